//! The coordinator's rules, without IO: state machines that take inputs
//! (what the cluster looks like now, a stage's answer, a failed send, a
//! cancellation, the current time) and give outputs (send this message to
//! that stage, stream this token, take this worker out of service, arm a
//! timer at this instant), in the manner of str0m. Nothing in here awaits,
//! touches a socket or reads the clock: the async shell (pipeline.rs, the
//! placer, the link readers) feeds inputs and carries out outputs, and the
//! tests drive the same machines with made-up time.

mod cluster;
mod peers;
mod placing;
mod plan;
mod request;
mod view;

#[cfg(test)]
mod cluster_tests;
#[cfg(test)]
mod peers_tests;
#[cfg(test)]
mod tests;

pub use cluster::{Cluster, ClusterConfig, ClusterInput, ClusterOutput};
pub use peers::{condition, runs_lost};
pub use plan::profiles;
pub use request::{Count, Input, Output, Request, RequestConfig};
pub use view::{ClusterView, Placement, StageView};

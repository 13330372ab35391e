//! The coordinator's rules, without IO: state machines that take inputs
//! and give outputs, in the manner of str0m. Nothing in here awaits,
//! touches a socket or reads the clock: the async shell (coord/mod.rs for
//! the cluster, pipeline.rs for each request) feeds inputs and carries out
//! outputs, and the tests drive the same machines with made-up time.
//!
//! - [`Cluster`] (`cluster.rs`): the cluster's state and its rules. Inputs: a
//!   peer joined or left, a link up (with its capabilities and generation)
//!   or down, a worker's message (calibration, telemetry, pause, resume, a
//!   `LoadShard`'s answer), a loss a request found, a failed send, a manual
//!   placement, the time. Outputs: link to a peer, send a message over a
//!   link of a generation (`Calibrate`, `LoadShard`), close a link, fail the
//!   runs on a lost worker, the state changed. It owns the peer table, the
//!   debounce, the placement being loaded, the active placement with its
//!   epoch and the retry after a failure.
//! - `approval.rs`: workers waiting for the operator's approval
//!   (`--approve-workers`): linked, neither calibrated nor placed.
//! - `claims.rs`: a worker's claims against what it shows (the bytes its
//!   loaded layers took against what they weigh).
//! - `plan.rs`: which placement to run (device profiles, manual or
//!   automatic, unchanged) and each stage's `next`/`prev`.
//! - `peers.rs`: what a worker's condition or loss means for placing again.
//! - `placing.rs`: the debounce and one round of `LoadShard` answers.
//! - [`Admission`] (`admission.rs`): at most `--parallel` requests run, the
//!   rest wait in arrival order in a bounded queue.
//! - [`Request`] (`request.rs`): one request from admission to its end
//!   (runs, chain and relays, step and stall timeouts, retries, recovery),
//!   seeing the cluster through [`ClusterView`] (`view.rs`).
//! - `spot.rs`: spot checks: which steps a request holds back to recompute
//!   on a trusted device, how the workers' token is judged against it, and
//!   whom a wrong one blames (the request evicts them and recovers).

mod admission;
mod approval;
mod claims;
mod cluster;
mod peers;
mod placing;
mod plan;
mod request;
mod spot;
mod view;

#[cfg(test)]
mod cluster_tests;
#[cfg(test)]
mod peers_tests;
#[cfg(test)]
mod tests;

pub use admission::{Admission, Admit};
pub use approval::PendingWorker;
pub use cluster::{Cluster, ClusterConfig, ClusterInput, ClusterOutput};
pub use peers::{condition, runs_lost};
pub use plan::profiles;
pub use request::{Count, Input, Output, Request, RequestConfig};
pub use spot::{SpotCheck, SpotConfig, Verdict, judge};
pub use view::{ClusterView, Placement, StageView, StepCost};

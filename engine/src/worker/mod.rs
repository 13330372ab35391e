//! What a worker runs, whatever carries its messages: the native `cairn worker`
//! (over str0m data channels) and the browser worker (over `RTCDataChannel`)
//! both feed the coordinator's messages to a [`StageServer`] and send back
//! what it answers.
//!
//! - [`Capabilities`]: what a peer advertises in `Hello` (JSON).
//! - [`StageServer`]: one loaded shard, its [`Route`] in a chain, a KV cache per request, and the
//!   `Forward` / `EndRequest` / `Calibrate` handlers.
//! - [`WorkerHost`]: what a worker does besides stepping, without I/O:
//!   `LoadShard` (checked into a [`LoadPlan`], loaded through a
//!   [`ShardSlot`]), `Close`, telemetry with the device's [`Condition`], and
//!   when to ask the coordinator to pause ([`PressureRule`]).
//! - [`calibrate`]: a short measured run on synthetic layers of the model's
//!   shape, so placement uses measured speed rather than a guess from a name.

mod calibrate;
mod capabilities;
mod host;
#[cfg(test)]
mod overlap_tests;
mod stage;
#[cfg(test)]
pub(crate) mod tests;

pub use calibrate::{calibrate, calibrate_devices};
pub use capabilities::{Capabilities, PeerKind, Role};
pub use host::{Condition, HostAction, LoadPlan, PressureRule, ShardSlot, WorkerHost};
pub use stage::{
    Outgoing, PREFILL_CHUNK, Pass, Route, StageServer, load_shard, load_stack, load_stack_split,
};

//! The coordinator's tamper-evident audit log (`<state dir>/audit.jsonl`):
//! who joined with which token and from where, who was admitted or refused,
//! tokens issued and revoked, placements, uses of the API keys (the scope
//! and the kind of route, never the key), and the coordinator's start and
//! stop. Each line is hash-chained to the one before ([`chain`]), written
//! off the request path ([`log`]), and checked by `cairn audit verify`.

pub mod chain;
pub mod log;

use serde::{Deserialize, Serialize};

pub use log::{AuditLog, AuditStats};

/// A stage of a placement, as the log records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRecord {
    pub peer: String,
    /// First and last layer, inclusive.
    pub first: usize,
    pub last: usize,
}

/// What happened. The `kind` names it in the line's `event` object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// `cairn serve` started with this setup (whether keys are set, never them).
    Start {
        version: String,
        listen: String,
        room: String,
        api_key: bool,
        read_key: bool,
        approve_workers: bool,
    },
    /// `cairn serve` stopped (Ctrl-C or SIGTERM); a log that ends without it ended in a crash or a kill.
    Stop,
    /// A peer joined the room with a valid token.
    Joined {
        peer: String,
        role: String,
        /// Unknown with an outside signaling server.
        token_id: Option<String>,
        addr: Option<String>,
    },
    /// The signaling server refused to let someone into the room.
    JoinRefused {
        reason: String,
        token_id: Option<String>,
        addr: Option<String>,
    },
    /// A peer left the room.
    Left {
        peer: String,
        token_id: Option<String>,
    },
    /// The coordinator took a worker's link: it may be placed.
    Admitted {
        peer: String,
        device: String,
        memory_budget_bytes: u64,
    },
    /// The coordinator refused a peer's link.
    Refused {
        peer: String,
        why: String,
    },
    /// The admin approved or rejected a worker (`--approve-workers`).
    Approval {
        peer: String,
        token_id: Option<String>,
        approved: bool,
    },
    /// A spot check caught a worker with a wrong result; it was taken out.
    Evicted {
        peer: String,
        token_id: Option<String>,
        why: String,
    },
    TokenIssued {
        token_id: String,
        expires_at: u64,
    },
    TokenRevoked {
        token_id: String,
        dropped: usize,
    },
    /// A placement was loaded and serves (empty `stages`: none serves now).
    Placement {
        epoch: u64,
        stages: Vec<StageRecord>,
    },
    /// A request that presented a key, or was refused for want of one.
    ApiKey {
        /// `admin`, `read`, or `none` (a missing or wrong key).
        scope: String,
        method: String,
        /// The kind of route (`inference`, `cluster`, `placement`, ...).
        route: String,
        status: u16,
    },
    /// The records before this one in the same file went to `previous`.
    Rotated {
        previous: String,
    },
    /// Records the writer had no room for (a burst faster than the disk).
    Dropped {
        records: u64,
    },
}

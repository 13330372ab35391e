//! The placer's rules without IO: when to place after a change (debounce),
//! and how loading a placement on its workers ends (every worker answered,
//! one failed or went away, or the time ran out).

use std::time::{Duration, Instant};

use cairn_signal::protocol::PeerId;

/// Changes arriving together (several workers joining) are placed once.
pub const DEBOUNCE: Duration = Duration::from_millis(200);
/// After a loss that left no placement: long enough to take in a second
/// worker lost at the same moment (a machine with several), short against
/// the requests' stall.
pub const URGENT_DEBOUNCE: Duration = Duration::from_millis(10);
/// The longest loading one placement may take before it counts as failed.
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(300);
/// What any load is given whatever its size (opening, planning, the
/// answer's way back).
pub const LOAD_BASE: Duration = Duration::from_secs(20);
/// The slowest fetch and upload a worker is allowed, in bytes a second: a
/// phone on Wi-Fi fetching its layers from the coordinator.
pub const LOAD_MIN_BYTES_PER_S: u64 = 2_000_000;
/// The fastest a load is ever counted on, whatever a link measured: past
/// the network, loading parses the file and uploads it to the device.
pub const LOAD_MAX_BYTES_PER_S: u64 = 10_000_000;
/// The share of a native worker's measured link speed a load is counted
/// on: the file comes over HTTP rather than the probed link, and is then
/// parsed and uploaded.
pub const LOAD_SPEED_SHARE: f64 = 0.25;

/// How long a worker may take to load `bytes` of weights: [`LOAD_BASE`]
/// plus those bytes at the rate its link's probe measured
/// (`measured_bytes_per_s`, taken at [`LOAD_SPEED_SHARE`]), never slower
/// than [`LOAD_MIN_BYTES_PER_S`] nor faster than [`LOAD_MAX_BYTES_PER_S`],
/// and never over [`LOAD_TIMEOUT`]. Without a measurement, the slowest
/// rate. A worker that never answers then holds up a small model's
/// placement for seconds, not minutes, and a fast link's large stage is
/// not given the slow link's minutes; a link that measures slow (or a
/// worker that slows its own probe) is given no more than no measurement.
pub fn load_timeout(bytes: u64, measured_bytes_per_s: Option<f64>) -> Duration {
    let rate = measured_bytes_per_s
        .filter(|b| b.is_finite() && *b > 0.0)
        .map_or(LOAD_MIN_BYTES_PER_S, |b| (b * LOAD_SPEED_SHARE) as u64)
        .clamp(LOAD_MIN_BYTES_PER_S, LOAD_MAX_BYTES_PER_S);
    (LOAD_BASE + Duration::from_secs(bytes / rate)).min(LOAD_TIMEOUT)
}

/// When the placer should look at the cluster next.
#[derive(Debug, Default)]
pub struct Debounce {
    due: Option<Instant>,
}

impl Debounce {
    /// Something changed at `now`; `urgent` when requests wait on a new
    /// placement (a worker holding layers was lost).
    pub fn poke(&mut self, now: Instant, urgent: bool) {
        let at = now + if urgent { URGENT_DEBOUNCE } else { DEBOUNCE };
        self.due = Some(match self.due {
            // A later change does not put off a placement already due.
            Some(due) => due.min(at),
            None => at,
        });
    }

    pub fn poll_timeout(&self) -> Option<Instant> {
        self.due
    }

    /// Whether it is time to place; the pokes so far are then used up.
    pub fn fire(&mut self, now: Instant) -> bool {
        match self.due {
            Some(due) if now >= due => {
                self.due = None;
                true
            }
            _ => false,
        }
    }
}

/// A placement being loaded: who still has to answer `LoadShard`.
#[derive(Debug)]
pub struct Loading {
    /// Each stage's worker with its answer once it came, in stage order.
    answers: Vec<(PeerId, Option<Result<(), String>>)>,
    deadline: Instant,
    timeout: Duration,
}

impl Loading {
    /// `LoadShard` went to `peers` (in stage order) at `now`; they have
    /// `timeout` to answer (the longest [`load_timeout`] of their stages).
    pub fn new(peers: Vec<PeerId>, now: Instant, timeout: Duration) -> Loading {
        Loading {
            answers: peers.into_iter().map(|p| (p, None)).collect(),
            deadline: now + timeout,
            timeout,
        }
    }

    /// `peer` answered (`ShardLoaded`, or an `Error` as its text); a
    /// second answer of the same worker is not one the load waits for.
    pub fn answer(&mut self, peer: &PeerId, result: Result<(), String>) {
        for (p, a) in &mut self.answers {
            if p == peer && a.is_none() {
                *a = Some(result);
                return;
            }
        }
    }

    /// Whether `peer` is a worker of this load that has not answered yet.
    pub fn waits_for(&self, peer: &PeerId) -> bool {
        self.answers.iter().any(|(p, a)| p == peer && a.is_none())
    }

    pub fn poll_timeout(&self) -> Instant {
        self.deadline
    }

    /// How the load ended, once it has: `Ok` when every worker loaded its
    /// layers, else the first failure in stage order. At or after the
    /// deadline a worker that has not answered has failed.
    pub fn outcome(&self, now: Instant) -> Option<Result<(), String>> {
        let late = now >= self.deadline;
        if !late && self.answers.iter().any(|(_, a)| a.is_none()) {
            return None;
        }
        for (peer, a) in &self.answers {
            let e = match a {
                Some(Ok(())) => continue,
                Some(Err(e)) => e.clone(),
                None => format!("no answer within {:?}", self.timeout),
            };
            return Some(Err(format!("{peer} could not load its layers: {e}")));
        }
        Some(Ok(()))
    }
}

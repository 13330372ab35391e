//! Which workers the operator has let in (`cairn serve --approve-workers`):
//! a worker's link that is not approved yet waits here, neither calibrated
//! nor placed, until the admin approves it (then it goes on as if it had
//! just linked) or rejects it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use cairn_engine::worker::Capabilities;
use cairn_signal::protocol::PeerId;

/// A worker linked and waiting for the operator.
#[derive(Clone, Debug)]
pub struct PendingWorker {
    pub caps: Capabilities,
    pub generation: u64,
    pub since: Instant,
}

#[derive(Debug, Default)]
pub struct Approval {
    required: bool,
    /// Approved peers (the shell approves a peer ahead of its link when it
    /// joined with a token approved before).
    approved: BTreeSet<PeerId>,
    pending: BTreeMap<PeerId, PendingWorker>,
}

impl Approval {
    pub fn new(required: bool) -> Approval {
        Approval {
            required,
            ..Approval::default()
        }
    }

    pub fn pending(&self) -> &BTreeMap<PeerId, PendingWorker> {
        &self.pending
    }

    /// A worker linked: its capabilities back when it may go on, `None`
    /// while it waits.
    pub fn admit(
        &mut self,
        peer: &PeerId,
        caps: Capabilities,
        generation: u64,
        now: Instant,
    ) -> Option<Capabilities> {
        if !self.required || self.approved.contains(peer) {
            return Some(caps);
        }
        self.pending.insert(
            peer.clone(),
            PendingWorker {
                caps,
                generation,
                since: now,
            },
        );
        None
    }

    /// The operator's decision on `peer`: the waiting link that may go on
    /// now, if any. An approval for a peer not linked yet holds for its link.
    pub fn decide(&mut self, peer: &PeerId, approved: bool) -> Option<PendingWorker> {
        let waiting = self.pending.remove(peer);
        if approved {
            self.approved.insert(peer.clone());
            waiting
        } else {
            self.approved.remove(peer);
            None
        }
    }

    /// `peer` left the room: its id never comes back (a rejoin gets a new
    /// one), so its approval goes too. Whether it was waiting.
    pub fn left(&mut self, peer: &PeerId) -> bool {
        self.approved.remove(peer);
        self.pending.remove(peer).is_some()
    }

    /// `peer`'s link of `generation` (any, when `None`) ended: whether it
    /// was waiting.
    pub fn gone(&mut self, peer: &PeerId, generation: Option<u64>) -> bool {
        let was_it = self
            .pending
            .get(peer)
            .is_some_and(|p| generation.is_none_or(|g| g == p.generation));
        if was_it {
            self.pending.remove(peer);
        }
        was_it
    }
}

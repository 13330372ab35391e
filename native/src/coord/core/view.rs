//! What the core sees of the cluster: the serving placement and which
//! workers are online. The shell builds one from its state whenever
//! anything may have changed.

use std::collections::BTreeSet;

use cairn_signal::protocol::PeerId;

/// One stage of a loaded placement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageView {
    pub peer: PeerId,
    pub start: usize,
    pub end: usize,
    /// The stage hands its output straight to the next stage's worker
    /// (`LoadShard::next`); when not, the coordinator relays it.
    pub direct: bool,
}

/// A placement that is loaded and serving.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub epoch: u64,
    pub stages: Vec<StageView>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterView {
    pub active: Option<Placement>,
    pub online: BTreeSet<PeerId>,
    /// Workers on devices the coordinator trusts (its own local worker):
    /// spot checks never blame them.
    pub trusted: BTreeSet<PeerId>,
    /// Why there is no placement, or what is being served (a request that
    /// waits in vain says it).
    pub message: String,
}

impl ClusterView {
    pub fn epoch(&self) -> Option<u64> {
        self.active.as_ref().map(|a| a.epoch)
    }

    /// A worker of `placement` that is no longer online, if any.
    pub fn gone<'a>(&self, placement: &'a Placement) -> Option<&'a PeerId> {
        placement
            .stages
            .iter()
            .map(|s| &s.peer)
            .find(|p| !self.online.contains(*p))
    }
}

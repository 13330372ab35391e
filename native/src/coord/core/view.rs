//! What the core sees of the cluster: the serving placement and which
//! workers are online. The shell builds one from its state whenever
//! anything may have changed.

use std::collections::BTreeSet;
use std::time::Duration;

use cairn_engine::placement::Prediction;
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
    /// What its workers' calibration predicts a step costs; none when
    /// nothing could be predicted (the step timeouts are then fixed).
    pub cost: Option<StepCost>,
}

/// What a placement's calibration (measured by the coordinator, screened)
/// predicts one step through all its stages takes, links included: the
/// step timeouts scale with it (`request::step_limit`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCost {
    /// One generated token.
    pub per_token: Duration,
    /// One prompt token, in a prefill.
    pub per_prompt_token: Duration,
}

impl StepCost {
    /// From the placer's prediction; none when it holds no usable number.
    pub fn from_prediction(p: &Prediction) -> Option<StepCost> {
        let usable = |s: f64| s.is_finite() && s > 0.0;
        if !usable(p.s_per_token) || !usable(p.prefill_s) || p.prompt_tokens == 0 {
            return None;
        }
        // Capped so that no prediction overflows a Duration; the step
        // timeout caps the limit far below anyway.
        let secs = |s: f64| Duration::from_secs_f64(s.min(3600.0));
        Some(StepCost {
            per_token: secs(p.s_per_token),
            per_prompt_token: secs(p.prefill_s / p.prompt_tokens as f64),
        })
    }

    /// A step over `rows` positions (the prompt and what was generated, for
    /// a run's first step; one after that).
    pub fn step(&self, rows: usize) -> Duration {
        let rows = u32::try_from(rows).unwrap_or(u32::MAX);
        self.per_token
            .max(self.per_prompt_token.saturating_mul(rows))
    }
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

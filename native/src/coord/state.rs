//! The cluster as the coordinator sees it: peers, their links and
//! telemetry, the placement, the requests in flight. Data only: the core
//! (`core::Cluster`) owns it and changes it, the dashboard and the request
//! shells read it; the links themselves stay with the shell.

use std::collections::BTreeMap;
use std::time::Instant;

use cairn_engine::placement::{DeviceCondition, Prediction, Stage, StageSplit};
use cairn_engine::protocol::{Calibration, Telemetry};
use cairn_engine::session::SessionStats;
use cairn_engine::worker::Capabilities;
use cairn_signal::protocol::PeerId;
use serde::Serialize;

use super::core::{Placement, StageView, StepCost};

/// What a peer is doing, as the dashboard shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerStatus {
    Calibrating,
    Idle,
    Loading,
    Computing,
    Throttled,
    Paused,
    Offline,
}

pub struct PeerState {
    pub caps: Capabilities,
    /// The coordinator's link to it as last measured (RTT, throughput,
    /// loss), copied in by the shell; none before the first copy.
    pub link: Option<SessionStats>,
    /// Bumped on every new link, so a dead link's reader cannot mark its
    /// successor offline.
    pub link_gen: u64,
    pub calibration: Option<Calibration>,
    pub telemetry: Option<Telemetry>,
    pub extra: serde_json::Value,
    pub paused: Option<String>,
    pub loading: bool,
    pub online: bool,
    pub joined: Instant,
    /// When it was lost; a peer offline for the core's `FORGET_AFTER`
    /// is forgotten (leaves `/api/cluster` and `/metrics`).
    pub offline_since: Option<Instant>,
}

impl PeerState {
    pub fn status(&self, layers: Option<(usize, usize)>) -> PeerStatus {
        if !self.online {
            PeerStatus::Offline
        } else if self.paused.is_some() {
            PeerStatus::Paused
        } else if self.loading {
            PeerStatus::Loading
        } else if self.calibration.is_none() {
            PeerStatus::Calibrating
        } else if self.throttled() {
            PeerStatus::Throttled
        } else if layers.is_some() && self.utilization() > 0.05 {
            PeerStatus::Computing
        } else {
            PeerStatus::Idle
        }
    }

    pub fn pressure(&self) -> Option<String> {
        self.extra
            .get("pressure")
            .and_then(|p| p.as_str())
            .map(str::to_owned)
    }

    pub fn throttled(&self) -> bool {
        matches!(self.pressure().as_deref(), Some("serious" | "critical"))
            || self.extra.get("throttled").and_then(|t| t.as_bool()) == Some(true)
    }

    pub fn utilization(&self) -> f64 {
        self.extra
            .get("utilization")
            .and_then(|u| u.as_f64())
            .unwrap_or(0.0)
    }

    pub fn battery(&self) -> (Option<f64>, Option<bool>) {
        let b = self.extra.get("battery");
        (
            b.and_then(|b| b.get("level")).and_then(|l| l.as_f64()),
            b.and_then(|b| b.get("charging")).and_then(|c| c.as_bool()),
        )
    }

    /// What placement weighs besides measured speed.
    pub fn condition(&self) -> DeviceCondition {
        super::core::condition(self.telemetry.as_ref(), self.paused.is_some())
    }

    pub fn background(&self) -> bool {
        self.extra.get("visibility").and_then(|v| v.as_str()) == Some("hidden")
    }
}

/// A placement that is loaded and serving.
#[derive(Clone)]
pub struct Active {
    pub epoch: u64,
    pub stages: Vec<ActiveStage>,
}

impl Active {
    /// What the core sees of it (the links stay with the shell), with what
    /// its calibration predicts (`State::prediction`, made when it was
    /// chosen).
    pub(crate) fn view(&self, prediction: Option<&Prediction>) -> Placement {
        Placement {
            cost: prediction.and_then(StepCost::from_prediction),
            epoch: self.epoch,
            stages: self
                .stages
                .iter()
                .map(|s| StageView {
                    peer: s.peer.clone(),
                    start: s.start,
                    end: s.end,
                    direct: s.direct,
                })
                .collect(),
        }
    }
}

#[derive(Clone)]
pub struct ActiveStage {
    pub peer: PeerId,
    /// Whether this stage's output goes straight to the next stage's worker
    /// (`LoadShard::next`); when not, the coordinator relays it.
    pub direct: bool,
    pub start: usize,
    pub end: usize,
    /// How a worker over several devices spreads the layers over them.
    pub split: StageSplit,
    /// The link (its generation) the stage was loaded over; its steps go
    /// over that link only, and fail once it is down.
    pub generation: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlacementStatus {
    /// Waiting for workers.
    Waiting,
    Placing,
    Ready,
    NoFit,
}

/// How a request is doing, for `/api/cluster` and the dashboard.
#[derive(Clone, Debug, Serialize)]
pub struct RequestView {
    pub id: String,
    pub state: &'static str,
    pub generated: usize,
    pub max_tokens: usize,
    pub recoveries: u32,
}

pub struct State {
    pub peers: BTreeMap<PeerId, PeerState>,
    /// A manual placement (`--placement`, `POST /api/placement`), by peer id.
    pub manual: Option<Vec<Stage>>,
    pub active: Option<Active>,
    /// The next epoch number; every loaded placement gets a new one.
    pub epoch: u64,
    pub status: PlacementStatus,
    pub message: String,
    /// The placement being loaded or served, and what it should give.
    pub target: Option<Vec<Stage>>,
    pub prediction: Option<Prediction>,
    pub requests: BTreeMap<u64, RequestView>,
    pub warnings: Vec<String>,
    /// Times a placement was computed (a join, a loss, a pause…).
    pub placements_computed: u64,
    /// Workers a spot check caught with a wrong result, and why: never
    /// linked or placed again in this run.
    pub evicted: BTreeMap<PeerId, String>,
}

impl State {
    pub fn new(manual: Option<Vec<Stage>>) -> State {
        State {
            peers: BTreeMap::new(),
            manual,
            active: None,
            epoch: 0,
            status: PlacementStatus::Waiting,
            message: "waiting for workers to join and calibrate".into(),
            target: None,
            prediction: None,
            requests: BTreeMap::new(),
            warnings: Vec::new(),
            placements_computed: 0,
            evicted: BTreeMap::new(),
        }
    }

    /// The layers `peer` serves in the active placement.
    pub fn layers_of(&self, peer: &PeerId) -> Option<(usize, usize)> {
        self.active
            .as_ref()?
            .stages
            .iter()
            .find(|s| &s.peer == peer)
            .map(|s| (s.start, s.end))
    }
}

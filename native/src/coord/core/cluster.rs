//! The cluster's rules without IO: who is a worker, what a worker's news
//! means, when to place and what, loading a placement on its workers and
//! making it active, and what a loss takes down. The shell feeds it what
//! happened ([`ClusterInput`]) and the time, and carries out what it asks
//! ([`ClusterOutput`]): send a message over a link, close one, fail the
//! runs on a lost worker, tell the watchers that something changed. It
//! owns [`State`], the data the dashboard and the requests read.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use cairn_engine::placement::{self, ModelCost, Stage, slowdown};
use cairn_engine::protocol::{LayerRange, Message};
use cairn_engine::session::SessionStats;
use cairn_engine::worker::{Capabilities, PeerKind, Role};
use cairn_signal::protocol::PeerId;
use tracing::{debug, info, warn};

use super::approval::{Approval, PendingWorker};
use super::claims::{judge_load, stage_bytes};
use super::peers::{Replace, after_condition, after_loss};
use super::placing::{Debounce, LOAD_BASE, Loading, load_timeout};
use super::plan::{chain_routes, describe, target, unchanged};
use crate::coord::state::{Active, ActiveStage, PeerState, PlacementStatus, State};

/// How long after a failed placement the cluster is looked at again.
pub const RETRY: Duration = Duration::from_secs(2);
/// How long a lost peer stays listed (as offline) before it is forgotten:
/// long enough to see that it went and for a restart to come back as the
/// same entry, short enough that peers coming and going cannot grow the
/// state without end.
pub const FORGET_AFTER: Duration = Duration::from_secs(300);
/// Warnings the dashboard keeps.
const MAX_WARNINGS: usize = 20;

/// What the cluster serves, as `Calibrate` and `LoadShard` tell workers.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// The model's `ModelConfig` as JSON (`Calibrate::config`).
    pub model_config: String,
    /// `gguf::model_id` of the model (`LoadShard::model_hash`).
    pub model_id: String,
    /// Where workers download the model (`LoadShard::source`).
    pub source: String,
    pub cost: ModelCost,
    /// Workers wait for the operator's approval before they are
    /// calibrated and placed (`--approve-workers`).
    pub approve_workers: bool,
}

/// What happened, as the shell tells the core.
#[derive(Debug)]
pub enum ClusterInput {
    /// A peer is in the room (`worker`: it says it is one).
    PeerJoined {
        peer: PeerId,
        worker: bool,
    },
    PeerLeft {
        peer: PeerId,
    },
    /// A link to `peer` is up; `capabilities` is what its hello carried.
    LinkUp {
        peer: PeerId,
        capabilities: String,
        generation: u64,
    },
    /// A link to `peer` ended: the one of `generation`, or whichever the
    /// mesh had (`None`).
    LinkDown {
        peer: PeerId,
        generation: Option<u64>,
        why: String,
    },
    /// A request found `peer` gone (a step that timed out, a failed send).
    Lost {
        peer: PeerId,
        why: String,
    },
    /// What a worker said that is not about one request's run.
    FromPeer {
        peer: PeerId,
        msg: Message,
    },
    /// A message the core asked to send over `peer`'s link of `generation`
    /// did not go out.
    SendFailed {
        peer: PeerId,
        generation: u64,
        why: String,
    },
    /// `--placement` or `POST /api/placement` (`None`: automatic again).
    SetManual(Option<Vec<Stage>>),
    /// The operator approved or rejected `peer` (`--approve-workers`).
    Approve {
        peer: PeerId,
        approved: bool,
    },
    /// A spot check caught `peer` with a wrong result: out for good.
    Evict {
        peer: PeerId,
        why: String,
    },
}

/// What the core asks the shell to do.
#[derive(Debug, PartialEq)]
pub enum ClusterOutput {
    /// Set up a link to `peer`.
    Connect(PeerId),
    /// Send `msg` over `peer`'s link of `generation` (no other).
    Send {
        peer: PeerId,
        generation: u64,
        msg: Message,
    },
    /// Close `peer`'s link of `generation`, telling it why.
    Close {
        peer: PeerId,
        generation: u64,
        reason: String,
    },
    /// Fail every run with a stage on `peer`.
    FailRuns { peer: PeerId, why: String },
    /// The state changed: wake whoever watches it (the dashboard, waiting
    /// requests).
    Changed,
}

/// A placement being loaded: its stages, each with its worker's link and
/// whether it is native, and who still has to answer.
#[derive(Debug)]
struct Round {
    stages: Vec<Stage>,
    workers: Vec<(PeerId, u64, bool)>,
    loading: Loading,
}

pub struct Cluster {
    cfg: ClusterConfig,
    state: State,
    debounce: Debounce,
    round: Option<Round>,
    /// A change seen while a placement loads: placed again once it ends.
    deferred: Option<Replace>,
    /// When to look again after a failed placement.
    retry_at: Option<Instant>,
    approval: Approval,
    out: VecDeque<ClusterOutput>,
}

impl Cluster {
    pub fn new(cfg: ClusterConfig, manual: Option<Vec<Stage>>) -> Cluster {
        Cluster {
            approval: Approval::new(cfg.approve_workers),
            cfg,
            state: State::new(manual),
            debounce: Debounce::default(),
            round: None,
            deferred: None,
            retry_at: None,
            out: VecDeque::new(),
        }
    }

    pub fn state(&self) -> &State {
        &self.state
    }

    /// Workers linked and waiting for the operator's approval.
    pub fn pending(&self) -> &std::collections::BTreeMap<PeerId, PendingWorker> {
        self.approval.pending()
    }

    /// For what the shell keeps in the state besides the core's rules (the
    /// requests' views).
    pub fn state_mut(&mut self) -> &mut State {
        &mut self.state
    }

    /// The shell's latest measurement of `peer`'s link of `generation`; one
    /// of an older link is not this peer's link any more.
    pub fn set_link(&mut self, peer: &PeerId, generation: u64, stats: SessionStats) {
        if let Some(p) = self.state.peers.get_mut(peer)
            && p.link_gen == generation
        {
            p.link = Some(stats);
        }
    }

    pub fn poll_output(&mut self) -> Option<ClusterOutput> {
        self.out.pop_front()
    }

    /// The next instant [`Self::handle_timeout`] has something to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [
            self.debounce.poll_timeout(),
            self.round.as_ref().map(|r| r.loading.poll_timeout()),
            self.retry_at,
            self.next_forget(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// When the longest-lost peer is to be forgotten.
    fn next_forget(&self) -> Option<Instant> {
        self.state
            .peers
            .values()
            .filter_map(|p| p.offline_since)
            .min()
            .map(|since| since + FORGET_AFTER)
    }

    /// Forgets peers lost for [`FORGET_AFTER`] (never one a placement or a
    /// load still names).
    fn forget_departed(&mut self, now: Instant) {
        let named = |peer: &PeerId| {
            self.state
                .active
                .as_ref()
                .is_some_and(|a| a.stages.iter().any(|s| &s.peer == peer))
                || self
                    .round
                    .as_ref()
                    .is_some_and(|r| r.workers.iter().any(|(p, _, _)| p == peer))
        };
        let gone: Vec<PeerId> = self
            .state
            .peers
            .iter()
            .filter(|(id, p)| {
                !p.online && p.offline_since.is_some_and(|t| now >= t + FORGET_AFTER) && !named(id)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for peer in &gone {
            info!(%peer, "forgetting a peer gone for {} s", FORGET_AFTER.as_secs());
            self.state.peers.remove(peer);
        }
        if !gone.is_empty() {
            self.out.push_back(ClusterOutput::Changed);
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        self.forget_departed(now);
        if let Some(r) = &self.round
            && now >= r.loading.poll_timeout()
        {
            self.check_round(now);
        }
        if self.retry_at.is_some_and(|at| now >= at) {
            self.retry_at = None;
            self.poke(Replace::Soon, now);
        }
        if self.round.is_none() && self.debounce.fire(now) {
            self.place(now);
        }
    }

    pub fn handle(&mut self, input: ClusterInput, now: Instant) {
        match input {
            ClusterInput::PeerJoined { peer, worker } => {
                if worker {
                    info!(%peer, "worker in the room; linking");
                    self.out.push_back(ClusterOutput::Connect(peer));
                }
            }
            ClusterInput::PeerLeft { peer } => {
                if self.approval.left(&peer) {
                    self.out.push_back(ClusterOutput::Changed);
                }
                if self.state.peers.contains_key(&peer) {
                    info!(%peer, "worker left the room");
                    self.lost(&peer, "left the room", now);
                }
            }
            ClusterInput::LinkUp {
                peer,
                capabilities,
                generation,
            } => self.link_up(peer, &capabilities, generation, now),
            ClusterInput::LinkDown {
                peer,
                generation,
                why,
            } => self.link_down(&peer, generation, &why, now),
            ClusterInput::Lost { peer, why } => self.lost(&peer, &why, now),
            ClusterInput::FromPeer { peer, msg } => self.worker_says(&peer, msg, now),
            ClusterInput::SendFailed {
                peer,
                generation,
                why,
            } => {
                debug!(%peer, error = %why, "a message to a worker was not sent");
                let loading_it = self.round.as_ref().is_some_and(|r| {
                    r.workers
                        .iter()
                        .any(|(p, g, _)| p == &peer && *g == generation)
                });
                if loading_it {
                    self.end_round(Err(format!("{peer}: {why}")), now);
                }
            }
            ClusterInput::SetManual(manual) => {
                self.state.manual = manual;
                self.poke(Replace::Soon, now);
            }
            ClusterInput::Evict { peer, why } => self.evict(peer, why, now),
            ClusterInput::Approve { peer, approved } => {
                match self.approval.decide(&peer, approved) {
                    Some(w) => {
                        info!(%peer, "worker approved");
                        self.admit(peer, w.caps, w.generation, now);
                    }
                    None => {
                        info!(%peer, approved, "operator's decision on a worker not waiting");
                        self.out.push_back(ClusterOutput::Changed);
                    }
                }
            }
        }
    }

    /// Takes `peer` out: its placement is redone without it, its link
    /// closed, and a link it makes again refused.
    fn evict(&mut self, peer: PeerId, why: String, now: Instant) {
        if self.state.evicted.contains_key(&peer) {
            return;
        }
        warn!(%peer, %why, "evicting a worker");
        self.state.evicted.insert(peer.clone(), why.clone());
        self.approval.left(&peer);
        let generation = self.state.peers.get(&peer).map(|p| p.link_gen);
        self.lost(&peer, &why, now);
        if let Some(generation) = generation {
            self.out.push_back(ClusterOutput::Close {
                peer,
                generation,
                reason: format!("evicted: {why}"),
            });
        }
        self.out.push_back(ClusterOutput::Changed);
    }

    fn link_up(&mut self, peer: PeerId, capabilities: &str, generation: u64, now: Instant) {
        if self.state.evicted.contains_key(&peer) {
            self.out.push_back(ClusterOutput::Close {
                peer,
                generation,
                reason: "evicted: a spot check found a wrong result".into(),
            });
            return;
        }
        let caps = match Capabilities::from_json(capabilities) {
            Ok(c) if c.role == Role::Worker => c,
            Ok(_) => {
                self.out.push_back(ClusterOutput::Close {
                    peer,
                    generation,
                    reason: "this coordinator only links to workers".into(),
                });
                return;
            }
            Err(e) => {
                warn!(%peer, error = %e, "a worker sent capabilities we cannot read; closing");
                self.out.push_back(ClusterOutput::Close {
                    peer,
                    generation,
                    reason: format!("unreadable capabilities: {e}"),
                });
                return;
            }
        };
        let Some(caps) = self.approval.admit(&peer, caps, generation, now) else {
            info!(%peer, "worker linked; waiting for the operator's approval");
            if self.state.active.is_none() {
                self.state.message = format!(
                    "{} worker(s) wait for the admin's approval (the dashboard, or POST /api/workers/ID/approve)",
                    self.approval.pending().len()
                );
            }
            self.out.push_back(ClusterOutput::Changed);
            return;
        };
        self.admit(peer, caps, generation, now);
    }

    /// A worker's link goes on to calibration (and then placement).
    fn admit(&mut self, peer: PeerId, caps: Capabilities, generation: u64, now: Instant) {
        info!(%peer, device = %caps.device.name, backend = %caps.backend, kind = ?caps.kind, "worker linked; calibrating");
        let entry = self
            .state
            .peers
            .entry(peer.clone())
            .or_insert_with(|| PeerState {
                caps: caps.clone(),
                link: None,
                link_gen: generation,
                calibration: None,
                telemetry: None,
                extra: serde_json::Value::Null,
                paused: None,
                loading: false,
                online: true,
                joined: now,
                offline_since: None,
            });
        entry.caps = caps;
        entry.link_gen = generation;
        entry.online = true;
        entry.offline_since = None;
        self.out.push_back(ClusterOutput::Changed);
        self.out.push_back(ClusterOutput::Send {
            peer,
            generation,
            msg: Message::Calibrate {
                config: self.cfg.model_config.clone(),
            },
        });
    }

    fn link_down(&mut self, peer: &PeerId, generation: Option<u64>, why: &str, now: Instant) {
        if self.approval.gone(peer, generation) {
            self.out.push_back(ClusterOutput::Changed);
            return;
        }
        let (current, online) = self.state.peers.get(peer).map_or((false, false), |p| {
            (generation.is_none_or(|g| g == p.link_gen), p.online)
        });
        if current && online {
            info!(%peer, error = %why, "worker link ended");
            self.lost(peer, why, now);
        } else if !online {
            // Already counted as lost: fail what was sent to it since.
            self.fail(peer, why, now);
        }
        // Else an older link of a peer that linked again: its successor stands.
    }

    /// A peer is gone (link down for good, or it left the room): drop the
    /// placement that uses it, then fail its runs, so requests that see the
    /// failure find the placement already being redone.
    fn lost(&mut self, peer: &PeerId, why: &str, now: Instant) {
        if let Some(p) = self.state.peers.get_mut(peer) {
            p.online = false;
            p.offline_since.get_or_insert(now);
        }
        let st = &mut self.state;
        let replace = after_loss(st.active.as_ref().map(|a| a.view(None)).as_ref(), peer);
        if replace == Replace::Now {
            warn!(%peer, %why, "a worker holding layers is gone; placing again");
            st.active = None;
            st.status = PlacementStatus::Placing;
            st.message = format!("{peer} was lost ({why}); placing again");
            st.warnings.push(format!("lost {peer}: {why}"));
            let n = st.warnings.len();
            if n > MAX_WARNINGS {
                st.warnings.drain(..n - MAX_WARNINGS);
            }
        }
        self.fail(peer, why, now);
        self.poke(replace, now);
    }

    /// Fails what waits on `peer`: the runs with a stage on it, and its
    /// part of the placement being loaded.
    fn fail(&mut self, peer: &PeerId, why: &str, now: Instant) {
        self.out.push_back(ClusterOutput::FailRuns {
            peer: peer.clone(),
            why: why.to_owned(),
        });
        if self
            .round
            .as_ref()
            .is_some_and(|r| r.loading.waits_for(peer))
        {
            self.answer(peer, Err(format!("{peer} went away: {why}")), now);
        }
    }

    fn worker_says(&mut self, peer: &PeerId, msg: Message, now: Instant) {
        match msg {
            Message::ShardLoaded {
                layers,
                weight_bytes,
                ..
            } => {
                let expected =
                    stage_bytes(&self.cfg.cost, layers.start as usize, layers.end as usize);
                match judge_load(expected, weight_bytes) {
                    Ok(()) => self.answer(peer, Ok(()), now),
                    Err(why) => {
                        let why = format!("its claims do not hold: {why}");
                        self.answer(peer, Err(why.clone()), now);
                        self.evict(peer.clone(), why, now);
                    }
                }
            }
            Message::Error { code, text } => {
                self.answer(peer, Err(format!("error {code}: {text}")), now);
            }
            Message::Calibration(c) => {
                info!(
                    %peer,
                    decode_ms_per_layer = c.decode_s_per_layer * 1e3,
                    call_ms = c.call_overhead_s * 1e3,
                    tensor_decode_ms_per_layer = c.tensor.map(|t| t.decode_s_per_layer * 1e3),
                    tensor_call_ms = c.tensor.map(|t| t.call_overhead_s * 1e3),
                    "worker calibrated"
                );
                if let Some(p) = self.state.peers.get_mut(peer) {
                    p.calibration = Some(c);
                }
                self.poke(Replace::Soon, now);
            }
            Message::Telemetry(t) => {
                // The typed report as the JSON object the dashboard reads
                // its fields from.
                let extra = serde_json::to_value(&t).unwrap_or(serde_json::Value::Null);
                let mut replace = Replace::No;
                if let Some(p) = self.state.peers.get_mut(peer) {
                    let was = p.condition();
                    p.extra = extra;
                    p.telemetry = Some(*t);
                    let is = p.condition();
                    replace = after_condition(&was, &is);
                    if replace != Replace::No {
                        let (was, is) = (slowdown(&was), slowdown(&is));
                        info!(%peer, was, now = is, "a worker's condition changed; placing again");
                    }
                }
                self.poke(replace, now);
            }
            Message::Pause { reason } => {
                info!(%peer, %reason, "worker pausing");
                if let Some(p) = self.state.peers.get_mut(peer) {
                    p.paused = Some(reason);
                }
                self.poke(Replace::Soon, now);
            }
            Message::Resume => {
                info!(%peer, "worker resumed");
                if let Some(p) = self.state.peers.get_mut(peer) {
                    p.paused = None;
                }
                self.poke(Replace::Soon, now);
            }
            other => debug!(%peer, kind = other.kind(), "unexpected message from a worker"),
        }
    }

    /// Something placement weighs may have changed; the watchers hear of
    /// it either way. While a placement loads, the change waits for it.
    fn poke(&mut self, replace: Replace, now: Instant) {
        if replace != Replace::No {
            if self.round.is_some() {
                self.deferred = Some(match (self.deferred, replace) {
                    (Some(Replace::Now), _) | (_, Replace::Now) => Replace::Now,
                    _ => Replace::Soon,
                });
            } else {
                replace.poke(&mut self.debounce, now);
            }
        }
        self.out.push_back(ClusterOutput::Changed);
    }

    /// The debounce fired: choose a placement and load it unless it is
    /// the one served.
    fn place(&mut self, now: Instant) {
        let wanted = match target(&mut self.state, &self.cfg.cost) {
            Ok(t) => t,
            Err(msg) => {
                warn!(%msg, "no placement");
                let st = &mut self.state;
                if st.active.is_none() {
                    st.status = if st.peers.values().any(|p| p.online) {
                        PlacementStatus::NoFit
                    } else {
                        PlacementStatus::Waiting
                    };
                    st.message = msg;
                    st.target = None;
                    st.prediction = None;
                }
                self.out.push_back(ClusterOutput::Changed);
                return;
            }
        };
        if !unchanged(self.state.active.as_ref(), &wanted) {
            self.load(wanted, now);
        }
        self.out.push_back(ClusterOutput::Changed);
    }

    /// Sends `LoadShard` to each stage's worker; the placement becomes
    /// active once every one has answered.
    fn load(&mut self, stages: Vec<Stage>, now: Instant) {
        let st = &mut self.state;
        st.active = None;
        st.status = PlacementStatus::Placing;
        st.message = format!("loading {}", describe(&stages));
        st.target = Some(stages.clone());
        st.prediction =
            placement::evaluate(&super::plan::profiles(st), &self.cfg.cost, &stages, 64).ok();
        let mut workers = Vec::new();
        for s in &stages {
            let found = st
                .peers
                .iter()
                .find(|(id, _)| id.to_string() == s.device)
                .ok_or_else(|| format!("{} is not in the cluster", s.device))
                .and_then(|(id, p)| {
                    p.online
                        .then(|| (id.clone(), p.link_gen, p.caps.kind == PeerKind::Native))
                        .ok_or_else(|| format!("{} has no link", s.device))
                });
            match found {
                Ok(w) => workers.push(w),
                Err(msg) => return self.failed(msg, now),
            }
        }
        for (peer, ..) in &workers {
            if let Some(p) = self.state.peers.get_mut(peer) {
                p.loading = true;
            }
        }
        let routes = chain_routes(
            &workers
                .iter()
                .zip(&stages)
                .map(|((peer, _, native), s)| (peer.to_string(), s, *native))
                .collect::<Vec<_>>(),
        );
        info!(placement = %describe(&stages), "loading placement");
        for (((peer, generation, _), s), (next, prev)) in workers.iter().zip(&stages).zip(routes) {
            self.out.push_back(ClusterOutput::Send {
                peer: peer.clone(),
                generation: *generation,
                msg: Message::LoadShard {
                    model_hash: self.cfg.model_id.clone(),
                    layers: LayerRange {
                        start: s.start as u32,
                        end: s.end as u32,
                    },
                    source: self.cfg.source.clone(),
                    next,
                    prev,
                    split: s.split,
                },
            });
        }
        let cost = &self.cfg.cost;
        // Each stage at its own worker's measured speed; browsers' loads are bound by their
        // device more than their link, so they get the slowest rate.
        let timeout = workers
            .iter()
            .zip(&stages)
            .map(|((peer, _, native), s)| {
                let measured = self
                    .state
                    .peers
                    .get(peer)
                    .filter(|_| *native)
                    .and_then(|p| p.link.as_ref())
                    .and_then(|l| l.throughput_bytes_per_s);
                load_timeout(stage_bytes(cost, s.start, s.end), measured)
            })
            .max()
            .unwrap_or(LOAD_BASE);
        let loading = Loading::new(
            workers.iter().map(|(p, ..)| p.clone()).collect(),
            now,
            timeout,
        );
        self.round = Some(Round {
            stages,
            workers,
            loading,
        });
    }

    /// `peer` answered `LoadShard` (or went away before it did).
    fn answer(&mut self, peer: &PeerId, result: Result<(), String>, now: Instant) {
        match &mut self.round {
            Some(r) if r.loading.waits_for(peer) => {
                r.loading.answer(peer, result);
                if let Some(p) = self.state.peers.get_mut(peer) {
                    p.loading = false;
                }
                self.check_round(now);
            }
            _ => {
                if let Err(e) = result {
                    warn!(%peer, error = %e, "worker reported an error");
                }
            }
        }
    }

    fn check_round(&mut self, now: Instant) {
        if let Some(outcome) = self.round.as_ref().and_then(|r| r.loading.outcome(now)) {
            self.end_round(outcome, now);
        }
    }

    /// The round in flight is over: activate it or say why not.
    fn end_round(&mut self, outcome: Result<(), String>, now: Instant) {
        let Some(round) = self.round.take() else {
            return;
        };
        for (peer, ..) in &round.workers {
            if let Some(p) = self.state.peers.get_mut(peer) {
                p.loading = false;
            }
        }
        // A worker may have gone while the others loaded.
        let outcome = outcome.and_then(|()| {
            let all_online = round
                .workers
                .iter()
                .all(|(p, ..)| self.state.peers.get(p).is_some_and(|p| p.online));
            if all_online {
                Ok(())
            } else {
                Err("a worker went away while loading".into())
            }
        });
        match outcome {
            Ok(()) => self.activate(round),
            Err(msg) => self.failed(msg, now),
        }
        if let Some(replace) = self.deferred.take() {
            replace.poke(&mut self.debounce, now);
        }
    }

    fn activate(&mut self, round: Round) {
        let st = &mut self.state;
        st.epoch += 1;
        let epoch = st.epoch;
        let n = round.workers.len();
        st.active = Some(Active {
            epoch,
            stages: round
                .workers
                .iter()
                .zip(&round.stages)
                .enumerate()
                .map(|(i, ((peer, generation, native), s))| ActiveStage {
                    peer: peer.clone(),
                    start: s.start,
                    end: s.end,
                    split: s.split,
                    generation: *generation,
                    direct: *native && round.workers[(i + 1) % n].2,
                })
                .collect(),
        });
        st.status = PlacementStatus::Ready;
        st.message = format!("serving: {}", describe(&round.stages));
        info!(epoch, placement = %describe(&round.stages), "placement ready");
        self.out.push_back(ClusterOutput::Changed);
    }

    /// Placing failed: say why, and look again after [`RETRY`].
    fn failed(&mut self, msg: String, now: Instant) {
        warn!(%msg, "placement failed; trying again");
        self.state.status = PlacementStatus::NoFit;
        self.state.message = msg;
        self.retry_at = Some(now + RETRY);
        self.out.push_back(ClusterOutput::Changed);
    }
}

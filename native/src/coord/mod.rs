//! The coordinator: tracks the cluster, places layers on workers, runs
//! requests through the stages, and recovers when a worker goes away.
//!
//! Topology is a chain where links allow: the coordinator sends a request's
//! prompt to the first stage, each stage hands its output to the next over a
//! worker-to-worker link, and the last stage feeds each sampled token back
//! to the first while telling the coordinator, which streams it. A hop with
//! no direct link (a browser's, or one not up yet) goes through the
//! coordinator, which relays it (docs/architecture.md). Everything that changes the cluster
//! (a link up or down, a peer leaving, telemetry, a pause, a manual
//! placement) updates [`State`] and, where it matters, wakes the placer,
//! which loads a new placement between tokens; requests notice the new epoch
//! and rebuild their KV caches by prefilling what they have so far.
//!
//! The rules of a request's runs and of the placer's timing live in
//! [`core`], as state machines without IO that the tasks here drive.

pub mod api;
mod core;
mod model;
mod pipeline;
mod placer;
pub mod state;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use cairn_engine::placement::{Stage, slowdown};
use cairn_engine::protocol::{Message, error_code};
use cairn_engine::worker::{Capabilities, Role as CapRole};
use cairn_signal::Role;
use cairn_signal::protocol::PeerId;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tracing::{debug, info, warn};

use crate::link::{Link, LinkConfig, LinkError, Mesh, MeshEvent};
pub use model::ServedModel;
pub use pipeline::{FinishReason, GenEvent, GenRequest};
use state::{PeerState, State};

/// How the coordinator is set up.
#[derive(Clone, Debug)]
pub struct CoordinatorOptions {
    pub model_path: PathBuf,
    pub signal_url: String,
    pub room: String,
    pub token: String,
    /// This coordinator's HTTP base URL as workers and browsers reach it
    /// (model downloads, the join page).
    pub public_url: String,
    /// The URL a browser opens to join (shown on the dashboard).
    pub join_url: Option<String>,
    pub link: LinkConfig,
    /// Context positions a request may use (prompt and generated).
    pub ctx: usize,
    /// Requests served at once (KV caches are budgeted for this many).
    pub parallel: usize,
    pub manual: Option<Vec<Stage>>,
    /// Bearer token the API requires, if any.
    pub api_key: Option<String>,
    /// How long a request waits for a placement before it fails.
    pub wait_timeout: Duration,
    /// How long one stage may take to answer one step before it counts as lost.
    pub step_timeout: Duration,
}

/// A stage's answer to one `Forward`, or why there is none.
pub(crate) type StageReply = Result<Message, StageFailure>;

#[derive(Clone, Debug)]
pub(crate) enum StageFailure {
    /// The worker went away (link down, left the room, timed out).
    Lost(String),
    /// The worker refused the step (`RequestError`): the request itself is at fault.
    Refused { code: u16, text: String },
}

/// A request's current run: what its stages say about it goes to `events`.
struct Pending {
    seq: u32,
    /// The run's stages; a loss of any fails the run.
    peers: Vec<PeerId>,
    /// Each answer with the `seq` of the run it belongs to.
    events: mpsc::UnboundedSender<(PeerId, u32, StageReply)>,
}

/// Shared by the event loop, the placer, the request tasks and the API.
pub struct Shared {
    pub opts: CoordinatorOptions,
    pub model: ServedModel,
    pub local_id: PeerId,
    state: Mutex<State>,
    /// Bumped on every change of the state (the dashboard's stream and
    /// waiting requests watch it).
    changed: watch::Sender<u64>,
    replace: Notify,
    /// Set with `replace` when a worker holding layers is lost: requests
    /// wait on the new placement, so it skips the debounce.
    urgent: std::sync::atomic::AtomicBool,
    pending: Mutex<HashMap<u64, Pending>>,
    loads: Mutex<HashMap<PeerId, oneshot::Sender<Result<(), String>>>>,
    next_request: AtomicU64,
    pub metrics: pipeline::Metrics,
    pub started: Instant,
}

impl Shared {
    pub fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn touch(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Asks the placer to look at the cluster again.
    pub fn replace(&self) {
        self.replace.notify_one();
        self.touch();
    }

    /// Like [`Self::replace`], for a change that leaves requests without a
    /// placement: placed at once rather than after the debounce.
    fn replace_now(&self) {
        self.urgent.store(true, Ordering::Relaxed);
        self.replace();
    }

    pub fn set_manual(&self, manual: Option<Vec<Stage>>) {
        self.state().manual = manual;
        self.replace();
    }

    fn request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// Fails every run that has a stage on `peer`.
    fn fail_pending(&self, peer: &PeerId, why: &str) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let ids = core::runs_lost(pending.iter().map(|(id, p)| (*id, &p.peers[..])), peer);
        for id in ids {
            if let Some(p) = pending.remove(&id) {
                let _ =
                    p.events
                        .send((peer.clone(), p.seq, Err(StageFailure::Lost(why.to_owned()))));
            }
        }
        let mut loads = self.loads.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(tx) = loads.remove(peer) {
            let _ = tx.send(Err(format!("{peer} went away: {why}")));
        }
    }

    /// A peer is gone (link down for good, or it left the room): drop the
    /// placement that uses it, then fail its waiting steps, so requests that
    /// see the failure find the placement already being redone.
    fn peer_lost(&self, peer: &PeerId, why: &str) {
        let replace = {
            let mut st = self.state();
            if let Some(p) = st.peers.get_mut(peer) {
                p.online = false;
                p.sender = None;
            }
            let replace = core::after_loss(st.active.as_ref().map(|a| a.view()).as_ref(), peer);
            if replace == core::Replace::Now {
                warn!(%peer, %why, "a worker holding layers is gone; placing again");
                st.active = None;
                st.status = state::PlacementStatus::Placing;
                st.message = format!("{peer} was lost ({why}); placing again");
                st.warnings.push(format!("lost {peer}: {why}"));
                let n = st.warnings.len();
                if n > 20 {
                    st.warnings.drain(..n - 20);
                }
            }
            replace
        };
        self.fail_pending(peer, why);
        match replace {
            core::Replace::Now => self.replace_now(),
            core::Replace::Soon | core::Replace::No => self.replace(),
        }
    }
}

/// A running coordinator.
#[derive(Clone)]
pub struct Coordinator {
    pub shared: Arc<Shared>,
}

impl Coordinator {
    /// Loads the model's metadata, joins the room and starts the event loop
    /// and the placer.
    pub async fn start(opts: CoordinatorOptions) -> Result<Coordinator> {
        let model = ServedModel::open(&opts.model_path, opts.ctx, opts.parallel)?;
        let mut link = opts.link.clone();
        // Browser workers answer our offers and learn our STUN/TURN servers from the room.
        link.share_ice_servers = true;
        link.capabilities = serde_json::json!({
            "role": CapRole::Coordinator,
            "version": env!("CARGO_PKG_VERSION"),
        })
        .to_string();
        let mesh = Mesh::join(&opts.signal_url, &opts.room, &opts.token, link)
            .await
            .with_context(|| format!("joining room '{}' at {}", opts.room, opts.signal_url))?;
        let local_id = mesh.local_id().clone();
        info!(peer = %local_id, room = %opts.room, model = %model.name, "coordinator joined");
        let manual = opts.manual.clone();
        let shared = Arc::new(Shared {
            opts,
            model,
            local_id,
            state: Mutex::new(State::new(manual)),
            changed: watch::channel(0).0,
            replace: Notify::new(),
            urgent: std::sync::atomic::AtomicBool::new(false),
            pending: Mutex::new(HashMap::new()),
            loads: Mutex::new(HashMap::new()),
            next_request: AtomicU64::new(1),
            metrics: pipeline::Metrics::default(),
            started: Instant::now(),
        });
        tokio::spawn(event_loop(shared.clone(), mesh));
        tokio::spawn(placer::run(shared.clone()));
        Ok(Coordinator { shared })
    }
}

async fn event_loop(shared: Arc<Shared>, mut mesh: Mesh) {
    let mut link_gen = 0u64;
    while let Some(event) = mesh.next_event().await {
        match event {
            MeshEvent::PeerJoined(p) => {
                if p.role == Role::Worker {
                    info!(peer = %p.peer_id, "worker in the room; linking");
                    mesh.connect(&p.peer_id);
                }
            }
            MeshEvent::PeerMeta(_) | MeshEvent::Signal { .. } => {}
            MeshEvent::PeerLeft(peer) => {
                let known = shared.state().peers.contains_key(&peer);
                if known {
                    info!(%peer, "worker left the room");
                    shared.peer_lost(&peer, "left the room");
                }
            }
            MeshEvent::LinkUp(link) => {
                link_gen += 1;
                on_link_up(&shared, link, link_gen);
            }
            MeshEvent::LinkDown { peer, error } => {
                debug!(%peer, %error, "link down");
                let known_online = shared.state().peers.get(&peer).is_some_and(|p| p.online);
                if known_online {
                    shared.peer_lost(&peer, &error.to_string());
                } else {
                    shared.fail_pending(&peer, &error.to_string());
                }
            }
            MeshEvent::SignalClosed => {
                warn!("the signaling session ended; no new workers can join");
            }
        }
    }
}

fn on_link_up(shared: &Arc<Shared>, link: Link, generation: u64) {
    let peer = link.peer().clone();
    let caps = match Capabilities::from_json(&link.remote_hello().capabilities) {
        Ok(c) if c.role == CapRole::Worker => c,
        Ok(_) => {
            link.close("this coordinator only links to workers");
            return;
        }
        Err(e) => {
            warn!(%peer, error = %e, "a worker sent capabilities we cannot read; closing");
            link.close(&format!("unreadable capabilities: {e}"));
            return;
        }
    };
    info!(%peer, device = %caps.device.name, backend = %caps.backend, kind = ?caps.kind, "worker linked; calibrating");
    let sender = link.sender();
    {
        let mut st = shared.state();
        let entry = st.peers.entry(peer.clone()).or_insert_with(|| PeerState {
            caps: caps.clone(),
            sender: None,
            stats: None,
            link_gen: 0,
            calibration: None,
            telemetry: None,
            extra: serde_json::Value::Null,
            paused: None,
            loading: false,
            online: true,
            joined: Instant::now(),
        });
        entry.caps = caps;
        entry.sender = Some(sender.clone());
        entry.stats = Some(link.stats_watch());
        entry.link_gen = generation;
        entry.online = true;
    }
    shared.touch();
    let config = serde_json::to_string(&shared.model.config).unwrap_or_default();
    tokio::spawn(async move {
        if let Err(e) = sender.send(Message::Calibrate { config }).await {
            debug!(error = %e, "calibration request not sent");
        }
    });
    tokio::spawn(read_link(shared.clone(), link, generation));
}

/// Routes what a worker says to whoever waits for it.
async fn read_link(shared: Arc<Shared>, mut link: Link, generation: u64) {
    let peer = link.peer().clone();
    let end: LinkError = loop {
        let m = match link.recv().await {
            Ok(m) => m,
            Err(e) => break e,
        };
        match m {
            Message::Token { request, seq, .. }
            | Message::Activations { request, seq, .. }
            | Message::RequestError { request, seq, .. } => {
                let run = shared
                    .pending
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&request)
                    .filter(|p| p.seq == seq && p.peers.contains(&peer))
                    .map(|p| p.events.clone());
                match run {
                    Some(events) => {
                        let reply = match m {
                            Message::RequestError { code, text, .. } => {
                                Err(StageFailure::Refused { code, text })
                            }
                            other => Ok(other),
                        };
                        let _ = events.send((peer.clone(), seq, reply));
                    }
                    None => {
                        debug!(%peer, request, seq, kind = m.kind(), "an answer nobody waits for (a run given up on)")
                    }
                }
            }
            Message::ShardLoaded { .. } | Message::Error { .. } => {
                let result = match m {
                    Message::Error { code, text } => Err(format!("error {code}: {text}")),
                    _ => Ok(()),
                };
                let waiter = shared
                    .loads
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&peer);
                match waiter {
                    Some(tx) => {
                        let _ = tx.send(result);
                    }
                    None => {
                        if let Err(e) = result {
                            warn!(%peer, error = %e, "worker reported an error");
                        }
                    }
                }
            }
            Message::Calibration(c) => {
                info!(%peer, decode_ms_per_layer = c.decode_s_per_layer * 1e3, "worker calibrated");
                if let Some(p) = shared.state().peers.get_mut(&peer) {
                    p.calibration = Some(c);
                }
                shared.replace();
            }
            Message::Telemetry(t) => {
                // The typed report as the JSON object the state and the
                // dashboard read their fields from.
                let extra = serde_json::to_value(&t).unwrap_or(serde_json::Value::Null);
                let mut st = shared.state();
                if let Some(p) = st.peers.get_mut(&peer) {
                    let was = p.condition();
                    p.extra = extra;
                    p.telemetry = Some(*t);
                    let now = p.condition();
                    if core::after_condition(&was, &now) != core::Replace::No {
                        let (was, now) = (slowdown(&was), slowdown(&now));
                        info!(%peer, was, now, "a worker's condition changed; placing again");
                        drop(st);
                        shared.replace();
                        continue;
                    }
                }
                drop(st);
                shared.touch();
            }
            Message::Pause { reason } => {
                info!(%peer, %reason, "worker pausing");
                if let Some(p) = shared.state().peers.get_mut(&peer) {
                    p.paused = Some(reason);
                }
                shared.replace();
            }
            Message::Resume => {
                info!(%peer, "worker resumed");
                if let Some(p) = shared.state().peers.get_mut(&peer) {
                    p.paused = None;
                }
                shared.replace();
            }
            other => debug!(%peer, kind = other.kind(), "unexpected message from a worker"),
        }
    };
    let (current, online) = shared
        .state()
        .peers
        .get(&peer)
        .map_or((false, false), |p| (p.link_gen == generation, p.online));
    if current && online {
        info!(%peer, error = %end, "worker link ended");
        shared.peer_lost(&peer, &end.to_string());
    } else if !online {
        // Already counted as lost: fail what was sent to it since.
        shared.fail_pending(&peer, &end.to_string());
    }
}

/// The request-failed error code a stage uses when the request is at fault.
pub(crate) fn is_request_fault(code: u16) -> bool {
    code == error_code::BAD_REQUEST
}

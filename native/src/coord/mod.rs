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
//! placement) goes to the cluster's core ([`core::Cluster`]), which updates
//! [`State`] and, where it matters, places again and loads the new placement
//! between tokens; requests notice the new epoch and rebuild their KV caches
//! by prefilling what they have so far.
//!
//! The rules live in [`core`], as state machines without IO: the cluster's
//! (links, workers' news, placing, loading, losses) and a request's runs.
//! This module is their shell: it holds the links, feeds the core what the
//! mesh and the links say and the time, and carries out what it asks.

pub mod api;
mod core;
pub mod join;
mod model;
mod pipeline;
pub mod share;
pub mod state;
mod verify;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use cairn_engine::placement::Stage;
use cairn_engine::protocol::{Message, error_code};
use cairn_engine::worker::Role as CapRole;
use cairn_signal::Role;
use cairn_signal::protocol::PeerId;
use tokio::sync::{Notify, mpsc, watch};
use tracing::{debug, info, warn};

pub use self::core::SpotConfig;
use self::core::{Cluster, ClusterConfig, ClusterInput, ClusterOutput};
use crate::audit::{AuditLog, Event, StageRecord};
use crate::link::{Link, LinkConfig, LinkError, LinkSender, LinkStats, Mesh, MeshEvent};
pub use model::ServedModel;
pub use pipeline::{FinishReason, GenEvent, GenRequest};
use state::State;

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
    /// The URL a browser opens to join (shown to the admin on the
    /// dashboard), when it is fixed (an outside signaling server's token).
    pub join_url: Option<String>,
    /// The embedded signaling server's join tokens; the join URL comes from
    /// here when set.
    pub join_tokens: Option<Arc<join::JoinTokens>>,
    pub link: LinkConfig,
    /// Context positions a request may use (prompt and generated).
    pub ctx: usize,
    /// Requests served at once (KV caches are budgeted for this many).
    pub parallel: usize,
    pub manual: Option<Vec<Stage>>,
    /// The admin key the API requires, if any (`api::auth`).
    pub api_key: Option<String>,
    /// A key that may only read the cluster's state (dashboards, metrics).
    pub read_key: Option<String>,
    /// Lets a worker fetch the model file without a key: put in the URL
    /// `LoadShard` names.
    pub model_cap: Option<String>,
    /// Origins whose pages may call the API from a browser (CORS); none by
    /// default.
    pub allow_origins: Vec<String>,
    /// How long a request waits for a placement before it fails.
    pub wait_timeout: Duration,
    /// How long one stage may take to answer one step before it counts as lost.
    pub step_timeout: Duration,
    /// Where joins, admissions, placements and key uses are recorded.
    pub audit: Arc<AuditLog>,
    /// Workers wait for the admin's approval before they are placed.
    pub approve_workers: bool,
    /// Who joined the embedded signaling server with which token, from where.
    pub sessions: Option<Arc<join::Sessions>>,
    /// Which steps are recomputed on the coordinator's own engine
    /// (`--spot-check-rate`, `--spot-check-tolerance`).
    pub spot: SpotConfig,
    /// The id of the token `cairn serve`'s own local worker joins with:
    /// workers joined with it are on this machine and never suspected.
    pub trusted_token: Option<String>,
    /// The engine options the spot checks' trusted (cpu) device opens with.
    pub engine: cairn_engine::EngineOptions,
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

/// A link the shell holds for the core, which knows it by peer and
/// generation.
struct LinkEntry {
    generation: u64,
    sender: LinkSender,
    stats: watch::Receiver<LinkStats>,
}

/// Shared by the event loop, the core's timer task, the request tasks and
/// the API.
pub struct Shared {
    pub opts: CoordinatorOptions,
    pub model: ServedModel,
    /// Our id in the room; a new one after each rejoin.
    local_id: Mutex<PeerId>,
    cluster: Mutex<Cluster>,
    /// The links the core's outputs go over, by peer (its latest link).
    links: Mutex<HashMap<PeerId, LinkEntry>>,
    /// Bumped on every change of the state (the dashboard's stream and
    /// waiting requests watch it).
    changed: watch::Sender<u64>,
    /// Wakes the timer task: the core's next deadline may have moved.
    rearm: Notify,
    /// What the shell learns after the fact (a send that failed), for the
    /// timer task to feed to the core.
    feedback: mpsc::UnboundedSender<ClusterInput>,
    pending: Mutex<HashMap<u64, Pending>>,
    next_request: AtomicU64,
    pub metrics: pipeline::Metrics,
    /// Which requests run and which wait (`--parallel`).
    pub queue: pipeline::Queue,
    pub started: Instant,
    /// Whether the coordinator is still in its room (its signaling session
    /// is open): without it no worker can join or link again.
    in_room: std::sync::atomic::AtomicBool,
    /// The epoch of the placement last recorded in the audit log (`None`:
    /// none serving).
    audited_epoch: Mutex<Option<u64>>,
    /// The trusted device spot checks recompute on (none when they are off).
    verifier: Option<Arc<verify::Verifier>>,
}

/// The cluster's state, borrowed from the core for reading (and for the
/// requests' views, which the request tasks keep).
pub struct StateGuard<'a>(MutexGuard<'a, Cluster>);

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;

    fn deref(&self) -> &State {
        self.0.state()
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.0.state_mut()
    }
}

impl Shared {
    /// Our id in the room now.
    pub fn local_id(&self) -> PeerId {
        self.local_id
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The URL a worker joins with: a fresh short-lived token's when the
    /// tokens are this coordinator's, else the fixed one, if any.
    pub fn join_url(&self) -> Option<String> {
        match &self.opts.join_tokens {
            Some(t) => Some(t.current_url()),
            None => self.opts.join_url.clone(),
        }
    }

    /// The core, with each peer's link measurements copied in.
    fn cluster(&self) -> MutexGuard<'_, Cluster> {
        let mut cluster = self.cluster.lock().unwrap_or_else(PoisonError::into_inner);
        let links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        for (peer, l) in links.iter() {
            let stats = l.stats.borrow().session.clone();
            cluster.set_link(peer, l.generation, stats);
        }
        cluster
    }

    /// Whether the cluster can serve a request now, for `/healthz`: the
    /// coordinator is in its room and a placement is loaded.
    pub fn health(&self) -> Result<(), String> {
        if !self.in_room.load(Ordering::Relaxed) {
            return Err("the coordinator is out of its room (its signaling session ended)".into());
        }
        let st = self.state();
        if st.status == state::PlacementStatus::Ready && st.active.is_some() {
            Ok(())
        } else {
            Err(format!("no placement can serve: {}", st.message))
        }
    }

    pub fn state(&self) -> StateGuard<'_> {
        StateGuard(self.cluster())
    }

    pub fn touch(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub fn set_manual(&self, manual: Option<Vec<Stage>>) {
        self.input(ClusterInput::SetManual(manual));
    }

    fn request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether `peer` joined with the local worker's token.
    fn trusted(&self, peer: &PeerId) -> bool {
        match (&self.opts.trusted_token, &self.opts.sessions) {
            (Some(t), Some(s)) => s.get(peer).is_some_and(|s| &s.token_id == t),
            _ => false,
        }
    }

    /// A spot check caught `peer` with a wrong result: out of the cluster,
    /// told so, and recorded.
    fn evict(&self, peer: &PeerId, why: &str) {
        // Its token and address are barred from now on (`on_link_up`).
        let evicted = self.opts.sessions.as_ref().and_then(|s| s.evict(peer));
        self.opts.audit.record(Event::Evicted {
            peer: peer.to_string(),
            token_id: evicted.as_ref().map(|(s, _)| s.token_id.clone()),
            why: why.to_owned(),
        });
        // A token only this worker holds goes with it: revoked, its session
        // dropped and refused across restarts. A shared one (the join URL's)
        // stays, or every honest worker that joined with it would be dropped
        // too; the bar on its address keeps this one out.
        if let (Some((session, true)), Some(tokens)) = (&evicted, &self.opts.join_tokens)
            && self.opts.trusted_token.as_deref() != Some(session.token_id.as_str())
        {
            match tokens.revoke(&session.token_id) {
                Ok(dropped) => {
                    info!(%peer, token = %session.token_id, dropped, "revoked an evicted worker's token")
                }
                Err(e) => warn!(%peer, error = %e, "cannot revoke an evicted worker's token"),
            }
        }
        let sender = self
            .links
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(peer)
            .map(|l| l.sender.clone());
        // The core refuses its links from now on; the close only tells it.
        let _ = self.input(ClusterInput::Evict {
            peer: peer.clone(),
            why: why.to_owned(),
        });
        if let Some(sender) = sender {
            let reason = format!("evicted: {why}");
            tokio::spawn(async move {
                let _ = sender.send(Message::Close { reason }).await;
            });
        }
    }

    /// `peer` is gone, as a request found out.
    fn peer_lost(&self, peer: &PeerId, why: &str) {
        self.input(ClusterInput::Lost {
            peer: peer.clone(),
            why: why.to_owned(),
        });
    }

    /// The sender of `peer`'s link of `generation`, while it is the latest.
    fn sender(&self, peer: &PeerId, generation: u64) -> Option<LinkSender> {
        self.links
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(peer)
            .filter(|l| l.generation == generation)
            .map(|l| l.sender.clone())
    }

    /// Feeds the core one input and carries out what it asks; what only
    /// the event loop can do (link to a peer, close a link) comes back.
    fn input(&self, input: ClusterInput) -> Vec<ClusterOutput> {
        let outputs = {
            let mut cluster = self.cluster();
            cluster.handle(input, Instant::now());
            drain(&mut cluster)
        };
        self.rearm.notify_one();
        self.carry_out(outputs)
    }

    /// Gives the core the time.
    fn timeout(&self) {
        let outputs = {
            let mut cluster = self.cluster();
            cluster.handle_timeout(Instant::now());
            drain(&mut cluster)
        };
        // Unhandled outputs come only from link events.
        let _ = self.carry_out(outputs);
    }

    fn carry_out(&self, outputs: Vec<ClusterOutput>) -> Vec<ClusterOutput> {
        let mut rest = Vec::new();
        for output in outputs {
            match output {
                ClusterOutput::Send {
                    peer,
                    generation,
                    msg,
                } => {
                    let sender = self.sender(&peer, generation);
                    let feedback = self.feedback.clone();
                    // A send may wait on a congested link: the core goes on.
                    tokio::spawn(async move {
                        let sent = match sender {
                            Some(s) => s.send(msg).await.map_err(|e| e.to_string()),
                            None => Err("no link to it".into()),
                        };
                        if let Err(why) = sent {
                            let _ = feedback.send(ClusterInput::SendFailed {
                                peer,
                                generation,
                                why,
                            });
                        }
                    });
                }
                ClusterOutput::FailRuns { peer, why } => self.fail_runs(&peer, &why),
                ClusterOutput::Changed => {
                    self.audit_placement();
                    self.touch();
                }
                other @ (ClusterOutput::Connect(_) | ClusterOutput::Close { .. }) => {
                    rest.push(other);
                }
            }
        }
        rest
    }

    /// Records the placement that serves, when it is not the one recorded last.
    fn audit_placement(&self) {
        let (epoch, stages) = {
            let st = self.state();
            match &st.active {
                Some(a) => (
                    Some(a.epoch),
                    a.stages
                        .iter()
                        .map(|s| StageRecord {
                            peer: s.peer.to_string(),
                            first: s.start,
                            last: s.end.saturating_sub(1),
                        })
                        .collect(),
                ),
                None => (None, Vec::new()),
            }
        };
        let mut audited = self
            .audited_epoch
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *audited == epoch {
            return;
        }
        let previous = std::mem::replace(&mut *audited, epoch);
        drop(audited);
        // None serving: recorded with the epoch that ended.
        self.opts.audit.record(Event::Placement {
            epoch: epoch.or(previous).unwrap_or(0),
            stages,
        });
    }

    /// Workers waiting for the admin's approval (`--approve-workers`).
    pub fn pending_workers(&self) -> Vec<(PeerId, core::PendingWorker)> {
        self.cluster
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pending()
            .iter()
            .map(|(p, w)| (p.clone(), w.clone()))
            .collect()
    }

    /// The admin approved or rejected a waiting worker; its token is
    /// remembered for its next session. Whether it was waiting.
    pub fn decide_worker(&self, peer: &PeerId, approved: bool) -> bool {
        if !self
            .cluster
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pending()
            .contains_key(peer)
        {
            return false;
        }
        let token_id = self
            .opts
            .sessions
            .as_ref()
            .and_then(|s| s.decide(peer, approved));
        self.opts.audit.record(Event::Approval {
            peer: peer.to_string(),
            token_id,
            approved,
        });
        self.input(ClusterInput::Approve {
            peer: peer.clone(),
            approved,
        });
        true
    }

    /// Fails every run that has a stage on `peer`.
    fn fail_runs(&self, peer: &PeerId, why: &str) {
        let mut pending = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let ids = core::runs_lost(pending.iter().map(|(id, p)| (*id, &p.peers[..])), peer);
        for id in ids {
            if let Some(p) = pending.remove(&id) {
                let _ =
                    p.events
                        .send((peer.clone(), p.seq, Err(StageFailure::Lost(why.to_owned()))));
            }
        }
    }
}

fn drain(cluster: &mut Cluster) -> Vec<ClusterOutput> {
    std::iter::from_fn(|| cluster.poll_output()).collect()
}

/// A running coordinator.
#[derive(Clone)]
pub struct Coordinator {
    pub shared: Arc<Shared>,
}

impl Coordinator {
    /// Loads the model's metadata, joins the room and starts the event loop
    /// and the core's timer.
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
        let mesh = Mesh::join(&opts.signal_url, &opts.room, &opts.token, link.clone())
            .await
            .with_context(|| format!("joining room '{}' at {}", opts.room, opts.signal_url))?;
        let local_id = mesh.local_id().clone();
        info!(peer = %local_id, room = %opts.room, model = %model.name, "coordinator joined");
        let cfg = ClusterConfig {
            model_config: serde_json::to_string(&model.config).unwrap_or_default(),
            model_id: model.id.clone(),
            source: format!(
                "{}{}{}",
                opts.public_url.trim_end_matches('/'),
                crate::model_fetch::model_route(&model.id),
                opts.model_cap
                    .as_ref()
                    .map(|c| format!("?cap={c}"))
                    .unwrap_or_default()
            ),
            cost: model.cost.clone(),
            approve_workers: opts.approve_workers,
        };
        let cluster = Cluster::new(cfg, opts.manual.clone());
        let verifier = (opts.spot.rate > 0.0).then(|| {
            Arc::new(verify::Verifier::new(
                opts.model_path.clone(),
                opts.engine.clone(),
                opts.spot.tolerance,
            ))
        });
        let (feedback, feedback_rx) = mpsc::unbounded_channel();
        let opts_parallel = opts.parallel;
        let shared = Arc::new(Shared {
            opts,
            model,
            local_id: Mutex::new(local_id),
            cluster: Mutex::new(cluster),
            links: Mutex::new(HashMap::new()),
            changed: watch::channel(0).0,
            rearm: Notify::new(),
            feedback,
            pending: Mutex::new(HashMap::new()),
            next_request: AtomicU64::new(1),
            metrics: pipeline::Metrics::default(),
            queue: pipeline::Queue::new(opts_parallel),
            started: Instant::now(),
            in_room: std::sync::atomic::AtomicBool::new(true),
            audited_epoch: Mutex::new(None),
            verifier,
        });
        tokio::spawn(event_loop(shared.clone(), mesh, link));
        tokio::spawn(timer(shared.clone(), feedback_rx));
        Ok(Coordinator { shared })
    }
}

/// Wakes the core at its deadlines (debounce, load timeout, retry) and
/// feeds it what the shell learned after the fact.
async fn timer(shared: Arc<Shared>, mut feedback: mpsc::UnboundedReceiver<ClusterInput>) {
    loop {
        let due = shared
            .cluster()
            .poll_timeout()
            .map(tokio::time::Instant::from_std);
        tokio::select! {
            () = shared.rearm.notified() => {}
            input = feedback.recv() => match input {
                Some(input) => {
                    let _ = shared.input(input);
                }
                None => return,
            },
            () = sleep_until(due) => shared.timeout(),
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The first wait before joining the room again after the signaling
/// session ended; it doubles on each failure up to [`REJOIN_MAX`].
pub const REJOIN_FIRST: Duration = Duration::from_millis(500);
pub const REJOIN_MAX: Duration = Duration::from_secs(15);

async fn event_loop(shared: Arc<Shared>, mut mesh: Mesh, link: LinkConfig) {
    let mut link_gen = 0u64;
    // While out of the room: when to try again, and the wait after that.
    let mut rejoin: Option<(tokio::time::Instant, Duration)> = None;
    loop {
        let event = match rejoin {
            None => mesh.next_event().await,
            // The old mesh's links keep serving while we are out of the room.
            Some((at, wait)) => tokio::select! {
                e = mesh.next_event() => e,
                () = tokio::time::sleep_until(at) => {
                    let o = &shared.opts;
                    match Mesh::join(&o.signal_url, &o.room, &o.token, link.clone()).await {
                        Ok(new) => {
                            info!(peer = %new.local_id(), "back in the room; linking to its workers again");
                            *shared.local_id.lock().unwrap_or_else(PoisonError::into_inner) =
                                new.local_id().clone();
                            // Its links go with it; the new session links to every worker in
                            // the room (each `PeerJoined`), and the core sees them as new links.
                            mesh = new;
                            rejoin = None;
                            shared.in_room.store(true, Ordering::Relaxed);
                            shared.touch();
                        }
                        Err(e) => {
                            warn!(error = %e, retry_in = ?wait, "cannot join the room again yet");
                            rejoin = Some((tokio::time::Instant::now() + wait, (wait * 2).min(REJOIN_MAX)));
                        }
                    }
                    continue;
                }
            },
        };
        let Some(event) = event else { break };
        match event {
            MeshEvent::PeerJoined(p) => {
                // The embedded signaling server records joins itself, with
                // the token and the address; an outside one tells neither.
                if shared.opts.join_tokens.is_none() {
                    shared.opts.audit.record(Event::Joined {
                        peer: p.peer_id.to_string(),
                        role: p.role.as_str().to_owned(),
                        token_id: None,
                        addr: None,
                    });
                }
                let joined = ClusterInput::PeerJoined {
                    peer: p.peer_id,
                    worker: p.role == Role::Worker,
                };
                for output in shared.input(joined) {
                    if let ClusterOutput::Connect(peer) = output {
                        mesh.connect(&peer);
                    }
                }
            }
            MeshEvent::PeerMeta(_) | MeshEvent::Signal { .. } => {}
            MeshEvent::PeerLeft(peer) => {
                if shared.opts.join_tokens.is_none() {
                    shared.opts.audit.record(Event::Left {
                        peer: peer.to_string(),
                        token_id: None,
                    });
                }
                shared.input(ClusterInput::PeerLeft { peer });
            }
            MeshEvent::LinkUp(link) => {
                link_gen += 1;
                on_link_up(&shared, link, link_gen);
            }
            MeshEvent::LinkDown { peer, error } => {
                debug!(%peer, %error, "link down");
                shared.input(ClusterInput::LinkDown {
                    peer,
                    generation: None,
                    why: error.to_string(),
                });
            }
            MeshEvent::SignalClosed => {
                warn!(retry_in = ?REJOIN_FIRST, "the signaling session ended; joining the room again");
                shared.in_room.store(false, Ordering::Relaxed);
                shared.touch();
                rejoin = Some((
                    tokio::time::Instant::now() + REJOIN_FIRST,
                    (REJOIN_FIRST * 2).min(REJOIN_MAX),
                ));
            }
        }
    }
}

/// Hands a new link to the core (which may refuse it) and reads it.
fn on_link_up(shared: &Arc<Shared>, link: Link, generation: u64) {
    let peer = link.peer().clone();
    // In the table first: the core's first words to it go out at once.
    shared
        .links
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(
            peer.clone(),
            LinkEntry {
                generation,
                sender: link.sender(),
                stats: link.stats_watch(),
            },
        );
    // A worker back with a token the admin decided on is not asked about
    // again; `cairn serve`'s own worker is never asked.
    let decided = shared
        .opts
        .approve_workers
        .then(|| shared.opts.sessions.as_ref().and_then(|s| s.decided(&peer)));
    if decided == Some(Some(true)) || (shared.opts.approve_workers && shared.trusted(&peer)) {
        shared.input(ClusterInput::Approve {
            peer: peer.clone(),
            approved: true,
        });
    }
    // An evicted worker back under a new peer id (same token, same
    // address): evicted again before the core sees its link, which it then
    // refuses.
    if shared
        .opts
        .sessions
        .as_ref()
        .is_some_and(|s| s.barred(&peer))
    {
        shared.input(ClusterInput::Evict {
            peer: peer.clone(),
            why: "it came back with an evicted worker's token from its address".into(),
        });
    }
    let up = ClusterInput::LinkUp {
        peer: peer.clone(),
        capabilities: link.remote_hello().capabilities.clone(),
        generation,
    };
    for output in shared.input(up) {
        if let ClusterOutput::Close { reason, .. } = output {
            shared.opts.audit.record(Event::Refused {
                peer: peer.to_string(),
                why: reason.clone(),
            });
            let mut links = shared.links.lock().unwrap_or_else(PoisonError::into_inner);
            if links.get(&peer).is_some_and(|l| l.generation == generation) {
                links.remove(&peer);
            }
            drop(links);
            link.close(&reason);
            return;
        }
    }
    let admitted = shared.state().peers.get(&peer).map(|p| Event::Admitted {
        peer: peer.to_string(),
        device: p.caps.device.name.clone(),
        memory_budget_bytes: p.caps.memory_budget_bytes,
    });
    if let Some(event) = admitted {
        shared.opts.audit.record(event);
    }
    if decided == Some(Some(false)) {
        shared.input(ClusterInput::Approve {
            peer: peer.clone(),
            approved: false,
        });
    }
    tokio::spawn(read_link(shared.clone(), link, generation));
}

/// Routes what a worker says: a run's answers to the request that waits
/// for them, everything else to the core.
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
            msg => {
                shared.input(ClusterInput::FromPeer {
                    peer: peer.clone(),
                    msg,
                });
            }
        }
    };
    shared.input(ClusterInput::LinkDown {
        peer,
        generation: Some(generation),
        why: end.to_string(),
    });
}

/// The request-failed error code a stage uses when the request is at fault.
pub(crate) fn is_request_fault(code: u16) -> bool {
    code == error_code::BAD_REQUEST
}

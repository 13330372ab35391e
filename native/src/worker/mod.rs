//! `cairn worker`: join a room, wait for the coordinator's link, and serve
//! the layers it assigns with the engine's [`StageServer`].
//!
//! The stage runs on its own thread (the CPU backend computes inside
//! `forward`, and wgpu's waits are blocking on native), fed in order through
//! a channel; its outputs go straight onto the links, so the link tasks keep
//! reading (and answering pings) while a step computes.
//!
//! Under a chain (`LoadShard::next`), a worker links to the worker of the
//! next stage and hands it each step's output directly; the last stage feeds
//! each sampled token back to the first. Links from other workers are taken
//! (the signaling server vouches for their role), but only `Forward`s from
//! the stage before ours are served on them.

mod corrupt;
pub mod host;
mod lose_pass;
mod source;
mod stage_thread;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use cairn_engine::Device;
use cairn_engine::model::Split;
use cairn_engine::protocol::{Message, error_code};
use cairn_engine::worker::{Capabilities, HostAction, PeerKind, PressureRule, WorkerHost};
use cairn_signal::Role;
use cairn_signal::protocol::PeerId;
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::link::{Link, LinkConfig, Mesh, MeshEvent};
pub use crate::model_fetch::local_model_id;
use stage_thread::{Job, SharedRoutes, StageThread};

/// Everything a worker needs.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    pub signal_url: String,
    pub room: String,
    pub token: String,
    /// A local copy of the model (weights load from disk instead of HTTP).
    pub model: Option<PathBuf>,
    /// Where shards fetched over HTTP are cached.
    pub cache_dir: Option<PathBuf>,
    pub link: LinkConfig,
    /// Bytes offered for weights and caches; default: a share of the device's memory.
    pub memory_budget: Option<u64>,
    /// How a stage over several devices spreads its layers over them.
    pub split: Split,
}

/// The first wait before joining the room again after the signaling
/// session ended; it doubles on each failure up to [`REJOIN_MAX`].
pub const REJOIN_FIRST: Duration = Duration::from_millis(500);
pub const REJOIN_MAX: Duration = Duration::from_secs(15);

/// How one stay in the room ended.
enum Ended {
    /// The signaling session closed: join again.
    SignalClosed,
    /// Joining failed; refused (a revoked or expired token) is for good.
    Join { error: anyhow::Error, refused: bool },
}

/// Joins the room and serves; after the signaling session ends (the server
/// restarted, or dropped us), joins again with backoff and serves on, the
/// stage thread and the layers it holds kept. A first join that fails, or a
/// token refused, ends it. `joined` receives our first peer id.
///
/// A worker over several devices whose device fails a pass leaves the room and joins again
/// over the others, as a new peer: the coordinator recovers the requests it held as after
/// any worker's loss, and places the model again with what is left.
pub async fn serve(
    mut devices: Vec<Arc<Device>>,
    opts: WorkerOptions,
    mut joined: Option<oneshot::Sender<PeerId>>,
) -> Result<()> {
    let local_id = match &opts.model {
        Some(p) => Some(
            local_model_id(p).with_context(|| format!("reading the model file {}", p.display()))?,
        ),
        None => None,
    };
    if devices.is_empty() {
        anyhow::bail!("a worker needs at least one device");
    }
    // Each device offers its share; an explicit budget is split by the devices' memory.
    let mut offered: Vec<u64> = devices
        .iter()
        .map(|d| (d.info().memory_bytes as f64 * offered_share(d)) as u64)
        .collect();
    if let Some(b) = opts.memory_budget {
        let total: u128 = devices
            .iter()
            .map(|d| u128::from(d.info().memory_bytes))
            .sum();
        offered = devices
            .iter()
            .map(|d| (u128::from(b) * u128::from(d.info().memory_bytes) / total.max(1)) as u64)
            .collect();
    }
    let source = Arc::new(source::ShardSource {
        local: opts.model.clone().zip(local_id.clone()),
        cache_dir: opts.cache_dir.clone(),
    });
    loop {
        let (failed_tx, mut failed_rx) = mpsc::unbounded_channel::<usize>();
        let link_config = worker_link_config(&opts, &devices, &offered, &local_id);
        let routes: SharedRoutes = Arc::default();
        let stage = StageThread::spawn(
            devices
                .iter()
                .cloned()
                .zip(offered.iter().copied())
                .collect(),
            String::new(),
            routes.clone(),
            failed_tx,
            opts.split,
        )?;
        let mut first = true;
        let mut wait = REJOIN_FIRST;
        let failed = loop {
            let ended = tokio::select! {
                ended = stay(&opts, &link_config, &stage, &source, &routes, &mut joined) => ended,
                Some(index) = failed_rx.recv() => break index,
            };
            match ended {
                Ok(()) => return Ok(()),
                Err(Ended::SignalClosed) => {
                    wait = REJOIN_FIRST;
                    warn!(retry_in = ?wait, "the signaling session ended; joining the room again");
                }
                Err(Ended::Join { error, refused }) if first || refused => return Err(error),
                Err(Ended::Join { error, .. }) => {
                    warn!(error = %format!("{error:#}"), retry_in = ?wait, "cannot join the room again yet");
                }
            }
            first = false;
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(REJOIN_MAX);
        };
        // Leaving the room (the stay above is dropped) closes every link: the coordinator
        // sees this peer go and recovers its requests elsewhere.
        if failed >= devices.len() || devices.len() == 1 {
            anyhow::bail!("the worker's last device failed");
        }
        let lost = devices.remove(failed);
        offered.remove(failed);
        warn!(
            device = %lost.info().id,
            left = devices.len(),
            "a device failed; joining the room again over the others"
        );
    }
}

/// What the worker tells the room about itself: its devices (all of them when several),
/// the bytes they offer and the model files it holds.
fn worker_link_config(
    opts: &WorkerOptions,
    devices: &[Arc<Device>],
    offered: &[u64],
    local_id: &Option<String>,
) -> LinkConfig {
    let first = &devices[0];
    let mut caps = Capabilities::worker(PeerKind::Native, first.info(), offered_share(first));
    caps.memory_budget_bytes = offered.iter().sum();
    if devices.len() > 1 {
        caps.devices = devices.iter().map(|d| d.info().clone()).collect();
        info!(
            devices = devices.len(),
            ids = %devices.iter().map(|d| d.info().id.as_str()).collect::<Vec<_>>().join(","),
            "one worker over several devices: its stage is split over them by {}",
            opts.split
        );
    }
    caps.models = local_id.iter().cloned().collect();
    let mut link_config = opts.link.clone();
    link_config.capabilities = caps.to_json();
    link_config
}

/// The share of a device's memory a worker offers: GPUs keep room for the driver and other
/// programs; a CPU worker shares the host.
fn offered_share(device: &Device) -> f64 {
    if device.info().backend == cairn_engine::BackendKind::Cpu {
        0.5
    } else {
        0.85
    }
}

/// One stay in the room: joins, then serves until the session ends.
async fn stay(
    opts: &WorkerOptions,
    link_config: &LinkConfig,
    stage: &StageThread,
    source: &Arc<source::ShardSource>,
    routes: &SharedRoutes,
    joined: &mut Option<oneshot::Sender<PeerId>>,
) -> Result<(), Ended> {
    let mut mesh = match Mesh::join(
        &opts.signal_url,
        &opts.room,
        &opts.token,
        link_config.clone(),
    )
    .await
    {
        Ok(m) => m,
        Err(e) => {
            let refused = matches!(e, crate::link::LinkError::Refused(_));
            let error = anyhow::Error::new(e).context(format!(
                "joining room '{}' at {}",
                opts.room, opts.signal_url
            ));
            return Err(Ended::Join { error, refused });
        }
    };
    info!(peer = %mesh.local_id(), room = %opts.room, "worker joined");
    if let Some(tx) = joined.take() {
        let _ = tx.send(mesh.local_id().clone());
    }
    routes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .set_local_id(mesh.local_id().to_string());
    let (connect_tx, mut connect_rx) = mpsc::unbounded_channel::<PeerId>();
    let mut coordinators = std::collections::HashSet::new();
    let mut workers = std::collections::HashSet::new();
    let mut current: Option<tokio::task::JoinHandle<()>> = None;
    loop {
        let event = tokio::select! {
            e = mesh.next_event() => match e {
                Some(e) => e,
                None => break,
            },
            Some(peer) = connect_rx.recv() => {
                if &peer != mesh.local_id() {
                    mesh.connect(&peer);
                }
                continue;
            }
        };
        match event {
            MeshEvent::PeerJoined(p) | MeshEvent::PeerMeta(p) => match p.role {
                Role::Coordinator => {
                    coordinators.insert(p.peer_id);
                }
                Role::Worker => {
                    workers.insert(p.peer_id);
                }
                _ => {}
            },
            MeshEvent::PeerLeft(p) => {
                coordinators.remove(&p);
                workers.remove(&p);
            }
            MeshEvent::LinkUp(link) => {
                if workers.contains(link.peer()) {
                    info!(peer = %link.peer(), "linked to another worker");
                    tokio::spawn(serve_worker_link(link, stage.clone(), routes.clone()));
                    continue;
                }
                if !coordinators.contains(link.peer()) {
                    warn!(peer = %link.peer(), "refusing a link from a peer that is neither coordinator nor worker");
                    link.close("workers only take links from a coordinator or another worker");
                    continue;
                }
                info!(coordinator = %link.peer(), "linked to the coordinator");
                if let Some(old) = current.take() {
                    old.abort();
                }
                current = Some(tokio::spawn(serve_link(
                    link,
                    stage.clone(),
                    source.clone(),
                    routes.clone(),
                    connect_tx.clone(),
                )));
            }
            MeshEvent::LinkDown { peer, error } => {
                info!(%peer, %error, "link down");
            }
            MeshEvent::SignalClosed => {
                if let Some(c) = current.take() {
                    c.abort();
                }
                return Err(Ended::SignalClosed);
            }
            MeshEvent::Signal { .. } => {}
        }
    }
    Ok(())
}

/// Serves one coordinator link: messages in order to the stage thread,
/// replies and telemetry back.
async fn serve_link(
    mut link: Link,
    stage: StageThread,
    source: Arc<source::ShardSource>,
    routes: SharedRoutes,
    connect: mpsc::UnboundedSender<PeerId>,
) {
    let sender = link.sender();
    routes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .set_coordinator(link.sender());
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Message>();
    let forward_out = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            if sender.send(m).await.is_err() {
                break;
            }
        }
    });
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let condition = host::HostCondition::from_env();
    // A native host's thermal pressure is reported, not paused for: the
    // coordinator gives a throttled host fewer layers.
    let mut worker = WorkerHost::new(PressureRule::Report);
    loop {
        tokio::select! {
            m = link.recv() => match m {
                Ok(m) => match worker.on_message(m) {
                    HostAction::Load(plan) => {
                        let (start, end) = (plan.start, plan.end);
                        info!(start, end, next = ?plan.route.next.as_ref().map(|h| &h.peer), "loading layers");
                        // The link to the next stage comes up while the layers load.
                        if let Some(hop) = &plan.route.next {
                            let _ = connect.send(PeerId(hop.peer.clone()));
                        }
                        let reply = match source.open(&plan.model, &plan.source, start, end).await {
                            Ok(src) => stage
                                .call(|reply| Job::Install { src, plan, reply })
                                .await
                                .unwrap_or_else(|text| Message::Error { code: error_code::INTERNAL, text }),
                            Err(e) => plan.failed(format!("{e:#}")),
                        };
                        match &reply {
                            Message::ShardLoaded { load_ms, weight_bytes, .. } => {
                                info!(start, end, load_ms, weight_bytes, "layers loaded");
                            }
                            Message::Error { text, .. } => warn!(%text, "loading layers failed"),
                            _ => {}
                        }
                        let _ = out_tx.send(reply);
                    }
                    HostAction::Reply(m) => {
                        let _ = out_tx.send(m);
                    }
                    HostAction::Close { reason } => {
                        info!(%reason, "the coordinator closed the link");
                        break;
                    }
                    HostAction::PeerError { code, text } => {
                        debug!(code, %text, "the coordinator reported an error");
                    }
                    HostAction::Stage(m) => stage.send(Job::Coordinator(m)),
                    HostAction::Ignore => {}
                },
                Err(e) => {
                    info!(error = %e, "coordinator link ended");
                    break;
                }
            },
            _ = tick.tick() => {
                if let Some(m) = worker.set_condition(condition.read()) {
                    let _ = out_tx.send(m);
                }
                if let Ok(t) = stage.call(Job::Telemetry).await {
                    let mut t = worker.telemetry(t);
                    t.links = routes
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .peer_stats();
                    let _ = out_tx.send(Message::Telemetry(Box::new(t)));
                }
            }
        }
    }
    forward_out.abort();
}

/// Serves a link from another worker: its steps go to the stage thread,
/// which serves only those of the stage before ours.
async fn serve_worker_link(mut link: Link, stage: StageThread, routes: SharedRoutes) {
    let peer = link.peer().to_string();
    let generation = routes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .add_peer(peer.clone(), link.sender(), link.stats_watch());
    let places = std::sync::Arc::new(tokio::sync::Semaphore::new(stage_thread::PEER_QUEUE_PLACES));
    loop {
        match link.recv().await {
            Ok(Message::Close { reason }) => {
                debug!(%peer, %reason, "a worker closed its link");
                break;
            }
            Ok(m) => stage.send_from_peer(&places, &peer, m).await,
            Err(e) => {
                debug!(%peer, error = %e, "a worker link ended");
                break;
            }
        }
    }
    routes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .drop_peer(&peer, generation);
}

//! `cairn worker`: join a room, wait for the coordinator's link, and serve
//! the layers it assigns with the engine's [`StageServer`].
//!
//! The stage runs on its own thread (the CPU backend computes inside
//! `forward`, and wgpu's waits are blocking on native), fed in order through
//! a channel; its replies go straight back to the link, so the link task
//! keeps reading (and answering pings) while a step computes.

pub mod host;
mod source;
mod stage_thread;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use cairn_engine::Device;
use cairn_engine::protocol::{Message, error_code};
use cairn_engine::worker::{Capabilities, PeerKind};
use cairn_signal::Role;
use cairn_signal::protocol::PeerId;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use crate::link::{Link, LinkConfig, Mesh, MeshEvent};
pub use crate::model_fetch::local_model_id;
use stage_thread::{Job, StageThread};

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
}

/// Joins the room and serves until the signaling session ends.
/// `joined` receives our peer id once we are in the room.
pub async fn serve(
    device: Arc<Device>,
    opts: WorkerOptions,
    joined: Option<oneshot::Sender<PeerId>>,
) -> Result<()> {
    let local_id = match &opts.model {
        Some(p) => Some(
            local_model_id(p).with_context(|| format!("reading the model file {}", p.display()))?,
        ),
        None => None,
    };
    let info = device.info();
    // GPUs keep room for the driver and other programs; a CPU worker shares the host.
    let share = if info.backend == cairn_engine::BackendKind::Cpu {
        0.5
    } else {
        0.85
    };
    let mut caps = Capabilities::worker(PeerKind::Native, info, share);
    if let Some(b) = opts.memory_budget {
        caps.memory_budget_bytes = b;
    }
    caps.models = local_id.iter().cloned().collect();
    let mut link_config = opts.link.clone();
    link_config.capabilities = caps.to_json();
    let mut mesh = Mesh::join(&opts.signal_url, &opts.room, &opts.token, link_config)
        .await
        .with_context(|| format!("joining room '{}' at {}", opts.room, opts.signal_url))?;
    info!(peer = %mesh.local_id(), room = %opts.room, device = %info.name, backend = %info.backend, "worker joined");
    if let Some(tx) = joined {
        let _ = tx.send(mesh.local_id().clone());
    }
    let stage = StageThread::spawn(device.clone())?;
    let source = Arc::new(source::ShardSource {
        local: opts.model.clone().zip(local_id),
        cache_dir: opts.cache_dir.clone(),
    });
    let mut coordinators = std::collections::HashSet::new();
    let mut current: Option<tokio::task::JoinHandle<()>> = None;
    while let Some(event) = mesh.next_event().await {
        match event {
            MeshEvent::PeerJoined(p) | MeshEvent::PeerMeta(p) => {
                if p.role == Role::Coordinator {
                    coordinators.insert(p.peer_id);
                }
            }
            MeshEvent::PeerLeft(p) => {
                coordinators.remove(&p);
            }
            MeshEvent::LinkUp(link) => {
                if !coordinators.contains(link.peer()) {
                    warn!(peer = %link.peer(), "refusing a link from a peer that is not a coordinator");
                    link.close("workers only take links from a coordinator");
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
                )));
            }
            MeshEvent::LinkDown { peer, error } => {
                info!(%peer, %error, "link down");
            }
            MeshEvent::SignalClosed => {
                anyhow::bail!("the signaling server closed our session");
            }
            MeshEvent::Signal { .. } => {}
        }
    }
    Ok(())
}

/// Serves one coordinator link: messages in order to the stage thread,
/// replies and telemetry back.
async fn serve_link(mut link: Link, stage: StageThread, source: Arc<source::ShardSource>) {
    let sender = link.sender();
    let step_replies = link.sender();
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Message>();
    let forward_out = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            if sender.send(m).await.is_err() {
                break;
            }
        }
    });
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let host = host::HostCondition::from_env();
    loop {
        tokio::select! {
            m = link.recv() => match m {
                Ok(Message::LoadShard { model_hash, layers, source: url }) => {
                    let (start, end) = (layers.start as usize, layers.end as usize);
                    info!(start, end, "loading layers");
                    let reply = match source.open(&model_hash, &url, start, end).await {
                        Ok(src) => stage.call(|tx| Job::Install { src, model: model_hash, start, end, reply: tx }).await,
                        Err(e) => Err(format!("{e:#}")),
                    };
                    let reply = reply.unwrap_or_else(|text| {
                        warn!(%text, "loading layers failed");
                        Message::Error { code: error_code::INTERNAL, text }
                    });
                    if let Message::ShardLoaded { load_ms, weight_bytes, .. } = &reply {
                        info!(start, end, load_ms, weight_bytes, "layers loaded");
                    }
                    let _ = out_tx.send(reply);
                }
                Ok(Message::Close { reason }) => {
                    info!(%reason, "the coordinator closed the link");
                    break;
                }
                Ok(m) => stage.send(Job::Handle(m, step_replies.clone())),
                Err(e) => {
                    info!(error = %e, "coordinator link ended");
                    break;
                }
            },
            _ = tick.tick() => {
                if let Ok(mut t) = stage.call(Job::Telemetry).await {
                    t.extra = with_host(&t.extra, host.read());
                    let _ = out_tx.send(Message::Telemetry(t));
                }
            }
        }
    }
    forward_out.abort();
}

/// The stage's telemetry object with the host's condition added.
fn with_host(extra: &str, host: serde_json::Map<String, serde_json::Value>) -> String {
    let mut v = serde_json::from_str::<serde_json::Value>(extra)
        .ok()
        .filter(serde_json::Value::is_object)
        .unwrap_or_else(|| serde_json::json!({}));
    if let Some(obj) = v.as_object_mut() {
        obj.extend(host);
    }
    v.to_string()
}

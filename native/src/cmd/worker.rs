//! `cairn worker`: join a cluster and serve the layers the coordinator assigns.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use cairn_engine::model::Split;
use cairn_native::link::LinkConfig;
use cairn_native::worker::{self, WorkerOptions};

use crate::cmd::ice_args::IceArgs;
use crate::cmd::signal_args::{parse_signal, resolve_room};
use crate::loading::{self, DeviceArgs};

#[derive(clap::Args)]
pub struct Args {
    /// cairn-signal to join, as it prints its address (ws://HOST:PORT, with or without
    /// /ws?room=...; http(s):// works too); found on the LAN through mDNS when omitted.
    #[arg(long)]
    signal: Option<String>,
    /// Worker token for the room.
    #[arg(long, env = "CAIRN_TOKEN")]
    token: String,
    /// Room to join (default: the one in --signal's URL, else the token's, else main).
    #[arg(long)]
    room: Option<String>,
    /// A local copy of the model: layers load from disk instead of over HTTP.
    #[arg(long)]
    model: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
    /// Bytes offered for weights and caches (default: a share of the device's memory).
    #[arg(long)]
    memory_budget: Option<u64>,
    /// How a worker over several devices (`--device a,b`) spreads its stage over them:
    /// `layers` (each device a run of the layers), `tensor` (each device a part of every
    /// layer's heads and feed-forward rows) or `auto` (tensor on GPUs that read each other's
    /// memory, for models 4,096 wide and up; layers otherwise).
    #[arg(long, default_value = "auto")]
    split: Split,
    /// Where shards fetched over HTTP are cached (default: ~/.cache/cairn/shards).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Gather link candidates on loopback only (tests, one machine).
    #[arg(long)]
    loopback: bool,
    /// STUN and TURN servers for the links.
    #[command(flatten)]
    ice: IceArgs,
}

pub fn run(a: Args) -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(serve(a))
}

async fn serve(a: Args) -> Result<()> {
    let parsed = a.signal.as_deref().map(parse_signal).transpose()?;
    let room = resolve_room(
        a.room.as_deref(),
        parsed.as_ref().and_then(|p| p.room.as_deref()),
        Some(&a.token),
    )?;
    let signal = match parsed {
        Some(p) => p.url,
        None => {
            let found = cairn_signal::mdns::discover(Duration::from_secs(3))
                .await
                .context("looking for cairn-signal on the LAN")?;
            let Some(first) = found.into_iter().next() else {
                bail!(
                    "no cairn-signal answered on the LAN within 3 s; pass --signal ws://HOST:PORT"
                );
            };
            println!("found cairn-signal '{}' at {}", first.instance, first.url);
            first.url
        }
    };
    let devices = loading::open_devices(&a.device)?;
    let cache_dir = a
        .cache_dir
        .clone()
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/cairn/shards")));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let opts = WorkerOptions {
        signal_url: signal,
        room: room.clone(),
        token: a.token.clone(),
        model: a.model.clone(),
        cache_dir,
        link: {
            let mut link = if a.loopback {
                LinkConfig::loopback()
            } else {
                LinkConfig::default()
            };
            a.ice.apply(&mut link);
            link
        },
        memory_budget: a.memory_budget,
        split: a.split,
    };
    let task = tokio::spawn(worker::serve(devices, opts, Some(tx)));
    if let Ok(peer) = rx.await {
        println!("joined room {room} as {peer}");
    }
    task.await.context("the worker task panicked")?
}

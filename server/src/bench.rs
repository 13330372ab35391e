//! `cairn-signal bench`: a load generator for loopback. It starts a server
//! in a child process (so the server's resident memory can be read apart
//! from the clients'), opens many WebSocket connections spread over rooms,
//! measures join latency, then relays signals between pairs of peers.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use cairn_signal::protocol::{ClientMessage, PeerId, ServerMessage};
use cairn_signal::token::{Claims, Role, Secret, issue};
use clap::Args;
use futures::{SinkExt as _, StreamExt as _};
use tokio::io::AsyncBufReadExt as _;
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;

/// A typical trickled ICE candidate: what most signaling traffic looks like.
const PAYLOAD: &str = r#"{"candidate":"candidate:842163049 1 udp 1677729535 192.0.2.10 54321 typ srflx raddr 0.0.0.0 rport 0 generation 0 ufrag Xk3d network-cost 999","sdpMid":"0","sdpMLineIndex":0}"#;

#[derive(Args)]
pub struct BenchArgs {
    /// WebSocket connections to hold open at once.
    #[arg(long, default_value_t = 10_000)]
    connections: usize,
    /// Rooms to spread them over.
    #[arg(long, default_value_t = 100)]
    rooms: usize,
    /// Connection attempts in flight at once.
    #[arg(long, default_value_t = 200)]
    concurrency: usize,
    /// Length of the relay phase, in seconds (at most 60).
    #[arg(long, default_value_t = 10)]
    relay_secs: u64,
    /// Signals each sending peer keeps in flight.
    #[arg(long, default_value_t = 8)]
    window: usize,
    /// Benchmark an already running server (loopback only) instead of
    /// starting one; its memory is then not reported.
    #[arg(long, requires = "secret_file")]
    url: Option<String>,
    #[arg(long)]
    secret_file: Option<PathBuf>,
}

/// Upper bound on the whole run, whatever the arguments.
const MAX_RUN: Duration = Duration::from_secs(600);

pub async fn run(args: BenchArgs) -> Result<()> {
    if args.connections < 2 || args.rooms == 0 || args.concurrency == 0 || args.window == 0 {
        bail!("need at least 2 connections, 1 room, 1 connection in flight and a window of 1");
    }
    match tokio::time::timeout(MAX_RUN, run_bounded(args)).await {
        Ok(result) => result,
        Err(_) => bail!("benchmark exceeded {} s", MAX_RUN.as_secs()),
    }
}

async fn run_bounded(args: BenchArgs) -> Result<()> {
    crate::raise_fd_limit(args.connections + 256);
    let per_room = args.connections.div_ceil(args.rooms);
    let (url, secret, child) = match (&args.url, &args.secret_file) {
        (Some(url), Some(secret_file)) => {
            ensure_loopback(url)?;
            (url.clone(), Secret::read_file(secret_file)?, None)
        }
        _ => {
            let (url, secret, child) = start_server(args.connections, per_room).await?;
            (url, secret, Some(child))
        }
    };
    let server_pid = child.as_ref().and_then(|c| c.child.id());
    println!("cairn-signal bench: {url}, {} CPU(s)", cpus());

    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_before = server_pid.and_then(rss_bytes);

    // Connect phase.
    let echoes = Arc::new(AtomicU64::new(0));
    let slots = Arc::new(Semaphore::new(args.concurrency));
    let (joined_tx, mut joined_rx) = mpsc::unbounded_channel();
    let tokens: Vec<String> = (0..args.rooms)
        .map(|r| {
            issue(
                &secret,
                &Claims::new(room_name(r), Role::Worker, Duration::from_secs(3600)),
            )
        })
        .collect();
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for index in 0..args.connections {
        // Pairs (2k, 2k+1) share a room so they can relay to each other.
        let room = (index / 2) % args.rooms;
        let request = format!("{url}/ws?room={}&token={}", room_name(room), tokens[room]);
        let slots = Arc::clone(&slots);
        let joined_tx = joined_tx.clone();
        let echoes = Arc::clone(&echoes);
        workers.spawn(async move {
            let Ok(permit) = slots.acquire_owned().await else {
                return;
            };
            let t0 = Instant::now();
            let connected = tokio::time::timeout(Duration::from_secs(30), join(&request)).await;
            drop(permit);
            match connected {
                Ok(Ok((ws, peer_id))) => {
                    let (control_tx, control_rx) = oneshot::channel();
                    let _ = joined_tx.send(Joined::Ok {
                        index,
                        peer_id,
                        latency: t0.elapsed(),
                        control: control_tx,
                    });
                    peer(ws, control_rx, echoes).await;
                }
                Ok(Err(error)) => {
                    let _ = joined_tx.send(Joined::Failed(error.to_string()));
                }
                Err(_) => {
                    let _ = joined_tx.send(Joined::Failed("timed out".into()));
                }
            }
        });
    }
    drop(joined_tx);

    let mut latencies = Vec::with_capacity(args.connections);
    let mut peers: Vec<Option<(PeerId, oneshot::Sender<Start>)>> =
        (0..args.connections).map(|_| None).collect();
    let mut failures = Vec::new();
    while latencies.len() + failures.len() < args.connections {
        let Some(joined) = joined_rx.recv().await else {
            break;
        };
        match joined {
            Joined::Ok {
                index,
                peer_id,
                latency,
                control,
            } => {
                latencies.push(latency);
                peers[index] = Some((peer_id, control));
            }
            Joined::Failed(error) => failures.push(error),
        }
    }
    let connect_time = started.elapsed();
    latencies.sort();
    let connected = latencies.len();
    println!(
        "connections: {connected} of {} open ({} failed) over {} rooms, in {:.1} s ({:.0} joins/s, {} in flight)",
        args.connections,
        failures.len(),
        args.rooms,
        connect_time.as_secs_f64(),
        connected as f64 / connect_time.as_secs_f64(),
        args.concurrency
    );
    if let Some(first) = failures.first() {
        println!("  first failure: {first}");
    }
    if connected > 0 {
        println!(
            "join latency (TCP connect + upgrade + welcome): p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            ms(percentile(&latencies, 50.0)),
            ms(percentile(&latencies, 99.0)),
            ms(latencies[connected - 1]),
        );
    }

    // Let the peer-joined broadcasts drain before reading memory.
    tokio::time::sleep(Duration::from_secs(2)).await;
    if let (Some(before), Some(after)) = (rss_before, server_pid.and_then(rss_bytes))
        && connected > 0
    {
        println!(
            "server resident memory: {:.1} MiB idle, {:.1} MiB with {connected} connections: {:.1} KiB per connection",
            before as f64 / 1048576.0,
            after as f64 / 1048576.0,
            after.saturating_sub(before) as f64 / 1024.0 / connected as f64
        );
    }

    // Relay phase: in each pair the even peer sends, the odd one echoes.
    let relay = Duration::from_secs(args.relay_secs.clamp(1, 60));
    let deadline = Instant::now() + relay;
    let mut pairs = 0usize;
    for pair in peers.chunks_mut(2) {
        let [a, b] = pair else { continue };
        let (Some((a_id, a_ctl)), Some((b_id, b_ctl))) = (a.take(), b.take()) else {
            continue;
        };
        let _ = a_ctl.send(Start {
            partner: b_id,
            window: args.window,
            deadline,
        });
        let _ = b_ctl.send(Start {
            partner: a_id,
            window: 0,
            deadline,
        });
        pairs += 1;
    }
    let relay_start = Instant::now();
    tokio::time::sleep_until((deadline).into()).await;
    let relayed = echoes.load(Ordering::Relaxed) * 2;
    let elapsed = relay_start.elapsed().as_secs_f64();
    println!(
        "relay: {relayed} signals in {elapsed:.1} s = {:.0} messages/s ({pairs} pairs, {} in flight per pair, {} byte payload)",
        relayed as f64 / elapsed,
        args.window,
        PAYLOAD.len()
    );
    if let Some(pid) = server_pid.and_then(|pid| rss_bytes(pid).map(|r| (pid, r))) {
        println!(
            "server resident memory after relay: {:.1} MiB",
            pid.1 as f64 / 1048576.0
        );
    }

    workers.abort_all();
    while workers.join_next().await.is_some() {}
    if let Some(child) = child {
        child.stop().await;
    }
    Ok(())
}

enum Joined {
    Ok {
        index: usize,
        peer_id: PeerId,
        latency: Duration,
        control: oneshot::Sender<Start>,
    },
    Failed(String),
}

struct Start {
    partner: PeerId,
    /// Signals to keep in flight; 0 for the echoing side.
    window: usize,
    deadline: Instant,
}

type Ws = tokio_tungstenite::WebSocketStream<TcpStream>;

async fn join(url: &str) -> Result<(Ws, PeerId)> {
    let request = url.into_client_request()?;
    let uri = request.uri();
    let host = uri.host().context("no host")?.to_owned();
    let port = uri.port_u16().context("no port")?;
    let tcp = TcpStream::connect((host.trim_matches(['[', ']']), port)).await?;
    tcp.set_nodelay(true)?;
    // Small buffers: ten thousand 128 KiB defaults would dwarf the server.
    let config = WebSocketConfig::default()
        .read_buffer_size(4096)
        .write_buffer_size(0);
    let (mut ws, _) =
        tokio_tungstenite::client_async_with_config(request, tcp, Some(config)).await?;
    while let Some(frame) = ws.next().await {
        if let Message::Text(text) = frame?
            && let Ok(ServerMessage::Welcome { peer_id, .. }) = serde_json::from_str(&text)
        {
            return Ok((ws, peer_id));
        }
    }
    bail!("closed before the welcome")
}

/// Keeps one connection read (so the server never finds it slow) and plays
/// its part in the relay phase.
async fn peer(mut ws: Ws, mut control: oneshot::Receiver<Start>, echoes: Arc<AtomicU64>) {
    let mut start: Option<Start> = None;
    let signal = |to: &PeerId| {
        let message = ClientMessage::Signal {
            to: to.clone(),
            data: serde_json::from_str(PAYLOAD).unwrap_or_default(),
        };
        Message::text(serde_json::to_string(&message).unwrap_or_default())
    };
    loop {
        tokio::select! {
            frame = ws.next() => {
                let Some(Ok(frame)) = frame else { return };
                let Message::Text(text) = frame else { continue };
                let Some(start) = &start else { continue };
                if !text.contains("\"type\":\"signal\"") {
                    continue;
                }
                if start.window == 0 {
                    if ws.send(signal(&start.partner)).await.is_err() {
                        return;
                    }
                } else {
                    echoes.fetch_add(1, Ordering::Relaxed);
                    if Instant::now() < start.deadline && ws.send(signal(&start.partner)).await.is_err() {
                        return;
                    }
                }
            }
            command = &mut control, if start.is_none() => {
                let Ok(command) = command else { continue };
                for _ in 0..command.window {
                    if ws.send(signal(&command.partner)).await.is_err() {
                        return;
                    }
                }
                start = Some(command);
            }
        }
    }
}

struct ServerChild {
    child: tokio::process::Child,
    secret_path: PathBuf,
}

impl ServerChild {
    async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
        let _ = std::fs::remove_file(&self.secret_path);
    }
}

async fn start_server(
    connections: usize,
    per_room: usize,
) -> Result<(String, Secret, ServerChild)> {
    let secret_path = std::env::temp_dir().join(format!(
        "cairn-signal-bench-{}-{}.secret",
        std::process::id(),
        rand::random::<u64>()
    ));
    let _ = std::fs::remove_file(&secret_path);
    let secret = Secret::create_file(&secret_path)?;
    let exe = std::env::current_exe().context("locating this executable")?;
    let mut child = tokio::process::Command::new(exe)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--no-mdns",
            "--secret-file",
        ])
        .arg(&secret_path)
        .args(["--max-connections", &(connections + 16).to_string()])
        .args(["--max-peers-per-room", &(per_room + 8).to_string()])
        // The bench measures the server, not its flood protection.
        .args(["--rate", "1000000", "--burst", "1000000"])
        .args(["--ping-secs", "300", "--idle-secs", "600"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting the server")?;
    let stdout = child.stdout.take().context("server stdout")?;
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .context("server did not start in 20 s")??
        .context("server exited at start")?;
    let url = line
        .strip_prefix("cairn-signal listening on ")
        .context("unexpected first line from the server")?
        .trim()
        .to_owned();
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((url, secret, ServerChild { child, secret_path }))
}

fn ensure_loopback(url: &str) -> Result<()> {
    let request = url.into_client_request()?;
    let host = request.uri().host().context("no host in --url")?;
    let host = host.trim_matches(['[', ']']);
    let loopback = host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        bail!("the benchmark only targets loopback addresses, not {host}");
    }
    Ok(())
}

fn room_name(index: usize) -> String {
    format!("bench-{index}")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Resident set size of a process, from procfs (Linux).
fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

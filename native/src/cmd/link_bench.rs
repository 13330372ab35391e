//! `cairn bench link`: RTT and throughput of a peer link between two native
//! peers on loopback (an in-process cairn-signal sets it up), beside a plain
//! TCP socket on the same machine in the same run.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use cairn_engine::protocol::{DType, Message, Tensor};
use cairn_native::link::{IceServer, IceTransportPolicy, Link, LinkConfig, Mesh, MeshEvent};
use cairn_signal::token::{Claims, Role, issue};
use cairn_signal::{MdnsMode, Server, SignalConfig};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

#[derive(clap::Args)]
pub struct Args {
    /// Round trips timed (after 50 warm-up ones).
    #[arg(long, default_value_t = 1000)]
    round_trips: usize,
    /// MiB sent per message size.
    #[arg(long, default_value_t = 64)]
    mib: usize,
    /// Message sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = [4096usize, 65536, 8 << 20])]
    sizes: Vec<usize>,
    /// Target size of UDP datagrams (576..=1500).
    #[arg(long, default_value_t = str0m_mtu())]
    mtu: usize,
    /// Data channel buffered-amount high water, KiB (str0m's send buffer).
    #[arg(long)]
    high_water_kib: Option<usize>,
    /// Largest data channel message (frame), KiB.
    #[arg(long)]
    frame_kib: Option<usize>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Relay the link through a TURN server on loopback started in this
    /// process (relay-only candidates): the relay path's figures.
    #[arg(long)]
    relay: bool,
}

const fn str0m_mtu() -> usize {
    1150
}

const WAIT: Duration = Duration::from_secs(60);

pub fn run(args: Args) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(bench(args))
}

struct SizeResult {
    bytes: usize,
    link_mb_s: f64,
    tcp_mb_s: f64,
}

async fn bench(args: Args) -> Result<()> {
    if args.sizes.is_empty() || args.round_trips == 0 {
        bail!("nothing to measure");
    }
    let server = Server::bind(SignalConfig {
        listen: "127.0.0.1:0".parse()?,
        mdns: MdnsMode::Off,
        ..SignalConfig::default()
    })
    .await?;
    let token = || {
        issue(
            server.secret(),
            &Claims::new("bench", Role::Worker, Duration::from_secs(3600)),
        )
    };
    let mut config = LinkConfig {
        probe_interval: None,
        mtu: args.mtu,
        ..LinkConfig::loopback()
    };
    if let Some(h) = args.high_water_kib {
        config.flow.high_water = h << 10;
        config.flow.low_water = h << 9;
    }
    if let Some(f) = args.frame_kib {
        config.frame_bytes = f << 10;
    }
    let _turn = if args.relay {
        let (turn, addr) = loopback_turn().await?;
        config.ice_servers = vec![IceServer {
            urls: vec![format!("turn:{addr}")],
            username: Some(TURN_USER.into()),
            credential: Some(TURN_USER.into()),
        }];
        config.ice_transport_policy = IceTransportPolicy::Relay;
        Some(turn)
    } else {
        None
    };
    let mut a = Mesh::join(&server.url(), "bench", &token(), config.clone()).await?;
    let mut b = Mesh::join(&server.url(), "bench", &token(), config).await?;
    b.connect(a.local_id());
    let setup = Instant::now();
    let mut link_b = up(&mut b).await?;
    let mut link_a = up(&mut a).await?;
    let setup = setup.elapsed();

    // Echo on b: tokens come back as they are; anything else is counted and
    // acknowledged with one token once `expect` bytes have arrived.
    let echo = tokio::spawn(async move {
        let mut received = 0u64;
        loop {
            let Ok(m) = link_b.recv().await else { return };
            match m {
                Message::Token { .. } => {
                    let echoed = link_b.send(m).await;
                    if echoed.is_err() {
                        return;
                    }
                }
                Message::Activations { tensor, seq, .. } => {
                    received += tensor.bytes().len() as u64;
                    if seq == u32::MAX {
                        let ack = Message::Token {
                            request: received,
                            seq: 0,
                            step: 0,
                            id: 0,
                            passed_on: false,
                        };
                        received = 0;
                        if link_b.send(ack).await.is_err() {
                            return;
                        }
                    }
                }
                _ => {}
            }
        }
    });

    let mut rtts = Vec::with_capacity(args.round_trips);
    for i in 0..args.round_trips + 50 {
        let t = Instant::now();
        link_a
            .send(Message::Token {
                request: 0,
                seq: i as u32,
                step: 0,
                id: 1,
                passed_on: false,
            })
            .await?;
        let back = timeout(WAIT, link_a.recv())
            .await
            .context("echo timed out")??;
        if !matches!(back, Message::Token { seq, .. } if seq == i as u32) {
            bail!("unexpected echo {}", back.kind());
        }
        if i >= 50 {
            rtts.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    rtts.sort_by(f64::total_cmp);
    let pct = |p: f64| rtts[((rtts.len() - 1) as f64 * p).round() as usize];
    let (p50, p99) = (pct(0.5), pct(0.99));

    let mut results = Vec::new();
    for &size in &args.sizes {
        let total = (args.mib << 20).max(size);
        let count = total.div_ceil(size);
        let link_mb_s = link_throughput(&mut link_a, size, count).await?;
        let tcp_mb_s = tcp_throughput(size, count).await?;
        results.push(SizeResult {
            bytes: size,
            link_mb_s,
            tcp_mb_s,
        });
    }
    let stats = link_a.stats();
    link_a.close("bench done");
    echo.abort();

    if args.json {
        let sizes: Vec<_> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "message_bytes": r.bytes,
                    "throughput_mb_s": round2(r.link_mb_s),
                    "tcp_throughput_mb_s": round2(r.tcp_mb_s),
                })
            })
            .collect();
        let out = serde_json::json!({
            "rtt_p50_ms": round3(p50),
            "rtt_p99_ms": round3(p99),
            "round_trips": rtts.len(),
            "ping_rtt_ms": stats.rtt_smoothed.map(|d| round3(d.as_secs_f64() * 1e3)),
            "setup_ms": round2(setup.as_secs_f64() * 1e3),
            "frame_bytes": link_a.max_frame_bytes(),
            "mtu": args.mtu,
            "relayed": stats.relayed,
            "mib_per_size": args.mib,
            "throughput": sizes,
        });
        println!("{out}");
    } else {
        println!(
            "peer link on loopback (str0m, data channel frames of {} bytes, mtu {}{})",
            link_a.max_frame_bytes(),
            args.mtu,
            if stats.relayed {
                ", through a TURN relay"
            } else {
                ""
            }
        );
        println!(
            "setup (offer to both hellos): {:.1} ms",
            setup.as_secs_f64() * 1e3
        );
        println!(
            "RTT over {} round trips: p50 {p50:.3} ms, p99 {p99:.3} ms",
            rtts.len()
        );
        println!(
            "{:>12} {:>14} {:>14} {:>8}",
            "message", "link MB/s", "TCP MB/s", "TCP/link"
        );
        for r in &results {
            println!(
                "{:>12} {:>14.1} {:>14.1} {:>8.2}",
                human(r.bytes),
                r.link_mb_s,
                r.tcp_mb_s,
                r.tcp_mb_s / r.link_mb_s
            );
        }
    }
    Ok(())
}

async fn up(mesh: &mut Mesh) -> Result<Link> {
    loop {
        match timeout(WAIT, mesh.next_event()).await {
            Ok(Some(MeshEvent::LinkUp(link))) => return Ok(link),
            Ok(Some(MeshEvent::LinkDown { error, .. })) => bail!("link failed: {error}"),
            Ok(Some(_)) => {}
            Ok(None) => bail!("mesh ended"),
            Err(_) => bail!("no link within {WAIT:?}"),
        }
    }
}

/// Sends `count` messages of `size` bytes and waits for the peer's
/// acknowledgement of the last; MB/s (10^6 bytes) over the whole transfer.
async fn link_throughput(link: &mut Link, size: usize, count: usize) -> Result<f64> {
    let payload = vec![0xa5u8; size];
    let start = Instant::now();
    for i in 0..count {
        let seq = if i + 1 == count { u32::MAX } else { i as u32 };
        let tensor = Tensor::new(DType::U8, vec![size as u64], payload.clone())?;
        link.send(Message::Activations {
            request: 1,
            seq,
            pos0: 0,
            tensor,
        })
        .await?;
    }
    let ack = timeout(WAIT, link.recv()).await.context("no ack")??;
    let elapsed = start.elapsed().as_secs_f64();
    match ack {
        Message::Token { request, .. } if request == (size * count) as u64 => {}
        other => bail!("unexpected ack {other:?}"),
    }
    Ok((size * count) as f64 / 1e6 / elapsed)
}

/// The same transfer over a plain TCP socket on loopback: length-prefixed
/// messages, one acknowledgement byte at the end.
async fn tcp_throughput(size: usize, count: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; size];
        for _ in 0..count {
            let mut len = [0u8; 4];
            s.read_exact(&mut len).await?;
            let n = u32::from_le_bytes(len) as usize;
            if n != size {
                anyhow::bail!("bad length");
            }
            s.read_exact(&mut buf).await?;
        }
        s.write_all(&[1]).await?;
        Ok(())
    });
    let mut s = TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let payload = vec![0xa5u8; size];
    let start = Instant::now();
    for _ in 0..count {
        // One copy per message, as the link makes one when it frames.
        let mut message = Vec::with_capacity(4 + size);
        message.extend_from_slice(&(size as u32).to_le_bytes());
        message.extend_from_slice(&payload);
        s.write_all(&message).await?;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack).await?;
    let elapsed = start.elapsed().as_secs_f64();
    reader.await??;
    Ok((size * count) as f64 / 1e6 / elapsed)
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

const TURN_USER: &str = "bench";

/// The bench's TURN server accepts one user whose password is its name.
struct BenchAuth;

impl turn::auth::AuthHandler for BenchAuth {
    fn auth_handle(
        &self,
        username: &str,
        realm: &str,
        _src: std::net::SocketAddr,
    ) -> std::result::Result<Vec<u8>, turn::Error> {
        if username == TURN_USER {
            Ok(turn::auth::generate_auth_key(username, realm, TURN_USER))
        } else {
            Err(turn::Error::ErrFakeErr)
        }
    }
}

/// A TURN server (the `turn` crate's) on loopback, relaying on loopback.
async fn loopback_turn() -> Result<(turn::server::Server, std::net::SocketAddr)> {
    use std::sync::Arc;
    use turn::relay::relay_static::RelayAddressGeneratorStatic;
    use turn::server::config::{ConnConfig, ServerConfig};
    let conn = Arc::new(tokio::net::UdpSocket::bind("127.0.0.1:0").await?);
    let addr = conn.local_addr()?;
    let server = turn::server::Server::new(ServerConfig {
        conn_configs: vec![ConnConfig {
            conn,
            relay_addr_generator: Box::new(RelayAddressGeneratorStatic {
                relay_address: std::net::IpAddr::from([127, 0, 0, 1]),
                address: "127.0.0.1".into(),
                net: Arc::new(webrtc_util::vnet::net::Net::new(None)),
            }),
        }],
        realm: "cairn-bench".into(),
        auth_handler: Arc::new(BenchAuth),
        channel_bind_timeout: Duration::ZERO,
        alloc_close_notify: None,
    })
    .await
    .context("starting the TURN server")?;
    Ok((server, addr))
}

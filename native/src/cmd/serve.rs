//! `cairn serve`: the coordinator, its HTTP API and dashboard; by default
//! also an embedded cairn-signal and a local worker, so one command serves
//! the default model.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::Router;
use axum::extract::Request;
use axum::response::IntoResponse;
use cairn_engine::model::Split;
use cairn_engine::placement::{Stage, StageSplit};
use cairn_native::audit::{AuditLog, Event, log as audit_log};
use cairn_native::coord::join::{JoinTokens, Session, Sessions};
use cairn_native::coord::{Coordinator, CoordinatorOptions, SpotConfig, api};
use cairn_native::link::LinkConfig;
use cairn_native::worker::{self, WorkerOptions};
use cairn_signal::{
    Claims, HealthCheck, MdnsMode, Role, Server, SessionEvent, SessionObserver, SignalConfig,
};
use tower::ServiceExt;

use crate::cmd::ice_args::IceArgs;
use crate::cmd::signal_args::{parse_signal, resolve_room};
use crate::loading::{self, DeviceArgs};

#[derive(clap::Args)]
pub struct Args {
    /// Address of the HTTP API, dashboard and (when embedded) cairn-signal.
    /// Loopback unless told otherwise: an address others can reach (or
    /// --lan) needs an API key, and one is made and printed if none is given.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Listen on every interface (port of --listen) and announce the
    /// embedded cairn-signal over mDNS.
    #[arg(long)]
    lan: bool,
    /// GGUF model (default: $CAIRN_MODEL, then the default model's cache location).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Use this cairn-signal instead of an embedded one (ws://HOST:PORT as it prints it, with
    /// or without /ws?room=...; http(s):// works too).
    #[arg(long, requires = "token")]
    signal: Option<String>,
    /// Coordinator token for --signal.
    #[arg(long, env = "CAIRN_TOKEN")]
    token: Option<String>,
    /// A worker token for the join URL shown to browsers (with --signal).
    #[arg(long)]
    join_token: Option<String>,
    /// Room of the cluster (default: the one in --signal's URL, else the token's, else main).
    #[arg(long)]
    room: Option<String>,
    /// Run only the coordinator: no worker in this process.
    #[arg(long)]
    no_local_worker: bool,
    /// The local worker's device.
    #[command(flatten)]
    device: DeviceArgs,
    /// Bytes the local worker offers (default: a share of its device's memory).
    #[arg(long)]
    memory_budget: Option<u64>,
    /// How a local worker over several devices (`--device a,b`) spreads its stage over
    /// them: `layers` (each device a run of the layers), `tensor` (each device a part of
    /// every layer's heads and feed-forward rows) or `auto` (tensor on GPUs that read each
    /// other's memory, for models 4,096 wide and up; layers otherwise).
    #[arg(long, default_value = "auto")]
    split: Split,
    /// Manual placement: PEER:FIRST-LAST,... (inclusive layer numbers; `PEER:0-29/tensor`
    /// splits a worker's layers over its devices by tensors).
    #[arg(long)]
    placement: Option<String>,
    /// The admin key: `Authorization: Bearer KEY` on the API, placement and
    /// join tokens.
    #[arg(long, env = "CAIRN_API_KEY")]
    api_key: Option<String>,
    /// A key that may only read: the cluster's state, events and metrics.
    #[arg(long, env = "CAIRN_READ_KEY", requires = "api_key")]
    read_key: Option<String>,
    /// An origin (`https://app.example`) whose pages may call the API from a
    /// browser; repeatable. Without it no CORS headers are sent.
    #[arg(long = "allow-origin")]
    allow_origins: Vec<String>,
    /// Seconds a join token (the join URL's) is valid; the URL is renewed
    /// at half of it.
    #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(u64).range(60..=30 * 24 * 3600))]
    join_ttl: u64,
    /// Where the signaling secret, revoked tokens, join tokens and the audit
    /// log (audit.jsonl; `cairn audit verify`) are kept (default:
    /// $CAIRN_STATE_DIR, $XDG_STATE_HOME/cairn, ~/.local/state/cairn).
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// A worker that joins waits, neither calibrated nor placed, until the
    /// admin approves it on the dashboard or with
    /// `POST /api/workers/ID/approve` (`/reject`); approval holds for its
    /// token for this run. On by default when listening beyond loopback
    /// without --api-key (the key is then generated); `--approve-workers=false`
    /// turns it off.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", require_equals = true)]
    approve_workers: Option<bool>,
    /// The share of generated tokens recomputed on the coordinator's own
    /// engine (cpu, the whole model, loaded at the first check) before they
    /// go out; a worker whose token is wrong is evicted and the request
    /// recovers without it. 0 turns checks off, 1 checks every token.
    #[arg(long, default_value_t = SpotConfig::DEFAULT_RATE, value_parser = rate)]
    spot_check_rate: f64,
    /// How far (in logits) a worker's token may fall below the trusted
    /// device's choice and still count as a tie between backends.
    #[arg(long, default_value_t = SpotConfig::DEFAULT_TOLERANCE)]
    spot_check_tolerance: f32,
    /// Context positions per request (prompt and completion).
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// Requests served at once, batched together on every stage; more wait in a queue
    /// (up to 32 per place, then 503). Placement budgets KV memory for this many.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Seconds a request waits for a placement before failing.
    #[arg(long, default_value_t = 120)]
    wait_timeout: u64,
    /// This server's base URL as workers and phones reach it (default: from the LAN address).
    #[arg(long)]
    public_url: Option<String>,
    /// Do not announce the embedded cairn-signal on the LAN (it is only
    /// announced with --lan or --mdns).
    #[arg(long)]
    no_mdns: bool,
    /// Announce the embedded cairn-signal over mDNS whatever the listen
    /// address (--lan does so already).
    #[arg(long, conflicts_with = "no_mdns")]
    mdns: bool,
    /// STUN and TURN servers for the links.
    #[command(flatten)]
    ice: IceArgs,
}

/// `PEER:0-14,PEER:15-29` (inclusive) as stages.
pub fn parse_placement(s: &str) -> Result<Vec<Stage>> {
    s.split(',')
        .map(|part| {
            // `PEER:FIRST-LAST`, with `/tensor` for a worker over several devices that
            // splits every layer across them.
            let (part, split) = if let Some(p) = part.strip_suffix("/tensor") {
                (p, StageSplit::Tensor)
            } else {
                (
                    part.strip_suffix("/layers").unwrap_or(part),
                    StageSplit::Layers,
                )
            };
            let (peer, range) = part
                .rsplit_once(':')
                .with_context(|| format!("'{part}' is not PEER:FIRST-LAST"))?;
            let (a, b) = range
                .split_once('-')
                .with_context(|| format!("'{range}' is not FIRST-LAST"))?;
            let start: usize = a
                .trim()
                .parse()
                .with_context(|| format!("bad layer '{a}'"))?;
            let last: usize = b
                .trim()
                .parse()
                .with_context(|| format!("bad layer '{b}'"))?;
            if last < start {
                bail!("'{range}': the last layer comes before the first");
            }
            Ok(Stage {
                device: peer.trim().to_owned(),
                start,
                end: last + 1,
                split,
            })
        })
        .collect()
}

/// The address others reach this host at: the listen address, or the first
/// LAN address when listening on all of them.
fn reachable_ip(listen: &SocketAddr) -> IpAddr {
    if !listen.ip().is_unspecified() {
        return listen.ip();
    }
    if_addrs::get_if_addrs()
        .ok()
        .and_then(|ifs| {
            ifs.into_iter()
                .filter(|i| !i.is_loopback())
                .map(|i| i.ip())
                .find(|ip| ip.is_ipv4())
        })
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

pub fn run(a: Args) -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    let result = rt.block_on(serve(a));
    // A local worker's step may still compute on a blocking thread: stop
    // without waiting for it.
    rt.shutdown_timeout(Duration::from_secs(1));
    result
}

/// Whether joining workers wait for the admin's approval: as the operator
/// said, else on when others can reach the API and the operator chose no
/// key (issue 21: a LAN without a key is where a leaked join URL lets a
/// stranger's device in unseen).
fn approval_by_default(asked: Option<bool>, exposed: bool, key_given: bool) -> bool {
    asked.unwrap_or(exposed && !key_given)
}

/// A fresh admin key: 32 random bytes as hex.
fn generate_key() -> String {
    use rand::RngCore as _;
    let mut raw = [0u8; 32];
    rand::rng().fill_bytes(&mut raw);
    raw.iter().map(|b| format!("{b:02x}")).collect()
}

async fn serve(mut a: Args) -> Result<()> {
    let external_signal = a.signal.as_deref().map(parse_signal).transpose()?;
    let room = resolve_room(
        a.room.as_deref(),
        external_signal.as_ref().and_then(|p| p.room.as_deref()),
        a.token.as_deref().filter(|_| a.signal.is_some()),
    )?;
    let external_signal = external_signal.map(|p| p.url);
    let model = crate::model_path::resolve(a.model.clone())?;
    if a.lan {
        a.listen = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), a.listen.port());
    }
    let exposed = !a.listen.ip().is_loopback();
    let approve_workers = approval_by_default(a.approve_workers, exposed, a.api_key.is_some());
    let mut generated_key = None;
    if exposed && a.api_key.is_none() {
        let key = generate_key();
        generated_key = Some(key.clone());
        a.api_key = Some(key);
    }
    let state_dir = cairn_native::state_dir::resolve(a.state_dir.clone())
        .context("creating the state directory (--state-dir)")?;
    let secret = cairn_signal::Secret::load_or_create(&state_dir.join("signal.secret"))
        .context("the signaling secret in the state directory")?;
    let manual = a.placement.as_deref().map(parse_placement).transpose()?;
    let audit = Arc::new(
        AuditLog::open(&state_dir, audit_log::DEFAULT_CAP).unwrap_or_else(|e| {
            tracing::error!(error = %e, dir = %state_dir.display(), "cannot open the audit log; serving without one");
            AuditLog::off()
        }),
    );
    audit.record(Event::Start {
        version: env!("CARGO_PKG_VERSION").into(),
        listen: a.listen.to_string(),
        room: room.clone(),
        api_key: a.api_key.is_some(),
        read_key: a.read_key.is_some(),
        approve_workers,
    });
    let sessions = Arc::new(Sessions::default());
    // The router is built once the coordinator exists; the embedded server
    // starts first (the coordinator joins through it), so it forwards to a
    // router filled in later.
    let late: Arc<OnceLock<Router>> = Arc::new(OnceLock::new());
    // The embedded server's `/healthz` reports the coordinator's readiness
    // once there is a coordinator.
    let late_coord: Arc<OnceLock<Arc<cairn_native::coord::Shared>>> = Arc::new(OnceLock::new());
    let health = {
        let late_coord = late_coord.clone();
        HealthCheck(Arc::new(move || match late_coord.get() {
            Some(shared) => shared.health(),
            None => Err("starting".into()),
        }))
    };
    let forward = {
        let late = late.clone();
        Router::new().fallback(move |request: Request| {
            let late = late.clone();
            async move {
                match late.get() {
                    Some(r) => r.clone().oneshot(request).await.into_response(),
                    None => {
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, "starting\n").into_response()
                    }
                }
            }
        })
    };
    let (signal_url, token, worker_token, local_addr, server, trusted_token) =
        match &external_signal {
            Some(url) => {
                let token = a.token.clone().context("--signal needs --token")?;
                (
                    url.clone(),
                    token,
                    a.join_token.clone(),
                    a.listen,
                    None,
                    None,
                )
            }
            None => {
                let server = Server::bind(SignalConfig {
                    listen: a.listen,
                    secret: secret.clone(),
                    mdns: if (a.lan || a.mdns) && !a.no_mdns {
                        MdnsMode::Lan
                    } else {
                        MdnsMode::Off
                    },
                    revocations_file: Some(state_dir.join("revoked")),
                    extra_routes: Some(forward.clone()),
                    health: Some(health),
                    observer: Some(observer(audit.clone(), sessions.clone())),
                    ..SignalConfig::default()
                })
                .await
                .with_context(|| format!("starting cairn-signal on {}", a.listen))?;
                // Both live in this process and are never shown.
                let ttl = cairn_signal::token::MAX_TTL;
                let coordinator = cairn_signal::token::issue(
                    server.secret(),
                    &Claims::new(&room, Role::Coordinator, ttl),
                );
                // The local worker's own token: what it computes is trusted
                // (spot checks never blame it), so no one else may hold it.
                let local_claims = Claims::new(&room, Role::Worker, ttl);
                let local_worker = cairn_signal::token::issue(server.secret(), &local_claims);
                let addr = server.local_addr();
                (
                    server.url(),
                    coordinator,
                    Some(local_worker),
                    addr,
                    Some(server),
                    (!a.no_local_worker).then_some(local_claims.jti),
                )
            }
        };
    let ip = reachable_ip(&local_addr);
    let host = SocketAddr::new(ip, local_addr.port());
    let public_url = a
        .public_url
        .clone()
        .unwrap_or_else(|| format!("http://{host}"));
    // Browsers on other machines reach the embedded server at the LAN address.
    let browser_signal = if a.signal.is_some() {
        signal_url.clone()
    } else {
        format!("ws://{host}")
    };
    let join_prefix = format!(
        "{public_url}/join?signal={}&room={}&token=",
        urlencode(&browser_signal),
        urlencode(&room)
    );
    // With an outside signaling server the join URL carries the token given
    // for it; the embedded one's are issued here, short-lived.
    let join_url = match &server {
        Some(_) => None,
        None => a.join_token.as_ref().map(|t| format!("{join_prefix}{t}")),
    };
    let join_tokens = server.as_ref().map(|s| {
        Arc::new(
            JoinTokens::new(
                secret.clone(),
                &room,
                Duration::from_secs(a.join_ttl),
                s.revoker(),
                join_prefix.clone(),
                Some(state_dir.join("tokens.json")),
            )
            .with_audit(audit.clone()),
        )
    });
    let mut link = if ip.is_loopback() {
        LinkConfig::loopback()
    } else {
        LinkConfig::default()
    };
    a.ice.apply(&mut link);
    let coord = Coordinator::start(CoordinatorOptions {
        model_path: model.clone(),
        signal_url: signal_url.clone(),
        room: room.clone(),
        token,
        public_url: public_url.clone(),
        join_url: join_url.clone(),
        join_tokens: join_tokens.clone(),
        link: link.clone(),
        ctx: a.ctx,
        parallel: a.parallel,
        manual,
        api_key: a.api_key.clone(),
        read_key: a.read_key.clone(),
        allow_origins: a.allow_origins.clone(),
        model_cap: Some(secret.derive(&format!("model:{}", model.display()))),
        wait_timeout: Duration::from_secs(a.wait_timeout),
        step_timeout: Duration::from_secs(120),
        audit: audit.clone(),
        approve_workers,
        sessions: server.as_ref().map(|_| sessions.clone()),
        spot: SpotConfig {
            rate: a.spot_check_rate,
            tolerance: a.spot_check_tolerance,
            seed: rand::random(),
        },
        trusted_token,
        engine: a.device.engine.options(),
    })
    .await?;
    let _ = late_coord.set(coord.shared.clone());
    let router = api::router(coord.shared.clone());
    if a.signal.is_some() {
        let listener = tokio::net::TcpListener::bind(a.listen)
            .await
            .with_context(|| format!("listening on {}", a.listen))?;
        // The same connection limits as the embedded server's, so one client cannot hold
        // every connection of the API.
        tokio::spawn(cairn_signal::serve_limited(
            listener,
            router,
            cairn_signal::Limits::default(),
        ));
    } else {
        let _ = late.set(router);
    }
    if !a.no_local_worker {
        let Some(wt) = worker_token.clone() else {
            bail!("a local worker needs a worker token: pass --join-token, or --no-local-worker");
        };
        let devices = loading::open_devices(&a.device)?;
        let opts = WorkerOptions {
            signal_url: signal_url.clone(),
            room: room.clone(),
            token: wt,
            model: Some(model.clone()),
            cache_dir: None,
            link,
            memory_budget: a.memory_budget,
            split: a.split,
        };
        tokio::spawn(async move {
            if let Err(e) = worker::serve(devices, opts, None).await {
                tracing::error!(error = %format!("{e:#}"), "the local worker stopped");
            }
        });
    }
    println!(
        "cairn serve: model {} ({})",
        coord.shared.model.name,
        model.display()
    );
    println!("dashboard:   {public_url}/");
    println!("api:         {public_url}/v1/chat/completions");
    println!("signal:      {signal_url} (room {room})");
    if exposed {
        println!(
            "listening:   on {} — reachable from other machines; the API needs the key",
            a.listen
        );
    } else {
        println!(
            "listening:   on {} (this machine only; --lan to let other devices in)",
            a.listen
        );
    }
    if let Some(key) = &generated_key {
        println!("api key:     {key} (generated for this run; pass --api-key to choose one)");
    }
    if let Some(j) = coord.shared.join_url() {
        println!("join:        {j}");
    }
    if approve_workers {
        println!(
            "approval:    workers wait for the admin's approval on the dashboard before they are placed{}",
            if a.approve_workers.is_none() {
                " (the default on a LAN without --api-key; --approve-workers=false turns it off)"
            } else {
                ""
            }
        );
    }
    if let Some(t) = &join_tokens {
        println!(
            "join tokens: valid {} s; `cairn token list|new|revoke` manage them",
            t.ttl().as_secs()
        );
    }
    let _server = server;
    shutdown_asked().await?;
    audit.record(Event::Stop);
    audit.close();
    Ok(())
}

/// Ctrl-C, or (on Unix) SIGTERM as a service manager sends: either ends
/// `serve` with the audit log's `stop` record written.
async fn shutdown_asked() -> Result<()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r?,
            _ = term.recv() => {}
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await?;
        Ok(())
    }
}

/// Records the embedded signaling server's sessions: who joined with which
/// token from where, who was refused, who left.
fn observer(audit: Arc<AuditLog>, sessions: Arc<Sessions>) -> SessionObserver {
    SessionObserver(Arc::new(move |event| {
        match &event {
            SessionEvent::Joined {
                peer_id,
                token_id,
                addr,
                ..
            } => sessions.joined(
                peer_id.clone(),
                Session {
                    token_id: token_id.clone(),
                    addr: *addr,
                },
            ),
            SessionEvent::Left { peer_id, .. } => sessions.left(peer_id),
            SessionEvent::Refused { .. } => {}
        }
        audit.record(match event {
            SessionEvent::Joined {
                peer_id,
                role,
                token_id,
                addr,
                ..
            } => Event::Joined {
                peer: peer_id.to_string(),
                role: role.as_str().to_owned(),
                token_id: Some(token_id),
                addr: addr.map(|a| a.to_string()),
            },
            SessionEvent::Refused {
                token_id,
                addr,
                reason,
                ..
            } => Event::JoinRefused {
                reason,
                token_id,
                addr: addr.map(|a| a.to_string()),
            },
            SessionEvent::Left {
                peer_id, token_id, ..
            } => Event::Left {
                peer: peer_id.to_string(),
                token_id: Some(token_id),
            },
        });
    }))
}

fn urlencode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `--spot-check-rate`: a share, 0 to 1.
fn rate(s: &str) -> Result<f64, String> {
    let r: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&r) {
        Ok(r)
    } else {
        Err("a share from 0 to 1".into())
    }
}

#[cfg(test)]
mod tests {
    use super::{Args, StageSplit, approval_by_default, parse_placement};
    use clap::Parser as _;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn approval(argv: &[&str]) -> bool {
        let cli = Cli::try_parse_from(std::iter::once("serve").chain(argv.iter().copied()))
            .expect("the flags parse");
        let exposed = cli.args.lan || !cli.args.listen.ip().is_loopback();
        approval_by_default(
            cli.args.approve_workers,
            exposed,
            cli.args.api_key.is_some(),
        )
    }

    #[test]
    fn workers_wait_for_approval_by_default_only_on_a_lan_without_a_key() {
        assert!(!approval(&[]), "loopback: no approval unless asked");
        assert!(approval(&["--approve-workers"]));
        assert!(approval(&["--lan"]), "a LAN without a key");
        assert!(approval(&["--listen", "0.0.0.0:8080"]));
        assert!(
            !approval(&["--lan", "--api-key", "k"]),
            "the operator chose a key"
        );
        assert!(approval(&["--lan", "--api-key", "k", "--approve-workers"]));
        assert!(
            !approval(&["--lan", "--approve-workers=false"]),
            "turned off"
        );
        assert!(approval(&["--approve-workers=true"]));
    }

    #[test]
    fn placements_parse_inclusive_ranges() {
        let t = parse_placement("gpus:0-29/tensor,b:30-31/layers").unwrap();
        assert_eq!(
            t.iter()
                .map(|s| (s.start, s.end, s.split))
                .collect::<Vec<_>>(),
            [(0, 30, StageSplit::Tensor), (30, 32, StageSplit::Layers)]
        );
        let p = parse_placement("a:0-14,b:15-29").unwrap();
        assert_eq!((p[0].device.as_str(), p[0].start, p[0].end), ("a", 0, 15));
        assert_eq!((p[1].device.as_str(), p[1].start, p[1].end), ("b", 15, 30));
        assert!(parse_placement("a:3-1").is_err());
        assert!(parse_placement("a").is_err());
        assert!(parse_placement("a:x-2").is_err());
    }
}

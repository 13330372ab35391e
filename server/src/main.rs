//! `cairn-signal`: serve, issue and revoke tokens, create secrets and
//! certificates, find servers on the LAN, and load-test a server.

mod bench;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use cairn_signal::client::ServerTrust;
use cairn_signal::config::DEFAULT_PORT;
use cairn_signal::token::{Claims, MAX_TTL, Role, Secret, issue, valid_room};
use cairn_signal::{Limits, MdnsMode, Server, SignalConfig, TlsMode};
use clap::{Args, Parser, Subcommand, ValueEnum};
use tracing::{info, warn};

#[derive(Parser)]
#[command(name = "cairn-signal", version, about = "Cairn's signaling server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server.
    Serve(ServeArgs),
    /// Print a join token.
    Token {
        #[arg(long)]
        secret_file: PathBuf,
        #[arg(long)]
        room: String,
        #[arg(long, value_enum)]
        role: JoinRole,
        /// Lifetime in seconds (at most 30 days).
        #[arg(long, default_value_t = 86_400)]
        ttl: u64,
        /// Also print the token's id (what `revoke` takes) on stderr.
        #[arg(long)]
        show_id: bool,
    },
    /// Revoke a token by id on a running server; its sessions drop at once.
    Revoke {
        #[arg(long)]
        secret_file: PathBuf,
        /// The token's id (its `jti`, shown by `token --show-id`).
        #[arg(long)]
        id: String,
        /// The running server.
        #[arg(long, default_value_t = format!("http://127.0.0.1:{DEFAULT_PORT}"))]
        server: String,
        /// Pin the server's certificate fingerprint (self-signed servers).
        #[arg(long)]
        fingerprint: Option<String>,
    },
    /// Create a new secret file (32 random bytes as hex, mode 0600).
    Secret {
        #[arg(long)]
        out: PathBuf,
    },
    /// Write a self-signed certificate for this host's names and addresses,
    /// to reuse across restarts with --tls-cert/--tls-key.
    Cert {
        #[arg(long)]
        cert: PathBuf,
        #[arg(long)]
        key: PathBuf,
        /// Extra DNS names or IP addresses to include.
        #[arg(long = "name")]
        names: Vec<String>,
    },
    /// Browse the LAN for servers announced over mDNS.
    Discover {
        #[arg(long, default_value_t = 3)]
        seconds: u64,
    },
    /// Load-test a server on loopback (starts one unless --url is given).
    Bench(bench::BenchArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum JoinRole {
    Worker,
    Coordinator,
    Observer,
}

impl From<JoinRole> for Role {
    fn from(role: JoinRole) -> Self {
        match role {
            JoinRole::Worker => Role::Worker,
            JoinRole::Coordinator => Role::Coordinator,
            JoinRole::Observer => Role::Observer,
        }
    }
}

#[derive(Args)]
struct ServeArgs {
    #[arg(long, default_value_t = SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT)))]
    listen: SocketAddr,
    /// Secret for tokens; without it a random one is kept in memory.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Directory served at `/` (the browser worker's page).
    #[arg(long = "static")]
    static_dir: Option<PathBuf>,
    #[arg(long, requires = "tls_key", conflicts_with = "tls_self_signed")]
    tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Generate a certificate for this host's LAN addresses at start.
    #[arg(long)]
    tls_self_signed: bool,
    #[arg(long)]
    no_mdns: bool,
    /// Keep revoked token ids in this file across restarts.
    #[arg(long)]
    revocations: Option<PathBuf>,
    #[command(flatten)]
    limits: LimitArgs,
}

#[derive(Args)]
struct LimitArgs {
    #[arg(long, default_value_t = Limits::default().max_frame_bytes)]
    max_frame_bytes: usize,
    #[arg(long, default_value_t = Limits::default().max_meta_bytes)]
    max_meta_bytes: usize,
    #[arg(long, default_value_t = Limits::default().max_peers_per_room)]
    max_peers_per_room: usize,
    #[arg(long, default_value_t = Limits::default().max_connections)]
    max_connections: usize,
    #[arg(long, default_value_t = Limits::default().max_http_connections)]
    max_http_connections: usize,
    /// Plain HTTP connections one address may hold at once.
    #[arg(long, default_value_t = Limits::default().max_http_connections_per_addr)]
    max_http_connections_per_addr: usize,
    /// WebSocket sessions one address may hold at once.
    #[arg(long, default_value_t = Limits::default().max_sessions_per_addr)]
    max_sessions_per_addr: usize,
    /// WebSocket sessions one token may hold at once.
    #[arg(long, default_value_t = Limits::default().max_sessions_per_token)]
    max_sessions_per_token: usize,
    /// Sustained messages per second per connection (a meta update costs one per peer it reaches).
    #[arg(long, default_value_t = Limits::default().messages_per_sec)]
    rate: u32,
    /// Burst above the sustained rate.
    #[arg(long, default_value_t = Limits::default().message_burst)]
    burst: u32,
    #[arg(long, default_value_t = Limits::default().ping_interval.as_secs())]
    ping_secs: u64,
    #[arg(long, default_value_t = Limits::default().idle_timeout.as_secs())]
    idle_secs: u64,
    #[arg(long, default_value_t = Limits::default().write_timeout.as_secs())]
    write_timeout_secs: u64,
    /// Messages queued towards one client before it is dropped as too slow.
    #[arg(long, default_value_t = Limits::default().send_queue)]
    send_queue: usize,
    /// Bytes queued towards one client before it is dropped as too slow.
    #[arg(long, default_value_t = Limits::default().send_queue_bytes)]
    send_queue_bytes: usize,
    #[arg(long, default_value_t = Limits::default().handshake_timeout.as_secs())]
    handshake_secs: u64,
}

impl From<&LimitArgs> for Limits {
    fn from(a: &LimitArgs) -> Self {
        Limits {
            max_frame_bytes: a.max_frame_bytes,
            max_meta_bytes: a.max_meta_bytes,
            max_peers_per_room: a.max_peers_per_room,
            max_connections: a.max_connections,
            max_http_connections: a.max_http_connections,
            max_http_connections_per_addr: a.max_http_connections_per_addr,
            max_sessions_per_addr: a.max_sessions_per_addr,
            max_sessions_per_token: a.max_sessions_per_token,
            messages_per_sec: a.rate,
            message_burst: a.burst,
            ping_interval: Duration::from_secs(a.ping_secs),
            idle_timeout: Duration::from_secs(a.idle_secs),
            write_timeout: Duration::from_secs(a.write_timeout_secs),
            send_queue: a.send_queue,
            send_queue_bytes: a.send_queue_bytes,
            handshake_timeout: Duration::from_secs(a.handshake_secs),
            ..Limits::default()
        }
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(run(cli.command))
}

async fn run(command: Command) -> Result<()> {
    match command {
        Command::Serve(args) => serve(args).await,
        Command::Token {
            secret_file,
            room,
            role,
            ttl,
            show_id,
        } => {
            if !valid_room(&room) {
                bail!("invalid room name {room:?}: use 1-64 of A-Z a-z 0-9 . _ -");
            }
            if ttl == 0 || ttl > MAX_TTL.as_secs() {
                bail!("--ttl must be between 1 and {} seconds", MAX_TTL.as_secs());
            }
            let secret = read_secret(&secret_file)?;
            let claims = Claims::new(room, role.into(), Duration::from_secs(ttl));
            if show_id {
                eprintln!("token id: {}", claims.jti);
            }
            println!("{}", issue(&secret, &claims));
            Ok(())
        }
        Command::Revoke {
            secret_file,
            id,
            server,
            fingerprint,
        } => {
            let secret = read_secret(&secret_file)?;
            let trust = fingerprint.map_or(ServerTrust::PublicRoots, ServerTrust::Fingerprint);
            let response = cairn_signal::admin::revoke_remote(&server, &secret, &id, &trust)
                .await
                .with_context(|| format!("revoking on {server}"))?;
            println!(
                "revoked {}; dropped {} live session(s)",
                response.id, response.dropped
            );
            Ok(())
        }
        Command::Secret { out } => {
            Secret::create_file(&out)?;
            println!("wrote a new secret to {}", out.display());
            Ok(())
        }
        Command::Cert { cert, key, names } => {
            let mut all = cairn_signal::tls::local_names();
            all.extend(names);
            let generated = cairn_signal::tls::generate_self_signed(&all)?;
            write_new(&cert, generated.cert_pem.as_bytes(), 0o644)?;
            write_new(&key, generated.key_pem.as_bytes(), 0o600)?;
            println!("names: {}", all.join(", "));
            println!("SHA-256 fingerprint: {}", generated.fingerprint);
            Ok(())
        }
        Command::Discover { seconds } => {
            let found = cairn_signal::mdns::discover(Duration::from_secs(seconds.min(60))).await?;
            if found.is_empty() {
                println!("no cairn-signal server announced itself");
            }
            for server in found {
                println!(
                    "{}  {}  fingerprint={}",
                    server.url,
                    server.instance,
                    server.fingerprint.as_deref().unwrap_or("-")
                );
            }
            Ok(())
        }
        Command::Bench(args) => bench::run(args).await,
    }
}

fn read_secret(path: &Path) -> Result<Secret> {
    Secret::read_file(path).with_context(|| format!("secret file {}", path.display()))
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    use std::io::Write as _;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let mut file = options
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))
}

async fn serve(args: ServeArgs) -> Result<()> {
    let limits = Limits::from(&args.limits);
    raise_fd_limit(limits.max_connections + limits.max_http_connections + 64);
    let (secret, generated) = match &args.secret_file {
        Some(path) => (read_secret(path)?, false),
        None => (Secret::generate(), true),
    };
    let tls = match (&args.tls_cert, &args.tls_key, args.tls_self_signed) {
        (Some(cert), Some(key), _) => TlsMode::Files {
            cert: cert.clone(),
            key: key.clone(),
        },
        (_, _, true) => TlsMode::SelfSigned,
        _ => TlsMode::Off,
    };
    let config = SignalConfig {
        listen: args.listen,
        secret: secret.clone(),
        static_dir: args.static_dir,
        tls,
        mdns: if args.no_mdns {
            MdnsMode::Off
        } else {
            MdnsMode::Lan
        },
        revocations_file: args.revocations,
        limits,
        extra_routes: None,
        health: None,
        observer: None,
    };
    let server = Server::bind(config).await?;
    // Plain lines on stdout for people and scripts (the bench reads the first).
    println!("cairn-signal listening on {}", server.url());
    if let Some(fp) = server.fingerprint() {
        println!("TLS certificate SHA-256 fingerprint: {fp}");
    }
    if generated {
        warn!(
            "no --secret-file: using a random secret kept in memory; tokens die with this process"
        );
        let claims = Claims::new("default", Role::Coordinator, Duration::from_secs(86_400));
        println!(
            "coordinator token for room 'default' (24 h): {}",
            issue(&secret, &claims)
        );
    }
    wait_for_signal().await;
    info!("shutting down");
    server.shutdown().await;
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(error) => {
                warn!(%error, "cannot listen for SIGTERM; Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Each connection is a file descriptor; the usual soft limit (1024) would
/// cap the server far below `max_connections`.
pub(crate) fn raise_fd_limit(wanted: usize) {
    match rlimit::increase_nofile_limit(wanted as u64) {
        Ok(got) if (got as usize) < wanted => warn!(
            got,
            wanted, "file descriptor limit is lower than the configured connections need"
        ),
        Ok(_) => {}
        Err(error) => warn!(%error, "cannot raise the file descriptor limit"),
    }
}

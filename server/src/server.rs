//! The server handle, its accept loop and its router.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{StatusCode, header};
use axum::routing::{get, post};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::config::{MdnsMode, SignalConfig, TlsMode};
use crate::limits::{Limits, TokenRates};
use crate::mdns::Announcement;
use crate::quota::Quota;
use crate::room::Hub;
use crate::token::Secret;
use crate::{SignalError, admin, session, static_files, tls};

/// How long `shutdown` waits for sessions and connections to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// The address of the client a request came from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Remote(pub IpAddr);

/// What every request handler shares.
pub(crate) struct AppState {
    pub secret: Secret,
    pub limits: Limits,
    pub hub: Arc<Hub>,
    /// One permit per WebSocket session.
    pub sessions: Arc<Semaphore>,
    /// WebSocket sessions per client address and per token id.
    pub sessions_per_addr: Quota<IpAddr>,
    pub sessions_per_token: Quota<String>,
    /// Messages per token, shared by its sessions.
    pub token_rates: TokenRates,
    pub tracker: TaskTracker,
    pub observer: Option<crate::config::SessionObserver>,
}

/// A running signaling server. Dropping it stops accepting connections and
/// closes sessions; [`Server::shutdown`] also waits for them to finish.
/// Revokes tokens on a running [`Server`] (persisted when it has a
/// revocations file); cheap to clone.
#[derive(Clone)]
pub struct Revoker(Arc<Hub>);

impl Revoker {
    /// Revokes a token by id and drops its live sessions; how many were.
    pub fn revoke(&self, token_id: &str) -> usize {
        let dropped = self.0.revoke(token_id);
        info!(token_id, dropped, "token revoked");
        dropped
    }

    pub fn is_revoked(&self, token_id: &str) -> bool {
        self.0.is_revoked(token_id)
    }
}

impl std::fmt::Debug for Revoker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Revoker")
    }
}

pub struct Server {
    local_addr: SocketAddr,
    tls: bool,
    fingerprint: Option<String>,
    state: Arc<AppState>,
    stop: CancellationToken,
    tracker: TaskTracker,
    mdns: Option<Announcement>,
}

impl Server {
    /// Binds the listener, starts serving and (unless off) announces the
    /// server over mDNS.
    pub async fn bind(config: SignalConfig) -> crate::Result<Server> {
        let SignalConfig {
            listen,
            secret,
            static_dir,
            tls: tls_mode,
            mdns,
            revocations_file,
            limits,
            extra_routes,
            health,
            observer,
        } = config;
        limits.validate().map_err(SignalError::Config)?;
        let tls = match &tls_mode {
            TlsMode::Off => None,
            TlsMode::Files { cert, key } => Some(tls::load_files(cert, key)?),
            TlsMode::SelfSigned => Some(tls::self_signed()?),
        };
        if let Some(dir) = &static_dir
            && !dir.is_dir()
        {
            return Err(SignalError::Config(format!(
                "static directory {} does not exist",
                dir.display()
            )));
        }
        let hub = Hub::new(&limits, revocations_file)?;
        let listener = bind_listener(listen).map_err(|source| SignalError::Bind {
            addr: listen,
            source,
        })?;
        let local_addr = listener.local_addr()?;
        let tracker = TaskTracker::new();
        let state = Arc::new(AppState {
            secret,
            sessions: Arc::new(Semaphore::new(limits.max_connections)),
            sessions_per_addr: Quota::new(limits.max_sessions_per_addr),
            sessions_per_token: Quota::new(limits.max_sessions_per_token),
            token_rates: TokenRates::new(&limits),
            limits: limits.clone(),
            hub,
            tracker: tracker.clone(),
            observer,
        });

        let mut router = Router::new()
            .route(
                "/healthz",
                get(move || {
                    let verdict = health.as_ref().map_or(Ok(()), |check| (check.0)());
                    async move {
                        match verdict {
                            Ok(()) => (StatusCode::OK, "ok\n".to_owned()),
                            Err(why) => (
                                StatusCode::SERVICE_UNAVAILABLE,
                                format!("unhealthy: {why}\n"),
                            ),
                        }
                    }
                }),
            )
            .route("/ws", get(session::ws_handler))
            .route(
                "/admin/revoke",
                post(admin::revoke_handler).layer(DefaultBodyLimit::max(4096)),
            )
            .with_state(Arc::clone(&state));
        if let Some(material) = &tls {
            let pem = material.cert_pem.clone();
            // Lets a phone download the certificate to install and trust it.
            router = router.route(
                "/cairn-signal.crt",
                get(move || async move {
                    ([(header::CONTENT_TYPE, "application/x-x509-ca-cert")], pem)
                }),
            );
        }
        if let Some(extra) = extra_routes {
            router = router.merge(extra);
        }
        if let Some(dir) = &static_dir {
            router = router.fallback_service(static_files::service(dir));
        }

        let stop = CancellationToken::new();
        let acceptor = tls
            .as_ref()
            .map(|m| tokio_rustls::TlsAcceptor::from(Arc::clone(&m.config)));
        tokio::spawn(accept_loop(
            listener,
            router,
            acceptor,
            limits.clone(),
            stop.clone(),
            tracker.clone(),
        ));

        let fingerprint = tls.as_ref().map(|m| m.fingerprint.clone());
        let scheme = if tls.is_some() { "wss" } else { "ws" };
        info!(url = %format!("{scheme}://{local_addr}"), tls = tls.is_some(), "listening");
        let mdns = match mdns {
            MdnsMode::Off => None,
            MdnsMode::Lan => {
                match Announcement::start(local_addr, tls.is_some(), fingerprint.as_deref()) {
                    Ok(announcement) => Some(announcement),
                    Err(error) => {
                        warn!(%error, "mDNS announcement failed; serving without it");
                        None
                    }
                }
            }
        };
        Ok(Server {
            local_addr,
            tls: tls.is_some(),
            fingerprint,
            state,
            stop,
            tracker,
            mdns,
        })
    }

    /// [`Server::bind`] with `router` merged into the server's routes.
    pub async fn bind_with_router(
        mut config: SignalConfig,
        router: Router,
    ) -> crate::Result<Server> {
        config.extra_routes = Some(match config.extra_routes.take() {
            Some(existing) => existing.merge(router),
            None => router,
        });
        Self::bind(config).await
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Base URL for WebSocket clients, `ws://` or `wss://`. A wildcard
    /// listen address is replaced by loopback, so the URL works on this host.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "wss" } else { "ws" };
        format!("{scheme}://{}", reachable(self.local_addr))
    }

    /// Base URL for HTTP (`http://` or `https://`): health, static files.
    pub fn http_url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", reachable(self.local_addr))
    }

    /// SHA-256 fingerprint of the TLS certificate (`AB:CD:...`), if TLS is on.
    pub fn fingerprint(&self) -> Option<String> {
        self.fingerprint.clone()
    }

    /// The secret tokens are checked against.
    pub fn secret(&self) -> &Secret {
        &self.state.secret
    }

    /// Revokes a token by id; its live sessions are dropped at once.
    /// Returns how many were.
    pub fn revoke(&self, token_id: &str) -> usize {
        let dropped = self.state.hub.revoke(token_id);
        info!(token_id, dropped, "token revoked");
        dropped
    }

    /// A handle that revokes tokens on this server while it runs.
    pub fn revoker(&self) -> Revoker {
        Revoker(self.state.hub.clone())
    }

    /// Peers currently in rooms.
    pub fn peer_count(&self) -> usize {
        self.state.hub.peer_count()
    }

    /// Stops accepting, closes every session with 1001 and waits (a few
    /// seconds at most) for connections to finish.
    pub async fn shutdown(mut self) {
        self.begin_shutdown();
        self.tracker.close();
        if tokio::time::timeout(SHUTDOWN_GRACE, self.tracker.wait())
            .await
            .is_err()
        {
            warn!("some connections did not close in time");
        }
        info!("shut down");
    }

    fn begin_shutdown(&mut self) {
        self.stop.cancel();
        self.state.hub.shut_down();
        if let Some(mdns) = self.mdns.take() {
            mdns.stop();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.begin_shutdown();
    }
}

/// Pending connections the kernel queues before `accept`. The usual 128
/// overflows when a few hundred workers reconnect at once, and each dropped
/// SYN costs its client a one-second retransmission.
const LISTEN_BACKLOG: u32 = 4096;

fn bind_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // Lets a restarted server rebind while old connections sit in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::from((Ipv4Addr::LOCALHOST, addr.port()))
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::from((Ipv6Addr::LOCALHOST, addr.port()))
        }
        _ => addr,
    }
}

/// Serves `router` on `listener` behind the signaling server's connection limits (HTTP
/// connections in all and per address, the time to send a request's head), for as long as
/// the task runs: for an HTTP service beside an outside signaling server (`cairn serve
/// --signal`), so one client cannot hold every connection there either.
pub async fn serve_limited(listener: TcpListener, router: Router, limits: Limits) {
    let tracker = TaskTracker::new();
    accept_loop(
        listener,
        router,
        None,
        limits,
        CancellationToken::new(),
        tracker,
    )
    .await;
}

async fn accept_loop(
    listener: TcpListener,
    router: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: Limits,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    // WebSocket sessions hold their own permits once upgraded, so this
    // bounds only connections still speaking HTTP.
    let http_slots = Arc::new(Semaphore::new(limits.max_http_connections));
    let per_addr = Quota::new(limits.max_http_connections_per_addr);
    loop {
        let (tcp, remote) = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Usually out of file descriptors: back off instead of spinning.
                    warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(mine) = per_addr.take(remote.ip()) else {
            debug!(%remote, "too many HTTP connections from this address; closing this one");
            continue;
        };
        let Ok(permit) = Arc::clone(&http_slots).try_acquire_owned() else {
            debug!(%remote, "too many HTTP connections; closing this one");
            continue;
        };
        let _ = tcp.set_nodelay(true);
        // Handlers see who they serve (sessions are counted per address).
        let router = router.clone().layer(axum::Extension(Remote(remote.ip())));
        let tls = tls.clone();
        let stop = stop.clone();
        let timeout = limits.handshake_timeout;
        tracker.spawn(async move {
            serve_tcp(tcp, router, tls, timeout, stop).await;
            drop(permit);
            drop(mine);
        });
    }
}

async fn serve_tcp(
    tcp: TcpStream,
    router: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    timeout: Duration,
    stop: CancellationToken,
) {
    match tls {
        None => serve_http(tcp, router, timeout, stop).await,
        Some(acceptor) => match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
            Ok(Ok(stream)) => serve_http(stream, router, timeout, stop).await,
            Ok(Err(error)) => debug!(%error, "TLS handshake failed"),
            Err(_) => debug!("TLS handshake timed out"),
        },
    }
}

async fn serve_http<I>(io: I, router: Router, header_timeout: Duration, stop: CancellationToken)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    let connection = builder
        .serve_connection(TokioIo::new(io), TowerToHyperService::new(router))
        .with_upgrades();
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(error) = result {
                debug!(%error, "HTTP connection ended with an error");
            }
        }
        () = stop.cancelled() => {
            connection.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(SHUTDOWN_GRACE, connection).await;
        }
    }
}

//! What an embedder (the coordinator) or the `serve` command configures.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use crate::limits::Limits;
use crate::protocol::PeerId;
use crate::token::{Role, Secret};

/// Where the server's TLS certificate comes from.
#[derive(Clone, Debug, Default)]
pub enum TlsMode {
    /// Plain `ws://` and `http://`: for loopback, or behind a reverse proxy
    /// that terminates TLS.
    #[default]
    Off,
    /// PEM files: a certificate chain and its private key.
    Files { cert: PathBuf, key: PathBuf },
    /// A certificate generated at start for this host's names and LAN
    /// addresses; its SHA-256 fingerprint is printed and announced.
    SelfSigned,
}

/// Whether and where the server announces itself over mDNS/DNS-SD.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MdnsMode {
    Off,
    /// On every interface, for the LAN.
    #[default]
    Lan,
}

/// Everything `Server::bind` needs.
#[derive(Clone, Debug)]
pub struct SignalConfig {
    pub listen: SocketAddr,
    /// Signs and checks join tokens. The default is a fresh random secret,
    /// which the embedder reads back to issue tokens.
    pub secret: Secret,
    /// Served at `/` when set (the browser worker's page).
    pub static_dir: Option<PathBuf>,
    pub tls: TlsMode,
    pub mdns: MdnsMode,
    /// Revoked token ids are appended here and reloaded at start, so a
    /// restart does not revive them. In memory only when `None`.
    pub revocations_file: Option<PathBuf>,
    pub limits: Limits,
    /// Routes merged into the server's router (the coordinator's own
    /// endpoints). They must not overlap `/healthz`, `/ws`, `/admin/*`.
    pub extra_routes: Option<axum::Router>,
    /// What `/healthz` reports besides the server answering at all: an
    /// embedder's own readiness (a coordinator out of its room, or with no
    /// placement that can serve, is not healthy). `Err` gives 503 and why.
    pub health: Option<HealthCheck>,
    /// Told of every session let in, refused or ended (an embedder's audit
    /// log). Called on the session's task: it must not block.
    pub observer: Option<SessionObserver>,
}

/// Who came, who was turned away, who left: for an embedder's audit log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionEvent {
    Joined {
        room: String,
        peer_id: PeerId,
        role: Role,
        token_id: String,
        addr: Option<IpAddr>,
    },
    /// A join refused before or at the room's door; `token_id` when the
    /// token was valid (revoked, for another room, over its quota).
    Refused {
        room: Option<String>,
        token_id: Option<String>,
        addr: Option<IpAddr>,
        reason: String,
    },
    Left {
        room: String,
        peer_id: PeerId,
        token_id: String,
    },
}

/// See [`SignalConfig::observer`].
#[derive(Clone)]
pub struct SessionObserver(pub std::sync::Arc<dyn Fn(SessionEvent) + Send + Sync>);

impl SessionObserver {
    pub(crate) fn tell(this: &Option<SessionObserver>, event: SessionEvent) {
        if let Some(o) = this {
            (o.0)(event);
        }
    }
}

impl std::fmt::Debug for SessionObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionObserver")
    }
}

/// An embedder's readiness for `/healthz`.
#[derive(Clone)]
pub struct HealthCheck(pub std::sync::Arc<dyn Fn() -> Result<(), String> + Send + Sync>);

impl std::fmt::Debug for HealthCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HealthCheck")
    }
}

/// The port `cairn-signal serve` listens on unless told otherwise.
pub const DEFAULT_PORT: u16 = 7777;

impl Default for SignalConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from((Ipv4Addr::UNSPECIFIED, DEFAULT_PORT)),
            secret: Secret::generate(),
            static_dir: None,
            tls: TlsMode::Off,
            mdns: MdnsMode::Lan,
            revocations_file: None,
            limits: Limits::default(),
            extra_routes: None,
            health: None,
            observer: None,
        }
    }
}

//! Peer links: WebRTC data channels between native peers (and browsers),
//! negotiated through cairn-signal, carrying the engine's wire protocol
//! (`cairn_engine::protocol`).
//!
//! - [`Mesh`] joins a signaling room and turns offers, answers and trickled
//!   ICE candidates into [`Link`]s; it re-establishes a link that died while
//!   both peers are still in the room.
//! - [`Link`] sends and receives [`Message`](cairn_engine::protocol::Message)s
//!   with backpressure, answers pings, and publishes [`LinkStats`] (RTT,
//!   jitter, loss, throughput) that the coordinator reads.
//!
//! WebRTC itself is `str0m` (sans-IO): each link is one tokio task
//! (`driver.rs`) that owns the `str0m::Rtc` and feeds the link's
//! `cairn_engine::session::Session` (hello, pings, heartbeat, probes, flow
//! control, close: the same code as the browser's); its datagrams go
//! through `transport.rs` (UDP sockets, TURN relays), and `app.rs` is its
//! end of the application's channels (`handle.rs`: [`Link`], [`LinkSender`]). See
//! `docs/architecture.md` ("Peer links") for why str0m, and
//! `docs/protocol.md` for the wire format and the measured figures.

mod app;
mod config;
mod driver;
mod gather;
mod handle;
mod mesh;
mod signal_msg;
mod stats;
mod stun;
mod transport;
mod turn;

use cairn_engine::protocol::ProtocolError;
use cairn_engine::session::SessionError;

pub use config::{IceServer, IceTransportPolicy, LinkConfig};
pub use handle::{Link, LinkSender};
pub use mesh::{Mesh, MeshEvent};
pub use signal_msg::{ICE_META_KEY, SignalPayload};
pub use stats::LinkStats;

/// Why a link (or an operation on it) failed.
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum LinkError {
    #[error("signaling: {0}")]
    Signal(String),
    /// The signaling server refused our token (revoked, expired, forged):
    /// trying again with it cannot help.
    #[error("signaling: the server refused our token: {0}")]
    Refused(String),
    #[error("WebRTC: {0}")]
    Rtc(String),
    #[error("I/O: {0}")]
    Io(String),
    #[error("protocol: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("the peer reported error {code}: {text}")]
    Remote { code: u16, text: String },
    #[error("no frame from the peer for {0:?} (heartbeat)")]
    HeartbeatTimeout(std::time::Duration),
    #[error("link not established within {0:?}")]
    ConnectTimeout(std::time::Duration),
    #[error("DTLS fingerprint in the SDP does not match the one the peer announced")]
    FingerprintMismatch,
    #[error("the peer closed the link: {0}")]
    ClosedByPeer(String),
    #[error("link closed")]
    Closed,
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("TURN server {server}: {reason}")]
    Turn { server: String, reason: String },
}

impl From<SessionError> for LinkError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Protocol(e) => LinkError::Protocol(e),
            SessionError::Remote { code, text } => LinkError::Remote { code, text },
            SessionError::HeartbeatTimeout(d) => LinkError::HeartbeatTimeout(d),
            SessionError::ConnectTimeout(d) => LinkError::ConnectTimeout(d),
            SessionError::ClosedByPeer(reason) => LinkError::ClosedByPeer(reason),
            SessionError::Closed => LinkError::Closed,
        }
    }
}

impl From<std::io::Error> for LinkError {
    fn from(e: std::io::Error) -> Self {
        LinkError::Io(e.to_string())
    }
}

impl From<str0m::RtcError> for LinkError {
    fn from(e: str0m::RtcError) -> Self {
        LinkError::Rtc(e.to_string())
    }
}

//! cairn-signal: the signaling server through which Cairn peers (native
//! workers, browser workers, the coordinator) find each other and exchange
//! WebRTC offers, answers and ICE candidates.
//!
//! The coordinator embeds it with [`Server::bind`]; native workers and the
//! coordinator talk to it with [`client::SignalClient`]. The wire protocol is
//! documented in `docs/signal.md` and typed in [`protocol`].

pub mod admin;
pub mod client;
pub mod config;
mod error;
pub mod garbage;
pub mod limits;
pub mod mdns;
pub mod protocol;
mod quota;
mod room;
mod server;
mod session;
mod static_files;
pub mod tls;
pub mod token;

pub use config::{HealthCheck, MdnsMode, SessionEvent, SessionObserver, SignalConfig, TlsMode};
pub use error::SignalError;
pub use limits::Limits;
pub use server::{Revoker, Server, serve_limited};
pub use token::{Claims, Role, Secret};

/// Result type of the library.
pub type Result<T, E = SignalError> = std::result::Result<T, E>;

//! The JSON messages exchanged over `/ws`, typed for clients, plus the
//! close codes the server uses. `docs/signal.md` describes the same.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::token::Role;

/// A peer's id, unique within the server while it is connected.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PeerId(pub String);

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl PeerId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A peer as others see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerInfo {
    pub peer_id: PeerId,
    pub role: Role,
    /// What the peer advertised with a `meta` message (capabilities).
    #[serde(default)]
    pub meta: Map<String, Value>,
}

/// Server to client.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum ServerMessage {
    /// First message of every session: your id and who is already here.
    Welcome {
        peer_id: PeerId,
        peers: Vec<PeerInfo>,
    },
    PeerJoined {
        peer: PeerInfo,
    },
    PeerLeft {
        peer_id: PeerId,
    },
    /// A peer changed its advertised `meta`.
    PeerMeta {
        peer: PeerInfo,
    },
    /// Relayed from another peer, `data` untouched.
    Signal {
        from: PeerId,
        data: Value,
    },
    /// Something the client sent was refused; the session goes on unless a
    /// close frame follows.
    Error {
        message: String,
    },
}

/// Client to server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum ClientMessage {
    /// Relay `data` (an SDP offer or answer, an ICE candidate: anything) to
    /// peer `to` in the same room.
    Signal { to: PeerId, data: Value },
    /// Replace this peer's advertised capabilities (a JSON object, size-capped).
    Meta { meta: Map<String, Value> },
}

/// Close codes the server sends, with their reasons in the close frame.
pub mod close_code {
    /// Server shutting down.
    pub const GOING_AWAY: u16 = 1001;
    /// Protocol misuse that cannot go on: message rate exceeded.
    pub const POLICY: u16 = 1008;
    /// A message over the size limit.
    pub const TOO_BIG: u16 = 1009;
    /// Nothing received within the idle timeout.
    pub const IDLE: u16 = 4000;
    /// The session's token was revoked.
    pub const REVOKED: u16 = 4001;
    /// The client did not read its messages fast enough.
    pub const TOO_SLOW: u16 = 4002;
}

/// Server-side encoding: borrows already-validated JSON fragments so relayed
/// `data` and stored `meta` are copied, never parsed again.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub(crate) enum Outgoing<'a> {
    Welcome {
        peer_id: &'a PeerId,
        peers: Vec<&'a serde_json::value::RawValue>,
    },
    PeerJoined {
        peer: &'a serde_json::value::RawValue,
    },
    PeerLeft {
        peer_id: &'a PeerId,
    },
    PeerMeta {
        peer: &'a serde_json::value::RawValue,
    },
    Signal {
        from: &'a PeerId,
        data: &'a serde_json::value::RawValue,
    },
    Error {
        message: &'a str,
    },
}

impl Outgoing<'_> {
    pub(crate) fn encode(&self) -> axum::extract::ws::Utf8Bytes {
        // Only strings and pre-validated JSON go in, so this does not fail.
        serde_json::to_string(self)
            .unwrap_or_else(|_| r#"{"type":"error","message":"internal encoding error"}"#.into())
            .into()
    }
}

#[derive(Serialize)]
pub(crate) struct PeerInfoRef<'a> {
    pub peer_id: &'a PeerId,
    pub role: Role,
    pub meta: &'a serde_json::value::RawValue,
}

/// What the server reads from a client frame before dispatching on `type`.
/// Borrowing `data` as raw JSON keeps relays from re-serializing it.
#[derive(Deserialize)]
pub(crate) struct Incoming<'a> {
    #[serde(rename = "type")]
    pub kind: Option<std::borrow::Cow<'a, str>>,
    pub to: Option<PeerId>,
    #[serde(borrow)]
    pub data: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow)]
    pub meta: Option<&'a serde_json::value::RawValue>,
}

#[cfg(test)]
mod garbage_tests {

    use super::{ClientMessage, ServerMessage};

    /// Messages that parse, to mutate.
    const SEEDS: [&str; 4] = [
        r#"{"type":"signal","to":"p1","data":{"sdp":"v=0","type":"offer"}}"#,
        r#"{"type":"meta","meta":{"role":"worker","memory":1024}}"#,
        r#"{"type":"welcome","peer_id":"p2","peers":[{"peer_id":"p1","role":"worker","meta":{}}]}"#,
        r#"{"type":"error","message":"rate limit exceeded"}"#,
    ];

    fn parse(bytes: &[u8]) {
        let _ = serde_json::from_slice::<ClientMessage>(bytes);
        let _ = serde_json::from_slice::<ServerMessage>(bytes);
    }

    /// What the server reads from peers and what peers read from the
    /// server, from random and mutated bytes: errors, never a panic (the
    /// `fuzz/` targets do the same under libFuzzer).
    #[test]
    fn random_and_mutated_signaling_messages_never_panic() {
        for body in crate::garbage::bodies(&SEEDS, 20_000, 21) {
            parse(&body);
        }
        parse("[".repeat(100_000).as_bytes());
    }
}

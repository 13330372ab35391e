//! What link setup sends through cairn-signal (inside `signal.data`). The
//! browser worker sends and reads the same JSON.

use serde::{Deserialize, Serialize};

/// The `data` of a cairn-signal `signal` message that sets up a link.
/// `session` names one attempt, so candidates of an old attempt are ignored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "link", rename_all = "kebab-case")]
pub enum SignalPayload {
    Offer {
        session: String,
        sdp: String,
    },
    Answer {
        session: String,
        sdp: String,
    },
    /// A trickled ICE candidate (`candidate:...` as in SDP).
    Candidate {
        session: String,
        candidate: String,
    },
    /// The sender gave up on `session` (refused, failed, closed).
    Bye {
        session: String,
        reason: String,
    },
}

impl SignalPayload {
    pub fn session(&self) -> &str {
        match self {
            SignalPayload::Offer { session, .. }
            | SignalPayload::Answer { session, .. }
            | SignalPayload::Candidate { session, .. }
            | SignalPayload::Bye { session, .. } => session,
        }
    }
}

/// The meta key under which each peer announces its DTLS certificate
/// fingerprint (`sha-256 AB:CD:…`) to the room.
pub const FINGERPRINT_META_KEY: &str = "dtls_fingerprint";

/// The meta key under which an offerer that shares its STUN/TURN servers
/// announces them: `{"servers": [RTCIceServer…], "policy": "all"|"relay"}`.
/// Browsers answering its offers build their `RTCConfiguration` from it, so
/// `cairn serve --turn … --relay-only` reaches browser workers through the
/// relay too. Room members hold the room's token, which already lets them
/// serve the model, so the TURN credential is no wider secret than that.
pub const ICE_META_KEY: &str = "ice";

/// The `a=fingerprint` of an SDP, normalized (see [`normalize_fingerprint`]).
pub fn sdp_fingerprint(sdp: &str) -> Option<String> {
    sdp.lines()
        .find_map(|l| l.trim().strip_prefix("a=fingerprint:"))
        .map(normalize_fingerprint)
}

/// Lower-case hash name, one space, upper-case hex pairs.
pub fn normalize_fingerprint(f: &str) -> String {
    let mut parts = f.split_whitespace();
    let hash = parts.next().unwrap_or_default().to_ascii_lowercase();
    let hex = parts.next().unwrap_or_default().to_ascii_uppercase();
    format!("{hash} {hex}")
}

/// The `a=max-message-size` of an SDP; RFC 8841 says 64 KiB when absent and
/// 0 means "no limit" (we then keep our own).
pub fn sdp_max_message_size(sdp: &str) -> Option<u64> {
    sdp.lines()
        .find_map(|l| l.trim().strip_prefix("a=max-message-size:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_tagged_json() {
        let p = SignalPayload::Candidate {
            session: "s1".into(),
            candidate: "candidate:1 1 udp 1 127.0.0.1 5 typ host".into(),
        };
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["link"], "candidate");
        assert_eq!(serde_json::from_value::<SignalPayload>(v).unwrap(), p);
    }

    #[test]
    fn sdp_fields() {
        let sdp = "v=0\r\na=fingerprint:SHA-256 ab:cd\r\na=max-message-size:262144\r\n";
        assert_eq!(sdp_fingerprint(sdp).as_deref(), Some("sha-256 AB:CD"));
        assert_eq!(sdp_max_message_size(sdp), Some(262144));
        assert_eq!(sdp_max_message_size("v=0"), None);
    }
}

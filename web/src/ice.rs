//! The STUN/TURN servers a coordinator shares with the browsers that answer its offers
//! (the native side's `ICE_META_KEY`, docs/architecture.md "Peer links"). Pure data, so it
//! is tested natively; `link.rs` turns it into an `RTCConfiguration`.

use serde::{Deserialize, Serialize};

/// The meta key under which the coordinator shares its STUN/TURN servers (the native
/// `ICE_META_KEY`): `{"servers": [RTCIceServer…], "policy": "all"|"relay"}`.
pub const ICE_META_KEY: &str = "ice";

/// One STUN or TURN server, as `RTCIceServer` takes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IceServer {
    pub urls: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
}

/// The ICE servers and candidate policy an offerer asks its answerers to use.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct IceConfig {
    #[serde(default)]
    pub servers: Vec<IceServer>,
    /// Only relay candidates (`iceTransportPolicy: "relay"`).
    #[serde(default, rename = "policy", deserialize_with = "relay_policy")]
    pub relay_only: bool,
}

fn relay_policy<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    match String::deserialize(d)?.as_str() {
        "relay" => Ok(true),
        "all" => Ok(false),
        other => Err(serde::de::Error::custom(format!(
            "ICE policy '{other}' is neither 'all' nor 'relay'"
        ))),
    }
}

impl IceConfig {
    /// The offerer's shared servers from its room meta; `None` when it shares none.
    pub fn from_meta(meta: Option<&serde_json::Value>) -> Result<Option<IceConfig>, String> {
        let Some(v) = meta else {
            return Ok(None);
        };
        let c: IceConfig = serde_json::from_value(v.clone())
            .map_err(|e| format!("the coordinator's ICE servers are malformed: {e}"))?;
        for s in &c.servers {
            if let Some(u) = s.urls.iter().find(|u| {
                !["stun:", "stuns:", "turn:", "turns:"]
                    .iter()
                    .any(|p| u.starts_with(p))
            }) {
                return Err(format!("'{u}' is not a stun: or turn: URL"));
            }
        }
        if c.relay_only && c.servers.iter().all(|s| s.username.is_none()) {
            return Err("relay-only links, but no TURN server with credentials".into());
        }
        Ok(Some(c))
    }
}

#[cfg(test)]
mod tests {
    use super::{ICE_META_KEY, IceConfig};
    use serde_json::json;

    #[test]
    fn shared_ice_servers_parse_and_bad_ones_are_refused() {
        assert_eq!(IceConfig::from_meta(None), Ok(None));
        let relay = json!({"servers": [{"urls": ["turn:10.0.0.1:3478?transport=udp"],
            "username": "u", "credential": "p"}], "policy": "relay"});
        // As the join page finds it: under its key in the offerer's meta.
        let mut meta = serde_json::Map::new();
        meta.insert(ICE_META_KEY.into(), relay);
        let c = IceConfig::from_meta(meta.get(ICE_META_KEY))
            .unwrap()
            .unwrap();
        assert!(c.relay_only);
        assert_eq!(c.servers[0].username.as_deref(), Some("u"));
        let stun = json!({"servers": [{"urls": ["stun:10.0.0.1"]}], "policy": "all"});
        assert!(
            !IceConfig::from_meta(Some(&stun))
                .unwrap()
                .unwrap()
                .relay_only
        );

        let cases = [
            (
                json!({"servers": [{"urls": ["http://x"]}], "policy": "all"}),
                "http://x",
            ),
            (json!({"servers": [], "policy": "sometimes"}), "sometimes"),
            (
                json!({"servers": [{"urls": ["stun:x"]}], "policy": "relay"}),
                "credentials",
            ),
            (json!({"servers": "turn:x"}), "malformed"),
        ];
        for (meta, says) in cases {
            let e = IceConfig::from_meta(Some(&meta)).unwrap_err();
            assert!(e.contains(says), "{meta}: {e}");
        }
    }
}

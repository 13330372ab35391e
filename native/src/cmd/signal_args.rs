//! `--signal` and `--room` the way people paste them: the server's address as it prints it
//! (`ws://host:port`), a join URL with `/ws?room=...`, or an http(s) form; the room from the
//! URL or else from the token's claims when `--room` is not given.

use anyhow::{Result, bail};

/// The room when neither `--room`, the URL nor the token names one.
pub const DEFAULT_ROOM: &str = "main";

/// A `--signal` value split into the server's base URL and the room its query names.
#[derive(Debug, PartialEq, Eq)]
pub struct SignalArg {
    /// `ws://` or `wss://`, host, port and any path prefix, without `/ws` or a query.
    pub url: String,
    pub room: Option<String>,
}

/// Reads `ws://host:port`, `ws://host:port/ws?room=r`, `http(s)://...` (turned into
/// `ws(s)://`), or a bare `host:port` (taken as `ws://`).
pub fn parse_signal(raw: &str) -> Result<SignalArg> {
    let raw = raw.trim();
    let (scheme, rest) = match raw.split_once("://") {
        Some(("ws" | "http", rest)) => ("ws", rest),
        Some(("wss" | "https", rest)) => ("wss", rest),
        Some((other, _)) => bail!(
            "--signal '{raw}': the scheme '{other}' is not one cairn-signal speaks; \
             pass ws://HOST:PORT (as cairn-signal prints it) or wss:// behind TLS"
        ),
        None => ("ws", raw),
    };
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let before_query = before_query.split('#').next().unwrap_or_default();
    let (authority, path) = match before_query.find('/') {
        Some(i) => before_query.split_at(i),
        None => (before_query, ""),
    };
    if authority.is_empty() {
        bail!("--signal '{raw}' names no host; pass ws://HOST:PORT");
    }
    let path = path.trim_end_matches('/');
    // The join endpoint itself is not part of the base URL: the client appends `/ws`.
    let prefix = path.strip_suffix("/ws").unwrap_or(path);
    let room = query.and_then(|q| {
        q.split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == "room")
            .map(|(_, v)| v.to_owned())
            .filter(|v| !v.is_empty())
    });
    Ok(SignalArg {
        url: format!("{scheme}://{authority}{prefix}"),
        room,
    })
}

/// The room a signaling token was issued for, read without checking its signature (the
/// server checks it): `v1.<base64url(claims)>.<tag>`.
pub fn room_from_token(token: &str) -> Option<String> {
    let mut parts = token.trim().split('.');
    let (Some("v1"), Some(payload), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let bytes = decode_base64url(payload)?;
    let claims: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    claims.get("room")?.as_str().map(str::to_owned)
}

/// The room to join: `--room`, else the URL's, else the token's, else [`DEFAULT_ROOM`]. An
/// explicit room that disagrees with the URL's is an error rather than a silent choice.
pub fn resolve_room(
    explicit: Option<&str>,
    from_url: Option<&str>,
    token: Option<&str>,
) -> Result<String> {
    if let (Some(e), Some(u)) = (explicit, from_url)
        && e != u
    {
        bail!("--room {e} disagrees with the room '{u}' in --signal; drop one of them");
    }
    Ok(explicit
        .or(from_url)
        .map(str::to_owned)
        .or_else(|| token.and_then(room_from_token))
        .unwrap_or_else(|| DEFAULT_ROOM.to_owned()))
}

fn decode_base64url(s: &str) -> Option<Vec<u8>> {
    fn value(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' => 62,
            b'_' => 63,
            _ => return None,
        } as u32)
    }
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.trim_end_matches('=').bytes() {
        acc = (acc << 6) | value(c)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use cairn_signal::token::{Secret, issue};
    use cairn_signal::{Claims, Role};

    use super::*;

    fn arg(url: &str, room: Option<&str>) -> SignalArg {
        SignalArg {
            url: url.into(),
            room: room.map(Into::into),
        }
    }

    #[test]
    fn the_forms_people_paste_all_reach_the_same_server() {
        let p = |s| parse_signal(s).expect("parses");
        assert_eq!(p("ws://10.0.0.2:8080"), arg("ws://10.0.0.2:8080", None));
        assert_eq!(p("ws://10.0.0.2:8080/"), arg("ws://10.0.0.2:8080", None));
        assert_eq!(
            p("ws://127.0.0.1:9000/ws?room=bars"),
            arg("ws://127.0.0.1:9000", Some("bars"))
        );
        assert_eq!(
            p("ws://h:1/ws?token=x&room=r2"),
            arg("ws://h:1", Some("r2"))
        );
        assert_eq!(p("http://h:1/ws"), arg("ws://h:1", None));
        assert_eq!(
            p("https://example.org/signal/ws?room=a"),
            arg("wss://example.org/signal", Some("a"))
        );
        assert_eq!(p("h:7"), arg("ws://h:7", None));
        assert_eq!(p("ws://[::1]:7/ws?room="), arg("ws://[::1]:7", None));
    }

    #[test]
    fn unusable_addresses_say_what_to_pass() {
        let e = parse_signal("ftp://h:1").expect_err("refused").to_string();
        assert!(e.contains("ws://HOST:PORT"), "{e}");
        assert!(parse_signal("ws:///ws").is_err());
    }

    #[test]
    fn the_room_comes_from_the_flag_then_the_url_then_the_token() {
        let secret = Secret::generate();
        let token = issue(
            &secret,
            &Claims::new("kitchen", Role::Worker, Duration::from_secs(60)),
        );
        assert_eq!(room_from_token(&token).as_deref(), Some("kitchen"));
        assert_eq!(room_from_token("v1.%%%.x"), None);
        assert_eq!(room_from_token("not a token"), None);
        let r = |e, u, t| resolve_room(e, u, t).expect("resolves");
        assert_eq!(r(Some("a"), None, Some(token.as_str())), "a");
        assert_eq!(r(None, Some("b"), Some(token.as_str())), "b");
        assert_eq!(r(None, None, Some(token.as_str())), "kitchen");
        assert_eq!(r(None, None, Some("garbage")), DEFAULT_ROOM);
        assert_eq!(r(None, None, None), DEFAULT_ROOM);
        assert_eq!(r(Some("a"), Some("a"), None), "a");
        assert!(resolve_room(Some("a"), Some("b"), None).is_err());
    }

    #[test]
    fn base64url_decodes_with_and_without_padding() {
        assert_eq!(decode_base64url("aGk").as_deref(), Some(&b"hi"[..]));
        assert_eq!(decode_base64url("aGk=").as_deref(), Some(&b"hi"[..]));
        assert_eq!(decode_base64url("-_8").as_deref(), Some(&[0xfb, 0xff][..]));
        assert_eq!(decode_base64url("a+b"), None);
    }
}

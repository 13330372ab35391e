//! Integration tests: real servers on loopback, real WebSocket clients.
//! Every test runs with mDNS off and short limits so the suite stays fast.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use cairn_signal::client::{ClientError, ConnectOptions, ServerTrust, SignalClient};
use cairn_signal::protocol::{ClientMessage, PeerId, ServerMessage};
use cairn_signal::token::{Claims, Role, Secret, issue, unix_now};
use cairn_signal::{Limits, MdnsMode, Server, SignalConfig, TlsMode};
use futures::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::{self, Message};

/// Bound on any single wait in these tests.
const WAIT: Duration = Duration::from_secs(10);

type Ws = WebSocketStream<TcpStream>;

fn config() -> SignalConfig {
    SignalConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        mdns: MdnsMode::Off,
        ..SignalConfig::default()
    }
}

fn with_limits(limits: Limits) -> SignalConfig {
    SignalConfig { limits, ..config() }
}

async fn start(config: SignalConfig) -> Server {
    Server::bind(config).await.unwrap()
}

fn token(server: &Server, room: &str, role: Role) -> (String, Claims) {
    let claims = Claims::new(room, role, Duration::from_secs(600));
    (issue(server.secret(), &claims), claims)
}

fn worker_token(server: &Server, room: &str) -> String {
    token(server, room, Role::Worker).0
}

/// A raw WebSocket handshake; `Err` carries the HTTP refusal.
async fn raw(server: &Server, query: &str) -> Result<Ws, tungstenite::Error> {
    let addr = server.local_addr();
    let request = format!("ws://{addr}/ws?{query}").into_client_request()?;
    let tcp = TcpStream::connect(addr).await?;
    let (ws, _) = tokio_tungstenite::client_async(request, tcp).await?;
    Ok(ws)
}

/// Joins `room` with a fresh worker token and returns the socket and the
/// welcome's peer id.
async fn join(server: &Server, room: &str) -> (Ws, PeerId) {
    let query = format!("room={room}&token={}", worker_token(server, room));
    let mut ws = raw(server, &query).await.unwrap();
    let welcome = next_json(&mut ws).await;
    assert_eq!(welcome["type"], "welcome", "{welcome}");
    let id = PeerId(welcome["peer_id"].as_str().unwrap().to_owned());
    (ws, id)
}

async fn refusal(server: &Server, query: &str) -> (u16, String) {
    match raw(server, query).await {
        Err(tungstenite::Error::Http(response)) => (
            response.status().as_u16(),
            String::from_utf8_lossy(response.body().as_deref().unwrap_or_default()).into_owned(),
        ),
        Ok(_) => panic!("{query}: connection was accepted"),
        Err(other) => panic!("{query}: {other}"),
    }
}

/// The next text frame, parsed; pings and pongs are skipped.
async fn next_json(ws: &mut Ws) -> Value {
    loop {
        let frame = tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("timed out waiting for a message")
            .expect("connection ended")
            .expect("read failed");
        match frame {
            Message::Text(text) => return serde_json::from_str(&text).unwrap(),
            Message::Ping(_) | Message::Pong(_) => {}
            other => panic!("expected text, got {other:?}"),
        }
    }
}

/// Reads until the close frame; returns its code, reason and the JSON
/// messages that came before it.
async fn closed(ws: &mut Ws) -> (u16, String, Vec<Value>) {
    let mut before = Vec::new();
    loop {
        let frame = tokio::time::timeout(WAIT, ws.next())
            .await
            .expect("timed out waiting for a close")
            .expect("ended without a close frame")
            .expect("read failed");
        match frame {
            Message::Close(Some(frame)) => {
                return (frame.code.into(), frame.reason.to_string(), before);
            }
            Message::Close(None) => panic!("close frame without a code"),
            Message::Text(text) => before.push(serde_json::from_str(&text).unwrap()),
            _ => {}
        }
    }
}

async fn send_json(ws: &mut Ws, value: Value) {
    ws.send(Message::text(value.to_string())).await.unwrap();
}

async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(WAIT, tcp.read_to_string(&mut response))
        .await
        .unwrap()
        .unwrap();
    let status = response[9..12].parse().unwrap();
    let body = response.split_once("\r\n\r\n").unwrap().1.to_owned();
    (status, body)
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "cairn-signal-test-{name}-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher as _, RandomState};
    RandomState::new().hash_one(0u8)
}

#[tokio::test]
async fn health_static_files_and_extra_routes() {
    let dir = temp_dir("static");
    std::fs::write(dir.join("index.html"), "<h1>cairn worker</h1>").unwrap();
    let extra = axum::Router::new().route("/extra", axum::routing::get(|| async { "extra" }));
    let server = Server::bind_with_router(
        SignalConfig {
            static_dir: Some(dir.clone()),
            ..config()
        },
        extra,
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    assert_eq!(http_get(addr, "/healthz").await.0, 200);
    assert_eq!(
        http_get(addr, "/").await,
        (200, "<h1>cairn worker</h1>".into())
    );
    assert_eq!(http_get(addr, "/extra").await, (200, "extra".into()));
    assert_eq!(http_get(addr, "/missing.js").await.0, 404);
    assert_eq!(http_get(addr, "/../Cargo.toml").await.0 / 100, 4);
    assert!(server.url().starts_with("ws://127.0.0.1:"));
    assert_eq!(server.fingerprint(), None);
    server.shutdown().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn bad_tokens_are_refused_before_the_upgrade() {
    let server = start(config()).await;
    let room = "lab";
    let (status, reason) = refusal(&server, "room=lab").await;
    assert_eq!((status, reason.as_str()), (401, "missing token"));

    let (status, reason) = refusal(&server, "room=lab&token=v1.garbage.x").await;
    assert_eq!(status, 401, "{reason}");

    let other_secret = Secret::generate();
    let forged = issue(
        &other_secret,
        &Claims::new(room, Role::Coordinator, Duration::from_secs(60)),
    );
    let (status, reason) = refusal(&server, &format!("room=lab&token={forged}")).await;
    assert_eq!((status, reason.as_str()), (401, "invalid token signature"));

    let mut expired = Claims::new(room, Role::Worker, Duration::from_secs(60));
    expired.exp = unix_now() - 5;
    let expired = issue(server.secret(), &expired);
    let (status, reason) = refusal(&server, &format!("room=lab&token={expired}")).await;
    assert_eq!((status, reason.as_str()), (401, "token expired"));

    let elsewhere = worker_token(&server, "other-room");
    let (status, reason) = refusal(&server, &format!("room=lab&token={elsewhere}")).await;
    assert_eq!(
        (status, reason.as_str()),
        (403, "token is for another room")
    );

    let (revoked, claims) = token(&server, room, Role::Worker);
    server.revoke(&claims.jti);
    let (status, reason) = refusal(&server, &format!("room=lab&token={revoked}")).await;
    assert_eq!((status, reason.as_str()), (403, "token revoked"));

    let (admin, _) = token(&server, room, Role::Admin);
    let (status, _) = refusal(&server, &format!("room=lab&token={admin}")).await;
    assert_eq!(status, 403);

    let (status, _) = refusal(&server, "room=bad%20room&token=x").await;
    assert_eq!(status, 400);

    // The typed client reports the same refusals.
    let error = SignalClient::connect(&server.url(), room, &expired)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(error, ClientError::Refused { status: 401, ref reason } if reason == "token expired"),
        "{error}"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn relay_between_two_peers_with_the_client_helper() {
    let server = start(config()).await;
    let url = server.url();
    let mut a = SignalClient::connect(&url, "lab", &worker_token(&server, "lab"))
        .await
        .unwrap();
    assert!(a.peers().is_empty());
    let (coordinator, _) = token(&server, "lab", Role::Coordinator);
    let mut b = SignalClient::connect(&url, "lab", &coordinator)
        .await
        .unwrap();
    assert_eq!(b.peers().len(), 1);
    assert_eq!(&b.peers()[0].peer_id, a.peer_id());
    assert_eq!(b.peers()[0].role, Role::Worker);

    match tokio::time::timeout(WAIT, a.recv()).await.unwrap().unwrap() {
        ServerMessage::PeerJoined { peer } => {
            assert_eq!(&peer.peer_id, b.peer_id());
            assert_eq!(peer.role, Role::Coordinator);
        }
        other => panic!("{other:?}"),
    }

    let offer =
        json!({"sdp": "v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\n", "kind": "offer", "n": [1, 2.5, null]});
    b.send(ClientMessage::Signal {
        to: a.peer_id().clone(),
        data: offer.clone(),
    })
    .await
    .unwrap();
    assert_eq!(
        tokio::time::timeout(WAIT, a.recv()).await.unwrap().unwrap(),
        ServerMessage::Signal {
            from: b.peer_id().clone(),
            data: offer
        }
    );
    a.sender()
        .send(ClientMessage::Signal {
            to: b.peer_id().clone(),
            data: json!("answer"),
        })
        .await
        .unwrap();
    assert_eq!(
        tokio::time::timeout(WAIT, b.recv()).await.unwrap().unwrap(),
        ServerMessage::Signal {
            from: a.peer_id().clone(),
            data: json!("answer")
        }
    );
    server.shutdown().await;
}

#[tokio::test]
async fn joins_leaves_and_meta_reach_everyone_in_order() {
    let server = start(config()).await;
    let (mut a, a_id) = join(&server, "lab").await;
    send_json(
        &mut a,
        json!({"type": "meta", "meta": {"gpu": "rtx 4090", "vram_gb": 24}}),
    )
    .await;

    // Meta is applied before B's welcome is built only if it was processed
    // first; wait for the server to have it by round-tripping an error.
    send_json(&mut a, json!({"type": "ping?"})).await;
    assert_eq!(next_json(&mut a).await["type"], "error");

    let (mut b, b_id) = {
        let query = format!("room=lab&token={}", worker_token(&server, "lab"));
        let mut ws = raw(&server, &query).await.unwrap();
        let welcome = next_json(&mut ws).await;
        assert_eq!(welcome["peers"].as_array().unwrap().len(), 1);
        assert_eq!(welcome["peers"][0]["peer_id"], a_id.0.as_str());
        assert_eq!(welcome["peers"][0]["role"], "worker");
        assert_eq!(welcome["peers"][0]["meta"]["gpu"], "rtx 4090");
        (ws, PeerId(welcome["peer_id"].as_str().unwrap().to_owned()))
    };
    let joined = next_json(&mut a).await;
    assert_eq!(joined["type"], "peer-joined");
    assert_eq!(joined["peer"]["peer_id"], b_id.0.as_str());
    assert_eq!(joined["peer"]["meta"], json!({}));

    send_json(&mut b, json!({"type": "meta", "meta": {"browser": true}})).await;
    let meta = next_json(&mut a).await;
    assert_eq!(meta["type"], "peer-meta");
    assert_eq!(meta["peer"]["peer_id"], b_id.0.as_str());
    assert_eq!(meta["peer"]["meta"], json!({"browser": true}));

    let (mut c, c_id) = join(&server, "lab").await;
    let joined = next_json(&mut a).await;
    assert_eq!(
        (joined["type"].as_str(), joined["peer"]["peer_id"].as_str()),
        (Some("peer-joined"), Some(c_id.0.as_str()))
    );
    assert_eq!(next_json(&mut b).await["peer"]["peer_id"], c_id.0.as_str());

    drop(b);
    for ws in [&mut a, &mut c] {
        let left = next_json(ws).await;
        assert_eq!(left, json!({"type": "peer-left", "peer_id": b_id.0}));
    }
    // Another room sees none of it.
    let (_d, _) = join(&server, "elsewhere").await;
    server.shutdown().await;
}

#[tokio::test]
async fn peer_joined_always_precedes_that_peers_signals() {
    let server = start(config()).await;
    let (mut a, a_id) = join(&server, "order").await;
    for _ in 0..10 {
        let (mut b, b_id) = join(&server, "order").await;
        send_json(
            &mut b,
            json!({"type": "signal", "to": a_id.0, "data": {"hello": 1}}),
        )
        .await;
        let first = next_json(&mut a).await;
        assert_eq!(first["type"], "peer-joined");
        assert_eq!(first["peer"]["peer_id"], b_id.0.as_str());
        let second = next_json(&mut a).await;
        assert_eq!(
            second,
            json!({"type": "signal", "from": b_id.0, "data": {"hello": 1}})
        );
        drop(b);
        assert_eq!(next_json(&mut a).await["type"], "peer-left");
    }
    server.shutdown().await;
}

#[tokio::test]
async fn revocation_drops_a_live_session_at_once() {
    let dir = temp_dir("revocations");
    let revocations = dir.join("revoked");
    let secret = Secret::generate();
    let server = start(SignalConfig {
        secret: secret.clone(),
        revocations_file: Some(revocations.clone()),
        ..config()
    })
    .await;
    let (revoked, claims) = token(&server, "lab", Role::Worker);
    let mut a = raw(&server, &format!("room=lab&token={revoked}"))
        .await
        .unwrap();
    let a_id = next_json(&mut a).await["peer_id"].clone();
    let (mut b, _) = join(&server, "lab").await;

    // Through the admin endpoint, as `cairn-signal revoke` does.
    let response = cairn_signal::admin::revoke_remote(
        &server.http_url(),
        &secret,
        &claims.jti,
        &ServerTrust::PublicRoots,
    )
    .await
    .unwrap();
    assert_eq!(response.dropped, 1);
    let (code, reason, _) = closed(&mut a).await;
    assert_eq!((code, reason.as_str()), (4001, "token revoked"));
    assert_eq!(
        next_json(&mut b).await,
        json!({"type": "peer-left", "peer_id": a_id})
    );
    let (status, _) = refusal(&server, &format!("room=lab&token={revoked}")).await;
    assert_eq!(status, 403);

    // The admin endpoint wants an admin token signed with the secret.
    let wrong = cairn_signal::admin::revoke_remote(
        &server.http_url(),
        &Secret::generate(),
        "x",
        &ServerTrust::PublicRoots,
    )
    .await
    .err()
    .unwrap();
    assert!(
        matches!(wrong, ClientError::Refused { status: 401, .. }),
        "{wrong}"
    );

    // A restart with the same revocations file still refuses the token.
    server.shutdown().await;
    let server = start(SignalConfig {
        secret,
        revocations_file: Some(revocations),
        ..config()
    })
    .await;
    let (status, reason) = refusal(&server, &format!("room=lab&token={revoked}")).await;
    assert_eq!((status, reason.as_str()), (403, "token revoked"));
    server.shutdown().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn malformed_input_gets_errors_and_the_session_goes_on() {
    let server = start(config()).await;
    let (mut a, a_id) = join(&server, "lab").await;
    let (mut b, b_id) = join(&server, "lab").await;
    assert_eq!(next_json(&mut a).await["type"], "peer-joined");

    let cases: Vec<(Message, &str)> = vec![
        (Message::text("not json"), "malformed message"),
        (Message::text("[1,2]"), "malformed message"),
        (
            Message::text(r#"{"type":"bogus"}"#),
            "unknown message type 'bogus'",
        ),
        (Message::text(r#"{"no":"type"}"#), "message has no 'type'"),
        (
            Message::text(r#"{"type":"signal","to":"nobody","data":1}"#),
            "unknown peer 'nobody'",
        ),
        (
            Message::text(json!({"type":"signal","to":b_id.0,"data":1}).to_string()),
            "cannot signal yourself",
        ),
        (
            Message::text(r#"{"type":"signal","data":1}"#),
            "signal needs 'to' and 'data'",
        ),
        (
            Message::text(r#"{"type":"meta","meta":[1]}"#),
            "meta must be a JSON object",
        ),
        (
            Message::binary(vec![0u8, 1, 2]),
            "binary frames are not supported",
        ),
    ];
    for (message, expected) in cases {
        b.send(message).await.unwrap();
        let reply = next_json(&mut b).await;
        assert_eq!(reply["type"], "error");
        let text = reply["message"].as_str().unwrap();
        assert!(
            text.starts_with(expected),
            "{text:?} should start with {expected:?}"
        );
    }
    send_json(
        &mut b,
        json!({"type": "signal", "to": a_id.0, "data": "still here"}),
    )
    .await;
    assert_eq!(
        next_json(&mut a).await,
        json!({"type": "signal", "from": b_id.0, "data": "still here"})
    );
    server.shutdown().await;
}

#[tokio::test]
async fn oversized_frames_close_with_1009() {
    let server = start(with_limits(Limits {
        max_frame_bytes: 1024,
        ..Limits::default()
    }))
    .await;
    let (mut a, _) = join(&server, "lab").await;
    let (mut b, _) = join(&server, "lab").await;
    let big = json!({"type": "meta", "meta": {"x": "y".repeat(2048)}});
    send_json(&mut a, big).await;
    let (code, _, before) = closed(&mut a).await;
    assert_eq!(code, 1009);
    assert!(
        before
            .iter()
            .all(|m| m["type"] == "error" || m["type"] == "peer-joined")
    );
    // Everyone else is served as before.
    assert_eq!(next_json(&mut b).await["type"], "peer-left");
    send_json(&mut b, json!({"type": "signal", "to": "gone", "data": 0})).await;
    assert_eq!(next_json(&mut b).await["type"], "error");
    server.shutdown().await;
}

#[tokio::test]
async fn meta_is_size_capped() {
    let server = start(with_limits(Limits {
        max_meta_bytes: 64,
        ..Limits::default()
    }))
    .await;
    let (mut a, _) = join(&server, "lab").await;
    send_json(
        &mut a,
        json!({"type": "meta", "meta": {"notes": "n".repeat(100)}}),
    )
    .await;
    let reply = next_json(&mut a).await;
    assert!(
        reply["message"]
            .as_str()
            .unwrap()
            .starts_with("meta too large"),
        "{reply}"
    );
    send_json(&mut a, json!({"type": "meta", "meta": {"ok": true}})).await;
    send_json(&mut a, json!({"type": "x"})).await;
    // Only the unknown type errs: the small meta was accepted.
    assert!(
        next_json(&mut a).await["message"]
            .as_str()
            .unwrap()
            .starts_with("unknown")
    );
    server.shutdown().await;
}

#[tokio::test]
async fn rooms_and_the_server_have_capacity_limits() {
    let server = start(with_limits(Limits {
        max_peers_per_room: 2,
        max_connections: 3,
        ..Limits::default()
    }))
    .await;
    let (a, _) = join(&server, "small").await;
    let (_b, _) = join(&server, "small").await;
    let query = format!("room=small&token={}", worker_token(&server, "small"));
    assert_eq!(refusal(&server, &query).await, (403, "room is full".into()));

    let (_c, _) = join(&server, "other").await;
    let query = format!("room=third&token={}", worker_token(&server, "third"));
    assert_eq!(
        refusal(&server, &query).await,
        (503, "server at its connection limit".into())
    );

    // A freed place can be taken again.
    drop(a);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match raw(&server, &query).await {
            Ok(_) => break,
            Err(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    server.shutdown().await;
}

#[tokio::test]
async fn floods_are_refused_then_disconnected() {
    let server = start(with_limits(Limits {
        messages_per_sec: 5,
        message_burst: 5,
        ..Limits::default()
    }))
    .await;
    let (mut flooder, _) = join(&server, "lab").await;
    let (mut calm, calm_id) = join(&server, "lab").await;
    assert_eq!(next_json(&mut flooder).await["type"], "peer-joined");
    for _ in 0..40 {
        if flooder
            .send(Message::text(r#"{"type":"meta","meta":{}}"#))
            .await
            .is_err()
        {
            break;
        }
    }
    let (code, reason, before) = closed(&mut flooder).await;
    assert_eq!(
        (code, reason.as_str()),
        (1008, "message rate limit exceeded")
    );
    let refusals = before
        .iter()
        .filter(|m| m["message"] == "rate limit exceeded: message dropped")
        .count();
    assert!(refusals >= 1, "{before:?}");

    // The calm peer saw the flooder's accepted metas, then its departure,
    // and is still served.
    loop {
        let message = next_json(&mut calm).await;
        if message["type"] == "peer-left" {
            break;
        }
        assert_eq!(message["type"], "peer-meta");
    }
    send_json(
        &mut calm,
        json!({"type": "signal", "to": calm_id.0, "data": 0}),
    )
    .await;
    assert_eq!(
        next_json(&mut calm).await["message"],
        "cannot signal yourself"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn heartbeat_keeps_readers_and_drops_silent_clients() {
    let server = start(with_limits(Limits {
        ping_interval: Duration::from_millis(100),
        idle_timeout: Duration::from_millis(400),
        ..Limits::default()
    }))
    .await;
    let (mut silent, _) = join(&server, "lab").await;
    let (mut reader, _) = join(&server, "lab").await;

    // The reader answers pings (tungstenite does it while reading) for
    // well past the idle timeout.
    let mut pings = 0;
    let until = tokio::time::Instant::now() + Duration::from_millis(1200);
    while let Ok(frame) = tokio::time::timeout_at(until, reader.next()).await {
        match frame.unwrap().unwrap() {
            Message::Ping(_) => pings += 1,
            Message::Text(text) => {
                let value: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(value["type"], "peer-left", "{value}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(pings >= 3, "{pings} pings");
    send_json(&mut reader, json!({"type": "nope"})).await;
    assert_eq!(next_json(&mut reader).await["type"], "error");

    // The silent one never read, so never answered a ping.
    let (code, reason, _) = closed(&mut silent).await;
    assert_eq!((code, reason.as_str()), (4000, "idle timeout"));
    server.shutdown().await;
}

#[tokio::test]
async fn a_peer_that_does_not_read_is_dropped_and_memory_stays_bounded() {
    // The byte budget (three 32 KiB signals) fills before the message count.
    let server = start(with_limits(Limits {
        send_queue: 1000,
        send_queue_bytes: 100_000,
        write_timeout: Duration::from_millis(500),
        messages_per_sec: 100_000,
        message_burst: 100_000,
        ..Limits::default()
    }))
    .await;
    let (_stuck, stuck_id) = join(&server, "lab").await;
    let (mut sender, _) = join(&server, "lab").await;
    let payload = "x".repeat(32 * 1024);
    let signal = json!({"type": "signal", "to": stuck_id.0, "data": payload}).to_string();
    let mut dropped_error = false;
    let mut left = false;
    // Far more than the stuck peer's socket buffers and queue can hold.
    for _ in 0..2000 {
        sender.send(Message::text(signal.clone())).await.unwrap();
        while let Ok(Some(Ok(Message::Text(text)))) =
            tokio::time::timeout(Duration::from_millis(0), sender.next()).await
        {
            let value: Value = serde_json::from_str(&text).unwrap();
            dropped_error |= value["message"]
                .as_str()
                .is_some_and(|m| m.contains("has been dropped"));
            left |= value == json!({"type": "peer-left", "peer_id": stuck_id.0});
        }
        if left {
            break;
        }
    }
    while !left {
        let value = next_json(&mut sender).await;
        left |= value == json!({"type": "peer-left", "peer_id": stuck_id.0});
    }
    assert!(left);
    // Either the queue filled (error to the sender) or the write timed out.
    let _ = dropped_error;
    assert_eq!(server.peer_count(), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn shutdown_closes_sessions_with_1001() {
    let server = start(config()).await;
    let (mut a, _) = join(&server, "lab").await;
    let addr = server.local_addr();
    let shutdown = tokio::spawn(server.shutdown());
    let (code, reason, _) = closed(&mut a).await;
    assert_eq!((code, reason.as_str()), (1001, "server shutting down"));
    drop(a);
    tokio::time::timeout(WAIT, shutdown).await.unwrap().unwrap();
    assert!(TcpStream::connect(addr).await.is_err());
}

#[tokio::test]
async fn tls_with_a_self_signed_certificate() {
    let server = start(SignalConfig {
        tls: TlsMode::SelfSigned,
        ..config()
    })
    .await;
    let fingerprint = server.fingerprint().unwrap();
    assert_eq!(fingerprint.len(), 32 * 3 - 1);
    assert!(server.url().starts_with("wss://"));
    let pinned = ConnectOptions {
        trust: ServerTrust::Fingerprint(fingerprint.to_lowercase().replace(':', "")),
        ..ConnectOptions::default()
    };
    let url = server.url();
    let mut a = SignalClient::connect_with(&url, "tls", &worker_token(&server, "tls"), &pinned)
        .await
        .unwrap();
    let b = SignalClient::connect_with(&url, "tls", &worker_token(&server, "tls"), &pinned)
        .await
        .unwrap();
    assert!(matches!(
        tokio::time::timeout(WAIT, a.recv()).await.unwrap(),
        Some(ServerMessage::PeerJoined { .. })
    ));
    b.send(ClientMessage::Signal {
        to: a.peer_id().clone(),
        data: json!({"ice": "candidate"}),
    })
    .await
    .unwrap();
    assert!(matches!(
        tokio::time::timeout(WAIT, a.recv()).await.unwrap(),
        Some(ServerMessage::Signal { .. })
    ));

    // Not trusted by the public roots, nor under another pin.
    let error = SignalClient::connect(&url, "tls", &worker_token(&server, "tls"))
        .await
        .err()
        .unwrap();
    assert!(matches!(error, ClientError::Tls(_)), "{error}");
    let wrong = ConnectOptions {
        trust: ServerTrust::Fingerprint("00".repeat(32)),
        ..ConnectOptions::default()
    };
    let error = SignalClient::connect_with(&url, "tls", &worker_token(&server, "tls"), &wrong)
        .await
        .err()
        .unwrap();
    assert!(matches!(error, ClientError::Tls(_)), "{error}");
    server.shutdown().await;
}

#[tokio::test]
async fn tls_from_certificate_files() {
    let dir = temp_dir("tls-files");
    let generated = cairn_signal::tls::generate_self_signed(&["127.0.0.1".into()]).unwrap();
    std::fs::write(dir.join("cert.pem"), &generated.cert_pem).unwrap();
    std::fs::write(dir.join("key.pem"), &generated.key_pem).unwrap();
    let server = start(SignalConfig {
        tls: TlsMode::Files {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        },
        ..config()
    })
    .await;
    assert_eq!(
        server.fingerprint().as_deref(),
        Some(generated.fingerprint.as_str())
    );
    let pinned = ConnectOptions {
        trust: ServerTrust::Fingerprint(generated.fingerprint.clone()),
        ..ConnectOptions::default()
    };
    SignalClient::connect_with(&server.url(), "r", &worker_token(&server, "r"), &pinned)
        .await
        .unwrap();
    // The admin endpoint works over TLS too.
    let (_, claims) = token(&server, "r", Role::Worker);
    let response = cairn_signal::admin::revoke_remote(
        &server.http_url(),
        server.secret(),
        &claims.jti,
        &pinned.trust,
    )
    .await
    .unwrap();
    assert_eq!(response.dropped, 0);
    server.shutdown().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn cli_secret_token_revoke_and_graceful_serve() {
    use std::process::Command;
    let exe = env!("CARGO_BIN_EXE_cairn-signal");
    let dir = temp_dir("cli");
    let secret_file = dir.join("secret");
    let out = Command::new(exe)
        .args(["secret", "--out"])
        .arg(&secret_file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let secret = Secret::read_file(&secret_file).unwrap();

    let out = Command::new(exe)
        .args([
            "token",
            "--room",
            "lab",
            "--role",
            "worker",
            "--ttl",
            "60",
            "--show-id",
        ])
        .arg("--secret-file")
        .arg(&secret_file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let claims = cairn_signal::token::verify(&secret, &token).unwrap();
    assert_eq!((claims.room.as_str(), claims.role), ("lab", Role::Worker));
    assert!(String::from_utf8_lossy(&out.stderr).contains(&claims.jti));

    // `serve` in a child process: join with the CLI's token, revoke it with
    // the CLI, then SIGTERM.
    let mut child = tokio::process::Command::new(exe)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--no-mdns",
            "--secret-file",
        ])
        .arg(&secret_file)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let line = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let url = line
        .strip_prefix("cairn-signal listening on ")
        .unwrap()
        .to_owned();
    let mut client = SignalClient::connect(&url, "lab", &token).await.unwrap();
    let http = url.replacen("ws://", "http://", 1);
    let out = tokio::process::Command::new(exe)
        .args([
            "revoke",
            "--id",
            &claims.jti,
            "--server",
            &http,
            "--secret-file",
        ])
        .arg(&secret_file)
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("dropped 1"));
    assert_eq!(
        tokio::time::timeout(WAIT, client.recv()).await.unwrap(),
        None
    );
    assert_eq!(client.close_info().unwrap().code, 4001);

    let pid = child.id().unwrap().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// mDNS needs multicast, and this host must not multicast on its real
/// interfaces: the check runs in a fresh network namespace that holds only
/// loopback, and is skipped (with a message) where one cannot be made.
#[test]
fn mdns_announces_and_is_discovered_on_loopback() {
    use std::process::Command;
    let exe = std::env::current_exe().unwrap();
    let script = "ip link set lo up && ip link set lo multicast on \
        && ip route add 224.0.0.0/4 dev lo && exec \"$0\" \"$@\"";
    let output = Command::new("unshare")
        .args(["--net", "--", "sh", "-c", script])
        .arg(&exe)
        .args([
            "mdns_inside_namespace",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env("CAIRN_MDNS_NETNS", "1")
        .output();
    let output = match output {
        Ok(output) => output,
        Err(error) => {
            eprintln!("SKIPPED mDNS test: cannot run unshare: {error}");
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() && !stdout.contains("running 1 test") {
        eprintln!("SKIPPED mDNS test: no private network namespace here: {stderr}");
        return;
    }
    if stdout.contains("MDNS-SKIP") {
        eprintln!("SKIPPED mDNS test: multicast unavailable on loopback\n{stdout}");
        return;
    }
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("MDNS-OK"), "{stdout}\n{stderr}");
}

#[tokio::test]
#[ignore = "run by mdns_announces_and_is_discovered_on_loopback inside a network namespace"]
async fn mdns_inside_namespace() {
    if std::env::var_os("CAIRN_MDNS_NETNS").is_none() {
        println!("MDNS-SKIP: only meaningful inside the test's network namespace");
        return;
    }
    let server = start(SignalConfig {
        mdns: MdnsMode::Lan,
        tls: TlsMode::SelfSigned,
        ..config()
    })
    .await;
    let fingerprint = server.fingerprint();
    let port = server.local_addr().port();
    let mut found = Vec::new();
    for _ in 0..3 {
        found = cairn_signal::mdns::discover(Duration::from_secs(2))
            .await
            .unwrap();
        if found.iter().any(|d| d.port == port) {
            break;
        }
    }
    let Some(ours) = found.into_iter().find(|d| d.port == port) else {
        println!("MDNS-SKIP: nothing discovered");
        server.shutdown().await;
        return;
    };
    assert_eq!(ours.url, format!("wss://127.0.0.1:{port}"));
    assert_eq!(ours.fingerprint, fingerprint);
    // The announced URL and fingerprint are enough to connect.
    let pinned = ConnectOptions {
        trust: ServerTrust::Fingerprint(ours.fingerprint.unwrap()),
        ..ConnectOptions::default()
    };
    SignalClient::connect_with(&ours.url, "lan", &worker_token(&server, "lan"), &pinned)
        .await
        .unwrap();
    server.shutdown().await;
    println!("MDNS-OK");
}

/// A raw WebSocket handshake from the local address `from` (any of
/// 127.0.0.0/8 reaches the server on Linux).
async fn raw_from(server: &Server, query: &str, from: &str) -> Result<Ws, tungstenite::Error> {
    let addr = server.local_addr();
    let request = format!("ws://{addr}/ws?{query}").into_client_request()?;
    let tcp = connect_from(addr, from).await;
    let (ws, _) = tokio_tungstenite::client_async(request, tcp).await?;
    Ok(ws)
}

async fn connect_from(addr: SocketAddr, from: &str) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    socket.connect(addr).await.unwrap()
}

/// Whether the server still serves `ws`: a bad message gets its error.
async fn still_served(ws: &mut Ws) -> bool {
    send_json(ws, json!({"type": "nope"})).await;
    loop {
        let value = next_json(ws).await;
        if value["type"] == "error" {
            return value["message"] == "unknown message type 'nope'";
        }
    }
}

/// Reads whatever is waiting, until the connection is quiet for 200 ms.
async fn drain(ws: &mut Ws) -> Vec<Value> {
    let mut out = Vec::new();
    while let Ok(Some(Ok(frame))) =
        tokio::time::timeout(Duration::from_millis(200), ws.next()).await
    {
        if let Message::Text(text) = frame {
            out.push(serde_json::from_str(&text).unwrap());
        }
    }
    out
}

#[tokio::test]
async fn a_signal_flood_costs_the_flooder_not_its_target() {
    // The default limits: a queue of 256 per reader, 32 of it per sender.
    let server = start(config()).await;
    let (mut target, target_id) = join(&server, "lab").await;
    let (mut flooder, _) = join(&server, "lab").await;
    let (mut other, _) = join(&server, "lab").await;
    assert_eq!(next_json(&mut flooder).await["type"], "peer-joined");
    // 400 signals in a burst (within the flooder's rate budget) while the
    // target reads nothing: enough to overflow its whole queue before.
    let signal = json!({"type": "signal", "to": target_id.0, "data": "x"}).to_string();
    for _ in 0..400 {
        flooder.send(Message::text(signal.clone())).await.unwrap();
    }
    let replies = drain(&mut flooder).await;
    let busy = replies
        .iter()
        .filter(|m| {
            m["message"]
                .as_str()
                .is_some_and(|t| t.contains("has too many of your messages waiting"))
        })
        .count();
    let got = drain(&mut target).await;
    let signals = got.iter().filter(|m| m["type"] == "signal").count();
    // The target's session keeps moving its queue into the socket, so how
    // many get through depends on timing; none is lost without a word.
    assert!(
        busy >= 1,
        "the flooder is told when its messages are dropped"
    );
    assert_eq!(signals + busy, 400, "each signal delivered or refused");
    assert!(got.iter().all(|m| m["type"] != "peer-left"), "{got:?}");
    assert!(still_served(&mut target).await);
    // Another peer's signal still reaches the target.
    send_json(
        &mut other,
        json!({"type": "signal", "to": target_id.0, "data": "hi"}),
    )
    .await;
    loop {
        let m = next_json(&mut target).await;
        if m["type"] == "signal" && m["data"] == "hi" {
            break;
        }
    }
    assert_eq!(server.peer_count(), 3);
    server.shutdown().await;
}

#[tokio::test]
async fn a_meta_flood_costs_the_flooder_not_the_room() {
    let server = start(config()).await;
    let mut calm = Vec::new();
    for _ in 0..4 {
        calm.push(join(&server, "lab").await.0);
    }
    let (mut flooder, _) = join(&server, "lab").await;
    // Updates as fast as the socket takes them, each fanned out to four
    // peers that read nothing meanwhile; the default budget is 400 messages
    // at once and 200 a second.
    for i in 0..2000 {
        let meta = json!({"type": "meta", "meta": {"n": i}}).to_string();
        if flooder.send(Message::text(meta)).await.is_err() {
            break;
        }
    }
    let (code, reason, _) = closed(&mut flooder).await;
    assert_eq!(
        (code, reason.as_str()),
        (1008, "message rate limit exceeded")
    );
    for ws in &mut calm {
        let got = drain(ws).await;
        let metas = got.iter().filter(|m| m["type"] == "peer-meta").count();
        // Each update is charged four messages: about 100 fit the burst.
        assert!(
            metas <= 150,
            "the fan-out was charged to the flooder: {metas} updates reached one peer"
        );
        assert!(still_served(ws).await);
    }
    assert_eq!(server.peer_count(), 4);
    server.shutdown().await;
}

#[tokio::test]
async fn one_address_cannot_take_every_http_connection() {
    let server = start(with_limits(Limits {
        max_http_connections: 16,
        max_http_connections_per_addr: 8,
        handshake_timeout: Duration::from_secs(30),
        ..Limits::default()
    }))
    .await;
    let addr = server.local_addr();
    // Idle connections that never send a request, from one address.
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(connect_from(addr, "127.0.0.2").await);
    }
    // Let the server accept them all before the next one.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut ninth = connect_from(addr, "127.0.0.2").await;
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(WAIT, ninth.read(&mut buf))
        .await
        .unwrap();
    assert!(
        matches!(n, Ok(0) | Err(_)),
        "a ninth connection from the same address is closed at once"
    );
    // Everyone else is served.
    assert_eq!(http_get(addr, "/healthz").await, (200, "ok\n".into()));
    drop(held);
    server.shutdown().await;
}

/// A kept-alive connection that sends no next request is closed after the head timeout,
/// like one that never sends its first: idle sockets cannot be held.
#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_after_the_head_timeout() {
    let server = start(with_limits(Limits {
        handshake_timeout: Duration::from_secs(1),
        ..Limits::default()
    }))
    .await;
    let mut tcp = TcpStream::connect(server.local_addr()).await.unwrap();
    tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(WAIT, tcp.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    let idle = std::time::Instant::now();
    // Whatever is left of the answer, then the end of the stream.
    loop {
        let n = tokio::time::timeout(WAIT, tcp.read(&mut buf))
            .await
            .expect("the idle connection was not closed")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
    }
    assert!(
        idle.elapsed() >= Duration::from_millis(900),
        "{:?}",
        idle.elapsed()
    );
    server.shutdown().await;
}

/// Opening more sessions with one token buys no more messages: its sessions share a
/// budget of four connections (`TOKEN_RATE_SESSIONS`), while another token keeps its own.
#[tokio::test]
async fn a_tokens_sessions_share_one_message_budget() {
    let server = start(with_limits(Limits {
        messages_per_sec: 10,
        message_burst: 100,
        ..Limits::default()
    }))
    .await;
    let shared = format!("room=lab&token={}", worker_token(&server, "lab"));
    let mut sessions = Vec::new();
    for _ in 0..8 {
        let mut ws = raw(&server, &shared).await.unwrap();
        assert_eq!(next_json(&mut ws).await["type"], "welcome");
        sessions.push(ws);
    }
    let (mut alone, _) = join(&server, "lab").await;
    let nope = json!({"type": "nope"}).to_string();
    let started = std::time::Instant::now();
    // Each session alone may send its burst of 100; all eight together, 400 and 40 a second.
    for ws in &mut sessions {
        for _ in 0..100 {
            ws.send(Message::text(nope.clone())).await.unwrap();
        }
    }
    let (mut allowed, mut refused) = (0, 0);
    for ws in &mut sessions {
        let mut answers = 0;
        while answers < 100 {
            let m = next_json(ws).await;
            if m["type"] != "error" {
                continue;
            }
            answers += 1;
            match m["message"].as_str() {
                Some("unknown message type 'nope'") => allowed += 1,
                Some("rate limit exceeded: message dropped") => refused += 1,
                other => panic!("{other:?}"),
            }
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(allowed + refused, 800);
    assert!(allowed >= 400, "the token's burst is used: {allowed}");
    assert!(
        f64::from(allowed) <= 400.0 + 40.0 * elapsed + 1.0,
        "{allowed} allowed in {elapsed:.2} s"
    );
    // Another token's session still has its own burst.
    for _ in 0..100 {
        alone.send(Message::text(nope.clone())).await.unwrap();
    }
    let mut answered = 0;
    while answered < 100 {
        let m = next_json(&mut alone).await;
        if m["type"] == "error" {
            assert_eq!(m["message"], "unknown message type 'nope'");
            answered += 1;
        }
    }
    server.shutdown().await;
}

/// `cairn serve --signal` serves its API through `serve_limited`: the same per-address cap.
#[tokio::test]
async fn an_http_service_beside_an_outside_server_is_capped_per_address_too() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok\n" }));
    let limits = Limits {
        max_http_connections: 16,
        max_http_connections_per_addr: 8,
        handshake_timeout: Duration::from_secs(30),
        ..Limits::default()
    };
    let served = tokio::spawn(cairn_signal::serve_limited(listener, router, limits));
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(connect_from(addr, "127.0.0.2").await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut ninth = connect_from(addr, "127.0.0.2").await;
    let mut buf = [0u8; 16];
    let n = tokio::time::timeout(WAIT, ninth.read(&mut buf))
        .await
        .unwrap();
    assert!(
        matches!(n, Ok(0) | Err(_)),
        "a ninth connection from the same address is closed at once"
    );
    assert_eq!(http_get(addr, "/healthz").await, (200, "ok\n".into()));
    drop(held);
    served.abort();
}

#[tokio::test]
async fn sessions_are_capped_per_token_and_per_address() {
    let server = start(with_limits(Limits {
        max_sessions_per_token: 2,
        max_sessions_per_addr: 3,
        ..Limits::default()
    }))
    .await;
    let shared = worker_token(&server, "lab");
    let query = format!("room=lab&token={shared}");
    let _a = raw(&server, &query).await.unwrap();
    let _b = raw(&server, &query).await.unwrap();
    assert_eq!(
        refusal(&server, &query).await,
        (429, "too many sessions with this token".into())
    );
    // Fresh tokens from one other address: three sessions, not four.
    let mut from_two = Vec::new();
    for _ in 0..3 {
        let q = format!("room=lab&token={}", worker_token(&server, "lab"));
        from_two.push(raw_from(&server, &q, "127.0.0.2").await.unwrap());
    }
    let q = format!("room=lab&token={}", worker_token(&server, "lab"));
    match raw_from(&server, &q, "127.0.0.2").await {
        Err(tungstenite::Error::Http(response)) => assert_eq!(response.status().as_u16(), 429),
        other => panic!("a fourth session from one address: {other:?}"),
    }
    // The other address still joins.
    let (mut ws, _) = join(&server, "lab").await;
    assert!(still_served(&mut ws).await);
    // A session that ends gives its place back.
    drop(from_two.pop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let q = format!("room=lab&token={}", worker_token(&server, "lab"));
    assert!(raw_from(&server, &q, "127.0.0.2").await.is_ok());
    server.shutdown().await;
}

#[tokio::test]
async fn healthz_reports_the_embedders_readiness() {
    let ready = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let check = {
        let ready = ready.clone();
        cairn_signal::HealthCheck(std::sync::Arc::new(move || {
            if ready.load(std::sync::atomic::Ordering::Relaxed) {
                Ok(())
            } else {
                Err("no placement can serve".into())
            }
        }))
    };
    let server = start(SignalConfig {
        health: Some(check),
        ..config()
    })
    .await;
    let addr = server.local_addr();
    assert_eq!(
        http_get(addr, "/healthz").await,
        (503, "unhealthy: no placement can serve\n".into())
    );
    ready.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(http_get(addr, "/healthz").await, (200, "ok\n".into()));
    server.shutdown().await;
}

/// An embedder's observer (the coordinator's audit log) hears of each
/// session let in, with its token's id and address, of each refusal (the
/// token's id once it was valid) and of each session's end.
#[tokio::test]
async fn the_observer_hears_joins_refusals_and_departures() {
    use cairn_signal::{SessionEvent, SessionObserver};
    use std::sync::{Arc, Mutex};
    let heard: Arc<Mutex<Vec<SessionEvent>>> = Arc::default();
    let server = start(SignalConfig {
        observer: Some(SessionObserver(Arc::new({
            let heard = heard.clone();
            move |e| heard.lock().unwrap().push(e)
        }))),
        ..config()
    })
    .await;
    let (good, claims) = token(&server, "lab", Role::Worker);
    let mut ws = raw(&server, &format!("room=lab&token={good}"))
        .await
        .unwrap();
    let id = PeerId(next_json(&mut ws).await["peer_id"].as_str().unwrap().into());
    let (status, _) = refusal(&server, "room=lab&token=forged").await;
    assert_eq!(status, 401);
    server.revoke(&claims.jti);
    closed(&mut ws).await;
    let (status, _) = refusal(&server, &format!("room=lab&token={good}")).await;
    assert_eq!(status, 403);
    let loopback = Some("127.0.0.1".parse().unwrap());
    let deadline = tokio::time::Instant::now() + WAIT;
    // The session's end is told once its task finishes.
    while heard.lock().unwrap().len() < 4 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let heard = heard.lock().unwrap().clone();
    assert_eq!(
        heard[0],
        SessionEvent::Joined {
            room: "lab".into(),
            peer_id: id.clone(),
            role: Role::Worker,
            token_id: claims.jti.clone(),
            addr: loopback,
        }
    );
    assert!(
        matches!(&heard[1], SessionEvent::Refused { token_id: None, addr, .. } if *addr == loopback),
        "{heard:?}"
    );
    assert!(
        heard.contains(&SessionEvent::Left {
            room: "lab".into(),
            peer_id: id,
            token_id: claims.jti.clone(),
        }),
        "{heard:?}"
    );
    assert!(
        heard.contains(&SessionEvent::Refused {
            room: Some("lab".into()),
            token_id: Some(claims.jti.clone()),
            addr: loopback,
            reason: "token revoked".into(),
        }),
        "{heard:?}"
    );
}

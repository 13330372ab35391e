//! Peer links end to end: native peers on loopback, set up through a real
//! cairn-signal server, exchanging the engine's wire protocol over WebRTC
//! data channels. Every wait is bounded; heartbeats are short.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};

use cairn_engine::protocol::{DType, Message, Telemetry, Tensor};
use cairn_native::link::{
    IceServer, IceTransportPolicy, Link, LinkConfig, LinkError, Mesh, MeshEvent, SignalPayload,
};
use cairn_signal::client::SignalClient;
use cairn_signal::protocol::{ClientMessage, PeerId, ServerMessage};
use cairn_signal::token::{Claims, Role, issue};
use cairn_signal::{MdnsMode, Server, SignalConfig};
use cairn_tests::turn_server::{self, PASSWORD as TURN_PASSWORD, USER as TURN_USER};
use serde_json::{Map, Value};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::time::timeout;

/// Bound on any single wait (generous: the machine may be loaded).
const WAIT: Duration = Duration::from_secs(30);
const ROOM: &str = "links";
const HEARTBEAT: Duration = Duration::from_millis(1500);

fn config() -> LinkConfig {
    LinkConfig {
        ping_interval: Duration::from_millis(200),
        heartbeat_timeout: HEARTBEAT,
        probe_interval: None,
        connect_timeout: Duration::from_secs(15),
        reconnect_backoff: (Duration::from_millis(100), Duration::from_secs(1)),
        ..LinkConfig::loopback()
    }
}

async fn server() -> Server {
    Server::bind(SignalConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        mdns: MdnsMode::Off,
        ..SignalConfig::default()
    })
    .await
    .unwrap()
}

fn token(server: &Server) -> String {
    issue(
        server.secret(),
        &Claims::new(ROOM, Role::Worker, Duration::from_secs(600)),
    )
}

async fn join(server: &Server, config: LinkConfig) -> Mesh {
    Mesh::join(&server.url(), ROOM, &token(server), config)
        .await
        .unwrap()
}

async fn next_event(mesh: &mut Mesh) -> MeshEvent {
    timeout(WAIT, mesh.next_event())
        .await
        .expect("no mesh event in time")
        .expect("mesh ended")
}

async fn next_up(mesh: &mut Mesh) -> Link {
    loop {
        match next_event(mesh).await {
            MeshEvent::LinkUp(link) => return link,
            MeshEvent::LinkDown { peer, error } => eprintln!("link to {peer} down: {error}"),
            _ => {}
        }
    }
}

async fn next_down(mesh: &mut Mesh) -> LinkError {
    loop {
        if let MeshEvent::LinkDown { error, .. } = next_event(mesh).await {
            return error;
        }
    }
}

/// Two peers with a link between them (`b` offers).
async fn pair(server: &Server, config: LinkConfig) -> (Mesh, Link, Mesh, Link) {
    let mut a = join(server, config.clone()).await;
    let mut b = join(server, config).await;
    b.connect(a.local_id());
    let link_b = next_up(&mut b).await;
    let link_a = next_up(&mut a).await;
    assert_eq!(link_a.peer(), b.local_id());
    assert_eq!(link_b.peer(), a.local_id());
    (a, link_a, b, link_b)
}

async fn recv(link: &mut Link) -> Message {
    timeout(WAIT, link.recv())
        .await
        .expect("no message in time")
        .expect("link failed")
}

fn random_tensor(elements: usize, seed: u32) -> Tensor {
    // Every bit pattern, NaNs and infinities included, must survive.
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    let values: Vec<u32> = (0..elements)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        })
        .collect();
    Tensor::from_values(DType::F32, vec![elements as u64 / 1024, 1024], &values).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_of_several_mib_round_trips_bit_exact() {
    let server = server().await;
    let (_a, mut link_a, _b, mut link_b) = pair(&server, config()).await;
    let tensor = random_tensor(3 * 1024 * 1024, 7); // 12 MiB
    let sent = Message::Activations {
        request: 9,
        seq: 0,
        pos0: 128,
        tensor: tensor.clone(),
    };
    link_a.send(sent.clone()).await.unwrap();
    let got = recv(&mut link_b).await;
    assert_eq!(got, sent);
    // And back.
    link_b.send(got).await.unwrap();
    let Message::Activations { tensor: back, .. } = recv(&mut link_a).await else {
        panic!("expected activations");
    };
    assert_eq!(back.shape(), tensor.shape());
    assert!(back.bytes() == tensor.bytes(), "tensor bytes differ");
}

fn interleaved(from: u32) -> Vec<Message> {
    (0..400u32)
        .map(|i| match i % 5 {
            0 | 2 => Message::Token {
                request: u64::from(from),
                seq: i,
                step: i,
                id: i * 31,
                passed_on: i % 2 == 0,
            },
            1 => Message::Activations {
                request: u64::from(from),
                seq: i,
                pos0: i,
                tensor: random_tensor(1024 * (1 + (i as usize % 70)), i),
            },
            3 => Message::Telemetry(Box::new(Telemetry {
                queue_depth: i,
                forwards: i,
                paused: Some(format!("telemetry {i}")),
                ..Telemetry::default()
            })),
            _ => Message::Error {
                code: 4,
                text: format!("not really an error {i}"),
            },
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_holds_under_interleaved_messages_both_ways() {
    let server = server().await;
    let (_a, mut link_a, _b, mut link_b) = pair(&server, config()).await;
    // `Error` from the peer ends a link, so the application-level mix here
    // leaves it out on the wire: keep only the others.
    let keep = |m: &Message| !matches!(m, Message::Error { .. });
    let to_b: Vec<Message> = interleaved(1).into_iter().filter(keep).collect();
    let to_a: Vec<Message> = interleaved(2).into_iter().filter(keep).collect();
    let (sa, sb) = (link_a.sender(), link_b.sender());
    let (ta, tb) = (to_b.clone(), to_a.clone());
    let send_a = tokio::spawn(async move {
        for m in ta {
            sa.send(m).await.unwrap();
        }
    });
    let send_b = tokio::spawn(async move {
        for m in tb {
            sb.send(m).await.unwrap();
        }
    });
    let recv_b = tokio::spawn(async move {
        let mut got = Vec::new();
        for _ in 0..to_b.len() {
            got.push(recv(&mut link_b).await);
        }
        assert!(got == to_b, "b received out of order");
        link_b
    });
    let mut got = Vec::new();
    for _ in 0..to_a.len() {
        got.push(recv(&mut link_a).await);
    }
    assert!(got == to_a, "a received out of order");
    send_a.await.unwrap();
    send_b.await.unwrap();
    recv_b.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_frame_closes_the_link_with_an_error_and_it_comes_back() {
    let server = server().await;
    let (mut a, mut link_a, mut b, mut link_b) = pair(&server, config()).await;
    let session = link_a.session().to_owned();
    // A frame whose header claims this version, one chunk of 16 bytes, with a wrong checksum.
    let mut frame = vec![0u8; 28 + 16];
    frame[0] = cairn_engine::protocol::PROTOCOL_VERSION;
    frame[1] = 3;
    frame[12..16].copy_from_slice(&16u32.to_le_bytes());
    frame[16..24].copy_from_slice(&16u64.to_le_bytes());
    link_b.sender().send_raw_frame(frame).unwrap();
    let err = timeout(WAIT, link_a.recv()).await.unwrap().unwrap_err();
    assert!(
        matches!(err, LinkError::Protocol(_)),
        "receiver should report a protocol error, got {err}"
    );
    let err = timeout(WAIT, link_b.recv()).await.unwrap().unwrap_err();
    assert!(
        matches!(err, LinkError::Remote { .. }),
        "sender should hear about it, got {err}"
    );
    // Both processes live on, and the offering side sets the link up again.
    let mut new_b = next_up(&mut b).await;
    let mut new_a = next_up(&mut a).await;
    assert_ne!(new_a.session(), session);
    new_a
        .send(Message::Token {
            request: 1,
            seq: 0,
            step: 0,
            id: 5,
            passed_on: false,
        })
        .await
        .unwrap();
    assert!(matches!(
        recv(&mut new_b).await,
        Message::Token { id: 5, .. }
    ));
    new_b.close("done");
    assert!(matches!(
        timeout(WAIT, new_a.recv()).await.unwrap(),
        Err(LinkError::ClosedByPeer(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_network_is_detected_by_heartbeat_and_the_link_reestablished() {
    let server = server().await;
    let (mut a, link_a, mut b, _link_b) = pair(&server, config()).await;
    let first = link_a.session().to_owned();
    let cut = Instant::now();
    a.debug_blackhole(b.local_id());
    let error = next_down(&mut a).await;
    let detected = cut.elapsed();
    eprintln!("dead link detected after {detected:?}: {error}");
    assert!(
        matches!(
            error,
            LinkError::HeartbeatTimeout(_) | LinkError::Rtc(_) | LinkError::ClosedByPeer(_)
        ),
        "{error}"
    );
    assert!(
        detected < HEARTBEAT + Duration::from_secs(3),
        "{detected:?}"
    );
    // Both are still in the room: b (the offerer) offers again.
    let mut link_b = next_up(&mut b).await;
    let mut link_a = next_up(&mut a).await;
    assert_ne!(link_a.session(), first);
    link_b
        .send(Message::Token {
            request: 2,
            seq: 1,
            step: 0,
            id: 77,
            passed_on: false,
        })
        .await
        .unwrap();
    assert!(matches!(
        recv(&mut link_a).await,
        Message::Token { id: 77, .. }
    ));
    link_a
        .send(Message::Close { reason: "x".into() })
        .await
        .ok();
    let _ = timeout(Duration::from_secs(5), link_b.recv()).await;
}

/// Run as a child process by `a_killed_peer_is_detected_within_the_heartbeat_bound`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: runs only as the child of another test"]
async fn link_child_peer() {
    let (Ok(url), Ok(token), Ok(parent)) = (
        std::env::var("CAIRN_LINK_CHILD_URL"),
        std::env::var("CAIRN_LINK_CHILD_TOKEN"),
        std::env::var("CAIRN_LINK_CHILD_PARENT"),
    ) else {
        return;
    };
    let mut mesh = Mesh::join(&url, ROOM, &token, config()).await.unwrap();
    mesh.connect(&PeerId(parent));
    let _link = next_up(&mut mesh).await;
    println!("CHILD-UP");
    tokio::time::sleep(WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_is_detected_within_the_heartbeat_bound() {
    let server = server().await;
    let mut a = join(&server, config()).await;
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "link_child_peer", "--nocapture"])
        .env("CAIRN_LINK_CHILD_URL", server.url())
        .env("CAIRN_LINK_CHILD_TOKEN", token(&server))
        .env("CAIRN_LINK_CHILD_PARENT", a.local_id().as_str())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let link = next_up(&mut a).await;
    // Wait until the child says its side is up too, then kill it outright.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    timeout(WAIT, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("CHILD-UP") {
                return;
            }
        }
        panic!("child ended before its link was up");
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stats = link.stats();
    assert!(stats.rtt.is_some(), "pings should have measured an RTT");
    let killed = Instant::now();
    child.kill().await.unwrap();
    let error = next_down(&mut a).await;
    let detected = killed.elapsed();
    eprintln!("killed peer detected after {detected:?}: {error}");
    assert!(
        matches!(error, LinkError::HeartbeatTimeout(_) | LinkError::Rtc(_)),
        "{error}"
    );
    assert!(
        detected < HEARTBEAT + Duration::from_secs(3),
        "{detected:?}"
    );
    // It left the room, so nobody offers again.
    assert!(
        timeout(Duration::from_secs(2), async {
            loop {
                if let Some(MeshEvent::LinkUp(_)) = a.next_event().await {
                    return;
                }
            }
        })
        .await
        .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measurements_are_published() {
    let server = server().await;
    let (_a, link_a, _b, mut link_b) = pair(&server, config()).await;
    let mut watch = link_a.stats_watch();
    timeout(WAIT, async {
        loop {
            watch.changed().await.unwrap();
            if watch.borrow().rtt.is_some() {
                return;
            }
        }
    })
    .await
    .unwrap();
    let rate = timeout(WAIT, link_a.probe(2 * 1024 * 1024))
        .await
        .unwrap()
        .unwrap();
    assert!(rate > 1e6, "probe throughput {rate} B/s");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let s = link_a.stats();
    eprintln!("{s:?}");
    assert!(s.rtt.unwrap() < Duration::from_secs(1));
    assert!(s.rtt_smoothed.is_some() && s.rtt_min.is_some());
    assert!(s.throughput_bytes_per_s.is_some());
    assert!(s.tx_bytes > 2 * 1024 * 1024 && s.rx_bytes > 0);
    assert!(s.loss < 0.5);
    assert_eq!(s.max_frame_bytes, LinkConfig::default().frame_bytes);
    // Host candidates on loopback: nothing goes through a relay.
    assert!(!s.relayed && s.tx_relayed_bytes == 0);
    // Probes never reach the application.
    assert!(
        timeout(Duration::from_millis(200), link_b.recv())
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_sender_is_held_back_by_a_slow_receiver() {
    let server = server().await;
    let config = LinkConfig {
        receive_queue: 2,
        send_queue_bytes: 4 * 1024 * 1024,
        ..config()
    };
    let (_a, link_a, _b, mut link_b) = pair(&server, config).await;
    let big = |i: u32| Message::Activations {
        request: 0,
        seq: i,
        pos0: 0,
        tensor: Tensor::new(DType::U8, vec![1024 * 1024], vec![i as u8; 1024 * 1024]).unwrap(),
    };
    // Nobody reads on b: sends must stop completing long before 200 MiB are queued.
    let sender = link_a.sender();
    let mut sent = 0u32;
    while sent < 200 {
        match timeout(Duration::from_secs(2), sender.send(big(sent))).await {
            Ok(r) => r.unwrap(),
            Err(_) => break,
        }
        sent += 1;
    }
    eprintln!("{sent} MiB accepted before the sender was held back");
    assert!(sent < 64, "{sent} MiB accepted with nobody reading");
    // The link is still alive (heartbeats go on while blocked) and
    // everything arrives in order once b reads.
    let done = tokio::spawn(async move {
        for i in sent..sent + 3 {
            sender.send(big(i)).await.unwrap();
        }
    });
    for i in 0..sent + 3 {
        match recv(&mut link_b).await {
            Message::Activations { seq, tensor, .. } => {
                assert_eq!(seq, i);
                assert!(tensor.bytes().iter().all(|&x| x == i as u8));
            }
            other => panic!("unexpected {}", other.kind()),
        }
    }
    done.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdp_fingerprint_other_than_the_announced_one_is_refused() {
    let server = server().await;
    let mut a = join(&server, config()).await;
    // A hand-driven peer that announces one fingerprint and offers another.
    let mut fake = SignalClient::connect(&server.url(), ROOM, &token(&server))
        .await
        .unwrap();
    let mut meta = Map::new();
    meta.insert(
        "dtls_fingerprint".into(),
        Value::String("sha-256 AA:BB".into()),
    );
    fake.send(ClientMessage::Meta { meta }).await.unwrap();
    let offer = SignalPayload::Offer {
        session: "s1".into(),
        sdp: "v=0\r\na=fingerprint:sha-256 CC:DD\r\n".into(),
    };
    fake.send(ClientMessage::Signal {
        to: a.local_id().clone(),
        data: serde_json::to_value(&offer).unwrap(),
    })
    .await
    .unwrap();
    assert_eq!(next_down(&mut a).await, LinkError::FingerprintMismatch);
    // The fake peer is told why.
    let bye = timeout(WAIT, async {
        loop {
            if let Some(ServerMessage::Signal { data, .. }) = fake.recv().await {
                return serde_json::from_value::<SignalPayload>(data).unwrap();
            }
        }
    })
    .await
    .unwrap();
    assert!(matches!(bye, SignalPayload::Bye { .. }), "{bye:?}");
}

/// Links that may only use relay candidates on the TURN server at `turn`.
fn relay_only(turn: SocketAddr, credential: &str) -> LinkConfig {
    LinkConfig {
        ice_servers: vec![IceServer {
            urls: vec![format!("turn:{turn}?transport=udp")],
            username: Some(TURN_USER.into()),
            credential: Some(credential.into()),
        }],
        ice_transport_policy: IceTransportPolicy::Relay,
        // The relay adds hops and tasks on a loaded machine: be lenient.
        ping_interval: Duration::from_millis(500),
        heartbeat_timeout: Duration::from_secs(5),
        ..config()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_only_link_carries_a_tensor_through_a_turn_server() {
    let (turn, turn_addr) = turn_server::start().await;
    let server = server().await;
    let (_a, mut link_a, _b, mut link_b) =
        pair(&server, relay_only(turn_addr, TURN_PASSWORD)).await;
    let tensor = random_tensor(1536 * 1024, 11); // 6 MiB
    let sent = Message::Activations {
        request: 3,
        seq: 0,
        pos0: 0,
        tensor: tensor.clone(),
    };
    link_a.send(sent.clone()).await.unwrap();
    let got = recv(&mut link_b).await;
    assert!(
        got == sent,
        "the tensor changed on its way through the relay"
    );
    link_b.send(got).await.unwrap();
    let Message::Activations { tensor: back, .. } = recv(&mut link_a).await else {
        panic!("expected activations");
    };
    assert!(back.bytes() == tensor.bytes(), "tensor bytes differ");
    // Stats are refreshed every ping.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let bytes = tensor.bytes().len() as u64;
    for (name, link) in [("a", &link_a), ("b", &link_b)] {
        let s = link.stats();
        eprintln!(
            "{name}: relayed {} tx_relayed_bytes {}",
            s.relayed, s.tx_relayed_bytes
        );
        assert!(s.relayed, "{name}: the selected pair is not the relay");
        assert!(
            s.tx_relayed_bytes > bytes,
            "{name}: {} bytes relayed",
            s.tx_relayed_bytes
        );
    }
    // The server saw both allocations, and each relayed the whole tensor out.
    let relayed = turn_server::relayed_bytes(&turn).await;
    assert_eq!(relayed.len(), 2, "{relayed:?}");
    for (addr, n) in relayed {
        assert!(n > bytes, "allocation {addr} relayed {n} bytes");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_turn_credentials_fail_the_link_with_a_clear_error() {
    let (_turn, turn_addr) = turn_server::start().await;
    let server = server().await;
    // Only b's credential is wrong, so b's own allocation is what fails
    // (not a `bye` from a peer whose allocation failed first).
    let a = join(&server, relay_only(turn_addr, TURN_PASSWORD)).await;
    let mut b = join(&server, relay_only(turn_addr, "not-the-password")).await;
    let start = Instant::now();
    b.connect(a.local_id());
    let error = next_down(&mut b).await;
    let took = start.elapsed();
    eprintln!("refused after {took:?}: {error}");
    let LinkError::Turn { reason, .. } = &error else {
        panic!("expected a TURN error, got {error}");
    };
    assert!(reason.contains("credential"), "{error}");
    // Refused by the server, not timed out.
    assert!(took < Duration::from_secs(5), "{took:?}");
}

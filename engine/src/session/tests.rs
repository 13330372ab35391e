//! Two sessions wired back to back in memory, with injected time.

use std::time::Duration;

use super::*;
use crate::protocol::{FlowControl, Hello, Message, PROTOCOL_VERSION};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn config(peer: &str) -> SessionConfig {
    SessionConfig {
        hello: Hello::new(peer, 1 << 20, "{}".into()),
        frame_bytes: 4096,
        limits: Limits::default(),
        flow: FlowControl {
            high_water: 16 * 1024,
            low_water: 8 * 1024,
        },
        ping_interval: Some(ms(100)),
        heartbeat_timeout: Some(ms(500)),
        probe_interval: None,
        probe_bytes: 0,
        connect_timeout: Some(ms(1000)),
        close_flush: ms(1000),
    }
}

/// Moves every frame `from` has queued into `to`; what `to` says about them.
fn carry(from: &mut Session, to: &mut Session, now: Duration) -> Result<usize, SessionError> {
    let mut n = 0;
    while let Some(frame) = from.next_frame()?.map(<[u8]>::to_vec) {
        from.frame_sent();
        to.on_frame_bytes(&frame, now)?;
        n += 1;
    }
    Ok(n)
}

/// Carries frames both ways until neither side has any.
fn settle(a: &mut Session, b: &mut Session, now: Duration) {
    loop {
        let moved = carry(a, b, now).expect("a to b") + carry(b, a, now).expect("b to a");
        if moved == 0 {
            return;
        }
    }
}

fn events(s: &mut Session) -> Vec<SessionEvent> {
    std::iter::from_fn(|| s.poll_event()).collect()
}

/// Two sessions, both up at time 0.
fn linked() -> (Session, Session) {
    let mut a = Session::new(config("a"), Duration::ZERO);
    let mut b = Session::new(config("b"), Duration::ZERO);
    a.on_open(Duration::ZERO);
    b.on_open(Duration::ZERO);
    settle(&mut a, &mut b, Duration::ZERO);
    assert!(a.is_up() && b.is_up());
    events(&mut a);
    events(&mut b);
    (a, b)
}

#[test]
fn hello_brings_both_up_with_the_negotiated_version() {
    let mut a = Session::new(config("a"), Duration::ZERO);
    let mut b = Session::new(config("b"), Duration::ZERO);
    assert!(!a.takes_messages(), "nothing goes before hello");
    a.on_open(ms(1));
    b.on_open(ms(1));
    settle(&mut a, &mut b, ms(2));
    match events(&mut a).as_slice() {
        [SessionEvent::Up { version, remote }] => {
            assert_eq!(*version, PROTOCOL_VERSION);
            assert_eq!(remote.peer, "b");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(b.remote_hello().map(|h| h.peer.as_str()), Some("a"));
    assert!(a.takes_messages());
}

#[test]
fn incompatible_versions_end_both_sides_with_the_reason() {
    let mut a = Session::new(config("a"), Duration::ZERO);
    let mut newer = config("b");
    newer.hello.protocol = PROTOCOL_VERSION + 1;
    newer.hello.min_protocol = PROTOCOL_VERSION + 1;
    let mut b = Session::new(newer, Duration::ZERO);
    a.on_open(Duration::ZERO);
    b.on_open(Duration::ZERO);
    // Both Hellos cross; each side refuses the other's, says why (an
    // `Error` goes out) and ends once that is flushed.
    let hello = |s: &mut Session| {
        let frame = s.next_frame().expect("frame").map(<[u8]>::to_vec);
        s.frame_sent();
        frame.expect("hello")
    };
    let (hello_a, hello_b) = (hello(&mut a), hello(&mut b));
    b.on_frame_bytes(&hello_a, ms(1)).expect("a's hello");
    a.on_frame_bytes(&hello_b, ms(1)).expect("b's hello");
    assert!(a.is_closing() && b.is_closing());
    assert!(a.has_frames(), "a's error waits to go out");
    assert_eq!(a.finished(ms(1), 0), None);
    let frame = a.next_frame().expect("frame").map(<[u8]>::to_vec);
    let mut d = crate::protocol::Deframer::new(Limits::default());
    d.push(&hello_a).expect("a's hello");
    match d
        .push(&frame.expect("error frame"))
        .expect("frame")
        .as_slice()
    {
        [Message::Error { code, text }] => {
            assert_eq!(*code, error_code::PROTOCOL);
            assert!(text.contains("do not overlap"), "{text}");
        }
        other => panic!("{other:?}"),
    }
    a.frame_sent();
    assert_eq!(
        a.finished(ms(2), 0),
        Some(SessionError::Protocol(ProtocolError::Incompatible {
            local: PROTOCOL_VERSION,
            remote: PROTOCOL_VERSION + 1,
        }))
    );
    assert_eq!(
        b.finished(ms(1001), 0),
        Some(SessionError::Protocol(ProtocolError::Incompatible {
            local: PROTOCOL_VERSION + 1,
            remote: PROTOCOL_VERSION,
        }))
    );
    assert!(!a.is_up() && !b.is_up());
}

#[test]
fn rtt_is_measured_from_the_delays() {
    let (mut a, mut b) = linked();
    a.on_tick(ms(100)).expect("tick");
    assert_eq!(events(&mut a), vec![SessionEvent::StatsDue]);
    // 15 ms there, 25 ms back.
    carry(&mut a, &mut b, ms(115)).expect("ping");
    carry(&mut b, &mut a, ms(140)).expect("pong");
    assert_eq!(events(&mut a), vec![SessionEvent::Rtt(ms(40))]);
    a.on_tick(ms(150)).expect("tick");
    assert!(!a.has_frames(), "the next ping is due at 200 ms");
    a.on_tick(ms(200)).expect("tick");
    carry(&mut a, &mut b, ms(210)).expect("ping");
    carry(&mut b, &mut a, ms(220)).expect("pong");
    let s = a.stats(ms(220), 0);
    assert_eq!(s.rtt, Some(ms(20)));
    assert_eq!(s.rtt_min, Some(ms(20)));
    assert!(s.rtt_smoothed > Some(ms(20)) && s.rtt_smoothed < Some(ms(40)));
    assert!(s.jitter > Duration::ZERO);
    assert_eq!(s.loss, 0.0);
    // Pings and pongs are the session's own: the application sees none.
    assert!(!a.has_received() && !b.has_received());
}

#[test]
fn silence_past_the_heartbeat_ends_the_link() {
    let (mut a, _b) = linked();
    a.on_tick(ms(400)).expect("still alive");
    assert_eq!(a.poll_timeout(), Some(ms(500)), "the heartbeat is next");
    assert_eq!(
        a.on_tick(ms(600)),
        Err(SessionError::HeartbeatTimeout(ms(600)))
    );
}

#[test]
fn a_reader_that_is_behind_does_not_blame_the_peer() {
    let (mut a, mut b) = linked();
    b.send(&Message::Resume).expect("send");
    carry(&mut b, &mut a, ms(10)).expect("resume");
    assert!(a.has_received());
    // The application does not read: a stops reading, silence is its own.
    a.on_tick(ms(450)).expect("tick");
    a.on_tick(ms(900)).expect("tick");
    assert_eq!(a.pop_received(), Some(Message::Resume));
    a.on_tick(ms(1300))
        .expect("within the heartbeat of the last held tick");
    assert!(matches!(
        a.on_tick(ms(1500)),
        Err(SessionError::HeartbeatTimeout(_))
    ));
}

#[test]
fn frames_from_the_peer_keep_the_link_alive() {
    let (mut a, mut b) = linked();
    for t in (100..2000).step_by(100) {
        a.on_tick(ms(t)).expect("a alive");
        b.on_tick(ms(t)).expect("b alive");
        settle(&mut a, &mut b, ms(t));
    }
}

#[test]
fn probe_throughput_from_injected_time() {
    let (mut a, mut b) = linked();
    let nonce = a.probe(100_000, ms(1000)).expect("probe");
    carry(&mut a, &mut b, ms(1080)).expect("probe");
    carry(&mut b, &mut a, ms(1100)).expect("ack");
    let done = events(&mut a);
    assert_eq!(
        done,
        vec![SessionEvent::ProbeDone {
            nonce,
            bytes: 100_000,
            elapsed: ms(100),
        }]
    );
    let bps = a
        .stats(ms(1100), 0)
        .throughput_bytes_per_s
        .expect("measured");
    assert!((bps - 1_000_000.0).abs() < 1.0, "{bps}");
    assert!((SessionEvent::throughput(100_000, ms(100)) - bps).abs() < 1.0);
    assert!(!b.has_received(), "a probe is not an application message");
}

#[test]
fn periodic_probes_follow_the_interval() {
    let mut ca = config("a");
    ca.probe_interval = Some(ms(300));
    ca.probe_bytes = 10_000;
    let mut a = Session::new(ca, Duration::ZERO);
    let mut b = Session::new(config("b"), Duration::ZERO);
    a.on_open(Duration::ZERO);
    b.on_open(Duration::ZERO);
    settle(&mut a, &mut b, Duration::ZERO);
    a.on_tick(ms(200)).expect("tick");
    assert_eq!(a.probes_in_flight().count(), 0);
    a.on_tick(ms(300)).expect("tick");
    assert_eq!(a.probes_in_flight().count(), 1);
    settle(&mut a, &mut b, ms(310));
    assert_eq!(a.probes_in_flight().count(), 0);
    assert!(
        events(&mut a)
            .iter()
            .any(|e| matches!(e, SessionEvent::ProbeDone { bytes: 10_000, .. }))
    );
}

#[test]
fn flow_control_blocks_and_resumes() {
    let (mut a, mut b) = linked();
    // An application message of 30 kB: several frames.
    let data = Message::Telemetry(Box::new(crate::protocol::Telemetry {
        backend: Some("x".repeat(30_000)),
        ..Default::default()
    }));
    a.send(&data).expect("send");
    assert!(!a.takes_messages(), "one message at a time");
    // A transport that holds what it is given until it drains.
    let mut buffered = 0usize;
    let mut on_wire = Vec::new();
    while a.may_write(buffered) {
        let Some(frame) = a.next_frame().expect("frame").map(<[u8]>::to_vec) else {
            break;
        };
        a.frame_sent();
        buffered += frame.len();
        on_wire.push(frame);
    }
    assert!(!a.may_write(buffered), "stopped at the high water mark");
    assert!(a.has_frames(), "the rest waits");
    assert!(buffered >= 16 * 1024);
    // The transport drains; writing resumes and the message arrives whole.
    buffered = 0;
    while a.may_write(buffered) {
        let Some(frame) = a.next_frame().expect("frame").map(<[u8]>::to_vec) else {
            break;
        };
        a.frame_sent();
        on_wire.push(frame);
    }
    assert!(!a.has_frames());
    assert!(a.takes_messages());
    for f in &on_wire {
        b.on_frame_bytes(f, ms(5)).expect("frame");
    }
    assert_eq!(b.pop_received(), Some(data));
    let s = a.stats(ms(5), 0);
    assert_eq!(s.tx_messages, 2, "hello and the message");
}

#[test]
fn control_messages_go_before_the_next_application_message() {
    let (mut a, mut b) = linked();
    b.on_tick(ms(100)).expect("tick"); // b pings
    carry(&mut b, &mut a, ms(101)).expect("ping");
    // a owes a pong; the application's next message waits behind it.
    assert!(!a.takes_messages());
    let first = a.next_frame().expect("frame").map(<[u8]>::to_vec);
    let frame = first.expect("pong frame");
    b.on_frame_bytes(&frame, ms(102)).expect("pong");
    a.frame_sent();
    assert!(matches!(
        events(&mut b).as_slice(),
        [SessionEvent::StatsDue, SessionEvent::Rtt(_)]
    ));
}

#[test]
fn close_delivers_the_reason() {
    let (mut a, mut b) = linked();
    a.send(&Message::Resume).expect("send");
    a.close("going away", ms(10));
    assert!(a.finished(ms(10), 0).is_none(), "queued data first");
    carry(&mut a, &mut b, ms(11)).expect("carry");
    assert_eq!(
        b.pop_received(),
        Some(Message::Resume),
        "sent before the close"
    );
    assert_eq!(
        b.finished(ms(11), 0),
        Some(SessionError::ClosedByPeer("going away".into()))
    );
    assert!(
        a.finished(ms(11), 100).is_none(),
        "the transport still holds data"
    );
    assert_eq!(a.finished(ms(11), 0), Some(SessionError::Closed));
}

#[test]
fn a_close_that_cannot_flush_ends_at_its_deadline() {
    let (mut a, _b) = linked();
    a.send(&Message::Resume).expect("send");
    a.close("bye", ms(10));
    assert!(a.poll_timeout() <= Some(ms(1010)));
    assert!(a.finished(ms(500), 0).is_none());
    assert_eq!(a.finished(ms(1010), 0), Some(SessionError::Closed));
}

#[test]
fn garbage_is_a_clear_error_not_a_panic() {
    let (mut a, mut b) = linked();
    b.on_frame_bytes(b"\xffthis is not a frame at all, not even close", ms(5))
        .expect("the error goes to the peer first");
    assert!(b.is_closing());
    // Nothing from a after the failure is read.
    a.send(&Message::Resume).expect("send");
    let err = carry(&mut b, &mut a, ms(6)).expect_err("a hears the error");
    assert!(
        matches!(&err, SessionError::Remote { code, text } if *code == error_code::PROTOCOL && text.starts_with("protocol: ")),
        "{err}"
    );
    carry(&mut a, &mut b, ms(6)).expect("ignored while closing");
    assert!(!b.has_received());
    match b.finished(ms(6), 0) {
        Some(SessionError::Protocol(e)) => assert!(!e.to_string().is_empty()),
        other => panic!("{other:?}"),
    }
}

#[test]
fn anything_before_hello_or_a_second_hello_is_refused() {
    let mut a = Session::new(config("a"), Duration::ZERO);
    let mut b = Session::new(config("b"), Duration::ZERO);
    // b never says hello but thinks the link is up.
    b.remote_hello = Some(Hello::new("a", 1 << 20, "{}".into()));
    b.send(&Message::Resume).expect("send");
    carry(&mut b, &mut a, ms(1)).expect("resume");
    match a.finished(ms(1001), 0) {
        Some(SessionError::Protocol(ProtocolError::Decode(t))) => {
            assert_eq!(t, "resume before hello")
        }
        other => panic!("{other:?}"),
    }

    let (mut a, mut b) = linked();
    b.control_out
        .push_back(Message::Hello(Hello::new("b", 1, String::new())));
    carry(&mut b, &mut a, ms(1)).expect("second hello");
    assert!(matches!(
        a.finished(ms(1001), 0),
        Some(SessionError::Protocol(ProtocolError::Decode(t))) if t == "second hello"
    ));
}

#[test]
fn text_frames_are_refused() {
    let (mut a, _b) = linked();
    a.on_text_frame(ms(1));
    assert!(matches!(
        a.finished(ms(2000), 0),
        Some(SessionError::Protocol(ProtocolError::Header(_)))
    ));
}

#[test]
fn no_hello_in_time_is_a_connect_timeout() {
    let mut a = Session::new(config("a"), ms(100));
    a.on_open(ms(100));
    assert_eq!(a.poll_timeout(), Some(ms(1100)));
    a.on_tick(ms(1099)).expect("not yet");
    assert_eq!(
        a.on_tick(ms(1100)),
        Err(SessionError::ConnectTimeout(ms(1000)))
    );
}

#[test]
fn an_answering_session_never_pings_or_times_out() {
    let mut a = Session::new(
        SessionConfig::answering(Hello::new("a", 1 << 20, "{}".into()), 4096),
        Duration::ZERO,
    );
    let mut b = Session::new(config("b"), Duration::ZERO);
    a.on_open(Duration::ZERO);
    b.on_open(Duration::ZERO);
    settle(&mut a, &mut b, Duration::ZERO);
    a.on_tick(Duration::from_secs(3600)).expect("no heartbeat");
    assert!(!a.has_frames(), "no ping");
    assert_eq!(a.poll_timeout(), None);
    // It still answers the peer's pings.
    b.on_tick(ms(100)).expect("tick");
    settle(&mut a, &mut b, ms(130));
    assert_eq!(b.stats(ms(130), 0).rtt, Some(ms(30)));
}

#[test]
fn messages_over_the_peers_limit_are_refused_and_the_link_goes_on() {
    let mut small = config("b");
    small.hello.max_message_bytes = 1000;
    let mut a = Session::new(config("a"), Duration::ZERO);
    let mut b = Session::new(small, Duration::ZERO);
    a.on_open(Duration::ZERO);
    b.on_open(Duration::ZERO);
    settle(&mut a, &mut b, Duration::ZERO);
    let big = Message::Probe {
        nonce: 1,
        payload: vec![0; 5000],
    };
    assert!(matches!(
        a.send(&big),
        Err(ProtocolError::MessageTooLarge { .. })
    ));
    assert!(a.probe(5000, ms(1)).is_err());
    a.send(&Message::Resume).expect("small ones go");
    settle(&mut a, &mut b, ms(2));
    assert_eq!(b.pop_received(), Some(Message::Resume));
}

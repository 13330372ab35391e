//! One link session: what both ends of every link (native str0m links and
//! the browser's `RTCDataChannel`) do above the framer, written once.
//!
//! Sans-IO: no sockets, no tasks, no clock reads. Every input carries `now`,
//! a [`Duration`] since an origin the caller picks (the same one for every
//! call on a session), and the caller writes the frames the session hands
//! out. A [`Session`] owns:
//!
//! - the `Hello` exchange: ours goes first when the channel opens, the
//!   peer's must be the first message it sends, and the versions must
//!   overlap ([`negotiate`]); then the link is up ([`SessionEvent::Up`]);
//! - pings every `ping_interval` and the RTT, jitter and loss estimates
//!   ([`SessionStats`]); pongs and probe acks for the peer's;
//! - liveness: no frame for `heartbeat_timeout` ends the link, except while
//!   the application is behind (messages wait in [`Session::pop_received`]):
//!   then we stopped reading, so the silence is ours, not the peer's;
//! - throughput probes, periodic or asked for ([`Session::probe`]), queued
//!   behind application data as a transfer would be;
//! - the order of outgoing frames (control messages before the next
//!   application message) and flow control on the transport's buffered amount;
//! - close: ours (`Close`, then a flush), the peer's, and protocol failures
//!   (an `Error` goes out, then the link ends).

mod stats;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

pub use stats::SessionStats;

use crate::protocol::{
    Deframer, FlowControl, Framer, Hello, Limits, Message, ProtocolError, error_code, negotiate,
};
use stats::Estimator;

/// Why a session ended (or an operation on it failed).
#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum SessionError {
    #[error("protocol: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("the peer reported error {code}: {text}")]
    Remote { code: u16, text: String },
    #[error("no frame from the peer for {0:?} (heartbeat)")]
    HeartbeatTimeout(Duration),
    #[error("link not established within {0:?}")]
    ConnectTimeout(Duration),
    #[error("the peer closed the link: {0}")]
    ClosedByPeer(String),
    #[error("link closed")]
    Closed,
}

/// What a session is configured with.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    /// Our `Hello` (peer id, largest message we reassemble, capabilities).
    pub hello: Hello,
    /// Largest frame we send (the transport's maximum message size).
    pub frame_bytes: usize,
    /// What the deframer accepts from the peer.
    pub limits: Limits,
    /// Buffered-amount thresholds of the transport.
    pub flow: FlowControl,
    /// How often we ping; `None`: never (the peer's pings are still answered).
    pub ping_interval: Option<Duration>,
    /// A link that receives nothing for this long is down; `None`: the
    /// transport decides liveness. Also what counts a pong as late.
    pub heartbeat_timeout: Option<Duration>,
    /// How often a throughput probe is sent once up; `None`: only on request.
    pub probe_interval: Option<Duration>,
    /// Size of the periodic probe.
    pub probe_bytes: usize,
    /// From the session's start to both `Hello`s exchanged; `None`: no limit.
    pub connect_timeout: Option<Duration>,
    /// How long a close may take to flush what is queued.
    pub close_flush: Duration,
}

impl SessionConfig {
    /// No pings, heartbeat, periodic probes or connect limit: a session that
    /// only answers the peer (how the browser side runs).
    pub fn answering(hello: Hello, frame_bytes: usize) -> Self {
        Self {
            hello,
            frame_bytes,
            limits: Limits::default(),
            flow: FlowControl::default(),
            ping_interval: None,
            heartbeat_timeout: None,
            probe_interval: None,
            probe_bytes: 0,
            connect_timeout: None,
            close_flush: Duration::from_secs(1),
        }
    }
}

/// What a session tells its driver, in order ([`Session::poll_event`]).
#[derive(Clone, Debug, PartialEq)]
pub enum SessionEvent {
    /// Both `Hello`s are exchanged: the link is up.
    Up { version: u8, remote: Hello },
    /// A pong came back.
    Rtt(Duration),
    /// A ping went out: a good moment to publish [`Session::stats`].
    StatsDue,
    /// The peer acknowledged probe `nonce`: `bytes` in `elapsed`.
    ProbeDone {
        nonce: u64,
        bytes: u64,
        elapsed: Duration,
    },
}

impl SessionEvent {
    /// A finished probe's throughput in bytes per second.
    pub fn throughput(bytes: u64, elapsed: Duration) -> f64 {
        bytes as f64 / elapsed.as_secs_f64().max(1e-9)
    }
}

/// One link's session state; see the module documentation.
#[derive(Debug)]
pub struct Session {
    config: SessionConfig,
    framer: Framer,
    deframer: Deframer,
    /// Control messages (Hello, Pong, ProbeAck, Error, Close) go before the
    /// next application message.
    control_out: VecDeque<Message>,
    /// Frames of the message being written (and probes queued behind it).
    frames: VecDeque<Vec<u8>>,
    /// Application messages received, not yet taken.
    received: VecDeque<Message>,
    events: VecDeque<SessionEvent>,
    open: bool,
    remote_hello: Option<Hello>,
    estimator: Estimator,
    next_ping: Duration,
    nonce: u64,
    /// Probes in flight: when sent and how big.
    probes: HashMap<u64, (Duration, u64)>,
    next_probe: Option<Duration>,
    connect_deadline: Option<Duration>,
    /// Set when the link is ending: the reason, and the flush deadline.
    closing: Option<(SessionError, Duration)>,
}

impl Session {
    pub fn new(config: SessionConfig, now: Duration) -> Self {
        Self {
            framer: Framer::new(config.frame_bytes),
            deframer: Deframer::new(config.limits),
            control_out: VecDeque::new(),
            frames: VecDeque::new(),
            received: VecDeque::new(),
            events: VecDeque::new(),
            open: false,
            remote_hello: None,
            estimator: Estimator::new(now),
            next_ping: now,
            nonce: 0,
            probes: HashMap::new(),
            next_probe: None,
            connect_deadline: config.connect_timeout.map(|t| now + t),
            closing: None,
            config,
        }
    }

    /// The transport's channel opened: our `Hello` goes out first.
    pub fn on_open(&mut self, _now: Duration) {
        if self.open {
            return;
        }
        self.open = true;
        self.control_out
            .push_front(Message::Hello(self.config.hello.clone()));
    }

    pub fn is_up(&self) -> bool {
        self.remote_hello.is_some()
    }

    pub fn is_closing(&self) -> bool {
        self.closing.is_some()
    }

    /// What the peer said in its `Hello`, once it has.
    pub fn remote_hello(&self) -> Option<&Hello> {
        self.remote_hello.as_ref()
    }

    /// Our frame size now.
    pub fn max_frame_bytes(&self) -> usize {
        self.framer.max_frame_bytes()
    }

    /// The transport renegotiated its maximum message size.
    pub fn set_max_frame_bytes(&mut self, n: usize) {
        self.framer.set_max_frame_bytes(n);
    }

    /// Whether another frame may be handed to a transport holding
    /// `buffered_amount` bytes.
    pub fn may_write(&self, buffered_amount: usize) -> bool {
        self.config.flow.may_send(buffered_amount)
    }

    /// Bytes of one binary message from the transport (a frame, or any
    /// slice of the byte stream). `Err`: the link is down now.
    pub fn on_frame_bytes(&mut self, bytes: &[u8], now: Duration) -> Result<(), SessionError> {
        if self.closing.is_some() {
            return Ok(());
        }
        self.estimator.received(bytes.len(), now);
        match self.deframer.push(bytes) {
            Ok(messages) => {
                for m in messages {
                    self.on_message(m, now)?;
                }
            }
            Err(e) => self.fail_with_notice(SessionError::Protocol(e), now),
        }
        Ok(())
    }

    /// A text message from the transport: this protocol is binary only.
    pub fn on_text_frame(&mut self, now: Duration) {
        if self.closing.is_some() {
            return;
        }
        self.fail_with_notice(
            SessionError::Protocol(ProtocolError::Header("text message on a binary link")),
            now,
        );
    }

    fn on_message(&mut self, message: Message, now: Duration) -> Result<(), SessionError> {
        if self.remote_hello.is_none() {
            let Message::Hello(hello) = message else {
                let e = ProtocolError::Decode(format!("{} before hello", message.kind()));
                self.fail_with_notice(SessionError::Protocol(e), now);
                return Ok(());
            };
            let version = match negotiate(&self.config.hello, &hello) {
                Ok(v) => v,
                Err(e) => {
                    self.fail_with_notice(SessionError::Protocol(e), now);
                    return Ok(());
                }
            };
            self.framer
                .set_peer_max_message_bytes(hello.max_message_bytes);
            self.remote_hello = Some(hello.clone());
            self.estimator.last_heard = now;
            self.next_ping = now;
            self.next_probe = self.config.probe_interval.map(|i| now + i);
            self.events.push_back(SessionEvent::Up {
                version,
                remote: hello,
            });
            return Ok(());
        }
        match message {
            Message::Ping { nonce, sent_us } => {
                self.control_out.push_back(Message::Pong { nonce, sent_us })
            }
            Message::Pong { nonce, sent_us } => {
                let now_us = now.as_micros() as u64;
                let rtt = Duration::from_micros(now_us.saturating_sub(sent_us));
                self.estimator.pong(nonce, rtt, now, self.late_after());
                self.events.push_back(SessionEvent::Rtt(rtt));
            }
            Message::Probe { nonce, payload } => self.control_out.push_back(Message::ProbeAck {
                nonce,
                bytes: payload.len() as u64,
            }),
            Message::ProbeAck { nonce, bytes } => {
                if let Some((start, _)) = self.probes.remove(&nonce) {
                    let elapsed = now.saturating_sub(start);
                    self.estimator.probe_done(bytes, elapsed);
                    self.events.push_back(SessionEvent::ProbeDone {
                        nonce,
                        bytes,
                        elapsed,
                    });
                }
            }
            Message::Close { reason } => {
                self.begin_close(SessionError::ClosedByPeer(reason), None, now)
            }
            Message::Error { code, text } => return Err(SessionError::Remote { code, text }),
            Message::Hello(_) => {
                let e = ProtocolError::Decode("second hello".into());
                self.fail_with_notice(SessionError::Protocol(e), now);
            }
            other => {
                self.estimator.received_message();
                self.received.push_back(other);
            }
        }
        Ok(())
    }

    /// What counts a pong as late (and a ping unanswered).
    fn late_after(&self) -> Duration {
        self.config.heartbeat_timeout.unwrap_or(Duration::MAX)
    }

    /// The next event for the driver.
    pub fn poll_event(&mut self) -> Option<SessionEvent> {
        self.events.pop_front()
    }

    /// The next application message received (everything but the session's
    /// own Hello, Ping, Pong, Probe, ProbeAck, Close and Error).
    pub fn pop_received(&mut self) -> Option<Message> {
        self.received.pop_front()
    }

    /// Whether received messages wait for the application. While any do,
    /// the driver should stop reading the transport (the peer is slowed
    /// down in turn) and the silence does not count against the peer.
    pub fn has_received(&self) -> bool {
        !self.received.is_empty()
    }

    /// The application is gone: drop what it would have read.
    pub fn clear_received(&mut self) {
        self.received.clear();
    }

    /// Whether the driver may hand over the next application message: the
    /// link is up, not closing, and nothing is left to write before it.
    pub fn takes_messages(&self) -> bool {
        self.frames.is_empty()
            && self.control_out.is_empty()
            && self.remote_hello.is_some()
            && self.closing.is_none()
    }

    /// Whether anything is queued to write.
    pub fn has_frames(&self) -> bool {
        !self.frames.is_empty() || !self.control_out.is_empty()
    }

    /// Queues an application message. A message the peer would refuse (over
    /// its `Hello::max_message_bytes`) or that cannot be encoded is an
    /// `Err` and nothing is queued; the link goes on.
    pub fn send(&mut self, message: &Message) -> Result<(), ProtocolError> {
        self.framer
            .encode_with(message, |f| self.frames.push_back(f))
            .map(|_| ())
    }

    /// Queues a frame as is, bypassing the framer (tests of how the peer
    /// handles malformed frames).
    pub fn send_raw_frame(&mut self, frame: Vec<u8>) {
        self.frames.push_back(frame);
    }

    /// The next frame to write: a control message's, or the application
    /// message's in progress. It stays next until [`Self::frame_sent`].
    pub fn next_frame(&mut self) -> Result<Option<&[u8]>, SessionError> {
        if self.frames.is_empty()
            && let Some(m) = self.control_out.pop_front()
        {
            self.framer.encode_with(&m, |f| self.frames.push_back(f))?;
        }
        Ok(self.frames.front().map(Vec::as_slice))
    }

    /// The transport took the frame [`Self::next_frame`] gave; `true` when
    /// that was the last frame of what was queued (a message is done).
    pub fn frame_sent(&mut self) -> bool {
        if let Some(frame) = self.frames.pop_front() {
            let done = self.frames.is_empty();
            self.estimator.sent(frame.len(), done);
            return done;
        }
        true
    }

    /// Measures throughput: queues a probe of `bytes` behind the data
    /// queued now (as a transfer would wait); its result comes as
    /// [`SessionEvent::ProbeDone`] with the returned nonce.
    pub fn probe(&mut self, bytes: usize, now: Duration) -> Result<u64, ProtocolError> {
        self.nonce += 1;
        let nonce = self.nonce;
        let message = Message::Probe {
            nonce,
            payload: vec![0u8; bytes],
        };
        self.framer
            .encode_with(&message, |f| self.frames.push_back(f))?;
        self.probes.insert(nonce, (now, bytes as u64));
        Ok(nonce)
    }

    /// Probes sent and not acknowledged yet.
    pub fn probes_in_flight(&self) -> impl Iterator<Item = u64> + '_ {
        self.probes.keys().copied()
    }

    /// Time passed: pings, probes, the heartbeat and the connect limit.
    /// `Err`: the link is down now.
    pub fn on_tick(&mut self, now: Duration) -> Result<(), SessionError> {
        if self.closing.is_some() {
            return Ok(());
        }
        if self.remote_hello.is_none() {
            if let (Some(deadline), Some(limit)) =
                (self.connect_deadline, self.config.connect_timeout)
                && now >= deadline
            {
                return Err(SessionError::ConnectTimeout(limit));
            }
            return Ok(());
        }
        if !self.received.is_empty() {
            // We stopped reading because the application is behind: the
            // silence is ours, not the peer's.
            self.estimator.last_heard = now;
        }
        if let Some(timeout) = self.config.heartbeat_timeout {
            let silent = now.saturating_sub(self.estimator.last_heard);
            if silent >= timeout {
                return Err(SessionError::HeartbeatTimeout(silent));
            }
        }
        if let Some(interval) = self.config.ping_interval
            && now >= self.next_ping
        {
            self.next_ping = now + interval;
            self.nonce += 1;
            self.estimator.ping_sent(self.nonce, now);
            self.control_out.push_back(Message::Ping {
                nonce: self.nonce,
                sent_us: now.as_micros() as u64,
            });
            self.events.push_back(SessionEvent::StatsDue);
        }
        if let Some(p) = self.next_probe
            && now >= p
        {
            self.next_probe = self.config.probe_interval.map(|i| now + i);
            // A periodic probe too large for the peer is just not sent.
            let _ = self.probe(self.config.probe_bytes, now);
        }
        Ok(())
    }

    /// When [`Self::on_tick`] (or [`Self::finished`]) has something to do next.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let mut next: Option<Duration> = None;
        let mut at = |t: Duration| next = Some(next.map_or(t, |n| n.min(t)));
        if self.remote_hello.is_some() {
            if self.config.ping_interval.is_some() {
                at(self.next_ping);
            }
            if let Some(timeout) = self.config.heartbeat_timeout {
                at(self.estimator.last_heard.saturating_add(timeout));
            }
            if let Some(p) = self.next_probe {
                at(p);
            }
        } else if let Some(d) = self.connect_deadline {
            at(d);
        }
        if let Some((_, deadline)) = &self.closing {
            at(*deadline);
        }
        next
    }

    /// Closes the link: what is queued goes out first, then `Close` with
    /// `reason` (if the channel ever opened), then the link ends as
    /// [`SessionError::Closed`] once flushed.
    pub fn close(&mut self, reason: &str, now: Duration) {
        self.begin_close(SessionError::Closed, Some(reason), now);
    }

    fn begin_close(&mut self, reason: SessionError, notice: Option<&str>, now: Duration) {
        if self.closing.is_some() {
            return;
        }
        if let Some(text) = notice
            && self.open
        {
            self.control_out.push_back(Message::Close {
                reason: text.to_owned(),
            });
        }
        self.closing = Some((reason, now + self.config.close_flush));
    }

    /// A failure the peer should hear about: an `Error` goes out, then we stop.
    fn fail_with_notice(&mut self, error: SessionError, now: Duration) {
        if self.closing.is_some() {
            return;
        }
        self.control_out.clear();
        self.control_out.push_back(Message::Error {
            code: error_code::PROTOCOL,
            text: error.to_string(),
        });
        self.closing = Some((error, now + self.config.close_flush));
    }

    /// The reason the link ends, once a close has flushed (nothing queued
    /// here and `transport_buffered` is 0) or its flush time is up.
    pub fn finished(&mut self, now: Duration, transport_buffered: usize) -> Option<SessionError> {
        let (_, deadline) = self.closing.as_ref()?;
        let flushed =
            self.frames.is_empty() && self.control_out.is_empty() && transport_buffered == 0;
        if flushed || now >= *deadline {
            return self.closing.take().map(|(reason, _)| reason);
        }
        None
    }

    /// Measurements now; `transport_buffered`: the transport's buffered amount.
    pub fn stats(&mut self, now: Duration, transport_buffered: usize) -> SessionStats {
        let late = self.late_after();
        let frame = self.framer.max_frame_bytes();
        self.estimator.refresh(now, late, frame, transport_buffered)
    }
}

//! One link: a tokio task that owns a `str0m::Rtc` and the link's
//! [`Session`] (hello, pings, heartbeat, probes, flow control and close,
//! shared with the browser), and moves data between them, the link's
//! datagrams ([`Transport`]: sockets, TURN relays) and the application's
//! channels ([`AppEnd`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_engine::protocol::Hello;
use cairn_engine::session::{Session, SessionEvent};
use cairn_signal::protocol::PeerId;
use str0m::change::{SdpAnswer, SdpPendingOffer};
use str0m::channel::ChannelId;
use str0m::{Candidate, Event, IceConnectionState, Input, Output, Rtc};
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;
use tracing::{debug, info, warn};

use super::app::{AppEnd, AppWake};
use super::handle::{Link, Outgoing};
use super::stats::LinkStats;
use super::transport::{Arrival, Incoming, Transport};
use super::turn::TurnServer;
use super::{IceTransportPolicy, LinkConfig, LinkError};

/// What the mesh tells a driver.
pub(crate) enum Control {
    Answer(SdpAnswer),
    RemoteCandidate(Candidate),
    /// Close gracefully (a `Close` message, then the DTLS close).
    Close(String),
    /// Drop every packet from now on (tests: a cut network).
    Blackhole,
    /// The peer accepts messages of at most this many bytes.
    FrameBytes(usize),
}

/// What a driver tells the mesh.
pub(crate) enum Report {
    LocalCandidate {
        peer: PeerId,
        session: String,
        candidate: String,
    },
    Up {
        peer: PeerId,
        session: String,
        link: Link,
    },
    Down {
        peer: PeerId,
        session: String,
        error: LinkError,
    },
}

/// Everything a driver starts from.
pub(crate) struct Setup {
    pub rtc: Rtc,
    pub sockets: Vec<UdpSocket>,
    pub peer: PeerId,
    pub local_peer: PeerId,
    pub session: String,
    pub pending_offer: Option<SdpPendingOffer>,
    pub config: Arc<LinkConfig>,
    pub reports: mpsc::UnboundedSender<Report>,
    /// Extra local candidates to gather (STUN servers resolved by the mesh).
    pub stun_servers: Vec<SocketAddr>,
    /// TURN servers to allocate a relay candidate on.
    pub turn_servers: Vec<TurnServer>,
}

/// The mesh's handle on a running driver.
pub(crate) struct DriverHandle {
    pub control: mpsc::UnboundedSender<Control>,
}

/// Datagrams taken per wake-up before the driver looks at its other inputs.
const RECV_BATCH: usize = 64;

pub(crate) fn spawn(setup: Setup) -> DriverHandle {
    let (control_tx, control_rx) = mpsc::unbounded_channel();
    let driver = Driver::new(setup, control_tx.clone(), control_rx);
    tokio::spawn(driver.run());
    DriverHandle {
        control: control_tx,
    }
}

struct Driver {
    rtc: Rtc,
    /// Hello, pings, heartbeat, probes, framing and close. Received
    /// messages wait in it until the application has room; while any do,
    /// the driver stops reading the sockets.
    session: Session,
    /// The sockets and relays str0m's datagrams go through.
    transport: Transport,
    /// The application's queues, probes, stats and close reason.
    app: AppEnd,
    control: mpsc::UnboundedReceiver<Control>,
    reports: mpsc::UnboundedSender<Report>,
    config: Arc<LinkConfig>,
    peer: PeerId,
    session_id: String,
    /// The origin of the session's time.
    epoch: Instant,
    pending_offer: Option<SdpPendingOffer>,
    channel: Option<ChannelId>,
    rtc_deadline: Instant,
}

/// One of the things the driver waits for.
enum Wake {
    Control(Option<Control>),
    Transport(Arrival),
    App(AppWake),
    Timer,
}

impl Driver {
    fn new(
        setup: Setup,
        control_tx: mpsc::UnboundedSender<Control>,
        control_rx: mpsc::UnboundedReceiver<Control>,
    ) -> Self {
        let now = Instant::now();
        let config = setup.config;
        let session = Session::new(
            config.session_config(setup.local_peer.as_str()),
            Duration::ZERO,
        );
        let app = AppEnd::new(
            setup.peer.clone(),
            setup.session.clone(),
            control_tx,
            config.send_queue_bytes,
            config.receive_queue,
            now,
        );
        let transport = Transport::new(
            setup.sockets,
            &setup.stun_servers,
            setup.turn_servers,
            config.udp_buffer_bytes,
            config.connect_timeout / 2,
            config.ice_transport_policy == IceTransportPolicy::Relay,
            now,
        );
        Self {
            rtc: setup.rtc,
            session,
            transport,
            app,
            control: control_rx,
            reports: setup.reports,
            peer: setup.peer,
            session_id: setup.session,
            epoch: now,
            pending_offer: setup.pending_offer,
            channel: None,
            rtc_deadline: now,
            config,
        }
    }

    async fn run(mut self) {
        let error = match self.run_inner().await {
            Ok(reason) | Err(reason) => reason,
        };
        match &error {
            LinkError::Closed => {
                debug!(peer = %self.peer, session = %self.session_id, "link closed")
            }
            e => info!(peer = %self.peer, session = %self.session_id, error = %e, "link down"),
        }
        self.app.close(&error);
        // Tell the DTLS and SCTP layers, best effort.
        if !self.transport.is_blackholed() && self.rtc.close().is_ok() {
            let _ = tokio::time::timeout(Duration::from_millis(200), self.drain()).await;
        }
        let _ = self.reports.send(Report::Down {
            peer: self.peer.clone(),
            session: self.session_id.clone(),
            error,
        });
    }

    /// Now, in the session's time.
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Feeds the DTLS datagrams that came too early once str0m takes them.
    async fn replay_early_dtls(&mut self) -> Result<(), LinkError> {
        let rtc = &self.rtc;
        let ready = self
            .transport
            .take_early(|r| rtc.accepts(&Input::Receive(Instant::now(), r)));
        for early in ready {
            self.on_datagram(early.endpoint, &early.data, early.from)?;
            self.drain().await?;
        }
        Ok(())
    }

    /// Runs until the link ends; `Ok` for an orderly end, `Err` for a failure.
    async fn run_inner(&mut self) -> Result<LinkError, LinkError> {
        let mut buf = vec![0u8; 65_536];
        loop {
            self.drain().await?;
            self.replay_early_dtls().await?;
            self.on_session_events();
            if let Some(done) = self.finished() {
                return Ok(done);
            }
            if self.write_some().await? {
                continue;
            }
            self.app.deliver(&mut self.session);
            let deadline = self.next_deadline();
            let can_take = self.session.takes_messages();
            let reading = !self.session.has_received();
            let wake = tokio::select! {
                c = self.control.recv() => Wake::Control(c),
                a = self.transport.wake(&mut buf, reading) => Wake::Transport(a),
                a = self.app.wake(can_take, !reading) => Wake::App(a),
                _ = tokio::time::sleep_until(deadline.into()) => Wake::Timer,
            };
            match wake {
                Wake::Control(Some(c)) => self.on_control(c)?,
                Wake::Control(None) => {
                    // The mesh is gone (the process is shutting down or the
                    // peer was dropped): stop without ceremony.
                    return Err(LinkError::Closed);
                }
                Wake::Transport(Arrival::Datagram {
                    endpoint,
                    len,
                    from,
                }) => {
                    self.on_datagram(endpoint, &buf[..len], from)?;
                    self.drain().await?;
                    self.receive_batch(&mut buf).await?;
                }
                Wake::Transport(Arrival::Error(e)) => return Err(e.into()),
                Wake::Transport(Arrival::Allocated(result)) => {
                    if let Some(c) = self.transport.on_allocated(result)? {
                        info!(peer = %self.peer, candidate = %c.to_sdp_string(), "TURN relay allocated");
                        self.add_local_candidate(c);
                    }
                }
                Wake::App(AppWake::Outgoing(Some(o))) => self.start_outgoing(o),
                Wake::App(AppWake::Outgoing(None)) => self.close(),
                Wake::App(AppWake::Room(room)) => self.app.on_room(room, &mut self.session),
                Wake::Timer => self.on_timer().await?,
            }
        }
    }

    /// Takes what else is waiting at the sockets and relays before looking
    /// elsewhere: up to `RECV_BATCH` rounds over every endpoint.
    async fn receive_batch(&mut self, buf: &mut [u8]) -> Result<(), LinkError> {
        for _ in 0..RECV_BATCH {
            if self.session.has_received() {
                break;
            }
            let mut got = false;
            for endpoint in 0..self.transport.endpoints() {
                if let Some((n, from)) = self.transport.try_recv(endpoint, buf)? {
                    got = true;
                    self.on_datagram(endpoint, &buf[..n], from)?;
                    self.drain().await?;
                }
            }
            if !got {
                break;
            }
        }
        Ok(())
    }

    /// The reason to stop, once a graceful close has flushed (or timed out).
    fn finished(&mut self) -> Option<LinkError> {
        if !self.session.is_closing() {
            return None;
        }
        let buffered = self.buffered_amount();
        let now = self.now();
        self.session.finished(now, buffered).map(LinkError::from)
    }

    /// Our graceful close: what is queued, then `Close`, then the DTLS close.
    fn close(&mut self) {
        let now = self.now();
        self.session.close("closed", now);
    }

    fn next_deadline(&self) -> Instant {
        let mut d = self.rtc_deadline;
        if let Some(t) = self.session.poll_timeout() {
            d = d.min(self.epoch + t);
        }
        if let Some(q) = self.transport.next_gather() {
            d = d.min(q);
        }
        // Never sleep long: a short tick also retries blocked writes.
        d.min(Instant::now() + Duration::from_millis(100))
    }

    async fn on_timer(&mut self) -> Result<(), LinkError> {
        let now = Instant::now();
        self.rtc.handle_input(Input::Timeout(now))?;
        self.drain().await?;
        self.transport.gather(now).await;
        let now = self.now();
        self.session.on_tick(now)?;
        self.on_session_events();
        Ok(())
    }

    /// Acts on what the session reports: the link is up, stats are due, a
    /// probe is done.
    fn on_session_events(&mut self) {
        while let Some(event) = self.session.poll_event() {
            match event {
                SessionEvent::Up { remote, .. } => self.become_up(remote),
                SessionEvent::Rtt(_) => {}
                SessionEvent::StatsDue => {
                    let buffered = self.buffered_amount();
                    let s = self.session.stats(self.now(), buffered);
                    let relay = self.transport.relay_stats();
                    self.app.publish(LinkStats::new(s, relay, Instant::now()));
                }
                SessionEvent::ProbeDone {
                    nonce,
                    bytes,
                    elapsed,
                } => self
                    .app
                    .probe_done(nonce, SessionEvent::throughput(bytes, elapsed)),
            }
        }
    }

    fn buffered_amount(&mut self) -> usize {
        self.channel
            .and_then(|id| self.rtc.channel(id).map(|mut c| c.buffered_amount()))
            .unwrap_or(0)
    }

    /// A new local candidate (server-reflexive or relayed) for str0m, and
    /// for the peer through signaling.
    fn add_local_candidate(&mut self, c: Candidate) {
        let sdp = c.to_sdp_string();
        if self.rtc.add_local_candidate(c).is_some() {
            debug!(peer = %self.peer, candidate = %sdp, "local candidate");
            let _ = self.reports.send(Report::LocalCandidate {
                peer: self.peer.clone(),
                session: self.session_id.clone(),
                candidate: sdp,
            });
        }
    }

    fn on_control(&mut self, control: Control) -> Result<(), LinkError> {
        match control {
            Control::Answer(answer) => {
                let Some(pending) = self.pending_offer.take() else {
                    return Err(LinkError::Signal("answer without an offer".into()));
                };
                self.rtc.sdp_api().accept_answer(pending, answer)?;
            }
            Control::RemoteCandidate(c) => self.rtc.add_remote_candidate(c),
            Control::Close(reason) => {
                debug!(peer = %self.peer, %reason, "closing link on request");
                self.close();
            }
            Control::Blackhole => self.transport.blackhole(),
            Control::FrameBytes(n) => self.session.set_max_frame_bytes(n),
        }
        Ok(())
    }

    /// A datagram at `endpoint` from `from`: a reflexive address of ours,
    /// or for str0m (DTLS it cannot take yet is kept for later).
    fn on_datagram(
        &mut self,
        endpoint: usize,
        data: &[u8],
        from: SocketAddr,
    ) -> Result<(), LinkError> {
        match self.transport.incoming(endpoint, data, from) {
            Incoming::Ignored => {}
            Incoming::Reflexive(c) => self.add_local_candidate(c),
            Incoming::Rtc(receive) => {
                let input = Input::Receive(Instant::now(), receive);
                if self.rtc.accepts(&input) {
                    self.rtc.handle_input(input)?;
                } else if !self.session.is_up() {
                    self.transport.keep_early(endpoint, data, from);
                }
            }
        }
        Ok(())
    }

    /// Polls str0m until it has nothing more to do now.
    async fn drain(&mut self) -> Result<(), LinkError> {
        loop {
            match self.rtc.poll_output()? {
                Output::Timeout(t) => {
                    self.rtc_deadline = t;
                    return Ok(());
                }
                Output::Transmit(t) => self.transport.send(&t).await,
                Output::Event(e) => self.on_event(e)?,
            }
        }
    }

    fn on_event(&mut self, event: Event) -> Result<(), LinkError> {
        match event {
            Event::IceConnectionStateChange(state) => {
                debug!(peer = %self.peer, ?state, "ICE");
                if state == IceConnectionState::Disconnected && !self.session.is_closing() {
                    return Err(LinkError::Rtc("ICE disconnected".into()));
                }
            }
            Event::ChannelOpen(id, label) => {
                debug!(peer = %self.peer, %label, "data channel open");
                if self.channel.is_some() {
                    return Ok(()); // one channel per link; ignore others
                }
                self.channel = Some(id);
                if let Some(mut c) = self.rtc.channel(id) {
                    c.set_buffered_amount_low_threshold(self.config.flow.low_water);
                }
                let now = self.now();
                self.session.on_open(now);
            }
            Event::ChannelData(d) => {
                if Some(d.id) != self.channel || self.session.is_closing() {
                    return Ok(());
                }
                let now = self.now();
                if d.binary {
                    self.session.on_frame_bytes(&d.data, now)?;
                } else {
                    self.session.on_text_frame(now);
                }
                if self.session.is_closing() {
                    debug!(peer = %self.peer, session = %self.session_id, "session closing");
                }
                self.on_session_events();
            }
            Event::ChannelClose(id) if Some(id) == self.channel && !self.session.is_closing() => {
                return Err(LinkError::ClosedByPeer("data channel closed".into()));
            }
            _ => {}
        }
        Ok(())
    }

    fn become_up(&mut self, hello: Hello) {
        let remote_max = self.session.max_frame_bytes();
        if let Some(link) = self.app.take_link(hello, remote_max) {
            info!(peer = %self.peer, session = %self.session_id, frame = remote_max, "link up");
            let _ = self.reports.send(Report::Up {
                peer: self.peer.clone(),
                session: self.session_id.clone(),
                link,
            });
        }
    }

    fn start_outgoing(&mut self, outgoing: Outgoing) {
        match outgoing {
            Outgoing::Message(message, permit) => match self.session.send(&message) {
                Ok(()) => self.app.hold_permit(permit),
                // A message the peer refuses to take: drop it, keep the link.
                Err(e) => warn!(peer = %self.peer, error = %e, "message not sent"),
            },
            Outgoing::Probe(bytes, waiter) => {
                let now = self.now();
                let started = self.session.probe(bytes, now).map_err(LinkError::from);
                self.app.probe_started(started, waiter);
            }
            Outgoing::Raw(frame) => self.session.send_raw_frame(frame),
        }
    }

    /// Writes frames while the data channel takes them; `true` if any went out.
    async fn write_some(&mut self) -> Result<bool, LinkError> {
        let Some(id) = self.channel else {
            return Ok(false);
        };
        if self.transport.is_blackholed() {
            return Ok(false);
        }
        let mut wrote = false;
        loop {
            if self.session.next_frame()?.is_none() {
                self.app.release_permit();
                if !self.session.takes_messages() {
                    break;
                }
                match self.app.try_next() {
                    Ok(o) => self.start_outgoing(o),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => self.close(),
                }
                continue;
            }
            let Some(mut channel) = self.rtc.channel(id) else {
                return Err(LinkError::ClosedByPeer("data channel gone".into()));
            };
            if !self.session.may_write(channel.buffered_amount()) {
                break;
            }
            let Some(frame) = self.session.next_frame()? else {
                continue;
            };
            if !channel.write(true, frame)? {
                break;
            }
            if self.session.frame_sent() {
                self.app.release_permit();
            }
            wrote = true;
            self.drain().await?;
        }
        Ok(wrote)
    }
}

#[cfg(test)]
mod tests {
    use cairn_engine::protocol::Message;

    use super::*;

    /// Loopback, with the short intervals the process-level tests use.
    fn config() -> Arc<LinkConfig> {
        Arc::new(LinkConfig {
            ping_interval: Duration::from_millis(200),
            heartbeat_timeout: Duration::from_millis(1500),
            probe_interval: None,
            ..LinkConfig::loopback()
        })
    }

    /// An `Rtc` with one loopback socket as its host candidate.
    async fn side(config: &LinkConfig) -> (Rtc, UdpSocket) {
        let mut rtc = Rtc::builder()
            .set_sctp_max_message_size(config.max_message_size)
            .set_sctp_max_buffered_amount(config.flow.high_water)
            .build(Instant::now());
        let socket = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let host = Candidate::host(socket.local_addr().expect("addr"), "udp").expect("candidate");
        rtc.add_local_candidate(host);
        (rtc, socket)
    }

    fn setup(
        rtc: Rtc,
        socket: UdpSocket,
        local: &str,
        peer: &str,
        pending_offer: Option<SdpPendingOffer>,
        reports: mpsc::UnboundedSender<Report>,
    ) -> Setup {
        Setup {
            rtc,
            sockets: vec![socket],
            peer: PeerId(peer.into()),
            local_peer: PeerId(local.into()),
            session: "s1".into(),
            pending_offer,
            config: config(),
            reports,
            stun_servers: Vec::new(),
            turn_servers: Vec::new(),
        }
    }

    /// The driver's `Up`, skipping candidates; panics on `Down`.
    async fn up(reports: &mut mpsc::UnboundedReceiver<Report>) -> Link {
        let wait = async {
            loop {
                match reports.recv().await {
                    Some(Report::Up { link, .. }) => return link,
                    Some(Report::LocalCandidate { .. }) => {}
                    Some(Report::Down { error, .. }) => panic!("link down: {error}"),
                    None => panic!("driver gone"),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .expect("up within 10 s")
    }

    /// The driver's `Down`, skipping the rest.
    async fn down(reports: &mut mpsc::UnboundedReceiver<Report>) -> LinkError {
        let wait = async {
            loop {
                match reports.recv().await {
                    Some(Report::Down { error, .. }) => return error,
                    Some(_) => {}
                    None => panic!("driver gone without a report"),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .expect("down within 10 s")
    }

    struct Pair {
        offerer: (DriverHandle, mpsc::UnboundedReceiver<Report>, Link),
        answerer: (DriverHandle, mpsc::UnboundedReceiver<Report>, Link),
    }

    /// Two drivers linked over loopback, the SDP handed across directly
    /// (what the mesh does through signaling).
    async fn pair() -> Pair {
        let config = config();
        let (mut a, a_socket) = side(&config).await;
        let (mut b, b_socket) = side(&config).await;
        let mut change = a.sdp_api();
        change.add_channel("cairn".into());
        let (offer, pending) = change.apply().expect("an offer");
        let answer = b.sdp_api().accept_offer(offer).expect("an answer");
        let (a_tx, mut a_reports) = mpsc::unbounded_channel();
        let (b_tx, mut b_reports) = mpsc::unbounded_channel();
        let a = spawn(setup(a, a_socket, "a", "b", Some(pending), a_tx));
        let b = spawn(setup(b, b_socket, "b", "a", None, b_tx));
        assert!(a.control.send(Control::Answer(answer)).is_ok());
        let a_link = up(&mut a_reports).await;
        let b_link = up(&mut b_reports).await;
        Pair {
            offerer: (a, a_reports, a_link),
            answerer: (b, b_reports, b_link),
        }
    }

    fn text(s: &str) -> Message {
        Message::Pause { reason: s.into() }
    }

    #[tokio::test]
    async fn two_drivers_carry_messages_probes_and_stats_and_close_with_a_reason() {
        let Pair {
            offerer: (_a, mut a_reports, mut a),
            answerer: (_b, mut b_reports, mut b),
        } = pair().await;
        assert_eq!(a.remote_hello().peer, "b");
        assert_eq!(b.remote_hello().peer, "a");

        let big = "y".repeat(200_000); // several frames
        a.send(text("one")).await.expect("sent");
        a.send(text(&big)).await.expect("sent");
        b.send(text("back")).await.expect("sent");
        assert_eq!(b.recv().await, Ok(text("one")));
        assert_eq!(b.recv().await, Ok(text(&big)));
        assert_eq!(a.recv().await, Ok(text("back")));

        let rate = a.probe(256 * 1024).await.expect("probe acknowledged");
        assert!(rate > 0.0);
        let mut stats = a.stats_watch();
        let measured = async {
            loop {
                stats.changed().await.expect("driver alive");
                if stats.borrow().rtt.is_some() {
                    return;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(5), measured)
            .await
            .expect("an RTT within 5 s");
        assert!(!a.stats().relayed, "host candidates only");

        a.close("done");
        assert!(matches!(b.recv().await, Err(LinkError::ClosedByPeer(r)) if r.contains("closed")));
        assert!(matches!(
            down(&mut b_reports).await,
            LinkError::ClosedByPeer(_)
        ));
        assert_eq!(down(&mut a_reports).await, LinkError::Closed);
        assert_eq!(a.send(text("late")).await, Err(LinkError::Closed));
    }

    #[tokio::test]
    async fn a_blackholed_link_dies_of_its_heartbeat_on_both_ends() {
        let Pair {
            offerer: (_a, mut a_reports, mut a),
            answerer: (b_handle, mut b_reports, _b),
        } = pair().await;
        assert!(b_handle.control.send(Control::Blackhole).is_ok());
        let error = tokio::time::timeout(Duration::from_secs(10), a.recv())
            .await
            .expect("down within 10 s");
        assert!(
            matches!(error, Err(LinkError::HeartbeatTimeout(_))),
            "{error:?}"
        );
        assert!(matches!(
            down(&mut a_reports).await,
            LinkError::HeartbeatTimeout(_)
        ));
        assert!(matches!(
            down(&mut b_reports).await,
            LinkError::HeartbeatTimeout(_)
        ));
    }
}

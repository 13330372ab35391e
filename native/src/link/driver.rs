//! One link: a tokio task that owns a `str0m::Rtc`, its UDP sockets and
//! TURN relays, and feeds the link's [`Session`] (hello, pings, heartbeat,
//! probes, flow control and close live there, shared with the browser);
//! plus the handles the application holds.

use std::collections::HashMap;
use std::future::poll_fn;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::{Duration, Instant};

use cairn_engine::protocol::{Framer, Hello, Message};
use cairn_engine::session::{Session, SessionEvent};
use cairn_signal::protocol::PeerId;
use str0m::change::{SdpAnswer, SdpPendingOffer};
use str0m::channel::ChannelId;
use str0m::net::{Protocol, Receive};
use str0m::{Candidate, Event, IceConnectionState, Input, Output, Rtc};
use tokio::io::ReadBuf;
use tokio::net::UdpSocket;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinError;
use tracing::{debug, info, warn};

use super::gather::ReflexiveGathering;
use super::stats::{LinkStats, RelayStats};
use super::turn::{Allocations, Relay, TurnServer};
use super::{LinkConfig, LinkError};

/// Most DTLS datagrams kept while ICE checks their source.
const MAX_EARLY_DTLS: usize = 8;

/// A DTLS record, by its first byte (RFC 7983's demultiplexing).
fn is_dtls(data: &[u8]) -> bool {
    data.first().is_some_and(|b| (20..=63).contains(b))
}

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

/// Who waits for a throughput probe's result (bytes per second).
type ProbeWaiter = oneshot::Sender<Result<f64, LinkError>>;

/// What the application hands a link to send.
enum Outgoing {
    Message(Message, Option<OwnedSemaphorePermit>),
    Probe(usize, oneshot::Sender<Result<f64, LinkError>>),
    /// A raw frame, written as is (tests: a malformed frame).
    Raw(Vec<u8>),
}

/// Sends messages on a link; cheap to clone. `send` waits while the link's
/// queue holds `send_queue_bytes`, so a fast sender cannot grow memory.
#[derive(Clone)]
pub struct LinkSender {
    queue: mpsc::UnboundedSender<Outgoing>,
    budget: Arc<Semaphore>,
    budget_bytes: usize,
    closed: Arc<Mutex<Option<LinkError>>>,
}

impl std::fmt::Debug for LinkSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkSender").finish_non_exhaustive()
    }
}

impl LinkSender {
    fn closed_error(&self) -> LinkError {
        self.closed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .unwrap_or(LinkError::Closed)
    }

    /// Queues `message`; waits while the queue is full. `Err` once the link is closed.
    pub async fn send(&self, message: Message) -> Result<(), LinkError> {
        self.send_or_return(message).await.map_err(|(_, e)| e)
    }

    /// Like [`Self::send`], but a message the link could not take comes
    /// back with the reason, so the caller can send it another way.
    pub async fn send_or_return(&self, message: Message) -> Result<(), (Message, LinkError)> {
        let len = match Framer::encoded_len(&message) {
            Ok(len) => len,
            Err(e) => return Err((message, e.into())),
        };
        let want = len.clamp(1, self.budget_bytes as u64) as u32;
        let permit = match Arc::clone(&self.budget).acquire_many_owned(want).await {
            Ok(p) => p,
            Err(_) => return Err((message, self.closed_error())),
        };
        self.queue
            .send(Outgoing::Message(message, Some(permit)))
            .map_err(|mpsc::error::SendError(back)| {
                let back = match back {
                    Outgoing::Message(m, _) => m,
                    // Only a message was queued above.
                    Outgoing::Probe(..) | Outgoing::Raw(_) => Message::Resume,
                };
                (back, self.closed_error())
            })
    }

    /// Measures throughput now: sends a probe of `bytes` and waits for the
    /// peer's acknowledgement. Bytes per second, from queueing to the ack.
    pub async fn probe(&self, bytes: usize) -> Result<f64, LinkError> {
        let (tx, rx) = oneshot::channel();
        self.queue
            .send(Outgoing::Probe(bytes, tx))
            .map_err(|_| self.closed_error())?;
        rx.await.map_err(|_| self.closed_error())?
    }

    /// Writes `frame` to the data channel as is, bypassing the framer. Only
    /// for tests of how the peer handles malformed frames.
    #[doc(hidden)]
    pub fn send_raw_frame(&self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.queue
            .send(Outgoing::Raw(frame))
            .map_err(|_| self.closed_error())
    }
}

/// An established link to one peer. Dropping it (and every [`LinkSender`])
/// closes the link gracefully.
pub struct Link {
    peer: PeerId,
    session: String,
    sender: LinkSender,
    inbound: mpsc::Receiver<Message>,
    stats: watch::Receiver<LinkStats>,
    control: mpsc::UnboundedSender<Control>,
    remote_hello: Hello,
    max_frame_bytes: usize,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("peer", &self.peer)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl Link {
    /// The peer's id in the signaling room.
    pub fn peer(&self) -> &PeerId {
        &self.peer
    }

    /// This connection attempt's id (a reconnection gets a new one).
    pub fn session(&self) -> &str {
        &self.session
    }

    /// What the peer said in its `Hello` (capabilities, limits).
    pub fn remote_hello(&self) -> &Hello {
        &self.remote_hello
    }

    /// Our frame size: the peer's negotiated maximum message size.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    pub fn sender(&self) -> LinkSender {
        self.sender.clone()
    }

    pub async fn send(&self, message: Message) -> Result<(), LinkError> {
        self.sender.send(message).await
    }

    /// The next message from the peer (pings, pongs, probes and `Hello` are
    /// handled by the link). `Err` with the reason once the link is down and
    /// every message received before has been read.
    pub async fn recv(&mut self) -> Result<Message, LinkError> {
        match self.inbound.recv().await {
            Some(m) => Ok(m),
            None => Err(self.sender.closed_error()),
        }
    }

    /// The latest measurements.
    pub fn stats(&self) -> LinkStats {
        self.stats.borrow().clone()
    }

    /// A receiver that changes at every refresh of the measurements.
    pub fn stats_watch(&self) -> watch::Receiver<LinkStats> {
        self.stats.clone()
    }

    pub async fn probe(&self, bytes: usize) -> Result<f64, LinkError> {
        self.sender.probe(bytes).await
    }

    /// Why the link closed, once it has.
    pub fn close_reason(&self) -> Option<LinkError> {
        self.sender
            .closed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Closes the link: queued messages go out first, then `Close`.
    pub fn close(&self, reason: &str) {
        let _ = self.control.send(Control::Close(reason.to_owned()));
    }
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
    sockets: Vec<UdpSocket>,
    /// TURN allocations that are ready, after the sockets in `locals`.
    relays: Vec<Relay>,
    /// TURN allocations under way.
    allocations: Allocations,
    /// Local addresses: one per socket, then one (relayed) per relay.
    locals: Vec<SocketAddr>,
    config: Arc<LinkConfig>,
    peer: PeerId,
    session_id: String,
    /// The origin of the session's time.
    epoch: Instant,
    pending_offer: Option<SdpPendingOffer>,
    channel: Option<ChannelId>,
    /// Hello, pings, heartbeat, probes, framing and close. Received
    /// messages wait in it until the application has room; while any do,
    /// the driver stops reading the sockets.
    session: Session,
    /// What to release once the message being written is out.
    frames_permit: Option<OwnedSemaphorePermit>,
    queue: mpsc::UnboundedReceiver<Outgoing>,
    control: mpsc::UnboundedReceiver<Control>,
    inbound: mpsc::Sender<Message>,
    link: Option<Link>,
    relay_stats: RelayStats,
    stats: watch::Sender<LinkStats>,
    /// Who waits for the result of which probe.
    probe_waiters: HashMap<u64, ProbeWaiter>,
    rtc_deadline: Instant,
    /// Server-reflexive candidates being gathered.
    gathering: ReflexiveGathering,
    reports: mpsc::UnboundedSender<Report>,
    closed: Arc<Mutex<Option<LinkError>>>,
    budget: Arc<Semaphore>,
    blackhole: bool,
    /// DTLS datagrams that came before ICE had checked their source, replayed
    /// once it has: str0m drops them, and the peer would resend its first
    /// flight only after a second.
    early_dtls: Vec<(usize, Vec<u8>, SocketAddr)>,
}

/// One of the things the driver waits for.
enum Wake {
    Control(Option<Control>),
    /// (endpoint: a socket's index, or sockets.len() + a relay's, bytes, from)
    Datagram(usize, usize, SocketAddr),
    Allocated(Option<Result<Result<Relay, LinkError>, JoinError>>),
    Outgoing(Option<Outgoing>),
    Deliverable(Option<mpsc::OwnedPermit<Message>>),
    Timer,
    SocketError(std::io::Error),
}

impl Driver {
    fn new(
        setup: Setup,
        control_tx: mpsc::UnboundedSender<Control>,
        control_rx: mpsc::UnboundedReceiver<Control>,
    ) -> Self {
        let now = Instant::now();
        let config = setup.config;
        let (queue_tx, queue_rx) = mpsc::unbounded_channel();
        let (inbound_tx, inbound_rx) = mpsc::channel(config.receive_queue);
        let (stats_tx, stats_rx) = watch::channel(LinkStats::initial(now));
        let session = Session::new(
            config.session_config(setup.local_peer.as_str()),
            Duration::ZERO,
        );
        let budget_bytes = config.send_queue_bytes.min(u32::MAX as usize >> 1);
        let budget = Arc::new(Semaphore::new(budget_bytes));
        let closed = Arc::new(Mutex::new(None));
        let sender = LinkSender {
            queue: queue_tx,
            budget: Arc::clone(&budget),
            budget_bytes,
            closed: Arc::clone(&closed),
        };
        let link = Link {
            peer: setup.peer.clone(),
            session: setup.session.clone(),
            sender,
            inbound: inbound_rx,
            stats: stats_rx,
            control: control_tx,
            remote_hello: Hello::new("", 0, String::new()),
            max_frame_bytes: 0,
        };
        let socket_addrs: Vec<Option<SocketAddr>> =
            setup.sockets.iter().map(|s| s.local_addr().ok()).collect();
        let locals = socket_addrs.iter().flatten().copied().collect();
        let gathering = ReflexiveGathering::new(&setup.stun_servers, &socket_addrs, now);
        let allocations = Allocations::start(
            setup.turn_servers,
            config.udp_buffer_bytes,
            config.connect_timeout / 2,
            config.ice_transport_policy == super::IceTransportPolicy::Relay,
        );
        Self {
            rtc: setup.rtc,
            sockets: setup.sockets,
            relays: Vec::new(),
            allocations,
            locals,
            peer: setup.peer,
            session_id: setup.session,
            epoch: now,
            pending_offer: setup.pending_offer,
            channel: None,
            session,
            frames_permit: None,
            queue: queue_rx,
            control: control_rx,
            inbound: inbound_tx,
            link: Some(link),
            relay_stats: RelayStats::default(),
            stats: stats_tx,
            probe_waiters: HashMap::new(),
            rtc_deadline: now,
            gathering,
            reports: setup.reports,
            closed,
            budget,
            blackhole: false,
            early_dtls: Vec::new(),
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
        *self.closed.lock().unwrap_or_else(PoisonError::into_inner) = Some(error.clone());
        self.budget.close();
        for (_, waiter) in self.probe_waiters.drain() {
            let _ = waiter.send(Err(error.clone()));
        }
        // Tell the DTLS and SCTP layers, best effort.
        if !self.blackhole && self.rtc.close().is_ok() {
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
        if self.early_dtls.is_empty() {
            return Ok(());
        }
        let early = std::mem::take(&mut self.early_dtls);
        let (ready, waiting): (Vec<_>, Vec<_>) =
            early.into_iter().partition(|(socket, data, from)| {
                data.as_slice().try_into().is_ok_and(|contents| {
                    self.rtc.accepts(&Input::Receive(
                        Instant::now(),
                        Receive {
                            proto: Protocol::Udp,
                            source: *from,
                            destination: self.locals[*socket],
                            contents,
                        },
                    ))
                })
            });
        self.early_dtls = waiting;
        for (socket, data, from) in ready {
            self.on_datagram(socket, &data, from).await?;
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
            self.deliver();
            let deadline = self.next_deadline();
            let can_take = self.session.takes_messages();
            let reading = !self.session.has_received();
            let wake = tokio::select! {
                c = self.control.recv() => Wake::Control(c),
                a = self.allocations.join_next(), if !self.allocations.is_empty() => Wake::Allocated(a),
                r = recv_any(&self.sockets, &mut self.relays, &mut buf), if reading => match r {
                    Ok((i, n, from)) => Wake::Datagram(i, n, from),
                    Err(e) => Wake::SocketError(e),
                },
                o = self.queue.recv(), if can_take => Wake::Outgoing(o),
                p = self.inbound.clone().reserve_owned(), if !reading => Wake::Deliverable(p.ok()),
                _ = tokio::time::sleep_until(deadline.into()) => Wake::Timer,
            };
            match wake {
                Wake::Control(Some(c)) => self.on_control(c)?,
                Wake::Control(None) => {
                    // The mesh is gone (the process is shutting down or the
                    // peer was dropped): stop without ceremony.
                    return Err(LinkError::Closed);
                }
                Wake::Datagram(i, n, from) => {
                    self.on_datagram(i, &buf[..n], from).await?;
                    self.drain().await?;
                    // Take what else is waiting before looking elsewhere.
                    'batch: for _ in 0..RECV_BATCH {
                        if self.session.has_received() {
                            break;
                        }
                        let mut got = false;
                        for i in 0..self.sockets.len() {
                            match self.sockets[i].try_recv_from(&mut buf) {
                                Ok((n, from)) => {
                                    got = true;
                                    let data = buf[..n].to_vec();
                                    self.on_datagram(i, &data, from).await?;
                                    self.drain().await?;
                                }
                                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                                Err(e) => return Err(e.into()),
                            }
                        }
                        for r in 0..self.relays.len() {
                            if let Ok((data, from)) = self.relays[r].incoming.try_recv() {
                                got = true;
                                let endpoint = self.sockets.len() + r;
                                self.on_datagram(endpoint, &data, from).await?;
                                self.drain().await?;
                            }
                        }
                        if !got {
                            break 'batch;
                        }
                    }
                }
                Wake::SocketError(e) => return Err(e.into()),
                Wake::Allocated(Some(result)) => self.on_allocated(result)?,
                Wake::Allocated(None) => {}
                Wake::Outgoing(Some(o)) => self.start_outgoing(o)?,
                Wake::Outgoing(None) => self.close(),
                Wake::Deliverable(Some(permit)) => {
                    if let Some(m) = self.session.pop_received() {
                        permit.send(m);
                    }
                }
                // The application dropped its receiver: nothing to deliver to.
                Wake::Deliverable(None) => self.session.clear_received(),
                Wake::Timer => self.on_timer().await?,
            }
        }
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
        if let Some(q) = self.gathering.next_try() {
            d = d.min(q);
        }
        // Never sleep long: a short tick also retries blocked writes.
        d.min(Instant::now() + Duration::from_millis(100))
    }

    async fn on_timer(&mut self) -> Result<(), LinkError> {
        let now = Instant::now();
        self.rtc.handle_input(Input::Timeout(now))?;
        self.drain().await?;
        self.stun_tick(now).await;
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
                    self.stats
                        .send_replace(LinkStats::new(s, &self.relay_stats, Instant::now()));
                }
                SessionEvent::ProbeDone {
                    nonce,
                    bytes,
                    elapsed,
                } => {
                    if let Some(w) = self.probe_waiters.remove(&nonce) {
                        let _ = w.send(Ok(SessionEvent::throughput(bytes, elapsed)));
                    }
                }
            }
        }
    }

    fn buffered_amount(&mut self) -> usize {
        self.channel
            .and_then(|id| self.rtc.channel(id).map(|mut c| c.buffered_amount()))
            .unwrap_or(0)
    }

    async fn stun_tick(&mut self, now: Instant) {
        for r in self.gathering.due(now) {
            if let Some(socket) = self.sockets.get(r.socket) {
                let _ = socket.send_to(&r.bytes, r.server).await;
            }
        }
    }

    /// A TURN allocation finished: its relay becomes a local candidate, or
    /// its failure ends a relay-only link that has no relay left to try.
    fn on_allocated(
        &mut self,
        result: Result<Result<Relay, LinkError>, JoinError>,
    ) -> Result<(), LinkError> {
        let Some(relay) = self.allocations.finished(result, self.relays.len())? else {
            return Ok(());
        };
        match Candidate::relayed(relay.relayed, relay.base, "udp") {
            Ok(c) => {
                let sdp = c.to_sdp_string();
                info!(peer = %self.peer, server = %relay.server, relayed = %relay.relayed, "TURN relay allocated");
                self.locals.push(relay.relayed);
                self.relays.push(relay);
                if self.rtc.add_local_candidate(c).is_some() {
                    let _ = self.reports.send(Report::LocalCandidate {
                        peer: self.peer.clone(),
                        session: self.session_id.clone(),
                        candidate: sdp,
                    });
                }
            }
            Err(e) => self.allocations.unusable(LinkError::Turn {
                server: relay.server.clone(),
                reason: format!("unusable relayed address {}: {e}", relay.relayed),
            }),
        }
        self.allocations.check(self.relays.len())
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
            Control::Blackhole => self.blackhole = true,
            Control::FrameBytes(n) => self.session.set_max_frame_bytes(n),
        }
        Ok(())
    }

    async fn on_datagram(
        &mut self,
        socket: usize,
        data: &[u8],
        from: SocketAddr,
    ) -> Result<(), LinkError> {
        if self.blackhole {
            return Ok(());
        }
        if let Some(mapped) = self.gathering.on_datagram(socket, from, data) {
            let base = self.locals[socket];
            if mapped != base
                && let Ok(c) = Candidate::server_reflexive(mapped, base, "udp")
            {
                let sdp = c.to_sdp_string();
                if self.rtc.add_local_candidate(c).is_some() {
                    let _ = self.reports.send(Report::LocalCandidate {
                        peer: self.peer.clone(),
                        session: self.session_id.clone(),
                        candidate: sdp,
                    });
                }
            }
            return Ok(());
        }
        let Ok(contents) = data.try_into() else {
            return Ok(()); // not STUN, DTLS or RTP: ignore
        };
        let input = Input::Receive(
            Instant::now(),
            Receive {
                proto: Protocol::Udp,
                source: from,
                destination: self.locals[socket],
                contents,
            },
        );
        if self.rtc.accepts(&input) {
            self.rtc.handle_input(input)?;
        } else if !self.session.is_up() && is_dtls(data) && self.early_dtls.len() < MAX_EARLY_DTLS {
            self.early_dtls.push((socket, data.to_vec(), from));
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
                Output::Transmit(t) => {
                    if self.blackhole {
                        continue;
                    }
                    let endpoint = self.locals.iter().position(|a| *a == t.source).unwrap_or(0);
                    // DTLS (and so SCTP) records, not ICE's STUN checks:
                    // they go over the pair ICE nominated.
                    let dtls = t.contents.first().is_some_and(|b| (20..64).contains(b));
                    if let Some(r) = endpoint.checked_sub(self.sockets.len()) {
                        let Some(relay) = self.relays.get(r) else {
                            continue;
                        };
                        // A full queue drops the datagram: a lost packet.
                        if relay.send(&t.contents, t.destination) {
                            self.relay_stats.relayed(t.contents.len(), dtls);
                        }
                        continue;
                    }
                    if dtls {
                        self.relay_stats.direct();
                    }
                    let Some(s) = self.sockets.get(endpoint) else {
                        continue;
                    };
                    match s.try_send_to(&t.contents, t.destination) {
                        Ok(_) => {}
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {
                            let _ = s.send_to(&t.contents, t.destination).await;
                        }
                        // A datagram that cannot go out is a lost packet; SCTP retransmits.
                        Err(e) => debug!(error = %e, "send failed"),
                    }
                }
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
        if let Some(mut link) = self.link.take() {
            link.remote_hello = hello;
            link.max_frame_bytes = remote_max;
            info!(peer = %self.peer, session = %self.session_id, frame = remote_max, "link up");
            let _ = self.reports.send(Report::Up {
                peer: self.peer.clone(),
                session: self.session_id.clone(),
                link,
            });
        }
    }

    /// Hands waiting messages to the application while it has room.
    fn deliver(&mut self) {
        while self.session.has_received() {
            match self.inbound.try_reserve() {
                Ok(permit) => {
                    if let Some(m) = self.session.pop_received() {
                        permit.send(m);
                    }
                }
                Err(mpsc::error::TrySendError::Full(())) => return,
                Err(mpsc::error::TrySendError::Closed(())) => {
                    self.session.clear_received();
                    return;
                }
            }
        }
    }

    fn start_outgoing(&mut self, outgoing: Outgoing) -> Result<(), LinkError> {
        match outgoing {
            Outgoing::Message(message, permit) => match self.session.send(&message) {
                Ok(()) => self.frames_permit = permit,
                // A message the peer refuses to take: drop it, keep the link.
                Err(e) => warn!(peer = %self.peer, error = %e, "message not sent"),
            },
            Outgoing::Probe(bytes, waiter) => {
                let now = self.now();
                match self.session.probe(bytes, now) {
                    Ok(nonce) => {
                        self.probe_waiters.insert(nonce, waiter);
                    }
                    Err(e) => {
                        let _ = waiter.send(Err(e.into()));
                    }
                }
            }
            Outgoing::Raw(frame) => self.session.send_raw_frame(frame),
        }
        Ok(())
    }

    /// Writes frames while the data channel takes them; `true` if any went out.
    async fn write_some(&mut self) -> Result<bool, LinkError> {
        let Some(id) = self.channel else {
            return Ok(false);
        };
        if self.blackhole {
            return Ok(false);
        }
        let mut wrote = false;
        loop {
            if self.session.next_frame()?.is_none() {
                self.frames_permit = None;
                if !self.session.takes_messages() {
                    break;
                }
                match self.queue.try_recv() {
                    Ok(o) => self.start_outgoing(o)?,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => self.close(),
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
                self.frames_permit = None;
            }
            wrote = true;
            self.drain().await?;
        }
        Ok(wrote)
    }
}

/// Waits for a datagram on any of the sockets or relays; the endpoint is
/// a socket's index, or `sockets.len()` plus a relay's.
async fn recv_any(
    sockets: &[UdpSocket],
    relays: &mut [Relay],
    buf: &mut [u8],
) -> std::io::Result<(usize, usize, SocketAddr)> {
    poll_fn(|cx| {
        for (i, s) in sockets.iter().enumerate() {
            let mut rb = ReadBuf::new(buf);
            if let Poll::Ready(r) = s.poll_recv_from(cx, &mut rb) {
                return Poll::Ready(r.map(|from| (i, rb.filled().len(), from)));
            }
        }
        for (i, r) in relays.iter_mut().enumerate() {
            // A closed relay (its task ended) just stops delivering.
            if let Poll::Ready(Some((data, from))) = r.incoming.poll_recv(cx) {
                let n = data.len().min(buf.len());
                buf[..n].copy_from_slice(&data[..n]);
                return Poll::Ready(Ok((sockets.len() + i, n, from)));
            }
        }
        Poll::Pending
    })
    .await
}

//! One link: a tokio task that owns a `str0m::Rtc`, its UDP sockets, the
//! framer and the deframer, and the handles the application holds.

use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::{Duration, Instant};

use cairn_engine::protocol::{self, Deframer, Framer, Hello, Limits, Message, error_code};
use cairn_signal::protocol::PeerId;
use str0m::change::{SdpAnswer, SdpPendingOffer};
use str0m::channel::ChannelId;
use str0m::net::{Protocol, Receive};
use str0m::{Candidate, Event, IceConnectionState, Input, Output, Rtc};
use tokio::io::ReadBuf;
use tokio::net::UdpSocket;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tokio::task::{JoinError, JoinSet};
use tracing::{debug, info, warn};

use super::stats::{Estimator, LinkStats};
use super::stun;
use super::turn::{Relay, TurnServer};
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
#[allow(
    clippy::large_enum_variant,
    reason = "a Message (protocol v4's typed Telemetry) is most of what moves through here; boxing it would allocate on every step"
)]
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

/// A STUN query in flight.
struct StunQuery {
    server: SocketAddr,
    socket: usize,
    tid: stun::TransactionId,
    next_try: Instant,
    tries: u32,
}

const STUN_TRIES: u32 = 4;
const STUN_RETRY: Duration = Duration::from_millis(500);
/// How long a graceful close may take to flush.
const CLOSE_FLUSH: Duration = Duration::from_secs(1);
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
    allocations: JoinSet<Result<Relay, LinkError>>,
    /// Why the last allocation failed, for a relay-only link that has none.
    relay_error: Option<LinkError>,
    relay_only: bool,
    /// Local addresses: one per socket, then one (relayed) per relay.
    locals: Vec<SocketAddr>,
    config: Arc<LinkConfig>,
    peer: PeerId,
    local_peer: PeerId,
    session: String,
    epoch: Instant,
    pending_offer: Option<SdpPendingOffer>,
    channel: Option<ChannelId>,
    framer: Framer,
    deframer: Deframer,
    /// Control messages (Hello, Pong, ProbeAck, Error, Close) go before
    /// queued application messages.
    control_out: VecDeque<Message>,
    /// Frames of the message being written, and what to release once it is.
    frames: VecDeque<Vec<u8>>,
    frames_permit: Option<OwnedSemaphorePermit>,
    queue: mpsc::UnboundedReceiver<Outgoing>,
    control: mpsc::UnboundedReceiver<Control>,
    inbound: mpsc::Sender<Message>,
    /// Received messages the application has not taken yet; while any wait,
    /// the driver stops reading the sockets.
    pending_in: VecDeque<Message>,
    link: Option<Link>,
    remote_hello: Option<Hello>,
    up: bool,
    estimator: Estimator,
    stats: watch::Sender<LinkStats>,
    next_ping: Instant,
    ping_nonce: u64,
    /// Probes in flight: when sent, how big, who waits for the result.
    probes: HashMap<u64, (Instant, u64, Option<ProbeWaiter>)>,
    next_probe: Option<Instant>,
    connect_deadline: Instant,
    rtc_deadline: Instant,
    stun: Vec<StunQuery>,
    reports: mpsc::UnboundedSender<Report>,
    closed: Arc<Mutex<Option<LinkError>>>,
    budget: Arc<Semaphore>,
    /// Set when the link is ending: the reason, and the flush deadline.
    closing: Option<(LinkError, Instant)>,
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
        let estimator = Estimator::new(now);
        let (stats_tx, stats_rx) =
            watch::channel(Estimator::new(now).refresh(now, config.heartbeat_timeout, 0, 0));
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
        let locals = setup
            .sockets
            .iter()
            .filter_map(|s| s.local_addr().ok())
            .collect();
        let stun = setup
            .stun_servers
            .iter()
            .flat_map(|&server| {
                (0..setup.sockets.len()).map(move |socket| StunQuery {
                    server,
                    socket,
                    tid: rand::random(),
                    next_try: now,
                    tries: 0,
                })
            })
            .filter(|q| {
                // Only ask over a socket of the server's address family.
                setup.sockets[q.socket]
                    .local_addr()
                    .is_ok_and(|a| a.is_ipv4() == q.server.is_ipv4() && !a.ip().is_loopback())
            })
            .collect();
        let mut allocations = JoinSet::new();
        for server in setup.turn_servers {
            let buffer = config.udp_buffer_bytes;
            let timeout = config.connect_timeout / 2;
            allocations.spawn(async move { Relay::allocate(&server, buffer, timeout).await });
        }
        Self {
            rtc: setup.rtc,
            sockets: setup.sockets,
            relays: Vec::new(),
            allocations,
            relay_error: None,
            relay_only: config.ice_transport_policy == super::IceTransportPolicy::Relay,
            locals,
            peer: setup.peer,
            local_peer: setup.local_peer,
            session: setup.session,
            epoch: now,
            pending_offer: setup.pending_offer,
            channel: None,
            framer: Framer::new(config.frame_bytes),
            deframer: Deframer::new(Limits {
                max_frame_bytes: config.max_message_size as usize,
                max_message_bytes: config.max_reassembly_bytes,
            }),
            control_out: VecDeque::new(),
            frames: VecDeque::new(),
            frames_permit: None,
            queue: queue_rx,
            control: control_rx,
            inbound: inbound_tx,
            pending_in: VecDeque::new(),
            link: Some(link),
            remote_hello: None,
            up: false,
            estimator,
            stats: stats_tx,
            next_ping: now,
            ping_nonce: 0,
            probes: HashMap::new(),
            next_probe: None,
            connect_deadline: now + config.connect_timeout,
            rtc_deadline: now,
            stun,
            reports: setup.reports,
            closed,
            budget,
            closing: None,
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
            LinkError::Closed => debug!(peer = %self.peer, session = %self.session, "link closed"),
            e => info!(peer = %self.peer, session = %self.session, error = %e, "link down"),
        }
        *self.closed.lock().unwrap_or_else(PoisonError::into_inner) = Some(error.clone());
        self.budget.close();
        for (_, (_, _, waiter)) in self.probes.drain() {
            if let Some(w) = waiter {
                let _ = w.send(Err(error.clone()));
            }
        }
        // Tell the DTLS and SCTP layers, best effort.
        if !self.blackhole && self.rtc.close().is_ok() {
            let _ = tokio::time::timeout(Duration::from_millis(200), self.drain()).await;
        }
        let _ = self.reports.send(Report::Down {
            peer: self.peer.clone(),
            session: self.session.clone(),
            error,
        });
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
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
            if let Some(done) = self.finished() {
                return Ok(done);
            }
            if self.write_some().await? {
                continue;
            }
            self.deliver();
            let deadline = self.next_deadline();
            let can_take = self.frames.is_empty()
                && self.control_out.is_empty()
                && self.up
                && self.closing.is_none();
            let reading = self.pending_in.is_empty();
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
                        if !self.pending_in.is_empty() {
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
                Wake::Outgoing(None) => self.begin_close(LinkError::Closed, true),
                Wake::Deliverable(Some(permit)) => {
                    if let Some(m) = self.pending_in.pop_front() {
                        permit.send(m);
                    }
                }
                // The application dropped its receiver: nothing to deliver to.
                Wake::Deliverable(None) => self.pending_in.clear(),
                Wake::Timer => self.on_timer().await?,
            }
        }
    }

    /// The reason to stop, once a graceful close has flushed (or timed out).
    fn finished(&mut self) -> Option<LinkError> {
        let (_, deadline) = self.closing.as_ref()?;
        let flushed = self.frames.is_empty()
            && self.control_out.is_empty()
            && self.channel.is_none_or(|id| {
                self.rtc
                    .channel(id)
                    .is_none_or(|mut c| c.buffered_amount() == 0)
            });
        if flushed || Instant::now() >= *deadline {
            return self.closing.take().map(|(reason, _)| reason);
        }
        None
    }

    fn begin_close(&mut self, reason: LinkError, send_close: bool) {
        if self.closing.is_some() {
            return;
        }
        if send_close && self.channel.is_some() {
            let text = match &reason {
                LinkError::Closed => "closed".to_owned(),
                other => other.to_string(),
            };
            self.control_out.push_back(Message::Close { reason: text });
        }
        self.closing = Some((reason, Instant::now() + CLOSE_FLUSH));
    }

    /// A failure the peer should hear about: an `Error` goes out, then we stop.
    fn fail_with_notice(&mut self, error: LinkError) {
        if self.closing.is_some() {
            return;
        }
        warn!(peer = %self.peer, session = %self.session, %error, "closing link");
        self.control_out.clear();
        self.control_out.push_back(Message::Error {
            code: error_code::PROTOCOL,
            text: error.to_string(),
        });
        self.closing = Some((error, Instant::now() + CLOSE_FLUSH));
    }

    fn next_deadline(&self) -> Instant {
        let mut d = self.rtc_deadline;
        if self.up {
            d = d
                .min(self.next_ping)
                .min(self.estimator.last_heard + self.config.heartbeat_timeout);
            if let Some(p) = self.next_probe {
                d = d.min(p);
            }
        } else {
            d = d.min(self.connect_deadline);
        }
        if let Some(q) = self.stun.iter().map(|q| q.next_try).min() {
            d = d.min(q);
        }
        if let Some((_, c)) = &self.closing {
            d = d.min(*c);
        }
        // Never sleep long: a short tick also retries blocked writes.
        d.min(Instant::now() + Duration::from_millis(100))
    }

    async fn on_timer(&mut self) -> Result<(), LinkError> {
        let now = Instant::now();
        self.rtc.handle_input(Input::Timeout(now))?;
        self.drain().await?;
        self.stun_tick(now).await;
        if self.closing.is_some() {
            return Ok(());
        }
        if !self.up {
            if now >= self.connect_deadline {
                return Err(LinkError::ConnectTimeout(self.config.connect_timeout));
            }
            return Ok(());
        }
        if !self.pending_in.is_empty() {
            // We stopped reading because the application is behind: the
            // silence is ours, not the peer's.
            self.estimator.last_heard = now;
        }
        let silent = now.duration_since(self.estimator.last_heard);
        if silent >= self.config.heartbeat_timeout {
            return Err(LinkError::HeartbeatTimeout(silent));
        }
        if now >= self.next_ping {
            self.next_ping = now + self.config.ping_interval;
            self.ping_nonce += 1;
            self.estimator.ping_sent(self.ping_nonce, now);
            self.control_out.push_back(Message::Ping {
                nonce: self.ping_nonce,
                sent_us: self.now_us(),
            });
            let buffered = self.buffered_amount();
            let stats = self.estimator.refresh(
                now,
                self.config.heartbeat_timeout,
                self.framer.max_frame_bytes(),
                buffered,
            );
            self.stats.send_replace(stats);
        }
        if let Some(p) = self.next_probe
            && now >= p
        {
            self.next_probe = self.config.probe_interval.map(|i| now + i);
            self.queue_probe(self.config.probe_bytes, None);
        }
        Ok(())
    }

    fn buffered_amount(&mut self) -> usize {
        self.channel
            .and_then(|id| self.rtc.channel(id).map(|mut c| c.buffered_amount()))
            .unwrap_or(0)
    }

    fn queue_probe(
        &mut self,
        bytes: usize,
        waiter: Option<oneshot::Sender<Result<f64, LinkError>>>,
    ) {
        self.ping_nonce += 1;
        let nonce = self.ping_nonce;
        self.probes
            .insert(nonce, (Instant::now(), bytes as u64, waiter));
        // Probes are ordinary messages: they queue behind application data,
        // which is what a throughput measurement should see.
        let message = Message::Probe {
            nonce,
            payload: vec![0u8; bytes],
        };
        if let Err(e) = self
            .framer
            .encode_with(&message, |f| self.frames.push_back(f))
            && let Some((_, _, Some(w))) = self.probes.remove(&nonce)
        {
            let _ = w.send(Err(e.into()));
        }
    }

    async fn stun_tick(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.stun.len() {
            let q = &mut self.stun[i];
            if q.next_try > now {
                i += 1;
                continue;
            }
            if q.tries >= STUN_TRIES {
                debug!(server = %q.server, "no answer from STUN server");
                self.stun.swap_remove(i);
                continue;
            }
            q.tries += 1;
            q.next_try = now + STUN_RETRY * q.tries;
            let request = stun::binding_request(&q.tid);
            let _ = self.sockets[q.socket].send_to(&request, q.server).await;
            i += 1;
        }
    }

    /// A TURN allocation finished: its relay becomes a local candidate, or
    /// its failure ends a relay-only link that has no relay left to try.
    fn on_allocated(
        &mut self,
        result: Result<Result<Relay, LinkError>, JoinError>,
    ) -> Result<(), LinkError> {
        let relay = match result {
            Ok(Ok(relay)) => relay,
            Ok(Err(e)) => {
                warn!(peer = %self.peer, error = %e, "no TURN relay");
                self.relay_error = Some(e);
                return self.check_relays();
            }
            Err(e) => {
                warn!(peer = %self.peer, error = %e, "TURN allocation task failed");
                self.relay_error = Some(LinkError::Rtc(format!("TURN allocation: {e}")));
                return self.check_relays();
            }
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
                        session: self.session.clone(),
                        candidate: sdp,
                    });
                }
            }
            Err(e) => {
                self.relay_error = Some(LinkError::Turn {
                    server: relay.server.clone(),
                    reason: format!("unusable relayed address {}: {e}", relay.relayed),
                });
            }
        }
        self.check_relays()
    }

    /// A relay-only link fails as soon as no relay is left, with the reason.
    fn check_relays(&mut self) -> Result<(), LinkError> {
        if self.relay_only && self.relays.is_empty() && self.allocations.is_empty() {
            return Err(self.relay_error.take().unwrap_or(LinkError::Turn {
                server: "(none)".into(),
                reason: "no relay allocated".into(),
            }));
        }
        Ok(())
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
                self.begin_close(LinkError::Closed, true);
            }
            Control::Blackhole => self.blackhole = true,
            Control::FrameBytes(n) => self.framer.set_max_frame_bytes(n),
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
        if let Some(pos) = self
            .stun
            .iter()
            .position(|q| q.server == from && q.socket == socket)
            && let Some(mapped) = stun::parse_binding_success(data, &self.stun[pos].tid)
        {
            self.stun.swap_remove(pos);
            let base = self.locals[socket];
            if mapped != base
                && let Ok(c) = Candidate::server_reflexive(mapped, base, "udp")
            {
                let sdp = c.to_sdp_string();
                if self.rtc.add_local_candidate(c).is_some() {
                    let _ = self.reports.send(Report::LocalCandidate {
                        peer: self.peer.clone(),
                        session: self.session.clone(),
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
        } else if !self.up && is_dtls(data) && self.early_dtls.len() < MAX_EARLY_DTLS {
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
                            self.estimator.relayed(t.contents.len(), dtls);
                        }
                        continue;
                    }
                    if dtls {
                        self.estimator.direct();
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
                if state == IceConnectionState::Disconnected && self.closing.is_none() {
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
                self.control_out.push_front(Message::Hello(Hello::new(
                    self.local_peer.as_str(),
                    self.config.max_reassembly_bytes,
                    self.config.capabilities.clone(),
                )));
            }
            Event::ChannelData(d) => {
                if Some(d.id) != self.channel || self.closing.is_some() {
                    return Ok(());
                }
                if !d.binary {
                    self.fail_with_notice(LinkError::Protocol(protocol::ProtocolError::Header(
                        "text message on a binary link",
                    )));
                    return Ok(());
                }
                self.estimator.received(d.data.len(), Instant::now());
                match self.deframer.push(&d.data) {
                    Ok(messages) => {
                        for m in messages {
                            self.on_message(m)?;
                        }
                    }
                    Err(e) => self.fail_with_notice(LinkError::Protocol(e)),
                }
            }
            Event::ChannelClose(id) if Some(id) == self.channel && self.closing.is_none() => {
                return Err(LinkError::ClosedByPeer("data channel closed".into()));
            }
            _ => {}
        }
        Ok(())
    }

    fn on_message(&mut self, message: Message) -> Result<(), LinkError> {
        if self.remote_hello.is_none() {
            let Message::Hello(hello) = message else {
                self.fail_with_notice(LinkError::Protocol(protocol::ProtocolError::Decode(
                    format!("{} before hello", message.kind()),
                )));
                return Ok(());
            };
            let local = Hello::new("", 0, String::new());
            if let Err(e) = protocol::negotiate(&local, &hello) {
                self.fail_with_notice(LinkError::Protocol(e));
                return Ok(());
            }
            self.framer
                .set_peer_max_message_bytes(hello.max_message_bytes);
            self.remote_hello = Some(hello);
            self.become_up();
            return Ok(());
        }
        match message {
            Message::Ping { nonce, sent_us } => {
                self.control_out.push_back(Message::Pong { nonce, sent_us })
            }
            Message::Pong { nonce, sent_us } => {
                let rtt = Duration::from_micros(self.now_us().saturating_sub(sent_us));
                self.estimator
                    .pong(nonce, rtt, Instant::now(), self.config.heartbeat_timeout);
            }
            Message::Probe { nonce, payload } => self.control_out.push_back(Message::ProbeAck {
                nonce,
                bytes: payload.len() as u64,
            }),
            Message::ProbeAck { nonce, bytes } => {
                if let Some((start, _, waiter)) = self.probes.remove(&nonce) {
                    let elapsed = start.elapsed();
                    self.estimator.probe_done(bytes, elapsed);
                    if let Some(w) = waiter {
                        let _ = w.send(Ok(bytes as f64 / elapsed.as_secs_f64().max(1e-9)));
                    }
                }
            }
            Message::Close { reason } => {
                self.begin_close(LinkError::ClosedByPeer(reason), false);
            }
            Message::Error { code, text } => {
                return Err(LinkError::Remote { code, text });
            }
            Message::Hello(_) => {
                self.fail_with_notice(LinkError::Protocol(protocol::ProtocolError::Decode(
                    "second hello".into(),
                )));
            }
            other => {
                self.estimator.received_message();
                self.pending_in.push_back(other);
                self.deliver();
            }
        }
        Ok(())
    }

    fn become_up(&mut self) {
        let Some(hello) = self.remote_hello.clone() else {
            return;
        };
        if self.up {
            return;
        }
        self.up = true;
        let now = Instant::now();
        self.estimator.last_heard = now;
        self.next_ping = now;
        self.next_probe = self.config.probe_interval.map(|i| now + i);
        let remote_max = self.framer.max_frame_bytes();
        if let Some(mut link) = self.link.take() {
            link.remote_hello = hello;
            link.max_frame_bytes = remote_max;
            info!(peer = %self.peer, session = %self.session, frame = remote_max, "link up");
            let _ = self.reports.send(Report::Up {
                peer: self.peer.clone(),
                session: self.session.clone(),
                link,
            });
        }
    }

    /// Hands waiting messages to the application while it has room.
    fn deliver(&mut self) {
        while let Some(m) = self.pending_in.pop_front() {
            match self.inbound.try_send(m) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(m)) => {
                    self.pending_in.push_front(m);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    self.pending_in.clear();
                    return;
                }
            }
        }
    }

    fn start_outgoing(&mut self, outgoing: Outgoing) -> Result<(), LinkError> {
        match outgoing {
            Outgoing::Message(message, permit) => {
                match self
                    .framer
                    .encode_with(&message, |f| self.frames.push_back(f))
                {
                    Ok(_) => self.frames_permit = permit,
                    // A message the peer refuses to take: drop it, keep the link.
                    Err(e) => warn!(peer = %self.peer, error = %e, "message not sent"),
                }
            }
            Outgoing::Probe(bytes, waiter) => self.queue_probe(bytes, Some(waiter)),
            Outgoing::Raw(frame) => self.frames.push_back(frame),
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
            if self.frames.is_empty() {
                self.frames_permit = None;
                if let Some(m) = self.control_out.pop_front() {
                    self.framer.encode_with(&m, |f| self.frames.push_back(f))?;
                } else if self.up && self.closing.is_none() {
                    match self.queue.try_recv() {
                        Ok(o) => self.start_outgoing(o)?,
                        Err(mpsc::error::TryRecvError::Empty) => break,
                        Err(mpsc::error::TryRecvError::Disconnected) => {
                            self.begin_close(LinkError::Closed, true);
                            continue;
                        }
                    }
                    continue;
                } else {
                    break;
                }
            }
            let Some(frame) = self.frames.front() else {
                continue;
            };
            let Some(mut channel) = self.rtc.channel(id) else {
                return Err(LinkError::ClosedByPeer("data channel gone".into()));
            };
            if !self.config.flow.may_send(channel.buffered_amount())
                || !channel.write(true, frame)?
            {
                break;
            }
            let len = frame.len();
            self.frames.pop_front();
            self.estimator.sent(len, self.frames.is_empty());
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

//! Link setup through cairn-signal: offers, answers, trickled candidates,
//! fingerprint checks, and re-establishing links that die.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_signal::client::{ClientError, SignalClient, SignalSender};
use cairn_signal::protocol::{ClientMessage, PeerId, PeerInfo, ServerMessage};
use serde_json::{Map, Value};
use str0m::change::{SdpAnswer, SdpOffer};
use str0m::config::DtlsCert;
use str0m::{Candidate, Rtc};
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::driver::{self, Control, DriverHandle, Report, Setup};
use super::handle::Link;
use super::signal_msg::{
    FINGERPRINT_META_KEY, ICE_META_KEY, SignalPayload, normalize_fingerprint, sdp_fingerprint,
    sdp_max_message_size,
};
use super::turn::{TurnServer, turn_host};
use super::{IceTransportPolicy, LinkConfig, LinkError};

/// What a [`Mesh`] reports.
#[derive(Debug)]
pub enum MeshEvent {
    /// A peer joined the room (or was there when we joined).
    PeerJoined(PeerInfo),
    /// A peer left the room. Its link, if any, stays until it fails (the
    /// data path may outlive the signaling session); it is not re-established.
    PeerLeft(PeerId),
    /// A peer changed its advertised meta.
    PeerMeta(PeerInfo),
    /// A link is established (for the first time or again).
    LinkUp(Link),
    /// A link or an attempt at one ended.
    LinkDown { peer: PeerId, error: LinkError },
    /// A `signal` that is not about links, for the application.
    Signal { from: PeerId, data: Value },
    /// The signaling session ended; no new links can be set up.
    SignalClosed,
}

enum Command {
    Connect(PeerId),
    Disconnect(PeerId),
    SetMeta(Map<String, Value>),
    Blackhole(PeerId),
}

/// Joins a signaling room and manages links to the peers in it.
pub struct Mesh {
    local: PeerId,
    fingerprint: String,
    commands: mpsc::UnboundedSender<Command>,
    events: mpsc::UnboundedReceiver<MeshEvent>,
    task: JoinHandle<()>,
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh").field("local", &self.local).finish()
    }
}

impl Mesh {
    /// Joins `room` on the cairn-signal server at `url` with `token`.
    pub async fn join(
        url: &str,
        room: &str,
        token: &str,
        config: LinkConfig,
    ) -> Result<Self, LinkError> {
        let client = SignalClient::connect(url, room, token)
            .await
            .map_err(|e| match e {
                ClientError::Refused {
                    status: 401 | 403, ..
                } => LinkError::Refused(e.to_string()),
                e => LinkError::Signal(e.to_string()),
            })?;
        Self::with_client(client, config).await
    }

    /// Manages links over an already connected signaling session.
    pub async fn with_client(client: SignalClient, config: LinkConfig) -> Result<Self, LinkError> {
        config.validate()?;
        let provider = str0m::crypto::from_feature_flags();
        let cert = provider
            .dtls_provider
            .generate_certificate()
            .ok_or_else(|| LinkError::Rtc("cannot generate a DTLS certificate".into()))?;
        let fingerprint = {
            let mut rtc = Rtc::builder()
                .set_dtls_cert(cert.clone())
                .build(Instant::now());
            normalize_fingerprint(&rtc.direct_api().local_dtls_fingerprint().to_string())
        };
        let local = client.peer_id().clone();
        let signal = client.sender();
        let mut meta = Map::new();
        meta.insert(
            FINGERPRINT_META_KEY.into(),
            Value::String(fingerprint.clone()),
        );
        if config.share_ice_servers && !config.ice_servers.is_empty() {
            meta.insert(
                ICE_META_KEY.into(),
                serde_json::json!({
                    "servers": config.ice_servers,
                    "policy": config.ice_transport_policy,
                }),
            );
        }
        signal
            .send(ClientMessage::Meta { meta: meta.clone() })
            .await
            .map_err(|e| LinkError::Signal(e.to_string()))?;
        let (stun_servers, turn_servers) = resolve_ice_servers(&config).await;
        if config.ice_transport_policy == IceTransportPolicy::Relay && turn_servers.is_empty() {
            return Err(LinkError::Config(
                "relay-only links, but no usable TURN server (see the warnings)".into(),
            ));
        }
        let (commands_tx, commands) = mpsc::unbounded_channel();
        let (events_tx, events) = mpsc::unbounded_channel();
        let (reports_tx, reports) = mpsc::unbounded_channel();
        // Peers already in the room are reported like later arrivals, so the
        // application handles both the same way.
        for p in client.peers() {
            let _ = events_tx.send(MeshEvent::PeerJoined(p.clone()));
        }
        let peers = client
            .peers()
            .iter()
            .map(|p| (p.peer_id.clone(), p.clone()))
            .collect();
        let task = MeshTask {
            local: local.clone(),
            signal,
            config: Arc::new(config),
            cert,
            meta,
            peers,
            sessions: HashMap::new(),
            wanted: HashMap::new(),
            events: events_tx,
            reports_tx,
            stun_servers,
            turn_servers,
        };
        let task = tokio::spawn(task.run(client, commands, reports));
        info!(peer = %local, "joined the room for peer links");
        Ok(Self {
            local,
            fingerprint,
            commands: commands_tx,
            events,
            task,
        })
    }

    /// Our id in the room.
    pub fn local_id(&self) -> &PeerId {
        &self.local
    }

    /// Our DTLS certificate fingerprint, as announced in our meta.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Opens a link to `peer` (we offer; if it has not joined yet, once it
    /// does) and keeps it up: if it dies while the peer is still in the
    /// room, it is offered again with backoff.
    /// The outcome arrives as [`MeshEvent::LinkUp`] or [`MeshEvent::LinkDown`].
    pub fn connect(&self, peer: &PeerId) {
        let _ = self.commands.send(Command::Connect(peer.clone()));
    }

    /// Stops keeping a link to `peer` up and closes it.
    pub fn disconnect(&self, peer: &PeerId) {
        let _ = self.commands.send(Command::Disconnect(peer.clone()));
    }

    /// Replaces our advertised meta (the DTLS fingerprint and shared ICE servers are kept in it).
    pub fn set_meta(&self, meta: Map<String, Value>) {
        let _ = self.commands.send(Command::SetMeta(meta));
    }

    /// Cuts the network under the current link to `peer` (drops every
    /// packet), as a dead network or a frozen peer would. For tests.
    #[doc(hidden)]
    pub fn debug_blackhole(&self, peer: &PeerId) {
        let _ = self.commands.send(Command::Blackhole(peer.clone()));
    }

    /// The next event; `None` once the mesh's task has ended.
    pub async fn next_event(&mut self) -> Option<MeshEvent> {
        self.events.recv().await
    }
}

/// A link attempt or an established link to one peer.
struct Session {
    id: String,
    driver: DriverHandle,
    offerer: bool,
    up: bool,
}

/// Re-offer schedule for a peer we keep a link to.
struct Wanted {
    backoff: Duration,
    next_attempt: Option<Instant>,
}

struct MeshTask {
    local: PeerId,
    signal: SignalSender,
    config: Arc<LinkConfig>,
    cert: DtlsCert,
    meta: Map<String, Value>,
    peers: HashMap<PeerId, PeerInfo>,
    sessions: HashMap<PeerId, Session>,
    wanted: HashMap<PeerId, Wanted>,
    events: mpsc::UnboundedSender<MeshEvent>,
    reports_tx: mpsc::UnboundedSender<Report>,
    stun_servers: Vec<SocketAddr>,
    turn_servers: Vec<TurnServer>,
}

impl MeshTask {
    async fn run(
        mut self,
        mut client: SignalClient,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut reports: mpsc::UnboundedReceiver<Report>,
    ) {
        let mut signal_open = true;
        loop {
            let next_retry = self
                .wanted
                .values()
                .filter_map(|w| w.next_attempt)
                .min()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                m = client.recv(), if signal_open => match m {
                    Some(m) => self.on_server(m).await,
                    None => {
                        signal_open = false;
                        let _ = self.events.send(MeshEvent::SignalClosed);
                    }
                },
                Some(c) = commands.recv() => self.on_command(c).await,
                Some(r) = reports.recv() => self.on_report(r).await,
                _ = tokio::time::sleep_until(next_retry.into()) => self.retry_due().await,
            }
        }
    }

    fn emit(&self, event: MeshEvent) {
        let _ = self.events.send(event);
    }

    async fn send_signal(&self, to: &PeerId, payload: &SignalPayload) {
        let Ok(data) = serde_json::to_value(payload) else {
            return;
        };
        if let Err(e) = self
            .signal
            .send(ClientMessage::Signal {
                to: to.clone(),
                data,
            })
            .await
        {
            debug!(error = %e, "signal not sent");
        }
    }

    async fn on_server(&mut self, message: ServerMessage) {
        match message {
            ServerMessage::PeerJoined { peer } => {
                let id = peer.peer_id.clone();
                self.peers.insert(id.clone(), peer.clone());
                self.emit(MeshEvent::PeerJoined(peer));
                if self.wanted.contains_key(&id) {
                    self.offer(&id).await;
                }
            }
            ServerMessage::PeerMeta { peer } => {
                self.peers.insert(peer.peer_id.clone(), peer.clone());
                self.emit(MeshEvent::PeerMeta(peer));
            }
            ServerMessage::PeerLeft { peer_id } => {
                self.peers.remove(&peer_id);
                self.wanted.remove(&peer_id);
                // A link attempt that is not up yet cannot succeed without signaling.
                if self.sessions.get(&peer_id).is_some_and(|s| !s.up)
                    && let Some(s) = self.sessions.remove(&peer_id)
                {
                    let _ = s.driver.control.send(Control::Close("peer left".into()));
                }
                self.emit(MeshEvent::PeerLeft(peer_id));
            }
            ServerMessage::Signal { from, data } => {
                match serde_json::from_value::<SignalPayload>(data.clone()) {
                    Ok(payload) => self.on_payload(from, payload).await,
                    Err(_) => self.emit(MeshEvent::Signal { from, data }),
                }
            }
            ServerMessage::Error { message } => {
                debug!(%message, "signaling server refused a message")
            }
            ServerMessage::Welcome { .. } => {}
        }
    }

    /// The fingerprint `peer` announced in its meta, if any.
    fn announced_fingerprint(&self, peer: &PeerId) -> Option<String> {
        self.peers
            .get(peer)?
            .meta
            .get(FINGERPRINT_META_KEY)?
            .as_str()
            .map(normalize_fingerprint)
    }

    fn check_fingerprint(&self, peer: &PeerId, sdp: &str) -> Result<(), LinkError> {
        match (self.announced_fingerprint(peer), sdp_fingerprint(sdp)) {
            (Some(a), Some(s)) if a == s => Ok(()),
            _ => Err(LinkError::FingerprintMismatch),
        }
    }

    async fn on_payload(&mut self, from: PeerId, payload: SignalPayload) {
        match payload {
            SignalPayload::Offer { session, sdp } => self.on_offer(from, session, sdp).await,
            SignalPayload::Answer { session, sdp } => {
                let Some(s) = self
                    .sessions
                    .get(&from)
                    .filter(|s| s.id == session && s.offerer)
                else {
                    debug!(peer = %from, %session, "answer for no current offer");
                    return;
                };
                let control = s.driver.control.clone();
                if let Err(error) = self.check_fingerprint(&from, &sdp) {
                    self.abandon(&from, &session, error).await;
                    return;
                }
                match SdpAnswer::from_sdp_string(&sdp) {
                    Ok(answer) => {
                        let _ = control.send(Control::Answer(answer));
                        self.note_max_message_size(&from, &sdp);
                    }
                    Err(e) => {
                        self.abandon(
                            &from,
                            &session,
                            LinkError::Signal(format!("bad answer: {e}")),
                        )
                        .await
                    }
                }
            }
            SignalPayload::Candidate { session, candidate } => {
                let Some(s) = self.sessions.get(&from).filter(|s| s.id == session) else {
                    debug!(peer = %from, %session, "candidate for no current session");
                    return;
                };
                let text = candidate.trim().trim_start_matches("a=");
                if text.is_empty() {
                    return; // end of candidates
                }
                match Candidate::from_sdp_string(text) {
                    Ok(c) => {
                        let _ = s.driver.control.send(Control::RemoteCandidate(c));
                    }
                    Err(e) => debug!(peer = %from, error = %e, "ignoring a candidate"),
                }
            }
            SignalPayload::Bye { session, reason } => {
                if self.sessions.get(&from).is_some_and(|s| s.id == session)
                    && let Some(s) = self.sessions.remove(&from)
                {
                    debug!(peer = %from, %reason, "peer gave up the session");
                    let _ = s
                        .driver
                        .control
                        .send(Control::Close(format!("peer: {reason}")));
                    self.emit(MeshEvent::LinkDown {
                        peer: from.clone(),
                        error: LinkError::ClosedByPeer(reason),
                    });
                    self.schedule_retry(&from);
                }
            }
        }
    }

    fn note_max_message_size(&self, peer: &PeerId, sdp: &str) {
        // str0m enforces the peer's limit on writes; frames must fit it.
        let size = sdp_max_message_size(sdp).unwrap_or(64 * 1024);
        if size != 0 && (size as usize) < self.config.frame_bytes {
            debug!(%peer, size, "peer's max-message-size is under our frame size");
            if let Some(s) = self.sessions.get(peer) {
                let _ = s.driver.control.send(Control::FrameBytes(size as usize));
            }
        }
    }

    /// Gives up `session` with `peer`: tells the peer, reports, maybe retries.
    async fn abandon(&mut self, peer: &PeerId, session: &str, error: LinkError) {
        warn!(%peer, %session, %error, "link setup refused");
        if self.sessions.get(peer).is_some_and(|s| s.id == session)
            && let Some(s) = self.sessions.remove(peer)
        {
            let _ = s.driver.control.send(Control::Close(error.to_string()));
        }
        self.send_signal(
            peer,
            &SignalPayload::Bye {
                session: session.to_owned(),
                reason: error.to_string(),
            },
        )
        .await;
        self.emit(MeshEvent::LinkDown {
            peer: peer.clone(),
            error,
        });
        self.schedule_retry(peer);
    }

    async fn on_offer(&mut self, from: PeerId, session: String, sdp: String) {
        if let Some(existing) = self.sessions.get(&from) {
            if existing.id == session {
                return; // duplicate
            }
            // Both offered at once: the peer with the smaller id wins.
            if existing.offerer && !existing.up && self.local < from {
                debug!(peer = %from, "offer glare: keeping ours");
                return;
            }
            if let Some(old) = self.sessions.remove(&from) {
                let _ = old
                    .driver
                    .control
                    .send(Control::Close("replaced by a new offer".into()));
            }
        }
        if let Err(error) = self.check_fingerprint(&from, &sdp) {
            self.abandon(&from, &session, error).await;
            return;
        }
        let result = async {
            let offer = SdpOffer::from_sdp_string(&sdp)
                .map_err(|e| LinkError::Signal(format!("bad offer: {e}")))?;
            let (mut rtc, sockets) = self.new_rtc().await?;
            let answer = rtc.sdp_api().accept_offer(offer)?;
            Ok::<_, LinkError>((rtc, sockets, answer))
        }
        .await;
        let (rtc, sockets, answer) = match result {
            Ok(r) => r,
            Err(error) => {
                self.abandon(&from, &session, error).await;
                return;
            }
        };
        let driver = driver::spawn(Setup {
            rtc,
            sockets,
            peer: from.clone(),
            local_peer: self.local.clone(),
            session: session.clone(),
            pending_offer: None,
            config: Arc::clone(&self.config),
            reports: self.reports_tx.clone(),
            stun_servers: self.stun_servers.clone(),
            turn_servers: self.turn_servers.clone(),
        });
        self.sessions.insert(
            from.clone(),
            Session {
                id: session.clone(),
                driver,
                offerer: false,
                up: false,
            },
        );
        self.note_max_message_size(&from, &sdp);
        self.send_signal(
            &from,
            &SignalPayload::Answer {
                session,
                sdp: answer.to_sdp_string(),
            },
        )
        .await;
    }

    /// A new `Rtc` with our certificate and limits, and its host candidates.
    async fn new_rtc(&self) -> Result<(Rtc, Vec<UdpSocket>), LinkError> {
        let c = &self.config;
        let mut rtc = Rtc::builder()
            .set_dtls_cert(self.cert.clone())
            .set_sctp_max_message_size(c.max_message_size)
            .set_sctp_max_buffered_amount(c.flow.high_water)
            .set_mtu(c.mtu..=usize::MAX)
            .build(Instant::now());
        if c.ice_transport_policy == IceTransportPolicy::Relay {
            // No host sockets at all: the relays' own sockets talk to the
            // TURN servers, and the driver adds the relay candidates.
            return Ok((rtc, Vec::new()));
        }
        let sockets = bind_sockets(c).await?;
        for s in &sockets {
            let addr = s.local_addr()?;
            let candidate =
                Candidate::host(addr, "udp").map_err(|e| LinkError::Rtc(e.to_string()))?;
            rtc.add_local_candidate(candidate);
        }
        Ok((rtc, sockets))
    }

    async fn offer(&mut self, peer: &PeerId) {
        if !self.peers.contains_key(peer) {
            // Not seen yet (its join may still be on the way): offer when it shows up.
            debug!(%peer, "waiting for the peer to join before offering");
            return;
        }
        if self.sessions.contains_key(peer) {
            return;
        }
        let session = format!("{:016x}", rand::random::<u64>());
        let result = async {
            let (mut rtc, sockets) = self.new_rtc().await?;
            let mut change = rtc.sdp_api();
            change.add_channel("cairn".into());
            let (offer, pending) = change
                .apply()
                .ok_or_else(|| LinkError::Rtc("no offer to make".into()))?;
            Ok::<_, LinkError>((rtc, sockets, offer, pending))
        }
        .await;
        let (rtc, sockets, offer, pending) = match result {
            Ok(r) => r,
            Err(error) => {
                self.emit(MeshEvent::LinkDown {
                    peer: peer.clone(),
                    error,
                });
                self.schedule_retry(peer);
                return;
            }
        };
        debug!(%peer, %session, "offering a link");
        let driver = driver::spawn(Setup {
            rtc,
            sockets,
            peer: peer.clone(),
            local_peer: self.local.clone(),
            session: session.clone(),
            pending_offer: Some(pending),
            config: Arc::clone(&self.config),
            reports: self.reports_tx.clone(),
            stun_servers: self.stun_servers.clone(),
            turn_servers: self.turn_servers.clone(),
        });
        self.sessions.insert(
            peer.clone(),
            Session {
                id: session.clone(),
                driver,
                offerer: true,
                up: false,
            },
        );
        self.send_signal(
            peer,
            &SignalPayload::Offer {
                session,
                sdp: offer.to_sdp_string(),
            },
        )
        .await;
    }

    fn schedule_retry(&mut self, peer: &PeerId) {
        if !self.config.reconnect || !self.peers.contains_key(peer) {
            return;
        }
        let (_, max) = self.config.reconnect_backoff;
        if let Some(w) = self.wanted.get_mut(peer) {
            w.next_attempt = Some(Instant::now() + w.backoff);
            w.backoff = (w.backoff * 2).min(max);
        }
    }

    async fn retry_due(&mut self) {
        let now = Instant::now();
        let due: Vec<PeerId> = self
            .wanted
            .iter()
            .filter(|(_, w)| w.next_attempt.is_some_and(|t| t <= now))
            .map(|(p, _)| p.clone())
            .collect();
        for peer in due {
            if let Some(w) = self.wanted.get_mut(&peer) {
                w.next_attempt = None;
            }
            info!(%peer, "re-establishing link");
            self.offer(&peer).await;
        }
    }

    async fn on_command(&mut self, command: Command) {
        match command {
            Command::Connect(peer) => {
                self.wanted.entry(peer.clone()).or_insert(Wanted {
                    backoff: self.config.reconnect_backoff.0,
                    next_attempt: None,
                });
                self.offer(&peer).await;
            }
            Command::Disconnect(peer) => {
                self.wanted.remove(&peer);
                if let Some(s) = self.sessions.remove(&peer) {
                    let _ = s.driver.control.send(Control::Close("disconnect".into()));
                }
            }
            Command::SetMeta(mut meta) => {
                // What the mesh itself announces stays, whatever the application sets.
                for key in [FINGERPRINT_META_KEY, ICE_META_KEY] {
                    if let Some(v) = self.meta.get(key) {
                        meta.insert(key.into(), v.clone());
                    }
                }
                self.meta = meta.clone();
                let _ = self.signal.send(ClientMessage::Meta { meta }).await;
            }
            Command::Blackhole(peer) => {
                if let Some(s) = self.sessions.get(&peer) {
                    let _ = s.driver.control.send(Control::Blackhole);
                }
            }
        }
    }

    async fn on_report(&mut self, report: Report) {
        match report {
            Report::LocalCandidate {
                peer,
                session,
                candidate,
            } => {
                self.send_signal(&peer, &SignalPayload::Candidate { session, candidate })
                    .await;
            }
            Report::Up {
                peer,
                session,
                link,
            } => {
                match self.sessions.get_mut(&peer) {
                    Some(s) if s.id == session => s.up = true,
                    _ => {
                        link.close("superseded");
                        return;
                    }
                }
                if let Some(w) = self.wanted.get_mut(&peer) {
                    w.backoff = self.config.reconnect_backoff.0;
                }
                self.emit(MeshEvent::LinkUp(link));
            }
            Report::Down {
                peer,
                session,
                error,
            } => {
                let current = self.sessions.get(&peer).is_some_and(|s| s.id == session);
                if !current {
                    return;
                }
                self.sessions.remove(&peer);
                if !matches!(error, LinkError::Closed) {
                    self.send_signal(
                        &peer,
                        &SignalPayload::Bye {
                            session,
                            reason: error.to_string(),
                        },
                    )
                    .await;
                }
                self.emit(MeshEvent::LinkDown {
                    peer: peer.clone(),
                    error,
                });
                self.schedule_retry(&peer);
            }
        }
    }
}

/// One UDP socket per local address to gather host candidates on.
async fn bind_sockets(config: &LinkConfig) -> Result<Vec<UdpSocket>, LinkError> {
    let mut ips = config.bind.clone();
    if ips.is_empty() {
        ips = if_addrs::get_if_addrs()
            .map(|list| {
                list.into_iter()
                    .filter(|i| !i.is_loopback() && !i.is_link_local())
                    .map(|i| i.ip())
                    .collect()
            })
            .unwrap_or_default();
        if ips.is_empty() {
            ips.push(IpAddr::from([127, 0, 0, 1]));
        }
    }
    let mut sockets = Vec::new();
    for ip in ips {
        match bind_one(SocketAddr::new(ip, 0), config.udp_buffer_bytes) {
            Ok(s) => sockets.push(s),
            Err(e) => warn!(%ip, error = %e, "cannot bind a UDP socket"),
        }
    }
    if sockets.is_empty() {
        return Err(LinkError::Io("no local address to bind".into()));
    }
    Ok(sockets)
}

pub(crate) fn bind_one(addr: SocketAddr, buffer: usize) -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, None)?;
    // Best effort: the kernel caps these (net.core.rmem_max).
    let _ = socket.set_recv_buffer_size(buffer);
    let _ = socket.set_send_buffer_size(buffer);
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    UdpSocket::from_std(socket.into())
}

/// Resolves the configured STUN and TURN servers; warns about (and
/// skips) what native links cannot use.
async fn resolve_ice_servers(config: &LinkConfig) -> (Vec<SocketAddr>, Vec<TurnServer>) {
    let relay_only = config.ice_transport_policy == IceTransportPolicy::Relay;
    let mut stun = Vec::new();
    let mut turn = Vec::new();
    for server in &config.ice_servers {
        for url in &server.urls {
            let is_turn = url.starts_with("turn:") || url.starts_with("turns:");
            let (host, port) = if is_turn {
                match turn_host(url) {
                    Ok(hp) => hp,
                    Err(why) => {
                        warn!(%url, %why, "ignoring TURN server");
                        continue;
                    }
                }
            } else {
                match super::stun::stun_host(url) {
                    Some(hp) => hp,
                    None => {
                        warn!(%url, "not a stun: or turn: URL; ignoring");
                        continue;
                    }
                }
            };
            if !is_turn && relay_only {
                continue; // no server-reflexive candidates under a relay-only policy
            }
            let (Some(username), Some(credential)) = (&server.username, &server.credential) else {
                if is_turn {
                    warn!(%url, "TURN server without username and credential; ignoring");
                    continue;
                }
                match tokio::net::lookup_host((host.as_str(), port)).await {
                    Ok(addrs) => stun.extend(addrs),
                    Err(e) => warn!(%url, error = %e, "cannot resolve STUN server"),
                }
                continue;
            };
            let addrs = match tokio::net::lookup_host((host.as_str(), port)).await {
                Ok(addrs) => addrs,
                Err(e) => {
                    warn!(%url, error = %e, "cannot resolve ICE server");
                    continue;
                }
            };
            for addr in addrs {
                if is_turn {
                    // One allocation per server, not per resolved address.
                    turn.push(TurnServer {
                        url: url.clone(),
                        addr,
                        username: username.clone(),
                        credential: credential.clone(),
                    });
                    break;
                }
                stun.push(addr);
            }
        }
    }
    (stun, turn)
}

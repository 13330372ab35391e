//! One link's datagrams below str0m: its UDP sockets and TURN relays (ready
//! and under way), the local address of each, sending from and receiving
//! at a local address (relayed sends included), server-reflexive gathering
//! over the sockets, DTLS that came before ICE checked its source, relay
//! byte counters and the tests' blackhole. The driver hands str0m's
//! transmits here and gets back what str0m should receive.

use std::future::{pending, poll_fn};
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::task::Poll;
use std::time::{Duration, Instant};

use str0m::Candidate;
use str0m::net::{Protocol, Receive, Transmit};
use tokio::io::ReadBuf;
use tokio::net::UdpSocket;
use tokio::task::JoinError;
use tracing::{debug, warn};

use super::LinkError;
use super::gather::ReflexiveGathering;
use super::stats::RelayStats;
use super::turn::{Allocations, Relay, TurnServer};

/// Most DTLS datagrams kept while ICE checks their source.
const MAX_EARLY_DTLS: usize = 8;

/// A DTLS record (and so SCTP, our data), by its first byte (RFC 7983's
/// demultiplexing), as opposed to ICE's STUN checks.
pub(crate) fn is_dtls(data: &[u8]) -> bool {
    data.first().is_some_and(|b| (20..=63).contains(b))
}

/// Where a local address lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Socket(usize),
    Relay(usize),
}

/// The local addresses by endpoint number: one per socket, then the
/// relayed address of each relay, in the order they became ready.
#[derive(Debug)]
struct Locals {
    addrs: Vec<SocketAddr>,
    sockets: usize,
}

impl Locals {
    fn new(sockets: Vec<SocketAddr>) -> Self {
        Self {
            sockets: sockets.len(),
            addrs: sockets,
        }
    }

    fn push_relay(&mut self, relayed: SocketAddr) {
        self.addrs.push(relayed);
    }

    fn address(&self, endpoint: usize) -> Option<SocketAddr> {
        self.addrs.get(endpoint).copied()
    }

    fn endpoint(&self, index: usize) -> Endpoint {
        match index.checked_sub(self.sockets) {
            Some(relay) => Endpoint::Relay(relay),
            None => Endpoint::Socket(index),
        }
    }

    /// Which endpoint sends what str0m transmits from `source`: the one
    /// with that address, else the first (str0m sends only from the
    /// addresses it was given as candidates).
    fn sending(&self, source: SocketAddr) -> Endpoint {
        self.endpoint(self.addrs.iter().position(|a| *a == source).unwrap_or(0))
    }
}

/// A datagram that came early, at endpoint `endpoint` from `from`.
#[derive(Debug, PartialEq)]
pub(crate) struct Early {
    pub endpoint: usize,
    pub data: Vec<u8>,
    pub from: SocketAddr,
}

/// DTLS datagrams that came before ICE had checked their source, replayed
/// once it has: str0m drops them, and the peer would resend its first
/// flight only after a second.
#[derive(Debug, Default)]
struct EarlyDtls {
    held: Vec<Early>,
}

impl EarlyDtls {
    /// Keeps `data` if it is DTLS and there is room; `true` if kept.
    fn keep(&mut self, endpoint: usize, data: &[u8], from: SocketAddr) -> bool {
        if !is_dtls(data) || self.held.len() >= MAX_EARLY_DTLS {
            return false;
        }
        self.held.push(Early {
            endpoint,
            data: data.to_vec(),
            from,
        });
        true
    }

    /// The datagrams `ready` says can go now, in the order they came; the
    /// others stay.
    fn take_ready(&mut self, ready: impl FnMut(&Early) -> bool) -> Vec<Early> {
        if self.held.is_empty() {
            return Vec::new();
        }
        let (ready, waiting) = std::mem::take(&mut self.held).into_iter().partition(ready);
        self.held = waiting;
        ready
    }
}

/// What a received datagram is, for the driver.
pub(crate) enum Incoming<'a> {
    /// Dropped (a blackhole), neither STUN, DTLS nor RTP, or a STUN answer
    /// that told us nothing new.
    Ignored,
    /// One of our STUN servers answered: a server-reflexive candidate.
    Reflexive(Candidate),
    /// For str0m.
    Rtc(Receive<'a>),
}

/// What the transport woke the driver for.
pub(crate) enum Arrival {
    /// A datagram of `len` bytes (at the start of the buffer) at `endpoint`, from `from`.
    Datagram {
        endpoint: usize,
        len: usize,
        from: SocketAddr,
    },
    /// A TURN allocation finished.
    Allocated(Result<Result<Relay, LinkError>, JoinError>),
    /// A socket failed.
    Error(std::io::Error),
}

/// Everything one link sends and receives datagrams through.
pub(crate) struct Transport {
    sockets: Vec<UdpSocket>,
    /// TURN allocations that are ready, after the sockets in `locals`.
    relays: Vec<Relay>,
    /// TURN allocations under way.
    allocations: Allocations,
    locals: Locals,
    /// Server-reflexive candidates being gathered.
    gathering: ReflexiveGathering,
    early_dtls: EarlyDtls,
    relay_stats: RelayStats,
    /// Drop every datagram, both ways (tests: a cut network).
    blackhole: bool,
}

impl Transport {
    /// The host sockets of a link, asking `stun_servers` for reflexive
    /// addresses and allocating a relay on each of `turn_servers` (each
    /// allowed `allocation_timeout`; a `relay_only` link fails when none is
    /// left to try).
    pub fn new(
        sockets: Vec<UdpSocket>,
        stun_servers: &[SocketAddr],
        turn_servers: Vec<TurnServer>,
        udp_buffer_bytes: usize,
        allocation_timeout: Duration,
        relay_only: bool,
        now: Instant,
    ) -> Self {
        let (sockets, addrs): (Vec<_>, Vec<_>) = sockets
            .into_iter()
            .filter_map(|s| match s.local_addr() {
                Ok(a) => Some((s, a)),
                Err(e) => {
                    warn!(error = %e, "a socket without a local address: not used");
                    None
                }
            })
            .unzip();
        let known: Vec<_> = addrs.iter().copied().map(Some).collect();
        Self {
            sockets,
            relays: Vec::new(),
            allocations: Allocations::start(
                turn_servers,
                udp_buffer_bytes,
                allocation_timeout,
                relay_only,
            ),
            locals: Locals::new(addrs),
            gathering: ReflexiveGathering::new(stun_servers, &known, now),
            early_dtls: EarlyDtls::default(),
            relay_stats: RelayStats::default(),
            blackhole: false,
        }
    }

    /// From now on, drop every datagram both ways.
    pub fn blackhole(&mut self) {
        self.blackhole = true;
    }

    pub fn is_blackholed(&self) -> bool {
        self.blackhole
    }

    pub fn relay_stats(&self) -> &RelayStats {
        &self.relay_stats
    }

    /// Sockets and ready relays: the endpoints `0..endpoints()`.
    pub fn endpoints(&self) -> usize {
        self.sockets.len() + self.relays.len()
    }

    /// Waits for a datagram (if `reading`) or a finished TURN allocation;
    /// forever if there is neither to wait for.
    pub async fn wake(&mut self, buf: &mut [u8], reading: bool) -> Arrival {
        tokio::select! {
            Some(a) = self.allocations.join_next(), if !self.allocations.is_empty() => Arrival::Allocated(a),
            r = recv_any(&self.sockets, &mut self.relays, buf), if reading => match r {
                Ok((endpoint, len, from)) => Arrival::Datagram { endpoint, len, from },
                Err(e) => Arrival::Error(e),
            },
            else => pending().await,
        }
    }

    /// A datagram waiting at `endpoint`, without waiting: its length (at
    /// the start of `buf`) and source.
    pub fn try_recv(
        &mut self,
        endpoint: usize,
        buf: &mut [u8],
    ) -> std::io::Result<Option<(usize, SocketAddr)>> {
        match self.locals.endpoint(endpoint) {
            Endpoint::Socket(i) => match self.sockets.get(i).map(|s| s.try_recv_from(buf)) {
                Some(Ok(got)) => Ok(Some(got)),
                Some(Err(e)) if e.kind() == ErrorKind::WouldBlock => Ok(None),
                Some(Err(e)) => Err(e),
                None => Ok(None),
            },
            Endpoint::Relay(r) => {
                let Some(Ok((data, from))) = self.relays.get_mut(r).map(|r| r.incoming.try_recv())
                else {
                    return Ok(None);
                };
                let n = data.len().min(buf.len());
                buf[..n].copy_from_slice(&data[..n]);
                Ok(Some((n, from)))
            }
        }
    }

    /// What `data`, received at `endpoint` from `from`, is.
    pub fn incoming<'a>(
        &mut self,
        endpoint: usize,
        data: &'a [u8],
        from: SocketAddr,
    ) -> Incoming<'a> {
        if self.blackhole {
            return Incoming::Ignored;
        }
        let Some(local) = self.locals.address(endpoint) else {
            return Incoming::Ignored;
        };
        if let Some(mapped) = self.gathering.on_datagram(endpoint, from, data) {
            return match Candidate::server_reflexive(mapped, local, "udp") {
                Ok(c) if mapped != local => Incoming::Reflexive(c),
                _ => Incoming::Ignored,
            };
        }
        match data.try_into() {
            Ok(contents) => Incoming::Rtc(Receive {
                proto: Protocol::Udp,
                source: from,
                destination: local,
                contents,
            }),
            Err(_) => Incoming::Ignored,
        }
    }

    /// str0m did not take `data` (received at `endpoint` from `from`) while
    /// the link is not up yet: keep it if it is DTLS ICE has yet to check.
    pub fn keep_early(&mut self, endpoint: usize, data: &[u8], from: SocketAddr) {
        self.early_dtls.keep(endpoint, data, from);
    }

    /// The early datagrams str0m takes now (`accepts`), to receive again.
    pub fn take_early(&mut self, mut accepts: impl FnMut(Receive<'_>) -> bool) -> Vec<Early> {
        let locals = &self.locals;
        self.early_dtls.take_ready(|e| {
            let Some(destination) = locals.address(e.endpoint) else {
                return false;
            };
            e.data.as_slice().try_into().is_ok_and(|contents| {
                accepts(Receive {
                    proto: Protocol::Udp,
                    source: e.from,
                    destination,
                    contents,
                })
            })
        })
    }

    /// Sends what str0m transmits, from the local address it names: over
    /// that socket, or through that relay. A datagram that cannot go out
    /// is a lost packet (ICE and SCTP retransmit).
    pub async fn send(&mut self, t: &Transmit) {
        if self.blackhole {
            return;
        }
        let dtls = is_dtls(&t.contents);
        match self.locals.sending(t.source) {
            Endpoint::Relay(r) => {
                let Some(relay) = self.relays.get(r) else {
                    return;
                };
                // A full queue drops the datagram.
                if relay.send(&t.contents, t.destination) {
                    self.relay_stats.relayed(t.contents.len(), dtls);
                }
            }
            Endpoint::Socket(i) => {
                if dtls {
                    self.relay_stats.direct();
                }
                let Some(s) = self.sockets.get(i) else {
                    return;
                };
                match s.try_send_to(&t.contents, t.destination) {
                    Ok(_) => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        let _ = s.send_to(&t.contents, t.destination).await;
                    }
                    Err(e) => debug!(error = %e, "send failed"),
                }
            }
        }
    }

    /// When a STUN request is next due.
    pub fn next_gather(&self) -> Option<Instant> {
        self.gathering.next_try()
    }

    /// Sends the STUN requests due at `now`.
    pub async fn gather(&mut self, now: Instant) {
        for r in self.gathering.due(now) {
            if let Some(socket) = self.sockets.get(r.socket) {
                let _ = socket.send_to(&r.bytes, r.server).await;
            }
        }
    }

    /// A TURN allocation finished: its relay's candidate, for str0m, or
    /// none (its failure noted). `Err` when a relay-only link has no relay
    /// left to try.
    pub fn on_allocated(
        &mut self,
        result: Result<Result<Relay, LinkError>, JoinError>,
    ) -> Result<Option<Candidate>, LinkError> {
        let Some(relay) = self.allocations.finished(result, self.relays.len())? else {
            return Ok(None);
        };
        match Candidate::relayed(relay.relayed, relay.base, "udp") {
            Ok(c) => {
                debug!(server = %relay.server, relayed = %relay.relayed, "TURN relay ready");
                self.locals.push_relay(relay.relayed);
                self.relays.push(relay);
                Ok(Some(c))
            }
            Err(e) => {
                self.allocations.unusable(LinkError::Turn {
                    server: relay.server.clone(),
                    reason: format!("unusable relayed address {}: {e}", relay.relayed),
                });
                self.allocations.check(self.relays.len()).map(|()| None)
            }
        }
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

#[cfg(test)]
mod tests {
    use cairn_engine::session::SessionStats;

    use super::super::stats::LinkStats;
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("address")
    }

    const DTLS: &[u8] = &[22, 254, 253, 0, 0];
    const NOT_DTLS: &[u8] = &[0, 1, 0, 0];

    #[test]
    fn endpoints_are_the_sockets_then_the_relays() {
        let (a, b, relayed) = (
            addr("10.0.0.1:5000"),
            addr("10.0.0.2:5000"),
            addr("203.0.113.9:40000"),
        );
        let mut locals = Locals::new(vec![a, b]);
        locals.push_relay(relayed);
        assert_eq!(locals.address(2), Some(relayed));
        assert_eq!(locals.address(3), None);
        assert_eq!(locals.sending(b), Endpoint::Socket(1));
        assert_eq!(locals.sending(relayed), Endpoint::Relay(0));
        assert_eq!(
            locals.sending(addr("192.0.2.1:1")),
            Endpoint::Socket(0),
            "an address we do not have: the first"
        );
        let relay_only = Locals::new(Vec::new());
        assert_eq!(relay_only.sending(relayed), Endpoint::Relay(0));
    }

    #[test]
    fn early_dtls_keeps_a_few_dtls_records_and_gives_back_those_ready_in_order() {
        let from = addr("192.0.2.1:9");
        let mut early = EarlyDtls::default();
        assert!(!early.keep(0, NOT_DTLS, from), "STUN is not kept");
        assert!(!early.keep(0, &[], from));
        for n in 0..MAX_EARLY_DTLS {
            assert!(early.keep(n % 2, &[22, n as u8], from));
        }
        assert!(!early.keep(0, DTLS, from), "full");
        assert!(early.take_ready(|_| false).is_empty());
        let ready = early.take_ready(|e| e.endpoint == 1);
        let order: Vec<u8> = ready.iter().map(|e| e.data[1]).collect();
        assert_eq!(order, vec![1, 3, 5, 7]);
        assert_eq!(early.held.len(), MAX_EARLY_DTLS / 2, "the rest wait");
        assert!(early.keep(0, DTLS, from), "room again");
    }

    async fn loopback(n: usize) -> Vec<UdpSocket> {
        let mut sockets = Vec::new();
        for _ in 0..n {
            sockets.push(UdpSocket::bind("127.0.0.1:0").await.expect("bind"));
        }
        sockets
    }

    fn transport(sockets: Vec<UdpSocket>, relay_only: bool) -> Transport {
        Transport::new(
            sockets,
            &[],
            Vec::new(),
            1 << 16,
            Duration::from_secs(1),
            relay_only,
            Instant::now(),
        )
    }

    fn transmit(source: SocketAddr, destination: SocketAddr, data: &[u8]) -> Transmit {
        Transmit {
            proto: Protocol::Udp,
            source,
            destination,
            contents: data.to_vec().into(),
        }
    }

    async fn next_datagram(t: &mut Transport, buf: &mut [u8]) -> (usize, usize, SocketAddr) {
        let wake = tokio::time::timeout(Duration::from_secs(5), t.wake(buf, true));
        match wake.await.expect("a datagram within 5 s") {
            Arrival::Datagram {
                endpoint,
                len,
                from,
            } => (endpoint, len, from),
            Arrival::Allocated(_) => panic!("no allocation was started"),
            Arrival::Error(e) => panic!("socket error: {e}"),
        }
    }

    #[tokio::test]
    async fn sends_from_the_socket_str0m_names_and_receives_at_each() {
        let sockets = loopback(2).await;
        let [a, b] = [0, 1].map(|i| sockets[i].local_addr().expect("addr"));
        let mut t = transport(sockets, false);
        assert_eq!(t.endpoints(), 2);
        let peer = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let peer_addr = peer.local_addr().expect("addr");

        t.send(&transmit(b, peer_addr, DTLS)).await;
        let mut got = [0u8; 64];
        let (n, from) = peer.recv_from(&mut got).await.expect("sent");
        assert_eq!((&got[..n], from), (DTLS, b));
        let stats = LinkStats::new(SessionStats::default(), t.relay_stats(), Instant::now());
        assert!(!stats.relayed, "data went straight to the peer");

        peer.send_to(DTLS, b).await.expect("send");
        let mut buf = vec![0u8; 2048];
        let (endpoint, len, from) = next_datagram(&mut t, &mut buf).await;
        assert_eq!((endpoint, from), (1, peer_addr));
        let Incoming::Rtc(r) = t.incoming(endpoint, &buf[..len], from) else {
            panic!("DTLS is for str0m");
        };
        assert_eq!((r.source, r.destination), (peer_addr, b));

        assert!(matches!(
            t.incoming(0, &[255, 1, 2], peer_addr),
            Incoming::Ignored
        ));

        assert_eq!(t.try_recv(0, &mut buf).expect("no error"), None);
        peer.send_to(NOT_DTLS, a).await.expect("send");
        let mut polled = None;
        for _ in 0..100 {
            polled = t.try_recv(0, &mut buf).expect("no error");
            if polled.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(polled, Some((NOT_DTLS.len(), peer_addr)));
        assert_eq!(t.try_recv(5, &mut buf).expect("no such endpoint"), None);
    }

    #[tokio::test]
    async fn early_dtls_is_replayed_with_the_address_it_came_to() {
        let sockets = loopback(2).await;
        let b = sockets[1].local_addr().expect("addr");
        let mut t = transport(sockets, false);
        let peer = addr("127.0.0.1:9");
        t.keep_early(1, DTLS, peer);
        t.keep_early(1, NOT_DTLS, peer);
        assert!(t.take_early(|_| false).is_empty(), "str0m not ready yet");
        let mut seen = Vec::new();
        let ready = t.take_early(|r| {
            seen.push((r.source, r.destination));
            true
        });
        assert_eq!(seen, vec![(peer, b)]);
        assert_eq!(
            ready,
            vec![Early {
                endpoint: 1,
                data: DTLS.to_vec(),
                from: peer
            }]
        );
        assert!(t.take_early(|_| true).is_empty(), "given back once");
    }

    #[tokio::test]
    async fn a_blackhole_drops_both_ways() {
        let sockets = loopback(1).await;
        let a = sockets[0].local_addr().expect("addr");
        let mut t = transport(sockets, false);
        let peer = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let peer_addr = peer.local_addr().expect("addr");
        t.blackhole();
        assert!(t.is_blackholed());
        t.send(&transmit(a, peer_addr, DTLS)).await;
        let mut got = [0u8; 64];
        let quiet = tokio::time::timeout(Duration::from_millis(100), peer.recv_from(&mut got));
        assert!(quiet.await.is_err(), "nothing went out");
        assert!(matches!(t.incoming(0, DTLS, peer_addr), Incoming::Ignored));
    }

    #[tokio::test]
    async fn with_nothing_to_read_or_allocate_it_waits() {
        let mut t = transport(loopback(1).await, false);
        let mut buf = [0u8; 64];
        let waited = tokio::time::timeout(Duration::from_millis(50), t.wake(&mut buf, false));
        assert!(waited.await.is_err());
    }

    #[tokio::test]
    async fn a_failed_allocation_ends_only_a_relay_only_link() {
        let refused = || LinkError::Turn {
            server: "turn:192.0.2.1".into(),
            reason: "allocation refused".into(),
        };
        let mut relay_only = transport(Vec::new(), true);
        assert!(matches!(relay_only.on_allocated(Ok(Err(refused()))), Err(e) if e == refused()));
        let mut with_hosts = transport(loopback(1).await, false);
        assert!(matches!(
            with_hosts.on_allocated(Ok(Err(refused()))),
            Ok(None)
        ));
        assert_eq!(with_hosts.endpoints(), 1);
    }
}

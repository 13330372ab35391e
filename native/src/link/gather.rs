//! ICE candidate gathering beyond host candidates: server-reflexive ones,
//! from a STUN Binding request to each configured STUN server over each
//! socket of its address family, retried a few times. Sans-IO: the driver
//! sends the requests this hands out and shows it the datagrams it gets.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::stun;

const STUN_TRIES: u32 = 4;
const STUN_RETRY: Duration = Duration::from_millis(500);

/// A STUN query in flight.
#[derive(Debug)]
struct StunQuery {
    server: SocketAddr,
    socket: usize,
    tid: stun::TransactionId,
    next_try: Instant,
    tries: u32,
}

/// The server-reflexive queries of one link.
#[derive(Debug, Default)]
pub(crate) struct ReflexiveGathering {
    queries: Vec<StunQuery>,
}

/// A request to send: over socket `socket`, to `server`.
pub(crate) struct StunRequest {
    pub socket: usize,
    pub server: SocketAddr,
    pub bytes: Vec<u8>,
}

impl ReflexiveGathering {
    /// One query per STUN server and socket of its address family;
    /// `locals[i]`: socket i's address (loopback sockets ask no server).
    pub fn new(servers: &[SocketAddr], locals: &[Option<SocketAddr>], now: Instant) -> Self {
        let queries = servers
            .iter()
            .flat_map(|&server| {
                locals
                    .iter()
                    .enumerate()
                    .filter_map(move |(socket, local)| {
                        let local = (*local)?;
                        (local.is_ipv4() == server.is_ipv4() && !local.ip().is_loopback()).then(
                            || StunQuery {
                                server,
                                socket,
                                tid: rand::random(),
                                next_try: now,
                                tries: 0,
                            },
                        )
                    })
            })
            .collect();
        Self { queries }
    }

    /// When a request is next due.
    pub fn next_try(&self) -> Option<Instant> {
        self.queries.iter().map(|q| q.next_try).min()
    }

    /// The requests due at `now`; a server that has not answered after
    /// `STUN_TRIES` is given up on.
    pub fn due(&mut self, now: Instant) -> Vec<StunRequest> {
        let mut out = Vec::new();
        self.queries.retain_mut(|q| {
            if q.next_try > now {
                return true;
            }
            if q.tries >= STUN_TRIES {
                tracing::debug!(server = %q.server, "no answer from STUN server");
                return false;
            }
            q.tries += 1;
            q.next_try = now + STUN_RETRY * q.tries;
            out.push(StunRequest {
                socket: q.socket,
                server: q.server,
                bytes: stun::binding_request(&q.tid),
            });
            true
        });
        out
    }

    /// A datagram from `from` on `socket`: `Some(mapped)` if it answers one
    /// of our queries (which is then done), `None` if it is someone else's.
    pub fn on_datagram(
        &mut self,
        socket: usize,
        from: SocketAddr,
        data: &[u8],
    ) -> Option<SocketAddr> {
        let pos = self
            .queries
            .iter()
            .position(|q| q.server == from && q.socket == socket)?;
        let mapped = stun::parse_binding_success(data, &self.queries[pos].tid)?;
        self.queries.swap_remove(pos);
        Some(mapped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("address")
    }

    #[test]
    fn asks_each_server_over_sockets_of_its_family_and_gives_up() {
        let t0 = Instant::now();
        let servers = [addr("192.0.2.1:3478"), addr("[2001:db8::1]:3478")];
        let locals = [
            Some(addr("10.0.0.2:5000")),
            Some(addr("127.0.0.1:5001")),
            Some(addr("[2001:db8::2]:5002")),
            None,
        ];
        let mut g = ReflexiveGathering::new(&servers, &locals, t0);
        let first = g.due(t0);
        let pairs: Vec<_> = first.iter().map(|r| (r.socket, r.server)).collect();
        assert_eq!(pairs, vec![(0, servers[0]), (2, servers[1])]);
        assert!(g.due(t0).is_empty(), "not again before the retry");
        for _ in 1..STUN_TRIES {
            let t = g.next_try().expect("retry");
            assert_eq!(g.due(t).len(), 2);
        }
        let t = g.next_try().expect("last wait");
        assert!(g.due(t).is_empty());
        assert_eq!(g.next_try(), None, "given up after {STUN_TRIES} tries");
    }

    #[test]
    fn an_answer_from_the_server_gives_the_mapped_address_once() {
        let t0 = Instant::now();
        let server = addr("192.0.2.1:3478");
        let mut g = ReflexiveGathering::new(&[server], &[Some(addr("10.0.0.2:5000"))], t0);
        let request = g.due(t0).remove(0);
        let tid: stun::TransactionId = request.bytes[8..20].try_into().expect("tid");
        let mapped = addr("203.0.113.7:41000");
        let answer = stun::tests::success(&tid, mapped);
        assert_eq!(
            g.on_datagram(0, addr("192.0.2.9:3478"), &answer),
            None,
            "another source"
        );
        assert_eq!(g.on_datagram(0, server, b"not stun"), None);
        assert_eq!(g.on_datagram(0, server, &answer), Some(mapped));
        assert_eq!(g.on_datagram(0, server, &answer), None, "done");
        assert_eq!(g.next_try(), None);
    }
}

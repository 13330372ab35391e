//! TURN relay candidates (RFC 8656) for native links.
//!
//! str0m has no TURN client, so each link allocates a relay on every
//! configured TURN server with the `turn` crate's client (long-term
//! credentials; CreatePermission and ChannelBind as the first datagram to
//! each peer goes out; Send/Data indications until the channel is bound,
//! ChannelData after; refreshes of the allocation and permissions). The
//! relayed address is handed to str0m as a local `relay` candidate: what
//! str0m transmits from that address goes out through the allocation, and
//! what the allocation receives is given to str0m as if it had arrived at
//! that address. The `turn` client is async and blocks a sender while it
//! creates a permission, so a [`Relay`] runs it in two small tasks and the
//! link's driver only ever does non-blocking queue operations on it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::task::{JoinError, JoinHandle, JoinSet};
use tracing::{debug, warn};
use turn::client::{Client, ClientConfig};
use webrtc_util::Conn;

use super::LinkError;

/// A TURN server as the links use it: resolved, with its credentials.
#[derive(Clone, Debug)]
pub(crate) struct TurnServer {
    /// The URL it was configured as, for messages.
    pub url: String,
    pub addr: SocketAddr,
    pub username: String,
    pub credential: String,
}

/// Datagrams queued between the driver and a relay's tasks. A full queue
/// drops the datagram (a lost packet, which SCTP and ICE retransmit).
const RELAY_QUEUE: usize = 1024;
/// Read buffer for the allocation: the largest datagram the `turn` client
/// passes on, so a peer's oversized datagram cannot fail the read (which
/// would end the relay) however large it is.
const RELAY_RECV_BYTES: usize = u16::MAX as usize;
/// How long closing an allocation may take when a link ends.
const CLOSE_WAIT: Duration = Duration::from_millis(500);

/// The host and port of a `turn:` URL (`turn:host`, `turn:host:port`,
/// `turn:[v6]:port`, an optional `?transport=udp`). `Err` with why for
/// what native links cannot use (`turns:`, TCP transport).
pub(crate) fn turn_host(url: &str) -> Result<(String, u16), String> {
    if url.starts_with("turns:") {
        return Err("TURN over TLS (turns:) is not supported by native links".into());
    }
    let Some(rest) = url.strip_prefix("turn:") else {
        return Err("not a turn: URL".into());
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    for param in query.split('&').filter(|p| !p.is_empty()) {
        match param.split_once('=') {
            Some(("transport", "udp")) => {}
            Some(("transport", other)) => {
                return Err(format!(
                    "transport={other}: native links allocate UDP relays only"
                ));
            }
            _ => {}
        }
    }
    let bad = || format!("cannot read host and port in {url}");
    if let Some(v6) = rest.strip_prefix('[') {
        let (host, tail) = v6.split_once(']').ok_or_else(bad)?;
        let port = match tail.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| bad())?,
            None => 3478,
        };
        return Ok((host.to_owned(), port));
    }
    match rest.rsplit_once(':') {
        Some((host, port)) => Ok((host.to_owned(), port.parse().map_err(|_| bad())?)),
        None if !rest.is_empty() => Ok((rest.to_owned(), 3478)),
        None => Err(bad()),
    }
}

/// One allocation on a TURN server, alive until dropped.
pub(crate) struct Relay {
    /// The TURN server's URL, for messages.
    pub server: String,
    /// The allocation's address on the server: the `relay` candidate.
    pub relayed: SocketAddr,
    /// Our socket that talks to the server (the candidate's related address).
    pub base: SocketAddr,
    outgoing: mpsc::Sender<(Vec<u8>, SocketAddr)>,
    pub incoming: mpsc::Receiver<(Vec<u8>, SocketAddr)>,
    client: Client,
    conn: Arc<dyn Conn + Send + Sync>,
    tasks: [JoinHandle<()>; 2],
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("server", &self.server)
            .field("relayed", &self.relayed)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Allocates a UDP relay on `server`. Fails with a [`LinkError::Turn`]
    /// that says why (refused credentials, no answer within `timeout`, …).
    pub async fn allocate(
        server: &TurnServer,
        udp_buffer_bytes: usize,
        timeout: Duration,
    ) -> Result<Self, LinkError> {
        let fail = |reason: String| LinkError::Turn {
            server: server.url.clone(),
            reason,
        };
        let any = if server.addr.is_ipv4() {
            IpAddr::V4(Ipv4Addr::UNSPECIFIED)
        } else {
            IpAddr::V6(Ipv6Addr::UNSPECIFIED)
        };
        let socket: Arc<UdpSocket> = Arc::new(super::mesh::bind_one(
            SocketAddr::new(any, 0),
            udp_buffer_bytes,
        )?);
        let base = socket.local_addr()?;
        let client = Client::new(ClientConfig {
            stun_serv_addr: String::new(),
            turn_serv_addr: server.addr.to_string(),
            username: server.username.clone(),
            password: server.credential.clone(),
            realm: String::new(),
            software: String::new(),
            rto_in_ms: 0,
            conn: socket,
            vnet: None,
        })
        .await
        .map_err(|e| fail(e.to_string()))?;
        // From here the client has a reading task: close it on every way
        // out, this future being dropped (the link ended) included.
        let mut guard = CloseOnDrop(Some(client.clone()));
        client.listen().await.map_err(|e| fail(e.to_string()))?;
        let allocated = match tokio::time::timeout(timeout, client.allocate()).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(e)) => return Err(fail(refusal(&e.to_string()))),
            Err(_) => return Err(fail(format!("no allocation within {timeout:?}"))),
        };
        let conn: Arc<dyn Conn + Send + Sync> = Arc::new(allocated);
        let relayed = conn.local_addr().map_err(|e| fail(e.to_string()))?;
        // The relay closes it from now on (and releases the allocation).
        guard.0 = None;
        let (outgoing, mut out_rx) = mpsc::channel::<(Vec<u8>, SocketAddr)>(RELAY_QUEUE);
        let (in_tx, incoming) = mpsc::channel(RELAY_QUEUE);
        let send_conn = Arc::clone(&conn);
        let url = server.url.clone();
        let sender = tokio::spawn(async move {
            while let Some((data, to)) = out_rx.recv().await {
                // The first datagram to a peer waits for its permission.
                if let Err(e) = send_conn.send_to(&data, to).await {
                    debug!(server = %url, %to, error = %e, "relay send failed");
                }
            }
        });
        let recv_conn = Arc::clone(&conn);
        let url = server.url.clone();
        let receiver = tokio::spawn(async move {
            let mut buf = vec![0u8; RELAY_RECV_BYTES];
            loop {
                match recv_conn.recv_from(&mut buf).await {
                    Ok((n, from)) => {
                        let Some(data) = buf.get(..n) else { continue };
                        if in_tx.send((data.to_vec(), from)).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        debug!(server = %url, error = %e, "relay closed");
                        return;
                    }
                }
            }
        });
        debug!(server = %server.url, %relayed, "TURN allocation");
        Ok(Self {
            server: server.url.clone(),
            relayed,
            base,
            outgoing,
            incoming,
            client,
            conn,
            tasks: [sender, receiver],
        })
    }

    /// Queues a datagram to `to` through the allocation; `false` if the
    /// queue is full (the datagram is dropped) or the relay is gone.
    pub fn send(&self, data: &[u8], to: SocketAddr) -> bool {
        self.outgoing.try_send((data.to_vec(), to)).is_ok()
    }
}

/// One link's TURN allocations under way, and what became of them: a
/// relay-only link fails as soon as none is left to try and none succeeded.
#[derive(Debug)]
pub(crate) struct Allocations {
    tasks: JoinSet<Result<Relay, LinkError>>,
    /// Why the last allocation failed, for a relay-only link that has none.
    last_error: Option<LinkError>,
    relay_only: bool,
}

impl Allocations {
    /// Starts an allocation on each of `servers`, each given `timeout`.
    pub fn start(
        servers: Vec<TurnServer>,
        udp_buffer_bytes: usize,
        timeout: Duration,
        relay_only: bool,
    ) -> Self {
        let mut tasks = JoinSet::new();
        for server in servers {
            tasks.spawn(async move { Relay::allocate(&server, udp_buffer_bytes, timeout).await });
        }
        Self {
            tasks,
            last_error: None,
            relay_only,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// The next allocation to finish (`None` once none is under way).
    pub async fn join_next(&mut self) -> Option<Result<Result<Relay, LinkError>, JoinError>> {
        self.tasks.join_next().await
    }

    /// An allocation finished: its relay, or (its failure noted) none.
    /// `Err` when a relay-only link has no relay left (`relays`: how many
    /// it has).
    pub fn finished(
        &mut self,
        result: Result<Result<Relay, LinkError>, JoinError>,
        relays: usize,
    ) -> Result<Option<Relay>, LinkError> {
        match result {
            Ok(Ok(relay)) => return Ok(Some(relay)),
            Ok(Err(e)) => {
                warn!(error = %e, "no TURN relay");
                self.last_error = Some(e);
            }
            Err(e) => {
                warn!(error = %e, "TURN allocation task failed");
                self.last_error = Some(LinkError::Rtc(format!("TURN allocation: {e}")));
            }
        }
        self.check(relays).map(|()| None)
    }

    /// A relay that was allocated but cannot be used.
    pub fn unusable(&mut self, error: LinkError) {
        self.last_error = Some(error);
    }

    /// `Err` when a relay-only link has no relay (`relays`) and none to wait for.
    pub fn check(&mut self, relays: usize) -> Result<(), LinkError> {
        if self.relay_only && relays == 0 && self.tasks.is_empty() {
            return Err(self.last_error.take().unwrap_or(LinkError::Turn {
                server: "(none)".into(),
                reason: "no relay allocated".into(),
            }));
        }
        Ok(())
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        // Release the allocation (a Refresh with lifetime 0) and stop the
        // client's refresh timers, which would otherwise run forever.
        let (conn, client) = (Arc::clone(&self.conn), self.client.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = tokio::time::timeout(CLOSE_WAIT, conn.close()).await;
                let _ = client.close().await;
            });
        }
    }
}

/// Closes a TURN client that never became a [`Relay`] (its reading task
/// would otherwise run for as long as the process).
struct CloseOnDrop(Option<Client>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let (Some(client), Ok(rt)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            rt.spawn(async move {
                let _ = client.close().await;
            });
        }
    }
}

/// A TURN client error, with a hint where the server refused our
/// credentials (the `turn` client reports the error response's code).
fn refusal(error: &str) -> String {
    let credentials = ["error 400", "error 401", "error 441"]
        .iter()
        .any(|code| error.contains(code));
    if credentials {
        format!("allocation refused ({error}): check the TURN username and credential")
    } else {
        format!("allocation failed: {error}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            turn_host("turn:example.org"),
            Ok(("example.org".into(), 3478))
        );
        assert_eq!(
            turn_host("turn:1.2.3.4:3479?transport=udp"),
            Ok(("1.2.3.4".into(), 3479))
        );
        assert_eq!(turn_host("turn:[::1]:5"), Ok(("::1".into(), 5)));
        assert!(turn_host("turn:x:1?transport=tcp").is_err());
        assert!(turn_host("turns:x:5349").is_err());
        assert!(turn_host("stun:x").is_err());
        assert!(turn_host("turn:x:notaport").is_err());
        assert!(turn_host("turn:").is_err());
    }

    #[test]
    fn refusals_name_the_credentials() {
        assert!(
            refusal("Allocate error response (error 401: Unauthorized)").contains("credential")
        );
        assert!(!refusal("transaction closed").contains("credential"));
    }
}

//! A TURN server that delays and drops the datagrams it relays, as netem
//! would on a link: the chaos test's links are all relay-only through it,
//! so every datagram between two peers passes one [`Impaired`] socket.
//!
//! Why in userspace: the kernels this runs on (this machine's, CI's
//! containers) may lack the netem qdisc and every tc classifier and action,
//! so delay and loss cannot be put on a veth; the relay sits where a lossy
//! router would, on the path of every datagram.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use turn::relay::RelayAddressGenerator;
use turn::relay::relay_static::RelayAddressGeneratorStatic;
use turn::server::config::{ConnConfig, ServerConfig};
use webrtc_util::Conn;

use crate::turn_server::{PASSWORD, USER};

/// What the relay does to each datagram it sends on, and what it did.
#[derive(Debug)]
pub struct Impairment {
    /// Every datagram waits this long before it is sent (order kept).
    pub delay: Duration,
    /// Share of datagrams dropped (0.02 for 2%).
    pub loss: f64,
    /// Datagrams sent on after the delay.
    pub sent: AtomicU64,
    /// Datagrams dropped.
    pub dropped: AtomicU64,
    rng: Mutex<u64>,
}

impl Impairment {
    pub fn new(delay: Duration, loss: f64, seed: u64) -> Arc<Impairment> {
        Arc::new(Impairment {
            delay,
            loss,
            sent: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            rng: Mutex::new(seed | 1),
        })
    }

    /// xorshift64: loss needs no better randomness than this.
    fn drops(&self) -> bool {
        let mut s = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        ((*s >> 11) as f64 / (1u64 << 53) as f64) < self.loss
    }
}

/// A relay socket whose `send_to` drops or delays, in order, through one
/// queue drained by its own task.
struct Impaired {
    inner: Arc<dyn Conn + Send + Sync>,
    queue: tokio::sync::mpsc::UnboundedSender<(tokio::time::Instant, Vec<u8>, SocketAddr)>,
    imp: Arc<Impairment>,
}

impl Impaired {
    fn wrap(inner: Arc<dyn Conn + Send + Sync>, imp: Arc<Impairment>) -> Impaired {
        let (tx, mut rx) =
            tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>, SocketAddr)>();
        let out = inner.clone();
        let counts = imp.clone();
        tokio::spawn(async move {
            while let Some((at, buf, target)) = rx.recv().await {
                tokio::time::sleep_until(at).await;
                if out.send_to(&buf, target).await.is_ok() {
                    counts.sent.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Impaired {
            inner,
            queue: tx,
            imp,
        }
    }
}

#[async_trait]
impl Conn for Impaired {
    async fn connect(&self, addr: SocketAddr) -> webrtc_util::Result<()> {
        self.inner.connect(addr).await
    }
    async fn recv(&self, buf: &mut [u8]) -> webrtc_util::Result<usize> {
        self.inner.recv(buf).await
    }
    async fn recv_from(&self, buf: &mut [u8]) -> webrtc_util::Result<(usize, SocketAddr)> {
        self.inner.recv_from(buf).await
    }
    async fn send(&self, buf: &[u8]) -> webrtc_util::Result<usize> {
        self.inner.send(buf).await
    }
    async fn send_to(&self, buf: &[u8], target: SocketAddr) -> webrtc_util::Result<usize> {
        if self.imp.drops() {
            self.imp.dropped.fetch_add(1, Ordering::Relaxed);
        } else {
            let at = tokio::time::Instant::now() + self.imp.delay;
            // The drain task ends only with this socket, so the queue is open.
            let _ = self.queue.send((at, buf.to_vec(), target));
        }
        Ok(buf.len())
    }
    fn local_addr(&self) -> webrtc_util::Result<SocketAddr> {
        self.inner.local_addr()
    }
    fn remote_addr(&self) -> Option<SocketAddr> {
        self.inner.remote_addr()
    }
    async fn close(&self) -> webrtc_util::Result<()> {
        self.inner.close().await
    }
    fn as_any(&self) -> &(dyn std::any::Any + Send + Sync) {
        self.inner.as_any()
    }
}

/// Relay sockets as the static generator makes them, impaired.
struct ImpairedRelays {
    inner: RelayAddressGeneratorStatic,
    imp: Arc<Impairment>,
}

#[async_trait]
impl RelayAddressGenerator for ImpairedRelays {
    fn validate(&self) -> Result<(), turn::Error> {
        self.inner.validate()
    }
    async fn allocate_conn(
        &self,
        use_ipv4: bool,
        requested_port: u16,
    ) -> Result<(Arc<dyn Conn + Send + Sync>, SocketAddr), turn::Error> {
        let (conn, addr) = self.inner.allocate_conn(use_ipv4, requested_port).await?;
        Ok((Arc::new(Impaired::wrap(conn, self.imp.clone())), addr))
    }
}

/// A TURN server (user [`USER`], password [`PASSWORD`]) on `ip`, relaying
/// on `ip` through impaired sockets. Between two relay-only peers each
/// datagram leaves through the sender's relay socket once, so it is
/// delayed once and dropped with probability `loss` once: one-way delay
/// `imp.delay`, as `netem delay` on the path.
pub async fn start(ip: IpAddr, imp: Arc<Impairment>) -> (turn::server::Server, SocketAddr) {
    let conn = Arc::new(
        tokio::net::UdpSocket::bind(SocketAddr::new(ip, 0))
            .await
            .expect("bind the TURN server's socket"),
    );
    let addr = conn.local_addr().expect("the TURN server's address");
    let server = turn::server::Server::new(ServerConfig {
        conn_configs: vec![ConnConfig {
            conn,
            relay_addr_generator: Box::new(ImpairedRelays {
                inner: RelayAddressGeneratorStatic {
                    relay_address: ip,
                    address: ip.to_string(),
                    net: Arc::new(webrtc_util::vnet::net::Net::new(None)),
                },
                imp,
            }),
        }],
        realm: "cairn.test".into(),
        auth_handler: Arc::new(crate::turn_server::Auth),
        channel_bind_timeout: Duration::ZERO,
        alloc_close_notify: None,
    })
    .await
    .expect("start the TURN server");
    (server, addr)
}

/// `--turn` and its credentials, for `cairn serve` and `cairn worker`.
pub fn turn_args(addr: SocketAddr) -> Vec<String> {
    vec![
        "--turn".into(),
        format!("turn:{addr}?transport=udp"),
        "--turn-username".into(),
        USER.into(),
        "--turn-credential".into(),
        PASSWORD.into(),
        "--relay-only".into(),
    ]
}

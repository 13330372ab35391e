use std::net::IpAddr;
use std::time::Duration;

use cairn_engine::protocol::{FlowControl, Hello, Limits};
use cairn_engine::session::SessionConfig;

/// How long a graceful close may take to flush.
const CLOSE_FLUSH: Duration = Duration::from_secs(1);

/// A STUN or TURN server, as in the browser's `RTCIceServer`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct IceServer {
    /// `stun:host[:port]` or `turn:host[:port][?transport=udp]`.
    pub urls: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential: Option<String>,
}

/// Which local candidates a link may use, as the browser's
/// `RTCIceTransportPolicy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IceTransportPolicy {
    /// Host, server-reflexive (STUN) and relay (TURN) candidates.
    #[default]
    All,
    /// Only relay candidates: every datagram goes through a TURN server
    /// (hides our addresses from the peer; tests of the relay path).
    Relay,
}

/// Everything a [`Mesh`](super::Mesh) and its links are configured with.
#[derive(Clone, Debug)]
pub struct LinkConfig {
    /// Local addresses to gather host candidates on, one UDP socket each.
    /// Empty: every non-loopback address of the host that is up (loopback
    /// when there is none).
    pub bind: Vec<IpAddr>,
    /// STUN servers give server-reflexive candidates for peers behind NAT;
    /// on each TURN server (`turn:`, UDP, with `username` and `credential`)
    /// every link allocates a relay candidate (src/link/turn.rs).
    pub ice_servers: Vec<IceServer>,
    /// `Relay`: gather only TURN relay candidates (needs a TURN server).
    pub ice_transport_policy: IceTransportPolicy,
    /// Largest data channel message this peer accepts, advertised in the
    /// SDP (`a=max-message-size`); the peer's value caps what we send.
    pub max_message_size: u32,
    /// Frames we send: at most this, and never more than the peer accepts.
    /// Small frames keep str0m's SCTP fast (see `flow`).
    pub frame_bytes: usize,
    /// Largest protocol message reassembled (a tensor, say).
    pub max_reassembly_bytes: u64,
    /// Buffered-amount thresholds of the data channel. str0m's SCTP
    /// (sctp-proto) spends time per packet that grows with the data in
    /// flight, so a small window is faster on loopback and LANs: 64 KiB
    /// measured best (docs/protocol.md, "Peer links").
    pub flow: FlowControl,
    /// Bytes of messages queued towards one link before `send` waits.
    pub send_queue_bytes: usize,
    /// Received messages queued towards the application before the link
    /// stops reading the network (and the peer, in turn, is slowed down).
    pub receive_queue: usize,
    /// How often each side pings (RTT, jitter, loss, liveness).
    pub ping_interval: Duration,
    /// A link that receives nothing for this long is dead.
    pub heartbeat_timeout: Duration,
    /// How often a throughput probe is sent; `None` for never (the
    /// coordinator can ask with `Link::probe`).
    pub probe_interval: Option<Duration>,
    /// Size of the periodic throughput probe.
    pub probe_bytes: usize,
    /// From offer to both `Hello`s exchanged.
    pub connect_timeout: Duration,
    /// Whether the offering side re-offers after a link dies while the peer
    /// is still in the room.
    pub reconnect: bool,
    /// First and largest wait between re-offers.
    pub reconnect_backoff: (Duration, Duration),
    /// Largest UDP datagram str0m aims for (576..=1500; browsers use about 1200).
    pub mtu: usize,
    /// Socket send and receive buffers asked of the kernel.
    pub udp_buffer_bytes: usize,
    /// Capabilities and device info sent in `Hello`, a JSON object.
    pub capabilities: String,
    /// Announce `ice_servers` and `ice_transport_policy` in our room meta
    /// ([`ICE_META_KEY`](super::ICE_META_KEY)) for the browsers that answer
    /// our offers. The coordinator does; workers keep theirs to themselves.
    pub share_ice_servers: bool,
}

impl Default for LinkConfig {
    fn default() -> Self {
        Self {
            bind: Vec::new(),
            ice_servers: Vec::new(),
            ice_transport_policy: IceTransportPolicy::All,
            max_message_size: 256 * 1024,
            frame_bytes: 32 * 1024,
            max_reassembly_bytes: 256 * 1024 * 1024,
            flow: FlowControl {
                high_water: 64 * 1024,
                low_water: 32 * 1024,
            },
            send_queue_bytes: 16 * 1024 * 1024,
            receive_queue: 256,
            ping_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(5),
            probe_interval: Some(Duration::from_secs(30)),
            probe_bytes: 1024 * 1024,
            connect_timeout: Duration::from_secs(15),
            reconnect: true,
            reconnect_backoff: (Duration::from_millis(250), Duration::from_secs(5)),
            mtu: str0m::DATAGRAM_MTU_TARGET,
            udp_buffer_bytes: 4 * 1024 * 1024,
            capabilities: "{}".into(),
            share_ice_servers: false,
        }
    }
}

impl LinkConfig {
    /// Loopback only (tests, `cairn bench link`).
    pub fn loopback() -> Self {
        Self {
            bind: vec![IpAddr::from([127, 0, 0, 1])],
            ..Self::default()
        }
    }

    /// What each link's session runs with; `local_peer` goes in our `Hello`.
    pub(crate) fn session_config(&self, local_peer: &str) -> SessionConfig {
        SessionConfig {
            hello: Hello::new(
                local_peer,
                self.max_reassembly_bytes,
                self.capabilities.clone(),
            ),
            frame_bytes: self.frame_bytes,
            limits: Limits {
                max_frame_bytes: self.max_message_size as usize,
                max_message_bytes: self.max_reassembly_bytes,
            },
            flow: self.flow,
            ping_interval: Some(self.ping_interval),
            heartbeat_timeout: Some(self.heartbeat_timeout),
            probe_interval: self.probe_interval,
            probe_bytes: self.probe_bytes,
            connect_timeout: Some(self.connect_timeout),
            close_flush: CLOSE_FLUSH,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), super::LinkError> {
        let bad = |s: &str| Err(super::LinkError::Config(s.into()));
        if self.max_message_size < 1024 {
            return bad("max_message_size under 1 KiB");
        }
        if self.flow.low_water > self.flow.high_water || self.flow.high_water == 0 {
            return bad("flow control needs 0 <= low_water <= high_water, high_water > 0");
        }
        if self.frame_bytes < 1024 || self.frame_bytes > self.flow.high_water {
            return bad("frame_bytes must be at least 1 KiB and at most flow.high_water");
        }
        if self.heartbeat_timeout <= self.ping_interval {
            return bad("heartbeat_timeout must be longer than ping_interval");
        }
        if !(str0m::DATAGRAM_MTU_TARGET_MIN..=str0m::DATAGRAM_MTU_TARGET_MAX).contains(&self.mtu) {
            return bad("mtu outside 576..=1500");
        }
        if self.send_queue_bytes == 0 || self.receive_queue == 0 {
            return bad("queues must hold something");
        }
        let has_turn = self.ice_servers.iter().any(|s| {
            s.urls
                .iter()
                .any(|u| u.starts_with("turn:") || u.starts_with("turns:"))
        });
        if self.ice_transport_policy == IceTransportPolicy::Relay && !has_turn {
            return bad("ice_transport_policy relay needs a turn: server in ice_servers");
        }
        Ok(())
    }
}

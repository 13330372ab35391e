//! What the coordinator reads about a link: the session's measurements
//! (`cairn_engine::session::SessionStats`: RTT, jitter, loss, throughput,
//! counters) and what only the native driver knows (TURN relaying).

use std::time::{Duration, Instant};

use cairn_engine::session::SessionStats;

/// What the coordinator reads about a link; refreshed every ping interval.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkStats {
    /// Latest round trip (ping to pong, through the whole stack).
    pub rtt: Option<Duration>,
    /// Smoothed RTT (RFC 6298 style, 1/8 gain).
    pub rtt_smoothed: Option<Duration>,
    pub rtt_min: Option<Duration>,
    /// Mean deviation between consecutive RTT samples (RFC 3550 style, 1/16 gain).
    pub jitter: Duration,
    /// Fraction of the last pings (up to 32) not answered within the
    /// heartbeat timeout. The data channel is reliable, so this counts
    /// pongs that came too late (or not at all), not lost packets.
    pub loss: f64,
    /// From the latest throughput probe: bytes / (send start to ack).
    pub throughput_bytes_per_s: Option<f64>,
    /// Rates over the last refresh interval.
    pub tx_bytes_per_s: f64,
    pub rx_bytes_per_s: f64,
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    pub tx_messages: u64,
    pub rx_messages: u64,
    /// Time since the last frame from the peer.
    pub since_last_heard: Duration,
    /// Our frame size (the peer's negotiated maximum message size).
    pub max_frame_bytes: usize,
    /// Bytes the data channel holds unacknowledged.
    pub buffered_amount: usize,
    /// Whether the link's DTLS records (its data) last went out through a
    /// TURN relay rather than straight to the peer: the pair ICE selected.
    pub relayed: bool,
    /// UDP payload bytes sent through TURN relays (ICE checks included).
    pub tx_relayed_bytes: u64,
    pub updated: Instant,
}

impl LinkStats {
    /// Before the first measurement.
    pub(crate) fn initial(now: Instant) -> Self {
        Self {
            rtt: None,
            rtt_smoothed: None,
            rtt_min: None,
            jitter: Duration::ZERO,
            loss: 0.0,
            throughput_bytes_per_s: None,
            tx_bytes_per_s: 0.0,
            rx_bytes_per_s: 0.0,
            tx_bytes: 0,
            rx_bytes: 0,
            tx_messages: 0,
            rx_messages: 0,
            since_last_heard: Duration::ZERO,
            max_frame_bytes: 0,
            buffered_amount: 0,
            relayed: false,
            tx_relayed_bytes: 0,
            updated: now,
        }
    }

    pub(crate) fn new(s: SessionStats, relay: &RelayStats, updated: Instant) -> Self {
        Self {
            rtt: s.rtt,
            rtt_smoothed: s.rtt_smoothed,
            rtt_min: s.rtt_min,
            jitter: s.jitter,
            loss: s.loss,
            throughput_bytes_per_s: s.throughput_bytes_per_s,
            tx_bytes_per_s: s.tx_bytes_per_s,
            rx_bytes_per_s: s.rx_bytes_per_s,
            tx_bytes: s.tx_bytes,
            rx_bytes: s.rx_bytes,
            tx_messages: s.tx_messages,
            rx_messages: s.rx_messages,
            since_last_heard: s.since_last_heard,
            max_frame_bytes: s.max_frame_bytes,
            buffered_amount: s.buffered_amount,
            relayed: relay.relayed,
            tx_relayed_bytes: relay.tx_relayed_bytes,
            updated,
        }
    }
}

/// How the driver's datagrams went out: through TURN relays or straight.
#[derive(Debug, Default)]
pub(crate) struct RelayStats {
    relayed: bool,
    tx_relayed_bytes: u64,
}

impl RelayStats {
    /// A datagram went out through a TURN relay; `data`: a DTLS record.
    pub fn relayed(&mut self, bytes: usize, data: bool) {
        self.tx_relayed_bytes += bytes as u64;
        if data {
            self.relayed = true;
        }
    }

    /// A DTLS record went straight to the peer.
    pub fn direct(&mut self) {
        self.relayed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_dtls_record_decides_whether_the_link_is_relayed() {
        let mut r = RelayStats::default();
        r.relayed(100, false);
        assert!(!r.relayed, "ICE checks through a relay are not data");
        r.relayed(50, true);
        assert!(r.relayed);
        r.direct();
        assert!(!r.relayed);
        assert_eq!(r.tx_relayed_bytes, 150);
        let s = LinkStats::initial(Instant::now());
        assert_eq!(s.max_frame_bytes, 0);
    }
}

//! What the coordinator reads about a link: the session's measurements
//! (`cairn_engine::session::SessionStats`: RTT, jitter, loss, throughput,
//! counters) and what only the native driver knows (TURN relaying).

use std::time::Instant;

use cairn_engine::session::SessionStats;

/// What the coordinator reads about a link; refreshed every ping interval.
/// The session's measurements are reached through `Deref` (`stats.rtt`).
#[derive(Clone, Debug, PartialEq)]
pub struct LinkStats {
    /// RTT, jitter, loss, throughput and counters, from the link's session.
    pub session: SessionStats,
    /// Whether the link's DTLS records (its data) last went out through a
    /// TURN relay rather than straight to the peer: the pair ICE selected.
    pub relayed: bool,
    /// UDP payload bytes sent through TURN relays (ICE checks included).
    pub tx_relayed_bytes: u64,
    pub updated: Instant,
}

impl std::ops::Deref for LinkStats {
    type Target = SessionStats;

    fn deref(&self) -> &SessionStats {
        &self.session
    }
}

impl LinkStats {
    /// Before the first measurement.
    pub(crate) fn initial(now: Instant) -> Self {
        Self::new(SessionStats::default(), &RelayStats::default(), now)
    }

    pub(crate) fn new(session: SessionStats, relay: &RelayStats, updated: Instant) -> Self {
        Self {
            session,
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

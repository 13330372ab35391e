//! Link measurement from a session's own traffic: RTT from ping/pong,
//! jitter, loss, probe throughput, byte and message counters and rates.
//! Times are `Duration`s since the session's origin (no clock is read here).

use std::collections::VecDeque;
use std::time::Duration;

/// What a session measures about its link; a snapshot taken with
/// [`Session::stats`](super::Session::stats). `Default` is before the first measurement.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionStats {
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
    /// Bytes the transport holds unacknowledged.
    pub buffered_amount: usize,
}

/// Pings remembered for the loss window.
const LOSS_WINDOW: usize = 32;

#[derive(Debug)]
pub(crate) struct Estimator {
    stats: SessionStats,
    srtt: Option<f64>,
    last_rtt: Option<f64>,
    jitter: f64,
    /// (nonce, sent, answered) of recent pings.
    pings: VecDeque<(u64, Duration, bool)>,
    last_refresh: Duration,
    tx_at_refresh: u64,
    rx_at_refresh: u64,
    pub last_heard: Duration,
}

impl Estimator {
    pub fn new(now: Duration) -> Self {
        Self {
            stats: SessionStats::default(),
            srtt: None,
            last_rtt: None,
            jitter: 0.0,
            pings: VecDeque::new(),
            last_refresh: now,
            tx_at_refresh: 0,
            rx_at_refresh: 0,
            last_heard: now,
        }
    }

    pub fn sent(&mut self, bytes: usize, message_done: bool) {
        self.stats.tx_bytes += bytes as u64;
        if message_done {
            self.stats.tx_messages += 1;
        }
    }

    pub fn received(&mut self, bytes: usize, now: Duration) {
        self.stats.rx_bytes += bytes as u64;
        self.last_heard = now;
    }

    pub fn received_message(&mut self) {
        self.stats.rx_messages += 1;
    }

    pub fn ping_sent(&mut self, nonce: u64, now: Duration) {
        self.pings.push_back((nonce, now, false));
        while self.pings.len() > LOSS_WINDOW {
            self.pings.pop_front();
        }
    }

    pub fn pong(&mut self, nonce: u64, rtt: Duration, now: Duration, timeout: Duration) {
        if let Some(p) = self.pings.iter_mut().find(|p| p.0 == nonce) {
            // A pong after the timeout still counts as lost.
            p.2 = now.saturating_sub(p.1) <= timeout;
        }
        let r = rtt.as_secs_f64();
        self.srtt = Some(match self.srtt {
            Some(s) => s + (r - s) / 8.0,
            None => r,
        });
        if let Some(last) = self.last_rtt {
            self.jitter += ((r - last).abs() - self.jitter) / 16.0;
        }
        self.last_rtt = Some(r);
        self.stats.rtt = Some(rtt);
        self.stats.rtt_min = Some(self.stats.rtt_min.map_or(rtt, |m| m.min(rtt)));
    }

    pub fn probe_done(&mut self, bytes: u64, elapsed: Duration) {
        if elapsed > Duration::ZERO {
            self.stats.throughput_bytes_per_s = Some(bytes as f64 / elapsed.as_secs_f64());
        }
    }

    /// Recomputes the derived figures and returns a snapshot.
    pub fn refresh(
        &mut self,
        now: Duration,
        timeout: Duration,
        max_frame_bytes: usize,
        buffered_amount: usize,
    ) -> SessionStats {
        let decided: Vec<bool> = self
            .pings
            .iter()
            .filter(|p| p.2 || now.saturating_sub(p.1) > timeout)
            .map(|p| p.2)
            .collect();
        self.stats.loss = if decided.is_empty() {
            0.0
        } else {
            decided.iter().filter(|&&ok| !ok).count() as f64 / decided.len() as f64
        };
        let dt = now.saturating_sub(self.last_refresh).as_secs_f64();
        if dt > 0.0 {
            self.stats.tx_bytes_per_s = (self.stats.tx_bytes - self.tx_at_refresh) as f64 / dt;
            self.stats.rx_bytes_per_s = (self.stats.rx_bytes - self.rx_at_refresh) as f64 / dt;
        }
        self.last_refresh = now;
        self.tx_at_refresh = self.stats.tx_bytes;
        self.rx_at_refresh = self.stats.rx_bytes;
        self.stats.rtt_smoothed = self.srtt.map(Duration::from_secs_f64);
        self.stats.jitter = Duration::from_secs_f64(self.jitter);
        self.stats.since_last_heard = now.saturating_sub(self.last_heard);
        self.stats.max_frame_bytes = max_frame_bytes;
        self.stats.buffered_amount = buffered_amount;
        self.stats.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtt_jitter_and_loss() {
        let t0 = Duration::from_secs(7);
        let mut e = Estimator::new(t0);
        let timeout = Duration::from_secs(1);
        for i in 0..4u64 {
            e.ping_sent(i, t0);
        }
        e.pong(0, Duration::from_millis(10), t0, timeout);
        e.pong(1, Duration::from_millis(14), t0, timeout);
        e.pong(2, Duration::from_millis(10), t0, timeout);
        let s = e.refresh(t0 + Duration::from_secs(2), timeout, 1000, 0);
        assert_eq!(s.rtt, Some(Duration::from_millis(10)));
        assert_eq!(s.rtt_min, Some(Duration::from_millis(10)));
        assert!(s.jitter > Duration::ZERO);
        assert!((s.loss - 0.25).abs() < 1e-9, "{}", s.loss);
    }
}

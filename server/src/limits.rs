//! Per-server limits and the message rate limiters: per connection, and per token across
//! its sessions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Every bound the server enforces. The defaults suit a LAN cluster of a few
/// hundred peers; each one is a CLI flag of `cairn-signal serve`.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest WebSocket message accepted from a client, in bytes.
    pub max_frame_bytes: usize,
    /// Largest `meta` object a peer may advertise, in bytes of JSON.
    pub max_meta_bytes: usize,
    /// Peers in one room, counting connections still being upgraded.
    pub max_peers_per_room: usize,
    /// WebSocket sessions across all rooms.
    pub max_connections: usize,
    /// Plain HTTP connections (health checks, static files, upgrades in
    /// progress) served at once, on top of the WebSocket sessions.
    pub max_http_connections: usize,
    /// Plain HTTP connections one address may hold at once, so one client
    /// cannot take every slot of `max_http_connections`.
    pub max_http_connections_per_addr: usize,
    /// WebSocket sessions one address may hold at once.
    pub max_sessions_per_addr: usize,
    /// WebSocket sessions one token may hold at once, so a leaked token
    /// cannot fill a room.
    pub max_sessions_per_token: usize,
    /// Sustained messages per second one connection may send. A `meta`
    /// update costs one message per peer it is sent to.
    pub messages_per_sec: u32,
    /// Messages a connection may send in a burst above the sustained rate.
    /// A client refused this many times in a row is disconnected.
    pub message_burst: u32,
    /// How often the server pings each client.
    pub ping_interval: Duration,
    /// A client that sends nothing (not even a pong) for this long is dropped.
    pub idle_timeout: Duration,
    /// A write to a client that does not complete in this time drops it.
    pub write_timeout: Duration,
    /// Messages queued towards one client before it counts as too slow and
    /// is dropped. Messages from other peers may fill only part of it (see
    /// [`Limits::peer_share`]); the rest is kept for the server's own
    /// events, so a flood from peers can neither drop the reader nor crowd
    /// out joins and leaves.
    pub send_queue: usize,
    /// Bytes queued towards one client before it counts as too slow: with
    /// `send_queue`, what bounds the server's memory per connection.
    pub send_queue_bytes: usize,
    /// Time allowed for the TLS handshake and the HTTP request head.
    pub handshake_timeout: Duration,
    /// Initial capacity of each connection's read buffer, in bytes.
    pub read_buffer_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_bytes: 64 * 1024,
            max_meta_bytes: 4 * 1024,
            max_peers_per_room: 256,
            max_connections: 10_000,
            max_http_connections: 1_024,
            max_http_connections_per_addr: 64,
            max_sessions_per_addr: 64,
            max_sessions_per_token: 64,
            messages_per_sec: 200,
            message_burst: 400,
            ping_interval: Duration::from_secs(15),
            idle_timeout: Duration::from_secs(45),
            write_timeout: Duration::from_secs(10),
            send_queue: 256,
            send_queue_bytes: 1024 * 1024,
            handshake_timeout: Duration::from_secs(10),
            read_buffer_bytes: 4 * 1024,
        }
    }
}

impl Limits {
    /// Messages one peer may have waiting in another's queue; more are
    /// dropped and the sender is told.
    pub(crate) fn peer_share(&self) -> usize {
        (self.send_queue / 8).max(1)
    }

    /// Messages from all peers together that one queue may hold.
    pub(crate) fn peers_room(&self) -> usize {
        (self.send_queue - self.send_queue / 4).max(1)
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        let positive = [
            ("max_frame_bytes", self.max_frame_bytes),
            ("max_meta_bytes", self.max_meta_bytes),
            ("max_peers_per_room", self.max_peers_per_room),
            ("max_connections", self.max_connections),
            ("max_http_connections", self.max_http_connections),
            (
                "max_http_connections_per_addr",
                self.max_http_connections_per_addr,
            ),
            ("max_sessions_per_addr", self.max_sessions_per_addr),
            ("max_sessions_per_token", self.max_sessions_per_token),
            ("messages_per_sec", self.messages_per_sec as usize),
            ("message_burst", self.message_burst as usize),
            ("send_queue", self.send_queue),
            ("read_buffer_bytes", self.read_buffer_bytes),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        let durations = [
            ("ping_interval", self.ping_interval),
            ("idle_timeout", self.idle_timeout),
            ("write_timeout", self.write_timeout),
            ("handshake_timeout", self.handshake_timeout),
        ];
        for (name, value) in durations {
            if value.is_zero() {
                return Err(format!("{name} must be longer than zero"));
            }
        }
        if self.send_queue_bytes < self.max_frame_bytes + 1024 {
            return Err("send_queue_bytes must exceed max_frame_bytes by at least 1024".into());
        }
        if self.ping_interval >= self.idle_timeout {
            return Err("ping_interval must be shorter than idle_timeout".into());
        }
        Ok(())
    }
}

/// What to do with one incoming message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Allow,
    /// Over the rate: drop it and tell the client.
    Refuse,
    /// Still sending after `burst` refusals in a row: disconnect.
    Disconnect,
}

/// Token bucket: `burst` tokens, refilled at `per_sec`.
pub(crate) struct RateLimiter {
    per_sec: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
    refusals: u32,
    max_refusals: u32,
}

impl RateLimiter {
    pub(crate) fn new(per_sec: u32, burst: u32, now: Instant) -> Self {
        let burst = burst.max(1);
        Self {
            per_sec: f64::from(per_sec.max(1)),
            burst: f64::from(burst),
            tokens: f64::from(burst),
            last: now,
            refusals: 0,
            max_refusals: burst,
        }
    }

    pub(crate) fn check(&mut self, now: Instant) -> Verdict {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.per_sec).min(self.burst);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            self.refusals = 0;
            return Verdict::Allow;
        }
        self.refuse()
    }

    /// Charges `extra` more messages for one already allowed (a `meta`
    /// update sent on to many peers): the bucket may go into debt, down to
    /// one burst, and refuses until it is paid back.
    pub(crate) fn charge(&mut self, extra: usize) {
        let extra = extra as f64;
        self.tokens = (self.tokens - extra).max(-self.burst);
    }

    fn refuse(&mut self) -> Verdict {
        self.refusals = self.refusals.saturating_add(1);
        if self.refusals > self.max_refusals {
            Verdict::Disconnect
        } else {
            Verdict::Refuse
        }
    }
}

/// How many connections' worth of messages all sessions of one token may send together
/// ([`TokenRates`]).
pub(crate) const TOKEN_RATE_SESSIONS: u32 = 4;

/// Each live token's session count and shared limiter.
type LiveTokens = Arc<Mutex<HashMap<String, (usize, Arc<Mutex<RateLimiter>>)>>>;

/// One [`RateLimiter`] per token id, shared by every live session of that token, at
/// [`TOKEN_RATE_SESSIONS`] times a connection's rate and burst: opening more sessions with
/// one token does not buy more messages. An entry lives while a session of its token does.
pub(crate) struct TokenRates {
    live: LiveTokens,
    per_sec: u32,
    burst: u32,
}

/// A session's share of its token's [`TokenRates`] limiter, given back on drop.
pub(crate) struct TokenRate {
    live: LiveTokens,
    token_id: String,
    limiter: Arc<Mutex<RateLimiter>>,
}

impl TokenRates {
    pub(crate) fn new(limits: &Limits) -> Self {
        Self {
            live: Arc::new(Mutex::new(HashMap::new())),
            per_sec: limits.messages_per_sec.saturating_mul(TOKEN_RATE_SESSIONS),
            burst: limits.message_burst.saturating_mul(TOKEN_RATE_SESSIONS),
        }
    }

    pub(crate) fn join(&self, token_id: &str) -> TokenRate {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        let (count, limiter) = live.entry(token_id.to_owned()).or_insert_with(|| {
            let limiter = RateLimiter::new(self.per_sec, self.burst, Instant::now());
            (0, Arc::new(Mutex::new(limiter)))
        });
        *count += 1;
        TokenRate {
            live: Arc::clone(&self.live),
            token_id: token_id.to_owned(),
            limiter: Arc::clone(limiter),
        }
    }

    #[cfg(test)]
    fn tokens(&self) -> usize {
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl TokenRate {
    /// Whether the token may send one more message now. Its sessions are not closed for
    /// the token's rate (their own limiters do that); over it, messages are refused.
    pub(crate) fn allows(&self, now: Instant) -> bool {
        let mut l = self.limiter.lock().unwrap_or_else(PoisonError::into_inner);
        let allowed = l.check(now) == Verdict::Allow;
        l.refusals = 0;
        allowed
    }

    /// See [`RateLimiter::charge`].
    pub(crate) fn charge(&self, extra: usize) {
        self.limiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .charge(extra);
    }
}

impl Drop for TokenRate {
    fn drop(&mut self) {
        let mut live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((count, _)) = live.get_mut(&self.token_id) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                live.remove(&self.token_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_allows_burst_then_refuses_then_disconnects() {
        let t0 = Instant::now();
        let mut limiter = RateLimiter::new(10, 3, t0);
        for _ in 0..3 {
            assert_eq!(limiter.check(t0), Verdict::Allow);
        }
        for _ in 0..3 {
            assert_eq!(limiter.check(t0), Verdict::Refuse);
        }
        assert_eq!(limiter.check(t0), Verdict::Disconnect);
    }

    #[test]
    fn bucket_refills_over_time() {
        let t0 = Instant::now();
        let mut limiter = RateLimiter::new(10, 1, t0);
        assert_eq!(limiter.check(t0), Verdict::Allow);
        assert_eq!(limiter.check(t0), Verdict::Refuse);
        let later = t0 + Duration::from_millis(150);
        assert_eq!(limiter.check(later), Verdict::Allow);
    }

    #[test]
    fn fan_out_is_charged_to_the_sender() {
        let t0 = Instant::now();
        let mut limiter = RateLimiter::new(10, 20, t0);
        assert_eq!(limiter.check(t0), Verdict::Allow);
        // One update sent on to 30 peers: 30 messages, 29 of them on top.
        limiter.charge(29);
        assert_eq!(limiter.check(t0), Verdict::Refuse);
        // In debt by 10 (20 - 30), so a second later the bucket holds none
        // of its own yet...
        assert_eq!(
            limiter.check(t0 + Duration::from_millis(1050)),
            Verdict::Refuse
        );
        // ...and two seconds later it is paid back and serving again.
        assert_eq!(
            limiter.check(t0 + Duration::from_secs(2) + Duration::from_millis(100)),
            Verdict::Allow
        );
    }

    #[test]
    fn defaults_are_valid() {
        assert!(Limits::default().validate().is_ok());
    }

    #[test]
    fn a_tokens_sessions_share_one_budget_while_any_lives() {
        let limits = Limits {
            messages_per_sec: 1,
            message_burst: 3,
            ..Limits::default()
        };
        let rates = TokenRates::new(&limits);
        let now = Instant::now();
        let a = rates.join("t");
        let b = rates.join("t");
        let other = rates.join("u");
        // 4 sessions' burst of 3, shared by a and b however they split it.
        let allowed = (0..20)
            .filter(|i| (if i % 2 == 0 { &a } else { &b }).allows(now))
            .count();
        assert_eq!(allowed, 12);
        assert!(other.allows(now), "another token has its own budget");
        b.charge(100);
        drop(a);
        assert!(!b.allows(now + Duration::from_secs(1)), "still in debt");
        drop(b);
        drop(other);
        assert_eq!(rates.tokens(), 0, "no entry outlives its sessions");
        assert!(rates.join("t").allows(now), "a fresh session starts afresh");
    }
}

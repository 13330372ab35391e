//! Worker join tokens of the embedded signaling server: issued short-lived,
//! listed, revoked. The join URL the dashboard shows carries the current one
//! and is renewed before it runs out, so a leaked link stops working within
//! a token's lifetime, and the operator can end it sooner by revoking it.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use cairn_signal::protocol::PeerId;
use cairn_signal::token::{self, MAX_TTL, unix_now};
use cairn_signal::{Claims, Revoker, Role, Secret};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::audit::{AuditLog, Event};

/// A token this coordinator issued, as `cairn token list` shows it (never
/// the token itself, only its id).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issued {
    pub id: String,
    pub role: Role,
    /// Seconds since the Unix epoch.
    pub expires_at: u64,
    pub revoked: bool,
}

/// What `JoinTokens` needs to make join URLs and check them.
pub struct JoinTokens {
    secret: Secret,
    room: String,
    ttl: Duration,
    revoker: Revoker,
    /// The join URL up to the token: `.../join?signal=...&room=...&token=`.
    url_prefix: String,
    /// Where the list is kept across restarts (`<state dir>/tokens.json`).
    file: Option<PathBuf>,
    audit: Option<Arc<AuditLog>>,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    issued: Vec<Issued>,
    /// The token in the join URL shown now, and its id.
    current: Option<(String, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("no token with id '{0}' was issued here (or it has expired)")]
    Unknown(String),
}

impl std::fmt::Debug for JoinTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinTokens")
            .field("room", &self.room)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl JoinTokens {
    pub fn new(
        secret: Secret,
        room: &str,
        ttl: Duration,
        revoker: Revoker,
        url_prefix: String,
        file: Option<PathBuf>,
    ) -> Self {
        let issued = file
            .as_deref()
            .and_then(|f| std::fs::read(f).ok())
            .and_then(|b| serde_json::from_slice::<Vec<Issued>>(&b).ok())
            .unwrap_or_default();
        Self {
            secret,
            room: room.to_owned(),
            ttl: ttl.min(MAX_TTL),
            revoker,
            url_prefix,
            file,
            audit: None,
            inner: Mutex::new(Inner {
                issued,
                current: None,
            }),
        }
    }

    /// Records issues and revocations in `audit`.
    pub fn with_audit(mut self, audit: Arc<AuditLog>) -> Self {
        self.audit = Some(audit);
        self
    }

    fn record(&self, event: Event) {
        if let Some(a) = &self.audit {
            a.record(event);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How long a join token lives unless asked otherwise.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// A new worker token for `ttl` (the default when `None`, never over
    /// the signaling server's maximum); its record and the token.
    pub fn issue(&self, ttl: Option<Duration>) -> (Issued, String) {
        let claims = Claims::new(&self.room, Role::Worker, ttl.unwrap_or(self.ttl));
        let token = token::issue(&self.secret, &claims);
        let record = Issued {
            id: claims.jti.clone(),
            role: Role::Worker,
            expires_at: claims.exp,
            revoked: false,
        };
        let mut inner = self.lock();
        inner.issued.push(record.clone());
        self.save(&inner);
        drop(inner);
        info!(token_id = %record.id, expires_at = record.expires_at, "join token issued");
        self.record(Event::TokenIssued {
            token_id: record.id.clone(),
            expires_at: record.expires_at,
        });
        (record, token)
    }

    /// The join URL for a browser or `cairn worker`, with a token that has
    /// at least half its lifetime left (a new one when not).
    pub fn current_url(&self) -> String {
        let now = unix_now();
        let half = self.ttl.as_secs() / 2;
        let fresh = {
            let inner = self.lock();
            inner.current.as_ref().and_then(|(id, token)| {
                inner
                    .issued
                    .iter()
                    .find(|i| &i.id == id)
                    .filter(|i| !i.revoked && i.expires_at > now.saturating_add(half))
                    .map(|_| token.clone())
            })
        };
        let token = match fresh {
            Some(t) => t,
            None => {
                let (record, token) = self.issue(None);
                self.lock().current = Some((record.id, token.clone()));
                token
            }
        };
        format!("{}{token}", self.url_prefix)
    }

    /// The tokens issued here that have not expired.
    pub fn list(&self) -> Vec<Issued> {
        let now = unix_now();
        let mut inner = self.lock();
        let before = inner.issued.len();
        inner.issued.retain(|i| i.expires_at > now);
        if inner.issued.len() != before {
            self.save(&inner);
        }
        inner.issued.clone()
    }

    /// Revokes a token issued here: the signaling server refuses it from
    /// now on (across restarts) and drops its live sessions, how many.
    pub fn revoke(&self, id: &str) -> Result<usize, JoinError> {
        let now = unix_now();
        {
            let mut inner = self.lock();
            let Some(record) = inner
                .issued
                .iter_mut()
                .find(|i| i.id == id && i.expires_at > now)
            else {
                return Err(JoinError::Unknown(id.to_owned()));
            };
            record.revoked = true;
            if inner.current.as_ref().is_some_and(|(c, _)| c == id) {
                inner.current = None;
            }
            self.save(&inner);
        }
        let dropped = self.revoker.revoke(id);
        self.record(Event::TokenRevoked {
            token_id: id.to_owned(),
            dropped,
        });
        Ok(dropped)
    }

    fn save(&self, inner: &Inner) {
        let Some(path) = &self.file else { return };
        let body = serde_json::to_vec_pretty(&inner.issued).unwrap_or_default();
        if let Err(e) = crate::state_dir::write_private(path, &body) {
            warn!(error = %e, path = %path.display(), "cannot keep the list of join tokens");
        }
    }
}

/// Who is in the embedded signaling server's room with which token and
/// from where (its session observer tells), and the operator's decisions
/// on tokens (`--approve-workers`): a worker that comes back with an
/// approved token is let in without asking again, for this run.
#[derive(Debug, Default)]
pub struct Sessions {
    inner: Mutex<SessionsInner>,
}

#[derive(Debug, Default)]
struct SessionsInner {
    peers: HashMap<PeerId, Session>,
    decided: HashMap<String, bool>,
    /// The token and address of each evicted worker: a peer that comes
    /// back with both is the same process (or its neighbour with its
    /// token) under a new peer id. With each, the peers that held both
    /// beside it when it was evicted: honest workers on the same host (or
    /// behind the same NAT) with the join URL's token, which keep their
    /// place when their links come up again.
    evicted: HashMap<(String, Option<IpAddr>), HashSet<PeerId>>,
}

/// A peer's way in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    pub token_id: String,
    pub addr: Option<IpAddr>,
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, SessionsInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn joined(&self, peer: PeerId, session: Session) {
        self.lock().peers.insert(peer, session);
    }

    pub fn left(&self, peer: &PeerId) {
        self.lock().peers.remove(peer);
    }

    pub fn get(&self, peer: &PeerId) -> Option<Session> {
        self.lock().peers.get(peer).cloned()
    }

    /// The operator approved (or rejected) `peer`: its token is remembered.
    pub fn decide(&self, peer: &PeerId, approved: bool) -> Option<String> {
        let mut inner = self.lock();
        let token = inner.peers.get(peer).map(|s| s.token_id.clone())?;
        inner.decided.insert(token.clone(), approved);
        Some(token)
    }

    /// `peer` was evicted: its token and address are barred for this run.
    /// Its session, and whether it is the token's only holder in the room
    /// (then the token may be revoked without dropping anyone else).
    pub fn evict(&self, peer: &PeerId) -> Option<(Session, bool)> {
        let mut inner = self.lock();
        let session = inner.peers.get(peer).cloned()?;
        let alone = !inner
            .peers
            .iter()
            .any(|(p, s)| p != peer && s.token_id == session.token_id);
        let beside: HashSet<PeerId> = inner
            .peers
            .iter()
            .filter(|(p, s)| *p != peer && **s == session)
            .map(|(p, _)| p.clone())
            .collect();
        inner
            .evicted
            .entry((session.token_id.clone(), session.addr))
            .or_default()
            .extend(beside);
        Some((session, alone))
    }

    /// Whether `peer` came with the token of an evicted worker from its
    /// address, and was not in the room beside it when it was evicted.
    pub fn barred(&self, peer: &PeerId) -> bool {
        let inner = self.lock();
        inner.peers.get(peer).is_some_and(|s| {
            inner
                .evicted
                .get(&(s.token_id.clone(), s.addr))
                .is_some_and(|beside| !beside.contains(peer))
        })
    }

    /// What the operator decided on `peer`'s token before, if anything.
    pub fn decided(&self, peer: &PeerId) -> Option<bool> {
        let inner = self.lock();
        let token = &inner.peers.get(peer)?.token_id;
        inner.decided.get(token).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn tokens(dir: &std::path::Path) -> (JoinTokens, cairn_signal::Server) {
        let secret = Secret::generate();
        let server = cairn_signal::Server::bind(cairn_signal::SignalConfig {
            listen: "127.0.0.1:0".parse().expect("addr"),
            secret: secret.clone(),
            mdns: cairn_signal::MdnsMode::Off,
            revocations_file: Some(dir.join("revoked")),
            ..Default::default()
        })
        .await
        .expect("server");
        let t = JoinTokens::new(
            secret,
            "main",
            Duration::from_secs(3600),
            server.revoker(),
            "http://x/join?token=".into(),
            Some(dir.join("tokens.json")),
        );
        (t, server)
    }

    #[tokio::test]
    async fn the_join_url_keeps_its_token_until_revoked_and_the_list_survives_a_restart() {
        let dir = tempfile::tempdir().expect("dir");
        let (t, server) = tokens(dir.path()).await;
        let first = t.current_url();
        assert_eq!(t.current_url(), first, "a fresh token is reused");
        let token = first.rsplit('=').next().expect("token");
        let claims = token::verify(server.secret(), token).expect("valid");
        assert_eq!(claims.role, Role::Worker);
        let left = claims.exp - unix_now();
        assert!((3590..=3600).contains(&left), "{left}");

        assert_eq!(t.revoke(&claims.jti).expect("known"), 0);
        assert!(server.revoker().is_revoked(&claims.jti));
        assert_ne!(
            t.current_url(),
            first,
            "a revoked token leaves the join URL"
        );
        assert!(matches!(t.revoke("nope"), Err(JoinError::Unknown(_))));

        let (again, _server2) = tokens(dir.path()).await;
        let listed = again.list();
        assert_eq!(listed.len(), 2);
        assert!(listed.iter().any(|i| i.id == claims.jti && i.revoked));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(dir.path().join("tokens.json"))
                .expect("file")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn a_decision_on_a_worker_holds_for_its_token_not_its_peer_id() {
        let s = Sessions::default();
        let (a, again, other) = (PeerId("a".into()), PeerId("a2".into()), PeerId("b".into()));
        let way_in = |t: &str| Session {
            token_id: t.into(),
            addr: None,
        };
        s.joined(a.clone(), way_in("t1"));
        s.joined(other.clone(), way_in("t2"));
        assert_eq!(s.decided(&a), None);
        assert_eq!(s.decide(&a, true).as_deref(), Some("t1"));
        s.left(&a);
        assert_eq!(s.get(&a), None);
        // The same token, a new session: approved without asking.
        s.joined(again.clone(), way_in("t1"));
        assert_eq!(s.decided(&again), Some(true));
        assert_eq!(s.decided(&other), None);
        assert_eq!(s.decide(&PeerId("nobody".into()), true), None);
    }

    #[test]
    fn an_eviction_bars_its_token_from_its_address_under_any_peer_id() {
        let s = Sessions::default();
        let way_in = |t: &str, ip: [u8; 4]| Session {
            token_id: t.into(),
            addr: Some(IpAddr::from(ip)),
        };
        let peer = |p: &str| PeerId(p.into());
        s.joined(peer("bad"), way_in("shared", [10, 0, 0, 9]));
        s.joined(peer("honest"), way_in("shared", [10, 0, 0, 2]));
        // An honest worker on the same host with the same token.
        s.joined(peer("neighbour"), way_in("shared", [10, 0, 0, 9]));
        s.joined(peer("own"), way_in("single", [10, 0, 0, 3]));
        let (session, alone) = s.evict(&peer("bad")).expect("a session");
        assert_eq!(session.token_id, "shared");
        assert!(!alone, "another worker holds the token");
        s.left(&peer("bad"));
        // Back under a new id: barred. The same token elsewhere is not.
        s.joined(peer("bad-again"), way_in("shared", [10, 0, 0, 9]));
        assert!(s.barred(&peer("bad-again")));
        assert!(!s.barred(&peer("honest")));
        // The neighbour was in the room beside it: its link coming up again
        // (same peer id) does not bar it. A later twin of it is barred.
        assert!(!s.barred(&peer("neighbour")));
        s.joined(peer("neighbour-twin"), way_in("shared", [10, 0, 0, 9]));
        assert!(s.barred(&peer("neighbour-twin")));
        s.joined(peer("new"), way_in("other", [10, 0, 0, 9]));
        assert!(!s.barred(&peer("new")), "another token from that address");
        // A token only the evicted worker holds is its alone (so revocable).
        assert!(s.evict(&peer("own")).expect("a session").1);
        assert_eq!(s.evict(&peer("nobody")), None);
    }
}

//! Rooms and their peers: joins, leaves, relays, meta updates, revocations.
//!
//! One mutex guards every room. All it protects are map operations and
//! non-blocking queue pushes, never I/O, so it is held for microseconds; and
//! holding one lock across a join's welcome and its broadcast is what gives
//! every peer the same order of events.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::extract::ws::Utf8Bytes;
use rand::RngCore as _;
use serde_json::value::RawValue;
use tokio::sync::{mpsc, watch};

use crate::limits::Limits;
use crate::protocol::{Outgoing, PeerId, PeerInfoRef, close_code};
use crate::token::{MAX_TTL, Role, unix_now};

/// Revocations remembered at most; the oldest is forgotten first.
const MAX_REVOCATIONS: usize = 100_000;

/// Why the server ends a session from outside its own task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Kick {
    pub code: u16,
    pub reason: &'static str,
}

pub(crate) const KICK_REVOKED: Kick = Kick {
    code: close_code::REVOKED,
    reason: "token revoked",
};
pub(crate) const KICK_TOO_SLOW: Kick = Kick {
    code: close_code::TOO_SLOW,
    reason: "not reading messages fast enough",
};
pub(crate) const KICK_SHUTDOWN: Kick = Kick {
    code: close_code::GOING_AWAY,
    reason: "server shutting down",
};
pub(crate) const KICK_LEFT: Kick = Kick {
    code: 1000,
    reason: "left",
};

struct Peer {
    token_id: String,
    role: Role,
    /// `{"peer_id":..,"role":..,"meta":{..}}`, as sent to others.
    info: Box<RawValue>,
    tx: Outbox,
    kick: watch::Sender<Option<Kick>>,
}

/// One queued message, with the peer it counts against (none for the
/// server's own events).
pub(crate) struct Queued {
    from: Option<PeerId>,
    text: Utf8Bytes,
}

/// Messages each sender has waiting in one queue.
type Shares = Arc<Mutex<HashMap<PeerId, usize>>>;

/// The hub's end of a session's queue, bounded in messages and in bytes so
/// a client that stops reading costs the server a known amount of memory.
/// Other peers' messages may fill only part of it, each sender a small
/// share, so a peer that floods another costs the flooder, never the
/// reader or the server's own events.
struct Outbox {
    tx: mpsc::Sender<Queued>,
    bytes: Arc<AtomicUsize>,
    max_bytes: usize,
    shares: Shares,
    /// Messages one sender may have waiting here.
    share: usize,
    /// Messages from all senders together.
    peers_room: usize,
}

enum Push {
    Queued,
    Full,
    /// A sender's message over its share, or over the part of the queue
    /// left to peers: dropped, and the reader stays.
    Busy,
    Closed,
}

impl Outbox {
    /// Callers hold the hub lock, so the check and the add are one step.
    fn push(&self, from: Option<&PeerId>, message: Utf8Bytes) -> Push {
        let len = message.len();
        let bytes = self.bytes.load(Ordering::Acquire);
        let mut shares = self.shares.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(from) = from {
            let waiting = self.tx.max_capacity() - self.tx.capacity();
            let mine = shares.get(from).copied().unwrap_or(0);
            if mine >= self.share
                || waiting >= self.peers_room
                || bytes + len > self.max_bytes / 4 * 3
            {
                return Push::Busy;
            }
        }
        if bytes + len > self.max_bytes {
            return Push::Full;
        }
        // Counted before sending so the session's subtraction cannot run first.
        self.bytes.fetch_add(len, Ordering::AcqRel);
        let queued = Queued {
            from: from.cloned(),
            text: message,
        };
        match self.tx.try_send(queued) {
            Ok(()) => {
                if let Some(from) = from {
                    *shares.entry(from.clone()).or_insert(0) += 1;
                }
                Push::Queued
            }
            Err(error) => {
                self.bytes.fetch_sub(len, Ordering::AcqRel);
                match error {
                    mpsc::error::TrySendError::Full(_) => Push::Full,
                    mpsc::error::TrySendError::Closed(_) => Push::Closed,
                }
            }
        }
    }
}

/// The session's end of its queue.
pub(crate) struct Inbox {
    rx: mpsc::Receiver<Queued>,
    bytes: Arc<AtomicUsize>,
    shares: Shares,
}

impl Inbox {
    /// Cancel-safe: the counts are updated in the same poll that takes the message.
    pub(crate) async fn recv(&mut self) -> Option<Utf8Bytes> {
        let Queued { from, text } = self.rx.recv().await?;
        self.bytes.fetch_sub(text.len(), Ordering::AcqRel);
        if let Some(from) = from {
            let mut shares = self.shares.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(n) = shares.get_mut(&from) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    shares.remove(&from);
                }
            }
        }
        Some(text)
    }
}

#[derive(Default)]
struct Room {
    peers: BTreeMap<PeerId, Peer>,
    /// Connections admitted to this room and still being upgraded.
    reserved: usize,
}

impl Room {
    fn is_unused(&self) -> bool {
        self.peers.is_empty() && self.reserved == 0
    }
}

#[derive(Default)]
struct State {
    rooms: HashMap<String, Room>,
    /// Revoked token id -> when it may be forgotten (Unix seconds).
    revoked: HashMap<String, u64>,
    closed: bool,
}

pub(crate) struct Hub {
    state: Mutex<State>,
    max_peers_per_room: usize,
    send_queue: usize,
    send_queue_bytes: usize,
    peer_share: usize,
    peers_room: usize,
    revocations_file: Option<PathBuf>,
}

/// A place held in a room between the HTTP check and the WebSocket join.
pub(crate) struct Reservation {
    hub: Arc<Hub>,
    room: String,
    live: bool,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        let mut state = self.hub.lock();
        if let Some(room) = state.rooms.get_mut(&self.room) {
            room.reserved = room.reserved.saturating_sub(1);
            if room.is_unused() {
                state.rooms.remove(&self.room);
            }
        }
    }
}

/// Being in a room; leaving it (with `peer-left` to the others) on drop.
pub(crate) struct Membership {
    hub: Arc<Hub>,
    room: String,
    peer_id: PeerId,
}

impl Drop for Membership {
    fn drop(&mut self) {
        let mut state = self.hub.lock();
        evict(
            &mut state,
            &self.room,
            vec![(self.peer_id.clone(), KICK_LEFT)],
        );
    }
}

/// What a session needs after joining.
pub(crate) struct Joined {
    pub membership: Membership,
    pub peer_id: PeerId,
    pub welcome: Utf8Bytes,
    pub outbox: Inbox,
    pub kicked: watch::Receiver<Option<Kick>>,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum RelayError {
    ToSelf,
    UnknownPeer,
    /// The target holds as many of the sender's messages as it may: this
    /// one was dropped.
    TargetBusy,
    /// The sender itself is no longer in the room.
    NotJoined,
}

impl Hub {
    pub(crate) fn new(
        limits: &Limits,
        revocations_file: Option<PathBuf>,
    ) -> std::io::Result<Arc<Self>> {
        let mut state = State::default();
        if let Some(path) = &revocations_file {
            state.revoked = load_revocations(path)?;
        }
        Ok(Arc::new(Self {
            state: Mutex::new(state),
            max_peers_per_room: limits.max_peers_per_room,
            send_queue: limits.send_queue,
            send_queue_bytes: limits.send_queue_bytes,
            peer_share: limits.peer_share(),
            peers_room: limits.peers_room(),
            revocations_file,
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere leaves maps that are still consistent (every
        // mutation is a single insert or remove), so carry on.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn is_revoked(&self, token_id: &str) -> bool {
        self.lock().revoked.contains_key(token_id)
    }

    /// Holds a place in `room`, or `None` if it is full.
    pub(crate) fn reserve(self: &Arc<Self>, room: &str) -> Option<Reservation> {
        let mut state = self.lock();
        if state.closed {
            return None;
        }
        let entry = state.rooms.entry(room.to_owned()).or_default();
        if entry.peers.len() + entry.reserved >= self.max_peers_per_room {
            return None;
        }
        entry.reserved += 1;
        Some(Reservation {
            hub: Arc::clone(self),
            room: room.to_owned(),
            live: true,
        })
    }

    /// Turns a reservation into a membership: tells everyone already in the
    /// room, and returns the welcome listing them.
    pub(crate) fn join(
        self: &Arc<Self>,
        mut reservation: Reservation,
        role: Role,
        token_id: &str,
    ) -> Result<Joined, Kick> {
        let mut state = self.lock();
        reservation.live = false;
        let room_name = std::mem::take(&mut reservation.room);
        let refusal = if state.closed {
            Some(KICK_SHUTDOWN)
        } else if state.revoked.contains_key(token_id) {
            Some(KICK_REVOKED)
        } else {
            None
        };
        let Some(room) = state.rooms.get_mut(&room_name) else {
            // The reservation kept the room alive, so this is unreachable.
            return Err(KICK_SHUTDOWN);
        };
        room.reserved = room.reserved.saturating_sub(1);
        if let Some(kick) = refusal {
            if room.is_unused() {
                state.rooms.remove(&room_name);
            }
            return Err(kick);
        }

        let peer_id = loop {
            let mut raw = [0u8; 8];
            rand::rng().fill_bytes(&mut raw);
            let id = PeerId(raw.iter().map(|b| format!("{b:02x}")).collect());
            if !room.peers.contains_key(&id) {
                break id;
            }
        };
        let info = peer_info(&peer_id, role, empty_meta());
        let welcome = Outgoing::Welcome {
            peer_id: &peer_id,
            peers: room.peers.values().map(|p| p.info.as_ref()).collect(),
        }
        .encode();
        let announcement = Outgoing::PeerJoined { peer: &info }.encode();
        let slow = broadcast(room, &announcement);

        let (tx, rx) = mpsc::channel(self.send_queue);
        let bytes = Arc::new(AtomicUsize::new(0));
        let shares = Shares::default();
        let tx = Outbox {
            tx,
            bytes: Arc::clone(&bytes),
            max_bytes: self.send_queue_bytes,
            shares: Arc::clone(&shares),
            share: self.peer_share,
            peers_room: self.peers_room,
        };
        let outbox = Inbox { rx, bytes, shares };
        let (kick, kicked) = watch::channel(None);
        room.peers.insert(
            peer_id.clone(),
            Peer {
                token_id: token_id.to_owned(),
                role,
                info,
                tx,
                kick,
            },
        );
        evict(&mut state, &room_name, slow);
        Ok(Joined {
            membership: Membership {
                hub: Arc::clone(self),
                room: room_name,
                peer_id: peer_id.clone(),
            },
            peer_id,
            welcome,
            outbox,
            kicked,
        })
    }

    /// Queues `message` (already encoded) for peer `to`.
    pub(crate) fn relay(
        &self,
        room_name: &str,
        from: &PeerId,
        to: &PeerId,
        message: Utf8Bytes,
    ) -> Result<(), RelayError> {
        let state = self.lock();
        let Some(room) = state.rooms.get(room_name) else {
            return Err(RelayError::NotJoined);
        };
        if !room.peers.contains_key(from) {
            return Err(RelayError::NotJoined);
        }
        if from == to {
            return Err(RelayError::ToSelf);
        }
        let Some(target) = room.peers.get(to) else {
            return Err(RelayError::UnknownPeer);
        };
        match target.tx.push(Some(from), message) {
            Push::Queued => Ok(()),
            Push::Closed => Err(RelayError::UnknownPeer),
            // Peers' messages never fill the whole queue, so this is the
            // byte bound of a reader that stopped: the same as `Busy` for
            // the sender, and the reader's write timeout ends it.
            Push::Busy | Push::Full => Err(RelayError::TargetBusy),
        }
    }

    /// Replaces a peer's advertised meta (a compact JSON object) and tells
    /// the others with `peer-meta`. Returns how many it was sent to: the
    /// sender pays for each. A peer already holding its share of the
    /// sender's messages misses this update (it sees the newest meta in the
    /// next one, or in the welcome of a later join).
    pub(crate) fn set_meta(&self, room_name: &str, peer_id: &PeerId, meta: &RawValue) -> usize {
        let mut state = self.lock();
        let Some(room) = state.rooms.get_mut(room_name) else {
            return 0;
        };
        let Some(peer) = room.peers.get_mut(peer_id) else {
            return 0;
        };
        peer.info = peer_info(peer_id, peer.role, meta);
        let update = Outgoing::PeerMeta { peer: &peer.info }.encode();
        let mut sent = 0;
        for (id, other) in &room.peers {
            if id != peer_id && matches!(other.tx.push(Some(peer_id), update.clone()), Push::Queued)
            {
                sent += 1;
            }
        }
        sent
    }

    /// Refuses token `token_id` from now on and drops its live sessions.
    /// Returns how many were dropped.
    pub(crate) fn revoke(&self, token_id: &str) -> usize {
        let now = unix_now();
        let forget_at = now.saturating_add(MAX_TTL.as_secs() + 120);
        let mut state = self.lock();
        state.revoked.retain(|_, until| *until > now);
        if state.revoked.len() >= MAX_REVOCATIONS {
            let oldest = state
                .revoked
                .iter()
                .min_by_key(|(_, until)| **until)
                .map(|(id, _)| id.clone());
            if let Some(oldest) = oldest {
                state.revoked.remove(&oldest);
            }
        }
        state.revoked.insert(token_id.to_owned(), forget_at);
        let mut victims: Vec<(String, PeerId)> = Vec::new();
        for (room_name, room) in &state.rooms {
            for (peer_id, peer) in &room.peers {
                if peer.token_id == token_id {
                    victims.push((room_name.clone(), peer_id.clone()));
                }
            }
        }
        for (room_name, peer_id) in &victims {
            evict(&mut state, room_name, vec![(peer_id.clone(), KICK_REVOKED)]);
        }
        drop(state);
        if let Some(path) = &self.revocations_file
            && let Err(error) = append_revocation(path, token_id, forget_at)
        {
            tracing::error!(%error, path = %path.display(), "cannot persist revocation");
        }
        victims.len()
    }

    /// Refuses new joins and tells every session to close.
    pub(crate) fn shut_down(&self) {
        let mut state = self.lock();
        state.closed = true;
        for room in state.rooms.values() {
            for peer in room.peers.values() {
                peer.kick.send_replace(Some(KICK_SHUTDOWN));
            }
        }
    }

    pub(crate) fn peer_count(&self) -> usize {
        self.lock().rooms.values().map(|r| r.peers.len()).sum()
    }
}

fn empty_meta() -> &'static RawValue {
    // A literal `{}` is valid JSON.
    static EMPTY: std::sync::OnceLock<Box<RawValue>> = std::sync::OnceLock::new();
    EMPTY.get_or_init(|| {
        RawValue::from_string("{}".to_owned()).unwrap_or_else(|_| unreachable!("{{}} is JSON"))
    })
}

fn peer_info(peer_id: &PeerId, role: Role, meta: &RawValue) -> Box<RawValue> {
    let json = serde_json::to_string(&PeerInfoRef {
        peer_id,
        role,
        meta,
    })
    .unwrap_or_default();
    RawValue::from_string(json).unwrap_or_else(|_| unreachable!("serde_json output is JSON"))
}

/// Queues one of the server's own events for everyone in `room`; returns
/// the peers whose queues were full.
fn broadcast(room: &Room, message: &Utf8Bytes) -> Vec<(PeerId, Kick)> {
    let mut slow = Vec::new();
    for (peer_id, peer) in &room.peers {
        if let Push::Full = peer.tx.push(None, message.clone()) {
            slow.push((peer_id.clone(), KICK_TOO_SLOW));
        }
    }
    slow
}

/// Removes peers from a room, each with `peer-left` to those who remain.
/// Telling them can find more full queues, hence the work list.
fn evict(state: &mut State, room_name: &str, first: Vec<(PeerId, Kick)>) {
    let mut work = VecDeque::from(first);
    let Some(room) = state.rooms.get_mut(room_name) else {
        return;
    };
    while let Some((peer_id, kick)) = work.pop_front() {
        let Some(peer) = room.peers.remove(&peer_id) else {
            continue;
        };
        peer.kick.send_replace(Some(kick));
        let left = Outgoing::PeerLeft { peer_id: &peer_id }.encode();
        work.extend(broadcast(room, &left));
    }
    if room.is_unused() {
        state.rooms.remove(room_name);
    }
}

fn load_revocations(path: &std::path::Path) -> std::io::Result<HashMap<String, u64>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => return Err(e),
    };
    let now = unix_now();
    let mut revoked = HashMap::new();
    let mut stale = false;
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(id), Some(until)) = (fields.next(), fields.next()) else {
            stale |= !line.trim().is_empty();
            continue;
        };
        match until.parse::<u64>() {
            Ok(until) if until > now => {
                revoked.insert(id.to_owned(), until);
            }
            _ => stale = true,
        }
    }
    if stale {
        // Rewrite without expired lines so the file does not grow forever.
        let tmp = path.with_extension("tmp");
        let body: String = revoked
            .iter()
            .map(|(id, until)| format!("{id} {until}\n"))
            .collect();
        std::fs::write(&tmp, body)?;
        std::fs::rename(&tmp, path)?;
    }
    Ok(revoked)
}

fn append_revocation(path: &std::path::Path, token_id: &str, until: u64) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    // Token ids are base64url (no whitespace), but ids typed by hand are
    // not: keep one record per line whatever they hold.
    let id: String = token_id.chars().filter(|c| !c.is_whitespace()).collect();
    writeln!(file, "{id} {until}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub(max: usize, queue: usize) -> Arc<Hub> {
        let limits = Limits {
            max_peers_per_room: max,
            send_queue: queue,
            ..Limits::default()
        };
        Hub::new(&limits, None).unwrap()
    }

    fn join(hub: &Arc<Hub>, token: &str) -> Joined {
        hub.join(hub.reserve("r").unwrap(), Role::Worker, token)
            .unwrap()
    }

    fn recv(inbox: &mut Inbox) -> Option<Utf8Bytes> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_millis(10), inbox.recv())
                .await
                .ok()
                .flatten()
        })
    }

    #[test]
    fn reservations_count_towards_room_size_and_release_on_drop() {
        let hub = hub(2, 8);
        let a = hub.reserve("r").unwrap();
        let _b = hub.reserve("r").unwrap();
        assert!(hub.reserve("r").is_none());
        drop(a);
        assert!(hub.reserve("r").is_some());
    }

    #[test]
    fn leaving_empties_and_removes_the_room() {
        let hub = hub(4, 8);
        let joined = join(&hub, "t");
        assert_eq!(hub.peer_count(), 1);
        drop(joined);
        assert_eq!(hub.peer_count(), 0);
        assert!(hub.lock().rooms.is_empty());
    }

    #[test]
    fn a_flooding_sender_costs_itself_not_the_reader() {
        // A queue of 16: each sender may have 2 waiting, all senders 12.
        let hub = hub(8, 16);
        let mut a = join(&hub, "a");
        let b = join(&hub, "b");
        let c = join(&hub, "c");
        let msg = || Utf8Bytes::from("{}");
        for _ in 0..2 {
            assert_eq!(hub.relay("r", &b.peer_id, &a.peer_id, msg()), Ok(()));
        }
        assert_eq!(
            hub.relay("r", &b.peer_id, &a.peer_id, msg()),
            Err(RelayError::TargetBusy),
            "over the sender's share"
        );
        assert_eq!(*a.kicked.borrow(), None, "the reader stays");
        assert_eq!(
            hub.relay("r", &c.peer_id, &a.peer_id, msg()),
            Ok(()),
            "another sender still gets through"
        );
        // `a` reads: two `peer-joined`, then b's messages free b's share.
        for _ in 0..3 {
            assert!(recv(&mut a.outbox).is_some());
        }
        assert_eq!(hub.relay("r", &b.peer_id, &a.peer_id, msg()), Ok(()));
        assert_eq!(hub.peer_count(), 3);
    }

    #[test]
    fn meta_skips_readers_holding_the_senders_share_and_counts_the_rest() {
        let hub = hub(8, 16);
        let a = join(&hub, "a");
        let _b = join(&hub, "b");
        let c = join(&hub, "c");
        let meta = RawValue::from_string("{\"x\":1}".into()).unwrap();
        assert_eq!(hub.set_meta("r", &a.peer_id, &meta), 2);
        assert_eq!(hub.set_meta("r", &a.peer_id, &meta), 2);
        // b and c each hold two of a's messages now.
        assert_eq!(hub.set_meta("r", &a.peer_id, &meta), 0);
        assert_eq!(*c.kicked.borrow(), None);
        assert_eq!(hub.peer_count(), 3);
    }

    #[test]
    fn a_reader_too_slow_for_the_servers_own_events_is_dropped() {
        // A queue of 2, all of it open to the server's `peer-joined` events.
        let hub = hub(8, 2);
        let a = join(&hub, "a");
        let mut b = join(&hub, "b");
        let _c = join(&hub, "c");
        assert_eq!(*a.kicked.borrow(), None, "two events fit");
        // b reads; a does not.
        while recv(&mut b.outbox).is_some() {}
        let _d = join(&hub, "d");
        assert_eq!(*a.kicked.borrow(), Some(KICK_TOO_SLOW));
        assert_eq!(hub.peer_count(), 3);
    }

    #[test]
    fn revocation_kicks_and_blocks_rejoin() {
        let hub = hub(4, 8);
        let a = join(&hub, "tok");
        assert_eq!(hub.revoke("tok"), 1);
        assert_eq!(*a.kicked.borrow(), Some(KICK_REVOKED));
        assert!(
            hub.join(hub.reserve("r").unwrap(), Role::Worker, "tok")
                .is_err()
        );
    }
}

//! The driver's end of the application's channels: the outgoing queue and
//! its byte budget (the permit of the message being written), inbound
//! delivery with backpressure, who waits for which probe, the published
//! stats and the close reason. No sockets and no WebRTC here: the driver
//! moves what this takes and gives between it and the link's session.

use std::collections::{HashMap, VecDeque};
use std::future::pending;
use std::sync::Arc;
use std::time::Instant;

use cairn_engine::protocol::{Hello, Message};
use cairn_engine::session::Session;
use cairn_signal::protocol::PeerId;
use tokio::sync::mpsc::error::{TryRecvError, TrySendError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};

use super::LinkError;
use super::driver::Control;
use super::handle::{CloseReason, Link, LinkSender, Outgoing, ProbeWaiter};
use super::stats::LinkStats;

/// Received messages waiting for the application (the session's, in the
/// driver; a plain queue in tests).
pub(crate) trait Inbox {
    fn has_received(&self) -> bool;
    fn pop_received(&mut self) -> Option<Message>;
    /// The application is gone: drop what waits.
    fn clear_received(&mut self);
}

impl Inbox for Session {
    fn has_received(&self) -> bool {
        Session::has_received(self)
    }

    fn pop_received(&mut self) -> Option<Message> {
        Session::pop_received(self)
    }

    fn clear_received(&mut self) {
        Session::clear_received(self)
    }
}

impl Inbox for VecDeque<Message> {
    fn has_received(&self) -> bool {
        !self.is_empty()
    }

    fn pop_received(&mut self) -> Option<Message> {
        self.pop_front()
    }

    fn clear_received(&mut self) {
        self.clear()
    }
}

/// What the application side woke the driver for.
pub(crate) enum AppWake {
    /// Something to send; `None`: every sender is gone.
    Outgoing(Option<Outgoing>),
    /// Room for one received message; `None`: the application dropped its receiver.
    Room(Option<mpsc::OwnedPermit<Message>>),
}

/// The driver's end of one link's application channels.
pub(crate) struct AppEnd {
    queue: mpsc::UnboundedReceiver<Outgoing>,
    inbound: mpsc::Sender<Message>,
    /// The application's handle, until the link is up.
    link: Option<Link>,
    stats: watch::Sender<LinkStats>,
    /// Who waits for the result of which probe.
    probe_waiters: HashMap<u64, ProbeWaiter>,
    closed: CloseReason,
    budget: Arc<Semaphore>,
    /// What to release once the message being written is out.
    frames_permit: Option<OwnedSemaphorePermit>,
}

impl AppEnd {
    /// The channels of a new link: `send_queue_bytes` of messages may wait
    /// to be written, `receive_queue` messages to be read.
    pub fn new(
        peer: PeerId,
        session: String,
        control: mpsc::UnboundedSender<Control>,
        send_queue_bytes: usize,
        receive_queue: usize,
        now: Instant,
    ) -> Self {
        let (queue_tx, queue) = mpsc::unbounded_channel();
        let (inbound, inbound_rx) = mpsc::channel(receive_queue.max(1));
        let (stats, stats_rx) = watch::channel(LinkStats::initial(now));
        // A semaphore holds at most `usize::MAX >> 3` permits, and a permit
        // request is a u32.
        let budget_bytes = send_queue_bytes.min(u32::MAX as usize >> 1);
        let budget = Arc::new(Semaphore::new(budget_bytes));
        let closed = CloseReason::default();
        let sender = LinkSender {
            queue: queue_tx,
            budget: Arc::clone(&budget),
            budget_bytes,
            closed: closed.clone(),
        };
        let link = Link {
            peer,
            session,
            sender,
            inbound: inbound_rx,
            stats: stats_rx,
            control,
            remote_hello: Hello::new("", 0, String::new()),
            max_frame_bytes: 0,
        };
        Self {
            queue,
            inbound,
            link: Some(link),
            stats,
            probe_waiters: HashMap::new(),
            closed,
            budget,
            frames_permit: None,
        }
    }

    /// The application's handle, once: the session is up with `remote`,
    /// and our frames are at most `max_frame_bytes`.
    pub fn take_link(&mut self, remote: Hello, max_frame_bytes: usize) -> Option<Link> {
        let mut link = self.link.take()?;
        link.remote_hello = remote;
        link.max_frame_bytes = max_frame_bytes;
        Some(link)
    }

    /// Waits for something to send (if `take`) or for room to deliver a
    /// received message (if `deliver`); forever if neither.
    pub async fn wake(&mut self, take: bool, deliver: bool) -> AppWake {
        let inbound = self.inbound.clone();
        tokio::select! {
            o = self.queue.recv(), if take => AppWake::Outgoing(o),
            p = inbound.reserve_owned(), if deliver => AppWake::Room(p.ok()),
            else => pending().await,
        }
    }

    /// The next thing to send, if one is queued.
    pub fn try_next(&mut self) -> Result<Outgoing, TryRecvError> {
        self.queue.try_recv()
    }

    /// The message now being written holds `permit` of the send budget.
    pub fn hold_permit(&mut self, permit: Option<OwnedSemaphorePermit>) {
        self.frames_permit = permit;
    }

    /// The message being written is out: its share of the budget is free.
    pub fn release_permit(&mut self) {
        self.frames_permit = None;
    }

    /// Hands waiting messages to the application while it has room.
    pub fn deliver(&mut self, inbox: &mut impl Inbox) {
        while inbox.has_received() {
            match self.inbound.try_reserve() {
                Ok(permit) => {
                    if let Some(m) = inbox.pop_received() {
                        permit.send(m);
                    }
                }
                Err(TrySendError::Full(())) => return,
                Err(TrySendError::Closed(())) => {
                    inbox.clear_received();
                    return;
                }
            }
        }
    }

    /// Room for one message came ([`AppWake::Room`]).
    pub fn on_room(&mut self, room: Option<mpsc::OwnedPermit<Message>>, inbox: &mut impl Inbox) {
        match room {
            Some(permit) => {
                if let Some(m) = inbox.pop_received() {
                    permit.send(m);
                }
            }
            // The application dropped its receiver: nothing to deliver to.
            None => inbox.clear_received(),
        }
    }

    /// A probe the application asked for went out as `nonce`, or could not.
    pub fn probe_started(&mut self, started: Result<u64, LinkError>, waiter: ProbeWaiter) {
        match started {
            Ok(nonce) => {
                self.probe_waiters.insert(nonce, waiter);
            }
            Err(e) => {
                let _ = waiter.send(Err(e));
            }
        }
    }

    /// Probe `nonce` was acknowledged: its waiter, if any, gets the result.
    pub fn probe_done(&mut self, nonce: u64, bytes_per_second: f64) {
        if let Some(w) = self.probe_waiters.remove(&nonce) {
            let _ = w.send(Ok(bytes_per_second));
        }
    }

    /// Publishes new measurements to every [`Link::stats`] reader.
    pub fn publish(&self, stats: LinkStats) {
        self.stats.send_replace(stats);
    }

    /// The link ended with `error`: senders and probe waiters learn why,
    /// and sending stops. Messages already delivered can still be read.
    pub fn close(&mut self, error: &LinkError) {
        self.closed.set(error.clone());
        self.budget.close();
        for (_, waiter) in self.probe_waiters.drain() {
            let _ = waiter.send(Err(error.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use cairn_engine::protocol::Framer;
    use cairn_engine::session::SessionStats;
    use tokio::sync::oneshot;

    use super::super::stats::RelayStats;
    use super::*;

    fn end(send_queue_bytes: usize, receive_queue: usize) -> (AppEnd, Link) {
        let (control, _) = mpsc::unbounded_channel();
        let mut app = AppEnd::new(
            PeerId("peer".into()),
            "s1".into(),
            control,
            send_queue_bytes,
            receive_queue,
            Instant::now(),
        );
        let link = app
            .take_link(Hello::new("peer", 1 << 20, String::new()), 4096)
            .expect("the handle, once");
        (app, link)
    }

    fn text(bytes: usize) -> Message {
        Message::Pause {
            reason: "x".repeat(bytes),
        }
    }

    /// Takes the next queued message with the budget permit it holds.
    fn queued(app: &mut AppEnd) -> (Message, Option<OwnedSemaphorePermit>) {
        match app.try_next() {
            Ok(Outgoing::Message(m, permit)) => (m, permit),
            Ok(_) => panic!("not a message"),
            Err(e) => panic!("nothing queued: {e}"),
        }
    }

    #[tokio::test]
    async fn the_handle_is_given_once_with_what_the_peer_said() {
        let (mut app, link) = end(1000, 4);
        assert_eq!(link.remote_hello().peer, "peer");
        assert_eq!(link.max_frame_bytes(), 4096);
        assert_eq!(link.session(), "s1");
        assert!(
            app.take_link(Hello::new("x", 0, String::new()), 1)
                .is_none()
        );
    }

    #[tokio::test]
    async fn a_sender_waits_while_queued_messages_hold_the_budget() {
        let len = Framer::encoded_len(&text(300)).expect("encodes") as usize;
        let (mut app, link) = end(len + len / 2, 4);
        link.send(text(300)).await.expect("within the budget");
        let sender = link.sender();
        let second = tokio::spawn(async move { sender.send(text(300)).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!second.is_finished(), "the first message holds the budget");

        let (_, permit) = queued(&mut app);
        assert!(permit.is_some());
        app.hold_permit(permit);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!second.is_finished(), "held while it is being written");
        app.release_permit();
        second
            .await
            .expect("task")
            .expect("sent once the first is out");
        let (m, _) = queued(&mut app);
        assert_eq!(m, text(300));
    }

    #[tokio::test]
    async fn a_message_larger_than_the_budget_takes_all_of_it() {
        let (mut app, link) = end(100, 4);
        link.send(text(1000)).await.expect("clamped to the budget");
        let sender = link.sender();
        let small = tokio::spawn(async move { sender.send(text(1)).await });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!small.is_finished());
        drop(queued(&mut app));
        small.await.expect("task").expect("sent");
    }

    #[tokio::test]
    async fn delivery_stops_at_the_receive_queue_and_goes_on_with_room() {
        let (mut app, mut link) = end(1000, 2);
        let mut inbox: VecDeque<Message> = (0..3).map(text).collect();
        app.deliver(&mut inbox);
        assert_eq!(inbox.len(), 1, "two fit the queue");
        assert_eq!(link.recv().await, Ok(text(0)));
        let AppWake::Room(room) = app.wake(false, true).await else {
            panic!("woke for room");
        };
        app.on_room(room, &mut inbox);
        assert!(inbox.is_empty());
        assert_eq!(link.recv().await, Ok(text(1)));
        assert_eq!(link.recv().await, Ok(text(2)));
    }

    #[tokio::test]
    async fn what_nobody_reads_any_more_is_dropped() {
        let (mut app, link) = end(1000, 1);
        drop(link);
        let mut inbox: VecDeque<Message> = (0..3).map(text).collect();
        app.deliver(&mut inbox);
        assert!(inbox.is_empty());
        inbox.push_back(text(4));
        let AppWake::Room(room) = app.wake(false, true).await else {
            panic!("woke for room");
        };
        assert!(room.is_none());
        app.on_room(room, &mut inbox);
        assert!(inbox.is_empty());
    }

    #[tokio::test]
    async fn probe_waiters_get_their_result_or_why_not() {
        let (mut app, _link) = end(1000, 1);
        let (done_tx, done) = oneshot::channel();
        app.probe_started(Ok(7), done_tx);
        let (refused_tx, refused) = oneshot::channel();
        app.probe_started(Err(LinkError::Closed), refused_tx);
        let (open_tx, open) = oneshot::channel();
        app.probe_started(Ok(8), open_tx);

        assert_eq!(refused.await.expect("answered"), Err(LinkError::Closed));
        app.probe_done(99, 1.0); // someone else's (the session's own probe)
        app.probe_done(7, 1234.0);
        assert_eq!(done.await.expect("answered"), Ok(1234.0));
        let why = LinkError::HeartbeatTimeout(Duration::from_secs(5));
        app.close(&why);
        assert_eq!(open.await.expect("answered"), Err(why));
    }

    #[tokio::test]
    async fn after_close_senders_learn_why_and_readers_drain_first() {
        let (mut app, mut link) = end(1000, 4);
        app.deliver(&mut VecDeque::from([text(1)]));
        let why = LinkError::ClosedByPeer("bye".into());
        app.close(&why);
        assert_eq!(link.close_reason(), Some(why.clone()));
        assert_eq!(link.send(text(2)).await, Err(why.clone()));
        let back = link.sender().send_or_return(text(3)).await;
        assert_eq!(back, Err((text(3), why.clone())));
        drop(app);
        assert_eq!(link.recv().await, Ok(text(1)), "received before the end");
        assert_eq!(link.recv().await, Err(why.clone()));
        assert_eq!(link.probe(10).await, Err(why));
    }

    #[tokio::test]
    async fn dropping_every_sender_wakes_the_driver_to_close() {
        let (mut app, link) = end(1000, 1);
        drop(link);
        assert!(matches!(
            app.wake(true, false).await,
            AppWake::Outgoing(None)
        ));
        assert!(matches!(app.try_next(), Err(TryRecvError::Disconnected)));
    }

    #[tokio::test]
    async fn published_stats_reach_every_reader() {
        let (app, link) = end(1000, 1);
        let mut watch = link.stats_watch();
        let session = SessionStats {
            max_frame_bytes: 4096,
            ..SessionStats::default()
        };
        let mut relay = RelayStats::default();
        relay.relayed(10, true);
        app.publish(LinkStats::new(session, &relay, Instant::now()));
        assert!(watch.has_changed().expect("open"));
        let s = watch.borrow_and_update().clone();
        assert_eq!(s, link.stats());
        assert_eq!(s.max_frame_bytes, 4096);
        assert!(s.relayed);
        assert_eq!(s.tx_relayed_bytes, 10);
    }
}

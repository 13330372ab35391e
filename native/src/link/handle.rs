//! What the application holds of a link: [`Link`] (receive, stats, close)
//! and [`LinkSender`] (send with backpressure, probe). The driver's end of
//! the same channels is `app.rs`.

use std::sync::{Arc, Mutex, PoisonError};

use cairn_engine::protocol::{Framer, Hello, Message};
use cairn_signal::protocol::PeerId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};

use super::LinkError;
use super::driver::Control;
use super::stats::LinkStats;

/// Who waits for a throughput probe's result (bytes per second).
pub(crate) type ProbeWaiter = oneshot::Sender<Result<f64, LinkError>>;

/// What the application hands a link to send.
pub(crate) enum Outgoing {
    /// A message, with the share of the send budget it holds until written.
    Message(Message, Option<OwnedSemaphorePermit>),
    Probe(usize, ProbeWaiter),
    /// A raw frame, written as is (tests: a malformed frame).
    Raw(Vec<u8>),
}

/// Why the link ended: written once by the driver, read by every handle.
#[derive(Clone, Debug, Default)]
pub(crate) struct CloseReason(Arc<Mutex<Option<LinkError>>>);

impl CloseReason {
    pub fn get(&self) -> Option<LinkError> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub fn set(&self, error: LinkError) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(error);
    }

    /// The reason, or plain `Closed` while the driver has not written one.
    fn or_closed(&self) -> LinkError {
        self.get().unwrap_or(LinkError::Closed)
    }
}

/// Sends messages on a link; cheap to clone. `send` waits while the link's
/// queue holds `send_queue_bytes`, so a fast sender cannot grow memory.
#[derive(Clone)]
pub struct LinkSender {
    pub(super) queue: mpsc::UnboundedSender<Outgoing>,
    pub(super) budget: Arc<Semaphore>,
    /// The budget's size: a larger message takes all of it, not more.
    pub(super) budget_bytes: usize,
    pub(super) closed: CloseReason,
}

impl std::fmt::Debug for LinkSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkSender").finish_non_exhaustive()
    }
}

impl LinkSender {
    fn closed_error(&self) -> LinkError {
        self.closed.or_closed()
    }

    /// Queues `message`; waits while the queue is full. `Err` once the link is closed.
    pub async fn send(&self, message: Message) -> Result<(), LinkError> {
        self.send_or_return(message).await.map_err(|(_, e)| e)
    }

    /// Like [`Self::send`], but a message the link could not take comes
    /// back with the reason, so the caller can send it another way.
    pub async fn send_or_return(&self, message: Message) -> Result<(), (Message, LinkError)> {
        let len = match Framer::encoded_len(&message) {
            Ok(len) => len,
            Err(e) => return Err((message, e.into())),
        };
        let want = len.clamp(1, self.budget_bytes as u64) as u32;
        let permit = match Arc::clone(&self.budget).acquire_many_owned(want).await {
            Ok(p) => p,
            Err(_) => return Err((message, self.closed_error())),
        };
        self.queue
            .send(Outgoing::Message(message, Some(permit)))
            .map_err(|mpsc::error::SendError(back)| {
                let back = match back {
                    Outgoing::Message(m, _) => m,
                    // Only a message was queued above.
                    Outgoing::Probe(..) | Outgoing::Raw(_) => Message::Resume,
                };
                (back, self.closed_error())
            })
    }

    /// Measures throughput now: sends a probe of `bytes` and waits for the
    /// peer's acknowledgement. Bytes per second, from queueing to the ack.
    pub async fn probe(&self, bytes: usize) -> Result<f64, LinkError> {
        let (tx, rx) = oneshot::channel();
        self.queue
            .send(Outgoing::Probe(bytes, tx))
            .map_err(|_| self.closed_error())?;
        rx.await.map_err(|_| self.closed_error())?
    }

    /// Writes `frame` to the data channel as is, bypassing the framer. Only
    /// for tests of how the peer handles malformed frames.
    #[doc(hidden)]
    pub fn send_raw_frame(&self, frame: Vec<u8>) -> Result<(), LinkError> {
        self.queue
            .send(Outgoing::Raw(frame))
            .map_err(|_| self.closed_error())
    }
}

/// An established link to one peer. Dropping it (and every [`LinkSender`])
/// closes the link gracefully.
pub struct Link {
    pub(super) peer: PeerId,
    pub(super) session: String,
    pub(super) sender: LinkSender,
    pub(super) inbound: mpsc::Receiver<Message>,
    pub(super) stats: watch::Receiver<LinkStats>,
    pub(super) control: mpsc::UnboundedSender<Control>,
    pub(super) remote_hello: Hello,
    pub(super) max_frame_bytes: usize,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("peer", &self.peer)
            .field("session", &self.session)
            .finish_non_exhaustive()
    }
}

impl Link {
    /// The peer's id in the signaling room.
    pub fn peer(&self) -> &PeerId {
        &self.peer
    }

    /// This connection attempt's id (a reconnection gets a new one).
    pub fn session(&self) -> &str {
        &self.session
    }

    /// What the peer said in its `Hello` (capabilities, limits).
    pub fn remote_hello(&self) -> &Hello {
        &self.remote_hello
    }

    /// Our frame size: the peer's negotiated maximum message size.
    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    pub fn sender(&self) -> LinkSender {
        self.sender.clone()
    }

    pub async fn send(&self, message: Message) -> Result<(), LinkError> {
        self.sender.send(message).await
    }

    /// The next message from the peer (pings, pongs, probes and `Hello` are
    /// handled by the link). `Err` with the reason once the link is down and
    /// every message received before has been read.
    pub async fn recv(&mut self) -> Result<Message, LinkError> {
        match self.inbound.recv().await {
            Some(m) => Ok(m),
            None => Err(self.sender.closed_error()),
        }
    }

    /// The latest measurements.
    pub fn stats(&self) -> LinkStats {
        self.stats.borrow().clone()
    }

    /// A receiver that changes at every refresh of the measurements.
    pub fn stats_watch(&self) -> watch::Receiver<LinkStats> {
        self.stats.clone()
    }

    pub async fn probe(&self, bytes: usize) -> Result<f64, LinkError> {
        self.sender.probe(bytes).await
    }

    /// Why the link closed, once it has.
    pub fn close_reason(&self) -> Option<LinkError> {
        self.sender.closed.get()
    }

    /// Closes the link: queued messages go out first, then `Close`.
    pub fn close(&self, reason: &str) {
        let _ = self.control.send(Control::Close(reason.to_owned()));
    }
}

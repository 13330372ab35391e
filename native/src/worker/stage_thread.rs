//! The stage server on its own thread, and where its outputs go.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use cairn_engine::Device;
use cairn_engine::gguf::TensorSource;
use cairn_engine::model::Split;
use cairn_engine::model::shard::MAX_BATCH_SEQS;
use cairn_engine::protocol::{LinkReport, Message, Telemetry};
use cairn_engine::worker::{LoadPlan, Outgoing, ShardSlot, StageServer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tracing::{debug, warn};

use super::corrupt::CorruptTokens;
use super::lose_pass::LosePass;
use crate::link::{LinkSender, LinkStats};

mod overlap;

pub enum Job {
    /// A message from the coordinator.
    Coordinator(Message),
    /// A message from another worker's link: only `Forward`s from the stage
    /// before ours are served. The permit is one of that link's few places
    /// in the queue, given back once the stage has taken the message.
    Peer(String, Message, OwnedSemaphorePermit),
    /// A step this stage passed to itself (it is the only stage of a chain).
    Local(Message),
    /// Install what `plan` asks for, loading it from `src` unless the stage
    /// already holds it (answers `ShardLoaded` or `Error`).
    Install {
        src: Box<dyn TensorSource + Send>,
        plan: LoadPlan,
        reply: oneshot::Sender<Result<Message, String>>,
    },
    Telemetry(oneshot::Sender<Result<Telemetry, String>>),
    /// A pass in flight is over (`overlap.rs`).
    PassDone,
}

/// A link to another worker, as the stage thread sends on it.
struct PeerLink {
    sender: LinkSender,
    stats: watch::Receiver<LinkStats>,
    generation: u64,
}

/// Where a worker's messages go: its coordinator, and the workers it has
/// links to. Outputs go straight onto these links from the stage thread: a
/// step's output is on every token's critical path, and each task it passes
/// through on the way costs a thread wake-up.
#[derive(Default)]
pub struct Routes {
    /// Our peer id in the room now (a new one after a rejoin): a pass to it
    /// goes into our own queue.
    local_id: String,
    coordinator: Option<LinkSender>,
    peers: HashMap<String, PeerLink>,
    next_generation: u64,
}

impl Routes {
    pub fn set_local_id(&mut self, id: String) {
        self.local_id = id;
    }

    pub fn set_coordinator(&mut self, sender: LinkSender) {
        self.coordinator = Some(sender);
    }

    /// Registers a link to worker `peer`; the generation to drop it with.
    pub fn add_peer(
        &mut self,
        peer: String,
        sender: LinkSender,
        stats: watch::Receiver<LinkStats>,
    ) -> u64 {
        self.next_generation += 1;
        let generation = self.next_generation;
        self.peers.insert(
            peer,
            PeerLink {
                sender,
                stats,
                generation,
            },
        );
        generation
    }

    /// Forgets the link to `peer` if it is still the one of `generation`.
    pub fn drop_peer(&mut self, peer: &str, generation: u64) {
        if self
            .peers
            .get(peer)
            .is_some_and(|p| p.generation == generation)
        {
            self.peers.remove(peer);
        }
    }

    /// The links to other workers as telemetry reports them: round trip and
    /// throughput per peer, for the coordinator's link matrix.
    pub fn peer_stats(&self) -> BTreeMap<String, LinkReport> {
        self.peers
            .iter()
            .map(|(peer, l)| {
                let s = l.stats.borrow();
                (
                    peer.clone(),
                    LinkReport {
                        rtt_ms: s.rtt_smoothed.or(s.rtt).map(|d| d.as_secs_f64() * 1e3),
                        throughput_mb_s: s.throughput_bytes_per_s.map(|b| b / 1e6),
                    },
                )
            })
            .collect()
    }
}

pub type SharedRoutes = Arc<Mutex<Routes>>;

fn lock(routes: &SharedRoutes) -> std::sync::MutexGuard<'_, Routes> {
    routes.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Messages one other worker's link may have waiting for the stage thread.
/// The stage before ours has a step or two in flight per request, so this
/// leaves room for several requests while bounding what a peer can queue
/// (each message may be up to the wire's frame limit).
pub const PEER_QUEUE_PLACES: usize = 8;

#[derive(Clone)]
pub struct StageThread {
    jobs: mpsc::UnboundedSender<Job>,
}

/// What the stage thread works with besides its server.
struct Context {
    /// The stage's devices, each with the bytes it offers.
    devices: Vec<(Arc<Device>, u64)>,
    routes: SharedRoutes,
    jobs: mpsc::UnboundedSender<Job>,
    /// Tests, `dev-hooks` builds: loses a chosen pass to another worker.
    lose_pass: LosePass,
    /// Tests, `dev-hooks` builds: `CAIRN_DEBUG_FAIL_DEVICE=INDEX:PASS` fails device INDEX
    /// of a worker over several at its PASSth pass.
    #[cfg(feature = "dev-hooks")]
    fail_device: Option<(usize, u64)>,
    passes: std::cell::Cell<u64>,
    /// When the last batched pass finished sending its outputs (for the per-pass trace).
    last_pass_end: std::cell::Cell<Option<std::time::Instant>>,
    /// Told the index of a device that failed a pass; the thread stops serving then.
    failed: mpsc::UnboundedSender<usize>,
    /// Tests, `dev-hooks` builds: reports wrong tokens.
    corrupt: CorruptTokens,
    /// Whether the log has said that passes are in flight at once (`overlap.rs`, once).
    overlap_told: std::cell::Cell<bool>,
}

impl StageThread {
    /// `failed` hears of a device of the stage that failed a pass; the thread then stops,
    /// and the worker carries on over the others with a new stage thread.
    pub fn spawn(
        devices: Vec<(Arc<Device>, u64)>,
        local_id: String,
        routes: SharedRoutes,
        failed: mpsc::UnboundedSender<usize>,
        split: Split,
    ) -> std::io::Result<StageThread> {
        let (jobs, mut rx) = mpsc::unbounded_channel::<Job>();
        lock(&routes).set_local_id(local_id);
        let cx = Context {
            devices,
            routes,
            jobs: jobs.clone(),
            lose_pass: LosePass::from_env(),
            #[cfg(feature = "dev-hooks")]
            fail_device: std::env::var("CAIRN_DEBUG_FAIL_DEVICE").ok().and_then(|v| {
                let (i, n) = v.split_once(':')?;
                Some((i.parse().ok()?, n.parse().ok()?))
            }),
            passes: std::cell::Cell::new(0),
            last_pass_end: std::cell::Cell::new(None),
            failed,
            corrupt: CorruptTokens::from_env(),
            overlap_told: std::cell::Cell::new(false),
        };
        std::thread::Builder::new()
            .name("cairn-stage".into())
            .spawn(move || {
                let mut server = StageServer::with_devices(cx.devices.clone());
                server.set_split(split);
                let mut slot = ShardSlot::default();
                // A job taken off the queue while gathering a batch, served next.
                let mut held: Option<Job> = None;
                loop {
                    // While a long prompt is part-way through its prefill, only what has
                    // already arrived joins its next chunk's round; nothing is waited for.
                    let job = match held.take() {
                        Some(job) => Some(job),
                        None if server.has_partial() => rx.try_recv().ok(),
                        None => rx.blocking_recv(),
                    };
                    let Some(job) = job else {
                        if server.has_partial() && cx.serve_batch(&mut server, Vec::new()) {
                            continue;
                        }
                        break;
                    };
                    let job = match step_of(&server, job) {
                        // Several requests over a stage split by layers: passes in flight
                        // across steps (one request keeps the path below).
                        Taken::Step(m)
                            if server.overlap() > 1
                                && (server.requests_held() > 1 || !rx.is_empty()) =>
                        {
                            if cx.serve_overlapped(&mut server, &mut slot, &mut rx, m) {
                                continue;
                            }
                            break;
                        }
                        Taken::Step(m) => {
                            // Continuous batching: every step already waiting (other
                            // requests' next tokens) joins this pass; what arrives
                            // while it runs joins the next.
                            let mut batch = vec![m];
                            while batch.len() < MAX_BATCH_SEQS {
                                let Ok(next) = rx.try_recv() else { break };
                                match step_of(&server, next) {
                                    Taken::Step(m) => batch.push(m),
                                    Taken::Dropped => {}
                                    Taken::Other(job) => {
                                        held = Some(job);
                                        break;
                                    }
                                }
                            }
                            if cx.serve_batch(&mut server, batch) {
                                continue;
                            }
                            // A device failed: this stage is done; the worker goes on
                            // without it.
                            break;
                        }
                        Taken::Dropped => continue,
                        Taken::Other(job) => job,
                    };
                    cx.other(&mut server, &mut slot, job);
                }
            })?;
        Ok(StageThread { jobs })
    }

    pub fn send(&self, job: Job) {
        let _ = self.jobs.send(job);
    }

    /// Queues a message from another worker's link once that link has a
    /// place among its `places` (see [`PEER_QUEUE_PLACES`]): a worker that
    /// sends faster than the stage serves waits, and its link's reader with
    /// it, instead of filling this worker's memory.
    pub async fn send_from_peer(&self, places: &Arc<Semaphore>, peer: &str, m: Message) {
        // The semaphore is never closed.
        let Ok(place) = places.clone().acquire_owned().await else {
            return;
        };
        self.send(Job::Peer(peer.to_owned(), m, place));
    }

    /// Sends a job built around a reply channel and waits for the reply.
    pub async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, String>>) -> Job,
    ) -> Result<T, String> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx));
        rx.await
            .map_err(|_| "the stage thread has stopped".to_owned())?
    }
}

/// What a job is to the batching loop.
enum Taken {
    /// A step for this stage.
    Step(Message),
    /// A message from a worker that this stage does not take.
    Dropped,
    Other(Job),
}

fn step_of(server: &StageServer, job: Job) -> Taken {
    match job {
        Job::Coordinator(m @ Message::Forward { .. }) | Job::Local(m @ Message::Forward { .. }) => {
            Taken::Step(m)
        }
        // The permit goes back as the step leaves the queue.
        Job::Peer(peer, m, _place) => {
            if matches!(m, Message::Forward { .. }) && server.serves_forwards_from(&peer) {
                Taken::Step(m)
            } else {
                // Normal for a moment after a new placement (steps of the old chain still
                // in flight); anything else is a misbehaving peer.
                debug!(%peer, kind = m.kind(), "dropping a message from a worker that is not the stage before ours");
                Taken::Dropped
            }
        }
        other => Taken::Other(other),
    }
}

impl Context {
    /// A job that is not a step of the stage's.
    fn other(&self, server: &mut StageServer, slot: &mut ShardSlot, job: Job) {
        match job {
            Job::Coordinator(m) | Job::Local(m) | Job::Peer(_, m, _) => self.serve(server, m),
            Job::Install { src, plan, reply } => {
                let answer = match slot.reuse(server, &plan) {
                    Some(loaded) => loaded,
                    None => pollster::block_on(slot.load(server, plan, src.as_ref())),
                };
                drop(src);
                let _ = reply.send(Ok(answer));
            }
            Job::Telemetry(reply) => {
                let _ = reply.send(Ok(server.telemetry()));
            }
            // A pass already ended (its outputs are taken as soon as they are there).
            Job::PassDone => {}
        }
    }

    /// Counts a pass; `dev-hooks` builds fail a device at the pass `CAIRN_DEBUG_FAIL_DEVICE`
    /// names.
    fn count_pass(&self, server: &StageServer) {
        self.passes.set(self.passes.get() + 1);
        #[cfg(feature = "dev-hooks")]
        if let Some((index, at)) = self.fail_device
            && at == self.passes.get()
        {
            warn!(
                index,
                pass = at,
                "failing a device on purpose (CAIRN_DEBUG_FAIL_DEVICE)"
            );
            server.fail_device(index);
        }
        #[cfg(not(feature = "dev-hooks"))]
        let _ = server;
    }

    fn serve(&self, server: &mut StageServer, m: Message) {
        if let Some(out) = pollster::block_on(server.handle(m)) {
            self.dispatch(out);
        }
    }

    /// Runs one batched pass and sends its outputs on; false when a device of the stage
    /// failed it: the worker is told, and the pass's requests are left to the coordinator,
    /// which recovers them when this worker leaves (their error replies would only make it
    /// retry here first).
    fn serve_batch(&self, server: &mut StageServer, steps: Vec<Message>) -> bool {
        self.count_pass(server);
        let start = std::time::Instant::now();
        let seqs = steps.len();
        let outs = pollster::block_on(server.step_forwards(steps));
        if let Some(index) = server.take_failed_device() {
            warn!(index, "a device of this worker failed a pass");
            let _ = self.failed.send(index);
            return false;
        }
        let ran = std::time::Instant::now();
        for out in outs {
            self.dispatch(out);
        }
        let end = std::time::Instant::now();
        // Where a stage's time goes between passes (issue 19's busy share): waiting for
        // work since the last pass's outputs left, the pass, and sending its outputs.
        // `bench cluster --logs` with RUST_LOG=cairn_native::worker::stage_thread=debug.
        let idle_us = self
            .last_pass_end
            .replace(Some(end))
            .map(|prev| start.saturating_duration_since(prev).as_micros() as u64);
        debug!(
            seqs,
            idle_us,
            pass_us = (ran - start).as_micros() as u64,
            dispatch_us = (end - ran).as_micros() as u64,
            "pass"
        );
        true
    }

    /// Sends a stage's output on its way: to the next stage where we have a
    /// link to it, else to the coordinator, which relays it.
    fn dispatch(&self, out: Outgoing) {
        let mut pass = match out {
            Outgoing::Reply(m) => return self.to_coordinator(self.corrupt.message(m)),
            Outgoing::Pass(p) => p,
        };
        let note = pass.delivered();
        let to_self = lock(&self.routes).local_id == pass.to;
        if to_self {
            let forward = std::mem::replace(&mut pass.forward, Message::Resume);
            let _ = self.jobs.send(Job::Local(forward));
        } else {
            let link = lock(&self.routes)
                .peers
                .get(&pass.to)
                .map(|l| l.sender.clone());
            let Some(link) = link else {
                debug!(peer = %pass.to, "no link to the next stage yet; the coordinator relays");
                return self.to_coordinator(self.corrupt.message(pass.undelivered()));
            };
            let forward = std::mem::replace(&mut pass.forward, Message::Resume);
            if self.lose_pass.lose_this() {
                tracing::warn!(peer = %pass.to, "losing this pass on purpose (CAIRN_DEBUG_LOSE_PASS)");
                return;
            }
            if let Err((back, e)) = pollster::block_on(link.send_or_return(forward)) {
                debug!(peer = %pass.to, error = %e, "the link to the next stage is down; the coordinator relays");
                pass.forward = back;
                return self.to_coordinator(self.corrupt.message(pass.undelivered()));
            }
        }
        if let Some(note) = note {
            self.to_coordinator(self.corrupt.message(note));
        }
    }

    fn to_coordinator(&self, m: Message) {
        let link = lock(&self.routes).coordinator.clone();
        match link {
            // Waits only while the link's send queue is full; an error means
            // the link is gone, which its reader notices.
            Some(link) => {
                let _ = pollster::block_on(link.send(m));
            }
            None => debug!(kind = m.kind(), "no coordinator to tell"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A peer that sends faster than the stage takes its messages waits at
    /// `PEER_QUEUE_PLACES` queued, and goes on as the stage takes one.
    #[tokio::test]
    async fn a_peer_waits_once_its_places_in_the_queue_are_full() {
        let (jobs, mut taken) = mpsc::unbounded_channel();
        let stage = StageThread { jobs };
        let places = Arc::new(Semaphore::new(PEER_QUEUE_PLACES));
        let ping = |nonce| Message::Ping { nonce, sent_us: 0 };
        for n in 0..PEER_QUEUE_PLACES as u64 {
            stage.send_from_peer(&places, "p", ping(n)).await;
        }
        let next = stage.send_from_peer(&places, "p", ping(99));
        tokio::pin!(next);
        assert!(
            tokio::time::timeout(Duration::from_millis(100), next.as_mut())
                .await
                .is_err(),
            "a message past the peer's places was queued"
        );
        // The stage takes one (its permit goes with it): the waiting message goes in.
        drop(taken.recv().await);
        tokio::time::timeout(Duration::from_secs(5), next)
            .await
            .expect("queued once a place was free");
        let mut queued = 0;
        while let Ok(job) = taken.try_recv() {
            assert!(matches!(job, Job::Peer(ref p, _, _) if p == "p"));
            queued += 1;
        }
        assert_eq!(queued, PEER_QUEUE_PLACES);
    }
}

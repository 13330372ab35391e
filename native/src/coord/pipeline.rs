//! The shell around a request's core ([`Request`]): it feeds the core what
//! the cluster looks like, what the stages answer and the time, and carries
//! out what the core asks (send a step, stream a token, take a worker out
//! of service). The rules themselves live in `core::request`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cairn_engine::kernels::SampleParams;
use cairn_engine::protocol::Message;
use cairn_signal::protocol::PeerId;
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use super::core::{
    Admission, Admit, ClusterView, Count, Input, Output, Request, RequestConfig, SpotCheck, Verdict,
};
use super::state::{Active, RequestView};
use super::{Pending, Shared, StageReply};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenRequest {
    /// For logs and the dashboard (the API's completion id).
    pub label: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sample: SampleParams,
    /// Generate `max_tokens` whatever tokens come (end-of-generation ones are
    /// then streamed like any other).
    pub ignore_eos: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token (not passed on as text).
    Stop,
    Length,
}

/// What a request's stream carries.
#[derive(Debug)]
pub enum GenEvent {
    Token(u32),
    Done {
        reason: FinishReason,
        recoveries: u32,
    },
    Failed(String),
}

#[derive(Default)]
pub struct Metrics {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    pub completed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub recoveries: AtomicU64,
    pub in_flight: AtomicU64,
    /// Requests turned away because the queue was full (or cancelled while queued).
    pub refused: AtomicU64,
    /// Requests that had to wait for a place.
    pub queued: AtomicU64,
    /// Hops the coordinator relayed (activations or a token it sent on).
    pub relayed: AtomicU64,
    /// Tokens the last stage handed straight to the first stage.
    pub passed_on: AtomicU64,
    /// Spot checks that found the workers' token right (or near a tie).
    pub spot_right: AtomicU64,
    /// Spot checks that found it wrong (its workers evicted).
    pub spot_wrong: AtomicU64,
    /// Spot checks the trusted device could not run.
    pub spot_unchecked: AtomicU64,
    /// Generated tokens with the time they came, for the live rate.
    pub recent: std::sync::Mutex<std::collections::VecDeque<std::time::Instant>>,
}

impl Metrics {
    fn token(&self) {
        self.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let now = std::time::Instant::now();
        let mut r = self
            .recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        r.push_back(now);
        while r
            .front()
            .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(5))
        {
            r.pop_front();
        }
    }

    /// Tokens per second over the last few seconds, all requests together.
    pub fn tokens_per_s(&self) -> f64 {
        let now = std::time::Instant::now();
        let r = self
            .recent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = r
            .iter()
            .filter(|t| now.duration_since(**t) <= Duration::from_secs(5))
            .count();
        n as f64 / 5.0
    }
}

/// Requests waiting beyond the running ones, per place (`--parallel`): past this the
/// API answers 503 at once rather than holding unbounded work.
const QUEUE_PER_PLACE: usize = 32;

/// The admission queue ([`Admission`]) with the waiting requests' wake-ups.
pub struct Queue {
    inner: std::sync::Mutex<(Admission, HashMap<u64, oneshot::Sender<()>>)>,
}

impl Queue {
    pub fn new(parallel: usize) -> Queue {
        let parallel = parallel.max(1);
        Queue {
            inner: std::sync::Mutex::new((
                Admission::new(parallel, parallel * QUEUE_PER_PLACE),
                HashMap::new(),
            )),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Admission, HashMap<u64, oneshot::Sender<()>>)> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// (running, queued, the oldest wait, the mean wait of the last starts, places).
    pub fn snapshot(&self) -> QueueView {
        let g = self.lock();
        QueueView {
            running: g.0.running(),
            queued: g.0.queued(),
            oldest_wait: g.0.oldest_wait(Instant::now()),
            mean_wait: g.0.mean_recent_wait(),
            parallel: g.0.parallel(),
        }
    }

    /// Waits for `id`'s turn; `Err` with the reason when the queue is full or the client
    /// went away while it waited. The place is given back when the returned guard drops.
    async fn admit(
        &self,
        id: u64,
        tx: &mpsc::Sender<GenEvent>,
        on_queued: impl FnOnce(),
    ) -> Result<Place<'_>, String> {
        let wait = {
            let mut g = self.lock();
            match g.0.arrive(id, Instant::now()) {
                Admit::Run => None,
                Admit::Queued { .. } => {
                    let (wake, woken) = oneshot::channel();
                    g.1.insert(id, wake);
                    Some(woken)
                }
                Admit::Refused { queued } => {
                    return Err(format!(
                        "the cluster is busy: {} requests run and {queued} wait; try again shortly",
                        g.0.running()
                    ));
                }
            }
        };
        let place = Place { queue: self, id };
        if let Some(woken) = wait {
            on_queued();
            tokio::select! {
                r = woken => r.map_err(|_| "the queue was dropped".to_owned())?,
                // The client went away while waiting: `place` leaves the queue.
                _ = tx.closed() => return Err("cancelled while waiting".into()),
            }
        }
        Ok(place)
    }

    fn leave(&self, id: u64) {
        let mut g = self.lock();
        let (adm, wakes) = &mut *g;
        wakes.remove(&id);
        for next in adm.leave(id, Instant::now()) {
            if let Some(w) = wakes.remove(&next) {
                let _ = w.send(());
            }
        }
    }
}

/// What the queue looks like now (dashboard and metrics).
#[derive(Debug, Clone, Copy)]
pub struct QueueView {
    pub running: usize,
    pub queued: usize,
    pub oldest_wait: Duration,
    pub mean_wait: Duration,
    pub parallel: usize,
}

/// A request's place among the running ones (or in the queue); given back on drop.
struct Place<'a> {
    queue: &'a Queue,
    id: u64,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.queue.leave(self.id);
    }
}

/// Starts generating; events arrive on the returned channel. Dropping the
/// receiver cancels the request.
pub fn start(shared: Arc<Shared>, req: GenRequest) -> mpsc::Receiver<GenEvent> {
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let id = shared.request_id();
        let label = req.label.clone();
        let place = shared
            .queue
            .admit(id, &tx, || {
                shared.state().requests.insert(
                    id,
                    RequestView {
                        id: req.label.clone(),
                        state: "queued",
                        generated: 0,
                        max_tokens: req.max_tokens,
                        recoveries: 0,
                    },
                );
                shared.metrics.queued.fetch_add(1, Ordering::Relaxed);
                shared.touch();
            })
            .await;
        let _place = match place {
            Ok(p) => p,
            Err(msg) => {
                shared.state().requests.remove(&id);
                shared.touch();
                shared.metrics.refused.fetch_add(1, Ordering::Relaxed);
                let _ = tx.send(GenEvent::Failed(msg)).await;
                return;
            }
        };
        shared.metrics.requests.fetch_add(1, Ordering::Relaxed);
        shared.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        shared
            .metrics
            .prompt_tokens
            .fetch_add(req.prompt.len() as u64, Ordering::Relaxed);
        shared.state().requests.insert(
            id,
            RequestView {
                id: req.label.clone(),
                state: "waiting",
                generated: 0,
                max_tokens: req.max_tokens,
                recoveries: 0,
            },
        );
        let result = drive(&shared, id, req, &tx).await;
        shared.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        shared.state().requests.remove(&id);
        shared.touch();
        match result {
            Ok((reason, recoveries)) => {
                shared.metrics.completed.fetch_add(1, Ordering::Relaxed);
                let _ = tx.send(GenEvent::Done { reason, recoveries }).await;
            }
            Err(msg) => {
                warn!(request = %label, %msg, "request failed");
                shared.metrics.failed.fetch_add(1, Ordering::Relaxed);
                let _ = tx.send(GenEvent::Failed(msg)).await;
            }
        }
    });
    rx
}

fn set_state(shared: &Shared, id: u64, state: &'static str, generated: usize, recoveries: u32) {
    if let Some(r) = shared.state().requests.get_mut(&id) {
        r.state = state;
        r.generated = generated;
        r.recoveries = recoveries;
    }
}

/// The cluster as the core sees it, and the placement with its links.
fn cluster_view(shared: &Shared) -> (ClusterView, Option<Active>) {
    let st = shared.state();
    let view = ClusterView {
        active: st.active.as_ref().map(|a| a.view(st.prediction.as_ref())),
        online: st
            .peers
            .iter()
            .filter(|(_, p)| p.online)
            .map(|(id, _)| id.clone())
            .collect(),
        message: st.message.clone(),
        trusted: st
            .peers
            .keys()
            .filter(|id| shared.trusted(id))
            .cloned()
            .collect(),
    };
    (view, st.active.clone())
}

/// Why the shell woke.
enum Wake {
    Input(Input),
    Timer,
    /// The cluster changed.
    Changed,
}

/// A request's core with what its shell keeps beside it: every placement
/// it has seen (a stage's link is the shell's of that stage's generation)
/// and its entry in `Shared::pending`.
struct Driver<'a> {
    shared: &'a Shared,
    id: u64,
    core: Request,
    placements: HashMap<u64, Active>,
    events: mpsc::UnboundedSender<(PeerId, u32, StageReply)>,
    /// Spot checks' verdicts, by step.
    checks: mpsc::UnboundedSender<(u32, Verdict)>,
    /// For the spot checks' tasks, which outlive a borrow.
    owner: Arc<Shared>,
    /// The spot checks' tasks this request started: once they are over, the trusted
    /// device forgets the request (it keeps each checked request's keys and values).
    check_tasks: Vec<tokio::task::JoinHandle<()>>,
    checked: bool,
    registered: Option<u32>,
}

impl Driver<'_> {
    /// Gives the core the cluster as it is now.
    fn refresh(&mut self, now: Instant) {
        let (view, active) = cluster_view(self.shared);
        if let Some(a) = active {
            self.placements.entry(a.epoch).or_insert(a);
        }
        self.core.handle(Input::Cluster(view), now);
        self.register();
    }

    /// Gives the core the cluster as it is now, then what happened (the
    /// rules that weigh a stage's answer look at the placement too).
    fn feed(&mut self, wake: Wake) {
        let now = Instant::now();
        self.refresh(now);
        match wake {
            Wake::Input(input) => self.core.handle(input, now),
            Wake::Timer => self.core.handle_timeout(now),
            Wake::Changed => {}
        }
        self.register();
    }

    /// Keeps the run's entry in `pending` current, so what its stages say
    /// reaches it (before any step of it is sent).
    fn register(&mut self) {
        let seq = self.core.run().map(|(seq, _)| seq);
        if seq == self.registered {
            return;
        }
        self.registered = seq;
        let mut pending = self
            .shared
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match self.core.run() {
            Some((seq, peers)) => {
                pending.insert(
                    self.id,
                    Pending {
                        seq,
                        peers,
                        events: self.events.clone(),
                    },
                );
            }
            None => {
                pending.remove(&self.id);
            }
        }
    }

    /// Carries out what the core asks until it asks nothing more; the
    /// request's result once it is over.
    async fn carry_out(
        &mut self,
        tx: &mpsc::Sender<GenEvent>,
    ) -> Option<Result<(FinishReason, u32), String>> {
        let m = &self.shared.metrics;
        while let Some(output) = self.core.poll_output() {
            match output {
                Output::Send { epoch, peer, msg } => {
                    let step = matches!(msg, Message::Forward { .. });
                    let sender = self
                        .placements
                        .get(&epoch)
                        .and_then(|a| a.stages.iter().find(|s| s.peer == peer))
                        .and_then(|s| self.shared.sender(&peer, s.generation));
                    let sent = match sender {
                        Some(s) => s.send(msg).await.map_err(|e| e.to_string()),
                        None => Err("no link to it".into()),
                    };
                    if let Err(error) = sent
                        && step
                    {
                        self.feed(Wake::Input(Input::SendFailed { peer, error }));
                    }
                }
                Output::Token(t) => {
                    if tx.send(GenEvent::Token(t)).await.is_err() {
                        self.feed(Wake::Input(Input::Cancel));
                    }
                }
                Output::Status {
                    state,
                    generated,
                    recoveries,
                } => {
                    set_state(self.shared, self.id, state, generated, recoveries);
                    if state == "waiting" {
                        self.shared.touch();
                    }
                }
                Output::Count(c) => match c {
                    Count::Generated => m.token(),
                    Count::Relayed => {
                        m.relayed.fetch_add(1, Ordering::Relaxed);
                    }
                    Count::PassedOn => {
                        m.passed_on.fetch_add(1, Ordering::Relaxed);
                    }
                    Count::Recovery => {
                        m.recoveries.fetch_add(1, Ordering::Relaxed);
                    }
                },
                Output::Blame { peer, why } => self.shared.peer_lost(&peer, &why),
                Output::Check(check) => self.spot_check(check),
                Output::Prefetch { request, context } => self.prefetch(request, context),
                Output::Evict { peers, why } => {
                    for peer in &peers {
                        self.shared.evict(peer, &why);
                    }
                }
                Output::Finished(result) => return Some(result),
            }
        }
        None
    }
}

impl Driver<'_> {
    /// Recomputes a held step on the trusted device, off the async threads;
    /// the verdict comes back through `checks`.
    fn spot_check(&mut self, check: SpotCheck) {
        let step = check.step;
        let tx = self.checks.clone();
        let Some(verifier) = self.shared.verifier.clone() else {
            let _ = tx.send((step, Verdict::Unchecked("spot checks are off".into())));
            return;
        };
        let shared = self.owner.clone();
        self.checked = true;
        self.check_tasks.retain(|t| !t.is_finished());
        self.check_tasks.push(tokio::spawn(async move {
            let verdict = tokio::task::spawn_blocking(move || verifier.check(&check))
                .await
                .unwrap_or_else(|e| Verdict::Unchecked(format!("the check stopped: {e}")));
            let counter = match &verdict {
                Verdict::Right => &shared.metrics.spot_right,
                Verdict::Wrong(_) => &shared.metrics.spot_wrong,
                Verdict::Unchecked(_) => &shared.metrics.spot_unchecked,
            };
            counter.fetch_add(1, Ordering::Relaxed);
            let _ = tx.send((step, verdict));
        }));
    }
}

impl Driver<'_> {
    /// Has the trusted device compute `context` of `request` ahead of a check, off the
    /// async threads; nothing comes back (a failure leaves the check to compute it).
    fn prefetch(&mut self, request: u64, context: Vec<u32>) {
        let Some(verifier) = self.shared.verifier.clone() else {
            return;
        };
        self.checked = true;
        self.check_tasks.retain(|t| !t.is_finished());
        self.check_tasks.push(tokio::spawn(async move {
            let _ = tokio::task::spawn_blocking(move || verifier.prefetch(request, &context)).await;
        }));
    }
}

impl Drop for Driver<'_> {
    fn drop(&mut self) {
        // A request that was checked: the trusted device drops what it keeps of it once
        // its checks under way are over (one finishing later would keep it again).
        if let Some(verifier) = self.shared.verifier.clone()
            && self.checked
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let tasks = std::mem::take(&mut self.check_tasks);
            let id = self.id;
            rt.spawn(async move {
                for t in tasks {
                    let _ = t.await;
                }
                let _ = tokio::task::spawn_blocking(move || verifier.forget(id)).await;
            });
        }
        if self.registered.is_some() {
            self.shared
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&self.id);
        }
    }
}

/// Runs a request's core until it is over.
async fn drive(
    shared: &Arc<Shared>,
    id: u64,
    req: GenRequest,
    tx: &mpsc::Sender<GenEvent>,
) -> Result<(FinishReason, u32), String> {
    let cfg = RequestConfig {
        id,
        wait_timeout: shared.opts.wait_timeout,
        step_timeout: shared.opts.step_timeout,
        end_ids: shared.model.tokenizer.end_of_generation_ids(),
        spot: shared.opts.spot,
    };
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let (checks_tx, mut checks) = mpsc::unbounded_channel();
    let mut changes = shared.subscribe();
    let mut d = Driver {
        shared,
        id,
        core: Request::new(cfg, req, Instant::now()),
        placements: HashMap::new(),
        events: events_tx,
        checks: checks_tx,
        owner: shared.clone(),
        check_tasks: Vec::new(),
        checked: false,
        registered: None,
    };
    // The core's first view decides whether it runs at once or waits.
    d.refresh(Instant::now());
    loop {
        if let Some(result) = d.carry_out(tx).await {
            return result;
        }
        let wake = d.core.poll_timeout().map(tokio::time::Instant::from_std);
        let wake = tokio::select! {
            e = events.recv() => match e {
                Some((from, seq, reply)) => Wake::Input(Input::Reply { from, seq, reply }),
                None => Wake::Input(Input::Cancel),
            },
            Some((step, verdict)) = checks.recv() => Wake::Input(Input::Checked { step, verdict }),
            changed = changes.changed() => {
                if changed.is_err() {
                    return Err("the coordinator stopped".into());
                }
                Wake::Changed
            }
            () = sleep_until(wake) => Wake::Timer,
            () = tx.closed() => Wake::Input(Input::Cancel),
        };
        d.feed(wake);
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

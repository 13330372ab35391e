//! Running one request through the stages, token by token, and carrying it
//! across placement changes and lost workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cairn_engine::kernels::SampleParams;
use cairn_engine::protocol::{Chain, DType, LayerRange, Message, Tensor};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::state::{Active, RequestView};
use super::{Pending, Shared, StageFailure, is_request_fault};

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
    /// Hops the coordinator relayed (activations or a token it sent on).
    pub relayed: AtomicU64,
    /// Tokens the last stage handed straight to the first stage.
    pub passed_on: AtomicU64,
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

/// How a run of a request ended, when the request does not end with it.
enum RunEnd {
    /// The request is done.
    Finished(FinishReason),
    /// A worker went away: wait for a new placement and rebuild.
    Lost(String),
    /// A stage failed the step but is still there: rebuild and try again.
    Retry(String),
    /// The placement changed under the run: rebuild on the new one.
    Replaced,
    /// Nothing came for too long and it is unknown where the run stopped:
    /// go on with every step through the coordinator, which can tell which
    /// stage does not answer.
    Stalled,
    /// The request cannot go on.
    Fatal(String),
}

/// Failed steps retried on the same placement before the request fails.
const MAX_RETRIES: u32 = 3;

/// The least time a chained run may go without news before it counts as
/// stalled; more when steps are slow (see `stall_after`).
const MIN_STALL: Duration = Duration::from_secs(5);

/// Starts generating; events arrive on the returned channel. Dropping the
/// receiver cancels the request at its next token.
pub fn start(shared: Arc<Shared>, req: GenRequest) -> mpsc::Receiver<GenEvent> {
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let id = shared.request_id();
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
        let result = run(&shared, id, &req, &tx).await;
        shared.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        shared.state().requests.remove(&id);
        shared.touch();
        match result {
            Ok((reason, recoveries)) => {
                shared.metrics.completed.fetch_add(1, Ordering::Relaxed);
                let _ = tx.send(GenEvent::Done { reason, recoveries }).await;
            }
            Err(msg) => {
                warn!(request = %req.label, %msg, "request failed");
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

/// What a request has produced so far and how to go on.
struct Progress<'a> {
    req: &'a GenRequest,
    id: u64,
    tx: &'a mpsc::Sender<GenEvent>,
    out: Vec<u32>,
    recoveries: u32,
    /// Steps go through the coordinator one stage at a time (after a stall).
    relay_all: bool,
}

async fn run(
    shared: &Arc<Shared>,
    id: u64,
    req: &GenRequest,
    tx: &mpsc::Sender<GenEvent>,
) -> Result<(FinishReason, u32), String> {
    let mut p = Progress {
        req,
        id,
        tx,
        out: Vec::new(),
        recoveries: 0,
        relay_all: false,
    };
    let mut seq = 0u32;
    let mut retries = 0u32;
    let mut min_epoch = 0;
    let mut placements: Vec<Active> = Vec::new();
    let result = loop {
        if p.out.len() >= req.max_tokens {
            break Ok(FinishReason::Length);
        }
        if tx.is_closed() {
            break Err("the client went away".into());
        }
        let active = match wait_active(shared, min_epoch, id).await {
            Ok(a) => a,
            Err(e) => break Err(e),
        };
        if !placements.iter().any(|a| a.epoch == active.epoch) {
            placements.push(active.clone());
        }
        if !p.out.is_empty() {
            info!(request = %req.label, epoch = active.epoch, tokens = p.out.len(), "rebuilding the caches on a new run");
        }
        seq += 1;
        match run_once(shared, &active, seq, &mut p).await {
            RunEnd::Finished(reason) => break Ok(reason),
            RunEnd::Lost(why) => {
                warn!(request = %req.label, %why, "a stage was lost mid-request; waiting for a new placement");
                p.recoveries += 1;
                shared.metrics.recoveries.fetch_add(1, Ordering::Relaxed);
                let placement_stands = {
                    let st = shared.state();
                    st.active.as_ref().is_some_and(|a| a.epoch == active.epoch)
                        && active
                            .stages
                            .iter()
                            .all(|s| st.peers.get(&s.peer).is_some_and(|p| p.online))
                };
                if placement_stands {
                    // A link was replaced under the run; the placement still holds.
                    retries += 1;
                    if retries > MAX_RETRIES {
                        break Err(format!("a stage kept failing: {why}"));
                    }
                } else {
                    min_epoch = active.epoch + 1;
                }
                set_state(shared, id, "recovering", p.out.len(), p.recoveries);
            }
            RunEnd::Retry(why) => {
                retries += 1;
                if retries > MAX_RETRIES {
                    break Err(format!("a stage kept failing: {why}"));
                }
                warn!(request = %req.label, %why, "a stage failed a step; rebuilding and retrying");
            }
            RunEnd::Replaced => {
                info!(request = %req.label, epoch = active.epoch, "the placement changed under the request");
                min_epoch = active.epoch + 1;
            }
            RunEnd::Stalled => {
                warn!(request = %req.label, tokens = p.out.len(), "no word from the chain; going on through the coordinator");
                p.relay_all = true;
            }
            RunEnd::Fatal(msg) => break Err(msg),
        }
    };
    // Every placement the request ran on may hold a cache of it.
    let mut told = std::collections::HashSet::new();
    for active in &placements {
        for s in &active.stages {
            if told.insert(s.peer.clone()) {
                let _ = s.sender.send(Message::EndRequest { request: id }).await;
            }
        }
    }
    result.map(|r| (r, p.recoveries))
}

/// The active placement of epoch `min_epoch` or later; waits for one up to
/// the configured timeout.
async fn wait_active(shared: &Shared, min_epoch: u64, id: u64) -> Result<Active, String> {
    let mut changes = shared.subscribe();
    let deadline = tokio::time::Instant::now() + shared.opts.wait_timeout;
    let mut waited = false;
    loop {
        let (active, message) = {
            let st = shared.state();
            (
                st.active.clone().filter(|a| a.epoch >= min_epoch),
                st.message.clone(),
            )
        };
        if let Some(a) = active {
            return Ok(a);
        }
        if !waited {
            waited = true;
            if let Some(r) = shared.state().requests.get_mut(&id) {
                r.state = "waiting";
            }
            shared.touch();
        }
        if tokio::time::timeout_at(deadline, changes.changed())
            .await
            .is_err()
        {
            return Err(format!(
                "no placement could serve this request within {:?}: {message}",
                shared.opts.wait_timeout
            ));
        }
    }
}

/// Registers a run, so what its stages say reaches it; unregisters on drop.
struct RunGuard<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for RunGuard<'_> {
    fn drop(&mut self) {
        self.shared
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.id);
    }
}

/// Why the placement a run was on is no longer the active one: one of its
/// workers was lost (the loss drops the placement before it fails the run,
/// so the change may be seen first), or a new placement was chosen.
fn moved_or_lost(shared: &Shared, active: &Active) -> RunEnd {
    match gone(shared, active) {
        Some(peer) => RunEnd::Lost(format!("{peer} is gone")),
        None => RunEnd::Replaced,
    }
}

/// A worker of `active` that is no longer online, if any.
fn gone(shared: &Shared, active: &Active) -> Option<cairn_signal::protocol::PeerId> {
    let st = shared.state();
    active
        .stages
        .iter()
        .find(|s| !st.peers.get(&s.peer).is_some_and(|p| p.online))
        .map(|s| s.peer.clone())
}

/// How long a chained run may go without news: several times the slowest
/// token so far, and never less than [`MIN_STALL`].
fn stall_after(slowest: Duration, step_timeout: Duration) -> Duration {
    (slowest * 20).max(MIN_STALL).min(step_timeout)
}

/// One run of a request on `active`: prompt and tokens so far from
/// position 0 (filling every stage's cache afresh), then token after token
/// until the request is done or the run breaks.
async fn run_once(shared: &Shared, active: &Active, seq: u32, p: &mut Progress<'_>) -> RunEnd {
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let _guard = RunGuard { shared, id: p.id };
    shared
        .pending
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(
            p.id,
            Pending {
                seq,
                peers: active.stages.iter().map(|s| s.peer.clone()).collect(),
                events: events_tx,
            },
        );
    // A loss noticed before the run was registered would never fail it.
    if let Some(peer) = gone(shared, active) {
        return RunEnd::Lost(format!("{peer} is gone"));
    }
    let mut changes = shared.subscribe();
    let req = p.req;
    let prompt_len = req.prompt.len();
    let max_len = (prompt_len + req.max_tokens) as u32;
    let chain = (!p.relay_all).then(|| Chain {
        max_steps: req.max_tokens as u32,
        // Peers refuse longer lists; the coordinator's own stop rule holds
        // whatever the last stage misses (it then makes a token or two more).
        end_ids: if req.ignore_eos {
            Vec::new()
        } else {
            let mut ids = shared.model.tokenizer.end_of_generation_ids();
            ids.truncate(Chain::MAX_END_IDS);
            ids
        },
    });
    let sample = |step: usize| SampleParams {
        step: step as u32,
        ..req.sample
    };
    let forward = |stage: usize, pos0: usize, step: usize, tensor: Tensor| {
        let s = &active.stages[stage];
        Message::Forward {
            request: p.id,
            seq,
            layers: LayerRange {
                start: s.start as u32,
                end: s.end as u32,
            },
            pos0: pos0 as u32,
            max_len,
            sample: Some(sample(step)),
            chain: chain.clone(),
            tensor,
        }
    };
    let last = active.stages.len() - 1;
    let mut all = req.prompt.clone();
    all.extend_from_slice(&p.out);
    set_state(
        shared,
        p.id,
        if p.out.is_empty() {
            "prefill"
        } else {
            "recovering"
        },
        p.out.len(),
        p.recoveries,
    );
    let tokens = match Tensor::from_values(DType::U32, vec![all.len() as u64], &all) {
        Ok(t) => t,
        Err(e) => return RunEnd::Fatal(e.to_string()),
    };
    // The stage that has to answer next, when the coordinator knows it: the
    // one a step went to, unless that one hands its output straight on
    // (the last stage always reports its token).
    let relay_all = p.relay_all;
    let answers = |i: usize| (relay_all || !active.stages[i].direct || i == last).then_some(i);
    let mut waiting_on = answers(0);
    if let Err(e) = active.stages[0]
        .sender
        .send(forward(0, 0, p.out.len(), tokens))
        .await
    {
        return RunEnd::Lost(format!("{}: {e}", active.stages[0].peer));
    }
    let mut last_news = tokio::time::Instant::now();
    let mut slowest = Duration::ZERO;
    let mut run_tokens = 0usize;
    loop {
        // The first token of a run waits out a whole prefill.
        let limit = if run_tokens == 0 || waiting_on.is_some() {
            shared.opts.step_timeout
        } else {
            stall_after(slowest, shared.opts.step_timeout)
        };
        let event = tokio::select! {
            e = events.recv() => e,
            changed = changes.changed() => {
                let current = shared.state().active.as_ref().map(|a| a.epoch);
                if changed.is_err() || current != Some(active.epoch) {
                    return moved_or_lost(shared, active);
                }
                continue;
            }
            _ = tokio::time::sleep_until(last_news + limit) => {
                return match waiting_on {
                    Some(i) => {
                        let peer = &active.stages[i].peer;
                        // A stage this slow is as good as lost: take it out of service.
                        shared.peer_lost(peer, "a step timed out");
                        RunEnd::Lost(format!("{peer} did not answer within {limit:?}"))
                    }
                    None => RunEnd::Stalled,
                };
            }
        };
        let Some((from, reply)) = event else {
            return RunEnd::Lost("the coordinator dropped the run".into());
        };
        let now = tokio::time::Instant::now();
        let stage = active.stages.iter().position(|s| s.peer == from);
        match reply {
            Ok(Message::Activations { pos0, tensor, .. }) => {
                let Some(i) = stage.filter(|&i| i < last) else {
                    return RunEnd::Fatal(format!("{from} sent activations out of turn"));
                };
                shared.metrics.relayed.fetch_add(1, Ordering::Relaxed);
                let next = &active.stages[i + 1];
                if let Err(e) = next
                    .sender
                    .send(forward(i + 1, pos0 as usize, p.out.len(), tensor))
                    .await
                {
                    return RunEnd::Lost(format!("{}: {e}", next.peer));
                }
                waiting_on = answers(i + 1);
            }
            Ok(Message::Token {
                step,
                id: token,
                passed_on,
                ..
            }) => {
                if stage != Some(last) || step as usize != p.out.len() {
                    return RunEnd::Fatal(format!(
                        "{from} sent the token of step {step} where step {} of the last stage was due",
                        p.out.len()
                    ));
                }
                if run_tokens > 0 {
                    slowest = slowest.max(now - last_news);
                }
                run_tokens += 1;
                p.out.push(token);
                shared.metrics.token();
                if passed_on {
                    shared.metrics.passed_on.fetch_add(1, Ordering::Relaxed);
                }
                set_state(shared, p.id, "decoding", p.out.len(), p.recoveries);
                let eog = !req.ignore_eos && shared.model.tokenizer.is_end_of_generation(token);
                if eog {
                    return RunEnd::Finished(FinishReason::Stop);
                }
                if p.tx.send(GenEvent::Token(token)).await.is_err() {
                    return RunEnd::Fatal("the client went away".into());
                }
                if p.out.len() >= req.max_tokens {
                    return RunEnd::Finished(FinishReason::Length);
                }
                if passed_on {
                    waiting_on = answers(0);
                } else {
                    // The last stage could not hand it to the first: the coordinator does.
                    shared.metrics.relayed.fetch_add(1, Ordering::Relaxed);
                    let Ok(t) = Tensor::from_values(DType::U32, vec![1], &[token]) else {
                        return RunEnd::Fatal("cannot wrap a token".into());
                    };
                    let pos0 = prompt_len + p.out.len() - 1;
                    if let Err(e) = active.stages[0]
                        .sender
                        .send(forward(0, pos0, p.out.len(), t))
                        .await
                    {
                        return RunEnd::Lost(format!("{}: {e}", active.stages[0].peer));
                    }
                    waiting_on = answers(0);
                }
            }
            Ok(other) => {
                return RunEnd::Fatal(format!("{from} answered a step with {}", other.kind()));
            }
            Err(StageFailure::Lost(why)) => return RunEnd::Lost(why),
            Err(StageFailure::Refused { code, text }) => {
                if shared.state().active.as_ref().map(|a| a.epoch) != Some(active.epoch) {
                    // The placement moved and took the caches with it.
                    return moved_or_lost(shared, active);
                }
                return if is_request_fault(code) {
                    RunEnd::Fatal(format!("{from}: {text}"))
                } else {
                    // Out of memory or an internal failure on that worker.
                    RunEnd::Retry(format!("{from} failed the step: {text}"))
                };
            }
        }
        last_news = now;
    }
}

//! Running one request through the stages, token by token, and carrying it
//! across placement changes and lost workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cairn_engine::kernels::SampleParams;
use cairn_engine::protocol::{DType, LayerRange, Message, Tensor};
use tokio::sync::{mpsc, oneshot};
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

enum StepError {
    /// A worker went away: wait for a new placement and rebuild.
    Lost(String),
    /// A stage failed the step but is still there: rebuild and try again.
    Retry(String),
    /// The request cannot go on.
    Fatal(String),
}

/// Failed steps retried on the same placement before the request fails.
const MAX_RETRIES: u32 = 3;

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

async fn run(
    shared: &Arc<Shared>,
    id: u64,
    req: &GenRequest,
    tx: &mpsc::Sender<GenEvent>,
) -> Result<(FinishReason, u32), String> {
    let max_len = (req.prompt.len() + req.max_tokens) as u32;
    let mut out: Vec<u32> = Vec::new();
    let mut seq = 0u32;
    // The epoch whose KV caches hold this request's positions so far.
    let mut cached_epoch: Option<u64> = None;
    let mut recoveries = 0u32;
    let mut retries = 0u32;
    let mut min_epoch = 0;
    let mut last_active: Option<Active> = None;
    let result = loop {
        if out.len() >= req.max_tokens {
            break Ok(FinishReason::Length);
        }
        if tx.is_closed() {
            break Err("the client went away".into());
        }
        let active = wait_active(shared, min_epoch, id).await?;
        let (input, pos0) = if cached_epoch == Some(active.epoch) {
            let last = *out.last().ok_or("no token to continue from")?;
            (vec![last], (req.prompt.len() + out.len() - 1) as u32)
        } else {
            if !out.is_empty() {
                info!(request = %req.label, epoch = active.epoch, tokens = out.len(), "rebuilding the caches on a new placement");
            }
            let mut all = req.prompt.clone();
            all.extend_from_slice(&out);
            (all, 0)
        };
        set_state(
            shared,
            id,
            if pos0 == 0 && out.is_empty() {
                "prefill"
            } else if pos0 == 0 {
                "recovering"
            } else {
                "decoding"
            },
            out.len(),
            recoveries,
        );
        let mut params = req.sample;
        params.step = out.len() as u32;
        match step(shared, &active, id, &mut seq, pos0, max_len, &input, params).await {
            Ok(token) => {
                cached_epoch = Some(active.epoch);
                last_active = Some(active);
                out.push(token);
                shared.metrics.token();
                let eog = !req.ignore_eos && shared.model.tokenizer.is_end_of_generation(token);
                if !eog && tx.send(GenEvent::Token(token)).await.is_err() {
                    break Err("the client went away".into());
                }
                if eog {
                    break Ok(FinishReason::Stop);
                }
            }
            Err(StepError::Lost(why)) => {
                warn!(request = %req.label, %why, "a stage was lost mid-request; waiting for a new placement");
                recoveries += 1;
                shared.metrics.recoveries.fetch_add(1, Ordering::Relaxed);
                cached_epoch = None;
                let placement_stands = {
                    let st = shared.state();
                    st.active.as_ref().is_some_and(|a| a.epoch == active.epoch)
                        && active
                            .stages
                            .iter()
                            .all(|s| st.peers.get(&s.peer).is_some_and(|p| p.online))
                };
                if placement_stands {
                    // A link was replaced under the step; the placement still holds.
                    retries += 1;
                    if retries > MAX_RETRIES {
                        break Err(format!("a stage kept failing: {why}"));
                    }
                } else {
                    min_epoch = active.epoch + 1;
                }
                set_state(shared, id, "recovering", out.len(), recoveries);
            }
            Err(StepError::Retry(why)) => {
                retries += 1;
                if retries > MAX_RETRIES {
                    break Err(format!("a stage kept failing: {why}"));
                }
                warn!(request = %req.label, %why, "a stage failed a step; rebuilding and retrying");
                cached_epoch = None;
            }
            Err(StepError::Fatal(msg)) => break Err(msg),
        }
    };
    if let Some(active) = last_active {
        for s in &active.stages {
            let _ = s.sender.send(Message::EndRequest { request: id }).await;
        }
    }
    result.map(|r| (r, recoveries))
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

/// One token: the input through every stage in order.
#[allow(clippy::too_many_arguments)]
async fn step(
    shared: &Shared,
    active: &Active,
    id: u64,
    seq: &mut u32,
    pos0: u32,
    max_len: u32,
    input: &[u32],
    params: SampleParams,
) -> Result<u32, StepError> {
    let fatal = |e: cairn_engine::protocol::ProtocolError| StepError::Fatal(e.to_string());
    let mut tensor =
        Tensor::from_values(DType::U32, vec![input.len() as u64], input).map_err(fatal)?;
    let last = active.stages.len() - 1;
    for (i, stage) in active.stages.iter().enumerate() {
        *seq += 1;
        let (reply_tx, reply_rx) = oneshot::channel();
        shared
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(
                id,
                Pending {
                    seq: *seq,
                    peer: stage.peer.clone(),
                    reply: reply_tx,
                },
            );
        // A loss noticed before the step was registered would never fail it.
        let online = shared
            .state()
            .peers
            .get(&stage.peer)
            .is_some_and(|p| p.online);
        if !online {
            shared
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&id);
            return Err(StepError::Lost(format!("{} is gone", stage.peer)));
        }
        let msg = Message::Forward {
            request: id,
            seq: *seq,
            layers: LayerRange {
                start: stage.start as u32,
                end: stage.end as u32,
            },
            pos0,
            max_len,
            sample: (i == last).then_some(params),
            tensor,
        };
        let sent = std::time::Instant::now();
        if let Err(e) = stage.sender.send(msg).await {
            shared
                .pending
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&id);
            return Err(StepError::Lost(format!("{}: {e}", stage.peer)));
        }
        let reply = match tokio::time::timeout(shared.opts.step_timeout, reply_rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(StageFailure::Lost(
                "the coordinator dropped the step".into(),
            )),
            Err(_) => {
                shared
                    .pending
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .remove(&id);
                // A stage this slow is as good as lost: take it out of service.
                shared.peer_lost(&stage.peer, "a step timed out");
                Err(StageFailure::Lost(format!(
                    "{} did not answer within {:?}",
                    stage.peer, shared.opts.step_timeout
                )))
            }
        };
        if reply.is_ok() && input.len() == 1 {
            let ms = sent.elapsed().as_secs_f64() * 1e3;
            if let Some(p) = shared.state().peers.get_mut(&stage.peer) {
                p.step_ms = Some(p.step_ms.map_or(ms, |s| 0.8 * s + 0.2 * ms));
            }
        }
        match reply {
            Ok(Message::Activations { tensor: t, .. }) if i < last => tensor = t,
            Ok(Message::Token { id: token, .. }) if i == last => return Ok(token),
            Ok(other) => {
                return Err(StepError::Fatal(format!(
                    "{} answered a step with {}",
                    stage.peer,
                    other.kind()
                )));
            }
            Err(StageFailure::Lost(why)) => return Err(StepError::Lost(why)),
            Err(StageFailure::Refused { code, text }) => {
                return Err(if is_request_fault(code) {
                    StepError::Fatal(format!("{}: {text}", stage.peer))
                } else {
                    // Out of memory or an internal failure on that worker.
                    StepError::Retry(format!("{} failed the step: {text}", stage.peer))
                });
            }
        }
    }
    Err(StepError::Fatal("the placement has no stages".into()))
}

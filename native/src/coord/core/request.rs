//! One request, from admission to its last token, as a state machine: it
//! waits for a placement, runs the prompt and the tokens so far through the
//! stages (a "run", numbered by `seq`), streams tokens, and when a run
//! breaks (a lost worker, a refused step, a new placement, a stall) starts
//! another from position 0 on whatever placement serves then, so the output
//! is the one an unbroken run would give.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use cairn_engine::kernels::SampleParams;
use cairn_engine::protocol::{Chain, DType, LayerRange, Message, Tensor};
use cairn_signal::protocol::PeerId;
use tracing::{info, warn};

use super::spot::{self, SpotCheck, SpotConfig, Verdict};
use super::view::{ClusterView, Placement, StepCost};
use crate::coord::pipeline::{FinishReason, GenRequest};
use crate::coord::{StageFailure, StageReply, is_request_fault};

/// Failed steps retried on the same placement before the request fails.
pub const MAX_RETRIES: u32 = 3;

/// The least time a chained run may go without news before it counts as
/// stalled; more when steps are slow (see [`stall_after`]).
pub const MIN_STALL: Duration = Duration::from_secs(5);

/// A stage that takes this many times its predicted step time to answer
/// counts as lost: calibration is measured on an idle device, and a step
/// may wait behind other requests' steps in a batch.
pub const STEP_MARGIN: u32 = 30;
/// The least time a stage is given to answer a step, however fast its
/// calibration says it is (a busy machine, a queue of others' steps).
pub const MIN_STEP: Duration = Duration::from_secs(15);

/// What a request needs to know besides what it generates.
#[derive(Clone, Debug)]
pub struct RequestConfig {
    /// The request's id on the wire.
    pub id: u64,
    /// How long it waits for a placement before it fails.
    pub wait_timeout: Duration,
    /// The longest one stage may take to answer one step; less when the
    /// placement's calibration predicts fast steps ([`step_limit`]).
    pub step_timeout: Duration,
    /// The model's end-of-generation ids, sorted.
    pub end_ids: Vec<u32>,
    /// Which steps are recomputed on a trusted device before they go out.
    pub spot: SpotConfig,
}

/// What happens to a request.
#[derive(Debug)]
pub enum Input {
    /// The cluster as it is now (the shell gives one before every other
    /// input, so the rules below always see the present).
    Cluster(ClusterView),
    /// A stage of run `seq` answered (or is known lost).
    Reply {
        from: PeerId,
        seq: u32,
        reply: StageReply,
    },
    /// A message to `peer` could not be sent.
    SendFailed { peer: PeerId, error: String },
    /// The client stopped listening.
    Cancel,
    /// What the trusted device found for the [`Output::Check`] of `step`.
    Checked { step: u32, verdict: Verdict },
}

/// Counters the shell keeps for `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    /// A token was generated (streamed or not).
    Generated,
    /// The coordinator carried a hop between stages.
    Relayed,
    /// The last stage fed a token straight to the first.
    PassedOn,
    /// A run was rebuilt after a lost worker.
    Recovery,
}

/// What the shell must do for a request.
#[derive(Debug)]
pub enum Output {
    /// Send `msg` to `peer` over the link of placement `epoch`.
    Send {
        epoch: u64,
        peer: PeerId,
        msg: Message,
    },
    /// Stream a token to the client.
    Token(u32),
    /// The request's state for the dashboard.
    Status {
        state: &'static str,
        generated: usize,
        recoveries: u32,
    },
    Count(Count),
    /// `peer` did not answer a step in time: take it out of service.
    Blame {
        peer: PeerId,
        why: String,
    },
    /// Recompute this step on a trusted device and answer with
    /// [`Input::Checked`]; the step's token and every later one are held
    /// back until then.
    Check(SpotCheck),
    /// A step of request `request` will be checked on this run: the trusted device may
    /// compute `context` (the prompt and tokens so far) now, while the workers do, so
    /// that check runs only what comes after. Nothing answers it.
    Prefetch {
        request: u64,
        context: Vec<u32>,
    },
    /// `peers` gave a wrong token: take them out of the cluster for good.
    Evict {
        peers: Vec<PeerId>,
        why: String,
    },
    /// The request is over (after the `EndRequest`s to every stage it ran on).
    Finished(Result<(FinishReason, u32), String>),
}

/// How a run of a request ended, when the request does not end with it.
#[derive(Debug, PartialEq, Eq)]
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

/// A run in progress on one placement.
#[derive(Debug)]
struct Run {
    placement: Placement,
    seq: u32,
    /// The stage that has to answer next, when the coordinator knows it.
    waiting_on: Option<usize>,
    last_news: Instant,
    slowest: Duration,
    tokens: usize,
    /// Positions the run's first step computes (the prompt and the tokens
    /// generated before it).
    rows: usize,
}

#[derive(Debug)]
enum Phase {
    /// Waiting for a placement of epoch `Request::min_epoch` or later.
    Waiting {
        deadline: Instant,
        /// Whether the dashboard has been told.
        shown: bool,
    },
    Running(Run),
    /// The run is over but a held token's check has not come back.
    Verifying(FinishReason),
    Done,
}

/// A spot check under way: the step, and whom a wrong token blames.
#[derive(Debug)]
struct Held {
    step: u32,
    epoch: u64,
    suspects: Vec<PeerId>,
}

pub struct Request {
    cfg: RequestConfig,
    req: GenRequest,
    view: ClusterView,
    phase: Phase,
    out: Vec<u32>,
    /// How many of `out` the client has.
    emitted: usize,
    /// The check that holds tokens back, if one is under way.
    held: Option<Held>,
    seq: u32,
    retries: u32,
    recoveries: u32,
    /// Steps go through the coordinator one stage at a time (after a stall).
    relay_all: bool,
    min_epoch: u64,
    /// Every placement a run went to (each may hold a cache of the request).
    ran_on: Vec<Placement>,
    /// The trusted device was asked to compute the prompt ahead of a check.
    prefetched: bool,
    queue: VecDeque<Output>,
}

impl Request {
    /// A request admitted at `now`; it waits for a placement until the
    /// first [`Input::Cluster`] shows one.
    pub fn new(cfg: RequestConfig, req: GenRequest, now: Instant) -> Request {
        let deadline = now + cfg.wait_timeout;
        Request {
            cfg,
            req,
            view: ClusterView::default(),
            phase: Phase::Waiting {
                deadline,
                shown: false,
            },
            out: Vec::new(),
            emitted: 0,
            held: None,
            seq: 0,
            retries: 0,
            recoveries: 0,
            relay_all: false,
            min_epoch: 0,
            ran_on: Vec::new(),
            prefetched: false,
            queue: VecDeque::new(),
        }
    }

    pub fn handle(&mut self, input: Input, now: Instant) {
        match input {
            Input::Cluster(view) => {
                self.view = view;
                self.on_cluster(now);
            }
            Input::Reply { from, seq, reply } => self.on_reply(from, seq, reply, now),
            Input::SendFailed { peer, error } => {
                if matches!(self.phase, Phase::Running(_)) {
                    self.end_run(RunEnd::Lost(format!("{peer}: {error}")), now);
                }
            }
            Input::Cancel => {
                if !matches!(self.phase, Phase::Done) {
                    // Steps queued for the stages are moot now.
                    self.queue.retain(|o| !matches!(o, Output::Send { .. }));
                    self.finish(Err("the client went away".into()));
                }
            }
            Input::Checked { step, verdict } => self.on_checked(step, verdict, now),
        }
    }

    /// What to do next, in order.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.queue.pop_front()
    }

    /// When [`Self::handle_timeout`] is due, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match &self.phase {
            Phase::Waiting { deadline, .. } => Some(*deadline),
            Phase::Running(run) => Some(run.last_news + self.limit(run)),
            // The shell answers every check.
            Phase::Verifying(_) | Phase::Done => None,
        }
    }

    pub fn handle_timeout(&mut self, now: Instant) {
        match &self.phase {
            Phase::Waiting { deadline, .. } if now >= *deadline => {
                let msg = format!(
                    "no placement could serve this request within {:?}: {}",
                    self.cfg.wait_timeout, self.view.message
                );
                self.finish(Err(msg));
            }
            Phase::Running(run) => {
                let limit = self.limit(run);
                if now < run.last_news + limit {
                    return;
                }
                let end = match run.waiting_on {
                    Some(i) => {
                        let peer = run.placement.stages[i].peer.clone();
                        // A stage this slow is as good as lost: take it out of service.
                        self.view.online.remove(&peer);
                        if self.view.epoch() == Some(run.placement.epoch) {
                            self.view.active = None;
                        }
                        let why = format!("{peer} did not answer within {limit:?}");
                        self.queue.push_back(Output::Blame {
                            peer,
                            why: "a step timed out".into(),
                        });
                        RunEnd::Lost(why)
                    }
                    None => RunEnd::Stalled,
                };
                self.end_run(end, now);
            }
            _ => {}
        }
    }

    #[cfg(test)]
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// The run in progress: its `seq` and the workers whose answers it takes.
    pub fn run(&self) -> Option<(u32, Vec<PeerId>)> {
        match &self.phase {
            Phase::Running(run) => Some((
                run.seq,
                run.placement
                    .stages
                    .iter()
                    .map(|s| s.peer.clone())
                    .collect(),
            )),
            _ => None,
        }
    }

    #[cfg(test)]
    pub fn recoveries(&self) -> u32 {
        self.recoveries
    }

    #[cfg(test)]
    pub fn relay_all(&self) -> bool {
        self.relay_all
    }

    /// How long the run may go without news: a step's limit while a known
    /// stage must answer (or the prompt is running), scaled with the
    /// placement's calibration and the step's size and never under the
    /// stall limit of the tokens measured so far; else the stall limit.
    fn limit(&self, run: &Run) -> Duration {
        let cost = run.placement.cost;
        if run.tokens == 0 {
            step_limit(cost, run.rows, self.cfg.step_timeout)
        } else if run.waiting_on.is_some() {
            step_limit(cost, 1, self.cfg.step_timeout)
                .max(stall_after(run.slowest, self.cfg.step_timeout))
        } else {
            stall_after(run.slowest, self.cfg.step_timeout)
        }
    }

    fn status(&mut self, state: &'static str) {
        self.queue.push_back(Output::Status {
            state,
            generated: self.out.len(),
            recoveries: self.recoveries,
        });
    }

    fn on_cluster(&mut self, now: Instant) {
        match &self.phase {
            Phase::Waiting { .. } => self.try_start(now),
            Phase::Running(run) => {
                if self.view.epoch() != Some(run.placement.epoch) {
                    let end = self.moved_or_lost(&run.placement);
                    self.end_run(end, now);
                }
            }
            Phase::Verifying(_) | Phase::Done => {}
        }
    }

    /// Why the placement a run was on is no longer the active one: one of
    /// its workers was lost, or a new placement was chosen.
    fn moved_or_lost(&self, placement: &Placement) -> RunEnd {
        match self.view.gone(placement) {
            Some(peer) => RunEnd::Lost(format!("{peer} is gone")),
            None => RunEnd::Replaced,
        }
    }

    /// Starts a run if a placement recent enough serves; else waits.
    fn try_start(&mut self, now: Instant) {
        if self.out.len() >= self.req.max_tokens {
            self.finish(Ok(FinishReason::Length));
            return;
        }
        let Some(placement) = self
            .view
            .active
            .clone()
            .filter(|a| a.epoch >= self.min_epoch)
        else {
            if let Phase::Waiting { shown, .. } = &mut self.phase
                && !*shown
            {
                *shown = true;
                self.status("waiting");
            }
            return;
        };
        if !self.ran_on.iter().any(|a| a.epoch == placement.epoch) {
            self.ran_on.push(placement.clone());
        }
        if !self.out.is_empty() {
            info!(request = %self.req.label, epoch = placement.epoch, tokens = self.out.len(), "rebuilding the caches on a new run");
        }
        self.seq += 1;
        let seq = self.seq;
        let waiting_on = answers(&placement, self.relay_all, 0);
        let epoch = placement.epoch;
        let first = placement.stages[0].peer.clone();
        self.phase = Phase::Running(Run {
            placement,
            seq,
            waiting_on,
            last_news: now,
            slowest: Duration::ZERO,
            tokens: 0,
            rows: 0,
        });
        // A loss seen before the run started would never fail it.
        if let Phase::Running(run) = &self.phase
            && let Some(peer) = self.view.gone(&run.placement)
        {
            let end = RunEnd::Lost(format!("{peer} is gone"));
            self.end_run(end, now);
            return;
        }
        self.status(if self.out.is_empty() {
            "prefill"
        } else {
            "recovering"
        });
        let mut all = self.req.prompt.clone();
        all.extend_from_slice(&self.out);
        if let Phase::Running(run) = &mut self.phase {
            run.rows = all.len();
        }
        self.prefetch(&all);
        let tokens = match Tensor::from_values(DType::U32, vec![all.len() as u64], &all) {
            Ok(t) => t,
            Err(e) => {
                self.end_run(RunEnd::Fatal(e.to_string()), now);
                return;
            }
        };
        let msg = self.forward(0, 0, tokens);
        self.queue.push_back(Output::Send {
            epoch,
            peer: first,
            msg,
        });
    }

    /// The `Forward` of the current run to stage `stage`.
    fn forward(&self, stage: usize, pos0: usize, tensor: Tensor) -> Message {
        let Phase::Running(run) = &self.phase else {
            unreachable!("a step is only built for a run in progress")
        };
        let s = &run.placement.stages[stage];
        let req = &self.req;
        let chain = (!self.relay_all).then(|| Chain {
            max_steps: req.max_tokens as u32,
            // Peers refuse longer lists; the coordinator's own stop rule holds
            // whatever the last stage misses (it then makes a token or two more).
            end_ids: if req.ignore_eos {
                Vec::new()
            } else {
                let mut ids = self.cfg.end_ids.clone();
                ids.truncate(Chain::MAX_END_IDS);
                ids
            },
        });
        Message::Forward {
            request: self.cfg.id,
            seq: run.seq,
            layers: LayerRange {
                start: s.start as u32,
                end: s.end as u32,
            },
            pos0: pos0 as u32,
            max_len: (req.prompt.len() + req.max_tokens) as u32,
            sample: Some(SampleParams {
                step: self.out.len() as u32,
                ..req.sample
            }),
            chain,
            tensor,
        }
    }

    fn on_reply(&mut self, from: PeerId, seq: u32, reply: StageReply, now: Instant) {
        let Phase::Running(run) = &self.phase else {
            return;
        };
        let Some(stage) = run.placement.stages.iter().position(|s| s.peer == from) else {
            return;
        };
        if seq != run.seq {
            // An answer of a run given up on.
            return;
        }
        let epoch = run.placement.epoch;
        let last = run.placement.stages.len() - 1;
        let end = match reply {
            Ok(Message::Activations { pos0, tensor, .. }) => {
                if stage >= last {
                    Some(RunEnd::Fatal(format!(
                        "{from} sent activations out of turn"
                    )))
                } else {
                    self.queue.push_back(Output::Count(Count::Relayed));
                    let msg = self.forward(stage + 1, pos0 as usize, tensor);
                    let next = run.placement.stages[stage + 1].peer.clone();
                    let waiting_on = answers(&run.placement, self.relay_all, stage + 1);
                    self.queue.push_back(Output::Send {
                        epoch,
                        peer: next,
                        msg,
                    });
                    self.set_waiting_on(waiting_on);
                    None
                }
            }
            Ok(Message::Token {
                step,
                id: token,
                passed_on,
                ..
            }) => self.on_token(&from, stage, step, token, passed_on, now),
            Ok(other) => Some(RunEnd::Fatal(format!(
                "{from} answered a step with {}",
                other.kind()
            ))),
            Err(StageFailure::Lost(why)) => Some(RunEnd::Lost(why)),
            Err(StageFailure::Refused { code, text }) => {
                Some(if self.view.epoch() != Some(epoch) {
                    // The placement moved and took the caches with it.
                    self.moved_or_lost(&run.placement)
                } else if is_request_fault(code) {
                    RunEnd::Fatal(format!("{from}: {text}"))
                } else {
                    // Out of memory or an internal failure on that worker.
                    RunEnd::Retry(format!("{from} failed the step: {text}"))
                })
            }
        };
        match end {
            Some(end) => self.end_run(end, now),
            None => {
                if let Phase::Running(run) = &mut self.phase {
                    run.last_news = now;
                }
            }
        }
    }

    fn set_waiting_on(&mut self, waiting_on: Option<usize>) {
        if let Phase::Running(run) = &mut self.phase {
            run.waiting_on = waiting_on;
        }
    }

    fn on_token(
        &mut self,
        from: &PeerId,
        stage: usize,
        step: u32,
        token: u32,
        passed_on: bool,
        now: Instant,
    ) -> Option<RunEnd> {
        let Phase::Running(run) = &mut self.phase else {
            return None;
        };
        let last = run.placement.stages.len() - 1;
        if stage != last || step as usize != self.out.len() {
            return Some(RunEnd::Fatal(format!(
                "{from} sent the token of step {step} where step {} of the last stage was due",
                self.out.len()
            )));
        }
        if run.tokens > 0 {
            run.slowest = run.slowest.max(now - run.last_news);
        }
        run.tokens += 1;
        let epoch = run.placement.epoch;
        let first = run.placement.stages[0].peer.clone();
        let waiting_on = answers(&run.placement, self.relay_all, 0);
        let check = (self.held.is_none() && self.cfg.spot.chosen(self.cfg.id, step))
            .then(|| spot::suspects(&run.placement, &self.view.trusted))
            .filter(|s| !s.is_empty());
        if let Some(suspects) = check {
            let mut context = self.req.prompt.clone();
            context.extend_from_slice(&self.out);
            self.held = Some(Held {
                step,
                epoch,
                suspects: suspects.clone(),
            });
            self.queue.push_back(Output::Check(SpotCheck {
                request: self.cfg.id,
                step,
                context,
                claimed: token,
                sample: SampleParams {
                    step,
                    ..self.req.sample
                },
                epoch,
                suspects,
            }));
        }
        self.out.push(token);
        self.queue.push_back(Output::Count(Count::Generated));
        if passed_on {
            self.queue.push_back(Output::Count(Count::PassedOn));
        }
        self.status("decoding");
        if !self.req.ignore_eos && self.cfg.end_ids.binary_search(&token).is_ok() {
            return Some(RunEnd::Finished(FinishReason::Stop));
        }
        self.release();
        if self.out.len() >= self.req.max_tokens {
            return Some(RunEnd::Finished(FinishReason::Length));
        }
        if !passed_on {
            // The last stage could not hand it to the first: the coordinator does.
            self.queue.push_back(Output::Count(Count::Relayed));
            let Ok(t) = Tensor::from_values(DType::U32, vec![1], &[token]) else {
                return Some(RunEnd::Fatal("cannot wrap a token".into()));
            };
            let pos0 = self.req.prompt.len() + self.out.len() - 1;
            let msg = self.forward(0, pos0, t);
            self.queue.push_back(Output::Send {
                epoch,
                peer: first,
                msg,
            });
        }
        self.set_waiting_on(waiting_on);
        None
    }

    /// Once per request, on the first run whose placement has untrusted stages, when a
    /// step still to come will be checked (the choice is the coordinator's keyed hash, so
    /// it is known here and nowhere else): the trusted device may compute `context` now.
    fn prefetch(&mut self, context: &[u32]) {
        /// The steps looked ahead for a check: past this a prompt computed now is likely
        /// given back (the trusted pool is bounded) before its check comes.
        const LOOK_AHEAD: usize = 1 << 16;
        let Phase::Running(run) = &self.phase else {
            return;
        };
        if self.prefetched
            || self.cfg.spot.rate <= 0.0
            || spot::suspects(&run.placement, &self.view.trusted).is_empty()
        {
            return;
        }
        let from = self.out.len();
        let to = self.req.max_tokens.min(from + LOOK_AHEAD);
        let id = self.cfg.id;
        if (from..to).any(|s| self.cfg.spot.chosen(id, s as u32)) {
            self.prefetched = true;
            self.queue.push_back(Output::Prefetch {
                request: id,
                context: context.to_vec(),
            });
        }
    }

    /// What follows a run's end: the request's end, or another run.
    fn end_run(&mut self, end: RunEnd, now: Instant) {
        let Phase::Running(run) = std::mem::replace(&mut self.phase, Phase::Done) else {
            return;
        };
        let label = self.req.label.clone();
        match end {
            RunEnd::Finished(reason) if self.held.is_some() => {
                self.phase = Phase::Verifying(reason);
                self.status("verifying");
                return;
            }
            RunEnd::Finished(reason) => return self.finish(Ok(reason)),
            RunEnd::Fatal(msg) => return self.finish(Err(msg)),
            RunEnd::Lost(why) => {
                warn!(request = %label, %why, "a stage was lost mid-request; waiting for a new placement");
                self.recoveries += 1;
                self.queue.push_back(Output::Count(Count::Recovery));
                let placement_stands = self.view.epoch() == Some(run.placement.epoch)
                    && self.view.gone(&run.placement).is_none();
                if placement_stands {
                    // A link was replaced under the run; the placement still holds.
                    self.retries += 1;
                    if self.retries > MAX_RETRIES {
                        return self.finish(Err(format!("a stage kept failing: {why}")));
                    }
                } else {
                    self.min_epoch = run.placement.epoch + 1;
                }
                self.status("recovering");
            }
            RunEnd::Retry(why) => {
                self.retries += 1;
                if self.retries > MAX_RETRIES {
                    return self.finish(Err(format!("a stage kept failing: {why}")));
                }
                warn!(request = %label, %why, "a stage failed a step; rebuilding and retrying");
            }
            RunEnd::Replaced => {
                info!(request = %label, epoch = run.placement.epoch, "the placement changed under the request");
                self.min_epoch = run.placement.epoch + 1;
            }
            RunEnd::Stalled => {
                warn!(request = %label, tokens = self.out.len(), "no word from the chain; going on through the coordinator");
                self.relay_all = true;
            }
        }
        self.phase = Phase::Waiting {
            deadline: now + self.cfg.wait_timeout,
            shown: false,
        };
        self.try_start(now);
    }

    /// Sends the client the tokens it does not have yet, unless a check
    /// holds them (an end-of-generation token never goes out).
    fn release(&mut self) {
        if self.held.is_some() {
            return;
        }
        let mut upto = self.out.len();
        if !self.req.ignore_eos
            && self
                .out
                .last()
                .is_some_and(|t| self.cfg.end_ids.binary_search(t).is_ok())
        {
            upto -= 1;
        }
        for &t in &self.out[self.emitted.min(upto)..upto] {
            self.queue.push_back(Output::Token(t));
        }
        self.emitted = self.emitted.max(upto);
    }

    /// A spot check came back: the held tokens go out, or the wrong one and
    /// all after it are dropped, its placement's untrusted workers evicted,
    /// and the request goes on from before it on another placement.
    fn on_checked(&mut self, step: u32, verdict: Verdict, now: Instant) {
        if self.held.as_ref().is_none_or(|h| h.step != step) || matches!(self.phase, Phase::Done) {
            return;
        }
        let Some(held) = self.held.take() else {
            return;
        };
        let why = match verdict {
            Verdict::Right => None,
            Verdict::Unchecked(why) => {
                warn!(request = %self.req.label, step, %why, "a spot check could not run; the token goes out");
                None
            }
            Verdict::Wrong(why) => Some(why),
        };
        let Some(why) = why else {
            self.release();
            if let Phase::Verifying(reason) = self.phase {
                self.finish(Ok(reason));
            }
            return;
        };
        let peers = held
            .suspects
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        warn!(request = %self.req.label, step, %why, %peers, "a spot check found a wrong token; evicting and recovering");
        self.out.truncate(step as usize);
        for p in &held.suspects {
            self.view.online.remove(p);
        }
        if self.view.epoch() == Some(held.epoch) {
            self.view.active = None;
        }
        self.min_epoch = self.min_epoch.max(held.epoch + 1);
        self.queue.push_back(Output::Evict {
            peers: held.suspects,
            why: format!("a spot check of step {step} found a wrong token: {why}"),
        });
        match self.phase {
            Phase::Running(_) => self.end_run(RunEnd::Lost(why), now),
            Phase::Verifying(_) => {
                self.recoveries += 1;
                self.queue.push_back(Output::Count(Count::Recovery));
                self.status("recovering");
                self.phase = Phase::Waiting {
                    deadline: now + self.cfg.wait_timeout,
                    shown: false,
                };
                self.try_start(now);
            }
            Phase::Waiting { .. } => self.try_start(now),
            Phase::Done => {}
        }
    }

    /// Ends the request: every worker it ran on forgets it, then the
    /// client hears how it went.
    fn finish(&mut self, result: Result<FinishReason, String>) {
        self.phase = Phase::Done;
        let mut told = BTreeSet::new();
        for placement in &self.ran_on {
            for s in &placement.stages {
                if told.insert(s.peer.clone()) {
                    self.queue.push_back(Output::Send {
                        epoch: placement.epoch,
                        peer: s.peer.clone(),
                        msg: Message::EndRequest {
                            request: self.cfg.id,
                        },
                    });
                }
            }
        }
        self.queue
            .push_back(Output::Finished(result.map(|r| (r, self.recoveries))));
    }
}

/// The stage that must answer after a step went to stage `i`, when the
/// coordinator knows it: that stage, unless it hands its output straight on
/// (the last stage always reports its token).
fn answers(placement: &Placement, relay_all: bool, i: usize) -> Option<usize> {
    let last = placement.stages.len() - 1;
    (relay_all || !placement.stages[i].direct || i == last).then_some(i)
}

/// How long a stage may take to answer a step over `rows` positions:
/// [`STEP_MARGIN`] times what the placement's calibration predicts, at
/// least [`MIN_STEP`], at most `step_timeout` (all of it when nothing was
/// predicted). A silent worker then holds a small model's request for
/// seconds, not minutes, while a slow device's long prompt keeps its time.
pub fn step_limit(cost: Option<StepCost>, rows: usize, step_timeout: Duration) -> Duration {
    match cost {
        Some(c) => c
            .step(rows)
            .saturating_mul(STEP_MARGIN)
            .max(MIN_STEP)
            .min(step_timeout),
        None => step_timeout,
    }
}

/// How long a chained run may go without news: several times the slowest
/// token so far, and never less than [`MIN_STALL`].
pub fn stall_after(slowest: Duration, step_timeout: Duration) -> Duration {
    (slowest * 20).max(MIN_STALL).min(step_timeout)
}

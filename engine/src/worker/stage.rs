use std::collections::HashMap;
use std::sync::Arc;

use web_time::Instant;

use crate::backend::Device;
use crate::gguf::TensorSource;
use crate::kernels::SampleParams;
use crate::model::shard::MAX_BATCH_SEQS;
use crate::model::shard::{DEFAULT_MAX_BATCH, max_batch_for};
use crate::model::{
    ModelError, Shard, ShardInput, ShardOutput, ShardStack, Split, StackItem, StackPool, StackSeq,
    Want,
};
use crate::protocol::{
    Chain, DType, Hop, KvReport, LayerRange, Message, Telemetry, Tensor, error_code,
};

/// Most requests with a live KV cache at once; more are refused (`OVERLOADED`)
/// rather than growing memory without bound.
pub const MAX_REQUESTS: usize = 64;

/// A worker's serving state: its shard, where its output goes, and each
/// request's share of the stage's key/value pool.
pub struct StageServer {
    /// The devices the stage's layers are split over (one for most workers), each with the
    /// bytes it offers (the split's weights).
    devices: Vec<(Arc<Device>, u64)>,
    /// How a stage over several devices spreads its layers over them.
    split: Split,
    /// Shared with the threads of passes in flight ([`Self::begin_forwards`]).
    shard: Option<Shared<ShardStack>>,
    route: Route,
    caches: HashMap<u64, Entry>,
    /// Made on the first step after a shard is installed.
    pool: Option<StackPool>,
    /// The pool's budget in bytes; `None`: from the device's free memory.
    kv_budget: Option<u64>,
    /// Sequences run by the window's forward passes (their mean is the batch size).
    window_seqs: u64,
    started: Instant,
    /// Forward calls and the seconds they took since the last telemetry.
    window_calls: u32,
    window_busy_s: f64,
    /// Every window's passes, seconds and sequences together (`Telemetry::busy_total_s`).
    busy_total_s: f64,
    passes_total: u64,
    seqs_total: u64,
    window_tokens: u64,
    /// Every token row run since the stage was made (a browser shows it to its owner).
    tokens_total: u64,
    window_start: Instant,
    last_kernel_ms: f64,
    /// A device of a stage over several that failed a pass (its index in `devices`),
    /// until the worker takes note ([`Self::take_failed_device`]).
    failed_device: Option<usize>,
    /// Prompts part-way through their prefill: each round runs the next chunk of each.
    partial: Vec<Ready>,
    /// Passes running on threads of their own ([`Self::begin_forwards`]), oldest first.
    #[cfg(not(target_arch = "wasm32"))]
    flights: Vec<Flight>,
    /// Requests ended while a pass of theirs was in flight: their blocks go back when it
    /// ends.
    ended: std::collections::HashSet<u64>,
    /// Passes in flight across steps where the stage is split by layers
    /// (`CAIRN_STAGE_OVERLAP=on`, [`Self::set_overlap`]).
    #[cfg(not(target_arch = "wasm32"))]
    overlap: bool,
}

/// A round whose pass runs on a thread of its own: its requests, and where the round comes
/// back with the pass's outputs and seconds.
#[cfg(not(target_arch = "wasm32"))]
struct Flight {
    requests: Vec<u64>,
    result: std::sync::mpsc::Receiver<(Round, PassResult, f64)>,
}

/// The stage's shard, shared with the threads of passes in flight; a browser has no threads
/// (and its devices are not `Send`).
#[cfg(not(target_arch = "wasm32"))]
type Shared<T> = Arc<T>;
#[cfg(target_arch = "wasm32")]
type Shared<T> = std::rc::Rc<T>;

/// Rows of one prompt run in one round: a longer prompt goes on in the next rounds, so the
/// steps of other requests that arrive meanwhile join them instead of waiting for it all.
/// A stage whose shard takes more rows in one pass (cuda: [`crate::model::shard::CUDA_MAX_BATCH`]) takes that many.
pub const PREFILL_CHUNK: usize = DEFAULT_MAX_BATCH;

/// One request's blocks in the pool and the run (`Forward::seq`) that filled them.
struct Entry {
    kv: StackSeq,
    seq: u32,
}

/// A `Forward` checked and decoded, ready to join a batch.
struct Ready {
    step: Step,
    input: Input,
    /// Rows of `input` run in earlier rounds, and (below the last stage) their hidden states.
    done: usize,
    hidden: Vec<f32>,
}

/// What a `Forward` is once checked.
enum Prepared {
    Ready(Ready),
    /// A step of a run older than its request's cache.
    Dropped,
    /// It cannot run: the reply that says why.
    Refused(Message),
}

enum Input {
    Tokens(Vec<u32>),
    Hidden(Vec<f32>),
}

/// Share of the free device memory (after the weights) a pool may grow into by default.
const KV_SHARE_OF_FREE: f64 = 0.5;

/// The neighbours of this stage in a chain (`LoadShard::next` and `prev`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Route {
    /// Where outputs go under a `Chain`; `None`: to the coordinator.
    pub next: Option<Hop>,
    /// The only other peer whose `Forward`s this stage serves.
    pub prev: Option<String>,
}

/// Where what a stage produced goes.
#[derive(Debug)]
pub enum Outgoing {
    /// To the coordinator.
    Reply(Message),
    /// To the next stage, straight over a link between the two (or into this
    /// stage's own queue when it is its own next).
    Pass(Pass),
}

impl Outgoing {
    /// What the coordinator gets when the output cannot be passed on.
    pub fn into_reply(self) -> Message {
        match self {
            Outgoing::Reply(m) => m,
            Outgoing::Pass(p) => p.undelivered(),
        }
    }
}

/// A `Forward` for the next stage of a chain.
#[derive(Debug)]
pub struct Pass {
    /// The peer that runs the next stage.
    pub to: String,
    /// The step for it.
    pub forward: Message,
    /// The token this step sampled, when the pass closes the loop (last
    /// stage to first): `(step, id)`.
    token: Option<(u32, u32)>,
}

impl Pass {
    /// What the coordinator hears once `forward` is on its way: the sampled
    /// token, marked as passed on, when there is one.
    pub fn delivered(&self) -> Option<Message> {
        let (step, id) = self.token?;
        let Message::Forward { request, seq, .. } = self.forward else {
            return None;
        };
        Some(Message::Token {
            request,
            seq,
            step,
            id,
            passed_on: true,
        })
    }

    /// What the coordinator gets instead when `forward` cannot go straight
    /// to the next stage: the activations (or the token) it then relays.
    pub fn undelivered(self) -> Message {
        let Message::Forward {
            request,
            seq,
            pos0,
            tensor,
            ..
        } = self.forward
        else {
            return self.forward;
        };
        match self.token {
            Some((step, id)) => Message::Token {
                request,
                seq,
                step,
                id,
                passed_on: false,
            },
            None => Message::Activations {
                request,
                seq,
                pos0,
                tensor,
            },
        }
    }
}

/// Loads layers `start..end` from `src` and waits until they are on the device;
/// returns the shard and the `ShardLoaded` message that reports it.
pub async fn load_shard(
    device: Arc<Device>,
    src: &dyn TensorSource,
    start: usize,
    end: usize,
) -> Result<(Shard, Message), ModelError> {
    let t0 = Instant::now();
    let before = device.live_bytes();
    let shard = Shard::load(
        device.clone(),
        src,
        start,
        end,
        max_batch_for(&device),
        &mut |_, _| {},
    )?;
    device.sync().await?;
    let loaded = shard_loaded(start, end, device.live_bytes().saturating_sub(before), t0);
    Ok((shard, loaded))
}

/// The `ShardLoaded` that reports layers `start..end`: the device bytes they took and the
/// time since `t0`.
fn shard_loaded(start: usize, end: usize, weight_bytes: u64, t0: Instant) -> Message {
    Message::ShardLoaded {
        layers: LayerRange {
            start: start as u32,
            end: end as u32,
        },
        weight_bytes,
        load_ms: t0.elapsed().as_millis().min(u32::MAX as u128) as u32,
    }
}

/// Loads layers `start..end` from `src` split over `devices` (each with the bytes it
/// offers: [`crate::model::stack::split_range`]) and waits until they are on the devices;
/// returns the stack and the `ShardLoaded` message that reports it.
pub async fn load_stack(
    devices: &[(Arc<Device>, u64)],
    src: &dyn TensorSource,
    start: usize,
    end: usize,
) -> Result<(ShardStack, Message), ModelError> {
    load_stack_split(devices, src, start, end, Split::Layers).await
}

/// [`load_stack`] with the devices splitting the layers as `split` says (by layers, or each
/// layer by its tensors).
pub async fn load_stack_split(
    devices: &[(Arc<Device>, u64)],
    src: &dyn TensorSource,
    start: usize,
    end: usize,
    split: Split,
) -> Result<(ShardStack, Message), ModelError> {
    if devices.len() == 1 {
        let (shard, loaded) = load_shard(Arc::clone(&devices[0].0), src, start, end).await?;
        return Ok((ShardStack::single(shard), loaded));
    }
    let t0 = Instant::now();
    let live = |ds: &[(Arc<Device>, u64)]| ds.iter().map(|(d, _)| d.live_bytes()).sum::<u64>();
    let before = live(devices);
    let stack = ShardStack::load_split(devices, src, start, end, split, &mut |_, _| {})?;
    for (d, _) in devices {
        d.sync().await?;
    }
    let loaded = shard_loaded(start, end, live(devices).saturating_sub(before), t0);
    Ok((stack, loaded))
}

impl StageServer {
    pub fn new(device: Arc<Device>) -> StageServer {
        let bytes = device.info().memory_bytes;
        Self::with_devices(vec![(device, bytes)])
    }

    /// A stage over several local devices, each with the bytes it offers (its share of the
    /// layers follows them). The first device is [`Self::device`]. An empty list is one
    /// cpu device's worth of nothing: callers give at least one.
    pub fn with_devices(devices: Vec<(Arc<Device>, u64)>) -> StageServer {
        StageServer {
            devices,
            split: Split::Layers,
            shard: None,
            route: Route::default(),
            caches: HashMap::new(),
            pool: None,
            kv_budget: None,
            window_seqs: 0,
            started: Instant::now(),
            window_calls: 0,
            window_busy_s: 0.0,
            busy_total_s: 0.0,
            passes_total: 0,
            seqs_total: 0,
            window_tokens: 0,
            tokens_total: 0,
            window_start: Instant::now(),
            last_kernel_ms: 0.0,
            failed_device: None,
            partial: Vec::new(),
            #[cfg(not(target_arch = "wasm32"))]
            flights: Vec::new(),
            ended: std::collections::HashSet::new(),
            #[cfg(not(target_arch = "wasm32"))]
            overlap: overlap_wanted(),
        }
    }

    /// Whether a prompt is part-way through its prefill: [`Self::step_forwards`] with no new
    /// steps runs its next chunk.
    pub fn has_partial(&self) -> bool {
        !self.partial.is_empty()
    }

    /// The device (index in [`Self::devices`]) that failed a pass, once: a worker over several
    /// devices then carries on without it.
    pub fn take_failed_device(&mut self) -> Option<usize> {
        self.failed_device.take()
    }

    /// Tests (`dev-hooks` builds): the next pass fails on device `index`, as a lost one's would.
    #[cfg(feature = "dev-hooks")]
    pub fn fail_device(&self, index: usize) {
        if let Some(s) = &self.shard {
            s.fail_device(index);
        }
    }

    /// The first (or only) device.
    pub fn device(&self) -> &Arc<Device> {
        &self.devices[0].0
    }

    /// Every device of the stage, with the bytes each offers.
    pub fn devices(&self) -> &[(Arc<Device>, u64)] {
        &self.devices
    }

    /// How the stage's next shard spreads its layers over several devices.
    pub fn set_split(&mut self, split: Split) {
        self.split = split;
    }

    pub fn split(&self) -> Split {
        self.split
    }

    /// Installs a loaded shard; the old one's caches go with it.
    pub fn set_shard(&mut self, shard: Shard) {
        self.set_stack(ShardStack::single(shard));
    }

    /// Installs a loaded stack (layers over several devices); the old one's caches go with it.
    pub fn set_stack(&mut self, stack: ShardStack) {
        self.clear_requests();
        self.shard = Some(Shared::new(stack));
    }

    /// Bounds the key/value pool to `bytes` (from the next shard or cleared pool on); by
    /// default it may grow into half the device memory the weights leave free.
    pub fn set_kv_budget(&mut self, bytes: Option<u64>) {
        self.kv_budget = bytes;
    }

    /// Sets where this stage's outputs go (see [`Route`]).
    pub fn set_route(&mut self, route: Route) {
        self.route = route;
    }

    pub fn route(&self) -> &Route {
        &self.route
    }

    /// Whether a `Forward` from the worker `peer` (not the coordinator) is
    /// served: only the stage before this one sends them.
    pub fn serves_forwards_from(&self, peer: &str) -> bool {
        self.route.prev.as_deref() == Some(peer)
    }

    /// Drops every request's cache, keeping the shard.
    pub fn clear_requests(&mut self) {
        self.drop_flights();
        self.partial.clear();
        self.caches.clear();
        self.pool = None;
    }

    /// Drops the shard and every cache (frees device memory).
    pub fn clear(&mut self) {
        self.drop_flights();
        self.partial.clear();
        self.caches.clear();
        self.pool = None;
        self.shard = None;
        self.route = Route::default();
    }

    /// Tokens this stage has run through its layers (prompts' and generated ones), over
    /// every shard it held.
    pub fn tokens_served(&self) -> u64 {
        self.tokens_total
    }

    /// The loaded layer range.
    pub fn layers(&self) -> Option<(usize, usize)> {
        self.shard.as_ref().map(|s| s.range())
    }

    /// How the loaded layers are spread over the devices (by layers on one device).
    pub fn loaded_split(&self) -> Option<Split> {
        self.shard.as_ref().map(|s| s.split())
    }

    /// Handles a message for the stage; returns where its output goes, if
    /// it has one. `LoadShard` is the host's (it knows where bytes come
    /// from); other messages not meant for a stage get `None`, as do steps
    /// of a run older than the one a request's cache holds.
    pub async fn handle(&mut self, msg: Message) -> Option<Outgoing> {
        match msg {
            m @ Message::Forward { .. } => self.handle_forwards(vec![m]).await.pop(),
            Message::EndRequest { request } => {
                self.end(request);
                None
            }
            Message::Calibrate { config } => {
                Some(Outgoing::Reply(match serde_json::from_str(&config) {
                    Ok(cfg) => {
                        match super::calibrate_devices(&self.devices, &cfg, self.split).await {
                            Ok(c) => Message::Calibration(c),
                            Err(e) => Message::Error {
                                code: error_code::INTERNAL,
                                text: format!("calibration failed: {e}"),
                            },
                        }
                    }
                    Err(e) => Message::Error {
                        code: error_code::BAD_REQUEST,
                        text: format!("calibration config is not a model config: {e}"),
                    },
                }))
            }
            _ => None,
        }
    }

    /// Where a step's output goes: straight to the next stage under a
    /// chain (the sampled token back to the first stage while the chain's
    /// stop rule allows), else to the coordinator.
    fn route_output(&self, step: Step, tokens: usize, output: ShardOutput) -> Outgoing {
        let Step {
            request,
            seq,
            pos0,
            max_len,
            sample,
            chain,
        } = step;
        let next = chain.as_ref().and(self.route.next.as_ref());
        match output {
            ShardOutput::Token(id) => {
                let params = sample.unwrap_or_default();
                let next_pos = pos0 as usize + tokens;
                let goes_on = chain
                    .as_ref()
                    .is_some_and(|c| c.continues_after(params.step, id))
                    && next_pos < max_len as usize;
                match next.filter(|_| goes_on) {
                    Some(hop) => Outgoing::Pass(Pass {
                        to: hop.peer.clone(),
                        forward: Message::Forward {
                            request,
                            seq,
                            layers: hop.layers,
                            pos0: next_pos as u32,
                            max_len,
                            sample: Some(SampleParams {
                                step: params.step + 1,
                                ..params
                            }),
                            chain,
                            tensor: match Tensor::from_values(DType::U32, vec![1], &[id]) {
                                Ok(t) => t,
                                Err(e) => {
                                    return Outgoing::Reply(request_error(
                                        request,
                                        seq,
                                        error_code::INTERNAL,
                                        e,
                                    ));
                                }
                            },
                        },
                        token: Some((params.step, id)),
                    }),
                    None => Outgoing::Reply(Message::Token {
                        request,
                        seq,
                        step: params.step,
                        id,
                        passed_on: false,
                    }),
                }
            }
            ShardOutput::Hidden(h) => {
                let dim = self.shard.as_ref().map_or(1, |s| s.config().dim);
                let rows = (h.len() / dim.max(1)) as u64;
                let tensor = match Tensor::from_f32(vec![rows, dim as u64], &h) {
                    Ok(t) => t,
                    Err(e) => {
                        return Outgoing::Reply(request_error(
                            request,
                            seq,
                            error_code::INTERNAL,
                            e,
                        ));
                    }
                };
                match next {
                    Some(hop) => Outgoing::Pass(Pass {
                        to: hop.peer.clone(),
                        forward: Message::Forward {
                            request,
                            seq,
                            layers: hop.layers,
                            pos0,
                            max_len,
                            sample,
                            chain,
                            tensor,
                        },
                        token: None,
                    }),
                    None => Outgoing::Reply(Message::Activations {
                        request,
                        seq,
                        pos0,
                        tensor,
                    }),
                }
            }
            ShardOutput::Logits(_) => Outgoing::Reply(request_error(
                request,
                seq,
                error_code::INTERNAL,
                "the shard returned logits where a token was asked for",
            )),
        }
    }

    /// Drops `request`'s blocks (back to the pool at once).
    fn end(&mut self, request: u64) {
        self.partial.retain(|p| p.step.request != request);
        if self.in_flight(request) {
            self.ended.insert(request);
        }
        if let Some(mut e) = self.caches.remove(&request)
            && let Some(pool) = self.pool.as_mut()
        {
            pool.release(&mut e.kv);
        }
    }

    /// Runs the steps of several requests together: one forward pass over all of them
    /// (`Shard::forward_batch`), each request's output routed on its own. Steps of one
    /// request run in the order given (a second one waits for the next pass). Returns the
    /// outputs, in no promised order; a step of a run older than its request's cache gets
    /// none.
    pub async fn handle_forwards(&mut self, msgs: Vec<Message>) -> Vec<Outgoing> {
        let mut outs = self.step_forwards(msgs).await;
        while self.has_partial() {
            outs.extend(self.step_forwards(Vec::new()).await);
        }
        outs
    }

    /// As [`Self::handle_forwards`], but a prompt longer than [`PREFILL_CHUNK`] runs only its
    /// next chunk in this call (its output comes with its last chunk): a caller that feeds in
    /// the steps arrived meanwhile and calls again while [`Self::has_partial`] interleaves
    /// other requests' decode steps with a long prefill.
    pub async fn step_forwards(&mut self, msgs: Vec<Message>) -> Vec<Outgoing> {
        let mut outs = Vec::new();
        let mut first = true;
        let mut round: Vec<Message> = Vec::new();
        for m in msgs {
            let Message::Forward { request, .. } = &m else {
                continue;
            };
            let repeat = round
                .iter()
                .any(|r| matches!(r, Message::Forward { request: q, .. } if q == request));
            if repeat || round.len() == MAX_BATCH_SEQS {
                let batch = std::mem::take(&mut round);
                outs.extend(self.run_round(batch, std::mem::take(&mut first)).await);
            }
            round.push(m);
        }
        if !round.is_empty() || (first && self.has_partial()) {
            outs.extend(self.run_round(round, first).await);
        }
        outs
    }

    /// Whether a pass holding `request` is in flight ([`Self::begin_forwards`]).
    pub fn in_flight(&self, request: u64) -> bool {
        #[cfg(not(target_arch = "wasm32"))]
        {
            self.flights.iter().any(|f| f.requests.contains(&request))
        }
        #[cfg(target_arch = "wasm32")]
        {
            let _ = request;
            false
        }
    }

    /// Requests holding blocks here, those of passes in flight included.
    pub fn requests_held(&self) -> usize {
        #[cfg(not(target_arch = "wasm32"))]
        let flying: usize = self.flights.iter().map(|f| f.requests.len()).sum();
        #[cfg(target_arch = "wasm32")]
        let flying = 0;
        self.caches.len() + flying
    }

    /// Waits for every pass in flight and drops what it did (the requests' caches go too).
    fn drop_flights(&mut self) {
        #[cfg(not(target_arch = "wasm32"))]
        for f in self.flights.drain(..) {
            let _ = f.result.recv();
        }
        self.ended.clear();
    }

    /// One batched pass over steps of distinct requests, with the prompts part-way through
    /// their prefill when `partials`.
    async fn run_round(&mut self, msgs: Vec<Message>, partials: bool) -> Vec<Outgoing> {
        let (mut outs, round) = self.start_round(msgs, partials);
        let Some(mut round) = round else {
            return outs;
        };
        let (Some(shard), Some(pool)) = (self.shard.as_ref(), self.pool.as_mut()) else {
            return outs;
        };
        let t0 = Instant::now();
        let result = run_pass(shard, pool, &mut round, false).await;
        let took = t0.elapsed().as_secs_f64();
        outs.extend(self.end_round(round, result, took));
        outs
    }

    /// A round's steps checked, and each one's entry taken out of `caches` for its pass; the
    /// replies to steps that cannot run.
    fn start_round(
        &mut self,
        msgs: Vec<Message>,
        partials: bool,
    ) -> (Vec<Outgoing>, Option<Round>) {
        let mut outs = Vec::new();
        let mut ready = Vec::with_capacity(msgs.len());
        for m in msgs {
            match self.prepare(m) {
                Prepared::Ready(r) => ready.push(r),
                Prepared::Dropped => {}
                Prepared::Refused(reply) => outs.push(Outgoing::Reply(reply)),
            }
        }
        if partials {
            // A request's new step (a run started again) replaces its unfinished prompt.
            let mut carried = std::mem::take(&mut self.partial);
            carried.retain(|p| {
                self.caches.contains_key(&p.step.request)
                    && !ready.iter().any(|r| r.step.request == p.step.request)
            });
            ready.splice(0..0, carried);
        }
        if ready.is_empty() || self.shard.is_none() || self.pool.is_none() {
            return (outs, None);
        }
        let (dim, chunk_rows) = self.shard.as_ref().map_or((1, PREFILL_CHUNK), |shard| {
            (shard.config().dim, PREFILL_CHUNK.max(shard.max_batch()))
        });
        // Each request's entry leaves the map for the pass (the items borrow them).
        let entries: Vec<(u64, Entry)> = ready
            .iter()
            .filter_map(|r| {
                self.caches
                    .remove(&r.step.request)
                    .map(|e| (r.step.request, e))
            })
            .collect();
        let round = Round {
            ready,
            entries,
            dim,
            chunk_rows,
        };
        (outs, Some(round))
    }

    /// A round after its pass: its entries back in `caches` (or their blocks back in the pool
    /// where the request ended meanwhile or failed), and its outputs.
    fn end_round(&mut self, round: Round, result: PassResult, took: f64) -> Vec<Outgoing> {
        let Round {
            ready,
            entries,
            dim,
            chunk_rows,
        } = round;
        let mut outs = Vec::new();
        let rows: usize = ready.iter().map(|r| r.chunk(dim, chunk_rows).len()).sum();
        self.window_calls += 1;
        self.window_busy_s += took;
        self.window_tokens += rows as u64;
        self.tokens_total += rows as u64;
        self.window_seqs += ready.len() as u64;
        self.busy_total_s += took;
        self.passes_total += 1;
        self.seqs_total += ready.len() as u64;
        self.last_kernel_ms = took * 1e3;
        let Some(pool) = self.pool.as_mut() else {
            return outs;
        };
        let results = match result {
            Ok(r) => r,
            Err(e) => {
                if let ModelError::DeviceFailed { index, .. } = &e {
                    self.failed_device = Some(*index);
                }
                // The device failed the pass: every request in it starts over.
                for (request, mut e) in entries {
                    pool.release(&mut e.kv);
                    self.ended.remove(&request);
                }
                let text = e.to_string();
                outs.extend(ready.into_iter().map(|r| {
                    Outgoing::Reply(request_error(
                        r.step.request,
                        r.step.seq,
                        error_code::INTERNAL,
                        &text,
                    ))
                }));
                return outs;
            }
        };
        let mut routed = Vec::with_capacity(ready.len());
        for ((r, (request, mut entry)), result) in ready.into_iter().zip(entries).zip(results) {
            if self.ended.remove(&request) {
                // Ended while its pass ran (overlapped passes): its blocks go back, and
                // its output nowhere.
                pool.release(&mut entry.kv);
                continue;
            }
            match result {
                Ok(out) => {
                    self.caches.insert(request, entry);
                    routed.push((r, out));
                }
                Err(e) => {
                    // The cache may hold half a step; the coordinator restarts the request.
                    pool.release(&mut entry.kv);
                    let code = match e {
                        ModelError::Backend(_) => error_code::INTERNAL,
                        ModelError::PoolFull(_) => error_code::OVERLOADED,
                        _ => error_code::BAD_REQUEST,
                    };
                    outs.push(Outgoing::Reply(request_error(
                        r.step.request,
                        r.step.seq,
                        code,
                        e,
                    )));
                }
            }
        }
        for (mut r, out) in routed {
            let rows = r.rows(dim);
            let end = rows.min(r.done + chunk_rows);
            let out = match out {
                ShardOutput::Hidden(h) if r.done > 0 || end < rows => {
                    r.hidden.extend_from_slice(&h);
                    ShardOutput::Hidden(std::mem::take(&mut r.hidden))
                }
                other => other,
            };
            if end < rows {
                // More of the prompt to run: its next chunk joins the next round.
                if let ShardOutput::Hidden(h) = out {
                    r.hidden = h;
                }
                r.done = end;
                self.partial.push(r);
                continue;
            }
            outs.push(self.route_output(r.step, rows, out));
        }
        outs
    }

    /// Checks a `Forward` against this stage and its request's cache, and decodes its
    /// input: `Ok(None)` for a step of an older run (dropped), `Err` with the reply for one
    /// that cannot run.
    fn prepare(&mut self, m: Message) -> Prepared {
        let Message::Forward {
            request,
            seq,
            layers,
            pos0,
            max_len,
            sample,
            chain,
            tensor,
        } = m
        else {
            return Prepared::Dropped;
        };
        if self.caches.get(&request).is_some_and(|e| seq < e.seq) {
            return Prepared::Dropped;
        }
        let fail =
            |code: u16, text: String| Prepared::Refused(request_error(request, seq, code, text));
        let bad = |text: String| fail(error_code::BAD_REQUEST, text);
        let Some(shard) = self.shard.as_ref() else {
            return fail(error_code::UNSUPPORTED, "no shard is loaded".into());
        };
        let (start, end) = shard.range();
        if (layers.start as usize, layers.end as usize) != (start, end) {
            // Not the request's fault: the placement moved; the coordinator retries.
            return fail(
                error_code::UNSUPPORTED,
                format!(
                    "this peer holds layers {start}..{end}, not {}..{}",
                    layers.start, layers.end
                ),
            );
        }
        let cfg = shard.config();
        let context = cfg.context_length.max(1);
        let pieces = shard.pieces().len();
        let input = match tensor.dtype() {
            DType::U32 if shard.is_first() => match tensor.to_values::<u32>() {
                Ok(v) => Input::Tokens(v),
                Err(e) => return bad(e.to_string()),
            },
            DType::F32 if !shard.is_first() => match tensor.to_f32() {
                Ok(v) => Input::Hidden(v),
                Err(e) => return bad(e.to_string()),
            },
            other => {
                return bad(format!(
                    "a shard of layers {start}..{end} takes {}, not {other:?}",
                    if shard.is_first() {
                        "U32 token ids"
                    } else {
                        "F32 hidden states"
                    }
                ));
            }
        };
        let pos0 = pos0 as usize;
        if self.pool.is_none() {
            // Each piece's pool: its share of an explicit budget (by its layers), else half
            // of what its device has free after the weights, capped at what MAX_REQUESTS
            // full contexts would take.
            let total_per_position = shard.kv_bytes_per_position().max(1);
            let budget = |piece: &Shard| {
                let per_position = piece.kv_bytes_per_position();
                match self.kv_budget {
                    Some(b) => {
                        (b as u128 * per_position as u128 / total_per_position as u128) as u64
                    }
                    None => {
                        let dev = piece.device();
                        let free = dev.info().memory_bytes.saturating_sub(dev.live_bytes());
                        let most = per_position * (MAX_REQUESTS * cfg.context_length.max(1)) as u64;
                        ((free as f64 * KV_SHARE_OF_FREE) as u64).min(most)
                    }
                }
            };
            match shard.new_pool(budget) {
                Ok(pool) => self.pool = Some(pool),
                Err(e) => return fail(error_code::OVERLOADED, e.to_string()),
            }
        }
        if pos0 == 0 {
            self.end(request);
        }
        if let Some(e) = self.caches.get(&request)
            && e.seq != seq
        {
            // A newer run must start at position 0; not the request's fault.
            return fail(
                error_code::UNSUPPORTED,
                format!(
                    "request {request} holds run {} here; run {seq} must start at position 0, not {pos0}",
                    e.seq
                ),
            );
        }
        if !self.caches.contains_key(&request) {
            if pos0 != 0 {
                // Its cache went (a new placement, an end): the coordinator rebuilds it.
                return fail(
                    error_code::UNSUPPORTED,
                    format!(
                        "request {request} is unknown here and starts at position {pos0}, not 0"
                    ),
                );
            }
            if self.requests_held() >= MAX_REQUESTS {
                return fail(
                    error_code::OVERLOADED,
                    format!("{MAX_REQUESTS} requests already hold a KV cache here"),
                );
            }
            let limit = (max_len as usize).clamp(1, context);
            self.caches.insert(
                request,
                Entry {
                    kv: StackSeq::new(pieces, limit),
                    seq,
                },
            );
        }
        let Some(Entry { kv, .. }) = self.caches.get_mut(&request) else {
            return fail(error_code::INTERNAL, "cache vanished".into());
        };
        if pos0 > kv.len() {
            return bad(format!(
                "position {pos0} skips past the {} positions request {request} holds",
                kv.len()
            ));
        }
        kv.truncate(pos0);
        Prepared::Ready(Ready {
            done: 0,
            hidden: Vec::new(),
            step: Step {
                request,
                seq,
                pos0: pos0 as u32,
                max_len,
                sample,
                chain,
            },
            input,
        })
    }

    /// Telemetry since the last call: utilization, forward time, memory.
    pub fn telemetry(&mut self) -> Telemetry {
        let window = self.window_start.elapsed().as_secs_f64().max(1e-3);
        let t = Telemetry {
            uptime_ms: self.started.elapsed().as_millis() as u64,
            queue_depth: 0,
            tokens_per_s: (self.window_tokens as f64 / window) as f32,
            memory_used_bytes: self.devices.iter().map(|(d, _)| d.live_bytes()).sum(),
            memory_total_bytes: self
                .devices
                .iter()
                .map(|(d, _)| d.info().memory_bytes)
                .sum(),
            utilization: (self.window_busy_s / window).min(1.0),
            kernel_ms: self.last_kernel_ms,
            // The mean over this window's calls: steadier than the last.
            forward_ms: (self.window_calls > 0)
                .then(|| self.window_busy_s * 1e3 / self.window_calls as f64),
            forwards: self.window_calls,
            requests: self.requests_held().try_into().unwrap_or(u32::MAX),
            mean_batch: (self.window_calls > 0)
                .then(|| (self.window_seqs as f64 / self.window_calls as f64) as f32),
            // Every piece holds the same sequences; the tightest pool is what binds.
            kv: self
                .pool
                .as_ref()
                .and_then(|p| {
                    p.each(|k| (k.book().budget(), k.book().used(), k.book().allocated()))
                        .into_iter()
                        .min_by_key(|b| b.0)
                })
                .map(|(budget, used, allocated)| KvReport {
                    blocks_used: used as u32,
                    blocks_allocated: allocated as u32,
                    blocks_budget: budget as u32,
                    block_positions: crate::model::KV_BLOCK as u32,
                }),
            layers: self.layers().map(|(start, end)| LayerRange {
                start: start as u32,
                end: end as u32,
            }),
            busy_total_s: self.busy_total_s,
            passes_total: self.passes_total,
            seqs_total: self.seqs_total,
            ..Telemetry::default()
        };
        self.window_calls = 0;
        self.window_busy_s = 0.0;
        self.window_tokens = 0;
        self.window_seqs = 0;
        self.window_start = Instant::now();
        t
    }
}

/// Passes in flight across steps. A stage split by layers over several devices runs one pass
/// at a time through [`StageServer::step_forwards`]: while its second device runs a pass's
/// later layers the first waits for the next step's tokens, which only that pass gives. Here
/// a pass runs on a thread of its own, holding each piece's pool only while it runs that
/// piece ([`ShardStack::forward_in_order`]), and the caller starts the next pass over other
/// requests as soon as it has their steps: with the requests in as many groups as pieces,
/// each group's pass is on a different piece, as the stages of a chain of processes keep
/// different requests' passes in flight (session 17: 1,020 tok/s against 849 one pass at a
/// time, 16 at once over two H200s). Each pass is the same pass of the same sequences as
/// [`StageServer::step_forwards`] would run, so outputs do not change.
#[cfg(not(target_arch = "wasm32"))]
impl StageServer {
    /// How many passes the stage keeps in flight at once: its pieces, for a stack split by
    /// layers over several devices with `CAIRN_STAGE_OVERLAP=on`; else 1 (the caller runs
    /// [`Self::step_forwards`]). Off by default until measured on several GPUs: on this
    /// 2-core machine, loaded by other work, two cpu devices lost with it (session 20).
    pub fn overlap(&self) -> usize {
        let pieces = self
            .shard
            .as_ref()
            .filter(|s| s.split() == Split::Layers)
            .map_or(1, |s| s.pieces().len());
        if pieces > 1 && self.overlap {
            pieces
        } else {
            1
        }
    }

    /// Whether a stage split by layers keeps passes in flight across steps (the default:
    /// `CAIRN_STAGE_OVERLAP=on`).
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    pub fn passes_in_flight(&self) -> usize {
        self.flights.len()
    }

    /// Requests in the passes in flight.
    pub fn requests_in_flight(&self) -> usize {
        self.flights.iter().map(|f| f.requests.len()).sum()
    }

    /// Starts the pass of `msgs` (steps of distinct requests, none in flight: the caller
    /// holds back a step of a request in flight until its pass ends) and of the prompts
    /// part-way through their prefill, on a thread of its own; `done` is called on that
    /// thread when the pass is over ([`Self::finish_passes`] then ends it). Returns the
    /// replies to steps that cannot run.
    pub fn begin_forwards(
        &mut self,
        msgs: Vec<Message>,
        done: impl FnOnce() + Send + 'static,
    ) -> Vec<Outgoing> {
        let (mut outs, round) = self.start_round(msgs, true);
        let Some(round) = round else {
            return outs;
        };
        let (Some(shard), Some(mut pool)) = (self.shard.clone(), self.pool.clone()) else {
            return outs;
        };
        let requests: Vec<u64> = round.entries.iter().map(|e| e.0).collect();
        let (give, take) = std::sync::mpsc::channel::<Round>();
        let (back, result) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("cairn-pass".into())
            .spawn(move || {
                let Ok(mut round) = take.recv() else {
                    return;
                };
                let t0 = Instant::now();
                let got = pollster::block_on(run_pass(&shard, &mut pool, &mut round, true));
                let _ = back.send((round, got, t0.elapsed().as_secs_f64()));
                done();
            });
        // The round goes to the thread only once it runs: without one, it runs here.
        let round = match spawned {
            Ok(_) => match give.send(round) {
                Ok(()) => {
                    self.flights.push(Flight { requests, result });
                    return outs;
                }
                Err(std::sync::mpsc::SendError(round)) => round,
            },
            Err(e) => {
                tracing::warn!(error = %e, "no thread for a pass; running it on the stage's");
                round
            }
        };
        outs.extend(self.run_now(round));
        outs
    }

    fn run_now(&mut self, mut round: Round) -> Vec<Outgoing> {
        let (Some(shard), Some(pool)) = (self.shard.clone(), self.pool.as_mut()) else {
            return Vec::new();
        };
        let t0 = Instant::now();
        let result = pollster::block_on(run_pass(&shard, pool, &mut round, true));
        self.end_round(round, result, t0.elapsed().as_secs_f64())
    }

    /// Ends the passes in flight that are over, oldest first, and returns their outputs;
    /// `wait`: when none is over yet, waits for the oldest.
    pub fn finish_passes(&mut self, wait: bool) -> Vec<Outgoing> {
        use std::sync::mpsc::TryRecvError;
        let mut over = Vec::new();
        let mut k = 0;
        while k < self.flights.len() {
            match self.flights[k].result.try_recv() {
                Ok(r) => {
                    self.flights.remove(k);
                    over.push(r);
                }
                Err(TryRecvError::Empty) => k += 1,
                // Its thread panicked: the requests' caches went with it; the coordinator
                // hears nothing and restarts them when their time runs out.
                Err(TryRecvError::Disconnected) => {
                    let f = self.flights.remove(k);
                    tracing::warn!(requests = ?f.requests, "a pass's thread stopped");
                    for r in f.requests {
                        self.ended.remove(&r);
                    }
                }
            }
        }
        if wait && over.is_empty() && !self.flights.is_empty() {
            let f = self.flights.remove(0);
            if let Ok(r) = f.result.recv() {
                over.push(r);
            }
        }
        let mut outs = Vec::new();
        for (round, result, took) in over {
            outs.extend(self.end_round(round, result, took));
        }
        outs
    }
}

/// Whether a stage split by layers keeps passes in flight across steps
/// (`CAIRN_STAGE_OVERLAP=on`: yes).
#[cfg(not(target_arch = "wasm32"))]
fn overlap_wanted() -> bool {
    std::env::var("CAIRN_STAGE_OVERLAP").as_deref() == Ok("on")
}

/// The step a `Forward` asks for, without its layers and input.
#[derive(Clone, Debug)]
struct Step {
    request: u64,
    seq: u32,
    pos0: u32,
    max_len: u32,
    sample: Option<SampleParams>,
    chain: Option<Chain>,
}

fn request_error(request: u64, seq: u32, code: u16, text: impl ToString) -> Message {
    Message::RequestError {
        request,
        seq,
        code,
        text: text.to_string(),
    }
}

impl Ready {
    /// Positions this step covers.
    fn rows(&self, dim: usize) -> usize {
        match &self.input {
            Input::Tokens(t) => t.len(),
            Input::Hidden(h) => h.len() / dim.max(1),
        }
    }

    /// This round's rows of the step: the next chunk of a long prompt, else all of it.
    fn chunk(&self, dim: usize, chunk_rows: usize) -> std::ops::Range<usize> {
        let total = self.rows(dim);
        self.done..total.min(self.done + chunk_rows)
    }
}

/// One round between its start and its end: its steps, and each one's entry (out of
/// `caches` while the pass runs).
struct Round {
    ready: Vec<Ready>,
    entries: Vec<(u64, Entry)>,
    dim: usize,
    chunk_rows: usize,
}

type PassResult = Result<Vec<Result<ShardOutput, ModelError>>, ModelError>;

/// The pass of `round` through `shard`: each step's chunk, asking the last stage's sample for
/// a step's last chunk. `in_order`: the pieces one after the other, each piece's pool held
/// only while it runs ([`ShardStack::forward_in_order`], for passes in flight at once).
async fn run_pass(
    shard: &ShardStack,
    pool: &mut StackPool,
    round: &mut Round,
    in_order: bool,
) -> PassResult {
    let (dim, chunk_rows) = (round.dim, round.chunk_rows);
    let want = |r: &Ready| {
        let last_chunk = r.chunk(dim, chunk_rows).end == r.rows(dim);
        match (shard.is_last(), last_chunk) {
            (true, true) => Want::Sample(r.step.sample.unwrap_or_default()),
            // An earlier chunk only fills the caches; the head's one row is cheap.
            (true, false) => Want::Logits,
            (false, _) => Want::Hidden,
        }
    };
    let mut items: Vec<StackItem> = round
        .ready
        .iter()
        .zip(round.entries.iter_mut())
        .map(|(r, (_, e))| StackItem {
            seq: &mut e.kv,
            input: match &r.input {
                Input::Tokens(t) => ShardInput::Tokens(&t[r.chunk(dim, chunk_rows)]),
                Input::Hidden(h) => {
                    let rows = r.chunk(dim, chunk_rows);
                    ShardInput::Hidden(&h[rows.start * dim..rows.end * dim])
                }
            },
            want: want(r),
        })
        .collect();
    if in_order {
        shard.forward_in_order(pool, &mut items).await
    } else {
        shard.forward_batch(pool, &mut items).await
    }
}

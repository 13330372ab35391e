use std::sync::Arc;

use web_time::Instant;

use crate::backend::Device;
use crate::kernels::SampleParams;
use crate::model::stack::{ShardStack, StackItem, StackPool, StackSeq, split_range};
use crate::model::synthetic::SyntheticModel;
use crate::model::{KV_BLOCK, ModelConfig, ModelError, Shard, ShardInput, Split, Want};
use crate::placement::SplitTiming;
use crate::protocol::Calibration;

/// Decode steps timed per shard, after a warm-up; the median counts.
const DECODE_STEPS: usize = 9;
/// Prompt length of the timed prefill.
const PREFILL_TOKENS: usize = 16;
/// How many more layers than the one-layer shard the tensor split is timed on.
const TENSOR_EXTRA_LAYERS: usize = 4;
/// Vocabulary rows the head is timed on (then scaled): enough to be
/// bandwidth-bound, small enough for a phone's memory.
const HEAD_ROWS: usize = 16384;

/// Where a calibration runs: one device, or several devices splitting every layer by
/// tensors ([`Split::Tensor`]).
#[derive(Clone, Copy)]
enum Target<'a> {
    Device(&'a Arc<Device>),
    Tensor(&'a [(Arc<Device>, u64)]),
}

/// Measures this device on layers of `cfg`'s shape (random weights of the
/// same types and sizes): decode seconds per layer, prefill seconds per layer
/// and token, the fixed cost of a call, and what the output head adds.
pub async fn calibrate(dev: Arc<Device>, cfg: &ModelConfig) -> Result<Calibration, ModelError> {
    let t = measure(Target::Device(&dev), cfg).await?;
    Ok(calibration(t, None))
}

/// A calibration of `layers` timings, with `tensor` offered beside them.
fn calibration(layers: SplitTiming, tensor: Option<SplitTiming>) -> Calibration {
    Calibration {
        decode_s_per_layer: layers.decode_s_per_layer,
        prefill_s_per_layer_token: layers.prefill_s_per_layer_token,
        call_overhead_s: layers.call_overhead_s,
        head_s: layers.head_s,
        tensor,
    }
}

/// Times `target` on layers of `cfg`'s shape. Two shards (one middle layer, and more)
/// separate per-layer time from per-call overhead; a last layer with the head, against one
/// middle layer, gives the head.
async fn measure(target: Target<'_>, cfg: &ModelConfig) -> Result<SplitTiming, ModelError> {
    // How many more layers the longer shard has. A tensor split's layers cost little on the
    // GPUs beside the pass's fixed costs (threads, planning, sums meeting), so one layer's
    // difference drowns in noise: on four H200s it ranked the 8B's split wrongly.
    let extra = match target {
        Target::Device(_) => 1,
        Target::Tensor(_) => TENSOR_EXTRA_LAYERS,
    };
    let mut small = cfg.clone();
    // Middle layers and a last one: the embedding is never loaded,
    // and the head is timed on at most HEAD_ROWS rows of the vocabulary.
    small.n_layers = extra + 3;
    small.vocab_size = cfg.vocab_size.clamp(1, HEAD_ROWS);
    small.context_length = small.context_length.max(64);
    let model = SyntheticModel::new(&small, 7);
    let one = time_range(target, &model, &small, 1, 2).await?;
    let more = time_range(target, &model, &small, 1, 2 + extra).await?;
    let last = time_range(target, &model, &small, 2 + extra, 3 + extra).await?;
    let decode_s_per_layer = ((more.0 - one.0) / extra as f64)
        .max(one.0 * 0.05)
        .max(1e-7);
    let call_overhead_s = (one.0 - decode_s_per_layer).max(0.0);
    let prefill_s_per_layer_token =
        ((more.1 - one.1) / extra as f64).max(one.1 * 0.05) / PREFILL_TOKENS as f64;
    let prefill_s_per_layer_token = prefill_s_per_layer_token.max(1e-8);
    // The head is a matrix-vector product over the vocabulary: its time
    // scales with the rows.
    let head_s = (last.0 - one.0).max(0.0) * cfg.vocab_size as f64 / small.vocab_size as f64;
    Ok(SplitTiming {
        decode_s_per_layer,
        prefill_s_per_layer_token,
        call_overhead_s,
        head_s,
        devices: 0,
    })
}

/// Measures a stage over several local devices ([`crate::model::ShardStack`]).
///
/// By layers (always): each device alone, then weighted by the share of layers it would
/// hold of a whole model ([`split_range`] by the bytes each offers). Each piece is its own
/// call, so the call overheads add up (each includes handing its hidden states on through
/// the host); the head is the last piece's.
///
/// By tensors (`split` is `tensor` or `auto`, and the model's shapes split over these
/// devices): the devices together on a tensor-split stack, through the pass a stage runs,
/// sums between devices included. With `auto` both are offered and placement picks per
/// stage; with `tensor` the tensor timings are the only ones (the worker splits that way
/// whatever placement says).
pub async fn calibrate_devices(
    devices: &[(Arc<Device>, u64)],
    cfg: &ModelConfig,
    split: Split,
) -> Result<Calibration, ModelError> {
    if let [(dev, _)] = devices {
        return calibrate(Arc::clone(dev), cfg).await;
    }
    let tensor = match split {
        Split::Layers => None,
        Split::Tensor | Split::Auto => match measure(Target::Tensor(devices), cfg).await {
            Ok(t) => Some(SplitTiming {
                devices: u32::try_from(devices.len()).unwrap_or(u32::MAX),
                ..t
            }),
            Err(ModelError::TensorSplit(why)) => {
                tracing::info!(%why, "calibration: the model does not split by tensors here");
                None
            }
            Err(e) => return Err(e),
        },
    };
    if let (Split::Tensor, Some(t)) = (split, tensor) {
        return Ok(calibration(t, None));
    }
    let weights: Vec<f64> = devices.iter().map(|(_, b)| *b as f64).collect();
    let layers = cfg.n_layers.max(1);
    let parts = split_range(0, layers, &weights);
    let mut sum = SplitTiming::default();
    for (i, a, b) in parts {
        let one = measure(Target::Device(&devices[i].0), cfg).await?;
        let share = (b - a) as f64 / layers as f64;
        sum.decode_s_per_layer += share * one.decode_s_per_layer;
        sum.prefill_s_per_layer_token += share * one.prefill_s_per_layer_token;
        sum.call_overhead_s += one.call_overhead_s;
        if b == layers {
            sum.head_s = one.head_s;
        }
    }
    Ok(calibration(sum, tensor))
}

/// (seconds per decode call, seconds per prefill call) of layers `start..end` on `target`.
async fn time_range(
    target: Target<'_>,
    model: &SyntheticModel,
    cfg: &ModelConfig,
    start: usize,
    end: usize,
) -> Result<(f64, f64), ModelError> {
    match target {
        Target::Device(dev) => time_shard(dev, model, cfg, start, end).await,
        Target::Tensor(devices) => time_tensor_stack(devices, model, cfg, start, end).await,
    }
}

/// [`time_shard`] for a stack split by tensors over `devices`, through its batched pass
/// with one sequence (what a stage runs for a lone request).
async fn time_tensor_stack(
    devices: &[(Arc<Device>, u64)],
    model: &SyntheticModel,
    cfg: &ModelConfig,
    start: usize,
    end: usize,
) -> Result<(f64, f64), ModelError> {
    let stack = ShardStack::load_split(devices, model, start, end, Split::Tensor, &mut |_, _| {})?;
    for (dev, _) in devices {
        dev.sync().await?;
    }
    let positions = PREFILL_TOKENS + DECODE_STEPS + 2;
    // Room for the sequence's positions in whole blocks, with a block to spare.
    let blocks = positions.div_ceil(KV_BLOCK) + 1;
    let mut pool = stack.new_pool(|p| p.kv_bytes_per_position() * (blocks * KV_BLOCK) as u64)?;
    let prompt = vec![0.01f32; PREFILL_TOKENS * cfg.dim];
    let one = vec![0.01f32; cfg.dim];
    let want = if end == cfg.n_layers {
        Want::Sample(SampleParams::default())
    } else {
        Want::Hidden
    };
    let mut seq = StackSeq::new(stack.pieces().len(), positions);
    // Warm-up of both paths, as in `time_shard`.
    stack_pass(&stack, &mut pool, &mut seq, &prompt, want).await?;
    stack_pass(&stack, &mut pool, &mut seq, &one, want).await?;
    pool.release(&mut seq);
    let mut seq = StackSeq::new(stack.pieces().len(), positions);
    let t0 = Instant::now();
    stack_pass(&stack, &mut pool, &mut seq, &prompt, want).await?;
    let prefill = t0.elapsed().as_secs_f64();
    let mut steps = Vec::with_capacity(DECODE_STEPS);
    for _ in 0..DECODE_STEPS {
        let t = Instant::now();
        stack_pass(&stack, &mut pool, &mut seq, &one, want).await?;
        steps.push(t.elapsed().as_secs_f64());
    }
    pool.release(&mut seq);
    steps.sort_by(f64::total_cmp);
    Ok((steps[DECODE_STEPS / 2], prefill))
}

/// One pass of `hidden` rows of one sequence through `stack`.
async fn stack_pass(
    stack: &ShardStack,
    pool: &mut StackPool,
    seq: &mut StackSeq,
    hidden: &[f32],
    want: Want,
) -> Result<(), ModelError> {
    let mut items = [StackItem {
        seq,
        input: ShardInput::Hidden(hidden),
        want,
    }];
    match stack.forward_batch(pool, &mut items).await?.pop() {
        Some(Ok(_)) => Ok(()),
        Some(Err(e)) => Err(e),
        None => Err(ModelError::WrongInput("a calibration pass gave no output")),
    }
}

/// (seconds per decode call, seconds per prefill call) of layers `start..end`.
async fn time_shard(
    dev: &Arc<Device>,
    model: &SyntheticModel,
    cfg: &ModelConfig,
    start: usize,
    end: usize,
) -> Result<(f64, f64), ModelError> {
    let shard = Shard::load(
        dev.clone(),
        model,
        start,
        end,
        PREFILL_TOKENS,
        &mut |_, _| {},
    )?;
    dev.sync().await?;
    let prompt = vec![0.01f32; PREFILL_TOKENS * cfg.dim];
    let mut cache = shard.new_cache(PREFILL_TOKENS + DECODE_STEPS + 2)?;
    let one = vec![0.01f32; cfg.dim];
    let want = if end == cfg.n_layers {
        Want::Sample(SampleParams::default())
    } else {
        Want::Hidden
    };
    // Warm-up of both paths: prefill and decode use different kernels, and a
    // pipeline compiled inside a timed call would be counted as a layer's
    // work (the difference of two shards then comes out negative or wild).
    shard
        .forward(&mut cache, ShardInput::Hidden(&prompt), want)
        .await?;
    shard
        .forward(&mut cache, ShardInput::Hidden(&one), want)
        .await?;
    cache.truncate(0);
    let t0 = Instant::now();
    shard
        .forward(&mut cache, ShardInput::Hidden(&prompt), want)
        .await?;
    let prefill = t0.elapsed().as_secs_f64();
    // The median step: one preempted step on a busy machine does not count.
    let mut steps = Vec::with_capacity(DECODE_STEPS);
    for _ in 0..DECODE_STEPS {
        let t = Instant::now();
        shard
            .forward(&mut cache, ShardInput::Hidden(&one), want)
            .await?;
        steps.push(t.elapsed().as_secs_f64());
    }
    steps.sort_by(f64::total_cmp);
    Ok((steps[DECODE_STEPS / 2], prefill))
}

use std::sync::Arc;

use web_time::Instant;

use crate::backend::Device;
use crate::kernels::SampleParams;
use crate::model::stack::split_range;
use crate::model::synthetic::SyntheticModel;
use crate::model::{ModelConfig, ModelError, Shard, ShardInput, Want};
use crate::protocol::Calibration;

/// Decode steps timed per shard, after a warm-up; the median counts.
const DECODE_STEPS: usize = 9;
/// Prompt length of the timed prefill.
const PREFILL_TOKENS: usize = 16;
/// Vocabulary rows the head is timed on (then scaled): enough to be
/// bandwidth-bound, small enough for a phone's memory.
const HEAD_ROWS: usize = 16384;

/// Measures this device on layers of `cfg`'s shape (random weights of the
/// same types and sizes): decode seconds per layer, prefill seconds per layer
/// and token, the fixed cost of a call, and what the output head adds. Two
/// shards (one and two middle layers) separate per-layer time from per-call
/// overhead; a last layer with the head, against one middle layer, gives the
/// head.
pub async fn calibrate(dev: Arc<Device>, cfg: &ModelConfig) -> Result<Calibration, ModelError> {
    let mut small = cfg.clone();
    // Three middle layers and a last one: the embedding is never loaded,
    // and the head is timed on at most HEAD_ROWS rows of the vocabulary.
    small.n_layers = 4;
    small.vocab_size = cfg.vocab_size.clamp(1, HEAD_ROWS);
    small.context_length = small.context_length.max(64);
    let model = SyntheticModel::new(&small, 7);
    let one = time_shard(&dev, &model, &small, 1, 2).await?;
    let two = time_shard(&dev, &model, &small, 1, 3).await?;
    let last = time_shard(&dev, &model, &small, 3, 4).await?;
    let decode_s_per_layer = (two.0 - one.0).max(one.0 * 0.05).max(1e-7);
    let call_overhead_s = (one.0 - decode_s_per_layer).max(0.0);
    let prefill_s_per_layer_token =
        ((two.1 - one.1).max(one.1 * 0.05) / PREFILL_TOKENS as f64).max(1e-8);
    // The head is a matrix-vector product over the vocabulary: its time
    // scales with the rows.
    let head_s = (last.0 - one.0).max(0.0) * cfg.vocab_size as f64 / small.vocab_size as f64;
    Ok(Calibration {
        decode_s_per_layer,
        prefill_s_per_layer_token,
        call_overhead_s,
        head_s,
    })
}

/// Measures a stage split over several local devices ([`crate::model::ShardStack`]): each
/// device alone, then weighted by the share of layers it would hold of a whole model
/// ([`split_range`] by the bytes each offers). Each piece is its own call, so the call
/// overheads add up (each includes handing its hidden states on through the host); the
/// head is the last piece's.
pub async fn calibrate_devices(
    devices: &[(Arc<Device>, u64)],
    cfg: &ModelConfig,
) -> Result<Calibration, ModelError> {
    if let [(dev, _)] = devices {
        return calibrate(Arc::clone(dev), cfg).await;
    }
    let weights: Vec<f64> = devices.iter().map(|(_, b)| *b as f64).collect();
    let layers = cfg.n_layers.max(1);
    let parts = split_range(0, layers, &weights);
    let mut sum = Calibration::default();
    for (i, a, b) in parts {
        let one = calibrate(Arc::clone(&devices[i].0), cfg).await?;
        let share = (b - a) as f64 / layers as f64;
        sum.decode_s_per_layer += share * one.decode_s_per_layer;
        sum.prefill_s_per_layer_token += share * one.prefill_s_per_layer_token;
        sum.call_overhead_s += one.call_overhead_s;
        if b == layers {
            sum.head_s = one.head_s;
        }
    }
    Ok(sum)
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

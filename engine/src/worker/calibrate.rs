use std::sync::Arc;

use web_time::Instant;

use crate::backend::Device;
use crate::model::synthetic::SyntheticModel;
use crate::model::{ModelConfig, ModelError, Shard, ShardInput, Want};
use crate::protocol::Calibration;

/// Decode steps timed per shard, after a warm-up; the median counts.
const DECODE_STEPS: usize = 9;
/// Prompt length of the timed prefill.
const PREFILL_TOKENS: usize = 16;

/// Measures this device on layers of `cfg`'s shape (random weights of the
/// same types and sizes): decode seconds per layer, prefill seconds per layer
/// and token, and the fixed cost of a call. Two shards (one and two middle
/// layers) separate per-layer time from per-call overhead.
pub async fn calibrate(dev: Arc<Device>, cfg: &ModelConfig) -> Result<Calibration, ModelError> {
    let mut small = cfg.clone();
    // Only middle layers are loaded: the embedding and head never are, so a
    // tiny vocabulary keeps the synthetic file small.
    small.n_layers = 4;
    small.vocab_size = 256;
    small.context_length = small.context_length.max(64);
    let model = SyntheticModel::new(&small, 7);
    let one = time_shard(&dev, &model, &small, 1, 2).await?;
    let two = time_shard(&dev, &model, &small, 1, 3).await?;
    let decode_s_per_layer = (two.0 - one.0).max(one.0 * 0.05).max(1e-7);
    let call_overhead_s = (one.0 - decode_s_per_layer).max(0.0);
    let prefill_s_per_layer_token =
        ((two.1 - one.1).max(one.1 * 0.05) / PREFILL_TOKENS as f64).max(1e-8);
    Ok(Calibration {
        decode_s_per_layer,
        prefill_s_per_layer_token,
        call_overhead_s,
    })
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
    // Warm-up of both paths: prefill and decode use different kernels, and a
    // pipeline compiled inside a timed call would be counted as a layer's
    // work (the difference of two shards then comes out negative or wild).
    shard
        .forward(&mut cache, ShardInput::Hidden(&prompt), Want::Hidden)
        .await?;
    shard
        .forward(&mut cache, ShardInput::Hidden(&one), Want::Hidden)
        .await?;
    cache.truncate(0);
    let t0 = Instant::now();
    shard
        .forward(&mut cache, ShardInput::Hidden(&prompt), Want::Hidden)
        .await?;
    let prefill = t0.elapsed().as_secs_f64();
    // The median step: one preempted step on a busy machine does not count.
    let mut steps = Vec::with_capacity(DECODE_STEPS);
    for _ in 0..DECODE_STEPS {
        let t = Instant::now();
        shard
            .forward(&mut cache, ShardInput::Hidden(&one), Want::Hidden)
            .await?;
        steps.push(t.elapsed().as_secs_f64());
    }
    steps.sort_by(f64::total_cmp);
    Ok((steps[DECODE_STEPS / 2], prefill))
}

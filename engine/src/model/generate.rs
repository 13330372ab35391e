//! Generation and teacher-forced scoring on a model held whole by one shard.

use web_time::Instant;

use super::{KvCache, ModelError, Shard, ShardInput, ShardOutput, Want};
use crate::kernels::SampleParams;
use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sample: SampleParams,
    /// Stop at the tokenizer's end-of-generation tokens.
    pub stop_at_eog: bool,
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
}

impl GenerateStats {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_s)
    }
    /// Tokens after the first (which comes out of the prefill) over the decode time.
    pub fn decode_tokens_per_s(&self) -> f64 {
        rate(self.generated.saturating_sub(1), self.decode_s)
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

fn need_whole(shard: &Shard) -> Result<(), ModelError> {
    if shard.is_first() && shard.is_last() {
        Ok(())
    } else {
        Err(ModelError::WrongInput(
            "this needs a shard holding the whole model",
        ))
    }
}

/// What a [`generate_with`] caller says after each token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// This token is the last (a stop rule matched, or the caller cancelled).
    Stop,
}

/// Generates from `prompt`, calling `on_token(id)` for each new token as it is drawn (the
/// end-of-generation token included, so callers can tell why it stopped).
pub async fn generate(
    shard: &Shard,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32),
) -> Result<(Vec<u32>, GenerateStats), ModelError> {
    generate_with(shard, prompt, opts, &mut |t| {
        on_token(t);
        if opts.stop_at_eog && tokenizer.is_end_of_generation(t) {
            Flow::Stop
        } else {
            Flow::Continue
        }
    })
    .await
}

/// Generates from `prompt` until `opts.max_tokens` or until `on_token` says stop (its own
/// stop rules; `opts.stop_at_eog` is [`generate`]'s). On devices that pipeline decode
/// ([`crate::Device::pipelines_decode`]) step n+1 is queued, its input the token step n drew
/// on the device, before step n's token is read, so the GPU has the next step while the host
/// waits for and hands on this one; a step queued past a stop is discarded (its key/value
/// writes lie past the sequence's end, in a cache that ends with this call). The tokens are
/// the same either way.
pub async fn generate_with(
    shard: &Shard,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<(Vec<u32>, GenerateStats), ModelError> {
    need_whole(shard)?;
    if shard.device().pipelines_decode() {
        return generate_pipelined(shard, prompt, opts, on_token).await;
    }
    let mut cache = shard.new_cache(prompt.len() + opts.max_tokens)?;
    let mut stats = GenerateStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut out = Vec::new();
    if opts.max_tokens == 0 {
        return Ok((out, stats));
    }
    let t0 = Instant::now();
    let mut params = opts.sample;
    params.step = 0;
    let mut next = sample(shard, &mut cache, ShardInput::Tokens(prompt), params).await?;
    stats.prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    loop {
        out.push(next);
        if on_token(next) == Flow::Stop || out.len() >= opts.max_tokens {
            break;
        }
        params.step = out.len() as u32;
        next = sample(shard, &mut cache, ShardInput::Tokens(&[next]), params).await?;
    }
    stats.decode_s = t1.elapsed().as_secs_f64();
    stats.generated = out.len();
    Ok((out, stats))
}

/// [`generate_with`] with one decode step always queued behind the one being read.
async fn generate_pipelined(
    shard: &Shard,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> Flow,
) -> Result<(Vec<u32>, GenerateStats), ModelError> {
    let mut cache = shard.new_cache(prompt.len() + opts.max_tokens)?;
    let mut stats = GenerateStats {
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    let mut out = Vec::new();
    if opts.max_tokens == 0 {
        return Ok((out, stats));
    }
    let dev = shard.device();
    let t0 = Instant::now();
    // Held to the end: each queued step reads the token the one before drew into the
    // scratch, so no other pass on this shard may run in between.
    let s = shard.scratch.lock().await;
    let mut params = opts.sample;
    params.step = 0;
    let mut pending = shard
        .queue_sample(&s, &mut cache, Some(prompt), params)
        .await?;
    // Tokens whose step is queued; never more than `max_tokens`, so the cache's capacity
    // (prompt plus `max_tokens`) holds every queued step.
    let mut queued = 1;
    let mut t1 = None;
    loop {
        let ahead = if queued < opts.max_tokens {
            params.step = queued as u32;
            queued += 1;
            Some(shard.queue_sample(&s, &mut cache, None, params).await?)
        } else {
            None
        };
        let b = dev.collect(pending).await?;
        let next = b
            .get(..4)
            .and_then(|b| <[u8; 4]>::try_from(b).ok())
            .map(u32::from_le_bytes)
            .ok_or(ModelError::WrongInput("a sampled token is 4 bytes"))?;
        if t1.is_none() {
            stats.prefill_s = t0.elapsed().as_secs_f64();
            t1 = Some(Instant::now());
        }
        out.push(next);
        if on_token(next) == Flow::Stop || out.len() >= opts.max_tokens {
            break;
        }
        match ahead {
            Some(p) => pending = p,
            None => break,
        }
    }
    stats.decode_s = t1.map_or(0.0, |t| t.elapsed().as_secs_f64());
    stats.generated = out.len();
    Ok((out, stats))
}

async fn sample(
    shard: &Shard,
    cache: &mut KvCache,
    input: ShardInput<'_>,
    params: SampleParams,
) -> Result<u32, ModelError> {
    match shard.forward(cache, input, Want::Sample(params)).await? {
        ShardOutput::Token(t) => Ok(t),
        _ => Err(ModelError::WrongInput("shard did not return a token")),
    }
}

/// Teacher-forced evaluation: after the prompt and after each continuation token but the
/// last, the model's argmax and its two largest logits.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Score {
    pub top1: Vec<u32>,
    pub top2_logits: Vec<[f32; 2]>,
}

/// Scores `continuation` after `prompt` in one batched forward pass over both (see
/// [`Shard::forward_logits_from`]); [`score_stepwise`] is the one-decode-step-per-position
/// form it replaces, kept to check it against.
pub async fn score(
    shard: &Shard,
    prompt: &[u32],
    continuation: &[u32],
) -> Result<Score, ModelError> {
    need_whole(shard)?;
    if prompt.is_empty() {
        return Err(ModelError::WrongInput("no tokens"));
    }
    let mut out = Score::default();
    if continuation.is_empty() {
        return Ok(out);
    }
    let mut tokens = prompt.to_vec();
    tokens.extend_from_slice(&continuation[..continuation.len() - 1]);
    let mut cache = shard.new_cache(tokens.len())?;
    let logits = shard
        .forward_logits_from(&mut cache, &tokens, prompt.len() - 1)
        .await?;
    for row in logits.chunks_exact(shard.config().vocab_size) {
        let (a, b) = top2(row);
        out.top1.push(a.0);
        out.top2_logits.push([a.1, b.1]);
    }
    Ok(out)
}

/// [`score`] by one decode step per position: the logits the matrix-vector kernels give.
pub async fn score_stepwise(
    shard: &Shard,
    prompt: &[u32],
    continuation: &[u32],
) -> Result<Score, ModelError> {
    need_whole(shard)?;
    let mut cache = shard.new_cache(prompt.len() + continuation.len())?;
    let mut out = Score::default();
    let mut input = prompt.to_vec();
    for next in continuation {
        let logits = match shard
            .forward(&mut cache, ShardInput::Tokens(&input), Want::Logits)
            .await?
        {
            ShardOutput::Logits(l) => l,
            _ => return Err(ModelError::WrongInput("shard did not return logits")),
        };
        let (a, b) = top2(&logits);
        out.top1.push(a.0);
        out.top2_logits.push([a.1, b.1]);
        input = vec![*next];
    }
    Ok(out)
}

/// The two largest entries as (index, value), the first index winning ties.
pub fn top2(x: &[f32]) -> ((u32, f32), (u32, f32)) {
    let mut a = (0u32, f32::NEG_INFINITY);
    let mut b = (0u32, f32::NEG_INFINITY);
    for (i, &v) in x.iter().enumerate() {
        if v > a.1 {
            b = a;
            a = (i as u32, v);
        } else if v > b.1 {
            b = (i as u32, v);
        }
    }
    (a, b)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::ModelConfig;
    use crate::model::synthetic::SyntheticModel;

    fn cpu() -> Arc<crate::backend::Device> {
        let sel = crate::Selection {
            backend: Some("cpu".into()),
            device: None,
        };
        Arc::new(
            crate::device::discover_blocking()
                .open_blocking(&sel)
                .expect("cpu backend"),
        )
    }

    /// The batched score against one decode step per position on the cpu backend, with a
    /// batch limit of 8 so the 21 positions span three submissions and the first rows with
    /// logits start inside the second. Products sum in another order in the tiled and the
    /// matrix-vector kernels: logits within 1e-3 of the largest, and the same argmax wherever
    /// the stepwise top two are apart by more than that.
    #[test]
    fn batched_score_matches_one_decode_step_per_position() {
        let mut cfg = ModelConfig::synthetic("135m").expect("135m shape");
        cfg.n_layers = 3;
        cfg.vocab_size = 512;
        let model = SyntheticModel::new(&cfg, 11);
        let shard = Shard::load(cpu(), &model, 0, cfg.n_layers, 8, &mut |_, _| {}).unwrap();
        let prompt: Vec<u32> = (0..11).map(|i| (i * 41 + 3) % 512).collect();
        let cont: Vec<u32> = (0..10).map(|i| (i * 97 + 20) % 512).collect();
        let batched = pollster::block_on(score(&shard, &prompt, &cont)).unwrap();
        let stepwise = pollster::block_on(score_stepwise(&shard, &prompt, &cont)).unwrap();
        assert_eq!(batched.top1.len(), cont.len());
        assert_eq!(stepwise.top1.len(), cont.len());
        let scale = 1.0
            + stepwise
                .top2_logits
                .iter()
                .fold(0f32, |m, l| m.max(l[0].abs()));
        let tol = 1e-3 * scale;
        let pairs = batched.top2_logits.iter().zip(&stepwise.top2_logits);
        for (i, (&b, &s)) in pairs.enumerate() {
            assert!(
                (b[0] - s[0]).abs() <= tol && (b[1] - s[1]).abs() <= tol,
                "position {i}: top-2 logits {b:?} batched, {s:?} stepwise (allowed {tol})"
            );
            if s[0] - s[1] > 2.0 * tol {
                assert_eq!(batched.top1[i], stepwise.top1[i], "position {i}");
            }
        }
    }

    #[test]
    fn batched_score_edges() {
        let mut cfg = ModelConfig::synthetic("tiny").expect("tiny shape");
        cfg.n_layers = 2;
        let model = SyntheticModel::new(&cfg, 5);
        let shard = Shard::load(cpu(), &model, 0, cfg.n_layers, 4, &mut |_, _| {}).unwrap();
        let empty = pollster::block_on(score(&shard, &[1, 2], &[])).unwrap();
        assert!(empty.top1.is_empty());
        let err = pollster::block_on(score(&shard, &[], &[1])).unwrap_err();
        assert!(err.to_string().contains("no tokens"), "{err}");
        let err = pollster::block_on(score(&shard, &[1, 600], &[2])).unwrap_err();
        assert!(err.to_string().contains("outside the vocabulary"), "{err}");
        // One continuation token: the logits after the prompt only, as a decode step gives.
        let one = pollster::block_on(score(&shard, &[1, 2, 3, 4, 5], &[9])).unwrap();
        let step = pollster::block_on(score_stepwise(&shard, &[1, 2, 3, 4, 5], &[9])).unwrap();
        assert_eq!(one.top1.len(), 1);
        assert!((one.top2_logits[0][0] - step.top2_logits[0][0]).abs() < 1e-2);
    }
}

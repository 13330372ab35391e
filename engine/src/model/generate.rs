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

/// Generates from `prompt`, calling `on_token(id)` for each new token as it is drawn (the
/// end-of-generation token included, so callers can tell why it stopped).
pub async fn generate(
    shard: &Shard,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32),
) -> Result<(Vec<u32>, GenerateStats), ModelError> {
    need_whole(shard)?;
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
        on_token(next);
        if out.len() >= opts.max_tokens
            || (opts.stop_at_eog && tokenizer.is_end_of_generation(next))
        {
            break;
        }
        params.step = out.len() as u32;
        next = sample(shard, &mut cache, ShardInput::Tokens(&[next]), params).await?;
    }
    stats.decode_s = t1.elapsed().as_secs_f64();
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

pub async fn score(
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

//! `cairn bench --concurrency 1,4,16`: aggregate decode tokens/s of several sequences decoded
//! together through one stage's paged pool (continuous batching), each count measured in the
//! same run, so the gain over one sequence is a ratio on the same device.

use std::time::Instant;

use anyhow::{Result, bail};
use cairn_engine::kernels::SampleParams;
use cairn_engine::model::shard::{BatchItem, MAX_BATCH_SEQS};
use cairn_engine::model::{SeqKv, Shard, ShardInput, ShardOutput, Want};

use super::bench::prompt_ids;

/// One concurrency's figures.
pub struct Level {
    pub sequences: usize,
    /// Every sequence's decode tokens over the decode time.
    pub aggregate_tok_s: f64,
    /// The prompts, all prefilled in one batched call.
    pub prefill_tok_s: f64,
}

/// Parses `1,4,16`.
pub fn parse_levels(s: &str) -> Result<Vec<usize>> {
    let mut v = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let n: usize = part
            .parse()
            .map_err(|_| anyhow::anyhow!("--concurrency: '{part}' is not a whole number"))?;
        if n == 0 || n > MAX_BATCH_SEQS {
            bail!("--concurrency: {n} is outside 1..={MAX_BATCH_SEQS}");
        }
        v.push(n);
    }
    if v.is_empty() {
        bail!("--concurrency needs at least one count, as in 1,4,16");
    }
    Ok(v)
}

/// `n` sequences of `prompt_tokens` (each its own prompt), prefilled together, then
/// `gen_tokens` greedy steps of all of them at once.
pub fn measure(shard: &Shard, n: usize, prompt_tokens: usize, gen_tokens: usize) -> Result<Level> {
    let vocab = shard.config().vocab_size;
    let per_pos = shard.kv_bytes_per_position().max(1);
    let positions = n * (prompt_tokens + gen_tokens + 16);
    let mut pool = shard.new_pool(per_pos * positions as u64 * 2)?;
    let mut seqs: Vec<SeqKv> = (0..n)
        .map(|_| SeqKv::new(prompt_tokens + gen_tokens + 1))
        .collect();
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| prompt_ids(prompt_tokens + i, vocab).split_off(i))
        .collect();
    let greedy = |step: u32| {
        Want::Sample(SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            step,
        })
    };
    let mut run = |inputs: &[Vec<u32>], step: u32| -> Result<Vec<u32>> {
        let mut items: Vec<BatchItem> = seqs
            .iter_mut()
            .zip(inputs)
            .map(|(seq, input)| BatchItem {
                seq,
                input: ShardInput::Tokens(input),
                want: greedy(step),
            })
            .collect();
        let outs = pollster::block_on(shard.forward_batch(&mut pool, &mut items))?;
        outs.into_iter()
            .map(|o| match o? {
                ShardOutput::Token(t) => Ok(t),
                _ => bail!("a batched step gave no token"),
            })
            .collect()
    };
    let t0 = Instant::now();
    let mut next = run(&prompts, 0)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for step in 1..gen_tokens {
        let inputs: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        next = run(&inputs, step as u32)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    Ok(Level {
        sequences: n,
        aggregate_tok_s: (n * (gen_tokens - 1)) as f64 / decode_s,
        prefill_tok_s: (n * prompt_tokens) as f64 / prefill_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_and_refuse_nonsense() {
        assert_eq!(parse_levels("1,4, 16").unwrap(), vec![1, 4, 16]);
        assert!(parse_levels("0").is_err());
        assert!(parse_levels("4,x").is_err());
        assert!(parse_levels("").is_err());
        assert!(parse_levels("1000").is_err());
    }
}

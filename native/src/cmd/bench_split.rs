//! `cairn bench --device A,B[,..] [--split layers|tensor|all]`: one model run as one stage
//! over several devices of this host, split by layers (a pipeline inside the process) or by
//! tensors (each device a part of every layer), against the first device alone, all in the
//! same run and through the same code path (a stage's batched pass over its paged pools), so
//! the ratios compare like with like.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use cairn_engine::Device;
use cairn_engine::gguf::TensorSource;
use cairn_engine::kernels::SampleParams;
use cairn_engine::model::{
    ModelConfig, ShardInput, ShardOutput, ShardStack, Split, StackItem, StackSeq, Want,
};
use serde_json::{Value, json};

use super::bench::prompt_ids;

/// Which splits `--split` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SplitChoice {
    Layers,
    Tensor,
    /// Both, each against the first device alone.
    All,
}

/// What the benchmark needs of `cairn bench`'s arguments.
pub struct Setup<'a> {
    pub devices: Vec<Arc<Device>>,
    pub src: &'a dyn TensorSource,
    pub cfg: &'a ModelConfig,
    pub what: &'a str,
    pub split: SplitChoice,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub runs: usize,
    pub concurrency: Vec<usize>,
    pub json: bool,
}

/// One arrangement's figures.
struct Figures {
    load_s: f64,
    prefill_tok_s: f64,
    decode_tok_s: f64,
    decode_ms: f64,
    /// `(sequences, aggregate decode tok/s)`.
    levels: Vec<(usize, f64)>,
    /// The greedy tokens of the single stream (the first sequence of the first run).
    tokens: Vec<u32>,
}

/// One measurement: prompt tok/s, decode tok/s, the median step in ms, and the first
/// sequence's tokens.
type Measured = (f64, f64, f64, Vec<u32>);

fn greedy(step: u32) -> Want {
    Want::Sample(SampleParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        step,
    })
}

/// `n` sequences prefilled together, then `generate` greedy steps of all of them at once:
/// prompt tokens/s, decode tokens/s over all of them, the median step in ms, and the first
/// sequence's tokens.
fn measure(stack: &ShardStack, n: usize, prompt: usize, generate: usize) -> Result<Measured> {
    let vocab = stack.config().vocab_size;
    let pieces = stack.pieces().len();
    let positions = (n * (prompt + generate + 16)) as u64;
    let total = stack.kv_bytes_per_position().max(1);
    let mut pool = stack.new_pool(|p| p.kv_bytes_per_position() * positions * 2 + total)?;
    let mut seqs: Vec<StackSeq> = (0..n)
        .map(|_| StackSeq::new(pieces, prompt + generate + 1))
        .collect();
    let prompts: Vec<Vec<u32>> = (0..n)
        .map(|i| prompt_ids(prompt + i, vocab).split_off(i))
        .collect();
    let mut run = |inputs: &[Vec<u32>], step: u32| -> Result<Vec<u32>> {
        let mut items: Vec<StackItem> = seqs
            .iter_mut()
            .zip(inputs)
            .map(|(seq, input)| StackItem {
                seq,
                input: ShardInput::Tokens(input),
                want: greedy(step),
            })
            .collect();
        let outs = pollster::block_on(stack.forward_batch(&mut pool, &mut items))?;
        outs.into_iter()
            .map(|o| match o? {
                ShardOutput::Token(t) => Ok(t),
                _ => bail!("a step gave no token"),
            })
            .collect()
    };
    let t0 = Instant::now();
    let mut next = run(&prompts, 0)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let mut tokens = vec![next[0]];
    let mut steps = Vec::with_capacity(generate);
    let t1 = Instant::now();
    for step in 1..generate {
        let s = Instant::now();
        let inputs: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        next = run(&inputs, step as u32)?;
        steps.push(s.elapsed().as_secs_f64() * 1e3);
        tokens.push(next[0]);
    }
    let decode_s = t1.elapsed().as_secs_f64();
    Ok((
        (n * prompt) as f64 / prefill_s,
        (n * (generate - 1)) as f64 / decode_s,
        super::bench::median(steps),
        tokens,
    ))
}

fn figures(stack: &ShardStack, load_s: f64, s: &Setup<'_>) -> Result<Figures> {
    // Warm-up over the whole prompt: compiles every kernel the prefill and decode take (the
    // prompt products' kernels depend on its length; `bench.rs` says what a short one missed).
    measure(stack, 1, s.prompt_tokens, 3)?;
    let mut one = Vec::with_capacity(s.runs);
    for _ in 0..s.runs {
        one.push(measure(stack, 1, s.prompt_tokens, s.gen_tokens)?);
    }
    let med = |f: fn(&Measured) -> f64| super::bench::median(one.iter().map(f).collect());
    let mut levels = Vec::new();
    for &n in &s.concurrency {
        // Best of the runs: the batch's own speed, not the machine's hiccups.
        let mut best = 0f64;
        for _ in 0..s.runs {
            best = best.max(measure(stack, n, s.prompt_tokens, s.gen_tokens)?.1);
        }
        levels.push((n, best));
    }
    Ok(Figures {
        load_s,
        prefill_tok_s: med(|r| r.0),
        decode_tok_s: med(|r| r.1),
        decode_ms: med(|r| r.2),
        tokens: one.first().map(|r| r.3.clone()).unwrap_or_default(),
        levels,
    })
}

/// Loads the model as one stage over `devices` split as `split`, and measures it.
fn arrangement(devices: &[Arc<Device>], split: Split, s: &Setup<'_>) -> Result<Figures> {
    let offered: Vec<(Arc<Device>, u64)> = devices
        .iter()
        .map(|d| (Arc::clone(d), d.info().memory_bytes.max(1)))
        .collect();
    let t0 = Instant::now();
    let stack = ShardStack::load_split(&offered, s.src, 0, s.cfg.n_layers, split, &mut |_, _| {})?;
    for d in devices {
        d.sync_blocking()?;
    }
    let load_s = t0.elapsed().as_secs_f64();
    figures(&stack, load_s, s)
}

pub fn run(s: Setup<'_>) -> Result<()> {
    let n = s.devices.len();
    let ids: Vec<String> = s.devices.iter().map(|d| d.info().id.clone()).collect();
    let mut plan: Vec<(String, Vec<Arc<Device>>, Split)> = vec![(
        format!("one device ({})", ids[0]),
        vec![Arc::clone(&s.devices[0])],
        Split::Layers,
    )];
    if matches!(s.split, SplitChoice::Layers | SplitChoice::All) {
        plan.push((format!("layers over {n}"), s.devices.clone(), Split::Layers));
    }
    if matches!(s.split, SplitChoice::Tensor | SplitChoice::All) {
        plan.push((format!("tensor over {n}"), s.devices.clone(), Split::Tensor));
    }
    if !s.json {
        eprintln!(
            "{} over {} ({}): {} prompt tokens, {} generated, {} runs",
            s.what,
            ids.join(","),
            s.devices[0].kind(),
            s.prompt_tokens,
            s.gen_tokens,
            s.runs
        );
    }
    let mut rows: Vec<Value> = Vec::new();
    let mut base: Option<(f64, Vec<(usize, f64)>)> = None;
    let mut base_tokens: Option<Vec<u32>> = None;
    for (label, devs, split) in plan {
        let split_name = if devs.len() == 1 {
            "one".to_string()
        } else {
            split.to_string()
        };
        match arrangement(&devs, split, &s) {
            Ok(f) => {
                if devs.len() == 1 {
                    base = Some((f.decode_tok_s, f.levels.clone()));
                    base_tokens = Some(f.tokens.clone());
                }
                // How many of the greedy tokens agree with one device's, from the first: a
                // split sums in another order, so a near-tie (common on random weights) may
                // go the other way; a wrong split parts at once.
                let same = base_tokens
                    .as_ref()
                    .map(|b| b.iter().zip(&f.tokens).take_while(|(x, y)| x == y).count());
                // Without the baseline (the model does not fit one device), no ratios.
                let (b_decode, b_levels) = base.clone().unwrap_or((f64::NAN, Vec::new()));
                let vs = f.decode_tok_s / b_decode;
                let levels: Vec<Value> = f
                    .levels
                    .iter()
                    .map(|&(k, tok_s)| {
                        let b = b_levels.iter().find(|l| l.0 == k).map(|l| l.1);
                        json!({
                            "sequences": k,
                            "aggregate_decode_tokens_per_s": tok_s,
                            "vs_one_device": b.map(|b| tok_s / b),
                        })
                    })
                    .collect();
                if !s.json {
                    println!(
                        "  {label:<26} prefill {:>9.1} tok/s  decode {:>8.1} tok/s ({:.2} ms/token, {:.2}x one device)  load {:.1} s{}",
                        f.prefill_tok_s,
                        f.decode_tok_s,
                        f.decode_ms,
                        vs,
                        f.load_s,
                        match same {
                            Some(k) if devs.len() > 1 =>
                                format!("  greedy tokens as one device: {k} of {}", f.tokens.len()),
                            _ => String::new(),
                        }
                    );
                    for l in &levels {
                        println!(
                            "  {:<26}   {} at once: {:.1} tok/s in all{}",
                            "",
                            l["sequences"],
                            l["aggregate_decode_tokens_per_s"]
                                .as_f64()
                                .unwrap_or(f64::NAN),
                            l["vs_one_device"]
                                .as_f64()
                                .map(|r| format!(", {r:.2}x one device"))
                                .unwrap_or_default()
                        );
                    }
                }
                rows.push(json!({
                    "split": split_name,
                    "devices": devs.iter().map(|d| d.info().id.clone()).collect::<Vec<_>>(),
                    "load_s": f.load_s,
                    "prefill_tokens_per_s": f.prefill_tok_s,
                    "decode_tokens_per_s": f.decode_tok_s,
                    "decode_ms_per_token_median": f.decode_ms,
                    "decode_vs_one_device": if vs.is_finite() { json!(vs) } else { Value::Null },
                    "greedy_tokens": f.tokens.len(),
                    "greedy_tokens_as_one_device": same,
                    "concurrency": levels,
                }));
            }
            Err(e) => {
                if !s.json {
                    println!("  {label:<26} not run: {e:#}");
                }
                rows.push(json!({
                    "split": split_name,
                    "devices": devs.iter().map(|d| d.info().id.clone()).collect::<Vec<_>>(),
                    "error": format!("{e:#}"),
                }));
            }
        }
    }
    if s.json {
        println!(
            "{}",
            json!({
                "model": s.what,
                "backend": s.devices[0].kind().name(),
                "devices": ids,
                "device_name": s.devices[0].info().name,
                "prompt_tokens": s.prompt_tokens,
                "gen_tokens": s.gen_tokens,
                "runs": s.runs,
                "arrangements": rows,
            })
        );
    }
    Ok(())
}

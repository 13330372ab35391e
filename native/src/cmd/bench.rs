//! `cairn bench`: prefill and decode tokens/s of a real or synthetic model on one device,
//! set against what the device's memory can deliver (a device-to-device copy measured in the
//! same run) and what a dispatch costs.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use cairn_engine::gguf::{GgufFile, MappedGguf, TensorSource};
use cairn_engine::kernels::{Add, BufferCopy, Op, SampleParams};
use cairn_engine::model::generate::{GenerateOptions, generate};
use cairn_engine::model::shard::max_batch_for;
use cairn_engine::model::synthetic::SyntheticModel;
use cairn_engine::model::weights::shard_weight_bytes;
use cairn_engine::model::{ModelConfig, Shard};
use cairn_engine::tokenizer::{Tokenizer, TokenizerSpec};
use cairn_engine::{BackendKind, Device};

use super::model_args::ModelArgs;
use crate::loading::{self, DeviceArgs};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    device: DeviceArgs,
    /// Prompt length; the prompt is token ids (1000 + 7919 i) mod vocab.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens generated after the prompt (greedy, no stop at end-of-generation).
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Measured runs after a warm-up over the same prompt; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Also decode this many sequences at once through the paged pool (continuous batching),
    /// each count in the same run: aggregate tokens/s and the gain over one, e.g. `1,4,16`.
    #[arg(long)]
    concurrency: Option<String>,
    /// With several devices (`--device a,b`): run the model as one stage over them, split by
    /// `layers`, by `tensor` (each device a part of every layer) or `all` (both), each
    /// against the first device alone in the same run (default `all`).
    #[arg(long, value_enum)]
    split: Option<super::bench_split::SplitChoice>,
    /// Something other than the model to measure (`cairn bench link`).
    #[command(subcommand)]
    which: Option<Which>,
}

#[derive(clap::Subcommand)]
pub enum Which {
    /// Peer links: RTT and throughput between two native peers on loopback.
    Link(super::link_bench::Args),
    /// The cluster: decode with 1, 2, 3 workers against one device, concurrent requests,
    /// recovery after a worker is killed, and the placement preview against measurement.
    Cluster(super::cluster_bench::Args),
}

enum Source {
    File(Box<MappedGguf>),
    Synthetic(SyntheticModel),
}

impl Source {
    fn tensors(&self) -> &dyn TensorSource {
        match self {
            Source::File(f) => f.as_ref(),
            Source::Synthetic(s) => s,
        }
    }
}

/// The prompt every backend (and llama.cpp, in scripts/bench-cpu.sh) is fed.
pub fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((1000 + 7919 * i as u64) % vocab as u64) as u32)
        .collect()
}

fn gib(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// Fails with a clear message when the model cannot fit the device: a tensor larger than the
/// largest buffer the device binds, or more bytes than it has.
fn check_fit(
    dev: &Device,
    file: &GgufFile,
    cfg: &ModelConfig,
    weights: u64,
    capacity: usize,
    what: &str,
) -> Result<()> {
    let info = dev.info();
    let max = dev.max_buffer_bytes();
    // wgpu and vulkan hold a larger tensor as several buffers of whole rows: there a row is
    // what must fit.
    let parts = matches!(dev.kind(), BackendKind::Wgpu | BackendKind::Vulkan);
    let unit = |t: &cairn_engine::gguf::TensorInfo| {
        let rows = t.dims.iter().skip(1).product::<u64>().max(1);
        if parts { t.n_bytes / rows } else { t.n_bytes }
    };
    if let Some(t) = file.tensors.iter().max_by_key(|t| unit(t))
        && unit(t) > max
    {
        let dims: Vec<String> = t.dims.iter().rev().map(|d| d.to_string()).collect();
        bail!(
            "{what} does not fit on {} ({}): its largest tensor, {} ({}, {}), is {}, and this \
             device binds at most {} per buffer (max_storage_buffer_binding_size {}, \
             max_buffer_size {}). Choose a smaller model (--synthetic 135m), or a device with \
             larger bindings (`cairn devices --json` lists each device's limits).",
            info.name,
            info.id,
            t.name,
            t.ty.name(),
            dims.join(" x "),
            gib(t.n_bytes),
            gib(max),
            info.limits.max_storage_buffer_binding_size,
            info.limits.max_buffer_size,
        );
    }
    let kv = cfg.n_layers as u64 * capacity as u64 * cfg.kv_bytes_per_token_layer();
    let need = weights + kv;
    if info.memory_bytes > 0 && need > info.memory_bytes {
        bail!(
            "{what} needs {} of weights and {} of KV cache, more than the {}{} of {} ({})",
            gib(weights),
            gib(kv),
            if info.memory_exact { "" } else { "~" },
            gib(info.memory_bytes),
            info.name,
            info.id
        );
    }
    Ok(())
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        0.5 * (v[m - 1] + v[m])
    }
}

/// Seconds per call of `f`, the median of `reps`.
fn time_median(reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        v.push(t.elapsed().as_secs_f64());
    }
    Ok(median(v))
}

struct CopyCeiling {
    bytes: u64,
    /// `Op::Copy` (on the cpu backend, memcpy).
    gb_per_s: f64,
    /// `Op::Add` over buffers half the copy's size (GPU backends).
    stream_gb_per_s: f64,
}

impl CopyCeiling {
    /// The faster of the two: what a bandwidth-bound kernel can hope for on this device.
    fn best(&self) -> f64 {
        self.gb_per_s.max(self.stream_gb_per_s)
    }
}

/// Device-to-device copy bandwidth, read plus write counted (as PyTorch's figures count it),
/// and a streaming kernel's (on NVIDIA through Vulkan, buffer copies run well below what
/// kernels reach). On the cpu backend, a plain memcpy between two host buffers: the backend's own `Op::Copy`
/// allocates a staging vector per copy, which measures the allocator, not the memory.
fn copy_bandwidth(dev: &Device, free: u64) -> Result<CopyCeiling> {
    if dev.kind() == BackendKind::Cpu {
        let bytes = (256u64 << 20).min(free / 4).max(1 << 20);
        let src = vec![0x5au8; bytes as usize];
        let mut dst = vec![0u8; bytes as usize];
        dst.copy_from_slice(&src);
        let s = time_median(7, || {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            Ok(())
        })?;
        let gb_per_s = 2.0 * bytes as f64 / s / 1e9;
        return Ok(CopyCeiling {
            bytes,
            gb_per_s,
            stream_gb_per_s: f64::NAN,
        });
    }
    let real_gpu = dev.kind() != BackendKind::Cpu && !dev.info().is_software();
    let want: u64 = if real_gpu { 512 << 20 } else { 32 << 20 };
    let bytes = want.min(dev.max_buffer_bytes()).min(free / 4).max(1 << 20) / 4 * 4;
    let src = dev.upload("copy src", &vec![0x5a; bytes as usize])?;
    let dst = dev.alloc("copy dst", bytes)?;
    let n = if real_gpu { 8 } else { 2 };
    let ops = vec![
        Op::Copy(BufferCopy {
            src: &src,
            src_offset: 0,
            dst: &dst,
            dst_offset: 0,
            bytes
        });
        n
    ];
    dev.run(&ops)?;
    dev.sync_blocking()?;
    let s = time_median(if real_gpu { 10 } else { 5 }, || {
        dev.run(&ops)?;
        Ok(dev.sync_blocking()?)
    })?;
    let gb_per_s = 2.0 * (bytes * n as u64) as f64 / s / 1e9;
    drop((src, dst));
    // A kernel streaming memory, `out = a + b`: two reads and a write per element.
    let sb = (bytes / 2).max(4) / 4 * 4;
    let (x, y, z) = (
        dev.alloc("stream a", sb)?,
        dev.alloc("stream b", sb)?,
        dev.alloc("stream out", sb)?,
    );
    let ops = vec![
        Op::Add(Add {
            a: &x,
            b: &y,
            out: &z,
            n: (sb / 4) as u32
        });
        n
    ];
    dev.run(&ops)?;
    dev.sync_blocking()?;
    let s = time_median(if real_gpu { 10 } else { 5 }, || {
        dev.run(&ops)?;
        Ok(dev.sync_blocking()?)
    })?;
    Ok(CopyCeiling {
        bytes,
        gb_per_s,
        stream_gb_per_s: 3.0 * (sb * n as u64) as f64 / s / 1e9,
    })
}

struct DispatchCost {
    /// One tiny dispatch in its own submission, waited for.
    submit_sync_us: f64,
    /// Each further tiny dispatch in the same submission.
    per_dispatch_us: f64,
}

fn dispatch_cost(dev: &Device) -> Result<DispatchCost> {
    const N: usize = 256;
    let bytes: Vec<u8> = (0..64).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let a = dev.upload("a", &bytes)?;
    let b = dev.upload("b", &bytes)?;
    let out = dev.alloc("out", 256)?;
    let ops = vec![
        Op::Add(Add {
            a: &a,
            b: &b,
            out: &out,
            n: 64
        });
        N
    ];
    let run = |k: usize| -> Result<()> {
        dev.run(&ops[..k])?;
        Ok(dev.sync_blocking()?)
    };
    run(N)?;
    let one = time_median(50, || run(1))?;
    let many = time_median(15, || run(N))?;
    Ok(DispatchCost {
        submit_sync_us: one * 1e6,
        per_dispatch_us: (many - one).max(0.0) / (N - 1) as f64 * 1e6,
    })
}

/// What one decode step queues, following `Shard::encode_blocks` and `encode_head`: the
/// embedding; per block 15 kernels (2 norms, 7 matrix-vector products, 2 ropes, attention,
/// silu-mul, 2 adds) and 2 copies into the KV cache; then a copy, the final norm, the output
/// head and the sampler. On wgpu each copy ends a compute pass.
struct StepShape {
    dispatches: usize,
    copies: usize,
}

fn step_shape(cfg: &ModelConfig) -> StepShape {
    StepShape {
        dispatches: 1 + 15 * cfg.n_layers + 3,
        copies: 2 * cfg.n_layers + 1,
    }
}

/// Weight bytes one decode step reads: every block matrix and norm, the output head (the
/// whole embedding matrix when tied), and one embedding row.
fn weight_bytes_per_token(src: &dyn TensorSource, cfg: &ModelConfig) -> u64 {
    let file = src.gguf();
    let all = shard_weight_bytes(src, cfg, 0, cfg.n_layers);
    let embd = file.tensor("token_embd.weight").map_or(0, |t| t.n_bytes);
    let row = embd / cfg.vocab_size.max(1) as u64;
    if cfg.tied_output {
        // Counted once by shard_weight_bytes; the head reads all of it.
        all + row
    } else {
        all - embd + row
    }
}

/// Matrix elements a token passes through (for prefill GFLOP/s: 2 flops each).
fn matrix_params(cfg: &ModelConfig) -> f64 {
    let per_layer =
        2 * cfg.dim * cfg.q_dim() + 2 * cfg.dim * cfg.kv_dim() + 3 * cfg.dim * cfg.ffn_dim;
    (cfg.n_layers * per_layer + cfg.vocab_size * cfg.dim) as f64
}

/// `generate` needs a tokenizer only to stop at end-of-generation, which the benchmark
/// turns off; a synthetic model gets a one-token stand-in.
fn stand_in_tokenizer() -> Result<Tokenizer> {
    let spec = TokenizerSpec {
        model: "gpt2".into(),
        tokens: vec!["a".into()],
        ..Default::default()
    };
    Ok(Tokenizer::from_spec(&spec)?)
}

struct RunStats {
    prefill_tok_s: f64,
    decode_tok_s: f64,
    decode_ms_median: f64,
}

fn one_run(shard: &Shard, tok: &Tokenizer, prompt: &[u32], n_gen: usize) -> Result<RunStats> {
    let opts = GenerateOptions {
        max_tokens: n_gen,
        sample: SampleParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            step: 0,
        },
        stop_at_eog: false,
    };
    let mut stamps = Vec::with_capacity(n_gen);
    let (_, stats) = pollster::block_on(generate(shard, tok, prompt, &opts, &mut |_| {
        stamps.push(Instant::now())
    }))?;
    let steps: Vec<f64> = stamps
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
        .collect();
    Ok(RunStats {
        prefill_tok_s: stats.prefill_tokens_per_s(),
        decode_tok_s: stats.decode_tokens_per_s(),
        decode_ms_median: median(steps),
    })
}

pub fn run(a: Args) -> Result<()> {
    match a.which {
        Some(Which::Link(link)) => return super::link_bench::run(link),
        Some(Which::Cluster(cluster)) => return super::cluster_bench::run(cluster),
        None => {}
    }
    if a.prompt_tokens == 0 || a.gen_tokens < 2 || a.runs == 0 {
        bail!("--prompt-tokens must be at least 1, --gen-tokens at least 2, --runs at least 1");
    }
    let mut devices = loading::open_devices(&a.device)?;
    let (src, what, tokenizer) = match a.model.synthetic_config()? {
        Some((name, cfg)) => (
            Source::Synthetic(SyntheticModel::new(&cfg, 1)),
            format!("synthetic {name}"),
            stand_in_tokenizer()?,
        ),
        None => {
            let path = a.model.path()?;
            let file =
                MappedGguf::open(&path).with_context(|| format!("opening {}", path.display()))?;
            let tok = Tokenizer::from_spec(&file.file.tokenizer_spec()?)?;
            let name = path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            (Source::File(Box::new(file)), name, tok)
        }
    };
    let tensors = src.tensors();
    let cfg = ModelConfig::from_gguf(tensors.gguf())?;
    if devices.len() > 1 || a.split.is_some() {
        if devices.len() < 2 {
            bail!("--split needs several devices: --device ID,ID (an id may repeat)");
        }
        let concurrency = match &a.concurrency {
            Some(s) => super::bench_batch::parse_levels(s)?,
            None => Vec::new(),
        };
        return super::bench_split::run(super::bench_split::Setup {
            devices,
            src: tensors,
            cfg: &cfg,
            what: &what,
            split: a.split.unwrap_or(super::bench_split::SplitChoice::All),
            prompt_tokens: a.prompt_tokens,
            gen_tokens: a.gen_tokens,
            runs: a.runs,
            concurrency,
            json: a.json,
        });
    }
    let dev = devices.remove(0);
    let info = dev.info().clone();
    let capacity = a.prompt_tokens + a.gen_tokens;
    let weights = shard_weight_bytes(tensors, &cfg, 0, cfg.n_layers);
    check_fit(&dev, tensors.gguf(), &cfg, weights, capacity, &what)?;

    if !a.json {
        eprintln!(
            "loading {what} ({}) onto {} ({}, {})",
            gib(weights),
            info.name,
            dev.kind(),
            info.id
        );
    }
    let t0 = Instant::now();
    let shard = Shard::load(
        dev.clone(),
        tensors,
        0,
        cfg.n_layers,
        max_batch_for(&dev),
        &mut |_, _| {},
    )?;
    dev.sync_blocking()?;
    let load_s = t0.elapsed().as_secs_f64();

    let free = info.memory_bytes.saturating_sub(dev.live_bytes());
    let copy = copy_bandwidth(&dev, if free == 0 { u64::MAX } else { free })?;
    let cost = dispatch_cost(&dev)?;

    let prompt = prompt_ids(a.prompt_tokens, cfg.vocab_size);
    // Warm-up over the whole prompt: compiles every pipeline the measured runs use. The prompt
    // products' kernels depend on the prompt's length (on GPUs, tiles by shape), and the first
    // use of a tile kernel costs the driver's compilation: a warm-up of a few tokens left it in
    // the first measured run (512-token prompts at 130 to 600 tok/s against 1,100 to 2,500
    // after, on an H200).
    one_run(&shard, &tokenizer, &prompt, 3)?;
    let mut runs = Vec::with_capacity(a.runs);
    for r in 0..a.runs {
        let s = one_run(&shard, &tokenizer, &prompt, a.gen_tokens)?;
        if !a.json {
            eprintln!(
                "run {}: prefill {:.1} tok/s, decode {:.1} tok/s ({:.2} ms/token median)",
                r + 1,
                s.prefill_tok_s,
                s.decode_tok_s,
                s.decode_ms_median
            );
        }
        runs.push(s);
    }
    let levels = match &a.concurrency {
        Some(s) => {
            let mut out = Vec::new();
            for n in super::bench_batch::parse_levels(s)? {
                // Best of the runs: the batch's own speed, not the machine's hiccups.
                let mut best: Option<super::bench_batch::Level> = None;
                for _ in 0..a.runs {
                    let l = super::bench_batch::measure(&shard, n, a.prompt_tokens, a.gen_tokens)?;
                    if best
                        .as_ref()
                        .is_none_or(|b| l.aggregate_tok_s > b.aggregate_tok_s)
                    {
                        best = Some(l);
                    }
                }
                if let Some(l) = best {
                    if !a.json {
                        eprintln!(
                            "{n} at once: {:.1} tok/s decode in all, prompts {:.1} tok/s",
                            l.aggregate_tok_s, l.prefill_tok_s
                        );
                    }
                    out.push(l);
                }
            }
            out
        }
        None => Vec::new(),
    };
    let one = levels
        .iter()
        .find(|l| l.sequences == 1)
        .map(|l| l.aggregate_tok_s);
    let concurrency: Vec<serde_json::Value> = levels
        .iter()
        .map(|l| {
            serde_json::json!({
                "sequences": l.sequences,
                "aggregate_decode_tokens_per_s": l.aggregate_tok_s,
                "per_sequence_tokens_per_s": l.aggregate_tok_s / l.sequences as f64,
                "gain_over_one": one.map(|o| l.aggregate_tok_s / o),
                "prefill_tokens_per_s": l.prefill_tok_s,
            })
        })
        .collect();
    let prefill = median(runs.iter().map(|r| r.prefill_tok_s).collect());
    let decode = median(runs.iter().map(|r| r.decode_tok_s).collect());
    let step_ms = median(runs.iter().map(|r| r.decode_ms_median).collect());
    // The last run was a decode step: a backend that fuses ops says what it launched.
    let mut shape = step_shape(&cfg);
    if let Some(n) = dev.launches_in_last_run() {
        shape.dispatches = n;
        // cuda's launches include its copies; wgpu's stay buffer copies, counted apart.
        shape.copies = dev.copies_in_last_run().unwrap_or(0);
    }

    let wpt = weight_bytes_per_token(tensors, &cfg);
    // KV cache read by the decode steps, averaged: step i attends over prompt + i + 1 positions.
    let kv_row = cfg.n_layers as u64 * cfg.kv_bytes_per_token_layer();
    let kv_avg = (1..a.gen_tokens)
        .map(|i| (a.prompt_tokens + i) as u64 * kv_row)
        .sum::<u64>() as f64
        / (a.gen_tokens - 1) as f64;
    let bytes_per_token = wpt as f64 + kv_avg;
    let decode_gb_s = bytes_per_token * decode / 1e9;
    let overhead_ms =
        shape.dispatches as f64 * cost.per_dispatch_us / 1e3 + cost.submit_sync_us / 1e3;
    let prefill_gflop_s = 2.0 * matrix_params(&cfg) * prefill / 1e9;

    let out = serde_json::json!({
        "model": what,
        "synthetic": a.model.synthetic.is_some(),
        "backend": dev.kind().name(),
        "device": info.id,
        "device_name": info.name,
        "layers": cfg.n_layers,
        "dim": cfg.dim,
        "weight_bytes": weights,
        "load_s": load_s,
        "prompt_tokens": a.prompt_tokens,
        "gen_tokens": a.gen_tokens,
        "runs": a.runs,
        "prefill_tokens_per_s": prefill,
        "prefill_gflop_per_s": prefill_gflop_s,
        "decode_tokens_per_s": decode,
        "decode_ms_per_token_median": step_ms,
        "weight_bytes_per_token": wpt,
        "kv_bytes_per_token_avg": kv_avg,
        "decode_gb_per_s": decode_gb_s,
        "copy_bytes": copy.bytes,
        "copy_gb_per_s": copy.gb_per_s,
        "stream_gb_per_s": if copy.stream_gb_per_s.is_finite() { serde_json::json!(copy.stream_gb_per_s) } else { serde_json::Value::Null },
        "ceiling_gb_per_s": copy.best(),
        "decode_pct_of_ceiling": 100.0 * decode_gb_s / copy.best(),
        "dispatches_per_decode_step": shape.dispatches,
        "copies_per_decode_step": shape.copies,
        "submit_sync_us": cost.submit_sync_us,
        "per_dispatch_us": cost.per_dispatch_us,
        "dispatch_overhead_ms_per_step": overhead_ms,
        "concurrency": concurrency,
    });
    if a.json {
        println!("{out}");
        return Ok(());
    }
    let row = |k: &str, v: String| println!("  {k:<34} {v}");
    println!("{what} on {} ({}, {})", info.name, dev.kind(), info.id);
    row(
        "weights",
        format!(
            "{} ({} layers, width {})",
            gib(weights),
            cfg.n_layers,
            cfg.dim
        ),
    );
    row("load", format!("{load_s:.2} s"));
    row(
        "prefill",
        format!(
            "{prefill:.1} tok/s ({} tokens; {prefill_gflop_s:.1} GFLOP/s in matrices)",
            a.prompt_tokens
        ),
    );
    row(
        "decode",
        format!(
            "{decode:.1} tok/s ({step_ms:.2} ms/token median; {} tokens)",
            a.gen_tokens
        ),
    );
    row(
        "bytes read per decode token",
        format!(
            "{} weights + {} KV cache (average)",
            gib(wpt),
            gib(kv_avg as u64)
        ),
    );
    row(
        "decode bandwidth",
        format!(
            "{decode_gb_s:.1} GB/s = {:.0}% of the ceiling (the faster of the two below)",
            100.0 * decode_gb_s / copy.best()
        ),
    );
    let how = if dev.kind() == BackendKind::Cpu {
        "host memcpy"
    } else {
        "device-to-device copy"
    };
    row(
        "copy (read + write)",
        format!(
            "{:.1} GB/s ({how}, {} buffers)",
            copy.gb_per_s,
            gib(copy.bytes)
        ),
    );
    if copy.stream_gb_per_s.is_finite() {
        row(
            "streaming kernel (a + b)",
            format!("{:.1} GB/s", copy.stream_gb_per_s),
        );
    }
    row(
        "dispatches per decode step",
        format!(
            "{} (+{} copies), one submission",
            shape.dispatches, shape.copies
        ),
    );
    row(
        "dispatch cost",
        format!(
            "{:.2} us each in a batch; {:.0} us for a lone submission and wait",
            cost.per_dispatch_us, cost.submit_sync_us
        ),
    );
    row(
        "dispatch overhead per step",
        format!(
            "{overhead_ms:.2} ms of the {step_ms:.2} ms step ({:.0}%)",
            100.0 * overhead_ms / step_ms
        ),
    );
    for l in &levels {
        row(
            &format!("{} at once (batched)", l.sequences),
            format!(
                "{:.1} tok/s in all, {:.1} each{}",
                l.aggregate_tok_s,
                l.aggregate_tok_s / l.sequences as f64,
                one.map(|o| format!(", {:.2}x one", l.aggregate_tok_s / o))
                    .unwrap_or_default()
            ),
        );
    }
    Ok(())
}

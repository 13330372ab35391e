//! Kernel throughput on one device: f32 matmul GFLOP/s, quantized matrix-vector GB/s (bytes
//! of weights read), RMSNorm and decode attention, a device-to-device copy and a streaming
//! kernel (`a + b`) as the bandwidth ceiling, and what one tiny dispatch costs.
//!
//! The device: `CAIRN_BENCH_BACKEND` (`wgpu`, `cpu`, or `vulkan` with `--features vulkan`) and `CAIRN_BENCH_DEVICE` (an id from
//! `cairn devices`); by default the best wgpu adapter, else the CPU backend. Software
//! adapters (lavapipe) and the CPU backend get small sizes so `cargo bench` finishes in
//! minutes; real GPUs get sizes up to 8192 x 8192 (`CAIRN_BENCH_SIZES=small|full` overrides).
//!
//! Every timed iteration ends with `device.sync_blocking()`. Two modes per kernel:
//! - `batch`: many dispatches, queued as submissions of up to 16 dispatches each (the CPU
//!   encodes the next submission while the GPU runs the last), then one sync. Weight matrices
//!   rotate over enough copies that together exceed the GPU's last-level cache, so the figure
//!   is memory bandwidth, not cache bandwidth. This is the kernel's own throughput.
//! - `single`: one dispatch, one submission, one sync: what a lone op costs end to end.
//!
//! Criterion reports time per iteration and throughput (bytes, or flops as "elements", so
//! `Gelem/s` reads GFLOP/s). After criterion's report a summary table gives per-dispatch time,
//! GB/s or GFLOP/s and the percentage of the copy ceiling; `CAIRN_BENCH_JSON=path` also
//! writes it as JSON.

use std::cell::Cell;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cairn_engine::device::{Selection, discover_blocking_with};
use cairn_engine::kernels::{Add, Attention, BufferCopy, Linear, MatMul, Op, RmsNorm};
use cairn_engine::options::{EngineOptions, WgpuAttention, WgpuMatvec};
use cairn_engine::quant::GgmlType;
use cairn_engine::{BackendKind, Buffer, Device};
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput, measurement::WallTime};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Dispatches per submission in batch mode.
const PER_SUBMIT: usize = 16;
/// Rotated weight copies should together exceed this (H100 L2: 50 MB; H200: 60 MB).
const CACHE_BUST_BYTES: u64 = 192 << 20;

#[derive(Clone, Copy, PartialEq)]
enum Unit {
    Bytes,
    Flops,
    /// Tiny dispatches, where only the time per dispatch matters.
    Dispatch,
}

struct Record {
    name: String,
    unit: Unit,
    /// Bytes or flops of one dispatch.
    per_dispatch: f64,
    dispatches: usize,
    /// Criterion's sample count: the last `keep` calls are the measured ones (warm-up first).
    keep: usize,
    samples: Vec<(u64, Duration)>,
}

static RECORDS: Mutex<Vec<Record>> = Mutex::new(Vec::new());

fn record(name: &str, iters: u64, elapsed: Duration) {
    let mut r = RECORDS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(rec) = r.iter_mut().find(|x| x.name == name) {
        rec.samples.push((iters, elapsed));
    }
}

fn register(name: &str, unit: Unit, per_dispatch: f64, dispatches: usize, keep: usize) {
    let mut r = RECORDS.lock().unwrap_or_else(|e| e.into_inner());
    r.retain(|x| x.name != name);
    r.push(Record {
        name: name.into(),
        unit,
        per_dispatch,
        dispatches,
        keep,
        samples: Vec::new(),
    });
}

/// Sizes for one device class.
struct Tier {
    name: &'static str,
    matvec: Vec<(u32, u32)>,
    matvec_single: Vec<(u32, u32)>,
    matmul: Vec<u32>,
    copy_bytes: u64,
    /// Work per batch iteration: bytes for bandwidth kernels, flops for matmul.
    target_bytes: u64,
    target_flops: f64,
    max_dispatch: usize,
    rmsnorm: Vec<(u32, u32)>,
    /// (heads, kv_heads, head_dim, context)
    attention: Vec<(u32, u32, u32, u32)>,
    cache_bust: bool,
    sample_size: usize,
    measure: Duration,
}

impl Tier {
    fn full() -> Tier {
        Tier {
            name: "full",
            matvec: vec![
                (1536, 576),
                (2048, 2048),
                (4096, 4096),
                (14336, 4096),
                (8192, 8192),
            ],
            matvec_single: vec![(1536, 576), (8192, 8192)],
            matmul: vec![1024, 2048, 4096, 8192],
            copy_bytes: 1 << 30,
            target_bytes: 2 << 30,
            target_flops: 100e9,
            max_dispatch: 512,
            rmsnorm: vec![(4096, 1), (4096, 512)],
            attention: vec![
                (9, 3, 64, 1024),
                (32, 8, 128, 576),
                (32, 8, 128, 1024),
                (32, 8, 128, 8192),
            ],
            cache_bust: true,
            sample_size: 20,
            measure: Duration::from_secs(2),
        }
    }

    fn small() -> Tier {
        Tier {
            name: "small",
            matvec: vec![(1536, 576), (2048, 2048)],
            matvec_single: vec![(1536, 576)],
            matmul: vec![128, 256, 512],
            copy_bytes: 32 << 20,
            target_bytes: 16 << 20,
            target_flops: 0.4e9,
            max_dispatch: 32,
            rmsnorm: vec![(576, 1), (576, 128)],
            attention: vec![(9, 3, 64, 256), (9, 3, 64, 1024)],
            cache_bust: false,
            sample_size: 10,
            measure: Duration::from_secs(2),
        }
    }
}

/// `CAIRN_WGPU_MATVEC` (rows, stream, subgroup, int8; else auto) picks the wgpu and vulkan
/// matrix-vector kernels, as `cairn`'s `--wgpu-matvec` does; `CAIRN_WGPU_ATTENTION` (split,
/// single; else auto) their decode attention, as `--wgpu-attention` does, and
/// `CAIRN_WGPU_ATTENTION_KERNEL` (heads; else grouped) and `CAIRN_WGPU_ATTENTION_PIECE` its
/// split's first pass; `CAIRN_VULKAN_ZERO_INIT` (polyfill, off; else native, the default) the vulkan
/// backend's zeroing of workgroup memory.
fn options() -> EngineOptions {
    let mut o = EngineOptions::default();
    o.wgpu.attention = match std::env::var("CAIRN_WGPU_ATTENTION").as_deref() {
        Ok("split") => WgpuAttention::Split,
        Ok("single") => WgpuAttention::Single,
        _ => WgpuAttention::ByAdapter,
    };
    if std::env::var("CAIRN_WGPU_ATTENTION_KERNEL").as_deref() == Ok("heads") {
        o.wgpu.attention_kernel = cairn_engine::options::WgpuAttentionKernel::Heads;
    }
    o.wgpu.attention_piece = std::env::var("CAIRN_WGPU_ATTENTION_PIECE")
        .ok()
        .and_then(|v| v.parse().ok());
    o.vulkan.zero_init = match std::env::var("CAIRN_VULKAN_ZERO_INIT").as_deref() {
        Ok("polyfill") => cairn_engine::options::VulkanZeroInit::Polyfill,
        Ok("off") => cairn_engine::options::VulkanZeroInit::Off,
        _ => cairn_engine::options::VulkanZeroInit::Native,
    };
    o.wgpu.matvec = match std::env::var("CAIRN_WGPU_MATVEC").as_deref() {
        Ok("rows") => WgpuMatvec::Rows,
        Ok("stream") => WgpuMatvec::Stream,
        Ok("subgroup") => WgpuMatvec::Subgroup,
        Ok("int8") => WgpuMatvec::Int8,
        Ok("repacked") => WgpuMatvec::Repacked,
        Ok("wide") => WgpuMatvec::Wide,
        _ => WgpuMatvec::ByAdapter,
    };
    // The wide walk's shape (`cairn`'s `--wgpu-matvec-shape`), where given.
    if let Ok(shape) = std::env::var("CAIRN_WGPU_MATVEC_SHAPE") {
        o.wgpu.matvec_shape = shape
            .parse()
            .unwrap_or_else(|e| panic!("CAIRN_WGPU_MATVEC_SHAPE={shape}: {e}"));
    }
    o
}

fn open_device() -> Device {
    let found = discover_blocking_with(options());
    let backend = std::env::var("CAIRN_BENCH_BACKEND")
        .ok()
        .filter(|s| !s.is_empty());
    let device = std::env::var("CAIRN_BENCH_DEVICE")
        .ok()
        .filter(|s| !s.is_empty());
    let explicit = backend.is_some() || device.is_some();
    let sel = Selection {
        backend: backend.or_else(|| Some("wgpu".into())),
        device,
    };
    match found.open_blocking(&sel) {
        Ok(d) => d,
        Err(e) if !explicit => {
            eprintln!("no wgpu adapter ({e}); benchmarking the cpu backend");
            let cpu = Selection {
                backend: Some("cpu".into()),
                device: None,
            };
            found
                .open_blocking(&cpu)
                .expect("the cpu backend always opens")
        }
        Err(e) => panic!("CAIRN_BENCH_BACKEND/CAIRN_BENCH_DEVICE: {e}"),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn rand_f32(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Random quantized blocks with sane scales (random bytes would give NaN or inf scales).
/// The 32-element formats with their scale first get random bytes with fixed scales; the
/// others one random row, quantized, repeated (the bytes a product reads are the same).
fn rand_weights(rng: &mut StdRng, ty: GgmlType, rows: u32, cols: u32) -> Vec<u8> {
    let row_bytes = ty.row_bytes(cols as usize).expect("whole blocks");
    if !matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) {
        let row = cairn_engine::quant::quantize_row(ty, &rand_f32(rng, cols as usize));
        return row.repeat(rows as usize);
    }
    let mut out = vec![0u8; row_bytes * rows as usize];
    rng.fill(&mut out[..]);
    let d = 0x2400u16.to_le_bytes(); // f16 0.015625
    let m = 0xa400u16.to_le_bytes(); // f16 -0.015625
    for blk in out.chunks_exact_mut(ty.block_bytes()) {
        blk[..2].copy_from_slice(&d);
        if ty == GgmlType::Q4_1 {
            blk[2..4].copy_from_slice(&m);
        }
    }
    out
}

struct Bench<'a> {
    dev: &'a Device,
    gpu: bool,
    tier: Tier,
    /// The sample size of the group being run.
    keep: Cell<usize>,
}

impl Bench<'_> {
    /// How many dispatches a batch iteration runs, for `work` units each.
    fn dispatches(&self, work: f64, target: f64) -> usize {
        ((target / work.max(1.0)).ceil() as usize).clamp(4, self.tier.max_dispatch)
    }

    /// How many distinct copies of a `bytes`-sized input to rotate over.
    fn sets(&self, bytes: u64, dispatches: usize) -> usize {
        if !self.tier.cache_bust {
            return 1;
        }
        (CACHE_BUST_BYTES.div_ceil(bytes.max(1)) as usize).clamp(1, dispatches.min(64))
    }

    /// Times `ops` (one op per dispatch) in batch mode: submissions of `PER_SUBMIT`, one sync.
    fn batch(
        &self,
        g: &mut BenchmarkGroup<'_, WallTime>,
        id: &str,
        name: &str,
        unit: Unit,
        per: f64,
        ops: &[Op<'_>],
    ) {
        let full = format!("{name}/{id}");
        register(&full, unit, per, ops.len(), self.keep.get());
        let total = per * ops.len() as f64;
        g.throughput(match unit {
            Unit::Bytes => Throughput::Bytes(total as u64),
            Unit::Flops | Unit::Dispatch => Throughput::Elements(total as u64),
        });
        let dev = self.dev;
        g.bench_function(id, |b| {
            b.iter_custom(|iters| {
                dev.sync_blocking().expect("sync");
                let t = Instant::now();
                for _ in 0..iters {
                    for chunk in ops.chunks(PER_SUBMIT) {
                        dev.run(chunk).expect("run");
                    }
                    dev.sync_blocking().expect("sync");
                }
                let e = t.elapsed();
                record(&full, iters, e);
                e
            })
        });
    }

    /// One dispatch per submission and sync, rotating over `ops`.
    fn single(
        &self,
        g: &mut BenchmarkGroup<'_, WallTime>,
        id: &str,
        name: &str,
        unit: Unit,
        per: f64,
        ops: &[Op<'_>],
    ) {
        let full = format!("{name}/{id}");
        register(&full, unit, per, 1, self.keep.get());
        g.throughput(match unit {
            Unit::Bytes => Throughput::Bytes(per as u64),
            Unit::Flops | Unit::Dispatch => Throughput::Elements(per as u64),
        });
        let dev = self.dev;
        g.bench_function(id, |b| {
            b.iter_custom(|iters| {
                dev.sync_blocking().expect("sync");
                let t = Instant::now();
                for i in 0..iters as usize {
                    dev.run(&ops[i % ops.len()..][..1]).expect("run");
                    dev.sync_blocking().expect("sync");
                }
                let e = t.elapsed();
                record(&full, iters, e);
                e
            })
        });
    }

    fn group<'c>(&self, c: &'c mut Criterion, name: &str) -> BenchmarkGroup<'c, WallTime> {
        let mut g = c.benchmark_group(name);
        self.keep.set(self.tier.sample_size);
        g.sample_size(self.tier.sample_size)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(self.tier.measure);
        g
    }

    fn copy(&self, c: &mut Criterion) {
        let bytes = self
            .tier
            .copy_bytes
            .min(self.dev.max_buffer_bytes() / 4 * 4);
        let src = self.dev.alloc("copy src", bytes).expect("alloc");
        let dst = self.dev.alloc("copy dst", bytes).expect("alloc");
        // Fill the source with something other than zeros.
        let chunk = vec![0x5au8; (bytes.min(64 << 20)) as usize];
        let mut off = 0;
        while off < bytes {
            let n = chunk.len().min((bytes - off) as usize);
            self.dev.write(&src, off, &chunk[..n]).expect("write");
            off += n as u64;
        }
        let op = Op::Copy(BufferCopy {
            src: &src,
            src_offset: 0,
            dst: &dst,
            dst_offset: 0,
            bytes,
        });
        let n = if self.gpu { 8 } else { 2 };
        let ops = vec![op; n];
        let mut g = self.group(c, "copy");
        // Read plus write, as PyTorch's copy figures count it.
        let id = format!("d2d_{}MiB", bytes >> 20);
        self.batch(&mut g, &id, "copy", Unit::Bytes, 2.0 * bytes as f64, &ops);
        // A compute kernel streaming memory: `out = a + b` reads two buffers and writes one.
        // On NVIDIA through Vulkan, buffer copies (Op::Copy) run well below what kernels reach.
        drop((src, dst));
        let sbytes = (bytes / 2).max(4) / 4 * 4;
        let a = self.dev.alloc("stream a", sbytes).expect("alloc");
        let b = self.dev.alloc("stream b", sbytes).expect("alloc");
        let out = self.dev.alloc("stream out", sbytes).expect("alloc");
        let add = Op::Add(Add {
            a: &a,
            b: &b,
            out: &out,
            n: (sbytes / 4) as u32,
        });
        let id = format!("add_stream_3x{}MiB", sbytes >> 20);
        self.batch(
            &mut g,
            &id,
            "copy",
            Unit::Bytes,
            3.0 * sbytes as f64,
            &vec![add; n],
        );
        if !self.gpu {
            // The cpu backend's Op::Copy allocates a staging vector per copy; its memory
            // ceiling is a plain memcpy.
            let n = 256usize << 20;
            let src = vec![0x5au8; n];
            let mut dst = vec![0u8; n];
            let full = "copy/host_memcpy_256MiB".to_string();
            register(&full, Unit::Bytes, 2.0 * n as f64, 1, self.keep.get());
            g.throughput(Throughput::Bytes(2 * n as u64));
            g.bench_function("host_memcpy_256MiB", |b| {
                b.iter_custom(|iters| {
                    let t = Instant::now();
                    for _ in 0..iters {
                        dst.copy_from_slice(std::hint::black_box(&src));
                        std::hint::black_box(&mut dst);
                    }
                    let e = t.elapsed();
                    record(&full, iters, e);
                    e
                })
            });
        }
        g.finish();
    }

    fn dispatch_overhead(&self, c: &mut Criterion) {
        let n = 64u32;
        let a = self
            .dev
            .upload("a", &f32_bytes(&vec![1.0; n as usize]))
            .expect("upload");
        let b = self
            .dev
            .upload("b", &f32_bytes(&vec![2.0; n as usize]))
            .expect("upload");
        let out = self.dev.alloc("out", u64::from(n) * 4).expect("alloc");
        let op = Op::Add(Add {
            a: &a,
            b: &b,
            out: &out,
            n,
        });
        let mut g = self.group(c, "dispatch");
        // One submission of 256 tiny dispatches: per-dispatch cost once submission is paid.
        let ops = vec![op; 256];
        {
            let full = "dispatch/add64_x256_one_submit".to_string();
            register(&full, Unit::Dispatch, 1.0, ops.len(), self.keep.get());
            let dev = self.dev;
            g.throughput(Throughput::Elements(ops.len() as u64));
            g.bench_function("add64_x256_one_submit", |bn| {
                bn.iter_custom(|iters| {
                    dev.sync_blocking().expect("sync");
                    let t = Instant::now();
                    for _ in 0..iters {
                        dev.run(&ops).expect("run");
                        dev.sync_blocking().expect("sync");
                    }
                    let e = t.elapsed();
                    record(&full, iters, e);
                    e
                })
            });
        }
        self.single(
            &mut g,
            "add64_single",
            "dispatch",
            Unit::Dispatch,
            1.0,
            &ops[..1],
        );
        g.finish();
    }

    fn matmul(&self, c: &mut Criterion) {
        let mut rng = StdRng::seed_from_u64(7);
        let mut g = self.group(c, "matmul_f32");
        // Large products take tens of milliseconds: equal iterations per sample, fewer samples.
        g.sampling_mode(SamplingMode::Flat).sample_size(10);
        self.keep.set(10);
        for &n in &self.tier.matmul {
            let elems = (n as usize) * (n as usize);
            let bytes = elems as u64 * 4;
            if bytes > self.dev.max_buffer_bytes() {
                eprintln!("matmul {n}: {bytes} bytes exceeds the device's largest buffer; skipped");
                continue;
            }
            let av = f32_bytes(&rand_f32(&mut rng, elems));
            let bv = f32_bytes(&rand_f32(&mut rng, elems));
            let a = self.dev.upload("a", &av).expect("upload");
            let b = self.dev.upload("b", &bv).expect("upload");
            let cc = self.dev.alloc("c", bytes).expect("alloc");
            drop((av, bv));
            let flops = 2.0 * f64::from(n).powi(3);
            let op = Op::MatMul(MatMul {
                a: &a,
                b: &b,
                c: &cc,
                m: n,
                n,
                k: n,
            });
            let k =
                ((self.tier.target_flops / flops).ceil() as usize).clamp(1, self.tier.max_dispatch);
            if k > 1 {
                self.batch(
                    &mut g,
                    &format!("{n}x{n}x{n}/batch{k}"),
                    "matmul_f32",
                    Unit::Flops,
                    flops,
                    &vec![op; k],
                );
            }
            if k <= 4 || n == self.tier.matmul[0] {
                self.single(
                    &mut g,
                    &format!("{n}x{n}x{n}/single"),
                    "matmul_f32",
                    Unit::Flops,
                    flops,
                    &[op],
                );
            }
            self.dev.sync_blocking().expect("sync");
        }
        g.finish();
    }

    fn matvec(&self, c: &mut Criterion) {
        let mut rng = StdRng::seed_from_u64(11);
        // Q4_K_M files hold Q4_K, Q6_K and Q5_0 (rows of 256s only for the K-quants).
        for ty in [
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q5_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
        ] {
            let name = format!("matvec_{}", ty.name().to_ascii_lowercase());
            let mut g = self.group(c, &name);
            for &(rows, cols) in &self.tier.matvec {
                if ty.row_bytes(cols as usize).is_none() {
                    continue;
                }
                let w = rand_weights(&mut rng, ty, rows, cols);
                let bytes = w.len() as u64;
                if bytes > self.dev.max_buffer_bytes() {
                    eprintln!(
                        "{name} {rows}x{cols}: {bytes} bytes exceeds the device's largest buffer; skipped"
                    );
                    continue;
                }
                let k = self.dispatches(bytes as f64, self.tier.target_bytes as f64);
                let sets = self.sets(bytes, k);
                let ws: Vec<Buffer> = (0..sets)
                    .map(|_| {
                        // Repacked where the device repacks (`CAIRN_WGPU_MATVEC=repacked`).
                        let row_bytes = (w.len() / rows as usize) as u64;
                        self.dev
                            .upload_weights("w", &w, ty, row_bytes)
                            .expect("upload")
                    })
                    .collect();
                drop(w);
                let x = self
                    .dev
                    .upload("x", &f32_bytes(&rand_f32(&mut rng, cols as usize)))
                    .expect("upload");
                let ys: Vec<Buffer> = (0..sets)
                    .map(|_| self.dev.alloc("y", u64::from(rows) * 4).expect("alloc"))
                    .collect();
                let ops: Vec<Op<'_>> = (0..k)
                    .map(|i| {
                        Op::Linear(Linear {
                            w: &ws[i % sets],
                            wtype: ty,
                            x: &x,
                            y: &ys[i % sets],
                            rows,
                            cols,
                            tokens: 1,
                        })
                    })
                    .collect();
                // Bytes of weights read; x (cols * 4, cached) and y are left out.
                let per = bytes as f64;
                self.batch(
                    &mut g,
                    &format!("{rows}x{cols}/batch{k}"),
                    &name,
                    Unit::Bytes,
                    per,
                    &ops,
                );
                if self.tier.matvec_single.contains(&(rows, cols)) {
                    self.single(
                        &mut g,
                        &format!("{rows}x{cols}/single"),
                        &name,
                        Unit::Bytes,
                        per,
                        &ops[..sets],
                    );
                }
                self.dev.sync_blocking().expect("sync");
            }
            g.finish();
        }
    }

    fn rmsnorm(&self, c: &mut Criterion) {
        let mut rng = StdRng::seed_from_u64(13);
        let mut g = self.group(c, "rmsnorm");
        for &(dim, tokens) in &self.tier.rmsnorm {
            let n = (dim * tokens) as usize;
            let x = self
                .dev
                .upload("x", &f32_bytes(&rand_f32(&mut rng, n)))
                .expect("upload");
            let w = self
                .dev
                .upload("w", &f32_bytes(&rand_f32(&mut rng, dim as usize)))
                .expect("upload");
            let y = self.dev.alloc("y", n as u64 * 4).expect("alloc");
            let op = Op::RmsNorm(RmsNorm {
                x: &x,
                weight: &w,
                y: &y,
                dim,
                tokens,
                eps: 1e-5,
            });
            let per = (2 * n + dim as usize) as f64 * 4.0;
            let k = self.dispatches(per, self.tier.target_bytes as f64 / 8.0);
            self.batch(
                &mut g,
                &format!("{dim}x{tokens}/batch{k}"),
                "rmsnorm",
                Unit::Bytes,
                per,
                &vec![op; k],
            );
            self.dev.sync_blocking().expect("sync");
        }
        g.finish();
    }

    fn attention(&self, c: &mut Criterion) {
        let mut rng = StdRng::seed_from_u64(17);
        let mut g = self.group(c, "attention_decode");
        for &(heads, kv_heads, head_dim, ctx) in &self.tier.attention {
            let kv = (ctx * kv_heads * head_dim) as usize;
            let qn = (heads * head_dim) as usize;
            let q = self
                .dev
                .upload("q", &f32_bytes(&rand_f32(&mut rng, qn)))
                .expect("upload");
            let kc = self
                .dev
                .upload("k", &f32_bytes(&rand_f32(&mut rng, kv)))
                .expect("upload");
            let vc = self
                .dev
                .upload("v", &f32_bytes(&rand_f32(&mut rng, kv)))
                .expect("upload");
            let out = self.dev.alloc("out", qn as u64 * 4).expect("alloc");
            let op = Op::Attention(Attention {
                q: &q,
                k_cache: &kc,
                v_cache: &vc,
                out: &out,
                heads,
                kv_heads,
                head_dim,
                tokens: 1,
                pos0: ctx - 1,
                scale: 1.0 / (head_dim as f32).sqrt(),
                window: 0,
                softcap: 0.0,
            });
            // Bytes of the K and V caches read (q and out are negligible).
            let per = 2.0 * kv as f64 * 4.0;
            let k = self.dispatches(per, self.tier.target_bytes as f64 / 8.0);
            let id = format!("h{heads}_kv{kv_heads}_d{head_dim}_ctx{ctx}/batch{k}");
            self.batch(
                &mut g,
                &id,
                "attention_decode",
                Unit::Bytes,
                per,
                &vec![op; k],
            );
            self.dev.sync_blocking().expect("sync");
        }
        g.finish();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
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

/// About three significant digits: software adapters run at fractions of a GB/s.
fn sig3(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 || a == 0.0 || !a.is_finite() {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn summary(dev: &Device, tier: &Tier) {
    let recs = RECORDS.lock().unwrap_or_else(|e| e.into_inner());
    let info = dev.info();
    let rows: Vec<(String, Unit, f64, f64, usize)> = recs
        .iter()
        .filter(|r| !r.samples.is_empty())
        .map(|r| {
            // Criterion's warm-up calls come first; keep the measured samples.
            let s = &r.samples[r.samples.len().saturating_sub(r.keep)..];
            let per_iter = median(s.iter().map(|(n, d)| d.as_secs_f64() / *n as f64).collect());
            let per_dispatch = per_iter / r.dispatches as f64;
            (
                r.name.clone(),
                r.unit,
                per_dispatch,
                r.per_dispatch / per_dispatch,
                r.dispatches,
            )
        })
        .collect();
    // The fastest of the copies and the streaming kernel is the ceiling.
    let copy = rows
        .iter()
        .filter(|r| r.0.starts_with("copy/"))
        .map(|r| r.3)
        .fold(f64::NAN, f64::max);
    println!();
    println!(
        "== cairn kernel summary: {} ({}, {}), sizes {}",
        info.name,
        dev.kind(),
        info.id,
        tier.name
    );
    println!(
        "{:<46} {:>8} {:>12} {:>14} {:>9}",
        "bench", "disp", "us/dispatch", "rate", "% copy"
    );
    let mut json = Vec::new();
    for (name, unit, t, rate, k) in &rows {
        let (rate_s, pct) = match unit {
            Unit::Bytes => (
                format!("{} GB/s", sig3(rate / 1e9)),
                format!("{}%", sig3(100.0 * rate / copy)),
            ),
            Unit::Flops => (format!("{} GFLOP/s", sig3(rate / 1e9)), String::new()),
            Unit::Dispatch => (String::new(), String::new()),
        };
        println!("{name:<46} {k:>8} {:>12.2} {rate_s:>14} {pct:>9}", t * 1e6);
        let rate_json = match unit {
            Unit::Bytes => format!(",\"gb_per_s\":{:.3}", rate / 1e9),
            Unit::Flops => format!(",\"gflop_per_s\":{:.3}", rate / 1e9),
            Unit::Dispatch => String::new(),
        };
        json.push(format!(
            "{{\"bench\":\"{name}\",\"dispatches\":{k},\"us_per_dispatch\":{:.3}{rate_json}}}",
            t * 1e6
        ));
    }
    if let Ok(path) = std::env::var("CAIRN_BENCH_JSON") {
        let text = format!(
            "{{\"device\":\"{}\",\"device_name\":\"{}\",\"backend\":\"{}\",\"sizes\":\"{}\",\"copy_gb_per_s\":{:.3},\"results\":[{}]}}\n",
            info.id,
            info.name.replace('"', "'"),
            dev.kind(),
            tier.name,
            copy / 1e9,
            json.join(",")
        );
        if let Err(e) = std::fs::write(&path, text) {
            eprintln!("writing {path}: {e}");
        }
    }
}

fn main() {
    let dev = open_device();
    let info = dev.info().clone();
    let gpu = dev.kind() != BackendKind::Cpu;
    let tier = match std::env::var("CAIRN_BENCH_SIZES").as_deref() {
        Ok("full") => Tier::full(),
        Ok("small") => Tier::small(),
        _ if gpu && !info.is_software() => Tier::full(),
        _ => Tier::small(),
    };
    eprintln!(
        "benchmarking {} ({}, {}; {} sizes)",
        info.name,
        dev.kind(),
        info.id,
        tier.name
    );
    let mut c = Criterion::default().configure_from_args();
    let b = Bench {
        dev: &dev,
        gpu,
        tier,
        keep: Cell::new(0),
    };
    b.copy(&mut c);
    b.dispatch_overhead(&mut c);
    b.matvec(&mut c);
    b.matmul(&mut c);
    b.rmsnorm(&mut c);
    b.attention(&mut c);
    c.final_summary();
    summary(&dev, &b.tier);
}

//! Every kernel on every usable adapter (lavapipe in CI), on every CUDA device when the `cuda`
//! feature is on and a driver is present, and on the CPU backend, against the CPU reference
//! functions, on random inputs of awkward sizes (not multiples of tile sizes). A backend that
//! is compiled in but finds no device is skipped with a printed reason;
//! `CAIRN_TEST_REQUIRE_CUDA=1` makes that a failure instead.
//!
//! Tolerances: results agree when `|gpu - ref| <= tol * (1 + max|ref|)` elementwise, with
//! `tol` stated per test. Float sums are reordered across invocations, so exact equality is
//! only required for integer results (argmax, ids).

// CUDA_MATVEC_MAX_TOKENS: token counts up to it take the cuda backend's matrix-vector kernels,
// more its tiled products (on tensor cores, f16 inputs); past CUDA_DECODE_MAX_TOKENS queries,
// its attention runs prefill's kernels (on tensor cores too).
use cairn_engine::backend::{BackendKind, CUDA_DECODE_MAX_TOKENS, CUDA_MATVEC_MAX_TOKENS};
use cairn_engine::kernels::{
    self as k, Add, AddBias, Argmax, Attention, Embed, GeluMul, KvStore, Linear, MatMul, Op,
    PagedAttention, PagedAttentionParams, RmsNorm, Rope, Sample, SampleParams, ScaleCap, SiluMul,
    Softmax,
};
use cairn_engine::options::{WgpuMatvec, WgpuMatvecShape};
use cairn_engine::quant::{GgmlType, dequantize_row, quantize_row};
use cairn_engine::{Buffer, Device};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The engine reads no variables itself; on a GPU machine these still pick what the kernels
/// are compared in (graphs off, f32 activations, attention unsplit), as `cairn`'s flags do.
fn options() -> cairn_engine::EngineOptions {
    let off = |var: &str| std::env::var(var).is_ok_and(|v| v == "0");
    let mut o = cairn_engine::EngineOptions::default();
    o.cuda.graphs = !off("CAIRN_CUDA_GRAPHS");
    o.cuda.int8_dot = !off("CAIRN_CUDA_INT8_DOT");
    o.cuda.tensor_cores = !off("CAIRN_CUDA_TENSOR_CORES");
    if off("CAIRN_CUDA_SPLIT_ATTENTION") {
        o.cuda.split_attention = 0;
    }
    // One matrix-vector kernel family may be pinned; else the tests that take
    // `gpu_variants` force each in turn.
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
    // Decode attention may be pinned (`split` or `single`); else auto, and
    // `split_decode_attention_matches_the_reference` forces the split.
    o.wgpu.attention = match std::env::var("CAIRN_WGPU_ATTENTION").as_deref() {
        Ok("split") => cairn_engine::options::WgpuAttention::Split,
        Ok("single") => cairn_engine::options::WgpuAttention::Single,
        _ => cairn_engine::options::WgpuAttention::ByAdapter,
    };
    // The grouped first pass of split attention, and the vulkan backend's workgroup-memory
    // zeroing, as `cairn`'s variables pin them (to run the whole suite under each).
    if std::env::var("CAIRN_WGPU_ATTENTION_KERNEL").as_deref() == Ok("heads") {
        o.wgpu.attention_kernel = cairn_engine::options::WgpuAttentionKernel::Heads;
    }
    o.vulkan.zero_init = match std::env::var("CAIRN_VULKAN_ZERO_INIT").as_deref() {
        Ok("polyfill") => cairn_engine::options::VulkanZeroInit::Polyfill,
        Ok("off") => cairn_engine::options::VulkanZeroInit::Off,
        _ => cairn_engine::options::VulkanZeroInit::Native,
    };
    o.vulkan.fixed_params = std::env::var("CAIRN_VULKAN_FIXED_PARAMS").as_deref() == Ok("1");
    // The norms are folded on software rasterizers too, to test that kernel here.
    if off("CAIRN_WGPU_FUSE") {
        o.wgpu.fuse = cairn_engine::options::WgpuFuse::Off;
    } else {
        o.wgpu.fuse = cairn_engine::options::WgpuFuse::All;
    }
    o
}

fn devices() -> Vec<Device> {
    let found = cairn_engine::device::discover_blocking_with(options());
    for (backend, why) in &found.unavailable {
        eprintln!("{backend} backend: no device ({why}); its part of this test is skipped");
    }
    if std::env::var_os("CAIRN_TEST_REQUIRE_CUDA").is_some() {
        assert!(
            found.devices.iter().any(|d| d.backend == BackendKind::Cuda),
            "CAIRN_TEST_REQUIRE_CUDA is set but no cuda device was found: {:?}",
            found.unavailable
        );
    }
    let mut out = Vec::new();
    for info in &found.devices {
        if info.support == cairn_engine::Support::Unsupported || info.api == "gl" {
            continue;
        }
        match pollster::block_on(found.open_info(info.clone())) {
            Ok(d) => out.push(d),
            Err(e) => panic!("discovered device {} failed to open: {e}", info.id),
        }
    }
    if std::env::var_os("CAIRN_TEST_REQUIRE_GPU").is_some() {
        assert!(
            out.iter().any(|d| d.kind() == BackendKind::Wgpu),
            "CAIRN_TEST_REQUIRE_GPU is set but no wgpu adapter was found (install mesa-vulkan-drivers)"
        );
    }
    out
}

/// Every device, the wgpu and vulkan ones once per matrix-vector kernel family whatever
/// auto-selection would pick there: `rows` on both, `stream` (workgroup-memory sums) on wgpu
/// and `subgroup` on vulkan where the device has subgroups (else `stream`), so each family
/// runs in CI while lavapipe's time stays bounded; only the pinned one where
/// `CAIRN_WGPU_MATVEC` pins one. Each with its family's name ("" elsewhere).
fn gpu_variants() -> Vec<(&'static str, Device)> {
    let mut found = cairn_engine::device::discover_blocking_with(options());
    let pinned = found.options_mut().wgpu.matvec != WgpuMatvec::ByAdapter;
    let mut out = Vec::new();
    for d in devices() {
        if !matches!(d.kind(), BackendKind::Wgpu | BackendKind::Vulkan) || pinned {
            out.push(("", d));
            continue;
        }
        let subgroups = d.info().features.iter().any(|f| f == "subgroups");
        let streaming = if d.kind() == BackendKind::Vulkan && subgroups {
            ("subgroup", WgpuMatvec::Subgroup)
        } else {
            ("stream", WgpuMatvec::Stream)
        };
        // The wide walk (f32 activations, so the tests' tolerances hold) on wgpu where it
        // has subgroups; its other shapes and the int8 path: wide_matvec_shapes_match_the_reference.
        let wide =
            (d.kind() == BackendKind::Wgpu && subgroups).then_some(("wide", WgpuMatvec::Wide));
        for (name, variant) in [("rows", WgpuMatvec::Rows), streaming]
            .into_iter()
            .chain(wide)
        {
            found.options_mut().wgpu.matvec = variant;
            // A small shape: lavapipe compiles large ones slowly (see the wide test).
            found.options_mut().wgpu.matvec_shape = WgpuMatvecShape {
                rows: 8,
                wg: 32,
                unroll: 1,
                dot: false,
            };
            let info = d.info().clone();
            match pollster::block_on(found.open_info(info)) {
                Ok(v) => out.push((name, v)),
                Err(e) => panic!(
                    "{} with the {name} kernels failed to open: {e}",
                    d.info().id
                ),
            }
        }
    }
    out
}

fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| rng.random_range(-1.0..1.0) * scale)
        .collect()
}

/// `Linear` of `tokens` rows of `x` by the weights `wq` (`ty`, rows x cols) on `d`; its output.
fn run_linear(
    d: &Device,
    ty: GgmlType,
    wq: &[u8],
    x: &[f32],
    rows: usize,
    cols: usize,
    tokens: usize,
) -> Vec<f32> {
    let bw = upload_weights(d, "w", wq, ty, cols);
    let bx = upload_f32(d, "x", x);
    let by = d.alloc("y", (tokens * rows * 4) as u64).unwrap();
    d.run(&[Op::Linear(Linear {
        w: &bw,
        wtype: ty,
        x: &bx,
        y: &by,
        rows: rows as u32,
        cols: cols as u32,
        tokens: tokens as u32,
    })])
    .unwrap();
    read(d, &by, tokens * rows)
}

/// Weights of `ty` in rows of `cols` as a model's are uploaded: repacked where the device
/// repacks them (`WgpuMatvec::Repacked`).
fn upload_weights(d: &Device, label: &str, wq: &[u8], ty: GgmlType, cols: usize) -> Buffer {
    let row_bytes = ty.row_bytes(cols).expect("whole blocks") as u64;
    d.upload_weights(label, wq, ty, row_bytes).expect("upload")
}

fn upload_f32(d: &Device, label: &str, v: &[f32]) -> Buffer {
    d.upload(label, bytemuck::cast_slice(v)).expect("upload")
}

fn assert_close(what: &str, dev: &Device, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what} on {}: length", dev.info().id);
    let scale = 1.0 + want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= tol * scale,
            "{what} on {} ({}): element {i}: got {g}, want {w} (err {err}, allowed {})",
            dev.info().id,
            dev.info().name,
            tol * scale
        );
    }
}

fn read(d: &Device, b: &Buffer, n: usize) -> Vec<f32> {
    let v = d.read_f32_blocking(b).expect("read");
    v[..n].to_vec()
}

#[test]
fn matmul_f32() {
    let mut rng = StdRng::seed_from_u64(1);
    for (m, n, kk) in [(37, 29, 41), (1, 67, 5), (64, 64, 64)] {
        let a = rand_vec(&mut rng, m * kk, 1.0);
        let b = rand_vec(&mut rng, kk * n, 1.0);
        let mut want = vec![0f32; m * n];
        k::linear::matmul(&a, &b, &mut want, m, n, kk);
        for d in devices() {
            let (ba, bb) = (upload_f32(&d, "a", &a), upload_f32(&d, "b", &b));
            let bc = d.alloc("c", (m * n * 4) as u64).unwrap();
            d.run(&[Op::MatMul(MatMul {
                a: &ba,
                b: &bb,
                c: &bc,
                m: m as u32,
                n: n as u32,
                k: kk as u32,
            })])
            .unwrap();
            // fp32 accumulation in another order: relative error ~ k * eps.
            assert_close(
                &format!("matmul {m}x{n}x{kk}"),
                &d,
                &read(&d, &bc, m * n),
                &want,
                1e-5,
            );
        }
    }
}

/// Rows of this many 8-element lane steps and more take the split matrix-vector kernels
/// (launch.rs's SPLIT_MIN_STEPS), where the 4-bit formats and Q5_0 round activations to int8.
const CUDA_SPLIT_MIN_STEPS: usize = 256;

/// What the cpu backend's quantized `Linear` computes: each token's activations rounded to
/// int8 per block (32 elements, 256 for the K-quants) with step `amax / 127`, against the
/// dequantized weights, summed exactly.
fn linear_q8_activations(
    ty: GgmlType,
    wq: &[u8],
    x: &[f32],
    rows: usize,
    cols: usize,
    tokens: usize,
) -> Vec<f32> {
    let block = ty.block_len();
    let mut xr = x.to_vec();
    if block > 1 {
        for b in xr.chunks_mut(block) {
            let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            b.iter_mut().for_each(|v| *v = (*v * id).round() * d);
        }
    }
    let row_bytes = ty.row_bytes(cols).expect("row bytes");
    let mut w = vec![0f32; cols];
    let mut y = vec![0f32; tokens * rows];
    for r in 0..rows {
        dequantize_row(ty, &wq[r * row_bytes..][..row_bytes], &mut w);
        for t in 0..tokens {
            let xt = &xr[t * cols..][..cols];
            let s: f64 = w.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
            y[t * rows + r] = s as f32;
        }
    }
    y
}

/// What the cuda backend's split 4-bit matrix-vector kernels compute (docs/cuda.md): each lane
/// step (elements 4q..4q+3 and 4q+16..4q+19 of a block of 32) has its activations rounded to
/// int8 against the step's largest magnitude; the nibble part of each weight multiplies the
/// rounded values and the format's offset (Q4_1's minimum, Q4_0's -8 d) the exact ones.
/// Q5_0's split step puts its -16 into the signed weight bytes, so all of it multiplies the
/// rounded values.
/// Weights and activations rounded to f16, products summed in f64: cuda's prefill on tensor
/// cores (f16 inputs, f32 sums).
fn linear_f16_inputs(
    ty: GgmlType,
    wq: &[u8],
    x: &[f32],
    rows: usize,
    cols: usize,
    tokens: usize,
) -> Vec<f32> {
    let f16 = |v: f32| half::f16::from_f32(v).to_f32();
    let xr: Vec<f32> = x.iter().map(|v| f16(*v)).collect();
    let row_bytes = ty.row_bytes(cols).expect("row bytes");
    let mut w = vec![0f32; cols];
    let mut y = vec![0f32; tokens * rows];
    for r in 0..rows {
        dequantize_row(ty, &wq[r * row_bytes..][..row_bytes], &mut w);
        w.iter_mut().for_each(|v| *v = f16(*v));
        for t in 0..tokens {
            let xt = &xr[t * cols..][..cols];
            y[t * rows + r] = w.iter().zip(xt).map(|(a, b)| f64::from(a * b)).sum::<f64>() as f32;
        }
    }
    y
}

/// Whether `d` runs `Linear` over `tokens` tokens and `cols` columns on f16 tensor cores:
/// cuda's tiled product on compute capability 8.0 and up, rows a multiple of 32.
fn on_tensor_cores(d: &Device, tokens: usize, cols: usize) -> bool {
    tokens > CUDA_MATVEC_MAX_TOKENS && cols.is_multiple_of(32) && has_tensor_cores(d)
}

/// Whether `d` runs prefill's attention over `tokens` queries on f16 tensor cores.
fn attention_on_tensor_cores(d: &Device, tokens: usize) -> bool {
    tokens > CUDA_DECODE_MAX_TOKENS && has_tensor_cores(d)
}

/// cuda on compute capability 8.0 and up, with its tensor-core kernels on.
fn has_tensor_cores(d: &Device) -> bool {
    let major = d
        .info()
        .cuda
        .as_ref()
        .and_then(|c| c.compute_capability.split('.').next()?.parse::<u32>().ok());
    major.is_some_and(|m| m >= 8) && options().cuda.tensor_cores
}

fn linear_int8_activations(
    ty: GgmlType,
    wq: &[u8],
    x: &[f32],
    rows: usize,
    cols: usize,
    tokens: usize,
) -> Vec<f32> {
    let (bb, row_bytes) = (ty.block_bytes(), ty.row_bytes(cols).expect("row bytes"));
    let mut xr = vec![0f32; x.len()];
    for step in 0..tokens * cols / 8 {
        let (base, q) = ((step / 4) * 32, step % 4);
        // Q8_0's chunks (the wide walk's) are 8 consecutive elements.
        let idx: [usize; 8] = if ty == GgmlType::Q8_0 {
            std::array::from_fn(|k| 8 * step + k)
        } else {
            std::array::from_fn(|k| base + 4 * q + if k < 4 { k } else { 12 + k })
        };
        let amax = idx.iter().fold(0f32, |m, &i| m.max(x[i].abs()));
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for &i in &idx {
            xr[i] = (x[i] * id).round_ties_even() * (amax * (1.0 / 127.0));
        }
    }
    let (mut w, mut offset) = (vec![0f32; cols], vec![0f32; cols]);
    let mut y = vec![0f32; tokens * rows];
    for r in 0..rows {
        let row = &wq[r * row_bytes..][..row_bytes];
        dequantize_row(ty, row, &mut w);
        // Each block's offset: the block with its 16 bytes of nibbles zeroed.
        // Q8_0 and Q5_0 have none outside their signed bytes.
        if !matches!(ty, GgmlType::Q5_0 | GgmlType::Q8_0) {
            let mut zeroed = row.to_vec();
            for block in zeroed.chunks_mut(bb) {
                block[bb - 16..].fill(0);
            }
            dequantize_row(ty, &zeroed, &mut offset);
        }
        for t in 0..tokens {
            let (xt, rt) = (&x[t * cols..][..cols], &xr[t * cols..][..cols]);
            let s: f64 = (0..cols)
                .map(|c| (w[c] - offset[c]) as f64 * rt[c] as f64 + offset[c] as f64 * xt[c] as f64)
                .sum();
            y[t * rows + r] = s as f32;
        }
    }
    y
}

#[test]
fn linear_every_format_matvec_and_matmat() {
    let mut rng = StdRng::seed_from_u64(2);
    let cases = [
        (GgmlType::F32, 37, 45),
        (GgmlType::F16, 37, 45),
        (GgmlType::Q8_0, 37, 96),
        (GgmlType::Q4_0, 37, 96),
        (GgmlType::Q4_1, 37, 96),
        (GgmlType::Q4_1, 70, 160),
        // Rows of 256 lane steps and more, which the cuda backend splits across a block.
        (GgmlType::F32, 19, 300),
        (GgmlType::F16, 11, 260),
        (GgmlType::Q8_0, 11, 2048),
        (GgmlType::Q4_0, 11, 2048),
        (GgmlType::Q4_1, 21, 2080),
        // Q5 and the K-quants: odd row counts; 22-, 110- and 210-byte blocks put every other
        // row (and Q5_0's every other block) at a byte offset of 2 mod 4.
        (GgmlType::Q5_0, 37, 96),
        (GgmlType::Q5_1, 37, 160),
        (GgmlType::Q2_K, 13, 512),
        (GgmlType::Q3_K, 13, 256),
        (GgmlType::Q4_K, 37, 256),
        (GgmlType::Q4_K, 11, 768),
        (GgmlType::Q5_K, 13, 512),
        (GgmlType::Q6_K, 37, 256),
        (GgmlType::Q6_K, 11, 768),
        (GgmlType::Q5_0, 9, 2080),
        (GgmlType::Q4_K, 9, 2048),
        (GgmlType::Q6_K, 9, 2304),
        // Rows of a multiple of 8 that the streaming kernels take through w_load4.
        (GgmlType::F32, 7, 72),
        (GgmlType::F16, 13, 136),
    ];
    let devs = gpu_variants();
    for (ty, rows, cols) in cases {
        let wf = rand_vec(&mut rng, rows * cols, 1.0);
        let wq: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
        // 1, 5 and a prefill's 33; for the streaming kernels and cuda also 2, 3 and 8 (the
        // batch kernels' partial and full token groups of 4, and with 5 a partial second
        // group); the streaming kernels not 33 (linear_matmat, as for `rows`).
        for tokens in [1usize, 2, 3, 5, 8, 33] {
            let x = rand_vec(&mut rng, tokens * cols, 1.0);
            let mut want = vec![0f32; tokens * rows];
            k::linear::linear(ty, &wq, &x, &mut want, rows, cols, tokens);
            let int8 = matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0)
                && tokens <= CUDA_MATVEC_MAX_TOKENS
                && cols / 8 >= CUDA_SPLIT_MIN_STEPS
                && options().cuda.int8_dot;
            let want_int8 = int8.then(|| linear_int8_activations(ty, &wq, &x, rows, cols, tokens));
            let want_cpu = linear_q8_activations(ty, &wq, &x, rows, cols, tokens);
            let want_f16 = linear_f16_inputs(ty, &wq, &x, rows, cols, tokens);
            for (variant, d) in &devs {
                let streaming = matches!(*variant, "stream" | "subgroup" | "wide");
                // The wide walk's formats differ only in the chunk loaders the streaming
                // kernels share: a few of them here, to keep lavapipe's compiling short.
                let wide_skips = *variant == "wide"
                    && !matches!(
                        ty,
                        GgmlType::Q8_0 | GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::F16
                    );
                if (streaming && tokens == 33)
                    || (*variant == "rows" && matches!(tokens, 2 | 3 | 8))
                    || wide_skips
                {
                    continue;
                }
                let got = run_linear(d, ty, &wq, &x, rows, cols, tokens);
                // Same dequantized weights (and on cuda's split 4-bit matrix-vector path, the
                // same rounded activations), different summation order: 2e-6 per element of the
                // row, relative to the largest output. cuda's tiled product on tensor cores
                // rounds weights and activations to f16 first.
                let reference = match &want_int8 {
                    _ if on_tensor_cores(d, tokens, cols) => &want_f16,
                    Some(w8) if d.kind() == BackendKind::Cuda => w8,
                    _ if d.kind() == BackendKind::Cpu => &want_cpu,
                    _ => &want,
                };
                assert_close(
                    &format!("linear {ty:?} {rows}x{cols} tokens={tokens} {variant}"),
                    d,
                    &got,
                    reference,
                    2e-6 * cols as f32,
                );
            }
        }
    }
}

/// The wide matrix-vector walk (`WgpuMatvec::Wide`) in several shapes (rows, invocations
/// and chunks in flight a step; tails where a row's chunks do not fill the unrolled steps,
/// rows past the last workgroup's; rows with fewer chunks than invocations run the streaming
/// kernels), one-token products against the reference: with `dot`,
/// Q8_0, Q4_0 and Q4_1 round each chunk's 8 activations to int8 (the cuda split kernels'
/// reference, `linear_int8_activations`) where the device has packed dot products; other
/// formats and `dot:0` take f32 activations (`k::linear::linear`). 2e-6 per element of the
/// row, relative to the largest output, as above. On wgpu every shape; on vulkan the first
/// (its SPIR-V compiles slowly on lavapipe) unless the shapes are given.
#[test]
fn wide_matvec_shapes_match_the_reference() {
    // Small shapes: lavapipe compiles a walk in time that grows with rows x unroll (the
    // default shape's 12 s on wgpu and 39 s on vulkan with a cold cache). The GPU run passes
    // its sweep's shapes in CAIRN_WGPU_MATVEC_SHAPES (separated by `;`).
    let given = std::env::var("CAIRN_WGPU_MATVEC_SHAPES").ok();
    let shapes: Vec<&str> = match &given {
        Some(list) => list.split(';').filter(|s| !s.trim().is_empty()).collect(),
        None => vec![
            "rows:8,wg:32,unroll:1,dot:1",
            "rows:8,wg:64,unroll:2,dot:1",
            "rows:12,wg:128,unroll:1,dot:0",
        ],
    };
    let cases = [
        (GgmlType::Q4_1, 21, 2080),
        (GgmlType::Q8_0, 11, 2048),
        (GgmlType::Q4_0, 13, 96),
        (GgmlType::Q4_1, 5, 160),
        (GgmlType::Q4_K, 9, 768),
        // Rows long enough for workgroups of 1024 (a chunk of 8 per invocation).
        (GgmlType::Q4_1, 5, 8192),
    ];
    let mut rng = StdRng::seed_from_u64(22);
    let data: Vec<_> = cases
        .iter()
        .map(|&(ty, rows, cols)| {
            let wf = rand_vec(&mut rng, rows * cols, 1.0);
            let wq: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
            let x = rand_vec(&mut rng, cols, 1.0);
            let mut want = vec![0f32; rows];
            k::linear::linear(ty, &wq, &x, &mut want, rows, cols, 1);
            let want_i8 = linear_int8_activations(ty, &wq, &x, rows, cols, 1);
            (ty, rows, cols, wq, x, want, want_i8)
        })
        .collect();
    let mut found = cairn_engine::device::discover_blocking_with(options());
    let mut ran = 0;
    for d in devices() {
        let subgroups = d.info().features.iter().any(|f| f == "subgroups");
        if !matches!(d.kind(), BackendKind::Wgpu | BackendKind::Vulkan) || !subgroups {
            continue;
        }
        let packed = d
            .info()
            .features
            .iter()
            .any(|f| f == "packed-4x8-integer-dot-product");
        let take = if d.kind() == BackendKind::Vulkan && given.is_none() {
            1
        } else {
            shapes.len()
        };
        for text in &shapes[..take] {
            let shape: WgpuMatvecShape = text.parse().expect("shape");
            found.options_mut().wgpu.matvec = WgpuMatvec::Wide;
            found.options_mut().wgpu.matvec_shape = shape;
            let dev = pollster::block_on(found.open_info(d.info().clone())).expect("open");
            let t0 = std::time::Instant::now();
            for (ty, rows, cols, wq, x, want, want_i8) in &data {
                let got = run_linear(&dev, *ty, wq, x, *rows, *cols, 1);
                // Rows with fewer chunks of 8 than invocations run the streaming kernels (f32).
                let int8 = shape.dot
                    && packed
                    && *cols / 8 >= shape.wg as usize
                    && matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1);
                assert_close(
                    &format!("wide {text} {ty:?} {rows}x{cols}"),
                    &dev,
                    &got,
                    if int8 { want_i8 } else { want },
                    2e-6 * *cols as f32,
                );
                ran += 1;
            }
            eprintln!("{} {text}: {:?}", d.info().id, t0.elapsed());
        }
    }
    eprintln!("{ran} wide products compared");
}

/// Prefill-sized products: enough rows and tokens that cuda takes each of its larger
/// tensor-core tiles (a block per multiprocessor and more): 64 rows x 128 tokens (4229 rows,
/// 257 tokens: 67 x 3 blocks; 1536 rows, 1153 tokens: 24 x 10), 128 x 128 (4229 x 385: 34 x 4;
/// 1536 x 1409: 12 x 12) and 128 x 64 (17000 rows, 33 tokens: 133 x 1), over activations
/// rounded to f16 once per product (4229 and 17000 rows) and in each block (1536 rows),
/// partial tiles at both edges, the 4-bit formats' own staging and a K-quant's generic one.
/// Same references and tolerance as above.
#[test]
fn linear_prefill_tiles() {
    let mut rng = StdRng::seed_from_u64(12);
    for (ty, rows, cols, tokens) in [
        (GgmlType::Q4_1, 4229usize, 64usize, 257usize),
        (GgmlType::Q4_0, 4229, 64, 257),
        (GgmlType::Q6_K, 4229, 256, 257),
        (GgmlType::Q4_1, 4229, 64, 385),
        (GgmlType::Q6_K, 4229, 256, 385),
        (GgmlType::Q4_1, 1536, 64, 1153),
        (GgmlType::Q4_0, 1536, 64, 1409),
        (GgmlType::Q4_1, 17_000, 64, 33),
    ] {
        let wf = rand_vec(&mut rng, rows * cols, 1.0);
        let wq: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
        let x = rand_vec(&mut rng, tokens * cols, 1.0);
        for d in devices() {
            let reference = if on_tensor_cores(&d, tokens, cols) {
                linear_f16_inputs(ty, &wq, &x, rows, cols, tokens)
            } else if d.kind() == BackendKind::Cpu {
                linear_q8_activations(ty, &wq, &x, rows, cols, tokens)
            } else {
                let mut want = vec![0f32; tokens * rows];
                k::linear::linear(ty, &wq, &x, &mut want, rows, cols, tokens);
                want
            };
            let got = run_linear(&d, ty, &wq, &x, rows, cols, tokens);
            assert_close(
                &format!("linear {ty:?} {rows}x{cols} tokens={tokens}"),
                &d,
                &got,
                &reference,
                2e-6 * cols as f32,
            );
        }
    }
}

/// A decode layer's feed-forward half (norm, gate, up, silu, down, residual add), which the
/// wgpu and vulkan backends fold into three dispatches (backend/wgpu/fuse.rs), against the
/// reference run op by op: every buffer the ops write, the norm's output included.
#[test]
fn fused_decode_ffn_matches_the_ops_one_by_one() {
    let mut rng = StdRng::seed_from_u64(23);
    // (format, dim, ffn): rows not a multiple of a workgroup's 8, a row tail past the last
    // 4-element chunk (F32 45), and every block family.
    let cases = [
        (GgmlType::F32, 45, 37),
        (GgmlType::Q8_0, 96, 160),
        (GgmlType::Q4_0, 160, 96),
        (GgmlType::Q4_1, 96, 160),
        (GgmlType::Q4_K, 256, 512),
        (GgmlType::Q6_K, 256, 256),
    ];
    let devs: Vec<(&str, Device)> = gpu_variants()
        .into_iter()
        .filter(|(_, d)| matches!(d.kind(), BackendKind::Wgpu | BackendKind::Vulkan))
        .collect();
    for (ty, dim, ffn) in cases {
        fused_ffn_case(&devs, ty, dim, ffn, &mut rng);
    }
}

/// One case of `fused_decode_ffn_matches_the_ops_one_by_one` on `devs`.
fn fused_ffn_case(devs: &[(&str, Device)], ty: GgmlType, dim: usize, ffn: usize, rng: &mut StdRng) {
    {
        let quant = |rows: usize, cols: usize, rng: &mut StdRng| -> Vec<u8> {
            let wf = rand_vec(rng, rows * cols, 1.0);
            wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect()
        };
        let (wg, wu, wd) = (
            quant(ffn, dim, rng),
            quant(ffn, dim, rng),
            quant(dim, ffn, rng),
        );
        let h = rand_vec(rng, dim, 3.0);
        let nw = rand_vec(rng, dim, 1.0);
        let mut xn = vec![0f32; dim];
        k::norm::rms_norm(&h, &nw, &mut xn, dim, 1e-5);
        let (mut g, mut u, mut a) = (vec![0f32; ffn], vec![0f32; ffn], vec![0f32; ffn]);
        k::linear::linear(ty, &wg, &xn, &mut g, ffn, dim, 1);
        k::linear::linear(ty, &wu, &xn, &mut u, ffn, dim, 1);
        k::elementwise::silu_mul(&g, &u, &mut a);
        let mut o = vec![0f32; dim];
        k::linear::linear(ty, &wd, &a, &mut o, dim, ffn, 1);
        let mut h2 = vec![0f32; dim];
        k::elementwise::add(&h, &o, &mut h2);
        for (variant, d) in devs {
            let b_h = upload_f32(d, "h", &h);
            let b_nw = upload_f32(d, "nw", &nw);
            let (b_wg, b_wu, b_wd) = (
                upload_weights(d, "wg", &wg, ty, dim),
                upload_weights(d, "wu", &wu, ty, dim),
                upload_weights(d, "wd", &wd, ty, ffn),
            );
            let f = |n: &str, len: usize| d.alloc(n, (len * 4) as u64).unwrap();
            let (b_xn, b_g, b_u, b_a, b_o) = (
                f("xn", dim),
                f("g", ffn),
                f("u", ffn),
                f("a", ffn),
                f("o", dim),
            );
            let lin = |w, x, y, rows: usize, cols: usize| {
                Op::Linear(Linear {
                    w,
                    wtype: ty,
                    x,
                    y,
                    rows: rows as u32,
                    cols: cols as u32,
                    tokens: 1,
                })
            };
            d.run(&[
                Op::RmsNorm(RmsNorm {
                    x: &b_h,
                    weight: &b_nw,
                    y: &b_xn,
                    dim: dim as u32,
                    tokens: 1,
                    eps: 1e-5,
                }),
                lin(&b_wg, &b_xn, &b_g, ffn, dim),
                lin(&b_wu, &b_xn, &b_u, ffn, dim),
                Op::SiluMul(SiluMul {
                    gate: &b_g,
                    up: &b_u,
                    out: &b_a,
                    n: ffn as u32,
                }),
                lin(&b_wd, &b_a, &b_o, dim, ffn),
                Op::Add(Add {
                    a: &b_h,
                    b: &b_o,
                    out: &b_h,
                    n: dim as u32,
                }),
            ])
            .unwrap();
            if options().wgpu.fuse != cairn_engine::options::WgpuFuse::Off {
                assert_eq!(
                    d.launches_in_last_run(),
                    Some(3),
                    "{ty:?} on {} {variant}",
                    d.info().id
                );
            }
            // Sums of a few hundred terms, chained through three products.
            let tol = 4e-6 * (dim + ffn) as f32;
            let what = |n: &str| format!("fused ffn {ty:?} {dim}x{ffn} {variant}: {n}");
            assert_close(&what("norm"), d, &read(d, &b_xn, dim), &xn, 1e-5);
            assert_close(&what("gate"), d, &read(d, &b_g, ffn), &g, tol);
            assert_close(&what("up"), d, &read(d, &b_u, ffn), &u, tol);
            assert_close(&what("silu"), d, &read(d, &b_a, ffn), &a, tol);
            assert_close(&what("down"), d, &read(d, &b_o, dim), &o, tol);
            assert_close(&what("residual"), d, &read(d, &b_h, dim), &h2, tol);
        }
    }
}

/// `WgpuMatvec::Repacked` (backend/wgpu/repack.rs), forced on every wgpu and vulkan device:
/// Q4_0, Q4_1 and Q8_0 weights repacked at upload, against the reference. Products of 1 and 5
/// tokens (the streaming kernels: the 8-weight walk over rows under 2048 elements, the vec4
/// walk from there, with groups of blocks straddling rows: 96 and 2080 columns), of 33
/// (`linear_matmat` over the repacked format), products over weights cut into parts by a
/// 16 KiB binding limit, and a fused decode ffn whose gate and up rows are 2048 long (the
/// fused vec4 kernel) and whose down rows are not. Same tolerances as the tests above.
#[test]
fn repacked_weights_match_the_reference() {
    let mut rng = StdRng::seed_from_u64(31);
    let mut found = cairn_engine::device::discover_blocking_with(options());
    let mut devs = Vec::new();
    for (limit, name) in [
        (None, "repacked"),
        (Some(16u64 << 10), "repacked, in parts"),
    ] {
        found.options_mut().wgpu.matvec = WgpuMatvec::Repacked;
        found.options_mut().wgpu.limits.max_binding_bytes = limit;
        for d in devices() {
            if !matches!(d.kind(), BackendKind::Wgpu | BackendKind::Vulkan) {
                continue;
            }
            match pollster::block_on(found.open_info(d.info().clone())) {
                Ok(v) => devs.push((name, v)),
                Err(e) => panic!("{} repacked failed to open: {e}", d.info().id),
            }
        }
    }
    let (whole, parts): (Vec<_>, Vec<_>) = devs.into_iter().partition(|(n, _)| *n == "repacked");
    for (ty, rows, cols) in [
        (GgmlType::Q4_1, 37, 96),
        (GgmlType::Q4_0, 37, 96),
        (GgmlType::Q8_0, 37, 96),
        (GgmlType::Q4_1, 21, 2080),
        (GgmlType::Q4_0, 11, 2048),
        (GgmlType::Q8_0, 11, 2080),
    ] {
        let wf = rand_vec(&mut rng, rows * cols, 1.0);
        let wq: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
        for tokens in [1usize, 5, 33] {
            let x = rand_vec(&mut rng, tokens * cols, 1.0);
            let mut want = vec![0f32; tokens * rows];
            k::linear::linear(ty, &wq, &x, &mut want, rows, cols, tokens);
            // Under the 16 KiB binding where the activations fit it (the 2080-column weights
            // are cut into parts there).
            let on_parts = tokens * cols * 4 <= 16 << 10;
            for (variant, d) in whole.iter().chain(parts.iter().filter(|_| on_parts)) {
                let got = run_linear(d, ty, &wq, &x, rows, cols, tokens);
                assert_close(
                    &format!("linear {ty:?} {rows}x{cols} tokens={tokens} {variant}"),
                    d,
                    &got,
                    &want,
                    2e-6 * cols as f32,
                );
            }
        }
    }
    for (ty, dim, ffn) in [
        (GgmlType::Q4_1, 2048, 64),
        (GgmlType::Q4_0, 2048, 64),
        (GgmlType::Q8_0, 2048, 64),
    ] {
        fused_ffn_case(&whole, ty, dim, ffn, &mut rng);
    }
}

/// A decode layer's attention half up to attention (norm, q, k, v, the ropes, the copies
/// into the KV cache), which the wgpu and vulkan backends fold into three dispatches, against
/// the reference op by op; rope only on part of each head, at a large position.
#[test]
fn fused_decode_qkv_with_rope_and_cache_copies_matches_the_ops_one_by_one() {
    let mut rng = StdRng::seed_from_u64(29);
    // (format, dim, heads, kv heads, head dim, rope dim)
    let cases = [
        (GgmlType::F32, 45, 3, 1, 14, 10),
        (GgmlType::Q8_0, 96, 6, 2, 16, 16),
        (GgmlType::Q4_1, 160, 5, 1, 32, 24),
        (GgmlType::Q4_K, 256, 4, 2, 64, 64),
    ];
    let devs: Vec<(&str, Device)> = gpu_variants()
        .into_iter()
        .filter(|(_, d)| matches!(d.kind(), BackendKind::Wgpu | BackendKind::Vulkan))
        .collect();
    let (pos0, base, slots) = (1234u32, 10_000.0f32, 4usize);
    for (ty, dim, heads, kv_heads, head_dim, rope_dim) in cases {
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        let quant = |rows: usize, rng: &mut StdRng| -> Vec<u8> {
            let wf = rand_vec(rng, rows * dim, 1.0);
            wf.chunks(dim).flat_map(|r| quantize_row(ty, r)).collect()
        };
        let (wq, wk, wv) = (
            quant(q_dim, &mut rng),
            quant(kv_dim, &mut rng),
            quant(kv_dim, &mut rng),
        );
        let h = rand_vec(&mut rng, dim, 3.0);
        let nw = rand_vec(&mut rng, dim, 1.0);
        let cache0 = rand_vec(&mut rng, slots * kv_dim, 1.0);
        let mut xn = vec![0f32; dim];
        k::norm::rms_norm(&h, &nw, &mut xn, dim, 1e-5);
        let (mut q, mut kk, mut v) = (vec![0f32; q_dim], vec![0f32; kv_dim], vec![0f32; kv_dim]);
        k::linear::linear(ty, &wq, &xn, &mut q, q_dim, dim, 1);
        k::linear::linear(ty, &wk, &xn, &mut kk, kv_dim, dim, 1);
        k::linear::linear(ty, &wv, &xn, &mut v, kv_dim, dim, 1);
        k::rope::rope(
            &mut q, heads, head_dim, rope_dim, pos0, None, base, false, None,
        );
        k::rope::rope(
            &mut kk, kv_heads, head_dim, rope_dim, pos0, None, base, false, None,
        );
        // The token goes to slot 2 of each cache.
        let at = 2 * kv_dim;
        let (mut kc, mut vc) = (cache0.clone(), cache0.clone());
        kc[at..at + kv_dim].copy_from_slice(&kk);
        vc[at..at + kv_dim].copy_from_slice(&v);
        for (variant, d) in &devs {
            let b_h = upload_f32(d, "h", &h);
            let b_nw = upload_f32(d, "nw", &nw);
            let (b_wq, b_wk, b_wv) = (
                d.upload("wq", &wq).unwrap(),
                d.upload("wk", &wk).unwrap(),
                d.upload("wv", &wv).unwrap(),
            );
            let f = |n: &str, len: usize| d.alloc(n, (len * 4) as u64).unwrap();
            let (b_xn, b_q, b_k, b_v) =
                (f("xn", dim), f("q", q_dim), f("k", kv_dim), f("v", kv_dim));
            let (b_kc, b_vc) = (upload_f32(d, "kc", &cache0), upload_f32(d, "vc", &cache0));
            let lin = |w, y, rows: usize| {
                Op::Linear(Linear {
                    w,
                    wtype: ty,
                    x: &b_xn,
                    y,
                    rows: rows as u32,
                    cols: dim as u32,
                    tokens: 1,
                })
            };
            let rope = |x, heads: usize| {
                Op::Rope(Rope {
                    x,
                    factors: None,
                    positions: None,
                    heads: heads as u32,
                    head_dim: head_dim as u32,
                    rope_dim: rope_dim as u32,
                    tokens: 1,
                    pos0,
                    freq_base: base,
                    neox: false,
                })
            };
            let copy = |src, dst| {
                Op::Copy(k::BufferCopy {
                    src,
                    src_offset: 0,
                    dst,
                    dst_offset: (at * 4) as u64,
                    bytes: (kv_dim * 4) as u64,
                })
            };
            d.run(&[
                Op::RmsNorm(RmsNorm {
                    x: &b_h,
                    weight: &b_nw,
                    y: &b_xn,
                    dim: dim as u32,
                    tokens: 1,
                    eps: 1e-5,
                }),
                lin(&b_wq, &b_q, q_dim),
                lin(&b_wk, &b_k, kv_dim),
                lin(&b_wv, &b_v, kv_dim),
                rope(&b_q, heads),
                rope(&b_k, kv_heads),
                copy(&b_k, &b_kc),
                copy(&b_v, &b_vc),
            ])
            .unwrap();
            if options().wgpu.fuse != cairn_engine::options::WgpuFuse::Off {
                assert_eq!(
                    d.launches_in_last_run(),
                    Some(3),
                    "{ty:?} on {} {variant}",
                    d.info().id
                );
            }
            let tol = 4e-6 * dim as f32;
            let what =
                |n: &str| format!("fused qkv {ty:?} {dim} {heads}x{head_dim} {variant}: {n}");
            assert_close(&what("norm"), d, &read(d, &b_xn, dim), &xn, 1e-5);
            assert_close(&what("q"), d, &read(d, &b_q, q_dim), &q, tol);
            assert_close(&what("k"), d, &read(d, &b_k, kv_dim), &kk, tol);
            assert_close(&what("v"), d, &read(d, &b_v, kv_dim), &v, tol);
            let n = slots * kv_dim;
            assert_close(&what("k cache"), d, &read(d, &b_kc, n), &kc, tol);
            assert_close(&what("v cache"), d, &read(d, &b_vc, n), &vc, tol);
        }
    }
}

#[test]
fn rmsnorm_softmax_silu_add() {
    let mut rng = StdRng::seed_from_u64(3);
    let (dim, tokens) = (300usize, 3usize);
    let x = rand_vec(&mut rng, dim * tokens, 3.0);
    let w = rand_vec(&mut rng, dim, 1.0);
    let mut norm_want = vec![0f32; dim * tokens];
    k::norm::rms_norm(&x, &w, &mut norm_want, dim, 1e-5);
    let mut soft_want = x.clone();
    k::softmax::softmax(&mut soft_want, 1000.min(dim));
    let n = 1001usize;
    let g = rand_vec(&mut rng, n, 4.0);
    let u = rand_vec(&mut rng, n, 2.0);
    let mut silu_want = vec![0f32; n];
    k::elementwise::silu_mul(&g, &u, &mut silu_want);
    let mut add_want = vec![0f32; n];
    k::elementwise::add(&g, &u, &mut add_want);
    for d in devices() {
        let bx = upload_f32(&d, "x", &x);
        let bw = upload_f32(&d, "w", &w);
        let by = d.alloc("y", (dim * tokens * 4) as u64).unwrap();
        let bs = upload_f32(&d, "s", &x);
        let (bg, bu) = (upload_f32(&d, "g", &g), upload_f32(&d, "u", &u));
        let bo = d.alloc("o", (n * 4) as u64).unwrap();
        let ba = d.alloc("a", (n * 4) as u64).unwrap();
        let bacc = upload_f32(&d, "acc", &g);
        d.run(&[
            Op::RmsNorm(RmsNorm {
                x: &bx,
                weight: &bw,
                y: &by,
                dim: dim as u32,
                tokens: tokens as u32,
                eps: 1e-5,
            }),
            Op::Softmax(Softmax {
                x: &bs,
                rows: tokens as u32,
                cols: dim as u32,
            }),
            Op::SiluMul(SiluMul {
                gate: &bg,
                up: &bu,
                out: &bo,
                n: n as u32,
            }),
            Op::Add(Add {
                a: &bg,
                b: &bu,
                out: &ba,
                n: n as u32,
            }),
            Op::Add(Add {
                a: &bacc,
                b: &bu,
                out: &bacc,
                n: n as u32,
            }),
        ])
        .unwrap();
        // Single reductions of a few hundred terms: 1e-5 relative.
        assert_close(
            "rmsnorm",
            &d,
            &read(&d, &by, dim * tokens),
            &norm_want,
            1e-5,
        );
        assert_close(
            "softmax",
            &d,
            &read(&d, &bs, dim * tokens),
            &soft_want,
            1e-5,
        );
        // exp differs by a few ulps between implementations.
        assert_close("silu_mul", &d, &read(&d, &bo, n), &silu_want, 1e-5);
        assert_close("add", &d, &read(&d, &ba, n), &add_want, 1e-6);
        assert_close("add in place", &d, &read(&d, &bacc, n), &add_want, 1e-6);
    }
}

#[test]
fn rope_both_variants_with_and_without_frequency_factors() {
    let mut rng = StdRng::seed_from_u64(4);
    let (heads, head_dim, rope_dim, tokens, pos0) = (3usize, 40usize, 32usize, 4usize, 1000u32);
    let x = rand_vec(&mut rng, tokens * heads * head_dim, 1.0);
    // Llama 3.1-like divisors between 1 and 8.
    let factors: Vec<f32> = (0..rope_dim / 2)
        .map(|_| 1.0 + 7.0 * rng.random_range(0.0f32..1.0))
        .collect();
    for neox in [false, true] {
        for with_factors in [false, true] {
            let fs = with_factors.then_some(factors.as_slice());
            let mut want = x.clone();
            k::rope::rope(
                &mut want, heads, head_dim, rope_dim, pos0, None, 100_000.0, neox, fs,
            );
            for d in devices() {
                let bx = upload_f32(&d, "x", &x);
                let bf = upload_f32(&d, "factors", &factors);
                d.run(&[Op::Rope(Rope {
                    x: &bx,
                    factors: with_factors.then_some(&bf),
                    positions: None,
                    heads: heads as u32,
                    head_dim: head_dim as u32,
                    rope_dim: rope_dim as u32,
                    tokens: tokens as u32,
                    pos0,
                    freq_base: 100_000.0,
                    neox,
                })])
                .unwrap();
                // Angles up to ~1000 rad: f32 argument reduction costs ~1e-4 absolute.
                assert_close(
                    &format!("rope neox={neox} factors={with_factors}"),
                    &d,
                    &read(&d, &bx, x.len()),
                    &want,
                    2e-4,
                );
            }
        }
    }
    // The factors change the result: a test of them that cannot fail would pass here too.
    let (mut plain, mut scaled) = (x.clone(), x.clone());
    k::rope::rope(
        &mut plain, heads, head_dim, rope_dim, pos0, None, 100_000.0, false, None,
    );
    k::rope::rope(
        &mut scaled,
        heads,
        head_dim,
        rope_dim,
        pos0,
        None,
        100_000.0,
        false,
        Some(&factors),
    );
    assert!(plain.iter().zip(&scaled).any(|(a, b)| (a - b).abs() > 1e-2));
}

/// A batch of several sequences' tokens: each token at its own position, in no order, repeated
/// and far apart, while `pos0` (ignored) would say otherwise.
#[test]
fn rope_at_per_token_positions() {
    let mut rng = StdRng::seed_from_u64(14);
    let (heads, head_dim, tokens, pos0) = (3usize, 40usize, 6usize, 1000u32);
    let positions: [u32; 6] = [7, 0, 4093, 3, 7, 1];
    let x = rand_vec(&mut rng, tokens * heads * head_dim, 1.0);
    for rope_dim in [32usize, 40] {
        let factors: Vec<f32> = (0..rope_dim / 2)
            .map(|_| 1.0 + 7.0 * rng.random_range(0.0f32..1.0))
            .collect();
        for neox in [false, true] {
            for with_factors in [false, true] {
                let fs = with_factors.then_some(factors.as_slice());
                let mut want = x.clone();
                k::rope::rope(
                    &mut want,
                    heads,
                    head_dim,
                    rope_dim,
                    pos0,
                    Some(&positions),
                    10_000.0,
                    neox,
                    fs,
                );
                for d in devices() {
                    let bx = upload_f32(&d, "x", &x);
                    let bf = upload_f32(&d, "factors", &factors);
                    let bp = d
                        .upload("positions", bytemuck::cast_slice(&positions))
                        .unwrap();
                    d.run(&[Op::Rope(Rope {
                        x: &bx,
                        factors: with_factors.then_some(&bf),
                        positions: Some(&bp),
                        heads: heads as u32,
                        head_dim: head_dim as u32,
                        rope_dim: rope_dim as u32,
                        tokens: tokens as u32,
                        pos0,
                        freq_base: 10_000.0,
                        neox,
                    })])
                    .unwrap();
                    // Angles up to ~4100 rad: f32 argument reduction costs ~4e-4 absolute.
                    assert_close(
                        &format!(
                            "rope positions rope_dim={rope_dim} neox={neox} factors={with_factors}"
                        ),
                        &d,
                        &read(&d, &bx, x.len()),
                        &want,
                        5e-4,
                    );
                }
            }
        }
    }
    // The positions change the result: a kernel that ignored them would fail above.
    let (mut by_pos0, mut by_positions) = (x.clone(), x.clone());
    k::rope::rope(
        &mut by_pos0,
        heads,
        head_dim,
        32,
        pos0,
        None,
        10_000.0,
        false,
        None,
    );
    k::rope::rope(
        &mut by_positions,
        heads,
        head_dim,
        32,
        pos0,
        Some(&positions),
        10_000.0,
        false,
        None,
    );
    assert!(
        by_pos0
            .iter()
            .zip(&by_positions)
            .any(|(a, b)| (a - b).abs() > 1e-2)
    );
}

/// Rows land in scattered slots and nothing else of the pool changes; a slot outside the pool
/// is skipped by GPU kernels (the pool buffer has one more row than `pool_slots`, which must
/// stay as it was) and refused by the CPU.
#[test]
fn kv_store_scatters_rows_and_skips_a_slot_outside_the_pool() {
    let mut rng = StdRng::seed_from_u64(15);
    let (kv_dim, pool_slots) = (40usize, 13usize);
    // The buffers hold one guard row past the pool.
    let k_pool0 = rand_vec(&mut rng, (pool_slots + 1) * kv_dim, 1.0);
    let v_pool0 = rand_vec(&mut rng, (pool_slots + 1) * kv_dim, 1.0);
    let store = |slots: &[u32], k: &[f32], v: &[f32]| {
        let (mut kp, mut vp) = (k_pool0.clone(), v_pool0.clone());
        for (t, &s) in slots.iter().enumerate() {
            let s = s as usize;
            if s < pool_slots {
                kp[s * kv_dim..][..kv_dim].copy_from_slice(&k[t * kv_dim..][..kv_dim]);
                vp[s * kv_dim..][..kv_dim].copy_from_slice(&v[t * kv_dim..][..kv_dim]);
            }
        }
        (kp, vp)
    };
    let good: &[u32] = &[12, 0, 7, 3, 5];
    let with_bad: &[u32] = &[2, 13, 9, 1000];
    for slots in [good, with_bad] {
        let tokens = slots.len();
        let k = rand_vec(&mut rng, tokens * kv_dim, 1.0);
        let v = rand_vec(&mut rng, tokens * kv_dim, 1.0);
        let (want_k, want_v) = store(slots, &k, &v);
        let bad = slots.iter().any(|&s| s as usize >= pool_slots);
        for d in devices() {
            let (bk, bv) = (upload_f32(&d, "k", &k), upload_f32(&d, "v", &v));
            let bs = d.upload("slots", bytemuck::cast_slice(slots)).unwrap();
            let (bkp, bvp) = (
                upload_f32(&d, "k_pool", &k_pool0),
                upload_f32(&d, "v_pool", &v_pool0),
            );
            let r = d.run(&[Op::KvStore(KvStore {
                k: &bk,
                v: &bv,
                slots: &bs,
                k_pool: &bkp,
                v_pool: &bvp,
                kv_dim: kv_dim as u32,
                tokens: tokens as u32,
                pool_slots: pool_slots as u32,
            })]);
            if bad && d.kind() == BackendKind::Cpu {
                let err = r.unwrap_err().to_string();
                assert!(err.contains("outside the key/value pool"), "{err}");
                // Refused as a whole: nothing was written.
                assert_close(
                    "refused kv_store",
                    &d,
                    &read(&d, &bkp, k_pool0.len()),
                    &k_pool0,
                    0.0,
                );
                continue;
            }
            r.unwrap();
            // Copies: exact.
            let what = format!("kv_store slots={slots:?}");
            assert_close(&what, &d, &read(&d, &bkp, want_k.len()), &want_k, 0.0);
            assert_close(&what, &d, &read(&d, &bvp, want_v.len()), &want_v, 0.0);
        }
    }
}

/// One sequence of the paged attention test: its length and query positions.
struct PagedSeq {
    len: usize,
    /// Key counts of its query tokens (position + 1).
    queries: Vec<usize>,
}

/// One `PagedAttention` of `p.tokens` tokens on `d` over the pools and the rows and table
/// given, its output buffer filled with 7 first (where skipped tokens keep it); the output.
fn run_paged_attention(
    d: &Device,
    q: &[f32],
    (k_pool, v_pool): (&[f32], &[f32]),
    (rows, table): (&[u32], &[u32]),
    p: &PagedAttentionParams,
) -> Result<Vec<f32>, cairn_engine::backend::BackendError> {
    let (bq, bk, bv) = (
        upload_f32(d, "q", q),
        upload_f32(d, "k_pool", k_pool),
        upload_f32(d, "v_pool", v_pool),
    );
    let br = d.upload("rows", bytemuck::cast_slice(rows)).unwrap();
    let bt = d.upload("table", bytemuck::cast_slice(table)).unwrap();
    let n = p.tokens as usize * (p.heads * p.head_dim) as usize;
    let bo = upload_f32(d, "out", &vec![7.0f32; n]);
    d.run(&[Op::PagedAttention(PagedAttention {
        q: &bq,
        k_pool: &bk,
        v_pool: &bv,
        rows: &br,
        table: &bt,
        out: &bo,
        heads: p.heads,
        kv_heads: p.kv_heads,
        head_dim: p.head_dim,
        tokens: p.tokens,
        block: p.block,
        pool_blocks: p.pool_blocks,
        table_len: p.table_len,
        scale: p.scale,
        window: p.window,
        softcap: p.softcap,
    })])
    .map(|()| read(d, &bo, n))
}

/// Several sequences of different lengths in one pool, their blocks shuffled, each token
/// through its own table slice; tokens whose table is too short or names a block outside the
/// pool are skipped by GPU kernels (their output rows keep what was there) and refused by the
/// CPU, so the valid tokens also run alone on every device.
#[test]
fn paged_attention_over_shuffled_blocks_of_several_sequences() {
    // Every device, then the wgpu and vulkan ones again with decode attention cut by keys
    // (`paged_attention_split.wgsl` and its merge), forced whatever the context.
    // And with the grouped first pass (`paged_attention_grouped.wgsl`: 3 query heads a
    // key/value head here).
    let split = split_attention_devices();
    let grouped = grouped_attention_devices();
    let mut rng = StdRng::seed_from_u64(16);
    let (heads, kv_heads) = (6usize, 2usize);
    let seqs = [
        // A token with no keys (a batch's padding, say) gets zeros, as the reference writes.
        PagedSeq {
            len: 1,
            queries: vec![1, 0],
        },
        PagedSeq {
            len: 16,
            queries: vec![16, 9],
        },
        PagedSeq {
            len: 17,
            queries: vec![17],
        },
        // Past 256 keys the kernels' chunk loop runs more than once.
        PagedSeq {
            len: 300,
            queries: vec![300, 257, 256],
        },
    ];
    // Blocks of 16 (a sequence of exactly one block, one of a block and one) and of an odd 5;
    // sliding windows of 7 (starting within a block) and of 30 (past the first 256-key chunk
    // of the longest sequence); a soft cap of 0.5, which bends every score.
    for (head_dim, block, window, softcap) in [
        (64usize, 16usize, 0u32, 0.0f32),
        (40, 5, 0, 0.0),
        (40, 5, 7, 0.5),
        (64, 16, 30, 0.0),
    ] {
        let kv_dim = kv_heads * head_dim;
        let n_blocks: Vec<usize> = seqs.iter().map(|s| s.len.div_ceil(block)).collect();
        // Spare blocks stay NaN: a kernel reading a wrong slot makes NaNs.
        let pool_blocks = n_blocks.iter().sum::<usize>() + 3;
        let mut order: Vec<u32> = (0..pool_blocks as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.random_range(0..=i));
        }
        // The table: two junk entries, then each sequence's blocks.
        let mut table: Vec<u32> = vec![u32::MAX, 5];
        let mut starts = Vec::new();
        let mut next = order.iter();
        for &nb in &n_blocks {
            starts.push(table.len() as u32);
            table.extend(next.by_ref().take(nb));
        }
        let mut kp = vec![f32::NAN; pool_blocks * block * kv_dim];
        let mut vp = kp.clone();
        for (s, seq) in seqs.iter().enumerate() {
            for j in 0..seq.len {
                let slot = table[starts[s] as usize + j / block] as usize * block + j % block;
                kp[slot * kv_dim..][..kv_dim].copy_from_slice(&rand_vec(&mut rng, kv_dim, 1.0));
                vp[slot * kv_dim..][..kv_dim].copy_from_slice(&rand_vec(&mut rng, kv_dim, 1.0));
            }
        }
        let good: Vec<u32> = seqs
            .iter()
            .zip(&starts)
            .flat_map(|(seq, &start)| seq.queries.iter().flat_map(move |&n| [start, n as u32]))
            .collect();
        // Table too short: the last entry for 2 blocks' keys; a start past the table; the
        // junk entry u32::MAX as a block.
        let table_len = table.len() as u32;
        let bad_rows = [
            [table_len - 1, (block + 1) as u32],
            [table_len + 7, 1],
            [0, 1],
        ];
        let n_good = good.len() / 2;
        let q = rand_vec(&mut rng, (n_good + bad_rows.len()) * heads * head_dim, 1.0);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let params = |tokens: usize| PagedAttentionParams {
            heads: heads as u32,
            kv_heads: kv_heads as u32,
            head_dim: head_dim as u32,
            tokens: tokens as u32,
            block: block as u32,
            pool_blocks: pool_blocks as u32,
            table_len,
            scale,
            window,
            softcap,
            _pad0: 0,
            _pad1: 0,
        };
        let row = heads * head_dim;
        let mut want = vec![0f32; n_good * row];
        k::paged::paged_attention(
            &q[..n_good * row],
            &kp,
            &vp,
            &good,
            &table,
            &mut want,
            &params(n_good),
        )
        .unwrap();
        // The mixed batch: bad tokens interleaved at 1, 3 and the end; their rows stay 7.
        let mut mixed_rows = Vec::new();
        let mut mixed_q = Vec::new();
        let mut mixed_want = Vec::new();
        let (mut gi, mut bi) = (0, 0);
        for t in 0..n_good + bad_rows.len() {
            if (t == 1 || t == 3 || t == n_good + bad_rows.len() - 1) && bi < bad_rows.len() {
                mixed_rows.extend(bad_rows[bi]);
                mixed_q.extend_from_slice(&q[(n_good + bi) * row..][..row]);
                mixed_want.extend(std::iter::repeat_n(7.0f32, row));
                bi += 1;
            } else {
                mixed_rows.extend([good[2 * gi], good[2 * gi + 1]]);
                mixed_q.extend_from_slice(&q[gi * row..][..row]);
                mixed_want.extend_from_slice(&want[gi * row..][..row]);
                gi += 1;
            }
        }
        assert_eq!((gi, bi), (n_good, bad_rows.len()));
        for d in devices().iter().chain(&split).chain(&grouped) {
            let run = |q: &[f32], rows: &[u32], tokens: usize| {
                run_paged_attention(d, q, (&kp, &vp), (rows, &table), &params(tokens))
            };
            // Online softmax rescales partial sums: 1e-5 relative, as dense attention.
            let got = run(&q[..n_good * row], &good, n_good).unwrap();
            let what = format!(
                "paged attention head_dim={head_dim} block={block} window={window} softcap={softcap}"
            );
            assert_close(&what, d, &got, &want, 1e-5);
            let mixed = run(&mixed_q, &mixed_rows, n_good + bad_rows.len());
            if d.kind() == BackendKind::Cpu {
                let err = mixed.unwrap_err().to_string();
                assert!(err.contains("outside the key/value pool"), "{err}");
            } else {
                let what = format!("{what} with skipped tokens");
                assert_close(&what, d, &mixed.unwrap(), &mixed_want, 1e-5);
            }
        }
    }
}

/// Gemma's ops: the GELU-gated product over inputs reaching both saturated ends (|g| > 10),
/// and scaling with and without a soft cap, over values well past the cap.
#[test]
fn gelu_mul_and_scale_cap() {
    let mut rng = StdRng::seed_from_u64(43);
    let n = 1003usize;
    let g = rand_vec(&mut rng, n, 14.0);
    let u = rand_vec(&mut rng, n, 2.0);
    let x = rand_vec(&mut rng, n, 80.0);
    let mut gelu_want = vec![0f32; n];
    k::elementwise::gelu_mul(&g, &u, &mut gelu_want);
    // Both ends and the middle are exercised, so a kernel that drops a branch fails.
    assert!(g.iter().any(|v| *v > 10.0) && g.iter().any(|v| *v < -10.0));
    assert!((k::elementwise::gelu(1.0) - 0.841_192).abs() < 1e-5);
    let mut scaled_want = x.clone();
    k::elementwise::scale_cap(&mut scaled_want, 3.5, 0.0);
    let mut capped_want = x.clone();
    k::elementwise::scale_cap(&mut capped_want, 1.0, 30.0);
    assert!(capped_want.iter().all(|v| v.abs() <= 30.0));
    assert!(capped_want.iter().any(|v| v.abs() > 29.0));
    for d in devices() {
        let (bg, bu) = (upload_f32(&d, "g", &g), upload_f32(&d, "u", &u));
        let bo = d.alloc("o", (n * 4) as u64).unwrap();
        let (bs, bc) = (upload_f32(&d, "s", &x), upload_f32(&d, "c", &x));
        d.run(&[
            Op::GeluMul(GeluMul {
                gate: &bg,
                up: &bu,
                out: &bo,
                n: n as u32,
            }),
            Op::ScaleCap(ScaleCap {
                x: &bs,
                n: n as u32,
                scale: 3.5,
                cap: 0.0,
            }),
            Op::ScaleCap(ScaleCap {
                x: &bc,
                n: n as u32,
                scale: 1.0,
                cap: 30.0,
            }),
        ])
        .unwrap();
        // tanh differs by a few ulps between implementations.
        assert_close("gelu_mul", &d, &read(&d, &bo, n), &gelu_want, 1e-5);
        assert_close("scale", &d, &read(&d, &bs, n), &scaled_want, 1e-6);
        assert_close("soft cap", &d, &read(&d, &bc, n), &capped_want, 1e-5);
    }
}

#[test]
fn bias_add_on_awkward_rows() {
    let mut rng = StdRng::seed_from_u64(41);
    for (cols, tokens) in [(1usize, 1usize), (7, 3), (300, 5), (1000, 1)] {
        let x = rand_vec(&mut rng, cols * tokens, 2.0);
        let bias = rand_vec(&mut rng, cols, 1.0);
        let mut want = x.clone();
        k::elementwise::add_bias(&mut want, &bias);
        for d in devices() {
            let bx = upload_f32(&d, "x", &x);
            let bb = upload_f32(&d, "bias", &bias);
            d.run(&[Op::AddBias(AddBias {
                x: &bx,
                bias: &bb,
                cols: cols as u32,
                tokens: tokens as u32,
            })])
            .unwrap();
            assert_close(
                &format!("add_bias {cols}x{tokens}"),
                &d,
                &read(&d, &bx, x.len()),
                &want,
                1e-6,
            );
        }
    }
}

#[test]
fn per_head_rmsnorm_over_head_rows() {
    // Qwen3's Q/K norm: the model's RmsNorm over rows of head_dim, one row per (token, head).
    let mut rng = StdRng::seed_from_u64(42);
    let (heads, head_dim, tokens) = (5usize, 72usize, 3usize);
    let x = rand_vec(&mut rng, tokens * heads * head_dim, 3.0);
    let w = rand_vec(&mut rng, head_dim, 1.0);
    let mut want = vec![0f32; x.len()];
    k::norm::rms_norm(&x, &w, &mut want, head_dim, 1e-6);
    for d in devices() {
        let bx = upload_f32(&d, "x", &x);
        let bw = upload_f32(&d, "w", &w);
        let by = d.alloc("y", (x.len() * 4) as u64).unwrap();
        d.run(&[Op::RmsNorm(RmsNorm {
            x: &bx,
            weight: &bw,
            y: &by,
            dim: head_dim as u32,
            tokens: (tokens * heads) as u32,
            eps: 1e-6,
        })])
        .unwrap();
        assert_close("head rmsnorm", &d, &read(&d, &by, x.len()), &want, 1e-5);
    }
}

#[test]
fn embed_every_table_format() {
    let mut rng = StdRng::seed_from_u64(5);
    for (ty, dim) in [
        (GgmlType::F32, 37usize),
        (GgmlType::F16, 37),
        (GgmlType::Q8_0, 64),
        (GgmlType::Q4_0, 64),
        (GgmlType::Q4_1, 96),
        (GgmlType::Q5_0, 64),
        (GgmlType::Q5_1, 96),
        (GgmlType::Q2_K, 256),
        (GgmlType::Q3_K, 256),
        (GgmlType::Q4_K, 256),
        (GgmlType::Q5_K, 512),
        (GgmlType::Q6_K, 256),
    ] {
        let vocab = 50usize;
        let tf = rand_vec(&mut rng, vocab * dim, 1.0);
        let table: Vec<u8> = tf.chunks(dim).flat_map(|r| quantize_row(ty, r)).collect();
        // An id past the vocabulary must give a zero row, not a read past the table.
        let ids = [3u32, 49, 0, 3, 53];
        let mut want = vec![0f32; ids.len() * dim];
        k::embed::embed(&table, ty, &ids, &mut want, dim, vocab);
        assert!(want[4 * dim..].iter().all(|v| *v == 0.0));
        for d in devices() {
            let bt = d.upload("table", &table).unwrap();
            let bi = d.upload("ids", bytemuck::cast_slice(&ids)).unwrap();
            let bo = d.alloc("out", (ids.len() * dim * 4) as u64).unwrap();
            d.run(&[Op::Embed(Embed {
                table: &bt,
                ttype: ty,
                ids: &bi,
                out: &bo,
                dim: dim as u32,
                vocab: vocab as u32,
                tokens: ids.len() as u32,
            })])
            .unwrap();
            // Dequantization is exact arithmetic on both sides.
            assert_close(
                &format!("embed {ty:?}"),
                &d,
                &read(&d, &bo, want.len()),
                &want,
                1e-6,
            );
        }
    }
}

#[test]
fn attention_decode_and_causal_prefill() {
    let mut rng = StdRng::seed_from_u64(6);
    let (heads, kv_heads, head_dim) = (6usize, 2usize, 40usize);
    // pos0 + tokens > 256 exercises the chunked online softmax; sliding windows start inside
    // the first chunk, in the second (skipping the first), and cut a prefill's rows; soft
    // caps of 0.5 and 0.7 bend every score.
    for (tokens, pos0, window, softcap) in [
        (1usize, 0usize, 0usize, 0.0f32),
        (1, 300, 0, 0.0),
        (7, 0, 0, 0.0),
        (5, 290, 0, 0.5),
        (1, 300, 37, 0.0),
        (7, 0, 3, 0.7),
        (5, 290, 100, 0.0),
    ] {
        check_attention(
            &mut rng,
            (heads, kv_heads, head_dim),
            (tokens, pos0),
            (window, softcap),
            |_| 1e-5,
        );
    }
}

/// Prefill attention with head sizes 64 and 128, which cuda runs on tensor cores (64 queries of
/// a head per block; Q, K, V and the softmax weights rounded to f16, sums and softmax in f32):
/// 4e-3 relative there (the outputs are averages of values of magnitude 1, each input rounded
/// at 2^-11), 1e-5 elsewhere.
#[test]
fn prefill_attention_at_head_sizes_64_and_128() {
    let mut rng = StdRng::seed_from_u64(16);
    let (heads, kv_heads) = (4usize, 2usize);
    // 100 tokens: a partial second tile of queries; pos0 37: keys before the prompt; windows
    // of 70 (keys of later rows start past the first tile) and 5, and Gemma 2's soft cap.
    for (head_dim, tokens, pos0, window, softcap) in [
        (64usize, 100usize, 0usize, 0usize, 0f32),
        (128, 100, 37, 0, 0.0),
        (64, 9, 70, 0, 0.0),
        (128, 150, 20, 70, 0.0),
        (64, 100, 3, 5, 2.0),
    ] {
        check_attention(
            &mut rng,
            (heads, kv_heads, head_dim),
            (tokens, pos0),
            (window, softcap),
            |d| {
                if attention_on_tensor_cores(d, tokens) {
                    4e-3
                } else {
                    1e-5
                }
            },
        );
    }
}

/// Random q, k and v for one `Attention` op, run on every device and compared with the CPU
/// reference within `tol(device)` of the largest output.
fn check_attention(
    rng: &mut StdRng,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    (tokens, pos0): (usize, usize),
    (window, softcap): (usize, f32),
    tol: impl Fn(&Device) -> f32,
) {
    check_attention_on(
        &devices(),
        rng,
        (heads, kv_heads, head_dim),
        (tokens, pos0),
        (window, softcap),
        tol,
    );
}

/// [`check_attention`] on `devs`.
fn check_attention_on(
    devs: &[Device],
    rng: &mut StdRng,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    (tokens, pos0): (usize, usize),
    (window, softcap): (usize, f32),
    tol: impl Fn(&Device) -> f32,
) {
    let n_pos = pos0 + tokens;
    let q = rand_vec(rng, tokens * heads * head_dim, 1.0);
    let kc = rand_vec(rng, n_pos * kv_heads * head_dim, 1.0);
    let vc = rand_vec(rng, n_pos * kv_heads * head_dim, 1.0);
    let scale = 1.0 / (head_dim as f32).sqrt();
    let mut want = vec![0f32; q.len()];
    k::attention::attention(
        &q, &kc, &vc, &mut want, heads, kv_heads, head_dim, tokens, pos0, scale, window, softcap,
    );
    for d in devs {
        let (bq, bk, bv) = (
            upload_f32(d, "q", &q),
            upload_f32(d, "k", &kc),
            upload_f32(d, "v", &vc),
        );
        let bo = d.alloc("out", (q.len() * 4) as u64).unwrap();
        d.run(&[Op::Attention(Attention {
            q: &bq,
            k_cache: &bk,
            v_cache: &bv,
            out: &bo,
            heads: heads as u32,
            kv_heads: kv_heads as u32,
            head_dim: head_dim as u32,
            tokens: tokens as u32,
            pos0: pos0 as u32,
            scale,
            window: window as u32,
            softcap,
        })])
        .unwrap();
        assert_close(
            &format!(
                "attention head_dim={head_dim} tokens={tokens} pos0={pos0} window={window} softcap={softcap}"
            ),
            d,
            &read(d, &bo, q.len()),
            &want,
            tol(d),
        );
    }
}

/// The wgpu and vulkan devices, opened with decode attention cut by keys whatever the
/// context (`--wgpu-attention split`), on the per-head first pass (`--wgpu-attention-kernel
/// heads`).
fn split_attention_devices() -> Vec<Device> {
    wgsl_devices_with(|o| {
        o.wgpu.attention = cairn_engine::options::WgpuAttention::Split;
        o.wgpu.attention_kernel = cairn_engine::options::WgpuAttentionKernel::Heads;
    })
}

/// [`split_attention_devices`] with the grouped first pass (`--wgpu-attention-kernel
/// grouped`): a workgroup per key/value head scores all the query heads sharing it.
fn grouped_attention_devices() -> Vec<Device> {
    wgsl_devices_with(|o| {
        o.wgpu.attention = cairn_engine::options::WgpuAttention::Split;
        o.wgpu.attention_kernel = cairn_engine::options::WgpuAttentionKernel::Grouped;
    })
}

/// The grouped first pass (`attention_grouped.wgsl`, forced on every wgpu and vulkan device)
/// against the reference, at grouped-query ratios 1 (4 heads over 4), 3 (6 over 2: a group
/// short of the kernel's 4 heads), 4 (8 over 2) and 8 (16 over 2: two workgroups per
/// key/value head); head sizes 40 (vec4s of a row not a multiple of the 8 scoring lanes),
/// 64, 128 and 256 (the largest the kernels take); one key, pieces of one to a few keys,
/// pieces of more than the 32-key chunk (8 tokens over one key/value head: 32 pieces of
/// about 63 keys), pieces past the end left empty, windows and a soft cap. Tolerance 1e-5 of
/// the largest output, as the per-head kernels (f32 sums in another order only).
#[test]
fn grouped_decode_attention_matches_the_reference() {
    let devs = grouped_attention_devices();
    let mut rng = StdRng::seed_from_u64(27);
    for (heads, kv_heads, head_dim, tokens, pos0, window, softcap) in [
        (4usize, 4usize, 64usize, 1usize, 0usize, 0usize, 0.0f32),
        (6, 2, 40, 1, 300, 0, 0.0),
        (6, 2, 40, 3, 2, 0, 0.0),
        (6, 2, 40, 1, 700, 300, 0.5),
        (8, 2, 128, 1, 511, 0, 0.0),
        (8, 2, 128, 2, 900, 37, 0.0),
        (16, 2, 64, 1, 200, 0, 0.7),
        (4, 1, 256, 8, 2000, 0, 0.0),
        (4, 1, 128, 8, 2000, 100, 0.0),
    ] {
        check_attention_on(
            &devs,
            &mut rng,
            (heads, kv_heads, head_dim),
            (tokens, pos0),
            (window, softcap),
            |_| 1e-5,
        );
    }
}

/// The wgpu and vulkan devices, opened with the options `set` changes.
fn wgsl_devices_with(set: impl Fn(&mut cairn_engine::EngineOptions)) -> Vec<Device> {
    let mut found = cairn_engine::device::discover_blocking_with(options());
    set(found.options_mut());
    found
        .devices
        .iter()
        .filter(|i| {
            matches!(i.backend, BackendKind::Wgpu | BackendKind::Vulkan)
                && i.support != cairn_engine::Support::Unsupported
                && i.api != "gl"
        })
        .map(|i| pollster::block_on(found.open_info(i.clone())).expect("open device"))
        .collect()
}

/// Prompt attention on tiles of 16 queries (`--wgpu-prompt-attention tiles`, forced on every
/// wgpu and vulkan device) against the reference, 1e-5 of the largest output as the
/// one-workgroup kernels (the tiles reorder f32 sums only): dense over a cache at head sizes
/// 40, 64 and 128 (a partial last tile of queries, keys before the prompt, windows that
/// start past the first tiles of keys, a soft cap), and paged, a batch of three prompts'
/// chunks whose runs start and end inside blocks of 16 tokens, lone tokens between them, and
/// skipped tokens (a table too short, a block outside the pool) in and after a run.
#[test]
fn prompt_attention_on_tiles_matches_the_reference() {
    use cairn_engine::options::WgpuPromptAttention;
    let devs = wgsl_devices_with(|o| o.wgpu.prompt_attention = WgpuPromptAttention::Tiles);
    let mut rng = StdRng::seed_from_u64(27);
    let (heads, kv_heads) = (6usize, 2usize);
    for (head_dim, tokens, pos0, window, softcap) in [
        (40usize, 40usize, 0usize, 0usize, 0f32),
        (64, 100, 37, 0, 0.0),
        (128, 33, 300, 70, 0.0),
        (64, 17, 5, 5, 2.0),
    ] {
        check_attention_on(
            &devs,
            &mut rng,
            (heads, kv_heads, head_dim),
            (tokens, pos0),
            (window, softcap),
            |_| 1e-5,
        );
        for d in &devs {
            let ran = d.kernels_in_last_run().unwrap_or_default();
            assert_eq!(ran, ["attention_tiled"], "{}", d.info().id);
        }
    }

    // Paged: blocks of 5, shuffled in the pool; spare blocks NaN.
    let (head_dim, block) = (64usize, 5usize);
    let kv_dim = kv_heads * head_dim;
    let lens = [40usize, 70, 25];
    let n_blocks: Vec<usize> = lens.iter().map(|l| l.div_ceil(block)).collect();
    let pool_blocks = n_blocks.iter().sum::<usize>() + 2;
    let mut order: Vec<u32> = (0..pool_blocks as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let mut table: Vec<u32> = Vec::new();
    let mut starts = Vec::new();
    let mut next = order.iter();
    for &nb in &n_blocks {
        starts.push(table.len() as u32);
        table.extend(next.by_ref().take(nb));
    }
    let mut kp = vec![f32::NAN; pool_blocks * block * kv_dim];
    let mut vp = kp.clone();
    for (s, &len) in lens.iter().enumerate() {
        for j in 0..len {
            let slot = table[starts[s] as usize + j / block] as usize * block + j % block;
            kp[slot * kv_dim..][..kv_dim].copy_from_slice(&rand_vec(&mut rng, kv_dim, 1.0));
            vp[slot * kv_dim..][..kv_dim].copy_from_slice(&rand_vec(&mut rng, kv_dim, 1.0));
        }
    }
    // (table start, keys) a token: sequence 0's prompt from key 1 to 21 (tokens 0-20: a run
    // across the first block of 16), a lone token of sequence 2, sequence 1's chunk of keys
    // 51-70 (a run from token 22 into the next block), sequence 2's keys 10-23, then a token
    // whose table is too short and a run whose later keys pass the table's end.
    let mut rows: Vec<[u32; 2]> = Vec::new();
    rows.extend((1..=21).map(|n| [starts[0], n]));
    rows.push([starts[2], 23]);
    rows.extend((51..=70).map(|n| [starts[1], n]));
    rows.extend((10..=23).map(|n| [starts[2], n]));
    let good = rows.len();
    rows.push([table.len() as u32 - 1, (block + 1) as u32]);
    // Sequence 2 holds 25 keys in the last 5 entries of the table: 26 and on do not fit.
    rows.extend((24..=27).map(|n| [starts[2], n]));
    let tokens = rows.len();
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    let q = rand_vec(&mut rng, tokens * heads * head_dim, 1.0);
    let row = heads * head_dim;
    let params = |tokens: usize| PagedAttentionParams {
        heads: heads as u32,
        kv_heads: kv_heads as u32,
        head_dim: head_dim as u32,
        tokens: tokens as u32,
        block: block as u32,
        pool_blocks: pool_blocks as u32,
        table_len: table.len() as u32,
        scale: 1.0 / (head_dim as f32).sqrt(),
        window: 0,
        softcap: 0.0,
        _pad0: 0,
        _pad1: 0,
    };
    // The reference refuses bad tokens: the good ones alone, then 24 and 25 keys (still in
    // the table), with 7 where the kernels skip a token.
    let mut want = vec![0f32; good * row];
    k::paged::paged_attention(
        &q[..good * row],
        &kp,
        &vp,
        &flat[..2 * good],
        &table,
        &mut want,
        &params(good),
    )
    .unwrap();
    let fits = 2;
    let mut tail = vec![0f32; fits * row];
    let tail_q = &q[(good + 1) * row..][..fits * row];
    k::paged::paged_attention(
        tail_q,
        &kp,
        &vp,
        &flat[2 * (good + 1)..][..2 * fits],
        &table,
        &mut tail,
        &params(fits),
    )
    .unwrap();
    want.extend(std::iter::repeat_n(7.0f32, row));
    want.extend(tail);
    want.extend(std::iter::repeat_n(
        7.0f32,
        (tokens - good - 1 - fits) * row,
    ));
    for d in &devs {
        let got = run_paged_attention(d, &q, (&kp, &vp), (&flat, &table), &params(tokens)).unwrap();
        assert_eq!(
            d.kernels_in_last_run().unwrap_or_default(),
            ["paged_attention_tiled"],
            "{}",
            d.info().id
        );
        assert_close("paged attention on tiles", d, &got, &want, 1e-5);
    }
}

/// Decode attention cut by keys across workgroups and merged (flash-decoding,
/// `--wgpu-attention split`), forced on every wgpu and vulkan device, against the reference:
/// one key (one piece), a piece of exactly the 256-key chunk, 257 keys, a long context cut
/// into more pieces than keys a piece, pieces past the end left empty (5 keys, 3 tokens), a
/// window and a soft cap, and a batch of 8 tokens whose pieces pass a chunk. Tolerance 1e-5 of
/// the largest output, as the one-workgroup kernel (the merge reorders f32 sums only).
#[test]
fn split_decode_attention_matches_the_reference() {
    let devs = split_attention_devices();
    let mut rng = StdRng::seed_from_u64(26);
    let (heads, kv_heads, head_dim) = (6usize, 2usize, 40usize);
    // With 6 heads the grid aims at 43 pieces per (head, token) for one token, 6 for eight.
    for (tokens, pos0, window, softcap) in [
        (1usize, 0usize, 0usize, 0.0f32),
        (1, 255, 0, 0.0),
        (1, 256, 0, 0.0),
        (1, 700, 0, 0.5),
        (3, 2, 0, 0.0),
        (1, 700, 300, 0.0),
        (8, 2000, 0, 0.0),
    ] {
        check_attention_on(
            &devs,
            &mut rng,
            (heads, kv_heads, head_dim),
            (tokens, pos0),
            (window, softcap),
            |_| 1e-5,
        );
    }
    // The cut ran: a split and a merge dispatch, not the one-workgroup kernel.
    for d in &devs {
        let b = upload_f32(d, "qkv", &[0.5; 80]);
        let o = d.alloc("out", 80 * 4).unwrap();
        d.run(&[Op::Attention(Attention {
            q: &b,
            k_cache: &b,
            v_cache: &b,
            out: &o,
            heads: 2,
            kv_heads: 1,
            head_dim: 40,
            tokens: 1,
            pos0: 1,
            scale: 1.0,
            window: 0,
            softcap: 0.0,
        })])
        .unwrap();
        assert_eq!(d.launches_in_last_run(), Some(2), "{}", d.info().id);
    }
}

#[test]
fn argmax_and_sampling_pick_what_the_reference_picks() {
    let mut rng = StdRng::seed_from_u64(7);
    let n = 5003usize;
    let mut x = rand_vec(&mut rng, n, 10.0);
    x[4000] = 50.0;
    x[1234] = 50.0; // a tie: the first index wins
    let want = k::sample::argmax(&x);
    assert_eq!(want, 1234);
    // Distinct, well-separated logits so float differences in exp/log cannot flip a draw.
    let logits: Vec<f32> = (0..n).map(|i| ((i * 7919) % n) as f32 * 0.002).collect();
    for d in devices() {
        let bx = upload_f32(&d, "x", &x);
        let bo = d.alloc("out", 4).unwrap();
        d.run(&[Op::Argmax(Argmax {
            x: &bx,
            n: n as u32,
            out: &bo,
        })])
        .unwrap();
        let got = u32::from_le_bytes(d.read_blocking(&bo, 0, 4).unwrap().try_into().unwrap());
        assert_eq!(got, want, "argmax on {}", d.info().id);

        let bl = upload_f32(&d, "logits", &logits);
        let mut agree = 0;
        let total = 24;
        for step in 0..total {
            let params = SampleParams {
                temperature: [0.0, 0.7, 1.0, 1.3][step as usize % 4],
                top_k: [0, 40, 0, 5][step as usize % 4],
                top_p: [1.0, 1.0, 0.9, 0.5][step as usize % 4],
                seed: 42,
                step,
            };
            let want = k::sample::sample(&logits, &params);
            d.run(&[Op::Sample(Sample {
                logits: &bl,
                n: n as u32,
                out: &bo,
                params,
            })])
            .unwrap();
            let got = u32::from_le_bytes(d.read_blocking(&bo, 0, 4).unwrap().try_into().unwrap());
            if params.top_k > 0 {
                let rank = logits.iter().filter(|v| **v > logits[got as usize]).count();
                assert!(
                    rank < params.top_k as usize,
                    "draw outside top-k on {}",
                    d.info().id
                );
            }
            agree += u32::from(got == want);
        }
        // Same hash and thresholds; only exp/log rounding may differ.
        assert!(
            agree >= total - 1,
            "sampling agreed on {agree}/{total} draws on {}",
            d.info().id
        );
    }
}

#[test]
fn buffers_are_accounted_and_bad_requests_are_refused() {
    for d in devices() {
        let base = d.live_bytes();
        let a = d.alloc("a", 1000).unwrap();
        let b = d.upload("b", &[1u8; 12]).unwrap();
        assert_eq!(d.live_bytes(), base + 1012, "{}", d.info().id);
        drop(a);
        assert_eq!(
            d.live_bytes(),
            base + 12,
            "dropping frees on {}",
            d.info().id
        );
        // An unaligned tail is written zero-padded and read back exactly.
        let c = d.upload("c", &[7u8; 7]).unwrap();
        assert_eq!(d.read_blocking(&c, 0, 7).unwrap(), vec![7u8; 7]);
        assert_eq!(d.read_blocking(&b, 4, 4).unwrap(), vec![1u8; 4]);

        let err = d.read_blocking(&b, 8, 8).unwrap_err().to_string();
        assert!(err.contains("outside the 12-byte buffer"), "{err}");
        let err = d.write(&b, 10, &[0u8; 4]).unwrap_err().to_string();
        assert!(err.contains("outside"), "{err}");
        let y = d.alloc("y", 8).unwrap();
        let err = d
            .run(&[Op::Linear(Linear {
                w: &b,
                wtype: GgmlType::Q4_1,
                x: &c,
                y: &y,
                rows: 4,
                cols: 64,
                tokens: 1,
            })])
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs 160 bytes, has 12"), "{err}");
        let err = d
            .run(&[Op::Linear(Linear {
                w: &b,
                wtype: GgmlType::Q4_1,
                x: &c,
                y: &y,
                rows: 1,
                cols: 30,
                tokens: 1,
            })])
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a whole number of Q4_1 blocks"), "{err}");
        let err = d
            .run(&[Op::SiluMul(SiluMul {
                gate: &y,
                up: &b,
                out: &y,
                n: 2,
            })])
            .unwrap_err()
            .to_string();
        assert!(err.contains("must not also be an input"), "{err}");
    }
    // A buffer of one device cannot be used on another.
    let devs = devices();
    if devs.len() >= 2 {
        let foreign = devs[0].alloc("foreign", 16).unwrap();
        let err = devs[1]
            .read_blocking(&foreign, 0, 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("belongs to another device"), "{err}");
    }
}

#[test]
fn selection_falls_back_to_cpu_and_names_the_choices() {
    let found = cairn_engine::device::discover_blocking();
    assert!(
        found.devices.iter().any(|d| d.backend == BackendKind::Cpu),
        "the CPU is always listed"
    );
    // Discovery is meant to be quick; a generous bound that only a hang would break.
    assert!(
        found.elapsed.as_secs() < 10,
        "discovery took {:?}",
        found.elapsed
    );
    let auto = found.choose(&Default::default()).unwrap();
    assert!(
        !auto.is_software(),
        "automatic selection must not pick a software rasterizer"
    );
    let sel = |b: Option<&str>, id: Option<&str>| cairn_engine::Selection {
        backend: b.map(str::to_string),
        device: id.map(str::to_string),
    };
    assert_eq!(found.choose(&sel(Some("cpu"), None)).unwrap().id, "cpu");
    let err = found
        .choose(&sel(Some("metalx"), None))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no backend named 'metalx'") && err.contains("wgpu, cpu"),
        "{err}"
    );
    let err = found
        .choose(&sel(None, Some("nope-123")))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no device with id 'nope-123'") && err.contains("cpu (cpu"),
        "{err}"
    );
    match found.choose(&sel(Some("cuda"), None)) {
        Ok(d) => assert_eq!(d.backend, BackendKind::Cuda),
        Err(e) if BackendKind::Cuda.compiled() => {
            let err = e.to_string();
            assert!(err.contains("backend 'cuda' has no usable device"), "{err}");
        }
        Err(e) => {
            let err = e.to_string();
            assert!(err.contains("--features cuda"), "{err}");
        }
    }
    for d in &found.devices {
        assert_eq!(
            found
                .choose(&sel(None, Some(&d.id)))
                .map(|x| x.id.clone())
                .ok(),
            (d.support != cairn_engine::Support::Unsupported).then(|| d.id.clone())
        );
    }
}

/// Batched decode on the wgpu and vulkan streaming kernels: a device takes 8 decode rows a
/// pass with them (1 with `rows`), and on the first such device three sequences prefilled and then decoded together
/// through the paged pool (decode steps in one pass, through the batch kernel) give each
/// sequence the logits it gets alone (one-token kernels, fused), within 1e-3 of the largest
/// logit's magnitude (plus one), as the model test checks for the default kernels.
#[test]
fn a_decode_batch_on_the_streaming_kernels_matches_each_sequence_alone() {
    // The model runs on one device's streaming kernels (lavapipe runs the synthetic model
    // slowly); the kernels themselves are checked on every device above.
    let mut ran = false;
    for (variant, dev) in gpu_variants() {
        let want_rows = match variant {
            "rows" => 1,
            "stream" | "subgroup" => 8,
            _ => continue,
        };
        assert_eq!(
            dev.decode_rows_per_pass(),
            Some(want_rows),
            "{} {variant}",
            dev.info().id
        );
        if want_rows == 1 || ran {
            continue;
        }
        ran = true;
        cairn_tests::batching::synthetic_batches_match_each_sequence_alone(
            std::sync::Arc::new(dev),
            variant,
        );
    }
}

/// The packed-integer kernels (`--wgpu-matvec int8`: `quantize_q8`, then `dot4I8Packed` in the
/// streaming walk) on every wgpu and vulkan device whose WGSL has them, for the formats they
/// take: one token, and 3 and 8 (the batch kernel's partial and full token groups), against
/// the reference over the activations rounded to int8 as `quantize_q8` rounds them (per
/// 32-element block, step amax / 127). Tolerance: the f32 bound above, plus the largest weight
/// times the largest step, for an element the GPU's division rounds the other way at a tie.
/// Two products of the same activations share one quantize dispatch.
#[test]
fn linear_int8_kernels_match_the_rounded_reference() {
    use cairn_engine::backend::wgpu::PACKED_DOT_FEATURE;
    use cairn_engine::backend::wgpu::check::round_to_int8;
    let mut rng = StdRng::seed_from_u64(31);
    let mut found = cairn_engine::device::discover_blocking_with(options());
    found.options_mut().wgpu.matvec = WgpuMatvec::Int8;
    let mut ran = 0;
    for info in found.devices.clone() {
        if !matches!(info.backend, BackendKind::Wgpu | BackendKind::Vulkan)
            || info.support == cairn_engine::Support::Unsupported
            || info.api == "gl"
        {
            continue;
        }
        if !info.features.iter().any(|f| f == PACKED_DOT_FEATURE) {
            eprintln!("{}: no packed integer dot products; skipped", info.id);
            continue;
        }
        let d = pollster::block_on(found.open_info(info.clone())).expect("opens");
        ran += 1;
        for (ty, rows, cols) in [
            (GgmlType::Q8_0, 37, 96),
            (GgmlType::Q4_0, 37, 96),
            (GgmlType::Q4_1, 70, 160),
            (GgmlType::Q4_0, 11, 2048),
            (GgmlType::Q8_0, 9, 2080),
        ] {
            let wf = rand_vec(&mut rng, rows * cols, 1.0);
            let wq: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
            let row_bytes = wq.len() / rows;
            let mut deq = vec![0f32; cols];
            let max_w = (0..rows).fold(0f32, |m, r| {
                dequantize_row(ty, &wq[r * row_bytes..][..row_bytes], &mut deq);
                deq.iter().fold(m, |m, v| m.max(v.abs()))
            });
            let bw = d.upload("w", &wq).unwrap();
            for tokens in [1usize, 3, 8] {
                let x = rand_vec(&mut rng, tokens * cols, 1.0);
                let (xr, step) = round_to_int8(&x);
                let mut want = vec![0f32; tokens * rows];
                k::linear::linear(ty, &wq, &xr, &mut want, rows, cols, tokens);
                let bx = upload_f32(&d, "x", &x);
                let by = d.alloc("y", (tokens * rows * 4) as u64).unwrap();
                let by2 = d.alloc("y2", (tokens * rows * 4) as u64).unwrap();
                let lin = |y| {
                    Op::Linear(Linear {
                        w: &bw,
                        wtype: ty,
                        x: &bx,
                        y,
                        rows: rows as u32,
                        cols: cols as u32,
                        tokens: tokens as u32,
                    })
                };
                d.run(&[lin(&by), lin(&by2)]).unwrap();
                assert_eq!(
                    d.launches_in_last_run(),
                    Some(3),
                    "one quantize dispatch for both products on {}",
                    info.id
                );
                let scale = 1.0 + want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let tol = 2e-6 * cols as f32 + max_w * step / scale;
                for y in [&by, &by2] {
                    assert_close(
                        &format!("int8 linear {ty:?} {rows}x{cols} tokens={tokens}"),
                        &d,
                        &read(&d, y, tokens * rows),
                        &want,
                        tol,
                    );
                }
            }
        }
    }
    if std::env::var_os("CAIRN_TEST_REQUIRE_GPU").is_some() {
        assert!(ran > 0, "no device ran the packed-integer kernels");
    }
}

/// The prompt-product kernels of `WgpuOptions::prefill` forced one by one
/// (`linear_matmat_tiled`, session 15's 64 x 64 tiles, the `linear_gemm_*` tiles of 128, 64
/// and 32 rows by tokens staged in workgroup memory, and the `linear_gemm_coop*` tiles on
/// cooperative matrices where a vulkan device has them, else `gemm`) on every wgpu device and
/// every vulkan one but software rasterizers: partial tiles of rows and tokens at both edges,
/// whole tiles (the cooperative kernels store those straight into the output), one and several
/// steps of columns, several tiles each way, block formats, a K-quant, F16, and F32 rows of 36
/// elements, which no tile takes (the product falls back to `linear_matmat`). Same reference
/// and tolerance as `linear_every_format_matvec_and_matmat` (2e-6 x cols: f32 sums in another
/// order) but for the cooperative kernels' f16 operands (below). (Lavapipe takes 12 to 37 s to compile each of the vulkan
/// backend's SPIR-V for these kernels with a cold shader cache, against 0.3 s for wgpu's; the
/// WGSL is the same.)
#[test]
fn linear_prefill_kernels_match_the_reference() {
    use cairn_engine::options::WgpuPrefill;
    let mut rng = StdRng::seed_from_u64(41);
    let cases = [
        (GgmlType::Q4_1, 150usize, 160usize, 135usize),
        (GgmlType::Q8_0, 130, 96, 65),
        (GgmlType::Q6_K, 37, 256, 70),
        (GgmlType::F16, 13, 32, 9),
        (GgmlType::Q4_0, 11, 1024, 17),
        (GgmlType::F32, 10, 36, 20),
    ];
    let data: Vec<_> = cases
        .iter()
        .map(|&(ty, rows, cols, tokens)| {
            let wf = rand_vec(&mut rng, rows * cols, 1.0);
            let wq: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
            let x = rand_vec(&mut rng, tokens * cols, 1.0);
            let mut want = vec![0f32; tokens * rows];
            k::linear::linear(ty, &wq, &x, &mut want, rows, cols, tokens);
            (wq, x, want)
        })
        .collect();
    let mut ran = 0;
    for choice in [
        WgpuPrefill::Tiles,
        WgpuPrefill::Gemm128,
        WgpuPrefill::Gemm64,
        WgpuPrefill::Gemm32,
        WgpuPrefill::Coop64,
        WgpuPrefill::Coop128,
        WgpuPrefill::Coop64x128,
        WgpuPrefill::Coop64K64,
    ] {
        let mut found = cairn_engine::device::discover_blocking_with(options());
        found.options_mut().wgpu.prefill = choice;
        for info in found.devices.clone() {
            if !matches!(info.backend, BackendKind::Wgpu | BackendKind::Vulkan)
                || info.support == cairn_engine::Support::Unsupported
                || info.api == "gl"
                || (info.backend == BackendKind::Vulkan && info.is_software())
            {
                continue;
            }
            let d = pollster::block_on(found.open_info(info.clone())).expect("opens");
            ran += 1;
            for (&(ty, rows, cols, tokens), (wq, x, want)) in cases.iter().zip(&data) {
                let got = run_linear(&d, ty, wq, x, rows, cols, tokens);
                // Cooperative matrices take f16 weights and activations (each rounded by at most
                // 2^-11 of itself, f32 sums): errors of random sign, about sqrt(cols) x 1e-3 x
                // the mean |w x| of 0.25, 0.006 at 1,024 columns, against an allowance of 2e-3
                // of the largest sum (about 30 there). A misplaced element is off by units.
                let tol = if choice.coop() {
                    2e-3
                } else {
                    2e-6 * cols as f32
                };
                assert_close(
                    &format!("{choice:?} linear {ty:?} {rows}x{cols} tokens={tokens}"),
                    &d,
                    &got,
                    want,
                    tol,
                );
            }
        }
    }
    if std::env::var_os("CAIRN_TEST_REQUIRE_GPU").is_some() {
        assert!(ran > 0, "no device ran the prompt-product kernels");
    }
}

/// Products in a row from the same activations (Q, K and V; gate and up) may share one int8
/// rounding of them (the cpu backend does), but only while those activations are unchanged:
/// one run where the second product's input was rewritten in between, by a product on f32
/// weights (which takes the reference path, quantizing nothing) and by an `Add`, must give
/// what the same products give in runs of their own. On every device. Tolerance: 1e-5 (the
/// same kernels on the same inputs; a stale rounding is off by the whole change, here about
/// as large as the outputs).
#[test]
fn products_in_a_row_share_rounded_activations_only_while_unchanged() {
    let mut rng = StdRng::seed_from_u64(91);
    let (rows, cols, tokens) = (48, 64, 5);
    let wf = rand_vec(&mut rng, rows * cols, 1.0);
    let wq: Vec<u8> = wf
        .chunks(cols)
        .flat_map(|r| quantize_row(GgmlType::Q4_1, r))
        .collect();
    let square = rand_vec(&mut rng, cols * cols, 0.5);
    let x0 = rand_vec(&mut rng, tokens * cols, 1.0);
    let z = rand_vec(&mut rng, tokens * cols, 1.0);
    for d in devices() {
        let w = upload_weights(&d, "w", &wq, GgmlType::Q4_1, cols);
        let sq = upload_weights(
            &d,
            "square",
            bytemuck::cast_slice(&square),
            GgmlType::F32,
            cols,
        );
        let (x, bz) = (upload_f32(&d, "x", &x0), upload_f32(&d, "z", &z));
        let out = |n: &str| d.alloc(n, (tokens * rows * 4) as u64).expect("alloc");
        let (y1, y2, y3) = (out("y1"), out("y2"), out("y3"));
        fn product<'a>(
            (w, wtype): (&'a Buffer, GgmlType),
            x: &'a Buffer,
            y: &'a Buffer,
            [rows, cols, tokens]: [usize; 3],
        ) -> Op<'a> {
            Op::Linear(Linear {
                w,
                wtype,
                x,
                y,
                rows: rows as u32,
                cols: cols as u32,
                tokens: tokens as u32,
            })
        }
        let lin = |w, wtype, x, y, rows| product((w, wtype), x, y, [rows, cols, tokens]);
        let add = Op::Add(Add {
            a: &x,
            b: &bz,
            out: &x,
            n: (tokens * cols) as u32,
        });
        let ops = [
            lin(&w, GgmlType::Q4_1, &x, &y1, rows),
            lin(&sq, GgmlType::F32, &bz, &x, cols),
            lin(&w, GgmlType::Q4_1, &x, &y2, rows),
            add,
            lin(&w, GgmlType::Q4_1, &x, &y3, rows),
        ];
        d.run(&ops).expect("one run");
        let got = [&y1, &y2, &y3].map(|y| read(&d, y, tokens * rows));
        // The same ops again, each in a run of its own, from the same start.
        d.write(&x, 0, bytemuck::cast_slice(&x0)).expect("reset x");
        let mut want = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            d.run(std::slice::from_ref(op)).expect("alone");
            if matches!(i, 0 | 2 | 4) {
                let y = [&y1, &y2, &y3][i / 2];
                want.push(read(&d, y, tokens * rows));
            }
        }
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("product {} of the run", k + 1), &d, g, w, 1e-5);
        }
        // And the change was large enough to catch a stale rounding.
        let moved = want[0]
            .iter()
            .zip(&want[1])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            moved > 0.1,
            "the second product's input barely changed ({moved})"
        );
    }
}

//! Every matrix-vector kernel family against the reference, as a function: where the kernel
//! tests cannot run (a browser's WebGPU; headless Chromium calls it through the web package's
//! `checkGpuKernels`, since a wasm build has no test harness in a page).
//!
//! Each family (`rows`, `stream`, `subgroup` where the device has subgroups, `int8` where
//! WGSL's packed integer dot products compile) opens the device anew and runs `Linear` over
//! the formats with their own chunk loaders and one through the generic loader (F16), for one
//! token and, but for `rows` (whose several-token product is `linear_matmat`, the same in
//! every family), for five: the batch kernels' full and partial token groups.

use super::PACKED_DOT_FEATURE;
use crate::device::{Discovery, discover_with};
use crate::kernels::{Linear, Op, linear};
use crate::options::{EngineOptions, WgpuMatvec};
use crate::quant::{GgmlType, dequantize_row, quantize_row};

/// What [`check_matvec_kernels`] compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatvecCheck {
    /// The families run, by their `--wgpu-matvec` names.
    pub families: Vec<&'static str>,
    /// Products compared with the reference.
    pub comparisons: usize,
}

/// (format, rows, cols): row counts that leave a partial workgroup of rows.
const CASES: &[(GgmlType, usize, usize)] = &[
    (GgmlType::Q8_0, 37, 96),
    (GgmlType::Q4_0, 37, 96),
    (GgmlType::Q4_1, 70, 160),
    (GgmlType::Q4_K, 11, 256),
    (GgmlType::Q6_K, 9, 256),
    (GgmlType::F16, 13, 136),
];

/// A small deterministic generator (xorshift64*): no `rand` at run time.
struct Rng(u64);

impl Rng {
    /// Uniform in `[-1, 1)`.
    fn unit(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (r >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.unit()).collect()
    }
}

/// `x` as `quantize_q8` rounds it: per 32-element block, step amax / 127, ties to even.
/// Also the largest step.
pub fn round_to_int8(x: &[f32]) -> (Vec<f32>, f32) {
    let mut out = x.to_vec();
    let mut max_step = 0f32;
    for b in out.chunks_mut(32) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        max_step = max_step.max(d);
        for v in b.iter_mut() {
            *v = (*v * id).round_ties_even() * d;
        }
    }
    (out, max_step)
}

/// Runs every family on the wgpu device `id`, each on a device opened anew from a discovery
/// of its own with `options` (a browser's adapter opens one device only); `Err` names the
/// first product that differs from the reference by more than its tolerance.
///
/// Tolerance: `2e-6 * cols * (1 + max|ref|)`, the kernel tests' bound for a reordered f32 sum
/// of the same dequantized weights. The `int8` family is compared with the reference over the
/// activations rounded as `quantize_q8` rounds them, with room for one element rounded the
/// other way at a tie (the GPU's division need not be correctly rounded): the largest weight
/// times the largest step more.
pub async fn check_matvec_kernels(
    options: &EngineOptions,
    id: &str,
) -> Result<MatvecCheck, String> {
    let find = |d: &Discovery| d.devices.iter().find(|d| d.id == id).cloned();
    let info =
        find(&discover_with(options.clone()).await).ok_or_else(|| format!("no device {id}"))?;
    let has = |f: &str| info.features.iter().any(|g| g == f);
    let mut families = vec![("rows", WgpuMatvec::Rows), ("stream", WgpuMatvec::Stream)];
    if has("subgroups") {
        families.push(("subgroup", WgpuMatvec::Subgroup));
    }
    if has(PACKED_DOT_FEATURE) {
        families.push(("int8", WgpuMatvec::Int8));
    }
    let mut comparisons = 0;
    for &(name, family) in &families {
        let mut opts = options.clone();
        opts.wgpu.matvec = family;
        let discovery = discover_with(opts).await;
        let info = find(&discovery).ok_or_else(|| format!("{name}: no device {id}"))?;
        let device = discovery
            .open_info(info)
            .await
            .map_err(|e| format!("opening {id} with the {name} kernels: {e}"))?;
        comparisons += check_family(&device, name, family).await?;
    }
    Ok(MatvecCheck {
        families: families.iter().map(|(n, _)| *n).collect(),
        comparisons,
    })
}

async fn check_family(
    device: &crate::Device,
    name: &str,
    family: WgpuMatvec,
) -> Result<usize, String> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut comparisons = 0;
    let e = |what: &str, err: crate::backend::BackendError| format!("{name}: {what}: {err}");
    for &(ty, rows, cols) in CASES {
        let wf = rng.vec(rows * cols);
        let wq: Vec<u8> = wf.chunks(cols).flat_map(|r| quantize_row(ty, r)).collect();
        let mut deq = vec![0f32; rows * cols];
        let row_bytes = wq.len() / rows;
        for (r, out) in deq.chunks_mut(cols).enumerate() {
            dequantize_row(ty, &wq[r * row_bytes..][..row_bytes], out);
        }
        let max_w = deq.iter().fold(0f32, |m, v| m.max(v.abs()));
        let int8 = family == WgpuMatvec::Int8 && cairn_shaders::INT8_FORMATS.contains(&ty.name());
        let tokens_run: &[usize] = if family == WgpuMatvec::Rows {
            &[1]
        } else {
            &[1, 5]
        };
        for &tokens in tokens_run {
            let x = rng.vec(tokens * cols);
            let (xr, slack) = if int8 {
                let (xr, step) = round_to_int8(&x);
                (xr, max_w * step)
            } else {
                (x.clone(), 0.0)
            };
            let mut want = vec![0f32; tokens * rows];
            linear::linear(ty, &wq, &xr, &mut want, rows, cols, tokens);
            let bw = device.upload("w", &wq).map_err(|err| e("upload", err))?;
            let bx = device
                .upload("x", bytemuck::cast_slice(&x))
                .map_err(|err| e("upload", err))?;
            let by = device
                .alloc("y", (tokens * rows * 4) as u64)
                .map_err(|err| e("alloc", err))?;
            device
                .run(&[Op::Linear(Linear {
                    w: &bw,
                    wtype: ty,
                    x: &bx,
                    y: &by,
                    rows: rows as u32,
                    cols: cols as u32,
                    tokens: tokens as u32,
                })])
                .map_err(|err| e("run", err))?;
            let got = device.read_f32(&by).await.map_err(|err| e("read", err))?;
            let scale = 1.0 + want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let tol = 2e-6 * cols as f32 * scale + slack;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // NaN fails too.
                if (g - w).abs().is_nan() || (g - w).abs() > tol {
                    return Err(format!(
                        "{name}: linear {} {rows}x{cols} tokens={tokens}: element {i} is {g}, the reference {w} (allowed {tol})",
                        ty.name()
                    ));
                }
            }
            comparisons += 1;
        }
    }
    Ok(comparisons)
}

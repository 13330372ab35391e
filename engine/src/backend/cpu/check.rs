//! This build's SIMD dot products against the scalar reference, as a function: where unit
//! tests cannot run (the browser's wasm build: headless Chromium calls it through the web
//! package's `checkCpuKernels`), and natively from the unit tests.
//!
//! Every quantized format, on awkward shapes (one block, three, many), random bit patterns
//! with finite scales, activations with outliers and an all-zero block.

use half::f16;

use super::dot::Isa;
use super::dot::tile::{Acts, TILE, Tile};
use super::q8::Q8;
use super::vecf32::VecF32;
use crate::quant::{GgmlType, dequantize_row};

/// What [`check_kernels`] compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCheck {
    /// The instruction sets compared with the scalar reference (none: only the reference).
    pub isas: Vec<&'static str>,
    /// Dot products compared.
    pub comparisons: usize,
    /// How many of them were prefill tile kernels' results (`dot/tile.rs`).
    pub tiles: usize,
}

/// A small deterministic generator (xorshift64*): the check needs no `rand` at run time.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `[-1, 1)`.
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Byte offsets of each block's f16 scales.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[0],
    }
}

/// Compares every SIMD kernel this build runs (the integer dot products and attention's f32
/// helpers) with the scalar one; `Err` names the first that differs by more than float
/// rounding.
pub fn check_kernels() -> Result<KernelCheck, String> {
    let isas: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
        .collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut comparisons = 0;
    let mut q8 = Q8::default();
    for ty in GgmlType::ALL.into_iter().filter(|t| t.block_len() > 1) {
        let Some((reference, layout)) = Isa::Scalar.dot(ty) else {
            continue;
        };
        let block = ty.block_len();
        for cols in [block, 3 * block, if block == 32 { 4096 } else { 2048 }] {
            let row_bytes = ty.row_bytes(cols).ok_or("a row of whole blocks")?;
            let mut w: Vec<u8> = (0..row_bytes).map(|_| rng.next() as u8).collect();
            for b in w.chunks_exact_mut(ty.block_bytes()) {
                for &at in f16_fields(ty) {
                    let v = f16::from_f32(rng.unit() * 0.05);
                    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            let mut x: Vec<f32> = (0..cols).map(|_| rng.unit()).collect();
            for _ in 0..cols / 64 {
                let i = (rng.next() % cols as u64) as usize;
                x[i] *= 20.0;
            }
            if cols >= 2 * layout.block() {
                x[layout.block()..2 * layout.block()].fill(0.0);
            }
            // Four tokens: the one compared alone, and three more for the four-token
            // kernels (the same values scaled and shifted, so each has its own steps).
            let x4: Vec<f32> = (0..4)
                .flat_map(|t| {
                    let x = &x;
                    x.iter().enumerate().map(move |(i, v)| match t {
                        0 => *v,
                        _ => v * (t as f32 + 0.5) - x[(i + t) % cols],
                    })
                })
                .collect();
            q8.quantize(layout, &x4, cols, 4);
            let mut deq = vec![0f32; cols];
            dequantize_row(ty, &w, &mut deq);
            let magnitude: f64 = deq
                .iter()
                .zip(&x)
                .map(|(a, b)| f64::from((a * b).abs()))
                .sum();
            let want = reference(&w, q8.row(0));
            for &isa in &isas {
                let Some((dot, _)) = isa.dot(ty) else {
                    continue;
                };
                let got = dot(&w, q8.row(0));
                comparisons += 1;
                let err = f64::from((got - want).abs());
                // NaN fails too.
                if err.is_nan() || err > 1e-5 * (magnitude * 1.5 + 1e-3) {
                    return Err(format!(
                        "{} {} over {cols} columns: {got}, the scalar reference {want}",
                        isa.name(),
                        ty.name()
                    ));
                }
                let Some(dot4) = isa.dot4(ty) else {
                    continue;
                };
                let rows: [_; 4] = std::array::from_fn(|t| q8.row(t));
                for (t, got) in dot4(&w, rows).into_iter().enumerate() {
                    let want = reference(&w, rows[t]);
                    let magnitude: f64 = deq
                        .iter()
                        .zip(&x4[t * cols..])
                        .map(|(a, b)| f64::from((a * b).abs()))
                        .sum();
                    comparisons += 1;
                    let err = f64::from((got - want).abs());
                    if err.is_nan() || err > 1e-5 * (magnitude * 1.5 + 1e-3) {
                        return Err(format!(
                            "{} {} four-token kernel, token {t}, over {cols} columns: {got}, \
                             the scalar reference {want}",
                            isa.name(),
                            ty.name()
                        ));
                    }
                }
            }
        }
    }
    let tiles = check_tiles(&isas, &mut rng)?;
    comparisons += tiles;
    // The browser's other SIMD helpers: the activations' rounding (bit for bit) and `exp`.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        let x: Vec<f32> = (0..203).map(|_| rng.unit() * 20.0).collect();
        comparisons += super::q8::check_simd128(&x)?;
        comparisons += super::exp_simd128::check(&x)?;
    }
    for &isa in &isas {
        let v = VecF32::new(isa);
        for n in [1, 3, 4, 7, 8, 15, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            let got = (v.dot)(&a, &b);
            let mut y = b.clone();
            (v.axpy)(&mut y, 0.75, &a);
            let axpy_ok = y
                .iter()
                .zip(a.iter().zip(&b))
                .all(|(y, (a, b))| (y - (b + 0.75 * a)).abs() <= 1e-6);
            comparisons +=
                2 + many_rows(&v, &a, &mut rng).map_err(|e| format!("{}: {e}", isa.name()))?;
            let dot_ok = (got - want).abs() <= 1e-5 * n as f32;
            if !(dot_ok && axpy_ok) {
                return Err(format!(
                    "{} f32 dot or axpy over {n}: dot {got}, the reference {want}",
                    isa.name()
                ));
            }
        }
    }
    Ok(KernelCheck {
        isas: isas.iter().map(|i| i.name()).collect(),
        comparisons,
        tiles,
    })
}

/// The many-row helpers (`dots`, `axpys`) against the one-row ones row by row: 1 to 9 rows
/// of `q.len()` elements with a gap between rows. Tolerance 1e-5 of the sum of the products'
/// magnitudes (f32 sums in another order; the wasm helpers give the one-row bits). Returns
/// how many results it compared.
fn many_rows(v: &VecF32, q: &[f32], rng: &mut Rng) -> Result<usize, String> {
    let (d, mut compared) = (q.len(), 0);
    let close = |g: f32, w: f32, scale: f32| (g - w).abs() <= 1e-5 * scale.max(1.0);
    for n in 1..=9 {
        let stride = d + 3;
        let rows: Vec<f32> = (0..n * stride).map(|_| rng.unit()).collect();
        let mut got = vec![0.0; n];
        (v.dots)(q, &rows, stride, &mut got);
        for (i, &g) in got.iter().enumerate() {
            let row = &rows[i * stride..][..d];
            let want = (v.dot)(q, row);
            let scale: f32 = q.iter().zip(row).map(|(a, b)| (a * b).abs()).sum();
            if !close(g, want, scale) {
                return Err(format!(
                    "dots over {n} rows of {d}: row {i} {g}, one row {want}"
                ));
            }
        }
        let w: Vec<f32> = (0..n).map(|_| rng.unit()).collect();
        let start: Vec<f32> = (0..d).map(|_| rng.unit()).collect();
        let (mut got, mut want) = (start.clone(), start);
        (v.axpys)(&mut got, &w, &rows, stride);
        for (i, &a) in w.iter().enumerate() {
            (v.axpy)(&mut want, a, &rows[i * stride..][..d]);
        }
        if let Some(e) = (0..d).find(|&e| !close(got[e], want[e], n as f32)) {
            return Err(format!(
                "axpys over {n} rows of {d}: element {e} {}, row by row {}",
                got[e], want[e]
            ));
        }
        compared += n + d;
    }
    Ok(compared)
}

/// Compares every prefill tile kernel of `isas` (`dot/tile.rs`: the unpacked tile against
/// several tokens) with the scalar one-token kernel, per row and token, on a partial tile (13
/// rows) and a full one; returns how many results it compared. Outliers are left out on both
/// sides (the callers add them alike).
fn check_tiles(isas: &[Isa], rng: &mut Rng) -> Result<usize, String> {
    let mut comparisons = 0;
    let mut q8 = Q8::default();
    let (mut d, mut s) = (Vec::new(), Vec::new());
    let mut t = Tile::default();
    for ty in GgmlType::ALL.into_iter().filter(|t| t.block_len() > 1) {
        let Some((reference, layout)) = Isa::Scalar.dot(ty) else {
            continue;
        };
        let block = ty.block_len();
        for (rows, cols) in [
            (13, 3 * block),
            (TILE, if block == 32 { 576 } else { 1536 }),
        ] {
            let row_bytes = ty.row_bytes(cols).ok_or("a row of whole blocks")?;
            let mut w: Vec<u8> = (0..rows * row_bytes).map(|_| rng.next() as u8).collect();
            for b in w.chunks_exact_mut(ty.block_bytes()) {
                for &at in f16_fields(ty) {
                    let v = f16::from_f32(rng.unit() * 0.05);
                    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            let tokens = 7;
            let mut x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit()).collect();
            x[cols..2 * cols].iter_mut().for_each(|v| *v *= 20.0);
            x[2 * cols..2 * cols + layout.block()].fill(0.0);
            q8.quantize(layout, &x, cols, tokens);
            let mut deq = vec![0f32; cols];
            for &isa in isas {
                let Some((kernel, format)) = isa.tile(ty) else {
                    continue;
                };
                let acts = Acts::new(&q8, format.sub, tokens, &mut d, &mut s);
                isa.fill_tile(&mut t, format, &w, row_bytes, 0..rows);
                let mut out = vec![[f32::NAN; TILE]; tokens];
                kernel(&t, &acts, 0..tokens, &mut out);
                for r in 0..rows {
                    let wr = &w[r * row_bytes..][..row_bytes];
                    dequantize_row(ty, wr, &mut deq);
                    for (tk, got) in out.iter().enumerate() {
                        let want = reference(wr, q8.row(tk));
                        let magnitude: f64 = deq
                            .iter()
                            .zip(&x[tk * cols..])
                            .map(|(a, b)| f64::from((a * b).abs()))
                            .sum();
                        comparisons += 1;
                        let err = f64::from((got[r] - want).abs());
                        if err.is_nan() || err > 1e-5 * (magnitude * 1.5 + 1e-3) {
                            return Err(format!(
                                "{} {} tile kernel over {cols} columns, row {r} of {rows}, \
                                 token {tk}: {}, the scalar reference {want}",
                                isa.name(),
                                ty.name(),
                                got[r]
                            ));
                        }
                    }
                }
            }
        }
    }
    Ok(comparisons)
}

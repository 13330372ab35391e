//! The cpu backend's integer paths against the scalar reference and the f32 reference, for
//! every quantized format, on awkward shapes: one block, many blocks, row counts that are
//! no multiple of a tile, one token and many.

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::dot::Isa;
use super::dot::tile::{Acts, TILE, Tile};
use super::linear::{linear, outlier_products};
use super::q8::{Layout, OUTLIER_RATIO, Q8};
use crate::kernels::linear as reference;
use crate::quant::{GgmlType, dequantize_row, quantize_row};

/// Every block-quantized format (all but F32 and F16).
fn quantized() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL.into_iter().filter(|t| t.block_len() > 1)
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

/// Activations in [-1, 1] with a few large outliers, and one all-zero block when there are
/// several (a block whose step is 0).
fn activations(rng: &mut StdRng, n: usize, block: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
    for _ in 0..n / 64 {
        let i = rng.random_range(0..n);
        x[i] *= 20.0;
    }
    if n >= 2 * block {
        x[block..2 * block].fill(0.0);
    }
    x
}

/// Every bit pattern the format can hold: random bytes, with the f16 scales made finite.
fn random_rows(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let row_bytes = ty.row_bytes(cols).expect("whole blocks");
    let mut w: Vec<u8> = (0..rows * row_bytes).map(|_| rng.random()).collect();
    for b in w.chunks_exact_mut(ty.block_bytes()) {
        for &at in f16_fields(ty) {
            let v = f16::from_f32(rng.random_range(-0.05..0.05));
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    w
}

/// Weights as the quantizers make them from a smooth-ish f32 matrix.
fn quantized_rows(rng: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    (0..rows)
        .flat_map(|_| {
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-0.5..0.5)).collect();
            quantize_row(ty, &x)
        })
        .collect()
}

fn layout(ty: GgmlType) -> Layout {
    Isa::Scalar.dot(ty).expect("a quantized format").1
}

/// `Σ |w_i x_i|` with the weights dequantized: the scale float rounding is measured against.
fn magnitude(w: &[f32], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(a, b)| f64::from((a * b).abs())).sum()
}

/// The bound int8 activations put on a dot product (see `q8`): half a step per element, the
/// step set by a block's largest magnitude or, in a super-block where that is more than
/// `OUTLIER_RATIO` times its third largest, by the third largest (the larger two are
/// multiplied exactly).
fn rounding_bound(w: &[f32], x: &[f32], block: usize) -> f64 {
    w.chunks(block)
        .zip(x.chunks(block))
        .map(|(wb, xb)| {
            let mut mags: Vec<f32> = xb.iter().map(|v| v.abs()).collect();
            mags.sort_by(|a, b| b.total_cmp(a));
            let step = if block == 256 && mags[0] > OUTLIER_RATIO * mags[2] {
                mags[2]
            } else {
                mags[0]
            };
            f64::from(step) / 254.0 * wb.iter().map(|v| f64::from(v.abs())).sum::<f64>()
        })
        .sum()
}

fn col_counts(ty: GgmlType) -> [usize; 3] {
    let b = ty.block_len();
    [b, 3 * b, if b == 32 { 4096 } else { 2048 }]
}

#[test]
fn every_isa_matches_the_scalar_reference_on_every_format() {
    let mut rng = StdRng::seed_from_u64(20);
    let isas = Isa::available();
    eprintln!(
        "instruction sets here: {:?}",
        isas.iter().map(|i| i.name()).collect::<Vec<_>>()
    );
    for ty in quantized() {
        for cols in col_counts(ty) {
            let rows = 5;
            let w = random_rows(&mut rng, ty, rows, cols);
            let x = activations(&mut rng, cols, layout(ty).block());
            let mut q8 = Q8::default();
            q8.quantize(layout(ty), &x, cols, 1);
            let row_bytes = ty.row_bytes(cols).expect("whole blocks");
            let mut deq = vec![0f32; cols];
            for r in 0..rows {
                let wr = &w[r * row_bytes..][..row_bytes];
                dequantize_row(ty, wr, &mut deq);
                let scale = magnitude(&deq, &x) * 1.5 + 1e-3;
                let want = (Isa::Scalar.dot(ty).expect("quantized").0)(wr, q8.row(0));
                for &isa in &isas {
                    let got = (isa.dot(ty).expect("quantized").0)(wr, q8.row(0));
                    let err = f64::from((got - want).abs());
                    assert!(
                        err <= 1e-5 * scale,
                        "{} {} cols {cols} row {r}: {got} vs scalar {want}",
                        isa.name(),
                        ty.name()
                    );
                }
            }
        }
    }
}

#[test]
fn int8_activations_stay_within_their_rounding_bound_of_f32() {
    let mut rng = StdRng::seed_from_u64(21);
    for ty in quantized() {
        for cols in col_counts(ty) {
            let w = quantized_rows(&mut rng, ty, 3, cols);
            let block = layout(ty).block();
            let x = activations(&mut rng, cols, block);
            let mut q8 = Q8::default();
            q8.quantize(layout(ty), &x, cols, 1);
            let row_bytes = ty.row_bytes(cols).expect("whole blocks");
            let mut deq = vec![0f32; cols];
            for (r, wr) in w.chunks_exact(row_bytes).enumerate() {
                dequantize_row(ty, wr, &mut deq);
                let exact: f64 = deq
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let bound = rounding_bound(&deq, &x, block) + 1e-5 * magnitude(&deq, &x) + 1e-6;
                let got = (Isa::detect().dot(ty).expect("quantized").0)(wr, q8.row(0))
                    + outlier_products(ty, wr, q8.row(0));
                let err = (f64::from(got) - exact).abs();
                assert!(
                    err <= bound,
                    "{} cols {cols} row {r}: {got} vs f32 {exact}: error {err} over bound {bound}",
                    ty.name()
                );
            }
        }
    }
}

/// A super-block with massive activations: they are kept aside with what saturation cut
/// off, the other elements get a step a hundred times finer, and the product is as close to
/// f32 as that finer step allows. The 32-element blocks keep the plain rule.
#[test]
fn massive_activations_do_not_coarsen_their_super_block() {
    let mut rng = StdRng::seed_from_u64(27);
    for ty in [
        GgmlType::Q6_K,
        GgmlType::Q5_K,
        GgmlType::Q4_K,
        GgmlType::Q5_1,
    ] {
        let block = layout(ty).block();
        let cols = 2 * block;
        let w = quantized_rows(&mut rng, ty, 1, cols);
        let mut x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        x[3] = 150.0;
        x[5] = -90.0;
        x[block + 7] = -200.0;
        x[block + 9] = 120.0;
        let mut q8 = Q8::default();
        q8.quantize(layout(ty), &x, cols, 1);
        let row = q8.row(0);
        let kept: Vec<u32> = row.outliers.iter().map(|o| o.col).collect();
        if block == 32 {
            assert!(kept.is_empty(), "{}: {kept:?}", ty.name());
            continue;
        }
        assert_eq!(
            kept,
            [3, 5, block as u32 + 7, block as u32 + 9],
            "{}",
            ty.name()
        );
        assert!(row.d.iter().all(|&d| d <= 1.0 / 127.0), "{}", ty.name());
        let mut deq = vec![0f32; cols];
        dequantize_row(ty, &w, &mut deq);
        let exact: f64 = deq
            .iter()
            .zip(&x)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let got =
            (Isa::detect().dot(ty).expect("quantized").0)(&w, row) + outlier_products(ty, &w, row);
        // Half a step of 1/127 per element (the largest of the rest is below 1).
        let bound = deq.iter().map(|v| f64::from(v.abs())).sum::<f64>() / 254.0
            + 1e-5 * magnitude(&deq, &x);
        let err = (f64::from(got) - exact).abs();
        assert!(
            err <= bound,
            "{}: {got} vs f32 {exact}: error {err} over {bound}",
            ty.name()
        );
    }
}

/// The threaded, tiled op (decode and prefill splits) gives each output exactly what the
/// dot product gives alone, and stays within the rounding bound of the f32 reference.
#[test]
fn linear_tiles_and_threads_agree_with_the_reference() {
    crate::kernels::linear::start_pool(Some(3));
    let mut rng = StdRng::seed_from_u64(22);
    let mut scratch = Q8::default();
    for ty in [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q3_K,
        GgmlType::F16,
    ] {
        let cols = if ty.block_len() == 1 {
            96
        } else {
            2 * ty.block_len()
        };
        for (rows, tokens) in [
            (1, 1),
            (37, 1),
            (300, 1),
            (37, 3),
            (41, 4),
            (53, 9),
            (300, 17),
            (29, 32),
            (37, 41),
        ] {
            let w = quantized_rows(&mut rng, ty, rows, cols);
            let x = activations(&mut rng, tokens * cols, 32);
            let mut y = vec![f32::NAN; rows * tokens];
            linear(
                Isa::detect(),
                &mut scratch,
                None,
                ty,
                &w,
                &x,
                &mut y,
                rows,
                cols,
                tokens,
            );
            let mut want = vec![0f32; rows * tokens];
            reference::linear(ty, &w, &x, &mut want, rows, cols, tokens);
            let row_bytes = ty.row_bytes(cols).expect("whole blocks");
            let mut deq = vec![0f32; cols];
            for r in 0..rows {
                dequantize_row(ty, &w[r * row_bytes..][..row_bytes], &mut deq);
                for t in 0..tokens {
                    let xt = &x[t * cols..][..cols];
                    let block = Isa::Scalar.dot(ty).map_or(1, |(_, l)| l.block());
                    let bound = if ty.block_len() == 1 {
                        0.0
                    } else {
                        rounding_bound(&deq, xt, block)
                    } + 1e-5 * magnitude(&deq, xt)
                        + 1e-6;
                    let (got, exp) = (y[t * rows + r], want[t * rows + r]);
                    assert!(
                        f64::from((got - exp).abs()) <= bound,
                        "{} rows {rows} tokens {tokens} at ({t}, {r}): {got} vs {exp}",
                        ty.name()
                    );
                }
            }
        }
    }
}

#[test]
fn zero_activations_give_zero_and_no_nan() {
    let mut scratch = Q8::default();
    for ty in quantized() {
        let cols = ty.block_len();
        let w = quantized_rows(&mut StdRng::seed_from_u64(23), ty, 4, cols);
        let x = vec![0f32; cols];
        let mut y = vec![f32::NAN; 4];
        linear(
            Isa::detect(),
            &mut scratch,
            None,
            ty,
            &w,
            &x,
            &mut y,
            4,
            cols,
            1,
        );
        assert!(y.iter().all(|v| *v == 0.0), "{}: {y:?}", ty.name());
    }
}

#[test]
fn vectorized_f32_helpers_match_the_scalar_ones() {
    let mut rng = StdRng::seed_from_u64(24);
    for isa in Isa::available() {
        let v = super::vecf32::VecF32::new(isa);
        for n in [1, 7, 8, 15, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            let got = (v.dot)(&a, &b);
            assert!(
                (got - want).abs() <= 1e-5 * n as f32,
                "{} dot n={n}: {got} vs {want}",
                isa.name()
            );
            let mut y = b.clone();
            (v.axpy)(&mut y, 0.75, &a);
            for i in 0..n {
                assert!(
                    (y[i] - (b[i] + 0.75 * a[i])).abs() <= 1e-6,
                    "{} axpy n={n} at {i}",
                    isa.name()
                );
            }
        }
    }
}

/// Decode and causal prefill, grouped heads, head sizes off the vector width, against the
/// reference attention.
#[test]
fn attention_matches_the_reference() {
    crate::kernels::linear::start_pool(Some(3));
    let mut rng = StdRng::seed_from_u64(25);
    let v = super::vecf32::VecF32::new(Isa::detect());
    for (heads, kv_heads, head_dim, tokens, pos0, window) in [
        (9, 3, 64, 1, 40, 0),
        (4, 4, 12, 7, 0, 0),
        (6, 2, 33, 5, 3, 4),
        (9, 3, 64, 33, 100, 0),
        (9, 3, 64, 33, 100, 17),
    ] {
        let cap = pos0 + tokens;
        let mut r =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let q = r(tokens * heads * head_dim);
        let kc = r(cap * kv_heads * head_dim);
        let vc = r(cap * kv_heads * head_dim);
        let scale = 1.0 / (head_dim as f32).sqrt();
        // Gemma 2's cap of 50 would hardly touch these scores; 0.5 bends them all.
        let softcap = if window > 0 { 0.5 } else { 0.0 };
        let mut want = vec![0f32; q.len()];
        crate::kernels::attention::attention(
            &q, &kc, &vc, &mut want, heads, kv_heads, head_dim, tokens, pos0, scale, window,
            softcap,
        );
        let mut got = vec![f32::NAN; q.len()];
        super::attention::attention(
            &v,
            &q,
            &kc,
            &vc,
            &mut got,
            [heads, kv_heads, head_dim, tokens, pos0, window],
            [scale, softcap],
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5,
                "shape {heads}/{kv_heads}/{head_dim} t{tokens} p{pos0} w{window} at {i}: {g} vs {w}"
            );
        }
    }
}

/// Decode's several-row kernels give each row what the scalar kernel gives it, and the very
/// bits the instruction set's one-row kernel gives it (see `a_tokens_products_do_not_depend_on_
/// its_batch`): row counts off the groups of four, block counts odd and even, the model's
/// rows of 576 and the tiny models' of 256.
#[test]
fn decode_row_kernels_match_the_scalar_kernel() {
    let mut rng = StdRng::seed_from_u64(27);
    let mut compared = 0;
    for isa in Isa::available() {
        for ty in quantized() {
            let Some(rows_kernel) = isa.rows(ty) else {
                continue;
            };
            let (scalar, layout) = Isa::Scalar.dot(ty).expect("quantized");
            let (one_row, _) = isa.dot(ty).expect("quantized");
            for cols in [32, 96, 256, 576, 4096] {
                let row_bytes = ty.row_bytes(cols).expect("whole blocks");
                for rows in [1, 3, 4, 5, 9] {
                    let w = random_rows(&mut rng, ty, rows, cols);
                    let x = activations(&mut rng, cols, layout.block());
                    let mut q8 = Q8::default();
                    q8.quantize(layout, &x, cols, 1);
                    // A NaN left in an output the kernel skipped fails the comparison.
                    let mut got = vec![f32::NAN; rows];
                    rows_kernel(&w, row_bytes, q8.row(0), &mut got);
                    let mut deq = vec![0f32; cols];
                    for (r, &g) in got.iter().enumerate() {
                        let wr = &w[r * row_bytes..][..row_bytes];
                        dequantize_row(ty, wr, &mut deq);
                        let scale = magnitude(&deq, &x) * 1.5 + 1e-3;
                        let want = scalar(wr, q8.row(0));
                        let err = f64::from((g - want).abs());
                        assert!(
                            err <= 1e-5 * scale,
                            "{} {} cols {cols} rows {rows} row {r}: {g} vs scalar {want}",
                            isa.name(),
                            ty.name()
                        );
                        let one = one_row(wr, q8.row(0));
                        assert_eq!(
                            g.to_bits(),
                            one.to_bits(),
                            "{} {} cols {cols} rows {rows} row {r}: {g} vs one-row kernel {one}",
                            isa.name(),
                            ty.name()
                        );
                        compared += 1;
                    }
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if Isa::available().iter().any(|i| i.name() == "avx512vnni") {
        // Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 on five column counts and five row counts.
        assert_eq!(compared, 5 * 5 * (1 + 3 + 4 + 5 + 9));
    }
    // Counted for the x86-64 check above only.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = compared;
}

/// A token's decode products do not depend on what else is in its batch: each op rounds its
/// activations to int8, so a last-bit difference between a sequence decoded alone (one
/// token: the several-row kernel) and in a batch (the four-token kernel, or the one-row
/// kernel per token) can move an element a whole step, and a few layers make that a visible
/// change of the logits (the tiny Gemma models: 0.08, where the batch tests allow 0.015). So
/// on every instruction set and format, each token of a batch of 2 to 9 gets the bits it gets
/// alone: the tiny models' rows of 256 elements, an odd block count, a last task cut short.
#[test]
fn a_tokens_products_do_not_depend_on_its_batch() {
    use super::linear::{Tiles, linear_with};
    crate::kernels::linear::start_pool(Some(3));
    let mut rng = StdRng::seed_from_u64(31);
    let mut scratch = Q8::default();
    for isa in Isa::available() {
        for ty in quantized() {
            let b = ty.block_len();
            for cols in [b, 3 * b, 256.max(b)] {
                let rows = 300;
                let w = quantized_rows(&mut rng, ty, rows, cols);
                for tokens in [2, 5, 9] {
                    let x = activations(&mut rng, tokens * cols, layout(ty).block());
                    let mut batch = vec![f32::NAN; rows * tokens];
                    let shape = [rows, cols, tokens];
                    linear_with(
                        Tiles::On,
                        isa,
                        (&mut scratch, None),
                        ty,
                        &w,
                        &x,
                        &mut batch,
                        shape,
                    );
                    for t in 0..tokens {
                        let mut alone = vec![f32::NAN; rows];
                        let xt = &x[t * cols..][..cols];
                        linear_with(
                            Tiles::On,
                            isa,
                            (&mut scratch, None),
                            ty,
                            &w,
                            xt,
                            &mut alone,
                            [rows, cols, 1],
                        );
                        for (r, a) in alone.iter().enumerate() {
                            let g = batch[t * rows + r];
                            assert_eq!(
                                g.to_bits(),
                                a.to_bits(),
                                "{} {} cols {cols} tokens {tokens} at ({t}, {r}): {g} in the \
                                 batch, {a} alone",
                                isa.name(),
                                ty.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The four-token kernels give each token the very bits the one-token kernel gives it (see
/// `a_tokens_products_do_not_depend_on_its_batch`).
#[test]
fn four_token_kernels_match_the_one_token_kernels() {
    let mut rng = StdRng::seed_from_u64(26);
    for isa in Isa::available() {
        for ty in quantized() {
            let Some(dot4) = isa.dot4(ty) else { continue };
            let (dot, layout) = isa.dot(ty).expect("quantized");
            for cols in col_counts(ty) {
                let w = random_rows(&mut rng, ty, 1, cols);
                let x = activations(&mut rng, 4 * cols, layout.block());
                let mut q8 = Q8::default();
                q8.quantize(layout, &x, cols, 4);
                let got = dot4(&w, std::array::from_fn(|k| q8.row(k)));
                for (k, g) in got.into_iter().enumerate() {
                    let want = dot(&w, q8.row(k));
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{} {} cols {cols} token {k}: {g} vs {want}",
                        isa.name(),
                        ty.name()
                    );
                }
            }
        }
    }
}

/// The batched decode step's kernels give each (row, token) the very bits the one-token
/// kernel gives it, for every batch size from 1 to 11 (their blocks of eight, four and one
/// token, and every mix), on one block, an odd count of blocks and long rows.
#[test]
fn batch_kernels_match_the_one_token_kernels() {
    let mut rng = StdRng::seed_from_u64(32);
    let mut compared = 0;
    for isa in Isa::available() {
        for ty in quantized() {
            let Some(batch) = isa.batch(ty) else { continue };
            let (dot, layout) = isa.dot(ty).expect("quantized");
            for cols in col_counts(ty) {
                let rows = 3;
                let w = random_rows(&mut rng, ty, rows, cols);
                let row_bytes = w.len() / rows;
                for tokens in 1..=11 {
                    let x = activations(&mut rng, tokens * cols, layout.block());
                    let mut q8 = Q8::default();
                    q8.quantize(layout, &x, cols, tokens);
                    let xs: Vec<_> = (0..tokens).map(|t| q8.row(t)).collect();
                    let mut got = vec![f32::NAN; rows * tokens];
                    batch(&w, row_bytes, &xs, &mut got);
                    for r in 0..rows {
                        for (t, &x) in xs.iter().enumerate() {
                            let (g, want) = (
                                got[r * tokens + t],
                                dot(&w[r * row_bytes..][..row_bytes], x),
                            );
                            assert_eq!(
                                g.to_bits(),
                                want.to_bits(),
                                "{} {} cols {cols} tokens {tokens} ({r}, {t}): {g} vs {want}",
                                isa.name(),
                                ty.name()
                            );
                        }
                    }
                    compared += 1;
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if Isa::available().iter().any(|i| i.name() == "avx512vnni") {
        // Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 on three column counts and eleven batch sizes.
        assert_eq!(compared, 5 * 3 * 11);
    }
    // Counted for the x86-64 check above only.
    #[cfg(not(target_arch = "x86_64"))]
    let _ = compared;
}

/// The prefill tiles give each (row, token) what the scalar kernel gives it, on every format
/// with a tile kernel: tiles cut short (rows no multiple of 16), token counts and ranges off
/// the kernels' blocks of four or eight.
#[test]
fn prefill_tiles_match_the_scalar_kernel() {
    let mut rng = StdRng::seed_from_u64(28);
    let mut tile = Tile::default();
    for isa in Isa::available() {
        for ty in quantized() {
            let Some((kernel, format)) = isa.tile(ty) else {
                continue;
            };
            let (scalar, layout) = Isa::Scalar.dot(ty).expect("quantized");
            for cols in col_counts(ty) {
                for (rows, tokens) in [(1, 1), (5, 3), (16, 8), (21, 13)] {
                    let w = random_rows(&mut rng, ty, rows, cols);
                    let x = activations(&mut rng, tokens * cols, layout.block());
                    let mut q8 = Q8::default();
                    q8.quantize(layout, &x, cols, tokens);
                    let row_bytes = ty.row_bytes(cols).expect("whole blocks");
                    let (mut d, mut s) = (Vec::new(), Vec::new());
                    let acts = Acts::new(&q8, format.sub, tokens, &mut d, &mut s);
                    let first = tokens / 3;
                    let mut out = vec![[f32::NAN; TILE]; tokens - first];
                    let mut deq = vec![0f32; cols];
                    for r0 in (0..rows).step_by(TILE) {
                        let r1 = (r0 + TILE).min(rows);
                        isa.fill_tile(&mut tile, format, &w, row_bytes, r0..r1);
                        kernel(&tile, &acts, first..tokens, &mut out);
                        for r in r0..r1 {
                            let wr = &w[r * row_bytes..][..row_bytes];
                            dequantize_row(ty, wr, &mut deq);
                            for t in first..tokens {
                                let xt = &x[t * cols..][..cols];
                                let scale = magnitude(&deq, xt) * 1.5 + 1e-3;
                                let want = scalar(wr, q8.row(t));
                                let got = out[t - first][r - r0];
                                assert!(
                                    f64::from((got - want).abs()) <= 1e-5 * scale,
                                    "{} {} cols {cols} rows {rows} tokens {tokens} at \
                                     ({t}, {r}): {got} vs scalar {want}",
                                    isa.name(),
                                    ty.name()
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The run-time check (what the browser's wasm build runs in headless Chromium) compares
/// every SIMD kernel this processor has, and passes on the kernels as they are.
#[test]
fn the_kernel_check_compares_every_simd_kernel() {
    let check = super::check_kernels().expect("every kernel matches the reference");
    let simd: Vec<&str> = Isa::available()
        .into_iter()
        .filter(|&i| i != Isa::Scalar)
        .map(Isa::name)
        .collect();
    assert_eq!(check.isas, simd);
    // Seven formats with SIMD kernels, three shapes each, at least.
    assert!(check.comparisons >= 21 * simd.len(), "{check:?}");
}

/// On aarch64 NEON is always compared, and the dot-product kernels exactly where the
/// processor has the extension (under qemu: its default CPU has it, a Cortex-A53 does not);
/// the best of them is what runs.
#[cfg(target_arch = "aarch64")]
#[test]
fn aarch64_runs_neon_and_dotprod_where_present() {
    let dotprod = std::arch::is_aarch64_feature_detected!("dotprod");
    let names: Vec<&str> = Isa::available().into_iter().map(Isa::name).collect();
    eprintln!("aarch64 dotprod: {dotprod}, instruction sets: {names:?}");
    let mut want = vec!["scalar", "neon"];
    if dotprod {
        want.push("neon+dotprod");
    }
    assert_eq!(names, want);
    assert_eq!(
        Isa::detect(),
        if dotprod { Isa::NeonDot } else { Isa::Neon }
    );
    for ty in quantized() {
        let dot = Isa::detect().dot(ty).expect("quantized").0;
        let scalar = Isa::Scalar.dot(ty).expect("quantized").0;
        let simd = matches!(
            ty,
            GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q8_0
                | GgmlType::Q4_K
                | GgmlType::Q6_K
        );
        // The formats with a NEON kernel do not run the scalar one.
        assert_eq!(
            dot as usize == scalar as usize,
            !simd,
            "{} runs the {} kernel",
            ty.name(),
            if simd { "scalar" } else { "NEON" }
        );
    }
}

/// The inlined f16 conversion the kernels use gives `half`'s value for every one of the
/// 65,536 bit patterns (NaNs as NaNs).
#[test]
fn f16_conversion_is_exact_for_every_value() {
    for h in 0..=u16::MAX {
        let want = f16::from_bits(h).to_f32();
        let got = super::dot::scalar::f16_to_f32(h);
        if want.is_nan() {
            assert!(got.is_nan(), "{h:#06x}: {got}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}: {got} vs {want}");
        }
    }
}

/// On x86-64 AVX2 and AVX-512 are compared exactly where the processor has them, and the
/// best runs: AVX-512 with VNNI where present, with its own kernels for the formats it has
/// and AVX2's for the others.
#[cfg(target_arch = "x86_64")]
#[test]
fn x86_runs_avx512_where_present() {
    use std::arch::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("f16c");
    let avx512 =
        avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni");
    let names: Vec<&str> = Isa::available().into_iter().map(Isa::name).collect();
    eprintln!("avx2: {avx2}, avx512 with vnni: {avx512}, instruction sets: {names:?}");
    let mut want = vec!["scalar"];
    if avx2 {
        want.push("avx2");
    }
    if avx512 {
        want.push("avx512vnni");
    }
    assert_eq!(names, want);
    if !avx512 {
        return;
    }
    if std::env::var_os("CAIRN_CPU_ISA").is_none() {
        assert_eq!(Isa::detect(), Isa::Avx512);
    }
    for ty in quantized() {
        let own = matches!(
            ty,
            GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q8_0
                | GgmlType::Q4_K
                | GgmlType::Q6_K
        );
        let a512 = Isa::Avx512.dot(ty).expect("quantized").0 as usize;
        let a2 = Isa::Avx2.dot(ty).expect("quantized").0 as usize;
        assert_eq!(a512 != a2, own, "{}", ty.name());
        let four = (
            Isa::Avx512.dot4(ty).map(|f| f as usize),
            Isa::Avx2.dot4(ty).map(|f| f as usize),
        );
        // Every format with a one-token kernel of its own has a four-token one.
        let own4 = own;
        assert_eq!(
            four.0.is_some() && four.0 != four.1,
            own4,
            "{} four-token",
            ty.name()
        );
    }
}

/// The whole prefill op over tiles, every mode (`CAIRN_CPU_TILES` off, the default, all),
/// against the scalar kernel plus the outliers' products on the same int8 activations, at
/// 1e-5 of `Σ|w·x|`: the shapes of the default model's Q4_K_M file (rows of 576 and 1536,
/// 192 rows, K-quant rows of 1536 in six super-blocks), a last tile cut short (37 rows),
/// prompts off the kernels' blocks of eight tokens (33, 40), massive activations in the same
/// two channels of every token (as at the down projection's input: the outliers' path runs
/// for every token) and one silent token. Each (row, token) is compared, not a bound on the
/// whole: a wrong row, token or outlier in any mode fails here.
#[test]
fn prefill_over_tiles_matches_the_scalar_kernel_on_the_models_shapes() {
    use super::linear::{Tiles, linear_with};
    crate::kernels::linear::start_pool(Some(3));
    let mut rng = StdRng::seed_from_u64(29);
    let mut scratch = Q8::default();
    let isa = Isa::detect();
    for ty in quantized() {
        let (scalar, layout) = Isa::Scalar.dot(ty).expect("quantized");
        let shapes: &[(usize, usize)] = if ty.block_len() == 32 {
            &[(37, 576), (192, 1536)]
        } else {
            &[(37, 1536), (192, 256)]
        };
        for &(rows, cols) in shapes {
            let w = quantized_rows(&mut rng, ty, rows, cols);
            let row_bytes = ty.row_bytes(cols).expect("whole blocks");
            for tokens in [33, 40] {
                let mut x: Vec<f32> = (0..tokens * cols)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                for t in 0..tokens {
                    x[t * cols + 7] = 300.0;
                    x[t * cols + cols / 2 + 3] = -150.0;
                }
                x[5 * cols..6 * cols].fill(0.0);
                let mut q8 = Q8::default();
                q8.quantize(layout, &x, cols, tokens);
                if layout == Layout::Super256 {
                    let missing: Vec<usize> = (0..tokens)
                        .filter(|&t| t != 5 && q8.row(t).outliers.is_empty())
                        .collect();
                    assert!(
                        missing.is_empty(),
                        "{} {cols} {tokens}: {missing:?}",
                        ty.name()
                    );
                }
                let mut deq = vec![0f32; cols];
                for mode in [Tiles::Off, Tiles::On, Tiles::All] {
                    let mut y = vec![f32::NAN; rows * tokens];
                    linear_with(
                        mode,
                        isa,
                        (&mut scratch, None),
                        ty,
                        &w,
                        &x,
                        &mut y,
                        [rows, cols, tokens],
                    );
                    for r in 0..rows {
                        let wr = &w[r * row_bytes..][..row_bytes];
                        dequantize_row(ty, wr, &mut deq);
                        for t in 0..tokens {
                            let xt = q8.row(t);
                            let want = scalar(wr, xt) + outlier_products(ty, wr, xt);
                            let got = y[t * rows + r];
                            let scale = magnitude(&deq, &x[t * cols..][..cols]) + 1e-3;
                            assert!(
                                f64::from((got - want).abs()) <= 1e-5 * scale,
                                "{} {} rows {rows} cols {cols} tokens {tokens} at ({t}, {r}): \
                                 {got} vs scalar {want}",
                                isa.name(),
                                ty.name()
                            );
                        }
                    }
                }
            }
        }
    }
}

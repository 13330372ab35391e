//! Quantizers for model conversion (`cairn quantize`): the K-quants search their sub-block
//! scales the way llama.cpp's reference quantizers do (a weighted least-squares fit of scale
//! and minimum over a few candidate step sizes for Q4_K and Q5_K, a scan of scales around
//! the largest element for Q6_K), which lowers the error well below the plain min/max rule of
//! [`super::quantize_row`]. The 32-element formats already follow ggml's reference rules and
//! are used as they are. Output bytes are the GGUF layouts the decoders in this module read;
//! they need not equal llama.cpp's bit for bit.

use half::f16;

use super::GgmlType;
use super::kquants::QK_K;

/// Quantizes `x` (a whole number of blocks) to `ty` with the best quantizer Cairn has for it.
pub fn quantize_row_best(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ty.row_bytes(x.len()).unwrap_or(0));
    match ty {
        GgmlType::Q4_K => x
            .chunks(QK_K)
            .for_each(|b| quantize_k4_block(b, false, &mut out)),
        GgmlType::Q5_K => x
            .chunks(QK_K)
            .for_each(|b| quantize_k4_block(b, true, &mut out)),
        GgmlType::Q6_K => x
            .chunks(QK_K)
            .for_each(|b| quantize_q6_k_block(b, &mut out)),
        _ => return super::quantize_row(ty, x),
    }
    out
}

/// Round half to even, as ggml's `nearest_int` does.
fn nearest(v: f32) -> i32 {
    v.round_ties_even() as i32
}

/// A fit of `x ≈ scale · L - min` with `L` in `0..=nmax`, weighted by `w`: starts from the
/// min/max rule, then tries `nstep + 1` step sizes `(max - min) / (nmax + rmin + rdelta · i)`,
/// refitting scale and minimum by weighted least squares for each rounding, and keeps the
/// one of least weighted squared error. Returns (scale, min) with min >= 0.
fn fit_scale_min(
    x: &[f32],
    w: &[f32],
    nmax: i32,
    (rmin, rdelta, nstep): (f32, f32, usize),
    l_out: &mut [u8],
) -> (f32, f32) {
    let mut min = x.iter().copied().fold(f32::INFINITY, f32::min).min(0.0);
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max <= min {
        l_out.iter_mut().for_each(|l| *l = 0);
        return (0.0, -min);
    }
    let sum_w: f32 = w.iter().sum();
    let sum_x: f32 = w.iter().zip(x).map(|(w, x)| w * x).sum();
    let quant = |iscale: f32, min: f32, v: f32| nearest(iscale * (v - min)).clamp(0, nmax) as u8;
    let error = |scale: f32, min: f32, l: &[u8]| -> f32 {
        x.iter()
            .zip(w)
            .zip(l)
            .map(|((x, w), l)| {
                let d = scale * f32::from(*l) + min - x;
                w * d * d
            })
            .sum()
    };
    let iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    for (l, v) in l_out.iter_mut().zip(x) {
        *l = quant(iscale, min, *v);
    }
    let mut best = error(scale, min, l_out);
    let mut laux = vec![0u8; x.len()];
    let lo = min;
    for step in 0..=nstep {
        let iscale = (rmin + rdelta * step as f32 + nmax as f32) / (max - lo);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((l, v), wi) in laux.iter_mut().zip(x).zip(w) {
            *l = quant(iscale, lo, *v);
            let lf = f32::from(*l);
            sum_l += wi * lf;
            sum_l2 += wi * lf * lf;
            sum_xl += wi * lf * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det <= 0.0 {
            continue;
        }
        let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
        let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if this_min > 0.0 {
            this_min = 0.0;
            this_scale = sum_xl / sum_l2;
        }
        let e = error(this_scale, this_min, &laux);
        if e < best {
            l_out.copy_from_slice(&laux);
            best = e;
            scale = this_scale;
            min = this_min;
        }
    }
    (scale, -min)
}

/// One Q4_K (`five` false) or Q5_K super-block.
fn quantize_k4_block(x: &[f32], five: bool, out: &mut Vec<u8>) {
    let (nmax, search) = if five {
        (31, (-0.5, 0.1, 15))
    } else {
        (15, (-1.0, 0.1, 20))
    };
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut l = [0u8; QK_K];
    for (j, (sub, lj)) in x.chunks_exact(32).zip(l.chunks_exact_mut(32)).enumerate() {
        // Weights favour large elements over the sub-block's RMS, as llama.cpp's do.
        let rms = (sub.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        let w: Vec<f32> = sub.iter().map(|v| rms + v.abs()).collect();
        (scales[j], mins[j]) = fit_scale_min(sub, &w, nmax, search, lj);
    }
    let max_scale = scales.iter().copied().fold(0f32, f32::max);
    let max_min = mins.iter().copied().fold(0f32, f32::max);
    let level = |v: f32, max: f32| {
        if max > 0.0 {
            nearest(63.0 / max * v).clamp(0, 63) as u8
        } else {
            0
        }
    };
    let sc: [u8; 8] = std::array::from_fn(|j| level(scales[j], max_scale));
    let m: [u8; 8] = std::array::from_fn(|j| level(mins[j], max_min));
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    // Requantize against the scales as stored, so rounding of d, dmin and the 6-bit levels
    // is absorbed by the quants.
    for (j, (sub, lj)) in x.chunks_exact(32).zip(l.chunks_exact_mut(32)).enumerate() {
        let step = d.to_f32() * f32::from(sc[j]);
        if step == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * f32::from(m[j]);
        for (q, v) in lj.iter_mut().zip(sub) {
            *q = nearest((v + dm) / step).clamp(0, nmax) as u8;
        }
    }
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
    out.extend_from_slice(&pack_scales_mins(&sc, &m));
    let (mut qh, mut qs) = ([0u8; 32], [0u8; 128]);
    for (i, q) in l.iter().enumerate() {
        let (c, h, e) = (i / 64, (i / 32) % 2, i % 32);
        qs[32 * c + e] |= (q & 0x0f) << (4 * h);
        qh[e] |= (q >> 4) << (2 * c + h);
    }
    if five {
        out.extend_from_slice(&qh);
    }
    out.extend_from_slice(&qs);
}

/// Eight 6-bit scales and minimums in the 12 bytes Q4_K and Q5_K use: the first four whole
/// in bytes 0..8, the last four as nibbles in bytes 8..12 with their top two bits in the
/// spare top bits of bytes 0..8.
fn pack_scales_mins(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
    s
}

/// A symmetric fit `x ≈ scale · L` with `L` in `-nmax..nmax`, weighted by x² (so large
/// elements are kept closest): tries step sizes around the largest element's and keeps the
/// least-squares scale of the best rounding.
fn fit_symmetric(x: &[f32], nmax: i32) -> f32 {
    let max = x
        .iter()
        .copied()
        .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    if max.abs() < 1e-15 {
        return 0.0;
    }
    let fit = |iscale: f32| {
        let (mut sum_lx, mut sum_l2) = (0f32, 0f32);
        for v in x {
            let l = nearest(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sum_lx += w * v * l;
            sum_l2 += w * l * l;
        }
        (sum_lx, sum_l2)
    };
    let (sum_lx, sum_l2) = fit(-(nmax as f32) / max);
    let mut scale = if sum_l2 > 0.0 { sum_lx / sum_l2 } else { 0.0 };
    let mut best = scale * sum_lx;
    for is in (-9..=9).filter(|i| *i != 0) {
        let (sum_lx, sum_l2) = fit(-(nmax as f32 + 0.1 * is as f32) / max);
        if sum_l2 > 0.0 && sum_lx * sum_lx > best * sum_l2 {
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
        }
    }
    scale
}

/// One Q6_K super-block: sixteen sub-blocks of 16 with signed 8-bit scales.
fn quantize_q6_k_block(x: &[f32], out: &mut Vec<u8>) {
    let scales: [f32; 16] = std::array::from_fn(|j| fit_symmetric(&x[16 * j..16 * j + 16], 32));
    let max = scales
        .iter()
        .copied()
        .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    if max.abs() < 1e-15 {
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend_from_slice(&[0u8; 16]);
        out.extend_from_slice(&f16::from_f32(0.0).to_le_bytes());
        return;
    }
    let iscale = -128.0 / max;
    let d = f16::from_f32(1.0 / iscale);
    let sc: [i8; 16] = std::array::from_fn(|j| nearest(iscale * scales[j]).clamp(-128, 127) as i8);
    for (i, v) in x.iter().enumerate() {
        let step = d.to_f32() * f32::from(sc[i / 16]);
        let q = if step == 0.0 {
            32
        } else {
            (nearest(v / step).clamp(-32, 31) + 32) as u8
        };
        let (n, k, l) = (i / 128, (i / 32) % 4, i % 32);
        ql[64 * n + 32 * (k % 2) + l] |= (q & 0x0f) << (4 * (k / 2));
        qh[32 * n + l] |= (q >> 4) << (2 * k);
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|s| *s as u8));
    out.extend_from_slice(&d.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_row, quantize_row};

    /// Weight-like data: mostly small values with a few outliers, and an offset sub-block.
    fn sample(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                let base = u * 0.1 + if (i / 32) % 7 == 3 { 0.05 } else { 0.0 };
                if s.is_multiple_of(61) {
                    base * 12.0
                } else {
                    base
                }
            })
            .collect()
    }

    fn rms_error(ty: GgmlType, x: &[f32], bytes: &[u8]) -> f32 {
        assert_eq!(bytes.len(), ty.row_bytes(x.len()).unwrap(), "{ty:?} size");
        let mut y = vec![0f32; x.len()];
        dequantize_row(ty, bytes, &mut y);
        (x.iter()
            .zip(&y)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            / x.len() as f32)
            .sqrt()
    }

    /// decode(quantize(x)) against x for each format, relative to the data's RMS: at most
    /// 3.5 · 2^-bits (uniform rounding on this outlier-heavy data gives about 2.7 · 2^-bits
    /// for Q4_0), so a broken packing or scale, which gives errors near 1, fails by far.
    #[test]
    fn round_trip_error_per_format_is_within_its_bound() {
        let x = sample(16 * QK_K, 7);
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
        let errors: Vec<(GgmlType, f32, f32)> = [
            (GgmlType::Q4_0, 4),
            (GgmlType::Q4_1, 4),
            (GgmlType::Q5_0, 5),
            (GgmlType::Q5_1, 5),
            (GgmlType::Q8_0, 8),
            (GgmlType::Q4_K, 4),
            (GgmlType::Q5_K, 5),
            (GgmlType::Q6_K, 6),
        ]
        .into_iter()
        .map(|(ty, bits)| {
            let e = rms_error(ty, &x, &quantize_row_best(ty, &x)) / rms;
            (ty, e, 3.5 / (1u32 << bits) as f32)
        })
        .collect();
        eprintln!("relative RMS errors: {errors:?}");
        for (ty, e, bound) in errors {
            assert!(e <= bound, "{ty:?}: relative RMS error {e} over {bound}");
        }
    }

    /// The searched K-quants beat the plain min/max quantizer on the same data (Q6_K's
    /// symmetric rule is close to its search already: there, no worse).
    #[test]
    fn searched_k_quants_beat_min_max() {
        let x = sample(32 * QK_K, 3);
        for (ty, ratio) in [
            (GgmlType::Q4_K, 0.95),
            (GgmlType::Q5_K, 0.95),
            (GgmlType::Q6_K, 1.0),
        ] {
            let searched = rms_error(ty, &x, &quantize_row_best(ty, &x));
            let plain = rms_error(ty, &x, &quantize_row(ty, &x));
            eprintln!("{ty:?}: searched {searched}, min/max {plain}");
            assert!(
                searched <= ratio * plain,
                "{ty:?}: searched {searched} vs min/max {plain}"
            );
        }
    }

    #[test]
    fn zeros_constants_and_negatives_round_trip() {
        for x in [
            vec![0f32; QK_K],
            vec![0.25f32; QK_K],
            vec![-3.5f32; QK_K],
            (0..QK_K).map(|i| -(i as f32) / 100.0).collect(),
        ] {
            for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                let e = rms_error(ty, &x, &quantize_row_best(ty, &x));
                assert!(e <= 0.07 * amax + 1e-6, "{ty:?} on {:?}..: {e}", &x[..2]);
            }
        }
    }

    #[test]
    fn scale_packing_is_what_the_decoder_reads() {
        let sc = [1, 20, 33, 63, 17, 40, 63, 5];
        let m = [0, 63, 8, 31, 60, 2, 47, 16];
        let s = pack_scales_mins(&sc, &m);
        for j in 0..8 {
            assert_eq!(super::super::kquants::scale_min_k4(j, &s), (sc[j], m[j]));
        }
    }
}

//! wasm simd128 dot products (the browser's CPU fallback). wasm has no run-time feature
//! detection: a module with SIMD instructions fails to load where the engine lacks them, so
//! these exist only in builds made with `-C target-feature=+simd128` (the browser worker's
//! package is: native/build.rs), and every browser with WebAssembly SIMD (all current
//! ones) runs that build.
//!
//! The shape follows the AVX2 kernels at half the width: a block's quants as signed bytes
//! in two 16-lane vectors, widened to i16 and multiplied in pairs into i32 lanes
//! (`i32x4.dot_i16x8_s`), one float multiply-add per block.

use std::arch::wasm32::*;

use super::DotFn;
use crate::backend::cpu::q8::{GROUP, Q8Row, QK, QK_K};
use crate::quant::GgmlType;
use crate::quant::kquants::scale_min_k4;

/// The simd128 kernel for `ty`, or `None` where there is none (the scalar one runs).
pub(super) fn dot(ty: GgmlType) -> Option<DotFn> {
    Some(match ty {
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q6_K => q6_k,
        _ => return None,
    })
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    super::scalar::f16_at(b, at)
}

fn load(b: &[u8]) -> v128 {
    assert!(b.len() >= 16);
    // SAFETY: 16 readable bytes (checked above); v128_load has no alignment requirement.
    unsafe { v128_load(b.as_ptr().cast()) }
}

fn load_i8(b: &[i8]) -> v128 {
    assert!(b.len() >= 16);
    // SAFETY: as `load`.
    unsafe { v128_load(b.as_ptr().cast()) }
}

/// Sixteen signed bytes times sixteen signed bytes, summed in fours into i32 lanes.
fn dot16(w: v128, x: v128) -> v128 {
    i32x4_add(
        i32x4_dot_i16x8(i16x8_extend_low_i8x16(w), i16x8_extend_low_i8x16(x)),
        i32x4_dot_i16x8(i16x8_extend_high_i8x16(w), i16x8_extend_high_i8x16(x)),
    )
}

fn hsum_f32(v: v128) -> f32 {
    f32x4_extract_lane::<0>(v)
        + f32x4_extract_lane::<1>(v)
        + f32x4_extract_lane::<2>(v)
        + f32x4_extract_lane::<3>(v)
}

/// 16 bytes of nibbles: (low nibbles, high nibbles), each 16 lanes of 0..16.
fn nibbles(b: &[u8]) -> (v128, v128) {
    let v = load(b);
    (v128_and(v, u8x16_splat(0x0f)), u8x16_shr(v, 4))
}

/// The 32 bits at `b[..4]` as two 16-lane vectors, 0x10 where the bit is set.
fn fifth_bits(b: &[u8]) -> (v128, v128) {
    let spread = |half: u16| {
        // Bytes [lo x8, hi x8] of `half`, each tested against its own bit.
        let v = u8x16_swizzle(
            u16x8_splat(half),
            u8x16(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        );
        let bit = u8x16(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
        v128_and(i8x16_eq(v128_and(v, bit), bit), u8x16_splat(0x10))
    };
    (
        spread(u16::from_le_bytes([b[0], b[1]])),
        spread(u16::from_le_bytes([b[2], b[3]])),
    )
}

/// The 32-element formats: `quants(block)` gives its 32 quants as signed bytes (elements
/// 0..16, 16..32); `(step, min)` come from the block's first bytes.
fn blocks32(
    w: &[u8],
    x: Q8Row<'_>,
    bytes: usize,
    has_min: bool,
    quants: impl Fn(&[u8]) -> (v128, v128),
) -> f32 {
    let mut acc = f32x4_splat(0.0);
    let mut mins = 0f32;
    for (((b, xq), &dx), &sx) in w
        .chunks_exact(bytes)
        .zip(x.qs.chunks_exact(QK))
        .zip(x.d)
        .zip(x.sum.iter().chain(std::iter::repeat(&0.0)))
    {
        let (q0, q1) = quants(b);
        let p = i32x4_add(dot16(q0, load_i8(xq)), dot16(q1, load_i8(&xq[16..])));
        acc = f32x4_add(
            acc,
            f32x4_mul(f32x4_splat(f16_at(b, 0) * dx), f32x4_convert_i32x4(p)),
        );
        if has_min {
            mins += f16_at(b, 2) * sx;
        }
    }
    hsum_f32(acc) + mins
}

fn q4_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 18, false, |b| {
        let (lo, hi) = nibbles(&b[2..18]);
        let eight = i8x16_splat(8);
        (i8x16_sub(lo, eight), i8x16_sub(hi, eight))
    })
}

fn q4_1(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 20, true, |b| nibbles(&b[4..20]))
}

fn q5_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 22, false, |b| {
        let (h0, h1) = fifth_bits(&b[2..6]);
        let (lo, hi) = nibbles(&b[6..22]);
        let sixteen = i8x16_splat(16);
        (
            i8x16_sub(v128_or(lo, h0), sixteen),
            i8x16_sub(v128_or(hi, h1), sixteen),
        )
    })
}

fn q5_1(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 24, true, |b| {
        let (h0, h1) = fifth_bits(&b[4..8]);
        let (lo, hi) = nibbles(&b[8..24]);
        (v128_or(lo, h0), v128_or(hi, h1))
    })
}

fn q8_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 34, false, |b| (load(&b[2..18]), load(&b[18..34])))
}

fn q4_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    let mut acc = f32x4_splat(0.0);
    let mut mins = 0f32;
    for (((b, xq), &dx), bs) in w
        .chunks_exact(144)
        .zip(x.qs.chunks_exact(QK_K))
        .zip(x.d)
        .zip(x.bsums.chunks_exact(QK_K / GROUP))
    {
        let mut sumi = i32x4_splat(0);
        let mut msum = 0i32;
        for c in 0..4 {
            let (sc_lo, m_lo) = scale_min_k4(2 * c, &b[4..16]);
            let (sc_hi, m_hi) = scale_min_k4(2 * c + 1, &b[4..16]);
            msum += i32::from(m_lo) * (i32::from(bs[4 * c]) + i32::from(bs[4 * c + 1]));
            msum += i32::from(m_hi) * (i32::from(bs[4 * c + 2]) + i32::from(bs[4 * c + 3]));
            let (lo0, hi0) = nibbles(&b[16 + 32 * c..]);
            let (lo1, hi1) = nibbles(&b[16 + 32 * c + 16..]);
            let x = &xq[64 * c..];
            let plo = i32x4_add(dot16(lo0, load_i8(x)), dot16(lo1, load_i8(&x[16..])));
            let phi = i32x4_add(dot16(hi0, load_i8(&x[32..])), dot16(hi1, load_i8(&x[48..])));
            sumi = i32x4_add(sumi, i32x4_mul(plo, i32x4_splat(i32::from(sc_lo))));
            sumi = i32x4_add(sumi, i32x4_mul(phi, i32x4_splat(i32::from(sc_hi))));
        }
        let d = f16_at(b, 0) * dx;
        acc = f32x4_add(acc, f32x4_mul(f32x4_splat(d), f32x4_convert_i32x4(sumi)));
        mins += f16_at(b, 2) * dx * msum as f32;
    }
    hsum_f32(acc) - mins
}

fn q6_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    let mut acc = f32x4_splat(0.0);
    let mut bias = 0f32;
    let (m4, m2) = (u8x16_splat(0x0f), u8x16_splat(0x03));
    for (((b, xq), &dx), bs) in w
        .chunks_exact(210)
        .zip(x.qs.chunks_exact(QK_K))
        .zip(x.d)
        .zip(x.bsums.chunks_exact(QK_K / GROUP))
    {
        let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
        let sc: [i32; 16] = std::array::from_fn(|g| i32::from(sc[g] as i8));
        // The quants are stored as q + 32 in 0..64; the 32 comes off through the group sums.
        let offset: i32 = sc.iter().zip(bs).map(|(&s, &m)| s * i32::from(m)).sum();
        let mut sumi = i32x4_splat(0);
        for n in 0..2 {
            for half in 0..2 {
                let l0 = load(&ql[64 * n + 16 * half..]);
                let l1 = load(&ql[64 * n + 32 + 16 * half..]);
                let h = load(&qh[32 * n + 16 * half..]);
                let high = |shift: u32| u8x16_shl(v128_and(u8x16_shr(h, shift), m2), 4);
                let q = [
                    v128_or(v128_and(l0, m4), high(0)),
                    v128_or(v128_and(l1, m4), high(2)),
                    v128_or(u8x16_shr(l0, 4), high(4)),
                    v128_or(u8x16_shr(l1, 4), high(6)),
                ];
                for (k, q) in q.into_iter().enumerate() {
                    let at = 128 * n + 32 * k + 16 * half;
                    let p = dot16(q, load_i8(&xq[at..]));
                    sumi = i32x4_add(sumi, i32x4_mul(p, i32x4_splat(sc[at / GROUP])));
                }
            }
        }
        let d = f16_at(b, 208) * dx;
        acc = f32x4_add(acc, f32x4_mul(f32x4_splat(d), f32x4_convert_i32x4(sumi)));
        bias += d * (32 * offset) as f32;
    }
    hsum_f32(acc) - bias
}

//! wasm SIMD dot products (the browser's CPU fallback). wasm has no run-time feature
//! detection: a module with SIMD instructions fails to load where the engine lacks them, so
//! these exist only in builds made with `-C target-feature=+simd128` (the browser worker's
//! packages are: native/build.rs), and every browser with WebAssembly SIMD (all current
//! ones) runs that build.
//!
//! Built with `+relaxed-simd` as well (the threaded package), the products of unsigned
//! quants (every format but Q8_0: Q4_0 and Q5_0 are taken as their unsigned codes, the
//! offset coming off through the activations' block sums as Q4_1's minimum does) use
//! relaxed SIMD's i8 × i7 dot products: `i16x8.relaxed_dot_i8x16_i7x16_s` (x86's
//! `pmaddubsw`) for the 32-element blocks, both halves summed in i16 and widened once,
//! `i32x4.relaxed_dot_i8x16_i7x16_add_s` for the K-quants, against five to seven
//! instructions per sixteen products with plain simd128 (widen to i16,
//! `i32x4.dot_i16x8_s`). Its result is implementation-defined only where the
//! second operand has its top bit set, which quants of at most 6 bits never have, so both
//! builds compute the same integers.
//!
//! Each block's integer sum is reduced to one exact i32 before it meets a float, and the
//! float part is the same code in both builds, so the two packages give bit-identical
//! results (the browser test holds the threaded package to the single-thread one). The
//! 32-element formats handle four blocks at a time: their four sums in the four lanes of a
//! vector, the f16 scales converted four at once, one multiply-add for the four; per block
//! that bookkeeping had cost as much as the products. The four-token kernel (prefill)
//! unpacks each weight block once and keeps the four tokens in the four lanes.

use std::arch::wasm32::*;

use super::{Dot4Fn, DotFn};
use crate::backend::cpu::q8::{GROUP, Q8Row, QK, QK_K};
use crate::quant::GgmlType;
use crate::quant::kquants::scale_min_k4;

/// The kernel for `ty`, or `None` where there is none (the scalar one runs).
pub(super) fn dot(ty: GgmlType) -> Option<DotFn> {
    Some(match ty {
        GgmlType::Q4_0 => blocks32::<Q4_0>,
        GgmlType::Q4_1 => blocks32::<Q4_1>,
        GgmlType::Q5_0 => blocks32::<Q5_0>,
        GgmlType::Q5_1 => blocks32::<Q5_1>,
        GgmlType::Q8_0 => blocks32::<Q8_0>,
        GgmlType::Q4_K => q4_k,
        GgmlType::Q6_K => q6_k,
        _ => return None,
    })
}

/// The four-token kernel for `ty` (the 32-element formats).
pub(super) fn dot4(ty: GgmlType) -> Option<Dot4Fn> {
    Some(match ty {
        GgmlType::Q4_0 => blocks32_4::<Q4_0>,
        GgmlType::Q4_1 => blocks32_4::<Q4_1>,
        GgmlType::Q5_0 => blocks32_4::<Q5_0>,
        GgmlType::Q5_1 => blocks32_4::<Q5_1>,
        GgmlType::Q8_0 => blocks32_4::<Q8_0>,
        _ => return None,
    })
}

/// Whether this build has relaxed SIMD's integer dot product (the name `Isa` reports).
pub(super) const RELAXED: bool = cfg!(target_feature = "relaxed-simd");

fn f16_at(b: &[u8], at: usize) -> f32 {
    super::scalar::f16_at(b, at)
}

fn load(b: &[u8]) -> v128 {
    assert!(b.len() >= 16);
    // SAFETY: 16 readable bytes (checked above); v128_load has no alignment requirement.
    unsafe { v128_load(b.as_ptr().cast()) }
}

#[cfg(target_feature = "relaxed-simd")]
fn load_i8(b: &[i8]) -> v128 {
    assert!(b.len() >= 16);
    // SAFETY: as `load`.
    unsafe { v128_load(b.as_ptr().cast()) }
}

fn load_f32(b: &[f32]) -> v128 {
    assert!(b.len() >= 4);
    // SAFETY: 4 readable f32 (checked above), no alignment requirement.
    unsafe { v128_load(b.as_ptr().cast()) }
}

/// Eight signed bytes widened to i16 lanes.
fn load_i8x8(b: &[i8]) -> v128 {
    assert!(b.len() >= 8);
    // SAFETY: 8 readable bytes (checked above), no alignment requirement.
    unsafe { i16x8_load_extend_i8x8(b.as_ptr()) }
}

/// Sixteen signed bytes `w` times `x[..16]`, summed in fours into i32 lanes, added to
/// `acc`: the quants need not be unsigned.
fn sdot16(w: v128, x: &[i8], acc: v128) -> v128 {
    let p = i32x4_add(
        i32x4_dot_i16x8(i16x8_extend_low_i8x16(w), load_i8x8(x)),
        i32x4_dot_i16x8(i16x8_extend_high_i8x16(w), load_i8x8(&x[8..])),
    );
    i32x4_add(acc, p)
}

/// As [`sdot16`] for quants `w` in 0..128.
#[cfg(target_feature = "relaxed-simd")]
fn udot16(w: v128, x: &[i8], acc: v128) -> v128 {
    i32x4_relaxed_dot_i8x16_i7x16_add(load_i8(x), w, acc)
}

#[cfg(not(target_feature = "relaxed-simd"))]
fn udot16(w: v128, x: &[i8], acc: v128) -> v128 {
    sdot16(w, x, acc)
}

/// A 32-element block's quants `(q0, q1)` (elements 0..16, 16..32) against `x[..32]`.
/// `unsigned`: the quants are in 0..32 (a constant where it is inlined).
#[inline(always)]
fn dot32(unsigned: bool, (q0, q1): (v128, v128), x: &[i8]) -> v128 {
    let x = &x[..QK];
    #[cfg(target_feature = "relaxed-simd")]
    if unsigned {
        // Pairs of products summed into i16 lanes, the two halves added there (each lane
        // at most 4 · 128 · 31 in magnitude, within i16), widened once.
        let h = i16x8_add(
            i16x8_relaxed_dot_i8x16_i7x16(load_i8(x), q0),
            i16x8_relaxed_dot_i8x16_i7x16(load_i8(&x[16..]), q1),
        );
        return i32x4_extadd_pairwise_i16x8(h);
    }
    let _ = unsigned;
    sdot16(q1, &x[16..], sdot16(q0, x, i32x4_splat(0)))
}

fn hsum_i32(v: v128) -> i32 {
    i32x4_extract_lane::<0>(v)
        + i32x4_extract_lane::<1>(v)
        + i32x4_extract_lane::<2>(v)
        + i32x4_extract_lane::<3>(v)
}

fn hsum_f32(v: v128) -> f32 {
    f32x4_extract_lane::<0>(v)
        + f32x4_extract_lane::<1>(v)
        + f32x4_extract_lane::<2>(v)
        + f32x4_extract_lane::<3>(v)
}

/// Four vectors' lane sums, `[Σp0, Σp1, Σp2, Σp3]` (exact integers).
fn hsum4(p: [v128; 4]) -> v128 {
    let a = i32x4_add(
        i32x4_shuffle::<0, 4, 1, 5>(p[0], p[1]),
        i32x4_shuffle::<2, 6, 3, 7>(p[0], p[1]),
    );
    let b = i32x4_add(
        i32x4_shuffle::<0, 4, 1, 5>(p[2], p[3]),
        i32x4_shuffle::<2, 6, 3, 7>(p[2], p[3]),
    );
    i32x4_add(
        i32x4_shuffle::<0, 1, 4, 5>(a, b),
        i32x4_shuffle::<2, 3, 6, 7>(a, b),
    )
}

/// Four f16 (the low 16 bits of each u32 lane) to f32, as `scalar::f16_to_f32` does it.
pub(super) fn f16x4(h: v128) -> v128 {
    let sign = i32x4_shl(v128_and(h, u32x4_splat(0x8000)), 16);
    let magnitude = i32x4_shl(v128_and(h, u32x4_splat(0x7fff)), 13);
    let normal = f32x4_mul(magnitude, f32x4_splat(f32::from_bits(0x7780_0000)));
    let special = v128_or(magnitude, u32x4_splat(0x7f80_0000));
    let is_special = u32x4_ge(magnitude, u32x4_splat(0x7c00 << 13));
    v128_or(v128_bitselect(special, normal, is_special), sign)
}

/// The f16 at byte `at` of four consecutive blocks of `bytes` each, from `w[0..]`.
fn f16_of_4(w: &[u8], bytes: usize, at: usize) -> v128 {
    let h = |k: usize| {
        u32::from(u16::from_le_bytes([
            w[k * bytes + at],
            w[k * bytes + at + 1],
        ]))
    };
    f16x4(u32x4(h(0), h(1), h(2), h(3)))
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

/// A 32-element format: `x = d·q + m` per block, the quants `q` as bytes.
trait Format {
    /// Bytes per block.
    const BYTES: usize;
    /// Whether the quants are in 0..128 (relaxed SIMD's dot product takes them).
    const UNSIGNED: bool;
    /// The block's 32 quants (elements 0..16, 16..32).
    fn quants(b: &[u8]) -> (v128, v128);
    /// The block's quants against `x[..32]`, as i32 lanes to sum.
    #[inline(always)]
    fn dot(b: &[u8], x: &[i8]) -> v128 {
        dot32(Self::UNSIGNED, Self::quants(b), x)
    }
    /// The minimum `m` from the step `d` (lanes of blocks) and the blocks' bytes: `None`
    /// where the format has none.
    fn min(d: v128, w: &[u8]) -> Option<v128>;
    /// As `min`, for one block.
    fn min1(d: f32, b: &[u8]) -> Option<f32>;
}

/// Sixteen bytes of nibbles against `x[..32]` without relaxed SIMD: each half of the bytes
/// widened to i16 as it loads, its low and high nibbles then already the i16 lanes that
/// `i32x4.dot_i16x8_s` takes (elements 0..8 and 16..24, 8..16 and 24..32), the activations
/// widened as they load: fewer instructions than widening the unpacked bytes.
#[cfg(not(target_feature = "relaxed-simd"))]
#[inline(always)]
fn nibbles_dot(b: &[u8], x: &[i8]) -> v128 {
    let (b, x) = (&b[..16], &x[..QK]);
    // SAFETY: 16 readable bytes (sliced above), no alignment requirement.
    let (w0, w1) = unsafe {
        (
            u16x8_load_extend_u8x8(b.as_ptr()),
            u16x8_load_extend_u8x8(b[8..].as_ptr()),
        )
    };
    let m = u16x8_splat(0x0f);
    let lo = i32x4_add(
        i32x4_dot_i16x8(v128_and(w0, m), load_i8x8(x)),
        i32x4_dot_i16x8(v128_and(w1, m), load_i8x8(&x[8..])),
    );
    let hi = i32x4_add(
        i32x4_dot_i16x8(u16x8_shr(w0, 4), load_i8x8(&x[16..])),
        i32x4_dot_i16x8(u16x8_shr(w1, 4), load_i8x8(&x[24..])),
    );
    i32x4_add(lo, hi)
}

/// Q4_0 as its unsigned codes `c = q + 8`: `d·q = d·c - 8d`.
struct Q4_0;
impl Format for Q4_0 {
    const BYTES: usize = 18;
    const UNSIGNED: bool = true;
    fn quants(b: &[u8]) -> (v128, v128) {
        nibbles(&b[2..18])
    }
    #[cfg(not(target_feature = "relaxed-simd"))]
    #[inline(always)]
    fn dot(b: &[u8], x: &[i8]) -> v128 {
        nibbles_dot(&b[2..18], x)
    }
    fn min(d: v128, _: &[u8]) -> Option<v128> {
        Some(f32x4_mul(d, f32x4_splat(-8.0)))
    }
    fn min1(d: f32, _: &[u8]) -> Option<f32> {
        Some(d * -8.0)
    }
}

struct Q4_1;
impl Format for Q4_1 {
    const BYTES: usize = 20;
    const UNSIGNED: bool = true;
    fn quants(b: &[u8]) -> (v128, v128) {
        nibbles(&b[4..20])
    }
    #[cfg(not(target_feature = "relaxed-simd"))]
    #[inline(always)]
    fn dot(b: &[u8], x: &[i8]) -> v128 {
        nibbles_dot(&b[4..20], x)
    }
    fn min(_: v128, w: &[u8]) -> Option<v128> {
        Some(f16_of_4(w, Self::BYTES, 2))
    }
    fn min1(_: f32, b: &[u8]) -> Option<f32> {
        Some(f16_at(b, 2))
    }
}

/// Q5_0 as its unsigned codes `c = q + 16`.
struct Q5_0;
impl Format for Q5_0 {
    const BYTES: usize = 22;
    const UNSIGNED: bool = true;
    fn quants(b: &[u8]) -> (v128, v128) {
        let (h0, h1) = fifth_bits(&b[2..6]);
        let (lo, hi) = nibbles(&b[6..22]);
        (v128_or(lo, h0), v128_or(hi, h1))
    }
    fn min(d: v128, _: &[u8]) -> Option<v128> {
        Some(f32x4_mul(d, f32x4_splat(-16.0)))
    }
    fn min1(d: f32, _: &[u8]) -> Option<f32> {
        Some(d * -16.0)
    }
}

struct Q5_1;
impl Format for Q5_1 {
    const BYTES: usize = 24;
    const UNSIGNED: bool = true;
    fn quants(b: &[u8]) -> (v128, v128) {
        let (h0, h1) = fifth_bits(&b[4..8]);
        let (lo, hi) = nibbles(&b[8..24]);
        (v128_or(lo, h0), v128_or(hi, h1))
    }
    fn min(_: v128, w: &[u8]) -> Option<v128> {
        Some(f16_of_4(w, Self::BYTES, 2))
    }
    fn min1(_: f32, b: &[u8]) -> Option<f32> {
        Some(f16_at(b, 2))
    }
}

struct Q8_0;
impl Format for Q8_0 {
    const BYTES: usize = 34;
    const UNSIGNED: bool = false;
    fn quants(b: &[u8]) -> (v128, v128) {
        (load(&b[2..18]), load(&b[18..34]))
    }
    fn min(_: v128, _: &[u8]) -> Option<v128> {
        None
    }
    fn min1(_: f32, _: &[u8]) -> Option<f32> {
        None
    }
}

/// One weight row of a 32-element format against one token: `Σ_b d_b·dx_b·Σq·x + m_b·sx_b`.
fn blocks32<F: Format>(w: &[u8], x: Q8Row<'_>) -> f32 {
    let n = (w.len() / F::BYTES).min(x.d.len());
    let (qs, dx, sx) = (&x.qs[..n * QK], &x.d[..n], &x.sum[..n]);
    let mut acc = f32x4_splat(0.0);
    let mut i = 0;
    while i + 4 <= n {
        let wb = &w[i * F::BYTES..][..4 * F::BYTES];
        let p: [v128; 4] =
            std::array::from_fn(|k| F::dot(&wb[k * F::BYTES..][..F::BYTES], &qs[(i + k) * QK..]));
        let d = f16_of_4(wb, F::BYTES, 0);
        let scaled = f32x4_mul(d, load_f32(&dx[i..]));
        acc = f32x4_add(acc, f32x4_mul(scaled, f32x4_convert_i32x4(hsum4(p))));
        if let Some(m) = F::min(d, wb) {
            acc = f32x4_add(acc, f32x4_mul(m, load_f32(&sx[i..])));
        }
        i += 4;
    }
    let mut tail = 0f32;
    for i in i..n {
        let b = &w[i * F::BYTES..][..F::BYTES];
        let p = hsum_i32(F::dot(b, &qs[i * QK..]));
        let d = f16_at(b, 0);
        tail += d * dx[i] * p as f32;
        if let Some(m) = F::min1(d, b) {
            tail += m * sx[i];
        }
    }
    hsum_f32(acc) + tail
}

/// One weight row against four tokens, each weight block unpacked once (and its scales
/// converted once): for each token the same arithmetic as [`blocks32`], so a token's result
/// does not depend on whether it went through this kernel or that one.
fn blocks32_4<F: Format>(w: &[u8], x: [Q8Row<'_>; 4]) -> [f32; 4] {
    let n = x
        .iter()
        .map(|x| x.d.len().min(x.sum.len()).min(x.qs.len() / QK))
        .fold(w.len() / F::BYTES, usize::min);
    let xs: [_; 4] = std::array::from_fn(|t| (&x[t].qs[..n * QK], &x[t].d[..n], &x[t].sum[..n]));
    let mut acc = [f32x4_splat(0.0); 4];
    let mut i = 0;
    while i + 4 <= n {
        let wb = &w[i * F::BYTES..][..4 * F::BYTES];
        let q: [(v128, v128); 4] =
            std::array::from_fn(|k| F::quants(&wb[k * F::BYTES..][..F::BYTES]));
        let d = f16_of_4(wb, F::BYTES, 0);
        let m = F::min(d, wb);
        for ((qs, dx, sx), acc) in xs.iter().zip(&mut acc) {
            let p: [v128; 4] =
                std::array::from_fn(|k| dot32(F::UNSIGNED, q[k], &qs[(i + k) * QK..]));
            let scaled = f32x4_mul(d, load_f32(&dx[i..]));
            *acc = f32x4_add(*acc, f32x4_mul(scaled, f32x4_convert_i32x4(hsum4(p))));
            if let Some(m) = m {
                *acc = f32x4_add(*acc, f32x4_mul(m, load_f32(&sx[i..])));
            }
        }
        i += 4;
    }
    let mut tail = [0f32; 4];
    for i in i..n {
        let b = &w[i * F::BYTES..][..F::BYTES];
        let q = F::quants(b);
        let d = f16_at(b, 0);
        let m = F::min1(d, b);
        for ((qs, dx, sx), tail) in xs.iter().zip(&mut tail) {
            let p = hsum_i32(dot32(F::UNSIGNED, q, &qs[i * QK..]));
            *tail += d * dx[i] * p as f32;
            if let Some(m) = m {
                *tail += m * sx[i];
            }
        }
    }
    std::array::from_fn(|t| hsum_f32(acc[t]) + tail[t])
}

fn q4_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    let mut acc = 0f32;
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
            let plo = udot16(lo1, &x[16..], udot16(lo0, x, i32x4_splat(0)));
            let phi = udot16(hi1, &x[48..], udot16(hi0, &x[32..], i32x4_splat(0)));
            sumi = i32x4_add(sumi, i32x4_mul(plo, i32x4_splat(i32::from(sc_lo))));
            sumi = i32x4_add(sumi, i32x4_mul(phi, i32x4_splat(i32::from(sc_hi))));
        }
        // One exact integer per super-block, so both builds' floats see the same values.
        let d = f16_at(b, 0) * dx;
        acc += d * hsum_i32(sumi) as f32;
        mins += f16_at(b, 2) * dx * msum as f32;
    }
    acc - mins
}

fn q6_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    let mut acc = 0f32;
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
                    let p = udot16(q, &xq[at..], i32x4_splat(0));
                    sumi = i32x4_add(sumi, i32x4_mul(p, i32x4_splat(sc[at / GROUP])));
                }
            }
        }
        let d = f16_at(b, 208) * dx;
        acc += d * hsum_i32(sumi) as f32;
        bias += d * (32 * offset) as f32;
    }
    acc - bias
}

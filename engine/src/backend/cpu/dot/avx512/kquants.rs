//! Q4_K and Q6_K against one token or four: one kernel generic over the token count, so a
//! token's product has the same bits whichever it runs in (a sequence alone and in a batch,
//! or a prompt's tokens four at a time and one at a time, must not differ in summation order:
//! `rows.rs` says why).
//!
//! Prompts of the K-quant files go through here, four tokens at a time: their prefill tiles
//! (`CAIRN_CPU_TILES=all`) sum in another order, and on the Q4_K_M file that order lands on
//! the wrong side of a near tie the teacher-forced test against llama.cpp calls firm
//! (docs/performance.md, "The K-quant tiles' firm miss"). These kernels give every product
//! the bits the one-token kernels before them gave (checked against them when they were
//! written, on every row and token tried), so prompts got faster without moving a logit:
//! a super-block's quants, scales and minimums are unpacked once for four tokens, the 6-bit
//! scales and minimums decoded with word operations instead of one at a time through memory,
//! and each token's scaled products, minimums and offsets summed as integers (exact in any
//! order) before the float steps, which stay the one-token kernel's, lane by lane.
//!
//! Each 64-element run of the activations multiplies one 512-bit vector of quants; lane `l`
//! sums elements `4l..4l + 4` of the run times their group's scale (bytes multiplied and
//! summed in pairs, then the pairs times the scale summed into the lane), and the run's 16
//! lanes are the float accumulator's lanes.

use std::arch::x86_64::*;

use super::{load128, load256, load512};
use crate::backend::cpu::q8::{GROUP, Q8Row, QK_K};

/// Q4_K rows `w` (whole super-blocks) against `N` tokens.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn q4_k<const N: usize>(w: &[u8], x: [Q8Row<'_>; N]) -> [f32; N] {
    let nb = w.len() / 144;
    for x in &x {
        check(x, nb);
    }
    let mut acc = [_mm512_setzero_ps(); N];
    const { assert!(N <= 4) };
    let mut mins = _mm_setzero_ps();
    let low4 = _mm512_set1_epi8(0x0f);
    // Per 64-element run c: sub-block 2c in bytes 0..32 of the quants, 2c + 1 in 32..64.
    let shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    // Word m of run c's products (elements 2m, 2m + 1) takes sub-block 2c + m / 16's scale.
    let halves = _mm512_setr_epi64(0, 0, 0, 0, 1, 1, 1, 1);
    let runs: [__m512i; 4] =
        std::array::from_fn(|c| _mm512_add_epi16(words(halves), _mm512_set1_epi16(2 * c as i16)));
    // Each minimum twice, beside the two 16-element sums of its sub-block.
    let twice = _mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    for (j, b) in w.chunks_exact(144).enumerate() {
        let (sc, mn) = scales_mins(&b[4..16]);
        let sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let mn = _mm256_permutexvar_epi16(
            twice,
            _mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64))),
        );
        let q: [__m512i; 4] = std::array::from_fn(|c| {
            let raw = _mm512_broadcast_i64x4(load256(&b[16 + 32 * c..]));
            _mm512_and_si512(_mm512_srlv_epi64(raw, shift), low4)
        });
        let s: [__m512i; 4] = std::array::from_fn(|c| _mm512_permutexvar_epi16(runs[c], sc));
        let (dw, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let mut msums = [_mm256_setzero_si256(); 4];
        let mut dx = [0f32; 4];
        for k in 0..N {
            let (sumi, bs) = products(&q, &s, x[k], j);
            msums[k] = _mm256_madd_epi16(bs, mn);
            dx[k] = x[k].d[j];
            let d = dw * dx[k];
            acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc[k]);
        }
        // Token k's `mins += dmin · dx · Σ min·sums` in lane k.
        let dx = _mm_setr_ps(dx[0], dx[1], dx[2], dx[3]);
        let t = _mm_mul_ps(
            _mm_mul_ps(_mm_set1_ps(dmin), dx),
            _mm_cvtepi32_ps(hsum4(msums)),
        );
        mins = _mm_add_ps(mins, t);
    }
    let mins = lanes(mins);
    std::array::from_fn(|k| _mm512_reduce_add_ps(acc[k]) - mins[k])
}

/// Q6_K rows `w` (whole super-blocks) against `N` tokens.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn q6_k<const N: usize>(w: &[u8], x: [Q8Row<'_>; N]) -> [f32; N] {
    let nb = w.len() / 210;
    for x in &x {
        check(x, nb);
    }
    let mut acc = [_mm512_setzero_ps(); N];
    const { assert!(N <= 4) };
    let mut bias = _mm_setzero_ps();
    let (m4, m2) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
    // The two high bits of elements 0..32 of a 128-element half are bits 0-1 of its 32 qh
    // bytes, of 32..64 bits 2-3, of 64..96 bits 4-5, of 96..128 bits 6-7: moved to bits 4-5.
    let up01 = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2);
    let down23 = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    // Word m of run r's products (elements 2m, 2m + 1) takes group 4r + m / 8's scale.
    let quarters = _mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3);
    let runs: [__m512i; 4] =
        std::array::from_fn(|r| _mm512_add_epi16(words(quarters), _mm512_set1_epi16(4 * r as i16)));
    for (j, b) in w.chunks_exact(210).enumerate() {
        let (ql, qh) = (&b[..128], &b[128..192]);
        let sc = _mm256_cvtepi8_epi16(load128(&b[192..208]));
        let mut q = [_mm512_setzero_si512(); 4];
        for n in 0..2 {
            let l = load512(&ql[64 * n..]);
            let h = _mm512_broadcast_i64x4(load256(&qh[32 * n..]));
            q[2 * n] = _mm512_or_si512(
                _mm512_and_si512(l, m4),
                _mm512_and_si512(_mm512_sllv_epi64(h, up01), m2),
            );
            q[2 * n + 1] = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                _mm512_and_si512(_mm512_srlv_epi64(h, down23), m2),
            );
        }
        let s: [__m512i; 4] =
            std::array::from_fn(|r| _mm512_permutexvar_epi16(runs[r], _mm512_castsi256_si512(sc)));
        let dw = f16_at(b, 208);
        let mut offsets = [_mm256_setzero_si256(); 4];
        let mut dx = [0f32; 4];
        for k in 0..N {
            let (sumi, bs) = products(&q, &s, x[k], j);
            // The quants are stored as q + 32 in 0..64; the 32 comes off through the group
            // sums.
            offsets[k] = _mm256_madd_epi16(bs, sc);
            dx[k] = x[k].d[j];
            let d = dw * dx[k];
            acc[k] = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(sumi), acc[k]);
        }
        // Token k's `bias += d · 32 · Σ scale·sums` in lane k.
        let d = _mm_mul_ps(_mm_set1_ps(dw), _mm_setr_ps(dx[0], dx[1], dx[2], dx[3]));
        let offset = _mm_slli_epi32::<5>(hsum4(offsets));
        bias = _mm_add_ps(bias, _mm_mul_ps(d, _mm_cvtepi32_ps(offset)));
    }
    let bias = lanes(bias);
    std::array::from_fn(|k| _mm512_reduce_add_ps(acc[k]) - bias[k])
}

/// That `x` holds `nb` super-blocks' activations and group sums.
#[inline]
fn check(x: &Q8Row<'_>, nb: usize) {
    assert!(x.qs.len() >= nb * QK_K && x.d.len() >= nb && x.bsums.len() >= nb * (QK_K / GROUP));
}

/// Super-block `j` of token `x` against its four runs of quants `q` (unsigned, at most 63)
/// with their scales `s` (one per word): `Σ q·x·scale` per four elements, lane `l` of run
/// `c` holding elements `64c + 4l .. + 4` (what `vpdpbusd` and a multiply by the scale give,
/// in fewer instructions: the byte products summed in pairs, then the pairs times their
/// scale summed into the lanes; no pair reaches `i16`'s range); and the super-block's 16
/// group sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn products(q: &[__m512i; 4], s: &[__m512i; 4], x: Q8Row<'_>, j: usize) -> (__m512i, __m256i) {
    let xq = cast(&x.qs[j * QK_K..][..QK_K]);
    let mut sumi = _mm512_setzero_si512();
    for c in 0..4 {
        let pairs = _mm512_maddubs_epi16(q[c], load512(&xq[64 * c..]));
        sumi = _mm512_dpwssd_epi32(sumi, pairs, s[c]);
    }
    let bs: &[i16] = &x.bsums[j * (QK_K / GROUP)..][..QK_K / GROUP];
    (sumi, load256(bytemuck::cast_slice(bs)))
}

/// Q4_K's eight 6-bit scales and eight minimums (12 bytes) as eight bytes each, scale or
/// minimum `i` in byte `i`: the layout `scale_min_k4` reads one at a time.
fn scales_mins(b: &[u8]) -> (u64, u64) {
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let (u0, u1, u2) = (word(0), word(4), word(8));
    let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    // Scales and minimums 0..4 are the low six bits of bytes 0..4 and 4..8; 4..8 take their
    // low four bits from the nibbles of bytes 8..12 and their top two from the spare top
    // bits of bytes 0..4 (scales) and 4..8 (minimums).
    let sc = u64::from(u0 & low6) | u64::from((u2 & low4) | (((u0 >> 6) & top2) << 4)) << 32;
    let mn = u64::from(u1 & low6) | u64::from(((u2 >> 4) & low4) | (((u1 >> 6) & top2) << 4)) << 32;
    (sc, mn)
}

/// Each 64-bit lane's value (0 to 3) in each of its four words.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn words(v: __m512i) -> __m512i {
    let v = _mm512_or_si512(v, _mm512_slli_epi64::<16>(v));
    _mm512_or_si512(v, _mm512_slli_epi64::<32>(v))
}

/// The sums of four vectors' eight i32 lanes, vector `k`'s in lane `k`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn hsum4(v: [__m256i; 4]) -> __m128i {
    // Within each 128-bit half: pairs, then fours, token k's in lane k of each half.
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
}

/// A vector's four lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn lanes(v: __m128) -> [f32; 4] {
    let mut out = [0f32; 4];
    // SAFETY: four floats are 16 writable bytes; storeu has no alignment requirement.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), v) };
    out
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    crate::backend::cpu::dot::scalar::f16_at(b, at)
}

/// Activations as the bytes the loads take.
fn cast(x: &[i8]) -> &[u8] {
    bytemuck::cast_slice(x)
}

//! Decode's products for the 32-element formats: several weight rows against one token's
//! activations per call, four rows at a time (taken with `CAIRN_CPU_ROWS=on`: see
//! `linear::decode_rows`).
//!
//! What [`super::pairs`] does per row, with the work that does not depend on the row done
//! once per pair of blocks for four rows (the activations' 64 bytes, their two steps and
//! sums spread over the register's halves) and no call, slicing or horizontal sum per row:
//! four rows' sums are reduced together at the end. The weights' steps become a register's
//! halves straight from two 16-bit broadcasts (no lane-by-lane assembly), and a format's
//! offset or minimum is folded into the same multiply-add. Four rows read side by side are
//! four streams, so each pair's bytes of the next four rows are prefetched.
//!
//! One thread, rows of 576 (SmolLM2's), against the one-row kernel called per row: 1.6x to
//! 1.9x from L2/L3 on Q5_0, Q4_1 and Q8_0; in a whole decode step on a loaded machine, no
//! gain (docs/performance.md, issue 20 session 17).

use std::arch::x86_64::*;

use super::{Format, Min, halves};
use crate::backend::cpu::q8::{Q8Row, QK};

/// Rows `w` (`out.len()` rows of `row_bytes`, whole blocks of `f`) against `x`, into `out`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn rows(
    w: &[u8],
    row_bytes: usize,
    x: Q8Row<'_>,
    out: &mut [f32],
    f: Format,
    quants: impl Fn(&[u8], &[u8]) -> __m512i + Copy,
) {
    let nb = row_bytes / f.bytes;
    assert!(nb > 0 && nb * f.bytes == row_bytes && w.len() >= out.len() * row_bytes);
    assert!(x.qs.len() >= nb * QK && x.d.len() >= nb);
    assert!(f.min == Min::None || x.sum.len() >= nb);
    let done = out.len() / 4 * 4;
    let mut quads = out.chunks_exact_mut(4);
    for (g, o) in (&mut quads).enumerate() {
        let v = group::<4>(&w[4 * g * row_bytes..], row_bytes, nb, x, f, quants);
        // SAFETY: `o` is 4 writable floats; storeu has no alignment requirement.
        unsafe { _mm_storeu_ps(o.as_mut_ptr(), v) };
    }
    for (r, o) in quads.into_remainder().iter_mut().enumerate() {
        let v = group::<1>(&w[(done + r) * row_bytes..], row_bytes, nb, x, f, quants);
        *o = _mm_cvtss_f32(v);
    }
}

/// `R` rows (1 or 4) from the start of `w`, their sums in the low `R` lanes. The caller
/// checked the activations' lengths for `nb` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn group<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    nb: usize,
    x: Q8Row<'_>,
    f: Format,
    quants: impl Fn(&[u8], &[u8]) -> __m512i,
) -> __m128 {
    let w = &w[..R * row_bytes];
    let mut acc = [_mm512_setzero_ps(); R];
    let (xq, xd, xs) = (x.qs.as_ptr(), x.d.as_ptr(), x.sum.as_ptr());
    for i in (0..nb).step_by(2) {
        let two = i + 1 < nb;
        // SAFETY (the loads): `i + 1 < nb` (else only block `i`'s 32 bytes and one float are
        // read), and the caller checked `x.qs` for `nb · 32` bytes and `x.d`, `x.sum` (where
        // the format has a minimum) for `nb` floats.
        let (xv, dx, s) = unsafe {
            let xv = if two {
                _mm512_loadu_si512(xq.add(i * QK).cast())
            } else {
                _mm512_maskz_loadu_epi8(0xffff_ffff, xq.add(i * QK))
            };
            let pair = |p: *const f32| {
                if two {
                    _mm_castpd_ps(_mm_load_sd(p.add(i).cast()))
                } else {
                    _mm_load_ss(p.add(i))
                }
            };
            let s = if f.min == Min::None {
                _mm_setzero_ps()
            } else {
                pair(xs)
            };
            (xv, halves(pair(xd)), halves(s))
        };
        // Each lane of a half sums an eighth of its block's product, so the block's
        // minimum term comes in eighths too (exact: a power of two).
        let s = match f.min {
            Min::None => s,
            Min::Offset(k) => _mm512_mul_ps(s, _mm512_set1_ps(k / 8.0)),
            Min::Stored => _mm512_mul_ps(s, _mm512_set1_ps(1.0 / 8.0)),
        };
        for (k, acc) in acc.iter_mut().enumerate() {
            // The same bytes of the next group's row: four rows read side by side are four
            // streams, which the hardware prefetchers left to DRAM's latency (Q8_0's rows
            // of 612 bytes ran at half the one-row kernel's speed from memory without this).
            let ahead = w.as_ptr().wrapping_add((R + k) * row_bytes + i * f.bytes);
            // (A hint: it does not fault on any address, past the end included.)
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            let a = &w[k * row_bytes + i * f.bytes..][..f.bytes];
            // The last block alone (odd count) pairs with itself; its activations' second
            // half, step and sum are zero.
            let b = if two {
                &w[k * row_bytes + (i + 1) * f.bytes..][..f.bytes]
            } else {
                a
            };
            let q = quants(a, b);
            let p = if f.signed {
                let x =
                    _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(q), _mm512_setzero_si512(), xv);
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q), x)
            } else {
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv)
            };
            let dw = f16_halves(a, b, 0);
            let t = match f.min {
                Min::None => _mm512_mul_ps(dx, _mm512_cvtepi32_ps(p)),
                Min::Offset(_) => _mm512_fmadd_ps(dx, _mm512_cvtepi32_ps(p), s),
                Min::Stored => {
                    *acc = _mm512_fmadd_ps(f16_halves(a, b, 2), s, *acc);
                    _mm512_mul_ps(dx, _mm512_cvtepi32_ps(p))
                }
            };
            *acc = _mm512_fmadd_ps(dw, t, *acc);
        }
    }
    if R == 4 {
        sum4([acc[0], acc[1 % R], acc[2 % R], acc[3 % R]])
    } else {
        _mm_set_ss(_mm512_reduce_add_ps(acc[0]))
    }
}

/// The f16 at `at` of `a` in the low eight lanes, of `b` in the high eight.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn f16_halves(a: &[u8], b: &[u8], at: usize) -> __m512 {
    let h = |v: &[u8]| _mm_set1_epi16(i16::from_le_bytes([v[at], v[at + 1]]));
    _mm512_cvtph_ps(_mm256_set_m128i(h(b), h(a)))
}

/// The sums of four vectors, in lane order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn sum4(v: [__m512; 4]) -> __m128 {
    let half = |v: __m512| {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        _mm256_add_ps(_mm512_castps512_ps256(v), hi)
    };
    let t = _mm256_hadd_ps(
        _mm256_hadd_ps(half(v[0]), half(v[1])),
        _mm256_hadd_ps(half(v[2]), half(v[3])),
    );
    _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t))
}

//! Decode's products for the 32-element formats: all of a task's weight rows against one
//! token's activations in one call, one row after another.
//!
//! What [`super::pairs`] does per row, without the call, the slicing and the closure around
//! it per row, and with a cheaper pair of blocks: the weights' two f16 steps become a
//! register's halves straight from two 16-bit broadcasts (no lane-by-lane assembly), the
//! activations' two steps and sums come as 8-byte loads, and a format's offset or minimum is
//! folded into the same multiply-add. Each pair's bytes of the next row are prefetched.
//!
//! Rows stay one stream: four rows at a time (the activations' work shared by the four, one
//! horizontal sum per four rows) ran 1.6x to 1.9x this kernel's predecessor from L2/L3, but a
//! decode step reads its weights from memory, and there four rows side by side are four
//! streams: a step took as much CPU time as with the one-row kernel or more. One row after
//! another takes 13% to 17% off a step's CPU time (docs/performance.md, issue 20 session 17).

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
    for (r, o) in out.iter_mut().enumerate() {
        *o = row(&w[r * row_bytes..], row_bytes, nb, x, f, quants);
    }
}

/// The row at the start of `w` (`row_bytes` of it; the next row's bytes, where there are
/// any, are prefetched). The caller checked the activations' lengths for `nb` blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn row(
    w: &[u8],
    row_bytes: usize,
    nb: usize,
    x: Q8Row<'_>,
    f: Format,
    quants: impl Fn(&[u8], &[u8]) -> __m512i,
) -> f32 {
    let next = w.as_ptr().wrapping_add(row_bytes);
    let w = &w[..row_bytes];
    let mut acc = _mm512_setzero_ps();
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
        // (A hint: it does not fault on any address, past the end included.)
        _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(i * f.bytes).cast());
        let a = &w[i * f.bytes..][..f.bytes];
        // The last block alone (odd count) pairs with itself; its activations' second half,
        // step and sum are zero.
        let b = if two {
            &w[(i + 1) * f.bytes..][..f.bytes]
        } else {
            a
        };
        let q = quants(a, b);
        let p = if f.signed {
            let x = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(q), _mm512_setzero_si512(), xv);
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(q), x)
        } else {
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv)
        };
        let dw = f16_halves(a, b, 0);
        let t = match f.min {
            Min::None => _mm512_mul_ps(dx, _mm512_cvtepi32_ps(p)),
            Min::Offset(_) => _mm512_fmadd_ps(dx, _mm512_cvtepi32_ps(p), s),
            Min::Stored => {
                acc = _mm512_fmadd_ps(f16_halves(a, b, 2), s, acc);
                _mm512_mul_ps(dx, _mm512_cvtepi32_ps(p))
            }
        };
        acc = _mm512_fmadd_ps(dw, t, acc);
    }
    _mm512_reduce_add_ps(acc)
}

/// The f16 at `at` of `a` in the low eight lanes, of `b` in the high eight.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn f16_halves(a: &[u8], b: &[u8], at: usize) -> __m512 {
    let h = |v: &[u8]| _mm_set1_epi16(i16::from_le_bytes([v[at], v[at + 1]]));
    _mm512_cvtph_ps(_mm256_set_m128i(h(b), h(a)))
}

//! AVX2 + FMA (+ F16C for the block scales) dot products, the way llama.cpp's x86 kernels
//! shape them: nibbles spread to 32 bytes, `maddubs` (u8 × i8 → pairs of i16), `madd`
//! (→ i32), one float multiply-add per block. Formats without a kernel here fall back to the
//! scalar one.

use std::arch::x86_64::*;
use std::ops::Range;

use super::tile::{Acts, TILE, Tile, word};
use super::{Dot4Fn, DotFn, TileFn};
use crate::backend::cpu::q8::{GROUP, Q8Row, QK, QK_K};
use crate::quant::GgmlType;
use crate::quant::kquants::scale_min_k4;

/// The AVX2 kernel for `ty`, or `None` where there is none or this processor lacks the
/// instructions (so no caller can reach one without them).
pub(super) fn dot(ty: GgmlType) -> Option<DotFn> {
    if !(is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c"))
    {
        return None;
    }
    // SAFETY (every closure below): the features each kernel is compiled for were detected
    // just above, and the kernels touch memory only through bounds-checked slices.
    Some(match ty {
        GgmlType::Q4_0 => |w, x| unsafe { q4_0(w, x) },
        GgmlType::Q4_1 => |w, x| unsafe { q4_1(w, x) },
        GgmlType::Q5_0 => |w, x| unsafe { q5_0(w, x) },
        GgmlType::Q5_1 => |w, x| unsafe { q5_1(w, x) },
        GgmlType::Q8_0 => |w, x| unsafe { q8_0(w, x) },
        GgmlType::Q4_K => |w, x| unsafe { q4_k(w, x) },
        GgmlType::Q6_K => |w, x| unsafe { q6_k(w, x) },
        _ => return None,
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn f16_at(b: &[u8], at: usize) -> f32 {
    let h = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h))))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn load128(b: &[u8]) -> __m128i {
    assert!(b.len() >= 16);
    // SAFETY: 16 readable bytes (checked above); loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn load256(b: &[u8]) -> __m256i {
    assert!(b.len() >= 32);
    // SAFETY: 32 readable bytes (checked above); loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn load256i(b: &[i8]) -> __m256i {
    assert!(b.len() >= 32);
    // SAFETY: as `load256`.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// Signed bytes times signed bytes, summed in fours into i32 lanes. `maddubs` wants its
/// first operand unsigned: |w| against x with w's sign moved onto it (|w| <= 128, |x| <=
/// 127: a pair sums to at most 32512, inside i16).
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_i8(w: __m256i, x: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    _mm256_madd_epi16(p, _mm256_set1_epi16(1))
}

/// Unsigned bytes (at most 63) times signed bytes, summed in fours into i32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_u8(w: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
}

/// 16 bytes of nibbles: the low nibbles in bytes 0..16, the high ones in 16..32.
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles32(b: &[u8]) -> __m256i {
    let v = load128(b);
    let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// The 32 bits at `b[..4]` as 32 bytes, 0xff where the bit is set.
#[target_feature(enable = "avx2,fma,f16c")]
fn bits32(b: &[u8]) -> __m256i {
    let qh = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh as i32),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    // Byte k of each 8 has every bit but bit k set: all ones exactly where bit k was.
    let probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(probe, _mm256_set1_epi64x(-1))
}

/// The 32-element formats: `quants(block)` gives the block's 32 quants and whether they are
/// signed; `(step, min)` come from the block's first bytes.
#[target_feature(enable = "avx2,fma,f16c")]
fn blocks32(
    w: &[u8],
    x: Q8Row<'_>,
    bytes: usize,
    has_min: bool,
    quants: impl Fn(&[u8]) -> (__m256i, bool),
) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0f32;
    for (((b, xq), &dx), &sx) in w
        .chunks_exact(bytes)
        .zip(x.qs.chunks_exact(QK))
        .zip(x.d)
        .zip(x.sum.iter().chain(std::iter::repeat(&0.0)))
    {
        let (q, signed) = quants(b);
        let xv = load256i(xq);
        let p = if signed {
            mul_sum_i8(q, xv)
        } else {
            mul_sum_u8(q, xv)
        };
        acc = _mm256_fmadd_ps(
            _mm256_set1_ps(f16_at(b, 0) * dx),
            _mm256_cvtepi32_ps(p),
            acc,
        );
        if has_min {
            mins += f16_at(b, 2) * sx;
        }
    }
    hsum(acc) + mins
}

/// The four-token kernel for `ty`: each block unpacked once for four tokens' activations,
/// with four independent accumulators. `None` as for [`dot`].
pub(super) fn dot4(ty: GgmlType) -> Option<Dot4Fn> {
    dot(ty)?;
    // SAFETY (every closure below): `dot` returned a kernel, so the features were detected.
    Some(match ty {
        GgmlType::Q4_0 => |w, x| unsafe {
            blocks32_4(w, x, 18, false, |b| {
                (
                    _mm256_sub_epi8(nibbles32(&b[2..18]), _mm256_set1_epi8(8)),
                    true,
                )
            })
        },
        GgmlType::Q4_1 => {
            |w, x| unsafe { blocks32_4(w, x, 20, true, |b| (nibbles32(&b[4..20]), false)) }
        }
        GgmlType::Q5_0 => |w, x| unsafe {
            blocks32_4(w, x, 22, false, |b| {
                let high = _mm256_andnot_si256(bits32(&b[2..6]), _mm256_set1_epi8(0xf0_u8 as i8));
                (_mm256_or_si256(nibbles32(&b[6..22]), high), true)
            })
        },
        GgmlType::Q5_1 => |w, x| unsafe {
            blocks32_4(w, x, 24, true, |b| {
                let high = _mm256_and_si256(bits32(&b[4..8]), _mm256_set1_epi8(0x10));
                (_mm256_or_si256(nibbles32(&b[8..24]), high), false)
            })
        },
        GgmlType::Q8_0 => {
            |w, x| unsafe { blocks32_4(w, x, 34, false, |b| (load256(&b[2..34]), true)) }
        }
        _ => return None,
    })
}

/// [`blocks32`] for four tokens at once.
#[target_feature(enable = "avx2,fma,f16c")]
fn blocks32_4(
    w: &[u8],
    x: [Q8Row<'_>; 4],
    bytes: usize,
    has_min: bool,
    quants: impl Fn(&[u8]) -> (__m256i, bool),
) -> [f32; 4] {
    let nb = w.len() / bytes;
    for r in &x {
        assert!(r.qs.len() >= nb * QK && r.d.len() >= nb && (!has_min || r.sum.len() >= nb));
    }
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut mins = [0f32; 4];
    let ones = _mm256_set1_epi16(1);
    for (i, b) in w.chunks_exact(bytes).enumerate() {
        let (q, signed) = quants(b);
        // Signed quants: |q| once, q's sign moved onto each token's activations.
        let qa = if signed { _mm256_sign_epi8(q, q) } else { q };
        let dw = f16_at(b, 0);
        let mw = if has_min { f16_at(b, 2) } else { 0.0 };
        for k in 0..4 {
            let mut xv = load256i(&x[k].qs[i * QK..]);
            if signed {
                xv = _mm256_sign_epi8(xv, q);
            }
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, xv), ones);
            acc[k] = _mm256_fmadd_ps(
                _mm256_set1_ps(dw * x[k].d[i]),
                _mm256_cvtepi32_ps(p),
                acc[k],
            );
            if has_min {
                mins[k] += mw * x[k].sum[i];
            }
        }
    }
    [
        hsum(acc[0]) + mins[0],
        hsum(acc[1]) + mins[1],
        hsum(acc[2]) + mins[2],
        hsum(acc[3]) + mins[3],
    ]
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 18, false, |b| {
        (
            _mm256_sub_epi8(nibbles32(&b[2..18]), _mm256_set1_epi8(8)),
            true,
        )
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_1(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 20, true, |b| (nibbles32(&b[4..20]), false))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 22, false, |b| {
        // Where the fifth bit is clear, 0xf0 over the nibble makes it nibble - 16 as i8.
        let high = _mm256_andnot_si256(bits32(&b[2..6]), _mm256_set1_epi8(0xf0_u8 as i8));
        (_mm256_or_si256(nibbles32(&b[6..22]), high), true)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q5_1(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 24, true, |b| {
        let high = _mm256_and_si256(bits32(&b[4..8]), _mm256_set1_epi8(0x10));
        (_mm256_or_si256(nibbles32(&b[8..24]), high), false)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q8_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 34, false, |b| (load256(&b[2..34]), true))
}

/// Two 16-element groups' scales as the i16 multipliers of one 32-byte product.
#[target_feature(enable = "avx2,fma,f16c")]
fn scales2(first: i32, second: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(second as i16), _mm_set1_epi16(first as i16))
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q4_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0f32;
    let low4 = _mm256_set1_epi8(0x0f);
    for (((b, xq), &dx), bs) in w
        .chunks_exact(144)
        .zip(x.qs.chunks_exact(QK_K))
        .zip(x.d)
        .zip(x.bsums.chunks_exact(QK_K / GROUP))
    {
        let mut sc = [0i32; 8];
        let mut msum = 0i32;
        for (sub, s) in sc.iter_mut().enumerate() {
            let (step, min) = scale_min_k4(sub, &b[4..16]);
            *s = i32::from(step);
            msum += i32::from(min) * (i32::from(bs[2 * sub]) + i32::from(bs[2 * sub + 1]));
        }
        let mut sumi = _mm256_setzero_si256();
        for c in 0..4 {
            let raw = load256(&b[16 + 32 * c..]);
            let lo = _mm256_and_si256(raw, low4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            let plo = _mm256_maddubs_epi16(lo, load256i(&xq[64 * c..]));
            let phi = _mm256_maddubs_epi16(hi, load256i(&xq[64 * c + 32..]));
            sumi = _mm256_add_epi32(
                sumi,
                _mm256_madd_epi16(plo, _mm256_set1_epi16(sc[2 * c] as i16)),
            );
            sumi = _mm256_add_epi32(
                sumi,
                _mm256_madd_epi16(phi, _mm256_set1_epi16(sc[2 * c + 1] as i16)),
            );
        }
        let d = f16_at(b, 0) * dx;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        mins += f16_at(b, 2) * dx * msum as f32;
    }
    hsum(acc) - mins
}

#[target_feature(enable = "avx2,fma,f16c")]
fn q6_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut bias = 0f32;
    let (m4, m2) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x03));
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
        let mut sumi = _mm256_setzero_si256();
        for n in 0..2 {
            let l0 = load256(&ql[64 * n..]);
            let l1 = load256(&ql[64 * n + 32..]);
            let h = load256(&qh[32 * n..]);
            let high = |shift: i32| {
                let v = match shift {
                    0 => h,
                    2 => _mm256_srli_epi16(h, 2),
                    4 => _mm256_srli_epi16(h, 4),
                    _ => _mm256_srli_epi16(h, 6),
                };
                _mm256_slli_epi16(_mm256_and_si256(v, m2), 4)
            };
            let q = [
                _mm256_or_si256(_mm256_and_si256(l0, m4), high(0)),
                _mm256_or_si256(_mm256_and_si256(l1, m4), high(2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), high(4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), high(6)),
            ];
            for (k, q) in q.into_iter().enumerate() {
                let g = 8 * n + 2 * k;
                let p = _mm256_maddubs_epi16(q, load256i(&xq[128 * n + 32 * k..]));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scales2(sc[g], sc[g + 1])));
            }
        }
        let d = f16_at(b, 208) * dx;
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        bias += d * (32 * offset) as f32;
    }
    hsum(acc) - bias
}

/// The prefill kernel over unpacked tiles (`tile.rs`) for `ty`, or `None` without the
/// instructions or for Q8_0 (its quants unpack to 0..=255, where `maddubs` saturates).
pub(super) fn tile(ty: GgmlType) -> Option<TileFn> {
    if ty == GgmlType::Q8_0
        || !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
    {
        return None;
    }
    // SAFETY: the features the kernel is compiled for were detected just above; it touches
    // memory through bounds-checked slices, and its stores write 8 floats into half of a
    // `[f32; 16]`.
    Some(|t, x, tokens, out| unsafe { tile_tokens(t, x, tokens, out) })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn tile_tokens(t: &Tile, x: &Acts<'_>, tokens: Range<usize>, out: &mut [[f32; TILE]]) {
    if t.groups == 8 {
        tile_pieces::<8>(t, x, tokens, out)
    } else {
        assert_eq!(t.groups, 4);
        tile_pieces::<4>(t, x, tokens, out)
    }
}

/// Tokens at once against half a tile (8 rows): four i32 and four f32 accumulators, within
/// AVX2's 16 registers.
const TILE_TOKENS: usize = 4;

/// The tile against `tokens` of `x`, eight rows at a time. Two words' `maddubs` results are
/// added as i16 before widening: every format's unpacked quants are at most 63 (Q8_0 has no
/// tile here), so four products of at most 63·127 stay inside i16.
#[target_feature(enable = "avx2,fma,f16c")]
fn tile_pieces<const G: usize>(
    t: &Tile,
    x: &Acts<'_>,
    tokens: Range<usize>,
    out: &mut [[f32; TILE]],
) {
    let (nb, len, cols) = (t.blocks, 4 * G, x.cols);
    assert!(x.blocks == nb && cols == nb * len && G.is_multiple_of(2));
    assert!(t.q.len() >= nb * G * TILE && t.dw.len() >= nb * TILE && t.mw.len() >= nb * TILE);
    assert!(x.qs.len() >= tokens.end * cols && x.d.len() >= tokens.end * nb);
    assert!(x.s.len() >= tokens.end * nb && out.len() >= tokens.len());
    let ones = _mm256_set1_epi16(1);
    let mut t0 = tokens.start;
    while t0 < tokens.end {
        let n = (tokens.end - t0).min(TILE_TOKENS);
        // Past the last token the last one again (its results are not stored).
        let ts: [usize; TILE_TOKENS] = std::array::from_fn(|k| t0 + k.min(n - 1));
        let xq = ts.map(|tk| &x.qs[tk * cols..][..cols]);
        let xd = ts.map(|tk| &x.d[tk * nb..][..nb]);
        let xs = ts.map(|tk| &x.s[tk * nb..][..nb]);
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); TILE_TOKENS];
            for b in 0..nb {
                let qb = &t.q[b * G * TILE..][..G * TILE];
                let xb = xq.map(|q| &q[b * len..][..len]);
                let mut sum = [_mm256_setzero_si256(); TILE_TOKENS];
                for g in (0..G).step_by(2) {
                    let w0 = load256(bytemuck::cast_slice(&qb[g * TILE + 8 * half..][..8]));
                    let w1 = load256(bytemuck::cast_slice(&qb[(g + 1) * TILE + 8 * half..][..8]));
                    for k in 0..TILE_TOKENS {
                        let p0 = _mm256_maddubs_epi16(w0, _mm256_set1_epi32(word(xb[k], 4 * g)));
                        let p1 =
                            _mm256_maddubs_epi16(w1, _mm256_set1_epi32(word(xb[k], 4 * g + 4)));
                        let p = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones);
                        sum[k] = _mm256_add_epi32(sum[k], p);
                    }
                }
                let dw = load_ps(&t.dw[b * TILE + 8 * half..]);
                let mw = load_ps(&t.mw[b * TILE + 8 * half..]);
                for k in 0..TILE_TOKENS {
                    let step = _mm256_mul_ps(dw, _mm256_set1_ps(xd[k][b]));
                    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[k]), step, acc[k]);
                    acc[k] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[k][b]), acc[k]);
                }
            }
            for (o, a) in out[t0 - tokens.start..][..n].iter_mut().zip(acc) {
                // SAFETY: `o[8 * half..]` is 8 writable floats; storeu has no alignment
                // requirement.
                unsafe { _mm256_storeu_ps(o[8 * half..].as_mut_ptr(), a) };
            }
        }
        t0 += n;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn load_ps(v: &[f32]) -> __m256 {
    assert!(v.len() >= 8);
    // SAFETY: 8 readable floats (checked above); loadu has no alignment requirement.
    unsafe { _mm256_loadu_ps(v.as_ptr()) }
}

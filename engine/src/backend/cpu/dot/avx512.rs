//! AVX-512 (F, BW, VL) with VNNI dot products: two 32-element blocks in one 512-bit
//! register, `vpdpbusd` (unsigned bytes times signed bytes, four products summed into each
//! i32 lane in one instruction, with no i16 step to saturate), one float multiply-add per
//! pair of blocks. VNNI is required: processors with AVX-512 but without it (Skylake-X) run
//! the AVX2 kernels. Formats without a kernel here fall back to AVX2's.
//!
//! Unsigned quants go straight into `vpdpbusd`. The formats whose quants are offset (Q4_0's
//! nibble - 8, Q5_0's five bits - 16) multiply the unsigned value and take the offset off
//! through each block's activation sum (`Q8Row::sum`, `d·Σq`), as Q4_1's minimum is added.
//! Q8_0's signed weights multiply as magnitudes against the activations with the weight's
//! sign moved onto them (a masked subtract: AVX-512 has no byte `sign`). Taking the offset
//! off in f32 rather than in the integer sum differs from the scalar kernel by float
//! rounding only (the unit tests hold it to 1e-5 of `Σ|w·x|`, as every SIMD path).

use std::arch::x86_64::*;
use std::ops::Range;

use super::tile::{self, Acts, TILE, Tile};
use super::{BatchFn, Dot4Fn, DotFn, RowsFn, TileFn};
use crate::backend::cpu::q8::Q8Row;
use crate::quant::GgmlType;

/// Whether this processor runs these kernels (and the AVX2 ones they fall back to).
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The AVX-512 kernel for `ty`, or `None` where there is none or this processor lacks the
/// instructions (so no caller can reach one without them).
pub(super) fn dot(ty: GgmlType) -> Option<DotFn> {
    if !available() {
        return None;
    }
    // SAFETY (every closure below): the features each kernel is compiled for were detected
    // just above, and the kernels touch memory only through bounds-checked slices (the one
    // masked load reads only bytes of a slice it checked).
    Some(match ty {
        GgmlType::Q4_0 => |w, x| unsafe { q4_0(w, x) },
        GgmlType::Q4_1 => |w, x| unsafe { q4_1(w, x) },
        GgmlType::Q5_0 => |w, x| unsafe { q5_0(w, x) },
        GgmlType::Q5_1 => |w, x| unsafe { q5_1(w, x) },
        GgmlType::Q8_0 => |w, x| unsafe { q8_0(w, x) },
        GgmlType::Q4_K => |w, x| unsafe { kquants::q4_k::<1>(w, [x])[0] },
        GgmlType::Q6_K => |w, x| unsafe { kquants::q6_k::<1>(w, [x])[0] },
        _ => return None,
    })
}

mod kquants;
mod rows;

/// Decode's kernel for `ty`: rows against one token, one call for a task's rows (`rows.rs`). `None` as
/// for [`dot`], and for the K-quants.
pub(super) fn rows(ty: GgmlType) -> Option<RowsFn> {
    if !available() {
        return None;
    }
    // SAFETY (every closure below): as in `dot`.
    Some(match ty {
        GgmlType::Q4_0 => |w, n, x, o| unsafe {
            rows::rows(w, n, x, o, Q4_0, |a, b| nibbles64(&a[2..18], &b[2..18]))
        },
        GgmlType::Q4_1 => |w, n, x, o| unsafe {
            rows::rows(w, n, x, o, Q4_1, |a, b| nibbles64(&a[4..20], &b[4..20]))
        },
        GgmlType::Q5_0 => |w, n, x, o| unsafe {
            rows::rows(w, n, x, o, Q5_0, |a, b| {
                fifth_bit(nibbles64(&a[6..22], &b[6..22]), &a[2..6], &b[2..6])
            })
        },
        GgmlType::Q5_1 => |w, n, x, o| unsafe {
            rows::rows(w, n, x, o, Q5_1, |a, b| {
                fifth_bit(nibbles64(&a[8..24], &b[8..24]), &a[4..8], &b[4..8])
            })
        },
        GgmlType::Q8_0 => |w, n, x, o| unsafe {
            rows::rows(w, n, x, o, Q8_0, |a, b| {
                join(load256(&a[2..34]), load256(&b[2..34]))
            })
        },
        _ => return None,
    })
}

/// The batched decode step's kernel for `ty`: rows against several tokens, one call for a
/// task's rows (`rows::rows_batch`). `None` as for [`rows`].
pub(super) fn batch(ty: GgmlType) -> Option<BatchFn> {
    if !available() {
        return None;
    }
    // SAFETY (every closure below): as in `dot`.
    Some(match ty {
        GgmlType::Q4_0 => |w, n, x, o| unsafe {
            rows::rows_batch(w, n, x, o, Q4_0, |a, b| nibbles64(&a[2..18], &b[2..18]))
        },
        GgmlType::Q4_1 => |w, n, x, o| unsafe {
            rows::rows_batch(w, n, x, o, Q4_1, |a, b| nibbles64(&a[4..20], &b[4..20]))
        },
        GgmlType::Q5_0 => |w, n, x, o| unsafe {
            rows::rows_batch(w, n, x, o, Q5_0, |a, b| {
                fifth_bit(nibbles64(&a[6..22], &b[6..22]), &a[2..6], &b[2..6])
            })
        },
        GgmlType::Q5_1 => |w, n, x, o| unsafe {
            rows::rows_batch(w, n, x, o, Q5_1, |a, b| {
                fifth_bit(nibbles64(&a[8..24], &b[8..24]), &a[4..8], &b[4..8])
            })
        },
        GgmlType::Q8_0 => |w, n, x, o| unsafe {
            rows::rows_batch(w, n, x, o, Q8_0, |a, b| {
                join(load256(&a[2..34]), load256(&b[2..34]))
            })
        },
        _ => return None,
    })
}

/// The four-token kernel for `ty`: each pair of blocks unpacked once for four tokens'
/// activations. `None` as for [`dot`].
pub(super) fn dot4(ty: GgmlType) -> Option<Dot4Fn> {
    if !available() {
        return None;
    }
    // SAFETY (every closure below): as in `dot`.
    Some(match ty {
        GgmlType::Q4_0 => |w, x| unsafe { q4_0_x4(w, x) },
        GgmlType::Q4_1 => |w, x| unsafe { q4_1_x4(w, x) },
        GgmlType::Q5_0 => |w, x| unsafe { q5_0_x4(w, x) },
        GgmlType::Q5_1 => |w, x| unsafe { q5_1_x4(w, x) },
        GgmlType::Q8_0 => |w, x| unsafe { q8_0_x4(w, x) },
        GgmlType::Q4_K => |w, x| unsafe { kquants::q4_k::<4>(w, x) },
        GgmlType::Q6_K => |w, x| unsafe { kquants::q6_k::<4>(w, x) },
        _ => return None,
    })
}

/// What a block adds besides its quants' product, through the activations' block sums.
#[derive(Clone, Copy, PartialEq)]
enum Min {
    None,
    /// The product ran on the quants plus `-k` (unsigned); the block adds `k · d · sum`.
    Offset(f32),
    /// An f16 minimum at bytes 2..4, times the block's `sum`.
    Stored,
}

/// One 32-element format: its block size, whether its quants are signed, and its minimum.
/// (How two blocks' quants become 64 bytes is a closure beside it, so it inlines.)
#[derive(Clone, Copy)]
struct Format {
    bytes: usize,
    signed: bool,
    min: Min,
}

const Q4_0: Format = Format {
    bytes: 18,
    signed: false,
    min: Min::Offset(-8.0),
};
const Q4_1: Format = Format {
    bytes: 20,
    signed: false,
    min: Min::Stored,
};
const Q5_0: Format = Format {
    bytes: 22,
    signed: false,
    min: Min::Offset(-16.0),
};
const Q5_1: Format = Format {
    bytes: 24,
    signed: false,
    min: Min::Stored,
};
const Q8_0: Format = Format {
    bytes: 34,
    signed: true,
    min: Min::None,
};

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    pairs(w, x, Q4_0, |a, b| nibbles64(&a[2..18], &b[2..18]))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4_1(w: &[u8], x: Q8Row<'_>) -> f32 {
    pairs(w, x, Q4_1, |a, b| nibbles64(&a[4..20], &b[4..20]))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q5_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    pairs(w, x, Q5_0, |a, b| {
        fifth_bit(nibbles64(&a[6..22], &b[6..22]), &a[2..6], &b[2..6])
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q5_1(w: &[u8], x: Q8Row<'_>) -> f32 {
    pairs(w, x, Q5_1, |a, b| {
        fifth_bit(nibbles64(&a[8..24], &b[8..24]), &a[4..8], &b[4..8])
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q8_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    pairs(w, x, Q8_0, |a, b| {
        join(load256(&a[2..34]), load256(&b[2..34]))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4_0_x4(w: &[u8], x: [Q8Row<'_>; 4]) -> [f32; 4] {
    pairs4(w, x, Q4_0, |a, b| nibbles64(&a[2..18], &b[2..18]))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4_1_x4(w: &[u8], x: [Q8Row<'_>; 4]) -> [f32; 4] {
    pairs4(w, x, Q4_1, |a, b| nibbles64(&a[4..20], &b[4..20]))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q5_0_x4(w: &[u8], x: [Q8Row<'_>; 4]) -> [f32; 4] {
    pairs4(w, x, Q5_0, |a, b| {
        fifth_bit(nibbles64(&a[6..22], &b[6..22]), &a[2..6], &b[2..6])
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q5_1_x4(w: &[u8], x: [Q8Row<'_>; 4]) -> [f32; 4] {
    pairs4(w, x, Q5_1, |a, b| {
        fifth_bit(nibbles64(&a[8..24], &b[8..24]), &a[4..8], &b[4..8])
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q8_0_x4(w: &[u8], x: [Q8Row<'_>; 4]) -> [f32; 4] {
    pairs4(w, x, Q8_0, |a, b| {
        join(load256(&a[2..34]), load256(&b[2..34]))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn load128(b: &[u8]) -> __m128i {
    assert!(b.len() >= 16);
    // SAFETY: 16 readable bytes (checked above); loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(b.as_ptr().cast()) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn load256(b: &[u8]) -> __m256i {
    assert!(b.len() >= 32);
    // SAFETY: 32 readable bytes (checked above); loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn load512(b: &[u8]) -> __m512i {
    assert!(b.len() >= 64);
    // SAFETY: 64 readable bytes (checked above); loadu has no alignment requirement.
    unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
}

/// Two 256-bit halves as one register, `lo` first.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn join(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Two blocks' 16 bytes of nibbles as their 2 × 32 quants in element order: per block the
/// low nibbles (elements 0..16), then the high ones (16..32).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn nibbles64(a: &[u8], b: &[u8]) -> __m512i {
    let ab = _mm256_set_m128i(load128(b), load128(a));
    // [a, a, b, b] in 128-bit lanes, the second of each pair shifted down a nibble.
    let v = _mm512_permutexvar_epi64(
        _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
        _mm512_castsi256_si512(ab),
    );
    let v = _mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    _mm512_and_si512(v, _mm512_set1_epi8(0x0f))
}

/// Adds 16 to each nibble whose bit is set in the blocks' 32-bit fifth-bit fields.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn fifth_bit(n: __m512i, a: &[u8], b: &[u8]) -> __m512i {
    let lo = u32::from_le_bytes([a[0], a[1], a[2], a[3]]);
    let hi = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let bits: __mmask64 = u64::from(lo) | (u64::from(hi) << 32);
    _mm512_mask_add_epi8(n, bits, n, _mm512_set1_epi8(16))
}

/// Lane 0 of `v` in the low eight lanes, lane 1 in the high eight.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn halves(v: __m128) -> __m512 {
    let idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v))
}

/// One row against one token, two blocks at a time (`rows.rs`: the arithmetic every path of
/// these formats shares).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pairs(w: &[u8], x: Q8Row<'_>, f: Format, quants: impl Fn(&[u8], &[u8]) -> __m512i) -> f32 {
    rows::row(w, x, f, None, quants)
}

/// [`pairs`] for four tokens at once, each pair of blocks unpacked once.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn pairs4(
    w: &[u8],
    x: [Q8Row<'_>; 4],
    f: Format,
    quants: impl Fn(&[u8], &[u8]) -> __m512i,
) -> [f32; 4] {
    rows::row4(w, x, f, quants)
}

/// The prefill kernel over unpacked tiles (`tile.rs`), or `None` without the instructions.
pub(super) fn tile() -> Option<TileFn> {
    if !available() {
        return None;
    }
    // SAFETY: the features the kernel is compiled for were detected just above; it touches
    // memory through bounds-checked slices, and its stores write 16 floats into a
    // `[f32; 16]`.
    Some(|t, x, tokens, out| unsafe { tile_tokens(t, x, tokens, out) })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn tile_tokens(t: &Tile, x: &Acts<'_>, tokens: Range<usize>, out: &mut [[f32; TILE]]) {
    if t.groups == 8 {
        tile_pieces::<8>(t, x, tokens, out)
    } else {
        assert_eq!(t.groups, 4);
        tile_pieces::<4>(t, x, tokens, out)
    }
}

/// Tokens at once against a tile: eight i32 and eight f32 accumulators of 16 rows each
/// stay in registers (AVX-512 has 32), each weight vector is loaded once for eight tokens.
const TILE_TOKENS: usize = 8;

/// The tile against `tokens` of `x`, `out[t - tokens.start]` each token's 16 rows. `G` words
/// (four elements) per piece. The loops index through pointers checked once up front: with
/// slices, the bounds checks and the slices' lengths took more registers and instructions
/// than the products.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn tile_pieces<const G: usize>(
    t: &Tile,
    x: &Acts<'_>,
    tokens: Range<usize>,
    out: &mut [[f32; TILE]],
) {
    let (nb, len, cols) = (t.blocks, 4 * G, x.cols);
    assert!(x.blocks == nb && cols == nb * len);
    assert!(t.q.len() >= nb * G * TILE && t.dw.len() >= nb * TILE && t.mw.len() >= nb * TILE);
    assert!(x.qs.len() >= tokens.end * cols && x.d.len() >= tokens.end * nb);
    assert!(x.s.len() >= tokens.end * nb && out.len() >= tokens.len());
    let (q, dw, mw) = (t.q.as_ptr(), t.dw.as_ptr(), t.mw.as_ptr());
    let mut t0 = tokens.start;
    while t0 < tokens.end {
        let n = (tokens.end - t0).min(TILE_TOKENS);
        // Past the last token the last one again (its results are not stored).
        let tk: [usize; TILE_TOKENS] = std::array::from_fn(|k| t0 + k.min(n - 1));
        let xq: [*const i8; TILE_TOKENS] = std::array::from_fn(|k| x.qs[tk[k] * cols..].as_ptr());
        let xd: [*const f32; TILE_TOKENS] = std::array::from_fn(|k| x.d[tk[k] * nb..].as_ptr());
        let xs: [*const f32; TILE_TOKENS] = std::array::from_fn(|k| x.s[tk[k] * nb..].as_ptr());
        let mut acc = [_mm512_setzero_ps(); TILE_TOKENS];
        for b in 0..nb {
            let mut sum = [_mm512_setzero_si512(); TILE_TOKENS];
            for g in 0..G {
                // SAFETY (this block): `b < nb` and `g < G`, so the tile's word
                // `(b·G + g)·16 + 15` and each token's byte `b·len + 4g + 3 < cols` are in
                // the slices checked above, as are each token's `d` and `s` at `b < nb`.
                let w = unsafe { _mm512_loadu_si512(q.add((b * G + g) * TILE).cast()) };
                for k in 0..TILE_TOKENS {
                    let v = unsafe { xq[k].add(b * len + 4 * g).cast::<i32>().read_unaligned() };
                    sum[k] = _mm512_dpbusd_epi32(sum[k], w, _mm512_set1_epi32(v));
                }
            }
            // SAFETY: as above; 16 floats of the tile's steps and offsets at `b·16`.
            let (dwv, mwv) = unsafe {
                (
                    _mm512_loadu_ps(dw.add(b * TILE)),
                    _mm512_loadu_ps(mw.add(b * TILE)),
                )
            };
            for k in 0..TILE_TOKENS {
                // SAFETY: as above.
                let (d, s) = unsafe { (*xd[k].add(b), *xs[k].add(b)) };
                let step = _mm512_mul_ps(dwv, _mm512_set1_ps(d));
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[k]), step, acc[k]);
                acc[k] = _mm512_fmadd_ps(mwv, _mm512_set1_ps(s), acc[k]);
            }
        }
        for (o, a) in out[t0 - tokens.start..][..n].iter_mut().zip(acc) {
            // SAFETY: `o` is 16 writable floats; storeu has no alignment requirement.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
        }
        t0 += n;
    }
}

/// Unpacks rows `rows` of a 32-element format, Q4_K or Q6_K into `t` sixteen rows at a
/// time: each of a block's words is one gather across the rows, or for the 32-element
/// formats 16-byte loads transposed in registers (`tile.rs`'s portable loop does a row at a
/// time and was a tenth of a prompt's time). `None` (nothing done) for the
/// other K-quants, or where a tile's rows span more than `i32` offsets.
pub(super) fn fill(
    t: &mut Tile,
    f: tile::Format,
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
) -> Option<()> {
    let blocks32 = match f.ty {
        GgmlType::Q4_0 => Some((2, None, Min::Offset(-8.0))),
        GgmlType::Q4_1 => Some((4, None, Min::Stored)),
        GgmlType::Q5_0 => Some((6, Some(2), Min::Offset(-16.0))),
        GgmlType::Q5_1 => Some((8, Some(4), Min::Stored)),
        GgmlType::Q8_0 => Some((2, None, Min::Offset(-128.0))),
        GgmlType::Q4_K | GgmlType::Q6_K => None,
        _ => return None,
    };
    if !available()
        || rows.is_empty()
        || rows.len() > TILE
        || !row_bytes.is_multiple_of(f.bytes)
        || i32::try_from(TILE * row_bytes).is_err()
    {
        return None;
    }
    let rows_bytes = &w[rows.start * row_bytes..rows.end * row_bytes];
    let n = rows.len();
    // SAFETY (all three): the features were detected above; every gather reads 4 bytes (and
    // every load of `fill32` 16) at `row · row_bytes + block · f.bytes + at` with `row < n`
    // and `at + 4 <= f.bytes` (`at + 16`), inside `rows_bytes` (`n · row_bytes` bytes).
    unsafe {
        match (blocks32, f.ty) {
            (Some((qs, qh, min)), _) => fill32(t, f, rows_bytes, row_bytes, n, qs, qh, min),
            (None, GgmlType::Q4_K) => fill_q4_k(t, f, rows_bytes, row_bytes, n),
            (None, _) => fill_q6_k(t, f, rows_bytes, row_bytes, n),
        }
    };
    Some(())
}

/// Byte offsets of a tile's 16 rows (rows past the last repeat it: their lanes are never
/// stored).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn row_offsets(n: usize, row_bytes: usize) -> __m512i {
    _mm512_mullo_epi32(
        _mm512_min_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(n as i32 - 1),
        ),
        _mm512_set1_epi32(row_bytes as i32),
    )
}

/// Byte `k` (0..4) of each lane, as i32.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn byte(v: __m512i, k: u32) -> __m512i {
    _mm512_and_si512(
        _mm512_srlv_epi32(v, _mm512_set1_epi32(8 * k as i32)),
        _mm512_set1_epi32(0xff),
    )
}

/// [`fill`] for Q4_K: the 6-bit scales and minimums decoded on 16 rows at once.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fill_q4_k(t: &mut Tile, f: tile::Format, w: &[u8], row_bytes: usize, n: usize) {
    let (q, dw, mw) = t.prepare(f, row_bytes, n);
    let supers = row_bytes / 144;
    assert!(q.len() >= supers * 64 * TILE && dw.len() >= supers * 8 * TILE);
    assert!(mw.len() >= supers * 8 * TILE && w.len() >= n * row_bytes);
    let idx = row_offsets(n, row_bytes);
    let base = w.as_ptr();
    let (low4, low6) = (_mm512_set1_epi32(0x0f0f_0f0f), _mm512_set1_epi32(63));
    for b in 0..supers {
        // SAFETY: the caller's; every `off + 4 <= 144`.
        let at = |off: usize| unsafe {
            _mm512_i32gather_epi32::<1>(idx, base.add(b * 144 + off).cast())
        };
        let head = at(0);
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
        let s = [at(4), at(8), at(12)];
        for j in 0..8u32 {
            let (sc, m) = if j < 4 {
                (
                    _mm512_and_si512(byte(s[0], j), low6),
                    _mm512_and_si512(byte(s[1], j), low6),
                )
            } else {
                let (lo, k) = (byte(s[2], j - 4), j - 4);
                (
                    _mm512_or_si512(
                        _mm512_and_si512(lo, _mm512_set1_epi32(0x0f)),
                        _mm512_slli_epi32(_mm512_srli_epi32(byte(s[0], k), 6), 4),
                    ),
                    _mm512_or_si512(
                        _mm512_srli_epi32(lo, 4),
                        _mm512_slli_epi32(_mm512_srli_epi32(byte(s[1], k), 6), 4),
                    ),
                )
            };
            let at_piece = (b * 8 + j as usize) * TILE;
            let step = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
            let offset = _mm512_mul_ps(
                _mm512_sub_ps(_mm512_setzero_ps(), dmin),
                _mm512_cvtepi32_ps(m),
            );
            // SAFETY: 16 floats at `at_piece`, inside the slices checked above.
            unsafe {
                _mm512_storeu_ps(dw[at_piece..][..TILE].as_mut_ptr(), step);
                _mm512_storeu_ps(mw[at_piece..][..TILE].as_mut_ptr(), offset);
            }
        }
        for c in 0..4 {
            for g in 0..8 {
                let v = at(16 + 32 * c + 4 * g);
                let lo = _mm512_and_si512(v, low4);
                let hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low4);
                for (h, word) in [lo, hi].into_iter().enumerate() {
                    let sub = 2 * c + h;
                    let o = ((b * 8 + sub) * 8 + g) * TILE;
                    // SAFETY: 16 words at `o`, inside `q` (checked above).
                    unsafe { _mm512_storeu_si512(q[o..][..TILE].as_mut_ptr().cast(), word) };
                }
            }
        }
    }
}

/// [`fill`] for Q6_K: sixteen 16-element pieces per super-block, signed 8-bit scales.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fill_q6_k(t: &mut Tile, f: tile::Format, w: &[u8], row_bytes: usize, n: usize) {
    let (q, dw, mw) = t.prepare(f, row_bytes, n);
    let supers = row_bytes / 210;
    assert!(q.len() >= supers * 64 * TILE && dw.len() >= supers * 16 * TILE);
    assert!(mw.len() >= supers * 16 * TILE && w.len() >= n * row_bytes);
    let idx = row_offsets(n, row_bytes);
    let base = w.as_ptr();
    let (low4, low2) = (
        _mm512_set1_epi32(0x0f0f_0f0f),
        _mm512_set1_epi32(0x0303_0303),
    );
    for b in 0..supers {
        // SAFETY: the caller's; every `off + 4 <= 210`.
        let at = |off: usize| unsafe {
            _mm512_i32gather_epi32::<1>(idx, base.add(b * 210 + off).cast())
        };
        // The step is bytes 208..210: the high half of the word at 206 (one at 208 would
        // read past the block).
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(at(206), 16)));
        for w4 in 0..4 {
            let sc = at(192 + 4 * w4);
            for k in 0..4 {
                // Byte k, sign-extended: to the top, then an arithmetic shift down.
                let v = _mm512_srai_epi32(_mm512_sllv_epi32(sc, _mm512_set1_epi32(24 - 8 * k)), 24);
                let step = _mm512_mul_ps(d, _mm512_cvtepi32_ps(v));
                let o = (b * 16 + 4 * w4 + k as usize) * TILE;
                // SAFETY: 16 floats at `o`, inside the slices checked above.
                unsafe {
                    _mm512_storeu_ps(dw[o..][..TILE].as_mut_ptr(), step);
                    _mm512_storeu_ps(
                        mw[o..][..TILE].as_mut_ptr(),
                        _mm512_mul_ps(step, _mm512_set1_ps(-32.0)),
                    );
                }
            }
        }
        for half in 0..2 {
            for m in 0..8 {
                let h = at(128 + 32 * half + 4 * m);
                let l = [at(64 * half + 4 * m), at(64 * half + 32 + 4 * m)];
                for k in 0..4 {
                    let low = _mm512_and_si512(
                        _mm512_srlv_epi32(l[k % 2], _mm512_set1_epi32(4 * (k / 2) as i32)),
                        low4,
                    );
                    let high = _mm512_and_si512(
                        _mm512_srlv_epi32(h, _mm512_set1_epi32(2 * k as i32)),
                        low2,
                    );
                    let word = _mm512_or_si512(low, _mm512_slli_epi32(high, 4));
                    let o = (b * 64 + 32 * half + 8 * k + m) * TILE;
                    // SAFETY: 16 words at `o`, inside `q` (checked above).
                    unsafe { _mm512_storeu_si512(q[o..][..TILE].as_mut_ptr().cast(), word) };
                }
            }
        }
    }
}

/// Dwords 0..4 of the 16 bytes at `off` of each of 16 rows, as four vectors of 16 lanes (lane
/// `r` row `r`): 16-byte loads and a 4 × 4 transpose within each 128-bit lane, about half
/// the cost of four gathers.
///
/// # Safety
/// `row[r] + off .. + 16` is readable for every `r`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn window16(row: &[*const u8; TILE], off: usize) -> [__m512i; 4] {
    // SAFETY: the caller's.
    let load = |r: usize| unsafe { _mm_loadu_si128(row[r].add(off).cast()) };
    // z[j]'s 128-bit lane l holds row 4l + j, so the transpose leaves lane 4l + j = row 4l + j.
    let z: [__m512i; 4] = std::array::from_fn(|j| {
        let v = _mm512_castsi128_si512(load(j));
        let v = _mm512_inserti32x4::<1>(v, load(j + 4));
        let v = _mm512_inserti32x4::<2>(v, load(j + 8));
        _mm512_inserti32x4::<3>(v, load(j + 12))
    });
    let t0 = _mm512_unpacklo_epi32(z[0], z[1]);
    let t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    let t2 = _mm512_unpacklo_epi32(z[2], z[3]);
    let t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fill32(
    t: &mut Tile,
    f: tile::Format,
    w: &[u8],
    row_bytes: usize,
    n: usize,
    qs: usize,
    qh: Option<usize>,
    min: Min,
) {
    let (q, dw, mw) = t.prepare(f, row_bytes, n);
    let blocks = row_bytes / f.bytes;
    assert!(q.len() >= blocks * 8 * TILE && dw.len() >= blocks * TILE && mw.len() >= blocks * TILE);
    assert!(w.len() >= n * row_bytes && qs + 16 <= f.bytes && f.bytes >= 16);
    assert!(f.ty != GgmlType::Q8_0 || qs + 32 <= f.bytes);
    let low4 = _mm512_set1_epi32(0x0f0f_0f0f);
    let bit0 = _mm512_set1_epi32(0x0101_0101);
    let spread = _mm512_set1_epi32(0x0020_4081);
    // Rows past the last repeat it (their lanes are never stored).
    let row: [*const u8; TILE] = std::array::from_fn(|r| w[r.min(n - 1) * row_bytes..].as_ptr());
    for b in 0..blocks {
        // SAFETY (the loads): the caller's; each window is 16 bytes inside the block.
        let window = |off: usize| unsafe { window16(&row, b * f.bytes + off) };
        let out = &mut q[b * 8 * TILE..][..8 * TILE];
        let first = window(0);
        // The word at byte `o` (`o + 4 <= 16`) of the block's first 16 bytes.
        let word_at = |o: usize| {
            let (i, k) = (o / 4, (o % 4) as u32);
            if k == 0 {
                first[i]
            } else {
                _mm512_or_si512(
                    _mm512_srl_epi32(first[i], _mm_cvtsi32_si128(8 * k as i32)),
                    _mm512_sll_epi32(first[i + 1], _mm_cvtsi32_si128(32 - 8 * k as i32)),
                )
            }
        };
        let head = first[0];
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
        let m = match min {
            Min::Stored => _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))),
            Min::Offset(k) => _mm512_mul_ps(d, _mm512_set1_ps(k)),
            Min::None => _mm512_setzero_ps(),
        };
        let high = qh.map(word_at);
        let mut words = [_mm512_setzero_si512(); 8];
        if f.ty == GgmlType::Q8_0 {
            let (lo, hi) = (window(qs), window(qs + 16));
            for (v, x) in words.iter_mut().zip(lo.into_iter().chain(hi)) {
                *v = _mm512_xor_si512(x, _mm512_set1_epi32(0x8080_8080_u32 as i32));
            }
        } else {
            for (k, v) in window(qs).into_iter().enumerate() {
                words[k] = _mm512_and_si512(v, low4);
                words[k + 4] = _mm512_and_si512(_mm512_srli_epi32(v, 4), low4);
            }
        }
        if let Some(h) = high {
            for (g, v) in words.iter_mut().enumerate() {
                // Four bits to bit 4 of four bytes (the shifted copies do not overlap).
                let four = _mm512_and_si512(
                    _mm512_srlv_epi32(h, _mm512_set1_epi32(4 * g as i32)),
                    _mm512_set1_epi32(0x0f),
                );
                let bits = _mm512_and_si512(_mm512_mullo_epi32(four, spread), bit0);
                *v = _mm512_or_si512(*v, _mm512_slli_epi32(bits, 4));
            }
        }
        for (g, v) in words.into_iter().enumerate() {
            // SAFETY: `out` holds 8 · 16 words.
            unsafe { _mm512_storeu_si512(out[g * TILE..][..TILE].as_mut_ptr().cast(), v) };
        }
        // SAFETY: 16 floats each at `b · 16`, inside the slices checked above.
        unsafe {
            _mm512_storeu_ps(dw[b * TILE..][..TILE].as_mut_ptr(), d);
            _mm512_storeu_ps(mw[b * TILE..][..TILE].as_mut_ptr(), m);
        }
    }
}

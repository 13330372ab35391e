//! Prefill over unpacked weight tiles in wasm SIMD (the browser's CPU fallback): the tiles of
//! `tile.rs` (16 rows, each 32-bit lane four consecutive quants of one row, so one v128 holds
//! four elements of four rows), run against several tokens per pass while they sit in L1 (each
//! piece's words, steps and offsets loaded once for them: four in the threaded package, two
//! in the single-thread one, [`PASS`]). Full Q4_0 and Q4_1
//! tiles are unpacked here too (`fill`), four rows at a time.
//!
//! Per 32-element block and token the one-token and four-token kernels (`simd128.rs`) pay for
//! the unpacking of the weight block (once per four tokens), a horizontal sum of the block's
//! i32 lanes and the float bookkeeping per row; here the block is unpacked once per op, each
//! i32 lane accumulates its own row (no horizontal sums), and the scale arithmetic runs on
//! four rows per vector.
//!
//! - With relaxed SIMD (the threaded package): `i16x8.relaxed_dot_i8x16_i7x16_s` of the
//!   token's four bytes broadcast to every lane against the tile's bytes (the weights are the
//!   7-bit operand: every tiled format's unpacked quants are at most 63), several groups of
//!   four summed in i16 before one widening (`SUM`, chosen so no lane can pass i16: Q4's
//!   quants of at most 15 sum eight groups, Q5's four, 6-bit ones two). Eight rows at a time
//!   ([`half_relaxed`]), for what V8's register allocator can hold.
//! - Without it (the single-thread package): the tile widened once to i16 pairs (elements
//!   0,1 and 2,3 of four rows per vector) and `i32x4.dot_i16x8_s` against the token's pairs
//!   broadcast.
//!
//! Both reduce each block's product to the same exact i32 per row before it meets a float,
//! and both end in the same float steps ([`scale_into`]), so the two packages stay
//! bit-identical
//! (tests/tests/browser.rs `threaded_cpu_fallback_matches_the_single_thread_one`). Q8_0 has
//! no tile here (its unpacked bytes use all 8 bits).

use std::arch::wasm32::*;
use std::ops::Range;

use super::TileFn;
use super::simd128::f16x4;
use super::tile::{Acts, Format, TILE, Tile};
use crate::quant::GgmlType;

/// The tile kernel for `ty`, where it has one.
pub(super) fn tile(ty: GgmlType) -> Option<TileFn> {
    Some(match ty {
        // Quants of at most 15.
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4_K => tokens::<8, 8>,
        // At most 31.
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => tokens::<8, 4>,
        // 16-element pieces: Q2_K (at most 3), Q3_K (7), Q6_K (63).
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q6_K => tokens::<4, 2>,
        GgmlType::Q8_0 | GgmlType::F32 | GgmlType::F16 => return None,
    })
}

thread_local! {
    /// The single-thread package's tile widened to i16 pairs, and one token's activations
    /// widened to i16; only grow.
    #[cfg(not(target_feature = "relaxed-simd"))]
    static WIDE: std::cell::RefCell<(Vec<v128>, Vec<i16>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

fn load_f32(b: &[f32]) -> v128 {
    assert!(b.len() >= 4);
    // SAFETY: 4 readable f32 (checked above), no alignment requirement.
    unsafe { v128_load(b.as_ptr().cast()) }
}

fn store_f32(b: &mut [f32], v: v128) {
    assert!(b.len() >= 4);
    // SAFETY: 4 writable f32 (checked above), no alignment requirement.
    unsafe { v128_store(b.as_mut_ptr().cast(), v) }
}

/// Tokens per pass over the tile: each piece's quants (or widened pairs), steps and offsets
/// are loaded once for this many tokens. Integer products and the float steps per token are
/// the one-token pass's, so the results keep its bits (and the packages stay bit-identical).
///
/// Four with relaxed SIMD (over eight rows at a time, [`half_relaxed`]; five measured 14%
/// slower on one thread in session 21, eight tokens over 16 rows 17% slower in session 21), two
/// in the single-thread package, whose widened pairs take twice the registers: there four
/// tokens spill V8's 16 vector registers on x86-64. Measured: the threaded package on one
/// thread in Chromium at load 1.3-1.7, 128-token prefill 274 / 278 tok/s with four against 224
/// / 223 with two; the single-thread package under Node, process CPU time, 162 with two, 138
/// with four, 105 with one (docs/performance.md, session 20).
#[cfg(target_feature = "relaxed-simd")]
const PASS: usize = 4;
#[cfg(not(target_feature = "relaxed-simd"))]
const PASS: usize = 2;

/// `acc` plus one piece's products for four rows and one token: the exact integer sums `s`
/// scaled by the rows' steps `dw` and the token's `dx`, plus the rows' offsets `mw` times the
/// token's block sum `sx`. Both packages' kernels end in this one function, so they give the
/// same bits (bit-identity between them rests on it).
#[inline(always)]
fn scale_into(acc: v128, s: v128, [dw, mw]: [v128; 2], [dx, sx]: [v128; 2]) -> v128 {
    let step = f32x4_mul(dw, dx);
    let offset = f32x4_mul(mw, sx);
    f32x4_add(
        acc,
        f32x4_add(f32x4_mul(step, f32x4_convert_i32x4(s)), offset),
    )
}

/// The tile (pieces of `G` words of four quants) against `tokens` of `x`, [`PASS`] tokens per
/// pass and the rest one at a time. `SUM`: words whose products are summed in i16 before
/// widening.
fn tokens<const G: usize, const SUM: usize>(
    t: &Tile,
    x: &Acts<'_>,
    tokens: Range<usize>,
    out: &mut [[f32; TILE]],
) {
    let (nb, len, cols) = (t.blocks, 4 * G, x.cols);
    assert!(t.groups == G && G.is_multiple_of(SUM));
    assert!(x.blocks == nb && cols == nb * len);
    assert!(t.q.len() >= nb * G * TILE && t.dw.len() >= nb * TILE && t.mw.len() >= nb * TILE);
    assert!(x.qs.len() >= tokens.end * cols && x.d.len() >= tokens.end * nb);
    assert!(x.s.len() >= tokens.end * nb && out.len() >= tokens.len());
    let (first, n) = (tokens.start, tokens.len());
    let passes = n / PASS;
    #[cfg(not(target_feature = "relaxed-simd"))]
    WIDE.with_borrow_mut(|(wide, xw)| {
        widen(t, nb * G, wide);
        xw.resize(PASS * cols, 0);
        let widen_x = |xw: &mut [i16], k: usize, tk: usize| {
            for (w, &q) in xw[k * cols..][..cols]
                .iter_mut()
                .zip(&x.qs[tk * cols..][..cols])
            {
                *w = i16::from(q);
            }
        };
        for p in 0..passes {
            let tk = first + p * PASS;
            for k in 0..PASS {
                widen_x(xw, k, tk + k);
            }
            let xs: [&[i16]; PASS] = std::array::from_fn(|k| &xw[k * cols..][..cols]);
            pass::<G, PASS>(t, x, tk, &mut out[p * PASS..], |b| {
                block_wide::<G, PASS>(wide, xs, b)
            });
        }
        for k in passes * PASS..n {
            widen_x(xw, 0, first + k);
            let xs = [&xw[..cols]];
            pass::<G, 1>(t, x, first + k, &mut out[k..], |b| {
                block_wide::<G, 1>(wide, xs, b)
            });
        }
    });
    #[cfg(target_feature = "relaxed-simd")]
    {
        let _ = len;
        let row = |tk: usize| &x.qs[tk * cols..][..cols];
        for p in 0..passes {
            let tk = first + p * PASS;
            let xs: [&[i8]; PASS] = std::array::from_fn(|k| row(tk + k));
            half_relaxed::<G, SUM, PASS, 0>(t, x, xs, tk, &mut out[p * PASS..]);
            half_relaxed::<G, SUM, PASS, 1>(t, x, xs, tk, &mut out[p * PASS..]);
        }
        for k in passes * PASS..n {
            let xs = [row(first + k)];
            half_relaxed::<G, SUM, 1, 0>(t, x, xs, first + k, &mut out[k..]);
            half_relaxed::<G, SUM, 1, 1>(t, x, xs, first + k, &mut out[k..]);
        }
    }
}

/// Rows `8H..8H + 8` of the tile against tokens `tk..tk + N` (`xs`, their int8 rows), every
/// piece, with relaxed SIMD: per piece the exact integer products, then [`scale_into`] as the
/// plain package's [`pass`] (so the same bits).
///
/// Why half the rows: the loop over a piece's words then holds N·2 i16 sums, two words, a
/// broadcast and a product (12 vectors for four tokens), within the 15 vector registers V8
/// allocates on x86-64. All 16 rows at once (sessions 19 and 20) held 22 and spilled 9 sums
/// to the stack and back on every word; a quarter (4 rows) paid a word's loop overhead for 4
/// products. The pointers are offset by hand: indexing slices put four bounds checks in
/// every word. And the loop stays rolled: unrolled, LLVM hoists the later words' loads ahead
/// (wasm has no register limit) and V8 spills them. In headless Chromium on this machine's
/// EPYC, one thread, the default model's 128-token prefill: 357 tok/s against 312 with all
/// 16 rows (docs/performance.md, session 21).
#[cfg(target_feature = "relaxed-simd")]
#[inline(always)]
fn half_relaxed<const G: usize, const SUM: usize, const N: usize, const H: usize>(
    t: &Tile,
    x: &Acts<'_>,
    xs: [&[i8]; N],
    tk: usize,
    out: &mut [[f32; TILE]],
) {
    let nb = t.blocks;
    let q = &t.q[..nb * G * TILE];
    let (dw, mw) = (&t.dw[..nb * TILE], &t.mw[..nb * TILE]);
    let xd: [&[f32]; N] = std::array::from_fn(|k| &x.d[(tk + k) * nb..][..nb]);
    let xsum: [&[f32]; N] = std::array::from_fn(|k| &x.s[(tk + k) * nb..][..nb]);
    let xs: [&[i8]; N] = xs.map(|x| &x[..nb * 4 * G]);
    let mut acc = [[f32x4_splat(0.0); 2]; N];
    for b in 0..nb {
        // The piece's words for these rows, and each token's bytes for the piece.
        let wp = q[b * G * TILE + 8 * H..].as_ptr();
        let xp: [*const i8; N] = xs.map(|x| x[b * 4 * G..].as_ptr());
        let mut s = [[i32x4_splat(0); 2]; N];
        for g0 in (0..G).step_by(SUM) {
            let mut h = [[i16x8_splat(0); 2]; N];
            let mut word = |g: usize| {
                // SAFETY: g < G: the piece's group g holds TILE words, of which these rows'
                // 8 start at 8H; each token's bytes 4g..4g + 4 are inside its piece (both
                // sliced above).
                let w = unsafe {
                    [
                        v128_load(wp.add(g * TILE).cast()),
                        v128_load(wp.add(g * TILE + 4).cast()),
                    ]
                };
                for (h, xp) in h.iter_mut().zip(xp) {
                    // SAFETY: as above.
                    let xw = unsafe { v128_load32_splat(xp.add(4 * g).cast()) };
                    for (h, &w) in h.iter_mut().zip(&w) {
                        // Each i16 lane two products of one row: at most 2·63·127, and
                        // `SUM` of them stay within i16 (`tile`).
                        *h = i16x8_add(*h, i16x8_relaxed_dot_i8x16_i7x16(xw, w));
                    }
                }
            };
            for g in g0..g0 + SUM {
                word(g);
            }
            for (s, h) in s.iter_mut().zip(h) {
                for (s, h) in s.iter_mut().zip(h) {
                    *s = i32x4_add(*s, i32x4_extadd_pairwise_i16x8(h));
                }
            }
        }
        for j in 0..2 {
            let at = b * TILE + 8 * H + 4 * j;
            let (dwv, mwv) = (load_f32(&dw[at..]), load_f32(&mw[at..]));
            for k in 0..N {
                let (dx, sx) = (f32x4_splat(xd[k][b]), f32x4_splat(xsum[k][b]));
                acc[k][j] = scale_into(acc[k][j], s[k][j], [dwv, mwv], [dx, sx]);
            }
        }
    }
    for (out, acc) in out[..N].iter_mut().zip(acc) {
        for (j, acc) in acc.into_iter().enumerate() {
            store_f32(&mut out[8 * H + 4 * j..], acc);
        }
    }
}

/// Tokens `tk..tk + N`'s 16 results each: `sums(b)` gives piece `b`'s exact integer
/// products per token (rows `4v..4v + 4` in vector `v`), scaled here by the rows' steps and
/// the token's, plus the rows' offsets times the token's block sum.
#[cfg(not(target_feature = "relaxed-simd"))]
#[inline(always)]
fn pass<const G: usize, const N: usize>(
    t: &Tile,
    x: &Acts<'_>,
    tk: usize,
    out: &mut [[f32; TILE]],
    sums: impl Fn(usize) -> [[v128; 4]; N],
) {
    let nb = t.blocks;
    let xd: [&[f32]; N] = std::array::from_fn(|k| &x.d[(tk + k) * nb..][..nb]);
    let xs: [&[f32]; N] = std::array::from_fn(|k| &x.s[(tk + k) * nb..][..nb]);
    let (dw, mw) = (&t.dw[..nb * TILE], &t.mw[..nb * TILE]);
    let mut acc = [[f32x4_splat(0.0); 4]; N];
    for b in 0..nb {
        let s = sums(b);
        let dx: [v128; N] = std::array::from_fn(|k| f32x4_splat(xd[k][b]));
        let sx: [v128; N] = std::array::from_fn(|k| f32x4_splat(xs[k][b]));
        for v in 0..4 {
            let (dwv, mwv) = (
                load_f32(&dw[b * TILE + 4 * v..]),
                load_f32(&mw[b * TILE + 4 * v..]),
            );
            for k in 0..N {
                acc[k][v] = scale_into(acc[k][v], s[k][v], [dwv, mwv], [dx[k], sx[k]]);
            }
        }
    }
    for (out, acc) in out[..N].iter_mut().zip(acc) {
        for (v, acc) in acc.into_iter().enumerate() {
            store_f32(&mut out[4 * v..], acc);
        }
    }
}

/// The tile's `words` words of 16 rows as i16 pairs: for each word and rows `4v..4v + 4`,
/// elements 0 and 1 of the four rows, then elements 2 and 3.
#[cfg(not(target_feature = "relaxed-simd"))]
fn widen(t: &Tile, words: usize, wide: &mut Vec<v128>) {
    let q = &t.q[..words * TILE];
    wide.clear();
    wide.reserve(words * 8);
    for c in q.chunks_exact(4) {
        // SAFETY: 16 readable bytes (a chunk of four u32), no alignment requirement.
        let v = unsafe { v128_load(c.as_ptr().cast()) };
        let pairs = u8x16_swizzle(
            v,
            u8x16(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15),
        );
        wide.push(u16x8_extend_low_u8x16(pairs));
        wide.push(u16x8_extend_high_u8x16(pairs));
    }
}

/// Piece `b` of the widened tile against `N` tokens' widened activations, plain simd128.
#[cfg(not(target_feature = "relaxed-simd"))]
#[inline(always)]
fn block_wide<const G: usize, const N: usize>(
    wide: &[v128],
    xw: [&[i16]; N],
    b: usize,
) -> [[v128; 4]; N] {
    let wb = &wide[b * G * 8..][..G * 8];
    let xb: [&[i16]; N] = xw.map(|x| &x[b * 4 * G..][..4 * G]);
    let mut s = [[i32x4_splat(0); 4]; N];
    for g in 0..G {
        let w = &wb[g * 8..][..8];
        for (s, xb) in s.iter_mut().zip(xb) {
            let pair = |at: usize| {
                let p = &xb[at..at + 2];
                // SAFETY: 4 readable bytes (two i16, sliced above), no alignment requirement.
                unsafe { v128_load32_splat(p.as_ptr().cast()) }
            };
            let (x01, x23) = (pair(4 * g), pair(4 * g + 2));
            for (v, s) in s.iter_mut().enumerate() {
                let p = i32x4_add(
                    i32x4_dot_i16x8(w[2 * v], x01),
                    i32x4_dot_i16x8(w[2 * v + 1], x23),
                );
                *s = i32x4_add(*s, p);
            }
        }
    }
    s
}

/// Unpacks a full tile of a Q4_0 or Q4_1 matrix (`Tile::fill`'s result, bit for bit) four
/// rows at a time: each row's 16 bytes of nibbles split into low and high halves (its words
/// 0..4 and 4..8) and four rows' words transposed into the tile's row-interleaved order, where
/// the portable fill moves one word at a time (5% of a prompt's time in the single-thread
/// package, docs/performance.md session 20). `None` where the portable fill runs instead
/// (other formats, a partial tile).
pub(super) fn fill(
    t: &mut Tile,
    f: Format,
    w: &[u8],
    row_bytes: usize,
    rows: Range<usize>,
) -> Option<()> {
    // Where the nibbles start in a block, and the offset per step where the block has no
    // stored minimum.
    let (at, offset) = match f.ty {
        GgmlType::Q4_0 => (2, Some(-8.0)),
        GgmlType::Q4_1 => (4, None),
        _ => return None,
    };
    if rows.len() != TILE || f.sub != 32 || !row_bytes.is_multiple_of(f.bytes) {
        return None;
    }
    let w = w.get(rows.start * row_bytes..rows.end * row_bytes)?;
    let nb = row_bytes / f.bytes;
    let (q, dw, mw) = t.prepare(f, row_bytes, TILE);
    assert!(q.len() == nb * 8 * TILE && dw.len() == nb * TILE && mw.len() == nb * TILE);
    let low4 = u8x16_splat(0x0f);
    for r0 in (0..TILE).step_by(4) {
        for b in 0..nb {
            let mut lo = [low4; 4];
            let mut hi = [low4; 4];
            let (mut d, mut m) = ([0u32; 4], [0u32; 4]);
            for i in 0..4 {
                let block = &w[(r0 + i) * row_bytes + b * f.bytes..][..f.bytes];
                let nibbles = &block[at..at + 16];
                // SAFETY: 16 readable bytes (sliced above), no alignment requirement.
                let v = unsafe { v128_load(nibbles.as_ptr().cast()) };
                lo[i] = v128_and(v, low4);
                hi[i] = u8x16_shr(v, 4);
                d[i] = u32::from(u16::from_le_bytes([block[0], block[1]]));
                m[i] = u32::from(u16::from_le_bytes([block[2], block[3]]));
            }
            // The four rows' scales (and Q4_1's minimums) converted at once; the conversion is
            // exact, so these are `f16_at`'s values.
            let d = f16x4(u32x4(d[0], d[1], d[2], d[3]));
            let m = match offset {
                Some(o) => f32x4_mul(f32x4_splat(o), d),
                None => f16x4(u32x4(m[0], m[1], m[2], m[3])),
            };
            store_f32(&mut dw[b * TILE + r0..], d);
            store_f32(&mut mw[b * TILE + r0..], m);
            for (half, words) in [transpose(lo), transpose(hi)].into_iter().enumerate() {
                for (j, v) in words.into_iter().enumerate() {
                    let dst = &mut q[(b * 8 + 4 * half + j) * TILE + r0..][..4];
                    // SAFETY: 16 writable bytes (four u32, sliced above), no alignment
                    // requirement.
                    unsafe { v128_store(dst.as_mut_ptr().cast(), v) };
                }
            }
        }
    }
    Some(())
}

/// Four vectors of four u32 (one row's words each) as four vectors of one word of each row.
#[inline(always)]
fn transpose(r: [v128; 4]) -> [v128; 4] {
    let a = i32x4_shuffle::<0, 4, 1, 5>(r[0], r[1]);
    let b = i32x4_shuffle::<2, 6, 3, 7>(r[0], r[1]);
    let c = i32x4_shuffle::<0, 4, 1, 5>(r[2], r[3]);
    let d = i32x4_shuffle::<2, 6, 3, 7>(r[2], r[3]);
    [
        i32x4_shuffle::<0, 1, 4, 5>(a, c),
        i32x4_shuffle::<2, 3, 6, 7>(a, c),
        i32x4_shuffle::<0, 1, 4, 5>(b, d),
        i32x4_shuffle::<2, 3, 6, 7>(b, d),
    ]
}

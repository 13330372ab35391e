//! The 32-element formats' products on AVX-512: a row against one token ([`row`], what
//! `dot` and decode's several-row kernel [`rows`] run), against four ([`row4`], the
//! four-token kernel) and against a batch of decode tokens ([`rows_batch`], a batched decode
//! step's rows in one call), with one arithmetic, so every path gives a (row, token) the same
//! bits.
//!
//! The same bits matter: each op rounds its activations to int8, so a last-bit difference in
//! one product can move an element by a whole step, and a few layers compound it (the tiny
//! Gemma models turn a one-ulp change of half of decode's products into logits 0.035 to 0.08
//! off; docs/performance.md, issue 20 session 18). A sequence decoded alone and the same
//! sequence in a batch (four-token kernel, or the one-token kernel per row) must therefore
//! not differ in summation order, and the batch tests hold them to 1e-3.
//!
//! Per pair of blocks, what the one-row kernel did before with the call, the slicing and the
//! closure around it per row, done cheaper: the weights' two f16 steps become a register's
//! halves straight from two 16-bit broadcasts (no lane-by-lane assembly), the activations'
//! two steps and sums come as 8-byte loads, and a format's offset or minimum is folded into
//! the same multiply-add. [`rows`] prefetches each pair's bytes of the next row.
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
    assert!(nb * f.bytes == row_bytes && w.len() >= out.len() * row_bytes);
    for (r, o) in out.iter_mut().enumerate() {
        let w = &w[r * row_bytes..][..row_bytes];
        // The next row's bytes, where there are any (a hint: it faults on no address).
        let next = w.as_ptr().wrapping_add(row_bytes);
        *o = row(w, x, f, Some(next), quants);
    }
}

/// That `x` holds `nb` blocks' activations (and sums, where the format has a minimum): what
/// [`token`]'s unchecked loads rely on.
fn check(x: Q8Row<'_>, nb: usize, f: Format) {
    assert!(x.qs.len() >= nb * QK && x.d.len() >= nb);
    assert!(f.min == Min::None || x.sum.len() >= nb);
}

/// The row `w` (whole blocks of `f`) against `x`; with `prefetch`, each pair's bytes from
/// that address on are prefetched.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn row(
    w: &[u8],
    x: Q8Row<'_>,
    f: Format,
    prefetch: Option<*const u8>,
    quants: impl Fn(&[u8], &[u8]) -> __m512i,
) -> f32 {
    let nb = w.len() / f.bytes;
    check(x, nb, f);
    let mut acc = _mm512_setzero_ps();
    for i in (0..nb).step_by(2) {
        if let Some(next) = prefetch {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(i * f.bytes).cast());
        }
        let p = pair(w, i, nb, f, &quants);
        acc = token(acc, &p, x, i, f);
    }
    _mm512_reduce_add_ps(acc)
}

/// [`row`] against four tokens, each token's arithmetic exactly [`row`]'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn row4(
    w: &[u8],
    x: [Q8Row<'_>; 4],
    f: Format,
    quants: impl Fn(&[u8], &[u8]) -> __m512i,
) -> [f32; 4] {
    let nb = w.len() / f.bytes;
    for r in x {
        check(r, nb, f);
    }
    let mut acc = [_mm512_setzero_ps(); 4];
    for i in (0..nb).step_by(2) {
        let p = pair(w, i, nb, f, &quants);
        for k in 0..4 {
            acc[k] = token(acc[k], &p, x[k], i, f);
        }
    }
    acc.map(|a| _mm512_reduce_add_ps(a))
}

/// Rows `w` (`out.len() / xs.len()` rows of `row_bytes`) against a batch of decode tokens
/// `xs`, `out[r · xs.len() + t]` row `r` against token `t`: the batched decode step's
/// product, each (row, token) with [`row`]'s bits.
///
/// What a token contributes to a pair of blocks besides its quants (its two steps as a
/// register's halves, its block sums scaled for the format's minimum) does not depend on the
/// row, so it is made once per call (per task) into a small table instead of once per row;
/// each pair of weight blocks is unpacked once for up to eight tokens; the rows run one after
/// another in this one call, the next row's bytes prefetched. Made with the very operations
/// [`token`] uses, the table's vectors hold its values, so the bits are [`row`]'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) fn rows_batch(
    w: &[u8],
    row_bytes: usize,
    xs: &[Q8Row<'_>],
    out: &mut [f32],
    f: Format,
    quants: impl Fn(&[u8], &[u8]) -> __m512i + Copy,
) {
    let nb = row_bytes / f.bytes;
    let tokens = xs.len();
    if tokens == 0 || nb == 0 {
        return;
    }
    let n = out.len() / tokens;
    assert!(nb * f.bytes == row_bytes && w.len() >= n * row_bytes);
    for &x in xs {
        check(x, nb, f);
    }
    let pairs = nb.div_ceil(2);
    SCALES.with_borrow_mut(|table| {
        table.clear();
        table.resize(tokens * pairs, Scales::default());
        for (x, scales) in xs.iter().zip(table.chunks_exact_mut(pairs)) {
            for (j, sc) in scales.iter_mut().enumerate() {
                let (dx, s) = token_scales(*x, 2 * j, 2 * j + 1 < nb, f);
                // SAFETY: each store writes the 16 floats of one `[f32; 16]`.
                unsafe {
                    _mm512_storeu_ps(sc.dx.as_mut_ptr(), dx);
                    _mm512_storeu_ps(sc.s.as_mut_ptr(), s);
                }
            }
        }
        let table = &table[..];
        for (r, o) in out.chunks_exact_mut(tokens).enumerate() {
            let w = &w[r * row_bytes..][..row_bytes];
            let next = w.as_ptr().wrapping_add(row_bytes);
            let mut t = 0;
            while t < tokens {
                let (xs, sc, o) = (&xs[t..], &table[t * pairs..], &mut o[t..]);
                t += match tokens - t {
                    8.. => prepared::<8>(w, xs, sc, pairs, o, f, next, quants),
                    4.. => prepared::<4>(w, xs, sc, pairs, o, f, next, quants),
                    _ => prepared::<1>(w, xs, sc, pairs, o, f, next, quants),
                };
            }
        }
    });
}

/// One token's values for pair `j` of [`rows_batch`]'s table.
#[derive(Clone, Copy, Default)]
struct Scales {
    /// The token's two block steps, as [`token`]'s `dx`.
    dx: [f32; 16],
    /// Its two block sums, scaled as [`token`]'s `s`.
    s: [f32; 16],
}

thread_local! {
    /// [`rows_batch`]'s table, `tokens × pairs`; only grows.
    static SCALES: std::cell::RefCell<Vec<Scales>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`token`]'s `dx` and `s` for pair `i`, `i + 1` (block `i` alone where `!two`) of `x`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn token_scales(x: Q8Row<'_>, i: usize, two: bool, f: Format) -> (__m512, __m512) {
    let (xd, xs) = (x.d.as_ptr(), x.sum.as_ptr());
    // SAFETY: as in `token` (the caller checked `x` with `check`).
    let (dx, s) = unsafe {
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
        (halves(pair(xd)), halves(s))
    };
    let s = match f.min {
        Min::None => s,
        Min::Offset(k) => _mm512_mul_ps(s, _mm512_set1_ps(k / 8.0)),
        Min::Stored => _mm512_mul_ps(s, _mm512_set1_ps(1.0 / 8.0)),
    };
    (dx, s)
}

/// Row `w` against the first `N` tokens of `xs` (their `pairs` entries of the table each in
/// `sc`), into `out[..N]`; returns `N`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn prepared<const N: usize>(
    w: &[u8],
    xs: &[Q8Row<'_>],
    sc: &[Scales],
    pairs: usize,
    out: &mut [f32],
    f: Format,
    next: *const u8,
    quants: impl Fn(&[u8], &[u8]) -> __m512i,
) -> usize {
    let nb = w.len() / f.bytes;
    assert!(xs.len() >= N && sc.len() >= N * pairs && out.len() >= N && pairs == nb.div_ceil(2));
    let xq: [*const i8; N] = std::array::from_fn(|k| xs[k].qs.as_ptr());
    let mut acc = [_mm512_setzero_ps(); N];
    for j in 0..pairs {
        let i = 2 * j;
        _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(i * f.bytes).cast());
        let p = pair(w, i, nb, f, &quants);
        for k in 0..N {
            // SAFETY: `check` held token `k`'s `qs` to `nb · 32` bytes (only block `i`'s 32
            // are read where it is the last, alone); its table entry `j` is in `sc` (the
            // assert above).
            let (xv, s) = unsafe {
                let xv = if p.two {
                    _mm512_loadu_si512(xq[k].add(i * QK).cast())
                } else {
                    _mm512_maskz_loadu_epi8(0xffff_ffff, xq[k].add(i * QK))
                };
                (xv, sc.get_unchecked(k * pairs + j))
            };
            // SAFETY: 16 floats of a `[f32; 16]` each.
            let (dx, s) = unsafe {
                (
                    _mm512_loadu_ps(s.dx.as_ptr()),
                    _mm512_loadu_ps(s.s.as_ptr()),
                )
            };
            acc[k] = accumulate(acc[k], &p, xv, dx, s, f);
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = _mm512_reduce_add_ps(a);
    }
    N
}

/// A pair of weight blocks, unpacked once for any number of tokens.
struct Pair {
    /// Their 64 quants (magnitudes where the format is signed).
    q: __m512i,
    /// Where the format is signed, the quants' signs.
    signs: __mmask64,
    /// The first block's f16 step in the low eight lanes, the second's in the high eight.
    dw: __m512,
    /// As `dw`, their minimums (`Min::Stored`; zero otherwise).
    mw: __m512,
    /// Whether there are two blocks (else block `i` alone: the row's last, odd count).
    two: bool,
}

/// Blocks `i` and `i + 1` of `w` (`nb` blocks); the last block alone pairs with itself,
/// and [`token`] gives its second half zero activations.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn pair(
    w: &[u8],
    i: usize,
    nb: usize,
    f: Format,
    quants: impl Fn(&[u8], &[u8]) -> __m512i,
) -> Pair {
    let two = i + 1 < nb;
    let a = &w[i * f.bytes..][..f.bytes];
    let b = if two {
        &w[(i + 1) * f.bytes..][..f.bytes]
    } else {
        a
    };
    let q = quants(a, b);
    let (q, signs) = if f.signed {
        (_mm512_abs_epi8(q), _mm512_movepi8_mask(q))
    } else {
        (q, 0)
    };
    let mw = if f.min == Min::Stored {
        f16_halves(a, b, 2)
    } else {
        _mm512_setzero_ps()
    };
    Pair {
        q,
        signs,
        dw: f16_halves(a, b, 0),
        mw,
        two,
    }
}

/// `acc` plus pair `p` (blocks `i`, `i + 1`) against token `x`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn token(acc: __m512, p: &Pair, x: Q8Row<'_>, i: usize, f: Format) -> __m512 {
    // SAFETY: `i + 1 < nb` where `two` (else only block `i`'s 32 bytes are read), and
    // `row`/`row4` checked `x.qs` for `nb · 32` bytes (`check`) before calling this.
    let xv = unsafe {
        let xq = x.qs.as_ptr();
        if p.two {
            _mm512_loadu_si512(xq.add(i * QK).cast())
        } else {
            _mm512_maskz_loadu_epi8(0xffff_ffff, xq.add(i * QK))
        }
    };
    let (dx, s) = token_scales(x, i, p.two, f);
    accumulate(acc, p, xv, dx, s, f)
}

/// `acc` plus pair `p` against a token's 64 activations `xv`, its steps `dx` and scaled
/// sums `s` (as [`token`] makes them): the arithmetic every path shares.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn accumulate(acc: __m512, p: &Pair, xv: __m512i, dx: __m512, s: __m512, f: Format) -> __m512 {
    let xv = if f.signed {
        _mm512_mask_sub_epi8(xv, p.signs, _mm512_setzero_si512(), xv)
    } else {
        xv
    };
    let prod = _mm512_dpbusd_epi32(_mm512_setzero_si512(), p.q, xv);
    let (t, acc) = match f.min {
        Min::None => (_mm512_mul_ps(dx, _mm512_cvtepi32_ps(prod)), acc),
        Min::Offset(_) => (_mm512_fmadd_ps(dx, _mm512_cvtepi32_ps(prod), s), acc),
        Min::Stored => (
            _mm512_mul_ps(dx, _mm512_cvtepi32_ps(prod)),
            _mm512_fmadd_ps(p.mw, s, acc),
        ),
    };
    _mm512_fmadd_ps(p.dw, t, acc)
}

/// The f16 at `at` of `a` in the low eight lanes, of `b` in the high eight.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn f16_halves(a: &[u8], b: &[u8], at: usize) -> __m512 {
    let h = |v: &[u8]| _mm_set1_epi16(i16::from_le_bytes([v[at], v[at + 1]]));
    _mm512_cvtph_ps(_mm256_set_m128i(h(b), h(a)))
}

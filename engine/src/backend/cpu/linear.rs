//! `y = W·x` on the cpu backend: the activations quantized once per op into a reused
//! scratch, then integer dot products against the weights in place, spread over the pool.
//!
//! Decode (few tokens) splits the output rows into tiles, one task each; a batch of several
//! sequences' decode tokens hands a task's rows to one call of the batch kernel where the
//! instruction set has one (`Isa::batch`), which streams each row once for all the tokens
//! with the one-token kernel's bits. Prefill (more than
//! `DECODE_TOKENS`) takes 16 weight rows per task, unpacks them once into a tile whose
//! vectors hold four elements of each of the 16 rows (`dot/tile.rs`), and runs every token
//! of the prompt against it while it sits in L1, eight tokens per pass on AVX-512 (four or two
//! per pass in wasm SIMD, `dot/simd128_tile.rs`). Where an instruction set has no tile kernel
//! (NEON, the scalar reference; Q8_0 in wasm) prefill splits the tokens into blocks instead
//! and walks the weights a tile of rows at a time, four tokens per weight block where a
//! four-token kernel exists.

use super::dot::tile::{self, Acts, TILE, Tile};
use super::dot::{Isa, TileFn};
use super::q8::{Layout, Q8, Q8Row, Source};
use crate::kernels::linear as reference;
use crate::quant::GgmlType;

/// Weight rows per tile: with the widest rows of small models (a few KiB) a tile stays
/// within L1/L2 while a block of tokens runs against it.
const TILE_ROWS: usize = 16;
/// At or below this many tokens (a decode step, or a batch of sequences' decode steps) an op
/// is split by output rows, each weight row read once for every token.
const DECODE_TOKENS: usize = 32;

/// Below this much work (multiply-adds) the pool costs more than it saves.
#[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
const PARALLEL_WORK: usize = 1 << 16;

/// `y[t, r] = Σ_c w[r, c] · x[t, c]`, as [`reference::linear`] computes it but with the
/// activations rounded to int8 per block (see `q8` for the bound that puts on the result).
/// Float weights take the reference path.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    isa: Isa,
    scratch: &mut Q8,
    source: Option<Source>,
    wtype: GgmlType,
    w: &[u8],
    x: &[f32],
    y: &mut [f32],
    rows: usize,
    cols: usize,
    tokens: usize,
) {
    linear_with(
        tiles(),
        isa,
        (scratch, source),
        wtype,
        w,
        x,
        y,
        [rows, cols, tokens],
    );
}

/// [`linear`] with the prompts over tiles chosen by the caller (the tests run every mode).
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_with(
    tiles: Tiles,
    isa: Isa,
    (scratch, source): (&mut Q8, Option<Source>),
    wtype: GgmlType,
    w: &[u8],
    x: &[f32],
    y: &mut [f32],
    [rows, cols, tokens]: [usize; 3],
) {
    let Some((dot, layout)) = isa
        .dot(wtype)
        .filter(|(_, l)| cols.is_multiple_of(l.block()))
    else {
        return reference::linear(wtype, w, x, y, rows, cols, tokens);
    };
    let Some(row_bytes) = wtype.row_bytes(cols) else {
        return reference::linear(wtype, w, x, y, rows, cols, tokens);
    };
    if rows == 0 || tokens == 0 {
        return;
    }
    scratch.quantize_from(source, layout, x, cols, tokens);
    let q8: &Q8 = scratch;
    let wrow = |r: usize| &w[r * row_bytes..][..row_bytes];
    let work = rows * cols * tokens;
    let y = &mut y[..rows * tokens];

    // Each product plus what its token's outliers add (q8's module comment); only
    // super-blocks have them, and the 32-element formats' products stay as they were.
    let outliers = layout == Layout::Super256;
    let dot = move |w: &[u8], x: Q8Row<'_>| {
        let v = dot(w, x);
        if outliers {
            v + outlier_products(wtype, w, x)
        } else {
            v
        }
    };
    let dot4 = isa.dot4(wtype).map(|dot4| {
        move |w: &[u8], xs: [Q8Row<'_>; 4]| {
            let mut out = dot4(w, xs);
            if outliers {
                for (o, x) in out.iter_mut().zip(xs) {
                    *o += outlier_products(wtype, w, x);
                }
            }
            out
        }
    });
    let tile = tile_rows(rows);
    if tokens == 1 {
        let x = q8.row(0);
        // The 32-element formats have no outliers: a task's rows go to one call.
        if let Some(rows) = isa.rows(wtype).filter(|_| !outliers && decode_rows()) {
            par_chunks(y, tile, work, |first, out| {
                rows(&w[first * row_bytes..], row_bytes, x, out);
            });
            return;
        }
        par_chunks(y, tile, work, |first, out| {
            for (j, o) in out.iter_mut().enumerate() {
                *o = dot(wrow(first + j), x);
            }
        });
        return;
    }
    if tokens <= DECODE_TOKENS {
        // A batch of decode steps: tiles of weight rows, each row against every token (four
        // at a time), so the weights stream once for the whole batch. The tokens' rows (and
        // their groups of four) are built once per op, not once per weight row: with the short
        // rows of small models, building and moving them per row cost as much as the products.
        let xs: [Q8Row<'_>; DECODE_TOKENS] = std::array::from_fn(|t| q8.row(t.min(tokens - 1)));
        // Where the instruction set has a batch kernel, a task's rows go to one call of it.
        if let Some(batch) = isa.batch(wtype).filter(|_| !outliers && decode_batch()) {
            let xs = &xs[..tokens];
            let len = y.len();
            let out = ChunkBase(y.as_mut_ptr());
            par_tasks(rows.div_ceil(tile), work, |i| {
                let (r0, r1) = (i * tile, ((i + 1) * tile).min(rows));
                BATCH_OUT.with_borrow_mut(|res| {
                    res.resize((r1 - r0) * tokens, 0.0);
                    batch(&w[r0 * row_bytes..r1 * row_bytes], row_bytes, xs, res);
                    for (j, per_token) in res.chunks_exact(tokens).enumerate() {
                        for (t, &v) in per_token.iter().enumerate() {
                            let at = t * rows + r0 + j;
                            assert!(at < len);
                            // SAFETY: task `i` alone writes rows `r0..r1` of each token,
                            // inside `y` (checked above), and `y` is borrowed while the
                            // tasks run.
                            unsafe { *out.at(at) = v };
                        }
                    }
                });
            });
            return;
        }
        let quads = if dot4.is_some() { tokens / 4 } else { 0 };
        let groups: [[Q8Row<'_>; 4]; DECODE_TOKENS / 4] =
            std::array::from_fn(|g| std::array::from_fn(|k| xs[(4 * g + k).min(tokens - 1)]));
        let (groups, singles) = (&groups[..quads], &xs[4 * quads..tokens]);
        let len = y.len();
        let out = ChunkBase(y.as_mut_ptr());
        par_tasks(rows.div_ceil(tile), work, |i| {
            let mut per_token = [0.0f32; DECODE_TOKENS];
            for r in i * tile..((i + 1) * tile).min(rows) {
                let w = wrow(r);
                if let Some(dot4) = dot4 {
                    for (g, x4) in groups.iter().enumerate() {
                        per_token[4 * g..][..4].copy_from_slice(&dot4(w, *x4));
                    }
                }
                for (t, x) in singles.iter().enumerate() {
                    per_token[4 * quads + t] = dot(w, *x);
                }
                for (t, &v) in per_token[..tokens].iter().enumerate() {
                    let at = t * rows + r;
                    assert!(at < len);
                    // SAFETY: task `i` alone writes row `r` (one of its rows) of each token,
                    // inside `y` (checked above), and `y` is borrowed while the tasks run.
                    unsafe { *out.at(at) = v };
                }
            }
        });
        return;
    }

    // The K-quants stay on the token-block path unless `CAIRN_CPU_TILES=all`. Their tiles
    // give what the scalar kernel gives (1e-7 of Σ|w·x| on every K-quant matrix of the
    // Q4_K_M file, outliers included; cpu/tests.rs
    // `prefill_over_tiles_matches_the_scalar_kernel_on_the_models_shapes`), but any change of
    // summation order moves this model's top-2 margins by up to 1.1 (AVX2 against AVX-512 on
    // this path; tiles against it up to 0.8), and with the tiles the teacher-forced test
    // against llama.cpp (q4_k_m_from_cairn_quantize_matches_llama_cpp_on_every_backend) lands
    // on the wrong side of russian position 27, a near tie in every one of Cairn's
    // arithmetics (margins -0.03 to +0.07; llama.cpp's own 0.80, on f32 products 0.32).
    // docs/performance.md, "The K-quant tiles' firm miss". On AVX-512 that path runs Q4_K and
    // Q6_K four tokens at a time with the one-token kernels' bits (`dot/avx512/kquants.rs`):
    // 1.5x less CPU per prompt token on that file than one token at a time (session 18).
    let k_quant = matches!(
        wtype,
        GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K
    );
    if let Some((kernel, format)) = isa
        .tile(wtype)
        .filter(|_| tiles == Tiles::All || (tiles == Tiles::On && !k_quant))
    {
        let tiled = Tiled {
            isa,
            kernel,
            format,
            wtype,
            w,
            row_bytes,
            q8,
            outliers,
        };
        return tiled.run(y, rows, tokens, work);
    }

    let per = tokens.div_ceil(threads() * 2).max(1);
    par_chunks(y, per * rows, work, |first, out| {
        let t0 = first / rows;
        for r0 in (0..rows).step_by(TILE_ROWS) {
            let r1 = (r0 + TILE_ROWS).min(rows);
            let n = out.len() / rows;
            let mut j = 0;
            if let Some(dot4) = dot4 {
                while j + 4 <= n {
                    let xs: [_; 4] = std::array::from_fn(|k| q8.row(t0 + j + k));
                    for r in r0..r1 {
                        for (k, v) in dot4(wrow(r), xs).into_iter().enumerate() {
                            out[(j + k) * rows + r] = v;
                        }
                    }
                    j += 4;
                }
            }
            for (jj, yt) in out.chunks_exact_mut(rows).enumerate().skip(j) {
                let x = q8.row(t0 + jj);
                for (r, o) in yt[r0..r1].iter_mut().enumerate() {
                    *o = dot(wrow(r0 + r), x);
                }
            }
        }
    });
}

thread_local! {
    /// A prefill task's unpacked tile and its results (`tokens × 16`); only grow.
    static TILE_SCRATCH: std::cell::RefCell<(Tile, Vec<[f32; TILE]>)> =
        std::cell::RefCell::new((Tile::default(), Vec::new()));
    /// A batched decode task's results, row-major (`rows × tokens`); only grows.
    static BATCH_OUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The K-quants' activations in pieces of 32 or 16 (`Acts::new`), on the op's thread.
    static PIECES: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// A prompt's product over unpacked tiles (`dot/tile.rs`): one task per 16 weight rows,
/// which unpacks them once and runs every token of the prompt against them.
struct Tiled<'a> {
    isa: Isa,
    kernel: TileFn,
    format: tile::Format,
    wtype: GgmlType,
    w: &'a [u8],
    row_bytes: usize,
    q8: &'a Q8,
    /// Whether tokens may carry outliers (the 256-element layout).
    outliers: bool,
}

impl Tiled<'_> {
    fn run(&self, y: &mut [f32], rows: usize, tokens: usize, work: usize) {
        PIECES.with_borrow_mut(|(d, s)| {
            let x = Acts::new(self.q8, self.format.sub, tokens, d, s);
            // Tokens with outliers, and their rows of the op's activations.
            let with_outliers: Vec<(usize, Q8Row<'_>)> = (0..tokens)
                .filter(|_| self.outliers)
                .map(|t| (t, self.q8.row(t)))
                .filter(|(_, r)| !r.outliers.is_empty())
                .collect();
            let len = y.len();
            let out = ChunkBase(y.as_mut_ptr());
            par_tasks(rows.div_ceil(TILE), work, |i| {
                let (r0, r1) = (i * TILE, ((i + 1) * TILE).min(rows));
                TILE_SCRATCH.with_borrow_mut(|(tile, res)| {
                    (self.isa).fill_tile(tile, self.format, self.w, self.row_bytes, r0..r1);
                    res.resize(tokens, [0.0; TILE]);
                    (self.kernel)(tile, &x, 0..tokens, res);
                    for &(t, xt) in &with_outliers {
                        for (r, v) in (r0..r1).zip(res[t].iter_mut()) {
                            let wr = &self.w[r * self.row_bytes..][..self.row_bytes];
                            *v += outlier_products(self.wtype, wr, xt);
                        }
                    }
                    for (t, v) in res.iter().enumerate() {
                        let at = t * rows + r0;
                        assert!(at + (r1 - r0) <= len);
                        // SAFETY: task `i` alone writes rows `r0..r1` of each token (inside
                        // `y`, checked above), and `y` is borrowed while the tasks run.
                        let o = unsafe { std::slice::from_raw_parts_mut(out.at(at), r1 - r0) };
                        if let Ok(o) = <&mut [f32; TILE]>::try_from(&mut *o) {
                            // A whole tile's 64 bytes as a fixed-size copy: the compiler
                            // moves them in registers, where a copy of a run-time length
                            // was a call (wasm's `memory.copy` is one into the browser).
                            *o = *v;
                        } else {
                            o.copy_from_slice(&v[..r1 - r0]);
                        }
                    }
                });
            });
        });
    }
}

/// Which prompts run over tiles.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Tiles {
    /// `CAIRN_CPU_TILES=off`: none (token blocks and the four-token kernels, as before the
    /// tiles), to measure one against the other in one binary as `CAIRN_CPU_ISA` does for
    /// instruction sets.
    Off,
    /// The default: the 32-element formats.
    On,
    /// `CAIRN_CPU_TILES=all`: the K-quants too (see `linear`).
    All,
}

fn tiles() -> Tiles {
    static CHOSEN: std::sync::OnceLock<Tiles> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| match std::env::var("CAIRN_CPU_TILES").as_deref() {
        Ok("off") => Tiles::Off,
        Ok("all") => Tiles::All,
        _ => Tiles::On,
    })
}

/// Whether decode hands a task's rows to one call of the several-row kernels where they exist
/// (by default; `CAIRN_CPU_ROWS=off`: one call of the one-row kernel per row, to compare the
/// two in one binary). Both give every row the same bits (`dot/avx512/rows.rs`). One thread,
/// CPU time per decode token at load 3.3 to 3.6: Q4_K_M 8.9 to 9.3 ms against 10.6 to 11.3,
/// Q4_1 9.6 against 11.1 to 11.4 (docs/performance.md, issue 20 session 17).
fn decode_rows() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| std::env::var("CAIRN_CPU_ROWS").as_deref() != Ok("off"))
}

/// Whether a batch of decode tokens goes to the instruction set's batch kernel where it has
/// one (by default; `CAIRN_CPU_BATCH=off`: the four-token kernel per row and group of four,
/// as before, to compare the two in one binary). Both give every (row, token) the same bits.
fn decode_batch() -> bool {
    static CHOSEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOSEN.get_or_init(|| std::env::var("CAIRN_CPU_BATCH").as_deref() != Ok("off"))
}

/// Runs `f(i)` for `i < tasks`, on the team (or the pool) when `work` pays for it.
pub(super) fn par_tasks(tasks: usize, work: usize, f: impl Fn(usize) + Sync) {
    #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
    if work >= PARALLEL_WORK && tasks > 1 {
        if let Some(team) = super::team::team()
            && team.run(tasks, &f)
        {
            return;
        }
        #[cfg(not(target_arch = "wasm32"))]
        if let Some(pool) = reference::pool() {
            use rayon::prelude::*;
            pool.install(|| (0..tasks).into_par_iter().for_each(&f));
            return;
        }
    }
    let _ = work;
    (0..tasks).for_each(f);
}

/// The part of `w · x` that `x`'s int8 values leave out: each outlier's rest times its
/// weight, decoded alone.
pub(super) fn outlier_products(wtype: GgmlType, w: &[u8], x: Q8Row<'_>) -> f32 {
    x.outliers
        .iter()
        .map(|o| crate::quant::element(wtype, w, o.col as usize) * o.rest)
        .sum()
}

/// Rows per decode task: a few tasks per thread, so one preempted thread does not hold up
/// the op, but never tiles so small that scheduling dominates.
fn tile_rows(rows: usize) -> usize {
    rows.div_ceil(threads() * 4).max(TILE_ROWS)
}

fn threads() -> usize {
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(pool) = reference::pool() {
        return pool.current_num_threads();
    }
    1
}

/// Calls `f(first_index, chunk)` for `chunk`-sized pieces of `out`, on the pool when `work`
/// pays for it.
pub(super) fn par_chunks(
    out: &mut [f32],
    chunk: usize,
    work: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    let chunk = chunk.max(1);
    #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
    if let Some(team) = super::team::team().filter(|_| work >= PARALLEL_WORK && out.len() > chunk) {
        let len = out.len();
        let base = ChunkBase(out.as_mut_ptr());
        let ran = team.run(len.div_ceil(chunk), &|i| {
            let first = i * chunk;
            // SAFETY: task `i` alone takes `out[first..first + chunk]` (clipped to `out`),
            // and `out` is borrowed for as long as `run` runs.
            let c =
                unsafe { std::slice::from_raw_parts_mut(base.at(first), chunk.min(len - first)) };
            f(first, c);
        });
        if ran {
            return;
        }
    }
    // The team was taken (another thread's op, or this is one of its tasks): rayon's pool.
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(pool) = reference::pool().filter(|_| work >= PARALLEL_WORK && out.len() > chunk) {
        use rayon::prelude::*;
        pool.install(|| {
            out.par_chunks_mut(chunk)
                .enumerate()
                .for_each(|(i, c)| f(i * chunk, c));
        });
        return;
    }
    let _ = work;
    for (i, c) in out.chunks_mut(chunk).enumerate() {
        f(i * chunk, c);
    }
}

/// Where `par_chunks`' (or a prefill's) output starts, shared by its tasks (each writes its
/// own piece).
struct ChunkBase(*mut f32);

// SAFETY: the tasks that share it write disjoint pieces (see `par_chunks`, `Tiled::run` and
// the decode batch in `linear`).
unsafe impl Sync for ChunkBase {}

impl ChunkBase {
    /// # Safety
    /// `first` is within the output.
    unsafe fn at(&self, first: usize) -> *mut f32 {
        // SAFETY: the caller's.
        unsafe { self.0.add(first) }
    }
}

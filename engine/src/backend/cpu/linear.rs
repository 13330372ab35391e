//! `y = W·x` on the cpu backend: the activations quantized once per op into a reused
//! scratch, then integer dot products against the weights in place, spread over the pool.
//!
//! Decode (few tokens) splits the output rows into tiles, one task each. Prefill splits the
//! tokens into blocks, one task each, and inside a task walks the weights a tile of rows at
//! a time, running every token of the block against a tile while it sits in cache: each
//! weight byte is fetched from memory once per block of tokens, not once per token.

use super::dot::Isa;
use super::q8::Q8;
use crate::kernels::linear as reference;
use crate::quant::GgmlType;

/// Weight rows per tile: with the widest rows of small models (a few KiB) a tile stays
/// within L1/L2 while a block of tokens runs against it.
const TILE_ROWS: usize = 16;
/// At or below this many tokens an op is split by output rows.
const DECODE_TOKENS: usize = 4;
/// Below this much work (multiply-adds) the pool costs more than it saves.
#[cfg(not(target_arch = "wasm32"))]
const PARALLEL_WORK: usize = 1 << 16;

/// `y[t, r] = Σ_c w[r, c] · x[t, c]`, as [`reference::linear`] computes it but with the
/// activations rounded to int8 per block (see `q8` for the bound that puts on the result).
/// Float weights take the reference path.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    isa: Isa,
    scratch: &mut Q8,
    wtype: GgmlType,
    w: &[u8],
    x: &[f32],
    y: &mut [f32],
    rows: usize,
    cols: usize,
    tokens: usize,
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
    scratch.quantize(layout, x, cols, tokens);
    let q8: &Q8 = scratch;
    let wrow = |r: usize| &w[r * row_bytes..][..row_bytes];
    let work = rows * cols * tokens;
    let y = &mut y[..rows * tokens];

    if tokens <= DECODE_TOKENS {
        // Each token's output row is split the same way; with one token that is `y`.
        let tile = tile_rows(rows);
        for (t, yt) in y.chunks_exact_mut(rows).enumerate() {
            let x = q8.row(t);
            par_chunks(yt, tile, work / tokens, |first, out| {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = dot(wrow(first + j), x);
                }
            });
        }
        return;
    }

    let dot4 = isa.dot4(wtype);
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

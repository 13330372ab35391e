//! Matrix products: f32 matmul, and `y = W·x` with f32, f16 or block-quantized weights.

use crate::quant::{GgmlType, dequantize_row};

/// `c[m×n] = a[m×k] · b[k×n]`.
pub fn matmul(a: &[f32], b: &[f32], c: &mut [f32], m: usize, n: usize, k: usize) {
    for_each_chunk(c, n, m * n * k, |i, crow| {
        crow.fill(0.0);
        let arow = &a[i * k..][..k];
        for (p, &av) in arow.iter().enumerate() {
            let brow = &b[p * n..][..n];
            for (cv, bv) in crow.iter_mut().zip(brow) {
                *cv += av * bv;
            }
        }
    });
}

/// `y[t, r] = Σ_c w[r, c] · x[t, c]`; `w` holds `rows` rows of `cols` elements of `wtype`.
pub fn linear(
    wtype: GgmlType,
    w: &[u8],
    x: &[f32],
    y: &mut [f32],
    rows: usize,
    cols: usize,
    tokens: usize,
) {
    let row_bytes = wtype.row_bytes(cols).unwrap_or(0);
    // Work is split over output rows; `y` is token-major, so each worker writes a
    // transposed tile and we scatter afterwards. For decode (one token) the tile is `y`.
    let mut yt = vec![0f32; rows * tokens];
    for_each_row_with(
        &mut yt,
        tokens,
        rows * cols * tokens,
        || vec![0f32; cols],
        |r, out, deq| {
            dequantize_row(wtype, &w[r * row_bytes..][..row_bytes], deq);
            for (t, o) in out.iter_mut().enumerate() {
                *o = dot(deq, &x[t * cols..][..cols]);
            }
        },
    );
    for r in 0..rows {
        for t in 0..tokens {
            y[t * rows + r] = yt[r * tokens + t];
        }
    }
}

/// Eight partial sums let the compiler vectorize without reassociating floats itself.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() / 8 * 8);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// Calls `f(row_index, row)` for every `row_len`-sized row of `out`, on the CPU backend's
/// threads when the work (`flops`) is large enough to pay for them. `scratch()` makes one
/// working buffer per block of rows, handed to `f` for each row (so a per-row dequantized
/// copy is not allocated per row).
pub(crate) fn for_each_chunk<F>(out: &mut [f32], row_len: usize, flops: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    for_each_row_with(out, row_len, flops, || (), |i, r, _| f(i, r));
}

pub(crate) fn for_each_row_with<S, F>(
    out: &mut [f32],
    row_len: usize,
    flops: usize,
    scratch: impl Fn() -> S + Sync,
    f: F,
) where
    F: Fn(usize, &mut [f32], &mut S) + Sync,
{
    if row_len == 0 {
        return;
    }
    let serial = |out: &mut [f32], first: usize| {
        let mut s = scratch();
        for (j, r) in out.chunks_exact_mut(row_len).enumerate() {
            f(first + j, r, &mut s);
        }
    };
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(pool) = pool().filter(|_| flops >= 1 << 18) {
        use rayon::prelude::*;
        let n_rows = out.len() / row_len;
        // A few blocks per thread, so a thread that is preempted does not hold
        // up the op.
        let per = n_rows.div_ceil(pool.current_num_threads() * 4).max(1);
        pool.install(|| {
            out.par_chunks_mut(per * row_len)
                .enumerate()
                .for_each(|(ci, block)| serial(block, ci * per));
        });
        return;
    }
    let _ = flops;
    serial(out, 0);
}

/// The CPU backend's threads, started once per process: by the first cpu device opened
/// (`EngineOptions::cpu_threads`), else on first use with one per core.
#[cfg(not(target_arch = "wasm32"))]
static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();

/// Starts the pool with `threads` (`None`: one per core) unless it is already running.
pub(crate) fn start_pool(threads: Option<usize>) {
    #[cfg(not(target_arch = "wasm32"))]
    POOL.get_or_init(|| make_pool(threads));
    #[cfg(target_arch = "wasm32")]
    let _ = threads;
}

/// `None` when there is one thread.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn pool() -> Option<&'static rayon::ThreadPool> {
    POOL.get_or_init(|| make_pool(None)).as_ref()
}

#[cfg(not(target_arch = "wasm32"))]
fn make_pool(threads: Option<usize>) -> Option<rayon::ThreadPool> {
    let n = threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    if n == 1 {
        return None;
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("cairn-cpu-{i}"))
        .build()
        .ok()
}

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
    for_each_chunk(&mut yt, tokens, rows * cols * tokens, |r, out| {
        let mut deq = vec![0f32; cols];
        dequantize_row(wtype, &w[r * row_bytes..][..row_bytes], &mut deq);
        for (t, o) in out.iter_mut().enumerate() {
            *o = dot(&deq, &x[t * cols..][..cols]);
        }
    });
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

/// Calls `f(row_index, row)` for every `row_len`-sized row of `out`, on several threads when
/// the work (`flops`) is large enough to pay for them.
pub(crate) fn for_each_chunk<F>(out: &mut [f32], row_len: usize, flops: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    if row_len == 0 {
        return;
    }
    let threads = worker_threads();
    if threads <= 1 || flops < 1 << 18 {
        out.chunks_exact_mut(row_len)
            .enumerate()
            .for_each(|(i, r)| f(i, r));
        return;
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        let n_rows = out.len() / row_len;
        let per = n_rows.div_ceil(threads);
        std::thread::scope(|s| {
            for (ci, chunk) in out.chunks_mut(per * row_len).enumerate() {
                let f = &f;
                s.spawn(move || {
                    for (j, r) in chunk.chunks_exact_mut(row_len).enumerate() {
                        f(ci * per + j, r);
                    }
                });
            }
        });
    }
}

fn worker_threads() -> usize {
    #[cfg(not(target_arch = "wasm32"))]
    {
        use std::sync::OnceLock;
        static N: OnceLock<usize> = OnceLock::new();
        *N.get_or_init(|| {
            std::env::var("CAIRN_CPU_THREADS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
                .max(1)
        })
    }
    #[cfg(target_arch = "wasm32")]
    {
        1
    }
}

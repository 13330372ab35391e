//! Causal grouped-query attention as [`crate::kernels::attention::attention`] computes it.
//!
//! A task is one token and one or more query heads of the same key/value head: with many
//! tasks to go round (a batch of sequences, a prompt) each takes a whole group of heads, so
//! every key and value row is read from memory once for the group and then from cache; with
//! few (one decode token) each takes one head, so both threads have work. A token's keys
//! come as runs of contiguous rows (the whole range of a dense cache, one block at a time of
//! a paged pool), and the score and weighted-sum loops run over a run at once
//! (`VecF32::dots`, `axpys`). Scores live in a per-thread buffer that only grows.

use std::cell::RefCell;
use std::ops::Range;

use super::linear::par_chunks;
use super::vecf32::VecF32;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static RUNS: RefCell<Vec<(usize, usize)>> = const { RefCell::new(Vec::new()) };
}

/// `shape`: heads, kv_heads, head_dim, tokens, pos0, window, as in
/// [`crate::kernels::Attention`]; `scale`: its scale and soft cap.
pub(crate) fn attention(
    v: &VecF32,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    out: &mut [f32],
    [heads, kv_heads, head_dim, tokens, pos0, window]: [usize; 6],
    scale: [f32; 2],
) {
    let shape = [heads, kv_heads, head_dim, tokens];
    let work = tokens * heads * (pos0 + tokens) * head_dim * 2;
    let first_key = crate::kernels::attention::first_key;
    attend(
        v,
        q,
        k_cache,
        v_cache,
        out,
        shape,
        scale,
        work,
        |t, runs| {
            let keys = first_key(pos0 + t + 1, window)..pos0 + t + 1;
            runs.push((keys.start, keys.len()));
        },
    );
}

/// [`crate::kernels::PagedAttention`]: token `t` attends to its keys `keys(t)`, key `j` of
/// them in row `table(t, j / block) · block + j % block` of the pools. Every index was
/// checked by the caller.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention(
    v: &VecF32,
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    out: &mut [f32],
    shape: [usize; 4],
    scale: [f32; 2],
    block: usize,
    keys: impl Fn(usize) -> Range<usize> + Sync,
    table: impl Fn(usize, usize) -> usize + Sync,
) {
    let [heads, _, head_dim, tokens] = shape;
    let block = block.max(1);
    let work = (0..tokens).map(|t| keys(t).len()).sum::<usize>() * heads * head_dim * 2;
    attend(v, q, k_pool, v_pool, out, shape, scale, work, |t, runs| {
        let keys = keys(t);
        let mut j = keys.start;
        while j < keys.end {
            let b = j / block;
            let end = keys.end.min((b + 1) * block);
            runs.push((table(t, b) * block + j % block, end - j));
            j = end;
        }
    });
}

/// Query heads per task: a whole group once there are enough tasks for every thread.
fn heads_per_task(heads: usize, kv_heads: usize, tokens: usize) -> usize {
    let kv_heads = kv_heads.max(1);
    if !heads.is_multiple_of(kv_heads) {
        return 1;
    }
    #[cfg(not(target_arch = "wasm32"))]
    let threads = crate::kernels::linear::pool().map_or(1, |p| p.current_num_threads());
    #[cfg(target_arch = "wasm32")]
    let threads = 1;
    if tokens * kv_heads >= 2 * threads {
        heads / kv_heads
    } else {
        1
    }
}

/// `runs(t, into)` appends token `t`'s keys as `(first row, rows)` runs, in key order.
#[allow(clippy::too_many_arguments)]
fn attend(
    v: &VecF32,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    out: &mut [f32],
    [heads, kv_heads, head_dim, tokens]: [usize; 4],
    [scale, softcap]: [f32; 2],
    work: usize,
    runs: impl Fn(usize, &mut Vec<(usize, usize)>) + Sync,
) {
    if head_dim == 0 || heads == 0 {
        return;
    }
    let group = (heads / kv_heads.max(1)).max(1);
    let kv_stride = kv_heads * head_dim;
    let per_task = heads_per_task(heads, kv_heads, tokens);
    let out = &mut out[..tokens * heads * head_dim];
    par_chunks(out, per_task * head_dim, work, |first, o| {
        let th = first / head_dim;
        let (t, h0) = (th / heads, th % heads);
        let nh = o.len() / head_dim;
        let kvh = h0 / group;
        let kv_col = kvh * head_dim;
        RUNS.with_borrow_mut(|rs| {
            SCORES.with_borrow_mut(|scores| {
                rs.clear();
                runs(t, rs);
                let n: usize = rs.iter().map(|r| r.1).sum();
                scores.clear();
                scores.resize(nh * n, 0.0);
                // Each run's keys against every head of the task while they sit in cache.
                let mut at = 0;
                for &(row, len) in rs.iter() {
                    let keys = &k_cache[row * kv_stride + kv_col..];
                    for j in 0..nh {
                        let qv = &q[(th + j) * head_dim..][..head_dim];
                        (v.dots)(qv, keys, kv_stride, &mut scores[j * n + at..][..len]);
                    }
                    at += len;
                }
                for s in scores.chunks_exact_mut(n.max(1)) {
                    let mut max = f32::NEG_INFINITY;
                    for x in s.iter_mut() {
                        *x = crate::kernels::attention::cap_score(*x * scale, softcap);
                        max = max.max(*x);
                    }
                    // In wasm SIMD, four at a time (`exp_simd128`): a libm call per score
                    // there.
                    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
                    let sum = super::exp_simd128::exp_minus(s, max);
                    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
                    let sum = {
                        let mut sum = 0.0;
                        for x in s.iter_mut() {
                            *x = (*x - max).exp();
                            sum += *x;
                        }
                        sum
                    };
                    let inv = 1.0 / sum;
                    for x in s.iter_mut() {
                        *x *= inv;
                    }
                }
                o.fill(0.0);
                let mut at = 0;
                for &(row, len) in rs.iter() {
                    let values = &v_cache[row * kv_stride + kv_col..];
                    for (j, oh) in o.chunks_exact_mut(head_dim).enumerate() {
                        (v.axpys)(oh, &scores[j * n + at..][..len], values, kv_stride);
                    }
                    at += len;
                }
            });
        });
    });
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::backend::cpu::dot::Isa;
    use crate::kernels::paged::{self, PagedAttentionParams};

    /// Several sequences' keys over shuffled blocks of a pool, as a batched pass sees them,
    /// against the reference paged attention: one decode token each (one head per task) and
    /// several tokens each (a group of heads per task), grouped heads, head sizes on and off
    /// the vector width, a window and a soft cap, sequences ending mid-block and on a block's
    /// edge. Tolerance 1e-5: f32 sums in another order.
    #[test]
    fn paged_attention_matches_the_reference() {
        crate::kernels::linear::start_pool(Some(3));
        let mut rng = StdRng::seed_from_u64(27);
        let v = VecF32::new(Isa::detect());
        let block = 16;
        for (heads, kv_heads, head_dim, per_seq, window, softcap) in [
            (9, 3, 64, 1, 0, 0.0),
            (9, 3, 64, 5, 0, 0.0),
            (6, 2, 33, 1, 20, 0.5),
            (6, 2, 33, 4, 7, 0.0),
            (4, 4, 12, 3, 0, 0.5),
            (2, 1, 128, 12, 5, 0.0),
            (4, 2, 128, 1, 5, 0.0),
        ] {
            // Keys per sequence: past `per_seq` new rows, these many positions.
            let lens = [1usize, 16, 37, 64];
            let blocks: usize = lens.iter().map(|n| n.div_ceil(block)).sum();
            let pool_blocks = blocks + 3;
            let mut order: Vec<u32> = (0..pool_blocks as u32).collect();
            order.shuffle(&mut rng);
            let mut table = Vec::new();
            let mut rows = Vec::new();
            for &n in &lens {
                let start = table.len() as u32;
                table.extend_from_slice(&order[..n.div_ceil(block)]);
                order.drain(..n.div_ceil(block));
                // The sequence's last `per_seq` positions are this pass's tokens.
                for j in n.saturating_sub(per_seq)..n {
                    rows.extend_from_slice(&[start, j as u32 + 1]);
                }
            }
            let tokens = rows.len() / 2;
            let kv_stride = kv_heads * head_dim;
            let mut r =
                |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
            let q = r(tokens * heads * head_dim);
            let kp = r(pool_blocks * block * kv_stride);
            let vp = r(pool_blocks * block * kv_stride);
            let scale = 1.0 / (head_dim as f32).sqrt();
            let p = PagedAttentionParams {
                heads: heads as u32,
                kv_heads: kv_heads as u32,
                head_dim: head_dim as u32,
                tokens: tokens as u32,
                block: block as u32,
                pool_blocks: pool_blocks as u32,
                table_len: table.len() as u32,
                scale,
                window: window as u32,
                softcap,
                _pad0: 0,
                _pad1: 0,
            };
            let mut want = vec![0f32; q.len()];
            paged::paged_attention(&q, &kp, &vp, &rows, &table, &mut want, &p).unwrap();
            let mut got = vec![f32::NAN; q.len()];
            paged_attention(
                &v,
                &q,
                &kp,
                &vp,
                &mut got,
                [heads, kv_heads, head_dim, tokens],
                [scale, softcap],
                block,
                |t| {
                    let n = rows[2 * t + 1] as usize;
                    crate::kernels::attention::first_key(n, window)..n
                },
                |t, b| table[rows[2 * t] as usize + b] as usize,
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5,
                    "{heads}/{kv_heads}/{head_dim} {per_seq} per sequence w{window} at {i}: {g} vs {w}"
                );
            }
        }
    }
}

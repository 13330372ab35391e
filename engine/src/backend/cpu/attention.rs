//! Causal grouped-query attention as [`crate::kernels::attention::attention`] computes it,
//! with every (token, head) an independent task on the pool and the score and weighted-sum
//! loops on the vectorized f32 helpers. Scores live in a per-thread buffer that only grows.

use std::cell::RefCell;
use std::ops::Range;

use super::linear::par_chunks;
use super::vecf32::VecF32;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
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
        |t| first_key(pos0 + t + 1, window)..pos0 + t + 1,
        |_, p| p,
    );
}

/// [`crate::kernels::PagedAttention`]: token `t` attends to its keys `keys(t)`, key `p` of it
/// in row `slot(t, p)` of the pools. Every index was checked by the caller.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention(
    v: &VecF32,
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    out: &mut [f32],
    shape: [usize; 4],
    scale: [f32; 2],
    keys: impl Fn(usize) -> Range<usize> + Sync,
    slot: impl Fn(usize, usize) -> usize + Sync,
) {
    let [heads, _, head_dim, tokens] = shape;
    let work = (0..tokens).map(|t| keys(t).len()).sum::<usize>() * heads * head_dim * 2;
    attend(v, q, k_pool, v_pool, out, shape, scale, work, keys, slot);
}

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
    keys: impl Fn(usize) -> Range<usize> + Sync,
    slot: impl Fn(usize, usize) -> usize + Sync,
) {
    if head_dim == 0 || heads == 0 {
        return;
    }
    let group = heads / kv_heads.max(1);
    let kv_stride = kv_heads * head_dim;
    let out = &mut out[..tokens * heads * head_dim];
    par_chunks(out, head_dim, work, |first, o| {
        let th = first / head_dim;
        let (t, h) = (th / heads, th % heads);
        let keys = keys(t);
        let kvh = h / group.max(1);
        let qv = &q[th * head_dim..][..head_dim];
        SCORES.with_borrow_mut(|scores| {
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in keys.clone() {
                let kv = &k_cache[slot(t, p) * kv_stride + kvh * head_dim..][..head_dim];
                let s = crate::kernels::attention::cap_score((v.dot)(qv, kv) * scale, softcap);
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            o.fill(0.0);
            for (p, s) in keys.zip(scores.iter()) {
                let vv = &v_cache[slot(t, p) * kv_stride + kvh * head_dim..][..head_dim];
                (v.axpy)(o, s / sum, vv);
            }
        });
    });
}

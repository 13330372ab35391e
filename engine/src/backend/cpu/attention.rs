//! Causal grouped-query attention as [`crate::kernels::attention::attention`] computes it,
//! with every (token, head) an independent task on the pool and the score and weighted-sum
//! loops on the vectorized f32 helpers. Scores live in a per-thread buffer that only grows.

use std::cell::RefCell;

use super::linear::par_chunks;
use super::vecf32::VecF32;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `shape`: heads, kv_heads, head_dim, tokens, pos0, as in [`crate::kernels::Attention`].
pub(crate) fn attention(
    v: &VecF32,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    out: &mut [f32],
    [heads, kv_heads, head_dim, tokens, pos0]: [usize; 5],
    scale: f32,
) {
    if head_dim == 0 || heads == 0 {
        return;
    }
    let group = heads / kv_heads.max(1);
    let kv_stride = kv_heads * head_dim;
    let out = &mut out[..tokens * heads * head_dim];
    let work = tokens * heads * (pos0 + tokens) * head_dim * 2;
    par_chunks(out, head_dim, work, |first, o| {
        let th = first / head_dim;
        let (t, h) = (th / heads, th % heads);
        let n_keys = pos0 + t + 1;
        let kvh = h / group.max(1);
        let qv = &q[th * head_dim..][..head_dim];
        SCORES.with_borrow_mut(|scores| {
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in 0..n_keys {
                let kv = &k_cache[p * kv_stride + kvh * head_dim..][..head_dim];
                let s = (v.dot)(qv, kv) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            o.fill(0.0);
            for (p, s) in scores.iter().enumerate() {
                let vv = &v_cache[p * kv_stride + kvh * head_dim..][..head_dim];
                (v.axpy)(o, s / sum, vv);
            }
        });
    });
}

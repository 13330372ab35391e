//! Causal grouped-query attention over a KV cache.

/// See [`super::Op::Attention`]. `k_cache`/`v_cache` hold at least `pos0 + tokens` rows of
/// `kv_heads × head_dim`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    out: &mut [f32],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    tokens: usize,
    pos0: usize,
    scale: f32,
) {
    let group = heads / kv_heads.max(1);
    let kv_stride = kv_heads * head_dim;
    let mut scores = Vec::new();
    for t in 0..tokens {
        let n_keys = pos0 + t + 1;
        for h in 0..heads {
            let kvh = h / group.max(1);
            let qv = &q[(t * heads + h) * head_dim..][..head_dim];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in 0..n_keys {
                let kv = &k_cache[p * kv_stride + kvh * head_dim..][..head_dim];
                let s = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let o = &mut out[(t * heads + h) * head_dim..][..head_dim];
            o.fill(0.0);
            for (p, s) in scores.iter().enumerate() {
                let vv = &v_cache[p * kv_stride + kvh * head_dim..][..head_dim];
                let w = s / sum;
                for (a, b) in o.iter_mut().zip(vv) {
                    *a += w * b;
                }
            }
        }
    }
}

//! Causal grouped-query attention over a KV cache.

use super::op::{OpSpec, Use, f32s, params};
use crate::backend::cpu::access::{f, fm, rd, wr};
use crate::backend::{self, Buffer};

/// See [`Attention`]. `k_cache`/`v_cache` hold at least `pos0 + tokens` rows of
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
    window: usize,
    softcap: f32,
) {
    let group = heads / kv_heads.max(1);
    let kv_stride = kv_heads * head_dim;
    let mut scores = Vec::new();
    for t in 0..tokens {
        let n_keys = pos0 + t + 1;
        let first = first_key(n_keys, window);
        for h in 0..heads {
            let kvh = h / group.max(1);
            let qv = &q[(t * heads + h) * head_dim..][..head_dim];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in first..n_keys {
                let kv = &k_cache[p * kv_stride + kvh * head_dim..][..head_dim];
                let s = cap_score(
                    qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale,
                    softcap,
                );
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
            for (p, s) in (first..n_keys).zip(&scores) {
                let vv = &v_cache[p * kv_stride + kvh * head_dim..][..head_dim];
                let w = s / sum;
                for (a, b) in o.iter_mut().zip(vv) {
                    *a += w * b;
                }
            }
        }
    }
}

/// A scaled attention score soft-capped as Gemma 2 does (`cap * tanh(s / cap)`) when
/// `softcap > 0`.
pub fn cap_score(s: f32, softcap: f32) -> f32 {
    if softcap > 0.0 {
        softcap * (s / softcap).tanh()
    } else {
        s
    }
}

/// The first key a query with `n_keys` causal keys attends to under a sliding `window` (the
/// last `window` positions, its own included, as llama.cpp masks Gemma's local layers); 0 is
/// no window.
pub fn first_key(n_keys: usize, window: usize) -> usize {
    if window == 0 {
        0
    } else {
        n_keys.saturating_sub(window)
    }
}

/// Causal grouped-query attention. `q`: `tokens × heads × head_dim`; caches:
/// `capacity × kv_heads × head_dim` holding positions `0..pos0 + tokens`; query `t` (at
/// position `pos0 + t`) attends to cache positions `0..=pos0 + t`, or with a `window` of
/// `w > 0` to the last `w` of them ([`first_key`]). `out` like `q`.
#[derive(Debug, Clone, Copy)]
pub struct Attention<'a> {
    pub q: &'a Buffer,
    pub k_cache: &'a Buffer,
    pub v_cache: &'a Buffer,
    pub out: &'a Buffer,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub tokens: u32,
    pub pos0: u32,
    pub scale: f32,
    /// Sliding window in positions; 0 attends to every earlier position.
    pub window: u32,
    /// Scores (after `scale`) become `softcap * tanh(score / softcap)`; 0 leaves them.
    pub softcap: f32,
}

params!(AttentionParams {
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    pos0: u32,
    scale: f32,
    // Blocks per (head, token) in cuda's `attention_split`; 0 elsewhere.
    splits: u32,
    window: u32,
    softcap: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
});

impl<'a> OpSpec<'a> for Attention<'a> {
    type Params = AttentionParams;

    fn name(&self) -> &'static str {
        "attention"
    }

    fn check(&self) -> Result<(), String> {
        let (heads, kv_heads, head_dim) = (self.heads, self.kv_heads, self.head_dim);
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "{heads} query heads is not a multiple of {kv_heads} kv heads"
            ));
        }
        if head_dim > 256 {
            return Err(format!("head_dim {head_dim} exceeds 256"));
        }
        if self.pos0.checked_add(self.tokens).is_none() {
            return Err("pos0 + tokens overflows".into());
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let n_pos = self.pos0.saturating_add(self.tokens);
        let q = f32s(&[self.tokens, self.heads, self.head_dim]);
        let kv = f32s(&[n_pos, self.kv_heads, self.head_dim]);
        vec![
            Use::read("q", self.q, q),
            Use::read("k_cache", self.k_cache, kv),
            Use::read("v_cache", self.v_cache, kv),
            Use::write("out", self.out, q),
        ]
    }

    fn params(&self) -> AttentionParams {
        AttentionParams {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            tokens: self.tokens,
            pos0: self.pos0,
            scale: self.scale,
            splits: 0,
            window: self.window,
            softcap: self.softcap,
            _pad0: 0,
            _pad1: 0,
            _pad2: 0,
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let (q, k, v) = (rd(self.q)?, rd(self.k_cache)?, rd(self.v_cache)?);
        let mut o = wr(self.out)?;
        attention(
            f(&q),
            f(&k),
            f(&v),
            fm(&mut o),
            self.heads as usize,
            self.kv_heads as usize,
            self.head_dim as usize,
            self.tokens as usize,
            self.pos0 as usize,
            self.scale,
            self.window as usize,
            self.softcap,
        );
        Ok(())
    }
}

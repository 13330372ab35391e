//! The key/value pool of a batch of sequences: writing each token's keys and values into the
//! pool's slots ([`KvStore`]), and attention through each sequence's block table
//! ([`PagedAttention`]).
//!
//! A pool holds `blocks × block` positions (slots) of `kv_dim` values per layer; a sequence
//! owns a list of blocks (its table), so its position `j` lives in slot
//! `table[j / block] * block + j % block`. Slots and table entries come from buffers the
//! kernels read, so every GPU kernel skips an entry outside the pool instead of reading or
//! writing past it; the CPU reference refuses such an entry with an error.

use super::attention::{cap_score, first_key};
use super::op::{OpSpec, Use, f32s, params};
use crate::backend::cpu::access::{f, fm, rd, wr};
use crate::backend::{self, BackendError, Buffer};

/// Copies row `t` of `k` and `v` (`tokens × kv_dim`) into slot `slots[t]` of `k_pool` and
/// `v_pool` (`pool_slots × kv_dim`). A slot at or past `pool_slots` is skipped by GPU
/// kernels and an error on the CPU.
#[derive(Debug, Clone, Copy)]
pub struct KvStore<'a> {
    pub k: &'a Buffer,
    pub v: &'a Buffer,
    pub slots: &'a Buffer,
    pub k_pool: &'a Buffer,
    pub v_pool: &'a Buffer,
    pub kv_dim: u32,
    pub tokens: u32,
    pub pool_slots: u32,
}

params!(KvStoreParams {
    kv_dim: u32,
    tokens: u32,
    pool_slots: u32,
    _pad: u32,
});

impl<'a> OpSpec<'a> for KvStore<'a> {
    type Params = KvStoreParams;

    fn name(&self) -> &'static str {
        "kv_store"
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let rows = f32s(&[self.tokens, self.kv_dim]);
        let pool = f32s(&[self.pool_slots, self.kv_dim]);
        vec![
            Use::read("k", self.k, rows),
            Use::read("v", self.v, rows),
            Use::read("slots", self.slots, f32s(&[self.tokens])),
            Use::in_place("k_pool", self.k_pool, pool),
            Use::in_place("v_pool", self.v_pool, pool),
        ]
    }

    fn params(&self) -> KvStoreParams {
        KvStoreParams {
            kv_dim: self.kv_dim,
            tokens: self.tokens,
            pool_slots: self.pool_slots,
            _pad: 0,
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let d = self.kv_dim as usize;
        let slots = rd(self.slots)?[..self.tokens as usize].to_vec();
        // Refused before anything is written, so a refused store leaves both pools as they were.
        if let Some(&slot) = slots.iter().find(|&&s| s >= self.pool_slots) {
            return Err(out_of_pool("slot", slot, self.pool_slots));
        }
        for (src, dst) in [(self.k, self.k_pool), (self.v, self.v_pool)] {
            let s = rd(src)?;
            let mut p = wr(dst)?;
            let (s, p) = (f(&s), fm(&mut p));
            for (t, &slot) in slots.iter().enumerate() {
                let slot = slot as usize;
                p[slot * d..(slot + 1) * d].copy_from_slice(&s[t * d..(t + 1) * d]);
            }
        }
        Ok(())
    }
}

/// Causal grouped-query attention of a batch of sequences, each through its own block table.
/// `q` and `out`: `tokens × heads × head_dim`. `rows`: two u32 per query token: where its
/// sequence's table starts in `table`, and how many keys it attends to (its position + 1);
/// its key `j` is in slot `table[start + j / block] * block + j % block` of `k_pool` and
/// `v_pool` (`pool_blocks × block × kv_heads × head_dim`). `table_len` u32 values of `table`
/// are valid; a token whose keys reach past them, or a block at or past `pool_blocks`, is
/// skipped by GPU kernels (its output is not written) and an error on the CPU. With a
/// `window` of `w > 0` a token attends to its last `w` keys only
/// ([`first_key`](super::attention::first_key)).
#[derive(Debug, Clone, Copy)]
pub struct PagedAttention<'a> {
    pub q: &'a Buffer,
    pub k_pool: &'a Buffer,
    pub v_pool: &'a Buffer,
    pub rows: &'a Buffer,
    pub table: &'a Buffer,
    pub out: &'a Buffer,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub tokens: u32,
    pub block: u32,
    pub pool_blocks: u32,
    pub table_len: u32,
    pub scale: f32,
    /// Sliding window in positions; 0 attends to every earlier position.
    pub window: u32,
    /// Scores (after `scale`) become `softcap * tanh(score / softcap)`; 0 leaves them.
    pub softcap: f32,
}

params!(PagedAttentionParams {
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    block: u32,
    pool_blocks: u32,
    table_len: u32,
    scale: f32,
    window: u32,
    softcap: f32,
    _pad0: u32,
    _pad1: u32,
});

impl<'a> OpSpec<'a> for PagedAttention<'a> {
    type Params = PagedAttentionParams;

    fn name(&self) -> &'static str {
        "paged_attention"
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
        if self.block == 0 {
            return Err("a block of 0 positions".into());
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let q = f32s(&[self.tokens, self.heads, self.head_dim]);
        let pool = f32s(&[self.pool_blocks, self.block, self.kv_heads, self.head_dim]);
        vec![
            Use::read("q", self.q, q),
            Use::read("k_pool", self.k_pool, pool),
            Use::read("v_pool", self.v_pool, pool),
            Use::read("rows", self.rows, f32s(&[self.tokens, 2])),
            Use::read("table", self.table, f32s(&[self.table_len])),
            Use::write("out", self.out, q),
        ]
    }

    fn params(&self) -> PagedAttentionParams {
        PagedAttentionParams {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            tokens: self.tokens,
            block: self.block,
            pool_blocks: self.pool_blocks,
            table_len: self.table_len,
            scale: self.scale,
            window: self.window,
            softcap: self.softcap,
            _pad0: 0,
            _pad1: 0,
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let (q, k, v) = (rd(self.q)?, rd(self.k_pool)?, rd(self.v_pool)?);
        let rows = rd(self.rows)?[..2 * self.tokens as usize].to_vec();
        let table = rd(self.table)?[..self.table_len as usize].to_vec();
        let mut o = wr(self.out)?;
        paged_attention(
            f(&q),
            f(&k),
            f(&v),
            &rows,
            &table,
            fm(&mut o),
            &self.params(),
        )
    }
}

/// Every query token's table slice lies within `table` and names blocks within the pool.
pub(crate) fn check_tables(
    rows: &[u32],
    table: &[u32],
    p: &PagedAttentionParams,
) -> backend::Result<()> {
    let block = p.block.max(1) as usize;
    for t in 0..p.tokens as usize {
        let (start, n_keys) = (rows[2 * t] as usize, rows[2 * t + 1] as usize);
        let end = start + n_keys.div_ceil(block);
        if end > table.len() {
            return Err(out_of_pool("table entry", end as u32, table.len() as u32));
        }
        if let Some(&b) = table[start..end].iter().find(|&&b| b >= p.pool_blocks) {
            return Err(out_of_pool("block", b, p.pool_blocks));
        }
    }
    Ok(())
}

/// The reference of [`PagedAttention`].
pub fn paged_attention(
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    rows: &[u32],
    table: &[u32],
    out: &mut [f32],
    p: &PagedAttentionParams,
) -> backend::Result<()> {
    let (heads, kv_heads, hd) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let block = p.block as usize;
    let group = heads / kv_heads.max(1);
    let kv_stride = kv_heads * hd;
    let mut slots = Vec::new();
    let mut scores = Vec::new();
    for t in 0..p.tokens as usize {
        let (start, n_keys) = (rows[2 * t] as usize, rows[2 * t + 1] as usize);
        let n_blocks = n_keys.div_ceil(block);
        if start + n_blocks > table.len() {
            return Err(out_of_pool(
                "table entry",
                (start + n_blocks) as u32,
                table.len() as u32,
            ));
        }
        slots.clear();
        for j in first_key(n_keys, p.window as usize)..n_keys {
            let b = table[start + j / block];
            if b >= p.pool_blocks {
                return Err(out_of_pool("block", b, p.pool_blocks));
            }
            slots.push(b as usize * block + j % block);
        }
        for h in 0..heads {
            let kvh = h / group.max(1);
            let qv = &q[(t * heads + h) * hd..][..hd];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for &slot in &slots {
                let kv = &k_pool[slot * kv_stride + kvh * hd..][..hd];
                let s = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * p.scale;
                let s = cap_score(s, p.softcap);
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let o = &mut out[(t * heads + h) * hd..][..hd];
            o.fill(0.0);
            for (&slot, s) in slots.iter().zip(&scores) {
                let vv = &v_pool[slot * kv_stride + kvh * hd..][..hd];
                let w = s / sum;
                for (a, b) in o.iter_mut().zip(vv) {
                    *a += w * b;
                }
            }
        }
    }
    Ok(())
}

fn out_of_pool(what: &str, value: u32, limit: u32) -> BackendError {
    BackendError::InvalidOp {
        op: "paged pool",
        reason: format!("{what} {value} is outside the key/value pool (limit {limit})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::attention::attention;

    /// A sequence's keys scattered over blocks in any order give the same attention as the
    /// same keys laid out contiguously (the dense kernel every backend already matches).
    #[test]
    fn paged_attention_matches_dense_attention_through_a_shuffled_table() {
        let (heads, kv_heads, hd, block) = (4usize, 2usize, 8usize, 4usize);
        let kv_dim = kv_heads * hd;
        let n = 11; // keys of the sequence; queries at its last 3 positions
        let val = |i: usize| ((i * 7919 % 1000) as f32 / 500.0) - 1.0;
        let k: Vec<f32> = (0..n * kv_dim).map(val).collect();
        let v: Vec<f32> = (0..n * kv_dim).map(|i| val(i + 31)).collect();
        let q: Vec<f32> = (0..3 * heads * hd).map(|i| val(i + 77)).collect();
        // 3 blocks, placed at pool blocks 5, 1, 3 of 6; the table starts at entry 2.
        let table = [9, 9, 5, 1, 3];
        let pool_blocks = 6;
        let mut kp = vec![f32::NAN; pool_blocks * block * kv_dim];
        let mut vp = kp.clone();
        for j in 0..n {
            let slot = table[2 + j / block] as usize * block + j % block;
            kp[slot * kv_dim..][..kv_dim].copy_from_slice(&k[j * kv_dim..][..kv_dim]);
            vp[slot * kv_dim..][..kv_dim].copy_from_slice(&v[j * kv_dim..][..kv_dim]);
        }
        let rows = [2, 9, 2, 10, 2, 11];
        let mut p = PagedAttentionParams {
            heads: heads as u32,
            kv_heads: kv_heads as u32,
            head_dim: hd as u32,
            tokens: 3,
            block: block as u32,
            pool_blocks: pool_blocks as u32,
            table_len: table.len() as u32,
            scale: 0.35,
            window: 0,
            softcap: 0.0,
            _pad0: 0,
            _pad1: 0,
        };
        let mut paged = vec![0.0; q.len()];
        // A window of 6 starts the three queries' keys in different blocks.
        for window in [0, 6] {
            let mut dense = vec![0.0; q.len()];
            attention(
                &q,
                &k,
                &v,
                &mut dense,
                heads,
                kv_heads,
                hd,
                3,
                n - 3,
                0.35,
                window,
                0.0,
            );
            p.window = window as u32;
            paged_attention(&q, &kp, &vp, &rows, &table, &mut paged, &p).unwrap();
            for (a, b) in dense.iter().zip(&paged) {
                assert!((a - b).abs() < 1e-6, "window {window}: {a} vs {b}");
            }
        }
        let mut unwindowed = vec![0.0; q.len()];
        p.window = 0;
        paged_attention(&q, &kp, &vp, &rows, &table, &mut unwindowed, &p).unwrap();
        assert!(
            paged
                .iter()
                .zip(&unwindowed)
                .any(|(a, b)| (a - b).abs() > 1e-3)
        );
        // A table too short for a token's keys, or a block outside the pool, is an error.
        let short = [2, 13];
        assert!(paged_attention(&q, &kp, &vp, &short, &table, &mut paged, &p).is_err());
        let bad_table = [9, 9, 5, 6, 3];
        assert!(paged_attention(&q, &kp, &vp, &rows, &bad_table, &mut paged, &p).is_err());
    }
}

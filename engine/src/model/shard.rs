//! A model shard: the blocks `[start, end)` of a dense decoder model (any supported
//! [`Family`](super::family::Family)) on one device, with the embedding when it starts at 0
//! and the output head when it ends at the last block.

use futures::lock::Mutex;

use super::ModelError;
use super::cache::KvCache;
use super::config::ModelConfig;
use super::kv_pool::{KV_BLOCK, KvPool, SeqKv};
use super::weights::{self, Matrix, ShardWeights};
use crate::backend::{Buffer, Device};
use crate::gguf::TensorSource;
use crate::kernels::{
    Add, AddBias, Attention, BufferCopy, Embed, GeluMul, KvStore, Linear, Op, PagedAttention,
    RmsNorm, Rope, Sample, SampleParams, ScaleCap, SiluMul,
};

/// What a shard is fed.
#[derive(Debug, Clone, Copy)]
pub enum ShardInput<'a> {
    /// Token ids (first shard only).
    Tokens(&'a [u32]),
    /// Hidden states from the previous shard, `tokens × dim`, row-major.
    Hidden(&'a [f32]),
}

/// What a shard should produce.
#[derive(Debug, Clone, Copy)]
pub enum Want {
    /// Hidden states for every input token (any shard but the last).
    Hidden,
    /// The last token's logits (last shard only).
    Logits,
    /// A token drawn on the device from the last token's logits (last shard only).
    Sample(SampleParams),
}

#[derive(Debug, Clone, PartialEq)]
pub enum ShardOutput {
    Hidden(Vec<f32>),
    Logits(Vec<f32>),
    Token(u32),
}

/// Working memory for one forward pass of up to `max_batch` tokens.
struct Scratch {
    h: Buffer,
    xn: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    /// Q or K before its per-head norm (families with `qk_norm` only).
    pre_norm: Option<Buffer>,
    att: Buffer,
    o: Buffer,
    g: Buffer,
    u: Buffer,
    a: Buffer,
    ids: Buffer,
    last: Buffer,
    last_norm: Buffer,
    logits: Buffer,
    token: Buffer,
}

pub struct Shard {
    cfg: ModelConfig,
    start: usize,
    end: usize,
    max_batch: usize,
    dev: std::sync::Arc<Device>,
    weights: ShardWeights,
    scratch: Mutex<Scratch>,
    /// A batched pass's own buffers, made on the first one.
    batch: Mutex<Option<BatchBuffers>>,
}

/// Most sequences in one batched pass.
pub const MAX_BATCH_SEQS: usize = 64;

/// One sequence's part of a batched pass ([`Shard::forward_batch`]).
pub struct BatchItem<'a> {
    pub seq: &'a mut SeqKv,
    pub input: ShardInput<'a>,
    pub want: Want,
}

/// Largest number of prompt tokens run in one submission; longer prompts are split.
pub const DEFAULT_MAX_BATCH: usize = 256;

impl Shard {
    /// Loads blocks `[start, end)` from `src` onto `dev`; `progress(done, total)` reports bytes.
    pub fn load(
        dev: std::sync::Arc<Device>,
        src: &dyn TensorSource,
        start: usize,
        end: usize,
        max_batch: usize,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Shard, ModelError> {
        let cfg = ModelConfig::from_gguf(src.gguf())?;
        if start >= end || end > cfg.n_layers {
            return Err(ModelError::BadRange {
                start,
                end,
                n_layers: cfg.n_layers,
            });
        }
        let max_batch = max_batch.clamp(1, 4096);
        let weights = weights::load(&dev, src, &cfg, start, end, progress)?;
        let scratch = Scratch::new(&dev, &cfg, max_batch)?;
        Ok(Shard {
            cfg,
            start,
            end,
            max_batch,
            dev,
            weights,
            scratch: Mutex::new(scratch),
            batch: Mutex::new(None),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn range(&self) -> (usize, usize) {
        (self.start, self.end)
    }
    pub fn is_first(&self) -> bool {
        self.start == 0
    }
    pub fn is_last(&self) -> bool {
        self.end == self.cfg.n_layers
    }
    pub fn device(&self) -> &std::sync::Arc<Device> {
        &self.dev
    }

    /// A KV cache for one sequence of up to `capacity` positions.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache, ModelError> {
        KvCache::new(
            &self.dev,
            self.end - self.start,
            self.cfg.kv_dim(),
            capacity.max(1),
        )
    }

    /// A key/value pool for this shard's layers that may grow to `budget_bytes`.
    pub fn new_pool(&self, budget_bytes: u64) -> Result<KvPool, ModelError> {
        KvPool::new(
            &self.dev,
            self.end - self.start,
            self.cfg.kv_dim(),
            budget_bytes,
        )
    }

    /// Device bytes one position of one sequence takes in a pool of this shard.
    pub fn kv_bytes_per_position(&self) -> u64 {
        KvPool::block_bytes(self.end - self.start, self.cfg.kv_dim()) / KV_BLOCK as u64
    }

    /// How many rows `input` is, or why this shard does not take it with `want`.
    fn rows_of(&self, input: ShardInput<'_>, want: Want) -> Result<usize, ModelError> {
        let dim = self.cfg.dim;
        let n = match input {
            ShardInput::Tokens(t) => {
                if !self.is_first() {
                    return Err(ModelError::WrongInput(
                        "token ids go to the first shard only",
                    ));
                }
                if let Some(bad) = t.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
                    return Err(ModelError::BadToken {
                        id: *bad,
                        vocab: self.cfg.vocab_size,
                    });
                }
                t.len()
            }
            ShardInput::Hidden(h) => {
                if self.is_first() {
                    return Err(ModelError::WrongInput("the first shard takes token ids"));
                }
                if h.len() % dim != 0 {
                    return Err(ModelError::BadShape(format!(
                        "{} hidden values is not a whole number of rows of {dim}",
                        h.len()
                    )));
                }
                h.len() / dim
            }
        };
        if n == 0 {
            return Err(ModelError::WrongInput("no tokens"));
        }
        if !self.is_last() && !matches!(want, Want::Hidden) {
            return Err(ModelError::WrongInput(
                "only the last shard produces logits",
            ));
        }
        if self.is_last() && matches!(want, Want::Hidden) {
            return Err(ModelError::WrongInput(
                "the last shard produces logits or tokens",
            ));
        }
        Ok(n)
    }

    /// Runs several sequences' next rows together, their keys and values in `pool`: the
    /// weight products take every row of the batch at once (each weight read once per pass,
    /// not once per sequence), attention runs per sequence through its block table. Rows
    /// beyond `max_batch` run in further passes. Each item gets its own result: one whose
    /// input is wrong, or for which the pool has no room now, fails alone; an error of the
    /// device fails the call.
    pub async fn forward_batch(
        &self,
        pool: &mut KvPool,
        items: &mut [BatchItem<'_>],
    ) -> Result<Vec<Result<ShardOutput, ModelError>>, ModelError> {
        let (dim, vocab) = (self.cfg.dim, self.cfg.vocab_size);
        let mut results: Vec<Option<Result<ShardOutput, ModelError>>> =
            (0..items.len()).map(|_| None).collect();
        // Rows per live item; a refused item gets its error now.
        let mut rows = vec![0usize; items.len()];
        for (i, it) in items.iter_mut().enumerate() {
            let n = if i >= MAX_BATCH_SEQS {
                Err(ModelError::WrongInput(
                    "more sequences than one batched pass takes",
                ))
            } else {
                self.rows_of(it.input, it.want)
            };
            let reserved = n.and_then(|n| {
                let len = it.seq.len() + n;
                pool.reserve(&self.dev, it.seq, len).map(|_| n)
            });
            match reserved {
                Ok(n) => rows[i] = n,
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        // A batch of decode steps alone keeps to what the device runs well in one pass.
        let decode_only = rows.iter().all(|&n| n <= 1);
        let per_pass = match self.dev.decode_rows_per_pass() {
            Some(n) if decode_only => n.clamp(1, self.max_batch),
            _ => self.max_batch,
        };
        let mut done = vec![0usize; items.len()];
        let mut hidden: Vec<Vec<f32>> = vec![Vec::new(); items.len()];
        let s = self.scratch.lock().await;
        let mut guard = self.batch.lock().await;
        if guard.is_none() {
            *guard = Some(BatchBuffers::new(
                &self.dev,
                &self.cfg,
                self.max_batch,
                self.is_last(),
            )?);
        }
        let Some(b) = guard.as_ref() else {
            return Err(ModelError::WrongInput("batch buffers vanished"));
        };
        loop {
            // This pass: (item, first row, rows) in item order, up to per_pass rows.
            let mut pass: Vec<(usize, usize, usize)> = Vec::new();
            let mut total = 0;
            for i in 0..items.len() {
                let left = rows[i] - done[i];
                if left == 0 || total == per_pass {
                    continue;
                }
                let take = left.min(per_pass - total);
                pass.push((i, done[i], take));
                total += take;
            }
            if pass.is_empty() {
                break;
            }
            let mut ids: Vec<u32> = Vec::new();
            let mut h_in: Vec<f32> = Vec::new();
            let mut positions = Vec::with_capacity(total);
            let mut slots = Vec::with_capacity(total);
            let mut meta = Vec::with_capacity(2 * total);
            let mut table: Vec<u32> = Vec::new();
            for &(i, from, take) in &pass {
                let it = &items[i];
                match it.input {
                    ShardInput::Tokens(t) => ids.extend_from_slice(&t[from..from + take]),
                    ShardInput::Hidden(h) => {
                        h_in.extend_from_slice(&h[from * dim..(from + take) * dim])
                    }
                }
                let start = table.len() as u32;
                table.extend_from_slice(it.seq.blocks());
                for j in 0..take {
                    let pos = it.seq.len() + j;
                    positions.push(pos as u32);
                    slots.push(it.seq.slot(pos));
                    meta.extend_from_slice(&[start, pos as u32 + 1]);
                }
            }
            if self.is_first() {
                self.dev.write(&s.ids, 0, bytemuck::cast_slice(&ids))?;
            } else {
                self.dev.write(&s.h, 0, bytemuck::cast_slice(&h_in))?;
            }
            self.dev
                .write(&b.positions, 0, bytemuck::cast_slice(&positions))?;
            self.dev.write(&b.slots, 0, bytemuck::cast_slice(&slots))?;
            self.dev.write(&b.rows, 0, bytemuck::cast_slice(&meta))?;
            self.dev
                .write(&pool.table, 0, bytemuck::cast_slice(&table))?;
            let kv = Kv::Paged {
                pool,
                batch: b,
                table_len: table.len() as u32,
            };
            let mut ops = Vec::with_capacity(16 * (self.end - self.start) + 8 + 3 * pass.len());
            self.encode_blocks(&s, kv, total, &mut ops);
            // Items whose last row is in this pass and that want the head: (item, head row).
            let mut heads: Vec<(usize, usize)> = Vec::new();
            if self.is_last() {
                let row = (dim * 4) as u64;
                let mut at = 0;
                for &(i, from, take) in &pass {
                    at += take;
                    if from + take == rows[i] {
                        let k = heads.len();
                        ops.push(Op::Copy(BufferCopy {
                            src: &s.h,
                            src_offset: (at as u64 - 1) * row,
                            dst: &b.head_h,
                            dst_offset: k as u64 * row,
                            bytes: row,
                        }));
                        heads.push((i, k));
                    }
                }
                if !heads.is_empty() {
                    self.encode_logits(
                        &b.head_h,
                        &b.head_norm,
                        &b.head_logits,
                        heads.len(),
                        &mut ops,
                    )?;
                }
                let lrow = (vocab * 4) as u64;
                for &(i, k) in &heads {
                    if let Want::Sample(params) = items[i].want {
                        ops.push(Op::Copy(BufferCopy {
                            src: &b.head_logits,
                            src_offset: k as u64 * lrow,
                            dst: &s.logits,
                            dst_offset: 0,
                            bytes: lrow,
                        }));
                        ops.push(Op::Sample(Sample {
                            logits: &s.logits,
                            n: vocab as u32,
                            out: &s.token,
                            params,
                        }));
                        ops.push(Op::Copy(BufferCopy {
                            src: &s.token,
                            src_offset: 0,
                            dst: &b.tokens,
                            dst_offset: k as u64 * 4,
                            bytes: 4,
                        }));
                    }
                }
            }
            self.dev.run(&ops)?;
            for &(i, _, take) in &pass {
                items[i].seq.advance(take);
                done[i] += take;
            }
            if !self.is_last() {
                let bytes = self.dev.read(&s.h, 0, (total * dim * 4) as u64).await?;
                let vals: &[f32] = bytemuck::cast_slice(&bytes);
                let mut at = 0;
                for &(i, _, take) in &pass {
                    hidden[i].extend_from_slice(&vals[at * dim..(at + take) * dim]);
                    at += take;
                }
            } else if !heads.is_empty() {
                let toks = self
                    .dev
                    .read(&b.tokens, 0, (heads.len() * 4) as u64)
                    .await?;
                let toks: &[u32] = bytemuck::cast_slice(&toks);
                let wants_logits = heads
                    .iter()
                    .any(|&(i, _)| matches!(items[i].want, Want::Logits));
                let logits = if wants_logits {
                    let bytes = self
                        .dev
                        .read(&b.head_logits, 0, (heads.len() * vocab * 4) as u64)
                        .await?;
                    bytemuck::cast_slice::<u8, f32>(&bytes).to_vec()
                } else {
                    Vec::new()
                };
                for &(i, k) in &heads {
                    results[i] = Some(Ok(match items[i].want {
                        Want::Sample(_) => ShardOutput::Token(toks[k]),
                        _ => ShardOutput::Logits(logits[k * vocab..(k + 1) * vocab].to_vec()),
                    }));
                }
            }
        }
        if !self.is_last() {
            for (i, h) in hidden.into_iter().enumerate() {
                if results[i].is_none() {
                    results[i] = Some(Ok(ShardOutput::Hidden(h)));
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or(Err(ModelError::WrongInput("a batch item produced nothing"))))
            .collect())
    }

    /// Runs the shard over `input` at the cache's next positions and appends them to it.
    pub async fn forward(
        &self,
        cache: &mut KvCache,
        input: ShardInput<'_>,
        want: Want,
    ) -> Result<ShardOutput, ModelError> {
        let dim = self.cfg.dim;
        let n = self.rows_of(input, want)?;
        if cache.len() + n > cache.capacity() {
            return Err(ModelError::ContextFull {
                needed: cache.len() + n,
                capacity: cache.capacity(),
            });
        }
        let s = self.scratch.lock().await;
        let mut hidden_out = Vec::new();
        let mut done = 0;
        while done < n {
            let t = (n - done).min(self.max_batch);
            match input {
                ShardInput::Tokens(ids) => {
                    self.dev
                        .write(&s.ids, 0, bytemuck::cast_slice(&ids[done..done + t]))?
                }
                ShardInput::Hidden(h) => self.dev.write(
                    &s.h,
                    0,
                    bytemuck::cast_slice(&h[done * dim..(done + t) * dim]),
                )?,
            }
            let pos0 = cache.len();
            let is_final = done + t == n;
            let mut ops = Vec::with_capacity(16 * (self.end - self.start) + 8);
            self.encode_blocks(&s, Kv::Dense { cache, pos0 }, t, &mut ops);
            if is_final && self.is_last() {
                self.encode_head(&s, t, want, &mut ops)?;
            }
            self.dev.run(&ops)?;
            cache.advance(t);
            if !self.is_last() {
                let bytes = self.dev.read(&s.h, 0, (t * dim * 4) as u64).await?;
                hidden_out.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
            }
            done += t;
        }
        Ok(match want {
            Want::Hidden => ShardOutput::Hidden(hidden_out),
            Want::Logits => ShardOutput::Logits(self.dev.read_f32(&s.logits).await?),
            Want::Sample(_) => {
                let b = self.dev.read(&s.token, 0, 4).await?;
                ShardOutput::Token(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
        })
    }

    /// Runs the whole model over `tokens` at the cache's next positions and returns the
    /// logits at every position from `from` on, `(tokens.len() - from) × vocab` row-major:
    /// teacher-forced scoring as one batched pass (the tiled matrix kernels, the output head a
    /// matrix product over those positions) instead of one decode step per position.
    pub async fn forward_logits_from(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        from: usize,
    ) -> Result<Vec<f32>, ModelError> {
        if !(self.is_first() && self.is_last()) {
            return Err(ModelError::WrongInput(
                "logits at every position need a shard holding the whole model",
            ));
        }
        let n = tokens.len();
        if from >= n {
            return Err(ModelError::WrongInput("no positions to return logits at"));
        }
        if let Some(bad) = tokens
            .iter()
            .find(|&&id| id as usize >= self.cfg.vocab_size)
        {
            return Err(ModelError::BadToken {
                id: *bad,
                vocab: self.cfg.vocab_size,
            });
        }
        if cache.len() + n > cache.capacity() {
            return Err(ModelError::ContextFull {
                needed: cache.len() + n,
                capacity: cache.capacity(),
            });
        }
        let (dim, vocab) = (self.cfg.dim, self.cfg.vocab_size);
        let rows = self.max_batch.min(n - from);
        let f = |label: &str, n: usize| self.dev.alloc(label, (n * 4) as u64);
        let head = HeadRows {
            h: f("head_h", rows * dim)?,
            norm: f("head_norm", rows * dim)?,
            logits: f("head_logits", rows * vocab)?,
        };
        let s = self.scratch.lock().await;
        let mut out = Vec::with_capacity((n - from) * vocab);
        let mut done = 0;
        while done < n {
            let t = (n - done).min(self.max_batch);
            self.dev
                .write(&s.ids, 0, bytemuck::cast_slice(&tokens[done..done + t]))?;
            let mut ops = Vec::with_capacity(16 * (self.end - self.start) + 4);
            let pos0 = cache.len();
            self.encode_blocks(&s, Kv::Dense { cache, pos0 }, t, &mut ops);
            // Rows of this chunk at or after `from`, as [first, t).
            let first = from.saturating_sub(done).min(t);
            let k = t - first;
            if k > 0 {
                let row = (dim * 4) as u64;
                ops.push(Op::Copy(BufferCopy {
                    src: &s.h,
                    src_offset: first as u64 * row,
                    dst: &head.h,
                    dst_offset: 0,
                    bytes: k as u64 * row,
                }));
                self.encode_logits(&head.h, &head.norm, &head.logits, k, &mut ops)?;
            }
            self.dev.run(&ops)?;
            cache.advance(t);
            if k > 0 {
                let bytes = self
                    .dev
                    .read(&head.logits, 0, (k * vocab * 4) as u64)
                    .await?;
                out.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                );
            }
            done += t;
        }
        Ok(out)
    }

    fn encode_blocks<'a>(&'a self, s: &'a Scratch, kv: Kv<'a>, t: usize, ops: &mut Vec<Op<'a>>) {
        let (pos0, positions) = match kv {
            Kv::Dense { pos0, .. } => (pos0, None),
            Kv::Paged { batch, .. } => (0, Some(&batch.positions)),
        };
        let c = &self.cfg;
        let tk = t as u32;
        let lin = |m: &'a Matrix, x: &'a Buffer, y: &'a Buffer| {
            Op::Linear(Linear {
                w: &m.buf,
                wtype: m.ty,
                x,
                y,
                rows: m.rows as u32,
                cols: m.cols as u32,
                tokens: tk,
            })
        };
        if let Some(e) = &self.weights.embed {
            ops.push(Op::Embed(Embed {
                table: &e.buf,
                ttype: e.ty,
                ids: &s.ids,
                out: &s.h,
                dim: c.dim as u32,
                vocab: e.rows as u32,
                tokens: tk,
            }));
            if c.family.gemma() {
                ops.push(Op::ScaleCap(ScaleCap {
                    x: &s.h,
                    n: (t * c.dim) as u32,
                    scale: (c.dim as f32).sqrt(),
                    cap: 0.0,
                }));
            }
        }
        let kv_row = (c.kv_dim() * 4) as u64;
        for (i, w) in self.weights.layers.iter().enumerate() {
            let layer = self.start + i;
            let norm = |weight: &'a Buffer| {
                Op::RmsNorm(RmsNorm {
                    x: &s.h,
                    weight,
                    y: &s.xn,
                    dim: c.dim as u32,
                    tokens: tk,
                    eps: c.norm_eps,
                })
            };
            let rope = |x: &'a Buffer, heads: usize| {
                Op::Rope(Rope {
                    x,
                    heads: heads as u32,
                    head_dim: c.head_dim as u32,
                    rope_dim: c.rope_dim as u32,
                    tokens: tk,
                    pos0: pos0 as u32,
                    freq_base: c.layer_rope_base(layer),
                    neox: c.rope_neox,
                    factors: self.weights.rope_freqs.as_ref(),
                    positions,
                })
            };
            ops.push(norm(&w.attn_norm));
            match (&w.qk_norm, &s.pre_norm) {
                (Some([qn, kn]), Some(pre)) => {
                    // One norm per head (rows of head_dim, a weight every head shares), from
                    // the product's own buffer: a kernel's input and output are never one.
                    for (m, out, weight, heads) in [
                        (&w.wq, &s.q, qn, c.n_heads),
                        (&w.wk, &s.k, kn, c.n_kv_heads),
                    ] {
                        ops.push(lin(m, &s.xn, pre));
                        if let Some(bias) = qkv_bias_of(w, m) {
                            ops.push(Op::AddBias(AddBias {
                                x: pre,
                                bias,
                                cols: m.rows as u32,
                                tokens: tk,
                            }));
                        }
                        ops.push(Op::RmsNorm(RmsNorm {
                            x: pre,
                            weight,
                            y: out,
                            dim: c.head_dim as u32,
                            tokens: tk * heads as u32,
                            eps: c.norm_eps,
                        }));
                    }
                }
                _ => {
                    ops.push(lin(&w.wq, &s.xn, &s.q));
                    ops.push(lin(&w.wk, &s.xn, &s.k));
                    for (m, x) in [(&w.wq, &s.q), (&w.wk, &s.k)] {
                        if let Some(bias) = qkv_bias_of(w, m) {
                            ops.push(Op::AddBias(AddBias {
                                x,
                                bias,
                                cols: m.rows as u32,
                                tokens: tk,
                            }));
                        }
                    }
                }
            }
            ops.push(lin(&w.wv, &s.xn, &s.v));
            if let Some(bias) = qkv_bias_of(w, &w.wv) {
                ops.push(Op::AddBias(AddBias {
                    x: &s.v,
                    bias,
                    cols: c.kv_dim() as u32,
                    tokens: tk,
                }));
            }
            ops.push(rope(&s.q, c.n_heads));
            ops.push(rope(&s.k, c.n_kv_heads));
            let (scale, window) = (c.attn_scale(), c.layer_window(layer));
            match kv {
                Kv::Dense { cache, pos0 } => {
                    let off = pos0 as u64 * kv_row;
                    let bytes = t as u64 * kv_row;
                    ops.push(Op::Copy(BufferCopy {
                        src: &s.k,
                        src_offset: 0,
                        dst: &cache.k[i],
                        dst_offset: off,
                        bytes,
                    }));
                    ops.push(Op::Copy(BufferCopy {
                        src: &s.v,
                        src_offset: 0,
                        dst: &cache.v[i],
                        dst_offset: off,
                        bytes,
                    }));
                    ops.push(Op::Attention(Attention {
                        q: &s.q,
                        k_cache: &cache.k[i],
                        v_cache: &cache.v[i],
                        out: &s.att,
                        heads: c.n_heads as u32,
                        kv_heads: c.n_kv_heads as u32,
                        head_dim: c.head_dim as u32,
                        tokens: tk,
                        pos0: pos0 as u32,
                        scale,
                        window,
                        softcap: c.attn_softcap,
                    }));
                }
                Kv::Paged {
                    pool,
                    batch,
                    table_len,
                } => {
                    let pool_blocks = pool.blocks() as u32;
                    ops.push(Op::KvStore(KvStore {
                        k: &s.k,
                        v: &s.v,
                        slots: &batch.slots,
                        k_pool: &pool.k[i],
                        v_pool: &pool.v[i],
                        kv_dim: c.kv_dim() as u32,
                        tokens: tk,
                        pool_slots: pool_blocks * KV_BLOCK as u32,
                    }));
                    ops.push(Op::PagedAttention(PagedAttention {
                        q: &s.q,
                        k_pool: &pool.k[i],
                        v_pool: &pool.v[i],
                        rows: &batch.rows,
                        table: &pool.table,
                        out: &s.att,
                        heads: c.n_heads as u32,
                        kv_heads: c.n_kv_heads as u32,
                        head_dim: c.head_dim as u32,
                        tokens: tk,
                        block: KV_BLOCK as u32,
                        pool_blocks,
                        table_len,
                        scale,
                        window,
                        softcap: c.attn_softcap,
                    }));
                }
            }
            // The residual adds `o`, or with Gemma's post norms `o` normed (into `xn`, free
            // until the next pre-norm).
            let residual = |ops: &mut Vec<Op<'a>>, post: Option<&'a Buffer>| {
                let b = match post {
                    Some(weight) => {
                        ops.push(Op::RmsNorm(RmsNorm {
                            x: &s.o,
                            weight,
                            y: &s.xn,
                            dim: c.dim as u32,
                            tokens: tk,
                            eps: c.norm_eps,
                        }));
                        &s.xn
                    }
                    None => &s.o,
                };
                ops.push(Op::Add(Add {
                    a: &s.h,
                    b,
                    out: &s.h,
                    n: (t * c.dim) as u32,
                }));
            };
            let [attn_post, ffn_post] = match &w.post_norms {
                Some([a, f]) => [Some(a), Some(f)],
                None => [None, None],
            };
            ops.push(lin(&w.wo, &s.att, &s.o));
            residual(ops, attn_post);
            ops.push(norm(&w.ffn_norm));
            ops.push(lin(&w.w_gate, &s.xn, &s.g));
            ops.push(lin(&w.w_up, &s.xn, &s.u));
            let (gate, up, out, n) = (&s.g, &s.u, &s.a, (t * c.ffn_dim) as u32);
            ops.push(if c.family.gemma() {
                Op::GeluMul(GeluMul { gate, up, out, n })
            } else {
                Op::SiluMul(SiluMul { gate, up, out, n })
            });
            ops.push(lin(&w.w_down, &s.a, &s.o));
            residual(ops, ffn_post);
        }
    }

    fn encode_head<'a>(
        &'a self,
        s: &'a Scratch,
        t: usize,
        want: Want,
        ops: &mut Vec<Op<'a>>,
    ) -> Result<(), ModelError> {
        let row = (self.cfg.dim * 4) as u64;
        ops.push(Op::Copy(BufferCopy {
            src: &s.h,
            src_offset: (t as u64 - 1) * row,
            dst: &s.last,
            dst_offset: 0,
            bytes: row,
        }));
        self.encode_logits(&s.last, &s.last_norm, &s.logits, 1, ops)?;
        if let Want::Sample(params) = want {
            ops.push(Op::Sample(Sample {
                logits: &s.logits,
                n: self.cfg.vocab_size as u32,
                out: &s.token,
                params,
            }));
        }
        Ok(())
    }

    /// The final norm and the output head over `rows` hidden rows in `x` (`xn` holds the
    /// normed rows), logits into `y`: shared by sampling, last-token logits and scoring.
    fn encode_logits<'a>(
        &'a self,
        x: &'a Buffer,
        xn: &'a Buffer,
        y: &'a Buffer,
        rows: usize,
        ops: &mut Vec<Op<'a>>,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (norm, _) = self
            .weights
            .head
            .as_ref()
            .ok_or(ModelError::WrongInput("no output head"))?;
        let out = self
            .weights
            .output()
            .ok_or(ModelError::WrongInput("no output head"))?;
        ops.push(Op::RmsNorm(RmsNorm {
            x,
            weight: norm,
            y: xn,
            dim: c.dim as u32,
            tokens: rows as u32,
            eps: c.norm_eps,
        }));
        ops.push(Op::Linear(Linear {
            w: &out.buf,
            wtype: out.ty,
            x: xn,
            y,
            rows: out.rows as u32,
            cols: out.cols as u32,
            tokens: rows as u32,
        }));
        if c.final_softcap > 0.0 {
            ops.push(Op::ScaleCap(ScaleCap {
                x: y,
                n: (rows * c.vocab_size) as u32,
                scale: 1.0,
                cap: c.final_softcap,
            }));
        }
        Ok(())
    }
}

/// The bias of `m`, one of `w`'s Q, K and V products, where the family has biases.
fn qkv_bias_of<'a>(w: &'a weights::LayerWeights, m: &Matrix) -> Option<&'a Buffer> {
    let [bq, bk, bv] = w.qkv_bias.as_ref()?;
    if std::ptr::eq(m, &w.wq) {
        Some(bq)
    } else if std::ptr::eq(m, &w.wk) {
        Some(bk)
    } else {
        Some(bv)
    }
}

/// Device buffers for the output head over several positions at once.
struct HeadRows {
    h: Buffer,
    norm: Buffer,
    logits: Buffer,
}

impl Scratch {
    fn new(dev: &Device, c: &ModelConfig, b: usize) -> Result<Scratch, ModelError> {
        let f = |label: &str, n: usize| dev.alloc(label, (n * 4) as u64);
        Ok(Scratch {
            h: f("h", b * c.dim)?,
            xn: f("xn", b * c.dim)?,
            q: f("q", b * c.q_dim())?,
            k: f("k", b * c.kv_dim())?,
            v: f("v", b * c.kv_dim())?,
            pre_norm: if c.qk_norm {
                Some(f("pre_norm", b * c.q_dim().max(c.kv_dim()))?)
            } else {
                None
            },
            att: f("att", b * c.q_dim())?,
            o: f("o", b * c.dim)?,
            g: f("gate", b * c.ffn_dim)?,
            u: f("up", b * c.ffn_dim)?,
            a: f("act", b * c.ffn_dim)?,
            ids: f("ids", b)?,
            last: f("last", c.dim)?,
            last_norm: f("last_norm", c.dim)?,
            logits: f("logits", c.vocab_size)?,
            token: f("token", 1)?,
        })
    }
}

/// Where a pass's keys and values go: one sequence's own cache, or a batch's pool.
#[derive(Clone, Copy)]
enum Kv<'a> {
    Dense {
        cache: &'a KvCache,
        pos0: usize,
    },
    Paged {
        pool: &'a KvPool,
        batch: &'a BatchBuffers,
        table_len: u32,
    },
}

/// Device buffers of a batched pass: per row its position, pool slot and attention row, and
/// for the last shard the head over each sequence's last row and the tokens drawn.
struct BatchBuffers {
    positions: Buffer,
    slots: Buffer,
    rows: Buffer,
    head_h: Buffer,
    head_norm: Buffer,
    head_logits: Buffer,
    tokens: Buffer,
}

impl BatchBuffers {
    fn new(
        dev: &Device,
        c: &ModelConfig,
        b: usize,
        last: bool,
    ) -> Result<BatchBuffers, ModelError> {
        let f = |label: &str, n: usize| dev.alloc(label, (n.max(1) * 4) as u64);
        let seqs = if last { MAX_BATCH_SEQS } else { 1 };
        Ok(BatchBuffers {
            positions: f("batch positions", b)?,
            slots: f("batch slots", b)?,
            rows: f("batch rows", 2 * b)?,
            head_h: f("batch head h", seqs * c.dim)?,
            head_norm: f("batch head norm", seqs * c.dim)?,
            head_logits: f("batch logits", if last { seqs * c.vocab_size } else { 1 })?,
            tokens: f("batch tokens", seqs)?,
        })
    }
}

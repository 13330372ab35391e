//! A model shard: the blocks `[start, end)` of a dense decoder model (any supported
//! [`Family`](super::family::Family)) on one device, with the embedding when it starts at 0
//! and the output head when it ends at the last block.

use futures::lock::Mutex;

use super::ModelError;
use super::cache::KvCache;
use super::config::ModelConfig;
use super::kv_pool::{KV_BLOCK, KvPool, SeqKv};
use super::tensor_split::TensorPart;
use super::weights::{self, Matrix, ShardWeights};
use crate::backend::{Buffer, Device, PendingRead};
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
pub(super) struct Scratch {
    pub(super) h: Buffer,
    xn: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    /// Q or K before its per-head norm (families with `qk_norm` only).
    pre_norm: Option<Buffer>,
    att: Buffer,
    pub(super) o: Buffer,
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
    /// The heads and feed-forward rows of each layer this shard computes: all of them, or
    /// its part of a tensor-parallel split (`tensor_split.rs`).
    local: Local,
    weights: ShardWeights,
    pub(super) scratch: Mutex<Scratch>,
    /// A batched pass's own buffers, made on the first one.
    pub(super) batch: Mutex<Option<BatchBuffers>>,
}

/// A layer's widths as one shard computes them.
#[derive(Clone, Copy, Debug)]
pub(super) struct Local {
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    pub head_dim: usize,
}

impl Local {
    fn of(cfg: &ModelConfig, part: Option<&TensorPart>) -> Local {
        match part {
            None => Local {
                heads: cfg.n_heads,
                kv_heads: cfg.n_kv_heads,
                ffn: cfg.ffn_dim,
                head_dim: cfg.head_dim,
            },
            Some(p) => Local {
                heads: p.kv_heads.len() * (cfg.n_heads / cfg.n_kv_heads.max(1)),
                kv_heads: p.kv_heads.len(),
                ffn: p.ffn.len(),
                head_dim: cfg.head_dim,
            },
        }
    }
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
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

/// [`DEFAULT_MAX_BATCH`] on the cuda backend: its tensor-core tiles take 128 tokens of 128
/// weight rows, and at 256 tokens a 4096-row product is 128 such tiles, fewer than an H100
/// has multiprocessors. Measured on an H100, one call, synthetic 8B, 512-token prompt:
/// 6,863-6,914 tok/s in two submissions of 256, 8,250-8,296 in one of 512; SmolLM2's shapes
/// 55,481 and 91,582.
pub const CUDA_MAX_BATCH: usize = 512;

/// The most prompt tokens one submission takes on `dev` (what its scratch is sized for).
pub fn max_batch_for(dev: &Device) -> usize {
    match dev.kind() {
        crate::backend::BackendKind::Cuda => CUDA_MAX_BATCH,
        _ => DEFAULT_MAX_BATCH,
    }
}

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
        Self::load_part(dev, src, start, end, max_batch, None, progress)
    }

    /// Loads blocks `[start, end)` as [`Shard::load`] does, or with `part` only that part of
    /// each layer's heads and feed-forward rows (and the embedding and output head only where
    /// the part holds them): one device's share of a tensor-parallel stage.
    pub(super) fn load_part(
        dev: std::sync::Arc<Device>,
        src: &dyn TensorSource,
        start: usize,
        end: usize,
        max_batch: usize,
        part: Option<&TensorPart>,
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
        let local = Local::of(&cfg, part);
        let weights = weights::load(&dev, src, &cfg, start, end, part, progress)?;
        let scratch = Scratch::new(&dev, &cfg, &local, max_batch)?;
        Ok(Shard {
            cfg,
            start,
            end,
            max_batch,
            dev,
            local,
            weights,
            scratch: Mutex::new(scratch),
            batch: Mutex::new(None),
        })
    }

    #[cfg(test)]
    pub(super) fn local(&self) -> &Local {
        &self.local
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Whether this shard holds the output head (the last shard; of a tensor split, its
    /// first part only).
    pub(super) fn has_head(&self) -> bool {
        self.weights.head.is_some()
    }

    /// The final norm and the output head's matrix, where this shard holds the head (a tensor
    /// split's head over its devices, `head_split.rs`, takes the first rows of it).
    pub(super) fn head_weights(&self) -> Option<(&Buffer, &Matrix)> {
        let (norm, _) = self.weights.head.as_ref()?;
        Some((norm, self.weights.output()?))
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
            self.local.kv_dim(),
            capacity.max(1),
        )
    }

    /// A key/value pool for this shard's layers that may grow to `budget_bytes`.
    pub fn new_pool(&self, budget_bytes: u64) -> Result<KvPool, ModelError> {
        KvPool::new(
            &self.dev,
            self.end - self.start,
            self.local.kv_dim(),
            budget_bytes,
        )
    }

    /// Device bytes one position of one sequence takes in a pool of this shard.
    pub fn kv_bytes_per_position(&self) -> u64 {
        KvPool::block_bytes(self.end - self.start, self.local.kv_dim()) / KV_BLOCK as u64
    }

    /// How many rows `input` is, or why this shard does not take it with `want`.
    pub(super) fn rows_of(&self, input: ShardInput<'_>, want: Want) -> Result<usize, ModelError> {
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
        let mut results: Vec<Option<Result<ShardOutput, ModelError>>> =
            (0..items.len()).map(|_| None).collect();
        // Rows per live item; a refused item gets its error now.
        let mut rows = vec![0usize; items.len()];
        for (i, it) in items.iter_mut().enumerate() {
            let n = self.check_item(i, it.input, it.want);
            let reserved = n.and_then(|n| {
                let len = it.seq.len() + n;
                pool.reserve(&self.dev, it.seq, len).map(|_| n)
            });
            match reserved {
                Ok(n) => rows[i] = n,
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let per_pass = self.rows_per_pass(&rows);
        let mut done = vec![0usize; items.len()];
        let mut hidden: Vec<Vec<f32>> = vec![Vec::new(); items.len()];
        let s = self.scratch.lock().await;
        let mut guard = self.batch.lock().await;
        let b = self.batch_buffers(&mut guard)?;
        loop {
            let pass = next_pass(&rows, &done, per_pass);
            if pass.is_empty() {
                break;
            }
            let total = pass.iter().map(|p| p.2).sum();
            let table_len = self.write_pass(&s, b, pool, items, &pass)?;
            let kv = Kv::Paged {
                pool,
                batch: b,
                table_len,
            };
            let mut ops = Vec::with_capacity(16 * (self.end - self.start) + 8 + 3 * pass.len());
            self.encode_blocks(&s, kv, total, &mut ops);
            let heads = self.encode_pass_heads(&s, b, items, &pass, &rows, &mut ops)?;
            self.dev.run(&ops)?;
            for &(i, _, take) in &pass {
                items[i].seq.advance(take);
                done[i] += take;
            }
            self.collect_pass(&s, b, items, &pass, &heads, &mut hidden, &mut results)
                .await?;
        }
        Ok(self.finish_batch(results, hidden))
    }

    /// How many rows `input` is, or why it is refused as item `i` of a batch.
    pub(super) fn check_item(
        &self,
        i: usize,
        input: ShardInput<'_>,
        want: Want,
    ) -> Result<usize, ModelError> {
        if i >= MAX_BATCH_SEQS {
            return Err(ModelError::WrongInput(
                "more sequences than one batched pass takes",
            ));
        }
        self.rows_of(input, want)
    }

    /// Rows one pass holds: a batch of decode steps alone keeps to what the device runs well
    /// in one pass.
    pub(super) fn rows_per_pass(&self, rows: &[usize]) -> usize {
        let decode_only = rows.iter().all(|&n| n <= 1);
        match self.dev.decode_rows_per_pass() {
            Some(n) if decode_only => n.clamp(1, self.max_batch),
            _ => self.max_batch,
        }
    }

    /// The batch buffers in `guard`, made on the first pass.
    pub(super) fn batch_buffers<'g>(
        &self,
        guard: &'g mut Option<BatchBuffers>,
    ) -> Result<&'g BatchBuffers, ModelError> {
        if guard.is_none() {
            *guard = Some(BatchBuffers::new(
                &self.dev,
                &self.cfg,
                self.max_batch,
                self.has_head(),
            )?);
        }
        guard
            .as_ref()
            .ok_or(ModelError::WrongInput("batch buffers vanished"))
    }

    /// Writes a pass's inputs (token ids, or hidden rows), each row's position, pool slot
    /// and attention row, and the block tables of its sequences; returns the tables' length.
    pub(super) fn write_pass(
        &self,
        s: &Scratch,
        b: &BatchBuffers,
        pool: &KvPool,
        items: &[BatchItem<'_>],
        pass: &[(usize, usize, usize)],
    ) -> Result<u32, ModelError> {
        let dim = self.cfg.dim;
        let total: usize = pass.iter().map(|p| p.2).sum();
        let mut ids: Vec<u32> = Vec::new();
        let mut h_in: Vec<f32> = Vec::new();
        let mut positions = Vec::with_capacity(total);
        let mut slots = Vec::with_capacity(total);
        let mut meta = Vec::with_capacity(2 * total);
        let mut table: Vec<u32> = Vec::new();
        for &(i, from, take) in pass {
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
        Ok(table.len() as u32)
    }

    /// The head over the last row of each item that ends in this pass (last shard only): its
    /// logits, and a token drawn where it wants one. Returns `(item, head row)` of each.
    pub(super) fn encode_pass_heads<'a>(
        &'a self,
        s: &'a Scratch,
        b: &'a BatchBuffers,
        items: &[BatchItem<'_>],
        pass: &[(usize, usize, usize)],
        rows: &[usize],
        ops: &mut Vec<Op<'a>>,
    ) -> Result<Vec<(usize, usize)>, ModelError> {
        let mut heads: Vec<(usize, usize)> = Vec::new();
        if !self.is_last() {
            return Ok(heads);
        }
        let (dim, vocab) = (self.cfg.dim, self.cfg.vocab_size);
        let row = (dim * 4) as u64;
        let mut at = 0;
        for &(i, from, take) in pass {
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
            self.encode_logits(&b.head_h, &b.head_norm, &b.head_logits, heads.len(), ops)?;
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
        Ok(heads)
    }

    /// Reads what a pass produced: each item's hidden rows (below the last shard), or the
    /// tokens and logits of the items whose head ran.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn collect_pass(
        &self,
        s: &Scratch,
        b: &BatchBuffers,
        items: &[BatchItem<'_>],
        pass: &[(usize, usize, usize)],
        heads: &[(usize, usize)],
        hidden: &mut [Vec<f32>],
        results: &mut [Option<Result<ShardOutput, ModelError>>],
    ) -> Result<(), ModelError> {
        let (dim, vocab) = (self.cfg.dim, self.cfg.vocab_size);
        if !self.is_last() {
            let total: usize = pass.iter().map(|p| p.2).sum();
            let bytes = self.dev.read(&s.h, 0, (total * dim * 4) as u64).await?;
            let vals: &[f32] = bytemuck::cast_slice(&bytes);
            let mut at = 0;
            for &(i, _, take) in pass {
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
            for &(i, k) in heads {
                results[i] = Some(Ok(match items[i].want {
                    Want::Sample(_) => ShardOutput::Token(toks[k]),
                    _ => ShardOutput::Logits(logits[k * vocab..(k + 1) * vocab].to_vec()),
                }));
            }
        }
        Ok(())
    }

    /// Every item's result: what its passes gave, its hidden rows below the last shard.
    pub(super) fn finish_batch(
        &self,
        mut results: Vec<Option<Result<ShardOutput, ModelError>>>,
        hidden: Vec<Vec<f32>>,
    ) -> Vec<Result<ShardOutput, ModelError>> {
        if !self.is_last() {
            for (i, h) in hidden.into_iter().enumerate() {
                if results[i].is_none() {
                    results[i] = Some(Ok(ShardOutput::Hidden(h)));
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(ModelError::WrongInput("a batch item produced nothing"))))
            .collect()
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

    /// Queues a pass of the whole model (this shard must hold it) at the cache's next
    /// positions that ends in a token drawn on the device, without waiting for it: over
    /// `prompt` where given, else over the one token the previous pass drew (still on the
    /// device, copied into the input ids by this pass's first op). The token comes with
    /// [`crate::Device::collect`]; until then further passes may be queued behind it
    /// (`generate`'s pipelined decode). The cache counts the positions as written at once.
    /// `s` is this shard's scratch, locked by the caller for the whole generation: between
    /// two queued passes the drawn token lives only in `s.token`, which no other pass may
    /// overwrite.
    pub(super) async fn queue_sample(
        &self,
        s: &Scratch,
        cache: &mut KvCache,
        prompt: Option<&[u32]>,
        params: SampleParams,
    ) -> Result<PendingRead, ModelError> {
        let want = Want::Sample(params);
        let n = match prompt {
            Some(ids) => self.rows_of(ShardInput::Tokens(ids), want)?,
            None => 1,
        };
        if !(self.is_first() && self.is_last()) {
            return Err(ModelError::WrongInput(
                "this needs a shard holding the whole model",
            ));
        }
        if cache.len() + n > cache.capacity() {
            return Err(ModelError::ContextFull {
                needed: cache.len() + n,
                capacity: cache.capacity(),
            });
        }
        let mut done = 0;
        loop {
            let t = (n - done).min(self.max_batch);
            let mut ops = Vec::with_capacity(16 * (self.end - self.start) + 8);
            match prompt {
                Some(ids) => {
                    self.dev
                        .write(&s.ids, 0, bytemuck::cast_slice(&ids[done..done + t]))?
                }
                None => ops.push(Op::Copy(BufferCopy {
                    src: &s.token,
                    src_offset: 0,
                    dst: &s.ids,
                    dst_offset: 0,
                    bytes: 4,
                })),
            }
            let pos0 = cache.len();
            self.encode_blocks(s, Kv::Dense { cache, pos0 }, t, &mut ops);
            done += t;
            if done == n {
                self.encode_head(s, t, want, &mut ops)?;
                let read = self.dev.run_then_read(&ops, &s.token, 0, 4).await?;
                cache.advance(t);
                return Ok(read);
            }
            self.dev.run(&ops)?;
            cache.advance(t);
        }
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
        self.encode_embed(s, t, ops);
        for i in 0..self.weights.layers.len() {
            self.encode_attention(s, kv, t, i, ops);
            self.encode_residual(s, t, self.post_norm(i, 0), ops);
            self.encode_ffn(s, t, i, ops);
            self.encode_residual(s, t, self.post_norm(i, 1), ops);
        }
    }

    /// The token embedding into `h` (the shard holding it only).
    pub(super) fn encode_embed<'a>(&'a self, s: &'a Scratch, t: usize, ops: &mut Vec<Op<'a>>) {
        if let Some(e) = &self.weights.embed {
            encode_embed_from(&self.cfg, e, s, t, ops);
        }
    }

    /// Gemma's norm of layer `i`'s attention output (`which` 0) or FFN output (1).
    pub(super) fn post_norm(&self, i: usize, which: usize) -> Option<&Buffer> {
        self.weights.layers[i]
            .post_norms
            .as_ref()
            .map(|norms| &norms[which])
    }

    /// The number of layers this shard holds.
    pub(super) fn layer_count(&self) -> usize {
        self.weights.layers.len()
    }

    fn lin<'a>(&self, m: &'a Matrix, x: &'a Buffer, y: &'a Buffer, t: usize) -> Op<'a> {
        Op::Linear(Linear {
            w: &m.buf,
            wtype: m.ty,
            x,
            y,
            rows: m.rows as u32,
            cols: m.cols as u32,
            tokens: t as u32,
        })
    }

    fn pre_norm<'a>(&self, s: &'a Scratch, weight: &'a Buffer, t: usize) -> Op<'a> {
        Op::RmsNorm(RmsNorm {
            x: &s.h,
            weight,
            y: &s.xn,
            dim: self.cfg.dim as u32,
            tokens: t as u32,
            eps: self.cfg.norm_eps,
        })
    }

    /// Layer `i`'s attention up to its output product, into `o` (of a tensor split, this
    /// part's heads' share of it).
    pub(super) fn encode_attention<'a>(
        &'a self,
        s: &'a Scratch,
        kv: Kv<'a>,
        t: usize,
        i: usize,
        ops: &mut Vec<Op<'a>>,
    ) {
        let (pos0, positions) = match kv {
            Kv::Dense { pos0, .. } => (pos0, None),
            Kv::Paged { batch, .. } => (0, Some(&batch.positions)),
        };
        let c = &self.cfg;
        let l = &self.local;
        let tk = t as u32;
        let kv_row = (l.kv_dim() * 4) as u64;
        let w = &self.weights.layers[i];
        let layer = self.start + i;
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
        ops.push(self.pre_norm(s, &w.attn_norm, t));
        match (&w.qk_norm, &s.pre_norm) {
            (Some([qn, kn]), Some(pre)) => {
                // One norm per head (rows of head_dim, a weight every head shares), from
                // the product's own buffer: a kernel's input and output are never one.
                for (m, out, weight, heads) in
                    [(&w.wq, &s.q, qn, l.heads), (&w.wk, &s.k, kn, l.kv_heads)]
                {
                    ops.push(self.lin(m, &s.xn, pre, t));
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
                ops.push(self.lin(&w.wq, &s.xn, &s.q, t));
                ops.push(self.lin(&w.wk, &s.xn, &s.k, t));
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
        ops.push(self.lin(&w.wv, &s.xn, &s.v, t));
        if let Some(bias) = qkv_bias_of(w, &w.wv) {
            ops.push(Op::AddBias(AddBias {
                x: &s.v,
                bias,
                cols: l.kv_dim() as u32,
                tokens: tk,
            }));
        }
        ops.push(rope(&s.q, l.heads));
        ops.push(rope(&s.k, l.kv_heads));
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
                    heads: l.heads as u32,
                    kv_heads: l.kv_heads as u32,
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
                    kv_dim: l.kv_dim() as u32,
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
                    heads: l.heads as u32,
                    kv_heads: l.kv_heads as u32,
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
        ops.push(self.lin(&w.wo, &s.att, &s.o, t));
    }

    /// The residual: `h += o`, or with Gemma's post norm `post` `h += norm(o)` (normed into
    /// `xn`, free until the next pre-norm).
    pub(super) fn encode_residual<'a>(
        &'a self,
        s: &'a Scratch,
        t: usize,
        post: Option<&'a Buffer>,
        ops: &mut Vec<Op<'a>>,
    ) {
        let c = &self.cfg;
        let b = match post {
            Some(weight) => {
                ops.push(Op::RmsNorm(RmsNorm {
                    x: &s.o,
                    weight,
                    y: &s.xn,
                    dim: c.dim as u32,
                    tokens: t as u32,
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
    }

    /// Layer `i`'s feed-forward block up to its down product, into `o` (of a tensor split,
    /// this part's rows' share of it).
    pub(super) fn encode_ffn<'a>(
        &'a self,
        s: &'a Scratch,
        t: usize,
        i: usize,
        ops: &mut Vec<Op<'a>>,
    ) {
        self.encode_ffn_into(s, t, i, &s.o, ops);
    }

    /// [`Shard::encode_ffn`] with the down product into `out` (a tensor split's peer sums
    /// alternate two buffers, so a device may write its next partial while the others still
    /// read its last).
    pub(super) fn encode_ffn_into<'a>(
        &'a self,
        s: &'a Scratch,
        t: usize,
        i: usize,
        out: &'a Buffer,
        ops: &mut Vec<Op<'a>>,
    ) {
        let w = &self.weights.layers[i];
        ops.push(self.pre_norm(s, &w.ffn_norm, t));
        ops.push(self.lin(&w.w_gate, &s.xn, &s.g, t));
        ops.push(self.lin(&w.w_up, &s.xn, &s.u, t));
        let (gate, up, act, n) = (&s.g, &s.u, &s.a, (t * self.local.ffn) as u32);
        ops.push(if self.cfg.family.gemma() {
            Op::GeluMul(GeluMul {
                gate,
                up,
                out: act,
                n,
            })
        } else {
            Op::SiluMul(SiluMul {
                gate,
                up,
                out: act,
                n,
            })
        });
        ops.push(self.lin(&w.w_down, act, out, t));
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

/// The embedding of the `t` token ids in `s.ids` from `table` into `s.h` (a shard's own
/// embedding, or a tensor split's copy of it on another device, `embed_copies.rs`).
pub(super) fn encode_embed_from<'a>(
    c: &ModelConfig,
    table: &'a Matrix,
    s: &'a Scratch,
    t: usize,
    ops: &mut Vec<Op<'a>>,
) {
    ops.push(Op::Embed(Embed {
        table: &table.buf,
        ttype: table.ty,
        ids: &s.ids,
        out: &s.h,
        dim: c.dim as u32,
        vocab: table.rows as u32,
        tokens: t as u32,
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
    fn new(dev: &Device, c: &ModelConfig, l: &Local, b: usize) -> Result<Scratch, ModelError> {
        let f = |label: &str, n: usize| dev.alloc(label, (n * 4) as u64);
        Ok(Scratch {
            h: f("h", b * c.dim)?,
            xn: f("xn", b * c.dim)?,
            q: f("q", b * l.q_dim())?,
            k: f("k", b * l.kv_dim())?,
            v: f("v", b * l.kv_dim())?,
            pre_norm: if c.qk_norm {
                Some(f("pre_norm", b * l.q_dim().max(l.kv_dim()))?)
            } else {
                None
            },
            att: f("att", b * l.q_dim())?,
            o: f("o", b * c.dim)?,
            g: f("gate", b * l.ffn)?,
            u: f("up", b * l.ffn)?,
            a: f("act", b * l.ffn)?,
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
pub(super) enum Kv<'a> {
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
pub(super) struct BatchBuffers {
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
        head: bool,
    ) -> Result<BatchBuffers, ModelError> {
        let f = |label: &str, n: usize| dev.alloc(label, (n.max(1) * 4) as u64);
        let seqs = if head { MAX_BATCH_SEQS } else { 1 };
        Ok(BatchBuffers {
            positions: f("batch positions", b)?,
            slots: f("batch slots", b)?,
            rows: f("batch rows", 2 * b)?,
            head_h: f("batch head h", seqs * c.dim)?,
            head_norm: f("batch head norm", seqs * c.dim)?,
            head_logits: f("batch logits", if head { seqs * c.vocab_size } else { 1 })?,
            tokens: f("batch tokens", seqs)?,
        })
    }
}

/// The next pass: `(item, first row, rows)` in item order, up to `per_pass` rows, of each
/// item's rows not yet `done`.
pub(super) fn next_pass(
    rows: &[usize],
    done: &[usize],
    per_pass: usize,
) -> Vec<(usize, usize, usize)> {
    let mut pass = Vec::new();
    let mut total = 0;
    for i in 0..rows.len() {
        let left = rows[i] - done[i];
        if left == 0 || total == per_pass {
            continue;
        }
        let take = left.min(per_pass - total);
        pass.push((i, done[i], take));
        total += take;
    }
    pass
}

//! A stage's layers split over several devices of one host, run back to back (one
//! sequence) or as a pipeline of micro-batches, a thread per piece (several; `pipeline.rs`).
//!
//! A worker that drives several local devices (two GPUs, say) serves one layer range as a
//! stack of [`Shard`]s, one per device, each over a contiguous part of the range. A pass
//! runs the pieces in order and hands each piece's hidden states to the next inside the
//! process, so the only cost between devices is the copy of a few rows of activations,
//! never a network hop. Each piece keeps its own key/value pool on its own device, and
//! each sequence holds blocks in every piece's pool.
//!
//! A single device is a stack of one, so the stage has one code path.
//!
//! The same devices can instead split every layer of the range by its tensors
//! ([`Split::Tensor`], `tensor_split.rs`): each piece is then one device's part of every
//! layer, and a pass runs them side by side, summing their partial products twice a layer.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::embed_copies::EmbedCopies;
use super::head_split::HeadSplit;
#[cfg(not(target_arch = "wasm32"))]
use super::pipeline;
use super::shard::{BatchItem, max_batch_for};
use super::tensor_split::{self, TensorSplit};
use super::{KvPool, ModelConfig, ModelError, SeqKv, Shard, ShardInput, ShardOutput, Want};
use crate::backend::Device;
use crate::gguf::TensorSource;

/// How a stage's layers are spread over several devices of one host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Split {
    /// Each device a contiguous run of the layers (a pipeline inside the process).
    #[default]
    Layers,
    /// Each device a part of every layer: its attention heads and feed-forward rows.
    Tensor,
    /// `Tensor` where it measured faster: every device can read the others' memory (the sums
    /// then run on the GPUs) and the model is wide (hidden size [`AUTO_TENSOR_MIN_DIM`] and
    /// up) and not of a family with post norms; `Layers` otherwise.
    Auto,
}

/// The narrowest hidden size `Split::Auto` splits by tensors. On two H200s (session 16) the
/// 8B shape (4,096) split by tensors decoded at 1.01x one device, 16 at once 1.39x and
/// prefilled 1.15x, where SmolLM2-135M (576) lost a third: its products are too small to
/// share. Sizes between were not measured, so they keep the layers.
pub const AUTO_TENSOR_MIN_DIM: usize = 4096;

impl std::str::FromStr for Split {
    type Err = String;
    fn from_str(s: &str) -> Result<Split, String> {
        match s {
            "layers" | "layer" => Ok(Split::Layers),
            "tensor" | "tensors" => Ok(Split::Tensor),
            "auto" => Ok(Split::Auto),
            other => Err(format!(
                "'{other}' is not a split; choose layers, tensor or auto"
            )),
        }
    }
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Split::Layers => "layers",
            Split::Tensor => "tensor",
            Split::Auto => "auto",
        })
    }
}

/// Layers `start..end` over several devices, in order.
pub struct ShardStack {
    pieces: Vec<Shard>,
    /// Each piece's index in the device list it was loaded over.
    devices: Vec<usize>,
    /// Set when the pieces are the parts of a tensor split rather than runs of layers.
    tensor: Option<TensorSplit>,
    /// Tests (`dev-hooks` builds): the device whose next pass fails, as a lost GPU's would.
    #[cfg(feature = "dev-hooks")]
    fail: std::sync::Mutex<Option<usize>>,
}

/// One key/value pool per piece, each on its piece's device. A clone is another handle to the
/// same pools: passes over different sequences may run on different threads at once
/// ([`ShardStack::forward_in_order`]), each holding a piece's pool only while it runs that
/// piece.
#[derive(Clone)]
pub struct StackPool {
    pools: Arc<[Mutex<KvPool>]>,
}

/// A piece's pool, whichever pass held it last (a pass that panicked leaves its blocks as
/// they were: the pool's own bookkeeping is updated before any kernel runs).
fn lock(pool: &Mutex<KvPool>) -> MutexGuard<'_, KvPool> {
    pool.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One sequence's blocks in every piece's pool.
pub struct StackSeq {
    seqs: Vec<SeqKv>,
}

/// One sequence's part of a batched pass over a stack.
pub struct StackItem<'a> {
    pub seq: &'a mut StackSeq,
    pub input: ShardInput<'a>,
    pub want: Want,
}

/// Splits `start..end` into one contiguous part per weight (in order), each part's layer
/// count proportional to its weight (a device's memory, as llama.cpp splits layers across
/// local GPUs), every part at least one layer while there are enough. Parts of zero layers
/// are left out; the result lists `(index, start, end)`.
pub fn split_range(start: usize, end: usize, weights: &[f64]) -> Vec<(usize, usize, usize)> {
    let layers = end.saturating_sub(start);
    let usable: Vec<f64> = weights
        .iter()
        .map(|w| if w.is_finite() && *w > 0.0 { *w } else { 0.0 })
        .collect();
    let total: f64 = usable.iter().sum();
    let n = usable.len();
    if n == 0 || layers == 0 {
        return Vec::new();
    }
    // Counts by largest remainder, so they sum to `layers` exactly.
    let mut counts: Vec<usize> = vec![0; n];
    if total > 0.0 {
        let exact: Vec<f64> = usable.iter().map(|w| w / total * layers as f64).collect();
        for (c, e) in counts.iter_mut().zip(&exact) {
            *c = e.floor() as usize;
        }
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| {
            let ra = exact[a] - exact[a].floor();
            let rb = exact[b] - exact[b].floor();
            rb.total_cmp(&ra).then(a.cmp(&b))
        });
        let mut left = layers - counts.iter().sum::<usize>();
        for &i in order.iter().cycle().take(n * 2) {
            if left == 0 {
                break;
            }
            if usable[i] > 0.0 {
                counts[i] += 1;
                left -= 1;
            }
        }
    } else {
        counts[0] = layers;
    }
    // Every usable part holds at least one layer when there are layers enough: take it
    // from the largest part.
    for i in 0..n {
        if usable[i] > 0.0
            && counts[i] == 0
            && let Some(big) = (0..n).filter(|&j| counts[j] > 1).max_by_key(|&j| counts[j])
        {
            counts[big] -= 1;
            counts[i] += 1;
        }
    }
    let mut parts = Vec::new();
    let mut at = start;
    for (i, c) in counts.into_iter().enumerate() {
        if c > 0 {
            parts.push((i, at, at + c));
            at += c;
        }
    }
    parts
}

impl ShardStack {
    /// One piece per part of `start..end` ([`split_range`] by each device's memory budget),
    /// each loaded onto its device; `progress(done, total)` reports bytes over all pieces.
    pub fn load(
        devices: &[(Arc<Device>, u64)],
        src: &dyn TensorSource,
        start: usize,
        end: usize,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<ShardStack, ModelError> {
        let weights: Vec<f64> = devices.iter().map(|(_, b)| *b as f64).collect();
        let parts = split_range(start, end, &weights);
        if parts.is_empty() {
            return Err(ModelError::WrongInput("no device to load a stage onto"));
        }
        let mut pieces = Vec::with_capacity(parts.len());
        let mut indices = Vec::with_capacity(parts.len());
        for (i, a, b) in parts {
            let dev = Arc::clone(&devices[i].0);
            let max_batch = max_batch_for(&dev);
            pieces.push(Shard::load(dev, src, a, b, max_batch, progress)?);
            indices.push(i);
        }
        Ok(ShardStack::of(pieces, indices))
    }

    /// Layers `start..end` over `devices` as `split` says: by layers ([`Self::load`]), or
    /// every layer by its tensors, one part per device ([`tensor_split::plan`] says how, or
    /// why the model's shapes do not split over that many).
    pub fn load_split(
        devices: &[(Arc<Device>, u64)],
        src: &dyn TensorSource,
        start: usize,
        end: usize,
        split: Split,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<ShardStack, ModelError> {
        if split == Split::Layers || devices.len() < 2 {
            return Self::load(devices, src, start, end, progress);
        }
        let cfg = ModelConfig::from_gguf(src.gguf())?;
        if split == Split::Auto {
            let devs: Vec<&Device> = devices.iter().map(|(d, _)| &**d).collect();
            let tensor = cfg.dim >= AUTO_TENSOR_MIN_DIM
                && !cfg.family.gemma()
                && Device::enable_peers(&devs);
            if !tensor {
                return Self::load(devices, src, start, end, progress);
            }
            match Self::load_split(devices, src, start, end, Split::Tensor, progress) {
                Err(ModelError::TensorSplit(why)) => {
                    tracing::info!(%why, "automatic split: by layers, the tensors do not split");
                    return Self::load(devices, src, start, end, progress);
                }
                other => return other,
            }
        }
        if start >= end || end > cfg.n_layers {
            return Err(ModelError::BadRange {
                start,
                end,
                n_layers: cfg.n_layers,
            });
        }
        let parts = tensor_split::plan(src.gguf(), &cfg, start, end, devices.len())?;
        // One row count for every part: the lanes' partial sums are sized by the lead's.
        let max_batch = devices
            .iter()
            .map(|(d, _)| max_batch_for(d))
            .min()
            .unwrap_or(super::shard::DEFAULT_MAX_BATCH);
        let mut pieces = Vec::with_capacity(parts.len());
        for ((dev, _), part) in devices.iter().zip(&parts) {
            pieces.push(Shard::load_part(
                Arc::clone(dev),
                src,
                start,
                end,
                max_batch,
                Some(part),
                progress,
            )?);
        }
        let mut tensor = TensorSplit::new(&pieces)?;
        if pieces[0].is_last() && super::head_split::wanted() {
            tensor.head = Some(HeadSplit::load(&pieces, src)?);
        }
        if pieces[0].is_first() && super::embed_copies::wanted() {
            tensor.embeds = Some(EmbedCopies::load(&pieces, src)?);
        }
        let mut stack = ShardStack::of(pieces, (0..devices.len()).collect());
        stack.tensor = Some(tensor);
        Ok(stack)
    }

    /// Tests: a tensor split's head back on the first device alone, as `CAIRN_HEAD_SPLIT=off`
    /// loads it.
    #[cfg(test)]
    pub(super) fn without_head_split(&mut self) {
        if let Some(t) = &mut self.tensor {
            t.head = None;
        }
    }

    /// Tests: a tensor split's embedding on the first device alone, as
    /// `CAIRN_EMBED_COPIES=off` loads it.
    #[cfg(test)]
    pub(super) fn without_embed_copies(&mut self) {
        if let Some(t) = &mut self.tensor {
            t.embeds = None;
        }
    }

    /// How the stack's layers are spread over its devices.
    pub fn split(&self) -> Split {
        if self.tensor.is_some() {
            Split::Tensor
        } else {
            Split::Layers
        }
    }

    fn of(pieces: Vec<Shard>, devices: Vec<usize>) -> ShardStack {
        ShardStack {
            pieces,
            devices,
            tensor: None,
            #[cfg(feature = "dev-hooks")]
            fail: std::sync::Mutex::new(None),
        }
    }

    /// A stack of one shard.
    pub fn single(shard: Shard) -> ShardStack {
        ShardStack::of(vec![shard], vec![0])
    }

    /// Tests (`dev-hooks` builds): the next pass fails on device `index` of the list the
    /// stack was loaded over, as a lost device's would.
    #[cfg(feature = "dev-hooks")]
    pub fn fail_device(&self, index: usize) {
        if let Ok(mut f) = self.fail.lock() {
            *f = Some(index);
        }
    }

    /// An error of piece `p`'s device, named by its index in the device list.
    fn device_failed(&self, p: usize, e: ModelError) -> ModelError {
        match e {
            ModelError::Backend(b) if self.pieces.len() > 1 => ModelError::DeviceFailed {
                index: self.devices[p],
                text: b.to_string(),
            },
            other => other,
        }
    }

    pub fn pieces(&self) -> &[Shard] {
        &self.pieces
    }

    fn first(&self) -> &Shard {
        &self.pieces[0]
    }

    fn last(&self) -> &Shard {
        &self.pieces[self.pieces.len() - 1]
    }

    pub fn config(&self) -> &ModelConfig {
        self.first().config()
    }

    pub fn range(&self) -> (usize, usize) {
        (self.first().range().0, self.last().range().1)
    }

    /// The most rows one pass of every piece takes without splitting it further.
    pub fn max_batch(&self) -> usize {
        self.pieces.iter().map(Shard::max_batch).min().unwrap_or(1)
    }

    pub fn is_first(&self) -> bool {
        self.first().is_first()
    }

    pub fn is_last(&self) -> bool {
        self.last().is_last()
    }

    /// Device bytes one position of one sequence takes over all pieces.
    pub fn kv_bytes_per_position(&self) -> u64 {
        self.pieces.iter().map(Shard::kv_bytes_per_position).sum()
    }

    /// Each piece's index in the device list the stack was loaded over.
    pub fn device_indices(&self) -> &[usize] {
        &self.devices
    }

    /// A pool per piece; `budget(piece)` gives each its bytes.
    pub fn new_pool(&self, budget: impl Fn(&Shard) -> u64) -> Result<StackPool, ModelError> {
        let pools = self
            .pieces
            .iter()
            .map(|p| p.new_pool(budget(p)).map(Mutex::new))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(StackPool {
            pools: pools.into(),
        })
    }

    /// Runs every item's rows through the pieces in order ([`Shard::forward_batch`] on
    /// each): a piece's hidden states are the next piece's input. An item that fails on a
    /// piece fails alone and skips the rest; an error of a device fails the call.
    pub async fn forward_batch(
        &self,
        pool: &mut StackPool,
        items: &mut [StackItem<'_>],
    ) -> Result<Vec<Result<ShardOutput, ModelError>>, ModelError> {
        if let Some(split) = &self.tensor {
            #[cfg(feature = "dev-hooks")]
            if let Ok(mut f) = self.fail.lock()
                && let Some(index) = f.take_if(|i| *i < self.pieces.len())
            {
                return Err(ModelError::DeviceFailed {
                    index,
                    text: "failed on purpose (CAIRN_DEBUG_FAIL_DEVICE)".into(),
                });
            }
            let mut guards = pool.lock_all();
            let mut pools: Vec<&mut KvPool> = guards.iter_mut().map(|g| &mut **g).collect();
            return tensor_split::forward_batch(&self.pieces, split, &mut pools, items)
                .await
                .map_err(|(p, e)| self.device_failed(p, e));
        }
        #[cfg(not(target_arch = "wasm32"))]
        {
            let micro = pipeline::micro_batches(items.len(), self.pieces.len());
            if micro > 1 {
                return self.forward_pipelined(pool, items, micro);
            }
        }
        self.forward_in_order(pool, items).await
    }

    /// [`Self::forward_batch`] over pieces split by layers, one after the other as one batch,
    /// holding each piece's pool only while it runs that piece: another pass over other
    /// sequences (on another thread, with a clone of `pool`) can run the first piece while
    /// this one runs the second (the stage's passes in flight across steps,
    /// `native/src/worker/stage_thread/overlap.rs`).
    // A piece's pool stays locked across its pass's awaits: the futures are driven to the end
    // on one thread (pollster, on the stage's thread or a pass's own), and the only other
    // holders are the threads of other passes, which wait for it; a browser runs one pass at
    // a time.
    #[allow(clippy::await_holding_lock)]
    pub async fn forward_in_order(
        &self,
        pool: &StackPool,
        items: &mut [StackItem<'_>],
    ) -> Result<Vec<Result<ShardOutput, ModelError>>, ModelError> {
        let n = items.len();
        if self.tensor.is_some()
            || items
                .iter()
                .any(|it| it.seq.seqs.len() != self.pieces.len())
        {
            return Err(ModelError::WrongInput("a sequence not made for this stage"));
        }
        let mut results: Vec<Option<Result<ShardOutput, ModelError>>> =
            (0..n).map(|_| None).collect();
        // Hidden states between pieces, per item.
        let mut carried: Vec<Option<Vec<f32>>> = vec![None; n];
        let last = self.pieces.len() - 1;
        for (p, (shard, kv)) in self.pieces.iter().zip(pool.pools.iter()).enumerate() {
            let live: Vec<usize> = (0..n).filter(|&i| results[i].is_none()).collect();
            if live.is_empty() {
                break;
            }
            let outs = {
                let mut batch: Vec<BatchItem> = Vec::with_capacity(live.len());
                // Each live item, with its input for this piece.
                for (i, item) in items.iter_mut().enumerate() {
                    if results[i].is_some() {
                        continue;
                    }
                    let input = if p == 0 {
                        item.input
                    } else {
                        match &carried[i] {
                            Some(h) => ShardInput::Hidden(h),
                            None => ShardInput::Hidden(&[]),
                        }
                    };
                    batch.push(BatchItem {
                        seq: &mut item.seq.seqs[p],
                        input,
                        want: if p == last { item.want } else { Want::Hidden },
                    });
                }
                #[cfg(feature = "dev-hooks")]
                if let Ok(mut f) = self.fail.lock()
                    && *f == Some(self.devices[p])
                {
                    *f = None;
                    return Err(ModelError::DeviceFailed {
                        index: self.devices[p],
                        text: "failed on purpose (CAIRN_DEBUG_FAIL_DEVICE)".into(),
                    });
                }
                // Held across this piece's pass only.
                let mut kv = lock(kv);
                shard
                    .forward_batch(&mut kv, &mut batch)
                    .await
                    .map_err(|e| self.device_failed(p, e))?
            };
            for (i, out) in live.into_iter().zip(outs) {
                match out {
                    Ok(ShardOutput::Hidden(h)) if p < last => carried[i] = Some(h),
                    Ok(other) if p < last => {
                        results[i] = Some(Ok(other));
                    }
                    Ok(out) => results[i] = Some(Ok(out)),
                    Err(e) => results[i] = Some(Err(e)),
                }
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or(Err(ModelError::WrongInput("a piece gave no output"))))
            .collect())
    }
}

impl ShardStack {
    /// [`Self::forward_batch`] over pieces split by layers as a pipeline of `micro`
    /// micro-batches, each piece on a thread of its own (`pipeline.rs`).
    #[cfg(not(target_arch = "wasm32"))]
    pub(super) fn forward_pipelined(
        &self,
        pool: &mut StackPool,
        items: &mut [StackItem<'_>],
        micro: usize,
    ) -> Result<Vec<Result<ShardOutput, ModelError>>, ModelError> {
        let count = self.pieces.len();
        let inputs: Vec<ShardInput> = items.iter().map(|it| it.input).collect();
        let wants: Vec<Want> = items.iter().map(|it| it.want).collect();
        // Each piece's part of every item's sequence.
        let mut seqs: Vec<Vec<&mut SeqKv>> = (0..count)
            .map(|_| Vec::with_capacity(items.len()))
            .collect();
        for it in items.iter_mut() {
            if it.seq.seqs.len() != count {
                return Err(ModelError::WrongInput("a sequence not made for this stage"));
            }
            for (piece, s) in seqs.iter_mut().zip(it.seq.seqs.iter_mut()) {
                piece.push(s);
            }
        }
        #[cfg(feature = "dev-hooks")]
        let fail = self.fail.lock().ok().and_then(|mut f| {
            let index = f.take_if(|i| self.devices.contains(i))?;
            let piece = self.devices.iter().position(|d| *d == index)?;
            Some((piece, index))
        });
        #[cfg(not(feature = "dev-hooks"))]
        let fail = None;
        let mut guards = pool.lock_all();
        let mut pools: Vec<&mut KvPool> = guards.iter_mut().map(|g| &mut **g).collect();
        pipeline::forward(&self.pieces, &mut pools, seqs, &inputs, &wants, micro, fail)
            .map_err(|(p, e)| self.device_failed(p, e))
    }
}

impl StackPool {
    /// Takes back every piece's blocks of `seq`.
    pub fn release(&mut self, seq: &mut StackSeq) {
        for (pool, s) in self.pools.iter().zip(&mut seq.seqs) {
            lock(pool).release(s);
        }
    }

    /// Every piece's pool, held until the guards drop (a pass over all of them at once).
    fn lock_all(&self) -> Vec<MutexGuard<'_, KvPool>> {
        self.pools.iter().map(|p| lock(p)).collect()
    }

    /// `f` of each piece's pool, in piece order.
    pub fn each<T>(&self, mut f: impl FnMut(&KvPool) -> T) -> Vec<T> {
        self.pools.iter().map(|p| f(&lock(p))).collect()
    }
}

impl StackSeq {
    /// A sequence of up to `limit` positions over a stack of `pieces`, holding nothing yet.
    pub fn new(pieces: usize, limit: usize) -> StackSeq {
        StackSeq {
            seqs: (0..pieces.max(1)).map(|_| SeqKv::new(limit)).collect(),
        }
    }

    /// Each piece's blocks of the sequence.
    pub(super) fn parts_mut(&mut self) -> &mut [SeqKv] {
        &mut self.seqs
    }

    /// Positions held (every piece holds the same).
    pub fn len(&self) -> usize {
        self.seqs.first().map_or(0, SeqKv::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn truncate(&mut self, len: usize) {
        for s in &mut self.seqs {
            s.truncate(len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::split_range;

    #[test]
    fn split_follows_the_weights_and_covers_the_range() {
        assert_eq!(
            split_range(0, 30, &[1.0, 1.0]),
            vec![(0, 0, 15), (1, 15, 30)]
        );
        assert_eq!(
            split_range(4, 14, &[3.0, 1.0]),
            vec![(0, 4, 12), (1, 12, 14)],
            "7.5 and 2.5 round to 8 and 2 (largest remainder, the first on a tie)"
        );
        // Every device gets a layer while there are enough, even a small one.
        assert_eq!(split_range(0, 4, &[100.0, 1.0]), vec![(0, 0, 3), (1, 3, 4)]);
        // Fewer layers than devices: the first ones get them.
        assert_eq!(split_range(0, 1, &[1.0, 1.0]), vec![(0, 0, 1)]);
        // A device with no budget (or a NaN one) gets nothing.
        assert_eq!(
            split_range(0, 6, &[1.0, 0.0, f64::NAN, 1.0]),
            vec![(0, 0, 3), (3, 3, 6)]
        );
        assert_eq!(split_range(0, 5, &[0.0, 0.0]), vec![(0, 0, 5)]);
        assert!(split_range(3, 3, &[1.0]).is_empty());
        for n in 1..40 {
            let parts = split_range(2, 2 + n, &[5.0, 3.0, 2.0, 7.0]);
            assert_eq!(parts.first().map(|p| p.1), Some(2));
            assert_eq!(parts.last().map(|p| p.2), Some(2 + n));
            assert!(
                parts
                    .windows(2)
                    .all(|w| w[0].2 == w[1].1 && w[0].0 < w[1].0)
            );
        }
    }
}

//! A stage's layers split across several devices of one host by their tensors (tensor
//! parallelism), not by layers.
//!
//! Every device holds every layer of the stage, but only its part of each: a contiguous run
//! of key/value heads with the query heads that read them (so grouped-query attention stays
//! on one device), those heads' rows of Q, K and V and their columns of the output product,
//! and a run of feed-forward rows (rows of gate and up, the same columns of down). Each
//! device computes the attention of its heads over its own keys and values (its pool holds
//! only its heads) and a partial output product; the partials are summed (an all-reduce) and
//! every device adds the sum to its own copy of the hidden states, which stay identical on
//! all of them. The same again for the feed-forward block: two all-reduces per layer.
//!
//! The all-reduce gathers the partials onto the first device with [`Device::copy_to`] (peer
//! to peer between CUDA devices, through host memory elsewhere), sums them there in device
//! order, and copies the sum back. Where every device can read the others' memory (CUDA peer
//! access), the sums happen on the GPUs instead (backend/peer.rs): each device's pass is queued
//! at once, and at each half-layer every device publishes that its partial is ready, waits for
//! the others', and adds all of them to its hidden states itself. Norms are small and replicated; the embedding and the
//! output head live on the first device only, which embeds the tokens and hands the rows to
//! the others, and samples at the end.
//!
//! Column slices of a quantized matrix exist only at block boundaries (32 elements, 256 for
//! the K-quants), so [`plan`] places the cuts on them and refuses, naming the tensor, a file
//! whose head groups do not line up.

use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};

use super::embed_copies::EmbedCopies;
use super::head_split::HeadSplit;
use super::kv_pool::KvPool;
use super::shard::{BatchItem, Kv, Scratch, next_pass};
use super::stack::StackItem;
use super::{ModelConfig, ModelError, Shard, ShardOutput, Want};
use crate::backend::peer::{PEER_FLAG_BYTES, PeerSum, Piece};
use crate::backend::{Buffer, Device};
use crate::gguf::GgufFile;
use crate::kernels::{Add, Op};
use crate::model::config::block_tensor;

/// One device's part of each layer of a tensor-parallel stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorPart {
    /// Key/value heads `[start, end)`; the query heads that read them come with them.
    pub kv_heads: Range<usize>,
    /// Feed-forward rows `[start, end)` (of gate and up; columns of down).
    pub ffn: Range<usize>,
    /// Whether this part holds the embedding and the output head (the first part).
    pub ends: bool,
}

impl TensorPart {
    /// Rows of Q this part computes (its query heads).
    pub fn q_rows(&self, cfg: &ModelConfig) -> Range<usize> {
        let per_kv = cfg.head_dim * (cfg.n_heads / cfg.n_kv_heads.max(1));
        self.kv_heads.start * per_kv..self.kv_heads.end * per_kv
    }

    /// Rows of K and of V this part computes (its key/value heads).
    pub fn kv_rows(&self, cfg: &ModelConfig) -> Range<usize> {
        self.kv_heads.start * cfg.head_dim..self.kv_heads.end * cfg.head_dim
    }
}

/// Cuts `n` into `parts` contiguous runs whose lengths differ by at most one, the longer
/// ones first (a tensor split's heads and rows, its head's vocabulary rows, a layer split's
/// micro-batches).
pub(super) fn even_runs(n: usize, parts: usize) -> Vec<Range<usize>> {
    let (base, extra) = (n / parts, n % parts);
    let mut at = 0;
    (0..parts)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = at..at + len;
            at += len;
            r
        })
        .collect()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// How layers `start..end` of `file` split over `devices` devices, or why they cannot: each
/// device needs a key/value head of its own, and the cuts through the output and down
/// products' columns must fall on their formats' block boundaries.
pub fn plan(
    file: &GgufFile,
    cfg: &ModelConfig,
    start: usize,
    end: usize,
    devices: usize,
) -> Result<Vec<TensorPart>, ModelError> {
    let refuse = |why: String| {
        Err(ModelError::TensorSplit(format!(
            "layers {start}..{end} cannot be split over {devices} devices: {why}; split them \
             by layers instead"
        )))
    };
    if devices == 0 {
        return refuse("no devices".into());
    }
    if cfg.n_kv_heads < devices {
        return refuse(format!(
            "the model has {} key/value heads, and each device needs at least one",
            cfg.n_kv_heads
        ));
    }
    let kv_runs = even_runs(cfg.n_kv_heads, devices);
    // The down product's columns are cut at multiples of every layer's block length.
    let mut ffn_unit = 1;
    for l in start..end {
        let ty_of = |part: &str| file.tensor(&block_tensor(l, part)).map(|t| t.ty);
        if let Some(ty) = ty_of("attn_output") {
            let block = ty.block_len();
            for r in &kv_runs {
                let part = TensorPart {
                    kv_heads: r.clone(),
                    ffn: 0..0,
                    ends: false,
                };
                let cols = part.q_rows(cfg);
                if !cols.start.is_multiple_of(block) || !cols.end.is_multiple_of(block) {
                    return refuse(format!(
                        "{} is {}, whose blocks of {block} columns do not line up with the \
                         columns {cols:?} of heads {:?} ({} query heads of {} per key/value \
                         head)",
                        block_tensor(l, "attn_output"),
                        ty.name(),
                        part.kv_heads,
                        cfg.n_heads / cfg.n_kv_heads.max(1),
                        cfg.head_dim,
                    ));
                }
            }
        }
        if let Some(ty) = ty_of("ffn_down") {
            let block = ty.block_len();
            ffn_unit = ffn_unit / gcd(ffn_unit, block) * block;
        }
    }
    if !cfg.ffn_dim.is_multiple_of(ffn_unit) || cfg.ffn_dim / ffn_unit < devices {
        return refuse(format!(
            "its {} feed-forward rows do not make a block of {ffn_unit} for each device",
            cfg.ffn_dim
        ));
    }
    let ffn_runs = even_runs(cfg.ffn_dim / ffn_unit, devices);
    Ok(kv_runs
        .into_iter()
        .zip(ffn_runs)
        .enumerate()
        .map(|(i, (kv_heads, f))| TensorPart {
            kv_heads,
            ffn: f.start * ffn_unit..f.end * ffn_unit,
            ends: i == 0,
        })
        .collect())
}

/// What a tensor-parallel stage holds besides its parts: on the first device, a buffer per
/// other device that its partial sums land in; or, where the devices can read each other's
/// memory, what the sums on the GPUs need instead ([`PeerSums`]).
pub(super) struct TensorSplit {
    gather: Vec<Buffer>,
    peer: Option<PeerSums>,
    /// The output head by vocabulary rows over the devices (`head_split.rs`), where the
    /// stage ends the model.
    pub(super) head: Option<HeadSplit>,
    /// The embedding on every device (`embed_copies.rs`), where the stage starts the model.
    pub(super) embeds: Option<EmbedCopies>,
}

/// The sums of a split whose devices read each other's memory (backend/peer.rs): each
/// device's pass is queued at once and its half-layers meet on the GPUs, with no host step
/// between them. Attention's partials go to the scratch's `o`, the feed-forward's to
/// `second`, so a device can write its next partial while the others still read its last.
struct PeerSums {
    /// Per device, on it: the feed-forward's partial sums.
    second: Vec<Buffer>,
    /// Per device, on it: the flag words the others publish their epochs into.
    flags: Vec<Buffer>,
    /// The next sum's epoch; every device's sums take the same, one per sum.
    epoch: AtomicU32,
}

/// `CAIRN_PEER_SUM=off` sums a split's partials through copies and the host even where the
/// devices could read each other (for measuring one against the other).
fn peer_sums_wanted() -> bool {
    std::env::var("CAIRN_PEER_SUM").as_deref() != Ok("off")
}

impl TensorSplit {
    /// Buffers for `lanes`' partial sums of up to their `max_batch` rows.
    pub(super) fn new(lanes: &[Shard]) -> Result<TensorSplit, ModelError> {
        let lead = &lanes[0];
        let bytes = (lead.max_batch() * lead.config().dim * 4) as u64;
        // Gemma's post norms need the whole sum before the residual add, which the peer sum
        // fuses; those families keep the copies.
        let post_norms = (0..lead.layer_count()).any(|i| lead.post_norm(i, 0).is_some());
        let devices: Vec<&Device> = lanes.iter().map(|l| &**l.device()).collect();
        let peer = if !post_norms && peer_sums_wanted() && Device::enable_peers(&devices) {
            let mut second = Vec::with_capacity(lanes.len());
            let mut flags = Vec::with_capacity(lanes.len());
            for (p, lane) in lanes.iter().enumerate() {
                let dev = lane.device();
                second.push(dev.alloc(&format!("feed-forward partial sums of device {p}"), bytes)?);
                let f = dev.alloc(&format!("peer sum flags of device {p}"), PEER_FLAG_BYTES)?;
                dev.write(&f, 0, &[0u8; PEER_FLAG_BYTES as usize])?;
                flags.push(f);
            }
            tracing::info!(
                devices = lanes.len(),
                "tensor split sums on the GPUs over peer access"
            );
            Some(PeerSums {
                second,
                flags,
                epoch: AtomicU32::new(1),
            })
        } else {
            None
        };
        // The copies' landing buffers, only where the sums go through them.
        let gather = (1..lanes.len())
            .filter(|_| peer.is_none())
            .map(|p| {
                lead.device()
                    .alloc(&format!("partial sums of device {p}"), bytes)
            })
            .collect::<Result<_, _>>()?;
        Ok(TensorSplit {
            gather,
            peer,
            head: None,
            embeds: None,
        })
    }
}

/// An error of device `p` of the split (its index in the stage's lanes).
pub(super) type LaneError = (usize, ModelError);

fn at<E: Into<ModelError>>(p: usize) -> impl Fn(E) -> LaneError {
    move |e| (p, e.into())
}

/// Runs every item's rows through the layers of a tensor-parallel stage, `lanes` its parts
/// (the first holding the embedding and head), each with its pool in `pools`. Items fail
/// alone as in [`Shard::forward_batch`]; an error of a device fails the call, naming it.
pub(super) async fn forward_batch(
    lanes: &[Shard],
    split: &TensorSplit,
    pools: &mut [&mut KvPool],
    items: &mut [StackItem<'_>],
) -> Result<Vec<Result<ShardOutput, ModelError>>, LaneError> {
    let n = lanes.len();
    let lead = &lanes[0];
    let dim = lead.config().dim;
    let k = items.len();
    // Each lane's view of the items: the same inputs, its own blocks of each sequence.
    let mut per_lane: Vec<Vec<BatchItem>> = (0..n).map(|_| Vec::with_capacity(k)).collect();
    for it in items.iter_mut() {
        let seqs = it.seq.parts_mut();
        if seqs.len() != n {
            return Err((
                0,
                ModelError::WrongInput("a sequence not made for this stage"),
            ));
        }
        for (lane, seq) in per_lane.iter_mut().zip(seqs.iter_mut()) {
            lane.push(BatchItem {
                seq,
                input: it.input,
                want: it.want,
            });
        }
    }
    let mut results: Vec<Option<Result<ShardOutput, ModelError>>> = (0..k).map(|_| None).collect();
    let mut rows = vec![0usize; k];
    for i in 0..k {
        let first = &per_lane[0][i];
        match lead.check_item(i, first.input, first.want) {
            Err(e) => results[i] = Some(Err(e)),
            Ok(r) => {
                for p in 0..n {
                    let it = &mut per_lane[p][i];
                    let len = it.seq.len() + r;
                    if let Err(e) = pools[p].reserve(lanes[p].device(), it.seq, len) {
                        results[i] = Some(Err(e));
                        break;
                    }
                }
                if results[i].is_none() {
                    rows[i] = r;
                }
            }
        }
    }
    let per_pass = lanes
        .iter()
        .map(|l| l.rows_per_pass(&rows))
        .min()
        .unwrap_or(1);
    let mut scratch = Vec::with_capacity(n);
    for l in lanes {
        scratch.push(l.scratch.lock().await);
    }
    let mut guards = Vec::with_capacity(n);
    for l in lanes {
        guards.push(l.batch.lock().await);
    }
    let mut bufs = Vec::with_capacity(n);
    for (p, (l, g)) in lanes.iter().zip(guards.iter_mut()).enumerate() {
        bufs.push(l.batch_buffers(g).map_err(at(p))?);
    }
    let mut done = vec![0usize; k];
    let mut hidden: Vec<Vec<f32>> = vec![Vec::new(); k];
    let layers = lead.layer_count();
    loop {
        let pass = next_pass(&rows, &done, per_pass);
        if pass.is_empty() {
            break;
        }
        let t: usize = pass.iter().map(|p| p.2).sum();
        let mut kvs = Vec::with_capacity(n);
        for p in 0..n {
            let table_len = lanes[p]
                .write_pass(&scratch[p], bufs[p], pools[p], &per_lane[p], &pass)
                .map_err(at(p))?;
            kvs.push(Kv::Paged {
                pool: pools[p],
                batch: bufs[p],
                table_len,
            });
        }
        // Each device embeds the tokens itself where each holds the embedding.
        let embeds = split.embeds.as_ref().filter(|_| lead.is_first());
        if lead.is_first() && embeds.is_none() {
            // The first device embeds the tokens and hands the rows to the others.
            let mut ops = Vec::new();
            lead.encode_embed(&scratch[0], t, &mut ops);
            lead.device().run(&ops).map_err(at(0))?;
            let bytes = (t * dim * 4) as u64;
            for p in 1..n {
                copy(lead, &scratch[0].h, &lanes[p], &scratch[p].h, bytes, p).await?;
            }
        }
        // Each item that ends in this pass: its index and its last row in the hidden states.
        let mut ends: Vec<(usize, usize)> = Vec::new();
        let mut row_end = 0;
        for &(i, from, take) in &pass {
            row_end += take;
            if from + take == rows[i] {
                ends.push((i, row_end - 1));
            }
        }
        let head_rows: Vec<usize> = ends.iter().map(|e| e.1).collect();
        let head = split.head.as_ref().filter(|_| lead.is_last());
        if let Some(peer) = &split.peer {
            // Epoch 0 is never taken before the counter wraps: flags start at 0.
            let first = peer.epoch.fetch_add(2 * layers as u32, Ordering::Relaxed);
            let n = (t * dim) as u32;
            let flags: Vec<&Buffer> = peer.flags.iter().collect();
            let attention: Vec<&Buffer> = scratch.iter().map(|s| &s.o).collect();
            let ffn: Vec<&Buffer> = peer.second.iter().collect();
            let encode = |p: usize| {
                let lane = &lanes[p];
                let h: &Buffer = &scratch[p].h;
                let sum = |of_ffn: bool, epoch: u32| PeerSum {
                    h,
                    parts: if of_ffn {
                        ffn.clone()
                    } else {
                        attention.clone()
                    },
                    flags: flags.clone(),
                    index: p as u32,
                    epoch,
                    first,
                    n,
                };
                let mut pieces = Vec::with_capacity(4 * layers);
                for i in 0..layers {
                    let epoch = first.wrapping_add(2 * i as u32);
                    let mut ops = Vec::new();
                    if let Some(e) = embeds.filter(|_| i == 0) {
                        e.encode(p, lane, &scratch[p], t, &mut ops);
                    }
                    lane.encode_attention(&scratch[p], kvs[p], t, i, &mut ops);
                    pieces.push(Piece::Ops(ops));
                    pieces.push(Piece::Sum(sum(false, epoch)));
                    let mut ops = Vec::new();
                    lane.encode_ffn_into(&scratch[p], t, i, &peer.second[p], &mut ops);
                    pieces.push(Piece::Ops(ops));
                    pieces.push(Piece::Sum(sum(true, epoch.wrapping_add(1))));
                }
                // Each device's rows of the head, in the same run.
                if let Some(hs) = head {
                    let mut ops = Vec::new();
                    hs.encode_lane(p, lane, &scratch[p], &head_rows, &mut ops)
                        .map_err(at(p))?;
                    pieces.push(Piece::Ops(ops));
                }
                lane.device().run_pieces(&pieces).map_err(at(p))
            };
            // Planning a device's pass costs the host about as long as a few of its layers
            // take on the GPU, and the first device's sums wait for the last device's pass to
            // be queued: the devices are planned and queued on threads of their own.
            // (No threads in a browser; no peer sums there either.)
            #[cfg(target_arch = "wasm32")]
            let queued: Vec<Result<(), LaneError>> = (0..lanes.len()).map(encode).collect();
            #[cfg(not(target_arch = "wasm32"))]
            let queued: Vec<Result<(), LaneError>> = std::thread::scope(|scope| {
                let others: Vec<_> = (1..lanes.len())
                    .map(|p| scope.spawn(move || encode(p)))
                    .collect();
                let mut all = vec![encode(0)];
                for (p, h) in others.into_iter().enumerate() {
                    all.push(h.join().unwrap_or_else(|_| {
                        Err((p + 1, ModelError::WrongInput("a device's pass panicked")))
                    }));
                }
                all
            });
            for q in queued {
                q?;
            }
        }
        for i in (0..layers).filter(|_| split.peer.is_none()) {
            for (p, lane) in lanes.iter().enumerate() {
                let mut ops = Vec::new();
                if i > 0 {
                    lane.encode_residual(&scratch[p], t, lane.post_norm(i - 1, 1), &mut ops);
                } else if let Some(e) = embeds {
                    e.encode(p, lane, &scratch[p], t, &mut ops);
                }
                lane.encode_attention(&scratch[p], kvs[p], t, i, &mut ops);
                lane.device().run(&ops).map_err(at(p))?;
            }
            all_reduce(lanes, &scratch, split, t).await?;
            for (p, lane) in lanes.iter().enumerate() {
                let mut ops = Vec::new();
                lane.encode_residual(&scratch[p], t, lane.post_norm(i, 0), &mut ops);
                lane.encode_ffn(&scratch[p], t, i, &mut ops);
                lane.device().run(&ops).map_err(at(p))?;
            }
            all_reduce(lanes, &scratch, split, t).await?;
        }
        if let Some(hs) = head {
            if split.peer.is_none() {
                // The last residual and each device's rows of the head.
                for (p, lane) in lanes.iter().enumerate() {
                    let mut ops = Vec::new();
                    lane.encode_residual(&scratch[p], t, lane.post_norm(layers - 1, 1), &mut ops);
                    hs.encode_lane(p, lane, &scratch[p], &head_rows, &mut ops)
                        .map_err(at(p))?;
                    lane.device().run(&ops).map_err(at(p))?;
                }
            }
            let wants: Vec<Want> = ends.iter().map(|e| per_lane[0][e.0].want).collect();
            if !wants.is_empty() {
                hs.gather(lanes, wants.len()).await?;
                let mut ops = Vec::new();
                hs.encode_samples(&wants, &mut ops);
                if !ops.is_empty() {
                    lead.device().run(&ops).map_err(at(0))?;
                }
            }
            for &(i, _, take) in &pass {
                for lane in per_lane.iter_mut() {
                    lane[i].seq.advance(take);
                }
                done[i] += take;
            }
            if !wants.is_empty() {
                let outs = hs.collect(lead.device(), &wants).await.map_err(at(0))?;
                for (e, out) in ends.iter().zip(outs) {
                    results[e.0] = Some(Ok(out));
                }
            }
            continue;
        }
        // The last residual and the head on the first device: the next pass starts the
        // others' hidden states afresh.
        let mut ops = Vec::new();
        if split.peer.is_none() {
            lead.encode_residual(&scratch[0], t, lead.post_norm(layers - 1, 1), &mut ops);
        }
        let heads = lead
            .encode_pass_heads(&scratch[0], bufs[0], &per_lane[0], &pass, &rows, &mut ops)
            .map_err(at(0))?;
        lead.device().run(&ops).map_err(at(0))?;
        for &(i, _, take) in &pass {
            for lane in per_lane.iter_mut() {
                lane[i].seq.advance(take);
            }
            done[i] += take;
        }
        lead.collect_pass(
            &scratch[0],
            bufs[0],
            &per_lane[0],
            &pass,
            &heads,
            &mut hidden,
            &mut results,
        )
        .await
        .map_err(at(0))?;
    }
    Ok(lead.finish_batch(results, hidden))
}

/// `bytes` of `src` on `from`'s device into `dst` on `to`'s, ordered after the work queued on
/// both; an error is device `p`'s.
async fn copy(
    from: &Shard,
    src: &Buffer,
    to: &Shard,
    dst: &Buffer,
    bytes: u64,
    p: usize,
) -> Result<(), LaneError> {
    let dev: &Device = from.device();
    dev.copy_to(src, 0, to.device(), dst, 0, bytes)
        .await
        .map(|_| ())
        .map_err(at(p))
}

/// Sums every lane's partial output product (`o`, `t` rows) onto every lane: gathered onto
/// the first device, added there in device order, copied back.
async fn all_reduce(
    lanes: &[Shard],
    scratch: &[futures::lock::MutexGuard<'_, Scratch>],
    split: &TensorSplit,
    t: usize,
) -> Result<(), LaneError> {
    let lead = &lanes[0];
    let len = t * lead.config().dim;
    let bytes = (len * 4) as u64;
    for (p, gather) in (1..lanes.len()).zip(&split.gather) {
        copy(&lanes[p], &scratch[p].o, lead, gather, bytes, p).await?;
    }
    let o = &scratch[0].o;
    let ops: Vec<Op> = split
        .gather
        .iter()
        .map(|g| {
            Op::Add(Add {
                a: o,
                b: g,
                out: o,
                n: len as u32,
            })
        })
        .collect();
    lead.device().run(&ops).map_err(at(0))?;
    for p in 1..lanes.len() {
        copy(lead, o, &lanes[p], &scratch[p].o, bytes, p).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_are_even_and_cover_everything() {
        assert_eq!(even_runs(3, 2), vec![0..2, 2..3]);
        assert_eq!(even_runs(8, 4), vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(even_runs(5, 3), vec![0..2, 2..4, 4..5]);
        // A head's vocabulary rows (head_split.rs).
        assert_eq!(even_runs(10, 3), vec![0..4, 4..7, 7..10]);
        assert_eq!(even_runs(512, 2), vec![0..256, 256..512]);
        assert_eq!(gcd(32, 256), 32);
    }
}

//! A stage split by layers over several devices, run as a pipeline inside the process.
//!
//! [`ShardStack::forward_batch`](super::ShardStack::forward_batch) over pieces split by layers
//! runs each piece after the one before it, so with the batch of every sequence in one pass
//! only one device works at a time: sixteen requests on two GPUs gave what one GPU gives
//! (session 17). Here the batch's sequences are divided into micro-batches, and each piece
//! runs on a thread of its own, taking the micro-batches in order as the piece before hands
//! them on: while the second device runs the first micro-batch's later layers, the first
//! device runs the second micro-batch's earlier ones, as a chain of stages pipelines the
//! batches of different requests, but with the hand-offs inside the process.
//!
//! `M` micro-batches over `P` pieces take `M + P - 1` slots of a micro-batch on one piece
//! where the pieces one after the other take `M * P`; a micro-batch costs less than the whole
//! batch, but not `1 / M` of it (each pass has its fixed costs, and the cuda backend's decode
//! products read each weight row once per four tokens), so the gain is smaller than the
//! slots say.
//! Each micro-batch is a pass of [`Shard::forward_batch`] on every piece: a sequence's rows
//! and key/value blocks are the same as in one pass of them all, and each row's arithmetic
//! does not depend on the other rows of its pass, so the outputs are the sequential pass's.
//!
//! `CAIRN_LAYER_PIPELINE=off` runs the pieces one after another as before (for measuring one
//! against the other); `CAIRN_LAYER_PIPELINE=N` makes micro-batches of about N sequences
//! (default [`DEFAULT_MICRO_SEQS`]).

// A browser has no threads: the pipeline is left out there, and what it uses goes unused.
#![cfg_attr(target_arch = "wasm32", allow(dead_code))]

/// Sequences per micro-batch by default. A batched pass's time is far from proportional to its
/// rows (on an H200, 8B shape, one pass of 16 decode rows takes about 5 times one of a
/// single row), so each micro-batch's fixed part weighs: 16 sequences over two H200s gave
/// 1,084 tok/s in micro-batches of 8 and 1,018 in micro-batches of 4, against 996 run one
/// piece after the other (session 19).
pub const DEFAULT_MICRO_SEQS: usize = 8;

/// The most micro-batches per piece of a pass: past this, each one's fixed costs (a
/// readback, an upload, the launches) outweigh the shorter fill of the pipeline.
const MAX_MICRO_PER_PIECE: usize = 4;

/// How many micro-batches a pass of `items` sequences over `pieces` pieces split by layers
/// runs as; 1 runs the pieces one after another.
pub(super) fn micro_batches(items: usize, pieces: usize) -> usize {
    let per = match std::env::var("CAIRN_LAYER_PIPELINE").as_deref() {
        Ok("off") | Ok("0") => return 1,
        Ok(v) => v.parse::<usize>().unwrap_or(DEFAULT_MICRO_SEQS).max(1),
        Err(_) => DEFAULT_MICRO_SEQS,
    };
    if pieces < 2 || items < 2 || cfg!(target_arch = "wasm32") {
        return 1;
    }
    items.div_ceil(per).clamp(1, MAX_MICRO_PER_PIECE * pieces)
}

/// `items` contiguous groups of lengths that differ by at most one, the longer first.
fn groups(items: usize, m: usize) -> Vec<std::ops::Range<usize>> {
    super::tensor_split::even_runs(items, m.clamp(1, items.max(1)))
}

#[cfg(not(target_arch = "wasm32"))]
pub(super) use threads::forward;

/// The pipeline's threads (none in a browser, where [`micro_batches`] is always 1).
#[cfg(not(target_arch = "wasm32"))]
mod threads {
    use super::groups;
    use crate::model::shard::BatchItem;
    use crate::model::{KvPool, ModelError, SeqKv, Shard, ShardInput, ShardOutput, Want};

    /// One micro-batch as it leaves a piece: each live item's index and hidden rows.
    type Handoff = Vec<(usize, Vec<f32>)>;

    /// What a piece's thread gives back: the items that ended on it (their output, or the error
    /// that stopped them), or the error of its device.
    type PieceResult = Result<Vec<(usize, Result<ShardOutput, ModelError>)>, (usize, ModelError)>;

    /// One piece's work over the pass: each micro-batch in order, its input from `input` (the
    /// first piece: the items' own) and its hidden rows to `output` (all but the last piece).
    #[allow(clippy::too_many_arguments)]
    fn run_piece(
        p: usize,
        shard: &Shard,
        pool: &mut KvPool,
        seqs: &mut [&mut SeqKv],
        inputs: &[ShardInput<'_>],
        wants: &[Want],
        parts: &[std::ops::Range<usize>],
        fail: Option<usize>,
        input: Option<std::sync::mpsc::Receiver<Handoff>>,
        output: Option<std::sync::mpsc::Sender<Handoff>>,
    ) -> PieceResult {
        if let Some(index) = fail {
            return Err((
                p,
                ModelError::DeviceFailed {
                    index,
                    text: "failed on purpose (CAIRN_DEBUG_FAIL_DEVICE)".into(),
                },
            ));
        }
        let last = output.is_none();
        let mut ended = Vec::new();
        for part in parts {
            // The micro-batch's live items and their rows for this piece.
            let carried: Handoff = match &input {
                None => part.clone().map(|i| (i, Vec::new())).collect(),
                // The piece before stopped (its device failed): so does this one.
                Some(rx) => match rx.recv() {
                    Ok(h) => h,
                    Err(_) => return Ok(ended),
                },
            };
            if carried.is_empty() {
                if let Some(tx) = &output {
                    let _ = tx.send(Vec::new());
                }
                continue;
            }
            let outs = {
                let mut batch: Vec<BatchItem> = Vec::with_capacity(carried.len());
                let mut want_idx = carried.iter().map(|c| c.0).peekable();
                for (i, seq) in seqs.iter_mut().enumerate() {
                    if want_idx.peek() != Some(&i) {
                        continue;
                    }
                    want_idx.next();
                    let k = batch.len();
                    batch.push(BatchItem {
                        seq,
                        input: if input.is_none() {
                            inputs[i]
                        } else {
                            ShardInput::Hidden(&carried[k].1)
                        },
                        want: if last { wants[i] } else { Want::Hidden },
                    });
                }
                pollster::block_on(shard.forward_batch(pool, &mut batch)).map_err(|e| (p, e))?
            };
            let mut next: Handoff = Vec::with_capacity(carried.len());
            for ((i, _), out) in carried.iter().zip(outs) {
                match out {
                    Ok(ShardOutput::Hidden(h)) if !last => next.push((*i, h)),
                    other => ended.push((*i, other)),
                }
            }
            if let Some(tx) = &output {
                // A later piece that stopped has its own error to report.
                if tx.send(next).is_err() {
                    return Ok(ended);
                }
            }
        }
        Ok(ended)
    }

    /// Runs `items` (each with one sequence part per piece in `seqs`, in piece order) through
    /// `pieces` as a pipeline of `m` micro-batches, each piece with its pool in `pools`. Items
    /// fail alone as in [`Shard::forward_batch`]; an error of a device fails the call, naming its
    /// piece (the first piece in order whose device failed). `fail`: the piece that fails on
    /// purpose (tests) and the device index it reports.
    pub(in crate::model) fn forward(
        pieces: &[Shard],
        pools: &mut [&mut KvPool],
        seqs: Vec<Vec<&mut SeqKv>>,
        inputs: &[ShardInput<'_>],
        wants: &[Want],
        m: usize,
        fail: Option<(usize, usize)>,
    ) -> Result<Vec<Result<ShardOutput, ModelError>>, (usize, ModelError)> {
        let n = inputs.len();
        let parts = groups(n, m);
        let count = pieces.len();
        let mut senders = Vec::with_capacity(count);
        let mut receivers = Vec::with_capacity(count);
        receivers.push(None);
        for _ in 1..count {
            let (tx, rx) = std::sync::mpsc::channel::<Handoff>();
            senders.push(Some(tx));
            receivers.push(Some(rx));
        }
        senders.push(None);
        let parts = &parts;
        let done: Vec<PieceResult> = std::thread::scope(|scope| {
            let mut handles = Vec::with_capacity(count);
            let mut first = None;
            for (p, ((((shard, pool), mut seqs), rx), tx)) in pieces
                .iter()
                .zip(pools.iter_mut())
                .zip(seqs)
                .zip(receivers)
                .zip(senders)
                .enumerate()
            {
                let work = move || {
                    run_piece(
                        p,
                        shard,
                        pool,
                        &mut seqs,
                        inputs,
                        wants,
                        parts,
                        fail.filter(|f| f.0 == p).map(|f| f.1),
                        rx,
                        tx,
                    )
                };
                // The first piece runs on the calling thread, the others on threads of their own.
                if p == 0 {
                    first = Some(work);
                } else {
                    handles.push(scope.spawn(work));
                }
            }
            let mut all = vec![first.map_or(Ok(Vec::new()), |w| w())];
            for (p, h) in handles.into_iter().enumerate() {
                all.push(h.join().unwrap_or_else(|_| {
                    Err((p + 1, ModelError::WrongInput("a piece's thread panicked")))
                }));
            }
            all
        });
        let mut results: Vec<Option<Result<ShardOutput, ModelError>>> =
            (0..n).map(|_| None).collect();
        for piece in done {
            for (i, out) in piece? {
                results[i] = Some(out);
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or(Err(ModelError::WrongInput("a piece gave no output"))))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::groups;

    #[test]
    fn groups_cover_the_items_in_order() {
        assert_eq!(groups(16, 4), vec![0..4, 4..8, 8..12, 12..16]);
        assert_eq!(groups(5, 2), vec![0..3, 3..5]);
        assert_eq!(groups(2, 8), vec![0..1, 1..2]);
        assert_eq!(groups(3, 1), vec![0..3]);
    }
}

//! The output head of a tensor-parallel last stage split by vocabulary rows over its devices.
//!
//! Without it the head runs on the first device alone while the others wait: on the 8B shape
//! over four H200s 0.3 ms of a 2.9 ms step (session 17). Here every device of the split holds
//! the final norm and a contiguous run of the head's rows (the first device uses the first
//! rows of the head it already holds for the embedding's device), and computes its rows'
//! logits from its own copy of the hidden states, which the split keeps identical on every
//! device. The logits are gathered onto the first device as one block per device (device
//! `p`'s `k x rows_p` at `k x start_p`: one copy per device, peer to peer between CUDA
//! devices), where each sequence's row is put together again before it is sampled, so every
//! sampler (greedy, top-k, top-p) sees the whole vocabulary as before. A row's logit is the
//! same dot product whichever device computes it, so the logits are one device's.
//!
//! `CAIRN_HEAD_SPLIT=off` keeps the head on the first device (for measuring one against the
//! other).

use std::ops::Range;

use super::shard::{MAX_BATCH_SEQS, Scratch};
use super::tensor_split::even_runs;
use super::weights::{Loader, Matrix};
use super::{ModelConfig, ModelError, Shard, ShardOutput, Want};
use crate::backend::{Buffer, Device};
use crate::gguf::TensorSource;
use crate::kernels::{BufferCopy, Linear, Op, RmsNorm, Sample, ScaleCap};

/// Whether a tensor split's last stage splits its head (`CAIRN_HEAD_SPLIT=off`: no).
pub(super) fn wanted() -> bool {
    std::env::var("CAIRN_HEAD_SPLIT").as_deref() != Ok("off")
}

/// One device's part of the head.
struct LaneHead {
    /// The final norm and this device's rows of the head (the first device's are in its
    /// shard's weights).
    weights: Option<(Buffer, Matrix)>,
    /// The last hidden row of each sequence whose head runs, and the rows normed.
    h: Buffer,
    xn: Buffer,
    /// This device's logits, `k x rows` (the first device writes into the gather instead).
    logits: Option<Buffer>,
}

/// The head of a tensor split's last stage, by vocabulary rows over its lanes.
pub(super) struct HeadSplit {
    /// Vocabulary rows of each lane.
    cuts: Vec<Range<usize>>,
    lanes: Vec<LaneHead>,
    /// On the first device: every lane's logits, lane `p`'s block of `k x rows_p` at
    /// `k x cuts[p].start` floats.
    gather: Buffer,
    /// On the first device: one sequence's whole row of logits, the token drawn from it, and
    /// the tokens of every sequence of the pass.
    row: Buffer,
    token: Buffer,
    tokens: Buffer,
}

impl HeadSplit {
    /// Loads each lane's rows of the head of `src` (the first lane's are the first rows of
    /// the head its shard holds) and the buffers of a pass of up to [`MAX_BATCH_SEQS`]
    /// sequences.
    pub(super) fn load(lanes: &[Shard], src: &dyn TensorSource) -> Result<HeadSplit, ModelError> {
        let lead = &lanes[0];
        let cfg: &ModelConfig = lead.config();
        let (dim, vocab) = (cfg.dim, cfg.vocab_size);
        if lead.head_weights().is_none() || vocab < lanes.len() {
            return Err(ModelError::WrongInput("no output head to split"));
        }
        let cuts = even_runs(vocab, lanes.len());
        let name = if cfg.tied_output {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let seqs = MAX_BATCH_SEQS;
        let f = |dev: &Device, label: &str, n: usize| dev.alloc(label, (n.max(1) * 4) as u64);
        let mut heads = Vec::with_capacity(lanes.len());
        for (p, (lane, cut)) in lanes.iter().zip(&cuts).enumerate() {
            let dev: &Device = lane.device();
            let weights = if p == 0 {
                None
            } else {
                let mut progress = |_: u64, _: u64| {};
                let mut ld = Loader {
                    dev,
                    src,
                    progress: &mut progress,
                    done: 0,
                    total: 0,
                };
                let norm = ld.vector("output_norm.weight", dim)?;
                let out = ld
                    .matrix_rows(name, dim, vocab, std::slice::from_ref(cut))?
                    .remove(0);
                Some((norm, out))
            };
            heads.push(LaneHead {
                weights,
                h: f(dev, "split head h", seqs * dim)?,
                xn: f(dev, "split head norm", seqs * dim)?,
                logits: if p == 0 {
                    None
                } else {
                    Some(f(dev, "split head logits", seqs * cut.len())?)
                },
            });
        }
        let dev: &Device = lead.device();
        Ok(HeadSplit {
            gather: f(dev, "split head gathered logits", seqs * vocab)?,
            row: f(dev, "split head row", vocab)?,
            token: f(dev, "split head token", 1)?,
            tokens: f(dev, "split head tokens", seqs)?,
            cuts,
            lanes: heads,
        })
    }

    /// Lane `p`'s head over rows `rows` of its hidden states `s.h` (each sequence's last row
    /// in this pass, in head order): its logits into its block.
    pub(super) fn encode_lane<'a>(
        &'a self,
        p: usize,
        lane: &'a Shard,
        s: &'a Scratch,
        rows: &[usize],
        ops: &mut Vec<Op<'a>>,
    ) -> Result<(), ModelError> {
        if rows.is_empty() {
            return Ok(());
        }
        let cfg = lane.config();
        let lh = &self.lanes[p];
        let (norm, out) = match &lh.weights {
            Some((n, o)) => (n, o),
            None => lane
                .head_weights()
                .ok_or(ModelError::WrongInput("no output head"))?,
        };
        let row = (cfg.dim * 4) as u64;
        for (k, &r) in rows.iter().enumerate() {
            ops.push(Op::Copy(BufferCopy {
                src: &s.h,
                src_offset: r as u64 * row,
                dst: &lh.h,
                dst_offset: k as u64 * row,
                bytes: row,
            }));
        }
        let k = rows.len();
        ops.push(Op::RmsNorm(RmsNorm {
            x: &lh.h,
            weight: norm,
            y: &lh.xn,
            dim: cfg.dim as u32,
            tokens: k as u32,
            eps: cfg.norm_eps,
        }));
        let y = lh.logits.as_ref().unwrap_or(&self.gather);
        let n = self.cuts[p].len();
        ops.push(Op::Linear(Linear {
            w: &out.buf,
            wtype: out.ty,
            x: &lh.xn,
            y,
            // The first lane's rows are the first of the whole head it holds.
            rows: n as u32,
            cols: out.cols as u32,
            tokens: k as u32,
        }));
        if cfg.final_softcap > 0.0 {
            ops.push(Op::ScaleCap(ScaleCap {
                x: y,
                n: (k * n) as u32,
                scale: 1.0,
                cap: cfg.final_softcap,
            }));
        }
        Ok(())
    }

    /// Copies every other lane's block of logits of `k` sequences into the gather on the
    /// first device, after what each has queued; an error is that lane's.
    pub(super) async fn gather(
        &self,
        lanes: &[Shard],
        k: usize,
    ) -> Result<(), (usize, ModelError)> {
        let lead: &Device = lanes[0].device();
        for (p, (lane, cut)) in lanes.iter().zip(&self.cuts).enumerate().skip(1) {
            let Some(src) = &self.lanes[p].logits else {
                continue;
            };
            let dev: &Device = lane.device();
            dev.copy_to(
                src,
                0,
                lead,
                &self.gather,
                (k * cut.start * 4) as u64,
                (k * cut.len() * 4) as u64,
            )
            .await
            .map_err(|e| (p, e.into()))?;
        }
        Ok(())
    }

    /// On the first device: for head `j` of `k` that wants a token, its row of logits put
    /// together from every lane's block, and the token drawn from it.
    pub(super) fn encode_samples<'a>(&'a self, wants: &[Want], ops: &mut Vec<Op<'a>>) {
        let k = wants.len();
        let vocab = self.cuts.last().map_or(0, |c| c.end);
        for (j, want) in wants.iter().enumerate() {
            let Want::Sample(params) = *want else {
                continue;
            };
            for cut in &self.cuts {
                ops.push(Op::Copy(BufferCopy {
                    src: &self.gather,
                    src_offset: ((k * cut.start + j * cut.len()) * 4) as u64,
                    dst: &self.row,
                    dst_offset: (cut.start * 4) as u64,
                    bytes: (cut.len() * 4) as u64,
                }));
            }
            ops.push(Op::Sample(Sample {
                logits: &self.row,
                n: vocab as u32,
                out: &self.token,
                params,
            }));
            ops.push(Op::Copy(BufferCopy {
                src: &self.token,
                src_offset: 0,
                dst: &self.tokens,
                dst_offset: (j * 4) as u64,
                bytes: 4,
            }));
        }
    }

    /// Reads the outputs of the `wants.len()` heads of a pass from the first device: a token
    /// where one was drawn, else the whole row of logits.
    pub(super) async fn collect(
        &self,
        lead: &Device,
        wants: &[Want],
    ) -> Result<Vec<ShardOutput>, ModelError> {
        let k = wants.len();
        let vocab = self.cuts.last().map_or(0, |c| c.end);
        let tokens: Vec<u32> = if wants.iter().any(|w| matches!(w, Want::Sample(_))) {
            let bytes = lead.read(&self.tokens, 0, (k * 4) as u64).await?;
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        } else {
            Vec::new()
        };
        let gathered: Vec<f32> = if wants.iter().any(|w| !matches!(w, Want::Sample(_))) {
            let bytes = lead.read(&self.gather, 0, (k * vocab * 4) as u64).await?;
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        } else {
            Vec::new()
        };
        Ok(wants
            .iter()
            .enumerate()
            .map(|(j, want)| match want {
                Want::Sample(_) => ShardOutput::Token(tokens[j]),
                _ => {
                    let mut row = Vec::with_capacity(vocab);
                    for cut in &self.cuts {
                        let at = k * cut.start + j * cut.len();
                        row.extend_from_slice(&gathered[at..at + cut.len()]);
                    }
                    ShardOutput::Logits(row)
                }
            })
            .collect())
    }
}

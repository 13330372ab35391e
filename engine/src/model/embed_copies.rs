//! A copy of the token embedding on every device of a tensor-parallel first stage.
//!
//! Without it the first device embeds a pass's tokens and copies the rows to the others
//! before any of them can start: a run and a copy per other device on the host's path to
//! every step, and every other device's pass waiting on the first's. With a copy each, every
//! device embeds the tokens itself at the start of its own pass (in the same run, so in the
//! replayed graph on cuda): every device already has the pass's token ids, which each part of
//! a first stage is given. The cost is the embedding's bytes on each other device (about
//! 0.3 GB for the 8B shape in Q4_1). An embedding row is looked up, not computed, so the
//! hidden states are the same.
//!
//! `CAIRN_EMBED_COPIES=off` keeps the embedding on the first device alone.

use super::shard::{Scratch, encode_embed_from};
use super::weights::{Loader, Matrix};
use super::{ModelError, Shard};
use crate::backend::Device;
use crate::gguf::TensorSource;
use crate::kernels::Op;

/// Whether a tensor split's first stage copies the embedding to every device.
pub(super) fn wanted() -> bool {
    std::env::var("CAIRN_EMBED_COPIES").as_deref() != Ok("off")
}

/// The embedding of every device of the split but the first (whose shard holds it).
pub(super) struct EmbedCopies {
    /// Lane `p`'s copy at `p - 1`.
    tables: Vec<Matrix>,
}

impl EmbedCopies {
    pub(super) fn load(lanes: &[Shard], src: &dyn TensorSource) -> Result<EmbedCopies, ModelError> {
        let cfg = lanes[0].config();
        let mut tables = Vec::with_capacity(lanes.len().saturating_sub(1));
        for lane in &lanes[1..] {
            let dev: &Device = lane.device();
            let mut progress = |_: u64, _: u64| {};
            let mut ld = Loader {
                dev,
                src,
                progress: &mut progress,
                done: 0,
                total: 0,
            };
            tables.push(ld.matrix("token_embd.weight", cfg.vocab_size, cfg.dim)?);
        }
        Ok(EmbedCopies { tables })
    }

    /// Lane `p`'s embedding of the pass's `t` token ids (already in `s`) into its hidden
    /// states.
    pub(super) fn encode<'a>(
        &'a self,
        p: usize,
        lane: &'a Shard,
        s: &'a Scratch,
        t: usize,
        ops: &mut Vec<Op<'a>>,
    ) {
        let Some(table) = p.checked_sub(1).and_then(|i| self.tables.get(i)) else {
            // The first device's embedding is its shard's own.
            lane.encode_embed(s, t, ops);
            return;
        };
        encode_embed_from(lane.config(), table, s, t, ops);
    }
}

//! The key/value memory of a stage's sequences as one pool of fixed-size blocks (paged): a
//! sequence takes blocks as it grows and gives them back when it ends, so memory follows the
//! positions in use, not every request's worst case, and a budget bounds it.
//!
//! [`BlockBook`] is the bookkeeping alone (which block is whose), sans-IO and tested without a
//! device; [`KvPool`] adds the device buffers, which grow by doubling up to the budget.

use super::ModelError;
use crate::backend::{Buffer, Device};
use crate::kernels::{BufferCopy, Op};

/// Positions per block. Small enough that a short request wastes little, large enough that a
/// table stays short (a 4,096-position context is 256 entries).
pub const KV_BLOCK: usize = 16;

/// Blocks a new pool starts with (1,024 positions); it doubles up to its budget.
const FIRST_BLOCKS: usize = 64;

/// One sequence's share of a pool: its blocks in position order and the positions filled.
#[derive(Debug, Default)]
pub struct SeqKv {
    blocks: Vec<u32>,
    len: usize,
    /// The most positions this sequence may hold (its request's context limit).
    limit: usize,
}

impl SeqKv {
    /// A sequence that may grow to `limit` positions.
    pub fn new(limit: usize) -> SeqKv {
        SeqKv {
            blocks: Vec::new(),
            len: 0,
            limit: limit.max(1),
        }
    }

    /// Positions filled so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Forgets positions from `len` on (their blocks stay with the sequence).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    pub(crate) fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// The pool slot of position `pos` (it must be within the blocks held).
    pub(crate) fn slot(&self, pos: usize) -> u32 {
        self.blocks[pos / KV_BLOCK] * KV_BLOCK as u32 + (pos % KV_BLOCK) as u32
    }
}

/// Why a sequence could not get the blocks it needs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvFull {
    #[error("context full: {needed} positions needed, the request's limit is {limit}")]
    Limit { needed: usize, limit: usize },
    #[error(
        "key/value pool full: {needed} more blocks needed, {free} free of the budget's {budget}"
    )]
    Pool {
        needed: usize,
        free: usize,
        budget: usize,
    },
}

/// Which blocks are free, out of `allocated` (what the buffers hold) and `budget` (the most
/// they may grow to).
#[derive(Debug)]
pub struct BlockBook {
    free: Vec<u32>,
    allocated: usize,
    budget: usize,
}

impl BlockBook {
    pub fn new(allocated: usize, budget: usize) -> BlockBook {
        let allocated = allocated.min(budget);
        BlockBook {
            // Popped from the end: low blocks first, so a lightly used pool stays compact.
            free: (0..allocated as u32).rev().collect(),
            allocated,
            budget,
        }
    }

    pub fn allocated(&self) -> usize {
        self.allocated
    }

    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Blocks held by sequences.
    pub fn used(&self) -> usize {
        self.allocated - self.free.len()
    }

    /// Blocks that can still be handed out, counting growth up to the budget.
    pub fn available(&self) -> usize {
        self.free.len() + (self.budget - self.allocated)
    }

    /// Blocks `seq` lacks for `len` positions: 0 when it holds enough; an error when `len`
    /// passes its limit or the budget cannot cover it.
    pub fn shortfall(&self, seq: &SeqKv, len: usize) -> Result<usize, KvFull> {
        if len > seq.limit {
            return Err(KvFull::Limit {
                needed: len,
                limit: seq.limit,
            });
        }
        let need = len.div_ceil(KV_BLOCK).saturating_sub(seq.blocks.len());
        if need > self.available() {
            return Err(KvFull::Pool {
                needed: need,
                free: self.available(),
                budget: self.budget,
            });
        }
        Ok(need)
    }

    /// The allocation the buffers must grow to so that `need` more blocks are free: `None`
    /// when they are free already. Doubles, capped by the budget.
    pub fn growth_for(&self, need: usize) -> Option<usize> {
        if need <= self.free.len() {
            return None;
        }
        let least = self.allocated + (need - self.free.len());
        Some(
            (self.allocated * 2)
                .max(least)
                .max(FIRST_BLOCKS)
                .min(self.budget),
        )
    }

    /// Records that the buffers now hold `blocks` blocks (after growing).
    pub fn grown_to(&mut self, blocks: usize) {
        let blocks = blocks.min(self.budget);
        // New blocks are handed out after the old free ones.
        let mut fresh: Vec<u32> = (self.allocated as u32..blocks as u32).rev().collect();
        fresh.append(&mut self.free);
        self.free = fresh;
        self.allocated = self.allocated.max(blocks);
    }

    /// Gives `seq` the blocks it needs for `len` positions from the free ones.
    pub fn take(&mut self, seq: &mut SeqKv, len: usize) -> Result<(), KvFull> {
        let need = self.shortfall(seq, len)?;
        if need > self.free.len() {
            return Err(KvFull::Pool {
                needed: need,
                free: self.free.len(),
                budget: self.budget,
            });
        }
        for _ in 0..need {
            if let Some(b) = self.free.pop() {
                seq.blocks.push(b);
            }
        }
        Ok(())
    }

    /// Takes back every block of `seq` (it ended).
    pub fn release(&mut self, seq: &mut SeqKv) {
        self.free.append(&mut seq.blocks);
        seq.len = 0;
    }
}

/// A stage's key/value pool: per layer one K and one V buffer of `allocated × KV_BLOCK`
/// positions, and the bookkeeping of whose blocks are whose.
pub struct KvPool {
    pub(crate) k: Vec<Buffer>,
    pub(crate) v: Vec<Buffer>,
    /// The block tables of a batch, concatenated (one entry per block at most).
    pub(crate) table: Buffer,
    book: BlockBook,
    kv_dim: usize,
}

impl KvPool {
    /// An empty pool for `layers` layers of `kv_dim` values per position, allowed to grow to
    /// `budget_bytes`.
    pub(crate) fn new(
        dev: &Device,
        layers: usize,
        kv_dim: usize,
        budget_bytes: u64,
    ) -> Result<KvPool, ModelError> {
        let per_block = Self::block_bytes(layers, kv_dim);
        let budget = (budget_bytes / per_block.max(1)).min(u32::MAX as u64 / 2) as usize;
        if budget == 0 {
            return Err(ModelError::BadShape(format!(
                "a key/value budget of {budget_bytes} bytes holds no block of {per_block} bytes"
            )));
        }
        let first = FIRST_BLOCKS.min(budget);
        let (k, v, table) = Self::alloc(dev, layers, kv_dim, first)?;
        Ok(KvPool {
            k,
            v,
            table,
            book: BlockBook::new(first, budget),
            kv_dim,
        })
    }

    /// Device bytes of one block over `layers` layers (K and V, f32).
    pub fn block_bytes(layers: usize, kv_dim: usize) -> u64 {
        (2 * layers * KV_BLOCK * kv_dim * 4) as u64
    }

    #[allow(clippy::type_complexity)]
    fn alloc(
        dev: &Device,
        layers: usize,
        kv_dim: usize,
        blocks: usize,
    ) -> Result<(Vec<Buffer>, Vec<Buffer>, Buffer), ModelError> {
        let bytes = (blocks * KV_BLOCK * kv_dim * 4) as u64;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for l in 0..layers {
            k.push(dev.alloc(&format!("k pool {l}"), bytes)?);
            v.push(dev.alloc(&format!("v pool {l}"), bytes)?);
        }
        let table = dev.alloc("kv table", (blocks.max(1) * 4) as u64)?;
        Ok((k, v, table))
    }

    pub fn book(&self) -> &BlockBook {
        &self.book
    }

    /// Device bytes the pool holds now.
    pub fn bytes(&self) -> u64 {
        self.k.iter().chain(&self.v).map(|b| b.size()).sum()
    }

    /// Blocks in the buffers (what kernels may address).
    pub(crate) fn blocks(&self) -> usize {
        self.book.allocated()
    }

    /// Makes sure `seq` holds blocks for `len` positions, growing the buffers (a copy of what
    /// they hold) when the free blocks do not cover it.
    pub(crate) fn reserve(
        &mut self,
        dev: &Device,
        seq: &mut SeqKv,
        len: usize,
    ) -> Result<(), ModelError> {
        let need = self.book.shortfall(seq, len).map_err(kv_full)?;
        if let Some(blocks) = self.book.growth_for(need) {
            self.grow(dev, blocks)?;
        }
        self.book.take(seq, len).map_err(kv_full)
    }

    fn grow(&mut self, dev: &Device, blocks: usize) -> Result<(), ModelError> {
        let layers = self.k.len();
        let (k, v, table) = Self::alloc(dev, layers, self.kv_dim, blocks)?;
        let old = (self.book.allocated() * KV_BLOCK * self.kv_dim * 4) as u64;
        if old > 0 {
            let mut ops = Vec::with_capacity(2 * layers);
            for (src, dst) in self.k.iter().zip(&k).chain(self.v.iter().zip(&v)) {
                ops.push(Op::Copy(BufferCopy {
                    src,
                    src_offset: 0,
                    dst,
                    dst_offset: 0,
                    bytes: old,
                }));
            }
            dev.run(&ops)?;
        }
        self.k = k;
        self.v = v;
        self.table = table;
        self.book.grown_to(blocks);
        Ok(())
    }

    /// Takes back `seq`'s blocks.
    pub fn release(&mut self, seq: &mut SeqKv) {
        self.book.release(seq);
    }
}

fn kv_full(e: KvFull) -> ModelError {
    match e {
        KvFull::Limit { needed, limit } => ModelError::ContextFull {
            needed,
            capacity: limit,
        },
        KvFull::Pool { .. } => ModelError::PoolFull(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_take_blocks_as_they_grow_and_give_them_back() {
        let mut book = BlockBook::new(4, 8);
        let mut a = SeqKv::new(1000);
        let mut b = SeqKv::new(1000);
        book.take(&mut a, 1).unwrap();
        assert_eq!(a.blocks(), &[0]);
        // Within its block: nothing more.
        book.take(&mut a, KV_BLOCK).unwrap();
        assert_eq!(book.used(), 1);
        book.take(&mut a, KV_BLOCK + 1).unwrap();
        book.take(&mut b, 2 * KV_BLOCK).unwrap();
        assert_eq!((a.blocks(), b.blocks()), (&[0, 1][..], &[2, 3][..]));
        assert_eq!(a.slot(KV_BLOCK + 3), KV_BLOCK as u32 + 3);
        assert_eq!(b.slot(KV_BLOCK), 3 * KV_BLOCK as u32);
        // The buffers are full; the budget allows 4 more, so growth is asked for.
        assert_eq!(book.shortfall(&a, 3 * KV_BLOCK), Ok(1));
        assert!(book.take(&mut a, 3 * KV_BLOCK).is_err());
        let grow = book.growth_for(1).unwrap();
        assert_eq!(grow, 8, "doubling, capped by the budget");
        book.grown_to(grow);
        book.take(&mut a, 3 * KV_BLOCK).unwrap();
        assert_eq!(a.blocks(), &[0, 1, 4]);
        book.release(&mut b);
        assert_eq!(book.used(), 3);
        assert!(b.is_empty() && b.blocks().is_empty());
        // Freed blocks come back first.
        let mut c = SeqKv::new(1000);
        book.take(&mut c, 1).unwrap();
        assert!(c.blocks()[0] == 2 || c.blocks()[0] == 3);
    }

    #[test]
    fn limits_and_the_budget_refuse_with_what_was_needed() {
        let mut book = BlockBook::new(2, 3);
        let mut a = SeqKv::new(20);
        assert_eq!(
            book.take(&mut a, 21),
            Err(KvFull::Limit {
                needed: 21,
                limit: 20
            })
        );
        let mut big = SeqKv::new(10_000);
        assert!(matches!(
            book.shortfall(&big, 4 * KV_BLOCK),
            Err(KvFull::Pool { needed: 4, .. })
        ));
        book.take(&mut big, 2 * KV_BLOCK).unwrap();
        assert_eq!(book.available(), 1);
        assert_eq!(book.growth_for(1), Some(3));
        // Nothing was taken by the refused requests.
        assert!(a.blocks().is_empty());
    }
}

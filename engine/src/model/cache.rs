//! Per-sequence key/value cache for the layers of one shard.

use super::ModelError;
use crate::backend::{Buffer, Device};

pub struct KvCache {
    pub(crate) k: Vec<Buffer>,
    pub(crate) v: Vec<Buffer>,
    capacity: usize,
    len: usize,
}

impl KvCache {
    pub(crate) fn new(
        dev: &Device,
        layers: usize,
        kv_dim: usize,
        capacity: usize,
    ) -> Result<KvCache, ModelError> {
        let bytes = (capacity * kv_dim * 4) as u64;
        let mut k = Vec::with_capacity(layers);
        let mut v = Vec::with_capacity(layers);
        for l in 0..layers {
            k.push(dev.alloc(&format!("k cache {l}"), bytes)?);
            v.push(dev.alloc(&format!("v cache {l}"), bytes)?);
        }
        Ok(KvCache {
            k,
            v,
            capacity,
            len: 0,
        })
    }

    /// Positions filled so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets positions from `len` on (the memory is reused by later tokens).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    pub fn bytes(&self) -> u64 {
        self.k.iter().chain(&self.v).map(|b| b.size()).sum()
    }
}

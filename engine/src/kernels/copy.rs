//! Copies between buffers of one device.

use super::op::{OpSpec, Use, params};
use crate::backend::{self, Buffer};

/// Copies `bytes` bytes (a multiple of 4) between buffers, offsets multiples of 4; `src` may
/// be `dst` where the ranges do not overlap.
#[derive(Debug, Clone, Copy)]
pub struct BufferCopy<'a> {
    pub src: &'a Buffer,
    pub src_offset: u64,
    pub dst: &'a Buffer,
    pub dst_offset: u64,
    pub bytes: u64,
}

params!(
    /// Offsets and length in 4-byte words, each split into low and high halves.
    CopyParams {
        src_lo: u32,
        src_hi: u32,
        dst_lo: u32,
        dst_hi: u32,
        n_lo: u32,
        n_hi: u32,
    }
);

impl<'a> OpSpec<'a> for BufferCopy<'a> {
    type Params = CopyParams;

    fn name(&self) -> &'static str {
        "copy"
    }

    fn check(&self) -> Result<(), String> {
        let (s, d, n) = (self.src_offset, self.dst_offset, self.bytes);
        if !s.is_multiple_of(4) || !d.is_multiple_of(4) || !n.is_multiple_of(4) {
            return Err("offsets and length must be multiples of 4".into());
        }
        if std::ptr::eq(self.src, self.dst) && s < d.saturating_add(n) && d < s.saturating_add(n) {
            return Err("source and destination ranges overlap".into());
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        vec![
            Use::read("src", self.src, self.src_offset.checked_add(self.bytes)),
            Use::in_place("dst", self.dst, self.dst_offset.checked_add(self.bytes)),
        ]
    }

    fn params(&self) -> CopyParams {
        let (s, d, n) = (self.src_offset / 4, self.dst_offset / 4, self.bytes / 4);
        CopyParams {
            src_lo: s as u32,
            src_hi: (s >> 32) as u32,
            dst_lo: d as u32,
            dst_hi: (d >> 32) as u32,
            n_lo: n as u32,
            n_hi: (n >> 32) as u32,
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        backend::cpu::access::copy(
            self.src,
            self.src_offset,
            self.dst,
            self.dst_offset,
            self.bytes,
        )
    }
}

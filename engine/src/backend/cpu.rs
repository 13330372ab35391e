//! The CPU backend: runs each op's reference function. It is both a real backend (the
//! fallback where there is no usable GPU) and the oracle every GPU test compares against.

use std::sync::RwLock;

use super::{BackendError, Buffer, Result, Storage};
use crate::kernels::{Op, OpSpec, with_op};

/// Host memory for one buffer; words keep f32 views aligned.
pub struct CpuStorage {
    words: RwLock<Vec<u32>>,
}

impl CpuStorage {
    pub(crate) fn write(&self, offset: u64, data: &[u8]) {
        let mut w = self.words.write().unwrap_or_else(|e| e.into_inner());
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut w);
        bytes[offset as usize..][..data.len()].copy_from_slice(data);
    }

    pub(crate) fn read(&self, offset: u64, len: u64) -> Vec<u8> {
        let w = self.words.read().unwrap_or_else(|e| e.into_inner());
        let bytes: &[u8] = bytemuck::cast_slice(&w);
        bytes[offset as usize..][..len as usize].to_vec()
    }
}

#[derive(Default)]
pub struct CpuBackend;

fn storage(b: &Buffer) -> Result<&CpuStorage> {
    match &b.storage {
        Storage::Cpu(s) => Ok(s),
        _ => Err(BackendError::ForeignBuffer {
            label: b.label().to_string(),
        }),
    }
}

type ReadGuard<'a> = std::sync::RwLockReadGuard<'a, Vec<u32>>;
type WriteGuard<'a> = std::sync::RwLockWriteGuard<'a, Vec<u32>>;

/// What the ops' reference runs use to reach `cpu` buffers: locked words, viewed as f32s or
/// bytes. An op that reads and writes one buffer takes the write lock alone.
pub(crate) mod access {
    use super::*;

    pub(crate) fn rd(b: &Buffer) -> Result<ReadGuard<'_>> {
        Ok(storage(b)?.words.read().unwrap_or_else(|e| e.into_inner()))
    }
    pub(crate) fn wr(b: &Buffer) -> Result<WriteGuard<'_>> {
        Ok(storage(b)?.words.write().unwrap_or_else(|e| e.into_inner()))
    }
    pub(crate) fn f(g: &[u32]) -> &[f32] {
        bytemuck::cast_slice(g)
    }
    pub(crate) fn fm(g: &mut [u32]) -> &mut [f32] {
        bytemuck::cast_slice_mut(g)
    }
    pub(crate) fn bytes(g: &[u32]) -> &[u8] {
        bytemuck::cast_slice(g)
    }
    pub(crate) fn copy(
        src: &Buffer,
        src_offset: u64,
        dst: &Buffer,
        dst_offset: u64,
        len: u64,
    ) -> Result<()> {
        let data = storage(src)?.read(src_offset, len);
        storage(dst)?.write(dst_offset, &data);
        Ok(())
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }

    pub(crate) fn alloc(&self, label: &str, bytes: u64) -> Result<CpuStorage> {
        let words = usize::try_from(bytes.div_ceil(4)).map_err(|_| BackendError::OutOfMemory {
            device: "cpu".into(),
            label: label.into(),
            bytes,
            reason: "larger than the address space".into(),
        })?;
        let mut v = Vec::new();
        v.try_reserve_exact(words)
            .map_err(|e| BackendError::OutOfMemory {
                device: "cpu".into(),
                label: label.into(),
                bytes,
                reason: e.to_string(),
            })?;
        v.resize(words, 0);
        Ok(CpuStorage {
            words: RwLock::new(v),
        })
    }

    pub(crate) fn run(&self, ops: &[Op<'_>]) -> Result<()> {
        for op in ops {
            with_op!(op, o => o.cpu())?;
        }
        Ok(())
    }
}

//! The CPU backend: a real backend (the fallback where there is no usable GPU) and the
//! oracle every GPU test compares against. Quantized `Linear` ops run integer dot products
//! against int8 activations with SIMD chosen at run time (`linear`, `dot`, `q8`); every
//! other op runs its reference function in `kernels`.

use std::sync::{Mutex, RwLock};

use super::{BackendError, Buffer, Result, Storage};
use crate::kernels::{Op, OpSpec, with_op};

mod attention;
mod check;
mod dot;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub(crate) mod exp_simd128;
mod linear;
mod q8;
// wasm32 has the team only where it is built with shared memory (the browser's threaded
// package); its workers are Web Workers (`team`).
#[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
mod team;
#[cfg(test)]
mod tests;
mod vecf32;

pub use check::{KernelCheck, check_kernels};
#[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
pub use team::{
    serve_wasm_team, set_wasm_team_spin, start_wasm_team, wasm_team_failed_flag, wasm_team_joins,
    wasm_team_probe,
};

use access::{bytes, f, fm, rd, wr};

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

pub struct CpuBackend {
    isa: dot::Isa,
    vec: vecf32::VecF32,
    /// The quantized activations of the op running; kept so no op allocates them anew.
    scratch: Mutex<q8::Q8>,
    /// `Linear` runs the f32 reference (`EngineOptions::cpu_f32_linear`).
    f32_linear: bool,
}

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

/// The feed-forward's `silu(gate)·up`, as the op's own `cpu` computes it but in pieces over
/// the team: alone on the calling thread it was a serial stretch between the products (3.6% of
/// a prompt's time in the browser's fallback on one thread, more on two).
fn silu_mul(s: &crate::kernels::SiluMul<'_>) -> Result<()> {
    let (g, u, mut o) = (rd(s.gate)?, rd(s.up)?, wr(s.out)?);
    let n = s.n as usize;
    let (g, u) = (&f(&g)[..n], &f(&u)[..n]);
    linear::par_chunks(&mut fm(&mut o)[..n], 4096, 16 * n, |first, out| {
        let (g, u) = (&g[first..][..out.len()], &u[first..][..out.len()]);
        crate::kernels::elementwise::silu_mul_here(g, u, out);
    });
    Ok(())
}

/// A number no streak of products had before ([`CpuBackend::run`]).
fn next_streak() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The instruction set the quantized dot products run here, for the device description.
pub(crate) fn isa_name() -> &'static str {
    dot::Isa::detect().name()
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend {
            isa: dot::Isa::detect(),
            vec: vecf32::VecF32::new(dot::Isa::detect()),
            scratch: Mutex::default(),
            f32_linear: false,
        }
    }

    /// A backend whose `Linear` keeps activations in f32 when `f32_linear` is set.
    pub fn with_f32_linear(f32_linear: bool) -> Self {
        CpuBackend {
            f32_linear,
            ..Self::new()
        }
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
        // Products in a row with no other op between them read buffers nothing wrote since
        // the first of them: one from the same activations as the last reuses their int8
        // values (`q8::Source`). Every other op, and every run, starts a new streak.
        let mut streak = next_streak();
        for op in ops {
            match op {
                Op::Linear(l) if !self.f32_linear => self.linear(l, streak)?,
                Op::Attention(a) => self.attention(a)?,
                Op::PagedAttention(a) => self.paged_attention(a)?,
                Op::SiluMul(s) => silu_mul(s)?,
                _ => with_op!(op, o => o.cpu())?,
            }
            if !matches!(op, Op::Linear(_)) {
                streak = next_streak();
            }
        }
        Ok(())
    }

    fn attention(&self, a: &crate::kernels::Attention<'_>) -> Result<()> {
        let (q, k, v) = (rd(a.q)?, rd(a.k_cache)?, rd(a.v_cache)?);
        let mut o = wr(a.out)?;
        let shape = [a.heads, a.kv_heads, a.head_dim, a.tokens, a.pos0, a.window];
        let shape = shape.map(|n| n as usize);
        attention::attention(
            &self.vec,
            f(&q),
            f(&k),
            f(&v),
            fm(&mut o),
            shape,
            [a.scale, a.softcap],
        );
        Ok(())
    }

    /// The reference's checks first (every table entry and block within bounds), then the
    /// pool's parallel, vectorized attention.
    fn paged_attention(&self, a: &crate::kernels::PagedAttention<'_>) -> Result<()> {
        let p = crate::kernels::OpSpec::params(a);
        let rows = rd(a.rows)?[..2 * a.tokens as usize].to_vec();
        let table = rd(a.table)?[..a.table_len as usize].to_vec();
        crate::kernels::paged::check_tables(&rows, &table, &p)?;
        let (q, k, v) = (rd(a.q)?, rd(a.k_pool)?, rd(a.v_pool)?);
        let mut o = wr(a.out)?;
        let (block, window) = (a.block as usize, a.window as usize);
        let shape = [a.heads, a.kv_heads, a.head_dim, a.tokens].map(|n| n as usize);
        attention::paged_attention(
            &self.vec,
            f(&q),
            f(&k),
            f(&v),
            fm(&mut o),
            shape,
            [a.scale, a.softcap],
            block,
            |t| {
                let n = rows[2 * t + 1] as usize;
                crate::kernels::attention::first_key(n, window)..n
            },
            |t, b| table[rows[2 * t] as usize + b] as usize,
        );
        Ok(())
    }

    fn linear(&self, l: &crate::kernels::Linear<'_>, streak: u64) -> Result<()> {
        let (w, x, mut y) = (rd(l.w)?, rd(l.x)?, wr(l.y)?);
        let (rows, cols, tokens) = (l.rows as usize, l.cols as usize, l.tokens as usize);
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let x = &f(&x)[..tokens * cols];
        let source = q8::Source {
            streak,
            addr: x.as_ptr() as usize,
            cols,
            tokens,
        };
        linear::linear(
            self.isa,
            &mut scratch,
            Some(source),
            l.wtype,
            bytes(&w),
            x,
            &mut fm(&mut y)[..tokens * rows],
            rows,
            cols,
            tokens,
        );
        scratch.written(&fm(&mut y)[..tokens * rows]);
        Ok(())
    }
}

//! The CPU backend: runs each op's reference function. It is both a real backend (the
//! fallback where there is no usable GPU) and the oracle every GPU test compares against.

use std::sync::RwLock;

use super::{BackendError, Buffer, Result, Storage};
use crate::kernels::{self, Op};

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

fn rd(b: &Buffer) -> Result<ReadGuard<'_>> {
    Ok(storage(b)?.words.read().unwrap_or_else(|e| e.into_inner()))
}
fn wr(b: &Buffer) -> Result<WriteGuard<'_>> {
    Ok(storage(b)?.words.write().unwrap_or_else(|e| e.into_inner()))
}
fn f(g: &[u32]) -> &[f32] {
    bytemuck::cast_slice(g)
}
fn fm(g: &mut [u32]) -> &mut [f32] {
    bytemuck::cast_slice_mut(g)
}
fn bytes(g: &[u32]) -> &[u8] {
    bytemuck::cast_slice(g)
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
            self.run_one(op)?;
        }
        Ok(())
    }

    fn run_one(&self, op: &Op<'_>) -> Result<()> {
        use kernels::*;
        match *op {
            Op::MatMul { a, b, c, m, n, k } => {
                let (a, b, mut c) = (rd(a)?, rd(b)?, wr(c)?);
                linear::matmul(f(&a), f(&b), fm(&mut c), m as usize, n as usize, k as usize);
            }
            Op::Linear {
                w,
                wtype,
                x,
                y,
                rows,
                cols,
                tokens,
            } => {
                let (w, x, mut y) = (rd(w)?, rd(x)?, wr(y)?);
                let (rows, cols, tokens) = (rows as usize, cols as usize, tokens as usize);
                linear::linear(
                    wtype,
                    bytes(&w),
                    &f(&x)[..tokens * cols],
                    &mut fm(&mut y)[..tokens * rows],
                    rows,
                    cols,
                    tokens,
                );
            }
            Op::RmsNorm {
                x,
                weight,
                y,
                dim,
                tokens,
                eps,
            } => {
                let n = (dim * tokens) as usize;
                let wv = rd(weight)?.clone();
                if std::ptr::eq(x, y) {
                    let mut g = wr(y)?;
                    let xs = f(&g)[..n].to_vec();
                    norm::rms_norm(&xs, f(&wv), &mut fm(&mut g)[..n], dim as usize, eps);
                } else {
                    let (x, mut y) = (rd(x)?, wr(y)?);
                    norm::rms_norm(&f(&x)[..n], f(&wv), &mut fm(&mut y)[..n], dim as usize, eps);
                }
            }
            Op::Rope {
                x,
                heads,
                head_dim,
                rope_dim,
                tokens,
                pos0,
                freq_base,
                neox,
            } => {
                let mut g = wr(x)?;
                let n = (tokens * heads * head_dim) as usize;
                rope::rope(
                    &mut fm(&mut g)[..n],
                    heads as usize,
                    head_dim as usize,
                    rope_dim as usize,
                    pos0,
                    freq_base,
                    neox,
                );
            }
            Op::Softmax { x, rows, cols } => {
                let mut g = wr(x)?;
                softmax::softmax(&mut fm(&mut g)[..(rows * cols) as usize], cols as usize);
            }
            Op::SiluMul { gate, up, out, n } => {
                let (g, u, mut o) = (rd(gate)?, rd(up)?, wr(out)?);
                let n = n as usize;
                elementwise::silu_mul(&f(&g)[..n], &f(&u)[..n], &mut fm(&mut o)[..n]);
            }
            Op::Add { a, b, out, n } => {
                let n = n as usize;
                let other = if std::ptr::eq(out, a) {
                    Some(b)
                } else if std::ptr::eq(out, b) {
                    Some(a)
                } else {
                    None
                };
                match other {
                    Some(src) => {
                        let s = rd(src)?.clone();
                        let mut o = wr(out)?;
                        elementwise::add_assign(&mut fm(&mut o)[..n], &f(&s)[..n]);
                    }
                    None => {
                        let (a, b, mut o) = (rd(a)?, rd(b)?, wr(out)?);
                        elementwise::add(&f(&a)[..n], &f(&b)[..n], &mut fm(&mut o)[..n]);
                    }
                }
            }
            Op::Embed {
                table,
                ttype,
                ids,
                out,
                dim,
                vocab,
                tokens,
            } => {
                let (t, i, mut o) = (rd(table)?, rd(ids)?, wr(out)?);
                let n = (dim * tokens) as usize;
                embed::embed(
                    bytes(&t),
                    ttype,
                    &i[..tokens as usize],
                    &mut fm(&mut o)[..n],
                    dim as usize,
                    vocab as usize,
                );
            }
            Op::Attention {
                q,
                k_cache,
                v_cache,
                out,
                heads,
                kv_heads,
                head_dim,
                tokens,
                pos0,
                scale,
            } => {
                let (q, k, v, mut o) = (rd(q)?, rd(k_cache)?, rd(v_cache)?, wr(out)?);
                attention::attention(
                    f(&q),
                    f(&k),
                    f(&v),
                    fm(&mut o),
                    heads as usize,
                    kv_heads as usize,
                    head_dim as usize,
                    tokens as usize,
                    pos0 as usize,
                    scale,
                );
            }
            Op::Argmax { x, n, out } => {
                let (x, mut o) = (rd(x)?, wr(out)?);
                o[0] = sample::argmax(&f(&x)[..n as usize]);
            }
            Op::Sample {
                logits,
                n,
                out,
                params,
            } => {
                let (x, mut o) = (rd(logits)?, wr(out)?);
                o[0] = sample::sample(&f(&x)[..n as usize], &params);
            }
            Op::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                bytes: len,
            } => {
                let data = storage(src)?.read(src_offset, len);
                storage(dst)?.write(dst_offset, &data);
            }
        }
        Ok(())
    }
}

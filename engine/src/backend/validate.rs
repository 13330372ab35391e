//! Shape checks every backend runs before queuing an op, so a kernel never reads or writes
//! outside its buffers and a wrong shape is an error, not garbage or a crash.

use super::{BackendError, Buffer, Result};
use crate::kernels::Op;

fn need(op: &'static str, what: &str, buf: &Buffer, bytes: Option<u64>) -> Result<()> {
    match bytes {
        Some(b) if b <= buf.size() => Ok(()),
        Some(b) => Err(BackendError::InvalidOp {
            op,
            reason: format!(
                "{what} ({}) needs {b} bytes, has {}",
                buf.label(),
                buf.size()
            ),
        }),
        None => Err(BackendError::InvalidOp {
            op,
            reason: format!("{what}: size overflows"),
        }),
    }
}

fn f32s(n: &[u32]) -> Option<u64> {
    n.iter()
        .try_fold(4u64, |acc, &v| acc.checked_mul(u64::from(v)))
}

fn distinct(op: &'static str, out: &Buffer, inputs: &[&Buffer]) -> Result<()> {
    if inputs.iter().any(|b| std::ptr::eq(*b, out)) {
        return Err(BackendError::InvalidOp {
            op,
            reason: format!("output {} must not also be an input", out.label()),
        });
    }
    Ok(())
}

fn invalid(op: &'static str, reason: impl Into<String>) -> BackendError {
    BackendError::InvalidOp {
        op,
        reason: reason.into(),
    }
}

/// Checks an op's shapes against its buffers.
pub fn validate_op(op: &Op<'_>) -> Result<()> {
    let name = op.name();
    match *op {
        Op::MatMul { a, b, c, m, n, k } => {
            need(name, "a", a, f32s(&[m, k]))?;
            need(name, "b", b, f32s(&[k, n]))?;
            need(name, "c", c, f32s(&[m, n]))?;
            distinct(name, c, &[a, b])
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
            let row = wtype.row_bytes(cols as usize).ok_or_else(|| {
                invalid(
                    name,
                    format!(
                        "{cols} columns is not a whole number of {} blocks",
                        wtype.name()
                    ),
                )
            })?;
            need(name, "w", w, (row as u64).checked_mul(u64::from(rows)))?;
            need(name, "x", x, f32s(&[tokens, cols]))?;
            need(name, "y", y, f32s(&[tokens, rows]))?;
            distinct(name, y, &[w, x])
        }
        Op::RmsNorm {
            x,
            weight,
            y,
            dim,
            tokens,
            eps,
        } => {
            if eps.is_nan() || eps < 0.0 {
                return Err(invalid(name, format!("eps must be >= 0, got {eps}")));
            }
            need(name, "x", x, f32s(&[tokens, dim]))?;
            need(name, "weight", weight, f32s(&[dim]))?;
            need(name, "y", y, f32s(&[tokens, dim]))
        }
        Op::Rope {
            x,
            heads,
            head_dim,
            rope_dim,
            tokens,
            ..
        } => {
            if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
                return Err(invalid(
                    name,
                    format!("rope_dim {rope_dim} must be even and at most head_dim {head_dim}"),
                ));
            }
            need(name, "x", x, f32s(&[tokens, heads, head_dim]))
        }
        Op::Softmax { x, rows, cols } => need(name, "x", x, f32s(&[rows, cols])),
        Op::SiluMul { gate, up, out, n } => {
            need(name, "gate", gate, f32s(&[n]))?;
            need(name, "up", up, f32s(&[n]))?;
            need(name, "out", out, f32s(&[n]))?;
            distinct(name, out, &[gate, up])
        }
        Op::Add { a, b, out, n } => {
            need(name, "a", a, f32s(&[n]))?;
            need(name, "b", b, f32s(&[n]))?;
            need(name, "out", out, f32s(&[n]))?;
            if std::ptr::eq(a, b) && std::ptr::eq(a, out) {
                return Err(invalid(name, "a, b and out are all the same buffer"));
            }
            Ok(())
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
            let row = ttype.row_bytes(dim as usize).ok_or_else(|| {
                invalid(
                    name,
                    format!("dim {dim} is not a whole number of {} blocks", ttype.name()),
                )
            })?;
            need(
                name,
                "table",
                table,
                (row as u64).checked_mul(u64::from(vocab)),
            )?;
            need(name, "ids", ids, f32s(&[tokens]))?;
            need(name, "out", out, f32s(&[tokens, dim]))?;
            distinct(name, out, &[table, ids])
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
            ..
        } => {
            if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
                return Err(invalid(
                    name,
                    format!("{heads} query heads is not a multiple of {kv_heads} kv heads"),
                ));
            }
            if head_dim > 256 {
                return Err(invalid(name, format!("head_dim {head_dim} exceeds 256")));
            }
            let n_pos = pos0
                .checked_add(tokens)
                .ok_or_else(|| invalid(name, "pos0 + tokens overflows"))?;
            need(name, "q", q, f32s(&[tokens, heads, head_dim]))?;
            need(name, "k_cache", k_cache, f32s(&[n_pos, kv_heads, head_dim]))?;
            need(name, "v_cache", v_cache, f32s(&[n_pos, kv_heads, head_dim]))?;
            need(name, "out", out, f32s(&[tokens, heads, head_dim]))?;
            distinct(name, out, &[q, k_cache, v_cache])
        }
        Op::Argmax { x, n, out } => {
            if n == 0 {
                return Err(invalid(name, "no values"));
            }
            need(name, "x", x, f32s(&[n]))?;
            need(name, "out", out, Some(4))?;
            distinct(name, out, &[x])
        }
        Op::Sample {
            logits,
            n,
            out,
            params,
        } => {
            if n == 0 {
                return Err(invalid(name, "no logits"));
            }
            if params.temperature.is_nan() || params.top_p.is_nan() {
                return Err(invalid(name, "temperature and top_p must be numbers"));
            }
            need(name, "logits", logits, f32s(&[n]))?;
            need(name, "out", out, Some(4))?;
            distinct(name, out, &[logits])
        }
        Op::Copy {
            src,
            src_offset,
            dst,
            dst_offset,
            bytes,
        } => {
            if !src_offset.is_multiple_of(4)
                || !dst_offset.is_multiple_of(4)
                || !bytes.is_multiple_of(4)
            {
                return Err(invalid(name, "offsets and length must be multiples of 4"));
            }
            need(name, "src", src, src_offset.checked_add(bytes))?;
            need(name, "dst", dst, dst_offset.checked_add(bytes))?;
            if std::ptr::eq(src, dst) {
                let overlap = src_offset < dst_offset + bytes && dst_offset < src_offset + bytes;
                if overlap {
                    return Err(invalid(name, "source and destination ranges overlap"));
                }
            }
            Ok(())
        }
    }
}

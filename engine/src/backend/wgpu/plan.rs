//! How each op maps onto kernels: pipeline, bindings, parameters and grid.

use cairn_shaders::{self as shaders, Kernel};

use crate::backend::{BackendError, Buffer, Result};
use crate::kernels::Op;

/// One GPU command of a submission.
pub(crate) enum Step<'a> {
    Dispatch {
        kernel: Kernel,
        format: Option<&'static str>,
        /// Bound at bindings 1.. in order (binding 0 is the parameters).
        buffers: Vec<&'a Buffer>,
        params: [u32; 8],
        groups: [u32; 3],
    },
    Copy {
        src: &'a Buffer,
        src_offset: u64,
        dst: &'a Buffer,
        dst_offset: u64,
        bytes: u64,
    },
}

/// Spreads `n` workgroups over x and y so neither passes the per-dimension limit; kernels
/// recover the linear index as `wid.y * num_workgroups.x + wid.x`.
fn grid(n: u32, max_dim: u32) -> Result<[u32; 3]> {
    let n = n.max(1);
    let x = n.min(max_dim);
    let y = n.div_ceil(x);
    if y > max_dim {
        return Err(BackendError::Unsupported(format!(
            "{n} workgroups exceed the device's {max_dim} x {max_dim} grid"
        )));
    }
    Ok([x, y, 1])
}

fn f(v: f32) -> u32 {
    v.to_bits()
}

pub(crate) fn plan<'a>(op: &Op<'a>, max_dim: u32) -> Result<Step<'a>> {
    let dispatch = |kernel, format, buffers, params, groups| {
        Ok(Step::Dispatch {
            kernel,
            format,
            buffers,
            params,
            groups,
        })
    };
    match *op {
        Op::MatMul { a, b, c, m, n, k } => dispatch(
            shaders::MATMUL,
            None,
            vec![a, b, c],
            [m, n, k, 0, 0, 0, 0, 0],
            [n.div_ceil(32).max(1), m.div_ceil(32).max(1), 1],
        ),
        Op::Linear {
            w,
            wtype,
            x,
            y,
            rows,
            cols,
            tokens,
        } => {
            let row_bytes = wtype.row_bytes(cols as usize).unwrap_or(0) as u32;
            let params = [rows, cols, row_bytes, tokens, 0, 0, 0, 0];
            if tokens == 1 {
                dispatch(
                    shaders::LINEAR_MATVEC,
                    Some(wtype.name()),
                    vec![w, x, y],
                    params,
                    grid(rows.div_ceil(8), max_dim)?,
                )
            } else {
                dispatch(
                    shaders::LINEAR_MATMAT,
                    Some(wtype.name()),
                    vec![w, x, y],
                    params,
                    [rows.div_ceil(32).max(1), tokens.div_ceil(32).max(1), 1],
                )
            }
        }
        Op::RmsNorm {
            x,
            weight,
            y,
            dim,
            tokens,
            eps,
        } => dispatch(
            shaders::RMSNORM,
            None,
            vec![x, weight, y],
            [dim, tokens, f(eps), 0, 0, 0, 0, 0],
            grid(tokens, max_dim)?,
        ),
        Op::Rope {
            x,
            heads,
            head_dim,
            rope_dim,
            tokens,
            pos0,
            freq_base,
            neox,
        } => dispatch(
            shaders::ROPE,
            None,
            vec![x],
            [
                heads,
                head_dim,
                rope_dim,
                tokens,
                pos0,
                f(freq_base),
                u32::from(neox),
                0,
            ],
            grid((tokens * heads * (rope_dim / 2)).div_ceil(256), max_dim)?,
        ),
        Op::Softmax { x, rows, cols } => dispatch(
            shaders::SOFTMAX,
            None,
            vec![x],
            [rows, cols, 0, 0, 0, 0, 0, 0],
            grid(rows, max_dim)?,
        ),
        Op::SiluMul { gate, up, out, n } => dispatch(
            shaders::SILU_MUL,
            None,
            vec![gate, up, out],
            [n, 0, 0, 0, 0, 0, 0, 0],
            grid(n.div_ceil(256), max_dim)?,
        ),
        Op::Add { a, b, out, n } => {
            let groups = grid(n.div_ceil(256), max_dim)?;
            let params = [n, 0, 0, 0, 0, 0, 0, 0];
            if std::ptr::eq(out, a) {
                dispatch(shaders::ADD_INPLACE, None, vec![out, b], params, groups)
            } else if std::ptr::eq(out, b) {
                dispatch(shaders::ADD_INPLACE, None, vec![out, a], params, groups)
            } else {
                dispatch(shaders::ADD, None, vec![a, b, out], params, groups)
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
            let row_bytes = ttype.row_bytes(dim as usize).unwrap_or(0) as u32;
            dispatch(
                shaders::EMBED,
                Some(ttype.name()),
                vec![table, ids, out],
                [dim, vocab, tokens, row_bytes, 0, 0, 0, 0],
                grid((dim * tokens).div_ceil(256), max_dim)?,
            )
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
        } => dispatch(
            shaders::ATTENTION,
            None,
            vec![q, k_cache, v_cache, out],
            [heads, kv_heads, head_dim, tokens, pos0, f(scale), 0, 0],
            [heads, tokens, 1],
        ),
        Op::Argmax { x, n, out } => dispatch(
            shaders::ARGMAX,
            None,
            vec![x, out],
            [n, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1],
        ),
        Op::Sample {
            logits,
            n,
            out,
            params: s,
        } => dispatch(
            shaders::SAMPLE,
            None,
            vec![logits, out],
            [
                n,
                s.top_k,
                s.seed as u32,
                (s.seed >> 32) as u32,
                s.step,
                f(s.temperature),
                f(s.top_p),
                0,
            ],
            [1, 1, 1],
        ),
        Op::Copy {
            src,
            src_offset,
            dst,
            dst_offset,
            bytes,
        } => Ok(Step::Copy {
            src,
            src_offset,
            dst,
            dst_offset,
            bytes,
        }),
    }
}

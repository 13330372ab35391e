//! The ops that read a tensor held in parts by rows (`backend/row_parts.rs`): a `Linear`
//! whose weights are in parts runs a product per part into a scratch buffer, whose rows are
//! then copied into their place in the output (token by token: the output is token-major);
//! an `Embed` whose table is in parts runs `embed_rows` once per part, each filling the rows
//! of the ids it holds. Neither is fused with anything.

use cairn_shaders as shaders;

use super::plan::{self, Matvec, Step, grid};
use crate::backend::row_parts::RowParts;
use crate::backend::{BackendError, Buffer, Result, Storage};
use crate::kernels::op::{params, row_bytes};
use crate::kernels::{Embed, Linear, Op};

params!(
    /// What `embed_rows` reads: `Embed`'s parameters and the rows of its part.
    EmbedRowsParams {
        dim: u32,
        vocab: u32,
        tokens: u32,
        row_bytes: u32,
        first: u32,
        rows: u32,
        _pad0: u32,
        _pad1: u32,
    }
);

/// The parts of `b`, where it is held in parts.
pub(crate) fn parts_of(b: &Buffer) -> Option<&RowParts> {
    match &b.storage {
        Storage::Rows(r) => Some(r),
        _ => None,
    }
}

/// Bytes of the scratch buffer `op`'s products per part write: a part's rows for every
/// token; `None` where `op` is no product over weights in parts.
pub(crate) fn scratch_bytes(op: &Op<'_>) -> Option<u64> {
    match op {
        Op::Linear(l) => parts_of(l.w).map(|r| u64::from(l.tokens) * r.rows_per_part * 4),
        _ => None,
    }
}

/// The steps of `op` where it reads a tensor in parts (`None` where it does not), with
/// `scratch` of at least [`scratch_bytes`] for a product.
pub(crate) fn plan_parts<'a>(
    op: &Op<'a>,
    max_dim: u32,
    matvec: Matvec,
    scratch: Option<&'a Buffer>,
) -> Result<Option<Vec<Step<'a>>>> {
    match op {
        Op::Linear(l) => match parts_of(l.w) {
            Some(r) => {
                let scratch = scratch.ok_or_else(|| {
                    BackendError::Gpu("no scratch buffer for a product in parts".into())
                })?;
                linear_parts(l, r, max_dim, matvec, scratch).map(Some)
            }
            None => Ok(None),
        },
        Op::Embed(e) => match parts_of(e.table) {
            Some(r) => embed_parts(e, r, max_dim).map(Some),
            None => Ok(None),
        },
        _ => Ok(None),
    }
}

fn linear_parts<'a>(
    l: &Linear<'a>,
    r: &'a RowParts,
    max_dim: u32,
    matvec: Matvec,
    scratch: &'a Buffer,
) -> Result<Vec<Step<'a>>> {
    let mut steps = Vec::new();
    let total = u64::from(l.rows);
    for (first, part) in r.with_first_rows() {
        if first >= total {
            break;
        }
        let rows = (total - first).min(r.rows_per_part);
        let part_op = Linear {
            w: part,
            rows: rows as u32,
            y: scratch,
            ..*l
        };
        steps.push(plan::plan(&Op::Linear(part_op), max_dim, matvec)?);
        for t in 0..u64::from(l.tokens) {
            steps.push(Step::Copy {
                src: scratch,
                src_offset: t * rows * 4,
                dst: l.y,
                dst_offset: (t * total + first) * 4,
                bytes: rows * 4,
            });
        }
    }
    Ok(steps)
}

fn embed_parts<'a>(e: &Embed<'a>, r: &'a RowParts, max_dim: u32) -> Result<Vec<Step<'a>>> {
    let groups = grid((e.dim * e.tokens).div_ceil(256), max_dim)?;
    let mut steps = Vec::new();
    for (first, part) in r.with_first_rows() {
        let p = EmbedRowsParams {
            dim: e.dim,
            vocab: e.vocab,
            tokens: e.tokens,
            row_bytes: row_bytes(e.ttype, e.dim),
            first: first as u32,
            // Counted from the table, not the part's bytes: a repacked part is padded.
            rows: (u64::from(e.vocab).saturating_sub(first)).min(r.rows_per_part) as u32,
            _pad0: 0,
            _pad1: 0,
        };
        let mut params = [0u32; super::PARAM_WORDS];
        let words: &[u32] = bytemuck::cast_slice(bytemuck::bytes_of(&p));
        params[..words.len()].copy_from_slice(words);
        steps.push(Step::Dispatch {
            kernel: shaders::EMBED_ROWS,
            format: Some(e.ttype.name()),
            buffers: vec![part, e.ids, e.out],
            params,
            groups,
        });
    }
    Ok(steps)
}

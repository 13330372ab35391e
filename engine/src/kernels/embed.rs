//! Embedding lookup from a (possibly quantized) table.

use crate::quant::{GgmlType, dequantize_row};

/// Ids at or beyond `vocab` produce zero rows: the op never reads outside the table, and the
/// model refuses such ids before they reach a device.
pub fn embed(
    table: &[u8],
    ttype: GgmlType,
    ids: &[u32],
    out: &mut [f32],
    dim: usize,
    vocab: usize,
) {
    let row_bytes = ttype.row_bytes(dim).unwrap_or(0);
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(dim)) {
        let id = id as usize;
        match table.get(id * row_bytes..(id + 1) * row_bytes) {
            Some(row) if id < vocab => dequantize_row(ttype, row, o),
            _ => o.fill(0.0),
        }
    }
}

//! Embedding lookup from a (possibly quantized) table.

use super::op::{OpSpec, Use, f32s, params, row_bytes};
use crate::backend::cpu::access::{bytes, fm, rd, wr};
use crate::backend::{self, Buffer};
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

/// `out[t] = dequantize(table[ids[t]])` for `tokens` u32 ids; `table` is `vocab × dim`.
#[derive(Debug, Clone, Copy)]
pub struct Embed<'a> {
    pub table: &'a Buffer,
    pub ttype: GgmlType,
    pub ids: &'a Buffer,
    pub out: &'a Buffer,
    pub dim: u32,
    pub vocab: u32,
    pub tokens: u32,
}

params!(EmbedParams {
    dim: u32,
    vocab: u32,
    tokens: u32,
    row_bytes: u32,
});

impl<'a> OpSpec<'a> for Embed<'a> {
    type Params = EmbedParams;

    fn name(&self) -> &'static str {
        "embed"
    }

    fn check(&self) -> Result<(), String> {
        match self.ttype.row_bytes(self.dim as usize) {
            Some(_) => Ok(()),
            None => Err(format!(
                "dim {} is not a whole number of {} blocks",
                self.dim,
                self.ttype.name()
            )),
        }
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let row = self.ttype.row_bytes(self.dim as usize);
        let table = row.and_then(|r| (r as u64).checked_mul(u64::from(self.vocab)));
        vec![
            Use::read("table", self.table, table),
            Use::read("ids", self.ids, f32s(&[self.tokens])),
            Use::write("out", self.out, f32s(&[self.tokens, self.dim])),
        ]
    }

    fn params(&self) -> EmbedParams {
        EmbedParams {
            dim: self.dim,
            vocab: self.vocab,
            tokens: self.tokens,
            row_bytes: row_bytes(self.ttype, self.dim),
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let (t, i, mut o) = (rd(self.table)?, rd(self.ids)?, wr(self.out)?);
        let n = (self.dim * self.tokens) as usize;
        embed(
            bytes(&t),
            self.ttype,
            &i[..self.tokens as usize],
            &mut fm(&mut o)[..n],
            self.dim as usize,
            self.vocab as usize,
        );
        Ok(())
    }
}

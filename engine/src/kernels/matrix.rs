//! The matrix-product ops: f32 `MatMul`, and `Linear` over weights in a GGUF format.

use super::linear::{linear, matmul};
use super::op::{OpSpec, Use, f32s, params, row_bytes};
use crate::backend::cpu::access::{bytes, f, fm, rd, wr};
use crate::backend::{self, Buffer};
use crate::quant::GgmlType;

/// `c[m×n] = a[m×k] · b[k×n]`, all f32.
#[derive(Debug, Clone, Copy)]
pub struct MatMul<'a> {
    pub a: &'a Buffer,
    pub b: &'a Buffer,
    pub c: &'a Buffer,
    pub m: u32,
    pub n: u32,
    pub k: u32,
}

params!(MatMulParams {
    m: u32,
    n: u32,
    k: u32,
    _pad: u32,
});

impl<'a> OpSpec<'a> for MatMul<'a> {
    type Params = MatMulParams;

    fn name(&self) -> &'static str {
        "matmul"
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let (m, n, k) = (self.m, self.n, self.k);
        vec![
            Use::read("a", self.a, f32s(&[m, k])),
            Use::read("b", self.b, f32s(&[k, n])),
            Use::write("c", self.c, f32s(&[m, n])),
        ]
    }

    fn params(&self) -> MatMulParams {
        MatMulParams {
            m: self.m,
            n: self.n,
            k: self.k,
            _pad: 0,
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let (a, b, mut c) = (rd(self.a)?, rd(self.b)?, wr(self.c)?);
        let (m, n, k) = (self.m as usize, self.n as usize, self.k as usize);
        matmul(f(&a), f(&b), fm(&mut c), m, n, k);
        Ok(())
    }
}

/// `y[t, r] = Σ_c w[r, c] · x[t, c]` for `tokens` rows of `x`: matrix-vector when
/// `tokens == 1`, matrix-matrix otherwise. `w` is `rows × cols` of `wtype`.
#[derive(Debug, Clone, Copy)]
pub struct Linear<'a> {
    pub w: &'a Buffer,
    pub wtype: GgmlType,
    pub x: &'a Buffer,
    pub y: &'a Buffer,
    pub rows: u32,
    pub cols: u32,
    pub tokens: u32,
}

params!(LinearParams {
    rows: u32,
    cols: u32,
    tokens: u32,
    row_bytes: u32,
});

impl<'a> OpSpec<'a> for Linear<'a> {
    type Params = LinearParams;

    fn name(&self) -> &'static str {
        if self.tokens == 1 { "matvec" } else { "matmat" }
    }

    fn check(&self) -> Result<(), String> {
        match self.wtype.row_bytes(self.cols as usize) {
            Some(_) => Ok(()),
            None => Err(format!(
                "{} columns is not a whole number of {} blocks",
                self.cols,
                self.wtype.name()
            )),
        }
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let row = self.wtype.row_bytes(self.cols as usize);
        let w = row.and_then(|r| (r as u64).checked_mul(u64::from(self.rows)));
        vec![
            Use::read("w", self.w, w),
            Use::read("x", self.x, f32s(&[self.tokens, self.cols])),
            Use::write("y", self.y, f32s(&[self.tokens, self.rows])),
        ]
    }

    fn params(&self) -> LinearParams {
        LinearParams {
            rows: self.rows,
            cols: self.cols,
            tokens: self.tokens,
            row_bytes: row_bytes(self.wtype, self.cols),
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let (w, x, mut y) = (rd(self.w)?, rd(self.x)?, wr(self.y)?);
        let (rows, cols, tokens) = (self.rows as usize, self.cols as usize, self.tokens as usize);
        linear(
            self.wtype,
            bytes(&w),
            &f(&x)[..tokens * cols],
            &mut fm(&mut y)[..tokens * rows],
            rows,
            cols,
            tokens,
        );
        Ok(())
    }
}

//! Row-wise softmax.

use super::op::{OpSpec, Use, f32s, params};
use crate::backend::cpu::access::{fm, wr};
use crate::backend::{self, Buffer};

pub fn softmax(x: &mut [f32], cols: usize) {
    for row in x.chunks_exact_mut(cols) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Softmax in place over each of `rows` rows of `cols`.
#[derive(Debug, Clone, Copy)]
pub struct Softmax<'a> {
    pub x: &'a Buffer,
    pub rows: u32,
    pub cols: u32,
}

params!(SoftmaxParams {
    rows: u32,
    cols: u32,
    _pad0: u32,
    _pad1: u32,
});

impl<'a> OpSpec<'a> for Softmax<'a> {
    type Params = SoftmaxParams;

    fn name(&self) -> &'static str {
        "softmax"
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        vec![Use::in_place("x", self.x, f32s(&[self.rows, self.cols]))]
    }

    fn params(&self) -> SoftmaxParams {
        SoftmaxParams {
            rows: self.rows,
            cols: self.cols,
            ..bytemuck::Zeroable::zeroed()
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let mut g = wr(self.x)?;
        let n = (self.rows * self.cols) as usize;
        softmax(&mut fm(&mut g)[..n], self.cols as usize);
        Ok(())
    }
}

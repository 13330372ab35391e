//! RMSNorm.

use super::op::{OpSpec, Use, f32s, params};
use crate::backend::cpu::access::{f, fm, rd, wr};
use crate::backend::{self, Buffer};

pub fn rms_norm(x: &[f32], weight: &[f32], y: &mut [f32], dim: usize, eps: f32) {
    for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, v), w) in yr.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// `y[t] = x[t] / sqrt(mean(x[t]²) + eps) * weight` over rows of `dim`; `y` may be `x`.
#[derive(Debug, Clone, Copy)]
pub struct RmsNorm<'a> {
    pub x: &'a Buffer,
    pub weight: &'a Buffer,
    pub y: &'a Buffer,
    pub dim: u32,
    pub tokens: u32,
    pub eps: f32,
}

params!(RmsNormParams {
    dim: u32,
    tokens: u32,
    eps: f32,
    _pad: u32,
});

impl<'a> OpSpec<'a> for RmsNorm<'a> {
    type Params = RmsNormParams;

    fn name(&self) -> &'static str {
        "rmsnorm"
    }

    fn check(&self) -> Result<(), String> {
        if self.eps.is_nan() || self.eps < 0.0 {
            return Err(format!("eps must be >= 0, got {}", self.eps));
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        vec![
            Use::read("x", self.x, f32s(&[self.tokens, self.dim])),
            Use::read("weight", self.weight, f32s(&[self.dim])),
            Use::in_place("y", self.y, f32s(&[self.tokens, self.dim])),
        ]
    }

    fn params(&self) -> RmsNormParams {
        RmsNormParams {
            dim: self.dim,
            tokens: self.tokens,
            eps: self.eps,
            _pad: 0,
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let n = (self.dim * self.tokens) as usize;
        let (dim, eps) = (self.dim as usize, self.eps);
        if std::ptr::eq(self.weight, self.y) {
            // One lock for both: take the weight's values first.
            let mut g = wr(self.y)?;
            let (w, xs) = (f(&g)[..dim].to_vec(), f(&g)[..n].to_vec());
            rms_norm(&xs, &w, &mut fm(&mut g)[..n], dim, eps);
            return Ok(());
        }
        // The weight is read under its own lock, not copied.
        let wv = rd(self.weight)?;
        let w = &f(&wv)[..dim];
        if std::ptr::eq(self.x, self.y) {
            let mut g = wr(self.y)?;
            let xs = f(&g)[..n].to_vec();
            rms_norm(&xs, w, &mut fm(&mut g)[..n], dim, eps);
        } else {
            let (x, mut y) = (rd(self.x)?, wr(self.y)?);
            rms_norm(&f(&x)[..n], w, &mut fm(&mut y)[..n], dim, eps);
        }
        Ok(())
    }
}

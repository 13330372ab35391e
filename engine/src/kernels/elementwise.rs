//! Elementwise kernels: SiLU- and GELU-gated multiplies, residual add, bias add, and scaling
//! with a soft cap.

use super::op::{CountParams, OpSpec, Use, f32s, params};
use crate::backend::cpu::access::{f, fm, rd, wr};
use crate::backend::{self, Buffer};

pub fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// [`silu_mul`] as this build computes it fastest: in the browser's CPU fallback four lanes
/// at a time (`exp_simd128`), where `exp` is a libm call per element.
pub(crate) fn silu_mul_here(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    crate::backend::cpu::exp_simd128::silu_mul(gate, up, out);
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    silu_mul(gate, up, out);
}

pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(*g) * u;
    }
}

/// GELU in the tanh approximation, as llama.cpp computes it for Gemma's FFN: past |v| = 10 the
/// tanh has saturated in f32, so the value is `v` or 0 there (which also keeps GPU `tanh`
/// away from arguments where some implementations overflow).
pub fn gelu(v: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF: f32 = 0.044_715;
    if v >= 10.0 {
        v
    } else if v <= -10.0 {
        0.0
    } else {
        0.5 * v * (1.0 + (SQRT_2_OVER_PI * v * (1.0 + COEF * v * v)).tanh())
    }
}

pub fn gelu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = gelu(*g) * u;
    }
}

/// `x * scale`, then `cap * tanh(x / cap)` when `cap > 0`; see [`ScaleCap`].
pub fn scale_cap(x: &mut [f32], scale: f32, cap: f32) {
    for v in x.iter_mut() {
        *v = soft_cap(*v * scale, cap);
    }
}

/// `cap * tanh(v / cap)`, or `v` when `cap` is 0: Gemma 2's soft cap of attention scores and
/// logits.
pub fn soft_cap(v: f32, cap: f32) -> f32 {
    if cap > 0.0 {
        cap * (v / cap).clamp(-10.0, 10.0).tanh()
    } else {
        v
    }
}

pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x + y;
    }
}

/// In-place residual add, the common case (`out` is `a`).
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// `out = silu(gate) * up`, elementwise over `n`.
#[derive(Debug, Clone, Copy)]
pub struct SiluMul<'a> {
    pub gate: &'a Buffer,
    pub up: &'a Buffer,
    pub out: &'a Buffer,
    pub n: u32,
}

impl<'a> OpSpec<'a> for SiluMul<'a> {
    type Params = CountParams;

    fn name(&self) -> &'static str {
        "silu_mul"
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let n = f32s(&[self.n]);
        vec![
            Use::read("gate", self.gate, n),
            Use::read("up", self.up, n),
            Use::write("out", self.out, n),
        ]
    }

    fn params(&self) -> CountParams {
        CountParams::new(self.n)
    }

    fn cpu(&self) -> backend::Result<()> {
        let (g, u, mut o) = (rd(self.gate)?, rd(self.up)?, wr(self.out)?);
        let n = self.n as usize;
        silu_mul_here(&f(&g)[..n], &f(&u)[..n], &mut fm(&mut o)[..n]);
        Ok(())
    }
}

/// `out = a + b`, elementwise over `n`; `out` may be `a` or `b`.
#[derive(Debug, Clone, Copy)]
pub struct Add<'a> {
    pub a: &'a Buffer,
    pub b: &'a Buffer,
    pub out: &'a Buffer,
    pub n: u32,
}

impl<'a> Add<'a> {
    /// The input that is not `out` when the add runs in place on the other one.
    pub fn in_place_other(&self) -> Option<&'a Buffer> {
        if std::ptr::eq(self.out, self.a) {
            Some(self.b)
        } else if std::ptr::eq(self.out, self.b) {
            Some(self.a)
        } else {
            None
        }
    }
}

impl<'a> OpSpec<'a> for Add<'a> {
    type Params = CountParams;

    fn name(&self) -> &'static str {
        "add"
    }

    fn check(&self) -> Result<(), String> {
        if std::ptr::eq(self.a, self.b) && std::ptr::eq(self.a, self.out) {
            return Err("a, b and out are all the same buffer".into());
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let n = f32s(&[self.n]);
        vec![
            Use::read("a", self.a, n),
            Use::read("b", self.b, n),
            Use::in_place("out", self.out, n),
        ]
    }

    fn params(&self) -> CountParams {
        CountParams::new(self.n)
    }

    fn cpu(&self) -> backend::Result<()> {
        let n = self.n as usize;
        match self.in_place_other() {
            // Two locks on two buffers: no copy of `src` (it was the whole buffer, a tenth of
            // a one-thread decode step on the cpu backend).
            Some(src) if !std::ptr::eq(src, self.out) => {
                let (s, mut o) = (rd(src)?, wr(self.out)?);
                add_assign(&mut fm(&mut o)[..n], &f(&s)[..n]);
            }
            Some(_) => {
                let mut o = wr(self.out)?;
                for v in &mut fm(&mut o)[..n] {
                    *v += *v;
                }
            }
            None => {
                let (a, b, mut o) = (rd(self.a)?, rd(self.b)?, wr(self.out)?);
                add(&f(&a)[..n], &f(&b)[..n], &mut fm(&mut o)[..n]);
            }
        }
        Ok(())
    }
}

/// Adds `bias` to every row of `x`; see [`AddBias`].
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_assign(row, bias);
    }
}

/// `x[t][i] += bias[i]` in place over `tokens` rows of `cols`: a product's bias (Qwen2's Q,
/// K and V).
#[derive(Debug, Clone, Copy)]
pub struct AddBias<'a> {
    pub x: &'a Buffer,
    pub bias: &'a Buffer,
    pub cols: u32,
    pub tokens: u32,
}

params!(BiasParams {
    cols: u32,
    tokens: u32,
    _pad0: u32,
    _pad1: u32,
});

impl<'a> OpSpec<'a> for AddBias<'a> {
    type Params = BiasParams;

    fn name(&self) -> &'static str {
        "add_bias"
    }

    fn check(&self) -> Result<(), String> {
        if std::ptr::eq(self.x, self.bias) {
            return Err("x and bias are the same buffer".into());
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        vec![
            Use::in_place("x", self.x, f32s(&[self.tokens, self.cols])),
            Use::read("bias", self.bias, f32s(&[self.cols])),
        ]
    }

    fn params(&self) -> BiasParams {
        BiasParams {
            cols: self.cols,
            tokens: self.tokens,
            _pad0: 0,
            _pad1: 0,
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let (b, mut x) = (rd(self.bias)?, wr(self.x)?);
        let (cols, n) = (self.cols as usize, (self.cols * self.tokens) as usize);
        if cols > 0 {
            add_bias(&mut fm(&mut x)[..n], &f(&b)[..cols]);
        }
        Ok(())
    }
}

/// `out = gelu(gate) * up`, elementwise over `n` ([`gelu`]: Gemma's FFN).
#[derive(Debug, Clone, Copy)]
pub struct GeluMul<'a> {
    pub gate: &'a Buffer,
    pub up: &'a Buffer,
    pub out: &'a Buffer,
    pub n: u32,
}

impl<'a> OpSpec<'a> for GeluMul<'a> {
    type Params = CountParams;

    fn name(&self) -> &'static str {
        "gelu_mul"
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let n = f32s(&[self.n]);
        vec![
            Use::read("gate", self.gate, n),
            Use::read("up", self.up, n),
            Use::write("out", self.out, n),
        ]
    }

    fn params(&self) -> CountParams {
        CountParams::new(self.n)
    }

    fn cpu(&self) -> backend::Result<()> {
        let (g, u, mut o) = (rd(self.gate)?, rd(self.up)?, wr(self.out)?);
        let n = self.n as usize;
        gelu_mul(&f(&g)[..n], &f(&u)[..n], &mut fm(&mut o)[..n]);
        Ok(())
    }
}

/// In place over `n` values: `x *= scale`, then `x = cap * tanh(x / cap)` when `cap > 0`.
/// Gemma scales its embeddings by sqrt(dim) (`cap` 0), and Gemma 2 soft-caps its logits
/// (`scale` 1).
#[derive(Debug, Clone, Copy)]
pub struct ScaleCap<'a> {
    pub x: &'a Buffer,
    pub n: u32,
    pub scale: f32,
    pub cap: f32,
}

params!(ScaleCapParams {
    n: u32,
    scale: f32,
    cap: f32,
    _pad: u32,
});

impl<'a> OpSpec<'a> for ScaleCap<'a> {
    type Params = ScaleCapParams;

    fn name(&self) -> &'static str {
        "scale_cap"
    }

    fn check(&self) -> Result<(), String> {
        if !(self.cap >= 0.0 && self.cap.is_finite()) {
            return Err(format!("soft cap {} is not a finite value >= 0", self.cap));
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        vec![Use::in_place("x", self.x, f32s(&[self.n]))]
    }

    fn params(&self) -> ScaleCapParams {
        ScaleCapParams {
            n: self.n,
            scale: self.scale,
            cap: self.cap,
            _pad: 0,
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let mut x = wr(self.x)?;
        scale_cap(&mut fm(&mut x)[..self.n as usize], self.scale, self.cap);
        Ok(())
    }
}

//! Rotary position embedding.

use super::op::{OpSpec, Use, f32s, params};
use crate::backend::cpu::access::{f, fm, rd, wr};
use crate::backend::{self, Buffer};

/// Rotates `x` (`tokens × heads × head_dim`) in place; see [`Rope`]. Token `t` is at
/// `positions[t]` when given, else at `pos0 + t`.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &mut [f32],
    heads: usize,
    head_dim: usize,
    rope_dim: usize,
    pos0: u32,
    positions: Option<&[u32]>,
    freq_base: f32,
    neox: bool,
    factors: Option<&[f32]>,
) {
    let half = rope_dim / 2;
    // The browser's CPU fallback: each pair's frequency once per call and each token's
    // angles once for all its heads, from the same expressions (so the same bits); a `powf`
    // and a `sin_cos` per element were 9% of a prompt's time there (docs/performance.md,
    // session 20). Natively this loop is left as it was.
    #[cfg(target_arch = "wasm32")]
    {
        let freq: Vec<f32> = (0..half)
            .map(|i| freq_base.powf(-2.0 * i as f32 / rope_dim as f32))
            .collect();
        let mut angles = vec![(0f32, 0f32); half];
        for (t, tok) in x.chunks_exact_mut(heads * head_dim).enumerate() {
            let pos = match positions {
                Some(p) => p[t] as f32,
                None => (pos0 as usize + t) as f32,
            };
            for (i, (sc, &f)) in angles.iter_mut().zip(&freq).enumerate() {
                let mut theta = pos * f;
                if let Some(fs) = factors {
                    theta /= fs[i];
                }
                *sc = theta.sin_cos();
            }
            for head in tok.chunks_exact_mut(head_dim) {
                for (i, &(s, c)) in angles.iter().enumerate() {
                    let (a, b) = if neox {
                        (i, i + half)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * c - x1 * s;
                    head[b] = x0 * s + x1 * c;
                }
            }
        }
        return;
    }
    #[allow(unreachable_code)]
    for (t, tok) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let pos = match positions {
            Some(p) => p[t] as f32,
            None => (pos0 as usize + t) as f32,
        };
        for head in tok.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let mut theta = pos * freq_base.powf(-2.0 * i as f32 / rope_dim as f32);
                if let Some(fs) = factors {
                    theta /= fs[i];
                }
                let (s, c) = theta.sin_cos();
                let (a, b) = if neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// Rotary position embedding in place on `x` (`tokens × heads × head_dim`), token `t` at
/// position `pos0 + t`. `neox` rotates pairs `(i, i + rope_dim/2)`; otherwise adjacent pairs
/// `(2i, 2i+1)`, which is what GGUF llama models use (their Q/K weights are permuted at
/// conversion). `factors` (`rope_dim / 2` values, Llama 3.1's `rope_freqs`) divide each
/// pair's angle. `positions` (`tokens` u32 values), when given, places each token on its own
/// (a batch of several sequences' tokens) and `pos0` is ignored.
#[derive(Debug, Clone, Copy)]
pub struct Rope<'a> {
    pub x: &'a Buffer,
    pub factors: Option<&'a Buffer>,
    pub positions: Option<&'a Buffer>,
    pub heads: u32,
    pub head_dim: u32,
    pub rope_dim: u32,
    pub tokens: u32,
    pub pos0: u32,
    pub freq_base: f32,
    pub neox: bool,
}

params!(RopeParams {
    heads: u32,
    head_dim: u32,
    rope_dim: u32,
    tokens: u32,
    pos0: u32,
    freq_base: f32,
    neox: u32,
    // ROPE_FACTORS when a factors buffer is bound, ROPE_POSITIONS when a positions buffer
    // gives each token's position (kernels bind them in that order, after `x`).
    flags: u32,
});

/// [`RopeParams::flags`]: frequency factors are bound.
pub const ROPE_FACTORS: u32 = 1;
/// [`RopeParams::flags`]: each token's position comes from a buffer.
pub const ROPE_POSITIONS: u32 = 2;

impl<'a> OpSpec<'a> for Rope<'a> {
    type Params = RopeParams;

    fn name(&self) -> &'static str {
        "rope"
    }

    fn check(&self) -> Result<(), String> {
        let (rope_dim, head_dim) = (self.rope_dim, self.head_dim);
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(format!(
                "rope_dim {rope_dim} must be even and at most head_dim {head_dim}"
            ));
        }
        Ok(())
    }

    fn buffers(&self) -> Vec<Use<'a>> {
        let n = f32s(&[self.tokens, self.heads, self.head_dim]);
        let mut v = vec![Use::in_place("x", self.x, n)];
        if let Some(fs) = self.factors {
            v.push(Use::read("factors", fs, f32s(&[self.rope_dim / 2])));
        }
        if let Some(p) = self.positions {
            v.push(Use::read("positions", p, f32s(&[self.tokens])));
        }
        v
    }

    fn params(&self) -> RopeParams {
        RopeParams {
            heads: self.heads,
            head_dim: self.head_dim,
            rope_dim: self.rope_dim,
            tokens: self.tokens,
            pos0: self.pos0,
            freq_base: self.freq_base,
            neox: u32::from(self.neox),
            flags: if self.factors.is_some() {
                ROPE_FACTORS
            } else {
                0
            } | if self.positions.is_some() {
                ROPE_POSITIONS
            } else {
                0
            },
        }
    }

    fn cpu(&self) -> backend::Result<()> {
        let factors = match self.factors {
            Some(b) => Some(f(&rd(b)?)[..(self.rope_dim / 2) as usize].to_vec()),
            None => None,
        };
        let positions = match self.positions {
            Some(b) => Some(rd(b)?[..self.tokens as usize].to_vec()),
            None => None,
        };
        let mut g = wr(self.x)?;
        let n = (self.tokens * self.heads * self.head_dim) as usize;
        rope(
            &mut fm(&mut g)[..n],
            self.heads as usize,
            self.head_dim as usize,
            self.rope_dim as usize,
            self.pos0,
            positions.as_deref(),
            self.freq_base,
            self.neox,
            factors.as_deref(),
        );
        Ok(())
    }
}

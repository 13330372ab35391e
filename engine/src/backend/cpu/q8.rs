//! Activations quantized to int8 once per op, so every weight row is a chain of integer dot
//! products: per 32-element block (a scale and the block's scaled sum) for the 32-element
//! formats, per 256-element block (a scale and sixteen 16-element sums) for the K-quants, the
//! way llama.cpp's Q8_1 and Q8_K activations are laid out.
//!
//! Rounding to the nearest of 255 levels moves each element by at most half a step,
//! `amax / 254` of its block, so a dot product against weights `w` moves by at most
//! `Σ_blocks amax_b / 254 · Σ_{i∈b} |w_i|` (the bound the tests hold every path to).

/// Elements per block of the 32-element formats' activations.
pub(crate) const QK: usize = 32;
/// Elements per K-quant super-block, and per group of its sums.
pub(crate) const QK_K: usize = 256;
pub(crate) const GROUP: usize = 16;

/// Which activation layout a weight format multiplies against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// 32-element blocks: `d`, `sum = d·Σq`.
    Blocks32,
    /// 256-element blocks: `d`, sixteen `Σq` of 16 elements each.
    Super256,
}

impl Layout {
    pub(crate) fn block(self) -> usize {
        match self {
            Layout::Blocks32 => QK,
            Layout::Super256 => QK_K,
        }
    }
}

/// `tokens` rows of quantized activations; reused from op to op, so its vectors only grow.
#[derive(Default)]
pub(crate) struct Q8 {
    layout: Option<Layout>,
    cols: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<f32>,
    bsums: Vec<i16>,
}

/// One token's quantized activations.
#[derive(Clone, Copy)]
pub(crate) struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    /// `Blocks32`: `d·Σq` per block; empty for `Super256`.
    pub sum: &'a [f32],
    /// `Super256`: `Σq` per 16 elements; empty for `Blocks32`.
    pub bsums: &'a [i16],
}

impl Q8 {
    /// Quantizes `tokens` rows of `cols` elements (`cols` a multiple of the layout's block).
    pub(crate) fn quantize(&mut self, layout: Layout, x: &[f32], cols: usize, tokens: usize) {
        let block = layout.block();
        debug_assert_eq!(cols % block, 0);
        let blocks = tokens * cols / block;
        self.layout = Some(layout);
        self.cols = cols;
        self.qs.resize(tokens * cols, 0);
        self.d.resize(blocks, 0.0);
        match layout {
            Layout::Blocks32 => {
                self.sum.resize(blocks, 0.0);
                self.bsums.clear();
            }
            Layout::Super256 => {
                self.sum.clear();
                self.bsums.resize(blocks * (QK_K / GROUP), 0);
            }
        }
        let x = &x[..tokens * cols];
        for (b, (xb, qb)) in x
            .chunks_exact(block)
            .zip(self.qs.chunks_exact_mut(block))
            .enumerate()
        {
            let d = quantize_block(xb, qb);
            self.d[b] = d;
            match layout {
                Layout::Blocks32 => {
                    self.sum[b] = d * qb.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
                }
                Layout::Super256 => {
                    let sums = &mut self.bsums[b * (QK_K / GROUP)..][..QK_K / GROUP];
                    for (s, g) in sums.iter_mut().zip(qb.chunks_exact(GROUP)) {
                        // 16 values of at most 127 in magnitude: fits an i16.
                        *s = g.iter().map(|&q| i16::from(q)).sum();
                    }
                }
            }
        }
    }

    pub(crate) fn row(&self, t: usize) -> Q8Row<'_> {
        let Some(layout) = self.layout else {
            return Q8Row {
                qs: &[],
                d: &[],
                sum: &[],
                bsums: &[],
            };
        };
        let blocks = self.cols / layout.block();
        Q8Row {
            qs: &self.qs[t * self.cols..][..self.cols],
            d: &self.d[t * blocks..][..blocks],
            sum: match layout {
                Layout::Blocks32 => &self.sum[t * blocks..][..blocks],
                Layout::Super256 => &[],
            },
            bsums: match layout {
                Layout::Blocks32 => &[],
                Layout::Super256 => &self.bsums[t * blocks * 16..][..blocks * 16],
            },
        }
    }
}

/// Symmetric rounding to -127..=127; returns the step.
fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        // `as` saturates; |v·id| <= 127 up to rounding, and NaN becomes 0.
        *q = (v * id).round() as i8;
    }
    d
}

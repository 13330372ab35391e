//! Activations quantized to int8 once per op, so every weight row is a chain of integer dot
//! products: per 32-element block (a scale and the block's scaled sum) for the 32-element
//! formats, per 256-element block (a scale and sixteen 16-element sums) for the K-quants, the
//! way llama.cpp's Q8_1 and Q8_K activations are laid out.
//!
//! Rounding to the nearest of 255 levels moves each element by at most half a step,
//! `amax / 254` of its block, so a dot product against weights `w` moves by at most
//! `Σ_blocks amax_b / 254 · Σ_{i∈b} |w_i|` (the bound the tests hold every path to).
//!
//! One or two elements far larger than the rest of a K-quant super-block (the "massive
//! activations" of a few tokens and channels, strongest at the feed-forward down
//! projection's input) would set that step for all 256 elements and round most of the
//! others to a level or two. So where a super-block's largest magnitude is more than
//! `OUTLIER_RATIO` times its third largest, the step is set by the third largest, the (at
//! most `OUTLIERS`) larger elements are saturated at ±127 and what saturation cut off is kept
//! as an [`Outlier`], which `linear` multiplies in f32 by the weight decoded alone. On the
//! default model as Q5_K_M (K-quants at the down projection) this takes the logits from 0.39
//! to about 0.23 rms of f32 products (llama.cpp's own Q8 activations are 0.37 away). The
//! 32-element blocks keep the plain rule: an outlier there coarsens 32 elements, not 256, and
//! their products are so cheap that the scalar decode of a few weights per row halved the
//! default model's decode speed when they had it too.

/// Elements per block of the 32-element formats' activations.
pub(crate) const QK: usize = 32;
/// Elements per K-quant super-block, and per group of its sums.
pub(crate) const QK_K: usize = 256;
pub(crate) const GROUP: usize = 16;
/// Most elements per block kept outside its int8 step.
const OUTLIERS: usize = 2;
/// How much larger than the block's third largest magnitude an element must be for its
/// block to get the finer step.
pub(crate) const OUTLIER_RATIO: f32 = 4.0;

/// An activation element beyond its block's int8 range: column `col` holds
/// `127·d·sign + rest`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Outlier {
    pub col: u32,
    pub rest: f32,
}

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
    outliers: Vec<Outlier>,
    /// Where each token's outliers start in `outliers`, and one past the last token's.
    outliers_at: Vec<usize>,
    /// What the values were quantized from, where the caller named it ([`Q8::quantize_from`]).
    source: Option<Source>,
}

/// The activations a [`Q8`] holds, as the cpu backend names them: its run of consecutive
/// products (`streak`: no other op ran in between, so the buffer is unchanged), the buffer's
/// address, and the shape (`tokens × cols` values from there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Source {
    pub streak: u64,
    pub addr: usize,
    pub cols: usize,
    pub tokens: usize,
}

/// Where [`Q8::quantize`]'s parallel tasks write.
struct Parts {
    qs: *mut i8,
    d: *mut f32,
    sum: *mut f32,
}

// SAFETY: the tasks that share it write disjoint tokens (`Q8::quantize`).
unsafe impl Sync for Parts {}

impl Parts {
    /// Token `t`'s `cols` values and its steps and sums (one per 32 values).
    ///
    /// # Safety
    /// The vectors hold token `t`, and no one else touches its parts while these live.
    #[allow(clippy::mut_from_ref)]
    unsafe fn token(&self, t: usize, cols: usize) -> (&mut [i8], &mut [f32], &mut [f32]) {
        let per = cols / QK;
        // SAFETY: the caller's.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.qs.add(t * cols), cols),
                std::slice::from_raw_parts_mut(self.d.add(t * per), per),
                std::slice::from_raw_parts_mut(self.sum.add(t * per), per),
            )
        }
    }
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
    /// What the int8 values leave out, in column order (see the module comment).
    pub outliers: &'a [Outlier],
}

impl Q8 {
    /// [`Q8::quantize`], unless these values already hold `source` in `layout` (a product
    /// right after another one from the same activations: Q, K and V, gate and up).
    pub(crate) fn quantize_from(
        &mut self,
        source: Option<Source>,
        layout: Layout,
        x: &[f32],
        cols: usize,
        tokens: usize,
    ) {
        if source.is_some() && self.source == source && self.layout == Some(layout) {
            return;
        }
        self.quantize(layout, x, cols, tokens);
        self.source = source;
    }

    /// `y` was just written: values quantized from any of it are stale (a product on the
    /// reference path writes without quantizing).
    pub(crate) fn written(&mut self, y: &[f32]) {
        let (start, end) = (y.as_ptr() as usize, y.as_ptr() as usize + 4 * y.len());
        if self
            .source
            .is_some_and(|s| s.addr < end && start < s.addr + 4 * s.cols * s.tokens)
        {
            self.source = None;
        }
    }

    /// Quantizes `tokens` rows of `cols` elements (`cols` a multiple of the layout's block).
    pub(crate) fn quantize(&mut self, layout: Layout, x: &[f32], cols: usize, tokens: usize) {
        self.source = None;
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
        self.outliers.clear();
        self.outliers_at.clear();
        self.outliers_at.push(0);
        if layout == Layout::Blocks32 {
            // No outliers in this layout: every token is independent, so the team takes
            // them where there are enough (a serial stretch between the products otherwise:
            // 7% of a wasm prefill).
            self.outliers_at.resize(tokens + 1, 0);
            let parts = Parts {
                qs: self.qs.as_mut_ptr(),
                d: self.d.as_mut_ptr(),
                sum: self.sum.as_mut_ptr(),
            };
            let parts = &parts;
            super::linear::par_tasks(tokens, tokens * cols * 8, |t| {
                // SAFETY: task `t` alone takes token `t`, inside the vectors sized above for
                // `tokens`, which outlive the tasks.
                let (qs, d, sum) = unsafe { parts.token(t, cols) };
                let xt = &x[t * cols..][..cols];
                for (((xb, qb), d), sum) in xt
                    .chunks_exact(QK)
                    .zip(qs.chunks_exact_mut(QK))
                    .zip(d.iter_mut())
                    .zip(sum.iter_mut())
                {
                    *d = quantize_block(xb, qb, 0, None);
                    *sum = *d * qb.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
                }
            });
            return;
        }
        // The K-quants' layout, on this thread: each token's outliers are appended in order.
        let per_token = cols / block;
        for (b, (xb, qb)) in x
            .chunks_exact(block)
            .zip(self.qs.chunks_exact_mut(block))
            .enumerate()
        {
            let first_col = (b % per_token) * block;
            self.d[b] = quantize_block(xb, qb, first_col, Some(&mut self.outliers));
            if (b + 1) % per_token == 0 {
                self.outliers_at.push(self.outliers.len());
            }
            let sums = &mut self.bsums[b * (QK_K / GROUP)..][..QK_K / GROUP];
            for (s, g) in sums.iter_mut().zip(qb.chunks_exact(GROUP)) {
                // 16 values of at most 127 in magnitude: fits an i16.
                *s = g.iter().map(|&q| i16::from(q)).sum();
            }
        }
    }

    /// Every token's values at once: `(qs, d, sum, bsums, cols)`, token-major (what the
    /// prefill tiles read; `sum` is empty for the 256-element layout, `bsums` for the other).
    #[allow(clippy::type_complexity)]
    pub(crate) fn parts(&self) -> (&[i8], &[f32], &[f32], &[i16], usize) {
        (&self.qs, &self.d, &self.sum, &self.bsums, self.cols)
    }

    pub(crate) fn row(&self, t: usize) -> Q8Row<'_> {
        let Some(layout) = self.layout else {
            return Q8Row {
                qs: &[],
                d: &[],
                sum: &[],
                bsums: &[],
                outliers: &[],
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
            outliers: &self.outliers[self.outliers_at[t]..self.outliers_at[t + 1]],
        }
    }
}

/// Symmetric rounding to -127..=127; returns the step. Given `outliers`, the block's
/// outliers (module comment) saturate, and what they lose is pushed there, the block
/// starting at column `first_col`.
fn quantize_block(
    x: &[f32],
    q: &mut [i8],
    first_col: usize,
    outliers: Option<&mut Vec<Outlier>>,
) -> f32 {
    let amax = match outliers {
        Some(outliers) => step_and_outliers(x, first_col, outliers),
        None => amax(x),
    };
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    round_block(x, q, id);
    d
}

/// The largest magnitude in `x` (NaN ignored).
fn amax(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if x.len().is_multiple_of(32) && super::dot::has_avx2() {
        // SAFETY: the features `simd` is compiled for were detected just above.
        return unsafe { simd::amax(x) };
    }
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    return simd128::amax(x);
    #[allow(unreachable_code)]
    x.iter().fold(0f32, |a, v| a.max(v.abs()))
}

/// `q = x·id` rounded to the nearest integer and clamped to -127..=127. Outliers land on
/// ±127, which `rest` counts from (never -128: the SIMD kernels take magnitudes of int8
/// values); NaN becomes 0.
fn round_block(x: &[f32], q: &mut [i8], id: f32) {
    #[cfg(target_arch = "x86_64")]
    if x.len().is_multiple_of(32) && q.len() >= x.len() && super::dot::has_avx2() {
        // SAFETY: as in `amax`.
        return unsafe { simd::round(x, q, id) };
    }
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    return simd128::round(x, q, id);
    #[allow(unreachable_code)]
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[path = "q8_simd128.rs"]
mod simd128;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
pub(crate) use simd128::check as check_simd128;

/// AVX2 forms of `amax`, `round_block` and the outlier test: the scalar loops were a tenth
/// of a prompt's time once its products ran over tiles (a `roundf` call per element). The
/// rounding goes to the nearest even integer at ties, where the scalar loop rounds away
/// from zero: either is within half a step, the bound every test holds products to.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    fn load(x: &[f32]) -> __m256 {
        assert!(x.len() >= 8);
        // SAFETY: 8 readable floats (checked above); loadu has no alignment requirement.
        unsafe { _mm256_loadu_ps(x.as_ptr()) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    fn abs(v: __m256) -> __m256 {
        _mm256_andnot_ps(_mm256_set1_ps(-0.0), v)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn amax(x: &[f32]) -> f32 {
        let mut m = _mm256_setzero_ps();
        for c in x.chunks_exact(8) {
            // `max_ps` returns its second operand where either is NaN: NaN is skipped.
            m = _mm256_max_ps(abs(load(c)), m);
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)))
    }

    /// How many elements of `x` times `ratio` are at least `amax`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn count_within(x: &[f32], amax: f32, ratio: f32) -> u32 {
        let (r, a) = (_mm256_set1_ps(ratio), _mm256_set1_ps(amax));
        x.chunks_exact(8)
            .map(|c| {
                let big = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_mul_ps(abs(load(c)), r), a);
                (_mm256_movemask_ps(big) as u32).count_ones()
            })
            .sum()
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn round(x: &[f32], q: &mut [i8], id: f32) {
        let (idv, hi, lo) = (
            _mm256_set1_ps(id),
            _mm256_set1_ps(127.0),
            _mm256_set1_ps(-127.0),
        );
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (xc, qc) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)) {
            let r: [__m256i; 4] = std::array::from_fn(|i| {
                let v = _mm256_mul_ps(load(&xc[8 * i..]), idv);
                // NaN to 0, then clamp and round.
                let v = _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
                let v = _mm256_max_ps(_mm256_min_ps(v, hi), lo);
                _mm256_cvtps_epi32(_mm256_round_ps::<
                    { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                >(v))
            });
            let p = _mm256_packs_epi16(
                _mm256_packs_epi32(r[0], r[1]),
                _mm256_packs_epi32(r[2], r[3]),
            );
            let p = _mm256_permutevar8x32_epi32(p, order);
            // SAFETY: `qc` is 32 writable bytes; storeu has no alignment requirement.
            unsafe { _mm256_storeu_si256(qc.as_mut_ptr().cast(), p) };
        }
    }
}

/// The magnitude that sets a super-block's step: its largest, or where that is more than
/// `OUTLIER_RATIO` times the third largest, the third largest, with the larger ones pushed to
/// `outliers`.
fn step_and_outliers(x: &[f32], first_col: usize, outliers: &mut Vec<Outlier>) -> f32 {
    // Most super-blocks have no outlier: three elements within OUTLIER_RATIO of the largest
    // say so without sorting.
    #[cfg(target_arch = "x86_64")]
    if x.len().is_multiple_of(32) && super::dot::has_avx2() {
        // SAFETY: the features `simd` is compiled for were detected just above.
        let (largest, count) = unsafe {
            let largest = simd::amax(x);
            (largest, simd::count_within(x, largest, OUTLIER_RATIO))
        };
        if count > OUTLIERS as u32 {
            return largest;
        }
    }
    // The OUTLIERS + 1 largest magnitudes, largest first.
    let mut top = [0f32; OUTLIERS + 1];
    for v in x {
        let a = v.abs();
        if a > top[OUTLIERS] {
            let mut i = OUTLIERS;
            while i > 0 && top[i - 1] < a {
                top[i] = top[i - 1];
                i -= 1;
            }
            top[i] = a;
        }
    }
    let limit = top[OUTLIERS];
    if top[0] <= OUTLIER_RATIO * limit || limit == 0.0 {
        return top[0];
    }
    for (i, v) in x.iter().enumerate() {
        if v.abs() > limit {
            outliers.push(Outlier {
                col: (first_col + i) as u32,
                rest: v - limit.copysign(*v),
            });
        }
    }
    limit
}

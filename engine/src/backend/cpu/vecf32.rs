//! f32 dot product and `y += a·x` for attention, AVX2 + FMA where the processor has them
//! (AVX-512 machines included), and their many-row forms over a run of key or value rows
//! (`dots`, `axpys`): AVX-512 where the processor has it.
//!
//! Attention calls these once per run of contiguous pool rows (a block of 16 positions)
//! rather than once per key: one call per key cost a call through a pointer, a horizontal
//! sum and, for `axpy`, a load and store of the output per key, which with heads of 64 was
//! as much as the arithmetic (a fifth of a batched decode step went to attention).

use super::dot::Isa;

pub(crate) struct VecF32 {
    pub dot: fn(&[f32], &[f32]) -> f32,
    pub axpy: fn(&mut [f32], f32, &[f32]),
    /// `out[i] = q · rows[i·stride..][..q.len()]` for every `i < out.len()`.
    pub dots: fn(&[f32], &[f32], usize, &mut [f32]),
    /// `y += Σ_i w[i] · rows[i·stride..][..y.len()]` over every `i < w.len()`.
    pub axpys: fn(&mut [f32], &[f32], &[f32], usize),
}

/// Whether `rows` holds `n` rows of `d` elements `stride` apart (what the many-row helpers
/// index; the vector paths check it before reading). Only the x86-64 paths index rows by
/// pointer.
#[cfg(target_arch = "x86_64")]
fn rows_fit(rows: &[f32], n: usize, stride: usize, d: usize) -> bool {
    n == 0 || (n - 1).saturating_mul(stride).saturating_add(d) <= rows.len()
}

impl VecF32 {
    pub(crate) fn new(isa: Isa) -> VecF32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // AVX-512 machines run the one-row helpers on AVX2 (heads are 64 to 128 wide) and
            // the many-row ones on 16 lanes.
            Isa::Avx512 if avx2::available() && avx512::available() => VecF32 {
                // SAFETY: `available` checked the features these are compiled for.
                dot: |a, b| unsafe { avx2::dot(a, b) },
                // SAFETY: as above.
                axpy: |y, a, x| unsafe { avx2::axpy(y, a, x) },
                // SAFETY: as above.
                dots: |q, rows, stride, out| unsafe { avx512::dots(q, rows, stride, out) },
                // SAFETY: as above.
                axpys: |y, w, rows, stride| unsafe { avx512::axpys(y, w, rows, stride) },
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 if avx2::available() => VecF32 {
                // SAFETY: `available` checked the features these are compiled for.
                dot: |a, b| unsafe { avx2::dot(a, b) },
                // SAFETY: as above.
                axpy: |y, a, x| unsafe { avx2::axpy(y, a, x) },
                // SAFETY: as above.
                dots: |q, rows, stride, out| unsafe { avx2::dots(q, rows, stride, out) },
                // SAFETY: as above.
                axpys: |y, w, rows, stride| unsafe { avx2::axpys(y, w, rows, stride) },
            },
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            Isa::Simd128 => VecF32 {
                dot: simd128::dot,
                axpy: simd128::axpy,
                dots: simd128::dots,
                axpys: simd128::axpys,
            },
            _ => VecF32 {
                dot: crate::kernels::linear::dot,
                axpy,
                dots,
                axpys,
            },
        }
    }
}

fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

fn dots(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = crate::kernels::linear::dot(q, &rows[i * stride..][..q.len()]);
    }
}

fn axpys(y: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
    for (i, &a) in w.iter().enumerate() {
        axpy(y, a, &rows[i * stride..][..y.len()]);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n elements are readable in both slices.
            unsafe {
                let (pa, pb) = (a.as_ptr().add(i), b.as_ptr().add(i));
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa), _mm256_loadu_ps(pb), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(8)), _mm256_loadu_ps(pb.add(8)), s1);
            }
            i += 16;
        }
        if i + 8 <= n {
            // SAFETY: i + 8 <= n.
            unsafe {
                s0 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                    s0,
                );
            }
            i += 8;
        }
        let v = _mm256_add_ps(s0, s1);
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        s + a[i..n]
            .iter()
            .zip(&b[i..n])
            .map(|(x, y)| x * y)
            .sum::<f32>()
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n elements of both slices; `y` is exclusively borrowed.
            unsafe {
                let py = y.as_mut_ptr().add(i);
                let r =
                    _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(py));
                _mm256_storeu_ps(py, r);
            }
            i += 8;
        }
        for (y, x) in y[i..n].iter_mut().zip(&x[i..n]) {
            *y += a * x;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn dots(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate() {
            *o = dot(q, &rows[i * stride..][..q.len()]);
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) fn axpys(y: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
        for (i, &a) in w.iter().enumerate() {
            axpy(y, a, &rows[i * stride..][..y.len()]);
        }
    }
}

/// The many-row helpers on 16-lane registers: `dots` runs four rows at a time (four
/// independent sums), `axpys` keeps up to 64 outputs in registers across all the rows.
/// Lengths off the vector width take masked loads, which read nothing past the mask.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    pub(super) fn available() -> bool {
        is_x86_feature_detected!("avx512f")
    }

    /// The first `n` lanes (`n` <= 16).
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 {
            0xffff
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn dots(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        let (d, n) = (q.len(), out.len());
        assert!(super::rows_fit(rows, n, stride, d), "dots: rows too short");
        let full = d / 16;
        let tail = lanes(d % 16);
        let (qp, rp) = (q.as_ptr(), rows.as_ptr());
        let mut i = 0;
        while i + 4 <= n {
            let mut acc = [_mm512_setzero_ps(); 4];
            for c in 0..full {
                // SAFETY: element 16c + 15 < d of `q` and of each row (checked above).
                unsafe {
                    let qv = _mm512_loadu_ps(qp.add(16 * c));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let kv = _mm512_loadu_ps(rp.add((i + r) * stride + 16 * c));
                        *a = _mm512_fmadd_ps(qv, kv, *a);
                    }
                }
            }
            if d % 16 != 0 {
                // SAFETY: the mask covers elements 16·full..d only; masked-off lanes are
                // not read.
                unsafe {
                    let qv = _mm512_maskz_loadu_ps(tail, qp.wrapping_add(16 * full));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let at = rp.wrapping_add((i + r) * stride + 16 * full);
                        *a = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, at), *a);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                out[i + r] = _mm512_reduce_add_ps(*a);
            }
            i += 4;
        }
        while i < n {
            let mut a = _mm512_setzero_ps();
            for c in 0..full {
                // SAFETY: as above.
                unsafe {
                    let qv = _mm512_loadu_ps(qp.add(16 * c));
                    a = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rp.add(i * stride + 16 * c)), a);
                }
            }
            if d % 16 != 0 {
                // SAFETY: as above.
                unsafe {
                    let qv = _mm512_maskz_loadu_ps(tail, qp.wrapping_add(16 * full));
                    let at = rp.wrapping_add(i * stride + 16 * full);
                    a = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, at), a);
                }
            }
            out[i] = _mm512_reduce_add_ps(a);
            i += 1;
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) fn axpys(y: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
        let (d, n) = (y.len(), w.len());
        assert!(super::rows_fit(rows, n, stride, d), "axpys: rows too short");
        let rp = rows.as_ptr();
        let yp = y.as_mut_ptr();
        // 64 outputs at a time: four registers, the last ones masked (or empty) past `d`.
        let mut c = 0;
        while c < d {
            let m: [__mmask16; 4] = std::array::from_fn(|k| lanes((d - c).saturating_sub(16 * k)));
            // SAFETY: each load and store covers elements c + 16k .. min(d, c + 16k + 16) of
            // `y` (exclusively borrowed) or of a row within `rows` (checked above); masked
            // lanes are not touched.
            unsafe {
                let mut acc: [__m512; 4] = std::array::from_fn(|k| {
                    _mm512_maskz_loadu_ps(m[k], yp.wrapping_add(c + 16 * k))
                });
                for (i, &wi) in w.iter().enumerate() {
                    let a = _mm512_set1_ps(wi);
                    let row = rp.wrapping_add(i * stride + c);
                    for (k, acc) in acc.iter_mut().enumerate() {
                        let x = _mm512_maskz_loadu_ps(m[k], row.wrapping_add(16 * k));
                        *acc = _mm512_fmadd_ps(a, x, *acc);
                    }
                }
                for (k, acc) in acc.iter().enumerate() {
                    _mm512_mask_storeu_ps(yp.wrapping_add(c + 16 * k), m[k], *acc);
                }
            }
            c += 64;
        }
    }
}

#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd128 {
    use std::arch::wasm32::*;

    pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        let mut s = f32x4_splat(0.0);
        let mut i = 0;
        while i + 4 <= n {
            // SAFETY: i + 4 <= n elements are readable in both slices; no alignment needed.
            let (va, vb) = unsafe {
                (
                    v128_load(a.as_ptr().add(i).cast()),
                    v128_load(b.as_ptr().add(i).cast()),
                )
            };
            s = f32x4_add(s, f32x4_mul(va, vb));
            i += 4;
        }
        f32x4_extract_lane::<0>(s)
            + f32x4_extract_lane::<1>(s)
            + f32x4_extract_lane::<2>(s)
            + f32x4_extract_lane::<3>(s)
            + a[i..].iter().zip(&b[i..]).map(|(x, y)| x * y).sum::<f32>()
    }

    /// [`dot`] of `q` with each of `out.len()` rows `stride` apart, four rows at a time: the
    /// four rows' sums are independent chains (one row's chain of adds alone waits on each
    /// add's latency), and `q` is loaded once for four. Each row's lanes and their final sum
    /// are added in [`dot`]'s order, so the results are its bits.
    pub(super) fn dots(q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        let d = q.len();
        let vectors = d / 4;
        let mut i = 0;
        while i + 4 <= out.len() {
            let r: [&[f32]; 4] = std::array::from_fn(|k| &rows[(i + k) * stride..][..d]);
            let mut s = [f32x4_splat(0.0); 4];
            for c in 0..vectors {
                let qv = load(q, 4 * c);
                for (s, r) in s.iter_mut().zip(r) {
                    *s = f32x4_add(*s, f32x4_mul(qv, load(r, 4 * c)));
                }
            }
            for (k, s) in s.into_iter().enumerate() {
                out[i + k] = f32x4_extract_lane::<0>(s)
                    + f32x4_extract_lane::<1>(s)
                    + f32x4_extract_lane::<2>(s)
                    + f32x4_extract_lane::<3>(s)
                    + q[4 * vectors..]
                        .iter()
                        .zip(&r[k][4 * vectors..])
                        .map(|(x, y)| x * y)
                        .sum::<f32>();
            }
            i += 4;
        }
        for (j, o) in out.iter_mut().enumerate().skip(i) {
            *o = dot(q, &rows[j * stride..][..d]);
        }
    }

    /// `y += Σ_i w[i] · rows[i·stride..][..y.len()]`, 32 elements of `y` at a time held in
    /// registers across every row (one row at a time loaded and stored all of `y` per row,
    /// and each row's adds waited on the previous row's stores). Each element still adds the
    /// rows' products in row order, as [`axpy`] row by row does, so the results are its bits.
    pub(super) fn axpys(y: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
        const V: usize = 8;
        let d = y.len();
        if w.is_empty() {
            return;
        }
        let rows = &rows[..(w.len() - 1) * stride + d];
        let mut c = 0;
        while c + 4 * V <= d {
            let mut acc: [v128; V] = std::array::from_fn(|j| load(y, c + 4 * j));
            for (i, &a) in w.iter().enumerate() {
                let (av, r) = (f32x4_splat(a), &rows[i * stride + c..][..4 * V]);
                for (j, acc) in acc.iter_mut().enumerate() {
                    *acc = f32x4_add(*acc, f32x4_mul(av, load(r, 4 * j)));
                }
            }
            for (j, acc) in acc.into_iter().enumerate() {
                store(y, c + 4 * j, acc);
            }
            c += 4 * V;
        }
        while c + 4 <= d {
            let mut acc = load(y, c);
            for (i, &a) in w.iter().enumerate() {
                acc = f32x4_add(acc, f32x4_mul(f32x4_splat(a), load(rows, i * stride + c)));
            }
            store(y, c, acc);
            c += 4;
        }
        for (i, &a) in w.iter().enumerate() {
            for (y, x) in y[c..].iter_mut().zip(&rows[i * stride + c..][..d - c]) {
                *y += a * x;
            }
        }
    }

    /// Four f32 of `x` from `at`.
    #[inline(always)]
    fn load(x: &[f32], at: usize) -> v128 {
        let x = &x[at..at + 4];
        // SAFETY: 4 readable f32 (sliced above), no alignment requirement.
        unsafe { v128_load(x.as_ptr().cast()) }
    }

    /// Four f32 into `y` from `at`.
    #[inline(always)]
    fn store(y: &mut [f32], at: usize, v: v128) {
        let y = &mut y[at..at + 4];
        // SAFETY: 4 writable f32 (sliced above), no alignment requirement.
        unsafe { v128_store(y.as_mut_ptr().cast(), v) }
    }

    pub(super) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let av = f32x4_splat(a);
        let mut i = 0;
        while i + 4 <= n {
            // SAFETY: i + 4 <= n elements of both slices; `y` is exclusively borrowed.
            unsafe {
                let py = y.as_mut_ptr().add(i);
                let r = f32x4_add(
                    v128_load(py.cast()),
                    f32x4_mul(av, v128_load(x.as_ptr().add(i).cast())),
                );
                v128_store(py.cast(), r);
            }
            i += 4;
        }
        for (y, x) in y[i..n].iter_mut().zip(&x[i..n]) {
            *y += a * x;
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    /// The many-row helpers of every instruction set here give what one row at a time in
    /// plain f32 gives, for row lengths on and off the vector widths (1 to 130), row counts
    /// on and off four (the AVX-512 `dots` runs four at a time) and rows with gaps between
    /// them. Tolerance: a few f32 roundings of sums of up to 130 products of numbers in
    /// [-1, 1] (1e-5 relative to the sum of magnitudes).
    #[test]
    fn many_row_helpers_match_one_row_at_a_time() {
        let mut rng = StdRng::seed_from_u64(31);
        for isa in Isa::available() {
            let v = VecF32::new(isa);
            for d in [1, 12, 16, 33, 64, 100, 128, 130] {
                for n in [0, 1, 3, 4, 5, 17] {
                    let stride = d + 7;
                    let rows: Vec<f32> = (0..n * stride)
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect();
                    let q: Vec<f32> = (0..d).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let w: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let row = |i: usize| &rows[i * stride..][..d];
                    let mut got = vec![f32::NAN; n];
                    (v.dots)(&q, &rows, stride, &mut got);
                    for (i, g) in got.iter().enumerate() {
                        let want: f32 = q.iter().zip(row(i)).map(|(a, b)| a * b).sum();
                        let mag: f32 = q.iter().zip(row(i)).map(|(a, b)| (a * b).abs()).sum();
                        assert!(
                            (g - want).abs() <= 1e-5 * (1.0 + mag),
                            "{} dots d={d} n={n} row {i}: {g} vs {want}",
                            isa.name()
                        );
                    }
                    let y0: Vec<f32> = (0..d).map(|_| rng.random_range(-1.0..1.0)).collect();
                    let mut got = y0.clone();
                    (v.axpys)(&mut got, &w, &rows, stride);
                    for (c, g) in got.iter().enumerate() {
                        let want = y0[c] + (0..n).map(|i| w[i] * row(i)[c]).sum::<f32>();
                        assert!(
                            (g - want).abs() <= 1e-5 * (1.0 + n as f32),
                            "{} axpys d={d} n={n} at {c}: {g} vs {want}",
                            isa.name()
                        );
                    }
                }
            }
        }
    }
}

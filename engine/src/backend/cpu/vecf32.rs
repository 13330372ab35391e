//! f32 dot product and `y += a·x` for attention, AVX2 + FMA where the processor has them
//! (AVX-512 machines included).

use super::dot::Isa;

pub(crate) struct VecF32 {
    pub dot: fn(&[f32], &[f32]) -> f32,
    pub axpy: fn(&mut [f32], f32, &[f32]),
}

impl VecF32 {
    pub(crate) fn new(isa: Isa) -> VecF32 {
        match isa {
            #[cfg(target_arch = "x86_64")]
            // AVX-512 machines run attention's AVX2 helpers (heads are 64 to 128 wide).
            Isa::Avx2 | Isa::Avx512 if avx2::available() => VecF32 {
                // SAFETY: `available` checked the features these are compiled for.
                dot: |a, b| unsafe { avx2::dot(a, b) },
                // SAFETY: as above.
                axpy: |y, a, x| unsafe { avx2::axpy(y, a, x) },
            },
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            Isa::Simd128 => VecF32 {
                dot: simd128::dot,
                axpy: simd128::axpy,
            },
            _ => VecF32 {
                dot: crate::kernels::linear::dot,
                axpy,
            },
        }
    }
}

fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
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

//! wasm SIMD forms of `q8.rs`'s `amax` and `round_block`, for the browser's CPU fallback:
//! there the scalar loops called `fmaxf` and `roundf` per element, and quantizing the
//! activations took 15% of a prompt's time in the single-thread package (a Node profile of a
//! 128-token prefill, docs/performance.md session 20).
//!
//! Both give the scalar loops' bits exactly (unlike the x86 forms, which round ties to even):
//! the maximum is order-free and skips NaN as `f32::max` does, and the rounding is
//! `f32::round`'s, ties away from zero, so the wasm packages' results do not move.

use std::arch::wasm32::*;

fn load(x: &[f32]) -> v128 {
    assert!(x.len() >= 4);
    // SAFETY: 4 readable f32 (checked above), no alignment requirement.
    unsafe { v128_load(x.as_ptr().cast()) }
}

/// The largest magnitude in `x`, NaN ignored.
pub(super) fn amax(x: &[f32]) -> f32 {
    let mut m = f32x4_splat(0.0);
    let chunks = x.chunks_exact(4);
    let rest = chunks.remainder();
    for c in chunks {
        // `pmax(m, v)` is `m < v ? v : m`: a NaN `v` leaves `m`.
        m = f32x4_pmax(m, f32x4_abs(load(c)));
    }
    let lanes = [
        f32x4_extract_lane::<0>(m),
        f32x4_extract_lane::<1>(m),
        f32x4_extract_lane::<2>(m),
        f32x4_extract_lane::<3>(m),
    ];
    lanes
        .into_iter()
        .chain(rest.iter().map(|v| v.abs()))
        .fold(0f32, f32::max)
}

/// `q = (x·id).round().clamp(-127, 127)`, NaN to 0, as the scalar loop computes it.
pub(super) fn round(x: &[f32], q: &mut [i8], id: f32) {
    let (idv, half, one, sign) = (
        f32x4_splat(id),
        f32x4_splat(0.5),
        f32x4_splat(1.0),
        f32x4_splat(-0.0),
    );
    let (hi, lo) = (f32x4_splat(127.0), f32x4_splat(-127.0));
    let n = x.len().min(q.len());
    let (x, q) = (&x[..n], &mut q[..n]);
    let mut xc = x.chunks_exact(16);
    let mut qc = q.chunks_exact_mut(16);
    for (xc, qc) in (&mut xc).zip(&mut qc) {
        let r: [v128; 4] = std::array::from_fn(|i| {
            let v = f32x4_mul(load(&xc[4 * i..]), idv);
            // Ties away from zero: the truncation plus the sign where the fraction (exact
            // below 2^23, zero above) is at least a half.
            let t = f32x4_trunc(v);
            let up = f32x4_ge(f32x4_abs(f32x4_sub(v, t)), half);
            let step = v128_and(up, v128_or(one, v128_and(v, sign)));
            // `min`/`max` keep a NaN, which the saturating conversion makes 0.
            let r = f32x4_max(f32x4_min(f32x4_add(t, step), hi), lo);
            i32x4_trunc_sat_f32x4(r)
        });
        let p = i8x16_narrow_i16x8(
            i16x8_narrow_i32x4(r[0], r[1]),
            i16x8_narrow_i32x4(r[2], r[3]),
        );
        // SAFETY: `qc` is 16 writable bytes; no alignment requirement.
        unsafe { v128_store(qc.as_mut_ptr().cast(), p) };
    }
    for (q, v) in qc.into_remainder().iter_mut().zip(xc.remainder()) {
        *q = (v * id).round().clamp(-127.0, 127.0) as i8;
    }
}

/// Compares [`amax`] and [`round`] with the scalar loops on `x` (any length) and on ties,
/// NaN, infinities and values past the clamp, bit for bit (`checkCpuKernels`); returns how
/// many results it compared.
pub(crate) fn check(x: &[f32]) -> Result<usize, String> {
    let mut v: Vec<f32> = x.to_vec();
    v.extend([
        0.5,
        -0.5,
        1.5,
        -2.5,
        126.5,
        -126.5,
        0.499_999_97,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e9,
        -3e8,
        -0.0,
    ]);
    let mut compared = 0;
    for len in [v.len(), 32, 35] {
        let x = &v[..len.min(v.len())];
        let want = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let got = amax(x);
        compared += 1;
        if got.to_bits() != want.to_bits() {
            return Err(format!(
                "simd128 amax over {len}: {got}, the scalar loop {want}"
            ));
        }
        for id in [1.0, 3.7, 1e-3] {
            let mut got = vec![0i8; x.len()];
            round(x, &mut got, id);
            for (i, (&g, v)) in got.iter().zip(x).enumerate() {
                let want = (v * id).round().clamp(-127.0, 127.0) as i8;
                compared += 1;
                if g != want {
                    return Err(format!(
                        "simd128 rounding of {v} times {id} (element {i}): {g}, the scalar \
                         loop {want}"
                    ));
                }
            }
        }
    }
    Ok(compared)
}

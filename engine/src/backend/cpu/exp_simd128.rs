//! `exp` four lanes at a time in wasm SIMD, for the browser's CPU fallback: there `f32::exp`
//! is a call into compiled libm per element, and attention's softmax and the feed-forward's
//! SiLU spent 10% of a 128-token prompt's time in it (a Node profile of the single-thread
//! package, docs/performance.md session 20).
//!
//! The reduction and polynomial are the classic single-precision ones (Cephes' `expf`: `n`
//! the nearest integer to `x·log2 e`, `r = x - n·ln 2` in two parts, a degree-5 polynomial,
//! `2^n` put in the exponent): within a few ulp of the true value, where libm's is within
//! one. Both wasm packages run this same code, so they stay bit-identical to each other.

use std::arch::wasm32::*;

fn load(x: &[f32]) -> v128 {
    assert!(x.len() >= 4);
    // SAFETY: 4 readable f32 (checked above), no alignment requirement.
    unsafe { v128_load(x.as_ptr().cast()) }
}

fn store(x: &mut [f32], v: v128) {
    assert!(x.len() >= 4);
    // SAFETY: 4 writable f32 (checked above), no alignment requirement.
    unsafe { v128_store(x.as_mut_ptr().cast(), v) }
}

/// `e^x` per lane. Arguments are clamped to [-87.3, 88] (so `2^n` stays a normal float:
/// below, the result is about 1e-38 rather than a subnormal or 0; above, 1.65e38 rather than
/// infinity); NaN stays NaN.
#[inline(always)]
pub(crate) fn exp(x: v128) -> v128 {
    let x = f32x4_max(f32x4_min(x, f32x4_splat(88.0)), f32x4_splat(-87.336_55));
    let n = f32x4_nearest(f32x4_mul(x, f32x4_splat(std::f32::consts::LOG2_E)));
    let r = f32x4_sub(
        f32x4_sub(x, f32x4_mul(n, f32x4_splat(0.693_359_4))),
        f32x4_mul(n, f32x4_splat(-2.121_944_4e-4)),
    );
    let mut p = f32x4_splat(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5, // Cephes: 5.0000001201e-1, which is 0.5 in f32
    ] {
        p = f32x4_add(f32x4_mul(p, r), f32x4_splat(c));
    }
    let y = f32x4_add(
        f32x4_add(f32x4_mul(p, f32x4_mul(r, r)), r),
        f32x4_splat(1.0),
    );
    // 2^n built in the exponent field; a NaN lane converts to 0 (2^0), and `y` is NaN.
    let two_n = i32x4_shl(i32x4_add(i32x4_trunc_sat_f32x4(n), i32x4_splat(127)), 23);
    f32x4_mul(y, two_n)
}

/// `s[i] = e^(s[i] - max)`, returning their sum: softmax's numerators.
pub(crate) fn exp_minus(s: &mut [f32], max: f32) -> f32 {
    let m = f32x4_splat(max);
    let mut acc = f32x4_splat(0.0);
    let mut chunks = s.chunks_exact_mut(4);
    for c in &mut chunks {
        let e = exp(f32x4_sub(load(c), m));
        store(c, e);
        acc = f32x4_add(acc, e);
    }
    let mut sum = (f32x4_extract_lane::<0>(acc) + f32x4_extract_lane::<1>(acc))
        + (f32x4_extract_lane::<2>(acc) + f32x4_extract_lane::<3>(acc));
    for x in chunks.into_remainder() {
        *x = (*x - max).exp();
        sum += *x;
    }
    sum
}

/// `out = gate / (1 + e^-gate) · up` (SiLU-gated), elementwise.
pub(crate) fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len().min(gate.len()).min(up.len());
    let (gate, up, out) = (&gate[..n], &up[..n], &mut out[..n]);
    let one = f32x4_splat(1.0);
    let mut o = out.chunks_exact_mut(4);
    let (mut g, mut u) = (gate.chunks_exact(4), up.chunks_exact(4));
    for ((o, g), u) in (&mut o).zip(&mut g).zip(&mut u) {
        let gv = load(g);
        let silu = f32x4_div(gv, f32x4_add(one, exp(f32x4_neg(gv))));
        store(o, f32x4_mul(silu, load(u)));
    }
    for ((o, g), u) in o
        .into_remainder()
        .iter_mut()
        .zip(g.remainder())
        .zip(u.remainder())
    {
        *o = crate::kernels::elementwise::silu(*g) * u;
    }
}

/// Compares [`exp_minus`] and [`silu_mul`] with the scalar `exp` on `x` (values in about
/// [-20, 20]) and on the ends of the range (`checkCpuKernels`); returns how many results it
/// compared.
pub(crate) fn check(x: &[f32]) -> Result<usize, String> {
    let mut v: Vec<f32> = x.to_vec();
    v.extend([0.0, -0.0, 1.0, -1.0, 80.0, -80.0, 88.0, -87.0, -100.0, 1e-7]);
    let mut compared = 0;
    let max = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut got = v.clone();
    let sum = exp_minus(&mut got, max);
    let mut want_sum = 0f64;
    for (g, x) in got.iter().zip(&v) {
        let want = (x - max).exp();
        want_sum += f64::from(want);
        compared += 1;
        // A few ulp, or below the clamp's floor where libm goes subnormal.
        if (g - want).abs() > 4e-7 * want.abs() + 2e-38 {
            return Err(format!("simd128 exp of {}: {g}, libm {want}", x - max));
        }
    }
    compared += 1;
    if (f64::from(sum) - want_sum).abs() > 1e-6 * want_sum {
        return Err(format!("simd128 exp sum: {sum}, libm's {want_sum}"));
    }
    let up: Vec<f32> = v.iter().map(|x| 0.5 - x * 0.25).collect();
    let mut got = vec![0f32; v.len()];
    silu_mul(&v, &up, &mut got);
    for ((g, x), u) in got.iter().zip(&v).zip(&up) {
        let want = crate::kernels::elementwise::silu(*x) * u;
        compared += 1;
        if (g - want).abs() > 1e-6 * want.abs() + 1e-30 {
            return Err(format!("simd128 silu_mul of {x}, {u}: {g}, libm's {want}"));
        }
    }
    Ok(compared)
}

//! aarch64 NEON dot products, with the dot-product extension (`sdot`: sixteen i8 × i8
//! products summed in fours into i32 lanes, one instruction) where the processor has it.
//! NEON itself is part of every aarch64 target Rust builds for; `dotprod` (Armv8.2+: Apple
//! M1 on, Graviton 2 on, Cortex-A55/A76 on) is detected at run time.
//!
//! The shape follows the simd128 kernels (the same 16-lane width): a block's quants as two
//! vectors of signed bytes, multiplied against the activations in i32 lanes, one float
//! multiply-add per block. The kernels are written once (`kernels!`) and compiled twice:
//! `plain` multiplies with `smull` and pairwise adds, `sdot` with the one instruction.
//!
//! `vdotq_s32` is still unstable in `std::arch` (issue 117224), so `sdot` is one line of
//! inline assembly in a function compiled with the feature enabled.

use std::arch::aarch64::*;

use super::DotFn;
use crate::backend::cpu::q8::{GROUP, Q8Row, QK, QK_K};
use crate::quant::GgmlType;
use crate::quant::kquants::scale_min_k4;

/// Whether this processor has the dot-product instructions.
pub(super) fn has_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// The NEON kernel for `ty` (with `sdot` when `dotprod` is set and the processor has it),
/// or `None` where there is none (the scalar one runs).
pub(super) fn dot(ty: GgmlType, dotprod: bool) -> Option<DotFn> {
    if dotprod {
        if !has_dotprod() {
            return None;
        }
        // SAFETY (every closure below): `dotprod` was detected just above; the kernels touch
        // memory only through bounds-checked slices.
        return Some(match ty {
            GgmlType::Q4_0 => |w, x| unsafe { sdot::q4_0(w, x) },
            GgmlType::Q4_1 => |w, x| unsafe { sdot::q4_1(w, x) },
            GgmlType::Q5_0 => |w, x| unsafe { sdot::q5_0(w, x) },
            GgmlType::Q5_1 => |w, x| unsafe { sdot::q5_1(w, x) },
            GgmlType::Q8_0 => |w, x| unsafe { sdot::q8_0(w, x) },
            GgmlType::Q4_K => |w, x| unsafe { sdot::q4_k(w, x) },
            GgmlType::Q6_K => |w, x| unsafe { sdot::q6_k(w, x) },
            _ => return None,
        });
    }
    // SAFETY (every closure below): NEON is part of every aarch64 target (the Rust targets
    // require it), and the kernels touch memory only through bounds-checked slices.
    Some(match ty {
        GgmlType::Q4_0 => |w, x| unsafe { plain::q4_0(w, x) },
        GgmlType::Q4_1 => |w, x| unsafe { plain::q4_1(w, x) },
        GgmlType::Q5_0 => |w, x| unsafe { plain::q5_0(w, x) },
        GgmlType::Q5_1 => |w, x| unsafe { plain::q5_1(w, x) },
        GgmlType::Q8_0 => |w, x| unsafe { plain::q8_0(w, x) },
        GgmlType::Q4_K => |w, x| unsafe { plain::q4_k(w, x) },
        GgmlType::Q6_K => |w, x| unsafe { plain::q6_k(w, x) },
        _ => return None,
    })
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    super::scalar::f16_at(b, at)
}

#[target_feature(enable = "neon")]
fn load(b: &[u8]) -> uint8x16_t {
    assert!(b.len() >= 16);
    // SAFETY: 16 readable bytes (checked above); vld1q has no alignment requirement.
    unsafe { vld1q_u8(b.as_ptr()) }
}

#[target_feature(enable = "neon")]
fn load_i8(b: &[i8]) -> int8x16_t {
    assert!(b.len() >= 16);
    // SAFETY: as `load`.
    unsafe { vld1q_s8(b.as_ptr()) }
}

/// 16 bytes of nibbles: (low nibbles, high nibbles), each 16 lanes of 0..16.
#[target_feature(enable = "neon")]
fn nibbles(b: &[u8]) -> (int8x16_t, int8x16_t) {
    let v = load(b);
    (
        vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0f))),
        vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)),
    )
}

/// The 32 bits at `b[..4]` as two 16-lane vectors, 0x10 where the bit is set.
#[target_feature(enable = "neon")]
fn fifth_bits(b: &[u8]) -> (int8x16_t, int8x16_t) {
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bit = load(&BIT);
    let spread = |lo: u8, hi: u8| {
        let v = vcombine_u8(vdup_n_u8(lo), vdup_n_u8(hi));
        vreinterpretq_s8_u8(vandq_u8(vtstq_u8(v, bit), vdupq_n_u8(0x10)))
    };
    (spread(b[0], b[1]), spread(b[2], b[3]))
}

/// Every kernel, written against a `dot16(acc, w, x)` (acc + sixteen i8 × i8 products,
/// summed into four i32 lanes) that each instance supplies, with the instance's target
/// features (`$($feature)*`) on each function.
macro_rules! kernels {
    ($(#[$feature:meta])*) => {
        use super::*;

        /// The 32-element formats: `quants(block)` gives its 32 quants as signed bytes
        /// (elements 0..16, 16..32); `(step, min)` come from the block's first bytes.
        $(#[$feature])*
        #[inline]
        fn blocks32(
            w: &[u8],
            x: Q8Row<'_>,
            bytes: usize,
            has_min: bool,
            quants: impl Fn(&[u8]) -> (int8x16_t, int8x16_t),
        ) -> f32 {
            let mut acc = vdupq_n_f32(0.0);
            let mut mins = 0f32;
            for (((b, xq), &dx), &sx) in w
                .chunks_exact(bytes)
                .zip(x.qs.chunks_exact(QK))
                .zip(x.d)
                .zip(x.sum.iter().chain(std::iter::repeat(&0.0)))
            {
                let (q0, q1) = quants(b);
                let p = dot16(dot16(vdupq_n_s32(0), q0, load_i8(xq)), q1, load_i8(&xq[16..]));
                acc = vfmaq_n_f32(acc, vcvtq_f32_s32(p), f16_at(b, 0) * dx);
                if has_min {
                    mins += f16_at(b, 2) * sx;
                }
            }
            vaddvq_f32(acc) + mins
        }

        $(#[$feature])*
        pub(super) fn q4_0(w: &[u8], x: Q8Row<'_>) -> f32 {
            blocks32(w, x, 18, false, |b| {
                let (lo, hi) = nibbles(&b[2..18]);
                let eight = vdupq_n_s8(8);
                (vsubq_s8(lo, eight), vsubq_s8(hi, eight))
            })
        }

        $(#[$feature])*
        pub(super) fn q4_1(w: &[u8], x: Q8Row<'_>) -> f32 {
            blocks32(w, x, 20, true, |b| nibbles(&b[4..20]))
        }

        $(#[$feature])*
        pub(super) fn q5_0(w: &[u8], x: Q8Row<'_>) -> f32 {
            blocks32(w, x, 22, false, |b| {
                let (h0, h1) = fifth_bits(&b[2..6]);
                let (lo, hi) = nibbles(&b[6..22]);
                let sixteen = vdupq_n_s8(16);
                (
                    vsubq_s8(vorrq_s8(lo, h0), sixteen),
                    vsubq_s8(vorrq_s8(hi, h1), sixteen),
                )
            })
        }

        $(#[$feature])*
        pub(super) fn q5_1(w: &[u8], x: Q8Row<'_>) -> f32 {
            blocks32(w, x, 24, true, |b| {
                let (h0, h1) = fifth_bits(&b[4..8]);
                let (lo, hi) = nibbles(&b[8..24]);
                (vorrq_s8(lo, h0), vorrq_s8(hi, h1))
            })
        }

        $(#[$feature])*
        pub(super) fn q8_0(w: &[u8], x: Q8Row<'_>) -> f32 {
            blocks32(w, x, 34, false, |b| {
                (
                    vreinterpretq_s8_u8(load(&b[2..18])),
                    vreinterpretq_s8_u8(load(&b[18..34])),
                )
            })
        }

        $(#[$feature])*
        pub(super) fn q4_k(w: &[u8], x: Q8Row<'_>) -> f32 {
            let mut acc = vdupq_n_f32(0.0);
            let mut mins = 0f32;
            for (((b, xq), &dx), bs) in w
                .chunks_exact(144)
                .zip(x.qs.chunks_exact(QK_K))
                .zip(x.d)
                .zip(x.bsums.chunks_exact(QK_K / GROUP))
            {
                let mut sumi = vdupq_n_s32(0);
                let mut msum = 0i32;
                for c in 0..4 {
                    let (sc_lo, m_lo) = scale_min_k4(2 * c, &b[4..16]);
                    let (sc_hi, m_hi) = scale_min_k4(2 * c + 1, &b[4..16]);
                    msum += i32::from(m_lo) * (i32::from(bs[4 * c]) + i32::from(bs[4 * c + 1]));
                    msum +=
                        i32::from(m_hi) * (i32::from(bs[4 * c + 2]) + i32::from(bs[4 * c + 3]));
                    let (lo0, hi0) = nibbles(&b[16 + 32 * c..]);
                    let (lo1, hi1) = nibbles(&b[16 + 32 * c + 16..]);
                    let x = &xq[64 * c..];
                    let zero = vdupq_n_s32(0);
                    let plo = dot16(dot16(zero, lo0, load_i8(x)), lo1, load_i8(&x[16..]));
                    let phi = dot16(dot16(zero, hi0, load_i8(&x[32..])), hi1, load_i8(&x[48..]));
                    sumi = vmlaq_n_s32(sumi, plo, i32::from(sc_lo));
                    sumi = vmlaq_n_s32(sumi, phi, i32::from(sc_hi));
                }
                let d = f16_at(b, 0) * dx;
                acc = vfmaq_n_f32(acc, vcvtq_f32_s32(sumi), d);
                mins += f16_at(b, 2) * dx * msum as f32;
            }
            vaddvq_f32(acc) - mins
        }

        $(#[$feature])*
        pub(super) fn q6_k(w: &[u8], x: Q8Row<'_>) -> f32 {
            let mut acc = vdupq_n_f32(0.0);
            let mut bias = 0f32;
            let (m4, m2) = (vdupq_n_u8(0x0f), vdupq_n_u8(0x03));
            for (((b, xq), &dx), bs) in w
                .chunks_exact(210)
                .zip(x.qs.chunks_exact(QK_K))
                .zip(x.d)
                .zip(x.bsums.chunks_exact(QK_K / GROUP))
            {
                let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
                let sc: [i32; 16] = std::array::from_fn(|g| i32::from(sc[g] as i8));
                // The quants are stored as q + 32 in 0..64; the 32 comes off through the
                // group sums.
                let offset: i32 = sc.iter().zip(bs).map(|(&s, &m)| s * i32::from(m)).sum();
                let mut sumi = vdupq_n_s32(0);
                for n in 0..2 {
                    for half in 0..2 {
                        let l0 = load(&ql[64 * n + 16 * half..]);
                        let l1 = load(&ql[64 * n + 32 + 16 * half..]);
                        let h = load(&qh[32 * n + 16 * half..]);
                        let q = [
                            vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8::<4>(vandq_u8(h, m2))),
                            vorrq_u8(
                                vandq_u8(l1, m4),
                                vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<2>(h), m2)),
                            ),
                            vorrq_u8(
                                vshrq_n_u8::<4>(l0),
                                vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<4>(h), m2)),
                            ),
                            vorrq_u8(vshrq_n_u8::<4>(l1), vshlq_n_u8::<4>(vshrq_n_u8::<6>(h))),
                        ];
                        for (k, q) in q.into_iter().enumerate() {
                            let at = 128 * n + 32 * k + 16 * half;
                            let p = dot16(
                                vdupq_n_s32(0),
                                vreinterpretq_s8_u8(q),
                                load_i8(&xq[at..]),
                            );
                            sumi = vmlaq_n_s32(sumi, p, sc[at / GROUP]);
                        }
                    }
                }
                let d = f16_at(b, 208) * dx;
                acc = vfmaq_n_f32(acc, vcvtq_f32_s32(sumi), d);
                bias += d * (32 * offset) as f32;
            }
            vaddvq_f32(acc) - bias
        }
    };
}

/// Baseline NEON: `smull` (8 × 8 → 16 bits, exact: |w·x| <= 128·127) and pairwise widening
/// adds into i32.
mod plain {
    #[target_feature(enable = "neon")]
    fn dot16(acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        let lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
        let hi = vmull_high_s8(w, x);
        vpadalq_s16(vpadalq_s16(acc, lo), hi)
    }

    kernels!(#[target_feature(enable = "neon")]);
}

/// With the dot-product extension.
mod sdot {
    #[target_feature(enable = "neon,dotprod")]
    fn dot16(mut acc: int32x4_t, w: int8x16_t, x: int8x16_t) -> int32x4_t {
        // SAFETY: registers only; the instruction exists where this function may run (it
        // is compiled for `dotprod`, and only `dot` calls into this module, after detection).
        unsafe {
            std::arch::asm!(
                "sdot {acc:v}.4s, {w:v}.16b, {x:v}.16b",
                acc = inout(vreg) acc,
                w = in(vreg) w,
                x = in(vreg) x,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        acc
    }

    kernels!(#[target_feature(enable = "neon,dotprod")]);
}

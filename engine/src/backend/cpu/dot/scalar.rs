//! The portable integer dot products, one per weight format: each block's quants unpacked
//! to integers, multiplied against the int8 activations in exact integer sums, scaled once
//! per block. Every SIMD path is tested against these.

use crate::backend::cpu::q8::{GROUP, Q8Row, QK, QK_K};
use crate::quant::kquants::{q3_k_scales, scale_min_k4};

/// The little-endian f16 at `b[at..at + 2]`, as f32.
#[inline]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// f16 to f32 in a few integer and float instructions that inline into the kernels (the
/// blocks' scales are converted once or twice per block). `half`'s portable conversion is
/// a call with branches; where the processor has no conversion instruction (wasm) it was a
/// fifth of the browser's decode time. Exact for every value: the exponent and mantissa
/// bits moved into an f32's place read as the value times 2^-112 (subnormals included), and
/// multiplying by 2^112 is exact; infinities and NaNs keep an all-ones exponent.
#[inline]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let magnitude = (h & 0x7fff) << 13;
    let value = if magnitude >= 0x7c00 << 13 {
        magnitude | 0x7f80_0000
    } else {
        (f32::from_bits(magnitude) * f32::from_bits(0x7780_0000)).to_bits()
    };
    f32::from_bits(value | sign)
}

fn idot(w: &[i32], x: &[i8]) -> i32 {
    w.iter().zip(x).map(|(&a, &b)| a * i32::from(b)).sum()
}

/// The 32-element formats: `unpack` gives a block's integer quants and its (step, min).
fn blocks32(
    w: &[u8],
    x: Q8Row<'_>,
    bytes: usize,
    unpack: impl Fn(&[u8], &mut [i32; QK]) -> (f32, f32),
) -> f32 {
    let mut q = [0i32; QK];
    let mut acc = 0f32;
    for (i, b) in w.chunks_exact(bytes).enumerate() {
        let (d, m) = unpack(b, &mut q);
        acc += d * x.d[i] * idot(&q, &x.qs[i * QK..][..QK]) as f32 + m * x.sum[i];
    }
    acc
}

fn nibbles(qs: &[u8], q: &mut [i32; QK], offset: i32) {
    for j in 0..16 {
        q[j] = i32::from(qs[j] & 0x0f) - offset;
        q[j + 16] = i32::from(qs[j] >> 4) - offset;
    }
}

fn fifth_bits(b: &[u8], at: usize, q: &mut [i32; QK], offset: i32) {
    let high = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    nibbles(&b[at + 4..at + 20], q, 0);
    for (e, v) in q.iter_mut().enumerate() {
        *v += (((high >> e) & 1) as i32) << 4;
        *v -= offset;
    }
}

pub(crate) fn q8_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 34, |b, q| {
        for (v, &c) in q.iter_mut().zip(&b[2..34]) {
            *v = i32::from(c as i8);
        }
        (f16_at(b, 0), 0.0)
    })
}

pub(crate) fn q4_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 18, |b, q| {
        nibbles(&b[2..18], q, 8);
        (f16_at(b, 0), 0.0)
    })
}

pub(crate) fn q4_1(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 20, |b, q| {
        nibbles(&b[4..20], q, 0);
        (f16_at(b, 0), f16_at(b, 2))
    })
}

pub(crate) fn q5_0(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 22, |b, q| {
        fifth_bits(b, 2, q, 16);
        (f16_at(b, 0), 0.0)
    })
}

pub(crate) fn q5_1(w: &[u8], x: Q8Row<'_>) -> f32 {
    blocks32(w, x, 24, |b, q| {
        fifth_bits(b, 4, q, 0);
        (f16_at(b, 0), f16_at(b, 2))
    })
}

/// One K-quant super-block as integers: `x = d·sc[g]·q - dmin·m[g]` for element group `g`
/// of 16.
struct Unpacked {
    d: f32,
    dmin: f32,
    sc: [i32; QK_K / GROUP],
    m: [i32; QK_K / GROUP],
    q: [i32; QK_K],
}

impl Unpacked {
    fn new() -> Self {
        Unpacked {
            d: 0.0,
            dmin: 0.0,
            sc: [0; QK_K / GROUP],
            m: [0; QK_K / GROUP],
            q: [0; QK_K],
        }
    }

    fn dot(&self, x: Q8Row<'_>, i: usize) -> f32 {
        let qs = &x.qs[i * QK_K..][..QK_K];
        let bsums = &x.bsums[i * (QK_K / GROUP)..][..QK_K / GROUP];
        let mut main = 0i32;
        let mut mins = 0i32;
        for (g, &bsum) in bsums.iter().enumerate() {
            let s = g * GROUP;
            main += self.sc[g] * idot(&self.q[s..s + GROUP], &qs[s..s + GROUP]);
            mins += self.m[g] * i32::from(bsum);
        }
        x.d[i] * (self.d * main as f32 - self.dmin * mins as f32)
    }
}

fn kquant(w: &[u8], x: Q8Row<'_>, bytes: usize, unpack: impl Fn(&[u8], &mut Unpacked)) -> f32 {
    let mut u = Unpacked::new();
    w.chunks_exact(bytes)
        .enumerate()
        .map(|(i, b)| {
            unpack(b, &mut u);
            u.dot(x, i)
        })
        .sum()
}

pub(crate) fn q2_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    kquant(w, x, 84, |b, u| {
        let (scales, qs) = (&b[..16], &b[16..80]);
        (u.d, u.dmin) = (f16_at(b, 80), f16_at(b, 82));
        for (g, &s) in scales.iter().enumerate() {
            u.sc[g] = i32::from(s & 0x0f);
            u.m[g] = i32::from(s >> 4);
        }
        for (i, v) in u.q.iter_mut().enumerate() {
            let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
            *v = i32::from((qs[32 * h + l] >> (2 * j)) & 3);
        }
    })
}

pub(crate) fn q3_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    kquant(w, x, 110, |b, u| {
        let (hmask, qs) = (&b[..32], &b[32..96]);
        let scales = q3_k_scales(&b[96..108]);
        (u.d, u.dmin) = (f16_at(b, 108), 0.0);
        u.sc = scales.map(i32::from);
        u.m = [0; 16];
        for (i, v) in u.q.iter_mut().enumerate() {
            let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
            let low = i32::from((qs[32 * h + l] >> (2 * j)) & 3);
            *v = if hmask[l] & (1 << (4 * h + j)) != 0 {
                low
            } else {
                low - 4
            };
        }
    })
}

/// Q4_K and Q5_K: `qh` is where Q5_K's fifth bits start, `qs` the nibbles.
fn k4(b: &[u8], qh: Option<usize>, qs: usize, u: &mut Unpacked) {
    (u.d, u.dmin) = (f16_at(b, 0), f16_at(b, 2));
    for sub in 0..8 {
        let (sc, m) = scale_min_k4(sub, &b[4..16]);
        for g in [2 * sub, 2 * sub + 1] {
            u.sc[g] = i32::from(sc);
            u.m[g] = i32::from(m);
        }
        let (c, h) = (sub / 2, sub % 2);
        for l in 0..32 {
            let mut q = (b[qs + 32 * c + l] >> (4 * h)) & 0x0f;
            if let Some(qh) = qh {
                q |= ((b[qh + l] >> (2 * c + h)) & 1) << 4;
            }
            u.q[32 * sub + l] = i32::from(q);
        }
    }
}

pub(crate) fn q4_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    kquant(w, x, 144, |b, u| k4(b, None, 16, u))
}

pub(crate) fn q5_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    kquant(w, x, 176, |b, u| k4(b, Some(16), 48, u))
}

pub(crate) fn q6_k(w: &[u8], x: Q8Row<'_>) -> f32 {
    kquant(w, x, 210, |b, u| {
        let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
        (u.d, u.dmin) = (f16_at(b, 208), 0.0);
        u.sc = std::array::from_fn(|g| i32::from(scales[g] as i8));
        u.m = [0; 16];
        for (i, v) in u.q.iter_mut().enumerate() {
            let (n, k, l) = (i / 128, (i / 32) % 4, i % 32);
            let low = (ql[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
            let high = (qh[32 * n + l] >> (2 * k)) & 3;
            *v = i32::from(low | (high << 4)) - 32;
        }
    })
}

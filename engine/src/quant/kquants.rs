//! The K-quant formats: super-blocks of 256 elements with per-sub-block scales (and, for
//! Q2_K, Q4_K and Q5_K, minimums) quantized against one or two f16 super-block scales.
//!
//! Element i of a super-block always uses sub-block i / 16 (Q2_K, Q3_K, Q6_K) or i / 32
//! (Q4_K, Q5_K). Where its quant bits sit:
//! - Q2_K (84 bytes: scales[16], qs[64], d, dmin): element `128 h + 32 j + l` is bits 2j..2j+2
//!   of `qs[32 h + l]`; scale byte = 4-bit scale | 4-bit min << 4; x = d sc q - dmin m.
//! - Q3_K (110 bytes: hmask[32], qs[64], scales[12], d): the low two bits as in Q2_K, the
//!   third bit (set means +4) is bit 4h + j of `hmask[l]`; 6-bit scales biased by 32, low
//!   nibbles in bytes 0..8 (two per byte), high pairs in bytes 8..12 (four per byte);
//!   x = d (sc - 32) (q - 4).
//! - Q4_K (144 bytes: d, dmin, scales[12], qs[128]) and Q5_K (176 bytes: d, dmin, scales[12],
//!   qh[32], qs[128]): element `64 c + 32 h + l` is nibble h of `qs[32 c + l]`, Q5_K's fifth
//!   bit is bit 2c + h of `qh[l]`; eight 6-bit scales and minimums packed in 12 bytes
//!   ([`scale_min_k4`]); x = d sc q - dmin m.
//! - Q6_K (210 bytes, so only 2-byte aligned: ql[128], qh[64], scales[16] as i8, d): element
//!   `128 n + 32 k + l` has its low nibble in nibble k / 2 of `ql[64 n + 32 (k % 2) + l]` and its
//!   high two bits at bits 2k..2k+2 of `qh[32 n + l]`; x = d sc (q - 32).
//!
//! The dequantizers multiply in ggml's order ((d sc) q - dmin m), so they agree with it
//! exactly. The quantizers are simple (min/max per sub-block, no search): they serve tests
//! and synthetic models, not model conversion.

use super::f16_at;
use half::f16;

pub(super) const QK_K: usize = 256;

/// Scale and minimum `j` (0..8) of the 12 packed bytes of Q4_K and Q5_K: 6 bits each, the
/// first four whole in bytes 0..8, the last four as nibbles in bytes 8..12 with their top two
/// bits in the spare top bits of bytes 0..8.
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The sixteen 6-bit scales of Q3_K, unbiased (-32..=31).
pub(crate) fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    std::array::from_fn(|i| {
        let low = (s[i % 8] >> (4 * (i / 8))) & 0x0f;
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        (low | (high << 4)) as i8 - 32
    })
}

pub(super) fn dequantize_q2_k(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(QK_K).zip(bytes.chunks_exact(84)) {
        let (scales, qs) = (&b[..16], &b[16..80]);
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for (i, v) in o.iter_mut().enumerate() {
            let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
            let q = (qs[32 * h + l] >> (2 * j)) & 3;
            let sc = scales[i / 16];
            let (dl, ml) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
            *v = dl * f32::from(q) - ml;
        }
    }
}

pub(super) fn dequantize_q3_k(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(QK_K).zip(bytes.chunks_exact(110)) {
        let (hmask, qs) = (&b[..32], &b[32..96]);
        let scales = q3_k_scales(&b[96..108]);
        let d = f16_at(b, 108);
        for (i, v) in o.iter_mut().enumerate() {
            let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
            let low = i32::from((qs[32 * h + l] >> (2 * j)) & 3);
            let q = if hmask[l] & (1 << (4 * h + j)) != 0 {
                low
            } else {
                low - 4
            };
            let dl = d * f32::from(scales[i / 16]);
            *v = dl * q as f32;
        }
    }
}

/// Q4_K and Q5_K: `qh` is where Q5_K's fifth bits start (`None` for Q4_K), `qs` the nibbles.
fn dequantize_k4(b: &[u8], qh: Option<usize>, qs: usize, o: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    for sub in 0..8 {
        let (sc, m) = scale_min_k4(sub, scales);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        let (c, h) = (sub / 2, sub % 2);
        for l in 0..32 {
            let mut q = (b[qs + 32 * c + l] >> (4 * h)) & 0x0f;
            if let Some(qh) = qh {
                q |= ((b[qh + l] >> (2 * c + h)) & 1) << 4;
            }
            o[32 * sub + l] = dl * f32::from(q) - ml;
        }
    }
}

pub(super) fn dequantize_q4_k(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(QK_K).zip(bytes.chunks_exact(144)) {
        dequantize_k4(b, None, 16, o);
    }
}

pub(super) fn dequantize_q5_k(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(QK_K).zip(bytes.chunks_exact(176)) {
        dequantize_k4(b, Some(16), 48, o);
    }
}

pub(super) fn dequantize_q6_k(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(QK_K).zip(bytes.chunks_exact(210)) {
        let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
        let d = f16_at(b, 208);
        for (i, v) in o.iter_mut().enumerate() {
            let (n, k, l) = (i / 128, (i / 32) % 4, i % 32);
            let low = (ql[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
            let high = (qh[32 * n + l] >> (2 * k)) & 3;
            let q = i32::from(low | (high << 4)) - 32;
            *v = d * f32::from(scales[i / 16] as i8) * q as f32;
        }
    }
}

/// Per-sub-block step and minimum for formats with x = step q - min (min >= 0), q in
/// 0..=`qmax`, and the super-block's two f16 scales for `levels`-level sub-block scales.
struct MinScales {
    d: f32,
    dmin: f32,
    sc: Vec<u8>,
    m: Vec<u8>,
}

fn min_scales(x: &[f32], sub: usize, qmax: f32, levels: f32) -> MinScales {
    let (steps, mins): (Vec<f32>, Vec<f32>) = x
        .chunks(sub)
        .map(|s| {
            let min = s.iter().copied().fold(0f32, f32::min);
            let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            ((max - min) / qmax, -min)
        })
        .unzip();
    let d = f16::from_f32(steps.iter().copied().fold(0f32, f32::max) / levels).to_f32();
    let dmin = f16::from_f32(mins.iter().copied().fold(0f32, f32::max) / levels).to_f32();
    let level = |v: f32, unit: f32| {
        if unit > 0.0 {
            (v / unit).round().clamp(0.0, levels) as u8
        } else {
            0
        }
    };
    MinScales {
        d,
        dmin,
        sc: steps.iter().map(|s| level(*s, d)).collect(),
        m: mins.iter().map(|m| level(*m, dmin)).collect(),
    }
}

impl MinScales {
    /// The quant of `v` in sub-block `s`, clamped to 0..=`qmax`.
    fn quant(&self, s: usize, v: f32, qmax: f32) -> u8 {
        let step = self.d * f32::from(self.sc[s]);
        if step == 0.0 {
            return 0;
        }
        ((v + self.dmin * f32::from(self.m[s])) / step)
            .round()
            .clamp(0.0, qmax) as u8
    }

    fn push_d_dmin(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&f16::from_f32(self.d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(self.dmin).to_le_bytes());
    }
}

/// Per-sub-block signed scales for symmetric formats (x = d sc q with q in `qmin..=-qmin-1`):
/// the element of largest magnitude maps to `qmin`. Returns d (f16-rounded) and the scales.
fn signed_scales(x: &[f32], sub: usize, qmin: f32, levels: f32) -> (f32, Vec<i32>) {
    let steps: Vec<f32> = x
        .chunks(sub)
        .map(|s| {
            let max = s
                .iter()
                .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
            max / qmin
        })
        .collect();
    let amax = steps.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = f16::from_f32(amax / levels).to_f32();
    let sc = steps
        .iter()
        .map(|s| {
            if d > 0.0 {
                (s / d).round().clamp(-levels - 1.0, levels) as i32
            } else {
                0
            }
        })
        .collect();
    (d, sc)
}

fn signed_quant(d: f32, sc: i32, v: f32, qmin: f32) -> i32 {
    let step = d * sc as f32;
    if step == 0.0 {
        return 0;
    }
    (v / step).round().clamp(qmin, -qmin - 1.0) as i32
}

pub(super) fn quantize_q2_k(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK_K) {
        let s = min_scales(blk, 16, 3.0, 15.0);
        out.extend((0..16).map(|i| s.sc[i] | (s.m[i] << 4)));
        let mut qs = [0u8; 64];
        for (i, v) in blk.iter().enumerate() {
            let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
            qs[32 * h + l] |= s.quant(i / 16, *v, 3.0) << (2 * j);
        }
        out.extend_from_slice(&qs);
        s.push_d_dmin(out);
    }
}

pub(super) fn quantize_q3_k(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK_K) {
        let (d, sc) = signed_scales(blk, 16, -4.0, 31.0);
        let (mut hmask, mut qs, mut scales) = ([0u8; 32], [0u8; 64], [0u8; 12]);
        for (i, v) in blk.iter().enumerate() {
            let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
            let u = (signed_quant(d, sc[i / 16], *v, -4.0) + 4) as u8;
            qs[32 * h + l] |= (u & 3) << (2 * j);
            hmask[l] |= (u >> 2) << (4 * h + j);
        }
        for (i, s) in sc.iter().enumerate() {
            let u = (s + 32) as u8;
            scales[i % 8] |= (u & 0x0f) << (4 * (i / 8));
            scales[8 + i % 4] |= (u >> 4) << (2 * (i / 4));
        }
        out.extend_from_slice(&hmask);
        out.extend_from_slice(&qs);
        out.extend_from_slice(&scales);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    }
}

/// The 12 bytes [`scale_min_k4`] reads.
fn pack_scale_min_k4(sc: &[u8], m: &[u8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] |= sc[j] & 63;
            s[j + 4] |= m[j] & 63;
        } else {
            s[j + 4] = (sc[j] & 0x0f) | ((m[j] & 0x0f) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
    s
}

/// Q4_K (`five` false) and Q5_K.
fn quantize_k4(x: &[f32], out: &mut Vec<u8>, five: bool) {
    let qmax = if five { 31.0 } else { 15.0 };
    for blk in x.chunks(QK_K) {
        let s = min_scales(blk, 32, qmax, 63.0);
        s.push_d_dmin(out);
        out.extend_from_slice(&pack_scale_min_k4(&s.sc, &s.m));
        let (mut qh, mut qs) = ([0u8; 32], [0u8; 128]);
        for (i, v) in blk.iter().enumerate() {
            let (c, h, l) = (i / 64, (i / 32) % 2, i % 32);
            let q = s.quant(i / 32, *v, qmax);
            qs[32 * c + l] |= (q & 0x0f) << (4 * h);
            qh[l] |= (q >> 4) << (2 * c + h);
        }
        if five {
            out.extend_from_slice(&qh);
        }
        out.extend_from_slice(&qs);
    }
}

pub(super) fn quantize_q4_k(x: &[f32], out: &mut Vec<u8>) {
    quantize_k4(x, out, false);
}

pub(super) fn quantize_q5_k(x: &[f32], out: &mut Vec<u8>) {
    quantize_k4(x, out, true);
}

pub(super) fn quantize_q6_k(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(QK_K) {
        let (d, sc) = signed_scales(blk, 16, -32.0, 127.0);
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        for (i, v) in blk.iter().enumerate() {
            let (n, k, l) = (i / 128, (i / 32) % 4, i % 32);
            let u = (signed_quant(d, sc[i / 16], *v, -32.0) + 32) as u8;
            ql[64 * n + 32 * (k % 2) + l] |= (u & 0x0f) << (4 * (k / 2));
            qh[32 * n + l] |= (u >> 4) << (2 * k);
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|s| *s as i8 as u8));
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
    }
}

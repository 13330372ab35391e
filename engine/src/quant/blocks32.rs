//! The 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.
//!
//! In the 4- and 5-bit ones byte j of the nibbles holds element j in its low nibble and
//! element j + 16 in its high nibble; Q5's fifth bits are one little-endian u32, bit e for
//! element e. The quantizers follow ggml's reference ones (`quantize_row_*_ref`).

use super::f16_at;
use half::f16;

pub(super) fn dequantize_q8_0(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(32).zip(bytes.chunks_exact(34)) {
        let d = f16_at(b, 0);
        for (i, v) in o.iter_mut().enumerate() {
            *v = d * f32::from(b[2 + i] as i8);
        }
    }
}

pub(super) fn dequantize_q4_0(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(32).zip(bytes.chunks_exact(18)) {
        let d = f16_at(b, 0);
        for j in 0..16 {
            let q = b[2 + j];
            o[j] = d * (f32::from(q & 0x0f) - 8.0);
            o[j + 16] = d * (f32::from(q >> 4) - 8.0);
        }
    }
}

pub(super) fn dequantize_q4_1(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(32).zip(bytes.chunks_exact(20)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for j in 0..16 {
            let q = b[4 + j];
            o[j] = d * f32::from(q & 0x0f) + m;
            o[j + 16] = d * f32::from(q >> 4) + m;
        }
    }
}

/// The 32 five-bit values of a Q5 block whose fifth bits start at `qh` and nibbles follow.
fn q5_values(b: &[u8], qh: usize) -> [u8; 32] {
    let high = u32::from_le_bytes([b[qh], b[qh + 1], b[qh + 2], b[qh + 3]]);
    let nibbles = &b[qh + 4..qh + 20];
    std::array::from_fn(|e| {
        let low = if e < 16 {
            nibbles[e] & 0x0f
        } else {
            nibbles[e - 16] >> 4
        };
        low | ((((high >> e) & 1) as u8) << 4)
    })
}

pub(super) fn dequantize_q5_0(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(32).zip(bytes.chunks_exact(22)) {
        let d = f16_at(b, 0);
        for (v, q) in o.iter_mut().zip(q5_values(b, 2)) {
            *v = (f32::from(q) - 16.0) * d;
        }
    }
}

pub(super) fn dequantize_q5_1(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_mut(32).zip(bytes.chunks_exact(24)) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (v, q) in o.iter_mut().zip(q5_values(b, 4)) {
            *v = f32::from(q) * d + m;
        }
    }
}

/// Packs 32 five-bit values as Q5 stores them: the u32 of fifth bits, then 16 nibble bytes.
fn push_q5(out: &mut Vec<u8>, q: &[u8; 32]) {
    let high = q
        .iter()
        .enumerate()
        .fold(0u32, |h, (e, v)| h | (u32::from(v >> 4) << e));
    out.extend_from_slice(&high.to_le_bytes());
    out.extend((0..16).map(|j| (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4)));
}

pub(super) fn quantize_q8_0(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(32) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
    }
}

/// The element of largest magnitude, with its sign.
fn signed_max(blk: &[f32]) -> f32 {
    blk.iter()
        .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m })
}

pub(super) fn quantize_q4_0(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(32) {
        let d = signed_max(blk) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for j in 0..16 {
            let q0 = ((blk[j] * id + 8.5) as i32).min(15) as u8;
            let q1 = ((blk[j + 16] * id + 8.5) as i32).min(15) as u8;
            out.push(q0 | (q1 << 4));
        }
    }
}

/// The minimum, the step for `levels` steps between minimum and maximum, and its inverse.
fn min_step(blk: &[f32], levels: f32) -> (f32, f32, f32) {
    let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
    let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let d = (max - min) / levels;
    (min, d, if d != 0.0 { 1.0 / d } else { 0.0 })
}

pub(super) fn quantize_q4_1(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(32) {
        let (min, d, id) = min_step(blk, 15.0);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        for j in 0..16 {
            let q0 = (((blk[j] - min) * id + 0.5) as i32).min(15) as u8;
            let q1 = (((blk[j + 16] - min) * id + 0.5) as i32).min(15) as u8;
            out.push(q0 | (q1 << 4));
        }
    }
}

pub(super) fn quantize_q5_0(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(32) {
        let d = signed_max(blk) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        let q = std::array::from_fn(|e| ((blk[e] * id + 16.5) as i32).clamp(0, 31) as u8);
        push_q5(out, &q);
    }
}

pub(super) fn quantize_q5_1(x: &[f32], out: &mut Vec<u8>) {
    for blk in x.chunks(32) {
        let (min, d, id) = min_step(blk, 31.0);
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        let q = std::array::from_fn(|e| (((blk[e] - min) * id + 0.5) as i32).clamp(0, 31) as u8);
        push_q5(out, &q);
    }
}

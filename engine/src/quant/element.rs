//! One element of a quantized row, decoded alone: the few weights the cpu backend's int8
//! products multiply in f32 (an activation too large for its block's int8 step, `cpu::q8`).
//! The same formulas as the row dequantizers (layouts in `kquants`), so the value is theirs.

use super::kquants::{q3_k_scales, scale_min_k4};
use super::{GgmlType, f16_at};

/// Element `i` of the row `row` (whole blocks of `ty`).
pub(crate) fn element(ty: GgmlType, row: &[u8], i: usize) -> f32 {
    let (len, bytes) = (ty.block_len(), ty.block_bytes());
    let b = &row[i / len * bytes..][..bytes];
    let i = i % len;
    match ty {
        GgmlType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => f16_at(b, 0),
        GgmlType::Q8_0 => f16_at(b, 0) * f32::from(b[2 + i] as i8),
        GgmlType::Q4_0 => f16_at(b, 0) * (f32::from(nibble(&b[2..], i)) - 8.0),
        GgmlType::Q4_1 => f16_at(b, 0) * f32::from(nibble(&b[4..], i)) + f16_at(b, 2),
        GgmlType::Q5_0 => (f32::from(q5(b, 2, i)) - 16.0) * f16_at(b, 0),
        GgmlType::Q5_1 => f32::from(q5(b, 4, i)) * f16_at(b, 0) + f16_at(b, 2),
        GgmlType::Q2_K => {
            let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
            let q = (b[16 + 32 * h + l] >> (2 * j)) & 3;
            let sc = b[i / 16];
            let dl = f16_at(b, 80) * f32::from(sc & 0x0f);
            dl * f32::from(q) - f16_at(b, 82) * f32::from(sc >> 4)
        }
        GgmlType::Q3_K => {
            let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
            let low = i32::from((b[32 + 32 * h + l] >> (2 * j)) & 3);
            let q = if b[l] & (1 << (4 * h + j)) != 0 {
                low
            } else {
                low - 4
            };
            f16_at(b, 108) * f32::from(q3_k_scales(&b[96..108])[i / 16]) * q as f32
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (sub, l) = (i / 32, i % 32);
            let (sc, m) = scale_min_k4(sub, &b[4..16]);
            let (c, h) = (sub / 2, sub % 2);
            let qs = if ty == GgmlType::Q4_K { 16 } else { 48 };
            let mut q = (b[qs + 32 * c + l] >> (4 * h)) & 0x0f;
            if ty == GgmlType::Q5_K {
                q |= ((b[16 + l] >> (2 * c + h)) & 1) << 4;
            }
            f16_at(b, 0) * f32::from(sc) * f32::from(q) - f16_at(b, 2) * f32::from(m)
        }
        GgmlType::Q6_K => {
            let (n, k, l) = (i / 128, (i / 32) % 4, i % 32);
            let low = (b[64 * n + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
            let high = (b[128 + 32 * n + l] >> (2 * k)) & 3;
            let q = i32::from(low | (high << 4)) - 32;
            f16_at(b, 208) * f32::from(b[192 + i / 16] as i8) * q as f32
        }
    }
}

/// Element `i` (0..32) of 16 bytes of nibbles: low nibbles first, then high.
fn nibble(qs: &[u8], i: usize) -> u8 {
    if i < 16 {
        qs[i] & 0x0f
    } else {
        qs[i - 16] >> 4
    }
}

/// Element `i` of a Q5 block whose u32 of fifth bits starts at `qh`, its nibbles after it.
fn q5(b: &[u8], qh: usize, i: usize) -> u8 {
    nibble(&b[qh + 4..], i) | ((b[qh + i / 8] >> (i % 8)) & 1) << 4
}

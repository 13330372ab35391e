//! GGML tensor element types and their block layouts, exactly as GGUF stores them.
//!
//! The GPU kernels read these blocks in place (no repacking), so the same bytes can be
//! memory-mapped natively, range-fetched in a browser and uploaded unchanged.

use half::f16;
use serde::{Deserialize, Serialize};

/// Tensor element types Cairn can load. Other GGML types are refused with an error naming them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl GgmlType {
    /// Every type Cairn loads.
    pub const ALL: [GgmlType; 5] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
    ];

    /// The numeric id GGUF uses for this type.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
        }
    }

    /// Maps a GGUF type id to a supported type; `Err` carries the GGML name of an unsupported one.
    pub fn from_id(id: u32) -> Result<Self, &'static str> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            other => return Err(ggml_type_name(other)),
        })
    }

    pub fn name(self) -> &'static str {
        ggml_type_name(self.id())
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q8_0 => 34,
        }
    }

    /// Bytes for a row of `n` elements, or `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }
}

fn ggml_type_name(id: u32) -> &'static str {
    const NAMES: [&str; 42] = [
        "F32",
        "F16",
        "Q4_0",
        "Q4_1",
        "Q4_2",
        "Q4_3",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q8_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "Q8_K",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ4_NL",
        "IQ3_S",
        "IQ2_S",
        "IQ4_XS",
        "I8",
        "I16",
        "I32",
        "I64",
        "F64",
        "IQ1_M",
        "BF16",
        "Q4_0_4_4",
        "Q4_0_4_8",
        "Q4_0_8_8",
        "TQ1_0",
        "TQ2_0",
        "IQ4_NL_4_4",
        "IQ4_NL_4_8",
        "IQ4_NL_8_8",
        "MXFP4",
        "NVFP4",
        "Q1_0",
    ];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

/// Dequantizes one row (a whole number of blocks) of `ty` into `out`.
///
/// `out.len()` elements are produced; `bytes` must hold exactly their blocks.
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_mut(32).zip(bytes.chunks_exact(34)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (i, v) in o.iter_mut().enumerate() {
                    *v = d * f32::from(b[2 + i] as i8);
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_mut(32).zip(bytes.chunks_exact(18)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for j in 0..16 {
                    let q = b[2 + j];
                    o[j] = d * (f32::from(q & 0x0f) - 8.0);
                    o[j + 16] = d * (f32::from(q >> 4) - 8.0);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_mut(32).zip(bytes.chunks_exact(20)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
                for j in 0..16 {
                    let q = b[4 + j];
                    o[j] = d * f32::from(q & 0x0f) + m;
                    o[j + 16] = d * f32::from(q >> 4) + m;
                }
            }
        }
    }
}

/// Quantizes `x` (a whole number of blocks for block types) the way ggml's reference
/// quantizers do. Used for tests and synthetic models.
pub fn quantize_row(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ty.row_bytes(x.len()).unwrap_or(0));
    match ty {
        GgmlType::F32 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for blk in x.chunks(32) {
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        GgmlType::Q4_0 => {
            for blk in x.chunks(32) {
                let max = blk
                    .iter()
                    .fold(0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                for j in 0..16 {
                    let q0 = ((blk[j] * id + 8.5) as i32).min(15) as u8;
                    let q1 = ((blk[j + 16] * id + 8.5) as i32).min(15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        GgmlType::Q4_1 => {
            for blk in x.chunks(32) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                for j in 0..16 {
                    let q0 = (((blk[j] - min) * id + 0.5) as i32).min(15) as u8;
                    let q1 = (((blk[j + 16] - min) * id + 0.5) as i32).min(15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_error_is_within_one_step() {
        let x: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13)
            .collect();
        for ty in [
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::F16,
        ] {
            let q = quantize_row(ty, &x);
            assert_eq!(q.len(), ty.row_bytes(x.len()).unwrap());
            let mut y = vec![0f32; x.len()];
            dequantize_row(ty, &q, &mut y);
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let step = match ty {
                GgmlType::Q8_0 => amax / 127.0,
                GgmlType::Q4_0 => amax / 8.0,
                GgmlType::Q4_1 => 2.0 * amax / 15.0,
                _ => amax / 1000.0,
            };
            for (a, b) in x.iter().zip(&y) {
                // f16 rounding of the scale can stretch the worst case past one step by a hair.
                assert!((a - b).abs() <= step * 1.01, "{ty:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn unknown_types_are_named() {
        assert_eq!(GgmlType::from_id(12), Err("Q4_K"));
        assert_eq!(GgmlType::from_id(999), Err("unknown"));
        assert_eq!(GgmlType::from_id(3), Ok(GgmlType::Q4_1));
    }
}

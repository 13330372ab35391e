//! GGML tensor element types and their block layouts, exactly as GGUF stores them.
//!
//! The GPU kernels read these blocks in place (no repacking), so the same bytes can be
//! memory-mapped natively, range-fetched in a browser and uploaded unchanged.

mod blocks32;
mod element;
pub(crate) mod kquants;
mod quantize;
mod quantize_mix;
mod quantize_model;

pub(crate) use element::element;
pub use quantize::quantize_row_best;
pub use quantize_mix::{FileType, ModelShape, tensor_type};
pub use quantize_model::{Progress, QuantizeError, QuantizeOptions, plan, quantize_model};

use half::f16;
use serde::{Deserialize, Serialize};

/// Tensor element types Cairn can load. Other GGML types are refused with an error naming them.
// GGML's own names (Q4_K), which GGUF files, logs and the protocol use.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl GgmlType {
    /// Every type Cairn loads.
    pub const ALL: [GgmlType; 12] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// The numeric id GGUF uses for this type.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
        }
    }

    /// Maps a GGUF type id to a supported type; `Err` carries the GGML name of an unsupported one.
    pub fn from_id(id: u32) -> Result<Self, &'static str> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            other => return Err(ggml_type_name(other)),
        })
    }

    /// The names of every type Cairn loads, comma-separated, for error messages.
    pub fn supported_names() -> String {
        GgmlType::ALL.map(GgmlType::name).join(", ")
    }

    pub fn name(self) -> &'static str {
        ggml_type_name(self.id())
    }

    /// Elements per block.
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                kquants::QK_K
            }
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
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
        GgmlType::Q8_0 => blocks32::dequantize_q8_0(bytes, out),
        GgmlType::Q4_0 => blocks32::dequantize_q4_0(bytes, out),
        GgmlType::Q4_1 => blocks32::dequantize_q4_1(bytes, out),
        GgmlType::Q5_0 => blocks32::dequantize_q5_0(bytes, out),
        GgmlType::Q5_1 => blocks32::dequantize_q5_1(bytes, out),
        GgmlType::Q2_K => kquants::dequantize_q2_k(bytes, out),
        GgmlType::Q3_K => kquants::dequantize_q3_k(bytes, out),
        GgmlType::Q4_K => kquants::dequantize_q4_k(bytes, out),
        GgmlType::Q5_K => kquants::dequantize_q5_k(bytes, out),
        GgmlType::Q6_K => kquants::dequantize_q6_k(bytes, out),
    }
}

/// Quantizes `x` (a whole number of blocks for block types). The 32-element formats follow
/// ggml's reference quantizers; the K-quants use a plain min/max rule per sub-block. Used for
/// tests and synthetic models.
pub fn quantize_row(ty: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(ty.row_bytes(x.len()).unwrap_or(0));
    match ty {
        GgmlType::F32 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => x
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => blocks32::quantize_q8_0(x, &mut out),
        GgmlType::Q4_0 => blocks32::quantize_q4_0(x, &mut out),
        GgmlType::Q4_1 => blocks32::quantize_q4_1(x, &mut out),
        GgmlType::Q5_0 => blocks32::quantize_q5_0(x, &mut out),
        GgmlType::Q5_1 => blocks32::quantize_q5_1(x, &mut out),
        GgmlType::Q2_K => kquants::quantize_q2_k(x, &mut out),
        GgmlType::Q3_K => kquants::quantize_q3_k(x, &mut out),
        GgmlType::Q4_K => kquants::quantize_q4_k(x, &mut out),
        GgmlType::Q5_K => kquants::quantize_q5_k(x, &mut out),
        GgmlType::Q6_K => kquants::quantize_q6_k(x, &mut out),
    }
    out
}

/// The little-endian f16 at byte `at` of `b`, as f32.
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[cfg(test)]
mod tests;

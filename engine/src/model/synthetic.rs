//! Llama-shaped models filled with random quantized weights, so bandwidth-bound sizes can be
//! benchmarked without downloading them. Each distinct tensor shape gets one random buffer that
//! every layer shares on the host; each layer still gets its own device copy, so a forward pass
//! reads as many bytes as the real model would.

use std::collections::HashMap;

use half::f16;

use super::config::ModelConfig;
use super::weights::shard_tensors;
use crate::gguf::{GgufError, GgufFile, Metadata, TensorInfo, TensorSource, Value};
use crate::quant::GgmlType;

pub struct SyntheticModel {
    file: GgufFile,
    data: HashMap<(GgmlType, usize, usize), Vec<u8>>,
}

impl SyntheticModel {
    pub fn new(cfg: &ModelConfig, seed: u64) -> SyntheticModel {
        let mut md = Metadata::new();
        let a = &cfg.architecture;
        md.insert("general.architecture", Value::String(a.clone()));
        md.insert(format!("{a}.block_count"), Value::U32(cfg.n_layers as u32));
        md.insert(format!("{a}.embedding_length"), Value::U32(cfg.dim as u32));
        md.insert(
            format!("{a}.feed_forward_length"),
            Value::U32(cfg.ffn_dim as u32),
        );
        md.insert(
            format!("{a}.attention.head_count"),
            Value::U32(cfg.n_heads as u32),
        );
        md.insert(
            format!("{a}.attention.head_count_kv"),
            Value::U32(cfg.n_kv_heads as u32),
        );
        md.insert(
            format!("{a}.rope.dimension_count"),
            Value::U32(cfg.rope_dim as u32),
        );
        md.insert(format!("{a}.rope.freq_base"), Value::F32(cfg.rope_base));
        md.insert(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.norm_eps),
        );
        md.insert(
            format!("{a}.context_length"),
            Value::U32(cfg.context_length as u32),
        );
        let mut tensors = Vec::new();
        let mut data = HashMap::new();
        let mut offset = 0u64;
        let mut rng = seed | 1;
        for (name, rows, cols) in shard_tensors(cfg, 0, cfg.n_layers) {
            let ty = if rows == 1 {
                GgmlType::F32
            } else if name == "token_embd.weight" {
                GgmlType::Q8_0
            } else {
                super::config::SYNTHETIC_WEIGHT_TYPE
            };
            let bytes = data
                .entry((ty, rows, cols))
                .or_insert_with(|| random_tensor(ty, rows, cols, &mut rng));
            let n_bytes = bytes.len() as u64;
            tensors.push(TensorInfo {
                name,
                dims: vec![cols as u64, rows as u64],
                ty,
                offset,
                n_bytes,
                n_elements: (rows * cols) as u64,
            });
            offset += n_bytes.div_ceil(32) * 32;
        }
        let file = GgufFile {
            version: 3,
            alignment: 32,
            metadata: md,
            tensors,
            data_offset: 0,
        };
        SyntheticModel { file, data }
    }
}

impl TensorSource for SyntheticModel {
    fn gguf(&self) -> &GgufFile {
        &self.file
    }

    fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let t = self.file.require_tensor(name)?;
        let key = (t.ty, t.dims[1] as usize, t.dims[0] as usize);
        self.data
            .get(&key)
            .map(Vec::as_slice)
            .ok_or_else(|| GgufError::MissingTensor {
                name: name.to_string(),
            })
    }
}

fn next(state: &mut u64) -> u64 {
    // xorshift64*: fast enough to fill gigabytes.
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

fn random_tensor(ty: GgmlType, rows: usize, cols: usize, rng: &mut u64) -> Vec<u8> {
    let n = rows * cols;
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| 1.0f32.to_le_bytes()).collect(),
        _ => {
            let blocks = n / ty.block_len();
            let mut out = Vec::with_capacity(blocks * ty.block_bytes());
            // Scales keep activations in a sane range whatever the depth.
            let d = f16::from_f32(0.02 / (cols as f32).sqrt()).to_le_bytes();
            let m = f16::from_f32(-0.15 / (cols as f32).sqrt()).to_le_bytes();
            for _ in 0..blocks {
                out.extend_from_slice(&d);
                if ty == GgmlType::Q4_1 {
                    out.extend_from_slice(&m);
                }
                let header = if ty == GgmlType::Q4_1 { 4 } else { 2 };
                let mut left = ty.block_bytes() - header;
                while left > 0 {
                    let r = next(rng).to_le_bytes();
                    let take = left.min(8);
                    out.extend_from_slice(&r[..take]);
                    left -= take;
                }
            }
            out
        }
    }
}

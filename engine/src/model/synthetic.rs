//! Llama-shaped models filled with random quantized weights, so bandwidth-bound sizes can be
//! benchmarked without downloading them. Each distinct tensor shape gets one random buffer that
//! every layer shares on the host; each layer still gets its own device copy, so a forward pass
//! reads as many bytes as the real model would.

use std::collections::HashMap;

use half::f16;

use super::config::ModelConfig;
use super::weights::shard_tensors;
use crate::gguf::{GgufError, GgufFile, GgufWriter, Metadata, TensorInfo, TensorSource, Value};
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

impl SyntheticModel {
    /// The model as a GGUF file, so processes that load models from files (the coordinator,
    /// workers) can run synthetic shapes. Its vocabulary is a stand-in (`<0>`, `<1>`, ...)
    /// with no merges: text does not encode usefully, so callers send token ids. Holds
    /// every tensor in memory while writing: meant for the small shapes.
    pub fn write_gguf(&self, out: impl std::io::Write) -> std::io::Result<()> {
        let mut w = GgufWriter::new();
        w.alignment(self.file.alignment as u32);
        for (k, v) in self.file.metadata.iter() {
            w.add(k, v.clone());
        }
        let vocab = self
            .file
            .tensor("token_embd.weight")
            .map_or(0, |t| t.dims[1] as usize);
        w.add("general.name", "synthetic");
        w.add("tokenizer.ggml.model", "gpt2");
        w.add(
            "tokenizer.ggml.tokens",
            Value::Array(
                (0..vocab)
                    .map(|i| Value::String(format!("<{i}>")))
                    .collect(),
            ),
        );
        w.add("tokenizer.ggml.bos_token_id", 0u32);
        w.add("tokenizer.ggml.eos_token_id", 0u32);
        w.add("tokenizer.ggml.add_bos_token", false);
        for t in &self.file.tensors {
            let data = self.tensor_data(&t.name).map_err(std::io::Error::other)?;
            w.add_tensor(t.name.clone(), &t.dims, t.ty, data.to_vec());
        }
        w.write_to(out)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::BytesGguf;
    use crate::tokenizer::Tokenizer;

    #[test]
    fn written_gguf_reads_back_as_the_same_model() {
        let mut cfg = ModelConfig::synthetic("135m").expect("135m shape");
        cfg.n_layers = 2;
        cfg.vocab_size = 300;
        let model = SyntheticModel::new(&cfg, 11);
        let mut bytes = Vec::new();
        model.write_gguf(&mut bytes).expect("writes");
        let file = BytesGguf::new(bytes).expect("parses");
        let read = ModelConfig::from_gguf(file.gguf()).expect("config");
        assert_eq!(
            (read.n_layers, read.dim, read.ffn_dim, read.vocab_size),
            (cfg.n_layers, cfg.dim, cfg.ffn_dim, cfg.vocab_size)
        );
        assert_eq!(read.n_kv_heads, cfg.n_kv_heads);
        assert_eq!(file.gguf().tensors.len(), model.gguf().tensors.len());
        for t in &model.gguf().tensors {
            assert_eq!(
                file.tensor_data(&t.name).expect("tensor present"),
                model.tensor_data(&t.name).expect("tensor present"),
                "{}",
                t.name
            );
        }
        let spec = file.gguf().tokenizer_spec().expect("tokenizer metadata");
        let tok = Tokenizer::from_spec(&spec).expect("tokenizer builds");
        assert_eq!(tok.decode(&[7, 42]).expect("decodes"), "<7><42>");
    }
}

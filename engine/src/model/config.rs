//! A model's shape and family, read from GGUF metadata and its first block's tensors.

use serde::{Deserialize, Serialize};

use super::ModelError;
use super::family::Family;
use crate::gguf::GgufFile;
use crate::quant::GgmlType;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: String,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub rope_base: f32,
    pub norm_eps: f32,
    pub context_length: usize,
    pub vocab_size: usize,
    /// The output head reuses the token embedding (no `output.weight`).
    pub tied_output: bool,
    #[serde(default)]
    pub family: Family,
    /// Rotation pairs `(i, i + rope_dim/2)` instead of `(2i, 2i+1)`.
    #[serde(default)]
    pub rope_neox: bool,
    /// Per-dimension frequency divisors (`rope_freqs.weight`, Llama 3.1's long-context RoPE).
    #[serde(default)]
    pub rope_freqs: bool,
    /// Q, K and V products add a bias (`attn_q.bias`, ..., or `attn_qkv.bias` when fused).
    #[serde(default)]
    pub qkv_bias: bool,
    /// Q and K are RMS-normed per head before the rotation (`attn_q_norm`, `attn_k_norm`).
    #[serde(default)]
    pub qk_norm: bool,
    /// Q, K and V are one tensor (`attn_qkv`), rows in that order; split at load.
    #[serde(default)]
    pub fused_qkv: bool,
    /// Gate and up are one tensor (`ffn_up` with gate rows first); split at load.
    #[serde(default)]
    pub fused_gate_up: bool,
    /// Attention scores become `c * tanh(s / c)` (Gemma 2); 0 leaves them.
    #[serde(default)]
    pub attn_softcap: f32,
    /// Logits become `c * tanh(l / c)` (Gemma 2, and Gemma 3 files that say so); 0 leaves them.
    #[serde(default)]
    pub final_softcap: f32,
    /// Positions a local layer attends to, its own included (Gemma's sliding window).
    #[serde(default)]
    pub sliding_window: usize,
    /// Per block, whether it is a local (sliding-window) layer; empty when none is.
    #[serde(default)]
    pub swa_layers: Vec<bool>,
    /// The RoPE base of the local layers; 0 when there are none.
    #[serde(default)]
    pub rope_base_swa: f32,
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig, ModelError> {
        let arch = file.architecture()?.to_string();
        let refuse = |why: String| ModelError::UnsupportedArchitecture {
            arch: arch.clone(),
            why,
        };
        let family = Family::of(&arch).map_err(&refuse)?;
        let m = &file.metadata;
        let key = |k: &str| format!("{arch}.{k}");
        if let Some(n) = m.opt_u32(&key("expert_count"))?
            && n > 0
        {
            return Err(refuse(format!(
                "a mixture-of-experts model ({n} experts); Cairn runs dense models only"
            )));
        }
        if let Some(kind) = m.opt_str(&key("rope.scaling.type"))?
            && !matches!(kind, "none" | "llama3")
        {
            return Err(refuse(format!("RoPE scaling '{kind}' is not supported")));
        }
        if file.tensor(&block_tensor(0, "rope_factors_long")).is_some()
            || file.tensor("rope_factors_long.weight").is_some()
        {
            return Err(refuse(
                "LongRoPE factors (rope_factors_long) are not supported".into(),
            ));
        }
        let n_layers = m.get_u32(&key("block_count"))? as usize;
        let dim = m.get_u32(&key("embedding_length"))? as usize;
        let ffn_dim = m.get_u32(&key("feed_forward_length"))? as usize;
        let n_heads = m.get_u32(&key("attention.head_count"))? as usize;
        let n_kv_heads = m
            .opt_u32(&key("attention.head_count_kv"))?
            .map_or(n_heads, |v| v as usize);
        let key_length = m.opt_u32(&key("attention.key_length"))?;
        if n_heads == 0
            || n_kv_heads == 0
            || !n_heads.is_multiple_of(n_kv_heads)
            || (key_length.is_none() && !dim.is_multiple_of(n_heads))
        {
            return Err(ModelError::BadShape(format!(
                "{n_heads} heads, {n_kv_heads} kv heads and width {dim} do not divide evenly"
            )));
        }
        let head_dim = key_length.map_or(dim / n_heads, |v| v as usize);
        if let Some(v) = m.opt_u32(&key("attention.value_length"))?
            && v as usize != head_dim
        {
            return Err(ModelError::BadShape(format!(
                "value heads of {v} and key heads of {head_dim} differ"
            )));
        }
        let rope_dim = m
            .opt_u32(&key("rope.dimension_count"))?
            .map_or(head_dim, |v| v as usize);
        let rope_base = m.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let norm_eps = m
            .opt_f32(&key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5);
        let mut context_length = m
            .opt_u32(&key("context_length"))?
            .map_or(2048, |v| v as usize);
        // Mistral-style llama files may name a sliding attention window; within the window
        // full causal attention is exact, so the context stops there. (llama.cpp ignores
        // phi3's window, and so does Cairn, to give the same logits.)
        if family == Family::Llama
            && let Some(w) = m.opt_u32(&key("attention.sliding_window"))?
            && w > 0
        {
            context_length = context_length.min(w as usize);
        }
        let gemma = family
            .gemma()
            .then(|| Gemma::from_metadata(m, &arch, family, n_layers, rope_base));
        let gemma = gemma.transpose()?.unwrap_or_default();
        let embd = file.require_tensor("token_embd.weight")?;
        if embd.dims.len() != 2 || embd.dims[0] as usize != dim {
            return Err(ModelError::BadShape(format!(
                "token_embd.weight has dims {:?}, expected [{dim}, vocab]",
                embd.dims
            )));
        }
        let vocab_size = usize::try_from(embd.dims[1])
            .map_err(|_| ModelError::BadShape("vocabulary too large".into()))?;
        let tied_output = file.tensor("output.weight").is_none();
        let has = |part: &str| file.tensor(&format!("blk.0.{part}")).is_some();
        let fused_qkv = has("attn_qkv.weight");
        let qkv_bias = if fused_qkv {
            has("attn_qkv.bias")
        } else {
            has("attn_q.bias")
        };
        let cfg = ModelConfig {
            architecture: arch,
            n_layers,
            dim,
            ffn_dim,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dim,
            rope_base,
            norm_eps,
            context_length,
            vocab_size,
            tied_output,
            family,
            rope_neox: family.neox_rope(),
            rope_freqs: file.tensor(ROPE_FREQS).is_some(),
            qkv_bias,
            qk_norm: has("attn_q_norm.weight"),
            fused_qkv,
            fused_gate_up: file.tensor(&block_tensor(0, "ffn_gate")).is_none(),
            attn_softcap: gemma.attn_softcap,
            final_softcap: gemma.final_softcap,
            sliding_window: gemma.sliding_window,
            swa_layers: gemma.swa_layers,
            rope_base_swa: gemma.rope_base_swa,
        };
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<(), ModelError> {
        let bad = |s: String| Err(ModelError::BadShape(s));
        if self.n_layers == 0 || self.n_layers > 4096 {
            return bad(format!("{} layers", self.n_layers));
        }
        if self.head_dim == 0 || self.head_dim > 256 {
            return bad(format!(
                "head dimension {} (Cairn supports 1..=256)",
                self.head_dim
            ));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return bad(format!(
                "rope dimension {} with head dimension {}",
                self.rope_dim, self.head_dim
            ));
        }
        if self.dim == 0 || self.ffn_dim == 0 || self.vocab_size == 0 {
            return bad("zero-sized width, FFN or vocabulary".into());
        }
        Ok(())
    }

    /// The attention window of block `layer`: the local layers' window, or 0 (every earlier
    /// position).
    pub fn layer_window(&self, layer: usize) -> u32 {
        if self.swa_layers.get(layer).copied().unwrap_or(false) {
            u32::try_from(self.sliding_window).unwrap_or(u32::MAX)
        } else {
            0
        }
    }

    /// The RoPE base of block `layer`.
    pub fn layer_rope_base(&self, layer: usize) -> f32 {
        if self.layer_window(layer) > 0 {
            self.rope_base_swa
        } else {
            self.rope_base
        }
    }

    /// The scale of attention scores. Gemma's 27B models scale by their width per head
    /// (`query_pre_attn_scalar`), not their head size; llama.cpp knows them by their block
    /// count, and so does Cairn, to give its logits.
    pub fn attn_scale(&self) -> f32 {
        let big = matches!(
            (self.family, self.n_layers),
            (Family::Gemma2, 46) | (Family::Gemma3, 62)
        );
        let d = if big {
            self.dim / self.n_heads.max(1)
        } else {
            self.head_dim
        };
        1.0 / (d as f32).sqrt()
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Bytes of KV cache one position costs in one layer (f32 keys and values).
    pub fn kv_bytes_per_token_layer(&self) -> u64 {
        2 * 4 * self.kv_dim() as u64
    }

    /// The shape of a synthetic model, for benchmarks without downloading weights.
    pub fn synthetic(name: &str) -> Option<ModelConfig> {
        let mk = |n_layers, dim, ffn_dim, n_heads, n_kv_heads, vocab_size, rope_base| ModelConfig {
            architecture: "llama".into(),
            n_layers,
            dim,
            ffn_dim,
            n_heads,
            n_kv_heads,
            head_dim: dim / n_heads,
            rope_dim: dim / n_heads,
            rope_base,
            norm_eps: 1e-5,
            context_length: 8192,
            vocab_size,
            tied_output: true,
            family: Family::Llama,
            rope_neox: false,
            rope_freqs: false,
            qkv_bias: false,
            qk_norm: false,
            fused_qkv: false,
            fused_gate_up: false,
            attn_softcap: 0.0,
            final_softcap: 0.0,
            sliding_window: 0,
            swa_layers: Vec::new(),
            rope_base_swa: 0.0,
        };
        match name {
            "smollm2-135m" | "135m" => Some(mk(30, 576, 1536, 9, 3, 49152, 100_000.0)),
            "llama-1b" | "1b" => Some(mk(16, 2048, 8192, 32, 8, 128_256, 500_000.0)),
            "llama-8b" | "8b" => Some(mk(32, 4096, 14336, 32, 8, 128_256, 500_000.0)),
            // Arithmetic too small to matter: what a run costs besides it.
            "tiny" => Some(mk(8, 128, 256, 4, 2, 512, 10_000.0)),
            // Rows long enough for the cuda backend's split matrix-vector kernels (2048
            // columns of a 4-bit format are 256 lane steps), in two small layers.
            "wide" => Some(mk(2, 2048, 2048, 16, 4, 512, 10_000.0)),
            // The 8B's width, heads and vocabulary in two layers: what a token of the 8B
            // costs between stages (a 4,096-float activation, a 128,256-entry head), cheap
            // enough for the cpu backend.
            "8b-thin" => Some(mk(2, 4096, 14336, 32, 8, 128_256, 500_000.0)),
            _ => None,
        }
    }
}

/// What Gemma's metadata adds, with llama.cpp's defaults where a file is silent.
#[derive(Default)]
struct Gemma {
    attn_softcap: f32,
    final_softcap: f32,
    sliding_window: usize,
    swa_layers: Vec<bool>,
    rope_base_swa: f32,
}

impl Gemma {
    fn from_metadata(
        m: &crate::gguf::Metadata,
        arch: &str,
        family: Family,
        n_layers: usize,
        rope_base: f32,
    ) -> Result<Gemma, ModelError> {
        let key = |k: &str| format!("{arch}.{k}");
        let gemma2 = family == Family::Gemma2;
        // Gemma 2 always caps (50 and 30 unless the file says); llama.cpp's Gemma 3 never
        // caps attention and caps logits only where the file names a cap.
        let attn_softcap = if gemma2 {
            m.opt_f32(&key("attn_logit_softcapping"))?.unwrap_or(50.0)
        } else {
            0.0
        };
        let final_softcap = m
            .opt_f32(&key("final_logit_softcapping"))?
            .unwrap_or(if gemma2 { 30.0 } else { 0.0 });
        let window = m.opt_u32(&key("attention.sliding_window"))?;
        let sliding_window = window.unwrap_or(if gemma2 { 4096 } else { 0 }) as usize;
        if sliding_window == 0 {
            return Ok(Gemma {
                attn_softcap,
                final_softcap,
                ..Gemma::default()
            });
        }
        // Every `n`th block is global, the others local (2 for Gemma 2, 6 for Gemma 3), or a
        // file's own list of which are local.
        let pattern_key = key("attention.sliding_window_pattern");
        let swa_layers = match m.get(&pattern_key) {
            Some(crate::gguf::Value::Array(items)) => {
                let local: Option<Vec<bool>> = items
                    .iter()
                    .map(|v| match v {
                        crate::gguf::Value::Bool(b) => Some(*b),
                        _ => None,
                    })
                    .collect();
                match local {
                    Some(l) if l.len() >= n_layers => l[..n_layers].to_vec(),
                    _ => {
                        return Err(ModelError::BadShape(format!(
                            "{pattern_key} is not a list of {n_layers} booleans"
                        )));
                    }
                }
            }
            _ => {
                let n = m
                    .opt_u32(&pattern_key)?
                    .unwrap_or(if gemma2 { 2 } else { 6 }) as usize;
                (0..n_layers).map(|l| n == 0 || l % n < n - 1).collect()
            }
        };
        let rope_base_swa = m.opt_f32(&key("rope.freq_base_swa"))?.unwrap_or(if gemma2 {
            rope_base
        } else {
            10_000.0
        });
        Ok(Gemma {
            attn_softcap,
            final_softcap,
            sliding_window,
            swa_layers,
            rope_base_swa,
        })
    }
}

/// Tensor names of one block.
pub(crate) fn block_tensor(layer: usize, part: &str) -> String {
    format!("blk.{layer}.{part}.weight")
}

/// A block's bias vector for the product `part`.
pub(crate) fn block_bias(layer: usize, part: &str) -> String {
    format!("blk.{layer}.{part}.bias")
}

/// Llama 3.1's RoPE frequency divisors, one per rotated pair, shared by every block.
pub(crate) const ROPE_FREQS: &str = "rope_freqs.weight";

/// The weight types a synthetic model uses: Q4_1 matrices, a Q8_0 embedding, like the
/// default model.
pub const SYNTHETIC_WEIGHT_TYPE: GgmlType = GgmlType::Q4_1;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{BytesGguf, TensorSource, Value};
    use crate::model::tiny::tiny_model;

    fn tiny(arch: &str) -> GgufFile {
        let bytes = tiny_model(arch, 3).expect("a tiny family");
        BytesGguf::new(bytes).expect("parses").gguf().clone()
    }

    fn refusal(file: &GgufFile) -> String {
        match ModelConfig::from_gguf(file) {
            Err(e @ ModelError::UnsupportedArchitecture { .. }) => e.to_string(),
            other => panic!("not refused as an architecture: {other:?}"),
        }
    }

    #[test]
    fn unsupported_architectures_are_refused_by_name() {
        let mut f = tiny("llama");
        f.metadata
            .insert("general.architecture", Value::String("qwen3moe".into()));
        let e = refusal(&f);
        assert!(
            e.contains("'qwen3moe'") && e.contains("mixture-of-experts"),
            "{e}"
        );
        f.metadata
            .insert("general.architecture", Value::String("mamba".into()));
        assert!(refusal(&f).contains("recurrent"));
        f.metadata
            .insert("general.architecture", Value::String("bert".into()));
        let e = refusal(&f);
        assert!(
            e.contains("'bert'") && e.contains("not one Cairn runs"),
            "{e}"
        );
    }

    #[test]
    fn a_llama_file_with_experts_is_refused_as_moe() {
        let mut f = tiny("llama");
        f.metadata.insert("llama.expert_count", Value::U32(8));
        let e = refusal(&f);
        assert!(e.contains("'llama'") && e.contains("8 experts"), "{e}");
        f.metadata.insert("llama.expert_count", Value::U32(0));
        assert!(ModelConfig::from_gguf(&f).is_ok());
    }

    #[test]
    fn a_sliding_window_bounds_a_llama_files_context() {
        let mut f = tiny("llama");
        f.metadata
            .insert("llama.attention.sliding_window", Value::U32(100));
        let cfg = ModelConfig::from_gguf(&f).expect("config");
        assert_eq!(cfg.context_length, 100);
        f.metadata
            .insert("llama.attention.sliding_window", Value::U32(4096));
        assert_eq!(
            ModelConfig::from_gguf(&f).expect("config").context_length,
            256
        );
        let mut p = tiny("phi3");
        p.metadata
            .insert("phi3.attention.sliding_window", Value::U32(100));
        assert_eq!(
            ModelConfig::from_gguf(&p).expect("config").context_length,
            256
        );
    }

    /// Where a Gemma file is silent, llama.cpp's defaults: Gemma 2 caps at 50 and 30 and
    /// windows every other block at 4096 with the global rope base; Gemma 3 without a window
    /// has no local blocks and no caps. A file's pattern, as a count or a list, wins.
    #[test]
    fn gemma_metadata_defaults_are_llama_cpps() {
        let mut g2 = tiny("gemma2");
        for k in [
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "attention.sliding_window",
        ] {
            g2.metadata.0.remove(&format!("gemma2.{k}"));
        }
        let c = ModelConfig::from_gguf(&g2).expect("config");
        assert_eq!((c.attn_softcap, c.final_softcap), (50.0, 30.0));
        assert_eq!(
            (c.sliding_window, c.layer_window(0), c.layer_window(1)),
            (4096, 4096, 0)
        );
        assert_eq!(c.rope_base_swa, c.rope_base);
        g2.metadata
            .insert("gemma2.rope.freq_base_swa", Value::F32(500.0));
        g2.metadata
            .insert("gemma2.attention.sliding_window_pattern", Value::U32(1));
        let c = ModelConfig::from_gguf(&g2).expect("config");
        assert_eq!(c.swa_layers, [false, false]);
        g2.metadata.insert(
            "gemma2.attention.sliding_window_pattern",
            Value::Array(vec![Value::Bool(false), Value::Bool(true)]),
        );
        let c = ModelConfig::from_gguf(&g2).expect("config");
        assert_eq!(
            (c.layer_rope_base(0), c.layer_rope_base(1)),
            (c.rope_base, 500.0)
        );
        g2.metadata.insert(
            "gemma2.attention.sliding_window_pattern",
            Value::Array(vec![Value::Bool(false)]),
        );
        assert!(ModelConfig::from_gguf(&g2).is_err());

        let mut g3 = tiny("gemma3");
        g3.metadata.0.remove("gemma3.attention.sliding_window");
        let c = ModelConfig::from_gguf(&g3).expect("config");
        assert!(c.swa_layers.is_empty() && c.layer_window(0) == 0);
        assert_eq!((c.attn_softcap, c.final_softcap), (0.0, 0.0));
        assert_eq!(c.layer_rope_base(0), c.rope_base);
        g3.metadata
            .insert("gemma3.final_logit_softcapping", Value::F32(30.0));
        assert_eq!(
            ModelConfig::from_gguf(&g3).expect("config").final_softcap,
            30.0
        );
    }

    /// Gemma's 27B models scale scores by their width per head, the others by head size.
    #[test]
    fn gemma_27b_scales_attention_by_width_per_head() {
        let mut c = ModelConfig::from_gguf(&tiny("gemma3")).expect("config");
        assert_eq!(c.attn_scale(), 1.0 / 128f32.sqrt());
        c.n_layers = 62;
        assert_eq!(c.attn_scale(), 1.0 / 64f32.sqrt());
        c.family = Family::Qwen3;
        assert_eq!(c.attn_scale(), 1.0 / 128f32.sqrt());
    }

    #[test]
    fn rope_scaling_other_than_llama3_is_refused() {
        let mut f = tiny("qwen2");
        f.metadata
            .insert("qwen2.rope.scaling.type", Value::String("yarn".into()));
        assert!(refusal(&f).contains("yarn"));
        f.metadata
            .insert("qwen2.rope.scaling.type", Value::String("none".into()));
        assert!(ModelConfig::from_gguf(&f).is_ok());
    }
}

//! Which GGUF architectures Cairn runs, and why it refuses the others.
//!
//! Every supported family is a dense decoder with llama's block (RMS norms, grouped-query
//! attention with rotary positions, a gated FFN); they differ in the rotation's pairing,
//! optional Q/K/V biases, per-head Q/K norms and fused tensors, which the file's tensors and
//! [`Family`] tell apart, and Gemma's further differences (see [`Family::gemma`]).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// `llama` and `mistral`: adjacent-pair RoPE (their Q/K rows are permuted at conversion).
    #[default]
    Llama,
    /// `qwen2`: Q/K/V biases, NEOX RoPE.
    Qwen2,
    /// `qwen3`: per-head Q/K RMS norms, NEOX RoPE, head size from `attention.key_length`.
    Qwen3,
    /// `phi3`: fused QKV and gate/up tensors, NEOX RoPE.
    Phi3,
    /// `gemma2`: Gemma's block, alternating sliding-window and global layers, soft-capped
    /// attention scores and logits.
    Gemma2,
    /// `gemma3`: Gemma's block with per-head Q/K norms, five sliding-window layers to one
    /// global, a rope base of its own for the local layers.
    Gemma3,
}

impl Family {
    /// The family of GGUF architecture `arch`, or why it is refused.
    pub fn of(arch: &str) -> Result<Family, String> {
        match arch {
            "llama" | "mistral" => Ok(Family::Llama),
            "qwen2" => Ok(Family::Qwen2),
            "qwen3" => Ok(Family::Qwen3),
            "phi3" => Ok(Family::Phi3),
            "gemma2" => Ok(Family::Gemma2),
            "gemma3" => Ok(Family::Gemma3),
            _ => Err(refusal(arch).to_string()),
        }
    }

    /// Whether the rotation pairs `(i, i + d/2)` (GGML's NEOX mode) rather than `(2i, 2i+1)`.
    pub fn neox_rope(self) -> bool {
        !matches!(self, Family::Llama)
    }

    /// Gemma's block: the embedding scaled by sqrt(width), RMS norms after attention and after
    /// the FFN (`post_attention_norm`, `post_ffw_norm`) before each residual add, and a GELU-gated
    /// FFN. Its norm weights are used as stored: the converter has folded Gemma's `1 + w`.
    pub fn gemma(self) -> bool {
        matches!(self, Family::Gemma2 | Family::Gemma3)
    }
}

/// Why an architecture Cairn does not run is refused, for the message that names it.
fn refusal(arch: &str) -> &'static str {
    const MOE: &[&str] = &[
        "qwen2moe",
        "qwen3moe",
        "deepseek",
        "deepseek2",
        "mixtral",
        "phimoe",
        "dbrx",
        "olmoe",
        "grok",
        "arctic",
        "gpt-oss",
        "granitemoe",
        "llama4",
        "bailingmoe",
        "dots1",
        "hunyuan-moe",
        "ernie4_5-moe",
    ];
    const RECURRENT: &[&str] = &[
        "mamba",
        "mamba2",
        "rwkv6",
        "rwkv6qwen2",
        "rwkv7",
        "arwkv7",
        "qwen3next",
        "jamba",
        "granitehybrid",
        "falcon-h1",
        "lfm2",
        "plamo2",
        "nemotron_h",
    ];
    if MOE.contains(&arch) {
        "a mixture-of-experts architecture; Cairn runs dense models only"
    } else if RECURRENT.contains(&arch) {
        "a recurrent or hybrid linear-attention architecture; Cairn runs attention-only models"
    } else {
        "not one Cairn runs (it runs llama, mistral, qwen2, qwen3, phi3, gemma2 and gemma3)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_architectures_map_to_their_family() {
        assert_eq!(Family::of("mistral"), Ok(Family::Llama));
        assert_eq!(Family::of("qwen3"), Ok(Family::Qwen3));
        assert!(!Family::Llama.neox_rope());
        assert!(Family::Phi3.neox_rope());
        assert_eq!(Family::of("gemma3"), Ok(Family::Gemma3));
        assert!(Family::Gemma2.gemma() && Family::Gemma2.neox_rope());
        assert!(!Family::Qwen3.gemma());
    }

    #[test]
    fn refusals_say_what_kind_of_model_it_is() {
        assert!(
            Family::of("qwen3moe")
                .unwrap_err()
                .contains("mixture-of-experts")
        );
        assert!(Family::of("rwkv7").unwrap_err().contains("recurrent"));
        assert!(
            Family::of("bert")
                .unwrap_err()
                .contains("not one Cairn runs")
        );
    }
}

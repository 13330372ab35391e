//! Tiny random-weight models of each supported family, written deterministically, so tests
//! can compare Cairn's logits with llama.cpp's on the same file (tests/tests/model.rs,
//! tools/reference/family_logits.py). `cargo run -p cairn-engine --example tiny_model --
//! FAMILY OUT.gguf` writes one out.
//!
//! Shapes are the smallest that keep every weight format's rows whole (K-quant rows are
//! multiples of 256), with grouped-query attention, two blocks, and each family's own
//! tensors: Llama 3.1's `rope_freqs`, Qwen2's Q/K/V biases and untied head, Qwen3's per-head
//! norms with a head size other than width / heads, Phi-3's fused QKV and gate/up, Gemma's
//! post norms and GELU FFN with Gemma 2's soft caps and alternating windowed layers and Gemma
//! 3's per-head norms and five windowed layers to one global (six blocks, so one is global).
//! Windows are short enough that the tests' 16 positions pass them. Matrices mix Q8_0, Q4_K
//! and F32 so every format the test covers is in every file.

use super::config::{ROPE_FREQS, block_bias, block_tensor};
use crate::gguf::{GgufWriter, Value};
use crate::quant::{GgmlType, quantize_row};

/// The families [`tiny_model`] writes, by GGUF architecture name.
pub const TINY_FAMILIES: &[&str] = &["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"];

pub const TINY_VOCAB: usize = 320;
const DIM: usize = 256;
const FFN: usize = 512;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const LAYERS: usize = 2;
/// Gemma 3's default pattern has one global block in six.
const GEMMA3_LAYERS: usize = 6;
/// Gemma's sliding window in the tiny files.
const WINDOW: u32 = 5;

struct Rng(u64);

impl Rng {
    /// Uniform in [-1, 1) (splitmix64: the same stream on every platform).
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize, scale: f32, offset: f32) -> Vec<f32> {
        (0..n).map(|_| offset + scale * self.next()).collect()
    }
}

struct Writer {
    w: GgufWriter,
    rng: Rng,
}

impl Writer {
    fn matrix(&mut self, name: String, rows: usize, cols: usize, ty: GgmlType, gain: f32) {
        let v = self.rng.vec(rows * cols, gain / (cols as f32).sqrt(), 0.0);
        let data: Vec<u8> = v
            .chunks_exact(cols)
            .flat_map(|r| quantize_row(ty, r))
            .collect();
        self.w
            .add_tensor(name, &[cols as u64, rows as u64], ty, data);
    }

    fn vector(&mut self, name: String, len: usize, scale: f32, offset: f32) {
        let v = self.rng.vec(len, scale, offset);
        let data = quantize_row(GgmlType::F32, &v);
        self.w.add_tensor(name, &[len as u64], GgmlType::F32, data);
    }
}

/// A GGUF file of a tiny random model of architecture `arch` (one of [`TINY_FAMILIES`]), the
/// same bytes for the same arguments; `None` for another architecture.
pub fn tiny_model(arch: &str, seed: u64) -> Option<Vec<u8>> {
    if !TINY_FAMILIES.contains(&arch) {
        return None;
    }
    let head_dim = if matches!(arch, "qwen3" | "gemma3") {
        128
    } else {
        DIM / HEADS
    };
    let gemma = arch.starts_with("gemma");
    let layers = if arch == "gemma3" {
        GEMMA3_LAYERS
    } else {
        LAYERS
    };
    let (q, kv) = (HEADS * head_dim, KV_HEADS * head_dim);
    let mut t = Writer {
        w: GgufWriter::new(),
        rng: Rng(seed),
    };
    let w = &mut t.w;
    w.add("general.architecture", arch)
        // Not the family's name: llama.cpp gives vocabularies of models named "phi3" special
        // tokens this stand-in lacks.
        .add("general.name", "cairn tiny model")
        .add(format!("{arch}.block_count"), layers as u32)
        .add(format!("{arch}.context_length"), 256u32)
        .add(format!("{arch}.embedding_length"), DIM as u32)
        .add(format!("{arch}.feed_forward_length"), FFN as u32)
        .add(format!("{arch}.attention.head_count"), HEADS as u32)
        .add(format!("{arch}.attention.head_count_kv"), KV_HEADS as u32)
        .add(format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-6f32)
        // A low base turns even the slow pairs within 16 positions, so a wrong pairing or a
        // missing frequency factor moves the logits well past the tolerance.
        .add(format!("{arch}.rope.freq_base"), 100.0f32)
        .add(format!("{arch}.rope.dimension_count"), head_dim as u32);
    if matches!(arch, "qwen3" | "gemma3") {
        w.add(format!("{arch}.attention.key_length"), head_dim as u32)
            .add(format!("{arch}.attention.value_length"), head_dim as u32);
    }
    if gemma {
        // Gemma 3's local rope base is llama.cpp's default (10000, no key), unlike the global.
        w.add(format!("{arch}.attention.sliding_window"), WINDOW);
    }
    if arch == "gemma2" {
        // Caps low enough to bend these scores and logits (the real ones are 50 and 30).
        w.add(format!("{arch}.attn_logit_softcapping"), 2.0f32)
            .add(format!("{arch}.final_logit_softcapping"), 15.0f32);
    }
    // A stand-in vocabulary: token ids are what the tests send. llama.cpp's BPE loader wants
    // merges, so there is one.
    w.add("tokenizer.ggml.model", "gpt2")
        .add("tokenizer.ggml.pre", "default")
        .add(
            "tokenizer.ggml.tokens",
            Value::Array(
                (0..TINY_VOCAB)
                    .map(|i| Value::String(format!("<{i}>")))
                    .collect(),
            ),
        )
        .add(
            "tokenizer.ggml.merges",
            Value::Array(vec![Value::String("< 1>".into())]),
        )
        .add("tokenizer.ggml.bos_token_id", 0u32)
        .add("tokenizer.ggml.eos_token_id", 1u32)
        .add("tokenizer.ggml.add_bos_token", false);

    let (q8, q4k) = (GgmlType::Q8_0, GgmlType::Q4_K);
    // Gains put the blocks' contributions above the embedding's, so a tied head does not just
    // echo the input token, and spread the logits so most top-2 margins pass 0.3.
    // Gemma multiplies the embedding by sqrt(DIM) = 16 and its head is the same table: a
    // smaller table, larger post norms and a larger final norm keep its logits from echoing
    // the input token.
    let (embd_gain, head_norm) = if gemma { (1.0, 8.0) } else { (4.0, 1.0) };
    t.matrix("token_embd.weight".into(), TINY_VOCAB, DIM, q4k, embd_gain);
    if arch == "llama" {
        // Llama 3.1's divisors: 1 for fast pairs, up to 8 for slow ones.
        let f: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0 + 7.0 * (i as f32 / (head_dim / 2 - 1) as f32).powi(2))
            .collect();
        t.w.add_tensor(
            ROPE_FREQS,
            &[f.len() as u64],
            GgmlType::F32,
            quantize_row(GgmlType::F32, &f),
        );
    }
    for l in 0..layers {
        let b = |p: &str| block_tensor(l, p);
        t.vector(b("attn_norm"), DIM, 0.2, 1.0);
        if arch == "phi3" {
            t.matrix(b("attn_qkv"), q + 2 * kv, DIM, q8, 1.0);
        } else {
            t.matrix(b("attn_q"), q, DIM, q8, 1.0);
            t.matrix(b("attn_k"), kv, DIM, q4k, 1.0);
            t.matrix(b("attn_v"), kv, DIM, q8, 1.0);
        }
        if arch == "qwen2" {
            t.vector(block_bias(l, "attn_q"), q, 0.5, 0.0);
            t.vector(block_bias(l, "attn_k"), kv, 0.5, 0.0);
            t.vector(block_bias(l, "attn_v"), kv, 0.5, 0.0);
        }
        if matches!(arch, "qwen3" | "gemma3") {
            t.vector(b("attn_q_norm"), head_dim, 0.3, 1.0);
            t.vector(b("attn_k_norm"), head_dim, 0.3, 1.0);
        }
        t.matrix(b("attn_output"), DIM, q, q4k, 3.0);
        if gemma {
            t.vector(b("post_attention_norm"), DIM, 0.5, 2.5);
        }
        t.vector(b("ffn_norm"), DIM, 0.2, 1.0);
        if arch == "phi3" {
            t.matrix(b("ffn_up"), 2 * FFN, DIM, q4k, 1.0);
        } else {
            t.matrix(b("ffn_gate"), FFN, DIM, q4k, 1.0);
            t.matrix(b("ffn_up"), FFN, DIM, q8, 1.0);
        }
        t.matrix(b("ffn_down"), DIM, FFN, q4k, 3.0);
        if gemma {
            t.vector(b("post_ffw_norm"), DIM, 0.5, 2.5);
        }
    }
    t.vector("output_norm.weight".into(), DIM, 0.2 * head_norm, head_norm);
    if matches!(arch, "qwen2" | "phi3") {
        t.matrix("output.weight".into(), TINY_VOCAB, DIM, GgmlType::F32, 6.0);
    }
    Some(t.w.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{BytesGguf, TensorSource};
    use crate::model::ModelConfig;
    use crate::model::family::Family;

    #[test]
    fn every_tiny_family_reads_back_with_its_features() {
        let cfg = |arch: &str| {
            let file = BytesGguf::new(tiny_model(arch, 5).expect("a tiny family")).expect("parses");
            ModelConfig::from_gguf(file.gguf()).expect("config")
        };
        let llama = cfg("llama");
        assert!(llama.rope_freqs && llama.tied_output && !llama.rope_neox);
        let qwen2 = cfg("qwen2");
        assert!(qwen2.qkv_bias && !qwen2.tied_output && qwen2.rope_neox);
        let qwen3 = cfg("qwen3");
        assert_eq!(
            (qwen3.family, qwen3.head_dim, qwen3.q_dim()),
            (Family::Qwen3, 128, 512)
        );
        assert!(qwen3.qk_norm && !qwen3.qkv_bias);
        let phi3 = cfg("phi3");
        assert!(phi3.fused_qkv && phi3.fused_gate_up && phi3.rope_neox);
        assert_eq!(tiny_model("llama", 5), tiny_model("llama", 5));
        assert_ne!(tiny_model("llama", 5), tiny_model("llama", 6));
        let gemma2 = cfg("gemma2");
        assert_eq!(gemma2.swa_layers, [true, false]);
        assert_eq!((gemma2.attn_softcap, gemma2.final_softcap), (2.0, 15.0));
        assert_eq!(gemma2.layer_rope_base(0), gemma2.rope_base);
        let gemma3 = cfg("gemma3");
        assert_eq!(gemma3.swa_layers, [true, true, true, true, true, false]);
        assert_eq!(
            (gemma3.layer_window(4), gemma3.layer_window(5)),
            (WINDOW, 0)
        );
        assert_eq!(
            (gemma3.layer_rope_base(0), gemma3.layer_rope_base(5)),
            (10_000.0, 100.0)
        );
        assert!(gemma3.qk_norm && gemma3.attn_softcap == 0.0 && gemma3.final_softcap == 0.0);
        assert!(tiny_model("gemma4", 5).is_none());
    }

    /// Partial fetching and weight accounting go by `shard_tensors`: for each family it names
    /// every tensor of the file, with its shape, and nothing else.
    #[test]
    fn shard_tensors_list_each_familys_file_exactly() {
        use crate::model::weights::shard_tensors;
        for arch in TINY_FAMILIES {
            let file = BytesGguf::new(tiny_model(arch, 2).expect("a tiny family")).expect("parses");
            let cfg = ModelConfig::from_gguf(file.gguf()).expect("config");
            let mut listed: Vec<(String, u64)> = shard_tensors(&cfg, 0, cfg.n_layers)
                .into_iter()
                .map(|(n, r, c)| (n, (r * c) as u64))
                .collect();
            let mut held: Vec<(String, u64)> = file
                .gguf()
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.n_elements))
                .collect();
            listed.sort();
            held.sort();
            assert_eq!(listed, held, "{arch}");
            // A later shard needs the shared rope factors too.
            let tail = shard_tensors(&cfg, 1, cfg.n_layers);
            assert_eq!(
                tail.iter().any(|(n, _, _)| n == "rope_freqs.weight"),
                cfg.rope_freqs,
                "{arch}"
            );
        }
    }
}

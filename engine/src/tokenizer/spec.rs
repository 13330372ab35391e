//! The tokenizer's description as a model file carries it, independent of the file format.

/// Everything needed to build a [`super::Tokenizer`], as read from a GGUF file's
/// `tokenizer.ggml.*` and `tokenizer.chat_template` metadata.
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `gpt2` for byte-level BPE, `llama` for SentencePiece.
    pub model: String,
    /// `tokenizer.ggml.pre`, e.g. `smollm`; empty when absent.
    pub pre: String,
    /// `tokenizer.ggml.tokens`: the token strings in id order.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte); empty when absent.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`: "left right" pairs in rank order.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.scores`: SentencePiece merge priorities, one per token; empty when absent.
    pub scores: Vec<f32>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    /// Further end-of-generation ids (`eot`, `eom`) where the file names them.
    pub eot_id: Option<u32>,
    pub unknown_id: Option<u32>,
    pub padding_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`; llama.cpp's default when absent is model-dependent.
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix`: SentencePiece's leading `▁` (default on for `llama`).
    pub add_space_prefix: Option<bool>,
    /// `general.name`: llama.cpp keys a few per-model token rules on it (Phi-3's special
    /// tokens eat the whitespace after them).
    pub name: String,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

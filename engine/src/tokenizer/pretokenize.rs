//! Pre-tokenizer selection: which regexes split text into words before BPE, per
//! `tokenizer.ggml.pre`, following llama.cpp's table so that ids match it exactly.

use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::tokenizer::SplitDelimiterBehavior;

use super::TokenizerError;

/// The original GPT-2 word regex.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3's regex in llama.cpp's spelling: the case-insensitive contractions written out
/// as classes, which is what llama.cpp matches.
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How a supported pre-tokenizer type behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PreType {
    /// Regexes applied one after another, each splitting the pieces the previous one left;
    /// matches and the text between them both become pieces.
    pub regexes: &'static [&'static str],
    /// Whole words found in the vocabulary skip the merges (Llama 3).
    pub ignore_merges: bool,
    /// llama.cpp's `add_bos` when the file does not say.
    pub default_add_bos: bool,
}

const DEFAULT: PreType = PreType {
    // llama.cpp's fallback for BPE files without (or with the literal "default") pre type.
    regexes: &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    ignore_merges: false,
    default_add_bos: false,
};

const GPT2_TYPE: PreType = PreType {
    regexes: &[GPT2],
    ignore_merges: false,
    default_add_bos: false,
};

const SMOLLM: PreType = PreType {
    // Every digit is a word of its own, then GPT-2's split on what remains.
    regexes: &[r"\p{N}", GPT2],
    ignore_merges: false,
    default_add_bos: false,
};

const LLAMA3_TYPE: PreType = PreType {
    regexes: &[LLAMA3],
    ignore_merges: true,
    default_add_bos: true,
};

const LLAMA3_REGEX_ONLY: PreType = PreType {
    regexes: &[LLAMA3],
    ignore_merges: false,
    default_add_bos: false,
};

impl PreType {
    /// Maps a `tokenizer.ggml.pre` value to its behaviour, with llama.cpp's aliases.
    /// Unknown names are refused rather than silently tokenized differently from llama.cpp.
    pub fn from_name(name: &str) -> Result<PreType, TokenizerError> {
        Ok(match name {
            // A missing key: llama.cpp falls back to its default regexes.
            "" | "default" => DEFAULT,
            "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" => GPT2_TYPE,
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" => SMOLLM,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" => LLAMA3_TYPE,
            "dbrx" | "smaug-bpe" => LLAMA3_REGEX_ONLY,
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        })
    }

    /// The `tokenizers` pipeline: the regex splits, then the byte-to-character mapping
    /// (no regex of its own) that byte-level BPE vocabularies are written in.
    pub fn build(&self) -> Result<PreTokenizerWrapper, TokenizerError> {
        let mut steps = Vec::with_capacity(self.regexes.len() + 1);
        for re in self.regexes {
            let split = Split::new(
                SplitPattern::Regex((*re).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::Library(format!("pre-tokenizer regex {re:?}: {e}")))?;
            steps.push(PreTokenizerWrapper::Split(split));
        }
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, false, false,
        )));
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(steps)))
    }
}

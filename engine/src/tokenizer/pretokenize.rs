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

/// Qwen2's regex in llama.cpp's spelling: Llama 3's with single digits.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 3.5's: Qwen2's with combining marks (`\p{M}`) kept inside words.
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The `tokenizer.ggml.pre` names [`PreType::from_name`] accepts, for error messages.
pub(crate) const SUPPORTED: &str = "default, gpt-2, llama3/llama-bpe, smollm, qwen2, qwen35, \
     deepseek-llm, deepseek-coder, falcon, starcoder, refact, command-r, mpt and their llama.cpp aliases";

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

const QWEN2_TYPE: PreType = PreType {
    regexes: &[QWEN2],
    ignore_merges: false,
    default_add_bos: false,
};

const QWEN35_TYPE: PreType = PreType {
    regexes: &[QWEN35],
    ignore_merges: false,
    default_add_bos: false,
};

/// DeepSeek's CJK and Hangul runs (U+0800 to U+4E00 included, as the original has it).
const CJK: &str = "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+";

const DEEPSEEK_LLM: PreType = PreType {
    // Newlines alone; Latin, Greek, Cyrillic and other cased letters (with one leading space);
    // ASCII and full-width punctuation; trailing whitespace; CJK and Hangul runs; digit runs.
    regexes: &[
        r"[\r\n]",
        // Written with escapes: editors and tools normalise some of these letters (U+1F7D to
        // U+03CE, say), which would turn a range around.
        "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\
         \u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\
         \u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\
         \u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\
         \u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\
         \u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\
         \u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\
         \u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\
         \u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\
         \u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\
         \u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\
         \u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\
         \u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\
         \u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\
         \u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\
         \u{1E900}-\u{1E943}]+",
        "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
        r"\s+$",
        CJK,
        r"\p{N}+",
    ],
    ignore_merges: false,
    default_add_bos: false,
};

const DEEPSEEK_CODER: PreType = PreType {
    regexes: &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, r"\p{N}"],
    ignore_merges: false,
    default_add_bos: false,
};

const FALCON: PreType = PreType {
    regexes: &[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
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
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2"
            | "hunyuan" | "solar-open" => QWEN2_TYPE,
            "qwen35" => QWEN35_TYPE,
            "deepseek-llm" => DEEPSEEK_LLM,
            "deepseek-coder" => DEEPSEEK_CODER,
            "falcon" => FALCON,
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

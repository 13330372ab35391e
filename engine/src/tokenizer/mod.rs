//! Tokenizer built from model metadata, and chat-template rendering.
//!
//! Byte-level BPE (`tokenizer.ggml.model = gpt2`) with llama.cpp's pre-tokenizers (see
//! pretokenize.rs for the list), and SentencePiece (`llama`) with byte fallback (spm.rs). The
//! BPE model and the regex splits come from the `tokenizers` crate; special-token handling,
//! the end-of-generation set and detokenization follow llama.cpp, whose ids are the reference
//! (tests/data/reference.json for the default model, llama.cpp's own vocabulary test files
//! for the other families: engine/tests/vocab.rs). See docs/tokenizer.md.

mod bytes;
mod chat;
mod pretokenize;
mod spec;
mod spm;
mod stream;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};

use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{Model as _, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

pub use chat::ChatMessage;
pub use spec::TokenizerSpec;
pub use stream::StreamDecoder;

use bytes::ByteDecoder;
use pretokenize::PreType;
use spm::Spm;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "unsupported tokenizer model '{0}': supported are byte-level BPE ('gpt2'), SentencePiece ('llama') and Gemma 4's BPE ('gemma4')"
    )]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer type '{0}': supported are {list}", list = pretokenize::SUPPORTED)]
    UnsupportedPreTokenizer(String),
    #[error("the tokenizer has no tokens")]
    EmptyVocabulary,
    #[error("tokenizer.ggml.token_type has {types} entries but there are {tokens} tokens")]
    TokenTypeCount { types: usize, tokens: usize },
    #[error("token id {id} is out of range (the vocabulary has {vocab_size} tokens)")]
    TokenOutOfRange { id: u32, vocab_size: usize },
    #[error("tokenizer: {0}")]
    Library(String),
    #[error(
        "the model has no chat template (tokenizer.chat_template) and no ChatML tokens to fall back on; use raw mode"
    )]
    NoChatTemplate,
    #[error("chat template: {0}")]
    Template(String),
}

/// A token's role, from `tokenizer.ggml.token_type` plus llama.cpp's corrections by text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
    Undefined,
}

impl Kind {
    fn from_gguf(t: i32) -> Kind {
        match t {
            1 => Kind::Normal,
            2 => Kind::Unknown,
            3 => Kind::Control,
            4 => Kind::UserDefined,
            5 => Kind::Unused,
            6 => Kind::Byte,
            _ => Kind::Undefined,
        }
    }

    /// Matched as a whole in text before BPE (control and unknown ones only when special
    /// tokens are parsed).
    fn is_special(self) -> bool {
        matches!(self, Kind::Control | Kind::UserDefined | Kind::Unknown)
    }
}

/// Token texts llama.cpp treats as end of generation whatever their declared type.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// End-of-turn texts llama.cpp looks for when the file names no `eot` token.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle pad / repository / file-separator texts: llama.cpp stops on these.
const FIM_EOG_TEXTS: &[&str] = &[
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// Fill-in-the-middle prefix / suffix / middle texts: llama.cpp makes these control tokens.
const FIM_CONTROL_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
];

/// How text between special tokens becomes ids.
enum Model {
    /// Byte-level BPE: regex splits, then rank-ordered merges per piece.
    Bpe { pre: PreTokenizerWrapper, bpe: BPE },
    /// SentencePiece: spaces as `▁`, one leading `▁` at the start and after each special
    /// token when `add_space_prefix`, then score-ordered merges over the whole fragment.
    Spm { spm: Spm, add_space_prefix: bool },
    /// Gemma 4's BPE over raw UTF-8 (`tokenizer.ggml.model = gemma4`): spaces as `▁`, text
    /// cut only between newline runs and the rest, rank-ordered merges, `<0xXX>` byte fallback.
    RawBpe { bpe: BPE },
}

/// The `tokenizer.ggml.model` families, before their models are built.
enum Family {
    ByteBpe(PreType),
    Spm,
    RawBpe,
}

/// A tokenizer for one model: encoding, decoding, and its chat template.
pub struct Tokenizer {
    tokens: Vec<String>,
    kinds: Vec<Kind>,
    /// The bytes each token decodes to (special tokens as their text), precomputed.
    pieces: Vec<Box<[u8]>>,
    /// Tokens matched whole in text, longest first (llama.cpp's order).
    specials: Vec<u32>,
    /// Special tokens that swallow the whitespace after them (Phi-3, as llama.cpp does).
    rstrip: HashSet<u32>,
    model: Model,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: HashSet<u32>,
    add_bos: bool,
    add_eos: bool,
    template: Option<String>,
    chatml_fallback: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("has_chat_template", &self.template.is_some())
            .finish_non_exhaustive()
    }
}

enum Fragment {
    Text(std::ops::Range<usize>),
    Token(u32),
}

impl Tokenizer {
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        let family = match spec.model.as_str() {
            "gpt2" => Family::ByteBpe(PreType::from_name(&spec.pre)?),
            // SentencePiece files carry no pre-tokenizer (or "default"); llama.cpp ignores it.
            "llama" => Family::Spm,
            "gemma4" => Family::RawBpe,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        if spec.tokens.is_empty() {
            return Err(TokenizerError::EmptyVocabulary);
        }
        let n = spec.tokens.len();
        if !spec.token_types.is_empty() && spec.token_types.len() != n {
            return Err(TokenizerError::TokenTypeCount {
                types: spec.token_types.len(),
                tokens: n,
            });
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::Library(format!(
                "{n} tokens do not fit 32-bit ids"
            )));
        }

        // An empty string would match everywhere; llama.cpp renames such entries the same way.
        let tokens: Vec<String> = spec
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.clone()
                }
            })
            .collect();
        let mut kinds: Vec<Kind> = if spec.token_types.is_empty() {
            vec![Kind::Normal; n]
        } else {
            spec.token_types
                .iter()
                .map(|&t| Kind::from_gguf(t))
                .collect()
        };

        // Later duplicates win, as in llama.cpp's text-to-id map.
        let mut by_text: HashMap<&str, u32> = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            by_text.insert(t.as_str(), i as u32);
        }

        let valid = |id: Option<u32>, what: &str| -> Option<u32> {
            match id {
                Some(i) if (i as usize) < n => Some(i),
                Some(i) => {
                    tracing::warn!("tokenizer: {what} id {i} is out of range; ignored");
                    None
                }
                None => None,
            }
        };
        let bos = valid(spec.bos_id, "bos");
        let eos = valid(spec.eos_id, "eos");
        let eot = valid(spec.eot_id, "eot");

        // End of generation and control types by token text, as llama.cpp does because
        // converters don't always mark these tokens.
        let mut eog: HashSet<u32> = HashSet::new();
        let mut force_control: Vec<u32> = Vec::new();
        let find = |texts: &[&str], out: &mut Vec<u32>| {
            for t in texts {
                if let Some(&id) = by_text.get(t) {
                    out.push(id);
                }
            }
        };
        let mut eog_found = Vec::new();
        find(EOG_TEXTS, &mut eog_found);
        find(FIM_EOG_TEXTS, &mut eog_found);
        if eot.is_none() {
            find(EOT_TEXTS, &mut eog_found);
        }
        find(FIM_CONTROL_TEXTS, &mut force_control);
        force_control.extend_from_slice(&eog_found);
        eog.extend(eog_found);
        eog.extend(eos);
        eog.extend(eot);
        for id in force_control {
            kinds[id as usize] = Kind::Control;
        }

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| kinds[i as usize].is_special())
            .collect();
        specials.sort_by(|&a, &b| {
            tokens[b as usize]
                .len()
                .cmp(&tokens[a as usize].len())
                .then(a.cmp(&b))
        });

        let rstrip = phi3_rstrip(&spec.name, &tokens, &kinds, &by_text);

        let pieces = match family {
            Family::ByteBpe(_) => bpe_pieces(&tokens, &kinds),
            Family::Spm | Family::RawBpe => spm_pieces(&tokens, &kinds),
        };

        let (model, add_bos) = match family {
            Family::ByteBpe(pre_type) => (
                Model::Bpe {
                    bpe: build_bpe(&tokens, &spec.merges, pre_type.ignore_merges, false)?,
                    pre: pre_type.build()?,
                },
                spec.add_bos.unwrap_or(pre_type.default_add_bos),
            ),
            Family::Spm => (
                Model::Spm {
                    spm: Spm::new(&tokens, &spec.scores, valid(spec.unknown_id, "unknown")),
                    add_space_prefix: spec.add_space_prefix.unwrap_or(true),
                },
                spec.add_bos.unwrap_or(true),
            ),
            // llama.cpp always adds BOS for Gemma 4, whatever the file says.
            Family::RawBpe => (
                Model::RawBpe {
                    bpe: build_bpe(&tokens, &spec.merges, false, true)?,
                },
                true,
            ),
        };

        let template = spec.chat_template.clone().filter(|t| !t.trim().is_empty());
        let chatml_fallback = template.is_none()
            && by_text.contains_key("<|im_start|>")
            && by_text.contains_key("<|im_end|>");

        Ok(Tokenizer {
            add_bos: add_bos && bos.is_some(),
            add_eos: spec.add_eos.unwrap_or(false) && eos.is_some(),
            tokens,
            kinds,
            pieces,
            specials,
            rstrip,
            model,
            bos,
            eos,
            eog,
            template,
            chatml_fallback,
        })
    }

    /// Token ids for `text`, without BOS. With `parse_special`, control-token texts such as
    /// `<|im_start|>` in the text become those tokens; user-defined tokens always do.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        // SentencePiece's leading space goes at the start and after every special token.
        let mut after_special = true;
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(range) => {
                    match &self.model {
                        Model::Bpe { pre, bpe } => bpe_text(pre, bpe, &text[range], &mut out)?,
                        Model::Spm {
                            spm,
                            add_space_prefix,
                        } => {
                            let prefix = *add_space_prefix && after_special;
                            spm.encode(&escape_spaces(&text[range], prefix), &mut out);
                        }
                        Model::RawBpe { bpe } => {
                            raw_bpe_text(bpe, &escape_spaces(&text[range], false), &mut out)?
                        }
                    }
                    after_special = false;
                }
            }
        }
        Ok(out)
    }

    /// The ids to feed the model for a prompt: special tokens parsed, BOS (and EOS) where
    /// the model asks for them. Unless `raw`, the text is first wrapped as a single user
    /// message by the chat template, with the generation prompt.
    pub fn encode_prompt(&self, text: &str, raw: bool) -> Result<Vec<u32>, TokenizerError> {
        if raw {
            self.encode_with_markers(text)
        } else {
            self.encode_chat(&[ChatMessage::new("user", text)])
        }
    }

    /// The ids to feed the model for a conversation: rendered by the chat template with the
    /// generation prompt, then encoded as [`Tokenizer::encode_prompt`] does.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
        let rendered = self.apply_chat_template(messages, true)?;
        let mut body = rendered.as_str();
        // Templates that write BOS/EOS themselves would otherwise get them twice; llama.cpp
        // strips them from the rendered text the same way.
        if self.add_bos
            && let Some(bos) = self.bos
        {
            body = body
                .strip_prefix(self.tokens[bos as usize].as_str())
                .unwrap_or(body);
        }
        if self.add_eos
            && let Some(eos) = self.eos
        {
            body = body
                .strip_suffix(self.tokens[eos as usize].as_str())
                .unwrap_or(body);
        }
        self.encode_with_markers(body)
    }

    /// `text` with special tokens parsed, between BOS and EOS where the model wants them.
    fn encode_with_markers(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        if self.add_bos
            && let Some(bos) = self.bos
        {
            ids.push(bos);
        }
        ids.extend(self.encode(text, true)?);
        if self.add_eos
            && let Some(eos) = self.eos
        {
            ids.push(eos);
        }
        Ok(ids)
    }

    /// The text of `ids`, special tokens included as their text. Bytes that do not form
    /// valid UTF-8 (a sequence cut inside a character) become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The exact bytes of `ids`, for callers that handle partial characters themselves.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::new();
        for &id in ids {
            out.extend_from_slice(self.piece(id)?);
        }
        Ok(out)
    }

    /// The bytes one token stands for.
    pub fn piece(&self, id: u32) -> Result<&[u8], TokenizerError> {
        self.pieces
            .get(id as usize)
            .map(|p| &p[..])
            .ok_or(TokenizerError::TokenOutOfRange {
                id,
                vocab_size: self.tokens.len(),
            })
    }

    /// The token's string as the vocabulary stores it (byte-level alphabet for normal tokens).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Incremental decoding for streaming, emitting text only at character boundaries.
    pub fn decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether BOS is prepended to prompts.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether generation stops at this token: EOS, EOT and the end-of-turn-like control
    /// tokens llama.cpp recognises (e.g. `<|im_end|>`, `<|endoftext|>`).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// All end-of-generation ids, sorted.
    pub fn end_of_generation_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eog.iter().copied().collect();
        v.sort_unstable();
        v
    }

    /// Whether the token is a control token (rendered as its text by [`Self::decode`];
    /// callers that show generated text may want to skip these).
    pub fn is_control(&self, id: u32) -> bool {
        matches!(
            self.kinds.get(id as usize),
            Some(Kind::Control | Kind::Unknown)
        )
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the model carries its own chat template (otherwise ChatML is used if its
    /// tokens exist, or templating fails).
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Renders `messages` with the model's chat template (`bos_token` and `eos_token` are
    /// available to it). Without a template, ChatML is used when the vocabulary has its
    /// tokens; otherwise this is [`TokenizerError::NoChatTemplate`].
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = match (&self.template, self.chatml_fallback) {
            (Some(t), _) => t.as_str(),
            (None, true) => chat::CHATML,
            (None, false) => return Err(TokenizerError::NoChatTemplate),
        };
        let text_of = |id: Option<u32>| {
            id.and_then(|i| self.tokens.get(i as usize))
                .map(String::as_str)
                .unwrap_or("")
        };
        chat::render(
            template,
            messages,
            add_generation_prompt,
            text_of(self.bos),
            text_of(self.eos),
        )
    }

    /// Splits `text` on special-token texts the way llama.cpp does: token by token, longest
    /// first, each one cutting every remaining text fragment at all its occurrences.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut fragments = Vec::new();
        if text.is_empty() {
            return fragments;
        }
        fragments.push(Fragment::Text(0..text.len()));
        for &id in &self.specials {
            let kind = self.kinds[id as usize];
            if !parse_special && kind != Kind::UserDefined {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            // Cheap reject before rebuilding the fragment list.
            if !fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(r) if text[r.clone()].contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let range = match fragment {
                    Fragment::Text(r) => r,
                    token => {
                        next.push(token);
                        continue;
                    }
                };
                let mut last = range.start;
                let rstrip = self.rstrip.contains(&id);
                for (pos, _) in text[range.clone()].match_indices(needle) {
                    let at = range.start + pos;
                    if at < last {
                        continue;
                    }
                    if at > last {
                        next.push(Fragment::Text(last..at));
                    }
                    next.push(Fragment::Token(id));
                    last = at + needle.len();
                    if rstrip {
                        // C's isspace, as llama.cpp strips.
                        let ws = text.as_bytes()[last..range.end]
                            .iter()
                            .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r'))
                            .count();
                        last += ws;
                    }
                }
                if last < range.end {
                    next.push(Fragment::Text(last..range.end));
                }
            }
            fragments = next;
        }
        fragments
    }
}

fn bpe_text(
    pre: &PreTokenizerWrapper,
    bpe: &BPE,
    text: &str,
    out: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    let lib = |e: tokenizers::Error| TokenizerError::Library(e.to_string());
    let mut pts = PreTokenizedString::from(text);
    pre.pre_tokenize(&mut pts).map_err(lib)?;
    pts.tokenize(|word| bpe.tokenize(word.get())).map_err(lib)?;
    for (_, _, tokens) in pts.get_splits(OffsetReferential::Original, OffsetType::None) {
        if let Some(tokens) = tokens {
            out.extend(tokens.iter().map(|t| t.id));
        }
    }
    Ok(())
}

/// Gemma 4's pieces: runs of newlines and runs of anything else, merged one by one; a
/// newline run that is itself a token is taken whole (llama.cpp does the same, because
/// the merges would cut it differently from the model's training).
fn raw_bpe_text(bpe: &BPE, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
    let bytes = text.as_bytes();
    let mut start = 0;
    while start < bytes.len() {
        let newlines = bytes[start] == b'\n';
        let len = bytes[start..]
            .iter()
            .take_while(|&&b| (b == b'\n') == newlines)
            .count();
        let piece = &text[start..start + len];
        start += len;
        if newlines && let Some(id) = bpe.token_to_id(piece) {
            out.push(id);
            continue;
        }
        let tokens = bpe
            .tokenize(piece)
            .map_err(|e| TokenizerError::Library(e.to_string()))?;
        out.extend(tokens.iter().map(|t| t.id));
    }
    Ok(())
}

/// SentencePiece's view of a text: spaces written `▁`, with one more in front if `prefix`.
fn escape_spaces(text: &str, prefix: bool) -> String {
    let mut s = String::with_capacity(text.len() + 3);
    if prefix {
        s.push('▁');
    }
    for c in text.chars() {
        s.push(if c == ' ' { '▁' } else { c });
    }
    s
}

/// What each token decodes to in a byte-level vocabulary.
fn bpe_pieces(tokens: &[String], kinds: &[Kind]) -> Vec<Box<[u8]>> {
    let decoder = ByteDecoder::new();
    tokens
        .iter()
        .zip(kinds)
        .map(|(text, kind)| match kind {
            Kind::Normal => {
                let mut b = Vec::with_capacity(text.len());
                decoder.decode_into(text, &mut b);
                b.into_boxed_slice()
            }
            Kind::Control | Kind::Unknown | Kind::UserDefined => {
                text.as_bytes().to_vec().into_boxed_slice()
            }
            // llama.cpp renders nothing for these in byte-level vocabularies.
            Kind::Unused | Kind::Byte | Kind::Undefined => Box::default(),
        })
        .collect()
}

/// What each token decodes to in a SentencePiece vocabulary: `▁` is a space, `<0xXX>` one byte.
fn spm_pieces(tokens: &[String], kinds: &[Kind]) -> Vec<Box<[u8]>> {
    tokens
        .iter()
        .zip(kinds)
        .map(|(text, kind)| match kind {
            Kind::Normal => text.replace('▁', " ").into_bytes().into_boxed_slice(),
            Kind::Byte => byte_token_value(text)
                .map(|b| vec![b].into_boxed_slice())
                .unwrap_or_default(),
            Kind::Control | Kind::Unknown | Kind::UserDefined => {
                text.as_bytes().to_vec().into_boxed_slice()
            }
            Kind::Unused | Kind::Undefined => Box::default(),
        })
        .collect()
}

/// The byte a `<0xXX>` token stands for.
fn byte_token_value(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// llama.cpp's rule for models named Phi-3: special tokens swallow the whitespace after them
/// (so "<|user|>\nhi" encodes like "<|user|>hi"), except `<unk>`, `<s>` and `<|endoftext|>`;
/// `</s>` does too whatever its type.
fn phi3_rstrip(
    name: &str,
    tokens: &[String],
    kinds: &[Kind],
    by_text: &HashMap<&str, u32>,
) -> HashSet<u32> {
    let name = name.to_lowercase();
    if !(name.contains("phi-3") || name.contains("phi3")) {
        return HashSet::new();
    }
    let mut set: HashSet<u32> = (0..tokens.len() as u32)
        .filter(|&i| kinds[i as usize].is_special())
        .collect();
    set.extend(by_text.get("</s>"));
    for keep in ["<unk>", "<s>", "<|endoftext|>"] {
        if let Some(id) = by_text.get(keep) {
            set.remove(id);
        }
    }
    set
}

/// The BPE model. Merges follow llama.cpp's reading: split at the first space after the
/// first character, first occurrence of a pair wins. Merges naming strings outside the
/// vocabulary can never produce a token and are dropped (the `tokenizers` crate refuses them).
fn build_bpe(
    tokens: &[String],
    merges: &[String],
    ignore_merges: bool,
    byte_fallback: bool,
) -> Result<BPE, TokenizerError> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mut seen: HashSet<(&str, &str)> = HashSet::with_capacity(merges.len());
    let mut pairs = Vec::with_capacity(merges.len());
    let mut dropped = 0usize;
    for m in merges {
        let split = m
            .char_indices()
            .nth(1)
            .and_then(|(start, _)| m[start..].find(' ').map(|p| start + p));
        let Some(at) = split else {
            dropped += 1;
            continue;
        };
        let (a, b) = (&m[..at], &m[at + 1..]);
        let merged = format!("{a}{b}");
        if !vocab.contains_key(a) || !vocab.contains_key(b) || !vocab.contains_key(&merged) {
            dropped += 1;
            continue;
        }
        if seen.insert((a, b)) {
            pairs.push((a.to_string(), b.to_string()));
        }
    }
    if dropped > 0 {
        tracing::warn!("tokenizer: {dropped} merges name strings outside the vocabulary; ignored");
    }
    BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .ignore_merges(ignore_merges)
        .byte_fallback(byte_fallback)
        .build()
        .map_err(|e| TokenizerError::Library(format!("BPE model: {e}")))
}

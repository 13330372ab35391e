//! GGUF model files: header, metadata, tensor infos and tensor data.
//!
//! [`GgufFile`] is the parsed header. It can come from a whole file in memory
//! ([`BytesGguf`]), a memory map ([`MappedGguf`], native only) or, on a worker without the
//! file, from its first bytes fetched over HTTP ([`parse_header`]), after which the tensors
//! of a layer range are fetched ([`shard_ranges`]) into a [`PartialGguf`]. [`GgufWriter`]
//! builds files for tests and synthetic models. Layout notes and limits are in
//! `docs/gguf.md`.

mod error;
mod parse;
mod partial;
mod source;
mod value;
mod writer;

#[cfg(test)]
mod tests;

use std::ops::Range;

pub use error::GgufError;
pub use partial::{
    HEADER_FIRST_FETCH, HeaderProgress, MAX_HEADER_BYTES, MAX_RANGE_BYTES, MERGE_GAP,
    MODEL_ID_PREFIX_BYTES, PartialGguf, model_id, model_id_prefix_len, parse_header, shard_ranges,
};
#[cfg(not(target_arch = "wasm32"))]
pub use source::MappedGguf;
pub use source::{BytesGguf, TensorSource};
pub use value::{Metadata, Value};
pub use writer::GgufWriter;

use crate::quant::GgmlType;
use crate::tokenizer::TokenizerSpec;

/// Fixed caps on what a file may declare. They sit far above real models (a 256k-token
/// vocabulary, a few thousand tensors) and keep a corrupt or hostile header from asking for
/// unbounded memory or time, even when the file's length is not known.
pub mod limits {
    /// Alignment of tensor data when `general.alignment` is absent.
    pub const DEFAULT_ALIGNMENT: u64 = 32;
    /// Largest `general.alignment` accepted (real files use 32); padding is sized by it.
    pub const MAX_ALIGNMENT: u64 = 1 << 20;
    /// Bytes in a metadata key or tensor name.
    pub const MAX_NAME_LEN: u64 = 65_535;
    /// Bytes in a string value (chat templates are the long ones, tens of KiB).
    pub const MAX_STRING_LEN: u64 = 16 << 20;
    /// Elements in one array value.
    pub const MAX_ARRAY_LEN: u64 = 1 << 24;
    /// Array elements over the whole metadata, nested ones included.
    pub const MAX_METADATA_VALUES: u64 = 1 << 24;
    /// Levels of arrays inside arrays (real files use one).
    pub const MAX_ARRAY_DEPTH: u32 = 8;
    pub const MAX_KV_COUNT: u64 = 1 << 20;
    pub const MAX_TENSOR_COUNT: u64 = 1 << 20;
    /// GGML tensors have at most four dimensions.
    pub const MAX_DIMS: u32 = 4;
    /// Vectors whose final length comes from the file start no larger than this and grow
    /// as items are actually read.
    pub(crate) const INITIAL_CAPACITY: u64 = 1024;
}

/// A parsed GGUF header: everything but the tensor data.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufFile {
    pub version: u32,
    /// Alignment of tensor data (`general.alignment`, default 32).
    pub alignment: u64,
    pub metadata: Metadata,
    /// Tensor infos in file order.
    pub tensors: Vec<TensorInfo>,
    /// Absolute offset of the tensor data section.
    pub data_offset: u64,
}

/// Where one tensor lives and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` is the innermost dimension (the row length).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data relative to [`GgufFile::data_offset`].
    pub offset: u64,
    pub n_bytes: u64,
    pub n_elements: u64,
}

impl TensorInfo {
    /// Elements in one row (`dims[0]`).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(0)
    }

    /// Rows: the product of all dims but the first.
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }

    /// Bytes in one row.
    pub fn row_bytes(&self) -> u64 {
        self.row_len() / self.ty.block_len() as u64 * self.ty.block_bytes() as u64
    }
}

impl GgufFile {
    /// Parses the header of a whole file held in `bytes`, and checks that every tensor's data
    /// lies inside it. For only the first bytes of a file, use [`GgufFile::parse_prefix`].
    pub fn parse(bytes: &[u8]) -> Result<GgufFile, GgufError> {
        parse::parse(bytes, Some(bytes.len() as u64))
    }

    /// Parses the header from the first bytes of a file.
    ///
    /// When the header goes on past `bytes`, returns [`GgufError::NeedMoreBytes`] with a
    /// lower bound on the prefix length needed; fetch more and call again. The bound only
    /// covers the item being read, so grow the prefix geometrically (at least double it)
    /// to keep round trips few: a 50k-token vocabulary is 50k strings. With `file_len`
    /// given, reads past the end of the file are [`GgufError::Truncated`] instead, and
    /// tensors are checked to lie inside the file; bytes beyond `file_len` are ignored.
    pub fn parse_prefix(bytes: &[u8], file_len: Option<u64>) -> Result<GgufFile, GgufError> {
        parse::parse(bytes, file_len)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Like [`GgufFile::tensor`], with an error naming a missing tensor.
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor {
            name: name.to_owned(),
        })
    }

    /// Absolute byte range of a tensor's data in the file.
    pub fn tensor_range(&self, t: &TensorInfo) -> Range<u64> {
        // The parser has checked that these sums do not overflow; saturate for infos built
        // by hand.
        let start = self.data_offset.saturating_add(t.offset);
        start..start.saturating_add(t.n_bytes)
    }

    /// `general.architecture`, e.g. `llama`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.metadata.get_str("general.architecture")
    }

    /// The tokenizer description from `tokenizer.ggml.*` and `tokenizer.chat_template`.
    pub fn tokenizer_spec(&self) -> Result<TokenizerSpec, GgufError> {
        let md = &self.metadata;
        let tokens = md.get_str_array("tokenizer.ggml.tokens")?;
        let token_types = if md.contains_key("tokenizer.ggml.token_type") {
            md.get_i32_array("tokenizer.ggml.token_type")?
        } else {
            Vec::new()
        };
        if !token_types.is_empty() && token_types.len() != tokens.len() {
            return Err(GgufError::InvalidValue {
                key: "tokenizer.ggml.token_type".to_owned(),
                reason: format!("{} entries for {} tokens", token_types.len(), tokens.len()),
            });
        }
        let scores = if md.contains_key("tokenizer.ggml.scores") {
            md.get_f32_array("tokenizer.ggml.scores")?
        } else {
            Vec::new()
        };
        if !scores.is_empty() && scores.len() < tokens.len() {
            return Err(GgufError::InvalidValue {
                key: "tokenizer.ggml.scores".to_owned(),
                reason: format!("{} entries for {} tokens", scores.len(), tokens.len()),
            });
        }
        let merges = if md.contains_key("tokenizer.ggml.merges") {
            md.get_str_array("tokenizer.ggml.merges")?
        } else {
            Vec::new()
        };
        let id = |key: &str| -> Result<Option<u32>, GgufError> {
            let id = md.opt_u32(key)?;
            match id {
                Some(i) if i as usize >= tokens.len() => Err(GgufError::InvalidValue {
                    key: key.to_owned(),
                    reason: format!(
                        "token id {i} is outside the {}-token vocabulary",
                        tokens.len()
                    ),
                }),
                _ => Ok(id),
            }
        };
        Ok(TokenizerSpec {
            model: md.get_str("tokenizer.ggml.model")?.to_owned(),
            pre: md
                .opt_str("tokenizer.ggml.pre")?
                .unwrap_or_default()
                .to_owned(),
            bos_id: id("tokenizer.ggml.bos_token_id")?,
            eos_id: id("tokenizer.ggml.eos_token_id")?,
            eot_id: match id("tokenizer.ggml.eot_token_id")? {
                Some(eot) => Some(eot),
                None => id("tokenizer.ggml.eom_token_id")?,
            },
            unknown_id: id("tokenizer.ggml.unknown_token_id")?,
            padding_id: id("tokenizer.ggml.padding_token_id")?,
            add_bos: md.opt_bool("tokenizer.ggml.add_bos_token")?,
            add_eos: md.opt_bool("tokenizer.ggml.add_eos_token")?,
            add_space_prefix: md.opt_bool("tokenizer.ggml.add_space_prefix")?,
            chat_template: md.opt_str("tokenizer.chat_template")?.map(str::to_owned),
            name: md.opt_str("general.name")?.unwrap_or_default().to_owned(),
            scores,
            tokens,
            token_types,
            merges,
        })
    }
}

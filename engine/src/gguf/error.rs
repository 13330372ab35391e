//! Errors from reading GGUF files: each says what is wrong and where.

/// Why a GGUF file could not be read or a value could not be taken from it.
///
/// Offsets are absolute byte offsets in the file. `what` fields name the field being read,
/// e.g. ``value of `tokenizer.ggml.tokens`, element 17`` or ``dims of tensor `output.weight` ``.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    #[error("not a GGUF file: expected magic \"GGUF\" at byte 0, found {found:02x?}")]
    BadMagic { found: Vec<u8> },

    #[error("unsupported GGUF version {version} at byte 4 (versions 2 and 3 are supported)")]
    UnsupportedVersion { version: u32 },

    #[error(
        "big-endian GGUF file (version field at byte 4 reads {version:#010x}); only little-endian files are supported"
    )]
    BigEndian { version: u32 },

    #[error(
        "truncated file: {what} at byte {offset} needs {needed} bytes, but only {available} remain"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    #[error("{what} at byte {offset} is {value}, above the limit of {limit}")]
    TooLarge {
        what: String,
        offset: u64,
        value: u64,
        limit: u64,
    },

    #[error("{what} at byte {offset} is not valid UTF-8")]
    BadUtf8 { what: String, offset: u64 },

    #[error("unknown metadata value type {type_id} for key `{key}` at byte {offset}")]
    UnknownValueType {
        type_id: u32,
        key: String,
        offset: u64,
    },

    #[error("bool value of `{key}` at byte {offset} is {value}, expected 0 or 1")]
    BadBool { key: String, offset: u64, value: u8 },

    #[error("arrays nested deeper than {limit} levels in `{key}` at byte {offset}")]
    NestingTooDeep {
        key: String,
        offset: u64,
        limit: u32,
    },

    #[error("metadata key `{key}` appears twice (second time at byte {offset})")]
    DuplicateKey { key: String, offset: u64 },

    #[error("general.alignment is {value}; it must be a power of two, at most 1 MiB")]
    BadAlignment { value: String },

    #[error(
        "tensor `{tensor}` has type {type_name} (GGML id {type_id}), which is not supported; supported types: {}",
        crate::quant::GgmlType::supported_names()
    )]
    UnsupportedTensorType {
        tensor: String,
        type_id: u32,
        type_name: &'static str,
    },

    #[error("tensor `{tensor}` has bad dims {dims:?}: {reason}")]
    BadDims {
        tensor: String,
        dims: Vec<u64>,
        reason: String,
    },

    #[error(
        "tensor `{tensor}` occupies bytes {start}..{end} of the file, past its end at {file_len} (if these bytes are only a prefix of the file, use GgufFile::parse_prefix)"
    )]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    #[error(
        "tensor `{tensor}`: data offset {offset} plus data section start {data_offset} overflows u64"
    )]
    TensorOffsetOverflow {
        tensor: String,
        offset: u64,
        data_offset: u64,
    },

    #[error(
        "tensor `{tensor}` data offset {offset} is not a multiple of the file's alignment {alignment}"
    )]
    Misaligned {
        tensor: String,
        offset: u64,
        alignment: u64,
    },

    #[error("tensors `{first}` and `{second}` overlap in the data section")]
    OverlappingTensors { first: String, second: String },

    #[error("tensor `{name}` is listed twice (second tensor info at byte {offset})")]
    DuplicateTensor { name: String, offset: u64 },

    #[error("metadata key `{key}` is missing")]
    MissingKey { key: String },

    #[error("metadata key `{key}` holds {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    #[error("metadata key `{key}`: {reason}")]
    InvalidValue { key: String, reason: String },

    #[error("tensor `{name}` is not in the file")]
    MissingTensor { name: String },

    /// Only from [`super::GgufFile::parse_prefix`]: the header goes on past the bytes given.
    /// Fetch at least `needed_at_least` bytes from the start of the file and parse again.
    #[error("need at least {needed_at_least} bytes from the start of the file to read its header")]
    NeedMoreBytes { needed_at_least: u64 },

    #[error("cannot read {path}: {source}")]
    Open {
        path: std::path::PathBuf,
        source: std::io::Error,
    },

    #[error(transparent)]
    Io(#[from] std::io::Error),
}

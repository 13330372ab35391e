use thiserror::Error;

/// Why a frame or message was refused. Any of these ends the link: the
/// receiver reports it, sends `Error` if it still can, and closes.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("frame of protocol version {0}, this build speaks {min}..={max}", min = super::MIN_PROTOCOL_VERSION, max = super::PROTOCOL_VERSION)]
    Version(u8),
    #[error("malformed frame header: {0}")]
    Header(&'static str),
    #[error("frame of {got} bytes is over the limit of {limit}")]
    FrameTooLarge { got: u64, limit: u64 },
    #[error("message of {got} bytes is over the limit of {limit}")]
    MessageTooLarge { got: u64, limit: u64 },
    #[error("frame checksum mismatch")]
    Checksum,
    #[error(
        "out of order: expected message {expected_message} chunk {expected_chunk}, got message {message} chunk {chunk}"
    )]
    OutOfOrder {
        expected_message: u32,
        expected_chunk: u32,
        message: u32,
        chunk: u32,
    },
    #[error("chunk lengths do not add up to the message length")]
    Length,
    #[error("cannot decode message: {0}")]
    Decode(String),
    #[error("cannot encode message: {0}")]
    Encode(String),
    #[error("invalid tensor: {0}")]
    Tensor(String),
    #[error("protocol versions do not overlap (local {local}, remote {remote})")]
    Incompatible { local: u8, remote: u8 },
    #[error("an earlier frame was refused; this stream is closed")]
    Failed,
}

//! The peer wire protocol: what Cairn peers say to each other over a link.
//!
//! Pure and transport-independent (no sockets, no clocks, no async), so the
//! native link (WebRTC data channels through `str0m`) and the browser worker
//! (its own `RTCDataChannel`) share it byte for byte. `docs/protocol.md`
//! describes the format.
//!
//! - [`Message`] is what peers exchange: control messages (`Hello`, `Ping`,
//!   `Token`, `LoadShard`, …) encoded with postcard, and tensor payloads
//!   ([`Tensor`]) carried as raw little-endian bytes beside that header.
//! - [`Framer`] cuts an encoded message into frames of at most
//!   `max_frame_bytes` (the data channel's negotiated maximum message size),
//!   each with a version, the message's sequence number, the chunk index,
//!   lengths and a CRC-32.
//! - [`Deframer`] is the receiving state machine: `push` the bytes of a frame
//!   (or any slice of a byte stream) and get whole messages back, in order.
//!   It checks every length and checksum, bounds what it buffers by
//!   [`Limits`] and refuses frames that claim more; after an error it stays
//!   failed, and the link reports the error and closes.
//! - [`FlowControl`] holds the buffered-amount thresholds a sender respects
//!   so a fast sender never grows memory without bound.

mod error;
mod frame;
mod message;
#[cfg(test)]
mod tests;

pub use error::ProtocolError;
pub use frame::{Deframer, FRAME_HEADER_BYTES, FlowControl, Framer, Limits};
pub use message::{
    Battery, Calibration, Chain, DType, Hello, Hop, KvReport, LayerRange, LinkReport, Message,
    Telemetry, Tensor, Thermal, Visibility, error_code,
};

/// The protocol version this build speaks (in every frame header and in `Hello`).
pub const PROTOCOL_VERSION: u8 = 7;

/// The oldest version this build still understands.
pub const MIN_PROTOCOL_VERSION: u8 = 7;

/// The version two peers use: the highest both speak, or an error when their
/// ranges do not overlap.
pub fn negotiate(local: &Hello, remote: &Hello) -> Result<u8, ProtocolError> {
    let version = local.protocol.min(remote.protocol);
    if version < local.min_protocol.max(remote.min_protocol) {
        return Err(ProtocolError::Incompatible {
            local: local.protocol,
            remote: remote.protocol,
        });
    }
    Ok(version)
}

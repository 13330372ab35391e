//! Frames: how an encoded message is cut to fit the transport's largest
//! message, and put back together.
//!
//! Every frame is a 28-byte header and up to `max_frame_bytes - 28` bytes of
//! the encoded message:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 1 | protocol version |
//! | 1 | 1 | flags: 1 = first chunk, 2 = last chunk |
//! | 2 | 2 | reserved, zero |
//! | 4 | 4 | message sequence number (per direction, from 0, wrapping) |
//! | 8 | 4 | chunk index within the message |
//! | 12 | 4 | payload length of this frame |
//! | 16 | 8 | total length of the encoded message |
//! | 24 | 4 | CRC-32 (IEEE) of bytes 0..24 and the payload |
//!
//! All integers are little-endian. Chunks of one message are sent back to
//! back, messages in sequence order; the receiver checks both.

use super::message::{self, Message};
use super::{MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, ProtocolError};

/// Bytes of the header in front of every frame.
pub const FRAME_HEADER_BYTES: usize = 28;

/// Smallest frame size a link may negotiate (header plus some payload).
const MIN_FRAME_BYTES: usize = FRAME_HEADER_BYTES + 36;

const FLAG_FIRST: u8 = 1;
const FLAG_LAST: u8 = 2;

/// Bounds on what a [`Deframer`] accepts and buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest frame, header included. The data channel's negotiated maximum
    /// message size (browsers commonly cap it at 256 KiB).
    pub max_frame_bytes: usize,
    /// Largest encoded message reassembled. Frames claiming more are refused
    /// before anything is buffered for them.
    pub max_message_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_bytes: 256 * 1024,
            max_message_bytes: 256 * 1024 * 1024,
        }
    }
}

impl Limits {
    /// The most a [`Deframer`] with these limits ever buffers: one message
    /// being reassembled plus one partial frame.
    pub fn max_buffered_bytes(&self) -> u64 {
        self.max_message_bytes + self.max_frame_bytes as u64
    }
}

/// When a sender pauses and resumes, by the transport's buffered amount
/// (`RTCDataChannel.bufferedAmount` in browsers): it stops handing frames to
/// the transport above `high_water` and resumes once the buffered amount
/// falls to `low_water` (the `bufferedAmountLowThreshold`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowControl {
    pub high_water: usize,
    pub low_water: usize,
}

impl Default for FlowControl {
    fn default() -> Self {
        Self {
            high_water: 4 * 1024 * 1024,
            low_water: 1024 * 1024,
        }
    }
}

impl FlowControl {
    /// Whether another frame may be handed to the transport now.
    pub fn may_send(&self, buffered_amount: usize) -> bool {
        buffered_amount < self.high_water
    }
}

/// Cuts messages into frames. One per direction of a link.
#[derive(Clone, Debug)]
pub struct Framer {
    max_frame_bytes: usize,
    peer_max_message_bytes: u64,
    next_message: u32,
}

impl Framer {
    /// Frames of at most `max_frame_bytes` (raised to a small minimum).
    pub fn new(max_frame_bytes: usize) -> Self {
        Self {
            max_frame_bytes: max_frame_bytes.max(MIN_FRAME_BYTES),
            peer_max_message_bytes: u64::MAX,
            next_message: 0,
        }
    }

    pub fn max_frame_bytes(&self) -> usize {
        self.max_frame_bytes
    }

    /// Applies a newly negotiated maximum message size of the transport.
    pub fn set_max_frame_bytes(&mut self, max_frame_bytes: usize) {
        self.max_frame_bytes = max_frame_bytes.max(MIN_FRAME_BYTES);
    }

    /// Applies the peer's `Hello::max_message_bytes`: larger messages are
    /// refused here rather than by the peer.
    pub fn set_peer_max_message_bytes(&mut self, max: u64) {
        self.peer_max_message_bytes = max;
    }

    /// The size of `message` once encoded, without the frame headers.
    pub fn encoded_len(message: &Message) -> Result<u64, ProtocolError> {
        Ok(message::encode(message)?.len())
    }

    /// Encodes `message` into frames, in order.
    pub fn encode(&mut self, message: &Message) -> Result<Vec<Vec<u8>>, ProtocolError> {
        let mut frames = Vec::new();
        self.encode_with(message, |frame| frames.push(frame))?;
        Ok(frames)
    }

    /// Encodes `message`, handing each frame to `emit` in order; returns how
    /// many frames it made. On error nothing was emitted and the sequence
    /// number is not used up.
    pub fn encode_with(
        &mut self,
        message: &Message,
        mut emit: impl FnMut(Vec<u8>),
    ) -> Result<usize, ProtocolError> {
        let encoded = message::encode(message)?;
        let total = encoded.len();
        if total > self.peer_max_message_bytes {
            return Err(ProtocolError::MessageTooLarge {
                got: total,
                limit: self.peer_max_message_bytes,
            });
        }
        let room = self.max_frame_bytes - FRAME_HEADER_BYTES;
        let chunks = total.div_ceil(room as u64);
        if chunks > u64::from(u32::MAX) {
            return Err(ProtocolError::MessageTooLarge {
                got: total,
                limit: room as u64 * u64::from(u32::MAX),
            });
        }
        let seq = self.next_message;
        self.next_message = seq.wrapping_add(1);
        // The encoded message is body then tail; frames take slices across both.
        let parts = [encoded.body, encoded.tail.as_slice()];
        let (mut part, mut offset) = (0usize, 0usize);
        for chunk in 0..chunks as u32 {
            let last = u64::from(chunk) + 1 == chunks;
            let mut frame = Vec::with_capacity(
                self.max_frame_bytes
                    .min(FRAME_HEADER_BYTES + total as usize),
            );
            frame.resize(FRAME_HEADER_BYTES, 0);
            while frame.len() < self.max_frame_bytes && part < parts.len() {
                let source = parts[part];
                let take = (source.len() - offset).min(self.max_frame_bytes - frame.len());
                frame.extend_from_slice(&source[offset..offset + take]);
                offset += take;
                if offset == source.len() {
                    part += 1;
                    offset = 0;
                }
            }
            let payload_len = (frame.len() - FRAME_HEADER_BYTES) as u32;
            let flags = if chunk == 0 { FLAG_FIRST } else { 0 } | if last { FLAG_LAST } else { 0 };
            write_header(&mut frame, flags, seq, chunk, payload_len, total);
            emit(frame);
        }
        Ok(chunks as usize)
    }
}

fn write_header(frame: &mut [u8], flags: u8, seq: u32, chunk: u32, payload_len: u32, total: u64) {
    frame[0] = PROTOCOL_VERSION;
    frame[1] = flags;
    frame[2..4].copy_from_slice(&[0, 0]);
    frame[4..8].copy_from_slice(&seq.to_le_bytes());
    frame[8..12].copy_from_slice(&chunk.to_le_bytes());
    frame[12..16].copy_from_slice(&payload_len.to_le_bytes());
    frame[16..24].copy_from_slice(&total.to_le_bytes());
    let crc = checksum(&frame[..24], &frame[FRAME_HEADER_BYTES..]);
    frame[24..28].copy_from_slice(&crc.to_le_bytes());
}

fn checksum(header: &[u8], payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(header);
    hasher.update(payload);
    hasher.finalize()
}

#[derive(Clone, Copy, Debug)]
struct Header {
    flags: u8,
    message: u32,
    chunk: u32,
    payload_len: usize,
    total: u64,
    crc: u32,
}

fn le_u32(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

/// Reads and checks a header (not yet its checksum) against the limits.
fn parse_header(bytes: &[u8], limits: &Limits) -> Result<Header, ProtocolError> {
    debug_assert!(bytes.len() >= FRAME_HEADER_BYTES);
    let version = bytes[0];
    if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) {
        return Err(ProtocolError::Version(version));
    }
    let flags = bytes[1];
    if flags & !(FLAG_FIRST | FLAG_LAST) != 0 {
        return Err(ProtocolError::Header("unknown flags"));
    }
    if bytes[2] != 0 || bytes[3] != 0 {
        return Err(ProtocolError::Header("reserved bytes are not zero"));
    }
    let payload_len = le_u32(bytes, 12) as usize;
    let mut total = [0u8; 8];
    total.copy_from_slice(&bytes[16..24]);
    let total = u64::from_le_bytes(total);
    let frame_len = FRAME_HEADER_BYTES as u64 + payload_len as u64;
    if frame_len > limits.max_frame_bytes as u64 {
        return Err(ProtocolError::FrameTooLarge {
            got: frame_len,
            limit: limits.max_frame_bytes as u64,
        });
    }
    if total > limits.max_message_bytes {
        return Err(ProtocolError::MessageTooLarge {
            got: total,
            limit: limits.max_message_bytes,
        });
    }
    if payload_len == 0 || payload_len as u64 > total {
        return Err(ProtocolError::Length);
    }
    Ok(Header {
        flags,
        message: le_u32(bytes, 4),
        chunk: le_u32(bytes, 8),
        payload_len,
        total,
        crc: le_u32(bytes, 24),
    })
}

/// A message being reassembled.
#[derive(Debug)]
struct Partial {
    message: u32,
    next_chunk: u32,
    total: u64,
    buf: Vec<u8>,
}

/// Puts frames back together into messages, checking everything.
///
/// Feed it each data channel message as it arrives (or arbitrary slices of
/// a byte stream: a frame split across pushes is kept until it is whole).
/// What it buffers never exceeds [`Limits::max_buffered_bytes`].
#[derive(Debug)]
pub struct Deframer {
    limits: Limits,
    next_message: u32,
    current: Option<Partial>,
    /// The start of a frame split across pushes (stream transports only).
    stash: Vec<u8>,
    failed: bool,
}

/// Buffers are reserved up to this much ahead of the bytes that arrived, so
/// a frame claiming a huge message cannot make us allocate it up front.
const RESERVE_AHEAD: u64 = 16 * 1024 * 1024;

impl Deframer {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            next_message: 0,
            current: None,
            stash: Vec::new(),
            failed: false,
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Bytes held now: a partial message and a partial frame.
    pub fn buffered_bytes(&self) -> usize {
        self.stash.len() + self.current.as_ref().map_or(0, |p| p.buf.len())
    }

    /// Whether an earlier push failed (every later push fails too).
    pub fn is_failed(&self) -> bool {
        self.failed
    }

    /// Takes the next bytes from the transport; returns the messages they complete.
    pub fn push(&mut self, mut bytes: &[u8]) -> Result<Vec<Message>, ProtocolError> {
        if self.failed {
            return Err(ProtocolError::Failed);
        }
        let mut out = Vec::new();
        let result = (|| {
            if !self.stash.is_empty() {
                if !self.fill_stash(&mut bytes)? {
                    return Ok(());
                }
                let frame = std::mem::take(&mut self.stash);
                self.frame(&frame, &mut out)?;
            }
            while !bytes.is_empty() {
                if bytes.len() < FRAME_HEADER_BYTES {
                    self.stash.extend_from_slice(bytes);
                    return Ok(());
                }
                let header = parse_header(bytes, &self.limits)?;
                let len = FRAME_HEADER_BYTES + header.payload_len;
                if bytes.len() < len {
                    self.stash.reserve_exact(len);
                    self.stash.extend_from_slice(bytes);
                    return Ok(());
                }
                let (frame, rest) = bytes.split_at(len);
                self.frame(frame, &mut out)?;
                bytes = rest;
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(out),
            Err(e) => {
                self.failed = true;
                self.current = None;
                self.stash = Vec::new();
                Err(e)
            }
        }
    }

    /// Moves bytes into the stash until it holds a whole frame; `false` if
    /// the input ran out first.
    fn fill_stash(&mut self, bytes: &mut &[u8]) -> Result<bool, ProtocolError> {
        if self.stash.len() < FRAME_HEADER_BYTES {
            let take = (FRAME_HEADER_BYTES - self.stash.len()).min(bytes.len());
            self.stash.extend_from_slice(&bytes[..take]);
            *bytes = &bytes[take..];
            if self.stash.len() < FRAME_HEADER_BYTES {
                return Ok(false);
            }
        }
        let header = parse_header(&self.stash, &self.limits)?;
        let len = FRAME_HEADER_BYTES + header.payload_len;
        let take = (len - self.stash.len()).min(bytes.len());
        self.stash.extend_from_slice(&bytes[..take]);
        *bytes = &bytes[take..];
        Ok(self.stash.len() == len)
    }

    /// One whole frame (header already length-checked by `parse_header`).
    fn frame(&mut self, frame: &[u8], out: &mut Vec<Message>) -> Result<(), ProtocolError> {
        let header = parse_header(frame, &self.limits)?;
        let payload = &frame[FRAME_HEADER_BYTES..];
        if checksum(&frame[..24], payload) != header.crc {
            return Err(ProtocolError::Checksum);
        }
        let first = header.flags & FLAG_FIRST != 0;
        let last = header.flags & FLAG_LAST != 0;
        let (expected_message, expected_chunk) = match &self.current {
            Some(p) => (p.message, p.next_chunk),
            None => (self.next_message, 0),
        };
        if header.message != expected_message
            || header.chunk != expected_chunk
            || first != (expected_chunk == 0)
        {
            return Err(ProtocolError::OutOfOrder {
                expected_message,
                expected_chunk,
                message: header.message,
                chunk: header.chunk,
            });
        }
        let partial = self.current.get_or_insert_with(|| Partial {
            message: header.message,
            next_chunk: 0,
            total: header.total,
            buf: Vec::with_capacity(header.total.min(RESERVE_AHEAD) as usize),
        });
        let have = partial.buf.len() as u64 + payload.len() as u64;
        if header.total != partial.total || have > partial.total || last != (have == partial.total)
        {
            return Err(ProtocolError::Length);
        }
        if partial.buf.capacity() - partial.buf.len() < payload.len() {
            let ahead = (partial.total - partial.buf.len() as u64).min(RESERVE_AHEAD) as usize;
            partial.buf.reserve(ahead.max(payload.len()));
        }
        partial.buf.extend_from_slice(payload);
        partial.next_chunk = partial.next_chunk.wrapping_add(1);
        if last {
            let done = self.current.take().map(|p| p.buf).unwrap_or_default();
            self.next_message = self.next_message.wrapping_add(1);
            out.push(message::decode(done)?);
        }
        Ok(())
    }
}

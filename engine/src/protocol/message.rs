//! Messages and tensors, and how one message becomes bytes.
//!
//! An encoded message is `body ‖ head ‖ head_len`: the raw body (a tensor's
//! little-endian bytes, a probe's padding; empty for control messages), then
//! the postcard encoding of [`Head`], then the head's length as a `u32` LE.
//! Putting the head last lets the receiver hand the body on without copying
//! it: the reassembly buffer is truncated to the body.

use serde::{Deserialize, Serialize};

use super::ProtocolError;
use crate::kernels::SampleParams;

/// Error codes carried by [`Message::Error`].
pub mod error_code {
    /// A frame or message was refused; the sender closes next.
    pub const PROTOCOL: u16 = 1;
    /// The request names something this peer does not have or cannot do.
    pub const UNSUPPORTED: u16 = 2;
    /// The peer is out of memory, queue space or time.
    pub const OVERLOADED: u16 = 3;
    /// The request itself is wrong (bad layer range, unknown request id, …).
    pub const BAD_REQUEST: u16 = 4;
    /// Something failed inside the peer.
    pub const INTERNAL: u16 = 5;
}

/// Most dimensions a tensor may have on the wire.
pub const MAX_RANK: usize = 8;

/// Element types a [`Tensor`] can carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    U32,
    I8,
    U8,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 => 1,
        }
    }
}

/// A dense tensor: element type, shape (outermost first) and its elements
/// as little-endian bytes, row-major. The length always matches the shape.
#[derive(Clone, PartialEq, Eq)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<u64>,
    data: Vec<u8>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("bytes", &self.data.len())
            .finish()
    }
}

/// Bytes a tensor of this type and shape takes, or an error when the shape
/// is too deep or overflows.
fn tensor_bytes(dtype: DType, shape: &[u64]) -> Result<u64, ProtocolError> {
    if shape.len() > MAX_RANK {
        return Err(ProtocolError::Tensor(format!(
            "rank {} is over {MAX_RANK}",
            shape.len()
        )));
    }
    shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| ProtocolError::Tensor("shape overflows".into()))
}

impl Tensor {
    /// A tensor from little-endian bytes; refuses a length that does not match the shape.
    pub fn new(dtype: DType, shape: Vec<u64>, data: Vec<u8>) -> Result<Self, ProtocolError> {
        let expected = tensor_bytes(dtype, &shape)?;
        if expected != data.len() as u64 {
            return Err(ProtocolError::Tensor(format!(
                "{} bytes for shape {shape:?} of {dtype:?}, expected {expected}",
                data.len()
            )));
        }
        Ok(Self { dtype, shape, data })
    }

    /// A tensor from native values; `T` must be the element type `dtype`
    /// stands for (checked by size), e.g. `f32` for `F32`, `half::f16` for `F16`.
    pub fn from_values<T: bytemuck::Pod>(
        dtype: DType,
        shape: Vec<u64>,
        values: &[T],
    ) -> Result<Self, ProtocolError> {
        if size_of::<T>() != dtype.size() {
            return Err(ProtocolError::Tensor(format!(
                "{}-byte values for {dtype:?}",
                size_of::<T>()
            )));
        }
        Self::new(dtype, shape, to_le_bytes(values))
    }

    pub fn from_f32(shape: Vec<u64>, values: &[f32]) -> Result<Self, ProtocolError> {
        Self::from_values(DType::F32, shape, values)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len() / self.dtype.size()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The elements as little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.data
    }

    /// The elements as native values of `T` (checked against the dtype's size).
    pub fn to_values<T: bytemuck::Pod>(&self) -> Result<Vec<T>, ProtocolError> {
        if size_of::<T>() != self.dtype.size() {
            return Err(ProtocolError::Tensor(format!(
                "reading {:?} as {}-byte values",
                self.dtype,
                size_of::<T>()
            )));
        }
        Ok(from_le_bytes(&self.data))
    }

    /// The elements as `f32`; only for `F32` tensors.
    pub fn to_f32(&self) -> Result<Vec<f32>, ProtocolError> {
        if self.dtype != DType::F32 {
            return Err(ProtocolError::Tensor(format!(
                "{:?} read as F32",
                self.dtype
            )));
        }
        self.to_values()
    }
}

fn to_le_bytes<T: bytemuck::Pod>(values: &[T]) -> Vec<u8> {
    #[allow(unused_mut)]
    let mut bytes = bytemuck::cast_slice::<T, u8>(values).to_vec();
    #[cfg(target_endian = "big")]
    for element in bytes.chunks_exact_mut(size_of::<T>()) {
        element.reverse();
    }
    bytes
}

fn from_le_bytes<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    // Copies into a properly aligned vector whatever the source alignment.
    let mut values = vec![T::zeroed(); bytes.len() / size_of::<T>()];
    let n = values.len() * size_of::<T>();
    bytemuck::cast_slice_mut::<T, u8>(&mut values).copy_from_slice(&bytes[..n]);
    #[cfg(target_endian = "big")]
    for element in bytemuck::cast_slice_mut::<T, u8>(&mut values).chunks_exact_mut(size_of::<T>()) {
        element.reverse();
    }
    values
}

/// The first message each side sends on a new link.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Highest protocol version spoken.
    pub protocol: u8,
    /// Lowest protocol version still understood.
    pub min_protocol: u8,
    /// Largest message this peer reassembles; larger ones are refused.
    pub max_message_bytes: u64,
    /// The sender's id in the signaling room.
    pub peer: String,
    /// Capabilities and device info as a JSON object (postcard is not
    /// self-describing, so JSON travels as text).
    pub capabilities: String,
}

impl Hello {
    pub fn new(peer: impl Into<String>, max_message_bytes: u64, capabilities: String) -> Self {
        Self {
            protocol: super::PROTOCOL_VERSION,
            min_protocol: super::MIN_PROTOCOL_VERSION,
            max_message_bytes,
            peer: peer.into(),
            capabilities,
        }
    }
}

/// A half-open range of transformer layers, `start..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerRange {
    pub start: u32,
    pub end: u32,
}

/// The stage after this one: who runs it and which layers it holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Hop {
    /// The peer's id in the signaling room.
    pub peer: String,
    pub layers: LayerRange,
}

/// How a request goes on without the coordinator: each stage hands its
/// output straight to the next (where it has a link to it), and the last
/// stage feeds each sampled token back to the first until a stop rule holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chain {
    /// Tokens the request generates in all: sampling step `max_steps - 1` is the last.
    pub max_steps: u32,
    /// Tokens that end generation (empty when the request ignores them).
    pub end_ids: Vec<u32>,
}

impl Chain {
    /// Most end-of-generation ids a chain carries; more is a malformed message.
    pub const MAX_END_IDS: usize = 64;

    /// Whether the token sampled at `step` is followed by another step.
    pub fn continues_after(&self, step: u32, token: u32) -> bool {
        step.saturating_add(1) < self.max_steps && !self.end_ids.contains(&token)
    }
}

/// What a worker reports about itself now and then.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct Telemetry {
    pub uptime_ms: u64,
    pub queue_depth: u32,
    pub tokens_per_s: f32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// Anything else, as a JSON object.
    pub extra: String,
}

/// Everything peers say to each other.
///
/// New variants are only ever appended (the wire names variants by index);
/// a peer meets an unknown one only from a newer protocol version, which
/// `Hello` negotiates away first.
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Hello(Hello),
    /// Round-trip probe; answered with `Pong` carrying the same fields.
    Ping {
        nonce: u64,
        sent_us: u64,
    },
    Pong {
        nonce: u64,
        sent_us: u64,
    },
    /// Hidden states of positions `pos0..pos0 + tokens` of request `request`,
    /// the `seq`th such message of that request.
    Activations {
        request: u64,
        seq: u32,
        pos0: u32,
        tensor: Tensor,
    },
    /// The token request `request` sampled at step `step` (tokens generated
    /// before it). `passed_on`: the last stage has already handed it to the
    /// first stage as the next step's input (a [`Chain`]); otherwise the
    /// coordinator decides whether, and where, the request goes on.
    Token {
        request: u64,
        seq: u32,
        step: u32,
        id: u32,
        passed_on: bool,
    },
    /// Load layers `layers` of the model whose id is `model_hash` (see
    /// `worker::model_id`), from a local copy when the worker has one, else
    /// from `source` (an HTTP URL serving the GGUF with range requests).
    /// Any shard loaded before is dropped with its KV caches. Answered with
    /// `ShardLoaded` or `Error`. `next` is the stage that takes this one's
    /// output under a [`Chain`] (the first stage, after the last; this very
    /// peer when it is the only stage), `None` to send every output to the
    /// coordinator; `prev` is the only other worker whose `Forward`s are
    /// served.
    LoadShard {
        model_hash: String,
        layers: LayerRange,
        source: String,
        next: Option<Hop>,
        prev: Option<String>,
    },
    Telemetry(Telemetry),
    /// Throughput probe: `payload` is padding the receiver counts and drops,
    /// answering with `ProbeAck`.
    Probe {
        nonce: u64,
        payload: Vec<u8>,
    },
    ProbeAck {
        nonce: u64,
        bytes: u64,
    },
    Error {
        code: u16,
        text: String,
    },
    /// The sender is closing the link on purpose.
    Close {
        reason: String,
    },
    /// Run the loaded shard over `tensor` (token ids as `U32` for the first
    /// shard, hidden states as `F32` `[n, dim]` otherwise) at positions
    /// `pos0..pos0 + n` of request `request`. `pos0 == 0` starts the request
    /// afresh (a cache of `max_len` positions); a `pos0` below what the cache
    /// holds rewinds it first. The last shard samples with `sample` and
    /// answers `Token`; the others answer `Activations`. `layers` is the
    /// range the sender believes this peer holds: a peer holding other
    /// layers (a placement changed under the step) refuses it. `seq` names
    /// the run of the request (the coordinator starts a new one at position
    /// 0 after a failure or a new placement); a stage drops steps of a run
    /// older than the one its cache holds. With `chain`, the output goes to
    /// the next stage as another `Forward` where the stage has a link to it
    /// (see `LoadShard::next`), and the request loops through the stages
    /// until the chain's stop rule holds.
    Forward {
        request: u64,
        seq: u32,
        layers: LayerRange,
        pos0: u32,
        max_len: u32,
        sample: Option<SampleParams>,
        chain: Option<Chain>,
        tensor: Tensor,
    },
    /// A `LoadShard` is done: `weight_bytes` are on the device.
    ShardLoaded {
        layers: LayerRange,
        weight_bytes: u64,
        load_ms: u32,
    },
    /// Forget request `request` (frees its KV cache).
    EndRequest {
        request: u64,
    },
    /// Measure how fast this peer runs a layer of the model `config` (JSON of
    /// `ModelConfig`); answered with `Calibration`.
    Calibrate {
        config: String,
    },
    Calibration(Calibration),
    /// A `Forward` of request `request` failed; the link stays up.
    RequestError {
        request: u64,
        seq: u32,
        code: u16,
        text: String,
    },
    /// The peer is about to stop serving (tab hidden, thermal pressure…) and
    /// asks the coordinator to move its work; `Resume` says it is back.
    Pause {
        reason: String,
    },
    Resume,
}

/// What a calibration run measured, in seconds per layer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct Calibration {
    /// One decode step (one token) through one layer.
    pub decode_s_per_layer: f64,
    /// One prompt token through one layer, in a batch.
    pub prefill_s_per_layer_token: f64,
    /// Fixed cost of one forward call, whatever the layers (submission, sync).
    pub call_overhead_s: f64,
    /// What the last stage adds per token: the final norm, the output head
    /// over the whole vocabulary, and sampling.
    pub head_s: f64,
}

impl Message {
    /// A short name for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::Ping { .. } => "ping",
            Message::Pong { .. } => "pong",
            Message::Activations { .. } => "activations",
            Message::Token { .. } => "token",
            Message::LoadShard { .. } => "load-shard",
            Message::Telemetry(_) => "telemetry",
            Message::Probe { .. } => "probe",
            Message::ProbeAck { .. } => "probe-ack",
            Message::Error { .. } => "error",
            Message::Close { .. } => "close",
            Message::Forward { .. } => "forward",
            Message::ShardLoaded { .. } => "shard-loaded",
            Message::EndRequest { .. } => "end-request",
            Message::Calibrate { .. } => "calibrate",
            Message::Calibration(_) => "calibration",
            Message::RequestError { .. } => "request-error",
            Message::Pause { .. } => "pause",
            Message::Resume => "resume",
        }
    }
}

/// The control part of a message, as postcard encodes it. Variant order is
/// the wire format: append only.
#[derive(Serialize, Deserialize)]
enum Head {
    Hello(Hello),
    Ping {
        nonce: u64,
        sent_us: u64,
    },
    Pong {
        nonce: u64,
        sent_us: u64,
    },
    Activations {
        request: u64,
        seq: u32,
        pos0: u32,
        dtype: DType,
        shape: Vec<u64>,
    },
    Token {
        request: u64,
        seq: u32,
        step: u32,
        id: u32,
        passed_on: bool,
    },
    LoadShard {
        model_hash: String,
        layers: LayerRange,
        source: String,
        next: Option<Hop>,
        prev: Option<String>,
    },
    Telemetry(Telemetry),
    Probe {
        nonce: u64,
    },
    ProbeAck {
        nonce: u64,
        bytes: u64,
    },
    Error {
        code: u16,
        text: String,
    },
    Close {
        reason: String,
    },
    Forward {
        request: u64,
        seq: u32,
        layers: LayerRange,
        pos0: u32,
        max_len: u32,
        sample: Option<SampleParams>,
        chain: Option<Chain>,
        dtype: DType,
        shape: Vec<u64>,
    },
    ShardLoaded {
        layers: LayerRange,
        weight_bytes: u64,
        load_ms: u32,
    },
    EndRequest {
        request: u64,
    },
    Calibrate {
        config: String,
    },
    Calibration(Calibration),
    RequestError {
        request: u64,
        seq: u32,
        code: u16,
        text: String,
    },
    Pause {
        reason: String,
    },
    Resume,
}

/// The encoded head (with its length suffix) and the body it travels with.
pub(crate) struct Encoded<'a> {
    pub body: &'a [u8],
    pub tail: Vec<u8>,
}

impl Encoded<'_> {
    pub fn len(&self) -> u64 {
        self.body.len() as u64 + self.tail.len() as u64
    }
}

pub(crate) fn encode(message: &Message) -> Result<Encoded<'_>, ProtocolError> {
    let (head, body): (Head, &[u8]) = match message {
        Message::Hello(h) => (Head::Hello(h.clone()), &[]),
        &Message::Ping { nonce, sent_us } => (Head::Ping { nonce, sent_us }, &[]),
        &Message::Pong { nonce, sent_us } => (Head::Pong { nonce, sent_us }, &[]),
        Message::Activations {
            request,
            seq,
            pos0,
            tensor,
        } => (
            Head::Activations {
                request: *request,
                seq: *seq,
                pos0: *pos0,
                dtype: tensor.dtype,
                shape: tensor.shape.clone(),
            },
            &tensor.data,
        ),
        &Message::Token {
            request,
            seq,
            step,
            id,
            passed_on,
        } => (
            Head::Token {
                request,
                seq,
                step,
                id,
                passed_on,
            },
            &[],
        ),
        Message::LoadShard {
            model_hash,
            layers,
            source,
            next,
            prev,
        } => (
            Head::LoadShard {
                model_hash: model_hash.clone(),
                layers: *layers,
                source: source.clone(),
                next: next.clone(),
                prev: prev.clone(),
            },
            &[],
        ),
        Message::Telemetry(t) => (Head::Telemetry(t.clone()), &[]),
        Message::Probe { nonce, payload } => (Head::Probe { nonce: *nonce }, payload),
        &Message::ProbeAck { nonce, bytes } => (Head::ProbeAck { nonce, bytes }, &[]),
        Message::Error { code, text } => (
            Head::Error {
                code: *code,
                text: text.clone(),
            },
            &[],
        ),
        Message::Close { reason } => (
            Head::Close {
                reason: reason.clone(),
            },
            &[],
        ),
        Message::Forward {
            request,
            seq,
            layers,
            pos0,
            max_len,
            sample,
            chain,
            tensor,
        } => (
            Head::Forward {
                request: *request,
                seq: *seq,
                layers: *layers,
                pos0: *pos0,
                max_len: *max_len,
                sample: *sample,
                chain: chain.clone(),
                dtype: tensor.dtype,
                shape: tensor.shape.clone(),
            },
            &tensor.data,
        ),
        &Message::ShardLoaded {
            layers,
            weight_bytes,
            load_ms,
        } => (
            Head::ShardLoaded {
                layers,
                weight_bytes,
                load_ms,
            },
            &[],
        ),
        &Message::EndRequest { request } => (Head::EndRequest { request }, &[]),
        Message::Calibrate { config } => (
            Head::Calibrate {
                config: config.clone(),
            },
            &[],
        ),
        Message::Calibration(c) => (Head::Calibration(*c), &[]),
        Message::RequestError {
            request,
            seq,
            code,
            text,
        } => (
            Head::RequestError {
                request: *request,
                seq: *seq,
                code: *code,
                text: text.clone(),
            },
            &[],
        ),
        Message::Pause { reason } => (
            Head::Pause {
                reason: reason.clone(),
            },
            &[],
        ),
        Message::Resume => (Head::Resume, &[]),
    };
    let mut tail =
        postcard::to_allocvec(&head).map_err(|e| ProtocolError::Encode(e.to_string()))?;
    let head_len = u32::try_from(tail.len())
        .map_err(|_| ProtocolError::Encode("message head over 4 GiB".into()))?;
    tail.extend_from_slice(&head_len.to_le_bytes());
    Ok(Encoded { body, tail })
}

/// Decodes one reassembled message, taking its buffer so a tensor body is
/// handed on without a copy.
pub(crate) fn decode(mut bytes: Vec<u8>) -> Result<Message, ProtocolError> {
    let bad = |what: &str| ProtocolError::Decode(what.to_owned());
    let n = bytes.len();
    let suffix: [u8; 4] = bytes
        .get(n.wrapping_sub(4)..)
        .and_then(|s| s.try_into().ok())
        .ok_or_else(|| bad("shorter than its length suffix"))?;
    let head_len = u32::from_le_bytes(suffix) as usize;
    let body_len = (n - 4)
        .checked_sub(head_len)
        .ok_or_else(|| bad("head length past the start of the message"))?;
    let (head, rest) = postcard::take_from_bytes::<Head>(&bytes[body_len..n - 4])
        .map_err(|e| ProtocolError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(bad("trailing bytes after the head"));
    }
    let no_body = |m: Message| {
        if body_len == 0 {
            Ok(m)
        } else {
            Err(bad("unexpected body"))
        }
    };
    match head {
        Head::Hello(h) => no_body(Message::Hello(h)),
        Head::Ping { nonce, sent_us } => no_body(Message::Ping { nonce, sent_us }),
        Head::Pong { nonce, sent_us } => no_body(Message::Pong { nonce, sent_us }),
        Head::Activations {
            request,
            seq,
            pos0,
            dtype,
            shape,
        } => {
            bytes.truncate(body_len);
            Ok(Message::Activations {
                request,
                seq,
                pos0,
                tensor: Tensor::new(dtype, shape, bytes)?,
            })
        }
        Head::Token {
            request,
            seq,
            step,
            id,
            passed_on,
        } => no_body(Message::Token {
            request,
            seq,
            step,
            id,
            passed_on,
        }),
        Head::LoadShard {
            model_hash,
            layers,
            source,
            next,
            prev,
        } => no_body(Message::LoadShard {
            model_hash,
            layers,
            source,
            next,
            prev,
        }),
        Head::Telemetry(t) => no_body(Message::Telemetry(t)),
        Head::Probe { nonce } => {
            bytes.truncate(body_len);
            Ok(Message::Probe {
                nonce,
                payload: bytes,
            })
        }
        Head::ProbeAck { nonce, bytes } => no_body(Message::ProbeAck { nonce, bytes }),
        Head::Error { code, text } => no_body(Message::Error { code, text }),
        Head::Close { reason } => no_body(Message::Close { reason }),
        Head::Forward {
            request,
            seq,
            layers,
            pos0,
            max_len,
            sample,
            chain,
            dtype,
            shape,
        } => {
            if chain
                .as_ref()
                .is_some_and(|c| c.end_ids.len() > Chain::MAX_END_IDS)
            {
                return Err(bad("a chain with too many end-of-generation ids"));
            }
            bytes.truncate(body_len);
            Ok(Message::Forward {
                request,
                seq,
                layers,
                pos0,
                max_len,
                sample,
                chain,
                tensor: Tensor::new(dtype, shape, bytes)?,
            })
        }
        Head::ShardLoaded {
            layers,
            weight_bytes,
            load_ms,
        } => no_body(Message::ShardLoaded {
            layers,
            weight_bytes,
            load_ms,
        }),
        Head::EndRequest { request } => no_body(Message::EndRequest { request }),
        Head::Calibrate { config } => no_body(Message::Calibrate { config }),
        Head::Calibration(c) => no_body(Message::Calibration(c)),
        Head::RequestError {
            request,
            seq,
            code,
            text,
        } => no_body(Message::RequestError {
            request,
            seq,
            code,
            text,
        }),
        Head::Pause { reason } => no_body(Message::Pause { reason }),
        Head::Resume => no_body(Message::Resume),
    }
}

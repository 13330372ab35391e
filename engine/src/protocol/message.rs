//! Messages and tensors, and how one message becomes bytes.
//!
//! An encoded message is `body ‖ head ‖ head_len`: the raw body (a tensor's
//! little-endian bytes, a probe's padding; empty for control messages), then
//! the postcard encoding of the [`Message`] itself (a bulk field written as
//! what describes it: a tensor's type and shape, nothing for the padding),
//! then that head's length as a `u32` LE.
//! Putting the head last lets the receiver hand the body on without copying
//! it: the reassembly buffer is truncated to the body.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ProtocolError;
use crate::kernels::SampleParams;
use crate::placement::{SplitTiming, StageSplit};

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

/// What a worker reports about itself about once a second: its stage's load,
/// and the device condition placement weighs (`placement::DeviceCondition`).
/// Fields a worker cannot observe stay `None` (or empty).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct Telemetry {
    pub uptime_ms: u64,
    pub queue_depth: u32,
    pub tokens_per_s: f32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// Share of the window since the last report spent computing, 0..=1.
    pub utilization: f64,
    /// The last forward call's time.
    pub kernel_ms: f64,
    /// The mean forward call's time over the window (none without calls).
    pub forward_ms: Option<f64>,
    /// Forward calls in the window.
    pub forwards: u32,
    /// Requests with a live KV cache.
    pub requests: u32,
    /// The layers loaded.
    pub layers: Option<LayerRange>,
    /// Thermal or compute pressure: `nominal`, `fair`, `serious` or
    /// `critical` (`ignored` from a browser told not to act on it).
    pub pressure: Option<String>,
    /// The pressure a browser observed while its `pressure` says `ignored`.
    pub pressure_observed: Option<String>,
    /// The host cuts clocks (a thermal zone past its passive trip point).
    pub throttled: Option<bool>,
    /// The hottest thermal zone.
    pub thermal: Option<Thermal>,
    pub battery: Option<Battery>,
    /// Whether a browser tab is visible (placement avoids background tabs).
    pub visibility: Option<Visibility>,
    /// Why the worker asked to pause, while it does.
    pub paused: Option<String>,
    /// The backend serving (browsers; native workers say it in `Hello`).
    pub backend: Option<String>,
    /// This worker's links to other workers, by peer id.
    pub links: BTreeMap<String, LinkReport>,
    /// Sequences per forward pass in the window, on average (continuous batching).
    pub mean_batch: Option<f32>,
    /// The stage's key/value pool.
    pub kv: Option<KvReport>,
    /// Seconds spent in forward passes since the stage was made (every window), so that two
    /// reports' difference over their `uptime_ms` is the busy share between them.
    pub busy_total_s: f64,
    /// Forward passes, and the sequences they ran, since the stage was made.
    pub passes_total: u64,
    pub seqs_total: u64,
}

/// A stage's key/value pool, in blocks of `block_positions` positions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct KvReport {
    pub blocks_used: u32,
    pub blocks_allocated: u32,
    /// The most the pool may grow to.
    pub blocks_budget: u32,
    pub block_positions: u32,
}

/// A thermal zone against its limit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct Thermal {
    pub zone: String,
    pub temp_c: f64,
    /// Where the zone counts as hot (its passive trip point, else just below critical).
    pub limit_c: Option<f64>,
}

/// Charge and whether it is charging (none when the platform does not say).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct Battery {
    /// 0..=1.
    pub level: f64,
    #[serde(default)]
    pub charging: Option<bool>,
}

/// A browser tab's visibility.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Visibility {
    Visible,
    Hidden,
}

/// A link between two workers as its sender measures it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct LinkReport {
    pub rtt_ms: Option<f64>,
    pub throughput_mb_s: Option<f64>,
}

/// Everything peers say to each other.
///
/// This enum is the wire format: postcard names a variant by its index and
/// writes its fields in order, so new variants are only ever appended, and a
/// peer meets an unknown one only from a newer protocol version, which
/// `Hello` negotiates away first. A variant's bulk bytes (a tensor's
/// elements, a probe's padding) are not in that encoding: they travel as the
/// message's body (see the module docs), and the head keeps only what describes
/// them (a tensor's type and shape).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
        #[serde(with = "tensor_head")]
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
    /// served. `split`: how a worker over several devices spreads the layers
    /// over them (placement's choice from its `Calibration`; a worker told
    /// `--split layers` or `--split tensor` keeps its own).
    LoadShard {
        model_hash: String,
        layers: LayerRange,
        source: String,
        next: Option<Hop>,
        prev: Option<String>,
        split: StageSplit,
    },
    /// Boxed: the largest payload by far, and the rarest, which would otherwise set the size
    /// of every message (serde writes a box as what it holds, so the wire is the same).
    Telemetry(Box<Telemetry>),
    /// Throughput probe: `payload` is padding the receiver counts and drops,
    /// answering with `ProbeAck`.
    Probe {
        nonce: u64,
        #[serde(with = "body_only")]
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
        #[serde(with = "tensor_head")]
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
    /// A worker over several devices that can also split every layer by tensors across
    /// them: its timings that way (the fields above are for runs of layers per device).
    pub tensor: Option<SplitTiming>,
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

/// How a tensor field is written in a message's head: its type and shape.
/// Its elements travel as the message's body; [`decode`] puts them back
/// (checking them against the shape), so a tensor deserialized here alone
/// is a placeholder without elements.
mod tensor_head {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::{DType, Tensor};

    pub fn serialize<S: Serializer>(tensor: &Tensor, s: S) -> Result<S::Ok, S::Error> {
        (tensor.dtype, &tensor.shape).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Tensor, D::Error> {
        let (dtype, shape) = <(DType, Vec<u64>)>::deserialize(d)?;
        Ok(Tensor {
            dtype,
            shape,
            data: Vec::new(),
        })
    }
}

/// A field that travels only as the message's body: nothing in the head.
mod body_only {
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(_: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_unit()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        <() as serde::Deserialize>::deserialize(d)?;
        Ok(Vec::new())
    }
}

impl Message {
    /// The whole encoded message (head and body) in one buffer, unframed: for carriers
    /// that move messages whole, such as a browser page and its Web Worker.
    pub fn to_bytes(&self) -> Result<Vec<u8>, ProtocolError> {
        let encoded = encode(self)?;
        let mut bytes = Vec::with_capacity(encoded.len() as usize);
        bytes.extend_from_slice(encoded.body);
        bytes.extend_from_slice(&encoded.tail);
        Ok(bytes)
    }

    /// The message [`Message::to_bytes`] made, checked as a received one is.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Message, ProtocolError> {
        decode(bytes)
    }
}

impl Message {
    /// The bytes that travel beside the head: a tensor's elements, a probe's padding.
    fn body(&self) -> &[u8] {
        match self {
            Message::Activations { tensor, .. } | Message::Forward { tensor, .. } => &tensor.data,
            Message::Probe { payload, .. } => payload,
            _ => &[],
        }
    }

    /// Puts a decoded head's body back where [`Message::body`] took it from.
    fn attach_body(&mut self, body: Vec<u8>) -> Result<(), ProtocolError> {
        match self {
            Message::Activations { tensor, .. } | Message::Forward { tensor, .. } => {
                let shape = std::mem::take(&mut tensor.shape);
                *tensor = Tensor::new(tensor.dtype, shape, body)?;
            }
            Message::Probe { payload, .. } => *payload = body,
            _ if body.is_empty() => {}
            _ => return Err(ProtocolError::Decode("unexpected body".into())),
        }
        Ok(())
    }

    /// Bounds a decoded message must keep beyond what its types say.
    fn check(&self) -> Result<(), ProtocolError> {
        match self {
            Message::Forward {
                chain: Some(chain), ..
            } if chain.end_ids.len() > Chain::MAX_END_IDS => Err(ProtocolError::Decode(
                "a chain with too many end-of-generation ids".into(),
            )),
            _ => Ok(()),
        }
    }
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
    let mut tail =
        postcard::to_allocvec(message).map_err(|e| ProtocolError::Encode(e.to_string()))?;
    let head_len = u32::try_from(tail.len())
        .map_err(|_| ProtocolError::Encode("message head over 4 GiB".into()))?;
    tail.extend_from_slice(&head_len.to_le_bytes());
    Ok(Encoded {
        body: message.body(),
        tail,
    })
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
    let (mut message, rest) = postcard::take_from_bytes::<Message>(&bytes[body_len..n - 4])
        .map_err(|e| ProtocolError::Decode(e.to_string()))?;
    if !rest.is_empty() {
        return Err(bad("trailing bytes after the head"));
    }
    message.check()?;
    bytes.truncate(body_len);
    message.attach_body(bytes)?;
    Ok(message)
}

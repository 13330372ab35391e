//! Layer placement: which device runs which contiguous range of a model's
//! transformer layers, and what that placement is predicted to cost.
//!
//! Pure logic (no I/O, no clocks), driven by measured [`DeviceProfile`]s and
//! a [`ModelCost`]. `docs/placement.md` describes the cost model, the solver
//! and the slowdown policy.
//!
//! The topology is a chain: each stage hands its output to the next, and the
//! last stage feeds each sampled token back to the first, except that a
//! relayed device (a browser, which keeps only its coordinator link) takes
//! its input from and returns its output to the coordinator. A placement's
//! per-token latency is a sum of per-stage terms, and only the first stage
//! (takes tokens, holds the embedding) and the last stage (returns a token,
//! holds the output head) are special.
//!
//! - [`place`] finds a placement of exactly minimum per-token latency.
//! - [`evaluate`] checks a (manual) placement and predicts its latency,
//!   throughput, prefill time and memory per stage.
//! - [`alternatives`] lists the best other placements, for a preview.
//! - [`screen`] leaves out the profiles of devices whose numbers cannot be
//!   believed (NaN, negative, absurd), so one bad worker never fails a
//!   placement for the others.
//! - [`slowdown`] turns a device's reported [`DeviceCondition`] into the
//!   factor its compute time is multiplied by.

mod condition;
mod cost;
mod error;
mod solve;
#[cfg(test)]
mod tests;

use serde::{Deserialize, Serialize};

pub use condition::{BATTERY_AVOID_BELOW, DeviceCondition, slowdown};
pub use cost::{MAX_PROFILE_S, Refused, screen};
pub use error::PlacementError;
pub use solve::{alternatives, evaluate, place, place_with_cost};

/// What the solver knows about one device, mostly measured by calibration.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DeviceProfile {
    /// Unique among the devices offered.
    pub id: String,
    /// Usable for weights + KV cache + scratch.
    pub memory_bytes: u64,
    /// One decode step (one token) through one layer, in seconds.
    pub decode_s_per_layer: f64,
    /// Prefill, per layer per prompt token, in seconds.
    pub prefill_s_per_layer_token: f64,
    /// Fixed cost of one call into the stage (dispatch, synchronisation).
    pub call_overhead_s: f64,
    /// What holding the output head adds per token (last stage only).
    #[serde(default)]
    pub head_s: f64,
    /// Round trip to the coordinator (also what a hop to the next stage is
    /// taken to cost).
    pub link_rtt_s: f64,
    /// Bandwidth to the coordinator; `f64::INFINITY` for an in-process device.
    pub link_bytes_per_s: f64,
    /// Its stage's input and output go through the coordinator rather than
    /// straight to and from the neighbouring stages (a browser).
    #[serde(default)]
    pub relayed: bool,
    /// `>= 1.0`, multiplies compute time; `f64::INFINITY` means do not use.
    /// See [`slowdown`].
    pub slowdown: f64,
    /// A worker over several local devices that can also split every layer of its stage by
    /// tensors across them: its timings that way (the fields above are for its devices
    /// taking runs of layers). The solver gives each stage the way that predicts the
    /// faster token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor: Option<SplitTiming>,
}

/// How a stage's layers are spread over the devices of a worker that drives several.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum StageSplit {
    /// Each device a contiguous run of the stage's layers (the only way for one device).
    #[default]
    Layers,
    /// Each device a part of every layer (its heads and feed-forward rows).
    Tensor,
}

impl StageSplit {
    pub fn is_layers(&self) -> bool {
        *self == StageSplit::Layers
    }
}

impl std::fmt::Display for StageSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StageSplit::Layers => "layers",
            StageSplit::Tensor => "tensor",
        })
    }
}

/// A device's (or a worker's) timings one way of running a stage, as calibration measures
/// them; the same quantities as [`DeviceProfile`]'s.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SplitTiming {
    pub decode_s_per_layer: f64,
    pub prefill_s_per_layer_token: f64,
    pub call_overhead_s: f64,
    pub head_s: f64,
    /// The devices a tensor split spreads over (0: not said, as from a worker before this
    /// field, taken as 2). Each but the first also holds a copy of the embedding (first
    /// stage), a share of the output head (last stage) and its own working buffers, which
    /// the solver counts against the worker's memory when it weighs this split.
    #[serde(default)]
    pub devices: u32,
}

/// The sizes of one model, as far as placement cares.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ModelCost {
    pub n_layers: usize,
    pub layer_weight_bytes: u64,
    /// For the configured context and concurrency.
    pub kv_bytes_per_layer: u64,
    /// Held by the first stage only (token embedding).
    pub first_extra_bytes: u64,
    /// Held by the last stage only (output head + final norm).
    pub last_extra_bytes: u64,
    /// Working buffers, on every stage.
    pub scratch_bytes: u64,
    /// One token's hidden state on the wire.
    pub activation_bytes: u64,
    /// One token (id) on the wire.
    pub token_bytes: u64,
    /// Requests served at once (batched on every stage); the KV bytes above are for this
    /// many, and predictions give the aggregate throughput at it.
    #[serde(default = "one")]
    pub concurrency: usize,
}

fn one() -> usize {
    1
}

/// Layers `start..end` of the model run on `device`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
pub struct Stage {
    pub device: String,
    pub start: usize,
    pub end: usize,
    /// How a worker with several devices spreads the stage over them.
    #[serde(default, skip_serializing_if = "StageSplit::is_layers")]
    pub split: StageSplit,
}

impl Stage {
    /// Layers `start..end` on `device`, split by layers (as every one-device stage is).
    pub fn new(device: impl Into<String>, start: usize, end: usize) -> Stage {
        Stage {
            device: device.into(),
            start,
            end,
            split: StageSplit::Layers,
        }
    }

    pub fn layers(&self) -> usize {
        self.end.saturating_sub(self.start)
    }
}

/// The prediction for one stage of a placement.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct StagePrediction {
    pub device: String,
    pub start: usize,
    pub end: usize,
    #[serde(default, skip_serializing_if = "StageSplit::is_layers")]
    pub split: StageSplit,
    /// What the stage needs: layers × (weights + KV) + embedding/head where
    /// it is first/last + scratch.
    pub memory_bytes: u64,
    /// The device's `memory_bytes`.
    pub memory_limit_bytes: u64,
    /// Per token: call overhead + layers × decode time × slowdown.
    pub compute_s: f64,
    /// Per token: the hop to the next stage (half a round trip + bytes out /
    /// bandwidth), or for a relayed stage a round trip + bytes in and out.
    pub link_s: f64,
}

/// What a placement is predicted to do.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Prediction {
    pub stages: Vec<StagePrediction>,
    /// Sum over stages of `compute_s + link_s`.
    pub s_per_token: f64,
    /// `1 / s_per_token`.
    pub tokens_per_s: f64,
    /// Time to prefill a prompt of `prompt_tokens` tokens.
    pub prefill_s: f64,
    /// Tokens per second of all `concurrency` requests together, their steps batched on
    /// every stage: each stage's step over the batch takes the longer of one decode step
    /// (reading the weights) and the batch's rows at the prefill rate (computing), one
    /// batch circulating through the stages.
    #[serde(default)]
    pub aggregate_tokens_per_s: f64,
    #[serde(default = "one")]
    pub concurrency: usize,
    pub prompt_tokens: usize,
}

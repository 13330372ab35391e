//! The cost model: memory and time of one stage, given its role.

use std::borrow::Cow;

use super::{DeviceProfile, ModelCost, PlacementError, StageSplit};

/// A stage's place in the pipeline; only the ends are special.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    /// The only stage: takes tokens, returns tokens, holds embedding and head.
    Only,
    /// Takes tokens, returns activations, holds the embedding.
    First,
    /// Takes activations, returns activations.
    Middle,
    /// Takes activations, returns a token, holds the head.
    Last,
}

impl Role {
    pub(super) fn of(index: usize, count: usize) -> Role {
        match (index == 0, index + 1 == count) {
            (true, true) => Role::Only,
            (true, false) => Role::First,
            (false, true) => Role::Last,
            (false, false) => Role::Middle,
        }
    }

    fn is_first(self) -> bool {
        matches!(self, Role::Only | Role::First)
    }

    fn is_last(self) -> bool {
        matches!(self, Role::Only | Role::Last)
    }
}

/// The ways `device` can run a stage: by layers always, by tensors where its worker offers
/// timings for that.
pub(super) fn splits(device: &DeviceProfile) -> &'static [StageSplit] {
    if device.tensor.is_some() {
        &[StageSplit::Layers, StageSplit::Tensor]
    } else {
        &[StageSplit::Layers]
    }
}

/// `device` as it runs a stage split `split`: its own timings by layers, its tensor timings
/// by tensors (none where it offers no tensor split). Memory, link and condition are the
/// same either way: the same devices hold the same bytes.
pub(super) fn split_as(
    device: &DeviceProfile,
    split: StageSplit,
) -> Option<Cow<'_, DeviceProfile>> {
    match split {
        StageSplit::Layers => Some(Cow::Borrowed(device)),
        StageSplit::Tensor => device.tensor.map(|t| {
            Cow::Owned(DeviceProfile {
                decode_s_per_layer: t.decode_s_per_layer,
                prefill_s_per_layer_token: t.prefill_s_per_layer_token,
                call_overhead_s: t.call_overhead_s,
                head_s: t.head_s,
                tensor: None,
                ..device.clone()
            })
        }),
    }
}

/// Every time a profile states, named as in its JSON, the tensor split's included.
fn timings(device: &DeviceProfile) -> Vec<(&'static str, f64)> {
    let mut all = vec![
        ("decode_s_per_layer", device.decode_s_per_layer),
        (
            "prefill_s_per_layer_token",
            device.prefill_s_per_layer_token,
        ),
        ("call_overhead_s", device.call_overhead_s),
        ("head_s", device.head_s),
        ("link_rtt_s", device.link_rtt_s),
    ];
    if let Some(t) = &device.tensor {
        all.extend([
            ("tensor.decode_s_per_layer", t.decode_s_per_layer),
            (
                "tensor.prefill_s_per_layer_token",
                t.prefill_s_per_layer_token,
            ),
            ("tensor.call_overhead_s", t.call_overhead_s),
            ("tensor.head_s", t.head_s),
        ]);
    }
    all
}

/// Bytes of model state one layer needs on a device.
pub(super) fn per_layer_bytes(model: &ModelCost) -> u128 {
    u128::from(model.layer_weight_bytes) + u128::from(model.kv_bytes_per_layer)
}

/// Bytes a stage needs beside its layers.
pub(super) fn fixed_bytes(model: &ModelCost, role: Role) -> u128 {
    let mut bytes = u128::from(model.scratch_bytes);
    if role.is_first() {
        bytes += u128::from(model.first_extra_bytes);
    }
    if role.is_last() {
        bytes += u128::from(model.last_extra_bytes);
    }
    bytes
}

/// The devices a tensor split of `device`'s worker spreads over (2 where it did not say).
pub(super) fn tensor_devices(device: &DeviceProfile) -> u32 {
    device.tensor.map_or(2, |t| t.devices.max(2))
}

/// What a stage split `split` holds beside [`fixed_bytes`] and its layers, over `devices`
/// devices ([`tensor_devices`]). By layers nothing: each device holds its own layers, and the
/// hidden states handed between its pieces go through the host. By tensors every device but
/// the first holds its own copy of the embedding (first stage: each embeds the tokens itself),
/// its share of the output head's rows with the final norm (last stage: the first device's
/// share is in the head it holds anyway) and its own working buffers. For the 8B over two
/// GPUs that is about 0.45 GB a GPU (session 19), which a placement that fits by layers may
/// not have.
pub(super) fn split_extra_bytes(
    model: &ModelCost,
    role: Role,
    split: StageSplit,
    devices: u32,
) -> u128 {
    if split == StageSplit::Layers || devices < 2 {
        return 0;
    }
    let others = u128::from(devices - 1);
    let mut bytes = others * u128::from(model.scratch_bytes);
    if role.is_first() {
        bytes += others * u128::from(model.first_extra_bytes);
    }
    if role.is_last() {
        bytes += others * u128::from(model.last_extra_bytes) / u128::from(devices);
    }
    bytes
}

/// Memory of a stage of `layers` layers split `split` over `devices` devices.
pub(super) fn stage_memory(
    model: &ModelCost,
    role: Role,
    layers: usize,
    split: StageSplit,
    devices: u32,
) -> u128 {
    layers as u128 * per_layer_bytes(model)
        + fixed_bytes(model, role)
        + split_extra_bytes(model, role, split, devices)
}

/// The most layers `device` can hold in `role` split `split`, capped at the model's layers.
pub(super) fn max_layers(
    device: &DeviceProfile,
    model: &ModelCost,
    role: Role,
    split: StageSplit,
) -> usize {
    let memory = u128::from(device.memory_bytes);
    let fixed =
        fixed_bytes(model, role) + split_extra_bytes(model, role, split, tensor_devices(device));
    if memory < fixed {
        return 0;
    }
    let per_layer = per_layer_bytes(model);
    if per_layer == 0 {
        return model.n_layers;
    }
    ((memory - fixed) / per_layer).min(model.n_layers as u128) as usize
}

/// Bytes a stage takes in and sends out per decoded token.
fn decode_bytes(model: &ModelCost, role: Role) -> (u128, u128) {
    let input = if role.is_first() {
        model.token_bytes
    } else {
        model.activation_bytes
    };
    let output = if role.is_last() {
        model.token_bytes
    } else {
        model.activation_bytes
    };
    (u128::from(input), u128::from(output))
}

/// Bytes a stage takes in and sends out to prefill `prompt` tokens: every
/// token in and every hidden state out, except that the last stage sends a
/// single token.
fn prefill_bytes(model: &ModelCost, role: Role, prompt: usize) -> (u128, u128) {
    let prompt = prompt as u128;
    let input = if role.is_first() {
        model.token_bytes
    } else {
        model.activation_bytes
    };
    let output = if role.is_last() {
        u128::from(model.token_bytes)
    } else {
        prompt * u128::from(model.activation_bytes)
    };
    (prompt * u128::from(input), output)
}

fn transfer_s(device: &DeviceProfile, bytes: u128) -> f64 {
    if bytes == 0 {
        0.0
    } else {
        bytes as f64 / device.link_bytes_per_s
    }
}

/// Per-token link time of a stage. A chained stage hands its output to the
/// next one: half a round trip plus the output's bytes (the link between
/// the two is taken to cost what this device's link does); a single chained
/// stage feeds itself and pays nothing. A relayed stage's input and output
/// both cross its link to the coordinator: a round trip plus both.
pub(super) fn decode_link_s(device: &DeviceProfile, model: &ModelCost, role: Role) -> f64 {
    let (input, output) = decode_bytes(model, role);
    if device.relayed {
        device.link_rtt_s + transfer_s(device, input + output)
    } else if role == Role::Only {
        0.0
    } else {
        device.link_rtt_s / 2.0 + transfer_s(device, output)
    }
}

/// Per-token compute time of a stage: call overhead + layers × per-layer
/// time, plus the output head for the stage that holds it.
pub(super) fn decode_compute_s(device: &DeviceProfile, role: Role, layers: usize) -> f64 {
    let head = match role {
        Role::Only | Role::Last => device.head_s * device.slowdown,
        Role::First | Role::Middle => 0.0,
    };
    device.call_overhead_s + head + layers as f64 * decode_layer_s(device)
}

/// One layer's decode time on `device`, slowdown included.
pub(super) fn decode_layer_s(device: &DeviceProfile) -> f64 {
    device.decode_s_per_layer * device.slowdown
}

/// One step of a batch of `batch` sequences (one new token each) through a stage: the longer
/// of a decode step (bound by reading the weights) and the batch's rows at the prefill rate
/// (bound by computing), plus the hop of every sequence's output.
pub(super) fn batched_step_s(
    device: &DeviceProfile,
    model: &ModelCost,
    role: Role,
    layers: usize,
    batch: usize,
) -> f64 {
    let b = batch.max(1) as f64;
    let per_layer =
        decode_layer_s(device).max(b * device.prefill_s_per_layer_token * device.slowdown);
    let head = match role {
        Role::Only | Role::Last => device.head_s * device.slowdown,
        Role::First | Role::Middle => 0.0,
    };
    let (_, output) = decode_bytes(model, role);
    let link = decode_link_s(device, model, role) + (b - 1.0) * transfer_s(device, output);
    device.call_overhead_s + head + layers as f64 * per_layer + link
}

/// A stage's part of the time to prefill `prompt` tokens.
pub(super) fn prefill_s(
    device: &DeviceProfile,
    model: &ModelCost,
    role: Role,
    layers: usize,
    prompt: usize,
) -> f64 {
    let (input, output) = prefill_bytes(model, role, prompt);
    // The prompt reaches the first stage from the coordinator; otherwise a
    // chained stage pays for its output's hop, as in `decode_link_s`.
    let link = if device.relayed || role.is_first() {
        device.link_rtt_s + transfer_s(device, input + output)
    } else {
        device.link_rtt_s / 2.0 + transfer_s(device, output)
    };
    device.call_overhead_s
        + layers as f64 * device.prefill_s_per_layer_token * prompt as f64 * device.slowdown
        + link
}

/// The longest any one timing of a profile may be: a layer, a call or a
/// round trip slower than this is a broken or lying device, not a slow one.
pub const MAX_PROFILE_S: f64 = 60.0;

/// Why [`screen`] left a device out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    pub device: String,
    pub reason: String,
}

/// Splits profiles from untrusted devices into those placement can weigh
/// and those it cannot (NaN, infinite, negative or absurd numbers, a
/// repeated id), so one bad device is left out instead of failing the whole
/// placement. What [`check_profiles`] would refuse is always refused here.
pub fn screen(devices: Vec<DeviceProfile>) -> (Vec<DeviceProfile>, Vec<Refused>) {
    let mut kept: Vec<DeviceProfile> = Vec::with_capacity(devices.len());
    let mut refused = Vec::new();
    for device in devices {
        let absurd = timings(&device)
            .into_iter()
            .find(|(_, v)| v.is_finite() && *v > MAX_PROFILE_S)
            .map(|(name, v)| {
                format!("{name} is {v} s, over the {MAX_PROFILE_S} s any device may take")
            });
        let reason = if kept.iter().any(|k| k.id == device.id) {
            Some("the id is used by more than one device".to_owned())
        } else {
            match check_profiles(std::slice::from_ref(&device)) {
                Err(PlacementError::BadProfile { reason, .. }) => Some(reason),
                Err(other) => Some(other.to_string()),
                Ok(()) => absurd,
            }
        };
        match reason {
            Some(reason) => refused.push(Refused {
                device: device.id,
                reason,
            }),
            None => kept.push(device),
        }
    }
    (kept, refused)
}

/// Refuses profiles whose numbers would make costs meaningless.
pub(super) fn check_profiles(devices: &[DeviceProfile]) -> Result<(), PlacementError> {
    for (i, device) in devices.iter().enumerate() {
        let bad = |reason: String| PlacementError::BadProfile {
            device: device.id.clone(),
            reason,
        };
        if devices[..i].iter().any(|other| other.id == device.id) {
            return Err(bad("the id is used by more than one device".into()));
        }
        for (name, value) in timings(device) {
            if !(value.is_finite() && value >= 0.0) {
                return Err(bad(format!(
                    "{name} is {value}, expected a finite time >= 0"
                )));
            }
        }
        // NaN is refused too.
        if device.link_bytes_per_s.is_nan() || device.link_bytes_per_s <= 0.0 {
            return Err(bad(format!(
                "link_bytes_per_s is {}, expected > 0 (infinity for in-process)",
                device.link_bytes_per_s
            )));
        }
        if device.slowdown.is_nan() || device.slowdown < 1.0 {
            return Err(bad(format!(
                "slowdown is {}, expected >= 1 (infinity for do-not-use)",
                device.slowdown
            )));
        }
    }
    Ok(())
}

pub(super) fn check_model(model: &ModelCost) -> Result<(), PlacementError> {
    if model.n_layers == 0 {
        return Err(PlacementError::BadModel("the model has no layers".into()));
    }
    Ok(())
}

/// Marked do-not-use by the slowdown policy.
pub(super) fn avoided(device: &DeviceProfile) -> bool {
    device.slowdown == f64::INFINITY
}

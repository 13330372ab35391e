//! What lending a device would cost its owner, told before they press the join page's
//! button: the share of the model it would download and the memory it would hold, from the
//! same sizes placement weighs ([`ModelCost`]) and the memory budget the page would
//! advertise.
//!
//! Placement splits the layers by speed, so the share is given as a range: at least an even
//! split over the devices serving now and this one, at most every layer that fits the
//! budget (with the token embedding, which the first stage holds).

use cairn_engine::placement::ModelCost;
use serde::Serialize;

/// A low and a high figure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Range {
    pub low: u64,
    pub high: u64,
}

/// The share a device of a given memory budget would likely get.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ShareEstimate {
    pub model_layers: usize,
    pub model_bytes: u64,
    /// Devices serving now, beside the one asking.
    pub devices: usize,
    /// Layers it would serve; `high` 0 when not even one fits its budget.
    pub layers: Range,
    /// Weights it would download (once: the page keeps them for next time).
    pub download_bytes: Range,
    /// Memory it would hold while serving: weights, key/value cache and working buffers.
    pub memory_bytes: Range,
}

/// The estimate for a device advertising `budget` bytes joining `devices` serving ones.
pub fn estimate(model: &ModelCost, model_bytes: u64, budget: u64, devices: usize) -> ShareEstimate {
    let n = model.n_layers as u64;
    let per_layer = model.layer_weight_bytes + model.kv_bytes_per_layer;
    let fit = budget
        .checked_sub(model.scratch_bytes)
        .map(|room| room.checked_div(per_layer).unwrap_or(n).min(n))
        .unwrap_or(0);
    let even = n.div_ceil(devices as u64 + 1).min(fit);
    let weights =
        |layers: u64, ends: u64| (layers * model.layer_weight_bytes + ends).min(model_bytes);
    // The most it could get includes the embedding (the first stage's), and the output
    // head too when it would hold every layer (the only stage).
    let ends_high = if fit == 0 {
        0
    } else if fit == n {
        model.first_extra_bytes + model.last_extra_bytes
    } else {
        model.first_extra_bytes
    };
    let download = Range {
        low: weights(even, 0),
        high: weights(fit, ends_high),
    };
    let held = |weights: u64, layers: u64| {
        if layers == 0 {
            0
        } else {
            weights + layers * model.kv_bytes_per_layer + model.scratch_bytes
        }
    };
    ShareEstimate {
        model_layers: model.n_layers,
        model_bytes,
        devices,
        layers: Range {
            low: even,
            high: fit,
        },
        download_bytes: download,
        memory_bytes: Range {
            low: held(download.low, even),
            high: held(download.high, fit),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 30 layers of 3 MB weights and 1 MB cache, a 20 MB embedding, a 1 MB head
    /// (tied), 5 MB of working buffers: 116 MB in all.
    fn model() -> ModelCost {
        ModelCost {
            n_layers: 30,
            layer_weight_bytes: 3 << 20,
            kv_bytes_per_layer: 1 << 20,
            first_extra_bytes: 20 << 20,
            last_extra_bytes: 1 << 20,
            scratch_bytes: 5 << 20,
            activation_bytes: 2304,
            token_bytes: 4,
            concurrency: 1,
        }
    }

    const FILE: u64 = 116 << 20;

    #[test]
    fn a_roomy_device_alone_may_get_the_whole_model() {
        let e = estimate(&model(), FILE, 1 << 30, 0);
        assert_eq!(e.layers, Range { low: 30, high: 30 });
        assert_eq!(e.download_bytes.low, 90 << 20);
        assert_eq!(e.download_bytes.high, 111 << 20);
        assert_eq!(e.memory_bytes.high, (111 + 30 + 5) << 20);
    }

    #[test]
    fn more_devices_lower_the_least_share_and_the_budget_caps_the_most() {
        // 45 MB: 10 layers of 4 MB after the 5 MB of buffers.
        let e = estimate(&model(), FILE, 45 << 20, 2);
        assert_eq!(e.layers, Range { low: 10, high: 10 });
        let e = estimate(&model(), FILE, 45 << 20, 5);
        assert_eq!(e.layers, Range { low: 5, high: 10 });
        assert_eq!(
            e.download_bytes,
            Range {
                low: 15 << 20,
                high: (30 + 20) << 20
            }
        );
        assert_eq!(
            e.memory_bytes,
            Range {
                low: (15 + 5 + 5) << 20,
                high: (50 + 10 + 5) << 20
            }
        );
    }

    #[test]
    fn a_device_too_small_for_one_layer_gets_nothing() {
        let e = estimate(&model(), FILE, 8 << 20, 0);
        assert_eq!(e.layers, Range { low: 0, high: 0 });
        assert_eq!(e.download_bytes, Range { low: 0, high: 0 });
        assert_eq!(e.memory_bytes, Range { low: 0, high: 0 });
    }
}

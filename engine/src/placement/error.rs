use thiserror::Error;

/// Why no placement could be made, or why a given one was refused.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlacementError {
    /// No device was offered, or every one is marked do-not-use.
    #[error(
        "no usable devices: {offered} offered, {avoided} of them marked do-not-use (slowdown infinite)"
    )]
    NoDevices { offered: usize, avoided: usize },
    /// The usable devices cannot hold the model in any split.
    #[error(
        "model does not fit: it needs at least {needed_bytes} bytes, the {devices} usable devices have {available_bytes} bytes in total; {reason}"
    )]
    DoesNotFit {
        /// The model on one stage: layers × (weights + KV) + embedding +
        /// head + scratch. Every further stage adds its own scratch.
        needed_bytes: u64,
        /// Sum of the usable (not do-not-use) devices' memory.
        available_bytes: u64,
        devices: usize,
        reason: String,
    },
    /// A device's profile cannot be used (NaN, negative time, zero
    /// bandwidth, slowdown below 1, duplicate id).
    #[error("device {device:?}: {reason}")]
    BadProfile { device: String, reason: String },
    /// The model description cannot be placed (no layers).
    #[error("bad model: {0}")]
    BadModel(String),
    /// A manual placement is not valid: gaps, overlaps, unknown or repeated
    /// devices, empty or out-of-range stages, memory over a device's limit.
    #[error("bad placement: {0}")]
    BadStages(String),
}

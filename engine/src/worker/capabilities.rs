use serde::{Deserialize, Serialize};

use crate::device::DeviceInfo;

/// Whether a peer serves layers or coordinates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Worker,
    Coordinator,
}

/// Where a peer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerKind {
    Native,
    Browser,
}

/// What a peer advertises about itself in `Hello.capabilities` (as JSON).
/// Native and browser workers use this same schema.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Capabilities {
    pub role: Role,
    pub kind: PeerKind,
    /// `wgpu` or `cpu`.
    pub backend: String,
    pub device: DeviceInfo,
    /// Every local device the worker splits its layers over, when it drives more than one
    /// (`device` is the first of them); empty for a one-device worker.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceInfo>,
    /// Bytes this peer offers for weights, KV caches and scratch.
    pub memory_budget_bytes: u64,
    /// Ids (`gguf::model_id`) of the model files this peer holds locally.
    #[serde(default)]
    pub models: Vec<String>,
    /// The peer's Cairn version.
    pub version: String,
    /// Anything else (a browser's adapter info, battery, visibility, pressure).
    #[serde(default)]
    pub extra: serde_json::Value,
}

impl Capabilities {
    /// A worker's capabilities for `device`, offering `budget_fraction` of its memory.
    pub fn worker(kind: PeerKind, device: &DeviceInfo, budget_fraction: f64) -> Capabilities {
        Capabilities {
            role: Role::Worker,
            kind,
            backend: device.backend.name().to_owned(),
            device: device.clone(),
            devices: Vec::new(),
            memory_budget_bytes: (device.memory_bytes as f64 * budget_fraction.clamp(0.0, 1.0))
                as u64,
            models: Vec::new(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            extra: serde_json::Value::Null,
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| "{}".into())
    }

    /// Parses what a peer sent; the error says what is wrong with it.
    pub fn from_json(s: &str) -> Result<Capabilities, serde_json::Error> {
        serde_json::from_str(s)
    }
}

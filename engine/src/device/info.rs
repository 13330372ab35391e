//! What Cairn knows about one device: identity, limits, features, memory and support class.

use serde::{Deserialize, Serialize};

use crate::backend::BackendKind;
/// Test code across the crate builds CPU devices from this description (the cuda backend's
/// tests, so unused in builds without it).
#[cfg(test)]
#[allow(unused_imports)]
pub(crate) use crate::backend::cpu_discover::describe as describe_cpu;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Support {
    /// Expected to run every kernel at a useful speed.
    Full,
    /// Runs correctly, with a known limitation (slow, small buffers, ...).
    Partial,
    /// Might work; not tested by Cairn.
    Experimental,
    /// Cannot run Cairn's kernels.
    Unsupported,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vendor(pub String);

impl Vendor {
    pub(crate) fn from_pci(id: u32, name: &str, software: bool) -> Vendor {
        let v = match id {
            0x10de => "NVIDIA",
            0x1002 | 0x1022 => "AMD",
            0x8086 => "Intel",
            0x106b => "Apple",
            0x5143 => "Qualcomm",
            0x13b5 => "ARM",
            0x1010 => "Imagination",
            0x14e4 => "Broadcom",
            0x10005 => "Mesa",
            _ if software => "software",
            _ if name.contains("Apple") => "Apple",
            _ => "unknown",
        };
        Vendor(v.to_string())
    }
}

/// One device as `cairn devices --json` reports it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// Stable across runs on the same machine: derived from the API, PCI ids, bus and name.
    pub id: String,
    pub name: String,
    pub vendor: Vendor,
    /// The engine backend that runs it: `wgpu` or `cpu` (later `cuda`, `vulkan`).
    pub backend: BackendKind,
    /// The graphics API under wgpu (`vulkan`, `metal`, `dx12`, `gl`, `webgpu`), or `cpu`.
    pub api: String,
    /// `discrete`, `integrated`, `virtual`, `cpu` (a software adapter or the CPU itself), `other`.
    pub device_type: String,
    pub driver: String,
    pub memory_bytes: u64,
    /// True when the platform reported the figure (Vulkan memory heaps, the OS for the CPU).
    pub memory_exact: bool,
    /// What the driver says this process may still allocate on the device-local heaps
    /// (VK_EXT_memory_budget, read at discovery), where it says so: the `vulkan` backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_budget_bytes: Option<u64>,
    pub support: Support,
    pub support_reason: String,
    pub features: Vec<String>,
    pub limits: DeviceLimits,
    /// Logical cores, for the CPU device.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cores: Option<u32>,
    /// What the CUDA driver reports, for `cuda` devices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<CudaProps>,
}

/// A `cuda` device as the CUDA driver describes it at discovery.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaProps {
    /// `major.minor`, e.g. `9.0` for Hopper.
    pub compute_capability: String,
    pub multiprocessors: u32,
    /// Peak SM clock.
    pub clock_mhz: u32,
    pub memory_clock_mhz: u32,
    pub memory_bus_bits: u32,
    pub l2_bytes: u64,
    /// Free device memory at discovery (cuMemGetInfo), exact.
    pub free_bytes: u64,
    pub total_bytes: u64,
    pub pci_bus_id: String,
    /// The CUDA version the driver implements, `major.minor`.
    pub driver_version: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DeviceLimits {
    pub max_buffer_size: u64,
    pub max_storage_buffer_binding_size: u64,
    pub max_storage_buffers_per_shader_stage: u32,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_invocations_per_workgroup: u32,
    pub max_compute_workgroup_size_x: u32,
    pub max_compute_workgroups_per_dimension: u32,
    pub min_uniform_buffer_offset_alignment: u32,
    pub subgroup_min_size: u32,
    pub subgroup_max_size: u32,
}

impl DeviceInfo {
    /// Software rasterizers exposed as GPUs (lavapipe, llvmpipe, SwiftShader, WARP).
    pub fn is_software(&self) -> bool {
        self.backend != BackendKind::Cpu && self.device_type == "cpu"
    }

    /// Higher is preferred by automatic selection.
    pub(crate) fn rank(&self) -> u32 {
        let support = match self.support {
            Support::Full => 300,
            Support::Partial => 200,
            Support::Experimental => 100,
            Support::Unsupported => 0,
        };
        let kind = match self.device_type.as_str() {
            "discrete" => 40,
            "integrated" => 30,
            "virtual" => 20,
            _ if self.backend == BackendKind::Cpu => 15,
            _ => 10,
        };
        let api = match self.api.as_str() {
            "vulkan" | "metal" | "dx12" | "webgpu" | "cuda" => 2,
            _ => 0,
        };
        // Where a vendor fast path is compiled in, it wins over wgpu on the same GPU: `cuda`
        // first (it measured fastest on NVIDIA, docs/cuda.md), then raw `vulkan`.
        let fast = match self.backend {
            BackendKind::Cuda => 2,
            BackendKind::Vulkan => 1,
            _ => 0,
        };
        support + kind + api + fast
    }
}

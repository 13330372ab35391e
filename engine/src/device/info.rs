//! What Cairn knows about one device: identity, limits, features, memory and support class.

use serde::{Deserialize, Serialize};

use crate::backend::BackendKind;

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
    fn from_pci(id: u32, name: &str, software: bool) -> Vendor {
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

/// Cairn's kernels need these; an adapter without them is unsupported.
const MIN_STORAGE_BUFFERS: u32 = 4;
const MIN_INVOCATIONS: u32 = 256;
const MIN_WORKGROUP_STORAGE: u32 = 16 * 1024;
/// Below this, large models need many small shards.
const COMFORTABLE_BINDING: u64 = 256 << 20;

pub(crate) fn describe_adapter(
    adapter: &wgpu::Adapter,
    index: usize,
    earlier: &[DeviceInfo],
) -> DeviceInfo {
    let ai = adapter.get_info();
    let limits = adapter.limits();
    let feats = adapter.features();
    let api = match ai.backend {
        wgpu::Backend::Vulkan => "vulkan",
        wgpu::Backend::Metal => "metal",
        wgpu::Backend::Dx12 => "dx12",
        wgpu::Backend::Gl => "gl",
        wgpu::Backend::BrowserWebGpu => "webgpu",
        _ => "other",
    };
    let device_type = match ai.device_type {
        wgpu::DeviceType::DiscreteGpu => "discrete",
        wgpu::DeviceType::IntegratedGpu => "integrated",
        wgpu::DeviceType::VirtualGpu => "virtual",
        wgpu::DeviceType::Cpu => "cpu",
        wgpu::DeviceType::Other => "other",
    };
    let lname = ai.name.to_ascii_lowercase();
    let software = device_type == "cpu"
        || ["llvmpipe", "lavapipe", "swiftshader", "softpipe", "warp"]
            .iter()
            .any(|s| lname.contains(s));
    let device_type = if software { "cpu" } else { device_type };

    let mut features = Vec::new();
    for (f, name) in [
        (wgpu::Features::SHADER_F16, "shader-f16"),
        (wgpu::Features::SUBGROUP, "subgroups"),
        (wgpu::Features::SUBGROUP_BARRIER, "subgroup-barrier"),
        (wgpu::Features::TIMESTAMP_QUERY, "timestamp-query"),
        (wgpu::Features::SHADER_INT64, "shader-int64"),
        (wgpu::Features::IMMEDIATES, "immediates"),
    ] {
        if feats.contains(f) {
            features.push(name.to_string());
        }
    }

    let dl = DeviceLimits {
        max_buffer_size: limits.max_buffer_size,
        max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
        max_storage_buffers_per_shader_stage: limits.max_storage_buffers_per_shader_stage,
        max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
        max_compute_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
        max_compute_workgroup_size_x: limits.max_compute_workgroup_size_x,
        max_compute_workgroups_per_dimension: limits.max_compute_workgroups_per_dimension,
        min_uniform_buffer_offset_alignment: limits.min_uniform_buffer_offset_alignment,
        subgroup_min_size: ai.subgroup_min_size,
        subgroup_max_size: ai.subgroup_max_size,
    };

    let (memory_bytes, memory_exact) = memory_of(adapter, &dl, device_type);

    let (support, support_reason) = if dl.max_storage_buffers_per_shader_stage < MIN_STORAGE_BUFFERS
        || dl.max_compute_invocations_per_workgroup < MIN_INVOCATIONS
        || dl.max_compute_workgroup_storage_size < MIN_WORKGROUP_STORAGE
    {
        (
            Support::Unsupported,
            format!(
                "needs {MIN_STORAGE_BUFFERS} storage buffers per stage, {MIN_INVOCATIONS} invocations and {MIN_WORKGROUP_STORAGE} bytes of workgroup storage; has {}, {} and {}",
                dl.max_storage_buffers_per_shader_stage,
                dl.max_compute_invocations_per_workgroup,
                dl.max_compute_workgroup_storage_size
            ),
        )
    } else if api == "gl" {
        (
            Support::Experimental,
            "OpenGL ES compute through wgpu is untested by Cairn; prefer Vulkan".into(),
        )
    } else if software {
        (
            Support::Partial,
            "software rasterizer on the CPU: correct but much slower than the cpu backend".into(),
        )
    } else if dl.max_storage_buffer_binding_size < COMFORTABLE_BINDING {
        (
            Support::Partial,
            format!(
                "storage bindings are capped at {} MiB, so large weight matrices must be split",
                dl.max_storage_buffer_binding_size >> 20
            ),
        )
    } else {
        (
            Support::Full,
            format!("{api} compute with all required limits"),
        )
    };

    // The bus id pins a physical slot; name and driver tell apart what shares it (the GL and
    // Vulkan views of one GPU get different ids through `api`).
    let key = format!(
        "{api}|{:x}|{:x}|{}|{}|{}",
        ai.vendor, ai.device, ai.device_pci_bus_id, ai.name, ai.driver
    );
    let mut id = format!("{}-{:08x}", short_api(api), fnv1a(key.as_bytes()) as u32);
    let dupes = earlier.iter().filter(|d| d.id.starts_with(&id)).count();
    if dupes > 0 {
        id = format!("{id}-{dupes}");
    }
    let _ = index;

    let driver = match (ai.driver.is_empty(), ai.driver_info.is_empty()) {
        (false, false) => format!("{} {}", ai.driver, ai.driver_info),
        (false, true) => ai.driver.clone(),
        (true, false) => ai.driver_info.clone(),
        (true, true) => String::new(),
    };

    DeviceInfo {
        id,
        name: ai.name.clone(),
        vendor: Vendor::from_pci(ai.vendor, &ai.name, software),
        backend: BackendKind::Wgpu,
        api: api.to_string(),
        device_type: device_type.to_string(),
        driver,
        memory_bytes,
        memory_exact,
        memory_budget_bytes: None,
        support,
        support_reason,
        features,
        limits: dl,
        cores: None,
        cuda: None,
    }
}

fn short_api(api: &str) -> &str {
    match api {
        "vulkan" => "vk",
        "metal" => "mtl",
        "webgpu" => "web",
        other => other,
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn memory_of(adapter: &wgpu::Adapter, limits: &DeviceLimits, device_type: &str) -> (u64, bool) {
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(bytes) = super::vulkan_memory::device_local_bytes(adapter) {
        return (bytes, true);
    }
    let _ = adapter;
    // No exact figure: integrated and software devices share system memory; for discrete
    // ones the largest buffer is the best lower bound the API gives.
    let system = system_memory().map(|(b, _)| b).unwrap_or(0);
    let est = match device_type {
        "integrated" | "cpu" if system > 0 => system / 2,
        _ => limits
            .max_buffer_size
            .min(system.max(limits.max_buffer_size)),
    };
    (est, false)
}

/// Total system memory, and whether the OS reported it.
pub(crate) fn system_memory() -> Option<(u64, bool)> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some((kb * 1024, true))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

pub(crate) fn describe_cpu() -> DeviceInfo {
    let cores = {
        #[cfg(not(target_arch = "wasm32"))]
        {
            std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
        }
        #[cfg(target_arch = "wasm32")]
        {
            1
        }
    };
    let (memory_bytes, memory_exact) = system_memory().unwrap_or((4 << 30, false));
    DeviceInfo {
        id: "cpu".into(),
        name: cpu_name().unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH)),
        vendor: Vendor(cpu_vendor().unwrap_or_else(|| "unknown".into())),
        backend: BackendKind::Cpu,
        api: "cpu".into(),
        device_type: "cpu".into(),
        driver: format!("cairn cpu backend ({})", std::env::consts::ARCH),
        memory_bytes,
        memory_exact,
        memory_budget_bytes: None,
        support: Support::Full,
        support_reason: "reference backend: every kernel, multi-threaded".into(),
        features: Vec::new(),
        limits: DeviceLimits::default(),
        cores: Some(cores),
        cuda: None,
    }
}

fn cpuinfo_field(key: &str) -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        let line = text.lines().find(|l| l.starts_with(key))?;
        Some(line.split_once(':')?.1.trim().to_string())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = key;
        None
    }
}

fn cpu_name() -> Option<String> {
    cpuinfo_field("model name")
}

fn cpu_vendor() -> Option<String> {
    let v = cpuinfo_field("vendor_id")?;
    Some(
        match v.as_str() {
            "GenuineIntel" => "Intel",
            "AuthenticAMD" => "AMD",
            other => other,
        }
        .to_string(),
    )
}

//! wgpu adapters as devices: enumerating them on the backends asked for, identity, limits,
//! features, memory (exact from Vulkan's heaps where the API is Vulkan) and support class.

use crate::backend::BackendKind;
use crate::device::info::DeviceLimits;
use crate::device::{DeviceInfo, Support, Vendor};
use crate::options::{EngineOptions, WgpuLimits};

/// Every adapter wgpu offers, described, in enumeration order, each with its adapter.
pub(crate) async fn discover(opts: &EngineOptions) -> Vec<(DeviceInfo, wgpu::Adapter)> {
    let instance = instance(opts);
    #[cfg_attr(not(target_arch = "wasm32"), allow(unused_mut))]
    let mut adapters: Vec<wgpu::Adapter> = instance.enumerate_adapters(wgpu::Backends::all()).await;
    #[cfg(target_arch = "wasm32")]
    if adapters.is_empty() {
        // Browsers hand out one adapter through request_adapter only.
        if let Ok(a) = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
        {
            adapters.push(a);
        }
    }
    // naga compiles it everywhere (to the device's integer dot products, or shifts and
    // multiplies); a browser's compiler may not.
    let packed_dot = instance
        .wgsl_language_features()
        .contains(wgpu::WgslLanguageFeatures::Packed4x8IntegerDotProduct);
    let mut found: Vec<(DeviceInfo, wgpu::Adapter)> = Vec::new();
    for adapter in adapters {
        let earlier: Vec<&str> = found.iter().map(|(d, _)| d.id.as_str()).collect();
        let mut info = describe_adapter(&adapter, &earlier, packed_dot);
        force_limits(&mut info, &opts.wgpu.limits);
        found.push((info, adapter));
    }
    found
}

/// What `limits` forces on a device: its description says what it will be opened with
/// (`WgpuBackend::open` and the `vulkan` backend request the limits and features listed here).
pub(crate) fn force_limits(info: &mut DeviceInfo, limits: &WgpuLimits) {
    let l = &mut info.limits;
    (l.max_storage_buffer_binding_size, l.max_buffer_size) =
        limits.binding_and_buffer(l.max_storage_buffer_binding_size, l.max_buffer_size);
    if limits.webgpu_defaults {
        let d = wgpu::Limits::default();
        l.max_compute_workgroup_storage_size = l
            .max_compute_workgroup_storage_size
            .min(d.max_compute_workgroup_storage_size);
        l.max_compute_invocations_per_workgroup = l
            .max_compute_invocations_per_workgroup
            .min(d.max_compute_invocations_per_workgroup);
        l.max_compute_workgroup_size_x = l
            .max_compute_workgroup_size_x
            .min(d.max_compute_workgroup_size_x);
        l.max_storage_buffers_per_shader_stage = l
            .max_storage_buffers_per_shader_stage
            .min(d.max_storage_buffers_per_shader_stage);
        l.max_compute_workgroups_per_dimension = l
            .max_compute_workgroups_per_dimension
            .min(d.max_compute_workgroups_per_dimension);
        // Optional features are off in WebGPU unless asked for; a phone may lack all of them.
        info.features
            .retain(|f| !matches!(f.as_str(), "shader-f16" | "subgroups" | "subgroup-barrier"));
    }
}

/// The limits to open `adapter` with: its own, lowered to what `info` lists (see
/// [`force_limits`]).
pub(crate) fn device_limits(adapter: &wgpu::Adapter, info: &DeviceInfo) -> wgpu::Limits {
    let mut l = adapter.limits();
    let d = &info.limits;
    l.max_storage_buffer_binding_size = l
        .max_storage_buffer_binding_size
        .min(d.max_storage_buffer_binding_size);
    l.max_buffer_size = l.max_buffer_size.min(d.max_buffer_size);
    l.max_compute_workgroup_storage_size = l
        .max_compute_workgroup_storage_size
        .min(d.max_compute_workgroup_storage_size);
    l.max_compute_invocations_per_workgroup = l
        .max_compute_invocations_per_workgroup
        .min(d.max_compute_invocations_per_workgroup);
    l.max_compute_workgroup_size_x = l
        .max_compute_workgroup_size_x
        .min(d.max_compute_workgroup_size_x);
    l.max_storage_buffers_per_shader_stage = l
        .max_storage_buffers_per_shader_stage
        .min(d.max_storage_buffers_per_shader_stage);
    l.max_compute_workgroups_per_dimension = l
        .max_compute_workgroups_per_dimension
        .min(d.max_compute_workgroups_per_dimension);
    l
}

/// `wanted` less the features `info` does not list (see [`force_limits`]).
pub(crate) fn device_features(wanted: wgpu::Features, info: &DeviceInfo) -> wgpu::Features {
    let has = |f: &str| info.features.iter().any(|g| g == f);
    let mut out = wanted;
    for (f, name) in [
        (wgpu::Features::SHADER_F16, "shader-f16"),
        (wgpu::Features::SUBGROUP, "subgroups"),
        (wgpu::Features::SUBGROUP_BARRIER, "subgroup-barrier"),
    ] {
        if !has(name) {
            out.remove(f);
        }
    }
    out
}

/// wgpu's other settings come from its own variables (`WGPU_VALIDATION`, ...); the backends
/// are the options', else `WGPU_BACKEND`'s, else all of them.
fn instance(opts: &EngineOptions) -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    desc.backends = match opts.wgpu_backends {
        Some(b) => b,
        None => wgpu::Backends::from_env().unwrap_or(wgpu::Backends::all()),
    };
    wgpu::Instance::new(desc)
}

/// Cairn's kernels need these; an adapter without them is unsupported.
const MIN_STORAGE_BUFFERS: u32 = 4;
const MIN_INVOCATIONS: u32 = 256;
const MIN_WORKGROUP_STORAGE: u32 = 16 * 1024;
/// Below this, large models need many small shards.
const COMFORTABLE_BINDING: u64 = 256 << 20;

/// `packed_dot`: WGSL's `packed_4x8_integer_dot_product` compiles here.
fn describe_adapter(adapter: &wgpu::Adapter, earlier: &[&str], packed_dot: bool) -> DeviceInfo {
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
    if packed_dot {
        features.push(super::PACKED_DOT_FEATURE.to_string());
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
    let dupes = earlier.iter().filter(|e| e.starts_with(&id)).count();
    if dupes > 0 {
        id = format!("{id}-{dupes}");
    }

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
    if let Some(bytes) = device_local_bytes(adapter) {
        return (bytes, true);
    }
    let _ = adapter;
    // No exact figure: integrated and software devices share system memory; for discrete
    // ones the largest buffer is the best lower bound the API gives.
    let system = crate::backend::cpu_discover::system_memory()
        .map(|(b, _)| b)
        .unwrap_or(0);
    let est = match device_type {
        "integrated" | "cpu" if system > 0 => system / 2,
        _ => limits
            .max_buffer_size
            .min(system.max(limits.max_buffer_size)),
    };
    (est, false)
}

/// Sum of the device-local heaps of a Vulkan adapter, read through wgpu's HAL (exact, where
/// wgpu's limits only bound it); `None` for other APIs.
#[cfg(not(target_arch = "wasm32"))]
fn device_local_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
    if adapter.get_info().backend != wgpu::Backend::Vulkan {
        return None;
    }
    // SAFETY: the HAL adapter is only borrowed for the duration of this call and used for a
    // read-only query; the wgpu adapter it came from outlives it.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let instance = hal.shared_instance().raw_instance();
    // SAFETY: the physical device handle comes from this instance and stays valid while the
    // adapter lives.
    let props =
        unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
    let heaps = &props.memory_heaps[..props.memory_heap_count as usize];
    let bytes: u64 = heaps
        .iter()
        .filter(|h| h.flags.contains(ash::vk::MemoryHeapFlags::DEVICE_LOCAL))
        .map(|h| h.size)
        .sum();
    (bytes > 0).then_some(bytes)
}

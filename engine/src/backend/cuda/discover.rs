//! `cuda:N` devices as the CUDA driver reports them: name, compute capability, exact total
//! and free memory, multiprocessors and clocks.

use cudarc::driver::result;
use cudarc::driver::sys::CUdevice_attribute as A;

use super::driver;
use crate::backend::BackendKind;
use crate::device::info::{CudaProps, DeviceLimits};
use crate::device::{DeviceInfo, Support, Vendor};

/// The oldest compute capability the kernels are written for (warp shuffles with masks,
/// stream-ordered frees where offered).
const MIN_CC: (i32, i32) = (6, 0);

/// The ordinal in an id `cuda:N`.
pub(crate) fn ordinal_of(id: &str) -> Option<usize> {
    id.strip_prefix("cuda:")?.parse().ok()
}

/// Every CUDA device, or none and the reason (no driver, no device, a driver error). Never
/// panics: a driver too old for a symbol the bindings expect is reported as a reason.
pub(crate) fn discover() -> (Vec<DeviceInfo>, Option<String>) {
    if !driver::driver_present() {
        let why = "libcuda not found (no NVIDIA driver)".to_string();
        tracing::debug!("cuda: {why}; no cuda devices");
        return (Vec::new(), Some(why));
    }
    // cudarc panics when a symbol is missing from the loaded library; a listing must not.
    let found = std::panic::catch_unwind(list);
    let (devices, why) = match found {
        Ok(Ok(d)) if d.is_empty() => (d, Some("the CUDA driver reports no device".to_string())),
        Ok(Ok(d)) => (d, None),
        Ok(Err(e)) => (Vec::new(), Some(e)),
        Err(_) => (
            Vec::new(),
            Some("the CUDA driver lacks a function the bindings need (driver too old?)".into()),
        ),
    };
    if let Some(why) = &why {
        tracing::info!("cuda: {why}; no cuda devices");
    }
    (devices, why)
}

fn list() -> Result<Vec<DeviceInfo>, String> {
    result::init().map_err(|e| format!("cuInit failed: {e}"))?;
    let count = result::device::get_count().map_err(|e| format!("cuDeviceGetCount: {e}"))?;
    let version = driver::driver_version().unwrap_or(0);
    let nvrtc = driver::nvrtc_present();
    let mut out = Vec::new();
    for ordinal in 0..count.max(0) as usize {
        match describe(ordinal, version, nvrtc) {
            Ok(info) => out.push(info),
            Err(e) => tracing::info!(ordinal, "cuda: device not listed: {e}"),
        }
    }
    Ok(out)
}

fn describe(ordinal: usize, version: i32, nvrtc: bool) -> Result<DeviceInfo, String> {
    let dev = result::device::get(ordinal as i32).map_err(|e| e.to_string())?;
    let name = result::device::get_name(dev).map_err(|e| e.to_string())?;
    let attr = |a| driver::attribute(dev, a);
    let cc = (
        attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
        attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
    );
    let total = driver::total_memory(dev).map_err(|e| e.to_string())? as u64;
    // Free memory needs a context: the primary one, retained only for the query.
    let free = {
        let ctx = driver::Context::open(ordinal).map_err(|e| e.to_string())?;
        let r = result::mem_get_info().map_err(|e| e.to_string());
        drop(ctx);
        r?.0 as u64
    };
    let props = CudaProps {
        compute_capability: format!("{}.{}", cc.0, cc.1),
        multiprocessors: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) as u32,
        clock_mhz: (attr(A::CU_DEVICE_ATTRIBUTE_CLOCK_RATE) / 1000) as u32,
        memory_clock_mhz: (attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE) / 1000) as u32,
        memory_bus_bits: attr(A::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH) as u32,
        l2_bytes: attr(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE) as u64,
        free_bytes: free,
        total_bytes: total,
        pci_bus_id: driver::pci_bus_id(dev).unwrap_or_default(),
        driver_version: format!("{}.{}", version / 1000, (version % 1000) / 10),
    };
    let integrated = attr(A::CU_DEVICE_ATTRIBUTE_INTEGRATED) != 0;
    let mut features = vec![format!("sm_{}{}", cc.0, cc.1), "graphs".to_string()];
    if attr(A::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED) != 0 {
        features.push("memory-pools".into());
    }
    if nvrtc {
        features.push("nvrtc".into());
    }
    let targetable =
        nvrtc && super::compile::target_arch(cc, &super::compile::supported_archs()).is_some();
    let (support, support_reason) = support(cc, nvrtc, targetable, &props);
    let shared = attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK) as u32;
    Ok(DeviceInfo {
        id: format!("cuda:{ordinal}"),
        name,
        vendor: Vendor("NVIDIA".into()),
        backend: BackendKind::Cuda,
        api: "cuda".into(),
        device_type: if integrated { "integrated" } else { "discrete" }.into(),
        driver: format!("CUDA driver {}", props.driver_version),
        memory_bytes: total,
        memory_exact: true,
        memory_budget_bytes: Some(free),
        support,
        support_reason,
        features,
        limits: DeviceLimits {
            max_buffer_size: total,
            max_storage_buffer_binding_size: total,
            max_storage_buffers_per_shader_stage: u32::MAX,
            max_compute_workgroup_storage_size: shared,
            max_compute_invocations_per_workgroup: attr(
                A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            ) as u32,
            max_compute_workgroup_size_x: attr(A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X) as u32,
            max_compute_workgroups_per_dimension: attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)
                as u32,
            min_uniform_buffer_offset_alignment: 0,
            subgroup_min_size: 32,
            subgroup_max_size: 32,
        },
        cores: None,
        cuda: Some(props),
    })
}

/// Whether the kernels can run: a new enough GPU and the run-time compiler.
fn support(cc: (i32, i32), nvrtc: bool, targetable: bool, p: &CudaProps) -> (Support, String) {
    if cc < MIN_CC {
        return (
            Support::Unsupported,
            format!(
                "compute capability {}.{} is below the {}.{} the kernels need",
                cc.0, cc.1, MIN_CC.0, MIN_CC.1
            ),
        );
    }
    if !nvrtc {
        return (
            Support::Unsupported,
            "libnvrtc not found: the kernels are compiled at run time (install the CUDA runtime compiler)".into(),
        );
    }
    if !targetable {
        return (
            Support::Unsupported,
            format!(
                "this libnvrtc cannot compile for compute capability {}.{} or older",
                cc.0, cc.1
            ),
        );
    }
    (
        Support::Full,
        format!(
            "CUDA {} on sm_{}{}, {} SMs at {} MHz; NVRTC kernels, graph replay",
            p.driver_version, cc.0, cc.1, p.multiprocessors, p.clock_mhz
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_back_to_ordinals() {
        assert_eq!(ordinal_of("cuda:0"), Some(0));
        assert_eq!(ordinal_of("cuda:12"), Some(12));
        assert_eq!(ordinal_of("vulkan:0"), None);
        assert_eq!(ordinal_of("cuda:x"), None);
    }

    #[test]
    fn support_needs_a_new_enough_gpu_and_nvrtc() {
        let p = CudaProps::default();
        assert_eq!(support((5, 2), true, true, &p).0, Support::Unsupported);
        assert_eq!(support((9, 0), false, false, &p).0, Support::Unsupported);
        assert!(support((9, 0), false, false, &p).1.contains("libnvrtc"));
        assert_eq!(support((7, 0), true, false, &p).0, Support::Unsupported);
        assert_eq!(support((9, 0), true, true, &p).0, Support::Full);
    }

    #[test]
    fn discovery_never_panics_and_explains_an_empty_list() {
        let (devices, why) = discover();
        assert!(devices.is_empty() == why.is_some(), "{why:?}");
    }
}

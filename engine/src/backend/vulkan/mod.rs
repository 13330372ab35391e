//! The `vulkan` backend: Cairn's WGSL kernels as SPIR-V on a VkDevice this backend creates
//! with ash, executed through the wgpu backend's executor.
//!
//! Why this shape: wgpu 30 can wrap a raw VkDevice (`Adapter::create_device_from_hal`) and
//! take SPIR-V as is (`Features::PASSTHROUGH_SHADERS`), so buffers, queue, readback and the
//! op planner stay the wgpu backend's code while the kernels lose wgpu's per-access checks
//! and gain push constants and subgroup reductions. The VkInstance is wgpu-hal's (it enables
//! the instance extensions the device needs); the VkDevice is ours.
//!
//! Devices are the Vulkan adapters wgpu enumerated, listed a second time as `vulkan:N`.

pub(crate) mod device;
pub(crate) mod props;
pub(crate) mod spirv;

use super::wgpu::WgpuBackend;
use super::{BackendError, BackendKind, Device, Result};
use crate::device::DeviceInfo;
use crate::options::{EngineOptions, VulkanOptions, VulkanZeroInit};

/// A `vulkan:N` entry for each Vulkan adapter among `adapters` (wgpu ids and adapters, in
/// discovery order), described from its wgpu twin in `earlier`; where there is none, why.
pub(crate) fn discover(
    adapters: &[(String, wgpu::Adapter)],
    earlier: &[DeviceInfo],
) -> (Vec<(DeviceInfo, wgpu::Adapter)>, Option<String>) {
    let mut out = Vec::new();
    for (id, adapter) in adapters {
        if adapter.get_info().backend != wgpu::Backend::Vulkan {
            continue;
        }
        let Some(base) = earlier.iter().find(|d| &d.id == id) else {
            continue;
        };
        let Some(props) = props::query(adapter) else {
            tracing::debug!(%id, "no Vulkan properties; not listed for the vulkan backend");
            continue;
        };
        let mut info = base.clone();
        info.id = format!("vulkan:{}", out.len());
        info.backend = BackendKind::Vulkan;
        if props.device_local_bytes > 0 {
            info.memory_bytes = props.device_local_bytes;
            info.memory_exact = true;
        }
        info.memory_budget_bytes = props.budget_bytes;
        info.features.extend(props::feature_names(&props));
        // naga writes dot4I8Packed as Vulkan's integer dot product instructions (no capability
        // list holds it back here): without them the packed-integer kernels stay off.
        if !info.features.iter().any(|f| f == "integer-dot-product") {
            info.features
                .retain(|f| f != crate::backend::wgpu::PACKED_DOT_FEATURE);
        }
        let missing = device::REQUIRED - adapter.features();
        if !missing.is_empty() && info.support != crate::Support::Unsupported {
            info.support = crate::Support::Unsupported;
            info.support_reason = format!("the driver lacks {missing:?} through wgpu");
        } else if info.support != crate::Support::Unsupported {
            info.support_reason = format!(
                "raw Vulkan {}.{}: SPIR-V kernels without bounds checks, cached bind groups{}; {}",
                ash::vk::api_version_major(props.api_version),
                ash::vk::api_version_minor(props.api_version),
                if adapter.features().contains(wgpu::Features::SUBGROUP) {
                    ", subgroup matrix-vector"
                } else {
                    ""
                },
                info.support_reason
            );
        }
        out.push((info, adapter.clone()));
    }
    let why = out
        .is_empty()
        .then(|| "wgpu found no Vulkan adapter with readable properties".to_string());
    (out, why)
}

/// Opens the device behind a `vulkan:N` entry.
pub(crate) fn open(
    adapter: Option<&wgpu::Adapter>,
    info: &DeviceInfo,
    opts: &EngineOptions,
) -> Result<Device> {
    let adapter = adapter.ok_or_else(|| {
        BackendError::Unsupported(format!("{}: no wgpu adapter behind this device", info.id))
    })?;
    // Cooperative matrices where asked for, and for `auto` on GPUs (`WgpuPrefill::ByAdapter`).
    let coop = opts.wgpu.prefill.coop()
        || (opts.wgpu.prefill == crate::options::WgpuPrefill::ByAdapter && !info.is_software());
    open_backend(adapter, info, &opts.vulkan, coop)
        .map(|b| Device::new_wgpu(info.clone(), b.with_options(&opts.wgpu, info)))
}

fn open_backend(
    adapter: &wgpu::Adapter,
    info: &DeviceInfo,
    opts: &VulkanOptions,
    coop: bool,
) -> Result<WgpuBackend> {
    let props = props::query(adapter)
        .ok_or_else(|| BackendError::Unsupported(format!("{}: not a Vulkan adapter", info.id)))?;
    // What the options force (WebGPU's defaults, a smaller binding) is in `info` already.
    let mut features =
        super::wgpu::discover::device_features(adapter.features() & device::WANTED, info);
    // Cooperative matrices only when asked for (`WgpuPrefill::Coop`: an experimental wgpu
    // feature) and where the driver multiplies 16 x 16 x 16 f16 tiles into f32 sums.
    let coop =
        coop && features.contains(wgpu::Features::SHADER_F16) && device::has_coop_f16(adapter);
    if coop {
        features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    }
    if !features.contains(device::REQUIRED) {
        return Err(BackendError::Unsupported(format!(
            "{}: the driver lacks {:?}",
            info.id,
            device::REQUIRED - features
        )));
    }
    let limits = super::wgpu::discover::device_limits(adapter, info);
    let experimental = if coop {
        // SAFETY: asked for only with cooperative matrices, wgpu's one experimental feature
        // here; its shaders are naga's SPIR-V, checked against the reference by the kernels
        // test on the GPU.
        unsafe { wgpu::ExperimentalFeatures::enabled() }
    } else {
        wgpu::ExperimentalFeatures::disabled()
    };
    let open = device::open_raw(adapter, &props, features, &limits)?;
    // SAFETY: `open` was made from this adapter's HAL adapter with exactly `features`, which
    // the adapter supports.
    let (dev, queue) = unsafe {
        adapter.create_device_from_hal(
            open,
            &wgpu::DeviceDescriptor {
                label: Some(&format!("cairn {}", info.id)),
                required_features: features,
                required_limits: limits.clone(),
                memory_hints: wgpu::MemoryHints::Performance,
                experimental_features: experimental,
                ..Default::default()
            },
        )
    }
    .map_err(|e| BackendError::Gpu(format!("create_device_from_hal: {e}")))?;
    let subgroups = features.contains(wgpu::Features::SUBGROUP);
    // Experimental: kernels read zeros from push constants on lavapipe and on the H100 alike
    // (docs/vulkan.md), so they are off unless asked for while that is investigated.
    let push_constants = features.contains(wgpu::Features::IMMEDIATES) && opts.push_constants;
    if push_constants {
        tracing::warn!("vulkan push constants on: known to give wrong results");
    }
    // The driver zeroes workgroup memory where it can, as wgpu's own pipelines let it;
    // naga's polyfill (invocation 0 stores zeros over every workgroup array, then a barrier)
    // elsewhere (docs/vulkan.md, "Against wgpu's own pipelines").
    use naga::back::spv::ZeroInitializeWorkgroupMemoryMode as Zero;
    let zero_init = match opts.zero_init {
        VulkanZeroInit::Polyfill => Zero::Polyfill,
        VulkanZeroInit::Native if props.zero_init_workgroup => Zero::Native,
        VulkanZeroInit::Native => {
            tracing::debug!(id = %info.id, "the driver does not zero workgroup memory itself; the polyfill does");
            Zero::Polyfill
        }
        VulkanZeroInit::Off => Zero::None,
    };
    let fixed_params = opts.fixed_params && !push_constants;
    tracing::info!(id = %info.id, name = %info.name, subgroups, push_constants, coop, ?zero_init, fixed_params, "opened raw Vulkan device");
    let kernels = spirv::SpirvKernels {
        subgroups,
        push_constants,
        coop,
        zero_init,
        fixed_params,
    };
    Ok(WgpuBackend::from_device(dev, queue, limits).with_spirv(kernels))
}

#[cfg(test)]
mod tests {
    use crate::backend::BackendKind;
    use crate::kernels::{Add, BufferCopy, Op};

    /// The first `vulkan:N` device (lavapipe in CI) runs a kernel and a copy, and its buffers
    /// read back what was written. The full kernel suite runs in tests/tests/kernels.rs.
    #[test]
    fn a_vulkan_device_runs_add_and_copy() {
        let found = crate::device::discover_blocking();
        let Some(info) = found
            .devices
            .iter()
            .find(|d| d.backend == BackendKind::Vulkan && d.support != crate::Support::Unsupported)
        else {
            eprintln!("no Vulkan device; skipped");
            return;
        };
        let dev = pollster::block_on(found.open_info(info.clone())).expect("open");
        assert_eq!(dev.kind(), BackendKind::Vulkan);
        let a: Vec<f32> = (0..300).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..300).map(|i| 0.5 * i as f32).collect();
        let ba = dev.upload("a", bytemuck::cast_slice(&a)).expect("upload");
        let bb = dev.upload("b", bytemuck::cast_slice(&b)).expect("upload");
        let out = dev.alloc("out", 1200).expect("alloc");
        let copy = dev.alloc("copy", 1200).expect("alloc");
        dev.run(&[Op::Copy(BufferCopy {
            src: &ba,
            src_offset: 0,
            dst: &copy,
            dst_offset: 0,
            bytes: 1200,
        })])
        .expect("copy");
        assert_eq!(dev.read_f32_blocking(&copy).expect("read"), a);
        for _ in 0..2 {
            dev.run(&[Op::Add(Add {
                a: &ba,
                b: &bb,
                out: &out,
                n: 300,
            })])
            .expect("run");
            let got = dev.read_f32_blocking(&out).expect("read");
            let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            assert_eq!(got, want);
        }
    }
}

//! Opens a VkDevice with ash (the extensions and features wgpu needs plus ours) and wraps it
//! into a wgpu device, so buffers, queue and the executor are wgpu's.

use ash::vk;

use super::props::{MEMORY_BUDGET, VulkanProps};
use crate::backend::{BackendError, Result};

/// wgpu features this backend asks for where the adapter has them; passthrough it needs.
pub(crate) const WANTED: wgpu::Features = wgpu::Features::TIMESTAMP_QUERY
    .union(wgpu::Features::SHADER_F16)
    .union(wgpu::Features::SUBGROUP)
    .union(wgpu::Features::IMMEDIATES)
    .union(wgpu::Features::PASSTHROUGH_SHADERS);
pub(crate) const REQUIRED: wgpu::Features = wgpu::Features::PASSTHROUGH_SHADERS;

/// Whether the adapter multiplies 16 x 16 x 16 f16 cooperative matrices into f32 sums in a
/// subgroup (what `linear_gemm_coop` does): wgpu lists the driver's subgroup-scoped
/// configurations.
pub(crate) fn has_coop_f16(adapter: &wgpu::Adapter) -> bool {
    if !adapter
        .features()
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    {
        return false;
    }
    adapter.cooperative_matrix_properties().iter().any(|c| {
        c.m_size == 16
            && c.n_size == 16
            && c.k_size == 16
            && c.ab_type == wgpu::CooperativeScalarType::F16
            && c.cr_type == wgpu::CooperativeScalarType::F32
    })
}

/// The queue family wgpu-hal's own `open` uses; compute-capable on every Vulkan GPU (the
/// specification requires a graphics-and-compute family, and drivers list it first).
const FAMILY: u32 = 0;

/// Creates the device. `features` must be a subset of the adapter's.
pub(crate) fn open_raw(
    adapter: &wgpu::Adapter,
    props: &VulkanProps,
    features: wgpu::Features,
    limits: &wgpu::Limits,
) -> Result<wgpu::hal::OpenDevice<wgpu::hal::api::Vulkan>> {
    // SAFETY: the guard is dropped at the end of this function, before the wgpu device is
    // made from what it returns; nothing it hands out is destroyed here.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }
        .ok_or_else(|| BackendError::Unsupported("not a Vulkan adapter".into()))?;
    let mut extensions = hal.required_device_extensions(features);
    // Enabled so the budget may be queried for the life of the device (the query itself is
    // on the physical device).
    if props.has(MEMORY_BUDGET) && !extensions.contains(&MEMORY_BUDGET) {
        extensions.push(MEMORY_BUDGET);
    }
    let mut phd_features = hal.physical_device_features(&extensions, features);
    let priorities = [1.0f32];
    let queues = [vk::DeviceQueueCreateInfo::default()
        .queue_family_index(FAMILY)
        .queue_priorities(&priorities)];
    let names: Vec<*const std::ffi::c_char> = extensions.iter().map(|e| e.as_ptr()).collect();
    let info = vk::DeviceCreateInfo::default()
        .queue_create_infos(&queues)
        .enabled_extension_names(&names);
    let info = phd_features.add_to_device_create(info);
    let instance = hal.shared_instance().raw_instance();
    tracing::debug!(?extensions, "creating VkDevice");
    // SAFETY: the physical device comes from this instance; `info` and everything it points
    // to (queue infos, extension names with static lifetime, the feature chain) outlive the
    // call; the extensions are supported (wgpu's list is filtered by support, ours checked).
    let raw = unsafe { instance.create_device(hal.raw_physical_device(), &info, None) }
        .map_err(|e| BackendError::Gpu(format!("vkCreateDevice: {e}")))?;
    // SAFETY: `raw` was created just above from this adapter with `extensions` (a superset of
    // `required_device_extensions(features)`) and `physical_device_features` for them, on
    // queue family FAMILY; with no drop callback wgpu-hal takes ownership and destroys it.
    unsafe {
        hal.device_from_raw(
            raw,
            None,
            &extensions,
            features,
            limits,
            &wgpu::MemoryHints::Performance,
            FAMILY,
            0,
        )
    }
    .map_err(|e| BackendError::Gpu(format!("wrapping the VkDevice for wgpu: {e}")))
}

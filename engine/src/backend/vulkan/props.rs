//! What a Vulkan physical device offers beyond what wgpu reports: extensions, subgroup
//! operations, and the memory budget (VK_EXT_memory_budget).

use std::ffi::CStr;

use ash::vk;

/// Device extensions this backend reports and, where named in `device.rs`, enables.
pub(crate) const MEMORY_BUDGET: &CStr = ash::ext::memory_budget::NAME;
pub(crate) const INTEGER_DOT: &CStr = ash::khr::shader_integer_dot_product::NAME;
pub(crate) const COOPERATIVE_MATRIX: &CStr = ash::khr::cooperative_matrix::NAME;
pub(crate) const SUBGROUP_SIZE_CONTROL: &CStr = ash::ext::subgroup_size_control::NAME;

#[derive(Debug, Clone, Default)]
pub(crate) struct VulkanProps {
    pub(crate) api_version: u32,
    pub(crate) extensions: Vec<String>,
    /// Sum of the device-local heaps' sizes.
    pub(crate) device_local_bytes: u64,
    /// Sum of the device-local heaps' budgets, when the driver has VK_EXT_memory_budget.
    pub(crate) budget_bytes: Option<u64>,
    pub(crate) subgroup_size: u32,
    pub(crate) subgroup_ops: vk::SubgroupFeatureFlags,
    /// The driver zeroes workgroup memory itself (`shaderZeroInitializeWorkgroupMemory`):
    /// only counted on Vulkan 1.3 devices, where wgpu-hal enables the feature on the devices
    /// it (and `device.rs`) creates; it adds no extension for older ones.
    pub(crate) zero_init_workgroup: bool,
}

impl VulkanProps {
    pub(crate) fn has(&self, ext: &CStr) -> bool {
        let name = ext.to_string_lossy();
        self.extensions.iter().any(|e| *e == name)
    }
}

/// Reads the properties of the physical device behind a wgpu Vulkan adapter.
pub(crate) fn query(adapter: &wgpu::Adapter) -> Option<VulkanProps> {
    // SAFETY: the HAL adapter is borrowed for this call only, for read-only queries; the wgpu
    // adapter it belongs to outlives the guard.
    let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
    let shared = hal.shared_instance();
    let instance = shared.raw_instance();
    let phd = hal.raw_physical_device();

    // SAFETY: `phd` was enumerated from `instance`, which stays alive while the adapter does.
    let exts = unsafe { instance.enumerate_device_extension_properties(phd) }.ok()?;
    let extensions: Vec<String> = exts
        .iter()
        .filter_map(|e| e.extension_name_as_c_str().ok())
        .map(|n| n.to_string_lossy().into_owned())
        .collect();
    // SAFETY: as above.
    let base = unsafe { instance.get_physical_device_properties(phd) };
    let mut props = VulkanProps {
        api_version: base.api_version,
        extensions,
        ..Default::default()
    };

    // The *2 queries are core since Vulkan 1.1; wgpu's instance asks for the newest version
    // the loader offers, so they are loaded unless instance and device are both 1.0.
    let v11 = shared.instance_api_version() >= vk::API_VERSION_1_1
        && base.api_version >= vk::API_VERSION_1_1;
    if v11 {
        let mut subgroup = vk::PhysicalDeviceSubgroupProperties::default();
        let mut p2 = vk::PhysicalDeviceProperties2::default().push_next(&mut subgroup);
        // SAFETY: `p2` and its chain live across the call; `phd` belongs to `instance`.
        unsafe { instance.get_physical_device_properties2(phd, &mut p2) };
        props.subgroup_size = subgroup.subgroup_size;
        if subgroup
            .supported_stages
            .contains(vk::ShaderStageFlags::COMPUTE)
        {
            props.subgroup_ops = subgroup.supported_operations;
        }
    }

    if shared.instance_api_version() >= vk::API_VERSION_1_3
        && base.api_version >= vk::API_VERSION_1_3
    {
        let mut v13 = vk::PhysicalDeviceVulkan13Features::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut v13);
        // SAFETY: `f2` and its chain live across the call; `phd` belongs to `instance`, and
        // both are Vulkan 1.3, which defines the chained struct.
        unsafe { instance.get_physical_device_features2(phd, &mut f2) };
        props.zero_init_workgroup = v13.shader_zero_initialize_workgroup_memory == vk::TRUE;
    }

    let has_budget = v11 && props.has(MEMORY_BUDGET);
    let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
    let mut mem2 = vk::PhysicalDeviceMemoryProperties2::default();
    if has_budget {
        mem2 = mem2.push_next(&mut budget);
    }
    if v11 {
        // SAFETY: as above; the budget struct is chained only when the device has the
        // extension, as the specification requires.
        unsafe { instance.get_physical_device_memory_properties2(phd, &mut mem2) };
    } else {
        // SAFETY: as above.
        mem2.memory_properties = unsafe { instance.get_physical_device_memory_properties(phd) };
    }
    let mem = mem2.memory_properties;
    let n = (mem.memory_heap_count as usize).min(vk::MAX_MEMORY_HEAPS);
    let local: Vec<usize> = (0..n)
        .filter(|&i| {
            mem.memory_heaps[i]
                .flags
                .contains(vk::MemoryHeapFlags::DEVICE_LOCAL)
        })
        .collect();
    props.device_local_bytes = local.iter().map(|&i| mem.memory_heaps[i].size).sum();
    if has_budget {
        props.budget_bytes = Some(local.iter().map(|&i| budget.heap_budget[i]).sum());
    }
    Some(props)
}

/// Names for `cairn devices`, in the style of DeviceInfo::features.
pub(crate) fn feature_names(p: &VulkanProps) -> Vec<String> {
    let mut out = vec![
        "spirv-passthrough".to_string(),
        "push-constants".to_string(),
    ];
    if p.budget_bytes.is_some() {
        out.push("memory-budget".into());
    }
    let ops = p.subgroup_ops;
    for (flag, name) in [
        (vk::SubgroupFeatureFlags::ARITHMETIC, "subgroup-arithmetic"),
        (vk::SubgroupFeatureFlags::SHUFFLE, "subgroup-shuffle"),
    ] {
        if ops.contains(flag) {
            out.push(name.into());
        }
    }
    if p.api_version >= vk::API_VERSION_1_3 || p.has(INTEGER_DOT) {
        out.push("integer-dot-product".into());
    }
    if p.has(COOPERATIVE_MATRIX) {
        out.push("cooperative-matrix".into());
    }
    if p.api_version >= vk::API_VERSION_1_3 || p.has(SUBGROUP_SIZE_CONTROL) {
        out.push("subgroup-size-control".into());
    }
    out
}

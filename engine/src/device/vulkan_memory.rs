//! Exact device-local memory from Vulkan's memory heaps, read through wgpu's HAL.

/// Sum of the device-local heaps of a Vulkan adapter; `None` for other APIs.
pub(crate) fn device_local_bytes(adapter: &wgpu::Adapter) -> Option<u64> {
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

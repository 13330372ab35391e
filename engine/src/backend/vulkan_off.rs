//! Stands in for the raw `vulkan` backend in builds without it (the `vulkan` feature off, or
//! wasm32): discovery lists no `vulkan:N` device and says why, and opening one is refused, so
//! callers need no `#[cfg]`.

use super::{BackendError, Device, Result};
use crate::device::DeviceInfo;
use crate::options::EngineOptions;

const NOT_COMPILED: &str = "not compiled in (build with `--features vulkan`)";

pub(crate) fn discover(
    _adapters: &[(String, wgpu::Adapter)],
    _earlier: &[DeviceInfo],
) -> (Vec<(DeviceInfo, wgpu::Adapter)>, Option<String>) {
    (Vec::new(), Some(NOT_COMPILED.into()))
}

pub(crate) fn open(
    _adapter: Option<&wgpu::Adapter>,
    info: &DeviceInfo,
    _opts: &EngineOptions,
) -> Result<Device> {
    Err(BackendError::Unsupported(format!(
        "{}: the vulkan backend is {NOT_COMPILED}",
        info.id
    )))
}

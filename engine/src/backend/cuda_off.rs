//! Stands in for the `cuda` backend in builds without it (the `cuda` feature off, or wasm32):
//! discovery finds no device and says why, and opening one is refused, so callers need no
//! `#[cfg]`.

use super::{BackendError, Device, Result};
use crate::device::DeviceInfo;
use crate::options::EngineOptions;

const NOT_COMPILED: &str = "not compiled in (build with `--features cuda`)";

pub(crate) fn discover() -> (Vec<DeviceInfo>, Option<String>) {
    (Vec::new(), Some(NOT_COMPILED.into()))
}

pub(crate) fn open(info: &DeviceInfo, _opts: &EngineOptions) -> Result<Device> {
    Err(BackendError::Unsupported(format!(
        "{}: the cuda backend is {NOT_COMPILED}",
        info.id
    )))
}

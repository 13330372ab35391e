//! Stands in for the `cuda` backend in builds without it (the `cuda` feature off, or wasm32):
//! discovery finds no device and says why, and opening one is refused. Its `CudaBackend` and
//! `CudaStorage` hold a value of a type that has none, so they never exist: `Device` keeps
//! its cuda variants and dispatch in every build at no cost, and callers need no `#[cfg]`.

use super::{BackendError, Device, Result};
use crate::device::DeviceInfo;
use crate::kernels::Op;
use crate::options::EngineOptions;

const NOT_COMPILED: &str = "not compiled in (build with `--features cuda`)";

/// No value of this type exists.
enum Never {}

pub(crate) struct CudaStorage(Never);

pub(crate) struct CudaBackend(Never);

pub(crate) struct StagedRead(Never);

pub(crate) fn discover() -> (Vec<DeviceInfo>, Option<String>) {
    (Vec::new(), Some(NOT_COMPILED.into()))
}

/// Opens the device behind a `cuda:N` entry: refused, as the backend's is where it cannot run.
pub(crate) fn open(info: &DeviceInfo, opts: &EngineOptions) -> Result<Device> {
    open_backend(info, opts).map(|b| Device::new_cuda(info.clone(), b))
}

fn open_backend(info: &DeviceInfo, _opts: &EngineOptions) -> Result<CudaBackend> {
    Err(BackendError::Unsupported(format!(
        "{}: the cuda backend is {NOT_COMPILED}",
        info.id
    )))
}

impl CudaBackend {
    pub(crate) fn max_buffer_bytes(&self) -> u64 {
        match self.0 {}
    }

    pub(crate) fn alloc(&self, _label: &str, _bytes: u64) -> Result<CudaStorage> {
        match self.0 {}
    }

    pub(crate) fn write(&self, _s: &CudaStorage, _offset: u64, _data: &[u8]) -> Result<()> {
        match self.0 {}
    }

    pub(crate) fn read(&self, _s: &CudaStorage, _offset: u64, _len: u64) -> Result<Vec<u8>> {
        match self.0 {}
    }

    pub(crate) fn sync(&self) -> Result<()> {
        match self.0 {}
    }

    pub(crate) fn pipelines_decode(&self) -> bool {
        match self.0 {}
    }

    pub(crate) fn set_pipelined_decode(&self, _on: bool) {
        match self.0 {}
    }

    pub(crate) fn run_then_read(
        &self,
        _ops: &[Op<'_>],
        _s: &CudaStorage,
        _offset: u64,
        _len: u64,
    ) -> Result<StagedRead> {
        match self.0 {}
    }

    pub(crate) fn collect(&self, read: StagedRead) -> Result<Vec<u8>> {
        match read.0 {}
    }

    pub(crate) fn run(&self, _ops: &[Op<'_>]) -> Result<()> {
        match self.0 {}
    }

    pub(crate) fn run_pieces(&self, _pieces: &[super::peer::Piece<'_>]) -> Result<()> {
        match self.0 {}
    }

    pub(crate) fn enable_peers(_devices: &[&CudaBackend]) -> bool {
        false
    }

    pub(crate) fn launches_in_last_run(&self) -> Option<usize> {
        match self.0 {}
    }

    pub(crate) fn copy_from_peer(
        &self,
        _dst: &CudaStorage,
        _dst_offset: u64,
        _src_dev: &CudaBackend,
        _src: &CudaStorage,
        _src_offset: u64,
        _bytes: u64,
    ) -> Result<bool> {
        match self.0 {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendKind;

    #[test]
    fn a_cuda_device_is_refused_with_the_feature_that_builds_it() {
        let (found, why) = discover();
        assert!(found.is_empty());
        assert_eq!(why.as_deref(), Some(NOT_COMPILED));
        let mut info = crate::device::info::describe_cpu();
        info.backend = BackendKind::Cuda;
        info.id = "cuda:0".into();
        let err = match open(&info, &EngineOptions::default()) {
            Ok(d) => panic!("opened {:?} in a build without cuda", d.kind()),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("--features cuda"), "{err}");
    }
}

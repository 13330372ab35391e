//! The backend abstraction: a [`Device`] owns buffers and runs [`Op`]s.
//!
//! Backends form a closed enum (`wgpu`, `cpu`, and behind cargo features `cuda` and `vulkan`)
//! so callers never need `#[cfg]`: a backend whose feature is off keeps its variant, holding a
//! stand-in type that has no values. Buffers are owned handles freed on drop, with live bytes
//! accounted per device. The API is async because a browser maps GPU buffers asynchronously;
//! native callers can block with the `*_blocking` helpers.

pub mod cpu;
pub(crate) mod cpu_discover;
// Each backend module exists in every build: where its feature is off, a stand-in that finds
// no device and refuses to open one, so `device/` and callers need no `#[cfg]`.
#[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
pub(crate) mod cuda;
#[cfg(not(all(feature = "cuda", not(target_arch = "wasm32"))))]
#[path = "cuda_off.rs"]
pub(crate) mod cuda;
pub mod peer;
pub(crate) mod row_parts;
mod validate;
#[cfg(all(feature = "vulkan", not(target_arch = "wasm32")))]
pub(crate) mod vulkan;
#[cfg(not(all(feature = "vulkan", not(target_arch = "wasm32"))))]
#[path = "vulkan_off.rs"]
pub(crate) mod vulkan;
pub mod wgpu;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::device::DeviceInfo;
use crate::kernels::{BufferCopy, Op, with_op};

pub use validate::validate_op;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{device}: out of memory allocating {bytes} bytes for {label}: {reason}")]
    OutOfMemory {
        device: String,
        label: String,
        bytes: u64,
        reason: String,
    },
    #[error("{label}: {bytes} bytes exceeds the device's largest buffer ({max} bytes)")]
    BufferTooLarge { label: String, bytes: u64, max: u64 },
    #[error("{op}: {reason}")]
    InvalidOp { op: &'static str, reason: String },
    #[error("buffer {label} belongs to another device")]
    ForeignBuffer { label: String },
    #[error("{what}: range {offset}..{end} is outside the {size}-byte buffer {label}")]
    OutOfRange {
        what: &'static str,
        label: String,
        offset: u64,
        end: u64,
        size: u64,
    },
    #[error("device lost: {0}")]
    DeviceLost(String),
    #[error("GPU error: {0}")]
    Gpu(String),
    #[error("{0}")]
    Unsupported(String),
}

pub type Result<T> = std::result::Result<T, BackendError>;

/// Which engine backend a device runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Wgpu,
    Cpu,
    Cuda,
    Vulkan,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
            BackendKind::Vulkan => "vulkan",
        }
    }

    /// Whether this build has the backend (`cuda` and `vulkan` are cargo features).
    pub fn compiled(self) -> bool {
        match self {
            BackendKind::Wgpu | BackendKind::Cpu => true,
            BackendKind::Cuda => cfg!(all(feature = "cuda", not(target_arch = "wasm32"))),
            BackendKind::Vulkan => cfg!(all(feature = "vulkan", not(target_arch = "wasm32"))),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Per-device counters shared by the device and its buffers.
#[derive(Debug, Default)]
pub(crate) struct Accounting {
    live_bytes: AtomicU64,
    peak_bytes: AtomicU64,
    next_id: AtomicU64,
    /// Set by backends that cache objects per buffer (wgpu bind groups): ids of dropped buffers
    /// are then queued in `dropped` so the backend can let go of what it holds for them.
    track_drops: AtomicBool,
    dropped: Mutex<Vec<u64>>,
}

impl Accounting {
    fn add(&self, bytes: u64) -> u64 {
        let now = self.live_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_bytes.fetch_max(now, Ordering::Relaxed);
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Ids of buffers dropped since the last call.
    pub(crate) fn take_dropped(&self) -> Vec<u64> {
        self.dropped
            .lock()
            .map(|mut d| std::mem::take(&mut *d))
            .unwrap_or_default()
    }
}

pub(crate) enum Storage {
    Cpu(cpu::CpuStorage),
    Wgpu(::wgpu::Buffer),
    Cuda(cuda::CudaStorage),
    /// A tensor too large for one buffer, in buffers of whole rows (`wgpu` and `vulkan`).
    Rows(row_parts::RowParts),
}

/// Memory on one device. Dropping it frees the memory (GPU memory once queued work using it
/// has finished).
pub struct Buffer {
    id: u64,
    size: u64,
    label: String,
    pub(crate) storage: Storage,
    accounting: Arc<Accounting>,
}

impl Buffer {
    pub fn size(&self) -> u64 {
        self.size
    }
    pub fn label(&self) -> &str {
        &self.label
    }
    /// Unique among the live buffers of the device that made it.
    pub fn id(&self) -> u64 {
        self.id
    }
    fn same_device(&self, acc: &Arc<Accounting>) -> bool {
        Arc::ptr_eq(&self.accounting, acc)
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} #{}, {} B)", self.label, self.id, self.size)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // A tensor in parts is accounted by its parts, which drop with it.
        let counted = match self.storage {
            Storage::Rows(_) => 0,
            _ => self.size,
        };
        self.accounting
            .live_bytes
            .fetch_sub(counted, Ordering::Relaxed);
        if self.accounting.track_drops.load(Ordering::Relaxed)
            && let Ok(mut d) = self.accounting.dropped.lock()
        {
            d.push(self.id);
        }
    }
}

/// Tokens the cuda backend's `Linear` runs as matrix-vector products (each weight row read
/// once for every 4 tokens), and so the most rows of a pass of batched decode steps there.
pub const CUDA_MATVEC_MAX_TOKENS: usize = 16;

/// Up to this many tokens a cuda pass counts as decode: products fuse with their neighbours
/// and attention splits its keys across blocks; past it, prefill's attention (on tensor cores
/// where present) takes over.
pub const CUDA_DECODE_MAX_TOKENS: usize = 4;

/// Bytes [`Device::run_then_read`] queued: read already, or on their way to the host behind
/// a submission. Dropping it uncollected discards them (the work still runs).
pub struct PendingRead(Pending);

enum Pending {
    Ready(Vec<u8>),
    Wgpu(wgpu::StagedRead),
    Cuda(cuda::StagedRead),
}

enum Inner {
    Cpu(Box<cpu::CpuBackend>),
    Wgpu(Box<wgpu::WgpuBackend>),
    Cuda(Box<cuda::CudaBackend>),
}

/// One compute device with its backend.
pub struct Device {
    inner: Inner,
    info: DeviceInfo,
    accounting: Arc<Accounting>,
}

impl Device {
    /// A cpu device with the default backend, for unit tests.
    #[cfg(test)]
    pub(crate) fn new_cpu(info: DeviceInfo) -> Device {
        Self::new_cpu_with(info, cpu::CpuBackend::new())
    }

    pub(crate) fn new_cpu_with(info: DeviceInfo, backend: cpu::CpuBackend) -> Device {
        Device {
            inner: Inner::Cpu(Box::new(backend)),
            info,
            accounting: Default::default(),
        }
    }

    pub(crate) fn new_wgpu(info: DeviceInfo, backend: wgpu::WgpuBackend) -> Device {
        let accounting = Accounting {
            track_drops: AtomicBool::new(true),
            ..Default::default()
        };
        Device {
            inner: Inner::Wgpu(Box::new(backend)),
            info,
            accounting: Arc::new(accounting),
        }
    }

    pub(crate) fn new_cuda(info: DeviceInfo, backend: cuda::CudaBackend) -> Device {
        Device {
            inner: Inner::Cuda(Box::new(backend)),
            info,
            accounting: Default::default(),
        }
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn kind(&self) -> BackendKind {
        match self.inner {
            Inner::Cpu(_) => BackendKind::Cpu,
            // The `vulkan` backend drives its own VkDevice through the wgpu executor.
            Inner::Wgpu(_) if self.info.backend == BackendKind::Vulkan => BackendKind::Vulkan,
            Inner::Wgpu(_) => BackendKind::Wgpu,
            Inner::Cuda(_) => BackendKind::Cuda,
        }
    }

    /// Bytes held by this device's live buffers.
    pub fn live_bytes(&self) -> u64 {
        self.accounting.live_bytes.load(Ordering::Relaxed)
    }

    /// The most bytes ever live at once on this device.
    pub fn peak_bytes(&self) -> u64 {
        self.accounting.peak_bytes.load(Ordering::Relaxed)
    }

    /// The largest single buffer this device accepts.
    pub fn max_buffer_bytes(&self) -> u64 {
        match &self.inner {
            Inner::Cpu(_) => u64::MAX >> 1,
            Inner::Wgpu(b) => b.max_binding_bytes(),
            Inner::Cuda(b) => b.max_buffer_bytes(),
        }
    }

    /// A zero-filled buffer of `bytes` bytes.
    pub fn alloc(&self, label: &str, bytes: u64) -> Result<Buffer> {
        let max = self.max_buffer_bytes();
        if bytes > max {
            return Err(BackendError::BufferTooLarge {
                label: label.into(),
                bytes,
                max,
            });
        }
        let storage = match &self.inner {
            Inner::Cpu(b) => Storage::Cpu(b.alloc(label, bytes)?),
            Inner::Wgpu(b) => Storage::Wgpu(b.alloc(label, bytes)?),
            Inner::Cuda(b) => Storage::Cuda(b.alloc(label, bytes)?),
        };
        let id = self.accounting.add(bytes);
        Ok(Buffer {
            id,
            size: bytes,
            label: label.to_string(),
            storage,
            accounting: self.accounting.clone(),
        })
    }

    /// A buffer holding `data`.
    pub fn upload(&self, label: &str, data: &[u8]) -> Result<Buffer> {
        let buf = self.alloc(label, data.len() as u64)?;
        self.write(&buf, 0, data)?;
        Ok(buf)
    }

    /// A buffer holding `data`, rows of `row_bytes` bytes each (a weight matrix). Where it is
    /// larger than one buffer on a `wgpu` or `vulkan` device, it is held as several buffers of
    /// whole rows, which `Linear` (as its weights) and `Embed` (as its table) take; elsewhere
    /// as `upload`.
    pub fn upload_rows(&self, label: &str, data: &[u8], row_bytes: u64) -> Result<Buffer> {
        let total = data.len() as u64;
        let max = self.max_buffer_bytes();
        let rows = match &self.inner {
            Inner::Wgpu(_) => row_parts::rows_per_part(total, row_bytes, max),
            _ => None,
        };
        let Some(rows_per_part) = rows else {
            return self.upload(label, data);
        };
        let part_bytes = (rows_per_part * row_bytes) as usize;
        let parts = data
            .chunks(part_bytes)
            .enumerate()
            .map(|(i, rows)| self.upload(&format!("{label} (part {i})"), rows))
            .collect::<Result<Vec<_>>>()?;
        tracing::debug!(
            label,
            parts = parts.len(),
            rows_per_part,
            "tensor cut by rows"
        );
        Ok(Buffer {
            // Its bytes are its parts'.
            id: self.accounting.add(0),
            size: total,
            label: label.to_string(),
            storage: Storage::Rows(row_parts::RowParts {
                parts,
                rows_per_part,
                row_bytes,
            }),
            accounting: self.accounting.clone(),
        })
    }

    /// A weight matrix of `ty`, rows of `row_bytes` bytes, as [`Device::upload_rows`]; where a
    /// `wgpu` or `vulkan` device repacks `ty` (`--wgpu-matvec repacked`:
    /// `backend/wgpu/repack.rs`), in the layout its kernels then read. Such a buffer holds
    /// the weights for the device's kernels only: its bytes are not GGUF's.
    pub fn upload_weights(
        &self,
        label: &str,
        data: &[u8],
        ty: crate::quant::GgmlType,
        row_bytes: u64,
    ) -> Result<Buffer> {
        let format = ty.name();
        let b = match &self.inner {
            Inner::Wgpu(b) if b.repacks(format) => b,
            _ => return self.upload_rows(label, data, row_bytes),
        };
        let one = |label: &str, part: &[u8]| -> Result<Buffer> {
            let bytes = wgpu::WgpuBackend::repacked_len(format, part.len() as u64);
            let max = self.max_buffer_bytes();
            if bytes > max {
                return Err(BackendError::BufferTooLarge {
                    label: label.into(),
                    bytes,
                    max,
                });
            }
            let (raw, bytes) = b.upload_repacked(label, format, part)?;
            let id = self.accounting.add(bytes);
            b.mark_repacked(id)?;
            Ok(Buffer {
                id,
                size: bytes,
                label: label.to_string(),
                storage: Storage::Wgpu(raw),
                accounting: self.accounting.clone(),
            })
        };
        let total = data.len() as u64;
        // A part's repacked bytes round up to a group of blocks (at most 272 bytes more).
        let max = self.max_buffer_bytes().saturating_sub(272);
        let Some(rows_per_part) = row_parts::rows_per_part(total, row_bytes, max) else {
            return one(label, data);
        };
        let part_bytes = (rows_per_part * row_bytes) as usize;
        let parts = data
            .chunks(part_bytes)
            .enumerate()
            .map(|(i, rows)| one(&format!("{label} (part {i})"), rows))
            .collect::<Result<Vec<_>>>()?;
        Ok(Buffer {
            id: self.accounting.add(0),
            size: total,
            label: label.to_string(),
            storage: Storage::Rows(row_parts::RowParts {
                parts,
                rows_per_part,
                row_bytes,
            }),
            accounting: self.accounting.clone(),
        })
    }

    /// Writes `data` at `offset`; ordered after every op already run and before later ones.
    pub fn write(&self, buf: &Buffer, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range("write", buf, offset, data.len() as u64)?;
        if let Storage::Rows(r) = &buf.storage {
            for (part, at, range) in r.pieces(offset, data.len() as u64) {
                self.write(part, at, &data[range])?;
            }
            return Ok(());
        }
        match (&self.inner, &buf.storage) {
            (Inner::Cpu(_), Storage::Cpu(s)) => {
                s.write(offset, data);
                Ok(())
            }
            (Inner::Wgpu(b), Storage::Wgpu(s)) => b.write(s, offset, data),
            (Inner::Cuda(b), Storage::Cuda(s)) => b.write(s, offset, data),
            _ => Err(BackendError::ForeignBuffer {
                label: buf.label.clone(),
            }),
        }
    }

    /// Queues `ops` as one submission. Every op is validated (shapes against buffer sizes,
    /// buffers of this device) before anything is queued.
    pub fn run(&self, ops: &[Op<'_>]) -> Result<()> {
        self.validate_ops(ops)?;
        match &self.inner {
            Inner::Cpu(b) => b.run(ops),
            Inner::Wgpu(b) => b.run(ops, &self.accounting),
            Inner::Cuda(b) => b.run(ops),
        }
    }

    /// Whether generation on this device queues decode step n+1 before reading step n's
    /// token (`model::generate`): the `wgpu`, `vulkan` and `cuda` backends, unless
    /// `WgpuOptions::serial_decode`, `CudaOptions::serial_decode` or
    /// [`Device::set_pipelined_decode`] turned it off. The cpu backend runs each step to its
    /// end inside `run`, so it would not gain from it.
    pub fn pipelines_decode(&self) -> bool {
        match &self.inner {
            Inner::Wgpu(b) => b.pipelines_decode(),
            Inner::Cuda(b) => b.pipelines_decode(),
            Inner::Cpu(_) => false,
        }
    }

    /// Turns pipelined decode on or off for this device (the GPU backends; nothing on the
    /// cpu): to compare both in one process.
    pub fn set_pipelined_decode(&self, on: bool) {
        match &self.inner {
            Inner::Wgpu(b) => b.set_pipelined_decode(on),
            Inner::Cuda(b) => b.set_pipelined_decode(on),
            Inner::Cpu(_) => {}
        }
    }

    /// Queues `ops` like [`Device::run`], then `len` bytes of `buf` at `offset` as they are
    /// once those ops have run, to be taken with [`Device::collect`]. On `wgpu` and `vulkan`
    /// the bytes are copied into host-readable memory by the same submission, on `cuda` into
    /// pinned memory by a copy with an event behind it, and collecting them waits for that
    /// work only, so later work can be queued first; on the cpu they are read at once.
    pub async fn run_then_read(
        &self,
        ops: &[Op<'_>],
        buf: &Buffer,
        offset: u64,
        len: u64,
    ) -> Result<PendingRead> {
        self.check_range("read", buf, offset, len)?;
        self.validate_ops(ops)?;
        if let (Inner::Wgpu(b), Storage::Wgpu(s)) = (&self.inner, &buf.storage) {
            return Ok(PendingRead(Pending::Wgpu(b.run_then_read(
                ops,
                &self.accounting,
                s,
                offset,
                len,
            )?)));
        }
        if let (Inner::Cuda(b), Storage::Cuda(s)) = (&self.inner, &buf.storage) {
            return Ok(PendingRead(Pending::Cuda(
                b.run_then_read(ops, s, offset, len)?,
            )));
        }
        self.run(ops)?;
        Ok(PendingRead(Pending::Ready(
            self.read(buf, offset, len).await?,
        )))
    }

    /// The bytes a [`Device::run_then_read`] queued, once its work has finished.
    pub async fn collect(&self, read: PendingRead) -> Result<Vec<u8>> {
        match (read.0, &self.inner) {
            (Pending::Ready(bytes), _) => Ok(bytes),
            (Pending::Wgpu(r), Inner::Wgpu(b)) => b.collect(r).await,
            (Pending::Cuda(r), Inner::Cuda(b)) => b.collect(r),
            (Pending::Wgpu(_) | Pending::Cuda(_), _) => Err(BackendError::ForeignBuffer {
                label: "a staged read of another device".into(),
            }),
        }
    }

    fn validate_ops(&self, ops: &[Op<'_>]) -> Result<()> {
        for op in ops {
            for u in with_op!(op, o => validate::validate(o))? {
                if !u.buf.same_device(&self.accounting) {
                    return Err(BackendError::ForeignBuffer {
                        label: u.buf.label.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Lets each of `devices` read every other's memory directly: true where all of them are
    /// CUDA devices (at most [`peer::MAX_PEER_DEVICES`]) and the driver allows peer access
    /// between every pair; false otherwise, and a tensor split then sums through copies.
    pub fn enable_peers(devices: &[&Device]) -> bool {
        if devices.len() < 2 || devices.len() > peer::MAX_PEER_DEVICES {
            return false;
        }
        let cudas: Option<Vec<&cuda::CudaBackend>> = devices
            .iter()
            .map(|d| match &d.inner {
                Inner::Cuda(b) => Some(&**b),
                _ => None,
            })
            .collect();
        cudas.is_some_and(|c| cuda::CudaBackend::enable_peers(&c))
    }

    /// Runs one device's share of a tensor-parallel pass: its ops, with [`peer::PeerSum`]s
    /// between them that wait on the GPU for the other devices (see `peer.rs`). Only where
    /// [`Device::enable_peers`] said yes for the split's devices.
    pub fn run_pieces(&self, pieces: &[peer::Piece<'_>]) -> Result<()> {
        for piece in pieces {
            match piece {
                peer::Piece::Ops(ops) => {
                    for op in ops {
                        for u in with_op!(op, o => validate::validate(o))? {
                            if !u.buf.same_device(&self.accounting) {
                                return Err(BackendError::ForeignBuffer {
                                    label: u.buf.label.clone(),
                                });
                            }
                        }
                    }
                }
                peer::Piece::Sum(sum) => self.check_sum(sum)?,
            }
        }
        match &self.inner {
            Inner::Cuda(b) => b.run_pieces(pieces),
            _ => Err(BackendError::Unsupported(format!(
                "{}: sums across devices on the GPU need cuda peer access",
                self.info.id
            ))),
        }
    }

    fn check_sum(&self, sum: &peer::PeerSum<'_>) -> Result<()> {
        let invalid = |reason: String| BackendError::InvalidOp {
            op: "peer_sum",
            reason,
        };
        let devices = sum.parts.len();
        if devices != sum.flags.len() || !(2..=peer::MAX_PEER_DEVICES).contains(&devices) {
            return Err(invalid(format!(
                "{} partials and {} flag buffers for a sum over 2 to {} devices",
                devices,
                sum.flags.len(),
                peer::MAX_PEER_DEVICES
            )));
        }
        let me = sum.index as usize;
        if me >= devices {
            return Err(invalid(format!("device {me} of {devices}")));
        }
        let bytes = u64::from(sum.n) * 4;
        for (what, buf, len) in [
            ("peer_sum hidden states", sum.h, bytes),
            ("peer_sum own partial", sum.parts[me], bytes),
            ("peer_sum own flags", sum.flags[me], peer::PEER_FLAG_BYTES),
        ] {
            self.check_range(what, buf, 0, len)?;
        }
        for (part, flags) in sum.parts.iter().zip(&sum.flags) {
            if part.size < bytes || flags.size < peer::PEER_FLAG_BYTES {
                return Err(invalid(format!(
                    "{} or {} is smaller than the sum needs",
                    part.label, flags.label
                )));
            }
        }
        Ok(())
    }

    /// The most rows a pass of batched decode steps should hold here, where more would be
    /// slower than the sequences one pass each: the cuda backend's matrix-vector kernels take
    /// up to [`CUDA_MATVEC_MAX_TOKENS`] tokens (each weight row read once per 4), past which
    /// its tiled product takes over (on an H100, 8B shape, 16 sequences at once: 725 tok/s in
    /// one pass of 16 rows, 453 in four passes of 4). wgpu and vulkan take up to 8 rows in one
    /// pass with their streaming batch kernels; with the `rows` kernels, whose tiled product is
    /// slower for a few rows than a pass per row (vulkan on an H200, 8B shape: 4 at once 0.23x
    /// one), a row per pass. `None`: no such limit (the cpu backend
    /// streams each weight row once for up to 32 rows).
    pub fn decode_rows_per_pass(&self) -> Option<usize> {
        match self.kind() {
            BackendKind::Cuda => Some(CUDA_MATVEC_MAX_TOKENS),
            BackendKind::Wgpu | BackendKind::Vulkan => match &self.inner {
                Inner::Wgpu(b) => Some(b.decode_rows_per_pass()),
                _ => Some(1),
            },
            BackendKind::Cpu => None,
        }
    }

    /// Kernel launches of the latest `run`, where the backend turns ops into launches other
    /// than one by one (`cuda` fuses decode ops, `wgpu` and `vulkan` fold small ops into
    /// their products); `None` on the cpu backend.
    pub fn launches_in_last_run(&self) -> Option<usize> {
        match &self.inner {
            Inner::Cuda(b) => b.launches_in_last_run(),
            Inner::Wgpu(b) => Some(b.dispatches_in_last_run()),
            Inner::Cpu(_) => None,
        }
    }

    /// The kernels the latest `run` dispatched, in order, on the `wgpu` and `vulkan` backends
    /// (fused ones by the fused kernel's name); `None` elsewhere. For tests that check which
    /// variant ran.
    pub fn kernels_in_last_run(&self) -> Option<Vec<&'static str>> {
        match &self.inner {
            Inner::Wgpu(b) => Some(b.kernels_in_last_run()),
            _ => None,
        }
    }

    /// Buffer copies of the latest `run` where the backend counts them apart from its launches
    /// (`wgpu` and `vulkan`, whose copies end a compute pass); `None` elsewhere.
    pub fn copies_in_last_run(&self) -> Option<usize> {
        match &self.inner {
            Inner::Wgpu(b) => Some(b.copies_in_last_run()),
            _ => None,
        }
    }

    /// Reads `len` bytes at `offset` once all earlier work has finished.
    pub async fn read(&self, buf: &Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        self.check_range("read", buf, offset, len)?;
        if let Storage::Rows(r) = &buf.storage {
            let mut out = Vec::with_capacity(len as usize);
            for (part, at, range) in r.pieces(offset, len) {
                out.extend(Box::pin(self.read(part, at, range.len() as u64)).await?);
            }
            return Ok(out);
        }
        match (&self.inner, &buf.storage) {
            (Inner::Cpu(_), Storage::Cpu(s)) => Ok(s.read(offset, len)),
            (Inner::Wgpu(b), Storage::Wgpu(s)) => b.read(s, offset, len).await,
            (Inner::Cuda(b), Storage::Cuda(s)) => b.read(s, offset, len),
            _ => Err(BackendError::ForeignBuffer {
                label: buf.label.clone(),
            }),
        }
    }

    /// Reads a whole buffer as f32 values.
    pub async fn read_f32(&self, buf: &Buffer) -> Result<Vec<f32>> {
        let bytes = self.read(buf, 0, buf.size() / 4 * 4).await?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Waits until all queued work has finished.
    pub async fn sync(&self) -> Result<()> {
        match &self.inner {
            Inner::Cpu(_) => Ok(()),
            Inner::Wgpu(b) => b.sync().await,
            Inner::Cuda(b) => b.sync(),
        }
    }

    /// Copies `bytes` from `src` (a buffer of this device) into `dst` on `dst_dev`, ordered
    /// after the work already queued on both devices and before later work on either.
    /// Between CUDA devices of one host this is a device-to-device copy (peer to peer where the
    /// hardware allows it); within one device, a copy on the device; otherwise it goes through
    /// host memory. Returns whether the bytes stayed off the host.
    pub async fn copy_to(
        &self,
        src: &Buffer,
        src_offset: u64,
        dst_dev: &Device,
        dst: &Buffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<bool> {
        self.check_range("copy_to", src, src_offset, bytes)?;
        dst_dev.check_range("copy_to", dst, dst_offset, bytes)?;
        if let (Inner::Cuda(s), Inner::Cuda(d), Storage::Cuda(ss), Storage::Cuda(ds)) =
            (&self.inner, &dst_dev.inner, &src.storage, &dst.storage)
        {
            return d.copy_from_peer(ds, dst_offset, s, ss, src_offset, bytes);
        }
        let same = Arc::ptr_eq(&self.accounting, &dst_dev.accounting);
        if same
            && bytes.is_multiple_of(4)
            && src_offset.is_multiple_of(4)
            && dst_offset.is_multiple_of(4)
            && !std::ptr::eq(src, dst)
        {
            self.run(&[Op::Copy(BufferCopy {
                src,
                src_offset,
                dst,
                dst_offset,
                bytes,
            })])?;
            return Ok(true);
        }
        let data = self.read(src, src_offset, bytes).await?;
        dst_dev.write(dst, dst_offset, &data)?;
        Ok(false)
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_blocking(&self, buf: &Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        pollster::block_on(self.read(buf, offset, len))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_f32_blocking(&self, buf: &Buffer) -> Result<Vec<f32>> {
        pollster::block_on(self.read_f32(buf))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn sync_blocking(&self) -> Result<()> {
        pollster::block_on(self.sync())
    }

    fn check_range(&self, what: &'static str, buf: &Buffer, offset: u64, len: u64) -> Result<()> {
        if !buf.same_device(&self.accounting) {
            return Err(BackendError::ForeignBuffer {
                label: buf.label.clone(),
            });
        }
        match offset.checked_add(len) {
            Some(end) if end <= buf.size => Ok(()),
            end => Err(BackendError::OutOfRange {
                what,
                label: buf.label.clone(),
                offset,
                end: end.unwrap_or(u64::MAX),
                size: buf.size,
            }),
        }
    }
}

//! The `wgpu` backend: WGSL kernels on Vulkan, Metal, DX12 or the browser's WebGPU.
//!
//! A `run` becomes one command buffer and one queue submission: all dispatches of a decode
//! step share a compute pass (split only around buffer copies), with their parameters packed
//! into one uniform buffer at 256-byte slots. Bind groups are cached across `run`s, keyed by
//! the buffers they bind, so a decode step that repeats the last one's bindings creates none.
//!
//! The `vulkan` backend reuses this executor on a device it creates itself; its kernels are
//! SPIR-V (see `backend/vulkan/spirv.rs`) and take their parameters as push constants.

pub mod check;
pub(crate) mod discover;
mod fuse;
mod plan;
#[cfg(not(target_arch = "wasm32"))]
mod profile;
mod repack;
mod rows;
mod split_attention;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::{Accounting, BackendError, Buffer, Result, Storage};
use crate::device::DeviceInfo;
use crate::kernels::Op;
use crate::options::{
    WgpuAttention, WgpuAttentionKernel, WgpuMatvec, WgpuOptions, WgpuPrefill, WgpuPromptAttention,
};
use plan::{Matvec, Step, Wide};

const PARAM_SLOT: u64 = 256;
/// The name `DeviceInfo::features` gives WGSL's `packed_4x8_integer_dot_product`, which the
/// packed-integer kernels need (`dot4I8Packed`).
pub const PACKED_DOT_FEATURE: &str = "packed-4x8-integer-dot-product";
/// Words of parameters every kernel takes, as a uniform slot or push constants: 12, since the
/// paged attention's window made its struct the first of 48 bytes.
pub(crate) const PARAM_WORDS: usize = 12;
/// [`PARAM_WORDS`] in bytes.
pub(crate) const PARAM_BYTES: u32 = PARAM_WORDS as u32 * 4;
/// Host-readable buffers kept for reads (`read`, staged reads): a pipelined decode has two
/// in flight.
const MAX_STAGING_BUFFERS: usize = 4;
/// Larger staging buffers (a prompt's hidden states, scoring's logits) are not kept.
const STAGING_MAX_KEPT_BYTES: u64 = 1 << 20;
/// The smallest staged-read buffer: a batch's tokens fit.
const STAGING_MIN_BYTES: u64 = 256;
/// Past this many cached bind groups the cache starts over, bounding what it keeps alive.
const MAX_CACHED_BIND_GROUPS: usize = 8192;

/// A kernel ready to dispatch.
#[derive(Clone)]
pub(crate) struct Compiled {
    pub(crate) pipeline: wgpu::ComputePipeline,
    pub(crate) layout: wgpu::BindGroupLayout,
    pub(crate) params: ParamMode,
}

/// How a kernel receives its `[u32; PARAM_WORDS]` of parameters.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
// Only the `vulkan` backend's SPIR-V kernels use the last two.
#[cfg_attr(
    not(all(feature = "vulkan", not(target_arch = "wasm32"))),
    allow(dead_code)
)]
pub(crate) enum ParamMode {
    /// Uniform binding 0 at the dispatch's slot, fixed in the bind group (wgpu's WGSL path,
    /// whose layouts wgpu derives and which therefore have no dynamic offsets).
    Uniform,
    /// Uniform binding 0 with a dynamic offset: one bind group serves every slot.
    DynamicUniform,
    /// Push constants; binding 0 is gone.
    Immediates,
}

/// Which bind group a dispatch needs: its layout (kernel and format), the parameter slot when
/// parameters are a uniform binding, and the buffers by id.
#[derive(PartialEq, Eq, Hash)]
struct BindKey {
    kernel: &'static str,
    format: Option<&'static str>,
    param_offset: Option<u64>,
    buffers: Vec<u64>,
}

#[derive(Default)]
struct BindCache {
    groups: HashMap<BindKey, wgpu::BindGroup>,
}

impl BindCache {
    /// Cached bind groups hold their buffers alive: forget those naming a dropped buffer.
    fn evict(&mut self, dropped: &[u64]) {
        if dropped.is_empty() || self.groups.is_empty() {
            return;
        }
        let gone: HashSet<u64> = dropped.iter().copied().collect();
        self.groups
            .retain(|k, _| !k.buffers.iter().any(|id| gone.contains(id)));
    }
}

pub struct WgpuBackend {
    device: wgpu::Device,
    queue: wgpu::Queue,
    limits: wgpu::Limits,
    pipelines: Mutex<HashMap<(&'static str, Option<&'static str>), Compiled>>,
    bind_groups: Mutex<BindCache>,
    /// Set on the `vulkan` backend: kernels become SPIR-V through naga and are passed through.
    #[cfg(all(feature = "vulkan", not(target_arch = "wasm32")))]
    spirv: Option<super::vulkan::spirv::SpirvKernels>,
    params: Mutex<Option<wgpu::Buffer>>,
    /// Small ops are folded into the matrix-vector products beside them (`fuse.rs`)...
    fuse: bool,
    /// ...the RMS norms too.
    fuse_norms: bool,
    /// The matrix-vector kernels.
    matvec: Matvec,
    /// The prompt-sized products' kernel (resolved for the device).
    prefill: WgpuPrefill,
    /// Prompt attention on tiles of 16 queries, or a workgroup per (head, token).
    prompt_attention: WgpuPromptAttention,
    /// Q4_0, Q4_1 and Q8_0 weights are repacked at upload (`repack.rs`)...
    repack: bool,
    /// ...and these buffers (by id) hold them so.
    repacked: Mutex<HashSet<u64>>,
    /// Where the packed-integer kernels' activations are rounded to (`quantize_q8`), grown
    /// to the largest a run has needed.
    int8_scratch: Mutex<Option<Arc<Buffer>>>,
    /// Where products over weights in parts by rows write a part's rows (`rows.rs`).
    parts_scratch: Mutex<Option<Arc<Buffer>>>,
    /// Decode attention cut by keys across workgroups (`split_attention.rs`): never
    /// (`Single`), always (`Split`), or where it pays (`ByAdapter`)...
    attention: WgpuAttention,
    /// ...scored by this kernel...
    attention_pass: split_attention::FirstPass,
    /// ...through this buffer.
    attention_scratch: Mutex<Option<Arc<Buffer>>>,
    /// Small host-readable buffers that reads copy into (`read`, and reads queued behind a run:
    /// [`WgpuBackend::run_then_read`]), kept for the next steps instead of made per read.
    staging: Mutex<Vec<wgpu::Buffer>>,
    /// Whether generation queues decode step n+1 before reading step n's token
    /// (`WgpuOptions::serial_decode` off); changeable at run time for comparisons.
    pipelined_decode: AtomicBool,
    /// Kernels compiled with wgpu's runtime checks (`WgpuOptions::shader_checks`).
    shader_checks: bool,
    /// GPU time per kernel (`CAIRN_WGPU_PROFILE=1` on a device with timestamp queries).
    #[cfg(not(target_arch = "wasm32"))]
    profile: Option<profile::Profile>,
    /// Dispatches and buffer copies of the latest `run`.
    last_dispatches: AtomicUsize,
    /// The kernels of the latest `run`'s dispatches, in order (for tests that check which
    /// variant ran).
    last_kernels: Mutex<Vec<&'static str>>,
    last_copies: AtomicUsize,
    /// Errors wgpu reports asynchronously (validation, out of memory, device loss), surfaced
    /// by the next call instead of aborting the process.
    errors: Arc<Mutex<Vec<String>>>,
    lost: Arc<Mutex<Option<String>>>,
}

impl WgpuBackend {
    pub(crate) async fn open(adapter: &wgpu::Adapter, info: &DeviceInfo) -> Result<WgpuBackend> {
        let wanted = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::SHADER_F16;
        // A browser's WGSL needs `enable subgroups;`, which naga rejects: subgroup kernels are
        // native-only.
        #[cfg(not(target_arch = "wasm32"))]
        let wanted = wanted | wgpu::Features::SUBGROUP;
        let required_features = discover::device_features(adapter.features() & wanted, info);
        // Ask for everything the adapter allows (weight matrices need large storage bindings),
        // or what the options force on it, which discovery wrote into `info`.
        let required_limits = discover::device_limits(adapter, info);
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some(&format!("cairn {}", info.id)),
                required_features,
                required_limits: required_limits.clone(),
                memory_hints: wgpu::MemoryHints::Performance,
                ..Default::default()
            })
            .await
            .map_err(|e| BackendError::Gpu(format!("request_device: {e}")))?;
        Ok(Self::from_device(device, queue, required_limits))
    }

    /// The executor over an already opened device (the `vulkan` backend opens its own).
    pub(crate) fn from_device(
        device: wgpu::Device,
        queue: wgpu::Queue,
        limits: wgpu::Limits,
    ) -> WgpuBackend {
        let errors: Arc<Mutex<Vec<String>>> = Default::default();
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            tracing::error!(error = %e, "wgpu error");
            if let Ok(mut v) = sink.lock() {
                v.push(e.to_string());
            }
        }));
        let lost: Arc<Mutex<Option<String>>> = Default::default();
        let lost_sink = lost.clone();
        device.set_device_lost_callback(move |reason, msg| {
            tracing::error!(?reason, %msg, "GPU device lost");
            if let Ok(mut l) = lost_sink.lock() {
                *l = Some(format!("{reason:?}: {msg}"));
            }
        });
        WgpuBackend {
            device,
            queue,
            limits,
            pipelines: Mutex::new(HashMap::new()),
            bind_groups: Mutex::new(BindCache::default()),
            #[cfg(all(feature = "vulkan", not(target_arch = "wasm32")))]
            spirv: None,
            params: Mutex::new(None),
            fuse: true,
            fuse_norms: true,
            matvec: Matvec::Rows,
            prefill: WgpuPrefill::Registers,
            prompt_attention: WgpuPromptAttention::Single,
            repack: false,
            repacked: Mutex::new(HashSet::new()),
            int8_scratch: Mutex::new(None),
            parts_scratch: Mutex::new(None),
            attention: WgpuAttention::Single,
            attention_pass: split_attention::FirstPass::Heads,
            attention_scratch: Mutex::new(None),
            staging: Mutex::new(Vec::new()),
            pipelined_decode: AtomicBool::new(true),
            shader_checks: false,
            #[cfg(not(target_arch = "wasm32"))]
            profile: None,
            last_dispatches: AtomicUsize::new(0),
            last_kernels: Mutex::new(Vec::new()),
            last_copies: AtomicUsize::new(0),
            errors,
            lost,
        }
    }

    #[cfg(all(feature = "vulkan", not(target_arch = "wasm32")))]
    pub(crate) fn with_spirv(mut self, spirv: super::vulkan::spirv::SpirvKernels) -> WgpuBackend {
        self.spirv = Some(spirv);
        self
    }

    /// What is folded into the products beside them (all of it by default) and which
    /// matrix-vector kernels run, on `info`'s device.
    pub(crate) fn with_options(mut self, opts: &WgpuOptions, info: &DeviceInfo) -> WgpuBackend {
        (self.fuse, self.fuse_norms) = opts.fuse.resolve(info.is_software());
        let subgroups = self.device.features().contains(wgpu::Features::SUBGROUP);
        let packed = info.features.iter().any(|f| f == PACKED_DOT_FEATURE);
        self.matvec = match opts.matvec.resolve(info.is_software()) {
            WgpuMatvec::Rows => Matvec::Rows,
            WgpuMatvec::Stream => Matvec::Stream {
                subgroups: false,
                int8: false,
                wide: None,
            },
            WgpuMatvec::Int8 => Matvec::Stream {
                subgroups,
                int8: packed,
                wide: None,
            },
            WgpuMatvec::Repacked => {
                self.repack = true;
                Matvec::Stream {
                    subgroups,
                    int8: false,
                    wide: None,
                }
            }
            WgpuMatvec::Wide => Matvec::Stream {
                subgroups,
                int8: false,
                // The wide kernels reduce through subgroups only.
                wide: subgroups.then_some(Wide {
                    shape: opts.matvec_shape.walk(),
                    dot: opts.matvec_shape.dot && packed,
                    // `auto` leaves Q8_0 on the streaming kernels (measured faster there).
                    stream_q8_0: opts.matvec == WgpuMatvec::ByAdapter,
                }),
            },
            _ => Matvec::Stream {
                subgroups,
                int8: false,
                wide: None,
            },
        };
        // Cooperative matrices only on a raw vulkan device opened with them.
        self.prefill = match opts.prefill.resolve(info.is_software(), self.coop()) {
            p if p.coop() && !self.coop() => WgpuPrefill::Gemm,
            other => other,
        };
        self.attention = opts.attention.resolve(info.is_software());
        self.attention_pass = match opts.attention_kernel {
            WgpuAttentionKernel::Heads => split_attention::FirstPass::Heads,
            WgpuAttentionKernel::Grouped => split_attention::FirstPass::Grouped {
                min_piece: opts
                    .attention_piece
                    .unwrap_or(split_attention::GROUPED_MIN_PIECE),
            },
        };
        self.prompt_attention = opts.prompt_attention.resolve(
            info.is_software(),
            self.device.limits().max_compute_workgroup_storage_size,
        );
        self.pipelined_decode = AtomicBool::new(!opts.serial_decode);
        self.shader_checks = opts.shader_checks;
        #[cfg(not(target_arch = "wasm32"))]
        if profile::wanted() {
            if self
                .device
                .features()
                .contains(wgpu::Features::TIMESTAMP_QUERY)
            {
                self.profile = Some(profile::Profile::default());
            } else {
                tracing::warn!(id = %info.id, "CAIRN_WGPU_PROFILE: this device has no timestamp queries; not profiled");
            }
        }
        tracing::debug!(id = %info.id, matvec = ?self.matvec, repack = self.repack, prefill = ?self.prefill, attention = ?self.attention, attention_pass = ?self.attention_pass, prompt_attention = ?self.prompt_attention, shader_checks = self.shader_checks, "wgpu kernels");
        self
    }

    /// Whether the device runs cooperative-matrix kernels (the vulkan backend's, opened with
    /// them for `WgpuPrefill::Coop`).
    fn coop(&self) -> bool {
        #[cfg(all(feature = "vulkan", not(target_arch = "wasm32")))]
        if let Some(spirv) = &self.spirv {
            return spirv.coop;
        }
        false
    }

    /// Whether weights of `format` (a GGML type name) are uploaded repacked (`repack.rs`).
    pub(crate) fn repacks(&self, format: &str) -> bool {
        self.repack && repack::repacks(format)
    }

    /// `data`, whole blocks of `format`, repacked ([`Self::repacks`]) into a new buffer that
    /// every kernel then reads in that layout.
    pub(crate) fn upload_repacked(
        &self,
        label: &str,
        format: &str,
        data: &[u8],
    ) -> Result<(wgpu::Buffer, u64)> {
        let bytes = repack::repack(format, data).ok_or_else(|| {
            BackendError::Unsupported(format!(
                "{label}: {} bytes are not whole blocks of {format}",
                data.len()
            ))
        })?;
        let buf = self.alloc(label, bytes.len() as u64)?;
        self.write(&buf, 0, &bytes)?;
        Ok((buf, bytes.len() as u64))
    }

    /// Records that the buffer `id` holds repacked weights.
    pub(crate) fn mark_repacked(&self, id: u64) -> Result<()> {
        self.repacked
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?
            .insert(id);
        Ok(())
    }

    /// The bytes a repacked part of `native` bytes of `format` takes.
    pub(crate) fn repacked_len(format: &str, native: u64) -> u64 {
        repack::repacked_len(format, native as usize).map_or(native, |n| n as u64)
    }

    /// Decode rows (sequences) one pass takes: the batch kernels' limit, or one where a
    /// batch runs a pass per sequence.
    pub(crate) fn decode_rows_per_pass(&self) -> usize {
        self.matvec.decode_rows_per_pass()
    }

    /// Dispatches of the latest `run`, fused ones counted once.
    pub(crate) fn dispatches_in_last_run(&self) -> usize {
        self.last_dispatches.load(Ordering::Relaxed)
    }

    /// The kernels the latest `run` dispatched, in order.
    pub(crate) fn kernels_in_last_run(&self) -> Vec<&'static str> {
        self.last_kernels
            .lock()
            .map(|k| k.clone())
            .unwrap_or_default()
    }

    /// Buffer copies of the latest `run`.
    pub(crate) fn copies_in_last_run(&self) -> usize {
        self.last_copies.load(Ordering::Relaxed)
    }

    pub(crate) fn max_binding_bytes(&self) -> u64 {
        self.limits
            .max_buffer_size
            .min(self.limits.max_storage_buffer_binding_size)
    }

    fn check_errors(&self) -> Result<()> {
        if let Some(l) = self.lost.lock().ok().and_then(|l| l.clone()) {
            return Err(BackendError::DeviceLost(l));
        }
        let mut errs = self
            .errors
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?;
        if errs.is_empty() {
            return Ok(());
        }
        let msg = errs.join("; ");
        errs.clear();
        Err(BackendError::Gpu(msg))
    }

    pub(crate) fn alloc(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
        let size = bytes.max(4).div_ceil(4) * 4;
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if let Some(e) = block_on_native(scope.pop()) {
            return Err(BackendError::OutOfMemory {
                device: "wgpu".into(),
                label: label.into(),
                bytes,
                reason: e.to_string(),
            });
        }
        Ok(buf)
    }

    pub(crate) fn write(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        if !offset.is_multiple_of(4) {
            return Err(BackendError::Unsupported(format!(
                "GPU writes must start at a multiple of 4 bytes, not {offset}"
            )));
        }
        let whole = data.len() / 4 * 4;
        if whole > 0 {
            self.queue.write_buffer(buf, offset, &data[..whole]);
        }
        if whole < data.len() {
            // The copy unit is 4 bytes: the tail goes out zero-padded (inside the allocation,
            // which is rounded up to 4).
            let mut tail = [0u8; 4];
            tail[..data.len() - whole].copy_from_slice(&data[whole..]);
            self.queue.write_buffer(buf, offset + whole as u64, &tail);
        }
        self.check_errors()
    }

    fn pipeline(
        &self,
        kernel: cairn_shaders::Kernel,
        format: Option<&'static str>,
    ) -> Result<Compiled> {
        let mut cache = self
            .pipelines
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?;
        if let Some(p) = cache.get(&(kernel.name, format)) {
            return Ok(p.clone());
        }
        #[cfg(all(feature = "vulkan", not(target_arch = "wasm32")))]
        if let Some(spirv) = &self.spirv {
            let compiled = spirv.compile(&self.device, kernel, format, self.matvec.wide_shape())?;
            cache.insert((kernel.name, format), compiled.clone());
            return Ok(compiled);
        }
        let src = cairn_shaders::source_shaped(kernel, format, self.matvec.wide_shape())
            .ok_or_else(|| {
                BackendError::Unsupported(format!(
                    "{}: no kernel for format {format:?}",
                    kernel.name
                ))
            })?;
        let label = format!(
            "{}{}",
            kernel.name,
            format.map(|f| format!("_{f}")).unwrap_or_default()
        );
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self.shader_module(&label, src);
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(&label),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = block_on_native(scope.pop()) {
            return Err(BackendError::Gpu(format!("compiling {label}: {e}")));
        }
        let compiled = Compiled {
            layout: pipeline.get_bind_group_layout(0),
            pipeline,
            params: ParamMode::Uniform,
        };
        cache.insert((kernel.name, format), compiled.clone());
        Ok(compiled)
    }

    /// A kernel's module: natively without wgpu's runtime checks unless asked for
    /// (`WgpuOptions::shader_checks`); in a browser as WebGPU compiles it.
    fn shader_module(&self, label: &str, src: String) -> wgpu::ShaderModule {
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(src.into()),
        };
        #[cfg(not(target_arch = "wasm32"))]
        if !self.shader_checks {
            // SAFETY: wgpu's checks guard a kernel's indexing, loops and divisions. Every op
            // is checked by `validate_op` before it is encoded (each buffer holds the shapes
            // its kernel indexes, every dimension a kernel divides by is nonzero), every loop
            // of the kernels runs to a bound taken from those shapes, and the indices read
            // from buffers (token ids, pool block tables, positions) are checked on the host
            // before upload and clamped again in the kernels that take them; buffer accesses
            // keep the driver's own robust access where the device has it. The `vulkan`
            // backend has run the same kernels without these checks since it was written.
            return unsafe {
                self.device
                    .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            };
        }
        self.device.create_shader_module(desc)
    }

    /// The uniform buffer for `bytes` of parameters; a new one empties the bind group cache,
    /// whose groups point at the old one.
    fn param_buffer(&self, bytes: u64) -> Result<wgpu::Buffer> {
        let mut slot = self
            .params
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?;
        match &*slot {
            Some(b) if b.size() >= bytes => Ok(b.clone()),
            _ => {
                let size = bytes.next_power_of_two().max(PARAM_SLOT * 64);
                let b = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("cairn params"),
                    size,
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                *slot = Some(b.clone());
                if let Ok(mut c) = self.bind_groups.lock() {
                    c.groups.clear();
                }
                Ok(b)
            }
        }
    }

    /// A buffer of at least `bytes` in `slot` (the packed-integer kernels' activations, the
    /// products over weights in parts): the one kept from earlier runs, or a larger one that
    /// replaces it.
    fn scratch(
        &self,
        slot: &Mutex<Option<Arc<Buffer>>>,
        label: &str,
        bytes: u64,
        accounting: &Arc<Accounting>,
    ) -> Result<Arc<Buffer>> {
        let mut slot = slot
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?;
        if let Some(b) = slot.as_ref().filter(|b| b.size >= bytes) {
            return Ok(b.clone());
        }
        // Rounded up so a few sizes serve every run, within what one binding takes.
        let bytes = bytes
            .next_power_of_two()
            .max(64 << 10)
            .min(self.max_binding_bytes())
            .max(bytes);
        // In a browser a wgpu buffer is neither Send nor Sync, and neither is this `Arc`; the
        // backend lives on one thread there.
        #[cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]
        let buf = Arc::new(Buffer {
            storage: Storage::Wgpu(self.alloc(label, bytes)?),
            id: accounting.add(bytes),
            size: bytes,
            label: label.into(),
            accounting: accounting.clone(),
        });
        *slot = Some(buf.clone());
        Ok(buf)
    }

    pub(crate) fn run(&self, ops: &[Op<'_>], accounting: &Arc<Accounting>) -> Result<()> {
        self.run_with(ops, accounting, None).map(|_| ())
    }

    /// Whether generation should queue decode step n+1 before reading step n's token.
    pub(crate) fn pipelines_decode(&self) -> bool {
        self.pipelined_decode.load(Ordering::Relaxed)
    }

    pub(crate) fn set_pipelined_decode(&self, on: bool) {
        self.pipelined_decode.store(on, Ordering::Relaxed);
    }

    /// `run`, with `len` bytes of `buf` at `offset` copied, at the end of the same command
    /// buffer, into a host-readable buffer: [`Self::collect`] waits for this submission only,
    /// not for work queued after it, so the next decode step can be queued before this one's
    /// token is read.
    pub(crate) fn run_then_read(
        &self,
        ops: &[Op<'_>],
        accounting: &Arc<Accounting>,
        buf: &wgpu::Buffer,
        offset: u64,
        len: u64,
    ) -> Result<StagedRead> {
        let start = offset / 4 * 4;
        let end = (offset + len).div_ceil(4) * 4;
        let size = (end - start).max(4);
        let staging = self.staging_buffer(size)?;
        let submission =
            self.run_with(ops, accounting, Some((buf, start, &staging, end - start)))?;
        Ok(StagedRead {
            staging,
            submission,
            skip: (offset - start) as usize,
            len: len as usize,
        })
    }

    /// Waits for `r`'s submission (and the work queued before it) and returns its bytes.
    pub(crate) async fn collect(&self, r: StagedRead) -> Result<Vec<u8>> {
        let (tx, rx) = futures::channel::oneshot::channel();
        r.staging.map_async(wgpu::MapMode::Read, .., move |m| {
            let _ = tx.send(m);
        });
        let t0 = HostClock::now();
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(r.submission.clone()),
                timeout: None,
            })
            .map_err(|e| BackendError::Gpu(format!("poll: {e}")))?;
        // How long the host waited for the GPU (pipelined decode: the step behind this one
        // is queued meanwhile).
        tracing::trace!(
            wait_us = HostClock::us(t0, HostClock::now()),
            "wgpu collect"
        );
        rx.await
            .map_err(|_| BackendError::DeviceLost("readback was cancelled".into()))?
            .map_err(|e| BackendError::Gpu(format!("mapping readback: {e}")))?;
        let out = {
            let view = r
                .staging
                .get_mapped_range(..)
                .map_err(|e| BackendError::Gpu(format!("mapped range: {e}")))?;
            view[r.skip..r.skip + r.len].to_vec()
        };
        r.staging.unmap();
        self.recycle(r.staging);
        self.check_errors()?;
        Ok(out)
    }

    /// Keeps an unmapped staging buffer for the next read, if it is small and few are kept.
    fn recycle(&self, staging: wgpu::Buffer) {
        if staging.size() > STAGING_MAX_KEPT_BYTES {
            return;
        }
        if let Ok(mut pool) = self.staging.lock()
            && pool.len() < MAX_STAGING_BUFFERS
        {
            pool.push(staging);
        }
    }

    /// A host-readable buffer of at least `bytes`: a kept one, or a new one.
    fn staging_buffer(&self, bytes: u64) -> Result<wgpu::Buffer> {
        let mut pool = self
            .staging
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?;
        if let Some(i) = pool.iter().position(|b| b.size() >= bytes) {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cairn readback"),
            size: bytes.max(STAGING_MIN_BYTES),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    /// `run`, plus the copy into `read` = (source, offset, staging, bytes) where given;
    /// returns the submission's index.
    fn run_with(
        &self,
        ops: &[Op<'_>],
        accounting: &Arc<Accounting>,
        read: Option<(&wgpu::Buffer, u64, &wgpu::Buffer, u64)>,
    ) -> Result<wgpu::SubmissionIndex> {
        self.check_errors()?;
        let t0 = HostClock::now();
        let max_dim = self.limits.max_compute_workgroups_per_dimension;
        let int8_bytes = ops
            .iter()
            .filter_map(|op| match op {
                Op::Linear(l) if self.matvec.int8_for(l) => Some(Matvec::int8_scratch_bytes(l)),
                _ => None,
            })
            .max();
        let scratch = int8_bytes
            .map(|n| self.scratch(&self.int8_scratch, "int8 activations", n, accounting))
            .transpose()?;
        let parts_scratch = ops
            .iter()
            .filter_map(rows::scratch_bytes)
            .max()
            .map(|n| self.scratch(&self.parts_scratch, "rows of a part", n, accounting))
            .transpose()?;
        let forced = self.attention == WgpuAttention::Split;
        let attention_bytes = ops
            .iter()
            .filter(|_| self.attention != WgpuAttention::Single)
            .filter_map(|op| match op {
                Op::Attention(a) => split_attention::splits(a, forced, self.attention_pass)
                    .map(|n| split_attention::scratch_bytes(a.tokens, a.heads, a.head_dim, n)),
                Op::PagedAttention(a) => {
                    split_attention::paged_splits(a, forced, self.attention_pass)
                        .map(|n| split_attention::scratch_bytes(a.tokens, a.heads, a.head_dim, n))
                }
                _ => None,
            })
            .max();
        let attention_scratch = attention_bytes
            .map(|n| self.scratch(&self.attention_scratch, "attention pieces", n, accounting))
            .transpose()?;
        let steps = fuse::plan_run(
            ops,
            max_dim,
            self.fuse,
            self.fuse_norms,
            self.matvec,
            fuse::Scratch {
                int8: scratch.as_deref(),
                parts: parts_scratch.as_deref(),
                attention: attention_scratch.as_deref(),
                attention_forced: forced,
                attention_pass: self.attention_pass,
            },
        )?;
        let mut steps: Vec<Step<'_>> = steps
            .into_iter()
            .map(|s| {
                let s = plan::prompt_attention(s, self.prompt_attention);
                if self.prefill == WgpuPrefill::Registers {
                    s
                } else {
                    plan::prefill(s, self.prefill)
                }
            })
            .collect();
        if self.repack {
            let repacked = self
                .repacked
                .lock()
                .map_err(|_| BackendError::Gpu("poisoned".into()))?;
            repack::retarget(&mut steps, |id| repacked.contains(&id));
        }
        let t_plan = HostClock::now();
        let n_dispatch = steps
            .iter()
            .filter(|s| matches!(s, Step::Dispatch { .. }))
            .count() as u64;
        self.last_dispatches
            .store(n_dispatch as usize, Ordering::Relaxed);
        self.last_copies
            .store(steps.len() - n_dispatch as usize, Ordering::Relaxed);
        if let Ok(mut names) = self.last_kernels.lock() {
            names.clear();
            names.extend(steps.iter().filter_map(|s| match s {
                Step::Dispatch { kernel, .. } => Some(kernel.name),
                Step::Copy { .. } => None,
            }));
        }
        let slot = PARAM_SLOT.max(u64::from(self.limits.min_uniform_buffer_offset_alignment));
        let params_buf = self.param_buffer((n_dispatch.max(1)) * slot)?;
        let mut param_bytes = vec![0u8; (n_dispatch.max(1) * slot) as usize];
        let mut uniform_params = false;

        let mut cache = self
            .bind_groups
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?;
        let dropped = accounting.take_dropped();
        cache.evict(&dropped);
        if self.repack && !dropped.is_empty() {
            let mut repacked = self
                .repacked
                .lock()
                .map_err(|_| BackendError::Gpu("poisoned".into()))?;
            for id in &dropped {
                repacked.remove(id);
            }
        }
        if cache.groups.len() > MAX_CACHED_BIND_GROUPS {
            cache.groups.clear();
        }
        let mut bind_groups = Vec::with_capacity(steps.len());
        let mut di = 0u64;
        for step in &steps {
            if let Step::Dispatch {
                kernel,
                format,
                buffers,
                params,
                ..
            } = step
            {
                let compiled = self.pipeline(*kernel, *format)?;
                let off = di * slot;
                if compiled.params != ParamMode::Immediates {
                    param_bytes[off as usize..][..PARAM_BYTES as usize]
                        .copy_from_slice(bytemuck::cast_slice(params));
                    uniform_params = true;
                }
                // A fixed uniform slot is part of the bind group; a dynamic one is not.
                let bound_offset = match compiled.params {
                    ParamMode::Uniform => Some(off),
                    ParamMode::DynamicUniform => Some(0),
                    ParamMode::Immediates => None,
                };
                let key = BindKey {
                    kernel: kernel.name,
                    format: *format,
                    param_offset: bound_offset,
                    buffers: buffers.iter().map(|b| b.id()).collect(),
                };
                let bg = match cache.groups.get(&key) {
                    Some(bg) => bg.clone(),
                    None => {
                        let mut entries = Vec::with_capacity(buffers.len() + 1);
                        if let Some(offset) = bound_offset {
                            entries.push(wgpu::BindGroupEntry {
                                binding: 0,
                                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                    buffer: &params_buf,
                                    offset,
                                    size: wgpu::BufferSize::new(u64::from(PARAM_BYTES)),
                                }),
                            });
                        }
                        for (i, b) in buffers.iter().enumerate() {
                            entries.push(wgpu::BindGroupEntry {
                                binding: i as u32 + 1,
                                resource: raw(b)?.as_entire_binding(),
                            });
                        }
                        let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                            label: Some(kernel.name),
                            layout: &compiled.layout,
                            entries: &entries,
                        });
                        cache.groups.insert(key, bg.clone());
                        bg
                    }
                };
                bind_groups.push(Some((compiled, bg, params, di)));
                di += 1;
            } else {
                bind_groups.push(None);
            }
        }
        drop(cache);
        if uniform_params {
            self.queue.write_buffer(&params_buf, 0, &param_bytes);
        }
        let t_bind = HostClock::now();

        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("cairn run"),
            });
        // Profiling: a pass of its own for every dispatch, stamped at both ends.
        #[cfg(not(target_arch = "wasm32"))]
        let queries = self
            .profile
            .as_ref()
            .filter(|_| n_dispatch > 0 && 2 * n_dispatch <= u64::from(profile::MAX_QUERIES))
            .map(|_| {
                self.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("cairn profile"),
                    ty: wgpu::QueryType::Timestamp,
                    count: 2 * n_dispatch as u32,
                })
            });
        #[cfg(target_arch = "wasm32")]
        let queries: Option<wgpu::QuerySet> = None;
        let mut profiled: Vec<String> = Vec::new();
        let mut i = 0;
        while i < steps.len() {
            if let Step::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                bytes,
            } = &steps[i]
            {
                enc.copy_buffer_to_buffer(raw(src)?, *src_offset, raw(dst)?, *dst_offset, *bytes);
                i += 1;
                continue;
            }
            let stamp = profiled.len() as u32 * 2;
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("cairn ops"),
                timestamp_writes: queries.as_ref().map(|query_set| {
                    wgpu::ComputePassTimestampWrites {
                        query_set,
                        beginning_of_pass_write_index: Some(stamp),
                        end_of_pass_write_index: Some(stamp + 1),
                    }
                }),
            });
            // Consecutive dispatches of one pipeline (Q, K and V; gate and up) set it once:
            // each call is validated and tracked by wgpu, about 2 us a dispatch on lavapipe's
            // host (docs/performance.md).
            let mut current: Option<(&str, Option<&str>)> = None;
            while i < steps.len() {
                let Step::Dispatch {
                    groups,
                    kernel,
                    format,
                    ..
                } = &steps[i]
                else {
                    break;
                };
                if let Some((compiled, bg, params, di)) = &bind_groups[i] {
                    if current != Some((kernel.name, *format)) {
                        pass.set_pipeline(&compiled.pipeline);
                        current = Some((kernel.name, *format));
                    }
                    match compiled.params {
                        ParamMode::Uniform => pass.set_bind_group(0, bg, &[]),
                        ParamMode::DynamicUniform => {
                            pass.set_bind_group(0, bg, &[(di * slot) as u32]);
                        }
                        ParamMode::Immediates => {
                            pass.set_immediates(0, bytemuck::cast_slice(&params[..]));
                            pass.set_bind_group(0, bg, &[]);
                        }
                    }
                    pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                }
                i += 1;
                if queries.is_some() {
                    profiled.push(format!(
                        "{}{}",
                        kernel.name,
                        format.map(|f| format!(" {f}")).unwrap_or_default()
                    ));
                    break;
                }
            }
        }
        #[cfg(not(target_arch = "wasm32"))]
        let stamps = queries
            .as_ref()
            .map(|qs| self.resolve_stamps(&mut enc, qs, profiled.len() as u32 * 2));
        if let Some((src, offset, staging, bytes)) = read
            && bytes > 0
        {
            enc.copy_buffer_to_buffer(src, offset, staging, 0, bytes);
        }
        let cmd = enc.finish();
        let t_encode = HostClock::now();
        let submission = self.queue.submit([cmd]);
        // Host time of a run, for issue 22's dispatch-bound steps: planning (fusion, kernel
        // choice, repacked retargeting), pipelines, bind groups and parameters, encoding the
        // passes, and the submission (`RUST_LOG=cairn_engine::backend::wgpu=trace`).
        tracing::trace!(
            ops = ops.len(),
            dispatches = n_dispatch,
            plan_us = HostClock::us(t0, t_plan),
            bind_us = HostClock::us(t_plan, t_bind),
            encode_us = HostClock::us(t_bind, t_encode),
            submit_us = HostClock::us(t_encode, HostClock::now()),
            "wgpu run"
        );
        self.check_errors()?;
        #[cfg(not(target_arch = "wasm32"))]
        if let (Some(profile), Some(stamps)) = (&self.profile, stamps) {
            let ticks = pollster::block_on(self.read_staged(&stamps, profiled.len() * 16))?;
            let ticks: Vec<u64> = ticks
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
                .collect();
            profile.add(&profiled, &ticks, self.queue.get_timestamp_period());
        }
        Ok(submission)
    }

    /// Profiling: the run's `count` timestamps resolved into a host-readable buffer.
    #[cfg(not(target_arch = "wasm32"))]
    fn resolve_stamps(
        &self,
        enc: &mut wgpu::CommandEncoder,
        queries: &wgpu::QuerySet,
        count: u32,
    ) -> wgpu::Buffer {
        let bytes = u64::from(count.max(1)) * 8;
        let resolved = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cairn profile stamps"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let host = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cairn profile readback"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        enc.resolve_query_set(queries, 0..count, &resolved, 0);
        enc.copy_buffer_to_buffer(&resolved, 0, &host, 0, bytes);
        host
    }

    /// Profiling: waits for the queue and returns `len` bytes of the host-readable `buf`.
    #[cfg(not(target_arch = "wasm32"))]
    async fn read_staged(&self, buf: &wgpu::Buffer, len: usize) -> Result<Vec<u8>> {
        let (tx, rx) = futures::channel::oneshot::channel();
        buf.map_async(wgpu::MapMode::Read, .., move |m| {
            let _ = tx.send(m);
        });
        self.wait()?;
        rx.await
            .map_err(|_| BackendError::Gpu("profile readback dropped".into()))?
            .map_err(|e| BackendError::Gpu(format!("profile readback: {e}")))?;
        let bytes = {
            let view = buf
                .get_mapped_range(..)
                .map_err(|e| BackendError::Gpu(format!("mapped range: {e}")))?;
            view[..len.min(view.len())].to_vec()
        };
        buf.unmap();
        Ok(bytes)
    }

    pub(crate) async fn read(&self, buf: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        self.check_errors()?;
        let start = offset / 4 * 4;
        let end = (offset + len).div_ceil(4) * 4;
        let size = (end - start).max(4);
        let staging = self.staging_buffer(size)?;
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("cairn read"),
            });
        if end > start {
            enc.copy_buffer_to_buffer(buf, start, &staging, 0, end - start);
        }
        // Timed from the submission: a software adapter's queue may block there until the
        // work before it is done.
        let t0 = HostClock::now();
        self.queue.submit([enc.finish()]);
        let (tx, rx) = futures::channel::oneshot::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        // How long the host waited for the GPU (all queued work, this read's copy included).
        tracing::trace!(wait_us = HostClock::us(t0, HostClock::now()), "wgpu read");
        rx.await
            .map_err(|_| BackendError::DeviceLost("readback was cancelled".into()))?
            .map_err(|e| BackendError::Gpu(format!("mapping readback: {e}")))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| BackendError::Gpu(format!("mapped range: {e}")))?;
        let skip = (offset - start) as usize;
        let out = view[skip..skip + len as usize].to_vec();
        drop(view);
        staging.unmap();
        self.recycle(staging);
        self.check_errors()?;
        Ok(out)
    }

    pub(crate) async fn sync(&self) -> Result<()> {
        let (tx, rx) = futures::channel::oneshot::channel();
        self.queue.on_submitted_work_done(move || {
            let _ = tx.send(());
        });
        self.wait()?;
        rx.await
            .map_err(|_| BackendError::DeviceLost("sync was cancelled".into()))?;
        self.check_errors()
    }

    /// Native: drive the device until queued work finishes. In a browser the event loop does.
    fn wait(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| BackendError::Gpu(format!("poll: {e}")))?;
        Ok(())
    }
}

#[cfg(not(target_arch = "wasm32"))]
impl Drop for WgpuBackend {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            p.report();
        }
    }
}

/// Bytes read back after a run ([`WgpuBackend::run_then_read`]), waiting in a host-readable
/// buffer for their submission to finish.
pub(crate) struct StagedRead {
    staging: wgpu::Buffer,
    // A browser's queue has no submission to wait on: its mapping waits for the work.
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    submission: wgpu::SubmissionIndex,
    skip: usize,
    len: usize,
}

/// A host clock for the run's trace event: `Instant` natively; nothing in a browser, where
/// `Instant::now` panics (wasm32 has no clock in std).
struct HostClock;

impl HostClock {
    #[cfg(not(target_arch = "wasm32"))]
    fn now() -> Option<std::time::Instant> {
        Some(std::time::Instant::now())
    }
    #[cfg(target_arch = "wasm32")]
    fn now() -> Option<()> {
        None
    }
    #[cfg(not(target_arch = "wasm32"))]
    fn us(a: Option<std::time::Instant>, b: Option<std::time::Instant>) -> u64 {
        match (a, b) {
            (Some(a), Some(b)) => b.saturating_duration_since(a).as_micros() as u64,
            _ => 0,
        }
    }
    #[cfg(target_arch = "wasm32")]
    fn us(_: Option<()>, _: Option<()>) -> u64 {
        0
    }
}

fn raw(b: &Buffer) -> Result<&wgpu::Buffer> {
    match &b.storage {
        Storage::Wgpu(w) => Ok(w),
        Storage::Rows(_) => Err(BackendError::Unsupported(format!(
            "{} is held in parts by rows (larger than a binding); only a product's weights or \
             an embedding table may be",
            b.label()
        ))),
        _ => Err(BackendError::ForeignBuffer {
            label: b.label().to_string(),
        }),
    }
}

/// Error scopes resolve immediately on native backends; in a browser they resolve later, so
/// there the check is skipped and errors arrive through the uncaptured-error handler.
fn block_on_native<F: std::future::Future<Output = Option<wgpu::Error>>>(
    f: F,
) -> Option<wgpu::Error> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        pollster::block_on(f)
    }
    #[cfg(target_arch = "wasm32")]
    {
        drop(f);
        None
    }
}

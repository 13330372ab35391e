//! The `cuda` backend: Cairn's ops as CUDA C kernels compiled at run time by NVRTC, run on one
//! stream per device through the CUDA driver API, with repeated runs (decode steps) replayed as
//! CUDA graphs.
//!
//! libcuda and libnvrtc are opened when discovery runs (cudarc's dynamic loading), so a
//! binary built with `--features cuda` runs unchanged on machines without them: discovery
//! then lists no `cuda:N` devices and says why in the log.
//!
//! Modules: `driver` (every driver call and its safety contract), `compile` (the .cu sources
//! and NVRTC), `launch` (op to kernel, grid and parameters; pure), `exec` (parameter arena
//! and graph cache), `discover` (device properties).

mod compile;
mod discover;
mod driver;
mod exec;
mod fuse;
mod launch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::peer::Piece;
use super::{BackendError, Buffer, Device, Result, Storage};
use crate::device::DeviceInfo;
use crate::kernels::Op;
use crate::options::{CudaFuse, CudaOptions, EngineOptions};
use driver::{Context, DevicePtr, Function, HostStage, Module};
use launch::{Kernel, ModuleKey};

pub(crate) use discover::discover;

/// One buffer's device memory; freed (stream-ordered) on drop.
pub(crate) struct CudaStorage {
    ptr: DevicePtr,
    ctx: Arc<Context>,
}

impl Drop for CudaStorage {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.free(self.ptr) {
            tracing::warn!(error = %e, "cuda: freeing a buffer failed");
        }
    }
}

/// A compiled module and the functions looked up in it so far.
type Loaded = (Module, HashMap<Kernel, Function>);

/// Fields drop in order: graphs, parameter slots and modules go before the context.
pub(crate) struct CudaBackend {
    id: String,
    /// The architecture the kernels are compiled for (at most the device's).
    cc: (i32, i32),
    total_bytes: u64,
    /// Before `modules`: captured graphs name their kernels.
    exec: Mutex<exec::Executor>,
    /// How decode ops are fused into fewer launches (fuse.rs).
    fusion: Fusion,
    /// Prefill's products and attention run on tensor cores (`launch::tensor_core_linear`,
    /// `launch::tensor_core_attention`).
    tensor_cores: bool,
    /// Multiprocessors, for the tile size of the tensor-core products.
    sms: u32,
    /// Which source the modules are compiled from (int8 or f32 activations, a kernel folder).
    variant: compile::Variant,
    /// Working memory of kernels that need some (split attention), and its size; grown as
    /// needed, zeroed when made (the kernels leave it as they found it).
    scratch: Mutex<Option<(CudaStorage, u64)>>,
    /// Activations converted for the product after them (`Launch::staging`), and its size.
    staging: Mutex<Option<(CudaStorage, u64)>>,
    modules: Mutex<HashMap<ModuleKey, Loaded>>,
    /// Pinned stages of finished reads, kept for the next (`run_then_read`).
    stages: Mutex<Vec<HostStage>>,
    /// Generation queues decode step n+1 before reading step n's token (`model::generate`).
    pipelined: std::sync::atomic::AtomicBool,
    ctx: Arc<Context>,
}

/// Bytes [`CudaBackend::run_then_read`] queued: on their way to pinned host memory behind the
/// run's work.
pub(crate) struct StagedRead {
    stage: HostStage,
    len: usize,
}

/// Stages kept for reuse; a decode keeps two in flight.
const KEPT_STAGES: usize = 4;

/// Opens the device behind a `cuda:N` entry.
pub(crate) fn open(info: &DeviceInfo, opts: &EngineOptions) -> Result<Device> {
    open_backend(info, opts).map(|b| Device::new_cuda(info.clone(), b))
}

fn open_backend(info: &DeviceInfo, opts: &EngineOptions) -> Result<CudaBackend> {
    let ordinal = discover::ordinal_of(&info.id)
        .ok_or_else(|| BackendError::Unsupported(format!("{}: not a cuda device id", info.id)))?;
    if !driver::driver_present() || !driver::nvrtc_present() {
        return Err(BackendError::Unsupported(format!(
            "{}: libcuda or libnvrtc cannot be opened",
            info.id
        )));
    }
    let ctx = Arc::new(Context::open(ordinal)?);
    let cc = (
        driver::attribute(
            ctx.dev,
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        ),
        driver::attribute(
            ctx.dev,
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        ),
    );
    let archs = compile::supported_archs();
    let cc = compile::target_arch(cc, &archs).ok_or_else(|| {
        BackendError::Unsupported(format!(
            "{}: this libnvrtc compiles for {archs:?}, none of which runs on compute capability {}.{}",
            info.id, cc.0, cc.1
        ))
    })?;
    let total_bytes =
        driver::total_memory(ctx.dev).map_err(driver::gpu_err("cuDeviceTotalMem"))? as u64;
    let graphs = opts.cuda.graphs;
    let sms = driver::attribute(
        ctx.dev,
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    );
    let fusion = Fusion::new(&opts.cuda, sms);
    tracing::info!(id = %info.id, name = %info.name, cc = ?cc, graphs, ?fusion, pools = ctx.pools, "opened cuda device");
    Ok(CudaBackend {
        ctx,
        id: info.id.clone(),
        cc,
        total_bytes,
        modules: Mutex::new(HashMap::new()),
        exec: Mutex::new(exec::Executor::new(graphs)),
        fusion,
        tensor_cores: opts.cuda.tensor_cores && cc.0 >= 8,
        sms: u32::try_from(sms).unwrap_or(1).max(1),
        variant: compile::Variant::new(&opts.cuda, &opts.dev),
        scratch: Mutex::new(None),
        staging: Mutex::new(None),
        stages: Mutex::new(Vec::new()),
        pipelined: std::sync::atomic::AtomicBool::new(!opts.cuda.serial_decode),
    })
}

/// Fusion settings, from `CudaOptions` (docs/cuda.md): for comparisons on a GPU machine.
#[derive(Debug, Clone, Copy)]
struct Fusion {
    on: bool,
    norms: bool,
    max_blocks: u32,
    /// How many blocks decode attention is split into, at most (0: no splitting).
    attention_blocks: u32,
}

impl Fusion {
    fn new(o: &CudaOptions, sms: i32) -> Fusion {
        Fusion {
            on: o.fuse != CudaFuse::Off,
            norms: o.fuse != CudaFuse::NoNorms,
            max_blocks: match o.fused_blocks_per_sm {
                0 => u32::MAX,
                n => n.saturating_mul(sms.max(1) as u32),
            },
            attention_blocks: o.split_attention.saturating_mul(sms.max(0) as u32),
        }
    }
}

fn storage(b: &Buffer) -> Result<&CudaStorage> {
    match &b.storage {
        Storage::Cuda(s) => Ok(s),
        _ => Err(BackendError::ForeignBuffer {
            label: b.label().to_string(),
        }),
    }
}

fn poisoned<T>(_: T) -> BackendError {
    BackendError::Gpu("cuda: a lock was poisoned by an earlier panic".into())
}

impl CudaBackend {
    pub(crate) fn max_buffer_bytes(&self) -> u64 {
        self.total_bytes
    }

    pub(crate) fn alloc(&self, label: &str, bytes: u64) -> Result<CudaStorage> {
        self.ctx.bind()?;
        // Zero-byte buffers are legal in Cairn; the driver refuses zero-byte allocations.
        let n = usize::try_from(bytes.max(4)).map_err(|_| BackendError::OutOfMemory {
            device: self.id.clone(),
            label: label.into(),
            bytes,
            reason: "larger than the address space".into(),
        })?;
        let ptr = self.ctx.alloc(n).map_err(|e| {
            if driver::is_out_of_memory(&e) {
                BackendError::OutOfMemory {
                    device: self.id.clone(),
                    label: label.into(),
                    bytes,
                    reason: e.to_string(),
                }
            } else {
                driver::gpu_err("alloc")(e)
            }
        })?;
        let s = CudaStorage {
            ptr,
            ctx: self.ctx.clone(),
        };
        self.ctx.memset_zero(ptr, n)?;
        Ok(s)
    }

    pub(crate) fn write(&self, s: &CudaStorage, offset: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.ctx.bind()?;
        self.ctx.upload(s.ptr + offset, data)
    }

    pub(crate) fn read(&self, s: &CudaStorage, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len as usize];
        self.ctx.bind()?;
        if len == 0 {
            self.ctx.synchronize()?;
            return Ok(out);
        }
        self.ctx.download(&mut out, s.ptr + offset)?;
        Ok(out)
    }

    pub(crate) fn sync(&self) -> Result<()> {
        self.ctx.synchronize()
    }

    pub(crate) fn pipelines_decode(&self) -> bool {
        self.pipelined.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn set_pipelined_decode(&self, on: bool) {
        self.pipelined
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Queues `ops`, then a copy of `len` bytes of `s` at `offset` into pinned host memory with
    /// an event behind it: [`Self::collect`] waits for that event only, so the next step can be
    /// queued (and planned, the host's share of a step) while this one runs.
    pub(crate) fn run_then_read(
        &self,
        ops: &[Op<'_>],
        s: &CudaStorage,
        offset: u64,
        len: u64,
    ) -> Result<StagedRead> {
        self.run(ops)?;
        let len = len as usize;
        let kept = self.stages.lock().map_err(poisoned)?.pop();
        let stage = match kept {
            Some(stage) if stage.bytes() >= len => stage,
            _ => HostStage::new(len)?,
        };
        self.ctx.bind()?;
        stage.queue(&self.ctx, s.ptr + offset, len)?;
        Ok(StagedRead { stage, len })
    }

    /// The bytes of a [`Self::run_then_read`], once its copy has run.
    pub(crate) fn collect(&self, read: StagedRead) -> Result<Vec<u8>> {
        self.ctx.bind()?;
        let bytes = read.stage.take(read.len)?;
        let mut kept = self.stages.lock().map_err(poisoned)?;
        if kept.len() < KEPT_STAGES {
            kept.push(read.stage);
        }
        Ok(bytes)
    }

    /// The compiled function for `kernel` in module `key`, compiling the module on first use.
    fn function(&self, key: ModuleKey, kernel: Kernel) -> Result<Function> {
        let mut modules = self.modules.lock().map_err(poisoned)?;
        let (module, functions) = match modules.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let t0 = std::time::Instant::now();
                let ptx = compile::ptx(key, self.cc, &self.variant)?;
                // A module belongs to the context current when it is loaded: with several
                // devices in one process that may be another device's (a launch of its
                // functions here would fail with an invalid handle).
                self.ctx.bind()?;
                let module = Module::load_ptx(&ptx)?;
                tracing::debug!(module = %compile::module_name(key), ms = t0.elapsed().as_secs_f64() * 1e3, "cuda module compiled");
                e.insert((module, HashMap::new()))
            }
        };
        if let Some(f) = functions.get(&kernel) {
            return Ok(*f);
        }
        let f = module.function(kernel.symbol())?;
        functions.insert(kernel, f);
        Ok(f)
    }

    pub(crate) fn run(&self, ops: &[Op<'_>]) -> Result<()> {
        let t0 = std::time::Instant::now();
        let mut launches = Vec::with_capacity(ops.len());
        self.plan_into(ops, &mut launches)?;
        self.execute(t0, ops.len(), &launches)
    }

    /// One device's share of a tensor-parallel pass (backend/peer.rs): its ops planned piece
    /// by piece (fusion stays inside a piece), the peer sums between them, all one run, so a
    /// decode step's is captured as one graph and replayed.
    pub(crate) fn run_pieces(&self, pieces: &[Piece<'_>]) -> Result<()> {
        let t0 = std::time::Instant::now();
        let mut launches = Vec::new();
        let mut ops = 0;
        for piece in pieces {
            match piece {
                Piece::Ops(o) => {
                    ops += o.len();
                    self.plan_into(o, &mut launches)?;
                }
                Piece::Sum(sum) => launches.push(launch::peer_sum(sum)),
            }
        }
        self.execute(t0, ops, &launches)
    }

    /// Lets every pair of `devices` read each other's memory; false where one pair cannot.
    pub(crate) fn enable_peers(devices: &[&CudaBackend]) -> bool {
        devices.iter().enumerate().all(|(i, a)| {
            devices.iter().enumerate().all(|(j, b)| {
                i == j || (a.ctx.ctx != b.ctx.ctx && driver::enable_peer_access(&a.ctx, &b.ctx))
            })
        })
    }

    /// `ops` as launches, after fusion and the backend's kernel choices, appended to `launches`.
    fn plan_into<'a>(&self, ops: &[Op<'a>], launches: &mut Vec<launch::Launch<'a>>) -> Result<()> {
        let items = if self.fusion.on {
            fuse::fuse(ops, self.fusion.norms)
        } else {
            ops.iter().map(fuse::Item::One).collect()
        };
        for item in &items {
            let l = match item {
                fuse::Item::One(op) => match launch::plan(op)? {
                    Some(mut l) => {
                        launch::split_attention(&mut l, self.fusion.attention_blocks);
                        if let Some(q8) =
                            launch::int8_activations(&mut l, !self.variant.f32_activations)
                        {
                            launches.push(q8);
                        }
                        if self.tensor_cores {
                            launch::tensor_core_attention(&mut l);
                            launch::tensor_core_linear(&mut l, self.sms);
                            if let Some(f16) = launch::f16_activations(&mut l) {
                                launches.push(f16);
                            }
                        }
                        l
                    }
                    None => continue,
                },
                fuse::Item::Fused(f) => fuse::plan(f, self.fusion.max_blocks),
            };
            launches.push(l);
        }
        Ok(())
    }

    /// Resolves `launches` to driver handles and queues them (direct, or a graph's capture or
    /// replay); `t0` is when planning began, `ops` how many ops they came from (for the trace).
    fn execute(
        &self,
        t0: std::time::Instant,
        ops: usize,
        launches: &[launch::Launch<'_>],
    ) -> Result<()> {
        let scratch_bytes = launches.iter().map(|l| l.scratch).max().unwrap_or(0);
        let scratch_ptr = self.grown(&self.scratch, "cuda scratch", scratch_bytes)?;
        let staging_bytes = launches.iter().map(|l| l.staging).max().unwrap_or(0);
        let staging_ptr = self.grown(&self.staging, "cuda staging", staging_bytes)?;
        let mut resolved = Vec::with_capacity(launches.len());
        for l in launches {
            let function = self.function(l.module, l.kernel)?;
            let mut buffers = l
                .buffers
                .iter()
                .map(|b| storage(b).map(|s| s.ptr))
                .collect::<Result<Vec<_>>>()?;
            if l.scratch > 0
                && let Some(p) = scratch_ptr
            {
                buffers.push(p);
            }
            if l.staging > 0
                && let Some(p) = staging_ptr
            {
                buffers.push(p);
            }
            resolved.push(exec::Resolved {
                function,
                function_id: function_id(l.module, l.kernel),
                grid: l.grid,
                block: l.block,
                shared: l.shared,
                buffers,
                params: l.params,
            });
        }
        self.ctx.bind()?;
        let t1 = std::time::Instant::now();
        let mut ex = self.exec.lock().map_err(poisoned)?;
        if gpu_time_wanted() {
            let (ran, ms) = driver::device_time(&self.ctx, || ex.run(&self.ctx, &resolved))?;
            tracing::info!(
                device = %self.id,
                launches = resolved.len(),
                plan_us = (t1 - t0).as_micros() as u64,
                gpu_us = (ms * 1e3) as u64,
                "cuda run timed"
            );
            return Ok(ran);
        }
        let ran = ex.run(&self.ctx, &resolved);
        // Host time of a run: planning (fusion, kernel choice, lookups) and queueing.
        tracing::trace!(
            device = %self.id,
            ops,
            launches = resolved.len(),
            plan_us = (t1 - t0).as_micros() as u64,
            queue_us = t1.elapsed().as_micros() as u64,
            "cuda run"
        );
        ran
    }

    /// The buffer in `slot`, made at least `bytes` long (zeroed when made); `None` while no
    /// launch has needed one.
    fn grown(
        &self,
        slot: &Mutex<Option<(CudaStorage, u64)>>,
        label: &str,
        bytes: u64,
    ) -> Result<Option<DevicePtr>> {
        let mut held = slot.lock().map_err(poisoned)?;
        if bytes > held.as_ref().map_or(0, |s| s.1) {
            // The old one is freed in stream order, after the work queued on it.
            *held = None;
            *held = Some((self.alloc(label, bytes)?, bytes));
        }
        Ok(held.as_ref().map(|s| s.0.ptr))
    }

    /// Direct launches, captures and replays so far.
    pub(crate) fn stats(&self) -> Option<exec::Stats> {
        self.exec.lock().ok().map(|e| e.stats)
    }

    /// Kernel launches of the latest `run`, after fusion.
    pub(crate) fn launches_in_last_run(&self) -> Option<usize> {
        self.stats().map(|s| s.last_launches as usize)
    }

    /// Copies `bytes` from `src` (on `src_dev`) to `dst` on this device.
    pub(crate) fn copy_from_peer(
        &self,
        dst: &CudaStorage,
        dst_offset: u64,
        src_dev: &CudaBackend,
        src: &CudaStorage,
        src_offset: u64,
        bytes: u64,
    ) -> Result<bool> {
        if bytes == 0 {
            return Ok(Arc::ptr_eq(&self.ctx, &src_dev.ctx));
        }
        if Arc::ptr_eq(&self.ctx, &src_dev.ctx) {
            self.ctx.bind()?;
            self.ctx
                .copy_d2d(dst.ptr + dst_offset, src.ptr + src_offset, bytes as usize)?;
            return Ok(true);
        }
        let direct = driver::enable_peer_access(&self.ctx, &src_dev.ctx);
        driver::peer_copy(
            &self.ctx,
            dst.ptr + dst_offset,
            &src_dev.ctx,
            src.ptr + src_offset,
            bytes as usize,
        )?;
        Ok(direct)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // What the fields free afterwards belongs to this context.
        let _ = self.ctx.bind();
        if let Some(s) = self.stats() {
            tracing::info!(id = %self.id, direct_runs = s.direct_runs, graph_captures = s.captures, graph_replays = s.replays, capture_failures = s.capture_failures, "cuda device closed");
        }
    }
}

/// A stable number for (module, kernel), for graph keys.
fn function_id(module: ModuleKey, kernel: Kernel) -> u32 {
    let m = match module {
        ModuleKey::Ops => 0,
        ModuleKey::Weights(ty) => 1 + ty.id(),
    };
    m << 8 | kernel as u32
}

/// `CAIRN_CUDA_GPU_TIME=1`: every run waits for its work and logs the device's time for it
/// beside its host planning (diagnosis of where a step goes; it serialises host and device).
fn gpu_time_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("CAIRN_CUDA_GPU_TIME").is_ok_and(|v| v == "1"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendKind;
    use crate::kernels::{Add, BufferCopy};

    fn cuda_backend(dev: &Device) -> Option<&CudaBackend> {
        match &dev.inner {
            crate::backend::Inner::Cuda(b) => Some(b),
            _ => None,
        }
    }

    /// On a machine with a CUDA driver, the first `cuda:N` device runs a kernel, a copy and a
    /// replayed graph; without one, discovery lists no cuda device and says why. The full
    /// kernel suite runs on cuda devices in tests/tests/kernels.rs.
    #[test]
    fn a_cuda_device_runs_add_copy_and_replays_a_graph() {
        let (infos, why) = discover();
        let Some(info) = infos.first() else {
            eprintln!(
                "no cuda device ({}); skipped",
                why.unwrap_or_else(|| "none found".into())
            );
            return;
        };
        let found = crate::device::discover_blocking();
        let dev = pollster::block_on(found.open_info(info.clone())).expect("open");
        assert_eq!(dev.kind(), BackendKind::Cuda);
        let a: Vec<f32> = (0..300).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..300).map(|i| 0.5 * i as f32).collect();
        let ba = dev.upload("a", bytemuck::cast_slice(&a)).expect("upload");
        let bb = dev.upload("b", bytemuck::cast_slice(&b)).expect("upload");
        let out = dev.alloc("out", 1200).expect("alloc");
        let copy = dev.alloc("copy", 2400).expect("alloc");
        for step in 0..4u64 {
            // The same ops with a new destination offset: the third run replays a graph.
            dev.run(&[
                Op::Add(Add {
                    a: &ba,
                    b: &bb,
                    out: &out,
                    n: 300,
                }),
                Op::Copy(BufferCopy {
                    src: &out,
                    src_offset: 0,
                    dst: &copy,
                    dst_offset: 400 * (step % 2),
                    bytes: 800,
                }),
            ])
            .expect("run");
            let got = dev.read_f32_blocking(&copy).expect("read");
            let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            let off = 100 * (step % 2) as usize;
            assert_eq!(&got[off..off + 200], &want[..200], "step {step}");
        }
        let stats = cuda_backend(&dev).and_then(|b| b.stats()).expect("stats");
        assert_eq!(
            (stats.direct_runs, stats.captures, stats.replays),
            (1, 1, 2)
        );
    }

    /// With two CUDA devices (a multi-GPU host), `Device::copy_to` moves bytes between them
    /// exactly, both ways and at offsets, ordered after the source's earlier work; it reports
    /// whether the bytes went peer to peer, which it must where the driver allows peer access.
    #[test]
    fn copies_between_two_cuda_devices_are_exact_and_ordered() {
        let (infos, why) = discover();
        if infos.len() < 2 {
            eprintln!(
                "{} cuda device(s) ({}); two needed, skipped",
                infos.len(),
                why.unwrap_or_else(|| "found".into())
            );
            return;
        }
        let found = crate::device::discover_blocking();
        let d0 = pollster::block_on(found.open_info(infos[0].clone())).expect("open 0");
        let d1 = pollster::block_on(found.open_info(infos[1].clone())).expect("open 1");
        let n = 1 << 20;
        let a: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.25).collect();
        let b: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
        let ba = d0.upload("a", bytemuck::cast_slice(&a)).expect("upload");
        let bb = d0.upload("b", bytemuck::cast_slice(&b)).expect("upload");
        let sum = d0.alloc("sum", 4 * n as u64).expect("alloc");
        let far = d1.alloc("far", 4 * n as u64 + 4096).expect("alloc");
        let back = d0.alloc("back", 4 * n as u64).expect("alloc");
        // Queued after the add on d0's stream: the copy must see its result.
        d0.run(&[Op::Add(Add {
            a: &ba,
            b: &bb,
            out: &sum,
            n: n as u32,
        })])
        .expect("add");
        let direct = pollster::block_on(d0.copy_to(&sum, 0, &d1, &far, 4096, 4 * n as u64))
            .expect("copy 0 -> 1");
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let got = d1.read_f32_blocking(&far).expect("read far");
        assert_eq!(&got[1024..], &want[..], "cuda:0 -> cuda:1 at offset 4096");
        let direct_back = pollster::block_on(d1.copy_to(&far, 4096, &d0, &back, 0, 4 * n as u64))
            .expect("copy 1 -> 0");
        assert_eq!(
            d0.read_f32_blocking(&back).expect("read back"),
            want,
            "cuda:1 -> cuda:0"
        );
        let ord = |i: usize| discover::ordinal_of(&infos[i].id).expect("a cuda:N id");
        // The destination's context reads the source's memory.
        let peer = (
            driver::can_access_peer(ord(1), ord(0)),
            driver::can_access_peer(ord(0), ord(1)),
        );
        eprintln!("peer access {peer:?}; copies direct {direct}, {direct_back}");
        assert_eq!((direct, direct_back), peer);
    }
    /// With two CUDA devices that can read each other's memory, a peer sum (backend/peer.rs)
    /// adds both devices' partials to each one's hidden states, exactly and identically, over
    /// several passes, and the device queued first waits on the GPU for the one queued late.
    #[test]
    fn peer_sums_between_two_cuda_devices_wait_for_each_other() {
        use crate::backend::peer::{PEER_FLAG_BYTES, PeerSum, Piece};
        let (infos, _) = discover();
        if infos.len() < 2 {
            eprintln!("{} cuda device(s); two needed, skipped", infos.len());
            return;
        }
        let found = crate::device::discover_blocking();
        let devs = [
            pollster::block_on(found.open_info(infos[0].clone())).expect("open 0"),
            pollster::block_on(found.open_info(infos[1].clone())).expect("open 1"),
        ];
        if !Device::enable_peers(&[&devs[0], &devs[1]]) {
            eprintln!("no peer access between cuda:0 and cuda:1; skipped");
            return;
        }
        let n = 5000usize;
        let h0: Vec<f32> = (0..n).map(|i| (i % 13) as f32).collect();
        let parts: Vec<Vec<f32>> = (0..2)
            .map(|d| (0..n).map(|i| ((i + d) % 5) as f32 - 2.0).collect())
            .collect();
        let h: Vec<Buffer> = devs
            .iter()
            .map(|d| d.upload("h", bytemuck::cast_slice(&h0)).expect("upload"))
            .collect();
        let first: Vec<Buffer> = devs
            .iter()
            .zip(&parts)
            .map(|(d, p)| d.upload("part", bytemuck::cast_slice(p)).expect("upload"))
            .collect();
        let second: Vec<Buffer> = devs
            .iter()
            .map(|d| d.alloc("part2", 4 * n as u64).expect("alloc"))
            .collect();
        let flags: Vec<Buffer> = devs
            .iter()
            .map(|d| {
                d.upload("flags", &[0u8; PEER_FLAG_BYTES as usize])
                    .expect("upload")
            })
            .collect();
        let passes = 3u32;
        for pass in 0..passes {
            let epoch = 1 + 2 * pass;
            for (i, dev) in devs.iter().enumerate() {
                if i == 1 {
                    // The first device is already waiting on the GPU.
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                let sum = |of_second: bool, epoch: u32| {
                    let parts = if of_second { &second } else { &first };
                    Piece::Sum(PeerSum {
                        h: &h[i],
                        parts: parts.iter().collect(),
                        flags: flags.iter().collect(),
                        index: i as u32,
                        epoch,
                        first: 1 + 2 * pass,
                        n: n as u32,
                    })
                };
                let pieces = [
                    sum(false, epoch),
                    Piece::Ops(vec![Op::Add(Add {
                        a: &first[i],
                        b: &first[i],
                        out: &second[i],
                        n: n as u32,
                    })]),
                    sum(true, epoch + 1),
                ];
                dev.run_pieces(&pieces).expect("run pieces");
            }
        }
        // Each pass adds p0 + p1, then twice that.
        let want: Vec<f32> = (0..n)
            .map(|i| h0[i] + 3.0 * passes as f32 * (parts[0][i] + parts[1][i]))
            .collect();
        for (i, dev) in devs.iter().enumerate() {
            assert_eq!(
                dev.read_f32_blocking(&h[i]).expect("read"),
                want,
                "hidden states on cuda device {i}"
            );
        }
    }
}

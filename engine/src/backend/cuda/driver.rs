//! The CUDA driver calls this backend makes, each behind a function that states its contract,
//! so the rest of the backend holds no raw `unsafe` beyond what is documented here.
//!
//! libcuda is opened at run time by cudarc (`dynamic-loading`); [`driver_present`] checks that
//! it can be opened before anything else is called, since a call into a missing library
//! panics inside cudarc.

use std::ffi::{c_int, c_void};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use crate::backend::BackendError;

pub(crate) type DevicePtr = sys::CUdeviceptr;

/// Whether libcuda can be opened (a driver is installed).
pub(crate) fn driver_present() -> bool {
    // SAFETY: only tries `dlopen` on cudarc's candidate names; nothing is called in them.
    unsafe { sys::is_culib_present() }
}

/// Whether libnvrtc (the run-time compiler for the kernels) can be opened.
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: as above, for NVRTC's candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// A driver error as a backend error, naming what failed; out-of-memory keeps its own kind.
pub(crate) fn gpu_err(what: &str) -> impl Fn(DriverError) -> BackendError + '_ {
    move |e| BackendError::Gpu(format!("cuda {what}: {e}"))
}

pub(crate) fn is_out_of_memory(e: &DriverError) -> bool {
    e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

pub(crate) fn driver_version() -> Result<i32, DriverError> {
    let mut v: c_int = 0;
    // SAFETY: writes one int to a valid location; allowed before cuInit.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok(v)
}

pub(crate) fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> i32 {
    // SAFETY: `dev` came from cuDeviceGet; an attribute the driver does not know reads as 0.
    unsafe { result::device::get_attribute(dev, attr) }.unwrap_or(0)
}

pub(crate) fn total_memory(dev: sys::CUdevice) -> Result<usize, DriverError> {
    // SAFETY: `dev` came from cuDeviceGet.
    unsafe { result::device::total_mem(dev) }
}

pub(crate) fn pci_bus_id(dev: sys::CUdevice) -> Option<String> {
    let mut buf = [0u8; 32];
    // SAFETY: the driver writes a NUL-terminated string of at most `len` bytes into `buf`.
    unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr().cast(), buf.len() as c_int, dev) }
        .result()
        .ok()?;
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// A device's primary context (shared with any other CUDA user in the process) and one
/// non-blocking stream on it: every copy and kernel of a Cairn device goes to that stream, so
/// they run in the order they were issued.
pub(crate) struct Context {
    pub(crate) dev: sys::CUdevice,
    pub(crate) ctx: sys::CUcontext,
    pub(crate) stream: sys::CUstream,
    /// Stream-ordered allocation (cuMemAllocAsync) is available: frees wait for queued work.
    pub(crate) pools: bool,
}

// SAFETY: the driver API is thread-safe; every entry point binds `ctx` to the calling thread
// first (`bind`), and the handles are plain identifiers owned by this struct until drop.
unsafe impl Send for Context {}
// SAFETY: as above; `&Context` only issues driver calls, which the driver serialises.
unsafe impl Sync for Context {}

impl Context {
    /// Retains device `ordinal`'s primary context and makes a stream on it.
    pub(crate) fn open(ordinal: usize) -> Result<Context, BackendError> {
        result::init().map_err(gpu_err("cuInit"))?;
        let dev = result::device::get(ordinal as c_int).map_err(gpu_err("cuDeviceGet"))?;
        keep_primary_context(dev)?;
        // SAFETY: `dev` is a valid device; the retain is balanced by the release in Drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }
            .map_err(gpu_err("cuDevicePrimaryCtxRetain"))?;
        let pools = attribute(
            dev,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED,
        ) != 0;
        let mut c = Context {
            dev,
            ctx,
            stream: std::ptr::null_mut(),
            pools,
        };
        c.bind()?;
        c.stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(gpu_err("cuStreamCreate"))?;
        Ok(c)
    }

    /// Makes this context current on the calling thread (cheap; needed before every call
    /// because Cairn's devices are used from whichever thread holds them).
    pub(crate) fn bind(&self) -> Result<(), BackendError> {
        // SAFETY: `ctx` is retained until drop.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(gpu_err("cuCtxSetCurrent"))
    }

    pub(crate) fn synchronize(&self) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: `stream` lives until drop.
        unsafe { result::stream::synchronize(self.stream) }.map_err(gpu_err("stream"))
    }

    /// `bytes` of device memory, ordered on the stream where pools are available.
    pub(crate) fn alloc(&self, bytes: usize) -> Result<DevicePtr, DriverError> {
        // SAFETY: the context is current (callers bind first); the pointer is freed once, by
        // `free`.
        unsafe {
            if self.pools {
                result::malloc_async(self.stream, bytes)
            } else {
                result::malloc_sync(bytes)
            }
        }
    }

    /// Frees `ptr` after the work queued so far (stream-ordered, or by waiting for it).
    pub(crate) fn free(&self, ptr: DevicePtr) -> Result<(), BackendError> {
        self.bind()?;
        // SAFETY: `ptr` came from `alloc` on this context and is freed exactly once.
        unsafe {
            if self.pools {
                result::free_async(ptr, self.stream).map_err(gpu_err("cuMemFreeAsync"))
            } else {
                result::stream::synchronize(self.stream).map_err(gpu_err("stream"))?;
                result::free_sync(ptr).map_err(gpu_err("cuMemFree"))
            }
        }
    }

    pub(crate) fn memset_zero(&self, ptr: DevicePtr, bytes: usize) -> Result<(), BackendError> {
        // SAFETY: `ptr..ptr + bytes` is inside one allocation of this context.
        unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream) }
            .map_err(gpu_err("cuMemsetD8Async"))
    }

    /// Queues a copy of `data` to `dst`. From pageable memory the driver stages `data` before
    /// returning, so the caller may free it at once.
    pub(crate) fn upload(&self, dst: DevicePtr, data: &[u8]) -> Result<(), BackendError> {
        // SAFETY: `dst..dst + data.len()` is inside one allocation of this context (the
        // caller checked the range).
        unsafe { result::memcpy_htod_async(dst, data, self.stream) }
            .map_err(gpu_err("cuMemcpyHtoDAsync"))
    }

    /// Copies `out.len()` bytes from `src` once all queued work has finished.
    pub(crate) fn download(&self, out: &mut [u8], src: DevicePtr) -> Result<(), BackendError> {
        // SAFETY: `src..src + out.len()` is inside one allocation (range checked by the
        // caller); the stream is synchronized before `out` is used or dropped.
        unsafe {
            result::memcpy_dtoh_async(out, src, self.stream)
                .map_err(gpu_err("cuMemcpyDtoHAsync"))?;
            result::stream::synchronize(self.stream).map_err(gpu_err("stream"))
        }
    }

    pub(crate) fn copy_d2d(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: both ranges lie inside allocations of this context (checked by the caller).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream) }
            .map_err(gpu_err("cuMemcpyDtoDAsync"))
    }
}

/// Retains `dev`'s primary context once for the rest of the process, so that closing the last
/// Cairn device on a GPU does not tear the context down only for the next one (a discovery, a
/// test's fresh device) to build it again: that costs a fraction of a second each time and
/// leaves other threads holding a destroyed context as their current one.
fn keep_primary_context(dev: sys::CUdevice) -> Result<(), BackendError> {
    use std::sync::{Mutex, OnceLock};
    static KEPT: OnceLock<Mutex<Vec<sys::CUdevice>>> = OnceLock::new();
    let mut kept = KEPT
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| BackendError::Gpu("cuda: context registry poisoned".into()))?;
    if !kept.contains(&dev) {
        // SAFETY: `dev` is a valid device; this retain is never released, on purpose.
        unsafe { result::primary_ctx::retain(dev) }.map_err(gpu_err("cuDevicePrimaryCtxRetain"))?;
        kept.push(dev);
    }
    Ok(())
}

impl Drop for Context {
    fn drop(&mut self) {
        let _ = self.bind();
        // SAFETY: the stream and the retained context are ours; nothing uses them after this.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            let _ = result::stream::destroy(self.stream);
            let _ = result::primary_ctx::release(self.dev);
        }
    }
}

/// Pinned host memory for one run's kernel parameters, its device twin, and an event that
/// completes once the device has taken the parameters (so the host copy can be rewritten).
pub(crate) struct ParamSlot {
    host: *mut u32,
    pub(crate) dev: DevicePtr,
    pub(crate) words: usize,
    taken: sys::CUevent,
}

// SAFETY: the pointers are owned by the slot and only touched under the backend's lock.
unsafe impl Send for ParamSlot {}

impl ParamSlot {
    pub(crate) fn new(words: usize) -> Result<ParamSlot, BackendError> {
        let bytes = words.max(1) * 4;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: allocates `bytes` of page-locked memory, freed in Drop.
        unsafe { sys::cuMemHostAlloc(&mut host, bytes, 0) }
            .result()
            .map_err(gpu_err("cuMemHostAlloc"))?;
        let mut slot = ParamSlot {
            host: host.cast(),
            dev: 0,
            words: words.max(1),
            taken: std::ptr::null_mut(),
        };
        // SAFETY: plain allocation in the current context, freed in Drop.
        slot.dev = unsafe { result::malloc_sync(bytes) }.map_err(gpu_err("cuMemAlloc"))?;
        slot.taken = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(gpu_err("cuEventCreate"))?;
        Ok(slot)
    }

    /// Waits until the device has read the previous contents, then writes `params`.
    pub(crate) fn fill(&mut self, params: &[u32]) -> Result<(), BackendError> {
        if params.len() > self.words {
            return Err(BackendError::Gpu(format!(
                "cuda: {} parameter words for a slot of {}",
                params.len(),
                self.words
            )));
        }
        // SAFETY: `taken` is a live event; a never-recorded event counts as complete.
        unsafe { result::event::synchronize(self.taken) }.map_err(gpu_err("cuEventSynchronize"))?;
        // SAFETY: `host` points at `words` u32 of pinned memory that no copy is reading now.
        let host = unsafe { std::slice::from_raw_parts_mut(self.host, self.words) };
        host[..params.len()].copy_from_slice(params);
        Ok(())
    }

    /// Queues the host-to-device copy of the first `words` parameters (captured into a graph
    /// as a memcpy node that reads the pinned memory each time the graph runs).
    pub(crate) fn queue_upload(&self, ctx: &Context, words: usize) -> Result<(), BackendError> {
        // SAFETY: both sides hold at least `words` u32; the host side is pinned and stays
        // allocated while any copy or graph using it can run (see Drop).
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(self.dev, self.host.cast(), words * 4, ctx.stream)
                .result()
                .map_err(gpu_err("cuMemcpyHtoDAsync (parameters)"))
        }
    }

    /// Records that the parameters queued so far have been taken once the stream gets here.
    pub(crate) fn mark_taken(&self, ctx: &Context) -> Result<(), BackendError> {
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.taken, ctx.stream) }.map_err(gpu_err("cuEventRecord"))
    }
}

impl Drop for ParamSlot {
    fn drop(&mut self) {
        // SAFETY: waits for the last copy that read `host`, then frees what `new` allocated.
        unsafe {
            let _ = result::event::synchronize(self.taken);
            let _ = result::event::destroy(self.taken);
            let _ = result::free_sync(self.dev);
            let _ = result::free_host(self.host.cast());
        }
    }
}

/// Pinned host memory that a device-to-host copy queued on the stream lands in, and an event
/// recorded behind that copy: the bytes can be taken once the copy (and only what was queued
/// before it) has run, while later work goes on queueing (pipelined decode).
pub(crate) struct HostStage {
    host: *mut u8,
    bytes: usize,
    done: sys::CUevent,
}

// SAFETY: the pointers are owned by the stage, which one thread uses at a time.
unsafe impl Send for HostStage {}

impl HostStage {
    pub(crate) fn new(bytes: usize) -> Result<HostStage, BackendError> {
        let bytes = bytes.max(64);
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: allocates `bytes` of page-locked memory, freed in Drop.
        unsafe { sys::cuMemHostAlloc(&mut host, bytes, 0) }
            .result()
            .map_err(gpu_err("cuMemHostAlloc"))?;
        let mut stage = HostStage {
            host: host.cast(),
            bytes,
            done: std::ptr::null_mut(),
        };
        stage.done = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(gpu_err("cuEventCreate"))?;
        Ok(stage)
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Queues a copy of `len` bytes from `src` into the stage behind the stream's work so far.
    pub(crate) fn queue(
        &self,
        ctx: &Context,
        src: DevicePtr,
        len: usize,
    ) -> Result<(), BackendError> {
        if len > self.bytes {
            return Err(BackendError::Gpu(format!(
                "cuda: a read of {len} bytes into a stage of {}",
                self.bytes
            )));
        }
        // SAFETY: `src..src + len` lies inside one allocation (range checked by the caller);
        // `host` holds at least `len` pinned bytes and is not read until `done` completes.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(self.host.cast(), src, len, ctx.stream)
                .result()
                .map_err(gpu_err("cuMemcpyDtoHAsync (staged read)"))?;
            result::event::record(self.done, ctx.stream).map_err(gpu_err("cuEventRecord"))
        }
    }

    /// Waits for the queued copy, then takes its first `len` bytes.
    pub(crate) fn take(&self, len: usize) -> Result<Vec<u8>, BackendError> {
        // SAFETY: a live event; a never-recorded one counts as complete.
        unsafe { result::event::synchronize(self.done) }.map_err(gpu_err("cuEventSynchronize"))?;
        // SAFETY: the copy into `host` has completed; `len <= bytes` was checked when queued.
        let host = unsafe { std::slice::from_raw_parts(self.host, len.min(self.bytes)) };
        Ok(host.to_vec())
    }
}

impl Drop for HostStage {
    fn drop(&mut self) {
        // SAFETY: waits for the last copy into `host`, then frees what `new` allocated.
        unsafe {
            let _ = result::event::synchronize(self.done);
            let _ = result::event::destroy(self.done);
            let _ = result::free_host(self.host.cast());
        }
    }
}

/// A loaded module's kernel.
#[derive(Clone, Copy)]
pub(crate) struct Function(pub(crate) sys::CUfunction);

// SAFETY: function handles are immutable identifiers valid while their module is loaded (the
// backend keeps every module until it is dropped).
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

pub(crate) struct Module(sys::CUmodule);

// SAFETY: a module handle is an identifier; loading and unloading happen under the lock.
unsafe impl Send for Module {}

impl Module {
    /// Loads NUL-terminated PTX (the driver compiles it for the device).
    pub(crate) fn load_ptx(ptx: &[u8]) -> Result<Module, BackendError> {
        if ptx.last() != Some(&0) {
            return Err(BackendError::Gpu("cuda: PTX is not NUL-terminated".into()));
        }
        // SAFETY: `ptx` is a NUL-terminated PTX image that outlives the call.
        let m = unsafe { result::module::load_data(ptx.as_ptr().cast()) }
            .map_err(gpu_err("cuModuleLoadData"))?;
        Ok(Module(m))
    }

    pub(crate) fn function(&self, name: &str) -> Result<Function, BackendError> {
        let cname = std::ffi::CString::new(name)
            .map_err(|_| BackendError::Gpu(format!("cuda: bad kernel name {name}")))?;
        // SAFETY: the module is loaded.
        let f = unsafe { result::module::get_function(self.0, cname) }
            .map_err(gpu_err("cuModuleGetFunction"))?;
        Ok(Function(f))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: nothing launches this module's kernels once the backend drops it.
        let _ = unsafe { result::module::unload(self.0) };
    }
}

/// Queues `f` on the stream. `args` are the kernel's arguments in order: the parameter
/// pointer, then buffer pointers, each a device address.
pub(crate) fn launch(
    ctx: &Context,
    f: Function,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    args: &mut [DevicePtr],
) -> Result<(), BackendError> {
    let mut ptrs: Vec<*mut c_void> = args
        .iter_mut()
        .map(|a| (a as *mut DevicePtr).cast())
        .collect();
    // SAFETY: every kernel in kernels/*.cu takes exactly these pointer arguments (built from
    // the same table in launch.rs); the buffers they point to were checked by `validate_op`
    // against the shapes in the parameters, and stay allocated until queued work finishes
    // (frees are stream-ordered). `shared_bytes` is at most the 48 KiB that needs no opt-in
    // (fuse.rs). `ptrs` outlives the call, which copies the arguments.
    unsafe {
        result::launch_kernel(
            f.0,
            (grid[0], grid[1], grid[2]),
            (block[0], block[1], block[2]),
            shared_bytes,
            ctx.stream,
            &mut ptrs,
        )
    }
    .map_err(gpu_err("cuLaunchKernel"))
}

/// An instantiated CUDA graph.
pub(crate) struct GraphExec {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: graph handles are identifiers used only under the backend's lock.
unsafe impl Send for GraphExec {}

impl GraphExec {
    pub(crate) fn launch(&self, ctx: &Context) -> Result<(), BackendError> {
        // SAFETY: live executable graph and stream.
        unsafe { result::graph::launch(self.exec, ctx.stream) }.map_err(gpu_err("cuGraphLaunch"))
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: an in-flight graph is freed by the driver when it completes.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}

/// Records what `enqueue` queues on the stream into a graph instead of running it.
pub(crate) fn capture(
    ctx: &Context,
    enqueue: impl FnOnce() -> Result<(), BackendError>,
) -> Result<GraphExec, BackendError> {
    // SAFETY: live stream; thread-local mode refuses unsafe calls on this thread only.
    unsafe {
        result::stream::begin_capture(
            ctx.stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
    }
    .map_err(gpu_err("cuStreamBeginCapture"))?;
    let queued = enqueue();
    // SAFETY: ends the capture begun above, whatever `enqueue` did, so the stream is usable
    // again.
    let graph = unsafe { result::stream::end_capture(ctx.stream) };
    queued?;
    let graph = graph.map_err(gpu_err("cuStreamEndCapture"))?;
    // SAFETY: `graph` was just captured.
    match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
        Ok(exec) => Ok(GraphExec { graph, exec }),
        Err(e) => {
            // SAFETY: the graph is ours and unused.
            let _ = unsafe { result::graph::destroy(graph) };
            Err(gpu_err("cuGraphInstantiate")(e))
        }
    }
}

/// Whether device `a` can read device `b`'s memory directly (NVLink or PCIe peer to peer).
fn can_access(a: sys::CUdevice, b: sys::CUdevice) -> bool {
    let mut can: c_int = 0;
    // SAFETY: both are devices the driver handed out; writes one int.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, a, b) }
        .result()
        .is_ok()
        && can != 0
}

/// [`can_access`] by CUDA ordinals.
#[cfg(test)]
pub(crate) fn can_access_peer(a: usize, b: usize) -> bool {
    match (
        result::device::get(a as c_int),
        result::device::get(b as c_int),
    ) {
        (Ok(da), Ok(db)) => can_access(da, db),
        _ => false,
    }
}

/// Lets `ctx`'s device read `peer`'s memory directly, where the hardware allows; false where
/// it does not (copies then go through the host, which the driver does itself).
pub(crate) fn enable_peer_access(ctx: &Context, peer: &Context) -> bool {
    if !can_access(ctx.dev, peer.dev) {
        return false;
    }
    if ctx.bind().is_err() {
        return false;
    }
    // SAFETY: `peer.ctx` is a live context; enabling twice reports "already enabled".
    let enabled = matches!(
        unsafe { sys::cuCtxEnablePeerAccess(peer.ctx, 0) },
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    );
    // Peer access covers memory from cuMemAlloc; stream-ordered allocations come from the
    // peer's memory pool, whose own access list must name this device too (copies work
    // without it, kernels reading the peer's memory do not: an illegal address).
    enabled && (!peer.pools || grant_pool_access(peer.dev, ctx.dev))
}

/// Lets device `reader` read and write what `owner`'s current memory pool hands out.
fn grant_pool_access(owner: sys::CUdevice, reader: sys::CUdevice) -> bool {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `owner` is a device the driver handed out; writes one handle.
    if unsafe { sys::cuDeviceGetMemPool(&mut pool, owner) }
        .result()
        .is_err()
    {
        return false;
    }
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: reader,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: a live pool and one valid descriptor.
    unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) }
        .result()
        .is_ok()
}

/// Queues on `dst`'s stream a copy from `src`'s device, after what `src` has queued; `src`'s
/// later work waits for the copy.
pub(crate) fn peer_copy(
    dst: &Context,
    dst_ptr: DevicePtr,
    src: &Context,
    src_ptr: DevicePtr,
    bytes: usize,
) -> Result<(), BackendError> {
    // An event belongs to the context current when it is made, and can only be recorded on
    // that context's streams (waiting on it works from any context).
    src.bind()?;
    let ev_src = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
        .map_err(gpu_err("cuEventCreate"))?;
    if let Err(e) = dst.bind() {
        // SAFETY: an event made above, not yet used.
        let _ = unsafe { result::event::destroy(ev_src) };
        return Err(e);
    }
    let ev_dst = match result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) {
        Ok(e) => e,
        Err(e) => {
            // SAFETY: an event made above, not yet used.
            let _ = unsafe { result::event::destroy(ev_src) };
            return Err(gpu_err("cuEventCreate")(e));
        }
    };
    // SAFETY: live events and streams of both contexts; the ranges were checked by the caller
    // and stay allocated (frees are ordered after the waits below). The events are destroyed
    // after use; the driver keeps recorded work alive.
    let r = unsafe {
        (|| {
            src.bind()?;
            result::event::record(ev_src, src.stream).map_err(gpu_err("cuEventRecord"))?;
            dst.bind()?;
            result::stream::wait_event(
                dst.stream,
                ev_src,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(gpu_err("cuStreamWaitEvent"))?;
            result::memcpy_peer_async(dst.ctx, dst_ptr, src.ctx, src_ptr, bytes, dst.stream)
                .map_err(gpu_err("cuMemcpyPeerAsync"))?;
            result::event::record(ev_dst, dst.stream).map_err(gpu_err("cuEventRecord"))?;
            src.bind()?;
            result::stream::wait_event(
                src.stream,
                ev_dst,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(gpu_err("cuStreamWaitEvent"))
        })()
    };
    // SAFETY: destroying a recorded event is allowed; waits already queued still complete.
    unsafe {
        let _ = result::event::destroy(ev_src);
        let _ = result::event::destroy(ev_dst);
    }
    r
}

/// Runs `queue` (which queues work on `ctx`'s stream) and waits for that work: the device's
/// time for it in milliseconds, between two timing events around it. The host waits, so this
/// is for diagnosis only (`CAIRN_CUDA_GPU_TIME`), never on a served path.
pub(crate) fn device_time<T>(
    ctx: &Context,
    queue: impl FnOnce() -> Result<T, BackendError>,
) -> Result<(T, f32), BackendError> {
    let start = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
        .map_err(gpu_err("cuEventCreate"))?;
    let end = match result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT) {
        Ok(e) => e,
        Err(e) => {
            // SAFETY: an event made above, not yet used.
            let _ = unsafe { result::event::destroy(start) };
            return Err(gpu_err("cuEventCreate")(e));
        }
    };
    let timed = (|| {
        // SAFETY: live events of this context, recorded on its own stream; the host waits
        // for `end` before reading the time, and the events are destroyed below, after that.
        unsafe { result::event::record(start, ctx.stream) }.map_err(gpu_err("cuEventRecord"))?;
        let out = queue()?;
        unsafe { result::event::record(end, ctx.stream) }.map_err(gpu_err("cuEventRecord"))?;
        unsafe { result::event::synchronize(end) }.map_err(gpu_err("cuEventSynchronize"))?;
        let ms =
            unsafe { result::event::elapsed(start, end) }.map_err(gpu_err("cuEventElapsedTime"))?;
        Ok((out, ms))
    })();
    // SAFETY: both events are complete (or never recorded) and nothing refers to them.
    unsafe {
        let _ = result::event::destroy(start);
        let _ = result::event::destroy(end);
    }
    timed
}

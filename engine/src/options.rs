//! Settings of the backends, given to discovery by whoever embeds the engine.
//!
//! The engine reads no environment variable of its own: the `cairn` binary builds these from
//! its flags (each with an environment variable of the same meaning), tests build them in code,
//! and `Default` is what a plain run uses. Variables that belong to wgpu itself (`WGPU_BACKEND`,
//! `WGPU_VALIDATION`, ...) are left to wgpu.

use std::path::PathBuf;

/// Everything a backend may be told besides which device to open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineOptions {
    /// Threads of the cpu backend (one pool per process, started by the first cpu device
    /// opened); `None`: one per core.
    pub cpu_threads: Option<usize>,
    /// The cpu backend's quantized `Linear` keeps activations in f32 (the scalar reference of
    /// `kernels::linear`) instead of rounding them to int8 for integer dot products: for tests
    /// that hold other devices to the exact reference.
    pub cpu_f32_linear: bool,
    /// The wgpu backends to enumerate adapters on; `None`: what `WGPU_BACKEND` names (wgpu's
    /// own variable), else all of them.
    pub wgpu_backends: Option<wgpu::Backends>,
    pub wgpu: WgpuOptions,
    pub cuda: CudaOptions,
    pub vulkan: VulkanOptions,
    pub dev: DevHooks,
}

/// Kernel variants and execution of the `cuda` backend (docs/cuda.md): for comparisons on a
/// GPU machine; the defaults are the measured best.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// Repeated runs (decode steps) are captured and replayed as CUDA graphs.
    pub graphs: bool,
    /// Which decode ops are fused into fewer launches.
    pub fuse: CudaFuse,
    /// The fused matrix-vector grid's cap in blocks per multiprocessor; 0: a block per row
    /// group.
    pub fused_blocks_per_sm: u32,
    /// Decode attention is split into about this many blocks per multiprocessor; 0: a block
    /// per (head, token).
    pub split_attention: u32,
    /// The 4-bit matrix-vector kernels round activations to int8 and sum with dp4a; `false`
    /// keeps them in f32.
    pub int8_dot: bool,
    /// Prefill's matrix products run on f16 tensor cores where the device has them (compute
    /// capability 8.0 and up); `false` keeps the f32 FMA tiles.
    pub tensor_cores: bool,
    /// Generation waits for each decode step's token before queueing the next (the order
    /// before session 18); off by default, as `WgpuOptions::serial_decode`.
    pub serial_decode: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            graphs: true,
            fuse: CudaFuse::All,
            fused_blocks_per_sm: 4,
            split_attention: 4,
            int8_dot: true,
            tensor_cores: true,
            serial_decode: false,
        }
    }
}

/// What the `cuda` backend fuses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CudaFuse {
    Off,
    /// Everything but the RMS norms.
    NoNorms,
    #[default]
    All,
}

/// Settings of the WGSL executor, which the `wgpu` and `vulkan` backends share.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WgpuOptions {
    /// Which ops are folded into the matrix-vector products beside them
    /// (`backend/wgpu/fuse.rs`).
    pub fuse: WgpuFuse,
    /// Which matrix-vector kernels run one-token products and small decode batches.
    pub matvec: WgpuMatvec,
    /// The shape of `WgpuMatvec::Wide`'s walk (rows and invocations a workgroup, chunks in
    /// flight per invocation, packed 8-bit dot products or f32).
    pub matvec_shape: WgpuMatvecShape,
    /// Which kernel runs prompt-sized products (more tokens than the matrix-vector kernels
    /// take).
    pub prefill: WgpuPrefill,
    /// The limits devices are opened with: the adapter's own, or WebGPU's defaults.
    pub limits: WgpuLimits,
    /// Decode attention split across workgroups by keys (flash-decoding) or one workgroup per
    /// head.
    pub attention: WgpuAttention,
    /// The first pass of decode attention cut by keys: one workgroup per query head, or per
    /// key/value head for all the query heads that share it.
    pub attention_kernel: WgpuAttentionKernel,
    /// The fewest keys a piece of the grouped kernel gets (`None`: its default, 32).
    pub attention_piece: Option<u32>,
    /// Prompt attention (more query tokens than decode's) through workgroup-memory tiles of 16
    /// queries, or one workgroup per (head, token).
    pub prompt_attention: WgpuPromptAttention,
    /// Generation waits for each decode step's token before queueing the next step (the
    /// order before session 18). Off by default: step n+1, whose input is the token step n
    /// sampled into a device buffer, is queued before step n's token is read back, so the
    /// GPU does not idle while the host encodes (`model::generate`).
    pub serial_decode: bool,
    /// The `wgpu` backend compiles its kernels with wgpu's runtime checks: indices into
    /// arrays clamped, loops bounded by a hidden counter, divisions guarded. Off by default
    /// natively, as on the `vulkan` backend's SPIR-V: every op's shapes are checked against
    /// its buffers before it is encoded (`validate_op`), and the indices read from buffers
    /// (token ids, block tables) are checked on the host and again in the kernels that take
    /// them, so the checks cost time without guarding anything. Buffer accesses keep whatever
    /// bounds the driver enforces by itself (Vulkan's robust buffer access, which wgpu turns
    /// on where the device has it). A browser's WebGPU always checks.
    pub shader_checks: bool,
}

/// The limits the `wgpu` and `vulkan` backends open a device with. A tensor larger than the
/// storage binding limit is cut by rows into several buffers (`Device::upload_rows`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WgpuLimits {
    /// WebGPU's defaults, the floor every browser and phone guarantees, on any adapter:
    /// 128 MiB per storage binding, 256 MiB per buffer, 16 KiB of workgroup memory, 256
    /// invocations per workgroup, 8 storage buffers per stage, and no optional shader feature
    /// (no shader-f16, no subgroups).
    pub webgpu_defaults: bool,
    /// A storage binding (and buffer) limit below the one the device would have: for tests
    /// that make small models split their tensors. Never raises a limit.
    pub max_binding_bytes: Option<u64>,
}

impl WgpuLimits {
    /// The storage-binding and buffer-size limits after these settings, from the adapter's.
    pub fn binding_and_buffer(&self, binding: u64, buffer: u64) -> (u64, u64) {
        let (mut binding, mut buffer) = (binding, buffer);
        if self.webgpu_defaults {
            binding = binding.min(WEBGPU_DEFAULT_BINDING);
            buffer = buffer.min(WEBGPU_DEFAULT_BUFFER);
        }
        if let Some(cap) = self.max_binding_bytes {
            binding = binding.min(cap);
            buffer = buffer.min(cap);
        }
        (binding, buffer)
    }
}

/// WebGPU's default `maxStorageBufferBindingSize`.
pub const WEBGPU_DEFAULT_BINDING: u64 = 128 << 20;
/// WebGPU's default `maxBufferSize`.
pub const WEBGPU_DEFAULT_BUFFER: u64 = 256 << 20;

/// How the `wgpu` and `vulkan` backends run decode attention (`Attention` of few tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WgpuAttention {
    /// One workgroup per (head, token) walks every key (`attention.wgsl`).
    Single,
    /// Flash-decoding: the keys are cut into pieces, one workgroup per (head, token, piece)
    /// computes its piece's maximum, sum and weighted values (`attention_split.wgsl`), and a
    /// second pass merges them (`attention_merge.wgsl`).
    Split,
    /// On GPUs, `Split` where the context gives at least two pieces of 64 keys, else
    /// `Single`; `Single` on software rasterizers (one workgroup per head already keeps their
    /// few cores busy; measured in docs/performance.md).
    #[default]
    ByAdapter,
}

impl WgpuAttention {
    /// What runs on a device that is a software rasterizer or not: `Single`, `Split`
    /// (every decode attention cut), or `ByAdapter` (cut where the context is long enough).
    pub fn resolve(self, software: bool) -> WgpuAttention {
        match self {
            WgpuAttention::ByAdapter if software => WgpuAttention::Single,
            other => other,
        }
    }
}

/// Which kernel scores the pieces of decode attention cut by keys (`WgpuAttention::Split`,
/// and `ByAdapter` where it cuts) on the `wgpu` and `vulkan` backends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WgpuAttentionKernel {
    /// One workgroup per (query head, token, piece) (`attention_split.wgsl`): under
    /// grouped-query attention each key and value row is read once per query head.
    Heads,
    /// One workgroup per (key/value head, token, piece) scoring up to 4 query heads that
    /// share it against each row loaded once (`attention_grouped.wgsl`); head sizes that are
    /// not a multiple of 4 keep `Heads`. The default since session 20 (H200: 8B decode 1.03x
    /// `Heads` at 512 keys, 1.20x at 2,048; 135M 1.11x).
    #[default]
    Grouped,
}

/// How the `wgpu` and `vulkan` backends run prompt attention (`Attention` and
/// `PagedAttention` of more query tokens than decode attention takes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WgpuPromptAttention {
    /// One workgroup per (head, token) walks every key of its token (`attention.wgsl`,
    /// `paged_attention.wgsl`).
    Single,
    /// A workgroup per (head, 16 consecutive query tokens of a sequence) loads each tile of
    /// 32 keys, then of their values, into workgroup memory once for all 16
    /// (`attention_tiled.wgsl`, `paged_attention_tiled.wgsl`); head sizes up to 128, on
    /// devices with 32 KiB of workgroup memory (others keep `Single`).
    Tiles,
    /// `Tiles` on GPUs, `Single` on software rasterizers.
    #[default]
    ByAdapter,
}

impl WgpuPromptAttention {
    /// `Single` or `Tiles` on a device that is a software rasterizer or not, with
    /// `workgroup_bytes` of workgroup memory (the tiles need [`PROMPT_TILE_BYTES`]).
    pub fn resolve(self, software: bool, workgroup_bytes: u32) -> WgpuPromptAttention {
        match self {
            _ if workgroup_bytes < PROMPT_TILE_BYTES => WgpuPromptAttention::Single,
            WgpuPromptAttention::ByAdapter if software => WgpuPromptAttention::Single,
            WgpuPromptAttention::ByAdapter => WgpuPromptAttention::Tiles,
            other => other,
        }
    }
}

/// Workgroup memory the prompt attention tiles use (`attention_tile.wgsl`: 16 queries and 32
/// keys of up to 128 elements, their scores and weights), rounded up to what devices offer.
pub const PROMPT_TILE_BYTES: u32 = 32 << 10;

/// The `wgpu` and `vulkan` backends' kernels for prompt-sized products (more tokens than the
/// matrix-vector kernels take; `backend/wgpu/plan.rs`, `prefill`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WgpuPrefill {
    /// `linear_matmat`: a 4-row by 4-token block of sums an invocation, weights and
    /// activations read from global memory, no workgroup memory.
    Registers,
    /// `linear_matmat_tiled`: 64-row by 64-token tiles staged in workgroup memory, 4 x 4 sums
    /// an invocation (session 15's tiles; 1,808 tok/s against `Registers`' 6,542 on the 135M
    /// model's prefill on an H100).
    Tiles,
    /// The `linear_gemm_*` kernels (`shaders/src/lib.rs`, `gemm_body`), the tile by the
    /// product's shape: 128 x 128 where that still gives enough workgroups, else 64 x 64, else
    /// 32 x 32. Rows of a multiple of the tile's step of columns (16 or 32); others run
    /// `Registers`.
    Gemm,
    /// `Gemm` with 128-row by 128-token tiles always.
    Gemm128,
    /// `Gemm` with 64 x 64 tiles always.
    Gemm64,
    /// `Gemm` with 32 x 32 tiles always.
    Gemm32,
    /// The `linear_gemm_coop*` kernels on the raw vulkan backend: tiles of f16 in workgroup
    /// memory multiplied on cooperative matrices (tensor cores; 16 x 16 x 16, f32 sums), where
    /// the driver has them (VK_KHR_cooperative_matrix with that configuration, f16), 128 x 128
    /// where that still gives enough workgroups, else 64 x 64; elsewhere, and on the wgpu
    /// backend, `Gemm`. Experimental (wgpu's cooperative-matrix feature is): not `ByAdapter`'s
    /// choice. Activations and weights are rounded to f16 (sums stay f32).
    Coop,
    /// `Coop` with 64 x 64 tiles always.
    Coop64,
    /// `Coop` with 128 x 128 tiles always.
    Coop128,
    /// `Coop` with 64-row by 128-token tiles (four subgroups of 2 x 4 blocks) always.
    Coop64x128,
    /// `Coop` with 64 x 64 tiles and 64 columns a step always.
    Coop64K64,
    /// `Coop` on the vulkan backend's GPUs whose driver has f16 cooperative matrices, `Gemm`
    /// on other GPUs, `Registers` on software rasterizers (on lavapipe workgroup tiles measured
    /// slower than register blocks, and compile slower). On an H200 the 8B shape's 512-token
    /// prefill ran at 2,222-2,467 tok/s on vulkan with `Coop`, 1,107-1,128 with `Gemm`,
    /// 502-503 with `Registers` (docs/performance.md, session 19).
    #[default]
    ByAdapter,
}

impl WgpuPrefill {
    /// What runs on a device that is a software rasterizer or not, and was opened with
    /// cooperative matrices or not.
    pub fn resolve(self, software: bool, coop: bool) -> WgpuPrefill {
        match self {
            WgpuPrefill::ByAdapter if software => WgpuPrefill::Registers,
            WgpuPrefill::ByAdapter if coop => WgpuPrefill::Coop,
            WgpuPrefill::ByAdapter => WgpuPrefill::Gemm,
            other => other,
        }
    }

    /// Whether this choice asks for cooperative matrices.
    pub fn coop(self) -> bool {
        matches!(
            self,
            WgpuPrefill::Coop
                | WgpuPrefill::Coop64
                | WgpuPrefill::Coop128
                | WgpuPrefill::Coop64x128
                | WgpuPrefill::Coop64K64
        )
    }
}

/// The `wgpu` and `vulkan` backends' matrix-vector kernels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WgpuMatvec {
    /// `linear_matvec`: 32 invocations per row, 8 rows per workgroup, one token; a decode
    /// batch runs a pass per sequence.
    Rows,
    /// The streaming kernels (`linear_matvec_stream`): 4 rows per workgroup with each
    /// chunk's activations loaded once for all of them, 8 weights per load of quants, decode
    /// batches of up to 8 tokens in one pass; sums reduced through workgroup memory.
    Stream,
    /// `Stream` with subgroup reductions where the device has subgroups (else `Stream`).
    Subgroup,
    /// `Subgroup`, with Q8_0, Q4_0 and Q4_1 products on 8-bit integers: a small kernel
    /// rounds the activations to int8 per 32-element block once per product
    /// (`quantize_q8`), and the streaming walk multiplies packed bytes with
    /// `dot4I8Packed` (WGSL's `packed_4x8_integer_dot_product`; Vulkan's integer dot
    /// product instructions where the device has them, else naga's shifts and multiplies).
    /// Other formats, and devices without the language feature, run `Subgroup`.
    Int8,
    /// `Subgroup` over Q4_0, Q4_1 and Q8_0 weights repacked at upload
    /// (`backend/wgpu/repack.rs`): scales in a 16-byte header per group of blocks, each
    /// block's quants on 16 bytes, so the streaming kernels over rows of 2048 elements and
    /// more load a block's quants as one vec4 (`stream_walk_v4.wgsl`); every other kernel
    /// reads the repacked layout through its own format (`formats/q4_1r.wgsl`, ...). Not
    /// `ByAdapter`'s choice until measured on a GPU.
    Repacked,
    /// `Subgroup`, with one-token products (decode's, fused or not) on the wide walk of
    /// `WgpuOptions::matvec_shape` (`shaders/src/lib.rs`, `wide_walk`): several rows a
    /// workgroup with each chunk's activations loaded once for all of them, several chunks
    /// of 8 weights in flight per invocation, and for Q8_0, Q4_0 and Q4_1 (with `dot`, where
    /// the device has packed 8-bit dot products) activations rounded to int8 per chunk
    /// inside the kernel and `dot4I8Packed`, the shape of the cuda backend's split
    /// matrix-vector kernel. Devices without subgroups run `Stream`.
    Wide,
    /// `Wide` (its default shape) on GPUs: on an H200 through NVIDIA's Vulkan driver it
    /// decoded the 8B shape at 147.8 and 153.3 tok/s on `vulkan` against `Subgroup`'s 131.6
    /// and 135.5 in the same call, and 125.5 against 97.9 on `wgpu` (docs/performance.md,
    /// session 18); where a product's rows are shorter than a chunk per invocation (the
    /// 135M model's), and for Q8_0 (2% to 9% slower on the wide walk there), `Subgroup`'s
    /// kernels run. `Subgroup` on software rasterizers (where the
    /// streaming kernels measured faster than `Rows`: lavapipe, 135M decode, 3.7 s a token
    /// against 4.5 on wgpu, 4.4 against 4.8 on vulkan), where the wide walk's large shapes
    /// compile slowly. In browsers wgpu offers no subgroups, so `Stream` runs (checked
    /// against the reference in headless Chromium by the web package's `checkGpuKernels`).
    /// The kernel tests force each family.
    #[default]
    ByAdapter,
}

impl WgpuMatvec {
    /// What runs on a device that is a software rasterizer or not: `ByAdapter` is `Wide` on
    /// GPUs and `Subgroup` on software rasterizers; every other choice is itself.
    pub fn resolve(self, software: bool) -> WgpuMatvec {
        match self {
            WgpuMatvec::ByAdapter if software => WgpuMatvec::Subgroup,
            WgpuMatvec::ByAdapter => WgpuMatvec::Wide,
            other => other,
        }
    }
}

/// The shape of the wide matrix-vector walk (`WgpuMatvec::Wide`), as
/// `rows:8,wg:256,unroll:4,dot:1` (`CAIRN_WGPU_MATVEC_SHAPE`; keys may be left out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WgpuMatvecShape {
    /// Rows a workgroup: 4, 8, 12 or 16.
    pub rows: u32,
    /// Invocations a workgroup: 32 to 1024 in powers of two (past 256 where the device takes
    /// it; WebGPU's default limit is 256).
    pub wg: u32,
    /// Chunks of 8 weights in flight per invocation and loop step: 1 to 8.
    pub unroll: u32,
    /// Q8_0, Q4_0 and Q4_1 on int8 activations and packed dot products where the device has
    /// them (else f32 activations, as every other format).
    pub dot: bool,
}

impl Default for WgpuMatvecShape {
    /// The cuda backend's split kernel's: 8 rows, 256 invocations, 4 steps in flight, int8.
    fn default() -> Self {
        let s = cairn_shaders::WideShape::default();
        WgpuMatvecShape {
            rows: s.rows,
            wg: s.wg,
            unroll: s.unroll,
            dot: true,
        }
    }
}

impl WgpuMatvecShape {
    /// The walk's shape, without `dot`.
    pub fn walk(&self) -> cairn_shaders::WideShape {
        cairn_shaders::WideShape {
            rows: self.rows,
            wg: self.wg,
            unroll: self.unroll,
        }
    }
}

impl std::str::FromStr for WgpuMatvecShape {
    type Err = String;

    /// `key:value` pairs separated by commas (`rows`, `wg`, `unroll`, `dot`); keys left out
    /// keep the default's value.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut shape = WgpuMatvecShape::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once([':', '='])
                .ok_or_else(|| format!("`{part}`: expected key:value"))?;
            let number = || {
                value
                    .trim()
                    .parse::<u32>()
                    .map_err(|_| format!("`{part}`: not a number"))
            };
            match key.trim() {
                "rows" => shape.rows = number()?,
                "wg" => shape.wg = number()?,
                "unroll" => shape.unroll = number()?,
                "dot" => {
                    shape.dot = match value.trim() {
                        "1" | "true" | "on" => true,
                        "0" | "false" | "off" => false,
                        _ => return Err(format!("`{part}`: dot is 0 or 1")),
                    }
                }
                other => return Err(format!("unknown key `{other}` (rows, wg, unroll, dot)")),
            }
        }
        shape.walk().check()?;
        Ok(shape)
    }
}

/// What the `wgpu` and `vulkan` backends fold into their products.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WgpuFuse {
    /// Every op its own dispatch.
    Off,
    /// Residual adds, silu(gate) * up, rope and the KV-cache copies, but not the RMS norms.
    NoNorms,
    /// All of it, the norms too.
    All,
    /// `All` on GPUs, `Off` on software rasterizers (lavapipe, SwiftShader), where dispatches
    /// cost little against the arithmetic and the fused kernel was slower (135M decode on
    /// lavapipe: 6.8 s a step unfused, 7.4 without the norms, 10.8 with them), so CI's model
    /// tests keep their time; the kernel tests force `All` there.
    #[default]
    ByAdapter,
}

impl WgpuFuse {
    /// (fuse at all, fuse the norms) on a device that is a software rasterizer or not.
    pub fn resolve(self, software: bool) -> (bool, bool) {
        match self {
            WgpuFuse::Off => (false, false),
            WgpuFuse::NoNorms => (true, false),
            WgpuFuse::All => (true, true),
            WgpuFuse::ByAdapter => (!software, !software),
        }
    }
}

/// Settings of the raw `vulkan` backend (docs/vulkan.md).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VulkanOptions {
    /// Kernel parameters as push constants instead of a uniform buffer. Known to give wrong
    /// results (the kernels read zeros), so off unless asked for while that is investigated.
    pub push_constants: bool,
    /// How the kernels' workgroup memory is zeroed, as WGSL requires, before they run.
    pub zero_init: VulkanZeroInit,
    /// Kernel parameters through a uniform binding with a dynamic offset (one bind group per
    /// set of buffers), or at a fixed offset in each dispatch's bind group, as the `wgpu`
    /// backend binds them.
    pub fixed_params: bool,
}

/// How the `vulkan` backend's SPIR-V zeroes workgroup memory (naga's
/// `ZeroInitializeWorkgroupMemoryMode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum VulkanZeroInit {
    /// Invocation 0 of every workgroup stores zeros over all of the kernel's workgroup arrays,
    /// then a barrier (naga's polyfill; what the backend did until session 20).
    Polyfill,
    /// The driver zeroes them (`VK_KHR_zero_initialize_workgroup_memory`, core in Vulkan
    /// 1.3), as wgpu's own pipelines do where the device has it; the polyfill elsewhere. The
    /// default: besides what it saves at run time, lavapipe compiles the polyfill's stores over
    /// large arrays for minutes (the prompt attention tiles' 28 KiB: over 4 minutes cold,
    /// against under a second with the driver's zeroing).
    #[default]
    Native,
    /// Not zeroed: every kernel writes its workgroup memory before reading it.
    Off,
}

/// Development hooks: what they hold is honoured only in builds with the `dev-hooks` feature,
/// which release builds leave off; without it the engine ignores them (and says so once in
/// the log).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DevHooks {
    /// A folder whose copies of the CUDA kernel files (`common.cuh`, `ops.cu`, `linear.cu`,
    /// `q4_0.cuh`, ...) replace the built-in ones: kernel work on a GPU machine without
    /// rebuilding.
    pub cuda_kernels: Option<PathBuf>,
}

impl DevHooks {
    /// Whether this build honours the hooks.
    pub const COMPILED: bool = cfg!(feature = "dev-hooks");

    /// The kernel folder, where this build honours it.
    pub fn cuda_kernels(&self) -> Option<&std::path::Path> {
        if !Self::COMPILED {
            if let Some(dir) = &self.cuda_kernels {
                tracing::warn!(dir = %dir.display(), "cuda kernel folder ignored: this build has no dev-hooks feature");
            }
            return None;
        }
        self.cuda_kernels.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_limits_only_lower_the_adapters() {
        let none = WgpuLimits::default();
        assert_eq!(
            none.binding_and_buffer(1 << 40, 1 << 41),
            (1 << 40, 1 << 41)
        );
        let web = WgpuLimits {
            webgpu_defaults: true,
            max_binding_bytes: None,
        };
        assert_eq!(
            web.binding_and_buffer(1 << 40, 1 << 41),
            (WEBGPU_DEFAULT_BINDING, WEBGPU_DEFAULT_BUFFER)
        );
        assert_eq!(
            web.binding_and_buffer(64 << 20, 64 << 20),
            (64 << 20, 64 << 20)
        );
        let small = WgpuLimits {
            webgpu_defaults: true,
            max_binding_bytes: Some(1 << 20),
        };
        assert_eq!(
            small.binding_and_buffer(1 << 40, 1 << 41),
            (1 << 20, 1 << 20)
        );
    }

    /// The defaults are the settings the engine used before options existed; a change here
    /// changes what every plain run does.
    #[test]
    fn defaults_are_the_measured_settings() {
        let o = EngineOptions::default();
        assert_eq!(o.cpu_threads, None);
        assert_eq!(o.wgpu_backends, None);
        assert_eq!(
            o.cuda,
            CudaOptions {
                graphs: true,
                fuse: CudaFuse::All,
                fused_blocks_per_sm: 4,
                split_attention: 4,
                int8_dot: true,
                tensor_cores: true,
                serial_decode: false,
            }
        );
        assert_eq!(o.wgpu.fuse, WgpuFuse::ByAdapter);
        // GPUs fold everything; software rasterizers nothing unless told.
        assert_eq!(
            WgpuPrefill::ByAdapter.resolve(true, false),
            WgpuPrefill::Registers
        );
        assert_eq!(
            WgpuPrefill::ByAdapter.resolve(false, false),
            WgpuPrefill::Gemm
        );
        assert_eq!(
            WgpuPrefill::ByAdapter.resolve(false, true),
            WgpuPrefill::Coop
        );
        assert_eq!(WgpuPrefill::Tiles.resolve(false, true), WgpuPrefill::Tiles);
        assert!(WgpuPrefill::Coop64K64.coop() && !WgpuPrefill::Gemm.coop());
        let tiles = WgpuPromptAttention::Tiles;
        assert_eq!(WgpuPromptAttention::ByAdapter.resolve(false, 49152), tiles);
        assert_eq!(
            WgpuPromptAttention::ByAdapter.resolve(true, 49152),
            WgpuPromptAttention::Single
        );
        assert_eq!(tiles.resolve(true, 32768), tiles);
        // WebGPU's default 16 KiB cannot hold the tiles, forced or not.
        assert_eq!(tiles.resolve(false, 16384), WgpuPromptAttention::Single);
        assert_eq!(WgpuFuse::ByAdapter.resolve(false), (true, true));
        assert_eq!(WgpuFuse::ByAdapter.resolve(true), (false, false));
        assert_eq!(WgpuFuse::NoNorms.resolve(true), (true, false));
        assert!(!o.vulkan.push_constants);
        assert_eq!(o.wgpu.limits, WgpuLimits::default());
        assert_eq!(
            WgpuAttention::ByAdapter.resolve(false),
            WgpuAttention::ByAdapter
        );
        assert_eq!(
            WgpuAttention::ByAdapter.resolve(true),
            WgpuAttention::Single
        );
        assert_eq!(WgpuAttention::Split.resolve(true), WgpuAttention::Split);
        assert_eq!(o.dev.cuda_kernels, None);
        // The wide walk on GPUs, the streaming kernels on software rasterizers.
        assert_eq!(WgpuMatvec::ByAdapter.resolve(false), WgpuMatvec::Wide);
        assert_eq!(WgpuMatvec::ByAdapter.resolve(true), WgpuMatvec::Subgroup);
        assert_eq!(WgpuMatvec::Rows.resolve(false), WgpuMatvec::Rows);
    }

    /// `--wgpu-matvec-shape`: keys left out keep the default's values; bad keys, values and
    /// shapes the walk does not take are refused with the reason.
    #[test]
    fn matvec_shapes_parse_and_refuse() {
        let d = WgpuMatvecShape::default();
        assert_eq!("".parse::<WgpuMatvecShape>(), Ok(d));
        let s: WgpuMatvecShape = "rows:4, wg=64,dot:0".parse().expect("shape");
        assert_eq!((s.rows, s.wg, s.unroll, s.dot), (4, 64, d.unroll, false));
        let s: WgpuMatvecShape = "unroll:8,dot:on".parse().expect("shape");
        assert_eq!((s.rows, s.wg, s.unroll, s.dot), (d.rows, d.wg, 8, true));
        for bad in [
            "rows:6", "rows:0", "rows:20", "wg:48", "wg:2048", "unroll:0", "unroll:9", "dot:2",
            "rows", "rows:x", "speed:1", "rows:-4",
        ] {
            let e = bad.parse::<WgpuMatvecShape>().expect_err(bad);
            assert!(!e.is_empty(), "{bad}");
        }
    }

    #[test]
    fn dev_hooks_are_ignored_without_the_feature() {
        let hooks = DevHooks {
            cuda_kernels: Some("/tmp/kernels".into()),
        };
        assert_eq!(hooks.cuda_kernels().is_some(), DevHooks::COMPILED);
    }
}

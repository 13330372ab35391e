//! The engine's backend settings as flags, each also read from the environment variable it
//! has always had (the engine itself reads none): `EngineOptions` for discovery.

use cairn_engine::options::{
    CudaFuse, CudaOptions, DevHooks, EngineOptions, VulkanOptions, VulkanZeroInit, WgpuAttention,
    WgpuAttentionKernel, WgpuFuse, WgpuLimits, WgpuMatvec, WgpuMatvecShape, WgpuOptions,
    WgpuPrefill, WgpuPromptAttention,
};
use clap::builder::BoolishValueParser;

#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Backend settings (for measuring; defaults are the best known)")]
pub struct EngineArgs {
    /// Threads of the cpu backend (default: one per core).
    #[arg(long, env = "CAIRN_CPU_THREADS")]
    pub cpu_threads: Option<usize>,
    /// wgpu and vulkan: which ops are folded into the matrix-vector products beside them
    /// (residual adds, silu, rope, KV-cache copies; with `all` the RMS norms too; `auto`:
    /// all on GPUs, off on software rasterizers).
    #[arg(long, env = "CAIRN_WGPU_FUSE", value_enum, default_value_t = WgpuFuseArg::Auto)]
    pub wgpu_fuse: WgpuFuseArg,
    /// wgpu and vulkan: the matrix-vector kernels (`rows`: 32 invocations a row, a decode
    /// batch a pass per sequence; `stream`: 4 rows a workgroup, activations loaded once for
    /// them, decode batches of up to 8 in one pass; `subgroup`: `stream` with subgroup
    /// reductions where the GPU has them; `int8`: `subgroup` with Q8_0, Q4_0 and Q4_1 products
    /// on activations rounded to int8 and packed 8-bit dot products; `repacked`: `subgroup`
    /// over weights repacked at upload; `wide`: `subgroup` with one-token products on the
    /// walk of `--wgpu-matvec-shape`; `auto`: subgroup).
    #[arg(long, env = "CAIRN_WGPU_MATVEC", value_enum, default_value_t = WgpuMatvecArg::Auto)]
    pub wgpu_matvec: WgpuMatvecArg,
    /// wgpu and vulkan: the shape of `--wgpu-matvec wide`'s walk (also `auto`'s on GPUs), as
    /// `rows:8,wg:256,unroll:4,dot:1`: rows 4 to 16 in fours; wg 32 to 1024 in powers of two
    /// (past 256 where the GPU takes it); unroll 1 to 8 chunks in flight; dot: int8
    /// activations and packed dot products for Q8_0, Q4_0 and Q4_1. Keys left out keep these
    /// defaults.
    #[arg(long, env = "CAIRN_WGPU_MATVEC_SHAPE", default_value = "", value_parser = parse_shape)]
    pub wgpu_matvec_shape: WgpuMatvecShape,
    /// wgpu and vulkan: the kernel of prompt-sized products: `registers` (4 x 4 register
    /// blocks, no workgroup memory), `tiles` (64 x 64 tiles in workgroup memory, session 15's),
    /// `gemm` (workgroup-memory tiles of 128, 64 or 32 rows and tokens by the product's shape),
    /// `gemm128`, `gemm64`, `gemm32` (that tile always), `coop` (vulkan: f16 tiles on
    /// cooperative matrices where the driver has them, else `gemm`; `coop64`, `coop128`,
    /// `coop64x128`, `coop64k64` force the tile), `auto` (`coop` on the vulkan backend's GPUs
    /// that have it, `gemm` on other GPUs, `registers` on software rasterizers).
    #[arg(long, env = "CAIRN_WGPU_PREFILL", value_enum, default_value_t = WgpuPrefillArg::Auto)]
    pub wgpu_prefill: WgpuPrefillArg,
    /// wgpu and vulkan: open devices with the adapter's own limits, or with WebGPU's
    /// defaults (`default`: 128 MiB per storage binding, 16 KiB of workgroup memory, 256
    /// invocations, no shader-f16 or subgroups), the floor of every browser and phone.
    /// Tensors larger than a binding are cut by rows into several buffers.
    #[arg(long, env = "CAIRN_WGPU_LIMITS", value_enum, default_value_t = WgpuLimitsArg::Adapter)]
    pub wgpu_limits: WgpuLimitsArg,
    /// wgpu and vulkan: cap storage bindings (and buffers) at this many bytes, below the
    /// device's own limit: makes small models split their tensors, for tests.
    #[arg(long, env = "CAIRN_WGPU_MAX_BINDING")]
    pub wgpu_max_binding: Option<u64>,
    /// wgpu and vulkan: decode attention (`split`: keys cut across workgroups and merged,
    /// flash-decoding; `single`: one workgroup per head; `auto`: split on GPUs, single on
    /// software rasterizers).
    #[arg(long, env = "CAIRN_WGPU_ATTENTION", value_enum, default_value_t = WgpuAttentionArg::Auto)]
    pub wgpu_attention: WgpuAttentionArg,
    /// wgpu and vulkan: the split decode attention's first pass (`heads`: a workgroup per
    /// query head; `grouped`, the default: a workgroup per key/value head for the query heads
    /// sharing it).
    #[arg(long, env = "CAIRN_WGPU_ATTENTION_KERNEL", value_enum, default_value_t = WgpuAttentionKernelArg::Grouped)]
    pub wgpu_attention_kernel: WgpuAttentionKernelArg,
    /// wgpu and vulkan: the fewest keys a piece of the grouped attention kernel gets
    /// (default 32).
    #[arg(long, env = "CAIRN_WGPU_ATTENTION_PIECE", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub wgpu_attention_piece: Option<u32>,
    /// wgpu and vulkan: prompt attention (`tiles`: 16 query tokens of a head a workgroup, each
    /// tile of keys and values loaded once for them, heads up to 128 wide, where the device
    /// has 32 KiB of workgroup memory; `single`: one workgroup per head and token; `auto`:
    /// tiles on GPUs, single on software rasterizers).
    #[arg(long, env = "CAIRN_WGPU_PROMPT_ATTENTION", value_enum, default_value_t = WgpuPromptAttentionArg::Auto)]
    pub wgpu_prompt_attention: WgpuPromptAttentionArg,
    /// wgpu and vulkan: queue each decode step before reading the previous step's token
    /// (false: wait for every token before encoding the next step).
    #[arg(long, env = "CAIRN_WGPU_PIPELINE", default_value_t = true, action = clap::ArgAction::Set, value_parser = BoolishValueParser::new())]
    pub wgpu_pipeline: bool,
    /// wgpu: compile the kernels with wgpu's runtime checks (indices clamped, loops bounded,
    /// divisions guarded; false, the default: shapes are checked before every op, as on the
    /// vulkan backend).
    #[arg(long, env = "CAIRN_WGPU_SHADER_CHECKS", default_value_t = false, action = clap::ArgAction::Set, value_parser = BoolishValueParser::new())]
    pub wgpu_shader_checks: bool,
    /// cuda: queue each decode step before reading the previous step's token (false: wait
    /// for every token before planning the next step).
    #[arg(long, env = "CAIRN_CUDA_PIPELINE", default_value_t = true, action = clap::ArgAction::Set, value_parser = BoolishValueParser::new())]
    pub cuda_pipeline: bool,
    /// cuda: replay repeated runs (decode steps) as CUDA graphs.
    #[arg(long, env = "CAIRN_CUDA_GRAPHS", default_value_t = true, action = clap::ArgAction::Set, value_parser = BoolishValueParser::new())]
    pub cuda_graphs: bool,
    /// cuda: which decode ops are fused into fewer launches.
    #[arg(long, env = "CAIRN_CUDA_FUSE", value_enum, default_value_t = FuseArg::All)]
    pub cuda_fuse: FuseArg,
    /// cuda: cap of the fused matrix-vector grid in blocks per multiprocessor (0: a block per
    /// row group).
    #[arg(long, env = "CAIRN_CUDA_FUSED_BLOCKS_PER_SM", default_value_t = CudaOptions::default().fused_blocks_per_sm)]
    pub cuda_fused_blocks_per_sm: u32,
    /// cuda: split decode attention into about this many blocks per multiprocessor (0: a
    /// block per head and token).
    #[arg(long, env = "CAIRN_CUDA_SPLIT_ATTENTION", default_value_t = CudaOptions::default().split_attention)]
    pub cuda_split_attention: u32,
    /// cuda: int8 activations and dp4a in the 4-bit matrix-vector kernels (false: f32).
    #[arg(long, env = "CAIRN_CUDA_INT8_DOT", default_value_t = true, action = clap::ArgAction::Set, value_parser = BoolishValueParser::new())]
    pub cuda_int8_dot: bool,
    /// cuda: prefill's matrix products on f16 tensor cores where the GPU has them (false: f32).
    #[arg(long, env = "CAIRN_CUDA_TENSOR_CORES", default_value_t = true, action = clap::ArgAction::Set, value_parser = BoolishValueParser::new())]
    pub cuda_tensor_cores: bool,
    /// vulkan: kernel parameters as push constants (known to give wrong results).
    #[arg(long, env = "CAIRN_VULKAN_PUSH_CONSTANTS", default_value_t = false, action = clap::ArgAction::Set, value_parser = BoolishValueParser::new())]
    pub vulkan_push_constants: bool,
    /// vulkan: how the kernels' workgroup memory is zeroed (`polyfill`: by invocation 0 of
    /// each workgroup; `native`: by the driver, as wgpu's pipelines do, where it can, else the
    /// polyfill; `off`).
    #[arg(long, env = "CAIRN_VULKAN_ZERO_INIT", value_enum, default_value_t = VulkanZeroInitArg::Native)]
    pub vulkan_zero_init: VulkanZeroInitArg,
    /// vulkan: kernel parameters at a fixed offset in each dispatch's bind group, as wgpu
    /// binds them (false: a dynamic offset, one bind group per set of buffers).
    #[arg(long, env = "CAIRN_VULKAN_FIXED_PARAMS", default_value_t = false, action = clap::ArgAction::Set, value_parser = BoolishValueParser::new())]
    pub vulkan_fixed_params: bool,
    /// cuda (development builds): a folder whose kernel files replace the built-in ones.
    #[cfg(feature = "dev-hooks")]
    #[arg(long, env = "CAIRN_CUDA_KERNELS")]
    pub cuda_kernels: Option<std::path::PathBuf>,
}

/// `--wgpu-matvec-shape`: `key:value` pairs, the defaults for keys left out.
fn parse_shape(s: &str) -> Result<WgpuMatvecShape, String> {
    s.parse()
}

/// `WgpuFuse` for the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgpuFuseArg {
    #[value(alias = "0")]
    Off,
    /// Everything but the RMS norms.
    Nonorm,
    #[value(alias = "1")]
    All,
    Auto,
}

/// `WgpuMatvec` for the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgpuMatvecArg {
    Rows,
    Stream,
    Subgroup,
    Int8,
    Repacked,
    Wide,
    Auto,
}

/// `WgpuPrefill` for the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgpuPrefillArg {
    Registers,
    Tiles,
    Gemm,
    Gemm128,
    Gemm64,
    Gemm32,
    Coop,
    Coop64,
    Coop128,
    Coop64x128,
    Coop64k64,
    Auto,
}

/// `WgpuLimits::webgpu_defaults` for the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgpuLimitsArg {
    Adapter,
    Default,
}

/// `WgpuAttention` for the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgpuAttentionArg {
    Split,
    Single,
    Auto,
}

/// `WgpuAttentionKernel` for the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgpuAttentionKernelArg {
    Heads,
    Grouped,
}

/// `VulkanZeroInit` for the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum VulkanZeroInitArg {
    Polyfill,
    Native,
    Off,
}

/// `WgpuPromptAttention` for the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgpuPromptAttentionArg {
    Tiles,
    Single,
    Auto,
}

/// `CudaFuse` for the command line; `0` and `1`, the variable's old values, still work.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FuseArg {
    #[value(alias = "0")]
    Off,
    /// Everything but the RMS norms.
    Nonorm,
    #[value(alias = "1")]
    All,
}

impl EngineArgs {
    pub fn options(&self) -> EngineOptions {
        EngineOptions {
            cpu_threads: self.cpu_threads,
            // The int8 products are the cpu backend's measured best; the f32 path is for tests.
            cpu_f32_linear: false,
            // wgpu reads its own variables (WGPU_BACKEND).
            wgpu_backends: None,
            wgpu: WgpuOptions {
                fuse: match self.wgpu_fuse {
                    WgpuFuseArg::Off => WgpuFuse::Off,
                    WgpuFuseArg::Nonorm => WgpuFuse::NoNorms,
                    WgpuFuseArg::All => WgpuFuse::All,
                    WgpuFuseArg::Auto => WgpuFuse::ByAdapter,
                },
                matvec: match self.wgpu_matvec {
                    WgpuMatvecArg::Rows => WgpuMatvec::Rows,
                    WgpuMatvecArg::Stream => WgpuMatvec::Stream,
                    WgpuMatvecArg::Subgroup => WgpuMatvec::Subgroup,
                    WgpuMatvecArg::Int8 => WgpuMatvec::Int8,
                    WgpuMatvecArg::Repacked => WgpuMatvec::Repacked,
                    WgpuMatvecArg::Wide => WgpuMatvec::Wide,
                    WgpuMatvecArg::Auto => WgpuMatvec::ByAdapter,
                },
                matvec_shape: self.wgpu_matvec_shape,
                prefill: match self.wgpu_prefill {
                    WgpuPrefillArg::Registers => WgpuPrefill::Registers,
                    WgpuPrefillArg::Tiles => WgpuPrefill::Tiles,
                    WgpuPrefillArg::Gemm => WgpuPrefill::Gemm,
                    WgpuPrefillArg::Gemm128 => WgpuPrefill::Gemm128,
                    WgpuPrefillArg::Gemm64 => WgpuPrefill::Gemm64,
                    WgpuPrefillArg::Gemm32 => WgpuPrefill::Gemm32,
                    WgpuPrefillArg::Coop => WgpuPrefill::Coop,
                    WgpuPrefillArg::Coop64 => WgpuPrefill::Coop64,
                    WgpuPrefillArg::Coop128 => WgpuPrefill::Coop128,
                    WgpuPrefillArg::Coop64x128 => WgpuPrefill::Coop64x128,
                    WgpuPrefillArg::Coop64k64 => WgpuPrefill::Coop64K64,
                    WgpuPrefillArg::Auto => WgpuPrefill::ByAdapter,
                },
                limits: WgpuLimits {
                    webgpu_defaults: self.wgpu_limits == WgpuLimitsArg::Default,
                    max_binding_bytes: self.wgpu_max_binding,
                },
                attention: match self.wgpu_attention {
                    WgpuAttentionArg::Split => WgpuAttention::Split,
                    WgpuAttentionArg::Single => WgpuAttention::Single,
                    WgpuAttentionArg::Auto => WgpuAttention::ByAdapter,
                },
                attention_kernel: match self.wgpu_attention_kernel {
                    WgpuAttentionKernelArg::Heads => WgpuAttentionKernel::Heads,
                    WgpuAttentionKernelArg::Grouped => WgpuAttentionKernel::Grouped,
                },
                attention_piece: self.wgpu_attention_piece,
                prompt_attention: match self.wgpu_prompt_attention {
                    WgpuPromptAttentionArg::Tiles => WgpuPromptAttention::Tiles,
                    WgpuPromptAttentionArg::Single => WgpuPromptAttention::Single,
                    WgpuPromptAttentionArg::Auto => WgpuPromptAttention::ByAdapter,
                },
                serial_decode: !self.wgpu_pipeline,
                shader_checks: self.wgpu_shader_checks,
            },
            cuda: CudaOptions {
                graphs: self.cuda_graphs,
                fuse: match self.cuda_fuse {
                    FuseArg::Off => CudaFuse::Off,
                    FuseArg::Nonorm => CudaFuse::NoNorms,
                    FuseArg::All => CudaFuse::All,
                },
                fused_blocks_per_sm: self.cuda_fused_blocks_per_sm,
                split_attention: self.cuda_split_attention,
                int8_dot: self.cuda_int8_dot,
                tensor_cores: self.cuda_tensor_cores,
                serial_decode: !self.cuda_pipeline,
            },
            vulkan: VulkanOptions {
                push_constants: self.vulkan_push_constants,
                zero_init: match self.vulkan_zero_init {
                    VulkanZeroInitArg::Polyfill => VulkanZeroInit::Polyfill,
                    VulkanZeroInitArg::Native => VulkanZeroInit::Native,
                    VulkanZeroInitArg::Off => VulkanZeroInit::Off,
                },
                fixed_params: self.vulkan_fixed_params,
            },
            dev: self.dev_hooks(),
        }
    }

    #[cfg(feature = "dev-hooks")]
    fn dev_hooks(&self) -> DevHooks {
        DevHooks {
            cuda_kernels: self.cuda_kernels.clone(),
        }
    }

    /// Builds without `dev-hooks` take no hook from the command line.
    #[cfg(not(feature = "dev-hooks"))]
    fn dev_hooks(&self) -> DevHooks {
        DevHooks::default()
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn parse(args: &[&str]) -> EngineOptions {
        let all: Vec<&str> = std::iter::once("cairn")
            .chain(args.iter().copied())
            .collect();
        Cli::try_parse_from(all).expect("parse").engine.options()
    }

    /// Without flags the binary gives the engine its defaults (unless the test's environment
    /// sets one of the variables, which CI does not).
    #[test]
    fn no_flags_give_the_engine_defaults() {
        let vars = [
            "CAIRN_CPU_THREADS",
            "CAIRN_WGPU_FUSE",
            "CAIRN_WGPU_MATVEC",
            "CAIRN_WGPU_MATVEC_SHAPE",
            "CAIRN_WGPU_PIPELINE",
            "CAIRN_CUDA_PIPELINE",
            "CAIRN_CUDA_GRAPHS",
            "CAIRN_CUDA_FUSE",
            "CAIRN_CUDA_FUSED_BLOCKS_PER_SM",
            "CAIRN_CUDA_SPLIT_ATTENTION",
            "CAIRN_CUDA_INT8_DOT",
            "CAIRN_VULKAN_PUSH_CONSTANTS",
            "CAIRN_CUDA_KERNELS",
        ];
        if vars.iter().any(|v| std::env::var_os(v).is_some()) {
            eprintln!("a backend variable is set in this environment; skipped");
            return;
        }
        assert_eq!(parse(&[]), EngineOptions::default());
    }

    /// Each flag reaches its option, with the values the variables have always taken.
    #[test]
    fn flags_reach_the_options() {
        let o = parse(&[
            "--cpu-threads",
            "3",
            "--wgpu-fuse",
            "nonorm",
            "--wgpu-matvec",
            "stream",
            "--cuda-graphs",
            "0",
            "--cuda-fuse",
            "nonorm",
            "--cuda-fused-blocks-per-sm",
            "0",
            "--cuda-split-attention",
            "2",
            "--cuda-int8-dot",
            "0",
            "--cuda-tensor-cores",
            "0",
            "--vulkan-push-constants",
            "1",
        ]);
        assert_eq!(o.cpu_threads, Some(3));
        assert_eq!(o.wgpu.fuse, WgpuFuse::NoNorms);
        assert_eq!(parse(&["--wgpu-fuse", "0"]).wgpu.fuse, WgpuFuse::Off);
        assert_eq!(o.wgpu.matvec, WgpuMatvec::Stream);
        assert_eq!(
            parse(&["--wgpu-matvec", "rows"]).wgpu.matvec,
            WgpuMatvec::Rows
        );
        assert_eq!(
            parse(&["--wgpu-matvec", "int8"]).wgpu.matvec,
            WgpuMatvec::Int8
        );
        assert_eq!(
            parse(&["--wgpu-matvec", "repacked"]).wgpu.matvec,
            WgpuMatvec::Repacked
        );
        let wide = parse(&[
            "--wgpu-matvec",
            "wide",
            "--wgpu-matvec-shape",
            "rows:4,wg:64",
        ]);
        assert_eq!(wide.wgpu.matvec, WgpuMatvec::Wide);
        assert_eq!(
            (wide.wgpu.matvec_shape.rows, wide.wgpu.matvec_shape.wg),
            (4, 64)
        );
        let all: Vec<&str> = ["cairn", "--wgpu-matvec-shape", "rows:5"].into();
        assert!(Cli::try_parse_from(all).is_err(), "rows:5 was taken");
        assert_eq!(
            parse(&["--wgpu-prefill", "tiles"]).wgpu.prefill,
            WgpuPrefill::Tiles
        );
        assert_eq!(parse(&[]).wgpu.prefill, WgpuPrefill::ByAdapter);
        assert!(!parse(&[]).wgpu.serial_decode);
        assert!(parse(&["--wgpu-pipeline", "0"]).wgpu.serial_decode);
        assert!(!parse(&[]).cuda.serial_decode);
        assert!(parse(&["--cuda-pipeline", "false"]).cuda.serial_decode);
        let limited = parse(&["--wgpu-limits", "default", "--wgpu-max-binding", "1048576"]);
        assert!(limited.wgpu.limits.webgpu_defaults);
        assert_eq!(limited.wgpu.limits.max_binding_bytes, Some(1 << 20));
        assert_eq!(
            parse(&["--wgpu-attention", "split"]).wgpu.attention,
            WgpuAttention::Split
        );
        assert_eq!(
            parse(&["--wgpu-attention", "single"]).wgpu.attention,
            WgpuAttention::Single
        );
        assert_eq!(
            parse(&[]).wgpu.attention_kernel,
            WgpuAttentionKernel::Grouped
        );
        assert_eq!(parse(&[]).vulkan.zero_init, VulkanZeroInit::Native);
        assert_eq!(
            parse(&["--vulkan-zero-init", "native"]).vulkan.zero_init,
            VulkanZeroInit::Native
        );
        assert_eq!(
            parse(&["--vulkan-zero-init", "off"]).vulkan.zero_init,
            VulkanZeroInit::Off
        );
        assert!(!parse(&[]).vulkan.fixed_params);
        assert!(
            parse(&["--vulkan-fixed-params", "true"])
                .vulkan
                .fixed_params
        );
        assert_eq!(parse(&[]).wgpu.attention_piece, None);
        assert_eq!(
            parse(&["--wgpu-attention-piece", "16"])
                .wgpu
                .attention_piece,
            Some(16)
        );
        assert_eq!(
            parse(&["--wgpu-attention-kernel", "heads"])
                .wgpu
                .attention_kernel,
            WgpuAttentionKernel::Heads
        );
        assert_eq!(
            o.cuda,
            CudaOptions {
                graphs: false,
                fuse: CudaFuse::NoNorms,
                fused_blocks_per_sm: 0,
                split_attention: 2,
                int8_dot: false,
                tensor_cores: false,
                serial_decode: false,
            }
        );
        assert!(o.vulkan.push_constants);
        assert_eq!(parse(&["--cuda-fuse", "0"]).cuda.fuse, CudaFuse::Off);
        assert_eq!(parse(&["--cuda-fuse", "1"]).cuda.fuse, CudaFuse::All);
        assert!(Cli::try_parse_from(["cairn", "--cuda-fuse", "some"]).is_err());
    }

    /// The kernel folder is a development hook: a flag only where the build has it.
    #[test]
    fn the_kernel_folder_flag_exists_only_with_dev_hooks() {
        let parsed = Cli::try_parse_from(["cairn", "--cuda-kernels", "/tmp/k"]);
        assert_eq!(parsed.is_ok(), cfg!(feature = "dev-hooks"));
        #[cfg(feature = "dev-hooks")]
        assert_eq!(
            parse(&["--cuda-kernels", "/tmp/k"]).dev.cuda_kernels,
            Some("/tmp/k".into())
        );
    }
}

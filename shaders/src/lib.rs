//! Cairn's WGSL compute kernels, one kernel per file in this crate's folder.
//!
//! Kernels that read weights (`linear_*`, `embed`) are written against two functions,
//! `w_load1` and `w_load4`, that each weight format in `formats/` defines; [`source`] joins a
//! kernel with its format so one kernel body serves every weight format (F32, F16, the
//! 32-element blocks Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, and the K-quants Q2_K to Q6_K).

/// A compute kernel: its name and WGSL source. Every kernel's entry point is `main`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Kernel {
    pub name: &'static str,
    pub wgsl: &'static str,
    /// Whether the kernel needs a weight format prepended.
    pub formatted: bool,
    /// Prepended before the body: what a family of kernels built from one file shares or
    /// sets apart (constants, the streaming walk, the reduction).
    pub prelude: &'static str,
    /// Whether the format's chunk loader (`chunks/`) is prepended too.
    pub chunked: bool,
    /// Whether the kernel uses subgroup operations (the device needs wgpu's SUBGROUP feature).
    pub subgroups: bool,
    /// Whether the kernel multiplies packed 8-bit integers: the format's integer chunk loader
    /// (`chunks_i8/`) is prepended too, and only formats with one are taken ([`INT8_FORMATS`]).
    pub int8: bool,
    /// Whether the kernel reads weights repacked at upload as vec4 words: its `w` becomes an
    /// `array<vec4<u32>>`, the format's block loader (`chunks_v4/`) is prepended instead of
    /// the format, and only the repacked formats are taken ([`REPACKED_FORMATS`]).
    pub vec4: bool,
    /// Whether the kernel runs over the wide walk, generated for a [`WideShape`] at pipeline
    /// creation ([`source_shaped`]; [`source`] gives [`WideShape::default`]'s).
    pub wide: bool,
    /// Whether the kernel is the prompt product through workgroup-memory tiles, generated for
    /// this shape ([`gemm_body`]; `wgsl` is empty).
    pub gemm: Option<GemmShape>,
    /// Whether the kernel is the prompt product on cooperative matrices with f16 inputs,
    /// generated for this shape ([`gemm_coop_body`]; `wgsl` is empty): its source starts with
    /// `enable f16; enable wgpu_cooperative_matrix;`, and only devices opened with both take it
    /// (the vulkan backend's, with `WgpuPrefill::Coop`).
    pub coop: Option<CoopShape>,
}

macro_rules! kernels {
    (streaming [$($sident:ident,)*] $($ident:ident = $file:literal, $formatted:expr;)*) => {
        $(pub const $ident: Kernel = Kernel {
            name: $file,
            wgsl: include_str!(concat!("../", $file, ".wgsl")),
            formatted: $formatted,
            prelude: "",
            chunked: false,
            subgroups: false,
            int8: false,
            vec4: false,
            wide: false,
            gemm: None,
            coop: None,
        };)*
        /// Every kernel, for validation and listing.
        pub const ALL: &[Kernel] = &[$($ident,)* $($sident,)*];
    };
}

/// A streaming matrix-vector kernel (`stream_walk.wgsl`, or `stream_walk_i8.wgsl` for the
/// packed-integer ones): `file`'s body over the walk for `tokens` tokens, reducing with
/// subgroups or through workgroup memory.
macro_rules! streaming {
    ($ident:ident = $name:literal from $file:literal, tokens $tokens:literal, $reduce:literal, $subgroups:expr) => {
        streaming!($ident = $name from $file over "stream_walk", tokens $tokens, $reduce, $subgroups, false, false);
    };
    ($ident:ident = $name:literal from $file:literal over $walk:literal, tokens $tokens:literal, $reduce:literal, $subgroups:expr, $int8:expr) => {
        streaming!($ident = $name from $file over $walk, tokens $tokens, $reduce, $subgroups, $int8, false);
    };
    ($ident:ident = $name:literal from $file:literal over $walk:literal, tokens $tokens:literal, $reduce:literal, $subgroups:expr, $int8:expr, $vec4:expr) => {
        pub const $ident: Kernel = Kernel {
            name: $name,
            wgsl: include_str!(concat!("../", $file, ".wgsl")),
            formatted: true,
            prelude: concat!(
                "const TOKENS: u32 = ",
                $tokens,
                "u;\n",
                include_str!(concat!("../", $walk, ".wgsl")),
                "\n",
                include_str!(concat!("../reduce/", $reduce, ".wgsl")),
            ),
            chunked: true,
            subgroups: $subgroups,
            int8: $int8,
            vec4: $vec4,
            wide: false,
            gemm: None,
            coop: None,
        };
    };
}

/// A one-token matrix-vector kernel over the wide walk ([`wide_walk`], generated per shape);
/// the format's packed-integer loader with `int8`. Subgroup reductions only.
macro_rules! wide {
    ($ident:ident = $name:literal from $file:literal, $int8:expr) => {
        pub const $ident: Kernel = Kernel {
            name: $name,
            wgsl: include_str!(concat!("../", $file, ".wgsl")),
            formatted: true,
            prelude: "",
            chunked: true,
            subgroups: true,
            int8: $int8,
            vec4: false,
            wide: true,
            gemm: None,
            coop: None,
        };
    };
}

streaming!(LINEAR_MATVEC_STREAM = "linear_matvec_stream" from "linear_matvec_stream", tokens 1, "workgroup", false);
streaming!(LINEAR_MATVEC_STREAM_SUBGROUP = "linear_matvec_stream_subgroup" from "linear_matvec_stream", tokens 1, "subgroup", true);
streaming!(LINEAR_MATVEC_BATCH = "linear_matvec_batch" from "linear_matvec_stream", tokens 4, "workgroup", false);
streaming!(LINEAR_MATVEC_BATCH_SUBGROUP = "linear_matvec_batch_subgroup" from "linear_matvec_stream", tokens 4, "subgroup", true);
streaming!(LINEAR_MATVEC_FUSED_STREAM = "linear_matvec_fused_stream" from "linear_matvec_fused_stream", tokens 1, "workgroup", false);
streaming!(LINEAR_MATVEC_FUSED_STREAM_SUBGROUP = "linear_matvec_fused_stream_subgroup" from "linear_matvec_fused_stream", tokens 1, "subgroup", true);
streaming!(LINEAR_MATVEC_STREAM_I8 = "linear_matvec_stream_i8" from "linear_matvec_stream_i8" over "stream_walk_i8", tokens 1, "workgroup", false, true);
streaming!(LINEAR_MATVEC_STREAM_I8_SUBGROUP = "linear_matvec_stream_i8_subgroup" from "linear_matvec_stream_i8" over "stream_walk_i8", tokens 1, "subgroup", true, true);
streaming!(LINEAR_MATVEC_BATCH_I8 = "linear_matvec_batch_i8" from "linear_matvec_stream_i8" over "stream_walk_i8", tokens 4, "workgroup", false, true);
streaming!(LINEAR_MATVEC_BATCH_I8_SUBGROUP = "linear_matvec_batch_i8_subgroup" from "linear_matvec_stream_i8" over "stream_walk_i8", tokens 4, "subgroup", true, true);
// The same kernels over weights repacked at upload (`vec4`), one block of 32 a step.
streaming!(LINEAR_MATVEC_STREAM_V4 = "linear_matvec_stream_v4" from "linear_matvec_stream" over "stream_walk_v4", tokens 1, "workgroup", false, false, true);
streaming!(LINEAR_MATVEC_STREAM_V4_SUBGROUP = "linear_matvec_stream_v4_subgroup" from "linear_matvec_stream" over "stream_walk_v4", tokens 1, "subgroup", true, false, true);
streaming!(LINEAR_MATVEC_BATCH_V4 = "linear_matvec_batch_v4" from "linear_matvec_stream" over "stream_walk_v4", tokens 4, "workgroup", false, false, true);
streaming!(LINEAR_MATVEC_BATCH_V4_SUBGROUP = "linear_matvec_batch_v4_subgroup" from "linear_matvec_stream" over "stream_walk_v4", tokens 4, "subgroup", true, false, true);
streaming!(LINEAR_MATVEC_FUSED_STREAM_V4 = "linear_matvec_fused_stream_v4" from "linear_matvec_fused_stream" over "stream_walk_v4", tokens 1, "workgroup", false, false, true);
streaming!(LINEAR_MATVEC_FUSED_STREAM_V4_SUBGROUP = "linear_matvec_fused_stream_v4_subgroup" from "linear_matvec_fused_stream" over "stream_walk_v4", tokens 1, "subgroup", true, false, true);

// The wide walk: several rows a workgroup with each chunk's activations loaded once for all
// of them, several chunks in flight per invocation; on f32 activations (all formats) or, for
// the `_I8` kernels, on activations rounded to int8 per chunk inside the walk and packed 8-bit
// dot products.
wide!(LINEAR_MATVEC_WIDE = "linear_matvec_wide" from "linear_matvec_wide", false);
wide!(LINEAR_MATVEC_WIDE_I8 = "linear_matvec_wide_i8" from "linear_matvec_wide", true);
wide!(LINEAR_MATVEC_FUSED_WIDE = "linear_matvec_fused_wide" from "linear_matvec_fused_wide", false);
wide!(LINEAR_MATVEC_FUSED_WIDE_I8 = "linear_matvec_fused_wide_i8" from "linear_matvec_fused_wide", true);

// Prompt-sized products (more tokens than the batch kernels take) as a real matrix product:
// tiles of rows by tokens, dequantized weights and activations staged in workgroup memory per
// step of columns, a register block of sums per invocation ([`gemm_body`]). Three tile sizes,
// all within WebGPU's 16 KiB of workgroup memory and 256 invocations.
pub const LINEAR_GEMM_128: Kernel = gemm_kernel("linear_gemm_128", GemmShape::LARGE);
pub const LINEAR_GEMM_64: Kernel = gemm_kernel("linear_gemm_64", GemmShape::MEDIUM);
pub const LINEAR_GEMM_32: Kernel = gemm_kernel("linear_gemm_32", GemmShape::SMALL);

const fn gemm_kernel(name: &'static str, shape: GemmShape) -> Kernel {
    Kernel {
        name,
        wgsl: "",
        formatted: true,
        prelude: "",
        chunked: false,
        subgroups: false,
        int8: false,
        vec4: false,
        wide: false,
        gemm: Some(shape),
        coop: None,
    }
}

/// The prompt product on cooperative matrices ([`gemm_coop_body`]): 64 x 64 tiles from four
/// subgroups, f16 tiles in workgroup memory, 16 x 16 x 16 products with f32 sums.
pub const LINEAR_GEMM_COOP: Kernel = coop_kernel("linear_gemm_coop", CoopShape::MEDIUM);
/// The same with 128 x 128 tiles from eight subgroups.
pub const LINEAR_GEMM_COOP_128: Kernel = coop_kernel("linear_gemm_coop_128", CoopShape::LARGE);
/// 64 rows by 128 tokens from four subgroups of 2 x 4 blocks.
pub const LINEAR_GEMM_COOP_64X128: Kernel = coop_kernel("linear_gemm_coop_64x128", CoopShape::WIDE);
/// 64 x 64 with 64 columns a step.
pub const LINEAR_GEMM_COOP_64K64: Kernel = coop_kernel("linear_gemm_coop_64k64", CoopShape::DEEP);

const fn coop_kernel(name: &'static str, shape: CoopShape) -> Kernel {
    Kernel {
        name,
        wgsl: "",
        formatted: true,
        prelude: "",
        chunked: false,
        subgroups: false,
        int8: false,
        vec4: false,
        wide: false,
        gemm: None,
        coop: Some(shape),
    }
}

/// Decode attention's first pass per query head (`attention_split.wgsl`, and
/// `paged_attention_split.wgsl` over a block table), over the chunk loop they share,
/// `attention_split_walk.wgsl`, prepended as their prelude.
pub const ATTENTION_SPLIT: Kernel = attention_walk(
    "attention_split",
    include_str!("../attention_split.wgsl"),
    include_str!("../attention_split_walk.wgsl"),
);
pub const PAGED_ATTENTION_SPLIT: Kernel = attention_walk(
    "paged_attention_split",
    include_str!("../paged_attention_split.wgsl"),
    include_str!("../attention_split_walk.wgsl"),
);

/// Decode attention's first pass grouped by key/value head (`attention_grouped.wgsl`, and
/// `paged_attention_grouped.wgsl` over a block table): the two kernels declare their
/// bindings, find their keys and call the chunk loop they share,
/// `attention_grouped_walk.wgsl`, prepended as their prelude.
pub const ATTENTION_GROUPED: Kernel = attention_walk(
    "attention_grouped",
    include_str!("../attention_grouped.wgsl"),
    include_str!("../attention_grouped_walk.wgsl"),
);
pub const PAGED_ATTENTION_GROUPED: Kernel = attention_walk(
    "paged_attention_grouped",
    include_str!("../paged_attention_grouped.wgsl"),
    include_str!("../attention_grouped_walk.wgsl"),
);

/// An attention kernel: its own file (bindings, which keys, `main`) after the chunk loop it
/// shares with its twin over the other cache layout.
const fn attention_walk(name: &'static str, wgsl: &'static str, walk: &'static str) -> Kernel {
    Kernel {
        name,
        wgsl,
        formatted: false,
        prelude: walk,
        chunked: false,
        subgroups: false,
        int8: false,
        vec4: false,
        wide: false,
        gemm: None,
        coop: None,
    }
}

/// What a cooperative-matrix kernel's source starts with (directives come before anything).
const COOP_ENABLES: &str = "enable f16;\nenable wgpu_cooperative_matrix;\n";

/// Tokens the batch kernels take per pass (`LINEAR_MATVEC_BATCH*`'s TOKENS); more run as
/// token groups along the grid's z.
pub const BATCH_TOKENS: u32 = 4;

kernels! {
    streaming [
    LINEAR_MATVEC_STREAM,
    LINEAR_MATVEC_STREAM_SUBGROUP,
    LINEAR_MATVEC_BATCH,
    LINEAR_MATVEC_BATCH_SUBGROUP,
    LINEAR_MATVEC_FUSED_STREAM,
    LINEAR_MATVEC_FUSED_STREAM_SUBGROUP,
    LINEAR_MATVEC_STREAM_I8,
    LINEAR_MATVEC_STREAM_I8_SUBGROUP,
    LINEAR_MATVEC_BATCH_I8,
    LINEAR_MATVEC_BATCH_I8_SUBGROUP,
    LINEAR_MATVEC_STREAM_V4,
    LINEAR_MATVEC_STREAM_V4_SUBGROUP,
    LINEAR_MATVEC_BATCH_V4,
    LINEAR_MATVEC_BATCH_V4_SUBGROUP,
    LINEAR_MATVEC_FUSED_STREAM_V4,
    LINEAR_MATVEC_FUSED_STREAM_V4_SUBGROUP,
    LINEAR_MATVEC_WIDE,
    LINEAR_MATVEC_WIDE_I8,
    LINEAR_MATVEC_FUSED_WIDE,
    LINEAR_MATVEC_FUSED_WIDE_I8,
    LINEAR_GEMM_128,
    LINEAR_GEMM_64,
    LINEAR_GEMM_32,
    LINEAR_GEMM_COOP,
    LINEAR_GEMM_COOP_128,
    LINEAR_GEMM_COOP_64X128,
    LINEAR_GEMM_COOP_64K64,
    ATTENTION_SPLIT,
    PAGED_ATTENTION_SPLIT,
    ATTENTION_GROUPED,
    PAGED_ATTENTION_GROUPED,
    ATTENTION_TILED,
    PAGED_ATTENTION_TILED,
    ]
    MATMUL = "matmul", false;
    LINEAR_MATVEC = "linear_matvec", true;
    LINEAR_MATMAT = "linear_matmat", true;
    LINEAR_MATMAT_TILED = "linear_matmat_tiled", true;
    LINEAR_MATVEC_SUBGROUP = "linear_matvec_subgroup", true;
    LINEAR_MATVEC_FUSED = "linear_matvec_fused", true;
    RMSNORM = "rmsnorm", false;
    ROPE = "rope", false;
    ROPE_TABLES = "rope_tables", false;
    SOFTMAX = "softmax", false;
    SILU_MUL = "silu_mul", false;
    GELU_MUL = "gelu_mul", false;
    SCALE_CAP = "scale_cap", false;
    ADD = "add", false;
    ADD_INPLACE = "add_inplace", false;
    ADD_BIAS = "add_bias", false;
    EMBED = "embed", true;
    EMBED_ROWS = "embed_rows", true;
    ATTENTION = "attention", false;
    ATTENTION_MERGE = "attention_merge", false;
    PAGED_ATTENTION = "paged_attention", false;
    PAGED_ATTENTION_MERGE = "paged_attention_merge", false;
    KV_STORE = "kv_store", false;
    QUANTIZE_Q8 = "quantize_q8", false;
    ARGMAX = "argmax", false;
    SAMPLE = "sample", false;
}

/// Prompt attention through workgroup-memory tiles (`attention_tiled.wgsl`, and
/// `paged_attention_tiled.wgsl` over a block table), over the tile loop they share,
/// `attention_tile.wgsl`.
pub const ATTENTION_TILED: Kernel = attention_walk(
    "attention_tiled",
    include_str!("../attention_tiled.wgsl"),
    include_str!("../attention_tile.wgsl"),
);
pub const PAGED_ATTENTION_TILED: Kernel = attention_walk(
    "paged_attention_tiled",
    include_str!("../paged_attention_tiled.wgsl"),
    include_str!("../attention_tile.wgsl"),
);

/// Weight formats, by GGML type name.
pub const FORMATS: &[(&str, &str)] = &[
    ("F32", include_str!("../formats/f32.wgsl")),
    ("F16", include_str!("../formats/f16.wgsl")),
    ("Q8_0", include_str!("../formats/q8_0.wgsl")),
    ("Q4_0", include_str!("../formats/q4_0.wgsl")),
    ("Q4_1", include_str!("../formats/q4_1.wgsl")),
    ("Q5_0", include_str!("../formats/q5_0.wgsl")),
    ("Q5_1", include_str!("../formats/q5_1.wgsl")),
    ("Q2_K", include_str!("../formats/q2_k.wgsl")),
    ("Q3_K", include_str!("../formats/q3_k.wgsl")),
    ("Q4_K", include_str!("../formats/q4_k.wgsl")),
    ("Q5_K", include_str!("../formats/q5_k.wgsl")),
    ("Q6_K", include_str!("../formats/q6_k.wgsl")),
    ("Q8_0R", include_str!("../formats/q8_0r.wgsl")),
    ("Q4_0R", include_str!("../formats/q4_0r.wgsl")),
    ("Q4_1R", include_str!("../formats/q4_1r.wgsl")),
];

/// Formats the `wgpu` and `vulkan` backends repack at upload with `--wgpu-matvec repacked`
/// (`backend/wgpu/repack.rs`), and the name of each one's repacked layout, which every
/// formatted kernel takes (the `vec4` kernels only these).
pub const REPACKED: &[(&str, &str)] = &[("Q8_0", "Q8_0R"), ("Q4_0", "Q4_0R"), ("Q4_1", "Q4_1R")];

/// The repacked layouts' names ([`REPACKED`]).
pub const REPACKED_FORMATS: &[&str] = &["Q8_0R", "Q4_0R", "Q4_1R"];

/// The name of `format`'s repacked layout, where it has one.
pub fn repacked(format: &str) -> Option<&'static str> {
    REPACKED.iter().find(|(n, _)| *n == format).map(|(_, r)| *r)
}

/// Block loaders of the `vec4` kernels, by repacked format.
const CHUNKS_V4: &[(&str, &str)] = &[
    ("Q8_0R", include_str!("../chunks_v4/q8_0r.wgsl")),
    ("Q4_0R", include_str!("../chunks_v4/q4_0r.wgsl")),
    ("Q4_1R", include_str!("../chunks_v4/q4_1r.wgsl")),
];
const CHUNK_V4_COMMON: &str = include_str!("../chunks_v4/common.wgsl");
/// How the kernels declare their weights; the `vec4` kernels' become vec4 words.
const W_DECL: &str = "var<storage, read> w: array<u32>;";
const W_DECL_V4: &str = "var<storage, read> w: array<vec4<u32>>;";

const COMMON: &str = include_str!("../formats/common.wgsl");

/// Chunk loaders of the streaming kernels, by format; the others use `chunks/generic.wgsl`.
const CHUNKS: &[(&str, &str)] = &[
    ("Q8_0", include_str!("../chunks/q8_0.wgsl")),
    ("Q4_0", include_str!("../chunks/q4_0.wgsl")),
    ("Q4_1", include_str!("../chunks/q4_1.wgsl")),
    ("Q4_K", include_str!("../chunks/q4_k.wgsl")),
    ("Q6_K", include_str!("../chunks/q6_k.wgsl")),
    ("Q8_0R", include_str!("../chunks/q8_0r.wgsl")),
    ("Q4_0R", include_str!("../chunks/q4_0r.wgsl")),
    ("Q4_1R", include_str!("../chunks/q4_1r.wgsl")),
];
const CHUNK_COMMON: &str = include_str!("../chunks/common.wgsl");

/// Integer chunk loaders of the packed-integer streaming kernels: the formats they take.
const CHUNKS_I8: &[(&str, &str)] = &[
    ("Q8_0", include_str!("../chunks_i8/q8_0.wgsl")),
    ("Q4_0", include_str!("../chunks_i8/q4_0.wgsl")),
    ("Q4_1", include_str!("../chunks_i8/q4_1.wgsl")),
];
const CHUNK_I8_COMMON: &str = include_str!("../chunks_i8/common.wgsl");

/// Weight formats the packed-integer kernels take (`Kernel::int8`).
pub const INT8_FORMATS: &[&str] = &["Q8_0", "Q4_0", "Q4_1"];
const CHUNK_GENERIC: &str = include_str!("../chunks/generic.wgsl");

/// Whether `format` has a chunk loader of its own (the others read chunks through w_load4).
pub fn has_own_chunks(format: &str) -> bool {
    CHUNKS.iter().any(|(n, _)| *n == format)
}

/// The weight formats `kernel` takes (`None` alone for a kernel without one).
pub fn formats(kernel: Kernel) -> Vec<Option<&'static str>> {
    if !kernel.formatted {
        vec![None]
    } else if kernel.int8 {
        INT8_FORMATS.iter().map(|f| Some(*f)).collect()
    } else if kernel.vec4 {
        REPACKED_FORMATS.iter().map(|f| Some(*f)).collect()
    } else {
        FORMATS.iter().map(|(n, _)| Some(*n)).collect()
    }
}

/// The complete WGSL for `kernel`, with the weight `format` (a GGML type name such as
/// `Q4_1`) where the kernel needs one. `None` when the format is unknown, or one the kernel
/// does not take.
pub fn source(kernel: Kernel, format: Option<&str>) -> Option<String> {
    source_shaped(kernel, format, WideShape::default())
}

/// [`source`], with the wide kernels' walk generated for `shape` (other kernels ignore it).
/// `None` also where `shape` is not one [`WideShape::check`] takes.
pub fn source_shaped(kernel: Kernel, format: Option<&str>, shape: WideShape) -> Option<String> {
    if kernel.wide {
        shape.check().ok()?;
        let walk = wide_walk(shape, kernel.int8);
        let kernel = Kernel {
            prelude: "",
            wide: false,
            ..kernel
        };
        let src = source_shaped(kernel, format, shape)?;
        // The walk needs the format's loaders, the kernel's x_at and `p` (declared in the
        // body): WGSL declarations may come in any order, so it goes last, and the reduction
        // with it.
        return Some(format!(
            "{src}\n{walk}\n{}",
            include_str!("../reduce/subgroup.wgsl")
        ));
    }
    if !kernel.formatted {
        if kernel.prelude.is_empty() {
            return Some(kernel.wgsl.to_string());
        }
        return Some(format!("{}\n{}", kernel.prelude, kernel.wgsl));
    }
    if kernel.vec4 {
        let loader = CHUNKS_V4.iter().find(|(n, _)| Some(*n) == format)?.1;
        if !kernel.wgsl.contains(W_DECL) {
            return None;
        }
        let body = kernel.wgsl.replacen(W_DECL, W_DECL_V4, 1);
        return Some(format!(
            "{CHUNK_V4_COMMON}\n{loader}\n{}\n{body}",
            kernel.prelude
        ));
    }
    let fmt = FORMATS.iter().find(|(n, _)| Some(*n) == format)?.1;
    let mut chunks = if kernel.chunked {
        let own = CHUNKS.iter().find(|(n, _)| Some(*n) == format);
        let loader = own.map_or(CHUNK_GENERIC, |(_, c)| c);
        format!("{CHUNK_COMMON}\n{loader}\n")
    } else {
        String::new()
    };
    if kernel.int8 {
        let loader = CHUNKS_I8.iter().find(|(n, _)| Some(*n) == format)?.1;
        chunks = format!("{chunks}{CHUNK_I8_COMMON}\n{loader}\n");
    }
    let body = match (kernel.gemm, kernel.coop) {
        (Some(shape), _) => std::borrow::Cow::Owned(gemm_body(shape)),
        (None, Some(shape)) => std::borrow::Cow::Owned(gemm_coop_body(shape)),
        (None, None) => std::borrow::Cow::Borrowed(kernel.wgsl),
    };
    let enables = if kernel.coop.is_some() {
        COOP_ENABLES
    } else {
        ""
    };
    Some(format!(
        "{enables}{COMMON}\n{fmt}\n{chunks}{}\n{body}",
        kernel.prelude
    ))
}

/// The shape of the wide matrix-vector walk (`LINEAR_MATVEC_WIDE*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WideShape {
    /// Rows a workgroup: 4, 8, 12 or 16 (the sums are reduced in groups of 4).
    pub rows: u32,
    /// Invocations a workgroup: 32 to 1024 in powers of two (past 256 where the device takes
    /// it).
    pub wg: u32,
    /// Chunks of 8 weights an invocation takes per loop step (1 to 8): their loads in
    /// flight together.
    pub unroll: u32,
}

impl Default for WideShape {
    /// The shape of the cuda backend's split matrix-vector kernel (engine/src/backend/cuda/
    /// kernels/linear.cu): 8 rows, 256 threads, 4 steps in flight.
    fn default() -> Self {
        WideShape {
            rows: 8,
            wg: 256,
            unroll: 4,
        }
    }
}

impl WideShape {
    /// Whether the walk can be generated for this shape, or why not.
    pub fn check(&self) -> Result<(), String> {
        if !(self.rows > 0 && self.rows <= 16 && self.rows.is_multiple_of(4)) {
            return Err(format!("rows {}: 4, 8, 12 or 16", self.rows));
        }
        // Past 256 only where the device allows it (WebGPU's default limit is 256; NVIDIA's
        // Vulkan driver takes 1024): a device that does not refuses the pipeline.
        if ![32, 64, 128, 256, 512, 1024].contains(&self.wg) {
            return Err(format!("wg {}: 32, 64, 128, 256, 512 or 1024", self.wg));
        }
        if !(1..=8).contains(&self.unroll) {
            return Err(format!("unroll {}: 1 to 8", self.unroll));
        }
        Ok(())
    }
}

/// The wide walk for `shape`: `walk_wide(r0, li)` returns the sums of rows r0 .. r0 + ROWS - 1
/// (a vec4 per 4 rows) of invocation li's chunks li, li + WG, ..., with UNROLL chunks a loop
/// step, each chunk's activations (the kernel's `x_at(vec4 index)`) loaded once for all rows.
/// With `int8` the chunk's 8 activations are rounded to int8 against their largest magnitude
/// (as the cuda backend's split kernels do) and each row's packed bytes (`w_chunk_i8`)
/// multiply them with `dot4I8Packed`; the format's offset multiplies their exact sum.
/// Written out row by row and chunk by chunk, so a driver keeps every sum in registers
/// without having to unroll loops over arrays.
pub fn wide_walk(shape: WideShape, int8: bool) -> String {
    use std::fmt::Write;
    let WideShape { rows, wg, unroll } = shape;
    let groups = rows / 4;
    let mut s = String::new();
    let _ = writeln!(s, "const ROWS: u32 = {rows}u;");
    let _ = writeln!(s, "const WG: u32 = {wg}u;");
    let _ = writeln!(s, "const RG: u32 = {groups}u;");
    if int8 {
        s.push_str(
            "struct XC { a: u32, b: u32, d: f32, s: f32, }

// Four rounded values as packed signed bytes, with bit operations: naga writes pack4xI8
// with SPIR-V's Int8 capability, which the raw vulkan backend's devices need not enable.
fn pack_i8(v: vec4<f32>) -> u32 {
    let b = (bitcast<vec4<u32>>(vec4<i32>(round(v))) & vec4<u32>(0xffu)) << vec4<u32>(0u, 8u, 16u, 24u);
    return b.x | b.y | b.z | b.w;
}

fn x_chunk(c: u32) -> XC {
    let at = chunk_at(c) / 4u;
    let xa = x_at(at.x);
    let xb = x_at(at.y);
    let m = max(abs(xa), abs(xb));
    let amax = max(max(m.x, m.y), max(m.z, m.w));
    let id = select(0.0, 127.0 / amax, amax > 0.0);
    let one = vec4<f32>(1.0);
    return XC(pack_i8(xa * id), pack_i8(xb * id), amax * (1.0 / 127.0), dot(xa, one) + dot(xb, one));
}

fn w_at(row: u32, c: u32) -> I8W {
    return w_chunk_i8(row, c);
}

fn row_dot(w: I8W, x: XC) -> f32 {
    return w.d * x.d * f32(dot4I8Packed(w.lo, x.a) + dot4I8Packed(w.hi, x.b)) + w.m * x.s;
}
",
        );
    } else {
        s.push_str(
            "struct XC { a: vec4<f32>, b: vec4<f32>, }

fn x_chunk(c: u32) -> XC {
    let at = chunk_at(c) / 4u;
    return XC(x_at(at.x), x_at(at.y));
}

fn w_at(row: u32, c: u32) -> W8 {
    return w_chunk(row, c);
}

fn row_dot(w: W8, x: XC) -> f32 {
    return dot(w.a, x.a) + dot(w.b, x.b);
}
",
        );
    }
    let _ = writeln!(
        s,
        "fn walk_wide(r0: u32, li: u32) -> array<vec4<f32>, RG> {{"
    );
    s.push_str("    let last = p.rows - 1u;\n");
    for r in 0..rows {
        let _ = writeln!(s, "    let rb{r} = min(r0 + {r}u, last) * p.row_bytes;");
    }
    for g in 0..groups {
        let _ = writeln!(s, "    var a{g} = vec4<f32>();");
    }
    s.push_str("    let chunks = p.cols / 8u;\n    var c = li;\n");
    // The unrolled steps, then the remaining chunks one at a time.
    let step = |s: &mut String, n: u32| {
        for u in 0..n {
            let _ = writeln!(s, "        let x{u} = x_chunk(c + {}u);", u * wg);
        }
        for u in 0..n {
            for r in 0..rows {
                let _ = writeln!(s, "        let w{u}_{r} = w_at(rb{r}, c + {}u);", u * wg);
            }
        }
        for g in 0..groups {
            let lanes: Vec<String> = (0..4)
                .map(|k| {
                    let r = 4 * g + k;
                    (0..n)
                        .map(|u| format!("row_dot(w{u}_{r}, x{u})"))
                        .collect::<Vec<_>>()
                        .join(" + ")
                })
                .collect();
            let _ = writeln!(s, "        a{g} += vec4<f32>({});", lanes.join(", "));
        }
    };
    if unroll > 1 {
        let _ = writeln!(
            s,
            "    for (; c + {}u < chunks; c += {}u) {{",
            (unroll - 1) * wg,
            unroll * wg
        );
        step(&mut s, unroll);
        s.push_str("    }\n");
    }
    let _ = writeln!(s, "    for (; c < chunks; c += {wg}u) {{");
    step(&mut s, 1);
    s.push_str("    }\n");
    let accs: Vec<String> = (0..groups).map(|g| format!("a{g}")).collect();
    let _ = writeln!(
        s,
        "    return array<vec4<f32>, RG>({});\n}}",
        accs.join(", ")
    );
    s
}

/// The tile of a prompt product (`LINEAR_GEMM_*`, [`gemm_body`]): a workgroup of `wx` x `wy`
/// invocations computes `wx * tm` rows by `wy * tn` tokens, `bk` columns a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemmShape {
    /// Invocations along the rows.
    pub wx: u32,
    /// Invocations along the tokens.
    pub wy: u32,
    /// Rows an invocation sums (`wx` apart).
    pub tm: u32,
    /// Tokens an invocation sums (`wy` apart).
    pub tn: u32,
    /// Columns a step: a multiple of 4 that divides 32, so a step never straddles a block of
    /// the 32-element formats. Rows of a multiple of it only.
    pub bk: u32,
}

impl GemmShape {
    /// 128 rows x 128 tokens, 8 x 8 sums an invocation, 16 columns a step (16 KiB).
    pub const LARGE: GemmShape = GemmShape {
        wx: 16,
        wy: 16,
        tm: 8,
        tn: 8,
        bk: 16,
    };
    /// 64 x 64, 4 x 4 sums an invocation, 32 columns a step (16 KiB).
    pub const MEDIUM: GemmShape = GemmShape {
        wx: 16,
        wy: 16,
        tm: 4,
        tn: 4,
        bk: 32,
    };
    /// 32 x 32 from 8 x 8 invocations, 4 x 4 sums each, 32 columns a step (8 KiB).
    pub const SMALL: GemmShape = GemmShape {
        wx: 8,
        wy: 8,
        tm: 4,
        tn: 4,
        bk: 32,
    };

    /// Rows a workgroup takes.
    pub const fn rows(&self) -> u32 {
        self.wx * self.tm
    }

    /// Tokens a workgroup takes.
    pub const fn tokens(&self) -> u32 {
        self.wy * self.tn
    }

    /// Bytes of workgroup memory: the step's weights and activations as f32.
    pub const fn workgroup_bytes(&self) -> u32 {
        (self.rows() + self.tokens()) * self.bk * 4
    }
}

/// The prompt product `y[t, r] = sum_c w[r, c] * x[t, c]` for `shape`, over the format's
/// `w_load4` (rows of a multiple of `shape.bk` elements). Per step of `bk` columns every
/// invocation dequantizes its share of the tile's weights (`rows x bk`) and copies its share
/// of the activations (`tokens x bk`) into workgroup memory, k-major in vec4s of 4 columns, so
/// each weight is dequantized once per workgroup and then serves all its tokens; then each
/// invocation sums its `tm x tn` block from workgroup memory. Its rows and tokens are `wx` and
/// `wy` apart, so neighbouring invocations read neighbouring vec4s (no bank conflicts) and
/// write neighbouring rows. Each sum takes its four products as a chain of fused
/// multiply-adds (a `dot` then an add is one instruction more). The next step's global loads are issued before this step's sums,
/// into registers, so their latency hides behind the arithmetic. Written out sum by sum, so a
/// driver keeps them in registers without unrolling loops over arrays. Rows and tokens past
/// the end re-read the last one; their sums are dropped.
pub fn gemm_body(shape: GemmShape) -> String {
    use std::fmt::Write;
    let GemmShape { wx, wy, tm, tn, bk } = shape;
    let (bm, bn, kq) = (shape.rows(), shape.tokens(), bk / 4);
    let threads = wx * wy;
    // Each invocation's share of the staged vec4s (at least one).
    let lw = (bm * kq).div_ceil(threads);
    let lx = (bn * kq).div_ceil(threads);
    let mut s = String::new();
    s.push_str(
        "struct Params {
    rows: u32,
    cols: u32,
    tokens: u32,
    row_bytes: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

",
    );
    let _ = writeln!(
        s,
        "const BM: u32 = {bm}u;\nconst BN: u32 = {bn}u;\nconst BK: u32 = {bk}u;\nconst KQ: u32 = {kq}u;\nconst NT: u32 = {threads}u;"
    );
    let _ = writeln!(s, "var<workgroup> ws: array<vec4<f32>, {}>;", bm * kq);
    let _ = writeln!(s, "var<workgroup> xs: array<vec4<f32>, {}>;", bn * kq);
    let _ = writeln!(
        s,
        "
@compute @workgroup_size({wx}, {wy})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {{
    let r0 = wid.x * BM;
    let t0 = wid.y * BN;
    let xrow = p.cols / 4u;"
    );
    // The invocation's staging slots: slot i of the tile is vec4 (i % KQ) of row (or token)
    // i / KQ, so neighbouring invocations read neighbouring memory.
    for l in 0..lw {
        let _ = writeln!(s, "    let wi{l} = li + {}u;", l * threads);
        let _ = writeln!(
            s,
            "    let wr{l} = min(r0 + min(wi{l}, BM * KQ - 1u) / KQ, p.rows - 1u) * p.row_bytes;"
        );
        let _ = writeln!(s, "    let wq{l} = wi{l} % KQ;");
        let _ = writeln!(s, "    var pw{l} = w_load4(wr{l}, wq{l} * 4u);");
    }
    for l in 0..lx {
        let _ = writeln!(s, "    let xi{l} = li + {}u;", l * threads);
        let _ = writeln!(
            s,
            "    let xr{l} = min(t0 + min(xi{l}, BN * KQ - 1u) / KQ, p.tokens - 1u) * xrow + xi{l} % KQ;"
        );
        let _ = writeln!(s, "    var px{l} = x[xr{l}];");
    }
    for i in 0..tm {
        for j in 0..tn {
            let _ = writeln!(s, "    var c{i}_{j} = 0.0;");
        }
    }
    s.push_str("    for (var k0 = 0u; k0 < p.cols; k0 += BK) {\n        workgroupBarrier();\n");
    for l in 0..lw {
        let guard = (bm * kq) % threads != 0 && l == lw - 1;
        if guard {
            let _ = writeln!(
                s,
                "        if (wi{l} < BM * KQ) {{ ws[wq{l} * BM + wi{l} / KQ] = pw{l}; }}"
            );
        } else {
            let _ = writeln!(s, "        ws[wq{l} * BM + wi{l} / KQ] = pw{l};");
        }
    }
    for l in 0..lx {
        let guard = (bn * kq) % threads != 0 && l == lx - 1;
        if guard {
            let _ = writeln!(
                s,
                "        if (xi{l} < BN * KQ) {{ xs[(xi{l} % KQ) * BN + xi{l} / KQ] = px{l}; }}"
            );
        } else {
            let _ = writeln!(s, "        xs[(xi{l} % KQ) * BN + xi{l} / KQ] = px{l};");
        }
    }
    s.push_str(
        "        workgroupBarrier();\n        let k1 = k0 + BK;\n        if (k1 < p.cols) {\n",
    );
    for l in 0..lw {
        let _ = writeln!(s, "            pw{l} = w_load4(wr{l}, k1 + wq{l} * 4u);");
    }
    for l in 0..lx {
        let _ = writeln!(s, "            px{l} = x[xr{l} + k1 / 4u];");
    }
    s.push_str("        }\n        for (var q = 0u; q < KQ; q++) {\n");
    for i in 0..tm {
        let _ = writeln!(
            s,
            "            let a{i} = ws[q * BM + lid.x + {}u];",
            i * wx
        );
    }
    for j in 0..tn {
        let _ = writeln!(
            s,
            "            let b{j} = xs[q * BN + lid.y + {}u];",
            j * wy
        );
    }
    for i in 0..tm {
        for j in 0..tn {
            let _ = writeln!(
                s,
                "            c{i}_{j} = fma(a{i}.w, b{j}.w, fma(a{i}.z, b{j}.z, fma(a{i}.y, b{j}.y, fma(a{i}.x, b{j}.x, c{i}_{j}))));"
            );
        }
    }
    s.push_str("        }\n    }\n");
    for j in 0..tn {
        let _ = writeln!(s, "    let otok{j} = t0 + lid.y + {}u;", j * wy);
    }
    for i in 0..tm {
        let _ = writeln!(s, "    let orow{i} = r0 + lid.x + {}u;", i * wx);
    }
    for j in 0..tn {
        let _ = writeln!(s, "    if (otok{j} < p.tokens) {{");
        for i in 0..tm {
            let _ = writeln!(
                s,
                "        if (orow{i} < p.rows) {{ y[otok{j} * p.rows + orow{i}] = c{i}_{j}; }}"
            );
        }
        s.push_str("    }\n");
    }
    s.push_str("}\n");
    s
}

/// The tile of a cooperative-matrix prompt product (`LINEAR_GEMM_COOP*`, [`gemm_coop_body`]):
/// `sr x st` subgroups of 32 invocations, each summing `mr x mt` blocks of 16 rows by 16
/// tokens, `bk` columns a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CoopShape {
    /// Subgroups along the rows.
    pub sr: u32,
    /// Subgroups along the tokens.
    pub st: u32,
    /// 16-row blocks a subgroup sums.
    pub mr: u32,
    /// 16-token blocks a subgroup sums.
    pub mt: u32,
    /// Columns a step: a multiple of 16; rows of a multiple of it only.
    pub bk: u32,
}

impl CoopShape {
    /// 64 x 64 from 2 x 2 subgroups of 2 x 2 blocks, 32 columns a step.
    pub const MEDIUM: CoopShape = CoopShape {
        sr: 2,
        st: 2,
        mr: 2,
        mt: 2,
        bk: 32,
    };
    /// 128 x 128 from 4 x 2 subgroups of 2 x 4 blocks, 32 columns a step.
    pub const LARGE: CoopShape = CoopShape {
        sr: 4,
        st: 2,
        mr: 2,
        mt: 4,
        bk: 32,
    };
    /// 64 rows x 128 tokens from 2 x 2 subgroups of 2 x 4 blocks, 32 columns a step.
    pub const WIDE: CoopShape = CoopShape {
        sr: 2,
        st: 2,
        mr: 2,
        mt: 4,
        bk: 32,
    };
    /// `MEDIUM` with 64 columns a step (half the barriers).
    pub const DEEP: CoopShape = CoopShape {
        sr: 2,
        st: 2,
        mr: 2,
        mt: 2,
        bk: 64,
    };

    /// Rows a workgroup takes.
    pub const fn rows(&self) -> u32 {
        self.sr * self.mr * 16
    }

    /// Tokens a workgroup takes.
    pub const fn tokens(&self) -> u32 {
        self.st * self.mt * 16
    }

    /// Invocations a workgroup (subgroups of 32 assumed).
    pub const fn invocations(&self) -> u32 {
        self.sr * self.st * 32
    }
}

/// The prompt product `y[t, r] = sum_c w[r, c] * x[t, c]` on cooperative matrices, for the raw
/// vulkan backend: per step of `bk` columns every invocation dequantizes its share of the
/// tile's weights and converts its share of the activations to f16 in workgroup memory
/// (row-major, `bk` columns a row; the next step's global loads are issued before this step's
/// products), and each subgroup multiplies its `mr x mt` blocks of 16 x 16 (16 columns at a
/// time, f32 sums). Whole tiles store their sums straight into y (column-major blocks:
/// token-major with a stride of `rows`); tiles at the edges store them block by block through
/// workgroup memory, dropping what is past the end. Assumes subgroups of 32 invocations
/// (NVIDIA's), numbered by `local_invocation_index / 32`. Rows of a multiple of `bk`.
pub fn gemm_coop_body(shape: CoopShape) -> String {
    use std::fmt::Write;
    let CoopShape { sr, st, mr, mt, bk } = shape;
    let (bm, bn, nt) = (shape.rows(), shape.tokens(), shape.invocations());
    let kq = bk / 4;
    let lw = (bm * kq).div_ceil(nt);
    let lx = (bn * kq).div_ceil(nt);
    let mut s = String::new();
    s.push_str(
        "struct Params {
    rows: u32,
    cols: u32,
    tokens: u32,
    row_bytes: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

",
    );
    let _ = writeln!(
        s,
        "const BM: u32 = {bm}u;\nconst BN: u32 = {bn}u;\nconst BK: u32 = {bk}u;\nconst KQ: u32 = {kq}u;"
    );
    let _ = writeln!(s, "var<workgroup> ws: array<f16, {}>;", bm * bk);
    let _ = writeln!(s, "var<workgroup> xs: array<f16, {}>;", bn * bk);
    // One 16 x 16 block of sums per subgroup, for the edges.
    let _ = writeln!(s, "var<workgroup> cs: array<f32, {}>;", sr * st * 256);
    let _ = writeln!(
        s,
        "
@compute @workgroup_size({nt})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {{
    let r0 = wid.x * BM;
    let t0 = wid.y * BN;
    let xrow = p.cols / 4u;
    let sg = li / 32u;
    let lane = li % 32u;
    // The subgroup's blocks: rows sr0 .., tokens st0 .. of the tile.
    let sr0 = (sg % {sr}u) * {}u;
    let st0 = (sg / {sr}u) * {}u;",
        mr * 16,
        mt * 16
    );
    for l in 0..lw {
        let _ = writeln!(s, "    let wi{l} = min(li + {}u, BM * KQ - 1u);", l * nt);
        let _ = writeln!(
            s,
            "    let wr{l} = min(r0 + wi{l} / KQ, p.rows - 1u) * p.row_bytes;"
        );
        let _ = writeln!(s, "    let wq{l} = wi{l} % KQ;");
        let _ = writeln!(s, "    var pw{l} = w_load4(wr{l}, wq{l} * 4u);");
    }
    for l in 0..lx {
        let _ = writeln!(s, "    let xi{l} = min(li + {}u, BN * KQ - 1u);", l * nt);
        let _ = writeln!(
            s,
            "    let xr{l} = min(t0 + xi{l} / KQ, p.tokens - 1u) * xrow + xi{l} % KQ;"
        );
        let _ = writeln!(s, "    var px{l} = x[xr{l}];");
    }
    for i in 0..mr {
        for j in 0..mt {
            let _ = writeln!(s, "    var c{i}_{j} = coop_mat16x16<f32, C>();");
        }
    }
    s.push_str("    for (var k0 = 0u; k0 < p.cols; k0 += BK) {\n        workgroupBarrier();\n");
    // Slot i: vec4 i % KQ of row (or token) i / KQ, at element (i / KQ) * BK + (i % KQ) * 4.
    // Slots past the tile (clamped to its last) write the same values twice.
    for l in 0..lw {
        let _ = writeln!(
            s,
            "        let wh{l} = vec4<f16>(pw{l});\n        let wa{l} = (wi{l} / KQ) * BK + wq{l} * 4u;"
        );
        for (c, f) in ["x", "y", "z", "w"].iter().enumerate() {
            let _ = writeln!(s, "        ws[wa{l} + {c}u] = wh{l}.{f};");
        }
    }
    for l in 0..lx {
        let _ = writeln!(
            s,
            "        let xh{l} = vec4<f16>(px{l});\n        let xa{l} = (xi{l} / KQ) * BK + (xi{l} % KQ) * 4u;"
        );
        for (c, f) in ["x", "y", "z", "w"].iter().enumerate() {
            let _ = writeln!(s, "        xs[xa{l} + {c}u] = xh{l}.{f};");
        }
    }
    s.push_str(
        "        workgroupBarrier();\n        let k1 = k0 + BK;\n        if (k1 < p.cols) {\n",
    );
    for l in 0..lw {
        let _ = writeln!(s, "            pw{l} = w_load4(wr{l}, k1 + wq{l} * 4u);");
    }
    for l in 0..lx {
        let _ = writeln!(s, "            px{l} = x[xr{l} + k1 / 4u];");
    }
    s.push_str("        }\n        for (var kk = 0u; kk < BK; kk += 16u) {\n");
    for i in 0..mr {
        let _ = writeln!(
            s,
            "            let a{i} = coopLoadT<coop_mat16x16<f16, A>>(&ws[(sr0 + {}u) * BK + kk], BK);",
            i * 16
        );
    }
    for j in 0..mt {
        let _ = writeln!(
            s,
            "            let b{j} = coopLoad<coop_mat16x16<f16, B>>(&xs[(st0 + {}u) * BK + kk], BK);",
            j * 16
        );
    }
    for i in 0..mr {
        for j in 0..mt {
            let _ = writeln!(
                s,
                "            c{i}_{j} = coopMultiplyAdd(a{i}, b{j}, c{i}_{j});"
            );
        }
    }
    s.push_str("        }\n    }\n");
    // Whole tiles: straight into y. The condition is the same for the whole workgroup.
    // (Offsets and stride bound to names first: naga 30's SPIR-V writer takes coopStore's
    // operands only as expressions already emitted.)
    s.push_str("    let ys = p.rows;\n    if (r0 + BM <= p.rows && t0 + BN <= p.tokens) {\n");
    for i in 0..mr {
        for j in 0..mt {
            let _ = writeln!(
                s,
                "        let yo{i}_{j} = (t0 + st0 + {}u) * ys + r0 + sr0 + {}u;\n        coopStore(c{i}_{j}, &y[yo{i}_{j}], ys);",
                j * 16,
                i * 16
            );
        }
    }
    s.push_str("        return;\n    }\n");
    for i in 0..mr {
        for j in 0..mt {
            let _ = writeln!(
                s,
                "    workgroupBarrier();
    coopStore(c{i}_{j}, &cs[sg * 256u], 16u);
    workgroupBarrier();
    for (var e = lane; e < 256u; e += 32u) {{
        let r = r0 + sr0 + {}u + e % 16u;
        let t = t0 + st0 + {}u + e / 16u;
        if (r < p.rows && t < p.tokens) {{
            y[t * p.rows + r] = cs[sg * 256u + e];
        }}
    }}",
                i * 16,
                j * 16
            );
        }
    }
    s.push_str("}\n");
    s
}

//! The transformer's operations: what each kernel computes, and its CPU twin.
//!
//! Every operation has one WGSL kernel in `shaders/` and one reference function here with the
//! same contract; the `cpu` backend runs these functions and every GPU test compares against
//! them. Shapes are in elements, buffers are little-endian and tightly packed, matrices are
//! row-major. Weight matrices keep GGUF's layout: `rows` rows of `cols` elements, each row a
//! whole number of blocks.

pub mod attention;
pub mod elementwise;
pub mod embed;
pub mod linear;
pub mod norm;
pub mod rope;
pub mod sample;
pub mod softmax;

use crate::backend::Buffer;
use crate::quant::GgmlType;

pub use sample::SampleParams;

/// One unit of work on a device. Ops run in order; each sees every earlier op's writes.
#[derive(Debug, Clone, Copy)]
pub enum Op<'a> {
    /// `c[m×n] = a[m×k] · b[k×n]`, all f32.
    MatMul {
        a: &'a Buffer,
        b: &'a Buffer,
        c: &'a Buffer,
        m: u32,
        n: u32,
        k: u32,
    },
    /// `y[t, r] = Σ_c w[r, c] · x[t, c]` for `tokens` rows of `x`: matrix-vector when
    /// `tokens == 1`, matrix-matrix otherwise. `w` is `rows × cols` of `wtype`.
    Linear {
        w: &'a Buffer,
        wtype: GgmlType,
        x: &'a Buffer,
        y: &'a Buffer,
        rows: u32,
        cols: u32,
        tokens: u32,
    },
    /// `y[t] = x[t] / sqrt(mean(x[t]²) + eps) * weight` over rows of `dim`.
    RmsNorm {
        x: &'a Buffer,
        weight: &'a Buffer,
        y: &'a Buffer,
        dim: u32,
        tokens: u32,
        eps: f32,
    },
    /// Rotary position embedding in place on `x` (`tokens × heads × head_dim`), token `t` at
    /// position `pos0 + t`. `neox` rotates pairs `(i, i + rope_dim/2)`; otherwise adjacent
    /// pairs `(2i, 2i+1)`, which is what GGUF llama models use (their Q/K weights are permuted
    /// at conversion).
    Rope {
        x: &'a Buffer,
        heads: u32,
        head_dim: u32,
        rope_dim: u32,
        tokens: u32,
        pos0: u32,
        freq_base: f32,
        neox: bool,
    },
    /// Softmax in place over each of `rows` rows of `cols`.
    Softmax { x: &'a Buffer, rows: u32, cols: u32 },
    /// `out = silu(gate) * up`, elementwise over `n`.
    SiluMul {
        gate: &'a Buffer,
        up: &'a Buffer,
        out: &'a Buffer,
        n: u32,
    },
    /// `out = a + b`, elementwise over `n`; `out` may be `a`.
    Add {
        a: &'a Buffer,
        b: &'a Buffer,
        out: &'a Buffer,
        n: u32,
    },
    /// `out[t] = dequantize(table[ids[t]])` for `tokens` u32 ids; `table` is `vocab × dim`.
    Embed {
        table: &'a Buffer,
        ttype: GgmlType,
        ids: &'a Buffer,
        out: &'a Buffer,
        dim: u32,
        vocab: u32,
        tokens: u32,
    },
    /// Causal grouped-query attention. `q`: `tokens × heads × head_dim`; caches:
    /// `capacity × kv_heads × head_dim` holding positions `0..pos0 + tokens`; query `t` (at
    /// position `pos0 + t`) attends to cache positions `0..=pos0 + t`. `out` like `q`.
    Attention {
        q: &'a Buffer,
        k_cache: &'a Buffer,
        v_cache: &'a Buffer,
        out: &'a Buffer,
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        tokens: u32,
        pos0: u32,
        scale: f32,
    },
    /// Index of the largest of `n` f32 values (the first on ties) into `out[0]` as u32.
    Argmax {
        x: &'a Buffer,
        n: u32,
        out: &'a Buffer,
    },
    /// Draws a token from `n` logits with temperature, top-k and top-p into `out[0]`.
    Sample {
        logits: &'a Buffer,
        n: u32,
        out: &'a Buffer,
        params: SampleParams,
    },
    /// Copies `bytes` bytes (a multiple of 4) between buffers, offsets multiples of 4.
    Copy {
        src: &'a Buffer,
        src_offset: u64,
        dst: &'a Buffer,
        dst_offset: u64,
        bytes: u64,
    },
}

impl Op<'_> {
    /// A short name for logs, errors and per-kernel timings.
    pub fn name(&self) -> &'static str {
        match self {
            Op::MatMul { .. } => "matmul",
            Op::Linear { tokens: 1, .. } => "matvec",
            Op::Linear { .. } => "matmat",
            Op::RmsNorm { .. } => "rmsnorm",
            Op::Rope { .. } => "rope",
            Op::Softmax { .. } => "softmax",
            Op::SiluMul { .. } => "silu_mul",
            Op::Add { .. } => "add",
            Op::Embed { .. } => "embed",
            Op::Attention { .. } => "attention",
            Op::Argmax { .. } => "argmax",
            Op::Sample { .. } => "sample",
            Op::Copy { .. } => "copy",
        }
    }
}

#[cfg(test)]
mod shader_validation {
    /// Every kernel, joined with every weight format it takes, parses and validates with naga
    /// (the shader compiler inside wgpu), independent of any adapter.
    #[test]
    fn every_shader_validates_with_naga() {
        let mut checked = 0;
        for kernel in cairn_shaders::ALL {
            let formats: Vec<Option<&str>> = if kernel.formatted {
                cairn_shaders::FORMATS
                    .iter()
                    .map(|(n, _)| Some(*n))
                    .collect()
            } else {
                vec![None]
            };
            for format in formats {
                let src = cairn_shaders::source(*kernel, format).expect("source");
                let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| {
                    panic!("{} {format:?}: {}", kernel.name, e.emit_to_string(&src))
                });
                naga::valid::Validator::new(
                    naga::valid::ValidationFlags::all(),
                    // unpack2x16float is core WGSL; naga files it under this capability.
                    // Subgroup variants are used only where the device has subgroups.
                    naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32
                        | naga::valid::Capabilities::SUBGROUP,
                )
                .validate(&module)
                .unwrap_or_else(|e| panic!("{} {format:?}: {e:?}", kernel.name));
                assert!(
                    module.entry_points.iter().any(|e| e.name == "main"),
                    "{} has no `main` entry point",
                    kernel.name
                );
                checked += 1;
            }
        }
        assert!(checked >= cairn_shaders::ALL.len());
    }

    #[test]
    fn unknown_formats_have_no_source() {
        assert!(cairn_shaders::source(cairn_shaders::LINEAR_MATVEC, Some("Q4_K")).is_none());
    }
}

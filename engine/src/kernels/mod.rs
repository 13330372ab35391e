//! The transformer's operations: what each kernel computes, and its CPU twin.
//!
//! Every operation is a struct here (its buffers and shape) implementing [`OpSpec`]: its
//! buffers with the bytes they need, its shape rules, the `#[repr(C)]` parameters its GPU
//! kernels read, and its reference function, which the `cpu` backend runs and every GPU test
//! compares against. Each backend plans an op in a small per-op impl of its own. Shapes are in elements, buffers are little-endian and tightly packed, matrices are
//! row-major. Weight matrices keep GGUF's layout: `rows` rows of `cols` elements, each row a
//! whole number of blocks.

pub mod attention;
pub mod copy;
pub mod elementwise;
pub mod embed;
pub mod linear;
pub mod matrix;
pub mod norm;
pub mod op;
pub mod paged;
pub mod rope;
pub mod sample;
pub mod softmax;

pub use attention::{Attention, AttentionParams};
pub use copy::{BufferCopy, CopyParams};
pub use elementwise::{Add, AddBias, BiasParams, GeluMul, ScaleCap, ScaleCapParams, SiluMul};
pub use embed::{Embed, EmbedParams};
pub use matrix::{Linear, LinearParams, MatMul, MatMulParams};
pub use norm::{RmsNorm, RmsNormParams};
pub(crate) use op::with_op;
pub use op::{Access, CountParams, Op, OpSpec, Use};
pub use paged::{KvStore, KvStoreParams, PagedAttention, PagedAttentionParams};
pub use rope::{ROPE_FACTORS, ROPE_POSITIONS, Rope, RopeParams};
pub use sample::{Argmax, Sample, SampleKernelParams, SampleParams};
pub use softmax::{Softmax, SoftmaxParams};

#[cfg(test)]
mod shader_validation {
    /// Every kernel, joined with every weight format it takes, parses and validates with naga
    /// (the shader compiler inside wgpu), independent of any adapter.
    #[test]
    fn every_shader_validates_with_naga() {
        let mut checked = 0;
        for kernel in cairn_shaders::ALL {
            let formats = cairn_shaders::formats(*kernel);
            for format in formats {
                let src = cairn_shaders::source(*kernel, format).expect("source");
                let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| {
                    panic!("{} {format:?}: {}", kernel.name, e.emit_to_string(&src))
                });
                naga::valid::Validator::new(
                    naga::valid::ValidationFlags::all(),
                    // unpack2x16float is core WGSL; naga files it under this capability.
                    // Subgroup variants are used only where the device has subgroups.
                    // Cooperative-matrix kernels only where the device has them (and f16).
                    naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32
                        | naga::valid::Capabilities::SUBGROUP
                        | naga::valid::Capabilities::COOPERATIVE_MATRIX
                        | naga::valid::Capabilities::SHADER_FLOAT16,
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
        assert!(cairn_shaders::source(cairn_shaders::LINEAR_MATVEC, Some("IQ4_NL")).is_none());
    }
}

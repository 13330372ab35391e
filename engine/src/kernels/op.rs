//! What every op is to a backend: [`OpSpec`] (name, buffers with the bytes it needs, shape
//! rules, parameter struct, CPU reference), and the one list of ops (`ops!`), which declares
//! the [`Op`] enum and [`with_op!`], the one match over every op.
//!
//! Each op's struct lives with its reference function (`norm.rs` holds `RmsNorm`, ...). Its
//! `Params` is the `#[repr(C)]` struct every GPU kernel of the op reads: the WGSL `Params`
//! declaration and the CUDA C struct of the same name declare the same members in the same
//! order, which tests check (`kernels/layout.rs`).

use crate::backend::{Buffer, Result};

use super::{
    Add, AddBias, Argmax, Attention, BufferCopy, Embed, GeluMul, KvStore, Linear, MatMul,
    PagedAttention, RmsNorm, Rope, Sample, ScaleCap, SiluMul, Softmax,
};

/// How an op touches one of its buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    /// Written, and must not also be a buffer the op reads.
    Write,
    /// Read and written, or written where it may also be an input (in place).
    InPlace,
}

/// One buffer of an op: its role (for errors), and the bytes the op touches in it (`None`
/// when that count overflows).
#[derive(Debug, Clone, Copy)]
pub struct Use<'a> {
    pub role: &'static str,
    pub buf: &'a Buffer,
    pub bytes: Option<u64>,
    pub access: Access,
}

impl<'a> Use<'a> {
    pub fn read(role: &'static str, buf: &'a Buffer, bytes: Option<u64>) -> Self {
        Use {
            role,
            buf,
            bytes,
            access: Access::Read,
        }
    }
    pub fn write(role: &'static str, buf: &'a Buffer, bytes: Option<u64>) -> Self {
        Use {
            role,
            buf,
            bytes,
            access: Access::Write,
        }
    }
    pub fn in_place(role: &'static str, buf: &'a Buffer, bytes: Option<u64>) -> Self {
        Use {
            role,
            buf,
            bytes,
            access: Access::InPlace,
        }
    }
}

/// Bytes of `dims` f32 (or u32) values, `None` on overflow.
pub fn f32s(dims: &[u32]) -> Option<u64> {
    dims.iter()
        .try_fold(4u64, |acc, &v| acc.checked_mul(u64::from(v)))
}

/// One operation's contract, shared by every backend.
pub trait OpSpec<'a> {
    /// The parameters every GPU kernel of this op reads, as one `#[repr(C)]` struct.
    type Params: bytemuck::Pod;

    /// A short name for logs, errors and per-kernel timings.
    fn name(&self) -> &'static str;

    /// Shape rules beyond buffer sizes, checked before them: the reason when broken.
    fn check(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    /// Every buffer the op touches, with the bytes it needs there.
    fn buffers(&self) -> Vec<Use<'a>>;

    fn params(&self) -> Self::Params;

    /// Runs the op on `cpu` buffers with its reference function; the op has been validated.
    fn cpu(&self) -> Result<()>;
}

/// Declares an op's `#[repr(C)]` parameter struct and its member list (for the layout checks
/// against the WGSL and CUDA C declarations). Members are 4-byte values: `u32` or `f32`.
macro_rules! params {
    ($(#[$meta:meta])* $name:ident { $($field:ident: $ty:ident),* $(,)? }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
        pub struct $name {
            $(pub $field: $ty,)*
        }

        impl $crate::kernels::op::Layout for $name {
            const NAME: &'static str = stringify!($name);
            const MEMBERS: &'static [(&'static str, &'static str, usize)] = &[
                $((stringify!($field), stringify!($ty), std::mem::offset_of!($name, $field)),)*
            ];
        }
    };
}
pub(crate) use params;

/// A parameter struct's members as declared: name, Rust type, byte offset.
pub trait Layout {
    const NAME: &'static str;
    const MEMBERS: &'static [(&'static str, &'static str, usize)];
}

/// Declares, from the one list of ops below, [`Op`] with a variant per op struct, `From` each
/// struct, and [`with_op!`]. (`$d` carries a `$` into the macro it declares.)
macro_rules! ops {
    ($($variant:ident($ty:ident)),* $(,)?) => {
        ops!(@declare ($) $($variant($ty)),*);
    };
    (@declare ($d:tt) $($variant:ident($ty:ident)),*) => {
        /// One unit of work on a device. Ops run in order; each sees every earlier op's
        /// writes.
        #[derive(Debug, Clone, Copy)]
        pub enum Op<'a> {
            $($variant($ty<'a>),)*
        }

        $(impl<'a> From<$ty<'a>> for Op<'a> {
            fn from(op: $ty<'a>) -> Self {
                Op::$variant(op)
            }
        })*

        /// Evaluates `$body` with `$o` bound to the struct inside `$op` (an `Op` or `&Op`),
        /// whatever op it is: the one match over every op, so backends write per-op impls,
        /// not matches.
        macro_rules! with_op {
            ($d op:expr, $d o:ident => $d body:expr) => {{
                use $crate::kernels::Op;
                match $d op {
                    $(Op::$variant($d o) => $d body,)*
                }
            }};
        }
        pub(crate) use with_op;
    };
}

// Every op, once: adding an op adds its line here.
ops!(
    MatMul(MatMul),
    Linear(Linear),
    RmsNorm(RmsNorm),
    Rope(Rope),
    Softmax(Softmax),
    SiluMul(SiluMul),
    GeluMul(GeluMul),
    ScaleCap(ScaleCap),
    Add(Add),
    AddBias(AddBias),
    Embed(Embed),
    Attention(Attention),
    KvStore(KvStore),
    PagedAttention(PagedAttention),
    Argmax(Argmax),
    Sample(Sample),
    Copy(BufferCopy),
);

impl<'a> Op<'a> {
    /// A short name for logs, errors and per-kernel timings.
    pub fn name(&self) -> &'static str {
        with_op!(self, o => o.name())
    }

    /// Every buffer the op touches.
    pub fn buffers(&self) -> Vec<Use<'a>> {
        with_op!(self, o => o.buffers())
    }
}

params!(
    /// The parameters of the ops over `n` elements (`Add`, `SiluMul`, `GeluMul`, `Argmax`).
    CountParams {
        n: u32,
        _pad0: u32,
        _pad1: u32,
        _pad2: u32,
    }
);

impl CountParams {
    pub fn new(n: u32) -> Self {
        CountParams {
            n,
            ..bytemuck::Zeroable::zeroed()
        }
    }
}

/// Bytes of a row of `n` `ty` values as a parameter word; 0 when `n` is not a whole number of
/// blocks or the row passes 4 GiB, which validation has refused before any kernel runs.
pub fn row_bytes(ty: crate::quant::GgmlType, n: u32) -> u32 {
    ty.row_bytes(n as usize)
        .and_then(|b| u32::try_from(b).ok())
        .unwrap_or(0)
}

#[cfg(test)]
pub(crate) mod cuda_declarations {
    use super::Layout;
    use crate::kernels::*;

    pub(crate) const COMMON: &str = include_str!("../backend/cuda/kernels/common.cuh");

    /// Parameter structs in common.cuh that are no op's: the cuda backend's own, checked
    /// where they are written (backend/cuda/fuse.rs).
    const BACKEND_PARAMS: &[&str] = &["FusedLinearParams", "PeerSumParams"];

    /// `struct Name { type member; ... };` declarations in CUDA C: name, then (type, member).
    pub(crate) fn c_structs(src: &str) -> Vec<(String, Vec<(String, String)>)> {
        let mut out = Vec::new();
        let mut rest = src;
        while let Some(at) = rest.find("\nstruct ") {
            rest = &rest[at + "\nstruct ".len()..];
            let (Some(open), Some(close)) = (rest.find('{'), rest.find("};")) else {
                break;
            };
            let name = rest[..open].trim().to_string();
            let members = rest[open + 1..close]
                .split(';')
                .filter_map(|m| {
                    let mut words = m.split_whitespace();
                    Some((words.next()?.to_string(), words.next()?.to_string()))
                })
                .collect();
            out.push((name, members));
            rest = &rest[close..];
        }
        out
    }

    pub(crate) fn same<P: Layout>(c: &[(String, Vec<(String, String)>)]) -> Result<(), String> {
        let (_, members) = c
            .iter()
            .find(|(n, _)| n == P::NAME)
            .ok_or_else(|| format!("common.cuh declares no struct {}", P::NAME))?;
        let rust: Vec<(String, String)> = P::MEMBERS
            .iter()
            .map(|(name, ty, _)| {
                let c_ty = if *ty == "f32" { "float" } else { ty };
                (c_ty.to_string(), name.to_string())
            })
            .collect();
        if *members != rust {
            return Err(format!("{}: cuda {members:?}, rust {rust:?}", P::NAME));
        }
        Ok(())
    }

    /// NVRTC compiles the CUDA source only on a GPU machine, so this is where a parameter
    /// struct that differs between Rust and CUDA C is caught everywhere.
    #[test]
    fn every_cuda_params_struct_declares_the_rust_members_in_order() {
        let c = c_structs(COMMON);
        let checks = [
            same::<MatMulParams>(&c),
            same::<LinearParams>(&c),
            same::<EmbedParams>(&c),
            same::<RmsNormParams>(&c),
            same::<RopeParams>(&c),
            same::<SoftmaxParams>(&c),
            same::<CountParams>(&c),
            same::<BiasParams>(&c),
            same::<ScaleCapParams>(&c),
            same::<AttentionParams>(&c),
            same::<KvStoreParams>(&c),
            same::<PagedAttentionParams>(&c),
            same::<SampleKernelParams>(&c),
            same::<CopyParams>(&c),
        ];
        let errors: Vec<String> = checks.into_iter().filter_map(|r| r.err()).collect();
        assert!(errors.is_empty(), "{errors:#?}");
        let params: Vec<&str> = c
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| n.ends_with("Params") && !BACKEND_PARAMS.contains(n))
            .collect();
        assert_eq!(
            params.len(),
            14,
            "a cuda struct without a rust twin: {params:?}"
        );
    }

    #[test]
    fn the_declaration_parser_sees_a_swapped_member() {
        let c = c_structs("x\nstruct MatMulParams { u32 n; u32 m; u32 k; u32 _pad; };\n");
        assert!(same::<MatMulParams>(&c).is_err());
        let c = c_structs("x\nstruct MatMulParams { u32 m; u32 n; u32 k; u32 _pad; };\n");
        assert_eq!(same::<MatMulParams>(&c), Ok(()));
    }
}

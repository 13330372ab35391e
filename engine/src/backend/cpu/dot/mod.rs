//! Integer dot products of one weight row (GGUF blocks, read in place) against one token's
//! int8 activations, per format, with the instruction set chosen once at run time.

use std::ops::Range;
use std::sync::OnceLock;

use tile::{Acts, TILE, Tile};

use super::q8::{Layout, Q8Row};
use crate::quant::GgmlType;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;
pub(crate) mod scalar;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd128;
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
mod simd128_tile;
pub(crate) mod tile;

/// A weight row's bytes (whole blocks) against the activations of as many elements.
pub(crate) type DotFn = fn(&[u8], Q8Row<'_>) -> f32;

/// One weight row against four tokens' activations.
pub(crate) type Dot4Fn = fn(&[u8], [Q8Row<'_>; 4]) -> [f32; 4];

/// Rows (`out.len()` of the given byte length, one after another) against one token's
/// activations, one result per row: decode's product where an instruction set has one.
pub(crate) type RowsFn = fn(&[u8], usize, Q8Row<'_>, &mut [f32]);

/// Rows (`out.len() / tokens` of the given byte length) against a batch of decode tokens,
/// `out[row · tokens + token]`: the batched decode step's product where an instruction set
/// has one, each (row, token) with the bits the one-token kernels give it.
pub(crate) type BatchFn = fn(&[u8], usize, &[Q8Row<'_>], &mut [f32]);

/// A prefill tile's rows against a range of the prompt's tokens, each token's 16 results
/// into one entry of the output (`tile.rs`).
pub(crate) type TileFn = fn(&Tile, &Acts<'_>, Range<usize>, &mut [[f32; TILE]]);

/// Which code the dot products run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 F/BW/VL with VNNI's `vpdpbusd`; formats without a kernel of their own run
    /// AVX2's.
    #[cfg(target_arch = "x86_64")]
    Avx512,
    /// aarch64 NEON without the dot-product extension (`smull` and pairwise adds).
    #[cfg(target_arch = "aarch64")]
    Neon,
    /// aarch64 NEON with `sdot` (Armv8.2's dot-product extension, detected at run time).
    #[cfg(target_arch = "aarch64")]
    NeonDot,
    /// wasm SIMD, chosen when the build enables it (wasm cannot detect it at run time);
    /// with relaxed SIMD's integer dot product where the build enables that too.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    Simd128,
}

impl Isa {
    /// The best this processor runs, or the one `CAIRN_CPU_ISA` names (one of
    /// [`Isa::available`]'s names: to compare kernels in one binary, or to step around one).
    pub(crate) fn detect() -> Isa {
        static CHOSEN: OnceLock<Isa> = OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = Isa::best();
            let Ok(name) = std::env::var("CAIRN_CPU_ISA") else {
                return best;
            };
            let available = Isa::available();
            match available.iter().find(|i| i.name() == name) {
                Some(&isa) => isa,
                None => {
                    let names: Vec<&str> = available.iter().map(|i| i.name()).collect();
                    tracing::warn!(
                        "CAIRN_CPU_ISA={name:?} is not one of this processor's {names:?}; using {}",
                        best.name()
                    );
                    best
                }
            }
        })
    }

    /// The fastest instruction set this processor has.
    fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if avx512::available() {
            return Isa::Avx512;
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            return Isa::Avx2;
        }
        #[cfg(target_arch = "aarch64")]
        return if neon::has_dotprod() {
            Isa::NeonDot
        } else {
            Isa::Neon
        };
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        return Isa::Simd128;
        #[allow(unreachable_code)]
        Isa::Scalar
    }

    /// Every instruction set this processor runs, the scalar reference first.
    pub(crate) fn available() -> Vec<Isa> {
        #[cfg_attr(
            not(any(
                target_arch = "x86_64",
                target_arch = "aarch64",
                all(target_arch = "wasm32", target_feature = "simd128")
            )),
            allow(unused_mut)
        )]
        let mut all = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx2() {
                all.push(Isa::Avx2);
            }
            if avx512::available() {
                all.push(Isa::Avx512);
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            all.push(Isa::Neon);
            if neon::has_dotprod() {
                all.push(Isa::NeonDot);
            }
        }
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        all.push(Isa::Simd128);
        all
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "avx512vnni",
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => "neon",
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => "neon+dotprod",
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            Isa::Simd128 if simd128::RELAXED => "simd128+relaxed",
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            Isa::Simd128 => "simd128",
        }
    }

    /// The dot product for `ty` and the activation layout it takes, or `None` for the float
    /// formats (those keep the f32 path).
    pub(crate) fn dot(self, ty: GgmlType) -> Option<(DotFn, Layout)> {
        let layout = match ty {
            GgmlType::F32 | GgmlType::F16 => return None,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                Layout::Blocks32
            }
            _ => Layout::Super256,
        };
        let f: DotFn = match self {
            Isa::Scalar => scalar_dot(ty)?,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2::dot(ty).or_else(|| scalar_dot(ty))?,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512::dot(ty)
                .or_else(|| avx2::dot(ty))
                .or_else(|| scalar_dot(ty))?,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => neon::dot(ty, false).or_else(|| scalar_dot(ty))?,
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => neon::dot(ty, true).or_else(|| scalar_dot(ty))?,
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            Isa::Simd128 => simd128::dot(ty).or_else(|| scalar_dot(ty))?,
        };
        Some((f, layout))
    }
}

impl Isa {
    /// The four-token kernel for `ty`, where this instruction set has one (prefill runs four
    /// tokens against each weight block while it is in registers).
    pub(crate) fn dot4(self, ty: GgmlType) -> Option<Dot4Fn> {
        match self {
            Isa::Scalar => {
                let _ = ty;
                None
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2::dot4(ty),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512::dot4(ty).or_else(|| avx2::dot4(ty)),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon | Isa::NeonDot => None,
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            Isa::Simd128 => simd128::dot4(ty),
        }
    }
}

impl Isa {
    /// Decode's several-row kernel for `ty`, where this instruction set has one (the
    /// 32-element formats on AVX-512); elsewhere decode calls [`Isa::dot`] row by row.
    pub(crate) fn rows(self, ty: GgmlType) -> Option<RowsFn> {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512::rows(ty),
            _ => {
                let _ = ty;
                None
            }
        }
    }
}

impl Isa {
    /// The batched decode step's kernel for `ty`, where this instruction set has one (the
    /// 32-element formats on AVX-512); elsewhere a batch runs [`Isa::dot4`] row by row.
    pub(crate) fn batch(self, ty: GgmlType) -> Option<BatchFn> {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512::batch(ty),
            _ => {
                let _ = ty;
                None
            }
        }
    }
}

impl Isa {
    /// The prefill kernel over unpacked tiles for `ty` and how its blocks unpack, where this
    /// instruction set has one.
    pub(crate) fn tile(self, ty: GgmlType) -> Option<(TileFn, tile::Format)> {
        let format = tile::Format::of(ty)?;
        let kernel: Option<TileFn> = match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512::tile(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2::tile(ty),
            #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
            Isa::Simd128 => simd128_tile::tile(ty),
            _ => None,
        };
        Some((kernel?, format))
    }
}

impl Isa {
    /// Unpacks rows `rows` of `w` into `t` (`Tile::fill`), with this instruction set's own
    /// unpacking where it has one for the format.
    pub(crate) fn fill_tile(
        self,
        t: &mut Tile,
        f: tile::Format,
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if self == Isa::Avx512 && avx512::fill(t, f, w, row_bytes, rows.clone()).is_some() {
            return;
        }
        #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
        if self == Isa::Simd128 && simd128_tile::fill(t, f, w, row_bytes, rows.clone()).is_some() {
            return;
        }
        t.fill(f, w, row_bytes, rows)
    }
}

/// What the AVX2 kernels (and attention's AVX2 f32 helpers) need.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

fn scalar_dot(ty: GgmlType) -> Option<DotFn> {
    Some(match ty {
        GgmlType::F32 | GgmlType::F16 => return None,
        GgmlType::Q4_0 => scalar::q4_0,
        GgmlType::Q4_1 => scalar::q4_1,
        GgmlType::Q5_0 => scalar::q5_0,
        GgmlType::Q5_1 => scalar::q5_1,
        GgmlType::Q8_0 => scalar::q8_0,
        GgmlType::Q2_K => scalar::q2_k,
        GgmlType::Q3_K => scalar::q3_k,
        GgmlType::Q4_K => scalar::q4_k,
        GgmlType::Q5_K => scalar::q5_k,
        GgmlType::Q6_K => scalar::q6_k,
    })
}

//! Folding a decode step's small ops into the matrix-vector products beside them
//! (`linear_matvec_fused`), as the `cuda` backend fuses (backend/cuda/fuse.rs), to save
//! dispatches: each costs the CPU 5 to 9 us to encode and the GPU a pipeline drain.
//!
//! Three pairs are folded: an RMS norm into the one-token product that reads its output (the
//! kernel normalizes in its prologue and still writes the norm's output for the products after
//! it), a residual add run in place on its accumulator into the product it adds, and
//! silu(gate) * up into the up product. A SmolLM2-135M layer goes from 15 dispatches to 10.
//! The fused dispatch writes every buffer the ops would have written, with their arithmetic,
//! so results are those of the ops one by one. A pair whose buffers would alias a written
//! binding (which WebGPU refuses, and which would race) runs as it is. Pure logic: tested
//! without a GPU.

use cairn_shaders as shaders;

use super::plan::{self, Step, grid};
use crate::backend::{Buffer, Result};
use crate::kernels::op::{params, row_bytes};
use crate::kernels::{self, Op};

params!(
    /// What `linear_matvec_fused` reads: `Linear`'s parameters, what is folded in (`mode`)
    /// and the norm's epsilon.
    FusedMatvecParams {
        rows: u32,
        cols: u32,
        tokens: u32,
        row_bytes: u32,
        mode: u32,
        eps: f32,
        _pad0: u32,
        _pad1: u32,
    }
);

/// `FusedMatvecParams::mode` (linear_matvec_fused.wgsl).
pub(crate) const MODE_NORM: u32 = 1;
pub(crate) const MODE_ADD: u32 = 2;
pub(crate) const MODE_SILU: u32 = 4;

/// Every op of a run as the steps that run it, fused where `fuse` allows.
pub(crate) fn plan_run<'a>(ops: &[Op<'a>], max_dim: u32, fuse: bool) -> Result<Vec<Step<'a>>> {
    let mut steps = Vec::with_capacity(ops.len());
    let mut i = 0;
    while i < ops.len() {
        if fuse && let Some(step) = fuse_pair(&ops[i], ops.get(i + 1), max_dim)? {
            steps.push(step);
            i += 2;
            continue;
        }
        steps.push(plan::plan(&ops[i], max_dim)?);
        i += 1;
    }
    Ok(steps)
}

/// The one-token product in `op`, if it is one.
fn matvec<'o, 'a>(op: &'o Op<'a>) -> Option<&'o kernels::Linear<'a>> {
    match op {
        Op::Linear(l) if l.tokens == 1 && l.rows > 0 && l.cols > 0 => Some(l),
        _ => None,
    }
}

fn same(a: &Buffer, b: &Buffer) -> bool {
    a.id() == b.id()
}

/// `first` and `next` as one `linear_matvec_fused` dispatch, where they fold.
fn fuse_pair<'a>(first: &Op<'a>, next: Option<&Op<'a>>, max_dim: u32) -> Result<Option<Step<'a>>> {
    let Some(next) = next else {
        return Ok(None);
    };
    // (product, mode, the buffer `x` binds, aux, out, eps)
    let fused = match (first, next) {
        (Op::RmsNorm(n), Op::Linear(_)) => {
            let Some(l) = matvec(next) else {
                return Ok(None);
            };
            if n.tokens != 1 || n.dim != l.cols || !same(n.y, l.x) {
                return Ok(None);
            }
            (l, MODE_NORM, n.x, n.weight, n.y, n.eps)
        }
        (Op::Linear(_), Op::Add(a)) => {
            let Some(l) = matvec(first) else {
                return Ok(None);
            };
            match a.in_place_other() {
                Some(other) if same(other, l.y) && !same(a.out, l.y) && a.n == l.rows => {
                    (l, MODE_ADD, l.x, l.x, a.out, 0.0)
                }
                _ => return Ok(None),
            }
        }
        (Op::Linear(_), Op::SiluMul(s)) => {
            let Some(l) = matvec(first) else {
                return Ok(None);
            };
            if !same(s.up, l.y) || s.n != l.rows {
                return Ok(None);
            }
            (l, MODE_SILU, l.x, s.gate, s.out, 0.0)
        }
        _ => return Ok(None),
    };
    let (l, mode, x, aux, out, eps) = fused;
    let buffers = vec![l.w, x, aux, l.y, out];
    // Bindings 4 and 5 are written: neither may be bound anywhere else.
    let aliased = |k: usize| {
        buffers
            .iter()
            .enumerate()
            .any(|(j, b)| j != k && same(b, buffers[k]))
    };
    if aliased(3) || aliased(4) {
        return Ok(None);
    }
    let p = FusedMatvecParams {
        rows: l.rows,
        cols: l.cols,
        tokens: 1,
        row_bytes: row_bytes(l.wtype, l.cols),
        mode,
        eps,
        _pad0: 0,
        _pad1: 0,
    };
    let mut params = [0u32; 8];
    params.copy_from_slice(bytemuck::cast_slice(bytemuck::bytes_of(&p)));
    Ok(Some(Step::Dispatch {
        kernel: shaders::LINEAR_MATVEC_FUSED,
        format: Some(l.wtype.name()),
        buffers,
        params,
        groups: grid(l.rows.div_ceil(8), max_dim)?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Device;
    use crate::kernels::{Add, Linear, RmsNorm, SiluMul};
    use crate::quant::GgmlType;

    struct Bufs {
        h: Buffer,
        xn: Buffer,
        nw: Buffer,
        w: [Buffer; 3],
        q: Buffer,
        o: Buffer,
        g: Buffer,
        u: Buffer,
        a: Buffer,
    }

    fn bufs() -> Bufs {
        let d = Device::new_cpu(crate::device::info::describe_cpu());
        let b = |n: &str| d.alloc(n, 4096).unwrap();
        Bufs {
            h: b("h"),
            xn: b("xn"),
            nw: b("nw"),
            w: [b("w0"), b("w1"), b("w2")],
            q: b("q"),
            o: b("o"),
            g: b("g"),
            u: b("u"),
            a: b("a"),
        }
    }

    fn lin<'a>(w: &'a Buffer, x: &'a Buffer, y: &'a Buffer, tokens: u32) -> Op<'a> {
        Op::Linear(Linear {
            w,
            wtype: GgmlType::Q8_0,
            x,
            y,
            rows: 64,
            cols: 64,
            tokens,
        })
    }

    fn norm<'a>(b: &'a Bufs, y: &'a Buffer) -> Op<'a> {
        Op::RmsNorm(RmsNorm {
            x: &b.h,
            weight: &b.nw,
            y,
            dim: 64,
            tokens: 1,
            eps: 1e-5,
        })
    }

    /// Each step as its kernel and, for a fused one, its mode.
    fn shape(steps: &[Step]) -> Vec<String> {
        steps
            .iter()
            .map(|s| match s {
                Step::Dispatch { kernel, params, .. }
                    if *kernel == shaders::LINEAR_MATVEC_FUSED =>
                {
                    format!("fused{}", params[4])
                }
                Step::Dispatch { kernel, .. } => kernel.name.to_string(),
                Step::Copy { .. } => "copy".into(),
            })
            .collect()
    }

    /// A decode layer's ffn half: norm + gate, up + silu, down + add.
    #[test]
    fn a_decode_ffn_folds_into_three_dispatches() {
        let b = bufs();
        let ops = vec![
            norm(&b, &b.xn),
            lin(&b.w[0], &b.xn, &b.g, 1),
            lin(&b.w[1], &b.xn, &b.u, 1),
            Op::SiluMul(SiluMul {
                gate: &b.g,
                up: &b.u,
                out: &b.a,
                n: 64,
            }),
            lin(&b.w[2], &b.a, &b.o, 1),
            Op::Add(Add {
                a: &b.h,
                b: &b.o,
                out: &b.h,
                n: 64,
            }),
        ];
        let steps = plan_run(&ops, 65535, true).unwrap();
        assert_eq!(shape(&steps), ["fused1", "fused4", "fused2"]);
        let ids = |s: &Step| match s {
            Step::Dispatch { buffers, .. } => buffers.iter().map(|b| b.id()).collect::<Vec<_>>(),
            Step::Copy { .. } => vec![],
        };
        // norm: reads h and its weight, writes the product and the norm's output.
        assert_eq!(
            ids(&steps[0]),
            [b.w[0].id(), b.h.id(), b.nw.id(), b.g.id(), b.xn.id()]
        );
        assert_eq!(
            ids(&steps[1]),
            [b.w[1].id(), b.xn.id(), b.g.id(), b.u.id(), b.a.id()]
        );
        assert_eq!(
            ids(&steps[2]),
            [b.w[2].id(), b.a.id(), b.a.id(), b.o.id(), b.h.id()]
        );
        // Off, every op is its own dispatch.
        assert_eq!(plan_run(&ops, 65535, false).unwrap().len(), ops.len());
    }

    #[test]
    fn what_would_alias_or_batch_is_left_alone() {
        let b = bufs();
        let cases: Vec<Vec<Op>> = vec![
            // Prefill: the tiled product takes several tokens.
            vec![norm(&b, &b.xn), lin(&b.w[0], &b.xn, &b.q, 2)],
            // A product reading something other than the norm's output.
            vec![norm(&b, &b.xn), lin(&b.w[0], &b.a, &b.q, 1)],
            // An in-place norm: its output is its input.
            vec![norm(&b, &b.h), lin(&b.w[0], &b.h, &b.q, 1)],
            // An add that is not in place, or adds something else.
            vec![
                lin(&b.w[0], &b.a, &b.o, 1),
                Op::Add(Add {
                    a: &b.h,
                    b: &b.o,
                    out: &b.q,
                    n: 64,
                }),
            ],
            vec![
                lin(&b.w[0], &b.a, &b.o, 1),
                Op::Add(Add {
                    a: &b.h,
                    b: &b.q,
                    out: &b.h,
                    n: 64,
                }),
            ],
            // The accumulator is what the product reads.
            vec![
                lin(&b.w[0], &b.h, &b.o, 1),
                Op::Add(Add {
                    a: &b.h,
                    b: &b.o,
                    out: &b.h,
                    n: 64,
                }),
            ],
            // silu's output is the product's input; and a product that is not `up`.
            vec![
                lin(&b.w[0], &b.a, &b.u, 1),
                Op::SiluMul(SiluMul {
                    gate: &b.g,
                    up: &b.u,
                    out: &b.a,
                    n: 64,
                }),
            ],
            vec![
                lin(&b.w[0], &b.xn, &b.g, 1),
                Op::SiluMul(SiluMul {
                    gate: &b.g,
                    up: &b.u,
                    out: &b.a,
                    n: 64,
                }),
            ],
            // A shorter elementwise op than the product.
            vec![
                lin(&b.w[0], &b.xn, &b.u, 1),
                Op::SiluMul(SiluMul {
                    gate: &b.g,
                    up: &b.u,
                    out: &b.a,
                    n: 32,
                }),
            ],
        ];
        for (i, ops) in cases.iter().enumerate() {
            let steps = plan_run(ops, 65535, true).unwrap();
            assert_eq!(steps.len(), 2, "case {i}: {:?}", shape(&steps));
        }
    }

    #[test]
    fn the_fused_params_are_the_kernels() {
        let src = shaders::source(shaders::LINEAR_MATVEC_FUSED, Some("F32")).unwrap();
        let module = naga::front::wgsl::parse_str(&src).unwrap();
        let consts: Vec<(String, u32)> = module
            .constants
            .iter()
            .filter_map(|(_, c)| {
                let name = c.name.clone()?;
                match module.global_expressions[c.init] {
                    naga::Expression::Literal(naga::Literal::U32(v)) => Some((name, v)),
                    _ => None,
                }
            })
            .collect();
        for (name, v) in [("NORM", MODE_NORM), ("ADD", MODE_ADD), ("SILU", MODE_SILU)] {
            assert!(
                consts.contains(&(name.to_string(), v)),
                "{name} = {v} in the kernel"
            );
        }
    }
}

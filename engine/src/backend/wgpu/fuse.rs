//! Folding a decode step's small ops into the matrix-vector products beside them
//! (`linear_matvec_fused`), as the `cuda` backend fuses (backend/cuda/fuse.rs), to save
//! dispatches: each costs the CPU 5 to 9 us to encode and the GPU a pipeline drain, and each
//! buffer copy ends a compute pass.
//!
//! What is folded into a one-token product: the RMS norm before it whose output it reads (the
//! kernel normalizes in its prologue and still writes the norm's output for the products after
//! it); right after it, a residual add run in place on its accumulator or silu(gate) * up with
//! it as `up`; or, a few ops later, the rope on its output and then the copy of its output into
//! the KV cache, where the ops in between touch neither. A SmolLM2-135M layer goes from 15
//! dispatches and 2 copies to 8 dispatches. The fused dispatch writes every buffer the ops
//! would have written, with their arithmetic, so results are those of the ops one by one. What
//! would alias a written binding (which WebGPU refuses, and which would race) runs as it is.
//! Pure logic: tested without a GPU.

use cairn_shaders as shaders;

use super::plan::{self, Matvec, Step, grid};
use super::{rows, split_attention};
use crate::backend::{Buffer, Result};
use crate::kernels::op::{params, row_bytes};
use crate::kernels::{self, Op, OpSpec, with_op};

params!(
    /// What `linear_matvec_fused` reads: `Linear`'s shape, what is folded in (`mode`), the
    /// norm's epsilon (as bits) or the KV-cache word offset (`extra`), and the rope's position,
    /// base and `head_dim | rope_dim << 16`.
    FusedMatvecParams {
        rows: u32,
        cols: u32,
        row_bytes: u32,
        mode: u32,
        extra: u32,
        pos0: u32,
        freq_base: f32,
        dims: u32,
    }
);

/// Bits of `FusedMatvecParams::mode` (linear_matvec_fused.wgsl).
pub(crate) const MODE_NORM: u32 = 1;
pub(crate) const MODE_ADD: u32 = 2;
pub(crate) const MODE_SILU: u32 = 4;
pub(crate) const MODE_ROPE: u32 = 8;
pub(crate) const MODE_STORE: u32 = 16;

/// How far past a product its rope and cache copy are looked for (in a decode layer they
/// follow the other products: 3 and 4 ops on).
const LOOKAHEAD: usize = 6;

/// The scratch buffers a run's steps may use, each where the run needs it.
#[derive(Clone, Copy, Default)]
pub(crate) struct Scratch<'a> {
    /// The packed-integer kernels' activations.
    pub(crate) int8: Option<&'a Buffer>,
    /// A part's rows of products over weights in parts (`rows.rs`).
    pub(crate) parts: Option<&'a Buffer>,
    /// The pieces of decode attention cut by keys (`split_attention.rs`); `None`: not cut.
    pub(crate) attention: Option<&'a Buffer>,
    /// Every decode attention is cut (`--wgpu-attention split`), not only long ones.
    pub(crate) attention_forced: bool,
    /// Which kernel scores the pieces.
    pub(crate) attention_pass: split_attention::FirstPass,
}

/// Every op of a run as the steps that run it, fused where `fuse` allows
/// (`norms`: RMS norms too). Products on the packed-integer kernels ([`Matvec::int8_for`])
/// are not fused: they round their activations into `scratch` first, once for consecutive
/// products of the same activations (a layer's Q, K and V; gate and up).
pub(crate) fn plan_run<'a>(
    ops: &[Op<'a>],
    max_dim: u32,
    fuse: bool,
    norms: bool,
    matvec: Matvec,
    scratch: Scratch<'a>,
) -> Result<Vec<Step<'a>>> {
    let mut steps = Vec::with_capacity(ops.len());
    let mut taken = vec![false; ops.len()];
    // The activations `scratch` holds (buffer, cols, tokens), while nothing ran since.
    let mut quantized: Option<(u64, u32, u32)> = None;
    for i in 0..ops.len() {
        if taken[i] {
            continue;
        }
        // Tensors in parts by rows run part by part, unfused.
        if let Some(parts) = rows::plan_parts(&ops[i], max_dim, matvec, scratch.parts)? {
            steps.extend(parts);
            quantized = None;
            continue;
        }
        // Decode attention cut by keys, where it is on (its scratch is there) and pays.
        if let (Op::Attention(a), Some(pieces)) = (&ops[i], scratch.attention)
            && let Some(n) =
                split_attention::splits(a, scratch.attention_forced, scratch.attention_pass)
        {
            steps.extend(split_attention::steps(a, n, pieces, scratch.attention_pass));
            quantized = None;
            continue;
        }
        if let (Op::PagedAttention(a), Some(pieces)) = (&ops[i], scratch.attention)
            && a.heads <= max_dim
            && let Some(n) =
                split_attention::paged_splits(a, scratch.attention_forced, scratch.attention_pass)
        {
            steps.extend(split_attention::paged_steps(
                a,
                n,
                pieces,
                scratch.attention_pass,
            ));
            quantized = None;
            continue;
        }
        if let (Op::Linear(l), Some(scratch)) = (&ops[i], scratch.int8)
            && matvec.int8_for(l)
        {
            let key = (l.x.id(), l.cols, l.tokens);
            plan::int8_steps(
                l,
                max_dim,
                matvec,
                scratch,
                quantized == Some(key),
                &mut steps,
            )?;
            quantized = Some(key);
            continue;
        }
        quantized = None;
        if fuse && let Some(step) = fuse_at(ops, i, &mut taken, norms, max_dim, matvec)? {
            steps.push(step);
            continue;
        }
        steps.push(plan::plan(&ops[i], max_dim, matvec)?);
    }
    Ok(steps)
}

/// The one-token product in `op`, if it is one.
fn matvec<'o, 'a>(op: &'o Op<'a>) -> Option<&'o kernels::Linear<'a>> {
    match op {
        Op::Linear(l)
            if l.tokens == 1 && l.rows > 0 && l.cols > 0 && rows::parts_of(l.w).is_none() =>
        {
            Some(l)
        }
        _ => None,
    }
}

fn same(a: &Buffer, b: &Buffer) -> bool {
    a.id() == b.id()
}

fn touches(op: &Op<'_>, b: &Buffer) -> bool {
    with_op!(op, o => o.buffers())
        .iter()
        .any(|u| same(u.buf, b))
}

/// A product and what is folded into it.
struct Fused<'a> {
    l: kernels::Linear<'a>,
    x: &'a Buffer,
    aux: &'a Buffer,
    out: &'a Buffer,
    mode: u32,
    extra: u32,
    rope: Option<kernels::Rope<'a>>,
}

/// The fused dispatch that starts at `ops[i]`, marking the ops it folds in as `taken`; `None`
/// when nothing folds (the op then runs as it is).
fn fuse_at<'a>(
    ops: &[Op<'a>],
    i: usize,
    taken: &mut [bool],
    norms: bool,
    max_dim: u32,
    kernels: Matvec,
) -> Result<Option<Step<'a>>> {
    let next = ops.get(i + 1);
    let (mut f, p) = match (&ops[i], next.and_then(matvec)) {
        (Op::RmsNorm(n), Some(l))
            if norms && n.tokens == 1 && n.dim == l.cols && same(n.y, l.x) =>
        {
            (
                Fused {
                    l: *l,
                    x: n.x,
                    aux: n.weight,
                    out: n.y,
                    mode: MODE_NORM,
                    extra: n.eps.to_bits(),
                    rope: None,
                },
                i + 1,
            )
        }
        (op, _) => match matvec(op) {
            Some(l) => (
                Fused {
                    l: *l,
                    x: l.x,
                    aux: l.x,
                    out: l.x,
                    mode: 0,
                    extra: 0,
                    rope: None,
                },
                i,
            ),
            None => return Ok(None),
        },
    };
    // The packed-integer kernels have no fused twin.
    if kernels.int8_for(&f.l) {
        return Ok(None);
    }
    let mut folded = vec![p];
    if f.mode == 0 {
        match next {
            Some(Op::Add(a)) => {
                if let Some(other) = a.in_place_other()
                    && same(other, f.l.y)
                    && !same(a.out, f.l.y)
                    && a.n == f.l.rows
                {
                    f.mode = MODE_ADD;
                    f.out = a.out;
                    folded.push(i + 1);
                }
            }
            Some(Op::SiluMul(s)) if same(s.up, f.l.y) && s.n == f.l.rows => {
                f.mode = MODE_SILU;
                f.aux = s.gate;
                f.out = s.out;
                folded.push(i + 1);
            }
            _ => {}
        }
    }
    if f.mode & (MODE_ADD | MODE_SILU) == 0 {
        fold_rope_and_store(ops, p, taken, &mut f, &mut folded);
    }
    // A lone product runs as the plain kernel; one with only its rope too, since `out` would
    // then have no buffer of its own to stand for.
    if f.mode & (MODE_NORM | MODE_ADD | MODE_SILU | MODE_STORE) == 0 {
        return Ok(None);
    }
    let buffers = vec![f.l.w, f.x, f.aux, f.l.y, f.out];
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
    for &j in &folded {
        taken[j] = true;
    }
    if f.mode & MODE_NORM != 0 {
        taken[i] = true;
    }
    let rope = f.rope.as_ref();
    let p = FusedMatvecParams {
        rows: f.l.rows,
        cols: f.l.cols,
        row_bytes: row_bytes(f.l.wtype, f.l.cols),
        mode: f.mode,
        extra: f.extra,
        pos0: rope.map_or(0, |r| r.pos0),
        freq_base: rope.map_or(0.0, |r| r.freq_base),
        dims: rope.map_or(0, |r| r.head_dim | r.rope_dim << 16),
    };
    let mut params = [0u32; super::PARAM_WORDS];
    let words: &[u32] = bytemuck::cast_slice(bytemuck::bytes_of(&p));
    params[..words.len()].copy_from_slice(words);
    let wide = kernels.wide_for(1, f.l.cols, f.l.wtype.name(), true);
    let (kernel, rows_per_group) = if let Some(wide) = wide {
        wide
    } else if kernels.streams(f.l.cols) {
        let kernel = kernels.pick((
            shaders::LINEAR_MATVEC_FUSED_STREAM,
            shaders::LINEAR_MATVEC_FUSED_STREAM_SUBGROUP,
        ));
        (kernel, Matvec::STREAM_ROWS)
    } else {
        (shaders::LINEAR_MATVEC_FUSED, 8)
    };
    Ok(Some(Step::Dispatch {
        kernel,
        format: Some(f.l.wtype.name()),
        buffers,
        params,
        groups: grid(f.l.rows.div_ceil(rows_per_group), max_dim)?,
    }))
}

/// Folds into the product at `ops[p]` the rope on its output and then the copy of its output
/// into a cache, each where no op between (not yet folded elsewhere) touches what it moves
/// past; the scan ends at the first op that touches the product's output otherwise.
fn fold_rope_and_store<'a>(
    ops: &[Op<'a>],
    p: usize,
    taken: &[bool],
    f: &mut Fused<'a>,
    folded: &mut Vec<usize>,
) {
    let y = f.l.y;
    let mut between: Vec<usize> = Vec::new();
    let clear = |between: &[usize], b: &Buffer| between.iter().all(|&m| !touches(&ops[m], b));
    for j in p + 1..ops.len().min(p + 1 + LOOKAHEAD) {
        if taken[j] {
            continue;
        }
        match &ops[j] {
            Op::Rope(r)
                if f.rope.is_none()
                    && same(r.x, y)
                    && r.factors.is_none()
                    && r.positions.is_none()
                    && !r.neox
                    && r.tokens == 1
                    && r.head_dim % 2 == 0
                    && r.rope_dim % 2 == 0
                    && r.rope_dim <= r.head_dim
                    && r.head_dim < 1 << 16
                    && u64::from(r.heads) * u64::from(r.head_dim) == u64::from(f.l.rows)
                    && clear(&between, y) =>
            {
                f.mode |= MODE_ROPE;
                f.rope = Some(*r);
                folded.push(j);
            }
            Op::Copy(c)
                if f.mode & MODE_NORM == 0
                    && same(c.src, y)
                    && c.src_offset == 0
                    && c.bytes == u64::from(f.l.rows) * 4
                    && c.dst_offset % 4 == 0
                    && c.dst_offset / 4 + u64::from(f.l.rows) <= u64::from(u32::MAX)
                    && clear(&between, y)
                    && clear(&between, c.dst) =>
            {
                f.mode |= MODE_STORE;
                f.out = c.dst;
                f.extra = (c.dst_offset / 4) as u32;
                folded.push(j);
                return;
            }
            op if touches(op, y) => return,
            _ => between.push(j),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Device;
    use crate::kernels::{Add, Attention, BufferCopy, Linear, RmsNorm, Rope, SiluMul};
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
        k: Buffer,
        v: Buffer,
        kc: Buffer,
        vc: Buffer,
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
            k: b("k"),
            v: b("v"),
            kc: b("kc"),
            vc: b("vc"),
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
                    format!("fused{}", params[3])
                }
                Step::Dispatch { kernel, .. } => kernel.name.to_string(),
                Step::Copy { .. } => "copy".into(),
            })
            .collect()
    }

    /// With the packed-integer kernels, the products of their formats are not fused: each
    /// reads activations `quantize_q8` rounded into the scratch buffer, once for gate and up,
    /// again for down (its input is new), and again after any other op.
    #[test]
    fn int8_products_quantize_once_per_activations_and_do_not_fuse() {
        let b = bufs();
        let scratch = &b.q;
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
            lin(&b.w[0], &b.xn, &b.o, 1),
            Op::Add(Add {
                a: &b.h,
                b: &b.o,
                out: &b.h,
                n: 64,
            }),
            lin(&b.w[1], &b.xn, &b.g, 1),
        ];
        let int8 = Matvec::Stream {
            subgroups: false,
            int8: true,
            wide: None,
        };
        let steps = plan_run(
            &ops,
            65535,
            true,
            true,
            int8,
            Scratch {
                int8: Some(scratch),
                ..Default::default()
            },
        )
        .unwrap();
        let (q, p) = ("quantize_q8", "linear_matvec_stream_i8");
        assert_eq!(
            shape(&steps),
            [
                "rmsnorm",
                q,
                p,
                p,
                "silu_mul",
                q,
                p,
                q,
                p,
                "add_inplace",
                q,
                p
            ]
        );
        // The products read the scratch buffer; the quantize dispatch writes it.
        let Step::Dispatch { buffers, .. } = &steps[2] else {
            panic!("a dispatch");
        };
        assert_eq!(buffers[1].id(), scratch.id());
        let Step::Dispatch { buffers, .. } = &steps[1] else {
            panic!("a dispatch");
        };
        assert_eq!(
            [buffers[0].id(), buffers[1].id()],
            [b.xn.id(), scratch.id()]
        );
        // Without a scratch buffer (or off), nothing changes.
        let plain = plan_run(&ops, 65535, true, true, Matvec::Rows, Scratch::default()).unwrap();
        assert!(!shape(&plain).iter().any(|s| s == q));
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
        let steps = plan_run(&ops, 65535, true, true, Matvec::Rows, Scratch::default()).unwrap();
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
        assert_eq!(
            plan_run(&ops, 65535, false, false, Matvec::Rows, Scratch::default())
                .unwrap()
                .len(),
            ops.len()
        );
    }

    fn rope(x: &Buffer) -> Op<'_> {
        Op::Rope(Rope {
            x,
            factors: None,
            positions: None,
            heads: 8,
            head_dim: 8,
            rope_dim: 6,
            tokens: 1,
            pos0: 17,
            freq_base: 1e4,
            neox: false,
        })
    }

    fn copy<'a>(src: &'a Buffer, dst: &'a Buffer) -> Op<'a> {
        Op::Copy(BufferCopy {
            src,
            src_offset: 0,
            dst,
            dst_offset: 3 * 256,
            bytes: 256,
        })
    }

    /// A decode layer's attention half as the model encodes it: norm, q, k, v, the ropes,
    /// the cache copies, attention.
    fn attention_half(b: &Bufs) -> Vec<Op<'_>> {
        vec![
            norm(b, &b.xn),
            lin(&b.w[0], &b.xn, &b.q, 1),
            lin(&b.w[1], &b.xn, &b.k, 1),
            lin(&b.w[2], &b.xn, &b.v, 1),
            rope(&b.q),
            rope(&b.k),
            copy(&b.k, &b.kc),
            copy(&b.v, &b.vc),
            Op::Attention(Attention {
                q: &b.q,
                k_cache: &b.kc,
                v_cache: &b.vc,
                out: &b.a,
                heads: 8,
                kv_heads: 8,
                head_dim: 8,
                tokens: 1,
                pos0: 3,
                scale: 0.3,
                window: 0,
                softcap: 0.0,
            }),
        ]
    }

    /// q takes the norm and its rope, k its rope and cache copy, v its copy: no pass-ending
    /// copies are left.
    #[test]
    fn a_decode_attention_half_folds_into_four_dispatches() {
        let b = bufs();
        let ops = attention_half(&b);
        let steps = plan_run(&ops, 65535, true, true, Matvec::Rows, Scratch::default()).unwrap();
        assert_eq!(shape(&steps), ["fused9", "fused24", "fused16", "attention"]);
        let Step::Dispatch {
            params, buffers, ..
        } = &steps[1]
        else {
            panic!("k is a dispatch");
        };
        // The cache offset in words, the rope's position, base and dimensions.
        assert_eq!(params[4], 3 * 256 / 4);
        assert_eq!(params[5], 17);
        assert_eq!(f32::from_bits(params[6]), 1e4);
        assert_eq!(params[7], 8 | 6 << 16);
        assert_eq!(buffers[4].id(), b.kc.id());
        let Step::Dispatch { params, .. } = &steps[0] else {
            panic!("q is a dispatch");
        };
        assert_eq!(f32::from_bits(params[4]), 1e-5);
    }

    /// The rope and copy are not moved past an op that touches what they touch.
    #[test]
    fn nothing_moves_past_an_op_that_touches_it() {
        let b = bufs();
        let mut ops = attention_half(&b);
        // Something reads k between its product and its rope, and writes the v cache.
        ops.insert(
            4,
            Op::Add(Add {
                a: &b.k,
                b: &b.h,
                out: &b.vc,
                n: 64,
            }),
        );
        let steps = plan_run(&ops, 65535, true, true, Matvec::Rows, Scratch::default()).unwrap();
        assert_eq!(
            shape(&steps),
            [
                "fused9",
                "linear_matvec",
                "linear_matvec",
                "add",
                "rope",
                "copy",
                "copy",
                "attention"
            ]
        );
        // Neox rope and rope tables are the rope kernels' own.
        let mut ops = attention_half(&b);
        let Op::Rope(r) = &mut ops[5] else {
            panic!("rope k")
        };
        r.neox = true;
        let steps = plan_run(&ops, 65535, true, true, Matvec::Rows, Scratch::default()).unwrap();
        assert_eq!(
            shape(&steps),
            [
                "fused9",
                "linear_matvec",
                "fused16",
                "rope",
                "copy",
                "attention"
            ]
        );
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
            let steps = plan_run(ops, 65535, true, true, Matvec::Rows, Scratch::default()).unwrap();
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
        for (name, v) in [
            ("NORM", MODE_NORM),
            ("ADD", MODE_ADD),
            ("SILU", MODE_SILU),
            ("ROPE", MODE_ROPE),
            ("STORE", MODE_STORE),
        ] {
            assert!(
                consts.contains(&(name.to_string(), v)),
                "{name} = {v} in the kernel"
            );
        }
    }
}

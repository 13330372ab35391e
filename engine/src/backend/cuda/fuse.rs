//! Fusing a decode step's ops into fewer launches (`linear_fused*` and `linear_glu*` in
//! kernels/linear.cu): an RMS norm into the matrix-vector products that read its output, the
//! products that share their activations (q, k and v; gate and up) into one launch, and what
//! follows them into its epilogue: rope and the copies into the KV cache, a residual add, or
//! silu(gate) * up.
//!
//! A step of SmolLM2-135M goes from 17 launches per layer to 5. Fusion is the backend's own
//! affair: the model and the other backends see the same ops, and a fused launch writes every
//! buffer the ops would have written (the norm's output, q, k, v, gate and up included), so
//! the results are those of the ops run one by one. Whatever could make them differ (a buffer
//! written by one block while another reads it) is refused here, and those ops run as they
//! are. Pure logic: tested without a GPU.

use super::launch::{DECODE_MAX_TOKENS, Kernel, Launch, ModuleKey, lane_step, words};
use crate::backend::Buffer;
use crate::kernels::op::{params, row_bytes};
use crate::kernels::{self, Op};
use crate::quant::GgmlType;

/// The norm's staged activations live in dynamic shared memory, which needs no opt-in up to
/// 48 KiB: rows of up to 12,288 floats (Llama-3-70B's are 8,192).
const MAX_STAGE_BYTES: u64 = 48 * 1024;

params!(
    /// What every fused kernel (`linear_fused`, `linear_fused_split`, `linear_glu`,
    /// `linear_glu_split`: one body in kernels/linear.cu) reads: the products' shapes, which
    /// parts are fused (`flags`), the norm's epsilon, the rope, and the word offset in the KV
    /// cache where each product is also written. Unused members are zero.
    FusedLinearParams {
        rows0: u32,
        cols: u32,
        tokens: u32,
        row_bytes: u32,
        rows1: u32,
        rows2: u32,
        flags: u32,
        eps: f32,
        pos0: u32,
        freq_base: f32,
        head_dim: u32,
        rope_dim: u32,
        cache0: u32,
        cache1: u32,
        cache2: u32,
        _pad: u32,
    }
);

/// Bits of `FusedLinearParams::flags` (kernels/linear.cu).
const FUSE_NORM: u32 = 1;
const FUSE_RESID: u32 = 2;
const FUSE_ROPE: u32 = 4;
const FUSE_CACHE: u32 = 32;

/// Rows per block of the matrix-vector kernels (MATVEC_ROWS in kernels/linear.cu).
const ROWS_PER_BLOCK: u32 = 8;

/// One matrix of a fused launch.
#[derive(Debug, Clone)]
pub(crate) struct Product<'a> {
    pub w: &'a Buffer,
    pub y: &'a Buffer,
    pub rows: u32,
    pub rope: bool,
    /// Also written to this buffer at this word offset (a KV-cache copy).
    pub cache: Option<(&'a Buffer, u32)>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Rope {
    pub pos0: u32,
    pub freq_base: f32,
    pub head_dim: u32,
    pub rope_dim: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct Norm<'a> {
    pub x: &'a Buffer,
    pub weight: &'a Buffer,
    pub y: &'a Buffer,
    pub eps: f32,
}

#[derive(Debug, Clone)]
pub(crate) enum Epilogue<'a> {
    None,
    /// `out = res + y0`.
    Residual {
        res: &'a Buffer,
        out: &'a Buffer,
    },
    /// `out = silu(y0) * y1`.
    Glu {
        out: &'a Buffer,
    },
}

/// Ops that run as one launch.
#[derive(Debug, Clone)]
pub(crate) struct Fused<'a> {
    /// What the products read: the norm's input when there is a norm.
    pub x: &'a Buffer,
    pub wtype: GgmlType,
    pub cols: u32,
    pub tokens: u32,
    pub norm: Option<Norm<'a>>,
    pub products: Vec<Product<'a>>,
    pub rope: Option<Rope>,
    pub epilogue: Epilogue<'a>,
    /// How many ops this replaces.
    pub ops: usize,
}

/// A run's ops after fusion, in order.
#[derive(Debug)]
pub(crate) enum Item<'o, 'a> {
    One(&'o Op<'a>),
    Fused(Fused<'a>),
}

/// `norms`: whether RMS norms are fused too (each block then normalizes the activations
/// itself).
pub(crate) fn fuse<'o, 'a>(ops: &'o [Op<'a>], norms: bool) -> Vec<Item<'o, 'a>> {
    let mut out = Vec::with_capacity(ops.len());
    let mut i = 0;
    while i < ops.len() {
        match fuse_at(&ops[i..], norms) {
            Some(f) => {
                i += f.ops;
                out.push(Item::Fused(f));
            }
            None => {
                out.push(Item::One(&ops[i]));
                i += 1;
            }
        }
    }
    out
}

fn same(a: &Buffer, b: &Buffer) -> bool {
    a.id() == b.id()
}

fn none_of(b: &Buffer, others: &[&Buffer]) -> bool {
    others.iter().all(|o| !same(b, o))
}

/// The longest fusable sequence at the start of `ops`, if it replaces more than one plain
/// launch's worth of work.
fn fuse_at<'a>(ops: &[Op<'a>], norms: bool) -> Option<Fused<'a>> {
    let mut at = 0;
    let norm = match ops.first()? {
        Op::RmsNorm(_) if !norms => return None,
        Op::RmsNorm(kernels::RmsNorm {
            x,
            weight,
            y,
            dim,
            tokens,
            eps,
        }) => {
            // In place, the first block's copy of the output would race the others' reads;
            // the kernel stages rows as float4s.
            if same(x, y) || u64::from(*dim) * 4 > MAX_STAGE_BYTES || dim % 4 != 0 {
                return None;
            }
            at = 1;
            Some((
                Norm {
                    x,
                    weight,
                    y,
                    eps: *eps,
                },
                *dim,
                *tokens,
            ))
        }
        _ => None,
    };
    let Some(Op::Linear(kernels::Linear {
        x,
        wtype,
        cols,
        tokens,
        ..
    })) = ops.get(at)
    else {
        return None;
    };
    let (x, wtype, cols, tokens) = (*x, *wtype, *cols, *tokens);
    if tokens == 0 || tokens > DECODE_MAX_TOKENS {
        return None;
    }
    // Several tokens of long rows: the fused split kernels read the weights once per token,
    // the plain several-token kernel once for up to four, which is worth more than the
    // launches fusion saves (8B shape, 4 sequences at once on an H100: 544 tok/s unfused,
    // 452 fused). Short rows keep fusing (135M: 2,324 fused, 1,848 not).
    if tokens > 1 && cols / lane_step(wtype) >= super::launch::SPLIT_MIN_STEPS {
        return None;
    }
    if let Some((n, dim, nt)) = &norm
        && (!same(n.y, x) || *dim != cols || *nt != tokens)
    {
        return None;
    }
    // Everything the launch reads, which nothing it writes may be.
    let mut inputs: Vec<&Buffer> = vec![x];
    if let Some((n, _, _)) = &norm {
        inputs.extend([n.x, n.weight]);
    }
    let mut written: Vec<&Buffer> = norm.iter().map(|(n, _, _)| n.y).collect();
    let mut products: Vec<Product<'a>> = Vec::new();
    while products.len() < 3 {
        let Some(Op::Linear(kernels::Linear {
            w,
            wtype: t,
            x: lx,
            y,
            rows,
            cols: c,
            tokens: tk,
        })) = ops.get(at)
        else {
            break;
        };
        if !same(lx, x) || *t != wtype || *c != cols || *tk != tokens || *rows == 0 {
            break;
        }
        if !none_of(y, &inputs) || !none_of(y, &written) || products.iter().any(|p| same(w, p.y)) {
            break;
        }
        inputs.push(w);
        written.push(y);
        products.push(Product {
            w,
            y,
            rows: *rows,
            rope: false,
            cache: None,
        });
        at += 1;
    }
    if products.is_empty() {
        return None;
    }
    let mut rope: Option<Rope> = None;
    let mut epilogue = Epilogue::None;
    match (products.len(), ops.get(at)) {
        (2, Some(Op::SiluMul(kernels::SiluMul { gate, up, out, n })))
            if same(gate, products[0].y)
                && same(up, products[1].y)
                && products[0].rows == products[1].rows
                && u64::from(*n) == u64::from(products[0].rows) * u64::from(tokens)
                && none_of(out, &inputs)
                && none_of(out, &written) =>
        {
            epilogue = Epilogue::Glu { out };
            at += 1;
        }
        (1, Some(Op::Add(kernels::Add { a, b, out, n })))
            if u64::from(*n) == u64::from(products[0].rows) * u64::from(tokens) =>
        {
            let y = products[0].y;
            let res = match (same(a, y), same(b, y)) {
                (false, true) => Some(*a),
                (true, false) => Some(*b),
                _ => None,
            };
            // The residual is read and `out` written by the thread that writes y0's element,
            // so either may be y0 itself, but nothing else the launch reads or writes.
            let mut others = inputs.clone();
            others.extend(norm.iter().map(|(n, _, _)| n.y));
            if let Some(res) = res
                && none_of(out, &others)
                && norm.iter().all(|(n, _, _)| !same(res, n.y))
            {
                epilogue = Epilogue::Residual { res, out };
                at += 1;
            }
        }
        _ => {
            // Rope on the products, then copies of them, in the order the ops give: a copy
            // ends what can follow for its product.
            let mut caches: Vec<&Buffer> = Vec::new();
            while let Some(op) = ops.get(at) {
                match *op {
                    Op::Rope(kernels::Rope {
                        x: rx,
                        heads,
                        head_dim,
                        rope_dim,
                        tokens: tk,
                        pos0,
                        freq_base,
                        neox: false,
                        factors: None,
                        positions: None,
                    }) => {
                        let Some(p) = products.iter_mut().find(|p| same(p.y, rx)) else {
                            break;
                        };
                        let r = Rope {
                            pos0,
                            freq_base,
                            head_dim,
                            rope_dim,
                        };
                        if p.rope
                            || p.cache.is_some()
                            || tk != tokens
                            || u64::from(heads) * u64::from(head_dim) != u64::from(p.rows)
                            || head_dim % 2 != 0
                            || rope_dim % 2 != 0
                            || rope_dim > head_dim
                            || rope.is_some_and(|o| o != r)
                        {
                            break;
                        }
                        p.rope = true;
                        rope = Some(r);
                    }
                    Op::Copy(kernels::BufferCopy {
                        src,
                        src_offset: 0,
                        dst,
                        dst_offset,
                        bytes,
                    }) => {
                        let Some(p) = products.iter_mut().find(|p| same(p.y, src)) else {
                            break;
                        };
                        let n = u64::from(p.rows) * u64::from(tokens);
                        let word = dst_offset / 4;
                        if p.cache.is_some()
                            || bytes != n * 4
                            || dst_offset % 4 != 0
                            || word + n > u64::from(u32::MAX)
                            || !none_of(dst, &inputs)
                            || !none_of(dst, &written)
                            || !none_of(dst, &caches)
                        {
                            break;
                        }
                        caches.push(dst);
                        p.cache = Some((dst, word as u32));
                    }
                    _ => break,
                }
                at += 1;
            }
        }
    }
    // A lone product with nothing fused runs as the plain kernel.
    if at == 1 {
        return None;
    }
    Some(Fused {
        x: norm.as_ref().map_or(x, |(n, _, _)| n.x),
        wtype,
        cols,
        tokens,
        norm: norm.map(|(n, _, _)| n),
        products,
        rope,
        epilogue,
        ops: at,
    })
}

/// The launch of a fused group (kernels/linear.cu documents the parameters and buffers), with
/// at most `max_blocks` blocks: each loops over row groups.
pub(crate) fn plan<'a>(f: &Fused<'a>, max_blocks: u32) -> Launch<'a> {
    let split = f.cols / lane_step(f.wtype) >= super::launch::SPLIT_MIN_STEPS;
    let glu = matches!(f.epilogue, Epilogue::Glu { .. });
    let kernel = match (glu, split) {
        (false, false) => Kernel::LinearFused,
        (false, true) => Kernel::LinearFusedSplit,
        (true, false) => Kernel::LinearGlu,
        (true, true) => Kernel::LinearGluSplit,
    };
    let per_block = if glu {
        ROWS_PER_BLOCK / 2
    } else {
        ROWS_PER_BLOCK
    };
    let blocks: u32 = if glu {
        f.products[0].rows.div_ceil(per_block)
    } else {
        f.products.iter().map(|p| p.rows.div_ceil(per_block)).sum()
    };
    let rows = |m: usize| f.products.get(m).map_or(0, |p| p.rows);
    let mut flags = 0;
    let mut aux: [&'a Buffer; 3] = [f.x; 3];
    if f.norm.is_some() {
        flags |= FUSE_NORM;
    }
    let mut cache_words = [0u32; 3];
    for (m, p) in f.products.iter().enumerate() {
        if p.rope {
            flags |= FUSE_ROPE << m;
        }
        if let Some((dst, word)) = p.cache {
            flags |= FUSE_CACHE << m;
            aux[m] = dst;
            cache_words[m] = word;
        }
    }
    match f.epilogue {
        Epilogue::None => {}
        Epilogue::Residual { res, out } => {
            flags |= FUSE_RESID;
            aux[0] = res;
            aux[1] = out;
        }
        Epilogue::Glu { out } => aux[0] = out,
    }
    let rope = f.rope.unwrap_or(Rope {
        pos0: 0,
        freq_base: 0.0,
        head_dim: 0,
        rope_dim: 0,
    });
    let norm = f.norm.as_ref();
    let product = |m: usize| f.products.get(m).map_or((f.x, f.x), |p| (p.w, p.y));
    let (w0, y0) = product(0);
    let (w1, y1) = product(1);
    let (w2, y2) = product(2);
    let params = FusedLinearParams {
        rows0: rows(0),
        cols: f.cols,
        tokens: f.tokens,
        row_bytes: row_bytes(f.wtype, f.cols),
        rows1: rows(1),
        rows2: rows(2),
        flags,
        eps: norm.map_or(0.0, |n| n.eps),
        pos0: rope.pos0,
        freq_base: rope.freq_base,
        head_dim: rope.head_dim,
        rope_dim: rope.rope_dim,
        cache0: cache_words[0],
        cache1: cache_words[1],
        cache2: cache_words[2],
        _pad: 0,
    };
    Launch {
        kernel,
        module: ModuleKey::Weights(f.wtype),
        grid: [blocks.min(max_blocks.max(1)), f.tokens, 1],
        block: [256, 1, 1],
        shared: if f.norm.is_some() { f.cols * 4 } else { 0 },
        scratch: 0,
        staging: 0,
        buffers: vec![
            f.x,
            norm.map_or(f.x, |n| n.weight),
            norm.map_or(f.x, |n| n.y),
            w0,
            y0,
            w1,
            y1,
            w2,
            y2,
            aux[0],
            aux[1],
            aux[2],
        ],
        params: words(&params),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Device;

    fn cpu() -> Device {
        Device::new_cpu(crate::device::info::describe_cpu())
    }

    fn fused_params(l: &Launch) -> FusedLinearParams {
        let size = std::mem::size_of::<FusedLinearParams>();
        bytemuck::pod_read_unaligned(&bytemuck::cast_slice(&l.params)[..size])
    }

    /// The fused kernels read the struct at the start of their 16 words, member for member
    /// as common.cuh declares it (NVRTC compiles that only on a GPU machine).
    #[test]
    fn the_fused_params_are_the_cuda_struct_and_fill_a_launch_s_words() {
        use crate::kernels::op::cuda_declarations::{c_structs, same};
        let c = c_structs(crate::kernels::op::cuda_declarations::COMMON);
        assert_eq!(same::<FusedLinearParams>(&c), Ok(()));
        assert_eq!(
            std::mem::size_of::<FusedLinearParams>(),
            super::super::launch::PARAM_WORDS * 4
        );
    }

    struct Bufs {
        h: Buffer,
        xn: Buffer,
        nw: Buffer,
        wq: Buffer,
        wk: Buffer,
        wv: Buffer,
        q: Buffer,
        k: Buffer,
        v: Buffer,
        kc: Buffer,
        vc: Buffer,
        att: Buffer,
        o: Buffer,
        g: Buffer,
        u: Buffer,
        a: Buffer,
    }

    fn bufs(d: &Device) -> Bufs {
        let b = |l: &str| d.alloc(l, 1 << 16).unwrap();
        Bufs {
            h: b("h"),
            xn: b("xn"),
            nw: b("nw"),
            wq: b("wq"),
            wk: b("wk"),
            wv: b("wv"),
            q: b("q"),
            k: b("k"),
            v: b("v"),
            kc: b("kc"),
            vc: b("vc"),
            att: b("att"),
            o: b("o"),
            g: b("g"),
            u: b("u"),
            a: b("a"),
        }
    }

    /// A Llama layer's ops as the model encodes them (model/shard.rs), 64 wide, 2 heads of 32
    /// (one kv head), ffn 128.
    fn layer<'a>(b: &'a Bufs, tokens: u32, pos0: u32) -> Vec<Op<'a>> {
        let lin = |w, x, y, rows, cols| {
            Op::Linear(kernels::Linear {
                w,
                wtype: GgmlType::Q4_1,
                x,
                y,
                rows,
                cols,
                tokens,
            })
        };
        let norm = Op::RmsNorm(kernels::RmsNorm {
            x: &b.h,
            weight: &b.nw,
            y: &b.xn,
            dim: 64,
            tokens,
            eps: 1e-5,
        });
        let rope = |x, heads| {
            Op::Rope(kernels::Rope {
                x,
                heads,
                head_dim: 32,
                rope_dim: 32,
                tokens,
                pos0,
                freq_base: 10000.0,
                neox: false,
                factors: None,
                positions: None,
            })
        };
        let copy = |src, dst| {
            Op::Copy(kernels::BufferCopy {
                src,
                src_offset: 0,
                dst,
                dst_offset: u64::from(pos0) * 32 * 4,
                bytes: u64::from(tokens) * 32 * 4,
            })
        };
        vec![
            norm,
            lin(&b.wq, &b.xn, &b.q, 64, 64),
            lin(&b.wk, &b.xn, &b.k, 32, 64),
            lin(&b.wv, &b.xn, &b.v, 32, 64),
            rope(&b.q, 2),
            rope(&b.k, 1),
            copy(&b.k, &b.kc),
            copy(&b.v, &b.vc),
            Op::Attention(kernels::Attention {
                q: &b.q,
                k_cache: &b.kc,
                v_cache: &b.vc,
                out: &b.att,
                heads: 2,
                kv_heads: 1,
                head_dim: 32,
                tokens,
                pos0,
                scale: 0.1,
                window: 0,
                softcap: 0.0,
            }),
            lin(&b.wq, &b.att, &b.o, 64, 64),
            Op::Add(kernels::Add {
                a: &b.h,
                b: &b.o,
                out: &b.h,
                n: 64 * tokens,
            }),
            norm,
            lin(&b.wk, &b.xn, &b.g, 128, 64),
            lin(&b.wv, &b.xn, &b.u, 128, 64),
            Op::SiluMul(kernels::SiluMul {
                gate: &b.g,
                up: &b.u,
                out: &b.a,
                n: 128 * tokens,
            }),
            lin(&b.wq, &b.a, &b.o, 64, 128),
            Op::Add(kernels::Add {
                a: &b.h,
                b: &b.o,
                out: &b.h,
                n: 64 * tokens,
            }),
        ]
    }

    fn shape(items: &[Item]) -> Vec<String> {
        items
            .iter()
            .map(|i| match i {
                Item::One(op) => op.name().to_string(),
                Item::Fused(f) => format!("fused{}", f.ops),
            })
            .collect()
    }

    #[test]
    fn a_decode_layer_is_five_launches() {
        let d = cpu();
        let b = bufs(&d);
        let ops = layer(&b, 1, 7);
        let items = fuse(&ops, true);
        assert_eq!(
            shape(&items),
            ["fused8", "attention", "fused2", "fused4", "fused2"]
        );
        let Item::Fused(qkv) = &items[0] else {
            unreachable!()
        };
        assert!(qkv.norm.is_some() && qkv.products.len() == 3);
        assert_eq!(
            qkv.products.iter().map(|p| p.rope).collect::<Vec<_>>(),
            [true, true, false]
        );
        assert_eq!(
            qkv.products
                .iter()
                .map(|p| p.cache.map(|(_, w)| w))
                .collect::<Vec<_>>(),
            [None, Some(7 * 32), Some(7 * 32)]
        );
        let l = plan(qkv, u32::MAX);
        assert_eq!(l.kernel, Kernel::LinearFused, "64 columns: a warp per row");
        assert_eq!(l.grid, [8 + 4 + 4, 1, 1]);
        assert_eq!(l.shared, 64 * 4);
        let p = fused_params(&l);
        assert_eq!(
            p.flags,
            FUSE_NORM | FUSE_ROPE | (FUSE_ROPE << 1) | (0b110 * FUSE_CACHE)
        );
        assert_eq!(
            (p.rows0, p.rows1, p.rows2, p.cols, p.tokens, p.row_bytes),
            (64, 32, 32, 64, 1, 40)
        );
        assert_eq!((p.pos0, p.head_dim, p.rope_dim), (7, 32, 32), "the rope");
        assert_eq!((p.eps, p.freq_base), (1e-5, 10000.0));
        assert_eq!((p.cache0, p.cache1, p.cache2), (0, 7 * 32, 7 * 32));
        let Item::Fused(glu) = &items[3] else {
            unreachable!()
        };
        let l = plan(glu, 16);
        assert_eq!(l.kernel, Kernel::LinearGlu);
        assert_eq!(
            l.grid,
            [16, 1, 1],
            "32 groups of 4 rows of gate and up, at most 16 blocks"
        );
        let Item::Fused(o) = &items[2] else {
            unreachable!()
        };
        assert_eq!(fused_params(&plan(o, u32::MAX)).flags, FUSE_RESID);
    }

    #[test]
    fn several_tokens_of_long_rows_are_not_fused() {
        let d = cpu();
        let x = d.alloc("x", 1 << 16).unwrap();
        let (nw, xn, w, y) = (
            d.alloc("nw", 1 << 16).unwrap(),
            d.alloc("xn", 1 << 16).unwrap(),
            d.alloc("w", 1 << 16).unwrap(),
            d.alloc("y", 1 << 16).unwrap(),
        );
        let ops = |tokens| {
            vec![
                Op::RmsNorm(kernels::RmsNorm {
                    x: &x,
                    weight: &nw,
                    y: &xn,
                    dim: 2048,
                    tokens,
                    eps: 1e-5,
                }),
                Op::Linear(kernels::Linear {
                    w: &w,
                    wtype: GgmlType::Q4_1,
                    x: &xn,
                    y: &y,
                    rows: 64,
                    cols: 2048,
                    tokens,
                }),
            ]
        };
        // 2048 columns are 256 lane steps: the split kernels.
        assert!(matches!(fuse(&ops(1), true)[..], [Item::Fused(_)]));
        assert!(
            fuse(&ops(2), true)
                .iter()
                .all(|i| matches!(i, Item::One(_))),
            "two tokens take the several-token kernel, which reads the weights once"
        );
    }

    #[test]
    fn prefill_is_not_fused() {
        let d = cpu();
        let b = bufs(&d);
        let ops = layer(&b, DECODE_MAX_TOKENS + 1, 0);
        assert!(fuse(&ops, true).iter().all(|i| matches!(i, Item::One(_))));
        let ops = layer(&b, DECODE_MAX_TOKENS, 0);
        assert_eq!(
            fuse(&ops, true).len(),
            5,
            "up to {DECODE_MAX_TOKENS} tokens fuse"
        );
        assert_eq!(
            shape(&fuse(&ops, false)),
            [
                "rmsnorm",
                "fused7",
                "attention",
                "fused2",
                "rmsnorm",
                "fused3",
                "fused2"
            ],
            "norms left out"
        );
    }

    /// A batch of sequences (continuous batching): ropes at per-token positions stay plain
    /// launches (the fused kernel has one pos0), and the pool writes and paged attention
    /// end the fused group.
    #[test]
    fn a_batched_decode_layer_fuses_its_products_only() {
        let d = cpu();
        let b = bufs(&d);
        let tokens = 3;
        let ops = layer(&b, tokens, 0);
        let rope = |x, heads| {
            Op::Rope(kernels::Rope {
                x,
                heads,
                head_dim: 32,
                rope_dim: 32,
                tokens,
                pos0: 0,
                freq_base: 10000.0,
                neox: false,
                factors: None,
                positions: Some(&b.a),
            })
        };
        let mut batched = ops[..4].to_vec();
        batched.extend([
            rope(&b.q, 2),
            rope(&b.k, 1),
            Op::KvStore(kernels::KvStore {
                k: &b.k,
                v: &b.v,
                slots: &b.g,
                k_pool: &b.kc,
                v_pool: &b.vc,
                kv_dim: 32,
                tokens,
                pool_slots: 64,
            }),
            Op::PagedAttention(kernels::PagedAttention {
                q: &b.q,
                k_pool: &b.kc,
                v_pool: &b.vc,
                rows: &b.u,
                table: &b.o,
                out: &b.att,
                heads: 2,
                kv_heads: 1,
                head_dim: 32,
                tokens,
                block: 16,
                pool_blocks: 4,
                table_len: 8,
                scale: 0.1,
                window: 0,
                softcap: 0.0,
            }),
        ]);
        batched.extend_from_slice(&ops[9..]);
        let items = fuse(&batched, true);
        assert_eq!(
            shape(&items),
            [
                "fused4",
                "rope",
                "rope",
                "kv_store",
                "paged_attention",
                "fused2",
                "fused4",
                "fused2"
            ]
        );
        let Item::Fused(qkv) = &items[0] else {
            unreachable!()
        };
        assert!(qkv.rope.is_none());
        assert!(qkv.products.iter().all(|p| !p.rope && p.cache.is_none()));
    }

    #[test]
    fn what_would_race_or_reorder_is_left_alone() {
        let d = cpu();
        let b = bufs(&d);
        let lin = |x, y| {
            Op::Linear(kernels::Linear {
                w: &b.wq,
                wtype: GgmlType::Q4_1,
                x,
                y,
                rows: 64,
                cols: 64,
                tokens: 1,
            })
        };
        // A norm in place: its first block's copy would race the others' reads.
        let ops = [
            Op::RmsNorm(kernels::RmsNorm {
                x: &b.h,
                weight: &b.nw,
                y: &b.h,
                dim: 64,
                tokens: 1,
                eps: 1e-5,
            }),
            lin(&b.h, &b.q),
        ];
        assert_eq!(shape(&fuse(&ops, true)), ["rmsnorm", "matvec"]);
        // A residual add into the product's own input.
        let ops = [
            lin(&b.att, &b.o),
            Op::Add(kernels::Add {
                a: &b.att,
                b: &b.o,
                out: &b.att,
                n: 64,
            }),
        ];
        assert_eq!(shape(&fuse(&ops, true)), ["matvec", "add"]);
        // A copy before the rope of the same product keeps the rope out.
        let ops = [
            lin(&b.xn, &b.k),
            Op::Copy(kernels::BufferCopy {
                src: &b.k,
                src_offset: 0,
                dst: &b.kc,
                dst_offset: 0,
                bytes: 256,
            }),
            Op::Rope(kernels::Rope {
                x: &b.k,
                heads: 2,
                head_dim: 32,
                rope_dim: 32,
                tokens: 1,
                pos0: 0,
                freq_base: 1e4,
                neox: false,
                factors: None,
                positions: None,
            }),
        ];
        assert_eq!(shape(&fuse(&ops, true)), ["fused2", "rope"]);
        // A copy of part of a product is not its cache write.
        let ops = [
            lin(&b.xn, &b.k),
            Op::Copy(kernels::BufferCopy {
                src: &b.k,
                src_offset: 0,
                dst: &b.kc,
                dst_offset: 0,
                bytes: 128,
            }),
        ];
        assert_eq!(shape(&fuse(&ops, true)), ["matvec", "copy"]);
        // A second product that reads the first one's output is a separate step.
        let ops = [lin(&b.xn, &b.q), lin(&b.q, &b.k)];
        assert_eq!(shape(&fuse(&ops, true)), ["matvec", "matvec"]);
    }
}

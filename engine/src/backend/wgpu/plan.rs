//! How each op maps onto WGSL kernels: pipeline, bindings and grid; the parameters are the
//! op's own `Params`, written as they are.

use cairn_shaders::{self as shaders, Kernel};

use crate::backend::{BackendError, Buffer, Result};
use crate::kernels::{
    Add, AddBias, Argmax, Attention, BufferCopy, Embed, GeluMul, KvStore, Linear, MatMul, Op,
    OpSpec, PagedAttention, RmsNorm, Rope, Sample, ScaleCap, SiluMul, Softmax, with_op,
};
use crate::options::{WgpuPrefill, WgpuPromptAttention};

/// One GPU command of a submission.
pub(crate) enum Step<'a> {
    Dispatch {
        kernel: Kernel,
        format: Option<&'static str>,
        /// Bound at bindings 1.. in order (binding 0 is the parameters).
        buffers: Vec<&'a Buffer>,
        params: [u32; super::PARAM_WORDS],
        groups: [u32; 3],
    },
    Copy {
        src: &'a Buffer,
        src_offset: u64,
        dst: &'a Buffer,
        dst_offset: u64,
        bytes: u64,
    },
}

/// Spreads `n` workgroups over x and y so neither passes the per-dimension limit; kernels
/// recover the linear index as `wid.y * num_workgroups.x + wid.x`.
pub(super) fn grid(n: u32, max_dim: u32) -> Result<[u32; 3]> {
    let n = n.max(1);
    let x = n.min(max_dim);
    let y = n.div_ceil(x);
    if y > max_dim {
        return Err(BackendError::Unsupported(format!(
            "{n} workgroups exceed the device's {max_dim} x {max_dim} grid"
        )));
    }
    Ok([x, y, 1])
}

/// Which matrix-vector kernels run one-token products and small batches
/// (`WgpuMatvec`, resolved for a device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Matvec {
    /// `linear_matvec` (and `linear_matvec_fused`): 32 invocations a row, one token.
    Rows,
    /// The streaming kernels (`stream_walk.wgsl`), up to [`Matvec::BATCH_MAX`] tokens a pass;
    /// with `int8`, the formats of `shaders::INT8_FORMATS` on packed 8-bit integers
    /// (`quantize_q8` then `stream_walk_i8.wgsl`).
    /// With `wide`, one-token products (fused or not) run the wide kernels
    /// (`LINEAR_MATVEC_WIDE*`) of that shape instead.
    Stream {
        subgroups: bool,
        int8: bool,
        wide: Option<Wide>,
    },
}

/// The wide kernels' shape on a device (`WgpuMatvec::Wide`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Wide {
    pub(crate) shape: shaders::WideShape,
    /// Q8_0, Q4_0 and Q4_1 on int8 activations and packed dot products (the device has them).
    pub(crate) dot: bool,
    /// Q8_0 products stay on the streaming kernels (`auto`'s choice: on an H200 the wide walk
    /// read Q8_0 2% to 9% slower than `subgroup`, docs/performance.md, session 18).
    pub(crate) stream_q8_0: bool,
}

impl Matvec {
    /// Tokens the streaming batch kernel takes in one pass (two token groups of
    /// `BATCH_TOKENS`); more go to `linear_matmat`.
    pub(crate) const BATCH_MAX: u32 = 2 * shaders::BATCH_TOKENS;
    /// Rows a workgroup of the streaming kernels takes (`ROWS` in stream_walk.wgsl).
    pub(crate) const STREAM_ROWS: u32 = 4;

    pub(crate) fn decode_rows_per_pass(self) -> usize {
        match self {
            Matvec::Rows => 1,
            Matvec::Stream { .. } => Matvec::BATCH_MAX as usize,
        }
    }

    /// Whether the streaming kernels take rows of `cols` elements (chunks of 8; the block
    /// formats' rows are whole blocks already).
    pub(crate) fn streams(self, cols: u32) -> bool {
        matches!(self, Matvec::Stream { .. }) && cols.is_multiple_of(8)
    }

    /// The shape the wide kernels are generated for (the default's where they do not run).
    pub(crate) fn wide_shape(self) -> shaders::WideShape {
        match self {
            Matvec::Stream { wide: Some(w), .. } => w.shape,
            _ => shaders::WideShape::default(),
        }
    }

    /// The wide kernel (`fused` or plain) and its rows per workgroup for a product of
    /// `tokens` tokens over rows of `cols` elements in `format`, where one runs it: one token,
    /// rows of a multiple of 8 with at least a chunk of 8 per invocation (shorter rows, such
    /// as the 135M model's 576 and 1536, left most of a 256-wide workgroup idle and measured
    /// slower than the streaming kernels: 293 against 305 and 357 tok/s on an H200), the wide
    /// kernels on.
    pub(crate) fn wide_for(
        self,
        tokens: u32,
        cols: u32,
        format: &str,
        fused: bool,
    ) -> Option<(Kernel, u32)> {
        let Matvec::Stream { wide: Some(w), .. } = self else {
            return None;
        };
        if tokens != 1
            || !cols.is_multiple_of(8)
            || cols / 8 < w.shape.wg
            || (w.stream_q8_0 && format == "Q8_0")
        {
            return None;
        }
        let int8 = w.dot && shaders::INT8_FORMATS.contains(&format);
        let kernel = match (fused, int8) {
            (false, false) => shaders::LINEAR_MATVEC_WIDE,
            (false, true) => shaders::LINEAR_MATVEC_WIDE_I8,
            (true, false) => shaders::LINEAR_MATVEC_FUSED_WIDE,
            (true, true) => shaders::LINEAR_MATVEC_FUSED_WIDE_I8,
        };
        Some((kernel, w.shape.rows))
    }

    /// The kernel of the streaming family for this reduction: (workgroup memory, subgroups).
    pub(crate) fn pick(self, kernels: (Kernel, Kernel)) -> Kernel {
        match self {
            Matvec::Stream {
                subgroups: true, ..
            } => kernels.1,
            _ => kernels.0,
        }
    }

    /// Whether `l` runs on the packed-integer kernels (a product of at most
    /// [`Matvec::BATCH_MAX`] tokens in one of their formats, when they are on).
    pub(crate) fn int8_for(self, l: &Linear<'_>) -> bool {
        matches!(self, Matvec::Stream { int8: true, .. })
            && l.tokens <= Matvec::BATCH_MAX
            && l.rows > 0
            && l.cols > 0
            && shaders::INT8_FORMATS.contains(&l.wtype.name())
    }

    /// Bytes of `quantize_q8`'s output for `l`: an int8 a column and an f32 step a block, per
    /// token.
    pub(crate) fn int8_scratch_bytes(l: &Linear<'_>) -> u64 {
        u64::from(l.tokens) * (u64::from(l.cols) + u64::from(l.cols / 32) * 4)
    }
}

/// How the wgpu and vulkan backends run one op.
pub(crate) trait WgpuOp<'a>: OpSpec<'a> {
    /// Every kernel the op may dispatch; each declares the op's `Params` at binding 0.
    const KERNELS: &'static [Kernel];

    fn step(&self, max_dim: u32) -> Result<Step<'a>>;
}

pub(crate) fn plan<'a>(op: &Op<'a>, max_dim: u32, matvec: Matvec) -> Result<Step<'a>> {
    match op {
        Op::Linear(l) => l.step_with(max_dim, matvec),
        _ => with_op!(op, o => o.step(max_dim)),
    }
}

/// A dispatch of `kernel` with the op's parameters.
fn dispatch<'a, O: WgpuOp<'a>>(
    op: &O,
    kernel: Kernel,
    format: Option<&'static str>,
    buffers: Vec<&'a Buffer>,
    groups: [u32; 3],
) -> Result<Step<'a>> {
    // Only a listed kernel has its `Params` declaration checked against the op's struct.
    debug_assert!(
        O::KERNELS.contains(&kernel),
        "{} is not in KERNELS",
        kernel.name
    );
    let mut params = [0u32; super::PARAM_WORDS];
    let p = op.params();
    let bytes = bytemuck::bytes_of(&p);
    bytemuck::cast_slice_mut::<u32, u8>(&mut params)[..bytes.len()].copy_from_slice(bytes);
    Ok(Step::Dispatch {
        kernel,
        format,
        buffers,
        params,
        groups,
    })
}

impl<'a> WgpuOp<'a> for MatMul<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::MATMUL];

    fn step(&self, _: u32) -> Result<Step<'a>> {
        let groups = [self.n.div_ceil(32).max(1), self.m.div_ceil(32).max(1), 1];
        dispatch(
            self,
            shaders::MATMUL,
            None,
            vec![self.a, self.b, self.c],
            groups,
        )
    }
}

impl<'a> WgpuOp<'a> for Linear<'a> {
    // The vulkan backend swaps in the subgroup variant of the matrix-vector kernel.
    const KERNELS: &'static [Kernel] = &[
        shaders::LINEAR_MATVEC,
        shaders::LINEAR_MATVEC_SUBGROUP,
        shaders::LINEAR_MATMAT,
        shaders::LINEAR_MATMAT_TILED,
        // Prompt-sized products with `WgpuOptions::prefill` (`prefill` swaps them in).
        shaders::LINEAR_GEMM_128,
        shaders::LINEAR_GEMM_64,
        shaders::LINEAR_GEMM_32,
        shaders::LINEAR_GEMM_COOP,
        shaders::LINEAR_GEMM_COOP_128,
        shaders::LINEAR_GEMM_COOP_64X128,
        shaders::LINEAR_GEMM_COOP_64K64,
        shaders::LINEAR_MATVEC_STREAM,
        shaders::LINEAR_MATVEC_STREAM_SUBGROUP,
        shaders::LINEAR_MATVEC_BATCH,
        shaders::LINEAR_MATVEC_BATCH_SUBGROUP,
        shaders::QUANTIZE_Q8,
        shaders::LINEAR_MATVEC_STREAM_I8,
        shaders::LINEAR_MATVEC_STREAM_I8_SUBGROUP,
        shaders::LINEAR_MATVEC_BATCH_I8,
        shaders::LINEAR_MATVEC_BATCH_I8_SUBGROUP,
        // Over weights repacked at upload (`repack.rs` swaps them in).
        shaders::LINEAR_MATVEC_STREAM_V4,
        shaders::LINEAR_MATVEC_STREAM_V4_SUBGROUP,
        shaders::LINEAR_MATVEC_BATCH_V4,
        shaders::LINEAR_MATVEC_BATCH_V4_SUBGROUP,
        // One-token products with `WgpuMatvec::Wide`.
        shaders::LINEAR_MATVEC_WIDE,
        shaders::LINEAR_MATVEC_WIDE_I8,
    ];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        self.step_with(max_dim, Matvec::Rows)
    }
}

impl<'a> Linear<'a> {
    fn step_with(&self, max_dim: u32, matvec: Matvec) -> Result<Step<'a>> {
        let (rows, tokens) = (self.rows, self.tokens);
        let wide = matvec.wide_for(tokens, self.cols, self.wtype.name(), false);
        let (kernel, groups) = if let Some((kernel, per)) = wide {
            (kernel, grid(rows.div_ceil(per), max_dim)?)
        } else if tokens <= Matvec::BATCH_MAX && matvec.streams(self.cols) {
            let kernel = if tokens == 1 {
                matvec.pick((
                    shaders::LINEAR_MATVEC_STREAM,
                    shaders::LINEAR_MATVEC_STREAM_SUBGROUP,
                ))
            } else {
                matvec.pick((
                    shaders::LINEAR_MATVEC_BATCH,
                    shaders::LINEAR_MATVEC_BATCH_SUBGROUP,
                ))
            };
            let [x, y, _] = grid(rows.div_ceil(Matvec::STREAM_ROWS), max_dim)?;
            (kernel, [x, y, tokens.div_ceil(shaders::BATCH_TOKENS)])
        } else if tokens == 1 {
            (shaders::LINEAR_MATVEC, grid(rows.div_ceil(8), max_dim)?)
        } else {
            let groups = [rows.div_ceil(32).max(1), tokens.div_ceil(32).max(1), 1];
            (shaders::LINEAR_MATMAT, groups)
        };
        let buffers = vec![self.w, self.x, self.y];
        dispatch(self, kernel, Some(self.wtype.name()), buffers, groups)
    }
}

/// `l` on the packed-integer kernels ([`Matvec::int8_for`]): `quantize_q8` rounds its
/// activations into `scratch` (at least [`Matvec::int8_scratch_bytes`]) unless `quantized`
/// says the same activations are there already, then the product reads them.
pub(crate) fn int8_steps<'a>(
    l: &Linear<'a>,
    max_dim: u32,
    matvec: Matvec,
    scratch: &'a Buffer,
    quantized: bool,
    steps: &mut Vec<Step<'a>>,
) -> Result<()> {
    if !quantized {
        let blocks = l.tokens * (l.cols / 32);
        let groups = grid(blocks.div_ceil(64), max_dim)?;
        let buffers = vec![l.x, scratch];
        steps.push(dispatch(l, shaders::QUANTIZE_Q8, None, buffers, groups)?);
    }
    let kernel = if l.tokens == 1 {
        matvec.pick((
            shaders::LINEAR_MATVEC_STREAM_I8,
            shaders::LINEAR_MATVEC_STREAM_I8_SUBGROUP,
        ))
    } else {
        matvec.pick((
            shaders::LINEAR_MATVEC_BATCH_I8,
            shaders::LINEAR_MATVEC_BATCH_I8_SUBGROUP,
        ))
    };
    let [x, y, _] = grid(l.rows.div_ceil(Matvec::STREAM_ROWS), max_dim)?;
    let groups = [x, y, l.tokens.div_ceil(shaders::BATCH_TOKENS)];
    let buffers = vec![l.w, scratch, l.y];
    steps.push(dispatch(l, kernel, Some(l.wtype.name()), buffers, groups)?);
    Ok(())
}

/// The `linear_gemm_*` tile for a product of `rows` by `tokens`: the largest whose grid still
/// has [`GEMM_MIN_GROUPS`] workgroups (a large tile reuses each staged value more, but fewer
/// workgroups leave multiprocessors idle), else the smallest.
pub(crate) fn gemm_for(rows: u32, tokens: u32) -> Kernel {
    let tiles = [shaders::LINEAR_GEMM_128, shaders::LINEAR_GEMM_64];
    for k in tiles {
        let Some(shape) = k.gemm else { continue };
        if rows.div_ceil(shape.rows()) * tokens.div_ceil(shape.tokens()) >= GEMM_MIN_GROUPS {
            return k;
        }
    }
    shaders::LINEAR_GEMM_32
}

/// The `linear_gemm_coop*` tile for a product of `rows` by `tokens`: 64 x 64 whatever the
/// shape, for now (on an H200 the 8B shape's prefill ran at 2,467 tok/s with it, 2,114 with
/// 128 x 128 tiles, 2,222-2,322 choosing 128 x 128 where the grid kept 128 workgroups).
pub(crate) fn coop_for(_rows: u32, _tokens: u32) -> Kernel {
    shaders::LINEAR_GEMM_COOP
}

/// Workgroups a tile's grid should have before `gemm_for` takes it: about one per
/// multiprocessor of a large GPU (132 on an H100).
pub(crate) const GEMM_MIN_GROUPS: u32 = 128;

/// Query tokens a prompt attention tile takes (`attention_tile.wgsl`'s BQ), and the largest
/// head it holds (MAX_HD).
const PROMPT_TILE_TOKENS: u32 = 16;
const PROMPT_TILE_HEAD_DIM: u32 = 128;

/// `step` with a prompt attention (more query tokens than decode attention's) on the tiles
/// where `choice` (`WgpuOptions::prompt_attention`, resolved for the device) is `Tiles` and
/// heads are at most 128 wide: `attention_tiled` a workgroup per 16 tokens of a head,
/// `paged_attention_tiled` on the same grid as `paged_attention` (its workgroups find their
/// runs). Any other step as it is.
pub(crate) fn prompt_attention(step: Step<'_>, choice: WgpuPromptAttention) -> Step<'_> {
    match step {
        Step::Dispatch {
            kernel,
            format,
            buffers,
            params,
            groups,
        } if choice == WgpuPromptAttention::Tiles
            && (kernel == shaders::ATTENTION || kernel == shaders::PAGED_ATTENTION)
            // Both kernels' parameters start heads, kv_heads, head_dim, tokens.
            && params[2] <= PROMPT_TILE_HEAD_DIM
            && params[3] > super::split_attention::DECODE_TOKENS =>
        {
            let (kernel, groups) = if kernel == shaders::ATTENTION {
                let blocks = params[3].div_ceil(PROMPT_TILE_TOKENS);
                (shaders::ATTENTION_TILED, [groups[0], blocks, 1])
            } else {
                (shaders::PAGED_ATTENTION_TILED, groups)
            };
            Step::Dispatch {
                kernel,
                format,
                buffers,
                params,
                groups,
            }
        }
        other => other,
    }
}

/// `step` with a prompt-sized product (`linear_matmat`) on the kernel `choice` names
/// (`WgpuOptions::prefill`, resolved for the device: `Coop` only where it was opened with
/// cooperative matrices): `linear_matmat_tiled` and `linear_gemm_coop` where its rows are a
/// multiple of 32 elements, a `linear_gemm_*` tile where they are a multiple of its step of
/// columns; any other step, and products those kernels do not take, as they are.
pub(crate) fn prefill(step: Step<'_>, choice: WgpuPrefill) -> Step<'_> {
    match step {
        Step::Dispatch {
            kernel,
            format,
            buffers,
            params,
            groups,
        } if kernel == shaders::LINEAR_MATMAT => {
            // Linear's parameters: rows, cols, tokens, row_bytes.
            let (rows, cols, tokens) = (params[0], params[1], params[2]);
            let kernel = match choice {
                WgpuPrefill::Tiles => shaders::LINEAR_MATMAT_TILED,
                WgpuPrefill::Gemm | WgpuPrefill::ByAdapter => gemm_for(rows, tokens),
                WgpuPrefill::Gemm128 => shaders::LINEAR_GEMM_128,
                WgpuPrefill::Gemm64 => shaders::LINEAR_GEMM_64,
                WgpuPrefill::Gemm32 => shaders::LINEAR_GEMM_32,
                WgpuPrefill::Coop => coop_for(rows, tokens),
                WgpuPrefill::Coop64 => shaders::LINEAR_GEMM_COOP,
                WgpuPrefill::Coop128 => shaders::LINEAR_GEMM_COOP_128,
                WgpuPrefill::Coop64x128 => shaders::LINEAR_GEMM_COOP_64X128,
                WgpuPrefill::Coop64K64 => shaders::LINEAR_GEMM_COOP_64K64,
                WgpuPrefill::Registers => shaders::LINEAR_MATMAT,
            };
            // (rows, tokens) a workgroup takes, and the columns a step.
            let (tile_rows, tile_tokens, step) = match (kernel.gemm, kernel.coop) {
                (Some(g), _) => (g.rows(), g.tokens(), g.bk),
                (None, Some(c)) => (c.rows(), c.tokens(), c.bk),
                _ if kernel == shaders::LINEAR_MATMAT_TILED => (64, 64, 32),
                _ => (0, 0, 0),
            };
            if step == 0 || !cols.is_multiple_of(step) {
                return Step::Dispatch {
                    kernel: shaders::LINEAR_MATMAT,
                    format,
                    buffers,
                    params,
                    groups,
                };
            }
            let groups = [
                rows.div_ceil(tile_rows).max(1),
                tokens.div_ceil(tile_tokens).max(1),
                1,
            ];
            Step::Dispatch {
                kernel,
                format,
                buffers,
                params,
                groups,
            }
        }
        other => other,
    }
}

impl<'a> WgpuOp<'a> for RmsNorm<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::RMSNORM];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        let buffers = vec![self.x, self.weight, self.y];
        dispatch(
            self,
            shaders::RMSNORM,
            None,
            buffers,
            grid(self.tokens, max_dim)?,
        )
    }
}

impl<'a> WgpuOp<'a> for Rope<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::ROPE, shaders::ROPE_TABLES];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        let pairs = self.tokens * self.heads * (self.rope_dim / 2);
        let groups = grid(pairs.div_ceil(256), max_dim)?;
        // An absent table is bound to the present one, which the kernel then never reads: both
        // are read-only there, and `x` (written) must not be bound twice (browsers refuse it).
        match self.factors.or(self.positions) {
            Some(table) => {
                let buffers = vec![
                    self.x,
                    self.factors.unwrap_or(table),
                    self.positions.unwrap_or(table),
                ];
                dispatch(self, shaders::ROPE_TABLES, None, buffers, groups)
            }
            None => dispatch(self, shaders::ROPE, None, vec![self.x], groups),
        }
    }
}

impl<'a> WgpuOp<'a> for AddBias<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::ADD_BIAS];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        let groups = grid((self.cols * self.tokens).div_ceil(256), max_dim)?;
        dispatch(
            self,
            shaders::ADD_BIAS,
            None,
            vec![self.x, self.bias],
            groups,
        )
    }
}

impl<'a> WgpuOp<'a> for Softmax<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::SOFTMAX];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        dispatch(
            self,
            shaders::SOFTMAX,
            None,
            vec![self.x],
            grid(self.rows, max_dim)?,
        )
    }
}

impl<'a> WgpuOp<'a> for SiluMul<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::SILU_MUL];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        let groups = grid(self.n.div_ceil(256), max_dim)?;
        let buffers = vec![self.gate, self.up, self.out];
        dispatch(self, shaders::SILU_MUL, None, buffers, groups)
    }
}

impl<'a> WgpuOp<'a> for GeluMul<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::GELU_MUL];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        let groups = grid(self.n.div_ceil(256), max_dim)?;
        let buffers = vec![self.gate, self.up, self.out];
        dispatch(self, shaders::GELU_MUL, None, buffers, groups)
    }
}

impl<'a> WgpuOp<'a> for ScaleCap<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::SCALE_CAP];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        let groups = grid(self.n.div_ceil(256), max_dim)?;
        dispatch(self, shaders::SCALE_CAP, None, vec![self.x], groups)
    }
}

impl<'a> WgpuOp<'a> for Add<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::ADD, shaders::ADD_INPLACE];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        let groups = grid(self.n.div_ceil(256), max_dim)?;
        match self.in_place_other() {
            Some(other) => dispatch(
                self,
                shaders::ADD_INPLACE,
                None,
                vec![self.out, other],
                groups,
            ),
            None => dispatch(
                self,
                shaders::ADD,
                None,
                vec![self.a, self.b, self.out],
                groups,
            ),
        }
    }
}

impl<'a> WgpuOp<'a> for Embed<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::EMBED];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        let groups = grid((self.dim * self.tokens).div_ceil(256), max_dim)?;
        let buffers = vec![self.table, self.ids, self.out];
        dispatch(
            self,
            shaders::EMBED,
            Some(self.ttype.name()),
            buffers,
            groups,
        )
    }
}

impl<'a> WgpuOp<'a> for Attention<'a> {
    // The split pair runs decode attention cut by keys (`split_attention.rs`).
    const KERNELS: &'static [Kernel] = &[
        shaders::ATTENTION,
        shaders::ATTENTION_SPLIT,
        shaders::ATTENTION_GROUPED,
        shaders::ATTENTION_MERGE,
        shaders::ATTENTION_TILED,
    ];

    fn step(&self, _: u32) -> Result<Step<'a>> {
        let buffers = vec![self.q, self.k_cache, self.v_cache, self.out];
        let groups = [self.heads, self.tokens, 1];
        dispatch(self, shaders::ATTENTION, None, buffers, groups)
    }
}

impl<'a> WgpuOp<'a> for KvStore<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::KV_STORE];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        let n = u64::from(self.tokens) * u64::from(self.kv_dim);
        let n = u32::try_from(n).map_err(|_| {
            BackendError::Unsupported(format!("kv_store of {n} elements passes u32"))
        })?;
        let groups = grid(n.div_ceil(256), max_dim)?;
        let buffers = vec![self.k, self.v, self.slots, self.k_pool, self.v_pool];
        dispatch(self, shaders::KV_STORE, None, buffers, groups)
    }
}

impl<'a> WgpuOp<'a> for PagedAttention<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::PAGED_ATTENTION, shaders::PAGED_ATTENTION_TILED];

    fn step(&self, max_dim: u32) -> Result<Step<'a>> {
        if self.heads > max_dim || self.tokens > max_dim {
            return Err(BackendError::Unsupported(format!(
                "paged attention over {} heads x {} tokens exceeds the device's {max_dim} x {max_dim} grid",
                self.heads, self.tokens
            )));
        }
        let buffers = vec![
            self.q,
            self.k_pool,
            self.v_pool,
            self.rows,
            self.table,
            self.out,
        ];
        let groups = [self.heads, self.tokens, 1];
        dispatch(self, shaders::PAGED_ATTENTION, None, buffers, groups)
    }
}

impl<'a> WgpuOp<'a> for Argmax<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::ARGMAX];

    fn step(&self, _: u32) -> Result<Step<'a>> {
        dispatch(
            self,
            shaders::ARGMAX,
            None,
            vec![self.x, self.out],
            [1, 1, 1],
        )
    }
}

impl<'a> WgpuOp<'a> for Sample<'a> {
    const KERNELS: &'static [Kernel] = &[shaders::SAMPLE];

    fn step(&self, _: u32) -> Result<Step<'a>> {
        dispatch(
            self,
            shaders::SAMPLE,
            None,
            vec![self.logits, self.out],
            [1, 1, 1],
        )
    }
}

impl<'a> WgpuOp<'a> for BufferCopy<'a> {
    const KERNELS: &'static [Kernel] = &[];

    fn step(&self, _: u32) -> Result<Step<'a>> {
        Ok(Step::Copy {
            src: self.src,
            src_offset: self.src_offset,
            dst: self.dst,
            dst_offset: self.dst_offset,
            bytes: self.bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which one-token products the wide kernels take, and which of them on packed integers.
    #[test]
    fn wide_kernels_take_long_one_token_rows() {
        let wide = |dot, stream_q8_0| Matvec::Stream {
            subgroups: true,
            int8: false,
            wide: Some(Wide {
                shape: shaders::WideShape::default(),
                dot,
                stream_q8_0,
            }),
        };
        let m = wide(true, false);
        assert_eq!(
            m.wide_for(1, 4096, "Q4_1", false),
            Some((shaders::LINEAR_MATVEC_WIDE_I8, 8))
        );
        assert_eq!(
            m.wide_for(1, 14336, "Q4_1", true),
            Some((shaders::LINEAR_MATVEC_FUSED_WIDE_I8, 8))
        );
        assert_eq!(
            m.wide_for(1, 4096, "Q4_K", true),
            Some((shaders::LINEAR_MATVEC_FUSED_WIDE, 8))
        );
        assert_eq!(
            wide(false, false).wide_for(1, 4096, "Q4_1", false),
            Some((shaders::LINEAR_MATVEC_WIDE, 8))
        );
        // Batches, rows not of 8s, rows with fewer chunks than invocations (576 / 8 < 256).
        assert_eq!(m.wide_for(2, 4096, "Q4_1", false), None);
        assert_eq!(m.wide_for(1, 4100, "F32", false), None);
        assert_eq!(m.wide_for(1, 576, "Q4_1", false), None);
        assert_eq!(m.wide_for(1, 4096, "Q8_0", false).map(|k| k.1), Some(8));
        assert_eq!(wide(true, true).wide_for(1, 4096, "Q8_0", false), None);
        assert_eq!(Matvec::Rows.wide_for(1, 4096, "Q4_1", false), None);
    }

    use crate::kernels::op::Layout;

    /// The members (name, offset) and size of the struct `kernel` binds at binding 0.
    fn wgsl_params(kernel: Kernel) -> (Vec<(String, u32)>, u32) {
        let format = shaders::formats(kernel)[0];
        let src = shaders::source(kernel, format).expect("source");
        let module = naga::front::wgsl::parse_str(&src).expect("parses");
        let var = module
            .global_variables
            .iter()
            .map(|(_, v)| v)
            .find(|v| v.binding.as_ref().is_some_and(|b| b.binding == 0))
            .unwrap_or_else(|| panic!("{} binds nothing at 0", kernel.name));
        let ty = &module.types[var.ty];
        let naga::TypeInner::Struct { members, span } = &ty.inner else {
            panic!("{}: binding 0 is not a struct", kernel.name);
        };
        let members = members
            .iter()
            .map(|m| (m.name.clone().unwrap_or_default(), m.offset))
            .collect();
        (members, *span)
    }

    fn matches<'a, O: WgpuOp<'a>>() -> Vec<&'static str>
    where
        O::Params: Layout,
    {
        declares::<O::Params>(O::KERNELS)
    }

    /// Checks that each of `kernels` declares `P`; their names.
    fn declares<P: Layout>(kernels: &[Kernel]) -> Vec<&'static str> {
        let rust: Vec<(String, u32)> = P::MEMBERS
            .iter()
            .map(|(n, _, off)| (n.to_string(), *off as u32))
            .collect();
        let size = std::mem::size_of::<P>() as u32;
        for &kernel in kernels {
            let (members, span) = wgsl_params(kernel);
            assert_eq!(members, rust, "{}: members of Params", kernel.name);
            assert_eq!(span, size, "{}: size of Params", kernel.name);
            assert!(
                size <= super::super::PARAM_BYTES,
                "{}: parameters beyond {} bytes",
                kernel.name,
                super::super::PARAM_BYTES
            );
        }
        kernels.iter().map(|k| k.name).collect()
    }

    /// Each kernel's WGSL `Params` has the members, offsets and size of the `#[repr(C)]`
    /// struct its op (or the fusion pass) writes, and every kernel belongs to one.
    #[test]
    fn every_wgsl_params_declaration_is_its_ops_struct() {
        let mut covered = [
            matches::<MatMul>(),
            matches::<Linear>(),
            matches::<RmsNorm>(),
            matches::<Rope>(),
            matches::<Softmax>(),
            matches::<SiluMul>(),
            matches::<GeluMul>(),
            matches::<ScaleCap>(),
            matches::<Add>(),
            matches::<AddBias>(),
            matches::<Embed>(),
            matches::<Attention>(),
            matches::<KvStore>(),
            matches::<PagedAttention>(),
            matches::<Argmax>(),
            matches::<Sample>(),
            matches::<BufferCopy>(),
            declares::<super::super::rows::EmbedRowsParams>(&[shaders::EMBED_ROWS]),
            declares::<super::super::split_attention::PagedSplitParams>(&[
                shaders::PAGED_ATTENTION_SPLIT,
                shaders::PAGED_ATTENTION_GROUPED,
                shaders::PAGED_ATTENTION_MERGE,
            ]),
            declares::<super::super::fuse::FusedMatvecParams>(&[
                shaders::LINEAR_MATVEC_FUSED,
                shaders::LINEAR_MATVEC_FUSED_STREAM,
                shaders::LINEAR_MATVEC_FUSED_STREAM_SUBGROUP,
                shaders::LINEAR_MATVEC_FUSED_STREAM_V4,
                shaders::LINEAR_MATVEC_FUSED_STREAM_V4_SUBGROUP,
                shaders::LINEAR_MATVEC_FUSED_WIDE,
                shaders::LINEAR_MATVEC_FUSED_WIDE_I8,
            ]),
        ]
        .concat();
        covered.sort();
        let mut all: Vec<&str> = shaders::ALL.iter().map(|k| k.name).collect();
        all.sort();
        assert_eq!(covered, all);
    }

    /// Plain rope binds `x` alone; with a table, the tables kernel binds the absent table to the
    /// present one (both read-only), never `x` twice (a browser's WebGPU refuses aliased
    /// writable bindings, and a writable and read-only binding of one buffer).
    #[test]
    fn rope_binds_a_stand_in_for_what_is_absent() {
        let d = crate::backend::Device::new_cpu(crate::device::info::describe_cpu());
        let (x, f, p) = (
            d.alloc("x", 1024).unwrap(),
            d.alloc("f", 64).unwrap(),
            d.alloc("p", 64).unwrap(),
        );
        let bound = |factors, positions| {
            let op = Rope {
                x: &x,
                factors,
                positions,
                heads: 2,
                head_dim: 8,
                rope_dim: 8,
                tokens: 3,
                pos0: 5,
                freq_base: 1e4,
                neox: false,
            };
            let Ok(Step::Dispatch {
                kernel,
                buffers,
                params,
                ..
            }) = op.step(65535)
            else {
                panic!("rope is a dispatch");
            };
            let tables = factors.is_some() || positions.is_some();
            assert_eq!(kernel == shaders::ROPE_TABLES, tables);
            assert_eq!(kernel == shaders::ROPE, !tables);
            let ids: Vec<u64> = buffers.iter().map(|b| b.id()).collect();
            // `x` (written) is never bound twice: a browser's WebGPU refuses that.
            assert_eq!(ids.iter().filter(|&&i| i == x.id()).count(), 1);
            (ids, params[7])
        };
        let flags = (crate::kernels::ROPE_FACTORS, crate::kernels::ROPE_POSITIONS);
        assert_eq!(bound(None, None), (vec![x.id()], 0));
        assert_eq!(
            bound(Some(&f), None),
            (vec![x.id(), f.id(), f.id()], flags.0)
        );
        assert_eq!(
            bound(None, Some(&p)),
            (vec![x.id(), p.id(), p.id()], flags.1)
        );
        assert_eq!(
            bound(Some(&f), Some(&p)),
            (vec![x.id(), f.id(), p.id()], flags.0 | flags.1)
        );
    }

    #[test]
    fn a_dispatch_carries_the_ops_params_as_they_are() {
        let d = crate::backend::Device::new_cpu(crate::device::info::describe_cpu());
        let (l, o) = (d.alloc("l", 40).unwrap(), d.alloc("o", 4).unwrap());
        let op = Sample {
            logits: &l,
            n: 10,
            out: &o,
            params: crate::kernels::SampleParams {
                temperature: 0.5,
                top_k: 3,
                top_p: 0.9,
                seed: 0x1234_5678_9abc_def0,
                step: 7,
            },
        };
        let Ok(Step::Dispatch { params, .. }) = op.step(65535) else {
            panic!("sample is a dispatch");
        };
        let want = [
            10,
            0.5f32.to_bits(),
            3,
            0.9f32.to_bits(),
            0x9abc_def0,
            0x1234_5678,
            7,
            0,
            0,
            0,
            0,
            0,
        ];
        assert_eq!(params, want);
    }
}

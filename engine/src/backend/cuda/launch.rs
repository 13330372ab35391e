//! Which CUDA kernel runs an [`Op`], over what grid, with which buffers; the parameter words
//! are the op's own `Params`.
//! Pure logic: no driver calls, so it is tested without a GPU.

use crate::backend::peer::{MAX_PEER_DEVICES, PeerSum};
use crate::backend::{BackendError, Buffer, Result};
use crate::kernels::{
    Add, AddBias, Argmax, Attention, AttentionParams, BufferCopy, Embed, GeluMul, KvStore, Linear,
    MatMul, Op, OpSpec, PagedAttention, PagedAttentionParams, RmsNorm, Rope, Sample, ScaleCap,
    SiluMul, Softmax, with_op,
};
use crate::quant::GgmlType;

/// Parameter words per launch in the device's parameter arena (see kernels/common.cuh).
pub(crate) const PARAM_WORDS: usize = 16;

/// Up to this many tokens, `Linear` runs as matrix-vector products: one token's kernels for
/// one, and past it kernels that read each weight row once for up to 4 tokens
/// (`linear_matvec_tokens`, `linear_matvec_split_tokens`; a batch of decode steps), which cost
/// less than a tiled product's setup for so few.
pub(crate) const MATVEC_MAX_TOKENS: u32 = crate::backend::CUDA_MATVEC_MAX_TOKENS as u32;

/// Tokens a block of the several-token matrix-vector kernels takes (`MATVEC_TOKENS` in
/// kernels/linear.cu).
pub(crate) const MATVEC_TOKENS: u32 = 4;

/// Tokens a block of `linear_matvec_split_tokens_q8` takes (`MATVEC_QTOKENS` in
/// kernels/linear.cu).
pub(crate) const MATVEC_QTOKENS: u32 = 4;

/// Up to this many tokens a pass counts as decode: products fuse with their neighbours
/// (fuse.rs, whose scratch is sized for this many) and attention splits its keys across
/// blocks; past it, prefill's kernels (tensor cores, a block per query tile) take over.
pub(crate) const DECODE_MAX_TOKENS: u32 = crate::backend::CUDA_DECODE_MAX_TOKENS as u32;

/// From this many lane steps per row up, a matrix-vector product splits each row's columns
/// across the block (`linear_matvec_split`) instead of giving each row one warp: one warp per
/// short row (SmolLM2's 576 columns are 72 steps of a 4-bit format) leaves most lanes idle in
/// a split block, and one warp per long row loads every activation once per row.
pub(crate) const SPLIT_MIN_STEPS: u32 = 256;

/// Elements a lane takes per step in the matrix-vector kernels (`SUB` in kernels/*.cuh).
pub(crate) fn lane_step(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 | GgmlType::F16 => 1,
        // The formats written per element (kernels/step8.cuh) take 8 too.
        GgmlType::Q8_0
        | GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Q2_K
        | GgmlType::Q3_K
        | GgmlType::Q4_K
        | GgmlType::Q5_K
        | GgmlType::Q6_K => 8,
    }
}

/// CUDA's limit on the second and third grid dimensions.
const MAX_GRID_YZ: u32 = 65_535;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kernel {
    MatMul,
    LinearMatvec,
    LinearMatvecSplit,
    LinearMatvecTokens,
    LinearMatvecSplitTokens,
    LinearMatvecSplitTokensQ8,
    ToQ8,
    LinearMatmat,
    LinearMma64,
    LinearMma128,
    LinearMma128Wide,
    LinearMma64Wide,
    LinearMma64WideHalf,
    LinearMma128Half,
    LinearMma128WideHalf,
    ToF16,
    LinearFused,
    LinearFusedSplit,
    LinearGlu,
    LinearGluSplit,
    Embed,
    RmsNorm,
    Rope,
    Softmax,
    SiluMul,
    GeluMul,
    ScaleCap,
    Add,
    AddBias,
    Attention,
    AttentionSplit,
    AttentionMma64,
    AttentionMma128,
    KvStore,
    PagedAttention,
    PagedAttentionSplit,
    Argmax,
    Sample,
    Copy,
    PeerSum,
}

impl Kernel {
    /// The `extern "C"` name in the .cu source.
    pub(crate) fn symbol(self) -> &'static str {
        match self {
            Kernel::MatMul => "matmul",
            Kernel::LinearMatvec => "linear_matvec",
            Kernel::LinearMatvecSplit => "linear_matvec_split",
            Kernel::LinearMatvecTokens => "linear_matvec_tokens",
            Kernel::LinearMatvecSplitTokens => "linear_matvec_split_tokens",
            Kernel::LinearMatvecSplitTokensQ8 => "linear_matvec_split_tokens_q8",
            Kernel::ToQ8 => "to_q8",
            Kernel::LinearMatmat => "linear_matmat",
            Kernel::LinearMma64 => "linear_mma64",
            Kernel::LinearMma128 => "linear_mma128",
            Kernel::LinearMma128Wide => "linear_mma128w",
            Kernel::LinearMma64Wide => "linear_mma64w",
            Kernel::LinearMma64WideHalf => "linear_mma64wh",
            Kernel::LinearMma128Half => "linear_mma128h",
            Kernel::LinearMma128WideHalf => "linear_mma128wh",
            Kernel::ToF16 => "to_f16",
            Kernel::LinearFused => "linear_fused",
            Kernel::LinearFusedSplit => "linear_fused_split",
            Kernel::LinearGlu => "linear_glu",
            Kernel::LinearGluSplit => "linear_glu_split",
            Kernel::Embed => "embed",
            Kernel::RmsNorm => "rmsnorm",
            Kernel::Rope => "rope",
            Kernel::Softmax => "softmax",
            Kernel::SiluMul => "silu_mul",
            Kernel::GeluMul => "gelu_mul",
            Kernel::ScaleCap => "scale_cap",
            Kernel::Add => "add",
            Kernel::AddBias => "add_bias",
            Kernel::Attention => "attention",
            Kernel::AttentionSplit => "attention_split",
            Kernel::AttentionMma64 => "attention_mma64",
            Kernel::AttentionMma128 => "attention_mma128",
            Kernel::KvStore => "kv_store",
            Kernel::PagedAttention => "paged_attention",
            Kernel::PagedAttentionSplit => "paged_attention_split",
            Kernel::Argmax => "argmax",
            Kernel::Sample => "sample",
            Kernel::Copy => "copy_words",
            Kernel::PeerSum => "peer_sum",
        }
    }
}

/// The source module a kernel lives in: the f32 ops, or the weight kernels for one format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ModuleKey {
    Ops,
    Weights(GgmlType),
}

/// One kernel launch.
#[derive(Debug, Clone)]
pub(crate) struct Launch<'a> {
    pub kernel: Kernel,
    pub module: ModuleKey,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes.
    pub shared: u32,
    /// Bytes of the backend's scratch buffer the kernel needs, passed after `buffers`: zeroed
    /// when made and left zeroed by its kernels (split attention's counts live there).
    pub scratch: u64,
    /// Bytes of the backend's staging buffer, passed after `buffers` (a launch takes this or
    /// `scratch`, never both): activations converted once per product (`to_f16`, `to_q8`) for
    /// the product that follows, which may leave anything there. Not the scratch: a split
    /// attention after them would find its counts overwritten (the first token of a model with
    /// 2048-column rows, 3 at once: logits off by 3.0 where 0.06 was allowed).
    pub staging: u64,
    /// The kernel's buffer arguments, in order, after the parameter pointer.
    pub buffers: Vec<&'a Buffer>,
    pub params: [u32; PARAM_WORDS],
}

/// The parameter words of `p`, zero-padded.
pub(crate) fn words<P: bytemuck::Pod>(p: &P) -> [u32; PARAM_WORDS] {
    const { assert!(std::mem::size_of::<P>() <= PARAM_WORDS * 4) };
    let mut w = [0u32; PARAM_WORDS];
    let bytes = bytemuck::bytes_of(p);
    bytemuck::cast_slice_mut::<u32, u8>(&mut w)[..bytes.len()].copy_from_slice(bytes);
    w
}

fn blocks(n: u64, per: u64) -> u32 {
    u32::try_from(n.div_ceil(per)).unwrap_or(u32::MAX)
}

fn grid_yz(op: &'static str, what: &str, n: u32) -> Result<u32> {
    if n > MAX_GRID_YZ {
        return Err(BackendError::InvalidOp {
            op,
            reason: format!("{what} {n} exceeds the cuda backend's {MAX_GRID_YZ} per launch"),
        });
    }
    Ok(n)
}

/// How the cuda backend runs one op: its launch, or `None` when it has no work (zero tokens,
/// zero elements). The op has passed validation.
pub(crate) trait CudaOp<'a>: OpSpec<'a> {
    fn launch(&self) -> Result<Launch<'a>>;
}

/// The launch for `op`, or `None` when it has no work. `op` must have passed `validate_op`.
pub(crate) fn plan<'a>(op: &Op<'a>) -> Result<Option<Launch<'a>>> {
    let launch = with_op!(op, o => o.launch())?;
    Ok(Some(launch).filter(|l| l.grid.iter().all(|g| *g > 0)))
}

/// A launch of `kernel` with the op's parameters, no shared memory and no scratch.
fn launch<'a>(
    op: &impl OpSpec<'a>,
    (kernel, module): (Kernel, ModuleKey),
    grid: [u32; 3],
    block: [u32; 3],
    buffers: Vec<&'a Buffer>,
) -> Result<Launch<'a>> {
    Ok(Launch {
        kernel,
        module,
        grid,
        block,
        shared: 0,
        scratch: 0,
        staging: 0,
        buffers,
        params: words(&op.params()),
    })
}

const OPS: ModuleKey = ModuleKey::Ops;

/// Blocks of a peer sum at most: every block waits for the other devices' flags before it
/// adds, so all of them must be resident at once (a waiting block must not hold back one that
/// has yet to start); 64 blocks of 256 fit any GPU this backend runs on.
const PEER_SUM_MAX_BLOCKS: u32 = 64;

/// The launch of a peer sum (backend/peer.rs; `peer_sum` in kernels/ops.cu): the hidden
/// states, then [`MAX_PEER_DEVICES`] partials and as many flag buffers, unused slots filled
/// with the hidden states (never read: `devices` bounds the kernel's loops). The sum must have
/// passed `Device::run_pieces`' checks.
pub(crate) fn peer_sum<'a>(sum: &PeerSum<'a>) -> Launch<'a> {
    let mut buffers = Vec::with_capacity(1 + 2 * MAX_PEER_DEVICES);
    buffers.push(sum.h);
    for list in [&sum.parts, &sum.flags] {
        buffers.extend(list.iter().copied());
        buffers.extend(std::iter::repeat_n(sum.h, MAX_PEER_DEVICES - list.len()));
    }
    let params = [
        sum.n,
        sum.index,
        sum.parts.len() as u32,
        sum.epoch,
        sum.first,
    ];
    let mut w = [0u32; PARAM_WORDS];
    w[..params.len()].copy_from_slice(&params);
    Launch {
        kernel: Kernel::PeerSum,
        module: OPS,
        grid: [
            blocks(sum.n.into(), 256).clamp(1, PEER_SUM_MAX_BLOCKS),
            1,
            1,
        ],
        block: [256, 1, 1],
        shared: 0,
        scratch: 0,
        staging: 0,
        buffers,
        params: w,
    }
}

impl<'a> CudaOp<'a> for MatMul<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let rows = grid_yz(self.name(), "rows", self.m.div_ceil(16))?;
        let grid = [blocks(self.n.into(), 16), rows, 1];
        let buffers = vec![self.a, self.b, self.c];
        launch(self, (Kernel::MatMul, OPS), grid, [16, 16, 1], buffers)
    }
}

impl<'a> CudaOp<'a> for Linear<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let (rows, tokens, module) = (self.rows, self.tokens, ModuleKey::Weights(self.wtype));
        let buffers = vec![self.w, self.x, self.y];
        if tokens <= MATVEC_MAX_TOKENS {
            let split = self.cols / lane_step(self.wtype) >= SPLIT_MIN_STEPS;
            let row_blocks = blocks(rows.into(), 8);
            if tokens == 1 {
                let kernel = if split {
                    Kernel::LinearMatvecSplit
                } else {
                    Kernel::LinearMatvec
                };
                let grid = [row_blocks, 1, 1];
                return launch(self, (kernel, module), grid, [256, 1, 1], buffers);
            }
            // Several tokens: the token blocks of the same rows side by side (see linear.cu).
            let kernel = if split {
                Kernel::LinearMatvecSplitTokens
            } else {
                Kernel::LinearMatvecTokens
            };
            let grid = [
                tokens.div_ceil(MATVEC_TOKENS),
                grid_yz(self.name(), "rows / 8", row_blocks)?,
                1,
            ];
            launch(self, (kernel, module), grid, [256, 1, 1], buffers)
        } else {
            let tiles = grid_yz(self.name(), "tokens", tokens.div_ceil(64))?;
            let grid = [blocks(rows.into(), 64), tiles, 1];
            launch(
                self,
                (Kernel::LinearMatmat, module),
                grid,
                [256, 1, 1],
                buffers,
            )
        }
    }
}

impl<'a> CudaOp<'a> for Embed<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let tokens = grid_yz(self.name(), "tokens", self.tokens)?;
        let grid = [blocks(self.dim.into(), 256), tokens, 1];
        let buffers = vec![self.table, self.ids, self.out];
        let kernel = (Kernel::Embed, ModuleKey::Weights(self.ttype));
        launch(self, kernel, grid, [256, 1, 1], buffers)
    }
}

impl<'a> CudaOp<'a> for RmsNorm<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let buffers = vec![self.x, self.weight, self.y];
        let grid = [self.tokens, 1, 1];
        launch(self, (Kernel::RmsNorm, OPS), grid, [1024, 1, 1], buffers)
    }
}

impl<'a> CudaOp<'a> for Rope<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let pairs = u64::from(self.heads) * u64::from(self.rope_dim / 2);
        let grid = [
            blocks(pairs, 256),
            grid_yz(self.name(), "tokens", self.tokens)?,
            1,
        ];
        // Without factors or positions the kernel's argument is x, which it then never reads.
        let factors = self.factors.unwrap_or(self.x);
        let positions = self.positions.unwrap_or(self.x);
        launch(
            self,
            (Kernel::Rope, OPS),
            grid,
            [256, 1, 1],
            vec![self.x, factors, positions],
        )
    }
}

impl<'a> CudaOp<'a> for Softmax<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let grid = [self.rows, 1, 1];
        launch(
            self,
            (Kernel::Softmax, OPS),
            grid,
            [256, 1, 1],
            vec![self.x],
        )
    }
}

impl<'a> CudaOp<'a> for SiluMul<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let grid = [blocks(self.n.into(), 256), 1, 1];
        let buffers = vec![self.gate, self.up, self.out];
        launch(self, (Kernel::SiluMul, OPS), grid, [256, 1, 1], buffers)
    }
}

impl<'a> CudaOp<'a> for GeluMul<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let grid = [blocks(self.n.into(), 256), 1, 1];
        let buffers = vec![self.gate, self.up, self.out];
        launch(self, (Kernel::GeluMul, OPS), grid, [256, 1, 1], buffers)
    }
}

impl<'a> CudaOp<'a> for ScaleCap<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let grid = [blocks(self.n.into(), 256), 1, 1];
        launch(
            self,
            (Kernel::ScaleCap, OPS),
            grid,
            [256, 1, 1],
            vec![self.x],
        )
    }
}

impl<'a> CudaOp<'a> for Add<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let grid = [blocks(self.n.into(), 256), 1, 1];
        let buffers = vec![self.a, self.b, self.out];
        launch(self, (Kernel::Add, OPS), grid, [256, 1, 1], buffers)
    }
}

impl<'a> CudaOp<'a> for AddBias<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let n = u64::from(self.cols) * u64::from(self.tokens);
        let grid = [blocks(n, 256), 1, 1];
        let buffers = vec![self.x, self.bias];
        launch(self, (Kernel::AddBias, OPS), grid, [256, 1, 1], buffers)
    }
}

impl<'a> CudaOp<'a> for Attention<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let grid = [self.heads, grid_yz(self.name(), "tokens", self.tokens)?, 1];
        let buffers = vec![self.q, self.k_cache, self.v_cache, self.out];
        launch(self, (Kernel::Attention, OPS), grid, [256, 1, 1], buffers)
    }
}

impl<'a> CudaOp<'a> for KvStore<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let grid = [
            blocks(self.kv_dim.into(), 256),
            grid_yz(self.name(), "tokens", self.tokens)?,
            1,
        ];
        let buffers = vec![self.k, self.v, self.slots, self.k_pool, self.v_pool];
        launch(self, (Kernel::KvStore, OPS), grid, [256, 1, 1], buffers)
    }
}

impl<'a> CudaOp<'a> for PagedAttention<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let grid = [self.heads, grid_yz(self.name(), "tokens", self.tokens)?, 1];
        let buffers = vec![
            self.q,
            self.k_pool,
            self.v_pool,
            self.rows,
            self.table,
            self.out,
        ];
        launch(
            self,
            (Kernel::PagedAttention, OPS),
            grid,
            [256, 1, 1],
            buffers,
        )
    }
}

impl<'a> CudaOp<'a> for Argmax<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let buffers = vec![self.x, self.out];
        launch(
            self,
            (Kernel::Argmax, OPS),
            [1, 1, 1],
            [1024, 1, 1],
            buffers,
        )
    }
}

impl<'a> CudaOp<'a> for Sample<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        let buffers = vec![self.logits, self.out];
        launch(
            self,
            (Kernel::Sample, OPS),
            [1, 1, 1],
            [1024, 1, 1],
            buffers,
        )
    }
}

impl<'a> CudaOp<'a> for BufferCopy<'a> {
    fn launch(&self) -> Result<Launch<'a>> {
        // A grid-stride loop: the grid depends on the length only, so a decode step that
        // appends to the KV cache at a new offset replays the same graph.
        let grid = [blocks(self.bytes / 4, 256).min(4096), 1, 1];
        let buffers = vec![self.src, self.dst];
        launch(self, (Kernel::Copy, OPS), grid, [256, 1, 1], buffers)
    }
}

/// At most this many blocks share one (head, token)'s keys in decode attention (the merge keeps
/// one weight per part in a 32-float shared array).
const MAX_ATTENTION_SPLITS: u32 = 32;

/// Decode attention (few tokens) over few heads leaves most of a GPU idle with a block per
/// (head, token): this splits each one's keys across blocks (`attention_split`,
/// `paged_attention_split`) so that about `target_blocks` run (the backend asks for four per
/// multiprocessor). The split depends on the shape only, never on the position or the block
/// tables, so a captured graph replays at every step.
pub(crate) fn split_attention(l: &mut Launch<'_>, target_blocks: u32) {
    match l.kernel {
        Kernel::Attention => split_dense(l, target_blocks),
        Kernel::PagedAttention => split_paged(l, target_blocks),
        _ => {}
    }
}

/// Prefill's tiled products on tensor cores (`linear_mma64`, `linear_mma128`, `linear_mma128w`,
/// `linear_mma64w`, kernels/linear.cu) for devices that have them, where rows are a multiple of
/// 32 columns: the largest tile whose grid still gives each of the `sms` multiprocessors a
/// block. 128 rows x 128 tokens stage each weight once per 128 tokens (the 8B shape's
/// 14336-row products over 512 tokens: 448 blocks; prefill 5,990 -> 6,670 tok/s on an H100),
/// then 64 x 128, which stages each weight as seldom with half the rows a block (the 8B
/// shape's 4096-row products over 512 tokens: 256 blocks where 128 x 128 gives 128; prefill
/// 8,797-8,815 -> 9,432-9,462 tok/s against 128 x 64), then 128 x 64 (few tokens over very
/// many rows), else 64 x 64 (small matrices: SmolLM2's 576 rows over a 512-token prompt are
/// 40 blocks of 128 rows, 72 of 64).
pub(crate) fn tensor_core_linear(l: &mut Launch<'_>, sms: u32) {
    if l.kernel != Kernel::LinearMatmat {
        return;
    }
    let size = std::mem::size_of::<crate::kernels::LinearParams>();
    let p: crate::kernels::LinearParams =
        bytemuck::pod_read_unaligned(&bytemuck::cast_slice(&l.params)[..size]);
    if !p.cols.is_multiple_of(32) {
        return;
    }
    let wide = p.rows.div_ceil(128).saturating_mul(p.tokens.div_ceil(128));
    let tiles = p.tokens.div_ceil(64);
    let half_wide = p.rows.div_ceil(64).saturating_mul(p.tokens.div_ceil(128));
    let (kernel, rows, tokens) = if p.tokens > 64 && wide >= sms {
        (Kernel::LinearMma128Wide, 128, 128)
    } else if p.tokens > 64 && half_wide >= sms {
        (Kernel::LinearMma64Wide, 64, 128)
    } else if p.rows.div_ceil(128).saturating_mul(tiles) >= sms {
        (Kernel::LinearMma128, 128, 64)
    } else {
        (Kernel::LinearMma64, 64, 64)
    };
    l.kernel = kernel;
    l.grid = [p.rows.div_ceil(rows), p.tokens.div_ceil(tokens), 1];
}

/// See [`f16_activations`].
const F16_ACTIVATION_ROWS: u32 = 2048;

/// The launch that rounds a tensor-core product's activations to f16 once (`to_f16`,
/// kernels/ops.cu) into the backend's staging buffer, which the product `l` then reads (its `*h`
/// kernel) instead of rounding every token's row again in each block of rows; `None` for every
/// other launch. Products of at least F16_ACTIVATION_ROWS rows only (16 blocks of 128 rows and
/// more): on an H100 the 8B shape's prefill gained 5% (6,621-6,650 -> 6,984 tok/s at 512
/// tokens), while SmolLM2's 576- and 1536-row products lost 8% to the extra launches.
pub(crate) fn f16_activations<'a>(l: &mut Launch<'a>) -> Option<Launch<'a>> {
    let half = match l.kernel {
        Kernel::LinearMma128 => Kernel::LinearMma128Half,
        Kernel::LinearMma128Wide => Kernel::LinearMma128WideHalf,
        Kernel::LinearMma64Wide => Kernel::LinearMma64WideHalf,
        _ => return None,
    };
    let size = std::mem::size_of::<crate::kernels::LinearParams>();
    let p: crate::kernels::LinearParams =
        bytemuck::pod_read_unaligned(&bytemuck::cast_slice(&l.params)[..size]);
    if p.rows < F16_ACTIVATION_ROWS {
        return None;
    }
    let n = p.tokens.checked_mul(p.cols)?;
    let x = *l.buffers.get(1)?;
    l.kernel = half;
    l.staging = u64::from(n) * 2;
    Some(conversion(Kernel::ToF16, x, n, l.staging))
}

/// A launch converting `n` activations of `x` (8 per thread) into `bytes` of the staging
/// buffer, for the product after it: `to_f16` or `to_q8`.
fn conversion(kernel: Kernel, x: &Buffer, n: u32, bytes: u64) -> Launch<'_> {
    Launch {
        kernel,
        module: OPS,
        grid: [blocks(u64::from(n), 256 * 8), 1, 1],
        block: [256, 1, 1],
        shared: 0,
        scratch: 0,
        staging: bytes,
        buffers: vec![x],
        params: words(&crate::kernels::CountParams::new(n)),
    }
}

/// The launch that rounds a several-token split matrix-vector product's activations to int8
/// once (`to_q8`, kernels/ops.cu: a uint4 per 8-element lane step) into the backend's staging,
/// which the product `l` then reads (`linear_matvec_split_tokens_q8`) instead of every block of
/// 8 rows rounding every token's activations again; `None` for every other launch, and for
/// formats whose split step is not int8 (only Q4_0, Q4_1 and Q5_0 define one, and none does
/// where the activations are kept in f32: `int8` is false then).
pub(crate) fn int8_activations<'a>(l: &mut Launch<'a>, int8: bool) -> Option<Launch<'a>> {
    if !int8 || l.kernel != Kernel::LinearMatvecSplitTokens {
        return None;
    }
    if !matches!(
        l.module,
        ModuleKey::Weights(GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0)
    ) {
        return None;
    }
    let size = std::mem::size_of::<crate::kernels::LinearParams>();
    let p: crate::kernels::LinearParams =
        bytemuck::pod_read_unaligned(&bytemuck::cast_slice(&l.params)[..size]);
    let n = p.tokens.checked_mul(p.cols)?;
    let x = *l.buffers.get(1)?;
    let bytes = u64::from(n) * 2; // 16 bytes per 8 elements
    l.kernel = Kernel::LinearMatvecSplitTokensQ8;
    l.grid[0] = p.tokens.div_ceil(MATVEC_QTOKENS);
    l.staging = bytes;
    Some(conversion(Kernel::ToQ8, x, n, bytes))
}

/// Prefill attention on tensor cores (`attention_mma64`, `attention_mma128`, kernels/ops.cu):
/// for devices that have them (compute capability 8.0 and up, `CudaOptions::tensor_cores`),
/// dense attention over more tokens than decode takes, with a head size of 64 or 128, runs a
/// block per 64 queries of a head instead of one per (head, token).
pub(crate) fn tensor_core_attention(l: &mut Launch<'_>) {
    if l.kernel != Kernel::Attention {
        return;
    }
    let size = std::mem::size_of::<AttentionParams>();
    let p: AttentionParams = bytemuck::pod_read_unaligned(&bytemuck::cast_slice(&l.params)[..size]);
    let kernel = match p.head_dim {
        64 => Kernel::AttentionMma64,
        128 => Kernel::AttentionMma128,
        _ => return,
    };
    if p.tokens <= DECODE_MAX_TOKENS {
        return;
    }
    l.kernel = kernel;
    l.grid = [p.heads, p.tokens.div_ceil(64), 1];
    l.block = [128, 1, 1];
}

/// The split attention kernels' count slots at the start of the scratch (`SPLIT_COUNTS` in
/// kernels/ops.cu): a region of their own, left zero by every launch, which no launch's
/// partial results overlap, however many (head, token) pairs it covers.
pub(crate) const SPLIT_COUNTS: u32 = 4096;

/// Blocks per (head, token) for `pairs` of them, or `None` when a block each fills the device
/// (or there are more pairs than count slots).
fn splits_for(pairs: u32, target_blocks: u32) -> Option<u32> {
    if pairs > SPLIT_COUNTS {
        return None;
    }
    let splits = (target_blocks / pairs.max(1)).min(MAX_ATTENTION_SPLITS);
    (splits >= 2).then_some(splits)
}

/// Scratch of a split over `pairs` (head, token) pairs: the count slots, then (m, l) and
/// head_dim partial outputs per part.
fn split_scratch(pairs: u32, splits: u32, head_dim: u32) -> u64 {
    let pairs = u64::from(pairs);
    u64::from(SPLIT_COUNTS) * 4 + pairs * u64::from(splits) * (2 + u64::from(head_dim)) * 4
}

fn split_dense(l: &mut Launch<'_>, target_blocks: u32) {
    let size = std::mem::size_of::<AttentionParams>();
    let mut p: AttentionParams =
        bytemuck::pod_read_unaligned(&bytemuck::cast_slice(&l.params)[..size]);
    // Prefill's causal rows differ in length; only decode's few tokens split.
    if p.tokens > DECODE_MAX_TOKENS {
        return;
    }
    let pairs = p.heads.saturating_mul(p.tokens);
    let Some(splits) = splits_for(pairs, target_blocks) else {
        return;
    };
    l.kernel = Kernel::AttentionSplit;
    l.grid[2] = splits;
    p.splits = splits;
    l.params = words(&p);
    l.scratch = split_scratch(pairs, splits, p.head_dim);
}

/// A batch of sequences' tokens; the kernel takes the split count from the grid.
fn split_paged(l: &mut Launch<'_>, target_blocks: u32) {
    let size = std::mem::size_of::<PagedAttentionParams>();
    let p: PagedAttentionParams =
        bytemuck::pod_read_unaligned(&bytemuck::cast_slice(&l.params)[..size]);
    let pairs = p.heads.saturating_mul(p.tokens);
    let Some(splits) = splits_for(pairs, target_blocks) else {
        return;
    };
    l.kernel = Kernel::PagedAttentionSplit;
    l.grid[2] = splits;
    l.scratch = split_scratch(pairs, splits, p.head_dim);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Device;
    use crate::kernels::SampleParams;

    fn cpu() -> Device {
        Device::new_cpu(crate::device::info::describe_cpu())
    }

    /// A peer sum passes the hidden states, then eight partial and eight flag pointers in
    /// device order, unused ones padded with the hidden states (the kernel's loops stop at
    /// `devices`), and never more blocks than can all wait at once.
    #[test]
    fn peer_sums_pass_every_device_in_order_and_cap_their_blocks() {
        let d = cpu();
        let h = d.alloc("h", 4 * 4096 * 512).unwrap();
        let parts: Vec<Buffer> = (0..3)
            .map(|_| d.alloc("p", 4 * 4096 * 512).unwrap())
            .collect();
        let flags: Vec<Buffer> = (0..3).map(|_| d.alloc("f", 32).unwrap()).collect();
        let sum = |n| PeerSum {
            h: &h,
            parts: parts.iter().collect(),
            flags: flags.iter().collect(),
            index: 1,
            epoch: 7,
            first: 5,
            n,
        };
        let l = peer_sum(&sum(4096 * 512));
        let ids: Vec<u64> = l.buffers.iter().map(|b| b.id()).collect();
        let mut want = vec![h.id()];
        for list in [&parts, &flags] {
            want.extend(list.iter().map(|b| b.id()));
            want.extend(std::iter::repeat_n(h.id(), MAX_PEER_DEVICES - 3));
        }
        assert_eq!(ids, want);
        assert_eq!(&l.params[..5], &[4096 * 512, 1, 3, 7, 5]);
        assert_eq!(l.grid, [PEER_SUM_MAX_BLOCKS, 1, 1]);
        assert_eq!(peer_sum(&sum(576)).grid, [3, 1, 1]);
    }

    #[test]
    fn linear_picks_matvec_for_few_tokens_and_tiles_otherwise() {
        let d = cpu();
        let w = d.alloc("w", 20 * 2 * 100).unwrap();
        let x = d.alloc("x", 4 * 64 * 100).unwrap();
        let y = d.alloc("y", 4 * 100 * 100).unwrap();
        let op = |tokens| {
            Op::Linear(Linear {
                w: &w,
                wtype: GgmlType::Q4_1,
                x: &x,
                y: &y,
                rows: 100,
                cols: 64,
                tokens,
            })
        };
        let one = plan(&op(1)).unwrap().unwrap();
        assert_eq!(
            one.kernel,
            Kernel::LinearMatvec,
            "64 columns are 8 steps: a warp per row"
        );
        assert_eq!(one.module, ModuleKey::Weights(GgmlType::Q4_1));
        assert_eq!(one.grid, [13, 1, 1]);
        assert_eq!(&one.params[..4], &[100, 64, 1, 40]);
        let long = Op::Linear(Linear {
            w: &w,
            wtype: GgmlType::Q4_1,
            x: &x,
            y: &y,
            rows: 100,
            cols: 2048,
            tokens: 1,
        });
        assert_eq!(
            plan(&long).unwrap().unwrap().kernel,
            Kernel::LinearMatvecSplit,
            "2048 columns are 256 steps: the block splits the row"
        );
        let many = plan(&op(65)).unwrap().unwrap();
        assert_eq!(many.kernel, Kernel::LinearMatmat);
        assert_eq!(many.grid, [2, 2, 1]);
        assert!(plan(&op(0)).unwrap().is_none(), "no tokens, no launch");
    }

    #[test]
    fn copy_offsets_are_words_split_in_halves_and_the_grid_ignores_offsets() {
        let d = cpu();
        let a = d.alloc("a", 1 << 12).unwrap();
        let b = d.alloc("b", 1 << 12).unwrap();
        let op = |dst_offset| {
            Op::Copy(BufferCopy {
                src: &a,
                src_offset: 8,
                dst: &b,
                dst_offset,
                bytes: 1024,
            })
        };
        let p0 = plan(&op(0)).unwrap().unwrap();
        let p1 = plan(&op(2048)).unwrap().unwrap();
        assert_eq!(&p1.params[..6], &[2, 0, 512, 0, 256, 0]);
        assert_eq!(
            p0.grid, p1.grid,
            "a new offset must not change the graph key"
        );
    }

    #[test]
    fn sample_params_carry_the_seed_in_two_words() {
        let d = cpu();
        let l = d.alloc("l", 40).unwrap();
        let o = d.alloc("o", 4).unwrap();
        let sp = SampleParams {
            temperature: 0.5,
            top_k: 3,
            top_p: 0.9,
            seed: 0x1234_5678_9abc_def0,
            step: 7,
        };
        let p = plan(&Op::Sample(Sample {
            logits: &l,
            n: 10,
            out: &o,
            params: sp,
        }))
        .unwrap()
        .unwrap();
        assert_eq!(
            &p.params[..7],
            &[
                10,
                0.5f32.to_bits(),
                3,
                0.9f32.to_bits(),
                0x9abc_def0,
                0x1234_5678,
                7
            ]
        );
    }

    #[test]
    fn decode_attention_splits_keys_by_shape_not_position() {
        let d = cpu();
        let b = d.alloc("b", 1 << 16).unwrap();
        let att = |tokens, pos0| {
            Op::Attention(Attention {
                q: &b,
                k_cache: &b,
                v_cache: &b,
                out: &b,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                tokens,
                pos0,
                scale: 0.125,
                window: 0,
                softcap: 0.0,
            })
        };
        let split = |tokens, pos0| {
            let mut l = plan(&att(tokens, pos0)).unwrap().unwrap();
            split_attention(&mut l, 264);
            l
        };
        let a = split(1, 10);
        assert_eq!(a.kernel, Kernel::AttentionSplit);
        assert_eq!(a.grid, [9, 1, 29], "264 blocks wanted, 9 heads");
        assert_eq!(a.params[6], 29);
        assert_eq!(a.scratch, 4096 * 4 + 9 * 29 * 66 * 4);
        let b2 = split(1, 500);
        assert_eq!((b2.grid, b2.params[6]), (a.grid, a.params[6]));
        assert_eq!(
            split(DECODE_MAX_TOKENS + 1, 0).kernel,
            Kernel::Attention,
            "prefill keeps a block per (head, token)"
        );
        let mut few_sms = plan(&att(1, 0)).unwrap().unwrap();
        split_attention(&mut few_sms, 8);
        assert_eq!(few_sms.kernel, Kernel::Attention, "9 heads fill 8 blocks");
    }

    #[test]
    fn the_pool_ops_launch_per_token_and_keep_their_buffer_order() {
        let d = cpu();
        let b: Vec<Buffer> = (0..6)
            .map(|i| d.alloc(&i.to_string(), 1 << 16).unwrap())
            .collect();
        let store = plan(&Op::KvStore(KvStore {
            k: &b[0],
            v: &b[1],
            slots: &b[2],
            k_pool: &b[3],
            v_pool: &b[4],
            kv_dim: 300,
            tokens: 5,
            pool_slots: 40,
        }))
        .unwrap()
        .unwrap();
        assert_eq!(store.kernel, Kernel::KvStore);
        assert_eq!((store.grid, store.block), ([2, 5, 1], [256, 1, 1]));
        assert_eq!(&store.params[..4], &[300, 5, 40, 0]);
        let ids = |l: &Launch| l.buffers.iter().map(|x| x.id()).collect::<Vec<_>>();
        assert_eq!(
            ids(&store),
            b[..5].iter().map(Buffer::id).collect::<Vec<_>>()
        );
        let att = plan(&Op::PagedAttention(PagedAttention {
            q: &b[0],
            k_pool: &b[1],
            v_pool: &b[2],
            rows: &b[3],
            table: &b[4],
            out: &b[5],
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            tokens: 7,
            block: 16,
            pool_blocks: 12,
            table_len: 20,
            scale: 0.125,
            window: 0,
            softcap: 0.0,
        }))
        .unwrap()
        .unwrap();
        assert_eq!(att.kernel, Kernel::PagedAttention);
        assert_eq!((att.grid, att.block), ([9, 7, 1], [256, 1, 1]));
        assert_eq!(
            &att.params[..8],
            &[9, 3, 64, 7, 16, 12, 20, 0.125f32.to_bits()]
        );
        assert_eq!(ids(&att), b.iter().map(Buffer::id).collect::<Vec<_>>());
        let mut l = att.clone();
        split_attention(&mut l, 1 << 16);
        assert_eq!(l.kernel, Kernel::PagedAttentionSplit);
        assert_eq!(
            l.grid,
            [9, 7, MAX_ATTENTION_SPLITS],
            "the kernel reads the split here"
        );
        assert_eq!(l.params, att.params);
        assert_eq!(l.scratch, 4096 * 4 + 63 * 32 * 66 * 4);
        let mut full = att.clone();
        split_attention(&mut full, 100);
        assert_eq!(
            full.kernel,
            Kernel::PagedAttention,
            "63 blocks of 100 wanted"
        );
    }

    #[test]
    fn prefill_products_move_to_tensor_cores_by_size() {
        let d = cpu();
        let b = d.alloc("b", 4).unwrap();
        let lin = |rows, cols, tokens| {
            let mut l = plan(&Op::Linear(Linear {
                w: &b,
                wtype: GgmlType::Q4_1,
                x: &b,
                y: &b,
                rows,
                cols,
                tokens,
            }))
            .unwrap()
            .unwrap();
            tensor_core_linear(&mut l, 132);
            (l.kernel, l.grid)
        };
        assert_eq!(lin(4096, 4096, 512), (Kernel::LinearMma64Wide, [64, 4, 1]));
        assert_eq!(lin(1024, 4096, 512), (Kernel::LinearMma64, [16, 8, 1]));
        assert_eq!(
            lin(17_000, 64, 33),
            (Kernel::LinearMma128, [133, 1, 1]),
            "few tokens over very many rows"
        );
        assert_eq!(
            lin(14336, 4096, 512),
            (Kernel::LinearMma128Wide, [112, 4, 1])
        );
        assert_eq!(lin(576, 576, 512), (Kernel::LinearMma64, [9, 8, 1]));
        assert_eq!(
            lin(576, 576, 1),
            (Kernel::LinearMatvec, [72, 1, 1]),
            "decode keeps its kernels"
        );
        assert_eq!(lin(4096, 4096, 1), (Kernel::LinearMatvecSplit, [512, 1, 1]));
        assert_eq!(
            lin(576, 576, MATVEC_MAX_TOKENS),
            (
                Kernel::LinearMatvecTokens,
                [MATVEC_MAX_TOKENS.div_ceil(MATVEC_TOKENS), 72, 1]
            ),
            "a batch of decode steps: each weight row read once per 4 tokens"
        );
        assert_eq!(
            lin(4096, 4096, 6),
            (Kernel::LinearMatvecSplitTokens, [2, 512, 1])
        );
        assert_eq!(
            lin(576, 576, MATVEC_MAX_TOKENS + 1).0,
            Kernel::LinearMma64,
            "a few more tokens than decode takes: tensor cores"
        );
        let mut f32_rows = plan(&Op::Linear(Linear {
            w: &b,
            wtype: GgmlType::F32,
            x: &b,
            y: &b,
            rows: 64,
            cols: 45,
            tokens: 100,
        }))
        .unwrap()
        .unwrap();
        tensor_core_linear(&mut f32_rows, 132);
        assert_eq!(
            f32_rows.kernel,
            Kernel::LinearMatmat,
            "45 columns: f32 tiles"
        );
        assert!(
            f16_activations(&mut f32_rows).is_none(),
            "the f32 tiles read f32 activations"
        );
        // A tensor-core product's activations, rounded to f16 once into the scratch it reads.
        let mut l = plan(&Op::Linear(Linear {
            w: &b,
            wtype: GgmlType::Q4_1,
            x: &b,
            y: &b,
            rows: 4096,
            cols: 4096,
            tokens: 512,
        }))
        .unwrap()
        .unwrap();
        tensor_core_linear(&mut l, 132);
        let f16 = f16_activations(&mut l).expect("a conversion before the product");
        assert_eq!(
            (f16.kernel, f16.grid, f16.staging, f16.buffers.len()),
            (Kernel::ToF16, [1024, 1, 1], 512 * 4096 * 2, 1)
        );
        assert_eq!(l.kernel, Kernel::LinearMma64WideHalf);
        assert_eq!(l.staging, f16.staging, "the product reads what it wrote");
        assert_eq!(
            (l.scratch, f16.scratch),
            (0, 0),
            "not the scratch, whose counts split attention keeps"
        );
        let mut small = plan(&Op::Linear(Linear {
            w: &b,
            wtype: GgmlType::Q4_1,
            x: &b,
            y: &b,
            rows: 1536,
            cols: 576,
            tokens: 2048,
        }))
        .unwrap()
        .unwrap();
        tensor_core_linear(&mut small, 132);
        assert_eq!(small.kernel, Kernel::LinearMma128Wide);
        assert!(
            f16_activations(&mut small).is_none(),
            "1536 rows: the product rounds its own activations"
        );
    }

    #[test]
    fn several_token_split_products_round_their_activations_to_int8_once() {
        let d = cpu();
        let b = d.alloc("b", 4).unwrap();
        let plan_linear = |wtype, rows, cols, tokens| {
            plan(&Op::Linear(Linear {
                w: &b,
                wtype,
                x: &b,
                y: &b,
                rows,
                cols,
                tokens,
            }))
            .unwrap()
            .unwrap()
        };
        let mut l = plan_linear(GgmlType::Q4_1, 4096, 4096, 16);
        assert_eq!(l.kernel, Kernel::LinearMatvecSplitTokens);
        let q8 = int8_activations(&mut l, true).expect("a rounding before the product");
        assert_eq!(
            (q8.kernel, q8.module, q8.grid, q8.staging, q8.buffers.len()),
            (Kernel::ToQ8, OPS, [32, 1, 1], 16 * 4096 * 2, 1),
            "a uint4 per 8 elements, 8 per thread-block row of 256"
        );
        assert_eq!(
            (l.kernel, l.grid, l.staging),
            (
                Kernel::LinearMatvecSplitTokensQ8,
                [16u32.div_ceil(MATVEC_QTOKENS), 512, 1],
                q8.staging
            ),
            "the product reads what it wrote"
        );
        assert_eq!(
            (l.scratch, q8.scratch),
            (0, 0),
            "not the scratch, whose counts split attention keeps"
        );
        for (ty, rows, cols, tokens, int8, why) in [
            (
                GgmlType::Q8_0,
                4096,
                4096,
                16,
                true,
                "Q8_0's split step is f32",
            ),
            (
                GgmlType::Q4_1,
                4096,
                4096,
                16,
                false,
                "activations kept in f32",
            ),
            (
                GgmlType::Q4_1,
                4096,
                4096,
                1,
                true,
                "one token: its own kernel",
            ),
            (
                GgmlType::Q4_1,
                576,
                576,
                4,
                true,
                "short rows: a warp per row",
            ),
        ] {
            let mut l = plan_linear(ty, rows, cols, tokens);
            let before = (l.kernel, l.grid, l.staging);
            assert!(int8_activations(&mut l, int8).is_none(), "{why}");
            assert_eq!((l.kernel, l.grid, l.staging), before, "{why}");
        }
    }

    #[test]
    fn prefill_attention_moves_to_tensor_cores_for_head_sizes_64_and_128() {
        let d = cpu();
        let b = d.alloc("b", 4).unwrap();
        let att = |tokens, head_dim| Attention {
            q: &b,
            k_cache: &b,
            v_cache: &b,
            out: &b,
            heads: 9,
            kv_heads: 3,
            head_dim,
            tokens,
            pos0: 5,
            scale: 0.125,
            window: 0,
            softcap: 0.0,
        };
        let moved = |tokens, head_dim| {
            let mut l = plan(&Op::Attention(att(tokens, head_dim)))
                .unwrap()
                .unwrap();
            tensor_core_attention(&mut l);
            l
        };
        let l = moved(130, 64);
        assert_eq!(l.kernel, Kernel::AttentionMma64);
        assert_eq!((l.grid, l.block), ([9, 3, 1], [128, 1, 1]));
        assert_eq!(moved(512, 128).kernel, Kernel::AttentionMma128);
        assert_eq!(moved(512, 96).kernel, Kernel::Attention, "no tile for 96");
        assert_eq!(
            moved(DECODE_MAX_TOKENS, 64).kernel,
            Kernel::Attention,
            "decode keeps its kernels"
        );
    }

    #[test]
    fn too_many_tokens_for_one_launch_is_an_error() {
        let d = cpu();
        let x = d.alloc("x", 4).unwrap();
        let err = plan(&Op::Rope(Rope {
            x: &x,
            heads: 1,
            head_dim: 2,
            rope_dim: 2,
            tokens: 70_000,
            pos0: 0,
            freq_base: 10000.0,
            neox: false,
            factors: None,
            positions: None,
        }))
        .unwrap_err()
        .to_string();
        assert!(err.contains("exceeds"), "{err}");
    }
}

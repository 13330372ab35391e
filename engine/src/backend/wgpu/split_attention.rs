//! Decode attention split by keys across workgroups (flash-decoding), as the `cuda` backend
//! splits it (`attention_split` there): `attention.wgsl` gives each (head, token) one
//! workgroup, which walks every key alone, so a decode step of the 135M model (9 heads) keeps
//! 9 workgroups busy however long the context. Here each (head, token) gets `splits`
//! workgroups over equal pieces of its keys (`attention_split.wgsl`), and a second pass
//! merges their maxima, sums and weighted values (`attention_merge.wgsl`).

use cairn_shaders as shaders;

use super::plan::{Step, WgpuOp};
use crate::backend::Buffer;
use crate::kernels::op::params;
use crate::kernels::{Attention, OpSpec, PagedAttention};

params!(
    /// What the paged split pair reads: `PagedAttentionParams` with the pieces per (head,
    /// token) in its first padding word.
    PagedSplitParams {
        heads: u32,
        kv_heads: u32,
        head_dim: u32,
        tokens: u32,
        block: u32,
        pool_blocks: u32,
        table_len: u32,
        scale: f32,
        window: u32,
        softcap: f32,
        splits: u32,
        _pad1: u32,
    }
);

/// Up to this many query tokens an attention counts as decode (a batch of sequences' next
/// tokens, or a short verification); longer ones are prefill, whose tokens already give
/// enough workgroups.
pub(crate) const DECODE_TOKENS: u32 = 16;
/// Workgroups a split attention aims at: enough to cover a large GPU's compute units twice
/// (132 multiprocessors on an H100).
pub(crate) const TARGET_WORKGROUPS: u32 = 256;
/// The fewest keys a piece gets: below it the merge costs more than the parallelism gains.
pub(crate) const MIN_PIECE: u32 = 64;

/// Query heads one workgroup of the grouped kernels scores at most (`GQ` in
/// `attention_grouped_walk.wgsl`).
pub(crate) const GROUP_HEADS: u32 = 4;
/// The grouped kernels' default fewest keys a piece: with a quarter of the workgroups (the
/// 8B's 32 query heads share 8 key/value heads), pieces of 32 keys still give the grid as many
/// workgroups as the per-head kernel's pieces of 64 at 512 keys and more.
pub(crate) const GROUPED_MIN_PIECE: u32 = 32;

/// How a cut attention's pieces are scored: one workgroup per query head
/// (`attention_split.wgsl`), or per key/value head for the query heads sharing it
/// (`attention_grouped.wgsl`), with pieces of at least `min_piece` keys.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum FirstPass {
    #[default]
    Heads,
    Grouped {
        min_piece: u32,
    },
}

impl FirstPass {
    /// What runs for an attention of this shape: the grouped kernels read rows as vec4s, so
    /// head sizes that are not a multiple of 4 (and shapes whose heads do not divide into
    /// key/value groups) keep the per-head kernel.
    fn for_shape(self, heads: u32, kv_heads: u32, head_dim: u32) -> FirstPass {
        match self {
            FirstPass::Grouped { .. }
                if kv_heads > 0 && heads.is_multiple_of(kv_heads) && head_dim.is_multiple_of(4) =>
            {
                self
            }
            _ => FirstPass::Heads,
        }
    }

    /// Workgroups per (token, piece).
    fn workgroups(self, heads: u32, kv_heads: u32) -> u32 {
        match self {
            FirstPass::Heads => heads,
            FirstPass::Grouped { .. } => kv_heads * (heads / kv_heads).div_ceil(GROUP_HEADS),
        }
    }

    fn min_piece(self) -> u32 {
        match self {
            FirstPass::Heads => MIN_PIECE,
            FirstPass::Grouped { min_piece } => min_piece.max(1),
        }
    }
}

/// Pieces per (head, token) for `a`, or `None` where it runs as one workgroup each: prefill,
/// or (unless `forced`) a context too short to cut in two pieces of the first pass's
/// fewest keys. `forced` (`--wgpu-attention split`) cuts every decode attention, into as
/// many pieces as the grid aims at, down to one key a piece: the tests run the merge at
/// every length that way.
pub(crate) fn splits(a: &Attention<'_>, forced: bool, pass: FirstPass) -> Option<u32> {
    let pass = pass.for_shape(a.heads, a.kv_heads, a.head_dim);
    let groups = pass.workgroups(a.heads, a.kv_heads);
    pieces(
        groups,
        a.tokens,
        a.pos0 + a.tokens,
        a.window,
        forced,
        pass.min_piece(),
    )
}

/// [`splits`] for paged attention, whose key counts are on the GPU: the keys the table
/// could name (`table_len` blocks) stand for the longest context, the pieces dividing each
/// token's own keys when it runs.
pub(crate) fn paged_splits(a: &PagedAttention<'_>, forced: bool, pass: FirstPass) -> Option<u32> {
    let keys = a.table_len.min(a.pool_blocks).saturating_mul(a.block);
    let pass = pass.for_shape(a.heads, a.kv_heads, a.head_dim);
    let groups = pass.workgroups(a.heads, a.kv_heads);
    pieces(groups, a.tokens, keys, a.window, forced, pass.min_piece())
}

/// `groups`: workgroups per (token, piece).
fn pieces(
    groups: u32,
    tokens: u32,
    keys: u32,
    window: u32,
    forced: bool,
    min_piece: u32,
) -> Option<u32> {
    if tokens == 0 || tokens > DECODE_TOKENS || groups == 0 {
        return None;
    }
    let keys = if window > 0 { keys.min(window) } else { keys };
    let by_grid = TARGET_WORKGROUPS.div_ceil(groups * tokens);
    if forced {
        return Some(by_grid.min(keys).max(1));
    }
    let n = (keys / min_piece).min(by_grid);
    (n >= 2).then_some(n)
}

/// Bytes of the pieces' records: head_dim + 2 floats per (token, head, piece).
pub(crate) fn scratch_bytes(tokens: u32, heads: u32, head_dim: u32, splits: u32) -> u64 {
    u64::from(tokens) * u64::from(heads) * u64::from(splits) * (u64::from(head_dim) + 2) * 4
}

/// The two dispatches of paged attention `a` in `splits` pieces, through `scratch` (at least
/// [`scratch_bytes`]).
pub(crate) fn paged_steps<'a>(
    a: &PagedAttention<'a>,
    splits: u32,
    scratch: &'a Buffer,
    pass: FirstPass,
) -> Vec<Step<'a>> {
    let pass = pass.for_shape(a.heads, a.kv_heads, a.head_dim);
    let o = a.params();
    let p = PagedSplitParams {
        heads: o.heads,
        kv_heads: o.kv_heads,
        head_dim: o.head_dim,
        tokens: o.tokens,
        block: o.block,
        pool_blocks: o.pool_blocks,
        table_len: o.table_len,
        scale: o.scale,
        window: o.window,
        softcap: o.softcap,
        splits,
        _pad1: 0,
    };
    let mut params = [0u32; super::PARAM_WORDS];
    let bytes = bytemuck::bytes_of(&p);
    bytemuck::cast_slice_mut::<u32, u8>(&mut params)[..bytes.len()].copy_from_slice(bytes);
    vec![
        Step::Dispatch {
            kernel: match pass {
                FirstPass::Heads => shaders::PAGED_ATTENTION_SPLIT,
                FirstPass::Grouped { .. } => shaders::PAGED_ATTENTION_GROUPED,
            },
            format: None,
            buffers: vec![a.q, a.k_pool, a.v_pool, a.rows, a.table, scratch],
            params,
            groups: [pass.workgroups(a.heads, a.kv_heads), a.tokens, splits],
        },
        Step::Dispatch {
            kernel: shaders::PAGED_ATTENTION_MERGE,
            format: None,
            buffers: vec![scratch, a.out],
            params,
            groups: [a.heads, a.tokens, 1],
        },
    ]
}

/// The two dispatches of `a` in `splits` pieces, through `scratch` (at least
/// [`scratch_bytes`]).
pub(crate) fn steps<'a>(
    a: &Attention<'a>,
    splits: u32,
    scratch: &'a Buffer,
    pass: FirstPass,
) -> Vec<Step<'a>> {
    debug_assert!(Attention::KERNELS.contains(&shaders::ATTENTION_SPLIT));
    debug_assert!(Attention::KERNELS.contains(&shaders::ATTENTION_GROUPED));
    let pass = pass.for_shape(a.heads, a.kv_heads, a.head_dim);
    let mut params = [0u32; super::PARAM_WORDS];
    let p = crate::kernels::attention::AttentionParams {
        splits,
        ..a.params()
    };
    let bytes = bytemuck::bytes_of(&p);
    bytemuck::cast_slice_mut::<u32, u8>(&mut params)[..bytes.len()].copy_from_slice(bytes);
    vec![
        Step::Dispatch {
            kernel: match pass {
                FirstPass::Heads => shaders::ATTENTION_SPLIT,
                FirstPass::Grouped { .. } => shaders::ATTENTION_GROUPED,
            },
            format: None,
            buffers: vec![a.q, a.k_cache, a.v_cache, scratch],
            params,
            groups: [pass.workgroups(a.heads, a.kv_heads), a.tokens, splits],
        },
        Step::Dispatch {
            kernel: shaders::ATTENTION_MERGE,
            format: None,
            buffers: vec![scratch, a.out],
            params,
            groups: [a.heads, a.tokens, 1],
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cut follows the context: none for prefill or a short context, more pieces for a
    /// longer one up to the target grid, and a window bounds the keys cut.
    #[test]
    fn pieces_follow_context_grid_and_window() {
        let d = crate::backend::Device::new_cpu(crate::device::info::describe_cpu());
        let b = d.alloc("b", 4).unwrap();
        let at_pass = |heads, kv_heads, tokens, pos0, window, forced, pass| {
            splits(
                &Attention {
                    q: &b,
                    k_cache: &b,
                    v_cache: &b,
                    out: &b,
                    heads,
                    kv_heads,
                    head_dim: 64,
                    tokens,
                    pos0,
                    scale: 1.0,
                    window,
                    softcap: 0.0,
                },
                forced,
                pass,
            )
        };
        let at_forced = |heads, tokens, pos0, window, forced| {
            at_pass(heads, 1, tokens, pos0, window, forced, FirstPass::Heads)
        };
        let at = |heads, tokens, pos0, window| at_forced(heads, tokens, pos0, window, false);
        assert_eq!(at(9, 1, 0, 0), None);
        assert_eq!(at(9, 1, 126, 0), None);
        assert_eq!(at(9, 1, 127, 0), Some(2));
        // 135M at 640 keys: 10 pieces of 64.
        assert_eq!(at(9, 1, 639, 0), Some(10));
        // 8B's 32 heads: the grid caps it at 8.
        assert_eq!(at(32, 1, 4095, 0), Some(8));
        // Prefill is not cut.
        assert_eq!(at(9, 64, 4096, 0), None);
        // A window of 100 keys is too short to cut.
        assert_eq!(at(9, 1, 4095, 100), None);
        // Forced: any decode length, one key a piece at most, prefill still whole.
        assert_eq!(at_forced(9, 1, 0, 0, true), Some(1));
        assert_eq!(at_forced(9, 1, 4, 0, true), Some(5));
        assert_eq!(at_forced(9, 1, 4095, 0, true), Some(29));
        assert_eq!(at_forced(9, 64, 4095, 0, true), None);
        // Grouped: the 8B's 32 heads over 8 key/value heads are 8 workgroups a piece, so
        // 512 keys make 16 pieces of 32 (the grid would take 32); 135M's 9 over 3 are 3.
        let grouped = FirstPass::Grouped {
            min_piece: GROUPED_MIN_PIECE,
        };
        assert_eq!(at_pass(32, 8, 1, 511, 0, false, grouped), Some(16));
        assert_eq!(at_pass(32, 8, 1, 4095, 0, false, grouped), Some(32));
        assert_eq!(at_pass(9, 3, 1, 4095, 0, false, grouped), Some(86));
        assert_eq!(at_pass(9, 3, 1, 62, 0, false, grouped), None);
        // 64 query heads over 8: two workgroups per key/value head.
        assert_eq!(at_pass(64, 8, 1, 4095, 0, false, grouped), Some(16));
        // Pieces of at least 16 where asked for.
        let small = FirstPass::Grouped { min_piece: 16 };
        assert_eq!(at_pass(32, 8, 1, 511, 0, false, small), Some(32));
        // Heads that do not divide into groups keep the per-head grid.
        assert_eq!(at_pass(9, 2, 1, 4095, 0, false, grouped), Some(29));
    }

    /// The grouped pass dispatches its own kernel over key/value heads (and groups of at most
    /// 4 query heads), the same merge after it; head sizes not of 4s keep the per-head kernel.
    #[test]
    fn grouped_pass_dispatches_per_key_value_head() {
        let d = crate::backend::Device::new_cpu(crate::device::info::describe_cpu());
        let b = d.alloc("b", 4).unwrap();
        let first = |heads, kv_heads, head_dim| {
            let a = Attention {
                q: &b,
                k_cache: &b,
                v_cache: &b,
                out: &b,
                heads,
                kv_heads,
                head_dim,
                tokens: 2,
                pos0: 100,
                scale: 1.0,
                window: 0,
                softcap: 0.0,
            };
            let pass = FirstPass::Grouped { min_piece: 32 };
            let steps = steps(&a, 3, &b, pass);
            let kernels: Vec<(&str, [u32; 3])> = steps
                .iter()
                .map(|s| match s {
                    Step::Dispatch { kernel, groups, .. } => (kernel.name, *groups),
                    _ => panic!("a copy"),
                })
                .collect();
            kernels
        };
        assert_eq!(
            first(32, 8, 128),
            [
                ("attention_grouped", [8, 2, 3]),
                ("attention_merge", [32, 2, 1])
            ]
        );
        assert_eq!(
            first(64, 8, 128),
            [
                ("attention_grouped", [16, 2, 3]),
                ("attention_merge", [64, 2, 1])
            ]
        );
        assert_eq!(
            first(9, 3, 42),
            [
                ("attention_split", [9, 2, 3]),
                ("attention_merge", [9, 2, 1])
            ]
        );
    }
}

//! Weights repacked at upload (`--wgpu-matvec repacked`) so the matrix-vector kernels can
//! load a block's quants as one 16-byte word: GGUF's Q4_0, Q4_1 and Q8_0 blocks are 18, 20
//! and 34 bytes, scales and quants interleaved, which allows 4-byte loads at best (2-byte
//! aligned ones for Q4_0 and Q8_0). Here a tensor's blocks, counted across its rows, go in
//! groups whose scales come first in one 16-byte word and whose quants follow, 16 (Q4) or 32
//! (Q8_0) bytes a block, so every block's quants start on 16 bytes. A group holds as many
//! bytes as its blocks did (Q4_1: 4 blocks in 80 bytes; Q4_0: 8 in 144; Q8_0: 8 in 272); the
//! last group of a tensor is padded with zeros.
//!
//! Every kernel that reads a weight buffer takes the repacked layout as a format of its own
//! (`Q4_0R`, `Q4_1R`, `Q8_0R`: `shaders/formats/*r.wgsl`, whose `w_load1`/`w_load4` find a
//! block from the native row offset they are given), so prefill, batches, the fused kernels
//! and the embedding lookups keep working; the streaming matrix-vector kernels over rows of
//! at least [`VEC4_MIN_COLS`] switch to their `vec4` variants (`shaders/stream_walk_v4.wgsl`),
//! a block a step. The packed-integer kernels do not take it (`repacked` leaves them off).

use cairn_shaders::{self as shaders, Kernel};

use super::plan::Step;

/// Rows of at least this many elements (64 blocks: one for each invocation of a workgroup)
/// run the `vec4` streaming kernels; shorter ones the 8-weight walk over the same layout,
/// whose 64 invocations still find a chunk each.
pub(crate) const VEC4_MIN_COLS: u32 = 2048;

/// (blocks a group, bytes of a block's scales in the group's header, bytes of a block's
/// quants, bytes of a native block) of a format that is repacked.
fn geometry(format: &str) -> Option<(usize, usize, usize, usize)> {
    match format {
        "Q4_1" => Some((4, 4, 16, 20)),
        "Q4_0" => Some((8, 2, 16, 18)),
        "Q8_0" => Some((8, 2, 32, 34)),
        _ => None,
    }
}

/// Whether `format` (a GGML type name) is repacked.
pub(crate) fn repacks(format: &str) -> bool {
    geometry(format).is_some() && shaders::repacked(format).is_some()
}

/// Bytes of `native` bytes of `format`'s blocks once repacked (the last group padded).
pub(crate) fn repacked_len(format: &str, native: usize) -> Option<usize> {
    let (per_group, _, _, block) = geometry(format)?;
    let blocks = native / block;
    Some(blocks.div_ceil(per_group) * per_group * block)
}

/// `data` (whole blocks of `format`) in the repacked layout; `None` where `format` is not
/// repacked or `data` is not whole blocks.
pub(crate) fn repack(format: &str, data: &[u8]) -> Option<Vec<u8>> {
    let (per_group, scale, quants, block) = geometry(format)?;
    if !data.len().is_multiple_of(block) {
        return None;
    }
    let mut out = vec![0u8; repacked_len(format, data.len())?];
    let group = per_group * block;
    for (k, b) in data.chunks_exact(block).enumerate() {
        let (g, j) = (k / per_group * group, k % per_group);
        out[g + j * scale..][..scale].copy_from_slice(&b[..scale]);
        out[g + 16 + j * quants..][..quants].copy_from_slice(&b[scale..]);
    }
    Some(out)
}

/// The streaming kernel's `vec4` variant, for a product over rows of `cols` elements.
fn vec4_variant(kernel: Kernel, cols: u32) -> Kernel {
    if cols < VEC4_MIN_COLS {
        return kernel;
    }
    let pairs = [
        (
            shaders::LINEAR_MATVEC_STREAM,
            shaders::LINEAR_MATVEC_STREAM_V4,
        ),
        (
            shaders::LINEAR_MATVEC_STREAM_SUBGROUP,
            shaders::LINEAR_MATVEC_STREAM_V4_SUBGROUP,
        ),
        (
            shaders::LINEAR_MATVEC_BATCH,
            shaders::LINEAR_MATVEC_BATCH_V4,
        ),
        (
            shaders::LINEAR_MATVEC_BATCH_SUBGROUP,
            shaders::LINEAR_MATVEC_BATCH_V4_SUBGROUP,
        ),
        (
            shaders::LINEAR_MATVEC_FUSED_STREAM,
            shaders::LINEAR_MATVEC_FUSED_STREAM_V4,
        ),
        (
            shaders::LINEAR_MATVEC_FUSED_STREAM_SUBGROUP,
            shaders::LINEAR_MATVEC_FUSED_STREAM_V4_SUBGROUP,
        ),
    ];
    pairs
        .iter()
        .find(|(k, _)| *k == kernel)
        .map_or(kernel, |(_, v)| *v)
}

/// Points every dispatch that binds a repacked buffer (`is_repacked`, by buffer id) at the
/// repacked format, and the streaming kernels at their `vec4` variants where the rows are
/// long enough. Every kernel that takes a weight format declares the parameters `rows, cols`
/// first, so the columns are the second word.
pub(crate) fn retarget(steps: &mut [Step<'_>], is_repacked: impl Fn(u64) -> bool) {
    for step in steps {
        let Step::Dispatch {
            kernel,
            format,
            buffers,
            params,
            ..
        } = step
        else {
            continue;
        };
        let Some(f) = *format else { continue };
        if !buffers.iter().any(|b| is_repacked(b.id())) {
            continue;
        }
        if let Some(r) = shaders::repacked(f) {
            *format = Some(r);
            *kernel = vec4_variant(*kernel, params[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks whose every byte says where it came from: (block, byte) -> a distinct value.
    fn blocks(n: usize, block: usize) -> Vec<u8> {
        (0..n * block).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn every_block_lands_in_its_group_with_scales_first() {
        for (format, n) in [("Q4_1", 9), ("Q4_0", 17), ("Q8_0", 3)] {
            let (per_group, scale, quants, block) = geometry(format).unwrap();
            let data = blocks(n, block);
            let out = repack(format, &data).unwrap();
            assert_eq!(out.len(), n.div_ceil(per_group) * per_group * block);
            // The header's scales fill 16 bytes, and quants start on 16.
            assert_eq!(per_group * scale, 16, "{format}");
            assert_eq!(16 + per_group * quants, per_group * block, "{format}");
            for k in 0..n {
                let b = &data[k * block..][..block];
                let g = k / per_group * per_group * block;
                let j = k % per_group;
                assert_eq!(&out[g + j * scale..][..scale], &b[..scale], "{format} {k}");
                let q = g + 16 + j * quants;
                assert_eq!(q % 16, 0);
                assert_eq!(&out[q..][..quants], &b[scale..], "{format} {k}");
            }
            // The padding of the last group is zeros.
            let used = (n - 1) / per_group * per_group * block;
            let tail_blocks = n - (n - 1) / per_group * per_group;
            assert!(
                out[used + 16 + tail_blocks * quants..]
                    .iter()
                    .all(|&b| b == 0)
            );
        }
    }

    #[test]
    fn only_whole_blocks_of_the_three_formats_are_repacked() {
        assert!(repack("Q4_1", &[0u8; 21]).is_none());
        assert!(repack("Q4_K", &[0u8; 144]).is_none());
        assert!(repack("F32", &[0u8; 16]).is_none());
        assert!(repacks("Q8_0") && repacks("Q4_0") && repacks("Q4_1") && !repacks("Q5_0"));
    }
}

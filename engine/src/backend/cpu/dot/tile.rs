//! Prefill's weight tiles: up to [`TILE`] rows of a quantized matrix unpacked once into
//! unsigned bytes, laid out so that one 64-byte vector holds four consecutive elements of
//! each of the 16 rows. A kernel then multiplies that vector by one token's four activation
//! bytes broadcast to every lane (`vpdpbusd` with a broadcast operand on AVX-512, `maddubs`
//! on AVX2), and each i32 lane accumulates its own row: no horizontal sums, and the per-block
//! scales are vectors of the 16 rows' scales times the token's one. Every token of the
//! prompt runs against the tile while it sits in L1, so each weight block is unpacked once
//! per op instead of once per token or per four tokens.
//!
//! Every format becomes the same thing: blocks of `len` elements (32, or 16 for the K-quants
//! whose scales are per 16) holding unsigned quants `u`, a step `dw` and an offset `mw`, so
//! that element `i` of a block is `dw·u_i + mw`. Its product with a token's int8 block
//! (step `dx`, `sx = dx·Σq`) is `dw·dx·Σu·q + mw·sx`: the offset (Q4_0's 8, Q8_0's 128 after
//! its sign flip, a K-quant's minimum) goes through the activations' block sum, as in the
//! one-token kernels. This is the idea of llama.cpp's repacked "8x8" layouts (ggml-cpu's
//! repack.cpp), done per op in a thread's own buffer rather than once at load, so the file's
//! weights stay as they are for decode.

use std::ops::Range;

use crate::backend::cpu::q8::{GROUP, Q8, QK, QK_K};
use crate::quant::GgmlType;
use crate::quant::kquants::{q3_k_scales, scale_min_k4};

use super::scalar::f16_at;

/// Rows per tile: one 512-bit vector of i32 lanes.
pub(crate) const TILE: usize = 16;

/// How a format's blocks unpack: `unpack(block, words, dw, mw)` writes the block's
/// `sub`-element pieces, each as `sub / 4` little-endian words of four unsigned quants, and
/// each piece's step and offset.
#[derive(Clone, Copy)]
pub(crate) struct Format {
    /// Bytes and elements of one of the file's blocks.
    pub(crate) bytes: usize,
    len: usize,
    /// Elements per piece with one step and offset: 32, or 16.
    pub(crate) sub: usize,
    pub(crate) ty: GgmlType,
}

impl Format {
    /// The tile layout of `ty`, where there is one (every block-quantized format).
    pub(crate) fn of(ty: GgmlType) -> Option<Format> {
        let sub = match ty {
            GgmlType::F32 | GgmlType::F16 => return None,
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q6_K => 16,
            _ => 32,
        };
        Some(Format {
            bytes: ty.block_bytes(),
            len: ty.block_len(),
            sub,
            ty,
        })
    }
}

/// Up to [`TILE`] weight rows, unpacked: `q[(b·groups + g)·16 + r]` holds elements
/// `4g..4g + 4` of piece `b` of row `r`; `dw`, `mw` hold each piece's step and offset per
/// row. Rows past `rows` are zeros. Reused from tile to tile, so its vectors only grow.
#[derive(Default)]
pub(crate) struct Tile {
    pub(crate) rows: usize,
    /// Pieces per row.
    pub(crate) blocks: usize,
    /// Words (four elements) per piece: 8 or 4.
    pub(crate) groups: usize,
    pub(crate) q: Vec<u32>,
    pub(crate) dw: Vec<f32>,
    pub(crate) mw: Vec<f32>,
}

impl Tile {
    /// Unpacks rows `rows` (at most [`TILE`]) of `w`, `row_bytes` each.
    pub(crate) fn fill(&mut self, f: Format, w: &[u8], row_bytes: usize, rows: Range<usize>) {
        // One copy of the loop per format, so the unpacking inlines into it.
        match f.ty {
            GgmlType::F32 | GgmlType::F16 => {}
            GgmlType::Q4_0 => self.fill_with(f, w, row_bytes, rows, q4_0),
            GgmlType::Q4_1 => self.fill_with(f, w, row_bytes, rows, q4_1),
            GgmlType::Q5_0 => self.fill_with(f, w, row_bytes, rows, q5_0),
            GgmlType::Q5_1 => self.fill_with(f, w, row_bytes, rows, q5_1),
            GgmlType::Q8_0 => self.fill_with(f, w, row_bytes, rows, q8_0),
            GgmlType::Q2_K => self.fill_with(f, w, row_bytes, rows, q2_k),
            GgmlType::Q3_K => self.fill_with(f, w, row_bytes, rows, q3_k),
            GgmlType::Q4_K => self.fill_with(f, w, row_bytes, rows, q4_k),
            GgmlType::Q5_K => self.fill_with(f, w, row_bytes, rows, q5_k),
            GgmlType::Q6_K => self.fill_with(f, w, row_bytes, rows, q6_k),
        }
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    /// Sizes the tile for `rows.len()` rows of `row_bytes` in format `f` (contents
    /// unspecified) and returns its quants, steps and offsets.
    pub(crate) fn prepare(
        &mut self,
        f: Format,
        row_bytes: usize,
        rows: usize,
    ) -> (&mut [u32], &mut [f32], &mut [f32]) {
        let per_block = f.len / f.sub;
        self.rows = rows;
        self.blocks = row_bytes / f.bytes * per_block;
        self.groups = f.sub / 4;
        self.q.resize(self.blocks * self.groups * TILE, 0);
        self.dw.resize(self.blocks * TILE, 0.0);
        self.mw.resize(self.blocks * TILE, 0.0);
        (
            &mut self.q[..self.blocks * self.groups * TILE],
            &mut self.dw[..self.blocks * TILE],
            &mut self.mw[..self.blocks * TILE],
        )
    }

    fn fill_with(
        &mut self,
        f: Format,
        w: &[u8],
        row_bytes: usize,
        rows: Range<usize>,
        unpack: impl Fn(&[u8], &mut [u32], &mut [f32], &mut [f32]),
    ) {
        debug_assert!(rows.len() <= TILE && row_bytes.is_multiple_of(f.bytes));
        let per_block = f.len / f.sub;
        let groups = f.sub / 4;
        let blocks = row_bytes / f.bytes * per_block;
        self.rows = rows.len();
        self.blocks = blocks;
        self.groups = groups;
        self.q.clear();
        self.q.resize(blocks * groups * TILE, 0);
        self.dw.clear();
        self.dw.resize(blocks * TILE, 0.0);
        self.mw.clear();
        self.mw.resize(blocks * TILE, 0.0);
        let mut words = [0u32; QK_K / 4];
        let mut dw = [0f32; QK_K / GROUP];
        let mut mw = [0f32; QK_K / GROUP];
        let (words, dw, mw) = (
            &mut words[..per_block * groups],
            &mut dw[..per_block],
            &mut mw[..per_block],
        );
        for (r, row) in rows.enumerate() {
            let row = &w[row * row_bytes..][..row_bytes];
            for (i, block) in row.chunks_exact(f.bytes).enumerate() {
                unpack(block, words, dw, mw);
                let first = i * per_block;
                for (j, &v) in words.iter().enumerate() {
                    self.q[(first * groups + j) * TILE + r] = v;
                }
                for p in 0..per_block {
                    self.dw[(first + p) * TILE + r] = dw[p];
                    self.mw[(first + p) * TILE + r] = mw[p];
                }
            }
        }
    }
}

/// The prompt's activations as the tile kernels read them: every token's int8 values, and
/// per piece of `sub` elements its step `d` and `s = d·Σq`, token-major.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) struct Acts<'a> {
    pub(crate) qs: &'a [i8],
    pub(crate) d: &'a [f32],
    pub(crate) s: &'a [f32],
    pub(crate) cols: usize,
    /// Pieces per token.
    pub(crate) blocks: usize,
}

impl<'a> Acts<'a> {
    /// `q8`'s `tokens` rows seen in pieces of `sub` elements. The 32-element layout has them
    /// already; the K-quants' 256-element layout gets them from its step and 16-element sums,
    /// written into `d` and `s`.
    pub(crate) fn new(
        q8: &'a Q8,
        sub: usize,
        tokens: usize,
        d: &'a mut Vec<f32>,
        s: &'a mut Vec<f32>,
    ) -> Acts<'a> {
        let (qs, steps, sums, bsums, cols) = q8.parts();
        let blocks = cols / sub;
        let qs = &qs[..tokens * cols];
        if bsums.is_empty() {
            debug_assert_eq!(sub, QK);
            return Acts {
                qs,
                d: &steps[..tokens * blocks],
                s: &sums[..tokens * blocks],
                cols,
                blocks,
            };
        }
        // One step per 256 elements, one sum per 16: a piece of 32 adds two sums.
        let per_super = QK_K / sub;
        let sums_per = sub / GROUP;
        d.clear();
        s.clear();
        for i in 0..tokens * blocks {
            let step = steps[i / per_super];
            let sum: i32 = bsums[i * sums_per..][..sums_per]
                .iter()
                .map(|&v| i32::from(v))
                .sum();
            d.push(step);
            s.push(step * sum as f32);
        }
        Acts {
            qs,
            d,
            s,
            cols,
            blocks,
        }
    }
}

/// Four activation bytes as one i32 (what the kernels broadcast to every lane).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn word(x: &[i8], at: usize) -> i32 {
    let v = &x[at..at + 4];
    i32::from_le_bytes([v[0] as u8, v[1] as u8, v[2] as u8, v[3] as u8])
}

/// The little-endian u32 at `b[at..at + 4]`.
#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    let v = &b[at..at + 4];
    u32::from_le_bytes([v[0], v[1], v[2], v[3]])
}

const LOW4: u32 = 0x0f0f_0f0f;
const BIT0: u32 = 0x0101_0101;

/// A 32-element block's 16 bytes of nibbles at `at`: words 0..4 the low nibbles (elements
/// 0..16), 4..8 the high ones.
#[inline(always)]
fn nibbles(b: &[u8], at: usize, words: &mut [u32]) {
    for k in 0..4 {
        let v = u32_at(b, at + 4 * k);
        words[k] = v & LOW4;
        words[k + 4] = (v >> 4) & LOW4;
    }
}

/// Four bits as four bytes, 16 in byte `i` where bit `i` is set.
const SPREAD: [u32; 16] = {
    let mut t = [0u32; 16];
    let mut i = 0;
    while i < 16 {
        let mut b = 0;
        while b < 4 {
            if i & (1 << b) != 0 {
                t[i] |= 0x10 << (8 * b);
            }
            b += 1;
        }
        i += 1;
    }
    t
};

/// Q5's fifth bits (one per element, 32 in the u32 at `at`) as 16 added to each element.
#[inline(always)]
fn fifth_bits(b: &[u8], at: usize, words: &mut [u32]) {
    let qh = u32_at(b, at);
    for (g, w) in words[..8].iter_mut().enumerate() {
        *w |= SPREAD[((qh >> (4 * g)) & 0x0f) as usize];
    }
}

fn q4_0(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    nibbles(b, 2, words);
    dw[0] = f16_at(b, 0);
    mw[0] = -8.0 * dw[0];
}

fn q4_1(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    nibbles(b, 4, words);
    dw[0] = f16_at(b, 0);
    mw[0] = f16_at(b, 2);
}

fn q5_0(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    nibbles(b, 6, words);
    fifth_bits(b, 2, words);
    dw[0] = f16_at(b, 0);
    mw[0] = -16.0 * dw[0];
}

fn q5_1(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    nibbles(b, 8, words);
    fifth_bits(b, 4, words);
    dw[0] = f16_at(b, 0);
    mw[0] = f16_at(b, 2);
}

/// Signed bytes plus 128 (the sign bit flipped), 128 taken off through the offset.
fn q8_0(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    for (g, w) in words[..8].iter_mut().enumerate() {
        *w = u32_at(b, 2 + 4 * g) ^ 0x8080_8080;
    }
    dw[0] = f16_at(b, 0);
    mw[0] = -128.0 * dw[0];
}

/// Element `e` of a 256-element block whose 2-bit fields are packed as Q2_K's and Q3_K's
/// (four per byte across 32-byte runs): the word of elements `e..e + 4`.
#[inline(always)]
fn two_bits(qs: &[u8], e: usize) -> u32 {
    let (h, j, l) = (e / 128, (e / 32) % 4, e % 32);
    (u32_at(qs, 32 * h + l) >> (2 * j)) & 0x0303_0303
}

fn q2_k(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (i, w) in words[..64].iter_mut().enumerate() {
        *w = two_bits(qs, 4 * i);
    }
    for (s, &sc) in scales.iter().enumerate() {
        dw[s] = d * f32::from(sc & 0x0f);
        mw[s] = -dmin * f32::from(sc >> 4);
    }
}

/// Q3_K: the 2-bit field plus 4 where the high-mask bit is set, in 0..8; 4 taken off.
fn q3_k(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    let (hmask, qs) = (&b[..32], &b[32..96]);
    let scales = q3_k_scales(&b[96..108]);
    let d = f16_at(b, 108);
    for (i, w) in words[..64].iter_mut().enumerate() {
        let e = 4 * i;
        let (h, j, l) = (e / 128, (e / 32) % 4, e % 32);
        let high = (u32_at(hmask, l) >> (4 * h + j)) & BIT0;
        *w = two_bits(qs, e) | (high << 2);
    }
    for (s, &sc) in scales.iter().enumerate() {
        dw[s] = d * f32::from(sc);
        mw[s] = -4.0 * dw[s];
    }
}

/// Q4_K and Q5_K: the nibbles at `qs` (sub-blocks 2c and 2c + 1 share 32 bytes, low and high
/// nibbles), Q5_K's fifth bits at `qh` (bit `2c + h` of byte `l`).
#[inline(always)]
fn k4(b: &[u8], qh: Option<usize>, qs: usize, words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for sub in 0..8 {
        let (sc, m) = scale_min_k4(sub, &b[4..16]);
        dw[sub] = d * f32::from(sc);
        mw[sub] = -dmin * f32::from(m);
        let (c, h) = (sub / 2, sub % 2);
        for g in 0..8 {
            let mut w = (u32_at(b, qs + 32 * c + 4 * g) >> (4 * h)) & LOW4;
            if let Some(qh) = qh {
                w |= ((u32_at(b, qh + 4 * g) >> (2 * c + h)) & BIT0) << 4;
            }
            words[8 * sub + g] = w;
        }
    }
}

fn q4_k(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    k4(b, None, 16, words, dw, mw);
}

fn q5_k(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    k4(b, Some(16), 48, words, dw, mw);
}

/// Q6_K: six-bit quants stored as `q + 32`, in 16-element pieces with signed 8-bit scales.
fn q6_k(b: &[u8], words: &mut [u32], dw: &mut [f32], mw: &mut [f32]) {
    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (i, w) in words[..64].iter_mut().enumerate() {
        let e = 4 * i;
        let (n, k, l) = (e / 128, (e / 32) % 4, e % 32);
        let low = (u32_at(ql, 64 * n + 32 * (k % 2) + l) >> (4 * (k / 2))) & LOW4;
        let high = (u32_at(qh, 32 * n + l) >> (2 * k)) & 0x0303_0303;
        *w = low | (high << 4);
    }
    for (s, &sc) in scales.iter().enumerate() {
        dw[s] = d * f32::from(sc as i8);
        mw[s] = -32.0 * dw[s];
    }
}

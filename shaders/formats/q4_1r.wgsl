// Q4_1 repacked at upload (`--wgpu-matvec repacked`, backend/wgpu/repack.rs): the tensor's
// blocks, counted across rows, in groups of 4 of 80 bytes: the 4 blocks' (d, m) f16 pairs
// (one word each), then their 16 bytes of nibbles each, as in Q4_1. Every group's quants
// start on 16 bytes, so the vec4 kernels (chunks_v4/) load a block's quants in one load.
// `row` is still the row's byte offset in the native layout (r * 20 * blocks a row).
fn q41r_words(row: u32, e: u32) -> vec2<u32> {
    let k = row / 20u + (e >> 5u);
    let g = (k >> 2u) * 20u;
    return vec2<u32>(g + (k & 3u), g + 4u + (k & 3u) * 4u);
}

fn w_load1(row: u32, e: u32) -> f32 {
    let at = q41r_words(row, e);
    let dm = unpack2x16float(w[at.x]);
    let j = e & 31u;
    let byte = (w[at.y + ((j & 15u) >> 2u)] >> ((j & 3u) * 8u)) & 0xffu;
    let q = select(byte & 15u, byte >> 4u, j >= 16u);
    return dm.x * f32(q) + dm.y;
}

fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let at = q41r_words(row, e);
    let dm = unpack2x16float(w[at.x]);
    let j = e & 31u;
    let word = w[at.y + ((j & 15u) >> 2u)];
    let nib = select(word, word >> 4u, j >= 16u);
    let q = vec4<u32>(nib, nib >> 8u, nib >> 16u, nib >> 24u) & vec4<u32>(15u);
    return dm.x * vec4<f32>(q) + vec4<f32>(dm.y);
}

// Q4_0 repacked at upload (`--wgpu-matvec repacked`, backend/wgpu/repack.rs): the tensor's
// blocks, counted across rows, in groups of 8 of 144 bytes: the 8 blocks' f16 scales (16
// bytes), then their 16 bytes of nibbles each, as in Q4_0. Every load is word-aligned, and
// every block's quants start on 16 bytes (one load in the vec4 kernels, chunks_v4/).
// `row` is still the row's byte offset in the native layout (r * 18 * blocks a row).
fn q40r_words(row: u32, e: u32) -> vec2<u32> {
    let k = row / 18u + (e >> 5u);
    let g = (k >> 3u) * 36u;
    return vec2<u32>(g + ((k & 7u) >> 1u) + ((k & 1u) << 31u), g + 4u + (k & 7u) * 4u);
}

fn q40r_scale(at: u32) -> f32 {
    return unpack2x16float(w[at & 0x7fffffffu])[at >> 31u];
}

fn w_load1(row: u32, e: u32) -> f32 {
    let at = q40r_words(row, e);
    let j = e & 31u;
    let byte = (w[at.y + ((j & 15u) >> 2u)] >> ((j & 3u) * 8u)) & 0xffu;
    let q = select(byte & 15u, byte >> 4u, j >= 16u);
    return q40r_scale(at.x) * (f32(q) - 8.0);
}

fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let at = q40r_words(row, e);
    let j = e & 31u;
    let word = w[at.y + ((j & 15u) >> 2u)];
    let nib = select(word, word >> 4u, j >= 16u);
    let q = vec4<u32>(nib, nib >> 8u, nib >> 16u, nib >> 24u) & vec4<u32>(15u);
    return q40r_scale(at.x) * (vec4<f32>(q) - vec4<f32>(8.0));
}

// Q8_0 repacked at upload (`--wgpu-matvec repacked`, backend/wgpu/repack.rs): the tensor's
// blocks, counted across rows, in groups of 8 of 272 bytes: the 8 blocks' f16 scales (16
// bytes), then their 32 signed bytes each, as in Q8_0. Every load is word-aligned, and every
// block's quants start on 16 bytes (two loads in the vec4 kernels, chunks_v4/).
// `row` is still the row's byte offset in the native layout (r * 34 * blocks a row).
fn q80r_words(row: u32, e: u32) -> vec2<u32> {
    let k = row / 34u + (e >> 5u);
    let g = (k >> 3u) * 68u;
    return vec2<u32>(g + ((k & 7u) >> 1u) + ((k & 1u) << 31u), g + 4u + (k & 7u) * 8u);
}

fn q80r_scale(at: u32) -> f32 {
    return unpack2x16float(w[at & 0x7fffffffu])[at >> 31u];
}

fn w_load1(row: u32, e: u32) -> f32 {
    let at = q80r_words(row, e);
    let j = e & 31u;
    let byte = (w[at.y + (j >> 2u)] >> ((j & 3u) * 8u)) & 0xffu;
    return q80r_scale(at.x) * f32(i32(byte << 24u) >> 24u);
}

// `e` is a multiple of 4 (as every caller's is).
fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let at = q80r_words(row, e);
    let q = w[at.y + ((e & 31u) >> 2u)];
    let v = vec4<i32>(i32(q << 24u), i32(q << 16u), i32(q << 8u), i32(q)) >> vec4<u32>(24u);
    return q80r_scale(at.x) * vec4<f32>(v);
}

// Q4_K: 32 chunks per 144-byte super-block, chunk k its k-th word of nibbles (byte
// 32 (k / 8) + 4 (k % 8)): the low nibbles are elements 64 (k / 8) + 4 (k % 8) .. + 3 of
// sub-block 2 (k / 8), the high ones 32 further on, of the next sub-block. Super-blocks are
// word-aligned.
fn chunk_at(c: u32) -> vec2<u32> {
    let k = c & 31u;
    let e = (c >> 5u) * 256u + (k >> 3u) * 64u + (k & 7u) * 4u;
    return vec2<u32>(e, e + 32u);
}

fn w_chunk(row: u32, c: u32) -> W8 {
    let blk = row + (c >> 5u) * 144u;
    let k = c & 31u;
    let g = k >> 3u;
    let q = bytes4(w[(blk >> 2u) + 4u + 8u * g + (k & 7u)]);
    let dm = unpack2x16float(w[blk >> 2u]);
    let s0 = scale_min_k4(blk + 4u, 2u * g);
    let s1 = scale_min_k4(blk + 4u, 2u * g + 1u);
    let lo = dm.x * s0.x * vec4<f32>(q & vec4<u32>(15u)) - vec4<f32>(dm.y * s0.y);
    let hi = dm.x * s1.x * vec4<f32>(q >> vec4<u32>(4u)) - vec4<f32>(dm.y * s1.y);
    return W8(lo, hi);
}

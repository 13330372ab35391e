// Q4_1: chunk c is word c % 4 of block c / 4's nibbles, as Q4_0; blocks are word-aligned.
fn chunk_at(c: u32) -> vec2<u32> {
    let e = (c >> 2u) * 32u + (c & 3u) * 4u;
    return vec2<u32>(e, e + 16u);
}

fn w_chunk(row: u32, c: u32) -> W8 {
    let blk = (row >> 2u) + (c >> 2u) * 5u;
    let dm = unpack2x16float(w[blk]);
    let q = bytes4(w[blk + 1u + (c & 3u)]);
    let lo = dm.x * vec4<f32>(q & vec4<u32>(15u)) + vec4<f32>(dm.y);
    let hi = dm.x * vec4<f32>(q >> vec4<u32>(4u)) + vec4<f32>(dm.y);
    return W8(lo, hi);
}

// Q4_0: chunk c is word c % 4 of block c / 4's 16 bytes of nibbles: elements 4k .. 4k + 3 in
// the low nibbles and 16 + 4k .. in the high ones.
fn chunk_at(c: u32) -> vec2<u32> {
    let e = (c >> 2u) * 32u + (c & 3u) * 4u;
    return vec2<u32>(e, e + 16u);
}

fn w_chunk(row: u32, c: u32) -> W8 {
    let blk = row + (c >> 2u) * 18u;
    let q = bytes4(load_u32_at(blk + 2u + (c & 3u) * 4u));
    let d = load_f16_at(blk);
    let lo = vec4<f32>(q & vec4<u32>(15u)) - vec4<f32>(8.0);
    let hi = vec4<f32>(q >> vec4<u32>(4u)) - vec4<f32>(8.0);
    return W8(d * lo, d * hi);
}

// Q8_0: chunk c is elements 8c .. 8c + 7, two words of block c / 4's bytes.
fn chunk_at(c: u32) -> vec2<u32> {
    return vec2<u32>(8u * c, 8u * c + 4u);
}

fn w_chunk(row: u32, c: u32) -> W8 {
    let blk = row + (c >> 2u) * 34u;
    let d = load_f16_at(blk);
    let o = blk + 2u + (c & 3u) * 8u;
    return W8(d * s8x4(load_u32_at(o)), d * s8x4(load_u32_at(o + 4u)));
}

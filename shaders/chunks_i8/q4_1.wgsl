// Q4_1: the low and high nibbles of the chunk's word as bytes of 0..15, the block's minimum
// as the offset; blocks are word-aligned.
fn w_chunk_i8(row: u32, c: u32) -> I8W {
    let blk = (row >> 2u) + (c >> 2u) * 5u;
    let dm = unpack2x16float(w[blk]);
    let q = w[blk + 1u + (c & 3u)];
    return I8W(q & 0x0f0f0f0fu, (q >> 4u) & 0x0f0f0f0fu, dm.x, dm.y);
}

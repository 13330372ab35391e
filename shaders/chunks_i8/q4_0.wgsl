// Q4_0: the low and high nibbles of the chunk's word, each a byte of 0..15 (a non-negative
// int8), with the format's -8 as an offset of -8 d.
fn w_chunk_i8(row: u32, c: u32) -> I8W {
    let blk = row + (c >> 2u) * 18u;
    let q = load_u32_at(blk + 2u + (c & 3u) * 4u);
    let d = load_f16_at(blk);
    return I8W(q & 0x0f0f0f0fu, (q >> 4u) & 0x0f0f0f0fu, d, -8.0 * d);
}

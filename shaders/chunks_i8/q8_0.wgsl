// Q8_0: the chunk's two words of signed bytes as they are; no offset.
fn w_chunk_i8(row: u32, c: u32) -> I8W {
    let blk = row + (c >> 2u) * 34u;
    let o = blk + 2u + (c & 3u) * 8u;
    return I8W(load_u32_at(o), load_u32_at(o + 4u), load_f16_at(blk), 0.0);
}

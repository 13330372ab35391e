// Any format: chunk c is elements 8c .. 8c + 7, through the format's w_load4.
fn chunk_at(c: u32) -> vec2<u32> {
    return vec2<u32>(8u * c, 8u * c + 4u);
}

fn w_chunk(row: u32, c: u32) -> W8 {
    return W8(w_load4(row, 8u * c), w_load4(row, 8u * c + 4u));
}

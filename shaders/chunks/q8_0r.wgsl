// Q8_0 repacked (formats/q8_0r.wgsl): chunk c is elements 8c .. 8c + 7, two words of block
// c / 4's bytes, as Q8_0.
fn chunk_at(c: u32) -> vec2<u32> {
    return vec2<u32>(8u * c, 8u * c + 4u);
}

fn w_chunk(row: u32, c: u32) -> W8 {
    let at = q80r_words(row, c * 8u);
    let d = q80r_scale(at.x);
    let o = at.y + (c & 3u) * 2u;
    return W8(d * s8x4(w[o]), d * s8x4(w[o + 1u]));
}

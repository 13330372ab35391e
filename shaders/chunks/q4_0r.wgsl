// Q4_0 repacked (formats/q4_0r.wgsl): chunk c is word c % 4 of block c / 4's nibbles, as Q4_0.
fn chunk_at(c: u32) -> vec2<u32> {
    let e = (c >> 2u) * 32u + (c & 3u) * 4u;
    return vec2<u32>(e, e + 16u);
}

fn w_chunk(row: u32, c: u32) -> W8 {
    let at = q40r_words(row, c * 8u);
    let d = q40r_scale(at.x);
    let q = bytes4(w[at.y + (c & 3u)]);
    let lo = vec4<f32>(q & vec4<u32>(15u)) - vec4<f32>(8.0);
    let hi = vec4<f32>(q >> vec4<u32>(4u)) - vec4<f32>(8.0);
    return W8(d * lo, d * hi);
}

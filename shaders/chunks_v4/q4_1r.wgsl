// Q4_1 repacked: groups of 4 blocks in 5 vec4 (scales word, then a vec4 of quants a block).
struct Blk {
    q: vec4<u32>,
    dm: vec2<f32>,
}

fn blk_load(k: u32) -> Blk {
    let g = (k >> 2u) * 5u;
    return Blk(w[g + 1u + (k & 3u)], unpack2x16float(w[g][k & 3u]));
}

fn blk_dot(b: Blk, xv: array<vec4<f32>, 8>, xs: f32) -> f32 {
    return b.dm.x * q4_dot(b.q, xv) + b.dm.y * xs;
}

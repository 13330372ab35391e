// Q4_0 repacked: groups of 8 blocks in 9 vec4 (the f16 scales, then a vec4 of quants a block).
struct Blk {
    q: vec4<u32>,
    d: f32,
}

fn blk_load(k: u32) -> Blk {
    let g = (k >> 3u) * 9u;
    let d = unpack2x16float(w[g][(k & 7u) >> 1u])[k & 1u];
    return Blk(w[g + 1u + (k & 7u)], d);
}

fn blk_dot(b: Blk, xv: array<vec4<f32>, 8>, xs: f32) -> f32 {
    return b.d * (q4_dot(b.q, xv) - 8.0 * xs);
}

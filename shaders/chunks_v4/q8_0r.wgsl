// Q8_0 repacked: groups of 8 blocks in 17 vec4 (the f16 scales, then two vec4 of quants a
// block).
struct Blk {
    q: vec4<u32>,
    r: vec4<u32>,
    d: f32,
}

fn blk_load(k: u32) -> Blk {
    let g = (k >> 3u) * 17u;
    let d = unpack2x16float(w[g][(k & 7u) >> 1u])[k & 1u];
    let at = g + 1u + (k & 7u) * 2u;
    return Blk(w[at], w[at + 1u], d);
}

fn blk_dot(b: Blk, xv: array<vec4<f32>, 8>, xs: f32) -> f32 {
    let s = dot(s8x4v(b.q.x), xv[0]) + dot(s8x4v(b.q.y), xv[1]) + dot(s8x4v(b.q.z), xv[2])
        + dot(s8x4v(b.q.w), xv[3]) + dot(s8x4v(b.r.x), xv[4]) + dot(s8x4v(b.r.y), xv[5])
        + dot(s8x4v(b.r.z), xv[6]) + dot(s8x4v(b.r.w), xv[7]);
    return b.d * s;
}

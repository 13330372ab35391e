// Rotary position embedding in place: one invocation per rotated pair, token t at pos0 + t.
// With frequency factors or per-token positions the plan runs rope_tables.wgsl instead.

struct Params {
    heads: u32,
    head_dim: u32,
    rope_dim: u32,
    tokens: u32,
    pos0: u32,
    freq_base: f32,
    neox: u32,
    flags: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;

const TAU: f32 = 6.283185307179586;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.y * nwg.x * 256u + gid.x;
    let half = p.rope_dim / 2u;
    let total = p.tokens * p.heads * half;
    if (idx >= total) {
        return;
    }
    let i = idx % half;
    let th = idx / half;
    let t = th / p.heads;
    let base = th * p.head_dim;
    let theta = f32(p.pos0 + t) * pow(p.freq_base, -2.0 * f32(i) / f32(p.rope_dim));
    // Reduce the angle first: some GPUs lose precision on sin/cos of large arguments.
    let a = theta - TAU * floor(theta / TAU);
    let s = sin(a);
    let c = cos(a);
    var ia = base + 2u * i;
    var ib = ia + 1u;
    if (p.neox != 0u) {
        ia = base + i;
        ib = ia + half;
    }
    let x0 = x[ia];
    let x1 = x[ib];
    x[ia] = x0 * c - x1 * s;
    x[ib] = x0 * s + x1 * c;
}

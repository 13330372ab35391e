// Rotary position embedding in place with tables: one invocation per rotated pair. `factors`
// (rope_dim / 2 divisors of the angle, Llama 3.1's rope_freqs) is read only when p.flags has
// ROPE_FACTORS, and `positions` (one per token, overriding pos0 + t) only with ROPE_POSITIONS;
// the plan binds the other table in an absent one's place (both read-only, so the same buffer
// twice is allowed; `x` is never a stand-in: a browser's WebGPU refuses a buffer bound
// writable twice, or writable and read-only, in one dispatch). Without either table the plan
// runs rope.wgsl.

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
@group(0) @binding(2) var<storage, read> factors: array<f32>;
@group(0) @binding(3) var<storage, read> positions: array<u32>;

const TAU: f32 = 6.283185307179586;
const ROPE_FACTORS: u32 = 1u;
const ROPE_POSITIONS: u32 = 2u;

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
    var pos = p.pos0 + t;
    if ((p.flags & ROPE_POSITIONS) != 0u) {
        pos = positions[t];
    }
    var theta = f32(pos) * pow(p.freq_base, -2.0 * f32(i) / f32(p.rope_dim));
    if ((p.flags & ROPE_FACTORS) != 0u) {
        theta = theta / factors[i];
    }
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

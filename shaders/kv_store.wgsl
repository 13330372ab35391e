// Copies row t of k and v into slot slots[t] of k_pool and v_pool: one invocation per element.
// A slot at or past pool_slots is skipped, so a bad slot never writes outside the pool.

struct Params {
    kv_dim: u32,
    tokens: u32,
    pool_slots: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> slots: array<u32>;
@group(0) @binding(4) var<storage, read_write> k_pool: array<f32>;
@group(0) @binding(5) var<storage, read_write> v_pool: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.y * nwg.x * 256u + gid.x;
    if (idx >= p.tokens * p.kv_dim) {
        return;
    }
    let t = idx / p.kv_dim;
    let slot = slots[t];
    if (slot >= p.pool_slots) {
        return;
    }
    let dst = slot * p.kv_dim + idx % p.kv_dim;
    k_pool[dst] = k[idx];
    v_pool[dst] = v[idx];
}

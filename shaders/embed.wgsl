// out[t] = dequantize(table[ids[t]]): one invocation per output element. Ids outside the
// vocabulary give zero rows instead of reading past the table.
// The table format's w_load1 is prepended at pipeline creation.

struct Params {
    dim: u32,
    vocab: u32,
    tokens: u32,
    row_bytes: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.dim * p.tokens) {
        return;
    }
    let t = i / p.dim;
    let e = i % p.dim;
    let id = ids[t];
    var v = 0.0;
    if (id < p.vocab) {
        v = w_load1(id * p.row_bytes, e);
    }
    out[i] = v;
}

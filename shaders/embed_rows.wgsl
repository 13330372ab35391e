// `embed` over one part of a table held as several buffers of whole rows (a table larger
// than a storage binding): this part holds rows first .. first + rows, and fills the output
// rows of the ids among them; the other parts' dispatches fill the rest. Ids outside the
// vocabulary give zero rows, written by the part that ends the table.
// The table format's w_load1 is prepended at pipeline creation.

struct Params {
    dim: u32,
    vocab: u32,
    tokens: u32,
    row_bytes: u32,
    first: u32,
    rows: u32,
    _pad0: u32,
    _pad1: u32,
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
    if (id >= p.first && id - p.first < p.rows) {
        out[i] = w_load1((id - p.first) * p.row_bytes, e);
    } else if (id >= p.vocab && p.first + p.rows >= p.vocab) {
        out[i] = 0.0;
    }
}

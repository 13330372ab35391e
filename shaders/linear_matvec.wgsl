// y[r] = sum_c w[r, c] * x[c] for one token: 32 lanes per row walk the row in 4-element
// chunks (adjacent lanes read adjacent bytes), then reduce through workgroup memory.
// The weight format's w_load1/w_load4 are prepended at pipeline creation.

struct Params {
    rows: u32,
    cols: u32,
    tokens: u32,
    row_bytes: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const LANES: u32 = 32u;
const ROWS_PER_GROUP: u32 = 8u;
var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let lane = li % LANES;
    let r = (wid.y * nwg.x + wid.x) * ROWS_PER_GROUP + li / LANES;
    var acc = 0.0;
    if (r < p.rows) {
        let row = r * p.row_bytes;
        let chunks = p.cols / 4u;
        for (var c = lane; c < chunks; c += LANES) {
            let e = c * 4u;
            let xv = vec4<f32>(x[e], x[e + 1u], x[e + 2u], x[e + 3u]);
            acc += dot(w_load4(row, e), xv);
        }
        for (var e = chunks * 4u + lane; e < p.cols; e += LANES) {
            acc += w_load1(row, e) * x[e];
        }
    }
    partial[li] = acc;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            partial[li] += partial[li + s];
        }
        workgroupBarrier();
    }
    if (lane == 0u && r < p.rows) {
        y[r] = partial[li];
    }
}

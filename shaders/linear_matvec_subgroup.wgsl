// linear_matvec with subgroup reductions, for devices with subgroups (the `vulkan` backend
// picks it when the device has them). Same contract, bindings and grid as linear_matvec:
// 32 lanes per row walk the row in 4-element chunks. Each subgroup then reduces its lanes of
// a row with shuffles; where subgroups are narrower than 32 lanes (lavapipe: 8), their
// partial sums meet in workgroup memory behind one barrier instead of linear_matvec's six.
// Assumes subgroups are contiguous runs of local_invocation_index, as drivers lay out 1-D
// workgroups, and a power-of-two subgroup size. (No `enable subgroups;`: naga 30 rejects the
// directive and gates the builtins on the SUBGROUP capability instead.)

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
        @builtin(local_invocation_index) li: u32, @builtin(subgroup_size) sg_size: u32) {
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
    // Butterfly over the lanes of this row that share a subgroup: offsets below the width
    // never cross a 32-lane row, even in 64-wide subgroups.
    let width = min(sg_size, LANES);
    for (var o = width / 2u; o > 0u; o >>= 1u) {
        acc += subgroupShuffleXor(acc, o);
    }
    // One partial per (row, subgroup): LANES / width of them per row, in order.
    if (li % width == 0u) {
        partial[li / width] = acc;
    }
    workgroupBarrier();
    if (lane == 0u && r < p.rows) {
        let per_row = LANES / width;
        let first = li / width;
        var sum = 0.0;
        for (var j = 0u; j < per_row; j++) {
            sum += partial[first + j];
        }
        y[r] = sum;
    }
}

// Softmax in place over each row, one workgroup per row.

struct Params {
    rows: u32,
    cols: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;

var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let r = wid.y * nwg.x + wid.x;
    let base = min(r, p.rows - 1u) * p.cols;
    var m = -3.4028234e38;
    for (var i = li; i < p.cols; i += 256u) {
        m = max(m, x[base + i]);
    }
    partial[li] = m;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            partial[li] = max(partial[li], partial[li + s]);
        }
        workgroupBarrier();
    }
    let row_max = partial[0];
    workgroupBarrier();
    var sum = 0.0;
    for (var i = li; i < p.cols; i += 256u) {
        sum += exp(x[base + i] - row_max);
    }
    partial[li] = sum;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            partial[li] += partial[li + s];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / partial[0];
    if (r < p.rows) {
        for (var i = li; i < p.cols; i += 256u) {
            x[base + i] = exp(x[base + i] - row_max) * inv;
        }
    }
}

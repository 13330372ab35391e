// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * weight, one workgroup per token.

struct Params {
    dim: u32,
    tokens: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let t = wid.y * nwg.x + wid.x;
    let base = min(t, p.tokens - 1u) * p.dim;
    var ss = 0.0;
    for (var i = li; i < p.dim; i += 256u) {
        let v = x[base + i];
        ss += v * v;
    }
    partial[li] = ss;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            partial[li] += partial[li + s];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / sqrt(partial[0] / f32(p.dim) + p.eps);
    if (t < p.tokens) {
        for (var i = li; i < p.dim; i += 256u) {
            y[base + i] = x[base + i] * scale * weight[i];
        }
    }
}

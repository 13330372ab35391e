// x = x * scale, then cap * tanh(x / cap) when cap > 0, in place (kernels/elementwise.rs
// `scale_cap`). The tanh argument is clamped to +-10, where f32 tanh has saturated, because
// some implementations overflow on large arguments.

struct Params {
    n: u32,
    scale: f32,
    cap: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i < p.n) {
        var v = x[i] * p.scale;
        if (p.cap > 0.0) {
            v = p.cap * tanh(clamp(v / p.cap, -10.0, 10.0));
        }
        x[i] = v;
    }
}

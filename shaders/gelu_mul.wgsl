// out = gelu(gate) * up, elementwise; GELU in the tanh approximation, saturated past |g| = 10
// (kernels/elementwise.rs `gelu`).

struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read> up: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i < p.n) {
        let g = gate[i];
        var v = 0.0;
        if (g >= 10.0) {
            v = g;
        } else if (g > -10.0) {
            v = 0.5 * g * (1.0 + tanh(0.7978846 * g * (1.0 + 0.044715 * g * g)));
        }
        out[i] = v * up[i];
    }
}

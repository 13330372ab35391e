// Rounds a Linear's activations to int8 for the packed-integer matrix-vector kernels
// (linear_matvec_stream_i8): one invocation per 32-element block of `tokens x cols`, step
// d = amax / 127, q = round(x / d) (ties to even), four bytes to a word, low byte first. The
// words come first (8 a block, in element order), then each block's d as f32 bits; blocks
// run token-major, so block b is token b / (cols / 32). Takes the Linear's own parameters.

struct Params {
    rows: u32,
    cols: u32,
    tokens: u32,
    row_bytes: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> q: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let b = gid.y * nwg.x * 64u + gid.x;
    let blocks = p.tokens * (p.cols / 32u);
    if (b >= blocks) {
        return;
    }
    var v: array<vec4<f32>, 8>;
    var amax = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) {
        v[i] = x[b * 8u + i];
        amax = max(amax, abs(v[i]));
    }
    let m = max(max(amax.x, amax.y), max(amax.z, amax.w));
    let d = m / 127.0;
    let id = select(0.0, 127.0 / m, m > 0.0);
    for (var i = 0u; i < 8u; i++) {
        q[b * 8u + i] = pack4xI8(vec4<i32>(round(v[i] * id)));
    }
    q[blocks * 8u + b] = bitcast<u32>(d);
}

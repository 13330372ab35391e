// y[t, r] = sum_c w[r, c] * x[t, c] for up to TOKENS tokens at once (1 for decode, more for a
// batch of decode steps): the streaming walk (stream_walk.wgsl), ROWS rows per workgroup,
// token groups of TOKENS along the grid's z. Takes rows of a multiple of 8 elements; the
// weight format's chunk loader, TOKENS and the reduction (subgroups or workgroup memory) are
// prepended at pipeline creation.

struct Params {
    rows: u32,
    cols: u32,
    tokens: u32,
    row_bytes: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// Tokens past the last re-read it (their sums are dropped).
fn x_at(t: u32, i: u32) -> vec4<f32> {
    return x[min(t, p.tokens - 1u) * (p.cols / 4u) + i];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        lanes: Lanes) {
    let r0 = (wid.y * nwg.x + wid.x) * ROWS;
    let t0 = wid.z * TOKENS;
    var acc = walk(r0, t0, lanes.li);
    for (var t = 0u; t < TOKENS; t++) {
        let s = reduce4(acc[t], lanes);
        let r = r0 + lanes.li;
        if (lanes.li < ROWS && r < p.rows && t0 + t < p.tokens) {
            y[(t0 + t) * p.rows + r] = s[lanes.li];
        }
    }
}

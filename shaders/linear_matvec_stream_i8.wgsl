// y[t, r] = sum_c w[r, c] * x[t, c] on 8-bit integers (stream_walk_i8.wgsl): `xq` is what
// quantize_q8 wrote for these tokens' activations (int8 words, then each 32-block's step).
// Otherwise linear_matvec_stream: ROWS rows a workgroup, token groups of TOKENS along z.

struct Params {
    rows: u32,
    cols: u32,
    tokens: u32,
    row_bytes: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> xq: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// Tokens past the last re-read it (their sums are dropped).
fn xq_at(t: u32, i: u32) -> u32 {
    return xq[min(t, p.tokens - 1u) * (p.cols / 4u) + i];
}

fn xd_at(t: u32, b: u32) -> f32 {
    return bitcast<f32>(xq[p.tokens * (p.cols / 4u) + min(t, p.tokens - 1u) * (p.cols / 32u) + b]);
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

// y[r] = sum_c w[r, c] * x[c] for one token on the wide walk (generated at pipeline creation
// from its shape: ROWS rows and WG invocations a workgroup, UNROLL chunks of 8 weights a
// step per invocation; see `wide_walk` in src/lib.rs). The weight format's chunk loader, the
// walk and the subgroup reduction are prepended. Takes rows of a multiple of 8 elements.

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

fn x_at(i: u32) -> vec4<f32> {
    return x[i];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        lanes: Lanes) {
    let r0 = (wid.y * nwg.x + wid.x) * ROWS;
    let acc = walk_wide(r0, lanes.li);
    for (var g = 0u; g < RG; g++) {
        let s = reduce4(acc[g], lanes);
        let r = r0 + 4u * g + lanes.li;
        if (lanes.li < 4u && r < p.rows) {
            y[r] = s[lanes.li];
        }
    }
}

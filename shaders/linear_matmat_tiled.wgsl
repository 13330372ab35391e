// y[t, r] = sum_c w[r, c] * x[t, c] for a prompt's tokens through workgroup memory: a
// workgroup of 16 x 16 invocations takes a tile of 64 rows by 64 tokens; for each step of 32
// columns it dequantizes the tile's 64 x 32 weights once into workgroup memory (each weight
// then serves 64 tokens, against 4 in linear_matmat) and stages the 64 tokens' 32
// activations beside them, and each invocation sums a 4-row by 4-token block in registers.
// 16 KiB of workgroup memory, WebGPU's guaranteed minimum. Takes rows of a multiple of 32
// elements; rows and tokens past the end re-read the last one, and their sums are dropped.

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

const TILE: u32 = 64u;
// vec4s per staged row: 32 columns.
const STEP4: u32 = 8u;

var<workgroup> ws: array<vec4<f32>, 512>;
var<workgroup> xs: array<vec4<f32>, 512>;

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let r0 = wid.x * TILE;
    let t0 = wid.y * TILE;
    var acc: array<vec4<f32>, 4>;
    for (var k0 = 0u; k0 < p.cols; k0 += 32u) {
        for (var s = 0u; s < 2u; s++) {
            let i = li + s * 256u;
            let n = i / STEP4;
            let q = i % STEP4;
            ws[i] = w_load4(min(r0 + n, p.rows - 1u) * p.row_bytes, k0 + q * 4u);
            xs[i] = x[min(t0 + n, p.tokens - 1u) * (p.cols / 4u) + k0 / 4u + q];
        }
        workgroupBarrier();
        for (var q = 0u; q < STEP4; q++) {
            let w0 = ws[(lid.x * 4u) * STEP4 + q];
            let w1 = ws[(lid.x * 4u + 1u) * STEP4 + q];
            let w2 = ws[(lid.x * 4u + 2u) * STEP4 + q];
            let w3 = ws[(lid.x * 4u + 3u) * STEP4 + q];
            for (var j = 0u; j < 4u; j++) {
                let xv = xs[(lid.y * 4u + j) * STEP4 + q];
                acc[j] += vec4<f32>(dot(w0, xv), dot(w1, xv), dot(w2, xv), dot(w3, xv));
            }
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < 4u; j++) {
        let t = t0 + lid.y * 4u + j;
        for (var i = 0u; i < 4u; i++) {
            let r = r0 + lid.x * 4u + i;
            if (t < p.tokens && r < p.rows) {
                y[t * p.rows + r] = acc[j][i];
            }
        }
    }
}

// y[t, r] = sum_c w[r, c] * x[t, c] for a prompt's tokens on cooperative matrices (tensor
// cores: Vulkan's VK_KHR_cooperative_matrix through naga's `wgpu_cooperative_matrix`), for the
// raw vulkan backend only. A workgroup of 128 invocations, four subgroups of 32, takes 64 rows
// by 64 tokens; per step of 32 columns it dequantizes the tile's weights and converts the
// tokens' activations to f16 in workgroup memory (row-major, 32 columns a row), and each
// subgroup multiplies a 32-row by 32-token quarter as 2 x 2 16 x 16 products, f16 inputs and
// f32 sums. The sums go out through workgroup memory (24 KiB in all: past WebGPU's floor, within
// every Vulkan GPU with cooperative matrices), so rows and tokens past the end are dropped
// there. Takes rows of a multiple of 32 elements. Assumes subgroups of 32 invocations
// (NVIDIA's), four to a workgroup.

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

const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 32u;

var<workgroup> ws: array<f16, 2048>;
var<workgroup> xs: array<f16, 2048>;
// The tile's sums, token-major (64 rows a token), on their way to y.
var<workgroup> cs: array<f32, 4096>;

fn stage(i: u32, r0: u32, t0: u32, k0: u32) {
    // Slot i (0..512) of each tile: vec4 i % 8 of row (or token) i / 8.
    let n = i / 8u;
    let q = i % 8u;
    let wv = vec4<f16>(w_load4(min(r0 + n, p.rows - 1u) * p.row_bytes, k0 + q * 4u));
    let xv = vec4<f16>(x[min(t0 + n, p.tokens - 1u) * (p.cols / 4u) + k0 / 4u + q]);
    let at = n * BK + q * 4u;
    ws[at] = wv.x;
    ws[at + 1u] = wv.y;
    ws[at + 2u] = wv.z;
    ws[at + 3u] = wv.w;
    xs[at] = xv.x;
    xs[at + 1u] = xv.y;
    xs[at + 2u] = xv.z;
    xs[at + 3u] = xv.w;
}

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r0 = wid.x * BM;
    let t0 = wid.y * BN;
    let sg = li / 32u;
    // The subgroup's quarter: rows sr .. sr + 31, tokens st .. st + 31 of the tile.
    let sr = (sg % 2u) * 32u;
    let st = (sg / 2u) * 32u;
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    for (var k0 = 0u; k0 < p.cols; k0 += BK) {
        workgroupBarrier();
        for (var s = 0u; s < 4u; s++) {
            stage(li + s * 128u, r0, t0, k0);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&ws[sr * BK + kk], BK);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&ws[(sr + 16u) * BK + kk], BK);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&xs[st * BK + kk], BK);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&xs[(st + 16u) * BK + kk], BK);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
        }
    }
    // Column-major 16 x 16 blocks: element (row m, token n) at n * 64 + m.
    coopStore(c00, &cs[st * BM + sr], BM);
    coopStore(c01, &cs[(st + 16u) * BM + sr], BM);
    coopStore(c10, &cs[st * BM + sr + 16u], BM);
    coopStore(c11, &cs[(st + 16u) * BM + sr + 16u], BM);
    workgroupBarrier();
    for (var e = li; e < BM * BN; e += 128u) {
        let r = r0 + e % BM;
        let t = t0 + e / BM;
        if (r < p.rows && t < p.tokens) {
            y[t * p.rows + r] = cs[e];
        }
    }
}

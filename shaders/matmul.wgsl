// c[m x n] = a[m x k] * b[k x n], f32 row-major. Each invocation keeps a 4x4 tile of c in
// registers; no workgroup memory or barriers.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> c: array<f32>;

@compute @workgroup_size(8, 8)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let i0 = (wid.y * 8u + lid.y) * 4u;
    let j0 = (wid.x * 8u + lid.x) * 4u;
    if (i0 >= p.m || j0 >= p.n) {
        return;
    }
    // Clamped indices keep loads in bounds; the masked results are never stored.
    let ia = vec4<u32>(min(i0, p.m - 1u), min(i0 + 1u, p.m - 1u), min(i0 + 2u, p.m - 1u), min(i0 + 3u, p.m - 1u)) * p.k;
    let jb = vec4<u32>(j0, min(j0 + 1u, p.n - 1u), min(j0 + 2u, p.n - 1u), min(j0 + 3u, p.n - 1u));
    var acc: array<vec4<f32>, 4>;
    for (var kk = 0u; kk < p.k; kk++) {
        let bo = kk * p.n;
        let bv = vec4<f32>(b[bo + jb.x], b[bo + jb.y], b[bo + jb.z], b[bo + jb.w]);
        acc[0] += a[ia.x + kk] * bv;
        acc[1] += a[ia.y + kk] * bv;
        acc[2] += a[ia.z + kk] * bv;
        acc[3] += a[ia.w + kk] * bv;
    }
    for (var i = 0u; i < 4u; i++) {
        for (var j = 0u; j < 4u; j++) {
            if (i0 + i < p.m && j0 + j < p.n) {
                c[(i0 + i) * p.n + j0 + j] = acc[i][j];
            }
        }
    }
}

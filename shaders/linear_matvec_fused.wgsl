// linear_matvec with the ops around it folded in, to save dispatches (the wgpu backend's
// fusion pass picks it; backend/wgpu/fuse.rs). Same grid and walk as linear_matvec: 32 lanes
// per row, 8 rows per workgroup, one token. The bits of `p.mode` say what is folded in:
// - NORM: x is the RMS norm's input and `aux` its weight (`extra` holds eps's bits); every
//   workgroup normalizes x itself, and the first one also writes the normalized row to `out`
//   (the norm's output, which later products read);
// - ADD: out[r] += y[r] (the residual add, in place on `out`);
// - SILU: out[r] = silu(aux[r]) * y[r] (y is the up product, aux the gate);
// - ROPE: y is rotated in pairs of adjacent rows (rope.wgsl's arithmetic, not neox), at
//   position pos0; `dims` holds head_dim and rope_dim << 16;
// - STORE: y, rotated, is also written to out[extra + r] (the copy into the KV cache).
// y is written in every mode, so every buffer the unfused ops wrote holds what they wrote.
// The weight format's w_load1/w_load4 are prepended at pipeline creation.

struct Params {
    rows: u32,
    cols: u32,
    row_bytes: u32,
    mode: u32,
    extra: u32,
    pos0: u32,
    freq_base: f32,
    dims: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> aux: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

const LANES: u32 = 32u;
const ROWS_PER_GROUP: u32 = 8u;
const NORM: u32 = 1u;
const ADD: u32 = 2u;
const SILU: u32 = 4u;
const ROPE: u32 = 8u;
const STORE: u32 = 16u;
const TAU: f32 = 6.283185307179586;
var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let g = wid.y * nwg.x + wid.x;
    let lane = li % LANES;
    let r = g * ROWS_PER_GROUP + li / LANES;
    let norm = (p.mode & NORM) != 0u;
    // rmsnorm's arithmetic, in its order, so the products see what its output holds.
    var scale = 1.0;
    if (norm) {
        var ss = 0.0;
        for (var i = li; i < p.cols; i += 256u) {
            let v = x[i];
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
        scale = 1.0 / sqrt(partial[0] / f32(p.cols) + bitcast<f32>(p.extra));
        workgroupBarrier();
        if (g == 0u) {
            for (var i = li; i < p.cols; i += 256u) {
                out[i] = x[i] * scale * aux[i];
            }
        }
    }
    var acc = 0.0;
    if (r < p.rows) {
        let row = r * p.row_bytes;
        let chunks = p.cols / 4u;
        for (var c = lane; c < chunks; c += LANES) {
            let e = c * 4u;
            var xv = vec4<f32>(x[e], x[e + 1u], x[e + 2u], x[e + 3u]);
            if (norm) {
                xv = xv * scale * vec4<f32>(aux[e], aux[e + 1u], aux[e + 2u], aux[e + 3u]);
            }
            acc += dot(w_load4(row, e), xv);
        }
        for (var e = chunks * 4u + lane; e < p.cols; e += LANES) {
            var xe = x[e];
            if (norm) {
                xe = xe * scale * aux[e];
            }
            acc += w_load1(row, e) * xe;
        }
    }
    partial[li] = acc;
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            partial[li] += partial[li + s];
        }
        workgroupBarrier();
    }
    if (lane == 0u && r < p.rows) {
        var v = partial[li];
        let head_dim = p.dims & 0xffffu;
        let rope_dim = p.dims >> 16u;
        if ((p.mode & ROPE) != 0u && r % head_dim < rope_dim) {
            // The pair's other row is the neighbouring 32 lanes' (rows come in even pairs).
            let other = partial[li ^ LANES];
            let odd = (r & 1u) == 1u;
            let x0 = select(v, other, odd);
            let x1 = select(other, v, odd);
            let i = (r % head_dim) / 2u;
            let theta = f32(p.pos0) * pow(p.freq_base, -2.0 * f32(i) / f32(rope_dim));
            let a = theta - TAU * floor(theta / TAU);
            let s = sin(a);
            let c = cos(a);
            v = select(x0 * c - x1 * s, x0 * s + x1 * c, odd);
        }
        y[r] = v;
        if ((p.mode & ADD) != 0u) {
            out[r] = out[r] + v;
        } else if ((p.mode & SILU) != 0u) {
            let gt = aux[r];
            out[r] = gt / (1.0 + exp(-gt)) * v;
        } else if ((p.mode & STORE) != 0u) {
            out[p.extra + r] = v;
        }
    }
}

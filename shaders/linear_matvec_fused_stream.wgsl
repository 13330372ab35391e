// linear_matvec_fused on the streaming walk (stream_walk.wgsl, TOKENS = 1): same parameters,
// bindings, modes and arithmetic of the folded ops as linear_matvec_fused, ROWS rows per
// workgroup instead of 8. Takes rows of a multiple of 8 elements; the weight format's chunk
// loader and the reduction (subgroups or workgroup memory) are prepended at pipeline creation.

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
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> aux: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

const NORM: u32 = 1u;
const ADD: u32 = 2u;
const SILU: u32 = 4u;
const ROPE: u32 = 8u;
const STORE: u32 = 16u;
const TAU: f32 = 6.283185307179586;

// With NORM, x is read normalized: x * scale * weight.
var<private> norm_scale: f32;

fn aux4(i: u32) -> vec4<f32> {
    let e = 4u * i;
    return vec4<f32>(aux[e], aux[e + 1u], aux[e + 2u], aux[e + 3u]);
}

fn x_at(t: u32, i: u32) -> vec4<f32> {
    if ((p.mode & NORM) != 0u) {
        return x[i] * norm_scale * aux4(i);
    }
    return x[i];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        lanes: Lanes) {
    let g = wid.y * nwg.x + wid.x;
    let li = lanes.li;
    let r0 = g * ROWS;
    let quads = p.cols / 4u;
    if ((p.mode & NORM) != 0u) {
        var ss = 0.0;
        for (var i = li; i < quads; i += WG) {
            let v = x[i];
            ss += dot(v, v);
        }
        let sum = reduce4(vec4<f32>(ss, 0.0, 0.0, 0.0), lanes).x;
        norm_scale = 1.0 / sqrt(sum / f32(p.cols) + bitcast<f32>(p.extra));
        if (g == 0u) {
            for (var i = li; i < quads; i += WG) {
                let v = x[i] * norm_scale * aux4(i);
                out[4u * i] = v.x;
                out[4u * i + 1u] = v.y;
                out[4u * i + 2u] = v.z;
                out[4u * i + 3u] = v.w;
            }
        }
    }
    var acc = walk(r0, 0u, li);
    let s = reduce4(acc[0], lanes);
    let r = r0 + li;
    if (li < ROWS && r < p.rows) {
        var v = s[li];
        let head_dim = p.dims & 0xffffu;
        let rope_dim = p.dims >> 16u;
        if ((p.mode & ROPE) != 0u && r % head_dim < rope_dim) {
            // Rows come in even pairs, and r0 is a multiple of 4: the pair is in s.
            let other = s[li ^ 1u];
            let odd = (r & 1u) == 1u;
            let x0 = select(v, other, odd);
            let x1 = select(other, v, odd);
            let i = (r % head_dim) / 2u;
            let theta = f32(p.pos0) * pow(p.freq_base, -2.0 * f32(i) / f32(rope_dim));
            let a = theta - TAU * floor(theta / TAU);
            let sn = sin(a);
            let cs = cos(a);
            v = select(x0 * cs - x1 * sn, x0 * sn + x1 * cs, odd);
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

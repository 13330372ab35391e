// linear_matvec_fused on the wide walk (linear_matvec_wide.wgsl: ROWS rows, WG invocations
// and UNROLL chunks a step, generated from the shape at pipeline creation): same parameters,
// bindings, modes and arithmetic of the folded ops as linear_matvec_fused_stream, its rows
// summed in groups of 4 (so rope's row pairs stay within a group). The weight format's chunk
// loader, the walk and the subgroup reduction are prepended.

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

fn x_at(i: u32) -> vec4<f32> {
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
    let acc = walk_wide(r0, li);
    for (var k = 0u; k < RG; k++) {
        finish(r0 + 4u * k, li, reduce4(acc[k], lanes));
    }
}

// The folded ops of rows r4 .. r4 + 3 (r4 a multiple of 4), whose sums are s.
fn finish(r4: u32, li: u32, s: vec4<f32>) {
    let r = r4 + li;
    if (li < 4u && r < p.rows) {
        var v = s[li];
        let head_dim = p.dims & 0xffffu;
        let rope_dim = p.dims >> 16u;
        if ((p.mode & ROPE) != 0u && r % head_dim < rope_dim) {
            // Rows come in even pairs, and r4 is a multiple of 4: the pair is in s.
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

// Draws a token from the logits on the device, so a decode step needs no logits readback.
// Top-k and top-p become thresholds on an order-preserving integer key of each logit, found
// bit by bit (32 rounds of a workgroup-wide count or sum); the draw itself is Gumbel-max with
// a counter-based hash, the same as the CPU twin in engine/src/kernels/sample.rs.

struct Params {
    n: u32,
    temperature: f32,
    top_k: u32,
    top_p: f32,
    seed_lo: u32,
    seed_hi: u32,
    step: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

var<workgroup> red_f: array<f32, 256>;
var<workgroup> red_u: array<u32, 256>;

fn order_key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn pcg(v: u32) -> u32 {
    let state = v * 747796405u + 2891336453u;
    let word = ((state >> ((state >> 28u) + 4u)) ^ state) * 277803737u;
    return (word >> 22u) ^ word;
}

fn uniform01(i: u32) -> f32 {
    let h = pcg(i ^ pcg(p.step ^ pcg(p.seed_lo ^ pcg(p.seed_hi))));
    return (f32(h >> 8u) + 0.5) / 16777216.0;
}

fn sum_f(li: u32, v: f32) -> f32 {
    red_f[li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            red_f[li] += red_f[li + s];
        }
        workgroupBarrier();
    }
    let r = red_f[0];
    workgroupBarrier();
    return r;
}

fn sum_u(li: u32, v: u32) -> u32 {
    red_u[li] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            red_u[li] += red_u[li + s];
        }
        workgroupBarrier();
    }
    let r = red_u[0];
    workgroupBarrier();
    return r;
}

// (value, index) maximum over the workgroup, lowest index on ties; index 0xffffffff = none.
fn argmax_pair(li: u32, v: f32, i: u32) -> u32 {
    red_f[li] = v;
    red_u[li] = i;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (li < s) {
            let ov = red_f[li + s];
            let oi = red_u[li + s];
            let mi = red_u[li];
            if (oi != 0xffffffffu && (mi == 0xffffffffu || ov > red_f[li] || (ov == red_f[li] && oi < mi))) {
                red_f[li] = ov;
                red_u[li] = oi;
            }
        }
        workgroupBarrier();
    }
    let r = red_u[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32) {
    // Greedy pick, also the maximum logit for the top-p mass.
    var bv = -3.4028234e38;
    var bi = 0xffffffffu;
    for (var i = li; i < p.n; i += 256u) {
        let v = logits[i];
        if (v > bv || bi == 0xffffffffu) {
            bv = v;
            bi = i;
        }
    }
    let best = argmax_pair(li, bv, bi);
    if (p.temperature <= 0.0) {
        if (li == 0u) {
            out[0] = best;
        }
        return;
    }
    let max_logit = logits[best];

    var kmin = 0u;
    if (p.top_k != 0u && p.top_k < p.n) {
        for (var bit = 31i; bit >= 0i; bit--) {
            let cand = kmin | (1u << u32(bit));
            var cnt = 0u;
            for (var i = li; i < p.n; i += 256u) {
                cnt += select(0u, 1u, order_key(logits[i]) >= cand);
            }
            if (sum_u(li, cnt) >= p.top_k) {
                kmin = cand;
            }
        }
    }

    var pmin = kmin;
    if (p.top_p < 1.0) {
        var part = 0.0;
        for (var i = li; i < p.n; i += 256u) {
            let l = logits[i];
            part += select(0.0, exp(l - max_logit), order_key(l) >= kmin);
        }
        let target_mass = max(p.top_p, 0.0) * sum_f(li, part);
        for (var bit = 31i; bit >= 0i; bit--) {
            let cand = pmin | (1u << u32(bit));
            var mass = 0.0;
            for (var i = li; i < p.n; i += 256u) {
                let l = logits[i];
                mass += select(0.0, exp(l - max_logit), order_key(l) >= cand);
            }
            let total = sum_f(li, mass);
            if (cand > pmin && total >= target_mass) {
                pmin = cand;
            }
        }
    }

    let inv_t = 1.0 / p.temperature;
    var sv = -3.4028234e38;
    var si = 0xffffffffu;
    for (var i = li; i < p.n; i += 256u) {
        let l = logits[i];
        if (order_key(l) >= pmin) {
            let score = l * inv_t - log(-log(uniform01(i)));
            if (score > sv || si == 0xffffffffu) {
                sv = score;
                si = i;
            }
        }
    }
    let pick = argmax_pair(li, sv, si);
    if (li == 0u) {
        out[0] = pick;
    }
}

// Decode attention split by keys (flash-decoding), first pass: one workgroup per (head,
// query token, piece). The query's keys (its window, else all of them) are cut into
// `splits` pieces of equal length; this workgroup scores its piece 64 keys at a time with an
// online softmax, as attention.wgsl does over all of them, and writes the piece's running
// maximum m, sum l of exp(score - m) and weighted values o (head_dim of them) to `part`, at
// record ((t * heads + h) * splits + piece) of head_dim + 2 floats. An empty piece writes
// m = -FLT_MAX, l = 0, o = 0, which the merge (attention_merge.wgsl) weighs as 0.

struct Params {
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    pos0: u32,
    scale: f32,
    // Pieces per (head, token).
    splits: u32,
    // Sliding window: a query attends to its last `window` keys; 0 is no window.
    window: u32,
    // Scores become softcap * tanh(score / softcap) when it is above 0 (Gemma 2).
    softcap: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k_cache: array<f32>;
@group(0) @binding(3) var<storage, read> v_cache: array<f32>;
@group(0) @binding(4) var<storage, read_write> part: array<f32>;

// Each key is read by LANES invocations at once, element d by invocation d % LANES, so a
// load instruction of 32 invocations reads 32 neighbouring floats of one key's row instead
// of 32 rows' d-th elements (one invocation per key, walking its row alone, was latency-bound:
// 32 us a layer for the 8B shape's 576 keys on an H200). GROUPS keys are in flight at a time,
// and the weighted values are summed the same way, each invocation keeping the elements
// lane, lane + LANES, ... of its group's keys, the groups' sums added at the end.
const LANES: u32 = 32u;
const GROUPS: u32 = 8u;
// Keys scored per chunk: their partial dot products (CHUNK rows of LANES, padded to LANES + 1
// so a row's sum reads every bank once) fill `red`, which later holds GROUPS x 256 values.
const CHUNK: u32 = 64u;
const PAD: u32 = 33u;
// head_dim is at most 256 (qs), so at most 256 / LANES elements per invocation.
const PER_LANE: u32 = 8u;
var<workgroup> qs: array<f32, 256>;
var<workgroup> scores: array<f32, 64>;
var<workgroup> red: array<f32, 2112>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t = wid.y;
    let piece = wid.z;
    let hd = p.head_dim;
    let kvh = h / (p.heads / p.kv_heads);
    let kv_stride = p.kv_heads * hd;
    let qbase = (t * p.heads + h) * hd;
    let n_keys = p.pos0 + t + 1u;
    let first = select(0u, n_keys - min(n_keys, p.window), p.window != 0u);
    let per = (n_keys - first + p.splits - 1u) / p.splits;
    let lo = min(first + piece * per, n_keys);
    let hi = min(lo + per, n_keys);
    if (li < hd) {
        qs[li] = q[qbase + li];
    }
    workgroupBarrier();
    let g = li / LANES;
    let lane = li % LANES;
    var m = -3.4028234e38;
    var l = 0.0;
    var ov: array<f32, PER_LANE>;
    for (var c0 = lo; c0 < hi; c0 += CHUNK) {
        // Only the piece's live keys: a short piece pays for its own keys, not the chunk.
        let live = min(CHUNK, hi - c0);
        for (var kk = g; kk < live; kk += GROUPS) {
            let kb = (c0 + kk) * kv_stride + kvh * hd;
            var acc = 0.0;
            for (var d = lane; d < hd; d += LANES) {
                acc += qs[d] * k_cache[kb + d];
            }
            red[kk * PAD + lane] = acc;
        }
        workgroupBarrier();
        if (li < live) {
            var acc = 0.0;
            for (var x = 0u; x < LANES; x++) {
                acc += red[li * PAD + x];
            }
            var s = acc * p.scale;
            if (p.softcap > 0.0) {
                s = p.softcap * tanh(s / p.softcap);
            }
            scores[li] = s;
        }
        workgroupBarrier();
        var cm = m;
        for (var i = 0u; i < live; i++) {
            cm = max(cm, scores[i]);
        }
        workgroupBarrier();
        if (li < live) {
            scores[li] = exp(scores[li] - cm);
        }
        workgroupBarrier();
        let corr = exp(m - cm);
        var csum = 0.0;
        for (var i = 0u; i < live; i++) {
            csum += scores[i];
        }
        l = l * corr + csum;
        for (var i = 0u; i < PER_LANE; i++) {
            ov[i] *= corr;
        }
        for (var kk = g; kk < live; kk += GROUPS) {
            let pw = scores[kk];
            let vb = (c0 + kk) * kv_stride + kvh * hd;
            for (var i = 0u; i < PER_LANE; i++) {
                let d = lane + i * LANES;
                if (d < hd) {
                    ov[i] += pw * v_cache[vb + d];
                }
            }
        }
        m = cm;
        // Everyone is done with this chunk's scores and partials before the next overwrites them.
        workgroupBarrier();
    }
    for (var i = 0u; i < PER_LANE; i++) {
        let d = lane + i * LANES;
        if (d < hd) {
            red[g * 256u + d] = ov[i];
        }
    }
    workgroupBarrier();
    let rec = ((t * p.heads + h) * p.splits + piece) * (hd + 2u);
    if (li == 0u) {
        part[rec] = m;
        part[rec + 1u] = l;
    }
    if (li < hd) {
        var o = 0.0;
        for (var gg = 0u; gg < GROUPS; gg++) {
            o += red[gg * 256u + li];
        }
        part[rec + 2u + li] = o;
    }
}

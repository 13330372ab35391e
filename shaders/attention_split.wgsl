// Decode attention split by keys (flash-decoding), first pass: one workgroup per (head,
// query token, piece). The query's keys (its window, else all of them) are cut into
// `splits` pieces of equal length; this workgroup scores its piece 256 keys at a time with an
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

const CHUNK: u32 = 256u;
var<workgroup> qs: array<f32, 256>;
var<workgroup> scores: array<f32, 256>;

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
    var m = -3.4028234e38;
    var l = 0.0;
    var o = 0.0;
    for (var c0 = lo; c0 < hi; c0 += CHUNK) {
        let j = c0 + li;
        let live_key = j < hi;
        var s = -3.4028234e38;
        if (live_key) {
            let kb = j * kv_stride + kvh * hd;
            var acc = 0.0;
            for (var d = 0u; d < hd; d++) {
                acc += qs[d] * k_cache[kb + d];
            }
            s = acc * p.scale;
            if (p.softcap > 0.0) {
                s = p.softcap * tanh(s / p.softcap);
            }
        }
        scores[li] = s;
        workgroupBarrier();
        // Only the piece's live keys: a short piece pays for its own keys, not the chunk.
        let live = min(CHUNK, hi - c0);
        var cm = m;
        for (var i = 0u; i < live; i++) {
            cm = max(cm, scores[i]);
        }
        workgroupBarrier();
        scores[li] = select(0.0, exp(s - cm), live_key);
        workgroupBarrier();
        let corr = exp(m - cm);
        var csum = 0.0;
        var ov = 0.0;
        for (var i = 0u; i < live; i++) {
            let pw = scores[i];
            csum += pw;
            if (li < hd) {
                ov += pw * v_cache[(c0 + i) * kv_stride + kvh * hd + li];
            }
        }
        l = l * corr + csum;
        o = o * corr + ov;
        m = cm;
        workgroupBarrier();
    }
    let rec = ((t * p.heads + h) * p.splits + piece) * (hd + 2u);
    if (li == 0u) {
        part[rec] = m;
        part[rec + 1u] = l;
    }
    if (li < hd) {
        part[rec + 2u + li] = o;
    }
}

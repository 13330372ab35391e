// Causal grouped-query attention over a KV cache: one workgroup per (query token, head).
// Keys are scored 256 at a time (one per invocation) with an online softmax, so any context
// length runs in fixed workgroup memory; invocation d < head_dim owns output element d.

struct Params {
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    pos0: u32,
    scale: f32,
    // Blocks per (head, token) in the cuda backend's split attention; unused here.
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
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

const CHUNK: u32 = 256u;
var<workgroup> qs: array<f32, 256>;
var<workgroup> scores: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t = wid.y;
    let hd = p.head_dim;
    let kvh = h / (p.heads / p.kv_heads);
    let kv_stride = p.kv_heads * hd;
    let qbase = (t * p.heads + h) * hd;
    let n_keys = p.pos0 + t + 1u;
    let first = select(0u, n_keys - min(n_keys, p.window), p.window != 0u);
    if (li < hd) {
        qs[li] = q[qbase + li];
    }
    workgroupBarrier();
    var m = -3.4028234e38;
    var l = 0.0;
    var o = 0.0;
    let n_chunks = (p.pos0 + p.tokens + CHUNK - 1u) / CHUNK;
    // Chunks wholly before the window are skipped; keys before it in the first one count 0.
    for (var c = first / CHUNK; c < n_chunks; c++) {
        let j = c * CHUNK + li;
        let live_key = j >= first && j < n_keys;
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
        var cm = m;
        for (var i = 0u; i < CHUNK; i++) {
            cm = max(cm, scores[i]);
        }
        workgroupBarrier();
        scores[li] = select(0.0, exp(s - cm), live_key);
        workgroupBarrier();
        let corr = exp(m - cm);
        var csum = 0.0;
        var ov = 0.0;
        let live = min(CHUNK, n_keys - min(n_keys, c * CHUNK));
        for (var i = 0u; i < live; i++) {
            let pw = scores[i];
            csum += pw;
            if (li < hd) {
                ov += pw * v_cache[(c * CHUNK + i) * kv_stride + kvh * hd + li];
            }
        }
        l = l * corr + csum;
        o = o * corr + ov;
        m = cm;
        workgroupBarrier();
    }
    if (li < hd) {
        out[qbase + li] = o / l;
    }
}

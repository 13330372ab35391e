// Decode attention split by keys, first pass, grouped: one workgroup per (key/value head,
// group of up to GQ query heads sharing it, query token, piece), scoring the group's heads
// against each key and value row loaded once (attention_grouped_walk.wgsl, prepended). The
// pieces and records are attention_split.wgsl's, merged by attention_merge.wgsl. head_dim is
// a multiple of 4 (the caches are read as vec4s).

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
@group(0) @binding(2) var<storage, read> k4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> v4: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> part: array<f32>;

fn key_row4(j: u32, kvh: u32) -> u32 {
    return (j * p.kv_heads + kvh) * (p.head_dim / 4u);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let group = p.heads / p.kv_heads;
    let subs = (group + GQ - 1u) / GQ;
    let kvh = wid.x / subs;
    let sub = wid.x % subs;
    let h0 = kvh * group + sub * GQ;
    let nq = min(GQ, group - sub * GQ);
    let t = wid.y;
    let n_keys = p.pos0 + t + 1u;
    let first = select(0u, n_keys - min(n_keys, p.window), p.window != 0u);
    let per = (n_keys - first + p.splits - 1u) / p.splits;
    let lo = min(first + wid.z * per, n_keys);
    let hi = min(lo + per, n_keys);
    attend(li, t, wid.z, kvh, h0, nq, lo, hi);
}

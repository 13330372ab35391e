// Decode attention split by keys (flash-decoding), first pass: one workgroup per (head,
// query token, piece). The query's keys (its window, else all of them) are cut into
// `splits` pieces of equal length; this workgroup scores its piece and writes the piece's
// record (attention_split_walk.wgsl, prepended), which attention_merge.wgsl merges.

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
@group(0) @binding(2) var<storage, read> kc: array<f32>;
@group(0) @binding(3) var<storage, read> vc: array<f32>;
@group(0) @binding(4) var<storage, read_write> part: array<f32>;

fn key_row(j: u32, kvh: u32) -> u32 {
    return (j * p.kv_heads + kvh) * p.head_dim;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wid.y;
    let n_keys = p.pos0 + t + 1u;
    let first = select(0u, n_keys - min(n_keys, p.window), p.window != 0u);
    let per = (n_keys - first + p.splits - 1u) / p.splits;
    let lo = min(first + wid.z * per, n_keys);
    let hi = min(lo + per, n_keys);
    attend_head(li, t, wid.z, wid.x, lo, hi);
}

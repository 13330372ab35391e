// Causal grouped-query attention of a prompt over a KV cache through workgroup-memory tiles:
// one workgroup per (head, block of 16 query tokens), the core in attention_tile.wgsl. Takes
// what attention.wgsl takes; for head sizes up to 128 (the backend keeps larger ones there).

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
@group(0) @binding(2) var<storage, read> kc: array<f32>;
@group(0) @binding(3) var<storage, read> vc: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

// Key j of the cache starts at row j.
fn key_row(start: u32, j: u32) -> u32 {
    return j * p.kv_heads * p.head_dim;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t0 = wid.y * BQ;
    // Token t attends to pos0 + t + 1 keys: every block of tokens is one run.
    attend_run(li, wid.x, t0, min(BQ, p.tokens - t0), p.pos0 + t0 + 1u, 0u);
}

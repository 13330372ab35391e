// Paged attention split by keys (flash-decoding), second pass: one workgroup per (head,
// query token) merges the `splits` pieces paged_attention_split.wgsl wrote, as
// attention_merge.wgsl does. A skipped token (l = -1 in its records) keeps its output row; a
// token with no keys gets zeros, as the reference writes.

struct Params {
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    block: u32,
    pool_blocks: u32,
    table_len: u32,
    scale: f32,
    window: u32,
    softcap: f32,
    // Pieces per (head, token): `PagedAttentionParams::_pad0` in the op's struct.
    splits: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t = wid.y;
    let hd = p.head_dim;
    let stride = hd + 2u;
    let base = (t * p.heads + h) * p.splits * stride;
    if (li >= hd || part[base + 1u] < 0.0) {
        return;
    }
    var big = -3.4028234e38;
    for (var s = 0u; s < p.splits; s++) {
        big = max(big, part[base + s * stride]);
    }
    var l = 0.0;
    var o = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        let rec = base + s * stride;
        let w = exp(part[rec] - big);
        l += part[rec + 1u] * w;
        o += part[rec + 2u + li] * w;
    }
    out[(t * p.heads + h) * hd + li] = select(o / l, 0.0, l == 0.0);
}

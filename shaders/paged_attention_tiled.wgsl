// Causal grouped-query attention of a batch's prompt tokens through their block tables and
// workgroup-memory tiles, the core in attention_tile.wgsl; takes what paged_attention.wgsl
// takes (rows[2t] is where token t's table starts in `table`, rows[2t + 1] how many keys it
// attends to), for head sizes up to 128.
//
// A run is up to 16 consecutive tokens, within a block of 16 (16 b .. 16 b + 15), of one
// sequence's prompt: the same table start and one key more each. The grid is one workgroup
// per (head, token), as paged_attention.wgsl's; the workgroup of a run's first token does
// the whole run and the others return, so a batch of several prompts and decode tokens runs
// each prompt 16 tokens a workgroup and each lone token as a run of one. Bounds as in
// paged_attention.wgsl: a token whose keys reach past table_len, or whose table names a block
// at or past pool_blocks, is skipped (its output row is not written). Its keys cover its
// run's earlier tokens' keys, so the valid tokens of a run are a prefix of it.

struct Params {
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    block: u32,
    pool_blocks: u32,
    table_len: u32,
    scale: f32,
    // Sliding window: a token attends to its last `window` keys; 0 is no window.
    window: u32,
    // Scores become softcap * tanh(score / softcap) when it is above 0 (Gemma 2).
    softcap: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kc: array<f32>;
@group(0) @binding(3) var<storage, read> vc: array<f32>;
@group(0) @binding(4) var<storage, read> token_rows: array<u32>;
@group(0) @binding(5) var<storage, read> table: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

// (tokens in the run, 0 where this workgroup's token is not a run's first; table start;
// keys of the first; table entries the last needs, as far as the table reaches)
var<workgroup> run: vec4<u32>;
var<workgroup> first_bad: atomic<u32>;
var<workgroup> valid_rows: u32;

// Key j of a table starting at `start` is in slot table[start + j / block] * block + j % block.
fn key_row(start: u32, j: u32) -> u32 {
    return (table[start + j / p.block] * p.block + j % p.block) * p.kv_heads * p.head_dim;
}

// Whether token b continues token a's run.
fn chains(a: u32, b: u32) -> bool {
    return token_rows[2u * b] == token_rows[2u * a] && token_rows[2u * b + 1u] == token_rows[2u * a + 1u] + 1u;
}

fn blocks_for(keys: u32) -> u32 {
    return keys / p.block + select(0u, 1u, keys % p.block != 0u);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t = wid.y;
    if (li == 0u) {
        let start = token_rows[2u * t];
        let n0 = token_rows[2u * t + 1u];
        var len = 0u;
        if (t % BQ == 0u || !chains(t - 1u, t)) {
            len = 1u;
            while (len < BQ && (t + len) % BQ != 0u && t + len < p.tokens && chains(t + len - 1u, t + len)) {
                len++;
            }
        }
        // A start past the table: every token of the run is skipped.
        if (start > p.table_len) {
            len = 0u;
        }
        var need = 0u;
        if (len > 0u) {
            need = min(blocks_for(n0 + len - 1u), p.table_len - start);
            atomicStore(&first_bad, p.table_len - start);
        }
        run = vec4<u32>(len, start, n0, need);
    }
    let info = workgroupUniformLoad(&run);
    if (info.x == 0u) {
        return;
    }
    for (var b = li; b < info.w; b += 256u) {
        if (table[info.y + b] >= p.pool_blocks) {
            atomicMin(&first_bad, b);
        }
    }
    workgroupBarrier();
    if (li == 0u) {
        // Token r is valid where its blocks are all in the table and name pool blocks.
        let fb = atomicLoad(&first_bad);
        var v = 0u;
        while (v < info.x && blocks_for(info.z + v) <= fb) {
            v++;
        }
        valid_rows = v;
    }
    let rows = workgroupUniformLoad(&valid_rows);
    if (rows > 0u) {
        attend_run(li, h, t, rows, info.z, info.y);
    }
}

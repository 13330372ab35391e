// Paged attention split by keys (flash-decoding), first pass: one workgroup per (head, query
// token, piece), over the token's keys through its block table as paged_attention.wgsl
// reads them (and with its checks: a token whose keys reach past table_len, or whose table
// names a block at or past pool_blocks, is skipped). The keys the token attends to (its
// window, else all) are cut into `splits` pieces of equal length; this workgroup writes its
// piece's running maximum m, sum l of exp(score - m) and weighted values o to `part`, at
// record ((t * heads + h) * splits + piece) of head_dim + 2 floats, through the chunk loop
// attention_split.wgsl runs (attention_split_walk.wgsl, prepended). A skipped token's
// records say so with l = -1; the merge then leaves its output row.

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
    // Pieces per (head, token): `PagedAttentionParams::_pad0` in the op's struct.
    splits: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kc: array<f32>;
@group(0) @binding(3) var<storage, read> vc: array<f32>;
@group(0) @binding(4) var<storage, read> rows: array<u32>;
@group(0) @binding(5) var<storage, read> table: array<u32>;
@group(0) @binding(6) var<storage, read_write> part: array<f32>;

// `live_keys` of a token that is skipped.
const SKIP: u32 = 0xffffffffu;
var<workgroup> bad: atomic<u32>;
var<workgroup> live_keys: u32;

// The token's first entry in `table`.
var<private> table_start: u32;

fn key_row(j: u32, kvh: u32) -> u32 {
    let slot = table[table_start + j / p.block] * p.block + j % p.block;
    return (slot * p.kv_heads + kvh) * p.head_dim;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t = wid.y;
    let start = rows[2u * t];
    let n_keys = rows[2u * t + 1u];
    table_start = start;
    let block = p.block;
    let n_blocks = n_keys / block + select(0u, 1u, n_keys % block != 0u);
    // Written without overflow: start and n_keys come from a buffer.
    let in_table = start <= p.table_len && n_blocks <= p.table_len - start;
    if (li == 0u) {
        atomicStore(&bad, select(1u, 0u, in_table));
    }
    workgroupBarrier();
    if (in_table) {
        for (var b = li; b < n_blocks; b += 256u) {
            if (table[start + b] >= p.pool_blocks) {
                atomicOr(&bad, 1u);
            }
        }
    }
    workgroupBarrier();
    if (li == 0u) {
        live_keys = select(n_keys, SKIP, atomicLoad(&bad) != 0u);
    }
    // Uniform across the workgroup, so the early return and the loop's barriers are too.
    let keys = workgroupUniformLoad(&live_keys);
    let h_rec = ((t * p.heads + h) * p.splits + wid.z) * (p.head_dim + 2u);
    if (keys == SKIP) {
        if (li == 0u) {
            part[h_rec + 1u] = -1.0;
        }
        return;
    }

    let first = select(0u, keys - min(keys, p.window), p.window != 0u);
    let per = (keys - first + p.splits - 1u) / p.splits;
    let lo = min(first + wid.z * per, keys);
    let hi = min(lo + per, keys);
    attend_head(li, t, wid.z, h, lo, hi);
}

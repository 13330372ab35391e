// Paged attention split by keys (flash-decoding), first pass: one workgroup per (head, query
// token, piece), over the token's keys through its block table as paged_attention.wgsl
// reads them (and with its checks: a token whose keys reach past table_len, or whose table
// names a block at or past pool_blocks, is skipped). The keys the token attends to (its
// window, else all) are cut into `splits` pieces of equal length; this workgroup writes its
// piece's running maximum m, sum l of exp(score - m) and weighted values o to `part`, at
// record ((t * heads + h) * splits + piece) of head_dim + 2 floats, as attention_split.wgsl
// does. A skipped token's records say so with l = -1; the merge then leaves its output row.

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
@group(0) @binding(2) var<storage, read> k_pool: array<f32>;
@group(0) @binding(3) var<storage, read> v_pool: array<f32>;
@group(0) @binding(4) var<storage, read> rows: array<u32>;
@group(0) @binding(5) var<storage, read> table: array<u32>;
@group(0) @binding(6) var<storage, read_write> part: array<f32>;

// The keys are scored and their values summed as attention_split.wgsl does: LANES
// invocations a key, neighbouring elements in neighbouring invocations, GROUPS keys in flight.
const LANES: u32 = 32u;
const GROUPS: u32 = 8u;
const CHUNK: u32 = 64u;
const PAD: u32 = 33u;
const PER_LANE: u32 = 8u;
// `live_keys` of a token that is skipped.
const SKIP: u32 = 0xffffffffu;
var<workgroup> qs: array<f32, 256>;
var<workgroup> scores: array<f32, 64>;
var<workgroup> red: array<f32, 2112>;
var<workgroup> bad: atomic<u32>;
var<workgroup> live_keys: u32;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wid.x;
    let t = wid.y;
    let start = rows[2u * t];
    let n_keys = rows[2u * t + 1u];
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

    let hd = p.head_dim;
    let kvh = h / (p.heads / p.kv_heads);
    let kv_stride = p.kv_heads * hd;
    let qbase = (t * p.heads + h) * hd;
    if (li < hd) {
        qs[li] = q[qbase + li];
    }
    workgroupBarrier();
    let g = li / LANES;
    let lane = li % LANES;
    var m = -3.4028234e38;
    var l = 0.0;
    var ov: array<f32, PER_LANE>;
    let first = select(0u, keys - min(keys, p.window), p.window != 0u);
    let per = (keys - first + p.splits - 1u) / p.splits;
    let lo = min(first + wid.z * per, keys);
    let hi = min(lo + per, keys);
    for (var c0 = lo; c0 < hi; c0 += CHUNK) {
        // Only the piece's live keys: a short piece pays for its own keys, not the chunk.
        let live = min(CHUNK, hi - c0);
        for (var kk = g; kk < live; kk += GROUPS) {
            let j = c0 + kk;
            let kb = (table[start + j / block] * block + j % block) * kv_stride + kvh * hd;
            var acc = 0.0;
            for (var d = lane; d < hd; d += LANES) {
                acc += qs[d] * k_pool[kb + d];
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
            let j = c0 + kk;
            let vb = (table[start + j / block] * block + j % block) * kv_stride + kvh * hd;
            for (var i = 0u; i < PER_LANE; i++) {
                let d = lane + i * LANES;
                if (d < hd) {
                    ov[i] += pw * v_pool[vb + d];
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
    if (li == 0u) {
        part[h_rec] = m;
        part[h_rec + 1u] = l;
    }
    if (li < hd) {
        var o = 0.0;
        for (var gg = 0u; gg < GROUPS; gg++) {
            o += red[gg * 256u + li];
        }
        part[h_rec + 2u + li] = o;
    }
}

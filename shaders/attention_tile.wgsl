// The core of prompt attention through workgroup-memory tiles (flash-attention style), shared
// by attention_tiled.wgsl and paged_attention_tiled.wgsl, each of which supplies `p` (heads,
// kv_heads, head_dim, scale, window, softcap), the bindings `q`, `kc`, `vc`, `out`, and
// `key_row(start, j)`: where key j of the run's keys starts in `kc`/`vc`.
//
// A workgroup takes a run of up to BQ consecutive query tokens of one head whose keys are
// the same sequence's (token r of the run attends to n0 + r keys, its window's last), and
// walks those keys BK at a time: the tile of keys is loaded once into workgroup memory and
// scored against every query of the run, then the tile of values replaces it and is summed
// with the softmax weights. One workgroup per (head, token) (attention.wgsl) reads each key
// once per query token; here once per BQ of them, in coalesced rows.
//
// Invocation li works for query row r = li / 16 of the run: it scores keys c and c + 16 of
// each tile (c = li % 16) and owns output elements c, c + 16, ... of its row (head_dim at
// most MAX_HD, so at most 8 of them). The row's running maximum and sum are computed alike by
// its 16 invocations from the shared scores, so they agree without a reduction.

const BQ: u32 = 16u;
const BK: u32 = 32u;
const MAX_HD: u32 = 128u;
// Key and value rows padded to MAX_HD + 1 floats, so the 16 invocations of a row reading 16
// keys' element d hit 16 different banks.
const KPAD: u32 = 129u;
// Below every real score: the sentinel of a masked key, and the maximum before any key.
const LOWEST: f32 = -3.4028234e38;

var<workgroup> tile_q: array<f32, 2048>;
var<workgroup> tile_kv: array<f32, 4128>;
var<workgroup> tile_s: array<f32, 512>;
var<workgroup> tile_p: array<f32, 512>;

// A key's score from its dot product with the query, or LOWEST where it is masked.
fn score(dot: f32, live: bool) -> f32 {
    var s = dot * p.scale;
    if (p.softcap > 0.0) {
        s = p.softcap * tanh(s / p.softcap);
    }
    return select(LOWEST, s, live);
}

// Attention of query tokens t0 .. t0 + rows - 1 of head h, token t0 + r attending to keys
// first(r) .. n0 + r - 1 (first(r) = n0 + r - window where a window is set). Must be
// called in uniform control flow with uniform arguments (it has barriers).
fn attend_run(li: u32, h: u32, t0: u32, rows: u32, n0: u32, start: u32) {
    let hd = p.head_dim;
    let kvh = h / (p.heads / p.kv_heads);
    let kv_off = kvh * hd;
    let r = li / 16u;
    let c = li % 16u;
    for (var i = li; i < BQ * hd; i += 256u) {
        let row = i / hd;
        var v = 0.0;
        if (row < rows) {
            v = q[((t0 + row) * p.heads + h) * hd + i % hd];
        }
        tile_q[i] = v;
    }
    let n_last = n0 + rows - 1u;
    // The first key any row of the run attends to: the first row's window start.
    let lo = select(0u, n0 - min(n0, p.window), p.window != 0u);
    let n_r = n0 + r;
    let first_r = select(0u, n_r - min(n_r, p.window), p.window != 0u);
    var m = LOWEST;
    var l = 0.0;
    // Output elements c, c + 16, ..., c + 112 of row r (those at head_dim and past are
    // computed from the padding of the value rows and never written).
    var o_lo = vec4<f32>(0.0);
    var o_hi = vec4<f32>(0.0);
    for (var k0 = lo / BK * BK; k0 < n_last; k0 += BK) {
        // Keys of this tile (fewer in the last). The loops over keys run to it, not to the
        // constant BK, and no array is private to an invocation: lavapipe took minutes to
        // compile the kernel with those loops unrolled into an array of 8 outputs.
        let kn = min(BK, n_last - k0);
        // The previous tile's values (and, the first time, the queries' loads) are done.
        workgroupBarrier();
        for (var i = li; i < BK * hd; i += 256u) {
            let j = i / hd;
            var v = 0.0;
            if (j < kn) {
                v = kc[key_row(start, k0 + j) + kv_off + i % hd];
            }
            tile_kv[j * KPAD + i % hd] = v;
        }
        workgroupBarrier();
        // Keys c and c + 16 of the tile against row r's query.
        var s0 = 0.0;
        var s1 = 0.0;
        for (var d = 0u; d < hd; d++) {
            let qd = tile_q[r * hd + d];
            s0 += qd * tile_kv[c * KPAD + d];
            s1 += qd * tile_kv[(c + 16u) * KPAD + d];
        }
        tile_s[r * BK + c] = score(s0, r < rows && k0 + c >= first_r && k0 + c < n_r);
        tile_s[r * BK + c + 16u] = score(s1, r < rows && k0 + c + 16u >= first_r && k0 + c + 16u < n_r);
        workgroupBarrier();
        for (var i = li; i < BK * hd; i += 256u) {
            let j = i / hd;
            var v = 0.0;
            if (j < kn) {
                v = vc[key_row(start, k0 + j) + kv_off + i % hd];
            }
            tile_kv[j * KPAD + i % hd] = v;
        }
        var cm = m;
        for (var j = 0u; j < kn; j++) {
            cm = max(cm, tile_s[r * BK + j]);
        }
        // A masked key's score is LOWEST: its weight is 0 (not exp(0) when nothing is live).
        let s0w = tile_s[r * BK + c];
        let s1w = tile_s[r * BK + c + 16u];
        tile_p[r * BK + c] = select(0.0, exp(s0w - cm), s0w > LOWEST);
        tile_p[r * BK + c + 16u] = select(0.0, exp(s1w - cm), s1w > LOWEST);
        workgroupBarrier();
        let corr = exp(m - cm);
        var csum = 0.0;
        var acc_lo = vec4<f32>(0.0);
        var acc_hi = vec4<f32>(0.0);
        for (var j = 0u; j < kn; j++) {
            let w = tile_p[r * BK + j];
            let row = j * KPAD + c;
            csum += w;
            acc_lo += w * vec4<f32>(tile_kv[row], tile_kv[row + 16u], tile_kv[row + 32u], tile_kv[row + 48u]);
            acc_hi += w * vec4<f32>(tile_kv[row + 64u], tile_kv[row + 80u], tile_kv[row + 96u], tile_kv[row + 112u]);
        }
        o_lo = o_lo * corr + acc_lo;
        o_hi = o_hi * corr + acc_hi;
        l = l * corr + csum;
        m = cm;
    }
    if (r < rows) {
        let base = ((t0 + r) * p.heads + h) * hd;
        // A row without keys (a paged token of none) writes zeros, as the reference.
        let inv = select(1.0 / l, 0.0, l == 0.0);
        let lo4 = o_lo * inv;
        let hi4 = o_hi * inv;
        for (var e = 0u; e < 4u; e++) {
            if (c + e * 16u < hd) {
                out[base + c + e * 16u] = lo4[e];
            }
            if (c + 64u + e * 16u < hd) {
                out[base + c + 64u + e * 16u] = hi4[e];
            }
        }
    }
}

// The chunk loop of the per-head split attention kernels (attention_split.wgsl over the
// contiguous cache, paged_attention_split.wgsl over a block table), prepended to each by
// shaders/src/lib.rs. The kernel declares `p` (with heads, kv_heads, head_dim, scale,
// softcap, splits), `q`, `kc`, `vc` (the caches as f32 rows) and `part`, and defines
// key_row(j, kvh): the index where key j's row of key/value head kvh starts.
//
// attend_head() scores keys lo..hi of query head h of token t 64 keys at a time with an online
// softmax, as attention.wgsl does over all of them, and writes the piece's running maximum m,
// sum l of exp(score - m) and weighted values o (head_dim of them) to `part`, at record
// ((t * heads + h) * splits + piece) of head_dim + 2 floats. An empty piece writes
// m = -FLT_MAX, l = 0, o = 0, which the merge weighs as 0.

// Each key is read by LANES invocations at once, element d by invocation d % LANES, so a
// load instruction of 32 invocations reads 32 neighbouring floats of one key's row instead
// of 32 rows' d-th elements (one invocation per key, walking its row alone, was latency-bound:
// 32 us a layer for the 8B shape's 576 keys on an H200). GROUPS keys are in flight at a time,
// and the weighted values are summed the same way, each invocation keeping the elements
// lane, lane + LANES, ... of its group's keys, the groups' sums added at the end.
const LANES: u32 = 32u;
const GROUPS: u32 = 8u;
// Keys scored per chunk: their partial dot products (CHUNK rows of LANES, padded to LANES + 1
// so a row's sum reads every bank once) fill `red`, which later holds GROUPS x 256 values.
const CHUNK: u32 = 64u;
const PAD: u32 = 33u;
// head_dim is at most 256 (qs), so at most 256 / LANES elements per invocation.
const PER_LANE: u32 = 8u;
var<workgroup> qs: array<f32, 256>;
var<workgroup> scores: array<f32, 64>;
var<workgroup> red: array<f32, 2112>;

// Call in uniform control flow (its arguments but li uniform).
fn attend_head(li: u32, t: u32, piece: u32, h: u32, lo: u32, hi: u32) {
    let hd = p.head_dim;
    let kvh = h / (p.heads / p.kv_heads);
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
    for (var c0 = lo; c0 < hi; c0 += CHUNK) {
        // Only the piece's live keys: a short piece pays for its own keys, not the chunk.
        let live = min(CHUNK, hi - c0);
        for (var kk = g; kk < live; kk += GROUPS) {
            let kb = key_row(c0 + kk, kvh);
            var acc = 0.0;
            for (var d = lane; d < hd; d += LANES) {
                acc += qs[d] * kc[kb + d];
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
            let vb = key_row(c0 + kk, kvh);
            for (var i = 0u; i < PER_LANE; i++) {
                let d = lane + i * LANES;
                if (d < hd) {
                    ov[i] += pw * vc[vb + d];
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
    let rec = ((t * p.heads + h) * p.splits + piece) * (hd + 2u);
    if (li == 0u) {
        part[rec] = m;
        part[rec + 1u] = l;
    }
    if (li < hd) {
        var o = 0.0;
        for (var gg = 0u; gg < GROUPS; gg++) {
            o += red[gg * 256u + li];
        }
        part[rec + 2u + li] = o;
    }
}

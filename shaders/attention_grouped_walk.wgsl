// The chunk loop of the grouped decode attention kernels (attention_grouped.wgsl over the
// contiguous cache, paged_attention_grouped.wgsl over a block table), prepended to each by
// shaders/src/lib.rs. One workgroup scores up to GQ query heads that share one key/value head
// (grouped-query attention: 4 of the 8B's 32 heads share each of its 8 key/value heads)
// against each key and value row loaded once, where the per-head kernels
// (attention_split.wgsl) read every row once per query head. The kernel declares `p` (with
// heads, head_dim, scale, softcap, splits), `q`, `k4`, `v4` (the caches as vec4 rows: head_dim
// is a multiple of 4 for these kernels) and `part`, and defines key_row4(j, kvh): the vec4
// index where key j's row of key/value head kvh starts.
//
// attend() writes, for each of its heads, the record attention_merge.wgsl reads: the piece's
// running maximum m, sum l of exp(score - m) and weighted values o, at record
// ((t * heads + h) * splits + piece) of head_dim + 2 floats, as attention_split.wgsl does.

const WG: u32 = 256u;
// Query heads a workgroup scores at most; a group of more (Llama 3 70B's 8) takes several
// workgroups per key/value head. Loops over heads run to GQ, a constant, so the per-head sums
// stay in registers; heads past the group's own score zeros (their queries are zero) and are
// not written.
const GQ: u32 = 4u;
// Keys a chunk: each is scored by KL invocations (neighbouring vec4s of its row in
// neighbouring invocations, so 8 invocations read 128 contiguous bytes), CHUNK x KL = WG.
const CHUNK: u32 = 32u;
const KL: u32 = 8u;
// Partial dot products per (head, key) padded from KL to KL + 1 floats, so the sum over a
// key's lanes reads distinct banks.
const KPAD: u32 = 9u;
// vec4s of a row one scoring invocation reads at most: head_dim <= 256 = MAXV * KL * 4.
const MAXV: u32 = 8u;
// Values summed per invocation per pass, loaded before any is used (loads in flight).
const VU: u32 = 4u;
const NEG_BIG: f32 = -3.4028234e38;

// The group's queries (GQ x 64 vec4, zeros past its heads); reused at the end to add the
// value sums of the invocations that share an output element.
var<workgroup> qs: array<vec4<f32>, 256>;
var<workgroup> dots: array<f32, 1152>;
// A chunk's scores per (head, key), then exp(score - m); a head's row padded from CHUNK to
// PS floats, so the 4 invocations walking their heads' rows read distinct banks.
const PS: u32 = 33u;
var<workgroup> probs: array<f32, 132>;
// Per head: running maximum, running sum, and the current chunk's correction exp(m_old - m).
var<workgroup> hm: array<f32, 4>;
var<workgroup> hl: array<f32, 4>;
var<workgroup> hc: array<f32, 4>;

// Scores keys lo..hi of key/value head kvh for query heads h0..h0+nq of token t, writing
// piece `piece`'s records. Call in uniform control flow (its arguments uniform).
fn attend(li: u32, t: u32, piece: u32, kvh: u32, h0: u32, nq: u32, lo: u32, hi: u32) {
    let hd = p.head_dim;
    let hd4 = hd / 4u;
    for (var i = li; i < GQ * 64u; i += WG) {
        let j = i / 64u;
        let c = i % 64u;
        var v = vec4<f32>(0.0);
        if (j < nq && c < hd4) {
            let b = (t * p.heads + h0 + j) * hd + 4u * c;
            v = vec4<f32>(q[b], q[b + 1u], q[b + 2u], q[b + 3u]);
        }
        qs[i] = v;
    }
    if (li < GQ) {
        hm[li] = NEG_BIG;
        hl[li] = 0.0;
    }
    workgroupBarrier();
    // Scoring: key slot ks, lane kl. Values: column vc of key group vg, n_vg groups.
    let ks = li / KL;
    let kl = li % KL;
    let vc = li % hd4;
    let vg = li / hd4;
    let n_vg = WG / hd4;
    var ov: array<vec4<f32>, GQ>;
    for (var c0 = lo; c0 < hi; c0 += CHUNK) {
        // Only the piece's live keys: a short piece pays for its own keys, not the chunk.
        let live = min(CHUNK, hi - c0);
        if (ks < live) {
            let kb = key_row4(c0 + ks, kvh);
            var kr: array<vec4<f32>, MAXV>;
            for (var i = 0u; i < MAXV; i++) {
                let c = kl + i * KL;
                if (c < hd4) {
                    kr[i] = k4[kb + c];
                }
            }
            var acc: array<f32, GQ>;
            for (var i = 0u; i < MAXV; i++) {
                let c = kl + i * KL;
                if (c < hd4) {
                    for (var j = 0u; j < GQ; j++) {
                        acc[j] += dot(qs[j * 64u + c], kr[i]);
                    }
                }
            }
            for (var j = 0u; j < GQ; j++) {
                dots[(j * CHUNK + ks) * KPAD + kl] = acc[j];
            }
        }
        workgroupBarrier();
        if (li < GQ * CHUNK) {
            let kk = li % CHUNK;
            let pi = (li / CHUNK) * PS + kk;
            var s = 0.0;
            for (var x = 0u; x < KL; x++) {
                s += dots[li * KPAD + x];
            }
            s *= p.scale;
            if (p.softcap > 0.0) {
                s = p.softcap * tanh(s / p.softcap);
            }
            probs[pi] = select(NEG_BIG, s, kk < live);
        }
        workgroupBarrier();
        if (li < GQ) {
            var cm = hm[li];
            for (var kk = 0u; kk < live; kk++) {
                cm = max(cm, probs[li * PS + kk]);
            }
            hc[li] = exp(hm[li] - cm);
            hm[li] = cm;
        }
        workgroupBarrier();
        if (li < GQ * CHUNK) {
            let j = li / CHUNK;
            let kk = li % CHUNK;
            probs[j * PS + kk] = select(0.0, exp(probs[j * PS + kk] - hm[j]), kk < live);
        }
        workgroupBarrier();
        if (li < GQ) {
            var cs = 0.0;
            for (var kk = 0u; kk < live; kk++) {
                cs += probs[li * PS + kk];
            }
            hl[li] = hl[li] * hc[li] + cs;
        }
        if (vg < n_vg) {
            for (var j = 0u; j < GQ; j++) {
                ov[j] *= hc[j];
            }
            for (var k0 = vg; k0 < live; k0 += VU * n_vg) {
                var vv: array<vec4<f32>, VU>;
                for (var u = 0u; u < VU; u++) {
                    let kk = min(k0 + u * n_vg, live - 1u);
                    vv[u] = v4[key_row4(c0 + kk, kvh) + vc];
                }
                for (var u = 0u; u < VU; u++) {
                    let kk = k0 + u * n_vg;
                    if (kk < live) {
                        for (var j = 0u; j < GQ; j++) {
                            ov[j] += probs[j * PS + kk] * vv[u];
                        }
                    }
                }
            }
        }
        // Everyone is done with this chunk's scores and sums before the next overwrites them.
        workgroupBarrier();
    }
    for (var j = 0u; j < GQ; j++) {
        if (j < nq) {
            if (vg < n_vg) {
                qs[vg * hd4 + vc] = ov[j];
            }
            workgroupBarrier();
            let rec = ((t * p.heads + h0 + j) * p.splits + piece) * (hd + 2u);
            if (li == 0u) {
                part[rec] = hm[j];
                part[rec + 1u] = hl[j];
            }
            if (li < hd4) {
                var o = vec4<f32>(0.0);
                for (var g = 0u; g < n_vg; g++) {
                    o += qs[g * hd4 + li];
                }
                let b = rec + 2u + 4u * li;
                part[b] = o.x;
                part[b + 1u] = o.y;
                part[b + 2u] = o.z;
                part[b + 3u] = o.w;
            }
            workgroupBarrier();
        }
    }
}

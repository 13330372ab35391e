// The streaming walk (stream_walk.wgsl) on 8-bit integers: the same chunks, ROWS rows and
// TOKENS tokens a workgroup, but each chunk's weights come as two words of packed signed
// bytes with a scale and an offset (the format's w_chunk_i8: the chunk's weights are
// d * byte + m), and each token's activations as two words of int8 from quantize_q8 with
// their block's step dx. A row's chunk then adds
//   dx * (d * dot4I8Packed(w, x) + m * (sum of the chunk's eight activation bytes)),
// the byte sum computed once per chunk and token for all ROWS rows. The kernel defines
// xq_at(token, word), xd_at(token, block) and TOKENS.

const ROWS: u32 = 4u;
const WG: u32 = 64u;
const ONES: u32 = 0x01010101u;

fn row_i8(w: I8W, xa: u32, xb: u32, sx: f32) -> f32 {
    return w.d * f32(dot4I8Packed(w.lo, xa) + dot4I8Packed(w.hi, xb)) + w.m * sx;
}

fn walk(r0: u32, t0: u32, li: u32) -> array<vec4<f32>, TOKENS> {
    var acc: array<vec4<f32>, TOKENS>;
    let last = p.rows - 1u;
    let rb = vec4<u32>(min(r0, last), min(r0 + 1u, last), min(r0 + 2u, last), min(r0 + 3u, last)) * p.row_bytes;
    let chunks = p.cols / 8u;
    for (var c = li; c < chunks; c += WG) {
        let e = chunk_at(c);
        let at = e / 4u;
        let blk = e.x / 32u;
        let w0 = w_chunk_i8(rb.x, c);
        let w1 = w_chunk_i8(rb.y, c);
        let w2 = w_chunk_i8(rb.z, c);
        let w3 = w_chunk_i8(rb.w, c);
        for (var t = 0u; t < TOKENS; t++) {
            let xa = xq_at(t0 + t, at.x);
            let xb = xq_at(t0 + t, at.y);
            let sx = f32(dot4I8Packed(xa, ONES) + dot4I8Packed(xb, ONES));
            acc[t] += xd_at(t0 + t, blk) * vec4<f32>(
                row_i8(w0, xa, xb, sx),
                row_i8(w1, xa, xb, sx),
                row_i8(w2, xa, xb, sx),
                row_i8(w3, xa, xb, sx),
            );
        }
    }
    return acc;
}

// The streaming matrix-vector walk (linear_matvec_stream, linear_matvec_fused_stream): a
// workgroup of WG invocations takes ROWS rows and TOKENS tokens; invocation i takes chunks
// i, i + WG, ... of the row (the format's w_chunk: 8 weights from one load of quants, so
// neighbouring invocations read neighbouring words), dequantizes each chunk once for all
// TOKENS tokens and loads each token's activations once (two vec4 loads) for all ROWS rows,
// keeping ROWS x TOKENS sums in registers. The kernel defines x_at(token, vec4 index), and
// TOKENS; rows past the end re-read the last row, and their sums are dropped.

const ROWS: u32 = 4u;
const WG: u32 = 64u;

fn walk(r0: u32, t0: u32, li: u32) -> array<vec4<f32>, TOKENS> {
    var acc: array<vec4<f32>, TOKENS>;
    let last = p.rows - 1u;
    let rb = vec4<u32>(min(r0, last), min(r0 + 1u, last), min(r0 + 2u, last), min(r0 + 3u, last)) * p.row_bytes;
    let chunks = p.cols / 8u;
    for (var c = li; c < chunks; c += WG) {
        let at = chunk_at(c) / 4u;
        let w0 = w_chunk(rb.x, c);
        let w1 = w_chunk(rb.y, c);
        let w2 = w_chunk(rb.z, c);
        let w3 = w_chunk(rb.w, c);
        for (var t = 0u; t < TOKENS; t++) {
            let xa = x_at(t0 + t, at.x);
            let xb = x_at(t0 + t, at.y);
            acc[t] += vec4<f32>(
                dot(w0.a, xa) + dot(w0.b, xb),
                dot(w1.a, xa) + dot(w1.b, xb),
                dot(w2.a, xa) + dot(w2.b, xb),
                dot(w3.a, xa) + dot(w3.b, xb),
            );
        }
    }
    return acc;
}

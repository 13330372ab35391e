// The streaming matrix-vector walk over weights repacked at upload (`--wgpu-matvec
// repacked`; chunks_v4/): the walk of stream_walk.wgsl (a workgroup of WG invocations takes
// ROWS rows and TOKENS tokens, ROWS x TOKENS sums in registers, rows past the end re-read the
// last row) with a 32-weight block a step instead of an 8-weight chunk: invocation i takes
// blocks i, i + WG, ... of the row, each one 16-byte load of quants (two for Q8_0) and a word
// of scales per row, and each token's 32 activations (8 vec4 loads) once for all ROWS rows.
// The kernel's `w` is an array<vec4<u32>>; rows are whole blocks (of 32 elements).

const ROWS: u32 = 4u;
const WG: u32 = 64u;

fn walk(r0: u32, t0: u32, li: u32) -> array<vec4<f32>, TOKENS> {
    var acc: array<vec4<f32>, TOKENS>;
    let last = p.rows - 1u;
    let nb = p.cols / 32u;
    let k = vec4<u32>(min(r0, last), min(r0 + 1u, last), min(r0 + 2u, last), min(r0 + 3u, last)) * nb;
    for (var b = li; b < nb; b += WG) {
        let w0 = blk_load(k.x + b);
        let w1 = blk_load(k.y + b);
        let w2 = blk_load(k.z + b);
        let w3 = blk_load(k.w + b);
        for (var t = 0u; t < TOKENS; t++) {
            let i = 8u * b;
            let xv = array<vec4<f32>, 8>(
                x_at(t0 + t, i), x_at(t0 + t, i + 1u), x_at(t0 + t, i + 2u), x_at(t0 + t, i + 3u),
                x_at(t0 + t, i + 4u), x_at(t0 + t, i + 5u), x_at(t0 + t, i + 6u), x_at(t0 + t, i + 7u),
            );
            let xs = dot(xv[0] + xv[1] + xv[2] + xv[3] + xv[4] + xv[5] + xv[6] + xv[7], vec4<f32>(1.0));
            acc[t] += vec4<f32>(blk_dot(w0, xv, xs), blk_dot(w1, xv, xs), blk_dot(w2, xv, xs), blk_dot(w3, xv, xs));
        }
    }
    return acc;
}

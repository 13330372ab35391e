// Block loaders of the vec4 streaming walk (stream_walk_v4.wgsl) over weights repacked at
// upload (formats/q4_0r.wgsl, q4_1r.wgsl, q8_0r.wgsl), with the kernel's `w` an
// array<vec4<u32>>: block k (counted across rows) comes as one or two 16-byte loads of quants
// and one word of scales; blk_dot takes its 32 activations as 8 vec4 (elements 4i .. 4i + 3
// in xv[i]) and their sum.

// The 8 nibbles of a word as (low nibbles, high nibbles), low byte first.
fn nibbles(word: u32) -> mat2x4<f32> {
    let b = vec4<u32>(word, word >> 8u, word >> 16u, word >> 24u);
    return mat2x4<f32>(vec4<f32>(b & vec4<u32>(15u)), vec4<f32>((b >> vec4<u32>(4u)) & vec4<u32>(15u)));
}

// The four signed bytes of a word, low byte first.
fn s8x4v(q: u32) -> vec4<f32> {
    return vec4<f32>(vec4<i32>(i32(q << 24u), i32(q << 16u), i32(q << 8u), i32(q)) >> vec4<u32>(24u));
}

// The 16 bytes of Q4 nibbles against xv: byte j holds element j (low) and j + 16 (high).
fn q4_dot(q: vec4<u32>, xv: array<vec4<f32>, 8>) -> f32 {
    let n0 = nibbles(q.x);
    let n1 = nibbles(q.y);
    let n2 = nibbles(q.z);
    let n3 = nibbles(q.w);
    return dot(n0[0], xv[0]) + dot(n1[0], xv[1]) + dot(n2[0], xv[2]) + dot(n3[0], xv[3])
        + dot(n0[1], xv[4]) + dot(n1[1], xv[5]) + dot(n2[1], xv[6]) + dot(n3[1], xv[7]);
}

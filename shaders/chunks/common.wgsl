// Chunk loaders for the streaming matrix-vector kernels: a row is walked in chunks of 8
// weights that a format stores together, so one load of quants serves all 8 (both nibbles of
// a word, say). Chunk c covers elements chunk_at(c).x .. + 3 and chunk_at(c).y .. + 3 (both
// multiples of 4, so the activations come as two vec4 loads); w_chunk returns their weights.
// Chunks cover a row exactly when its length is a multiple of 8 (and of the format's block).

struct W8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

// The four signed bytes of a word, low byte first.
fn s8x4(q: u32) -> vec4<f32> {
    return vec4<f32>(vec4<i32>(i32(q << 24u), i32(q << 16u), i32(q << 8u), i32(q)) >> vec4<u32>(24u));
}

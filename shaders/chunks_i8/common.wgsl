// Integer chunk loaders for stream_walk_i8.wgsl: chunk c (the same elements as the format's
// chunk_at in chunks/) as two words of packed signed bytes, `lo` for the elements at
// chunk_at(c).x and `hi` for those at chunk_at(c).y, with the weights d * byte + m.

struct I8W {
    lo: u32,
    hi: u32,
    d: f32,
    m: f32,
}

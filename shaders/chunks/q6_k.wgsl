// Q6_K: 32 chunks per 210-byte super-block, chunk k its k-th word of low nibbles (byte
// 64 n + 32 h + l with n = k / 16, h = k / 8 % 2, l = 4 (k % 8)): the low nibbles are
// elements 128 n + 32 h + l .. + 3, the high ones 64 further on; their top bits are bit pairs
// h and h + 2 of the word at byte 128 + 32 n + l, their scales bytes 4 apart.
fn chunk_at(c: u32) -> vec2<u32> {
    let k = c & 31u;
    let e = (c >> 5u) * 256u + (k >> 4u) * 128u + ((k >> 3u) & 1u) * 32u + (k & 7u) * 4u;
    return vec2<u32>(e, e + 64u);
}

fn w_chunk(row: u32, c: u32) -> W8 {
    let blk = row + (c >> 5u) * 210u;
    let k = c & 31u;
    let n = k >> 4u;
    let h = (k >> 3u) & 1u;
    let l = (k & 7u) * 4u;
    let lo = bytes4(load_u32_at(blk + 64u * n + 32u * h + l));
    let hb = bytes4(load_u32_at(blk + 128u + 32u * n + l));
    let qa = (lo & vec4<u32>(15u)) | (((hb >> vec4<u32>(2u * h)) & vec4<u32>(3u)) << vec4<u32>(4u));
    let qb = (lo >> vec4<u32>(4u)) | (((hb >> vec4<u32>(2u * h + 4u)) & vec4<u32>(3u)) << vec4<u32>(4u));
    let si = blk + 192u + 8u * n + 2u * h + (l >> 4u);
    let sa = f32(i32(load_u8_at(si) << 24u) >> 24u);
    let sb = f32(i32(load_u8_at(si + 4u) << 24u) >> 24u);
    let d = load_f16_at(blk + 208u);
    return W8(d * sa * (vec4<f32>(qa) - vec4<f32>(32.0)), d * sb * (vec4<f32>(qb) - vec4<f32>(32.0)));
}

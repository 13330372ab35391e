// Q6_K: super-blocks of 256 elements in 210 bytes (so only 2-byte aligned: every read goes
// through load_u32_at/load_f16_at): 128 bytes of low nibbles, 64 bytes of high bit pairs,
// sixteen int8 scales, f16 d. Element 128n + 32k + l: nibble k / 2 of low byte
// 64n + 32 (k % 2) + l, bits 2k..2k+2 of high byte 32n + l; x = d sc (q - 32).
fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = row + (e >> 8u) * 210u;
    let i = e & 255u;
    let n = i >> 7u;
    let k = (i >> 5u) & 3u;
    let l = i & 31u;
    let low = (bytes4(load_u32_at(blk + 64u * n + 32u * (k & 1u) + l)) >> vec4<u32>(4u * (k >> 1u))) & vec4<u32>(15u);
    let high = (bytes4(load_u32_at(blk + 128u + 32u * n + l)) >> vec4<u32>(2u * k)) & vec4<u32>(3u);
    let q = vec4<f32>(low | (high << vec4<u32>(4u))) - vec4<f32>(32.0);
    let sc = f32(i32(load_u8_at(blk + 192u + (i >> 4u)) << 24u) >> 24u);
    return load_f16_at(blk + 208u) * sc * q;
}

fn w_load1(row: u32, e: u32) -> f32 {
    return w_load4(row, e & ~3u)[e & 3u];
}

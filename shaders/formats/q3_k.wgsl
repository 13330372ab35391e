// Q3_K: super-blocks of 256 elements in 110 bytes (so only 2-byte aligned): 32 bytes of high
// bits, 64 bytes of 2-bit quants, 12 bytes of sixteen 6-bit scales, f16 d. Element
// 128h + 32j + l: low bits 2j of quant byte 32h + l, third bit 4h + j of high byte l (clear
// means -4); scale of element i: low nibble (i / 16) % 8 of the scale bytes 0..8, high pair
// (i / 16) % 4 of bytes 8..12, minus 32; x = d sc q.
fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = row + (e >> 8u) * 110u;
    let i = e & 255u;
    let h = i >> 7u;
    let j = (i >> 5u) & 3u;
    let l = i & 31u;
    let low = (bytes4(load_u32_at(blk + 32u + 32u * h + l)) >> vec4<u32>(2u * j)) & vec4<u32>(3u);
    let hb = (bytes4(load_u32_at(blk + l)) >> vec4<u32>(4u * h + j)) & vec4<u32>(1u);
    let q = vec4<f32>(low) + 4.0 * vec4<f32>(hb) - vec4<f32>(4.0);
    let is = i >> 4u;
    let slo = (load_u8_at(blk + 96u + (is & 7u)) >> (4u * (is >> 3u))) & 15u;
    let shi = (load_u8_at(blk + 104u + (is & 3u)) >> (2u * (is >> 2u))) & 3u;
    let sc = f32(i32(slo | (shi << 4u)) - 32);
    return load_f16_at(blk + 108u) * sc * q;
}

fn w_load1(row: u32, e: u32) -> f32 {
    return w_load4(row, e & ~3u)[e & 3u];
}

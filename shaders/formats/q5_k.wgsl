// Q5_K: super-blocks of 256 elements in 176 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales
// and minimums (as Q4_K), 32 bytes of fifth bits, 128 bytes of nibbles. Element 64c + 32h + l
// is nibble h of byte 32c + l with fifth bit 2c + h of high byte l; x = d sc q - dmin m.

fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = row + (e >> 8u) * 176u;
    let i = e & 255u;
    let s = i >> 5u;
    let l = i & 31u;
    let low = (bytes4(load_u32_at(blk + 48u + 32u * (s >> 1u) + l)) >> vec4<u32>(4u * (s & 1u))) & vec4<u32>(15u);
    let high = (bytes4(load_u32_at(blk + 16u + l)) >> vec4<u32>(s)) & vec4<u32>(1u);
    let dm = unpack2x16float(load_u32_at(blk));
    let sm = scale_min_k4(blk + 4u, s);
    return dm.x * sm.x * vec4<f32>(low | (high << vec4<u32>(4u))) - vec4<f32>(dm.y * sm.y);
}

fn w_load1(row: u32, e: u32) -> f32 {
    return w_load4(row, e & ~3u)[e & 3u];
}

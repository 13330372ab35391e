// Q4_K: super-blocks of 256 elements in 144 bytes: f16 d, f16 dmin, 12 bytes of eight 6-bit
// scales and minimums (one pair per 32 elements), 128 bytes of nibbles. Element 64c + 32h + l
// is nibble h of byte 32c + l; x = d sc q - dmin m.

fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = row + (e >> 8u) * 144u;
    let i = e & 255u;
    let s = i >> 5u;
    let l = i & 31u;
    let q = (bytes4(load_u32_at(blk + 16u + 32u * (s >> 1u) + l)) >> vec4<u32>(4u * (s & 1u))) & vec4<u32>(15u);
    let dm = unpack2x16float(load_u32_at(blk));
    let sm = scale_min_k4(blk + 4u, s);
    return dm.x * sm.x * vec4<f32>(q) - vec4<f32>(dm.y * sm.y);
}

fn w_load1(row: u32, e: u32) -> f32 {
    return w_load4(row, e & ~3u)[e & 3u];
}

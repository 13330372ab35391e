// Q2_K: super-blocks of 256 elements in 84 bytes: 16 scale bytes (low nibble a 4-bit scale,
// high nibble a 4-bit minimum, one per 16 elements), 64 bytes of 2-bit quants, f16 d, f16 dmin.
// Element 128h + 32j + l is bits 2j..2j+2 of quant byte 32h + l; x = d sc q - dmin m.
// (engine/src/quant/kquants.rs has every K-quant layout.)
fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = row + (e >> 8u) * 84u;
    let i = e & 255u;
    let h = i >> 7u;
    let j = (i >> 5u) & 3u;
    let l = i & 31u;
    let q = (bytes4(load_u32_at(blk + 16u + 32u * h + l)) >> vec4<u32>(2u * j)) & vec4<u32>(3u);
    let sc = load_u8_at(blk + (i >> 4u));
    let dm = unpack2x16float(load_u32_at(blk + 80u));
    return dm.x * f32(sc & 15u) * vec4<f32>(q) - vec4<f32>(dm.y * f32(sc >> 4u));
}

fn w_load1(row: u32, e: u32) -> f32 {
    return w_load4(row, e & ~3u)[e & 3u];
}

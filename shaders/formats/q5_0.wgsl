// Q5_0: blocks of 32 elements in 22 bytes (so only 2-byte aligned): f16 scale d, a u32 whose
// bit j is element j's fifth bit, then 16 bytes; byte j holds element j in its low nibble and
// element j + 16 in its high nibble; x = d * (q - 16).
fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = row + (e >> 5u) * 22u;
    let j = e & 31u;
    let qh = load_u32_at(blk + 2u) >> j;
    let word = load_u32_at(blk + 6u + (j & 15u));
    let low = bytes4(select(word, word >> 4u, j >= 16u)) & vec4<u32>(15u);
    let high = (vec4<u32>(qh, qh >> 1u, qh >> 2u, qh >> 3u) & vec4<u32>(1u)) << vec4<u32>(4u);
    return load_f16_at(blk) * (vec4<f32>(low | high) - vec4<f32>(16.0));
}

// Four elements of an aligned group share their bytes, so one element reads its group.
fn w_load1(row: u32, e: u32) -> f32 {
    return w_load4(row, e & ~3u)[e & 3u];
}

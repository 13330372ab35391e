// Q4_0: blocks of 32 elements in 18 bytes: f16 scale d, then 16 bytes; byte j holds element j
// in its low nibble and element j + 16 in its high nibble; x = d * (q - 8).
fn w_load1(row: u32, e: u32) -> f32 {
    let blk = row + (e >> 5u) * 18u;
    let j = e & 31u;
    let byte = load_u32_at(blk + 2u + (j & 15u)) & 0xffu;
    let q = select(byte & 15u, byte >> 4u, j >= 16u);
    return load_f16_at(blk) * (f32(q) - 8.0);
}

fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = row + (e >> 5u) * 18u;
    let j = e & 31u;
    let word = load_u32_at(blk + 2u + (j & 15u));
    let nib = select(word, word >> 4u, j >= 16u);
    let q = vec4<u32>(nib, nib >> 8u, nib >> 16u, nib >> 24u) & vec4<u32>(15u);
    return load_f16_at(blk) * (vec4<f32>(q) - vec4<f32>(8.0));
}

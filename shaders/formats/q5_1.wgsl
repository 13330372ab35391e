// Q5_1: blocks of 32 elements in 24 bytes: f16 scale d, f16 minimum m, a u32 of fifth bits
// (bit j for element j), then 16 bytes of nibbles as in Q5_0; x = d * q + m.
fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = row + (e >> 5u) * 24u;
    let j = e & 31u;
    let dm = unpack2x16float(load_u32_at(blk));
    let qh = load_u32_at(blk + 4u) >> j;
    let word = load_u32_at(blk + 8u + (j & 15u));
    let low = bytes4(select(word, word >> 4u, j >= 16u)) & vec4<u32>(15u);
    let high = (vec4<u32>(qh, qh >> 1u, qh >> 2u, qh >> 3u) & vec4<u32>(1u)) << vec4<u32>(4u);
    return dm.x * vec4<f32>(low | high) + vec4<f32>(dm.y);
}

fn w_load1(row: u32, e: u32) -> f32 {
    return w_load4(row, e & ~3u)[e & 3u];
}

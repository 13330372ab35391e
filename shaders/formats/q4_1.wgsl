// Q4_1: blocks of 32 elements in 20 bytes: f16 scale d, f16 minimum m, then 16 bytes; byte j
// holds element j in its low nibble and element j + 16 in its high nibble; x = d * q + m.
// Blocks are word-aligned, so no straddling loads are needed.
fn w_load1(row: u32, e: u32) -> f32 {
    let blk = (row >> 2u) + (e >> 5u) * 5u;
    let dm = unpack2x16float(w[blk]);
    let j = e & 31u;
    let byte = (w[blk + 1u + ((j & 15u) >> 2u)] >> ((j & 3u) * 8u)) & 0xffu;
    let q = select(byte & 15u, byte >> 4u, j >= 16u);
    return dm.x * f32(q) + dm.y;
}

fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = (row >> 2u) + (e >> 5u) * 5u;
    let dm = unpack2x16float(w[blk]);
    let j = e & 31u;
    let word = w[blk + 1u + ((j & 15u) >> 2u)];
    let nib = select(word, word >> 4u, j >= 16u);
    let q = vec4<u32>(nib, nib >> 8u, nib >> 16u, nib >> 24u) & vec4<u32>(15u);
    return dm.x * vec4<f32>(q) + vec4<f32>(dm.y);
}

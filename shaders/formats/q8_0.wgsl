// Q8_0: blocks of 32 elements in 34 bytes: f16 scale d, then 32 signed bytes q; x = d * q.
fn w_load1(row: u32, e: u32) -> f32 {
    let blk = row + (e >> 5u) * 34u;
    let d = load_f16_at(blk);
    let byte = load_u32_at(blk + 2u + (e & 31u)) & 0xffu;
    return d * f32(i32(byte << 24u) >> 24u);
}

fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let blk = row + (e >> 5u) * 34u;
    let d = load_f16_at(blk);
    let q = load_u32_at(blk + 2u + (e & 31u));
    let v = vec4<i32>(i32(q << 24u), i32(q << 16u), i32(q << 8u), i32(q)) >> vec4<u32>(24u);
    return d * vec4<f32>(v);
}

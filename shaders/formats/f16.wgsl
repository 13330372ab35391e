// F16 weights: 2 bytes per element; rows of odd length start mid-word.
fn w_load1(row: u32, e: u32) -> f32 {
    return load_f16_at(row + 2u * e);
}

fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let b = row + 2u * e;
    return vec4<f32>(load_f16_at(b), load_f16_at(b + 2u), load_f16_at(b + 4u), load_f16_at(b + 6u));
}

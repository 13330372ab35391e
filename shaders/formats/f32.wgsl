// F32 weights: 4 bytes per element.
fn w_load1(row: u32, e: u32) -> f32 {
    return bitcast<f32>(w[(row >> 2u) + e]);
}

fn w_load4(row: u32, e: u32) -> vec4<f32> {
    let i = (row >> 2u) + e;
    return vec4<f32>(bitcast<f32>(w[i]), bitcast<f32>(w[i + 1u]), bitcast<f32>(w[i + 2u]), bitcast<f32>(w[i + 3u]));
}

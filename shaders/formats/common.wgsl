// Byte-addressed reads from the packed weight array `w` (declared by the kernel). GGUF blocks
// are 18 or 34 bytes for Q4_0 and Q8_0, so loads may straddle 32-bit words.

fn load_u32_at(byte: u32) -> u32 {
    let i = byte >> 2u;
    let sh = (byte & 3u) * 8u;
    if (sh == 0u) {
        return w[i];
    }
    return (w[i] >> sh) | (w[i + 1u] << (32u - sh));
}

fn load_f16_at(byte: u32) -> f32 {
    let word = w[byte >> 2u];
    let bits = select(word & 0xffffu, word >> 16u, (byte & 2u) != 0u);
    return unpack2x16float(bits).x;
}

fn load_u8_at(byte: u32) -> u32 {
    return (w[byte >> 2u] >> ((byte & 3u) * 8u)) & 0xffu;
}

// The four bytes of a word, low byte first.
fn bytes4(word: u32) -> vec4<u32> {
    return vec4<u32>(word, word >> 8u, word >> 16u, word >> 24u) & vec4<u32>(0xffu);
}

// Q4_K's and Q5_K's sub-block s: its 6-bit scale and minimum. s < 4: whole in bytes s and
// s + 4 of the 12 scale bytes; else the nibbles of byte s + 4 with the top bits of bytes s - 4
// and s.
fn scale_min_k4(scales: u32, s: u32) -> vec2<f32> {
    if (s < 4u) {
        return vec2<f32>(f32(load_u8_at(scales + s) & 63u), f32(load_u8_at(scales + s + 4u) & 63u));
    }
    let b = load_u8_at(scales + s + 4u);
    let sc = (b & 15u) | ((load_u8_at(scales + s - 4u) >> 6u) << 4u);
    let m = (b >> 4u) | ((load_u8_at(scales + s) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Q4_0: an f16 scale and 16 bytes of nibbles, 18 bytes (2-byte aligned). Byte j holds
// element j (low nibble) and element j + 16 (high nibble); values are nibble - 8.
#define CHUNK 32

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    const u8* b = row + (c >> 5) * 18;
    const u32 j = c & 31;
    float d = f16_bits_to_f32(*reinterpret_cast<const u16*>(b));
    u32 q = b[2 + (j & 15)];
    int v = j < 16 ? (int)(q & 15) : (int)(q >> 4);
    return d * (float)(v - 8);
}

__device__ __forceinline__ float chunk_dot(const u8* row, u32 ch, const float* x) {
    const u16* b = reinterpret_cast<const u16*>(row + ch * 18);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float d = f16_bits_to_f32(b[0]);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        // Bytes 4i..4i+3: elements 4i..4i+3 (low nibbles) and 4i+16.. (high nibbles).
        u32 q = (u32)b[1 + 2 * i] | ((u32)b[2 + 2 * i] << 16);
        float4 lo = x4[i], hi = x4[4 + i];
        s += ((float)((q >> 0) & 15) - 8.0f) * lo.x + ((float)((q >> 8) & 15) - 8.0f) * lo.y
           + ((float)((q >> 16) & 15) - 8.0f) * lo.z + ((float)((q >> 24) & 15) - 8.0f) * lo.w
           + ((float)((q >> 4) & 15) - 8.0f) * hi.x + ((float)((q >> 12) & 15) - 8.0f) * hi.y
           + ((float)((q >> 20) & 15) - 8.0f) * hi.z + ((float)((q >> 28) & 15) - 8.0f) * hi.w;
    }
    return d * s;
}

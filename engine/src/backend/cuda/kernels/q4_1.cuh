// Q4_1: f16 scale d, f16 minimum m, 16 bytes of nibbles: 20 bytes, so 4-byte aligned.
// Element j is d * nibble + m, nibbles laid out as in Q4_0.
#define CHUNK 32

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    const u8* b = row + (c >> 5) * 20;
    const u32 j = c & 31;
    const u16* h = reinterpret_cast<const u16*>(b);
    float d = f16_bits_to_f32(h[0]), m = f16_bits_to_f32(h[1]);
    u32 q = b[4 + (j & 15)];
    u32 v = j < 16 ? (q & 15) : (q >> 4);
    return d * (float)v + m;
}

__device__ __forceinline__ float chunk_dot(const u8* row, u32 ch, const float* x) {
    const u32* b = reinterpret_cast<const u32*>(row + ch * 20);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    u32 dm = b[0];
    float d = f16_bits_to_f32((u16)(dm & 0xffff)), m = f16_bits_to_f32((u16)(dm >> 16));
    float s = 0.0f, xs = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 q = b[1 + i];
        float4 lo = x4[i], hi = x4[4 + i];
        s += (float)((q >> 0) & 15) * lo.x + (float)((q >> 8) & 15) * lo.y
           + (float)((q >> 16) & 15) * lo.z + (float)((q >> 24) & 15) * lo.w
           + (float)((q >> 4) & 15) * hi.x + (float)((q >> 12) & 15) * hi.y
           + (float)((q >> 20) & 15) * hi.z + (float)((q >> 28) & 15) * hi.w;
        xs += lo.x + lo.y + lo.z + lo.w + hi.x + hi.y + hi.z + hi.w;
    }
    return d * s + m * xs;
}

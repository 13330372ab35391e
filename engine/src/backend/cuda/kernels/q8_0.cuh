// Q8_0: blocks of 32 int8 with an f16 scale, 34 bytes (so only 2-byte aligned).
#define CHUNK 32

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    const u8* b = row + (c >> 5) * 34;
    float d = f16_bits_to_f32(*reinterpret_cast<const u16*>(b));
    return d * (float)(signed char)b[2 + (c & 31)];
}

// `x` points at the block's 32 activations, 16-byte aligned (cols is a multiple of 32).
__device__ __forceinline__ float chunk_dot(const u8* row, u32 ch, const float* x) {
    const u16* b = reinterpret_cast<const u16*>(row + ch * 34);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float d = f16_bits_to_f32(b[0]);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u16 lo = b[1 + 2 * i], hi = b[2 + 2 * i];
        float4 xv = x4[i];
        s += (float)(signed char)(lo & 0xff) * xv.x + (float)(signed char)(lo >> 8) * xv.y
           + (float)(signed char)(hi & 0xff) * xv.z + (float)(signed char)(hi >> 8) * xv.w;
    }
    return d * s;
}

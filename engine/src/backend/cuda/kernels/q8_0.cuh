// Q8_0: blocks of 32 int8 with an f16 scale, 34 bytes (so only 2-byte aligned). A lane step
// is 8 elements (a quarter block, q = s % 4); cols are a multiple of 32, so the activation
// float4 loads are aligned.
#define SUB 8
struct XS { float4 a, c; };

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    const u8* b = row + (c >> 5) * 34;
    float d = f16_bits_to_f32(*reinterpret_cast<const u16*>(b));
    return d * (float)(signed char)b[2 + (c & 31)];
}
__device__ __forceinline__ XS load_x(const float* x, u32 s) {
    const float4* x4 = reinterpret_cast<const float4*>(x + (s >> 2) * 32 + 8 * (s & 3));
    return XS{x4[0], x4[1]};
}
__device__ __forceinline__ float row_dot(const u8* row, u32 s, const XS& x) {
    const u32 blk = s >> 2, q = s & 3;
    const u16* b = reinterpret_cast<const u16*>(row + blk * 34);
    const float d = f16_bits_to_f32(__ldg(b));
    const u16 w0 = __ldg(b + 1 + 4 * q), w1 = __ldg(b + 2 + 4 * q), w2 = __ldg(b + 3 + 4 * q),
              w3 = __ldg(b + 4 + 4 * q);
    return d * ((float)(signed char)(w0 & 0xff) * x.a.x + (float)(signed char)(w0 >> 8) * x.a.y
              + (float)(signed char)(w1 & 0xff) * x.a.z + (float)(signed char)(w1 >> 8) * x.a.w
              + (float)(signed char)(w2 & 0xff) * x.c.x + (float)(signed char)(w2 >> 8) * x.c.y
              + (float)(signed char)(w3 & 0xff) * x.c.z + (float)(signed char)(w3 >> 8) * x.c.w);
}

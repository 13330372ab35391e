// The lane step of the formats that define one element of a block (`kelem(block, i)`,
// BLOCK_LEN, BLOCK_BYTES): 8 consecutive elements, which always share one (sub-)block scale
// since sub-blocks are 16 or 32 long. Activations stay in f32. The format header and
// welem.cuh come first, this file after them.
#define SUB 8
struct XS { float4 a, c; };

__device__ __forceinline__ XS load_x(const float* x, u32 s) {
    const float4* x4 = reinterpret_cast<const float4*>(x + 8 * s);
    return XS{x4[0], x4[1]};
}
__device__ __forceinline__ float row_dot(const u8* row, u32 s, const XS& x) {
    const u32 e = 8 * s;
    const u8* b = row + (e / BLOCK_LEN) * BLOCK_BYTES;
    const u32 i = e % BLOCK_LEN;
    return kelem(b, i) * x.a.x + kelem(b, i + 1) * x.a.y + kelem(b, i + 2) * x.a.z
         + kelem(b, i + 3) * x.a.w + kelem(b, i + 4) * x.c.x + kelem(b, i + 5) * x.c.y
         + kelem(b, i + 6) * x.c.z + kelem(b, i + 7) * x.c.w;
}

// Q5_1: 24-byte blocks of 32: f16 d, f16 m, then fifth bits and nibbles as in Q5_0;
// x = d q + m.
#define BLOCK_LEN 32
#define BLOCK_BYTES 24
__device__ __forceinline__ float kelem(const u8* b, u32 j) {
    const u32 low = (b[8 + (j & 15)] >> (j & 16 ? 4 : 0)) & 15;
    const u32 q = low | (((ld_u32(b + 4) >> j) & 1) << 4);
    return (float)q * ld_f16(b) + ld_f16(b + 2);
}

// Q5_0: 22-byte blocks of 32: f16 d, u32 of fifth bits (bit j for element j), 16 bytes whose
// low nibbles are elements 0..15 and high nibbles 16..31; x = d (q - 16).
#define BLOCK_LEN 32
#define BLOCK_BYTES 22
__device__ __forceinline__ float kelem(const u8* b, u32 j) {
    const u32 low = (b[6 + (j & 15)] >> (j & 16 ? 4 : 0)) & 15;
    const u32 q = low | (((ld_u32(b + 2) >> j) & 1) << 4);
    return (float)((int)q - 16) * ld_f16(b);
}

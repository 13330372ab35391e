// Q3_K: 110-byte super-blocks of 256 (hmask[32], qs[64], scales[12], f16 d). Element
// 128h + 32j + l: low bits 2j of qs[32h + l], third bit 4h + j of hmask[l] (clear means -4);
// sixteen 6-bit scales biased by 32: low nibbles in bytes 0..8, high pairs in bytes 8..12.
#define BLOCK_LEN 256
#define BLOCK_BYTES 110
__device__ __forceinline__ float kelem(const u8* b, u32 i) {
    const u32 h = i >> 7, j = (i >> 5) & 3, l = i & 31, is = i >> 4;
    const u32 lo = (b[96 + (is & 7)] >> (4 * (is >> 3))) & 15;
    const u32 hi = (b[104 + (is & 3)] >> (2 * (is >> 2))) & 3;
    const int sc = (int)(lo | (hi << 4)) - 32;
    int q = (int)((b[32 + 32 * h + l] >> (2 * j)) & 3);
    if (!((b[l] >> (4 * h + j)) & 1)) q -= 4;
    return ld_f16(b + 108) * (float)sc * (float)q;
}

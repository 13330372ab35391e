// Q6_K: 210-byte super-blocks of 256 (ql[128], qh[64], int8 scales[16], f16 d), so only
// 2-byte aligned: every load is bytewise. Element 128n + 32k + l: low nibble k / 2 of
// ql[64n + 32 (k % 2) + l], high bits 2k of qh[32n + l]; x = d sc (q - 32).
#define BLOCK_LEN 256
#define BLOCK_BYTES 210
__device__ __forceinline__ float kelem(const u8* b, u32 i) {
    const u32 n = i >> 7, k = (i >> 5) & 3, l = i & 31;
    const u32 lo = (b[64 * n + 32 * (k & 1) + l] >> (4 * (k >> 1))) & 15;
    const u32 hi = (b[128 + 32 * n + l] >> (2 * k)) & 3;
    const int q = (int)(lo | (hi << 4)) - 32;
    return ld_f16(b + 208) * (float)(signed char)b[192 + (i >> 4)] * (float)q;
}

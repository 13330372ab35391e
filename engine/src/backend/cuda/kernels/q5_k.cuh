// Q5_K: 176-byte super-blocks of 256 (f16 d, f16 dmin, scales[12], qh[32], qs[128]): Q4_K's
// layout plus a fifth bit, bit 2c + h of qh[l] for element 64c + 32h + l; x = d sc q - dmin m.
#define BLOCK_LEN 256
#define BLOCK_BYTES 176
__device__ __forceinline__ float kelem(const u8* b, u32 i) {
    const u32 sub = i >> 5, c = sub >> 1, h = sub & 1, l = i & 31;
    u32 sc, m;
    kscale_min(b + 4, sub, sc, m);
    const u32 q = ((b[48 + 32 * c + l] >> (4 * h)) & 15) | (((b[16 + l] >> (2 * c + h)) & 1) << 4);
    return ld_f16(b) * (float)sc * (float)q - ld_f16(b + 2) * (float)m;
}

// Q4_K: 144-byte super-blocks of 256 (f16 d, f16 dmin, scales[12], qs[128]). Element
// 64c + 32h + l is nibble h of qs[32c + l]; sub-block i / 32 has a 6-bit scale and minimum
// (kscale_min, packed as in ggml); x = d sc q - dmin m.
#define BLOCK_LEN 256
#define BLOCK_BYTES 144
__device__ __forceinline__ float kelem(const u8* b, u32 i) {
    const u32 sub = i >> 5, c = sub >> 1, h = sub & 1, l = i & 31;
    u32 sc, m;
    kscale_min(b + 4, sub, sc, m);
    const u32 q = (b[16 + 32 * c + l] >> (4 * h)) & 15;
    return ld_f16(b) * (float)sc * (float)q - ld_f16(b + 2) * (float)m;
}

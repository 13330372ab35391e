// Q2_K: 84-byte super-blocks of 256 (scales[16], qs[64], f16 d, f16 dmin; engine/src/quant/
// kquants.rs has the layout). Element 128h + 32j + l: bits 2j of qs[32h + l]; its sub-block
// i / 16 has a 4-bit scale (low nibble) and minimum; x = d sc q - dmin m.
#define BLOCK_LEN 256
#define BLOCK_BYTES 84
__device__ __forceinline__ float kelem(const u8* b, u32 i) {
    const u32 h = i >> 7, j = (i >> 5) & 3, l = i & 31;
    const u32 q = (b[16 + 32 * h + l] >> (2 * j)) & 3;
    const u32 sc = b[i >> 4];
    return ld_f16(b + 80) * (float)(sc & 15) * (float)q - ld_f16(b + 82) * (float)(sc >> 4);
}

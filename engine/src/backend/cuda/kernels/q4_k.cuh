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

// The lane step: the 4-byte word 4q..4q+3 of quarter c of super-block s / 32's nibbles
// (c = s / 8 % 4, q = s % 8): low nibbles are elements 64c+4q..64c+4q+3 of sub-block 2c,
// high nibbles the same 32 later, of sub-block 2c+1. The 144-byte super-blocks keep u32
// alignment, so the word is one load.
#define SUB 8
struct XS { float4 lo, hi; float slo, shi; };
__device__ __forceinline__ XS load_x(const float* x, u32 s) {
    const float* xb = x + (s >> 3) * 64 + 4 * (s & 7);
    XS r;
    r.lo = *reinterpret_cast<const float4*>(xb);
    r.hi = *reinterpret_cast<const float4*>(xb + 32);
    r.slo = (r.lo.x + r.lo.y) + (r.lo.z + r.lo.w);
    r.shi = (r.hi.x + r.hi.y) + (r.hi.z + r.hi.w);
    return r;
}
// sum (1 + n / 16) x over the low and the high nibbles of `w` separately (NIBF in common).
__device__ __forceinline__ float nib_lo(u32 w, float4 v) {
    return NIBF(w << 19) * v.x + NIBF(w << 11) * v.y + NIBF(w << 3) * v.z + NIBF(w >> 5) * v.w;
}
__device__ __forceinline__ float nib_hi(u32 w, float4 v) {
    return NIBF(w << 15) * v.x + NIBF(w << 7) * v.y + NIBF(w >> 1) * v.z + NIBF(w >> 9) * v.w;
}
__device__ __forceinline__ float row_dot(const u8* row, u32 s, const XS& x) {
    const u32 sb = s >> 5, c = (s >> 3) & 3, q = s & 7;
    const u8* b = row + sb * BLOCK_BYTES;
    const u32* b4 = reinterpret_cast<const u32*>(b);
    const u32 dm = __ldg(b4), w = __ldg(b4 + 4 + 8 * c + q);
    const float d = f16_bits_to_f32((u16)(dm & 0xffff)), dmin = f16_bits_to_f32((u16)(dm >> 16));
    u32 sc0, m0, sc1, m1;
    kscale_min(b + 4, 2 * c, sc0, m0);
    kscale_min(b + 4, 2 * c + 1, sc1, m1);
    // sum n x = 16 (nib - sum x) per half; value = d sc n - dmin m
    const float nlo = 16.0f * (nib_lo(w, x.lo) - x.slo), nhi = 16.0f * (nib_hi(w, x.hi) - x.shi);
    return d * ((float)sc0 * nlo + (float)sc1 * nhi) - dmin * ((float)m0 * x.slo + (float)m1 * x.shi);
}

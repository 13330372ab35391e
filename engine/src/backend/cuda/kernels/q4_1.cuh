// Q4_1: f16 scale d, f16 minimum m, 16 bytes of nibbles: 20 bytes, so 4-byte aligned.
// Element j is d * nibble + m, nibbles laid out as in Q4_0, and a lane step covers the same
// quarter block (elements 4q..4q+3 and 4q+16..4q+19).
#define SUB 8
typedef XQ4 XS;

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    const u8* b = row + (c >> 5) * 20;
    const u32 j = c & 31;
    const u16* h = reinterpret_cast<const u16*>(b);
    float d = f16_bits_to_f32(h[0]), m = f16_bits_to_f32(h[1]);
    u32 q = b[4 + (j & 15)];
    u32 v = j < 16 ? (q & 15) : (q >> 4);
    return d * (float)v + m;
}
__device__ __forceinline__ XS load_x(const float* x, u32 s) { return load_x_q4(x, s); }
// Elements c..c+7 (c a multiple of 8) as four f16 pairs for the tensor-core prefill: the
// words (stage8_load, a step ahead), then one rounding of d n + m per weight and no
// int-to-float conversions (stage8_make).
#define HAVE_STAGE8_SPLIT
struct W8 { u32 dm, w0, w1; };
__device__ __forceinline__ W8 stage8_load(const u8* row, u32 c) {
    const u32* b = reinterpret_cast<const u32*>(row + (c >> 5) * 20);
    const u32 w = 1 + ((c & 15) >> 2);
    return W8{__ldg(b), __ldg(b + w), __ldg(b + w + 1)};
}
__device__ __forceinline__ uint4 stage8_make(const W8& r, u32 c) {
    const u32 d2 = (r.dm & 0xffffu) * 0x10001u, m2 = (r.dm >> 16) * 0x10001u;
    const u32 sh = (c & 31) >= 16 ? 4 : 0;
    const u32 x0 = (r.w0 >> sh) & 0x0f0f0f0fu, x1 = (r.w1 >> sh) & 0x0f0f0f0fu;
    return make_uint4(f16x2_fma(f16x2_sub(nib_pair_1024(x0, 0), F16X2_1024), d2, m2),
                      f16x2_fma(f16x2_sub(nib_pair_1024(x0, 1), F16X2_1024), d2, m2),
                      f16x2_fma(f16x2_sub(nib_pair_1024(x1, 0), F16X2_1024), d2, m2),
                      f16x2_fma(f16x2_sub(nib_pair_1024(x1, 1), F16X2_1024), d2, m2));
}
__device__ __forceinline__ float row_dot(const u8* row, u32 s, const XS& x) {
    const u32 blk = s >> 2, q = s & 3;
    const u32* b = reinterpret_cast<const u32*>(row + blk * 20);
    const u32 dm = __ldg(b), w = __ldg(b + 1 + q);
    const float d = f16_bits_to_f32((u16)(dm & 0xffff)), m = f16_bits_to_f32((u16)(dm >> 16));
    // sum n x = 16 (sv - sum x); value = d sum n x + m sum x
    return d * 16.0f * (nib_dot(w, x.lo, x.hi) - x.sum) + m * x.sum;
}
#ifndef CAIRN_F32_ACTIVATIONS
// The split kernels' step: int8 activations (load_x_q8 in common), dp4a.
#define SPLIT_XS XQ8
#define split_load_x load_x_q8
#define SPLIT_Q8  // the several-token split kernel may take them rounded once (to_q8)
// A row's step read once (split_w_load) and dotted with each token's (split_w_dot).
#define HAVE_SPLIT_W
struct SplitW { float d, m; int lo, hi; };
__device__ __forceinline__ SplitW split_w_load(const u8* row, u32 s) {
    const u32 blk = s >> 2, q = s & 3;
    const u32* b = reinterpret_cast<const u32*>(row + blk * 20);
    const u32 dm = __ldg(b), w = __ldg(b + 1 + q);
    return SplitW{f16_bits_to_f32((u16)(dm & 0xffff)), f16_bits_to_f32((u16)(dm >> 16)),
                  (int)(w & 0x0f0f0f0fu), (int)((w >> 4) & 0x0f0f0f0fu)};
}
__device__ __forceinline__ float split_w_dot(const SplitW& w, const XQ8& x) {
    return w.d * x.d * (float)dp4a(w.lo, x.lo, dp4a(w.hi, x.hi, 0)) + w.m * x.sum;
}
__device__ __forceinline__ float split_row_dot(const u8* row, u32 s, const XQ8& x) {
    return split_w_dot(split_w_load(row, s), x);
}
#endif

// Q4_0: an f16 scale and 16 bytes of nibbles, 18 bytes (2-byte aligned). Byte j holds
// element j (low nibble) and element j + 16 (high nibble); values are nibble - 8.
// A lane step covers bytes 4q..4q+3 of a block (q = s % 4): elements 4q..4q+3 and
// 4q+16..4q+19.
#define SUB 8
typedef XQ4 XS;

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    const u8* b = row + (c >> 5) * 18;
    const u32 j = c & 31;
    float d = f16_bits_to_f32(*reinterpret_cast<const u16*>(b));
    u32 q = b[2 + (j & 15)];
    int v = j < 16 ? (int)(q & 15) : (int)(q >> 4);
    return d * (float)(v - 8);
}
__device__ __forceinline__ XS load_x(const float* x, u32 s) { return load_x_q4(x, s); }
// Elements c..c+7 (c a multiple of 8) as four f16 pairs for the tensor-core prefill: the
// words (stage8_load, a step ahead; blocks are only 2-byte aligned, so halfwords), then
// d (n - 8) with n - 8 exact in f16, one rounding, no int-to-float conversions (stage8_make).
#define HAVE_STAGE8_SPLIT
struct W8 { u32 d, w0, w1; };
__device__ __forceinline__ W8 stage8_load(const u8* row, u32 c) {
    const u16* b = reinterpret_cast<const u16*>(row + (c >> 5) * 18);
    const u32 h = 1 + ((c & 15) >> 1);
    return W8{(u32)__ldg(b), (u32)__ldg(b + h) | ((u32)__ldg(b + h + 1) << 16),
              (u32)__ldg(b + h + 2) | ((u32)__ldg(b + h + 3) << 16)};
}
__device__ __forceinline__ uint4 stage8_make(const W8& r, u32 c) {
    const u32 d2 = r.d * 0x10001u, sh = (c & 31) >= 16 ? 4 : 0;
    const u32 x0 = (r.w0 >> sh) & 0x0f0f0f0fu, x1 = (r.w1 >> sh) & 0x0f0f0f0fu;
    const u32 k = 0x64086408u;  // the pair (1032, 1032): 1024 + n - 1032 = n - 8
    return make_uint4(f16x2_mul(f16x2_sub(nib_pair_1024(x0, 0), k), d2),
                      f16x2_mul(f16x2_sub(nib_pair_1024(x0, 1), k), d2),
                      f16x2_mul(f16x2_sub(nib_pair_1024(x1, 0), k), d2),
                      f16x2_mul(f16x2_sub(nib_pair_1024(x1, 1), k), d2));
}
__device__ __forceinline__ float row_dot(const u8* row, u32 s, const XS& x) {
    const u32 blk = s >> 2, q = s & 3;
    const u16* b = reinterpret_cast<const u16*>(row + blk * 18);
    const float d = f16_bits_to_f32(__ldg(b));
    const u32 w = (u32)__ldg(b + 1 + 2 * q) | ((u32)__ldg(b + 2 + 2 * q) << 16);
    // sum n x = 16 (sv - sum x); value = d (sum n x - 8 sum x)
    return d * (16.0f * nib_dot(w, x.lo, x.hi) - 24.0f * x.sum);
}
#ifndef CAIRN_F32_ACTIVATIONS
// The split kernels' step: int8 activations (load_x_q8 in common), dp4a.
#define SPLIT_XS XQ8
#define split_load_x load_x_q8
#define SPLIT_Q8  // the several-token split kernel may take them rounded once (to_q8)
// A row's step read once (split_w_load) and dotted with each token's (split_w_dot).
#define HAVE_SPLIT_W
struct SplitW { float d; int lo, hi; };
__device__ __forceinline__ SplitW split_w_load(const u8* row, u32 s) {
    const u32 blk = s >> 2, q = s & 3;
    const u16* b = reinterpret_cast<const u16*>(row + blk * 18);
    const u32 w = (u32)__ldg(b + 1 + 2 * q) | ((u32)__ldg(b + 2 + 2 * q) << 16);
    return SplitW{f16_bits_to_f32(__ldg(b)), (int)(w & 0x0f0f0f0fu), (int)((w >> 4) & 0x0f0f0f0fu)};
}
__device__ __forceinline__ float split_w_dot(const SplitW& w, const XQ8& x) {
    return w.d * (x.d * (float)dp4a(w.lo, x.lo, dp4a(w.hi, x.hi, 0)) - 8.0f * x.sum);
}
__device__ __forceinline__ float split_row_dot(const u8* row, u32 s, const XQ8& x) {
    return split_w_dot(split_w_load(row, s), x);
}
#endif

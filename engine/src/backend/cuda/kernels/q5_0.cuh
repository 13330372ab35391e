// Q5_0: 22-byte blocks of 32: f16 d, u32 of fifth bits (bit j for element j), 16 bytes whose
// low nibbles are elements 0..15 and high nibbles 16..31; x = d (q - 16).
#define BLOCK_LEN 32
#define BLOCK_BYTES 22
__device__ __forceinline__ float kelem(const u8* b, u32 j) {
    const u32 low = (b[6 + (j & 15)] >> (j & 16 ? 4 : 0)) & 15;
    const u32 q = low | (((ld_u32(b + 2) >> j) & 1) << 4);
    return (float)((int)q - 16) * ld_f16(b);
}

// The lane step: bytes 4q..4q+3 of block s / 4's nibbles (q = s % 4), elements 4q..4q+3
// (low nibbles) and 4q+16..4q+19 (high), as in Q4_0, with their fifth bits. The 22-byte
// blocks are 2-byte aligned, so words are read as u16 pairs.
#define SUB 8
typedef XQ4 XS;
__device__ __forceinline__ XS load_x(const float* x, u32 s) { return load_x_q4(x, s); }
__device__ __forceinline__ u32 ld2_u16(const u16* p) {
    return (u32)__ldg(p) | ((u32)__ldg(p + 1) << 16);
}
__device__ __forceinline__ float bit_f(u32 h, u32 i, float x) { return (h >> i) & 1 ? x : 0.0f; }
// value = d (n + 16 h - 16): sum n x through nib_dot (see common), the fifth bits by selects.
__device__ __forceinline__ float row_dot(const u8* row, u32 s, const XS& x) {
    const u32 blk = s >> 2, q = s & 3;
    const u16* b = reinterpret_cast<const u16*>(row + blk * BLOCK_BYTES);
    const float d = f16_bits_to_f32(__ldg(b));
    const u32 h = ld2_u16(b + 1) >> (4 * q), w = ld2_u16(b + 3 + 2 * q);
    const float hx = (bit_f(h, 0, x.lo.x) + bit_f(h, 1, x.lo.y)) + (bit_f(h, 2, x.lo.z) + bit_f(h, 3, x.lo.w))
                   + (bit_f(h, 16, x.hi.x) + bit_f(h, 17, x.hi.y)) + (bit_f(h, 18, x.hi.z) + bit_f(h, 19, x.hi.w));
    // sum n x = 16 (nib_dot - sum x)
    return d * (16.0f * (nib_dot(w, x.lo, x.hi) - x.sum) + 16.0f * hx - 16.0f * x.sum);
}
#ifndef CAIRN_F32_ACTIVATIONS
// The split kernels' step: the five-bit values as signed bytes against int8 activations.
#define SPLIT_XS XQ8
#define split_load_x load_x_q8
#define SPLIT_Q8  // the several-token split kernel may take them rounded once (to_q8)
// Bits 0..3 of `h` to bit 0 of bytes 0..3 (the shifted copies do not overlap, so no carries).
__device__ __forceinline__ u32 spread4(u32 h) { return ((h & 15) * 0x00204081u) & 0x01010101u; }
// A row's step read once (split_w_load) and dotted with each token's (split_w_dot).
#define HAVE_SPLIT_W
struct SplitW { float d; int lo, hi; };
__device__ __forceinline__ SplitW split_w_load(const u8* row, u32 s) {
    const u32 blk = s >> 2, q = s & 3;
    const u16* b = reinterpret_cast<const u16*>(row + blk * BLOCK_BYTES);
    const u32 h = ld2_u16(b + 1) >> (4 * q), w = ld2_u16(b + 3 + 2 * q);
    const u32 lo = __vsub4((w & 0x0f0f0f0fu) | (spread4(h) << 4), 0x10101010u);
    const u32 hi = __vsub4(((w >> 4) & 0x0f0f0f0fu) | (spread4(h >> 16) << 4), 0x10101010u);
    return SplitW{f16_bits_to_f32(__ldg(b)), (int)lo, (int)hi};
}
__device__ __forceinline__ float split_w_dot(const SplitW& w, const XQ8& x) {
    return w.d * x.d * (float)dp4a(w.lo, x.lo, dp4a(w.hi, x.hi, 0));
}
__device__ __forceinline__ float split_row_dot(const u8* row, u32 s, const XQ8& x) {
    return split_w_dot(split_w_load(row, s), x);
}
#endif

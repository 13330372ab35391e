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

// The lane step: in half n of super-block s / 32 (n = s / 16 % 2), with a = s / 8 % 2 and
// q = s % 8, the bytes ql[64n + 32a + 4q ..+3] and qh[32n + 4q ..+3]: their low nibbles and
// bits 2a..2a+1 are elements 128n + 32a + 4q ..+3, their high nibbles and bits 2a+4..2a+5 the
// same 64 later (scales 8n + 2a + q / 4 and 4 after it). Blocks are only 2-byte aligned: u16
// loads.
#define SUB 8
struct XS { float4 lo, hi; float slo, shi; };
__device__ __forceinline__ XS load_x(const float* x, u32 s) {
    const float* xb = x + (s >> 4) * 128 + ((s >> 3) & 1) * 32 + 4 * (s & 7);
    XS r;
    r.lo = *reinterpret_cast<const float4*>(xb);
    r.hi = *reinterpret_cast<const float4*>(xb + 64);
    r.slo = (r.lo.x + r.lo.y) + (r.lo.z + r.lo.w);
    r.shi = (r.hi.x + r.hi.y) + (r.hi.z + r.hi.w);
    return r;
}
// A byte (0..255) as a float without an int-to-float conversion: 2^23 + v, minus 2^23.
__device__ __forceinline__ float byte_f(u32 v) { return __uint_as_float(0x4B000000u | (v & 0xff)) - 8388608.0f; }
__device__ __forceinline__ float dot4(u32 v, float4 x) {
    return byte_f(v) * x.x + byte_f(v >> 8) * x.y + byte_f(v >> 16) * x.z + byte_f(v >> 24) * x.w;
}
__device__ __forceinline__ float row_dot(const u8* row, u32 s, const XS& x) {
    const u32 sb = s >> 5, n = (s >> 4) & 1, a = (s >> 3) & 1, q = s & 7;
    const u8* b = row + sb * BLOCK_BYTES;
    const u16* l16 = reinterpret_cast<const u16*>(b + 64 * n + 32 * a + 4 * q);
    const u16* h16 = reinterpret_cast<const u16*>(b + 128 + 32 * n + 4 * q);
    const u32 ql = (u32)__ldg(l16) | ((u32)__ldg(l16 + 1) << 16);
    const u32 qh = ((u32)__ldg(h16) | ((u32)__ldg(h16 + 1) << 16)) >> (2 * a);
    const u32 vlo = (ql & 0x0f0f0f0fu) | ((qh & 0x03030303u) << 4);
    const u32 vhi = ((ql >> 4) & 0x0f0f0f0fu) | (((qh >> 4) & 0x03030303u) << 4);
    const u32 si = 8 * n + 2 * a + (q >> 2);
    const float sc0 = (float)(signed char)b[192 + si], sc1 = (float)(signed char)b[192 + si + 4];
    const float d = f16_bits_to_f32(__ldg(reinterpret_cast<const u16*>(b + 208)));
    // value = d sc (v - 32)
    return d * (sc0 * (dot4(vlo, x.lo) - 32.0f * x.slo) + sc1 * (dot4(vhi, x.hi) - 32.0f * x.shi));
}

// Byte-wise loads for the formats whose blocks are only 2-byte aligned or whose fields sit at
// odd offsets (Q5_0, Q5_1 and the K-quants; Q6_K's blocks are 210 bytes).
__device__ __forceinline__ float ld_f16(const u8* p) {
    return f16_bits_to_f32((u16)(p[0] | ((u32)p[1] << 8)));
}
__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
// Q4_K's and Q5_K's sub-block j: its 6-bit scale and minimum from the 12 packed scale bytes.
__device__ __forceinline__ void kscale_min(const u8* s, u32 j, u32& sc, u32& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

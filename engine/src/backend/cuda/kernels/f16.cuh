// F16 weights: one element per chunk; rows are 2-byte aligned (row_bytes = 2 * cols).
#define CHUNK 1

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    return f16_bits_to_f32(reinterpret_cast<const u16*>(row)[c]);
}

__device__ __forceinline__ float chunk_dot(const u8* row, u32 ch, const float* x) {
    return f16_bits_to_f32(reinterpret_cast<const u16*>(row)[ch]) * x[0];
}

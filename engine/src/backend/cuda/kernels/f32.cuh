// F32 weights: one element per chunk (rows need not be a multiple of 32 columns).
#define CHUNK 1

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    return reinterpret_cast<const float*>(row)[c];
}

__device__ __forceinline__ float chunk_dot(const u8* row, u32 ch, const float* x) {
    return reinterpret_cast<const float*>(row)[ch] * x[0];
}

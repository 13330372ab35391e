// F32 weights. A lane step is one element (rows need not be a multiple of 32 columns).
#define SUB 1
struct XS { float v; };

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    return reinterpret_cast<const float*>(row)[c];
}
__device__ __forceinline__ XS load_x(const float* x, u32 s) { return XS{x[s]}; }
__device__ __forceinline__ float row_dot(const u8* row, u32 s, const XS& x) {
    return __ldg(reinterpret_cast<const float*>(row) + s) * x.v;
}

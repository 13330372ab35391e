// F16 weights: one element per lane step; rows are 2-byte aligned (row_bytes = 2 * cols).
#define SUB 1
struct XS { float v; };

__device__ __forceinline__ float w_elem(const u8* row, u32 c) {
    return f16_bits_to_f32(reinterpret_cast<const u16*>(row)[c]);
}
__device__ __forceinline__ XS load_x(const float* x, u32 s) { return XS{x[s]}; }
__device__ __forceinline__ float row_dot(const u8* row, u32 s, const XS& x) {
    return f16_bits_to_f32(__ldg(reinterpret_cast<const u16*>(row) + s)) * x.v;
}

// Shared by every Cairn CUDA module (compiled at run time by NVRTC, so no system headers).
//
// Kernel ABI: the first argument points at this launch's 16 parameter words in the device's
// parameter arena, which a kernel reads as its parameter struct below (an op's, or the fused
// kernels' FusedLinearParams); buffers follow as raw pointers. Parameters live in device memory
// rather than in kernel arguments so that a captured CUDA graph can be replayed with new
// positions (decode steps) by rewriting the arena alone.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;

// Each op's parameters, member for member the `#[repr(C)]` struct the Rust side writes
// (engine/src/kernels/*.rs, `params!`; a test there compares the two).
struct MatMulParams { u32 m; u32 n; u32 k; u32 _pad; };
struct LinearParams { u32 rows; u32 cols; u32 tokens; u32 row_bytes; };
struct EmbedParams { u32 dim; u32 vocab; u32 tokens; u32 row_bytes; };
struct RmsNormParams { u32 dim; u32 tokens; float eps; u32 _pad; };
struct RopeParams {
    u32 heads; u32 head_dim; u32 rope_dim; u32 tokens; u32 pos0; float freq_base; u32 neox;
    u32 flags;
};
struct SoftmaxParams { u32 rows; u32 cols; u32 _pad0; u32 _pad1; };
struct CountParams { u32 n; u32 _pad0; u32 _pad1; u32 _pad2; };
struct BiasParams { u32 cols; u32 tokens; u32 _pad0; u32 _pad1; };
struct ScaleCapParams { u32 n; float scale; float cap; u32 _pad; };
struct AttentionParams {
    u32 heads; u32 kv_heads; u32 head_dim; u32 tokens; u32 pos0; float scale; u32 splits;
    u32 window; float softcap; u32 _pad0; u32 _pad1; u32 _pad2;
};
struct KvStoreParams { u32 kv_dim; u32 tokens; u32 pool_slots; u32 _pad; };
struct PagedAttentionParams {
    u32 heads; u32 kv_heads; u32 head_dim; u32 tokens; u32 block; u32 pool_blocks; u32 table_len;
    float scale; u32 window; float softcap; u32 _pad0; u32 _pad1;
};
struct SampleKernelParams {
    u32 n; float temperature; u32 top_k; float top_p; u32 seed_lo; u32 seed_hi; u32 step;
    u32 _pad;
};
struct CopyParams { u32 src_lo; u32 src_hi; u32 dst_lo; u32 dst_hi; u32 n_lo; u32 n_hi; };
// A tensor-parallel peer sum's (ops.cu `peer_sum`), as backend/cuda/launch.rs writes it.
struct PeerSumParams { u32 n; u32 index; u32 devices; u32 epoch; u32 first; };
// The fused matrix-vector kernels' (linear.cu), as backend/cuda/fuse.rs writes them.
struct FusedLinearParams {
    u32 rows0; u32 cols; u32 tokens; u32 row_bytes; u32 rows1; u32 rows2; u32 flags; float eps;
    u32 pos0; float freq_base; u32 head_dim; u32 rope_dim; u32 cache0; u32 cache1; u32 cache2;
    u32 _pad;
};

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// f16 bits to f32 without cuda_fp16.h (not every NVRTC ships it as a built-in header).
__device__ __forceinline__ float f16_bits_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ u32 warp_sum_u32(u32 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `sh` holds 32 floats. The leading barrier lets callers reuse `sh` back to back.
__device__ float block_sum(float v, float* sh) {
    v = warp_sum(v);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? sh[lane] : 0.0f;
    return warp_sum(v);
}

__device__ u32 block_sum_u32(u32 v, u32* sh) {
    v = warp_sum_u32(v);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? sh[lane] : 0u;
    return warp_sum_u32(v);
}

__device__ float block_max(float v, float* sh) {
    v = warp_max(v);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? sh[lane] : NEG_INF;
    return warp_max(v);
}

// (value, index) pairs: the larger value wins, the smaller index on ties; index 0xffffffff
// means "nothing yet" and always loses.
__device__ __forceinline__ void arg_take(float& v, u32& i, float v2, u32 i2) {
    if (i2 == 0xffffffffu) return;
    if (i == 0xffffffffu || v2 > v || (v2 == v && i2 < i)) {
        v = v2;
        i = i2;
    }
}

__device__ void block_argmax(float& v, u32& i, float* shv, u32* shi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(FULL_MASK, v, o);
        u32 i2 = __shfl_xor_sync(FULL_MASK, i, o);
        arg_take(v, i, v2, i2);
    }
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        shv[warp] = v;
        shi[warp] = i;
    }
    __syncthreads();
    v = NEG_INF;
    i = 0xffffffffu;
    if (lane < (blockDim.x >> 5)) {
        v = shv[lane];
        i = shi[lane];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float v2 = __shfl_xor_sync(FULL_MASK, v, o);
        u32 i2 = __shfl_xor_sync(FULL_MASK, i, o);
        arg_take(v, i, v2, i2);
    }
}

// The activations of one lane step of a 4-bit format: elements 4q..4q+3 and 4q+16..4q+19 of
// block s/4 (q = s % 4), which the nibbles of bytes 4q..4q+3 multiply, and their sum.
struct XQ4 { float4 lo, hi; float sum; };
__device__ __forceinline__ XQ4 load_x_q4(const float* x, u32 s) {
    const float* xb = x + (s >> 2) * 32 + 4 * (s & 3);
    XQ4 r;
    r.lo = *reinterpret_cast<const float4*>(xb);
    r.hi = *reinterpret_cast<const float4*>(xb + 16);
    r.sum = (r.lo.x + r.lo.y) + (r.lo.z + r.lo.w) + (r.hi.x + r.hi.y) + (r.hi.z + r.hi.w);
    return r;
}

// sum_j (1 + n_j / 16) x_j over the 8 nibbles of `w` (bytes' low nibbles against lo, high
// nibbles against hi): each nibble is put into the top mantissa bits of 1.0f by a shift and
// one AND-OR, so no int-to-float conversion runs. Callers take sum n_j x_j as
// 16 (result - sum x_j); the values are in [1, 2), so that difference cancels no more than
// four bits.
#define NIBF(v) __uint_as_float(0x3F800000u | ((v) & 0x00780000u))
__device__ __forceinline__ float nib_dot(u32 w, float4 lo, float4 hi) {
    return NIBF(w << 19) * lo.x + NIBF(w << 11) * lo.y + NIBF(w << 3) * lo.z + NIBF(w >> 5) * lo.w
         + NIBF(w << 15) * hi.x + NIBF(w << 7) * hi.y + NIBF(w >> 1) * hi.z + NIBF(w >> 9) * hi.w;
}

// The same lane step with the activations rounded to int8 against the step's largest magnitude
// (d = amax / 127), for dp4a against the nibbles: the 4-bit formats' step in the split
// matrix-vector kernels (linear.cu; CAIRN_F32_ACTIVATIONS keeps XQ4 there too). Two dp4a per
// row and step replace eight FMAs and eight nibble extractions, which is what held those
// kernels at 1.6 TB/s on an H100 (2.35 with this). `sum` is the unrounded sum, for the
// formats' offset terms.
struct XQ8 { int lo, hi; float d, sum; };
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
__device__ __forceinline__ int q8x4(float4 v, float id) {
    return (__float2int_rn(v.x * id) & 0xff) | ((__float2int_rn(v.y * id) & 0xff) << 8)
         | ((__float2int_rn(v.z * id) & 0xff) << 16) | (__float2int_rn(v.w * id) << 24);
}
__device__ __forceinline__ float amax4(float4 v) {
    return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
}
__device__ __forceinline__ XQ8 load_x_q8(const float* x, u32 s) {
    const XQ4 f = load_x_q4(x, s);
    const float amax = fmaxf(amax4(f.lo), amax4(f.hi));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    XQ8 r;
    r.lo = q8x4(f.lo, id);
    r.hi = q8x4(f.hi, id);
    r.d = amax * (1.0f / 127.0f);
    r.sum = f.sum;
    return r;
}

// Packed f16x2 arithmetic on raw words (no cuda_fp16.h under NVRTC): the tensor-core prefill's
// weight staging (stage8 in the 4-bit format headers).
__device__ __forceinline__ u32 f16x2_sub(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ u32 f16x2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
__device__ __forceinline__ u32 f16x2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
// Bytes 2i and 2i + 1 of `nibs` (each 0..15) as the f16 pair (1024 + n): 0x64 above each byte
// makes an f16 whose last mantissa bit counts ones, so no int-to-float conversion is needed.
__device__ __forceinline__ u32 nib_pair_1024(u32 nibs, u32 i) {
    return __byte_perm(nibs, 0x64646464u, i ? 0x4342u : 0x4140u);
}
#define F16X2_1024 0x64006400u

#if __CUDA_ARCH__ >= 800
// Two f32 as one f16x2 word, `lo` in the low half (the lower column).
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c += a b for one 16x8 tile over 16 columns on tensor cores: a 16x16 (row-major fragment),
// b 16x8 (column-major), f16 inputs, f32 sums. Fragment element owners, with g = lane / 4 and
// q = lane % 4: a[0] holds row g, columns 2q and 2q + 1; a[1] row g + 8; a[2] and a[3] the
// same 8 columns on; b[0] rows 2q, 2q + 1 of column g, b[1] 8 rows on; c[0], c[1] row g,
// columns 2q, 2q + 1; c[2], c[3] row g + 8.
__device__ __forceinline__ void mma_16x8x16(float* c, const u32* a, const u32* b) {
    // Not volatile: its outputs order it, and the compiler may interleave it with the next
    // fragment loads.
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Four 8x8 f16 matrices from shared memory in one instruction: lane l gives the address of
// row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned), and r[m] receives matrix m's
// fragment (row lane / 4, columns 2 (lane % 4) and the next), as mma's operands want them.
// Volatile: it reads what other threads stored before a __syncthreads.
__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* row) {
    const u32 at = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}
#endif


// Kernels that take f32 buffers only. common.cuh is prepended by the Rust side.

// c[m x n] = a[m x k] . b[k x n], 16x16 tiles: grid (n / 16, m / 16), block 16x16.
extern "C" __global__ void __launch_bounds__(256)
matmul(const MatMulParams* __restrict__ p, const float* __restrict__ a, const float* __restrict__ b,
       float* __restrict__ c) {
    __shared__ float as[16][17];
    __shared__ float bs[16][17];
    const u32 m = p->m, n = p->n, k = p->k;
    const u32 tx = threadIdx.x, ty = threadIdx.y;
    const u32 row = blockIdx.y * 16 + ty, col = blockIdx.x * 16 + tx;
    float acc = 0.0f;
    for (u32 k0 = 0; k0 < k; k0 += 16) {
        as[ty][tx] = (row < m && k0 + tx < k) ? a[(size_t)row * k + k0 + tx] : 0.0f;
        bs[ty][tx] = (k0 + ty < k && col < n) ? b[(size_t)(k0 + ty) * n + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 16; i++) acc += as[ty][i] * bs[i][tx];
        __syncthreads();
    }
    if (row < m && col < n) c[(size_t)row * n + col] = acc;
}

// Prefill's tiled products (linear_mma*) take their activations as f16, rounded here once
// per product instead of in every block of rows: 8 elements per thread (n is a multiple of 32).
extern "C" __global__ void __launch_bounds__(256)
to_f16(const CountParams* __restrict__ p, const float* __restrict__ x, uint4* __restrict__ out) {
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    if ((size_t)i * 8 >= p->n) return;
    const float4 a = reinterpret_cast<const float4*>(x)[2 * (size_t)i];
    const float4 b = reinterpret_cast<const float4*>(x)[2 * (size_t)i + 1];
#if __CUDA_ARCH__ >= 800
    out[i] = make_uint4(pack_f16x2(a.x, a.y), pack_f16x2(a.z, a.w), pack_f16x2(b.x, b.y),
                        pack_f16x2(b.z, b.w));
#else
    // Tensor cores (and so this kernel's launches) are taken from compute 8.0 up only; the
    // kernel still compiles for older GPUs, whose ops module holds it.
    (void)a;
    (void)b;
#endif
}

// The several-token split matrix-vector products (linear_matvec_split_tokens_q8) take their
// activations rounded to int8 once per product: each lane step of 8 elements (load_x_q8's
// layout, which continues across rows as they are whole 32-element blocks) as one uint4 of
// (lo, hi, d, sum). One step per thread.
extern "C" __global__ void __launch_bounds__(256)
to_q8(const CountParams* __restrict__ p, const float* __restrict__ x, uint4* __restrict__ out) {
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    if ((size_t)i * 8 >= p->n) return;
    const XQ8 q = load_x_q8(x, i);
    out[i] = make_uint4((u32)q.lo, (u32)q.hi, __float_as_uint(q.d), __float_as_uint(q.sum));
}

// One block of 1024 per row; x may be y (each thread rewrites only what it read). A row of
// up to 8192 is read once into registers, all loads issued before the sum waits on them.
#define RMS_THREADS 1024
#define RMS_REGS 8
extern "C" __global__ void __launch_bounds__(RMS_THREADS)
rmsnorm(const RmsNormParams* __restrict__ p, const float* x, const float* __restrict__ weight, float* y) {
    __shared__ float sh[32];
    const u32 dim = p->dim;
    const float eps = p->eps;
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* yr = y + (size_t)blockIdx.x * dim;
    float v[RMS_REGS];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < RMS_REGS; k++) {
        const u32 c = threadIdx.x + k * RMS_THREADS;
        v[k] = c < dim ? xr[c] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < RMS_REGS; k++) ss += v[k] * v[k];
    for (u32 c = threadIdx.x + RMS_REGS * RMS_THREADS; c < dim; c += RMS_THREADS) ss += xr[c] * xr[c];
    ss = block_sum(ss, sh);
    const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int k = 0; k < RMS_REGS; k++) {
        const u32 c = threadIdx.x + k * RMS_THREADS;
        if (c < dim) yr[c] = v[k] * scale * weight[c];
    }
    for (u32 c = threadIdx.x + RMS_REGS * RMS_THREADS; c < dim; c += RMS_THREADS)
        yr[c] = xr[c] * scale * weight[c];
}

// In place; one thread per rotated pair: grid (heads * rope_dim / 2 / 256, tokens). `factors`
// (rope_dim / 2 divisors of the angle) is read only when p->flags has ROPE_FACTORS, and
// `positions` (one per token) only with ROPE_POSITIONS; otherwise the launch passes x there.
#define ROPE_FACTORS 1u
#define ROPE_POSITIONS 2u
extern "C" __global__ void __launch_bounds__(256)
rope(const RopeParams* __restrict__ p, float* x, const float* factors, const u32* positions) {
    const u32 heads = p->heads, head_dim = p->head_dim, rope_dim = p->rope_dim, pos0 = p->pos0;
    const u32 neox = p->neox;
    const float base = p->freq_base;
    const u32 half = rope_dim / 2;
    const u32 idx = blockIdx.x * 256 + threadIdx.x, t = blockIdx.y;
    if (idx >= heads * half) return;
    const u32 head = idx / half, i = idx % half;
    // Same expression order as the CPU twin: pos * base^(-2i / rope_dim), all f32.
    const float pos = (float)((p->flags & ROPE_POSITIONS) ? positions[t] : pos0 + t);
    float theta = pos * powf(base, (-2.0f * (float)i) / (float)rope_dim);
    if (p->flags & ROPE_FACTORS) theta = theta / factors[i];
    float s, c;
    sincosf(theta, &s, &c);
    float* h = x + ((size_t)t * heads + head) * head_dim;
    const u32 ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    const float x0 = h[ia], x1 = h[ib];
    h[ia] = x0 * c - x1 * s;
    h[ib] = x0 * s + x1 * c;
}

// In place over each row; one block per row.
extern "C" __global__ void __launch_bounds__(256) softmax(const SoftmaxParams* __restrict__ p, float* x) {
    __shared__ float sh[32];
    const u32 cols = p->cols;
    float* r = x + (size_t)blockIdx.x * cols;
    float mx = NEG_INF;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) mx = fmaxf(mx, r[c]);
    mx = block_max(mx, sh);
    float sum = 0.0f;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) {
        const float e = expf(r[c] - mx);
        r[c] = e;
        sum += e;
    }
    sum = block_sum(sum, sh);
    const float inv = 1.0f / sum;
    for (u32 c = threadIdx.x; c < cols; c += blockDim.x) r[c] *= inv;
}

extern "C" __global__ void __launch_bounds__(256)
silu_mul(const CountParams* __restrict__ p, const float* __restrict__ gate, const float* __restrict__ up,
         float* __restrict__ out) {
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    if (i >= p->n) return;
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
}

// out = gelu(gate) * up; GELU in the tanh approximation, saturated past |g| = 10
// (kernels/elementwise.rs `gelu`).
extern "C" __global__ void __launch_bounds__(256)
gelu_mul(const CountParams* __restrict__ p, const float* __restrict__ gate, const float* __restrict__ up,
         float* __restrict__ out) {
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    if (i >= p->n) return;
    const float g = gate[i];
    float v = 0.0f;
    if (g >= 10.0f) {
        v = g;
    } else if (g > -10.0f) {
        v = 0.5f * g * (1.0f + tanhf(0.7978846f * g * (1.0f + 0.044715f * g * g)));
    }
    out[i] = v * up[i];
}

// x = x * scale, then cap * tanh(x / cap) when cap > 0, in place.
extern "C" __global__ void __launch_bounds__(256)
scale_cap(const ScaleCapParams* __restrict__ p, float* __restrict__ x) {
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    if (i >= p->n) return;
    float v = x[i] * p->scale;
    if (p->cap > 0.0f) v = p->cap * tanhf(fminf(fmaxf(v / p->cap, -10.0f), 10.0f));
    x[i] = v;
}

// x[t * cols + i] += bias[i], in place.
extern "C" __global__ void __launch_bounds__(256)
add_bias(const BiasParams* __restrict__ p, float* __restrict__ x, const float* __restrict__ bias) {
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    const u32 cols = p->cols;
    if (i >= cols * p->tokens) return;
    x[i] += bias[i % cols];
}

// out may be a or b.
extern "C" __global__ void __launch_bounds__(256)
add(const CountParams* __restrict__ p, const float* a, const float* b, float* out) {
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    if (i >= p->n) return;
    out[i] = a[i] + b[i];
}

// Causal grouped-query attention over keys [k0, k1) of one (head, token), by a block of 256
// threads. Keys are taken 256 at a time, one thread per key for the scores; the chunk's softmax
// weights go through shared memory to the threads that own the output elements (one per
// element of head_dim, which is at most 256, validated), with an online rescale between
// chunks. Leaves the running maximum m, the sum l and (threads below head_dim) the unscaled
// output element in acc; an empty range leaves m = -inf, l = 0, acc = 0.
#define ATT_CHUNK 256
struct AttPart { float m, l, acc; };
__device__ __forceinline__ AttPart attend(const AttentionParams* p, const float* q, const float* kc,
                                          const float* vc, u32 k0, u32 k1, float* qs, float* ps,
                                          float* red) {
    const u32 heads = p->heads, kv_heads = p->kv_heads, hd = p->head_dim;
    const float scale = p->scale, softcap = p->softcap;
    const u32 h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    const u32 kh = h / (heads / kv_heads);
    const size_t kv_stride = (size_t)kv_heads * hd;
    const float* qv = q + ((size_t)t * heads + h) * hd;
    for (u32 c = tid; c < hd; c += blockDim.x) qs[c] = qv[c];
    __syncthreads();
    // Rows start 16-byte aligned when head_dim is a multiple of 4 (buffers are 256-aligned).
    const bool vec4 = (hd & 3) == 0;
    float m = NEG_INF, l = 0.0f, acc = 0.0f;
    for (u32 p0 = k0; p0 < k1; p0 += ATT_CHUNK) {
        const u32 p = p0 + tid;
        float s = NEG_INF;
        if (p < k1) {
            const float* kr = kc + p * kv_stride + (size_t)kh * hd;
            float dot = 0.0f;
            if (vec4) {
                const float4* k4 = reinterpret_cast<const float4*>(kr);
#pragma unroll 8
                for (u32 d = 0; d < hd / 4; d++) {
                    const float4 k = k4[d];
                    dot += qs[4 * d] * k.x + qs[4 * d + 1] * k.y + qs[4 * d + 2] * k.z
                         + qs[4 * d + 3] * k.w;
                }
            } else {
                for (u32 d = 0; d < hd; d++) dot += qs[d] * kr[d];
            }
            s = dot * scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        }
        const float mn = fmaxf(m, block_max(s, red));
        const float e = p < k1 ? expf(s - mn) : 0.0f;
        ps[tid] = e;
        // block_sum's barriers also publish ps to every thread.
        const float cs = block_sum(e, red);
        const float corr = expf(m - mn);  // 0 on the first chunk (m = -inf)
        l = l * corr + cs;
        if (tid < hd) {
            const u32 np = min((u32)ATT_CHUNK, k1 - p0);
            const float* vr = vc + (size_t)p0 * kv_stride + (size_t)kh * hd + tid;
            float a = acc * corr;
#pragma unroll 16
            for (u32 j = 0; j < np; j++) a += ps[j] * vr[j * kv_stride];
            acc = a;
        }
        m = mn;
        __syncthreads();  // everyone is done with ps before the next chunk writes it
    }
    return AttPart{m, l, acc};
}

// The first of `n_keys` causal keys a query attends to under a sliding window of `window`
// positions (0: none), as kernels::attention::first_key.
__device__ __forceinline__ u32 first_key(u32 n_keys, u32 window) {
    return window == 0 ? 0 : n_keys - min(n_keys, window);
}

// One block per (head, token) over all its keys (the window's).
extern "C" __global__ void __launch_bounds__(256)
attention(const AttentionParams* __restrict__ p, const float* __restrict__ q, const float* __restrict__ kc,
          const float* __restrict__ vc, float* __restrict__ out) {
    __shared__ float qs[256];
    __shared__ float ps[ATT_CHUNK];
    __shared__ float red[32];
    const u32 heads = p->heads, hd = p->head_dim, pos0 = p->pos0;
    const u32 h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    const u32 n_keys = pos0 + t + 1;
    const AttPart r = attend(p, q, kc, vc, first_key(n_keys, p->window), n_keys, qs, ps, red);
    if (tid < hd) out[((size_t)t * heads + h) * hd + tid] = r.acc / r.l;
}

// Prefill attention on tensor cores (flash-attention style), for head_dim 64 and 128 on compute
// capability 8.0 and up, with the sliding window and score soft cap of the other kernels: a block of 4 warps takes 64 queries of one head, each warp 16 of them,
// and walks the keys they need 64 at a time. Each tile of keys is staged in shared memory as
// f16 (keys row-major, values transposed, rows padded so the fragment loads below hit 32
// distinct banks); S = Q K^T and O += P V run as 16x8x16 products with f32 sums, the softmax in
// f32 with an online rescale per tile. P goes from the S accumulators to the A operand without
// leaving registers (an accumulator tile pair has the A fragment's layout). Grid (heads,
// tokens / 64 rounded up), 128 threads.
#define FA_Q 64
#define FA_K 64
#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

template <int HD>
__device__ __forceinline__ void flash_attention(const AttentionParams* __restrict__ p,
                                                const float* __restrict__ q,
                                                const float* __restrict__ kc,
                                                const float* __restrict__ vc,
                                                float* __restrict__ out) {
    constexpr u32 KW = HD / 2 + 4;    // u32 words per staged key row
    constexpr u32 VW = FA_K / 2 + 4;  // u32 words per staged (transposed) value row
    __shared__ __align__(16) u32 ks[FA_K][KW];
    __shared__ __align__(16) u32 vt[HD][VW];
    const u32 heads = p->heads, tokens = p->tokens, pos0 = p->pos0, window = p->window;
    const float scale = p->scale, softcap = p->softcap;
    const u32 h = blockIdx.x, t0 = blockIdx.y * FA_Q;
    const u32 kh = h / (heads / p->kv_heads);
    const size_t kv_stride = (size_t)p->kv_heads * HD;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, qd = lane & 3;
    const u32 n_keys = pos0 + tokens;
    // This thread's two query rows (g and g + 8 of the warp's 16) and the last key each may
    // see; rows past the last token attend like the last token and are not written.
    const u32 qa = t0 + warp * 16 + g, qb = qa + 8;
    const u32 lim[2] = {min(pos0 + qa, n_keys - 1), min(pos0 + qb, n_keys - 1)};
    // ... and the first, under a sliding window.
    const u32 lo[2] = {first_key(lim[0] + 1, window), first_key(lim[1] + 1, window)};
    u32 qf[HD / 16][4];
    {
        const float* ra = q + ((size_t)min(qa, tokens - 1) * heads + h) * HD;
        const float* rb = q + ((size_t)min(qb, tokens - 1) * heads + h) * HD;
#pragma unroll
        for (int c = 0; c < HD / 16; c++) {
            const u32 d = 16 * c + 2 * qd;
            qf[c][0] = pack_f16x2(ra[d], ra[d + 1]);
            qf[c][1] = pack_f16x2(rb[d], rb[d + 1]);
            qf[c][2] = pack_f16x2(ra[d + 8], ra[d + 9]);
            qf[c][3] = pack_f16x2(rb[d + 8], rb[d + 9]);
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[j][e] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    const u32 key_end = pos0 + min(t0 + FA_Q, tokens);
    // Staging: thread i takes half of key i / 2's row (HD / 2 floats) of K and of V.
    const u32 sk = threadIdx.x >> 1, sh = (threadIdx.x & 1) * (HD / 2);
    // The block's first query has the earliest first key.
    const u32 key_start = first_key(pos0 + t0 + 1, window) / FA_K * FA_K;
    for (u32 k0 = key_start; k0 < key_end; k0 += FA_K) {
        const u32 key = k0 + sk;
        const bool in = key < n_keys;
        const float* kr = kc + (size_t)(in ? key : 0) * kv_stride + (size_t)kh * HD + sh;
        const float* vr = vc + (size_t)(in ? key : 0) * kv_stride + (size_t)kh * HD + sh;
        u16* vt16 = reinterpret_cast<u16*>(&vt[0][0]);
#pragma unroll 4
        for (u32 c = 0; c < HD / 2; c += 4) {
            float4 kv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vv = kv;
            if (in) {
                kv = *reinterpret_cast<const float4*>(kr + c);
                vv = *reinterpret_cast<const float4*>(vr + c);
            }
            *reinterpret_cast<uint2*>(&ks[sk][(sh + c) >> 1]) =
                make_uint2(pack_f16x2(kv.x, kv.y), pack_f16x2(kv.z, kv.w));
            const u32 d = sh + c;
            vt16[(d + 0) * (2 * VW) + sk] = f32_to_f16_bits(vv.x);
            vt16[(d + 1) * (2 * VW) + sk] = f32_to_f16_bits(vv.y);
            vt16[(d + 2) * (2 * VW) + sk] = f32_to_f16_bits(vv.z);
            vt16[(d + 3) * (2 * VW) + sk] = f32_to_f16_bits(vv.w);
        }
        __syncthreads();
        float s[FA_K / 8][4];
#pragma unroll
        for (int j = 0; j < FA_K / 8; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = 0.0f;
#pragma unroll
            for (int c = 0; c < HD / 16; c++) {
                const u32 b[2] = {ks[8 * j + g][8 * c + qd], ks[8 * j + g][8 * c + qd + 4]};
                mma_16x8x16(s[j], qf[c], b);
            }
        }
        // Scale and mask; each row's maximum over the quad of lanes that holds it.
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int j = 0; j < FA_K / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const u32 key = k0 + 8 * j + 2 * qd + (e & 1);
                float v = s[j][e] * scale;
                if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
                v = key >= lo[e >> 1] && key <= lim[e >> 1] ? v : NEG_INF;
                s[j][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
            // A row whose keys all lie in later tiles (a window) keeps m = -inf until then.
            const float mn = fmaxf(m[r], mx[r]);
            corr[r] = mn == NEG_INF ? 1.0f : expf(m[r] - mn);  // 0 on a row's first keys
            m[r] = mn;
        }
        float sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < FA_K / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float pe = s[j][e] == NEG_INF ? 0.0f : expf(s[j][e] - m[e >> 1]);
                s[j][e] = pe;
                sum[e >> 1] += pe;
            }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            sum[r] += __shfl_xor_sync(FULL_MASK, sum[r], 1);
            sum[r] += __shfl_xor_sync(FULL_MASK, sum[r], 2);
            l[r] = l[r] * corr[r] + sum[r];
        }
#pragma unroll
        for (int j = 0; j < HD / 8; j++) {
            o[j][0] *= corr[0];
            o[j][1] *= corr[0];
            o[j][2] *= corr[1];
            o[j][3] *= corr[1];
        }
        // O += P V, 16 keys at a time: S tiles 2c and 2c + 1 are P's A fragment.
#pragma unroll
        for (int c = 0; c < FA_K / 16; c++) {
            const u32 a[4] = {pack_f16x2(s[2 * c][0], s[2 * c][1]),
                              pack_f16x2(s[2 * c][2], s[2 * c][3]),
                              pack_f16x2(s[2 * c + 1][0], s[2 * c + 1][1]),
                              pack_f16x2(s[2 * c + 1][2], s[2 * c + 1][3])};
#pragma unroll
            for (int j = 0; j < HD / 8; j++) {
                const u32 b[2] = {vt[8 * j + g][8 * c + qd], vt[8 * j + g][8 * c + qd + 4]};
                mma_16x8x16(o[j], a, b);
            }
        }
        __syncthreads();  // everyone is done with this tile before the next is staged
    }
    const float inv[2] = {1.0f / l[0], 1.0f / l[1]};
    const u32 rows[2] = {qa, qb};
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (rows[r] >= tokens) continue;
        float* orow = out + ((size_t)rows[r] * heads + h) * HD;
#pragma unroll
        for (int j = 0; j < HD / 8; j++)
            *reinterpret_cast<float2*>(orow + 8 * j + 2 * qd) =
                make_float2(o[j][2 * r] * inv[r], o[j][2 * r + 1] * inv[r]);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(128)
attention_mma64(const AttentionParams* __restrict__ p, const float* __restrict__ q,
                const float* __restrict__ kc, const float* __restrict__ vc, float* __restrict__ out) {
#if __CUDA_ARCH__ >= 800
    flash_attention<64>(p, q, kc, vc, out);
#endif
}
extern "C" __global__ void __launch_bounds__(128)
attention_mma128(const AttentionParams* __restrict__ p, const float* __restrict__ q,
                 const float* __restrict__ kc, const float* __restrict__ vc, float* __restrict__ out) {
#if __CUDA_ARCH__ >= 800
    flash_attention<128>(p, q, kc, vc, out);
#endif
}

// Decode attention with each (head, token)'s keys split across p->splits blocks (grid z), so that a
// step with few heads still fills the device (flash-decoding). Each block leaves its part in
// the scratch buffer; the last of a (head, token)'s blocks to finish (an atomic count) merges
// them and sets the count back to zero for the next launch. The split count depends on the
// shape only, never on pos0, so a captured graph replays at every position.
// Scratch: SPLIT_COUNTS counts (u32; this launch's heads * tokens first), then per part (m, l),
// then per part head_dim floats. The counts keep a region of their own, which no launch's parts
// overlap: a launch over fewer (head, token) pairs would otherwise leave its parts where a
// later launch over more pairs finds its counts, which must be zero (a short prompt after a
// decode step merged at the wrong block: wrong attention).
#define SPLIT_COUNTS 4096
extern "C" __global__ void __launch_bounds__(256)
attention_split(const AttentionParams* __restrict__ p, const float* __restrict__ q,
                const float* __restrict__ kc, const float* __restrict__ vc,
                float* __restrict__ out, u32* __restrict__ scratch) {
    __shared__ float qs[256];
    __shared__ float ps[ATT_CHUNK];
    __shared__ float red[32];
    __shared__ bool merge;
    const u32 heads = p->heads, hd = p->head_dim, tokens = p->tokens, pos0 = p->pos0;
    const u32 splits = p->splits;
    const u32 h = blockIdx.x, t = blockIdx.y, part = blockIdx.z, tid = threadIdx.x;
    const u32 n_keys = pos0 + t + 1, key0 = first_key(n_keys, p->window);
    const u32 per = (n_keys - key0 + splits - 1) / splits;
    const u32 k0 = min(key0 + part * per, n_keys), k1 = min(k0 + per, n_keys);
    const AttPart r = attend(p, q, kc, vc, k0, k1, qs, ps, red);
    const u32 ht = t * heads + h;
    u32* count = scratch + ht;
    float* ml = reinterpret_cast<float*>(scratch + SPLIT_COUNTS);
    float* pacc = ml + (size_t)heads * tokens * splits * 2;
    const size_t mine = (size_t)ht * splits + part;
    if (tid == 0) {
        ml[2 * mine] = r.m;
        ml[2 * mine + 1] = r.l;
    }
    if (tid < hd) pacc[mine * hd + tid] = r.acc;
    __threadfence();
    __syncthreads();
    if (tid == 0) merge = atomicAdd(count, 1u) == splits - 1;
    __syncthreads();
    if (!merge) return;
    __threadfence();
    // The merge, with the parts' weights found in parallel (one thread per part) and the
    // output elements' loads unrolled: a loop of dependent loads over up to 32 parts costs
    // more than the attention itself.
    __shared__ float weight[32];
    const size_t first = (size_t)ht * splits;
    float mk = NEG_INF, lk = 0.0f;
    if (tid < splits) {
        mk = __ldcg(ml + 2 * (first + tid));
        lk = __ldcg(ml + 2 * (first + tid) + 1);
    }
    const float mx = block_max(mk, red);
    // An empty range (lk = 0, mk = -inf) weighs nothing.
    const float wk = lk > 0.0f ? expf(mk - mx) : 0.0f;
    if (tid < splits) weight[tid] = wk;
    // block_sum's barriers also publish `weight`.
    const float l = block_sum(lk * wk, red);
    if (tid < hd) {
        float a = 0.0f;
#pragma unroll 8
        for (u32 k = 0; k < splits; k++) a += __ldcg(pacc + (first + k) * hd + tid) * weight[k];
        out[(size_t)ht * hd + tid] = a / l;
    }
    if (tid == 0) *count = 0;
}

// The paged key/value pool (kernels/paged.rs). Slots and table entries are read from buffers,
// so an entry outside the pool or the table is skipped rather than followed.

// Row t of k and v into slot slots[t] of k_pool and v_pool: grid (kv_dim / 256, tokens).
extern "C" __global__ void __launch_bounds__(256)
kv_store(const KvStoreParams* __restrict__ p, const float* __restrict__ k, const float* __restrict__ v,
         const u32* __restrict__ slots, float* __restrict__ k_pool, float* __restrict__ v_pool) {
    const u32 kv_dim = p->kv_dim;
    const u32 c = blockIdx.x * 256 + threadIdx.x, t = blockIdx.y;
    if (c >= kv_dim) return;
    const u32 slot = slots[t];
    if (slot >= p->pool_slots) return;
    const size_t src = (size_t)t * kv_dim + c, dst = (size_t)slot * kv_dim + c;
    k_pool[dst] = k[src];
    v_pool[dst] = v[src];
}

// Where token t's keys are: its table (from `start` in `table`) and key count, or false when
// the token is skipped: its keys reach past table_len, or its table names a block at or past
// pool_blocks. Every thread of the block must call it (it ends in a barrier).
__device__ __forceinline__ bool paged_keys(const PagedAttentionParams* p, const u32* rows,
                                           const u32* table, u32 t, const u32** tab, u32* n) {
    const u32 block = p->block, table_len = p->table_len, pool_blocks = p->pool_blocks;
    const u32 start = rows[2 * t], n_keys = rows[2 * t + 1];
    const u32 n_blocks = n_keys / block + (n_keys % block != 0);
    // Written without overflow: start and n_keys come from a buffer.
    bool bad = start > table_len || n_blocks > table_len - start;
    if (!bad)
        for (u32 b = threadIdx.x; b < n_blocks; b += blockDim.x) bad |= table[start + b] >= pool_blocks;
    *tab = table + start;
    *n = n_keys;
    return !__syncthreads_or(bad);
}

// Keys [k0, k1) of one (head, token) through its table `tab`, by a block of 256 threads: the
// same chunked online softmax as `attend`, with each chunk's slots kept in shared memory for
// the value pass. Leaves m, l and (threads below head_dim) the unscaled output element.
__device__ __forceinline__ AttPart paged_attend(const PagedAttentionParams* p, const float* q,
                                                const float* kp, const float* vp, const u32* tab,
                                                u32 k0, u32 k1, float* qs, float* ps,
                                                u32* key_slots, float* red) {
    const u32 heads = p->heads, kv_heads = p->kv_heads, hd = p->head_dim, block = p->block;
    const float scale = p->scale, softcap = p->softcap;
    const u32 h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    const u32 kh = h / (heads / kv_heads);
    const size_t kv_stride = (size_t)kv_heads * hd;
    const float* qv = q + ((size_t)t * heads + h) * hd;
    for (u32 c = tid; c < hd; c += blockDim.x) qs[c] = qv[c];
    __syncthreads();
    // Rows start 16-byte aligned when head_dim is a multiple of 4 (buffers are 256-aligned).
    const bool vec4 = (hd & 3) == 0;
    float m = NEG_INF, l = 0.0f, acc = 0.0f;
    for (u32 p0 = k0; p0 < k1; p0 += ATT_CHUNK) {
        const u32 j = p0 + tid;
        float s = NEG_INF;
        if (j < k1) {
            const u32 slot = tab[j / block] * block + j % block;
            key_slots[tid] = slot;
            const float* kr = kp + slot * kv_stride + (size_t)kh * hd;
            float dot = 0.0f;
            if (vec4) {
                const float4* k4 = reinterpret_cast<const float4*>(kr);
#pragma unroll 8
                for (u32 d = 0; d < hd / 4; d++) {
                    const float4 k = k4[d];
                    dot += qs[4 * d] * k.x + qs[4 * d + 1] * k.y + qs[4 * d + 2] * k.z
                         + qs[4 * d + 3] * k.w;
                }
            } else {
                for (u32 d = 0; d < hd; d++) dot += qs[d] * kr[d];
            }
            s = dot * scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        }
        const float mn = fmaxf(m, block_max(s, red));
        const float e = j < k1 ? expf(s - mn) : 0.0f;
        ps[tid] = e;
        // block_sum's barriers also publish ps and key_slots to every thread.
        const float cs = block_sum(e, red);
        const float corr = expf(m - mn);  // 0 on the first chunk (m = -inf)
        l = l * corr + cs;
        if (tid < hd) {
            const u32 np = min((u32)ATT_CHUNK, k1 - p0);
            const float* vr = vp + (size_t)kh * hd + tid;
            float a = acc * corr;
#pragma unroll 8
            for (u32 i = 0; i < np; i++) a += ps[i] * vr[key_slots[i] * kv_stride];
            acc = a;
        }
        m = mn;
        __syncthreads();  // everyone is done with ps and key_slots before the next chunk
    }
    return AttPart{m, l, acc};
}

// Causal grouped-query attention of a batch of sequences, each token through its block table
// (kernels/paged.rs): rows[2t] is where token t's table starts in `table`, rows[2t + 1] how
// many keys it attends to; key j is in slot table[start + j / block] * block + j % block. A
// skipped token (see paged_keys) has its output row left unwritten. Grid (heads, tokens),
// block 256.
extern "C" __global__ void __launch_bounds__(256)
paged_attention(const PagedAttentionParams* __restrict__ p, const float* __restrict__ q,
                const float* __restrict__ kp, const float* __restrict__ vp,
                const u32* __restrict__ rows, const u32* __restrict__ table,
                float* __restrict__ out) {
    __shared__ float qs[256];
    __shared__ float ps[ATT_CHUNK];
    __shared__ u32 key_slots[ATT_CHUNK];
    __shared__ float red[32];
    const u32 h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x;
    const u32* tab;
    u32 n_keys;
    if (!paged_keys(p, rows, table, t, &tab, &n_keys)) return;
    const u32 key0 = first_key(n_keys, p->window);
    const AttPart r = paged_attend(p, q, kp, vp, tab, key0, n_keys, qs, ps, key_slots, red);
    // No keys: zeros, as the reference writes.
    if (tid < p->head_dim)
        out[((size_t)t * p->heads + h) * p->head_dim + tid] = n_keys ? r.acc / r.l : 0.0f;
}

// paged_attention with each (head, token)'s keys split across gridDim.z blocks, merged by the
// last of them to finish, as attention_split does (same scratch layout: heads * tokens counts,
// then (m, l) per part, then head_dim floats per part). A skipped token's blocks all return
// before counting, so its count stays zero and its output row unwritten. The split depends on
// the shape only, so a captured graph replays whatever the tables say.
extern "C" __global__ void __launch_bounds__(256)
paged_attention_split(const PagedAttentionParams* __restrict__ p, const float* __restrict__ q,
                      const float* __restrict__ kp, const float* __restrict__ vp,
                      const u32* __restrict__ rows, const u32* __restrict__ table,
                      float* __restrict__ out, u32* __restrict__ scratch) {
    __shared__ float qs[256];
    __shared__ float ps[ATT_CHUNK];
    __shared__ u32 key_slots[ATT_CHUNK];
    __shared__ float red[32];
    __shared__ bool merge;
    __shared__ float weight[32];
    const u32 heads = p->heads, hd = p->head_dim, tokens = p->tokens, splits = gridDim.z;
    const u32 h = blockIdx.x, t = blockIdx.y, part = blockIdx.z, tid = threadIdx.x;
    const u32* tab;
    u32 n_keys;
    if (!paged_keys(p, rows, table, t, &tab, &n_keys)) return;
    const u32 key0 = first_key(n_keys, p->window), live = n_keys - key0;
    const u32 per = live / splits + (live % splits != 0);
    const u32 k0 = min(key0 + part * per, n_keys), k1 = min(k0 + per, n_keys);
    const AttPart r = paged_attend(p, q, kp, vp, tab, k0, k1, qs, ps, key_slots, red);
    const u32 ht = t * heads + h;
    u32* count = scratch + ht;
    float* ml = reinterpret_cast<float*>(scratch + SPLIT_COUNTS);
    float* pacc = ml + (size_t)heads * tokens * splits * 2;
    const size_t mine = (size_t)ht * splits + part;
    if (tid == 0) {
        ml[2 * mine] = r.m;
        ml[2 * mine + 1] = r.l;
    }
    if (tid < hd) pacc[mine * hd + tid] = r.acc;
    __threadfence();
    __syncthreads();
    if (tid == 0) merge = atomicAdd(count, 1u) == splits - 1;
    __syncthreads();
    if (!merge) return;
    __threadfence();
    const size_t first = (size_t)ht * splits;
    float mk = NEG_INF, lk = 0.0f;
    if (tid < splits) {
        mk = __ldcg(ml + 2 * (first + tid));
        lk = __ldcg(ml + 2 * (first + tid) + 1);
    }
    const float mx = block_max(mk, red);
    // An empty range (lk = 0, mk = -inf) weighs nothing.
    const float wk = lk > 0.0f ? expf(mk - mx) : 0.0f;
    if (tid < splits) weight[tid] = wk;
    // block_sum's barriers also publish `weight`.
    const float l = block_sum(lk * wk, red);
    if (tid < hd) {
        float a = 0.0f;
#pragma unroll 8
        for (u32 k = 0; k < splits; k++) a += __ldcg(pacc + (first + k) * hd + tid) * weight[k];
        // No keys: zeros, as the reference writes.
        out[(size_t)ht * hd + tid] = n_keys ? a / l : 0.0f;
    }
    if (tid == 0) *count = 0;
}

// The first index of the largest value; one block of 1024.
extern "C" __global__ void __launch_bounds__(1024)
argmax(const CountParams* __restrict__ p, const float* __restrict__ x, u32* __restrict__ out) {
    __shared__ float shv[32];
    __shared__ u32 shi[32];
    const u32 n = p->n;
    float v = NEG_INF;
    u32 i = 0xffffffffu;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) arg_take(v, i, x[j], j);
    block_argmax(v, i, shv, shi);
    if (threadIdx.x == 0) out[0] = i;
}

// The sampling twin of kernels/sample.rs: same order keys, same bitwise searches for the
// top-k and top-p thresholds, same counter-based hash, Gumbel-max over what survives.
__device__ __forceinline__ u32 order_key(float v) {
    const u32 b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ u32 pcg(u32 v) {
    const u32 state = v * 747796405u + 2891336453u;
    const u32 word = ((state >> ((state >> 28) + 4)) ^ state) * 277803737u;
    return (word >> 22) ^ word;
}

__device__ __forceinline__ float uniform01(u32 seed_lo, u32 seed_hi, u32 step, u32 i) {
    const u32 h = pcg(i ^ pcg(step ^ pcg(seed_lo ^ pcg(seed_hi))));
    return ((float)(h >> 8) + 0.5f) / 16777216.0f;
}

__device__ float mass_above(const float* x, u32 n, u32 kmin, float mx, float* sh) {
    float s = 0.0f;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x)
        if (order_key(x[j]) >= kmin) s += expf(x[j] - mx);
    return block_sum(s, sh);
}

// One block of 1024.
extern "C" __global__ void __launch_bounds__(1024)
sample(const SampleKernelParams* __restrict__ p, const float* __restrict__ x, u32* __restrict__ out) {
    __shared__ float shv[32];
    __shared__ u32 shi[32];
    const u32 n = p->n, top_k = p->top_k, seed_lo = p->seed_lo, seed_hi = p->seed_hi;
    const u32 step = p->step;
    const float temp = p->temperature, top_p = p->top_p;
    float v = NEG_INF;
    u32 best = 0xffffffffu;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) arg_take(v, best, x[j], j);
    block_argmax(v, best, shv, shi);
    if (!(temp > 0.0f)) {
        if (threadIdx.x == 0) out[0] = best;
        return;
    }
    const float mx = x[best];
    u32 kmin = 0;
    if (top_k != 0 && top_k < n) {
        for (int bit = 31; bit >= 0; bit--) {
            const u32 cand = kmin | (1u << bit);
            u32 cnt = 0;
            for (u32 j = threadIdx.x; j < n; j += blockDim.x) cnt += order_key(x[j]) >= cand;
            if (block_sum_u32(cnt, shi) >= top_k) kmin = cand;
        }
    }
    u32 pmin = kmin;
    if (top_p < 1.0f) {
        const float target = fmaxf(top_p, 0.0f) * mass_above(x, n, kmin, mx, shv);
        for (int bit = 31; bit >= 0; bit--) {
            const u32 cand = pmin | (1u << bit);
            if (cand > pmin && mass_above(x, n, cand, mx, shv) >= target) pmin = cand;
        }
    }
    const float inv_t = 1.0f / temp;
    v = NEG_INF;
    best = 0xffffffffu;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        if (order_key(x[j]) < pmin) continue;
        const float u = uniform01(seed_lo, seed_hi, step, j);
        arg_take(v, best, x[j] * inv_t - logf(-logf(u)), j);
    }
    block_argmax(v, best, shv, shi);
    if (threadIdx.x == 0) out[0] = best;
}

// Word copy between (possibly the same) buffers; ranges never overlap (validated).
extern "C" __global__ void __launch_bounds__(256)
copy_words(const CopyParams* __restrict__ p, const u32* src, u32* dst) {
    const u64 so = (u64)p->src_lo | ((u64)p->src_hi << 32);
    const u64 dof = (u64)p->dst_lo | ((u64)p->dst_hi << 32);
    const u64 n = (u64)p->n_lo | ((u64)p->n_hi << 32);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        dst[dof + i] = src[so + i];
}

// A tensor-parallel pass's sum across the GPUs of one host (backend/peer.rs): h += the sum of
// every device's partial, in device order (so every device computes the same floats), once
// every device has reached the same sum. Device d's partial and flag words live on device d
// and are read and written here over peer access (NVLink or PCIe). Block 0 first publishes
// this device's epoch into every other device's flags (slot `index`); every block then waits
// until its own flags hold the epoch from every other device. A device is at most one sum
// ahead of another (it cannot pass its next sum before this one is published everywhere), so
// the comparison is on the signed difference, which survives the counter wrapping.
//
// A wait gives up after about five seconds: a device whose pass was never queued (its host
// call failed, and the pass fails on the host) must not keep this GPU spinning. The epoch it
// gave up at goes into the device's own slot of its flags, and the pass's later sums (epochs
// from `first`, the pass's first) do not wait; the pass's first sum resets the slot.
#define PEER_MAX 8
#define PEER_TIMEOUT_CYCLES 10000000000LL

__device__ __forceinline__ u32 peer_flag_load(const u32* f) {
#if __CUDA_ARCH__ >= 700
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(f) : "memory");
    return v;
#else
    const u32 v = *(const volatile u32*)f;
    __threadfence_system();
    return v;
#endif
}

__device__ __forceinline__ void peer_flag_store(u32* f, u32 v) {
#if __CUDA_ARCH__ >= 700
    asm volatile("st.release.sys.global.u32 [%0], %1;" : : "l"(f), "r"(v) : "memory");
#else
    __threadfence_system();
    *(volatile u32*)f = v;
#endif
}

extern "C" __global__ void __launch_bounds__(256)
peer_sum(const PeerSumParams* __restrict__ p, float* h,
         const float* p0, const float* p1, const float* p2, const float* p3,
         const float* p4, const float* p5, const float* p6, const float* p7,
         u32* f0, u32* f1, u32* f2, u32* f3, u32* f4, u32* f5, u32* f6, u32* f7) {
    const float* parts[PEER_MAX] = {p0, p1, p2, p3, p4, p5, p6, p7};
    u32* flags[PEER_MAX] = {f0, f1, f2, f3, f4, f5, f6, f7};
    const u32 n = p->n, me = p->index, devices = p->devices, epoch = p->epoch;
    if (threadIdx.x == 0) {
        if (blockIdx.x == 0) {
            // The partial was written by earlier kernels of this stream: complete, and made
            // visible to the other devices by the release.
            __threadfence_system();
            for (u32 d = 0; d < devices; d++)
                if (d != me) peer_flag_store(flags[d] + me, epoch);
        }
        u32* gave_up = flags[me] + me;
        if (epoch == p->first && blockIdx.x == 0) *(volatile u32*)gave_up = p->first - 1;
        const long long t0 = clock64();
        bool waiting = (int)(*(volatile u32*)gave_up - p->first) < 0;
        for (u32 d = 0; d < devices && waiting; d++) {
            if (d == me) continue;
            while ((int)(peer_flag_load(flags[me] + d) - epoch) < 0) {
                if (clock64() - t0 > PEER_TIMEOUT_CYCLES) {
                    *(volatile u32*)gave_up = epoch;
                    waiting = false;
                    break;
                }
            }
        }
    }
    __syncthreads();
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (u32 d = 0; d < devices; d++) {
            // Volatile: another device's memory, written after this kernel may have started.
            s += d == me ? parts[d][i] : *(const volatile float*)(parts[d] + i);
        }
        h[i] += s;
    }
}

// Kernels that take f32 buffers only. common.cuh is prepended by the Rust side.

// c[m x n] = a[m x k] . b[k x n], 16x16 tiles: grid (n / 16, m / 16), block 16x16.
// P: m, n, k.
extern "C" __global__ void __launch_bounds__(256)
matmul(const u32* __restrict__ P, const float* __restrict__ a, const float* __restrict__ b,
       float* __restrict__ c) {
    __shared__ float as[16][17];
    __shared__ float bs[16][17];
    const u32 m = P[0], n = P[1], k = P[2];
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

// One block per row; x may be y (each thread rewrites only what it read). P: dim, tokens, eps.
extern "C" __global__ void __launch_bounds__(256)
rmsnorm(const u32* __restrict__ P, const float* x, const float* __restrict__ weight, float* y) {
    __shared__ float sh[32];
    const u32 dim = P[0];
    const float eps = param_f(P, 2);
    const float* xr = x + (size_t)blockIdx.x * dim;
    float* yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss, sh);
    const float scale = 1.0f / sqrtf(ss / (float)dim + eps);
    for (u32 c = threadIdx.x; c < dim; c += blockDim.x) yr[c] = xr[c] * scale * weight[c];
}

// In place; one thread per rotated pair: grid (heads * rope_dim / 2 / 256, tokens).
// P: heads, head_dim, rope_dim, tokens, pos0, freq_base, neox.
extern "C" __global__ void __launch_bounds__(256) rope(const u32* __restrict__ P, float* x) {
    const u32 heads = P[0], head_dim = P[1], rope_dim = P[2], pos0 = P[4], neox = P[6];
    const float base = param_f(P, 5);
    const u32 half = rope_dim / 2;
    const u32 idx = blockIdx.x * 256 + threadIdx.x, t = blockIdx.y;
    if (idx >= heads * half) return;
    const u32 head = idx / half, i = idx % half;
    // Same expression order as the CPU twin: pos * base^(-2i / rope_dim), all f32.
    const float pos = (float)(pos0 + t);
    const float theta = pos * powf(base, (-2.0f * (float)i) / (float)rope_dim);
    float s, c;
    sincosf(theta, &s, &c);
    float* h = x + ((size_t)t * heads + head) * head_dim;
    const u32 ia = neox ? i : 2 * i, ib = neox ? i + half : 2 * i + 1;
    const float x0 = h[ia], x1 = h[ib];
    h[ia] = x0 * c - x1 * s;
    h[ib] = x0 * s + x1 * c;
}

// In place over each row; one block per row. P: rows, cols.
extern "C" __global__ void __launch_bounds__(256) softmax(const u32* __restrict__ P, float* x) {
    __shared__ float sh[32];
    const u32 cols = P[1];
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

// P: n.
extern "C" __global__ void __launch_bounds__(256)
silu_mul(const u32* __restrict__ P, const float* __restrict__ gate, const float* __restrict__ up,
         float* __restrict__ out) {
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    if (i >= P[0]) return;
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
}

// out may be a or b. P: n.
extern "C" __global__ void __launch_bounds__(256)
add(const u32* __restrict__ P, const float* a, const float* b, float* out) {
    const u32 i = blockIdx.x * 256 + threadIdx.x;
    if (i >= P[0]) return;
    out[i] = a[i] + b[i];
}

// Causal grouped-query attention, one block of 4 warps per (head, token): each warp keeps an
// online softmax over every 4th key, and the warps' partial results are merged at the end.
// head_dim <= 256 (validated), so a lane holds at most 8 of q's and out's elements.
// P: heads, kv_heads, head_dim, tokens, pos0, scale.
#define ATT_WARPS 4
#define ATT_PER_LANE 8
extern "C" __global__ void __launch_bounds__(128)
attention(const u32* __restrict__ P, const float* __restrict__ q, const float* __restrict__ kc,
          const float* __restrict__ vc, float* __restrict__ out) {
    __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
    __shared__ float s_o[ATT_WARPS][256];
    const u32 heads = P[0], kv_heads = P[1], hd = P[2], pos0 = P[4];
    const float scale = param_f(P, 5);
    const u32 h = blockIdx.x, t = blockIdx.y;
    const u32 kh = h / (heads / kv_heads);
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 n_keys = pos0 + t + 1;
    const size_t kv_stride = (size_t)kv_heads * hd;
    const float* qv = q + ((size_t)t * heads + h) * hd;
    float qr[ATT_PER_LANE], o[ATT_PER_LANE];
#pragma unroll
    for (int d = 0; d < ATT_PER_LANE; d++) {
        const u32 c = lane + 32 * d;
        qr[d] = c < hd ? qv[c] : 0.0f;
        o[d] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (u32 p = warp; p < n_keys; p += ATT_WARPS) {
        const float* kr = kc + p * kv_stride + (size_t)kh * hd;
        float s = 0.0f;
#pragma unroll
        for (int d = 0; d < ATT_PER_LANE; d++) {
            const u32 c = lane + 32 * d;
            if (c < hd) s += qr[d] * kr[c];
        }
        s = warp_sum(s) * scale;
        const float mn = fmaxf(m, s);
        const float corr = expf(m - mn), e = expf(s - mn);
        l = l * corr + e;
        const float* vr = vc + p * kv_stride + (size_t)kh * hd;
#pragma unroll
        for (int d = 0; d < ATT_PER_LANE; d++) {
            const u32 c = lane + 32 * d;
            if (c < hd) o[d] = o[d] * corr + e * vr[c];
        }
        m = mn;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int d = 0; d < ATT_PER_LANE; d++) {
        const u32 c = lane + 32 * d;
        if (c < hd) s_o[warp][c] = o[d];
    }
    __syncthreads();
    // Warps that saw no key have m = -inf and contribute exp(-inf) = 0.
    float mx = NEG_INF;
    for (int w = 0; w < ATT_WARPS; w++) mx = fmaxf(mx, s_m[w]);
    float f[ATT_WARPS], total = 0.0f;
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = expf(s_m[w] - mx);
        total += s_l[w] * f[w];
    }
    float* ov = out + ((size_t)t * heads + h) * hd;
    for (u32 c = threadIdx.x; c < hd; c += blockDim.x) {
        float acc = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) acc += s_o[w][c] * f[w];
        ov[c] = acc / total;
    }
}

// The first index of the largest value; one block of 1024. P: n.
extern "C" __global__ void __launch_bounds__(1024)
argmax(const u32* __restrict__ P, const float* __restrict__ x, u32* __restrict__ out) {
    __shared__ float shv[32];
    __shared__ u32 shi[32];
    const u32 n = P[0];
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

// One block of 1024. P: n, temperature, top_k, top_p, seed_lo, seed_hi, step.
extern "C" __global__ void __launch_bounds__(1024)
sample(const u32* __restrict__ P, const float* __restrict__ x, u32* __restrict__ out) {
    __shared__ float shv[32];
    __shared__ u32 shi[32];
    const u32 n = P[0], top_k = P[2], seed_lo = P[4], seed_hi = P[5], step = P[6];
    const float temp = param_f(P, 1), top_p = param_f(P, 3);
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
// P: src offset lo/hi, dst offset lo/hi, words lo/hi (all in 4-byte words).
extern "C" __global__ void __launch_bounds__(256)
copy_words(const u32* __restrict__ P, const u32* src, u32* dst) {
    const u64 so = (u64)P[0] | ((u64)P[1] << 32);
    const u64 dof = (u64)P[2] | ((u64)P[3] << 32);
    const u64 n = (u64)P[4] | ((u64)P[5] << 32);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        dst[dof + i] = src[so + i];
}

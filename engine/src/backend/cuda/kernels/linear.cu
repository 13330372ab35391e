// Kernels that read weights in one GGML format. The Rust side prepends common.cuh and one
// format header (f32.cuh, f16.cuh, q8_0.cuh, q4_0.cuh, q4_1.cuh), which define SUB (elements
// per lane step), XS (a step's activations, loaded once for every row that uses them), load_x,
// row_dot (one row's step against XS) and w_elem (one element of a row). A header may also
// define SPLIT_XS, split_load_x and split_row_dot, a step for the split kernels only, which
// load a step's activations once for 8 rows (the 4-bit formats' int8 step: rounding the
// activations costs more than it saves where each row loads its own).
#ifndef SPLIT_XS
#define SPLIT_XS XS
#define split_load_x load_x
#define split_row_dot row_dot
#endif
// A row's step for the several-token split kernel, read once for all of its tokens: a format
// header may decode it once (split_w_load) and dot it with each token's step (split_w_dot);
// by default the step is the row and index, and each token's dot reads the weights again.
#ifndef HAVE_SPLIT_W
struct SplitW { const u8* row; u32 s; };
__device__ __forceinline__ SplitW split_w_load(const u8* row, u32 s) { return SplitW{row, s}; }
__device__ __forceinline__ float split_w_dot(const SplitW& w, const SPLIT_XS& x) {
    return split_row_dot(w.row, w.s, x);
}
#endif

#define MATVEC_ROWS 8  // rows per block of 256 threads, in both matrix-vector kernels

// y[t, r] = sum_c w[r, c] * x[t, c] for small token counts and short rows: grid (rows / 8,
// tokens), one warp per row.
extern "C" __global__ void __launch_bounds__(256)
linear_matvec(const LinearParams* __restrict__ p, const u8* __restrict__ w, const float* __restrict__ x,
              float* __restrict__ y) {
    const u32 rows = p->rows, cols = p->cols, row_bytes = p->row_bytes;
    const u32 lane = threadIdx.x & 31;
    const u32 row = blockIdx.x * MATVEC_ROWS + (threadIdx.x >> 5);
    const u32 t = blockIdx.y;
    if (row >= rows) return;  // whole warps leave; nothing below synchronizes the block
    const u8* wr = w + (size_t)row * row_bytes;
    const float* xt = x + (size_t)t * cols;
    const u32 steps = cols / SUB;
    float s0 = 0.0f, s1 = 0.0f;
    u32 i = lane;
    // Two steps in flight per lane before either is summed.
    for (; i + 32 < steps; i += 64) {
        s0 += row_dot(wr, i, load_x(xt, i));
        s1 += row_dot(wr, i + 32, load_x(xt, i + 32));
    }
    if (i < steps) s0 += row_dot(wr, i, load_x(xt, i));
    float s = warp_sum(s0 + s1);
    if (lane == 0) y[(size_t)t * rows + row] = s;
}

// The same product for long rows (the launch picks it from 256 lane steps per row up): the
// block splits the columns, not the rows. Each thread takes every 256th step of all 8 rows, so
// a step's activations are loaded once for 8 rows and the block reads 8 rows' contiguous
// spans; the warps' partial sums meet in shared memory. Same grid and parameters. Four
// blocks per multiprocessor and four steps in flight per thread: the loads are what it waits on
// (on an H100, synthetic 8B decode: 174 tok/s, against 168 with two steps and 165 with one).
// Registers hold it at four blocks (50% occupancy, ncu); asking the compiler for five, six or
// eight made it spill to local memory and lose 12% to 40%.
extern "C" __global__ void __launch_bounds__(256, 4)
linear_matvec_split(const LinearParams* __restrict__ p, const u8* __restrict__ w,
                    const float* __restrict__ x, float* __restrict__ y) {
    __shared__ float part[8][MATVEC_ROWS];
    const u32 rows = p->rows, cols = p->cols, row_bytes = p->row_bytes;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 row0 = blockIdx.x * MATVEC_ROWS, t = blockIdx.y;
    const float* xt = x + (size_t)t * cols;
    // 32-bit offsets from the block's first row, not 8 pointers: registers are what limit
    // how many blocks a multiprocessor holds.
    const u8* w0 = w + (size_t)row0 * row_bytes;
    const u32 last = rows - 1 - row0;
    u32 off[MATVEC_ROWS];
    float acc[MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        // Rows past the end read the last row again and are not written.
        off[r] = min((u32)r, last) * row_bytes;
        acc[r] = 0.0f;
    }
    const u32 steps = cols / SUB;
#pragma unroll 4
    for (u32 i = threadIdx.x; i < steps; i += 256) {
        const SPLIT_XS xs = split_load_x(xt, i);
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) acc[r] += split_row_dot(w0 + off[r], i, xs);
    }
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) {
        const float s = warp_sum(acc[r]);
        if (lane == 0) part[warp][r] = s;
    }
    __syncthreads();
    if (threadIdx.x < MATVEC_ROWS) {
        const u32 row = row0 + threadIdx.x;
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) s += part[k][threadIdx.x];
        if (row < rows) y[(size_t)t * rows + row] = s;
    }
}

// The same products for a few tokens at once (a batch of decode steps): each block takes up
// to MATVEC_TOKENS tokens, so a weight row is read once for all of them where the kernels above
// read it once per token. Grid (tokens / MATVEC_TOKENS rounded up, rows / 8): the blocks of
// the same rows are neighbours, so past the first the weights come from L2. NT, the tokens of
// a block, is a template argument so the sums stay in registers.
#define MATVEC_TOKENS 4
// Tokens a block of linear_matvec_split_tokens_q8 takes (launch.rs: MATVEC_QTOKENS).
#ifndef MATVEC_QTOKENS
#define MATVEC_QTOKENS 4
#endif
// Partial sums a warp of the several-token split kernels leaves in shared memory.
#define SPLIT_PART (MATVEC_ROWS * (MATVEC_QTOKENS > MATVEC_TOKENS ? MATVEC_QTOKENS : MATVEC_TOKENS))

template <int NT>
__device__ __forceinline__ void matvec_warp_tokens(const u8* __restrict__ wr, const float* __restrict__ x,
                                                   float* __restrict__ y, u32 cols, u32 rows, u32 row,
                                                   u32 t0) {
    const u32 lane = threadIdx.x & 31, steps = cols / SUB;
    float s[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) s[j] = 0.0f;
    for (u32 i = lane; i < steps; i += 32) {
#pragma unroll
        for (int j = 0; j < NT; j++) s[j] += row_dot(wr, i, load_x(x + (size_t)(t0 + j) * cols, i));
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const float v = warp_sum(s[j]);
        if (lane == 0) y[(size_t)(t0 + j) * rows + row] = v;
    }
}

// linear_matvec for up to MATVEC_TOKENS tokens per block: one warp per row.
extern "C" __global__ void __launch_bounds__(256)
linear_matvec_tokens(const LinearParams* __restrict__ p, const u8* __restrict__ w,
                     const float* __restrict__ x, float* __restrict__ y) {
    const u32 rows = p->rows, cols = p->cols, t0 = blockIdx.x * MATVEC_TOKENS;
    const u32 row = blockIdx.y * MATVEC_ROWS + (threadIdx.x >> 5);
    if (row >= rows || t0 >= p->tokens) return;
    const u8* wr = w + (size_t)row * p->row_bytes;
    switch (min(p->tokens - t0, (u32)MATVEC_TOKENS)) {
        case 1: matvec_warp_tokens<1>(wr, x, y, cols, rows, row, t0); break;
        case 2: matvec_warp_tokens<2>(wr, x, y, cols, rows, row, t0); break;
        case 3: matvec_warp_tokens<3>(wr, x, y, cols, rows, row, t0); break;
        default: matvec_warp_tokens<4>(wr, x, y, cols, rows, row, t0); break;
    }
}

// A token's step for the several-token split kernel: rounded here from x, or (formats whose
// split step is int8, SPLIT_Q8) read as one uint4 from xq, where to_q8 (ops.cu) rounded every
// step of the product's activations once, the same arithmetic as load_x_q8.
__device__ __forceinline__ SPLIT_XS split_tokens_x(const float* __restrict__ x,
                                                   const uint4* __restrict__ xq, u32 cols,
                                                   u32 t, u32 i) {
#ifdef SPLIT_Q8
    if (xq != nullptr) {
        const uint4 v = xq[(size_t)t * (cols / SUB) + i];
        return XQ8{(int)v.x, (int)v.y, __uint_as_float(v.z), __uint_as_float(v.w)};
    }
#endif
    return split_load_x(x + (size_t)t * cols, i);
}

template <int NT>
__device__ __forceinline__ void matvec_split_tokens(const LinearParams* __restrict__ p,
                                                    const u8* __restrict__ w,
                                                    const float* __restrict__ x,
                                                    const uint4* __restrict__ xq,
                                                    float* __restrict__ y, u32 t0,
                                                    float (*part)[SPLIT_PART]) {
    const u32 rows = p->rows, cols = p->cols, row_bytes = p->row_bytes;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 row0 = blockIdx.y * MATVEC_ROWS;
    const u8* w0 = w + (size_t)row0 * row_bytes;
    const u32 last = rows - 1 - row0;
    u32 off[MATVEC_ROWS];
    float acc[NT][MATVEC_ROWS];
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS; r++) off[r] = min((u32)r, last) * row_bytes;
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) acc[j][r] = 0.0f;
    const u32 steps = cols / SUB;
#pragma unroll 2
    for (u32 i = threadIdx.x; i < steps; i += 256) {
        SPLIT_XS xs[NT];
#pragma unroll
        for (int j = 0; j < NT; j++) xs[j] = split_tokens_x(x, xq, cols, t0 + j, i);
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) {
            const SplitW wv = split_w_load(w0 + off[r], i);
#pragma unroll
            for (int j = 0; j < NT; j++) acc[j][r] += split_w_dot(wv, xs[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) {
            const float s = warp_sum(acc[j][r]);
            if (lane == 0) part[warp][j * MATVEC_ROWS + r] = s;
        }
    __syncthreads();
    if (threadIdx.x < MATVEC_ROWS * NT) {
        const u32 j = threadIdx.x / MATVEC_ROWS, row = row0 + threadIdx.x % MATVEC_ROWS;
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 8; k++) s += part[k][threadIdx.x];
        if (row < rows) y[(size_t)(t0 + j) * rows + row] = s;
    }
}

// The block's n tokens (1 <= n <= NT) through the instance of matvec_split_tokens for n.
template <int NT>
struct SplitTokens {
    static __device__ __forceinline__ void run(u32 n, const LinearParams* p, const u8* w,
                                               const float* x, const uint4* xq, float* y, u32 t0,
                                               float (*part)[SPLIT_PART]) {
        if (n < NT) SplitTokens<NT - 1>::run(n, p, w, x, xq, y, t0, part);
        else matvec_split_tokens<NT>(p, w, x, xq, y, t0, part);
    }
};
template <>
struct SplitTokens<1> {
    static __device__ __forceinline__ void run(u32, const LinearParams* p, const u8* w,
                                               const float* x, const uint4* xq, float* y, u32 t0,
                                               float (*part)[SPLIT_PART]) {
        matvec_split_tokens<1>(p, w, x, xq, y, t0, part);
    }
};

template <int QT>
__device__ __forceinline__ void split_tokens_body(const LinearParams* __restrict__ p,
                                                  const u8* __restrict__ w,
                                                  const float* __restrict__ x,
                                                  const uint4* __restrict__ xq,
                                                  float* __restrict__ y) {
    __shared__ float part[8][SPLIT_PART];
    const u32 t0 = blockIdx.x * QT;
    if (t0 >= p->tokens) return;
    SplitTokens<QT>::run(min(p->tokens - t0, (u32)QT), p, w, x, xq, y, t0, part);
}

// linear_matvec_split for up to MATVEC_TOKENS tokens per block. Twice the registers of one
// token's sums, so two blocks per multiprocessor where one token's kernel holds four.
extern "C" __global__ void __launch_bounds__(256, 2)
linear_matvec_split_tokens(const LinearParams* __restrict__ p, const u8* __restrict__ w,
                           const float* __restrict__ x, float* __restrict__ y) {
    split_tokens_body<MATVEC_TOKENS>(p, w, x, nullptr, y);
}

// The same over activations rounded to int8 once per product (to_q8 into the backend's
// staging buffer, launch::int8_activations): without it every block of 8 rows rounds every
// token's activations again, which costs the 8B shape's 16-sequence decode more than the
// dp4a products do. MATVEC_QTOKENS tokens a block.
#ifdef SPLIT_Q8
extern "C" __global__ void __launch_bounds__(256, 2)
linear_matvec_split_tokens_q8(const LinearParams* __restrict__ p, const u8* __restrict__ w,
                              const float* __restrict__ x, float* __restrict__ y,
                              const uint4* __restrict__ xq) {
    split_tokens_body<MATVEC_QTOKENS>(p, w, x, xq, y);
}
#endif

// The same product for many tokens (prefill) in f32 FMA: 64 rows x 64 tokens per block of 256
// threads (the tensor-core tiles, linear_mma*, follow).
#define MM_T 64
#define MM_K 32

// f32 FMA: weights dequantized into shared memory 32 columns at a time, 4x4 outputs per thread.
__device__ __forceinline__ void matmat_fma(const LinearParams* __restrict__ p, const u8* __restrict__ w,
                                           const float* __restrict__ x, float* __restrict__ y) {
    __shared__ float ws[MM_K][MM_T + 1];
    __shared__ float xs[MM_K][MM_T + 1];
    const u32 rows = p->rows, cols = p->cols, tokens = p->tokens, row_bytes = p->row_bytes;
    const u32 r0 = blockIdx.x * MM_T, t0 = blockIdx.y * MM_T;
    const u32 tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (u32 k0 = 0; k0 < cols; k0 += MM_K) {
        for (u32 e = threadIdx.x; e < MM_T * MM_K; e += 256) {
            const u32 r = e / MM_K, kk = e % MM_K, gk = k0 + kk;
            const u32 gr = r0 + r, gt = t0 + r;
            ws[kk][r] = (gr < rows && gk < cols) ? w_elem(w + (size_t)gr * row_bytes, gk) : 0.0f;
            xs[kk][r] = (gt < tokens && gk < cols) ? x[(size_t)gt * cols + gk] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (u32 kk = 0; kk < MM_K; kk++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = ws[kk][tx + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = xs[kk][ty + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 r = r0 + tx + 16 * i;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u32 t = t0 + ty + 16 * j;
            if (r < rows && t < tokens) y[(size_t)t * rows + r] = acc[i][j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
linear_matmat(const LinearParams* __restrict__ p, const u8* __restrict__ w, const float* __restrict__ x,
              float* __restrict__ y) {
    matmat_fma(p, w, x, y);
}

// The same product on tensor cores (compute capability 8.0 and up, rows a multiple of 32
// columns; launch::tensor_core_linear picks it and the tile): BM weight rows (64 or 128) x BN
// tokens (64, or 128 for long prompts over large matrices) per block of 8 warps, each warp 32
// rows x (BN / (8 / (BM / 32))) tokens of 16x8 tiles. Each step stages 64 columns of the rows (dequantized, f16) and of the tokens'
// activations (f16) in shared memory, rows padded to 72 halves so the fragment loads (ldmatrix)
// hit 32 distinct banks; the next step's global loads are issued before this step's products.
// 64 columns a step, not 32: each step's products then cover the latency of the next step's
// loads (8B shape prefill on an H100: see docs/performance.md). A row's last 32 columns may be
// the step's only ones. Sums stay f32; rounding the activations to f16 loses less than the cpu
// backend's int8 ones.
#define MMA_K 64    // columns per step
#define MMA_PAD 36  // u32 words per staged row: 64 halves + 8 of padding
#if __CUDA_ARCH__ >= 800
// A format header may split its 8-weight staging into the loads (W8, stage8_load, a step
// ahead) and the arithmetic (stage8_make); otherwise the loads are the whole of it.
#ifndef HAVE_STAGE8_SPLIT
struct W8 { uint4 v; };
__device__ __forceinline__ W8 stage8_load(const u8* row, u32 c) {
    float e[8];
#pragma unroll
    for (int j = 0; j < 8; j++) e[j] = w_elem(row, c + j);
    return W8{make_uint4(pack_f16x2(e[0], e[1]), pack_f16x2(e[2], e[3]), pack_f16x2(e[4], e[5]),
                         pack_f16x2(e[6], e[7]))};
}
__device__ __forceinline__ uint4 stage8_make(const W8& r, u32) { return r.v; }
#endif

// HX: the activations come as f16 pairs (`xh`, written once per product by to_f16) instead of
// f32 (`x`), for products of many row blocks, each of which would round every token's row again.
template <int BM, int BN, bool HX>
__device__ __forceinline__ void linear_mma_tile(const LinearParams* __restrict__ p,
                                                const u8* __restrict__ w,
                                                const float* __restrict__ x,
                                                const u32* __restrict__ xh,
                                                float* __restrict__ y) {
    constexpr int WARPS_M = BM / 32, WN = BN / (8 / WARPS_M), NT = WN / 8;
    constexpr int WGROUPS = BM / 64;  // row groups each thread stages per step
    constexpr int XGROUPS = BN / 64;  // token groups each thread stages per step
    constexpr int HALVES = MMA_K / 32;  // 8-column groups each thread stages per row and step
    __shared__ __align__(16) u32 ws[BM][MMA_PAD];
    __shared__ __align__(16) u32 xs[BN][MMA_PAD];
    const u32 rows = p->rows, cols = p->cols, tokens = p->tokens, row_bytes = p->row_bytes;
    const u32 r0 = blockIdx.x * BM, t0 = blockIdx.y * BN;
    // Staging: thread i fills columns kq..kq+7 (+ 32) of weight rows i / 4 (+ 64) and of token
    // i / 4.
    const u32 sr = threadIdx.x >> 2, kq = (threadIdx.x & 3) * 8;
    bool w_in[WGROUPS];
    const u8* wrow[WGROUPS];
#pragma unroll
    for (int i = 0; i < WGROUPS; i++) {
        w_in[i] = r0 + sr + 64 * i < rows;
        wrow[i] = w + (size_t)(w_in[i] ? r0 + sr + 64 * i : 0) * row_bytes;
    }
    bool x_in[XGROUPS];
    const float* xrow[XGROUPS];
    const u32* hrow[XGROUPS];  // HX: a token's row is cols / 2 words
#pragma unroll
    for (int i = 0; i < XGROUPS; i++) {
        x_in[i] = t0 + sr + 64 * i < tokens;
        const size_t t = x_in[i] ? t0 + sr + 64 * i : 0;
        if (HX) hrow[i] = xh + t * (cols / 2);
        else xrow[i] = x + t * cols;
    }
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 wm = (warp % WARPS_M) * 32, wn = (warp / WARPS_M) * WN, g = lane >> 2, q = lane & 3;
    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
    W8 wr[WGROUPS][HALVES];
    uint4 xv[XGROUPS][HALVES];
    float4 xa[XGROUPS][HALVES], xb[XGROUPS][HALVES];
    auto load = [&](u32 k0) {
#pragma unroll
        for (int h = 0; h < HALVES; h++) {
            const u32 c = k0 + 32 * h + kq;
            if (c >= cols) continue;
#pragma unroll
            for (int i = 0; i < WGROUPS; i++)
                if (w_in[i]) wr[i][h] = stage8_load(wrow[i], c);
#pragma unroll
            for (int i = 0; i < XGROUPS; i++) {
                if (!x_in[i]) continue;
                if (HX) {
                    xv[i][h] = *reinterpret_cast<const uint4*>(hrow[i] + c / 2);
                } else {
                    xa[i][h] = *reinterpret_cast<const float4*>(xrow[i] + c);
                    xb[i][h] = *reinterpret_cast<const float4*>(xrow[i] + c + 4);
                }
            }
        }
    };
    load(0);
    for (u32 k0 = 0; k0 < cols; k0 += MMA_K) {
#pragma unroll
        for (int h = 0; h < HALVES; h++) {
            const u32 c = k0 + 32 * h + kq, at = (32 * h + kq) >> 1;
            const bool in = c < cols;
#pragma unroll
            for (int i = 0; i < WGROUPS; i++)
                *reinterpret_cast<uint4*>(&ws[sr + 64 * i][at]) =
                    w_in[i] && in ? stage8_make(wr[i][h], c) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int i = 0; i < XGROUPS; i++)
                *reinterpret_cast<uint4*>(&xs[sr + 64 * i][at]) =
                    !(x_in[i] && in) ? make_uint4(0u, 0u, 0u, 0u)
                    : HX ? xv[i][h]
                         : make_uint4(pack_f16x2(xa[i][h].x, xa[i][h].y), pack_f16x2(xa[i][h].z, xa[i][h].w),
                                      pack_f16x2(xb[i][h].x, xb[i][h].y), pack_f16x2(xb[i][h].z, xb[i][h].w));
        }
        __syncthreads();
        if (k0 + MMA_K < cols) load(k0 + MMA_K);
#pragma unroll
        for (u32 kh = 0; kh < MMA_K / 2; kh += 8) {
            u32 a[2][4], b[NT][2];
            // A: matrices (rows 0-7, 8-15) x (columns 0-7, 8-15) of the 16x16 tile, in a[0..3]'s
            // order; B: two 8-token tiles' (columns 0-7, 8-15) per instruction.
#pragma unroll
            for (int i = 0; i < 2; i++)
                ldmatrix_x4(a[i], &ws[wm + 16 * i + (lane & 15)][kh + (lane >> 4) * 4]);
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                u32 r[4];
                ldmatrix_x4(r, &xs[wn + 8 * j + (lane & 7) + (lane >> 4) * 8][kh + ((lane >> 3) & 1) * 4]);
                b[j][0] = r[0];
                b[j][1] = r[1];
                b[j + 1][0] = r[2];
                b[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < NT; j++) mma_16x8x16(acc[i][j], a[i], b[j]);
        }
        __syncthreads();
    }
    // Accumulator e of tile (i, j): row g (+8 for e >= 2), token 2q + (e & 1).
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const u32 r = r0 + wm + 16 * i + g + (e >= 2 ? 8 : 0);
                const u32 t = t0 + wn + 8 * j + 2 * q + (e & 1);
                if (r < rows && t < tokens) y[(size_t)t * rows + r] = acc[i][j][e];
            }
}
#endif

extern "C" __global__ void __launch_bounds__(256)
linear_mma64(const LinearParams* __restrict__ p, const u8* __restrict__ w, const float* __restrict__ x,
             float* __restrict__ y) {
#if __CUDA_ARCH__ >= 800
    linear_mma_tile<64, 64, false>(p, w, x, nullptr, y);
#endif
}
// The 128-row tiles ask for two blocks per multiprocessor (at most 128 registers a thread; 168
// without): one block left each multiprocessor waiting at every step's barriers, and a grid of
// 1.7 waves (ncu, 8B shape, 256 tokens). On an H100, synthetic 8B prefill at 512 tokens:
// 8,250-8,296 -> 8,749-8,777 tok/s, no spills.
extern "C" __global__ void __launch_bounds__(256, 2)
linear_mma128(const LinearParams* __restrict__ p, const u8* __restrict__ w, const float* __restrict__ x,
              float* __restrict__ y) {
#if __CUDA_ARCH__ >= 800
    linear_mma_tile<128, 64, false>(p, w, x, nullptr, y);
#endif
}
// 128 rows x 128 tokens: half the weight staging per product of the 64-token tile, for long
// prompts over large matrices (launch::tensor_core_linear).
extern "C" __global__ void __launch_bounds__(256, 2)
linear_mma128w(const LinearParams* __restrict__ p, const u8* __restrict__ w, const float* __restrict__ x,
               float* __restrict__ y) {
#if __CUDA_ARCH__ >= 800
    linear_mma_tile<128, 128, false>(p, w, x, nullptr, y);
#endif
}
// 64 rows x 128 tokens: the weight staging of the 128-token tile with twice the blocks, for
// products too small for enough 128 x 128 blocks (the 8B shape's 4096-row products at 512
// tokens: 256 blocks, 1.07x the prefill of 128 x 64 tiles on an H100).
extern "C" __global__ void __launch_bounds__(256, 2)
linear_mma64w(const LinearParams* __restrict__ p, const u8* __restrict__ w, const float* __restrict__ x,
              float* __restrict__ y) {
#if __CUDA_ARCH__ >= 800
    linear_mma_tile<64, 128, false>(p, w, x, nullptr, y);
#endif
}
extern "C" __global__ void __launch_bounds__(256, 2)
linear_mma64wh(const LinearParams* __restrict__ p, const u8* __restrict__ w, const float* __restrict__ x,
               float* __restrict__ y, const u32* __restrict__ xh) {
#if __CUDA_ARCH__ >= 800
    linear_mma_tile<64, 128, true>(p, w, x, xh, y);
#endif
}
// The two 128-row tiles over f16 activations in the backend's staging buffer
// (launch::f16_activations).
extern "C" __global__ void __launch_bounds__(256, 2)
linear_mma128h(const LinearParams* __restrict__ p, const u8* __restrict__ w, const float* __restrict__ x,
               float* __restrict__ y, const u32* __restrict__ xh) {
#if __CUDA_ARCH__ >= 800
    linear_mma_tile<128, 64, true>(p, w, x, xh, y);
#endif
}
extern "C" __global__ void __launch_bounds__(256, 2)
linear_mma128wh(const LinearParams* __restrict__ p, const u8* __restrict__ w, const float* __restrict__ x,
                float* __restrict__ y, const u32* __restrict__ xh) {
#if __CUDA_ARCH__ >= 800
    linear_mma_tile<128, 128, true>(p, w, x, xh, y);
#endif
}

// out[t] = row ids[t] of the table, or zeros for ids at or past vocab: grid (dim / 256, tokens).
extern "C" __global__ void __launch_bounds__(256)
embed(const EmbedParams* __restrict__ p, const u8* __restrict__ table, const u32* __restrict__ ids,
      float* __restrict__ out) {
    const u32 dim = p->dim, vocab = p->vocab, row_bytes = p->row_bytes;
    const u32 c = blockIdx.x * 256 + threadIdx.x, t = blockIdx.y;
    if (c >= dim) return;
    const u32 id = ids[t];
    out[(size_t)t * dim + c] = id < vocab ? w_elem(table + (size_t)id * row_bytes, c) : 0.0f;
}

// ---- Fused matrix-vector products (decode) ----------------------------------------------
// One launch for what a decode step does around its matrix-vector products: an optional RMS
// norm of the activations on the way in, up to three matrices that read the same activations
// (q, k and v), and an epilogue: rope on any of them and their copies into the KV cache, or a
// residual add, or silu(gate) * up (the `linear_glu*` entries, which give each block 4 rows of
// both matrices). fuse.rs fuses only op sequences whose results this reproduces exactly, every
// intermediate buffer included: the norm's output is still written (by the first block of each
// token), and so are q, k, v, gate and up.
//
// Parameters: FusedLinearParams (common.cuh): the rows of matrices 0, 1 and 2, cols, tokens,
// row_bytes, flags, the norm's eps, the rope (pos0, freq_base, head_dim, rope_dim), then the
// KV cache offsets (words) of matrices 0, 1 and 2.
// Buffers: x, norm weight, norm output, w0, y0, w1, y1, w2, y2, aux0, aux1, aux2 (unused ones
// point at x and are never written). FUSE_RESID: out (aux1) = a (aux0) + y0. GLU: aux0 =
// silu(y0) * y1. FUSE_CACHE << m: aux_m also receives matrix m's output, at word cache_m.
// Dynamic shared memory: cols floats with FUSE_NORM, else none.
#define FUSE_NORM 1u
#define FUSE_RESID 2u
#define FUSE_ROPE 4u    // << m, for m = 0, 1, 2
#define FUSE_CACHE 32u  // << m

#define FUSED_ARGS                                                                              \
    const FusedLinearParams *__restrict__ p, const float *x, const float *__restrict__ nw,      \
        float *xn, const u8 *__restrict__ w0, float *y0, const u8 *__restrict__ w1, float *y1, \
        const u8 *__restrict__ w2, float *y2, float *aux0, float *aux1, float *aux2
#define FUSED_PASS p, x, nw, xn, w0, y0, w1, y1, w2, y2, aux0, aux1, aux2

// The activations this block multiplies: row t of x as it is, or normalized into shared memory
// (same expression order as the rmsnorm kernel) and, by the token's first block, into xn. In
// one pass: each thread keeps its float4s of x and of the weight in registers (rows of up to
// 4096 floats; longer rows load theirs again), so a block waits on one round of loads.
// fuse.rs fuses a norm only when cols is a multiple of 4.
#define STAGE_REGS 4
__device__ __forceinline__ const float* fused_x(const FusedLinearParams* p, const float* x,
                                                const float* nw, float* xn, float* stage,
                                                float* red) {
    const u32 cols = p->cols, t = blockIdx.y;
    const float* xt = x + (size_t)t * cols;
    if (!(p->flags & FUSE_NORM)) return xt;
    const u32 n4 = cols >> 2;
    const float4* x4 = reinterpret_cast<const float4*>(xt);
    const float4* g4 = reinterpret_cast<const float4*>(nw);
    float4 xv[STAGE_REGS], gv[STAGE_REGS];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < STAGE_REGS; k++) {
        const u32 c = threadIdx.x + k * blockDim.x;
        if (c < n4) {
            xv[k] = x4[c];
            gv[k] = g4[c];
        } else {
            xv[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            gv[k] = xv[k];
        }
    }
#pragma unroll
    for (int k = 0; k < STAGE_REGS; k++)
        ss += xv[k].x * xv[k].x + xv[k].y * xv[k].y + xv[k].z * xv[k].z + xv[k].w * xv[k].w;
    for (u32 c = threadIdx.x + STAGE_REGS * blockDim.x; c < n4; c += blockDim.x) {
        const float4 v = x4[c];
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(ss / (float)cols + p->eps);
    float4* s4 = reinterpret_cast<float4*>(stage);
    float4* n4out = reinterpret_cast<float4*>(xn + (size_t)t * cols);
    const bool first = blockIdx.x == 0;
#pragma unroll
    for (int k = 0; k < STAGE_REGS; k++) {
        const u32 c = threadIdx.x + k * blockDim.x;
        if (c < n4) {
            const float4 v = make_float4(xv[k].x * scale * gv[k].x, xv[k].y * scale * gv[k].y,
                                         xv[k].z * scale * gv[k].z, xv[k].w * scale * gv[k].w);
            s4[c] = v;
            if (first) n4out[c] = v;
        }
    }
    for (u32 c = threadIdx.x + STAGE_REGS * blockDim.x; c < n4; c += blockDim.x) {
        const float4 xx = x4[c], g = g4[c];
        const float4 v = make_float4(xx.x * scale * g.x, xx.y * scale * g.y, xx.z * scale * g.z,
                                     xx.w * scale * g.w);
        s4[c] = v;
        if (first) n4out[c] = v;
    }
    __syncthreads();
    return stage;
}

// Run by threads 0..7 (lanes of warp 0) together, slot r = threadIdx.x holding its row's sum.
template <bool GLU>
__device__ __forceinline__ void fused_epilogue(const FusedLinearParams* p, u32 m, u32 rows,
                                               u32 row0, float s, float* y0, float* y1,
                                               float* y2, float* aux0, float* aux1,
                                               float* aux2) {
    const u32 r = threadIdx.x, t = blockIdx.y, flags = p->flags;
    if (GLU) {
        // Slots 0..3 are gate rows, 4..7 the same rows of up.
        const float other = __shfl_xor_sync(0xffu, s, 4);
        const u32 row = row0 + (r & 3);
        if (row >= rows) return;
        const size_t i = (size_t)t * rows + row;
        if (r < 4) {
            y0[i] = s;
            aux0[i] = s / (1.0f + expf(-s)) * other;
        } else {
            y1[i] = s;
        }
        return;
    }
    float v = s;
    if (flags & (FUSE_ROPE << m)) {
        // Adjacent pairs (2i, 2i + 1) of a head: rows row0 + r and row0 + (r ^ 1), as row0 is a
        // multiple of 8 and head_dim is even. Same expression order as the rope kernel.
        const float other = __shfl_xor_sync(0xffu, s, 1);
        const u32 hd = p->head_dim, rd = p->rope_dim;
        const u32 j = (row0 + r) % hd;
        if (j < rd) {
            const float pos = (float)(p->pos0 + t);
            const float theta = pos * powf(p->freq_base, (-2.0f * (float)(j >> 1)) / (float)rd);
            float sn, cs;
            sincosf(theta, &sn, &cs);
            v = (j & 1) ? other * sn + s * cs : s * cs - other * sn;
        }
    }
    const u32 row = row0 + r;
    if (row >= rows) return;
    const size_t i = (size_t)t * rows + row;
    float* y = m == 0 ? y0 : (m == 1 ? y1 : y2);
    y[i] = v;
    if (flags & (FUSE_CACHE << m)) {
        float* c = m == 0 ? aux0 : (m == 1 ? aux1 : aux2);
        const u32 at = m == 0 ? p->cache0 : (m == 1 ? p->cache1 : p->cache2);
        c[at + i] = v;
    }
    if (flags & FUSE_RESID) aux1[i] = aux0[i] + v;
}

// Blocks loop over the row groups (8 rows of one matrix, or 4 rows of gate and up), so a
// grid sized to the device stages the normalized activations once per block, not per group.
template <bool SPLIT, bool GLU>
__device__ __forceinline__ void linear_fused_body(FUSED_ARGS) {
    extern __shared__ float stage[];
    __shared__ float part[8][MATVEC_ROWS];
    __shared__ float red[32];
    const u32 cols = p->cols, row_bytes = p->row_bytes;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* xs = fused_x(p, x, nw, xn, stage, red);
    const u32 steps = cols / SUB;
    const u32 per = GLU ? MATVEC_ROWS / 2 : MATVEC_ROWS;
    const u32 nb0 = (p->rows0 + per - 1) / per;
    const u32 nb1 = GLU ? 0 : (p->rows1 + MATVEC_ROWS - 1) / MATVEC_ROWS;
    const u32 nb2 = GLU ? 0 : (p->rows2 + MATVEC_ROWS - 1) / MATVEC_ROWS;
    for (u32 g = blockIdx.x; g < nb0 + nb1 + nb2; g += gridDim.x) {
        // The group's matrix and first row: matrix 0's groups first.
        u32 m = 0, rows = p->rows0, bx = g;
        const u8* wa = w0;
        if (bx >= nb0 + nb1) {
            m = 2;
            bx -= nb0 + nb1;
            rows = p->rows2;
            wa = w2;
        } else if (bx >= nb0) {
            m = 1;
            bx -= nb0;
            rows = p->rows1;
            wa = w1;
        }
        const u32 row0 = bx * per;
        // Slots past the last row read the last row again and are not written.
        const u32 last = rows - 1 - row0;
        if (SPLIT) {
            const u8* pa = wa + (size_t)row0 * row_bytes;
            const u8* pb = GLU ? w1 + (size_t)row0 * row_bytes : pa;
            u32 off[MATVEC_ROWS];
            float acc[MATVEC_ROWS];
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; r++) {
                off[r] = min((u32)(GLU ? (r & 3) : r), last) * row_bytes;
                acc[r] = 0.0f;
            }
#pragma unroll 4
            for (u32 i = threadIdx.x; i < steps; i += 256) {
                const SPLIT_XS xv = split_load_x(xs, i);
#pragma unroll
                for (int r = 0; r < MATVEC_ROWS; r++)
                    acc[r] += split_row_dot((GLU && r >= 4 ? pb : pa) + off[r], i, xv);
            }
#pragma unroll
            for (int r = 0; r < MATVEC_ROWS; r++) {
                const float s = warp_sum(acc[r]);
                if (lane == 0) part[warp][r] = s;
            }
        } else {
            const u32 slot = warp;
            const u8* base = (GLU && slot >= 4) ? w1 : wa;
            const u8* wr = base + (size_t)(row0 + min(GLU ? (slot & 3) : slot, last)) * row_bytes;
            float s0 = 0.0f, s1 = 0.0f;
            u32 i = lane;
            for (; i + 32 < steps; i += 64) {
                s0 += row_dot(wr, i, load_x(xs, i));
                s1 += row_dot(wr, i + 32, load_x(xs, i + 32));
            }
            if (i < steps) s0 += row_dot(wr, i, load_x(xs, i));
            const float s = warp_sum(s0 + s1);
            if (lane == 0) part[0][slot] = s;
        }
        __syncthreads();
        if (threadIdx.x < MATVEC_ROWS) {
            float s;
            if (SPLIT) {
                s = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; k++) s += part[k][threadIdx.x];
            } else {
                s = part[0][threadIdx.x];
            }
            fused_epilogue<GLU>(p, m, rows, row0, s, y0, y1, y2, aux0, aux1, aux2);
        }
        __syncthreads();  // the epilogue has read `part` before the next group writes it
    }
}

extern "C" __global__ void __launch_bounds__(256) linear_fused(FUSED_ARGS) {
    linear_fused_body<false, false>(FUSED_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 4) linear_fused_split(FUSED_ARGS) {
    linear_fused_body<true, false>(FUSED_PASS);
}
extern "C" __global__ void __launch_bounds__(256) linear_glu(FUSED_ARGS) {
    linear_fused_body<false, true>(FUSED_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 4) linear_glu_split(FUSED_ARGS) {
    linear_fused_body<true, true>(FUSED_PASS);
}

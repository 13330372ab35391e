// Kernels that read weights in one GGML format. The Rust side prepends common.cuh and one
// format header (f32.cuh, f16.cuh, q8_0.cuh, q4_0.cuh, q4_1.cuh), which define SUB (elements
// per lane step), XS (a step's activations, loaded once for every row that uses them), load_x,
// row_dot (one row's step against XS) and w_elem (one element of a row).

#define MATVEC_ROWS 8  // rows per block of 256 threads, in both matrix-vector kernels

// y[t, r] = sum_c w[r, c] * x[t, c] for small token counts and short rows: grid (rows / 8,
// tokens), one warp per row. P: rows, cols, tokens, row_bytes.
extern "C" __global__ void __launch_bounds__(256)
linear_matvec(const u32* __restrict__ P, const u8* __restrict__ w, const float* __restrict__ x,
              float* __restrict__ y) {
    const u32 rows = P[0], cols = P[1], row_bytes = P[3];
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
linear_matvec_split(const u32* __restrict__ P, const u8* __restrict__ w,
                    const float* __restrict__ x, float* __restrict__ y) {
    __shared__ float part[8][MATVEC_ROWS];
    const u32 rows = P[0], cols = P[1], row_bytes = P[3];
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
        const XS xs = load_x(xt, i);
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS; r++) acc[r] += row_dot(w0 + off[r], i, xs);
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

// The same product for many tokens: 64 rows x 64 tokens per block, weights dequantized into
// shared memory 32 columns at a time, 4x4 outputs per thread. P: rows, cols, tokens, row_bytes.
#define MM_T 64
#define MM_K 32
extern "C" __global__ void __launch_bounds__(256)
linear_matmat(const u32* __restrict__ P, const u8* __restrict__ w, const float* __restrict__ x,
              float* __restrict__ y) {
    __shared__ float ws[MM_K][MM_T + 1];
    __shared__ float xs[MM_K][MM_T + 1];
    const u32 rows = P[0], cols = P[1], tokens = P[2], row_bytes = P[3];
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

// out[t] = row ids[t] of the table, or zeros for ids at or past vocab: grid (dim / 256, tokens).
// P: dim, vocab, tokens, row_bytes.
extern "C" __global__ void __launch_bounds__(256)
embed(const u32* __restrict__ P, const u8* __restrict__ table, const u32* __restrict__ ids,
      float* __restrict__ out) {
    const u32 dim = P[0], vocab = P[1], row_bytes = P[3];
    const u32 c = blockIdx.x * 256 + threadIdx.x, t = blockIdx.y;
    if (c >= dim) return;
    const u32 id = ids[t];
    out[(size_t)t * dim + c] = id < vocab ? w_elem(table + (size_t)id * row_bytes, c) : 0.0f;
}

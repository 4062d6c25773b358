/* Weight-only int8 matrix products for a few rows: y = x (scale * q)^T, the lower tiers' projections.
 *
 * A decode step of the retrieval tier multiplies one activation row (a proposal block: up to gamma + 1 rows) by
 * every int8 weight matrix, so it is bound by the bytes of the weights: one byte per weight, a quarter of fp32's.
 * Over SmolLM2's 135 MB of int8 weights, read from memory as a decode step reads them, PyTorch's
 * aten._weight_int8pack_mm (bf16 activations) ran at 10.7 GB/s for one row and 4.3 GB/s for seven on this project's
 * 2-core machine, against 25 GB/s for MKL's fp32 GEMV (bench/qlinear.py); this kernel streams each weight row once
 * for all M activation rows, prefetches a few rows ahead, dequantises 16 weights per AVX-512 vector
 * (int8 -> int32 -> fp32) and accumulates in fp32 (the scheme of gpt-fast's and torchao's int8 weight-only matmul: one scale per output
 * channel, applied after the dot product):
 *
 *     y[m, o] = scale[o] * sum_i x[m, i] q[o, i]          q: (out, in) int8, scale: (out,) fp32, x: (M, in) fp32
 *
 * Each output's sum is taken in the same order (16 lanes along i, then the lanes) whatever M and whatever the other
 * rows, so a row's result does not depend on the rows beside it. Built at first use by triforce/kernels.py with
 * -O3 -mavx512f -mavx512bw -mavx512vl -fopenmp; the Python side checks every precondition below before calling.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define MAX_ROWS 16
#define OUT_BLOCK 4  /* outputs per inner step: each x vector is loaded once for 4 weight rows */
#define ROW_BLOCK 4  /* activation rows per inner step: 4 x 4 accumulators stay in registers */
#define PREFETCH_ROWS 16  /* weight rows ahead that each inner step prefetches (9 KB of int8, 36 KB of fp32 at in = 576) */

/* The weights' element types: how 16 weights of row o at input i become a fp32 vector, and a masked tail of them. */
#define LOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p))))
#define LOAD_I8_TAIL(k, p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((k), (p))))

/* y[m, o0 : o0 + no) for M rows (M <= ROW_BLOCK, a constant after inlining; no <= OUT_BLOCK).
 * WT: the weight element type, LOAD / LOAD_TAIL: its loaders, LINE: weights per 64-byte cache line. */
#define OUT_BLOCK_FN(NAME, WT, LOAD, LOAD_TAIL, LINE)                                                               \
static inline __attribute__((always_inline)) void NAME(const float* x, const int M, int in, const WT* w,           \
                                                       const float* scale, int o0, int no, int out, float* y) {   \
    __m512 acc[OUT_BLOCK][ROW_BLOCK];                                                                             \
    for (int u = 0; u < no; ++u)                                                                                  \
        for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();                                              \
    const int ahead = o0 + no + PREFETCH_ROWS <= out;  /* prefetch only inside the matrix */                       \
    int i = 0;                                                                                                    \
    for (; i + 16 <= in; i += 16) {                                                                               \
        __m512 wv[OUT_BLOCK];                                                                                     \
        if (ahead && (i % (LINE)) == 0) /* a line PREFETCH_ROWS rows ahead: enough loads in flight for DRAM */    \
            for (int u = 0; u < no; ++u)                                                                          \
                _mm_prefetch((const char*)(w + (int64_t)(o0 + u + PREFETCH_ROWS) * in + i), _MM_HINT_T0);          \
        for (int u = 0; u < no; ++u) wv[u] = LOAD(w + (int64_t)(o0 + u) * in + i);                                \
        for (int m = 0; m < M; ++m) {                                                                             \
            const __m512 xv = _mm512_loadu_ps(x + (int64_t)m * in + i);                                           \
            for (int u = 0; u < no; ++u) acc[u][m] = _mm512_fmadd_ps(xv, wv[u], acc[u][m]);                       \
        }                                                                                                         \
    }                                                                                                             \
    if (i < in) {  /* the last in % 16 inputs, masked */                                                          \
        const __mmask16 k = (__mmask16)((1u << (in - i)) - 1);                                                    \
        __m512 wv[OUT_BLOCK];                                                                                     \
        for (int u = 0; u < no; ++u) wv[u] = LOAD_TAIL(k, w + (int64_t)(o0 + u) * in + i);                        \
        for (int m = 0; m < M; ++m) {                                                                             \
            const __m512 xv = _mm512_maskz_loadu_ps(k, x + (int64_t)m * in + i);                                  \
            for (int u = 0; u < no; ++u) acc[u][m] = _mm512_fmadd_ps(xv, wv[u], acc[u][m]);                       \
        }                                                                                                         \
    }                                                                                                             \
    for (int u = 0; u < no; ++u)                                                                                  \
        for (int m = 0; m < M; ++m) {                                                                             \
            const float sum = _mm512_reduce_add_ps(acc[u][m]);                                                    \
            y[(int64_t)m * out + o0 + u] = scale[o0 + u] * sum;                                                   \
        }                                                                                                         \
}

OUT_BLOCK_FN(block_i8, int8_t, LOAD_I8, LOAD_I8_TAIL, 64)

/* All output blocks, split over the threads; rows past the first ROW_BLOCK re-read a block's weights from L1. */
#define LINEAR_FN(NAME, WT, BLOCK)                                                                                \
int NAME(const float* x, const WT* w, const float* scale, float* y, int M, int in, int out, int nthreads) {     \
    if (M < 1 || M > MAX_ROWS || in < 1 || out < 1 || nthreads < 1)                                               \
        return -1;                                                                                                \
    const int blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;                                                         \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                                            \
    for (int b = 0; b < blocks; ++b) {                                                                            \
        const int o0 = b * OUT_BLOCK, no = out - o0 < OUT_BLOCK ? out - o0 : OUT_BLOCK;                           \
        for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {                                                               \
            const float* xm = x + (int64_t)m0 * in;                                                               \
            float* ym = y + (int64_t)m0 * out;                                                                    \
            switch (M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK) {                                                    \
                case 4: BLOCK(xm, 4, in, w, scale, o0, no, out, ym); break;                                       \
                case 3: BLOCK(xm, 3, in, w, scale, o0, no, out, ym); break;                                       \
                case 2: BLOCK(xm, 2, in, w, scale, o0, no, out, ym); break;                                       \
                default: BLOCK(xm, 1, in, w, scale, o0, no, out, ym); break;                                      \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
    return 0;                                                                                                     \
}

/* x: (M, in) fp32 contiguous, q: (out, in) int8 contiguous, scale: (out,) fp32, y: (M, out) fp32.
 * Returns 0, or -1 for arguments outside what the kernel handles (nothing written). */
LINEAR_FN(triforce_int8_linear, int8_t, block_i8)

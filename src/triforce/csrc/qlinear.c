/* Matrix products for a few activation rows: weight-only int8, y = x (scale * q)^T (the lower tiers' projections),
 * and fp32 with the weights stored (in, out), y = x W (the verifier's verification blocks and batched steps).
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


/* fp32, weights (in, out) as triforce.model.Linear stores them: y[m, o] = sum_i x[m, i] w[i, o].
 *
 * A verification block (gamma + 1 rows) or a batched decode step (one row per sequence) reads every weight matrix
 * once for a few rows, so it should cost what a one-row product costs: the bytes of the weights. oneDNN's packed
 * product read SmolLM2's matrices at 9-15 GB/s for 4-7 rows on this project's CPU, against about 20 GB/s for one row
 * (bench/qlinear.py). Here the output columns are split into blocks of 4 vectors (64 floats; 2 where a matrix has
 * too few blocks for the threads); a block's accumulators for 7 rows stay in registers while the rows i of its
 * weights stream past, each vector of weights loaded once for all 7 rows, every x[m, i] broadcast. More rows take
 * further passes over a tile of F_TILE weight rows while it is still in L1, the accumulators kept in y between
 * tiles. The weight rows F_AHEAD ahead are prefetched, since the stride between rows (out floats) defeats the
 * hardware's prefetchers, and the last pass over a tile prefetches the next one. No horizontal sums: y[m, o] is one chain of FMAs over i = 0 .. in-1 in a lane, whatever M
 * and the other rows, so a row's product is bitwise the same alone and in a block. */
#define F_ROWS 7     /* activation rows per pass: 7 x 4 accumulators */
#define F_TILE 64    /* weight rows per tile when several passes share it (16 KB of a 64-float column block) */
#define F_AHEAD 16   /* weight rows ahead that each step prefetches */

/* y[m, o0 : o0 + 16 NV) += sum_{i0 <= i < i1} x[m, i] w[i, o0 : ...) for M (<= F_ROWS) rows, from zero if i0 == 0;
 * each step prefetches the weight row `ahead` rows on (none if 0) */
static inline __attribute__((always_inline)) void colblock_f32(const float* x, const int M, int in, int i0, int i1,
                                                               int ahead, const float* w, int out, int o0,
                                                               const int NV, float* y) {
    __m512 acc[F_ROWS][4];
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < NV; ++c)
            acc[m][c] = i0 ? _mm512_loadu_ps(y + (int64_t)m * out + o0 + 16 * c) : _mm512_setzero_ps();
    const float* wi = w + (int64_t)i0 * out + o0;
    for (int i = i0; i < i1; ++i, wi += out) {
        if (ahead && i + ahead < in)
            for (int c = 0; c < NV; ++c) _mm_prefetch((const char*)(wi + (int64_t)ahead * out + 16 * c), _MM_HINT_T2);
        __m512 wv[4];
        for (int c = 0; c < NV; ++c) wv[c] = _mm512_loadu_ps(wi + 16 * c);
        for (int m = 0; m < M; ++m) {
            const __m512 xb = _mm512_set1_ps(x[(int64_t)m * in + i]);
            for (int c = 0; c < NV; ++c) acc[m][c] = _mm512_fmadd_ps(xb, wv[c], acc[m][c]);
        }
    }
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(y + (int64_t)m * out + o0 + 16 * c, acc[m][c]);
}

#define F_CASE(NV, MM) case MM: colblock_f32(xm, MM, in, i0, i1, ahead, w, out, o0, NV, ym); break;
#define F_CASES(NV) F_CASE(NV, 1) F_CASE(NV, 2) F_CASE(NV, 3) F_CASE(NV, 4) F_CASE(NV, 5) F_CASE(NV, 6) F_CASE(NV, 7)

/* x: (M, in) fp32 contiguous, w: (in, out) fp32 contiguous, y: (M, out) fp32; out a multiple of 16.
 * Returns 0, or -1 for arguments outside what the kernel handles (nothing written). */
int triforce_f32_linear(const float* x, const float* w, float* y, int M, int in, int out, int nthreads) {
    if (M < 1 || M > MAX_ROWS || in < 1 || out < 16 || out % 16 || nthreads < 1)
        return -1;
    const int width = out / 64 >= 4 * nthreads ? 64 : 32;  /* floats per column block */
    const int blocks = (out + width - 1) / width, tile = M <= F_ROWS ? in : F_TILE;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int b = 0; b < blocks; ++b) {
        const int o0 = b * width, nv = (out - o0 < width ? out - o0 : width) / 16;
        for (int i0 = 0; i0 < in; i0 += tile) {
            const int i1 = in - i0 < tile ? in : i0 + tile;
            for (int m0 = 0; m0 < M; m0 += F_ROWS) {
                /* the first pass streams the tile, the last one the next tile while the memory is otherwise idle */
                const int ahead = m0 == 0 ? F_AHEAD : m0 + F_ROWS >= M ? tile : 0;
                const float* xm = x + (int64_t)m0 * in;
                float* ym = y + (int64_t)m0 * out;
                switch (nv) {
                    case 4: switch (M - m0 < F_ROWS ? M - m0 : F_ROWS) { F_CASES(4) } break;
                    case 3: switch (M - m0 < F_ROWS ? M - m0 : F_ROWS) { F_CASES(3) } break;
                    case 2: switch (M - m0 < F_ROWS ? M - m0 : F_ROWS) { F_CASES(2) } break;
                    default: switch (M - m0 < F_ROWS ? M - m0 : F_ROWS) { F_CASES(1) } break;
                }
            }
        }
    }
    return 0;
}

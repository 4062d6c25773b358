/* Matrix products for a few activation rows: weight-only int8, y = x (scale * q)^T (the lower tiers' projections),
 * and fp32 with the weights stored (in, out), y = x W (the verifier's verification blocks and batched steps).
 *
 * A decode step of the retrieval tier multiplies one activation row (a proposal block: up to gamma + 1 rows) by
 * every int8 weight matrix, so it is bound by the bytes of the weights: one byte per weight, a quarter of fp32's.
 * Over SmolLM2's 135 MB of int8 weights, read from memory as a decode step reads them, PyTorch's
 * aten._weight_int8pack_mm (bf16 activations) ran at 10.7 GB/s for one row and 4.3 GB/s for seven on this project's
 * 2-core machine, against 25 GB/s for MKL's fp32 GEMV (bench/kernels/qlinear.py); this kernel streams each weight row once
 * for all M activation rows, prefetches a few rows ahead, dequantises 16 weights per AVX-512 vector
 * (int8 -> int32 -> fp32) and accumulates in fp32 (the scheme of gpt-fast's and torchao's int8 weight-only matmul: one scale per output
 * channel, applied after the dot product):
 *
 *     y[m, o] = scale[o] * sum_i x[m, i] q[o, i]          q: (out, in) int8, scale: (out,) fp32, x: (M, in) fp32
 *
 * Each output's sum is taken in the same order (16 lanes along i, then the lanes) whatever M and whatever the other
 * rows, so a row's result does not depend on the rows beside it. Built at first use by triforce/kernels.py with
 * -O3 -mavx512f -mavx512bw -mavx512vl -fopenmp where the CPU has AVX-512, else with -O3 -mavx2 -mfma -fopenmp: the
 * same two kernels on 8-lane vectors (the AVX2 branch below), and with no ISA flags at all on a CPU with neither (or
 * another architecture: aarch64): the portable branch at the end, plain C loops the compiler vectorises, with the same
 * row-independence. The Python side checks every precondition below before calling.
 */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define MAX_ROWS 64  /* the most activation rows per call: a batch of 8 sequences verifying 7 tokens each is 56 */
/* the most rows of one fp32 call: each row's sums run in the same order for any M, so the verifier's batches past
 * MAX_ROWS rows (triforce/exact.py) take one pass over the weights instead of one per 64 rows */
#define F32_MAX_ROWS 1024

/* The fp32 product's last out % 16 columns (an output width that is not a multiple of 16: an LM head over a 32,001-
 * token vocabulary), y[m, o] for o0 <= o < out: one fmaf chain over i = 0 .. in-1 per output, from +0, which is what a
 * vector lane of the column blocks computes (a fused multiply-add rounds once, in a lane as in fmaf), so these columns
 * too are bitwise the same whatever M and the other rows. Strided reads of at most 15 columns: negligible beside the
 * other columns' product. */
#if defined(__AVX2__)
static void f32_tail_columns(const float* x, const float* w, float* y, int M, int in, int out, int o0) {
    for (int m = 0; m < M; ++m)
        for (int o = o0; o < out; ++o) {
            float acc = 0.f;
            for (int i = 0; i < in; ++i) acc = fmaf(x[(int64_t)m * in + i], w[(int64_t)i * out + o], acc);
            y[(int64_t)m * out + o] = acc;
        }
}
#endif

#if defined(__AVX512F__)

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


/* fp32, weights (in, out) as triforce.model.transformer.Linear stores them: y[m, o] = sum_i x[m, i] w[i, o].
 *
 * A verification block (gamma + 1 rows) or a batched decode step (one row per sequence) reads every weight matrix
 * once for a few rows, so it should cost what a one-row product costs: the bytes of the weights. oneDNN's packed
 * product read SmolLM2's matrices at 9-15 GB/s for 4-7 rows on this project's CPU, against about 20 GB/s for one row
 * (bench/kernels/qlinear.py). Here the output columns are split into blocks of 4 vectors (64 floats; 2 where a matrix has
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

/* x: (M, in) fp32 contiguous, w: (in, out) fp32 contiguous, y: (M, out) fp32; the columns past the last multiple of
 * 16 by f32_tail_columns. Returns 0, or -1 for arguments outside what the kernel handles (nothing written). */
int triforce_f32_linear(const float* x, const float* w, float* y, int M, int in, int out, int nthreads) {
    if (M < 1 || M > F32_MAX_ROWS || in < 1 || out < 1 || nthreads < 1)
        return -1;
    const int out16 = out - out % 16;  /* the columns of whole vectors; out stays the stride of w and y */
    const int width = out16 / 64 >= 4 * nthreads ? 64 : 32;  /* floats per column block */
    const int blocks = (out16 + width - 1) / width, tile = M <= F_ROWS ? in : F_TILE;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int b = 0; b < blocks; ++b) {
        const int o0 = b * width, nv = (out16 - o0 < width ? out16 - o0 : width) / 16;
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
    if (out16 < out) f32_tail_columns(x, w, y, M, in, out, out16);
    return 0;
}

#elif defined(__AVX2__)  /* AVX2 + FMA: 16 registers of 8 floats */

/* The int8 kernel on 8 lanes: 1 output x 4 rows per inner step (the dequantised weight vector reused for 4 rows),
 * the weight rows PREFETCH_ROWS ahead prefetched; each output is 8 lanes along i, then the lanes summed in one fixed
 * order, then the last in % 8 inputs in order: the same whatever M and the other rows. On an AVX2 EPYC over
 * SmolLM2's weights (bench/kernels/qlinear.py), 1 output per step read them at 7.4 / 7.0 / 3.4 / 3.2 GB/s for 1 / 2 / 5 / 7
 * rows where 2 outputs per step read 7.9 / 6.4 / 2.9 / 2.5 (aten's bf16 int8 product: 6.4 / 5.5 / 1.9 / 1.9). */
#ifndef OUT_BLOCK
#define OUT_BLOCK 1
#endif
#ifndef ROW_BLOCK
#define ROW_BLOCK 4
#endif
/* One row (a lower tier's decode step) takes ONE_ROW_OUT outputs per step instead: with a single output its
 * accumulator is one chain of dependent FMAs, latency-bound (on an AVX2 EPYC it was behind aten's int8 product; with
 * 4 chains Qwen2.5-1.5B's 1.78 GB of int8 weights take 123.4 ms against aten's 199.9,
 * bench/results/qlinear_qwen1.5b_avx2_cpu.json). Each output keeps its own chain
 * over i in the same order, so the results are bitwise those of one output per step. */
#ifndef ONE_ROW_OUT
#define ONE_ROW_OUT 4
#endif
#define ACC_OUT (OUT_BLOCK > ONE_ROW_OUT ? OUT_BLOCK : ONE_ROW_OUT)
#define PREFETCH_ROWS 16

static inline __m256 load_i8x8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static inline float hsum8(__m256 v) {  /* ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __attribute__((always_inline)) void block_i8(const float* x, const int M, int in, const int8_t* w,
                                                           const float* scale, int o0, const int no, int out, float* y) {
    __m256 acc[ACC_OUT][ROW_BLOCK];
    for (int u = 0; u < no; ++u)
        for (int m = 0; m < M; ++m) acc[u][m] = _mm256_setzero_ps();
    const int ahead = o0 + no + PREFETCH_ROWS <= out;
    int i = 0;
    for (; i + 8 <= in; i += 8) {
        if (ahead && (i % 64) == 0)
            for (int u = 0; u < no; ++u)
                _mm_prefetch((const char*)(w + (int64_t)(o0 + u + PREFETCH_ROWS) * in + i), _MM_HINT_T0);
        __m256 wv[ACC_OUT];
        for (int u = 0; u < no; ++u) wv[u] = load_i8x8(w + (int64_t)(o0 + u) * in + i);
        for (int m = 0; m < M; ++m) {
            const __m256 xv = _mm256_loadu_ps(x + (int64_t)m * in + i);
            for (int u = 0; u < no; ++u) acc[u][m] = _mm256_fmadd_ps(xv, wv[u], acc[u][m]);
        }
    }
    for (int u = 0; u < no; ++u)
        for (int m = 0; m < M; ++m) {
            float sum = hsum8(acc[u][m]);
            for (int j = i; j < in; ++j) sum += x[(int64_t)m * in + j] * (float)w[(int64_t)(o0 + u) * in + j];
            y[(int64_t)m * out + o0 + u] = scale[o0 + u] * sum;
        }
}

int triforce_int8_linear(const float* x, const int8_t* w, const float* scale, float* y, int M, int in, int out,
                         int nthreads) {
    if (M < 1 || M > MAX_ROWS || in < 1 || out < 1 || nthreads < 1)
        return -1;
    if (M == 1) {  /* ONE_ROW_OUT independent chains */
        const int blocks1 = (out + ONE_ROW_OUT - 1) / ONE_ROW_OUT;
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int b = 0; b < blocks1; ++b) {
            const int o0 = b * ONE_ROW_OUT;
            if (out - o0 >= ONE_ROW_OUT) block_i8(x, 1, in, w, scale, o0, ONE_ROW_OUT, out, y);
            else for (int o = o0; o < out; ++o) block_i8(x, 1, in, w, scale, o, 1, out, y);
        }
        return 0;
    }
    const int blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int b = 0; b < blocks; ++b) {
        const int o0 = b * OUT_BLOCK, no = out - o0 < OUT_BLOCK ? out - o0 : OUT_BLOCK;
        for (int m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const float* xm = x + (int64_t)m0 * in;
            float* ym = y + (int64_t)m0 * out;
            switch (M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK) {
#if ROW_BLOCK > 4
                case 6: block_i8(xm, 6, in, w, scale, o0, no, out, ym); break;
                case 5: block_i8(xm, 5, in, w, scale, o0, no, out, ym); break;
#endif
                case 4: block_i8(xm, 4, in, w, scale, o0, no, out, ym); break;
                case 3: block_i8(xm, 3, in, w, scale, o0, no, out, ym); break;
                case 2: block_i8(xm, 2, in, w, scale, o0, no, out, ym); break;
                default: block_i8(xm, 1, in, w, scale, o0, no, out, ym); break;
            }
        }
    }
    return 0;
}

/* The fp32 kernel on 8 lanes: column blocks of 16 floats (one 64-byte line of each weight row), up to 8 rows per pass
 * (16 accumulators: the compiler takes the two weight vectors as memory operands of the FMAs, which the loads from L1
 * afford), the rows split evenly over the passes (a pass of one row would wait on its FMA chains' latency); later
 * passes over a tile of F_TILE weight rows find it in L1. As in the AVX-512 build, no horizontal sums: y[m, o] is one
 * chain of FMAs over i in a lane, whatever M. Over SmolLM2's matrices on an AVX2 EPYC (bench/kernels/qlinear.py), 8 rows per
 * pass read the weights at 10.4 GB/s for 7 rows where 6 rows per pass (4 + 3, 128-row tiles) read them at 7.0, and
 * 32-row tiles beat 128-row ones for 8 rows (9.7 against 7.3 GB/s). One row read 11.2 GB/s against MKL's GEMV's
 * 14.3, so this build leaves decode steps to MKL (kernels.f32_one_row_pays). */
#ifndef F_ROWS
#define F_ROWS 8
#endif
#ifndef F_TILE
#define F_TILE 32    /* weight rows per tile when several passes share it (2 KB of a 16-float column block) */
#endif
#ifndef F_AHEAD
#define F_AHEAD 24   /* weight rows ahead that each step prefetches */
#endif

static inline __attribute__((always_inline)) void colblock_f32(const float* x, const int M, int in, int i0, int i1,
                                                               int ahead, const float* w, int out, int o0, float* y) {
    __m256 acc[F_ROWS][2];
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < 2; ++c)
            acc[m][c] = i0 ? _mm256_loadu_ps(y + (int64_t)m * out + o0 + 8 * c) : _mm256_setzero_ps();
    const float* wi = w + (int64_t)i0 * out + o0;
    for (int i = i0; i < i1; ++i, wi += out) {
        if (ahead && i + ahead < in) _mm_prefetch((const char*)(wi + (int64_t)ahead * out), _MM_HINT_T2);
        const __m256 w0 = _mm256_loadu_ps(wi), w1 = _mm256_loadu_ps(wi + 8);
        for (int m = 0; m < M; ++m) {
            const __m256 xb = _mm256_broadcast_ss(x + (int64_t)m * in + i);
            acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
        }
    }
    for (int m = 0; m < M; ++m)
        for (int c = 0; c < 2; ++c) _mm256_storeu_ps(y + (int64_t)m * out + o0 + 8 * c, acc[m][c]);
}

#define F_CASE(MM) case MM: colblock_f32(xm, MM, in, i0, i1, ahead, w, out, o0, ym); break;

/* x: (M, in) fp32 contiguous, w: (in, out) fp32 contiguous, y: (M, out) fp32; the columns past the last multiple of
 * 16 by f32_tail_columns. Returns 0, or -1 for arguments outside what the kernel handles (nothing written). */
int triforce_f32_linear(const float* x, const float* w, float* y, int M, int in, int out, int nthreads) {
    if (M < 1 || M > F32_MAX_ROWS || in < 1 || out < 1 || nthreads < 1)
        return -1;
    const int blocks = out / 16, passes = (M + F_ROWS - 1) / F_ROWS, tile = passes == 1 ? in : F_TILE;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int b = 0; b < blocks; ++b) {
        const int o0 = b * 16;
        for (int i0 = 0; i0 < in; i0 += tile) {
            const int i1 = in - i0 < tile ? in : i0 + tile;
            for (int p = 0, m0 = 0; p < passes; ++p) {
                const int rows = M / passes + (p < M % passes);
                /* the first pass streams the tile, the last one the next tile while the memory is otherwise idle */
                const int ahead = p == 0 ? F_AHEAD : p == passes - 1 ? tile : 0;
                const float* xm = x + (int64_t)m0 * in;
                float* ym = y + (int64_t)m0 * out;
                switch (rows) { F_CASE(1) F_CASE(2) F_CASE(3) F_CASE(4) F_CASE(5) F_CASE(6) F_CASE(7) F_CASE(8) }
                m0 += rows;
            }
        }
    }
    if (out % 16) f32_tail_columns(x, w, y, M, in, out, out - out % 16);
    return 0;
}

#else  /* portable: no ISA flags (a CPU with neither AVX2 nor AVX-512, or aarch64) */

#include "common.h"  /* MADD: the portable builds' multiply-add, the same in both kernels and in csrc/blockcodes.c */

#define P_LANES 8   /* the int8 kernel's partial sums: lane l takes inputs i = l mod 8 (the loop the compiler vectorises) */
#define P_COLS 64   /* the fp32 kernel's columns per work item: their accumulators, one per row, stay in L1 */
#define P_ROWS 4    /* activation rows per pass over a column block's weights */

/* y[m, o] = scale[o] (sum of 8 lane sums over i, lane l the chain over i = l mod 8 in order, then the lanes in a
 * fixed tree, then the last in % 8 inputs in order): the same order whatever M and the other rows */
int triforce_int8_linear(const float* x, const int8_t* w, const float* scale, float* y, int M, int in, int out,
                         int nthreads) {
    if (M < 1 || M > MAX_ROWS || in < 1 || out < 1 || nthreads < 1)
        return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int o = 0; o < out; ++o) {
        const int8_t* wo = w + (int64_t)o * in;
        for (int m = 0; m < M; ++m) {
            const float* xm = x + (int64_t)m * in;
            float acc[P_LANES] = {0};
            int i = 0;
            for (; i + P_LANES <= in; i += P_LANES)
                for (int l = 0; l < P_LANES; ++l) acc[l] = MADD(xm[i + l], (float)wo[i + l], acc[l]);
            for (int s = P_LANES / 2; s > 0; s /= 2)
                for (int l = 0; l < s; ++l) acc[l] += acc[l + s];
            float sum = acc[0];
            for (; i < in; ++i) sum = MADD(xm[i], (float)wo[i], sum);
            y[(int64_t)m * out + o] = scale[o] * sum;
        }
    }
    return 0;
}

/* y[m, o] = one MADD chain over i = 0 .. in-1 from +0, per output: the chain the AVX builds' lanes compute (bitwise
 * theirs where MADD is fmaf), whatever M and the other rows, any out (no tail columns: a work item is up to P_COLS
 * columns). The weight row's P_COLS columns are loaded once for P_ROWS rows. */
int triforce_f32_linear(const float* x, const float* w, float* y, int M, int in, int out, int nthreads) {
    if (M < 1 || M > F32_MAX_ROWS || in < 1 || out < 1 || nthreads < 1)
        return -1;
    const int blocks = (out + P_COLS - 1) / P_COLS;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int b = 0; b < blocks; ++b) {
        const int o0 = b * P_COLS, nc = out - o0 < P_COLS ? out - o0 : P_COLS;
        for (int m0 = 0; m0 < M; m0 += P_ROWS) {
            const int nr = M - m0 < P_ROWS ? M - m0 : P_ROWS;
            float acc[P_ROWS][P_COLS];
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < P_COLS; ++c) acc[r][c] = 0.f;
            for (int i = 0; i < in; ++i) {
                const float* wi = w + (int64_t)i * out + o0;
                for (int r = 0; r < nr; ++r) {
                    const float xv = x[(int64_t)(m0 + r) * in + i];
                    for (int c = 0; c < nc; ++c) acc[r][c] = MADD(xv, wi[c], acc[r][c]);
                }
            }
            for (int r = 0; r < nr; ++r)
                for (int c = 0; c < nc; ++c) y[(int64_t)(m0 + r) * out + o0 + c] = acc[r][c];
        }
    }
    return 0;
}

#endif

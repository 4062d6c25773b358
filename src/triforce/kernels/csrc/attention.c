/* Attention of a few query rows over a long fp32 (or bf16) KV cache, split over key chunks (flash-decoding).
 *
 * What a decode step (T = 1) and a verification block (T = gamma + 1) of the verifier run at every layer: the g*T
 * query rows of each KV head (grouped-query attention, g = nh / nkv) against that head's keys and values. PyTorch's
 * CPU SDPA reads the cache at 6-7 GB/s on one core of this project's machine and parallelises over heads only (3 KV
 * heads on 2 threads for SmolLM2); this kernel streams each key and value row once from memory for all g*T rows of
 * its head and splits the keys into chunks, one work item per (batch, KV head, chunk), merged with the
 * log-sum-exp rule of flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023; the online
 * softmax of Milakov & Gimelshein, arXiv 1805.02867):
 *
 *     chunk c: m_c = max_j s_j, l_c = sum_j exp(s_j - m_c), a_c = sum_j exp(s_j - m_c) v_j
 *     out = sum_c exp(m_c - M) a_c / sum_c exp(m_c - M) l_c,  M = max_c m_c
 *
 * While a thread computes one work item it prefetches into L2 the values it will weigh next and the keys of its next
 * item (static schedule: the next chunk), spread over the item's passes: the scores' passes (one per 3 rows) each
 * prefetch a share of this chunk's values, the weighted sums' passes a share of the next chunk's keys. So the memory
 * stream does not pause while the scores and sums are computed, and a 7-token block's prefetches do not arrive in
 * one burst that evicts the rows it is working on (prefetching the whole next item at its start was slower, with
 * bitwise the same outputs: docs/performance.md, "Kernels (EPYC)"). The AVX-512 path spreads its prefetches the
 * same way, into L1 (its score passes take 4 rows).
 *
 * triforce_gqa_attention_bf16 reads bf16 keys and values (a lower tier's cache, or the full cache with --kv-dtype
 * bfloat16: half the bytes) with the same arithmetic in fp32. Built at first use by triforce/kernels.py with -O3 -mavx2 -mfma -fopenmp
 * (plus -mavx512f where the CPU has it), or with no ISA flags on a CPU without AVX2 (or aarch64): the portable
 * chunk_item below, the same chunks, merge and causal rule, plain C loops; the Python side
 * checks every precondition below before calling. Causal mask: the row of token i (rows are ordered (g, T): row r is token r % T)
 * sees keys j <= n_keys - T + i, as the full KV cache's block mask.
 */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


/* ES: bytes per key or value element, fp32 or bf16 (BF, a constant after inlining); kv_at: element i of p */
#define ES(BF) ((BF) ? 2 : 4)
static inline __attribute__((always_inline)) const void* kv_at(const void* p, int64_t i, const int BF) {
    return (const char*)p + i * ES(BF);
}

#if defined(__AVX2__)
/* expf for 8 lanes: Cephes' range reduction and degree-6 polynomial, relative error < 2e-7 on [-88, 88] */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {  /* the 4 horizontal sums */
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* Keys and values are fp32 or bf16 (BF, a constant after inlining: csrc/decode_step.c's bf16 caches of the tiers below
 * the verifier). A bf16 element is the top half of the fp32 with the same bits (torch.bfloat16), so loading one is a
 * widening and a shift, exact: the kernel over a bf16 cache computes bitwise what it computes over the fp32 copy of
 * that cache, from half the bytes. */

/* 8 keys' or values' elements from element i of p, as fp32 */
static inline __attribute__((always_inline)) __m256 load8(const void* p, int64_t i, const int BF) {
    if (BF)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i))), 16));
    return _mm256_loadu_ps((const float*)p + i);
}

/* Prefetch of rows [j, min(j + nk, end)) of hs elements of es bytes from base, into L2 (the AVX2 path) or with L1
 * into L1 (the AVX-512 path: its passes are shorter, and with the L2 hint its loads waited on L2; SmolLM2's attention
 * at 8K on one thread was slower so, in a trial with the two builds side by side). The P passes over a chunk share its
 * prefetches: pass p takes the steps whose index is p mod P, so the requests spread evenly over the item's time (a
 * counter counts the steps down: no division in the loops). */
static inline __attribute__((always_inline)) void prefetch_rows(const char* base, int j, int nk, int end, int hs,
                                                                int es, const int L1) {
    for (int64_t o = (int64_t)j * hs * es; o < (int64_t)(j + nk < end ? j + nk : end) * hs * es; o += 64)
        if (L1) _mm_prefetch(base + o, _MM_HINT_T0);
        else _mm_prefetch(base + o, _MM_HINT_T1);
}

/* s[i * ld + j] = scale * q_i . k_j for NR (<= 3) query rows and keys [0, n): 4 keys x NR rows per step. Every
 * score is summed in the same order whichever step computes it, so a query's output does not depend on the other
 * rows of its block (a verification computes what a decode step would). Prefetches pf's rows of its share of the
 * 4-key steps (prefetch_rows). */
static inline __attribute__((always_inline)) void scores(const float* Q, const int NR, const void* K, int n,
                                                         int hs, float scale, float* s, int ld, const char* pf,
                                                         int part, int parts, const int BF) {
    const __m128 sc = _mm_set1_ps(scale);
    int j = 0;
    for (int wait = part; j + 4 <= n; j += 4, --wait) {
        if (!wait) {
            prefetch_rows(pf, j, 4, n, hs, ES(BF), 0);
            wait = parts;
        }
        __m256 a[3][4];
        for (int i = 0; i < NR; ++i)
            for (int u = 0; u < 4; ++u) a[i][u] = _mm256_setzero_ps();
        const int64_t kj = (int64_t)j * hs;
        for (int d = 0; d < hs; d += 8) {
            __m256 qq[3];
            for (int i = 0; i < NR; ++i) qq[i] = _mm256_loadu_ps(Q + i * hs + d);
            for (int u = 0; u < 4; ++u) {
                __m256 kk = load8(K, kj + u * hs + d, BF);
                for (int i = 0; i < NR; ++i) a[i][u] = _mm256_fmadd_ps(qq[i], kk, a[i][u]);
            }
        }
        for (int i = 0; i < NR; ++i) _mm_storeu_ps(s + i * ld + j, _mm_mul_ps(hsum4(a[i][0], a[i][1], a[i][2], a[i][3]), sc));
    }
    for (; j < n; ++j) {
        const int64_t kj = (int64_t)j * hs;
        for (int i = 0; i < NR; ++i) {
            __m256 a0 = _mm256_setzero_ps();
            for (int d = 0; d < hs; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(Q + i * hs + d), load8(K, kj + d, BF), a0);
            s[i * ld + j] = _mm_cvtss_f32(hsum4(a0, a0, a0, a0)) * scale;  /* the 4-key path's order of additions */
        }
    }
}

/* A[b][0 : 8 NE) = sum_j P[b][j] V_j[0 : 8 NE) for NB (<= 3) rows over keys [0, n) (V rows hs apart, P rows ldp
 * apart, A rows lda apart): 4 value vectors (32 dims) for 3 rows per pass, so each value vector is loaded once for
 * the 3 rows (12 accumulators, 4 values and a broadcast: AVX2's 16 registers; a 7-token block's 21 rows per KV head
 * are 7 passes, not 21 that each load every value vector: bench/kernels/attention_kernel.py, 1.17x on SmolLM2's shape,
 * 1.4x on Qwen2.5-1.5B's). Each output element is the same chain of FMAs over j in order whatever NB and NE, so a
 * row's result does not depend on the rows beside it. Prefetches pf's rows [0, npf) of its share of the keys. */
static inline __attribute__((always_inline)) void pv(const float* P, int ldp, const int NB, const void* V, int n,
                                                     int hs, const int NE, float* A, int lda, const char* pf,
                                                     int npf, int part, int parts, const int BF) {
    __m256 o[3][4];
    for (int b = 0; b < NB; ++b)
        for (int e = 0; e < NE; ++e) o[b][e] = _mm256_setzero_ps();
    for (int j = 0, wait = pf ? part : -1; j < n; ++j, --wait) {
        if (!wait) {
            prefetch_rows(pf, j, 1, npf, hs, ES(BF), 0);
            wait = parts;
        }
        __m256 vv[4];
        for (int e = 0; e < NE; ++e) vv[e] = load8(V, (int64_t)j * hs + 8 * e, BF);
        for (int b = 0; b < NB; ++b) {
            const __m256 pj = _mm256_set1_ps(P[(int64_t)b * ldp + j]);
            for (int e = 0; e < NE; ++e) o[b][e] = _mm256_fmadd_ps(pj, vv[e], o[b][e]);
        }
    }
    for (int b = 0; b < NB; ++b)
        for (int e = 0; e < NE; ++e) _mm256_storeu_ps(A + (int64_t)b * lda + 8 * e, o[b][e]);
}

/* pv() with NB and NE constants, so that the accumulators stay in registers; pass (r0 / 3, e0 / 4) of the
 * (R / 3) x (nv / 4) passes prefetches its share of the next item's keys */
#define PV_ROWS(NB)                                                                                                \
    for (int e0 = 0; e0 < nv; e0 += 4) {                                                                           \
        const int ne = nv - e0 < 4 ? nv - e0 : 4, epasses = (nv + 3) / 4, parts = (R + 2) / 3 * epasses;           \
        const int part = r0 / 3 * epasses + e0 / 4;                                                                \
        const float* P = sbuf + (int64_t)r0 * n;                                                                   \
        float* A = acc + (int64_t)r0 * hs + 8 * e0;                                                                \
        const void* Ve = kv_at(V, 8 * e0, BF);                                                                     \
        if (ne == 4) pv(P, n, NB, Ve, kmax, hs, 4, A, hs, knext, nnext, part, parts, BF);                          \
        else if (ne == 3) pv(P, n, NB, Ve, kmax, hs, 3, A, hs, knext, nnext, part, parts, BF);                     \
        else if (ne == 2) pv(P, n, NB, Ve, kmax, hs, 2, A, hs, knext, nnext, part, parts, BF);                     \
        else pv(P, n, NB, Ve, kmax, hs, 1, A, hs, knext, nnext, part, parts, BF);                                  \
    }

#ifdef __AVX512F__
/* The AVX-512 path (built where the CPU has AVX-512, used for head sizes that are multiples of 16): 16 lanes, 4 query
 * rows per score step, and the weighted sum of values for up to 6 rows at once, so each value row is loaded once for
 * all of them; the score passes prefetch shares of this chunk's values, the weighted sums' passes shares of the next
 * item's keys (the header). A row's operations are still the same whatever the rows beside it (each score in one fixed order; the
 * weighted sum over keys j in order, rows past their last visible key adding exact zeros). */

/* load8 on 16 lanes */
static inline __attribute__((always_inline)) __m512 load16(const void* p, int64_t i, const int BF) {
    if (BF)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i))), 16));
    return _mm512_loadu_ps((const float*)p + i);
}

/* exp8's polynomial on 16 lanes: the same value in every lane as exp8 gives */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

/* The horizontal sums of 16 vectors a[4 i + u] (row i, key u) at once, a transposing tree of 15 additions and 30
 * shuffles (against 4 extractions, 4 additions and 3 hadds per row of 4 keys for one sum at a time): lanes
 * 4 i .. 4 i + 3 of the result hold row i's 4 sums. Each sum adds its own vector's lanes in the same order wherever
 * it sits among the 16 (the shuffles only move lanes), so a row's scores do not depend on the rows beside it. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 a[16]) {
    __m512 v1[8], v2[4];
    for (int p = 0; p < 8; ++p)  /* per 128-bit lane: lanes 0 + 2 and 1 + 3 of two vectors, interleaved */
        v1[p] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * p], a[2 * p + 1]), _mm512_unpackhi_ps(a[2 * p], a[2 * p + 1]));
    for (int q = 0; q < 4; ++q) {  /* per 128-bit lane L: the lane-L sums of vectors 4 q .. 4 q + 3 */
        const __m512d x = _mm512_castps_pd(v1[2 * q]), y = _mm512_castps_pd(v1[2 * q + 1]);
        v2[q] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 v30 = _mm512_add_ps(_mm512_shuffle_f32x4(v2[0], v2[1], 0x88), _mm512_shuffle_f32x4(v2[0], v2[1], 0xDD));
    const __m512 v31 = _mm512_add_ps(_mm512_shuffle_f32x4(v2[2], v2[3], 0x88), _mm512_shuffle_f32x4(v2[2], v2[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v30, v31, 0x88), _mm512_shuffle_f32x4(v30, v31, 0xDD));
}

/* scores() on 16 lanes, up to 4 rows (NR a constant after inlining); the rows of a 4-row step missing from NR
 * are zero vectors in sum16 */
static inline __attribute__((always_inline)) void scores16(const float* Q, const int NR, const void* K, int n,
                                                           int hs, float scale, float* s, int ld, const char* pf,
                                                           int part, int parts, const int BF) {
    const __m512 sc = _mm512_set1_ps(scale);
    int j = 0;
    for (int wait = part; j + 4 <= n; j += 4, --wait) {
        if (!wait) {
            prefetch_rows(pf, j, 4, n, hs, ES(BF), 1);
            wait = parts;
        }
        __m512 a[16];
        for (int x = 0; x < 16; ++x) a[x] = _mm512_setzero_ps();
        const int64_t kj = (int64_t)j * hs;
        for (int d = 0; d < hs; d += 16) {
            __m512 qq[4];
            for (int i = 0; i < NR; ++i) qq[i] = _mm512_loadu_ps(Q + i * hs + d);
            for (int u = 0; u < 4; ++u) {
                __m512 kk = load16(K, kj + u * hs + d, BF);
                for (int i = 0; i < NR; ++i) a[4 * i + u] = _mm512_fmadd_ps(qq[i], kk, a[4 * i + u]);
            }
        }
        const __m512 sums = _mm512_mul_ps(sum16(a), sc);
        for (int i = 0; i < NR; ++i) _mm512_mask_storeu_ps(s + i * ld + j - 4 * i, (__mmask16)(0xF << (4 * i)), sums);
    }
    for (; j < n; ++j) {  /* the last keys one at a time, through the same tree */
        const int64_t kj = (int64_t)j * hs;
        __m512 a[16];
        for (int x = 0; x < 16; ++x) a[x] = _mm512_setzero_ps();
        for (int i = 0; i < NR; ++i)
            for (int d = 0; d < hs; d += 16)
                a[4 * i] = _mm512_fmadd_ps(_mm512_loadu_ps(Q + i * hs + d), load16(K, kj + d, BF), a[4 * i]);
        const __m512 sums = _mm512_mul_ps(sum16(a), sc);
        for (int i = 0; i < NR; ++i) _mm512_mask_storeu_ps(s + i * ld + j - 4 * i, (__mmask16)(1 << (4 * i)), sums);
    }
}

/* A[b][0 : 16 NE) = sum_j P[b][j] V_j[0 : 16 NE) for NB (<= 6) rows over keys [0, n): each value vector loaded once */
static inline __attribute__((always_inline)) void pv16(const float* P, int ldp, const int NB, const void* V, int n,
                                                       int hs, const int NE, float* A, int lda, const char* pf,
                                                       int npf, int part, int parts, const int BF) {
    __m512 o[6][4];
    for (int b = 0; b < NB; ++b)
        for (int e = 0; e < NE; ++e) o[b][e] = _mm512_setzero_ps();
    for (int j = 0, wait = pf ? part : -1; j < n; ++j, --wait) {
        if (!wait) {
            prefetch_rows(pf, j, 1, npf, hs, ES(BF), 1);
            wait = parts;
        }
        __m512 v[4];
        for (int e = 0; e < NE; ++e) v[e] = load16(V, (int64_t)j * hs + 16 * e, BF);
        for (int b = 0; b < NB; ++b) {
            const __m512 pj = _mm512_set1_ps(P[(int64_t)b * ldp + j]);
            for (int e = 0; e < NE; ++e) o[b][e] = _mm512_fmadd_ps(pj, v[e], o[b][e]);
        }
    }
    for (int b = 0; b < NB; ++b)
        for (int e = 0; e < NE; ++e) _mm512_storeu_ps(A + (int64_t)b * lda + 16 * e, o[b][e]);
}

#define PV16_ROWS(NB)                                                                                              \
    for (int e0 = 0; e0 < nv; e0 += 4) {                                                                           \
        const int ne = nv - e0 < 4 ? nv - e0 : 4, epasses = (nv + 3) / 4, parts = (R + 5) / 6 * epasses;         \
        const int part = r0 / 6 * epasses + e0 / 4;                                                                \
        const float* P = sbuf + (int64_t)r0 * n;                                                                   \
        float* A = acc + (int64_t)r0 * hs + 16 * e0;                                                               \
        const void* Ve = kv_at(V, 16 * e0, BF);                                                                    \
        if (ne == 4) pv16(P, n, NB, Ve, kmax, hs, 4, A, hs, knext, nnext, part, parts, BF);                        \
        else if (ne == 3) pv16(P, n, NB, Ve, kmax, hs, 3, A, hs, knext, nnext, part, parts, BF);                   \
        else if (ne == 2) pv16(P, n, NB, Ve, kmax, hs, 2, A, hs, knext, nnext, part, parts, BF);                   \
        else pv16(P, n, NB, Ve, kmax, hs, 1, A, hs, knext, nnext, part, parts, BF);                                \
    }

/* chunk_item() on the AVX-512 path (hs a multiple of 16) */
static inline __attribute__((always_inline)) void chunk_item16(const float* Q, const void* K, const void* V, int R,
                                                               int T, int hs, int j0, int n, int last0, float scale,
                                                               float* acc, float* mrow, float* lrow, float* sbuf,
                                                               const char* knext, int nnext, const int BF) {
    const int nmax = last0 + T - j0 < n ? last0 + T - j0 : n;  /* keys the last token's rows see */
    int parts = 0;
    for (int r0 = 0; r0 < R; r0 += R - r0 == 5 ? 3 : 4) ++parts;
    for (int r0 = 0, nr, part = 0; nmax > 0 && r0 < R; r0 += nr, ++part) {
        nr = R - r0 == 5 ? 3 : R - r0 < 4 ? R - r0 : 4;  /* 5 rows left: 3 + 2, since a step costs one sum16 */
        const float* q = Q + (int64_t)r0 * hs;
        float* s = sbuf + (int64_t)r0 * n;
        if (nr == 4) scores16(q, 4, K, nmax, hs, scale, s, n, (const char*)V, part, parts, BF);
        else if (nr == 3) scores16(q, 3, K, nmax, hs, scale, s, n, (const char*)V, part, parts, BF);
        else if (nr == 2) scores16(q, 2, K, nmax, hs, scale, s, n, (const char*)V, part, parts, BF);
        else scores16(q, 1, K, nmax, hs, scale, s, n, (const char*)V, part, parts, BF);
    }
    for (int r = 0; r < R; ++r) {  /* softmax numerators in place; zeros past the row's last visible key */
        const int nvis = last0 + r % T - j0 + 1 < n ? last0 + r % T - j0 + 1 : n;  /* causal: keys <= last0 + i */
        float* s = sbuf + (int64_t)r * n;
        if (nvis <= 0) {
            mrow[r] = -INFINITY;
            lrow[r] = 0.f;
            for (int j = 0; j < nmax; ++j) s[j] = 0.f;
            continue;
        }
        __m512 m16 = _mm512_set1_ps(-INFINITY);  /* the maximum: the same whatever the order */
        int j = 0;
        for (; j + 16 <= nvis; j += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(s + j));
        float m = _mm512_reduce_max_ps(m16);
        for (; j < nvis; ++j) m = s[j] > m ? s[j] : m;
        const __m512 mm = _mm512_set1_ps(m);
        __m512 l16 = _mm512_setzero_ps();
        for (j = 0; j + 16 <= nvis; j += 16) {
            __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mm));
            _mm512_storeu_ps(s + j, p);
            l16 = _mm512_add_ps(l16, p);
        }
        float l = _mm512_reduce_add_ps(l16);
        for (; j < nvis; ++j) {
            s[j] = expf(s[j] - m);
            l += s[j];
        }
        for (j = nvis; j < nmax; ++j) s[j] = 0.f;
        mrow[r] = m;
        lrow[r] = l;
    }
    const int nv = hs / 16;
    for (int r0 = 0; r0 < R; r0 += 6) {  /* 6 rows at a time, over the keys the block's last row sees */
        const int nb = R - r0 < 6 ? R - r0 : 6;
        int kmax = 0;
        for (int r = r0; r < r0 + nb; ++r) {
            const int nvis = last0 + r % T - j0 + 1 < n ? last0 + r % T - j0 + 1 : n;
            kmax = nvis > kmax ? nvis : kmax;
        }
        if (kmax <= 0) {
            memset(acc + (int64_t)r0 * hs, 0, (size_t)nb * hs * sizeof(float));
            continue;
        }
        switch (nb) {
            case 6: PV16_ROWS(6) break;
            case 5: PV16_ROWS(5) break;
            case 4: PV16_ROWS(4) break;
            case 3: PV16_ROWS(3) break;
            case 2: PV16_ROWS(2) break;
            default: PV16_ROWS(1) break;
        }
    }
}
#endif

/* One (batch, head, chunk) work item: for every row, its chunk maximum m, sum l and unnormalised output a. The
 * scores' passes prefetch this chunk's values, the weighted sums' passes the next item's nnext keys at knext (NULL:
 * none). */
static inline __attribute__((always_inline)) void chunk_item(const float* Q, const void* K, const void* V, int R,
                                                             int T, int hs, int j0, int n, int last0, float scale,
                                                             float* acc, float* mrow, float* lrow, float* sbuf,
                                                             const char* knext, int nnext, const int BF) {
    const int nmax = last0 + T - j0 < n ? last0 + T - j0 : n;  /* keys the last token's rows see */
    for (int r0 = 0; nmax > 0 && r0 < R; r0 += 3) {
        const int nr = R - r0 < 3 ? R - r0 : 3, part = r0 / 3, parts = (R + 2) / 3;
        const float* q = Q + (int64_t)r0 * hs;
        float* s = sbuf + (int64_t)r0 * n;
        if (nr == 3) scores(q, 3, K, nmax, hs, scale, s, n, (const char*)V, part, parts, BF);
        else if (nr == 2) scores(q, 2, K, nmax, hs, scale, s, n, (const char*)V, part, parts, BF);
        else scores(q, 1, K, nmax, hs, scale, s, n, (const char*)V, part, parts, BF);
    }
    for (int r = 0; r < R; ++r) {  /* softmax numerators in place; zeros past the row's last visible key */
        const int nvis = last0 + r % T - j0 + 1 < n ? last0 + r % T - j0 + 1 : n;  /* causal: keys <= last0 + i */
        float* s = sbuf + (int64_t)r * n;
        if (nvis <= 0) {
            mrow[r] = -INFINITY;
            lrow[r] = 0.f;
            for (int j = 0; j < nmax; ++j) s[j] = 0.f;
            continue;
        }
        __m256 m8 = _mm256_set1_ps(-INFINITY);  /* the maximum: the same whatever the order (8 lanes, not a scalar
                                                 * chain whose latency cost a third of a decode step's attention) */
        int j = 0;
        for (; j + 8 <= nvis; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        for (; j < nvis; ++j) m = s[j] > m ? s[j] : m;
        const __m256 mm = _mm256_set1_ps(m);
        __m256 l8 = _mm256_setzero_ps();
        for (j = 0; j + 8 <= nvis; j += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mm));
            _mm256_storeu_ps(s + j, p);
            l8 = _mm256_add_ps(l8, p);
        }
        float l = hsum(l8);
        for (; j < nvis; ++j) {
            s[j] = expf(s[j] - m);
            l += s[j];
        }
        for (j = nvis; j < nmax; ++j) s[j] = 0.f;
        mrow[r] = m;
        lrow[r] = l;
    }
    const int nv = hs / 8;
    for (int r0 = 0; r0 < R; r0 += 3) {  /* 3 rows at a time, over the keys the last of them sees (zeros past a
                                          * row's own last key add exact zeros) */
        const int nb = R - r0 < 3 ? R - r0 : 3;
        int kmax = 0;
        for (int r = r0; r < r0 + nb; ++r) {
            const int nvis = last0 + r % T - j0 + 1 < n ? last0 + r % T - j0 + 1 : n;
            kmax = nvis > kmax ? nvis : kmax;
        }
        if (kmax <= 0) {
            memset(acc + (int64_t)r0 * hs, 0, (size_t)nb * hs * sizeof(float));
            continue;
        }
        if (nb == 3) { PV_ROWS(3) }
        else if (nb == 2) { PV_ROWS(2) }
        else { PV_ROWS(1) }
    }
}

#else  /* portable: no ISA flags (a CPU without AVX2, or aarch64) */

#include "common.h"  /* MADD: the portable builds' multiply-add */
#define P_LANES 8  /* partial sums of a row's softmax sum: lane l takes the keys j = l mod 8 */

/* element i of p as fp32 (bf16: the top half of the fp32 with the same bits, exact) */
static inline __attribute__((always_inline)) float kv_get(const void* p, int64_t i, const int BF) {
    if (!BF) return ((const float*)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The work item of the AVX2 build's chunk_item, row by row: each row's scores over the keys it sees (its dot product
 * with each key one MADD chain over d = 0 .. hs-1, times scale), its maximum, exp(s - m) by libm's expf and their sum
 * (P_LANES lanes, a fixed tree, then the tail in order), then its weighted sum of values over those keys in order.
 * Every value a row gets depends on that row's query and the chunk's keys only, so a row's result does not depend on
 * the rows beside it. The chunk's keys are transposed once into kt (hs, nmax), so that the scores' chains run down
 * contiguous keys, a loop the compiler vectorises across keys (each key's chain stays in its own lane, in order);
 * where that buffer cannot be allocated, the same chains run key by key. */
static inline __attribute__((always_inline)) void chunk_item(const float* Q, const void* K, const void* V, int R,
                                                             int T, int hs, int j0, int n, int last0, float scale,
                                                             float* acc, float* mrow, float* lrow, float* sbuf,
                                                             const char* knext, int nnext, const int BF) {
    (void)knext, (void)nnext;
    const int nmax = last0 + T - j0 < n ? last0 + T - j0 : n;  /* keys the last token's rows see */
    /* kt's rows ld floats apart: a multiple of 8 that is not one of 64, so that the rows of a tile do not share a
     * cache set (a stride of 256 keys, 1 KB, made the transposition most of the item's time) */
    const int ld = (nmax + 7) / 8 * 8 + ((nmax + 7) / 8 % 8 == 0 ? 8 : 0);
    float* kt = nmax > 0 ? (float*)malloc((size_t)hs * (size_t)ld * sizeof(float)) : NULL;
    if (kt)
        for (int j0 = 0; j0 < nmax; j0 += 8) {  /* 8 keys at a time: each of kt's rows gets 8 contiguous floats */
            const int nj = nmax - j0 < 8 ? nmax - j0 : 8;
            for (int d = 0; d < hs; ++d)
                for (int jj = 0; jj < nj; ++jj)
                    kt[(int64_t)d * ld + j0 + jj] = kv_get(K, (int64_t)(j0 + jj) * hs + d, BF);
        }
    for (int r = 0; r < R; ++r) {
        const int nvis = last0 + r % T - j0 + 1 < n ? last0 + r % T - j0 + 1 : n;  /* causal: keys <= last0 + i */
        const float* q = Q + (int64_t)r * hs;
        float* s = sbuf + (int64_t)r * n;
        float* a = acc + (int64_t)r * hs;
        for (int d = 0; d < hs; ++d) a[d] = 0.f;
        if (nvis <= 0) {
            mrow[r] = -INFINITY;
            lrow[r] = 0.f;
            continue;
        }
        if (kt) {
            for (int j = 0; j < nvis; ++j) s[j] = 0.f;
            for (int d = 0; d < hs; d += 4) {  /* 4 steps of each key's chain per pass over s (hs: a multiple of 8) */
                const float q0 = q[d], q1 = q[d + 1], q2 = q[d + 2], q3 = q[d + 3];
                const float *k0 = kt + (int64_t)d * ld, *k1 = k0 + ld, *k2 = k1 + ld, *k3 = k2 + ld;
                for (int j = 0; j < nvis; ++j)
                    s[j] = MADD(q3, k3[j], MADD(q2, k2[j], MADD(q1, k1[j], MADD(q0, k0[j], s[j]))));
            }
        } else {
            for (int j = 0; j < nvis; ++j) {
                float dot = 0.f;
                for (int d = 0; d < hs; ++d) dot = MADD(q[d], kv_get(K, (int64_t)j * hs + d, BF), dot);
                s[j] = dot;
            }
        }
        float m = -INFINITY;
        for (int j = 0; j < nvis; ++j) {
            s[j] *= scale;
            m = s[j] > m ? s[j] : m;
        }
        float lane[P_LANES] = {0};
        int j = 0;
        for (; j + P_LANES <= nvis; j += P_LANES)
            for (int l = 0; l < P_LANES; ++l) {
                s[j + l] = expf(s[j + l] - m);
                lane[l] += s[j + l];
            }
        for (int w = P_LANES / 2; w > 0; w /= 2)
            for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
        float l = lane[0];
        for (; j < nvis; ++j) {
            s[j] = expf(s[j] - m);
            l += s[j];
        }
        for (j = 0; j + 4 <= nvis; j += 4) {  /* 4 steps of each element's chain over keys per pass over a */
            const float p0 = s[j], p1 = s[j + 1], p2 = s[j + 2], p3 = s[j + 3];
            const int64_t v0 = (int64_t)j * hs, v1 = v0 + hs, v2 = v1 + hs, v3 = v2 + hs;
            for (int d = 0; d < hs; ++d)
                a[d] = MADD(p3, kv_get(V, v3 + d, BF), MADD(p2, kv_get(V, v2 + d, BF),
                            MADD(p1, kv_get(V, v1 + d, BF), MADD(p0, kv_get(V, v0 + d, BF), a[d]))));
        }
        for (; j < nvis; ++j) {
            const float p = s[j];
            const int64_t vj = (int64_t)j * hs;
            for (int d = 0; d < hs; ++d) a[d] = MADD(p, kv_get(V, vj + d, BF), a[d]);
        }
        mrow[r] = m;
        lrow[r] = l;
    }
    free(kt);
}
#endif

/* q: (B, nkv, R, hs) contiguous; key/value (b, h, j, d) at b * bstride + h * hstride + j * hs + d, j < n_keys;
 * out: (B, nkv, R, hs) contiguous; scratch: B * nkv * ceil(n_keys / chunk) * R * (hs + 2) floats for the chunks'
 * partial results, then nthreads * R * chunk floats, each thread's scores; lse: NULL, or (B, nkv, R) floats that
 * receive each row's log-sum-exp of its scaled scores.
 * Returns 0, or -1 for arguments outside what the kernel handles (nothing written). */
static inline __attribute__((always_inline)) int gqa_attention(const float* q, const void* k, const void* v, float* out,
                                                               float* scratch, int B, int nkv, int R, int T, int hs,
                                                               int64_t bstride, int64_t hstride, int n_keys,
                                                               int chunk, float scale, int nthreads, float* lse,
                                                               const int BF) {
    if (hs % 8 || hs > 256 || T < 1 || R % T || n_keys < T || chunk < 8 || nthreads < 1)
        return -1;
    const int nchunks = (n_keys + chunk - 1) / chunk, items = B * nkv * nchunks, last0 = n_keys - T;
    const int64_t item_floats = (int64_t)R * (hs + 2);
    float* const scores_base = scratch + (int64_t)items * item_floats;
    #pragma omp parallel num_threads(nthreads)
    {
        float* const sbuf = scores_base + (int64_t)omp_get_thread_num() * R * chunk;  /* this thread's scores */
        #pragma omp for schedule(static)
        for (int it = 0; it < items; ++it) {
            const int c = it % nchunks, bh = it / nchunks, h = bh % nkv, b = bh / nkv;
            const int j0 = c * chunk, n = n_keys - j0 < chunk ? n_keys - j0 : chunk;
            const int64_t kv_off = b * bstride + h * hstride + (int64_t)j0 * hs;
            float* acc = scratch + it * item_floats;
            const char* knext = 0;  /* the next item's keys (its values: at the same offset in v) */
            int nnext = 0;
            if (it + 1 < items) {
                const int c1 = (it + 1) % nchunks, bh1 = (it + 1) / nchunks;
                nnext = n_keys - c1 * chunk < chunk ? n_keys - c1 * chunk : chunk;
                knext = (const char*)kv_at(k, (bh1 / nkv) * bstride + (bh1 % nkv) * hstride + (int64_t)c1 * chunk * hs,
                                           BF);
            }
#ifdef __AVX512F__
            if (hs % 16 == 0) {
                chunk_item16(q + (int64_t)bh * R * hs, kv_at(k, kv_off, BF), kv_at(v, kv_off, BF), R, T, hs, j0, n,
                             last0, scale, acc, acc + (int64_t)R * hs, acc + (int64_t)R * hs + R, sbuf, knext, nnext,
                             BF);
            } else
#endif
            chunk_item(q + (int64_t)bh * R * hs, kv_at(k, kv_off, BF), kv_at(v, kv_off, BF), R, T, hs, j0, n, last0,
                       scale, acc, acc + (int64_t)R * hs, acc + (int64_t)R * hs + R, sbuf, knext, nnext, BF);
        }
        /* merge the chunks of every (batch, head, row) */
        #pragma omp for schedule(static)
        for (int x = 0; x < B * nkv * R; ++x) {
            const int r = x % R, bh = x / R;
            const float* base = scratch + (int64_t)bh * nchunks * item_floats;
            float M = -INFINITY, L = 0.f;
            for (int c = 0; c < nchunks; ++c) {
                const float mc = base[c * item_floats + (int64_t)R * hs + r];
                M = mc > M ? mc : M;
            }
            float* o = out + (int64_t)x * hs;
            for (int d = 0; d < hs; ++d) o[d] = 0.f;
            for (int c = 0; c < nchunks; ++c) {
                const float* it = base + c * item_floats;
                const float lc = it[(int64_t)R * hs + R + r];
                if (lc == 0.f) continue;
                const float w = expf(it[(int64_t)R * hs + r] - M);
                L += w * lc;
                for (int d = 0; d < hs; ++d) o[d] += w * it[(int64_t)r * hs + d];
            }
            const float inv = 1.f / L;
            for (int d = 0; d < hs; ++d) o[d] *= inv;
            if (lse) lse[x] = M + logf(L);  /* log sum_j exp(s_j): to merge with attention over other keys */
        }
    }
    return 0;
}

int triforce_gqa_attention(const float* q, const float* k, const float* v, float* out, float* scratch, int B,
                           int nkv, int R, int T, int hs, int64_t bstride, int64_t hstride, int n_keys, int chunk,
                           float scale, int nthreads, float* lse) {
    return gqa_attention(q, k, v, out, scratch, B, nkv, R, T, hs, bstride, hstride, n_keys, chunk, scale, nthreads,
                         lse, 0);
}

/* triforce_gqa_attention over bf16 keys and values (torch.bfloat16's bits, at the same element offsets): bitwise what
 * it computes over their fp32 values */
int triforce_gqa_attention_bf16(const float* q, const uint16_t* k, const uint16_t* v, float* out, float* scratch,
                                int B, int nkv, int R, int T, int hs, int64_t bstride, int64_t hstride, int n_keys,
                                int chunk, float scale, int nthreads, float* lse) {
    return gqa_attention(q, k, v, out, scratch, B, nkv, R, T, hs, bstride, hstride, n_keys, chunk, scale, nthreads,
                         lse, 1);
}

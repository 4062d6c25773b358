/* fp32 matrix products over weights stored as their GGUF block codes, dequantized exactly in registers.
 *
 * A model read from a GGUF file (the default SmolLM2 is Q4_1, its embedding Q8_0) has fp32 weights that are exactly
 * w = fl(fl(d * q) + m) per block of 32 inputs: q a 4-bit code in [0, 15] with the block's scale d and minimum m
 * (Q4_1), or an 8-bit code in [-127, 127] with m = 0 (Q8_0) (ggml's block formats, as gguf-py dequantizes them).
 * triforce/blockcodes.py finds the codes from the fp32 weights and checks every weight's reconstruction exactly, so
 * this kernel multiplies by the very fp32 weights the model holds, reading 0.625 (4-bit) or 1.0625 (8-bit) bytes per
 * weight instead of 4: a decode step is bound by those bytes. Each y[m, o] is one chain of FMAs over i = 0 .. in-1 in
 * a lane, the same chain as triforce_f32_linear's (csrc/qlinear.c) over the dequantized (in, out) weights, so the
 * two give bitwise the same products, whatever M and the other rows (a row alone and in a block agree).
 *
 * Layout (one 8-output column block c = o / 8 after another, so each block streams from memory):
 *     bits 4: codes (out / 8, in) uint32, nibble k (bits 4k .. 4k + 3) the code of output 8c + k at input i
 *     bits 8: codes (out / 8, in, 8) int8
 *     d, m:   (out / 8, in / 32, 8) fp16 per block of 32 inputs, as the GGUF file stores them (converted to fp32
 *             exactly in registers); m NULL for m = 0 (the add is skipped: d * q exactly)
 *     BC_KS:  a K-quant's (Q4_K, Q5_K, Q6_K) as its file keeps them: int8 group values (out / 8, in / G, 8) (sc, mc),
 *             then fp16 super-block values (out / 8, in / 256, 8) (d, -dmin), their product formed in registers
 *             (kscale8: exact, so the same weights as fp32 products per group, BC_F32, at 0.578 bytes a Q4_K weight)
 *     bits 16: (out / 8, in, 8) the weights themselves, bf16 or fp16 (a 2-byte checkpoint kept as it is stored), each
 *             widened exactly to fp32 in registers; d and m NULL
 *
 * triforce_blockcode_fit finds the codes of an fp32 (in, out) matrix in this layout, one pass over it (8 outputs per
 * vector, a block's 32 inputs down the lanes): the block's scale is max - min over 15 (Q4_1) or max |w| over 127
 * (Q8_0) rounded to fp16 (GGUF stores it so), or a neighbouring fp16 value, and every weight's d * q + m must come back
 * exactly; it answers 1 (nothing usable written) at the first block no candidate reproduces.
 *
 * Built with -ffp-contract=off (d * q + m rounds twice, as PyTorch's elementwise ops and gguf-py's numpy do) and
 * -mavx2 -mfma -fopenmp by triforce/kernels.py's builder, plus -mavx512f -mavx512bw -mavx512vl where the CPU has
 * AVX-512 (the exact product's 16-lane path below), and -mavx512vnni where it has VNNI (the integer dot products'
 * vpdpbusd): faster for every row count, bitwise the same outputs (docs/performance.md, "Kernels"). On a CPU without
 * AVX2 (or aarch64) it is built with no ISA flags: the portable branch at the end, plain C over the same layout, whose
 * exact products are bitwise the portable triforce_f32_linear's. The Python side checks every precondition before
 * calling.
 */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_ROWS 64
#define GROUP 32

#if defined(__AVX2__)  /* the AVX2 and AVX-512 paths (the portable build's, plain C, are at the end of this file) */
/* the 8 scales or minima at index k (a multiple of 8) of a (out / 8, groups, 8) array, as fp32: fp16 values converted
 * exactly, or fp32 values (F32: a K-quant's products of two fp16 scales, exact in fp32) */
static inline __attribute__((always_inline)) __m256 scale8(const void* p, int64_t k, const int F32) {
    if (F32) return _mm256_loadu_ps((const float*)p + k);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + k)));
}

/* BC_KS: a K-quant's scales (or minima) as the file keeps them: p holds int8 sub-block values (out / 8, groups, 8)
 * (Q4_K/Q5_K's 6-bit sc or mc, Q6_K's int8 sc), then at byte sup = out groups the fp16 super-block values
 * (out / 8, in / 256, 8) (d, or -dmin for the minima). The 8 values of column block c at group g, as fp32: an fp16
 * times an integer below 2^7 in magnitude is exact in fp32 (11 + 7 significant bits), so these are bitwise the fp32
 * products d sc the BC_F32 format stores. */
static inline __attribute__((always_inline)) __m256 kscale8(const void* p, int64_t c, int groups, int g, const int G,
                                                            int64_t sup) {
    const int per = 256 / G;  /* groups a super-block */
    const __m128i s = _mm_loadl_epi64((const __m128i*)((const int8_t*)p + (c * groups + g) * 8));
    const __m128i h = _mm_loadu_si128((const __m128i*)((const char*)p + sup + (c * (groups / per) + g / per) * 16));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s)));
}

/* the 8 scales or minima of column block c at group g: fp16, fp32 (F32) or a K-quant's pair (KS) */
static inline __attribute__((always_inline)) __m256 group8(const void* p, int64_t c, int groups, int g, const int F32,
                                                           const int KS, const int G, int64_t sup) {
    return KS ? kscale8(p, c, groups, g, G, sup) : scale8(p, (c * groups + g) * 8, F32);
}

/* BLOCK_PRODUCT_EXACT: a weight's d q is exact in fp32 (an fp16 scale's 11 significant bits times a code's 4 or 8,
 * at least 2^-24 in magnitude where not 0), so fl(fl(d q) + m), the weight, is the one rounding of d q + m that an FMA
 * computes: one instruction instead of a multiply and an add, the same weights bitwise (docs/history.md has the
 * timing) */

/* 8 weights of column block c at input i, exactly as fp32 */
static inline __attribute__((always_inline)) __m256 weights8(const void* codes, const int BITS, const int BF, int64_t c,
                                                             int in, int i, __m256 dv, __m256 mv, const int HAS_M) {
    if (BITS == 16) {  /* the weights themselves: bf16 (BF) or fp16, widened exactly */
        const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)codes + (c * in + i) * 8));
        return BF ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
    }
    __m256i q;
    if (BITS == 4) {
        const uint32_t word = ((const uint32_t*)codes)[c * in + i];
        q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                             _mm256_set1_epi32(15));
    } else {
        q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((const int8_t*)codes + (c * in + i) * 8)));
    }
    /* d q is exact in fp32 (BLOCK_PRODUCT_EXACT), so one FMA rounds d q + m as fl(fl(d q) + m) does */
    return HAS_M ? _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(q), mv) : _mm256_mul_ps(dv, _mm256_cvtepi32_ps(q));
}

/* L1 prefetch of group g of column blocks [c_from, c_to): their codes, scales and minima */
static inline __attribute__((always_inline)) void prefetch_group(const void* codes, const int BITS, const void* d,
                                                                 const void* m, const int HAS_M, const int F32,
                                                                 const int KS, const int G, int64_t c_from,
                                                                 int64_t c_to, int in, int groups, int g, int64_t sup) {
    const int ds = KS ? 1 : F32 ? 4 : 2;  /* bytes of a (sub-block) scale */
    for (int64_t u = c_from; u < c_to; ++u) {
        const char* cn = (const char*)codes + (u * in + g * G) * BITS;  /* 4 or 8 bytes an input */
        for (int o = 0; o < G * BITS; o += 64) _mm_prefetch(cn + o, _MM_HINT_T0);
        if (BITS == 16) continue;  /* no scales */
        _mm_prefetch((const char*)d + (u * groups + g) * 8 * ds, _MM_HINT_T0);
        if (HAS_M) _mm_prefetch((const char*)m + (u * groups + g) * 8 * ds, _MM_HINT_T0);
        if (KS && g % (256 / G) == 0) {  /* the super-block's fp16 values */
            const int64_t s = sup + (u * (groups / (256 / G)) + g / (256 / G)) * 16;
            _mm_prefetch((const char*)d + s, _MM_HINT_T0);
            if (HAS_M) _mm_prefetch((const char*)m + s, _MM_HINT_T0);
        }
    }
}

/* y[m, 8 (c0 + u) : ... + 8) for R rows (constants after inlining) and NC column blocks c0 .. c0 + NC - 1; with PF,
 * each group of inputs also prefetches the same group of the next NC column blocks (their codes, scales, minima).
 * A tile reads 2 NC + NC short streams (a column block's codes are 2.3 KB for 576 inputs), too short for the hardware
 * prefetcher to run ahead: without it a one-row product's memory reads and dequantization took turns (1.25x
 * slower on SmolLM2's codes; docs/history.md has the timing). */
static inline __attribute__((always_inline)) void tile(const float* x, const int R, int in, const void* codes,
                                                       const int BITS, const int BF, const void* d, const void* m, const int HAS_M,
                                                       const int F32, const int KS, const int G, int64_t c0, const int NC,
                                                       int out, float* y, const int PF) {
    __m256 acc[8];  /* R * NC <= 8 */
    for (int a = 0; a < R * NC; ++a) acc[a] = _mm256_setzero_ps();
    const int groups = in / G;
    const int64_t sup = (int64_t)out * groups;  /* KS: the super-block values' byte offset */
    for (int g = 0; g < groups; ++g) {
        __m256 dv[4], mv[4];
        for (int u = 0; u < NC; ++u) {
            dv[u] = BITS == 16 ? _mm256_setzero_ps() : group8(d, c0 + u, groups, g, F32, KS, G, sup);
            mv[u] = HAS_M ? group8(m, c0 + u, groups, g, F32, KS, G, sup) : _mm256_setzero_ps();
        }
        if (PF) prefetch_group(codes, BITS, d, m, HAS_M, F32, KS, G, c0 + NC, c0 + 2 * NC, in, groups, g, sup);
        for (int i = g * G; i < (g + 1) * G; ++i) {
            __m256 w[4];
            for (int u = 0; u < NC; ++u) w[u] = weights8(codes, BITS, BF, c0 + u, in, i, dv[u], mv[u], HAS_M);
            for (int r = 0; r < R; ++r) {
                const __m256 xb = _mm256_broadcast_ss(x + (int64_t)r * in + i);
                for (int u = 0; u < NC; ++u) acc[r * NC + u] = _mm256_fmadd_ps(xb, w[u], acc[r * NC + u]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < NC; ++u) _mm256_storeu_ps(y + (int64_t)r * out + 8 * (c0 + u), acc[r * NC + u]);
}

/* All rows over the 4 column blocks [cq, cq + 4): passes of R rows, NC blocks at a time (one row: 4 independent FMA
 * chains, so a one-row product is not bound by FMA latency); the first pass (pf) prefetches the next NC blocks while
 * they are the thread's (below c1) */
#define PASS(BITS, HAS_M, R, NC)                                                                           \
    for (int64_t c = cq; c < cq + 4; c += NC)                                                                      \
        if (pf && c + NC < c1) tile(xm, R, in, codes, BITS, BF, d, m, HAS_M, F32, KS, G, c, NC, out, ym, 1);       \
        else tile(xm, R, in, codes, BITS, BF, d, m, HAS_M, F32, KS, G, c, NC, out, ym, 0);
#define ROWS(BITS, HAS_M)                                                                                            \
    switch (rows) {                                                                                                \
        case 1: PASS(BITS, HAS_M, 1, 4) break;                                                             \
        case 2: PASS(BITS, HAS_M, 2, 4) break;                                                             \
        case 3: PASS(BITS, HAS_M, 3, 2) break;                                                             \
        case 4: PASS(BITS, HAS_M, 4, 2) break;                                                             \
        case 5: PASS(BITS, HAS_M, 5, 1) break;                                                             \
        case 6: PASS(BITS, HAS_M, 6, 1) break;                                                             \
        case 7: PASS(BITS, HAS_M, 7, 1) break;                                                             \
        default: PASS(BITS, HAS_M, 8, 1) break;                                                            \
    }

#ifdef __AVX512F__
/* The AVX-512 path (built where the CPU has AVX-512 F/BW/VL): 16 lanes hold two column blocks, c (lanes 0-7) and
 * c + 1 (lanes 8-15), so each dequantization and FMA covers 16 outputs, in about half the AVX2 path's instructions
 * per weight (the AVX2 path's one-row product is bound by them, not by the codes' bytes: bench/kernels/blockcodes.py). Every
 * lane is still one chain of FMAs over i = 0 .. in-1 of the same fp32 weights, so both paths, and
 * triforce_f32_linear, give bitwise the same products. */
/* lane k's nibble of a 4-bit code word, in place: (q << 4 (k % 8)), and the scale 2^-4 (k % 8) that undoes it */
static const unsigned NIBBLES16[16] = {15u, 15u << 4, 15u << 8, 15u << 12, 15u << 16, 15u << 20, 15u << 24, 15u << 28,
                                       15u, 15u << 4, 15u << 8, 15u << 12, 15u << 16, 15u << 20, 15u << 24, 15u << 28};
static const float UNSHIFT16[16] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-28f,
                                    1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 0x1p-28f};

/* 16 weights of column blocks c and c + 1 at input i, exactly as fp32. 4-bit codes are not shifted down: lane k
 * takes q 2^s (s = 4 (k % 8), exact as an unsigned conversion: 4 significant bits) times dv = d 2^-s, so
 * fl(dv q 2^s) = fl(d q), the same weight as the AVX2 path's. dv is exact because every scale is an fp16 value or 0
 * (GGUF stores them so; triforce_blockcode_fit only writes such): |d| >= 2^-24, so d 2^-28 stays a normal fp32. */
static inline __attribute__((always_inline)) __m512 weights16(const void* codes, const int BITS, const int BF,
                                                              int64_t c, int in, int i, __m512 dv, __m512 mv,
                                                              const int HAS_M) {
    if (BITS == 16) {  /* the weights themselves: bf16 (BF) or fp16, widened exactly */
        const uint16_t* h = (const uint16_t*)codes + (c * in + i) * 8;
        const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)h)),
                                                     _mm_loadu_si128((const __m128i*)(h + (int64_t)in * 8)), 1);
        return BF ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16)) : _mm512_cvtph_ps(both);
    }
    __m512 qf;
    if (BITS == 4) {
        const uint32_t* w = (const uint32_t*)codes + c * in + i;
        const __m512i both = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)w[0]), 0xFF00, (int)w[in]);
        qf = _mm512_cvtepu32_ps(_mm512_and_si512(both, _mm512_loadu_si512(NIBBLES16)));
    } else {
        const int8_t* b = (const int8_t*)codes + (c * in + i) * 8;
        const __m128i lo = _mm_loadl_epi64((const __m128i*)b);
        qf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(lo), (const double*)(b + (int64_t)in * 8)))));
    }
    return HAS_M ? _mm512_fmadd_ps(dv, qf, mv) : _mm512_mul_ps(dv, qf);  /* exact d q: BLOCK_PRODUCT_EXACT */
}

/* the 8 + 8 values of column blocks c and c + 1 at group g of a (out / 8, groups, 8) array, as fp32 (exact): fp16,
 * or fp32 (F32) */
static inline __attribute__((always_inline)) __m512 pair16(const void* a, int64_t c, int groups, int g, const int F32,
                                                           const int KS, const int G, int64_t sup) {
    if (KS) {
        const __m256 lo = kscale8(a, c, groups, g, G, sup), hi = kscale8(a, c + 1, groups, g, G, sup);
        return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
    }
    if (F32) {
        const float* f = (const float*)a;
        const __m256 lo = _mm256_loadu_ps(f + (c * groups + g) * 8), hi = _mm256_loadu_ps(f + ((c + 1) * groups + g) * 8);
        return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
    }
    const uint16_t* h = (const uint16_t*)a;
    const __m128i lo = _mm_loadu_si128((const __m128i*)(h + (c * groups + g) * 8));
    const __m128i hi = _mm_loadu_si128((const __m128i*)(h + ((c + 1) * groups + g) * 8));
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

/* tile() on 16 lanes: y[m, 8 c0 : 8 (c0 + 2 NP)) for R rows and the NP column-block pairs from c0 (c0 even); with
 * PF, each group also prefetches the same group of the next 2 NP column blocks below c1 (the thread's end) */
static inline __attribute__((always_inline)) void tile16(const float* x, const int R, int in, const void* codes,
                                                         const int BITS, const int BF, const void* d, const void* m,
                                                         const int HAS_M, const int F32, const int KS, const int G,
                                                         int64_t c0, const int NP, float* y, int out, const int PF,
                                                         int64_t c1) {
    __m512 acc[16];  /* R * NP <= 16 */
    for (int a = 0; a < R * NP; ++a) acc[a] = _mm512_setzero_ps();
    const int groups = in / G;
    const int64_t sup = (int64_t)out * groups;  /* KS: the super-block values' byte offset */
    for (int g = 0; g < groups; ++g) {
        __m512 dv[4], mv[4];
        for (int p = 0; p < NP; ++p) {
            dv[p] = BITS == 16 ? _mm512_setzero_ps() : pair16(d, c0 + 2 * p, groups, g, F32, KS, G, sup);
            if (BITS == 4) dv[p] = _mm512_mul_ps(dv[p], _mm512_loadu_ps(UNSHIFT16));  /* d 2^-s: exact */
            mv[p] = HAS_M ? pair16(m, c0 + 2 * p, groups, g, F32, KS, G, sup) : _mm512_setzero_ps();
        }
        if (PF) prefetch_group(codes, BITS, d, m, HAS_M, F32, KS, G, c0 + 2 * NP, c0 + 4 * NP < c1 ? c0 + 4 * NP : c1,
                               in, groups, g, sup);
        for (int i = g * G; i < (g + 1) * G; ++i) {
            __m512 w[4];
            for (int p = 0; p < NP; ++p) w[p] = weights16(codes, BITS, BF, c0 + 2 * p, in, i, dv[p], mv[p], HAS_M);
            for (int r = 0; r < R; ++r) {
                const __m512 xb = _mm512_set1_ps(x[(int64_t)r * in + i]);
                for (int p = 0; p < NP; ++p) acc[r * NP + p] = _mm512_fmadd_ps(xb, w[p], acc[r * NP + p]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int p = 0; p < NP; ++p) _mm512_storeu_ps(y + (int64_t)r * out + 8 * (c0 + 2 * p), acc[r * NP + p]);
}

/* One thread's column blocks [c0, c1) (a multiple of 4), all M rows: one or two rows over 8 column blocks at a time
 * (4 independent FMA chains a row, so a one-row product is not bound by FMA latency), more rows over 4 (2 pairs),
 * up to 8 rows a pass; a pass over a span's first rows prefetches the next span while it is the thread's. */
#define TILE16(BITS, HAS_M, R, NP, PF) tile16(xm, R, in, codes, BITS, BF, d, m, HAS_M, F32, KS, G, cq, NP, ym, out, PF, c1)
#define SPAN16(BITS, HAS_M)                                                                                        \
    for (int64_t cq = c0, span; cq < c1; cq += span) {                                                             \
        span = M <= 2 && cq + 8 <= c1 ? 8 : 4;                                                                     \
        for (int m0 = 0; m0 < M; m0 += 8) {                                                                        \
            const int rows = M - m0 < 8 ? M - m0 : 8, pf = m0 == 0 && cq + span < c1;                              \
            const float* xm = x + (int64_t)m0 * in;                                                                \
            float* ym = y + (int64_t)m0 * out;                                                                     \
            if (span == 8) {                                                                                       \
                if (rows == 1) { if (pf) TILE16(BITS, HAS_M, 1, 4, 1); else TILE16(BITS, HAS_M, 1, 4, 0); }        \
                else { if (pf) TILE16(BITS, HAS_M, 2, 4, 1); else TILE16(BITS, HAS_M, 2, 4, 0); }                  \
            } else switch (rows * 2 + pf) {                                                                        \
                case 2: TILE16(BITS, HAS_M, 1, 2, 0); break;                                                       \
                case 3: TILE16(BITS, HAS_M, 1, 2, 1); break;                                                       \
                case 4: TILE16(BITS, HAS_M, 2, 2, 0); break;                                                       \
                case 5: TILE16(BITS, HAS_M, 2, 2, 1); break;                                                       \
                case 6: TILE16(BITS, HAS_M, 3, 2, 0); break;                                                       \
                case 7: TILE16(BITS, HAS_M, 3, 2, 1); break;                                                       \
                case 8: TILE16(BITS, HAS_M, 4, 2, 0); break;                                                       \
                case 9: TILE16(BITS, HAS_M, 4, 2, 1); break;                                                       \
                case 10: TILE16(BITS, HAS_M, 5, 2, 0); break;                                                      \
                case 11: TILE16(BITS, HAS_M, 5, 2, 1); break;                                                      \
                case 12: TILE16(BITS, HAS_M, 6, 2, 0); break;                                                      \
                case 13: TILE16(BITS, HAS_M, 6, 2, 1); break;                                                      \
                case 14: TILE16(BITS, HAS_M, 7, 2, 0); break;                                                      \
                case 15: TILE16(BITS, HAS_M, 7, 2, 1); break;                                                      \
                case 16: TILE16(BITS, HAS_M, 8, 2, 0); break;                                                      \
                default: TILE16(BITS, HAS_M, 8, 2, 1); break;                                                      \
            }                                                                                                      \
        }                                                                                                          \
    }
#endif
#endif  /* __AVX2__ */

/* bits: the code width (4, 8, or 16: the weights themselves, fp16 or with BC_BF16 bf16, no scales) plus BC_F32 (d and m
 * are fp32 arrays: a K-quant's per-group scale d_sb sc and minimum dmin_sb mc, exact products of an fp16 and a 6- or
 * 8-bit integer), BC_KS (d and m are those factors as the file keeps them: int8 sub-block values, then fp16 super-block
 * values, kscale8; in a multiple of 256) and BC_G16 (groups of 16 inputs: Q6_K's). 256 is taken (decode_step.c's
 * Q8_ACTIVATIONS). */
#define BC_F32 32
#define BC_G16 64
#define BC_BF16 128
#define BC_KS 512
/* the formats the exact product is built for: fp16 scales, groups of 32 (Q4_0, Q4_1, Q5_0, Q8_0); a K-quant's stored
 * scales (KS), groups of 32 (Q4_K 4-bit with minima, Q5_K 8-bit with minima, their fusion) or 16 (Q6_K, and with
 * minima a fusion of Q6_K with Q4_K or Q5_K); fp32 scales in the same shapes (a fusion of K-quants with the fp16-scale
 * types); 2-byte weights (a bf16 or fp16 checkpoint). DISPATCH(BODY) runs BODY(BITS, HAS_M) with F32, KS, G and BF
 * constants in scope. */
#define DISPATCH(BODY)                                                                                             \
    switch (bits | (m ? 1 : 0)) {                                                                                  \
        case 4 | 1: { const int F32 = 0, KS = 0, G = 32, BF = 0; BODY(4, 1) } break;                               \
        case 4: { const int F32 = 0, KS = 0, G = 32, BF = 0; BODY(4, 0) } break;                                   \
        case 8 | 1: { const int F32 = 0, KS = 0, G = 32, BF = 0; BODY(8, 1) } break;                               \
        case 8: { const int F32 = 0, KS = 0, G = 32, BF = 0; BODY(8, 0) } break;                                   \
        case 4 | BC_KS | 1: { const int F32 = 0, KS = 1, G = 32, BF = 0; BODY(4, 1) } break;                       \
        case 8 | BC_KS | 1: { const int F32 = 0, KS = 1, G = 32, BF = 0; BODY(8, 1) } break;                       \
        case 8 | BC_KS | BC_G16: { const int F32 = 0, KS = 1, G = 16, BF = 0; BODY(8, 0) } break;                  \
        case 8 | BC_KS | BC_G16 | 1: { const int F32 = 0, KS = 1, G = 16, BF = 0; BODY(8, 1) } break;              \
        case 4 | BC_F32 | 1: { const int F32 = 1, KS = 0, G = 32, BF = 0; BODY(4, 1) } break;                      \
        case 8 | BC_F32 | 1: { const int F32 = 1, KS = 0, G = 32, BF = 0; BODY(8, 1) } break;                      \
        case 8 | BC_F32: { const int F32 = 1, KS = 0, G = 32, BF = 0; BODY(8, 0) } break;                          \
        case 8 | BC_F32 | BC_G16: { const int F32 = 1, KS = 0, G = 16, BF = 0; BODY(8, 0) } break;                 \
        case 8 | BC_F32 | BC_G16 | 1: { const int F32 = 1, KS = 0, G = 16, BF = 0; BODY(8, 1) } break;             \
        case 16: { const int F32 = 0, KS = 0, G = 32, BF = 0; BODY(16, 0) } break;                                 \
        default: { const int F32 = 0, KS = 0, G = 32, BF = 1; BODY(16, 0) } break; /* 16 | BC_BF16 */              \
    }

/* an fp16 value's bits as fp32, exactly (the portable build's _cvtsh_ss) */
static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, man = h & 1023u;
    if (e == 0) {  /* zero or subnormal: man 2^-24, a normal fp32 */
        const float f = (float)man * 0x1p-24f;
        return sign ? -f : f;
    }
    const uint32_t u = sign | (e == 31 ? 0x7f800000u | (man << 13) : ((e + 112u) << 23) | (man << 13));
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#if defined(__AVX2__)
#define H2F(h) _cvtsh_ss(h)
#else
#define H2F(h) h2f(h)
#endif

static int format_ok(int bits, const void* m, int in) {
    switch (bits | (m ? 1 : 0)) {
        case 4 | 1: case 4: case 8 | 1: case 8: case 4 | BC_F32 | 1: case 8 | BC_F32 | 1: case 8 | BC_F32:
        case 8 | BC_F32 | BC_G16: case 8 | BC_F32 | BC_G16 | 1: case 16: case 16 | BC_BF16:
            return 1;
        case 4 | BC_KS | 1: case 8 | BC_KS | 1: case 8 | BC_KS | BC_G16: case 8 | BC_KS | BC_G16 | 1:
            return in % 256 == 0;  /* whole super-blocks */
        default:
            return 0;
    }
}

/* x: (M, in) fp32 contiguous, y: (M, out) fp32; codes, d, m as above (d, m fp32 with BC_F32, (out / 8, in / G, 8);
 * with BC_KS int8 (out / 8, in / G, 8) then fp16 (out / 8, in / 256, 8)); in
 * a multiple of 32, out of 32 (4 column blocks per one-row step). Returns 0, or -1 for arguments outside what the
 * kernel handles (nothing written). */
#if defined(__AVX2__)
int triforce_blockcode_linear(const float* x, const void* codes, int bits, const void* d, const void* m, float* y,
                              int M, int in, int out, int nthreads) {
    if (M < 1 || M > MAX_ROWS || in < GROUP || in % GROUP || out < 32 || out % 32 || !format_ok(bits, m, in)
        || nthreads < 1)
        return -1;
    const int64_t quads = out / 32;  /* 4 column blocks each, a contiguous range of them per thread */
    #pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t c0 = 4 * (quads * t / nt), c1 = 4 * (quads * (t + 1) / nt);  /* this thread's column blocks */
#ifdef __AVX512F__
        DISPATCH(SPAN16)
#else
        for (int64_t cq = c0; cq < c1; cq += 4)
            for (int m0 = 0; m0 < M; m0 += 8) {
                const int rows = M - m0 < 8 ? M - m0 : 8, pf = m0 == 0;
                const float* xm = x + (int64_t)m0 * in;
                float* ym = y + (int64_t)m0 * out;
                DISPATCH(ROWS)
            }
#endif
    }
    return 0;
}



/* ---- Integer dot products over the same codes: the file's own arithmetic ----
 *
 * A GGUF model's users run it as llama.cpp computes it: each row's activations quantized to int8, integer dot
 * products with the file's codes (ggml-quants.c). Here each row's activations are quantized per block of 32 inputs
 * (xq = round(x / dx), dx = max |x| / 127; llama.cpp's Q8_0, for every weight type) and each scale group's sum is an
 * integer dot product of codes and xq:
 *
 *     y[o] = sum_g d[g, o] dx[g] sum_{i in g} q[i, o] xq[i]  +  m[g, o] sum_{i in g} x[i]
 *
 * (the minima's term with the exact fp32 sum of the group's inputs), the groups added in one fixed order with a
 * multiply and an add each. A row's result depends on that row alone, on every build (the integers are exact; the
 * float steps are the same operations in the same order): row-invariant by construction, so the verifier may use it
 * (the ``file`` precision) as the tiers below it do. The same formula takes the K-quants' codes (BC_F32 or BC_KS:
 * d sc and -(dmin mc) per 32 inputs for Q4_K and Q5_K, per 16 for Q6_K, BC_G16; llama.cpp's vec_dot_q*_K_q8_K sums
 * the same sub-blocks with activations quantized per 256, we per 32). Q8_0 codes must lie in [-127, 127] (vpsignb
 * cannot negate -128; the Python side checks). xp: the rows' activations laid out for the byte shuffles below
 * (prepare_rows); dx: (M, in / 32) the blocks' scales; sx: (M, in / G) the scale groups' fp32 input sums. */

/* 4-bit codes: 8 inputs (one 32-byte load: 8 words of 8 nibbles) -> per lane, the 4 inputs' products summed for the
 * even outputs (lo) and the odd ones (hi) of the column block; xp lane k = the 4 inputs' xq repeated 4 times */
static inline __attribute__((always_inline)) void dot4_step(__m256i v, const __m256i* xp, const int R, int64_t xstride,
                                                            __m256i* lo, __m256i* hi) {
    const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    /* byte 4j + b of a lane is word j's byte b (outputs 2b, 2b + 1 at input j); to 4b + j: each output's 4 inputs */
    const __m256i tr = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                        0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i ql = _mm256_shuffle_epi8(_mm256_and_si256(v, nib), tr);
    const __m256i qh = _mm256_shuffle_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), tr);
    for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_load_si256(xp + r * xstride);
#ifdef __AVX512VNNI__  /* the 4 products of each lane summed in one instruction: the same integers (no saturation
                        * above: |15 * 127 * 2| < 2^15) */
        (void)ones;
        lo[r] = _mm256_dpbusd_epi32(lo[r], ql, x);
        hi[r] = _mm256_dpbusd_epi32(hi[r], qh, x);
#else
        lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ql, x), ones));
        hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(qh, x), ones));
#endif
    }
}

/* 8-bit codes: 8 inputs (two 32-byte loads of 4 inputs x 8 outputs) -> per lane, the lane's inputs' products summed
 * for outputs 0-3 (a) and 4-7 (b); xp: per 4 inputs, lane k = inputs 2k, 2k + 1 interleaved 8 times */
static inline __attribute__((always_inline)) void dot8_step(__m256i v0, __m256i v1, const __m256i* xp, const int R,
                                                            int64_t xstride, __m256i* a, __m256i* b) {
    const __m256i ones = _mm256_set1_epi16(1);
    /* bytes (input 2k, outputs 0-7), (input 2k + 1, outputs 0-7) -> (output o: input 2k, input 2k + 1) */
    const __m256i il = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                        0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m256i q0 = _mm256_shuffle_epi8(v0, il), q1 = _mm256_shuffle_epi8(v1, il);
    for (int r = 0; r < R; ++r) {
        const __m256i x0 = _mm256_load_si256(xp + r * xstride), x1 = _mm256_load_si256(xp + r * xstride + 1);
        const __m256i p0 = _mm256_maddubs_epi16(_mm256_abs_epi8(x0), _mm256_sign_epi8(q0, x0));  /* (lane, o) */
        const __m256i p1 = _mm256_maddubs_epi16(_mm256_abs_epi8(x1), _mm256_sign_epi8(q1, x1));
        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(_mm256_unpacklo_epi16(p0, p1), ones));
        b[r] = _mm256_add_epi32(b[r], _mm256_madd_epi16(_mm256_unpackhi_epi16(p0, p1), ones));
    }
}

/* acc[r] += the block's integer sums (s0, s1: dot4_step's or dot8_step's lanes) times dv dx, plus mv sx, for R rows:
 * a multiply and an add each (no FMA, the flags forbid contraction), so that every build, the portable one included,
 * rounds alike */
static inline __attribute__((always_inline)) void add_block(__m256* acc, const __m256i* s0, const __m256i* s1,
                                                            const int R, const int BITS, __m256 dv, __m256 mv,
                                                            const int HAS_M, const float* dx, int64_t dstride,
                                                            const float* sx, int64_t sstride) {
    for (int r = 0; r < R; ++r) {
        const __m128i u = _mm_add_epi32(_mm256_castsi256_si128(s0[r]), _mm256_extracti128_si256(s0[r], 1));
        const __m128i w = _mm_add_epi32(_mm256_castsi256_si128(s1[r]), _mm256_extracti128_si256(s1[r], 1));
        /* BITS 4: u = outputs 0 2 4 6, w = 1 3 5 7; BITS 8: u = 0-3, w = 4-7 */
        const __m256i iv = BITS == 4 ? _mm256_set_m128i(_mm_unpackhi_epi32(u, w), _mm_unpacklo_epi32(u, w))
                                     : _mm256_set_m128i(w, u);
        acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_cvtepi32_ps(iv),
                                                     _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * dstride]))));
        if (HAS_M) acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(mv, _mm256_set1_ps(sx[r * sstride])));
    }
}

/* y[r, 8 c : 8 c + 8) for R (<= 4) rows of column block c; G: inputs per scale (32, or 16 with 8-bit codes: Q6_K's
 * groups, two scales per block of the activations) */
static inline __attribute__((always_inline)) void dot_tile(const __m256i* xp, const float* dx, const float* sx,
                                                           const int R, int in, const void* codes, const int BITS,
                                                           const void* d, const void* m, const int HAS_M, const int F32,
                                                           const int KS, const int G, int64_t c, int out, float* y,
                                                           const int PF) {
    const int ds = KS ? 1 : F32 ? 4 : 2;  /* bytes of a (sub-block) scale or minimum: int8 (KS), fp32 or fp16 */
    const int groups = in / GROUP, gs = in / G;  /* activation blocks, scale groups */
    const int64_t sup = (int64_t)out * gs;  /* KS: the super-block values' byte offset */
    const int64_t xstride = (int64_t)in * BITS / 32;  /* 32-byte vectors per row: 4 bytes (BITS 4) or 8 an input */
    __m256 acc[4];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        const char* cg = (const char*)codes + (c * in + g * GROUP) * BITS;  /* the block's codes: 32 BITS bytes */
        if (PF) {
            const char* cn = cg + (int64_t)in * BITS;  /* the next column block's */
            for (int o = 0; o < GROUP * BITS; o += 64) _mm_prefetch(cn + o, _MM_HINT_T0);
            for (int h = 0; h < GROUP / G; ++h) {
                const int64_t gi = (c + 1) * gs + g * (GROUP / G) + h;
                _mm_prefetch((const char*)d + gi * 8 * ds, _MM_HINT_T0);
                if (HAS_M) _mm_prefetch((const char*)m + gi * 8 * ds, _MM_HINT_T0);
            }
            if (KS && g % 8 == 0) {  /* the super-block's fp16 values */
                const int64_t s = sup + ((c + 1) * (in / 256) + g / 8) * 16;
                _mm_prefetch((const char*)d + s, _MM_HINT_T0);
                if (HAS_M) _mm_prefetch((const char*)m + s, _MM_HINT_T0);
            }
        }
        __m256i s0[4], s1[4];
        const __m256i* xg = xp + (int64_t)g * GROUP * BITS / 32;
        const float* dg = dx + g;
        if (BITS == 4) {
            for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
            for (int k = 0; k < 4; ++k)
                dot4_step(_mm256_loadu_si256((const __m256i*)cg + k), xg + k, R, xstride, s0, s1);
            const __m256 dv = group8(d, c, gs, g, F32, KS, G, sup);
            const __m256 mv = HAS_M ? group8(m, c, gs, g, F32, KS, G, sup) : _mm256_setzero_ps();
            add_block(acc, s0, s1, R, BITS, dv, mv, HAS_M, dg, groups, sx + g, gs);
        } else {
            for (int h = 0; h < GROUP / G; ++h) {  /* G 16: each half of the block with its own scale */
                const int per = 8 * G / GROUP, gi = g * (GROUP / G) + h;  /* 2-vector steps a scale group */
                for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
                for (int k = per * h; k < per * (h + 1); k += 2)
                    dot8_step(_mm256_loadu_si256((const __m256i*)cg + k),
                              _mm256_loadu_si256((const __m256i*)cg + k + 1), xg + k, R, xstride, s0, s1);
                const __m256 dv = group8(d, c, gs, gi, F32, KS, G, sup);
                const __m256 mv = HAS_M ? group8(m, c, gs, gi, F32, KS, G, sup) : _mm256_setzero_ps();
                add_block(acc, s0, s1, R, BITS, dv, mv, HAS_M, dg, groups, sx + gi, gs);
            }
        }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (int64_t)r * out + 8 * c, acc[r]);
}

/* x (M, in) -> xp, dx, sx of the layout above (one row's xp: in BITS bytes). Each group's 32 codes are rounded in
 * 8 lanes (vcvtps2dq rounds to nearest even, as lrintf does in the default rounding mode) and laid out with shuffles;
 * the inputs' sum stays one sequential chain. Serial (it runs before the product's parallel region): scalar, it
 * took about 6% of a retrieval step's master thread on SmolLM2 (perf), its partner spinning meanwhile. */
static void prepare_rows(const float* x, int M, int in, int bits, int G, int8_t* xp, float* dx, float* sx) {
    const int groups = in / GROUP;
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  /* packs' lane interleave -> input order */
    for (int r = 0; r < M; ++r)
        for (int g = 0; g < groups; ++g) {
            const float* xg = x + (int64_t)r * in + g * GROUP;
            __m256 v[4], a = _mm256_setzero_ps();
            for (int k = 0; k < 4; ++k) {
                v[k] = _mm256_loadu_ps(xg + 8 * k);
                a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[k]));
            }
            __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(a4, _mm_movehdup_ps(a4)));  /* max |x|: any order */
            for (int h = 0; h < GROUP / G; ++h) {  /* the inputs' sums per scale group, each one chain in order */
                float s = 0.f;
                for (int i = h * G; i < (h + 1) * G; ++i) s += xg[i];
                sx[(int64_t)r * (in / G) + g * (GROUP / G) + h] = s;
            }
            const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            const __m256 iv = _mm256_set1_ps(inv);
            __m256i q[4];
            for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], iv));  /* |q| <= 127 */
            const __m256i codes = _mm256_permutevar8x32_epi32(  /* the 32 codes in input order */
                _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
            dx[(int64_t)r * groups + g] = scale;
            int8_t* o = xp + ((int64_t)r * in + g * GROUP) * bits;
            if (bits == 4) {  /* per 8 inputs, 32 bytes: inputs 0-3's codes 4 times, then inputs 4-7's */
                for (int t = 0; t < 4; ++t)
                    _mm256_storeu_si256((__m256i*)(o + 32 * t), _mm256_permutevar8x32_epi32(
                        codes, _mm256_setr_epi32(2 * t, 2 * t, 2 * t, 2 * t, 2 * t + 1, 2 * t + 1, 2 * t + 1, 2 * t + 1)));
            } else {  /* 16 bytes per pair of inputs (2 m, 2 m + 1): the pair 8 times */
                uint16_t pairs[16];
                _mm256_storeu_si256((__m256i*)pairs, codes);
                for (int m = 0; m < 16; ++m) _mm_storeu_si128((__m128i*)(o + 16 * m), _mm_set1_epi16((short)pairs[m]));
            }
        }
}

/* As triforce_blockcode_linear, with the rows' activations quantized to int8 (above); work: M * in * bits bytes,
 * 32-byte aligned, then 2 M in / 32 floats. Returns 0, or -1 for arguments outside what the kernel handles. */
int triforce_blockcode_linear_q8(const float* x, const void* codes, int bits, const void* d, const void* m,
                                 float* y, int M, int in, int out, int nthreads, void* work) {
    /* fp32 scales and minima per 32 inputs, or the file's (KS): Q4_K (4-bit), Q5_K (8-bit); G16: Q6_K (8-bit) */
    const int f32 = (bits & BC_F32) != 0, ks = (bits & BC_KS) != 0, G = (bits & BC_G16) ? 16 : 32;
    bits &= ~(BC_F32 | BC_KS | BC_G16);
    if (M < 1 || M > MAX_ROWS || in < GROUP || in % GROUP || out < 32 || out % 32 || (bits != 4 && bits != 8)
        || nthreads < 1 || ((uintptr_t)work & 31) || (f32 && ks) || (ks && in % 256) || (G == 16 && bits != 8)
        || (G == 16 && !f32 && !ks))
        return -1;
    int8_t* const xp = (int8_t*)work;
    float* const dx = (float*)(xp + (int64_t)M * in * bits);
    float* const sx = dx + (int64_t)M * (in / GROUP);
    prepare_rows(x, M, in, bits, G, xp, dx, sx);
    const int64_t quads = out / 32, groups = in / GROUP, xrow = (int64_t)in * bits / 32;
    #pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t c0 = 4 * (quads * t / nt), c1 = 4 * (quads * (t + 1) / nt);  /* this thread's column blocks */
        for (int64_t c = c0; c < c1; ++c)
            for (int r0 = 0; r0 < M; r0 += 4) {
                const int R = M - r0 < 4 ? M - r0 : 4, pf = r0 == 0 && c + 1 < c1;
                const __m256i* xr = (const __m256i*)xp + r0 * xrow;
                const float *dr = dx + r0 * groups, *sr = sx + (int64_t)r0 * (in / G);
                float* yr = y + (int64_t)r0 * out;
#define DOT_TILE(BITS, HAS_M, F32, KS, G)                                                                              \
    switch (R * 2 + (pf ? 1 : 0)) {                                                                                    \
        case 2: dot_tile(xr, dr, sr, 1, in, codes, BITS, d, m, HAS_M, F32, KS, G, c, out, yr, 0); break;               \
        case 3: dot_tile(xr, dr, sr, 1, in, codes, BITS, d, m, HAS_M, F32, KS, G, c, out, yr, 1); break;               \
        case 4: dot_tile(xr, dr, sr, 2, in, codes, BITS, d, m, HAS_M, F32, KS, G, c, out, yr, 0); break;               \
        case 5: dot_tile(xr, dr, sr, 2, in, codes, BITS, d, m, HAS_M, F32, KS, G, c, out, yr, 1); break;               \
        case 6: dot_tile(xr, dr, sr, 3, in, codes, BITS, d, m, HAS_M, F32, KS, G, c, out, yr, 0); break;               \
        case 7: dot_tile(xr, dr, sr, 3, in, codes, BITS, d, m, HAS_M, F32, KS, G, c, out, yr, 1); break;               \
        case 8: dot_tile(xr, dr, sr, 4, in, codes, BITS, d, m, HAS_M, F32, KS, G, c, out, yr, 0); break;               \
        default: dot_tile(xr, dr, sr, 4, in, codes, BITS, d, m, HAS_M, F32, KS, G, c, out, yr, 1); break;              \
    }
                if (G == 16) {  /* Q6_K, alone (KS) or fused with Q4_K or Q5_K (minima) */
                    if (ks && m) { DOT_TILE(8, 1, 0, 1, 16) }
                    else if (ks) { DOT_TILE(8, 0, 0, 1, 16) }
                    else if (m) { DOT_TILE(8, 1, 1, 0, 16) }
                    else { DOT_TILE(8, 0, 1, 0, 16) }
                } else if (ks) {  /* K-quants' scales and minima as stored: sc, mc and d, -dmin */
                    if (bits == 4 && m) { DOT_TILE(4, 1, 0, 1, 32) }
                    else if (bits == 4) { DOT_TILE(4, 0, 0, 1, 32) }
                    else if (m) { DOT_TILE(8, 1, 0, 1, 32) }
                    else { DOT_TILE(8, 0, 0, 1, 32) }
                } else if (f32) {  /* K-quants' scales and minima: d sc and -(dmin mc) as fp32 */
                    if (bits == 4 && m) { DOT_TILE(4, 1, 1, 0, 32) }
                    else if (bits == 4) { DOT_TILE(4, 0, 1, 0, 32) }
                    else if (m) { DOT_TILE(8, 1, 1, 0, 32) }
                    else { DOT_TILE(8, 0, 1, 0, 32) }
                } else if (bits == 4 && m) { DOT_TILE(4, 1, 0, 0, 32) }
                else if (bits == 4) { DOT_TILE(4, 0, 0, 0, 32) }
                else if (m) { DOT_TILE(8, 1, 0, 0, 32) }
                else { DOT_TILE(8, 0, 0, 0, 32) }
#undef DOT_TILE
            }
    }
    return 0;
}

/* the fp16 value k steps from h (positive halves are ordered as their bits), as fp32 */
static inline __m256 half_step(__m128i h, int k) {
    return _mm256_cvtph_ps(_mm_add_epi16(h, _mm_set1_epi16((short)k)));
}

/* One block of triforce_blockcode_fit (below the portable branch): item it = c * groups + g, the 32 inputs of group g
 * for outputs 8 c .. 8 c + 7, all 8 lanes at once. Writes its codes, d and m and returns 0 when every weight is
 * reproduced exactly; returns 1 (writing nothing) when one is not. */
static int fit_item(const float* w, int in, int out, int bits, int64_t it, int groups, void* codes, uint16_t* d,
                    uint16_t* m) {
    const int64_t c = it / groups;
    const int g = (int)(it % groups);
    __m256 col[GROUP];  /* the block's 32 inputs for 8 outputs */
    for (int j = 0; j < GROUP; ++j) col[j] = _mm256_loadu_ps(w + (int64_t)(g * GROUP + j) * out + 8 * c);
    __m256 lo = col[0], hi = col[0];
    for (int j = 1; j < GROUP; ++j) {
        lo = _mm256_min_ps(lo, col[j]);
        hi = _mm256_max_ps(hi, col[j]);
    }
    const __m256 absmax = _mm256_max_ps(hi, _mm256_sub_ps(_mm256_setzero_ps(), lo));
    const __m256 base = bits == 4 ? _mm256_div_ps(_mm256_sub_ps(hi, lo), _mm256_set1_ps(15.f))
                                  : _mm256_div_ps(absmax, _mm256_set1_ps(127.f));
    const __m256 mv = bits == 4 ? lo : _mm256_setzero_ps();
    const __m128i h = _mm256_cvtps_ph(base, _MM_FROUND_TO_NEAREST_INT);
    const float qlo = bits == 4 ? 0.f : -128.f, qhi = bits == 4 ? 15.f : 127.f;
    __m256 dv = _mm256_setzero_ps();
    int done = 0;  /* lanes reproduced exactly */
    __m256 qs[GROUP];
    static const int steps[5] = {0, 1, -1, 2, -2};
    for (int s = 0; s < 5 && done != 0xFF; ++s) {
        const __m256 cand = half_step(h, steps[s]);
        const __m256 pos = _mm256_cmp_ps(cand, _mm256_setzero_ps(), _CMP_GT_OQ);
        const __m256 safe = _mm256_blendv_ps(_mm256_set1_ps(1.f), cand, pos);
        int ok = 0xFF & _mm256_movemask_ps(_mm256_cmp_ps(cand, cand, _CMP_ORD_Q));  /* not NaN */
        __m256 q[GROUP];
        for (int j = 0; j < GROUP && ok; ++j) {
            __m256 x = bits == 4 ? _mm256_sub_ps(col[j], mv) : col[j];
            x = _mm256_round_ps(_mm256_div_ps(x, safe), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            x = _mm256_and_ps(x, pos);  /* a zero scale: code 0 */
            q[j] = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(qlo)), _mm256_set1_ps(qhi));
            __m256 rec = _mm256_mul_ps(cand, q[j]);
            if (bits == 4) rec = _mm256_add_ps(rec, mv);
            ok &= _mm256_movemask_ps(_mm256_cmp_ps(rec, col[j], _CMP_EQ_OQ));
        }
        const int take = ok & ~done;  /* lanes this candidate reproduces, not yet taken */
        if (take) {
            const __m256 sel = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                _mm256_and_si256(_mm256_set1_epi32(take), _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128)),
                _mm256_setzero_si256()));
            dv = _mm256_blendv_ps(dv, cand, sel);
            for (int j = 0; j < GROUP; ++j) qs[j] = s == 0 ? q[j] : _mm256_blendv_ps(qs[j], q[j], sel);
            done |= take;
        }
    }
    /* the minima are stored as fp16 too: a Q4_1 block's minimum is its fp16 m (the weight of code 0) */
    const __m128i mh = _mm256_cvtps_ph(mv, _MM_FROUND_TO_NEAREST_INT);
    if (done != 0xFF || (bits == 4 && _mm256_movemask_ps(_mm256_cmp_ps(_mm256_cvtph_ps(mh), mv, _CMP_EQ_OQ)) != 0xFF)) {
        return 1;
    }
    /* (c, g) -> (c * groups + g) * 8; every candidate scale is an fp16 value, so both conversions are exact */
    _mm_storeu_si128((__m128i*)(d + it * 8), _mm256_cvtps_ph(dv, _MM_FROUND_TO_NEAREST_INT));
    if (bits == 4) {
        _mm_storeu_si128((__m128i*)(m + it * 8), mh);
        uint32_t* cw = (uint32_t*)codes + c * in + g * GROUP;
        for (int j = 0; j < GROUP; ++j) {
            const __m256i qi = _mm256_sllv_epi32(_mm256_cvtps_epi32(qs[j]), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
            __m128i s4 = _mm_or_si128(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
            s4 = _mm_or_si128(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_or_si128(s4, _mm_shuffle_epi32(s4, 0xB1));
            cw[j] = (uint32_t)_mm_cvtsi128_si32(s4);
        }
    } else {
        int8_t* cb = (int8_t*)codes + (c * in + g * GROUP) * 8;
        for (int j = 0; j < GROUP; ++j) {
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i*)lanes, _mm256_cvtps_epi32(qs[j]));
            for (int k = 0; k < 8; ++k) cb[j * 8 + k] = (int8_t)lanes[k];
        }
    }
    return 0;
}

#else  /* portable: no ISA flags (a CPU without AVX2, or aarch64) */

/* MADD: the portable builds' multiply-add, as csrc/qlinear.c's portable branch uses it. Each y[m, o] below is one MADD
 * chain over i = 0 .. in-1 from +0 of the same fp32 weights, so the exact product is bitwise the portable
 * triforce_f32_linear over the dequantized weights, whatever M and the other rows. */
#include "common.h"

/* the 8 scales (or minima) of column block c at group g as fp32, exactly: fp16, fp32 (F32) or a K-quant's int8 group
 * value times its fp16 super-block value (KS: exact, kscale8 above) */
static void group_values(const void* p, int64_t c, int groups, int g, int F32, int KS, int G, int64_t sup,
                         float* v) {
    const int64_t s = (c * groups + g) * 8;
    for (int k = 0; k < 8; ++k) {
        if (KS) {
            const int per = 256 / G;
            const int64_t h = (c * (groups / per) + g / per) * 8 + k;
            v[k] = h2f(((const uint16_t*)((const char*)p + sup))[h]) * (float)((const int8_t*)p)[s + k];
        } else {
            v[k] = F32 ? ((const float*)p)[s + k] : h2f(((const uint16_t*)p)[s + k]);
        }
    }
}

/* The exact product (the layout and formats of the AVX2 path) for column block c, all M rows: each group's 8 x G
 * weights dequantized once into a tile, w = fl(fl(d q) + m) (d q exact: BLOCK_PRODUCT_EXACT, so one rounding), or the
 * 2-byte weights widened exactly; then every row's chains take the tile's inputs in order. The format's parameters
 * are constants after inlining (DISPATCH), so the compiler unrolls and vectorises the tile's 8 lanes. */
static inline __attribute__((always_inline)) void p_column(const float* x, const void* codes, const void* d,
                                                           const void* m, float* y, int M, int in, int out, int c,
                                                           const int BITS, const int HAS_M, const int F32, const int KS,
                                                           const int G, const int BF) {
    const int groups = in / G;
    const int64_t sup = (int64_t)out * groups;  /* KS: the super-block values' byte offset */
    float acc[MAX_ROWS][8];
    for (int r = 0; r < M; ++r)
        for (int k = 0; k < 8; ++k) acc[r][k] = 0.f;
    for (int g = 0; g < groups; ++g) {
        float dv[8] = {0}, mv[8] = {0}, wt[32][8];
        if (BITS != 16) {
            group_values(d, c, groups, g, F32, KS, G, sup, dv);
            if (HAS_M) group_values(m, c, groups, g, F32, KS, G, sup, mv);
        }
        for (int i = 0; i < G; ++i) {
            const int64_t ci = (int64_t)c * in + g * G + i;
            if (BITS == 16) {
                const uint16_t* h = (const uint16_t*)codes + ci * 8;
                for (int k = 0; k < 8; ++k) {
                    if (BF) {
                        const uint32_t u = (uint32_t)h[k] << 16;
                        memcpy(&wt[i][k], &u, 4);
                    } else {
                        wt[i][k] = h2f(h[k]);
                    }
                }
                continue;
            }
            int q[8];
            if (BITS == 4) {
                const uint32_t word = ((const uint32_t*)codes)[ci];
                for (int k = 0; k < 8; ++k) q[k] = (int)((word >> (4 * k)) & 15u);
            } else {
                for (int k = 0; k < 8; ++k) q[k] = ((const int8_t*)codes)[ci * 8 + k];
            }
            for (int k = 0; k < 8; ++k) wt[i][k] = HAS_M ? dv[k] * (float)q[k] + mv[k] : dv[k] * (float)q[k];
        }
        for (int r = 0; r < M; ++r) {  /* the row's 8 chains in locals, so that they stay in registers */
            const float* xr = x + (int64_t)r * in + g * G;
            float a[8];
            for (int k = 0; k < 8; ++k) a[k] = acc[r][k];
            for (int i = 0; i < G; ++i) {
                const float xi = xr[i];
                for (int k = 0; k < 8; ++k) a[k] = MADD(xi, wt[i][k], a[k]);
            }
            for (int k = 0; k < 8; ++k) acc[r][k] = a[k];
        }
    }
    for (int r = 0; r < M; ++r)
        for (int k = 0; k < 8; ++k) y[(int64_t)r * out + 8 * c + k] = acc[r][k];
}

#define P_COLUMN(BITS, HAS_M) p_column(x, codes, d, m, y, M, in, out, c, BITS, HAS_M, F32, KS, G, BF);

int triforce_blockcode_linear(const float* x, const void* codes, int bits, const void* d, const void* m, float* y,
                              int M, int in, int out, int nthreads) {
    if (M < 1 || M > MAX_ROWS || in < GROUP || in % GROUP || out < 32 || out % 32 || !format_ok(bits, m, in)
        || nthreads < 1)
        return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < out / 8; ++c) {
        DISPATCH(P_COLUMN)
    }
    return 0;
}

/* The integer dot products of the AVX2 path's definition, in plain C: each row's activations quantized per 32 inputs
 * (dx = max |x| / 127, xq = round-to-nearest-even of x (127 / max |x|), sx the inputs' fp32 sum per scale group, in
 * order), each scale group's integer sum exact, then per output acc = acc + isum fl(d_g dx) and acc = acc + m_g sx_g,
 * a multiply and an add each, in group order: bitwise the AVX2 and AVX-512 paths' results, whatever the rows. work:
 * xq (M in int8 at the start), dx and sx where the AVX2 path keeps them. */
int triforce_blockcode_linear_q8(const float* x, const void* codes, int bits, const void* d, const void* m,
                                 float* y, int M, int in, int out, int nthreads, void* work) {
    const int f32 = (bits & BC_F32) != 0, ks = (bits & BC_KS) != 0, G = (bits & BC_G16) ? 16 : 32;
    bits &= ~(BC_F32 | BC_KS | BC_G16);
    if (M < 1 || M > MAX_ROWS || in < GROUP || in % GROUP || out < 32 || out % 32 || (bits != 4 && bits != 8)
        || nthreads < 1 || ((uintptr_t)work & 31) || (f32 && ks) || (ks && in % 256) || (G == 16 && bits != 8)
        || (G == 16 && !f32 && !ks))
        return -1;
    int8_t* const xq = (int8_t*)work;
    float* const dx = (float*)(xq + (int64_t)M * in * bits);
    const int groups = in / GROUP, gs = in / G, halves = GROUP / G;
    float* const sx = dx + (int64_t)M * groups;
    for (int r = 0; r < M; ++r)
        for (int g = 0; g < groups; ++g) {
            const float* xg = x + (int64_t)r * in + g * GROUP;
            float amax = 0.f;
            for (int i = 0; i < GROUP; ++i) {
                const float a = fabsf(xg[i]);
                amax = a > amax ? a : amax;
            }
            for (int h = 0; h < halves; ++h) {
                float s = 0.f;
                for (int i = h * G; i < (h + 1) * G; ++i) s += xg[i];
                sx[(int64_t)r * gs + g * halves + h] = s;
            }
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int i = 0; i < GROUP; ++i) xq[(int64_t)r * in + g * GROUP + i] = (int8_t)lrintf(xg[i] * inv);
            dx[(int64_t)r * groups + g] = amax / 127.f;
        }
    const int64_t sup = (int64_t)out * gs;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = 0; c < out / 8; ++c) {
        float acc[MAX_ROWS][8];
        for (int r = 0; r < M; ++r)
            for (int k = 0; k < 8; ++k) acc[r][k] = 0.f;
        for (int g = 0; g < groups; ++g)
            for (int h = 0; h < halves; ++h) {
                const int gi = g * halves + h;
                float dv[8], mv[8] = {0};
                group_values(d, c, gs, gi, f32, ks, G, sup, dv);
                if (m) group_values(m, c, gs, gi, f32, ks, G, sup, mv);
                int qc[GROUP][8];
                for (int i = 0; i < G; ++i) {
                    const int64_t ci = (int64_t)c * in + g * GROUP + h * G + i;
                    for (int k = 0; k < 8; ++k)
                        qc[i][k] = bits == 4 ? (int)((((const uint32_t*)codes)[ci] >> (4 * k)) & 15u)
                                             : ((const int8_t*)codes)[ci * 8 + k];
                }
                for (int r = 0; r < M; ++r) {
                    const int8_t* xr = xq + (int64_t)r * in + g * GROUP + h * G;
                    int32_t isum[8] = {0};
                    for (int i = 0; i < G; ++i)
                        for (int k = 0; k < 8; ++k) isum[k] += qc[i][k] * xr[i];
                    const float dxg = dx[(int64_t)r * groups + g], sxg = sx[(int64_t)r * gs + gi];
                    for (int k = 0; k < 8; ++k) {  /* a multiply and an add (no fmaf): the AVX paths' rounding */
                        const float ds = dv[k] * dxg;
                        acc[r][k] = acc[r][k] + (float)isum[k] * ds;
                        if (m) acc[r][k] = acc[r][k] + mv[k] * sxg;
                    }
                }
            }
        for (int r = 0; r < M; ++r)
            for (int k = 0; k < 8; ++k) y[(int64_t)r * out + 8 * c + k] = acc[r][k];
    }
    return 0;
}

/* fp32 -> fp16 bits, rounded to nearest even (vcvtps2ph's rounding; NaN stays a quiet NaN) */
static uint16_t f2h(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((u >> 13) & 0x3ffu);  /* NaN */
    if (u >= 0x477ff000u) return sign | 0x7c00u;  /* 65520 and above round to infinity */
    if (u >= 0x38800000u) return sign | (uint16_t)((u + 0xfffu + ((u >> 13) & 1u) - 0x38000000u) >> 13);  /* normal */
    float a;
    memcpy(&a, &u, 4);
    return sign | (uint16_t)lrintf(a * 0x1p24f);  /* subnormal: units of 2^-24, exact before the rounding */
}

/* The AVX2 path's fit_item, one output (lane) at a time: the same candidates in the same order, the same comparisons (a
 * scale that is NaN or not positive fails or gives code 0 as there), so the same codes. */
static int fit_item(const float* w, int in, int out, int bits, int64_t it, int groups, void* codes, uint16_t* d,
                    uint16_t* m) {
    const int64_t c = it / groups;
    const int g = (int)(it % groups);
    int bad = 0;
    uint16_t dh[8], mh[8];
    int qs[8][GROUP];
    for (int k = 0; k < 8 && !bad; ++k) {
        float col[GROUP];
        for (int j = 0; j < GROUP; ++j) col[j] = w[(int64_t)(g * GROUP + j) * out + 8 * c + k];
        float lo = col[0], hi = col[0];
        for (int j = 1; j < GROUP; ++j) {
            lo = lo < col[j] ? lo : col[j];  /* _mm256_min_ps / max_ps: the second operand where either is NaN */
            hi = hi > col[j] ? hi : col[j];
        }
        const float neg = 0.f - lo, absmax = hi > neg ? hi : neg;
        const float base = bits == 4 ? (hi - lo) / 15.f : absmax / 127.f;
        const float mv = bits == 4 ? lo : 0.f;
        const uint16_t h = f2h(base);
        const float qlo = bits == 4 ? 0.f : -128.f, qhi = bits == 4 ? 15.f : 127.f;
        static const int steps[5] = {0, 1, -1, 2, -2};
        int done = 0;
        for (int s = 0; s < 5 && !done; ++s) {
            const uint16_t hc = (uint16_t)(h + steps[s]);
            const float cand = h2f(hc);
            if (cand != cand) continue;  /* NaN */
            const int pos = cand > 0.f;
            const float safe = pos ? cand : 1.f;
            int ok = 1;
            for (int j = 0; j < GROUP && ok; ++j) {
                float v = bits == 4 ? col[j] - mv : col[j];
                v = pos ? nearbyintf(v / safe) : 0.f;
                v = v > qlo ? v : qlo;
                v = v < qhi ? v : qhi;
                float rec = cand * v;
                if (bits == 4) rec = rec + mv;
                ok = rec == col[j];
                qs[k][j] = (int)v;
            }
            if (ok) {
                done = 1;
                dh[k] = f2h(cand);
            }
        }
        mh[k] = f2h(mv);
        if (!done || (bits == 4 && h2f(mh[k]) != mv)) bad = 1;
    }
    if (bad) return 1;
    for (int k = 0; k < 8; ++k) d[it * 8 + k] = dh[k];
    if (bits == 4) {
        for (int k = 0; k < 8; ++k) m[it * 8 + k] = mh[k];
        uint32_t* cw = (uint32_t*)codes + c * in + g * GROUP;
        for (int j = 0; j < GROUP; ++j) {
            uint32_t word = 0;
            for (int k = 0; k < 8; ++k) word |= (uint32_t)qs[k][j] << (4 * k);
            cw[j] = word;
        }
    } else {
        int8_t* cb = (int8_t*)codes + (c * in + g * GROUP) * 8;
        for (int j = 0; j < GROUP; ++j)
            for (int k = 0; k < 8; ++k) cb[j * 8 + k] = (int8_t)qs[k][j];
    }
    return 0;
}
#endif

/* w: (in, out) fp32 contiguous; codes, d, m: outputs in the layout above (m ignored for bits 8). Returns 0 when every
 * weight is reproduced exactly, 1 when some block is not (the outputs then hold nothing usable), -1 for bad sizes. Each
 * block of 32 inputs and 8 outputs is one fit_item, this build's. */
int triforce_blockcode_fit(const float* w, int in, int out, int bits, void* codes, uint16_t* d, uint16_t* m) {
    if (in < GROUP || in % GROUP || out < 32 || out % 32 || (bits != 4 && bits != 8))
        return -1;
    const int groups = in / GROUP;
    const int64_t items = (int64_t)(out / 8) * groups;
    int bad = 0;
    #pragma omp parallel for schedule(static) reduction(| : bad)
    for (int64_t it = 0; it < items; ++it) {
        if (bad) continue;
        bad |= fit_item(w, in, out, bits, it, groups, codes, d, m);
    }
    return bad;
}

/* The fp32 weights of column blocks [c_from, c_to) (outputs 8 c_from .. 8 c_to - 1), written to w as an (in, 8 (c_to -
 * c_from)) row-major tile: w = fl(fl(d q) + m) per weight, the value the products above multiply by (d q is exact, so
 * one rounding; built with -ffp-contract=off). For products of more rows than MAX_ROWS (prefill): a tile of dense
 * weights for the GEMM, so no fp32 copy of the matrix is kept. Plain C. Returns 0, or -1 (nothing written). */
int triforce_blockcode_dequantize(const void* codes, int bits, const void* d, const void* m, float* w, int in, int out,
                                  int c_from, int c_to, int nthreads) {
    if (in < GROUP || in % GROUP || out < 32 || out % 32 || !format_ok(bits, m, in) || c_from < 0 || c_to > out / 8
        || c_from >= c_to || nthreads < 1)
        return -1;
    const int G = bits & BC_G16 ? 16 : 32, F32 = (bits & BC_F32) != 0, KS = (bits & BC_KS) != 0, width = bits & 31;
    const int groups = in / G, per = 256 / G;
    const int64_t sup = (int64_t)out * groups;  /* KS: the super-block values' byte offset */
    const int64_t ld = 8 * (int64_t)(c_to - c_from);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int c = c_from; c < c_to; ++c)
        for (int g = 0; g < groups; ++g) {
            float dv[8], mv[8];
            for (int k = 0; k < 8 && width != 16; ++k) {
                const int64_t s = ((int64_t)c * groups + g) * 8 + k;
                if (KS) {  /* an fp16 times an int8: exact */
                    const int64_t h = ((int64_t)c * (groups / per) + g / per) * 8 + k;
                    dv[k] = H2F(((const uint16_t*)((const char*)d + sup))[h]) * (float)((const int8_t*)d)[s];
                    mv[k] = !m ? 0.f
                               : H2F(((const uint16_t*)((const char*)m + sup))[h]) * (float)((const int8_t*)m)[s];
                    continue;
                }
                dv[k] = F32 ? ((const float*)d)[s] : H2F(((const uint16_t*)d)[s]);
                mv[k] = !m ? 0.f : F32 ? ((const float*)m)[s] : H2F(((const uint16_t*)m)[s]);
            }
            for (int i = g * G; i < (g + 1) * G; ++i) {
                float* row = w + (int64_t)i * ld + 8 * (int64_t)(c - c_from);
                if (width == 16) {  /* 2-byte weights, widened exactly */
                    const uint16_t* h = (const uint16_t*)codes + ((int64_t)c * in + i) * 8;
                    for (int k = 0; k < 8; ++k) {
                        const uint32_t u = (uint32_t)h[k] << 16;
                        float f;
                        __builtin_memcpy(&f, &u, 4);
                        row[k] = bits & BC_BF16 ? f : H2F(h[k]);
                    }
                    continue;
                }
                for (int k = 0; k < 8; ++k) {
                    const int q = width == 4 ? (int)((((const uint32_t*)codes)[(int64_t)c * in + i] >> (4 * k)) & 15u)
                                             : ((const int8_t*)codes)[((int64_t)c * in + i) * 8 + k];
                    const float p = dv[k] * (float)q;
                    row[k] = m ? p + mv[k] : p;
                }
            }
        }
    return 0;
}

/* Every decoder layer of one decode step (or a verification block of a few tokens) in one call (batch 1, fp32
 * activations): an int8 lower tier's, or a model whose projections read their GGUF block codes (csrc/blockcodes.c:
 * the verifier's decode steps and verification blocks over the full cache; the retrieval tier over the same codes,
 * exactly or with its activations quantized to int8 for integer dot products).
 *
 * A decode step of the retrieval tier (TriForce, arXiv 2404.11912, Sec. 4.1: the target's weights over a small
 * retrieval cache; here its int8 weight-only copy, triforce/quant.py) is 30 layers of about 15 small operations each
 * on SmolLM2. Called from Python one at a time, each pays its dispatch (a few microseconds to tens), and the gaps
 * between the OpenMP regions of the matrix products outlast the threads' spin, so every product also pays a thread
 * wake-up, which cost more than a third of the step (docs/performance.md, "Kernels (EPYC)"). This driver runs the
 * same layer as triforce/model.py Block.forward, with the same kernels, back to back:
 *
 *     h = rms_norm(x) ;  [q k v] = h (s_qkv * Q_qkv)^T + b_qkv
 *     q, k = rope(q), rope(k) ;  K[slot], V[slot] = k, v ;  a = attention(q, K[:n_keys], V[:n_keys])
 *     x = x + (a (s_o * Q_o)^T + b_o)
 *     h = rms_norm(x) ;  [g u] = h (s_gu * Q_gu)^T + b_gu ;  x = x + ((silu(g) * u) (s_d * Q_d)^T + b_d)
 *
 * silu(g) = g / (1 + exp(-g)) as PyTorch's, with Cephes' exp (triforce_silu_mul below), which rounds differently from
 * PyTorch's: in a lower tier this changes acceptance at most, never the output; in the verifier every decode step and
 * verification block rounds alike (the same function), and its logits stay within the tolerances the tests hold it to
 * against transformers. The kernels are the other csrc/ files' exported functions, passed as pointers (each keeps its
 * own build flags and OpenMP regions; the gaps between two of them are now shorter than the threads' spin). Plain C
 * apart from SiLU's AVX2 and AVX-512 paths (target attributes, picked at run time): built with -O3 -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int (*int8_linear_fn)(const float* x, const int8_t* w, const float* scale, float* y, int M, int in, int out,
                              int nthreads);
typedef int (*blockcode_linear_fn)(const float* x, const void* codes, int bits, const void* d, const void* m,
                                   float* y, int M, int in, int out, int nthreads);
typedef int (*blockcode_linear_q8_fn)(const float* x, const void* codes, int bits, const void* d, const void* m,
                                      float* y, int M, int in, int out, int nthreads, void* work);
typedef void (*rms_norm_fn)(const float* x, const float* w, float* y, int64_t rows, int d, float eps);
typedef void (*rope_fn)(const float* x, int64_t sb, int64_t sh, int64_t st, float* y, const float* cos,
                        const float* sin, int B, int H, int T, int hs);
typedef int (*attention_fn)(const float* q, const float* k, const float* v, float* out, float* scratch, int B,
                            int nkv, int R, int T, int hs, int64_t bstride, int64_t hstride, int n_keys, int chunk,
                            float scale, int nthreads, float* lse);

/* fp32 -> bf16 bits, rounding to nearest even as torch's vectorized conversion (Tensor.to, copy_ into a bf16 cache)
 * does, NaN -> 0xFFFF as there */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (isnan(f)) return 0xFFFF;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* n floats from src to row dst of a cache: fp32, or bf16 (kv_bf16) */
static void store_row(void* dst, const float* src, int n, int kv_bf16) {
    if (!kv_bf16) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    uint16_t* d = (uint16_t*)dst;
    for (int i = 0; i < n; ++i) d[i] = to_bf16(src[i]);
}

/* x rounded to bf16 and back, in place (what a bf16 cache holds of it) */
static void round_bf16(float* x, int n) {
    for (int i = 0; i < n; ++i) {
        const uint32_t u = (uint32_t)to_bf16(x[i]) << 16;
        memcpy(x + i, &u, 4);
    }
}

/* silu(g) * u over n elements: act[i] = g[i] / (1 + exp(-g[i])) * u[i], exp as Cephes' expf (csrc/attention.c's
 * exp8 range reduction and degree-6 polynomial, relative error < 2e-7 on [-88, 88]), with separate multiplies and
 * adds (no FMA) so that a lane gives the same value at every width (bitwise, NaN payloads aside): 16 lanes with
 * AVX-512, 8 with AVX2 (picked at run time), one otherwise; libm's scalar expf before it ran serially while the other
 * thread waited, 184,320 calls in a 4-token verification of SmolLM2 (30 layers x 4 tokens x 1,536 channels;
 * bench/kernels/step_source.py times the steps against that source). -g is clamped to [-88.38, 176] and 2^k applied as
 * 2^(k/2) 2^(k - k/2), so that exp(-g) overflows to inf past 88.7 as libm's does: silu(g) -> -0 for large negative g,
 * NaN for g = -inf (as PyTorch gives), inf u for g = +inf; NaN in g propagates. */
#define SILU_STEP(V, VI, SET1, ADD, SUB, MUL, DIV, MIN, MAX, FLOOR, CVT, ADDI, SUBI, SRAI, SLLI, CAST)          \
    do {                                                                                                        \
        V x = SUB(SET1(0.f), gg);                                                                               \
        x = MAX(MIN(x, SET1(176.0f)), SET1(-88.3762626647949f));                                                \
        const V fk = FLOOR(ADD(MUL(x, SET1(1.44269504088896341f)), SET1(0.5f)));  /* k in [-127, 254] */        \
        x = SUB(x, MUL(fk, SET1(0.693359375f)));                                                                \
        x = SUB(x, MUL(fk, SET1(-2.12194440e-4f)));                                                             \
        V y = SET1(1.9875691500E-4f);                                                                           \
        y = ADD(MUL(y, x), SET1(1.3981999507E-3f));                                                             \
        y = ADD(MUL(y, x), SET1(8.3334519073E-3f));                                                             \
        y = ADD(MUL(y, x), SET1(4.1665795894E-2f));                                                             \
        y = ADD(MUL(y, x), SET1(1.6666665459E-1f));                                                             \
        y = ADD(MUL(y, x), SET1(5.0000001201E-1f));                                                             \
        y = ADD(MUL(y, MUL(x, x)), ADD(x, SET1(1.0f)));                                                        \
        const VI k = CVT(fk), ka = SRAI(k, 1), kb = SUBI(k, ka);  /* each in [-64, 127]: a normal power of 2 */ \
        const V e = MUL(MUL(y, CAST(SLLI(ADDI(ka), 23))), CAST(SLLI(ADDI(kb), 23)));                            \
        out = MUL(DIV(gg, ADD(SET1(1.0f), e)), uu);                                                             \
    } while (0)

static inline float s_min(float a, float b) { return a < b ? a : b; }  /* as _mm_min_ps: b where either is NaN */
static inline float s_max(float a, float b) { return a > b ? a : b; }
static inline float s_add(float a, float b) { return a + b; }
static inline float s_sub(float a, float b) { return a - b; }
static inline float s_mul(float a, float b) { return a * b; }
static inline float s_div(float a, float b) { return a / b; }
static inline float s_set1(float a) { return a; }
static inline int32_t s_cvt(float a) { return (int32_t)a; }
static inline int32_t s_addi(int32_t k) { return k + 127; }
static inline int32_t s_subi(int32_t a, int32_t b) { return a - b; }
static inline int32_t s_srai(int32_t k, int n) { return k >> n; }  /* arithmetic on GCC and Clang: floor(k / 2^n) */
static inline uint32_t s_slli(int32_t k, int n) { return (uint32_t)k << n; }
static inline float s_cast(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static void silu_mul_scalar(const float* g, const float* u, float* act, int i, int n) {
    for (; i < n; ++i) {
        const float gg = g[i], uu = u[i];
        float out;
        SILU_STEP(float, int32_t, s_set1, s_add, s_sub, s_mul, s_div, s_min, s_max, floorf, s_cvt, s_addi, s_subi,
                  s_srai, s_slli, s_cast);
        act[i] = out;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ADDI8(k) _mm256_add_epi32(k, _mm256_set1_epi32(127))
#define FLOOR8(v) _mm256_floor_ps(v)
#define ADDI16(k) _mm512_add_epi32(k, _mm512_set1_epi32(127))
#define FLOOR16(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
/* silu_mul_scalar on W lanes of V (intrinsics prefix P, integer cast width SI), the tail on one */
#define SILU_MUL_VEC(NAME, TARGET, W, V, P, SI, FLOORV, ADDIV)                                                    \
    __attribute__((target(TARGET))) static void NAME(const float* g, const float* u, float* act, int n) {         \
        int i = 0;                                                                                                \
        for (; i + W <= n; i += W) {                                                                              \
            const V gg = P##_loadu_ps(g + i), uu = P##_loadu_ps(u + i);                                          \
            V out;                                                                                                \
            SILU_STEP(V, V##i, P##_set1_ps, P##_add_ps, P##_sub_ps, P##_mul_ps, P##_div_ps, P##_min_ps,           \
                      P##_max_ps, FLOORV, P##_cvttps_epi32, ADDIV, P##_sub_epi32, P##_srai_epi32, P##_slli_epi32,   \
                      P##_castsi##SI##_ps);                                                                       \
            P##_storeu_ps(act + i, out);                                                                          \
        }                                                                                                         \
        silu_mul_scalar(g, u, act, i, n);                                                                         \
    }
SILU_MUL_VEC(silu_mul_avx2, "avx2", 8, __m256, _mm256, 256, FLOOR8, ADDI8)
SILU_MUL_VEC(silu_mul_avx512, "avx512f", 16, __m512, _mm512, 512, FLOOR16, ADDI16)
#endif

/* with a given width: isa 2 AVX-512, 1 AVX2, 0 scalar; returns -1 (nothing written) where the CPU lacks it */
int triforce_silu_mul_isa(const float* g, const float* u, float* act, int n, int isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa == 2 && __builtin_cpu_supports("avx512f")) return silu_mul_avx512(g, u, act, n), 0;
    if (isa == 1 && __builtin_cpu_supports("avx2")) return silu_mul_avx2(g, u, act, n), 0;
#endif
    if (isa == 0) return silu_mul_scalar(g, u, act, 0, n), 0;
    return -1;
}

/* the widest this CPU has */
void triforce_silu_mul(const float* g, const float* u, float* act, int n) {
    for (int isa = 2; isa >= 0; --isa)
        if (triforce_silu_mul_isa(g, u, act, n, isa) == 0) return;
}

static void add_bias(float* y, const float* b, int n) {
    if (b)
        for (int i = 0; i < n; ++i) y[i] += b[i];
}

/* bits of a projection whose block codes multiply int8-quantized activations (csrc/blockcodes.c's integer dot
 * products: a tier below the verifier) */
#define Q8_ACTIVATIONS 256

/* y = x W^T for M rows: bits 0 the int8 kernel (w: (out, in) int8, s: per-channel scales), else csrc/blockcodes.c's
 * bits (w: codes or 2-byte weights, s: the blocks' scales, mn: their minima, or NULL), plus Q8_ACTIVATIONS its
 * integer dot products (4- or 8-bit codes, fp16 or fp32 scales; qwork: their buffer, 32-byte aligned) */
static int project(void* const* fns, int bits, const void* w, const void* s, const void* mn, const float* x,
                   float* y, int M, int in, int out, int nthreads, void* qwork) {
    if (bits == 0) return ((int8_linear_fn)fns[0])(x, (const int8_t*)w, (const float*)s, y, M, in, out, nthreads);
    if (bits & Q8_ACTIVATIONS)
        return fns[5] ? ((blockcode_linear_q8_fn)fns[5])(x, w, bits & ~Q8_ACTIVATIONS, s, mn, y, M, in, out, nthreads,
                                                         qwork) : -1;
    if (!fns[4]) return -1;
    return ((blockcode_linear_fn)fns[4])(x, w, bits, s, mn, y, M, in, out, nthreads);
}

/* fns: {int8_linear, rms_norm, rope, attention, blockcode_linear or NULL, blockcode_linear_q8 or NULL,
 * attention over bf16 keys and values}. x: (T, d) the
 * hidden states of a block of T tokens (1 <= T <= MAX_T: a decode step, or a verification block over the full cache),
 * updated in place. norm_w: 2 per layer (input, post-attention). q, scale, mins, bits, bias: 4 per layer (qkv, o,
 * gate_up, down): with bits 0, (out, in) int8, (out,) fp32, unused; with block-code bits (plus Q8_ACTIVATIONS: the
 * integer dot products), the block codes, scales and minima (or NULL) of csrc/blockcodes.c's layout; bias (out,) fp32 or NULL. k_cache, v_cache: (L, 1, nkv, capacity, hs) contiguous,
 * fp32, or bf16 with kv_bf16 (a lower tier's cache: keys and values rounded to nearest even as torch does, and a
 * block attends to its own keys and values as rounded too, as to every other row of its cache), layer_stride =
 * nkv * capacity * hs, head_stride = capacity * hs (elements); the block's keys and values go to rows
 * slot .. slot + T - 1 and its queries attend over rows [0, n_keys), token i of the block seeing rows
 * j <= n_keys - T + i (T > 1 needs n_keys = slot + T: the full cache's causal block). cos, sin: (T, hs) the block's
 * rotations. work: at least T (6 nh hs + 4 nkv hs + 2 d + 3 inter + 3 nh + 2 n_in + 3 n_in / 32) + 8 floats (n_in
 * the widest projection input, max(d, nh hs, inter): the integer dot products' activations); attn_scratch:
 * what triforce_gqa_attention needs for T nh / nkv rows over n_keys keys; q_out: NULL, or (L, nh, T, hs) floats that
 * receive every layer's rotated queries (the full cache keeps them for the retrieval cache's chunk selection).
 *
 * n_shared >= 0: the retrieval cache's layout instead (triforce/retrieval.py RetrievalCache: generated tokens take
 * rows from the end, newest lowest): token t of the block goes to row slot - t; rows [0, n_shared) (selected tokens)
 * and [slot + 1, n_keys) (tokens generated before the block) are seen by every token, and token i sees the block's
 * tokens 0 .. i. The attention is then three calls of the kernel (the two shared ranges, and the block's own keys in
 * token order with its causal mask), merged by their log-sum-exps as flash-decoding merges chunks: one pass over T
 * tokens instead of T decode steps that would each read the weights (a retrieval tier verifying an n-gram drafter's
 * block, or catching up with the tokens a verification accepted).
 * Returns 0, -1 for a block it does not take, or the first kernel's nonzero return code. */
#define MAX_T 64  /* a verification block up to gamma 63 (triforce/exact.py EXACT_MAX_BLOCK) in one call */
/* most rows of one ragged call (csrc/blockcodes.c's and csrc/qlinear.c's MAX_ROWS) */
#define MAX_RAGGED_T 64

/* out[r] = sum_c w_c o_c[r] / sum_c w_c, w_c = exp(lse_c[r] - max_c lse_c[r]) over the nc (<= 3) partial attentions
 * of every row (lse -INFINITY: a range with no keys, skipped) */
static void merge_partials(float* out, float* const* o, float* const* lse, int nc, int rows, int hs) {
    for (int r = 0; r < rows; ++r) {
        float M = -INFINITY, L = 0.f;
        for (int c = 0; c < nc; ++c) M = lse[c][r] > M ? lse[c][r] : M;
        float w[3];
        for (int c = 0; c < nc; ++c) {
            w[c] = lse[c][r] == -INFINITY ? 0.f : expf(lse[c][r] - M);
            L += w[c];
        }
        float* y = out + (int64_t)r * hs;
        for (int e = 0; e < hs; ++e) {
            float a = 0.f;
            for (int c = 0; c < nc; ++c)
                if (w[c] != 0.f) a += w[c] * o[c][(int64_t)r * hs + e];
            y[e] = a / L;
        }
    }
}

/* The layers over S segments of T rows in all (x: (T, d), segment s its rows t0_s .. t0_s + seg_T[s] - 1), each
 * segment over its own cache: k_caches[s], v_caches[s] with layer_strides[s], head_strides[s], its keys and values
 * written from row slots[s], attending over rows [0, n_keys[s]), its queries to q_outs[s] (or NULL). The products,
 * norms and MLP run once over all T rows; RoPE, the cache writes and the attention per segment. S = 1 is
 * triforce_decode_layers; n_shared >= 0 (the retrieval layout) only with S = 1. */
static int layers(void* const* fns, float* x, int S, const int* seg_T, int L, int d, int nh, int nkv, int hs,
                  int inter, float eps, const float* const* norm_w, const void* const* q, const void* const* scale,
                  const void* const* mins, const int* bits, const float* const* bias, void* const* k_caches,
                  void* const* v_caches, int kv_bf16, float* const* q_outs, const int64_t* layer_strides,
                  const int64_t* head_strides, const int* slots, const int* n_keys_s, int n_shared, const float* cos,
                  const float* sin, int chunk, float attn_scale, int nthreads, float* work, float* attn_scratch) {
    const int retrieval = n_shared >= 0;
    int T = 0;
    for (int s = 0; s < S; ++s) {
        const int Ts = seg_T[s];
        if (Ts < 1 || (!retrieval && Ts > 1 && n_keys_s[s] != slots[s] + Ts)) return -1;
        T += Ts;
    }
    if (S < 1 || T > (S == 1 ? MAX_T : MAX_RAGGED_T) || (retrieval && S != 1)) return -1;
    const int slot = slots[0], n_keys = n_keys_s[0];
    if (retrieval && (slot - T + 1 < n_shared || slot >= n_keys)) return -1;
    const rms_norm_fn norm = (rms_norm_fn)fns[1];
    const rope_fn rope = (rope_fn)fns[2];
    const attention_fn attention = (attention_fn)fns[3];  /* over fp32 rows (the block's own, in the retrieval layout) */
    const attention_fn cache_attention = (attention_fn)(kv_bf16 ? fns[6] : fns[3]);  /* over the cache's rows */
    const int es = kv_bf16 ? 2 : 4;  /* bytes per cache element */
    if (!cache_attention) return -1;
    const int nq = nh * hs, nk = nkv * hs, nqkv = nq + 2 * nk;
    float* const qkv = work;                   /* (T, nqkv) */
    float* const q_rot = qkv + T * nqkv;       /* per segment (nh, T_s, hs): rows (g, T_s) per KV head, as the attention takes them */
    float* const k_rot = q_rot + T * nq;       /* per segment (nkv, T_s, hs) */
    float* const attn = k_rot + T * nk;        /* per segment (nh, T_s, hs) */
    float* const attn_t = attn + T * nq;       /* (T, nh hs) */
    float* const h = attn_t + T * nq;          /* (T, d) */
    float* const y = h + T * d;                /* (T, d) */
    float* const gu = y + T * d;               /* (T, 2 inter) */
    float* const act = gu + 2 * T * inter;     /* (T, inter) */
    float* const part1 = act + T * inter;      /* (nh, T, hs) x 2: the retrieval layout's partial attentions */
    float* const part2 = part1 + T * nq;
    float* const v_blk = part2 + T * nq;       /* (nkv, T, hs): the block's values in token order */
    float* const lse0 = v_blk + T * nk;        /* (nh T) x 3: their log-sum-exps */
    float* const lse1 = lse0 + T * nh;
    float* const lse2 = lse1 + T * nh;
    void* const qwork = (void*)(((uintptr_t)(lse2 + T * nh) + 31) & ~(uintptr_t)31);
    int rc;
    for (int l = 0; l < L; ++l) {
        const void* const* wq = q + 4 * l;
        const void* const* ws = scale + 4 * l;
        const void* const* wm = mins + 4 * l;
        const int* wbits = bits + 4 * l;
        const float* const* wb = bias + 4 * l;
        /* attention */
        norm(x, norm_w[2 * l], h, T, d, eps);
        if ((rc = project(fns, wbits[0], wq[0], ws[0], wm[0], h, qkv, T, d, nqkv, nthreads, qwork))) return rc;
        for (int t = 0; t < T; ++t) add_bias(qkv + t * nqkv, wb[0], nqkv);
        for (int s = 0, t0 = 0; s < S; t0 += seg_T[s++]) {
            const int Ts = seg_T[s], rows = nh / nkv * Ts;
            const int64_t layer_stride = layer_strides[s], head_stride = head_strides[s];
            char* const kl = (char*)k_caches[s] + l * layer_stride * es;
            char* const vl = (char*)v_caches[s] + l * layer_stride * es;
            float* const qs = q_rot + t0 * nq;
            float* const ks = k_rot + t0 * nk;
            float* const as = attn + t0 * nq;
            const float* const qkv_s = qkv + t0 * nqkv;
            rope(qkv_s, 0, hs, nqkv, qs, cos + t0 * hs, sin + t0 * hs, 1, nh, Ts, hs);
            rope(qkv_s + nq, 0, hs, nqkv, ks, cos + t0 * hs, sin + t0 * hs, 1, nkv, Ts, hs);
            if (q_outs[s]) memcpy(q_outs[s] + (int64_t)l * Ts * nq, qs, sizeof(float) * Ts * nq);
            for (int j = 0; j < nkv; ++j)
                for (int t = 0; t < Ts; ++t) {
                    const int64_t row = retrieval ? slot - t : slots[s] + t;
                    store_row(kl + (j * head_stride + row * hs) * es, ks + (j * Ts + t) * hs, hs, kv_bf16);
                    store_row(vl + (j * head_stride + row * hs) * es, qkv_s + t * nqkv + nq + nk + j * hs, hs, kv_bf16);
                    if (retrieval) memcpy(v_blk + (j * T + t) * hs, qkv_s + t * nqkv + nq + nk + j * hs, sizeof(float) * hs);
                }
            if (!retrieval) {
                if ((rc = cache_attention(qs, (const float*)kl, (const float*)vl, as, attn_scratch, 1, nkv, rows, Ts,
                                          hs, layer_stride, head_stride, n_keys_s[s], chunk, attn_scale, nthreads, 0)))
                    return rc;
            } else {
                if (kv_bf16) {  /* the block's own keys and values as its cache holds them */
                    round_bf16(k_rot, T * nk);
                    round_bf16(v_blk, T * nk);
                }
                /* the block's own keys, causal (token order: k_rot, v_blk), then the rows every token sees (T = 1 in
                 * the kernel's terms: no mask over them) */
                if ((rc = attention(q_rot, k_rot, v_blk, attn, attn_scratch, 1, nkv, rows, T, hs, (int64_t)nk,
                                    (int64_t)T * hs, T, chunk, attn_scale, nthreads, lse0))) return rc;
                float* parts[3] = {attn, part1, part2};
                float* lses[3] = {lse0, lse1, lse2};
                int nc = 1;
                if (n_shared > 0) {
                    if ((rc = cache_attention(q_rot, (const float*)kl, (const float*)vl, parts[nc], attn_scratch, 1,
                                              nkv, rows, 1, hs, layer_stride, head_stride, n_shared, chunk,
                                              attn_scale, nthreads, lses[nc]))) return rc;
                    ++nc;
                }
                if (slot + 1 < n_keys) {
                    if ((rc = cache_attention(q_rot, (const float*)(kl + (int64_t)(slot + 1) * hs * es),
                                              (const float*)(vl + (int64_t)(slot + 1) * hs * es), parts[nc],
                                              attn_scratch, 1, nkv, rows, 1, hs, layer_stride, head_stride,
                                              n_keys - slot - 1, chunk, attn_scale, nthreads, lses[nc]))) return rc;
                    ++nc;
                }
                if (nc > 1) merge_partials(attn, parts, lses, nc, nh * T, hs);  /* in place: each element read first */
            }
            for (int j = 0; j < nh; ++j)  /* (nh, T_s, hs) -> rows t0 .. t0 + T_s - 1 of (T, nh hs) */
                for (int t = 0; t < Ts; ++t)
                    memcpy(attn_t + (t0 + t) * nq + j * hs, as + (j * Ts + t) * hs, sizeof(float) * hs);
        }
        if ((rc = project(fns, wbits[1], wq[1], ws[1], wm[1], attn_t, y, T, nq, d, nthreads, qwork))) return rc;
        for (int t = 0; t < T; ++t) add_bias(y + t * d, wb[1], d);
        for (int i = 0; i < T * d; ++i) x[i] = x[i] + y[i];
        /* SwiGLU MLP */
        norm(x, norm_w[2 * l + 1], h, T, d, eps);
        if ((rc = project(fns, wbits[2], wq[2], ws[2], wm[2], h, gu, T, d, 2 * inter, nthreads, qwork))) return rc;
        for (int t = 0; t < T; ++t) {
            float* g = gu + (int64_t)t * 2 * inter;
            add_bias(g, wb[2], 2 * inter);
            triforce_silu_mul(g, g + inter, act + (int64_t)t * inter, inter);
        }
        if ((rc = project(fns, wbits[3], wq[3], ws[3], wm[3], act, y, T, inter, d, nthreads, qwork))) return rc;
        for (int t = 0; t < T; ++t) add_bias(y + t * d, wb[3], d);
        for (int i = 0; i < T * d; ++i) x[i] = x[i] + y[i];
    }
    return 0;
}

int triforce_decode_layers(void* const* fns, float* x, int T, int L, int d, int nh, int nkv, int hs, int inter,
                           float eps, const float* const* norm_w, const void* const* q, const void* const* scale,
                           const void* const* mins, const int* bits, const float* const* bias, void* k_cache,
                           void* v_cache, int kv_bf16, float* q_out, int64_t layer_stride, int64_t head_stride,
                           int slot, int n_keys, int n_shared, const float* cos, const float* sin, int chunk,
                           float attn_scale, int nthreads, float* work, float* attn_scratch) {
    if (T < 1 || T > MAX_T) return -1;
    if (n_shared < 0 && (T > 1 && n_keys != slot + T)) return -1;
    return layers(fns, x, 1, &T, L, d, nh, nkv, hs, inter, eps, norm_w, q, scale, mins, bits, bias, &k_cache,
                  &v_cache, kv_bf16, &q_out, &layer_stride, &head_stride, &slot, &n_keys, n_shared, cos, sin, chunk,
                  attn_scale, nthreads, work, attn_scratch);
}

/* S sequences' blocks in one call (continuous batching: triforce/model.py forward_ragged), each over its own full
 * cache (the layout of n_shared < 0 above); seg_T[s] tokens of sequence s, T = sum seg_T <= MAX_RAGGED_T rows in
 * the products (x: (T, d), cos, sin: (T, hs) in the same row order). Every row is computed as
 * triforce_decode_layers computes it alone: the products are row-invariant (each row's sums in the same order
 * whatever the other rows) and each segment's attention is its own call. work: as above for T rows; attn_scratch:
 * what the largest segment's attention needs. */
int triforce_decode_layers_ragged(void* const* fns, float* x, int S, const int* seg_T, int L, int d, int nh, int nkv,
                                  int hs, int inter, float eps, const float* const* norm_w, const void* const* q,
                                  const void* const* scale, const void* const* mins, const int* bits,
                                  const float* const* bias, void* const* k_caches, void* const* v_caches, int kv_bf16,
                                  float* const* q_outs, const int64_t* layer_strides, const int64_t* head_strides,
                                  const int* slots, const int* n_keys, const float* cos, const float* sin, int chunk,
                                  float attn_scale, int nthreads, float* work, float* attn_scratch) {
    return layers(fns, x, S, seg_T, L, d, nh, nkv, hs, inter, eps, norm_w, q, scale, mins, bits, bias, k_caches,
                  v_caches, kv_bf16, q_outs, layer_strides, head_strides, slots, n_keys, -1, cos, sin, chunk,
                  attn_scale, nthreads, work, attn_scratch);
}

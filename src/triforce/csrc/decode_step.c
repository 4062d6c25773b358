/* Every decoder layer of one decode step of an int8 lower tier, in one call (one token, batch 1, fp32 activations).
 *
 * A decode step of the retrieval tier (TriForce, arXiv 2404.11912, Sec. 4.1: the target's weights over a small
 * retrieval cache; here its int8 weight-only copy, triforce/quant.py) is 30 layers of about 15 small operations each
 * on SmolLM2. Called from Python one at a time, each pays its dispatch (a few microseconds to tens), and the gaps
 * between the OpenMP regions of the matrix products outlast the threads' spin, so every product also pays a thread
 * wake-up: at 8K tokens on this project's 2-core AVX2 machine the step took 26.3 ms where its int8 products and
 * attention alone took 16.2 ms (bench/decode_step.py, bench/results/decode_step_8000_avx2_2026-12-03.json). This driver runs the same layer as triforce/model.py Block.forward, with the
 * same kernels, back to back:
 *
 *     h = rms_norm(x) ;  [q k v] = h (s_qkv * Q_qkv)^T + b_qkv
 *     q, k = rope(q), rope(k) ;  K[slot], V[slot] = k, v ;  a = attention(q, K[:n_keys], V[:n_keys])
 *     x = x + (a (s_o * Q_o)^T + b_o)
 *     h = rms_norm(x) ;  [g u] = h (s_gu * Q_gu)^T + b_gu ;  x = x + ((silu(g) * u) (s_d * Q_d)^T + b_d)
 *
 * silu(g) = g / (1 + exp(-g)), as PyTorch's (which may round its exp differently: the tier only proposes tokens, the
 * verifier decides them, so this changes acceptance at most, never the output). The kernels are the other csrc/
 * files' exported functions, passed as pointers (each keeps its own build flags and OpenMP regions; the gaps between
 * two of them are now shorter than the threads' spin). Plain C, no intrinsics: built with -O3.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int (*int8_linear_fn)(const float* x, const int8_t* w, const float* scale, float* y, int M, int in, int out,
                              int nthreads);
typedef void (*rms_norm_fn)(const float* x, const float* w, float* y, int64_t rows, int d, float eps);
typedef void (*rope_fn)(const float* x, int64_t sb, int64_t sh, int64_t st, float* y, const float* cos,
                        const float* sin, int B, int H, int T, int hs);
typedef int (*attention_fn)(const float* q, const float* k, const float* v, float* out, float* scratch, int B,
                            int nkv, int R, int T, int hs, int64_t bstride, int64_t hstride, int n_keys, int chunk,
                            float scale, int nthreads, float* lse);

static void add_bias(float* y, const float* b, int n) {
    if (b)
        for (int i = 0; i < n; ++i) y[i] += b[i];
}

/* fns: {int8_linear, rms_norm, rope, attention}. x: (d,) the hidden state, updated in place.
 * norm_w: 2 per layer (input, post-attention). q, scale, bias: 4 per layer (qkv, o, gate_up, down): (out, in) int8,
 * (out,) fp32, (out,) fp32 or NULL. k_cache, v_cache: (L, 1, nkv, capacity, hs) fp32 contiguous, layer_stride =
 * nkv * capacity * hs, head_stride = capacity * hs; this token's key and value go to row `slot` and the query attends
 * over rows [0, n_keys) (all of them visible to it). cos, sin: (hs,) this position's rotation. work: at least
 * (nh + 2 nkv) hs + 2 nh hs + nkv hs + 2 d + 3 inter floats; attn_scratch: what triforce_gqa_attention needs for
 * one row block of nh / nkv rows over n_keys keys. Returns 0, or the first kernel's nonzero return code. */
int triforce_int8_decode_layers(void* const* fns, float* x, int L, int d, int nh, int nkv, int hs, int inter,
                                float eps, const float* const* norm_w, const int8_t* const* q,
                                const float* const* scale, const float* const* bias, float* k_cache, float* v_cache,
                                int64_t layer_stride, int64_t head_stride, int slot, int n_keys, const float* cos,
                                const float* sin, int chunk, float attn_scale, int nthreads, float* work,
                                float* attn_scratch) {
    const int8_linear_fn linear = (int8_linear_fn)fns[0];
    const rms_norm_fn norm = (rms_norm_fn)fns[1];
    const rope_fn rope = (rope_fn)fns[2];
    const attention_fn attention = (attention_fn)fns[3];
    const int nq = nh * hs, nk = nkv * hs, nqkv = nq + 2 * nk;
    float* const qkv = work;               /* (nqkv,) */
    float* const q_rot = qkv + nqkv;       /* (nh, hs) */
    float* const k_rot = q_rot + nq;       /* (nkv, hs) */
    float* const attn = k_rot + nk;        /* (nh, hs) */
    float* const h = attn + nq;            /* (d,) */
    float* const y = h + d;                /* (d,) */
    float* const gu = y + d;               /* (2 inter,) */
    float* const act = gu + 2 * inter;     /* (inter,) */
    int rc;
    for (int l = 0; l < L; ++l) {
        const int8_t* const* wq = q + 4 * l;
        const float* const* ws = scale + 4 * l;
        const float* const* wb = bias + 4 * l;
        float* const kl = k_cache + l * layer_stride;
        float* const vl = v_cache + l * layer_stride;
        /* attention */
        norm(x, norm_w[2 * l], h, 1, d, eps);
        if ((rc = linear(h, wq[0], ws[0], qkv, 1, d, nqkv, nthreads))) return rc;
        add_bias(qkv, wb[0], nqkv);
        rope(qkv, 0, hs, hs, q_rot, cos, sin, 1, nh, 1, hs);
        rope(qkv + nq, 0, hs, hs, k_rot, cos, sin, 1, nkv, 1, hs);
        for (int j = 0; j < nkv; ++j) {
            memcpy(kl + j * head_stride + (int64_t)slot * hs, k_rot + j * hs, sizeof(float) * hs);
            memcpy(vl + j * head_stride + (int64_t)slot * hs, qkv + nq + nk + j * hs, sizeof(float) * hs);
        }
        if ((rc = attention(q_rot, kl, vl, attn, attn_scratch, 1, nkv, nh / nkv, 1, hs, layer_stride, head_stride,
                            n_keys, chunk, attn_scale, nthreads, 0))) return rc;
        if ((rc = linear(attn, wq[1], ws[1], y, 1, nq, d, nthreads))) return rc;
        add_bias(y, wb[1], d);
        for (int i = 0; i < d; ++i) x[i] = x[i] + y[i];
        /* SwiGLU MLP */
        norm(x, norm_w[2 * l + 1], h, 1, d, eps);
        if ((rc = linear(h, wq[2], ws[2], gu, 1, d, 2 * inter, nthreads))) return rc;
        add_bias(gu, wb[2], 2 * inter);
        for (int i = 0; i < inter; ++i) {
            const float g = gu[i];
            act[i] = g / (1.0f + expf(-g)) * gu[inter + i];
        }
        if ((rc = linear(act, wq[3], ws[3], y, 1, inter, d, nthreads))) return rc;
        add_bias(y, wb[3], d);
        for (int i = 0; i < d; ++i) x[i] = x[i] + y[i];
    }
    return 0;
}

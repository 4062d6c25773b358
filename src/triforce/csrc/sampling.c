/* Top-p (nucleus) selection and inverse-CDF draws over a large vocabulary, a few rows at a time.
 *
 * Every tier turns its logits into the distribution its tokens are drawn from at every step (triforce/sampling.py:
 * temperature, top-k, then top-p as transformers' TopPLogitsWarper, Holtzman et al., arXiv 1904.09751), and draws
 * from it by inversion. Over SmolLM2's 49,152 tokens PyTorch's topk, cumsum, scatter and checks cost 0.3 ms a step
 * inside a generation, about a tenth of a retrieval step; these two functions do the same work in one pass each over
 * the row (the softmax stays PyTorch's):
 *
 * triforce_top_p: a token stays iff the mass of the tokens ranked above it is < top_p (the most likely always
 * stays), the rest is zeroed and the kept mass renormalised. The nucleus is found among the tokens whose probability
 * is at least a threshold t (first pmax / 32, lowered 32-fold while too little mass is there; 0 takes every
 * token): once the candidates, ranked by probability (ties: lower index first), sum to >= top_p along the ranking,
 * every token below t has at least that mass ranked above it, so it is out, and the ranking of the candidates alone
 * decides. A row whose nucleus is larger than the caller's max_kept is left to the caller: its boundary sits in a
 * long sum of small probabilities, which transformers' warper accumulates in another order, so the caller's full
 * sort reproduces it instead (1-2% of SmolLM2's rows at T = 0.6 and top-p 0.9).
 *
 * triforce_sample: token i of a row with weights w (non-negative, any positive finite sum) is drawn when
 * u * c[V-1] falls in [c[i-1], c[i]), c the fp64 cumulative sums in index order and u in [0, 1): probability
 * w[i] / sum(w) exactly, never a token of weight 0. Runs of 8 zero weights are skipped (they add nothing to c),
 * so a nucleus row costs a scan of its zeros.
 *
 * Built at first use by triforce/kernels.py's builder with -O3 -mavx2; the Python side checks every precondition
 * (contiguous fp32 rows, 1 <= V, 0 < top_p < 1) before calling.
 */
#define _GNU_SOURCE  /* qsort_r */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the largest of n >= 1 floats (NaN-free rows: softmax outputs) */
static float row_max(const float* p, int n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(p + i));
    float m[8];
    _mm256_storeu_ps(m, m8);
    float best = m[0];
    for (int l = 1; l < 8; ++l) best = m[l] > best ? m[l] : best;
    for (; i < n; ++i) best = p[i] > best ? p[i] : best;
    return best;
}

/* the indices of the tokens with p >= t, in index order, into idx; returns their count */
static int above(const float* p, int n, float t, int* idx) {
    const __m256 t8 = _mm256_set1_ps(t);
    int k = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), t8, _CMP_GE_OQ));
        while (bits) {
            idx[k++] = i + __builtin_ctz(bits);
            bits &= bits - 1;
        }
    }
    for (; i < n; ++i)
        if (p[i] >= t) idx[k++] = i;
    return k;
}

/* qsort_r's order of candidates: probability descending, then index ascending (arg: the row) */
static int by_rank(const void* a, const void* b, void* arg) {
    const float* p = (const float*)arg;
    const int i = *(const int*)a, j = *(const int*)b;
    if (p[i] != p[j]) return p[i] > p[j] ? -1 : 1;
    return (i > j) - (i < j);
}

static int by_index(const void* a, const void* b, void* arg) {
    (void)arg;
    const int i = *(const int*)a, j = *(const int*)b;
    return (i > j) - (i < j);
}

/* 1 if token i ranks below token j (lower probability, or the same and a higher index) */
static inline int below(const float* p, int i, int j) {
    return p[i] < p[j] || (p[i] == p[j] && i > j);
}

/* the m best-ranked of idx[0 .. n) (m < n) moved to idx[0 .. m), in no order: a heap of the m best so far whose root
 * is the worst of them, O(n log m) */
static void select_best(const float* p, int* idx, int n, int m) {
    for (int s = m / 2 - 1; s >= 0; --s)  /* heapify idx[0 .. m) */
        for (int a = s, c; (c = 2 * a + 1) < m; a = c) {
            if (c + 1 < m && below(p, idx[c + 1], idx[c])) ++c;
            if (!below(p, idx[c], idx[a])) break;
            const int t = idx[a]; idx[a] = idx[c]; idx[c] = t;
        }
    for (int x = m; x < n; ++x) {
        if (!below(p, idx[0], idx[x])) continue;  /* not better than the worst kept */
        idx[0] = idx[x];
        for (int a = 0, c; (c = 2 * a + 1) < m; a = c) {
            if (c + 1 < m && below(p, idx[c + 1], idx[c])) ++c;
            if (!below(p, idx[c], idx[a])) break;
            const int t = idx[a]; idx[a] = idx[c]; idx[c] = t;
        }
    }
}

/* probs: (N, V) contiguous rows of a softmax, each replaced in place by its nucleus distribution; work: V ints.
 * Returns 0; -1 for arguments outside what the function handles (nothing written); r + 1 for row r whose largest
 * probability is not positive and finite, or whose nucleus holds more than max_kept tokens (rows before it already
 * replaced). */
int triforce_top_p(float* probs, int N, int V, float top_p, int max_kept, int* work) {
    if (N < 1 || V < 1 || !(top_p > 0.f && top_p < 1.f) || max_kept < 1) return -1;
    for (int r = 0; r < N; ++r) {
        float* p = probs + (int64_t)r * V;
        const float pmax = row_max(p, V);
        if (!(pmax > 0.f) || isinf(pmax)) return r + 1;  /* NaN or no mass: the caller's PyTorch ops decide */
        int k = 0;
        for (float t = pmax * 0x1p-5f;; t *= 0x1p-5f) {
            if (t < 1e-30f) t = 0.f;  /* every token: the last pass */
            int n = above(p, V, t, work);
            if (n > max_kept + 1) {  /* the first max_kept + 1 of the ranking decide: one left out, or too many kept */
                select_best(p, work, n, max_kept + 1);
                n = max_kept + 1;
            }
            qsort_r(work, (size_t)n, sizeof(int), by_rank, p);
            float mass = 0.f;  /* the mass ranked above candidate k, as the warper's cumulative sum */
            for (k = 0; k < n && (k == 0 || mass < top_p); ++k) mass += p[work[k]];
            if (k > max_kept) return r + 1;  /* a flat row: the caller's full sort decides, as the warper rounds */
            if (k < n || mass >= top_p || t == 0.f) break;  /* a candidate left out, or the mass reached: decided */
        }
        float kept = 0.f;
        for (int c = 0; c < k; ++c) kept += p[work[c]];
        for (int c = 0; c < k; ++c) p[work[c]] /= kept;  /* renormalised in place */
        qsort_r(work, (size_t)k, sizeof(int), by_index, NULL);
        for (int c = 0, from = 0; c <= k; ++c) {  /* zero the gaps between the kept tokens */
            const int to = c < k ? work[c] : V;
            memset(p + from, 0, sizeof(float) * (size_t)(to - from));
            from = to + 1;
        }
    }
    return 0;
}

/* probs: (N, V) contiguous non-negative weights; u: N uniforms in [0, 1); out: N token ids. Returns 0, or the
 * 1-based index of the first row that is not a distribution (a negative or NaN entry, or a sum that is not positive
 * and finite), nothing drawn for it or after it. */
int triforce_sample(const float* probs, const double* u, int64_t* out, int N, int V) {
    for (int r = 0; r < N; ++r) {
        const float* p = probs + (int64_t)r * V;
        double total = 0.0;
        int bad = 0, i = 0;
        const __m256 zero = _mm256_setzero_ps();
        for (; i + 8 <= V; i += 8) {
            const __m256 v = _mm256_loadu_ps(p + i);
            if (_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_NEQ_UQ)) == 0) continue;  /* 8 zeros */
            if (_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_NGE_UQ))) bad = 1;       /* < 0 or NaN */
            for (int l = 0; l < 8; ++l) total += p[i + l];
        }
        for (; i < V; ++i) {
            if (!(p[i] >= 0.f)) bad = 1;
            total += p[i];
        }
        if (bad || !(total > 0.0) || isinf(total)) return r + 1;
        const double target = u[r] * total;
        double c = 0.0;
        int64_t tok = -1, last = -1;
        for (i = 0; i < V && tok < 0; i += 8) {
            const int end = i + 8 < V ? i + 8 : V;
            for (int j = i; j < end; ++j) {
                if (p[j] == 0.f) continue;
                c += p[j];
                last = j;
                if (target < c) {
                    tok = j;
                    break;
                }
            }
        }
        out[r] = tok >= 0 ? tok : last;  /* u * total rounding up to the total: the last token of positive weight */
    }
    return 0;
}

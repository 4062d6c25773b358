/* Top-p (nucleus) selection and inverse-CDF draws over a large vocabulary, a few rows at a time.
 *
 * Every tier turns its logits into the distribution its tokens are drawn from at every step (triforce/sampling.py:
 * temperature, top-k, then top-p as transformers' TopPLogitsWarper, Holtzman et al., arXiv 1904.09751), and draws
 * from it by inversion. Over SmolLM2's 49,152 tokens PyTorch's topk, cumsum, scatter and checks cost 0.30 ms of a
 * retrieval step inside a generation (bench/analysis/step_overhead.py), about a tenth of the step; these two functions do the
 * same work in one pass each over the row (the softmax stays PyTorch's):
 *
 * triforce_top_p: a token stays iff the mass of the tokens ranked above it is < top_p (the most likely always
 * stays), the rest is zeroed and the kept mass renormalised. The nucleus is found among the tokens whose probability
 * is at least a threshold t (first pmax / 32, lowered 32-fold until the ranking of the candidates, probability
 * descending and ties by the lower index, leaves one out; 0 takes every token): every token below t ranks below all
 * the candidates, so it has at least the mass above the one left out ranked above it, and it is out too. The mass
 * ranked above a candidate is computed as speculation/sampling.py's PyTorch path does (a cumulative sum accumulated in fp64 and
 * rounded to fp32 at each step, minus the candidate's probability, compared in fp32), so both keep the same tokens,
 * up to the choice among exactly equal probabilities at the boundary. A row whose nucleus is larger than max_kept is
 * left to the caller's full sort: its boundary sits in a long sum of small probabilities, which transformers'
 * warper accumulates in ascending order (rare at T = 0.6 and top-p 0.9: bench/kernels/nucleus.py reports the sizes).
 *
 * triforce_sample: token i of a row with weights w (non-negative, any positive finite sum) is drawn when
 * u * c[V-1] falls in [c[i-1], c[i]), c the fp64 cumulative sums in index order and u in [0, 1): probability
 * w[i] / sum(w) exactly, never a token of weight 0. Runs of 8 zero weights are skipped (they add nothing to c),
 * so a nucleus row costs a scan of its zeros.
 *
 * Built at first use by triforce/kernels.py's builder with -O3 -mavx2 (or, on a CPU without AVX2, with no ISA flags:
 * the portable branches, the same results: maxima, comparisons and sums in index order are exact); the Python side checks every precondition
 * (contiguous fp32 rows, 1 <= V, 0 < top_p < 1) before calling.
 */
#define _GNU_SOURCE  /* qsort_r */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the largest of n >= 1 floats (NaN-free rows: softmax outputs) */
static float row_max(const float* p, int n) {
#if defined(__AVX2__)
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(p + i));
    float m[8];
    _mm256_storeu_ps(m, m8);
#else  /* portable: 8 running maxima the compiler can vectorise */
    float m[8];
    for (int l = 0; l < 8; ++l) m[l] = -INFINITY;
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; ++l) m[l] = p[i + l] > m[l] ? p[i + l] : m[l];
#endif
    float best = m[0];
    for (int l = 1; l < 8; ++l) best = m[l] > best ? m[l] : best;
    for (; i < n; ++i) best = p[i] > best ? p[i] : best;
    return best;
}

/* the indices of the tokens with p >= t, in index order, into idx; returns their count */
static int above(const float* p, int n, float t, int* idx) {
    int k = 0, i = 0;
#if defined(__AVX2__)
    const __m256 t8 = _mm256_set1_ps(t);
    for (; i + 8 <= n; i += 8) {
        unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), t8, _CMP_GE_OQ));
        while (bits) {
            idx[k++] = i + __builtin_ctz(bits);
            bits &= bits - 1;
        }
    }
#endif
    for (; i < n; ++i)
        if (p[i] >= t) idx[k++] = i;
    return k;
}

/* 1 if token i ranks below token j (lower probability, or the same and a higher index) */
static inline int below(const float* p, int i, int j) {
    return p[i] < p[j] || (p[i] == p[j] && i > j);
}

/* qsort_r's order of candidates: the ranking above, best first (arg: the row) */
static int by_rank(const void* a, const void* b, void* arg) {
    const float* p = (const float*)arg;
    const int i = *(const int*)a, j = *(const int*)b;
    return below(p, i, j) - below(p, j, i);
}

static int by_index(const void* a, const void* b, void* arg) {
    (void)arg;
    const int i = *(const int*)a, j = *(const int*)b;
    return (i > j) - (i < j);
}

/* restores the heap idx[0 .. m) (each parent ranking below its children: the worst at the root) below node a */
static void sift_down(const float* p, int* idx, int a, int m) {
    for (int c; (c = 2 * a + 1) < m; a = c) {
        if (c + 1 < m && below(p, idx[c + 1], idx[c])) ++c;
        if (!below(p, idx[c], idx[a])) break;
        const int t = idx[a];
        idx[a] = idx[c];
        idx[c] = t;
    }
}

/* the m best-ranked of idx[0 .. n) (m < n) moved to idx[0 .. m), in no order: a heap of the m best so far whose root
 * is the worst of them, O(n log m) */
static void select_best(const float* p, int* idx, int n, int m) {
    for (int s = m / 2 - 1; s >= 0; --s) sift_down(p, idx, s, m);
    for (int x = m; x < n; ++x)
        if (below(p, idx[0], idx[x])) {  /* better than the worst kept: it takes the root's place */
            idx[0] = idx[x];
            sift_down(p, idx, 0, m);
        }
}

/* probs: (N, V) contiguous rows of a softmax, each replaced in place by its nucleus distribution; work: V ints;
 * left: N flags. A row whose largest probability is not positive and finite (NaN), or whose nucleus holds more than
 * max_kept tokens, is left as it is with its flag set, for the caller's full sort: each row's result is its own,
 * whatever the rows beside it. Returns the number of rows left, or -1 for arguments outside what the function
 * handles (nothing written). */
int triforce_top_p(float* probs, int N, int V, float top_p, int max_kept, int* work, uint8_t* left) {
    if (N < 1 || V < 1 || !(top_p > 0.f && top_p < 1.f) || max_kept < 1) return -1;
    int n_left = 0;
    for (int r = 0; r < N; ++r) {
        float* p = probs + (int64_t)r * V;
        const float pmax = row_max(p, V);
        left[r] = 0;
        if (!(pmax > 0.f) || isinf(pmax)) {  /* NaN or no mass */
            left[r] = 1, ++n_left;
            continue;
        }
        int k = 0;
        for (float t = pmax * 0x1p-5f;; t *= 0x1p-5f) {
            if (t < 1e-30f) t = 0.f;  /* every token: the last pass */
            int n = above(p, V, t, work);
            if (n > max_kept + 1) {  /* the first max_kept + 1 of the ranking decide: one left out, or too many kept */
                select_best(p, work, n, max_kept + 1);
                n = max_kept + 1;
            }
            qsort_r(work, (size_t)n, sizeof(int), by_rank, p);
            /* the mass ranked above candidate k as the PyTorch path computes it: the cumulative sum accumulated in
             * double and rounded to fp32 at each step (CPU cumsum of fp32), minus the candidate's own, in fp32 */
            double c = 0.0;
            for (k = 0; k < n; ++k) {
                const float pk = p[work[k]];
                c += pk;
                if (k > 0 && !((float)c - pk < top_p)) break;
            }
            if (k > max_kept) break;                    /* a flat row: the caller's full sort decides */
            if (k < n || t == 0.f) break;               /* a candidate left out (or every token in): decided */
        }
        if (k > max_kept) {
            left[r] = 1, ++n_left;
            continue;
        }
        float kept = 0.f;
        for (int i = 0; i < k; ++i) kept += p[work[i]];
        for (int i = 0; i < k; ++i) p[work[i]] /= kept;  /* renormalised in place */
        qsort_r(work, (size_t)k, sizeof(int), by_index, NULL);
        for (int i = 0, from = 0; i <= k; ++i) {  /* zero the gaps between the kept tokens */
            const int to = i < k ? work[i] : V;
            memset(p + from, 0, sizeof(float) * (size_t)(to - from));
            from = to + 1;
        }
    }
    return n_left;
}

/* probs: (N, V) contiguous non-negative weights; total: N doubles. With u NULL, checks every row and writes its
 * total (the fp64 sum in index order); returns 0, or the 1-based index of the first row that is not a distribution
 * (a negative or NaN entry, or a sum that is not positive and finite). Then with u (N uniforms in [0, 1)) and those
 * totals, draws each row's token into out and returns 0. Two calls, so that a caller draws its uniforms only for rows
 * it knows are distributions (its generator's state after a refusal is the one before). */
int triforce_sample(const float* probs, const double* u, int64_t* out, int N, int V, double* total) {
    for (int r = 0; r < N; ++r) {
        const float* p = probs + (int64_t)r * V;
        if (!u) {
            double sum = 0.0;
            int bad = 0, i = 0;
#if defined(__AVX2__)
            const __m256 zero = _mm256_setzero_ps();
            for (; i + 8 <= V; i += 8) {
                const __m256 v = _mm256_loadu_ps(p + i);
                if (_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_NEQ_UQ)) == 0) continue;  /* 8 zeros */
                if (_mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_NGE_UQ))) bad = 1;       /* < 0 or NaN */
                for (int l = 0; l < 8; ++l) sum += p[i + l];
            }
#endif
            for (; i < V; ++i) {
                if (!(p[i] >= 0.f)) bad = 1;
                sum += p[i];
            }
            if (bad || !(sum > 0.0) || isinf(sum)) return r + 1;
            total[r] = sum;
            continue;
        }
        const double target = u[r] * total[r];
        double c = 0.0;
        int64_t tok = -1, last = -1;
        for (int i = 0; i < V && tok < 0; i += 8) {
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

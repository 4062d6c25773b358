/* RMSNorm and rotary embeddings (RoPE) of a few rows in one call each, fp32.
 *
 * A decode step of SmolLM2 runs 61 RMSNorms and 60 RoPE rotations; in PyTorch each is 6-8 small ops
 * (pow, mean, add, rsqrt, mul, mul; neg, two slices, cat, mul, mul, add) of a few microseconds' dispatch apiece.
 * One call each made a decode step 1.16x faster at 256 tokens of context and 1.08x at 8,000, a 7-token block
 * 1.20x / 1.13x, on this project's CPU (bench/kernels/norm_rope.py). These are the same formulas as transformers'
 * LlamaRMSNorm and apply_rotary_pos_emb:
 *
 *     RMSNorm (Zhang & Sennrich, arXiv 1910.07467):  y = w * (x / sqrt(mean(x^2) + eps))
 *     RoPE (Su et al., arXiv 2104.09864, the rotate-half form):  y = x * cos + rotate_half(x) * sin,
 *         rotate_half(x) = (-x[hs/2:], x[:hs/2])
 *
 * Each row's result depends on that row only (the sum of squares in a fixed order), so a verification row equals
 * its decode step. Built at first use by triforce/kernels.py (plain C, -O3: the compiler vectorises the loops); the
 * Python side checks every precondition before calling.
 */
#include <math.h>
#include <stdint.h>

/* x, y: (rows, d) contiguous, w: (d,). */
void triforce_rms_norm(const float* x, const float* w, float* y, int64_t rows, int d, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * d;
        float* yr = y + r * d;
        float acc[16] = {0};  /* 16 partial sums, then a fixed tree: the same order for every row */
        int i = 0;
        for (; i + 16 <= d; i += 16)
            for (int l = 0; l < 16; ++l) acc[l] += xr[i + l] * xr[i + l];
        for (; i < d; ++i) acc[i % 16] += xr[i] * xr[i];
        for (int s = 8; s > 0; s /= 2)
            for (int l = 0; l < s; ++l) acc[l] += acc[l + s];
        const float inv = 1.0f / sqrtf(acc[0] / (float)d + eps);
        for (i = 0; i < d; ++i) yr[i] = w[i] * (xr[i] * inv);
    }
}

/* x: element (b, h, t, j) at b * sb + h * sh + t * st + j (j contiguous); y: (B, H, T, hs) contiguous;
 * cos, sin: (T, hs) contiguous. */
void triforce_rope(const float* x, int64_t sb, int64_t sh, int64_t st, float* y, const float* cos, const float* sin,
                   int B, int H, int T, int hs) {
    const int half = hs / 2;
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h)
            for (int t = 0; t < T; ++t) {
                const float* xp = x + b * sb + h * sh + t * st;
                float* yp = y + (((int64_t)b * H + h) * T + t) * hs;
                const float *c = cos + (int64_t)t * hs, *s = sin + (int64_t)t * hs;
                for (int j = 0; j < half; ++j) yp[j] = xp[j] * c[j] + -xp[j + half] * s[j];
                for (int j = half; j < hs; ++j) yp[j] = xp[j] * c[j] + xp[j - half] * s[j];
            }
}

/* The station's per-layer float32 CPU ops besides the linears and attention: RMSNorm, RoPE and SiLU * up (paged
 * attention: paged_attention.c), and each thread's reused scratch buffer.
 *
 * Each output row is computed from its own inputs in one fixed order (no reduction is split across threads or
 * changes with the number of rows), so a row's bits are the same alone, among any others of its wave, at any
 * thread count, and whether its prompt arrived in one chunk or several. Threads split rows.
 */
#include "row_math.h"

/* This thread's scratch buffer number `slot` (0: the packed linear's accumulators, 1: attention scores) of at least
 * `floats` floats, 64-byte aligned: grown when a call needs more, otherwise reused, so the kernels allocate nothing
 * per call once a station has served its largest wave. Contents are not kept between calls. */
float *thread_scratch(int slot, size_t floats) {
    static __thread float *buf[2];
    static __thread size_t cap[2];
    if (floats > cap[slot]) {
        free(buf[slot]);
        size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
        buf[slot] = aligned_alloc(64, bytes);
        cap[slot] = buf[slot] ? bytes / sizeof(float) : 0;
    }
    return buf[slot];
}

/* out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)), x and out [T, d] (row strides ldx, d). */
void rmsnorm_f32(const float *x, int64_t T, int64_t ldx, int64_t d, const float *w, float eps, float *out,
                 int threads) {
#pragma omp parallel for num_threads(team(T, threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * ldx;
        float inv = 1.0f / sqrtf(dot(r, r, d) / (float)d + eps);
        for (int64_t i = 0; i < d; i++) out[t * d + i] = w[i] * (r[i] * inv);
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i] for gu [T, 2I] (gate then up) -> out [T, I]; silu(g) = g / (1 + e^-g).
 * Each row walks i the same way whatever T, so its bits do not depend on its company. */
void silu_mul_f32(const float *gu, int64_t T, int64_t I, float *out, int threads) {
#pragma omp parallel for num_threads(team(T, threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {  /* the scalar loop's operations, 8 lanes at a time */
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp8_f32(_mm256_xor_ps(gv, _mm256_set1_ps(-0.0f)));  /* exp(-g): the sign flipped */
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sv, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) {
            float s = g[i] / (1.0f + exp_f32(-g[i]));
            o[i] = s * u[i];
        }
    }
}

/* Rotate heads [T, heads, D] in place (row stride ldx) by cos/sin [T, D] (the first half pairs with the second). */
void rope_f32(float *x, int64_t T, int64_t ldx, int64_t heads, int64_t D, const float *cos_, const float *sin_,
              int threads) {
    int64_t half = D / 2;
#pragma omp parallel for num_threads(team(T, threads)) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_ + t * D, *s = sin_ + t * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * ldx + h * D;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

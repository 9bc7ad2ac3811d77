/* What csrc/layer_ops.c and csrc/paged_attention.c share: a row's fixed-order dot product and e^x, the threads a
 * loop over rows takes, and each thread's scratch buffer. The helpers are static inline, so every file that includes
 * them runs the same operations in the same order: the same bits wherever they are used.
 */
#ifndef WAVEMESH_ROW_MATH_H
#define WAVEMESH_ROW_MATH_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define PART 8 /* partial sums per dot product: one AVX2 vector, summed by a fixed tree */
#define MIN_ROWS_PER_THREAD 8 /* fewer rows than this per thread: one thread (a team costs more than the rows) */

float *thread_scratch(int slot, size_t floats); /* layer_ops.c: this thread's reused buffer */

static inline int team(int64_t rows, int threads) { return rows >= (int64_t)threads * MIN_ROWS_PER_THREAD ? threads : 1; }

/* e^x for float32: x = n ln2 + r (|r| <= ln2 / 2), a degree-7 polynomial in r, scaled by 2^n; every step an
 * explicit fused multiply-add or a single operation, so the vector and scalar forms give the same bits. Inputs are
 * clamped to [-87, 88] (beyond them SiLU is 0 or x to float32's precision anyway). */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693145751953125f, x);
    r = fmaf(n, -1.428606765330187e-06f, r);
    float p = fmaf(1.9875691500e-4f, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* exp_f32 on 8 lanes: the same operations in the same order (the clamp keeps a NaN a NaN, as the scalar one's
 * comparisons do), so each lane's bits are exp_f32's; GCC leaves the scalar loops unvectorized (rintf). */
static inline __m256 exp8_f32(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.0f), x));  /* NaN: the second operand */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.428606765330187e-06f), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.9875691500e-4f), r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline float tree8(const float p[PART]) {
    return ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
}

/* sum_i a[i] * b[i]: PART lanes, a fixed tree, then the tail past the last multiple of PART in order. */
static inline float dot(const float *a, const float *b, int64_t n) {
    float p[PART] = {0};
    int64_t full = n - n % PART;
    for (int64_t i = 0; i < full; i += PART)
        for (int j = 0; j < PART; j++) p[j] += a[i + j] * b[i + j];
    float sum = tree8(p);
    for (int64_t i = full; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#endif

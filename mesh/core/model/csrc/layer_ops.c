/* The station's per-layer float32 CPU ops besides the linears: RMSNorm, RoPE and paged attention.
 *
 * Each output row is computed from its own inputs in one fixed order (no reduction is split across threads or
 * changes with the number of rows), so a row's bits are the same alone, among any others of its wave, at any
 * thread count, and whether its prompt arrived in one chunk or several. Threads split rows (and KV heads).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PART 8 /* partial sums per dot product: one AVX2 vector, summed by a fixed tree */
#define MIN_ROWS_PER_THREAD 8 /* fewer rows than this per thread: one thread (a team costs more than the rows) */

static inline int team(int64_t rows, int threads) { return rows >= (int64_t)threads * MIN_ROWS_PER_THREAD ? threads : 1; }

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

/* One row's query head qh [D] against its sequence's keys at positions [first, p] (head g of the paged cache):
 * the scores, their max, exp and sum in position order, then the values weighted in position order. Called with a
 * constant D where it can be, so the compiler keeps the D-wide sums in registers; every row takes the same path. */
static inline __attribute__((always_inline)) void attend_one(
        const float *qh, const float *kc, const float *vc, const int64_t *tab, int64_t BT, int64_t block_stride,
        int64_t g, int64_t first, int64_t p, const int64_t D, float scale, float *score, float *o) {
    float mx = -INFINITY;
    for (int64_t s = first; s <= p;) {  /* block by block: no division per key */
        int64_t b = s / BT, off = s % BT, n = BT - off < p + 1 - s ? BT - off : p + 1 - s;
        const float *key = kc + tab[b] * block_stride + (g * BT + off) * D;
        for (int64_t j = 0; j < n; j++) {
            float sc = dot(qh, key + j * D, D) * scale;
            score[s - first + j] = sc;
            if (sc > mx) mx = sc;
        }
        s += n;
    }
    float total = 0.0f;
    for (int64_t i = 0; i <= p - first; i++) {
        score[i] = expf(score[i] - mx);
        total += score[i];
    }
    float acc[D];
    for (int64_t i = 0; i < D; i++) acc[i] = 0.0f;
    for (int64_t s = first; s <= p;) {
        int64_t b = s / BT, off = s % BT, n = BT - off < p + 1 - s ? BT - off : p + 1 - s;
        const float *val = vc + tab[b] * block_stride + (g * BT + off) * D;
        for (int64_t j = 0; j < n; j++) {
            float e = score[s - first + j];
            for (int64_t i = 0; i < D; i++) acc[i] += e * val[j * D + i];
        }
        s += n;
    }
    for (int64_t i = 0; i < D; i++) o[i] = acc[i] / total;
}

/* Store every row's k/v [T, KVH, D] in the paged cache [blocks, KVH, BT, D] at its position, then attend each
 * row's query heads q [T, H, D] to its sequence's keys at positions [max(0, pos - window + 1), pos] (window 0:
 * all). tables: every sequence's block table, concatenated; row_table[t]: where row t's table starts;
 * row_pos[t]: row t's position. out [T, H, D]. */
void paged_attention_f32(const float *q, const float *k, const float *v, int64_t ldq, int64_t ldkv, int64_t T,
                         int64_t H, int64_t KVH, int64_t D, float *kc, float *vc, int64_t BT,
                         const int64_t *tables, const int64_t *row_table, const int64_t *row_pos, int64_t window,
                         float scale, float *out, int threads) {
    int64_t block_stride = KVH * BT * D, G = H / KVH, max_keys = 1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t *tab = tables + row_table[t];
        int64_t p = row_pos[t], blk = tab[p / BT], off = p % BT;
        for (int64_t g = 0; g < KVH; g++) {
            memcpy(kc + blk * block_stride + (g * BT + off) * D, k + t * ldkv + g * D, D * sizeof(float));
            memcpy(vc + blk * block_stride + (g * BT + off) * D, v + t * ldkv + g * D, D * sizeof(float));
        }
        if (p + 1 > max_keys) max_keys = p + 1;
    }
#pragma omp parallel num_threads(team(T * H * max_keys / 512, threads))  /* per thread: >= 8 x 512 keys */
    {
        float *score = malloc(max_keys * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < T * H; task++) {
            int64_t t = task / H, h = task % H, g = h / G, p = row_pos[t];
            int64_t first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            const int64_t *tab = tables + row_table[t];
            const float *qh = q + t * ldq + h * D;
            float *o = out + (t * H + h) * D;
            if (D == 64)
                attend_one(qh, kc, vc, tab, BT, block_stride, g, first, p, 64, scale, score, o);
            else if (D == 128)
                attend_one(qh, kc, vc, tab, BT, block_stride, g, first, p, 128, scale, score, o);
            else
                attend_one(qh, kc, vc, tab, BT, block_stride, g, first, p, D, scale, score, o);
        }
        free(score);
    }
}

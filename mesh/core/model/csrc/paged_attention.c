/* Paged attention for the station's float32 CPU path: each row's new keys and values stored in the paged cache, and
 * the row attending to its own sequence's keys up to its position, prompt chunk or decode token alike.
 *
 * Each (row, head) is one fixed-order computation (no reduction is split across threads or changes with the number
 * of rows), so a row's bits are the same alone, among any others of its wave, at any thread count, and whether its
 * prompt arrived in one chunk or several. Threads split rows and KV heads.
 */
#include "row_math.h"

/* Horizontal sum of 8 lanes in tree8's order: ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)). */
static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_hadd_ps(x, x);
    return _mm_cvtss_f32(_mm_hadd_ps(x, x));
}

/* The sums of 8 vectors' lanes, each in tree8's order (as hsum8), side by side: lane k is a[k]'s sum. */
static inline __m256 hsum8x8(const __m256 a[8]) {
    __m256 b[4];
    for (int k = 0; k < 4; k++)  /* [a_k lo + a_k hi | a_k+4 lo + a_k+4 hi]: v_j + v_j+4 */
        b[k] = _mm256_add_ps(_mm256_permute2f128_ps(a[k], a[k + 4], 0x20), _mm256_permute2f128_ps(a[k], a[k + 4], 0x31));
    return _mm256_hadd_ps(_mm256_hadd_ps(b[0], b[1]), _mm256_hadd_ps(b[2], b[3]));
}

/* scores[j] = (qh . key[j]) * scale for n keys [n, D] side by side. Where D is a multiple of 8 each key's dot
 * product is 8 lanes of fused multiply-adds over d in order, summed in tree8's order (dot() otherwise), eight keys
 * in flight at a time; a key's score is the same whichever keys share its eight. */
static inline __attribute__((always_inline)) void score_keys(const float *qh, const float *key, int64_t n,
                                                             const int64_t D, float scale, float *scores) {
    if (D % PART) {
        for (int64_t j = 0; j < n; j++) scores[j] = dot(qh, key + j * D, D) * scale;
        return;
    }
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const float *k0 = key + j * D;
        __m256 a[8];
        for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += PART) {
            __m256 qv = _mm256_loadu_ps(qh + i);
            for (int k = 0; k < 8; k++) a[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + k * D + i), a[k]);
        }
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale)));
    }
    for (; j < n; j++) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t i = 0; i < D; i += PART)
            a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(key + j * D + i), a);
        scores[j] = hsum8(a) * scale;
    }
}

/* The attention weights of `keys` scores in place: their max (PART lanes by position, then across them; a max is
 * the same in any grouping), every exp(score - max) (exp_f32, independent of the others); returns their sum in
 * PART lanes by position, then tree8, then the tail in order. */
static inline __attribute__((always_inline)) float softmax_weights(float *score, int64_t keys) {
    float lane_max[PART], mx = -INFINITY;
    int64_t full = keys - keys % PART;
    for (int j = 0; j < PART; j++) lane_max[j] = -INFINITY;
    for (int64_t i = 0; i < full; i += PART)
        for (int j = 0; j < PART; j++) lane_max[j] = score[i + j] > lane_max[j] ? score[i + j] : lane_max[j];
    for (int j = 0; j < PART; j++) mx = lane_max[j] > mx ? lane_max[j] : mx;
    for (int64_t i = full; i < keys; i++) mx = score[i] > mx ? score[i] : mx;
    int64_t i8 = 0;
    for (; i8 + 8 <= keys; i8 += 8)
        _mm256_storeu_ps(score + i8, exp8_f32(_mm256_sub_ps(_mm256_loadu_ps(score + i8), _mm256_set1_ps(mx))));
    for (; i8 < keys; i8++) score[i8] = exp_f32(score[i8] - mx);
    float lanes[PART] = {0};
    for (int64_t i = 0; i < full; i += PART)
        for (int j = 0; j < PART; j++) lanes[j] += score[i + j];
    float total = tree8(lanes);
    for (int64_t i = full; i < keys; i++) total += score[i];
    return total;
}

/* One row's query head qh [D] against its sequence's keys at positions [first, p] (head g of the paged cache):
 * the scores (score_keys), their weights (softmax_weights), then the values weighted in position order into two
 * sums (even and odd keys) added last. Called with a constant D where it can be, so the compiler keeps the D-wide
 * sums in registers; every row takes the same path. */
static inline __attribute__((always_inline)) void attend_one(
        const float *qh, const float *kc, const float *vc, const int64_t *tab, int64_t BT, int64_t block_stride,
        int64_t g, int64_t first, int64_t p, const int64_t D, float scale, float *score, float *o) {
    for (int64_t s = first; s <= p;) {  /* block by block: no division per key */
        int64_t b = s / BT, off = s % BT, n = BT - off < p + 1 - s ? BT - off : p + 1 - s;
        score_keys(qh, kc + tab[b] * block_stride + (g * BT + off) * D, n, D, scale, score + s - first);
        s += n;
    }
    float total = softmax_weights(score, p + 1 - first);
    float even[D], odd[D];  /* the values at even and at odd key indices (from first), each in position order */
    for (int64_t i = 0; i < D; i++) even[i] = odd[i] = 0.0f;
    for (int64_t s = first; s <= p;) {
        int64_t b = s / BT, off = s % BT, n = BT - off < p + 1 - s ? BT - off : p + 1 - s, j = 0;
        const float *val = vc + tab[b] * block_stride + (g * BT + off) * D, *e = score + s - first;
        if ((s - first) & 1) {  /* this block starts at an odd key */
            for (int64_t i = 0; i < D; i++) odd[i] = fmaf(e[0], val[i], odd[i]);
            j = 1;
        }
        for (; j + 2 <= n; j += 2)
            for (int64_t i = 0; i < D; i++) {
                even[i] = fmaf(e[j], val[j * D + i], even[i]);
                odd[i] = fmaf(e[j + 1], val[(j + 1) * D + i], odd[i]);
            }
        if (j < n)
            for (int64_t i = 0; i < D; i++) even[i] = fmaf(e[j], val[j * D + i], even[i]);
        s += n;
    }
    for (int64_t i = 0; i < D; i++) o[i] = (even[i] + odd[i]) / total;
}

#if defined(__AVX512VL__)
/* Prompt rows take their heads together (attend_group), which needs 32 vector registers: with 16 (an AVX2 build
 * of the Zen 5 VM, 4 keys and 2 chunks at a time) the grouped pass was 0.82-1.10x, so there every row reads per
 * head. */
#define GROUP_PROMPT_HEADS 1
#define GROUP_KEYS 8 /* keys scored at once for a group of heads: 3 x 8 sums in registers */
#define GROUP_CHUNKS 4 /* 8-float chunks of a value row weighted at once: 3 heads x 2 sums x 4 in registers */
#define MAX_GROUP 3 /* query heads of one KV head attended together: each key and value row is loaded once for them */

/* Several query heads (NQ <= MAX_GROUP, of one row and one KV head) against the same keys: each head's scores,
 * weights and output are computed exactly as attend_one computes them (the same fused multiply-adds, in the same
 * order, the same sums), so the bits do not change; only the loads are shared, a key or value row read once for
 * NQ heads. D is a constant multiple of 8 * GROUP_CHUNKS. */
static inline __attribute__((always_inline)) void attend_group(
        const float *const *qs, const int NQ, const float *kc, const float *vc, const int64_t *tab, int64_t BT,
        int64_t block_stride, int64_t g, int64_t first, int64_t p, const int64_t D, float scale, float *const *scores,
        float *const *outs) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t s = first; s <= p;) {  /* scores: as score_keys, the keys of a block GROUP_KEYS at a time */
        int64_t b = s / BT, off = s % BT, n = BT - off < p + 1 - s ? BT - off : p + 1 - s, j = 0, at = s - first;
        const float *key = kc + tab[b] * block_stride + (g * BT + off) * D;
        for (; j + GROUP_KEYS <= n; j += GROUP_KEYS) {
            __m256 a[MAX_GROUP][GROUP_KEYS];
            for (int q = 0; q < NQ; q++)
                for (int k = 0; k < GROUP_KEYS; k++) a[q][k] = _mm256_setzero_ps();
            for (int64_t i = 0; i < D; i += PART) {
                __m256 qv[MAX_GROUP];
                for (int q = 0; q < NQ; q++) qv[q] = _mm256_loadu_ps(qs[q] + i);
                for (int k = 0; k < GROUP_KEYS; k++) {
                    __m256 kv = _mm256_loadu_ps(key + (j + k) * D + i);
                    for (int q = 0; q < NQ; q++) a[q][k] = _mm256_fmadd_ps(qv[q], kv, a[q][k]);
                }
            }
            for (int q = 0; q < NQ; q++)
                _mm256_storeu_ps(scores[q] + at + j, _mm256_mul_ps(hsum8x8(a[q]), vscale));
        }
        for (; j < n; j++)
            for (int q = 0; q < NQ; q++) {
                __m256 a = _mm256_setzero_ps();
                for (int64_t i = 0; i < D; i += PART)
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(qs[q] + i), _mm256_loadu_ps(key + j * D + i), a);
                scores[q][at + j] = hsum8(a) * scale;
            }
        s += n;
    }
    float total[MAX_GROUP];
    for (int q = 0; q < NQ; q++) total[q] = softmax_weights(scores[q], p + 1 - first);
    /* values: as attend_one, block by block (a block's rows stay in L1 while GROUP_CHUNKS x 8 of d at a time go
     * through the registers), each head's two D-wide sums kept here between blocks */
    float even_sum[MAX_GROUP][D] __attribute__((aligned(32))), odd_sum[MAX_GROUP][D] __attribute__((aligned(32)));
    for (int q = 0; q < NQ; q++)
        for (int64_t i = 0; i < D; i++) even_sum[q][i] = odd_sum[q][i] = 0.0f;
    for (int64_t s = first; s <= p;) {
        int64_t b = s / BT, off = s % BT, n = BT - off < p + 1 - s ? BT - off : p + 1 - s, at = s - first;
        const float *block = vc + tab[b] * block_stride + (g * BT + off) * D;
        for (int64_t c = 0; c < D; c += PART * GROUP_CHUNKS) {
            const float *val = block + c;
            __m256 even[MAX_GROUP][GROUP_CHUNKS], odd[MAX_GROUP][GROUP_CHUNKS];
            for (int q = 0; q < NQ; q++)
                for (int u = 0; u < GROUP_CHUNKS; u++) {
                    even[q][u] = _mm256_load_ps(even_sum[q] + c + u * PART);
                    odd[q][u] = _mm256_load_ps(odd_sum[q] + c + u * PART);
                }
            int64_t j = 0;
            if (at & 1) {  /* this block starts at an odd key */
                for (int u = 0; u < GROUP_CHUNKS; u++) {
                    __m256 v = _mm256_loadu_ps(val + u * PART);
                    for (int q = 0; q < NQ; q++)
                        odd[q][u] = _mm256_fmadd_ps(_mm256_set1_ps(scores[q][at]), v, odd[q][u]);
                }
                j = 1;
            }
            for (; j + 2 <= n; j += 2)
                for (int u = 0; u < GROUP_CHUNKS; u++) {
                    __m256 v0 = _mm256_loadu_ps(val + j * D + u * PART), v1 = _mm256_loadu_ps(val + (j + 1) * D + u * PART);
                    for (int q = 0; q < NQ; q++) {
                        even[q][u] = _mm256_fmadd_ps(_mm256_set1_ps(scores[q][at + j]), v0, even[q][u]);
                        odd[q][u] = _mm256_fmadd_ps(_mm256_set1_ps(scores[q][at + j + 1]), v1, odd[q][u]);
                    }
                }
            if (j < n)
                for (int u = 0; u < GROUP_CHUNKS; u++) {
                    __m256 v = _mm256_loadu_ps(val + j * D + u * PART);
                    for (int q = 0; q < NQ; q++)
                        even[q][u] = _mm256_fmadd_ps(_mm256_set1_ps(scores[q][at + j]), v, even[q][u]);
                }
            for (int q = 0; q < NQ; q++)
                for (int u = 0; u < GROUP_CHUNKS; u++) {
                    _mm256_store_ps(even_sum[q] + c + u * PART, even[q][u]);
                    _mm256_store_ps(odd_sum[q] + c + u * PART, odd[q][u]);
                }
        }
        s += n;
    }
    for (int q = 0; q < NQ; q++)
        for (int64_t i = 0; i < D; i += PART)
            _mm256_storeu_ps(outs[q] + i, _mm256_div_ps(_mm256_add_ps(_mm256_load_ps(even_sum[q] + i),
                                                                      _mm256_load_ps(odd_sum[q] + i)),
                                                        _mm256_set1_ps(total[q])));
}

/* The heads [h0, h1) of one row (all of KV head g) with a constant D: in groups of up to MAX_GROUP through
 * attend_group. */
static inline __attribute__((always_inline)) void attend_heads(
        const float *q, const int64_t *tab, const float *kc, const float *vc, int64_t BT, int64_t block_stride,
        int64_t g, int64_t first, int64_t p, const int64_t D, float scale, int64_t h0, int64_t h1, int64_t keys_cap,
        float *score, float *out) {
    for (int64_t h = h0; h < h1; h += MAX_GROUP) {
        const float *qs[MAX_GROUP];
        float *scores[MAX_GROUP], *outs[MAX_GROUP];
        int nq = h1 - h < MAX_GROUP ? (int)(h1 - h) : MAX_GROUP;
        for (int i = 0; i < nq; i++) {
            qs[i] = q + (h + i) * D;
            scores[i] = score + i * keys_cap;
            outs[i] = out + (h + i) * D;
        }
        if (nq == 3)
            attend_group(qs, 3, kc, vc, tab, BT, block_stride, g, first, p, D, scale, scores, outs);
        else if (nq == 2)
            attend_group(qs, 2, kc, vc, tab, BT, block_stride, g, first, p, D, scale, scores, outs);
        else
            attend_group(qs, 1, kc, vc, tab, BT, block_stride, g, first, p, D, scale, scores, outs);
    }
}

#else
#define GROUP_PROMPT_HEADS 0
#define MAX_GROUP 1
#endif

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
#pragma omp parallel num_threads(team(T * H * max_keys / 64, threads))  /* per thread: >= 8 x 64 keys */
    {
        float *score = thread_scratch(1, (size_t)MAX_GROUP * max_keys);
        /* a task: one row's query heads of one KV head, dealt out one at a time in turn (a prompt's later rows
         * attend to more keys, and in contiguous shares the thread holding the last rows did ~3x the first one's
         * work). A row of a prompt chunk (its sequence has other rows in the wave, whose keys are the same and stay
         * in cache from row to row) takes its heads together through attend_group, one pass over the keys and
         * values for all of them: 1.2-1.4x faster at 512 rows of 1536-4096 keys, 1.0-1.3x at 0-512 (where the build
         * has 32 vector registers: GROUP_PROMPT_HEADS). A decode row (one per sequence: its keys come from memory)
         * takes them one by one, each attend_one reading what the first left in cache: there the grouped pass was
         * 0.55-0.85x at 48-64 rows of ~300-700 keys, and 0.69-1.05x at 16-32 rows of 600-4000. Either way a head's bits are the
         * same, whatever its path, task or thread. */
        const int64_t tasks = T * KVH;
#pragma omp for schedule(static, 1)
        for (int64_t task = 0; task < tasks; task++) {
            int64_t t = task / KVH, g = task % KVH, p = row_pos[t];
            int64_t first = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            const int64_t *tab = tables + row_table[t];
            const float *qt = q + t * ldq;
            float *ot = out + t * H * D;
#if GROUP_PROMPT_HEADS
            int chunk = (t > 0 && row_table[t - 1] == row_table[t]) || (t + 1 < T && row_table[t + 1] == row_table[t]);
            if (chunk && D == 64)
                attend_heads(qt, tab, kc, vc, BT, block_stride, g, first, p, 64, scale, g * G, (g + 1) * G, max_keys,
                             score, ot);
            else if (chunk && D == 128)
                attend_heads(qt, tab, kc, vc, BT, block_stride, g, first, p, 128, scale, g * G, (g + 1) * G,
                             max_keys, score, ot);
            else
#endif
                for (int64_t h = g * G; h < (g + 1) * G; h++) {
                    if (D == 64)
                        attend_one(qt + h * D, kc, vc, tab, BT, block_stride, g, first, p, 64, scale, score, ot + h * D);
                    else if (D == 128)
                        attend_one(qt + h * D, kc, vc, tab, BT, block_stride, g, first, p, 128, scale, score, ot + h * D);
                    else
                        attend_one(qt + h * D, kc, vc, tab, BT, block_stride, g, first, p, D, scale, score, ot + h * D);
                }
        }
    }
}

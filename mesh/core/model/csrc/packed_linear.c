/* Batch-invariant float32 linear for the station's CPU path: out[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]).
 *
 * Every output element is ONE chain of fused multiply-adds over k = 0, 1, ..., K-1, then the bias: the same
 * additions in the same order whatever the row count T, the tile the row falls in, the thread count or the
 * vector width (AVX-512 and AVX2 give the same bits: each lane is its own chain). Threads split the output
 * features, never k, so a row's result is the same alone or among any others.
 *
 * The weight is packed once as [N / 64][K][64] (N padded to a multiple of 64 with zeros): a tile of 64 output
 * features reads one contiguous stream, each x value is broadcast against it, and a row tile of up to 6 rows
 * keeps its accumulators in registers; k is walked in blocks of 64 whose weights stay in L1 while every row tile
 * passes, so the weight comes from memory once per call whatever T is.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define TILE_N 64 /* output features per packed tile */
#define TILE_T 6  /* rows per register tile (see CVECS) */
#define BLOCK_K 64 /* k per block: a tile's 64 x 64 weights (16 KiB) stay in L1 while every row passes */
#ifndef PREFETCH_K
#define PREFETCH_K 16 /* k ahead (64 floats each): measured best of 16, 64, 128 at 4-64 rows */
#endif
#define INLINE static inline __attribute__((always_inline))

float *thread_scratch(int slot, size_t floats); /* layer_ops.c: this thread's reused buffer */

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
INLINE vec vload(const float *p) { return _mm512_loadu_ps(p); }
INLINE vec vbroadcast(const float *p) { return _mm512_set1_ps(*p); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vec;
INLINE vec vload(const float *p) { return _mm256_loadu_ps(p); }
INLINE vec vbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
INLINE void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
#else
#error "packed_linear needs AVX2 with FMA, or AVX-512"
#endif

#define VECS (TILE_N / LANES)
/* vectors of a tile's width one register tile covers at once: the whole tile with AVX-512 (6 x 4 accumulators in
 * 32 registers), a quarter with AVX2 (6 x 2 in 16 registers; the whole tile, 6 x 8, spilled to the stack) */
#if defined(__AVX512F__)
#define CVECS VECS
#else
#define CVECS 2
#endif

/* tb (constant, <= TILE_T) rows of x over k in [k0, k1) of one packed tile, continuing the partial sums in acc
 * [tb][64] (zero before the first block): storing and reloading a partial sum leaves its bits as they were. The
 * tile's columns are taken cv vectors at a time (cv constant, dividing VECS); each output is still one chain
 * over k in order, so cv changes no bit. */
INLINE void tile_block(const float *x, int64_t ldx, const int tb, const int cv, const float *wp, int64_t k0,
                       int64_t k1, float *accbuf) {
    for (int c0 = 0; c0 < VECS; c0 += cv) {
        const float *wc = wp + c0 * LANES;
        float *ac = accbuf + c0 * LANES;
        vec acc[TILE_T][VECS];
        for (int i = 0; i < tb; i++)
            for (int j = 0; j < cv; j++) acc[i][j] = vload(ac + i * TILE_N + j * LANES);
        for (int64_t k = k0; k < k1; k++) {
            vec wv[VECS];
            for (int j = 0; j < cv; j++) wv[j] = vload(wc + k * TILE_N + j * LANES);
            for (int j = 0; j < cv * LANES; j += 16)  /* the next block's weights, on their way while this computes */
                _mm_prefetch((const char *)(wc + (k + PREFETCH_K) * TILE_N + j), _MM_HINT_T0);
            for (int i = 0; i < tb; i++) {
                vec xb = vbroadcast(x + i * ldx + k);
                for (int j = 0; j < cv; j++) acc[i][j] = vfma(xb, wv[j], acc[i][j]);
            }
        }
        for (int i = 0; i < tb; i++)
            for (int j = 0; j < cv; j++) vstore(ac + i * TILE_N + j * LANES, acc[i][j]);
    }
}

static void rows_block(const float *x, int64_t ldx, int64_t T, const float *wp, int64_t k0, int64_t k1,
                       float *accbuf) {
    int64_t t = 0;
    for (; t + TILE_T <= T; t += TILE_T)
        tile_block(x + t * ldx, ldx, TILE_T, CVECS, wp, k0, k1, accbuf + t * TILE_N);
    switch (T - t) {  /* the last rows: one smaller tile, the same chains (one or two rows: the whole width) */
        case 5: tile_block(x + t * ldx, ldx, 5, CVECS, wp, k0, k1, accbuf + t * TILE_N); break;
        case 4: tile_block(x + t * ldx, ldx, 4, CVECS, wp, k0, k1, accbuf + t * TILE_N); break;
        case 3: tile_block(x + t * ldx, ldx, 3, CVECS, wp, k0, k1, accbuf + t * TILE_N); break;
        case 2: tile_block(x + t * ldx, ldx, 2, VECS, wp, k0, k1, accbuf + t * TILE_N); break;
        case 1: tile_block(x + t * ldx, ldx, 1, VECS, wp, k0, k1, accbuf + t * TILE_N); break;
        default: break;
    }
}

/* x [T, K] (row stride ldx), wp packed [ceil(N/64)][K][64], bias [ceil(N/64) * 64] zero-padded or NULL
 * -> out [T, N] contiguous. */
void packed_linear_f32(const float *x, int64_t T, int64_t ldx, int64_t K, const float *wp, int64_t N,
                       const float *bias, float *out, int threads) {
    int64_t tiles = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel num_threads(threads)
    {
        float *accbuf = thread_scratch(0, (size_t)T * TILE_N);
#pragma omp for schedule(static)
        for (int64_t ti = 0; ti < tiles; ti++) {
            const float *w = wp + ti * K * TILE_N;
            memset(accbuf, 0, (size_t)T * TILE_N * sizeof(float));
            for (int64_t k0 = 0; k0 < K; k0 += BLOCK_K)
                rows_block(x, ldx, T, w, k0, k0 + BLOCK_K < K ? k0 + BLOCK_K : K, accbuf);
            int64_t n0 = ti * TILE_N;
            int n_valid = (int)(N - n0 < TILE_N ? N - n0 : TILE_N);
            for (int64_t t = 0; t < T; t++)
                for (int c = 0; c < n_valid; c++)
                    out[t * N + n0 + c] = bias ? accbuf[t * TILE_N + c] + bias[n0 + c] : accbuf[t * TILE_N + c];
        }
    }
}

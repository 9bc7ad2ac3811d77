/* Batch-invariant float32 linear for the station's CPU path: out[t, n] = sum_k x[t, k] * w[n, k] (+ bias[n]).
 *
 * Every output element is ONE chain of fused multiply-adds over k = 0, 1, ..., K-1, then the bias: the same
 * additions in the same order whatever the row count T, the tile the row falls in, the thread count or the
 * vector width (AVX-512 and AVX2 give the same bits: each lane is its own chain). Threads split the output
 * features (tiles claimed as tile_claims.h says), never k, so a row's result is the same alone or among any others.
 *
 * The weight is packed once as [N / 64][K][64] (N padded to a multiple of 64 with zeros): a tile of 64 output
 * features reads one contiguous stream, each x value is broadcast against it, and a row tile of up to 6 rows
 * keeps its accumulators in registers (register_tile.h); k is walked in blocks of 64 whose weights stay in L1
 * while every row tile passes, so the weight comes from memory once per call whatever T is. A weight whose values
 * bfloat16 or float16 holds exactly may be packed so (half the bytes to stream; packed_linear_any), same bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "register_tile.h"
#include "tile_claims.h"

#define BLOCK_K 64 /* k per block: a tile's 64 x 64 weights (16 KiB) stay in L1 while every row passes */

float *thread_scratch(int slot, size_t floats); /* layer_ops.c: this thread's reused buffer */

/* The packed linear over weights in format fmt (constant; register_tile.h). */
static inline __attribute__((always_inline)) void packed_linear(const float *x, int64_t T, int64_t ldx, int64_t K,
                                                                const char *wp, const WeightFormat fmt, int64_t N,
                                                                const float *bias, float *out, int threads) {
    const int64_t wbytes = WBYTES(fmt);
    int64_t tiles = (N + TILE_N - 1) / TILE_N;
    TileClaims claims;
    tile_claims_init(&claims, tiles, threads);
#pragma omp parallel num_threads(threads)
    {
        float *accbuf = thread_scratch(0, (size_t)T * TILE_N);
        for (int64_t ti; (ti = tile_claim(&claims)) >= 0;) {
            const char *w = wp + ti * K * TILE_N * wbytes;
            memset(accbuf, 0, (size_t)T * TILE_N * sizeof(float));
            for (int64_t k0 = 0; k0 < K; k0 += BLOCK_K) /* streamed: each weight is read from memory once a call */
                all_rows_over_block(x + k0, ldx, T, w + k0 * TILE_N * wbytes, fmt,
                                    K - k0 < BLOCK_K ? K - k0 : BLOCK_K, 1, accbuf);
            int64_t n0 = ti * TILE_N;
            int n_valid = (int)(N - n0 < TILE_N ? N - n0 : TILE_N);
            for (int64_t t = 0; t < T; t++)
                for (int c = 0; c < n_valid; c++)
                    out[t * N + n0 + c] = bias ? accbuf[t * TILE_N + c] + bias[n0 + c] : accbuf[t * TILE_N + c];
        }
    }
}

/* x [T, K] (row stride ldx), wp packed [ceil(N/64)][K][64] float32, bias [ceil(N/64) * 64] zero-padded or NULL
 * -> out [T, N] contiguous. */
void packed_linear_f32(const float *x, int64_t T, int64_t ldx, int64_t K, const float *wp, int64_t N,
                       const float *bias, float *out, int threads) {
    packed_linear(x, T, ldx, K, (const char *)wp, WF_F32, N, bias, out, threads);
}

/* As packed_linear_f32 over wp packed [ceil(N/64)][K][64] in format fmt (a WeightFormat: float32; bfloat16, each
 * line's 32 columns interleaved; float16, columns in order; register_tile.h): the bits packed_linear_f32 gives over
 * the same values as float32. The Python path and fused_layer.c call this one. Each branch passes its format as a
 * constant, so the inlined loop is compiled once per format with the widening chosen at compile time. */
void packed_linear_any(const float *x, int64_t T, int64_t ldx, int64_t K, const void *wp, int fmt, int64_t N,
                       const float *bias, float *out, int threads) {
    if (fmt == WF_BF16) packed_linear(x, T, ldx, K, wp, WF_BF16, N, bias, out, threads);
    else if (fmt == WF_F16) packed_linear(x, T, ldx, K, wp, WF_F16, N, bias, out, threads);
    else packed_linear(x, T, ldx, K, wp, WF_F32, N, bias, out, threads);
}

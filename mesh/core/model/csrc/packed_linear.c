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
 * bfloat16 holds exactly may be packed as bfloat16 (half the bytes to stream; packed_linear_bf16), same bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "register_tile.h"
#include "tile_claims.h"

#define BLOCK_K 64 /* k per block: a tile's 64 x 64 weights (16 KiB) stay in L1 while every row passes */

float *thread_scratch(int slot, size_t floats); /* layer_ops.c: this thread's reused buffer */

/* The packed linear over weights of wbytes each (constant: 4, float32 tiles; 2, bfloat16 tiles, register_tile.h). */
static inline __attribute__((always_inline)) void packed_linear(const float *x, int64_t T, int64_t ldx, int64_t K,
                                                                const char *wp, const int wbytes, int64_t N,
                                                                const float *bias, float *out, int threads) {
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
                all_rows_over_block(x + k0, ldx, T, w + k0 * TILE_N * wbytes, wbytes,
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
    packed_linear(x, T, ldx, K, (const char *)wp, 4, N, bias, out, threads);
}

/* As packed_linear_f32 over wp packed [ceil(N/64)][K][64] bfloat16, each line's 32 columns interleaved
 * (register_tile.h): the bits packed_linear_f32 gives over the same values as float32. */
void packed_linear_bf16(const float *x, int64_t T, int64_t ldx, int64_t K, const uint16_t *wp, int64_t N,
                        const float *bias, float *out, int threads) {
    packed_linear(x, T, ldx, K, (const char *)wp, 2, N, bias, out, threads);
}

/* packed_linear_f32 or packed_linear_bf16 by the weight's size (fused_layer.c's layers carry it). */
void packed_linear_any(const float *x, int64_t T, int64_t ldx, int64_t K, const void *wp, int wbytes, int64_t N,
                       const float *bias, float *out, int threads) {
    if (wbytes == 2) packed_linear_bf16(x, T, ldx, K, wp, N, bias, out, threads);
    else packed_linear_f32(x, T, ldx, K, wp, N, bias, out, threads);
}

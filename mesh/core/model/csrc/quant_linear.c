/* Float32 linear over weights kept in GGUF's blocks (Q8_0, Q4_0, Q4_1, and the kinds quant_blocks.h makes of Q5_0,
 * Q5_1, the K-quants and the i-quants, groups of 32 all): out[t, n] = sum_k x[t, k] * w[n, k]
 * (+ bias[n]), each w[n, k] dequantized in registers to exactly the float32 the `gguf` package gives it:
 *   Q8_0: q * d          Q4_0: (q - 8) * d          Q4_1: q * d, rounded, then + m, rounded
 * with d and m the block's float16 scale and minimum. q * d is exact in float32 (an 11-bit float16 significand
 * times an integer of at most 8 bits), so its rounding changes nothing and Q4_1's weight is one fused multiply-add,
 * q * d + m rounded once: the same float32. Each output is then the chain packed_linear.c computes: fused
 * multiply-adds over k = 0, 1, ..., K-1 in order from zero, then the bias. So a station holding these weights gives
 * the bits of one holding them dequantized in packed float32 tiles, at every row count and thread count.
 *
 * The weights are laid out once at load (quant_repack.c; the layout in quant_blocks.h): a group's 64 float16 scales,
 * minimums and transposed quant bytes, so a k's 64 weights are 64 consecutive bytes; a group's scales are widened
 * to float32 once per pass over the group. For one to four rows of x (decode steps)
 * each weight is dequantized in registers straight into the sums; for more, a k-block of 64 is decoded into a
 * float32 buffer that stays in L1 while every row tile of up to 6 rows passes over it (register_tile.h),
 * accumulators in registers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"
#include "register_tile.h"
#include "tile_claims.h"

#define QBLOCK_K 64    /* k decoded at a time (two groups) */
#define FEW_ROWS 4     /* up to this many rows (at most 4), weights are dequantized straight into the sums */
/* With few rows the weights' bytes this far ahead are asked for (into L1) as they are read: a group's scale lines
 * at its start, then a line with each k (few_rows_k's `ask`). The hardware prefetcher alone left SmolLM2's
 * linears (Q4_1, the head Q8_0) reading ~11 GB/s at one row; asking for a whole group 16 KiB ahead at its start
 * took 0.68-0.74x the time at 1-4 rows (8 KiB about the same, 4 and 32 KiB 0.72-0.76x, into L2 0.72-0.75x), and
 * spreading the asks over the group 0.84-0.89x that again at 4-12 KiB (16-32 KiB 0.90-0.95x); 16 rows (weights
 * decoded into an L1 buffer, compute-bound) unchanged (session 49, the Intel VM with AMX; other CPU types not
 * measured). */
#define FEW_ROWS_AHEAD_BYTES 8192
_Static_assert(QTILE_N == TILE_N, "a repacked tile is one register-tile width");

#include "quant_decode.h"

/* Weights k0 .. k0 + kb - 1 of one tile (k0 and kb multiples of 32: whole groups), dequantized into wb [kb][64]. */
QINLINE void decode_block_of(const uint8_t *tile, int64_t gbytes, const int qtype, int64_t k0, int kb, float *wb) {
    float d[QTILE_N] __attribute__((aligned(64))), m[QTILE_N] __attribute__((aligned(64)));
    for (int k = 0; k < kb; k += GROUP) {
        const uint8_t *grp = tile + ((k0 + k) / GROUP) * gbytes;
        group_scales(grp, qtype, d, m);
        for (int j = 0; j < GROUP; j++) decode_k(group_quants(grp, qtype), qtype, j, d, m, wb + (k + j) * QTILE_N);
    }
}

static void decode_block(const uint8_t *tile, int64_t gbytes, int qtype, int64_t k0, int kb, float *wb) {
    switch (qtype) {  /* one specialized decoder per type */
        case Q8_0: decode_block_of(tile, gbytes, Q8_0, k0, kb, wb); break;
        case Q4_0: decode_block_of(tile, gbytes, Q4_0, k0, kb, wb); break;
        case Q4_KF: decode_block_of(tile, gbytes, Q4_KF, k0, kb, wb); break;
        case Q6_KF: decode_block_of(tile, gbytes, Q6_KF, k0, kb, wb); break;
        case Q5_KF: decode_block_of(tile, gbytes, Q5_KF, k0, kb, wb); break;
        case Q2_KF: decode_block_of(tile, gbytes, Q2_KF, k0, kb, wb); break;
        case IQ4F: decode_block_of(tile, gbytes, IQ4F, k0, kb, wb); break;
        default: decode_block_of(tile, gbytes, Q4_1, k0, kb, wb); break;
    }
}

static void rows_over_block(const float *x, int64_t ldx, int64_t T, const float *wb, int64_t kb, float *acc) {
    all_rows_over_block(x, ldx, T, wb, WF_F32, kb, 0, acc);  /* not streamed: the weights are in L1 */
}

/* k = k0 .. k0 + n - 1 of one group for few_rows_of: tb rows of x (xg, the group's first k) into the sums a, cv
 * vectors of columns (q: byte row 0 of those columns; Q4_0 / Q4_1 read byte row k - k0 and its `high` nibbles,
 * the byte kinds byte row k); with `ask` (the pass over a tile's first columns) each k's line FEW_ROWS_AHEAD_BYTES
 * on. Pointer steps and constant nibble choice keep the loop free of index arithmetic and branches. */
QINLINE void few_rows_k(const float *xg, int64_t ldx, const int tb, const int cv, const uint8_t *q, const int qtype,
                        const int k0, const int n, const int high, const float *d, const float *m, const int ask,
                        vec a[FEW_ROWS][VECS]) {
    for (int kk = 0; kk < n; kk++, q += QTILE_N) {
        if (ask) _mm_prefetch((const char *)q + FEW_ROWS_AHEAD_BYTES, _MM_HINT_T0);  /* this k's line, ahead */
        for (int j = 0; j < cv; j++) {
            vec w = dequantize_at(q + j * LANES, qtype, high, vload(d + j * LANES),
                                  with_minimum(qtype) ? vload(m + j * LANES) : vload(d + j * LANES));
            for (int i = 0; i < tb; i++) a[i][j] = vfma(vbroadcast(xg + i * ldx + k0 + kk), w, a[i][j]);
        }
    }
}

/* tb (1 .. 4, constant) rows of x over a whole tile (all K), each weight dequantized in registers straight into
 * the sums: for decode steps, where a weight meets too few rows to pay for a float32 buffer. The columns go cv
 * vectors at a time (cv constant: enough independent sums to hide the fused multiply-add's latency, few enough to
 * stay in registers); acc [tb][64] holds the sums between groups. The same operations in the same order as
 * decode_k then register_tile, so the same bits. */
QINLINE void few_rows_of(const float *x, int64_t ldx, const int tb, const int cv, const uint8_t *tile,
                         int64_t gbytes, const int qtype, int64_t K, float *acc) {
    for (int64_t g = 0; g < K / GROUP; g++) {
        const uint8_t *grp = tile + g * gbytes;
        for (int64_t line = 0; line < group_scale_bytes(qtype); line += 64)  /* past the tile: the next, as near */
            _mm_prefetch((const char *)grp + FEW_ROWS_AHEAD_BYTES + line, _MM_HINT_T0);
        float d[QTILE_N] __attribute__((aligned(64))), m[QTILE_N] __attribute__((aligned(64)));
        group_scales(grp, qtype, d, m);
        const float *xg = x + g * GROUP;
        const uint8_t *qs = group_quants(grp, qtype);
        for (int c0 = 0; c0 < QTILE_N; c0 += cv * LANES) {
            vec a[FEW_ROWS][VECS];
            for (int i = 0; i < tb; i++)
                for (int j = 0; j < cv; j++) a[i][j] = vload(acc + i * QTILE_N + c0 + j * LANES);
            if (qtype == Q8_0 || qtype == Q5_KF) {
                few_rows_k(xg, ldx, tb, cv, qs + c0, qtype, 0, GROUP, 0, d + c0, m + c0, c0 == 0, a);
            } else if (qtype == Q6_KF) {  /* k = 0..15 at the first sub-block's scales, k = 16..31 at the second's */
                few_rows_k(xg, ldx, tb, cv, qs + c0, qtype, 0, GROUP / 2, 0, d + c0, d + c0, c0 == 0, a);
                few_rows_k(xg, ldx, tb, cv, qs + GROUP / 2 * QTILE_N + c0, qtype, GROUP / 2, GROUP / 2, 0, m + c0,
                           m + c0, c0 == 0, a);
            } else {  /* k = 0..15 from the low nibbles of byte rows 0..15, then k = 16..31 from their high ones (Q2_KF:
                       * at the second sub-block's scales and minimums) */
                const float *d2 = qtype == Q2_KF ? second_scales(grp) : d, *m2 = qtype == Q2_KF ? d2 + QTILE_N : m;
                few_rows_k(xg, ldx, tb, cv, qs + c0, qtype, 0, GROUP / 2, 0, d + c0, m + c0, c0 == 0, a);
                few_rows_k(xg, ldx, tb, cv, qs + c0, qtype, GROUP / 2, GROUP / 2, 1, d2 + c0, m2 + c0, c0 == 0, a);
            }
            for (int i = 0; i < tb; i++)
                for (int j = 0; j < cv; j++) vstore(acc + i * QTILE_N + c0 + j * LANES, a[i][j]);
        }
    }
}

#if defined(__AVX512F__)
/* out[s][i] = in[4 i + s] (s < 4, i < 16): a tile's 64 column values in the order few_nibbles_of keeps its sums. */
QINLINE void to_lane_order(const float *in, vec out[4]) {
    const __m512i every4th = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    vec v0 = vload(in), v1 = vload(in + 16), v2 = vload(in + 32), v3 = vload(in + 48);
    for (int s = 0; s < 4; s++) {
        __m512i at = _mm512_add_epi32(every4th, _mm512_set1_epi32(s));
        out[s] = _mm512_mask_blend_ps(0xFF00, _mm512_permutex2var_ps(v0, at, v1), _mm512_permutex2var_ps(v2, at, v3));
    }
}

/* The 16 byte rows qs of a group for few_nibbles_of: k = 0..15 (xg: their x) from the nibbles `shift` (a constant:
 * 0 low, 4 high) bits up in each byte, into the lane-order sums a. */
QINLINE void nibbles_k(const float *xg, int64_t ldx, const int tb, const uint8_t *qs, const int qtype, const int shift,
                       const vec table, const vec dl[4], const vec ml[4], vec a[FEW_ROWS][4]) {
    for (int kk = 0; kk < GROUP / 2; kk++, qs += QTILE_N) {
        _mm_prefetch((const char *)qs + FEW_ROWS_AHEAD_BYTES, _MM_HINT_T0);
        __m512i line = _mm512_loadu_si512(qs);
        for (int s = 0; s < 4; s++) {
            vec q = _mm512_permutexvar_ps(_mm512_srli_epi32(line, 8 * s + shift), table);
            vec w = qtype == Q4_0 || qtype == IQ4F ? vmul(q, dl[s]) : vfma(q, dl[s], ml[s]);
            for (int i = 0; i < tb; i++) a[i][s] = vfma(vbroadcast(xg + i * ldx + kk), w, a[i][s]);
        }
    }
}

/* few_rows_of for Q4_0 / Q4_1 with AVX-512, the sums held in registers over the whole tile: a 64-byte line (one byte
 * row of the 64 columns) is loaded as 16 lanes of 4 bytes, so lane i holds columns 4i .. 4i + 3, and vector s of the
 * sums holds columns 4i + s. A column's nibble is then one shift of the line away (by 8 s, plus 4 for the high
 * nibbles), and a 16-entry lookup (vpermps reads an index's low 4 bits) gives its float32: no widening of bytes, no
 * mask, no conversion. Each weight is the same float32 (q * d + m, or (q - 8) * d, as dequantize_at) and each
 * column the same chain of fused multiply-adds over k in order, so the same bits; the sums go back to column order
 * in acc at the end. The shifts must be immediates (nibbles_k's constant `shift`: with a loop's variable count the
 * same code took 1.06-1.13x few_rows_of's time at 2-4 rows); one matrix in cache, one thread, 1-4 rows take
 * 0.91-0.97x the time of few_rows_of (session 49). */
QINLINE void few_nibbles_of(const float *x, int64_t ldx, const int tb, const uint8_t *tile, int64_t gbytes,
                            const int qtype, int64_t K, float *acc) {
    const vec table = qtype == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                      : qtype == IQ4F ? _mm512_load_ps(IQ4_VALUES)
                                      : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    vec a[FEW_ROWS][4];
    for (int i = 0; i < tb; i++)
        for (int s = 0; s < 4; s++) a[i][s] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / GROUP; g++) {
        const uint8_t *grp = tile + g * gbytes;
        for (int64_t line = 0; line < group_scale_bytes(qtype); line += 64)
            _mm_prefetch((const char *)grp + FEW_ROWS_AHEAD_BYTES + line, _MM_HINT_T0);
        float d[QTILE_N] __attribute__((aligned(64))), m[QTILE_N] __attribute__((aligned(64)));
        vec dl[4], ml[4];
        group_scales(grp, qtype, d, m);
        to_lane_order(d, dl);
        if (with_minimum(qtype)) to_lane_order(m, ml);
        const float *xg = x + g * GROUP;
        const uint8_t *qs = group_quants(grp, qtype);
        /* k = 0..15: low nibbles of byte rows 0..15; k = 16..31: their high ones (Q2_KF: at the second sub-block's
         * scales and minimums) */
        nibbles_k(xg, ldx, tb, qs, qtype, 0, table, dl, ml, a);
        if (qtype == Q2_KF) {
            to_lane_order(second_scales(grp), dl);
            to_lane_order(second_scales(grp) + QTILE_N, ml);
        }
        nibbles_k(xg + GROUP / 2, ldx, tb, qs, qtype, 4, table, dl, ml, a);
    }
    for (int i = 0; i < tb; i++) {
        float lanes[QTILE_N] __attribute__((aligned(64)));
        for (int s = 0; s < 4; s++) vstore(lanes + s * LANES, a[i][s]);
        for (int c = 0; c < QTILE_N; c++) acc[i * QTILE_N + c] = lanes[(c % 4) * LANES + c / 4];
    }
}

#endif

#if defined(__AVX512F__)
/* few_nibbles_of for qtype, T (1 .. FEW_ROWS) as a constant */
#define FEW_NIBBLES_OF_TYPE(qt)                                                   \
    switch (T) {                                                                  \
        case 1: few_nibbles_of(x, ldx, 1, tile, gbytes, qt, K, acc); break;       \
        case 2: few_nibbles_of(x, ldx, 2, tile, gbytes, qt, K, acc); break;       \
        case 3: few_nibbles_of(x, ldx, 3, tile, gbytes, qt, K, acc); break;       \
        default: few_nibbles_of(x, ldx, 4, tile, gbytes, qt, K, acc); break;      \
    }
#endif

/* vectors of columns at a time for tb rows: with AVX2 at most 8 sums in registers (16 exist), with AVX-512 the
 * whole tile (at most 24 of 32) */
#if defined(__AVX512F__)
#define FEW_CVECS(tb) VECS
#else
#define FEW_CVECS(tb) ((tb) == 1 ? VECS : (tb) == 2 ? VECS / 2 : VECS / 4)
#endif

/* few_rows_of for qtype, T (1 .. FEW_ROWS) as a constant */
#define FEW_ROWS_OF_TYPE(qt)                                                              \
    switch (T) {                                                                          \
        case 1: few_rows_of(x, ldx, 1, FEW_CVECS(1), tile, gbytes, qt, K, acc); break;    \
        case 2: few_rows_of(x, ldx, 2, FEW_CVECS(2), tile, gbytes, qt, K, acc); break;    \
        case 3: few_rows_of(x, ldx, 3, FEW_CVECS(3), tile, gbytes, qt, K, acc); break;    \
        default: few_rows_of(x, ldx, 4, FEW_CVECS(4), tile, gbytes, qt, K, acc); break;   \
    }

static void few_rows(const float *x, int64_t ldx, int64_t T, const uint8_t *tile, int64_t gbytes, int qtype,
                     int64_t K, float *acc) {
    switch (qtype) {  /* one specialized loop per type and row count */
        case Q8_0: FEW_ROWS_OF_TYPE(Q8_0); break;
        case Q6_KF: FEW_ROWS_OF_TYPE(Q6_KF); break;
        case Q5_KF: FEW_ROWS_OF_TYPE(Q5_KF); break;
#if defined(__AVX512F__)
        case Q4_0: FEW_NIBBLES_OF_TYPE(Q4_0); break;
        case Q4_KF: FEW_NIBBLES_OF_TYPE(Q4_KF); break;
        case Q2_KF: FEW_NIBBLES_OF_TYPE(Q2_KF); break;
        case IQ4F: FEW_NIBBLES_OF_TYPE(IQ4F); break;
        default: FEW_NIBBLES_OF_TYPE(Q4_1); break;
#else
        case Q4_0: FEW_ROWS_OF_TYPE(Q4_0); break;
        case Q4_KF: FEW_ROWS_OF_TYPE(Q4_KF); break;
        case Q2_KF: FEW_ROWS_OF_TYPE(Q2_KF); break;
        case IQ4F: FEW_ROWS_OF_TYPE(IQ4F); break;
        default: FEW_ROWS_OF_TYPE(Q4_1); break;
#endif
    }
}

/* x [T, K] (row stride ldx) @ the repacked weight wq (quant_repack) of N rows, + bias [ceil(N/64) * 64] zero-padded
 * or NULL -> out [T, N] contiguous. K is a multiple of 32. */
void quant_linear_f32(const float *x, int64_t T, int64_t ldx, int64_t K, const uint8_t *wq, int qtype, int64_t N,
                      const float *bias, float *out, int threads) {
    int64_t tiles = (N + QTILE_N - 1) / QTILE_N, groups = K / GROUP, gbytes = quant_group_bytes(qtype);
    TileClaims claims;
    tile_claims_init(&claims, tiles, threads);
#pragma omp parallel num_threads(threads)
    {
        float *acc = aligned_alloc(64, (size_t)T * QTILE_N * sizeof(float));
        float *wb = aligned_alloc(64, QBLOCK_K * QTILE_N * sizeof(float));
        for (int64_t ti; (ti = tile_claim(&claims)) >= 0;) {
            const uint8_t *tile = wq + ti * groups * gbytes;
            memset(acc, 0, (size_t)T * QTILE_N * sizeof(float));
            if (T <= FEW_ROWS) {
                few_rows(x, ldx, T, tile, gbytes, qtype, K, acc);
            } else {
                for (int64_t k0 = 0; k0 < K; k0 += QBLOCK_K) {
                    int kb = (int)(K - k0 < QBLOCK_K ? K - k0 : QBLOCK_K);
                    decode_block(tile, gbytes, qtype, k0, kb, wb);
                    rows_over_block(x + k0, ldx, T, wb, kb, acc);
                }
            }
            int64_t n0 = ti * QTILE_N;
            int n_valid = (int)(N - n0 < QTILE_N ? N - n0 : QTILE_N);
            for (int64_t t = 0; t < T; t++)
                for (int c = 0; c < n_valid; c++)
                    out[t * N + n0 + c] = bias ? acc[t * QTILE_N + c] + bias[n0 + c] : acc[t * QTILE_N + c];
        }
        free(acc);
        free(wb);
    }
}

/* A station's whole layer range in one call: every decoder layer of a wave, looped over in C.
 *
 * Per layer: RMSNorm -> fused q/k/v linear -> RoPE -> KV write into the paged pool and paged attention -> o_proj
 * + residual -> RMSNorm -> fused gate/up linear -> SiLU(gate) * up -> down + residual, through the same kernels
 * the per-op path calls (packed_linear.c over float32, bfloat16 or float16 tiles, quant_linear.c over GGUF blocks,
 * layer_ops.c, paged_attention.c), on the same inputs in the same order: a row's bits are those of the per-op path,
 * alone or in any company, at any thread count. The scratch rows are allocated once per call and reused by every layer.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void packed_linear_any(const float *x, int64_t T, int64_t ldx, int64_t K, const void *wp, int fmt, int64_t N,
                       const float *bias, float *out, int threads);
void rmsnorm_f32(const float *x, int64_t T, int64_t ldx, int64_t d, const float *w, float eps, float *out,
                 int threads);
void rope_f32(float *x, int64_t T, int64_t ldx, int64_t heads, int64_t D, const float *cos_, const float *sin_,
              int threads);
void paged_attention_f32(const float *q, const float *k, const float *v, int64_t ldq, int64_t ldkv, int64_t T,
                         int64_t H, int64_t KVH, int64_t D, float *kc, float *vc, int64_t BT,
                         const int64_t *tables, const int64_t *row_table, const int64_t *row_pos, int64_t window,
                         float scale, float *out, int threads);

void silu_mul_f32(const float *gu, int64_t T, int64_t I, float *out, int threads);
void quant_linear_f32(const float *x, int64_t T, int64_t ldx, int64_t K, const uint8_t *wq, int qtype, int64_t N,
                      const float *bias, float *out, int threads);

/* One layer's parameters, as addresses in a row of the weights table (0: none), and the format of each of its
 * linears' weights: register_tile.h's WeightFormat for packed tiles (0 float32, 1 bfloat16, 2 float16), or
 * QUANT_FORMAT + quant_linear.c's type code (quant_blocks.h) for GGUF blocks. q, k and v are one fused linear
 * (QKV_W), or where their weights differ in format (a Q4_K_M file's Q6_K v beside Q4_K q and k) three (Q_W, K_W,
 * V_W, QKV_W 0), each computed alone and put side by side. */
enum { IN_NORM, POST_NORM, QKV_W, QKV_B, O_W, O_B, GATE_UP_W, DOWN_W, QKV_FMT, O_FMT, GATE_UP_FMT, DOWN_FMT,
       Q_W, K_W, V_W, Q_B, K_B, V_B, Q_FMT, K_FMT, V_FMT, FIELDS };
#define QUANT_FORMAT 3

/* The weights table's row width, for the caller to check against its own (fused.py's FIELDS). */
void fused_table_fields(int64_t *fields) { *fields = FIELDS; }

/* x [T, K] (row stride ldx) @ a linear's weight w in format fmt (+ padded bias) -> out [T, N]. */
static void layer_linear(const float *x, int64_t T, int64_t ldx, int64_t K, const void *w, int64_t fmt, int64_t N,
                         const float *bias, float *out, int threads) {
    if (fmt >= QUANT_FORMAT)
        quant_linear_f32(x, T, ldx, K, (const uint8_t *)w, (int)(fmt - QUANT_FORMAT), N, bias, out, threads);
    else
        packed_linear_any(x, T, ldx, K, w, (int)fmt, N, bias, out, threads);
}

/* h [T, d] through q, k and v as three linears (the table's Q_W .. V_FMT) into qkv [T, q | k | v]; part: scratch
 * of T x H x D floats. Each is the call the per-op path makes for it, so the same bits. */
static void split_projection(const float *h, int64_t T, int64_t d, const int64_t *w, int64_t H, int64_t KVH,
                             int64_t D, float *qkv, float *part, int threads) {
    const int64_t widths[3] = {H * D, KVH * D, KVH * D}, qkv_n = (H + 2 * KVH) * D;
    for (int64_t p = 0, at = 0; p < 3; at += widths[p], p++) {
        layer_linear(h, T, d, d, (const void *)(intptr_t)w[Q_W + p], w[Q_FMT + p], widths[p],
                     (const float *)(intptr_t)w[Q_B + p], part, threads);
        for (int64_t t = 0; t < T; t++) memcpy(qkv + t * qkv_n + at, part + t * widths[p], sizeof(float) * widths[p]);
    }
}

static void add_rows(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = x[i] + y[i];
}

#define TIMED(slot, call)                                         \
    do {                                                          \
        double t0_ = seconds ? omp_get_wtime() : 0.0;             \
        call;                                                     \
        if (seconds) seconds[slot] += omp_get_wtime() - t0_;      \
    } while (0)

/* Run layers [0, L) over x [T, d] in place. weights [L][FIELDS]: each layer's norm weights, linear weights (packed
 * tiles or repacked GGUF blocks) and padded biases, and its linears' formats. H/KVH/D: heads, KV heads, head
 * width; I: the MLP's width. cos/sin [T, D]. kc/vc: layer 0's paged K/V [blocks, KVH, BT, D], layer_stride floats
 * apart; tables/row_table/row_pos/window/scale as paged_attention_f32. seconds (NULL: not timed) accumulates
 * [linears, attention, other ops]. */
void fused_layers_f32(float *x, int64_t T, int64_t d, int64_t L, const int64_t *weights, float eps, int64_t H,
                      int64_t KVH, int64_t D, int64_t I, const float *cos_, const float *sin_, float *kc, float *vc,
                      int64_t layer_stride, int64_t BT, const int64_t *tables, const int64_t *row_table,
                      const int64_t *row_pos, int64_t window, float scale, double *seconds, int threads) {
    int64_t qkv_n = (H + 2 * KVH) * D;
    float *h = malloc(sizeof(float) * T * d);            /* a norm's output, then a linear's before the residual */
    float *qkv = malloc(sizeof(float) * T * qkv_n);      /* [T, q | k | v] */
    float *att = malloc(sizeof(float) * T * H * D);      /* [T, H, D] */
    float *gu = malloc(sizeof(float) * T * 2 * I);       /* [T, gate | up] */
    float *act = malloc(sizeof(float) * T * I);          /* [T, I] */
    float *part = malloc(sizeof(float) * T * H * D);     /* one of q, k, v where they run apart */
    for (int64_t l = 0; l < L; l++) {
        const int64_t *w = weights + l * FIELDS;
#define P(f) ((const float *)(intptr_t)w[f])
        TIMED(2, rmsnorm_f32(x, T, d, d, P(IN_NORM), eps, h, threads));
        if (w[QKV_W])
            TIMED(0, layer_linear(h, T, d, d, P(QKV_W), w[QKV_FMT], qkv_n, P(QKV_B), qkv, threads));
        else
            TIMED(0, split_projection(h, T, d, w, H, KVH, D, qkv, part, threads));
        TIMED(2, rope_f32(qkv, T, qkv_n, H, D, cos_, sin_, threads);
                 rope_f32(qkv + H * D, T, qkv_n, KVH, D, cos_, sin_, threads));
        TIMED(1, paged_attention_f32(qkv, qkv + H * D, qkv + (H + KVH) * D, qkv_n, qkv_n, T, H, KVH, D,
                                     kc + l * layer_stride, vc + l * layer_stride, BT, tables, row_table, row_pos,
                                     window, scale, att, threads));
        TIMED(0, layer_linear(att, T, H * D, H * D, P(O_W), w[O_FMT], d, P(O_B), h, threads));
        TIMED(2, add_rows(x, h, T * d); rmsnorm_f32(x, T, d, d, P(POST_NORM), eps, h, threads));
        TIMED(0, layer_linear(h, T, d, d, P(GATE_UP_W), w[GATE_UP_FMT], 2 * I, NULL, gu, threads));
        TIMED(2, silu_mul_f32(gu, T, I, act, threads));
        TIMED(0, layer_linear(act, T, I, I, P(DOWN_W), w[DOWN_FMT], d, NULL, h, threads));
        TIMED(2, add_rows(x, h, T * d));
#undef P
    }
    free(h), free(qkv), free(att), free(gu), free(act), free(part);
}

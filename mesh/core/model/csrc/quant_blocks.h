/* GGUF's 32-weight blocks as the quantized linear holds them (quant_repack.c lays them out, quant_linear.c reads them).
 *
 * Layout (quant_repack builds it once at load): the N output rows in tiles of 64 (zero rows past N); each tile is
 * K / 32 groups, a group is the tile's 64 scales (float16, as in the blocks), for Q4_1 its 64 minimums (float16),
 * then the blocks'
 * quant bytes transposed, [byte][64 rows]: Q8_0 32 signed bytes (k = byte); Q4_0 / Q4_1 16 bytes, k = byte in the
 * low nibble and k = byte + 16 in the high one, as in the GGUF block. So a repack is a byte transpose and a k's 64
 * weights are 64 consecutive bytes.
 */
#ifndef WAVEMESH_QUANT_BLOCKS_H
#define WAVEMESH_QUANT_BLOCKS_H

#include <stdint.h>

#define QTILE_N 64 /* output rows per tile (register_tile.h's TILE_N) */
#define GROUP 32   /* weights per GGUF block */

/* GGUF's K-quants (and Q5_1) are held as three more kinds of 32-weight group, laid out in Python at load
 * (mesh/core/model/quant_kblocks.py), their scales exact products widened to float32:
 *   Q4_KF: a Q4_K sub-block of 32 as a Q4_1 group: the scale d * sc and the negated minimum -(dmin * m), float32,
 *          then the nibbles as Q4_1 keeps them (byte b: k = b low, k = b + 16 high); w = q * D + M, rounded once
 *          (q * D is exact), the gguf package's d * q - dm;
 *   Q6_KF: a Q6_K group of 32 as a Q8_0 group of signed bytes q - 32, with the scales d * sc of its two sub-blocks
 *          of 16 (k < 16, then k >= 16), float32; w = q * D, rounded once, as the package's (a Q3_K group likewise:
 *          its bytes q in -4..3 under the scales d * (sc - 32), w = q * D exact);
 *   Q5_KF: a Q5_K sub-block of 32 (or a Q5_1 block) as unsigned bytes q (0..31) with the scale D and the negated
 *          minimum M (Q5_1: its float16 d and m), float32; w = q * D + M in one fused multiply-add (q * D exact).
 *   Q2_KF: a Q2_K group of 32 as a Q4_KF one whose two sub-blocks of 16 each have their own scale d * sc and
 *          negated minimum -(dmin * m): four float32 vectors (first scales, first minimums, second scales, second
 *          minimums), then the 2-bit q as Q4_1's nibbles (the low ones k < 16, the first sub-block; the high ones
 *          k >= 16, the second); w = q * D + M in one fused multiply-add (q * D exact), the package's dl * q - ml.
 *   IQ4F:  an IQ4_NL block (or an IQ4_XS sub-block of 32): its float32 scale (IQ4_NL's float16 d, IQ4_XS's exact
 *          d * (ls - 32)), then Q4_1's nibbles, each an index into IQ4_NL's 16 values; w = value * D, exact.
 * (A Q5_0 block is a Q8_0 one: its weights (q - 16) * d are a Q8_0 block's with the bytes q - 16.) */
enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_KF = 3, Q6_KF = 4, Q5_KF = 5, Q2_KF = 6, IQ4F = 7 };

static inline __attribute__((always_inline)) int byte_quants(int qtype) {
    return qtype == Q8_0 || qtype == Q6_KF || qtype == Q5_KF;
}
static inline __attribute__((always_inline)) int with_minimum(int qtype) {
    return qtype == Q4_1 || qtype == Q4_KF || qtype == Q5_KF || qtype == Q2_KF;
}
static inline __attribute__((always_inline)) int float_scales(int qtype) {
    return qtype == Q4_KF || qtype == Q6_KF || qtype == Q5_KF || qtype == Q2_KF || qtype == IQ4F;
}

/* Bytes of one group of a 64-row tile in the repacked layout. */
static inline int64_t quant_group_bytes(int qtype) {
    switch (qtype) {
        case Q8_0: return QTILE_N * 2 + GROUP * QTILE_N;      /* scales, 32 bytes a row */
        case Q4_0: return QTILE_N * 2 + GROUP / 2 * QTILE_N;  /* scales, 16 bytes a row */
        case Q4_KF: return QTILE_N * 8 + GROUP / 2 * QTILE_N; /* float32 scales and minimums, 16 bytes a row */
        case Q2_KF: return QTILE_N * 16 + GROUP / 2 * QTILE_N; /* two of each, 16 bytes a row */
        case IQ4F: return QTILE_N * 4 + GROUP / 2 * QTILE_N;  /* float32 scales, 16 bytes a row */
        case Q6_KF:                                           /* two float32 scales, 32 bytes a row */
        case Q5_KF: return QTILE_N * 8 + GROUP * QTILE_N;     /* float32 scales and minimums, 32 bytes a row */
        default: return QTILE_N * 4 + GROUP / 2 * QTILE_N;    /* Q4_1: scales and minimums, 16 bytes a row */
    }
}

/* Bytes of a GGUF block: the float16 scale (and minimum), then the quants. */
static inline __attribute__((always_inline)) int64_t block_bytes(int qtype) {
    return qtype == Q8_0 ? 34 : qtype == Q4_0 ? 18 : 20;
}

/* Bytes of a group's float16 scales (and minimums) ahead of its quants. */
static inline __attribute__((always_inline)) int64_t group_scale_bytes(int qtype) {
    if (qtype == Q2_KF) return QTILE_N * 16;
    if (qtype == IQ4F) return QTILE_N * 4;
    return float_scales(qtype) ? QTILE_N * 8 : qtype == Q4_1 ? QTILE_N * 4 : QTILE_N * 2;
}

#endif

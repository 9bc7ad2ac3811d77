/* The quantized linear's load-time layout: a linear's GGUF blocks (Q8_0, Q4_0, Q4_1) repacked into tiles of 64 output
 * rows, group by group, the float16 scales and minimums gathered and the quant bytes transposed (the layout is
 * described in quant_blocks.h). Run once per weight when a station loads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "quant_blocks.h"

/* Two 16 x 16 byte transposes at once, one in each 128-bit lane: r[i] holds 16 bytes of row i of block A in its low
 * lane and of block B in its high lane; out[p] gets byte p of the 16 rows, of block A in its low lane and of block B
 * in its high one. Four rounds of interleaves, each pairing twice as many bytes: rows (2i, 2i+1) by byte, then by 2,
 * 4 and 8 bytes. */
static inline void transpose16x2(const __m256i r[16], __m256i out[16]) {
    __m256i s[16], t[16], u[16];
    for (int i = 0; i < 8; i++) {  /* s[8h + i]: bytes 8h..8h+7, each as rows (2i, 2i+1) */
        s[i] = _mm256_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        s[8 + i] = _mm256_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++)  /* t[4q + i]: bytes 4q..4q+3, each as rows 4i..4i+3 */
        for (int i = 0; i < 4; i++) {
            t[8 * h + i] = _mm256_unpacklo_epi16(s[8 * h + 2 * i], s[8 * h + 2 * i + 1]);
            t[8 * h + 4 + i] = _mm256_unpackhi_epi16(s[8 * h + 2 * i], s[8 * h + 2 * i + 1]);
        }
    for (int q = 0; q < 4; q++)  /* u[2p + half]: bytes 2p, 2p+1, each as rows 8 half .. 8 half + 7 */
        for (int half = 0; half < 2; half++) {
            u[4 * q + half] = _mm256_unpacklo_epi32(t[4 * q + 2 * half], t[4 * q + 2 * half + 1]);
            u[4 * q + 2 + half] = _mm256_unpackhi_epi32(t[4 * q + 2 * half], t[4 * q + 2 * half + 1]);
        }
    for (int p = 0; p < 16; p++)  /* byte p of the 16 rows: both blocks */
        out[p] = (p & 1) ? _mm256_unpackhi_epi64(u[p - 1], u[p]) : _mm256_unpacklo_epi64(u[p], u[p + 1]);
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The float16 scales (and, with 2 scales, the minimums after them) at byte `off` of 16 rows, as they are:
 * h[sc] holds the 16 rows' halves of kind sc in row order. */
static inline void scales16(const uint8_t *const rows[16], int64_t off, int scales, __m256i h[2]) {
    /* each row's first 4 bytes: scale | minimum << 16 (a Q8_0 / Q4_0 block's first quants), inserted into vectors
     * from the loads (not stored then reloaded: that load would wait on 16 narrow stores) */
#define ROW_WORD(i) ((int)load_u32(rows[i] + off))
    __m256i lo = _mm256_setr_epi32(ROW_WORD(0), ROW_WORD(1), ROW_WORD(2), ROW_WORD(3), ROW_WORD(4), ROW_WORD(5),
                                   ROW_WORD(6), ROW_WORD(7));
    __m256i hi = _mm256_setr_epi32(ROW_WORD(8), ROW_WORD(9), ROW_WORD(10), ROW_WORD(11), ROW_WORD(12), ROW_WORD(13),
                                   ROW_WORD(14), ROW_WORD(15));
#undef ROW_WORD
    for (int sc = 0; sc < scales; sc++) {  /* the 16 halves in row order: pack (lane-wise), then put lanes in order */
        __m256i a = sc ? _mm256_srli_epi32(lo, 16) : _mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF));
        __m256i b = sc ? _mm256_srli_epi32(hi, 16) : _mm256_and_si256(hi, _mm256_set1_epi32(0xFFFF));
        h[sc] = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    }
}

/* One 64-byte line of the layout, as two 32-byte halves. `stream` (constant; dst 32-byte aligned): past the caches,
 * as the repacked weights are read again only by the kernel, much later, and a whole line written at once need
 * not be read from memory first (with the next tile's rows requested ahead, quant_repack below: 1.4-1.5x on weights
 * larger than the caches, `python bench/gguf_load.py --repack-shape 14336x4096`). */
static inline __attribute__((always_inline)) void store_line(uint8_t *dst, __m256i lo, __m256i hi, const int stream) {
    if (stream) {
        _mm256_stream_si256((__m256i *)dst, lo);
        _mm256_stream_si256((__m256i *)(dst + 32), hi);
    } else {
        _mm256_storeu_si256((__m256i *)dst, lo);
        _mm256_storeu_si256((__m256i *)(dst + 32), hi);
    }
}

/* Group g (weights 32 g .. 32 g + 31) of a tile's 64 rows, gathered from their GGUF blocks into grp (the layout
 * above), each line of grp written whole. */
static inline __attribute__((always_inline)) void gather_group(const uint8_t *const row[QTILE_N], int qtype,
                                                               int64_t g, uint8_t *grp, const int stream) {
    int64_t off = g * block_bytes(qtype), head = qtype == Q4_1 ? 4 : 2, scales = qtype == Q4_1 ? 2 : 1;
    uint8_t *qs = grp + group_scale_bytes(qtype);
    __m256i h[4][2], r[16];
    for (int lg = 0; lg < QTILE_N; lg += 16) scales16(row + lg, off, (int)scales, h[lg / 16]);
    for (int sc = 0; sc < scales; sc++) {  /* a kind's 64 halves: two lines */
        store_line(grp + sc * QTILE_N * 2, h[0][sc], h[1][sc], stream);
        store_line(grp + sc * QTILE_N * 2 + 64, h[2][sc], h[3][sc], stream);
    }
    if (qtype == Q8_0) {  /* 16 rows at a time, their bytes 0..15 and 16..31 side by side */
        __m256i t[4][16];
        for (int lg = 0; lg < QTILE_N; lg += 16) {
            for (int i = 0; i < 16; i++) r[i] = _mm256_loadu_si256((const __m256i *)(row[lg + i] + off + head));
            transpose16x2(r, t[lg / 16]);
        }
        for (int p = 0; p < 16; p++) {  /* byte p (low lanes) and byte 16 + p (high lanes) of the four row groups */
            store_line(qs + p * QTILE_N, _mm256_permute2x128_si256(t[0][p], t[1][p], 0x20),
                       _mm256_permute2x128_si256(t[2][p], t[3][p], 0x20), stream);
            store_line(qs + (16 + p) * QTILE_N, _mm256_permute2x128_si256(t[0][p], t[1][p], 0x31),
                       _mm256_permute2x128_si256(t[2][p], t[3][p], 0x31), stream);
        }
    } else {  /* 32 rows at a time: rows lg.. lg + 15 and lg + 16 .. lg + 31 side by side */
        __m256i t[2][16];
        for (int lg = 0; lg < QTILE_N; lg += 32) {
            for (int i = 0; i < 16; i++)
                r[i] = _mm256_loadu2_m128i((const __m128i *)(row[lg + 16 + i] + off + head),
                                           (const __m128i *)(row[lg + i] + off + head));
            transpose16x2(r, t[lg / 32]);
        }
        for (int p = 0; p < 16; p++) store_line(qs + p * QTILE_N, t[0][p], t[1][p], stream);
    }
}

/* Where each of tile ti's 64 rows lies: part p's row (HF row r at raw row order[p][r], or r) among the parts side by
 * side, zero_row past the N rows. */
static void tile_rows(const uint8_t *const *src, const int64_t *rows, const int64_t *const *order, int64_t N,
                      int64_t row_bytes, const uint8_t *zero_row, int64_t ti, const uint8_t *row[QTILE_N]) {
    for (int i = 0; i < QTILE_N; i++) {
        int64_t n = ti * QTILE_N + i, p = 0;
        if (n >= N) { row[i] = zero_row; continue; }
        while (n >= rows[p]) n -= rows[p++];
        row[i] = src[p] + (order[p] ? order[p][n] : n) * row_bytes;
    }
}

/* Repack a linear's rows, given as `parts` GGUF tensors side by side (part p: rows[p] rows of K / 32 blocks at
 * src[p], HF row r at raw row order[p][r], or r where order[p] is NULL), into the tile layout at dst (N = the sum
 * of the parts' rows; ceil(N / 64) tiles of K / 32 groups). */
void quant_repack(const uint8_t *const *src, const int64_t *rows, const int64_t *const *order, int parts,
                  int64_t K, int qtype, uint8_t *dst, int threads) {
    int64_t N = 0, groups = K / GROUP, gbytes = quant_group_bytes(qtype), row_bytes = groups * block_bytes(qtype);
    for (int p = 0; p < parts; p++) N += rows[p];
    int64_t tiles = (N + QTILE_N - 1) / QTILE_N;
    uint8_t *zero_row = calloc(1, (size_t)row_bytes); /* the rows past N: scale, minimum and quants zero */
    const int stream = (uintptr_t)dst % 32 == 0; /* every group is whole lines: each then starts aligned */
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t ti = 0; ti < tiles; ti++) {
            const uint8_t *row[QTILE_N], *next[QTILE_N];
            tile_rows(src, rows, order, N, row_bytes, zero_row, ti, row);
            if (ti + 1 < tiles) {  /* the next tile's rows, into L2 while this one is repacked */
                tile_rows(src, rows, order, N, row_bytes, zero_row, ti + 1, next);
                for (int i = 0; i < QTILE_N; i++)
                    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch((const char *)(next[i] + b), _MM_HINT_T1);
            }
            uint8_t *out = dst + ti * groups * gbytes;
            if (stream)
                for (int64_t g = 0; g < groups; g++) gather_group(row, qtype, g, out + g * gbytes, 1);
            else
                for (int64_t g = 0; g < groups; g++) gather_group(row, qtype, g, out + g * gbytes, 0);
        }
        _mm_sfence(); /* the streamed lines are in memory before anyone reads them */
    }
    free(zero_row);
}


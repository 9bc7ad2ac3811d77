/* Float32 linear over weights kept in GGUF's 32-weight blocks (Q8_0, Q4_0, Q4_1): out[t, n] = sum_k x[t, k] * w[n, k]
 * (+ bias[n]), each w[n, k] dequantized in registers to exactly the float32 the `gguf` package gives it:
 *   Q8_0: q * d          Q4_0: (q - 8) * d          Q4_1: q * d, rounded, then + m, rounded (no fused multiply-add)
 * with d and m the block's float16 scale and minimum. Each output is then the chain packed_linear.c computes: fused
 * multiply-adds over k = 0, 1, ..., K-1 in order from zero, then the bias. So a station holding these weights gives
 * the bits of one holding them dequantized in packed float32 tiles, at every row count and thread count.
 *
 * Layout (quant_repack builds it once at load): the N output rows in tiles of 64 (zero rows past N); each tile is
 * K / 32 groups, a group is the tile's 64 scales (float32), for Q4_1 its 64 minimums (float32), then the blocks'
 * quant bytes transposed, [byte][64 rows]: Q8_0 32 signed bytes (k = byte); Q4_0 / Q4_1 16 bytes, k = byte in the
 * low nibble and k = byte + 16 in the high one, as in the GGUF block. So a repack is a byte transpose and a k's 64
 * weights are 64 consecutive bytes. A k-block of 64 is decoded into a float32 buffer that stays in L1 while every
 * row tile of up to 6 rows passes over it, accumulators in registers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#define QTILE_N 64  /* output rows per tile */
#define QTILE_T 6   /* rows of x per register tile */
#define QBLOCK_K 64 /* k decoded at a time (two groups) */
#define GROUP 32    /* weights per GGUF block */
#define QINLINE static inline __attribute__((always_inline))

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

#if defined(__AVX512F__)
#define QLANES 16
typedef __m512 qvec;
typedef __m512i qivec;
QINLINE qivec load_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
QINLINE qivec load_i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
QINLINE qivec ilow(qivec v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
QINLINE qivec ihigh(qivec v) { return _mm512_srli_epi32(v, 4); }
QINLINE qivec iminus8(qivec v) { return _mm512_sub_epi32(v, _mm512_set1_epi32(8)); }
QINLINE qvec tofloat(qivec v) { return _mm512_cvtepi32_ps(v); }
QINLINE qvec qload(const float *p) { return _mm512_loadu_ps(p); }
QINLINE qvec qmul(qvec a, qvec b) { return _mm512_mul_ps(a, b); }
QINLINE qvec qadd(qvec a, qvec b) { return _mm512_add_ps(a, b); }
QINLINE qvec qfma(qvec a, qvec b, qvec c) { return _mm512_fmadd_ps(a, b, c); }
QINLINE qvec qbroadcast(const float *p) { return _mm512_set1_ps(*p); }
QINLINE void qstore(float *p, qvec v) { _mm512_storeu_ps(p, v); }
/* d * q is exact in float32 (an 11-bit fp16 mantissa times a 4- or 8-bit integer), so contraction could not change
 * a bit; the product is kept a separate rounded value all the same, as the reference computes it */
#define ROUNDED(v) __asm__("" : "+v"(v))
#elif defined(__AVX2__) && defined(__FMA__)
#define QLANES 8
typedef __m256 qvec;
typedef __m256i qivec;
QINLINE qivec load_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
QINLINE qivec load_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
QINLINE qivec ilow(qivec v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
QINLINE qivec ihigh(qivec v) { return _mm256_srli_epi32(v, 4); }
QINLINE qivec iminus8(qivec v) { return _mm256_sub_epi32(v, _mm256_set1_epi32(8)); }
QINLINE qvec tofloat(qivec v) { return _mm256_cvtepi32_ps(v); }
QINLINE qvec qload(const float *p) { return _mm256_loadu_ps(p); }
QINLINE qvec qmul(qvec a, qvec b) { return _mm256_mul_ps(a, b); }
QINLINE qvec qadd(qvec a, qvec b) { return _mm256_add_ps(a, b); }
QINLINE qvec qfma(qvec a, qvec b, qvec c) { return _mm256_fmadd_ps(a, b, c); }
QINLINE qvec qbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
QINLINE void qstore(float *p, qvec v) { _mm256_storeu_ps(p, v); }
#define ROUNDED(v) __asm__("" : "+x"(v))
#else
#error "quant_linear needs AVX2 with FMA, or AVX-512"
#endif

#define QVECS (QTILE_N / QLANES)
/* vectors of the tile's width a register tile covers at once: all of it with AVX-512, a quarter with AVX2 (whose
 * 16 registers cannot hold 6 x 8 accumulators; see packed_linear.c) */
#if defined(__AVX512F__)
#define QCVECS QVECS
#else
#define QCVECS 2
#endif

/* Bytes of one group of a 64-row tile in the repacked layout (0 for an unknown type). */
static int64_t quant_group_bytes(int qtype) {
    switch (qtype) {
        case Q8_0: return QTILE_N * 4 + GROUP * QTILE_N;      /* scales, 32 bytes a row */
        case Q4_0: return QTILE_N * 4 + GROUP / 2 * QTILE_N;  /* scales, 16 bytes a row */
        case Q4_1: return QTILE_N * 8 + GROUP / 2 * QTILE_N;  /* scales and minimums, 16 bytes a row */
        default: return 0;
    }
}

static int64_t block_bytes(int qtype) { return qtype == Q8_0 ? 34 : qtype == Q4_0 ? 18 : 20; }

__attribute__((unused)) static float half_to_float(const uint8_t *p) { /* IEEE binary16 (little-endian) -> float32, exactly */
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    float f;
    if (exp == 0) {
        f = (float)man * (1.0f / 16777216.0f); /* zero or subnormal: man * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Bytes [off, off + 16) of 16 rows, transposed: out + j * stride gets byte off + j of rows 0..15. Four rounds of
 * interleaves, each pairing twice as many bytes: rows (2i, 2i+1) by byte, then by 2, 4 and 8 bytes. */
static void transpose16(const uint8_t *const rows[16], int64_t off, uint8_t *out, int64_t stride) {
    __m128i r[16], s[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm_loadu_si128((const __m128i *)(rows[i] + off));
    for (int i = 0; i < 8; i++) {  /* s[8h + i]: bytes 8h..8h+7, each as rows (2i, 2i+1) */
        s[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
        s[8 + i] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++)  /* t[4q + i]: bytes 4q..4q+3, each as rows 4i..4i+3 */
        for (int i = 0; i < 4; i++) {
            t[8 * h + i] = _mm_unpacklo_epi16(s[8 * h + 2 * i], s[8 * h + 2 * i + 1]);
            t[8 * h + 4 + i] = _mm_unpackhi_epi16(s[8 * h + 2 * i], s[8 * h + 2 * i + 1]);
        }
    for (int q = 0; q < 4; q++)  /* u[2p + half]: bytes 2p, 2p+1, each as rows 8 half .. 8 half + 7 */
        for (int half = 0; half < 2; half++) {
            u[4 * q + half] = _mm_unpacklo_epi32(t[4 * q + 2 * half], t[4 * q + 2 * half + 1]);
            u[4 * q + 2 + half] = _mm_unpackhi_epi32(t[4 * q + 2 * half], t[4 * q + 2 * half + 1]);
        }
    for (int p = 0; p < 8; p++) {
        _mm_storeu_si128((__m128i *)(out + 2 * p * stride), _mm_unpacklo_epi64(u[2 * p], u[2 * p + 1]));
        _mm_storeu_si128((__m128i *)(out + (2 * p + 1) * stride), _mm_unpackhi_epi64(u[2 * p], u[2 * p + 1]));
    }
}

/* The float16 scale (and, with 2 scales, the minimum after it) at byte `off` of 16 rows, as float32 into d[0..15]
 * (and d[64..79]). */
static void scales16(const uint8_t *const rows[16], int64_t off, int scales, float *d) {
#if defined(__AVX512F__)
    uint32_t w[16];  /* each row's first 4 bytes: scale | minimum << 16 (a Q8_0 / Q4_0 block's first quants) */
    for (int i = 0; i < 16; i++) memcpy(&w[i], rows[i] + off, 4);
    __m512i v = _mm512_loadu_si512(w);
    _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
    if (scales == 2) _mm512_storeu_ps(d + QTILE_N, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))));
#else
    for (int i = 0; i < 16; i++)
        for (int sc = 0; sc < scales; sc++) d[sc * QTILE_N + i] = half_to_float(rows[i] + off + 2 * sc);
#endif
}

/* Repack a linear's rows, given as `parts` GGUF tensors side by side (part p: rows[p] rows of K / 32 blocks at
 * src[p], HF row r at raw row order[p][r], or r where order[p] is NULL), into the tile layout at dst (N = the sum
 * of the parts' rows; ceil(N / 64) tiles of K / 32 groups). */
void quant_repack(const uint8_t *const *src, const int64_t *rows, const int64_t *const *order, int parts,
                  int64_t K, int qtype, uint8_t *dst, int threads) {
    int64_t N = 0, groups = K / GROUP, gbytes = quant_group_bytes(qtype), bb = block_bytes(qtype);
    int64_t row_bytes = groups * bb, head = qtype == Q4_1 ? 4 : 2, scales = qtype == Q4_1 ? 2 : 1;
    for (int p = 0; p < parts; p++) N += rows[p];
    int64_t tiles = (N + QTILE_N - 1) / QTILE_N;
    uint8_t *zero_row = calloc(1, (size_t)row_bytes); /* the rows past N: scale, minimum and quants zero */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t ti = 0; ti < tiles; ti++) {
        uint8_t *tile = dst + ti * groups * gbytes;
        const uint8_t *row[QTILE_N];
        for (int i = 0; i < QTILE_N; i++) {
            int64_t n = ti * QTILE_N + i, p = 0;
            if (n >= N) { row[i] = zero_row; continue; }
            while (n >= rows[p]) n -= rows[p++];
            row[i] = src[p] + (order[p] ? order[p][n] : n) * row_bytes;
        }
        for (int64_t g = 0; g < groups; g++) {  /* a group's bytes written while in L1, 16 rows at a time */
            uint8_t *grp = tile + g * gbytes, *qs = grp + scales * QTILE_N * 4;
            for (int lg = 0; lg < QTILE_N; lg += 16) scales16(row + lg, g * bb, scales, (float *)grp + lg);
            for (int lg = 0; lg < QTILE_N; lg += 16) {
                transpose16(row + lg, g * bb + head, qs + lg, QTILE_N);
                if (qtype == Q8_0) transpose16(row + lg, g * bb + head + 16, qs + lg + 16 * QTILE_N, QTILE_N);
            }
        }
    }
    free(zero_row);
}

/* The 64 rows' weights of one k of a group, dequantized into w[64] (qtype a constant where inlined). */
QINLINE void decode_k(const uint8_t *grp, const int qtype, int k, float *w) {
    const float *d = (const float *)grp, *m = d + QTILE_N;
    if (qtype == Q8_0) {
        const uint8_t *qs = grp + QTILE_N * 4 + k * QTILE_N;
        for (int j = 0; j < QTILE_N; j += QLANES) qstore(w + j, qmul(tofloat(load_i8(qs + j)), qload(d + j)));
        return;
    }
    const uint8_t *qs = grp + (qtype == Q4_1 ? QTILE_N * 8 : QTILE_N * 4) + (k & 15) * QTILE_N;
    for (int j = 0; j < QTILE_N; j += QLANES) {
        qivec q = k < 16 ? ilow(load_u8(qs + j)) : ihigh(load_u8(qs + j));
        if (qtype == Q4_0) {
            qstore(w + j, qmul(tofloat(iminus8(q)), qload(d + j)));
        } else {
            qvec p = qmul(tofloat(q), qload(d + j));
            ROUNDED(p);
            qstore(w + j, qadd(p, qload(m + j)));
        }
    }
}

/* Weights k0 .. k0 + kb - 1 of one tile (k0 a multiple of 32), dequantized into wb [kb][64]. */
QINLINE void decode_block_of(const uint8_t *tile, int64_t gbytes, const int qtype, int64_t k0, int kb, float *wb) {
    for (int k = 0; k < kb; k++)
        decode_k(tile + ((k0 + k) / GROUP) * gbytes, qtype, (int)((k0 + k) % GROUP), wb + k * QTILE_N);
}

static void decode_block(const uint8_t *tile, int64_t gbytes, int qtype, int64_t k0, int kb, float *wb) {
    switch (qtype) {  /* one specialized decoder per type */
        case Q8_0: decode_block_of(tile, gbytes, Q8_0, k0, kb, wb); break;
        case Q4_0: decode_block_of(tile, gbytes, Q4_0, k0, kb, wb); break;
        default: decode_block_of(tile, gbytes, Q4_1, k0, kb, wb); break;
    }
}

/* tb (<= 6) rows of x over the kb decoded weights wb [kb][64] starting at k0, continuing the sums in acc [tb][64],
 * the columns cv vectors at a time (cv constant, dividing QVECS; each output is one chain over k whatever cv is). */
QINLINE void rows_over_block(const float *x, int64_t ldx, const int tb, const int cv, const float *wb, int64_t k0,
                             int kb, float *acc) {
    for (int c0 = 0; c0 < QVECS; c0 += cv) {
        const float *wc = wb + c0 * QLANES;
        float *ac = acc + c0 * QLANES;
        qvec a[QTILE_T][QVECS];
        for (int i = 0; i < tb; i++)
            for (int j = 0; j < cv; j++) a[i][j] = qload(ac + i * QTILE_N + j * QLANES);
        for (int k = 0; k < kb; k++) {
            qvec wv[QVECS];
            for (int j = 0; j < cv; j++) wv[j] = qload(wc + k * QTILE_N + j * QLANES);
            for (int i = 0; i < tb; i++) {
                qvec xb = qbroadcast(x + i * ldx + k0 + k);
                for (int j = 0; j < cv; j++) a[i][j] = qfma(xb, wv[j], a[i][j]);
            }
        }
        for (int i = 0; i < tb; i++)
            for (int j = 0; j < cv; j++) qstore(ac + i * QTILE_N + j * QLANES, a[i][j]);
    }
}

static void all_rows_over_block(const float *x, int64_t ldx, int64_t T, const float *wb, int64_t k0, int kb,
                                float *acc) {
    int64_t t = 0;
    for (; t + QTILE_T <= T; t += QTILE_T)
        rows_over_block(x + t * ldx, ldx, QTILE_T, QCVECS, wb, k0, kb, acc + t * QTILE_N);
    switch (T - t) {  /* one or two rows: the whole width */
        case 5: rows_over_block(x + t * ldx, ldx, 5, QCVECS, wb, k0, kb, acc + t * QTILE_N); break;
        case 4: rows_over_block(x + t * ldx, ldx, 4, QCVECS, wb, k0, kb, acc + t * QTILE_N); break;
        case 3: rows_over_block(x + t * ldx, ldx, 3, QCVECS, wb, k0, kb, acc + t * QTILE_N); break;
        case 2: rows_over_block(x + t * ldx, ldx, 2, QVECS, wb, k0, kb, acc + t * QTILE_N); break;
        case 1: rows_over_block(x + t * ldx, ldx, 1, QVECS, wb, k0, kb, acc + t * QTILE_N); break;
        default: break;
    }
}

/* x [T, K] (row stride ldx) @ the repacked weight wq (quant_repack) of N rows, + bias [ceil(N/64) * 64] zero-padded
 * or NULL -> out [T, N] contiguous. K is a multiple of 32. */
void quant_linear_f32(const float *x, int64_t T, int64_t ldx, int64_t K, const uint8_t *wq, int qtype, int64_t N,
                      const float *bias, float *out, int threads) {
    int64_t tiles = (N + QTILE_N - 1) / QTILE_N, groups = K / GROUP, gbytes = quant_group_bytes(qtype);
#pragma omp parallel num_threads(threads)
    {
        float *acc = aligned_alloc(64, (size_t)T * QTILE_N * sizeof(float));
        float *wb = aligned_alloc(64, QBLOCK_K * QTILE_N * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t ti = 0; ti < tiles; ti++) {
            const uint8_t *tile = wq + ti * groups * gbytes;
            memset(acc, 0, (size_t)T * QTILE_N * sizeof(float));
            for (int64_t k0 = 0; k0 < K; k0 += QBLOCK_K) {
                int kb = (int)(K - k0 < QBLOCK_K ? K - k0 : QBLOCK_K);
                decode_block(tile, gbytes, qtype, k0, kb, wb);
                all_rows_over_block(x, ldx, T, wb, k0, kb, acc);
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

/* The register tile both float32 linears share (packed_linear.c over packed weights, quant_linear.c over weights it
 * has just dequantized): up to 6 rows of x against a 64-wide block of weights [kb][64], the accumulators in
 * registers, each output one chain of fused multiply-adds over k in order, continued from the partial sums in acc.
 * Storing and reloading a partial sum leaves its bits as they were, so how k is cut into blocks, how many rows share
 * a tile and how many columns a tile takes at once change no bit.
 *
 * A weight block is float32, bfloat16 or float16 (`fmt`, a WeightFormat; the half-size tiles packed_linear.c keeps
 * for weights whose values the narrower type holds exactly): the narrow value widens to the same float32 in a
 * register, so every multiply-add, hence every bit, is the float32 block's. A bfloat16 is a float32's upper 16 bits
 * (widened by a shift or a mask): in a bfloat16 tile each 64-byte line holds 32 columns interleaved (position 2i:
 * column i, 2i + 1: column 16 + i), so one 32-bit lane holds a column and the one 16 to its right and a vector of
 * either comes from one load and one shift or mask. A float16 tile keeps the columns in order (one conversion
 * instruction, F16C, widens 16 or 8 of them).
 */
#ifndef WAVEMESH_REGISTER_TILE_H
#define WAVEMESH_REGISTER_TILE_H

#include <stdint.h>
#include <immintrin.h>

#define TILE_N 64 /* output features per weight tile */
#define TILE_T 6  /* rows per register tile (see CVECS) */
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define LANES 16
#define VREGS 32 /* vector registers */
typedef __m512 vec;
INLINE vec vload(const float *p) { return _mm512_loadu_ps(p); }
INLINE vec vbroadcast(const float *p) { return _mm512_set1_ps(*p); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
INLINE void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
typedef __m512i ivec;
INLINE ivec iload(const void *p) { return _mm512_loadu_si512(p); }
INLINE vec low_halves(ivec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
INLINE vec high_halves(ivec v) {
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000)));
}
INLINE vec halfs(const void *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#define VREGS 16
typedef __m256 vec;
INLINE vec vload(const float *p) { return _mm256_loadu_ps(p); }
INLINE vec vbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
INLINE vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
INLINE void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
typedef __m256i ivec;
INLINE ivec iload(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE vec low_halves(ivec v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
INLINE vec high_halves(ivec v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000)));
}
INLINE vec halfs(const void *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
#error "the native linears need AVX2 with FMA, or AVX-512"
#endif
#if !defined(__F16C__)
#error "the native linears need F16C (every CPU with AVX2 has it)"
#endif

typedef enum { WF_F32 = 0, WF_BF16 = 1, WF_F16 = 2 } WeightFormat; /* a packed tile's element type */
#define WBYTES(fmt) ((fmt) == WF_F32 ? 4 : 2)

#define VECS (TILE_N / LANES)

/* v, passed through an empty asm: the compiler cannot turn a loop storing a local array's vectors into a memcpy
 * from that array (which keeps the array in memory and, in the k loop before it, stores every sum at every k). */
INLINE vec in_register(vec v) {
#if defined(__AVX512F__)
    __asm__("" : "+v"(v));
#else
    __asm__("" : "+x"(v));
#endif
    return v;
}
/* Vector j (columns j * LANES on) of one k's weights `row` [64] in format fmt (constant): a float32 load, float16s
 * converted, or from a bfloat16 line's interleave (above) the lanes' low or high halves widened. */
INLINE vec wload(const char *row, const WeightFormat fmt, int j) {
    if (fmt == WF_F32) return vload((const float *)row + j * LANES);
    if (fmt == WF_F16) return halfs(row + j * LANES * 2);
    const int col = j * LANES % 32; /* in its line: < 16 the low halves of the lanes from 2 * col, else the high */
    ivec raw = iload(row + (j * LANES / 32) * 64 + (col % 16) * 4);
    return col < 16 ? low_halves(raw) : high_halves(raw);
}

/* vectors of a tile's width one register tile covers at once: the whole tile with AVX-512 (6 x 4 accumulators in
 * 32 registers), a quarter with AVX2 (6 x 2 in 16 registers; the whole tile, 6 x 8, spilled to the stack) */
#if defined(__AVX512F__)
#define CVECS VECS
#else
#define CVECS 2
#endif
/* How a streamed weight is requested ahead, as measured per build: with AVX-512 (a Zen 5 VM, session 19) one or two
 * rows request each pass's weights 16 k ahead and every request is non-temporal, so the glue between a station's
 * native calls keeps its caches; with AVX2 (a Zen 3 VM, sessions 10-11) one or two rows leave it to the hardware
 * prefetcher (3-8% faster there than requesting) and the next block goes into L2. 3-40 rows request the next block
 * (MID_ROWS_AHEAD; see rows_requesting). On an Intel Xeon with AVX-512 (the session 27 VMs; the build defines
 * WAVEMESH_PREFETCH_T0 where /proc/cpuinfo names GenuineIntel) every non-temporal request roughly halves the speed:
 * there 1-40 rows request each pass's weights 16 k ahead into L1, as more rows do everywhere, and a model's linears
 * take 0.44-0.56x the time at 1-32 rows (bench/out/linear_stream_intel_s27.txt). There, from SPREAD_ROWS rows (two
 * row tiles or more that request), every row count requests the next block into L2 with its requests spread over
 * every row tile's pass, so memory streams while the tiles after the first compute from L1: at one thread 16 rows
 * take 0.80x the time, 32 rows 0.74x, 64 rows 0.79x, 512 rows 0.96x, bits equal (session 30,
 * bench/out/linear_stream_s30_spread.txt); 3-8 rows (one requesting tile) 1.00-1.04x so, kept as they were
 * (linear_stream_s30_experiments.txt). SPREAD_ROWS 0: never (the other builds, not measured so: unchanged code). */
#if defined(__AVX512F__) && defined(WAVEMESH_PREFETCH_T0)
#define MID_ROWS_PREFETCH 16
#define MID_ROWS_AHEAD 0
#define NEXT_BLOCK_HINT _MM_HINT_T1
/* On an Intel part with AMX (native.py defines WAVEMESH_SPREAD_FROM_3 where /proc/cpuinfo names amx_tile; the
 * session 42 VM, 2 MiB of L2 a core) the spread requests pay from 3 rows: a bench-preset decode step at batch 3 / 4
 * / 6 / 8 takes 0.94-0.96 / 0.87-0.89 / 0.84-0.88 / 0.88-0.91x the time (two runs of 12 alternated pairs, every pair
 * faster), SmolLM2's 0.92x at 4 and 8 (16 of 16), batch 1 and 12-16 unchanged, tokens equal
 * (bench/out/kernel_spread_s42.txt). Session 30's Intel type (no AMX) found 3-8 rows 1.00-1.04x so, and keeps 9.
 * There one or two rows also request 32 k (8 KiB) ahead rather than 16: a decode step at batch 1 / 2 takes
 * 0.936-0.943 / 0.946-0.956x the time, at two threads and at one, SmolLM2 and the bench preset (every one of 88
 * alternated pairs faster; batch 4 unchanged), 64 k ahead about the same, 128 k 1.03-1.05x (session 43,
 * bench/out/kernel_few_rows_s43.txt); a pure two-thread read of 540 MB there makes 26.9 GB/s with no requests and
 * 23.4 GB/s requesting 4 KiB ahead into L1, as 16 k did. */
#if defined(WAVEMESH_SPREAD_FROM_3)
#define SPREAD_ROWS 3
#define FEW_ROWS_AHEAD 32
#else
#define SPREAD_ROWS 9
#define FEW_ROWS_AHEAD 16
#endif
#define SPREAD_HINT _MM_HINT_T1
#elif defined(__AVX512F__) && defined(WAVEMESH_SPREAD_L2)
/* Zen 4 (AMD family 25; native.py defines WAVEMESH_SPREAD_L2 there), session 39, bench/out/linear_stream_s39_zen4.txt:
 * from 7 rows the spread requests, into L2 rather than non-temporal: at one thread, with a second core streaming
 * weights as a pipeline's other station does, 8 rows take 0.80-0.93x the time of the Zen 5 policy, 16 rows
 * 0.94-0.96x, 32 rows 0.93-0.96x, 64 rows 0.94-0.95x (all of it into L2, each tile requesting: 4 rows 1.07-1.12x).
 * 1-6 rows request nothing: the hardware prefetcher alone, 2-6 rows 0.88-0.93x the time of the non-temporal
 * requests, 1 row 0.98-1.01x; a whole station's decode step at batch 2-6 0.87-0.92x (SmolLM2 batch 1 0.96x). */
#define FEW_ROWS_AHEAD 0
#define MID_ROWS_PREFETCH 0
#define MID_ROWS_AHEAD 0
#define NEXT_BLOCK_HINT _MM_HINT_NTA /* never issued here (no tile asks for the next block but the spread ones) */
#define SPREAD_ROWS 7
#define SPREAD_HINT _MM_HINT_T1
#elif defined(__AVX512F__)
#define FEW_ROWS_AHEAD (-16)
#define MID_ROWS_PREFETCH 0
#define MID_ROWS_AHEAD 1
#define NEXT_BLOCK_HINT _MM_HINT_NTA
#define SPREAD_ROWS 0
#define SPREAD_HINT NEXT_BLOCK_HINT
#else
#define FEW_ROWS_AHEAD 0
#define MID_ROWS_PREFETCH 0
#define MID_ROWS_AHEAD 1
#define NEXT_BLOCK_HINT _MM_HINT_T1
#define SPREAD_ROWS 0
#define SPREAD_HINT NEXT_BLOCK_HINT
#endif

/* tb (constant, <= TILE_T) rows of x (x[i * ldx + k]) over kb weights w [kb][64] in format fmt (constant, see
 * wload), continuing the sums in acc [tb][64], the columns cv vectors at a time (cv constant, dividing VECS). Weights
 * streamed from memory are requested ahead of use: with prefetch > 0 (constant), each pass's columns that many k
 * ahead (< 0: -prefetch k ahead, as non-temporal); with `ahead` (constant), the next kb x 64 weights after w's, line
 * by line in memory order, spread evenly over this call's passes (its k rows with k % parts == part: this tile is
 * number `part` of `parts` sharing the requests; where a k's weights have fewer lines than the tile has passes, as a
 * half-size block's with AVX2, the first passes request a line each and the rest none), with
 * SPREAD_HINT where `ahead` is 2 (the spread requests), else
 * NEXT_BLOCK_HINT (5-12% faster at 4-40 rows with AVX-512, 9-29% with AVX2, than each pass's
 * columns one block ahead, bench/out/linear_stream.txt; non-temporal rather than into L2 on the AVX-512 VM: a 4-row
 * decode wave 10% faster in a station, a 16-row one 3%). */
INLINE void register_tile(const float *x, int64_t ldx, const int tb, const int cv, const void *w,
                          const WeightFormat fmt, int64_t kb, const int prefetch, const int ahead, int part, int parts,
                          float *acc) {
    const int wbytes = WBYTES(fmt);
    const int line_cols = 64 / wbytes;                   /* columns of a k's weights in one cache line */
    const int k_lines = TILE_N / line_cols;              /* cache lines of a k's weights */
    const int passes = VECS / cv;
    const int lines = k_lines >= passes ? k_lines / passes : 1; /* of the next block per k of a requesting pass */
    const int64_t row_bytes = (int64_t)TILE_N * wbytes;
    const char *wb = (const char *)w;
    for (int c0 = 0; c0 < VECS; c0 += cv) {
        float *ac = acc + c0 * LANES;
        const int pass = c0 / cv;
        const int requests = pass < k_lines;             /* this pass has a share of the next block */
        const char *next = wb + kb * row_bytes + (int64_t)pass * kb * lines * 64; /* this pass's share */
        const int first_line = c0 * LANES / line_cols;   /* the pass's columns' lines within a k's weights */
        const int pass_lines = cv * LANES / line_cols > 0 ? cv * LANES / line_cols : 1;
        vec a[TILE_T][VECS];
        for (int i = 0; i < tb; i++)
            for (int j = 0; j < cv; j++) a[i][j] = vload(ac + i * TILE_N + j * LANES);
        int due = part; /* passes of k until this tile's next request of the next block */
        for (int64_t k = 0; k < kb; k++) {
            const char *row = wb + k * row_bytes;
            vec wv[VECS];
            for (int j = 0; j < cv; j++) {
                wv[j] = wload(row, fmt, c0 + j);
                /* held in a register where the tile leaves one free: given the choice, GCC reads 3-4 rows'
                 * weights as a memory operand of every multiply-add (one load per FMA: ~60% of the FMA peak
                 * against ~90% so, in L1) */
                if (tb * cv + cv + 1 <= VREGS) wv[j] = in_register(wv[j]);
            }
            if (prefetch > 0)
                for (int l = 0; l < pass_lines; l++)
                    _mm_prefetch(row + prefetch * row_bytes + (first_line + l) * 64, _MM_HINT_T0);
            if (prefetch < 0)
                for (int l = 0; l < pass_lines; l++)
                    _mm_prefetch(row - prefetch * row_bytes + (first_line + l) * 64, _MM_HINT_NTA);
            if (ahead && requests && due-- == 0) {
                for (int l = 0; l < lines; l++) {
                    if (ahead == 2) _mm_prefetch(next + (k * lines + l) * 64, SPREAD_HINT);
                    else _mm_prefetch(next + (k * lines + l) * 64, NEXT_BLOCK_HINT);
                }
                due = parts - 1;
            }
            for (int i = 0; i < tb; i++) {
                vec xb = vbroadcast(x + i * ldx + k);
                for (int j = 0; j < cv; j++) a[i][j] = vfma(xb, wv[j], a[i][j]);
            }
        }
        for (int i = 0; i < tb; i++)
            for (int j = 0; j < cv; j++) vstore(ac + i * TILE_N + j * LANES, in_register(a[i][j]));
    }
}

/* All T rows of x over one weight block, in register tiles of 6 rows (3-6 rows: CVECS vectors of columns at a time;
 * the last one or two rows: the whole width). Weights streamed from memory (not from L1) are requested ahead by the
 * row count (measured on a model's worth of weights: `mesh bench linear_stream`, bench/out/linear_stream.txt): one or
 * two rows alone (a decode step) read the tile in one sequential pass, FEW_ROWS_AHEAD (with AVX-512 16 k ahead, 10-15%
 * faster on a Zen 5 VM than the hardware prefetcher alone, best at 8-32 k; as non-temporal a station's decode step
 * 4-6% faster again, its glue keeping its caches); 3-40 rows have each row tile request the whole next block in
 * memory order, spread over its passes (the passes stride across the block, which defeats the hardware prefetcher:
 * 3-6 rows ~30% faster, 8-40 rows 7-26% faster than requesting each pass's columns one block ahead); more rows 16 k
 * ahead (a block computes long enough for the hardware prefetcher, and further ahead the rows' x push the block out
 * of L1 before its use). With `spread` (constant; SPREAD_ROWS), at any row count, the row tiles of 3-6 rows share
 * the next block's requests instead, each requesting its share as it passes. */
INLINE void rows_requesting(const float *x, int64_t ldx, int64_t T, const void *w, const WeightFormat fmt,
                            int64_t kb, const int prefetch, const int ahead, const int spread, float *acc) {
    const int parts = spread ? (int)(T / TILE_T) + (T % TILE_T >= 3) : 1; /* the row tiles that request */
    const int asks = spread ? 2 : ahead; /* 2: the spread requests, with SPREAD_HINT */
    int64_t t = 0;
    for (; t + TILE_T <= T; t += TILE_T)
        register_tile(x + t * ldx, ldx, TILE_T, CVECS, w, fmt, kb, prefetch, asks, spread ? (int)(t / TILE_T) : 0,
                      parts, acc + t * TILE_N);
    const int last = spread ? parts - 1 : 0;
    switch (T - t) {
        case 5:
            register_tile(x + t * ldx, ldx, 5, CVECS, w, fmt, kb, prefetch, asks, last, parts, acc + t * TILE_N);
            break;
        case 4:
            register_tile(x + t * ldx, ldx, 4, CVECS, w, fmt, kb, prefetch, asks, last, parts, acc + t * TILE_N);
            break;
        case 3:
            register_tile(x + t * ldx, ldx, 3, CVECS, w, fmt, kb, prefetch, asks, last, parts, acc + t * TILE_N);
            break;
        case 2: register_tile(x + t * ldx, ldx, 2, VECS, w, fmt, kb, prefetch, 0, 0, 1, acc + t * TILE_N); break;
        case 1: register_tile(x + t * ldx, ldx, 1, VECS, w, fmt, kb, prefetch, 0, 0, 1, acc + t * TILE_N); break;
        default: break;
    }
}

/* The request policy above as constants (a distance or a pointer known only at run time costs the 16-register AVX2
 * tile a register and a branch in its k loop: 20-35% slower, measured). kb is 64 where it matters (one block). */
INLINE void all_rows_over_block(const float *x, int64_t ldx, int64_t T, const void *w, const WeightFormat fmt,
                                int64_t kb, const int streamed, float *acc) {
    if (!streamed) rows_requesting(x, ldx, T, w, fmt, kb, 0, 0, 0, acc);
    else if (T <= 2) rows_requesting(x, ldx, T, w, fmt, kb, FEW_ROWS_AHEAD, 0, 0, acc);
    else if (SPREAD_ROWS && T >= SPREAD_ROWS) rows_requesting(x, ldx, T, w, fmt, kb, 0, 1, 1, acc);
    else if (T <= 40) rows_requesting(x, ldx, T, w, fmt, kb, MID_ROWS_PREFETCH, MID_ROWS_AHEAD, 0, acc);
    else rows_requesting(x, ldx, T, w, fmt, kb, 16, 0, 0, acc);
}

#endif

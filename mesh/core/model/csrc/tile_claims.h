/* How the threads of one parallel region share a linear's tiles: each thread owns a contiguous range of them (the
 * split `schedule(static)` makes, so each streams its weights in order), claims its own tiles one at a time, and
 * when its range is done claims the tiles left in the others' (the next thread's first). A thread the OS has
 * descheduled (another process's turn on a busy core) thus holds up only the tile it is in, not the rest of its
 * share while the other threads wait at the barrier. Which thread computes a tile changes no bit.
 *
 *   TileClaims claims;                       (shared: declared before the parallel region)
 *   tile_claims_init(&claims, tiles, threads);
 *   #pragma omp parallel num_threads(threads)
 *   for (int64_t ti; (ti = tile_claim(&claims)) >= 0;) ...
 */
#ifndef WAVEMESH_TILE_CLAIMS_H
#define WAVEMESH_TILE_CLAIMS_H

#include <stdint.h>
#include <omp.h>

#define CLAIM_RANGES 64 /* threads beyond this share ranges (a thread claims from range id % CLAIM_RANGES) */

typedef struct {
    struct { int64_t next, end; char pad[48]; } range[CLAIM_RANGES] __attribute__((aligned(64)));
    int ranges;
} TileClaims;

static inline void tile_claims_init(TileClaims *c, int64_t tiles, int threads) {
    c->ranges = threads < 1 ? 1 : threads > CLAIM_RANGES ? CLAIM_RANGES : threads;
    for (int r = 0; r < c->ranges; r++) {
        c->range[r].next = tiles * r / c->ranges;
        c->range[r].end = tiles * (r + 1) / c->ranges;
    }
}

/* The next tile for the calling thread of the parallel region, or -1 when every tile is claimed. */
static inline int64_t tile_claim(TileClaims *c) {
    int own = omp_get_thread_num() % c->ranges;
    for (int i = 0; i < c->ranges; i++) {
        int r = (own + i) % c->ranges;
        if (__atomic_load_n(&c->range[r].next, __ATOMIC_RELAXED) >= c->range[r].end) continue;
        int64_t ti = __atomic_fetch_add(&c->range[r].next, 1, __ATOMIC_RELAXED);
        if (ti < c->range[r].end) return ti;
    }
    return -1;
}

#endif

/* prefix_pool.h: a model's pool of computed prompt prefixes (opt-in). A session whose
 * prompt starts with a cached prefix at the same depth shares that prefix's KV pages
 * instead of recomputing them: its output is bit-identical to a cold start (the same
 * batch-invariant rows), only the prefill is shorter. Entries are evicted least recently
 * used first when their pages exceed the byte budget. Thread-safe: one lock per pool. */
#ifndef TL_PREFIX_POOL_H
#define TL_PREFIX_POOL_H

#include "kv_cache.h"

typedef struct tl_prefix_pool tl_prefix_pool;

void tl_prefix_pool_free(tl_prefix_pool *pool); /* NULL is a no-op */

/* An entry's K/V are those of its tokens computed at `loops` from the initial loop state
   that `state_seed` draws (forward.h; 0: the model's fixed one): a prefix is shared only
   where all three match, else the output would not be a cold start's. */

/* Shares into `cache` (empty, of m) the longest pooled prefix of tokens[0..n) computed at
   `loops` from `state_seed`, within its window where it has one (the rows before it are an
   unwindowed session's); returns how many entries it now holds (0: no hit). */
int tl_prefix_pool_take(tl_prefix_pool *pool, const int32_t *tokens, int n, int loops, uint64_t state_seed,
                        tl_kv_cache *cache);

/* The length of the common prefix of a[0..na) and b[0..nb): what an entry of one serves the
   other. */
int tl_prefix_pool_common(const int32_t *a, int na, const int32_t *b, int nb);

/* How many entries a take of tokens[0..n) at (loops, state_seed) would share now (nothing
   is taken). */
int tl_prefix_pool_longest(tl_prefix_pool *pool, const int32_t *tokens, int n, int loops, uint64_t state_seed);

/* Offers the first n entries of `cache` (computed from `state_seed` and tokens[0..n)) to
   the pool as computed at `loops`, which keeps a share of their pages: those before the
   first entry of another depth (an early exit's shallower row), which a cold start at
   `loops` would not compute, and with a window those before it while the ring holds them.
   Out of memory is not an error: nothing is kept. */
void tl_prefix_pool_offer(tl_prefix_pool *pool, const int32_t *tokens, int n, int loops, uint64_t state_seed,
                          const tl_kv_cache *cache);

#endif

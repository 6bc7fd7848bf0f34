/* kv_cache.h: per-layer-instance key/value storage (SPEC §2).
 *
 * Slots: one per layer instance, n_prelude + n_block * max_loops + n_coda of them; the
 * block layer i at loop l (1-based) owns slot n_prelude + (l-1)*n_block + i.
 * Entries are addressed by their logical index (0, 1, 2, ... in the order they were
 * appended); with a window the physical row is logical % capacity (a ring buffer).
 *
 * The K/V storage is a buffer of the model's backend (backend.h); the row bookkeeping
 * (pos, logical, depth, length) is host memory: the host appends, rolls back and compacts. */
#ifndef TL_KV_CACHE_H
#define TL_KV_CACHE_H

#include "internal.h"

struct tl_backend;

typedef struct tl_kv_cache {
    int n_slots;
    int kv_dim;          /* n_kv_heads * head_dim */
    int capacity;        /* physical rows per slot */
    int window;          /* 0 = unbounded; else attention sees positions > p - window */
    int max_chunk;       /* most rows one forward may append (ring-buffer headroom) */
    int length;          /* logical entries appended so far */
    float *k, *v;        /* [n_slots][capacity][kv_dim] backend buffers */
    const struct tl_backend *backend; /* owner of k and v */
    void *backend_ctx;
    int32_t *pos;        /* [capacity] token position of each row (RoPE / window) */
    int32_t *logical;    /* [capacity] logical index the row holds: with a ring, rows written
                            for entries later rolled back (speculative drafts) can overwrite
                            older ones, and readers must not mistake them for those */
    uint16_t *depth;     /* [capacity] loops computed for the row; deeper slots are shared */
} tl_kv_cache;

/* A cache for forwards of model m, its K/V in m's backend. tokens: most logical entries
   ever held (prompt + max new); window 0 = unbounded. With a window the memory is
   (window + max_chunk) rows whatever `tokens` is. */
tl_status tl_kv_cache_new_for(const tl_model *m, int tokens, int window, int max_chunk,
                              tl_kv_cache **out);
void tl_kv_cache_free(tl_kv_cache *cache);

static inline int tl_kv_row(const tl_kv_cache *c, int logical) { return logical % c->capacity; }
/* Addresses of entry `logical` in `slot`: host pointers for the CPU backend (its kernels
   and the tests); other backends index their buffers with the same layout. */
static inline float *tl_kv_k(const tl_kv_cache *c, int slot, int logical) {
    return c->k + ((size_t)slot * (size_t)c->capacity + (size_t)tl_kv_row(c, logical)) * (size_t)c->kv_dim;
}
static inline float *tl_kv_v(const tl_kv_cache *c, int slot, int logical) {
    return c->v + ((size_t)slot * (size_t)c->capacity + (size_t)tl_kv_row(c, logical)) * (size_t)c->kv_dim;
}
/* Forgets the newest entries so that `length` remain (speculative rollback). */
tl_status tl_kv_truncate(tl_kv_cache *cache, int length);
/* Copies every slot of entry `from` to entry `to` (to < from), used to compact an
   accepted tree path into consecutive entries (the copy runs on the backend). */
void tl_kv_move(tl_kv_cache *cache, int from, int to);

#endif

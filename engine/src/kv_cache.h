/* kv_cache.h: per-layer-instance key/value storage (SPEC §2), in shared pages.
 *
 * Slots: one per layer instance, n_prelude + n_block * max_loops + n_coda of them; the
 * block layer i at loop l (1-based) owns slot n_prelude + (l-1)*n_block + i.
 * Entries are addressed by their logical index (0, 1, 2, ... in the order they were
 * appended); with a window the physical row is logical % capacity (a ring buffer).
 *
 * Pages. Each slot's rows live in pages of TL_KV_PAGE_ROWS rows, reserved before a forward
 * writes them for every slot up to the session's depth (reserve_loops), so memory follows
 * the depth a session runs at (a model allowing 4096 loops run at 8 pays for 8); once a
 * page's rows are all written, the pages of slots none of them reached (early exit) go back
 * (tl_kv_reserve). Pages are reference-counted, so that a forked session, a prefix-pool entry
 * or a saved state shares its parent's pages: a page is copied only when one of its sharers
 * writes into it (copy on write). The K/V pages are buffers of the model's backend
 * (backend.h); the page table and the row bookkeeping (pos, logical, depth, length) are host
 * memory: the host appends, rolls back, compacts and forks. */
#ifndef TL_KV_CACHE_H
#define TL_KV_CACHE_H

#include <stdatomic.h>

#include "internal.h"

#define TL_KV_PAGE_ROWS 16

typedef struct tl_kv_page {
    atomic_int refs;     /* caches sharing the page; written only while it is 1 */
    void *k, *v;         /* [TL_KV_PAGE_ROWS][kv_dim] backend buffers of the model's kv_type:
                            float, or uint16_t f16 (rounded on write, widened on read) */
    struct tl_kv_page *next_spare; /* in the model's spare list (refs 0) */
    int pool_entries;    /* entries of the model's prefix pool holding the page (prefix_pool.c,
                            under its lock) */
} tl_kv_page;

/* A model's spare pages. A page no cache holds any more is kept (up to TL_KV_SPARE_BYTES
   per model) and handed to the next cache that needs one: a server's steady stream of
   sessions, or a batch of new ones, then reuses warm memory instead of faulting in and
   zeroing fresh pages for every 16 rows of every slot. A reused page keeps its old rows:
   a row is read only after its cache wrote it (logical[], depth[] and length say which
   rows hold entries), so they are never seen. */
#define TL_KV_SPARE_BYTES ((size_t)64 << 20)
typedef struct tl_kv_spares tl_kv_spares;
tl_kv_spares *tl_kv_spares_new(void);             /* NULL when out of memory: no reuse */
void tl_kv_spares_free(const tl_model *m, tl_kv_spares *spares); /* frees the kept pages */
size_t tl_kv_spares_bytes(const tl_model *m); /* K + V bytes kept now */

typedef struct tl_kv_cache {
    const tl_model *model; /* whose backend holds the pages */
    int n_slots;
    int kv_dim;          /* n_kv_heads * head_dim */
    size_t row_bytes;    /* kv_dim elements of K (or V) of the model's kv_type */
    int capacity;        /* physical rows per slot */
    int n_pages;         /* pages per slot: capacity / TL_KV_PAGE_ROWS rounded up */
    int window;          /* 0 = unbounded; else attention sees positions > p - window */
    int max_chunk;       /* most rows one forward may append (ring-buffer headroom) */
    int length;          /* logical entries appended so far */
    int reserve_loops;   /* loops whose slots a forward's rows get pages for up front
                            (the owner's depth; max_loops until told) */
    bool out_of_memory;  /* a page could not be allocated: the forward's result is void */
    int trimmed_blocks;  /* window 0: pages of TL_KV_PAGE_ROWS entries [0, this) whose slots
                            deeper than their rows' deepest were given back (tl_kv_reserve) */
    tl_kv_page **pages;  /* [n_slots][n_pages], NULL until written */
    int32_t *pos;        /* [capacity] token position of each row (RoPE / window) */
    int32_t *logical;    /* [capacity] logical index the row holds: with a ring, rows written
                            for entries later rolled back (speculative drafts) can overwrite
                            older ones, and readers must not mistake them for those */
    uint16_t *depth;     /* [capacity] loops computed for the row; deeper slots are shared */
} tl_kv_cache;

/* The slot numbering above, in one place: how many slots a cache of model config c has, and
   whether a row computed at `depth` loops has `slot` (prelude, block loops 1..depth, coda). */
static inline int tl_kv_slots(const tl_config *c) {
    const int n = c->n_prelude + c->n_block * c->max_loops + c->n_coda;
    return n > 0 ? n : 1;
}
static inline bool tl_kv_slot_at_depth(const tl_config *c, int slot, int depth) {
    return slot < c->n_prelude + c->n_block * depth || slot >= c->n_prelude + c->n_block * c->max_loops;
}

/* A cache for forwards of model m, its K/V in m's backend. tokens: most logical entries
   ever held (prompt + max new); window 0 = unbounded. With a window the memory is at most
   (window + max_chunk) rows whatever `tokens` is. No page is allocated yet. */
tl_status tl_kv_cache_new_for(const tl_model *m, int tokens, int window, int max_chunk,
                              tl_kv_cache **out);
/* A cache holding exactly what `src` holds, sharing its pages (cheap: a page table and the
   row bookkeeping are copied, no K/V). */
tl_status tl_kv_cache_fork(const tl_kv_cache *src, tl_kv_cache **out);
void tl_kv_cache_free(tl_kv_cache *cache);
/* Lets go of every page and entry: the cache as new (a session that took a shorter prefix from
   the pool than the pool now holds takes the longer one: session.c). */
void tl_kv_cache_empty(tl_kv_cache *cache);
/* Bytes of K/V pages this cache references (shared ones included). */
size_t tl_kv_cache_bytes(const tl_kv_cache *cache);
/* The most bytes of K/V pages this cache can reference: every page of its capacity in every
   slot up to reserve_loops deep (a shared page counted as its own: a write copies it). */
size_t tl_kv_cache_max_bytes(const tl_kv_cache *cache);
/* Bytes of one K/V page of the model (its K and V). */
size_t tl_kv_page_bytes(const tl_model *model);

static inline int tl_kv_row(const tl_kv_cache *c, int logical) { return logical % c->capacity; }
/* Of the rows [0, n), those an unwindowed cache's would be: with a window W, the rows before W,
   which attend to every row before them (the window is the last W positions, a row's own
   included); all n without a window. (Whether a ring still holds them is its entries' say.)
   The prefix pool takes and offers these, and a serving engine's waits count them. */
static inline int tl_kv_unwindowed_rows(const tl_kv_cache *c, int n) { return c->window > 0 && n > c->window ? c->window : n; }
static inline tl_kv_page *tl_kv_page_of(const tl_kv_cache *c, int slot, int row) {
    return c->pages[(size_t)slot * (size_t)c->n_pages + (size_t)(row / TL_KV_PAGE_ROWS)];
}
/* Row `row` (of TL_KV_PAGE_ROWS) of a page's K or V buffer. */
static inline void *tl_kv_page_row(const tl_kv_cache *c, void *buffer, int row) {
    return (char *)buffer + (size_t)(row % TL_KV_PAGE_ROWS) * c->row_bytes;
}
/* Addresses of entry `logical` in `slot`, for reading (NULL when never written): host
   pointers for the CPU backend (its kernels and the tests); other backends index their
   pages the same way. Elements of c->type. */
static inline const void *tl_kv_k(const tl_kv_cache *c, int slot, int logical) {
    const int row = tl_kv_row(c, logical);
    const tl_kv_page *p = tl_kv_page_of(c, slot, row);
    return p ? tl_kv_page_row(c, p->k, row) : NULL;
}
static inline const void *tl_kv_v(const tl_kv_cache *c, int slot, int logical) {
    const int row = tl_kv_row(c, logical);
    const tl_kv_page *p = tl_kv_page_of(c, slot, row);
    return p ? tl_kv_page_row(c, p->v, row) : NULL;
}
/* The same for writing: allocates the page, or copies it when it is shared. false when out
   of memory (the cache is then marked out_of_memory). */
bool tl_kv_writable(tl_kv_cache *c, int slot, int logical, void **k, void **v);

/* Makes the pages of logical entries [from, from + n) writable in every slot up to
   reserve_loops deep: a forward then writes without allocating. */
tl_status tl_kv_reserve(tl_kv_cache *c, int from, int n);
/* Forgets the newest entries so that `length` remain (speculative rollback). */
tl_status tl_kv_truncate(tl_kv_cache *cache, int length);
/* Copies every slot of entry `from` to entry `to` (to < from), used to compact an
   accepted tree path into consecutive entries (the copy runs on the backend). */
void tl_kv_move(tl_kv_cache *cache, int from, int to);

#endif

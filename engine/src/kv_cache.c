/* kv_cache.c: pages, forks, rollback and compaction of the KV cache. The K/V pages are
 * allocated and copied by the backend; the page table and bookkeeping here are host-side. */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "kv_cache.h"

/* ---------------------------------------------------------------- pages */

/* Bytes of a row of K (or V) in m's caches, and of a page's K (or V) buffer: every cache of
   a model has the same pages. */
static size_t row_bytes_of(const tl_model *m) {
    return (size_t)m->cfg.n_kv_heads * (size_t)m->cfg.head_dim * (m->kv_type == TL_KV_F16 ? sizeof(uint16_t) : sizeof(float));
}
static size_t buffer_bytes(const tl_model *m) { return (size_t)TL_KV_PAGE_ROWS * row_bytes_of(m); }
static size_t page_bytes(const tl_model *m) { return 2 * buffer_bytes(m); }

struct tl_kv_spares {
    pthread_mutex_t lock;
    tl_kv_page *top;  /* a stack: the most recently freed page is the warmest */
    size_t bytes;     /* K + V bytes of the kept pages */
};

tl_kv_spares *tl_kv_spares_new(void) {
    tl_kv_spares *spares = calloc(1, sizeof *spares);
    if (spares && pthread_mutex_init(&spares->lock, NULL) != 0) {
        free(spares);
        return NULL;
    }
    return spares;
}

/* The model's count of page bytes (internal.h): pages are made and destroyed through the
   const model pointers that caches hold. */
static void count_page_bytes(const tl_model *m, long long bytes) {
    atomic_fetch_add(&((tl_model *)m)->kv_page_bytes, bytes);
}

static void page_destroy(const tl_model *m, tl_kv_page *p) {
    m->backend->free(m->backend_ctx, p->k);
    m->backend->free(m->backend_ctx, p->v);
    free(p);
    count_page_bytes(m, -(long long)page_bytes(m));
}

void tl_kv_spares_free(const tl_model *m, tl_kv_spares *spares) {
    if (!spares) return;
    for (tl_kv_page *p = spares->top, *next; p; p = next) {
        next = p->next_spare;
        page_destroy(m, p);
    }
    pthread_mutex_destroy(&spares->lock);
    free(spares);
}

size_t tl_kv_spares_bytes(const tl_model *m) {
    tl_kv_spares *spares = m->kv_spares;
    if (!spares) return 0;
    pthread_mutex_lock(&spares->lock);
    const size_t bytes = spares->bytes;
    pthread_mutex_unlock(&spares->lock);
    return bytes;
}

static void page_release(const tl_kv_cache *c, tl_kv_page *p) {
    if (!p || atomic_fetch_sub(&p->refs, 1) != 1) return;
    tl_kv_spares *spares = c->model->kv_spares;
    if (spares) {
        pthread_mutex_lock(&spares->lock);
        const bool keep = spares->bytes + page_bytes(c->model) <= TL_KV_SPARE_BYTES;
        if (keep) {
            p->next_spare = spares->top;
            spares->top = p;
            spares->bytes += page_bytes(c->model);
        }
        pthread_mutex_unlock(&spares->lock);
        if (keep) return;
    }
    page_destroy(c->model, p);
}

/* A kept page, or NULL when there is none. */
static tl_kv_page *spare_page(const tl_kv_cache *c) {
    tl_kv_spares *spares = c->model->kv_spares;
    if (!spares) return NULL;
    pthread_mutex_lock(&spares->lock);
    tl_kv_page *p = spares->top;
    if (p) {
        spares->top = p->next_spare;
        spares->bytes -= page_bytes(c->model);
    }
    pthread_mutex_unlock(&spares->lock);
    return p;
}

/* A new page (a kept one when there is one); a copy of `from` when given (copy on write). */
static tl_kv_page *page_new(const tl_kv_cache *c, const tl_kv_page *from) {
    const tl_model *m = c->model;
    tl_kv_page *p = spare_page(c);
    if (p) {
        atomic_store(&p->refs, 1);
    } else {
        if (!(p = malloc(sizeof *p))) return NULL;
        atomic_init(&p->refs, 1);
        p->k = m->backend->alloc(m->backend_ctx, buffer_bytes(m));
        p->v = m->backend->alloc(m->backend_ctx, buffer_bytes(m));
        if (!p->k || !p->v) {
            if (p->k) m->backend->free(m->backend_ctx, p->k);
            if (p->v) m->backend->free(m->backend_ctx, p->v);
            free(p);
            return NULL;
        }
        count_page_bytes(m, (long long)page_bytes(m));
    }
    p->next_spare = NULL;
    p->pool_entries = 0;
    if (from) { /* the backend copies floats: a buffer is a whole number of them (16 rows) */
        m->backend->copy(m, p->k, from->k, buffer_bytes(m) / sizeof(float));
        m->backend->copy(m, p->v, from->v, buffer_bytes(m) / sizeof(float));
    }
    return p;
}

/* The page of (slot, row), made private and present. */
static tl_kv_page *page_writable(tl_kv_cache *c, int slot, int row) {
    tl_kv_page **at = &c->pages[(size_t)slot * (size_t)c->n_pages + (size_t)(row / TL_KV_PAGE_ROWS)];
    if (*at && atomic_load(&(*at)->refs) == 1) return *at;
    tl_kv_page *fresh = page_new(c, *at);
    if (!fresh) {
        c->out_of_memory = true;
        return NULL;
    }
    page_release(c, *at);
    *at = fresh;
    return fresh;
}

bool tl_kv_writable(tl_kv_cache *c, int slot, int logical, void **k, void **v) {
    const int row = tl_kv_row(c, logical);
    tl_kv_page *p = page_writable(c, slot, row);
    if (!p) return false;
    *k = tl_kv_page_row(c, p->k, row);
    *v = tl_kv_page_row(c, p->v, row);
    return true;
}

/* Early exit: the rows of a page that no longer grows (its entries all below `from`) may all
   have stopped short of the depth its pages were reserved for; the slots none of them reached
   are never written or read (attention reads a shallower row's deepest slot at deeper loops),
   so their pages go back (200 tokens at loops 16 exiting at 3 held the pages of 16). A ring
   (window) reuses its pages and is bounded by its window: left as it is. */
static void trim_unreached(tl_kv_cache *c, int from) {
    if (c->window != 0) return;
    const tl_config *cfg = &c->model->cfg;
    for (; (c->trimmed_blocks + 1) * TL_KV_PAGE_ROWS <= from; c->trimmed_blocks++) {
        const int first = c->trimmed_blocks * TL_KV_PAGE_ROWS;
        int deepest = 0;
        for (int e = first; e < first + TL_KV_PAGE_ROWS; e++)
            if (c->depth[e] > deepest) deepest = c->depth[e];
        for (int slot = 0; slot < c->n_slots; slot++) {
            if (tl_kv_slot_at_depth(cfg, slot, deepest)) continue;
            tl_kv_page **at = &c->pages[(size_t)slot * (size_t)c->n_pages + (size_t)c->trimmed_blocks];
            page_release(c, *at);
            *at = NULL;
        }
    }
}

/* The depth whose slots a cache's rows get pages for: its owner's, within the model's. */
static int reserved_loops(const tl_kv_cache *c) {
    return c->reserve_loops < c->model->cfg.max_loops ? c->reserve_loops : c->model->cfg.max_loops;
}

tl_status tl_kv_reserve(tl_kv_cache *c, int from, int n) {
    trim_unreached(c, from);
    const tl_config *cfg = &c->model->cfg;
    const int loops = reserved_loops(c);
    for (int slot = 0; slot < c->n_slots; slot++) {
        if (!tl_kv_slot_at_depth(cfg, slot, loops)) continue; /* loops deeper than the owner runs */
        int last_page = -1;
        for (int e = from; e < from + n; e++) {
            const int row = tl_kv_row(c, e);
            if (row / TL_KV_PAGE_ROWS == last_page) continue;
            last_page = row / TL_KV_PAGE_ROWS;
            if (!page_writable(c, slot, row))
                return tl_fail(TL_ERR_NO_MEMORY, "kv cache: out of memory for a page of %d rows", TL_KV_PAGE_ROWS);
        }
    }
    return TL_OK;
}

size_t tl_kv_cache_bytes(const tl_kv_cache *c) {
    size_t pages = 0;
    for (size_t i = 0; i < (size_t)c->n_slots * (size_t)c->n_pages; i++) pages += c->pages[i] != NULL;
    return pages * page_bytes(c->model);
}

size_t tl_kv_page_bytes(const tl_model *model) { return page_bytes(model); }

size_t tl_kv_cache_max_bytes(const tl_kv_cache *c) {
    const tl_config *cfg = &c->model->cfg;
    const int loops = reserved_loops(c);
    size_t slots = 0;
    for (int slot = 0; slot < c->n_slots; slot++) slots += tl_kv_slot_at_depth(cfg, slot, loops);
    return slots * (size_t)c->n_pages * page_bytes(c->model);
}

/* ---------------------------------------------------------------- caches */

static tl_kv_cache *cache_alloc(const tl_model *m, int capacity) {
    tl_kv_cache *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    const tl_config *cfg = &m->cfg;
    c->model = m;
    c->n_slots = tl_kv_slots(cfg);
    c->kv_dim = cfg->n_kv_heads * cfg->head_dim;
    c->row_bytes = row_bytes_of(m);
    c->capacity = capacity;
    c->n_pages = (capacity + TL_KV_PAGE_ROWS - 1) / TL_KV_PAGE_ROWS;
    c->reserve_loops = cfg->max_loops;
    c->pages = calloc((size_t)c->n_slots * (size_t)c->n_pages, sizeof *c->pages);
    c->pos = calloc((size_t)capacity, sizeof *c->pos);
    c->depth = calloc((size_t)capacity, sizeof *c->depth);
    c->logical = malloc((size_t)capacity * sizeof *c->logical);
    if (!c->pages || !c->pos || !c->depth || !c->logical) {
        tl_kv_cache_free(c);
        return NULL;
    }
    return c;
}

tl_status tl_kv_cache_new_for(const tl_model *m, int tokens, int window, int max_chunk,
                              tl_kv_cache **out) {
    *out = NULL;
    if (tokens < 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv cache: tokens = %d must be >= 1", tokens);
    if (window < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "cache_window = %d must be >= 0", window);
    if (max_chunk < 1) max_chunk = 1;
    int capacity = tokens;
    /* A ring needs room for a whole chunk beyond the window: a chunk's rows must not
       overwrite entries that its own first row still attends to. */
    if (window > 0 && (long)window + max_chunk < tokens) capacity = window + max_chunk;
    tl_kv_cache *c = cache_alloc(m, capacity);
    if (!c) return tl_fail(TL_ERR_NO_MEMORY, "kv cache: out of memory for %d rows", capacity);
    c->window = window;
    c->max_chunk = max_chunk;
    for (int i = 0; i < capacity; i++) c->logical[i] = -1;
    *out = c;
    return TL_OK;
}

tl_status tl_kv_cache_fork(const tl_kv_cache *src, tl_kv_cache **out) {
    *out = NULL;
    tl_kv_cache *c = cache_alloc(src->model, src->capacity);
    if (!c) return tl_fail(TL_ERR_NO_MEMORY, "kv cache: out of memory for a fork");
    c->window = src->window;
    c->max_chunk = src->max_chunk;
    c->length = src->length;
    c->reserve_loops = src->reserve_loops;
    c->trimmed_blocks = src->trimmed_blocks;
    const size_t n = (size_t)src->n_slots * (size_t)src->n_pages;
    for (size_t i = 0; i < n; i++)
        if ((c->pages[i] = src->pages[i])) atomic_fetch_add(&c->pages[i]->refs, 1);
    memcpy(c->pos, src->pos, (size_t)src->capacity * sizeof *c->pos);
    memcpy(c->depth, src->depth, (size_t)src->capacity * sizeof *c->depth);
    memcpy(c->logical, src->logical, (size_t)src->capacity * sizeof *c->logical);
    *out = c;
    return TL_OK;
}

void tl_kv_cache_empty(tl_kv_cache *c) {
    for (size_t i = 0; i < (size_t)c->n_slots * (size_t)c->n_pages; i++) {
        page_release(c, c->pages[i]);
        c->pages[i] = NULL;
    }
    c->length = 0;
    c->trimmed_blocks = 0;
}

void tl_kv_cache_free(tl_kv_cache *c) {
    if (!c) return;
    if (c->pages) tl_kv_cache_empty(c);
    free(c->pages);
    free(c->pos);
    free(c->depth);
    free(c->logical);
    free(c);
}

tl_status tl_kv_truncate(tl_kv_cache *c, int length) {
    if (length < 0 || length > c->length)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv cache: cannot truncate %d entries to %d",
                       c->length, length);
    /* Bookkeeping only: rows past `length` are overwritten by the next append, and until
       then attention cannot reach them (it reads entries below base + n, and `logical`
       tells a reused ring row from the entry it once held). */
    c->length = length;
    /* (a page rows are written into again takes its deeper slots again: tl_kv_reserve) */
    if (c->trimmed_blocks * TL_KV_PAGE_ROWS > length) c->trimmed_blocks = length / TL_KV_PAGE_ROWS;
    return TL_OK;
}

void tl_kv_move(tl_kv_cache *c, int from, int to) {
    if (from == to) return;
    c->model->backend->kv_move(c, from, to);
    c->pos[tl_kv_row(c, to)] = c->pos[tl_kv_row(c, from)];
    c->depth[tl_kv_row(c, to)] = c->depth[tl_kv_row(c, from)];
    c->logical[tl_kv_row(c, to)] = to;
}

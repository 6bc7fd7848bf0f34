/* kv_cache.c: allocation, rollback and compaction of the KV cache. The K/V storage is
 * allocated and copied by the backend; the bookkeeping here is host-side. */
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "kv_cache.h"

static tl_status cache_new(const tl_config *cfg, const tl_backend *be, void *be_ctx, int tokens,
                           int window, int max_chunk, tl_kv_cache **out) {
    *out = NULL;
    if (tokens < 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv cache: tokens = %d must be >= 1", tokens);
    if (window < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "cache_window = %d must be >= 0", window);
    if (max_chunk < 1) max_chunk = 1;
    tl_kv_cache *c = calloc(1, sizeof *c);
    if (!c) return tl_fail(TL_ERR_NO_MEMORY, "kv cache: out of memory");
    c->backend = be;
    c->backend_ctx = be_ctx;
    c->n_slots = cfg->n_prelude + cfg->n_block * cfg->max_loops + cfg->n_coda;
    c->kv_dim = cfg->n_kv_heads * cfg->head_dim;
    c->window = window;
    c->max_chunk = max_chunk;
    c->capacity = tokens;
    /* A ring needs room for a whole chunk beyond the window: a chunk's rows must not
       overwrite entries that its own first row still attends to. */
    if (window > 0 && (long)window + max_chunk < tokens) c->capacity = window + max_chunk;
    size_t rows = (size_t)(c->n_slots ? c->n_slots : 1) * (size_t)c->capacity * (size_t)c->kv_dim;
    c->k = be->alloc(be_ctx, rows * sizeof(float));
    c->v = be->alloc(be_ctx, rows * sizeof(float));
    c->pos = calloc((size_t)c->capacity, sizeof *c->pos);
    c->depth = calloc((size_t)c->capacity, sizeof *c->depth);
    c->logical = malloc((size_t)c->capacity * sizeof *c->logical);
    if (c->logical)
        for (int i = 0; i < c->capacity; i++) c->logical[i] = -1;
    if (!c->k || !c->v || !c->pos || !c->depth || !c->logical) {
        const int capacity = c->capacity, n_slots = c->n_slots;
        tl_kv_cache_free(c);
        return tl_fail(TL_ERR_NO_MEMORY, "kv cache: out of memory for %d rows x %d slots", capacity, n_slots);
    }
    *out = c;
    return TL_OK;
}

tl_status tl_kv_cache_new_for(const tl_model *m, int tokens, int window, int max_chunk,
                              tl_kv_cache **out) {
    return cache_new(&m->cfg, m->backend, m->backend_ctx, tokens, window, max_chunk, out);
}

void tl_kv_cache_free(tl_kv_cache *c) {
    if (!c) return;
    c->backend->free(c->backend_ctx, c->k);
    c->backend->free(c->backend_ctx, c->v);
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
    return TL_OK;
}

void tl_kv_move(tl_kv_cache *c, int from, int to) {
    if (from == to) return;
    c->backend->kv_move(c, from, to);
    c->pos[tl_kv_row(c, to)] = c->pos[tl_kv_row(c, from)];
    c->depth[tl_kv_row(c, to)] = c->depth[tl_kv_row(c, from)];
    c->logical[tl_kv_row(c, to)] = to;
}

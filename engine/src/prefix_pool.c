/* prefix_pool.c: computed prompt prefixes shared between sessions (prefix_pool.h). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "prefix_pool.h"

typedef struct pool_entry {
    int32_t *tokens;      /* [n] */
    int n, loops;
    uint64_t state_seed;  /* the initial loop state's seed (prefix_pool.h), 0: fixed */
    tl_kv_cache *cache;   /* holds exactly these n entries, sharing the donor's pages */
    size_t bytes;
    uint64_t last_used;
} pool_entry;

/* The entries are kept sorted by (loops, state_seed, tokens), the tokens compared as
   words are in a dictionary (a prefix before its extensions). Among sorted sequences the ones
   sharing the longest prefix with a prompt lie next to the place the prompt would take, so a
   lookup is a binary search and two comparisons: every entry compared with every prompt made
   a session's overhead grow with the pool (1.2 ms a session at 8 entries, 3.6 at 2,048 on the
   shipped model). */
struct tl_prefix_pool {
    pthread_mutex_t lock;
    size_t budget;
    pool_entry **entries; /* [n_entries], sorted (compare_entry) */
    int n_entries, cap_entries;
    uint64_t clock;
    size_t pages_held;    /* distinct K/V pages the entries hold (count_pages) */
};

/* ---------------------------------------------------------------- shared prefixes */

/* dst (empty) takes rows [0, n) of src: shared pages, copied bookkeeping. Rows past n in the
   last shared page are overwritten (after a copy on write) when dst appends. Either may be a
   ring (a window) whose first n rows are still its entries [0, n) (tl_kv_unwindowed_rows): a ring's row
   is its entry's index modulo its capacity, the page table's as an unwindowed cache's. */
static void share_prefix(tl_kv_cache *dst, const tl_kv_cache *src, int n) {
    const int pages = (n + TL_KV_PAGE_ROWS - 1) / TL_KV_PAGE_ROWS;
    for (int slot = 0; slot < dst->n_slots; slot++)
        for (int p = 0; p < pages; p++) {
            tl_kv_page *page = src->pages[(size_t)slot * (size_t)src->n_pages + (size_t)p];
            if (!page) continue;
            atomic_fetch_add(&page->refs, 1);
            dst->pages[(size_t)slot * (size_t)dst->n_pages + (size_t)p] = page;
        }
    memcpy(dst->pos, src->pos, (size_t)n * sizeof *dst->pos);
    memcpy(dst->depth, src->depth, (size_t)n * sizeof *dst->depth);
    memcpy(dst->logical, src->logical, (size_t)n * sizeof *dst->logical);
    dst->length = n;
}

/* Whether entry e's K/V were computed as a session at `loops` from `state_seed` computes
   them (prefix_pool.h): only then may its rows stand in for that session's. */
static bool same_key(const pool_entry *e, int loops, uint64_t state_seed) {
    return e->loops == loops && e->state_seed == state_seed;
}

int tl_prefix_pool_common(const int32_t *a, int na, const int32_t *b, int nb) {
    int k = 0;
    while (k < na && k < nb && a[k] == b[k]) k++;
    return k;
}

/* The pool's order: entry e against the sequence tokens[0..n) at (loops, state_seed). */
static int compare_entry(const pool_entry *e, int loops, uint64_t state_seed, const int32_t *tokens, int n) {
    if (e->loops != loops) return e->loops < loops ? -1 : 1;
    if (e->state_seed != state_seed) return e->state_seed < state_seed ? -1 : 1;
    const int k = tl_prefix_pool_common(e->tokens, e->n, tokens, n);
    if (k < e->n && k < n) return e->tokens[k] < tokens[k] ? -1 : 1;
    return (e->n > n) - (e->n < n);
}

/* Under the lock: the first entry not before tokens[0..n) at (loops, state_seed), or n_entries. */
static int place_of(const tl_prefix_pool *pool, int loops, uint64_t state_seed, const int32_t *tokens, int n) {
    int low = 0, high = pool->n_entries;
    while (low < high) {
        const int mid = low + (high - low) / 2;
        if (compare_entry(pool->entries[mid], loops, state_seed, tokens, n) < 0)
            low = mid + 1;
        else
            high = mid;
    }
    return low;
}

/* One more entry fits in the array (grown when needed). */
static bool room_for_one(tl_prefix_pool *pool) {
    if (pool->n_entries < pool->cap_entries) return true;
    const int cap = pool->cap_entries * 2 + 8;
    pool_entry **grown = realloc(pool->entries, (size_t)cap * sizeof *grown);
    if (!grown) return false;
    pool->entries = grown;
    pool->cap_entries = cap;
    return true;
}

static void entry_free(pool_entry *e) {
    if (!e) return;
    tl_kv_cache_free(e->cache);
    free(e->tokens);
    free(e);
}

/* Under the lock: an entry's cache counted into the pool's pages as it joins (joining true),
   or out as it leaves. Entries share pages (a system prompt's, by conversations that start
   with it), which count once: each counted its own, and the pool evicted with its pages well
   under the budget (two conversations of eight that fitted). The count is kept, not made
   again: sorting every entry's pages at each offer made an offer cost more the more entries
   the pool held (86 ms a session at 4,096), and evicting down to a lower budget quadratic
   (8.7 s for 1,024 entries, the lock held). */
static void count_pages(tl_prefix_pool *pool, const tl_kv_cache *cache, bool joining) {
    const size_t n = (size_t)cache->n_slots * (size_t)cache->n_pages;
    for (size_t k = 0; k < n; k++) {
        tl_kv_page *page = cache->pages[k];
        if (!page) continue;
        if (joining) {
            if (page->pool_entries++ == 0) pool->pages_held++;
        } else if (--page->pool_entries == 0) {
            pool->pages_held--;
        }
    }
}

/* Under the lock: entry i leaves; the others keep their order. */
static void remove_entry(tl_prefix_pool *pool, int i) {
    count_pages(pool, pool->entries[i]->cache, false);
    entry_free(pool->entries[i]);
    pool->n_entries--;
    memmove(&pool->entries[i], &pool->entries[i + 1], (size_t)(pool->n_entries - i) * sizeof *pool->entries);
}

/* Under the lock: least recently used entries leave until the pool's pages (with those of an
   entry about to join, counted already) fit the budget, or none is left. */
static void evict_to_fit(tl_prefix_pool *pool, const tl_model *model) {
    while (pool->n_entries > 0 && pool->pages_held * tl_kv_page_bytes(model) > pool->budget) {
        int lru = 0;
        for (int i = 1; i < pool->n_entries; i++)
            if (pool->entries[i]->last_used < pool->entries[lru]->last_used) lru = i;
        remove_entry(pool, lru);
    }
}

/* ---------------------------------------------------------------- the pool */

tl_status tl_model_set_prefix_pool(tl_model *m, int64_t budget_bytes) {
    tl_clear_error();
    if (!m) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_model_set_prefix_pool: model must not be NULL");
    if (budget_bytes <= 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "prefix pool budget = %lld bytes must be > 0",
                       (long long)budget_bytes);
    tl_prefix_pool *pool = atomic_load(&m->prefix_pool);
    if (!pool) {
        tl_prefix_pool *fresh = calloc(1, sizeof *fresh);
        if (!fresh) return tl_fail(TL_ERR_NO_MEMORY, "prefix pool: out of memory");
        pthread_mutex_init(&fresh->lock, NULL);
        fresh->budget = (size_t)budget_bytes;
        tl_prefix_pool *none = NULL;
        if (atomic_compare_exchange_strong(&m->prefix_pool, &none, fresh)) return TL_OK;
        tl_prefix_pool_free(fresh); /* another first call installed one: this sets its budget */
        pool = none;
    }
    /* A new budget, kept at once: entries over it leave now (a pool that waited for its
       next new entry kept them, and served them, for good when none came). */
    pthread_mutex_lock(&pool->lock);
    pool->budget = (size_t)budget_bytes;
    evict_to_fit(pool, m);
    pthread_mutex_unlock(&pool->lock);
    return TL_OK;
}

void tl_prefix_pool_free(tl_prefix_pool *pool) {
    if (!pool) return;
    while (pool->n_entries > 0) remove_entry(pool, pool->n_entries - 1);
    free(pool->entries);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

/* Under the lock: the entry holding the longest prefix of tokens[0..n) at (loops, state_seed),
   whose length goes in *len (0, NULL: none). It is a neighbour of the prompt's place (the
   pool's order). */
static pool_entry *longest_entry(const tl_prefix_pool *pool, const int32_t *tokens, int n, int loops,
                                 uint64_t state_seed, int *len) {
    const int place = place_of(pool, loops, state_seed, tokens, n);
    pool_entry *best = NULL;
    *len = 0;
    for (int i = place - 1; i <= place; i++) {
        if (i < 0 || i >= pool->n_entries) continue;
        pool_entry *e = pool->entries[i];
        if (!same_key(e, loops, state_seed)) continue;
        const int common = tl_prefix_pool_common(e->tokens, e->n, tokens, n);
        if (common > *len) { best = e; *len = common; }
    }
    return best;
}

int tl_prefix_pool_longest(tl_prefix_pool *pool, const int32_t *tokens, int n, int loops, uint64_t state_seed) {
    if (!pool) return 0;
    int len;
    pthread_mutex_lock(&pool->lock);
    longest_entry(pool, tokens, n, loops, state_seed, &len);
    pthread_mutex_unlock(&pool->lock);
    return len;
}

int tl_prefix_pool_take(tl_prefix_pool *pool, const int32_t *tokens, int n, int loops, uint64_t state_seed,
                        tl_kv_cache *cache) {
    if (!pool || cache->length != 0) return 0;
    n = tl_kv_unwindowed_rows(cache, n); /* (a windowed session's rows past its window see fewer) */
    pthread_mutex_lock(&pool->lock);
    int best_len;
    pool_entry *best = longest_entry(pool, tokens, n, loops, state_seed, &best_len);
    if (best && best_len <= cache->capacity) {
        best->last_used = ++pool->clock;
        share_prefix(cache, best->cache, best_len);
    } else {
        best_len = 0;
    }
    pthread_mutex_unlock(&pool->lock);
    return best_len;
}

void tl_prefix_pool_offer(tl_prefix_pool *pool, const int32_t *tokens, int n, int loops, uint64_t state_seed,
                          const tl_kv_cache *cache) {
    if (!pool || n < 1 || cache->length < n) return;
    n = tl_kv_unwindowed_rows(cache, n);
    /* (a ring's row may hold a later entry: once it has written past its capacity, or where a
       speculative cycle's drafts wrapped past it and were rolled back, the length below it again) */
    for (int j = 0; j < n; j++) {
        const int row = tl_kv_row(cache, j);
        if (cache->depth[row] != loops || cache->logical[row] != j) {
            n = j;
            break;
        }
    }
    if (n < 1) return;
    pthread_mutex_lock(&pool->lock);
    /* Already held, as such or longer: an entry that extends these tokens is the first one
       not before them (those between them and it would extend them too). */
    int place = place_of(pool, loops, state_seed, tokens, n);
    if (place < pool->n_entries) {
        pool_entry *held = pool->entries[place];
        if (same_key(held, loops, state_seed) && held->n >= n &&
            tl_prefix_pool_common(held->tokens, held->n, tokens, n) == n) {
            held->last_used = ++pool->clock;
            pthread_mutex_unlock(&pool->lock);
            return;
        }
    }
    pool_entry *e = calloc(1, sizeof *e);
    bool made = false;
    if (e) {
        e->n = n;
        e->loops = loops;
        e->state_seed = state_seed;
        e->tokens = malloc((size_t)n * sizeof *e->tokens);
        if (e->tokens && tl_kv_cache_new_for(cache->model, n, 0, 1, &e->cache) == TL_OK) {
            memcpy(e->tokens, tokens, (size_t)n * sizeof *e->tokens);
            share_prefix(e->cache, cache, n);
            e->bytes = tl_kv_cache_bytes(e->cache);
            e->last_used = ++pool->clock;
            made = true;
        }
    }
    if (made && e->bytes <= pool->budget && room_for_one(pool)) {
        /* An entry these tokens extend is dropped (the longer one serves all it served). No
           entry is a prefix of another at the same key (this, and the refusal above, keep it
           so), so there is at most one, and it is just before the new entry's place: any
           entry between it and these tokens would extend it. */
        while (place > 0) {
            pool_entry *old = pool->entries[place - 1];
            if (!same_key(old, loops, state_seed) || old->n > n ||
                tl_prefix_pool_common(old->tokens, old->n, tokens, n) != old->n)
                break;
            remove_entry(pool, --place);
        }
        count_pages(pool, e->cache, true);
        evict_to_fit(pool, cache->model); /* least recently used first */
        place = place_of(pool, loops, state_seed, tokens, n);
        memmove(&pool->entries[place + 1], &pool->entries[place], (size_t)(pool->n_entries - place) * sizeof *pool->entries);
        pool->entries[place] = e;
        pool->n_entries++;
    } else {
        entry_free(e);
    }
    pthread_mutex_unlock(&pool->lock);
}

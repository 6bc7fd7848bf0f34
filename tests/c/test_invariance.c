/* test_invariance.c: bit-exact (memcmp) batch and thread invariance of the forward pass,
 * plus the KV-cache behaviours built on it: windows, rollback, chunk masks, KV sharing. */
#define _DEFAULT_SOURCE /* mkdtemp, realpath, symlink */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "quantised.h"
#include "cpu/cpu_backend.h"
#include "pool.h"
#include "forward.h"
#include "kv_cache.h"
#include "safetensors.h"
#include "tinyloop.h"

#define N_TOKENS 24
#define LONG_TOKENS 96 /* check_fused: a sequence longer than the goldens allow (32) */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static tl_model *load(const char *dir, int threads) {
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = threads;
    tl_model *m = NULL;
    if (tl_model_load(dir, &o, &m) != TL_OK) printf("load %s: %s\n", dir, tl_last_error());
    return m;
}

/* Runs tokens[0..n) through a fresh cache in chunks of the given sizes (a zero-terminated
   list, repeated as needed); writes all n rows of logits. */
static void run_chunks(const tl_model *m, const int32_t *tokens, int n, const int *sizes, int loops,
                       int window, float *logits) {
    const int vocab = tl_model_info(m)->vocab_size;
    tl_kv_cache *cache = NULL;
    tl_workspace ws = {0};
    int32_t pos[LONG_TOKENS];
    for (int i = 0; i < n; i++) pos[i] = i;
    tl_status st = tl_kv_cache_new_for(m, n, window, n > N_TOKENS ? n : N_TOKENS, &cache);
    for (int done = 0, k = 0; st == TL_OK && done < n; k++) {
        if (!sizes[k]) k = 0;
        int len = sizes[k] < n - done ? sizes[k] : n - done;
        st = tl_forward_run(m, cache, &ws, tokens + done, pos + done, len, NULL, loops, 0,
                            logits + (size_t)done * (size_t)vocab);
        done += len;
    }
    CHECK(st == TL_OK, "forward: %s", tl_last_error());
    tl_workspace_release(&ws);
    tl_kv_cache_free(cache);
}

static void check_config(const char *root, const char *name) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", root, name);
    tl_model *models[3] = {load(dir, 1), load(dir, 2), load(dir, 3)};
    CHECK(models[0] && models[1] && models[2], "%s: load", name);
    if (!models[0] || !models[1] || !models[2]) goto done;
    const struct tl_model_info *info = tl_model_info(models[0]);
    const int vocab = info->vocab_size, loops = info->max_loops > 3 ? 3 : info->max_loops;
    const size_t bytes = (size_t)N_TOKENS * (size_t)vocab * sizeof(float);
    float *want = malloc(bytes), *got = malloc(bytes);
    int32_t tokens[N_TOKENS];
    for (int i = 0; i < N_TOKENS; i++) tokens[i] = (int32_t)(next_u32() % (uint32_t)vocab);

    const int whole[] = {N_TOKENS, 0}, single[] = {1, 0};
    run_chunks(models[0], tokens, N_TOKENS, whole, loops, 0, want);
    for (int t = 0; t < 3; t++) {
        run_chunks(models[t], tokens, N_TOKENS, whole, loops, 0, got);
        CHECK(memcmp(want, got, bytes) == 0, "%s: whole prefill, %d threads vs 1", name, t + 1);
        run_chunks(models[t], tokens, N_TOKENS, single, loops, 0, got);
        CHECK(memcmp(want, got, bytes) == 0, "%s: one token at a time, %d threads", name, t + 1);
        for (int trial = 0; trial < 4; trial++) {
            int sizes[N_TOKENS + 1] = {0};
            for (int i = 0; i < N_TOKENS; i++) sizes[i] = 1 + (int)(next_u32() % 7);
            run_chunks(models[t], tokens, N_TOKENS, sizes, loops, 0, got);
            CHECK(memcmp(want, got, bytes) == 0, "%s: random chunks (first %d,%d,%d), %d threads",
                  name, sizes[0], sizes[1], sizes[2], t + 1);
        }
    }
    /* tl_score is the same forward. */
    CHECK(tl_score(models[1], tokens, N_TOKENS, loops, got) == TL_OK && memcmp(want, got, bytes) == 0,
          "%s: tl_score differs from the chunked forward", name);

    /* A window wider than the sequence changes nothing; a narrow one is chunking
       invariant and really limits attention. */
    const int fives[] = {5, 0};
    run_chunks(models[1], tokens, N_TOKENS, fives, loops, N_TOKENS + 3, got);
    CHECK(memcmp(want, got, bytes) == 0, "%s: wide window differs from unbounded", name);
    float *windowed = malloc(bytes);
    run_chunks(models[0], tokens, N_TOKENS, single, loops, 6, windowed);
    run_chunks(models[2], tokens, N_TOKENS, fives, loops, 6, got);
    CHECK(memcmp(windowed, got, bytes) == 0, "%s: window 6 one-by-one vs chunks of 5", name);
    CHECK(memcmp(windowed, want, (size_t)6 * vocab * sizeof(float)) == 0,
          "%s: window 6 changed rows inside the window", name);
    CHECK(memcmp(windowed, want, bytes) != 0, "%s: window 6 had no effect on 24 tokens", name);
    free(windowed);

    /* Rollback: append 5 wrong tokens after 16, truncate, continue: same as never appended. */
    {
        tl_kv_cache *cache = NULL;
        tl_workspace ws = {0};
        int32_t pos[N_TOKENS], wrong[5] = {1, 2, 3, 4, 5};
        for (int i = 0; i < N_TOKENS; i++) pos[i] = i;
        tl_kv_cache_new_for(models[1], N_TOKENS, 0, N_TOKENS, &cache);
        tl_forward_run(models[1], cache, &ws, tokens, pos, 16, NULL, loops, 16, NULL);
        tl_forward_run(models[1], cache, &ws, wrong, pos + 16, 5, NULL, loops, 0, got);
        CHECK(tl_kv_truncate(cache, 16) == TL_OK, "truncate");
        tl_forward_run(models[1], cache, &ws, tokens + 16, pos + 16, 8, NULL, loops, 0, got);
        CHECK(memcmp(want + (size_t)16 * vocab, got, (size_t)8 * vocab * sizeof(float)) == 0,
              "%s: rollback then continue differs", name);
        CHECK(tl_kv_truncate(cache, 25) == TL_ERR_INVALID_ARGUMENT, "truncate beyond length must fail");
        /* loops past max_loops have no cache slot: refused, the cache untouched */
        CHECK(tl_forward_run(models[1], cache, &ws, tokens + 16, pos + 16, 1, NULL, info->max_loops + 1, 0, got) ==
                      TL_ERR_INVALID_ARGUMENT && cache->length == 24,
              "%s: a forward deeper than max_loops must fail", name);
        tl_forward_part deep = {.cache = cache, .n = 1, .loops = info->max_loops + 1};
        const bool want_logits = true;
        CHECK(tl_forward_batch(models[1], &ws, &deep, 1, tokens + 16, pos + 16, &want_logits, got) ==
                      TL_ERR_INVALID_ARGUMENT && cache->length == 24,
              "%s: a batched forward deeper than max_loops must fail", name);
        tl_workspace_release(&ws);
        tl_kv_cache_free(cache);
    }

    /* Tree mask: prefix of 10, then a chunk {a, b, c} with b and c both children of a
       (positions 10, 11, 11). Row c must equal the sequential run of prefix + a + c. */
    {
        tl_kv_cache *cache = NULL;
        tl_workspace ws = {0};
        int32_t pos[N_TOKENS], seq[12], chunk[3] = {tokens[10], tokens[11], tokens[12]};
        int32_t chunk_pos[3] = {10, 11, 11};
        const uint8_t mask[9] = {1, 0, 0, /* a sees itself */ 1, 1, 0, /* b: a, b */ 1, 0, 1 /* c: a, c */};
        for (int i = 0; i < N_TOKENS; i++) pos[i] = i;
        memcpy(seq, tokens, 11 * sizeof *seq);
        seq[11] = tokens[12];
        float *tree = malloc((size_t)3 * vocab * sizeof(float));
        const int all[] = {12, 0};
        run_chunks(models[0], seq, 12, all, loops, 0, got);
        tl_kv_cache_new_for(models[2], N_TOKENS, 0, N_TOKENS, &cache);
        tl_forward_run(models[2], cache, &ws, tokens, pos, 10, NULL, loops, 10, NULL);
        tl_forward_run(models[2], cache, &ws, chunk, chunk_pos, 3, mask, loops, 0, tree);
        CHECK(memcmp(tree, want + (size_t)10 * vocab, (size_t)2 * vocab * sizeof(float)) == 0,
              "%s: tree rows a, b differ from the sequential run", name);
        CHECK(memcmp(tree + (size_t)2 * vocab, got + (size_t)11 * vocab, (size_t)vocab * sizeof(float)) == 0,
              "%s: tree row c differs from the sequential run of prefix + a + c", name);
        /* Compacting c into b's entry, then continuing, equals the sequential cache. */
        tl_kv_move(cache, 12, 11);
        tl_kv_truncate(cache, 12);
        int32_t next = tokens[13], next_pos = 12;
        float *after = malloc((size_t)vocab * sizeof(float));
        tl_forward_run(models[2], cache, &ws, &next, &next_pos, 1, NULL, loops, 0, after);
        int32_t seq13[13];
        memcpy(seq13, seq, sizeof seq);
        seq13[12] = next;
        const int all13[] = {13, 0};
        float *ref13 = malloc((size_t)13 * vocab * sizeof(float));
        run_chunks(models[0], seq13, 13, all13, loops, 0, ref13);
        CHECK(memcmp(after, ref13 + (size_t)12 * vocab, (size_t)vocab * sizeof(float)) == 0,
              "%s: continuing after tree compaction differs", name);
        free(ref13);
        free(after);
        free(tree);
        tl_workspace_release(&ws);
        tl_kv_cache_free(cache);
    }
    free(want);
    free(got);
done:
    for (int t = 0; t < 3; t++) tl_model_free(models[t]);
}

/* KV sharing (SPEC §2): a prefix computed at depth 2 and read at depth 4 behaves exactly
   as if its depth-2 K/V had been copied into the loop-3 and loop-4 slots. */
static void check_kv_sharing(const char *root, const char *name) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", root, name);
    tl_model *m = load(dir, 2);
    if (!m) { CHECK(0, "load %s", name); return; }
    const tl_config *c = &m->cfg;
    const int vocab = c->vocab_size;
    int32_t tokens[11], pos[11];
    for (int i = 0; i < 11; i++) { tokens[i] = (int32_t)(next_u32() % (uint32_t)vocab); pos[i] = i; }
    float *shared = malloc((size_t)vocab * sizeof(float)), *copied = malloc((size_t)vocab * sizeof(float)),
          *deep = malloc((size_t)vocab * sizeof(float));
    tl_workspace ws = {0};
    tl_kv_cache *a = NULL, *b = NULL, *d = NULL;
    tl_kv_cache_new_for(m, 11, 0, 11, &a);
    tl_kv_cache_new_for(m, 11, 0, 11, &b);
    tl_kv_cache_new_for(m, 11, 0, 11, &d);
    tl_forward_run(m, a, &ws, tokens, pos, 10, NULL, 2, 10, NULL);
    tl_forward_run(m, b, &ws, tokens, pos, 10, NULL, 2, 10, NULL);
    tl_forward_run(m, d, &ws, tokens, pos, 10, NULL, 4, 10, NULL);
    for (int j = 0; j < 10; j++) {
        CHECK(a->depth[j] == 2, "depth recorded %d", a->depth[j]);
        for (int loop = 3; loop <= 4; loop++)
            for (int i = 0; i < c->n_block; i++) {
                int from = c->n_prelude + 1 * c->n_block + i, to = c->n_prelude + (loop - 1) * c->n_block + i;
                void *k_to, *v_to;
                CHECK(tl_kv_writable(b, to, j, &k_to, &v_to), "page");
                /* K/V rows are backend memory (device memory under TINYLOOP_BACKEND=cuda):
                   the backend copies them. */
                if (m->kv_type == TL_KV_F32) {
                    m->backend->copy(m, k_to, tl_kv_k(b, from, j), (size_t)b->kv_dim);
                    m->backend->copy(m, v_to, tl_kv_v(b, from, j), (size_t)b->kv_dim);
                } else { /* f16 KV: the CPU backend's host memory */
                    memcpy(k_to, tl_kv_k(b, from, j), b->row_bytes);
                    memcpy(v_to, tl_kv_v(b, from, j), b->row_bytes);
                }
            }
        b->depth[j] = 4;
    }
    tl_forward_run(m, a, &ws, tokens + 10, pos + 10, 1, NULL, 4, 0, shared);
    tl_forward_run(m, b, &ws, tokens + 10, pos + 10, 1, NULL, 4, 0, copied);
    tl_forward_run(m, d, &ws, tokens + 10, pos + 10, 1, NULL, 4, 0, deep);
    CHECK(memcmp(shared, copied, (size_t)vocab * sizeof(float)) == 0,
          "%s: shared KV read differs from explicitly copied slots", name);
    CHECK(memcmp(shared, deep, (size_t)vocab * sizeof(float)) != 0,
          "%s: a depth-2 prefix gave the same logits as a depth-4 one (sharing untested)", name);
    free(shared); free(copied); free(deep);
    tl_workspace_release(&ws);
    tl_kv_cache_free(a); tl_kv_cache_free(b); tl_kv_cache_free(d);
    tl_model_free(m);
}

/* Speculative verification resumed from the draft's kept states (forward.h: tl_kept_states):
   six rows (a chain, or a tree under an ancestor mask) drafted level by level at depth
   `draft` and kept, the cache rolled back, then resumed to depth `loops`, give the same
   logits (memcmp) and leave the same K/V in every slot they reach as one forward from
   scratch; and fewer kept rows than asked for is an error. */
static void check_kept_resume(const char *root, const char *name, bool tree, int draft, int loops) {
    char dir[8400];
    snprintf(dir, sizeof dir, "%s/%s", root, name);
    tl_model *m = load(dir, 2);
    if (!m) { CHECK(0, "load %s", name); return; }
    const tl_config *c = &m->cfg;
    const int vocab = c->vocab_size, base = 10, n = 6;
    /* node: parent (-1 for the root); levels {0}, {1, 2}, {3, 4, 5} (a chain: one per level) */
    const int chain_parent[6] = {-1, 0, 1, 2, 3, 4}, tree_parent[6] = {-1, 0, 0, 1, 1, 2};
    const int *parent = tree ? tree_parent : chain_parent;
    const int chain_levels[] = {0, 1, 2, 3, 4, 5, 6}, tree_levels[] = {0, 1, 3, 6};
    const int *level = tree ? tree_levels : chain_levels, n_levels = tree ? 3 : 6;
    int32_t tokens[16], pos[16];
    uint8_t full[36], part[36];
    for (int i = 0; i < 16; i++) { tokens[i] = (int32_t)(next_u32() % (uint32_t)vocab); pos[i] = i; }
    for (int i = 0; i < n; i++) {
        int depth = 0;
        for (int x = parent[i]; x >= 0; x = parent[x]) depth++;
        pos[base + i] = base + depth;
        for (int j = 0; j < n; j++) {
            bool seen = false;
            for (int x = i; x >= 0; x = parent[x]) seen = seen || x == j;
            full[i * n + j] = seen;
        }
    }
    float *want = malloc((size_t)n * (size_t)vocab * sizeof(float)), *got = malloc((size_t)n * (size_t)vocab * sizeof(float));
    tl_workspace ws = {0};
    ws.state_seed = c->state_init == TL_STATE_TRUNCATED_NORMAL ? 0x1234567ull : 0;
    tl_kept_states kept = {0};
    tl_kv_cache *a = NULL, *b = NULL;
    tl_kv_cache_new_for(m, base + n, 0, base + n, &a);
    tl_kv_cache_new_for(m, base + n, 0, base + n, &b);
    CHECK(tl_kept_states_reserve(&kept, m, n) == TL_OK, "reserve");
    tl_forward_run(m, a, &ws, tokens, pos, base, NULL, loops, base, NULL);
    tl_forward_run(m, b, &ws, tokens, pos, base, NULL, loops, base, NULL);
    tl_forward_run(m, a, &ws, tokens + base, pos + base, n, tree ? full : NULL, loops, 0, want);

    /* The draft: each level sees the prefix and its ancestors; the last level only loops. */
    for (int l = 0; l < n_levels; l++) {
        const int first = level[l], end = level[l + 1], rows = end - first;
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < end; j++) part[i * end + j] = full[(first + i) * n + j];
        tl_forward f;
        tl_status st = tl_forward_begin_masked(&f, m, b, &ws, tokens + base + first, pos + base + first, rows,
                                               tree ? part : NULL, base);
        CHECK(st == TL_OK, "draft level %d: %s", l, tl_last_error());
        if (st != TL_OK) break;
        for (int i = 0; i < draft; i++) tl_forward_loop(&f);
        tl_forward_keep(&f, 0, rows, &kept, first);
        if (l + 1 < n_levels) tl_forward_end(&f, 0, got);
        else tl_forward_commit(&f);
    }
    CHECK(tl_kv_truncate(b, base) == TL_OK, "rollback");
    tl_forward f;
    CHECK_ERROR(tl_forward_begin_kept(&f, m, b, &ws, tokens + base, pos + base, n + 1, NULL, &kept, draft),
                TL_ERR_INVALID_ARGUMENT, "7 rows to resume, 6 kept");
    tl_status st = tl_forward_begin_kept(&f, m, b, &ws, tokens + base, pos + base, n, tree ? full : NULL, &kept, draft);
    CHECK(st == TL_OK, "resume: %s", tl_last_error());
    if (st == TL_OK) {
        for (int i = draft; i < loops; i++) tl_forward_loop(&f);
        tl_forward_end(&f, 0, got);
        CHECK(memcmp(want, got, (size_t)n * (size_t)vocab * sizeof(float)) == 0,
              "%s %s d%d: resumed verification logits differ from a forward from scratch", name,
              tree ? "tree" : "chain", draft);
        /* Every slot the rows reach: prelude, loops 1..loops, coda. The rows are read on
           the host: only where the backend's memory is host memory (the CPU's; a GPU run,
           TINYLOOP_BACKEND=cuda, checks the logits above). */
        const bool host_memory = strcmp(m->backend->name, "cpu") == 0;
        int differ = 0, compared = 0;
        for (int slot = 0; host_memory && slot < a->n_slots; slot++) {
            const bool block = slot >= c->n_prelude && slot < c->n_prelude + c->n_block * c->max_loops;
            if (block && (slot - c->n_prelude) / c->n_block >= loops) continue;
            for (int j = base; j < base + n; j++) {
                const void *ka = tl_kv_k(a, slot, j), *kb = tl_kv_k(b, slot, j);
                const void *va = tl_kv_v(a, slot, j), *vb = tl_kv_v(b, slot, j);
                const size_t bytes = a->row_bytes;
                differ += !ka || !kb || memcmp(ka, kb, bytes) != 0 || memcmp(va, vb, bytes) != 0;
                compared++;
            }
        }
        CHECK(differ == 0 && (compared > 0 || !host_memory), "%s %s d%d: %d of %d resumed K/V entries differ", name,
              tree ? "tree" : "chain", draft, differ, compared);
    }
    free(want); free(got);
    tl_kept_states_release(&kept);
    tl_workspace_release(&ws);
    tl_kv_cache_free(a); tl_kv_cache_free(b);
    tl_model_free(m);
}

/* The config.json at `from` written to `to` (may be the same file) with its number `key`
   set to `value`: false when it could not be. */
static bool edit_config_number(const char *from, const char *to, const char *key, int value) {
    char config[8192], quoted[64];
    FILE *f = fopen(from, "rb");
    const size_t len = f ? fread(config, 1, sizeof config - 1, f) : 0;
    if (f) fclose(f);
    config[len] = '\0';
    snprintf(quoted, sizeof quoted, "\"%s\"", key);
    char *at = strstr(config, quoted);
    if (len == 0 || !at || !(f = fopen(to, "wb"))) return false;
    char *number = strchr(at, ':') + 1, *end = number;
    while (*end == ' ' || (*end >= '0' && *end <= '9')) end++;
    fprintf(f, "%.*s %d%s", (int)(number - config), config, value, end);
    return fclose(f) == 0;
}

/* A copy of root/name in a new temporary directory `dir` (its config with another
   max_seq_len, the weights linked): false when it could not be made. remove_copy undoes it. */
static bool copy_with_max_seq_len(const char *root, const char *name, int max_seq_len, char dir[64]) {
    char src[4200], path[4300], target[4300], resolved[PATH_MAX];
    strcpy(dir, "/tmp/tinyloop-test-copy-XXXXXX");
    if (!mkdtemp(dir)) return false;
    snprintf(src, sizeof src, "%s/%s", root, name);
    snprintf(target, sizeof target, "%s/config.json", src);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!edit_config_number(target, path, "max_seq_len", max_seq_len)) return false;
    snprintf(target, sizeof target, "%s/model.safetensors", src);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    return realpath(target, resolved) && symlink(resolved, path) == 0;
}

static void remove_copy(const char *dir) {
    char path[4300];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
}

/* The CPU backend keeps RoPE's cos/sin in a table unless the table would be large (long
   contexts), when it computes them per call with the same expression: a copy of `name`
   whose max_seq_len is too long for the table must give the same logits, bit for bit. */
static void check_rope_table(const char *root, const char *name) {
    char dir[64], src[4200];
    snprintf(src, sizeof src, "%s/%s", root, name);
    const bool made = copy_with_max_seq_len(root, name, 300000, dir);
    CHECK(made, "%s: a copy for the RoPE table check", name);
    tl_model *table = load(src, 2), *computed = made ? load(dir, 2) : NULL;
    CHECK(table && computed, "%s: load both", name);
    if (table && computed) {
        const int vocab = tl_model_info(table)->vocab_size, sizes[] = {5, 1, 0};
        int32_t tokens[N_TOKENS];
        for (int i = 0; i < N_TOKENS; i++) tokens[i] = (int32_t)(next_u32() % (uint32_t)vocab);
        float *want = malloc((size_t)N_TOKENS * (size_t)vocab * sizeof(float));
        float *got = malloc((size_t)N_TOKENS * (size_t)vocab * sizeof(float));
        if (want && got) {
            run_chunks(table, tokens, N_TOKENS, sizes, 3, 0, want);
            run_chunks(computed, tokens, N_TOKENS, sizes, 3, 0, got);
            CHECK(memcmp(want, got, (size_t)N_TOKENS * (size_t)vocab * sizeof(float)) == 0,
                  "%s: RoPE from the table and computed per call differ", name);
        }
        free(want);
        free(got);
    }
    tl_model_free(table);
    tl_model_free(computed);
    if (made) remove_copy(dir);
}

/* The CPU backend runs a decode step's q/k/v, RoPE, cache writes, attention and output
   projection as one pass (backend.h qkv_attention) when every chunk is a single row, and
   the KV heads split evenly into whole panels over the threads; otherwise as the separate
   operations. Both must give the same logits, bit for bit. A copy of `name` with room for
   LONG_TOKENS positions runs them as one prefill and in chunks of 7 (separate) and one
   token at a time (fused wherever the heads allow), at 1, 2 and 4 threads. */
static void check_fused(const char *root, const char *name) {
    char dir[64];
    const bool made = copy_with_max_seq_len(root, name, LONG_TOKENS, dir);
    CHECK(made, "%s: a copy for the fused attention check", name);
    if (!made) return;
    const int threads[] = {1, 2, 4}, whole[] = {LONG_TOKENS, 0}, single[] = {1, 0}, sevens[] = {7, 0};
    int loops = 0;
    int32_t tokens[LONG_TOKENS];
    float *want = NULL, *got = NULL;
    size_t bytes = 0;
    for (int t = 0; t < 3; t++) {
        tl_model *m = load(dir, threads[t]);
        CHECK(m != NULL, "%s: load the copy at %d threads", name, threads[t]);
        if (!m) continue;
        if (!want) { /* the reference: one prefill at 1 thread, the separate operations */
            const int vocab = tl_model_info(m)->vocab_size, max_loops = tl_model_info(m)->max_loops;
            loops = max_loops > 3 ? 3 : max_loops;
            for (int i = 0; i < LONG_TOKENS; i++) tokens[i] = (int32_t)(next_u32() % (uint32_t)vocab);
            bytes = (size_t)LONG_TOKENS * (size_t)vocab * sizeof(float);
            want = malloc(bytes);
            got = malloc(bytes);
            if (!want || !got) {
                tl_model_free(m);
                break;
            }
            run_chunks(m, tokens, LONG_TOKENS, whole, loops, 0, want);
        }
        run_chunks(m, tokens, LONG_TOKENS, whole, loops, 0, got);
        CHECK(memcmp(want, got, bytes) == 0, "%s: one prefill at %d threads vs 1", name, threads[t]);
        run_chunks(m, tokens, LONG_TOKENS, single, loops, 0, got);
        CHECK(memcmp(want, got, bytes) == 0, "%s: one token at a time (fused) at %d threads vs one prefill", name,
              threads[t]);
        run_chunks(m, tokens, LONG_TOKENS, sevens, loops, 0, got);
        CHECK(memcmp(want, got, bytes) == 0, "%s: chunks of 7 at %d threads vs one prefill", name,
              threads[t]);
        if (threads[t] > 1 && !strcmp(m->backend->name, "cpu")) {
            /* Threads of unequal speed (pool.h): the pool's shares at their bounds cut the
               small products and the KV heads unevenly, thread 0 taking the most. */
            float skewed[4];
            for (int i = 0; i < threads[t]; i++) skewed[i] = i ? 1.0f : 3.0f;
            tl_pool_set_shares(tl_cpu_pool(m), skewed);
            run_chunks(m, tokens, LONG_TOKENS, single, loops, 0, got);
            CHECK(memcmp(want, got, bytes) == 0, "%s: one token at a time, %d threads of skewed shares", name,
                  threads[t]);
            run_chunks(m, tokens, LONG_TOKENS, sevens, loops, 0, got);
            CHECK(memcmp(want, got, bytes) == 0, "%s: chunks of 7, %d threads of skewed shares", name, threads[t]);
            tl_pool_set_shares(tl_cpu_pool(m), NULL);
        }
        /* The separate operations only, through a copy of the backend without the fused
           attention and the phased products (forward.c then calls matmul_group, matmul,
           rope, kv_write and attention): what the fused and phased jobs must give. */
        tl_backend separate = *m->backend;
        separate.qkv_attention = NULL;
        separate.matmul_then = NULL;
        const tl_backend *own = m->backend;
        m->backend = &separate;
        run_chunks(m, tokens, LONG_TOKENS, single, loops, 0, got);
        CHECK(memcmp(want, got, bytes) == 0, "%s: one token at a time, separate operations only, %d threads", name,
              threads[t]);
        m->backend = own;
        tl_model_free(m);
    }
    free(want);
    free(got);
    remove_copy(dir);
}

/* The fused pass at 2 threads gives each task one KV head and the query heads that read
   it; no golden model has more query heads than KV heads and KV heads that split into whole
   panels over 2 threads. A copy of f16_concat_residual_gqa with 4 query heads of 16 lanes
   over `kv_heads` KV heads (2: its own, k and v get 16 more rows each; 4: 48 more, so that
   skewed shares split the heads 3 + 1; the rows are the layer's q's) has both; check_fused
   then runs it fused at 1 and 2 threads, separately at 4. `quantise` TL_Q8 or TL_Q4 runs a
   quantised copy of it (TL_F32: as it is). */
static void check_fused_gqa(const char *root, int kv_heads, tl_dtype quantise) {
    char dir[64], path[4300];
    const bool made = copy_with_max_seq_len(root, "f16_concat_residual_gqa", LONG_TOKENS, dir);
    CHECK(made, "a copy for the fused GQA check");
    if (!made) return;
    snprintf(path, sizeof path, "%s/config.json", dir);
    bool ok = edit_config_number(path, path, "n_heads", 4) && edit_config_number(path, path, "n_kv_heads", kv_heads);
    FILE *f = NULL;
    /* The weights: the link replaced by a file, every tensor as it was but k and v. */
    tl_st_file st = {0};
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ok = ok && tl_st_open(path, &st) == TL_OK && unlink(path) == 0 && (f = fopen(path, "wb"));
    if (ok) {
        char header[8192];
        size_t at = 0, offset = 0, wider[64] = {0};
        int listed = 0;
        at += (size_t)snprintf(header + at, sizeof header - at, "{");
        for (int i = 0; i < st.n_tensors && i < 64 && at < sizeof header - 512; i++, listed++) {
            const tl_st_tensor *t = &st.tensors[i];
            const size_t name_len = strlen(t->name);
            const bool kv = name_len > 14 && (!strcmp(t->name + name_len - 14, ".attn.k.weight") ||
                                              !strcmp(t->name + name_len - 14, ".attn.v.weight"));
            wider[i] = kv ? t->nbytes * (size_t)(kv_heads - 1) : 0; /* 16 rows -> kv_heads x 16 */
            at += (size_t)snprintf(header + at, sizeof header - at,
                                   "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld", i ? "," : "", t->name,
                                   tl_st_dtype_name(t->dtype), (long long)t->shape[0] * (kv ? kv_heads : 1));
            for (int d = 1; d < t->ndim; d++)
                at += (size_t)snprintf(header + at, sizeof header - at, ",%lld", (long long)t->shape[d]);
            at += (size_t)snprintf(header + at, sizeof header - at, "],\"data_offsets\":[%zu,%zu]}", offset,
                                   offset + t->nbytes + wider[i]);
            offset += t->nbytes + wider[i];
        }
        at += (size_t)snprintf(header + at, sizeof header - at, "}%*s", (int)((8 - (at + 1) % 8) % 8), "");
        ok = at < sizeof header && listed == st.n_tensors; /* padded: the data stays 8-aligned */
        const uint64_t header_len = at; /* little-endian, as the format says (and the hosts are) */
        ok = ok && fwrite(&header_len, 8, 1, f) == 1 && fwrite(header, 1, at, f) == at;
        for (int i = 0; ok && i < st.n_tensors; i++) {
            const tl_st_tensor *t = &st.tensors[i];
            ok = fwrite(t->data, 1, t->nbytes, f) == t->nbytes;
            if (!ok || !wider[i]) continue;
            /* the added rows: the layer's q rows, from its first row (v) or up to its last (k) */
            char q_name[256];
            snprintf(q_name, sizeof q_name, "%.*sq.weight", (int)strlen(t->name) - 8, t->name);
            const tl_st_tensor *q = tl_st_find(&st, q_name);
            const bool is_k = t->name[strlen(t->name) - 8] == 'k';
            ok = q && q->nbytes >= wider[i] &&
                 fwrite(q->data + (is_k ? q->nbytes - wider[i] : 0), 1, wider[i], f) == wider[i];
        }
        ok = fclose(f) == 0 && ok;
    }
    tl_st_close(&st);
    CHECK(ok, "the GQA copy's config and weights");
    const int failed = checks_failed;
    /* (q8/q4: the copy quantised; at 2 threads over 2 KV heads each task's query heads are
       32 columns of att, one q8/q4 group, which the tasks quantise for the output projection) */
    const char *copy_root = quantise == TL_F32 ? "/tmp" : ok ? quantised_copy("/tmp", dir + strlen("/tmp/"), quantise) : NULL;
    CHECK(!ok || copy_root, "quantise the GQA copy");
    if (ok && copy_root) check_fused(copy_root, dir + strlen("/tmp/"));
    CHECK(checks_failed == failed, "the failures above: the copy of f16_concat_residual_gqa with 4 query heads over %d (%s)",
          kv_heads, quantise == TL_Q8 ? "q8" : quantise == TL_Q4 ? "q4" : "as it is");
    remove_copy(dir);
}

/* A matmul group's split into tasks depends on the thread count (one task per thread
   across a small group's products, "spanning", or tasks per product): every column of
   every product must come out the same whatever the split. Products with rows not a
   multiple of the panel, SwiGLU pairs first, after another product and beside two more,
   GELU epilogues, every float and quantised dtype, row-major (mapped) and packed, 1 to 8
   threads against 1. The packing (tasks of 64 panels on the pool) is checked too: float
   panels element by element against the layout, q8/q4 by their products, which equal the
   row-major ones bit for bit (test_isa). */
static void check_group_split(const char *dir) {
    enum { K = 256, MAX_N = 3, N_MATRICES = 14, MAX_ROWS = 1050 };
    const struct { int rows; tl_dtype dt; } specs[N_MATRICES] = {
        {200, TL_F32}, {72, TL_F16}, {72, TL_BF16}, {104, TL_F32}, {104, TL_F32}, {40, TL_F16},
        {200, TL_Q8}, {72, TL_Q8}, {72, TL_Q4}, {104, TL_Q8}, {104, TL_Q8}, {MAX_ROWS, TL_F16}, {MAX_ROWS, TL_Q8},
        {MAX_ROWS, TL_Q4}};
    /* Each group: up to 4 (matrix, gelu, swiglu, bias) entries, matrix -1 ends it. */
    const struct { int w; bool gelu, swiglu, bias; } groups[][4] = {
        {{0, false, false, true}, {1, false, false, false}, {2, false, false, true}, {-1, false, false, false}},
        {{3, false, true, false}, {4, false, false, false}, {-1, false, false, false}},
        {{5, false, false, false}, {3, false, true, true}, {4, false, false, true}, {-1, false, false, false}},
        {{0, true, false, false}, {5, true, false, true}, {-1, false, false, false}},
        {{6, false, false, true}, {7, false, false, false}, {8, false, false, false}, {-1, false, false, false}},
        {{9, false, true, false}, {10, false, false, false}, {8, true, false, false}, {-1, false, false, false}},
        {{3, false, true, false}, {4, false, false, false}, {0, false, false, false}, {1, false, false, false}},
        {{11, false, false, true}, {5, false, false, false}, {-1, false, false, false}},
        {{12, false, false, true}, {7, false, false, false}, {-1, false, false, false}},
        {{8, false, false, false}, {13, false, false, true}, {-1, false, false, false}},
    };
    const bool quantised_group[] = {false, false, false, false, true, true, false, false, true, true};
    enum { N_GROUPS = sizeof groups / sizeof groups[0] };
    static uint8_t data[N_MATRICES][MAX_ROWS * K * 4];
    static uint16_t scales[N_MATRICES][MAX_ROWS * K / TL_QGROUP];
    static float x[MAX_N * K], bias[MAX_ROWS];
    tl_matrix rowmajor[N_MATRICES];
    for (int i = 0; i < N_MATRICES; i++) {
        const tl_dtype dt = specs[i].dt;
        const size_t count = (size_t)specs[i].rows * K;
        for (size_t e = 0; e < count; e++) {
            const uint32_t r = next_u32();
            if (dt == TL_F32) ((float *)data[i])[e] = (float)(r % 2001) / 1000.0f - 1.0f;
            else if (dt == TL_F16) ((uint16_t *)data[i])[e] = (uint16_t)((r & 0x8000u) | (10u + r % 7u) << 10 | (r >> 16 & 0x3ffu));
            else if (dt == TL_BF16) ((uint16_t *)data[i])[e] = (uint16_t)((r & 0x8000u) | (120u + r % 8u) << 7 | (r >> 16 & 0x7fu));
            else if (dt == TL_Q8) ((int8_t *)data[i])[e] = (int8_t)((int)(r % 255u) - 127);
            else if (e < count / 2) data[i][e] = (uint8_t)r;
        }
        for (size_t g = 0; g < count / TL_QGROUP; g++)
            scales[i][g] = (uint16_t)((5u + next_u32() % 4u) << 10 | (next_u32() & 0x3ffu));
        rowmajor[i] = (tl_matrix){data[i], tl_dtype_quantised(dt) ? scales[i] : NULL, dt, specs[i].rows, K, 0};
    }
    for (int i = 0; i < MAX_N * K; i++) x[i] = (float)(next_u32() % 2001) / 1000.0f - 1.0f;
    for (int i = 0; i < MAX_ROWS; i++) bias[i] = (float)(next_u32() % 201) / 100.0f - 1.0f;

    size_t offsets[N_GROUPS][4], total = 0;
    for (int g = 0; g < N_GROUPS; g++)
        for (int p = 0; p < 4 && groups[g][p].w >= 0; p++) {
            offsets[g][p] = total;
            total += (size_t)(1 + MAX_N) * (size_t)specs[groups[g][p].w].rows; /* n = 1, then n = 3 */
        }
    float *want[2] = {malloc(total * sizeof(float)), malloc(total * sizeof(float))};
    float *got = malloc(total * sizeof(float));
    CHECK(want[0] && want[1] && got, "group split: memory");
    for (int packed = 0; packed < 2 && want[0] && want[1] && got; packed++)
        for (int threads = 1; threads <= 8; threads++) {
            /* Mapped, so the model's own matrices stay out of the way of the packed ones. */
            tl_load_options o;
            tl_load_options_init(&o);
            o.n_threads = threads;
            o.mmap_weights = 1;
            o.backend = TL_BACKEND_CPU; /* the CPU kernels' own split (also under TINYLOOP_BACKEND=cuda) */
            tl_model *m = NULL;
            if (tl_model_load(dir, &o, &m) != TL_OK) { CHECK(0, "load %s: %s", dir, tl_last_error()); break; }
            tl_matrix ws[N_MATRICES], *ptrs[N_MATRICES];
            for (int i = 0; i < N_MATRICES; i++) ws[i] = rowmajor[i], ptrs[i] = &ws[i];
            if (packed) {
                CHECK(tl_cpu_upload_weights(m, ptrs, N_MATRICES, NULL, NULL, 0, false) == TL_OK && ws[0].packed,
                      "group split: pack: %s", tl_last_error());
                for (int i = 0; i < N_MATRICES; i++) {
                    if (tl_dtype_quantised(specs[i].dt) || !ws[i].packed) continue;
                    const size_t elem = specs[i].dt == TL_F32 ? 4 : 2, panels = ((size_t)specs[i].rows + TL_PANEL - 1) / TL_PANEL;
                    size_t wrong = 0;
                    for (size_t r = 0; r < panels * TL_PANEL; r++)
                        for (size_t c = 0; c < K; c++) {
                            const uint8_t *at = (const uint8_t *)ws[i].data + ((r / TL_PANEL) * K * TL_PANEL + c * TL_PANEL + r % TL_PANEL) * elem;
                            const uint8_t zero[4] = {0};
                            wrong += memcmp(at, r < (size_t)specs[i].rows ? data[i] + (r * K + c) * elem : zero, elem) != 0;
                        }
                    CHECK(wrong == 0, "matrix %d: %zu packed elements out of place (%d threads)", i, wrong, threads);
                }
            }
            float *out = threads == 1 ? want[packed] : got;
            for (size_t e = 0; e < total; e++) out[e] = NAN;
            for (int g = 0; g < N_GROUPS; g++)
                for (int n = 1; n <= MAX_N; n += 2) {
                    tl_matmul_out outs[4];
                    int count = 0;
                    for (; count < 4 && groups[g][count].w >= 0; count++)
                        outs[count] = (tl_matmul_out){&ws[groups[g][count].w], groups[g][count].bias ? bias : NULL,
                                                      out + offsets[g][count] + (n == 1 ? 0 : (size_t)specs[groups[g][count].w].rows),
                                                      groups[g][count].gelu, groups[g][count].swiglu};
                    tl_cpu_matmul_group(m, x, n, outs, count);
                }
            if (threads == 1) {
                size_t bad = 0;
                for (size_t e = 0; e < total; e++) bad += !isfinite(out[e]);
                CHECK(bad == 0, "group split (%s): %zu outputs not computed or not finite", packed ? "packed" : "mapped", bad);
                for (int g = 0; packed && g < N_GROUPS; g++)
                    for (int p = 0; quantised_group[g] && p < 4 && groups[g][p].w >= 0; p++) {
                        const size_t len = (size_t)(1 + MAX_N) * (size_t)specs[groups[g][p].w].rows;
                        CHECK(memcmp(want[0] + offsets[g][p], want[1] + offsets[g][p], len * sizeof(float)) == 0,
                              "group %d product %d: packed differs from row-major", g, p);
                    }
            } else {
                for (int g = 0; g < N_GROUPS; g++)
                    for (int p = 0; p < 4 && groups[g][p].w >= 0; p++) {
                        const size_t len = (size_t)(1 + MAX_N) * (size_t)specs[groups[g][p].w].rows;
                        CHECK(memcmp(want[packed] + offsets[g][p], got + offsets[g][p], len * sizeof(float)) == 0,
                              "group %d product %d (%s): %d threads differ from 1", g, p, packed ? "packed" : "mapped", threads);
                    }
            }
            tl_model_free(m);
        }
    free(want[0]);
    free(want[1]);
    free(got);
}

int main(int argc, char **argv) {
    const char *root = argc > 1 ? argv[1] : "tests/data/golden";
    const char *configs[] = {"gpt2_like", "llama_like", "concat_residual_mqa", "f16_concat_residual_gqa",
                             "bf16_tied_rope_residual", "add_residual_statenorm_rms_gqa2",
                             "none_replace_beta_rope1000", "nblock0_none"};
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) check_config(root, configs[i]);
    /* q8 / q4: quantised activations are per row, so the same contracts hold. */
    const char *quantised[] = {"gpt2_like", "llama_like", "f16_concat_residual_gqa"};
    for (size_t i = 0; i < sizeof quantised / sizeof quantised[0]; i++)
        for (int t = 0; t < 2; t++) {
            const char *qroot = quantised_copy(root, quantised[i], t ? TL_Q4 : TL_Q8);
            CHECK(qroot != NULL, "%s: quantise", quantised[i]);
            if (qroot) check_config(qroot, quantised[i]);
        }
    char group_dir[4200];
    snprintf(group_dir, sizeof group_dir, "%.4000s/llama_like", root);
    check_group_split(group_dir);
    /* Positions without a learned table, so that the copies may hold LONG_TOKENS. Fused at 2
       threads: deep_residual (4 KV heads of 8 lanes: two per thread, one panel),
       nblock0_none (2 of 16), bf16_tied_rope_residual (3 of 8: 2 + 1, the nearest whole
       heads to equal shares); at 1 thread only: llama_like (2 of 8: half a panel each),
       concat_residual_mqa (one KV head). */
    const char *fused[] = {"deep_residual", "nblock0_none", "llama_like", "concat_residual_mqa",
                           "bf16_tied_rope_residual"};
    for (size_t i = 0; i < sizeof fused / sizeof fused[0]; i++) check_fused(root, fused[i]);
    check_fused_gqa(root, 2, TL_F32);
    check_fused_gqa(root, 4, TL_F32);
    check_fused_gqa(root, 2, TL_Q8);
    check_fused_gqa(root, 2, TL_Q4);
    for (int t = 0; t < 2; t++) {
        const char *qroot = quantised_copy(root, "deep_residual", t ? TL_Q4 : TL_Q8);
        CHECK(qroot != NULL, "deep_residual: quantise");
        if (qroot) check_fused(qroot, "deep_residual");
    }
    check_rope_table(root, "bf16_tied_rope_residual");
    check_rope_table(root, "none_replace_beta_rope1000");
    check_kv_sharing(root, "add_replace_beta_statenorm_ln");
    check_kv_sharing(root, "f16_concat_residual_gqa");
    /* The published layouts (tests/data/hf beside the goldens): Huginn, one slot per block
       application with prelude and coda; Ouro, one slot per (pass, layer), no prelude. */
    char hf[4200];
    snprintf(hf, sizeof hf, "%.4000s/../hf", root);
    check_config(hf, "huginn_f32");
    check_config(hf, "ouro_bf16_tied");
    check_kv_sharing(hf, "huginn_bf16");
    check_kv_sharing(hf, "ouro_f32");
    const char *resumed[] = {"add_residual_statenorm_rms_gqa2", "f16_concat_residual_gqa", "bf16_tied_rope_residual"};
    for (size_t i = 0; i < sizeof resumed / sizeof resumed[0]; i++)
        for (int tree = 0; tree < 2; tree++) {
            check_kept_resume(root, resumed[i], tree, 1, 4);
            check_kept_resume(root, resumed[i], tree, 3, 4);
        }
    check_kept_resume(hf, "huginn_f32", true, 2, 4);
    check_kept_resume(hf, "ouro_bf16_tied", false, 1, 4);
    return check_summary();
}

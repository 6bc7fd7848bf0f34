/* grammar_mask.c: allowed-token masks of a compiled grammar against a vocabulary, and the
 * per-generation matchers that plug a compiled grammar into a session.
 *
 * The vocabulary is a trie of token byte strings (grammar.h). A mask walks the trie from the
 * matcher state, advancing one byte per edge (memoised transitions), and prunes a subtree as
 * soon as the state dies: tokens sharing a prefix share its work. Two more shortcuts:
 *   - a subtree whose bytes all lead from the state back to itself (e.g. the inside of a JSON
 *     string) is allowed in bulk, without walking it;
 *   - masks are cached per state for the life of the compiled grammar, so a state met again,
 *     in this generation or a later one, costs a copy. They are cached small (a bitset, or a
 *     projection's entry plus a list of tokens): with a byte per token, the first touch of the
 *     fresh pages each new copy needed (13 for GPT-2; page faults are slow on virtual machines)
 *     was most of a cold mask's time, more than the walks;
 *   - a state never met before takes the cached mask of its projection (its stacks cut to the
 *     top frames, grammar.h), shared by the states that differ only in deeper frames, and walks
 *     only the subtrees where the projection's walk needed the cut frames (closing brackets);
 *   - a child byte no stack can take is skipped with a bit test, not a transition lookup.
 * The session asks for a full mask only when it must: greedy decoding first checks its argmax
 * against the grammar (a walk of one token's bytes) and masks only when it is rejected. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "tokenizer.h"

#define MASK_CACHE_BYTES ((size_t)64 << 20) /* cached masks per vocabulary (entries, bitsets, token lists), then start over */
#define BULK_MIN_TOKENS 8                    /* subtrees smaller than this are walked */

/* ---------------------------------------------------------------- the vocabulary trie */

static void vocab_free(tl_gram_vocab *v) {
    if (!v) return;
    free(v->text);
    free(v->node_byte);
    free(v->sub_end);
    free(v->tok_first);
    free(v->order);
    free(v->sub_bytes);
    free(v->bytes);
    free(v->lens);
    free(v);
}

typedef struct tok_ref { const char *bytes; uint32_t len; int32_t id; } tok_ref;

static int by_bytes(const void *a, const void *b) {
    const tok_ref *x = a, *y = b;
    const uint32_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->bytes, y->bytes, n);
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static uint64_t fingerprint(const struct tl_tlz_tokenizer *tok, int vocab_size, int eos) {
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)vocab_size ^ ((uint64_t)(uint32_t)eos << 32);
    for (int32_t id = 0; id < vocab_size; id++) {
        const char *b;
        size_t len;
        /* a special token's text too, marked apart: it names the token for <text> references
           (vocabularies that differ in them resolve a grammar's references apart) */
        const bool special = tl_tlz_is_special(tok, id);
        if (tl_tlz_token_bytes(tok, id, &b, &len) != 0) len = 0, b = "";
        h = (h ^ (len + (special ? 0x7f4au : 0x9e37u))) * 1099511628211ULL;
        for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)b[i]) * 1099511628211ULL;
    }
    return h;
}

/* Whether token id can ever be allowed, and its bytes: special tokens are control, not text;
   empty tokens would never advance the grammar. */
static bool allowed_bytes(const struct tl_tlz_tokenizer *tok, int32_t id, const char **bytes, size_t *len) {
    return !tl_tlz_is_special(tok, id) && tl_tlz_token_bytes(tok, id, bytes, len) == 0 && *len > 0 && *len <= 65535;
}

static tl_status vocab_build(const struct tl_tlz_tokenizer *tok, int vocab_size, int eos, uint64_t fp, tl_gram_vocab **out) {
    *out = NULL;
    tl_gram_vocab *v = calloc(1, sizeof *v);
    tok_ref *refs = malloc(((size_t)vocab_size + 1) * sizeof *refs);
    int32_t *path = malloc(65537 * sizeof *path);
    if (!v || !refs || !path) goto oom;
    v->vocab_size = vocab_size;
    v->eos = eos >= 0 && eos < vocab_size ? eos : -1;
    v->bytes = calloc((size_t)vocab_size + 1, sizeof *v->bytes);
    v->lens = calloc((size_t)vocab_size + 1, sizeof *v->lens);
    if (!v->bytes || !v->lens) goto oom;
    size_t total = 0; /* (two passes: the owned copy is one block of this size) */
    for (int32_t id = 0; id < vocab_size; id++) {
        const char *b;
        size_t len;
        if (allowed_bytes(tok, id, &b, &len)) total += len;
    }
    v->text = malloc(total + 1);
    if (!v->text) goto oom;
    int n = 0;
    size_t at = 0;
    for (int32_t id = 0; id < vocab_size; id++) {
        const char *b;
        size_t len;
        if (!allowed_bytes(tok, id, &b, &len)) continue;
        memcpy(v->text + at, b, len);
        v->bytes[id] = v->text + at;
        v->lens[id] = (uint32_t)len;
        refs[n++] = (tok_ref){v->text + at, (uint32_t)len, id};
        at += len;
    }
    v->fingerprint = fp;
    qsort(refs, (size_t)n, sizeof *refs, by_bytes);
    const size_t max_nodes = total + 1;
    v->node_byte = malloc(max_nodes);
    v->sub_end = malloc(max_nodes * sizeof *v->sub_end);
    int32_t *tok_node = malloc(((size_t)n + 1) * sizeof *tok_node);
    if (!v->node_byte || !v->sub_end || !tok_node) { free(tok_node); goto oom; }
    /* Sorted strings give the trie in preorder: keep the current path, close the nodes below
       the common prefix with the previous token, open nodes for the rest. */
    int n_nodes = 1, depth = 0;
    path[0] = 0;
    v->node_byte[0] = 0;
    const tok_ref *prev = NULL;
    for (int i = 0; i < n; i++) {
        const tok_ref *t = &refs[i];
        uint32_t lcp = 0;
        if (prev) while (lcp < t->len && lcp < prev->len && t->bytes[lcp] == prev->bytes[lcp]) lcp++;
        while ((uint32_t)depth > lcp) v->sub_end[path[depth--]] = n_nodes;
        for (uint32_t k = lcp; k < t->len; k++) {
            v->node_byte[n_nodes] = (uint8_t)t->bytes[k];
            path[++depth] = n_nodes++;
        }
        tok_node[i] = path[t->len];
        prev = t;
    }
    while (depth >= 0) v->sub_end[path[depth--]] = n_nodes;
    v->n_nodes = n_nodes;
    v->tok_first = calloc((size_t)n_nodes + 1, sizeof *v->tok_first);
    v->order = malloc(((size_t)n + 1) * sizeof *v->order);
    v->sub_bytes = calloc((size_t)n_nodes, sizeof *v->sub_bytes);
    if (!v->tok_first || !v->order || !v->sub_bytes) { free(tok_node); goto oom; }
    /* tokens are already sorted by node (preorder is the sort order) */
    for (int i = 0; i < n; i++) { v->order[i] = refs[i].id; v->tok_first[tok_node[i] + 1]++; }
    for (int i = 0; i < n_nodes; i++) v->tok_first[i + 1] += v->tok_first[i];
    v->n_ordered = n;
    free(tok_node);
    for (int i = n_nodes - 1; i >= 0; i--)
        for (int c = i + 1; c < v->sub_end[i]; c = v->sub_end[c]) {
            v->sub_bytes[i].bits[v->node_byte[c] >> 6] |= 1ull << (v->node_byte[c] & 63);
            for (int k = 0; k < 4; k++) v->sub_bytes[i].bits[k] |= v->sub_bytes[c].bits[k];
        }
    free(refs);
    free(path);
    v->memory = sizeof *v + total + 1 + ((size_t)vocab_size + 1) * (sizeof *v->bytes + sizeof *v->lens) +
                (total + 1) * (sizeof *v->node_byte + sizeof *v->sub_end) +
                ((size_t)n_nodes + 1) * sizeof *v->tok_first + ((size_t)n + 1) * sizeof *v->order +
                (size_t)n_nodes * sizeof *v->sub_bytes;
    *out = v;
    return TL_OK;
oom:
    free(refs);
    free(path);
    vocab_free(v);
    return tl_fail(TL_ERR_NO_MEMORY, "out of memory building the vocabulary trie");
}

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER; /* innermost: taken under a grammar's lock */
static tl_gram_vocab *registry;

/* The fingerprints of the tokenizers met last, by serial (tl_tlz_serial: never reused, so a
   tokenizer loaded where a freed one was is not mistaken for it). Hashing GPT-2's vocabulary
   took 0.7 ms, paid by every session under a grammar, on a server's event loop. */
enum { FINGERPRINT_MEMO = 8 };
static struct { uint64_t serial, fingerprint; int vocab_size, eos; } fingerprint_memo[FINGERPRINT_MEMO];
static int fingerprint_next;
static pthread_mutex_t memo_lock = PTHREAD_MUTEX_INITIALIZER; /* (not the registry's: that one is held while a trie builds) */

static uint64_t vocab_fingerprint(const struct tl_tlz_tokenizer *tok, int vocab_size, int eos) {
    const uint64_t serial = tl_tlz_serial(tok);
    pthread_mutex_lock(&memo_lock);
    for (int i = 0; i < FINGERPRINT_MEMO; i++)
        if (fingerprint_memo[i].serial == serial && fingerprint_memo[i].vocab_size == vocab_size &&
            fingerprint_memo[i].eos == eos) {
            const uint64_t fp = fingerprint_memo[i].fingerprint;
            pthread_mutex_unlock(&memo_lock);
            return fp;
        }
    pthread_mutex_unlock(&memo_lock);
    const uint64_t fp = fingerprint(tok, vocab_size, eos); /* (outside the lock: threads on other tokenizers go on) */
    pthread_mutex_lock(&memo_lock);
    fingerprint_memo[fingerprint_next].serial = serial;
    fingerprint_memo[fingerprint_next].fingerprint = fp;
    fingerprint_memo[fingerprint_next].vocab_size = vocab_size;
    fingerprint_memo[fingerprint_next].eos = eos;
    fingerprint_next = (fingerprint_next + 1) % FINGERPRINT_MEMO;
    pthread_mutex_unlock(&memo_lock);
    return fp;
}

tl_status tl_gram_vocab_acquire(const struct tl_tlz_tokenizer *tok, int vocab_size, int eos, uint64_t fp, tl_gram_vocab **out) {
    tl_status st = TL_OK;
    pthread_mutex_lock(&registry_lock);
    tl_gram_vocab *v = registry;
    while (v && !(v->fingerprint == fp && v->vocab_size == vocab_size)) v = v->next;
    if (!v) { /* (built under the lock: a second thread on the same tokenizer waits for this one) */
        st = vocab_build(tok, vocab_size, eos, fp, &v);
        if (st == TL_OK) {
            v->next = registry;
            registry = v;
        }
    }
    if (st == TL_OK) v->refs++;
    pthread_mutex_unlock(&registry_lock);
    *out = st == TL_OK ? v : NULL;
    return st;
}

void tl_gram_vocab_release(tl_gram_vocab *v) {
    if (!v) return;
    pthread_mutex_lock(&registry_lock);
    const bool last = --v->refs == 0;
    if (last) {
        tl_gram_vocab **at = &registry;
        while (*at != v) at = &(*at)->next;
        *at = v->next;
    }
    pthread_mutex_unlock(&registry_lock);
    if (last) vocab_free(v);
}

/* ---------------------------------------------------------------- masks */

static bool subset(const tl_gram_byteset *a, const tl_gram_byteset *b) {
    for (int k = 0; k < 4; k++)
        if (a->bits[k] & ~b->bits[k]) return false;
    return true;
}

/* Trie nodes where a projection's walk escaped (grammar.h, tl_gram_project): the tokens below
   them depend on the frames the projection cut off, and are resolved per state. */
typedef struct esc_list { int32_t *node; uint16_t *depth; int n, cap; bool oom; } esc_list;

static void esc_add(esc_list *e, int32_t node, int depth) {
    if (e->n == e->cap) {
        int cap = e->cap ? e->cap * 2 : 16;
        int32_t *q = realloc(e->node, (size_t)cap * sizeof *q);
        if (q) e->node = q;
        uint16_t *d = q ? realloc(e->depth, (size_t)cap * sizeof *d) : NULL;
        if (d) e->depth = d;
        if (!q || !d) { e->oom = true; return; }
        e->cap = cap;
    }
    e->node[e->n] = node;
    e->depth[e->n++] = (uint16_t)depth;
}

/* Allows the tokens of node's children subtrees reachable from `state`; returns the count
   added, or -1 out of memory. A child whose state is escaped (only a projection's walk meets
   one) is left out and listed in `esc`. */
static int walk(tl_gram_runtime *rt, const tl_gram_vocab *v, int node, int depth, int32_t state, uint8_t *allowed, esc_list *esc) {
    int count = 0;
    /* bytes no stack can take die without a transition lookup: a wide node (GPT-2's " " has
       thousands of children) costs a bit test per child, not a hash probe */
    const tl_gram_byteset takes = *tl_gram_first_bytes(rt, state); /* a copy: advancing may move the array */
    for (int c = node + 1; c < v->sub_end[node]; c = v->sub_end[c]) {
        if (!tl_gram_byteset_has(&takes, v->node_byte[c])) continue;
        const int32_t next = tl_gram_advance(rt, state, v->node_byte[c]);
        if (next < 0) return -1;
        if (next == GRAM_DEAD) continue;
        if (tl_gram_escaped(rt, next)) {
            esc_add(esc, c, depth + 1);
            if (esc->oom) return -1;
            continue;
        }
        const int32_t here_end = v->tok_first[c + 1], below_end = v->tok_first[v->sub_end[c]];
        for (int32_t k = v->tok_first[c]; k < here_end; k++) allowed[v->order[k]] = 1;
        count += here_end - v->tok_first[c];
        if (v->sub_end[c] == c + 1) continue; /* a leaf */
        if (below_end - here_end >= BULK_MIN_TOKENS) {
            const tl_gram_byteset *loop = tl_gram_loop_bytes(rt, next);
            if (!loop) return -1;
            if (subset(&v->sub_bytes[c], loop)) {
                for (int32_t k = here_end; k < below_end; k++) allowed[v->order[k]] = 1;
                count += below_end - here_end;
                continue;
            }
        }
        int below = walk(rt, v, c, depth + 1, next, allowed, esc);
        if (below < 0) return -1;
        count += below;
    }
    return count;
}

/* ---------------------------------------------------------------- the mask cache */

static void forget_masks(tl_gram_binding *b) {
    for (int i = 0; i < b->n_masks; i++) {
        tl_gram_mask_entry *e = &b->masks[i];
        free(e->bits);
        free(e->extra);
        free(e->esc);
        free(e->esc_depth);
    }
    b->n_masks = 0;
    b->mask_bytes = 0;
    tl_gram_hash_clear(&b->mask_ids);
}

void tl_gram_binding_destroy(tl_gram_binding *b) {
    forget_masks(b);
    free(b->masks);
    tl_gram_hash_free(&b->mask_ids);
    memset(b, 0, sizeof *b);
}

static int32_t cached_mask(const tl_gram_binding *b, int32_t state) {
    return tl_gram_hash_get(&b->mask_ids, (uint64_t)state + 1);
}

static size_t mask_words(const tl_gram_vocab *v) { return ((size_t)v->vocab_size + 63) / 64; }

/* allowed[0..n) (bytes 0 or 1) as a bitset. Eight bytes at a time: the multiply gathers the
   low bit of each byte into the top byte, byte i to bit 56 + i (no two partial products meet,
   so nothing carries). The loads are spelled out byte by byte so that the order does not
   depend on the host's endianness; compilers turn them into one load. */
static void pack_bits(const uint8_t *allowed, int n, uint64_t *bits) {
    int t = 0;
    for (size_t w = 0; t + 64 <= n; w++, t += 64) {
        uint64_t word = 0;
        for (int g = 0; g < 8; g++) {
            const uint8_t *p = allowed + t + 8 * g;
            const uint64_t x = (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
                               (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
            word |= ((x * 0x0102040810204080ULL) >> 56) << (8 * g);
        }
        bits[w] = word;
    }
    if (t < n) {
        uint64_t word = 0;
        for (int k = 0; t + k < n; k++) word |= (uint64_t)allowed[t + k] << k;
        bits[t / 64] = word;
    }
}

/* The inverse: allowed[0..n) from a bitset, a byte of bits at a time through a table of
   their eight 0/1 bytes (2 KiB), copied whole: a cached mask is read far more often than it
   is written, so this is the copy every mask of a state met before pays. */
#define SPREAD1(c) {(c) & 1, (c) >> 1 & 1, (c) >> 2 & 1, (c) >> 3 & 1, (c) >> 4 & 1, (c) >> 5 & 1, (c) >> 6 & 1, (c) >> 7 & 1}
#define SPREAD4(c) SPREAD1(c), SPREAD1((c) + 1), SPREAD1((c) + 2), SPREAD1((c) + 3)
#define SPREAD16(c) SPREAD4(c), SPREAD4((c) + 4), SPREAD4((c) + 8), SPREAD4((c) + 12)
#define SPREAD64(c) SPREAD16(c), SPREAD16((c) + 16), SPREAD16((c) + 32), SPREAD16((c) + 48)
static const uint8_t spread[256][8] = {SPREAD64(0), SPREAD64(64), SPREAD64(128), SPREAD64(192)};

static void unpack_bits(const uint64_t *bits, int n, uint8_t *allowed) {
    int t = 0;
    for (size_t w = 0; t + 64 <= n; w++, t += 64) {
        const uint64_t word = bits[w];
        if (word == 0 || word == ~0ull) { /* most words of a JSON mask: none or all allowed */
            memset(allowed + t, (int)(word & 1), 64);
            continue;
        }
        for (int g = 0; g < 8; g++) memcpy(allowed + t + 8 * g, spread[(word >> (8 * g)) & 0xff], 8);
    }
    for (; t < n; t++) allowed[t] = (uint8_t)((bits[t / 64] >> (t % 64)) & 1);
}

/* Writes a cached mask into allowed[0..vocab) and returns its count. */
static int load_mask(const tl_gram_binding *b, const tl_gram_mask_entry *e, uint8_t *allowed) {
    unpack_bits(e->base >= 0 ? b->masks[e->base].bits : e->bits, b->vocab->vocab_size, allowed);
    for (int32_t i = 0; i < e->n_extra; i++) allowed[e->extra[i]] = 1;
    return e->count;
}

/* The tokens of `allowed` that the projection's entry `base` lacks, written to out (when not
   NULL); returns how many. The projection's walk stopped at its escape nodes, so they can
   only be below them: only those subtrees are scanned. */
static int32_t extra_tokens(const tl_gram_binding *b, int32_t base, const uint8_t *allowed, int32_t *out) {
    const tl_gram_vocab *v = b->vocab;
    const tl_gram_mask_entry *pm = &b->masks[base];
    int32_t n = 0;
    for (int32_t i = 0; i < pm->n_esc; i++) {
        const int32_t c = pm->esc[i];
        for (int32_t k = v->tok_first[c]; k < v->tok_first[v->sub_end[c]]; k++) {
            const int32_t t = v->order[k];
            if (allowed[t] && !((pm->bits[t / 64] >> (t % 64)) & 1)) {
                if (out) out[n] = t;
                n++;
            }
        }
    }
    return n;
}

/* Caches a mask (with a projection's escape list, taken over on success; on failure the
   caller keeps it). base >= 0: the state's projection's entry, and the mask is held as the
   tokens it adds to that one when such a list is smaller than a bitset. */
static bool remember_mask(tl_gram_binding *b, int32_t state, const uint8_t *allowed, int count, esc_list *esc, int32_t base) {
    esc_list none = {0};
    if (!esc) esc = &none;
    const tl_gram_vocab *v = b->vocab;
    const size_t bits_bytes = mask_words(v) * sizeof(uint64_t);
    if (base >= 0 && !b->masks[base].bits) base = -1; /* a base is a whole mask, never a list on another */
    int32_t n_extra = base >= 0 ? extra_tokens(b, base, allowed, NULL) : 0;
    if (base >= 0 && (size_t)n_extra * sizeof(int32_t) >= bits_bytes) base = -1;
    const size_t fixed = sizeof(tl_gram_mask_entry) + (size_t)esc->n * (sizeof *esc->node + sizeof *esc->depth);
    if (b->mask_bytes + fixed + (base >= 0 ? (size_t)n_extra * sizeof(int32_t) : bits_bytes) > b->mask_budget) {
        forget_masks(b); /* full: start over (the base goes too) */
        base = -1;
    }
    if (base < 0) n_extra = 0;
    const size_t held = fixed + (base >= 0 ? (size_t)n_extra * sizeof(int32_t) : bits_bytes);
    if (!tl_gram_hash_reserve(&b->mask_ids)) return false;
    if (b->n_masks == b->cap_masks) {
        int cap = b->cap_masks ? b->cap_masks * 2 : 64;
        tl_gram_mask_entry *q = realloc(b->masks, (size_t)cap * sizeof *q);
        if (!q) return false;
        b->masks = q;
        b->cap_masks = cap;
    }
    tl_gram_mask_entry e = {.state = state, .count = count, .base = base, .esc = esc->node, .esc_depth = esc->depth, .n_esc = esc->n};
    if (base >= 0) {
        if (n_extra && !(e.extra = malloc((size_t)n_extra * sizeof *e.extra))) return false;
        e.n_extra = extra_tokens(b, base, allowed, e.extra);
    } else {
        if (!(e.bits = malloc(bits_bytes))) return false;
        pack_bits(allowed, v->vocab_size, e.bits);
    }
    b->masks[b->n_masks] = e;
    if (!tl_gram_hash_put(&b->mask_ids, (uint64_t)state + 1, b->n_masks)) { /* reserved: cannot fail */
        free(e.bits);
        free(e.extra);
        return false;
    }
    b->n_masks++;
    b->mask_bytes += held;
    return true;
}

/* A state's mask is its projection's (grammar.h, tl_gram_project) plus the tokens below the
   trie nodes where the projection's walk escaped, resolved from the state itself: the
   projection is shared by every state with the same top frames, so a state never met before
   usually costs a copy and a few small subtree walks (the tokens that close brackets) instead
   of a walk of the whole vocabulary. Where the grammar may end, EOS too (the empty stack is
   never cut, so the state and its projection agree). */
static int resolve(tl_gram_runtime *rt, const tl_gram_vocab *v, const tl_gram_mask_entry *pm, int32_t state, uint8_t *allowed) {
    int count = pm->count;
    for (int i = 0; i < pm->n_esc; i++) {
        const int32_t c = pm->esc[i];
        /* the bytes leading to c: the first pm->esc_depth[i] bytes of any token below it */
        const int32_t tok = v->order[v->tok_first[c]];
        const int32_t at = tl_gram_advance_bytes(rt, state, v->bytes[tok], pm->esc_depth[i]);
        if (at < 0) return -1;
        if (at == GRAM_DEAD) continue;
        const int32_t here_end = v->tok_first[c + 1];
        for (int32_t k = v->tok_first[c]; k < here_end; k++) allowed[v->order[k]] = 1;
        count += here_end - v->tok_first[c];
        esc_list none = {0};
        const int below = walk(rt, v, c, pm->esc_depth[i], at, allowed, &none);
        free(none.node);
        free(none.depth);
        if (below < 0) return -1;
        count += below;
    }
    return count;
}

static int walk_mask(tl_gram_runtime *rt, const tl_gram_vocab *v, int32_t state, uint8_t *allowed, esc_list *esc) {
    memset(allowed, 0, (size_t)v->vocab_size);
    if (state == GRAM_DEAD) return 0;
    int count = walk(rt, v, 0, 0, state, allowed, esc);
    if (count < 0) return -1;
    if (v->eos >= 0 && tl_gram_accepting(rt, state) && !allowed[v->eos]) {
        allowed[v->eos] = 1;
        count++;
    }
    return count;
}

int tl_gram_mask_full(tl_gram_runtime *rt, tl_gram_binding *b, int32_t state, uint8_t *allowed) {
    esc_list none = {0};
    int count = walk_mask(rt, b->vocab, state, allowed, &none); /* a real state never escapes */
    free(none.node);
    free(none.depth);
    return count;
}

static int mask_of(tl_gram_runtime *rt, tl_gram_binding *b, int32_t state, uint8_t *allowed) {
    const tl_gram_vocab *v = b->vocab;
    int32_t at = cached_mask(b, state);
    if (at >= 0) return load_mask(b, &b->masks[at], allowed);
    const int32_t proj = tl_gram_project(rt, state);
    if (proj < 0) return -1;
    if (proj == state) { /* nothing cut: the state's own walk */
        const int count = tl_gram_mask_full(rt, b, state, allowed);
        if (count >= 0) remember_mask(b, state, allowed, count, NULL, -1); /* a failed remember only costs speed */
        return count;
    }
    if ((at = cached_mask(b, proj)) < 0) {
        esc_list esc = {0};
        const int count = walk_mask(rt, v, proj, allowed, &esc);
        if (count < 0) { free(esc.node); free(esc.depth); return -1; }
        if (!remember_mask(b, proj, allowed, count, &esc, -1)) {
            /* uncached: resolve from this one */
            tl_gram_mask_entry tmp = {.state = proj, .count = count, .base = -1, .esc = esc.node, .esc_depth = esc.depth, .n_esc = esc.n};
            const int n = resolve(rt, v, &tmp, state, allowed);
            free(esc.node);
            free(esc.depth);
            return n;
        }
        at = b->n_masks - 1;
    } else load_mask(b, &b->masks[at], allowed);
    const tl_gram_mask_entry pm = b->masks[at]; /* a copy: remembering may move the array */
    if (pm.n_esc == 0) return pm.count;
    const int count = resolve(rt, v, &pm, state, allowed);
    if (count >= 0) remember_mask(b, state, allowed, count, NULL, at);
    return count;
}

/* Within a budget of work (GRAM_MAX_MASK_WORK): past it, -1 and the grammar is
   "too costly to follow". */
int tl_gram_mask(tl_gram_runtime *rt, tl_gram_binding *b, int32_t state, uint8_t *allowed) {
    rt->work = 0, rt->work_budget = GRAM_MAX_MASK_WORK;
    const int count = mask_of(rt, b, state, allowed);
    rt->work_budget = 0;
    return count;
}

int32_t tl_gram_advance_token(tl_gram_runtime *rt, const tl_gram_vocab *v, const tl_gram_token_set *refs, int32_t state, int32_t token) {
    if (token < 0 || token >= v->vocab_size || state == GRAM_DEAD) return GRAM_DEAD;
    if (token == v->eos) return tl_gram_accepting(rt, state) ? state : GRAM_DEAD;
    const int32_t by_bytes = v->bytes[token] ? tl_gram_advance_bytes(rt, state, v->bytes[token], v->lens[token]) : GRAM_DEAD;
    if (by_bytes < 0 || !refs) return by_bytes;
    return tl_gram_advance_refs(rt, state, by_bytes, token, refs);
}

/* The matcher's token references, read against its vocabulary and ends (NULL: none). */
static const tl_gram_token_set *matcher_refs(const tl_grammar_matcher *mt, tl_gram_token_set *out) {
    if (!mt->ref_ids) return NULL;
    *out = (tl_gram_token_set){mt->ref_ids, mt->vocab->eos, mt->ends, mt->n_ends};
    return out;
}

/* ---------------------------------------------------------------- matchers */

/* The program's token references in a vocabulary: <[id]> must be one of its ids, <text> the
   text of one of its tokens (NULL *out when the program has none). */
static tl_status resolve_refs(const tl_gram_program *p, const struct tl_tlz_tokenizer *tok, int vocab_size, int eos,
                              int32_t **out) {
    *out = NULL;
    if (p->n_tokens == 0) return TL_OK;
    int32_t *ids = malloc((size_t)p->n_tokens * sizeof *ids);
    if (!ids) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    tl_status st = TL_OK;
    for (int i = 0; i < p->n_tokens && st == TL_OK; i++) {
        const tl_gram_token_ref *ref = &p->tokens[i];
        char name[32]; /* the reference as written */
        snprintf(name, sizeof name, "<[%d]>", (int)ref->id);
        ids[i] = ref->text ? tl_tlz_token_id(tok, ref->text) : ref->id;
        if (ref->text && (ids[i] < 0 || ids[i] >= vocab_size))
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar: %s%s is not a token of the model's vocabulary (write <[id]>, "
                         "or the text of one token)", ref->negated ? "!" : "", ref->text);
        else if (ids[i] >= vocab_size)
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar: %s%s is past the model's vocabulary (%d tokens)",
                         ref->negated ? "!" : "", name, vocab_size);
        else if (!ref->negated && eos >= 0 && ids[i] == eos)
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar: %s is the end of text, which no reference takes (the text ends "
                         "where the grammar may end)", ref->text ? ref->text : name);
    }
    if (st != TL_OK) {
        free(ids);
        return st;
    }
    *out = ids;
    return TL_OK;
}

/* The index of the tokenizer's vocabulary in g->vocabs, built on first use (callers hold g->lock). */
static tl_status vocab_for(tl_compiled_grammar *g, const struct tl_tlz_tokenizer *tok, int vocab_size, int eos, int *index) {
    const uint64_t fp = vocab_fingerprint(tok, vocab_size, eos);
    for (int i = 0; i < g->n_vocabs; i++)
        if (g->vocabs[i]->fingerprint == fp && g->vocabs[i]->vocab_size == vocab_size) {
            *index = i;
            return TL_OK;
        }
    int32_t *ref_ids;
    tl_status st = resolve_refs(g->prog, tok, vocab_size, eos, &ref_ids);
    if (st != TL_OK) return st;
    tl_gram_vocab *v;
    st = tl_gram_vocab_acquire(tok, vocab_size, eos, fp, &v);
    if (st != TL_OK) {
        free(ref_ids);
        return st;
    }
    tl_gram_vocab **q = realloc(g->vocabs, ((size_t)g->n_vocabs + 1) * sizeof *q);
    if (q) g->vocabs = q;
    int32_t **r = q ? realloc(g->ref_ids, ((size_t)g->n_vocabs + 1) * sizeof *r) : NULL;
    if (r) g->ref_ids = r;
    if (!q || !r) {
        tl_gram_vocab_release(v);
        free(ref_ids);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    }
    g->vocabs[g->n_vocabs] = v;
    g->ref_ids[g->n_vocabs] = ref_ids;
    *index = g->n_vocabs++;
    return TL_OK;
}

/* The tables' mask cache for g->vocabs[index] exists (callers hold g->lock). */
static tl_status bind(tl_compiled_grammar *g, tl_gram_tables *t, int index) {
    if (index < t->n_bindings) return TL_OK;
    tl_gram_binding *q = realloc(t->bindings, ((size_t)index + 1) * sizeof *q);
    if (!q) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    t->bindings = q;
    for (; t->n_bindings <= index; t->n_bindings++) {
        memset(&q[t->n_bindings], 0, sizeof *q);
        q[t->n_bindings].vocab = g->vocabs[t->n_bindings];
        q[t->n_bindings].mask_budget = MASK_CACHE_BYTES;
    }
    return TL_OK;
}

tl_status tl_gram_matcher_new(const tl_compiled_grammar *cg, const struct tl_tlz_tokenizer *tok, int vocab_size, int eos,
                           tl_grammar_matcher **out) {
    tl_compiled_grammar *g = (tl_compiled_grammar *)cg;
    tl_grammar_matcher *mt = calloc(1, sizeof *mt);
    if (!mt) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    mt->cap = 64;
    mt->states = malloc((size_t)mt->cap * sizeof *mt->states);
    tl_status st = mt->states ? TL_OK : tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    pthread_mutex_lock(&g->lock);
    tl_gram_tables *t = tl_gram_current_tables(g);
    if (st == TL_OK) st = vocab_for(g, tok, vocab_size, eos, &mt->binding);
    if (st == TL_OK) st = bind(g, t, mt->binding);
    if (st == TL_OK) {
        t->users++;
        mt->tables = t;
        mt->vocab = g->vocabs[mt->binding];
        mt->ref_ids = g->ref_ids[mt->binding];
        mt->states[0] = t->rt.initial;
        mt->n = 1;
    }
    pthread_mutex_unlock(&g->lock);
    if (st != TL_OK) {
        free(mt->states);
        free(mt);
        return st;
    }
    tl_compiled_grammar_retain(g);
    mt->g = g;
    *out = mt;
    return TL_OK;
}

tl_status tl_gram_matcher_clone(const tl_grammar_matcher *src, tl_grammar_matcher **out) {
    tl_grammar_matcher *mt = calloc(1, sizeof *mt);
    int32_t *states = malloc((size_t)src->cap * sizeof *states);
    if (!mt || !states) {
        free(mt);
        free(states);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    }
    memcpy(states, src->states, (size_t)src->n * sizeof *states);
    *mt = *src;
    mt->states = states;
    tl_compiled_grammar_retain(mt->g);
    pthread_mutex_lock(&mt->g->lock);
    mt->tables->users++; /* the copy's states are the source's: the same generation */
    pthread_mutex_unlock(&mt->g->lock);
    *out = mt;
    return TL_OK;
}

tl_status tl_grammar_matcher_new(const tl_compiled_grammar *g, const tl_model *m, tl_grammar_matcher **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_new: out must not be NULL");
    *out = NULL;
    if (!g || !m) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_new: grammar and model must not be NULL");
    if (!m->tokenizer)
        return tl_fail(TL_ERR_UNSUPPORTED, "a compiled grammar needs the model's tokenizer.json (token bytes)");
    return tl_gram_matcher_new(g, m->tokenizer, m->cfg.vocab_size, m->cfg.eos_token_id, out);
}

void tl_grammar_matcher_free(tl_grammar_matcher *mt) {
    if (!mt) return;
    pthread_mutex_lock(&mt->g->lock);
    tl_gram_tables_leave(mt->g, mt->tables);
    pthread_mutex_unlock(&mt->g->lock);
    tl_compiled_grammar_free(mt->g);
    free(mt->states);
    free(mt);
}

int32_t tl_gram_matcher_state(const tl_grammar_matcher *mt) { return mt->states[mt->n - 1]; }

void tl_gram_matcher_set_ends(tl_grammar_matcher *mt, const tl_token_seq *stops, int n_stops) {
    const tl_gram_vocab *v = mt->vocab;
    mt->n_ends = 0;
    for (int i = 0; i < n_stops && mt->n_ends < GRAM_MAX_ENDS; i++) {
        if (stops[i].n != 1) continue;
        const int32_t id = stops[i].tokens[0];
        if (id >= 0 && id < v->vocab_size && id != v->eos && !v->bytes[id]) mt->ends[mt->n_ends++] = id;
    }
}

static bool is_end(const tl_grammar_matcher *mt, int32_t token) {
    for (int i = 0; i < mt->n_ends; i++)
        if (mt->ends[i] == token) return true;
    return false;
}

int tl_gram_matcher_mask_state(tl_grammar_matcher *mt, int32_t state, uint8_t *allowed) {
    pthread_mutex_lock(&mt->g->lock);
    tl_gram_runtime *rt = &mt->tables->rt;
    int n = tl_gram_mask(rt, &mt->tables->bindings[mt->binding], state, allowed);
    tl_gram_token_set refs;
    if (n >= 0 && matcher_refs(mt, &refs)) n = tl_gram_mask_refs(rt, state, &refs, mt->vocab->vocab_size, allowed, n);
    if (n >= 0 && mt->n_ends && state != GRAM_DEAD && tl_gram_accepting(rt, state))
        for (int i = 0; i < mt->n_ends; i++)
            if (!allowed[mt->ends[i]]) { allowed[mt->ends[i]] = 1; n++; }
    pthread_mutex_unlock(&mt->g->lock);
    return n;
}

int32_t tl_gram_matcher_advance_state(tl_grammar_matcher *mt, int32_t state, int32_t token) {
    pthread_mutex_lock(&mt->g->lock);
    tl_gram_runtime *rt = &mt->tables->rt;
    /* an end token ends the text where it may end; elsewhere it is a token like any other (a
       token reference may take it: the mask allows it there too) */
    tl_gram_token_set refs;
    const int32_t next = is_end(mt, token) && state != GRAM_DEAD && tl_gram_accepting(rt, state)
                             ? state
                             : tl_gram_advance_token(rt, mt->vocab, matcher_refs(mt, &refs), state, token);
    pthread_mutex_unlock(&mt->g->lock);
    return next;
}

tl_status tl_grammar_matcher_mask(tl_grammar_matcher *mt, uint8_t *allowed, int vocab_size, int *count) {
    tl_clear_error();
    if (!mt || !allowed || !count)
        return tl_fail_null("tl_grammar_matcher_mask", 3, "m", (const void *)mt, "allowed", (const void *)allowed, "count",
                            (const void *)count);
    if (vocab_size != mt->vocab->vocab_size)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_mask: vocab_size = %d, the matcher's is %d", vocab_size,
                       mt->vocab->vocab_size);
    int n = tl_gram_matcher_mask_state(mt, tl_gram_matcher_state(mt), allowed);
    if (n < 0) return tl_gram_failure("grammar mask");
    *count = n;
    return TL_OK;
}

tl_status tl_grammar_matcher_accepts(tl_grammar_matcher *mt, int32_t token, int *ok) {
    tl_clear_error();
    if (!mt || !ok) return tl_fail_null("tl_grammar_matcher_accepts", 2, "m", (const void *)mt, "ok", (const void *)ok);
    int32_t next = tl_gram_matcher_advance_state(mt, tl_gram_matcher_state(mt), token);
    if (next < 0) return tl_gram_failure("grammar");
    *ok = next != GRAM_DEAD;
    return TL_OK;
}

tl_status tl_grammar_matcher_accept(tl_grammar_matcher *mt, int32_t token) {
    tl_clear_error();
    if (!mt) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_accept: matcher is NULL");
    int32_t next = tl_gram_matcher_advance_state(mt, tl_gram_matcher_state(mt), token);
    if (next < 0) return tl_gram_failure("grammar");
    if (next == GRAM_DEAD) return tl_fail(TL_ERR_INVALID_ARGUMENT, "token %d is not allowed by the grammar here", (int)token);
    if (mt->n == mt->cap) {
        int32_t *q = realloc(mt->states, (size_t)mt->cap * 2 * sizeof *q);
        if (!q) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        mt->states = q;
        mt->cap *= 2;
    }
    mt->states[mt->n++] = next;
    return TL_OK;
}

tl_status tl_grammar_matcher_rollback(tl_grammar_matcher *mt, int n_tokens) {
    tl_clear_error();
    if (!mt) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_rollback: matcher is NULL");
    if (n_tokens < 0 || n_tokens > mt->n - 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_rollback: n_tokens = %d, %d accepted", n_tokens,
                       mt->n - 1);
    mt->n -= n_tokens;
    return TL_OK;
}

int tl_grammar_matcher_is_accepting(const tl_grammar_matcher *mt) {
    if (!mt) return 0;
    /* (under the lock: another thread's new state may be moving state_flags) */
    pthread_mutex_lock(&mt->g->lock);
    const int accepting = tl_gram_accepting(&mt->tables->rt, tl_gram_matcher_state(mt));
    pthread_mutex_unlock(&mt->g->lock);
    return accepting;
}

/* ---------------------------------------------------------------- the session's tl_grammar */

static int matcher_allowed(void *user, uint8_t *allowed, int vocab_size) {
    tl_grammar_matcher *mt = user;
    (void)vocab_size;
    return tl_gram_matcher_mask_state(mt, tl_gram_matcher_state(mt), allowed);
}

static int matcher_advance(void *user, int32_t token) {
    return tl_grammar_matcher_accept(user, token) == TL_OK ? 0 : -1;
}

void tl_gram_matcher_as_grammar(tl_grammar_matcher *mt, tl_grammar *out) {
    memset(out, 0, sizeof *out);
    out->user = mt;
    out->allowed = matcher_allowed;
    out->advance = matcher_advance;
}

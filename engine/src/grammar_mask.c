/* grammar_mask.c: allowed-token masks of a compiled grammar against a vocabulary, and the
 * per-generation matchers that plug a compiled grammar into a session.
 *
 * The vocabulary is a trie of token byte strings (grammar.h). A mask walks the trie from the
 * matcher state, advancing one byte per edge (memoised transitions), and prunes a subtree as
 * soon as the state dies: tokens sharing a prefix share its work. Two more shortcuts:
 *   - a subtree whose bytes all lead from the state back to itself (e.g. the inside of a JSON
 *     string) is allowed in bulk, without walking it;
 *   - masks are cached per state for the life of the compiled grammar, so a state met again,
 *     in this generation or a later one, costs a copy;
 *   - a state never met before takes the cached mask of its projection (its stacks cut to the
 *     top frames, grammar.h), shared by the states that differ only in deeper frames, and walks
 *     only the subtrees where the projection's walk needed the cut frames (closing brackets);
 *   - a child byte no stack can take is skipped with a bit test, not a transition lookup.
 * The session asks for a full mask only when it must: greedy decoding first checks its argmax
 * against the grammar (a walk of one token's bytes) and masks only when it is rejected. */
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "tokenizer.h"

#define MASK_CACHE_BYTES ((size_t)256 << 20) /* cached masks per vocabulary, then start over */
#define BULK_MIN_TOKENS 8                    /* subtrees smaller than this are walked */

/* ---------------------------------------------------------------- the vocabulary trie */

void gram_vocab_free(gram_vocab *v) {
    if (!v) return;
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

static uint64_t fingerprint(const struct tlz_tokenizer *tok, int vocab_size, int eos) {
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)vocab_size ^ ((uint64_t)(uint32_t)eos << 32);
    for (int32_t id = 0; id < vocab_size; id++) {
        const char *b;
        size_t len;
        if (tlz_is_special(tok, id) || tlz_token_bytes(tok, id, &b, &len) != 0) len = 0, b = "";
        h = (h ^ (len + 0x9e37u)) * 1099511628211ULL;
        for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)b[i]) * 1099511628211ULL;
    }
    return h;
}

tl_status gram_vocab_build(const struct tlz_tokenizer *tok, int vocab_size, int eos, gram_vocab **out) {
    *out = NULL;
    gram_vocab *v = calloc(1, sizeof *v);
    tok_ref *refs = malloc(((size_t)vocab_size + 1) * sizeof *refs);
    int32_t *path = malloc(65537 * sizeof *path);
    if (!v || !refs || !path) goto oom;
    v->vocab_size = vocab_size;
    v->eos = eos >= 0 && eos < vocab_size ? eos : -1;
    v->bytes = calloc((size_t)vocab_size + 1, sizeof *v->bytes);
    v->lens = calloc((size_t)vocab_size + 1, sizeof *v->lens);
    if (!v->bytes || !v->lens) goto oom;
    int n = 0;
    size_t total = 0;
    for (int32_t id = 0; id < vocab_size; id++) {
        const char *b;
        size_t len;
        /* special tokens are control, not text; empty tokens would never advance the grammar */
        if (tlz_is_special(tok, id) || tlz_token_bytes(tok, id, &b, &len) != 0 || len == 0 || len > 65535) continue;
        v->bytes[id] = b;
        v->lens[id] = (uint32_t)len;
        refs[n++] = (tok_ref){b, (uint32_t)len, id};
        total += len;
    }
    v->fingerprint = fingerprint(tok, vocab_size, eos);
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
    *out = v;
    return TL_OK;
oom:
    free(refs);
    free(path);
    gram_vocab_free(v);
    return tl_fail(TL_ERR_NO_MEMORY, "out of memory building the vocabulary trie");
}

/* ---------------------------------------------------------------- masks */

static bool subset(const gram_byteset *a, const gram_byteset *b) {
    for (int k = 0; k < 4; k++)
        if (a->bits[k] & ~b->bits[k]) return false;
    return true;
}

/* Trie nodes where a projection's walk escaped (grammar.h, gram_project): the tokens below
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
static int walk(gram_runtime *rt, const gram_vocab *v, int node, int depth, int32_t state, uint8_t *allowed, esc_list *esc) {
    int count = 0;
    /* bytes no stack can take die without a transition lookup: a wide node (GPT-2's " " has
       thousands of children) costs a bit test per child, not a hash probe */
    const gram_byteset takes = *gram_first_bytes(rt, state); /* a copy: advancing may move the array */
    for (int c = node + 1; c < v->sub_end[node]; c = v->sub_end[c]) {
        if (!gram_byteset_has(&takes, v->node_byte[c])) continue;
        const int32_t next = gram_advance(rt, state, v->node_byte[c]);
        if (next < 0) return -1;
        if (next == GRAM_DEAD) continue;
        if (gram_escaped(rt, next)) {
            esc_add(esc, c, depth + 1);
            if (esc->oom) return -1;
            continue;
        }
        const int32_t here_end = v->tok_first[c + 1], below_end = v->tok_first[v->sub_end[c]];
        for (int32_t k = v->tok_first[c]; k < here_end; k++) allowed[v->order[k]] = 1;
        count += here_end - v->tok_first[c];
        if (v->sub_end[c] == c + 1) continue; /* a leaf */
        if (below_end - here_end >= BULK_MIN_TOKENS) {
            const gram_byteset *loop = gram_loop_bytes(rt, next);
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

void gram_binding_destroy(gram_binding *b) {
    for (int i = 0; i < b->n_masks; i++) { free(b->masks[i].mask); free(b->masks[i].esc); free(b->masks[i].esc_depth); }
    free(b->masks);
    gram_hash_free(&b->mask_ids);
    gram_vocab_free(b->vocab);
    memset(b, 0, sizeof *b);
}

static int32_t cached_mask(const gram_binding *b, int32_t state) {
    return gram_hash_get(&b->mask_ids, (uint64_t)state + 1);
}

/* Caches a mask (with a projection's escape list, taken over on success; on failure the
   caller keeps it). */
static bool remember_mask(gram_binding *b, int32_t state, const uint8_t *allowed, int count, esc_list *esc) {
    esc_list none = {0};
    if (!esc) esc = &none;
    const size_t vocab = (size_t)b->vocab->vocab_size;
    if (b->mask_bytes + vocab > MASK_CACHE_BYTES) { /* full: start over */
        for (int i = 0; i < b->n_masks; i++) { free(b->masks[i].mask); free(b->masks[i].esc); free(b->masks[i].esc_depth); }
        b->n_masks = 0;
        b->mask_bytes = 0;
        gram_hash_clear(&b->mask_ids);
    }
    if (!gram_hash_reserve(&b->mask_ids)) return false;
    if (b->n_masks == b->cap_masks) {
        int cap = b->cap_masks ? b->cap_masks * 2 : 64;
        gram_mask_entry *q = realloc(b->masks, (size_t)cap * sizeof *q);
        if (!q) return false;
        b->masks = q;
        b->cap_masks = cap;
    }
    uint8_t *copy = malloc(vocab);
    if (!copy) return false;
    memcpy(copy, allowed, vocab);
    b->masks[b->n_masks] = (gram_mask_entry){state, count, copy, esc->node, esc->depth, esc->n};
    if (!gram_hash_put(&b->mask_ids, (uint64_t)state + 1, b->n_masks)) { free(copy); return false; } /* reserved: cannot fail */
    b->n_masks++;
    b->mask_bytes += vocab + (size_t)esc->n * 6;
    return true;
}

/* A state's mask is its projection's (grammar.h, gram_project) plus the tokens below the
   trie nodes where the projection's walk escaped, resolved from the state itself: the
   projection is shared by every state with the same top frames, so a state never met before
   usually costs a copy and a few small subtree walks (the tokens that close brackets) instead
   of a walk of the whole vocabulary. Where the grammar may end, EOS too (the empty stack is
   never cut, so the state and its projection agree). */
static int resolve(gram_runtime *rt, const gram_vocab *v, const gram_mask_entry *pm, int32_t state, uint8_t *allowed) {
    int count = pm->count;
    for (int i = 0; i < pm->n_esc; i++) {
        const int32_t c = pm->esc[i];
        /* the bytes leading to c: the first pm->esc_depth[i] bytes of any token below it */
        const int32_t tok = v->order[v->tok_first[c]];
        const int32_t at = gram_advance_bytes(rt, state, v->bytes[tok], pm->esc_depth[i]);
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

static int walk_mask(gram_runtime *rt, const gram_vocab *v, int32_t state, uint8_t *allowed, esc_list *esc) {
    memset(allowed, 0, (size_t)v->vocab_size);
    if (state == GRAM_DEAD) return 0;
    int count = walk(rt, v, 0, 0, state, allowed, esc);
    if (count < 0) return -1;
    if (v->eos >= 0 && gram_accepting(rt, state) && !allowed[v->eos]) {
        allowed[v->eos] = 1;
        count++;
    }
    return count;
}

int gram_mask_full(gram_runtime *rt, gram_binding *b, int32_t state, uint8_t *allowed) {
    esc_list none = {0};
    int count = walk_mask(rt, b->vocab, state, allowed, &none); /* a real state never escapes */
    free(none.node);
    free(none.depth);
    return count;
}

int gram_mask(gram_runtime *rt, gram_binding *b, int32_t state, uint8_t *allowed) {
    const gram_vocab *v = b->vocab;
    int32_t at = cached_mask(b, state);
    if (at >= 0) {
        memcpy(allowed, b->masks[at].mask, (size_t)v->vocab_size);
        return b->masks[at].count;
    }
    const int32_t proj = gram_project(rt, state);
    if (proj < 0) return -1;
    if (proj == state) { /* nothing cut: the state's own walk */
        const int count = gram_mask_full(rt, b, state, allowed);
        if (count >= 0) remember_mask(b, state, allowed, count, NULL); /* a failed remember only costs speed */
        return count;
    }
    if ((at = cached_mask(b, proj)) < 0) {
        esc_list esc = {0};
        const int count = walk_mask(rt, v, proj, allowed, &esc);
        if (count < 0) { free(esc.node); free(esc.depth); return -1; }
        if (!remember_mask(b, proj, allowed, count, &esc)) {
            /* uncached: resolve from this one */
            gram_mask_entry tmp = {proj, count, NULL, esc.node, esc.depth, esc.n};
            const int n = resolve(rt, v, &tmp, state, allowed);
            free(esc.node);
            free(esc.depth);
            return n;
        }
        at = b->n_masks - 1;
    } else memcpy(allowed, b->masks[at].mask, (size_t)v->vocab_size);
    const gram_mask_entry pm = b->masks[at]; /* a copy: remembering may move the array */
    if (pm.n_esc == 0) return pm.count;
    const int count = resolve(rt, v, &pm, state, allowed);
    if (count >= 0) remember_mask(b, state, allowed, count, NULL);
    return count;
}

int32_t gram_advance_token(gram_runtime *rt, const gram_vocab *v, int32_t state, int32_t token) {
    if (token < 0 || token >= v->vocab_size || state == GRAM_DEAD) return GRAM_DEAD;
    if (token == v->eos) return gram_accepting(rt, state) ? state : GRAM_DEAD;
    if (!v->bytes[token]) return GRAM_DEAD;
    return gram_advance_bytes(rt, state, v->bytes[token], v->lens[token]);
}

/* ---------------------------------------------------------------- matchers */

static tl_status binding_for(tl_compiled_grammar *g, const struct tlz_tokenizer *tok, int vocab_size, int eos,
                             int *index) {
    const uint64_t fp = fingerprint(tok, vocab_size, eos);
    for (int i = 0; i < g->n_bindings; i++)
        if (g->bindings[i].vocab->fingerprint == fp && g->bindings[i].vocab->vocab_size == vocab_size) {
            *index = i;
            return TL_OK;
        }
    gram_vocab *v;
    tl_status st = gram_vocab_build(tok, vocab_size, eos, &v);
    if (st != TL_OK) return st;
    gram_binding *q = realloc(g->bindings, ((size_t)g->n_bindings + 1) * sizeof *q);
    if (!q) {
        gram_vocab_free(v);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    }
    g->bindings = q;
    memset(&g->bindings[g->n_bindings], 0, sizeof *g->bindings);
    g->bindings[g->n_bindings].vocab = v;
    *index = g->n_bindings++;
    return TL_OK;
}

tl_status gram_matcher_new(const tl_compiled_grammar *cg, const struct tlz_tokenizer *tok, int vocab_size, int eos,
                           tl_grammar_matcher **out) {
    tl_compiled_grammar *g = (tl_compiled_grammar *)cg;
    tl_grammar_matcher *mt = calloc(1, sizeof *mt);
    if (!mt) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    pthread_mutex_lock(&g->rt.lock);
    tl_status st = binding_for(g, tok, vocab_size, eos, &mt->binding);
    pthread_mutex_unlock(&g->rt.lock);
    mt->cap = 64;
    mt->states = malloc((size_t)mt->cap * sizeof *mt->states);
    if (st == TL_OK && !mt->states) st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    if (st != TL_OK) {
        free(mt->states);
        free(mt);
        return st;
    }
    tl_compiled_grammar_retain(g);
    mt->g = g;
    mt->states[0] = g->rt.initial;
    mt->n = 1;
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
    return gram_matcher_new(g, m->tokenizer, m->cfg.vocab_size, m->cfg.eos_token_id, out);
}

void tl_grammar_matcher_free(tl_grammar_matcher *mt) {
    if (!mt) return;
    tl_compiled_grammar_free(mt->g);
    free(mt->states);
    free(mt);
}

int32_t gram_matcher_state(const tl_grammar_matcher *mt) { return mt->states[mt->n - 1]; }

int gram_matcher_mask_state(tl_grammar_matcher *mt, int32_t state, uint8_t *allowed) {
    pthread_mutex_lock(&mt->g->rt.lock);
    int n = gram_mask(&mt->g->rt, &mt->g->bindings[mt->binding], state, allowed);
    pthread_mutex_unlock(&mt->g->rt.lock);
    return n;
}

int32_t gram_matcher_advance_state(tl_grammar_matcher *mt, int32_t state, int32_t token) {
    pthread_mutex_lock(&mt->g->rt.lock);
    int32_t next = gram_advance_token(&mt->g->rt, mt->g->bindings[mt->binding].vocab, state, token);
    pthread_mutex_unlock(&mt->g->rt.lock);
    return next;
}

tl_status tl_grammar_matcher_mask(tl_grammar_matcher *mt, uint8_t *allowed, int vocab_size, int *count) {
    tl_clear_error();
    if (!mt || !allowed || !count) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_mask: NULL argument");
    if (vocab_size != mt->g->bindings[mt->binding].vocab->vocab_size)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_mask: vocab_size = %d, the matcher's is %d", vocab_size,
                       mt->g->bindings[mt->binding].vocab->vocab_size);
    int n = gram_matcher_mask_state(mt, gram_matcher_state(mt), allowed);
    if (n < 0) return tl_fail(TL_ERR_NO_MEMORY, "grammar mask: out of memory (grammar too ambiguous?)");
    *count = n;
    return TL_OK;
}

tl_status tl_grammar_matcher_accepts(tl_grammar_matcher *mt, int32_t token, int *ok) {
    tl_clear_error();
    if (!mt || !ok) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_accepts: NULL argument");
    int32_t next = gram_matcher_advance_state(mt, gram_matcher_state(mt), token);
    if (next < 0) return tl_fail(TL_ERR_NO_MEMORY, "grammar: out of memory (grammar too ambiguous?)");
    *ok = next != GRAM_DEAD;
    return TL_OK;
}

tl_status tl_grammar_matcher_accept(tl_grammar_matcher *mt, int32_t token) {
    tl_clear_error();
    if (!mt) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_matcher_accept: matcher is NULL");
    int32_t next = gram_matcher_advance_state(mt, gram_matcher_state(mt), token);
    if (next < 0) return tl_fail(TL_ERR_NO_MEMORY, "grammar: out of memory (grammar too ambiguous?)");
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
    return mt && gram_accepting(&mt->g->rt, gram_matcher_state(mt));
}

/* ---------------------------------------------------------------- the session's tl_grammar */

static int matcher_allowed(void *user, uint8_t *allowed, int vocab_size) {
    tl_grammar_matcher *mt = user;
    (void)vocab_size;
    return gram_matcher_mask_state(mt, gram_matcher_state(mt), allowed);
}

static int matcher_advance(void *user, int32_t token) {
    return tl_grammar_matcher_accept(user, token) == TL_OK ? 0 : -1;
}

void gram_matcher_as_grammar(tl_grammar_matcher *mt, tl_grammar *out) {
    memset(out, 0, sizeof *out);
    out->user = mt;
    out->allowed = matcher_allowed;
    out->advance = matcher_advance;
}

/* grammar.c: the rule builder, its compilation to a byte-level program (UTF-8 classes,
 * undefined rules, left recursion), the matcher runtime (interned stacks and states) and the
 * public compile / match calls. See grammar.h for the design. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"

/* Limits that keep a hostile grammar from eating the machine: errors, not aborts. */
#define GRAM_MAX_NODES (1 << 23)
#define GRAM_MAX_STATES (1 << 22)
#define GRAM_MAX_EXPANSION (1 << 16) /* stacks one byte may produce: beyond, "too ambiguous" */
/* The most (position, stack) items one expansion takes: a safety net (left recursion, which
   would expand forever, is refused when the grammar is built). */
#define GRAM_MAX_EXPANDED (1 << 22)

bool tl_gram_grow(void **p, int *cap, int need, size_t size) {
    if (need <= *cap) return true;
    if (need > INT32_MAX / 2) return false; /* (the doubling below would overflow) */
    int c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * size);
    if (!q) return false;
    *p = q;
    *cap = c;
    return true;
}

char *tl_gram_copy_text(const char *s, size_t len) {
    char *copy = malloc(len + 1);
    if (!copy) return NULL;
    memcpy(copy, s, len);
    copy[len] = 0;
    return copy;
}

/* ---------------------------------------------------------------- hash tables */

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

bool tl_gram_hash_reserve(tl_gram_hash *h) {
    if ((h->n + 1) * 2 <= h->cap) return true;
    size_t cap = h->cap ? h->cap * 2 : 1024;
    uint64_t *keys = calloc(cap, sizeof *keys);
    int32_t *vals = malloc(cap * sizeof *vals);
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return false;
    }
    for (size_t i = 0; i < h->cap; i++) {
        if (!h->keys[i]) continue;
        size_t j = mix64(h->keys[i]) & (cap - 1);
        while (keys[j]) j = (j + 1) & (cap - 1);
        keys[j] = h->keys[i];
        vals[j] = h->vals[i];
    }
    free(h->keys);
    free(h->vals);
    h->keys = keys;
    h->vals = vals;
    h->cap = cap;
    return true;
}

int32_t tl_gram_hash_get(const tl_gram_hash *h, uint64_t key) {
    if (!h->cap) return -1;
    for (size_t j = mix64(key) & (h->cap - 1);; j = (j + 1) & (h->cap - 1)) {
        if (h->keys[j] == key) return h->vals[j];
        if (!h->keys[j]) return -1;
    }
}

bool tl_gram_hash_put(tl_gram_hash *h, uint64_t key, int32_t val) {
    if (!tl_gram_hash_reserve(h)) return false;
    size_t j = mix64(key) & (h->cap - 1);
    while (h->keys[j] && h->keys[j] != key) j = (j + 1) & (h->cap - 1);
    if (!h->keys[j]) h->n++;
    h->keys[j] = key;
    h->vals[j] = val;
    return true;
}

void tl_gram_hash_clear(tl_gram_hash *h) {
    if (h->cap) memset(h->keys, 0, h->cap * sizeof *h->keys);
    h->n = 0;
}

void tl_gram_hash_free(tl_gram_hash *h) {
    free(h->keys);
    free(h->vals);
    memset(h, 0, sizeof *h);
}

/* ---------------------------------------------------------------- the builder */

void tl_gram_builder_free(tl_gram_builder *b) {
    for (int i = 0; i < b->n_rules; i++) free(b->names[i]);
    free(b->names);
    free(b->defined_at);
    free(b->by_name);
    free(b->used_line);
    free(b->used_col);
    free(b->alt_rule);
    free(b->alt_first);
    free(b->alt_len);
    free(b->items);
    free(b->ranges);
    for (int i = 0; i < b->n_tokens; i++) free(b->tokens[i].text);
    free(b->tokens);
    memset(b, 0, sizeof *b);
}

/* The rule names' table (a schema's grammar has thousands of rules: a linear search per
   reference made building it quadratic). */
static uint32_t name_hash(const char *name, size_t len) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)name[i]) * 16777619u;
    return h;
}

static int32_t *name_slot(const tl_gram_builder *b, const char *name, size_t len) {
    const uint32_t mask = (uint32_t)b->name_slots - 1;
    for (uint32_t at = name_hash(name, len) & mask;; at = (at + 1) & mask) {
        const int32_t r = b->by_name[at];
        if (r < 0 || (strlen(b->names[r]) == len && memcmp(b->names[r], name, len) == 0)) return &b->by_name[at];
    }
}

/* Room in the table for one more name; false out of memory. */
static bool reserve_name(tl_gram_builder *b) {
    if (2 * (b->n_rules + 1) <= b->name_slots) return true;
    const int slots = b->name_slots ? 2 * b->name_slots : 64;
    int32_t *table = malloc((size_t)slots * sizeof *table);
    if (!table) return false;
    for (int i = 0; i < slots; i++) table[i] = -1;
    int32_t *old = b->by_name;
    b->by_name = table;
    b->name_slots = slots;
    for (int r = 0; r < b->n_rules; r++) *name_slot(b, b->names[r], strlen(b->names[r])) = r;
    free(old);
    return true;
}

static int add_rule(tl_gram_builder *b, char *name) {
    if (!name) return -1;
    if (!reserve_name(b)) { free(name); return -1; }
    const int n = b->n_rules + 1;
    int cap = b->cap_rules;
    if (!tl_gram_grow((void **)&b->names, &cap, n, sizeof *b->names)) { free(name); return -1; }
    cap = b->cap_rules;
    if (!tl_gram_grow((void **)&b->defined_at, &cap, n, sizeof *b->defined_at)) { free(name); return -1; }
    cap = b->cap_rules;
    if (!tl_gram_grow((void **)&b->used_line, &cap, n, sizeof *b->used_line)) { free(name); return -1; }
    cap = b->cap_rules;
    if (!tl_gram_grow((void **)&b->used_col, &cap, n, sizeof *b->used_col)) { free(name); return -1; }
    b->cap_rules = cap;
    b->names[b->n_rules] = name;
    *name_slot(b, name, strlen(name)) = b->n_rules;
    b->defined_at[b->n_rules] = -1;
    b->used_line[b->n_rules] = 0;
    b->used_col[b->n_rules] = 0;
    return b->n_rules++;
}

int tl_gram_builder_rule(tl_gram_builder *b, const char *name, size_t len) {
    if (b->name_slots > 0) {
        const int32_t known = *name_slot(b, name, len);
        if (known >= 0) return known;
    }
    char *copy = malloc(len + 1);
    if (copy) {
        memcpy(copy, name, len);
        copy[len] = 0;
    }
    return add_rule(b, copy);
}

int tl_gram_builder_fresh_rule(tl_gram_builder *b, int parent) {
    const char *base = parent >= 0 ? b->names[parent] : "rule";
    size_t len = strlen(base) + 16;
    char *name = malloc(len);
    if (name) snprintf(name, len, "%s(%d)", base, b->n_rules); /* not a GBNF name: no clash */
    int r = add_rule(b, name);
    if (r >= 0) b->defined_at[r] = 0; /* generated: defined by construction */
    return r;
}

/* ---------------------------------------------------------------- UTF-8 ranges */

typedef struct byte_seq { int n; uint8_t lo[4], hi[4]; } byte_seq;

static int utf8_encode(uint32_t c, uint8_t *out) {
    if (c < 0x80) { out[0] = (uint8_t)c; return 1; }
    if (c < 0x800) { out[0] = (uint8_t)(0xC0 | (c >> 6)); out[1] = (uint8_t)(0x80 | (c & 0x3F)); return 2; }
    if (c < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (c >> 12));
        out[1] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (c & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (c >> 18));
    out[1] = (uint8_t)(0x80 | ((c >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (c & 0x3F));
    return 4;
}

/* Splits the code point range [lo, hi] (no surrogates, <= U+10FFFF) into byte-range sequences,
   each matching exactly the UTF-8 encodings of a sub-range (the utf8-ranges algorithm). */
static bool utf8_split(uint32_t lo, uint32_t hi, byte_seq **out, int *n, int *cap) {
    static const uint32_t bounds[] = {0x7F, 0x7FF, 0xFFFF};
    if (lo > hi) return true;
    for (int i = 0; i < 3; i++)
        if (lo <= bounds[i] && hi > bounds[i])
            return utf8_split(lo, bounds[i], out, n, cap) && utf8_split(bounds[i] + 1, hi, out, n, cap);
    if (hi >= 0x80) {
        for (int i = 1; i < 4; i++) {
            const uint32_t m = (1u << (6 * i)) - 1;
            if ((lo & ~m) != (hi & ~m)) {
                if ((lo & m) != 0)
                    return utf8_split(lo, lo | m, out, n, cap) && utf8_split((lo | m) + 1, hi, out, n, cap);
                if ((hi & m) != m)
                    return utf8_split(lo, (hi & ~m) - 1, out, n, cap) && utf8_split(hi & ~m, hi, out, n, cap);
            }
        }
    }
    if (!tl_gram_grow((void **)out, cap, *n + 1, sizeof **out)) return false;
    byte_seq *s = &(*out)[(*n)++];
    uint8_t a[4], b[4];
    s->n = utf8_encode(lo, a);
    utf8_encode(hi, b);
    for (int i = 0; i < s->n; i++) { s->lo[i] = a[i]; s->hi[i] = b[i]; }
    return true;
}

/* ---------------------------------------------------------------- compiling the builder */

typedef struct prog_writer {
    tl_gram_program *p;
    int cap_elems, cap_alts, cap_sets, cap_rules;
    tl_gram_hash set_ids;
    /* generated rules of multi-byte classes: their alternatives, laid out after the others */
    byte_seq **gen_seqs;
    int *gen_n;
    int n_gen, cap_gen, cap_gen_n;
    int first_gen;
    bool out_of_memory; /* an emit failed to grow (not the size limit) */
} prog_writer;

static int add_set(prog_writer *w, const tl_gram_byteset *set) {
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < 4; i++) h = mix64(h ^ set->bits[i]);
    h |= 1;
    int32_t at = tl_gram_hash_get(&w->set_ids, h);
    if (at >= 0 && memcmp(&w->p->sets[at], set, sizeof *set) == 0) return at;
    tl_gram_program *p = w->p;
    if (!tl_gram_grow((void **)&p->sets, &w->cap_sets, p->n_sets + 1, sizeof *p->sets)) return -1;
    p->sets[p->n_sets] = *set;
    if (at < 0 && !tl_gram_hash_put(&w->set_ids, h, p->n_sets)) return -1;
    return p->n_sets++;
}

static bool emit(prog_writer *w, uint8_t kind, int32_t arg) {
    tl_gram_program *p = w->p;
    if (p->n_elems >= GRAM_MAX_ELEMS) return false;
    if (!tl_gram_grow((void **)&p->elems, &w->cap_elems, p->n_elems + 1, sizeof *p->elems)) return !(w->out_of_memory = true);
    p->elems[p->n_elems++] = (tl_gram_elem){kind, arg};
    return true;
}

static bool begin_alt(prog_writer *w) {
    tl_gram_program *p = w->p;
    if (!tl_gram_grow((void **)&p->alt_start, &w->cap_alts, p->n_alts + 1, sizeof *p->alt_start)) return false;
    p->alt_start[p->n_alts++] = p->n_elems;
    return true;
}

static void set_range(tl_gram_byteset *s, unsigned lo, unsigned hi) {
    for (unsigned b = lo; b <= hi; b++) s->bits[b >> 6] |= 1ull << (b & 63);
}

/* One class element: a byte set when every code point is ASCII, else a call of a generated
   rule whose alternatives are the UTF-8 byte sequences. */
static bool emit_class(prog_writer *w, const tl_gram_range *ranges, int n_ranges, bool *oom) {
    bool ascii = true;
    for (int i = 0; i < n_ranges; i++)
        if (ranges[i].hi >= 0x80) ascii = false;
    if (ascii) {
        tl_gram_byteset set = {{0}};
        for (int i = 0; i < n_ranges; i++) set_range(&set, ranges[i].lo, ranges[i].hi);
        int id = add_set(w, &set);
        if (id < 0) return !(*oom = true);
        return emit(w, GE_BYTES, id);
    }
    byte_seq *seqs = NULL;
    int n = 0, cap = 0;
    for (int i = 0; i < n_ranges; i++) {
        uint32_t lo = ranges[i].lo, hi = ranges[i].hi;
        bool ok = true;
        if (lo < 0xD800 && hi > 0xDFFF) ok = utf8_split(lo, 0xD7FF, &seqs, &n, &cap) && utf8_split(0xE000, hi, &seqs, &n, &cap);
        else if (lo >= 0xD800 && hi <= 0xDFFF) ok = true;
        else if (lo >= 0xD800 && lo <= 0xDFFF) ok = utf8_split(0xE000, hi, &seqs, &n, &cap);
        else if (hi >= 0xD800 && hi <= 0xDFFF) ok = utf8_split(lo, 0xD7FF, &seqs, &n, &cap);
        else ok = utf8_split(lo, hi, &seqs, &n, &cap);
        if (!ok) { free(seqs); return !(*oom = true); }
    }
    if (!tl_gram_grow((void **)&w->gen_seqs, &w->cap_gen, w->n_gen + 1, sizeof *w->gen_seqs) ||
        !tl_gram_grow((void **)&w->gen_n, &w->cap_gen_n, w->n_gen + 1, sizeof *w->gen_n)) {
        free(seqs);
        return !(*oom = true);
    }
    w->gen_seqs[w->n_gen] = seqs;
    w->gen_n[w->n_gen] = n;
    return emit(w, GE_REF, w->first_gen + w->n_gen++);
}

void tl_gram_program_free(tl_gram_program *p) {
    if (!p) return;
    for (int i = 0; i < p->n_tokens; i++) free(p->tokens[i].text);
    free(p->tokens);
    for (int i = 0; p->rule_names && i < p->n_rules; i++) free(p->rule_names[i]);
    free(p->rule_names);
    free(p->elems);
    free(p->alt_start);
    free(p->rule_alts);
    free(p->sets);
    free(p);
}

/* Which rules derive a string of what passes: with bytes_pass, some text (productive); without,
   the empty string (nullable). A work list: an alternative waits at the first call that has not
   passed yet, and moves on when that rule is found; each element is passed once. (A loop to a
   fixpoint took one pass over the grammar per rule of a chain r1 ::= r2, r2 ::= r3...:
   quadratic, 21 s for a 1.4 MB grammar.) */
typedef struct derive_walk {
    const tl_gram_program *p;
    bool bytes_pass;
    bool *done;
    int32_t *alt_rule, *cursor, *wait_head, *wait_next, *queue;
    int n_queue;
} derive_walk;

static void derive_step(derive_walk *w, int a) {
    const tl_gram_elem *el = w->p->elems;
    int pos = w->cursor[a];
    while (((el[pos].kind == GE_BYTES || el[pos].kind == GE_TOKEN) && w->bytes_pass) ||
           (el[pos].kind == GE_REF && w->done[el[pos].arg]))
        pos++;
    w->cursor[a] = pos;
    if (el[pos].kind == GE_END) {
        const int r = w->alt_rule[a];
        if (!w->done[r]) {
            w->done[r] = true;
            w->queue[w->n_queue++] = r;
        }
    } else if (el[pos].kind == GE_REF) { /* wait for the callee */
        w->wait_next[a] = w->wait_head[el[pos].arg];
        w->wait_head[el[pos].arg] = a;
    } /* a byte or a token, not passing: this alternative never derives the empty string */
}

static bool derive_rules(const tl_gram_program *p, bool bytes_pass, bool *done) {
    const int R = p->n_rules, A = p->n_alts;
    derive_walk w = {.p = p, .bytes_pass = bytes_pass, .done = done};
    w.alt_rule = malloc(((size_t)A + 1) * sizeof *w.alt_rule);
    w.cursor = malloc(((size_t)A + 1) * sizeof *w.cursor);
    w.wait_next = malloc(((size_t)A + 1) * sizeof *w.wait_next);
    w.wait_head = malloc(((size_t)R + 1) * sizeof *w.wait_head);
    w.queue = malloc(((size_t)R + 1) * sizeof *w.queue);
    const bool ok = w.alt_rule && w.cursor && w.wait_next && w.wait_head && w.queue;
    if (ok) {
        memset(done, 0, (size_t)R);
        for (int r = 0; r < R; r++) {
            w.wait_head[r] = -1;
            for (int a = p->rule_alts[r]; a < p->rule_alts[r + 1]; a++) w.alt_rule[a] = r;
        }
        for (int a = 0; a < A; a++) {
            w.cursor[a] = p->alt_start[a];
            derive_step(&w, a);
        }
        for (int head = 0; head < w.n_queue; head++) {
            const int r = w.queue[head];
            int a = w.wait_head[r];
            w.wait_head[r] = -1;
            while (a >= 0) {
                const int next = w.wait_next[a];
                derive_step(&w, a); /* its call of r passes now */
                a = next;
            }
        }
    }
    free(w.alt_rule);
    free(w.cursor);
    free(w.wait_next);
    free(w.wait_head);
    free(w.queue);
    return ok;
}

/* Whether rule `star` is x*: star ::= x star | "" (what x* and x+ write). */
static bool is_star_of(const tl_gram_program *p, int star, int x) {
    const int a = p->rule_alts[star];
    if (p->rule_alts[star + 1] - a != 2) return false;
    const tl_gram_elem *loop = &p->elems[p->alt_start[a]], *empty = &p->elems[p->alt_start[a + 1]];
    return loop[0].kind == GE_REF && loop[0].arg == x && loop[1].kind == GE_REF && loop[1].arg == star &&
           loop[2].kind == GE_END && empty[0].kind == GE_END;
}

enum { DROPPED = 255 }; /* an element marked for removal (no element kind) */

/* Removes the elements marked DROPPED: alternatives lie in order, so the compacted copy never
   overtakes its source. */
static void compact(tl_gram_program *p) {
    int w = 0;
    for (int a = 0; a < p->n_alts; a++) {
        int pos = p->alt_start[a];
        p->alt_start[a] = w;
        for (;; pos++) {
            if (p->elems[pos].kind == DROPPED) continue;
            p->elems[w++] = p->elems[pos];
            if (p->elems[pos].kind == GE_END) break;
        }
    }
    p->n_elems = w;
}

/* A call of a rule that matches only the empty string ((""){5,720}, a regular expression's
   (?:){5,720}) matches nothing: it is dropped. Kept, each was a chain of calls that every
   expansion walked again: ((?:){5,720}|[^"]?){5,720} walked 720 x 720 calls per byte, 2 s for
   56 bytes. A rule is empty-only when each of its alternatives calls only empty-only rules: a
   least fixpoint by a work list (a cycle of such rules stays, which costs speed, not
   correctness). False out of memory (nothing dropped). */
static bool drop_empty_only_calls(tl_gram_program *p) {
    const int R = p->n_rules, A = p->n_alts;
    int32_t *alt_rule = malloc(((size_t)A + 1) * sizeof *alt_rule), *alt_waiting = malloc(((size_t)A + 1) * sizeof *alt_waiting);
    int32_t *rule_waiting = malloc(((size_t)R + 1) * sizeof *rule_waiting), *queue = malloc(((size_t)R + 1) * sizeof *queue);
    int32_t *calls_first = calloc((size_t)R + 2, sizeof *calls_first); /* rule r's calls: calls_alt[calls_first[r]..] */
    int32_t *calls_alt = NULL;
    bool *empty_only = calloc((size_t)R + 1, sizeof *empty_only), ok = false;
    if (!alt_rule || !alt_waiting || !rule_waiting || !queue || !calls_first || !empty_only) goto done;
    int n_calls = 0;
    for (int r = 0; r < R; r++) {
        rule_waiting[r] = p->rule_alts[r + 1] - p->rule_alts[r];
        for (int a = p->rule_alts[r]; a < p->rule_alts[r + 1]; a++) {
            alt_rule[a] = r;
            alt_waiting[a] = 0;
            for (int pos = p->alt_start[a]; p->elems[pos].kind != GE_END; pos++) {
                if (p->elems[pos].kind != GE_REF) alt_waiting[a] = INT32_MIN; /* a byte or a token: never empty */
                else {
                    alt_waiting[a]++;
                    calls_first[p->elems[pos].arg + 1]++;
                    n_calls++;
                }
            }
        }
    }
    for (int r = 0; r < R; r++) calls_first[r + 1] += calls_first[r];
    if (!(calls_alt = malloc(((size_t)n_calls + 1) * sizeof *calls_alt))) goto done;
    int32_t *fill = queue; /* (the queue is not in use yet: it holds the fill positions) */
    for (int r = 0; r < R; r++) fill[r] = calls_first[r];
    for (int a = 0; a < A; a++)
        for (int pos = p->alt_start[a]; p->elems[pos].kind != GE_END; pos++)
            if (p->elems[pos].kind == GE_REF) calls_alt[fill[p->elems[pos].arg]++] = a;
    int n_queue = 0;
    for (int a = 0; a < A; a++)
        if (alt_waiting[a] == 0) rule_waiting[alt_rule[a]]--;
    for (int r = 0; r < R; r++)
        if (rule_waiting[r] == 0 && p->rule_alts[r + 1] > p->rule_alts[r]) {
            empty_only[r] = true;
            queue[n_queue++] = r;
        }
    for (int head = 0; head < n_queue; head++) {
        const int r = queue[head];
        for (int k = calls_first[r]; k < calls_first[r + 1]; k++) {
            const int a = calls_alt[k];
            if (alt_waiting[a] > 0 && --alt_waiting[a] == 0 && --rule_waiting[alt_rule[a]] == 0 && !empty_only[alt_rule[a]]) {
                empty_only[alt_rule[a]] = true;
                queue[n_queue++] = alt_rule[a];
            }
        }
    }
    bool any = false;
    for (int pos = 0; pos < p->n_elems; pos++)
        if (p->elems[pos].kind == GE_REF && empty_only[p->elems[pos].arg]) {
            p->elems[pos].kind = DROPPED;
            any = true;
        }
    if (any) compact(p);
    ok = true;
done:
    free(alt_rule);
    free(alt_waiting);
    free(rule_waiting);
    free(queue);
    free(calls_first);
    free(calls_alt);
    free(empty_only);
    return ok;
}

/* x x* is x* when x may be empty (x+ writes x x*, x{3,} x x x*): its first turns are the star's.
   Kept, the two readings of every x were two stacks, and x nested k deep ((("a"?)+)+ ...) was
   2^k stacks: a 66-byte grammar failed to compile at k = 16. */
static void drop_nullable_plus_heads(tl_gram_program *p, const bool *nullable) {
    bool any = false;
    /* backwards, each x against the next element kept, so that x x x* ({3,}) is x* too */
    for (int pos = p->n_elems - 1, next = -1; pos >= 0; pos--) {
        const tl_gram_elem *e = &p->elems[pos], *after = next >= 0 ? &p->elems[next] : NULL;
        if (e->kind == GE_REF && after && after->kind == GE_REF && nullable[e->arg] && is_star_of(p, after->arg, e->arg) &&
            pos != p->alt_start[p->rule_alts[after->arg]] /* not the star's own x star */) {
            p->elems[pos].kind = DROPPED;
            any = true;
            continue;
        }
        next = pos; /* (an alternative's GE_END too: nothing pairs across alternatives) */
    }
    if (any) compact(p);
}

/* Left recursion: a rule that can reach itself without consuming a byte.
   Edges r -> callee for each call on an alternative's left edge (after nullable calls only),
   marked "tail" when the call is its alternative's last element. A cycle through a call that
   is not a tail call pushes a frame on every turn and would expand forever: an error. A cycle
   of tail calls only ("a"? repeated: r ::= x r | "" with x nullable) revisits the same stack,
   which the matcher recognises (expand: each call once per closure). Cycles are found as strongly connected
   components (Tarjan's, iterative). */
static tl_status check_left_recursion(tl_gram_program *p, char *err, size_t errlen) {
    const int R = p->n_rules;
    bool *nullable = calloc((size_t)R + 1, 1);
    int32_t *edge_first = calloc((size_t)R + 1, sizeof *edge_first);
    int32_t *edges = NULL;
    uint8_t *edge_tail = NULL;
    int32_t *order = malloc((size_t)R * sizeof *order), *low = malloc((size_t)R * sizeof *low);
    int32_t *comp = malloc((size_t)R * sizeof *comp), *tstack = malloc((size_t)R * sizeof *tstack);
    int32_t *dfs = malloc((size_t)R * sizeof *dfs), *cursor = malloc((size_t)R * sizeof *cursor);
    int n_edges = 0, cap_edges = 0, cap_tail = 0;
    tl_status st = TL_OK;
    if (!nullable || !edge_first || !order || !low || !comp || !tstack || !dfs || !cursor) goto oom;
    if (!drop_empty_only_calls(p) || !derive_rules(p, false, nullable)) goto oom;
    drop_nullable_plus_heads(p, nullable);
    for (int r = 0; r < R; r++) {
        edge_first[r] = n_edges;
        for (int a = p->rule_alts[r]; a < p->rule_alts[r + 1]; a++)
            for (int pos = p->alt_start[a]; p->elems[pos].kind == GE_REF; pos++) {
                if (!tl_gram_grow((void **)&edges, &cap_edges, n_edges + 1, sizeof *edges) ||
                    !tl_gram_grow((void **)&edge_tail, &cap_tail, n_edges + 1, sizeof *edge_tail))
                    goto oom;
                edge_tail[n_edges] = p->elems[pos + 1].kind == GE_END;
                edges[n_edges++] = p->elems[pos].arg;
                if (!nullable[p->elems[pos].arg]) break;
            }
    }
    edge_first[R] = n_edges;
    /* productive: derives some text (an alternative of bytes and productive calls); a cycle
       of tail calls among rules that are not ("r ::= r") only recurs: an error too */
    bool *productive = nullable; /* (nullable is no longer needed: reused) */
    if (!derive_rules(p, true, productive)) goto oom;
    /* Tarjan: order[r] = visit number (-1 unvisited), low[r] = lowest reachable on the stack */
    for (int r = 0; r < R; r++) order[r] = comp[r] = -1;
    int visited = 0, n_tstack = 0, n_comps = 0;
    for (int start = 0; start < R; start++) {
        if (order[start] >= 0) continue;
        int depth = 0;
        dfs[0] = start;
        cursor[0] = edge_first[start];
        order[start] = low[start] = visited++;
        tstack[n_tstack++] = start;
        while (depth >= 0) {
            const int r = dfs[depth];
            if (cursor[depth] < edge_first[r + 1]) {
                const int callee = edges[cursor[depth]++];
                if (order[callee] < 0) {
                    order[callee] = low[callee] = visited++;
                    tstack[n_tstack++] = callee;
                    dfs[++depth] = callee;
                    cursor[depth] = edge_first[callee];
                } else if (comp[callee] < 0 && order[callee] < low[r]) low[r] = order[callee]; /* on the stack */
                continue;
            }
            if (low[r] == order[r]) { /* r roots a component: pop it */
                int member;
                do { member = tstack[--n_tstack]; comp[member] = n_comps; } while (member != r);
                n_comps++;
            }
            if (--depth >= 0 && low[r] < low[dfs[depth]]) low[dfs[depth]] = low[r];
        }
    }
    for (int r = 0; r < R && st == TL_OK; r++)
        for (int e = edge_first[r]; e < edge_first[r + 1]; e++) {
            const int callee = edges[e];
            if (comp[callee] != comp[r]) continue;
            if (edge_tail[e] && productive[r]) continue;
            /* the cycle for the message: a path callee -> ... -> r inside the component, each
               rule once (marked before its edges are scanned: a self-edge cannot repeat it) */
            int n_path = 0;
            for (int at = callee; n_path < R;) {
                dfs[n_path++] = at;
                if (at == r) break;
                order[at] = -1; /* (visit numbers are no longer needed: mark the path) */
                int next = -1;
                for (int f = edge_first[at]; f < edge_first[at + 1] && next < 0; f++)
                    if (comp[edges[f]] == comp[r] && order[edges[f]] >= 0) next = edges[f];
                if (next < 0) break;
                at = next;
            }
            size_t at = (size_t)snprintf(err, errlen, "rule '%s' is left-recursive: %s", p->rule_names[r], p->rule_names[r]);
            for (int k = 0; k < n_path && at < errlen; k++)
                at += (size_t)snprintf(err + at, errlen - at, " -> %s", p->rule_names[dfs[k]]);
            if (dfs[n_path - 1] != r && at < errlen) snprintf(err + at, errlen - at, " -> ... -> %s", p->rule_names[r]);
            st = TL_ERR_INVALID_ARGUMENT;
            break;
        }
    /* A rule that never ends ("x ::= "c" x": every alternative calls a rule that does not
       end) would let tokens into a path no text finishes; a user's rule is named before a
       generated group's (named after its rule, "x(3)"). */
    for (int pass = 0; pass < 2 && st == TL_OK; pass++)
        for (int r = 0; r < R && st == TL_OK; r++) {
            if (productive[r] || (pass == 0) == (strchr(p->rule_names[r], '(') != NULL)) continue;
            snprintf(err, errlen, "rule '%s' never ends: each of its alternatives calls a rule that never ends "
                     "(as x ::= \"c\" x does; x ::= \"c\" x | \"c\" ends)", p->rule_names[r]);
            st = TL_ERR_INVALID_ARGUMENT;
        }
    goto done;
oom:
    snprintf(err, errlen, "out of memory");
    st = TL_ERR_NO_MEMORY;
done:
    free(nullable);
    free(edge_first);
    free(edges);
    free(edge_tail);
    free(order);
    free(low);
    free(comp);
    free(tstack);
    free(dfs);
    free(cursor);
    return st;
}

tl_status tl_gram_build(const tl_gram_builder *b, tl_gram_program **out, char *err, size_t errlen) {
    *out = NULL;
    if (b->n_rules == 0) {
        snprintf(err, errlen, "empty grammar: no rules (a grammar needs at least 'root ::= ...')");
        return TL_ERR_INVALID_ARGUMENT;
    }
    for (int r = 0; r < b->n_rules; r++)
        if (b->defined_at[r] < 0) {
            snprintf(err, errlen, "line %d, column %d: undefined rule '%s'", b->used_line[r], b->used_col[r],
                     b->names[r]);
            return TL_ERR_INVALID_ARGUMENT;
        }
    int root = -1;
    for (int r = 0; r < b->n_rules; r++)
        if (strcmp(b->names[r], "root") == 0) root = r;
    if (root < 0) {
        snprintf(err, errlen, "no rule named 'root' (the start rule)");
        return TL_ERR_INVALID_ARGUMENT;
    }
    tl_gram_program *p = calloc(1, sizeof *p);
    prog_writer w = {.p = p, .first_gen = b->n_rules};
    bool oom = !p;
    /* Alternatives of each rule, in rule order. */
    int *rule_alt_count = calloc((size_t)b->n_rules + 1, sizeof *rule_alt_count);
    int32_t *by_rule = malloc(((size_t)b->n_alts + 1) * sizeof *by_rule);
    if (!rule_alt_count || !by_rule) oom = true;
    if (!oom) {
        for (int a = 0; a < b->n_alts; a++) rule_alt_count[b->alt_rule[a]]++;
        int *fill = calloc((size_t)b->n_rules + 1, sizeof *fill);
        if (!fill) oom = true;
        for (int r = 0, at = 0; !oom && r < b->n_rules; r++) { fill[r] = at; at += rule_alt_count[r]; }
        for (int a = 0; !oom && a < b->n_alts; a++) by_rule[fill[b->alt_rule[a]]++] = a;
        free(fill);
    }
    int cap_ra = 0;
    bool too_big = false;
    for (int r = 0, k = 0; !oom && !too_big && r < b->n_rules; r++) {
        if (!tl_gram_grow((void **)&p->rule_alts, &cap_ra, r + 2, sizeof *p->rule_alts)) { oom = true; break; }
        p->rule_alts[r] = p->n_alts;
        for (int i = 0; i < rule_alt_count[r] && !oom && !too_big; i++, k++) {
            const int a = by_rule[k];
            if (!begin_alt(&w)) { oom = true; break; }
            for (int j = 0; j < b->alt_len[a]; j++) {
                const tl_gram_item *it = &b->items[b->alt_first[a] + j];
                bool ok = it->kind == GE_REF || it->kind == GE_TOKEN
                              ? emit(&w, (uint8_t)it->kind, it->arg)
                              : emit_class(&w, b->ranges ? b->ranges + it->arg : NULL, it->n_ranges, &oom);
                if (!ok) { too_big = !oom; break; }
            }
            if (!oom && !too_big && !emit(&w, GE_END, 0)) too_big = true;
        }
    }
    /* The generated rules of multi-byte classes. */
    for (int g = 0; !oom && !too_big && g < w.n_gen; g++) {
        const int r = b->n_rules + g;
        if (!tl_gram_grow((void **)&p->rule_alts, &cap_ra, r + 2, sizeof *p->rule_alts)) { oom = true; break; }
        p->rule_alts[r] = p->n_alts;
        tl_gram_byteset single = {{0}};
        bool any_single = false;
        for (int i = 0; i < w.gen_n[g]; i++) {
            const byte_seq *s = &w.gen_seqs[g][i];
            if (s->n == 1) { set_range(&single, s->lo[0], s->hi[0]); any_single = true; continue; }
            if (!begin_alt(&w)) { oom = true; break; }
            for (int j = 0; j < s->n && !oom; j++) {
                tl_gram_byteset set = {{0}};
                set_range(&set, s->lo[j], s->hi[j]);
                int id = add_set(&w, &set);
                if (id < 0) oom = true;
                else if (!emit(&w, GE_BYTES, id)) too_big = true;
            }
            if (!emit(&w, GE_END, 0)) too_big = true;
        }
        if (any_single && !oom && !too_big) {
            int id = add_set(&w, &single);
            if (id < 0 || !begin_alt(&w)) oom = true;
            else if (!emit(&w, GE_BYTES, id) || !emit(&w, GE_END, 0)) too_big = true;
        }
        if (p->n_alts == p->rule_alts[r] && !oom && !too_big) {
            /* an empty class (e.g. only surrogates): a rule with no alternative matches nothing,
               which the matcher handles; keep one impossible alternative for uniformity */
            tl_gram_byteset none = {{0}};
            int id = add_set(&w, &none);
            if (id < 0 || !begin_alt(&w)) oom = true;
            else if (!emit(&w, GE_BYTES, id) || !emit(&w, GE_END, 0)) too_big = true;
        }
    }
    if (!oom && p && b->n_tokens) { /* the token references, copied */
        p->tokens = calloc((size_t)b->n_tokens, sizeof *p->tokens);
        if (!p->tokens) oom = true;
        for (int i = 0; !oom && i < b->n_tokens; i++) {
            const char *text = b->tokens[i].text;
            p->tokens[i] = b->tokens[i];
            p->tokens[i].text = text ? tl_gram_copy_text(text, strlen(text)) : NULL;
            p->n_tokens = i + 1;
            oom = text && !p->tokens[i].text;
        }
    }
    if (!oom && p) {
        p->n_rules = b->n_rules + w.n_gen;
        if (!tl_gram_grow((void **)&p->rule_alts, &cap_ra, p->n_rules + 1, sizeof *p->rule_alts)) oom = true;
        else p->rule_alts[p->n_rules] = p->n_alts;
        p->root = root;
        p->rule_names = calloc((size_t)p->n_rules + 1, sizeof *p->rule_names);
        if (!p->rule_names) oom = true;
        for (int r = 0; !oom && r < p->n_rules; r++) {
            const char *src = r < b->n_rules ? b->names[r] : "character class";
            p->rule_names[r] = malloc(strlen(src) + 1);
            if (!p->rule_names[r]) oom = true;
            else strcpy(p->rule_names[r], src);
        }
    }
    for (int g = 0; g < w.n_gen; g++) free(w.gen_seqs[g]);
    free(w.gen_seqs);
    free(w.gen_n);
    tl_gram_hash_free(&w.set_ids);
    free(rule_alt_count);
    free(by_rule);
    oom = oom || w.out_of_memory; /* (a failed emit reads as "too big" above) */
    if (oom || too_big) {
        tl_gram_program_free(p);
        snprintf(err, errlen, oom ? "out of memory compiling the grammar" : "grammar too large (more than %d elements)",
                 GRAM_MAX_ELEMS);
        return oom ? TL_ERR_NO_MEMORY : TL_ERR_INVALID_ARGUMENT;
    }
    tl_status st = check_left_recursion(p, err, errlen);
    if (st != TL_OK) {
        tl_gram_program_free(p);
        return st;
    }
    *out = p;
    return TL_OK;
}

/* ---------------------------------------------------------------- the runtime */

/* Why the calling thread's last runtime call returned -1, when a limit (not memory) stopped it:
   the calls return -1 either way, and tl_gram_failure words the error. Per thread, as each call
   runs on its caller's thread (under the grammar's lock). */
enum { FAILED_MEMORY, FAILED_AMBIGUOUS, FAILED_FULL, FAILED_COSTLY };
static _Thread_local int last_failure;

tl_status tl_gram_failure(const char *what) {
    const int why = last_failure;
    last_failure = FAILED_MEMORY;
    if (why == FAILED_AMBIGUOUS)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "%s: the grammar is too ambiguous here: more than %d parses at one point of the text "
                       "(alternatives that begin alike, nested: a recursive anyOf whose branches share their first "
                       "property, or repetitions of what may be empty, say; give them distinct beginnings)",
                       what, GRAM_MAX_EXPANSION);
    if (why == FAILED_COSTLY)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "%s: the grammar is too costly to follow: one token's choices took more than %lld parse steps "
                       "(very many alternatives alive at once, that begin alike; give them distinct beginnings)",
                       what, (long long)GRAM_MAX_MASK_WORK);
    if (why == FAILED_FULL)
        return tl_fail(TL_ERR_NO_MEMORY, "%s: the grammar's tables are full (%d stacks or %d states)", what, GRAM_MAX_NODES,
                       GRAM_MAX_STATES);
    return tl_fail(TL_ERR_NO_MEMORY, "%s: out of memory", what);
}

/* The token reference stack node n waits on, or NULL (a byte set, the empty stack, the
   projection's stand-in). */
static const tl_gram_elem *ref_top(const tl_gram_runtime *rt, int32_t n) {
    if (n <= 0 || rt->nodes[n].pos < 0) return NULL;
    const tl_gram_elem *e = &rt->prog->elems[rt->nodes[n].pos];
    return e->kind == GE_TOKEN ? e : NULL;
}

static int32_t intern_node(tl_gram_runtime *rt, int32_t pos, int32_t parent) {
    const uint64_t key = ((uint64_t)(uint32_t)(pos + 1) << 32) | (uint32_t)parent;
    int32_t id = tl_gram_hash_get(&rt->node_ids, key);
    if (id >= 0) return id;
    if (rt->n_nodes >= GRAM_MAX_NODES) {
        last_failure = FAILED_FULL;
        return -1;
    }
    if (!tl_gram_grow((void **)&rt->nodes, &rt->cap_nodes, rt->n_nodes + 1, sizeof *rt->nodes)) return -1;
    id = rt->n_nodes++;
    rt->nodes[id] = (tl_gram_node){pos, parent};
    if (!tl_gram_hash_put(&rt->node_ids, key, id)) return -1;
    return id;
}

static bool push_scratch(tl_gram_runtime *rt, int32_t v) {
    if (rt->n_scratch >= GRAM_MAX_EXPANSION) {
        last_failure = FAILED_AMBIGUOUS;
        return false;
    }
    if (rt->n_scratch == rt->cap_scratch) {
        size_t cap = rt->cap_scratch ? rt->cap_scratch * 2 : 256;
        int32_t *q = realloc(rt->scratch, cap * sizeof *q);
        if (!q) return false;
        rt->scratch = q;
        rt->cap_scratch = cap;
    }
    rt->scratch[rt->n_scratch++] = v;
    return true;
}

/* A new closure number (rt->called's values): past INT32_MAX the table starts again. */
static void next_closure(tl_gram_runtime *rt) {
    if (rt->closure == INT32_MAX) {
        tl_gram_hash_clear(&rt->called);
        rt->closure = 0;
    }
    rt->closure++;
}

static bool push_pending(tl_gram_runtime *rt, int32_t pos, int32_t parent) {
    if (rt->n_pending + 2 > rt->cap_pending) {
        size_t cap = rt->cap_pending ? rt->cap_pending * 2 : 256;
        int32_t *q = realloc(rt->pending, cap * sizeof *q);
        if (!q) return false;
        rt->pending = q;
        rt->cap_pending = cap;
    }
    rt->pending[rt->n_pending++] = pos;
    rt->pending[rt->n_pending++] = parent;
    return true;
}

/* Every stack that starts at `pos` with `parent` below, expanded until its top is a byte set
   (or it is empty: the grammar may end here). Appends node ids to the scratch list. A work
   list, not recursion: a run of a thousand nullable items ("a"?){1000} expands a thousand
   calls deep. A byte set that holds no byte (an empty class, never()) is no stack: a token
   that can only reach it leads nowhere, and the mask leaves it out. */
static bool expand(tl_gram_runtime *rt, int32_t pos0, int32_t parent0) {
    const tl_gram_program *p = rt->prog;
    rt->n_pending = 0;
    if (!push_pending(rt, pos0, parent0)) return false;
    for (long taken = 0; rt->n_pending > 0; taken++) {
        if (taken > GRAM_MAX_EXPANDED) {
            last_failure = FAILED_AMBIGUOUS;
            return false;
        }
        int32_t parent = rt->pending[--rt->n_pending];
        int32_t pos = rt->pending[--rt->n_pending];
        for (;;) {
            const tl_gram_elem e = p->elems[pos];
            if (e.kind == GE_END) {
                if (parent == 0) { if (!push_scratch(rt, 0)) return false; break; }
                if (parent == rt->esc_node) { if (!push_scratch(rt, parent)) return false; break; } /* below a projection's cut */
                pos = rt->nodes[parent].pos;
                parent = rt->nodes[parent].parent;
                continue;
            }
            if (e.kind == GE_BYTES || e.kind == GE_TOKEN) {
                const tl_gram_byteset *set = e.kind == GE_BYTES ? &p->sets[e.arg] : NULL;
                if (set && !(set->bits[0] | set->bits[1] | set->bits[2] | set->bits[3])) break;
                int32_t n = intern_node(rt, pos, parent);
                if (n < 0 || !push_scratch(rt, n)) return false;
                break;
            }
            /* A call: what follows it is pushed, unless the call is the alternative's last element
               (a tail call pushes nothing, so repetition does not grow the stack). */
            int32_t cont = parent;
            if (p->elems[pos + 1].kind != GE_END && (cont = intern_node(rt, pos + 1, parent)) < 0) return false;
            /* A call with the same stack below expands to the same stacks: once per closure.
               That ends a cycle of tail calls (a repeated nullable item comes back to the same
               call with the same stack below), and keeps ambiguous nullable alternatives
               ((a?|b?){16}) from expanding every way they can be empty. */
            const uint64_t key = ((uint64_t)(uint32_t)(e.arg + 1) << 32) | (uint32_t)cont;
            if (tl_gram_hash_get(&rt->called, key) == rt->closure) break;
            if (!tl_gram_hash_put(&rt->called, key, rt->closure)) return false;
            for (int a = p->rule_alts[e.arg + 1] - 1; a >= p->rule_alts[e.arg]; a--)
                if (!push_pending(rt, p->alt_start[a], cont)) return false;
            break;
        }
    }
    return true;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The state whose stacks are the scratch list (sorted, deduplicated here). */
static int32_t intern_state(tl_gram_runtime *rt) {
    int32_t *m = rt->scratch;
    size_t n = rt->n_scratch;
    if (n > 1) qsort(m, n, sizeof *m, cmp_i32);
    size_t u = 0;
    for (size_t i = 0; i < n; i++)
        if (u == 0 || m[u - 1] != m[i]) m[u++] = m[i];
    n = u;
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ n;
    for (size_t i = 0; i < n; i++) h = mix64(h ^ (uint64_t)(uint32_t)m[i]);
    h |= 1;
    /* probe the table: equal hashes are compared member by member */
    tl_gram_hash *t = &rt->state_ids;
    if (t->cap) {
        for (size_t j = mix64(h) & (t->cap - 1); t->keys[j]; j = (j + 1) & (t->cap - 1)) {
            if (t->keys[j] != h) continue;
            const int32_t s = t->vals[j];
            const int64_t first = rt->state_first[s], len = rt->state_first[s + 1] - first;
            if ((size_t)len == n && (n == 0 || memcmp(rt->state_members + first, m, n * sizeof *m) == 0)) return s;
        }
    }
    if (rt->n_states >= GRAM_MAX_STATES) {
        last_failure = FAILED_FULL;
        return -1;
    }
    if (rt->n_states + 2 > rt->cap_states) {
        int cap = rt->cap_states ? rt->cap_states * 2 : 256;
        int64_t *f = realloc(rt->state_first, ((size_t)cap + 1) * sizeof *f);
        if (!f) return -1;
        rt->state_first = f;
        uint8_t *fl = realloc(rt->state_flags, (size_t)cap);
        if (!fl) return -1;
        rt->state_flags = fl;
        tl_gram_byteset *lp = realloc(rt->state_loop, (size_t)cap * sizeof *lp);
        if (!lp) return -1;
        rt->state_loop = lp;
        tl_gram_byteset *tk = realloc(rt->state_takes, (size_t)cap * sizeof *tk);
        if (!tk) return -1;
        rt->state_takes = tk;
        int32_t *pj = realloc(rt->state_proj, (size_t)cap * sizeof *pj);
        if (!pj) return -1;
        rt->state_proj = pj;
        rt->cap_states = cap;
    }
    if (rt->n_members + n > rt->cap_members) {
        size_t cap = rt->cap_members ? rt->cap_members : 1024;
        while (cap < rt->n_members + n) cap *= 2;
        int32_t *q = realloc(rt->state_members, cap * sizeof *q);
        if (!q) return -1;
        rt->state_members = q;
        rt->cap_members = cap;
    }
    const int32_t s = rt->n_states++;
    if (n) memcpy(rt->state_members + rt->n_members, m, n * sizeof *m);
    rt->state_first[s] = (int64_t)rt->n_members;
    rt->n_members += n;
    rt->state_first[s + 1] = (int64_t)rt->n_members;
    rt->state_flags[s] = (n > 0 && m[0] == 0) ? 1 : 0;
    rt->state_proj[s] = -1;
    for (size_t i = 0; i < n; i++) {
        if (m[i] == rt->esc_node && rt->esc_node > 0) rt->state_flags[s] |= 4;
        else if (ref_top(rt, m[i])) rt->state_flags[s] |= 16; /* a stack waits for a token reference */
    }
    /* a collision-free insert: probe to an empty slot */
    if (!tl_gram_hash_reserve(t)) return -1;
    size_t j = mix64(h) & (t->cap - 1);
    while (t->keys[j]) j = (j + 1) & (t->cap - 1);
    t->keys[j] = h;
    t->vals[j] = s;
    t->n++;
    return s;
}

tl_status tl_gram_runtime_init(tl_gram_runtime *rt, const tl_gram_program *prog) {
    last_failure = FAILED_MEMORY;
    memset(rt, 0, sizeof *rt);
    rt->prog = prog;
    /* node 0: the empty stack; state 0: the dead state (no stacks) */
    if (!tl_gram_grow((void **)&rt->nodes, &rt->cap_nodes, 1, sizeof *rt->nodes)) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    rt->nodes[rt->n_nodes++] = (tl_gram_node){-1, -1};
    rt->n_scratch = 0;
    if (intern_state(rt) != GRAM_DEAD) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    /* never a member of a real state: expand stops at it instead of reading its pos */
    if ((rt->esc_node = intern_node(rt, -2, 0)) < 0) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    bool ok = true;
    next_closure(rt);
    for (int a = prog->rule_alts[prog->root]; ok && a < prog->rule_alts[prog->root + 1]; a++)
        ok = expand(rt, prog->alt_start[a], 0);
    rt->initial = ok ? intern_state(rt) : -1;
    if (rt->initial < 0) return tl_gram_failure("grammar");
    return TL_OK;
}

void tl_gram_runtime_destroy(tl_gram_runtime *rt) {
    free(rt->nodes);
    tl_gram_hash_free(&rt->node_ids);
    free(rt->state_members);
    free(rt->state_first);
    free(rt->state_flags);
    free(rt->state_loop);
    free(rt->state_proj);
    free(rt->state_takes);
    tl_gram_hash_free(&rt->state_ids);
    tl_gram_hash_free(&rt->transitions);
    tl_gram_hash_free(&rt->called);
    free(rt->scratch);
    free(rt->pending);
    memset(rt, 0, sizeof *rt);
}

size_t tl_gram_runtime_bytes(const tl_gram_runtime *rt) {
    const size_t per_state = sizeof *rt->state_first + sizeof *rt->state_flags + sizeof *rt->state_loop +
                             sizeof *rt->state_takes + sizeof *rt->state_proj;
    const size_t per_slot = sizeof(uint64_t) + sizeof(int32_t); /* a hash table's key and value */
    return (size_t)rt->cap_nodes * sizeof *rt->nodes + rt->cap_members * sizeof *rt->state_members +
           (size_t)rt->cap_states * per_state +
           (rt->node_ids.cap + rt->state_ids.cap + rt->transitions.cap + rt->called.cap) * per_slot +
           (rt->cap_scratch + rt->cap_pending) * sizeof(int32_t);
}

int32_t tl_gram_advance(tl_gram_runtime *rt, int32_t state, unsigned byte) {
    if (state == GRAM_DEAD) return GRAM_DEAD;
    const uint64_t key = (uint64_t)state * 256u + byte + 1u;
    int32_t next = tl_gram_hash_get(&rt->transitions, key);
    if (next >= 0) return next;
    last_failure = FAILED_MEMORY; /* (the reason is always this call's) */
    if (rt->work_budget > 0 && (rt->work += rt->state_first[state + 1] - rt->state_first[state]) > rt->work_budget) {
        last_failure = FAILED_COSTLY;
        return -1;
    }
    const tl_gram_program *p = rt->prog;
    rt->n_scratch = 0;
    next_closure(rt);
    for (int64_t i = rt->state_first[state]; i < rt->state_first[state + 1]; i++) {
        const int32_t n = rt->state_members[i];
        if (n == 0 || n == rt->esc_node) continue; /* the empty stack accepts the end, not a byte */
        const tl_gram_node node = rt->nodes[n];
        if (p->elems[node.pos].kind != GE_BYTES) continue; /* a token reference takes no byte */
        if (!tl_gram_byteset_has(&p->sets[p->elems[node.pos].arg], byte)) continue;
        if (!expand(rt, node.pos + 1, node.parent)) return -1;
    }
    next = intern_state(rt);
    if (next < 0 || !tl_gram_hash_put(&rt->transitions, key, next)) return -1;
    return next;
}

static bool is_end_token(const tl_gram_token_set *refs, int32_t token) {
    if (token == refs->eos) return true;
    for (int i = 0; i < refs->n_ends; i++)
        if (refs->ends[i] == token) return true;
    return false;
}

/* Whether token reference `ref` (resolved to `id` in the vocabulary) takes token `token`: a
   negated one any token but that one and the ends (eos, a turn's end: they end the text, as in
   llama.cpp no reference takes them by negation); a named one that token, never eos. */
static bool ref_takes(const tl_gram_token_ref *ref, int32_t id, int32_t token, const tl_gram_token_set *refs) {
    if (token == refs->eos) return false;
    return ref->negated ? token != id && !is_end_token(refs, token) : token == id;
}

int32_t tl_gram_advance_refs(tl_gram_runtime *rt, int32_t state, int32_t by_bytes, int32_t token, const tl_gram_token_set *refs) {
    if (state == GRAM_DEAD || !tl_gram_has_refs(rt, state)) return by_bytes;
    last_failure = FAILED_MEMORY;
    const tl_gram_program *p = rt->prog;
    rt->n_scratch = 0;
    next_closure(rt);
    for (int64_t i = rt->state_first[state]; i < rt->state_first[state + 1]; i++) {
        const int32_t n = rt->state_members[i];
        const tl_gram_elem *e = ref_top(rt, n);
        if (!e || !ref_takes(&p->tokens[e->arg], refs->ids[e->arg], token, refs)) continue;
        if (!expand(rt, rt->nodes[n].pos + 1, rt->nodes[n].parent)) return -1;
    }
    if (rt->n_scratch == 0) return by_bytes;
    /* and the stacks the token's bytes led to: one state of both */
    if (by_bytes > 0)
        for (int64_t i = rt->state_first[by_bytes]; i < rt->state_first[by_bytes + 1]; i++)
            if (!push_scratch(rt, rt->state_members[i])) return -1;
    return intern_state(rt);
}

int tl_gram_mask_refs(const tl_gram_runtime *rt, int32_t state, const tl_gram_token_set *refs, int vocab_size, uint8_t *allowed,
                   int count) {
    if (state == GRAM_DEAD || !tl_gram_has_refs(rt, state)) return count;
    const tl_gram_program *p = rt->prog;
    /* named ones one by one; the negated ones in one pass over the vocabulary, however many
       stacks wait on one (one per stack made a mask cost stacks x vocabulary) */
    int32_t negated = -1; /* the one token negated references leave out; -1 none left out */
    bool any_negated = false;
    for (int64_t i = rt->state_first[state]; i < rt->state_first[state + 1]; i++) {
        const tl_gram_elem *e = ref_top(rt, rt->state_members[i]);
        if (!e) continue;
        const int32_t id = refs->ids[e->arg];
        if (p->tokens[e->arg].negated) {
            negated = !any_negated || negated == id ? id : -1; /* two different ones: together, every token */
            any_negated = true;
        } else if (id >= 0 && id < vocab_size && id != refs->eos && !allowed[id]) { /* (ref_takes of a named one) */
            allowed[id] = 1;
            count++;
        }
    }
    for (int32_t t = 0; any_negated && t < vocab_size; t++)
        if (t != negated && !allowed[t] && !is_end_token(refs, t)) {
            allowed[t] = 1;
            count++;
        }
    return count;
}

int32_t tl_gram_advance_bytes(tl_gram_runtime *rt, int32_t state, const void *bytes, size_t len) {
    const unsigned char *b = bytes;
    for (size_t i = 0; i < len && state > 0; i++) state = tl_gram_advance(rt, state, b[i]);
    return state;
}

const tl_gram_byteset *tl_gram_first_bytes(tl_gram_runtime *rt, int32_t state) {
    if (!(rt->state_flags[state] & 8)) {
        tl_gram_byteset takes = {{0}};
        const tl_gram_program *p = rt->prog;
        for (int64_t i = rt->state_first[state]; i < rt->state_first[state + 1]; i++) {
            const int32_t n = rt->state_members[i];
            if (n == 0 || n == rt->esc_node || p->elems[rt->nodes[n].pos].kind != GE_BYTES) continue;
            const tl_gram_byteset *s = &p->sets[p->elems[rt->nodes[n].pos].arg];
            for (int k = 0; k < 4; k++) takes.bits[k] |= s->bits[k];
        }
        rt->state_takes[state] = takes;
        rt->state_flags[state] |= 8;
    }
    return &rt->state_takes[state];
}

const tl_gram_byteset *tl_gram_loop_bytes(tl_gram_runtime *rt, int32_t state) {
    if (!(rt->state_flags[state] & 2)) {
        tl_gram_byteset loop = {{0}};
        /* only bytes some stack can take may loop */
        const tl_gram_byteset possible = *tl_gram_first_bytes(rt, state);
        for (unsigned b = 0; b < 256; b++) {
            if (!tl_gram_byteset_has(&possible, b)) continue;
            int32_t next = tl_gram_advance(rt, state, b);
            if (next < 0) return NULL;
            if (next == state) loop.bits[b >> 6] |= 1ull << (b & 63);
        }
        rt->state_loop[state] = loop;
        rt->state_flags[state] |= 2;
    }
    return &rt->state_loop[state];
}

int32_t tl_gram_project(tl_gram_runtime *rt, int32_t state) {
    if (rt->state_proj[state] >= 0) return rt->state_proj[state];
    last_failure = FAILED_MEMORY;
    int32_t frames[GRAM_PROJECT_DEPTH];
    bool cut = false;
    rt->n_scratch = 0;
    for (int64_t i = rt->state_first[state]; i < rt->state_first[state + 1]; i++) {
        int32_t n = rt->state_members[i], depth = 0;
        for (int32_t k = n; k > 0 && k != rt->esc_node && depth <= GRAM_PROJECT_DEPTH; k = rt->nodes[k].parent)
            if (depth < GRAM_PROJECT_DEPTH) frames[depth++] = k;
            else depth++;
        if (depth > GRAM_PROJECT_DEPTH) { /* deeper than the cut: rebuilt on the stand-in */
            cut = true;
            n = rt->esc_node;
            for (int d = GRAM_PROJECT_DEPTH - 1; d >= 0 && n >= 0; d--) n = intern_node(rt, rt->nodes[frames[d]].pos, n);
            if (n < 0) return -1;
        }
        if (!push_scratch(rt, n)) return -1;
    }
    const int32_t proj = cut ? intern_state(rt) : state;
    if (proj < 0) return -1;
    rt->state_proj[state] = proj;
    return proj;
}

/* ---------------------------------------------------------------- public: compiling */

static void tables_free(tl_gram_tables *t) {
    if (!t) return;
    for (int i = 0; i < t->n_bindings; i++) tl_gram_binding_destroy(&t->bindings[i]);
    free(t->bindings);
    tl_gram_runtime_destroy(&t->rt);
    free(t);
}

static tl_status tables_new(const tl_gram_program *prog, tl_gram_tables **out) {
    tl_gram_tables *t = calloc(1, sizeof *t);
    if (!t) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    tl_status st = tl_gram_runtime_init(&t->rt, prog);
    if (st != TL_OK) {
        tables_free(t);
        return st;
    }
    *out = t;
    return TL_OK;
}

/* A new generation: the current one is freed, or goes with its last matcher (under g->lock). */
static tl_status tables_restart(tl_compiled_grammar *g) {
    tl_gram_tables *old = g->tables, *fresh = NULL;
    tl_status st = tables_new(g->prog, &fresh);
    if (st != TL_OK) return st;
    g->tables = fresh;
    g->generations++;
    if (old->users == 0) {
        tables_free(old);
    } else { /* its last matcher frees it (tl_gram_tables_leave) */
        old->next = g->old_tables;
        g->old_tables = old;
    }
    return TL_OK;
}

tl_gram_tables *tl_gram_current_tables(tl_compiled_grammar *g) {
    if (tl_gram_runtime_bytes(&g->tables->rt) > g->table_budget && tables_restart(g) != TL_OK)
        tl_clear_error(); /* the full tables serve on, up to their interning limits */
    return g->tables;
}

tl_status tl_grammar_trim(const tl_compiled_grammar *cg) {
    tl_clear_error();
    if (!cg) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_trim: grammar is NULL");
    tl_compiled_grammar *g = (tl_compiled_grammar *)cg;
    pthread_mutex_lock(&g->lock);
    const tl_status st = tables_restart(g);
    pthread_mutex_unlock(&g->lock);
    return st;
}

void tl_gram_tables_leave(tl_compiled_grammar *g, tl_gram_tables *t) {
    if (--t->users > 0 || t == g->tables) return;
    tl_gram_tables **at = &g->old_tables;
    while (*at != t) at = &(*at)->next;
    *at = t->next;
    tables_free(t);
}

static size_t program_bytes(const tl_gram_program *p) {
    size_t n = sizeof *p + (size_t)p->n_elems * sizeof *p->elems + (size_t)p->n_alts * sizeof *p->alt_start +
               ((size_t)p->n_rules + 1) * sizeof *p->rule_alts + (size_t)p->n_sets * sizeof *p->sets +
               (size_t)p->n_rules * sizeof *p->rule_names + (size_t)p->n_tokens * sizeof *p->tokens;
    for (int i = 0; p->rule_names && i < p->n_rules; i++) n += p->rule_names[i] ? strlen(p->rule_names[i]) + 1 : 0;
    for (int i = 0; i < p->n_tokens; i++) n += p->tokens[i].text ? strlen(p->tokens[i].text) + 1 : 0;
    return n;
}

static void add_tables(tl_grammar_memory *m, const tl_gram_tables *t) {
    m->table_bytes += tl_gram_runtime_bytes(&t->rt);
    for (int i = 0; i < t->n_bindings; i++) m->mask_bytes += t->bindings[i].mask_bytes;
    m->generations++;
}

tl_status tl_grammar_memory_usage(const tl_compiled_grammar *cg, tl_grammar_memory *out) {
    tl_clear_error();
    if (!cg || !out) return tl_fail_null("tl_grammar_memory_usage", 2, "g", (const void *)cg, "out", (const void *)out);
    tl_compiled_grammar *g = (tl_compiled_grammar *)cg;
    tl_grammar_memory m = {0};
    if (pthread_mutex_trylock(&g->lock) != 0) { /* in use (a mask being computed): the last figures */
        pthread_mutex_lock(&g->usage_lock);
        m = g->last_usage;
        pthread_mutex_unlock(&g->usage_lock);
        if (m.generations > 0) {
            *out = m;
            return TL_OK;
        }
        pthread_mutex_lock(&g->lock); /* (none yet: this once, wait) */
    }
    m.program_bytes = program_bytes(g->prog);
    add_tables(&m, g->tables);
    for (const tl_gram_tables *t = g->old_tables; t; t = t->next) add_tables(&m, t);
    for (int i = 0; i < g->n_vocabs; i++) m.vocab_bytes += g->vocabs[i]->memory;
    m.program_bytes += (size_t)g->n_vocabs * (sizeof *g->vocabs + sizeof *g->ref_ids + /* resolved references */
                                              (size_t)g->prog->n_tokens * sizeof(int32_t));
    m.restarts = g->generations;
    m.own_bytes = m.program_bytes + m.table_bytes + m.mask_bytes;
    pthread_mutex_lock(&g->usage_lock);
    g->last_usage = m;
    pthread_mutex_unlock(&g->usage_lock);
    pthread_mutex_unlock(&g->lock);
    *out = m;
    return TL_OK;
}

/* What the program matches, hashed: its element, alternative and rule arrays, byte sets and
   token references, field by field (no struct padding), in a fixed order. Two compilations
   of one grammar hash alike; rule names, which only messages read, are left out. */
static uint64_t program_fingerprint(const tl_gram_program *p) {
    tl_hasher h;
    tl_hash_init(&h);
    const int32_t counts[6] = {p->n_elems, p->n_alts, p->n_rules, p->n_sets, p->n_tokens, p->root};
    tl_hash_add(&h, counts, sizeof counts);
    for (int i = 0; i < p->n_elems; i++) {
        const int32_t elem[2] = {p->elems[i].kind, p->elems[i].arg};
        tl_hash_add(&h, elem, sizeof elem);
    }
    tl_hash_add(&h, p->alt_start, (size_t)p->n_alts * sizeof *p->alt_start);
    tl_hash_add(&h, p->rule_alts, ((size_t)p->n_rules + 1) * sizeof *p->rule_alts);
    for (int i = 0; i < p->n_sets; i++) tl_hash_add(&h, p->sets[i].bits, sizeof p->sets[i].bits);
    for (int i = 0; i < p->n_tokens; i++) {
        const tl_gram_token_ref *t = &p->tokens[i];
        const int32_t ref[3] = {t->id, t->negated, t->text ? (int32_t)strlen(t->text) : -1};
        tl_hash_add(&h, ref, sizeof ref);
        if (t->text) tl_hash_add(&h, t->text, strlen(t->text));
    }
    return tl_hash_final(&h);
}

tl_status tl_gram_wrap_program(tl_gram_program *prog, tl_compiled_grammar **out) {
    tl_compiled_grammar *g = calloc(1, sizeof *g);
    if (!g) {
        tl_gram_program_free(prog);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    }
    atomic_init(&g->refs, 1);
    g->prog = prog;
    g->fingerprint = program_fingerprint(prog);
    g->table_budget = GRAM_TABLE_BYTES;
    if (pthread_mutex_init(&g->lock, NULL) != 0) {
        tl_gram_program_free(prog);
        free(g);
        return tl_fail(TL_ERR_INTERNAL, "cannot create a mutex");
    }
    if (pthread_mutex_init(&g->usage_lock, NULL) != 0) {
        pthread_mutex_destroy(&g->lock);
        tl_gram_program_free(prog);
        free(g);
        return tl_fail(TL_ERR_INTERNAL, "cannot create a mutex");
    }
    tl_status st = tables_new(prog, &g->tables);
    if (st != TL_OK) {
        pthread_mutex_destroy(&g->usage_lock);
        pthread_mutex_destroy(&g->lock);
        tl_gram_program_free(prog);
        free(g);
        return st;
    }
    *out = g;
    return TL_OK;
}

tl_status tl_grammar_compile_gbnf(const char *text, size_t len, tl_compiled_grammar **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_gbnf: out must not be NULL");
    *out = NULL;
    if (!text && len) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_gbnf: text is NULL");
    char err[512] = "";
    tl_gram_program *prog;
    tl_status st = tl_gram_parse_gbnf(text ? text : "", len, &prog, err, sizeof err);
    if (st != TL_OK) return tl_fail(st, "grammar: %s", err);
    return tl_gram_wrap_program(prog, out);
}

tl_status tl_json_schema_to_gbnf(const char *schema, size_t len, const tl_json_schema_options *opts, char **gbnf,
                                 size_t *gbnf_len) {
    tl_clear_error();
    if (!gbnf) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_json_schema_to_gbnf: gbnf must not be NULL");
    *gbnf = NULL;
    if (!schema) return tl_fail(TL_ERR_INVALID_ARGUMENT, "JSON schema: the schema's text is NULL");
    if (opts && ((opts->free_whitespace != 0 && opts->free_whitespace != 1) || (opts->loose != 0 && opts->loose != 1)))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "JSON schema options: free_whitespace = %d and loose = %d must each be 0 or 1",
                       opts->free_whitespace, opts->loose);
    char err[512] = "";
    size_t n = 0;
    tl_status st = tl_gram_json_schema_to_gbnf(schema, len, opts ? opts->free_whitespace : 0, opts ? opts->loose : 0, gbnf, &n, err,
                                            sizeof err);
    if (st != TL_OK) return tl_fail(st, "JSON schema: %s", err);
    if (gbnf_len) *gbnf_len = n;
    return TL_OK;
}

tl_status tl_grammar_compile_json_schema(const char *schema, size_t len, const tl_json_schema_options *opts,
                                         tl_compiled_grammar **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_json_schema: out must not be NULL");
    *out = NULL;
    char *text = NULL;
    size_t n = 0;
    tl_status st = tl_json_schema_to_gbnf(schema, len, opts, &text, &n);
    if (st != TL_OK) return st;
    char err[512] = "";
    tl_gram_program *prog;
    st = tl_gram_parse_gbnf(text, n, &prog, err, sizeof err);
    free(text);
    /* a $ref cycle that consumes nothing first ({"$ref": "#"}) is the schema's fault */
    if (st != TL_OK && strstr(err, "left-recursive"))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "JSON schema: a $ref cycle matches nothing before recurring (%s)", err);
    if (st != TL_OK && strstr(err, "grammar too large"))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "JSON schema: too large once expanded (%s)", err);
    if (st == TL_ERR_NO_MEMORY) return tl_fail(st, "JSON schema: %s", err);
    if (st != TL_OK) return tl_fail(st, "JSON schema: the generated grammar is invalid (a TinyLoop bug): %s", err);
    return tl_gram_wrap_program(prog, out);
}

tl_status tl_regex_to_gbnf(const char *pattern, size_t len, char **gbnf, size_t *gbnf_len) {
    tl_clear_error();
    if (!gbnf) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_regex_to_gbnf: gbnf must not be NULL");
    *gbnf = NULL;
    if (!pattern) return tl_fail(TL_ERR_INVALID_ARGUMENT, "regular expression: the pattern is NULL");
    if (memchr(pattern, 0, len)) return tl_fail(TL_ERR_INVALID_ARGUMENT, "regular expression: a NUL byte in the pattern (write \\0)");
    char *copy = malloc(len + 1);
    if (!copy) return tl_fail(TL_ERR_NO_MEMORY, "tl_regex_to_gbnf: out of memory");
    memcpy(copy, pattern, len);
    copy[len] = 0;
    strbuf text = {0};
    tl_strbuf_puts(&text, "root ::= ");
    char err[256] = "";
    const int rc = tl_gram_regex_expr(copy, true, NULL, &text, err, sizeof err);
    tl_strbuf_puts(&text, "\n");
    free(copy);
    if (rc < 0) { free(text.p); return tl_fail(TL_ERR_INVALID_ARGUMENT, "regular expression: %s", err); }
    if (text.oom) { free(text.p); return tl_fail(TL_ERR_NO_MEMORY, "tl_regex_to_gbnf: out of memory"); }
    *gbnf = text.p;
    if (gbnf_len) *gbnf_len = text.n;
    return TL_OK;
}

tl_status tl_grammar_compile_regex(const char *pattern, size_t len, tl_compiled_grammar **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_regex: out must not be NULL");
    *out = NULL;
    char *text = NULL;
    size_t n = 0;
    tl_status st = tl_regex_to_gbnf(pattern, len, &text, &n);
    if (st != TL_OK) return st;
    char err[512] = "";
    tl_gram_program *prog;
    st = tl_gram_parse_gbnf(text, n, &prog, err, sizeof err);
    free(text);
    /* repetitions that expand past the grammar's size are the pattern's size, not a bug */
    if (st != TL_OK && strstr(err, "grammar too large"))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "regular expression: too large once its repetitions are expanded (%s)", err);
    if (st == TL_ERR_NO_MEMORY) return tl_fail(st, "regular expression: %s", err);
    if (st != TL_OK) return tl_fail(st, "regular expression: the generated grammar is invalid (a TinyLoop bug): %s", err);
    return tl_gram_wrap_program(prog, out);
}

void tl_compiled_grammar_retain(const tl_compiled_grammar *g) {
    if (!g) return; /* (as tl_compiled_grammar_free(NULL): it crashed) */
    atomic_fetch_add(&((tl_compiled_grammar *)g)->refs, 1);
}

void tl_compiled_grammar_free(tl_compiled_grammar *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    tables_free(g->tables); /* older generations went with their last matcher, which held a ref */
    for (int i = 0; i < g->n_vocabs; i++) {
        tl_gram_vocab_release(g->vocabs[i]);
        free(g->ref_ids[i]);
    }
    free(g->vocabs);
    free(g->ref_ids);
    pthread_mutex_destroy(&g->usage_lock);
    pthread_mutex_destroy(&g->lock);
    tl_gram_program_free(g->prog);
    free(g);
}

tl_status tl_grammar_matches(const tl_compiled_grammar *cg, const char *text, size_t len, int *match) {
    tl_clear_error();
    if (!cg || !match || (!text && len))
        return tl_fail_null("tl_grammar_matches", 3, "g", (const void *)cg, "match", (const void *)match,
                            "text (of len > 0)", (const void *)text);
    tl_compiled_grammar *g = (tl_compiled_grammar *)cg;
    pthread_mutex_lock(&g->lock);
    tl_gram_runtime *rt = &tl_gram_current_tables(g)->rt;
    int32_t s = tl_gram_advance_bytes(rt, rt->initial, text, len);
    *match = s > 0 && tl_gram_accepting(rt, s);
    pthread_mutex_unlock(&g->lock);
    if (s < 0) return tl_gram_failure("tl_grammar_matches");
    return TL_OK;
}

tl_status tl_grammar_matches_prefix(const tl_compiled_grammar *cg, const char *text, size_t len, int *match) {
    tl_clear_error();
    if (!cg || !match || (!text && len))
        return tl_fail_null("tl_grammar_matches_prefix", 3, "g", (const void *)cg, "match", (const void *)match,
                            "text (of len > 0)", (const void *)text);
    tl_compiled_grammar *g = (tl_compiled_grammar *)cg;
    pthread_mutex_lock(&g->lock);
    tl_gram_runtime *rt = &tl_gram_current_tables(g)->rt;
    const int32_t s = tl_gram_advance_bytes(rt, rt->initial, text, len);
    pthread_mutex_unlock(&g->lock);
    if (s < 0) return tl_gram_failure("tl_grammar_matches_prefix");
    *match = s != GRAM_DEAD;
    return TL_OK;
}

void tl_grammar_use(tl_grammar *grammar, const tl_compiled_grammar *g) {
    if (!grammar) return;
    memset(grammar, 0, sizeof *grammar);
    grammar->compiled = g;
}

tl_status tl_grammar_rule_count(const tl_compiled_grammar *g, int *rules, int *elements) {
    tl_clear_error();
    if (!g) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_rule_count: grammar is NULL");
    if (rules) *rules = g->prog->n_rules;
    if (elements) *elements = g->prog->n_elems;
    return TL_OK;
}

/* grammar_tags.c: free text and the grammars it opens (xgrammar's triggered tags, vLLM's
 * structural_tag, llama.cpp's lazy grammars).
 *
 * The text is free until one of the triggers appears; from there it is a tag whose begin
 * starts with that trigger (the rest of its begin, a sentence of its content grammar, its
 * end), then free text again (or the end of the text: ends_text). It is one grammar program, built
 * here from the content grammars' programs:
 *
 *   free_s  the free text, one rule per state s of the triggers' Aho-Corasick automaton (s =
 *           the longest trigger prefix the text ends with): an alternative per set of bytes
 *           that lead to the same next state, "[bytes] free_next", or "[bytes] enter_n" where
 *           the next state n completes triggers; and an empty alternative (the text may end)
 *           unless at_least_one and no tag came yet (a second copy of the free rules then);
 *   enter_n an alternative per tag whose begin starts with a trigger completed at n:
 *           "[rest of begin, a byte each] blank_t0";
 *   blank_tk "[ \t\n\r] blank_t(k+1) | content_t.root [end, a byte each] next", next being
 *           free_root (after a tag) or nothing (a tag that ends the text); max_blanks of them.
 *
 * Every cycle of new rules passes through a byte and the content programs were checked when
 * they were compiled, so the whole is free of left recursion; a token that spans a trigger is
 * judged byte by byte like any other. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"

#define MAX_TRIGGER 256
#define MAX_TRIGGERS 64
#define MAX_TAGS 256
/* Blank bytes a caller may allow between a tag's begin and its content ("</think>\n\n{"): a
   few, not a run a model could pad with up to max_tokens. */
#define MAX_BLANKS 16

typedef struct bytes { const unsigned char *p; int n; } bytes;

typedef struct tag_in {
    bytes begin, end;
    const tl_gram_program *content;
    bool ends_text;
} tag_in;

/* ---------------------------------------------------------------- the program writer */

typedef struct writer {
    tl_gram_program *p;
    int cap_elems, cap_alts, cap_sets, cap_rule_alts, cap_tokens;
    bool oom;
    bool big;           /* past GRAM_MAX_ELEMS: stopped writing (an error, not an allocation) */
    int32_t single[256]; /* the set of each single byte, once written (-1: not yet) */
} writer;

static void emit(writer *w, uint8_t kind, int32_t arg) {
    if (!w->oom && w->p->n_elems >= GRAM_MAX_ELEMS) w->big = w->oom = true; /* (oom: every write stops) */
    if (w->oom || !tl_gram_grow((void **)&w->p->elems, &w->cap_elems, w->p->n_elems + 1, sizeof *w->p->elems)) { w->oom = true; return; }
    w->p->elems[w->p->n_elems++] = (tl_gram_elem){kind, arg};
}

static void begin_alt(writer *w) {
    if (w->oom || !tl_gram_grow((void **)&w->p->alt_start, &w->cap_alts, w->p->n_alts + 1, sizeof *w->p->alt_start)) { w->oom = true; return; }
    w->p->alt_start[w->p->n_alts++] = w->p->n_elems;
}

/* Rules are written in order: rule r's alternatives follow begin_rule(w, r). */
static void begin_rule(writer *w, int r) {
    if (w->oom || !tl_gram_grow((void **)&w->p->rule_alts, &w->cap_rule_alts, r + 2, sizeof *w->p->rule_alts)) { w->oom = true; return; }
    w->p->rule_alts[r] = w->p->n_alts;
}

static int32_t add_set(writer *w, const tl_gram_byteset *set) {
    if (!w->oom && w->p->n_sets >= GRAM_MAX_ELEMS) w->big = w->oom = true;
    if (w->oom || !tl_gram_grow((void **)&w->p->sets, &w->cap_sets, w->p->n_sets + 1, sizeof *w->p->sets)) { w->oom = true; return 0; }
    w->p->sets[w->p->n_sets] = *set;
    return w->p->n_sets++;
}

/* A content grammar's token reference, copied (its text too). */
static void add_token(writer *w, const tl_gram_token_ref *ref) {
    tl_gram_program *p = w->p;
    if (w->oom || !tl_gram_grow((void **)&p->tokens, &w->cap_tokens, p->n_tokens + 1, sizeof *p->tokens)) { w->oom = true; return; }
    tl_gram_token_ref copy = *ref;
    if (ref->text && !(copy.text = tl_gram_copy_text(ref->text, strlen(ref->text)))) { w->oom = true; return; }
    p->tokens[p->n_tokens++] = copy;
}

static int32_t byte_set(writer *w, unsigned char b) {
    if (w->single[b] >= 0) return w->single[b];
    tl_gram_byteset set = {{0}};
    set.bits[b >> 6] |= 1ull << (b & 63);
    return w->single[b] = add_set(w, &set);
}

/* The set of the blanks allowed between a begin and its content: space, tab, newline, CR. */
static int32_t add_blank_set(writer *w) {
    tl_gram_byteset blank = {{0}};
    for (const char *c = " \t\n\r"; *c; c++) blank.bits[(unsigned char)*c >> 6] |= 1ull << ((unsigned char)*c & 63);
    return add_set(w, &blank);
}

/* An alternative nothing matches (a rule that is never entered, a trigger no tag opens). */
static void impossible_alt(writer *w) {
    const tl_gram_byteset none = {{0}};
    const int32_t id = add_set(w, &none);
    begin_alt(w);
    emit(w, GE_BYTES, id);
    emit(w, GE_END, 0);
}

/* A program's rules appended as they are (their alternatives, elements and sets renumbered):
   its rule r becomes rule first + r. */
static void append_program(writer *w, const tl_gram_program *g, int first) {
    const int set0 = w->p->n_sets, token0 = w->p->n_tokens;
    for (int s = 0; s < g->n_sets; s++) add_set(w, &g->sets[s]);
    for (int t = 0; t < g->n_tokens && !w->oom; t++) add_token(w, &g->tokens[t]);
    for (int r = 0; r < g->n_rules && !w->oom; r++) {
        begin_rule(w, first + r);
        for (int a = g->rule_alts[r]; a < g->rule_alts[r + 1]; a++) {
            begin_alt(w);
            for (int pos = g->alt_start[a];; pos++) {
                const tl_gram_elem e = g->elems[pos];
                emit(w, e.kind, e.kind == GE_BYTES   ? e.arg + set0
                                : e.kind == GE_REF   ? e.arg + first
                                : e.kind == GE_TOKEN ? e.arg + token0
                                                     : 0);
                if (e.kind == GE_END) break;
            }
        }
    }
}

/* ---------------------------------------------------------------- the triggers' automaton */

/* Aho-Corasick over bytes: a trie of the triggers, delta[s * 256 + b] the next state (failure
   links folded in), completes[s] whether some trigger ends at s (at s itself or at a suffix
   of it), and which ones: ends_of(s) through the failure links. */
typedef struct automaton {
    int n_states;
    int32_t *delta;     /* [n_states][256] */
    int32_t *fail_of;   /* [n_states] */
    int32_t *trigger_at;/* [n_states] the trigger whose last byte is s, or -1 */
    bool *completes;    /* [n_states] */
} automaton;

static void automaton_free(automaton *a) {
    free(a->delta);
    free(a->fail_of);
    free(a->trigger_at);
    free(a->completes);
}

static bool automaton_build(automaton *a, const bytes *triggers, int n) {
    int max_states = 1;
    for (int t = 0; t < n; t++) max_states += triggers[t].n;
    memset(a, 0, sizeof *a);
    a->delta = malloc((size_t)max_states * 256 * sizeof *a->delta);
    a->fail_of = malloc((size_t)max_states * sizeof *a->fail_of);
    a->trigger_at = malloc((size_t)max_states * sizeof *a->trigger_at);
    a->completes = calloc((size_t)max_states, sizeof *a->completes);
    int32_t *queue = malloc((size_t)max_states * sizeof *queue);
    if (!a->delta || !a->fail_of || !a->trigger_at || !a->completes || !queue) {
        free(queue);
        automaton_free(a);
        return false;
    }
    for (int i = 0; i < max_states * 256; i++) a->delta[i] = -1;
    a->n_states = 1;
    a->trigger_at[0] = -1;
    for (int t = 0; t < n; t++) {
        int s = 0;
        for (int i = 0; i < triggers[t].n; i++) {
            int32_t *next = &a->delta[s * 256 + triggers[t].p[i]];
            if (*next < 0) {
                *next = a->n_states;
                a->trigger_at[a->n_states++] = -1;
            }
            s = *next;
        }
        if (a->trigger_at[s] < 0) a->trigger_at[s] = t; /* (a repeated trigger: its first) */
    }
    /* breadth first: a state's failure link is shallower, so known before it */
    int head = 0, tail = 0;
    a->fail_of[0] = 0;
    for (int b = 0; b < 256; b++) {
        int32_t *next = &a->delta[b];
        if (*next < 0) *next = 0;
        else { a->fail_of[*next] = 0; queue[tail++] = *next; }
    }
    while (head < tail) {
        const int s = queue[head++];
        a->completes[s] = a->trigger_at[s] >= 0 || a->completes[a->fail_of[s]];
        for (int b = 0; b < 256; b++) {
            int32_t *next = &a->delta[s * 256 + b];
            if (*next < 0) *next = a->delta[a->fail_of[s] * 256 + b];
            else {
                a->fail_of[*next] = a->delta[a->fail_of[s] * 256 + b];
                queue[tail++] = *next;
            }
        }
    }
    free(queue);
    return true;
}

/* ---------------------------------------------------------------- the program */

static bool starts_with(bytes s, bytes prefix) { return s.n >= prefix.n && memcmp(s.p, prefix.p, (size_t)prefix.n) == 0; }

/* at_least_one: the text may not end before a tag; tag_first: it begins with one (no free
   text before it: xgrammar's at_least_one), a rule of its own, the root, choosing a tag by its
   whole begin. */
static tl_status program_tags(const tag_in *tags, int n_tags, const bytes *triggers, int n_triggers, int max_blanks,
                              bool at_least_one, bool tag_first, tl_gram_program **out, char *err, size_t errlen) {
    *out = NULL;
    automaton a;
    if (!automaton_build(&a, triggers, n_triggers)) {
        snprintf(err, errlen, "out of memory");
        return TL_ERR_NO_MEMORY;
    }
    /* rule numbers: the content programs, then free (one or two copies), enter (per state),
       open (per trigger), blank (per tag) */
    const int S = a.n_states, copies = at_least_one && !tag_first ? 2 : 1;
    int *content_first = malloc((size_t)n_tags * sizeof *content_first);
    /* reached: the states free text can be in (from the root through states that complete
       nothing) or step into; grouping: each next state's bytes, per state */
    bool *reached = calloc((size_t)S, sizeof *reached);
    int32_t *queue = malloc((size_t)S * sizeof *queue), *group_of = malloc((size_t)S * sizeof *group_of);
    int32_t *stamp = malloc((size_t)S * sizeof *stamp);
    writer w = {.p = calloc(1, sizeof *w.p)};
    for (int b = 0; b < 256; b++) w.single[b] = -1;
    if (!content_first || !reached || !queue || !group_of || !stamp || !w.p) w.oom = true;
    int n_rules = 0;
    for (int t = 0; t < n_tags && !w.oom; t++) {
        content_first[t] = n_rules;
        n_rules += tags[t].content->n_rules;
    }
    const int free_first = n_rules, enter_first = free_first + copies * S, open_first = enter_first + S;
    const int blank_first = open_first + n_triggers, first_tag = blank_first + n_tags * (max_blanks + 1);
    n_rules = first_tag + (tag_first ? 1 : 0);
    /* free_after: the free text after a tag (the copy that may end); the start: before any */
    const int free_after = free_first + (copies - 1) * S;
    if (!w.oom) {
        int head = 0, tail = 0;
        reached[0] = true;
        queue[tail++] = 0;
        while (head < tail) {
            const int st = queue[head++];
            stamp[st] = -1;
            if (a.completes[st]) continue;
            for (int byte = 0; byte < 256; byte++) {
                const int next = a.delta[st * 256 + byte];
                if (!reached[next]) { reached[next] = true; queue[tail++] = next; }
            }
        }
    }
    for (int t = 0; t < n_tags && !w.oom; t++) append_program(&w, tags[t].content, content_first[t]);
    for (int c = 0; c < copies && !w.oom; c++)
        for (int st = 0; st < S && !w.oom; st++) {
            begin_rule(&w, free_first + c * S + st);
            if (!reached[st] || a.completes[st]) { /* (never called: free text is never here) */
                impossible_alt(&w);
                continue;
            }
            /* one alternative per next state, its bytes in one set (grouped in one pass) */
            tl_gram_byteset groups[256];
            int32_t targets[256];
            int n_groups = 0;
            for (int byte = 0; byte < 256; byte++) {
                const int next = a.delta[st * 256 + byte];
                if (stamp[next] != st) {
                    stamp[next] = st;
                    group_of[next] = n_groups;
                    memset(&groups[n_groups], 0, sizeof groups[n_groups]);
                    targets[n_groups++] = next;
                }
                groups[group_of[next]].bits[byte >> 6] |= 1ull << (byte & 63);
            }
            for (int k = 0; k < n_groups; k++) {
                const int32_t id = add_set(&w, &groups[k]);
                begin_alt(&w);
                emit(&w, GE_BYTES, id);
                emit(&w, GE_REF, a.completes[targets[k]] ? enter_first + targets[k] : free_first + c * S + targets[k]);
                emit(&w, GE_END, 0);
            }
            if (c == copies - 1) { /* the text may end here */
                begin_alt(&w);
                emit(&w, GE_END, 0);
            }
            for (int k = 0; k < n_groups; k++) stamp[targets[k]] = -1; /* (the next state's pass) */
        }
    /* enter_s: each trigger that ends at s, through its open rule */
    bool used[MAX_TRIGGERS] = {false}; /* (a repeated trigger, or one never reached, opens nothing) */
    for (int st = 0; st < S && !w.oom; st++) {
        begin_rule(&w, enter_first + st);
        bool any = false;
        if (reached[st])
            for (int at = st; a.completes[at]; at = a.fail_of[at]) {
                if (a.trigger_at[at] >= 0) {
                    begin_alt(&w);
                    emit(&w, GE_REF, open_first + a.trigger_at[at]);
                    emit(&w, GE_END, 0);
                    used[a.trigger_at[at]] = any = true;
                }
                if (at == 0) break;
            }
        if (!any) impossible_alt(&w);
    }
    /* open_t: each tag whose begin starts with trigger t, the rest of its begin then its blanks */
    for (int t = 0; t < n_triggers && !w.oom; t++) {
        begin_rule(&w, open_first + t);
        bool any = false;
        for (int k = 0; k < n_tags && used[t]; k++) {
            if (!starts_with(tags[k].begin, triggers[t])) continue;
            begin_alt(&w);
            for (int i = triggers[t].n; i < tags[k].begin.n; i++) emit(&w, GE_BYTES, byte_set(&w, tags[k].begin.p[i]));
            emit(&w, GE_REF, blank_first + k * (max_blanks + 1));
            emit(&w, GE_END, 0);
            any = true;
        }
        if (!any) impossible_alt(&w);
    }
    const int32_t blank_set = add_blank_set(&w);
    for (int t = 0; t < n_tags && !w.oom; t++)
        for (int k = 0; k <= max_blanks; k++) {
            const int r = blank_first + t * (max_blanks + 1) + k;
            begin_rule(&w, r);
            if (k < max_blanks) {
                begin_alt(&w);
                emit(&w, GE_BYTES, blank_set);
                emit(&w, GE_REF, r + 1);
                emit(&w, GE_END, 0);
            }
            begin_alt(&w);
            emit(&w, GE_REF, content_first[t] + tags[t].content->root);
            for (int i = 0; i < tags[t].end.n; i++) emit(&w, GE_BYTES, byte_set(&w, tags[t].end.p[i]));
            if (!tags[t].ends_text) emit(&w, GE_REF, free_after);
            emit(&w, GE_END, 0);
        }
    if (tag_first && !w.oom) { /* first_tag: one tag's whole begin, then its blanks and content */
        begin_rule(&w, first_tag);
        for (int t = 0; t < n_tags; t++) {
            begin_alt(&w);
            for (int i = 0; i < tags[t].begin.n; i++) emit(&w, GE_BYTES, byte_set(&w, tags[t].begin.p[i]));
            emit(&w, GE_REF, blank_first + t * (max_blanks + 1));
            emit(&w, GE_END, 0);
        }
    }
    begin_rule(&w, n_rules); /* (the end of the last rule's alternatives) */
    tl_gram_program *p = w.p;
    if (!w.oom) {
        p->n_rules = n_rules;
        p->root = tag_first ? first_tag : free_first;
        p->rule_names = calloc((size_t)n_rules + 1, sizeof *p->rule_names);
        if (!p->rule_names) w.oom = true;
        for (int t = 0, r = 0; t < n_tags && !w.oom; t++)
            for (int k = 0; k < tags[t].content->n_rules && !w.oom; k++, r++) {
                const char *name = tags[t].content->rule_names[k];
                if (!(p->rule_names[r] = malloc(strlen(name) + 1))) w.oom = true;
                else strcpy(p->rule_names[r], name);
            }
        for (int r = free_first; r < n_rules && !w.oom; r++) {
            const char *name = r < enter_first ? "free text" : r < blank_first ? "a trigger" : "a tag";
            if (!(p->rule_names[r] = malloc(strlen(name) + 1))) w.oom = true;
            else strcpy(p->rule_names[r], name);
        }
    }
    free(content_first);
    free(reached);
    free(queue);
    free(group_of);
    free(stamp);
    automaton_free(&a);
    if (w.oom) {
        const bool big = w.big;
        tl_gram_program_free(p);
        if (big) snprintf(err, errlen, "too large (more than %d elements)", GRAM_MAX_ELEMS);
        else snprintf(err, errlen, "out of memory");
        return big ? TL_ERR_INVALID_ARGUMENT : TL_ERR_NO_MEMORY;
    }
    *out = p;
    return TL_OK;
}

/* ---------------------------------------------------------------- the API */

tl_status tl_grammar_compile_tags(const tl_grammar_tag *tags, int n_tags, const char *const *triggers, int n_triggers,
                                  const tl_grammar_tags_options *opts, tl_compiled_grammar **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: out must not be NULL");
    *out = NULL;
    if (!tags || n_tags < 1 || n_tags > MAX_TAGS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: 1 to %d tags", MAX_TAGS);
    if (!triggers || n_triggers < 1 || n_triggers > MAX_TRIGGERS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: 1 to %d triggers", MAX_TRIGGERS);
    const int max_blanks = opts ? opts->max_blanks : 0;
    if (opts && opts->at_least_one != 0 && opts->at_least_one != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: at_least_one = %d must be 0 or 1", opts->at_least_one);
    if (opts && opts->tag_first != 0 && opts->tag_first != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: tag_first = %d must be 0 or 1", opts->tag_first);
    if (max_blanks < 0 || max_blanks > MAX_BLANKS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: max_blanks = %d is out of range [0, %d]", max_blanks,
                       MAX_BLANKS);
    bytes trig[MAX_TRIGGERS];
    for (int i = 0; i < n_triggers; i++) {
        const size_t n = triggers[i] ? strlen(triggers[i]) : 0;
        if (n == 0 || n > MAX_TRIGGER)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: triggers[%d] must be 1 to %d bytes", i, MAX_TRIGGER);
        trig[i] = (bytes){(const unsigned char *)triggers[i], (int)n};
    }
    tag_in *in = calloc((size_t)n_tags, sizeof *in);
    if (!in) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    tl_status st = TL_OK;
    for (int t = 0; t < n_tags && st == TL_OK; t++) {
        if (!tags[t].begin || !tags[t].content || !tags[t].end) {
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: tags[%d] needs begin, content and end", t);
            break;
        }
        if (tags[t].ends_text != 0 && tags[t].ends_text != 1) {
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: tags[%d].ends_text = %d must be 0 or 1", t,
                         tags[t].ends_text);
            break;
        }
        in[t] = (tag_in){{(const unsigned char *)tags[t].begin, (int)strlen(tags[t].begin)},
                         {(const unsigned char *)tags[t].end, (int)strlen(tags[t].end)}, tags[t].content->prog,
                         tags[t].ends_text != 0};
        bool opened = false;
        for (int i = 0; i < n_triggers && !opened; i++) opened = starts_with(in[t].begin, trig[i]);
        if (!opened)
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: tags[%d]'s begin \"%.64s\" starts with no trigger", t,
                         tags[t].begin);
        else if (in[t].begin.n > 4096 || in[t].end.n > 4096)
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_tags: tags[%d]'s begin or end is over 4096 bytes", t);
    }
    tl_gram_program *prog = NULL;
    char err[128] = "";
    if (st == TL_OK) {
        st = program_tags(in, n_tags, trig, n_triggers, max_blanks, opts && opts->at_least_one, opts && opts->tag_first, &prog,
                          err, sizeof err);
        if (st != TL_OK) st = tl_fail(st, "tl_grammar_compile_tags: %s", err);
    }
    free(in);
    return st == TL_OK ? tl_gram_wrap_program(prog, out) : st;
}

/* after(trigger, g): one tag, the trigger its begin, g its content, no end; the text ends with
   it. Its rules start with g's own (g's root keeps its number). `who` names the caller in
   messages. */
static tl_status after_program(const tl_compiled_grammar *g, const char *trigger, size_t len, int max_blanks, const char *who,
                               tl_gram_program **out) {
    if (max_blanks < 0 || max_blanks > MAX_BLANKS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: max_blanks = %d is out of range [0, %d]", who, max_blanks, MAX_BLANKS);
    const bytes trig = {(const unsigned char *)trigger, (int)len};
    const tag_in tag = {trig, {(const unsigned char *)"", 0}, g->prog, true};
    char err[128] = "";
    const tl_status st = program_tags(&tag, 1, &trig, 1, max_blanks, false, false, out, err, sizeof err);
    return st == TL_OK ? TL_OK : tl_fail(st, "%s: %s", who, err);
}

tl_status tl_grammar_compile_after(const tl_compiled_grammar *g, const char *trigger, size_t len, int max_blanks,
                                   tl_compiled_grammar **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_after: out must not be NULL");
    *out = NULL;
    if (!g) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_after: grammar is NULL");
    if (!trigger || len == 0 || len > MAX_TRIGGER)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_after: the trigger must be 1 to %d bytes", MAX_TRIGGER);
    tl_gram_program *prog;
    const tl_status st = after_program(g, trigger, len, max_blanks, "tl_grammar_compile_after", &prog);
    return st == TL_OK ? tl_gram_wrap_program(prog, out) : st;
}

tl_status tl_grammar_compile_after_block(const tl_compiled_grammar *g, const char *open, const char *close, int max_blanks,
                                         tl_compiled_grammar **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_after_block: out must not be NULL");
    *out = NULL;
    if (!g) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_after_block: grammar is NULL");
    const size_t open_len = open ? strlen(open) : 0, close_len = close ? strlen(close) : 0;
    if (open_len == 0 || open_len > MAX_TRIGGER || close_len == 0 || close_len > MAX_TRIGGER)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_after_block: open and close must be 1 to %d bytes",
                       MAX_TRIGGER);
    /* after(close, g), and in front a new root: "open after.root | g.root" */
    tl_gram_program *p;
    const tl_status st = after_program(g, close, close_len, max_blanks, "tl_grammar_compile_after_block", &p);
    if (st != TL_OK) return st;
    writer w = {.p = p, .cap_elems = p->n_elems, .cap_alts = p->n_alts, .cap_sets = p->n_sets, .cap_rule_alts = p->n_rules + 1};
    for (int b = 0; b < 256; b++) w.single[b] = -1;
    /* lead_k ::= [ \t\n\r] lead_k+1 | open after.root (| g.root for k = 0): up to max_blanks
       blanks may come before the block, as a reasoning reader takes them */
    const int root = p->n_rules, after_root = p->root, n_new = max_blanks + 1;
    const int32_t blank_set = add_blank_set(&w);
    for (int k = 0; k < n_new; k++) {
        begin_rule(&w, root + k);
        if (k < max_blanks) {
            begin_alt(&w);
            emit(&w, GE_BYTES, blank_set);
            emit(&w, GE_REF, root + k + 1);
            emit(&w, GE_END, 0);
        }
        begin_alt(&w);
        for (size_t i = 0; i < open_len; i++) emit(&w, GE_BYTES, byte_set(&w, (unsigned char)open[i]));
        emit(&w, GE_REF, after_root);
        emit(&w, GE_END, 0);
        if (k == 0) {
            begin_alt(&w);
            emit(&w, GE_REF, g->prog->root);
            emit(&w, GE_END, 0);
        }
    }
    begin_rule(&w, root + n_new);
    char **names = w.oom ? NULL : realloc(p->rule_names, ((size_t)root + n_new + 1) * sizeof *names);
    int named = 0;
    if (names) {
        p->rule_names = names;
        for (; named < n_new; named++) {
            names[root + named] = malloc(sizeof "a block, then the grammar");
            if (!names[root + named]) break;
            strcpy(names[root + named], "a block, then the grammar");
        }
        names[root + n_new] = NULL;
    }
    if (!names || named < n_new) {
        p->n_rules = root + named; /* (the names array holds that many entries) */
        tl_gram_program_free(p);
        if (w.big) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_grammar_compile_after_block: too large (more than %d elements)", GRAM_MAX_ELEMS);
        return tl_fail(TL_ERR_NO_MEMORY, "tl_grammar_compile_after_block: out of memory");
    }
    p->n_rules = root + n_new;
    p->root = root;
    return tl_gram_wrap_program(p, out);
}

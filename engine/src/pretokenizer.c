/* Pre-tokenizer pipeline: the "pre_tokenizer" of a tokenizer.json, as Hugging Face
 * `tokenizers` (0.13 .. 0.21) runs it. See pretokenizer.h for the contract.
 *
 * What the published files use (checked for issue 16 part 5; the files themselves are not
 * in this repository):
 * - Ouro (ByteDance/Ouro-1.4B, -2.6B) ships SmolLM2's tokenizer (vocabulary 49152):
 *   normalizer null, pre_tokenizer Sequence[Digits(individual_digits=true),
 *   ByteLevel(add_prefix_space=false, trim_offsets=true, use_regex=true)]. Source: the
 *   pinned SmolLM2-135M tokenizer.json settings an exporter checks for (found with the
 *   code search; HuggingFaceTB/SmolLM2-135M revision 93efa2f0...).
 * - Huginn-0125 (tomg-group-umd/huginn-0125, tokenizer "huginn_tokenizer_65k", vocabulary
 *   65536) was trained with BPEasy and converted to tokenizers: normalizer null,
 *   pre_tokenizer Sequence[Split(Regex(R), behavior Isolated, invert false),
 *   ByteLevel(add_prefix_space=false, use_regex=false)], where R is the authors' own
 *   modification of the GPT-4 (cl100k) pre-tokenization regex of Dagan et al. 2024 (tech
 *   report "Scaling up Test-Time Compute with Latent Reasoning", section 4; BPEasy's
 *   Split + ByteLevel(use_regex=false) conversion; seal-rg/recurrent-pretraining's data
 *   scripts). The exact R was not readable offline, so the engine takes any R from the file
 *   and the tests use cl100k's regex, whose constructs ((?i:...), \p{N}{1,3}, lookahead)
 *   are the ones R builds on.
 *
 * HF semantics followed here (tokenizers/src/tokenizer/normalizer.rs and pattern.rs, and
 * the files in tokenizers/src/pre_tokenizers):
 * - Each step splits every current piece; a regex sees one piece, never its neighbours.
 * - A regex's matches are enumerated like the onig crate's find_iter: leftmost match from
 *   the end of the previous one; an empty match right where the previous match ended is
 *   skipped by advancing one character (so "a*" on "baa" gives "", "aa" and no trailing "").
 *   The gaps and the matches alternate as segments (match flag true/false; empty matches
 *   included), `invert` flips the flags, the behaviour merges or drops segments, and empty
 *   pieces are dropped last.
 * - Digits is a split on char::is_numeric (Unicode N*, here \p{N}): Isolated per character
 *   when individual_digits, else Contiguous (runs), which is exactly a Split on \p{N} resp.
 *   \p{N}+ with Isolated, so it runs through the same code.
 * - ByteLevel adds the prefix space to each piece that does not start with one, then
 *   splits with GPT-2's regex when use_regex, then maps bytes (our BPE does that through
 *   its byte table, so the mapping happens exactly once).
 *
 * Known differences: PCRE2's Unicode tables are not Oniguruma's or Rust's (a code point
 * added in a newer Unicode version may be classed differently), and \s also matches U+180E
 * in PCRE2 10.42. ^ and $ anchor at lines, as in Oniguruma's Ruby syntax (PCRE2_MULTILINE),
 * \h is a hex digit as there (spelled out), and a class intersection is refused.
 */
#define PCRE2_CODE_UNIT_WIDTH 8

#include "pretokenizer.h"
#include "tokenizer.h"

#include <cjson/cJSON.h>
#include <pcre2.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* GPT-2's pre-tokenisation regex, the one ByteLevel(use_regex=true) applies. PCRE2_UCP makes
   \s, \p{L}, \p{N} Unicode aware, like the Oniguruma regex Hugging Face uses. Known
   differences in the \s class: PCRE2 10.42 also counts U+180E as space (Oniguruma does not);
   gpt-3-encoder (JavaScript) counts U+FEFF but not U+0085. */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* A hostile file could nest Sequences deeply (the parser recurses) or list thousands of
   steps (each compiles a regex); real files have two or three. */
enum { MAX_STEPS = 64, MAX_NESTING = 16 };

typedef enum { B_REMOVED, B_ISOLATED, B_MERGED_PREV, B_MERGED_NEXT, B_CONTIGUOUS } behavior;

static const char *const BEHAVIOR_NAMES[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext",
                                             "Contiguous"};

typedef struct {
    pcre2_code *re;      /* Split and Digits: what separates; NULL for ByteLevel */
    behavior how;
    int invert;
    int byte_level;      /* the ByteLevel step (always the last) */
    int add_prefix_space;
} step;

struct tl_tlz_pretok {
    step steps[MAX_STEPS];
    int n_steps;
    int prefix_stretch;
    pcre2_code *gpt2;    /* ByteLevel's own regex; NULL when use_regex is false */
    uint32_t max_pairs;  /* ovector pairs enough for every regex here */
};

typedef struct {
    size_t a, b;
    int match;
} segment;

typedef struct {
    segment *v;
    size_t n, cap;
} seglist;

struct tl_tlz_pretok_scratch {
    pcre2_match_data *md;
    /* a JIT stack larger than PCRE2's 32 KiB, made when a match runs out of that one: a
       regex that repeats a group ((?:\p{L}|')+) needs it for a word of some thousands of
       characters (a URL, base64), which Hugging Face's Oniguruma encodes */
    pcre2_match_context *big_stack_context;
    pcre2_jit_stack *big_stack;
    seglist segs[MAX_STEPS + 1]; /* one per depth: a step's pieces live while deeper ones run */
    char *prefixed;              /* " " + piece, for ByteLevel's add_prefix_space */
    size_t prefixed_cap;
};

/* ------------------------------------------------------------------ parse */

static int compile(const char *pattern, uint32_t options, const char *where, pcre2_code **out, char *err,
                   size_t errlen)
{
    int code;
    PCRE2_SIZE off;
    *out = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED, options, &code, &off, NULL);
    if (!*out) {
        PCRE2_UCHAR msg[160];
        char q[96];
        pcre2_get_error_message(code, msg, sizeof msg);
        return tl_tlz_fail(err, errlen, code == PCRE2_ERROR_HEAP_FAILED ? TLZ_ENOMEM : TLZ_EFORMAT,
                        "%s: cannot compile the regex '%s': %s (at offset %zu)", where,
                        tl_tlz_quote(pattern, strlen(pattern), q, sizeof q), (char *)msg, (size_t)off);
    }
#ifndef TLZ_NO_JIT
    /* A failure only means no JIT on this platform; pcre2_match then runs the interpreter on
       the same code, with the same results. */
    (void)pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE);
#endif
    return TLZ_OK;
}

/* An Oniguruma (Ruby syntax) regex as PCRE2 reads the same: \h and \H (a hex digit, and
   any other character: PCRE2's are horizontal space) spelled out; an inline flag m (Ruby's
   dot-matches-newline) as PCRE2's s; {,n} (Ruby's {0,n}, PCRE2's literal text) as {0,n}; a
   class intersection ([a-z&&[^aeiou]], which PCRE2 reads as the characters '&') and a class
   nested in a class ([a[bc]], Ruby's union, PCRE2's '[' then a literal ']') refused. *out
   is malloc'd. */
static int from_ruby_syntax(const char *pattern, const char *where, char **out, char *err, size_t errlen)
{
    const size_t n = strlen(pattern);
    char *o = malloc(n * 12 + 1); /* (each \h grows to at most 12 bytes) */
    if (!o) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory reading %s", where);
    size_t k = 0;
    int in_class = 0;
    for (size_t i = 0; i < n; i++) {
        const char c = pattern[i];
        if (c == '\\' && i + 1 < n) {
            const char e = pattern[i + 1];
            if (e == 'h' || e == 'H') {
                if (e == 'H' && in_class) {
                    free(o);
                    return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s: \\H inside a character class is not supported", where);
                }
                const char *hex = in_class ? "0-9a-fA-F" : e == 'h' ? "[0-9a-fA-F]" : "[^0-9a-fA-F]";
                memcpy(o + k, hex, strlen(hex));
                k += strlen(hex);
            } else {
                o[k++] = c;
                o[k++] = e;
            }
            i++;
            continue;
        }
        if (c == '[' && in_class && !(i + 1 < n && pattern[i + 1] == ':')) { /* ([[:alpha:]] is PCRE2's too) */
            free(o);
            return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s: a character class nested in a class is not supported", where);
        }
        if (!in_class && c == '(' && i + 2 < n && pattern[i + 1] == '?' && strchr("imx-", pattern[i + 2])) {
            o[k++] = '(';
            o[k++] = '?';
            for (i += 2; i < n && strchr("imx-", pattern[i]); i++) o[k++] = pattern[i] == 'm' ? 's' : pattern[i];
            i--; /* (the ':' or ')' after the flags is copied as any character) */
            continue;
        }
        if (!in_class && c == '{' && i + 1 < n && pattern[i + 1] == ',') {
            size_t d = i + 2;
            while (d < n && pattern[d] >= '0' && pattern[d] <= '9') d++;
            if (d > i + 2 && d < n && pattern[d] == '}') { /* {,n}: Ruby's {0,n} */
                o[k++] = '{';
                o[k++] = '0';
                continue;
            }
        }
        if (c == '[') in_class++;
        else if (c == ']' && in_class) in_class--;
        else if (c == '&' && in_class && i + 1 < n && pattern[i + 1] == '&') {
            free(o);
            return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s: a class intersection (&&) is not supported", where);
        }
        o[k++] = c;
    }
    o[k] = 0;
    *out = o;
    return TLZ_OK;
}

static int get_bool(const cJSON *obj, const char *key, int dflt, int *out, const char *where, char *err,
                    size_t errlen)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) { *out = dflt; return TLZ_OK; }
    if (!cJSON_IsBool(v)) return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s.%s must be a boolean", where, key);
    *out = cJSON_IsTrue(v) ? 1 : 0;
    return TLZ_OK;
}

static int add_step(tl_tlz_pretok *p, step s, const char *where, char *err, size_t errlen)
{
    if (p->n_steps == MAX_STEPS) {
        if (s.re) pcre2_code_free(s.re);
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s: more than %d pre-tokenizer steps", where, MAX_STEPS);
    }
    p->steps[p->n_steps++] = s;
    return TLZ_OK;
}

static int parse_split(tl_tlz_pretok *p, const cJSON *node, const char *where, char *err, size_t errlen)
{
    step s = {0};
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(node, "pattern");
    const cJSON *rx = cJSON_IsObject(pat) ? cJSON_GetObjectItemCaseSensitive(pat, "Regex") : NULL;
    const cJSON *lit = cJSON_IsObject(pat) ? cJSON_GetObjectItemCaseSensitive(pat, "String") : NULL;
    if (!cJSON_IsString(rx) == !cJSON_IsString(lit))
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT,
                        "%s: Split needs \"pattern\": {\"Regex\": \"...\"} or {\"String\": \"...\"}", where);
    const cJSON *beh = cJSON_GetObjectItemCaseSensitive(node, "behavior");
    if (!cJSON_IsString(beh))
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s.behavior is missing or not a string", where);
    int found = 0;
    for (int i = 0; i < 5 && !found; i++)
        if (strcmp(beh->valuestring, BEHAVIOR_NAMES[i]) == 0) s.how = (behavior)i, found = 1;
    if (!found) {
        char q[64];
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT,
                        "%s.behavior '%s' is not supported (Removed, Isolated, MergedWithPrevious, "
                        "MergedWithNext or Contiguous)",
                        where, tl_tlz_quote(beh->valuestring, strlen(beh->valuestring), q, sizeof q));
    }
    int rc = get_bool(node, "invert", 0, &s.invert, where, err, errlen);
    if (rc) return rc;
    char at[530];
    if (snprintf(at, sizeof at, "%s.pattern", where) >= (int)sizeof at)
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s: pre_tokenizer nested too deep", where);
    /* HF escapes a String pattern into a regex; PCRE2_LITERAL is that escape. A Regex is
       Oniguruma's Ruby syntax: ^ and $ anchor at lines (PCRE2_MULTILINE), \h is a hex digit. */
    if (rx) {
        char *pcre_pattern = NULL;
        rc = from_ruby_syntax(rx->valuestring, at, &pcre_pattern, err, errlen);
        if (!rc) rc = compile(pcre_pattern, PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, at, &s.re, err, errlen);
        free(pcre_pattern);
    } else {
        rc = compile(lit->valuestring, PCRE2_UTF | PCRE2_LITERAL, at, &s.re, err, errlen);
    }
    return rc ? rc : add_step(p, s, where, err, errlen);
}

static int parse_node(tl_tlz_pretok *p, const cJSON *node, const char *where, int depth, char *err, size_t errlen)
{
    const cJSON *type = cJSON_IsObject(node) ? cJSON_GetObjectItemCaseSensitive(node, "type") : NULL;
    if (!cJSON_IsString(type))
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s is not an object with a string \"type\"", where);
    const char *t = type->valuestring;
    if (p->n_steps > 0 && p->steps[p->n_steps - 1].byte_level)
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT,
                        "%s ('%s') comes after the ByteLevel step, which must be the last one", where, t);
    if (strcmp(t, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(node, "pretokenizers");
        if (!cJSON_IsArray(list))
            return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s.pretokenizers is missing or not an array", where);
        if (depth >= MAX_NESTING)
            return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s: Sequence nested more than %d deep", where, MAX_NESTING);
        int i = 0;
        for (const cJSON *c = list->child; c; c = c->next, i++) {
            char sub[512]; /* MAX_NESTING levels of ".pretokenizers[N]" fit */
            if (snprintf(sub, sizeof sub, "%s.pretokenizers[%d]", where, i) >= (int)sizeof sub)
                return tl_tlz_fail(err, errlen, TLZ_EFORMAT, "%s: pre_tokenizer nested too deep", where);
            int rc = parse_node(p, c, sub, depth + 1, err, errlen);
            if (rc) return rc;
        }
        return TLZ_OK;
    }
    if (strcmp(t, "Split") == 0) return parse_split(p, node, where, err, errlen);
    if (strcmp(t, "Digits") == 0) {
        int individual = 0, rc = get_bool(node, "individual_digits", 0, &individual, where, err, errlen);
        step s = {.how = B_ISOLATED};
        if (!rc) rc = compile(individual ? "\\p{N}" : "\\p{N}+", PCRE2_UTF | PCRE2_UCP, where, &s.re, err, errlen);
        return rc ? rc : add_step(p, s, where, err, errlen);
    }
    if (strcmp(t, "ByteLevel") == 0) {
        step s = {.byte_level = 1};
        int use_regex = 1, trim = 1, rc;
        if ((rc = get_bool(node, "add_prefix_space", 0, &s.add_prefix_space, where, err, errlen)) ||
            (rc = get_bool(node, "use_regex", 1, &use_regex, where, err, errlen)) ||
            (rc = get_bool(node, "trim_offsets", 1, &trim, where, err, errlen))) /* offsets only */
            return rc;
        if (use_regex && (rc = compile(GPT2_PATTERN, PCRE2_UTF | PCRE2_UCP, where, &p->gpt2, err, errlen)))
            return rc;
        return add_step(p, s, where, err, errlen);
    }
    char q[64];
    return tl_tlz_fail(err, errlen, TLZ_EFORMAT,
                    "%s '%s' is not supported (supported: Sequence, Split, Digits, ByteLevel)", where,
                    tl_tlz_quote(t, strlen(t), q, sizeof q));
}

int tl_tlz_pretok_parse(const cJSON *root, tl_tlz_pretok **out, char *err, size_t errlen)
{
    *out = NULL;
    const cJSON *node = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
    if (!node || cJSON_IsNull(node))
        return tl_tlz_fail(err, errlen, TLZ_EFORMAT,
                        "pre_tokenizer is missing (a byte-level BPE needs a ByteLevel pre-tokenizer)");
    tl_tlz_pretok *p = calloc(1, sizeof *p);
    if (!p) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory loading the pre-tokenizer");
    int rc = parse_node(p, node, "pre_tokenizer", 0, err, errlen);
    /* Without ByteLevel, HF would run BPE on characters, not bytes: another model family. */
    if (!rc && (p->n_steps == 0 || !p->steps[p->n_steps - 1].byte_level))
        rc = tl_tlz_fail(err, errlen, TLZ_EFORMAT,
                      "pre_tokenizer has no ByteLevel step (only byte-level BPE is supported; it must be the last step)");
    if (rc) {
        tl_tlz_pretok_free(p);
        return rc;
    }
    p->prefix_stretch = p->n_steps == 1 && p->steps[0].add_prefix_space;
    p->max_pairs = 1;
    for (int i = 0; i <= p->n_steps; i++) {
        pcre2_code *re = i < p->n_steps ? p->steps[i].re : p->gpt2;
        uint32_t caps = 0;
        if (re && pcre2_pattern_info(re, PCRE2_INFO_CAPTURECOUNT, &caps) == 0 && caps + 1 > p->max_pairs)
            p->max_pairs = caps + 1;
    }
    *out = p;
    return TLZ_OK;
}

void tl_tlz_pretok_free(tl_tlz_pretok *p)
{
    if (!p) return;
    for (int i = 0; i < p->n_steps; i++)
        if (p->steps[i].re) pcre2_code_free(p->steps[i].re);
    if (p->gpt2) pcre2_code_free(p->gpt2);
    free(p);
}

int tl_tlz_pretok_prefix_stretch(const tl_tlz_pretok *p) { return p->prefix_stretch; }

tl_tlz_pretok_scratch *tl_tlz_pretok_scratch_new(const tl_tlz_pretok *p)
{
    tl_tlz_pretok_scratch *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->md = pcre2_match_data_create(p->max_pairs, NULL);
    if (!s->md) {
        free(s);
        return NULL;
    }
    return s;
}

void tl_tlz_pretok_scratch_free(tl_tlz_pretok_scratch *s)
{
    if (!s) return;
    pcre2_match_data_free(s->md);
    pcre2_match_context_free(s->big_stack_context);
    pcre2_jit_stack_free(s->big_stack);
    for (int i = 0; i <= MAX_STEPS; i++) free(s->segs[i].v);
    free(s->prefixed);
    free(s);
}

/* -------------------------------------------------------------------- run */

static int push(seglist *l, size_t a, size_t b, int match)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 32;
        segment *v = realloc(l->v, cap * sizeof *v);
        if (!v) return 0;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = (segment){a, b, match};
    return 1;
}

/* Gaps and matches of re over s[0..n), in order, as the onig crate's find_iter yields them
   (see the top of the file for the empty-match rule). */
/* The most JIT stack a match may use: reserved as address space, used as needed. */
#define BIG_JIT_STACK (64u << 20)

static int find_segments(pcre2_code *re, tl_tlz_pretok_scratch *scratch, const char *s, size_t n, seglist *out,
                         char *err, size_t errlen)
{
    pcre2_match_data *md = scratch->md;
    size_t last_end = 0, prev = 0, last_match_end = 0;
    int have_match = 0;
    out->n = 0;
    while (last_end <= n) {
        int m = pcre2_match(re, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK, md, scratch->big_stack_context);
        if (m == PCRE2_ERROR_JIT_STACKLIMIT && !scratch->big_stack_context) {
            scratch->big_stack_context = pcre2_match_context_create(NULL);
            scratch->big_stack = pcre2_jit_stack_create(32u << 10, BIG_JIT_STACK, NULL);
            if (!scratch->big_stack_context || !scratch->big_stack)
                return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory for the pre-tokenizer regex's stack");
            pcre2_jit_stack_assign(scratch->big_stack_context, NULL, scratch->big_stack);
            continue; /* the same match again, on the larger stack */
        }
        if (m == PCRE2_ERROR_NOMATCH) break;
        if (m < 0) {
            PCRE2_UCHAR msg[160];
            pcre2_get_error_message(m, msg, sizeof msg);
            /* The match and backtracking limits end a pathological regex here, as an error. */
            return tl_tlz_fail(err, errlen, m == PCRE2_ERROR_NOMEMORY ? TLZ_ENOMEM : TLZ_EENCODE,
                            "pre-tokenizer regex failed: %s", (char *)msg);
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t a = ov[0], b = ov[1];
        if (b < a || a < last_end) /* only \K inside a lookaround could do this; PCRE2 >= 10.38 refuses it */
            return tl_tlz_fail(err, errlen, TLZ_EENCODE, "pre-tokenizer regex reported a match that ends before it starts");
        if (a == b && have_match && last_end == last_match_end) {
            if (last_end >= n) break;
            int k = tl_tlz_utf8_seq((const unsigned char *)s + last_end, n - last_end);
            last_end += k > 0 ? (size_t)k : 1; /* valid UTF-8 by contract: k > 0 */
            continue;
        }
        last_end = last_match_end = b;
        have_match = 1;
        if ((prev != a && !push(out, prev, a, 0)) || !push(out, a, b, 1))
            return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory encoding");
        prev = b;
    }
    if (prev != n && !push(out, prev, n, 0)) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory encoding");
    return TLZ_OK;
}

/* Applies a behaviour to segments in place (HF's NormalizedString::split folds); afterwards
   every kept segment has match == 0 and removed ones have match == 1. */
static void apply_behavior(seglist *l, behavior how, int invert)
{
    if (invert)
        for (size_t i = 0; i < l->n; i++) l->v[i].match = !l->v[i].match;
    size_t o = 0;
    int prev_match = 0;
    switch (how) {
    case B_REMOVED: /* the match flag already says "drop" */
        return;
    case B_ISOLATED:
        for (size_t i = 0; i < l->n; i++) l->v[i].match = 0;
        return;
    case B_CONTIGUOUS:
        for (size_t i = 0; i < l->n; i++) {
            segment g = l->v[i];
            if (g.match == prev_match && o > 0) l->v[o - 1].b = g.b;
            else l->v[o++] = (segment){g.a, g.b, 0};
            prev_match = g.match;
        }
        break;
    case B_MERGED_PREV:
        for (size_t i = 0; i < l->n; i++) {
            segment g = l->v[i];
            if (g.match && !prev_match && o > 0) l->v[o - 1].b = g.b;
            else l->v[o++] = (segment){g.a, g.b, 0};
            prev_match = g.match;
        }
        break;
    case B_MERGED_NEXT: {
        /* Folded from the right into the tail of the array, then moved to the front. */
        size_t w = l->n; /* next free slot from the right: l->v[w..n) is the result */
        for (size_t i = l->n; i-- > 0;) {
            segment g = l->v[i];
            if (g.match && !prev_match && w < l->n) l->v[w].a = g.a;
            else l->v[--w] = (segment){g.a, g.b, 0};
            prev_match = g.match;
        }
        memmove(l->v, l->v + w, (l->n - w) * sizeof *l->v);
        o = l->n - w;
        break;
    }
    }
    l->n = o;
}

static int run_step(const tl_tlz_pretok *p, tl_tlz_pretok_scratch *s, int k, const char *text, size_t n,
                    tl_tlz_piece_fn emit, void *ctx, char *err, size_t errlen);

static int byte_level(const tl_tlz_pretok *p, tl_tlz_pretok_scratch *s, const step *st, const char *text, size_t n,
                      tl_tlz_piece_fn emit, void *ctx, char *err, size_t errlen)
{
    if (st->add_prefix_space && !p->prefix_stretch && text[0] != ' ') {
        if (n + 1 > s->prefixed_cap) {
            size_t cap = 2 * (n + 1);
            char *b = realloc(s->prefixed, cap);
            if (!b) return tl_tlz_fail(err, errlen, TLZ_ENOMEM, "out of memory encoding");
            s->prefixed = b;
            s->prefixed_cap = cap;
        }
        s->prefixed[0] = ' ';
        memcpy(s->prefixed + 1, text, n);
        text = s->prefixed;
        n++;
    }
    if (!p->gpt2) return emit(ctx, (const unsigned char *)text, n);
    seglist *l = &s->segs[MAX_STEPS];
    int rc = find_segments(p->gpt2, s, text, n, l, err, errlen);
    for (size_t i = 0; i < l->n && !rc; i++) /* Isolated: every segment, empty ones dropped */
        if (l->v[i].b > l->v[i].a) rc = emit(ctx, (const unsigned char *)text + l->v[i].a, l->v[i].b - l->v[i].a);
    return rc;
}

/* Depth first: step k splits its piece, then every sub-piece goes through steps k+1.. before
   the next one. Each step treats pieces independently, so this yields HF's order. */
static int run_step(const tl_tlz_pretok *p, tl_tlz_pretok_scratch *s, int k, const char *text, size_t n,
                    tl_tlz_piece_fn emit, void *ctx, char *err, size_t errlen)
{
    const step *st = &p->steps[k];
    if (st->byte_level) return byte_level(p, s, st, text, n, emit, ctx, err, errlen);
    seglist *l = &s->segs[k];
    int rc = find_segments(st->re, s, text, n, l, err, errlen);
    if (rc) return rc;
    apply_behavior(l, st->how, st->invert);
    for (size_t i = 0; i < l->n && !rc; i++) {
        segment g = l->v[i]; /* by value: deeper steps use other lists, but stay safe */
        if (!g.match && g.b > g.a) rc = run_step(p, s, k + 1, text + g.a, g.b - g.a, emit, ctx, err, errlen);
    }
    return rc;
}

int tl_tlz_pretok_run(const tl_tlz_pretok *p, tl_tlz_pretok_scratch *s, const char *text, size_t n, tl_tlz_piece_fn emit,
                   void *ctx, char *err, size_t errlen)
{
    if (n == 0) return TLZ_OK; /* HF drops empty pieces */
    return run_step(p, s, 0, text, n, emit, ctx, err, errlen);
}

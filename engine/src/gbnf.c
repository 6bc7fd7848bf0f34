/* gbnf.c: llama.cpp's GBNF dialect parsed into the rule builder (grammar.h).
 *
 *   grammar   := (rule)*                     rules end at a newline unless inside ( )
 *   rule      := name '::=' alternates
 *   alternates:= sequence ('|' sequence)*    newlines may follow '::=', '|' and '('
 *   sequence  := (element postfix?)*
 *   element   := '"' literal '"' | '[' '^'? class ']' | '.' | name | '(' alternates ')'
 *              | '!'? '<' ('[' id ']' | text) '>'     a token reference (one whole token)
 *   postfix   := '*' | '+' | '?' | '{' m '}' | '{' m ',' '}' | '{' m ',' n '}'
 *   comments  := '#' to the end of the line
 * Groups and repetitions become generated rules; repetition is right-recursive with the
 * recursive call in tail position (the matcher pushes nothing for it). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "tokenizer.h"

#define MAX_REPEAT 10000
#define MAX_NESTING 200

typedef struct parser {
    const char *src, *end, *at;
    tl_gram_builder b;
    int rule;                /* rule being defined, for messages */
    int depth;
    /* position()'s last answer: the parse moves forward, so each call scans on from here
       (from the start each time, a grammar of thousands of rules took seconds) */
    const char *pos_at;
    int pos_line, pos_col;
    char *err;
    size_t errlen;
    tl_status st;
} parser;

/* An alternative under construction: items are committed to the builder when it ends, so
   that nested groups can add their own alternatives meanwhile. */
typedef struct seq { tl_gram_item *items; int n, cap; } seq;

static void position(parser *ps, const char *at, int *line, int *col) {
    const char *c = ps->src;
    *line = 1;
    *col = 1;
    if (ps->pos_at && ps->pos_at <= at) {
        c = ps->pos_at;
        *line = ps->pos_line;
        *col = ps->pos_col;
    }
    for (; c < at && c < ps->end; c++) {
        /* a line ends at "\n", "\r\n" or a lone "\r", as the parser reads it (the position
           counted "\n" only: a file of lone CRs was all line 1) */
        if (*c == '\n' || (*c == '\r' && (c + 1 >= ps->end || c[1] != '\n'))) { (*line)++; *col = 1; }
        else if (*c != '\r' && ((unsigned char)*c & 0xC0) != 0x80) (*col)++;
    }
    ps->pos_at = c;
    ps->pos_line = *line;
    ps->pos_col = *col;
}

static bool fail_at(parser *ps, const char *at, const char *fmt, const char *what) {
    if (ps->st != TL_OK) return false;
    int line, col;
    position(ps, at, &line, &col);
    int n = snprintf(ps->err, ps->errlen, "line %d, column %d: ", line, col);
    if (n < 0 || (size_t)n >= ps->errlen) n = 0;
    n += snprintf(ps->err + n, ps->errlen - (size_t)n, fmt, what);
    if (ps->rule >= 0 && (size_t)n < ps->errlen)
        snprintf(ps->err + n, ps->errlen - (size_t)n, " (in rule '%s')", ps->b.names[ps->rule]);
    ps->st = TL_ERR_INVALID_ARGUMENT;
    return false;
}

static bool oom(parser *ps) {
    if (ps->st == TL_OK) {
        snprintf(ps->err, ps->errlen, "out of memory parsing the grammar");
        ps->st = TL_ERR_NO_MEMORY;
    }
    return false;
}

static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

/* Skips blanks and comments; newlines only when `newlines` is true. */
static void skip_space(parser *ps, bool newlines) {
    while (ps->at < ps->end) {
        char c = *ps->at;
        if (c == ' ' || c == '\t' || (newlines && (c == '\n' || c == '\r'))) ps->at++;
        else if (c == '#') { /* (to the line's end: a \n, or a lone \r, as llama.cpp reads it) */
            while (ps->at < ps->end && *ps->at != '\n' && *ps->at != '\r') ps->at++;
        } else break;
    }
}

static bool seq_push(parser *ps, seq *s, tl_gram_item it) {
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 8;
        tl_gram_item *q = realloc(s->items, (size_t)cap * sizeof *q);
        if (!q) return oom(ps);
        s->items = q;
        s->cap = cap;
    }
    s->items[s->n++] = it;
    return true;
}

static bool add_ranges(parser *ps, const tl_gram_range *r, int n, tl_gram_item *it) {
    tl_gram_builder *b = &ps->b;
    if (b->n_ranges + n > b->cap_ranges) {
        int cap = b->cap_ranges ? b->cap_ranges : 64;
        while (cap < b->n_ranges + n) cap *= 2;
        tl_gram_range *q = realloc(b->ranges, (size_t)cap * sizeof *q);
        if (!q) return oom(ps);
        b->ranges = q;
        b->cap_ranges = cap;
    }
    if (n) memcpy(b->ranges + b->n_ranges, r, (size_t)n * sizeof *r);
    *it = (tl_gram_item){GE_BYTES, b->n_ranges, n};
    b->n_ranges += n;
    return true;
}

/* The parser's limits: the program's elements (GRAM_MAX_ELEMS, where it stopped at four times
   that), and rules, some 200 bytes each: 800 "a"{0,10000} held 8 million of them, 1.3 GB, before
   the program refused them. A repetition checks what it will add before it adds it. */
#define GBNF_MAX_RULES (1 << 20)

/* Commits an alternative of `rule`. */
static bool commit_alt(parser *ps, int rule, const tl_gram_item *items, int n) {
    tl_gram_builder *b = &ps->b;
    if (b->n_items + n > GRAM_MAX_ELEMS) return fail_at(ps, ps->at, "%s", "grammar too large");
    if (b->n_items + n > b->cap_items) {
        int cap = b->cap_items ? b->cap_items : 64;
        while (cap < b->n_items + n) cap *= 2;
        tl_gram_item *q = realloc(b->items, (size_t)cap * sizeof *q);
        if (!q) return oom(ps);
        b->items = q;
        b->cap_items = cap;
    }
    if (b->n_alts == b->cap_alts) {
        int cap = b->cap_alts ? b->cap_alts * 2 : 32;
        int32_t *r = realloc(b->alt_rule, (size_t)cap * sizeof *r);
        if (!r) return oom(ps);
        b->alt_rule = r;
        int32_t *f = realloc(b->alt_first, (size_t)cap * sizeof *f);
        if (!f) return oom(ps);
        b->alt_first = f;
        int32_t *l = realloc(b->alt_len, (size_t)cap * sizeof *l);
        if (!l) return oom(ps);
        b->alt_len = l;
        b->cap_alts = cap;
    }
    if (n) memcpy(b->items + b->n_items, items, (size_t)n * sizeof *items);
    b->alt_rule[b->n_alts] = rule;
    b->alt_first[b->n_alts] = b->n_items;
    b->alt_len[b->n_alts] = n;
    b->n_alts++;
    b->n_items += n;
    return true;
}

/* One code point of a literal or class, escapes decoded. */
static bool parse_char(parser *ps, uint32_t *out, const char *context) {
    const char *start = ps->at;
    if (ps->at >= ps->end) return fail_at(ps, start, "unexpected end of input in %s", context);
    unsigned char c = (unsigned char)*ps->at;
    if (c == '\\') {
        ps->at++;
        if (ps->at >= ps->end) return fail_at(ps, start, "unfinished escape in %s", context);
        char e = *ps->at++;
        int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
        if (digits) {
            uint32_t v = 0;
            for (int i = 0; i < digits; i++) {
                if (ps->at >= ps->end) return fail_at(ps, start, "expected %s hex digits after the escape", digits == 2 ? "2" : digits == 4 ? "4" : "8");
                char h = *ps->at++;
                int d = tl_gram_hex_digit((unsigned char)h);
                if (d < 0) return fail_at(ps, ps->at - 1, "expected a hex digit in an escape in %s", context);
                v = v * 16 + (uint32_t)d;
            }
            if (v > 0x10FFFF) return fail_at(ps, start, "escape beyond U+10FFFF in %s", context);
            /* UTF-16 surrogates are no characters (no UTF-8 text holds one): a high one and a
               low one written as JSON writes them are the one character they mean */
            if (v >= 0xD800 && v <= 0xDBFF && ps->end - ps->at >= 6 && ps->at[0] == '\\' && ps->at[1] == 'u') {
                uint32_t low = 0;
                int i = 2;
                for (; i < 6; i++) {
                    const char h = ps->at[i];
                    const int d = tl_gram_hex_digit((unsigned char)h);
                    if (d < 0) break;
                    low = low * 16 + (uint32_t)d;
                }
                if (i == 6 && low >= 0xDC00 && low <= 0xDFFF) {
                    ps->at += 6;
                    *out = 0x10000 + ((v - 0xD800) << 10) + (low - 0xDC00);
                    return true;
                }
            }
            if (v >= 0xD800 && v <= 0xDFFF)
                return fail_at(ps, start, "a UTF-16 surrogate is not a character (in %s): write the character, or "
                               "\\U and its 8 hex digits", context);
            *out = v;
            return true;
        }
        switch (e) {
        case 'n': *out = '\n'; return true;
        case 't': *out = '\t'; return true;
        case 'r': *out = '\r'; return true;
        case '0': *out = 0; return true;
        case '\\': case '"': case '[': case ']': case '-': case '^': case '/': case '\'': case '.': case '*':
        case '+': case '?': case '(': case ')': case '{': case '}': case '|':
            *out = (uint32_t)e;
            return true;
        default: {
            char what[2] = {e, 0};
            return fail_at(ps, start, "unknown escape '\\%s' (expected one of \\n \\t \\r \\0 \\xHH \\uHHHH \\UHHHHHHHH, "
                                      "or \\ before one of \\ \" [ ] - ^ / ' . * + ? ( ) { } |)", what);
        }
        }
    }
    /* raw text: one strict UTF-8 sequence (the tokenizer's one reading: an overlong form, a
       surrogate or a code point past U+10FFFF is refused, as the escapes refuse them) */
    const int len = tl_tlz_utf8_seq((const unsigned char *)ps->at, (size_t)(ps->end - ps->at));
    if (len <= 0) return fail_at(ps, start, "invalid UTF-8 in %s", context);
    *out = tl_tlz_utf8_value((const unsigned char *)ps->at, len);
    ps->at += len;
    return true;
}

static int cmp_range(const void *a, const void *b) {
    const tl_gram_range *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

/* [abc], [a-z], [^...]: ranges sorted and merged; negation over U+0000..U+10FFFF. */
static bool parse_class(parser *ps, tl_gram_item *it) {
    const char *open = ps->at++;
    bool negate = ps->at < ps->end && *ps->at == '^';
    if (negate) ps->at++;
    tl_gram_range *r = NULL;
    int n = 0, cap = 0;
    bool ok = true;
    while (ok) {
        if (ps->at >= ps->end) { ok = fail_at(ps, open, "%s", "unterminated character class: expected ']'"); break; }
        if (*ps->at == ']') { ps->at++; break; }
        uint32_t lo, hi;
        if (!(ok = parse_char(ps, &lo, "a character class"))) break;
        hi = lo;
        if (ps->at + 1 < ps->end && *ps->at == '-' && ps->at[1] != ']') {
            ps->at++;
            if (!(ok = parse_char(ps, &hi, "a character class"))) break;
            if (hi < lo) { ok = fail_at(ps, ps->at, "%s", "character range is reversed (end before start)"); break; }
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            tl_gram_range *q = realloc(r, (size_t)cap * sizeof *q);
            if (!q) { ok = oom(ps); break; }
            r = q;
        }
        r[n++] = (tl_gram_range){lo, hi};
    }
    /* [] and [^]: llama.cpp's parser adds nothing for them (the sequence goes on as if they
       were not there); read as classes, they are no character and any one: refused, so that a
       grammar means one thing here and there */
    if (ok && n == 0)
        ok = fail_at(ps, open, "%s", negate ? "an empty class [^]: write . for any one character"
                                            : "an empty class []: it matches no character");
    if (ok) {
        if (n > 1) qsort(r, (size_t)n, sizeof *r, cmp_range);
        int m = 0;
        for (int i = 0; i < n; i++) {
            if (m && r[i].lo <= r[m - 1].hi + 1) {
                if (r[i].hi > r[m - 1].hi) r[m - 1].hi = r[i].hi;
            } else r[m++] = r[i];
        }
        n = m;
        if (negate) {
            tl_gram_range *c = malloc(((size_t)n + 1) * sizeof *c);
            if (!c) ok = oom(ps);
            int k = 0;
            uint32_t next = 0;
            for (int i = 0; ok && i < n; i++) {
                if (r[i].lo > next) c[k++] = (tl_gram_range){next, r[i].lo - 1};
                next = r[i].hi + 1;
            }
            if (ok && next <= 0x10FFFF) c[k++] = (tl_gram_range){next, 0x10FFFF};
            free(r);
            r = c;
            n = k;
        }
    }
    if (ok) ok = add_ranges(ps, r, n, it);
    free(r);
    return ok;
}

static bool parse_alternates(parser *ps, int rule);

/* A token reference (llama.cpp's): <[id]>, or <text> for the token whose text is exactly that,
   brackets included (<think>, <|im_end|>), either negated by a leading '!' (any one token but
   that one). It matches one whole token by id, special tokens included; <text> is looked up in
   each vocabulary the grammar is used with. */
static bool parse_token_ref(parser *ps, tl_gram_item *it) {
    const char *start = ps->at;
    tl_gram_token_ref ref = {.id = -1};
    if (*ps->at == '!') {
        ref.negated = true;
        ps->at++;
    }
    if (ps->at >= ps->end || *ps->at != '<')
        return fail_at(ps, start, "%s", "expected '<' after '!' (a token reference: !<[id]> or !<text>)");
    const char *open = ps->at++;
    if (ps->at < ps->end && *ps->at == '[') {
        const char *digits = ++ps->at;
        long id = 0;
        while (ps->at < ps->end && *ps->at >= '0' && *ps->at <= '9') {
            id = id * 10 + (*ps->at++ - '0');
            if (id > INT32_MAX) return fail_at(ps, digits, "%s", "token id past 2^31 - 1 in '<[id]>'");
        }
        if (ps->at == digits) return fail_at(ps, digits, "%s", "expected a token id in '<[id]>'");
        if (ps->end - ps->at < 2 || ps->at[0] != ']' || ps->at[1] != '>')
            return fail_at(ps, ps->at, "%s", "expected ']>' to close '<[id]>'");
        ps->at += 2;
        ref.id = (int32_t)id;
    } else {
        while (ps->at < ps->end && *ps->at != '>' && *ps->at != '\n') {
            const int len = tl_tlz_utf8_seq((const unsigned char *)ps->at, (size_t)(ps->end - ps->at));
            if (len <= 0) return fail_at(ps, ps->at, "%s", "invalid UTF-8 in a token reference");
            ps->at += len;
        }
        if (ps->at >= ps->end || *ps->at != '>')
            return fail_at(ps, open, "%s", "unterminated token reference: expected '>' (<[id]> or <text>)");
        ps->at++;
        const size_t len = (size_t)(ps->at - open);
        if (len == 2) return fail_at(ps, open, "%s", "an empty token reference '<>'");
        if (!(ref.text = tl_gram_copy_text(open, len))) return oom(ps);
    }
    tl_gram_builder *b = &ps->b;
    if (!tl_gram_grow((void **)&b->tokens, &b->cap_tokens, b->n_tokens + 1, sizeof *b->tokens)) {
        free(ref.text);
        return oom(ps);
    }
    b->tokens[b->n_tokens] = ref;
    *it = (tl_gram_item){GE_TOKEN, b->n_tokens++, 0};
    return true;
}

/* x* x+ x? x{m} x{m,} x{m,n}: replaces the last item of s. */
static bool apply_repeat(parser *ps, seq *s, int min, int max /* -1: unbounded */) {
    const tl_gram_item x = s->items[--s->n];
    tl_gram_builder *b = &ps->b;
    const long more = max > min ? max - min : 1; /* the rules it adds (two items and an empty alternative each) */
    /* (the sequence's items so far count too: they are committed with its alternative) */
    if ((long)b->n_rules + more > GBNF_MAX_RULES || (long)b->n_items + s->n + (long)min + 2 * more > GRAM_MAX_ELEMS)
        return fail_at(ps, ps->at, "%s", "grammar too large (over 2^20 rules or 2^22 elements once its repetitions are expanded)");
    if (max == 0) { /* x{0}: an empty rule stands in, so that a following postfix has an element */
        int empty = tl_gram_builder_fresh_rule(b, ps->rule);
        if (empty < 0) return oom(ps);
        return commit_alt(ps, empty, NULL, 0) && seq_push(ps, s, (tl_gram_item){GE_REF, empty, 0});
    }
    for (int i = 0; i < min; i++)
        if (!seq_push(ps, s, x)) return false;
    if (max == min) return true;
    if (max < 0) { /* star ::= x star | ε */
        int star = tl_gram_builder_fresh_rule(b, ps->rule);
        if (star < 0) return oom(ps);
        tl_gram_item both[2] = {x, {GE_REF, star, 0}};
        if (!commit_alt(ps, star, both, 2) || !commit_alt(ps, star, NULL, 0)) return false;
        return seq_push(ps, s, (tl_gram_item){GE_REF, star, 0});
    }
    /* up to (max - min) more: opt_k ::= x opt_(k+1) | ε, built from the innermost */
    int inner = -1;
    for (int k = 0; k < max - min; k++) {
        int opt = tl_gram_builder_fresh_rule(b, ps->rule);
        if (opt < 0) return oom(ps);
        tl_gram_item both[2] = {x, {GE_REF, inner, 0}};
        if (!commit_alt(ps, opt, both, inner >= 0 ? 2 : 1) || !commit_alt(ps, opt, NULL, 0)) return false;
        inner = opt;
    }
    return seq_push(ps, s, (tl_gram_item){GE_REF, inner, 0});
}

static bool parse_int(parser *ps, int *v) {
    const char *start = ps->at;
    long n = 0;
    while (ps->at < ps->end && *ps->at >= '0' && *ps->at <= '9') {
        n = n * 10 + (*ps->at++ - '0');
        if (n > MAX_REPEAT) return fail_at(ps, start, "repetition count above %s", "10000");
    }
    if (ps->at == start) return fail_at(ps, start, "%s", "expected a number in '{m,n}'");
    *v = (int)n;
    return true;
}

static bool parse_postfix(parser *ps, seq *s) {
    const char *at = ps->at;
    char c = *at;
    if (c == '*') { ps->at++; return apply_repeat(ps, s, 0, -1); }
    if (c == '+') { ps->at++; return apply_repeat(ps, s, 1, -1); }
    if (c == '?') { ps->at++; return apply_repeat(ps, s, 0, 1); }
    /* '{': inside parentheses, line ends may stand between its parts (llama.cpp's) */
    const bool nested = ps->depth > 0;
    ps->at++;
    skip_space(ps, nested);
    int min, max;
    if (!parse_int(ps, &min)) return false;
    skip_space(ps, nested);
    max = min;
    if (ps->at < ps->end && *ps->at == ',') {
        ps->at++;
        skip_space(ps, nested);
        if (ps->at < ps->end && *ps->at == '}') max = -1;
        else if (!parse_int(ps, &max)) return false;
        skip_space(ps, nested);
    }
    if (ps->at >= ps->end || *ps->at != '}') return fail_at(ps, ps->at, "%s", "expected '}' to close '{m,n}'");
    ps->at++;
    if (max >= 0 && max < min) return fail_at(ps, at, "%s", "repetition '{m,n}' with n < m");
    return apply_repeat(ps, s, min, max);
}

/* A sequence: elements until '|', ')', a newline (outside parentheses) or the end. */
static bool parse_sequence(parser *ps, seq *s) {
    const bool nested = ps->depth > 0;
    for (;;) {
        skip_space(ps, nested);
        if (ps->at >= ps->end) return true;
        const char *start = ps->at;
        char c = *ps->at;
        if (c == '|' || c == ')' || c == '\n' || c == '\r') return true;
        const int element = s->n; /* the element's first item: a postfix applies to all of them */
        if (c == '"') {
            ps->at++;
            for (;;) { /* (a line end inside is a character of it, as llama.cpp reads it) */
                if (ps->at >= ps->end) return fail_at(ps, start, "%s", "unterminated string literal: expected '\"'");
                if (*ps->at == '"') { ps->at++; break; }
                uint32_t cp;
                if (!parse_char(ps, &cp, "a string literal")) return false;
                tl_gram_range r = {cp, cp};
                tl_gram_item it;
                if (!add_ranges(ps, &r, 1, &it) || !seq_push(ps, s, it)) return false;
            }
        } else if (c == '[') {
            tl_gram_item it;
            if (!parse_class(ps, &it) || !seq_push(ps, s, it)) return false;
        } else if (c == '<' || c == '!') {
            tl_gram_item it;
            if (!parse_token_ref(ps, &it) || !seq_push(ps, s, it)) return false;
        } else if (c == '.') {
            ps->at++;
            tl_gram_range any = {0, 0x10FFFF};
            tl_gram_item it;
            if (!add_ranges(ps, &any, 1, &it) || !seq_push(ps, s, it)) return false;
        } else if (c == '(') {
            ps->at++;
            if (++ps->depth > MAX_NESTING) return fail_at(ps, start, "%s", "parentheses nested too deeply");
            int group = tl_gram_builder_fresh_rule(&ps->b, ps->rule);
            if (group < 0) return oom(ps);
            if (!parse_alternates(ps, group)) return false;
            skip_space(ps, true);
            if (ps->at >= ps->end || *ps->at != ')') return fail_at(ps, start, "%s", "expected ')' to close '('");
            ps->at++;
            ps->depth--;
            if (!seq_push(ps, s, (tl_gram_item){GE_REF, group, 0})) return false;
        } else if (is_name_char(c)) {
            const char *name = ps->at;
            while (ps->at < ps->end && is_name_char(*ps->at)) ps->at++;
            /* "name ::=" starts the next rule: the sequence ended at the previous line */
            const char *after = ps->at;
            skip_space(ps, false);
            if (ps->end - ps->at >= 3 && memcmp(ps->at, "::=", 3) == 0)
                return fail_at(ps, name, "%s", "a rule definition must start on its own line (expected a newline before it)");
            ps->at = after;
            int r = tl_gram_builder_rule(&ps->b, name, (size_t)(after - name));
            if (r < 0) return oom(ps);
            if (ps->b.defined_at[r] < 0 && ps->b.used_line[r] == 0) position(ps, name, &ps->b.used_line[r], &ps->b.used_col[r]);
            if (!seq_push(ps, s, (tl_gram_item){GE_REF, r, 0})) return false;
        } else {
            char what[8] = {c, 0};
            if ((unsigned char)c < 0x20 || (unsigned char)c >= 0x7F) snprintf(what, sizeof what, "\\x%02X", (unsigned char)c);
            return fail_at(ps, start, "unexpected '%s': expected a literal, a class, a token reference, a rule name, '(' or '.'", what);
        }
        /* Postfixes bind to the element just parsed, after spaces too ("x *"), and a second
           one to everything the first made ("a"+? is ("a"+)?, "a"{2}* is ("aa")*), as in
           llama.cpp: an element of other than one item (a multi-character literal, a
           repetition's copies) becomes a rule first. */
        skip_space(ps, nested);
        while (ps->at < ps->end && (*ps->at == '*' || *ps->at == '+' || *ps->at == '?' || *ps->at == '{')) {
            if (s->n - element != 1) {
                int whole = tl_gram_builder_fresh_rule(&ps->b, ps->rule);
                if (whole < 0) return oom(ps);
                if (!commit_alt(ps, whole, s->n > element ? s->items + element : NULL, s->n - element)) return false;
                s->n = element;
                if (!seq_push(ps, s, (tl_gram_item){GE_REF, whole, 0})) return false;
            }
            if (!parse_postfix(ps, s)) return false;
            skip_space(ps, nested);
        }
        if (s->n > 0 && (long)ps->b.n_items + s->n > GRAM_MAX_ELEMS) return fail_at(ps, start, "%s", "grammar too large");
    }
}

static bool parse_alternates(parser *ps, int rule) {
    for (;;) {
        seq s = {0};
        bool ok = parse_sequence(ps, &s) && commit_alt(ps, rule, s.items, s.n);
        free(s.items);
        if (!ok) return false;
        skip_space(ps, ps->depth > 0);
        if (ps->at < ps->end && *ps->at == '|') {
            ps->at++;
            skip_space(ps, true);
            continue;
        }
        return true;
    }
}

static bool parse_rule(parser *ps) {
    const char *name = ps->at;
    if (!is_name_char(*name)) {
        char what[8] = {*name, 0};
        if ((unsigned char)*name < 0x20 || (unsigned char)*name >= 0x7F) snprintf(what, sizeof what, "\\x%02X", (unsigned char)*name);
        return fail_at(ps, name, "unexpected '%s': expected a rule name", what);
    }
    while (ps->at < ps->end && is_name_char(*ps->at)) ps->at++;
    const size_t len = (size_t)(ps->at - name);
    int r = tl_gram_builder_rule(&ps->b, name, len);
    if (r < 0) return oom(ps);
    skip_space(ps, false);
    if (ps->end - ps->at < 3 || memcmp(ps->at, "::=", 3) != 0) {
        ps->rule = -1;
        char nm[64];
        snprintf(nm, sizeof nm, "%.*s", (int)(len < 60 ? len : 60), name);
        return fail_at(ps, ps->at, "expected '::=' after rule name '%s'", nm);
    }
    if (ps->b.defined_at[r] >= 0) {
        const int line = (int)(ps->b.defined_at[r] >> 20), col = (int)(ps->b.defined_at[r] & 0xFFFFF);
        char msg[160];
        snprintf(msg, sizeof msg, "rule '%.40s' is defined twice (first at line %d, column %d)", ps->b.names[r], line, col);
        return fail_at(ps, name, "%s", msg);
    }
    int line, col;
    position(ps, name, &line, &col);
    ps->b.defined_at[r] = ((int64_t)line << 20) | (col & 0xFFFFF);
    ps->rule = r;
    ps->at += 3;
    skip_space(ps, true);
    if (!parse_alternates(ps, r)) return false;
    skip_space(ps, false);
    if (ps->at < ps->end && *ps->at == ')') return fail_at(ps, ps->at, "%s", "unexpected ')' without a matching '('");
    if (ps->at < ps->end && *ps->at != '\n' && *ps->at != '\r')
        return fail_at(ps, ps->at, "%s", "expected the end of the line after the rule");
    ps->rule = -1;
    return true;
}

tl_status tl_gram_parse_gbnf(const char *text, size_t len, tl_gram_program **out, char *err, size_t errlen) {
    parser ps = {.src = text, .end = text + len, .at = text, .rule = -1, .err = err, .errlen = errlen, .st = TL_OK};
    *out = NULL;
    for (size_t i = 0; i < len; i++)
        if (text[i] == 0) {
            fail_at(&ps, text + i, "%s", "NUL byte in the grammar text");
            tl_gram_builder_free(&ps.b);
            return ps.st;
        }
    for (;;) {
        skip_space(&ps, true);
        if (ps.at >= ps.end) break;
        if (!parse_rule(&ps)) break;
    }
    tl_status st = ps.st;
    if (st == TL_OK) st = tl_gram_build(&ps.b, out, err, errlen);
    tl_gram_builder_free(&ps.b);
    return st;
}

/* ---------------------------------------------------------------- writing GBNF
   For the converters that write GBNF (json_schema.c, regex.c): text that this parser reads
   back as exactly the characters meant. */

void tl_gram_gbnf_literal(strbuf *b, const char *s) {
    tl_strbuf_puts(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') { const char e[3] = {'\\', (char)*p, 0}; tl_strbuf_puts(b, e); }
        else if (*p < 0x20) tl_strbuf_printf(b, "\\x%02X", *p);
        else tl_strbuf_put(b, (const char *)p, 1);
    }
    tl_strbuf_puts(b, "\"");
}

/* Letters and digits as they are, everything else escaped, so that no character can close
   the class or start a comment ('#'). */
void tl_gram_gbnf_class_cp(strbuf *b, uint32_t v) {
    const char ch = (char)v;
    if ((v >= '0' && v <= '9') || (v >= 'a' && v <= 'z') || (v >= 'A' && v <= 'Z')) tl_strbuf_put(b, &ch, 1);
    else if (v < 0x80) tl_strbuf_printf(b, "\\x%02X", (unsigned)v);
    else tl_strbuf_printf(b, "\\U%08X", (unsigned)v);
}

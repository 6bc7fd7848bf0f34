/* regex.c: a regular-expression subset written as a GBNF expression (then compiled like any
 * grammar). Two users, one converter:
 *   - a JSON Schema's "pattern" (json_schema.c), matched against a JSON string's characters as
 *     JSON writes them: '"', '\' and the controls escaped (a control's short escape, or \u00XX);
 *   - a whole generated text (tl_grammar_compile_regex: vLLM's `regex` structured output).
 *
 * Syntax: ECMA-262's, as JSON Schema says. Literals (UTF-8), '.', classes [...] and [^...]
 * with ranges, \d \w \s \D \W \S (in classes too: [\s\S] is any character), \xHH and
 * \uHHHH in classes, escaped punctuation, groups (...) and (?:...), alternation, * + ? {m}
 * {m,} {m,n} (greedy; up to 1000), \xHH, \uHHHH and \n \r \t \f \v \0 outside classes too
 * (in a JSON string, a control as JSON escapes it). ^ and $ are accepted at the start and the
 * end of the pattern (or of a top-level alternative). A whole text matches the pattern whole,
 * anchors or not; a schema's pattern is searched for, as JSON Schema says (ECMA-262's test):
 * an alternative without '^' may follow any characters, one without '$' be followed by any
 * (it read "abc" as exactly "abc", refusing "xabcx"). Lazy quantifiers (*? +? ?? {m,n}?) match
 * the same texts as the greedy ones, whole or searched, and named groups (?<name>...) as plain
 * groups: both are taken. Anything else (lookaround, backreferences, \b, possessive
 * quantifiers, inline flags, anchors inside it) is an error naming it: a pattern is never
 * silently loosened. The matcher decides by bytes, so the expression is exact, not a
 * sampled approximation: every text it lets through matches the pattern. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "tokenizer.h"

#define MAX_DEPTH 64
#define MAX_REPEAT 1000

typedef struct rx {
    strbuf *out;
    bool text; /* a whole text; false: a JSON string's characters */
    const char *pad; /* a GBNF expression for any characters (NULL: the pattern matches whole) */
    char *err;
    size_t errlen;
    bool failed;
} rx;

static int fail(rx *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(rx *r, const char *fmt, ...) {
    if (r->failed) return -1;
    r->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err, r->errlen, fmt, ap);
    va_end(ap);
    return -1;
}

/* The length of the valid UTF-8 character at s (NUL-terminated), or <= 0. */
static int char_len(const char *s) {
    size_t n = 0;
    while (n < 4 && s[n]) n++;
    return n ? tl_tlz_utf8_seq((const unsigned char *)s, n) : -1;
}

/* The escapes' sets, as sorted code point ranges: \d, \w, and \s (ECMA-262's white space
   and line terminators); \D \W \S are their complements. One table each, for classes and
   outside them alike. */
typedef struct cp_range {
    uint32_t lo, hi;
} cp_range;
static const cp_range DIGIT_SET[] = {{'0', '9'}};
static const cp_range WORD_SET[] = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
static const cp_range SPACE_SET[] = {{0x09, 0x0D}, {0x20, 0x20},     {0xA0, 0xA0},     {0x1680, 0x1680}, {0x2000, 0x200A},
                                     {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};
#define MAX_CODE_POINT 0x10FFFFu

/* What a JSON string's character class must leave out: '"', '\' and the controls (never
   raw in a JSON string: written escaped, as the alternatives the caller adds). */
#define JSON_EXCLUDED "\"\\\\\\x00-\\x1F"

/* The control character of a text-mode escape (\n \r \t \f \v, \0 not before a digit), or -1. */
static int control_escape(const char *s) {
    switch (s[1]) {
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    case 'f': return '\f';
    case 'v': return '\v';
    case '0': return s[2] >= '0' && s[2] <= '9' ? -1 : 0;
    default: return -1;
    }
}

/* \xHH (or \uHHHH) at s: the code point and its length, or -1 (error set). */
static int hex_escape(rx *r, const char *s, uint32_t *cp) {
    const int digits = s[1] == 'x' ? 2 : 4;
    uint32_t v = 0;
    for (int i = 0; i < digits; i++) {
        const int d = tl_gram_hex_digit((unsigned char)s[2 + i]);
        if (d < 0) return fail(r, "'\\%c' needs %d hex digits", s[1], digits);
        v = v * 16 + (uint32_t)d;
    }
    if (v >= 0xD800 && v <= 0xDFFF) return fail(r, "a surrogate code point is not supported");
    *cp = v;
    return 2 + digits;
}

/* The set an escape at s names (\d \w \s \D \W \S; *complement for the capitals), or
   NULL. (In a JSON string the controls of \s, \t and \n, are written as JSON escapes them:
   class_range.) */
static const cp_range *escape_set(const char *s, int *n_ranges, bool *complement) {
    if (s[0] != '\\') return NULL;
    const char e = s[1];
    *complement = e == 'D' || e == 'W' || e == 'S';
#define SET(table) (*n_ranges = (int)(sizeof table / sizeof table[0]), table)
    switch (e) {
    case 'd': case 'D': return SET(DIGIT_SET);
    case 'w': case 'W': return SET(WORD_SET);
    case 's': case 'S': return SET(SPACE_SET);
    default: return NULL;
    }
#undef SET
}

/* One member of a class at *q that is a code point. Escapes follow ECMA-262: \xHH, \uHHHH,
   \n \r \t \f \v \0 and escaped punctuation are characters; any other escape is refused. */
static int class_member(rx *r, const char **q, uint32_t *cp) {
    const char *s = *q;
    if (*s == '\\') {
        const unsigned char e = (unsigned char)s[1];
        if (e == 'x' || e == 'u') {
            const int n = hex_escape(r, s, cp);
            if (n < 0) return -1;
            *q += n;
            return 0;
        }
        /* (in a JSON string too: a control character there is what \xHH names, which the
           class then treats as such, [^\n] the common case) */
        const int control = control_escape(s);
        if (control >= 0) { *cp = (uint32_t)control; *q += 2; return 0; }
        if (e == 'b') { *cp = '\b'; *q += 2; return 0; } /* (in a class, ECMA-262's backspace) */
        if (e == '0') return fail(r, "'\\0' before a digit (an octal escape) is not supported");
        if (!e) return fail(r, "the pattern ends in a '\\' that escapes nothing");
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9'))
            return fail(r, "escape '\\%c' inside a class is not supported", e);
        if (e >= 0x80 || e < 0x20) return fail(r, "escaping a control or non-ASCII character is not supported");
        *cp = e;
        *q += 2;
        return 0;
    }
    const int len = char_len(s);
    if (len <= 0) return fail(r, "invalid UTF-8 in a class");
    *cp = tl_tlz_utf8_value((const unsigned char *)s, len);
    *q += len;
    return 0;
}

/* The characters a JSON string writes escaped, which a class of its text holds as
   alternatives beside the GBNF class: '"', '\\' and the controls (bit c: U+00c). */
typedef struct json_specials {
    bool quote, backslash;
    uint32_t controls;
} json_specials;

/* A range of a class, as GBNF. In a JSON string the specials the range holds are flagged in
   *specials (a plain class writes them as the JSON escapes beside it, a negated one as those
   it does not exclude) and left out of a plain class. */
static void class_range(rx *r, strbuf *o, uint32_t lo, uint32_t hi, bool negated, json_specials *specials) {
    if (!r->text) {
        for (uint32_t cp = lo; cp <= hi && cp < 0x20; cp++) specials->controls |= 1u << cp;
        if (lo <= '"' && '"' <= hi) specials->quote = true;
        if (lo <= '\\' && '\\' <= hi) specials->backslash = true;
        if (!negated) { /* the rest: the class's own ranges */
            if (lo < 0x20) lo = 0x20;
            static const uint32_t split[2] = {'"', '\\'};
            for (int k = 0; k < 2 && lo <= hi; k++)
                if (lo <= split[k] && split[k] <= hi) {
                    if (lo < split[k]) class_range(r, o, lo, split[k] - 1, negated, specials);
                    lo = split[k] + 1;
                }
            if (lo > hi) return;
        }
    }
    tl_gram_gbnf_class_cp(o, lo);
    if (hi != lo) { tl_strbuf_puts(o, "-"); tl_gram_gbnf_class_cp(o, hi); }
}

/* A set's ranges (or those of its complement) in a class. */
static void class_set(rx *r, strbuf *o, const cp_range *set, int n_ranges, bool complement, bool negated,
                      json_specials *specials) {
    if (!complement) {
        for (int i = 0; i < n_ranges; i++) class_range(r, o, set[i].lo, set[i].hi, negated, specials);
        return;
    }
    uint32_t next = 0;
    for (int i = 0; i < n_ranges; i++) {
        if (set[i].lo > next) class_range(r, o, next, set[i].lo - 1, negated, specials);
        if (set[i].hi + 1 > next) next = set[i].hi + 1;
    }
    if (next <= MAX_CODE_POINT) class_range(r, o, next, MAX_CODE_POINT, negated, specials);
}

/* Controls (bit c: U+00c) inside a JSON string, as JSON writes them: alternatives, after
   `written` others (" | " between them). Each as its short escape (\b \t \n \f \r) where JSON
   has one, and each as \u00XX, hex digits in either case (JSON.stringify and Python write
   lower case, some writers upper: the same character). Returns the count written. */
static int json_controls(strbuf *o, uint32_t mask, int written) {
    static const char SHORT[] = {['\b'] = 'b', ['\t'] = 't', ['\n'] = 'n', ['\f'] = 'f', ['\r'] = 'r'};
    for (uint32_t cp = 0; cp < sizeof SHORT; cp++)
        if ((mask >> cp & 1) && SHORT[cp]) {
            const char escaped[3] = {'\\', SHORT[cp], 0};
            if (written++) tl_strbuf_puts(o, " | ");
            tl_gram_gbnf_literal(o, escaped);
        }
    if (!mask) return written;
    if (written++) tl_strbuf_puts(o, " | ");
    tl_gram_gbnf_literal(o, "\\u00");
    tl_strbuf_puts(o, " (");
    for (int high = 0, halves = 0; high < 2; high++) {
        const uint32_t low = mask >> (16 * high) & 0xFFFFu;
        if (!low) continue;
        tl_strbuf_printf(o, "%s\"%d\" [", halves++ ? " | " : "", high);
        for (int d = 0; d < 16; d++)
            if (low >> d & 1) {
                if (d < 10) tl_strbuf_printf(o, "%d", d);
                else tl_strbuf_printf(o, "%c%c", 'a' + d - 10, 'A' + d - 10);
            }
        tl_strbuf_puts(o, "]");
    }
    tl_strbuf_puts(o, ")");
    return written;
}

/* One control inside a JSON string, as json_controls writes it, grouped. */
static void json_control(strbuf *o, uint32_t cp) {
    tl_strbuf_puts(o, "(");
    json_controls(o, 1u << cp, 0);
    tl_strbuf_puts(o, ")");
}

/* A class [...] / [^...] (ECMA-262: "[]" matches nothing, "[^]" any character) translated
   member by member into a GBNF class, never copied as text: the pattern's bytes cannot end
   up outside the class. In a JSON string '"', '\' and the controls the class matches are
   alternatives beside it, written as JSON escapes them: a plain class's members, a negated
   one's non-members (its GBNF class excludes them all: [^a] matched no '"' and \s no tab,
   valid strings refused). */
static int regex_class(rx *r, const char **p) {
    const char *s = *p + 1;
    const bool negated = *s == '^';
    if (negated) s++;
    strbuf cls = {0};
    tl_strbuf_puts(&cls, negated ? "[^" : "[");
    const size_t empty_len = cls.n;
    json_specials specials = {0}; /* (a JSON string's: those the members hold) */
    while (*s != ']') {
        if (!*s) { free(cls.p); return fail(r, "unterminated '['"); }
        const char *from = s;
        int n_ranges;
        bool complement;
        const cp_range *set = escape_set(s, &n_ranges, &complement);
        if (set) {
            s += 2;
            if (s[0] == '-' && s[1] && s[1] != ']') {
                free(cls.p);
                return fail(r, "a class range cannot start with '%.2s'", from);
            }
            class_set(r, &cls, set, n_ranges, complement, negated, &specials);
            continue;
        }
        uint32_t lo = 0, hi;
        if (class_member(r, &s, &lo) < 0) { free(cls.p); return -1; }
        hi = lo;
        if (s[0] == '-' && s[1] && s[1] != ']') {
            s++;
            if (escape_set(s, &n_ranges, &complement)) {
                free(cls.p);
                return fail(r, "a class range cannot end with '%.2s'", s);
            }
            if (class_member(r, &s, &hi) < 0) { free(cls.p); return -1; }
            if (hi < lo) { free(cls.p); return fail(r, "reversed range '%.*s' in a class", (int)(s - from), from); }
        }
        class_range(r, &cls, lo, hi, negated, &specials);
    }
    if (cls.oom) { free(cls.p); r->out->oom = true; *p = s + 1; return 0; }
    const bool has_ranges = cls.n > empty_len;
    if (negated && !r->text) tl_strbuf_puts(&cls, JSON_EXCLUDED);
    tl_strbuf_puts(&cls, "]");
    /* "[^]" in text mode: any character, which an empty negated GBNF class is not */
    if (negated && r->text && !has_ranges) { free(cls.p); tl_strbuf_puts(r->out, "."); *p = s + 1; return 0; }
    /* the specials it matches: a plain class's members, a negated one's others */
    const bool quote = !r->text && negated != specials.quote, backslash = !r->text && negated != specials.backslash;
    const uint32_t controls = r->text ? 0 : negated ? ~specials.controls : specials.controls;
    const char *alts[3];
    int n_alts = 0;
    if (negated || has_ranges) alts[n_alts++] = cls.p;
    if (quote) alts[n_alts++] = "\"\\\\\\\"\"";
    if (backslash) alts[n_alts++] = "\"\\\\\\\\\"";
    strbuf *o = r->out;
    if (n_alts == 0 && controls == 0) tl_strbuf_puts(o, "[^\\x00-\\U0010FFFF]"); /* "[]": nothing */
    else if (n_alts == 1 && controls == 0) tl_strbuf_puts(o, alts[0]);
    else {
        tl_strbuf_puts(o, "(");
        for (int i = 0; i < n_alts; i++) { if (i) tl_strbuf_puts(o, " | "); tl_strbuf_puts(o, alts[i]); }
        json_controls(o, controls, n_alts);
        tl_strbuf_puts(o, ")");
    }
    free(cls.p);
    *p = s + 1;
    return 0;
}

static int regex_alt(rx *r, const char **p, int depth);

/* One code point as a GBNF literal. */
static void literal_cp(strbuf *o, uint32_t cp) {
    char utf8[5] = {0};
    if (cp < 0x80) utf8[0] = (char)cp;
    else if (cp < 0x800) { utf8[0] = (char)(0xC0 | cp >> 6); utf8[1] = (char)(0x80 | (cp & 0x3F)); }
    else if (cp < 0x10000) {
        utf8[0] = (char)(0xE0 | cp >> 12);
        utf8[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        utf8[2] = (char)(0x80 | (cp & 0x3F));
    } else {
        utf8[0] = (char)(0xF0 | cp >> 18);
        utf8[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        utf8[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        utf8[3] = (char)(0x80 | (cp & 0x3F));
    }
    /* U+0000 is the one code point a NUL-terminated literal cannot hold: a class can */
    if (cp == 0) tl_strbuf_puts(o, "[\\x00]");
    else tl_gram_gbnf_literal(o, utf8);
}

static int regex_atom(rx *r, const char **p, int depth) {
    strbuf *o = r->out;
    const char *s = *p;
    if (*s == '(') {
        s++;
        if (s[0] == '?' && s[1] == ':') {
            s += 2;
        } else if (s[0] == '?' && s[1] == '<' && s[2] != '=' && s[2] != '!') {
            /* a named group (ECMA-262 2018) matches as a plain group: only a backreference
               to it would need the name, and those are refused */
            const char *name = s + 2;
            while ((*name >= 'a' && *name <= 'z') || (*name >= 'A' && *name <= 'Z') || (*name >= '0' && *name <= '9') ||
                   *name == '_' || *name == '$')
                name++;
            if (name == s + 2 || (s[2] >= '0' && s[2] <= '9') || *name != '>')
                return fail(r, "a named group is (?<name>...), its name a letter, '_' or '$' then letters, digits, '_' or '$'");
            s = name + 1;
        } else if (s[0] == '?') {
            /* each construct named (inline flags and comments were called lookaround) */
            return fail(r, "%s", s[1] == '=' || s[1] == '!'         ? "lookahead ((?=...), (?!...)) is not supported"
                                 : s[1] == '<'                        ? "lookbehind ((?<=...), (?<!...)) is not supported"
                                 : s[1] == 'P'                        ? "Python's (?P...) groups are not ECMA-262's: a named "
                                                                        "group is (?<name>...)"
                                 : s[1] == '#'                        ? "comments (?#...) are not supported"
                                 : s[1] == ')' || s[1] == 0           ? "a group '(?' that names no kind: (?:...) or (?<name>...)"
                                                                      : "inline flags ((?i), (?s), (?m), ...) are not supported");
        }
        tl_strbuf_puts(o, "(");
        *p = s;
        if (regex_alt(r, p, depth + 1) < 0) return -1;
        if (**p != ')') return fail(r, "expected ')'");
        (*p)++;
        tl_strbuf_puts(o, ")");
        return 0;
    }
    if (*s == '[') return regex_class(r, p);
    /* '.': any character but a line terminator (ECMA-262: \n \r U+2028 U+2029) */
    if (*s == '.') {
        const char *as_class = "[^\\n\\r\\u2028\\u2029]"; /* (a JSON string's '"', '\' and other controls: escaped) */
        if (regex_class(r, &as_class) < 0) return -1;
        *p = s + 1;
        return 0;
    }
    if (*s == '\\') {
        const unsigned char e = (unsigned char)s[1];
        /* \d \w \s \D \W \S: the class of that one member */
        if (e && strchr("dwsDWS", e)) {
            const char as_class[] = {'[', '\\', (char)e, ']', 0};
            const char *q = as_class;
            if (regex_class(r, &q) < 0) return -1;
            *p = s + 2;
            return 0;
        }
        const int control = control_escape(s);
        if (control >= 0) {
            if (r->text) literal_cp(o, (uint32_t)control);
            else json_control(o, (uint32_t)control);
            *p = s + 2;
            return 0;
        }
        if (e == '0') return fail(r, "'\\0' before a digit (an octal escape) is not supported");
        if (e == 'x' || e == 'u') {
            uint32_t cp;
            const int n = hex_escape(r, s, &cp);
            if (n < 0) return -1;
            /* in a JSON string: controls, '"' and '\' as JSON writes them */
            if (!r->text && cp < 0x20) json_control(o, cp);
            else if (!r->text && (cp == '"' || cp == '\\')) tl_strbuf_puts(o, cp == '"' ? "\"\\\\\\\"\"" : "\"\\\\\\\\\"");
            else literal_cp(o, cp);
            *p = s + n;
            return 0;
        }
        if (!e) return fail(r, "the pattern ends in a '\\' that escapes nothing");
        if (e >= '1' && e <= '9') return fail(r, "backreferences ('\\%c') are not supported", e);
        if (e == 'k') return fail(r, "named backreferences (\\k<name>) are not supported");
        if (e == 'b' || e == 'B') return fail(r, "word boundaries ('\\%c') are not supported", e);
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z') || (e >= '0' && e <= '9'))
            return fail(r, "escape '\\%c' is not supported", e);
        /* An escaped byte is copied as one literal: only ASCII punctuation is a whole
           character (a UTF-8 lead byte would leave the literal half a character). */
        if (e >= 0x80 || e < 0x20) return fail(r, "escaping a control or non-ASCII character is not supported");
        if (!r->text && (e == '"' || e == '\\')) tl_strbuf_puts(o, e == '"' ? "\"\\\\\\\"\"" : "\"\\\\\\\\\"");
        else literal_cp(o, e);
        *p = s + 2;
        return 0;
    }
    if (strchr("*+?{", *s)) return fail(r, "'%c' with nothing to repeat", *s);
    if (!r->text && (unsigned char)*s < 0x20) return fail(r, "control characters are not supported");
    if (!r->text && *s == '"') { tl_strbuf_puts(o, "\"\\\\\\\"\""); *p = s + 1; return 0; }
    /* one UTF-8 character, as a literal (GBNF reads only valid UTF-8) */
    const int len = char_len(s);
    if (len <= 0) return fail(r, "invalid UTF-8");
    literal_cp(o, tl_tlz_utf8_value((const unsigned char *)s, len));
    *p = s + len;
    return 0;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

/* A sequence. Anchors stand at the start ('^') or the end ('$') of the pattern or of one of
   its top-level alternatives; without them a searched pattern (r->pad) is padded there with
   any characters. Elsewhere ("a^b", "(^a)*") they would cut the language: refused, never
   dropped. */
static int regex_seq(rx *r, const char **p, int depth) {
    if (depth > MAX_DEPTH) return fail(r, "nested too deeply");
    strbuf *o = r->out;
    bool empty = true, anchored_end = false;
    if (depth == 0 && r->pad && **p != '^') tl_strbuf_printf(o, "%s ", r->pad);
    while (**p && **p != '|' && **p != ')') {
        if (**p == '^') {
            if (depth > 0 || !empty) return fail(r, "'^' is supported only at the start of the pattern or of a top-level alternative");
            (*p)++;
            continue;
        }
        if (**p == '$') {
            if (depth > 0 || ((*p)[1] && (*p)[1] != '|'))
                return fail(r, "'$' is supported only at the end of the pattern or of a top-level alternative");
            (*p)++;
            anchored_end = true;
            continue;
        }
        if (regex_atom(r, p, depth) < 0) return -1;
        empty = false;
        const char q = **p;
        if (q == '*' || q == '+' || q == '?') { tl_strbuf_put(o, *p, 1); (*p)++; }
        else if (q == '{') {
            /* {m}, {m,}, {m,n}, digits only ("{ 2}" and "{+2}" are not quantifiers): parsed,
               so that only valid GBNF comes out */
            char *after = (char *)*p + 1;
            long lo = is_digit((*p)[1]) ? strtol(*p + 1, &after, 10) : -1, hi = lo;
            bool ok = lo >= 0 && lo <= MAX_REPEAT;
            if (ok && *after == ',') {
                const char *from = after + 1;
                hi = *from == '}' ? -1 : is_digit(*from) ? strtol(from, &after, 10) : -2;
                if (hi >= 0) ok = hi >= lo && hi <= MAX_REPEAT;
                else if (hi == -1) after = (char *)from;
                else ok = false;
            }
            if (!ok || *after != '}') return fail(r, "bad quantifier (expected {m}, {m,} or {m,n} up to %d)", MAX_REPEAT);
            if (hi < 0) tl_strbuf_printf(o, "{%ld,}", lo);
            else tl_strbuf_printf(o, "{%ld,%ld}", lo, hi);
            *p = after + 1;
        }
        /* a lazy quantifier matches the same texts as the greedy one, the whole text (or a
           schema's search) decided either way: read as it (vLLM's xgrammar does); a possessive
           one is not ECMA-262's */
        if (**p == '?') (*p)++;
        else if (**p == '+') return fail(r, "possessive quantifiers ('+' after a quantifier) are not ECMA-262's");
        tl_strbuf_puts(o, " ");
    }
    /* an empty alternative ("a|", "()") matches the empty text: GBNF needs it spelled */
    if (empty) tl_strbuf_puts(o, "\"\" ");
    if (depth == 0 && r->pad && !anchored_end) tl_strbuf_printf(o, "%s ", r->pad);
    return 0;
}

static int regex_alt(rx *r, const char **p, int depth) {
    for (;;) {
        if (regex_seq(r, p, depth) < 0) return -1;
        if (**p != '|') return 0;
        tl_strbuf_puts(r->out, "| ");
        (*p)++;
    }
}

int tl_gram_regex_expr(const char *pattern, bool text, const char *pad, strbuf *out, char *err, size_t errlen) {
    rx r = {.out = out, .text = text, .pad = pad, .err = err, .errlen = errlen};
    const char *p = pattern;
    tl_strbuf_puts(out, "(");
    if (regex_alt(&r, &p, 0) < 0) return -1;
    if (*p) return fail(&r, "unexpected ')'");
    tl_strbuf_puts(out, ")");
    return 0;
}

/* json_schema.c: a JSON Schema subset converted to GBNF (then compiled like any grammar).
 *
 * Supported: type (one or a list, whose other keywords each apply to the values of their own
 * type, as JSON Schema says: {"type": ["string", "null"], "maxLength": 8}), properties, required, additionalProperties (false, true or
 * a schema, for keys that are none of the declared names; absent means false where properties
 * are declared: generation wants closed objects, as llama.cpp's converter; an object that
 * declares none is any object), enum, const, items,
 * prefixItems, minItems/maxItems, anyOf, oneOf (where no value can match two of its
 * branches: their types differ, or their const/enum values, or a property required in both
 * has a different const in each, a discriminator; a grammar cannot refuse a value for
 * matching twice), allOf of objects, string minLength/maxLength,
 * pattern (a regular-expression subset), format date/time/date-time/uuid, integer
 * and number minimum/maximum/exclusiveMinimum/exclusiveMaximum (exact ranges), multipleOf 1 or
 * a power of ten below it (a number's places),
 * boolean, null, $ref to "#" or a JSON Pointer into the schema ("#/$defs/NAME", escapes
 * decoded), draft-07's tuples ("items" an array, "additionalItems"), OpenAPI's "nullable"
 * (the values and null), a "type" beside anyOf/oneOf/allOf whose branches are all of it, no
 * "type" where the keywords are one type's (that type written: keywords_type).
 * Annotations (title, description, examples, default, $schema, $id, $comment, deprecated,
 * readOnly, writeOnly, OpenAPI's example, discriminator and "x-" keys) are ignored. Anything
 * else is an error naming the keyword: a schema is never silently loosened (except where
 * tl_json_schema_options.loose asks for it). */
#include <cjson/cJSON.h>
#include <ctype.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "internal.h"
#include "tokenizer.h"

#define MAX_DEPTH 64
/* The most GBNF a schema may become: each subschema's text is written once per place it is
   used, so a small schema can grow exponentially ({"type": ["object", "object"]} nested) */
#define MAX_GBNF_BYTES (8u << 20)

typedef struct conv {
    const cJSON *root;
    strbuf out;
    int n_rules;
    bool free_ws;
    bool loose;            /* tl_json_schema_options.loose: narrowing keywords not enforced */
    /* $ref targets already given a rule: node -> rule (a list searched from the start cost
       20,000 $refs 1.4 s) */
    tl_gram_hash ref_rules;
    /* $ref targets given a rule whose body is still to write: compiled one after another
       from the top (compiled where first met, each nested the next deeper: a chain of 22
       Pydantic models, each holding the next, was "nested more than 64 levels") */
    struct pending_ref { const cJSON *target; const char *ref; int rule; } *pending;
    int n_pending, cap_pending, next_pending;
    bool draining_for_clash; /* (oneOf compiles them before naming a clash: once, not nested) */
    char *err;
    size_t errlen;
    bool failed;
    bool used_value, used_string;
    /* schema_bits' answers by schema node: computed once each (without it, anyOf branches that
       $ref the same definitions were walked once per path, exponential in the nesting) */
    tl_gram_hash type_bits_of;
    /* oneOf's pairwise check: branch pairs and value comparisons made (each pair of 20,000
       branches, or of two enums' values, took seconds to minutes: MAX_ONEOF_CHECKS) */
    int64_t oneof_checks;
    /* schema nodes made during the conversion (allOf's merges, undeclared required
       properties): kept until its end, as the tables above are keyed by node (a node freed
       earlier could leave its address, and its answer, to another) */
    cJSON *made;
} conv;

/* Keeps a made node until the conversion ends; false (node freed) when out of memory. */
static bool keep_made(conv *c, cJSON *node) {
    if (!c->made && !(c->made = cJSON_CreateArray())) { cJSON_Delete(node); return false; }
    cJSON_AddItemToArray(c->made, node);
    return true;
}

/* cJSON_AddItemReferenceToObject, without its leak: it loses the reference it made when
   copying the key fails (cJSON 1.7.15; out of memory). The reference made in an array, where
   no key is copied, then moved to the object, freed here where that fails. */
static bool add_reference_to_object(cJSON *object, const char *key, const cJSON *item) {
    cJSON *scratch = cJSON_CreateArray();
    if (!scratch || !cJSON_AddItemReferenceToArray(scratch, (cJSON *)item)) {
        cJSON_Delete(scratch);
        return false;
    }
    cJSON *reference = cJSON_DetachItemFromArray(scratch, 0);
    cJSON_Delete(scratch);
    if (cJSON_AddItemToObject(object, key, reference)) return true;
    cJSON_Delete(reference); /* (a reference: the item it names stays) */
    return false;
}

#define MAX_ONEOF_CHECKS ((int64_t)1 << 22)

static int fail(conv *c, const char *path, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(conv *c, const char *path, const char *fmt, ...) {
    if (c->failed) return -1;
    c->failed = true;
    int n = snprintf(c->err, c->errlen, "at %s: ", path[0] ? path : "the root");
    if (n < 0 || (size_t)n >= c->errlen) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err + n, c->errlen - (size_t)n, fmt, ap);
    va_end(ap);
    return -1;
}

/* Out of memory: c->out's sticky flag, which the conversion's end reads before anything else
   (a text lost to it may also have read as the schema's fault, or as a narrower grammar). */
static int out_of_memory(conv *c, const char *path) {
    c->out.oom = true;
    return fail(c, path, "out of memory");
}

/* The end of a scratch text: freed, its out of memory made the conversion's. */
static void drop(conv *c, strbuf *b) {
    if (b->oom) c->out.oom = true;
    free(b->p);
    *b = (strbuf){0};
}

static const char *WS(const conv *c) { return c->free_ws ? " ws" : ""; }

static int schema(conv *c, const cJSON *s, const char *path, int depth);

static int new_rule(conv *c) { return ++c->n_rules; }

/* OpenAPI 3.0's "nullable": true (smolagents' and FastAPI's tools carry it on optional
   inputs): the schema's values, and null (schema()). */
static bool is_nullable(const cJSON *s) {
    return cJSON_IsObject(s) && cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(s, "nullable"));
}

/* A rule of rule r's values and null (a nullable schema's). */
static int or_null_rule(conv *c, int r);

/* ---------------------------------------------------------------- digit caps */

/* The most digits a number's whole part and fraction take, as llama.cpp's converter caps
   them, and its exponent: a model can write digits without end (0.24902222442343314935...
   under exclusiveMaximum 0.25), and a double holds 17 significant digits. A
   bound whose fraction is longer gets one digit past it (minimum 1.5e-16: 18). */
#define MAX_WHOLE_DIGITS 16
#define MAX_FRACTION_DIGITS 16
#define DIGITS_TEXT(n) #n
#define CAP(n) DIGITS_TEXT(n)
#define WHOLE_GBNF "(\"0\" | [1-9] [0-9]{0,15})" /* MAX_WHOLE_DIGITS - 1 */
#define FRACTION_GBNF "(\".\" [0-9]{1," CAP(MAX_FRACTION_DIGITS) "})"
/* An exponent up to 289 (three digits at most): with 16 digits either side of the point a
   value stays within 1e-305 and 1e305, a finite double and not 0 (e-976 read as 0 under
   exclusiveMinimum 0, e454 as Infinity; a model that has written its 16 fraction digits
   goes on with an exponent) */
#define EXPONENT_GBNF "([eE] [-+]? ([0-9]{1,2} | [01] [0-9]{2} | \"2\" [0-8] [0-9]))"
#define NUMBER_GBNF "\"-\"? " WHOLE_GBNF " " FRACTION_GBNF "? " EXPONENT_GBNF "?"
_Static_assert(MAX_WHOLE_DIGITS == 16, "WHOLE_GBNF spells MAX_WHOLE_DIGITS - 1 out");

/* ---------------------------------------------------------------- integers in a range */

/* Decimal numbers of exactly the digits between a and b (same length, leading zeros allowed). */
static void digits_range(strbuf *b, const char *lo, const char *hi) {
    size_t n = strlen(lo);
    if (n == 0) return;
    if (lo[0] == hi[0]) {
        tl_strbuf_printf(b, "\"%c\" ", lo[0]);
        digits_range(b, lo + 1, hi + 1);
        return;
    }
    bool lo_min = true, hi_max = true;
    for (size_t i = 1; i < n; i++) { lo_min &= lo[i] == '0'; hi_max &= hi[i] == '9'; }
    if (lo_min && hi_max) {
        tl_strbuf_printf(b, "[%c-%c]", lo[0], hi[0]);
        if (n > 1) tl_strbuf_printf(b, " [0-9]{%zu}", n - 1);
        tl_strbuf_puts(b, " ");
        return;
    }
    char nines[32], zeros[32];
    memset(nines, '9', n - 1);
    nines[n - 1] = 0;
    memset(zeros, '0', n - 1);
    zeros[n - 1] = 0;
    tl_strbuf_puts(b, "(");
    tl_strbuf_printf(b, "\"%c\" ", lo[0]);
    digits_range(b, lo + 1, nines);
    if (hi[0] - lo[0] > 1) {
        tl_strbuf_printf(b, "| [%c-%c]", lo[0] + 1, hi[0] - 1);
        if (n > 1) tl_strbuf_printf(b, " [0-9]{%zu}", n - 1);
        tl_strbuf_puts(b, " ");
    }
    tl_strbuf_printf(b, "| \"%c\" ", hi[0]);
    digits_range(b, zeros, hi + 1);
    tl_strbuf_puts(b, ") ");
}

/* Non-negative integers in [lo, hi] (hi < 0: unbounded, to MAX_WHOLE_DIGITS digits), no
   leading zeros. */
static void natural_range(strbuf *b, long long lo, long long hi) {
    bool first = true;
    tl_strbuf_puts(b, "(");
    for (int d = 1; d <= 19; d++) {
        long long dmin = d == 1 ? 0 : (long long)pow(10, d - 1), dmax = (long long)pow(10, d) - 1;
        if (d == 19) dmax = 999999999999999999LL;
        long long a = lo > dmin ? lo : dmin, z = hi >= 0 && hi < dmax ? hi : dmax;
        if (a > z) {
            if (hi >= 0 && dmin > hi) break;
            continue;
        }
        if (!first) tl_strbuf_puts(b, "| ");
        first = false;
        if (hi < 0 && a == dmin && d > 1) { /* every number of d or more digits */
            tl_strbuf_printf(b, "[1-9] [0-9]{%d,%d} ", d - 1, MAX_WHOLE_DIGITS - 1);
            break;
        }
        char sa[32], sz[32];
        snprintf(sa, sizeof sa, "%lld", a);
        snprintf(sz, sizeof sz, "%lld", z);
        digits_range(b, sa, sz);
        if (hi < 0 && z == dmax) {
            if (d < MAX_WHOLE_DIGITS) tl_strbuf_printf(b, "| [1-9] [0-9]{%d,%d} ", d, MAX_WHOLE_DIGITS - 1);
            break;
        }
    }
    if (first) tl_strbuf_puts(b, "[^\\x00-\\U0010FFFF] "); /* empty range: nothing */
    tl_strbuf_puts(b, ")");
}

/* ---------------------------------------------------------------- numbers in a range */

/* One side of a number's range, on the magnitudes of one sign (the negative numbers' bounds
   are their magnitudes' too, flipped): its value's digits as the schema wrote them, the
   shortest decimal that reads back as the same double (0.1, not 0.1000000000000000055...). */
typedef struct decimal_bound {
    bool present, strict; /* absent: no bound on this side; strict: the value itself is out */
    long long whole;      /* the integer part (of a value >= 0) */
    char frac[352];       /* the fraction's digits, no trailing zeros ("": none); a double's
                             smallest, 5e-324, has 340 */
} decimal_bound;

/* Frees scratch text src and empties it. */
static void strbuf_reset(strbuf *src) {
    free(src->p);
    *src = (strbuf){0};
}

/* Moves scratch text src to the end of dst between `before` and `after` (its out of memory
   made dst's), and empties src. */

static void move_text(strbuf *dst, const char *before, strbuf *src, const char *after) {
    if (src->oom || !src->p) dst->oom = true;
    else tl_strbuf_printf(dst, "%s%s%s", before, src->p, after);
    strbuf_reset(src);
}

/* The shortest decimal digits that read back as v > 0 (2^-24: 5960464477539063, not the
   correctly rounded ...062 that reads back as another double, nor ...0625): `digits` (no
   point, at most 17) and `point`, v = 0.digits x 10^point. At each length the rounded text
   and its neighbours a unit either side are tried: above a power of two the doubles' gap
   below is half the gap above, so the nearest of a length may miss where the next does not. */
static void shortest_digits(double v, char digits[24], int *point) {
    void *callers = tl_enter_c_locale();
    for (int precision = 0; precision < 17; precision++) {
        char text[40];
        snprintf(text, sizeof text, "%.*e", precision, v);
        char rounded[24];
        int n = 0;
        const char *p = text;
        for (; *p && *p != 'e'; p++)
            if (isdigit((unsigned char)*p)) rounded[n++] = *p;
        rounded[n] = 0;
        const int exponent = atoi(p + 1);
        for (int step = 0; step < 3; step++) { /* the rounded digits, one unit more, one less */
            char candidate[24];
            memcpy(candidate, rounded, (size_t)n + 1);
            int candidate_exponent = exponent, at = n - 1;
            if (step == 1) {
                while (at >= 0 && candidate[at] == '9') candidate[at--] = '0';
                if (at < 0) { candidate[0] = '1'; candidate_exponent++; } /* 9.99 -> 10.0 */
                else candidate[at]++;
            } else if (step == 2) {
                while (at >= 0 && candidate[at] == '0') candidate[at--] = '9';
                if (at < 0) continue;
                candidate[at]--;
                if (candidate[0] == '0') continue; /* (1.00 -> 0.99: none smaller of this length) */
            }
            char back[48];
            snprintf(back, sizeof back, "%c.%se%d", candidate[0], candidate + 1, candidate_exponent);
            /* (17 rounded digits always read back: the loop ends here at the latest) */
            if ((precision == 16 && step == 0) || strtod(back, NULL) == v) {
                memcpy(digits, candidate, (size_t)n + 1);
                *point = candidate_exponent + 1;
                tl_leave_c_locale(callers);
                return;
            }
        }
    }
}

/* The shortest text that reads back as v, spelt as printf's %g spells it (1e-07, 0.5,
   1.2345678901234568e+20): a const's or enum's number in the grammar, a bound in a message. */
static void shortest_text(double v, char text[40]) {
    if (v == 0) { snprintf(text, 40, "%s", signbit(v) ? "-0" : "0"); return; }
    char digits[24];
    int point;
    shortest_digits(fabs(v), digits, &point);
    const int n = (int)strlen(digits), exponent = point - 1;
    char *at = text;
    if (v < 0) *at++ = '-';
    if (exponent < -4 || exponent >= n) { /* d.ddde+XX */
        const unsigned magnitude = (unsigned)abs(exponent) % 1000u; /* (a double's: at most 324) */
        snprintf(at, 32, "%c%s%se%c%02u", digits[0], n > 1 ? "." : "", digits + 1, exponent < 0 ? '-' : '+', magnitude);
    } else if (exponent >= 0) { /* ddd.ddd */
        snprintf(at, 32, "%.*s%s%s", point, digits, n > point ? "." : "", digits + point);
    } else { /* 0.000ddd */
        *at++ = '0';
        *at++ = '.';
        for (int zeros = 0; zeros < -point; zeros++) *at++ = '0';
        snprintf(at, 24, "%s", digits);
    }
}

static decimal_bound decimal_of(double value, bool strict) {
    decimal_bound b = {.present = true, .strict = strict};
    if (value == 0) return b;
    char digits[24];
    int point; /* digits d1 d2 ... read as 0.d1d2... x 10^point */
    shortest_digits(value, digits, &point);
    const int n = (int)strlen(digits);
    int f = 0;
    for (int i = point < 0 ? point : 0; i < 0; i++) b.frac[f++] = '0';
    for (int i = 0; i < n; i++) {
        if (i < point) b.whole = b.whole * 10 + (digits[i] - '0');
        else b.frac[f++] = digits[i];
    }
    for (int i = n; i < point; i++) b.whole *= 10;
    while (f > 0 && b.frac[f - 1] == '0') f--;
    b.frac[f] = 0;
    return b;
}

/* A fraction's digit strings F (the text after "."; its value 0.F, zeros padding it on the
   right, so that the order is the digits') within fraction bounds lo/hi (NULL: none on that
   side), of 1 to max_digits digits. Written as flat alternatives, each a literal run of a
   bound's digits, one digit that leaves it and any digits after: a group per digit nested
   a bound of 5e-324's 324 digits past the parser's nesting limit. */
typedef struct fraction_range {
    const char *lo, *hi;
    size_t n_lo, n_hi;
    bool lo_strict, hi_strict;
    size_t max_digits; /* MAX_FRACTION_DIGITS, one past a longer bound's, or multipleOf's places */
} fraction_range;

/* places >= 0: a multipleOf's grid, at most that many digits (the bounds are on it). */
static fraction_range fraction_range_of(const char *lo, const char *hi, bool lo_strict, bool hi_strict, int places) {
    fraction_range r = {lo, hi, lo ? strlen(lo) : 0, hi ? strlen(hi) : 0, lo_strict, hi_strict, MAX_FRACTION_DIGITS};
    if (places >= 0) {
        r.max_digits = (size_t)places;
        return r;
    }
    if (r.n_lo + 1 > r.max_digits) r.max_digits = r.n_lo + 1;
    if (r.n_hi + 1 > r.max_digits) r.max_digits = r.n_hi + 1;
    return r;
}

/* A bound's i-th fraction digit, zeros past its own. */
static char bound_digit(const char *digits, size_t n, size_t i) { return i < n ? digits[i] : '0'; }

/* Starts an alternative: "| " before all but the first, then the bound's first `len` digits
   as a literal. */
static void alternative(strbuf *b, int *count, const char *digits, size_t n, size_t len) {
    tl_strbuf_puts(b, (*count)++ ? "| " : "");
    if (len == 0) return;
    tl_strbuf_puts(b, "\"");
    for (size_t i = 0; i < len; i++) tl_strbuf_printf(b, "%c", bound_digit(digits, n, i));
    tl_strbuf_puts(b, "\" ");
}

/* Between `least` and `most` more digits (most 0: none). */
static void any_digits(strbuf *b, size_t least, size_t most) {
    if (most == 0) return;
    if (least == most) tl_strbuf_printf(b, "[0-9]{%zu} ", most);
    else tl_strbuf_printf(b, "[0-9]{%zu,%zu} ", least, most);
}

/* The F at or above the low bound (past it where strict) whose first `from` digits are the
   bound's, `from` or more digits long (from 0: one or more). */
static void at_least(strbuf *b, int *count, const fraction_range *r, size_t from) {
    const size_t n = r->n_lo, room = r->max_digits;
    for (size_t k = from; k < n; k++) { /* the bound's digits to k, then a greater one: any after */
        if (r->lo[k] == '9') continue;
        alternative(b, count, r->lo, n, k);
        tl_strbuf_printf(b, "[%c-9] ", r->lo[k] + 1);
        any_digits(b, 0, room - k - 1);
    }
    const size_t all = n > from ? n : from; /* the bound's digits all: any after, or (strict) a nonzero after */
    if (!r->lo_strict) {
        alternative(b, count, r->lo, n, all);
        any_digits(b, all == 0 ? 1 : 0, room - all);
        return;
    }
    for (size_t zeros = 0; all + zeros < room; zeros++) {
        alternative(b, count, r->lo, n, all + zeros);
        tl_strbuf_puts(b, "[1-9] ");
        any_digits(b, 0, room - all - zeros - 1);
    }
}

/* The F at or below the high bound (below it where strict) whose first `from` digits are the
   bound's, `from` or more digits long (from 0: one or more). */
static void at_most(strbuf *b, int *count, const fraction_range *r, size_t from) {
    const size_t m = r->n_hi, room = r->max_digits;
    for (size_t k = from; k < m; k++) { /* the bound's digits to k (ending there), or then a smaller one */
        const bool may_end = k > 0; /* (a proper prefix of the bound's digits is below it) */
        if (r->hi[k] == '0') {
            if (may_end) alternative(b, count, r->hi, m, k);
            continue;
        }
        alternative(b, count, r->hi, m, k);
        tl_strbuf_printf(b, "%s[0-%c] ", may_end ? "(" : "", r->hi[k] - 1);
        any_digits(b, 0, room - k - 1);
        if (may_end) tl_strbuf_puts(b, ")? ");
    }
    const size_t all = m > from ? m : from; /* the bound itself, zeros after */
    if (r->hi_strict) return;
    alternative(b, count, r->hi, m, all);
    if (room > all) tl_strbuf_printf(b, "\"0\"{%d,%zu} ", all == 0, room - all);
}

/* Every F within both bounds: their shared first digits, then the low bound's digit (and
   at_least after it), a digit between, or the high bound's (and at_most). */
static void between(strbuf *b, int *count, const fraction_range *r) {
    const size_t longer = r->n_lo > r->n_hi ? r->n_lo : r->n_hi;
    size_t shared = 0;
    while (shared < longer && bound_digit(r->lo, r->n_lo, shared) == bound_digit(r->hi, r->n_hi, shared)) shared++;
    if (shared == longer) { /* one value: the bound, zeros after (its callers saw it is in) */
        alternative(b, count, r->lo, r->n_lo, shared);
        if (r->max_digits > shared) tl_strbuf_printf(b, "\"0\"{%d,%zu} ", shared == 0, r->max_digits - shared);
        return;
    }
    const size_t shortest = r->n_lo > 0 ? r->n_lo : 1;
    if (shortest <= shared && !r->lo_strict) { /* the low bound itself, up to `shared` digits (0.5, 0.50, ...) */
        alternative(b, count, r->lo, r->n_lo, shortest);
        if (shared > shortest) tl_strbuf_printf(b, "\"0\"{0,%zu} ", shared - shortest);
    }
    const char low = bound_digit(r->lo, r->n_lo, shared), high = bound_digit(r->hi, r->n_hi, shared);
    at_least(b, count, r, shared + 1);
    if (high - low > 1) {
        alternative(b, count, r->lo, r->n_lo, shared);
        tl_strbuf_printf(b, "[%c-%c] ", low + 1, high - 1);
        any_digits(b, 0, r->max_digits - shared - 1);
    }
    at_most(b, count, r, shared + 1);
}

/* The text after an integer part: nothing (the fraction 0, where in), or "." and a fraction
   in range. False: none fits. */
static bool fraction_part(strbuf *b, const fraction_range *r) {
    const bool zero_in = (!r->lo || (r->n_lo == 0 && !r->lo_strict)) && (!r->hi || r->n_hi > 0 || !r->hi_strict);
    if (r->max_digits == 0) return zero_in; /* (multipleOf 1: no fraction) */
    strbuf digits = {0};
    int count = 0;
    if (r->lo && r->hi) between(&digits, &count, r);
    else if (r->lo) at_least(&digits, &count, r, 0);
    else if (r->hi) at_most(&digits, &count, r, 0);
    else {
        alternative(&digits, &count, "", 0, 0);
        any_digits(&digits, 1, r->max_digits);
    }
    if (count > 0) move_text(b, zero_in ? "(\".\" (" : "\".\" (", &digits, zero_in ? "))? " : ") ");
    strbuf_reset(&digits);
    return zero_in || count > 0;
}

/* Plain decimals (no exponent) whose value lies in [lo, hi] (hi absent: unbounded; lo is
   present, 0 where nothing else bounds it), as GBNF alternatives. False: none. */
static bool magnitude_range(strbuf *b, const decimal_bound *lo, const decimal_bound *hi, int places) {
    bool any = false;
    strbuf alt = {0};
    if (hi->present && lo->whole == hi->whole) { /* one integer part: the fraction between both */
        const fraction_range r = fraction_range_of(lo->frac, hi->frac, lo->strict, hi->strict, places);
        tl_strbuf_printf(&alt, "\"%lld\" ", lo->whole);
        if (fraction_part(&alt, &r)) { move_text(b, "", &alt, ""); any = true; }
    } else {
        const fraction_range from_lo = fraction_range_of(lo->frac, NULL, lo->strict, false, places);
        tl_strbuf_printf(&alt, "\"%lld\" ", lo->whole);
        if (fraction_part(&alt, &from_lo)) { move_text(b, "", &alt, ""); any = true; }
        if (!hi->present || lo->whole + 1 <= hi->whole - 1) { /* integer parts strictly between: any fraction */
            tl_strbuf_puts(b, any ? "| " : "");
            natural_range(b, lo->whole + 1, hi->present ? hi->whole - 1 : -1);
            if (places < 0) tl_strbuf_puts(b, " " FRACTION_GBNF "? ");
            else if (places > 0) tl_strbuf_printf(b, " (\".\" [0-9]{1,%d})? ", places); /* (multipleOf's grid) */
            any = true;
        }
        if (hi->present) {
            const fraction_range to_hi = fraction_range_of(NULL, hi->frac, false, hi->strict, places);
            strbuf_reset(&alt);
            tl_strbuf_printf(&alt, "\"%lld\" ", hi->whole);
            if (fraction_part(&alt, &to_hi)) { move_text(b, any ? "| " : "", &alt, ""); any = true; }
        }
    }
    strbuf_reset(&alt);
    return any;
}

/* An integer's or a number's bounds: the tighter of each side's two (at a tie, the exclusive).
   2^53 limits them: from it on a double holds no longer every integer (9007199254740993 reads
   as ...992: a bound that moved by one, refused rather than taken), and a number's integer
   part fits a long long. Loosely, a bound past it or not a number is left out (a superset). */
#define BOUND_LIMIT 9007199254740992.0
typedef struct numeric_bounds {
    bool has_lo, has_hi, lo_strict, hi_strict;
    double lo, hi;
    int places; /* multipleOf 10^-places (0 to MAX_FRACTION_DIGITS), or -1: none */
} numeric_bounds;

/* multipleOf's places where it is 1 or a power of ten below it (0.01: 2), else -1. */
static int step_places(const cJSON *step) {
    if (!cJSON_IsNumber(step) || !(step->valuedouble > 0) || step->valuedouble > 1) return -1;
    const decimal_bound d = decimal_of(step->valuedouble, false);
    const size_t n = strlen(d.frac);
    if (d.whole == 1 && n == 0) return 0;
    if (d.whole != 0 || n == 0 || n > MAX_FRACTION_DIGITS || d.frac[n - 1] != '1') return -1;
    for (size_t i = 0; i + 1 < n; i++)
        if (d.frac[i] != '0') return -1;
    return (int)n;
}

static int read_bounds(conv *c, const cJSON *s, const char *path, numeric_bounds *out) {
    static const char *const names[4] = {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"};
    numeric_bounds b = {.places = -1};
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(s, "multipleOf");
    if (step && (b.places = step_places(step)) < 0 && !c->loose) /* (loosely: left out) */
        return fail(c, path, "'multipleOf' is supported as 1 or a power of ten below it (0.1, 0.01, ... 1e-16)");
    for (int k = 0; k < 4; k++) {
        const cJSON *bound = cJSON_GetObjectItemCaseSensitive(s, names[k]);
        if (!bound) continue;
        if (!cJSON_IsNumber(bound) || !(fabs(bound->valuedouble) < BOUND_LIMIT)) {
            if (c->loose) continue;
            return fail(c, path, "'%s' must be a number below 2^53 (9007199254740992) in magnitude", names[k]);
        }
        const double v = bound->valuedouble;
        const bool strict = k == 1 || k == 3;
        if (k < 2 && (!b.has_lo || v > b.lo || (v == b.lo && strict))) { b.has_lo = true; b.lo_strict = strict; b.lo = v; }
        if (k >= 2 && (!b.has_hi || v < b.hi || (v == b.hi && strict))) { b.has_hi = true; b.hi_strict = strict; b.hi = v; }
    }
    *out = b;
    return 0;
}

/* The order of two magnitudes: < 0, 0 or > 0 (their digits: the doubles' order too). */
static int decimal_order(const decimal_bound *a, const decimal_bound *b) {
    if (a->whole != b->whole) return a->whole < b->whole ? -1 : 1;
    const size_t na = strlen(a->frac), nb = strlen(b->frac);
    for (size_t i = 0; i < na || i < nb; i++) {
        const char x = i < na ? a->frac[i] : '0', y = i < nb ? b->frac[i] : '0';
        if (x != y) return x < y ? -1 : 1;
    }
    return 0;
}

/* Whether [lo, hi] holds a value (hi absent: unbounded). */
static bool range_holds(const decimal_bound *lo, const decimal_bound *hi) {
    if (!hi->present) return true;
    const int order = decimal_order(lo, hi);
    return order < 0 || (order == 0 && !lo->strict && !hi->strict);
}

/* Moves a magnitude bound onto multipleOf's grid of `places` digits, inward: a low end (`up`)
   to the first multiple at or above it (above it where strict), a high end to the last at or
   below it; either is inclusive then. False: none below a high end (it is under one unit). */
static bool onto_grid(decimal_bound *d, size_t places, bool up) {
    size_t n = strlen(d->frac);
    const bool off = n > places; /* digits past the grid: truncating went down */
    if (off) d->frac[n = places] = 0;
    const bool step = up ? off || d->strict : !off && d->strict;
    d->strict = false;
    if (step) {
        while (n < places) d->frac[n++] = '0';
        d->frac[n] = 0;
        size_t at = places;
        if (up) { /* one unit more: carry into the whole part */
            while (at > 0 && d->frac[at - 1] == '9') d->frac[--at] = '0';
            if (at > 0) d->frac[at - 1]++;
            else d->whole++;
        } else { /* one unit less: borrow from it */
            while (at > 0 && d->frac[at - 1] == '0') d->frac[--at] = '9';
            if (at > 0) d->frac[at - 1]--;
            else if (d->whole == 0) return false;
            else d->whole--;
        }
    }
    while (n > 0 && d->frac[n - 1] == '0') d->frac[--n] = 0;
    return true;
}

/* One sign's magnitudes in [from, to], on multipleOf's grid where there is one (places >= 0),
   written after b's alternatives (`any`: there are some), a negative one after "-". */
static void magnitudes(strbuf *b, bool *any, bool negative, decimal_bound from, decimal_bound to, int places) {
    if (places >= 0 && (!onto_grid(&from, (size_t)places, true) || (to.present && !onto_grid(&to, (size_t)places, false))))
        return;
    if (!range_holds(&from, &to)) return;
    strbuf text = {0};
    if (magnitude_range(&text, &from, &to, places)) {
        move_text(b, negative ? "\"-\" (" : *any ? "| " : "", &text, negative ? ") " : "");
        *any = true;
    }
    strbuf_reset(&text);
}

/* The numbers within the bounds (absent ones do not bound), as one GBNF group: the negative
   ones as "-" and a magnitude, -0 and -0.0 where 0 is in (JSON's -0 is 0). A bound other than
   0 rules the exponent out (1e2 would leave the range its mantissa is in: every value has a
   plain form); bounds at 0 alone keep it (a power of ten keeps the sign). False: none fits. */
static bool number_range(strbuf *b, const numeric_bounds *bounds) {
    const bool has_lo = bounds->has_lo, has_hi = bounds->has_hi;
    bool lo_strict = bounds->lo_strict, hi_strict = bounds->hi_strict;
    double lo = bounds->lo, hi = bounds->hi;
    /* An exclusive bound other than 0 is the next double inward, taken inclusive: a text
       between the bound and it reads back as the bound itself (1.0000000000000001 is 1, which
       zod's gt(1) refused), so every text taken reads back within the range; texts that
       round up to that double from below it are left out (narrower, never looser). At 0 the
       caps keep every text's double off 0 (1e-16 x 1e-289 at the least). */
    if (has_lo && lo_strict && lo != 0) { lo = nextafter(lo, INFINITY); lo_strict = false; }
    if (has_hi && hi_strict && hi != 0) { hi = nextafter(hi, -INFINITY); hi_strict = false; }
    const bool zero_in = (!has_lo || lo < 0 || (lo == 0 && !lo_strict)) && (!has_hi || hi > 0 || (hi == 0 && !hi_strict));
    const decimal_bound none = {0};
    bool any = false;
    tl_strbuf_puts(b, "((");
    if (!has_lo || lo <= 0) /* negative: magnitudes from |hi| (or 0) to |lo| */
        magnitudes(b, &any, true, has_hi && hi < 0 ? decimal_of(-hi, hi_strict) : decimal_of(0, !zero_in),
                   has_lo ? decimal_of(-lo, lo_strict) : none, bounds->places);
    if (!has_hi || hi >= 0) /* non-negative: from lo (or 0) to hi */
        magnitudes(b, &any, false, has_lo && lo >= 0 ? decimal_of(lo, lo_strict) : decimal_of(0, false),
                   has_hi ? decimal_of(hi, hi_strict) : none, bounds->places);
    tl_strbuf_puts(b, ")");
    /* (a multipleOf's grid has no exponent: 1e2 is one of 0.01, 1e-5 is not) */
    if ((!has_lo || lo == 0) && (!has_hi || hi == 0) && bounds->places < 0) tl_strbuf_puts(b, " " EXPONENT_GBNF "?");
    tl_strbuf_puts(b, ")");
    return any;
}

/* ---------------------------------------------------------------- strings */

/* The length of the valid UTF-8 character at s (NUL-terminated), or <= 0. */
static int utf8_char(const char *s) {
    size_t n = 0;
    while (n < 4 && s[n]) n++;
    return n ? tl_tlz_utf8_seq((const unsigned char *)s, n) : -1;
}

/* A string format this converter writes a grammar for. */
static bool known_format(const cJSON *format) {
    static const char *const KNOWN[] = {"date", "time", "date-time", "uuid", NULL};
    for (int i = 0; cJSON_IsString(format) && KNOWN[i]; i++)
        if (strcmp(format->valuestring, KNOWN[i]) == 0) return true;
    return false;
}

/* A count keyword (minLength, maxItems...): a whole number in [0, max] (2.7 items was read as
   2, a narrower schema than the one given). */
static bool is_count(const cJSON *v, double max) {
    return cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble <= max && v->valuedouble == floor(v->valuedouble);
}

/* A count keyword past the grammar's bound `max`, loosely: left out, as a keyword that only
   narrows (Claude Code's Workflow tool: a script of maxLength 524288 failed the whole
   request); NULL for it, else the keyword. */
static const cJSON *count_within(const conv *c, const cJSON *v, double max) {
    return v && c->loose && is_count(v, DBL_MAX) && !is_count(v, max) ? NULL : v;
}

static int string_schema(conv *c, const cJSON *s, const char *path) {
    const cJSON *minl = cJSON_GetObjectItemCaseSensitive(s, "minLength");
    const cJSON *maxl = cJSON_GetObjectItemCaseSensitive(s, "maxLength");
    const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(s, "pattern");
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(s, "format");
    strbuf body = {0};
    bool patterned = false;
    if (pattern) {
        if (!cJSON_IsString(pattern)) return fail(c, path, "'pattern' must be a string");
        if ((minl || maxl) && !c->loose) /* (loose: the pattern alone, a superset) */
            return fail(c, path, "'pattern' combined with minLength/maxLength is not supported");
        /* a format beside it: the pattern alone (zod writes each format's own pattern beside
           it, {"format": "uuid", "pattern": ...}; both were refused) */
        if (format && !cJSON_IsString(format)) return fail(c, path, "'format' must be a string");
        char err[256];
        tl_strbuf_puts(&body, "\"\\\"\" ");
        c->used_string = true; /* (char: any characters around a pattern without its anchors) */
        if (tl_gram_regex_expr(pattern->valuestring, false, "char*", &body, err, sizeof err) < 0) {
            const bool oom = body.oom;
            drop(c, &body);
            if (oom) return out_of_memory(c, path);
            if (!c->loose) return fail(c, path, "pattern: %s", err);
            /* loose: a pattern that cannot be enforced (a lookahead: pydantic's Decimal) is left
               out, as the other keywords that only narrow */
        } else {
            tl_strbuf_puts(&body, " \"\\\"\"");
            patterned = true;
        }
    }
    if (!patterned && format && !(c->loose && !known_format(format))) { /* (loose: an unknown format is any string) */
        if (!cJSON_IsString(format)) return fail(c, path, "'format' must be a string");
        if ((minl || maxl) && !c->loose) return fail(c, path, "'format' combined with minLength/maxLength is not supported");
        const char *f = format->valuestring;
        /* a day that exists (RFC 3339's full-date, years 0000 to 9999 of the proleptic
           Gregorian calendar): 31 days in months 1 3 5 7 8 10 12, 30 in 4 6 9 11, 28 in
           February, and February 29 in leap years (divisible by 4, and by 400 where by 100) */
        const char *date = "([0-9]{4} \"-\" ((\"0\" [13578] | \"1\" [02]) \"-\" (\"0\" [1-9] | [12] [0-9] | \"3\" [01]) | "
                           "(\"0\" [469] | \"11\") \"-\" (\"0\" [1-9] | [12] [0-9] | \"30\") | "
                           "\"02-\" (\"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8])) | "
                           "([0-9] [0-9] (\"0\" [48] | [2468] [048] | [13579] [26]) | ([02468] [048] | [13579] [26]) \"00\") "
                           "\"-02-29\")";
        /* RFC 3339's full-time, 'T' and 'Z' in either case. A second of 60, a leap second,
           ends the day in UTC: 23:59:60 shifted by the offset (section 5.7; JSON Schema's
           test suite refuses 22:59:60Z and 23:59:60+01:00, which 00-60 anywhere let
           through). Only its UTC spellings (Z, +00:00, -00:00) are written: narrower, never
           looser (the same second at another offset, 00:59:60+01:00, is refused). */
        const char *time = "(([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" [0-5] [0-9] " FRACTION_GBNF "? "
                           "([Zz] | [+-] ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9]) | "
                           "\"23:59:60\" " FRACTION_GBNF "? ([Zz] | [+-] \"00:00\"))";
        if (strcmp(f, "date") == 0) tl_strbuf_printf(&body, "\"\\\"\" %s \"\\\"\"", date);
        else if (strcmp(f, "time") == 0) tl_strbuf_printf(&body, "\"\\\"\" %s \"\\\"\"", time);
        else if (strcmp(f, "date-time") == 0) tl_strbuf_printf(&body, "\"\\\"\" %s [Tt] %s \"\\\"\"", date, time);
        else if (strcmp(f, "uuid") == 0)
            tl_strbuf_puts(&body, "\"\\\"\" [0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{12} \"\\\"\"");
        else return fail(c, path, "format '%s' is not supported (date, time, date-time, uuid)", f);
    } else if (!patterned) {
        c->used_string = true;
        int lo = 0, hi = -1;
        minl = count_within(c, minl, 10000);
        maxl = count_within(c, maxl, 10000);
        if (minl && !is_count(minl, 10000)) return fail(c, path, "'minLength' must be an integer in [0, 10000]");
        if (maxl && !is_count(maxl, 10000)) return fail(c, path, "'maxLength' must be an integer in [0, 10000]");
        if (minl) lo = minl->valueint;
        if (maxl) hi = maxl->valueint;
        if (hi >= 0 && hi < lo) return fail(c, path, "maxLength < minLength");
        if (!minl && !maxl) tl_strbuf_puts(&body, "string");
        else if (hi < 0) tl_strbuf_printf(&body, "\"\\\"\" char{%d,} \"\\\"\"", lo);
        else tl_strbuf_printf(&body, "\"\\\"\" char{%d,%d} \"\\\"\"", lo, hi);
    }
    if (body.oom) { drop(c, &body); return out_of_memory(c, path); }
    int r = new_rule(c);
    /* (the shared string rule ends in its own blanks: a second ws after it let two runs of
       them follow a string) */
    const bool shared = body.p && strcmp(body.p, "string") == 0;
    tl_strbuf_printf(&c->out, "r%d ::= %s%s\n", r, body.p, shared ? "" : WS(c));
    drop(c, &body);
    return r;
}

/* ---------------------------------------------------------------- schemas */

/* Keywords that only narrow the values a schema allows: a loose conversion leaves them out
   (the grammar then allows a superset). Widening ones (patternProperties beside
   additionalProperties false) are not here: leaving them out would refuse valid values. */
static const char *const NARROWING[] = {"multipleOf", "uniqueItems", "minProperties", "maxProperties", "contains",
                                        "minContains", "maxContains", "if", "then", "else", "not", "propertyNames",
                                        "dependentRequired", "dependentSchemas", "unevaluatedProperties",
                                        "unevaluatedItems", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                        "contentEncoding", "contentMediaType", "format", NULL};

/* (and OpenAPI's: "example", "discriminator", which Pydantic writes beside a oneOf whose branches
   a property's const tells apart, "x-" extensions; validators ignore them) */
static const char *const ANNOTATIONS[] = {"title", "description", "examples", "default", "$schema", "$id",
                                          "$comment", "$defs", "definitions", "deprecated", "readOnly", "writeOnly",
                                          "example", "discriminator", NULL};

static bool keyword_in(const char *k, const char *const *list) {
    for (; *list; list++)
        if (strcmp(k, *list) == 0) return true;
    return false;
}

/* A keyword any schema may carry: an annotation, OpenAPI's nullable (schema() reads it), or
   (loose) one that only narrows. */
static bool keyword_taken_anywhere(const conv *c, const char *k) {
    return keyword_in(k, ANNOTATIONS) || strncmp(k, "x-", 2) == 0 || strcmp(k, "nullable") == 0 ||
           (c->loose && keyword_in(k, NARROWING));
}

static const char *const *type_keywords(const char *type);

/* propertyNames that every name meets (a name is a string): true, {}, {"type": "string"}, as
   zod writes it for every z.record(z.string(), ...); it narrows nothing. */
static bool names_any(const cJSON *k) {
    if (strcmp(k->string, "propertyNames") != 0) return false;
    if (cJSON_IsTrue(k) || (cJSON_IsObject(k) && !k->child)) return true;
    const cJSON *type = cJSON_IsObject(k) ? cJSON_GetObjectItemCaseSensitive(k, "type") : NULL;
    return type && cJSON_GetArraySize(k) == 1 && cJSON_IsString(type) && strcmp(type->valuestring, "string") == 0;
}

/* Every keyword of s must be handled by its type or be taken anywhere. A type's keyword where
   it is not read (beside a $ref, without a "type", under another type or a combinator) is
   named as such: "unsupported" alone sent users looking for a keyword that is supported. */
static int check_keywords(conv *c, const cJSON *s, const char *path, const char *const *handled) {
    static const char *const TYPES[] = {"object", "array", "string", "integer", "number", NULL};
    for (const cJSON *k = s->child; k; k = k->next) {
        if (keyword_taken_anywhere(c, k->string) || keyword_in(k->string, handled) || names_any(k)) continue;
        if (keyword_in("$ref", handled))
            return fail(c, path, "keyword '%s' beside '$ref' is not supported (a $ref takes only annotations such as "
                                 "'description')", k->string);
        strbuf types = {0};
        for (int i = 0; TYPES[i]; i++)
            if (strcmp(k->string, "type") != 0 && keyword_in(k->string, type_keywords(TYPES[i])))
                tl_strbuf_printf(&types, "%s\"%s\"", types.p ? " or " : "", TYPES[i]);
        int r = types.p ? fail(c, path, "keyword '%s' is not supported here: it is read only in a schema of \"type\" %s "
                                        "(without const, enum, anyOf, oneOf or allOf)", k->string, types.p)
                        : fail(c, path, "unsupported keyword '%s'", k->string);
        drop(c, &types);
        return r;
    }
    return 0;
}

/* A value holds no number a double may not hold exactly (cJSON reads 1e400 as infinity, and
   9007199254740993 as 9007199254740992: the literal would be another value), as the bounds
   ('minimum', ...) are held below 2^53. (U+0000 is refused in the schema's text,
   tl_gram_json_schema_to_gbnf.) */
static int literal_checked(conv *c, const cJSON *v, const char *path) {
    if (cJSON_IsNumber(v) && !(fabs(v->valuedouble) < 9007199254740992.0))
        return fail(c, path, "%s", "a number in 'const' or 'enum' must be below 2^53 (9007199254740992) in magnitude "
                                   "(past it a double may hold another value than the one written)");
    for (const cJSON *k = cJSON_IsArray(v) || cJSON_IsObject(v) ? v->child : NULL; k; k = k->next)
        if (literal_checked(c, k, path) < 0) return -1;
    return 0;
}

/* A number as the shortest text that reads back as exactly that double: cJSON's own printing
   takes 15 digits wherever they read back within its epsilon, so 0.30000000000000004 became
   0.3 (another value) and 2^53 - 1 became 9.00719925474099e+15. Written and read in the C
   locale (tl_enter_c_locale): a host program that set its own (setlocale(LC_ALL, "") in a
   German desktop) had the grammar force "0,5" for 0.5, which is not JSON. */
static void exact_number(strbuf *out, double d) {
    char text[40];
    if (d == floor(d) && fabs(d) < 1e17) {
        void *callers = tl_enter_c_locale();
        snprintf(text, sizeof text, "%.0f", d);
        tl_leave_c_locale(callers);
    } else {
        shortest_text(d, text);
    }
    if (strcmp(text, "-0") == 0) snprintf(text, sizeof text, "0"); /* (-0 == 0: one value, its usual spelling) */
    tl_strbuf_puts(out, text);
}

/* A string as JSON text, as JSON writers spell it (cJSON's, JSON.stringify's, Python's: the
   short escapes where JSON has one, else \u00xx in lower case); false when out of memory. */
static bool json_string(strbuf *out, const char *s) {
    cJSON *item = cJSON_CreateString(s);
    char *text = item ? cJSON_PrintUnformatted(item) : NULL;
    cJSON_Delete(item);
    if (!text) return false;
    tl_strbuf_puts(out, text);
    free(text);
    return true;
}

/* A literal value as compact JSON text (json_string's strings, exact numbers); false when out
   of memory. */
static bool literal_text(strbuf *out, const cJSON *v) {
    if (cJSON_IsNumber(v)) {
        exact_number(out, v->valuedouble);
        return true;
    }
    if (cJSON_IsArray(v) || cJSON_IsObject(v)) {
        const bool object = cJSON_IsObject(v);
        tl_strbuf_puts(out, object ? "{" : "[");
        for (const cJSON *k = v->child; k; k = k->next) {
            if (k != v->child) tl_strbuf_puts(out, ",");
            if (object) {
                if (!json_string(out, k->string)) return false;
                tl_strbuf_puts(out, ":");
            }
            if (!literal_text(out, k)) return false;
        }
        tl_strbuf_puts(out, object ? "}" : "]");
        return true;
    }
    char *text = cJSON_PrintUnformatted(v); /* a string, true, false or null */
    if (!text) return false;
    tl_strbuf_puts(out, text);
    free(text);
    return true;
}

/* A literal value as a GBNF sequence: its compact text; with free blanks, an array or object
   takes them where any value's does (after '[', '{', ',', ':', a key and each member), as
   json.dumps writes [1, 2]. False when out of memory. */
static bool literal_gbnf(strbuf *out, const cJSON *v, bool free_ws) {
    if (free_ws && (cJSON_IsArray(v) || cJSON_IsObject(v))) {
        const bool object = cJSON_IsObject(v);
        tl_strbuf_puts(out, object ? "\"{\" ws" : "\"[\" ws");
        for (const cJSON *k = v->child; k; k = k->next) {
            if (k != v->child) tl_strbuf_puts(out, " \",\" ws");
            if (object) {
                strbuf key = {0};
                const bool ok = json_string(&key, k->string) && !key.oom;
                if (ok) {
                    tl_strbuf_puts(out, " ");
                    tl_gram_gbnf_literal(out, key.p ? key.p : "");
                    tl_strbuf_puts(out, " ws \":\" ws");
                }
                free(key.p);
                if (!ok) return false;
            }
            tl_strbuf_puts(out, " ");
            if (!literal_gbnf(out, k, true)) return false;
            tl_strbuf_puts(out, " ws");
        }
        tl_strbuf_puts(out, object ? " \"}\"" : " \"]\"");
        return true;
    }
    strbuf text = {0};
    const bool ok = literal_text(&text, v) && !text.oom;
    if (ok) tl_gram_gbnf_literal(out, text.p ? text.p : "");
    free(text.p);
    return ok;
}

static int json_literal_rule(conv *c, const cJSON *v, const char *path) {
    if (literal_checked(c, v, path) < 0) return -1;
    strbuf body = {0};
    if (!literal_gbnf(&body, v, c->free_ws) || body.oom) {
        drop(c, &body);
        return out_of_memory(c, path);
    }
    int r = new_rule(c);
    tl_strbuf_printf(&c->out, "r%d ::= ", r);
    tl_strbuf_puts(&c->out, body.p ? body.p : "");
    tl_strbuf_printf(&c->out, "%s\n", WS(c));
    free(body.p);
    return r;
}

/* One reference token of a JSON Pointer in a URI fragment (RFC 6901 sections 4 and 6): its
   %XX escapes decoded first, then ~1 as '/' and ~0 as '~' ("#/$defs/a~1b" names the
   definition "a/b"). Writes at most cap - 1 bytes and a NUL; false for a malformed escape, a
   NUL byte or a token past cap. */
static bool pointer_token(const char *from, size_t len, char *out, size_t cap) {
    char uri[1024];
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        int byte = (unsigned char)from[i];
        if (byte == '%') {
            if (i + 2 >= len || !isxdigit((unsigned char)from[i + 1]) || !isxdigit((unsigned char)from[i + 2])) return false;
            char hex[3] = {from[i + 1], from[i + 2], 0};
            byte = (int)strtol(hex, NULL, 16);
            i += 2;
        }
        if (byte == 0 || n + 1 >= sizeof uri) return false;
        uri[n++] = (char)byte;
    }
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = uri[i];
        if (ch == '~') {
            if (i + 1 >= n || (uri[i + 1] != '0' && uri[i + 1] != '1')) return false;
            ch = uri[++i] == '1' ? '/' : '~';
        }
        if (o + 1 >= cap) return false;
        out[o++] = ch;
    }
    out[o] = 0;
    return true;
}

/* The schema a $ref names: "#" (the root) or a JSON Pointer into this document ("#/$defs/NAME",
   "#/definitions/NAME", "#/properties/a/items"...), NULL where it points nowhere; *supported
   false for any other form (another document, an $id, a malformed pointer). */
static const cJSON *ref_target(const conv *c, const char *ref, bool *supported) {
    *supported = true;
    if (ref[0] != '#' || (ref[1] != 0 && ref[1] != '/')) {
        *supported = false;
        return NULL;
    }
    const cJSON *node = c->root;
    for (const char *p = ref + 1; *p; ) { /* (every token is read: a malformed one is refused wherever it is) */
        const char *start = p + 1, *end = strchr(start, '/');
        if (!end) end = start + strlen(start);
        char name[1024];
        if (!pointer_token(start, (size_t)(end - start), name, sizeof name)) {
            *supported = false;
            return NULL;
        }
        if (cJSON_IsArray(node)) { /* an index: digits without a leading zero (NULL: pointed nowhere already) */
            char *stop;
            long index = strtol(name, &stop, 10);
            bool digits = name[0] >= '0' && name[0] <= '9' && *stop == 0 && (name[0] != '0' || name[1] == 0);
            node = digits && index < INT_MAX ? cJSON_GetArrayItem(node, (int)index) : NULL;
        } else {
            node = cJSON_IsObject(node) ? cJSON_GetObjectItemCaseSensitive(node, name) : NULL;
        }
        p = end;
    }
    return node;
}

/* The schema a $ref names, or NULL with the error set (another document, a malformed pointer,
   a pointer to nothing): ref_rule's and allOf's. */
static const cJSON *resolved_ref(conv *c, const char *ref, const char *path) {
    bool supported;
    const cJSON *target = ref_target(c, ref, &supported);
    if (!supported)
        fail(c, path, "$ref '%s' is not supported (only references into this schema: \"#\" or a JSON Pointer such as \"#/$defs/NAME\")", ref);
    else if (!target)
        fail(c, path, "$ref '%s' points nowhere", ref);
    return target;
}

static int ref_rule(conv *c, const char *ref, const char *path) {
    const cJSON *target = resolved_ref(c, ref, path);
    if (!target) return -1;
    const uint64_t key = (uint64_t)(uintptr_t)target;
    const int32_t known = tl_gram_hash_get(&c->ref_rules, key);
    if (known >= 0) return known;
    /* the rule name exists before its body, so recursive schemas refer to it; the body waits
       its turn (compile_pending_refs) */
    const int r = new_rule(c);
    if (!tl_gram_hash_put(&c->ref_rules, key, r)) return out_of_memory(c, path);
    if (c->n_pending == c->cap_pending) {
        const int cap = c->cap_pending * 2 + 16;
        struct pending_ref *grown = realloc(c->pending, (size_t)cap * sizeof *grown);
        if (!grown) return out_of_memory(c, path);
        c->pending = grown;
        c->cap_pending = cap;
    }
    c->pending[c->n_pending++] = (struct pending_ref){target, ref, r};
    return r;
}

/* The bodies of the $ref targets met (and those met in them, in turn), each from the top
   depth: -1 (error set) or 0. */
static int compile_pending_refs(conv *c) {
    while (c->next_pending < c->n_pending) { /* (n_pending grows as bodies meet new targets) */
        const struct pending_ref p = c->pending[c->next_pending++];
        char sub[256];
        snprintf(sub, sizeof sub, "%.200s", p.ref);
        const int body = schema(c, p.target, sub, 0);
        if (body < 0) return -1;
        tl_strbuf_printf(&c->out, "r%d ::= r%d\n", p.rule, body);
    }
    return 0;
}

/* ---------------------------------------------------------------- objects */

/* A declared property name as code points, for the key rule of additional properties. */
typedef struct name_cps { uint32_t *cp; int len; } name_cps;

#define MAX_NAME_CPS 1024 /* a declared name's length beside additionalProperties (recursion) */

static int compare_names(const void *a_, const void *b_) {
    const name_cps *a = a_, *b = b_;
    for (int i = 0; i < a->len && i < b->len; i++)
        if (a->cp[i] != b->cp[i]) return a->cp[i] < b->cp[i] ? -1 : 1;
    return (a->len > b->len) - (a->len < b->len);
}

/* The rest of a key after the `depth` code points that names[lo, hi) (sorted) share: the
   closing quote unless one of them ends here, each next code point of theirs followed by
   its own rest, or any other character and then anything. "Any other" may be a two-letter
   escape (\n, \", ...) of a character no name has next, not a \u escape (it could spell
   one): the few keys that leave every name by a \u escape are not generated (narrower,
   never looser). */
static int key_rest_rule(conv *c, const name_cps *names, int lo, int hi, int depth) {
    static const char ESCAPES[] = "\"\\/bfnrt", ESCAPED[] = "\"\\/\b\f\n\r\t";
    bool escape_ok[sizeof ESCAPES - 1];
    for (size_t e = 0; e < sizeof escape_ok; e++) escape_ok[e] = true;
    strbuf body = {0}, excluded = {0};
    bool ends_a_name = false, any = false;
    for (int i = lo; i < hi; i++) ends_a_name |= names[i].len == depth;
    if (!ends_a_name) { tl_strbuf_puts(&body, "\"\\\"\""); any = true; }
    for (int i = lo, j; i < hi; i = j) {
        j = i + 1;
        if (names[i].len == depth) continue;
        const uint32_t next = names[i].cp[depth];
        while (j < hi && names[j].len > depth && names[j].cp[depth] == next) j++;
        for (size_t e = 0; e < sizeof escape_ok; e++) escape_ok[e] &= next != (unsigned char)ESCAPED[e];
        if (next < 0x20 || next == '"' || next == '\\') continue; /* written escaped in a name: never matched */
        const int child = key_rest_rule(c, names, i, j, depth + 1);
        if (child < 0) { drop(c, &body); drop(c, &excluded); return -1; }
        tl_strbuf_printf(&body, "%s[", any ? " | " : "");
        tl_gram_gbnf_class_cp(&body, next);
        tl_strbuf_printf(&body, "] r%d", child);
        tl_gram_gbnf_class_cp(&excluded, next);
        any = true;
    }
    tl_strbuf_printf(&body, "%s([^\"\\\\\\x00-\\x1F%s]", any ? " | " : "", excluded.p ? excluded.p : "");
    strbuf escapes = {0};
    for (size_t e = 0; e < sizeof escape_ok; e++)
        if (escape_ok[e]) tl_gram_gbnf_class_cp(&escapes, (unsigned char)ESCAPES[e]);
    if (escapes.p) tl_strbuf_printf(&body, " | \"\\\\\" [%s]", escapes.p);
    drop(c, &escapes);
    tl_strbuf_puts(&body, ") char* \"\\\"\"");
    const int r = new_rule(c);
    tl_strbuf_printf(&c->out, "r%d ::= %s\n", r, body.p ? body.p : "");
    drop(c, &body);
    drop(c, &excluded);
    return r;
}

/* A JSON string that is none of the declared property names (an additional property must
   not reuse one: its value would then answer to that property's schema, or repeat it). */
static int extra_key_rule(conv *c, const cJSON *props, const char *path) {
    int n = 0;
    for (const cJSON *p = props ? props->child : NULL; p; p = p->next) n++;
    name_cps *names = calloc((size_t)n + 1, sizeof *names);
    if (!names) return out_of_memory(c, path);
    int r = 0, i = 0;
    for (const cJSON *p = props ? props->child : NULL; p && r == 0; p = p->next, i++) {
        const size_t bytes = strlen(p->string);
        names[i].cp = malloc((bytes + 1) * sizeof *names[i].cp);
        if (!names[i].cp) { r = out_of_memory(c, path); break; }
        for (const unsigned char *s = (const unsigned char *)p->string; *s;) {
            const int len = utf8_char((const char *)s);
            if (len <= 0) { r = fail(c, path, "property name '%.100s' is not valid UTF-8", p->string); break; }
            names[i].cp[names[i].len++] = tl_tlz_utf8_value(s, len);
            s += len;
        }
        if (r == 0 && names[i].len > MAX_NAME_CPS)
            r = fail(c, path, "a property name over %d characters beside additionalProperties is not supported", MAX_NAME_CPS);
    }
    if (r == 0) {
        qsort(names, (size_t)n, sizeof *names, compare_names);
        const int rest = key_rest_rule(c, names, 0, n, 0);
        if (rest < 0) r = -1;
        else {
            r = new_rule(c);
            tl_strbuf_printf(&c->out, "r%d ::= \"\\\"\" r%d\n", r, rest);
        }
    }
    for (i = 0; i < n; i++) free(names[i].cp);
    free(names);
    return r;
}

/* A property's name and its place (sorted by name: qsort's comparison). */
typedef struct named { const char *name; int index; } named;
static int by_name(const void *a, const void *b) { return strcmp(((const named *)a)->name, ((const named *)b)->name); }
static int by_name_then_index(const void *a, const void *b) {
    const named *x = a, *y = b;
    const int r = strcmp(x->name, y->name);
    return r ? r : (x->index > y->index) - (x->index < y->index);
}
static int by_index(const void *a, const void *b) {
    const named *x = a, *y = b;
    return (x->index > y->index) - (x->index < y->index);
}

/* An object's n member names with their places, sorted by name (a name given twice lies
   beside itself), or NULL (out of memory). */
static named *sorted_names(const cJSON *obj, int n) {
    named *sorted = calloc((size_t)n + 1, sizeof *sorted);
    if (!sorted) return NULL;
    int i = 0;
    for (const cJSON *p = obj ? obj->child : NULL; p; p = p->next, i++) sorted[i] = (named){p->string, i};
    qsort(sorted, (size_t)n, sizeof *sorted, by_name);
    return sorted;
}

static int object_schema(conv *c, const cJSON *props, const cJSON *required, const cJSON *additional, const char *path,
                         int depth) {
    int n = 0;
    for (const cJSON *p = props ? props->child : NULL; p; p = p->next) n++;
    int *value = calloc((size_t)n + 1, sizeof *value);
    bool *req = calloc((size_t)n + 1, sizeof *req);
    const cJSON **prop = calloc((size_t)n + 1, sizeof *prop); /* by index: walking the list to each was O(n^2) */
    /* each required name found by a binary search over the sorted names (comparing every
       name with every required one cost 50,000 properties 24 s) */
    named *sorted = sorted_names(props, n);
    if (!value || !req || !prop || !sorted) { free(value); free(req); free(prop); free(sorted); return out_of_memory(c, path); }
    int result = -1; /* (every way out frees the arrays: done) */
    int i = 0;
    for (const cJSON *p = props ? props->child : NULL; p; p = p->next, i++) prop[i] = p;
    /* required names 'properties' lacks, each an additional property that must be there
       (JSON Schema's reading; they were refused): declared below with the schema
       additionalProperties gives them, or any value */
    int n_missing = 0;
    for (const cJSON *r = required ? required->child : NULL; r; r = r->next) {
        const named key = {cJSON_IsString(r) ? r->valuestring : NULL, 0};
        if (!key.name) {
            fail(c, path, "'required' must list property names (strings)");
            goto done;
        }
        const named *hit = bsearch(&key, sorted, (size_t)n, sizeof *sorted, by_name);
        if (!hit) {
            if (additional && cJSON_IsFalse(additional)) {
                fail(c, path, "required property '%s' is not in 'properties', and additionalProperties is false: "
                              "no object matches", key.name);
                goto done;
            }
            n_missing++;
            continue;
        }
        /* every property of that name (a key given twice: both required, as before) */
        const int at = (int)(hit - sorted);
        for (int k = at; k >= 0 && strcmp(sorted[k].name, key.name) == 0; k--) req[sorted[k].index] = true;
        for (int k = at + 1; k < n && strcmp(sorted[k].name, key.name) == 0; k++) req[sorted[k].index] = true;
    }
    if (n_missing) {
        /* again, with them declared after the properties, in the order 'required' lists them
           (they were sorted: {"required": ["b", "a"]} wrote "a" first, and refused a client's
           {"b":..., "a":...}), each once: sorted by name and place, a name required twice is
           beside its first place, and dropped, then put back in order */
        named *missing = calloc((size_t)n_missing, sizeof *missing);
        cJSON *declared = missing ? cJSON_CreateObject() : NULL;
        bool ok = declared != NULL;
        int m = 0;
        for (const cJSON *r = required->child; ok && r; r = r->next) {
            const named key = {r->valuestring, m};
            if (!bsearch(&key, sorted, (size_t)n, sizeof *sorted, by_name)) missing[m++] = key;
        }
        if (m > 1) { /* (missing NULL: out of memory, m 0) */
            qsort(missing, (size_t)m, sizeof *missing, by_name_then_index);
            int kept = 1;
            for (int k = 1; k < m; k++)
                if (strcmp(missing[kept - 1].name, missing[k].name) != 0) missing[kept++] = missing[k];
            m = kept;
            qsort(missing, (size_t)m, sizeof *missing, by_index);
        }
        for (const cJSON *p = props ? props->child : NULL; ok && p; p = p->next)
            ok = add_reference_to_object(declared, p->string, p);
        for (int k = 0; ok && k < m; k++) {
            ok = additional && cJSON_IsObject(additional)
                     ? add_reference_to_object(declared, missing[k].name, additional)
                     : cJSON_AddObjectToObject(declared, missing[k].name) != NULL;
        }
        free(missing);
        if (!ok) {
            cJSON_Delete(declared);
            out_of_memory(c, path);
        } else if (!keep_made(c, declared)) {
            out_of_memory(c, path);
        } else {
            result = object_schema(c, declared, required, additional, path, depth);
        }
        goto done;
    }
    /* (compiled once the required names are all declared: with some missing, the object is
       compiled again with them) */
    for (i = 0; i < n; i++) {
        char sub[512];
        /* (an undeclared required name's schema is additionalProperties': a fault is named there) */
        const bool additional_schema = (prop[i]->type & cJSON_IsReference) && additional && prop[i]->child &&
                                       prop[i]->child == additional->child;
        if (additional_schema) snprintf(sub, sizeof sub, "%.400s/additionalProperties", path);
        else snprintf(sub, sizeof sub, "%.300s/properties/%.100s", path, prop[i]->string);
        value[i] = schema(c, prop[i], sub, depth + 1);
        if (value[i] < 0) goto done;
    }
    /* extra key-value pairs after the declared ones */
    int extra = -1;
    if (additional && !cJSON_IsFalse(additional)) {
        int v;
        if (cJSON_IsTrue(additional)) { c->used_value = true; v = new_rule(c); tl_strbuf_printf(&c->out, "r%d ::= value\n", v); }
        else {
            char sub[512];
            snprintf(sub, sizeof sub, "%.400s/additionalProperties", path);
            v = schema(c, additional, sub, depth + 1);
        }
        if (v < 0) goto done;
        c->used_string = true;
        const int key = n ? extra_key_rule(c, props, path) : 0;
        if (key < 0) goto done;
        extra = new_rule(c);
        if (key) tl_strbuf_printf(&c->out, "r%d ::= r%d%s \":\"%s r%d\n", extra, key, WS(c), WS(c), v);
        else tl_strbuf_printf(&c->out, "r%d ::= string \":\"%s r%d\n", extra, WS(c), v);
    }
    /* rest(i, first): the properties from i on, `first` when nothing was written yet. Rules
       rest_i_first / rest_i_after, so optional properties cost linear size. */
    const int base = c->n_rules;
    c->n_rules += 2 * (n + 1);
    for (i = n; i >= 0; i--) {
        for (int first = 0; first < 2; first++) {
            const int self = base + 1 + 2 * i + first;
            tl_strbuf_printf(&c->out, "r%d ::= ", self);
            const char *sep = first ? "" : "\",\" ";
            if (i == n) {
                if (extra < 0) tl_strbuf_puts(&c->out, "\"\"");
                else if (first) tl_strbuf_printf(&c->out, "(r%d (\",\"%s r%d)*)?", extra, WS(c), extra);
                else tl_strbuf_printf(&c->out, "(\",\"%s r%d)*", WS(c), extra);
                tl_strbuf_puts(&c->out, "\n");
                continue;
            }
            const cJSON *p = prop[i];
            /* the key as JSON text: "name" with JSON escapes */
            strbuf key = {0};
            if (!json_string(&key, p->string) || key.oom) c->out.oom = true; /* (reported once the conversion ends) */
            const int next_after = base + 1 + 2 * (i + 1);
            strbuf kv = {0};
            if (*sep) tl_strbuf_printf(&kv, "%s%s ", sep, c->free_ws ? "ws" : "");
            tl_gram_gbnf_literal(&kv, key.p ? key.p : "");
            drop(c, &key);
            tl_strbuf_printf(&kv, "%s \":\"%s r%d r%d", WS(c), WS(c), value[i], next_after); /* (blanks either side of ':') */
            if (req[i]) tl_strbuf_puts(&c->out, kv.p ? kv.p : "");
            else tl_strbuf_printf(&c->out, "(%s) | r%d", kv.p ? kv.p : "", base + 1 + 2 * (i + 1) + first);
            drop(c, &kv);
            tl_strbuf_puts(&c->out, "\n");
        }
    }
    result = new_rule(c);
    tl_strbuf_printf(&c->out, "r%d ::= \"{\"%s r%d \"}\"%s\n", result, WS(c), base + 2, WS(c));
done:
    free(value);
    free(req);
    free(prop);
    free(sorted);
    return result;
}

static int array_schema(conv *c, const cJSON *s, const char *path, int depth) {
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    const cJSON *prefix = cJSON_GetObjectItemCaseSensitive(s, "prefixItems");
    /* draft-07's tuples, which zod-to-json-schema writes for z.tuple: "items" an array (read as
       prefixItems), "additionalItems" the rest (read as items; beside "items" of one schema it
       means nothing, as in draft-07) */
    const bool tuple = cJSON_IsArray(items);
    if (tuple) {
        if (prefix) return fail(c, path, "'items' as an array (draft-07's tuples) and 'prefixItems': give one of them");
        prefix = items;
        items = cJSON_GetObjectItemCaseSensitive(s, "additionalItems");
    }
    const cJSON *mini = count_within(c, cJSON_GetObjectItemCaseSensitive(s, "minItems"), 1000);
    const cJSON *maxi = count_within(c, cJSON_GetObjectItemCaseSensitive(s, "maxItems"), 1000);
    if (mini && !is_count(mini, 1000)) return fail(c, path, "'minItems' must be an integer in [0, 1000]");
    if (maxi && !is_count(maxi, 1000)) return fail(c, path, "'maxItems' must be an integer in [0, 1000]");
    int lo = mini ? mini->valueint : 0, hi = maxi ? maxi->valueint : -1;
    if (hi >= 0 && hi < lo) return fail(c, path, "maxItems < minItems");
    int n_prefix = prefix ? cJSON_GetArraySize(prefix) : 0;
    if (prefix && !cJSON_IsArray(prefix)) return fail(c, path, "'prefixItems' must be an array");
    int *pre = calloc((size_t)n_prefix + 1, sizeof *pre);
    if (!pre) return out_of_memory(c, path);
    for (int i = 0; i < n_prefix; i++) {
        char sub[512];
        snprintf(sub, sizeof sub, "%.400s/%s/%d", path, tuple ? "items" : "prefixItems", i);
        if ((pre[i] = schema(c, cJSON_GetArrayItem(prefix, i), sub, depth + 1)) < 0) { free(pre); return -1; }
    }
    int item = -1;
    if (items && cJSON_IsFalse(items)) item = -1;
    else if (items) {
        char sub[512];
        snprintf(sub, sizeof sub, "%.400s/%s", path, tuple ? "additionalItems" : "items");
        if ((item = schema(c, items, sub, depth + 1)) < 0) { free(pre); return -1; }
    } else if (!prefix) {
        c->used_value = true;
        item = new_rule(c);
        tl_strbuf_printf(&c->out, "r%d ::= value\n", item);
    }
    /* (no prefixItems and items false: minItems > 0 matches nothing, and [] was let through) */
    if (lo > n_prefix && item < 0) {
        free(pre);
        return fail(c, path, "minItems %d exceeds the %d %s and no items may follow them", lo, n_prefix,
                    tuple ? "items (a tuple without additionalItems)" : "prefixItems");
    }
    /* elements: prefix ones first (all required up to lo, beyond optional), then items,
       which follow only the whole prefix. The optional prefix items are a chain of rules, each
       "(this one, then the next rule)?" (nested in one rule, they met the GBNF parser's limit
       on nested parentheses at 200). */
    const char *comma = c->free_ws ? "\",\" ws " : "\",\" ";
    const int used = n_prefix < hi || hi < 0 ? n_prefix : hi;
    strbuf rest = {0}; /* the items after the prefix */
    if (item >= 0 && (hi < 0 || used < hi)) {
        int need = lo > used ? lo - used : 0;
        for (int k = 0; k < need; k++) tl_strbuf_printf(&rest, "%sr%d ", used + k ? comma : "", item);
        int have = used + need;
        if (hi < 0) {
            if (have == 0) tl_strbuf_printf(&rest, "(r%d (%sr%d)*)? ", item, comma, item);
            else tl_strbuf_printf(&rest, "(%sr%d)* ", comma, item);
        } else if (hi > have) {
            if (have == 0) tl_strbuf_printf(&rest, "(r%d (%sr%d){0,%d})? ", item, comma, item, hi - 1);
            else tl_strbuf_printf(&rest, "(%sr%d){0,%d} ", comma, item, hi - have);
        }
    }
    int tail = -1; /* the rule of what follows the required prefix items */
    if (rest.p) {
        tail = new_rule(c);
        tl_strbuf_printf(&c->out, "r%d ::= %s\n", tail, rest.p);
    }
    drop(c, &rest);
    for (int i = used - 1; i >= lo; i--) {
        const int link = new_rule(c);
        if (tail >= 0) tl_strbuf_printf(&c->out, "r%d ::= (%sr%d r%d)?\n", link, i ? comma : "", pre[i], tail);
        else tl_strbuf_printf(&c->out, "r%d ::= (%sr%d)?\n", link, i ? comma : "", pre[i]);
        tail = link;
    }
    int r = new_rule(c);
    strbuf b = {0};
    tl_strbuf_printf(&b, "\"[\"%s ", WS(c));
    for (int i = 0; i < used && i < lo; i++) tl_strbuf_printf(&b, "%sr%d ", i ? comma : "", pre[i]);
    if (tail >= 0) tl_strbuf_printf(&b, "r%d ", tail);
    tl_strbuf_printf(&b, "\"]\"%s", WS(c));
    tl_strbuf_printf(&c->out, "r%d ::= %s\n", r, b.p ? b.p : "\"[]\"");
    drop(c, &b);
    free(pre);
    return r;
}

/* The keywords a type's schema reads (with "type"), or NULL for an unknown type. */
static const char *const *type_keywords(const char *type) {
    static const char *const OBJECT_KW[] = {"type", "properties", "required", "additionalProperties", NULL};
    static const char *const ARRAY_KW[] = {"type", "items", "prefixItems", "additionalItems", "minItems", "maxItems", NULL};
    static const char *const STRING_KW[] = {"type", "minLength", "maxLength", "pattern", "format", NULL};
    static const char *const NUMERIC_KW[] = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", NULL};
    static const char *const PLAIN_KW[] = {"type", NULL};
    return !strcmp(type, "object") ? OBJECT_KW : !strcmp(type, "array") ? ARRAY_KW : !strcmp(type, "string") ? STRING_KW
         : !strcmp(type, "integer") || !strcmp(type, "number") ? NUMERIC_KW
         : !strcmp(type, "boolean") || !strcmp(type, "null") ? PLAIN_KW : NULL;
}

/* The type a schema without a "type" writes, or NULL (any value): an object where it has
   "properties", an array where "items" or "prefixItems", else the one type whose keywords it
   carries (number for minimum and the like, which integer's also are; none, or two types':
   NULL). Such a schema allows any value and narrows that type's; the grammar writes that
   type, as llama.cpp's converter does ({"pattern": ...} a string, {"minimum": 0} a number):
   {"format": "date"} was refused in strict mode and, loosely, any value at all. Keywords that
   only narrow count in loose mode too (they say which type was meant where the grammar leaves
   them out); those no type reads (minProperties) say nothing. */
static const char *keywords_type(const cJSON *s) {
    if (cJSON_GetObjectItemCaseSensitive(s, "properties")) return "object";
    if (cJSON_GetObjectItemCaseSensitive(s, "items") || cJSON_GetObjectItemCaseSensitive(s, "prefixItems")) return "array";
    static const char *const TYPES[] = {"object", "array", "string", "number", NULL};
    const char *only = NULL;
    for (const cJSON *k = s->child; k; k = k->next)
        for (int i = 0; TYPES[i]; i++)
            if (strcmp(k->string, "type") != 0 && keyword_in(k->string, type_keywords(TYPES[i]))) {
                if (only && only != TYPES[i]) return NULL;
                only = TYPES[i];
                break;
            }
    return only;
}

/* The value rule of schema s for one type. `listed`: the type is one of a list, whose
   keywords were checked together (schema()): each type then reads its own and leaves the
   others', which apply only to values of their types (JSON Schema's rule). */
static int typed(conv *c, const cJSON *s, const char *type, const char *path, int depth, bool listed) {
    const char *const *keywords = type_keywords(type);
    if (!keywords) return fail(c, path, "unknown type '%s'", type);
    if (!listed && check_keywords(c, s, path, keywords) < 0) return -1;
    if (strcmp(type, "object") == 0) {
        const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
        const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
        if (props && !cJSON_IsObject(props)) return fail(c, path, "'properties' must be an object");
        if (req && !cJSON_IsArray(req)) return fail(c, path, "'required' must be an array");
        const cJSON *additional = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
        if (!props && !req && !additional) { /* no keys declared: any object (JSON Schema's, llama.cpp's reading) */
            c->used_value = true;
            const int any = new_rule(c);
            tl_strbuf_printf(&c->out, "r%d ::= object\n", any);
            return any;
        }
        if (!props && !additional) { /* required names alone: any object that has them (it took no other key) */
            cJSON *any = cJSON_CreateTrue();
            if (!any || !keep_made(c, any)) return out_of_memory(c, path);
            additional = any;
        }
        return object_schema(c, props, req, additional, path, depth);
    }
    if (strcmp(type, "array") == 0) return array_schema(c, s, path, depth);
    if (strcmp(type, "string") == 0) return string_schema(c, s, path);
    int r;
    if (strcmp(type, "integer") == 0) {
        numeric_bounds bounds;
        if (read_bounds(c, s, path, &bounds) < 0) return -1;
        const bool has_lo = bounds.has_lo, has_hi = bounds.has_hi;
        /* the integers within: the bound itself where it is one and inclusive */
        double lo = !has_lo ? -BOUND_LIMIT : bounds.lo_strict ? floor(bounds.lo) + 1 : ceil(bounds.lo);
        double hi = !has_hi ? BOUND_LIMIT : bounds.hi_strict ? ceil(bounds.hi) - 1 : floor(bounds.hi);
        if (lo > hi) return fail(c, path, "minimum > maximum: no integer fits");
        r = new_rule(c);
        tl_strbuf_printf(&c->out, "r%d ::= (", r);
        if (!has_lo && !has_hi) tl_strbuf_puts(&c->out, "\"-\"? " WHOLE_GBNF);
        else {
            bool any = false;
            if (lo < 0) { /* negative part: -(|hi'|..|lo|) */
                long long a = hi < 0 ? (long long)-hi : 1, z = has_lo ? (long long)-lo : -1;
                tl_strbuf_puts(&c->out, "\"-\" ");
                natural_range(&c->out, a, z);
                any = true;
            }
            if (hi >= 0) {
                if (any) tl_strbuf_puts(&c->out, " | ");
                natural_range(&c->out, lo > 0 ? (long long)lo : 0, has_hi ? (long long)hi : -1);
                /* (-0 is 0, as the unbounded integer takes it) */
                if (lo <= 0) tl_strbuf_puts(&c->out, " | \"-0\"");
            }
        }
        tl_strbuf_printf(&c->out, ")%s\n", WS(c));
        return r;
    }
    if (strcmp(type, "number") == 0) {
        numeric_bounds bounds;
        if (read_bounds(c, s, path, &bounds) < 0) return -1;
        r = new_rule(c);
        tl_strbuf_printf(&c->out, "r%d ::= ", r);
        if (!bounds.has_lo && !bounds.has_hi && bounds.places < 0) tl_strbuf_puts(&c->out, NUMBER_GBNF);
        else if (!number_range(&c->out, &bounds)) {
            char low[40], high[40], step[40] = "";
            shortest_text(bounds.lo, low);
            shortest_text(bounds.hi, high);
            if (bounds.places >= 0) shortest_text(cJSON_GetObjectItemCaseSensitive(s, "multipleOf")->valuedouble, step);
            return fail(c, path, "no %s%s is %s %s and %s %s", bounds.places >= 0 ? "multiple of " : "number", step,
                        bounds.lo_strict ? ">" : ">=", low, bounds.hi_strict ? "<" : "<=", high);
        }
        tl_strbuf_printf(&c->out, "%s\n", WS(c));
        return r;
    }
    r = new_rule(c); /* boolean or null */
    tl_strbuf_printf(&c->out, "r%d ::= %s%s\n", r, type[0] == 'b' ? "(\"true\" | \"false\")" : "\"null\"", WS(c));
    return r;
}

/* Refuses a property the merge of allOf's branches holds twice: -1 (error set), or 0. */
static int once_each(conv *c, const cJSON *props, const char *path) {
    int n = 0;
    for (const cJSON *p = props->child; p; p = p->next) n++;
    named *sorted = sorted_names(props, n);
    if (!sorted) return out_of_memory(c, path);
    int r = 0;
    for (int i = 1; i < n && r == 0; i++)
        if (strcmp(sorted[i - 1].name, sorted[i].name) == 0)
            r = fail(c, path, "allOf: property '%s' in more than one branch is not supported", sorted[i].name);
    free(sorted);
    return r;
}

/* allOf's branches as object schemas to merge, into *out (grown): a branch that is a $ref
   is the schema it names, and one that is itself an allOf (with at most "type": "object"
   beside it) its own branches: OpenAPI's inheritance, {"allOf": [{"$ref": Base}, {...}]},
   where Base may inherit in turn. -1 (failed) where a $ref points nowhere or the $refs and
   allOfs nest deeper than MAX_ALLOF_NESTING (a cycle). */
/* (each schema is followed once: an allOf of the same schema twice is that schema once, and
   definitions that each name the next twice took time and memory doubling with each level;
   past MAX_ALLOF_SCHEMAS, refused) */
enum { MAX_ALLOF_NESTING = 64, MAX_ALLOF_SCHEMAS = 4096 };
struct branch_list { const cJSON **items; int n, cap; const cJSON **seen; int n_seen, cap_seen; };
static bool grow_list(const cJSON ***items, int n, int *cap) {
    if (n < *cap) return true;
    const int grown_cap = *cap * 2 + 8;
    const cJSON **grown = realloc(*items, (size_t)grown_cap * sizeof *grown);
    if (!grown) return false;
    *items = grown, *cap = grown_cap;
    return true;
}
static int allof_branches(conv *c, const cJSON *list, const char *path, int nesting, struct branch_list *out);
static int allof_branch(conv *c, const cJSON *s, const char *path, int nesting, struct branch_list *out) {
    if (nesting > MAX_ALLOF_NESTING)
        return fail(c, path, "allOf: $refs and allOfs nest more than %d deep (a cycle?)", MAX_ALLOF_NESTING);
    for (int i = 0; i < out->n_seen; i++)
        if (out->seen[i] == s) return 0;
    if (out->n_seen == MAX_ALLOF_SCHEMAS)
        return fail(c, path, "allOf: more than %d schemas through its $refs and allOfs", MAX_ALLOF_SCHEMAS);
    if (!grow_list(&out->seen, out->n_seen, &out->cap_seen)) return out_of_memory(c, path);
    out->seen[out->n_seen++] = s;
    const cJSON *ref = cJSON_IsObject(s) ? cJSON_GetObjectItemCaseSensitive(s, "$ref") : NULL;
    if (ref) {
        static const char *const KW[] = {"$ref", NULL};
        if (!cJSON_IsString(ref)) return fail(c, path, "'$ref' must be a string");
        if (check_keywords(c, s, path, KW) < 0) return -1;
        const cJSON *target = resolved_ref(c, ref->valuestring, path);
        if (!target) return -1;
        return allof_branch(c, target, path, nesting + 1, out); /* (a $ref or an allOf itself, followed in turn) */
    }
    const cJSON *inner = cJSON_IsObject(s) ? cJSON_GetObjectItemCaseSensitive(s, "allOf") : NULL;
    if (inner && cJSON_IsArray(inner) && inner->child) {
        static const char *const KW[] = {"allOf", "type", NULL};
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(s, "type");
        if (t && !(cJSON_IsString(t) && strcmp(t->valuestring, "object") == 0))
            return fail(c, path, "allOf is supported for object schemas only");
        if (check_keywords(c, s, path, KW) < 0) return -1;
        return allof_branches(c, inner, path, nesting + 1, out);
    }
    if (!grow_list(&out->items, out->n, &out->cap)) return out_of_memory(c, path);
    out->items[out->n++] = s;
    return 0;
}
static int allof_branches(conv *c, const cJSON *list, const char *path, int nesting, struct branch_list *out) {
    for (const cJSON *s = list->child; s; s = s->next)
        if (allof_branch(c, s, path, nesting, out) < 0) return -1;
    return 0;
}

/* Merges allOf's object schemas into one (properties and required concatenated). */
static int all_of(conv *c, const cJSON *list, const char *path, int depth) {
    cJSON *props = cJSON_CreateObject(), *req = cJSON_CreateArray();
    const cJSON *additional = NULL;
    int r = -1, branches_with_properties = 0;
    bool additional_branch_has_properties = false;
    struct branch_list branches = {0};
    if (!props || !req) { r = out_of_memory(c, path); goto done; }
    if (allof_branches(c, list, path, 0, &branches) < 0) goto done;
    for (int b = 0; b < branches.n; b++) {
        const cJSON *s = branches.items[b];
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(s, "type");
        const cJSON *p = cJSON_GetObjectItemCaseSensitive(s, "properties");
        if (!cJSON_IsObject(s) || (t && !(cJSON_IsString(t) && strcmp(t->valuestring, "object") == 0)) || (!t && !p)) {
            r = fail(c, path, "allOf is supported for object schemas only");
            goto done;
        }
        static const char *const KW[] = {"type", "properties", "required", "additionalProperties", NULL};
        if (check_keywords(c, s, path, KW) < 0) goto done;
        /* A property or additionalProperties in two branches would need the intersection of
           their schemas: refused rather than one branch's kept (the other's constraints,
           a minimum, additionalProperties false, were silently dropped). */
        for (const cJSON *q = p ? p->child : NULL; q; q = q->next)
            if (!add_reference_to_object(props, q->string, q)) {
                r = out_of_memory(c, path);
                goto done;
            }
        const cJSON *rq = cJSON_GetObjectItemCaseSensitive(s, "required");
        for (const cJSON *q = rq ? rq->child : NULL; q; q = q->next)
            if (!cJSON_AddItemReferenceToArray(req, (cJSON *)q)) { /* (a required name lost: a wider grammar) */
                r = out_of_memory(c, path);
                goto done;
            }
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
        if (a && additional) {
            r = fail(c, path, "%s", "allOf: additionalProperties in more than one branch is not supported");
            goto done;
        }
        if (a) {
            additional = a;
            additional_branch_has_properties = p && p->child;
        }
        if (p && p->child) branches_with_properties++;
    }
    /* (the names sorted, a name given twice lies beside itself: looking each up in the merge
       cost 20,000 properties half a second) */
    if (once_each(c, props, path) < 0) goto done;
    /* a branch's additionalProperties is about the keys that branch does not declare: merged,
       it would let in another branch's keys ({"b": 1} past {"properties": {"a"},
       "additionalProperties": false} beside {"properties": {"b"}}; {"a": 1} past
       {"additionalProperties": false} beside {"properties": {"a"}}), which allOf refuses. It
       is exact only when its own branch declares every property of the merge. */
    if (additional && !cJSON_IsTrue(additional) && branches_with_properties > (additional_branch_has_properties ? 1 : 0)) {
        r = fail(c, path, "%s", "allOf: additionalProperties (other than true) is supported only in the branch that declares every property");
        goto done;
    }
    r = object_schema(c, props, req, additional, path, depth);
done:
    free(branches.items);
    free(branches.seen);
    if (props && !keep_made(c, props) && r >= 0) r = out_of_memory(c, path);
    if (req && !keep_made(c, req) && r >= 0) r = out_of_memory(c, path);
    return r;
}

/* Whether JSON value v has JSON Schema type `type` (a name, or an array of names; NULL: any). */
static bool value_has_type(const cJSON *v, const cJSON *type) {
    if (!type) return true;
    if (cJSON_IsArray(type)) {
        for (const cJSON *t = type->child; t; t = t->next)
            if (value_has_type(v, t)) return true;
        return false;
    }
    if (!cJSON_IsString(type)) return false;
    const char *name = type->valuestring;
    if (!strcmp(name, "string")) return cJSON_IsString(v);
    if (!strcmp(name, "number")) return cJSON_IsNumber(v);
    if (!strcmp(name, "integer")) return cJSON_IsNumber(v) && isfinite(v->valuedouble) && v->valuedouble == floor(v->valuedouble);
    if (!strcmp(name, "boolean")) return cJSON_IsBool(v);
    if (!strcmp(name, "null")) return cJSON_IsNull(v);
    if (!strcmp(name, "array")) return cJSON_IsArray(v);
    if (!strcmp(name, "object")) return cJSON_IsObject(v);
    return false;
}

/* ---------------------------------------------------------------- oneOf's branches */

/* The JSON types a value can have, as bits (an integer-valued number apart from others). */
enum { JT_NULL = 1, JT_BOOLEAN = 2, JT_OBJECT = 4, JT_ARRAY = 8, JT_STRING = 16, JT_INTEGER = 32, JT_FRACTION = 64,
       JT_ANY = 127 };

static unsigned type_bits(const char *name) {
    if (!strcmp(name, "null")) return JT_NULL;
    if (!strcmp(name, "boolean")) return JT_BOOLEAN;
    if (!strcmp(name, "object")) return JT_OBJECT;
    if (!strcmp(name, "array")) return JT_ARRAY;
    if (!strcmp(name, "string")) return JT_STRING;
    if (!strcmp(name, "integer")) return JT_INTEGER;
    if (!strcmp(name, "number")) return JT_INTEGER | JT_FRACTION;
    return JT_ANY;
}

static unsigned value_bits(const cJSON *v) {
    if (cJSON_IsNull(v)) return JT_NULL;
    if (cJSON_IsBool(v)) return JT_BOOLEAN;
    if (cJSON_IsObject(v)) return JT_OBJECT;
    if (cJSON_IsArray(v)) return JT_ARRAY;
    if (cJSON_IsString(v)) return JT_STRING;
    return v->valuedouble == floor(v->valuedouble) ? JT_INTEGER : JT_FRACTION;
}

/* The schema a $ref leads to (a few hops), or s itself; a nullable one stops the hops (null
   is among its values, and not among its target's). */
static const cJSON *followed(const conv *c, const cJSON *s) {
    for (int hop = 0; hop < 8 && cJSON_IsObject(s) && !is_nullable(s); hop++) {
        const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
        if (!cJSON_IsString(ref)) break;
        bool supported;
        const cJSON *target = ref_target(c, ref->valuestring, &supported);
        if (!target) break;
        s = target;
    }
    return s;
}

/* The types of the values a schema lets through (JT_ANY where it cannot tell): with `written`,
   of those its grammar writes; without, of those the schema itself matches. They differ where
   the grammar narrows: "properties" or "items" without a "type" constrain objects or arrays only
   and let any other value through, but the grammar writes an object or an array. */
static unsigned schema_bits(conv *c, const cJSON *s, bool written, int depth) {
    s = followed(c, s);
    const bool or_null = is_nullable(s);
    if (!cJSON_IsObject(s) || depth > MAX_DEPTH) return JT_ANY;
    /* once per node (without it, anyOf branches that $ref the same definitions were walked once
       per path, exponential in the nesting); a node met again while its answer is pending (a
       cycle of $refs) is JT_ANY, which only makes oneOf refuse more */
    enum { PENDING = 1 << 30 };
    const uint64_t key = (uint64_t)(uintptr_t)s | (written ? 1u : 0u); /* nodes are aligned: bit 0 is free */
    int32_t known = tl_gram_hash_get(&c->type_bits_of, key);
    if (known >= 0) return known == PENDING ? JT_ANY : (unsigned)known;
    if (!tl_gram_hash_put(&c->type_bits_of, key, PENDING)) { /* out of memory: said so (refusing would blame the schema) */
        c->out.oom = true;
        return JT_ANY;
    }
    unsigned bits = JT_ANY;
    const cJSON *cst = cJSON_GetObjectItemCaseSensitive(s, "const"), *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    const cJSON *all = cJSON_GetObjectItemCaseSensitive(s, "allOf");
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(s, "anyOf");
    if (!any) any = cJSON_GetObjectItemCaseSensitive(s, "oneOf");
    if (cst) bits = value_bits(cst);
    else if (cJSON_IsArray(en)) {
        bits = 0;
        for (const cJSON *v = en->child; v; v = v->next) bits |= value_bits(v);
    } else if (cJSON_IsString(type)) bits = type_bits(type->valuestring);
    else if (cJSON_IsArray(type)) {
        bits = 0;
        for (const cJSON *t = type->child; t; t = t->next) bits |= cJSON_IsString(t) ? type_bits(t->valuestring) : JT_ANY;
    } else if (cJSON_IsArray(any)) {
        bits = 0;
        for (const cJSON *b = any->child; b; b = b->next) bits |= schema_bits(c, b, written, depth + 1);
    } else if (cJSON_IsArray(all)) {
        if (written && all->child && !all->child->next) bits = schema_bits(c, all->child, written, depth + 1); /* (its branch) */
        else if (written) bits = JT_OBJECT; /* all_of writes one merged object */
        else /* a value matches every branch */
            for (const cJSON *b = all->child; b; b = b->next) bits &= schema_bits(c, b, false, depth + 1);
    } else if (written) {
        const char *narrowed = keywords_type(s);
        if (narrowed) bits = type_bits(narrowed);
    }
    if (or_null) bits |= JT_NULL;
    if (!tl_gram_hash_put(&c->type_bits_of, key, (int32_t)bits)) c->out.oom = true; /* (the node stays PENDING: JT_ANY) */
    return bits;
}

/* The values a schema allows when it lists them (const, or enum), else NULL; *one holds a
   const (which is no array of values). */
static const cJSON *listed_values(const conv *c, const cJSON *s, const cJSON **one) {
    *one = NULL;
    s = followed(c, s);
    if (is_nullable(s)) return NULL; /* (null too: not a list to compare) */
    *one = cJSON_IsObject(s) ? cJSON_GetObjectItemCaseSensitive(s, "const") : NULL;
    if (*one) return *one;
    const cJSON *en = cJSON_IsObject(s) ? cJSON_GetObjectItemCaseSensitive(s, "enum") : NULL;
    return cJSON_IsArray(en) ? en : NULL;
}

/* Whether two JSON values are one value (JSON Schema's equality): numbers exactly (cJSON_Compare
   takes numbers within an epsilon as equal, 0.1 and 0.1 + 2^-56 among them), objects as sets
   of members. */
static bool same_value(const cJSON *x, const cJSON *y) {
    if (cJSON_IsNumber(x) || cJSON_IsNumber(y)) return cJSON_IsNumber(x) && cJSON_IsNumber(y) && x->valuedouble == y->valuedouble;
    if (cJSON_IsArray(x) && cJSON_IsArray(y)) {
        const cJSON *a = x->child, *b = y->child;
        for (; a && b; a = a->next, b = b->next)
            if (!same_value(a, b)) return false;
        return !a && !b;
    }
    if (cJSON_IsObject(x) && cJSON_IsObject(y)) {
        int nx = 0, ny = 0;
        for (const cJSON *a = x->child; a; a = a->next, nx++) {
            const cJSON *b = cJSON_GetObjectItemCaseSensitive(y, a->string);
            if (!b || !same_value(a, b)) return false;
        }
        for (const cJSON *b = y->child; b; b = b->next) ny++;
        return nx == ny;
    }
    return cJSON_Compare(x, y, true); /* strings, true, false, null */
}

/* Whether two listed value sets share a value (true, said to meet, past oneOf's budget of
   checks: the caller refuses the schema). */
static bool values_meet(conv *c, const cJSON *a, const cJSON *a_one, const cJSON *b, const cJSON *b_one) {
    for (const cJSON *x = a_one ? a_one : a->child; x; x = a_one ? NULL : x->next)
        for (const cJSON *y = b_one ? b_one : b->child; y; y = b_one ? NULL : y->next)
            if (++c->oneof_checks > MAX_ONEOF_CHECKS || same_value(x, y)) return true;
    return false;
}

static bool required_in(const cJSON *s, const char *name) {
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    for (const cJSON *r = cJSON_IsArray(req) ? req->child : NULL; r; r = r->next)
        if (cJSON_IsString(r) && !strcmp(r->valuestring, name)) return true;
    return false;
}

/* Whether the grammar of object schema s (its $ref followed) never writes a member `name`: it
   writes its declared properties and required names alone (no additionalProperties but
   false, no combinator), and `name` is neither. */
static bool never_writes(const cJSON *s, const char *name) {
    if (!cJSON_IsObject(s)) return false;
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (!cJSON_IsObject(props) || (extra && !cJSON_IsFalse(extra))) return false;
    if (type && !(cJSON_IsString(type) && strcmp(type->valuestring, "object") == 0)) return false;
    for (const char *const *k = (const char *const[]){"anyOf", "oneOf", "allOf", "$ref", NULL}; *k; k++)
        if (cJSON_GetObjectItemCaseSensitive(s, *k)) return false;
    return !cJSON_GetObjectItemCaseSensitive(props, name) && !required_in(s, name);
}

/* Whether a name that schema b requires is one a's grammar never writes (so no value a's grammar
   writes matches b). */
static bool lacks_required(const cJSON *a, const cJSON *b) {
    const cJSON *req = cJSON_IsObject(b) ? cJSON_GetObjectItemCaseSensitive(b, "required") : NULL;
    for (const cJSON *r = cJSON_IsArray(req) ? req->child : NULL; r; r = r->next)
        if (cJSON_IsString(r) && never_writes(a, r->valuestring)) return true;
    return false;
}

/* Whether no value that one schema's grammar writes matches the other schema (so oneOf's grammar
   of alternatives refuses nothing oneOf accepts, and lets through nothing it refuses): their
   types differ, their listed values differ, or, among objects, a property both require lists
   different values in each (a discriminator), or each requires a name the other's grammar
   never writes (pydantic's union of models whose tag has a default: {"type": "text", "text"}
   beside {"type": "image", "url"}, the tag not required). */
static bool disjoint(conv *c, const cJSON *a, const cJSON *b) {
    const unsigned shared = (schema_bits(c, a, true, 0) & schema_bits(c, b, false, 0)) |
                            (schema_bits(c, a, false, 0) & schema_bits(c, b, true, 0));
    if (!shared) return true;
    const cJSON *a_one, *b_one, *av = listed_values(c, a, &a_one), *bv = listed_values(c, b, &b_one);
    if (av && bv) return !values_meet(c, av, a_one, bv, b_one);
    if (shared != JT_OBJECT) return false; /* "required" says nothing of other values */
    a = followed(c, a);
    b = followed(c, b);
    const cJSON *ap = cJSON_IsObject(a) ? cJSON_GetObjectItemCaseSensitive(a, "properties") : NULL;
    const cJSON *bp = cJSON_IsObject(b) ? cJSON_GetObjectItemCaseSensitive(b, "properties") : NULL;
    for (const cJSON *p = cJSON_IsObject(ap) ? ap->child : NULL; p; p = p->next) {
        const cJSON *q = cJSON_IsObject(bp) ? cJSON_GetObjectItemCaseSensitive(bp, p->string) : NULL;
        if (!q || !required_in(a, p->string) || !required_in(b, p->string)) continue;
        av = listed_values(c, p, &a_one);
        bv = listed_values(c, q, &b_one);
        if (av && bv && !values_meet(c, av, a_one, bv, b_one)) return true;
    }
    return lacks_required(a, b) && lacks_required(b, a);
}

static int schema_body(conv *c, const cJSON *s, const char *path, int depth);

static int schema(conv *c, const cJSON *s, const char *path, int depth) {
    const cJSON *nullable = cJSON_IsObject(s) ? cJSON_GetObjectItemCaseSensitive(s, "nullable") : NULL;
    if (nullable && !cJSON_IsBool(nullable)) return fail(c, path, "'nullable' must be true or false");
    const int r = schema_body(c, s, path, depth);
    return r < 0 || !cJSON_IsTrue(nullable) ? r : or_null_rule(c, r);
}

static int or_null_rule(conv *c, int r) {
    const int or_null = new_rule(c);
    tl_strbuf_printf(&c->out, "r%d ::= r%d | \"null\"%s\n", or_null, r, WS(c));
    return or_null;
}

/* A "type" beside a combinator: both apply, the values of a branch that are of the type. Taken
   where every branch's grammar writes values of the type alone (a tool's parameters, which
   must be an object, as a union of objects: {"type": "object", "anyOf": [...]}). Elsewhere
   strict mode refuses it, and loose mode keeps the type and leaves the combinator out (it
   only narrows the type's values): leaving the type out instead wrote a branch's own type,
   which the type refuses ({"type": "string", "anyOf": [{"minimum": 0}]}, whose branch writes
   a number, took only numbers, none of them valid). -1 (error set), 0 (both apply), or 1
   (loose: the type alone). */
static int combinator_type_checked(conv *c, const cJSON *s, const cJSON *list, const char *combinator, const char *path) {
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (!type) return 0;
    unsigned allowed = 0; /* (a malformed type is named, loosely too: alone it would be) */
    if (cJSON_IsString(type)) {
        if (!type_keywords(type->valuestring)) return fail(c, path, "unknown type '%s'", type->valuestring);
        allowed = type_bits(type->valuestring);
    } else if (cJSON_IsArray(type) && type->child) {
        for (const cJSON *t = type->child; t; t = t->next) {
            if (!cJSON_IsString(t)) return fail(c, path, "'type' entries must be strings");
            if (!type_keywords(t->valuestring)) return fail(c, path, "unknown type '%s'", t->valuestring);
            allowed |= type_bits(t->valuestring);
        }
    } else {
        return fail(c, path, "'type' must be a string or a non-empty array of strings");
    }
    /* allOf's grammar writes one merged object, or its one branch */
    const bool merged = combinator[1] == 'l' && list->child->next;
    int i = 0;
    for (const cJSON *b = list->child; b; b = b->next, i++)
        if (((merged ? JT_OBJECT : schema_bits(c, b, true, 0)) & ~allowed) != 0) {
            if (c->loose) return 1;
            return fail(c, path, "'type' beside '%s' is supported only where each branch is of that type, and branch %d "
                                 "may be of another (give the branch its 'type', or leave 'type' out)", combinator, i);
        }
    return 0;
}

static int schema_body(conv *c, const cJSON *s, const char *path, int depth) {
    if (c->failed) return -1;
    if (depth > MAX_DEPTH) return fail(c, path, "schema nested too deeply (more than %d levels)", MAX_DEPTH);
    if (c->out.n > MAX_GBNF_BYTES)
        return fail(c, path, "the schema's grammar grows past %u MiB (a subschema is written once per place it is used)",
                    MAX_GBNF_BYTES >> 20);
    if (cJSON_IsTrue(s) || (cJSON_IsObject(s) && !s->child)) {
        c->used_value = true;
        int r = new_rule(c);
        tl_strbuf_printf(&c->out, "r%d ::= value\n", r);
        return r;
    }
    if (cJSON_IsFalse(s)) return fail(c, path, "schema 'false' matches nothing");
    /* An $id below the root starts a schema resource with its own base, against which its
       $refs ("#" its own root) resolve: read from the document's root instead, they would
       name other schemas, silently. */
    if (s != c->root && cJSON_IsObject(s) && cJSON_GetObjectItemCaseSensitive(s, "$id"))
        return fail(c, path, "'$id' below the root (an embedded schema resource, the base of its own $refs) is not supported");
    if (!cJSON_IsObject(s)) return fail(c, path, "a schema must be an object or a boolean");
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
    if (ref) {
        static const char *const KW[] = {"$ref", NULL};
        if (!cJSON_IsString(ref)) return fail(c, path, "'$ref' must be a string");
        if (check_keywords(c, s, path, KW) < 0) return -1;
        return ref_rule(c, ref->valuestring, path);
    }
    const cJSON *cst = cJSON_GetObjectItemCaseSensitive(s, "const");
    if (cst) {
        static const char *const KW[] = {"const", "type", NULL};
        if (check_keywords(c, s, path, KW) < 0) return -1;
        /* both keywords apply: a const of another type matches nothing (it was let through) */
        if (!value_has_type(cst, cJSON_GetObjectItemCaseSensitive(s, "type")))
            return fail(c, path, "%s", "'const' is not of the schema's 'type': the schema matches nothing");
        return json_literal_rule(c, cst, path);
    }
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    if (en) {
        static const char *const KW[] = {"enum", "type", NULL};
        if (check_keywords(c, s, path, KW) < 0) return -1;
        if (!cJSON_IsArray(en) || !en->child) return fail(c, path, "'enum' must be a non-empty array");
        /* both keywords apply: only the values of the schema's type (others were let through) */
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
        strbuf alts = {0};
        for (const cJSON *v = en->child; v; v = v->next) {
            if (!value_has_type(v, type)) continue;
            int r = json_literal_rule(c, v, path);
            if (r < 0) { drop(c, &alts); return -1; }
            tl_strbuf_printf(&alts, "%sr%d", alts.p ? " | " : "", r);
        }
        if (alts.oom) { drop(c, &alts); return out_of_memory(c, path); }
        if (!alts.p && is_nullable(s)) {
            /* OpenAPI's null, {"type": "string", "nullable": true, "enum": [null]} (zod's
               z.null() for OpenAPI 3.0): nullable lets null through, which schema() adds */
            for (const cJSON *v = en->child; v && !alts.p; v = v->next)
                if (cJSON_IsNull(v)) tl_strbuf_puts(&alts, "\"null\"");
        }
        if (!alts.p) return fail(c, path, "%s", "no 'enum' value is of the schema's 'type': the schema matches nothing");
        int r = new_rule(c);
        tl_strbuf_printf(&c->out, "r%d ::= %s\n", r, alts.p ? alts.p : "\"\"");
        drop(c, &alts);
        return r;
    }
    const char *combinator = cJSON_GetObjectItemCaseSensitive(s, "anyOf") ? "anyOf"
                           : cJSON_GetObjectItemCaseSensitive(s, "oneOf") ? "oneOf"
                           : cJSON_GetObjectItemCaseSensitive(s, "allOf") ? "allOf" : NULL;
    if (combinator) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(s, combinator);
        const char *const KW[] = {combinator, "type", NULL};
        if (check_keywords(c, s, path, KW) < 0) return -1;
        if (!cJSON_IsArray(list) || !list->child) return fail(c, path, "'%s' must be a non-empty array", combinator);
        const int type_checked = combinator_type_checked(c, s, list, combinator, path);
        if (type_checked < 0) return -1;
        if (type_checked == 1) { /* (loose) the schema without its combinator: the type's values */
            /* its branches are still compiled, unused, so that a fault in one is named as it is
               elsewhere (a $ref pointing nowhere, an unknown type) */
            int i = 0;
            for (const cJSON *b = list->child; b; b = b->next, i++) {
                char sub[512];
                snprintf(sub, sizeof sub, "%.400s/%s/%d", path, combinator, i);
                if (schema(c, b, sub, depth + 1) < 0) return -1;
            }
            cJSON *alone = cJSON_Duplicate(s, true);
            if (!alone || !keep_made(c, alone)) return out_of_memory(c, path);
            cJSON_DeleteItemFromObjectCaseSensitive(alone, combinator);
            /* (a root's $id, which the copy would read as one below the root: refs resolve from
               the document's root all the same) */
            cJSON_DeleteItemFromObjectCaseSensitive(alone, "$id");
            return schema_body(c, alone, path, depth + 1);
        }
        /* a one-branch allOf is its branch (pydantic v1's and FastAPI's way to annotate a $ref:
           {"allOf": [{"$ref": ...}], "description": ...}), of any type */
        if (combinator[1] == 'l' && !list->child->next) {
            char sub[512];
            snprintf(sub, sizeof sub, "%.400s/allOf/0", path);
            return schema(c, list->child, sub, depth + 1);
        }
        if (combinator[1] == 'l') {
            /* every branch nullable: so is the merge (one that is not refuses null) */
            bool all_nullable = true;
            for (const cJSON *b = list->child; b && all_nullable; b = b->next) all_nullable = is_nullable(b);
            const int merged = all_of(c, list, path, depth);
            return merged < 0 || !all_nullable ? merged : or_null_rule(c, merged);
        }
        /* oneOf refuses a value that matches two branches, which a grammar of alternatives
           cannot: it is taken where no value can (anyOf's grammar is then oneOf's). The first
           pair that may meet is refused once the branches compiled, so that a branch's own
           fault is named first (a $ref pointing nowhere was "a value may match both"). */
        int clash_i = -1, clash_j = -1;
        /* (loose: oneOf's refusal of a value two branches match only narrows: left out, the
           branches' alternatives are anyOf's, llama.cpp's reading) */
        if (combinator[0] == 'o' && !c->loose) {
            /* each branch's $ref followed once, not once a pair (a lookup walks the $defs: 1,000
               branches, each a $ref, took 3.8 s, 2,000 took 37 s) */
            const int n = cJSON_GetArraySize(list);
            const cJSON **branch = malloc((size_t)n * sizeof *branch);
            if (!branch) return out_of_memory(c, path);
            int k = 0;
            for (const cJSON *x = list->child; x; x = x->next) branch[k++] = followed(c, x);
            for (int i = 0; i < n && clash_i < 0; i++)
                for (int j = i + 1; j < n && clash_i < 0; j++) {
                    const bool apart = ++c->oneof_checks <= MAX_ONEOF_CHECKS && disjoint(c, branch[i], branch[j]);
                    if (c->oneof_checks > MAX_ONEOF_CHECKS) {
                        free(branch);
                        return fail(c, path, "oneOf: too many branches or values to check that no value matches two "
                                             "branches (more than %lld checks); use anyOf, or one enum",
                                             (long long)MAX_ONEOF_CHECKS);
                    }
                    if (!apart) clash_i = i, clash_j = j;
                }
            free(branch);
        }
        strbuf alts = {0};
        int i = 0;
        for (const cJSON *v = list->child; v; v = v->next, i++) {
            char sub[512];
            snprintf(sub, sizeof sub, "%.400s/%s/%d", path, combinator, i);
            int r = schema(c, v, sub, depth + 1);
            if (r < 0) { drop(c, &alts); return -1; }
            tl_strbuf_printf(&alts, "%sr%d", i ? " | " : "", r);
        }
        /* (a branch's $ref target waits its turn: its own fault is still named first) */
        if (clash_i >= 0 && !c->draining_for_clash) {
            c->draining_for_clash = true;
            if (compile_pending_refs(c) < 0) { drop(c, &alts); return -1; }
        }
        if (clash_i >= 0) {
            drop(c, &alts);
            return fail(c, path, "oneOf: a value may match both branch %d and branch %d, which oneOf refuses and "
                                 "a grammar cannot (give them different types or const values, a property both "
                                 "require with a different const in each, or use anyOf)", clash_i, clash_j);
        }
        int r = new_rule(c);
        tl_strbuf_printf(&c->out, "r%d ::= %s\n", r, alts.p ? alts.p : "\"\"");
        drop(c, &alts);
        return r;
    }
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (!type) {
        const char *narrowed = keywords_type(s);
        if (narrowed) return typed(c, s, narrowed, path, depth, false);
        static const char *const NONE[] = {NULL};
        if (check_keywords(c, s, path, NONE) < 0) return -1;
        c->used_value = true;
        int r = new_rule(c);
        tl_strbuf_printf(&c->out, "r%d ::= value\n", r);
        return r;
    }
    if (cJSON_IsString(type)) return typed(c, s, type->valuestring, path, depth, false);
    if (cJSON_IsArray(type) && type->child) {
        /* each keyword must be one of a listed type's (typed reads each type's own) */
        for (const cJSON *t = type->child; t; t = t->next) {
            if (!cJSON_IsString(t)) return fail(c, path, "'type' entries must be strings");
            if (!type_keywords(t->valuestring)) return fail(c, path, "unknown type '%s'", t->valuestring);
            /* (JSON Schema wants them unique; each is written out in full) */
            for (const cJSON *u = type->child; u != t; u = u->next)
                if (strcmp(u->valuestring, t->valuestring) == 0) return fail(c, path, "'type' lists '%s' twice", t->valuestring);
        }
        for (const cJSON *k = s->child; k; k = k->next) {
            bool known = keyword_taken_anywhere(c, k->string);
            for (const cJSON *t = type->child; t && !known; t = t->next) known = keyword_in(k->string, type_keywords(t->valuestring));
            if (!known) return fail(c, path, "unsupported keyword '%s'", k->string);
        }
        strbuf alts = {0};
        for (const cJSON *t = type->child; t; t = t->next) {
            int r = typed(c, s, t->valuestring, path, depth, true);
            if (r < 0) { drop(c, &alts); return -1; }
            tl_strbuf_printf(&alts, "%sr%d", t == type->child ? "" : " | ", r);
        }
        int r = new_rule(c);
        tl_strbuf_printf(&c->out, "r%d ::= %s\n", r, alts.p ? alts.p : "\"\"");
        drop(c, &alts);
        return r;
    }
    return fail(c, path, "'type' must be a string or a non-empty array of strings");
}

tl_status tl_gram_json_schema_to_gbnf(const char *json, size_t len, int free_ws, int loose, char **gbnf, size_t *gbnf_len, char *err,
                                   size_t errlen) {
    *gbnf = NULL;
    /* (GBNF literals are code points: names and values must be valid UTF-8, which the
       loader's JSON rules below see to.) \u0000: cJSON keeps a string only to its first NUL,
       so a key or value holding one would be matched as its part before it */
    for (size_t i = 0; i + 1 < len; i++) {
        if (json[i] != '\\') continue;
        if (json[i + 1] == 'u' && i + 5 < len && memcmp(json + i + 2, "0000", 4) == 0) {
            snprintf(err, errlen, "a string holding U+0000 (\\u0000, byte %zu) is not supported", i);
            return TL_ERR_INVALID_ARGUMENT;
        }
        i++; /* the escaped character */
    }
    /* (the loader's JSON rules: valid UTF-8, no raw control characters, one value, nothing
       after it but blanks, no byte order mark, no key twice: text after the schema was
       dropped, and of a key given twice cJSON kept the first where Python's and JavaScript's
       parsers keep the last) */
    cJSON *root = NULL;
    char why[200];
    const int read = tl_json_read_value_strict(json, len, &root, why, sizeof why);
    if (read != 0) {
        snprintf(err, errlen, "%s", why);
        return read == -2 ? TL_ERR_NO_MEMORY : TL_ERR_INVALID_ARGUMENT;
    }
    conv c = {.root = root, .free_ws = free_ws != 0, .loose = loose != 0, .err = err, .errlen = errlen};
    int top = schema(&c, root, "", 0);
    if (top >= 0 && compile_pending_refs(&c) < 0) top = -1;
    tl_status st = TL_OK;
    if (c.out.oom) { /* (first: a lost text may have failed as the schema's fault) */
        snprintf(err, errlen, "out of memory");
        st = TL_ERR_NO_MEMORY;
    } else if (top < 0) {
        st = TL_ERR_INVALID_ARGUMENT;
    } else {
        strbuf head = {0};
        tl_strbuf_printf(&head, "root ::= %sr%d\n", c.free_ws ? "ws " : "", top);
        /* free blanks: one blank, then one or two line breaks (CRLF too, RFC 8259's
           whitespace) and an indentation of up to 20 blanks: JSON pretty-printed with an
           indent of 4 five levels deep (llama.cpp's bound), and no budget spent on blanks (a
           weak model given more wrote blanks until max_tokens); the shipped json.gbnf's rule */
        tl_strbuf_puts(&head, c.free_ws ? "ws ::= [ \\t]? (\"\\r\"? \"\\n\" (\"\\r\"? \"\\n\")? [ \\t]{0,20})?\n" : "ws ::= \"\"\n");
        if (c.used_string || c.used_value) {
            tl_strbuf_puts(&head, "string ::= \"\\\"\" char* \"\\\"\"");
            tl_strbuf_printf(&head, "%s\n", WS(&c));
            /* one character: a \u escape of a surrogate pair is one (minLength counts it once),
               a lone surrogate none (no character: JSON text for UTF-8 output holds none) */
            tl_strbuf_puts(&head, "char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" ([0-9a-cA-Ce-fE-F] [0-9a-fA-F]{3} | "
                               "[dD] [0-7] [0-9a-fA-F]{2} | [dD] [89abAB] [0-9a-fA-F]{2} \"\\\\u\" [dD] [c-fC-F] [0-9a-fA-F]{2}))\n");
        }
        if (c.used_value) {
            tl_strbuf_puts(&head, "value ::= object | array | string | number | (\"true\" | \"false\" | \"null\") ws\n");
            tl_strbuf_puts(&head, "object ::= \"{\" ws (string \":\" ws value (\",\" ws string \":\" ws value)*)? \"}\" ws\n");
            tl_strbuf_puts(&head, "array ::= \"[\" ws (value (\",\" ws value)*)? \"]\" ws\n");
            tl_strbuf_puts(&head, "number ::= " NUMBER_GBNF " ws\n");
        }
        tl_strbuf_put(&head, c.out.p ? c.out.p : "", c.out.n);
        if (head.oom || c.out.oom) {
            free(head.p);
            snprintf(err, errlen, "out of memory");
            st = TL_ERR_NO_MEMORY;
        } else {
            *gbnf = head.p;
            if (gbnf_len) *gbnf_len = head.n;
        }
    }
    free(c.out.p);
    free(c.pending);
    tl_gram_hash_free(&c.ref_rules);
    tl_gram_hash_free(&c.type_bits_of);
    cJSON_Delete(c.made);
    cJSON_Delete(root);
    return st;
}

/* test_regex.c: regular expressions as grammars (tl_grammar_compile_regex, regex.c).
 *   - tables: what each construct accepts and rejects, text mode against JSON-string mode;
 *   - errors: every refused construct is named, never loosened;
 *   - a differential check against libc's POSIX regex (regcomp, REG_EXTENDED) on random
 *     patterns of the syntax both share and every short text over their alphabet;
 *   - generation: seeded samples of the shipped model under a pattern all match it (by
 *     regexec too) and end where the pattern lets them.
 *   test_regex SOURCE_DIR */
#define _POSIX_C_SOURCE 200809L
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "tinyloop.h"

static tl_compiled_grammar *regex(const char *pattern) {
    tl_compiled_grammar *g = NULL;
    const tl_status st = tl_grammar_compile_regex(pattern, strlen(pattern), &g);
    CHECK(st == TL_OK, "compile /%s/: %s", pattern, tl_last_error());
    return g;
}

static int matches_n(const tl_compiled_grammar *g, const char *text, size_t len) {
    int m = -1;
    const tl_status st = tl_grammar_matches(g, text, len, &m);
    CHECK(st == TL_OK, "matches: %s", tl_last_error());
    return m;
}

static int matches(const tl_compiled_grammar *g, const char *text) { return matches_n(g, text, strlen(text)); }

static void expect(const char *pattern, const char *const *yes, const char *const *no) {
    tl_compiled_grammar *g = regex(pattern);
    if (!g) return;
    for (; *yes; yes++) CHECK(matches(g, *yes) == 1, "/%s/ should accept \"%s\"", pattern, *yes);
    for (; *no; no++) CHECK(matches(g, *no) == 0, "/%s/ should reject \"%s\"", pattern, *no);
    tl_compiled_grammar_free(g);
}

/* ---------------------------------------------------------------- what each construct matches */

static void test_tables(void) {
    { static const char *y[] = {"555-1234", NULL}, *n[] = {"55-1234", "555-12345", "", "5551234", NULL};
      expect("\\d{3}-\\d{4}", y, n); }
    { static const char *y[] = {"yes\n", "no\n", NULL}, *n[] = {"yes", "no \n", NULL};
      expect("(yes|no)\\n", y, n); }
    /* '.' is any character but a line terminator; a negated class takes them */
    { static const char *y[] = {"a\"b\\c", "\xc3\xa9", "\t", NULL}, *n[] = {"a\nb", "\r", "\xe2\x80\xa8", "", NULL};
      expect(".+", y, n); }
    { static const char *y[] = {"\n", "\"\\", "\xf0\x9f\x98\x80", NULL}, *n[] = {"a", "ba", NULL};
      expect("[^a]+", y, n); }
    /* "[^]" is any character, "[]" none; an empty alternative is the empty text */
    { static const char *y[] = {"x", "\n", NULL}, *n[] = {"", "xy", NULL}; expect("[^]", y, n); }
    { static const char *y[] = {NULL}, *n[] = {"", "a", NULL}; expect("[]", y, n); }
    { static const char *y[] = {"a", "", NULL}, *n[] = {"b", "aa", NULL}; expect("a|", y, n); }
    /* a range of one character is no reversed range */
    { static const char *y[] = {"ab", NULL}, *n[] = {"bb", "b", NULL}; expect("[a-a]b", y, n); }
    { static const char *y[] = {"", NULL}, *n[] = {"a", NULL}; expect("()", y, n); }
    /* \s is ECMA-262's white space, controls included outside a JSON string */
    { static const char *y[] = {" \t\n\v\f\rx", "\xc2\xa0\xe3\x80\x80y", "z", NULL}, *n[] = {"  ", "x ", NULL};
      expect("\\s*\\S", y, n); }
    { static const char *y[] = {"a_1", NULL}, *n[] = {"a-1", NULL}; expect("\\w+", y, n); }
    { static const char *y[] = {"-", "x", "_", NULL}, *n[] = {"1", NULL}; expect("\\D", y, n); }
    { static const char *y[] = {"-", "x", NULL}, *n[] = {"1", "_", NULL}; expect("[^\\d_]", y, n); }
    { static const char *y[] = {"\t", "\n", NULL}, *n[] = {"n", "t", "\\", NULL}; expect("[\\n\\t]", y, n); }
    /* \D \W \S in a class are their complements ("[\s\S]", any character, was refused) */
    { static const char *y[] = {"a\n\"\xf0\x9f\x98\x80 \x01", "", NULL}, *n[] = {NULL}; expect("[\\s\\S]*", y, n); }
    { static const char *y[] = {"a", "-", "\xe2\x82\xac", "1", "\n", NULL}, *n[] = {"", "a1", NULL}; expect("[\\D\\d]", y, n); }
    { static const char *y[] = {"a", "_", "7", NULL}, *n[] = {"-", " ", NULL}; expect("[^\\W]", y, n); }
    { static const char *y[] = {" ", "\t", "\xe3\x80\x80", "-", NULL}, *n[] = {"x", "\xc3\xa9", NULL}; expect("[^\\S]|-", y, n); }
    { static const char *y[] = {"1", "x", NULL}, *n[] = {" ", "\xc2\xa0", "\n", NULL}; expect("[\\S]", y, n); }
    /* quotes and backslashes are plain characters here (a JSON string writes them escaped) */
    { static const char *y[] = {"\"q\\\"", NULL}, *n[] = {"\"q\\\\\"", "q", NULL}; expect("\"q\\\\\"", y, n); }
    { static const char *y[] = {"\"", "\\", NULL}, *n[] = {"\\\"", NULL}; expect("[\"\\\\]", y, n); }
    /* \xHH, \uHHHH and \0 in and out of classes */
    { static const char *y[] = {"A\xc3\xa9", NULL}, *n[] = {"A", "Ae", NULL}; expect("\\x41\\u00e9", y, n); }
    { static const char *y[] = {"b", "\xc3\xa9", "\xe2\x82\xac", NULL}, *n[] = {"a", "\xe2\x82\xad", NULL};
      expect("[b\\u00e0-\\u00ff\\u20ac]", y, n); }
    /* anchors are accepted: the whole text matches anyway */
    { static const char *y[] = {"Hello", NULL}, *n[] = {"hello", "Hello!", NULL}; expect("^[A-Z][a-z]+$", y, n); }
    { static const char *y[] = {"ab", "cd", NULL}, *n[] = {"abcd", NULL}; expect("^ab$|^cd$", y, n); }
    /* ambiguous alternatives that may be empty, repeated: each call expands once per step
       (they ran out of the matcher's room for stacks) */
    { static const char *y[] = {"c", "ababbac", "aaaaaaaaaaaaaaac", NULL}, *n[] = {"", "abd", NULL};
      expect("(a?|b?){0,16}c", y, n); expect("x?(a*|b*){16}c", y, n); }
    { static const char *y[] = {"", NULL}, *n[] = {"a", NULL}; expect("(|){20}", y, n); }
    { static const char *y[] = {"x", "xx", "xxxxx", NULL}, *n[] = {"", NULL}; expect("x{1,}", y, n); }
    { static const char *y[] = {"ab", "abab", "", NULL}, *n[] = {"aba", NULL}; expect("(?:ab){0,2}", y, n); }
    { static const char *y[] = {"caf\xc3\xa9", NULL}, *n[] = {"cafe", NULL}; expect("caf\xc3\xa9", y, n); }
    /* lazy quantifiers match the texts the greedy ones do (vLLM's users write <think>.*?</think>;
       they were refused), named groups as plain groups, [\b] ECMA-262's backspace */
    { static const char *y[] = {"<t></t>", "<t>a</t>b</t>", NULL}, *n[] = {"<t>", "<t></t>x", NULL}; expect("<t>.*?</t>", y, n); }
    { static const char *y[] = {"a", "aaa", "c", "bc", NULL}, *n[] = {"", "aaaa", "b", NULL}; expect("a{1,3}?|b??c", y, n); }
    { static const char *y[] = {"2024-05", NULL}, *n[] = {"2024-5", NULL}; expect("(?<year>\\d{4})-(?<$m_1>\\d{2})", y, n); }
    { static const char *y[] = {"\b", "x", NULL}, *n[] = {"b", "\\", NULL}; expect("[\\bx]", y, n); }
    /* a NUL in the text, written \0 in the pattern */
    tl_compiled_grammar *g = regex("a\\0b");
    if (g) {
        CHECK(matches_n(g, "a\0b", 3) == 1, "/a\\0b/ should accept a NUL between a and b");
        CHECK(matches_n(g, "a0b", 3) == 0, "/a\\0b/ should reject \"a0b\"");
        tl_compiled_grammar_free(g);
    }
    /* the GBNF a pattern compiles to, for users who want to see or edit it */
    char *gbnf = NULL;
    size_t len = 0;
    CHECK(tl_regex_to_gbnf("[0-9]+|no", 9, &gbnf, &len) == TL_OK, "%s", tl_last_error());
    if (gbnf) {
        CHECK(len == strlen(gbnf) && strstr(gbnf, "root ::= ") == gbnf && strstr(gbnf, "[0-9]+"), "gbnf: %s", gbnf);
        tl_free(gbnf);
    }
}

/* ---------------------------------------------------------------- errors */

static void test_errors(void) {
    static const struct { const char *pattern, *needle; } bad[] = {
        {"(?=a)b", "lookahead"},
        {"ab\\", "ends in a '\\' that escapes nothing"}, /* (it said "escape '\?'") */
        {"[ab\\", "ends in a '\\' that escapes nothing"},
        /* each construct named (inline flags and comments were called lookaround) */
        {"(?<=a)b", "lookbehind"},
        {"(?!a)b", "lookahead"},
        {"(?i)abc", "inline flags"},
        {"(?#note)a", "comments"},
        {"a(?)", "a group '(?' that names no kind"},
        {"(?P<n>a)", "Python's (?P...) groups"},
        {"(?<1a>a)", "a named group is (?<name>...)"},
        {"(?<n a)", "a named group is (?<name>...)"},
        {"a\\1", "backreferences ('\\1')"},
        {"(?<n>a)\\k<n>", "named backreferences"},
        {"\\bword", "word boundaries ('\\b')"},
        {"a\\B", "word boundaries ('\\B')"},
        {"a++", "possessive quantifiers"},
        {"a{2}+", "possessive quantifiers"},
        {"*a", "'*' with nothing to repeat"},
        {"a**", "'*' with nothing to repeat"},
        {"(a", "expected ')'"},
        {"a)", "unexpected ')'"},
        {"[a", "unterminated '['"},
        {"[z-a]", "reversed range 'z-a'"},
        {"[\\d-z]", "a class range cannot start with '\\d'"},
        {"[\\S-z]", "a class range cannot start with '\\S'"},
        {"[a-\\W]", "a class range cannot end with '\\W'"},
        {"a{2", "bad quantifier"},
        {"a{1001}", "bad quantifier"},
        {"a{3,2}", "bad quantifier"},
        {"\\x4", "'\\x' needs 2 hex digits"},
        {"\\ud800", "surrogate"},
        {"\xff", "invalid UTF-8"},
        {"[\xc3]", "invalid UTF-8 in a class"},
        /* anchors where they would cut the language, never dropped (they matched "ab" once) */
        {"a^b", "'^' is supported only at the start"},
        {"b(^a)", "'^' is supported only at the start"},
        {"(^a)*", "'^' is supported only at the start"},
        {"a$b", "'$' is supported only at the end"},
        {"a(b$)?c", "'$' is supported only at the end"},
        {"x^", "'^' is supported only at the start"},
        /* quantifiers are digits only (these once read as a{2} and a{2,3}) */
        {"a{ 2}", "bad quantifier"},
        {"a{+2}", "bad quantifier"},
        {"a{2, 3}", "bad quantifier"},
        {"a{-0}", "bad quantifier"},
        {"a\\01", "'\\0' before a digit"},
        {"[\\01]", "'\\0' before a digit"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tl_compiled_grammar *g = NULL;
        const tl_status st = tl_grammar_compile_regex(bad[i].pattern, strlen(bad[i].pattern), &g);
        CHECK(st == TL_ERR_INVALID_ARGUMENT && g == NULL, "/%s/ should be refused", bad[i].pattern);
        CHECK(strstr(tl_last_error(), "regular expression: ") && strstr(tl_last_error(), bad[i].needle),
              "/%s/: \"%s\" should say \"%s\"", bad[i].pattern, tl_last_error(), bad[i].needle);
        tl_compiled_grammar_free(g);
    }
    /* repetitions past the grammar's size: the pattern's size, not "a TinyLoop bug" */
    char big[1024] = "";
    for (int i = 0; i < 100; i++) strcat(big, ".{1000}");
    tl_compiled_grammar *too_big = NULL;
    CHECK(tl_grammar_compile_regex(big, strlen(big), &too_big) == TL_ERR_INVALID_ARGUMENT && !too_big &&
              strstr(tl_last_error(), "regular expression: too large once its repetitions are expanded"),
          "100 x .{1000}: %s", tl_last_error());
    /* a NUL byte inside the pattern's length, a NULL pattern or out: refused, never read past */
    tl_compiled_grammar *g = NULL;
    CHECK(tl_grammar_compile_regex("a\0b", 3, &g) == TL_ERR_INVALID_ARGUMENT && strstr(tl_last_error(), "NUL"), "NUL in pattern");
    CHECK(tl_grammar_compile_regex(NULL, 0, &g) == TL_ERR_INVALID_ARGUMENT, "NULL pattern");
    CHECK(tl_grammar_compile_regex("a", 1, NULL) == TL_ERR_INVALID_ARGUMENT, "NULL out");
    CHECK(tl_regex_to_gbnf("a", 1, NULL, NULL) == TL_ERR_INVALID_ARGUMENT, "NULL gbnf");
    /* the length is honoured: "ab" cut to one byte is /a/ */
    g = NULL;
    CHECK(tl_grammar_compile_regex("ab", 1, &g) == TL_OK && g && matches(g, "a") == 1 && matches(g, "ab") == 0, "length");
    tl_compiled_grammar_free(g);
}

/* ---------------------------------------------------------------- against POSIX regex */

/* A random pattern of the syntax ECMA-262 and POSIX ERE read alike: literals over {a, b},
   '.', classes, groups, '|', * + ? {m,n}. */
static unsigned rng_state = 12345;
static unsigned rnd(unsigned n) {
    rng_state = rng_state * 1103515245u + 12345u;
    return (rng_state >> 16) % n;
}

static void random_alt(char *out, size_t cap, int depth);

static void random_atom(char *out, size_t cap, int depth) {
    static const char *const atoms[] = {"a", "b", ".", "[ab]", "[^a]", "[a-c]", "c"};
    const unsigned pick = rnd(depth < 3 ? 9 : 7);
    if (pick < 7) strncat(out, atoms[pick], cap - strlen(out) - 1);
    else {
        strncat(out, "(", cap - strlen(out) - 1);
        random_alt(out, cap, depth + 1);
        strncat(out, ")", cap - strlen(out) - 1);
    }
    static const char *const quantifiers[] = {"*", "+", "?", "{2}", "{0,2}", "{1,}"};
    if (rnd(3) == 0) strncat(out, quantifiers[rnd(6)], cap - strlen(out) - 1);
}

static void random_alt(char *out, size_t cap, int depth) {
    const unsigned n_alts = 1 + rnd(depth ? 2 : 3);
    for (unsigned a = 0; a < n_alts; a++) {
        if (a) strncat(out, "|", cap - strlen(out) - 1);
        const unsigned n_atoms = 1 + rnd(3);
        for (unsigned i = 0; i < n_atoms; i++) random_atom(out, cap, depth);
    }
}

static void test_against_posix(void) {
    int patterns = 0, compared = 0, disagreed = 0;
    for (int p = 0; p < 300; p++) {
        char pattern[512] = "";
        random_alt(pattern, sizeof pattern, 0);
        char anchored[600];
        snprintf(anchored, sizeof anchored, "^(%s)$", pattern);
        regex_t posix;
        if (regcomp(&posix, anchored, REG_EXTENDED | REG_NOSUB) != 0) continue; /* (ERE refuses a few, "a**") */
        tl_compiled_grammar *g = regex(pattern);
        if (!g) { regfree(&posix); continue; }
        patterns++;
        /* every text of up to 5 characters over {a, b, c, x} */
        char text[8];
        for (int len = 0; len <= 5; len++) {
            int total = 1;
            for (int i = 0; i < len; i++) total *= 4;
            for (int k = 0; k < total; k++) {
                int code = k;
                for (int i = 0; i < len; i++) { text[i] = "abcx"[code % 4]; code /= 4; }
                text[len] = 0;
                const int ours = matches(g, text);
                const int theirs = regexec(&posix, text, 0, NULL, 0) == 0;
                compared++;
                if (ours != theirs && disagreed++ < 5)
                    CHECK(0, "/%s/ on \"%s\": TinyLoop %d, POSIX regexec %d", pattern, text, ours, theirs);
            }
        }
        tl_compiled_grammar_free(g);
        regfree(&posix);
    }
    CHECK(patterns >= 250 && disagreed == 0, "%d patterns, %d texts compared, %d disagreements", patterns, compared, disagreed);
    printf("regex vs POSIX: %d patterns, %d texts, %d disagreements\n", patterns, compared, disagreed);
}

/* ---------------------------------------------------------------- generation */

static void test_generation(tl_model *m) {
    /* each pattern and its POSIX spelling (ERE has no \\n: a newline stands for itself) */
    static const char *const patterns[][2] = {
        {"[0-9]{3}-[0-9]{4}", "[0-9]{3}-[0-9]{4}"},
        {"(Emma|Harriet|Mr\\. Knightley) (is|was) [a-z]{2,10}\\.", "(Emma|Harriet|Mr\\. Knightley) (is|was) [a-z]{2,10}\\."},
        {"[A-Z][a-z]+( [a-z]+){0,4}[.!?]\\n", "[A-Z][a-z]+( [a-z]+){0,4}[.!?]\n"},
        {"([A-Za-z]*,? ?)+[.!?]", "([A-Za-z]*,? ?)+[.!?]"}, /* a repeated item that may be empty */
    };
    for (size_t i = 0; i < sizeof patterns / sizeof patterns[0]; i++) {
        tl_compiled_grammar *g = regex(patterns[i][0]);
        if (!g) continue;
        char anchored[256];
        snprintf(anchored, sizeof anchored, "^(%s)$", patterns[i][1]);
        regex_t posix;
        CHECK(regcomp(&posix, anchored, REG_EXTENDED | REG_NOSUB) == 0, "regcomp %s", anchored);
        int32_t *prompt = NULL;
        int prompt_len = 0;
        CHECK(tl_encode(m, "It is a truth", 13, &prompt, &prompt_len) == TL_OK, "encode: %s", tl_last_error());
        for (int seed = 1; seed <= 8 && prompt; seed++) {
            tl_generate_config cfg;
            tl_generate_config_init(&cfg);
            cfg.max_tokens = 64;
            cfg.temperature = 1.0f;
            cfg.sample_seed = (uint64_t)seed;
            tl_grammar use;
            tl_grammar_use(&use, g);
            cfg.grammar = &use;
            int32_t out[256];
            int out_len = 0;
            tl_generate_stats stats;
            const tl_status st = tl_generate(m, prompt, prompt_len, &cfg, out, 256, &out_len, &stats);
            CHECK(st == TL_OK, "generate /%s/ seed %d: %s", patterns[i][0], seed, tl_last_error());
            if (st != TL_OK) continue;
            /* the end of the sequence comes where the pattern lets the text end, and only there */
            CHECK(stats.stop_reason == TL_STOP_EOS, "/%s/ seed %d: ended by %d, not at the pattern's end", patterns[i][0], seed,
                  (int)stats.stop_reason);
            char *text = NULL;
            size_t len = 0;
            const int n_new = out_len - prompt_len - (stats.stop_reason == TL_STOP_EOS);
            CHECK(tl_decode(m, out + prompt_len, n_new, &text, &len) == TL_OK, "decode: %s", tl_last_error());
            if (!text) continue;
            CHECK(matches(g, text) == 1 && regexec(&posix, text, 0, NULL, 0) == 0, "/%s/ seed %d: \"%s\" does not match",
                  patterns[i][0], seed, text);
            tl_free(text);
        }
        tl_free(prompt);
        regfree(&posix);
        tl_compiled_grammar_free(g);
    }
}

int main(int argc, char **argv) {
    const char *root_dir = argc > 1 ? argv[1] : ".";
    test_tables();
    test_errors();
    test_against_posix();
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/tinyloop-austen", root_dir);
    tl_model *m = NULL;
    tl_load_options opts;
    tl_load_options_init(&opts);
    opts.n_threads = 1;
    if (tl_model_load(dir, &opts, &m) == TL_OK) {
        test_generation(m);
        tl_model_free(m);
    } else CHECK(0, "load %s: %s", dir, tl_last_error());
    return check_summary();
}

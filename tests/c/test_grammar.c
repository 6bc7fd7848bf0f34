/* test_grammar.c: GBNF parsing (valid and invalid, messages checked), the matcher on llama.cpp's
 * and the shipped grammars, masks against a brute-force check, JSON Schema conversion, and
 * generation: 200 seeded JSON samples parse, schema samples validate, greedy speculative
 * (chain and tree) under a grammar equals plain decoding.
 *   test_grammar SOURCE_DIR */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "grammar.h"
#include "strbuf.h"
#include "tinyloop.h"
#include "tokenizer.h"

static const char *root_dir;

static char *slurp(const char *rel, size_t *len) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", root_dir, rel);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    size_t got = fread(buf, 1, (size_t)n, f);
    fclose(f);
    buf[got] = 0;
    if (len) *len = got;
    return buf;
}

static tl_compiled_grammar *load_grammar(const char *rel) {
    size_t len;
    char *text = slurp(rel, &len);
    CHECK(text != NULL, "cannot read %s", rel);
    if (!text) return NULL;
    tl_compiled_grammar *g = NULL;
    tl_status st = tl_grammar_compile_gbnf(text, len, &g);
    CHECK(st == TL_OK, "%s: %s", rel, tl_last_error());
    free(text);
    return g;
}

static tl_compiled_grammar *compile(const char *text) {
    tl_compiled_grammar *g = NULL;
    tl_status st = tl_grammar_compile_gbnf(text, strlen(text), &g);
    CHECK(st == TL_OK, "compile \"%s\": %s", text, tl_last_error());
    return g;
}

static int matches(const tl_compiled_grammar *g, const char *text) {
    int m = -1;
    tl_status st = tl_grammar_matches(g, text, strlen(text), &m);
    CHECK(st == TL_OK, "matches: %s", tl_last_error());
    return m;
}

static void expect(const tl_compiled_grammar *g, const char *name, const char *const *yes, const char *const *no) {
    if (!g) return;
    for (; *yes; yes++) CHECK(matches(g, *yes) == 1, "%s should accept \"%s\"", name, *yes);
    for (; *no; no++) CHECK(matches(g, *no) == 0, "%s should reject \"%s\"", name, *no);
}

/* ---------------------------------------------------------------- parser */

static void test_parse_errors(void) {
    static const struct { const char *text, *needle; } cases[] = {
        {"", "empty grammar"},
        {"# only a comment\n", "empty grammar"},
        {"root ::= foo", "line 1, column 10: undefined rule 'foo'"},
        {"root ::= \"a\" | bar\n", "undefined rule 'bar'"},
        {"root ::= root \"a\"", "rule 'root' is left-recursive"},
        {"root ::= a\na ::= b a \"x\" | \"y\"\nb ::= \"z\"?", "is left-recursive"},
        /* a cycle of tail calls among rules that derive nothing only recurs */
        {"root ::= r\nr ::= r", "rule 'r' is left-recursive: r -> r"},
        /* a self-edge on the cycle's path is named once (the path once wrote past its array) */
        {"root ::= a\na ::= a \"x\" | root", "left-recursive: root -> a -> root"},
        {"root ::= a\na ::= \"x\"? b\nb ::= a", "is left-recursive"},
        /* a nullable item repeated, then a call that pushes a frame: still expands forever */
        {"root ::= a \"x\"\na ::= (\"y\"?)* a \"z\" | \"w\"", "is left-recursive"},
        {"root ::= [a-", "line 1, column 10: unterminated character class: expected ']' (in rule 'root')"},
        {"root ::= ok\nok ::= \"abc", "line 2, column 8: unterminated string literal"},
        /* a lone CR ends a line in the positions too, as in the parser (all was line 1) */
        {"root ::= \"a\"\rx ::= \"\\q\"", "line 2, column 8: unknown escape '\\q'"},
        {"root ::= \"a\"\r\nx ::= \"\\q\"", "line 2, column 8: unknown escape '\\q'"},
        {"root ::= ok\nok ::= \"abc", "(in rule 'ok')"},
        {"root = \"a\"", "line 1, column 6: expected '::=' after rule name 'root'"},
        {"root ::= \"a\" )", "unexpected ')'"},
        {"root ::= (\"a\"", "expected ')' to close '('"},
        {"a ::= \"x\"", "no rule named 'root'"},
        {"root ::= \"\\q\"", "unknown escape '\\q'"},
        {"root ::= \"a\"{3,1}", "n < m"},
        {"root ::= \"a\"{3,2}", "n < m"}, /* (n = m - 1: the bound itself) */
        {"root ::= \"a\"{2", "expected '}'"},
        {"root ::= \"a\"{99999}", "repetition count above 10000"},
        {"root ::= x\nx ::= \"a\"\nx ::= \"b\"", "rule 'x' is defined twice (first at line 2, column 1)"},
        {"root ::= [z-a]", "reversed"},
        /* (llama.cpp's parser adds nothing for them: "x" [] "y" matched xy there, nothing here) */
        {"root ::= \"x\" [] \"y\"", "line 1, column 14: an empty class []: it matches no character"},
        {"root ::= \"x\" [^] \"y\"", "an empty class [^]: write . for any one character"},
        {"root ::= \"\\q\"", "or \\ before one of \\ \" [ ] - ^ / ' . * + ? ( ) { } |)"},
        {"root ::= \"\\xZZ\"", "expected a hex digit"},
        {"root ::= \"a\" @", "unexpected '@'"},
        {"root ::= \"a\" b ::= \"c\"", "must start on its own line"},
        {"root ::= \"\\U00110000\"", "beyond U+10FFFF"},
        /* raw text is strict UTF-8, as the escapes are: an overlong NUL, a code point past
           U+10FFFF, a surrogate, a lone continuation byte, a sequence cut short */
        {"root ::= \"a\xc0\x80\"", "line 1, column 12: invalid UTF-8 in a string literal"},
        {"root ::= [a-\xf7\xbf\xbf\xbf]", "invalid UTF-8"},
        {"root ::= [a-\xf4\x90\x80\x80]", "invalid UTF-8"},
        {"root ::= \"\xed\xa0\x80\"", "invalid UTF-8"},
        {"root ::= \"\x80\"", "invalid UTF-8"},
        {"root ::= \"\xe2\x82", "invalid UTF-8"},
        /* token references */
        {"root ::= <[x]>", "line 1, column 12: expected a token id in '<[id]>'"},
        {"root ::= <[5]", "expected ']>' to close '<[id]>'"},
        {"root ::= <[99999999999]>", "token id past 2^31 - 1"},
        {"root ::= <think", "line 1, column 10: unterminated token reference: expected '>'"},
        {"root ::= <think\n>", "unterminated token reference"},
        {"root ::= <>", "an empty token reference '<>'"},
        {"root ::= !\"a\"", "expected '<' after '!'"},
        {"root ::= <\xff>", "invalid UTF-8 in a token reference"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        tl_compiled_grammar *g = (tl_compiled_grammar *)1;
        CHECK_ERROR(tl_grammar_compile_gbnf(cases[i].text, strlen(cases[i].text), &g), TL_ERR_INVALID_ARGUMENT,
                    cases[i].needle);
        CHECK(g == NULL, "out is NULL on failure");
    }
    /* success clears the thread's error */
    tl_compiled_grammar *g = compile("root ::= \"a\"");
    CHECK(strcmp(tl_last_error(), "") == 0, "error cleared: \"%s\"", tl_last_error());
    tl_compiled_grammar_free(g);
    CHECK_ERROR(tl_grammar_compile_gbnf("x", 1, NULL), TL_ERR_INVALID_ARGUMENT, "out must not be NULL");
}

static void test_dialect(void) {
    tl_compiled_grammar *g = compile("root ::= \"a\"{2} \"b\"{1,3} \"c\"{2,} \"d\"? (\"ef\")* \"g\"+");
    static const char *y1[] = {"aabccg", "aabbbcccdefefgg", "aabccdg", NULL};
    static const char *n1[] = {"abccg", "aabbbbccg", "aabcg", "aabccgx", "", NULL};
    expect(g, "repeat", y1, n1);
    tl_compiled_grammar_free(g);
    /* escapes, classes, negation, '.', comments, multi-line alternatives */
    g = compile("# comment\nroot ::= \"\\x41\\u00e9\\U0001F600\\t\\n\\\\\\\"\" [^a-c] . [\\u0100-\\u0200] | # tail\n"
                "  \"alt\"   ( \"x\" |\n \"y\" )\n");
    static const char *y2[] = {"A\xc3\xa9\xf0\x9f\x98\x80\t\n\\\"d\xe4\xb8\x80\xc4\x80", "altx", "alty", NULL};
    static const char *n2[] = {"A\xc3\xa9\xf0\x9f\x98\x80\t\n\\\"a\xe4\xb8\x80\xc4\x80", "altz", "alt", NULL};
    expect(g, "escapes", y2, n2);
    tl_compiled_grammar_free(g);
    /* nullable rules, tail recursion, deep nesting */
    g = compile("root ::= e\ne ::= \"(\" e \")\" e | \"\"");
    static const char *y3[] = {"", "()", "(())()", "((((((((((()))))))))))", NULL};
    static const char *n3[] = {"(", ")(", "(()", NULL};
    expect(g, "parens", y3, n3);
    tl_compiled_grammar_free(g);
    /* fuzzer findings: x{0} followed by another postfix; an empty literal repeated */
    g = compile("root ::= \"\"{0}{5} \"a\"{0}{3} \"b\"");
    static const char *y4[] = {"b", NULL};
    static const char *n4[] = {"ab", "", NULL};
    expect(g, "x{0}", y4, n4);
    tl_compiled_grammar_free(g);
    /* A second postfix applies to everything the first made, as in llama.cpp: "a"+? is
       ("a"+)? (it refused ""), "a"{2}* is ("aa")* (it took "a" and "aaa"); and a postfix may
       follow spaces ("x *" was "unexpected '*'"). */
    g = compile("root ::= \"a\"+? \"b\"");
    static const char *y5[] = {"b", "ab", "aaab", NULL};
    static const char *n5[] = {"", "a", NULL};
    expect(g, "+?", y5, n5);
    tl_compiled_grammar_free(g);
    g = compile("root ::= \"a\"{2}* \"b\"");
    static const char *y6[] = {"b", "aab", "aaaab", NULL};
    static const char *n6[] = {"ab", "aaab", NULL};
    expect(g, "{2}*", y6, n6);
    tl_compiled_grammar_free(g);
    /* A repeated item that may be empty (("a"?)*, what a regular expression's (a?)* becomes):
       a cycle of tail calls, which the matcher expands once per step (it was refused as
       left-recursive, though it comes back to the same stack) */
    g = compile("root ::= (\"a\"? \"b\"?)* \"c\" | x\nx ::= \"d\"? x | \"e\"");
    static const char *y8[] = {"c", "abc", "bbac", "aaaabbbc", "e", "dde", NULL};
    static const char *n8[] = {"", "ab", "ca", "d", "ded", NULL};
    expect(g, "nullable repeat", y8, n8);
    tl_compiled_grammar_free(g);
    /* calls of rules that match only the empty string are dropped (a chain of 720 of them
       was walked again at every call: a regular expression's ((?:){5,720}|x?){5,720} took 2 s
       for 56 bytes); what the grammar matches is the same, the empty-only root and star too */
    g = compile("root ::= ((\"\"){5,720} | [^\"]?){5,720} \"!\" | e* \"?\" e\ne ::= (\"\" (\"\"){2})?");
    static const char *y9[] = {"!", "abc!", "?", "a b c d e f g h!", NULL};
    static const char *n9[] = {"", "a\"!", "a?", "\"!", "??", NULL};
    expect(g, "empty-only calls", y9, n9);
    tl_compiled_grammar_free(g);
    g = compile("root ::= \"ab\" * [x-z] + ( \"c\" ) ?\t{1,2}");
    static const char *y7[] = {"x", "ababyz", "abxc", "xcc", NULL};
    static const char *n7[] = {"", "ab", "xccc", NULL};
    expect(g, "spaces", y7, n7);
    tl_compiled_grammar_free(g);
    /* as llama.cpp reads them (both were refused): a line end inside a string literal is a
       character of it, and inside parentheses line ends may stand within '{m,n}' */
    g = compile("root ::= \"a\nb\" (\"c\"{\n1,\n2\n})");
    static const char *y_lines[] = {"a\nbc", "a\nbcc", NULL};
    static const char *n_lines[] = {"abc", "a\nb", "a\nbccc", NULL};
    expect(g, "line ends", y_lines, n_lines);
    tl_compiled_grammar_free(g);
}

static void test_llama_grammars(void) {
    static const char *names[] = {"arithmetic", "c", "chess", "english", "japanese", "json", "json_arr", "list"};
    tl_compiled_grammar *gs[8] = {0};
    for (int i = 0; i < 8; i++) {
        char rel[256];
        snprintf(rel, sizeof rel, "tests/data/grammars/llama.cpp/%s.gbnf", names[i]);
        gs[i] = load_grammar(rel);
    }
    static const char *ar_y[] = {"x=1\n", "a+b*(c-1)=foo\n", "(x) = 42\ny/2=z\n", NULL};
    static const char *ar_n[] = {"x=1", "=1\n", "a+=1\n", "1=(2\n", NULL};
    expect(gs[0], "arithmetic", ar_y, ar_n);
    static const char *c_y[] = {"", "int main(){return 0;}", "int f(int x){x = x+1;if(x<3){return x;}else{return 0;}}",
                                "char g(){/* c */while(a<b){a = a*2;}}", NULL};
    static const char *c_n[] = {"int main(", "int main(){return 0}", "main(){}", "int f(){x=;}", NULL};
    expect(gs[1], "c", c_y, c_n);
    static const char *ch_y[] = {"1. e4 e5\n2. Nf3 Nc6\n", "1. d4 d5\n2. c4 dxc4\n3. O-O Qxd8+\n", NULL};
    static const char *ch_n[] = {"1. e4 e5\n", "1. e9 e5\n2. a1 a2\n", NULL};
    expect(gs[2], "chess", ch_y, ch_n);
    static const char *js_y[] = {"{}", "{\"a\": 1}", "{\"a\":[1, -2, \"x\", {\"b\": true}], \"c\": \"\\u00e9\\n\"}", NULL};
    static const char *js_n[] = {"[]", "{\"a\" 1}", "{\"a\": 1,}", "{\"a\": 1.5}", "{'a': 1}", "{\"a\": tru}", NULL};
    expect(gs[5], "json", js_y, js_n);
    static const char *li_y[] = {"- one\n", "- one\n- two \xe2\x82\xac\n", NULL};
    static const char *li_n[] = {"", "- \n", "- one", "* one\n", "- a\xe2\x80\xa8" "b\n", NULL};
    expect(gs[7], "list", li_y, li_n);
    static const char *jp_y[] = {"\xe3\x81\x82\xe3\x82\xa2", NULL};
    static const char *jp_n[] = {"abc", NULL};
    expect(gs[4], "japanese", jp_y, jp_n);
    for (int i = 0; i < 8; i++) tl_compiled_grammar_free(gs[i]);
}

static void test_shipped_grammars(void) {
    tl_compiled_grammar *g = load_grammar("lua/tinyloop/grammars/json.gbnf");
    /* blanks: pretty-printed with an indent of 4 five levels deep (17 blanks and more after
       a line break were refused), CRLF line ends; bounded (a model cannot spend its budget
       on them: 21 blanks of indentation, three line breaks, two blanks in a line) */
    static const char *j_y[] = {"{}", " [1, 2.5e-3, \"x\", null, true, {\"k\": []}] ", "\"str\\u0041\"", "-0.5", "0",
                                "[\n    [\n        [\n            [\n                [\n                    1\n"
                                "                ]\n            ]\n        ]\n    ]\n]",
                                "{\r\n  \"a\": 1\r\n}", "[1, \n\n  2]", NULL};
    static const char *j_n[] = {"", "{", "01", "[1,]", "{\"a\":}", "\"\x01\"", "nul", "1.",
                                "[1,\n                     2]", "[1,\n\n\n2]", "[1,  2]", NULL};
    expect(g, "json", j_y, j_n);
    tl_compiled_grammar_free(g);
    g = load_grammar("lua/tinyloop/grammars/json_array_of_strings.gbnf");
    static const char *a_y[] = {"[]", "[\"a\"]", "[\"a\", \"b\\\"\",\"\"]", NULL};
    static const char *a_n[] = {"[1]", "[\"a\",]", "[\"a\" \"b\"]", "\"a\"", NULL};
    expect(g, "json_array_of_strings", a_y, a_n);
    tl_compiled_grammar_free(g);
    g = load_grammar("lua/tinyloop/grammars/arithmetic.gbnf");
    static const char *m_y[] = {"1", "1 + 2 * (x - 3.5) / -y", "(((a)))", NULL};
    static const char *m_n[] = {"", "1 +", "(1", "1 2", "3.", NULL};
    expect(g, "arithmetic", m_y, m_n);
    tl_compiled_grammar_free(g);
    g = load_grammar("lua/tinyloop/grammars/list.gbnf");
    static const char *l_y[] = {"- a\n", "- a\n- b c\n", NULL};
    static const char *l_n[] = {"", "- a", "-a\n", "- \n", NULL};
    expect(g, "list", l_y, l_n);
    tl_compiled_grammar_free(g);
    g = load_grammar("lua/tinyloop/grammars/yes_no.gbnf");
    static const char *y_y[] = {"yes", " No.", "Yes.", NULL};
    static const char *y_n[] = {"", "maybe", "yes!", "YES", NULL};
    expect(g, "yes_no", y_y, y_n);
    tl_compiled_grammar_free(g);
}

/* ---------------------------------------------------------------- JSON Schema */

static tl_compiled_grammar *schema(const char *json) {
    tl_compiled_grammar *g = NULL;
    tl_status st = tl_grammar_compile_json_schema(json, strlen(json), NULL, &g);
    CHECK(st == TL_OK, "schema %s: %s", json, tl_last_error());
    return g;
}

/* anyOf branches that begin alike (the same first property), under recursion: each level
   doubles the parses a byte leads to, and past the matcher's limit the error says so (it said
   "out of memory"), as a clear refusal of this grammar, not of the machine. */
static void test_too_ambiguous(void) {
    tl_compiled_grammar *g = schema("{\"$defs\":{\"n\":{\"anyOf\":[{\"type\":\"null\"},"
        "{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/$defs/n\"}},\"required\":[\"a\"]},"
        "{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/$defs/n\"},\"b\":{\"type\":\"integer\"}},"
        "\"required\":[\"a\",\"b\"]}]}},\"$ref\":\"#/$defs/n\"}");
    if (!g) return;
    char doc[256] = "";
    for (int depth = 0; depth < 4; depth++) strcat(doc, "{\"a\":");
    strcat(doc, "null}}}}");
    CHECK(matches(g, doc) == 1, "4 levels: %s", doc);
    doc[0] = 0;
    for (int depth = 0; depth < 20; depth++) strcat(doc, "{\"a\":");
    int match = -1;
    CHECK_ERROR(tl_grammar_matches(g, doc, strlen(doc), &match), TL_ERR_UNSUPPORTED,
                "tl_grammar_matches: the grammar is too ambiguous here: more than 65536 parses at one point");
    CHECK(matches(g, "null") == 1, "the grammar serves on after the refusal");
    tl_compiled_grammar_free(g);
    /* repetitions of what may be empty, 16 deep: x{2,} is x* then (x x x* with x nullable), and
       x{1,3}, which stays ambiguous, is refused by name when the grammar starts (it said "out of
       memory", and a later real out of memory on the thread said "too ambiguous") */
    for (int bounded = 0; bounded < 2; bounded++) {
        char text[512] = "root ::= ";
        for (int depth = 0; depth < 16; depth++) strcat(text, "(");
        strcat(text, "\"a\"?");
        for (int depth = 0; depth < 16; depth++) strcat(text, bounded ? "){1,3}" : "){2,}");
        strcat(text, " \"b\"");
        if (!bounded) {
            g = compile(text);
            CHECK(g && matches(g, "aab") == 1 && matches(g, "b") == 1 && matches(g, "ba") == 0, "%s", text);
            tl_compiled_grammar_free(g);
        } else CHECK_ERROR(tl_grammar_compile_gbnf(text, strlen(text), &g), TL_ERR_UNSUPPORTED,
                           "grammar: the grammar is too ambiguous here");
    }
    g = compile("root ::= [a-z]+");
    CHECK(g && matches(g, "abc") == 1, "a grammar after the refusal");
    tl_compiled_grammar_free(g);
}

/* What generators other than JSON Schema's own write (each was refused, strict and loose): OpenAPI's
   "nullable" (smolagents' optional tool inputs), "x-" keys, "example" and Pydantic's
   "discriminator"; a "type" beside a combinator (a tool's parameters as a union of objects);
   draft-07's tuples (zod-to-json-schema's z.tuple); and $ref chains longer than the nesting
   limit (22 Pydantic models each holding the next were "nested more than 64 levels"). */
static void test_openapi_and_generators(void) {
    tl_json_schema_options loose = {.loose = 1};
    tl_compiled_grammar *g = NULL;
    for (int strict = 0; strict < 2; strict++) {
        const char *nullable = "{\"type\":\"object\",\"properties\":{\"q\":{\"type\":\"string\"},\"year\":{\"type\":"
                               "\"integer\",\"nullable\":true,\"x-order\":1,\"example\":2020}},\"required\":[\"q\",\"year\"]}";
        g = NULL;
        CHECK(tl_grammar_compile_json_schema(nullable, strlen(nullable), strict ? NULL : &loose, &g) == TL_OK,
              "nullable (%s): %s", strict ? "strict" : "loose", tl_last_error());
        static const char *ny[] = {"{\"q\":\"a\",\"year\":null}", "{\"q\":\"a\",\"year\":1999}", NULL};
        static const char *nn[] = {"{\"q\":null,\"year\":1}", "{\"q\":\"a\",\"year\":\"x\"}", NULL};
        expect(g, "nullable", ny, nn);
        tl_compiled_grammar_free(g);
    }
    g = schema("{\"enum\":[\"a\",\"b\"],\"nullable\":true}");
    static const char *ey[] = {"\"a\"", "null", NULL};
    static const char *en[] = {"\"c\"", NULL};
    expect(g, "nullable enum", ey, en);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"string\",\"nullable\":false}");
    static const char *fy[] = {"\"a\"", NULL};
    static const char *fn[] = {"null", NULL};
    expect(g, "nullable false", fy, fn);
    tl_compiled_grammar_free(g);
    /* a $ref made nullable: its target's values and null */
    g = schema("{\"$defs\":{\"p\":{\"type\":\"integer\"}},\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/p\",\"nullable\":true}}");
    static const char *ry[] = {"[1,null]", NULL};
    static const char *rn[] = {"[\"x\"]", NULL};
    expect(g, "nullable $ref", ry, rn);
    tl_compiled_grammar_free(g);
    /* allOf: null where every branch is nullable (the merge), not where one is not */
    g = schema("{\"allOf\":[{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"nullable\":true},"
               "{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"integer\"}},\"nullable\":true}]}");
    static const char *ay2[] = {"null", "{\"a\":1,\"b\":2}", NULL};
    static const char *an2[] = {"1", NULL};
    expect(g, "allOf of nullable branches", ay2, an2);
    tl_compiled_grammar_free(g);
    g = schema("{\"allOf\":[{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"nullable\":true},"
               "{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"integer\"}}}]}");
    static const char *ay3[] = {"{\"a\":1,\"b\":2}", NULL};
    static const char *an3[] = {"null", NULL};
    expect(g, "allOf of one nullable branch", ay3, an3);
    tl_compiled_grammar_free(g);
    /* oneOf: null is in both branches, or in one and the other's const: they meet */
    static const char *const meet[] = {
        "{\"oneOf\":[{\"type\":\"string\",\"nullable\":true},{\"type\":\"integer\",\"nullable\":true}]}",
        "{\"oneOf\":[{\"enum\":[\"a\"],\"nullable\":true},{\"const\":null}]}",
        "{\"$defs\":{\"s\":{\"type\":\"string\"}},\"oneOf\":[{\"$ref\":\"#/$defs/s\",\"nullable\":true},{\"type\":\"null\"}]}"};
    for (size_t i = 0; i < sizeof meet / sizeof meet[0]; i++) {
        g = NULL;
        CHECK(tl_grammar_compile_json_schema(meet[i], strlen(meet[i]), NULL, &g) == TL_ERR_INVALID_ARGUMENT &&
                  strstr(tl_last_error(), "may match both branch 0 and branch 1"),
              "oneOf of nullable branches that meet: %s", g ? "compiled" : tl_last_error());
        tl_compiled_grammar_free(g);
    }
    const char *bad_nullable = "{\"type\":\"string\",\"nullable\":1}";
    g = NULL;
    CHECK(tl_grammar_compile_json_schema(bad_nullable, strlen(bad_nullable), NULL, &g) == TL_ERR_INVALID_ARGUMENT &&
              strstr(tl_last_error(), "'nullable' must be true or false"), "nullable 1: %s", tl_last_error());
    /* Pydantic's discriminated union: the discriminator is an annotation, the consts tell apart */
    g = schema("{\"$defs\":{\"Cat\":{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":\"cat\",\"type\":\"string\"}},"
               "\"required\":[\"kind\"]},\"Dog\":{\"type\":\"object\",\"properties\":{\"kind\":{\"const\":\"dog\","
               "\"type\":\"string\"}},\"required\":[\"kind\"]}},\"oneOf\":[{\"$ref\":\"#/$defs/Cat\"},{\"$ref\":\"#/$defs/Dog\"}],"
               "\"discriminator\":{\"propertyName\":\"kind\",\"mapping\":{\"cat\":\"#/$defs/Cat\",\"dog\":\"#/$defs/Dog\"}}}");
    static const char *dy[] = {"{\"kind\":\"cat\"}", "{\"kind\":\"dog\"}", NULL};
    static const char *dn[] = {"{\"kind\":\"cow\"}", NULL};
    expect(g, "discriminator", dy, dn);
    tl_compiled_grammar_free(g);
    /* "type" beside a combinator: taken where every branch is of it */
    const char *union_of_objects = "{\"type\":\"object\",\"anyOf\":[{\"properties\":{\"a\":{\"type\":\"integer\"}},"
                                   "\"required\":[\"a\"]},{\"properties\":{\"b\":{\"type\":\"string\"}},\"required\":[\"b\"]}]}";
    g = schema(union_of_objects);
    static const char *uy[] = {"{\"a\":1}", "{\"b\":\"x\"}", NULL};
    static const char *un[] = {"{\"a\":\"x\"}", "1", NULL};
    expect(g, "type beside anyOf", uy, un);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"object\",\"allOf\":[{\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]},"
               "{\"properties\":{\"b\":{\"type\":\"integer\"}},\"required\":[\"b\"]}]}");
    static const char *ay[] = {"{\"a\":1,\"b\":2}", NULL};
    static const char *an[] = {"{\"a\":1}", NULL};
    expect(g, "type beside allOf", ay, an);
    tl_compiled_grammar_free(g);
    const char *mixed = "{\"type\":\"string\",\"oneOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}";
    g = NULL;
    CHECK(tl_grammar_compile_json_schema(mixed, strlen(mixed), NULL, &g) == TL_ERR_INVALID_ARGUMENT &&
              strstr(tl_last_error(), "'type' beside 'oneOf' is supported only where each branch is of that type, and branch 1"),
          "type beside a branch of another type: %s", tl_last_error());
    CHECK(tl_grammar_compile_json_schema(mixed, strlen(mixed), &loose, &g) == TL_OK, "loose leaves the oneOf out: %s",
          tl_last_error());
    tl_compiled_grammar_free(g);
    /* loosely the type stays and the combinator goes (it only narrows the type's values):
       leaving the type out wrote the branches' own types, which the type refuses, so that
       {"type": "string", "anyOf": [{"minimum": 0}]} took numbers alone, none of them valid */
    static const char *const typed_beside[] = {
        "{\"type\":\"string\",\"oneOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}",
        "{\"type\":\"string\",\"anyOf\":[{\"minimum\":0}]}",
        "{\"type\":\"string\",\"allOf\":[{\"minimum\":0},{\"maxLength\":3}]}",
        "{\"type\":\"string\",\"anyOf\":[{\"properties\":{\"a\":{\"type\":\"integer\"}}}]}",
        /* (a root's $id stays the root's: the copy without the combinator read it as one below) */
        "{\"$id\":\"https://x/s\",\"type\":\"string\",\"anyOf\":[{\"minimum\":0}]}",
    };
    for (size_t i = 0; i < sizeof typed_beside / sizeof typed_beside[0]; i++) {
        g = NULL;
        CHECK(tl_grammar_compile_json_schema(typed_beside[i], strlen(typed_beside[i]), &loose, &g) == TL_OK, "loose %s: %s",
              typed_beside[i], tl_last_error());
        int string_in = 0, number_in = 1, object_in = 1;
        tl_grammar_matches(g, "\"x\"", 3, &string_in);
        tl_grammar_matches(g, "5", 1, &number_in);
        tl_grammar_matches(g, "{\"a\":1}", 7, &object_in);
        CHECK(string_in == 1 && number_in == 0 && object_in == 0, "loose %s: \"x\" %d, 5 %d, {\"a\":1} %d", typed_beside[i],
              string_in, number_in, object_in);
        tl_compiled_grammar_free(g);
    }
    /* the combinator left out is still read: a fault in a branch is named, as elsewhere */
    static const struct { const char *schema, *needle; } dropped_faults[] = {
        {"{\"type\":\"string\",\"anyOf\":[{\"$ref\":\"#/$defs/missing\"}]}", "points nowhere"},
        {"{\"type\":\"string\",\"oneOf\":[{\"type\":\"bogus\"}]}", "unknown type 'bogus'"},
    };
    for (size_t i = 0; i < sizeof dropped_faults / sizeof dropped_faults[0]; i++) {
        g = NULL;
        CHECK(tl_grammar_compile_json_schema(dropped_faults[i].schema, strlen(dropped_faults[i].schema), &loose, &g) ==
                      TL_ERR_INVALID_ARGUMENT &&
                  strstr(tl_last_error(), dropped_faults[i].needle),
              "loose %s: %s", dropped_faults[i].schema, tl_last_error());
        tl_compiled_grammar_free(g);
    }
    /* where every branch is of the type, both apply, loosely too */
    const char *typed_both = "{\"type\":\"object\",\"anyOf\":[{\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]}]}";
    g = NULL;
    CHECK(tl_grammar_compile_json_schema(typed_both, strlen(typed_both), &loose, &g) == TL_OK, "loose %s: %s", typed_both,
          tl_last_error());
    int object_in = 0, other_in = 1;
    tl_grammar_matches(g, "{\"a\":1}", 7, &object_in);
    tl_grammar_matches(g, "{\"b\":1}", 7, &other_in);
    CHECK(object_in == 1 && other_in == 0, "loose %s: %d %d", typed_both, object_in, other_in);
    tl_compiled_grammar_free(g);
    /* a schema without a "type" whose keywords are one type's writes that type, strict and
       loose (llama.cpp's reading; JSON Schema lets other values through, which the grammar
       need not write): {"format": "date"} was refused in strict mode and any value loosely */
    static const struct { const char *schema, *in, *out; } narrowed[] = {
        {"{\"minLength\":2}", "\"ab\"", "5"},
        /* bounds that meet: a length of exactly 3; minimum 5 with exclusiveMinimum 5 is above 5 */
        {"{\"type\":\"string\",\"minLength\":3,\"maxLength\":3}", "\"abc\"", "\"ab\""},
        {"{\"type\":\"integer\",\"minimum\":5,\"exclusiveMinimum\":5}", "6", "5"},
        {"{\"format\":\"date\",\"description\":\"d\"}", "\"2024-02-29\"", "\"x\""},
        {"{\"pattern\":\"^a+$\"}", "\"aa\"", "true"},
        {"{\"minimum\":0,\"exclusiveMaximum\":5}", "4.5", "5"},
        {"{\"minimum\":0,\"exclusiveMaximum\":5}", "0", "\"a\""},
        {"{\"multipleOf\":1}", "-3", "2.5"},
        {"{\"maxItems\":1}", "[1]", "[1,2]"},
        {"{\"required\":[\"a\"]}", "{\"a\":[]}", "{}"},
        {"{\"properties\":{\"a\":{\"type\":\"integer\"}},\"minProperties\":1}", "{\"a\":1}", "{\"a\":\"x\"}"},
    };
    for (size_t i = 0; i < sizeof narrowed / sizeof narrowed[0]; i++)
        for (int strict = 0; strict < 2; strict++) {
            const char *schema = narrowed[i].schema;
            if (strict && strstr(schema, "minProperties")) continue; /* (a keyword strict mode refuses) */
            g = NULL;
            CHECK(tl_grammar_compile_json_schema(schema, strlen(schema), strict ? NULL : &loose, &g) == TL_OK, "%s %s: %s",
                  strict ? "strict" : "loose", schema, tl_last_error());
            int in = 0, out = 1;
            tl_grammar_matches(g, narrowed[i].in, strlen(narrowed[i].in), &in);
            tl_grammar_matches(g, narrowed[i].out, strlen(narrowed[i].out), &out);
            CHECK(in == 1 && out == 0, "%s %s: %s %d, %s %d", strict ? "strict" : "loose", schema, narrowed[i].in, in,
                  narrowed[i].out, out);
            tl_compiled_grammar_free(g);
        }
    /* and in a oneOf, a branch is what it matches, not what it writes: {"pattern": "^a$"} lets
       4 through, so beside {"minimum": 3} both match 4 (and "a"): refused */
    const char *clash = "{\"oneOf\":[{\"pattern\":\"^a$\"},{\"minimum\":3}]}";
    g = NULL;
    CHECK(tl_grammar_compile_json_schema(clash, strlen(clash), NULL, &g) == TL_ERR_INVALID_ARGUMENT &&
              strstr(tl_last_error(), "a value may match both branch 0 and branch 1"),
          "untyped oneOf branches: %s", tl_last_error());
    /* a type's keyword where it is not read is refused, strict and loose, naming it: left out,
       loose would widen a combinator's branches to any value ({"type": "object", "anyOf":
       [{"required": ["a"]}, ...]} gave a tool call whose arguments were a number) or keep
       one type of a schema that mixes two */
    static const char *const untyped[] = {"{\"minLength\":2,\"maxItems\":1}", "{\"required\":[\"a\"],\"minimum\":1}",
                                          "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"}},"
                                          "\"anyOf\":[{\"required\":[\"a\"]},{\"required\":[\"b\"]}]}",
                                          "{\"properties\":{\"a\":{\"type\":\"integer\"}},\"items\":{\"type\":\"string\"}}"};
    for (int i = 0; i < 4; i++)
        for (int strict = 0; strict < 2; strict++) {
            g = NULL;
            CHECK(tl_grammar_compile_json_schema(untyped[i], strlen(untyped[i]), strict ? NULL : &loose, &g) ==
                          TL_ERR_INVALID_ARGUMENT &&
                      strstr(tl_last_error(), "is not supported here: it is read only in a schema of"),
                  "%s %s: %s", strict ? "strict" : "loose", untyped[i], tl_last_error());
            tl_compiled_grammar_free(g);
        }
    const char *misspelt = "{\"type\":\"strnig\",\"anyOf\":[{\"type\":\"string\"}]}";
    g = NULL;
    CHECK(tl_grammar_compile_json_schema(misspelt, strlen(misspelt), &loose, &g) == TL_ERR_INVALID_ARGUMENT &&
              strstr(tl_last_error(), "unknown type 'strnig'"),
          "loose names a misspelt type beside anyOf, as alone: %s", tl_last_error());
    /* draft-07's tuples */
    g = schema("{\"type\":\"array\",\"minItems\":2,\"maxItems\":2,\"items\":[{\"type\":\"string\"},{\"type\":\"number\"}]}");
    static const char *ty[] = {"[\"a\",1.5]", NULL};
    static const char *tn[] = {"[1,\"a\"]", "[\"a\"]", "[\"a\",1,2]", NULL};
    expect(g, "draft-07 tuple", ty, tn);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"array\",\"items\":[{\"type\":\"string\"}],\"additionalItems\":{\"type\":\"integer\"}}");
    static const char *ty2[] = {"[\"a\"]", "[\"a\",1,2]", "[]", NULL};
    static const char *tn2[] = {"[\"a\",\"b\"]", "[1]", NULL};
    expect(g, "draft-07 tuple and additionalItems", ty2, tn2);
    tl_compiled_grammar_free(g);
    const char *closed = "{\"type\":\"array\",\"items\":[{\"type\":\"integer\"}],\"additionalItems\":false,\"minItems\":2}";
    g = NULL;
    CHECK(tl_grammar_compile_json_schema(closed, strlen(closed), NULL, &g) == TL_ERR_INVALID_ARGUMENT &&
              strstr(tl_last_error(), "minItems 2 exceeds the 1 items (a tuple without additionalItems)"),
          "a closed tuple under minItems, in its own words: %s", tl_last_error());
    const char *both = "{\"type\":\"array\",\"items\":[{}],\"prefixItems\":[{}]}";
    g = NULL;
    CHECK(tl_grammar_compile_json_schema(both, strlen(both), NULL, &g) == TL_ERR_INVALID_ARGUMENT &&
              strstr(tl_last_error(), "give one of them"), "tuple forms together: %s", tl_last_error());
    /* 40 models in a cycle of $refs, each holding the next or null; the document nests 6 deep */
    strbuf defs = {0};
    tl_strbuf_puts(&defs, "{\"$defs\":{");
    for (int i = 0; i < 40; i++)
        tl_strbuf_printf(&defs, "%s\"S%d\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"integer\"},\"next\":{\"anyOf\":"
                                "[{\"$ref\":\"#/$defs/S%d\"},{\"type\":\"null\"}]}},\"required\":[\"x\",\"next\"]}",
                         i ? "," : "", i, (i + 1) % 40);
    tl_strbuf_puts(&defs, "},\"$ref\":\"#/$defs/S0\"}");
    g = defs.p ? schema(defs.p) : NULL;
    CHECK(g != NULL, "a cycle of 40 $refs");
    /* 45 links deep: past any count of 64 levels the nesting rule made of a walk through $refs */
    strbuf doc = {0};
    for (int i = 0; i < 45; i++) tl_strbuf_puts(&doc, "{\"x\":1,\"next\":");
    tl_strbuf_puts(&doc, "null");
    for (int i = 0; i < 45; i++) tl_strbuf_puts(&doc, "}");
    static const char *cn[] = {"{\"x\":1}", NULL};
    const char *cy[] = {doc.p, NULL};
    if (doc.p) expect(g, "a cycle of 40 $refs", cy, cn);
    tl_compiled_grammar_free(g);
    free(defs.p);
    free(doc.p);
}

static void test_json_schema(void) {
    tl_compiled_grammar *g = schema("{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":4},"
                                    "\"age\":{\"type\":\"integer\",\"minimum\":18,\"maximum\":120},\"ok\":{\"type\":\"boolean\"}},"
                                    "\"required\":[\"name\",\"age\"]}");
    static const char *y1[] = {"{\"name\":\"ann\",\"age\":18}", "{\"name\":\"\",\"age\":120,\"ok\":true}", "{\"name\":\"bobb\",\"age\":99}", NULL};
    static const char *n1[] = {"{\"name\":\"ann\"}", "{\"name\":\"annie\",\"age\":20}", "{\"name\":\"a\",\"age\":17}",
                               "{\"name\":\"a\",\"age\":121}", "{\"age\":20,\"name\":\"a\"}", "{\"name\":\"a\",\"age\":20,\"x\":1}", NULL};
    expect(g, "object schema", y1, n1);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"null\"},\"b\":{\"const\":\"x\"}}}");
    static const char *y2[] = {"{}", "{\"a\":null}", "{\"b\":\"x\"}", "{\"a\":null,\"b\":\"x\"}", NULL};
    static const char *n2[] = {"{,\"b\":\"x\"}", "{\"b\":\"x\",\"a\":null}", "{\"a\":null,}", NULL};
    expect(g, "optional properties", y2, n2);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"array\",\"prefixItems\":[{\"type\":\"integer\"}],\"items\":{\"enum\":[\"r\",\"g\",1]},\"minItems\":2,\"maxItems\":3}");
    static const char *y3[] = {"[5,\"r\"]", "[-7,1,\"g\"]", NULL};
    static const char *n3[] = {"[5]", "[5,\"b\"]", "[5,1,1,1]", "[\"r\",5]", NULL};
    expect(g, "array schema", y3, n3);
    tl_compiled_grammar_free(g);
    g = schema("{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\",\"minimum\":-5,\"maximum\":5},"
               "\"next\":{\"$ref\":\"#/$defs/node\"}},\"required\":[\"v\"]}},\"$ref\":\"#/$defs/node\"}");
    /* (-0 is 0, inside the bounds, as the unbounded integer takes it) */
    static const char *y4[] = {"{\"v\":-5}", "{\"v\":0,\"next\":{\"v\":5,\"next\":{\"v\":-1}}}", "{\"v\":-0}", NULL};
    static const char *n4[] = {"{\"v\":6}", "{\"v\":-6}", "{\"v\":-00}", "{\"next\":{\"v\":1}}", NULL};
    expect(g, "recursive $ref", y4, n4);
    tl_compiled_grammar_free(g);
    g = schema("{\"anyOf\":[{\"type\":\"string\",\"format\":\"date\"},{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d+$\"},"
               "{\"type\":\"string\",\"format\":\"uuid\"},{\"allOf\":[{\"properties\":{\"a\":{\"type\":\"number\"}},\"required\":[\"a\"]},"
               "{\"properties\":{\"b\":{\"type\":\"string\",\"minLength\":2}}}]}]}");
    static const char *y5[] = {"\"2024-02-29\"", "\"AB-123\"", "\"123e4567-e89b-12d3-a456-426614174000\"", "{\"a\":1.5e3}",
                               "{\"a\":-2,\"b\":\"xy\"}", NULL};
    static const char *n5[] = {"\"2024-13-01\"", "\"ab-1\"", "\"AB-\"", "{\"a\":1,\"b\":\"x\"}", "{\"b\":\"xy\"}", NULL};
    expect(g, "anyOf/allOf/format/pattern", y5, n5);
    tl_compiled_grammar_free(g);
    /* A pattern is searched for (JSON Schema: ECMA-262's test): an alternative without '^' may
       follow any characters, one without '$' be followed by any (it read "abc" as exactly
       "abc"); anchored ones are matched whole, escapes around them included. */
    g = schema("{\"type\":\"string\",\"pattern\":\"abc\"}");
    static const char *y_search[] = {"\"abc\"", "\"xabcx\"", "\"\\nabc\\\"\"", "\"ab abc\"", NULL};
    static const char *n_search[] = {"\"ab\"", "\"acb\"", "\"\"", NULL};
    expect(g, "pattern searched", y_search, n_search);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"string\",\"pattern\":\"^a|b$\"}");
    static const char *y_ends[] = {"\"a\"", "\"ax\"", "\"xb\"", "\"b\"", "\"a b\"", NULL};
    static const char *n_ends[] = {"\"xa\"", "\"bx\"", "\"x\"", NULL};
    expect(g, "pattern anchored at one end", y_ends, n_ends);
    tl_compiled_grammar_free(g);
    /* a one-branch allOf is its branch, of any type (pydantic v1 annotating a $ref; it was
       refused as "allOf is supported for object schemas only") */
    g = schema("{\"definitions\":{\"Color\":{\"enum\":[\"red\",\"blue\"]}},\"type\":\"object\",\"properties\":{\"c\":"
               "{\"allOf\":[{\"$ref\":\"#/definitions/Color\"}],\"description\":\"a color\"}},\"required\":[\"c\"]}");
    static const char *y_one[] = {"{\"c\":\"red\"}", "{\"c\":\"blue\"}", NULL};
    static const char *n_one[] = {"{\"c\":\"green\"}", "{\"c\":1}", "{}", NULL};
    expect(g, "one-branch allOf", y_one, n_one);
    tl_compiled_grammar_free(g);
    /* allOf over $refs: OpenAPI's inheritance, a $ref's target merged as its branch, and a
       target that inherits in turn (an allOf itself) flattened (llama.cpp's corpus: "allOf is
       supported for object schemas only" for any $ref branch) */
    g = schema("{\"$defs\":{\"Root\":{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"integer\"}},\"required\":[\"id\"]},"
               "\"Base\":{\"allOf\":[{\"$ref\":\"#/$defs/Root\"},{\"properties\":{\"kind\":{\"const\":\"b\"}}}]},"
               "\"Alias\":{\"$ref\":\"#/$defs/Base\"}},"
               "\"allOf\":[{\"$ref\":\"#/$defs/Alias\",\"description\":\"the base\"},"
               "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"}},\"required\":[\"name\"]}]}");
    static const char *y_inherit[] = {"{\"id\":1,\"name\":\"x\"}", "{\"id\":1,\"kind\":\"b\",\"name\":\"x\"}", NULL};
    static const char *n_inherit[] = {"{\"name\":\"x\"}", "{\"id\":1}", "{\"id\":1,\"kind\":\"c\",\"name\":\"x\"}", NULL};
    expect(g, "allOf over $refs", y_inherit, n_inherit);
    tl_compiled_grammar_free(g);
    /* required names not in properties come after them, in the order 'required' lists them,
       once each (they were sorted: {"b":1,"a":2} was refused) */
    g = schema("{\"type\":\"object\",\"properties\":{\"z\":{\"type\":\"integer\"}},\"required\":[\"b\",\"z\",\"a\",\"b\"]}");
    static const char *y_order[] = {"{\"z\":0,\"b\":1,\"a\":2}", NULL};
    static const char *n_order[] = {"{\"z\":0,\"a\":2,\"b\":1}", "{\"b\":1,\"a\":2,\"z\":0}", "{\"z\":0,\"b\":1,\"a\":2,\"b\":1}", NULL};
    expect(g, "required names in their order", y_order, n_order);
    tl_compiled_grammar_free(g);
    /* each schema is merged once: definitions that each name the next twice (a doubling
       chain, 2^30 branches at 30 levels: minutes and gigabytes) compile at once, a cycle
       through allOf is its other branches; past 4096 schemas, refused */
    {
        strbuf chain = {0};
        tl_strbuf_puts(&chain, "{\"$defs\":{");
        for (int level = 0; level < 30; level++)
            tl_strbuf_printf(&chain, "\"A%d\":{\"allOf\":[{\"$ref\":\"#/$defs/A%d\"},{\"$ref\":\"#/$defs/A%d\"}]},", level, level + 1,
                             level + 1);
        tl_strbuf_puts(&chain, "\"A30\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]},"
                               "\"C\":{\"allOf\":[{\"$ref\":\"#/$defs/C\"},{\"type\":\"object\",\"properties\":{\"c\":{\"const\":1}}}]}},"
                               "\"allOf\":[{\"$ref\":\"#/$defs/A0\"},{\"$ref\":\"#/$defs/C\"}]}");
        g = chain.p ? schema(chain.p) : NULL;
        static const char *y_chain[] = {"{\"a\":1}", "{\"a\":1,\"c\":1}", NULL};
        static const char *n_chain[] = {"{}", "{\"a\":1,\"c\":2}", NULL};
        expect(g, "allOf over a doubling chain", y_chain, n_chain);
        tl_compiled_grammar_free(g);
        free(chain.p);
        strbuf wide = {0};
        tl_strbuf_puts(&wide, "{\"allOf\":[");
        for (int i = 0; i < 4097; i++) tl_strbuf_printf(&wide, "%s{\"type\":\"object\"}", i ? "," : "");
        tl_strbuf_puts(&wide, "]}");
        g = NULL;
        const tl_status st = wide.p ? tl_grammar_compile_json_schema(wide.p, strlen(wide.p), NULL, &g) : TL_ERR_NO_MEMORY;
        CHECK(st == TL_ERR_INVALID_ARGUMENT && strstr(tl_last_error(), "more than 4096 schemas"), "4097 allOf branches: %s \"%s\"",
              tl_status_name(st), tl_last_error());
        tl_compiled_grammar_free(g);
        free(wide.p);
    }
    /* $ref is a JSON Pointer into the schema, escapes decoded (RFC 6901: %XX, then ~1 '/' and
       ~0 '~'): "a/b" and "c~d" were looked up as "a~1b" and "c~0d" and pointed nowhere; and it
       may point anywhere in the document, an array's item included */
    g = schema("{\"$defs\":{\"a/b\":{\"type\":\"integer\"},\"c~d\":{\"type\":\"boolean\"},\"e f\":{\"const\":\"x\"}},"
               "\"type\":\"object\",\"properties\":{\"p\":{\"$ref\":\"#/$defs/a~1b\"},\"q\":{\"$ref\":\"#/$defs/c~0d\"},"
               "\"r\":{\"$ref\":\"#/$defs/e%20f\"},\"s\":{\"$ref\":\"#/properties/t/prefixItems/1\"},"
               "\"t\":{\"type\":\"array\",\"prefixItems\":[{\"type\":\"null\"},{\"enum\":[7,8]}],\"items\":false}},"
               "\"required\":[\"p\",\"q\",\"r\",\"s\"],\"additionalProperties\":false}");
    static const char *y_pointer[] = {"{\"p\":1,\"q\":true,\"r\":\"x\",\"s\":7}",
                                      "{\"p\":-2,\"q\":false,\"r\":\"x\",\"s\":8,\"t\":[null,7]}", NULL};
    static const char *n_pointer[] = {"{\"p\":true,\"q\":true,\"r\":\"x\",\"s\":7}", "{\"p\":1,\"q\":1,\"r\":\"x\",\"s\":7}",
                                      "{\"p\":1,\"q\":true,\"r\":\"y\",\"s\":7}", "{\"p\":1,\"q\":true,\"r\":\"x\",\"s\":null}", NULL};
    expect(g, "$ref JSON Pointers", y_pointer, n_pointer);
    tl_compiled_grammar_free(g);
    /* format date: days that exist (a validator's date.fromisoformat refuses the others; the
       grammar allowed 31 in every month), February 29 in leap years only */
    g = schema("{\"type\":\"string\",\"format\":\"date\"}");
    static const char *y_date[] = {"\"2023-01-31\"", "\"2023-04-30\"", "\"2023-02-28\"", "\"2024-02-29\"", "\"2000-02-29\"",
                                   "\"0000-02-29\"", "\"1996-02-29\"", "\"2023-12-31\"", "\"1999-11-30\"", NULL};
    static const char *n_date[] = {"\"2023-02-30\"", "\"2023-04-31\"", "\"2023-02-29\"", "\"1900-02-29\"", "\"2100-02-29\"",
                                   "\"2023-06-31\"", "\"2023-09-31\"", "\"2023-11-31\"", "\"2023-00-10\"", "\"2023-01-00\"", NULL};
    expect(g, "format date", y_date, n_date);
    tl_compiled_grammar_free(g);
    /* format date-time and time: RFC 3339's leap second (:60) and lower-case 't' and 'z'
       (both were refused); the leap second ends a day in UTC, written in UTC only (a second
       of 60 was taken at any time: JSON Schema's test suite refuses 22:59:60Z, 23:58:60Z and
       23:59:60+01:00) */
    g = schema("{\"type\":\"string\",\"format\":\"date-time\"}");
    static const char *y_datetime[] = {"\"2016-12-31T23:59:60Z\"", "\"2016-12-31T23:59:60.25-00:00\"",
                                       "\"2023-01-31t10:00:00z\"", "\"2023-01-31T10:00:00.5+05:30\"", NULL};
    static const char *n_datetime[] = {"\"2023-01-31 10:00:00Z\"", "\"2023-01-31T10:00:61Z\"", "\"2023-01-31T24:00:00Z\"",
                                       "\"2023-01-31T10:00:00\"", "\"2023-01-31T10:00:00x\"", "\"0000-01-11T00:11:60z\"",
                                       NULL};
    expect(g, "format date-time", y_datetime, n_datetime);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"string\",\"format\":\"time\"}");
    static const char *y_time[] = {"\"23:59:60z\"", "\"23:59:60+00:00\"", "\"00:00:00-01:00\"", NULL};
    static const char *n_time[] = {"\"23:60:00Z\"", "\"23:59:70Z\"", "\"t23:59:59Z\"", "\"22:59:60Z\"", "\"23:58:60Z\"",
                                   "\"23:59:60+01:00\"", "\"23:59:60+00:30\"", "\"23:59:60-01:00\"", "\"00:44:60z\"", NULL};
    expect(g, "format time", y_time, n_time);
    tl_compiled_grammar_free(g);
    /* Pattern classes are translated member by member (never copied as text): ']' and '#'
       stay inside the class, '"' and '\' inside a class become the JSON escapes, "[]"
       matches nothing and "[^]" any character ('\' too: it was left out). */
    g = schema("{\"type\":\"string\",\"pattern\":\"^[a\\\\]#][ -~]{2}[^]x$\"}");
    static const char *y7[] = {"\"]ab~x\"", "\"#\\\"\\\\zx\"", "\"a \\\"zx\"", "\"#\\\\\\\\\\\\x\"", NULL};
    static const char *n7[] = {"\"b  zx\"", "\"a\"b\"x\"", "\"a\\\\x\"", "\"#ab\"", NULL};
    expect(g, "pattern classes", y7, n7);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"string\",\"pattern\":\"a[]|b\"}");
    static const char *y8[] = {"\"b\"", NULL};
    static const char *n8[] = {"\"a\"", "\"a]\"", NULL};
    expect(g, "empty class", y8, n8);
    tl_compiled_grammar_free(g);
    /* ECMA-262's white space and line terminators: [^\s] excludes U+00A0 and U+3000 as well
       as the space, '.' excludes U+2028 (both were let through) */
    g = schema("{\"type\":\"string\",\"pattern\":\"^[^\\\\s].$\"}");
    static const char *y10[] = {"\"ab\"", "\"\xc3\xa9 \"", NULL};
    static const char *n10[] = {"\" a\"", "\"\xc2\xa0" "a\"", "\"\xe3\x80\x80" "a\"", "\"a\xe2\x80\xa8\"", NULL};
    expect(g, "ECMA white space", y10, n10);
    tl_compiled_grammar_free(g);
    /* \S \D \W in a class (refused): "[\s\S]" is any character a JSON string holds, '"', '\'
       and the controls written escaped (\s's tab and line feed were left out); a negated class
       of them excludes exactly the set */
    g = schema("{\"type\":\"string\",\"pattern\":\"^[\\\\s\\\\S]{2}$\"}");
    static const char *y_any[] = {"\"a \"", "\"\\\"\\\\\"", "\"\xc3\xa9\xe2\x82\xac\"", "\"\\\"1\"", "\"\\t\\n\"",
                                  "\"\\u0001\xe2\x80\xa8\"", NULL};
    static const char *n_any[] = {"\"a\"", "\"abc\"", "\"a\\\"", NULL};
    expect(g, "[\\s\\S] in a JSON string", y_any, n_any);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"string\",\"pattern\":\"^[^\\\\S\\\\d]$\"}");
    static const char *y_nots[] = {"\" \"", "\"\xc2\xa0\"", "\"\\t\"", "\"\\r\"", NULL};
    static const char *n_nots[] = {"\"a\"", "\"1\"", "\"\\\"\"", "\"\\u0001\"", NULL};
    expect(g, "[^\\S\\d] in a JSON string", y_nots, n_nots);
    tl_compiled_grammar_free(g);
    /* what ECMA-262's '.', \s, \S and a negated class match in a JSON string, written as JSON
       escapes it: '"', '\' and the controls ('.' refused them, [^a] refused '"', \s the tab: valid
       strings the grammar could never write) */
    static const char *const dot_pattern[][4] = {
        /* pattern, matches, matches, does not match */
        {"^.$", "\"\\\"\"", "\"\\u001f\"", "\"\\n\""},
        {"^.$", "\"\\\\\"", "\"\\t\"", "\"\\u000D\""},
        {"^\\\\s$", "\"\\t\"", "\"\\u000b\"", "\"\\u0001\""},
        {"^\\\\S$", "\"\\u0001\"", "\"\\\\\"", "\"\\t\""},
        {"^[^a]$", "\"\\\"\"", "\"\\n\"", "\"a\""},
        {"^[^\\\\n]$", "\"\\\\\"", "\"\\b\"", "\"\\u000a\""},
        {"^\\\\W$", "\"\\u0000\"", "\"\\\"\"", "\"_\""},
    };
    for (size_t i = 0; i < sizeof dot_pattern / sizeof dot_pattern[0]; i++) {
        char text[128];
        snprintf(text, sizeof text, "{\"type\":\"string\",\"pattern\":\"%s\"}", dot_pattern[i][0]);
        g = schema(text);
        const char *yes[] = {dot_pattern[i][1], dot_pattern[i][2], NULL}, *no[] = {dot_pattern[i][3], NULL};
        expect(g, dot_pattern[i][0], yes, no);
        tl_compiled_grammar_free(g);
    }
    /* enum next to type: the values of that type only (1 was let through) */
    g = schema("{\"type\":\"string\",\"enum\":[\"a\",1,\"b\"]}");
    static const char *y9[] = {"\"a\"", "\"b\"", NULL};
    static const char *n9[] = {"1", NULL};
    expect(g, "enum with type", y9, n9);
    tl_compiled_grammar_free(g);
    /* additionalProperties: extra keys are any string but a declared name (one was let
       through: {"a":1,"a":2}, or "ab" with an integer); a name spelled with escapes is no
       way around it; a key that leaves every name may use escapes after that */
    g = schema("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"ab\":{\"type\":\"string\"},"
               "\"\xc3\xa9\":{\"type\":\"boolean\"}},\"additionalProperties\":{\"type\":\"integer\"}}");
    static const char *y11[] = {"{\"a\":1}", "{\"a\":1,\"b\":2}", "{\"x\":3}", "{\"\":1}", "{\"abc\":4}", "{\"aa\":5}",
                                "{\"\xc3\xa9x\":1}", "{\"\xc3\xaa\":1}", "{\"ab\":\"s\",\"abc\":1,\"A\":2}", "{\"b\\n\\u0061\":1}",
                                "{\"\xc3\xa9\":true,\"a\\\"\":7}", NULL};
    static const char *n11[] = {"{\"a\":1,\"a\":2}", "{\"ab\":\"s\",\"a\":2}", "{\"ab\":1}", "{\"x\":\"s\"}", "{\"\xc3\xa9\":1}",
                                "{\"\\u0061b\":1}", "{\"a\\u0062\":1}", "{\"\xc3\xa9\":true,\"\xc3\xa9\":2}", NULL};
    expect(g, "additional property names", y11, n11);
    tl_compiled_grammar_free(g);
    /* a required name that 'properties' lacks: an additional property that must be there, of
       additionalProperties' schema or any value (it was refused, a valid schema that tools
       without parameters' descriptions send); without 'properties' the object stays open, as
       an object that declares no keys is any object */
    g = schema("{\"type\":\"object\",\"required\":[\"y\",\"y\"]}");
    static const char *y_req[] = {"{\"y\":1}", "{\"y\":{\"s\":[2]}}", "{\"y\":1,\"x\":\"z\"}", NULL};
    static const char *n_req[] = {"{}", "{\"x\":1}", "{\"y\":1,\"y\":2}", NULL};
    expect(g, "required, undeclared", y_req, n_req);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"b\",\"a\"],"
               "\"additionalProperties\":{\"type\":\"string\"}}");
    static const char *y_req2[] = {"{\"a\":1,\"b\":\"x\"}", "{\"a\":1,\"b\":\"x\",\"c\":\"d\"}", NULL};
    static const char *n_req2[] = {"{\"a\":1}", "{\"a\":1,\"b\":2}", "{\"a\":1,\"b\":\"x\",\"b\":\"y\"}", "{\"b\":\"x\"}", NULL};
    expect(g, "required, of additionalProperties' schema", y_req2, n_req2);
    tl_compiled_grammar_free(g);
    /* additionalProperties: true beside names that share prefixes, one of them empty */
    g = schema("{\"type\":\"object\",\"properties\":{\"\":{\"type\":\"null\"},\"k\":{\"type\":\"null\"},\"kk\":{\"type\":\"null\"}},"
               "\"additionalProperties\":true}");
    static const char *y12[] = {"{\"\":null,\"k\":null,\"x\":[1]}", "{\"kkk\":\"v\"}", "{\"kx\":{}}", "{\"K\":0}", NULL};
    static const char *n12[] = {"{\"\":1}", "{\"k\":1}", "{\"kk\":1}", "{\"x\":1,\"\":null}", "{\"k\":null,\"k\":null}", NULL};
    expect(g, "additional names with shared prefixes", y12, n12);
    tl_compiled_grammar_free(g);
    /* an escape that spells a name's next character is no way out of it either */
    g = schema("{\"type\":\"object\",\"properties\":{\"a/\":{\"type\":\"integer\"}},\"additionalProperties\":{\"type\":\"string\"}}");
    static const char *y13[] = {"{\"a/\":1}", "{\"a\\n\":\"s\"}", "{\"a//\":\"s\"}", "{\"a\\\\\":\"s\"}", NULL};
    static const char *n13[] = {"{\"a\\/\":\"s\"}", "{\"a/\":\"s\"}", "{\"a/\":1,\"a/\":2}", NULL};
    expect(g, "additional names and escapes", y13, n13);
    tl_compiled_grammar_free(g);
    /* A list of types beside other keywords (OpenAI's nullable fields): each keyword applies
       to the values of its own type (they were refused as unsupported) */
    g = schema("{\"type\":[\"string\",\"null\"],\"maxLength\":3}");
    static const char *ty0[] = {"\"ab\"", "null", NULL};
    static const char *tn0[] = {"\"abcd\"", "1", NULL};
    expect(g, "type list 0", ty0, tn0);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":[\"integer\",\"null\"],\"minimum\":1}");
    static const char *ty1[] = {"1", "null", "7", NULL};
    static const char *tn1[] = {"0", "-3", "\"x\"", NULL};
    expect(g, "type list 1", ty1, tn1);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":[\"object\",\"null\"],\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"],\"additionalProperties\":false}");
    static const char *ty2[] = {"{\"a\":1}", "null", NULL};
    static const char *tn2[] = {"{}", "{\"a\":1,\"b\":2}", NULL};
    expect(g, "type list 2", ty2, tn2);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":[\"array\",\"null\"],\"items\":{\"type\":\"string\"},\"maxItems\":1}");
    static const char *ty3[] = {"[\"x\"]", "null", "[]", NULL};
    static const char *tn3[] = {"[1]", "[\"a\",\"b\"]", NULL};
    expect(g, "type list 3", ty3, tn3);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":[\"string\",\"integer\"],\"minLength\":2,\"maximum\":5}");
    static const char *ty4[] = {"\"ab\"", "5", "-9", NULL};
    static const char *tn4[] = {"\"a\"", "6", NULL};
    expect(g, "type list 4", ty4, tn4);
    tl_compiled_grammar_free(g);
    /* \uHHHH and \xHH outside a class too; '"' and '\' as JSON writes them */
    g = schema("{\"type\":\"string\",\"pattern\":\"caf\\\\u00e9 \\\\x41\\\\u0022\"}");
    static const char *yu[] = {"\"caf\xc3\xa9 A\\\"\"", NULL};
    static const char *nu[] = {"\"cafe A\\\"\"", "\"caf\xc3\xa9 A\"\"", NULL};
    expect(g, "pattern hex escapes", yu, nu);
    tl_compiled_grammar_free(g);
    /* a control in a JSON string's pattern: the string holds it as JSON escapes it (its short
       escape, or \u00XX in either case) */
    g = schema("{\"type\":\"string\",\"pattern\":\"a\\\\nb\\\\t\\\\x01\"}");
    static const char *yc[] = {"\"a\\nb\\t\\u0001\"", "\"a\\u000Ab\\u0009\\u0001\"", NULL};
    static const char *nc[] = {"\"anbt\"", "\"a\nb\t\x01\"", "\"a\\u000Bb\\t\\u0001\"", NULL};
    expect(g, "pattern controls", yc, nc);
    tl_compiled_grammar_free(g);
    /* controls in a plain class too, each as JSON escapes it, beside the class's characters
       (they were refused: "[a-z\n]" is how a pattern allows several lines) */
    g = schema("{\"type\":\"string\",\"pattern\":\"^[a-b\\\\n\\\\x00-\\\\x02\\\"]+$\"}");
    static const char *ycc[] = {"\"a\\nb\"", "\"\\n\\u0000\\u0001\\u0002\\\"\"", "\"ab\"", "\"a\\u000ab\"", NULL};
    static const char *ncc[] = {"\"a\nb\"", "\"a\\tb\"", "\"\\u0003\"", "\"c\"", NULL};
    expect(g, "pattern class controls", ycc, ncc);
    tl_compiled_grammar_free(g);
    g = schema("{\"type\":\"string\",\"pattern\":\"^[\\\\t]$\"}"); /* a class of controls alone */
    static const char *yct[] = {"\"\\t\"", NULL};
    static const char *nct[] = {"\"\t\"", "\"t\"", "\"\"", NULL};
    expect(g, "pattern class control alone", yct, nct);
    tl_compiled_grammar_free(g);
    /* free whitespace */
    tl_json_schema_options opts = {.free_whitespace = 1};
    g = NULL;
    const char *s6 = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}}}";
    CHECK(tl_grammar_compile_json_schema(s6, strlen(s6), &opts, &g) == TL_OK, "%s", tl_last_error());
    static const char *y6[] = {"{ \"a\": [1, 2 ] }", "{\"a\":[]}", NULL};
    static const char *n6[] = {"{ \"a\": [1 2] }", NULL};
    expect(g, "free whitespace", y6, n6);
    tl_compiled_grammar_free(g);
    /* loose: keywords that only narrow are not enforced (a superset), for schemas given
       without strict (Pydantic's HttpUrl, EmailStr, gt=); widening ones are still refused */
    tl_json_schema_options loose = {.loose = 1};
    const char *s7 = "{\"type\":\"object\",\"properties\":{\"u\":{\"type\":\"string\",\"format\":\"uri\",\"minLength\":1,"
                     "\"maxLength\":2083},\"e\":{\"type\":\"string\",\"format\":\"email\"},\"x\":{\"type\":\"number\","
                     "\"exclusiveMinimum\":0,\"multipleOf\":0.5},\"t\":{\"type\":\"array\",\"uniqueItems\":true,"
                     "\"items\":{\"type\":\"integer\",\"format\":\"int32\"}},\"d\":{\"type\":\"string\",\"format\":\"date\"}},"
                     "\"required\":[\"u\",\"e\",\"x\",\"t\",\"d\"],\"minProperties\":1}";
    g = NULL;
    CHECK(tl_grammar_compile_json_schema(s7, strlen(s7), NULL, &g) == TL_ERR_INVALID_ARGUMENT, "strict refuses format uri");
    CHECK(tl_grammar_compile_json_schema(s7, strlen(s7), &loose, &g) == TL_OK, "loose: %s", tl_last_error());
    static const char *y_loose[] = {"{\"u\":\"https://a.b\",\"e\":\"x@y.z\",\"x\":2.5,\"t\":[1,1],\"d\":\"2024-01-31\"}",
                               "{\"u\":\"a\",\"e\":\"\",\"x\":0.1,\"t\":[],\"d\":\"2024-01-31\"}", NULL};
    /* a negative number under a bound >= 0, a known format and the lengths are still held */
    static const char *n_loose[] = {"{\"u\":\"a\",\"e\":\"b\",\"x\":-1,\"t\":[],\"d\":\"2024-01-31\"}",
                               "{\"u\":\"a\",\"e\":\"b\",\"x\":1,\"t\":[],\"d\":\"yesterday\"}",
                               "{\"u\":\"\",\"e\":\"b\",\"x\":1,\"t\":[],\"d\":\"2024-01-31\"}", NULL};
    expect(g, "loose", y_loose, n_loose);
    tl_compiled_grammar_free(g);
    g = NULL;
    const char *widening = "{\"type\":\"object\",\"patternProperties\":{\"^a\":{}},\"additionalProperties\":false}";
    CHECK(tl_grammar_compile_json_schema(widening, strlen(widening), &loose, &g) == TL_ERR_INVALID_ARGUMENT &&
              strstr(tl_last_error(), "unsupported keyword 'patternProperties'"),
          "loose still refuses patternProperties: %s", tl_last_error());
    test_openapi_and_generators();
    /* unsupported keywords are errors that name them */
    static const struct { const char *s, *needle; } bad[] = {
        {"{\"type\":\"string\",\"contentEncoding\":\"base64\"}", "unsupported keyword 'contentEncoding'"},
        {"{\"type\":\"object\",\"patternProperties\":{}}", "unsupported keyword 'patternProperties'"},
        /* a type's keyword where it is not read says so ("unsupported" sent users looking for
           a keyword that is supported) */
        {"{\"type\":\"number\",\"maxLength\":3}", "keyword 'maxLength' is not supported here: it is read only in a schema of \"type\" \"string\""},
        {"{\"minimum\":1,\"pattern\":\"a\"}", "keyword 'minimum' is not supported here: it is read only in a schema of \"type\" \"integer\" or \"number\""},
        {"{\"$defs\":{\"s\":{\"type\":\"string\"}},\"$ref\":\"#/$defs/s\",\"maxLength\":3}", "keyword 'maxLength' beside '$ref' is not supported"},
        {"{\"$ref\":\"#/$defs/a~2\"}", "$ref '#/$defs/a~2' is not supported"},
        {"{\"$ref\":\"#/$defs/a%zz\"}", "$ref '#/$defs/a%zz' is not supported"},
        {"{\"$ref\":\"#/$defs/a%00\"}", "is not supported"},
        {"{\"$ref\":\"#x\"}", "$ref '#x' is not supported"},
        {"{\"$defs\":{\"l\":[{}]},\"$ref\":\"#/$defs/l/01\"}", "points nowhere"},
        {"{\"type\":\"string\",\"format\":\"email\"}", "format 'email' is not supported"},
        {"{\"type\":\"wat\"}", "unknown type 'wat'"},
        {"{\"$ref\":\"http://x\"}", "$ref 'http://x' is not supported"},
        {"{\"$ref\":\"#/$defs/missing\"}", "points nowhere"},
        /* a branch's own fault, not the overlap its unknown type looked like */
        {"{\"oneOf\":[{\"type\":\"string\"},{\"$ref\":\"#/nope\"}]}", "at /oneOf/1: $ref '#/nope' points nowhere"},
        {"{\"$defs\":{\"x\":{\"type\":\"bogus\"}},\"oneOf\":[{\"type\":\"string\"},{\"$ref\":\"#/$defs/x\"}]}",
         "at #/$defs/x: unknown type 'bogus'"},
        {"{\"type\":\"object\",\"required\":[\"z\"],\"additionalProperties\":false}",
         "required property 'z' is not in 'properties', and additionalProperties is false: no object matches"},
        {"{\"type\":\"object\",\"required\":[1]}", "'required' must list property names (strings)"},
        /* a fault of additionalProperties' schema, which an undeclared required name takes, is
           named there */
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"],\"additionalProperties\":{\"type\":\"bogus\"}}",
         "at /additionalProperties: unknown type 'bogus'"},
        {"{\"type\":", "not valid JSON"},
        {"{\"not\":{}}", "unsupported keyword 'not'"},
        /* schemas that match nothing, or whose branches would need intersecting (each once
           let through what it forbids: [], 1, {"a":1}) */
        {"{\"type\":\"array\",\"items\":false,\"minItems\":1}", "minItems 1 exceeds the 0 prefixItems"},
        {"{\"type\":\"string\",\"const\":1}", "'const' is not of the schema's 'type'"},
        {"{\"type\":\"string\",\"enum\":[1,null]}", "no 'enum' value is of the schema's 'type'"},
        {"{\"allOf\":[{\"properties\":{\"a\":{\"type\":\"integer\"}},\"required\":[\"a\"]},"
         "{\"properties\":{\"a\":{\"type\":\"integer\",\"minimum\":5}}}]}", "property 'a' in more than one branch"},
        {"{\"allOf\":[{\"type\":\"object\",\"additionalProperties\":false},{\"type\":\"object\",\"additionalProperties\":true}]}",
         "additionalProperties in more than one branch"},
        {"{\"type\":\"string\",\"pattern\":\"(?=x)\"}", "lookahead"},
        {"{\"type\":\"string\",\"pattern\":\"[D-0]\"}", "reversed range 'D-0'"},
        {"{\"type\":\"string\",\"pattern\":\"a{{2}\"}", "bad quantifier"},
        /* fuzzer find: "[]" (an empty class) then an unbalanced ')' once gave GBNF that did not compile */
        {"{\"type\": \"string\", \"pattern\": \"-Y2-YK][]##!#######Y(Y4U4 00000)000000000 000000000632*7777.00000004 "
         "00000)0000032YY];lY\"}", "pattern: unexpected ')'"},
        {"{\"type\":\"string\",\"pattern\":\"[\\\\d-z]\"}", "pattern: a class range cannot start with '\\d'"},
        {"{\"$ref\":\"#\"}", "a $ref cycle matches nothing"},
        /* allOf's $refs: one pointing nowhere, a cycle of them, a target of another type */
        {"{\"allOf\":[{\"$ref\":\"#/$defs/None\"},{\"type\":\"object\"}]}", "$ref '#/$defs/None' points nowhere"},
        /* (a chain deeper than 64 $refs; a cycle is followed once: A = allOf[A, ...] is its other branches) */
        {"{\"$defs\":{\"A0\":{\"$ref\":\"#/$defs/A1\"},\"A1\":{\"$ref\":\"#/$defs/A2\"},\"A2\":{\"$ref\":\"#/$defs/A3\"},"
         "\"A3\":{\"$ref\":\"#/$defs/A4\"},\"A4\":{\"$ref\":\"#/$defs/A5\"},\"A5\":{\"$ref\":\"#/$defs/A6\"},\"A6\":{\"$ref\":\"#/$defs/A7\"},"
         "\"A7\":{\"allOf\":[{\"$ref\":\"#/$defs/A8\"},{\"allOf\":[{\"allOf\":[{\"allOf\":[{\"allOf\":[{\"allOf\":[{\"allOf\":[{\"allOf\":"
         "[{\"allOf\":[{\"$ref\":\"#/$defs/A0\"}]}]}]}]}]}]}]}]}]},\"A8\":{\"type\":\"object\"}},"
         "\"allOf\":[{\"$ref\":\"#/$defs/B0\"},{\"type\":\"object\"}]}", "$ref '#/$defs/B0' points nowhere"},
        {"{\"$defs\":{\"S\":{\"type\":\"string\"}},\"allOf\":[{\"$ref\":\"#/$defs/S\"},{\"type\":\"object\"}]}",
         "allOf is supported for object schemas only"},
        {"{\"properties\":{\"a\":{\"type\":\"integer\",\"multipleOf\":2}}}", "at /properties/a: 'multipleOf' is supported as 1 or a power of ten below it"},
        /* a list of types: a keyword of none of them, an unknown type, a bound a type cannot take */
        {"{\"type\":[\"string\",\"null\"],\"items\":{}}", "unsupported keyword 'items'"},
        {"{\"type\":[\"string\",\"wat\"]}", "unknown type 'wat'"},
        {"{\"type\":[\"string\",3]}", "'type' entries must be strings"},
        /* a number's bounds: numbers below 2^53 (an integer part in a long long), a range with a value */
        {"{\"type\":[\"number\",\"null\"],\"minimum\":\"2\"}", "'minimum' must be a number below 2^53"},
        {"{\"type\":\"number\",\"maximum\":1e300}", "'maximum' must be a number below 2^53"},
        {"{\"type\":\"number\",\"minimum\":2.5,\"maximum\":1}", "no number is >= 2.5 and <= 1"},
        {"{\"type\":[\"number\",\"integer\"],\"exclusiveMinimum\":0.1,\"maximum\":0.1}", "no number is > 0.1 and <= 0.1"},
        /* a count that is no whole number (2.7 was read as 2: a narrower schema) */
        {"{\"type\":\"array\",\"minItems\":2.7}", "'minItems' must be an integer"},
        {"{\"type\":\"array\",\"maxItems\":1.5}", "'maxItems' must be an integer"},
        {"{\"type\":\"string\",\"minLength\":2.5}", "'minLength' must be an integer"},
        {"{\"type\":\"string\",\"maxLength\":0.5}", "'maxLength' must be an integer"},
        /* one JSON document, by the loader's rules: a second value after it was dropped, a
           key given twice kept its first value (Python's and JavaScript's parsers the last) */
        {"{\"type\":\"string\"} {\"type\":\"integer\"}", "unexpected text after the JSON value"},
        {"true false", "unexpected text after the JSON value"},
        {"\xEF\xBB\xBF{\"type\":\"string\"}", "byte order mark"},
        {"{\"type\":\"string\",\"type\":\"integer\"}", "duplicate key \"type\""},
        /* what cJSON reads and JSON has not: a \u escape without four hex digits (read as
           U+0000, which cut the enum's string short: "a\uzzzzb" became "a", no error), and
           numbers outside JSON's grammar (01 read as 1) */
        {"{\"enum\":[\"a\\uzzzzb\"]}", "a \\u escape without four hex digits at line 1, column 12"},
        {"{\"const\":\"\\u12\"}", "not valid JSON"}, /* (cJSON's own refusal) */
        {"{\"type\":\"integer\",\"minimum\":01}", "'01' at line 1, column 29 is no JSON number"},
        {"{\"const\":1.}", "'1.' at line 1, column 10 is no JSON number"},
        {"{\"const\":-.5}", "is no JSON number"},
        {"{\"const\":2.e3}", "'2.e3' at line 1, column 10 is no JSON number"},
        {"{\"const\":[-01]}", "is no JSON number"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        tl_compiled_grammar *x = NULL;
        CHECK_ERROR(tl_grammar_compile_json_schema(bad[i].s, strlen(bad[i].s), NULL, &x), TL_ERR_INVALID_ARGUMENT, bad[i].needle);
        tl_compiled_grammar_free(x);
    }
    /* a control character between tokens (cJSON skipped any byte up to a space), or raw in a string */
    {
        tl_compiled_grammar *x = NULL;
        CHECK_ERROR(tl_grammar_compile_json_schema("{\"type\":\f\"string\"}", 18, NULL, &x), TL_ERR_INVALID_ARGUMENT,
                    "a control character (0x0C) outside a string at line 1, column 9");
        tl_compiled_grammar_free(x);
        x = NULL;
        CHECK_ERROR(tl_grammar_compile_json_schema("{\"const\":\"a\tb\"}", 15, NULL, &x), TL_ERR_INVALID_ARGUMENT,
                    "a control character (0x09) unescaped in a string");
        tl_compiled_grammar_free(x);
    }
    /* a NUL inside the length is text after the value too; blanks after it are fine */
    {
        static const char nul_after[] = "{\"type\":\"string\"}\0";
        tl_compiled_grammar *x = NULL;
        CHECK_ERROR(tl_grammar_compile_json_schema(nul_after, sizeof nul_after - 1, NULL, &x), TL_ERR_INVALID_ARGUMENT, "a NUL byte");
        tl_compiled_grammar_free(x);
        x = NULL;
        CHECK(tl_grammar_compile_json_schema("{\"type\":\"string\"}\n ", 19, NULL, &x) == TL_OK, "%s", tl_last_error());
        tl_compiled_grammar_free(x);
    }
    /* a declared name over 1024 characters beside additionalProperties (its key rule is a
       rule a character): refused; the same name alone is fine */
    char long_name[2200];
    for (int additional = 0; additional < 2; additional++) {
        int at = snprintf(long_name, sizeof long_name, "{\"properties\":{\"");
        for (int i = 0; i < 1025; i++) long_name[at++] = 'n';
        snprintf(long_name + at, sizeof long_name - (size_t)at, "\":{}},\"additionalProperties\":%s}", additional ? "true" : "false");
        tl_compiled_grammar *x = NULL;
        if (additional)
            CHECK_ERROR(tl_grammar_compile_json_schema(long_name, strlen(long_name), NULL, &x), TL_ERR_INVALID_ARGUMENT,
                        "a property name over 1024 characters beside additionalProperties is not supported");
        else
            CHECK(tl_grammar_compile_json_schema(long_name, strlen(long_name), NULL, &x) == TL_OK, "%s", tl_last_error());
        tl_compiled_grammar_free(x);
    }
}

/* ---------------------------------------------------------------- masks and generation */

/* The trie-based mask equals a token-by-token check along a document's tokens; then, from the
   start again, every state's mask comes from the cache (a bitset, or a projection's entry plus
   the tokens the state adds: grammar_mask.c) and equals the first. */
static void test_masks(tl_model *m, const char *rel_grammar, const char *doc) {
    tl_compiled_grammar *g = load_grammar(rel_grammar);
    if (!g) return;
    const int vocab = tl_model_info(m)->vocab_size;
    tl_grammar_matcher *mt = NULL;
    CHECK(tl_grammar_matcher_new(g, m, &mt) == TL_OK, "%s", tl_last_error());
    tl_compiled_grammar_free(g); /* the matcher keeps it alive */
    int32_t *ids;
    int n;
    CHECK(tl_encode(m, doc, strlen(doc), &ids, &n) == TL_OK, "%s", tl_last_error());
    uint8_t *first = malloc(((size_t)n + 1) * (size_t)vocab);
    int *first_count = malloc(((size_t)n + 1) * sizeof *first_count);
    int mismatches = 0;
    for (int i = 0; i <= n && mt; i++) {
        int count = -1;
        uint8_t *mask = first + (size_t)i * (size_t)vocab;
        CHECK(tl_grammar_matcher_mask(mt, mask, vocab, &count) == TL_OK, "%s", tl_last_error());
        first_count[i] = count;
        int counted = 0;
        for (int t = 0; t < vocab; t++) {
            int ok = 0;
            tl_grammar_matcher_accepts(mt, t, &ok);
            if (ok != mask[t]) mismatches++;
            counted += mask[t];
        }
        CHECK(counted == count, "mask count %d, %d set", count, counted);
        if (i < n) CHECK(tl_grammar_matcher_accept(mt, ids[i]) == TL_OK, "token %d of the document: %s", i, tl_last_error());
    }
    CHECK(mismatches == 0, "%s: %d mask entries differ from the per-token check", rel_grammar, mismatches);
    CHECK(tl_grammar_matcher_is_accepting(mt), "the whole document is a sentence");
    /* rollback: back to the start; the same states again, now cached */
    CHECK(tl_grammar_matcher_rollback(mt, n) == TL_OK, "%s", tl_last_error());
    uint8_t *mask = malloc((size_t)vocab);
    int cached_mismatches = 0;
    for (int i = 0; i <= n && mt; i++) {
        int count = -1;
        CHECK(tl_grammar_matcher_mask(mt, mask, vocab, &count) == TL_OK, "%s", tl_last_error());
        if (count != first_count[i] || memcmp(mask, first + (size_t)i * (size_t)vocab, (size_t)vocab) != 0) cached_mismatches++;
        if (i < n) CHECK(tl_grammar_matcher_accept(mt, ids[i]) == TL_OK, "token %d of the document: %s", i, tl_last_error());
    }
    CHECK(cached_mismatches == 0, "%s: %d cached masks differ from the first ones", rel_grammar, cached_mismatches);
    /* rollback: back to the start, the first token again */
    CHECK(tl_grammar_matcher_rollback(mt, n) == TL_OK, "%s", tl_last_error());
    CHECK(tl_grammar_matcher_accept(mt, ids[0]) == TL_OK, "after rollback: %s", tl_last_error());
    CHECK_ERROR(tl_grammar_matcher_rollback(mt, 5), TL_ERR_INVALID_ARGUMENT, "1 accepted");
    tl_free(ids);
    free(first);
    free(first_count);
    free(mask);
    tl_grammar_matcher_free(mt);
}

/* A validator for the schema subset used below. */
static bool validate(const cJSON *v, const cJSON *s) {
    const cJSON *en = cJSON_GetObjectItem(s, "enum");
    if (en) {
        for (const cJSON *e = en->child; e; e = e->next)
            if (cJSON_Compare(e, v, true)) return true;
        return false;
    }
    const char *type = cJSON_GetStringValue(cJSON_GetObjectItem(s, "type"));
    if (!type) return true;
    if (strcmp(type, "string") == 0) {
        if (!cJSON_IsString(v)) return false;
        const cJSON *mx = cJSON_GetObjectItem(s, "maxLength");
        return !mx || (int)strlen(v->valuestring) <= mx->valueint; /* ASCII-only strings below */
    }
    if (strcmp(type, "integer") == 0) {
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble)) return false;
        const cJSON *lo = cJSON_GetObjectItem(s, "minimum"), *hi = cJSON_GetObjectItem(s, "maximum");
        return (!lo || v->valuedouble >= lo->valuedouble) && (!hi || v->valuedouble <= hi->valuedouble);
    }
    if (strcmp(type, "number") == 0) {
        if (!cJSON_IsNumber(v)) return false;
        const cJSON *lo = cJSON_GetObjectItem(s, "minimum"), *below = cJSON_GetObjectItem(s, "exclusiveMaximum");
        return (!lo || v->valuedouble >= lo->valuedouble) && (!below || v->valuedouble < below->valuedouble);
    }
    if (strcmp(type, "boolean") == 0) return cJSON_IsBool(v);
    if (strcmp(type, "array") == 0) {
        if (!cJSON_IsArray(v)) return false;
        const cJSON *mx = cJSON_GetObjectItem(s, "maxItems");
        if (mx && cJSON_GetArraySize(v) > mx->valueint) return false;
        for (const cJSON *e = v->child; e; e = e->next)
            if (!validate(e, cJSON_GetObjectItem(s, "items"))) return false;
        return true;
    }
    if (strcmp(type, "object") == 0) {
        if (!cJSON_IsObject(v)) return false;
        const cJSON *props = cJSON_GetObjectItem(s, "properties");
        for (const cJSON *e = v->child; e; e = e->next) {
            const cJSON *ps = cJSON_GetObjectItem(props, e->string);
            if (!ps || !validate(e, ps)) return false;
        }
        for (const cJSON *r = cJSON_GetObjectItem(s, "required")->child; r; r = r->next)
            if (!cJSON_GetObjectItem(v, r->valuestring)) return false;
        return true;
    }
    return false;
}

static int sample(tl_model *m, const tl_compiled_grammar *g, uint64_t seed, float temperature, tl_speculative_mode mode,
                  int K, int32_t *out, int *out_len, tl_generate_stats *stats) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    tl_grammar grammar;
    tl_grammar_use(&grammar, g);
    cfg.grammar = &grammar;
    cfg.max_tokens = 200;
    cfg.loops = 4;
    cfg.temperature = temperature;
    cfg.top_k = 0 + 40;
    cfg.sample_seed = seed;
    cfg.speculative = mode;
    cfg.draft_loops = 2;
    cfg.K_branches = K;
    const int32_t prompt[] = {0, 1};
    int32_t *ids;
    int n;
    if (tl_encode(m, "Data:", 5, &ids, &n) != TL_OK) return -1;
    tl_status st = tl_generate(m, n > 0 ? ids : prompt, n > 0 ? n : 2, &cfg, out, 256, out_len, stats);
    tl_free(ids);
    return st == TL_OK ? n : -1;
}

/* Beam search of width `width` from `prompt` (a grammar when g is not NULL); returns the
   prompt length, -1 on error. */
static int beam_sample(tl_model *m, const tl_compiled_grammar *g, int width, const char *prompt, int32_t *out,
                       int *out_len, tl_generate_stats *stats) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    tl_grammar grammar;
    if (g) {
        tl_grammar_use(&grammar, g);
        cfg.grammar = &grammar;
    }
    cfg.max_tokens = 120;
    cfg.loops = 4;
    cfg.beam_size = width;
    int32_t *ids;
    int n;
    if (tl_encode(m, prompt, strlen(prompt), &ids, &n) != TL_OK || n == 0) return -1;
    tl_status st = tl_generate(m, ids, n, &cfg, out, 256, out_len, stats);
    tl_free(ids);
    return st == TL_OK ? n : -1;
}

static char *continuation_text(tl_model *m, const int32_t *out, int len, int prompt_len) {
    int eos = tl_model_info(m)->eos_token_id;
    int n = len - prompt_len;
    if (n > 0 && out[len - 1] == eos) n--;
    char *text = NULL;
    size_t tl;
    if (tl_decode(m, out + prompt_len, n, &text, &tl) != TL_OK) return NULL;
    return text;
}

/* Greedy decoding under g from "Data:", plain, then chain and tree speculative: the
   speculative tokens must equal plain decoding's (and have drafted). Returns plain decoding's
   text (tl_free it; NULL on failure) and its stop reason in *stop. */
static char *greedy_modes_agree(tl_model *m, const tl_compiled_grammar *g, const char *what, tl_stop_reason *stop) {
    int32_t plain[256], out[256];
    int plain_len = 0, len, plain_prompt = 0;
    tl_generate_stats st;
    for (int mode = 0; mode < 3; mode++) {
        const int pl = sample(m, g, 0, 0.0f, mode == 0 ? TL_SPECULATIVE_OFF : mode == 1 ? TL_SPECULATIVE_CHAIN : TL_SPECULATIVE_TREE,
                              mode == 2 ? 3 : 1, mode == 0 ? plain : out, mode == 0 ? &plain_len : &len, &st);
        CHECK(pl > 0, "%s, mode %d: %s", what, mode, tl_last_error());
        if (pl <= 0) return NULL;
        if (mode == 0) {
            plain_prompt = pl;
            if (stop) *stop = st.stop_reason;
            continue;
        }
        CHECK(len == plain_len && memcmp(out, plain, (size_t)len * sizeof *out) == 0,
              "%s: speculative mode %d differs from plain decoding (%d vs %d tokens)", what, mode, len, plain_len);
        CHECK(st.drafted > 0, "%s: mode %d drafted nothing", what, mode);
    }
    return continuation_text(m, plain, plain_len, plain_prompt);
}

/* Sizes a hostile schema or grammar reaches within a server's body (the hunt's 1 MB): refused
   or converted without a quadratic walk or a gigabyte on the way. */
static void test_large_inputs(void) {
    /* oneOf's pairwise check has a budget: 3,000 branches are 4.5 million pairs (20,000 took
       21 s); 2,000 are within it */
    for (int branches = 2000; branches <= 3000; branches += 1000) {
        strbuf s = {0};
        tl_strbuf_puts(&s, "{\"oneOf\":[");
        for (int i = 0; i < branches; i++) tl_strbuf_printf(&s, "%s{\"const\":%d}", i ? "," : "", i);
        tl_strbuf_puts(&s, "]}");
        tl_compiled_grammar *g = NULL;
        if (branches == 2000) {
            CHECK(tl_grammar_compile_json_schema(s.p, s.n, NULL, &g) == TL_OK && matches(g, "1999") == 1 && matches(g, "2000") == 0,
                  "oneOf of 2000 consts: %s", tl_last_error());
        } else {
            CHECK_ERROR(tl_grammar_compile_json_schema(s.p, s.n, NULL, &g), TL_ERR_INVALID_ARGUMENT,
                        "oneOf: too many branches or values to check that no value matches two branches");
        }
        tl_compiled_grammar_free(g);
        free(s.p);
    }
    /* 20,000 properties, every other one required (each required name was compared with every
       property: 50,000 took 24 s); a document of the required ones matches, one without the last fails */
    {
        enum { N = 20000 };
        strbuf s = {0}, doc = {0}, missing = {0};
        tl_strbuf_puts(&s, "{\"type\":\"object\",\"properties\":{");
        for (int i = 0; i < N; i++) tl_strbuf_printf(&s, "%s\"p%d\":{\"type\":\"integer\"}", i ? "," : "", i);
        tl_strbuf_puts(&s, "},\"required\":[");
        for (int i = N - 2; i >= 0; i -= 2) tl_strbuf_printf(&s, "%s\"p%d\"", i == N - 2 ? "" : ",", i);
        tl_strbuf_puts(&s, "]}");
        tl_strbuf_puts(&doc, "{");
        for (int i = 0; i < N; i += 2) tl_strbuf_printf(&doc, "%s\"p%d\":%d", i ? "," : "", i, i);
        tl_strbuf_put(&missing, doc.p, (size_t)(strrchr(doc.p, ',') - doc.p));
        tl_strbuf_puts(&doc, "}");
        tl_strbuf_puts(&missing, "}");
        tl_compiled_grammar *g = NULL;
        CHECK(tl_grammar_compile_json_schema(s.p, s.n, NULL, &g) == TL_OK && matches(g, doc.p) == 1 && matches(g, missing.p) == 0,
              "20,000 properties: %s", tl_last_error());
        tl_compiled_grammar_free(g);
        free(s.p), free(doc.p), free(missing.p);
    }
    /* repetitions checked before they are expanded: 200 x {0,10000} would be 2 million rules
       (800 of them held 1.3 GB before the refusal) */
    {
        strbuf s = {0};
        tl_strbuf_puts(&s, "root ::= ");
        for (int i = 0; i < 200; i++) tl_strbuf_puts(&s, "\"a\"{0,10000} ");
        tl_compiled_grammar *g = NULL;
        CHECK_ERROR(tl_grammar_compile_gbnf(s.p, s.n, &g), TL_ERR_INVALID_ARGUMENT, "grammar too large (over 2^20 rules");
        free(s.p);
    }
}

/* A grammar that keeps thousands of alternatives alive, each a step on every byte of the
   vocabulary's trie: a mask took a second and more (the hunt's 30,000 took 1.4 s a token, on
   the engine thread). Refused past the mask's budget of work, by name; a grammar of as many
   alternatives that begin apart (an enum's shape) stays cheap and generates. */
static void test_too_costly(tl_model *m) {
    for (int apart = 0; apart < 2; apart++) {
        strbuf text = {0};
        tl_strbuf_puts(&text, "root ::= ");
        for (int i = 0; i < 3000; i++) tl_strbuf_printf(&text, "%s%s\"%d\"", i ? " | " : "", apart ? "" : "c ", i);
        tl_strbuf_puts(&text, "\nc ::= [a-z ,.]{0,200}\n");
        tl_compiled_grammar *g = NULL;
        CHECK(tl_grammar_compile_gbnf(text.p, text.n, &g) == TL_OK, "%s", tl_last_error());
        free(text.p);
        if (!g) continue;
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        tl_grammar grammar;
        tl_grammar_use(&grammar, g);
        cfg.grammar = &grammar, cfg.max_tokens = 4, cfg.temperature = 1.0f, cfg.sample_seed = 1;
        const int32_t prompt[2] = {72, 105};
        int32_t out[16];
        int len;
        if (apart)
            CHECK(tl_generate(m, prompt, 2, &cfg, out, 16, &len, NULL) == TL_OK, "alternatives that begin apart: %s", tl_last_error());
        else
            CHECK_ERROR(tl_generate(m, prompt, 2, &cfg, out, 16, &len, NULL), TL_ERR_UNSUPPORTED,
                        "grammar mask: the grammar is too costly to follow: one token's choices took more than");
        tl_compiled_grammar_free(g);
    }
}

static void test_generation(tl_model *m) {
    tl_compiled_grammar *g = load_grammar("tests/data/grammars/json_bounded.gbnf");
    if (!g) return;
    int32_t out[256];
    int parsed = 0, finished = 0;
    for (uint64_t seed = 1; seed <= 200; seed++) {
        int len;
        tl_generate_stats stats;
        int pl = sample(m, g, seed, 1.0f, TL_SPECULATIVE_OFF, 1, out, &len, &stats);
        CHECK(pl > 0, "seed %llu: %s", (unsigned long long)seed, tl_last_error());
        if (pl <= 0) continue;
        finished += stats.stop_reason == TL_STOP_EOS || stats.stop_reason == TL_STOP_GRAMMAR_DEAD_END;
        char *text = continuation_text(m, out, len, pl);
        cJSON *doc = text ? cJSON_Parse(text) : NULL;
        parsed += doc != NULL;
        if (!doc) printf("seed %llu (%s): not JSON: %s\n", (unsigned long long)seed, tl_stop_reason_name(stats.stop_reason), text);
        cJSON_Delete(doc);
        tl_free(text);
    }
    CHECK(finished == 200, "%d of 200 samples finished", finished);
    CHECK(parsed == 200, "%d of 200 samples parse as JSON", parsed);
    printf("json: %d of 200 seeded samples finished and parse\n", parsed);

    /* greedy: speculative chain and tree are bit-identical to plain decoding */
    tl_free(greedy_modes_agree(m, g, "json", NULL));
    int len;
    tl_generate_stats st;
    /* beam search: every hypothesis carries its own grammar state, so the returned one is a
       sentence (the search is deterministic: widths and prompts vary instead of seeds) */
    static const char *beam_prompts[] = {"Data:", "{", "Mr. Darcy said", "The list:"};
    for (int w = 2; w <= 4; w++)
        for (int pi = 0; pi < 4; pi++) {
            int pl = beam_sample(m, g, w, beam_prompts[pi], out, &len, &st);
            CHECK(pl > 0, "beam %d: %s", w, tl_last_error());
            if (pl <= 0) continue;
            CHECK(st.stop_reason == TL_STOP_EOS, "beam %d, prompt %d: stopped by %s", w, pi, tl_stop_reason_name(st.stop_reason));
            char *text = continuation_text(m, out, len, pl);
            int ok = 0;
            if (text) tl_grammar_matches(g, text, strlen(text), &ok);
            CHECK(ok, "beam %d, prompt %d: not a sentence: %s", w, pi, text ? text : "");
            tl_free(text);
        }
    /* a grammar that allows every text changes nothing: the same tokens as without one */
    tl_compiled_grammar *any = NULL;
    const char *any_text = "root ::= [\\x00-\\U0010FFFF]*";
    CHECK(tl_grammar_compile_gbnf(any_text, strlen(any_text), &any) == TL_OK, "%s", tl_last_error());
    for (int w = 2; w <= 4 && any; w++)
        for (int pi = 0; pi < 4; pi++) {
            int32_t free_out[256];
            int free_len;
            int pl = beam_sample(m, any, w, beam_prompts[pi], out, &len, &st);
            int pf = beam_sample(m, NULL, w, beam_prompts[pi], free_out, &free_len, NULL);
            CHECK(pl > 0 && pf > 0, "%s", tl_last_error());
            CHECK(len == free_len && memcmp(out, free_out, (size_t)len * sizeof *out) == 0,
                  "beam %d, prompt %d: an allow-everything grammar changed the result (%d vs %d tokens)", w, pi, len, free_len);
        }
    tl_compiled_grammar_free(any);
    /* and with sampling the chain stays within the grammar */
    for (uint64_t seed = 1; seed <= 10; seed++) {
        int pl = sample(m, g, seed, 0.8f, TL_SPECULATIVE_CHAIN, 1, out, &len, &st);
        CHECK(pl > 0, "%s", tl_last_error());
        char *text = pl > 0 ? continuation_text(m, out, len, pl) : NULL;
        int ok = 0;
        if (text) tl_grammar_matches(g, text, strlen(text), &ok);
        CHECK(ok, "speculative sample %llu is a sentence: %s", (unsigned long long)seed, text ? text : "");
        tl_free(text);
    }
    tl_compiled_grammar_free(g);

    /* schema-constrained samples validate */
    const char *schema_text =
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"pattern\":\"^[a-z]{1,6}$\"},"
        "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\"]},"
        "\"maxItems\":3},\"ok\":{\"type\":\"boolean\"},\"score\":{\"type\":\"number\",\"minimum\":-0.5,\"exclusiveMaximum\":0.25}},"
        "\"required\":[\"name\",\"age\",\"score\"]}";
    /* the validator's schema: pattern dropped (the grammar enforces it; we check the length) */
    const char *check_text =
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":100},"
        "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":120},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\"]},"
        "\"maxItems\":3},\"ok\":{\"type\":\"boolean\"},\"score\":{\"type\":\"number\",\"minimum\":-0.5,\"exclusiveMaximum\":0.25}},"
        "\"required\":[\"name\",\"age\",\"score\"]}";
    tl_compiled_grammar *sg = NULL;
    CHECK(tl_grammar_compile_json_schema(schema_text, strlen(schema_text), NULL, &sg) == TL_OK, "%s", tl_last_error());
    cJSON *check = cJSON_Parse(check_text);
    int valid = 0, runs = 0;
    for (uint64_t seed = 1; sg && seed <= 40; seed++) {
        tl_generate_stats stats;
        int pl = sample(m, sg, seed, 1.0f, TL_SPECULATIVE_OFF, 1, out, &len, &stats);
        if (pl <= 0 || stats.stop_reason == TL_STOP_MAX_TOKENS) continue;
        runs++;
        char *text = continuation_text(m, out, len, pl);
        cJSON *doc = text ? cJSON_Parse(text) : NULL;
        bool ok = doc && validate(doc, check);
        valid += ok;
        if (!ok) printf("schema sample %llu invalid: %s\n", (unsigned long long)seed, text);
        cJSON_Delete(doc);
        tl_free(text);
    }
    CHECK(runs >= 30 && valid == runs, "%d of %d finished schema samples validate", valid, runs);
    printf("schema: %d of %d finished samples validate\n", valid, runs);
    cJSON_Delete(check);
    tl_compiled_grammar_free(sg);
}

/* Masks at many states: seeded random JSON nested up to 7 deep, so that the same place in a
   value recurs under different enclosing frames (states that share a projection, whose mask
   comes from the projection plus the per-state escapes: grammar_mask.c). Each state's mask is
   compared with the per-token check (test_masks), which advances the state itself. */
static uint64_t doc_rng = 0x2545F4914F6CDD1DULL;
static unsigned doc_rand(unsigned n) {
    doc_rng ^= doc_rng << 13;
    doc_rng ^= doc_rng >> 7;
    doc_rng ^= doc_rng << 17;
    return (unsigned)(doc_rng % n);
}
static void doc_value(char *b, size_t cap, int depth) {
    static const char *atoms[] = {"1", "-2.5e3", "\"x\"", "\"a b\"", "true", "null", "\"\"", "0"};
    size_t n = strlen(b);
    const unsigned kind = depth >= 7 ? 2 : doc_rand(3);
    if (kind == 2 || n + 64 > cap) { snprintf(b + n, cap - n, "%s", atoms[doc_rand(8)]); return; }
    const int items = 1 + (int)doc_rand(2);
    snprintf(b + n, cap - n, "%s", kind ? "[" : "{");
    for (int i = 0; i < items; i++) {
        n = strlen(b);
        if (n + 64 > cap) break;
        if (i) snprintf(b + n, cap - n, doc_rand(2) ? ", " : ",");
        n = strlen(b);
        if (!kind) snprintf(b + n, cap - n, "\"k%d\": ", (int)doc_rand(3));
        doc_value(b, cap, depth + 1);
    }
    n = strlen(b);
    snprintf(b + n, cap - n, "%s", kind ? "]" : "}");
}
/* ---------------------------------------------------------------- free text, then a grammar */

/* tl_grammar_compile_after: free text until the trigger, then (after blank space) the grammar.
   What it matches (the trigger found by KMP: overlapping prefixes, a trigger inside the
   answer), and generation: seeded samples where the model writes the trigger continue under
   the grammar and end where it ends; a token spanning the trigger is judged byte by byte;
   greedy speculative decoding equals plain decoding; beam hypotheses carry it too. */
static void test_after(tl_model *m) {
    tl_compiled_grammar *answer = compile("root ::= (\"cat\" | \"dog\") \".\"");
    tl_compiled_grammar *g = NULL;
    CHECK(tl_grammar_compile_after(answer, "abab", 4, 4, &g) == TL_OK, "%s", tl_last_error());
    tl_compiled_grammar_free(answer); /* the combined grammar keeps what it needs */
    static const char *y[] = {"", "free text", "aba", "ababcat.", "abaababdog.", "x abab \n\t cat.", "abacababcat.", NULL};
    static const char *n[] = {"ababcat", "ababx", "abab cat. more", "ababcat.abab", NULL};
    expect(g, "after", y, n);
    /* the trigger's overlaps: "abaabab" holds it from its 4th byte on; the first whole
       trigger is the one that counts ("aababab" has it at its 2nd byte, then "ab") */
    static const char *y2[] = {"abaababdog.", "aababcat.", "cat.", NULL};
    static const char *n2[] = {"aabababdog.", "aababab", NULL};
    expect(g, "after, overlapping", y2, n2);
    tl_compiled_grammar *bad = NULL;
    CHECK(tl_grammar_compile_after(g, "", 0, 4, &bad) == TL_ERR_INVALID_ARGUMENT && !bad, "an empty trigger is refused");
    CHECK(tl_grammar_compile_after(NULL, "x", 1, 4, &bad) == TL_ERR_INVALID_ARGUMENT, "a NULL grammar is refused");
    CHECK(tl_grammar_compile_after(g, "x", 1, 17, &bad) == TL_ERR_INVALID_ARGUMENT && strstr(tl_last_error(), "max_blanks"),
          "max_blanks over 16 is refused");
    CHECK(tl_grammar_compile_after(g, "x", 1, -1, &bad) == TL_ERR_INVALID_ARGUMENT, "a negative max_blanks is refused");
    /* max_blanks: that many blanks between the trigger and the grammar, no more */
    tl_compiled_grammar *cat = compile("root ::= \"cat.\""), *tight = NULL;
    CHECK(tl_grammar_compile_after(cat, "Q:", 2, 0, &tight) == TL_OK, "%s", tl_last_error());
    static const char *y3[] = {"Q:cat.", "x Q:cat.", "Q", NULL};
    static const char *n3[] = {"Q: cat.", "Q:", NULL};
    expect(tight, "after, no blanks", y3, n3);
    tl_compiled_grammar_free(tight);
    tight = NULL;
    CHECK(tl_grammar_compile_after(cat, "Q:", 2, 2, &tight) == TL_OK, "%s", tl_last_error());
    static const char *y4[] = {"Q:\n cat.", "Q:cat.", NULL};
    static const char *n4[] = {"Q:\n\n\tcat.", NULL};
    expect(tight, "after, two blanks", y4, n4);
    tl_compiled_grammar_free(tight);
    /* an optional block first (a model that opens "<think>" itself), then the grammar */
    tight = NULL;
    CHECK(tl_grammar_compile_after_block(cat, "<think>", "</think>", 2, &tight) == TL_OK, "%s", tl_last_error());
    static const char *y5[] = {"cat.", "<think>x</think>cat.", "<think></think>\n cat.", "<think>thinking, unclosed",
                               "\n <think>x</think>cat.", NULL};
    static const char *n5[] = {"x cat.", " cat.", "<think>a</think>dog.", "<think>a</think>cat.</think>", "<think>a</think>   cat.",
                               "<thin", "\n\n\t<think>x</think>cat.", NULL};
    expect(tight, "after a block", y5, n5);
    tl_compiled_grammar_free(tight);
    CHECK(tl_grammar_compile_after_block(cat, "", "</think>", 2, &tight) == TL_ERR_INVALID_ARGUMENT, "an empty open is refused");
    tl_compiled_grammar_free(cat);
    tl_compiled_grammar_free(g);

    /* generation: the shipped model writes " the" often; after it, " cat." or " dog." */
    answer = compile("root ::= (\"cat\" | \"dog\" | \"house\") [.!]");
    g = NULL;
    CHECK(tl_grammar_compile_after(answer, " the", 4, 4, &g) == TL_OK, "%s", tl_last_error());
    tl_compiled_grammar_free(answer);
    if (!g) return;
    int32_t out[256];
    int triggered = 0, free_before = 0, ended = 0;
    for (uint64_t seed = 1; seed <= 40; seed++) {
        int len;
        tl_generate_stats stats;
        const int pl = sample(m, g, seed, 1.0f, TL_SPECULATIVE_OFF, 1, out, &len, &stats);
        CHECK(pl > 0, "seed %llu: %s", (unsigned long long)seed, tl_last_error());
        if (pl <= 0) continue;
        char *text = continuation_text(m, out, len, pl);
        if (!text) continue;
        const char *at = strstr(text, " the");
        int ok = 0;
        tl_grammar_matches(g, text, strlen(text), &ok);
        ended += stats.stop_reason == TL_STOP_EOS;
        if (stats.stop_reason == TL_STOP_EOS) CHECK(ok, "seed %llu: not a sentence: \"%s\"", (unsigned long long)seed, text);
        if (at) {
            triggered++;
            /* after the trigger: blanks, then exactly one answer, and the end */
            const char *rest = at + 4;
            while (*rest == ' ' || *rest == '\t' || *rest == '\n' || *rest == '\r') rest++;
            CHECK(stats.stop_reason != TL_STOP_EOS || strcmp(rest, "cat.") == 0 || strcmp(rest, "dog.") == 0 ||
                      strcmp(rest, "house.") == 0 || strcmp(rest, "cat!") == 0 || strcmp(rest, "dog!") == 0 ||
                      strcmp(rest, "house!") == 0,
                  "seed %llu: after the trigger \"%s\"", (unsigned long long)seed, rest);
            /* before it: text the answer grammar alone could not write */
            free_before += at > text;
        }
        tl_free(text);
    }
    CHECK(triggered >= 10 && free_before >= 5, "the trigger came in %d of 40 samples (%d after free text)", triggered,
          free_before);
    /* (the checks above of whole sentences apply where a sample ended: enough must have) */
    CHECK(ended >= 30, "%d of 40 samples ended", ended);
    printf("after: the trigger came in %d of 40 seeded samples, %d after free text, %d ended\n", triggered, free_before,
           ended);
    tl_compiled_grammar_free(g);
    /* greedy from "Data:" writes a "," early: across that trigger, speculative chain and tree
       are bit-identical to plain decoding, and beam hypotheses carry the grammar */
    answer = compile("root ::= (\"cat\" | \"dog\" | \"house\") [.!]");
    g = NULL;
    CHECK(tl_grammar_compile_after(answer, ",", 1, 4, &g) == TL_OK, "%s", tl_last_error());
    tl_compiled_grammar_free(answer);
    if (!g) return;
    tl_stop_reason stop = TL_STOP_NONE;
    char *greedy = greedy_modes_agree(m, g, "after", &stop);
    CHECK(greedy && strchr(greedy, ',') && stop == TL_STOP_EOS, "greedy crosses the trigger and ends: \"%s\"", greedy ? greedy : "");
    tl_free(greedy);
    int len;
    tl_generate_stats st;
    /* beam search: the returned hypothesis is a sentence when it ends */
    for (int w = 2; w <= 3; w++) {
        const int pl = beam_sample(m, g, w, "Data:", out, &len, &st);
        CHECK(pl > 0, "beam %d: %s", w, tl_last_error());
        if (pl <= 0 || st.stop_reason != TL_STOP_EOS) continue;
        char *text = continuation_text(m, out, len, pl);
        int ok = 0;
        if (text) tl_grammar_matches(g, text, strlen(text), &ok);
        CHECK(ok, "beam %d: not a sentence: %s", w, text ? text : "");
        tl_free(text);
    }
    tl_compiled_grammar_free(g);
}

/* tl_grammar_compile_tags: free text, tags opened by triggers, free text again. */
static tl_compiled_grammar *tags_grammar(const tl_grammar_tag *tags, int n_tags, const char *const *triggers, int n_triggers,
                                         int at_least_one, int max_blanks) {
    tl_grammar_tags_options opts = {max_blanks, at_least_one, 0};
    tl_compiled_grammar *g = NULL;
    CHECK(tl_grammar_compile_tags(tags, n_tags, triggers, n_triggers, &opts, &g) == TL_OK, "%s", tl_last_error());
    return g;
}

static void test_tags(tl_model *m) {
    tl_compiled_grammar *digit = compile("root ::= \"{\" [0-9] \"}\""), *x = compile("root ::= \"x\"+");
    const tl_grammar_tag fa[] = {{"<f=a>", digit, "</f>", 0}, {"<f=b>", x, "</f>", 0}};
    const char *const trig[] = {"<f="};
    tl_compiled_grammar *g = tags_grammar(fa, 2, trig, 1, 0, 0);
    static const char *y1[] = {"", "hello", "hi <f=a>{1}</f> bye", "<f=b>xx</f><f=a>{2}</f>", "a<f<f=b>x</f>", "<f", NULL};
    static const char *n1[] = {"<f=c>", "<f=a>{x}</f>", "<f=a>{1}", "<f=a>{1}</f", "<f=a> {1}</f>", "<f=", NULL};
    expect(g, "tags", y1, n1);
    tl_compiled_grammar_free(g);
    /* tag_first: the text begins with a tag, free text (and more tags) after it */
    {
        tl_grammar_tags_options first = {0, 0, 1};
        CHECK(tl_grammar_compile_tags(fa, 2, trig, 1, &first, &g) == TL_OK, "%s", tl_last_error());
        static const char *yf[] = {"<f=a>{1}</f>", "<f=b>x</f> bye <f=a>{2}</f>", "<f=a>{1}</f>tail", NULL};
        static const char *nf[] = {"", "hello", "hi <f=a>{1}</f>", " <f=a>{1}</f>", "<f=a>{1}", "<f=c>", NULL};
        expect(g, "tags, tag first", yf, nf);
        tl_compiled_grammar_free(g);
        /* each tag ending the text: that one tag and nothing else (xgrammar's at_least_one with stop_after_first) */
        const tl_grammar_tag only[] = {{"<f=a>", digit, "</f>", 1}, {"<f=b>", x, "</f>", 1}};
        CHECK(tl_grammar_compile_tags(only, 2, trig, 1, &first, &g) == TL_OK, "%s", tl_last_error());
        static const char *yo[] = {"<f=a>{1}</f>", "<f=b>xx</f>", NULL};
        static const char *no[] = {"", "a<f=a>{1}</f>", "<f=a>{1}</f> ", "<f=a>{1}</f><f=b>x</f>", NULL};
        expect(g, "tags, one tag first and only", yo, no);
        tl_compiled_grammar_free(g);
    }
    /* at least one tag; a tag that ends the text; blanks after a begin */
    g = tags_grammar(fa, 2, trig, 1, 1, 0);
    static const char *y2[] = {"<f=b>x</f>", "so <f=a>{3}</f> and", NULL};
    static const char *n2[] = {"", "no tag", NULL};
    expect(g, "tags, at least one", y2, n2);
    tl_compiled_grammar_free(g);
    const tl_grammar_tag last[] = {{"<f=a>", digit, "</f>", 1}, {"<f=b>", x, "</f>", 0}};
    g = tags_grammar(last, 2, trig, 1, 0, 2);
    static const char *y3[] = {"<f=b>x</f>", "so <f=a>\n {3}</f>", "none", "<f=b>x</f> more <f=a>{1}</f>", NULL};
    static const char *n3[] = {"<f=a>{1}</f> more", "<f=a>\n \n{3}</f>", NULL};
    expect(g, "tags, one ending the text, two blanks", y3, n3);
    tl_compiled_grammar_free(g);
    /* triggers that overlap: "ab" and "b" complete together after "ab"; each opens its own */
    const tl_grammar_tag ov[] = {{"abX", digit, "", 0}, {"bY", x, ";", 0}};
    const char *const trig2[] = {"ab", "b"};
    g = tags_grammar(ov, 2, trig2, 2, 0, 0);
    static const char *y4[] = {"aabX{1}", "abYx;", "bYxx;c", "zzz", NULL};
    static const char *n4[] = {"ab", "abZ", "bX{1}", "aab", NULL};
    expect(g, "tags, overlapping triggers", y4, n4);
    tl_compiled_grammar_free(g);
    /* what is refused */
    tl_compiled_grammar *bad = NULL;
    const tl_grammar_tag orphan[] = {{"<g=a>", digit, "", 0}};
    CHECK(tl_grammar_compile_tags(orphan, 1, trig, 1, NULL, &bad) == TL_ERR_INVALID_ARGUMENT &&
              strstr(tl_last_error(), "starts with no trigger"), "a begin without its trigger: %s", tl_last_error());
    const char *const empty_trigger[] = {""};
    CHECK(tl_grammar_compile_tags(fa, 2, empty_trigger, 1, NULL, &bad) == TL_ERR_INVALID_ARGUMENT, "an empty trigger");
    CHECK(tl_grammar_compile_tags(fa, 0, trig, 1, NULL, &bad) == TL_ERR_INVALID_ARGUMENT, "no tags");
    const tl_grammar_tag no_content[] = {{"<f=a>", NULL, "", 0}};
    CHECK(tl_grammar_compile_tags(no_content, 1, trig, 1, NULL, &bad) == TL_ERR_INVALID_ARGUMENT, "a tag without content");
    /* triggers that share prefixes, one inside another, twice the same: each opens its tags */
    const tl_grammar_tag nest[] = {{"<a", digit, "", 0}, {"<ab", x, ";", 0}, {"b>", digit, "", 1}};
    const char *const trig5[] = {"<a", "<ab", "<a", "b>"};
    g = tags_grammar(nest, 3, trig5, 4, 0, 0);
    static const char *y5[] = {"<a{1}", "<abxx;", "zb>{2}", "<a{1}<abx;b>{3}", NULL};
    static const char *n5[] = {"<a", "<ab{1}x", "b>{1}tail", "z<ab>{2}", NULL}; /* ("<a" opens first) */
    expect(g, "tags, nested and repeated triggers", y5, n5);
    tl_compiled_grammar_free(g);
    /* big inputs build in one pass: 64 triggers of 256 bytes (the free rules once scanned
       every byte for every pair of states: 44 s), and begins of 4 KB behind a trigger that
       completes in thousands of states no text reaches (each once copied the begin: GBs) */
    static char long_trig[64][257];
    const char *long_p[64];
    for (int i = 0; i < 64; i++) {
        for (int j = 0; j < 256; j++) long_trig[i][j] = (char)('A' + (i * 7 + j * 13) % 50);
        long_trig[i][256] = 0;
        long_p[i] = long_trig[i];
    }
    const tl_grammar_tag long_tag[] = {{long_trig[5], digit, "", 0}};
    g = tags_grammar(long_tag, 1, long_p, 64, 0, 0);
    char *long_text = malloc(300);
    snprintf(long_text, 300, "free %s{7}", long_trig[5]);
    static const char *no_more[] = {NULL};
    const char *y6[] = {long_text, NULL};
    expect(g, "tags, 64 long triggers", y6, no_more);
    tl_compiled_grammar_free(g);
    static char spread[64][257], begins[3][4097];
    for (int i = 1; i < 64; i++) {
        spread[i][0] = (char)('A' + i);
        memset(spread[i] + 1, 'x', 255);
        long_p[i] = spread[i];
    }
    long_p[0] = "x";
    tl_grammar_tag wide[3];
    for (int k = 0; k < 3; k++) {
        begins[k][0] = 'x';
        memset(begins[k] + 1, 'y', 4095);
        begins[k][4095] = (char)('a' + k);
        wide[k] = (tl_grammar_tag){begins[k], digit, "", 0};
    }
    g = tags_grammar(wide, 3, long_p, 64, 0, 0);
    char *wide_text = malloc(4200);
    snprintf(wide_text, 4200, "B%s{4}", begins[2]);
    const char *y7[] = {wide_text, NULL};
    expect(g, "tags, long begins", y7, no_more);
    tl_compiled_grammar_free(g);
    free(long_text);
    free(wide_text);
    tl_grammar_tags_options too_many = {17, 0, 0};
    CHECK(tl_grammar_compile_tags(fa, 2, trig, 1, &too_many, &bad) == TL_ERR_INVALID_ARGUMENT, "max_blanks 17");
    CHECK(bad == NULL, "nothing compiled");
    tl_compiled_grammar_free(digit);
    tl_compiled_grammar_free(x);

    /* generation: the shipped model writes " the" often; each one opens " cat." or " dog."
       and the text runs free again after it */
    tl_compiled_grammar *animal = compile("root ::= (\" cat\" | \" dog\")");
    const tl_grammar_tag the[] = {{" the", animal, ".", 0}};
    const char *const trig3[] = {" the"};
    g = tags_grammar(the, 1, trig3, 1, 0, 0);
    tl_compiled_grammar_free(animal);
    if (!g) return;
    int32_t out[256];
    int tags_seen = 0, ended = 0;
    for (uint64_t seed = 1; seed <= 30; seed++) {
        int len;
        tl_generate_stats stats;
        const int pl = sample(m, g, seed, 1.0f, TL_SPECULATIVE_OFF, 1, out, &len, &stats);
        CHECK(pl > 0, "seed %llu: %s", (unsigned long long)seed, tl_last_error());
        if (pl <= 0) continue;
        char *text = continuation_text(m, out, len, pl);
        if (!text) continue;
        /* every " the" the text holds opens a tag: " cat." or " dog." follows (or the text
           ends inside it) */
        for (const char *at = strstr(text, " the"); at; at = strstr(at, " the")) {
            at += 4;
            const size_t rest = strlen(at);
            const bool whole = strncmp(at, " cat.", 5) == 0 || strncmp(at, " dog.", 5) == 0;
            const bool cut = rest < 5 && (strncmp(at, " cat.", rest) == 0 || strncmp(at, " dog.", rest) == 0);
            CHECK(whole || cut, "seed %llu: a tag not kept after \" the\": \"%s\"", (unsigned long long)seed, at);
            tags_seen += whole;
            if (whole) at += 5;
            else break;
        }
        if (stats.stop_reason == TL_STOP_EOS) {
            ended++;
            int ok = 0;
            tl_grammar_matches(g, text, strlen(text), &ok);
            CHECK(ok, "seed %llu: not a sentence: \"%s\"", (unsigned long long)seed, text);
        }
        tl_free(text);
    }
    CHECK(tags_seen >= 20, "%d tags in 30 samples", tags_seen);
    CHECK(ended >= 20, "%d of 30 samples ended (the sentence check applies to those)", ended);
    printf("tags: %d tags in 30 seeded samples (%d ended)\n", tags_seen, ended);
    tl_compiled_grammar_free(g);
    /* greedy from "Data:" writes "," early: across that trigger, greedy speculative decoding
       is plain decoding under tags too */
    animal = compile("root ::= (\" cat\" | \" dog\")");
    const tl_grammar_tag comma[] = {{",", animal, ".", 0}};
    const char *const trig4[] = {","};
    g = tags_grammar(comma, 1, trig4, 1, 0, 0);
    tl_compiled_grammar_free(animal);
    if (!g) return;
    char *text = greedy_modes_agree(m, g, "tags", NULL);
    CHECK(text && (strstr(text, ", cat.") || strstr(text, ", dog.")), "greedy opens a tag: \"%s\"", text ? text : "");
    tl_free(text);
    tl_compiled_grammar_free(g);
}

static void test_masks_nested(tl_model *m) {
    for (int d = 0; d < 6; d++) {
        char doc[2048] = "{\"top\": ";
        doc_value(doc, sizeof doc - 2, 1);
        strcat(doc, "}");
        test_masks(m, "lua/tinyloop/grammars/json.gbnf", doc);
    }
}

/* A grammar shared by many generations (a server caches compiled grammars by their text) keeps
   its interned tables under a budget: past it, the next matcher, or tl_grammar_matches, starts
   a new generation, and a matcher still on the old one goes on there until it is freed. Before,
   every stack any document met was kept, and after some 12,000 documents 40 deep every request
   failed with "out of memory" for good. */
static void nested_path(char *b, size_t cap, int depth) { /* a random path of arrays and objects */
    size_t n = strlen(b);
    if (n + 16 > cap) return;
    if (depth == 0) { snprintf(b + n, cap - n, "1"); return; }
    const bool array = doc_rand(2);
    snprintf(b + n, cap - n, "%s", array ? "[" : "{\"k\":");
    nested_path(b, cap, depth - 1);
    n = strlen(b);
    snprintf(b + n, cap - n, "%s", array ? "]" : "}");
}

static void test_table_generations(tl_model *m) {
    tl_compiled_grammar *g = schema("{\"type\":\"object\"}");
    if (!g) return;
    g->table_budget = (size_t)256 << 10;
    /* a matcher that starts before the tables are renewed, halfway through its document */
    const char *doc = "{\"name\":[\"Elizabeth\",{\"age\":20}],\"tags\":[]}"; /* compact: the schema's form */
    int32_t *ids = NULL;
    int n_ids = 0;
    CHECK(tl_encode(m, doc, strlen(doc), &ids, &n_ids) == TL_OK && n_ids > 4, "%s", tl_last_error());
    tl_grammar_matcher *early = NULL;
    CHECK(tl_grammar_matcher_new(g, m, &early) == TL_OK, "%s", tl_last_error());
    if (!early || !ids) { tl_free(ids); tl_grammar_matcher_free(early); tl_compiled_grammar_free(g); return; }
    for (int i = 0; i < n_ids / 2; i++) CHECK(tl_grammar_matcher_accept(early, ids[i]) == TL_OK, "%s", tl_last_error());
    tl_gram_tables *first = early->tables;
    int matched = 0;
    size_t most = 0;
    for (int d = 0; d < 600; d++) {
        char text[1024] = "{\"k\":";
        nested_path(text, sizeof text - 2, 40);
        strcat(text, "}");
        matched += matches(g, text) == 1;
        const size_t bytes = tl_gram_runtime_bytes(&g->tables->rt);
        if (bytes > most) most = bytes;
    }
    CHECK(matched == 600, "%d of 600 nested documents matched", matched);
    CHECK(g->generations >= 2 && g->tables != first, "the tables started over %lld times", (long long)g->generations);
    /* a table doubles past the budget; the rest of one document adds little */
    CHECK(most <= 4 * g->table_budget, "the tables grew to %zu bytes on a budget of %zu", most, g->table_budget);
    /* the early matcher goes on in its own generation: the rest of its document, then the end */
    for (int i = n_ids / 2; i < n_ids; i++) CHECK(tl_grammar_matcher_accept(early, ids[i]) == TL_OK, "%s", tl_last_error());
    CHECK(tl_grammar_matcher_is_accepting(early) && early->tables == first, "the early matcher lost its tables");
    /* a new matcher starts on the current generation; a clone stays with its source's */
    tl_grammar_matcher *late = NULL, *twin = NULL;
    CHECK(tl_grammar_matcher_new(g, m, &late) == TL_OK && late->tables == g->tables, "%s", tl_last_error());
    CHECK(tl_gram_matcher_clone(early, &twin) == TL_OK && twin->tables == first && first->users == 2, "clone's tables");
    tl_grammar_memory usage;
    CHECK(tl_grammar_memory_usage(g, &usage) == TL_OK && usage.generations == 2 && usage.restarts == g->generations &&
              usage.table_bytes >= tl_gram_runtime_bytes(&g->tables->rt) + tl_gram_runtime_bytes(&first->rt),
          "memory usage with an old generation: %d generations, %zu table bytes", usage.generations, usage.table_bytes);
    tl_grammar_matcher_free(early); /* the old generation stays for the twin... */
    const int32_t state = tl_gram_matcher_state(twin);
    CHECK(first->users == 1 && tl_grammar_matcher_is_accepting(twin) && state > 0, "the twin lost its tables");
    tl_grammar_matcher_free(twin); /* ...and goes with it (ASan: no leak, no use after free) */
    CHECK(tl_grammar_memory_usage(g, &usage) == TL_OK && usage.generations == 1 &&
              usage.table_bytes == tl_gram_runtime_bytes(&g->tables->rt),
          "memory usage after the old generation went: %d generations", usage.generations);
    for (int i = 0; late && i < n_ids; i++) CHECK(tl_grammar_matcher_accept(late, ids[i]) == TL_OK, "%s", tl_last_error());
    CHECK(late && tl_grammar_matcher_is_accepting(late), "the late matcher refused the document");
    tl_grammar_matcher_free(late);
    tl_free(ids);
    tl_compiled_grammar_free(g);
}

/* A grammar outlives the model it was first used with: its vocabulary trie owns the token bytes
   (it pointed into the freed tokenizer, read again by a reloaded model of the same tokenizer).
   Tries are shared by the grammars used with one tokenizer; memory usage counts what a grammar
   holds. */
static void test_outlives_model(const char *dir) {
    tl_compiled_grammar *g = compile("root ::= [a-z ]+ \".\"\n"), *other = compile("root ::= \"x\"+\n");
    tl_grammar_memory fresh, used, other_usage;
    CHECK(g && tl_grammar_memory_usage(g, &fresh) == TL_OK && fresh.program_bytes > 0 && fresh.vocab_bytes == 0 &&
              fresh.generations == 1 && fresh.restarts == 0 &&
              fresh.own_bytes == fresh.program_bytes + fresh.table_bytes + fresh.mask_bytes,
          "a fresh grammar's memory usage");
    CHECK(tl_grammar_memory_usage(NULL, &fresh) == TL_ERR_INVALID_ARGUMENT && tl_grammar_memory_usage(g, NULL) == TL_ERR_INVALID_ARGUMENT,
          "memory usage of NULL");
    uint8_t *first = NULL, *again = NULL;
    int vocab = 0;
    for (int round = 0; round < 2 && g && other; round++) {
        tl_model *m = NULL;
        if (tl_model_load(dir, NULL, &m) != TL_OK) { CHECK(0, "load %s: %s", dir, tl_last_error()); break; }
        vocab = tl_model_info(m)->vocab_size;
        uint8_t *allowed = calloc((size_t)vocab, 1);
        tl_grammar_matcher *mt = NULL, *other_mt = NULL;
        CHECK(tl_grammar_matcher_new(g, m, &mt) == TL_OK && tl_grammar_matcher_new(other, m, &other_mt) == TL_OK, "%s",
              tl_last_error());
        int32_t *ids = NULL;
        int n_ids = 0, count = 0;
        CHECK(tl_encode(m, "it is a truth", 13, &ids, &n_ids) == TL_OK, "%s", tl_last_error());
        for (int i = 0; mt && i < n_ids; i++) CHECK(tl_grammar_matcher_accept(mt, ids[i]) == TL_OK, "%s", tl_last_error());
        CHECK(mt && tl_grammar_matcher_mask(mt, allowed, vocab, &count) == TL_OK && count > 0, "%s", tl_last_error());
        if (round == 0) {
            first = allowed;
            CHECK(mt && other_mt && mt->vocab == other_mt->vocab, "two grammars on one tokenizer built two tries");
            CHECK(tl_grammar_memory_usage(g, &used) == TL_OK && tl_grammar_memory_usage(other, &other_usage) == TL_OK,
                  "%s", tl_last_error());
            CHECK(used.vocab_bytes > (size_t)vocab && used.vocab_bytes == other_usage.vocab_bytes &&
                      used.table_bytes > fresh.table_bytes && used.mask_bytes > 0 &&
                      used.own_bytes == used.program_bytes + used.table_bytes + used.mask_bytes,
                  "memory usage after use: vocab %zu (other %zu), tables %zu (fresh %zu), masks %zu", used.vocab_bytes,
                  other_usage.vocab_bytes, used.table_bytes, fresh.table_bytes, used.mask_bytes);
            /* while the grammar is in use (its lock held, as by a mask being computed), the
               figures found last, at once */
            tl_grammar_memory busy;
            pthread_mutex_lock(&g->lock);
            const tl_status busy_st = tl_grammar_memory_usage(g, &busy);
            pthread_mutex_unlock(&g->lock);
            CHECK(busy_st == TL_OK && busy.own_bytes == used.own_bytes && busy.table_bytes == used.table_bytes &&
                      busy.mask_bytes == used.mask_bytes && busy.generations == used.generations,
                  "memory usage while in use: %d, own %zu (%zu), tables %zu (%zu), masks %zu (%zu), generations %d (%d)",
                  busy_st, busy.own_bytes, used.own_bytes, busy.table_bytes, used.table_bytes, busy.mask_bytes,
                  used.mask_bytes, busy.generations, used.generations);
        } else {
            again = allowed;
        }
        if (round == 0) { /* trimmed, g keeps the running matcher's generation until it goes */
            uint8_t *after_trim = calloc((size_t)vocab, 1);
            tl_grammar_memory trimmed;
            CHECK(tl_grammar_trim(g) == TL_OK && tl_grammar_memory_usage(g, &trimmed) == TL_OK && trimmed.generations == 2 &&
                      trimmed.restarts == used.restarts + 1,
                  "trimmed with a matcher running: %d generations", trimmed.generations);
            CHECK(after_trim && tl_grammar_matcher_mask(mt, after_trim, vocab, &count) == TL_OK &&
                      memcmp(after_trim, allowed, (size_t)vocab) == 0,
                  "the running matcher's mask changed with the trim");
            free(after_trim);
            tl_grammar_matcher_free(mt);
            mt = NULL;
            CHECK(tl_grammar_memory_usage(g, &trimmed) == TL_OK && trimmed.generations == 1 && trimmed.mask_bytes == 0 &&
                      trimmed.table_bytes == fresh.table_bytes,
                  "after the trim and the matcher: %d generations, %zu mask bytes, %zu table bytes (fresh %zu)",
                  trimmed.generations, trimmed.mask_bytes, trimmed.table_bytes, fresh.table_bytes);
            CHECK(tl_grammar_trim(NULL) == TL_ERR_INVALID_ARGUMENT, "trim of NULL");
        }
        tl_free(ids);
        tl_grammar_matcher_free(mt);
        tl_grammar_matcher_free(other_mt);
        if (round == 0) { /* the other grammar goes first; the trie stays with g */
            tl_compiled_grammar_free(other);
            other = compile("root ::= \"x\"+\n");
        }
        tl_model_free(m);
    }
    CHECK(first && again && memcmp(first, again, (size_t)vocab) == 0, "the mask after the model was reloaded differs");
    free(first);
    free(again);
    tl_compiled_grammar_free(other);
    tl_compiled_grammar_free(g);
}

/* ---------------------------------------------------------------- token references
   llama.cpp's <[id]>, <text> and !<...>: one whole token by id, special tokens included, on a
   small vocabulary with two special tokens of a thinking model. Each state's mask is checked
   against advancing the state by every token. */
/* (tests/data/tokenizer/thinking9.json: a, b, ab, " ", <, >, then <think> 6, </think> 7 and
   <|end|> 8, special) */
enum { REF_VOCAB = 9, REF_EOS = 8 };

/* The mask at the matcher's state, and that it allows exactly the tokens that advance it. */
static int ref_mask(tl_grammar_matcher *mt, uint8_t *allowed) {
    const int n = tl_gram_matcher_mask_state(mt, tl_gram_matcher_state(mt), allowed);
    for (int t = 0; t < REF_VOCAB; t++) {
        const int32_t next = tl_gram_matcher_advance_state(mt, tl_gram_matcher_state(mt), t);
        CHECK(next >= 0 && allowed[t] == (next != GRAM_DEAD), "token %d: mask %d, advance %d", t, allowed[t], (int)next);
    }
    return n;
}

static tl_grammar_matcher *ref_matcher(const tl_tlz_tokenizer *tok, const char *gbnf, tl_compiled_grammar **g) {
    *g = compile(gbnf);
    tl_grammar_matcher *mt = NULL;
    if (*g) CHECK(tl_gram_matcher_new(*g, tok, REF_VOCAB, REF_EOS, &mt) == TL_OK, "%s: %s", gbnf, tl_last_error());
    return mt;
}

static void test_token_refs(void) {
    tl_tlz_tokenizer *tok = NULL;
    char err[256] = "", path[1024];
    snprintf(path, sizeof path, "%s/tests/data/tokenizer/thinking9.json", root_dir);
    CHECK(tl_tlz_tokenizer_load(path, &tok, err, sizeof err) == TLZ_OK, "%s", err);
    if (!tok) return;
    uint8_t allowed[REF_VOCAB];
    /* <think> by its text, </think> by its id: only they, where they stand */
    tl_compiled_grammar *g;
    tl_grammar_matcher *mt = ref_matcher(tok, "root ::= <think> \"ab\"* <[7]> \"a\"", &g);
    if (mt) {
        CHECK(ref_mask(mt, allowed) == 1 && allowed[6], "first only <think>");
        CHECK(tl_grammar_matcher_accept(mt, 6) == TL_OK, "%s", tl_last_error());
        CHECK(ref_mask(mt, allowed) == 3 && allowed[0] && allowed[2] && allowed[7], "then \"a\" (a prefix of ab), ab, </think>");
        static const int32_t rest[] = {2, 0, 1, 7, 0};
        for (int i = 0; i < 5; i++) CHECK(tl_grammar_matcher_accept(mt, rest[i]) == TL_OK, "token %d: %s", rest[i], tl_last_error());
        CHECK(tl_grammar_matcher_is_accepting(mt) && ref_mask(mt, allowed) == 1 && allowed[REF_EOS], "the end");
        CHECK_ERROR(tl_grammar_matcher_rollback(mt, 2) == TL_OK ? tl_grammar_matcher_accept(mt, 6) : TL_ERR_INTERNAL,
                    TL_ERR_INVALID_ARGUMENT, "token 6 is not allowed by the grammar here");
        /* the text of a token reference is no text: matching text never passes one */
        CHECK(matches(g, "<think>ab</think>a") == 0, "text passed a token reference");
    }
    tl_grammar_matcher_free(mt);
    tl_compiled_grammar_free(g);
    /* !</think>: any one token but that (and the end), special or not, until </think> */
    mt = ref_matcher(tok, "root ::= <think> (!</think>)* </think>", &g);
    if (mt) {
        CHECK(tl_grammar_matcher_accept(mt, 6) == TL_OK, "%s", tl_last_error());
        CHECK(ref_mask(mt, allowed) == REF_VOCAB - 1 && !allowed[REF_EOS], "inside: every token but the end");
        static const int32_t inside[] = {0, 6, 3, 2, 5, 7};
        for (int i = 0; i < 6; i++) {
            CHECK(tl_grammar_matcher_accept(mt, inside[i]) == TL_OK, "token %d: %s", inside[i], tl_last_error());
            ref_mask(mt, allowed);
        }
        CHECK(tl_grammar_matcher_is_accepting(mt), "</think> ends it");
    }
    tl_grammar_matcher_free(mt);
    tl_compiled_grammar_free(g);
    /* a special token that also ends the text (a one-token stop sequence): the end where the
       grammar may end, and elsewhere a token like any other, which a reference takes */
    mt = ref_matcher(tok, "root ::= <think> \"a\" </think> \"b\"", &g);
    if (mt) {
        const int32_t end_id = 7;
        const tl_token_seq stop = {&end_id, 1};
        tl_gram_matcher_set_ends(mt, &stop, 1);
        static const int32_t text[] = {6, 0, 7, 1};
        for (int i = 0; i < 4; i++) {
            ref_mask(mt, allowed);
            CHECK(allowed[text[i]] == 1 && (text[i] != 7 || allowed[7]), "token %d allowed", text[i]);
            CHECK(tl_grammar_matcher_accept(mt, text[i]) == TL_OK, "token %d: %s", text[i], tl_last_error());
        }
        CHECK(tl_grammar_matcher_is_accepting(mt) && ref_mask(mt, allowed) == 2 && allowed[7] && allowed[REF_EOS],
              "at the end: </think> ends the text as eos does");
    }
    tl_grammar_matcher_free(mt);
    tl_compiled_grammar_free(g);
    /* nested deeper than a projection's cut, a token reference and bytes at every level */
    mt = ref_matcher(tok, "root ::= x\nx ::= <think> x </think> | \"a\" x \"b\" | \"ab\"", &g);
    static const int32_t deep[] = {6, 0, 6, 6, 0, 0, 6, 2, 7, 1, 1, 7, 7, 1, 7};
    for (int i = 0; mt && i < 15; i++) {
        ref_mask(mt, allowed);
        CHECK(allowed[deep[i]] && tl_grammar_matcher_accept(mt, deep[i]) == TL_OK, "token %d of the nested text", i);
    }
    CHECK(mt && tl_grammar_matcher_is_accepting(mt), "nested text accepted");
    tl_grammar_matcher_free(mt);
    tl_compiled_grammar_free(g);
    /* a reference inside a grammar that opens after a trigger (its references copied) */
    tl_compiled_grammar *content = compile("root ::= <[6]> \"b\"");
    tl_compiled_grammar *after = NULL;
    CHECK(content && tl_grammar_compile_after(content, "ab", 2, 0, &after) == TL_OK, "%s", tl_last_error());
    if (after && tl_gram_matcher_new(after, tok, REF_VOCAB, REF_EOS, &mt) == TL_OK) {
        static const int32_t text[] = {0, 3, 2, 6, 1};
        for (int i = 0; i < 5; i++) {
            ref_mask(mt, allowed);
            CHECK(tl_grammar_matcher_accept(mt, text[i]) == TL_OK, "after, token %d: %s", text[i], tl_last_error());
        }
        CHECK(tl_grammar_matcher_is_accepting(mt), "after: accepted");
        tl_grammar_matcher_free(mt);
    } else CHECK(0, "after: %s", tl_last_error());
    tl_compiled_grammar_free(after);
    tl_compiled_grammar_free(content);
    /* negated references never take the tokens that end the text (eos, a matcher's ends), as
       in llama.cpp: inside, an end token is refused until the grammar may end */
    mt = ref_matcher(tok, "root ::= \"a\" (!<[1]>)* \"b\"", &g);
    if (mt) {
        const int32_t end_id = 6;
        const tl_token_seq stop = {&end_id, 1};
        tl_gram_matcher_set_ends(mt, &stop, 1);
        static const int32_t text[] = {0, 7, 3, 0, 1};
        for (int i = 0; i < 5; i++) {
            CHECK(ref_mask(mt, allowed) >= 1 && (i == 0 || (!allowed[6] && !allowed[REF_EOS])), "token %d: ends refused", i);
            CHECK(tl_grammar_matcher_accept(mt, text[i]) == TL_OK, "token %d: %s", text[i], tl_last_error());
        }
        CHECK(tl_grammar_matcher_is_accepting(mt) && ref_mask(mt, allowed) == 2 && allowed[6] && allowed[REF_EOS],
              "at the end, the ends");
    }
    tl_grammar_matcher_free(mt);
    tl_compiled_grammar_free(g);
    /* a vocabulary that differs only in a special token's text resolves the references apart
       (it shared the first one's: <think> read as the other's token 6, and a name it lacks passed) */
    size_t json_len = 0;
    char *renamed = slurp("tests/data/tokenizer/thinking9.json", &json_len);
    for (char *at = renamed ? strstr(renamed, "<think>") : NULL; at; at = strstr(at, "<think>")) memcpy(at, "<thonk>", 7);
    tl_tlz_tokenizer *other = NULL;
    CHECK(renamed && tl_tlz_tokenizer_load_json(renamed, json_len, &other, err, sizeof err) == TLZ_OK, "%s", err);
    g = compile("root ::= <think> \"a\"");
    tl_grammar_matcher *first = NULL;
    mt = NULL;
    CHECK(g && tl_gram_matcher_new(g, tok, REF_VOCAB, REF_EOS, &first) == TL_OK, "%s", tl_last_error());
    if (g && other) CHECK_ERROR(tl_gram_matcher_new(g, other, REF_VOCAB, REF_EOS, &mt), TL_ERR_INVALID_ARGUMENT,
                                "<think> is not a token of the model's vocabulary");
    tl_grammar_matcher_free(first);
    tl_grammar_matcher_free(mt);
    tl_compiled_grammar_free(g);
    /* a tokenizer loaded after another was freed (often at its address) is not taken for it:
       vocabulary fingerprints are remembered by tl_tlz_serial, which is never reused */
    const uint64_t renamed_serial = tl_tlz_serial(other);
    tl_tlz_tokenizer_free(other);
    g = compile("root ::= <thonk> \"a\"");
    for (int round = 0; round < 2 && g; round++) {
        other = NULL;
        CHECK(tl_tlz_tokenizer_load_json(renamed, json_len, &other, err, sizeof err) == TLZ_OK, "%s", err);
        CHECK(other && tl_tlz_serial(other) != renamed_serial && tl_tlz_serial(other) != tl_tlz_serial(tok), "a serial was reused");
        mt = NULL;
        CHECK(other && tl_gram_matcher_new(g, other, REF_VOCAB, REF_EOS, &mt) == TL_OK, "%s", tl_last_error());
        tl_grammar_matcher_free(mt);
        tl_tlz_tokenizer_free(other);
        size_t plain_len = 0; /* the unrenamed vocabulary, likely where the renamed one was */
        char *plain = slurp("tests/data/tokenizer/thinking9.json", &plain_len);
        other = NULL;
        CHECK(plain && tl_tlz_tokenizer_load_json(plain, plain_len, &other, err, sizeof err) == TLZ_OK, "%s", err);
        mt = NULL;
        if (other) CHECK_ERROR(tl_gram_matcher_new(g, other, REF_VOCAB, REF_EOS, &mt), TL_ERR_INVALID_ARGUMENT,
                               "<thonk> is not a token of the model's vocabulary");
        tl_grammar_matcher_free(mt);
        tl_tlz_tokenizer_free(other);
        free(plain);
    }
    tl_compiled_grammar_free(g);
    free(renamed);
    /* references the vocabulary does not have: refused when a matcher binds it; and the end of
       text named, which no reference takes (the grammar ends where it may end) */
    static const struct { const char *gbnf, *needle; } missing[] = {
        {"root ::= <nope>", "grammar: <nope> is not a token of the model's vocabulary"},
        {"root ::= \"a\" !<[9]>", "grammar: !<[9]> is past the model's vocabulary (9 tokens)"},
        {"root ::= \"a\" <|end|>", "grammar: <|end|> is the end of text, which no reference takes"},
        {"root ::= \"a\" <[8]>", "grammar: <[8]> is the end of text"},
    };
    for (int i = 0; i < 4; i++) {
        g = compile(missing[i].gbnf);
        mt = NULL;
        if (g) CHECK_ERROR(tl_gram_matcher_new(g, tok, REF_VOCAB, REF_EOS, &mt), TL_ERR_INVALID_ARGUMENT, missing[i].needle);
        CHECK(mt == NULL, "no matcher");
        tl_compiled_grammar_free(g);
    }
    tl_tlz_tokenizer_free(tok);
}

/* GPT-2's vocabulary: 50257 tokens, not a multiple of 64, so a cached bitset ends in a partial
   word, and its string tokens make projections' deltas large (some over the size of a bitset,
   which are then cached as one). At every state of nested documents, the mask, cold and then
   from the cache, equals the state's own uncached walk (tl_gram_mask_full, which test_masks holds
   to the per-token check on the other vocabularies). With a cache budget of a few masks too,
   so that it starts over often, projections' entries included. */
static void test_masks_gpt2(tl_tlz_tokenizer *tok, size_t budget) {
    tl_compiled_grammar *g = load_grammar("lua/tinyloop/grammars/json.gbnf");
    if (!g) return;
    const int vocab = tl_tlz_vocab_size(tok);
    tl_grammar_matcher *mt = NULL;
    CHECK(tl_gram_matcher_new(g, tok, vocab, tl_tlz_token_id(tok, "<|endoftext|>"), &mt) == TL_OK, "%s", tl_last_error());
    if (mt && budget) mt->tables->bindings[mt->binding].mask_budget = budget;
    doc_rng = 0x9E3779B97F4A7C15ULL; /* the same documents for every budget */
    uint8_t *mask = malloc((size_t)vocab), *ref = malloc((size_t)vocab);
    int states = 0, mismatches = 0;
    for (int d = 0; d < 8 && mt; d++) {
        char doc[2048] = "{\"top\": ";
        doc_value(doc, sizeof doc - 2, 1);
        strcat(doc, "}");
        int32_t *ids = NULL;
        size_t n = 0;
        CHECK(tl_tlz_encode(tok, doc, strlen(doc), &ids, &n, NULL, 0) == 0, "encode %s", doc);
        for (int pass = 0; pass < 2; pass++) {
            for (size_t i = 0; i <= n; i++) {
                const int32_t state = tl_gram_matcher_state(mt);
                const int count = tl_gram_matcher_mask_state(mt, state, mask);
                const int want = tl_gram_mask_full(&mt->tables->rt, &mt->tables->bindings[mt->binding], state, ref);
                states++;
                if (count != want || memcmp(mask, ref, (size_t)vocab) != 0) mismatches++;
                if (i < n && tl_grammar_matcher_accept(mt, ids[i]) != TL_OK) {
                    CHECK(0, "token %zu of %s: %s", i, doc, tl_last_error());
                    break;
                }
            }
            while (tl_grammar_matcher_rollback(mt, 1) == TL_OK) {}
        }
        free(ids);
    }
    CHECK(states > 500 && mismatches == 0, "GPT-2 json.gbnf, cache budget %zu: %d of %d masks differ from the uncached walk",
          budget, mismatches, states);
    free(mask);
    free(ref);
    tl_grammar_matcher_free(mt);
    tl_compiled_grammar_free(g);
}

/* ---------------------------------------------------------------- edges a mutation round found untested */

/* Each limit of the tag and trigger grammars at the limit (taken) and one past (refused); a
   trigger that completes as a suffix of another's prefix fires; GBNF text at its edges (the
   last code point in a negated class, a surrogate pair that is not one, an error's column
   after a two-byte character, a NUL in the text); a matcher's mask of another vocabulary size
   refused; a negated reference to the end of text usable with the model; a one-token stop
   sequence of ordinary text not taken for an end of the grammar. */
static void test_edges(tl_model *m) {
    tl_compiled_grammar *x = compile("root ::= \"x\"");
    if (!x) return;
    tl_compiled_grammar *g = NULL;
    const char *suffix_triggers[] = {"abc", "b"};
    tl_grammar_tag suffix_tags[] = {{"b", x, "", 0}, {"abc", x, "", 0}};
    CHECK(tl_grammar_compile_tags(suffix_tags, 2, suffix_triggers, 2, NULL, &g) == TL_OK, "%s", tl_last_error());
    if (g) {
        CHECK(matches(g, "aby") == 0 && matches(g, "abx") == 1, "at \"ab\" the trigger \"b\" fires: aby %d, abx %d",
              matches(g, "aby"), matches(g, "abx"));
        tl_compiled_grammar_free(g), g = NULL;
    }
    const char *trigger[] = {"<t>"};
    tl_grammar_tag tag[] = {{"<t>", x, "</t>", 0}};
    for (int field = 0; field < 3; field++) {
        tl_grammar_tags_options o = {0, 0, 0};
        if (field == 0) o.at_least_one = 2;
        if (field == 1) o.tag_first = 2;
        if (field == 2) o.max_blanks = 17;
        CHECK_ERROR(tl_grammar_compile_tags(tag, 1, trigger, 1, &o, &g), TL_ERR_INVALID_ARGUMENT, field == 0 ? "at_least_one" :
                    field == 1 ? "tag_first" : "max_blanks");
    }
    tl_grammar_tags_options most = {16, 1, 1};
    CHECK(tl_grammar_compile_tags(tag, 1, trigger, 1, &most, &g) == TL_OK, "max_blanks 16: %s", tl_last_error());
    tl_compiled_grammar_free(g), g = NULL;
    static char long_text[4098];
    memset(long_text, 'e', 4097);
    tl_grammar_tag long_end[] = {{"<t>", x, long_text, 0}};
    CHECK_ERROR(tl_grammar_compile_tags(long_end, 1, trigger, 1, NULL, &g), TL_ERR_INVALID_ARGUMENT, "end");
    long_text[4096] = 0;
    CHECK(tl_grammar_compile_tags(long_end, 1, trigger, 1, NULL, &g) == TL_OK, "an end of 4096 bytes: %s", tl_last_error());
    tl_compiled_grammar_free(g), g = NULL;
    memset(long_text, 'q', 257);
    long_text[257] = 0;
    CHECK_ERROR(tl_grammar_compile_after(x, long_text, 257, 0, &g), TL_ERR_INVALID_ARGUMENT, "trigger");
    CHECK(tl_grammar_compile_after(x, long_text, 256, 16, &g) == TL_OK, "a trigger of 256 bytes: %s", tl_last_error());
    tl_compiled_grammar_free(g), g = NULL;
    CHECK_ERROR(tl_grammar_compile_after(x, "<t>", 3, 17, &g), TL_ERR_INVALID_ARGUMENT, "max_blanks");

    /* GBNF text */
    g = compile("root ::= [^\\x00-\\U0010FFFE]");
    if (g) CHECK(matches(g, "\xf4\x8f\xbf\xbf") == 1 && matches(g, "\xf4\x8f\xbf\xbe") == 0, "U+10FFFF in a negated class");
    tl_compiled_grammar_free(g), g = NULL;
    const char *not_a_pair = "root ::= \"\\uD800\\uE000\"";
    CHECK_ERROR(tl_grammar_compile_gbnf(not_a_pair, strlen(not_a_pair), &g), TL_ERR_INVALID_ARGUMENT, "surrogate");
    const char *after_two_bytes = "root ::= \"\xc3\xa9\" @";
    CHECK_ERROR(tl_grammar_compile_gbnf(after_two_bytes, strlen(after_two_bytes), &g), TL_ERR_INVALID_ARGUMENT, "column 14");
    const char with_nul[] = "root ::= \"a\0b\"";
    CHECK_ERROR(tl_grammar_compile_gbnf(with_nul, sizeof with_nul - 1, &g), TL_ERR_INVALID_ARGUMENT, "NUL byte");

    /* with the model */
    tl_grammar_matcher *mt = NULL;
    g = compile("root ::= !<|endoftext|> \"a\"");
    CHECK(g && tl_grammar_matcher_new(g, m, &mt) == TL_OK, "a negated end-of-text reference: %s", tl_last_error());
    const int vocab = tl_model_info(m)->vocab_size;
    uint8_t *allowed = calloc((size_t)vocab, 1);
    int count = -1;
    if (mt && allowed) {
        CHECK(tl_grammar_matcher_mask(mt, allowed, vocab, &count) == TL_OK && count > 0 &&
                  !allowed[tl_model_info(m)->eos_token_id], "its first mask: %d allowed, the end of text among them: %d", count,
              allowed[tl_model_info(m)->eos_token_id]);
        CHECK_ERROR(tl_grammar_matcher_mask(mt, allowed, vocab - 1, &count), TL_ERR_INVALID_ARGUMENT, "vocab_size");
    }
    free(allowed);
    tl_grammar_matcher_free(mt);
    tl_compiled_grammar_free(g), g = NULL;
    int32_t *dot = NULL, *prompt = NULL;
    int n_dot = 0, n_prompt = 0;
    g = compile("root ::= \"yes\"");
    if (g && tl_encode(m, ".", 1, &dot, &n_dot) == TL_OK && n_dot == 1 && tl_encode(m, "Say yes", 7, &prompt, &n_prompt) == TL_OK) {
        tl_grammar use;
        tl_grammar_use(&use, g);
        tl_token_seq stop = {dot, 1};
        tl_logit_bias bias = {dot[0], 100.0f};
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 8;
        cfg.grammar = &use;
        cfg.stop_sequences = &stop;
        cfg.n_stop_sequences = 1;
        cfg.logit_bias = &bias;
        cfg.n_logit_bias = 1;
        int32_t out[64];
        int len = 0;
        tl_generate_stats st;
        CHECK(tl_generate(m, prompt, n_prompt, &cfg, out, 64, &len, &st) == TL_OK, "%s", tl_last_error());
        CHECK(st.stop_reason == TL_STOP_EOS && out[len - 1] != dot[0], "a text stop token where only the end may follow: "
              "stopped by %s at %d", tl_stop_reason_name(st.stop_reason), out[len - 1]);
    } else CHECK(0, "encode: %s", tl_last_error());
    tl_free(dot);
    tl_free(prompt);
    tl_compiled_grammar_free(g);
    tl_compiled_grammar_free(x);
}

int main(int argc, char **argv) {
    root_dir = argc > 1 ? argv[1] : ".";
    test_parse_errors();
    test_dialect();
    test_llama_grammars();
    test_shipped_grammars();
    test_json_schema();
    test_too_ambiguous();
    test_large_inputs();
    test_token_refs();
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tests/data/textmodel", root_dir);
    tl_model *small = NULL;
    if (tl_model_load(dir, NULL, &small) == TL_OK) {
        test_masks(small, "lua/tinyloop/grammars/json.gbnf", "{\"a\": [1, 2.5, \"xy z\"], \"b\": null}");
        tl_model_free(small);
    } else CHECK(0, "load %s: %s", dir, tl_last_error());
    snprintf(dir, sizeof dir, "%s/models/tinyloop-austen", root_dir);
    tl_model *m = NULL;
    tl_load_options opts;
    tl_load_options_init(&opts);
    opts.n_threads = 1;
    if (tl_model_load(dir, &opts, &m) == TL_OK) {
        test_masks(m, "lua/tinyloop/grammars/json.gbnf", "{\"name\": \"Elizabeth Bennet\", \"age\": 20, \"tags\": [\"wit\"]}");
        test_masks(m, "tests/data/grammars/llama.cpp/c.gbnf", "int main(){return 0;}");
        test_masks_nested(m);
        test_table_generations(m);
        test_generation(m);
        test_too_costly(m);
        test_after(m);
        test_tags(m);
        test_edges(m);
        tl_model_free(m);
    } else CHECK(0, "load %s: %s", dir, tl_last_error());
    test_outlives_model(dir);
    snprintf(dir, sizeof dir, "%s/tests/data/gpt2/tokenizer.json", root_dir);
    tl_tlz_tokenizer *gpt2 = NULL;
    char err[256] = "";
    CHECK(tl_tlz_tokenizer_load(dir, &gpt2, err, sizeof err) == 0, "%s: %s", dir, err);
    if (gpt2) {
        test_masks_gpt2(gpt2, 0);
        test_masks_gpt2(gpt2, 32 << 10); /* about five bitsets */
        tl_tlz_tokenizer_free(gpt2);
    }
    return check_summary();
}

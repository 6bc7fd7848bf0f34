/* Tests of the pre-tokenizer pipeline (engine/src/pretokenizer.c) through the tokenizer.
 *
 * Usage: test_pretokenizer DATA_DIR     (DATA_DIR = tests/data)
 * 1. DATA_DIR/tokenizer/pretok/pretok.cases: synthetic tokenizer.json files with Huginn-0125's
 *    and Ouro's published pre_tokenizer settings, plus every Split behaviour, invert, String
 *    patterns, empty matches, Digits runs and nesting; the ids were computed by the independent
 *    reference scripts/reference/pretok_ref.py and must match exactly.
 * 2. Bad pre_tokenizer specs fail the load with a message naming the field and value.
 * 3. tl_model_load of an HF folder (DATA_DIR/hf/huginn_f32) with a Huginn-style tokenizer.json.
 */
#define _DEFAULT_SOURCE /* mkdtemp */
#include "check.h"
#include "pretokenizer.h"
#include "tinyloop.h"
#include "tokenizer.h"

#include <cjson/cJSON.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t cap = 0, n = 0, got;
    do {
        if (n == cap) {
            char *nb = realloc(buf, cap ? 2 * cap + 1 : 65537);
            if (!nb) { free(buf); fclose(f); return NULL; }
            buf = nb;
            cap = cap ? 2 * cap : 65536;
        }
        got = fread(buf + n, 1, cap - n, f);
        n += got;
    } while (got > 0);
    fclose(f);
    buf[n] = '\0';
    *len = n;
    return buf;
}

static int write_all(const char *path, const char *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/* C escapes of the cases file: \n \t \r \\ \xNN. */
static size_t unescape(const char *s, size_t n, char *o)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 == n) { o[k++] = s[i]; continue; }
        char c = s[++i];
        if (c == 'n') o[k++] = '\n';
        else if (c == 't') o[k++] = '\t';
        else if (c == 'r') o[k++] = '\r';
        else if (c == 'x' && i + 2 < n) {
            char hex[3] = {s[i + 1], s[i + 2], 0};
            o[k++] = (char)strtol(hex, NULL, 16);
            i += 2;
        } else o[k++] = c;
    }
    return k;
}

/* Configurations that drop text (Removed) or add some (a prefix space) cannot decode back to
   their input; every other one must. */
static int lossless(const char *file)
{
    return strcmp(file, "removed.json") && strcmp(file, "inverted_removed.json") &&
           strcmp(file, "digits_runs_prefix.json");
}

static void test_reference_cases(const char *data)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/pretok/pretok.cases", data);
    size_t len;
    char *txt = read_all(path, &len);
    CHECK(txt != NULL, "cannot read %s", path);
    if (!txt) return;
    tl_tlz_tokenizer *tok = NULL;
    char file[256] = "", err[512];
    int n_files = 0, n_cases = 0, n_bad = 0, n_roundtrips = 0;
    for (char *line = txt; line && *line;) {
        char *eol = strchr(line, '\n');
        if (eol) *eol = '\0';
        if (line[0] == '@' && line[1] == ' ') {
            tl_tlz_tokenizer_free(tok);
            tok = NULL;
            snprintf(file, sizeof file, "%s", line + 2);
            snprintf(path, sizeof path, "%s/tokenizer/pretok/%s", data, file);
            int rc = tl_tlz_tokenizer_load(path, &tok, err, sizeof err);
            CHECK(rc == TLZ_OK, "load %s: %s", file, err);
            n_files++;
        } else if (line[0] != '#' && strchr(line, '\t') && tok) {
            char *tab = strchr(line, '\t');
            size_t cap = (size_t)(tab - line) + 1;
            char *input = malloc(cap);
            size_t in_len = unescape(line, (size_t)(tab - line), input);
            int32_t want[512];
            size_t nwant = 0;
            for (char *p = tab + 1, *end; nwant < 512; p = end) {
                long v = strtol(p, &end, 10);
                if (end == p) break;
                want[nwant++] = (int32_t)v;
            }
            int32_t *ids = NULL;
            size_t n = 0;
            int rc = tl_tlz_encode(tok, input, in_len, &ids, &n, err, sizeof err);
            int ok = rc == TLZ_OK && n == nwant && (n == 0 || memcmp(ids, want, n * sizeof *ids) == 0);
            if (!ok) {
                n_bad++;
                printf("  %s: case '%s': rc=%d %s\n    want", file, line, rc, rc ? err : "");
                for (size_t i = 0; i < nwant; i++) printf(" %d", (int)want[i]);
                printf("\n    got ");
                for (size_t i = 0; i < n; i++) printf(" %d", (int)ids[i]);
                printf("\n");
            }
            if (ok && lossless(file)) {
                char *back = NULL;
                size_t back_len = 0;
                rc = tl_tlz_decode(tok, ids, n, &back, &back_len, err, sizeof err);
                CHECK(rc == TLZ_OK && back_len == in_len && memcmp(back, input, in_len) == 0,
                      "%s: '%s' does not decode back to its input", file, line);
                free(back);
                n_roundtrips++;
            }
            free(ids);
            free(input);
            n_cases++;
        }
        line = eol ? eol + 1 : NULL;
    }
    tl_tlz_tokenizer_free(tok);
    free(txt);
    CHECK(n_files >= 10 && n_cases >= 200, "too few reference cases: %d files, %d cases", n_files, n_cases);
    CHECK(n_bad == 0, "%d of %d reference cases differ from scripts/reference/pretok_ref.py", n_bad, n_cases);
    printf("  %d reference cases in %d tokenizers, %d round trips\n", n_cases, n_files, n_roundtrips);
}

/* ------------------------------------------------------------------ errors */

static void expect_error(const char *pre, const char *needle)
{
    char json[2048], err[512] = "";
    snprintf(json, sizeof json,
             "{\"normalizer\": null, \"pre_tokenizer\": %s, \"model\": {\"type\": \"BPE\", "
             "\"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\"]}}",
             pre);
    tl_tlz_tokenizer *tok = (tl_tlz_tokenizer *)1;
    int rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    CHECK(rc == TLZ_EFORMAT && tok == NULL && strstr(err, needle) != NULL,
          "pre_tokenizer %s: rc=%d, message \"%s\" should contain \"%s\"", pre, rc, err, needle);
    if (rc == TLZ_OK) tl_tlz_tokenizer_free(tok);
}

#define BL "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}"

typedef struct { char *out; size_t cap; } piece_text; /* "[piece]" each, appended */
static int append_piece(void *ctx, const unsigned char *piece, size_t n)
{
    piece_text *into = ctx;
    const size_t used = strlen(into->out);
    snprintf(into->out + used, into->cap - used, "[%.*s]", (int)n, (const char *)piece);
    return 0;
}
#define SEQ(...) "{\"type\": \"Sequence\", \"pretokenizers\": [" __VA_ARGS__ "]}"

static void test_errors(void)
{
    expect_error(SEQ("{\"type\": \"Whitespace\"}, " BL),
                 "pre_tokenizer.pretokenizers[0] 'Whitespace' is not supported (supported: Sequence, Split, "
                 "Digits, ByteLevel)");
    expect_error(SEQ(SEQ("{\"type\": \"Metaspace\"}") ", " BL), "pre_tokenizer.pretokenizers[0].pretokenizers[0] "
                                                            "'Metaspace' is not supported");
    expect_error(SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, \"behavior\": \"Sideways\"}, " BL),
                 "pre_tokenizer.pretokenizers[0].behavior 'Sideways' is not supported (Removed, Isolated, "
                 "MergedWithPrevious, MergedWithNext or Contiguous)");
    expect_error(SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, \"behavior\": \"isolated\"}, " BL),
                 "behavior 'isolated' is not supported");
    expect_error(SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(ab\"}, \"behavior\": \"Isolated\"}, " BL),
                 "pre_tokenizer.pretokenizers[0].pattern: cannot compile the regex '(ab': missing closing "
                 "parenthesis (at offset 3)");
    expect_error(SEQ("{\"type\": \"Split\", \"behavior\": \"Isolated\"}, " BL),
                 "pre_tokenizer.pretokenizers[0]: Split needs \"pattern\": {\"Regex\": \"...\"} or {\"String\": "
                 "\"...\"}");
    expect_error(SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": 7}, \"behavior\": \"Isolated\"}, " BL),
                 "Split needs \"pattern\"");
    expect_error(SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}}, " BL),
                 "pre_tokenizer.pretokenizers[0].behavior is missing");
    expect_error(SEQ("{\"type\": \"Split\", \"pattern\": {\"String\": \"a\"}, \"behavior\": \"Isolated\", "
                     "\"invert\": \"yes\"}, " BL),
                 "pre_tokenizer.pretokenizers[0].invert must be a boolean");
    expect_error(SEQ("{\"type\": \"Digits\", \"individual_digits\": 1}, " BL),
                 "pre_tokenizer.pretokenizers[0].individual_digits must be a boolean");
    expect_error(SEQ(BL ", {\"type\": \"Digits\", \"individual_digits\": true}"),
                 "pre_tokenizer.pretokenizers[1] ('Digits') comes after the ByteLevel step, which must be the last");
    expect_error(SEQ("{\"type\": \"Digits\", \"individual_digits\": true}"), "pre_tokenizer has no ByteLevel step");
    expect_error(SEQ(""), "pre_tokenizer has no ByteLevel step");
    expect_error("{\"type\": \"Sequence\"}", "pre_tokenizer.pretokenizers is missing or not an array");
    expect_error(SEQ("3, " BL), "pre_tokenizer.pretokenizers[0] is not an object with a string \"type\"");
    expect_error("null", "pre_tokenizer is missing");
    expect_error("{\"type\": \"ByteLevel\", \"use_regex\": \"no\"}", "pre_tokenizer.use_regex must be a boolean");
    /* Nesting is bounded (the parser recurses): 20 levels of Sequence. */
    char deep[1024] = "";
    for (int i = 0; i < 20; i++) strcat(deep, "{\"type\": \"Sequence\", \"pretokenizers\": [");
    strcat(deep, BL);
    for (int i = 0; i < 20; i++) strcat(deep, "]}");
    expect_error(deep, "Sequence nested more than 16 deep");
}

/* Input that is not UTF-8 (the pipeline sees only its valid runs; each invalid byte is a piece
   of its own): random bytes round-trip through both published shapes, whose vocabularies cover
   all 256 bytes. */
static void test_invalid_utf8(const char *data)
{
    static const char *const files[] = {"huginn.json", "ouro.json", "merged_next.json", "contiguous.json"};
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (int f = 0; f < 4; f++) {
        char path[1024], err[512] = "", text[4096];
        snprintf(path, sizeof path, "%s/tokenizer/pretok/%s", data, files[f]);
        tl_tlz_tokenizer *tok = NULL;
        CHECK(tl_tlz_tokenizer_load(path, &tok, err, sizeof err) == TLZ_OK, "load %s: %s", files[f], err);
        if (!tok) continue;
        int bad = 0;
        for (int round = 0; round < 50 && !bad; round++) {
            size_t n = 1 + (size_t)(x % sizeof text);
            for (size_t i = 0; i < n; i++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                /* mostly text-like bytes, with invalid UTF-8 lead and continuation bytes */
                text[i] = (char)("ab 1\n\x80\xc3\xa9\xe6\x97\xa5\xff-x9"[x % 15]);
            }
            int32_t *ids = NULL;
            size_t nids = 0;
            char *back = NULL;
            size_t back_len = 0;
            bad = tl_tlz_encode(tok, text, n, &ids, &nids, err, sizeof err) != TLZ_OK ||
                  tl_tlz_decode(tok, ids, nids, &back, &back_len, err, sizeof err) != TLZ_OK || back_len != n ||
                  memcmp(back, text, n) != 0;
            free(ids);
            free(back);
        }
        CHECK(!bad, "%s: random bytes do not round-trip (%s)", files[f], err);
        tl_tlz_tokenizer_free(tok);
    }
}

/* A regex with catastrophic backtracking ends at PCRE2's match limit: an encode error with
   PCRE2's reason, not a hang. */
static void test_match_limit(void)
{
    const char *json = "{\"pre_tokenizer\": " SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(a|aa)+$\"}, "
                                                  "\"behavior\": \"Isolated\"}, " BL)
                       ", \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}}";
    char err[512] = "", text[200];
    tl_tlz_tokenizer *tok = NULL;
    int rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    CHECK(rc == TLZ_OK, "load: %s", err);
    if (rc) return;
    memset(text, 'a', sizeof text - 1);
    text[sizeof text - 1] = 'b';
    int32_t *ids = NULL;
    size_t n = 0;
    rc = tl_tlz_encode(tok, text, sizeof text, &ids, &n, err, sizeof err);
    CHECK(rc == TLZ_EENCODE && ids == NULL && strstr(err, "pre-tokenizer regex failed: match limit exceeded"),
          "rc=%d \"%s\"", rc, err);
    free(ids);
    tl_tlz_tokenizer_free(tok);
}

/* A Split regex is Oniguruma's Ruby syntax, as Hugging Face reads it: \h is a hex digit, ^
   anchors at every line, a class intersection is refused; and a repeated group matches a word
   of thousands of characters (PCRE2's default JIT stack held some 2,000). The pieces show in
   the ids: the merge a b -> ab happens only inside one. */
static void expect_ids(const char *regex, const char *text, size_t len, const int32_t *want, size_t n_want)
{
    char json[1024], err[512] = "";
    snprintf(json, sizeof json,
             "{\"pre_tokenizer\": " SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"%s\"}, \"behavior\": \"Isolated\"}, " BL)
             ", \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, \"\\u010a\": 3}, \"merges\": [\"a b\"]}}",
             regex);
    tl_tlz_tokenizer *tok = NULL;
    int rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    CHECK(rc == TLZ_OK, "load %s: %s", regex, err);
    if (rc) return;
    int32_t *ids = NULL;
    size_t n = 0;
    rc = tl_tlz_encode(tok, text, len, &ids, &n, err, sizeof err);
    CHECK(rc == TLZ_OK && n == n_want && (!want || memcmp(ids, want, n * sizeof *ids) == 0),
          "regex %s: rc=%d n=%zu (want %zu) %s", regex, rc, n, n_want, err);
    free(ids);
    tl_tlz_tokenizer_free(tok);
}

static void test_ruby_syntax(void)
{
    expect_ids("\\\\h", "ab", 2, (const int32_t[]){0, 1}, 2);        /* each hex digit its own piece */
    expect_ids("\\\\H+", "ab", 2, (const int32_t[]){2}, 1);          /* no piece: one word */
    expect_ids("^a", "ab\nab", 5, (const int32_t[]){0, 1, 3, 0, 1}, 5); /* ^ after the newline too */
    expect_error(SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"[a-z&&[^aeiou]]\"}, \"behavior\": \"Isolated\"}, " BL),
                 "pre_tokenizer.pretokenizers[0].pattern: a class intersection (&&) is not supported");
    /* Ruby's inline m is dot-matches-newline (PCRE2's s: "b\na" one piece, no merge across),
       {,n} is {0,n} ("ba" a piece), a class nested in a class is refused (PCRE2 read each
       otherwise: different pieces, silently) */
    expect_ids("(?m:b.a)", "ab\nab", 5, (const int32_t[]){0, 1, 3, 0, 1}, 5);
    expect_ids("ba{,1}", "aba", 3, (const int32_t[]){0, 1, 0}, 3);
    expect_ids("[[:alpha:]]+", "ab", 2, (const int32_t[]){2}, 1); /* (a POSIX class is no nested class) */
    expect_error(SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"[a[b]]+\"}, \"behavior\": \"Isolated\"}, " BL),
                 "pre_tokenizer.pretokenizers[0].pattern: a character class nested in a class is not supported");
    static char word[20000];
    memset(word, 'a', sizeof word);
    expect_ids("(?:\\\\p{L}|')+", word, sizeof word, NULL, sizeof word);
}

/* ------------------------------------------------------------- model load */

/* Huginn's tokenizer shape on the tiny Huginn checkpoint (vocab_size 96): bytes 'a'..'z', ' ',
   '0'..'9' at ids 0..36, one merge "a b" -> "ab" (37), and <|begin_text|> (92) / <|end_text|>
   (93) as added tokens, with the Split + ByteLevel(use_regex=false) pre-tokenizer. */
static void test_model_load(const char *data)
{
    char dir[] = "/tmp/tl_pretok_XXXXXX", src[1024], dst[1024];
    if (!mkdtemp(dir)) { CHECK(0, "mkdtemp failed"); return; }
    static const char *const files[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        size_t n;
        snprintf(src, sizeof src, "%s/hf/huginn_f32/%s", data, files[i]);
        snprintf(dst, sizeof dst, "%s/%s", dir, files[i]);
        char *buf = read_all(src, &n);
        CHECK(buf && write_all(dst, buf, n), "copy %s", src);
        free(buf);
    }
    char json[8192];
    int o = snprintf(json, sizeof json,
                     "{\"added_tokens\": [{\"id\": 92, \"content\": \"<|begin_text|>\", \"special\": true},"
                     " {\"id\": 93, \"content\": \"<|end_text|>\", \"special\": true}], \"normalizer\": null,"
                     " \"pre_tokenizer\": " SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": "
                                                "\"\\\\p{N}{1,3}| ?\\\\p{L}+|\\\\s+\"}, \"behavior\": \"Isolated\", "
                                                "\"invert\": false}, " BL)
                     ", \"model\": {\"type\": \"BPE\", \"vocab\": {");
    const char *alphabet = "abcdefghijklmnopqrstuvwxyz\\u0120" "0123456789"; /* \u0120: space */
    for (int id = 0, i = 0; alphabet[i]; id++) {
        int k = alphabet[i] == '\\' ? 6 : 1;
        o += snprintf(json + o, sizeof json - (size_t)o, "\"%.*s\": %d, ", k, alphabet + i, id);
        i += k;
    }
    snprintf(json + o, sizeof json - (size_t)o,
             "\"ab\": 37, \"<|begin_text|>\": 92, \"<|end_text|>\": 93}, \"merges\": [\"a b\"]}}");
    snprintf(dst, sizeof dst, "%s/tokenizer.json", dir);
    CHECK(write_all(dst, json, strlen(json)), "write %s", dst);

    tl_model *m = NULL;
    tl_status st = tl_model_load(dir, NULL, &m);
    CHECK(st == TL_OK, "tl_model_load of a Huginn folder with a Split pre-tokenizer: %s", tl_last_error());
    if (st == TL_OK) {
        /* "<|begin_text|>" | "ab" | "1234" -> "123","4" | " cab" -> Ġ c ab */
        const char *text = "<|begin_text|>ab1234 cab";
        const int32_t want[] = {92, 37, 28, 29, 30, 31, 26, 2, 37};
        int32_t *ids = NULL;
        int n = 0;
        st = tl_encode(m, text, strlen(text), &ids, &n);
        CHECK(st == TL_OK && n == 9 && memcmp(ids, want, sizeof want) == 0, "tl_encode: st=%s n=%d (%s)",
              tl_status_name(st), n, tl_last_error());
        tl_free(ids);
    }
    tl_model_free(m);
    for (int i = 0; i < 3; i++) {
        snprintf(dst, sizeof dst, "%s/%s", dir, i < 2 ? files[i] : "tokenizer.json");
        unlink(dst);
    }
    rmdir(dir);
}

/* The pieces a pre-tokenizer cuts `text` into, "[piece]" each, in out. */
static void pieces_of(const char *pre, const char *text, char *out, size_t cap)
{
    char json[1024], err[256] = "";
    snprintf(json, sizeof json, "{\"pre_tokenizer\": %s}", pre);
    cJSON *root = cJSON_Parse(json);
    tl_tlz_pretok *p = NULL;
    out[0] = '\0';
    if (!root || tl_tlz_pretok_parse(root, &p, err, sizeof err) != TLZ_OK) {
        snprintf(out, cap, "parse error: %s", err);
        cJSON_Delete(root);
        return;
    }
    tl_tlz_pretok_scratch *scratch = tl_tlz_pretok_scratch_new(p);
    piece_text into = {out, cap};
    tl_tlz_pretok_run(p, scratch, text, strlen(text), append_piece, &into, err, sizeof err);
    tl_tlz_pretok_scratch_free(scratch);
    tl_tlz_pretok_free(p);
    cJSON_Delete(root);
}

/* Split's edges, as Hugging Face's tokenizers cut them: a delimiter merged with the piece
   before it stands alone where it follows another (a--b is a-, -, b); a quantifier "{,}"
   with no bound is literal text in Oniguruma (Ruby's {,n} is {0,n}, rewritten; {,} was too). */
static void test_split_edges(void)
{
    char got[256];
    pieces_of(SEQ("{\"type\": \"Split\", \"pattern\": {\"String\": \"-\"}, \"behavior\": \"MergedWithPrevious\"}, " BL),
              "a--b", got, sizeof got);
    CHECK(strcmp(got, "[a-][-][b]") == 0, "MergedWithPrevious on a--b: %s", got);
    pieces_of(SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a{,}\"}, \"behavior\": \"Isolated\"}, " BL), "aa{,}b",
              got, sizeof got);
    CHECK(strcmp(got, "[a][a{,}][b]") == 0, "the regex a{,} on aa{,}b: %s", got);
    pieces_of(SEQ("{\"type\": \"Split\", \"pattern\": {\"Regex\": \"a{,2}\"}, \"behavior\": \"Isolated\"}, " BL), "aaab",
              got, sizeof got);
    CHECK(strcmp(got, "[aa][a][b]") == 0, "the regex a{,2} (Ruby's {0,2}) on aaab: %s", got);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DATA_DIR (tests/data)\n", argv[0]);
        return 2;
    }
    test_reference_cases(argv[1]);
    test_errors();
    test_match_limit();
    test_ruby_syntax();
    test_split_edges();
    test_invalid_utf8(argv[1]);
    test_model_load(argv[1]);
    return check_summary();
}

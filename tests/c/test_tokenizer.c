/* Tests of the byte-level BPE tokenizer (engine/src/tokenizer.h).
 *
 * Usage: test_tokenizer DATA_DIR     (DATA_DIR = tests/data)
 * Reads DATA_DIR/gpt2/tokenizer.json, DATA_DIR/tokenizer/{sample.txt,
 * sample.gpt2.ids, tiny.json, tiny.cases}. Prints one line per check and a
 * final "N passed, M failed"; exit status 0 only when nothing failed.
 */
#include "tokenizer.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int n_pass, n_fail;

static void check(int ok, const char *name, const char *fmt, ...)
{
    if (ok) {
        n_pass++;
        printf("PASS %s\n", name);
        return;
    }
    n_fail++;
    printf("FAIL %s", name);
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        printf(": ");
        vprintf(fmt, ap);
        va_end(ap);
    }
    printf("\n");
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *nb = realloc(buf, 2 * cap + 1);
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) buf[n] = '\0';
    *len = n;
    return buf;
}

static char *join(const char *dir, const char *rel)
{
    size_t n = strlen(dir) + strlen(rel) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, rel);
    return p;
}

static int is_valid_utf8(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        int k = tl_tlz_utf8_seq((const unsigned char *)s + i, n - i);
        if (k <= 0) return 0;
        i += (size_t)k;
    }
    return 1;
}

/* Round trip plus the streaming detokenizer on one input. Returns NULL on
   success, else a static description of what went wrong. */
static const char *roundtrip(const tl_tlz_tokenizer *tok, tl_tlz_stream *st, const char *s, size_t n, unsigned flags)
{
    static char why[512];
    int32_t *ids = NULL;
    size_t nids = 0, dlen = 0;
    char *dec = NULL, err[256];
    if (tl_tlz_encode_ex(tok, s, n, flags, &ids, &nids, err, sizeof err)) {
        snprintf(why, sizeof why, "encode failed: %s", err);
        return why;
    }
    if (tl_tlz_decode(tok, ids, nids, &dec, &dlen, err, sizeof err)) {
        free(ids);
        snprintf(why, sizeof why, "decode failed: %s", err);
        return why;
    }
    const char *bad = NULL;
    if (dlen != n || memcmp(dec, s, n) != 0) bad = "decode(encode(x)) != x";
    /* Streamed pieces must add up to the same bytes and, for valid input,
       each piece must be valid UTF-8 by itself (no split code point). */
    int valid = is_valid_utf8(s, n);
    char *acc = malloc(n + 1);
    size_t acc_n = 0;
    tl_tlz_stream_reset(st);
    for (size_t i = 0; !bad && i < nids; i++) {
        const char *piece;
        size_t plen;
        if (tl_tlz_stream_push(st, ids[i], &piece, &plen, err, sizeof err)) { bad = "stream push failed"; break; }
        if (valid && !is_valid_utf8(piece, plen)) bad = "stream emitted a partial UTF-8 sequence";
        if (acc_n + plen > n) bad = "stream emitted too many bytes";
        else memcpy(acc + acc_n, piece, plen), acc_n += plen;
    }
    if (!bad) {
        const char *piece;
        size_t plen;
        tl_tlz_stream_flush(st, &piece, &plen);
        if (valid && plen) bad = "stream held bytes back at the end of valid input";
        if (acc_n + plen > n) bad = "stream emitted too many bytes";
        else memcpy(acc + acc_n, piece, plen), acc_n += plen;
        if (!bad && (acc_n != n || memcmp(acc, s, n) != 0)) bad = "streamed pieces != input";
    }
    free(acc);
    free(ids);
    free(dec);
    return bad;
}

/* ------------------------------------------------------------ random text */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13; /* xorshift64: fixed seed, same inputs every run */
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}
static uint32_t rnd_below(uint32_t n) { return rnd() % n; }

static size_t put_cp(uint32_t cp, char *o)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | cp >> 6); o[1] = (char)(0x80 | (cp & 63)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | cp >> 12); o[1] = (char)(0x80 | ((cp >> 6) & 63)); o[2] = (char)(0x80 | (cp & 63));
        return 3;
    }
    o[0] = (char)(0xF0 | cp >> 18); o[1] = (char)(0x80 | ((cp >> 12) & 63));
    o[2] = (char)(0x80 | ((cp >> 6) & 63)); o[3] = (char)(0x80 | (cp & 63));
    return 4;
}

static uint32_t random_cp(void)
{
    static const uint32_t ranges[][2] = {
        {0x20, 0x7E}, {0x20, 0x7E}, {0x20, 0x7E}, {0x00, 0x1F}, {0xA0, 0x24F}, {0x370, 0x3FF}, {0x400, 0x4FF},
        {0x4E00, 0x9FFF}, {0x3040, 0x30FF}, {0xAC00, 0xD7A3}, {0x1F300, 0x1FAFF}, {0x200B, 0x200D},
        {0x0300, 0x036F}, {0x2000, 0x206F}, {0xE000, 0xF8FF}, {0x10000, 0x10FFFF},
    };
    const uint32_t *r = ranges[rnd_below(sizeof ranges / sizeof ranges[0])];
    uint32_t cp = r[0] + rnd_below(r[1] - r[0] + 1);
    if (cp >= 0xD800 && cp < 0xE000) cp = 'x'; /* surrogates are not valid UTF-8 */
    return cp;
}

/* Kind 0: random bytes (mostly invalid UTF-8). 1: random valid UTF-8.
   2: ASCII words, numbers, contractions and whitespace runs. 3: pieces of
   the others glued together, plus stray lead/continuation bytes. */
static size_t random_text(int kind, char *o, size_t cap)
{
    size_t n = 0, len = rnd_below(80);
    static const char *const words[] = {"the", "The", "A", "quick", "'s", "'LL", "don't", "I'm", "123", "4.5",
                                        "<|endoftext|>", "<|endo", "!!", "?", "...", "x", "\xc3\xa9t\xc3\xa9",
                                        "\xe4\xb8\xad\xe6\x96\x87", "\xf0\x9f\x98\x80"};
    static const char *const spaces[] = {" ", " ", " ", "  ", "\t", "\n", "\n\n", " \n", "\r\n", "   "};
    while (n + 16 < cap && len-- > 0) {
        int k = kind == 3 ? (int)rnd_below(3) : kind;
        if (kind == 3 && rnd_below(8) == 0) {
            static const unsigned char stray[] = {0x80, 0xBF, 0xC0, 0xC3, 0xE2, 0xED, 0xF0, 0xF4, 0xF5, 0xFF};
            o[n++] = (char)stray[rnd_below(sizeof stray)];
        } else if (k == 0) {
            o[n++] = (char)rnd_below(256);
        } else if (k == 1) {
            n += put_cp(random_cp(), o + n);
        } else {
            const char *w = rnd_below(2) ? words[rnd_below(sizeof words / sizeof *words)]
                                         : spaces[rnd_below(sizeof spaces / sizeof *spaces)];
            size_t wl = strlen(w);
            memcpy(o + n, w, wl);
            n += wl;
        }
    }
    return n;
}

/* ------------------------------------------------------------- load errors */

/* A small tokenizer.json with each part replaceable, for the error paths. */
typedef struct {
    const char *top;    /* extra top-level members, each followed by a comma */
    const char *pre;    /* pre_tokenizer value */
    const char *model;  /* extra model members (type, options), each followed by a comma */
    const char *vocab;
    const char *merges; /* NULL: omit */
} json_parts;

static char *make_json(json_parts p)
{
    static char buf[4096];
    snprintf(buf, sizeof buf,
             "{%s \"pre_tokenizer\": %s, \"model\": {%s \"vocab\": %s %s%s%s}}", p.top ? p.top : "",
             p.pre ? p.pre : "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}",
             p.model ? p.model : "\"type\": \"BPE\",",
             p.vocab ? p.vocab : "{\"a\":0,\"b\":1,\"ab\":2,\"\\u0120\":3}", p.merges ? ", \"merges\": " : "",
             p.merges ? p.merges : "", "");
    return buf;
}

static void expect_load_error(const char *name, const char *json, const char *needle)
{
    tl_tlz_tokenizer *tok = (tl_tlz_tokenizer *)1;
    char err[256] = "";
    int rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    int ok = rc != TLZ_OK && tok == NULL && strstr(err, needle) != NULL;
    check(ok, name, "rc=%d, message \"%s\" should mention \"%s\"", rc, err, needle);
    if (rc == TLZ_OK) tl_tlz_tokenizer_free(tok);
}

static void test_load_errors(const char *dir)
{
    char err[512] = "";
    tl_tlz_tokenizer *tok = (tl_tlz_tokenizer *)1;
    char *missing = join(dir, "no/such/tokenizer.json");
    int rc = tl_tlz_tokenizer_load(missing, &tok, err, sizeof err);
    check(rc == TLZ_EIO && tok == NULL && strstr(err, "cannot open") && strstr(err, missing),
          "load error: missing file", "rc=%d message \"%s\"", rc, err);
    free(missing);

    expect_load_error("load error: invalid JSON", "{\"model\": {\"type\": \"BPE\",\n \"vocab\": {\"a\": 0,,}}}",
                      "not valid JSON (error near line 2");
    expect_load_error("load error: empty file", "", "not valid JSON");
    expect_load_error("load error: top level not an object", "[1, 2]", "top level");
    expect_load_error("load error: no model", "{\"pre_tokenizer\": null}", "no \"model\"");
    expect_load_error("load error: non-BPE model",
                      make_json((json_parts){.model = "\"type\": \"WordPiece\",", .merges = "[]"}),
                      "model type 'WordPiece' is not supported (only BPE)");
    expect_load_error("load error: missing vocab",
                      "{\"pre_tokenizer\": {\"type\":\"ByteLevel\"}, \"model\": {\"type\": \"BPE\", \"merges\": []}}",
                      "model.vocab is missing");
    expect_load_error("load error: vocab not an object", make_json((json_parts){.vocab = "[\"a\"]", .merges = "[]"}),
                      "model.vocab is missing or not an object");
    expect_load_error("load error: empty vocab", make_json((json_parts){.vocab = "{}", .merges = "[]"}),
                      "model.vocab is empty");
    expect_load_error("load error: missing merges", make_json((json_parts){0}), "model.merges is missing");
    expect_load_error("load error: merges not an array", make_json((json_parts){.merges = "{}"}),
                      "model.merges is missing or not an array");
    expect_load_error("load error: merge without a space", make_json((json_parts){.merges = "[\"a b\", \"ab\"]"}),
                      "model.merges[1] is malformed: \"ab\"");
    expect_load_error("load error: merge with two spaces", make_json((json_parts){.merges = "[\"a b c\"]"}),
                      "model.merges[0] is malformed");
    expect_load_error("load error: merge pair of three", make_json((json_parts){.merges = "[[\"a\",\"b\",\"c\"]]"}),
                      "model.merges[0] is malformed: [\"a\",\"b\",\"c\"]");
    expect_load_error("load error: merge of a number", make_json((json_parts){.merges = "[[\"a\", 7]]"}),
                      "model.merges[0] is malformed");
    expect_load_error("load error: merge token not in vocab", make_json((json_parts){.merges = "[\"a x\"]"}),
                      "model.merges[0]: token 'x' is not in the vocab");
    expect_load_error("load error: merged token not in vocab", make_json((json_parts){.merges = "[\"b a\"]"}),
                      "model.merges[0] ('b' + 'a'): merged token is not in the vocab");
    expect_load_error("load error: vocab id is a string",
                      make_json((json_parts){.vocab = "{\"a\":0,\"b\":\"1\"}", .merges = "[]"}),
                      "model.vocab entry 'b': id must be an integer");
    expect_load_error("load error: vocab id negative",
                      make_json((json_parts){.vocab = "{\"a\":-1}", .merges = "[]"}), "model.vocab entry 'a'");
    expect_load_error("load error: vocab id fractional",
                      make_json((json_parts){.vocab = "{\"a\":0.5}", .merges = "[]"}), "model.vocab entry 'a'");
    expect_load_error("load error: vocab id huge",
                      make_json((json_parts){.vocab = "{\"a\":1e12}", .merges = "[]"}), "model.vocab entry 'a'");
    expect_load_error("load error: vocab id used twice",
                      make_json((json_parts){.vocab = "{\"a\":0,\"b\":0}", .merges = "[]"}),
                      "id 0 is used by both 'a' and 'b'");
    expect_load_error("load error: vocab duplicate string",
                      make_json((json_parts){.vocab = "{\"a\":0,\"a\":1}", .merges = "[]"}), "duplicate key \"a\" in \"vocab\"");
    expect_load_error("load error: added token without content",
                      make_json((json_parts){.top = "\"added_tokens\": [{\"id\": 5}],", .merges = "[]"}),
                      "added_tokens[0]: \"content\"");
    expect_load_error("load error: added token with bad id",
                      make_json((json_parts){.top = "\"added_tokens\": [{\"id\": \"x\", \"content\": \"<s>\"}],",
                                             .merges = "[]"}),
                      "added_tokens[0]: \"id\"");
    /* one id, one token (a clash decoded a vocabulary id as the added text, or two added
       texts as one id) */
    expect_load_error("load error: added token's text is another vocabulary id",
                      make_json((json_parts){.top = "\"added_tokens\": [{\"id\": 5, \"content\": \"ab\"}],", .merges = "[]"}),
                      "added_tokens: 'ab' has id 5, but the vocabulary has it as id 2");
    expect_load_error("load error: added token on a vocabulary id",
                      make_json((json_parts){.top = "\"added_tokens\": [{\"id\": 1, \"content\": \"<s>\"}],", .merges = "[]"}),
                      "added_tokens: '<s>' has id 1, which is the vocabulary's 'b'");
    expect_load_error("load error: two added tokens on one id",
                      make_json((json_parts){.top = "\"added_tokens\": [{\"id\": 7, \"content\": \"<s>\"}, "
                                                    "{\"id\": 7, \"content\": \"</s>\"}],", .merges = "[]"}),
                      "added_tokens: '</s>' has id 7, which another added token has");
    expect_load_error("load error: added token content starting with NUL",
                      make_json((json_parts){.top = "\"added_tokens\": [{\"id\": 7, \"content\": \"\\u0000x\"}],", .merges = "[]"}),
                      "a string holds U+0000");
    /* anywhere in a string: cJSON's strings end at it ("<tok\u0000>" was read as "<tok", another
       token), in an added token, a vocabulary key or a merge; an escaped backslash before
       "u0000" is text */
    expect_load_error("load error: added token content holding NUL",
                      make_json((json_parts){.top = "\"added_tokens\": [{\"id\": 7, \"content\": \"<tok\\u0000>\"}],", .merges = "[]"}),
                      "a string holds U+0000");
    expect_load_error("load error: a merge holding NUL", make_json((json_parts){.merges = "[\"a b\\u0000\"]"}),
                      "a string holds U+0000");
    {
        tl_tlz_tokenizer *escaped = NULL;
        const char *text = make_json((json_parts){.vocab = "{\"a\":0,\"b\":1,\"ab\":2,\"\\u0120\":3,\"\\\\u0000\":4}", .merges = "[]"});
        check(tl_tlz_tokenizer_load_json(text, strlen(text), &escaped, err, sizeof err) == TLZ_OK,
              "load: an escaped backslash before u0000 is text", "%s", err);
        tl_tlz_tokenizer_free(escaped);
    }
    /* what would change the ids or the text, refused rather than ignored */
    expect_load_error("load error: BPE dropout",
                      make_json((json_parts){.model = "\"type\":\"BPE\", \"dropout\": 0.5,", .merges = "[]"}),
                      "model.dropout is not supported");
    expect_load_error("load error: unk_token not a string",
                      make_json((json_parts){.model = "\"type\":\"BPE\", \"unk_token\": 5,", .merges = "[]"}),
                      "model.unk_token must be a string or null");
    expect_load_error("load error: another decoder",
                      make_json((json_parts){.top = "\"decoder\": {\"type\": \"WordPiece\", \"prefix\": \"##\"},", .merges = "[]"}),
                      "decoder 'WordPiece' is not supported");
    expect_load_error("load error: a decoder sequence with another decoder",
                      make_json((json_parts){.top = "\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"ByteLevel\"}, "
                                                    "{\"type\": \"Strip\"}]},", .merges = "[]"}),
                      "decoder 'Sequence' is not supported");
    expect_load_error("load error: an empty decoder sequence (HF maps no bytes: it was read as ByteLevel)",
                      make_json((json_parts){.top = "\"decoder\": {\"type\": \"Sequence\", \"decoders\": []},", .merges = "[]"}),
                      "decoder 'Sequence' is not supported");
    /* What JSON (and Hugging Face's serde) refuses and cJSON let through: a stray byte in a
       token's text (it loaded, and encoded and decoded its bytes), a raw control character in
       a string, one between values */
    expect_load_error("load error: ill-formed UTF-8",
                      make_json((json_parts){.top = "\"decoder\": {\"type\": \"By\xfftel\"},", .merges = "[]"}),
                      "tokenizer.json: not valid UTF-8 (byte");
    expect_load_error("load error: a raw tab in a string",
                      make_json((json_parts){.top = "\"decoder\": {\"type\": \"Byte\tLevel\"},", .merges = "[]"}),
                      "a control character (0x09) unescaped in a string at line 1");
    expect_load_error("load error: a control character between values",
                      make_json((json_parts){.top = "\"decoder\":\f null,", .merges = "[]"}),
                      "a control character (0x0C) outside a string at line 1");
    expect_load_error("load error: a key given twice",
                      make_json((json_parts){.top = "\"decoder\": null, \"decoder\": null,", .merges = "[]"}),
                      "tokenizer.json: duplicate key \"decoder\"");
    {
        char trailing[4200];
        snprintf(trailing, sizeof trailing, "%s xx", make_json((json_parts){.merges = "[]"}));
        expect_load_error("load error: text after the JSON", trailing, "unexpected text after the JSON value: \"xx\"");
        /* a NUL and more after it, within the length given (the NUL ended the check) */
        const size_t at = strlen(trailing) - 3;
        memcpy(trailing + at, "\0xx", 3);
        tl_tlz_tokenizer *nul = (tl_tlz_tokenizer *)1;
        char nul_err[256] = "";
        const int nul_rc = tl_tlz_tokenizer_load_json(trailing, at + 3, &nul, nul_err, sizeof nul_err);
        check(nul_rc != TLZ_OK && nul == NULL && strstr(nul_err, "unexpected text after the JSON value: a NUL byte"),
              "load error: a NUL after the JSON", "rc=%d \"%s\"", nul_rc, nul_err);
    }
    {   /* ...and what changes nothing loads: an added token that is its own vocabulary entry
           (GPT-2's <|endoftext|>), dropout null, a ByteLevel decoder in a sequence */
        const char *fine = make_json((json_parts){.top = "\"added_tokens\": [{\"id\": 2, \"content\": \"ab\"}], "
                                                         "\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"ByteLevel\"}]},",
                                                  .model = "\"type\":\"BPE\", \"dropout\": null, \"unk_token\": null,", .merges = "[]"});
        tl_tlz_tokenizer *loaded = NULL;
        check(tl_tlz_tokenizer_load_json(fine, strlen(fine), &loaded, err, sizeof err) == TLZ_OK, "load: what changes nothing", "%s", err);
        tl_tlz_tokenizer_free(loaded);
    }
    expect_load_error("load error: unsupported pre_tokenizer",
                      make_json((json_parts){.pre = "{\"type\": \"Metaspace\"}", .merges = "[]"}),
                      "pre_tokenizer 'Metaspace' is not supported");
    expect_load_error("load error: no pre_tokenizer", make_json((json_parts){.pre = "null", .merges = "[]"}),
                      "pre_tokenizer is missing");
    expect_load_error("load error: unsupported normalizer",
                      make_json((json_parts){.top = "\"normalizer\": {\"type\": \"NFC\"},", .merges = "[]"}),
                      "normalizer 'NFC' is not supported");
    expect_load_error("load error: byte_fallback",
                      make_json((json_parts){.model = "\"type\":\"BPE\", \"byte_fallback\": true,", .merges = "[]"}),
                      "byte_fallback");
    expect_load_error("load error: subword prefix",
                      make_json((json_parts){.model = "\"continuing_subword_prefix\": \"##\",", .merges = "[]"}),
                      "continuing_subword_prefix");
    expect_load_error("load error: unk_token not in vocab",
                      make_json((json_parts){.model = "\"unk_token\": \"<unk>\",", .merges = "[]"}),
                      "unk_token '<unk>' is not in the vocab");
}

/* ------------------------------------------------------------------ tiny */

static size_t unescape(const char *s, size_t n, char *o)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 == n) { o[k++] = s[i]; continue; }
        char c = s[++i];
        if (c == 'n') o[k++] = '\n';
        else if (c == 't') o[k++] = '\t';
        else if (c == 'r') o[k++] = '\r';
        else if (c == 'x' && i + 2 < n + 1) {
            char hex[3] = {s[i + 1], s[i + 2], 0};
            o[k++] = (char)strtol(hex, NULL, 16);
            i += 2;
        } else o[k++] = c;
    }
    return k;
}

/* A merge listed twice ranks where it comes last, as Hugging Face's tokenizers read the list
   into a map (the later insert wins): with ["b c", "a b", "b c"], "abc" is ab c, not a bc. */
static void test_repeated_merge(void)
{
    const char *json = make_json((json_parts){.vocab = "{\"a\":0,\"b\":1,\"c\":2,\"ab\":3,\"bc\":4}",
                                              .merges = "[\"b c\", \"a b\", \"b c\"]"});
    tl_tlz_tokenizer *tok = NULL;
    char err[256] = "";
    int rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    check(rc == TLZ_OK, "repeated merge: load", "rc=%d %s", rc, err);
    if (rc != TLZ_OK) return;
    int32_t *ids = NULL;
    size_t n = 0;
    rc = tl_tlz_encode(tok, "abc", 3, &ids, &n, err, sizeof err);
    check(rc == TLZ_OK && n == 2 && ids[0] == 3 && ids[1] == 2, "repeated merge: the later rank wins (ab c)",
          "rc=%d n=%zu first ids %d %d", rc, n, n > 0 ? (int)ids[0] : -1, n > 1 ? (int)ids[1] : -1);
    free(ids);
    tl_tlz_tokenizer_free(tok);
}

static void test_tiny(const char *dir)
{
    char err[256] = "";
    char *path = join(dir, "tokenizer/tiny.json");
    tl_tlz_tokenizer *tok = NULL;
    int rc = tl_tlz_tokenizer_load(path, &tok, err, sizeof err);
    free(path);
    check(rc == TLZ_OK, "tiny: load", "%s", err);
    if (rc) return;
    check(tl_tlz_vocab_size(tok) == 13, "tiny: vocab size 13", "got %d", (int)tl_tlz_vocab_size(tok));
    check(tl_tlz_token_id(tok, "<|e|>") == 10 && tl_tlz_is_special(tok, 10), "tiny: <|e|> is special id 10", NULL);
    check(tl_tlz_token_id(tok, "<|e|>a") == 11 && !tl_tlz_is_special(tok, 11), "tiny: <|e|>a is non-special id 11", NULL);
    check(tl_tlz_token_id(tok, "\xc4\xa0" "ab") == 7 && tl_tlz_token_id(tok, "zz") == -1, "tiny: token_id lookup", NULL);

    size_t len;
    char *cases = join(dir, "tokenizer/tiny.cases");
    char *txt = read_all(cases, &len);
    free(cases);
    check(txt != NULL, "tiny: read tiny.cases", NULL);
    int n_cases = 0, n_bad = 0;
    for (char *line = txt; txt && line && *line;) {
        char *eol = strchr(line, '\n');
        if (eol) *eol = '\0';
        char *tab = strchr(line, '\t');
        if (line[0] != '#' && tab) {
            char input[256], *p = tab + 1;
            size_t in_len = unescape(line, (size_t)(tab - line), input);
            int32_t want[64];
            size_t nwant = 0;
            for (char *end; nwant < 64; p = end) {
                long v = strtol(p, &end, 10);
                if (end == p) break;
                want[nwant++] = (int32_t)v;
            }
            int32_t *ids = NULL;
            size_t n = 0;
            rc = tl_tlz_encode(tok, input, in_len, &ids, &n, err, sizeof err);
            int ok = rc == TLZ_OK && n == nwant && (n == 0 || memcmp(ids, want, n * sizeof *ids) == 0);
            if (!ok) {
                n_bad++;
                printf("  tiny case '%s': rc=%d %s got", line, rc, rc ? err : "");
                for (size_t i = 0; i < n; i++) printf(" %d", (int)ids[i]);
                printf("\n");
            }
            free(ids);
            n_cases++;
        }
        line = eol ? eol + 1 : NULL;
    }
    free(txt);
    check(n_cases >= 15 && n_bad == 0, "tiny: hand-worked cases", "%d of %d cases wrong", n_bad, n_cases);

    /* NO_SPECIAL reads only the special token's text as text: the non-special added token
       <|e|>a is still one token, and <|e|> alone is then bytes, which this vocab lacks. */
    int32_t *ids = NULL;
    size_t n = 0;
    rc = tl_tlz_encode_ex(tok, "<|e|>ab", 7, TLZ_ENCODE_NO_SPECIAL, &ids, &n, err, sizeof err);
    check(rc == TLZ_OK && n == 2 && ids[0] == 11 && ids[1] == 1, "tiny: NO_SPECIAL keeps the non-special <|e|>a",
          "rc=%d n=%zu %s", rc, n, err);
    free(ids);
    rc = tl_tlz_encode(tok, "<|e|>b", 6, &ids, &n, err, sizeof err);
    check(rc == TLZ_OK && n == 2 && ids[0] == 10 && ids[1] == 1, "tiny: <|e|>b is the special <|e|>, then b", "rc=%d", rc);
    free(ids);
    rc = tl_tlz_encode_ex(tok, "<|e|>b", 6, TLZ_ENCODE_NO_SPECIAL, &ids, &n, err, sizeof err);
    check(rc == TLZ_EENCODE && ids == NULL && strstr(err, "0x3c"), "tiny: NO_SPECIAL reads <|e|> as its bytes",
          "rc=%d \"%s\"", rc, err);

    /* Bytes the vocab lacks cannot be encoded without an unk_token. */
    rc = tl_tlz_encode(tok, "abd", 3, &ids, &n, err, sizeof err);
    check(rc == TLZ_EENCODE && ids == NULL && strstr(err, "0x64"), "tiny: byte without token fails cleanly",
          "rc=%d \"%s\"", rc, err);
    /* A vocab entry outside the byte alphabet decodes to its own UTF-8. */
    int32_t arrow = 12;
    char *dec = NULL;
    rc = tl_tlz_decode(tok, &arrow, 1, &dec, &len, err, sizeof err);
    check(rc == TLZ_OK && len == 3 && memcmp(dec, "\xe2\x86\x92", 3) == 0, "tiny: non-byte-level token decodes as UTF-8",
          NULL);
    free(dec);
    int32_t bad = 13;
    rc = tl_tlz_decode(tok, &bad, 1, &dec, &len, err, sizeof err);
    check(rc == TLZ_EID && dec == NULL && strstr(err, "13"), "tiny: decode of id 13 fails", "rc=%d \"%s\"", rc, err);
    tl_tlz_tokenizer_free(tok);

    /* Variants built in memory: unk_token, add_prefix_space, unused ids. */
    const char *vocab = "{\"a\":0,\"b\":1,\"ab\":2,\"\\u0120\":3,\"<unk>\":5}";
    const char *json = make_json((json_parts){.model = "\"type\":\"BPE\",\"unk_token\":\"<unk>\",", .vocab = vocab,
                                              .merges = "[[\"a\",\"b\"]]"});
    rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    check(rc == TLZ_OK, "tiny+unk: load", "%s", err);
    if (!rc) {
        rc = tl_tlz_encode(tok, "abzab", 5, &ids, &n, err, sizeof err);
        check(rc == TLZ_OK && n == 3 && ids[0] == 2 && ids[1] == 5 && ids[2] == 2, "tiny+unk: unknown byte -> unk id",
              "rc=%d n=%zu", rc, n);
        free(ids);
        int32_t gap = 4; /* inside [0, vocab_size) but no token has it */
        rc = tl_tlz_decode(tok, &gap, 1, &dec, &len, err, sizeof err);
        const char *bytes;
        check(rc == TLZ_EID && tl_tlz_token_bytes(tok, 4, &bytes, &len) == TLZ_EID, "tiny+unk: unused id 4 is invalid",
              NULL);
        tl_tlz_tokenizer_free(tok);
    }
    /* fuse_unk: a run of bytes without a token is one unk_token, as HF's BPE fuses them */
    json = make_json((json_parts){.model = "\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":true,", .vocab = vocab,
                                  .merges = "[[\"a\",\"b\"]]"});
    rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    check(rc == TLZ_OK, "tiny+fuse_unk: load", "%s", err);
    if (!rc) {
        rc = tl_tlz_encode(tok, "abzzzab", 7, &ids, &n, err, sizeof err);
        check(rc == TLZ_OK && n == 3 && ids[0] == 2 && ids[1] == 5 && ids[2] == 2, "tiny+fuse_unk: zzz is one unk",
              "rc=%d n=%zu", rc, n);
        free(ids);
        tl_tlz_tokenizer_free(tok);
    }
    /* Added tokens' lstrip and rstrip take the whitespace beside them; HF's two passes match
       the tokens not normalized first (<s> inside the normalized a<s is <s>); single_word is
       refused, not ignored. */
    json = make_json((json_parts){
        .top = "\"added_tokens\":[{\"id\":4,\"content\":\"<s>\",\"special\":true,\"lstrip\":true,\"normalized\":false},"
               "{\"id\":6,\"content\":\"</s>\",\"special\":true,\"rstrip\":true},"
               "{\"id\":7,\"content\":\"a<s\",\"special\":false,\"normalized\":true}],",
        .vocab = "{\"a\":0,\"b\":1,\"ab\":2,\"\\u0120\":3,\"<unk>\":5}", .merges = "[\"a b\"]"});
    rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    check(rc == TLZ_OK, "tiny+strip: load", "%s", err);
    if (!rc) {
        const char *text = "ab \t<s>ab</s>  \xc2\xa0" "ab a<s>"; /* (U+00A0 is whitespace too) */
        rc = tl_tlz_encode(tok, text, strlen(text), &ids, &n, err, sizeof err);
        static const int32_t want[] = {2, 4, 2, 6, 2, 3, 0, 4};
        check(rc == TLZ_OK && n == 8 && memcmp(ids, want, sizeof want) == 0, "tiny+strip: lstrip, rstrip, two passes",
              "rc=%d n=%zu %s", rc, n, err);
        free(ids);
        tl_tlz_tokenizer_free(tok);
    }
    /* A match inside the blanks an rstrip token took is a token all the same, and the blanks
       after it are text again: HF finds the matches on the text first, then widens each
       (its start_offset moves to the later match's end). They were swallowed: "</s>   ab"
       was </s> ab, where HF reads </s> "  " " ab". */
    json = make_json((json_parts){
        .top = "\"added_tokens\":[{\"id\":4,\"content\":\"  \",\"special\":false,\"normalized\":false},"
               "{\"id\":6,\"content\":\"</s>\",\"special\":true,\"rstrip\":true,\"normalized\":false}],",
        .vocab = "{\"a\":0,\"b\":1,\"ab\":2,\"\\u0120\":3,\"<unk>\":5}", .merges = "[\"a b\"]"});
    rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    check(rc == TLZ_OK, "tiny+rstrip overlap: load", "%s", err);
    if (!rc) {
        rc = tl_tlz_encode(tok, "ab</s>   ab", 11, &ids, &n, err, sizeof err);
        static const int32_t want[] = {2, 6, 4, 3, 2};
        check(rc == TLZ_OK && n == 5 && memcmp(ids, want, sizeof want) == 0, "tiny+rstrip overlap: a token in the stripped blanks",
              "rc=%d n=%zu %s", rc, n, err);
        free(ids);
        rc = tl_tlz_encode(tok, "</s> ab", 7, &ids, &n, err, sizeof err); /* (one blank: no match in it, taken) */
        static const int32_t want_one[] = {6, 2};
        check(rc == TLZ_OK && n == 2 && memcmp(ids, want_one, sizeof want_one) == 0, "tiny+rstrip overlap: a blank taken",
              "rc=%d n=%zu", rc, n);
        free(ids);
        tl_tlz_tokenizer_free(tok);
    }
    expect_load_error("load error: single_word", make_json((json_parts){
        .top = "\"added_tokens\":[{\"id\":4,\"content\":\"ab\",\"special\":false,\"single_word\":true}],",
        .vocab = vocab, .merges = "[]"}), "\"single_word\": true (of 'ab') is not supported");
    json = make_json((json_parts){
        .top = "\"added_tokens\":[{\"id\":4,\"content\":\"<s>\",\"special\":true}],",
        .pre = "{\"type\":\"ByteLevel\",\"add_prefix_space\":true}", .vocab = vocab, .merges = "[\"a b\"]"});
    rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    check(rc == TLZ_OK, "tiny+prefix: load", "%s", err);
    if (!rc) {
        /* HF adds the space to each stretch between added tokens. */
        rc = tl_tlz_encode(tok, "ab<s>ab", 7, &ids, &n, err, sizeof err);
        static const int32_t want[] = {3, 2, 4, 3, 2};
        check(rc == TLZ_OK && n == 5 && memcmp(ids, want, sizeof want) == 0, "tiny+prefix: add_prefix_space", NULL);
        free(ids);
        tl_tlz_tokenizer_free(tok);
    }
    /* With use_regex false the whole stretch is one word, so a merge may
       cross a space: "a b" -> (a,Ġ) b; with the regex it is "a", " b". */
    const char *vocab2 = "{\"a\":0,\"b\":1,\"\\u0120\":3,\"a\\u0120\":5}";
    for (int use_regex = 0; use_regex < 2; use_regex++) {
        json = make_json((json_parts){.pre = use_regex ? NULL : "{\"type\":\"ByteLevel\",\"use_regex\":false}",
                                      .vocab = vocab2, .merges = "[\"a \\u0120\"]"});
        rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
        if (!rc) {
            rc = tl_tlz_encode(tok, "a b", 3, &ids, &n, err, sizeof err);
            int ok = rc == TLZ_OK && (use_regex ? n == 3 && ids[0] == 0 && ids[1] == 3 && ids[2] == 1
                                                : n == 2 && ids[0] == 5 && ids[1] == 1);
            free(ids);
            tl_tlz_tokenizer_free(tok);
            rc = ok ? TLZ_OK : -1;
        }
        check(rc == TLZ_OK, use_regex ? "tiny: use_regex true splits at the space"
                                      : "tiny: use_regex false merges across the space", "%s", err);
    }
}

/* ------------------------------------------------------------------ many added tokens */

/* Added-token matching against a brute-force reading of HF's rule, over 400 random tokens that
   share their first bytes (as "<|reserved_N|>" do): the tokens not normalized first, each
   leftmost-longest, then the normalized ones in the stretches left, the rest byte by byte
   (the vocabulary is the four letters alone, no merges); where specials are read as text, a
   special match's span stays text. */
#define MANY_ADDED 400
static const char MANY_ALPHABET[] = "ab<|";
typedef struct { char text[8]; size_t len; int32_t id; int special, normalized; } many_token;

/* The reference: text[0..len) in the pass of `normalized` tokens, ids appended to out. */
static void many_reference(const many_token *toks, const char *text, size_t len, int skip_special, int normalized,
                           int32_t *out, size_t *n_out)
{
    size_t start = 0;
    for (size_t i = 0; i < len;) {
        const many_token *best = NULL;
        for (int k = 0; k < MANY_ADDED; k++) {
            const many_token *m = &toks[k];
            if (m->normalized != normalized || m->len > len - i) continue;
            if (memcmp(m->text, text + i, m->len) == 0 && (!best || m->len > best->len)) best = m;
        }
        if (!best) { i++; continue; }
        /* (HF's split_special_tokens: the longest match over all, a special one then dropped,
           its span text not searched again in this pass) */
        if (skip_special && best->special) { i += best->len; continue; }
        if (normalized) {
            for (size_t c = start; c < i; c++) out[(*n_out)++] = (int32_t)(strchr(MANY_ALPHABET, text[c]) - MANY_ALPHABET);
        } else {
            many_reference(toks, text + start, i - start, skip_special, 1, out, n_out);
        }
        out[(*n_out)++] = best->id;
        i += best->len;
        start = i;
    }
    if (normalized) {
        for (size_t c = start; c < len; c++) out[(*n_out)++] = (int32_t)(strchr(MANY_ALPHABET, text[c]) - MANY_ALPHABET);
    } else {
        many_reference(toks, text + start, len - start, skip_special, 1, out, n_out);
    }
}

static void test_added_tokens_many(void)
{
    static many_token toks[MANY_ADDED];
    size_t cap = 64 + MANY_ADDED * 96, used = 0;
    char *json = malloc(cap);
    used += (size_t)snprintf(json + used, cap - used, "{\"added_tokens\": [");
    for (int k = 0; k < MANY_ADDED; k++) {
        many_token *m = &toks[k];
        for (;;) { /* a new text of 2..7 bytes, half of them starting "<|" */
            m->len = 2 + rnd_below(6);
            for (size_t c = 0; c < m->len; c++) m->text[c] = MANY_ALPHABET[rnd_below(4)];
            if (rnd_below(2)) memcpy(m->text, "<|", 2);
            m->text[m->len] = '\0';
            int taken = 0;
            for (int j = 0; j < k && !taken; j++) taken = strcmp(toks[j].text, m->text) == 0;
            if (!taken) break;
        }
        m->id = 10 + k;
        m->special = (int)rnd_below(2);
        m->normalized = (int)rnd_below(2);
        used += (size_t)snprintf(json + used, cap - used, "%s{\"id\": %d, \"content\": \"%s\", \"special\": %s, \"normalized\": %s}",
                                 k ? ", " : "", m->id, m->text, m->special ? "true" : "false",
                                 m->normalized ? "true" : "false");
    }
    snprintf(json + used, cap - used, "], \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false}, "
             "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"<\": 2, \"|\": 3}, \"merges\": []}}");
    tl_tlz_tokenizer *tok = NULL;
    char err[256] = "";
    int rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    free(json);
    check(rc == TLZ_OK, "many added: load", "%s", err);
    if (rc) return;
    int id_ok = 1;
    for (int k = 0; k < MANY_ADDED; k++) id_ok = id_ok && tl_tlz_token_id(tok, toks[k].text) == toks[k].id;
    check(id_ok, "many added: tl_tlz_token_id finds each text's id", NULL);
    check(tl_tlz_token_id(tok, "<") == 2 && tl_tlz_token_id(tok, "<|<|<|<|") == -1, "many added: tl_tlz_token_id of others", NULL);
    int mismatches = 0;
    for (int round = 0; round < 400; round++) {
        char text[64];
        const size_t len = rnd_below(sizeof text);
        for (size_t c = 0; c < len; c++) text[c] = MANY_ALPHABET[rnd_below(4)];
        const int skip_special = round & 1;
        int32_t want[64];
        size_t n_want = 0, n = 0;
        many_reference(toks, text, len, skip_special, 0, want, &n_want);
        int32_t *ids = NULL;
        rc = tl_tlz_encode_ex(tok, text, len, skip_special ? TLZ_ENCODE_NO_SPECIAL : 0, &ids, &n, err, sizeof err);
        if (rc || n != n_want || (n && memcmp(ids, want, n * sizeof *ids) != 0)) {
            if (!mismatches++)
                check(0, "many added: encode equals the reference", "'%.*s' (skip_special %d): %zu ids, want %zu", (int)len,
                      text, skip_special, n, n_want);
        }
        free(ids);
    }
    check(mismatches == 0, "many added: 400 random texts encode as the reference splits them", "%d differ", mismatches);
    tl_tlz_tokenizer_free(tok);
}

/* ------------------------------------------------------------------ GPT-2 */

static int32_t *read_ids(const char *path, size_t *n)
{
    size_t len;
    char *txt = read_all(path, &len);
    if (!txt) return NULL;
    int32_t *ids = malloc((len / 2 + 1) * sizeof *ids);
    size_t k = 0;
    for (char *p = txt, *end; ids; p = end) {
        long v = strtol(p, &end, 10);
        if (end == p) break;
        ids[k++] = (int32_t)v;
    }
    free(txt);
    *n = k;
    return ids;
}

static void test_gpt2(const char *dir)
{
    char err[256] = "";
    char *path = join(dir, "gpt2/tokenizer.json");
    tl_tlz_tokenizer *tok = NULL;
    clock_t t0 = clock();
    int rc = tl_tlz_tokenizer_load(path, &tok, err, sizeof err);
    double load_ms = 1000.0 * (double)(clock() - t0) / CLOCKS_PER_SEC;
    free(path);
    check(rc == TLZ_OK, "gpt2: load", "%s", err);
    if (rc) return;
    printf("  (gpt2 tokenizer.json loaded in %.0f ms)\n", load_ms);
    check(tl_tlz_vocab_size(tok) == 50257, "gpt2: vocab size 50257", "got %d", (int)tl_tlz_vocab_size(tok));
    check(tl_tlz_token_id(tok, "<|endoftext|>") == 50256 && tl_tlz_is_special(tok, 50256), "gpt2: <|endoftext|> = 50256",
          NULL);
    const char *b;
    size_t blen;
    rc = tl_tlz_token_bytes(tok, tl_tlz_token_id(tok, "\xc4\xa0the"), &b, &blen);
    check(rc == TLZ_OK && blen == 4 && memcmp(b, " the", 4) == 0 && tl_tlz_token_id(tok, "\xc4\xa0the") == 262,
          "gpt2: token 262 is \" the\"", NULL);
    rc = tl_tlz_token_bytes(tok, 50257, &b, &blen);
    check(rc == TLZ_EID && tl_tlz_token_bytes(tok, -1, &b, &blen) == TLZ_EID, "gpt2: token_bytes rejects bad ids", NULL);

    size_t slen = 0, ngold = 0; /* (read_ids leaves ngold where it fails: MinSizeRel's gcc warned) */
    char *spath = join(dir, "tokenizer/sample.txt"), *gpath = join(dir, "tokenizer/sample.gpt2.ids");
    char *sample = read_all(spath, &slen);
    int32_t *gold = read_ids(gpath, &ngold);
    free(spath);
    free(gpath);
    check(sample && gold && ngold > 1000, "gpt2: read golden sample", NULL);
    if (sample && gold) {
        int32_t *ids = NULL;
        size_t n = 0;
        rc = tl_tlz_encode(tok, sample, slen, &ids, &n, err, sizeof err);
        size_t first = 0;
        while (first < n && first < ngold && ids[first] == gold[first]) first++;
        check(rc == TLZ_OK && n == ngold && first == n, "gpt2: sample ids == gpt-3-encoder golden",
              "rc=%d, %zu ids vs %zu golden, first difference at %zu (got %d, want %d)", rc, n, ngold, first,
              first < n ? (int)ids[first] : -1, first < ngold ? (int)gold[first] : -1);
        char *dec = NULL;
        size_t dlen = 0;
        rc = tl_tlz_decode(tok, gold, ngold, &dec, &dlen, err, sizeof err);
        check(rc == TLZ_OK && dlen == slen && memcmp(dec, sample, slen) == 0, "gpt2: decode(golden) == sample", NULL);
        free(dec);

        /* Stream the sample token by token. */
        tl_tlz_stream *st = NULL;
        tl_tlz_stream_new(tok, &st, err, sizeof err);
        char *acc = malloc(slen + 1);
        size_t acc_n = 0, held = 0;
        int pieces_ok = 1;
        for (size_t i = 0; i < ngold && st; i++) {
            const char *piece;
            size_t plen;
            if (tl_tlz_stream_push(st, gold[i], &piece, &plen, err, sizeof err) || acc_n + plen > slen) {
                pieces_ok = 0;
                break;
            }
            const char *tb;
            size_t tl;
            tl_tlz_token_bytes(tok, gold[i], &tb, &tl);
            if (plen != tl) held++;
            if (!is_valid_utf8(piece, plen)) pieces_ok = 0;
            memcpy(acc + acc_n, piece, plen);
            acc_n += plen;
        }
        const char *piece;
        size_t plen = 0;
        tl_tlz_stream_flush(st, &piece, &plen);
        check(pieces_ok && plen == 0 && acc_n == slen && memcmp(acc, sample, slen) == 0 && held > 10,
              "gpt2: streamed sample == sample, every piece whole UTF-8",
              "pieces_ok=%d flushed=%zu bytes=%zu/%zu tokens-with-held-bytes=%zu", pieces_ok, plen, acc_n, slen, held);
        free(acc);
        tl_tlz_stream_free(st);
        free(ids);
    }
    free(sample);
    free(gold);

    /* Special tokens. */
    int32_t *ids = NULL;
    size_t n = 0;
    const char *s = "Hi<|endoftext|>there<|endoftext|><|endoftext|>";
    rc = tl_tlz_encode(tok, s, strlen(s), &ids, &n, err, sizeof err);
    static const int32_t want[] = {17250, 50256, 8117, 50256, 50256};
    check(rc == TLZ_OK && n == 5 && memcmp(ids, want, sizeof want) == 0, "gpt2: <|endoftext|> in text -> 50256",
          NULL);
    free(ids);
    rc = tl_tlz_encode_ex(tok, s, strlen(s), TLZ_ENCODE_NO_SPECIAL, &ids, &n, err, sizeof err);
    int has_special = 0;
    for (size_t i = 0; i < n; i++) has_special |= ids[i] == 50256;
    check(rc == TLZ_OK && !has_special && n > 5, "gpt2: NO_SPECIAL encodes <|endoftext|> as text", NULL);
    free(ids);

    /* A few known encodings (gpt-3-encoder). */
    rc = tl_tlz_encode(tok, "Hello world", 11, &ids, &n, err, sizeof err);
    check(rc == TLZ_OK && n == 2 && ids[0] == 15496 && ids[1] == 995, "gpt2: \"Hello world\" = 15496 995", NULL);
    free(ids);
    rc = tl_tlz_encode(tok, "", 0, &ids, &n, err, sizeof err);
    check(rc == TLZ_OK && n == 0, "gpt2: empty text -> no ids", NULL);
    free(ids);
    rc = tl_tlz_encode(tok, "a\0b", 3, &ids, &n, err, sizeof err);
    check(rc == TLZ_OK && n == 3 && ids[1] == 188, "gpt2: NUL byte is token 188", NULL);
    free(ids);

    /* Decode errors. */
    char *dec = (char *)1;
    size_t dlen = 7;
    int32_t bad_ids[] = {464, 50257};
    rc = tl_tlz_decode(tok, bad_ids, 2, &dec, &dlen, err, sizeof err);
    check(rc == TLZ_EID && dec == NULL && dlen == 0 && strstr(err, "50257") && strstr(err, "position 1"),
          "gpt2: decode of id 50257 fails cleanly", "rc=%d \"%s\"", rc, err);
    bad_ids[1] = -5;
    rc = tl_tlz_decode(tok, bad_ids, 2, &dec, &dlen, err, sizeof err);
    check(rc == TLZ_EID && strstr(err, "-5"), "gpt2: decode of id -5 fails cleanly", "rc=%d \"%s\"", rc, err);
    rc = tl_tlz_encode(NULL, "x", 1, &ids, &n, err, sizeof err);
    check(rc == TLZ_EINVAL, "gpt2: encode with NULL tokenizer fails cleanly", NULL);
    rc = tl_tlz_decode(tok, NULL, 0, &dec, &dlen, NULL, 0);
    check(rc == TLZ_OK && dlen == 0 && dec && dec[0] == '\0', "gpt2: decode of nothing is \"\"", NULL);
    free(dec);

    /* Streaming: held-back bytes, invalid bytes, flush. */
    tl_tlz_stream *st = NULL;
    rc = tl_tlz_stream_new(tok, &st, err, sizeof err);
    if (rc == TLZ_OK) {
        const char *p;
        size_t pl;
        /* Bytes 0xE4 0xB8 0xAD = U+4E2D; byte tokens are ids of the byte-level chars. */
        int32_t e4 = tl_tlz_token_id(tok, "\xc3\xa4"), b8 = tl_tlz_token_id(tok, "\xc2\xb8"), ad = tl_tlz_token_id(tok, "\xc5\x83"); /* 0xAD -> U+0143 */
        int ok = e4 >= 0 && b8 >= 0 && ad >= 0;
        ok = ok && !tl_tlz_stream_push(st, e4, &p, &pl, NULL, 0) && pl == 0;
        ok = ok && !tl_tlz_stream_push(st, b8, &p, &pl, NULL, 0) && pl == 0;
        ok = ok && !tl_tlz_stream_push(st, ad, &p, &pl, NULL, 0) && pl == 3 && memcmp(p, "\xe4\xb8\xad", 3) == 0;
        check(ok, "stream: a code point split over 3 tokens comes out whole", NULL);
        int32_t x = tl_tlz_token_id(tok, "x");
        ok = !tl_tlz_stream_push(st, e4, &p, &pl, NULL, 0) && pl == 0;
        ok = ok && !tl_tlz_stream_push(st, x, &p, &pl, NULL, 0) && pl == 2 && memcmp(p, "\xe4x", 2) == 0;
        check(ok, "stream: an unfinished sequence broken by ASCII is passed through", NULL);
        int32_t ff = tl_tlz_token_id(tok, "\xc3\xbf");
        ok = !tl_tlz_stream_push(st, ff, &p, &pl, NULL, 0) && pl == 1 && (unsigned char)p[0] == 0xff;
        check(ok, "stream: an invalid byte is emitted at once", NULL);
        ok = !tl_tlz_stream_push(st, e4, &p, &pl, NULL, 0) && pl == 0 &&
             !tl_tlz_stream_push(st, b8, &p, &pl, NULL, 0) && pl == 0;
        tl_tlz_stream_flush(st, &p, &pl);
        ok = ok && pl == 2 && memcmp(p, "\xe4\xb8", 2) == 0;
        tl_tlz_stream_flush(st, &p, &pl);
        ok = ok && pl == 0;
        check(ok, "stream: flush emits held bytes once", NULL);
        rc = tl_tlz_stream_push(st, 50257, &p, &pl, err, sizeof err);
        check(rc == TLZ_EID && strstr(err, "50257"), "stream: bad id fails cleanly", "rc=%d \"%s\"", rc, err);
        tl_tlz_stream_free(st);
    }

    /* Round trips of random inputs. */
    rc = tl_tlz_stream_new(tok, &st, err, sizeof err);
    char buf[1024];
    int fails[4] = {0, 0, 0, 0};
    const char *first_why = NULL;
    for (int i = 0; i < 2000 && st; i++) {
        int kind = i % 4;
        size_t len = random_text(kind, buf, sizeof buf);
        const char *why = roundtrip(tok, st, buf, len, 0);
        if (why) {
            if (!first_why) {
                first_why = why;
                printf("  input %d (kind %d, %zu bytes): %s\n", i, kind, len, why);
            }
            fails[kind]++;
        }
    }
    check(!fails[0], "gpt2: 500 random byte strings round-trip (+ stream)", "%d failed", fails[0]);
    check(!fails[1], "gpt2: 500 random valid UTF-8 strings round-trip (+ stream)", "%d failed", fails[1]);
    check(!fails[2], "gpt2: 500 random ASCII word/space mixes round-trip (+ stream)", "%d failed", fails[2]);
    check(!fails[3], "gpt2: 500 random mixed valid/invalid strings round-trip (+ stream)", "%d failed", fails[3]);

    /* Large inputs: one 1 MB pre-token (BPE must not be quadratic), long
       whitespace runs (regex backtracking), 1 MB of random bytes. */
    size_t big = 1 << 20;
    char *text = malloc(big);
    const char *why;
    memset(text, 'a', big);
    t0 = clock();
    why = roundtrip(tok, st, text, big, 0);
    double ms = 1000.0 * (double)(clock() - t0) / CLOCKS_PER_SEC;
    check(!why, "gpt2: 1 MB single-word input round-trips", "%s", why);
    printf("  (1 MB word: %.0f ms)\n", ms);
    memset(text, ' ', big);
    text[big - 1] = 'x';
    why = roundtrip(tok, st, text, big, 0);
    check(!why, "gpt2: 1 MB of spaces then a letter round-trips", "%s", why);
    for (size_t i = 0; i < big; i++) text[i] = (char)rnd();
    t0 = clock();
    why = roundtrip(tok, st, text, big, 0);
    ms = 1000.0 * (double)(clock() - t0) / CLOCKS_PER_SEC;
    check(!why, "gpt2: 1 MB of random bytes round-trips", "%s", why);
    printf("  (1 MB random bytes: %.0f ms)\n", ms);
    for (size_t i = 0; i < big; i++) text[i] = "ab \n\t.,'s1"[rnd_below(10)];
    why = roundtrip(tok, st, text, big, 0);
    check(!why, "gpt2: 1 MB of short words round-trips", "%s", why);
    free(text);
    tl_tlz_stream_free(st);
    tl_tlz_tokenizer_free(tok);
}

/* Tokens longer than the stream's first buffer (64 bytes here after a short one, 130 as the
   first piece): each piece is the token's bytes, the buffer grown to hold it (a growth one
   byte short, or grown once where twice was needed, wrote past it: ASan's CI run sees that). */
static void test_long_tokens(void)
{
    char x64[65], y130[131], json[1024], err[256] = "";
    memset(x64, 'x', 64), x64[64] = 0;
    memset(y130, 'y', 130), y130[130] = 0;
    snprintf(json, sizeof json,
             "{\"pre_tokenizer\": {\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}, "
             "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\":0,\"b\":1,\"%s\":2,\"%s\":3}, \"merges\": []}}", x64, y130);
    tl_tlz_tokenizer *tok = NULL;
    tl_tlz_stream *st = NULL;
    int rc = tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err);
    check(rc == TLZ_OK, "long tokens: load", "%s", err);
    if (rc) return;
    const char *piece;
    size_t len, total = 0;
    char got[256];
    for (int order = 0; order < 2; order++) {
        rc = tl_tlz_stream_new(tok, &st, err, sizeof err);
        check(rc == TLZ_OK, "long tokens: stream", "%s", err);
        if (rc) break;
        const int32_t ids[2][2] = {{0, 2}, {3, 1}};
        total = 0;
        for (int i = 0; i < 2; i++) {
            if (tl_tlz_stream_push(st, ids[order][i], &piece, &len, err, sizeof err) != TLZ_OK || total + len > sizeof got) break;
            memcpy(got + total, piece, len), total += len;
        }
        char want[256];
        snprintf(want, sizeof want, "%s", order ? "" : "a");
        strcat(want, order ? y130 : x64);
        if (order) strcat(want, "b");
        check(total == strlen(want) && memcmp(got, want, total) == 0, order ? "long tokens: 130 bytes first" :
              "long tokens: 64 bytes after one", "%zu bytes", total);
        tl_tlz_stream_free(st);
        st = NULL;
    }
    tl_tlz_tokenizer_free(tok);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DATA_DIR (tests/data)\n", argv[0]);
        return 2;
    }
    test_load_errors(argv[1]);
    test_repeated_merge();
    test_tiny(argv[1]);
    test_added_tokens_many();
    test_long_tokens();
    test_gpt2(argv[1]);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}

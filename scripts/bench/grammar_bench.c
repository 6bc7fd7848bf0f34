/* grammar_bench: allowed-token mask time per token, grammar compile time, and constrained vs
 * unconstrained decoding speed.
 *
 *   tinyloop-grammar-bench [SOURCE_DIR]
 *
 * For each vocabulary (GPT-2's 50257 tokens from tests/data/gpt2/tokenizer.json, and the
 * shipped model's) and each grammar (the shipped JSON grammar, a large JSON-schema grammar),
 * it walks seeded documents token by token and times the FULL mask at every position (the
 * slow path: sampling, or a greedy argmax the grammar rejected), starting from an empty mask
 * cache, as maskbench does. It also times the argmax-first check greedy decoding uses, and
 * prints median, p99 and max. Then constrained vs unconstrained tokens/s on the model, and
 * free text under grammars built around others (after, tags, a regular expression). Last, the
 * hard cases: compile and match times of grammars that were exponential, quadratic or
 * unbounded before (oneOf through $ref'd anyOf, rule chains, nested repetitions of what may be
 * empty, a shared grammar's tables, many negated token references). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grammar.h"
#include "tinyloop.h"
#include "tokenizer.h"

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static char *slurp(const char *path, size_t *len) {
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

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---------------------------------------------------------------- documents */

static uint64_t rng = 88172645463325252ULL;
static unsigned rnd(unsigned n) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (unsigned)(rng % n);
}

typedef struct buf { char *p; size_t n, cap; } buf;
static void add(buf *b, const char *s) {
    size_t k = strlen(s);
    if (b->n + k + 1 > b->cap) {
        b->cap = (b->n + k + 1) * 2;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, k + 1);
    b->n += k;
}

static const char *WORDS[] = {"Elizabeth", "Darcy", "the", "ball", "Netherfield", "pride", "a letter", "Mr. Collins",
                              "caf\xc3\xa9", "na\\u00efve", "line\\nbreak", "100%", "quote \\\"x\\\"", "Pemberley",
                              "sister", "\xe6\x97\xa5\xe6\x9c\xac", "estate", "income", "Bennet", "Longbourn"};

static void random_value(buf *b, int depth) {
    char tmp[64];
    unsigned k = rnd(depth >= 3 ? 4 : 7);
    switch (k) {
    case 0: add(b, "\""); add(b, WORDS[rnd(20)]); if (rnd(2)) { add(b, " "); add(b, WORDS[rnd(20)]); } add(b, "\""); break;
    case 1: snprintf(tmp, sizeof tmp, "%d", (int)rnd(100000) - 500); add(b, tmp); break;
    case 2: snprintf(tmp, sizeof tmp, "%d.%d", (int)rnd(1000), (int)rnd(100)); add(b, tmp); break;
    case 3: add(b, rnd(3) == 0 ? "null" : rnd(2) ? "true" : "false"); break;
    case 4: case 5: {
        add(b, "{");
        unsigned n = rnd(5);
        for (unsigned i = 0; i < n; i++) {
            if (i) add(b, ", ");
            add(b, "\"");
            add(b, WORDS[rnd(20)]);
            add(b, "\": ");
            random_value(b, depth + 1);
        }
        add(b, "}");
        break;
    }
    default: {
        add(b, "[");
        unsigned n = rnd(5);
        for (unsigned i = 0; i < n; i++) {
            if (i) add(b, ", ");
            random_value(b, depth + 1);
        }
        add(b, "]");
    }
    }
}

static const char *SCHEMA =
    "{\"type\":\"object\",\"properties\":{"
    "\"id\":{\"type\":\"string\",\"format\":\"uuid\"},"
    "\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":40},"
    "\"email\":{\"type\":\"string\",\"pattern\":\"^[a-z0-9.]+@[a-z]+\\\\.[a-z]{2,4}$\"},"
    "\"age\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":150},"
    "\"score\":{\"type\":\"number\"},"
    "\"born\":{\"type\":\"string\",\"format\":\"date\"},"
    "\"updated\":{\"type\":\"string\",\"format\":\"date-time\"},"
    "\"role\":{\"enum\":[\"admin\",\"editor\",\"viewer\",\"guest\"]},"
    "\"active\":{\"type\":\"boolean\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":20},\"maxItems\":8},"
    "\"address\":{\"type\":\"object\",\"properties\":{\"street\":{\"type\":\"string\"},\"city\":{\"type\":\"string\"},"
    "\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"},\"country\":{\"enum\":[\"GB\",\"FR\",\"DE\",\"US\"]}},"
    "\"required\":[\"street\",\"city\"]},"
    "\"friends\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/friend\"},\"maxItems\":5},"
    "\"settings\":{\"type\":\"object\",\"properties\":{\"theme\":{\"enum\":[\"dark\",\"light\"]},\"font\":{\"type\":\"integer\",\"minimum\":8,\"maximum\":72},"
    "\"notify\":{\"type\":\"boolean\"}},\"additionalProperties\":{\"type\":\"string\"}},"
    "\"note\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"null\"}]}"
    "},\"required\":[\"id\",\"name\",\"age\",\"role\"],"
    "\"$defs\":{\"friend\":{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"since\":{\"type\":\"integer\",\"minimum\":1900,\"maximum\":2100}},\"required\":[\"name\"]}}}";

static void schema_doc(buf *b) {
    char tmp[256];
    snprintf(tmp, sizeof tmp, "{\"id\":\"%08x-%04x-4%03x-a%03x-%012x\",\"name\":\"Elizabeth Bennet\"", rnd(1u << 31), rnd(65536), rnd(4096),
             rnd(4096), rnd(1u << 31));
    add(b, tmp);
    if (rnd(2)) add(b, ",\"email\":\"lizzy.bennet@longbourn.uk\"");
    snprintf(tmp, sizeof tmp, ",\"age\":%u", rnd(150));
    add(b, tmp);
    if (rnd(2)) { snprintf(tmp, sizeof tmp, ",\"score\":%u.%u", rnd(100), rnd(100)); add(b, tmp); }
    if (rnd(2)) add(b, ",\"born\":\"1796-01-28\"");
    if (rnd(2)) add(b, ",\"updated\":\"2024-05-01T12:30:00Z\"");
    static const char *roles[] = {"admin", "editor", "viewer", "guest"};
    snprintf(tmp, sizeof tmp, ",\"role\":\"%s\"", roles[rnd(4)]);
    add(b, tmp);
    if (rnd(2)) add(b, ",\"active\":true");
    if (rnd(2)) { add(b, ",\"tags\":[\"wit\",\"walks\",\"novels\"]"); }
    if (rnd(2)) add(b, ",\"address\":{\"street\":\"1 Meryton Road\",\"city\":\"Hertfordshire\",\"zip\":\"12345\",\"country\":\"GB\"}");
    if (rnd(2)) add(b, ",\"friends\":[{\"name\":\"Charlotte\",\"since\":1901},{\"name\":\"Jane\"}]");
    if (rnd(2)) add(b, ",\"settings\":{\"theme\":\"dark\",\"font\":12,\"notify\":false,\"lang\":\"en\"}");
    if (rnd(2)) add(b, ",\"note\":null");
    add(b, "}");
}

/* ---------------------------------------------------------------- one scenario */

typedef struct result { double median, p99, max, mean, check_median, compile_ms, bind_ms; int n; double warm_median, warm_p99, warm_max; } result;

static void percentiles(double *t, int n, double *median, double *p99, double *max, double *mean) {
    qsort(t, (size_t)n, sizeof *t, cmp_double);
    double s = 0;
    for (int i = 0; i < n; i++) s += t[i];
    *median = t[n / 2];
    *p99 = t[(int)((n - 1) * 0.99)];
    *max = t[n - 1];
    *mean = s / n;
}

static int run(const tl_tlz_tokenizer *tok, int vocab, int eos, const char *gbnf, bool schema, int n_docs, result *r) {
    /* compile time: median of repeated compiles */
    double times[41];
    for (int i = 0; i < 41; i++) {
        tl_compiled_grammar *g;
        double t0 = now_us();
        tl_status st = schema ? tl_grammar_compile_json_schema(gbnf, strlen(gbnf), NULL, &g)
                              : tl_grammar_compile_gbnf(gbnf, strlen(gbnf), &g);
        times[i] = now_us() - t0;
        if (st != TL_OK) { fprintf(stderr, "compile: %s\n", tl_last_error()); return 1; }
        tl_compiled_grammar_free(g);
    }
    qsort(times, 41, sizeof *times, cmp_double);
    r->compile_ms = times[20] / 1000.0;
    tl_compiled_grammar *g;
    if (schema) tl_grammar_compile_json_schema(gbnf, strlen(gbnf), NULL, &g);
    else tl_grammar_compile_gbnf(gbnf, strlen(gbnf), &g);
    tl_grammar_matcher *mt;
    double t0 = now_us();
    if (tl_gram_matcher_new(g, tok, vocab, eos, &mt) != TL_OK) { fprintf(stderr, "%s\n", tl_last_error()); return 1; }
    r->bind_ms = (now_us() - t0) / 1000.0;
    uint8_t *mask = malloc((size_t)vocab);
    size_t cap = 1 << 16;
    double *t = malloc(cap * sizeof *t), *check = malloc(cap * sizeof *check);
    int n = 0, nc = 0, cold_n = 0;
    for (int pass = 0; pass < 2; pass++) {
    /* pass 0: from empty caches; pass 1: the same documents again (warm caches) */
    if (pass == 1) {
        percentiles(t, n, &r->median, &r->p99, &r->max, &r->mean);
        cold_n = n;
        n = 0;
    }
    rng = 88172645463325252ULL;
    for (int d = 0; d < n_docs; d++) {
        buf b = {0};
        if (schema) schema_doc(&b);
        else random_value(&b, rnd(2) ? 0 : 1);
        int32_t *ids;
        size_t n_ids;
        if (tl_tlz_encode(tok, b.p, b.n, &ids, &n_ids, NULL, 0) != 0) { free(b.p); continue; }
        for (size_t i = 0; i < n_ids; i++) {
            int count;
            double a = now_us();
            tl_grammar_matcher_mask(mt, mask, vocab, &count);
            double z = now_us();
            if ((size_t)n < cap) t[n++] = z - a;
            if (!mask[ids[i]]) { fprintf(stderr, "document token %zu rejected: %s\n", i, b.p); break; }
            int ok;
            a = now_us();
            tl_grammar_matcher_accepts(mt, ids[i], &ok);
            z = now_us();
            if ((size_t)nc < cap) check[nc++] = z - a;
            tl_grammar_matcher_accept(mt, ids[i]);
        }
        tl_grammar_matcher_rollback(mt, 0);
        /* back to the start for the next document */
        while (tl_grammar_matcher_rollback(mt, 1) == TL_OK) {}
        free(ids);
        free(b.p);
    }
    }
    double wmean;
    percentiles(t, n, &r->warm_median, &r->warm_p99, &r->warm_max, &wmean);
    double cm, cp, cx, cmean;
    percentiles(check, nc, &cm, &cp, &cx, &cmean);
    r->check_median = cm;
    r->n = cold_n;
    free(t);
    free(check);
    free(mask);
    tl_grammar_matcher_free(mt);
    tl_compiled_grammar_free(g);
    return 0;
}

static double tokens_per_s(tl_model *m, const tl_compiled_grammar *g, float temperature) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    tl_grammar grammar;
    if (g) { tl_grammar_use(&grammar, g); cfg.grammar = &grammar; }
    cfg.max_tokens = 200;
    cfg.temperature = temperature;
    cfg.ignore_eos = g ? 0 : 1;
    int32_t prompt[] = {1, 2, 3}, out[256];
    int len;
    double ms = 0, decoded = 0;
    for (int seed = 1; seed <= 5; seed++) {
        cfg.sample_seed = (uint64_t)seed;
        tl_generate_stats st;
        if (tl_generate(m, prompt, 3, &cfg, out, 256, &len, &st) != TL_OK) { fprintf(stderr, "%s\n", tl_last_error()); return 0; }
        /* the tokens decoded, by the engine's rule (the prefill's token is not: counted, the
           constrained runs of ~21 tokens read 5% fast) */
        decoded += tl_stats_decode_tokens_per_s(&st) * st.decode_ms / 1000.0;
        ms += st.decode_ms;
    }
    return ms > 0 ? decoded / (ms / 1000.0) : 0;
}

/* ---- hard cases: grammars whose compile or match time was exponential, quadratic or
   unbounded in earlier versions, each timed once */
static tl_compiled_grammar *timed_gbnf(const char *text, double *ms) {
    tl_compiled_grammar *g = NULL;
    const double t0 = now_us();
    if (tl_grammar_compile_gbnf(text, strlen(text), &g) != TL_OK) fprintf(stderr, "  (%s)\n", tl_last_error());
    *ms = (now_us() - t0) / 1e3;
    return g;
}

static void hard_cases(const tl_tlz_tokenizer *gpt2) {
    printf("\nhard cases (exponential, quadratic or unbounded in earlier versions):\n");
    buf b = {0};
    /* oneOf's branch types through 8 levels of anyOf, each of 12 $refs to the next */
    add(&b, "{\"$defs\":{");
    char piece[64];
    for (int level = 0; level < 8; level++) {
        snprintf(piece, sizeof piece, "\"d%d\":{\"anyOf\":[", level);
        add(&b, piece);
        for (int k = 0; k < 12; k++) {
            snprintf(piece, sizeof piece, "%s{\"$ref\":\"#/$defs/d%d\"}", k ? "," : "", level + 1);
            add(&b, piece);
        }
        add(&b, "]},");
    }
    add(&b, "\"d8\":{\"type\":\"string\"}},\"oneOf\":[{\"$ref\":\"#/$defs/d0\"},{\"type\":\"integer\"}]}");
    tl_compiled_grammar *g = NULL;
    double t0 = now_us();
    const tl_status st = tl_grammar_compile_json_schema(b.p, b.n, NULL, &g);
    printf("  oneOf through 8 levels of 12-way anyOf ($ref), %zu-byte schema: %s in %.1f ms\n", b.n,
           st == TL_OK ? "compiled" : "failed", (now_us() - t0) / 1e3);
    tl_compiled_grammar_free(g);
    /* a chain of 80,000 rules, each nullable only through the next */
    b.n = 0;
    add(&b, "root ::= r1\n");
    for (int k = 1; k < 80000; k++) {
        snprintf(piece, sizeof piece, "r%d ::= r%d\n", k, k + 1);
        add(&b, piece);
    }
    add(&b, "r80000 ::= \"b\" | \"\"\n");
    double ms;
    g = timed_gbnf(b.p, &ms);
    printf("  a chain of 80,000 rules (%zu bytes): %s in %.1f ms\n", b.n, g ? "compiled" : "failed", ms);
    tl_compiled_grammar_free(g);
    /* ("x"?)+ nested 24 deep */
    b.n = 0;
    add(&b, "root ::= ");
    for (int k = 0; k < 24; k++) add(&b, "(");
    add(&b, "\"x\"?");
    for (int k = 0; k < 24; k++) add(&b, ")+");
    add(&b, " \"y\"\n");
    g = timed_gbnf(b.p, &ms);
    int match = 0;
    t0 = now_us();
    if (g) tl_grammar_matches(g, "xxxy", 4, &match);
    printf("  (\"x\"?)+ nested 24 deep: %s in %.2f ms, \"xxxy\" %s in %.2f ms\n", g ? "compiled" : "failed", ms,
           match ? "matched" : "not matched", (now_us() - t0) / 1e3);
    tl_compiled_grammar_free(g);
    /* a regular expression repeating a group that holds a chain of empty matches */
    const char *pattern = "((?:){5,720}|[^\"]?){5,720}";
    const char *text = "It is a truth universally acknowledged, that a single man";
    t0 = now_us();
    if (tl_grammar_compile_regex(pattern, strlen(pattern), &g) == TL_OK) {
        tl_grammar_matches(g, text, strlen(text), &match);
        printf("  regex %s: compiled and matched %zu bytes in %.1f ms\n", pattern, strlen(text), (now_us() - t0) / 1e3);
        tl_compiled_grammar_free(g);
    }
    /* one compiled grammar shared by 10,000 documents, each a new 40-deep path (a server's
       cached grammar), its tables on an 8 MiB budget */
    const char *object = "{\"type\":\"object\"}";
    tl_grammar_compile_json_schema(object, strlen(object), NULL, &g);
    if (g) {
        g->table_budget = (size_t)8 << 20;
        int matched = 0;
        size_t peak = 0;
        t0 = now_us();
        for (int d = 0; d < 10000; d++) {
            b.n = 0;
            add(&b, "{\"k\":");
            char closers[64];
            for (int depth = 0; depth < 40; depth++) {
                const bool array = rnd(2);
                add(&b, array ? "[" : "{\"k\":");
                closers[39 - depth] = array ? ']' : '}';
            }
            add(&b, "1");
            closers[40] = '}';
            closers[41] = 0;
            add(&b, closers);
            if (tl_grammar_matches(g, b.p, b.n, &match) == TL_OK) matched += match;
            const size_t bytes = tl_gram_runtime_bytes(&g->tables->rt);
            if (bytes > peak) peak = bytes;
        }
        printf("  one grammar, 10,000 new 40-deep documents: %d matched in %.1f s, %lld table generations, "
               "tables at most %.1f MiB (budget 8)\n", matched, (now_us() - t0) / 1e6, (long long)g->generations,
               (double)peak / (1 << 20));
        tl_compiled_grammar_free(g);
    }
    /* 16,000 negated token references waiting at once, GPT-2's vocabulary */
    b.n = 0;
    add(&b, "root ::= (x)*\nx ::= ");
    for (int k = 0; k < 16000; k++) {
        snprintf(piece, sizeof piece, "%s!<[%d]>", k ? " | " : "", k % 7);
        add(&b, piece);
    }
    add(&b, "\n");
    g = timed_gbnf(b.p, &ms);
    tl_grammar_matcher *mt = NULL;
    if (g && tl_gram_matcher_new(g, gpt2, tl_tlz_vocab_size(gpt2), tl_tlz_token_id(gpt2, "<|endoftext|>"), &mt) == TL_OK) {
        uint8_t *allowed = malloc((size_t)tl_tlz_vocab_size(gpt2));
        t0 = now_us();
        int count = 0;
        for (int k = 0; k < 5 && allowed; k++) {
            count = tl_gram_matcher_mask_state(mt, tl_gram_matcher_state(mt), allowed);
            tl_grammar_matcher_accept(mt, 100 + k);
        }
        printf("  16,000 negated token references, %zu bytes: a mask of %d tokens in %.2f ms\n", b.n, count,
               (now_us() - t0) / 1e3 / 5);
        free(allowed);
        tl_grammar_matcher_free(mt);
    }
    tl_compiled_grammar_free(g);
    free(b.p);
}

int main(int argc, char **argv) {
    if (argc > 1 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        printf("usage: tinyloop-grammar-bench [SOURCE_DIR]  (the repository root, default .: its grammars, GPT-2's\n"
               "       tokenizer and the shipped model are read from there; the figures go to stdout)\n");
        return 0;
    }
    if (argc > 2 || (argc > 1 && argv[1][0] == '-')) {
        fprintf(stderr, "tinyloop-grammar-bench: unexpected argument %s (see --help)\n", argv[argc > 2 ? 2 : 1]);
        return 2;
    }
    const char *root = argc > 1 ? argv[1] : ".";
    char path[1024];
    snprintf(path, sizeof path, "%s/lua/tinyloop/grammars/json.gbnf", root);
    char *json_gbnf = slurp(path, NULL);
    if (!json_gbnf) { fprintf(stderr, "cannot read %s\n", path); return 1; }
    static const char *vocabs[][2] = {{"GPT-2", "tests/data/gpt2/tokenizer.json"}, {"tinyloop-austen", "models/tinyloop-austen/tokenizer.json"}};
    printf("mask time per token in microseconds; cold: from empty caches, warm: the same documents again\n");
    printf("%-16s %-12s %6s %8s %8s %8s %8s | %8s %8s %8s | %9s %10s %8s\n", "vocabulary", "grammar", "tokens", "median", "p99",
           "max", "mean", "w.median", "w.p99", "w.max", "argmax_us", "compile_ms", "trie_ms");
    for (int v = 0; v < 2; v++) {
        snprintf(path, sizeof path, "%s/%s", root, vocabs[v][1]);
        tl_tlz_tokenizer *tok;
        char err[256];
        if (tl_tlz_tokenizer_load(path, &tok, err, sizeof err) != 0) { fprintf(stderr, "%s: %s\n", path, err); return 1; }
        const int vocab = tl_tlz_vocab_size(tok);
        const int eos = tl_tlz_token_id(tok, "<|endoftext|>");
        for (int s = 0; s < 2; s++) {
            result r = {0};
            if (run(tok, vocab, eos, s ? SCHEMA : json_gbnf, s, s ? 60 : 200, &r)) return 1;
            printf("%-16s %-12s %6d %8.1f %8.1f %8.1f %8.1f | %8.1f %8.1f %8.1f | %9.2f %10.3f %8.1f\n", vocabs[v][0],
                   s ? "json-schema" : "json.gbnf", r.n, r.median, r.p99, r.max, r.mean, r.warm_median, r.warm_p99, r.warm_max,
                   r.check_median, r.compile_ms, r.bind_ms);
        }
        tl_tlz_tokenizer_free(tok);
    }
    snprintf(path, sizeof path, "%s/models/tinyloop-austen", root);
    tl_model *m;
    tl_load_options lo;
    tl_load_options_init(&lo);
    lo.n_threads = 1;
    if (tl_model_load(path, &lo, &m) == TL_OK) {
        tl_compiled_grammar *g;
        tl_grammar_compile_gbnf(json_gbnf, strlen(json_gbnf), &g);
        printf("\ndecode tokens/s on tinyloop-austen (200 tokens x 5 seeds):\n");
        printf("  greedy    unconstrained %8.0f   json.gbnf %8.0f\n", tokens_per_s(m, NULL, 0), tokens_per_s(m, g, 0));
        printf("  sampling  unconstrained %8.0f   json.gbnf %8.0f\n", tokens_per_s(m, NULL, 1), tokens_per_s(m, g, 1));
        /* free text under grammars built around others: the text stays free (the trigger never
           comes in these 200 tokens), so the figures are the cost of their masks alone,
           alternated with unconstrained runs three times (this machine drifts) */
        tl_compiled_grammar *after = NULL, *tags = NULL, *regex = NULL, *never = NULL, *body = NULL;
        tl_grammar_compile_after(g, "</think>", 8, 4, &after);
        const char *nothing = "root ::= [^\\x00-\\U0010FFFF]";
        tl_grammar_compile_gbnf(nothing, strlen(nothing), &never);
        const tl_grammar_tag think_body[] = {{"</think>", never, "", 0}};
        const char *const close_trigger[] = {"</think>"};
        tl_grammar_compile_tags(think_body, 1, close_trigger, 1, NULL, &body);
        const tl_grammar_tag tool_tags[] = {{"<tool_call>", g, "</tool_call>", 1}, {"<think>", body, "</think>", 0}};
        const char *const tool_triggers[] = {"<tool_call>", "<think>"};
        tl_grammar_compile_tags(tool_tags, 2, tool_triggers, 2, NULL, &tags);
        tl_grammar_compile_regex("[^<]*", 5, &regex);
        printf("  sampling, free text under a grammar (three alternated rounds):\n");
        for (int round = 0; round < 3 && after && tags && regex; round++)
            printf("    unconstrained %8.0f   after(</think>, json) %8.0f   tags(<tool_call>, <think>) %8.0f   regex [^<]* %8.0f\n",
                   tokens_per_s(m, NULL, 1), tokens_per_s(m, after, 1), tokens_per_s(m, tags, 1), tokens_per_s(m, regex, 1));
        tl_compiled_grammar_free(after);
        tl_compiled_grammar_free(tags);
        tl_compiled_grammar_free(regex);
        tl_compiled_grammar_free(never);
        tl_compiled_grammar_free(body);
        tl_compiled_grammar_free(g);
        tl_model_free(m);
    }
    snprintf(path, sizeof path, "%s/%s", root, vocabs[0][1]);
    tl_tlz_tokenizer *gpt2;
    char err[256];
    if (tl_tlz_tokenizer_load(path, &gpt2, err, sizeof err) == 0) {
        hard_cases(gpt2);
        tl_tlz_tokenizer_free(gpt2);
    }
    free(json_gbnf);
    return 0;
}

/* test_kv_f16.c: the f16 KV cache (tl_load_options.kv_type). Its K/V pages hold half the
 * bytes of f32's; the logits stay close to f32's on the shipped model's text (top-1 and
 * error bounds, teacher-forced, one row a step as decode runs and in prompt chunks) but are
 * not f32's bits (the rows really are rounded); a widened row equals the rounded value on
 * every ISA (test_isa checks the kernels) and the suite reruns its bit-identity tests with
 * TINYLOOP_KV_TYPE=f16 (tests/CMakeLists.txt). Bad options are refused with clear errors. A
 * row of logits holding a NaN (an f16 cache's overflow, or any other) fails every decoder, and
 * an embedding holding one is refused. */
#define _POSIX_C_SOURCE 200809L /* setenv, mkdtemp */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "dtype.h"
#include "backend.h"
#include "forward.h"
#include "kv_cache.h"
#include "sampler.h"

/* A passage in the shipped model's domain (its training text is Austen's novels). */
static const char *const k_text =
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters. \"My dear Mr. Bennet,\" said his lady to him one day, \"have you heard that "
    "Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But it is,\" returned "
    "she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made no "
    "answer. \"Do you not want to know who has taken it?\" cried his wife impatiently.";

static tl_model *load(const char *dir, tl_kv_type kv_type) {
    tl_load_options o;
    tl_load_options_init(&o);
    o.kv_type = kv_type;
    o.n_threads = 2;
    tl_model *m = NULL;
    /* (a model that does not load fails the test: the callers return without it) */
    CHECK(tl_model_load(dir, &o, &m) == TL_OK, "load %s: %s", dir, tl_last_error());
    return m;
}

/* Teacher-forced logits [n][vocab] of tokens[0..n), in chunks of `chunk` rows (1: as decode
   steps run, through the fused attention path). Returns the cache's K/V bytes. */
static size_t forced_logits(tl_model *m, const int32_t *tokens, int n, int chunk, float *logits) {
    const int vocab = m->cfg.vocab_size, loops = m->cfg.default_loops;
    tl_kv_cache *cache = NULL;
    tl_workspace ws = {0};
    if (tl_kv_cache_new_for(m, n, 0, chunk, &cache) != TL_OK) return 0;
    int32_t pos[256];
    for (int at = 0; at < n; at += chunk) {
        const int rows = n - at < chunk ? n - at : chunk;
        for (int r = 0; r < rows; r++) pos[r] = at + r;
        if (tl_forward_run(m, cache, &ws, tokens + at, pos, rows, NULL, loops, 0, logits + (size_t)at * vocab) != TL_OK)
            CHECK(0, "forward at %d: %s", at, tl_last_error());
    }
    const size_t bytes = tl_kv_cache_bytes(cache);
    tl_workspace_release(&ws);
    tl_kv_cache_free(cache);
    return bytes;
}

/* text: the model's tokenizer encodes it; NULL: random ids up to max_seq_len (the golden
   test models, which have no tokenizer). */
static void close_to_f32(const char *dir, const char *text) {
    tl_model *exact = load(dir, TL_KV_F32), *half = load(dir, TL_KV_F16);
    int32_t *tokens = NULL;
    if (!exact || !half) {
        CHECK(0, "load both");
        goto done;
    }
    CHECK(strcmp(tl_model_info(half)->kv_type, "f16") == 0 && strcmp(tl_model_info(exact)->kv_type, "f32") == 0,
          "info kv_type %s / %s", tl_model_info(half)->kv_type, tl_model_info(exact)->kv_type);
    int n = 0;
    if (text) {
        if (tl_encode(exact, text, strlen(text), &tokens, &n) != TL_OK || n < 100) {
            CHECK(0, "encode: %s (%d tokens)", tl_last_error(), n);
            goto done;
        }
    } else {
        n = exact->cfg.max_seq_len;
        tokens = malloc((size_t)n * sizeof *tokens);
        uint32_t seed = 12345;
        for (int i = 0; i < n; i++) {
            seed = seed * 1664525u + 1013904223u;
            tokens[i] = (int32_t)((seed >> 8) % (uint32_t)exact->cfg.vocab_size);
        }
    }
    if (n > exact->cfg.max_seq_len) n = exact->cfg.max_seq_len;
    const int vocab = exact->cfg.vocab_size;
    float *want = malloc((size_t)n * vocab * sizeof(float)), *got = malloc((size_t)n * vocab * sizeof(float));
    for (int chunk = 1; chunk <= 16; chunk += 15) {
        const size_t exact_bytes = forced_logits(exact, tokens, n, chunk, want);
        const size_t half_bytes = forced_logits(half, tokens, n, chunk, got);
        CHECK(exact_bytes > 0 && half_bytes * 2 == exact_bytes, "chunks of %d: f16 KV %zu bytes, f32 %zu",
              chunk, half_bytes, exact_bytes);
        int agree = 0;
        double err2 = 0.0, ref2 = 0.0, worst = 0.0;
        for (int t = 0; t < n; t++) {
            const float *w = want + (size_t)t * vocab, *g = got + (size_t)t * vocab;
            agree += tl_argmax(w, vocab) == tl_argmax(g, vocab);
            for (int v = 0; v < vocab; v++) {
                const double d = (double)g[v] - (double)w[v];
                err2 += d * d;
                ref2 += (double)w[v] * (double)w[v];
                if (fabs(d) > worst) worst = fabs(d);
            }
        }
        const double rel = sqrt(err2 / ref2);
        printf("%s, chunks of %d rows: %d positions, top-1 agreement %d (%.2f%%), logit RMS error %.2e of RMS, "
               "largest %.3g; KV %zu -> %zu bytes\n",
               dir, chunk, n, agree, 100.0 * agree / n, rel, worst, exact_bytes, half_bytes);
        CHECK(agree >= n - n / 50, "chunks of %d: top-1 agreement %d of %d (want >= 98%%)", chunk, agree, n);
        CHECK(rel < 2e-3, "chunks of %d: logit RMS error %.2e of the logits' RMS (want < 2e-3)", chunk, rel);
        CHECK(memcmp(want, got, (size_t)n * vocab * sizeof(float)) != 0,
              "chunks of %d: f16 KV gave f32's logits bit for bit: the rows were not rounded", chunk);
    }
    free(want);
    free(got);
done:
    if (text) tl_free(tokens);
    else free(tokens);
    tl_model_free(exact);
    tl_model_free(half);
}

/* The backend's kv_write stores what tl_f32_to_f16 gives (overflow to inf included). */
static void rows_round_to_nearest(const char *dir) {
    tl_model *m = load(dir, TL_KV_F16);
    if (!m) return;
    tl_kv_cache *c = NULL;
    if (tl_kv_cache_new_for(m, 4, 0, 1, &c) != TL_OK) { CHECK(0, "cache"); tl_model_free(m); return; }
    CHECK(c->model->kv_type == TL_KV_F16 && c->row_bytes == (size_t)c->kv_dim * 2, "row bytes %zu for kv_dim %d",
          c->row_bytes, c->kv_dim);
    float *k = malloc((size_t)c->kv_dim * sizeof(float)), *v = malloc((size_t)c->kv_dim * sizeof(float));
    for (int i = 0; i < c->kv_dim; i++) {
        k[i] = (float)(i - c->kv_dim / 2) * 0.0123456789f; /* most need rounding */
        v[i] = i % 7 == 0 ? 70000.0f : 1.0f / (float)(i + 3); /* 70000 overflows f16: inf */
    }
    tl_kv_reserve(c, 2, 1);
    m->backend->kv_write(m, c, 0, 2, k, v, 1); /* entry 2 of slot 0 */
    const uint16_t *k_half = tl_kv_k(c, 0, 2), *v_half = tl_kv_v(c, 0, 2);
    int wrong = 0, rounded = 0;
    for (int i = 0; i < c->kv_dim; i++) {
        wrong += k_half[i] != tl_f32_to_f16(k[i]) || v_half[i] != tl_f32_to_f16(v[i]);
        rounded += tl_f16_to_f32(k_half[i]) != k[i];
        if (i % 7 == 0) wrong += !isinf(tl_f16_to_f32(v_half[i]));
    }
    CHECK(wrong == 0 && rounded > c->kv_dim / 2, "stored rows: %d wrong, %d rounded", wrong, rounded);
    free(k);
    free(v);
    tl_kv_cache_free(c);
    tl_model_free(m);
}

static void bad_options(const char *dir) {
    tl_load_options o;
    tl_load_options_init(&o);
    CHECK(o.kv_type == TL_KV_F32, "default kv_type f32");
    o.kv_type = (tl_kv_type)7;
    tl_model *m = NULL;
    CHECK_ERROR(tl_model_load(dir, &o, &m), TL_ERR_INVALID_ARGUMENT, "unknown kv_type 7");
    CHECK(m == NULL, "no model on error");
    o.kv_type = (tl_kv_type)-1;
    CHECK_ERROR(tl_model_load(dir, &o, &m), TL_ERR_INVALID_ARGUMENT, "kv_type");
    /* The environment's default: TINYLOOP_KV_TYPE=f16 (and nothing else) makes f16 the default. */
    setenv("TINYLOOP_KV_TYPE", "f16", 1);
    tl_load_options_init(&o);
    CHECK(o.kv_type == TL_KV_F16, "TINYLOOP_KV_TYPE=f16: default f16");
    setenv("TINYLOOP_KV_TYPE", "f8", 1);
    tl_load_options_init(&o);
    CHECK(o.kv_type == TL_KV_F32, "TINYLOOP_KV_TYPE=f8: default stays f32");
    unsetenv("TINYLOOP_KV_TYPE");
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc(*len + 1);
    if (p && fread(p, 1, *len, f) != *len) { free(p); p = NULL; }
    if (p) p[*len] = '\0'; /* (the header is searched as text) */
    fclose(f);
    return p;
}
static bool write_file(const char *path, const char *data, size_t len) {
    FILE *f = fopen(path, "wb");
    if (!f) return false;
    const bool ok = fwrite(data, 1, len, f) == len;
    return fclose(f) == 0 && ok;
}

/* A copy of the golden checkpoint in golden_dir, in work (a mkdtemp template, filled in), with
   the F32 tensor `tensor`'s values[n] changed by `edit`. False (and checks failed) when not. */
static bool copy_edited(const char *golden_dir, const char *tensor, void (*edit)(float *values, long n), char *work) {
    char path[4200], name[256]; /* (golden_dir: at most 4096) */
    CHECK(mkdtemp(work) != NULL, "mkdtemp");
    size_t len = 0, config_len = 0;
    snprintf(path, sizeof path, "%s/config.json", golden_dir);
    char *config = read_file(path, &config_len);
    snprintf(path, sizeof path, "%s/model.safetensors", golden_dir);
    char *file = read_file(path, &len);
    CHECK(config && file && len > 8, "read %s", golden_dir);
    bool ok = config && file;
    if (ok) {
        uint64_t header_len;
        memcpy(&header_len, file, 8);
        /* the tensor's data offsets, from its header entry (F32: these checkpoints' dtype) */
        snprintf(name, sizeof name, "\"%s\"", tensor);
        const char *entry = strstr(file + 8, name);
        const char *offsets = entry ? strstr(entry, "\"data_offsets\":[") : NULL;
        long begin = 0, end = 0;
        static const char f32[] = "\"dtype\":\"F32\"";
        const char *dtype = entry ? strstr(entry, "\"dtype\":") : NULL;
        ok = dtype && strncmp(dtype, f32, sizeof f32 - 1) == 0 && offsets &&
             sscanf(offsets, "\"data_offsets\":[%ld,%ld]", &begin, &end) == 2 && end > begin;
        CHECK(ok, "%s: an F32 tensor with its offsets (the edit reads floats)", tensor);
        if (ok) {
            const long n = (end - begin) / 4;
            float *values = malloc((size_t)n * sizeof *values);
            memcpy(values, file + 8 + header_len + begin, (size_t)n * sizeof *values);
            edit(values, n);
            memcpy(file + 8 + header_len + begin, values, (size_t)n * sizeof *values);
            free(values);
            snprintf(path, sizeof path, "%s/config.json", work);
            ok = write_file(path, config, config_len);
            snprintf(path, sizeof path, "%s/model.safetensors", work);
            ok = ok && write_file(path, file, len);
            CHECK(ok, "write the edited copy in %s", work);
        }
    }
    free(config);
    free(file);
    return ok;
}
static void remove_dir(const char *work) {
    char command[200];
    snprintf(command, sizeof command, "rm -rf %s", work);
    CHECK(system(command) == 0, "clean up");
}

/* A checkpoint whose V rows overflow f16 (its coda's V weights times 1e6: ~1e5 a value, which
   f32 holds and f16 does not): generation through an f16 cache fails with an error naming the
   cause. (The NaN rows compared with nothing, no token was above -inf, and the step read as a
   grammar's dead end: a cut text with a normal stop.) */
static void times_a_million(float *values, long n) {
    for (long i = 0; i < n; i++) values[i] *= 1e6f;
}
static void overflow_names_its_cause(const char *golden_dir) {
    char work[] = "/tmp/tinyloop-kvf16-XXXXXX";
    if (!copy_edited(golden_dir, "coda.0.attn.v.weight", times_a_million, work)) return;
    const int32_t prompt[] = {2, 3, 4, 5};
    int32_t out[32];
    int n_out = 0;
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 8;
    cfg.ignore_eos = 1;
    tl_model *exact = load(work, TL_KV_F32), *half = load(work, TL_KV_F16);
    CHECK(exact && half, "load the overflowing copy");
    if (exact && half) {
        CHECK(tl_generate(exact, prompt, 4, &cfg, out, 32, &n_out, NULL) == TL_OK, "f32 KV holds it: %s",
              tl_last_error());
        CHECK_ERROR(tl_generate(half, prompt, 4, &cfg, out, 32, &n_out, NULL), TL_ERR_FORMAT,
                    "non-finite logits (NaN) at token 1: its activations overflow (an f16 KV cache holds at most 65504");
        cfg.beam_size = 2; /* (a beam search dropped every NaN hypothesis: a dead end, a cut text) */
        CHECK_ERROR(tl_generate(half, prompt, 4, &cfg, out, 32, &n_out, NULL), TL_ERR_FORMAT,
                    "non-finite logits (NaN) at token 1: its activations overflow");
    }
    tl_model_free(exact);
    tl_model_free(half);
    remove_dir(work);
}

/* Token 0's head row made of +-3e38 in turn: its logit is inf - inf somewhere, a NaN in a row
   of finite ones. Every decoder fails there, as on a wholly NaN row: greedy passed over the
   NaN (a NaN never compares) and went on with the other tokens, a log-probability read it as
   banned (-inf, null in the server's JSON). */
static void row_zero_huge(float *values, long n) {
    (void)n;
    for (int j = 0; j < 32; j++) values[j] = j % 2 ? -3e38f : 3e38f; /* (d_model 32) */
}
static void partly_nan_row_fails(const char *golden_dir) {
    char work[] = "/tmp/tinyloop-nanrow-XXXXXX";
    if (!copy_edited(golden_dir, "lm_head.weight", row_zero_huge, work)) return;
    tl_model *m = load(work, TL_KV_F32);
    CHECK(m != NULL, "load the edited copy");
    if (m) {
        /* the first position whose row is not finite at token 0 (a NaN, or an infinity where
           the products had one sign), with finite logits elsewhere */
        enum { N = 12, V = 64 };
        const int32_t ids[N] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
        static float logits[N * V];
        CHECK(tl_score(m, ids, N, 8, logits) == TL_OK, "score: %s", tl_last_error());
        int at = -1, nan_at = -1;
        for (int i = 0; i < N && nan_at < 0; i++) {
            bool others_finite = true;
            for (int t = 1; t < V; t++) others_finite = others_finite && isfinite(logits[i * V + t]);
            if (!isfinite(logits[i * V]) && others_finite && at < 0) at = i;
            if (isnan(logits[i * V]) && others_finite) nan_at = i;
        }
        CHECK(nan_at >= 0, "some row has a NaN logit at token 0 and finite ones elsewhere");
        if (nan_at >= 0) { /* (at <= nan_at: the first non-finite row scoring meets) */
            char want[128];
            snprintf(want, sizeof want, "non-finite logits (%s) at position %d: its activations overflow",
                     isnan(logits[at * V]) ? "NaN" : logits[at * V] > 0 ? "inf" : "-inf", at);
            float logprobs[N];
            CHECK_ERROR(tl_score_logprobs(m, ids, N, 8, 0, logprobs, NULL, NULL), TL_ERR_FORMAT, want);
            tl_generate_config cfg;
            tl_generate_config_init(&cfg);
            cfg.max_tokens = 4;
            cfg.ignore_eos = 1;
            int32_t out[64];
            int n_out = 0;
            const char *want_step = "non-finite logits (NaN) at token 1: its activations overflow";
            CHECK_ERROR(tl_generate(m, ids, nan_at + 1, &cfg, out, 64, &n_out, NULL), TL_ERR_FORMAT, want_step);
            cfg.temperature = 0.8f;
            cfg.sample_seed = 3;
            CHECK_ERROR(tl_generate(m, ids, nan_at + 1, &cfg, out, 64, &n_out, NULL), TL_ERR_FORMAT, want_step);
            cfg.temperature = 0.0f;
            cfg.beam_size = 2;
            CHECK_ERROR(tl_generate(m, ids, nan_at + 1, &cfg, out, 64, &n_out, NULL), TL_ERR_FORMAT, want_step);
            cfg.beam_size = 0;
            cfg.speculative = TL_SPECULATIVE_CHAIN;
            cfg.draft_loops = 1;
            CHECK_ERROR(tl_generate(m, ids, nan_at + 1, &cfg, out, 64, &n_out, NULL), TL_ERR_FORMAT, want_step);
            cfg.speculative = TL_SPECULATIVE_OFF;
            /* batched: the prompt's own status says it */
            const tl_token_seq prompts[2] = {{ids, nan_at + 1}, {ids, nan_at + 1}};
            int lens[2];
            CHECK(tl_generate_batch(m, prompts, 2, &cfg, out, 64, lens, &n_out, NULL) == TL_ERR_FORMAT &&
                      strstr(tl_last_error(), "non-finite logits (NaN)"),
                  "batch: %s", tl_last_error());
        }
    }
    tl_model_free(m);
    remove_dir(work);
}

/* The coda's MLP weights, up and down, times 1e30: its sums overflow to inf (and NaN), and
   the embedding is refused, in tl_embed and per input in tl_embed_batch (it was returned as a
   vector of NaN: JSON has none). */
static void times_1e30(float *values, long n) {
    for (long i = 0; i < n; i++) values[i] *= 1e30f;
}
static void embedding_overflow_fails(const char *golden_dir) {
    char half_done[] = "/tmp/tinyloop-nanembed-XXXXXX", work[] = "/tmp/tinyloop-nanembed-XXXXXX";
    const bool edited = copy_edited(golden_dir, "coda.0.mlp.up.weight", times_1e30, half_done) &&
                        copy_edited(half_done, "coda.0.mlp.down.weight", times_1e30, work);
    remove_dir(half_done);
    if (!edited) return;
    tl_model *m = load(work, TL_KV_F32);
    CHECK(m != NULL, "load the edited copy");
    if (m) {
        const int32_t ids[3] = {5, 6, 7};
        float out[3 * 32]; /* (d_model 32) */
        tl_embed_options o;
        tl_embed_options_init(&o);
        CHECK_ERROR(tl_embed(m, ids, 3, &o, out), TL_ERR_FORMAT,
                    "tl_embed: the embedding holds non-finite values (NaN or inf): the model's activations overflow");
        o.pooling = TL_POOLING_NONE;
        o.normalize = 0;
        CHECK_ERROR(tl_embed(m, ids, 3, &o, out), TL_ERR_FORMAT, "non-finite values (NaN or inf)");
        o.pooling = TL_POOLING_LAST;
        const tl_token_seq inputs[2] = {{ids, 2}, {ids, 3}};
        CHECK_ERROR(tl_embed_batch(m, inputs, 2, &o, out), TL_ERR_FORMAT,
                    "tl_embed_batch: the embedding of input 0 holds non-finite values (NaN or inf)");
    }
    tl_model_free(m);
    remove_dir(work);
}

/* Logits that overflow to an infinity (not a NaN): token 0's head row is 1e38 times the sign
   of each value of the row the head reads after the prompt, token 1's its negation, so that
   every product has one sign and their sum passes 3.4e38. The steps went on: greedy and a
   beam search chose token 0 every time (log-probability 0), as did a scoring of the others
   (-inf, the server's null). */
static float head_row_signs[64];
static int head_row_width;
static void rows_overflow_to_inf(float *values, long n) {
    (void)n;
    for (int j = 0; j < head_row_width; j++) {
        values[j] = copysignf(1e38f, head_row_signs[j]);
        values[head_row_width + j] = -values[j];
    }
}
static void infinite_row_fails(const char *golden_dir) {
    const int32_t prompt[4] = {5, 6, 7, 8};
    tl_model *original = load(golden_dir, TL_KV_F32);
    CHECK(original != NULL, "load %s", golden_dir);
    if (!original) return;
    head_row_width = tl_model_info(original)->d_model;
    CHECK(head_row_width <= 64, "d_model %d fits", head_row_width);
    static float rows[4 * 64];
    tl_embed_options opts;
    tl_embed_options_init(&opts);
    opts.pooling = TL_POOLING_NONE;
    opts.normalize = 0;
    CHECK(tl_embed(original, prompt, 4, &opts, rows) == TL_OK, "embed: %s", tl_last_error());
    memcpy(head_row_signs, rows + 3 * head_row_width, (size_t)head_row_width * sizeof(float));
    tl_model_free(original);
    char work[] = "/tmp/tinyloop-infrow-XXXXXX";
    if (!copy_edited(golden_dir, "lm_head.weight", rows_overflow_to_inf, work)) return;
    tl_model *m = load(work, TL_KV_F32);
    CHECK(m != NULL, "load the edited copy");
    if (m) {
        const int vocab = tl_model_info(m)->vocab_size;
        float *logits = malloc((size_t)4 * (size_t)vocab * sizeof(float));
        const int loops = tl_model_info(m)->default_loops;
        CHECK(logits && tl_score(m, prompt, 4, loops, logits) == TL_OK, "score: %s", tl_last_error());
        if (logits) CHECK(logits[3 * vocab] == INFINITY && logits[3 * vocab + 1] == -INFINITY,
                          "the last row's logits of tokens 0 and 1: %g %g", logits[3 * vocab], logits[3 * vocab + 1]);
        free(logits);
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 4;
        cfg.ignore_eos = 1;
        int32_t out[16];
        int n_out = 0;
        const char *want_step = "non-finite logits (inf) at token 1: its activations overflow";
        CHECK_ERROR(tl_generate(m, prompt, 4, &cfg, out, 16, &n_out, NULL), TL_ERR_FORMAT, want_step);
        cfg.temperature = 0.8f;
        cfg.sample_seed = 3;
        CHECK_ERROR(tl_generate(m, prompt, 4, &cfg, out, 16, &n_out, NULL), TL_ERR_FORMAT, want_step);
        cfg.temperature = 0.0f;
        cfg.beam_size = 2;
        CHECK_ERROR(tl_generate(m, prompt, 4, &cfg, out, 16, &n_out, NULL), TL_ERR_FORMAT, want_step);
        cfg.beam_size = 0;
        cfg.speculative = TL_SPECULATIVE_CHAIN;
        cfg.draft_loops = 1;
        CHECK_ERROR(tl_generate(m, prompt, 4, &cfg, out, 16, &n_out, NULL), TL_ERR_FORMAT, want_step);
        const int32_t scored[5] = {5, 6, 7, 8, 9};
        float logprobs[4];
        /* (the earlier rows' values have the last one's signs mostly: they overflow too) */
        CHECK_ERROR(tl_score_logprobs(m, scored, 5, loops, 0, logprobs, NULL, NULL), TL_ERR_FORMAT,
                    "non-finite logits (inf) at position ");
    }
    tl_model_free(m);
    remove_dir(work);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        printf("usage: test_kv_f16 SHIPPED_MODEL_DIR GOLDEN_DIR\n");
        return 2;
    }
    unsetenv("TINYLOOP_KV_TYPE"); /* this test chooses per model */
    bad_options(argv[1]);
    rows_round_to_nearest(argv[1]);
    close_to_f32(argv[1], k_text);
    /* Grouped-query attention (2 KV heads for 4), RoPE, biases: random weights, random ids. */
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/add_residual_statenorm_rms_gqa2", argv[2]);
    close_to_f32(dir, NULL);
    snprintf(dir, sizeof dir, "%s/deep_residual", argv[2]);
    overflow_names_its_cause(dir);
    partly_nan_row_fails(dir);
    infinite_row_fails(dir);
    embedding_overflow_fails(dir);
    return check_summary();
}

/* test_embed.c: tl_embed, a sequence's embedding.
 *
 * - Each row (TL_POOLING_NONE, not normalised) is what the head reads: lm_head times the row,
 *   summed here in double from the matrix's own rows (tl_matrix_row_f32), gives tl_score's
 *   logits for that position (within float rounding) on models with and without the head's
 *   final norm (Ouro applies its norm per pass), tied and untied heads, f16/bf16 weights.
 * - Rows are causal and batch-invariant: the rows of a prefix are the first rows of the
 *   whole (memcmp), also across the forward's chunk size: the text model's context (128)
 *   holds a sequence of 100 tokens, two chunks of TL_FORWARD_CHUNK (64), whose prefix of 70
 *   ends in the second; pooling sums over both chunks, last takes the second's last row.
 * - Mean pooling is the mean of the rows, summed in double in token order (memcmp); last
 *   pooling is the last row (memcmp); normalize scales each vector to unit length, in the
 *   same direction; loops 0 is the model's default depth (memcmp), and another depth gives
 *   other rows (where the model has a block to loop).
 * - tl_embed_batch: every input's result is tl_embed's for it alone (memcmp), for each
 *   pooling, normalised or not, at another depth: inputs of 1 token to the whole context,
 *   enough of them to fill several shared forwards, and on the shipped model (context 256)
 *   inputs longer than a shared forward holds, which go alone, chunk by chunk, between
 *   short ones.
 * - Refusals: NULL arguments, n out of range, token ids out of range, loops, pooling and
 *   normalize out of range; tl_embed_batch's naming the input at fault, count 0 a no-op. */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

#include "check.h"
#include "forward.h"
#include "cpu/kernels.h"
#include "tinyloop.h"

#define LONG_N 100 /* over TL_FORWARD_CHUNK (64): two chunks */

static tl_model *load(const char *root, const char *name) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%.4000s/%s", root, name);
    tl_load_options o;
    tl_load_options_init(&o);
    tl_model *m = NULL;
    if (tl_model_load(dir, &o, &m) != TL_OK) CHECK(0, "load %s: %s", dir, tl_last_error());
    return m;
}

static tl_embed_options options(int loops, tl_pooling pooling, int normalize) {
    tl_embed_options o;
    tl_embed_options_init(&o);
    o.loops = loops;
    o.pooling = pooling;
    o.normalize = normalize;
    return o;
}

static void fill_tokens(int32_t *tokens, int n, int vocab, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        tokens[i] = (int32_t)((seed >> 8) % (uint32_t)vocab);
    }
}

/* The head over the rows: lm_head . row, in double, against tl_score's logits. */
static void check_head_parity(const char *name, const tl_model *m, const int32_t *tokens, int n, const float *rows) {
    const tl_config *c = &m->cfg;
    const int d = c->d_model, vocab = c->vocab_size;
    float *logits = malloc((size_t)n * (size_t)vocab * sizeof *logits), *w = malloc((size_t)d * sizeof *w);
    if (!logits || !w) {
        CHECK(0, "%s: out of memory", name);
        free(logits);
        free(w);
        return;
    }
    CHECK(tl_score(m, tokens, n, c->default_loops, logits) == TL_OK, "%s: score: %s", name, tl_last_error());
    /* The head's weights as the host reads them: another backend's (TINYLOOP_BACKEND=cuda)
       are device memory, so a CPU load of the same checkpoint lends its own. */
    tl_model *host = NULL;
    if (strcmp(m->backend->name, "cpu") != 0) {
        tl_load_options o;
        tl_load_options_init(&o);
        o.backend = TL_BACKEND_CPU;
        if (tl_model_load(m->dir, &o, &host) != TL_OK) {
            CHECK(0, "%s: a CPU load for the head's weights: %s", name, tl_last_error());
            free(logits);
            free(w);
            return;
        }
    }
    const tl_matrix *lm_head = host ? &host->w.lm_head : &m->w.lm_head;
    double worst = 0.0;
    for (int o = 0; o < vocab; o++) {
        tl_matrix_row_f32(lm_head, o, w);
        for (int t = 0; t < n; t++) {
            double dot = 0.0, scale = 0.0;
            for (int j = 0; j < d; j++) {
                dot += (double)rows[(size_t)t * (size_t)d + (size_t)j] * (double)w[j];
                scale += fabs((double)rows[(size_t)t * (size_t)d + (size_t)j] * (double)w[j]);
            }
            const double err = fabs(dot - (double)logits[(size_t)t * (size_t)vocab + (size_t)o]) / (scale + 1e-6);
            if (err > worst) worst = err;
        }
    }
    CHECK(worst < 1e-5, "%s: head(row) against tl_score's logits: worst relative error %g", name, worst);
    tl_model_free(host);
    free(logits);
    free(w);
}

static void check_model(const char *root, const char *name) {
    tl_model *m = load(root, name);
    if (!m) return;
    const tl_config *c = &m->cfg;
    const int d = c->d_model;
    const int n = LONG_N < c->max_seq_len ? LONG_N : c->max_seq_len;
    const int short_n = n > TL_FORWARD_CHUNK ? TL_FORWARD_CHUNK + 6 : 7; /* (past the first chunk where n is) */
    int32_t *tokens = malloc((size_t)n * sizeof *tokens);
    float *rows = malloc((size_t)n * (size_t)d * sizeof *rows), *prefix = malloc((size_t)short_n * (size_t)d * sizeof *prefix);
    float *vec = malloc((size_t)d * sizeof *vec), *again = malloc((size_t)d * sizeof *again);
    if (!tokens || !rows || !prefix || !vec || !again) {
        CHECK(0, "%s: out of memory", name);
        goto done;
    }
    fill_tokens(tokens, n, c->vocab_size, 7u);
    if (strcmp(name, "textmodel") == 0) CHECK(n > TL_FORWARD_CHUNK, "%s: %d tokens is one chunk", name, n);

    tl_embed_options o = options(0, TL_POOLING_NONE, 0);
    CHECK(tl_embed(m, tokens, n, &o, rows) == TL_OK, "%s: rows: %s", name, tl_last_error());
    check_head_parity(name, m, tokens, n, rows);

    /* causal and batch-invariant: a prefix's rows are the first rows of the whole */
    CHECK(tl_embed(m, tokens, short_n, &o, prefix) == TL_OK, "%s: prefix rows: %s", name, tl_last_error());
    CHECK(memcmp(prefix, rows, (size_t)short_n * (size_t)d * sizeof *rows) == 0, "%s: prefix rows differ", name);

    /* mean: the rows' mean in double, in token order */
    o = options(0, TL_POOLING_MEAN, 0);
    CHECK(tl_embed(m, tokens, n, &o, vec) == TL_OK, "%s: mean: %s", name, tl_last_error());
    bool same = true;
    for (int j = 0; j < d; j++) {
        double sum = 0.0;
        for (int t = 0; t < n; t++) sum += rows[(size_t)t * (size_t)d + (size_t)j];
        const float mean = (float)(sum / (double)n);
        same = same && memcmp(&mean, &vec[j], sizeof mean) == 0;
    }
    CHECK(same, "%s: mean pooling is not the rows' mean", name);
    /* defaults (opts NULL) = mean, normalised, default depth */
    CHECK(tl_embed(m, tokens, n, NULL, again) == TL_OK, "%s: defaults: %s", name, tl_last_error());
    double length = 0.0, cosine = 0.0, vec_length = 0.0;
    for (int j = 0; j < d; j++) {
        length += (double)again[j] * again[j];
        vec_length += (double)vec[j] * vec[j];
        cosine += (double)again[j] * vec[j];
    }
    CHECK(fabs(sqrt(length) - 1.0) < 1e-6, "%s: normalised length %.9f", name, sqrt(length));
    CHECK(vec_length > 0 && fabs(cosine / sqrt(vec_length) - 1.0) < 1e-6, "%s: normalised vector turned (cosine %.9f)", name,
          cosine / sqrt(vec_length));

    /* last: the last row */
    o = options(0, TL_POOLING_LAST, 0);
    CHECK(tl_embed(m, tokens, n, &o, vec) == TL_OK, "%s: last: %s", name, tl_last_error());
    CHECK(memcmp(vec, rows + (size_t)(n - 1) * (size_t)d, (size_t)d * sizeof *vec) == 0, "%s: last pooling is not the last row",
          name);

    /* every row normalised */
    o = options(0, TL_POOLING_NONE, 1);
    CHECK(tl_embed(m, tokens, short_n, &o, prefix) == TL_OK, "%s: normalised rows: %s", name, tl_last_error());
    bool unit = true;
    for (int t = 0; t < short_n; t++) {
        double squares = 0.0;
        for (int j = 0; j < d; j++) squares += (double)prefix[(size_t)t * (size_t)d + (size_t)j] * prefix[(size_t)t * (size_t)d + (size_t)j];
        unit = unit && fabs(sqrt(squares) - 1.0) < 1e-6;
    }
    CHECK(unit, "%s: a normalised row is not of unit length", name);

    /* depth: 0 is default_loops; another depth, other rows */
    o = options(c->default_loops, TL_POOLING_LAST, 0);
    CHECK(tl_embed(m, tokens, n, &o, again) == TL_OK, "%s: explicit depth: %s", name, tl_last_error());
    CHECK(memcmp(vec, again, (size_t)d * sizeof *vec) == 0, "%s: loops 0 is not default_loops", name);
    o = options(c->default_loops == 1 ? 2 : 1, TL_POOLING_LAST, 0);
    if (o.loops <= c->max_loops && c->n_block > 0) { /* (no block: no depth) */
        CHECK(tl_embed(m, tokens, n, &o, again) == TL_OK, "%s: other depth: %s", name, tl_last_error());
        CHECK(memcmp(vec, again, (size_t)d * sizeof *vec) != 0, "%s: depth %d gives the default depth's row", name, o.loops);
    }
done:
    free(tokens);
    free(rows);
    free(prefix);
    free(vec);
    free(again);
    tl_model_free(m);
}


/* tl_embed_batch against tl_embed input by input, bit for bit. */
#define BATCH_INPUTS 14
static void check_batch(const char *root, const char *name) {
    tl_model *m = load(root, name);
    if (!m) return;
    const tl_config *c = &m->cfg;
    const int d = c->d_model, ctx = c->max_seq_len;
    /* short and long inputs mixed; several shared forwards' worth of rows; where the
       context allows, inputs over a shared forward (more than 128 rows) between them */
    const int wanted[BATCH_INPUTS] = {3, 1, ctx, 7, ctx / 2, 200, 2, ctx - 1, 17, 1, 250, ctx, 5, 9};
    int lengths[BATCH_INPUTS], total = 0;
    int32_t *inputs[BATCH_INPUTS] = {0};
    bool ok = true;
    for (int i = 0; i < BATCH_INPUTS; i++) {
        lengths[i] = wanted[i] < ctx ? wanted[i] : ctx;
        total += lengths[i];
        inputs[i] = malloc((size_t)lengths[i] * sizeof *inputs[i]);
        ok = ok && inputs[i];
        if (inputs[i]) fill_tokens(inputs[i], lengths[i], c->vocab_size, 100u + (uint32_t)i);
    }
    float *batch = malloc((size_t)total * (size_t)d * sizeof *batch), *alone = malloc((size_t)ctx * (size_t)d * sizeof *alone);
    if (!ok || !batch || !alone) {
        CHECK(0, "%s: out of memory", name);
        goto done;
    }
    const tl_pooling poolings[] = {TL_POOLING_MEAN, TL_POOLING_LAST, TL_POOLING_NONE};
    for (int v = 0; v < 3 * 2 + 1; v++) {
        /* each pooling, normalised and not; then mean at another depth where there is one */
        int loops = 0;
        if (v == 6) {
            if (c->n_block == 0 || c->max_loops < 2) continue;
            loops = c->default_loops == 1 ? 2 : 1;
        }
        const tl_embed_options o = options(loops, poolings[v < 6 ? v / 2 : 0], v < 6 ? v % 2 : 0);
        for (size_t f = 0; f < (size_t)total * (size_t)d; f++) batch[f] = NAN; /* (a place left unwritten fails) */
        tl_token_seq seqs[BATCH_INPUTS];
        for (int i = 0; i < BATCH_INPUTS; i++) seqs[i] = (tl_token_seq){inputs[i], lengths[i]};
        CHECK(tl_embed_batch(m, seqs, BATCH_INPUTS, &o, batch) == TL_OK && tl_last_error()[0] == '\0',
              "%s: batch (pooling %d, normalize %d, loops %d): %s", name, (int)o.pooling, o.normalize, o.loops, tl_last_error());
        size_t at = 0;
        for (int i = 0; i < BATCH_INPUTS; i++) {
            const size_t floats = (size_t)(o.pooling == TL_POOLING_NONE ? lengths[i] : 1) * (size_t)d;
            CHECK(tl_embed(m, inputs[i], lengths[i], &o, alone) == TL_OK, "%s: alone: %s", name, tl_last_error());
            CHECK(memcmp(batch + at, alone, floats * sizeof *alone) == 0,
                  "%s: input %d (%d tokens; pooling %d, normalize %d, loops %d) differs from tl_embed's", name, i, lengths[i],
                  (int)o.pooling, o.normalize, o.loops);
            at += floats;
        }
    }
done:
    for (int i = 0; i < BATCH_INPUTS; i++) free(inputs[i]);
    free(batch);
    free(alone);
    tl_model_free(m);
}

static void check_refusals(const char *root) {
    tl_model *m = load(root, "llama_like");
    if (!m) return;
    const tl_config *c = &m->cfg;
    int32_t tokens[4] = {1, 2, 3, 4};
    float *out = malloc((size_t)c->max_seq_len * (size_t)c->d_model * sizeof *out);
    int32_t *many = calloc((size_t)c->max_seq_len + 1, sizeof *many);
    if (!out || !many) {
        CHECK(0, "out of memory");
    } else {
        tl_embed_options o;
        tl_embed_options_init(&o);
        CHECK_ERROR(tl_embed(NULL, tokens, 4, &o, out), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
        CHECK_ERROR(tl_embed(m, NULL, 4, &o, out), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
        CHECK_ERROR(tl_embed(m, tokens, 4, &o, NULL), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
        CHECK_ERROR(tl_embed(m, tokens, 0, &o, out), TL_ERR_INVALID_ARGUMENT, "n = 0 is out of range");
        CHECK_ERROR(tl_embed(m, many, c->max_seq_len + 1, &o, out), TL_ERR_INVALID_ARGUMENT, "is out of range");
        tokens[2] = c->vocab_size;
        CHECK_ERROR(tl_embed(m, tokens, 4, &o, out), TL_ERR_INVALID_ARGUMENT, "token id");
        tokens[2] = -1;
        CHECK_ERROR(tl_embed(m, tokens, 4, &o, out), TL_ERR_INVALID_ARGUMENT, "token id");
        tokens[2] = 3;
        o.loops = -1;
        CHECK_ERROR(tl_embed(m, tokens, 4, &o, out), TL_ERR_INVALID_ARGUMENT, "loops = -1");
        o.loops = c->max_loops + 1;
        CHECK_ERROR(tl_embed(m, tokens, 4, &o, out), TL_ERR_INVALID_ARGUMENT, "loops");
        tl_embed_options_init(&o);
        o.pooling = (tl_pooling)7;
        CHECK_ERROR(tl_embed(m, tokens, 4, &o, out), TL_ERR_INVALID_ARGUMENT, "pooling = 7");
        tl_embed_options_init(&o);
        o.normalize = 2;
        CHECK_ERROR(tl_embed(m, tokens, 4, &o, out), TL_ERR_INVALID_ARGUMENT, "normalize = 2");
        tl_embed_options_init(&o);
        CHECK(tl_embed(m, tokens, 4, &o, out) == TL_OK && tl_last_error()[0] == '\0', "a good call after refusals: %s",
              tl_last_error());

        /* tl_embed_batch: the input at fault is named, nothing is computed */
        tl_token_seq inputs[3] = {{tokens, 4}, {tokens, 2}, {tokens, 3}};
        CHECK_ERROR(tl_embed_batch(NULL, inputs, 3, &o, out), TL_ERR_INVALID_ARGUMENT, "model must not be NULL");
        CHECK_ERROR(tl_embed_batch(m, inputs, -1, &o, out), TL_ERR_INVALID_ARGUMENT, "n_inputs = -1");
        CHECK(tl_embed_batch(m, NULL, 0, &o, NULL) == TL_OK, "n_inputs 0 is a no-op: %s", tl_last_error());
        CHECK_ERROR(tl_embed_batch(m, NULL, 3, &o, out), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
        CHECK_ERROR(tl_embed_batch(m, inputs, 3, &o, NULL), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
        inputs[1].tokens = NULL;
        CHECK_ERROR(tl_embed_batch(m, inputs, 3, &o, out), TL_ERR_INVALID_ARGUMENT, "input 1's tokens are NULL");
        inputs[1].tokens = tokens;
        inputs[2].n = 0;
        CHECK_ERROR(tl_embed_batch(m, inputs, 3, &o, out), TL_ERR_INVALID_ARGUMENT, "input 2 has 0 tokens");
        inputs[2] = (tl_token_seq){many, c->max_seq_len + 1};
        CHECK_ERROR(tl_embed_batch(m, inputs, 3, &o, out), TL_ERR_INVALID_ARGUMENT, "input 2 has");
        inputs[2].n = 3;
        many[1] = c->vocab_size;
        CHECK_ERROR(tl_embed_batch(m, inputs, 3, &o, out), TL_ERR_INVALID_ARGUMENT, "input 2: token id");
        many[1] = 0;
        o.loops = c->max_loops + 1;
        CHECK_ERROR(tl_embed_batch(m, inputs, 3, &o, out), TL_ERR_INVALID_ARGUMENT, "loops");
        tl_embed_options_init(&o);
        o.pooling = (tl_pooling)7;
        CHECK_ERROR(tl_embed_batch(m, inputs, 3, &o, out), TL_ERR_INVALID_ARGUMENT, "tl_embed_batch: pooling = 7");
        tl_embed_options_init(&o);
        o.normalize = -1;
        CHECK_ERROR(tl_embed_batch(m, inputs, 3, &o, out), TL_ERR_INVALID_ARGUMENT, "normalize = -1");
        tl_embed_options_init(&o);
        CHECK(tl_embed_batch(m, inputs, 3, &o, out) == TL_OK && tl_last_error()[0] == '\0',
              "a good batch after refusals: %s", tl_last_error());
    }
    free(out);
    free(many);
    tl_model_free(m);
}

int main(int argc, char **argv) {
    const char *root = argc > 1 ? argv[1] : "tests/data/golden";
    const char *configs[] = {"gpt2_like", "llama_like", "f16_concat_residual_gqa", "bf16_tied_rope_residual", "nblock0_none"};
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) check_model(root, configs[i]);
    char data[4200];
    snprintf(data, sizeof data, "%.4000s/..", root);
    check_model(data, "textmodel"); /* context 128: two chunks */
    char hf[4200];
    snprintf(hf, sizeof hf, "%.4000s/../hf", root);
    check_model(hf, "huginn_f32");
    check_model(hf, "ouro_bf16_tied");
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) check_batch(root, configs[i]);
    check_batch(data, "textmodel");
    check_batch(hf, "huginn_f32");
    check_batch(hf, "ouro_bf16_tied");
    if (argc > 2) { /* the shipped model: context 256, inputs longer than a shared forward */
        char shipped[4200];
        snprintf(shipped, sizeof shipped, "%.4000s", argv[2]);
        char *slash = strrchr(shipped, '/');
        if (slash) {
            *slash = '\0';
            check_batch(shipped, slash + 1);
        }
    }
    check_refusals(root);
    printf("%d passed, %d failed\n", checks_passed, checks_failed);
    return checks_failed;
}

/* score.c: reading a whole sequence without generating: tl_score, logits for every position
 * of a sequence (SPEC §6), tl_score_logprobs, their log-probabilities chunk by chunk, and
 * tl_embed, the rows the head reads, pooled into an embedding. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "forward.h"
#include "sampler.h"

/* Where a scored chunk's logits (or hidden rows) go: each chunk's rows in turn (tl_score:
   into the caller's array; tl_score_logprobs: one chunk's buffer, reduced after each;
   tl_embed: the head's input rows instead, into the caller's array or one chunk's buffer). */
typedef struct chunk_sink {
    float *logits;      /* [n][vocab], or one chunk's [TL_FORWARD_CHUNK][vocab] */
    float *hidden;      /* instead of logits: [n][d], or one chunk's [TL_FORWARD_CHUNK][d] */
    bool reuse;         /* every chunk into the array's start */
    tl_status (*done)(void *ctx, int start, int len);
    void *ctx;
} chunk_sink;

static tl_status score_chunks(const char *what, const tl_model *model, const int32_t *tokens, int n, int loops,
                              const chunk_sink *sink) {
    const tl_config *c = &model->cfg;
    if (n < 1 || n > c->max_seq_len)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: n = %d is out of range [1, max_seq_len = %d]", what, n, c->max_seq_len);
    if (loops < 1 || loops > c->max_loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: loops = %d is out of range [1, max_loops = %d]", what, loops,
                       c->max_loops);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: token id %d at index %d is out of range [0, %d)", what,
                           tokens[i], i, c->vocab_size);

    tl_kv_cache *cache = NULL;
    tl_workspace ws = {0};
    int32_t *positions = malloc((size_t)n * sizeof *positions);
    tl_status st = positions ? tl_kv_cache_new_for(model, n, 0, TL_FORWARD_CHUNK, &cache)
                             : tl_fail(TL_ERR_NO_MEMORY, "%s: out of memory", what);
    if (st == TL_OK) cache->reserve_loops = loops; /* pages only for the depth scored */
    for (int i = 0; positions && i < n; i++) positions[i] = i;
    for (int start = 0; st == TL_OK && start < n; start += TL_FORWARD_CHUNK) {
        int len = n - start < TL_FORWARD_CHUNK ? n - start : TL_FORWARD_CHUNK;
        if (sink->hidden)
            st = tl_forward_run_hidden(model, cache, &ws, tokens + start, positions + start, len, loops,
                                       sink->hidden + (sink->reuse ? 0 : (size_t)start * (size_t)c->d_model));
        else
            st = tl_forward_run(model, cache, &ws, tokens + start, positions + start, len, NULL, loops, 0,
                                sink->logits + (sink->reuse ? 0 : (size_t)start * (size_t)c->vocab_size));
        if (st == TL_OK && sink->done) st = sink->done(sink->ctx, start, len);
    }
    tl_workspace_release(&ws);
    tl_kv_cache_free(cache);
    free(positions);
    if (st == TL_OK) tl_clear_error();
    return st;
}

tl_status tl_score(const tl_model *model, const int32_t *tokens, int n, int loops, float *logits) {
    tl_clear_error();
    if (!model) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_score: model must not be NULL");
    if (!tokens || !logits) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_score: tokens and logits must not be NULL");
    const chunk_sink sink = {.logits = logits};
    return score_chunks("tl_score", model, tokens, n, loops, &sink);
}

/* ---------------------------------------------------------------- log-probabilities */

typedef struct logprob_reduce {
    const int32_t *tokens;
    int n, vocab, top;
    bool f16_kv;
    const float *chunk;     /* the chunk's logits */
    double *scratch;        /* [vocab] */
    float *logprobs;
    int32_t *top_ids;
    float *top_logprobs;
} logprob_reduce;

/* Row i (position start + i) predicts token start + i + 1; the last row of the sequence
   predicts nothing and is skipped. */
static tl_status reduce_chunk(void *ctx, int start, int len) {
    logprob_reduce *r = ctx;
    for (int i = 0; i < len && start + i + 1 < r->n; i++) {
        const size_t at = (size_t)(start + i);
        const float *row = r->chunk + (size_t)i * (size_t)r->vocab;
        const tl_status st = tl_check_logits_finite(row, r->vocab, r->f16_kv, "position", start + i);
        if (st != TL_OK) return st;
        tl_row_logprobs(row, r->vocab, r->tokens[start + i + 1], r->top, r->scratch,
                        &r->logprobs[at], r->top ? r->top_ids + at * (size_t)r->top : NULL,
                        r->top ? r->top_logprobs + at * (size_t)r->top : NULL); /* (top 0: they may be NULL) */
    }
    return TL_OK;
}

tl_status tl_score_logprobs(const tl_model *model, const int32_t *tokens, int n, int loops, int top, float *logprobs,
                            int32_t *top_ids, float *top_logprobs) {
    tl_clear_error();
    if (!model || !tokens || !logprobs)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_score_logprobs: model, tokens and logprobs must not be NULL");
    tl_status st = tl_check_top_logprobs("tl_score_logprobs", top, top_ids, top_logprobs);
    if (st != TL_OK) return st;
    const int vocab = model->cfg.vocab_size;
    float *chunk = malloc((size_t)TL_FORWARD_CHUNK * (size_t)vocab * sizeof *chunk);
    double *scratch = malloc((size_t)vocab * sizeof *scratch);
    if (!chunk || !scratch) {
        st = tl_fail(TL_ERR_NO_MEMORY, "tl_score_logprobs: out of memory");
    } else {
        logprob_reduce r = {tokens, n, vocab, top, model->kv_type == TL_KV_F16, chunk, scratch, logprobs, top_ids,
                            top_logprobs};
        const chunk_sink sink = {.logits = chunk, .reuse = true, .done = reduce_chunk, .ctx = &r};
        st = score_chunks("tl_score_logprobs", model, tokens, n, loops, &sink);
    }
    free(chunk);
    free(scratch);
    return st;
}

/* ---------------------------------------------------------------- embeddings */

void tl_embed_options_init(tl_embed_options *opts) {
    if (!opts) return;
    opts->loops = 0;
    opts->pooling = TL_POOLING_MEAN;
    opts->normalize = 1;
}

typedef struct pool_rows {
    const float *chunk; /* the chunk's hidden rows [len][d] */
    int n, d;
    tl_pooling pooling;
    double *sum;        /* [d]: mean pooling's running sum, in token order */
    float *out;         /* [d]: the last row (TL_POOLING_LAST) */
} pool_rows;

static tl_status pool_chunk(void *ctx, int start, int len) {
    pool_rows *p = ctx;
    if (p->pooling == TL_POOLING_LAST) {
        if (start + len == p->n) memcpy(p->out, p->chunk + (size_t)(len - 1) * (size_t)p->d, (size_t)p->d * sizeof *p->out);
        return TL_OK;
    }
    for (int t = 0; t < len; t++)
        for (int j = 0; j < p->d; j++) p->sum[j] += p->chunk[(size_t)t * (size_t)p->d + (size_t)j];
    return TL_OK;
}

/* v[d] scaled to unit L2 norm (the norm in double); a zero vector stays zero. */
static void unit_norm(float *v, int d) {
    double squares = 0.0;
    for (int j = 0; j < d; j++) squares += (double)v[j] * (double)v[j];
    if (squares <= 0.0) return;
    const double scale = 1.0 / sqrt(squares);
    for (int j = 0; j < d; j++) v[j] = (float)((double)v[j] * scale);
}

/* opts (NULL: the defaults) checked into *o, loops 0 made the model's default_loops. */
static tl_status embed_options_of(const char *what, const tl_model *model, const tl_embed_options *opts,
                                  tl_embed_options *o) {
    tl_embed_options_init(o);
    if (opts) *o = *opts;
    if (o->pooling != TL_POOLING_MEAN && o->pooling != TL_POOLING_LAST && o->pooling != TL_POOLING_NONE)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: pooling = %d is not TL_POOLING_MEAN, _LAST or _NONE", what,
                       (int)o->pooling);
    if (o->normalize != 0 && o->normalize != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: normalize = %d, want 0 or 1", what, o->normalize);
    if (o->loops == 0) o->loops = model->cfg.default_loops;
    return TL_OK;
}

/* The end of a pooled embedding, whichever path computed its rows: mean pooling's running
   sum divided by the count, then unit length if asked. */
static void finish_pooled(const tl_embed_options *o, const double *sum, int n, int d, float *out) {
    if (o->pooling == TL_POOLING_MEAN)
        for (int j = 0; j < d; j++) out[j] = (float)(sum[j] / (double)n);
    if (o->normalize) unit_norm(out, d);
}

/* One sequence of any length, chunk by chunk: out [d] ([n][d] unpooled). */
/* TL_OK unless out[count], an embedding (or its rows), holds a NaN or an infinity: the
   model's activations overflowed, or a device failed. A caller read it as a vector (JSON has
   neither). `input`: its index in a batch, or -1. */
static tl_status check_embedding(const char *what, const tl_model *model, const float *out, size_t count, int input) {
    size_t at = 0;
    while (at < count && isfinite(out[at])) at++;
    if (at == count) return TL_OK;
    char which[48] = "";
    if (input >= 0) snprintf(which, sizeof which, " of input %d", input);
    return tl_fail(TL_ERR_FORMAT, "%s: the embedding%s holds non-finite values (NaN or inf): the model's activations "
                   "overflow%s", what, which, tl_overflow_hint(model->kv_type == TL_KV_F16));
}

/* One input's embedding into out, checked (`input`: its index in a batch, or -1). */
static tl_status embed_one(const char *what, const tl_model *model, const int32_t *tokens, int n,
                           const tl_embed_options *o, int input, float *out) {
    const int d = model->cfg.d_model;
    if (o->pooling == TL_POOLING_NONE) { /* every row straight into out */
        const chunk_sink sink = {.hidden = out};
        tl_status st = score_chunks(what, model, tokens, n, o->loops, &sink);
        if (st == TL_OK && o->normalize)
            for (int t = 0; t < n; t++) unit_norm(out + (size_t)t * (size_t)d, d);
        return st == TL_OK ? check_embedding(what, model, out, (size_t)n * (size_t)d, input) : st;
    }
    float *chunk = malloc((size_t)TL_FORWARD_CHUNK * (size_t)d * sizeof *chunk);
    double *sum = calloc((size_t)d, sizeof *sum);
    tl_status st;
    if (!chunk || !sum) {
        st = tl_fail(TL_ERR_NO_MEMORY, "%s: out of memory", what);
    } else {
        pool_rows p = {chunk, n, d, o->pooling, sum, out};
        const chunk_sink sink = {.hidden = chunk, .reuse = true, .done = pool_chunk, .ctx = &p};
        st = score_chunks(what, model, tokens, n, o->loops, &sink);
        if (st == TL_OK) finish_pooled(o, sum, n, d, out);
        if (st == TL_OK) st = check_embedding(what, model, out, (size_t)d, input);
    }
    free(chunk);
    free(sum);
    return st;
}

tl_status tl_embed(const tl_model *model, const int32_t *tokens, int n, const tl_embed_options *opts, float *out) {
    tl_clear_error();
    if (!model || !tokens || !out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_embed: model, tokens and out must not be NULL");
    tl_embed_options o;
    tl_status st = embed_options_of("tl_embed", model, opts, &o);
    return st == TL_OK ? embed_one("tl_embed", model, tokens, n, &o, -1, out) : st;
}

/* ---------------------------------------------------------------- many embeddings */

/* The most rows one forward of tl_embed_batch carries: short inputs share forwards up to
   it (each in its own cache, as the batched decode's sessions), so each weight read serves
   all their rows; a longer input goes alone, chunk by chunk. Each input's cache takes whole
   pages (TL_KV_PAGE_ROWS rows, every slot at the depth), so a group is also held to twice
   that many rows in pages: 128 one-token inputs would have taken 16 times their K/V. */
#define EMBED_BATCH_ROWS 128
#define EMBED_BATCH_PAGE_ROWS (2 * EMBED_BATCH_ROWS)
static int page_rows(int n) { return (n + TL_KV_PAGE_ROWS - 1) / TL_KV_PAGE_ROWS * TL_KV_PAGE_ROWS; }

typedef struct embed_batch {
    const tl_model *model;
    const tl_token_seq *inputs;
    const tl_embed_options *o;
    tl_workspace ws;
    int32_t *tokens, *positions; /* [EMBED_BATCH_ROWS]: a group's rows */
    float *hidden;               /* [EMBED_BATCH_ROWS][d] */
    double *sum;                 /* [d] */
    tl_forward_part parts[EMBED_BATCH_ROWS];
    tl_kv_cache *caches[EMBED_BATCH_ROWS];
} embed_batch;

/* Inputs [first, first + count) in one forward, each in its own cache; each one's vector
   (or rows) into out, the next free place of which is *out_at. */
static tl_status embed_group(embed_batch *b, int first, int count, float *out, size_t *out_at) {
    const tl_model *model = b->model;
    const tl_embed_options *o = b->o;
    const int d = model->cfg.d_model;
    tl_status st = TL_OK;
    int rows = 0;
    for (int i = 0; i < count; i++) b->caches[i] = NULL;
    for (int i = 0; i < count && st == TL_OK; i++) {
        const int n = b->inputs[first + i].n;
        st = tl_kv_cache_new_for(model, n, 0, n, &b->caches[i]);
        if (st != TL_OK) break;
        b->caches[i]->reserve_loops = o->loops; /* pages only for the depth embedded */
        b->parts[i] = (tl_forward_part){.cache = b->caches[i], .n = n, .loops = o->loops};
        memcpy(b->tokens + rows, b->inputs[first + i].tokens, (size_t)n * sizeof *b->tokens);
        for (int t = 0; t < n; t++) b->positions[rows + t] = t;
        rows += n;
    }
    if (st == TL_OK) st = tl_forward_batch_hidden(model, &b->ws, b->parts, count, b->tokens, b->positions, b->hidden);
    for (int i = 0, row = 0; i < count && st == TL_OK; i++) {
        const int n = b->inputs[first + i].n;
        const float *own = b->hidden + (size_t)row * (size_t)d;
        float *dst = out + *out_at;
        const size_t len = (size_t)(o->pooling == TL_POOLING_NONE ? n : 1) * (size_t)d;
        if (o->pooling == TL_POOLING_NONE) { /* as embed_one: the rows, then each to unit length */
            memcpy(dst, own, len * sizeof *dst);
            if (o->normalize)
                for (int t = 0; t < n; t++) unit_norm(dst + (size_t)t * (size_t)d, d);
        } else { /* as embed_one over one chunk: pool_chunk, then finish_pooled */
            memset(b->sum, 0, (size_t)d * sizeof *b->sum);
            pool_rows p = {own, n, d, o->pooling, b->sum, dst};
            pool_chunk(&p, 0, n);
            finish_pooled(o, b->sum, n, d, dst);
        }
        *out_at += len;
        st = check_embedding("tl_embed_batch", model, dst, len, first + i); /* (as embed_one checks) */
        row += n;
    }
    for (int i = 0; i < count; i++) tl_kv_cache_free(b->caches[i]);
    return st;
}

tl_status tl_embed_batch(const tl_model *model, const tl_token_seq *inputs, int n_inputs, const tl_embed_options *opts,
                         float *out) {
    static const char what[] = "tl_embed_batch";
    tl_clear_error();
    if (!model) return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: model must not be NULL", what);
    if (n_inputs < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: n_inputs = %d, want >= 0", what, n_inputs);
    if (n_inputs == 0) return TL_OK;
    if (!inputs || !out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: inputs and out must not be NULL", what);
    tl_embed_options o;
    tl_status st = embed_options_of(what, model, opts, &o);
    if (st != TL_OK) return st;
    const tl_config *c = &model->cfg;
    if (o.loops < 1 || o.loops > c->max_loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: loops = %d is out of range [1, max_loops = %d]", what, o.loops,
                       c->max_loops);
    /* Every input checked before any is computed: a bad one is named, and nothing is half done. */
    for (int i = 0; i < n_inputs; i++) {
        if (inputs[i].n < 1 || inputs[i].n > c->max_seq_len)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: input %d has %d tokens: want 1 .. max_seq_len = %d", what, i,
                           inputs[i].n, c->max_seq_len);
        if (!inputs[i].tokens) return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: input %d's tokens are NULL", what, i);
        for (int t = 0; t < inputs[i].n; t++)
            if (inputs[i].tokens[t] < 0 || inputs[i].tokens[t] >= c->vocab_size)
                return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: input %d: token id %d at index %d is out of range [0, %d)",
                               what, i, inputs[i].tokens[t], t, c->vocab_size);
    }
    embed_batch *b = calloc(1, sizeof *b);
    if (b) {
        b->tokens = malloc(EMBED_BATCH_ROWS * sizeof *b->tokens);
        b->positions = malloc(EMBED_BATCH_ROWS * sizeof *b->positions);
        b->hidden = malloc((size_t)EMBED_BATCH_ROWS * (size_t)c->d_model * sizeof *b->hidden);
        b->sum = malloc((size_t)c->d_model * sizeof *b->sum);
    }
    if (!b || !b->tokens || !b->positions || !b->hidden || !b->sum) {
        st = tl_fail(TL_ERR_NO_MEMORY, "%s: out of memory", what);
    } else {
        b->model = model;
        b->inputs = inputs;
        b->o = &o;
        size_t out_at = 0;
        for (int i = 0; st == TL_OK && i < n_inputs;) {
            if (inputs[i].n > EMBED_BATCH_ROWS) { /* alone, chunk by chunk */
                st = embed_one(what, model, inputs[i].tokens, inputs[i].n, &o, i, out + out_at);
                out_at += (size_t)(o.pooling == TL_POOLING_NONE ? inputs[i].n : 1) * (size_t)c->d_model;
                i++;
                continue;
            }
            int group = 0, rows = 0, paged = 0;
            while (i + group < n_inputs && rows + inputs[i + group].n <= EMBED_BATCH_ROWS &&
                   paged + page_rows(inputs[i + group].n) <= EMBED_BATCH_PAGE_ROWS) {
                rows += inputs[i + group].n;
                paged += page_rows(inputs[i + group++].n);
            }
            st = embed_group(b, i, group, out, &out_at);
            i += group;
        }
    }
    if (b) {
        tl_workspace_release(&b->ws);
        free(b->tokens);
        free(b->positions);
        free(b->hidden);
        free(b->sum);
        free(b);
    }
    if (st == TL_OK) tl_clear_error();
    return st;
}

/* score.c: tl_score, logits for every position of a sequence (SPEC §6), and
 * tl_score_logprobs, their log-probabilities chunk by chunk. */
#include <stdlib.h>

#include "forward.h"
#include "sampler.h"

/* Where a scored chunk's logits go: each chunk's rows in turn (tl_score: into the caller's
   array; tl_score_logprobs: one chunk's buffer, reduced after each). */
typedef struct chunk_sink {
    float *logits;      /* [n][vocab], or one chunk's [TL_FORWARD_CHUNK][vocab] */
    bool reuse;         /* every chunk into logits' start */
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
    const chunk_sink sink = {logits, false, NULL, NULL};
    return score_chunks("tl_score", model, tokens, n, loops, &sink);
}

/* ---------------------------------------------------------------- log-probabilities */

typedef struct logprob_reduce {
    const int32_t *tokens;
    int n, vocab, top;
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
        tl_row_logprobs(r->chunk + (size_t)i * (size_t)r->vocab, r->vocab, r->tokens[start + i + 1], r->top, r->scratch,
                        &r->logprobs[at], r->top_ids + at * (size_t)r->top, r->top_logprobs + at * (size_t)r->top);
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
        logprob_reduce r = {tokens, n, vocab, top, chunk, scratch, logprobs, top_ids, top_logprobs};
        const chunk_sink sink = {chunk, true, reduce_chunk, &r};
        st = score_chunks("tl_score_logprobs", model, tokens, n, loops, &sink);
    }
    free(chunk);
    free(scratch);
    return st;
}

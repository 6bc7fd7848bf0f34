/* score.c: tl_score, logits for every position of a sequence (SPEC §6). */
#include <stdlib.h>

#include "forward.h"

tl_status tl_score(const tl_model *model, const int32_t *tokens, int n, int loops, float *logits) {
    tl_clear_error();
    if (!model) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_score: model must not be NULL");
    if (!tokens || !logits) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_score: tokens and logits must not be NULL");
    const tl_config *c = &model->cfg;
    if (n < 1 || n > c->max_seq_len)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_score: n = %d is out of range [1, max_seq_len = %d]",
                       n, c->max_seq_len);
    if (loops < 1 || loops > c->max_loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_score: loops = %d is out of range [1, max_loops = %d]",
                       loops, c->max_loops);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_score: token id %d at index %d is out of range [0, %d)",
                           tokens[i], i, c->vocab_size);

    tl_kv_cache *cache = NULL;
    tl_workspace ws = {0};
    int32_t *positions = malloc((size_t)n * sizeof *positions);
    tl_status st = positions ? tl_kv_cache_new_for(model, n, 0, TL_FORWARD_CHUNK, &cache)
                             : tl_fail(TL_ERR_NO_MEMORY, "tl_score: out of memory");
    if (st == TL_OK) cache->reserve_loops = loops; /* pages only for the depth scored */
    for (int i = 0; positions && i < n; i++) positions[i] = i;
    for (int start = 0; st == TL_OK && start < n; start += TL_FORWARD_CHUNK) {
        int len = n - start < TL_FORWARD_CHUNK ? n - start : TL_FORWARD_CHUNK;
        st = tl_forward_run(model, cache, &ws, tokens + start, positions + start, len, NULL, loops, 0,
                            logits + (size_t)start * (size_t)c->vocab_size);
    }
    tl_workspace_release(&ws);
    tl_kv_cache_free(cache);
    free(positions);
    if (st == TL_OK) tl_clear_error();
    return st;
}

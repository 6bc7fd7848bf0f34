/* generate.c: the blocking calls of SPEC §3, each a loop over tl_session_step, whatever the
 * mode of the config (plain, speculative, beam). */
#include <stdio.h>
#include <string.h>

#include "session.h"
#include "validate.h"

/* Runs a session to its end, copying prompt + continuation into out. */
static tl_status run_session(tl_session *s, int32_t *out, int *out_len, tl_generate_stats *stats) {
    tl_status st = TL_OK;
    int32_t token;
    tl_stop_reason stop = TL_STOP_NONE;
    while (stop == TL_STOP_NONE && st == TL_OK) st = tl_session_step(s, &token, &stop);
    if (stats) *stats = s->stats;
    if (st != TL_OK) return st;
    memcpy(out, s->tokens, (size_t)s->n_tokens * sizeof *out);
    if (out_len) *out_len = s->n_tokens;
    return TL_OK;
}

static tl_status check_output(const int32_t *out, int out_capacity, long long need) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out must not be NULL");
    if (out_capacity < need)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "out_capacity = %d is too small: prompt_len + max_tokens = %lld", out_capacity, need);
    return TL_OK;
}

tl_status tl_generate_stream(const tl_model *model, const int32_t *prompt, int prompt_len,
                             const tl_generate_config *cfg, tl_stream_fn on_token, void *user,
                             int32_t *out, int out_capacity, int *out_len,
                             tl_generate_stats *stats) {
    tl_clear_error();
    tl_session *s = NULL;
    tl_status st = tl_session_create(model, prompt, prompt_len, cfg, &s);
    if (st == TL_OK) st = check_output(out, out_capacity, (long long)prompt_len + s->cfg.max_tokens);
    if (st == TL_OK) {
        s->stream_fn = on_token;
        s->stream_user = user;
        st = run_session(s, out, out_len, stats);
    }
    tl_session_free(s);
    if (st == TL_OK) tl_clear_error();
    return st;
}

tl_status tl_generate(const tl_model *model, const int32_t *prompt, int prompt_len,
                      const tl_generate_config *cfg, int32_t *out, int out_capacity, int *out_len,
                      tl_generate_stats *stats) {
    return tl_generate_stream(model, prompt, prompt_len, cfg, NULL, NULL, out, out_capacity,
                              out_len, stats);
}

tl_status tl_generate_batch(const tl_model *model, const tl_token_seq *prompts, int n_prompts,
                            const tl_generate_config *cfg, int32_t *out, int out_capacity,
                            int *out_lens, int *out_len, tl_generate_stats *stats) {
    tl_clear_error();
    if (!model) return tl_fail(TL_ERR_INVALID_ARGUMENT, "generate_batch: model must not be NULL");
    if (!prompts) return tl_fail(TL_ERR_INVALID_ARGUMENT, "generate_batch: prompts must not be NULL");
    if (n_prompts < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "generate_batch: n_prompts = %d, need at least one prompt", n_prompts);
    if (!out_lens) return tl_fail(TL_ERR_INVALID_ARGUMENT, "generate_batch: out_lens must not be NULL");
    tl_generate_config defaults;
    tl_generate_config_init(&defaults);
    if (!cfg) cfg = &defaults;
    /* Validate every prompt before decoding any, so a bad one costs no work. */
    long long need = 0;
    for (int i = 0; i < n_prompts; i++) {
        tl_status st = tl_generate_validate(model, prompts[i].tokens, prompts[i].n, cfg);
        if (st != TL_OK) {
            char msg[900];
            snprintf(msg, sizeof msg, "%s", tl_last_error());
            return tl_fail(st, "generate_batch: prompt %d: %s", i, msg);
        }
        need += (long long)prompts[i].n + cfg->max_tokens;
    }
    if (!out || need > out_capacity)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "generate_batch: out_capacity = %d is too small: prompts + max_tokens each = %lld",
                       out_capacity, need);
    int at = 0;
    for (int i = 0; i < n_prompts; i++) {
        int len = 0;
        tl_status st = tl_generate(model, prompts[i].tokens, prompts[i].n, cfg, out + at,
                                   out_capacity - at, &len, stats ? &stats[i] : NULL);
        if (st != TL_OK) return st;
        out_lens[i] = len;
        at += len;
    }
    if (out_len) *out_len = at;
    return TL_OK;
}

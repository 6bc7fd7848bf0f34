/* generate.c: the blocking calls of SPEC §3, each a loop over tl_session_step. */
#include <stdio.h>
#include <string.h>

#include "beam.h"
#include "session.h"

/* Runs a session to its end, copying prompt + continuation into out. */
static tl_status run_session(tl_session *s, int32_t *out, int *out_len,
                             tl_generate_stats *stats) {
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

static tl_status check_output(const int32_t *out, int out_capacity, int need) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "out must not be NULL");
    if (out_capacity < need)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "out_capacity = %d is too small: prompt_len + max_tokens = %d", out_capacity, need);
    return TL_OK;
}

tl_status tl_generate_stream(const tl_model *model, const int32_t *prompt, int prompt_len,
                             const tl_generate_config *cfg, tl_stream_fn on_token, void *user,
                             int32_t *out, int out_capacity, int *out_len,
                             tl_generate_stats *stats) {
    if (cfg && cfg->beam_size >= 2) {
        if (!model) return tl_fail(TL_ERR_INVALID_ARGUMENT, "model must not be NULL");
        tl_status st = tl_generate_validate(model, prompt, prompt_len, cfg);
        if (st == TL_OK) st = check_output(out, out_capacity, prompt_len + cfg->max_tokens);
        if (st == TL_OK) st = tl_beam_generate(model, prompt, prompt_len, cfg, on_token, user, out, out_len, stats);
        if (st == TL_OK) tl_clear_error();
        return st;
    }
    tl_session *s = NULL;
    tl_status st = tl_session_new(model, prompt, prompt_len, cfg, &s);
    if (st == TL_OK) st = check_output(out, out_capacity, prompt_len + s->cfg.max_tokens);
    if (st == TL_OK) {
        s->stream_fn = on_token;
        s->stream_user = user;
        st = run_session(s, out, out_len, stats);
    }
    tl_session_free(s);
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
    if (!prompts || n_prompts < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "generate_batch: need at least one prompt (n_prompts = %d)",
                       n_prompts);
    if (!out_lens) return tl_fail(TL_ERR_INVALID_ARGUMENT, "generate_batch: out_lens must not be NULL");
    tl_generate_config defaults;
    tl_generate_config_init(&defaults);
    const int max_tokens = (cfg ? cfg : &defaults)->max_tokens;
    long need = 0;
    for (int i = 0; i < n_prompts; i++) need += (long)prompts[i].n + (max_tokens > 0 ? max_tokens : 0);
    if (!out || need > out_capacity)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "generate_batch: out_capacity = %d is too small: prompts + max_tokens each = %ld",
                       out_capacity, need);
    /* Validate every prompt before decoding any, so a bad one costs no work. */
    if (!model) return tl_fail(TL_ERR_INVALID_ARGUMENT, "model must not be NULL");
    for (int i = 0; i < n_prompts; i++) {
        tl_status st = tl_generate_validate(model, prompts[i].tokens, prompts[i].n, cfg ? cfg : &defaults);
        if (st != TL_OK) {
            char msg[900];
            snprintf(msg, sizeof msg, "%s", tl_last_error());
            return tl_fail(st, "generate_batch: prompt %d: %s", i, msg);
        }
    }
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

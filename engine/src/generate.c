/* generate.c: the blocking calls of SPEC §3, each a loop over tl_session_step, whatever the
 * mode of the config (plain, speculative, beam). */
#include <stdio.h>
#include <stdlib.h>
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

/* Sessions decoding at once in tl_generate_batch: enough rows to share each weight read
   widely, few enough that their caches stay modest; more prompts wait for a free place. */
#define TL_BATCH_LIVE_SESSIONS 16

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
    /* Every session calls the one config's hooks; a callback grammar's user pointer holds one
       sequence's state, which the prompts' advances would interleave on (a compiled grammar
       gives each session its own matcher). */
    if (n_prompts > 1 && cfg->grammar && !cfg->grammar->compiled)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "generate_batch: a callback grammar holds one sequence's state and cannot serve %d prompts: use a "
                       "compiled grammar (tl_grammar_use), or one tl_generate per prompt", n_prompts);
    /* Validate every prompt before decoding any, so a bad one costs no work. */
    long long need = 0;
    for (int i = 0; i < n_prompts; i++) {
        tl_status st = tl_generate_validate(model, prompts[i].tokens, prompts[i].n, cfg);
        if (st != TL_OK) {
            char msg[TL_ERROR_MAX];
            snprintf(msg, sizeof msg, "%s", tl_last_error());
            return tl_fail(st, "generate_batch: prompt %d: %s", i, msg);
        }
        need += (long long)prompts[i].n + cfg->max_tokens;
    }
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "generate_batch: out must not be NULL");
    if (need > out_capacity)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "generate_batch: out_capacity = %d is too small: prompts + max_tokens each = %lld",
                       out_capacity, need);

    /* Continuous batching: up to TL_BATCH_LIVE_SESSIONS sessions advance together, one
       batched step at a time; a finished one hands its place to the next prompt. Sequence i
       is first written at its reserved offset (prompts before it at full length), then the
       results are packed in prompt order. */
    tl_session *live[TL_BATCH_LIVE_SESSIONS];
    int live_prompt[TL_BATCH_LIVE_SESSIONS], n_live = 0, next_prompt = 0;
    int32_t tokens[TL_BATCH_LIVE_SESSIONS];
    tl_stop_reason stops[TL_BATCH_LIVE_SESSIONS];
    tl_status statuses[TL_BATCH_LIVE_SESSIONS];
    long long *reserved = malloc((size_t)n_prompts * sizeof *reserved);
    if (!reserved) return tl_fail(TL_ERR_NO_MEMORY, "generate_batch: out of memory");
    for (long long i = 0, at = 0; i < n_prompts; i++) {
        reserved[i] = at;
        at += prompts[i].n + cfg->max_tokens;
    }
    tl_status st = TL_OK;
    while (st == TL_OK && (n_live > 0 || next_prompt < n_prompts)) {
        while (st == TL_OK && n_live < TL_BATCH_LIVE_SESSIONS && next_prompt < n_prompts) {
            st = tl_session_create(model, prompts[next_prompt].tokens, prompts[next_prompt].n, cfg, &live[n_live]);
            if (st == TL_OK) live_prompt[n_live++] = next_prompt++;
        }
        if (st != TL_OK || n_live == 0) break;
        st = tl_session_step_batch(live, n_live, tokens, stops, statuses);
        for (int i = 0; st == TL_OK && i < n_live; i++) {
            tl_session *s = live[i];
            if (statuses[i] != TL_OK) {
                st = tl_fail(statuses[i], "generate_batch: prompt %d: %s", live_prompt[i], tl_session_error(s));
                break;
            }
            if (!s->finished) continue;
            const int p = live_prompt[i];
            memcpy(out + reserved[p], s->tokens, (size_t)s->n_tokens * sizeof *out);
            out_lens[p] = s->n_tokens;
            if (stats) stats[p] = s->stats;
            tl_session_free(s);
            live[i] = live[n_live - 1]; /* the order of live sessions does not matter */
            live_prompt[i] = live_prompt[n_live - 1];
            tokens[i] = tokens[n_live - 1];
            stops[i] = stops[n_live - 1];
            statuses[i] = statuses[n_live - 1];
            n_live--;
            i--;
        }
    }
    /* (failed: the prompts under way keep what ran before it, as tl_generate's stats do) */
    for (int i = 0; i < n_live; i++) {
        if (stats) stats[live_prompt[i]] = live[i]->stats;
        tl_session_free(live[i]);
    }
    if (st == TL_OK) { /* pack: offsets only move down, so a front-to-back memmove is safe */
        int at = 0;
        for (int p = 0; p < n_prompts; p++) {
            memmove(out + at, out + reserved[p], (size_t)out_lens[p] * sizeof *out);
            at += out_lens[p];
        }
        if (out_len) *out_len = at;
    }
    free(reserved);
    return st;
}

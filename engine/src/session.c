/* session.c: the canonical decode state machine (SPEC §3). Per step: forward the pending
 * tokens, then logits hook, repetition penalty, grammar mask, sample, append, stop checks.
 * Every blocking call in generate.c is a loop over tl_session_step. */
#define _POSIX_C_SOURCE 200809L /* strdup */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "session.h"
#include "stop.h"
#include "tokenizer.h"

/* Prompt rows per forward: bounds activation memory; results do not depend on it. */
#define PREFILL_CHUNK 64

/* ---------------------------------------------------------------- config */

void tl_generate_config_init(tl_generate_config *cfg) {
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->max_tokens = 64;
    cfg->temperature = 0.0f;
    cfg->top_k = 50;
    cfg->top_p = 1.0f;
    cfg->repetition_penalty = 1.0f;
    cfg->length_penalty = 1.0f;
    cfg->early_exit_min_L = 2;
    cfg->early_exit_peek_every = 1;
    cfg->early_exit_threshold = 0.03f;
}

const char *tl_stop_reason_name(tl_stop_reason reason) {
    switch (reason) {
    case TL_STOP_EOS: return "EOS";
    case TL_STOP_SEQUENCE: return "STOP_SEQUENCE";
    case TL_STOP_MAX_TOKENS: return "MAX_TOKENS";
    case TL_STOP_CALLBACK_ABORT: return "CALLBACK_ABORT";
    case TL_STOP_GRAMMAR_DEAD_END: return "GRAMMAR_DEAD_END";
    default: return "NONE";
    }
}

double tl_stats_decode_tokens_per_s(const tl_generate_stats *s) {
    return s && s->decode_ms > 0 ? s->tokens_emitted * 1000.0 / s->decode_ms : 0.0;
}

double tl_stats_prefill_tokens_per_s(const tl_generate_stats *s) {
    return s && s->prefill_ms > 0 ? s->prompt_tokens * 1000.0 / s->prefill_ms : 0.0;
}

/* Every rule of SPEC §3, with the field and value in the message. */
tl_status tl_generate_validate(const tl_model *m, const int32_t *prompt, int prompt_len,
                          const tl_generate_config *c) {
    const tl_config *mc = &m->cfg;
    if (!prompt && prompt_len > 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt must not be NULL");
    if (prompt_len < 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt_len = %d must be >= 1", prompt_len);
    if (c->max_tokens < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_tokens = %d must be >= 0", c->max_tokens);
    if ((long)prompt_len + c->max_tokens > mc->max_seq_len)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "prompt_len + max_tokens = %d + %d exceeds max_seq_len = %d", prompt_len,
                       c->max_tokens, mc->max_seq_len);
    for (int i = 0; i < prompt_len; i++)
        if (prompt[i] < 0 || prompt[i] >= mc->vocab_size)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt token id %d at index %d is out of range [0, %d)",
                           prompt[i], i, mc->vocab_size);
    if (c->loops != 0 && (c->loops < 1 || c->loops > mc->max_loops))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "loops = %d is out of range [1, max_loops = %d] (0 = default)",
                       c->loops, mc->max_loops);
    if (!(c->temperature >= 0.0f) || !isfinite(c->temperature))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "temperature = %g must be a finite number >= 0", (double)c->temperature);
    if (c->temperature > 0.01f && c->top_k < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_k = %d must be >= 1 when sampling (temperature = %g)",
                       c->top_k, (double)c->temperature);
    if (!(c->top_p > 0.0f && c->top_p <= 1.0f))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_p = %g must be in (0, 1]", (double)c->top_p);
    if (!(c->repetition_penalty > 0.0f) || !isfinite(c->repetition_penalty))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "repetition_penalty = %g must be a finite number > 0",
                       (double)c->repetition_penalty);
    if (c->cache_window < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "cache_window = %d must be >= 0 (0 = unbounded)", c->cache_window);
    if (c->n_stop_sequences < 0 || (c->n_stop_sequences > 0 && !c->stop_sequences))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_stop_sequences = %d without stop_sequences", c->n_stop_sequences);
    for (int i = 0; i < c->n_stop_sequences; i++) {
        const tl_token_seq *s = &c->stop_sequences[i];
        if (s->n < 1 || !s->tokens)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "stop_sequences[%d] is empty (n = %d)", i, s->n);
        for (int j = 0; j < s->n; j++)
            if (s->tokens[j] < 0 || s->tokens[j] >= mc->vocab_size)
                return tl_fail(TL_ERR_INVALID_ARGUMENT, "stop_sequences[%d] token id %d is out of range [0, %d)",
                               i, s->tokens[j], mc->vocab_size);
    }
    if (c->beam_size < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "beam_size = %d must be >= 0", c->beam_size);
    if (!isfinite(c->length_penalty))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "length_penalty = %g must be finite", (double)c->length_penalty);
    if (c->early_exit_patience < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "early_exit_patience = %d must be >= 0", c->early_exit_patience);
    if (c->early_exit_min_L < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "early_exit_min_L = %d must be >= 1", c->early_exit_min_L);
    if (c->early_exit_peek_every < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "early_exit_peek_every = %d must be >= 1", c->early_exit_peek_every);
    if (!(c->early_exit_logit_margin >= 0.0f) || !isfinite(c->early_exit_logit_margin))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "early_exit_logit_margin = %g must be a finite number >= 0",
                       (double)c->early_exit_logit_margin);
    if (c->n_stop_strings < 0 || (c->n_stop_strings > 0 && !c->stop_strings))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_stop_strings = %d without stop_strings", c->n_stop_strings);
    for (int i = 0; i < c->n_stop_strings; i++)
        if (!c->stop_strings[i] || !c->stop_strings[i][0])
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "stop_strings[%d] is empty", i);
    if (c->n_stop_strings > 0 && !m->tokenizer)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "stop_strings need a tokenizer, and this model has no tokenizer.json");
    if (c->grammar && (!c->grammar->allowed || !c->grammar->advance))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar needs both an allowed and an advance callback");
    if (!(c->early_exit_threshold >= 0.0f) || !isfinite(c->early_exit_threshold))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "early_exit_threshold = %g must be a finite number >= 0",
                       (double)c->early_exit_threshold);
    return TL_OK;
}

/* ---------------------------------------------------------------- lifetime */

void tl_session_free(tl_session *s) {
    if (!s) return;
    tl_kv_cache_free(s->cache);
    tl_workspace_release(&s->ws);
    tl_distribution_free(&s->dist);
    free(s->stop_seqs);
    free(s->stop_store);
    free(s->tokens);
    free(s->positions);
    free(s->logits);
    free(s->work);
    free(s->seen);
    free(s->allowed);
    free(s->text);
    for (int i = 0; s->stop_strs && i < s->cfg.n_stop_strings; i++) free(s->stop_strs[i]);
    free(s->stop_strs);
    free(s->stop_lens);
    free(s);
}

tl_status tl_session_new(const tl_model *m, const int32_t *prompt, int prompt_len,
                         const tl_generate_config *cfg, tl_session **out) {
    return tl_session_create(m, prompt, prompt_len, cfg, 0, out);
}

tl_status tl_session_create(const tl_model *m, const int32_t *prompt, int prompt_len,
                            const tl_generate_config *cfg, int min_chunk, tl_session **out) {
    double t_start = tl_now_ms();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_new: out must not be NULL");
    *out = NULL;
    if (!m) return tl_fail(TL_ERR_INVALID_ARGUMENT, "model must not be NULL");
    tl_generate_config defaults;
    tl_generate_config_init(&defaults);
    if (!cfg) cfg = &defaults;
    tl_status st = tl_generate_validate(m, prompt, prompt_len, cfg);
    if (st != TL_OK) return st;
    if (cfg->beam_size >= 2)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "beam_size = %d: beam search runs through tl_generate / tl_generate_stream, not "
                       "the step API", cfg->beam_size);

    const int vocab = m->cfg.vocab_size, total = prompt_len + cfg->max_tokens;
    tl_session *s = calloc(1, sizeof *s);
    if (!s) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    s->m = m;
    s->cfg = *cfg;
    s->loops = cfg->loops ? cfg->loops : m->cfg.default_loops;
    s->greedy = cfg->temperature <= 0.01f;
    s->prompt_len = s->n_tokens = prompt_len;
    s->t_start = t_start;
    s->stats.prompt_tokens = prompt_len;
    tl_rng_seed(&s->rng, cfg->sample_seed);

    int stop_total = 0;
    for (int i = 0; i < cfg->n_stop_sequences; i++) stop_total += cfg->stop_sequences[i].n;
    s->stop_seqs = calloc((size_t)cfg->n_stop_sequences + 1, sizeof *s->stop_seqs);
    s->stop_store = malloc(((size_t)stop_total + 1) * sizeof *s->stop_store);
    s->tokens = malloc((size_t)total * sizeof *s->tokens);
    s->positions = malloc((size_t)total * sizeof *s->positions);
    s->logits = malloc((size_t)vocab * sizeof *s->logits);
    s->work = malloc((size_t)vocab * sizeof *s->work);
    s->seen = calloc((size_t)vocab, 1);
    s->allowed = malloc((size_t)vocab);
    st = (s->stop_seqs && s->stop_store && s->tokens && s->positions && s->logits && s->work &&
          s->seen && s->allowed)
             ? tl_distribution_init(&s->dist, vocab)
             : tl_fail(TL_ERR_NO_MEMORY, "out of memory for a session of %d tokens", total);
    /* A windowed cache holds window + chunk rows: small windows take small chunks so that
       memory stays within twice the window. */
    s->chunk = cfg->cache_window > 0 && cfg->cache_window < PREFILL_CHUNK ? cfg->cache_window : PREFILL_CHUNK;
    if (st == TL_OK)
        /* min_chunk rows of headroom: a speculative tree sits after the sequence until the
           accepted path is compacted. */
        st = tl_kv_cache_new(&m->cfg, total + min_chunk, cfg->cache_window,
                             s->chunk > min_chunk ? s->chunk : min_chunk, &s->cache);
    if (st != TL_OK) {
        tl_session_free(s);
        return st;
    }
    for (int i = 0, at = 0; i < cfg->n_stop_sequences; i++) {
        const tl_token_seq *src = &cfg->stop_sequences[i];
        memcpy(s->stop_store + at, src->tokens, (size_t)src->n * sizeof(int32_t));
        s->stop_seqs[i] = (tl_token_seq){s->stop_store + at, src->n};
        at += src->n;
    }
    s->cfg.stop_sequences = s->stop_seqs;
    if (cfg->grammar) {
        s->grammar = *cfg->grammar;
        s->cfg.grammar = &s->grammar;
    }
    s->stop_strs = calloc((size_t)cfg->n_stop_strings + 1, sizeof *s->stop_strs);
    s->stop_lens = calloc((size_t)cfg->n_stop_strings + 1, sizeof *s->stop_lens);
    for (int i = 0; s->stop_strs && s->stop_lens && i < cfg->n_stop_strings; i++) {
        s->stop_lens[i] = strlen(cfg->stop_strings[i]);
        s->stop_strs[i] = strdup(cfg->stop_strings[i]);
        if (!s->stop_strs[i]) break;
        if (s->stop_lens[i] > s->max_stop_len) s->max_stop_len = s->stop_lens[i];
    }
    s->cfg.stop_strings = (const char *const *)s->stop_strs;
    if (!s->stop_strs || !s->stop_lens || (cfg->n_stop_strings && !s->stop_strs[cfg->n_stop_strings - 1])) {
        tl_session_free(s);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    }
    memcpy(s->tokens, prompt, (size_t)prompt_len * sizeof *s->tokens);
    for (int i = 0; i < total; i++) s->positions[i] = i;
    tl_clear_error();
    *out = s;
    return TL_OK;
}

const int32_t *tl_session_tokens(const tl_session *s, int *n) {
    if (n) *n = s ? s->n_tokens : 0;
    return s ? s->tokens : NULL;
}

const tl_generate_stats *tl_session_stats(const tl_session *s) { return s ? &s->stats : NULL; }

/* ---------------------------------------------------------------- the step */

/* One decode token with early exit (SPEC §3 knobs): after early_exit_min_L loops, probe
   every early_exit_peek_every loops with the coda + head; exit after `patience`
   consecutive stable probes. The exited position keeps its depth in the cache, and deeper
   loops of later tokens read its deepest slot (KV sharing, SPEC §2). */
static tl_status forward_early_exit(tl_session *s, int start) {
    const tl_generate_config *c = &s->cfg;
    const int L = s->loops;
    tl_forward f;
    tl_status st = tl_forward_begin(&f, s->m, s->cache, &s->ws, s->tokens + start, s->positions + start, 1, NULL);
    if (st != TL_OK) return st;
    int stable = 0;
    int32_t previous = -1;
    for (int l = 1; l <= L; l++) {
        const bool probe = l < L && l >= c->early_exit_min_L && (l - c->early_exit_min_L) % c->early_exit_peek_every == 0;
        if (!probe) {
            tl_forward_loop(&f);
            continue;
        }
        double change; /* +infinity for an all-zero state: never stable */
        tl_forward_loop_measured(&f, &change);
        const double t0 = tl_now_ms();
        tl_forward_head(&f, 0, s->logits);
        const int32_t top = tl_argmax(s->logits, s->m->cfg.vocab_size);
        bool now_stable;
        if (c->early_exit_logit_margin > 0.0f) {
            float second = -INFINITY;
            for (int i = 0; i < s->m->cfg.vocab_size; i++)
                if (i != top && s->logits[i] > second) second = s->logits[i];
            now_stable = top >= 0 && s->logits[top] - second >= c->early_exit_logit_margin;
        } else {
            now_stable = change < (double)c->early_exit_threshold && top == previous;
        }
        previous = top;
        stable = now_stable ? stable + 1 : 0;
        s->stats.probes++;
        s->stats.probe_ms += tl_now_ms() - t0;
        if (stable >= c->early_exit_patience) {
            tl_forward_commit(&f); /* the last probe's coda K/V and logits are this depth's */
            s->last_depth = l;
            return TL_OK;
        }
    }
    tl_forward_end(&f, 0, s->logits);
    s->last_depth = L;
    return TL_OK;
}

/* Brings the cache up to date with every token and leaves the next-token logits. */
static tl_status forward_pending(tl_session *s) {
    tl_kv_cache *c = s->cache;
    const bool prefill = c->length == 0;
    if (!prefill && s->cfg.early_exit_patience > 0 && c->length + 1 == s->n_tokens)
        return forward_early_exit(s, c->length);
    const int start = c->length;
    tl_status st = tl_forward_sequence(s->m, c, &s->ws, s->tokens + start, s->positions + start,
                                       s->n_tokens - start, s->chunk, s->loops, s->logits);
    if (st != TL_OK) return st;
    s->last_depth = s->loops;
    if (prefill) {
        s->t_prefill_end = tl_now_ms();
        s->stats.prefill_ms = s->t_prefill_end - s->t_start;
    }
    return TL_OK;
}

static tl_status finish(tl_session *s, tl_stop_reason reason, tl_stop_reason *stop) {
    s->finished = true;
    s->stats.stop_reason = reason;
    *stop = reason;
    return TL_OK;
}

static tl_status hook_failed(tl_session *s, const char *hook, int code) {
    s->finished = true;
    return tl_fail(TL_ERR_HOOK, "%s hook returned error %d", hook, code);
}

/* Appends the token's bytes to the generated text; true when a stop string now ends
   inside them (a match may start in earlier tokens' text). */
static tl_status append_text(tl_session *s, int32_t tok, bool *matched) {
    *matched = false;
    /* Special tokens (end of text...) are control, not text: they are never shown. */
    if (!s->m->tokenizer || tlz_is_special(s->m->tokenizer, tok)) return TL_OK;
    const char *bytes;
    size_t len;
    if (tlz_token_bytes(s->m->tokenizer, tok, &bytes, &len) != 0) len = 0; /* id without text */
    if (s->text_len + len + 1 > s->text_cap) {
        size_t cap = (s->text_len + len + 1) * 2;
        char *grown = realloc(s->text, cap);
        if (!grown) return tl_fail(TL_ERR_NO_MEMORY, "out of memory for generated text");
        s->text = grown;
        s->text_cap = cap;
    }
    const size_t old = s->text_len;
    memcpy(s->text + old, bytes, len);
    s->text_len += len;
    for (int i = 0; i < s->cfg.n_stop_strings; i++) {
        const size_t L = s->stop_lens[i];
        size_t from = old + 1 > L ? old + 1 - L : 0; /* the match must end in the new bytes */
        for (size_t at = from; at + L <= s->text_len; at++)
            if (memcmp(s->text + at, s->stop_strs[i], L) == 0) { *matched = true; return TL_OK; }
    }
    return TL_OK;
}

tl_status tl_session_prepare_logits(tl_session *s, const float *row) {
    const tl_generate_config *c = &s->cfg;
    const int vocab = s->m->cfg.vocab_size;
    memcpy(s->work, row, (size_t)vocab * sizeof(float));
    if (c->logits_processor) {
        int r = c->logits_processor(c->logits_processor_user, s->work, vocab, s->tokens, s->n_tokens);
        if (r < 0) return hook_failed(s, "logits_processor", r);
    }
    tl_repetition_penalty(s->work, s->tokens, s->n_tokens, c->repetition_penalty, s->seen);
    if (c->grammar) {
        memset(s->allowed, 0, (size_t)vocab);
        int n_allowed = c->grammar->allowed(c->grammar->user, s->allowed, vocab);
        if (n_allowed < 0) return hook_failed(s, "grammar allowed", n_allowed);
        for (int i = 0; i < vocab; i++)
            if (!s->allowed[i]) s->work[i] = -INFINITY;
    }
    return TL_OK;
}

/* Picks the next token from a row of logits; *token = -1 when nothing is allowed. */
static tl_status choose_token(tl_session *s, const float *row, int32_t *token) {
    const tl_generate_config *c = &s->cfg;
    tl_status st = tl_session_prepare_logits(s, row);
    if (st != TL_OK) return st;
    if (s->greedy) {
        *token = tl_argmax(s->work, s->m->cfg.vocab_size);
    } else {
        *token = tl_distribution_build(&s->dist, s->work, c->temperature, c->top_k, c->top_p)
                     ? tl_distribution_draw(&s->dist, &s->rng)
                     : -1;
    }
    return TL_OK;
}

tl_status tl_session_emit(tl_session *s, int32_t tok, tl_stop_reason *stop) {
    const tl_generate_config *c = &s->cfg;
    tl_status st;
    *stop = TL_STOP_NONE;
    if (tok < 0) return finish(s, TL_STOP_GRAMMAR_DEAD_END, stop);
    if (c->grammar) {
        int r = c->grammar->advance(c->grammar->user, tok);
        if (r < 0) return hook_failed(s, "grammar advance", r);
    }

    /* Append and account. */
    const int position = s->n_tokens;
    s->tokens[s->n_tokens++] = tok;
    const double now = tl_now_ms();
    const int emitted = s->n_tokens - s->prompt_len;
    if (emitted == 1) s->stats.first_token_ms = now - s->t_start;
    s->stats.decode_ms = now - s->t_prefill_end;
    s->stats.tokens_emitted = emitted;
    const int depth = s->last_depth > 0 ? s->last_depth : s->loops;
    s->loops_sum += depth;
    s->stats.loops_used = s->loops_sum / emitted;
    s->stats.depth_histogram[depth < TL_HISTOGRAM_DEPTHS ? depth : TL_HISTOGRAM_DEPTHS - 1]++;

    bool stop_string = false;
    if ((st = append_text(s, tok, &stop_string)) != TL_OK) { s->finished = true; return st; }

    /* Observers see every token, the last one included. */
    bool observer_stop = false;
    if (c->on_token) {
        int r = c->on_token(c->on_token_user, tok, position);
        if (r < 0) return hook_failed(s, "on_token", r);
        observer_stop = r == TL_HOOK_STOP;
    }
    if (s->stream_fn && !s->stream_fn(s->stream_user, tok, position)) observer_stop = true;

    /* Stop checks, in order of precedence. */
    if (tok == s->m->cfg.eos_token_id && !c->ignore_eos) return finish(s, TL_STOP_EOS, stop);
    if (tl_stop_sequences_match(s->tokens, s->n_tokens, s->prompt_len, c->stop_sequences, c->n_stop_sequences))
        return finish(s, TL_STOP_SEQUENCE, stop);
    if (stop_string) return finish(s, TL_STOP_SEQUENCE, stop);
    if (c->stop_rule) {
        int r = c->stop_rule(c->stop_rule_user, s->tokens, s->n_tokens);
        if (r < 0) return hook_failed(s, "stop_rule", r);
        if (r == TL_HOOK_STOP) return finish(s, TL_STOP_CALLBACK_ABORT, stop);
    }
    if (observer_stop) return finish(s, TL_STOP_CALLBACK_ABORT, stop);
    if (emitted >= c->max_tokens) return finish(s, TL_STOP_MAX_TOKENS, stop);
    return TL_OK;
}

tl_status tl_session_step(tl_session *s, int32_t *token, tl_stop_reason *stop) {
    if (!s || !token || !stop) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_step: NULL argument");
    *token = -1;
    *stop = TL_STOP_NONE;
    if (s->finished)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "session has already finished (stop reason %s)",
                       tl_stop_reason_name(s->stats.stop_reason));
    if (s->cfg.max_tokens == 0) return finish(s, TL_STOP_MAX_TOKENS, stop);

    tl_status st = forward_pending(s);
    if (st != TL_OK) { s->finished = true; return st; }
    int32_t tok = -1;
    if ((st = choose_token(s, s->logits, &tok)) != TL_OK) return st;
    if ((st = tl_session_emit(s, tok, stop)) != TL_OK) return st;
    if (tok >= 0) *token = tok;
    return TL_OK;
}

/* ---------------------------------------------------------------- streamed text */

/* Bytes at the end of text[0..len) to hold back: an unfinished UTF-8 sequence, or the
   longest suffix that is a proper prefix of a stop string. */
static size_t held_back(const tl_session *s) {
    size_t hold = 0;
    const unsigned char *t = (const unsigned char *)s->text;
    for (size_t back = 1; back <= 3 && back <= s->text_len; back++) {
        unsigned char c = t[s->text_len - back];
        if ((c & 0xC0) != 0x80) { /* the last lead byte: is its sequence complete? */
            if (tlz_utf8_seq(t + s->text_len - back, back) == 0) hold = back;
            break;
        }
    }
    for (int i = 0; i < s->cfg.n_stop_strings; i++) {
        size_t L = s->stop_lens[i];
        for (size_t k = L - 1 < s->text_len ? L - 1 : s->text_len; k > hold; k--)
            if (memcmp(s->text + s->text_len - k, s->stop_strs[i], k) == 0) { hold = k; break; }
    }
    return hold;
}

tl_status tl_session_text(tl_session *s, const char **piece, size_t *len) {
    if (!s || !piece || !len) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_text: NULL argument");
    if (!s->m->tokenizer)
        return tl_fail(TL_ERR_UNSUPPORTED, "tl_session_text: the model has no tokenizer.json");
    size_t safe = s->finished ? s->text_len : s->text_len - held_back(s);
    if (safe < s->text_shown) safe = s->text_shown;
    *piece = s->text ? s->text + s->text_shown : "";
    *len = safe - s->text_shown;
    s->text_shown = safe;
    return TL_OK;
}

/* session.c: the canonical decode state machine (SPEC §3) and plain decoding.
 *
 * Per step: the session's decoder finds the next token (forward passes, then logits hook,
 * repetition penalty, grammar mask and the choice), and tl_session_emit appends it and runs
 * the hooks and stop checks. Every mode (plain, speculative, beam) and every blocking call in
 * generate.c goes through tl_session_step. */
#define _POSIX_C_SOURCE 200809L /* strdup */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "session.h"
#include "stats.h"
#include "stop.h"
#include "prefix_pool.h"
#include "tokenizer.h"
#include "validate.h"

/* ---------------------------------------------------------------- the hooks' buffers

   A logits_processor edits s->work, and a callback grammar's allowed() fills s->allowed, in
   place through a bare pointer, and a Lua hook indexes it with no bounds check: an index just
   past either end (a 1-based habit, `for i = 0, vocab`; an id list of another model) would
   write into the allocator's bookkeeping and abort the process later, far from the hook.
   HOOK_GUARD bytes on each side hold a pattern; after each call a changed byte fails the
   session with the index written (and is restored). Writes further out are not caught: the
   header says the bounds. */
enum { HOOK_GUARD = 256 }; /* (64 floats) */
static const unsigned char HOOK_GUARD_BYTE = 0xA5;

void *tl_session_hook_buffer_new(size_t bytes) {
    unsigned char *block = malloc(bytes + 2 * HOOK_GUARD);
    if (!block) return NULL;
    memset(block, HOOK_GUARD_BYTE, HOOK_GUARD);
    memset(block + HOOK_GUARD + bytes, HOOK_GUARD_BYTE, HOOK_GUARD);
    return block + HOOK_GUARD;
}

void tl_session_hook_buffer_free(void *buffer) {
    if (buffer) free((unsigned char *)buffer - HOOK_GUARD);
}

/* Whether the hook wrote outside buffer[0, n) of elements of `size` bytes: *index, the
   element nearest the buffer it wrote (-1 before it, n after it, ...); each guard restored. */
static bool hook_guard_breached(void *buffer, int n, size_t size, int *index) {
    unsigned char *before = (unsigned char *)buffer - HOOK_GUARD, *after = (unsigned char *)buffer + (size_t)n * size;
    bool breached = false;
    for (int i = 0; i < HOOK_GUARD; i++) /* before: the nearest last */
        if (before[i] != HOOK_GUARD_BYTE) {
            *index = -(int)((HOOK_GUARD - i + size - 1) / size), breached = true;
            before[i] = HOOK_GUARD_BYTE;
        }
    for (int i = HOOK_GUARD - 1; i >= 0; i--) /* after: the nearest last */
        if (after[i] != HOOK_GUARD_BYTE) {
            *index = n + (int)(i / size), breached = true;
            after[i] = HOOK_GUARD_BYTE;
        }
    return breached;
}

/* ---------------------------------------------------------------- lifetime */

static void session_destroy(tl_session *s) {
    if (s->decoder && s->decoder->close) s->decoder->close(s);
    tl_kv_cache_free(s->cache);
    tl_workspace_release(&s->ws);
    tl_distribution_free(&s->dist);
    free(s->stop_seqs);
    free(s->stop_store);
    free(s->tokens);
    free(s->positions);
    free(s->logits);
    tl_session_hook_buffer_free(s->work);
    free(s->tally);
    free(s->logit_bias);
    tl_session_hook_buffer_free(s->allowed);
    free(s->probe_logp);
    free(s->logprob_scratch);
    free(s->text);
    for (int i = 0; s->stop_strs && i < s->cfg.n_stop_strings; i++) free(s->stop_strs[i]);
    free(s->stop_strs);
    free(s->stop_lens);
    free(s->stop_borders);
    tl_grammar_matcher_free(s->grammar_matcher);
    free(s);
}

void tl_session_free(tl_session *s) {
    if (!s) return;
    /* From one of the session's own hooks: the running step still uses it. A serving
       engine's session (a hook's free of it, or another thread's) is the engine's to free:
       it ends the request instead (scheduler.c), never leaves it a dangling pointer. */
    if (atomic_load(&s->engine_claimed) || s->stepping) { /* (the claim first: an engine's thread writes stepping) */
        atomic_store(&s->free_requested, true);
        return;
    }
    session_destroy(s);
}

bool tl_session_claim(tl_session *s) {
    bool unclaimed = false;
    return atomic_compare_exchange_strong(&s->engine_claimed, &unclaimed, true);
}

void tl_session_unclaim(tl_session *s) { atomic_store(&s->engine_claimed, false); }

void tl_session_release_claimed(tl_session *s) {
    if (!s) return;
    tl_session_unclaim(s);
    tl_session_free(s); /* (not stepping: the engine frees between steps) */
}

tl_status tl_session_new(const tl_model *m, const int32_t *prompt, int prompt_len,
                         const tl_generate_config *cfg, tl_session **out) {
    tl_clear_error();
    return tl_session_create(m, prompt, prompt_len, cfg, out);
}

tl_status tl_session_cache_new(tl_session *s, int headroom) {
    const int total = s->prompt_len + s->cfg.max_tokens;
    tl_status st = tl_kv_cache_new_for(s->m, total + headroom, s->cfg.cache_window,
                                       s->chunk > headroom ? s->chunk : headroom, &s->cache);
    if (st == TL_OK) s->cache->reserve_loops = s->loops; /* pages only for the depth in use */
    return st;
}

tl_status tl_session_create(const tl_model *m, const int32_t *prompt, int prompt_len,
                            const tl_generate_config *cfg, tl_session **out) {
    return tl_session_create_with(NULL, m, prompt, prompt_len, cfg, out);
}

/* border[q] for q < L - 1: the longest proper prefix of stop[0, q] that is also its suffix
   (Knuth-Morris-Pratt's failure function, all held_back's matcher reads; border[0] = 0). */
static void stop_border_table(const char *stop, size_t L, size_t *border) {
    border[0] = 0;
    for (size_t q = 1, k = 0; q + 1 < L; q++) {
        while (k > 0 && stop[q] != stop[k]) k = border[k - 1];
        if (stop[q] == stop[k]) k++;
        border[q] = k;
    }
}

tl_status tl_session_create_with(const tl_decoder *decoder, const tl_model *m, const int32_t *prompt,
                                 int prompt_len, const tl_generate_config *cfg, tl_session **out) {
    double t_start = tl_now_ms();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_new: out must not be NULL");
    *out = NULL;
    tl_generate_config defaults;
    tl_generate_config_init(&defaults);
    if (!cfg) cfg = &defaults;
    tl_status st = tl_generate_validate(m, prompt, prompt_len, cfg);
    if (st != TL_OK) return st;

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
    s->decoder = decoder ? decoder
               : cfg->beam_size >= 2 ? &tl_beam_decoder
               : cfg->speculative != TL_SPECULATIVE_OFF ? &tl_speculative_decoder
                                                        : &tl_plain_decoder;
    tl_rng_seed(&s->rng, cfg->sample_seed);
    /* A model that starts the loop from a random state (Huginn) draws it per token from a
       seed of the generation config, so that a seed reproduces a generation: never 0,
       which means a zero state. fixed_state_seed: sample_seed 0's, whatever the sampling's. */
    if (m->cfg.state_init == TL_STATE_TRUNCATED_NORMAL) {
        tl_rng seeded;
        tl_rng_seed(&seeded, (cfg->fixed_state_seed ? 0 : cfg->sample_seed) ^ 0x5354415445ull); /* "STATE" */
        s->ws.state_seed = tl_rng_next(&seeded) | 1u;
    }

    int stop_total = 0;
    for (int i = 0; i < cfg->n_stop_sequences; i++) stop_total += cfg->stop_sequences[i].n;
    s->stop_seqs = calloc((size_t)cfg->n_stop_sequences + 1, sizeof *s->stop_seqs);
    s->stop_store = malloc(((size_t)stop_total + 1) * sizeof *s->stop_store);
    s->tokens = malloc((size_t)total * sizeof *s->tokens);
    s->positions = malloc((size_t)total * sizeof *s->positions);
    s->logits = calloc((size_t)vocab, sizeof *s->logits); /* speculative and beam modes never write it; forks copy it */
    s->work = tl_session_hook_buffer_new((size_t)vocab * sizeof *s->work);
    s->tally = calloc((size_t)vocab, sizeof *s->tally);
    s->logit_bias = malloc(((size_t)cfg->n_logit_bias + 1) * sizeof *s->logit_bias);
    s->allowed = tl_session_hook_buffer_new((size_t)vocab);
    s->stop_strs = calloc((size_t)cfg->n_stop_strings + 1, sizeof *s->stop_strs);
    s->stop_lens = calloc((size_t)cfg->n_stop_strings + 1, sizeof *s->stop_lens);
    st = (s->stop_seqs && s->stop_store && s->tokens && s->positions && s->logits && s->work &&
          s->tally && s->logit_bias && s->allowed && s->stop_strs && s->stop_lens)
             ? tl_distribution_init(&s->dist, vocab)
             : tl_fail(TL_ERR_NO_MEMORY, "out of memory for a session of %d tokens", total);
    for (int i = 0; st == TL_OK && i < cfg->n_stop_strings; i++) {
        s->stop_lens[i] = strlen(cfg->stop_strings[i]);
        if (!(s->stop_strs[i] = strdup(cfg->stop_strings[i]))) st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    }
    const size_t borders_len = st == TL_OK ? tl_session_borders_len(s) : 0; /* (stop_lens made) */
    if (borders_len > 0) {
        if (!(s->stop_borders = malloc(borders_len * sizeof *s->stop_borders))) st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        for (size_t i = 0, at = 0; st == TL_OK && i < (size_t)cfg->n_stop_strings; at += s->stop_lens[i++])
            stop_border_table(s->stop_strs[i], s->stop_lens[i], s->stop_borders + at);
    }
    s->cfg.stop_strings = (const char *const *)s->stop_strs;
    /* A windowed cache holds window + chunk rows: small windows take small chunks so that
       memory stays within twice the window. */
    s->chunk = cfg->cache_window > 0 && cfg->cache_window < TL_FORWARD_CHUNK ? cfg->cache_window : TL_FORWARD_CHUNK;
    if (st == TL_OK) {
        memcpy(s->tokens, prompt, (size_t)prompt_len * sizeof *s->tokens);
        for (int i = 0; i < total; i++) s->positions[i] = i;
        st = s->decoder->open(s);
    }
    if (st != TL_OK) {
        session_destroy(s);
        return st;
    }
    for (int i = 0, at = 0; i < cfg->n_stop_sequences; i++) {
        const tl_token_seq *src = &cfg->stop_sequences[i];
        memcpy(s->stop_store + at, src->tokens, (size_t)src->n * sizeof(int32_t));
        s->stop_seqs[i] = (tl_token_seq){s->stop_store + at, src->n};
        at += src->n;
    }
    s->cfg.stop_sequences = s->stop_seqs;
    if (cfg->n_logit_bias > 0) memcpy(s->logit_bias, cfg->logit_bias, (size_t)cfg->n_logit_bias * sizeof *s->logit_bias);
    s->cfg.logit_bias = s->logit_bias;
    s->forced_token = -1;
    tl_session_own_reasoning_tags(s, cfg);
    s->reasoning_inside = cfg->reasoning_budget > 0 && cfg->reasoning_open;
    s->reasoning_forced = -1;
    if (cfg->grammar && (st = tl_session_set_grammar(s, cfg->grammar)) != TL_OK) {
        session_destroy(s);
        return st;
    }
    *out = s;
    return TL_OK;
}

tl_status tl_session_set_grammar(tl_session *s, const tl_grammar *g) {
    s->grammar = *g;
    s->cfg.grammar = &s->grammar;
    if (!g->compiled) return TL_OK;
    /* ---- grammar: a compiled grammar gets this session's own matcher */
    tl_status st = tl_gram_matcher_new(g->compiled, s->m->tokenizer, s->m->cfg.vocab_size, s->m->cfg.eos_token_id,
                                    &s->grammar_matcher);
    if (st != TL_OK) return st;
    /* a one-token stop sequence of a special token (a chat turn's end) ends the text where
       the grammar may end, as eos does: no grammar writes it */
    tl_gram_matcher_set_ends(s->grammar_matcher, s->cfg.stop_sequences, s->cfg.n_stop_sequences);
    tl_gram_matcher_as_grammar(s->grammar_matcher, &s->grammar);
    return st;
}

const int32_t *tl_session_tokens(const tl_session *s, int *n) {
    if (n) *n = s ? s->n_tokens : 0;
    return s ? s->tokens : NULL;
}

const tl_generate_stats *tl_session_stats(const tl_session *s) { return s ? &s->stats : NULL; }

int64_t tl_session_max_kv_bytes(const tl_session *s) { return s && s->cache ? (int64_t)tl_kv_cache_max_bytes(s->cache) : 0; }

/* ---------------------------------------------------------------- shared by the decoders */

/* Offers the cache's rows that hold the sequence so far (at most n) to the model's prefix
   pool. Every decoder's rows on the sequence are at its full depth what a prefill of the same
   text computes (batch invariance; the verifier's rows of speculative decoding are plain
   decoding's bit for bit): they serve a request that resends this text, a chat's next turn.
   The pool takes the rows up to the first shallower one (an early exit's, here or in the
   session this one was forked or resumed from); rows read from saved bytes are never
   offered. */
static void offer_rows(const tl_session *s, int n) {
    if (!s->m->prefix_pool || s->rows_from_bytes) return;
    const int rows = s->decoder->sequence_rows ? s->decoder->sequence_rows(s) : s->cache->length;
    tl_prefix_pool_offer(s->m->prefix_pool, s->tokens, rows < n ? rows : n, s->loops, s->ws.state_seed, s->cache);
}

void tl_session_take_prefix(tl_session *s) {
    if (s->m->prefix_pool)
        s->stats.prompt_tokens_reused =
            tl_prefix_pool_take(s->m->prefix_pool, s->tokens, s->prompt_len - 1, s->loops, s->ws.state_seed, s->cache);
}

/* The prompt's rows its prefill computes: all of a plain session's; all but the last of a
   speculative or beam session's, whose first step takes that token (the root of its drafts or
   beams). */
static int prefill_rows(const tl_session *s) {
    return s->prompt_len - (s->decoder == &tl_plain_decoder ? 0 : 1);
}

/* Whether s has not begun its prefill and every row its cache holds came from the pool at its
   open (so that it may let them go for a longer prefix), with tokens to generate. */
static bool prefill_not_begun(const tl_session *s) {
    return s->m->prefix_pool && s->cache && s->cache->length == s->stats.prompt_tokens_reused && s->t_prefill_start <= 0 &&
           !s->prompt_done && !s->rows_from_bytes && s->cfg.max_tokens > 0;
}

/* The prompt rows a session may take from the pool: all but the last, with a window those
   before it (tl_prefix_pool_take's rule). */
static int takeable_rows(const tl_session *s) { return tl_kv_unwindowed_rows(s->cache, s->prompt_len - 1); }

int tl_session_prefix_reach(const tl_session *s) {
    if (!prefill_not_begun(s)) return -1;
    const int offered = tl_prefix_pool_longest(s->m->prefix_pool, s->tokens, takeable_rows(s), s->loops, s->ws.state_seed);
    return offered > s->cache->length ? offered : s->cache->length;
}

void tl_session_take_prefix_late(tl_session *s) {
    if (tl_session_prefix_reach(s) <= s->cache->length) return; /* (-1: not such a session) */
    tl_kv_cache_empty(s->cache); /* (pages of the pool's only: let go, then the longer prefix shared) */
    tl_session_take_prefix(s);
}

int tl_session_prompt_rows_shared(const tl_session *waiting, const tl_session *running) {
    if (waiting->m != running->m || running->prompt_done || running->rows_from_bytes ||
        waiting->loops != running->loops || waiting->ws.state_seed != running->ws.state_seed)
        return 0;
    /* (running offers its prefill's rows as its prompt is done: with a window, those before it,
       while its ring still holds them, which a prefill past the ring's capacity wrote over) */
    const int prefilled = prefill_rows(running);
    if (running->cache->window > 0 && prefilled > running->cache->capacity) return 0;
    return tl_prefix_pool_common(waiting->tokens, takeable_rows(waiting), running->tokens,
                                 tl_kv_unwindowed_rows(running->cache, prefilled));
}

/* The prompt's rows are in the cache: time the prefill, and offer them to the prefix pool.
   (prefill_tokens: the rows added since the clock started, all the prompt's but the pool's,
   or all but the last for the decoders whose first step takes it; a state read mid-prompt
   counts the rows forwarded after it.) */
static void prompt_done(tl_session *s) {
    s->prompt_done = true;
    s->t_prefill_end = tl_now_ms();
    s->stats.prefill_ms = s->t_prefill_end - (s->t_prefill_start > 0 ? s->t_prefill_start : s->t_start);
    s->stats.prefill_tokens = s->cache->length - s->prefill_first_row;
    offer_rows(s, s->prompt_len);
}

/* The prefill's clock starts at its first row: a session that waited (in an engine's queue,
   or for its caller's first step) had the wait counted as its prefill. */
static void prefill_begins(tl_session *s) {
    if (s->t_prefill_start <= 0) {
        s->t_prefill_start = tl_now_ms();
        s->prefill_first_row = s->cache->length;
    }
}

tl_status tl_session_prefill(tl_session *s, int n, float *last_logits) {
    prefill_begins(s);
    const int start = s->cache->length;
    tl_status st = tl_forward_sequence(s->m, s->cache, &s->ws, s->tokens + start, s->positions + start, n - start,
                                       s->chunk, s->loops, last_logits);
    if (st != TL_OK) return st;
    prompt_done(s);
    return TL_OK;
}

tl_status tl_session_hook_failed(tl_session *s, const char *hook, int code) {
    s->finished = true;
    return tl_fail(TL_ERR_HOOK, "%s hook returned error %d", hook, code);
}

tl_status tl_session_prepare_logits_for(tl_session *s, const float *row, const int32_t *history, int n) {
    const tl_generate_config *c = &s->cfg;
    const int vocab = s->m->cfg.vocab_size;
    /* (the model's row, before the hooks: a hook's own NaN is its choice, banned) */
    tl_status st = tl_check_logits_finite(row, vocab, s->m->kv_type == TL_KV_F16, "token", s->n_tokens - s->prompt_len + 1);
    if (st != TL_OK) {
        s->finished = true;
        return st;
    }
    if (row != s->work) memcpy(s->work, row, (size_t)vocab * sizeof(float));
    if (c->logits_processor) {
        int r = c->logits_processor(c->logits_processor_user, s->work, vocab, history, n);
        int outside;
        if (hook_guard_breached(s->work, vocab, sizeof *s->work, &outside)) {
            s->finished = true;
            return tl_fail(TL_ERR_HOOK, "logits_processor wrote logits[%d], outside [0, %d): the hook may write "
                           "logits[0] to logits[vocab_size - 1] only, during its call", outside, vocab);
        }
        if (r < 0) return tl_session_hook_failed(s, "logits_processor", r);
    }
    tl_adjust_logits(c, s->work, history, n, s->prompt_len, s->m->cfg.eos_token_id, s->tally);
    s->forced_token = -1;
    if (s->reasoning_forced >= 0) { /* the thinking budget is spent: reasoning_end's next id */
        s->forced_token = c->reasoning_end.tokens[s->reasoning_forced];
        /* a compiled grammar must take it (a callback grammar's advance is told, and may fail) */
        if (s->grammar_matcher) {
            const int32_t next =
                tl_gram_matcher_advance_state(s->grammar_matcher, tl_gram_matcher_state(s->grammar_matcher), s->forced_token);
            if (next < 0 || next == GRAM_DEAD) s->finished = true;
            if (next < 0) return tl_gram_failure("grammar");
            if (next == GRAM_DEAD)
                return tl_fail(TL_ERR_UNSUPPORTED, "the thinking budget is spent, and the grammar does not allow "
                               "reasoning_end's id %d there (a grammar must let the reasoning block end: "
                               "tl_grammar_compile_after_block)", s->forced_token);
        }
        return TL_OK;
    }
    if (c->grammar) {
        /* ---- grammar: greedy decoding checks its argmax first; when the grammar accepts it,
           the masked argmax is the same token (ties go to the lowest id either way), so the
           full mask is skipped. Beam search masks each hypothesis with its own state
           (beam.c), not the session's. */
        if (s->grammar_matcher && s->cfg.beam_size >= 2) return TL_OK;
        if (s->grammar_matcher && s->greedy) {
            const int32_t top = tl_argmax(s->work, vocab);
            const int32_t next = top >= 0 ? tl_gram_matcher_advance_state(s->grammar_matcher,
                                                                        tl_gram_matcher_state(s->grammar_matcher), top)
                                          : GRAM_DEAD;
            if (next < 0) return tl_gram_failure("grammar");
            if (next != GRAM_DEAD) return TL_OK;
        }
        memset(s->allowed, 0, (size_t)vocab);
        int n_allowed = c->grammar->allowed(c->grammar->user, s->allowed, vocab);
        int outside;
        if (hook_guard_breached(s->allowed, vocab, 1, &outside)) {
            s->finished = true;
            return tl_fail(TL_ERR_HOOK, "grammar allowed wrote mask[%d], outside [0, %d): the hook may write mask[0] to "
                           "mask[vocab_size - 1] only, during its call", outside, vocab);
        }
        if (n_allowed < 0 && s->grammar_matcher) { /* a compiled grammar's own error */
            s->finished = true;
            return tl_gram_failure("grammar mask");
        }
        if (n_allowed < 0) return tl_session_hook_failed(s, "grammar allowed", n_allowed);
        int32_t only = -1;
        int in_mask = 0;
        for (int i = 0; i < vocab; i++) {
            if (!s->allowed[i]) s->work[i] = -INFINITY;
            else only = i, in_mask++;
        }
        /* the count is the mask's (tinyloop.h): a callback whose count disagrees broke its
           contract (a count of 0 over a mask of tokens went on sampling them, a count of 1
           over several forced the last) */
        if (n_allowed != in_mask && !s->grammar_matcher) {
            tl_session_hook_failed(s, "grammar allowed", n_allowed); /* (finishes the session; the message says more) */
            return tl_fail(TL_ERR_HOOK, "grammar allowed hook returned %d for a mask of %d allowed tokens (the count must be "
                                        "the mask's)", n_allowed, in_mask);
        }
        /* one allowed token: no need to sample (unless a hook banned it: then nothing is left) */
        if (in_mask == 1 && s->work[only] > -INFINITY) s->forced_token = only;
    }
    return TL_OK;
}

int32_t tl_session_choose(tl_session *s) {
    const tl_generate_config *c = &s->cfg;
    if (s->forced_token >= 0) return s->forced_token; /* the grammar allowed one token */
    if (s->greedy) return tl_argmax(s->work, s->m->cfg.vocab_size);
    return tl_distribution_build(&s->dist, s->work, c->temperature, c->top_k, c->top_p, c->min_p, c->temperature_last)
               ? tl_distribution_draw(&s->dist, &s->rng)
               : -1;
}

/* ---------------------------------------------------------------- the thinking budget */

/* The bytes of tag's ids into out[256] -> their length; 0 when they cannot be matched as text
   (no tokenizer, a special token among them: its text is not in the generated text, or more
   than 256 bytes). */
static size_t tag_bytes(const tl_session *s, const tl_token_seq *tag, char *out) {
    size_t len = 0;
    if (!s->m->tokenizer) return 0;
    for (int i = 0; i < tag->n; i++) {
        const char *bytes;
        size_t n;
        if (tl_tlz_is_special(s->m->tokenizer, tag->tokens[i]) ||
            tl_tlz_token_bytes(s->m->tokenizer, tag->tokens[i], &bytes, &n) != 0 || len + n > 256)
            return 0;
        memcpy(out + len, bytes, n);
        len += n;
    }
    return len;
}

void tl_session_own_reasoning_tags(tl_session *s, const tl_generate_config *from) {
    const tl_token_seq *tags[2] = {&from->reasoning_start, &from->reasoning_end};
    tl_token_seq *own[2] = {&s->cfg.reasoning_start, &s->cfg.reasoning_end};
    for (int t = 0; t < 2; t++) {
        const int n = from->reasoning_budget > 0 ? tags[t]->n : 0; /* (validated: <= TL_MAX_REASONING_TAG) */
        if (n > 0 && tags[t]->tokens != s->reasoning_ids[t])
            memcpy(s->reasoning_ids[t], tags[t]->tokens, (size_t)n * sizeof(int32_t));
        *own[t] = (tl_token_seq){n > 0 ? s->reasoning_ids[t] : NULL, n};
        s->reasoning_tag_len[t] = n > 0 ? tag_bytes(s, own[t], s->reasoning_tag_bytes[t]) : 0;
    }
}

/* Whether tag t (0 start, 1 end) has just been written: the generated ids end with its ids
   (whole within them), or the text holds its bytes ending in the last token's bytes (`old`:
   the text's length before them), however the model's ids spelled them. */
static bool tag_written(const tl_session *s, int t, size_t old) {
    const tl_token_seq *tag = t ? &s->cfg.reasoning_end : &s->cfg.reasoning_start;
    const int n = s->n_tokens;
    if (tag->n >= 1 && n - s->prompt_len >= tag->n &&
        memcmp(s->tokens + n - tag->n, tag->tokens, (size_t)tag->n * sizeof(int32_t)) == 0)
        return true;
    return tl_session_text_ends_in_new(s, s->reasoning_tag_bytes[t], s->reasoning_tag_len[t], old);
}

void tl_session_track_reasoning(tl_session *s, size_t old_text_len) {
    const tl_generate_config *c = &s->cfg;
    if (c->reasoning_budget <= 0) return;
    if (s->reasoning_forced >= 0) { /* a forced id went out: the block closes with the last */
        if (++s->reasoning_forced == c->reasoning_end.n) s->reasoning_forced = -1, s->reasoning_inside = false;
        return;
    }
    if (!s->reasoning_inside) {
        if (tag_written(s, 0, old_text_len)) s->reasoning_inside = true, s->reasoning_tokens = 0;
        return;
    }
    if (tag_written(s, 1, old_text_len)) {
        s->reasoning_inside = false;
        return;
    }
    if (++s->reasoning_tokens < c->reasoning_budget) return;
    /* spent: the end's ids are forced, from where the block's last tokens already began it
       (a tag of several ids the model was writing), so that the end is written once */
    const tl_token_seq *end = &c->reasoning_end;
    int begun = end->n - 1;
    if (begun > s->reasoning_tokens) begun = s->reasoning_tokens;
    for (; begun > 0; begun--)
        if (memcmp(s->tokens + s->n_tokens - begun, end->tokens, (size_t)begun * sizeof(int32_t)) == 0) break;
    s->reasoning_forced = begun;
}

/* ---------------------------------------------------------------- plain decoding */

/* The cache, holding the longest prefix of the prompt the prefix pool has at this depth. */
static tl_status plain_open(tl_session *s) {
    tl_status st = tl_session_cache_new(s, 0);
    if (st == TL_OK) tl_session_take_prefix(s);
    return st;
}

/* Brings the cache up to date with every token, then chooses from the next-token logits. */
static tl_status plain_next(tl_session *s, int32_t *token) {
    tl_kv_cache *c = s->cache;
    tl_status st;
    if (!s->prompt_done) {
        st = tl_session_prefill(s, s->n_tokens, s->logits);
        s->last_depth = s->loops;
    } else if (tl_early_exit_on(&s->cfg) && c->length + 1 == s->n_tokens) {
        st = tl_session_forward_adaptive(s, c->length);
    } else {
        const int start = c->length;
        st = tl_forward_sequence(s->m, c, &s->ws, s->tokens + start, s->positions + start,
                                 s->n_tokens - start, s->chunk, s->loops, s->logits);
        s->last_depth = s->loops;
    }
    if (st != TL_OK) return st;
    if ((st = tl_session_prepare_logits(s, s->logits)) != TL_OK) return st;
    *token = tl_session_choose(s);
    s->chosen_row = s->logits;
    return TL_OK;
}

const tl_decoder tl_plain_decoder = {"plain", plain_open, plain_next, NULL, NULL, NULL};

/* ---------------------------------------------------------------- emission */

static tl_status finish(tl_session *s, tl_stop_reason reason, tl_stop_reason *stop) {
    s->finished = true;
    if (s->prompt_done) offer_rows(s, s->n_tokens); /* the generated rows too */
    s->stats.stop_reason = reason;
    *stop = reason;
    return TL_OK;
}

/* tl_token_in_text under a config known valid (a session's: checked when it was made; this
   is its per-token path). */
static bool token_in_text(const tl_model *m, const tl_generate_config *c, int32_t tok) {
    if (!m->tokenizer || tok < 0 || tok >= m->cfg.vocab_size) return false;
    if (!tl_tlz_is_special(m->tokenizer, tok)) return true;
    return c && c->keep_special_text && !tl_is_end(c, m->cfg.eos_token_id, tok);
}

int tl_token_in_text(const tl_model *m, const tl_generate_config *c, int32_t tok) {
    if (!m) return 0;
    /* (the caller's config is not validated elsewhere, and there is no status to say so: one
       tl_session_new refuses is read as keeping nothing; a stop sequence without its tokens
       was read through NULL) */
    return token_in_text(m, c && tl_text_fields_valid(c, m->cfg.vocab_size) ? c : NULL, tok);
}

const tl_generate_config *tl_session_config(const tl_session *s) {
    return s ? &s->cfg : NULL;
}

/* Appends the token's bytes to the generated text; true when a stop string now ends
   inside them (a match may start in earlier tokens' text). */
tl_status tl_session_append_text(tl_session *s, int32_t tok, bool *matched) {
    *matched = false;
    /* Special tokens (end of text...) are control, not text: shown only where the config
       keeps their text, and never the one that ends generation. */
    if (!token_in_text(s->m, &s->cfg, tok)) return TL_OK;
    const char *bytes;
    size_t len;
    if (tl_tlz_token_bytes(s->m->tokenizer, tok, &bytes, &len) != 0) len = 0; /* id without text */
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
    /* min_tokens (vLLM's rule): stop strings are checked once more than min_tokens tokens
       came, a match ending in a later token's text (one the first min_tokens tokens ended is
       never seen; one may start in their text) */
    if (s->n_tokens - s->prompt_len <= s->cfg.min_tokens) return TL_OK;
    for (int i = 0; i < s->cfg.n_stop_strings; i++)
        if (tl_session_text_ends_in_new(s, s->stop_strs[i], s->stop_lens[i], old)) { *matched = true; return TL_OK; }
    return TL_OK;
}

bool tl_session_text_ends_in_new(const tl_session *s, const char *bytes, size_t len, size_t old) {
    if (len == 0 || s->text_len == old) return false;
    for (size_t at = old + 1 > len ? old + 1 - len : 0; at + len <= s->text_len; at++) /* the match ends in the new bytes */
        if (memcmp(s->text + at, bytes, len) == 0) return true;
    return false;
}

tl_stop_reason tl_session_rule_stop(const tl_session *s, int n, bool stop_string) {
    const tl_generate_config *c = &s->cfg;
    if (s->tokens[n - 1] == s->m->cfg.eos_token_id && !c->ignore_eos) return TL_STOP_EOS;
    /* min_tokens: longer stop sequences end the min_tokens-th new token at the earliest, stop
       strings the next (tl_session_append_text matches none before); a one-token sequence's
       token ends whenever it comes, as eos (sampler.h) */
    if (tl_stop_sequences_match(s->tokens, n, s->prompt_len, c->stop_sequences, c->n_stop_sequences,
                                tl_stop_longest(c, n, s->prompt_len)) ||
        stop_string)
        return TL_STOP_SEQUENCE;
    return TL_STOP_NONE;
}

tl_status tl_session_emit(tl_session *s, int32_t tok, tl_stop_reason *stop) {
    const tl_generate_config *c = &s->cfg;
    tl_status st;
    *stop = TL_STOP_NONE;
    if (tok < 0) return finish(s, TL_STOP_GRAMMAR_DEAD_END, stop);
    if (c->grammar) {
        int r = c->grammar->advance(c->grammar->user, tok);
        if (r < 0) return tl_session_hook_failed(s, "grammar advance", r);
    }

    /* Append and account. */
    const int position = s->n_tokens;
    s->tokens[s->n_tokens++] = tok;
    const int emitted = s->n_tokens - s->prompt_len;
    tl_stats_count_token(&s->stats, emitted, s->last_depth > 0 ? s->last_depth : s->loops, &s->loops_sum,
                         s->t_start, s->t_prefill_end, tl_now_ms());

    bool stop_string = false;
    const size_t old_text_len = s->text_len;
    if ((st = tl_session_append_text(s, tok, &stop_string)) != TL_OK) { s->finished = true; return st; }
    tl_session_track_reasoning(s, old_text_len);

    /* Observers see every token, the last one included. */
    bool observer_stop = false;
    if (c->on_token) {
        int r = c->on_token(c->on_token_user, tok, position);
        if (r < 0) return tl_session_hook_failed(s, "on_token", r);
        observer_stop = r == TL_HOOK_STOP;
    }
    if (s->stream_fn && !s->stream_fn(s->stream_user, tok, position)) observer_stop = true;

    /* Stop checks, in order of precedence. */
    const tl_stop_reason rule = tl_session_rule_stop(s, s->n_tokens, stop_string);
    if (rule != TL_STOP_NONE) return finish(s, rule, stop);
    if (c->stop_rule) {
        int r = c->stop_rule(c->stop_rule_user, s->tokens, s->n_tokens);
        if (r < 0) return tl_session_hook_failed(s, "stop_rule", r);
        if (r == TL_HOOK_STOP) return finish(s, TL_STOP_CALLBACK_ABORT, stop);
    }
    if (observer_stop) return finish(s, TL_STOP_CALLBACK_ABORT, stop);
    if (emitted >= c->max_tokens) return finish(s, TL_STOP_MAX_TOKENS, stop);
    return TL_OK;
}

/* ---------------------------------------------------------------- the step */

static tl_status step(tl_session *s, int32_t *token, tl_stop_reason *stop) {
    s->chosen_row = NULL; /* each decoder sets its own */
    if (s->cfg.max_tokens == 0) return finish(s, TL_STOP_MAX_TOKENS, stop);
    int32_t tok = -1;
    tl_status st = s->decoder->next(s, &tok);
    if (st != TL_OK) {
        s->finished = true;
        return st;
    }
    if (tok < 0) s->chosen_row = NULL; /* before the emission's hooks, which may ask (tl_session_logprobs from on_token) */
    if ((st = tl_session_emit(s, tok, stop)) != TL_OK) return st;
    if (tok >= 0) *token = tok;
    return TL_OK;
}

/* The message of the session's failed step, for tl_session_error (the thread's last error
   is shared by every session a batch steps). */
static void keep_error(tl_session *s, const char *message) {
    /* (a longer message is cut: the precision says so, where "%s" made -Wformat-truncation
       warn under optimisation) */
    snprintf(s->error, sizeof s->error, "%.*s", (int)sizeof s->error - 1, message);
}

const char *tl_session_error(const tl_session *s) { return s ? s->error : ""; }

tl_status tl_session_logprobs(tl_session *s, int top, float *logprob, int32_t *top_ids, float *top_logprobs) {
    tl_clear_error();
    if (!s || !logprob) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs: session and logprob must not be NULL");
    tl_status st = tl_check_top_logprobs("tl_session_logprobs", top, top_ids, top_logprobs);
    if (st != TL_OK) return st;
    if (!tl_session_keeps_rows(s))
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "tl_session_logprobs: a %s session chooses its tokens from rows it does not keep (plain or "
                       "speculative decoding only)",
                       s->decoder->name);
    if (!s->chosen_row && s->stepping)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "tl_session_logprobs: the session is stepping and has not emitted this step's token yet (%s; ask "
                       "from its on_token hook or after the step)",
                       TL_STEPPING_WHERE);
    if (!s->chosen_row) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs: the last step emitted no token");
    const int vocab = s->m->cfg.vocab_size;
    if (!s->logprob_scratch && !(s->logprob_scratch = malloc((size_t)vocab * sizeof *s->logprob_scratch)))
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    tl_row_logprobs(s->chosen_row, vocab, s->tokens[s->n_tokens - 1], top, s->logprob_scratch, logprob, top_ids,
                    top_logprobs);
    return TL_OK;
}

const char *tl_session_batch_refusal(const tl_session *s, const tl_model *m) {
    if (s->m != m) return "on another model";
    if (s->finished) return "finished";
    if (s->stepping) return "stepping";
    return NULL;
}

tl_status tl_session_step(tl_session *s, int32_t *token, tl_stop_reason *stop) {
    tl_clear_error();
    if (!s) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_step: session must not be NULL");
    if (!token || !stop) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_step: token and stop must not be NULL");
    *token = -1;
    *stop = TL_STOP_NONE;
    if (s->stepping)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "tl_session_step: the session is already stepping (%s)", TL_STEPPING_WHERE);
    if (s->finished)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "session has already finished (stop reason %s)",
                       tl_stop_reason_name(s->stats.stop_reason));
    s->stepping = true;
    tl_status st = step(s, token, stop);
    s->stepping = false;
    if (st != TL_OK) keep_error(s, tl_last_error());
    if (s->free_requested && !atomic_load(&s->engine_claimed)) session_destroy(s);
    if (st == TL_OK) tl_clear_error(); /* a hook's failed call is not this step's error */
    return st;
}

/* ---------------------------------------------------------------- many sessions */

/* Whether a session's next step is one plain forward that can share a batched forward.
   Speculative and beam steps have forwards of their own shapes (drafts, trees, beams), and
   early exit decides each token's depth between loops: those sessions are stepped on their
   own inside the batch call, except an early exit's prompt, which is a plain prefill at full
   depth (plain_next) and so shares the pass, and its chunks. */
static bool shares_forward(const tl_session *s) {
    return s->decoder == &tl_plain_decoder && s->cfg.max_tokens > 0 && (!tl_early_exit_on(&s->cfg) || !s->prompt_done);
}

/* The cache length a session's rows in the shared pass bring it to: every token for one that
   shares its forward; for a speculative or beam session whose prompt is not in yet, the
   prompt but its last token, which its decoder prefills first (plain rows at full depth,
   tl_session_prefill) before a forward of its own shape (the last token is the root of its
   drafts or beams), so that its prompt shares the pass and its chunks too; else -1. */
static int shared_goal(const tl_session *s) {
    if (shares_forward(s)) return s->n_tokens;
    if (s->decoder != &tl_plain_decoder && s->cfg.max_tokens > 0 && !s->prompt_done && s->cache->length < prefill_rows(s))
        return prefill_rows(s);
    return -1;
}

/* One session's share of a batched pass. */
typedef struct batch_entry {
    tl_session *session;
    int order;             /* its index in the call (ties of the depth sort) */
    int take;              /* how many of its pending rows go in this pass */
    bool last;             /* the pass holds its last pending row: its logits come back */
} batch_entry;

/* Deepest first (rows of shallower sessions stop looping early), then the call's order. */
static int by_depth(const void *a, const void *b) {
    const batch_entry *x = a, *y = b;
    if (x->session->loops != y->session->loops) return y->session->loops - x->session->loops;
    return x->order - y->order; /* never equal: a total order, so qsort is deterministic */
}

/* Forwards the pending rows of the sessions up to their goals (shared_goal: prompt chunks of
   new ones, the last token of running ones) in passes of at most TL_FORWARD_CHUNK rows, each
   session's cache its own, leaving the next-token logits in s->logits of each session whose
   goal is its every token and whose rows are all in its cache afterwards. prompt_rows > 0
   caps the rows of prompts not yet done, shared out in the group's order (a running
   session's row always goes in): a prompt the cap cuts keeps the rest for a later call, and
   gets no logits. */
static tl_status forward_together(tl_session **group, const int *goals, int n, int prompt_rows) {
    const tl_model *m = group[0]->m;
    const int vocab = m->cfg.vocab_size;
    tl_status st = TL_OK;
    batch_entry *entries = malloc((size_t)n * sizeof *entries);
    tl_forward_part *parts = malloc((size_t)n * sizeof *parts);
    bool *want = malloc((size_t)n * sizeof *want);
    int32_t *tokens = malloc(TL_FORWARD_CHUNK * sizeof *tokens), *positions = malloc(TL_FORWARD_CHUNK * sizeof *positions);
    float *logits = malloc((size_t)n * (size_t)vocab * sizeof *logits);
    int *target = malloc((size_t)n * sizeof *target); /* the cache length each session ends this call at */
    if (!entries || !parts || !want || !tokens || !positions || !logits || !target)
        st = tl_fail(TL_ERR_NO_MEMORY, "tl_session_step_batch: out of memory for %d sessions", n);
    for (int i = 0, prompt_left = prompt_rows; st == TL_OK && i < n; i++) {
        const tl_session *s = group[i];
        int take = goals[i] - s->cache->length;
        if (prompt_rows > 0 && !s->prompt_done) {
            if (take > prompt_left) take = prompt_left;
            prompt_left -= take;
        }
        if (!s->prompt_done && take > 0) prefill_begins(group[i]);
        group[i]->batch_prompt_rows = s->prompt_done ? 0 : take;
        target[i] = s->cache->length + take;
    }
    for (;;) {
        if (st != TL_OK) break;
        /* Fill one pass in the call's order: each session takes what fits of its rows left. */
        int k = 0, rows = 0;
        for (int i = 0; i < n && rows < TL_FORWARD_CHUNK; i++) {
            tl_session *s = group[i];
            const int left = target[i] - s->cache->length;
            if (left <= 0) continue;
            int take = left < s->chunk ? left : s->chunk;
            if (take > TL_FORWARD_CHUNK - rows) take = TL_FORWARD_CHUNK - rows;
            entries[k++] = (batch_entry){s, i, take, s->cache->length + take == goals[i] && goals[i] == s->n_tokens};
            rows += take;
        }
        if (k == 0) break;
        qsort(entries, (size_t)k, sizeof *entries, by_depth);
        rows = 0;
        for (int e = 0; e < k; e++) {
            tl_session *s = entries[e].session;
            const int from = s->cache->length;
            memcpy(tokens + rows, s->tokens + from, (size_t)entries[e].take * sizeof *tokens);
            memcpy(positions + rows, s->positions + from, (size_t)entries[e].take * sizeof *positions);
            parts[e] = (tl_forward_part){s->cache, NULL, from, rows, entries[e].take, 0, s->loops, s->ws.state_seed};
            want[e] = entries[e].last;
            rows += entries[e].take;
        }
        st = tl_forward_batch(m, &group[0]->ws, parts, k, tokens, positions, want, logits);
        for (int e = 0, row = 0; st == TL_OK && e < k; e++) {
            if (!want[e]) continue;
            memcpy(entries[e].session->logits, logits + (size_t)row++ * (size_t)vocab, (size_t)vocab * sizeof(float));
        }
    }
    free(entries);
    free(parts);
    free(want);
    free(tokens);
    free(positions);
    free(logits);
    free(target);
    return st;
}

/* After its share of the batched forward: choose and emit, as plain_next + step would. */
static tl_status finish_shared_step(tl_session *s, bool was_prefill, int32_t *token, tl_stop_reason *stop) {
    s->last_depth = s->loops;
    if (was_prefill) prompt_done(s);
    tl_status st = tl_session_prepare_logits(s, s->logits);
    if (st != TL_OK) return st;
    const int32_t tok = tl_session_choose(s);
    s->chosen_row = tok >= 0 ? s->logits : NULL;
    if ((st = tl_session_emit(s, tok, stop)) != TL_OK) return st;
    if (tok >= 0) *token = tok;
    return TL_OK;
}

void tl_step_batch_options_init(tl_step_batch_options *opts) {
    if (!opts) return;
    opts->prompt_rows = 0;
}

tl_status tl_session_step_batch(tl_session *const *sessions, int n, int32_t *tokens, tl_stop_reason *stops,
                                tl_status *statuses) {
    return tl_session_step_batch_with(sessions, n, NULL, tokens, stops, statuses);
}

tl_status tl_session_step_batch_with(tl_session *const *sessions, int n, const tl_step_batch_options *opts,
                                     int32_t *tokens, tl_stop_reason *stops, tl_status *statuses) {
    tl_clear_error();
    if (!sessions || !tokens || !stops || !statuses)
        return tl_fail_null("tl_session_step_batch", 4, "sessions", (const void *)sessions, "tokens", (const void *)tokens,
                            "stops", (const void *)stops, "statuses", (const void *)statuses);
    if (n < 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_step_batch: n = %d, need >= 1", n);
    tl_step_batch_options o;
    tl_step_batch_options_init(&o);
    if (opts) o = *opts;
    if (o.prompt_rows < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_step_batch_with: prompt_rows = %d, need >= 0 (0: no limit)",
                       o.prompt_rows);
    for (int i = 0; i < n; i++) {
        const tl_session *s = sessions[i];
        if (!s) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_step_batch: sessions[%d] is NULL", i);
        const char *refusal = tl_session_batch_refusal(s, sessions[0]->m);
        if (refusal) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_step_batch: sessions[%d] is %s", i, refusal);
        for (int j = 0; j < i; j++)
            if (sessions[j] == s)
                return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_step_batch: sessions[%d] is sessions[%d] again", i, j);
    }
    tl_session **group = malloc((size_t)n * sizeof *group);
    bool *was_prefill = malloc((size_t)n * sizeof *was_prefill);
    if (!group || !was_prefill) {
        free(group);
        free(was_prefill);
        return tl_fail(TL_ERR_NO_MEMORY, "tl_session_step_batch: out of memory");
    }
    /* The sessions whose next forward is a plain one share ONE batched forward. Every
       session of the call is stepping until it ends: a hook's tl_session_free of any of them
       (one stepped before it, or after) is done then, never while the call still reads it. */
    int n_group = 0;
    bool *shares = malloc((size_t)n * sizeof *shares);
    int *goals = malloc((size_t)n * sizeof *goals); /* [n_group]: shared_goal of each */
    if (!shares || !goals) {
        free(group);
        free(was_prefill);
        free(shares);
        free(goals);
        return tl_fail(TL_ERR_NO_MEMORY, "tl_session_step_batch: out of memory");
    }
    for (int i = 0; i < n; i++) {
        tokens[i] = -1;
        stops[i] = TL_STOP_NONE;
        statuses[i] = TL_OK;
        sessions[i]->stepping = true;
        const int goal = shared_goal(sessions[i]);
        shares[i] = goal >= 0;
        if (!shares[i]) continue;
        /* The shared forward pass replaces its logits before any hook runs: its last token's
           row is gone from here on (a hook of an earlier session may ask, tl_session_logprobs). */
        sessions[i]->chosen_row = NULL;
        was_prefill[n_group] = !sessions[i]->prompt_done;
        goals[n_group] = goal;
        group[n_group++] = sessions[i];
    }
    tl_status forward_status = n_group > 0 ? forward_together(group, goals, n_group, o.prompt_rows) : TL_OK;
    char forward_error[TL_ERROR_MAX] = "";
    if (forward_status != TL_OK) snprintf(forward_error, sizeof forward_error, "%s", tl_last_error());
    for (int i = 0, g = 0; i < n; i++) {
        tl_session *s = sessions[i];
        if (!shares[i]) { /* its own step, in its own mode (tl_session_step's, already stepping) */
            statuses[i] = s->finished ? tl_fail(TL_ERR_INVALID_ARGUMENT, "session has already finished (stop reason %s)",
                                                tl_stop_reason_name(s->stats.stop_reason))
                                      : step(s, &tokens[i], &stops[i]);
            if (statuses[i] != TL_OK) keep_error(s, tl_last_error());
            continue;
        }
        s->chosen_row = NULL; /* (as step() does: a failed step leaves no token's row) */
        if (forward_status != TL_OK) {
            s->finished = true;
            statuses[i] = forward_status;
            keep_error(s, forward_error);
        } else if (s->cache->length < goals[g]) {
            /* prompt_rows cut its prompt: the rest goes in a later call, which emits its first token */
        } else if (goals[g] < s->n_tokens) { /* a speculative or beam prompt is in: its own step */
            statuses[i] = step(s, &tokens[i], &stops[i]);
            if (statuses[i] != TL_OK) keep_error(s, tl_last_error());
        } else {
            statuses[i] = finish_shared_step(s, was_prefill[g], &tokens[i], &stops[i]);
            if (statuses[i] != TL_OK) {
                s->finished = true; /* (as step() does: a session that fails is finished) */
                keep_error(s, tl_last_error());
            }
        }
        g++;
    }
    for (int i = 0; i < n; i++) {
        sessions[i]->stepping = false;
        /* (a serving engine's session stays: the engine ends its request and frees it) */
        if (sessions[i]->free_requested && !atomic_load(&sessions[i]->engine_claimed)) session_destroy(sessions[i]);
    }
    free(shares);
    free(goals);
    free(group);
    free(was_prefill);
    if (forward_status != TL_OK) tl_fail(forward_status, "%s", forward_error);
    else tl_clear_error();
    return TL_OK;
}

/* ---------------------------------------------------------------- streamed text */

/* Bytes at the end of the text to hold back: an unfinished UTF-8 sequence, or the longest
   suffix that is a proper prefix of a stop string. That suffix is where the stop string's
   matcher (Knuth-Morris-Pratt's: the string's border table, stop_border_table's, made with
   the session) stands after reading the text's last L - 1 bytes: O(L) a string, where
   comparing each length k with memcmp was O(L^2) (stop strings of 8,000 bytes cost 4.3 ms a
   token). */
static size_t held_back(const tl_session *s) {
    size_t hold = tl_tlz_utf8_unfinished_tail((const unsigned char *)s->text, s->text_len);
    const size_t *border = s->stop_borders;
    for (int i = 0; i < s->cfg.n_stop_strings; border += s->stop_lens[i++]) {
        const char *stop = s->stop_strs[i];
        const size_t L = s->stop_lens[i];
        const size_t window = L - 1 < s->text_len ? L - 1 : s->text_len;
        if (L < 2 || window <= hold) continue;
        /* (matched stays below L: the window is L - 1 bytes) */
        const char *text = s->text + s->text_len - window;
        size_t matched = 0;
        for (size_t j = 0; j < window; j++) {
            while (matched > 0 && text[j] != stop[matched]) matched = border[matched - 1];
            if (text[j] == stop[matched]) matched++;
        }
        if (matched > hold) hold = matched;
    }
    return hold;
}

tl_status tl_session_text(tl_session *s, const char **piece, size_t *len) {
    tl_clear_error();
    if (!s || !piece || !len)
        return tl_fail_null("tl_session_text", 3, "session", (const void *)s, "piece", (const void *)piece, "len", (const void *)len);
    if (!s->m->tokenizer)
        return tl_fail(TL_ERR_UNSUPPORTED, "tl_session_text: the model has no tokenizer.json");
    size_t safe = s->finished ? s->text_len : s->text_len - held_back(s);
    if (safe < s->text_shown) safe = s->text_shown;
    *piece = s->text ? s->text + s->text_shown : "";
    *len = safe - s->text_shown;
    s->text_shown = safe;
    return TL_OK;
}

/* beam.c: deterministic beam search (beam_size >= 2) as a session mode.
 *
 * All live beams advance in ONE batched forward per search step. The beams share one KV
 * cache laid out as a tree: the prompt once, then every beam's tokens appended as they are
 * decoded, and a per-step attention mask lets each beam's row see the prompt and its own
 * ancestors only. Reordering beams therefore copies nothing: a beam that dies leaves
 * unreachable rows behind, a surviving beam keeps pointing at its ancestors' rows. (Memory:
 * prompt + beam_size x max_tokens rows, the price of never copying.)
 *
 * Scoring follows Hugging Face: beams are ranked by their summed log-probability;
 * hypotheses that end (EOS, a stop sequence, or max_tokens) are ranked by
 * sum_logprob / max(1, len)^length_penalty, len = generated tokens, and the best one is
 * returned. Sampling knobs (temperature, top_k, top_p, sample_seed) are ignored; the
 * logits_processor hook and the repetition penalty apply to each beam's own history.
 * Search stops when every beam has ended, or when beam_size hypotheses have ended and no
 * live beam's current score beats the worst of them.
 *
 * A compiled grammar (GBNF, JSON Schema) constrains every hypothesis: each carries its own
 * matcher state (states are immutable ints, so copying a hypothesis copies its grammar
 * state), its row is masked with that state's allowed tokens before the candidates are
 * chosen, and a hypothesis with nothing allowed (GRAMMAR_DEAD_END) is dropped. The session's
 * own matcher advances only over the emitted tokens, a prefix of a hypothesis that followed
 * the grammar. A callback grammar has one state for the whole session and stays refused.
 *
 * Streaming: a token is emitted as soon as every hypothesis that can still be returned (the
 * live beams and the kept ended ones) agrees on it, since the winner is one of them or a
 * descendant of a live beam; the rest of the winner is emitted when the search ends. The
 * session's emission then applies the same stop checks the search applied to hypotheses. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "session.h"
#include "stop.h"

typedef struct hypothesis {
    double logp;           /* sum of log-probabilities of the generated tokens */
    int len;               /* generated tokens */
    int32_t *tokens;       /* [max_tokens] */
    int *rows;             /* [max_tokens] cache row of each generated token once forwarded */
    double score;          /* ranking score of an ended hypothesis */
    int32_t gstate;        /* compiled grammar: the matcher state after the tokens */
} hypothesis;

typedef struct candidate { double score; int beam; int32_t token; } candidate;

typedef struct beam_state {
    int B, T, V;
    hypothesis *live, *next, *ended;  /* [B], [B], [B + 1] */
    int n_live, n_ended;
    int32_t *history;                 /* [prompt_len + T] prompt + one beam's tokens */
    float *logits;                    /* [B][V] */
    double *logprobs;                 /* [V] */
    int32_t *top_ids;                 /* [2B] */
    float *top_values;                /* [2B] */
    int32_t *rows_tokens, *rows_positions; /* [B] */
    uint8_t *mask;                    /* [B][B * (T + 1)] */
    candidate *cands;                 /* [B * 2B] */
} beam_state;

static int by_score(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->beam != y->beam) return x->beam - y->beam;
    return x->token - y->token;
}

/* logp / len^penalty. A penalty far from 0 (any finite one is taken) under- or overflows the
   power: 0 / 0 was a NaN score, which by_score ranks below -inf. A log-probability of 0 (a
   certain hypothesis) stays 0, the best, and -inf stays -inf. */
static double length_score(double logp, int len, float penalty) {
    if (logp == 0 || logp == -INFINITY) return logp;
    return logp / pow(len > 1 ? (double)len : 1.0, (double)penalty);
}

/* ---------------------------------------------------------------- hypotheses */

static void free_hyps(hypothesis *h, int count) {
    for (int i = 0; h && i < count; i++) {
        free(h[i].tokens);
        free(h[i].rows);
    }
    free(h);
}

/* All or nothing: NULL when any allocation fails (test_alloc_fail found a hypothesis whose
   tokens failed while its rows did not, which the caller's check missed). */
static hypothesis *alloc_hyps(int count, int T) {
    hypothesis *h = calloc((size_t)count, sizeof *h);
    for (int i = 0; h && i < count; i++) {
        h[i].tokens = malloc(((size_t)T + 1) * sizeof(int32_t));
        h[i].rows = malloc(((size_t)T + 1) * sizeof(int));
        if (!h[i].tokens || !h[i].rows) {
            free_hyps(h, count);
            return NULL;
        }
    }
    return h;
}

static void copy_hyp(hypothesis *dst, const hypothesis *src) {
    dst->logp = src->logp;
    dst->len = src->len;
    dst->score = src->score;
    dst->gstate = src->gstate;
    memcpy(dst->tokens, src->tokens, (size_t)src->len * sizeof(int32_t));
    memcpy(dst->rows, src->rows, (size_t)src->len * sizeof(int));
}

/* Keeps the best B ended hypotheses, ordered best first (stable: earlier ones win ties). */
static void add_ended(beam_state *b, const hypothesis *h) {
    int at = b->n_ended;
    while (at > 0 && b->ended[at - 1].score < h->score) at--;
    if (at >= b->B) return;
    int last = b->n_ended < b->B ? b->n_ended : b->B - 1;
    hypothesis spare = b->ended[last];
    for (int i = last; i > at; i--) b->ended[i] = b->ended[i - 1];
    b->ended[at] = spare;
    copy_hyp(&b->ended[at], h);
    if (b->n_ended < b->B) b->n_ended++;
}

/* prompt + the beam's tokens, for hooks, the penalty and stop sequences. */
static int history_of(const tl_session *s, beam_state *b, const hypothesis *h) {
    memcpy(b->history + s->prompt_len, h->tokens, (size_t)h->len * sizeof(int32_t));
    return s->prompt_len + h->len;
}

/* ---------------------------------------------------------------- lifetime */

static void beam_close(tl_session *s) {
    beam_state *b = s->mode_state;
    if (!b) return;
    free_hyps(b->live, b->B);
    free_hyps(b->next, b->B);
    free_hyps(b->ended, b->B + 1);
    free(b->history);
    free(b->logits);
    free(b->logprobs);
    free(b->top_ids);
    free(b->top_values);
    free(b->rows_tokens);
    free(b->rows_positions);
    free(b->mask);
    free(b->cands);
    free(b);
    s->mode_state = NULL;
}

/* The mode's state and its buffers, for a session of s's config (no cache). */
static tl_status beam_alloc(tl_session *s) {
    beam_state *b = calloc(1, sizeof *b);
    if (!b) return tl_fail(TL_ERR_NO_MEMORY, "beam search: out of memory");
    s->mode_state = b;
    b->B = s->cfg.beam_size;
    b->T = s->cfg.max_tokens;
    b->V = s->m->cfg.vocab_size;
    const size_t B = (size_t)b->B, T = (size_t)b->T, V = (size_t)b->V;
    b->live = alloc_hyps(b->B, b->T);
    b->next = alloc_hyps(b->B, b->T);
    b->ended = alloc_hyps(b->B + 1, b->T);
    b->history = malloc(((size_t)s->prompt_len + T + 1) * sizeof(int32_t));
    b->logits = malloc(B * V * sizeof(float));
    b->logprobs = malloc(V * sizeof(double));
    b->top_ids = malloc(2 * B * sizeof(int32_t));
    b->top_values = malloc(2 * B * sizeof(float));
    b->rows_tokens = malloc(B * sizeof(int32_t));
    b->rows_positions = malloc(B * sizeof(int32_t));
    b->mask = malloc(B * B * (T + 1) + 1);
    b->cands = malloc(B * 2 * B * sizeof(candidate));
    if (!b->live || !b->next || !b->ended || !b->live[b->B - 1].rows || !b->next[b->B - 1].rows ||
        !b->ended[b->B].rows || !b->history || !b->logits || !b->logprobs || !b->top_ids || !b->top_values ||
        !b->rows_tokens || !b->rows_positions || !b->mask || !b->cands)
        return tl_fail(TL_ERR_NO_MEMORY, "beam search: out of memory");
    return TL_OK;
}

static tl_status beam_open(tl_session *s) {
    tl_status st = beam_alloc(s);
    if (st != TL_OK) return st;
    const beam_state *b = s->mode_state;
    /* The tree-shaped cache: the prompt once, then up to B rows per step. */
    st = tl_kv_cache_new_for(s->m, s->prompt_len + b->B * (b->T + 1), 0, b->B, &s->cache);
    if (st == TL_OK) {
        s->cache->reserve_loops = s->loops; /* pages only for the depth in use */
        tl_session_take_prefix(s);
    }
    return st;
}

/* A fork's (or a saved state's) mode state: the live beams and the kept ended hypotheses
   (their tokens and rows, which the forked cache holds) and the history's prompt, so that the
   copy's search goes on exactly as src's would; the buffers a step fills first are its own. */
static tl_status beam_clone(tl_session *dst, const tl_session *src) {
    /* each hypothesis holds its state in src's compiled grammar: another grammar's tables
       number their states otherwise */
    const void *src_rules = src->grammar_matcher ? (const void *)src->grammar_matcher->g : NULL;
    const void *dst_rules = dst->grammar_matcher ? (const void *)dst->grammar_matcher->g : NULL;
    if (src_rules != dst_rules)
        return tl_fail(TL_ERR_UNSUPPORTED, "a beam search's hypotheses hold their states in the session's compiled "
                                           "grammar: fork it under that same grammar (or none)");
    tl_status st = beam_alloc(dst);
    if (st != TL_OK) return st;
    beam_state *d = dst->mode_state;
    const beam_state *s = src->mode_state;
    d->n_live = s->n_live, d->n_ended = s->n_ended;
    for (int i = 0; i < s->n_live; i++) copy_hyp(&d->live[i], &s->live[i]);
    for (int i = 0; i < s->n_ended; i++) copy_hyp(&d->ended[i], &s->ended[i]);
    memcpy(d->history, s->history, (size_t)src->prompt_len * sizeof(int32_t));
    return TL_OK;
}

/* The rows on the sequence: the prompt's but its last token (the root beam's pending token);
   past them the cache is every beam's rows, a tree. */
static int beam_sequence_rows(const tl_session *s) {
    return s->cache->length < s->prompt_len - 1 ? s->cache->length : s->prompt_len - 1;
}

/* ---------------------------------------------------------------- one search step */

/* Advances every live beam by one token: one forward, then each beam's 2B best
   continuations, then the B best of those become the next beams (ended ones set aside). */
static tl_status search_step(tl_session *s, beam_state *b) {
    const tl_generate_config *cfg = &s->cfg;
    const int B = b->B, V = b->V, prompt_len = s->prompt_len, mask_start = prompt_len - 1;
    const int base = s->cache->length, a = b->n_live, width = base + a - mask_start;
    /* One forward: each live beam's last token (the prompt's last for the root). */
    for (int i = 0; i < a; i++) {
        const hypothesis *h = &b->live[i];
        b->rows_tokens[i] = h->len ? h->tokens[h->len - 1] : s->tokens[prompt_len - 1];
        b->rows_positions[i] = prompt_len - 1 + h->len;
        uint8_t *row = b->mask + (size_t)i * (size_t)width;
        memset(row, 0, (size_t)width);
        for (int k = 0; k + 1 < h->len; k++) row[h->rows[k] - mask_start] = 1; /* forwarded ancestors */
        if (h->len > 0) row[0] = 1;                                           /* the prompt's last token */
        row[base + i - mask_start] = 1;
    }
    tl_forward f;
    tl_status st = tl_forward_begin_masked(&f, s->m, s->cache, &s->ws, b->rows_tokens, b->rows_positions, a,
                                           b->mask, mask_start);
    if (st != TL_OK) return st;
    for (int l = 0; l < s->loops; l++) tl_forward_loop(&f);
    tl_forward_end(&f, 0, b->logits);
    for (int i = 0; i < a; i++)
        if (b->live[i].len > 0) b->live[i].rows[b->live[i].len - 1] = base + i;

    /* Candidates: each beam's 2B best continuations, after the logits hook and penalty. */
    int n_cand = 0;
    for (int i = 0; i < a; i++) {
        const int n_hist = history_of(s, b, &b->live[i]);
        st = tl_session_prepare_logits_for(s, b->logits + (size_t)i * (size_t)V, b->history, n_hist);
        if (st != TL_OK) return st;
        if (s->grammar_matcher) { /* this hypothesis's own grammar state (none allowed: dropped) */
            const int n_allowed = tl_gram_matcher_mask_state(s->grammar_matcher, b->live[i].gstate, s->allowed);
            if (n_allowed < 0) return tl_gram_failure("grammar mask");
            for (int t = 0; t < V; t++)
                if (!s->allowed[t]) s->work[t] = -INFINITY;
        }
        if (!tl_log_softmax(s->work, V, b->logprobs)) continue; /* no continuation: all banned (a NaN row failed above) */
        const int n = tl_top_k(s->work, V, 2 * B, b->top_ids, b->top_values);
        for (int pick = 0; pick < n; pick++)
            b->cands[n_cand++] = (candidate){b->live[i].logp + b->logprobs[b->top_ids[pick]], i, b->top_ids[pick]};
    }
    qsort(b->cands, (size_t)n_cand, sizeof *b->cands, by_score);

    /* Walk the candidates best first: ended hypotheses are set aside (only from the top B,
       as Hugging Face does), the others fill the next beams. */
    int n_next = 0;
    for (int c = 0; c < n_cand && n_next < B; c++) {
        const candidate *cd = &b->cands[c];
        hypothesis *h = &b->next[n_next];
        copy_hyp(h, &b->live[cd->beam]);
        h->tokens[h->len++] = cd->token;
        h->logp = cd->score;
        if (s->grammar_matcher) { /* the mask allowed the token: the state cannot die here */
            h->gstate = tl_gram_matcher_advance_state(s->grammar_matcher, h->gstate, cd->token);
            if (h->gstate < 0) return tl_gram_failure("grammar");
        }
        const int n_hist = history_of(s, b, h);
        const bool ended = (cd->token == s->m->cfg.eos_token_id && !cfg->ignore_eos) ||
                           tl_stop_sequences_match(b->history, n_hist, prompt_len, cfg->stop_sequences,
                                                   cfg->n_stop_sequences,
                                                   tl_stop_longest(cfg, n_hist, prompt_len));
        if (ended || h->len >= b->T) {
            h->score = length_score(h->logp, h->len, cfg->length_penalty);
            if (c < B || !ended) add_ended(b, h);
            continue;
        }
        n_next++;
    }
    hypothesis *swap = b->live;
    b->live = b->next;
    b->next = swap;
    b->n_live = n_next;
    /* Done when B hypotheses have ended and no live beam's current score beats the worst. */
    if (b->n_ended >= B && b->n_live > 0) {
        double best_live = -INFINITY;
        for (int i = 0; i < b->n_live; i++) {
            double score = length_score(b->live[i].logp, b->live[i].len, cfg->length_penalty);
            best_live = score > best_live ? score : best_live;
        }
        if (best_live <= b->ended[b->n_ended - 1].score) b->n_live = 0;
    }
    return TL_OK;
}

/* Tokens every hypothesis that can still be returned agrees on. */
static int settled_length(const beam_state *b) {
    const hypothesis *first = b->n_live > 0 ? &b->live[0] : &b->ended[0];
    int settled = first->len;
    for (int i = 0; i < b->n_live + b->n_ended; i++) {
        const hypothesis *h = i < b->n_live ? &b->live[i] : &b->ended[i - b->n_live];
        int k = 0;
        while (k < settled && k < h->len && h->tokens[k] == first->tokens[k]) k++;
        settled = k;
    }
    return settled;
}

static tl_status beam_next(tl_session *s, int32_t *token) {
    beam_state *b = s->mode_state;
    tl_status st;
    if (!s->prompt_done) { /* tl_session_prefill marks it */
        /* All but the last prompt token: that one is the root beam's pending token. */
        if ((st = tl_session_prefill(s, s->prompt_len - 1, NULL)) != TL_OK) return st;
        b->n_live = 1;
        b->live[0].logp = 0.0;
        b->live[0].len = 0;
        b->live[0].gstate = s->grammar_matcher ? tl_gram_matcher_state(s->grammar_matcher) : 0;
        memcpy(b->history, s->tokens, (size_t)s->prompt_len * sizeof(int32_t));
    }
    const int emitted = s->n_tokens - s->prompt_len;
    s->last_depth = s->loops;
    while (b->n_live > 0) {
        if (b->n_live + b->n_ended > 0 && settled_length(b) > emitted) break;
        /* A step may search many levels before a token settles: a serving engine's cancel
           ends it between them, not when the search does (the request is dropped anyway). */
        if (atomic_load(&s->stop_requested)) return tl_fail(TL_ERR_INVALID_ARGUMENT, "beam search: cancelled");
        if ((st = search_step(s, b)) != TL_OK) return st;
    }
    if (b->n_live + b->n_ended == 0) { /* every continuation was banned */
        *token = -1;
        return TL_OK;
    }
    const hypothesis *source = b->n_live > 0 ? &b->live[0] : &b->ended[0];
    if (b->n_live == 0) s->stats.beam_score = b->ended[0].score;
    if (emitted >= source->len)
        return tl_fail(TL_ERR_INTERNAL, "beam search: the winner has %d tokens and %d were emitted without a stop",
                       source->len, emitted);
    *token = source->tokens[emitted];
    return TL_OK;
}

const tl_decoder tl_beam_decoder = {"beam", beam_open, beam_next, beam_close, beam_sequence_rows, beam_clone};

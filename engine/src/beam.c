/* beam.c: deterministic beam search (GenerateConfig.beam_size >= 2).
 *
 * All live beams advance in ONE batched forward per step. The beams share one KV cache laid
 * out as a tree: the prompt once, then every beam's tokens appended as they are decoded,
 * and a per-step attention mask lets each beam's row see the prompt and its own ancestors
 * only. Reordering beams therefore copies nothing: a beam that dies leaves unreachable rows
 * behind, a surviving beam keeps pointing at its ancestors' rows. (Memory: prompt +
 * beam_size x max_tokens rows, the price of never copying.)
 *
 * Scoring follows Hugging Face: beams are ranked by their summed log-probability;
 * hypotheses that end (EOS, a stop sequence, or max_tokens) are ranked by
 * sum_logprob / max(1, len)^length_penalty, len = generated tokens, and the best one is
 * returned. Sampling knobs (temperature, top_k, top_p, sample_seed) are ignored; the
 * logits_processor hook and the repetition penalty apply to each beam's own history.
 * Search stops when every beam has ended, or when beam_size hypotheses have ended and no
 * live beam's current score beats the worst of them. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "beam.h"
#include "stop.h"

typedef struct hypothesis {
    double logp;           /* sum of log-probabilities of the generated tokens */
    int len;               /* generated tokens */
    int32_t *tokens;       /* [max_tokens] */
    int *rows;             /* [max_tokens] cache row of each generated token once forwarded */
    tl_stop_reason reason; /* for ended hypotheses */
    double score;          /* ranking score of an ended hypothesis */
} hypothesis;

typedef struct { double score; int beam; int32_t token; } candidate;

static int by_score(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->beam != y->beam) return x->beam - y->beam;
    return x->token - y->token;
}

static double length_score(double logp, int len, float penalty) {
    return logp / pow(len > 1 ? (double)len : 1.0, (double)penalty);
}

typedef struct beam_state {
    const tl_model *m;
    const tl_generate_config *cfg;
    int B, T, V, L, prompt_len;
    hypothesis *live, *next, *ended;  /* [B], [B], [B + 1] */
    int n_live, n_ended;
    int32_t *history;                 /* [prompt_len + T] prompt + one beam's tokens */
    float *logits;                    /* [B][V] */
    double *logprobs;                 /* [V] */
    uint8_t *seen;                    /* [V] repetition-penalty scratch */
    int32_t *chunk, *positions;       /* [B] */
    uint8_t *mask;                    /* [B][B * (T + 1)] */
    candidate *cands;                 /* [B * 2B] */
} beam_state;

static hypothesis *alloc_hyps(int count, int T) {
    hypothesis *h = calloc((size_t)count, sizeof *h);
    for (int i = 0; h && i < count; i++) {
        h[i].tokens = malloc(((size_t)T + 1) * sizeof(int32_t));
        h[i].rows = malloc(((size_t)T + 1) * sizeof(int));
        if (!h[i].tokens || !h[i].rows) return h; /* caller checks the last one */
    }
    return h;
}

static void free_hyps(hypothesis *h, int count) {
    for (int i = 0; h && i < count; i++) {
        free(h[i].tokens);
        free(h[i].rows);
    }
    free(h);
}

static void copy_hyp(hypothesis *dst, const hypothesis *src) {
    dst->logp = src->logp;
    dst->len = src->len;
    dst->reason = src->reason;
    dst->score = src->score;
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

static tl_status state_init(beam_state *b, const tl_model *m, const tl_generate_config *cfg, int prompt_len) {
    memset(b, 0, sizeof *b);
    b->m = m;
    b->cfg = cfg;
    b->B = cfg->beam_size;
    b->T = cfg->max_tokens;
    b->V = m->cfg.vocab_size;
    b->L = cfg->loops ? cfg->loops : m->cfg.default_loops;
    b->prompt_len = prompt_len;
    const size_t B = (size_t)b->B, T = (size_t)b->T, V = (size_t)b->V;
    b->live = alloc_hyps(b->B, b->T);
    b->next = alloc_hyps(b->B, b->T);
    b->ended = alloc_hyps(b->B + 1, b->T);
    b->history = malloc(((size_t)prompt_len + T + 1) * sizeof(int32_t));
    b->logits = malloc(B * V * sizeof(float));
    b->logprobs = malloc(V * sizeof(double));
    b->seen = calloc(V, 1);
    b->chunk = malloc(B * sizeof(int32_t));
    b->positions = malloc(B * sizeof(int32_t));
    b->mask = malloc(B * B * (T + 1) + 1);
    b->cands = malloc(B * 2 * B * sizeof(candidate));
    if (!b->live || !b->next || !b->ended || !b->live[b->B - 1].rows || !b->next[b->B - 1].rows ||
        !b->ended[b->B].rows || !b->history || !b->logits || !b->logprobs || !b->seen || !b->chunk ||
        !b->positions || !b->mask || !b->cands)
        return tl_fail(TL_ERR_NO_MEMORY, "beam search: out of memory");
    return TL_OK;
}

static void state_free(beam_state *b) {
    free_hyps(b->live, b->B);
    free_hyps(b->next, b->B);
    free_hyps(b->ended, b->B + 1);
    free(b->history);
    free(b->logits);
    free(b->logprobs);
    free(b->seen);
    free(b->chunk);
    free(b->positions);
    free(b->mask);
    free(b->cands);
}

/* prompt + the beam's tokens, for hooks, the penalty and stop sequences. */
static int history_of(beam_state *b, const int32_t *prompt, const hypothesis *h) {
    memcpy(b->history, prompt, (size_t)b->prompt_len * sizeof(int32_t));
    memcpy(b->history + b->prompt_len, h->tokens, (size_t)h->len * sizeof(int32_t));
    return b->prompt_len + h->len;
}

/* Log-softmax of a processed row, in double. */
static void log_softmax(const float *row, int V, double *out) {
    double mx = -INFINITY, sum = 0.0;
    for (int i = 0; i < V; i++) mx = row[i] > mx ? row[i] : mx;
    for (int i = 0; i < V; i++) sum += row[i] > -INFINITY ? exp((double)row[i] - mx) : 0.0;
    const double lz = mx + log(sum);
    for (int i = 0; i < V; i++) out[i] = row[i] > -INFINITY ? (double)row[i] - lz : -INFINITY;
}

tl_status tl_beam_generate(const tl_model *m, const int32_t *prompt, int prompt_len,
                           const tl_generate_config *cfg, tl_stream_fn on_token, void *user,
                           int32_t *out, int *out_len, tl_generate_stats *stats) {
    const double t_start = tl_now_ms();
    tl_generate_stats local;
    if (!stats) stats = &local;
    memset(stats, 0, sizeof *stats);
    stats->prompt_tokens = prompt_len;
    if (cfg->grammar || cfg->on_token || cfg->stop_rule || cfg->n_stop_strings > 0 || cfg->cache_window > 0 ||
        cfg->early_exit_patience > 0)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "beam search does not support grammars, on_token / stop_rule hooks, stop strings, "
                       "cache_window or early exit yet");
    if (cfg->beam_size > 64) return tl_fail(TL_ERR_INVALID_ARGUMENT, "beam_size = %d is above 64", cfg->beam_size);

    beam_state b;
    tl_kv_cache *cache = NULL;
    tl_workspace ws = {0};
    tl_status st = state_init(&b, m, cfg, prompt_len);
    const int B = b.B, T = b.T, V = b.V;
    if (st == TL_OK) st = tl_kv_cache_new(&m->cfg, prompt_len + B * (T + 1), 0, B, &cache);

    /* Prefill all but the last prompt token: that one is the root beam's pending token. */
    int32_t *positions = NULL;
    if (st == TL_OK && !(positions = malloc((size_t)prompt_len * sizeof(int32_t))))
        st = tl_fail(TL_ERR_NO_MEMORY, "beam search: out of memory");
    for (int i = 0; st == TL_OK && i < prompt_len; i++) positions[i] = i;
    if (st == TL_OK) st = tl_forward_sequence(m, cache, &ws, prompt, positions, prompt_len - 1, 64, b.L, NULL);
    free(positions);
    stats->prefill_ms = tl_now_ms() - t_start;
    const double t_prefill_end = tl_now_ms();

    if (st == TL_OK) {
        b.n_live = T > 0 ? 1 : 0;
        b.live[0].logp = 0.0;
        b.live[0].len = 0;
        if (T == 0) {
            b.ended[0].len = 0;
            b.ended[0].reason = TL_STOP_MAX_TOKENS;
            b.ended[0].score = 0.0;
            b.n_ended = 1;
        }
    }
    const int mask_start = prompt_len - 1;
    for (int step = 0; st == TL_OK && b.n_live > 0; step++) {
        /* One forward: each live beam's last token (the prompt's last for the root). */
        const int base = cache->length, a = b.n_live, width = base + a - mask_start;
        for (int i = 0; i < a; i++) {
            const hypothesis *h = &b.live[i];
            b.chunk[i] = h->len ? h->tokens[h->len - 1] : prompt[prompt_len - 1];
            b.positions[i] = prompt_len - 1 + h->len;
            uint8_t *row = b.mask + (size_t)i * (size_t)width;
            memset(row, 0, (size_t)width);
            for (int k = 0; k + 1 < h->len; k++) row[h->rows[k] - mask_start] = 1; /* forwarded ancestors */
            if (h->len > 0) row[0] = 1;                                           /* the prompt's last token */
            row[base + i - mask_start] = 1;
        }
        tl_forward f;
        st = tl_forward_begin_masked(&f, m, cache, &ws, b.chunk, b.positions, a, b.mask, mask_start);
        if (st != TL_OK) break;
        for (int l = 0; l < b.L; l++) tl_forward_loop(&f);
        tl_forward_end(&f, 0, b.logits);
        for (int i = 0; i < a; i++)
            if (b.live[i].len > 0) b.live[i].rows[b.live[i].len - 1] = base + i;

        /* Candidates: each beam's 2B best continuations. */
        int n_cand = 0;
        for (int i = 0; i < a && st == TL_OK; i++) {
            float *row = b.logits + (size_t)i * (size_t)V;
            const int n_hist = history_of(&b, prompt, &b.live[i]);
            if (cfg->logits_processor) {
                int r = cfg->logits_processor(cfg->logits_processor_user, row, V, b.history, n_hist);
                if (r < 0) st = tl_fail(TL_ERR_HOOK, "logits_processor hook returned error %d", r);
            }
            tl_repetition_penalty(row, b.history, n_hist, cfg->repetition_penalty, b.seen);
            log_softmax(row, V, b.logprobs);
            for (int pick = 0; pick < 2 * B; pick++) {
                int best = -1;
                for (int v = 0; v < V; v++)
                    if (b.logprobs[v] > -INFINITY && (best < 0 || b.logprobs[v] > b.logprobs[best])) best = v;
                if (best < 0) break;
                b.cands[n_cand++] = (candidate){b.live[i].logp + b.logprobs[best], i, best};
                b.logprobs[best] = -INFINITY;
            }
        }
        if (st != TL_OK) break;
        qsort(b.cands, (size_t)n_cand, sizeof *b.cands, by_score);

        /* Walk the candidates best first: ended hypotheses are set aside (only from the top
           B, as Hugging Face does), the others fill the next beams. */
        int n_next = 0;
        for (int c = 0; c < n_cand && n_next < B; c++) {
            const candidate *cd = &b.cands[c];
            hypothesis *h = &b.next[n_next];
            copy_hyp(h, &b.live[cd->beam]);
            h->tokens[h->len++] = cd->token;
            h->logp = cd->score;
            int n_hist = history_of(&b, prompt, h);
            tl_stop_reason reason = TL_STOP_NONE;
            if (cd->token == m->cfg.eos_token_id && !cfg->ignore_eos) reason = TL_STOP_EOS;
            else if (tl_stop_sequences_match(b.history, n_hist, prompt_len, cfg->stop_sequences, cfg->n_stop_sequences))
                reason = TL_STOP_SEQUENCE;
            else if (h->len >= T) reason = TL_STOP_MAX_TOKENS;
            if (reason != TL_STOP_NONE) {
                h->reason = reason;
                h->score = length_score(h->logp, h->len, cfg->length_penalty);
                if (c < B || reason == TL_STOP_MAX_TOKENS) add_ended(&b, h);
                continue;
            }
            n_next++;
        }
        hypothesis *swap = b.live;
        b.live = b.next;
        b.next = swap;
        b.n_live = n_next;
        /* Done when B hypotheses have ended and no live beam's current score beats the worst. */
        if (b.n_ended >= B && b.n_live > 0) {
            double best_live = -INFINITY;
            for (int i = 0; i < b.n_live; i++) {
                double s = length_score(b.live[i].logp, b.live[i].len, cfg->length_penalty);
                best_live = s > best_live ? s : best_live;
            }
            if (best_live <= b.ended[b.n_ended - 1].score) b.n_live = 0;
        }
    }

    if (st == TL_OK && b.n_ended == 0) st = tl_fail(TL_ERR_INTERNAL, "beam search ended without a hypothesis");
    if (st == TL_OK) {
        const hypothesis *best = &b.ended[0];
        memcpy(out, prompt, (size_t)prompt_len * sizeof(int32_t));
        memcpy(out + prompt_len, best->tokens, (size_t)best->len * sizeof(int32_t));
        if (out_len) *out_len = prompt_len + best->len;
        stats->tokens_emitted = best->len;
        stats->stop_reason = best->reason;
        stats->beam_score = best->score;
        stats->loops_used = b.L;
        if (best->len > 0) stats->depth_histogram[b.L < TL_HISTOGRAM_DEPTHS ? b.L : TL_HISTOGRAM_DEPTHS - 1] = best->len;
        const double now = tl_now_ms();
        stats->decode_ms = now - t_prefill_end;
        stats->first_token_ms = now - t_start;
        /* The stream sees the winning hypothesis once the search is over. */
        for (int i = 0; on_token && i < best->len; i++)
            if (!on_token(user, best->tokens[i], prompt_len + i)) break;
    }
    tl_workspace_release(&ws);
    tl_kv_cache_free(cache);
    state_free(&b);
    return st;
}

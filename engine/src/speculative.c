/* speculative.c: self-speculative decoding, chain and tree (SPEC §3).
 *
 * Both run on a session (session.c) so that emission, hooks, stop rules and stats are
 * those of plain decoding, token for token. One cycle:
 *   1. draft at draft_loops from the pending token (the last one emitted, not yet cached);
 *   2. roll the cache back to the prefix;
 *   3. verify the pending token + every drafted token in ONE forward at verify_loops;
 *   4. walk the verifier's rows: choose each token exactly as plain decoding would (same
 *      hooks, penalty, argmax or sampling), emit it, and keep going while it matches a draft.
 * Greedy output is bit-exact with tl_generate because every verifier row is computed by the
 * batch-invariant kernels with the attention set sequential decoding would have used.
 *
 * Tree shape: each drafted node proposes its K_branches best tokens; at every level the
 * children with the highest cumulative draft log-probability are kept, at most K^level of
 * them, at most (max_nodes - 1) / draft_ahead per level (so the tree is as deep as the chain),
 * and none whose cumulative probability is below e^-2 of the level's best. Best-first under a budget rather than the full K-ary tree,
 * because on a CPU the verifier's cost grows with every node (each row is real compute),
 * while acceptance concentrates on the few most probable paths: when the draft is
 * confident the tree stays a chain, and it branches where the draft hesitates. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "session.h"

#define MAX_AHEAD 32
#define MAX_NODES 256
#define TREE_PRUNE 2.0 /* nats */

void tl_speculative_config_init(tl_speculative_config *cfg) {
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->max_tokens = 64;
    cfg->draft_loops = 2;
    cfg->verify_loops = 8;
    cfg->draft_ahead = 4;
}

void tl_tree_speculative_config_init(tl_tree_speculative_config *cfg) {
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    tl_speculative_config_init(&cfg->spec);
    cfg->K_branches = 2;
    cfg->max_nodes = 64;
}

/* ---------------------------------------------------------------- shared state */

typedef struct spec_run {
    tl_session *s;
    const tl_speculative_config *cfg;
    tl_speculative_stats *stats;
    int vocab;
    float *draft_logits;   /* [max rows][vocab] logits of a draft forward */
    float *verify_logits;  /* [max rows][vocab] */
    float *scratch;        /* [vocab] penalised draft row */
    double *q;             /* [draft_ahead][vocab] draft distributions (sampling) */
    double *p;             /* [vocab] verifier distribution (sampling) */
    int32_t *chunk;        /* [max rows] tokens of a forward */
    int32_t *positions;    /* [max rows] */
    uint8_t *mask;         /* [max rows][max rows] */
} spec_run;

static tl_status validate(const tl_model *m, const tl_speculative_config *c) {
    if (!m) return tl_fail(TL_ERR_INVALID_ARGUMENT, "model must not be NULL");
    if (!c) return tl_fail(TL_ERR_INVALID_ARGUMENT, "speculative config must not be NULL");
    if (c->verify_loops < 1 || c->verify_loops > m->cfg.max_loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "verify_loops = %d is out of range [1, max_loops = %d]",
                       c->verify_loops, m->cfg.max_loops);
    if (c->draft_loops < 1 || c->draft_loops >= c->verify_loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_loops = %d must be in [1, verify_loops = %d)",
                       c->draft_loops, c->verify_loops);
    if (c->draft_ahead < 1 || c->draft_ahead > MAX_AHEAD)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_ahead = %d is out of range [1, %d]", c->draft_ahead,
                       MAX_AHEAD);
    if (c->base && c->base->grammar)
        return tl_fail(TL_ERR_UNSUPPORTED, "speculative decoding with a grammar is not supported yet");
    if (c->base && (c->base->beam_size >= 2 || c->base->early_exit_patience > 0))
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "speculative decoding does not combine with beam search or early exit");
    return TL_OK;
}

static tl_status run_open(spec_run *r, const tl_model *m, const int32_t *prompt, int prompt_len,
                          const tl_speculative_config *c, int max_rows, tl_speculative_stats *stats) {
    memset(r, 0, sizeof *r);
    tl_generate_config g;
    if (c->base) g = *c->base;
    else tl_generate_config_init(&g);
    g.max_tokens = c->max_tokens;
    g.loops = c->verify_loops;
    g.temperature = c->temperature;
    g.sample_seed = c->seed;
    tl_status st = tl_session_create(m, prompt, prompt_len, &g, max_rows, &r->s);
    if (st != TL_OK) return st;
    const size_t v = (size_t)m->cfg.vocab_size, rows = (size_t)max_rows;
    r->cfg = c;
    r->stats = stats;
    r->vocab = m->cfg.vocab_size;
    r->draft_logits = malloc(rows * v * sizeof(float));
    r->verify_logits = malloc(rows * v * sizeof(float));
    r->scratch = malloc(v * sizeof(float));
    r->q = malloc((size_t)c->draft_ahead * v * sizeof(double));
    r->p = malloc(v * sizeof(double));
    r->chunk = malloc(rows * sizeof(int32_t));
    r->positions = malloc(rows * sizeof(int32_t));
    r->mask = malloc(rows * rows);
    if (!r->draft_logits || !r->verify_logits || !r->scratch || !r->q || !r->p || !r->chunk ||
        !r->positions || !r->mask)
        return tl_fail(TL_ERR_NO_MEMORY, "speculative decoding: out of memory");
    return TL_OK;
}

static void run_close(spec_run *r) {
    tl_session_free(r->s);
    free(r->draft_logits);
    free(r->verify_logits);
    free(r->scratch);
    free(r->q);
    free(r->p);
    free(r->chunk);
    free(r->positions);
    free(r->mask);
}

/* Prefills the prompt minus its last token (that one is the first cycle's root). */
static tl_status prefill(spec_run *r) {
    tl_session *s = r->s;
    const int n = s->prompt_len - 1;
    tl_status st = tl_forward_sequence(s->m, s->cache, &s->ws, s->tokens, s->positions, n, s->chunk, s->loops, NULL);
    if (st != TL_OK) return st;
    r->stats->verify_forwards += (n + s->chunk - 1) / s->chunk;
    s->t_prefill_end = tl_now_ms();
    s->stats.prefill_ms = s->t_prefill_end - s->t_start;
    return TL_OK;
}

/* Copies a row, applies the repetition penalty for history tokens[0..n). */
static const float *penalised(spec_run *r, const float *row, const int32_t *history, int n) {
    memcpy(r->scratch, row, (size_t)r->vocab * sizeof(float));
    tl_repetition_penalty(r->scratch, history, n, r->s->cfg.repetition_penalty, r->s->seen);
    return r->scratch;
}

/* Dense distribution (after temperature, top-k, top-p) of processed logits; false if empty. */
static bool dense_distribution(spec_run *r, const float *logits, double *out) {
    tl_session *s = r->s;
    if (!tl_distribution_build(&s->dist, logits, s->cfg.temperature, s->cfg.top_k, s->cfg.top_p)) return false;
    memset(out, 0, (size_t)r->vocab * sizeof(double));
    for (int i = 0; i < s->dist.n; i++) out[s->dist.ids[i]] = s->dist.probs[i];
    return true;
}

/* Draws from a dense distribution over ids 0..vocab-1 (weights need not sum to 1). */
static int32_t draw_dense(const double *w, int vocab, tl_rng *rng) {
    double total = 0.0;
    for (int i = 0; i < vocab; i++) total += w[i];
    if (!(total > 0.0)) return -1;
    double u = tl_rng_uniform(rng) * total, acc = 0.0;
    int32_t last = -1;
    for (int i = 0; i < vocab; i++) {
        if (w[i] <= 0.0) continue;
        acc += w[i];
        last = i;
        if (u < acc) return i;
    }
    return last;
}

/* How many tokens a cycle may still draft: it emits at most drafts + 1. */
static int room(const tl_session *s, int wanted) {
    int remaining = s->cfg.max_tokens - (s->n_tokens - s->prompt_len);
    int k = remaining - 1 < wanted ? remaining - 1 : wanted;
    return k < 0 ? 0 : k;
}

static void finish_stats(spec_run *r, double verify_rows) {
    tl_speculative_stats *st = r->stats;
    st->gen = r->s->stats;
    st->acceptance_rate = verify_rows > 0 ? st->accepted / verify_rows : 0.0;
    st->mean_accepted = st->verify_steps ? (double)st->accepted / st->verify_steps : 0.0;
}

/* ---------------------------------------------------------------- chain */

/* Drafts up to *k tokens after the pending token; *k receives how many it drafted. */
static tl_status draft_chain(spec_run *r, int *k_inout, int32_t *drafts) {
    int k = *k_inout;
    tl_session *s = r->s;
    const int n = s->n_tokens, base = s->cache->length;
    int32_t cur = s->tokens[n - 1], pos = n - 1;
    double t0 = tl_now_ms();
    for (int i = 0; i < k; i++) {
        tl_status st = tl_forward_run(s->m, s->cache, &s->ws, &cur, &pos, 1, NULL, r->cfg->draft_loops, 0,
                                      r->draft_logits);
        if (st != TL_OK) return st;
        r->stats->draft_forwards++;
        /* History for the penalty: the sequence plus the drafts so far, kept in the spare
           capacity of s->tokens (room() guarantees it exists). */
        const float *row = penalised(r, r->draft_logits, s->tokens, n + i);
        int32_t d;
        if (s->greedy) {
            d = tl_argmax(row, r->vocab);
        } else {
            double *q = r->q + (size_t)i * (size_t)r->vocab;
            d = dense_distribution(r, row, q) ? draw_dense(q, r->vocab, &s->rng) : -1;
        }
        if (d < 0) { k = i; break; }
        drafts[i] = d;
        s->tokens[n + i] = d;
        cur = d;
        pos++;
    }
    r->stats->draft_ms += tl_now_ms() - t0;
    r->stats->drafted += k;
    *k_inout = k;
    return tl_kv_truncate(s->cache, base);
}

static tl_status chain_cycle(spec_run *r, tl_stop_reason *stop) {
    tl_session *s = r->s;
    int32_t drafts[MAX_AHEAD];
    int k = room(s, r->cfg->draft_ahead);
    const int n = s->n_tokens, base = s->cache->length;
    tl_status st = draft_chain(r, &k, drafts);
    if (st != TL_OK) return st;

    r->chunk[0] = s->tokens[n - 1];
    r->positions[0] = n - 1;
    for (int i = 0; i < k; i++) {
        r->chunk[i + 1] = drafts[i];
        r->positions[i + 1] = n + i;
    }
    double t0 = tl_now_ms();
    st = tl_forward_run(s->m, s->cache, &s->ws, r->chunk, r->positions, k + 1, NULL, s->loops, 0,
                        r->verify_logits);
    r->stats->verify_ms += tl_now_ms() - t0;
    if (st != TL_OK) return st;
    r->stats->verify_forwards++;
    r->stats->verify_steps++;

    int accepted = 0;
    for (int j = 0; j <= k; j++) {
        const float *row = r->verify_logits + (size_t)j * (size_t)r->vocab;
        if ((st = tl_session_prepare_logits(s, row)) != TL_OK) return st;
        int32_t tok;
        if (s->greedy) {
            tok = tl_argmax(s->work, r->vocab);
        } else if (!dense_distribution(r, s->work, r->p)) {
            tok = -1;
        } else if (j < k) {
            /* Speculative sampling: keep the draft with probability min(1, p/q), else draw
               from the normalised residual max(0, p - q). */
            const double *q = r->q + (size_t)j * (size_t)r->vocab;
            const int32_t d = drafts[j];
            if (tl_rng_uniform(&s->rng) * q[d] < r->p[d]) {
                tok = d;
            } else {
                for (int i = 0; i < r->vocab; i++) r->p[i] = r->p[i] > q[i] ? r->p[i] - q[i] : 0.0;
                tok = draw_dense(r->p, r->vocab, &s->rng);
            }
        } else {
            tok = draw_dense(r->p, r->vocab, &s->rng);
        }
        const bool matched = j < k && tok == drafts[j];
        if ((st = tl_session_emit(s, tok, stop)) != TL_OK || *stop != TL_STOP_NONE) {
            r->stats->accepted += accepted + (matched ? 1 : 0);
            return st;
        }
        if (!matched) break;
        accepted++;
    }
    r->stats->accepted += accepted;
    /* Keep the K/V of the pending token and the accepted drafts; the last emitted token is
       the next cycle's pending one. */
    return tl_kv_truncate(s->cache, base + accepted + 1);
}

tl_status tl_generate_speculative(const tl_model *model, const int32_t *prompt, int prompt_len,
                                  const tl_speculative_config *cfg, int32_t *out, int out_capacity,
                                  int *out_len, tl_speculative_stats *stats) {
    tl_speculative_stats local;
    if (!stats) stats = &local;
    memset(stats, 0, sizeof *stats);
    tl_status st = validate(model, cfg);
    if (st != TL_OK) return st;
    if (!out || out_capacity < prompt_len + cfg->max_tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "out_capacity = %d is too small: prompt_len + max_tokens = %d",
                       out_capacity, prompt_len + cfg->max_tokens);
    spec_run r;
    st = run_open(&r, model, prompt, prompt_len, cfg, cfg->draft_ahead + 1, stats);
    if (st == TL_OK && cfg->max_tokens == 0) {
        r.s->stats.stop_reason = TL_STOP_MAX_TOKENS;
    } else if (st == TL_OK) {
        st = prefill(&r);
        tl_stop_reason stop = TL_STOP_NONE;
        while (st == TL_OK && stop == TL_STOP_NONE) st = chain_cycle(&r, &stop);
    }
    if (r.s) {
        finish_stats(&r, stats->drafted);
        if (st == TL_OK) {
            memcpy(out, r.s->tokens, (size_t)r.s->n_tokens * sizeof(int32_t));
            if (out_len) *out_len = r.s->n_tokens;
        }
    }
    run_close(&r);
    return st;
}

/* ---------------------------------------------------------------- tree */

typedef struct tree {
    int n;                         /* nodes; node 0 is the pending token (the root) */
    int32_t token[MAX_NODES];
    int parent[MAX_NODES];
    int depth[MAX_NODES];
    double logp[MAX_NODES];        /* cumulative draft log-probability */
} tree;

typedef struct { double logp; int parent; int32_t token; int greedy; } candidate;

/* The greedy path first (the tree always contains the chain's drafts), then by cumulative
   log-probability. */
static int by_logp_desc(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->greedy != y->greedy) return y->greedy - x->greedy;
    if (x->logp != y->logp) return x->logp > y->logp ? -1 : 1;
    if (x->parent != y->parent) return x->parent - y->parent;
    return x->token - y->token;
}

static bool is_ancestor_or_self(const tree *t, int a, int node) {
    for (; node >= 0; node = t->parent[node])
        if (node == a) return true;
    return false;
}

/* Writes the path root..node (excluded root) tokens after s->tokens[n) for the penalty. */
static int path_history(const tree *t, tl_session *s, int node) {
    int d = t->depth[node];
    for (int x = node; x > 0; x = t->parent[x]) s->tokens[s->n_tokens + t->depth[x] - 1] = t->token[x];
    return s->n_tokens + d;
}

static tl_status draft_tree(spec_run *r, tree *t, int levels, int K, int max_nodes) {
    tl_session *s = r->s;
    const int n = s->n_tokens, base = s->cache->length;
    candidate cand[MAX_NODES * 8];
    int level_start = 0, level_end = 1, width = 1, greedy_node = 0;
    t->n = 1;
    t->token[0] = s->tokens[n - 1];
    t->parent[0] = -1;
    t->depth[0] = 0;
    t->logp[0] = 0.0;
    double t0 = tl_now_ms();
    for (int level = 0; level < levels && t->n < max_nodes; level++) {
        /* Forward this level's nodes; each sees the prefix and its ancestors (rows
           base + index in the cache). */
        const int rows = level_end - level_start, cols = level_end;
        for (int i = 0; i < rows; i++) {
            int node = level_start + i;
            r->chunk[i] = t->token[node];
            r->positions[i] = n - 1 + t->depth[node];
            for (int c = 0; c < cols; c++) r->mask[i * cols + c] = is_ancestor_or_self(t, c, node);
        }
        tl_forward f;
        tl_status st = tl_forward_begin_masked(&f, s->m, s->cache, &s->ws, r->chunk, r->positions, rows,
                                               r->mask, base);
        if (st != TL_OK) return st;
        for (int l = 0; l < r->cfg->draft_loops; l++) tl_forward_loop(&f);
        tl_forward_end(&f, 0, r->draft_logits);
        r->stats->draft_forwards++;

        /* Each node proposes its K best tokens; keep the likeliest children overall. */
        int n_cand = 0;
        for (int i = 0; i < rows; i++) {
            int node = level_start + i;
            const float *row = penalised(r, r->draft_logits + (size_t)i * (size_t)r->vocab, s->tokens,
                                         path_history(t, s, node));
            float mx = -INFINITY;
            for (int v = 0; v < r->vocab; v++) mx = row[v] > mx ? row[v] : mx;
            if (!(mx > -INFINITY)) continue;
            double sum = 0.0;
            for (int v = 0; v < r->vocab; v++) sum += exp((double)row[v] - mx);
            const double log_z = mx + log(sum);
            /* K best by a partial selection (K is small). */
            for (int pick = 0; pick < K; pick++) {
                int best = -1;
                for (int v = 0; v < r->vocab; v++) {
                    if (!(row[v] > -INFINITY)) continue;
                    bool taken = false;
                    for (int c = n_cand - pick; c < n_cand; c++)
                        if (cand[c].token == v) { taken = true; break; }
                    if (!taken && (best < 0 || row[v] > row[best])) best = v;
                }
                if (best < 0) break;
                cand[n_cand++] = (candidate){t->logp[node] + (double)row[best] - log_z, node, best,
                                             node == greedy_node && pick == 0};
            }
        }
        qsort(cand, (size_t)n_cand, sizeof *cand, by_logp_desc);
        width = width * K > MAX_NODES ? MAX_NODES : width * K;
        /* Share the budget between levels so the tree is as deep as the chain would be. */
        const int per_level = (max_nodes - 1) / levels > 1 ? (max_nodes - 1) / levels : 1;
        int keep = n_cand < width ? n_cand : width;
        if (keep > per_level) keep = per_level;
        if (keep > max_nodes - t->n) keep = max_nodes - t->n;
        /* Spend verifier rows only on plausible branches: a child whose cumulative draft
           probability is below e^-TREE_PRUNE (about 1/7) of the level's best is dropped. */
        double best_logp = -INFINITY;
        for (int c = 0; c < keep; c++) best_logp = cand[c].logp > best_logp ? cand[c].logp : best_logp;
        for (int c = 1; c < keep; c++)
            if (cand[c].logp < best_logp - TREE_PRUNE) { keep = c; break; }
        level_start = t->n;
        for (int c = 0; c < keep; c++) {
            int x = t->n++;
            if (cand[c].greedy) greedy_node = x;
            t->token[x] = cand[c].token;
            t->parent[x] = cand[c].parent;
            t->depth[x] = level + 1;
            t->logp[x] = cand[c].logp;
        }
        level_end = t->n;
        if (keep == 0) break;
        if (level + 1 == levels) break; /* the last level is verified, not drafted from */
    }
    r->stats->draft_ms += tl_now_ms() - t0;
    r->stats->drafted += t->n - 1;
    return tl_kv_truncate(s->cache, base);
}

static tl_status tree_cycle(spec_run *r, const tl_tree_speculative_config *cfg, tl_stop_reason *stop,
                            double *offered) {
    tl_session *s = r->s;
    tree t;
    const int levels = room(s, cfg->spec.draft_ahead), base = s->cache->length, n = s->n_tokens;
    tl_status st = draft_tree(r, &t, levels, cfg->K_branches, cfg->max_nodes);
    if (st != TL_OK) return st;
    int max_depth = 0;
    for (int i = 0; i < t.n; i++) {
        r->chunk[i] = t.token[i];
        r->positions[i] = n - 1 + t.depth[i];
        if (t.depth[i] > max_depth) max_depth = t.depth[i];
        for (int c = 0; c < t.n; c++) r->mask[i * t.n + c] = is_ancestor_or_self(&t, c, i);
    }
    *offered += max_depth;
    double t0 = tl_now_ms();
    st = tl_forward_run(s->m, s->cache, &s->ws, r->chunk, r->positions, t.n, r->mask, s->loops, 0,
                        r->verify_logits);
    r->stats->verify_ms += tl_now_ms() - t0;
    if (st != TL_OK) return st;
    r->stats->verify_forwards++;
    r->stats->verify_steps++;

    /* Walk down the tree while the verifier agrees with a drafted child. */
    int node = 0, depth = 0;
    int path[MAX_NODES];
    for (;;) {
        if ((st = tl_session_prepare_logits(s, r->verify_logits + (size_t)node * (size_t)r->vocab)) != TL_OK)
            return st;
        int32_t tok = tl_argmax(s->work, r->vocab);
        int child = -1;
        for (int c = 1; c < t.n && tok >= 0; c++)
            if (t.parent[c] == node && t.token[c] == tok) { child = c; break; }
        if ((st = tl_session_emit(s, tok, stop)) != TL_OK || *stop != TL_STOP_NONE) {
            r->stats->accepted += depth + (child >= 0 ? 1 : 0);
            return st;
        }
        if (child < 0) break;
        path[++depth] = child;
        node = child;
    }
    r->stats->accepted += depth;
    /* Compact the accepted path's K/V into consecutive entries after the root. */
    for (int d = 1; d <= depth; d++) tl_kv_move(s->cache, base + path[d], base + d);
    return tl_kv_truncate(s->cache, base + depth + 1);
}

tl_status tl_generate_tree_speculative(const tl_model *model, const int32_t *prompt, int prompt_len,
                                       const tl_tree_speculative_config *cfg, int32_t *out,
                                       int out_capacity, int *out_len, tl_speculative_stats *stats) {
    tl_speculative_stats local;
    if (!stats) stats = &local;
    memset(stats, 0, sizeof *stats);
    if (!cfg) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tree speculative config must not be NULL");
    tl_status st = validate(model, &cfg->spec);
    if (st != TL_OK) return st;
    if (cfg->K_branches < 1 || cfg->K_branches > 8)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "K_branches = %d is out of range [1, 8]", cfg->K_branches);
    if (cfg->max_nodes < 2 || cfg->max_nodes > MAX_NODES)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_nodes = %d is out of range [2, %d]", cfg->max_nodes, MAX_NODES);
    if (cfg->spec.temperature > 0.01f)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "temperature = %g: tree speculative sampling is not implemented (use greedy, or the chain)",
                       (double)cfg->spec.temperature);
    if (!out || out_capacity < prompt_len + cfg->spec.max_tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "out_capacity = %d is too small: prompt_len + max_tokens = %d",
                       out_capacity, prompt_len + cfg->spec.max_tokens);
    spec_run r;
    double offered = 0.0;
    st = run_open(&r, model, prompt, prompt_len, &cfg->spec, cfg->max_nodes, stats);
    if (st == TL_OK && cfg->spec.max_tokens == 0) {
        r.s->stats.stop_reason = TL_STOP_MAX_TOKENS;
    } else if (st == TL_OK) {
        st = prefill(&r);
        tl_stop_reason stop = TL_STOP_NONE;
        while (st == TL_OK && stop == TL_STOP_NONE) st = tree_cycle(&r, cfg, &stop, &offered);
    }
    if (r.s) {
        finish_stats(&r, offered);
        if (st == TL_OK) {
            memcpy(out, r.s->tokens, (size_t)r.s->n_tokens * sizeof(int32_t));
            if (out_len) *out_len = r.s->n_tokens;
        }
    }
    run_close(&r);
    return st;
}

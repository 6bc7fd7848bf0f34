/* speculative.c: self-speculative decoding, chain and tree, as a session mode (SPEC §3).
 *
 * One driver for both shapes: a chain is a tree with one child per node. One cycle:
 *   1. draft from the pending token (the last one emitted, not yet cached) at draft_loops,
 *      level by level: each node proposes its K_branches best tokens (the chain: 1; when
 *      sampling, the chain draws its token from the draft distribution instead);
 *      keeping every node's loop state at draft_loops (the last level's nodes, which propose
 *      nothing, get a pass through the loops only);
 *   2. roll the cache back to the prefix (bookkeeping only: the draft's K/V stay in the pages);
 *   3. verify the pending token + every drafted node in ONE forward at the verify depth,
 *      resumed from the kept states: the draft computed the prelude and the first draft_loops
 *      loops of each node with exactly the verifier's inputs (token, position, visible
 *      entries), so those results and the K/V they wrote are already the verifier's, bit for
 *      bit (forward.h: tl_kept_states), and only loops draft_loops + 1 .. verify run;
 *   4. then each step takes the verifier's row of the current node, chooses a token exactly as
 *      plain decoding would (same hooks, penalty, argmax or sampling) and emits it; while the
 *      token is a drafted child the next step continues from that child, otherwise the
 *      accepted path is compacted into the cache and the next step drafts a new cycle.
 * Greedy output is bit-exact with plain decoding because every verifier row is computed by
 * the batch-invariant kernels with the attention set sequential decoding would have used.
 * Sampling (chain) keeps a draft with probability min(1, p/q), else draws from the residual
 * max(0, p - q), so the output distribution equals plain sampling.
 *
 * Tree shape: at every level the children with the highest cumulative draft log-probability
 * are kept, at most K^level of them, at most (max_nodes - 1) / draft_ahead per level (so the
 * tree is as deep as the chain), and none whose cumulative probability is below e^-2 of the
 * level's best. Best-first under a budget rather than the full K-ary tree, because on a CPU
 * the verifier's cost grows with every node (each row is real compute), while acceptance
 * concentrates on the few most probable paths: when the draft is confident the tree stays a
 * chain, and it branches where the draft hesitates. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "session.h"
#include "stats.h"
#include "validate.h"

#define TREE_PRUNE 2.0 /* nats */

typedef struct draft_tree {
    int n;                                /* nodes; node 0 is the pending token (the root) */
    int32_t token[TL_MAX_TREE_NODES];
    int parent[TL_MAX_TREE_NODES];
    int depth[TL_MAX_TREE_NODES];
    double logp[TL_MAX_TREE_NODES];       /* cumulative draft log-probability */
} draft_tree;

typedef struct candidate { double logp; int parent; int32_t token; int greedy; } candidate;

typedef struct spec_state {
    int K;                 /* children proposed per node: 1 for the chain */
    int max_nodes;         /* draft_ahead + 1 for the chain */
    bool sampling;         /* chain at temperature > 0: speculative sampling */
    float *draft_logits;   /* [max_nodes][vocab] one draft level's logits */
    float *verify_logits;  /* [max_nodes][vocab] the verifier's rows, one per node */
    float *draft_row;      /* [vocab] a draft row after the repetition penalty */
    double *logprobs;      /* [vocab] its log-softmax (tree ranking) */
    int32_t *top_ids;      /* [K] */
    float *top_values;     /* [K] */
    candidate *candidates; /* [max_nodes * K] */
    double *q;             /* [draft_ahead][vocab] draft distributions (sampling) */
    double *p;             /* [vocab] verifier distribution (sampling) */
    int32_t *history;      /* [prompt + max_tokens + draft_ahead] sequence + a drafted path */
    int32_t *tally;        /* [vocab] tl_adjust_logits' scratch for the drafts */
    int32_t *row_tokens;   /* [max_nodes] tokens of a forward */
    int32_t *row_positions;/* [max_nodes] */
    uint8_t *mask;         /* [max_nodes][max_nodes] ancestor mask */
    draft_tree tree;
    tl_kept_states kept;   /* [max_nodes] each node's loop state after draft_loops */
    int32_t grammar_state[TL_MAX_TREE_NODES]; /* compiled grammar: its state after each node */
    int base;              /* cache length before the cycle's root */
    int node;              /* node whose verifier row gives the next token; -1: new cycle */
    int depth;             /* accepted depth of the current cycle */
    int path[TL_MAX_TREE_NODES];
    double depth_offered;  /* sum of the drafted trees' depths */
} spec_state;

/* ---------------------------------------------------------------- lifetime */

static void spec_close(tl_session *s) {
    spec_state *sp = s->mode_state;
    if (!sp) return;
    free(sp->draft_logits);
    free(sp->verify_logits);
    free(sp->draft_row);
    free(sp->logprobs);
    free(sp->top_ids);
    free(sp->top_values);
    free(sp->candidates);
    free(sp->q);
    free(sp->p);
    free(sp->history);
    free(sp->tally);
    free(sp->row_tokens);
    free(sp->row_positions);
    free(sp->mask);
    tl_kept_states_release(&sp->kept);
    free(sp);
    s->mode_state = NULL;
}

/* The mode's state and its buffers, for a session of s's config (no cache). */
static tl_status spec_alloc(tl_session *s) {
    const tl_generate_config *c = &s->cfg;
    const bool tree = c->speculative == TL_SPECULATIVE_TREE;
    spec_state *sp = calloc(1, sizeof *sp);
    if (!sp) return tl_fail(TL_ERR_NO_MEMORY, "speculative decoding: out of memory");
    s->mode_state = sp;
    sp->K = tree ? c->K_branches : 1;
    sp->max_nodes = tree ? c->max_nodes : c->draft_ahead + 1;
    sp->sampling = !s->greedy;
    sp->node = -1;
    const size_t v = (size_t)s->m->cfg.vocab_size, rows = (size_t)sp->max_nodes, K = (size_t)sp->K;
    sp->draft_logits = malloc(rows * v * sizeof(float));
    sp->verify_logits = malloc(rows * v * sizeof(float));
    sp->draft_row = malloc(v * sizeof(float));
    sp->logprobs = malloc(v * sizeof(double));
    sp->top_ids = malloc(K * sizeof(int32_t));
    sp->top_values = malloc(K * sizeof(float));
    sp->candidates = malloc(rows * K * sizeof(candidate));
    sp->q = sp->sampling ? malloc((size_t)c->draft_ahead * v * sizeof(double)) : NULL;
    sp->p = malloc(v * sizeof(double));
    sp->history = malloc(((size_t)s->prompt_len + (size_t)c->max_tokens + rows) * sizeof(int32_t));
    sp->tally = calloc(v, sizeof *sp->tally);
    sp->row_tokens = malloc(rows * sizeof(int32_t));
    sp->row_positions = malloc(rows * sizeof(int32_t));
    sp->mask = malloc(rows * rows);
    if (!sp->draft_logits || !sp->verify_logits || !sp->draft_row || !sp->logprobs || !sp->top_ids ||
        !sp->top_values || !sp->candidates || (sp->sampling && !sp->q) || !sp->p || !sp->history ||
        !sp->tally || !sp->row_tokens || !sp->row_positions || !sp->mask)
        return tl_fail(TL_ERR_NO_MEMORY, "speculative decoding: out of memory");
    return tl_kept_states_reserve(&sp->kept, s->m, sp->max_nodes);
}

static tl_status spec_open(tl_session *s) {
    tl_status st = spec_alloc(s);
    if (st != TL_OK) return st;
    /* Room for a whole tree after the sequence until the accepted path is compacted. */
    st = tl_session_cache_new(s, ((spec_state *)s->mode_state)->max_nodes);
    if (st == TL_OK) tl_session_take_prefix(s);
    return st;
}

/* A fork's (or a saved state's) mode state: src's where a cycle is under way (the drafted
   tree, the verifier's rows, the accepted path, a sampled chain's draft distributions), so
   that the copy emits exactly the tokens src would; the buffers a cycle fills before it reads
   them are the copy's own. Its cache, forked from src's, holds the cycle's rows. */
static tl_status spec_clone(tl_session *dst, const tl_session *src) {
    tl_status st = spec_alloc(dst);
    if (st != TL_OK) return st;
    spec_state *d = dst->mode_state;
    const spec_state *s = src->mode_state;
    const size_t v = (size_t)src->m->cfg.vocab_size, rows = (size_t)s->max_nodes;
    d->tree = s->tree;
    memcpy(d->grammar_state, s->grammar_state, sizeof d->grammar_state);
    memcpy(d->path, s->path, sizeof d->path);
    d->base = s->base, d->node = s->node, d->depth = s->depth, d->depth_offered = s->depth_offered;
    memcpy(d->verify_logits, s->verify_logits, rows * v * sizeof(float));
    if (s->sampling) memcpy(d->q, s->q, (size_t)src->cfg.draft_ahead * v * sizeof(double));
    /* the row the last token was chosen from, in the copy's own verifier rows */
    if (src->chosen_row && src->chosen_row >= s->verify_logits && src->chosen_row < s->verify_logits + rows * v)
        dst->chosen_row = d->verify_logits + (src->chosen_row - s->verify_logits);
    return TL_OK;
}

/* The rows on the sequence: all of them between cycles; within one, the prefix, the root and
   the accepted path as far as it runs through the nodes in their rows' order (a chain's
   whole path: its node d sits at base + d; a tree's other nodes are branches). */
static int spec_sequence_rows(const tl_session *s) {
    const spec_state *sp = s->mode_state;
    if (!sp || sp->node < 0) return s->cache->length;
    int d = 0;
    while (d < sp->depth && sp->path[d + 1] == d + 1) d++;
    return sp->base + 1 + d;
}

/* ---------------------------------------------------------------- drafting */

/* Dense distribution (after temperature, top-k, top-p, min-p) of processed logits; false if empty. */
static bool dense_distribution(tl_session *s, const float *logits, double *out, double *total) {
    const int vocab = s->m->cfg.vocab_size;
    if (!tl_distribution_build(&s->dist, logits, s->cfg.temperature, s->cfg.top_k, s->cfg.top_p, s->cfg.min_p,
                               s->cfg.temperature_last)) return false;
    memset(out, 0, (size_t)vocab * sizeof(double));
    for (int i = 0; i < s->dist.n; i++) out[s->dist.ids[i]] = s->dist.probs[i];
    *total = 0.0;
    for (int i = 0; i < vocab; i++) *total += out[i];
    return true;
}

static bool is_ancestor_or_self(const draft_tree *t, int a, int node) {
    for (; node >= 0; node = t->parent[node])
        if (node == a) return true;
    return false;
}

/* ---- grammar: a draft row masked by the grammar's state after the node's path, so that
   drafts are sentences the verifier can accept. The greedy chain only needs its argmax to be
   allowed; the tree ranks several children and sampling draws from the row: both need the
   full mask. Returns false when out of memory. */
static bool grammar_draft_row(tl_session *s, spec_state *sp, int node) {
    tl_grammar_matcher *mt = s->grammar_matcher;
    const int vocab = s->m->cfg.vocab_size;
    const int32_t state = sp->grammar_state[node];
    if (sp->K == 1 && !sp->sampling) {
        const int32_t top = tl_argmax(sp->draft_row, vocab);
        const int32_t next = top >= 0 ? tl_gram_matcher_advance_state(mt, state, top) : GRAM_DEAD;
        if (next < 0) return false;
        if (next != GRAM_DEAD) return true;
    }
    if (tl_gram_matcher_mask_state(mt, state, s->allowed) < 0) return false;
    for (int i = 0; i < vocab; i++)
        if (!s->allowed[i]) sp->draft_row[i] = -INFINITY;
    return true;
}

/* The draft row of `node` adjusted as the verifier's rows are (tl_adjust_logits, over the
   sequence + its path), and masked by the grammar, with a compiled grammar. NULL when out
   of memory. */
static const float *penalised_draft_row(tl_session *s, spec_state *sp, const float *row, int node) {
    const int vocab = s->m->cfg.vocab_size;
    memcpy(sp->draft_row, row, (size_t)vocab * sizeof(float));
    const draft_tree *t = &sp->tree;
    if (!tl_adjusts_logits(&s->cfg, s->n_tokens + t->depth[node], s->prompt_len)) {
        if (s->grammar_matcher && !grammar_draft_row(s, sp, node)) return NULL;
        return sp->draft_row;
    }
    for (int x = node; x > 0; x = t->parent[x]) sp->history[s->n_tokens + t->depth[x] - 1] = t->token[x];
    tl_adjust_logits(&s->cfg, sp->draft_row, sp->history, s->n_tokens + t->depth[node], s->prompt_len,
                     s->m->cfg.eos_token_id, sp->tally);
    if (s->grammar_matcher && !grammar_draft_row(s, sp, node)) return NULL;
    return sp->draft_row;
}

/* The greedy path first (the tree always contains the chain's drafts), then by cumulative
   log-probability. */
static int by_logp_desc(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->greedy != y->greedy) return y->greedy - x->greedy;
    if (x->logp != y->logp) return x->logp > y->logp ? -1 : 1;
    if (x->parent != y->parent) return x->parent - y->parent;
    return x->token - y->token;
}

/* Proposals of one drafted node: its K best tokens, or (sampling) one drawn token. */
static int propose(tl_session *s, spec_state *sp, const float *row, int node, int level, bool on_greedy_path,
                   candidate *out) {
    const int vocab = s->m->cfg.vocab_size;
    const draft_tree *t = &sp->tree;
    if (sp->sampling) {
        double total, *q = sp->q + (size_t)level * (size_t)vocab;
        if (!dense_distribution(s, row, q, &total)) return 0;
        int d = tl_draw(q, vocab, total, &s->rng);
        if (d < 0) return 0;
        out[0] = (candidate){0.0, node, d, 1};
        return 1;
    }
    const int n = tl_top_k(row, vocab, sp->K, sp->top_ids, sp->top_values);
    /* With one child per node there is nothing to rank: skip the log-softmax. */
    if (n > 0 && sp->K > 1) tl_log_softmax(row, vocab, sp->logprobs);
    for (int pick = 0; pick < n; pick++) {
        const double logp = sp->K > 1 ? t->logp[node] + sp->logprobs[sp->top_ids[pick]] : 0.0;
        out[pick] = (candidate){logp, node, sp->top_ids[pick], on_greedy_path && pick == 0};
    }
    return n;
}

/* The forward rows of tree nodes [first, end), for a draft level and for the verification
   alike: each node's token at its position and, in a tree, its row of the ancestor mask over
   nodes [0, end). */
static void node_rows(const tl_session *s, spec_state *sp, int first, int end) {
    const draft_tree *t = &sp->tree;
    const int n = s->n_tokens;
    const bool chain = sp->K == 1;
    for (int i = 0; i < end - first; i++) {
        const int node = first + i;
        sp->row_tokens[i] = t->token[node];
        sp->row_positions[i] = n - 1 + t->depth[node];
        for (int c = 0; !chain && c < end; c++) sp->mask[i * end + c] = is_ancestor_or_self(t, c, node);
    }
}

/* Forwards the nodes [first, end) (one tree level) at draft_loops over the cached prefix and
   their ancestors (rows base + index in the cache; a chain's ancestors are exactly the causal
   set) and keeps their loop states for the verifier. With `logits` the rows go on through the
   coda and head (a draft level); without, they stop after the loops (the last level, which
   proposes nothing: only its states are needed). */
static tl_status forward_level(tl_session *s, spec_state *sp, int first, int end, int base, float *logits) {
    const int rows = end - first;
    const bool chain = sp->K == 1;
    node_rows(s, sp, first, end);
    tl_forward f;
    tl_status st = tl_forward_begin_masked(&f, s->m, s->cache, &s->ws, sp->row_tokens, sp->row_positions, rows,
                                           chain ? NULL : sp->mask, base);
    if (st != TL_OK) return st;
    for (int l = 0; l < s->cfg.draft_loops; l++) tl_forward_loop(&f);
    tl_forward_keep(&f, 0, rows, &sp->kept, first);
    if (logits) tl_forward_end(&f, 0, logits);
    else tl_forward_commit(&f);
    s->stats.draft_forwards++;
    return TL_OK;
}

/* Drafts up to `levels` levels below the pending token, then rolls the cache back. Every node
   (the last level's too) leaves its loop state at draft_loops in sp->kept. */
static tl_status draft(tl_session *s, spec_state *sp, int levels) {
    draft_tree *t = &sp->tree;
    const int n = s->n_tokens, base = s->cache->length, vocab = s->m->cfg.vocab_size;
    int level_start = 0, level_end = 1, width = 1, greedy_node = 0, forwarded = 0;
    t->n = 1;
    t->token[0] = s->tokens[n - 1];
    t->parent[0] = -1;
    t->depth[0] = 0;
    t->logp[0] = 0.0;
    if (s->grammar_matcher) sp->grammar_state[0] = tl_gram_matcher_state(s->grammar_matcher);
    if (tl_adjusts_logits(&s->cfg, n, s->prompt_len)) memcpy(sp->history, s->tokens, (size_t)n * sizeof(int32_t));
    const double t0 = tl_now_ms();
    for (int level = 0; level < levels && t->n < sp->max_nodes; level++) {
        const int rows = level_end - level_start;
        tl_status st = forward_level(s, sp, level_start, level_end, base, sp->draft_logits);
        if (st != TL_OK) return st;
        forwarded = level_end;

        int n_cand = 0;
        for (int i = 0; i < rows; i++) {
            const int node = level_start + i;
            const float *row = penalised_draft_row(s, sp, sp->draft_logits + (size_t)i * (size_t)vocab, node);
            if (!row) return tl_gram_failure("grammar mask of a draft");
            n_cand += propose(s, sp, row, node, level, node == greedy_node, sp->candidates + n_cand);
        }
        candidate *cand = sp->candidates;
        qsort(cand, (size_t)n_cand, sizeof *cand, by_logp_desc);
        width = width * sp->K > TL_MAX_TREE_NODES ? TL_MAX_TREE_NODES : width * sp->K;
        /* Share the budget between levels so the tree is as deep as the chain would be. */
        const int per_level = (sp->max_nodes - 1) / levels > 1 ? (sp->max_nodes - 1) / levels : 1;
        int keep = n_cand < width ? n_cand : width;
        if (keep > per_level) keep = per_level;
        if (keep > sp->max_nodes - t->n) keep = sp->max_nodes - t->n;
        /* Spend verifier rows only on plausible branches: a child whose cumulative draft
           probability is below e^-TREE_PRUNE (about 1/7) of the level's best is dropped. */
        double best_logp = -INFINITY;
        for (int c = 0; c < keep; c++) best_logp = cand[c].logp > best_logp ? cand[c].logp : best_logp;
        for (int c = 1; c < keep; c++)
            if (cand[c].logp < best_logp - TREE_PRUNE) { keep = c; break; }
        level_start = t->n;
        for (int c = 0; c < keep; c++) {
            const int x = t->n++;
            if (cand[c].greedy) greedy_node = x;
            t->token[x] = cand[c].token;
            t->parent[x] = cand[c].parent;
            t->depth[x] = level + 1;
            t->logp[x] = cand[c].logp;
            if (s->grammar_matcher) {
                sp->grammar_state[x] = tl_gram_matcher_advance_state(s->grammar_matcher, sp->grammar_state[cand[c].parent],
                                                                  cand[c].token);
                if (sp->grammar_state[x] < 0) return tl_gram_failure("grammar");
            }
        }
        level_end = t->n;
        if (keep == 0) break;
    }
    /* The nodes proposed last were never forwarded: their states too, so that the verifier
       resumes every row (this costs the layers the verifier saves on one level's rows). */
    if (forwarded < t->n) {
        tl_status st = forward_level(s, sp, forwarded, t->n, base, NULL);
        if (st != TL_OK) return st;
    }
    s->stats.draft_ms += tl_now_ms() - t0;
    s->stats.drafted += t->n - 1;
    return tl_kv_truncate(s->cache, base);
}

/* ---------------------------------------------------------------- one cycle */

/* How many levels a cycle may draft: it emits at most levels + 1 tokens. */
static int room(const tl_session *s) {
    const int remaining = s->cfg.max_tokens - (s->n_tokens - s->prompt_len);
    const int levels = remaining - 1 < s->cfg.draft_ahead ? remaining - 1 : s->cfg.draft_ahead;
    return levels < 0 ? 0 : levels;
}

static tl_status begin_cycle(tl_session *s, spec_state *sp) {
    if (!s->prompt_done) { /* tl_session_prefill marks it */
        /* The prompt minus its last token: that one is the first cycle's root. */
        const int n = s->prompt_len - 1;
        tl_status st = tl_session_prefill(s, n, NULL);
        if (st != TL_OK) return st;
        /* the rows from the prefill's first (past the pool's), whether this call or a batch's
           shared pass forwarded them, counted in passes of a chunk */
        s->stats.verify_forwards += (n - s->prefill_first_row + s->chunk - 1) / s->chunk;
    }
    sp->base = s->cache->length;
    tl_status st = draft(s, sp, room(s));
    if (st != TL_OK) return st;

    const draft_tree *t = &sp->tree;
    const bool chain = sp->K == 1;
    node_rows(s, sp, 0, t->n);
    int max_depth = 0;
    for (int i = 0; i < t->n; i++)
        if (t->depth[i] > max_depth) max_depth = t->depth[i];
    sp->depth_offered += max_depth;
    const double t0 = tl_now_ms();
    /* Every row resumes from its draft's state: only the loops past draft_loops are left. */
    tl_forward f;
    st = tl_forward_begin_kept(&f, s->m, s->cache, &s->ws, sp->row_tokens, sp->row_positions, t->n,
                               chain ? NULL : sp->mask, &sp->kept, s->cfg.draft_loops);
    if (st != TL_OK) return st;
    for (int l = s->cfg.draft_loops; l < s->loops; l++) tl_forward_loop(&f);
    tl_forward_end(&f, 0, sp->verify_logits);
    s->stats.verify_ms += tl_now_ms() - t0;
    s->stats.verify_forwards++;
    s->stats.verify_steps++;
    sp->node = 0;
    sp->depth = 0;
    return TL_OK;
}

/* The accepted path's K/V into consecutive entries after the root; the rest rolled back.
   The last chosen token is the next cycle's root. */
static tl_status end_cycle(tl_session *s, spec_state *sp) {
    for (int d = 1; d <= sp->depth; d++) tl_kv_move(s->cache, sp->base + sp->path[d], sp->base + d);
    sp->node = -1;
    return tl_kv_truncate(s->cache, sp->base + sp->depth + 1);
}

/* The verifier's choice at the current node, exactly as plain decoding would make it. */
static tl_status choose_verified(tl_session *s, spec_state *sp, int32_t *token) {
    const int vocab = s->m->cfg.vocab_size;
    const draft_tree *t = &sp->tree;
    const float *row = sp->verify_logits + (size_t)sp->node * (size_t)vocab;
    tl_status st = tl_session_prepare_logits(s, row);
    if (st != TL_OK) return st;
    s->chosen_row = row; /* (valid until the next cycle's verification: the next step) */
    if (!sp->sampling) {
        *token = tl_session_choose(s);
        return TL_OK;
    }
    double total;
    if (!dense_distribution(s, s->work, sp->p, &total)) {
        *token = -1;
        return TL_OK;
    }
    /* The chain's drafted child of this node, if any: its draft distribution is level `node`. */
    const int child = sp->node + 1 < t->n ? sp->node + 1 : -1;
    if (child < 0) {
        *token = tl_draw(sp->p, vocab, total, &s->rng);
        return TL_OK;
    }
    const double *q = sp->q + (size_t)sp->node * (size_t)vocab;
    const int32_t d = t->token[child];
    if (tl_rng_uniform(&s->rng) * q[d] < sp->p[d]) {
        *token = d;
        return TL_OK;
    }
    /* Rejected: draw from the normalised residual max(0, p - q). */
    total = 0.0;
    for (int i = 0; i < vocab; i++) total += (sp->p[i] = sp->p[i] > q[i] ? sp->p[i] - q[i] : 0.0);
    /* (no residual means p <= q everywhere, both summing to 1: p = q up to rounding, where
       the draft is accepted with probability 1; it is taken, not a dead end) */
    *token = total > 0.0 ? tl_draw(sp->p, vocab, total, &s->rng) : d;
    return TL_OK;
}

static tl_status spec_next(tl_session *s, int32_t *token) {
    spec_state *sp = s->mode_state;
    tl_status st;
    if (sp->node < 0 && (st = begin_cycle(s, sp)) != TL_OK) return st;
    if ((st = choose_verified(s, sp, token)) != TL_OK) return st;
    s->last_depth = s->loops;

    /* Walk down the tree while the verifier agrees with a drafted child. */
    const draft_tree *t = &sp->tree;
    int child = -1;
    for (int c = sp->node + 1; c < t->n && *token >= 0; c++)
        if (t->parent[c] == sp->node && t->token[c] == *token) { child = c; break; }
    if (child >= 0) {
        sp->path[++sp->depth] = child;
        sp->node = child;
        s->stats.accepted++;
    } else {
        st = end_cycle(s, sp);
    }
    tl_stats_finish_speculative(&s->stats, sp->depth_offered);
    return st;
}

const tl_decoder tl_speculative_decoder = {"speculative", spec_open, spec_next, spec_close, spec_sequence_rows, spec_clone};

/* ---------------------------------------------------------------- blocking calls */

/* A generation config in speculative mode from a speculative config. */
static tl_generate_config speculative_generate_config(const tl_speculative_config *c, tl_speculative_mode mode) {
    tl_generate_config g;
    if (c->base) g = *c->base;
    else tl_generate_config_init(&g);
    g.max_tokens = c->max_tokens;
    g.loops = c->verify_loops;
    g.temperature = c->temperature;
    g.sample_seed = c->seed;
    g.speculative = mode;
    g.draft_loops = c->draft_loops;
    g.draft_ahead = c->draft_ahead;
    return g;
}

static tl_status run_speculative(const tl_model *model, const int32_t *prompt, int prompt_len,
                                 const tl_generate_config *g, int32_t *out, int out_capacity, int *out_len,
                                 tl_speculative_stats *stats) {
    tl_generate_stats gen;
    tl_status st = tl_generate(model, prompt, prompt_len, g, out, out_capacity, out_len, &gen);
    if (stats) tl_stats_to_speculative(&gen, stats);
    return st;
}

tl_status tl_generate_speculative(const tl_model *model, const int32_t *prompt, int prompt_len,
                                  const tl_speculative_config *cfg, int32_t *out, int out_capacity,
                                  int *out_len, tl_speculative_stats *stats) {
    tl_clear_error();
    if (stats) memset(stats, 0, sizeof *stats);
    tl_status st = tl_speculative_validate(model, cfg);
    if (st != TL_OK) return st;
    const tl_generate_config g = speculative_generate_config(cfg, TL_SPECULATIVE_CHAIN);
    return run_speculative(model, prompt, prompt_len, &g, out, out_capacity, out_len, stats);
}

tl_status tl_generate_tree_speculative(const tl_model *model, const int32_t *prompt, int prompt_len,
                                       const tl_tree_speculative_config *cfg, int32_t *out,
                                       int out_capacity, int *out_len, tl_speculative_stats *stats) {
    tl_clear_error();
    if (stats) memset(stats, 0, sizeof *stats);
    if (!cfg) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tree speculative config must not be NULL");
    tl_status st = tl_speculative_validate(model, &cfg->spec);
    if (st != TL_OK) return st;
    tl_generate_config g = speculative_generate_config(&cfg->spec, TL_SPECULATIVE_TREE);
    g.K_branches = cfg->K_branches;
    g.max_nodes = cfg->max_nodes;
    return run_speculative(model, prompt, prompt_len, &g, out, out_capacity, out_len, stats);
}

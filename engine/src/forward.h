/* forward.h: the looped forward pass (SPEC §1) over a chunk of new tokens, composed of
 * the backend's operations (backend.h) over the backend's buffers.
 *
 * It runs in three stages so that callers can decide the depth token by token
 * (early exit) or stop after a shallow draft:
 *     tl_forward_begin   embed + prelude; loop state initialised
 *     tl_forward_loop    one application of the shared block (call L times)
 *     tl_forward_end     coda + final norm + head; the chunk's rows join the cache */
#ifndef TL_FORWARD_H
#define TL_FORWARD_H

#include "backend.h"
#include "kv_cache.h"

/* Scratch activations of one session, sized for `rows` tokens per forward: buffers of the
   model's backend (the host reads none of them). */
typedef struct tl_workspace {
    const struct tl_backend *backend; /* owner of the buffers (set by reserve) */
    void *backend_ctx;
    int rows, scratch_per_thread, threads;
    float *x;     /* [rows][d]     residual stream of the layer being run */
    float *e;     /* [rows][d]     injected input (prelude output) */
    float *s;     /* [rows][d]     loop state */
    float *u;     /* [rows][d]     block input of the current loop */
    float *cat;   /* [rows][2d]    [s ; e] for concat injection */
    float *h;     /* [rows][d]     normed input of a sub-layer, then its output */
    float *q;     /* [rows][n_heads*head_dim] */
    float *k;     /* [rows][kv_dim] */
    float *v;     /* [rows][kv_dim] */
    float *att;   /* [rows][n_heads*head_dim] attention output before o-proj */
    float *ff_a;  /* [rows][d_ff] */
    float *ff_b;  /* [rows][d_ff] */
    float *attn_scratch; /* [threads][scratch_per_thread * TL_ATTENTION_SCORE_SLOTS] softmax scores */
    float *s_before; /* [1][d]       row 0 of the loop state before a measured loop */
    /* Seed of the random initial loop state (cfg.initial_state "truncated_normal"): 0 keeps
       the zero state (tl_score, so that scores are deterministic); a generation sets it from
       its sample_seed. Each token's state is then a function of (seed, its position) alone
       (backend.h: state_init_random), identical in prefill, decode, drafts and verification. */
    uint64_t state_seed;
    /* Calibration only (calibrate.c; NULL otherwise): called with the input of every matrix
       product of a layer before the product, x [n][w[0]->cols], read by the `count` matrices
       w (q/k/v, or gate/up, share one input). The forward never reads anything back from it.
       x is backend memory, so only a host backend (the CPU's) may have it set. */
    void (*observe)(void *ctx, const tl_matrix *const *w, int count, const float *x, int n);
    void *observe_ctx;
} tl_workspace;

/* Grows the workspace (never shrinks) to hold `rows` tokens against a cache of
   `cache_capacity` physical rows. A zeroed workspace is empty; one workspace serves one
   backend. */
tl_status tl_workspace_reserve(tl_workspace *ws, const tl_model *m, int rows, int cache_capacity);
void tl_workspace_release(tl_workspace *ws);

/* The rows of one KV cache within a forward. A forward over one sequence has one part; a
   batched forward (tl_forward_batch) has one per session, each with its own cache, mask
   and depth, while every row-wise operation runs over all rows at once. */
typedef struct tl_forward_part {
    tl_kv_cache *cache;
    const uint8_t *mask;      /* see tl_forward_begin_masked, or NULL (causal) */
    int mask_start;
    int row;                  /* the part's first row in the workspace */
    int n;                    /* its rows */
    int base;                 /* cache->length when the forward began */
    int loops;                /* its depth (batched forwards) */
    uint64_t state_seed;      /* random initial state (cfg.state_init): its sequence's seed,
                                 0 = a zero state; single forwards take ws->state_seed */
} tl_forward_part;

typedef struct tl_forward {
    const tl_model *m;
    tl_workspace *ws;
    const int32_t *positions; /* [n] host, every part's rows */
    tl_forward_part *parts;   /* [n_parts] (points at `one` for a single sequence: a
                                 tl_forward is not to be copied while in use) */
    int n_parts;
    int n;                    /* rows of every part */
    int loops_done;
    tl_forward_part one;
    tl_attention_args *attention; /* [n_parts] scratch of the attention calls */
    tl_attention_args attention_one;
} tl_forward;

/* tokens/positions: [n]; mask: NULL for causal, else mask[i*n+j] != 0 when chunk row i
   may see chunk row j (rows always see the whole cached prefix within the window).
   The arrays must stay valid until tl_forward_end. */
tl_status tl_forward_begin(tl_forward *f, const tl_model *m, tl_kv_cache *cache,
                           tl_workspace *ws, const int32_t *tokens, const int32_t *positions,
                           int n, const uint8_t *mask);
/* Tree attention over entries already in the cache too (speculative drafting): mask is
   [n][base + n - mask_start], mask[i][c] != 0 when chunk row i may see entry
   mask_start + c; entries before mask_start are the always-visible prefix. */
tl_status tl_forward_begin_masked(tl_forward *f, const tl_model *m, tl_kv_cache *cache,
                                  tl_workspace *ws, const int32_t *tokens,
                                  const int32_t *positions, int n, const uint8_t *mask,
                                  int mask_start);

/* Loop states kept from one forward for a later one: each kept row's injected input e and
   loop state s (backend buffers [rows][d]). A speculative draft keeps every drafted row's
   state after draft_loops, and the verifier resumes its rows from them instead of running
   the prelude and those loops again: the same token at the same position, attending over the
   same entries, gets bit-identical states (batch invariance), and the K/V the draft wrote for
   the prelude and those loops stay in the pages after the rollback (tl_kv_truncate only
   moves the length), identical to what the verifier would write. */
typedef struct tl_kept_states {
    const struct tl_backend *backend;
    void *backend_ctx;
    float *e, *s;  /* [rows][d] */
    int rows;
} tl_kept_states;
/* Room for `rows` kept states (what was kept before is dropped); a zeroed one is empty. */
tl_status tl_kept_states_reserve(tl_kept_states *k, const tl_model *m, int rows);
void tl_kept_states_release(tl_kept_states *k);
/* Keeps rows [from, from + n) of the forward's loop state as kept rows [at, at + n). */
void tl_forward_keep(const tl_forward *f, int from, int n, tl_kept_states *k, int at);
/* tl_forward_begin for rows that earlier forwards already took through the prelude and the
   first `loops_done` loops, whose states are kept rows [0, n), at the cache entries this
   forward appends (they wrote those layers' K/V there, then were rolled back). The forward
   goes on at loop loops_done + 1; its results are bit-identical to those of tl_forward_begin
   when the kept rows were computed with the same tokens, positions and visible entries. */
tl_status tl_forward_begin_kept(tl_forward *f, const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                                const int32_t *tokens, const int32_t *positions, int n, const uint8_t *mask,
                                const tl_kept_states *k, int loops_done);
void tl_forward_loop(tl_forward *f);
/* tl_forward_loop, and the early-exit measure of how much it moved row 0's loop state:
   *relative_change = sqrt(sum (s_new - s_old)^2 / sum s_new^2), in double, or +infinity
   when s_new is all zero (so that `change < threshold` fails as `norm > 0` did). */
void tl_forward_loop_measured(tl_forward *f, double *relative_change);
/* Runs the coda, then the head for rows [logits_from, n) into logits
   [(n - logits_from)][vocab] (logits may be NULL to skip the head). */
void tl_forward_end(tl_forward *f, int logits_from, float *logits);

/* tl_forward_end in two parts. The head may run several times between loops (early-exit
   probes: coda + head on the current loop state, rewriting the coda's K/V); commit records
   the depth reached and appends the chunk's rows to the cache. */
void tl_forward_head(tl_forward *f, int logits_from, float *logits);
void tl_forward_commit(tl_forward *f);

/* tl_forward_end bringing back the head's input instead of the logits: the coda, then
   hidden[n][d] (host) = final_norm of every row (backend.h: hidden); the rows join the cache. */
void tl_forward_end_hidden(tl_forward *f, float *hidden);

/* Forwards tokens[0..n) (n >= 0) in chunks of at most `chunk` rows at `loops`; when
   last_logits is not NULL it receives the logits of the last token (n must then be >= 1).
   Results do not depend on `chunk` (batch invariance); it only bounds activation memory. */
tl_status tl_forward_sequence(const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                              const int32_t *tokens, const int32_t *positions, int n, int chunk,
                              int loops, float *last_logits);

/* One forward over several sequences at once, each in its own cache (continuous
   batching): parts[i] has `n` rows starting at workspace row parts[i].row, tokens and
   positions [sum n] hold every part's rows in that order, and parts must be sorted by
   `loops`, deepest first (rows of shallower parts stop looping early, so the rows still
   looping are always a prefix). For each part with want_logits[i], logits [k][vocab]
   receives its LAST row's logits, in part order (k = parts wanting them). Each row's
   result is bit-identical to forwarding its sequence alone (batch invariance). */
tl_status tl_forward_batch(const tl_model *m, tl_workspace *ws, tl_forward_part *parts, int n_parts,
                           const int32_t *tokens, const int32_t *positions, const bool *want_logits,
                           float *logits);

/* tl_forward_batch bringing back every row's head input instead of the last rows' logits:
   hidden [sum n][d] (host) = final_norm of each row, in part order (backend.h: hidden).
   Each row is bit-identical to tl_forward_run_hidden over its sequence alone. */
tl_status tl_forward_batch_hidden(const tl_model *m, tl_workspace *ws, tl_forward_part *parts, int n_parts,
                                  const int32_t *tokens, const int32_t *positions, float *hidden);

/* begin + `loops` x loop + end. */
tl_status tl_forward_run(const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                         const int32_t *tokens, const int32_t *positions, int n,
                         const uint8_t *mask, int loops, int logits_from, float *logits);
/* begin + `loops` x loop + end_hidden (causal): hidden [n][d] on the host. */
tl_status tl_forward_run_hidden(const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                                const int32_t *tokens, const int32_t *positions, int n, int loops,
                                float *hidden);

#endif

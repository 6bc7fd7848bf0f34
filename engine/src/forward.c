/* forward.c: prelude -> shared loop block x L -> coda -> head, composed of the backend's
 * operations (backend.h). Nothing here touches an activation: the buffers are the
 * backend's, and the only host data are token ids, positions, the mask, the cache's row
 * bookkeeping and, at the very end, the logits. (The calibration hook, tl_workspace.observe,
 * only passes a matrix input's address on to calibrate.c, which reads it on the CPU backend.)
 * Reads in data-flow order: workspace, one layer, the stages (begin: embed +
 * prelude; loop; head: coda + final norm + lm_head; commit). */
#include <stdint.h>
#include <stdlib.h>

#include "forward.h"

/* ---------------------------------------------------------------- workspace */

void tl_workspace_release(tl_workspace *ws) {
    float **bufs[] = {&ws->x, &ws->e, &ws->s, &ws->u, &ws->cat, &ws->h, &ws->q, &ws->k, &ws->v,
                      &ws->att, &ws->ff_a, &ws->ff_b, &ws->attn_scratch, &ws->s_before};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        if (*bufs[i]) ws->backend->free(ws->backend_ctx, *bufs[i]);
        *bufs[i] = NULL;
    }
    ws->rows = ws->scratch_per_thread = ws->threads = 0;
}

tl_status tl_workspace_reserve(tl_workspace *ws, const tl_model *m, int rows, int cache_capacity) {
    const tl_config *c = &m->cfg;
    const tl_backend *be = m->backend;
    int threads = be->threads(m->backend_ctx);
    if (ws->backend != be || ws->backend_ctx != m->backend_ctx) {
        /* Buffers of another backend (or none yet): start empty on this one. */
        if (ws->backend) tl_workspace_release(ws);
        ws->backend = be;
        ws->backend_ctx = m->backend_ctx;
    }
    if (rows <= ws->rows && cache_capacity <= ws->scratch_per_thread && threads <= ws->threads)
        return TL_OK;
    if (rows < ws->rows) rows = ws->rows;
    if (cache_capacity < ws->scratch_per_thread) cache_capacity = ws->scratch_per_thread;
    tl_workspace_release(ws);
    size_t r = (size_t)rows, d = (size_t)c->d_model, qd = (size_t)(c->n_heads * c->head_dim),
           kvd = (size_t)(c->n_kv_heads * c->head_dim), ff = (size_t)c->d_ff;
    void *ctx = m->backend_ctx;
    ws->x = be->alloc(ctx, r * d * sizeof(float));
    ws->e = be->alloc(ctx, r * d * sizeof(float));
    ws->s = be->alloc(ctx, r * d * sizeof(float));
    ws->u = be->alloc(ctx, r * d * sizeof(float));
    ws->cat = be->alloc(ctx, r * 2 * d * sizeof(float));
    ws->h = be->alloc(ctx, r * d * sizeof(float));
    ws->q = be->alloc(ctx, r * qd * sizeof(float));
    ws->k = be->alloc(ctx, r * kvd * sizeof(float));
    ws->v = be->alloc(ctx, r * kvd * sizeof(float));
    ws->att = be->alloc(ctx, r * qd * sizeof(float));
    ws->ff_a = be->alloc(ctx, r * ff * sizeof(float));
    ws->ff_b = be->alloc(ctx, r * ff * sizeof(float));
    ws->attn_scratch = be->alloc(ctx, (size_t)threads * (size_t)cache_capacity *
                                          (size_t)TL_ATTENTION_SCORE_SLOTS * sizeof(float));
    ws->s_before = be->alloc(ctx, d * sizeof(float));
    if (!ws->x || !ws->e || !ws->s || !ws->u || !ws->cat || !ws->h || !ws->q || !ws->k ||
        !ws->v || !ws->att || !ws->ff_a || !ws->ff_b || !ws->attn_scratch || !ws->s_before) {
        tl_workspace_release(ws);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory for activations of %d rows", rows);
    }
    ws->rows = rows;
    ws->scratch_per_thread = cache_capacity;
    ws->threads = threads;
    return TL_OK;
}

/* ---------------------------------------------------------------- one layer */

/* Adds a sub-layer's output h [n][d] to the residual stream x [n][d], with the norms the
   placement puts around it (cfg.norm_placement): "pre" x += h; "pre_post" x += norm(h);
   "sandwich" x = norm(x + h). */
static void residual_add(tl_forward *f, int n, float *h, const float *out_w, const float *out_b) {
    const tl_model *m = f->m;
    const tl_backend *be = m->backend;
    float *x = f->ws->x;
    const size_t nd = (size_t)n * (size_t)m->cfg.d_model;
    switch (m->cfg.norm_placement) {
    case TL_PLACE_PRE:
        be->add(m, x, h, nd);
        break;
    case TL_PLACE_PRE_POST:
        be->norm(m, h, n, out_w, out_b, h);
        be->add(m, x, h, nd);
        break;
    case TL_PLACE_SANDWICH:
        be->add(m, x, h, nd);
        be->norm(m, x, n, out_w, out_b, x);
        break;
    }
}

/* Hands a product's input to the calibration hook, when one is set (forward.h). */
static void observe(const tl_workspace *ws, const tl_matrix *const *w, int count, const float *x, int n) {
    if (ws->observe) ws->observe(ws->observe_ctx, w, count, x, n);
}

/* One transformer layer on the first n rows (x [n][d] in place; the rows still looping),
   writing the layer's K/V into `slot` (for block layers, the slot of loop `loop`) of each
   part's cache. */
static void layer_forward(tl_forward *f, const tl_layer *L, int slot, int loop, int n) {
    const tl_model *m = f->m;
    const tl_config *c = &m->cfg;
    const tl_backend *be = m->backend;
    tl_workspace *ws = f->ws;
    const size_t qd = (size_t)(c->n_heads * c->head_dim), kvd = (size_t)(c->n_kv_heads * c->head_dim);
    /* q/k biases go in with the projection, before RoPE, except under the test hook that
       reproduces the classic mistake of adding them after it. */
    const bool bias_after_rope = c->qk_bias_after_rope && c->pos_encoding == TL_POS_ROPE;

    /* Attention: h [n][d] = norm(x); q [n][qd], k, v [n][kvd] projections, positions on
       q and k, each part's k and v into its cache, att [n][qd] over cache + chunk. */
    be->norm(m, ws->x, n, L->attn_norm_w, L->attn_norm_b, ws->h);
    const tl_matmul_out qkv[3] = {{&L->q, bias_after_rope ? NULL : L->q_b, ws->q, false, false},
                                  {&L->k, bias_after_rope ? NULL : L->k_b, ws->k, false, false},
                                  {&L->v, L->v_b, ws->v, false, false}};
    observe(ws, (const tl_matrix *const[]){&L->q, &L->k, &L->v}, 3, ws->h, n);
    const int write_slot = loop ? slot + (loop - 1) * c->n_block : slot;
    int n_attention = 0;
    for (int i = 0; i < f->n_parts && f->parts[i].row < n; i++) {
        const tl_forward_part *p = &f->parts[i];
        const size_t row = (size_t)p->row;
        f->attention[n_attention++] = (tl_attention_args){
            ws->q + row * qd, ws->att + row * qd, p->n, p->cache, p->base, slot, loop, c->n_block,
            f->positions + p->row, p->mask, p->mask_start, ws->attn_scratch,
            ws->scratch_per_thread * TL_ATTENTION_SCORE_SLOTS, p->row};
    }
    /* h [n][d] = o(att), the projection reading att [n][qd] (observed after the pass:
       att is still there) */
    const bool rope = c->pos_encoding == TL_POS_ROPE;
    const tl_matmul_out o = {&L->o, L->o_b, ws->h, false, false};
    if (!bias_after_rope && be->qkv_attention &&
        be->qkv_attention(m, ws->h, n, qkv, rope ? f->positions : NULL, write_slot, f->attention, n_attention,
                          ws->att, &o)) {
        /* done in one pass */
    } else {
        be->matmul_group(m, ws->h, n, qkv, 3);
        if (rope) be->rope(m, ws->q, ws->k, n, f->positions);
        if (bias_after_rope) {
            if (L->q_b) be->add_rows(m, ws->q, n, c->n_heads * c->head_dim, L->q_b);
            if (L->k_b) be->add_rows(m, ws->k, n, c->n_kv_heads * c->head_dim, L->k_b);
        }
        for (int i = 0; i < n_attention; i++) {
            const tl_forward_part *p = &f->parts[i];
            be->kv_write(m, p->cache, write_slot, p->base, ws->k + (size_t)p->row * kvd,
                         ws->v + (size_t)p->row * kvd, p->n);
        }
        be->attention(m, f->attention, n_attention);
        be->matmul(m, ws->att, n, &L->o, L->o_b, ws->h);
    }
    observe(ws, (const tl_matrix *const[]){&L->o}, 1, ws->att, n);
    /* x [n][d] += h (with the placement's norms) */
    residual_add(f, n, ws->h, L->attn_out_norm_w, L->attn_out_norm_b);

    /* MLP: h [n][d] = norm(x); ff_a [n][d_ff] = act(...) (ff_b [n][d_ff]: swiglu's up);
       h [n][d] = down(ff_a); x [n][d] += h (with the placement's norms) */
    be->norm(m, ws->x, n, L->mlp_norm_w, L->mlp_norm_b, ws->h);
    /* ff_a = gelu(up) or silu(gate) * up, applied by the product (backend.h) */
    const bool gelu = c->mlp == TL_MLP_GELU;
    const tl_matmul_out act[2] = {gelu ? (tl_matmul_out){&L->up, L->up_b, ws->ff_a, true, false}
                                       : (tl_matmul_out){&L->gate, L->gate_b, ws->ff_a, false, true},
                                  {&L->up, L->up_b, ws->ff_b, false, false}};
    const int n_act = gelu ? 1 : 2;
    const tl_matmul_out down = {&L->down, L->down_b, ws->h, false, false};
    observe(ws, gelu ? (const tl_matrix *const[]){&L->up} : (const tl_matrix *const[]){&L->gate, &L->up}, n_act,
            ws->h, n);
    if (be->matmul_then) {
        be->matmul_then(m, ws->h, n, act, n_act, &down);
    } else {
        be->matmul_group(m, ws->h, n, act, n_act);
        be->matmul(m, ws->ff_a, n, &L->down, L->down_b, ws->h);
    }
    observe(ws, (const tl_matrix *const[]){&L->down}, 1, ws->ff_a, n); /* ff_a is still there */
    residual_add(f, n, ws->h, L->mlp_out_norm_w, L->mlp_out_norm_b);
}

/* Rows still looping at loop `loop`: the parts are sorted deepest first, so a prefix. */
static int rows_looping(const tl_forward *f, int loop) {
    int n = 0;
    for (int i = 0; i < f->n_parts && f->parts[i].loops >= loop; i++) n += f->parts[i].n;
    return n;
}

/* ---------------------------------------------------------------- begin: embed + prelude */

tl_status tl_forward_begin(tl_forward *f, const tl_model *m, tl_kv_cache *cache,
                           tl_workspace *ws, const int32_t *tokens, const int32_t *positions,
                           int n, const uint8_t *mask) {
    return tl_forward_begin_masked(f, m, cache, ws, tokens, positions, n, mask, cache->length);
}

/* Checks one part against its cache; records its rows' positions in the cache's
   bookkeeping (the prelude's attention already sees the chunk's rows). */
static tl_status start_part(const tl_model *m, tl_forward_part *p, const int32_t *tokens,
                            const int32_t *positions) {
    const tl_config *c = &m->cfg;
    tl_kv_cache *cache = p->cache;
    const int n = p->n;
    if (cache->model != m) /* its K/V would have another shape, or be another device's memory */
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "forward: the KV cache was made for another model");
    if (p->mask_start < 0 || p->mask_start > cache->length ||
        (long)cache->length + n - p->mask_start > cache->capacity)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "forward: mask_start %d outside the cache (%d entries)",
                       p->mask_start, cache->length);
    if (n < 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "forward: n = %d tokens, need >= 1", n);
    if (cache->window == 0 && cache->length + n > cache->capacity)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "forward: %d cached + %d new tokens exceed the cache capacity %d",
                       cache->length, n, cache->capacity);
    if (cache->window > 0 && n > cache->max_chunk)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "forward: chunk of %d tokens exceeds the windowed cache's chunk limit %d",
                       n, cache->max_chunk);
    for (int t = 0; t < n; t++) {
        if (tokens[t] < 0 || tokens[t] >= c->vocab_size)
            return tl_fail(TL_ERR_INVALID_ARGUMENT,
                           "token id %d at index %d is out of range [0, %d)", tokens[t], t,
                           c->vocab_size);
        if (positions[t] < 0 || positions[t] >= c->max_seq_len)
            return tl_fail(TL_ERR_INVALID_ARGUMENT,
                           "position %d at index %d is out of range [0, max_seq_len = %d)",
                           positions[t], t, c->max_seq_len);
    }
    /* Pages for the rows first (allocated, or copied where shared with a fork), so that
       no layer has to allocate in the middle of the pass. */
    tl_status st = tl_kv_reserve(cache, cache->length, n);
    if (st != TL_OK) return st;
    p->base = cache->length;
    for (int t = 0; t < n; t++) {
        cache->pos[tl_kv_row(cache, p->base + t)] = positions[t];
        cache->logical[tl_kv_row(cache, p->base + t)] = p->base + t;
    }
    return TL_OK;
}

/* Checks every part and sizes the workspace: the forward's rows are then in the caches'
   bookkeeping, nothing computed yet. */
static tl_status open_parts(tl_forward *f, const tl_model *m, tl_workspace *ws, tl_forward_part *parts,
                            int n_parts, const int32_t *tokens, const int32_t *positions) {
    int rows = 0, capacity = 0;
    for (int i = 0; i < n_parts; i++) {
        parts[i].row = rows;
        tl_status st = start_part(m, &parts[i], tokens + rows, positions + rows);
        if (st != TL_OK) return st;
        rows += parts[i].n;
        if (parts[i].cache->capacity > capacity) capacity = parts[i].cache->capacity;
    }
    tl_status st = tl_workspace_reserve(ws, m, rows, capacity);
    if (st != TL_OK) return st;
    f->m = m;
    f->ws = ws;
    f->positions = positions;
    f->parts = parts;
    f->n_parts = n_parts;
    f->n = rows;
    f->loops_done = 0;
    return TL_OK;
}

/* A forward over one sequence: its one part. */
static void one_part(tl_forward *f, tl_kv_cache *cache, const tl_workspace *ws, int n, const uint8_t *mask,
                     int mask_start) {
    f->one = (tl_forward_part){cache, mask, mask_start, 0, n, 0, INT32_MAX, ws->state_seed};
    f->attention = &f->attention_one;
}

/* Checks every part, sizes the workspace, then embed + prelude for all rows. */
static tl_status start(tl_forward *f, const tl_model *m, tl_workspace *ws, tl_forward_part *parts,
                       int n_parts, const int32_t *tokens, const int32_t *positions) {
    tl_status st = open_parts(f, m, ws, parts, n_parts, tokens, positions);
    if (st != TL_OK) return st;
    const int rows = f->n;
    const tl_config *c = &m->cfg;
    const tl_backend *be = m->backend;
    be->embed(m, tokens, positions, rows, ws->x); /* x [n][d] */
    for (int i = 0; i < c->n_prelude; i++) layer_forward(f, &m->w.prelude[i], i, 0, rows);
    be->loop_init(m, ws->x, rows, ws->e, ws->s); /* e [n][d] = x; s [n][d] = e or 0 */
    /* s [rows][d] drawn per token for a random initial state, each part with its seed */
    for (int i = 0; c->state_init == TL_STATE_TRUNCATED_NORMAL && i < n_parts; i++)
        if (parts[i].state_seed != 0)
            be->state_init_random(m, ws->s + (size_t)parts[i].row * (size_t)c->d_model, parts[i].n,
                                  positions + parts[i].row, parts[i].state_seed);
    return TL_OK;
}

tl_status tl_forward_begin_masked(tl_forward *f, const tl_model *m, tl_kv_cache *cache,
                                  tl_workspace *ws, const int32_t *tokens,
                                  const int32_t *positions, int n, const uint8_t *mask,
                                  int mask_start) {
    one_part(f, cache, ws, n, mask, mask_start);
    return start(f, m, ws, &f->one, 1, tokens, positions);
}

/* ---------------------------------------------------------------- kept loop states */

void tl_kept_states_release(tl_kept_states *k) {
    if (k->e) k->backend->free(k->backend_ctx, k->e);
    if (k->s) k->backend->free(k->backend_ctx, k->s);
    k->e = k->s = NULL;
    k->rows = 0;
}

tl_status tl_kept_states_reserve(tl_kept_states *k, const tl_model *m, int rows) {
    const size_t bytes = (size_t)rows * (size_t)m->cfg.d_model * sizeof(float);
    tl_kept_states_release(k);
    k->backend = m->backend;
    k->backend_ctx = m->backend_ctx;
    k->e = m->backend->alloc(m->backend_ctx, bytes);
    k->s = m->backend->alloc(m->backend_ctx, bytes);
    if (!k->e || !k->s) {
        tl_kept_states_release(k);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory for %d kept loop states", rows);
    }
    k->rows = rows;
    return TL_OK;
}

void tl_forward_keep(const tl_forward *f, int from, int n, tl_kept_states *k, int at) {
    const tl_model *m = f->m;
    const size_t d = (size_t)m->cfg.d_model;
    m->backend->copy(m, k->e + (size_t)at * d, f->ws->e + (size_t)from * d, (size_t)n * d);
    m->backend->copy(m, k->s + (size_t)at * d, f->ws->s + (size_t)from * d, (size_t)n * d);
}

tl_status tl_forward_begin_kept(tl_forward *f, const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                                const int32_t *tokens, const int32_t *positions, int n, const uint8_t *mask,
                                const tl_kept_states *k, int loops_done) {
    const bool ours = k->backend == m->backend && k->backend_ctx == m->backend_ctx;
    if (!ours || n > k->rows)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "forward: %d rows to resume, %d kept states of this model", n,
                       ours ? k->rows : 0);
    one_part(f, cache, ws, n, mask, cache->length);
    tl_status st = open_parts(f, m, ws, &f->one, 1, tokens, positions);
    if (st != TL_OK) return st;
    const size_t nd = (size_t)n * (size_t)m->cfg.d_model;
    m->backend->copy(m, ws->e, k->e, nd);
    m->backend->copy(m, ws->s, k->s, nd);
    f->loops_done = loops_done;
    return TL_OK;
}

/* ---------------------------------------------------------------- the loop */

void tl_forward_loop(tl_forward *f) {
    const tl_model *m = f->m;
    const tl_config *c = &m->cfg;
    const tl_backend *be = m->backend;
    tl_workspace *ws = f->ws;
    const int loop = ++f->loops_done, n = rows_looping(f, loop);

    /* u [n][d] = inject(s, e) (cat [n][2d]: concat's input), the block's input; x [n][d]
       runs through the block; s [n][d] moves towards x (and is normed). Rows of shallower
       parts keep their final state. */
    be->inject(m, ws->s, ws->e, n, ws->cat, ws->u);
    /* concat: cat = [s ; e] is the inject matrix's input (the backend fills it in inject) */
    if (c->injection == TL_INJECT_CONCAT) observe(ws, (const tl_matrix *const[]){&m->w.inject}, 1, ws->cat, n);
    be->copy(m, ws->x, ws->u, (size_t)n * (size_t)c->d_model);
    for (int i = 0; i < c->n_block; i++) layer_forward(f, &m->w.block[i], c->n_prelude + i, loop, n);
    be->loop_update(m, ws->s, ws->x, ws->u, n);
}

void tl_forward_loop_measured(tl_forward *f, double *relative_change) {
    const tl_model *m = f->m;
    tl_workspace *ws = f->ws;
    /* s_before [1][d] = row 0 of s: the backend keeps it, only the number comes back. */
    m->backend->copy(m, ws->s_before, ws->s, (size_t)m->cfg.d_model);
    tl_forward_loop(f);
    *relative_change = m->backend->state_change(m, ws->s, ws->s_before);
}

/* ---------------------------------------------------------------- head: coda + logits */

/* x [n][d] = the coda's output for every row. */
static void coda(tl_forward *f) {
    const tl_model *m = f->m;
    const tl_config *c = &m->cfg;
    const tl_backend *be = m->backend;
    tl_workspace *ws = f->ws;
    const int n = f->n;

    /* x [n][d] = the coda's input: the state itself ("replace") or injected ("residual"). */
    if (c->loop_update == TL_UPDATE_REPLACE) be->copy(m, ws->x, ws->s, (size_t)n * (size_t)c->d_model);
    else {
        be->inject(m, ws->s, ws->e, n, ws->cat, ws->x);
        if (c->injection == TL_INJECT_CONCAT) observe(ws, (const tl_matrix *const[]){&m->w.inject}, 1, ws->cat, n);
    }
    /* Huginn's ln_f, first use: x [n][d] = final_norm(x) (the head applies it again). */
    if (c->final_norm_before_coda) be->norm(m, ws->x, n, m->w.final_norm_w, m->w.final_norm_b, ws->x);
    const int coda_slot = c->n_prelude + c->n_block * c->max_loops;
    for (int i = 0; i < c->n_coda; i++) layer_forward(f, &m->w.coda[i], coda_slot + i, 0, n);
}

void tl_forward_head(tl_forward *f, int logits_from, float *logits) {
    const tl_model *m = f->m;
    const tl_backend *be = m->backend;
    tl_workspace *ws = f->ws;
    const int n = f->n, d = m->cfg.d_model;
    coda(f);

    /* logits [n - logits_from][vocab], host = lm_head(final_norm(x rows [logits_from, n)))
       (no final norm when cfg.final_norm_at_head is false) with h [n][d] as scratch. */
    if (logits && logits_from < n)
        be->head(m, ws->x + (size_t)logits_from * (size_t)d, n - logits_from, ws->h, logits);
}

/* ---------------------------------------------------------------- commit, and whole runs */

void tl_forward_commit(tl_forward *f) {
    for (int i = 0; i < f->n_parts; i++) {
        tl_forward_part *p = &f->parts[i];
        const int depth = p->loops < f->loops_done ? p->loops : f->loops_done;
        for (int t = 0; t < p->n; t++)
            p->cache->depth[tl_kv_row(p->cache, p->base + t)] = (uint16_t)(depth > 0 ? depth : 1);
        p->cache->length += p->n;
    }
}

void tl_forward_end(tl_forward *f, int logits_from, float *logits) {
    tl_forward_head(f, logits_from, logits);
    tl_forward_commit(f);
}

void tl_forward_end_hidden(tl_forward *f, float *hidden) {
    coda(f);
    f->m->backend->hidden(f->m, f->ws->x, f->n, hidden);
    tl_forward_commit(f);
}

tl_status tl_forward_sequence(const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                              const int32_t *tokens, const int32_t *positions, int n, int chunk,
                              int loops, float *last_logits) {
    for (int start = 0; start < n; start += chunk) {
        const int len = n - start < chunk ? n - start : chunk;
        const bool last = start + len == n && last_logits;
        tl_status st = tl_forward_run(m, cache, ws, tokens + start, positions + start, len, NULL, loops,
                                      last ? len - 1 : len, last ? last_logits : NULL);
        if (st != TL_OK) return st;
    }
    return TL_OK;
}

/* A forward's depth: deeper loops than max_loops have no cache slot. */
static tl_status check_loops(const tl_model *m, int loops) {
    if (loops < 0 || loops > m->cfg.max_loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "forward: loops = %d outside [0, max_loops = %d]", loops, m->cfg.max_loops);
    return TL_OK;
}

/* A batched forward up to its end: every part's rows begun, looped to its depth and taken
   through the coda (x [rows][d]); the caller then reads its outputs and commits. */
static tl_status batch_to_coda(tl_forward *f, const tl_model *m, tl_workspace *ws, tl_forward_part *parts,
                               int n_parts, const int32_t *tokens, const int32_t *positions) {
    f->attention = NULL;
    if (n_parts < 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "forward: n_parts = %d, need >= 1", n_parts);
    for (int i = 1; i < n_parts; i++)
        if (parts[i].loops > parts[i - 1].loops)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "forward: parts must be sorted deepest first");
    tl_status st = check_loops(m, parts[0].loops); /* the deepest part */
    if (st != TL_OK) return st;
    f->attention = malloc((size_t)n_parts * sizeof *f->attention);
    if (!f->attention) return tl_fail(TL_ERR_NO_MEMORY, "forward: out of memory for %d parts", n_parts);
    st = start(f, m, ws, parts, n_parts, tokens, positions);
    if (st != TL_OK) return st;
    for (int l = 0; l < parts[0].loops; l++) tl_forward_loop(f);
    coda(f);
    return TL_OK;
}

tl_status tl_forward_batch(const tl_model *m, tl_workspace *ws, tl_forward_part *parts, int n_parts,
                           const int32_t *tokens, const int32_t *positions, const bool *want_logits,
                           float *logits) {
    tl_forward f;
    tl_status st = batch_to_coda(&f, m, ws, parts, n_parts, tokens, positions);
    if (st == TL_OK) {
        /* u [k][d] = the last row of each part that wants logits (u is free after the
           loop), so that one head call reads lm_head once for the whole batch. */
        const size_t d = (size_t)m->cfg.d_model;
        int k = 0;
        for (int i = 0; i < n_parts; i++)
            if (want_logits[i])
                m->backend->copy(m, ws->u + (size_t)k++ * d, ws->x + (size_t)(parts[i].row + parts[i].n - 1) * d, d);
        if (k > 0) m->backend->head(m, ws->u, k, ws->h, logits);
        tl_forward_commit(&f);
    }
    free(f.attention);
    return st;
}

tl_status tl_forward_batch_hidden(const tl_model *m, tl_workspace *ws, tl_forward_part *parts, int n_parts,
                                  const int32_t *tokens, const int32_t *positions, float *hidden) {
    tl_forward f;
    tl_status st = batch_to_coda(&f, m, ws, parts, n_parts, tokens, positions);
    if (st == TL_OK) {
        m->backend->hidden(m, ws->x, f.n, hidden);
        tl_forward_commit(&f);
    }
    free(f.attention);
    return st;
}

/* begin + `loops` x loop: what the whole runs share before their end. */
static tl_status begin_and_loop(tl_forward *f, const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                                const int32_t *tokens, const int32_t *positions, int n, const uint8_t *mask, int loops) {
    tl_status st = check_loops(m, loops);
    if (st == TL_OK) st = tl_forward_begin(f, m, cache, ws, tokens, positions, n, mask);
    for (int l = 0; st == TL_OK && l < loops; l++) tl_forward_loop(f);
    return st;
}

tl_status tl_forward_run(const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                         const int32_t *tokens, const int32_t *positions, int n,
                         const uint8_t *mask, int loops, int logits_from, float *logits) {
    tl_forward f;
    tl_status st = begin_and_loop(&f, m, cache, ws, tokens, positions, n, mask, loops);
    if (st == TL_OK) tl_forward_end(&f, logits_from, logits);
    return st;
}

tl_status tl_forward_run_hidden(const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                                const int32_t *tokens, const int32_t *positions, int n, int loops,
                                float *hidden) {
    tl_forward f;
    tl_status st = begin_and_loop(&f, m, cache, ws, tokens, positions, n, NULL, loops);
    if (st == TL_OK) tl_forward_end_hidden(&f, hidden);
    return st;
}

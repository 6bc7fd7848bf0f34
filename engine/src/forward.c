/* forward.c: prelude -> shared loop block x L -> coda -> head, composed of the backend's
 * operations (backend.h). Nothing here touches an activation: the buffers are the
 * backend's, and the only host data are token ids, positions, the mask, the cache's row
 * bookkeeping and, at the very end, the logits.
 * Reads in data-flow order: workspace, one layer, the stages (begin: embed +
 * prelude; loop; head: coda + final norm + lm_head; commit). */
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
    ws->attn_scratch = be->alloc(ctx, (size_t)threads * (size_t)cache_capacity * sizeof(float));
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
static void residual_add(tl_forward *f, float *h, const float *out_w, const float *out_b) {
    const tl_model *m = f->m;
    const tl_backend *be = m->backend;
    float *x = f->ws->x;
    const size_t nd = (size_t)f->n * (size_t)m->cfg.d_model;
    switch (m->cfg.norm_placement) {
    case TL_PLACE_PRE:
        be->add(m, x, h, nd);
        break;
    case TL_PLACE_PRE_POST:
        be->norm(m, h, f->n, out_w, out_b, h);
        be->add(m, x, h, nd);
        break;
    case TL_PLACE_SANDWICH:
        be->add(m, x, h, nd);
        be->norm(m, x, f->n, out_w, out_b, x);
        break;
    }
}

/* One transformer layer on the chunk (x [n][d] in place), writing the layer's K/V into
   `slot` (for block layers, the slot of loop `loop`). */
static void layer_forward(tl_forward *f, const tl_layer *L, int slot, int loop) {
    const tl_model *m = f->m;
    const tl_config *c = &m->cfg;
    const tl_backend *be = m->backend;
    tl_workspace *ws = f->ws;
    const int n = f->n;
    const size_t nff = (size_t)n * (size_t)c->d_ff;
    /* q/k biases go in with the projection, before RoPE, except under the test hook that
       reproduces the classic mistake of adding them after it. */
    const bool bias_after_rope = c->qk_bias_after_rope && c->pos_encoding == TL_POS_ROPE;

    /* Attention: h [n][d] = norm(x); q [n][qd], k, v [n][kvd] projections, positions on
       q and k, the chunk's k and v into the cache, att [n][qd] over cache + chunk. */
    be->norm(m, ws->x, n, L->attn_norm_w, L->attn_norm_b, ws->h);
    be->matmul(m, ws->h, n, &L->q, bias_after_rope ? NULL : L->q_b, ws->q);
    be->matmul(m, ws->h, n, &L->k, bias_after_rope ? NULL : L->k_b, ws->k);
    be->matmul(m, ws->h, n, &L->v, L->v_b, ws->v);
    if (c->pos_encoding == TL_POS_ROPE) {
        be->rope(m, ws->q, n, c->n_heads, f->positions);
        be->rope(m, ws->k, n, c->n_kv_heads, f->positions);
    }
    if (bias_after_rope) {
        if (L->q_b) be->add_rows(m, ws->q, n, c->n_heads * c->head_dim, L->q_b);
        if (L->k_b) be->add_rows(m, ws->k, n, c->n_kv_heads * c->head_dim, L->k_b);
    }
    const int write_slot = loop ? slot + (loop - 1) * c->n_block : slot;
    be->kv_write(m, f->cache, write_slot, f->base, ws->k, ws->v, n);
    tl_attention_args args = {ws->q, ws->att, n, f->cache, f->base, slot, loop, c->n_block,
                              f->positions, f->mask, f->mask_start, ws->attn_scratch};
    be->attention(m, &args);
    /* h [n][d] = o(att); x [n][d] += h (with the placement's norms) */
    be->matmul(m, ws->att, n, &L->o, L->o_b, ws->h);
    residual_add(f, ws->h, L->attn_out_norm_w, L->attn_out_norm_b);

    /* MLP: h [n][d] = norm(x); ff_a [n][d_ff] = act(...) (ff_b [n][d_ff]: swiglu's up);
       h [n][d] = down(ff_a); x [n][d] += h (with the placement's norms) */
    be->norm(m, ws->x, n, L->mlp_norm_w, L->mlp_norm_b, ws->h);
    if (c->mlp == TL_MLP_GELU) {
        be->matmul(m, ws->h, n, &L->up, L->up_b, ws->ff_a);
        be->gelu(m, ws->ff_a, nff);
    } else {
        be->matmul(m, ws->h, n, &L->gate, L->gate_b, ws->ff_a);
        be->matmul(m, ws->h, n, &L->up, L->up_b, ws->ff_b);
        be->swiglu(m, ws->ff_a, ws->ff_b, nff);
    }
    be->matmul(m, ws->ff_a, n, &L->down, L->down_b, ws->h);
    residual_add(f, ws->h, L->mlp_out_norm_w, L->mlp_out_norm_b);
}

/* ---------------------------------------------------------------- begin: embed + prelude */

tl_status tl_forward_begin(tl_forward *f, const tl_model *m, tl_kv_cache *cache,
                           tl_workspace *ws, const int32_t *tokens, const int32_t *positions,
                           int n, const uint8_t *mask) {
    return tl_forward_begin_masked(f, m, cache, ws, tokens, positions, n, mask, cache->length);
}

tl_status tl_forward_begin_masked(tl_forward *f, const tl_model *m, tl_kv_cache *cache,
                                  tl_workspace *ws, const int32_t *tokens,
                                  const int32_t *positions, int n, const uint8_t *mask,
                                  int mask_start) {
    const tl_config *c = &m->cfg;
    if (cache->backend != m->backend) /* its K/V would be another device's memory */
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "forward: the KV cache was made for another backend than "
                       "the model's (%s); create it with tl_kv_cache_new_for", m->backend->name);
    if (mask_start < 0 || mask_start > cache->length || (long)cache->length + n - mask_start > cache->capacity)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "forward: mask_start %d outside the cache (%d entries)",
                       mask_start, cache->length);
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
    tl_status st = tl_workspace_reserve(ws, m, n, cache->capacity);
    if (st != TL_OK) return st;
    *f = (tl_forward){m, cache, ws, positions, mask, n, cache->length, 0, mask_start};
    /* Row bookkeeping first: the prelude's attention already sees the chunk's rows. */
    for (int t = 0; t < n; t++) {
        cache->pos[tl_kv_row(cache, f->base + t)] = positions[t];
        cache->logical[tl_kv_row(cache, f->base + t)] = f->base + t;
    }

    const tl_backend *be = m->backend;
    be->embed(m, tokens, positions, n, ws->x); /* x [n][d] */
    for (int i = 0; i < c->n_prelude; i++) layer_forward(f, &m->w.prelude[i], i, 0);
    be->loop_init(m, ws->x, n, ws->e, ws->s); /* e [n][d] = x; s [n][d] = e or 0 */
    if (c->state_init == TL_STATE_TRUNCATED_NORMAL && ws->state_seed != 0)
        be->state_init_random(m, ws->s, n, positions, ws->state_seed); /* s [n][d] drawn per token */
    return TL_OK;
}

/* ---------------------------------------------------------------- the loop */

void tl_forward_loop(tl_forward *f) {
    const tl_model *m = f->m;
    const tl_config *c = &m->cfg;
    const tl_backend *be = m->backend;
    tl_workspace *ws = f->ws;
    const int loop = ++f->loops_done;

    /* u [n][d] = inject(s, e) (cat [n][2d]: concat's input), the block's input; x [n][d]
       runs through the block; s [n][d] moves towards x (and is normed). */
    be->inject(m, ws->s, ws->e, f->n, ws->cat, ws->u);
    be->copy(m, ws->x, ws->u, (size_t)f->n * (size_t)c->d_model);
    for (int i = 0; i < c->n_block; i++) layer_forward(f, &m->w.block[i], c->n_prelude + i, loop);
    be->loop_update(m, ws->s, ws->x, ws->u, f->n);
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

void tl_forward_head(tl_forward *f, int logits_from, float *logits) {
    const tl_model *m = f->m;
    const tl_config *c = &m->cfg;
    const tl_backend *be = m->backend;
    tl_workspace *ws = f->ws;
    const int n = f->n, d = c->d_model;

    /* x [n][d] = the coda's input: the state itself ("replace") or injected ("residual"). */
    if (c->loop_update == TL_UPDATE_REPLACE) be->copy(m, ws->x, ws->s, (size_t)n * (size_t)d);
    else be->inject(m, ws->s, ws->e, n, ws->cat, ws->x);
    /* Huginn's ln_f, first use: x [n][d] = final_norm(x) (the head applies it again). */
    if (c->final_norm_before_coda) be->norm(m, ws->x, n, m->w.final_norm_w, m->w.final_norm_b, ws->x);
    const int coda_slot = c->n_prelude + c->n_block * c->max_loops;
    for (int i = 0; i < c->n_coda; i++) layer_forward(f, &m->w.coda[i], coda_slot + i, 0);

    /* logits [n - logits_from][vocab], host = lm_head(final_norm(x rows [logits_from, n)))
       (no final norm when cfg.final_norm_at_head is false) with h [n][d] as scratch. */
    if (logits && logits_from < n)
        be->head(m, ws->x + (size_t)logits_from * (size_t)d, n - logits_from, ws->h, logits);
}

/* ---------------------------------------------------------------- commit, and whole runs */

void tl_forward_commit(tl_forward *f) {
    for (int t = 0; t < f->n; t++)
        f->cache->depth[tl_kv_row(f->cache, f->base + t)] = (uint16_t)(f->loops_done ? f->loops_done : 1);
    f->cache->length += f->n;
}

void tl_forward_end(tl_forward *f, int logits_from, float *logits) {
    tl_forward_head(f, logits_from, logits);
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

tl_status tl_forward_run(const tl_model *m, tl_kv_cache *cache, tl_workspace *ws,
                         const int32_t *tokens, const int32_t *positions, int n,
                         const uint8_t *mask, int loops, int logits_from, float *logits) {
    tl_forward f;
    tl_status st = tl_forward_begin(&f, m, cache, ws, tokens, positions, n, mask);
    if (st != TL_OK) return st;
    for (int l = 0; l < loops; l++) tl_forward_loop(&f);
    tl_forward_end(&f, logits_from, logits);
    return TL_OK;
}

/* forward.c: prelude -> shared loop block x L -> coda -> head, over the backend's ops.
 * Reads in data-flow order: workspace, per-row helpers, one layer, the three stages. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/kernels.h"
#include "forward.h"

/* ---------------------------------------------------------------- workspace */

void tl_workspace_release(tl_workspace *ws) {
    float **bufs[] = {&ws->x, &ws->e, &ws->s, &ws->u, &ws->cat, &ws->h, &ws->q,
                      &ws->k, &ws->v, &ws->att, &ws->ff_a, &ws->ff_b, &ws->attn_scratch};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        tl_free_aligned(*bufs[i]);
        *bufs[i] = NULL;
    }
    ws->rows = ws->scratch_per_thread = ws->threads = 0;
}

tl_status tl_workspace_reserve(tl_workspace *ws, const tl_model *m, int rows, int cache_capacity) {
    const tl_config *c = &m->cfg;
    int threads = m->info.n_threads;
    if (rows <= ws->rows && cache_capacity <= ws->scratch_per_thread && threads <= ws->threads)
        return TL_OK;
    if (rows < ws->rows) rows = ws->rows;
    if (cache_capacity < ws->scratch_per_thread) cache_capacity = ws->scratch_per_thread;
    tl_workspace_release(ws);
    size_t r = (size_t)rows, d = (size_t)c->d_model, qd = (size_t)(c->n_heads * c->head_dim),
           kvd = (size_t)(c->n_kv_heads * c->head_dim), ff = (size_t)c->d_ff;
    ws->x = tl_alloc_aligned(r * d * sizeof(float));
    ws->e = tl_alloc_aligned(r * d * sizeof(float));
    ws->s = tl_alloc_aligned(r * d * sizeof(float));
    ws->u = tl_alloc_aligned(r * d * sizeof(float));
    ws->cat = tl_alloc_aligned(r * 2 * d * sizeof(float));
    ws->h = tl_alloc_aligned(r * d * sizeof(float));
    ws->q = tl_alloc_aligned(r * qd * sizeof(float));
    ws->k = tl_alloc_aligned(r * kvd * sizeof(float));
    ws->v = tl_alloc_aligned(r * kvd * sizeof(float));
    ws->att = tl_alloc_aligned(r * qd * sizeof(float));
    ws->ff_a = tl_alloc_aligned(r * ff * sizeof(float));
    ws->ff_b = tl_alloc_aligned(r * ff * sizeof(float));
    ws->attn_scratch = tl_alloc_aligned((size_t)threads * (size_t)cache_capacity * sizeof(float));
    if (!ws->x || !ws->e || !ws->s || !ws->u || !ws->cat || !ws->h || !ws->q || !ws->k ||
        !ws->v || !ws->att || !ws->ff_a || !ws->ff_b || !ws->attn_scratch) {
        tl_workspace_release(ws);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory for activations of %d rows", rows);
    }
    ws->rows = rows;
    ws->scratch_per_thread = cache_capacity;
    ws->threads = threads;
    return TL_OK;
}

/* ---------------------------------------------------------------- per-row helpers */

/* y = norm(x) row by row; y may alias x. Statistics in double: cheap, and closer to
   the float64 reference. */
static void norm_rows(const tl_config *c, const float *x, int n, const float *w, const float *b,
                      float *y) {
    const int d = c->d_model;
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * (size_t)d;
        float *yr = y + (size_t)r * (size_t)d;
        double mean = 0.0, var = 0.0;
        if (c->norm == TL_NORM_LAYERNORM) {
            for (int i = 0; i < d; i++) mean += xr[i];
            mean /= d;
        }
        for (int i = 0; i < d; i++) var += ((double)xr[i] - mean) * ((double)xr[i] - mean);
        const float inv = (float)(1.0 / sqrt(var / d + (double)c->norm_eps));
        const float m = (float)mean;
        for (int i = 0; i < d; i++) yr[i] = (xr[i] - m) * inv * w[i] + (b ? b[i] : 0.0f);
    }
}

static void add_rows(float *y, const float *x, size_t count) {
    for (size_t i = 0; i < count; i++) y[i] += x[i];
}

/* Hugging Face "rotate half" RoPE on every head of every row; angles in double. */
static void rope_rows(const tl_model *m, float *x, int n, int heads, const int32_t *positions) {
    const int hd = m->cfg.head_dim, half = hd / 2;
    for (int r = 0; r < n; r++)
        for (int i = 0; i < half; i++) {
            double angle = (double)positions[r] * (double)m->rope_inv_freq[i];
            float cs = (float)cos(angle), sn = (float)sin(angle);
            for (int h = 0; h < heads; h++) {
                float *v = x + ((size_t)r * (size_t)heads + (size_t)h) * (size_t)hd;
                float a = v[i], b = v[i + half];
                v[i] = a * cs - b * sn;
                v[i + half] = b * cs + a * sn;
            }
        }
}

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

/* ---------------------------------------------------------------- one layer */

/* x = x + Attn(Norm(x)); x = x + MLP(Norm(x)) for the chunk, writing the layer's K/V
   into `slot` (for block layers, the slot of loop `loop`). */
static void layer_forward(tl_forward *f, const tl_layer *L, int slot, int loop) {
    const tl_model *m = f->m;
    const tl_config *c = &m->cfg;
    const tl_backend *be = m->backend;
    tl_workspace *ws = f->ws;
    const int n = f->n, d = c->d_model, kvd = c->n_kv_heads * c->head_dim;

    norm_rows(c, ws->x, n, L->attn_norm_w, L->attn_norm_b, ws->h);
    be->matmul(m, ws->h, n, &L->q, L->q_b, ws->q);
    be->matmul(m, ws->h, n, &L->k, L->k_b, ws->k);
    be->matmul(m, ws->h, n, &L->v, L->v_b, ws->v);
    if (c->pos_encoding == TL_POS_ROPE) {
        rope_rows(m, ws->q, n, c->n_heads, f->positions);
        rope_rows(m, ws->k, n, c->n_kv_heads, f->positions);
    }
    const int write_slot = loop ? slot + (loop - 1) * c->n_block : slot;
    for (int t = 0; t < n; t++) {
        memcpy(tl_kv_k(f->cache, write_slot, f->base + t), ws->k + (size_t)t * (size_t)kvd,
               (size_t)kvd * sizeof(float));
        memcpy(tl_kv_v(f->cache, write_slot, f->base + t), ws->v + (size_t)t * (size_t)kvd,
               (size_t)kvd * sizeof(float));
    }
    tl_attention_args args = {ws->q, ws->att, n, f->cache, f->base, slot, loop, c->n_block,
                              f->positions, f->mask, f->mask_start, ws->attn_scratch};
    be->attention(m, &args);
    be->matmul(m, ws->att, n, &L->o, L->o_b, ws->h);
    add_rows(ws->x, ws->h, (size_t)n * (size_t)d);

    norm_rows(c, ws->x, n, L->mlp_norm_w, L->mlp_norm_b, ws->h);
    const size_t nff = (size_t)n * (size_t)c->d_ff;
    if (c->mlp == TL_MLP_GELU) {
        be->matmul(m, ws->h, n, &L->up, L->up_b, ws->ff_a);
        for (size_t i = 0; i < nff; i++) ws->ff_a[i] = gelu_tanh(ws->ff_a[i]);
    } else {
        be->matmul(m, ws->h, n, &L->gate, L->gate_b, ws->ff_a);
        be->matmul(m, ws->h, n, &L->up, L->up_b, ws->ff_b);
        for (size_t i = 0; i < nff; i++) {
            float g = ws->ff_a[i];
            ws->ff_a[i] = g / (1.0f + expf(-g)) * ws->ff_b[i];
        }
    }
    be->matmul(m, ws->ff_a, n, &L->down, L->down_b, ws->h);
    add_rows(ws->x, ws->h, (size_t)n * (size_t)d);
}

/* ---------------------------------------------------------------- injection */

/* out = inject(s, e): "none": s, "add": s + e, "concat": W_inj [s ; e] (+ b). */
static void inject(tl_forward *f, float *out) {
    const tl_model *m = f->m;
    const int n = f->n, d = m->cfg.d_model;
    const size_t count = (size_t)n * (size_t)d;
    tl_workspace *ws = f->ws;
    switch (m->cfg.injection) {
    case TL_INJECT_NONE:
        memcpy(out, ws->s, count * sizeof(float));
        break;
    case TL_INJECT_ADD:
        for (size_t i = 0; i < count; i++) out[i] = ws->s[i] + ws->e[i];
        break;
    case TL_INJECT_CONCAT:
        for (int r = 0; r < n; r++) {
            memcpy(ws->cat + (size_t)r * 2 * (size_t)d, ws->s + (size_t)r * (size_t)d, (size_t)d * sizeof(float));
            memcpy(ws->cat + ((size_t)r * 2 + 1) * (size_t)d, ws->e + (size_t)r * (size_t)d, (size_t)d * sizeof(float));
        }
        m->backend->matmul(m, ws->cat, n, &m->w.inject, m->w.inject_b, out);
        break;
    }
}

/* ---------------------------------------------------------------- the three stages */

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
    for (int t = 0; t < n; t++) {
        cache->pos[tl_kv_row(cache, f->base + t)] = positions[t];
        cache->logical[tl_kv_row(cache, f->base + t)] = f->base + t;
    }

    const int d = c->d_model;
    float *row = ws->h;
    for (int t = 0; t < n; t++) {
        float *x = ws->x + (size_t)t * (size_t)d;
        tl_matrix_row_f32(&m->w.tok_embed, tokens[t], x);
        if (c->pos_encoding == TL_POS_LEARNED) {
            tl_matrix_row_f32(&m->w.pos_embed, positions[t], row);
            add_rows(x, row, (size_t)d);
        }
    }
    for (int i = 0; i < c->n_prelude; i++) layer_forward(f, &m->w.prelude[i], i, 0);

    const size_t bytes = (size_t)n * (size_t)d * sizeof(float);
    memcpy(ws->e, ws->x, bytes);
    if (c->injection == TL_INJECT_NONE) memcpy(ws->s, ws->e, bytes);
    else memset(ws->s, 0, bytes);
    return TL_OK;
}

void tl_forward_loop(tl_forward *f) {
    const tl_model *m = f->m;
    const tl_config *c = &m->cfg;
    tl_workspace *ws = f->ws;
    const size_t count = (size_t)f->n * (size_t)c->d_model;
    const int loop = ++f->loops_done;

    inject(f, ws->u);
    memcpy(ws->x, ws->u, count * sizeof(float));
    for (int i = 0; i < c->n_block; i++) layer_forward(f, &m->w.block[i], c->n_prelude + i, loop);
    /* replace: s += beta (b - s); residual: s += beta (b - u). */
    const float *ref = c->loop_update == TL_UPDATE_REPLACE ? ws->s : ws->u;
    for (size_t i = 0; i < count; i++) ws->s[i] += c->beta * (ws->x[i] - ref[i]);
    if (c->state_norm) norm_rows(c, ws->s, f->n, m->w.state_norm_w, m->w.state_norm_b, ws->s);
}

void tl_forward_loop_measured(tl_forward *f, double *relative_change) {
    const int d = f->m->cfg.d_model;
    float *before = malloc((size_t)d * sizeof(float));
    if (!before) { /* no measure without memory: report "not converged" */
        tl_forward_loop(f);
        *relative_change = INFINITY;
        return;
    }
    memcpy(before, f->ws->s, (size_t)d * sizeof(float));
    tl_forward_loop(f);
    double change = 0.0, norm = 0.0;
    for (int i = 0; i < d; i++) {
        double delta = (double)f->ws->s[i] - (double)before[i];
        change += delta * delta;
        norm += (double)f->ws->s[i] * (double)f->ws->s[i];
    }
    free(before);
    *relative_change = norm > 0.0 ? sqrt(change / norm) : INFINITY;
}

void tl_forward_head(tl_forward *f, int logits_from, float *logits) {
    const tl_model *m = f->m;
    const tl_config *c = &m->cfg;
    tl_workspace *ws = f->ws;
    const int n = f->n, d = c->d_model;

    if (c->loop_update == TL_UPDATE_REPLACE) memcpy(ws->x, ws->s, (size_t)n * (size_t)d * sizeof(float));
    else inject(f, ws->x);
    const int coda_slot = c->n_prelude + c->n_block * c->max_loops;
    for (int i = 0; i < c->n_coda; i++) layer_forward(f, &m->w.coda[i], coda_slot + i, 0);

    if (logits && logits_from < n) {
        const size_t off = (size_t)logits_from * (size_t)d;
        norm_rows(c, ws->x + off, n - logits_from, m->w.final_norm_w, m->w.final_norm_b, ws->h);
        m->backend->matmul(m, ws->h, n - logits_from, &m->w.lm_head, NULL, logits);
    }
}

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

/* model.c: loading a checkpoint directory (SPEC §1) into an immutable tl_model.
 *
 * Matrices are bound in the memory-mapped file in their stored dtype; vectors (norm
 * weights, biases) are converted to f32 copies. Every tensor the config implies must be
 * present with its exact shape, and every tensor in the file must be one the config
 * implies. The backend (backend.h) is opened for the model and then takes the bound
 * tensors into its own storage and layout (upload_weights). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "backend.h"
#include "backend_plugin.h"
#include "dtype.h"
#include "kv_cache.h"
#include "loader.h"
#include "prefix_pool.h"
#include "tokenizer.h"

void tl_load_options_init(tl_load_options *opts) {
    if (!opts) return;
    memset(opts, 0, sizeof *opts);
    opts->n_threads = 0;
    opts->backend = TL_BACKEND_AUTO;
    /* TINYLOOP_KV_TYPE=f16 makes f16 the default (the test suite runs its bit-identity tests
       so, and a deployment can switch without code); an explicit kv_type still decides. */
    const char *kv = getenv("TINYLOOP_KV_TYPE");
    opts->kv_type = kv && strcmp(kv, "f16") == 0 ? TL_KV_F16 : TL_KV_F32;
}

/* ---------------------------------------------------------------- ownership */

static void *own(tl_model *m, void *p) {
    if (!p) return NULL;
    if (m->n_owned == m->cap_owned) {
        int cap = m->cap_owned ? m->cap_owned * 2 : 64;
        void **grown = realloc(m->owned, (size_t)cap * sizeof *grown);
        if (!grown) { tl_free_aligned(p); return NULL; }
        m->owned = grown;
        m->cap_owned = cap;
    }
    m->owned[m->n_owned++] = p;
    return p;
}

void tl_model_free(tl_model *m) {
    if (!m) return;
    tl_prefix_pool_free(m->prefix_pool); /* its pages are backend buffers: before close */
    tl_kv_spares_free(m, m->kv_spares);  /* so are the kept ones, the pool's among them */
    if (m->backend) m->backend->close(m->backend_ctx); /* workers first: nothing runs after */
    tl_tlz_tokenizer_free(m->tokenizer);
    for (int i = 0; i < m->n_owned; i++) tl_free_aligned(m->owned[i]);
    free(m->owned);
    if (m->kept_files) tl_st_set_close(m->kept_files);
    free(m->kept_files);
    free(m->w.prelude);
    free(m->w.block);
    free(m->w.coda);
    free(m->rope_inv_freq);
    free(m->dir);
    free(m);
}

/* ---------------------------------------------------------------- files */

/* ---------------------------------------------------------------- tensor binding */

static tl_dtype dtype_of(const tl_st_tensor *t) {
    return t->dtype == TL_ST_F32 ? TL_F32 : t->dtype == TL_ST_F16 ? TL_F16 : TL_BF16;
}

/* The tensor `name` with exactly the shape dims[0..ndim), claimed. */
static tl_status find_shaped(tl_binder *b, const char *name, const int64_t *dims, int ndim,
                             tl_st_tensor **out, const char **path) {
    tl_st_tensor *t = tl_st_set_find(b->files, name, path);
    if (!t) return tl_fail(TL_ERR_FORMAT, "%s: missing tensor \"%s\" (required by config.json)",
                           b->files->described_as, name);
    t->claimed = true;
    bool ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == dims[i];
    if (!ok) {
        char got[96] = "[", want[96] = "[";
        for (int i = 0; i < t->ndim; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        for (int i = 0; i < ndim; i++)
            snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", i ? ", " : "", (long long)dims[i]);
        strncat(got, "]", sizeof got - strlen(got) - 1);
        strncat(want, "]", sizeof want - strlen(want) - 1);
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has shape %s, config.json implies %s", *path,
                       name, got, want);
    }
    if (t->dtype != TL_ST_F32 && t->dtype != TL_ST_F16 && t->dtype != TL_ST_BF16)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has dtype %s; only F32, F16 and BF16 are supported",
                       *path, name, tl_st_dtype_name(t->dtype));
    /* A NaN or inf weight poisons every logit downstream (a NaN in one mlp.down made every
       later token "not allowed"), so it is refused here, once, where every tensor passes:
       one linear scan over the bytes, far cheaper than the copy into the backend. */
    const tl_dtype dt = t->dtype == TL_ST_F32 ? TL_F32 : t->dtype == TL_ST_F16 ? TL_F16 : TL_BF16;
    const size_t numel = t->nbytes / tl_st_dtype_size(t->dtype);
    const size_t bad = tl_first_nonfinite(t->data, dt, numel);
    if (bad < numel) {
        const float v = tl_weight_at_unaligned(t->data, dt, bad);
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has a non-finite value (%s) at index %zu "
                       "(row-major); the checkpoint is corrupt or overflowed when it was saved",
                       *path, name, isnan(v) ? "NaN" : v > 0 ? "+inf" : "-inf", bad);
    }
    *out = t;
    return TL_OK;
}

/* Rows [row0, row0 + rows) of a q8 (I8 [total_rows, cols]) or q4 (U8 [total_rows, cols / 2])
   matrix and of its F16 scale tensor "<name>_scale" [total_rows, cols / TL_QGROUP] (layout:
   internal.h, README "Quantised weights"): a row's bytes and scales are its own, so a fused
   tensor (Huginn's Wqkv, its MLP's fc) splits by rows as a float one does. */
static tl_status bind_quantised(tl_binder *b, const char *name, tl_st_tensor *t, const char *path, int total_rows,
                                int cols, int row0, int rows, tl_matrix *out) {
    const bool q8 = t->dtype == TL_ST_I8;
    t->claimed = true;
    if (cols % TL_QGROUP != 0)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" is quantised but its %d columns are not a multiple of %d",
                       path, name, cols, TL_QGROUP);
    if (t->ndim != 2 || t->shape[0] != total_rows || t->shape[1] != (q8 ? cols : cols / 2)) {
        char shape[96] = "";
        for (int i = 0, at = 0; i < t->ndim && at < (int)sizeof shape - 24; i++)
            at += snprintf(shape + at, sizeof shape - (size_t)at, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        return tl_fail(TL_ERR_FORMAT, "%s: %s tensor \"%s\" has shape [%s]; it must be [%d, %d] (config.json: [%d, %d])",
                       path, q8 ? "q8 (I8)" : "q4 (U8)", name, shape, total_rows, q8 ? cols : cols / 2, total_rows, cols);
    }
    char scale_name[300];
    snprintf(scale_name, sizeof scale_name, "%s" TL_ST_SCALE_SUFFIX, name);
    const char *scale_path = NULL;
    tl_st_tensor *s = tl_st_set_find(b->files, scale_name, &scale_path);
    if (!s) return tl_fail(TL_ERR_FORMAT, "%s: quantised tensor \"%s\" has no scale tensor \"%s\"", path, name, scale_name);
    s->claimed = true;
    if (s->dtype != TL_ST_F16 || s->ndim != 2 || s->shape[0] != total_rows || s->shape[1] != cols / TL_QGROUP)
        return tl_fail(TL_ERR_FORMAT, "%s: scale tensor \"%s\" must be F16 [%d, %d]", path, scale_name, total_rows,
                       cols / TL_QGROUP);
    const size_t row_bytes = (size_t)(q8 ? cols : cols / 2), row_scales = (size_t)(cols / TL_QGROUP);
    const uint8_t *scales = s->data + (size_t)row0 * row_scales * 2;
    /* A float weight's rule, for its scales: an infinite or NaN scale makes its group NaN. */
    const size_t n_scales = (size_t)rows * row_scales, bad = tl_first_nonfinite(scales, TL_F16, n_scales);
    if (bad < n_scales)
        return tl_fail(TL_ERR_FORMAT, "%s: scale tensor \"%s\" has a non-finite value at index %zu (row-major); "
                       "the checkpoint is corrupt", path, scale_name, bad);
    out->dtype = q8 ? TL_Q8 : TL_Q4;
    out->rows = rows;
    out->cols = cols;
    out->data = t->data + (size_t)row0 * row_bytes;
    out->scale = scales;
    if ((uintptr_t)scales % 2 != 0) { /* unaligned in the file: keep an aligned copy */
        void *copy = own(b->m, tl_alloc_aligned(n_scales * 2));
        if (!copy) return tl_fail(TL_ERR_NO_MEMORY, "out of memory copying \"%s\"", scale_name);
        memcpy(copy, scales, n_scales * 2);
        out->scale = copy;
    }
    return TL_OK;
}

tl_status tl_bind_matrix_rows(tl_binder *b, const char *name, int total_rows, int cols, int row0,
                              int rows, tl_matrix *out) {
    tl_st_tensor *t = NULL;
    const char *path = NULL;
    const int64_t dims[2] = {total_rows, cols};
    tl_st_tensor *stored = tl_st_set_find(b->files, name, &path);
    if (stored && (stored->dtype == TL_ST_I8 || stored->dtype == TL_ST_U8)) {
        if (strcmp(name, "pos_embed.weight") == 0)
            return tl_fail(TL_ERR_FORMAT, "%s: \"%s\" must be F32, F16 or BF16 (it is not quantised)", path, name);
        return bind_quantised(b, name, stored, path, total_rows, cols, row0, rows, out);
    }
    tl_status st = find_shaped(b, name, dims, 2, &t, &path);
    if (st != TL_OK) return st;
    const size_t elem = tl_st_dtype_size(t->dtype), bytes = (size_t)rows * (size_t)cols * elem;
    out->dtype = dtype_of(t);
    out->rows = rows;
    out->cols = cols;
    out->data = t->data + (size_t)row0 * (size_t)cols * elem;
    if ((uintptr_t)out->data % elem != 0) { /* unaligned in the file: keep an aligned copy */
        void *copy = own(b->m, tl_alloc_aligned(bytes));
        if (!copy) return tl_fail(TL_ERR_NO_MEMORY, "out of memory copying \"%s\"", name);
        memcpy(copy, out->data, bytes);
        out->data = copy;
    }
    return TL_OK;
}

tl_status tl_bind_matrix(tl_binder *b, const char *name, int rows, int cols, tl_matrix *out) {
    return tl_bind_matrix_rows(b, name, rows, cols, 0, rows, out);
}

tl_status tl_bind_vector_part(tl_binder *b, const char *name, const int64_t *shape, int ndim, int at,
                              int len, const float **out) {
    tl_st_tensor *t = NULL;
    const char *path = NULL;
    tl_status st = find_shaped(b, name, shape, ndim, &t, &path);
    if (st != TL_OK) return st;
    float *v = own(b->m, tl_alloc_aligned((size_t)len * sizeof(float)));
    if (!v) return tl_fail(TL_ERR_NO_MEMORY, "out of memory copying \"%s\"", name);
    tl_convert_to_f32(t->data + (size_t)at * tl_st_dtype_size(t->dtype), dtype_of(t), (size_t)len, v);
    *out = v;
    return TL_OK;
}

/* A vector converted to an owned f32 array. */
tl_status tl_bind_vector(tl_binder *b, const char *name, int len, const float **out) {
    const int64_t shape[1] = {len};
    return tl_bind_vector_part(b, name, shape, 1, 0, len, out);
}

bool tl_bind_ignore(tl_binder *b, const char *name) {
    tl_st_tensor *t = tl_st_set_find(b->files, name, NULL);
    if (t) t->claimed = t->ignored = true;
    /* and its scales, where it was quantised (a tied head that an earlier quantize wrote:
       the load refused its "lm_head.weight_scale" as unexpected) */
    char scale_name[512];
    snprintf(scale_name, sizeof scale_name, "%s" TL_ST_SCALE_SUFFIX, name);
    tl_st_tensor *scale = t ? tl_st_set_find(b->files, scale_name, NULL) : NULL;
    if (scale) scale->claimed = scale->ignored = true;
    return t != NULL;
}

tl_status tl_bind_head(tl_binder *b, const char *name) {
    tl_weights *w = &b->m->w;
    const tl_config *c = &b->m->cfg;
    if (!c->tie_embeddings) return tl_bind_matrix(b, name, c->vocab_size, c->d_model, &w->lm_head);
    w->lm_head = w->tok_embed;
    tl_bind_ignore(b, name);
    return TL_OK;
}

static tl_status bind_norm(tl_binder *b, const char *prefix, const float **w, const float **bias) {
    char name[256];
    const tl_config *c = &b->m->cfg;
    snprintf(name, sizeof name, "%s.weight", prefix);
    tl_status st = tl_bind_vector(b, name, c->d_model, w);
    if (st != TL_OK || c->norm != TL_NORM_LAYERNORM) return st;
    snprintf(name, sizeof name, "%s.bias", prefix);
    return tl_bind_vector(b, name, c->d_model, bias);
}

/* Matrix `prefix.weight` [rows, cols] and, when the config has biases, `prefix.bias`. */
static tl_status bind_linear(tl_binder *b, const char *prefix, int rows, int cols, tl_matrix *w,
                             const float **bias) {
    char name[256];
    snprintf(name, sizeof name, "%s.weight", prefix);
    tl_status st = tl_bind_matrix(b, name, rows, cols, w);
    if (st != TL_OK || !b->m->cfg.bias) return st;
    snprintf(name, sizeof name, "%s.bias", prefix);
    return tl_bind_vector(b, name, rows, bias);
}

/* q or k with qk_bias (and no general bias): the bias alone, added before RoPE. */
static tl_status bind_qk_linear(tl_binder *b, const char *prefix, int rows, int cols, tl_matrix *w,
                                const float **bias) {
    char name[256];
    tl_status st = bind_linear(b, prefix, rows, cols, w, bias);
    if (st != TL_OK || b->m->cfg.bias || !b->m->cfg.qk_bias) return st;
    snprintf(name, sizeof name, "%s.bias", prefix);
    return tl_bind_vector(b, name, rows, bias);
}

static tl_status bind_layer(tl_binder *b, const char *group, int index, tl_layer *L) {
    const tl_config *c = &b->m->cfg;
    const int d = c->d_model, qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    char p[96], name[160];
    snprintf(p, sizeof p, "%s.%d", group, index);
    tl_status st;
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
#define SUB(suffix) (snprintf(name, sizeof name, "%s.%s", p, suffix), name)
    TRY(bind_norm(b, SUB("attn_norm"), &L->attn_norm_w, &L->attn_norm_b));
    if (c->norm_placement != TL_PLACE_PRE) {
        TRY(bind_norm(b, SUB("attn_out_norm"), &L->attn_out_norm_w, &L->attn_out_norm_b));
        TRY(bind_norm(b, SUB("mlp_out_norm"), &L->mlp_out_norm_w, &L->mlp_out_norm_b));
    }
    TRY(bind_qk_linear(b, SUB("attn.q"), qd, d, &L->q, &L->q_b));
    TRY(bind_qk_linear(b, SUB("attn.k"), kvd, d, &L->k, &L->k_b));
    TRY(bind_linear(b, SUB("attn.v"), kvd, d, &L->v, &L->v_b));
    TRY(bind_linear(b, SUB("attn.o"), d, qd, &L->o, &L->o_b));
    TRY(bind_norm(b, SUB("mlp_norm"), &L->mlp_norm_w, &L->mlp_norm_b));
    if (c->mlp == TL_MLP_SWIGLU) TRY(bind_linear(b, SUB("mlp.gate"), c->d_ff, d, &L->gate, &L->gate_b));
    TRY(bind_linear(b, SUB("mlp.up"), c->d_ff, d, &L->up, &L->up_b));
    TRY(bind_linear(b, SUB("mlp.down"), d, c->d_ff, &L->down, &L->down_b));
#undef SUB
#undef TRY
    return TL_OK;
}

static tl_status bind_all(tl_binder *b) {
    tl_model *m = b->m;
    const tl_config *c = &m->cfg;
    tl_weights *w = &m->w;
    tl_status st;
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
    TRY(tl_bind_matrix(b, "tok_embed.weight", c->vocab_size, c->d_model, &w->tok_embed));
    if (c->pos_encoding == TL_POS_LEARNED)
        TRY(tl_bind_matrix(b, "pos_embed.weight", c->max_seq_len, c->d_model, &w->pos_embed));
    for (int i = 0; i < c->n_prelude; i++) TRY(bind_layer(b, "prelude", i, &w->prelude[i]));
    for (int i = 0; i < c->n_block; i++) TRY(bind_layer(b, "block", i, &w->block[i]));
    for (int i = 0; i < c->n_coda; i++) TRY(bind_layer(b, "coda", i, &w->coda[i]));
    if (c->injection == TL_INJECT_CONCAT)
        TRY(bind_linear(b, "inject", c->d_model, 2 * c->d_model, &w->inject, &w->inject_b));
    if (c->state_norm && !c->state_norm_is_final_norm)
        TRY(bind_norm(b, "state_norm", &w->state_norm_w, &w->state_norm_b));
    TRY(bind_norm(b, "final_norm", &w->final_norm_w, &w->final_norm_b));
    if (c->state_norm_is_final_norm) {
        w->state_norm_w = w->final_norm_w;
        w->state_norm_b = w->final_norm_b;
    }
    if (c->tie_embeddings) w->lm_head = w->tok_embed;
    else TRY(tl_bind_matrix(b, "lm_head.weight", c->vocab_size, c->d_model, &w->lm_head));
    if (c->exit_gate) {
        TRY(tl_bind_matrix(b, "exit_gate.weight", 1, c->d_model, &w->exit_gate));
        TRY(tl_bind_vector(b, "exit_gate.bias", 1, &w->exit_gate_b));
    }
#undef TRY
    return TL_OK;
}

/* Every tensor in the files is one the config implies (or one a family ignores on purpose). */
static tl_status check_all_claimed(tl_binder *b) {
    for (int f = 0; f < b->files->n_files; f++) {
        const tl_st_file *file = &b->files->files[f];
        for (int i = 0; i < file->n_tensors; i++)
            if (!file->tensors[i].claimed)
                return tl_fail(TL_ERR_FORMAT, "%s: unexpected tensor \"%s\" (not used by this config%s)",
                               b->files->paths[f], file->tensors[i].name,
                               strcmp(file->tensors[i].name, "lm_head.weight") == 0 ? ": tie_embeddings is true" : "");
    }
    return TL_OK;
}

/* Layer arrays for the config's counts (one spare each, so that none is a zero-size calloc). */
static tl_status allocate_layers(tl_model *m) {
    const tl_config *c = &m->cfg;
    m->w.prelude = calloc((size_t)c->n_prelude + 1, sizeof(tl_layer));
    m->w.block = calloc((size_t)c->n_block + 1, sizeof(tl_layer));
    m->w.coda = calloc((size_t)c->n_coda + 1, sizeof(tl_layer));
    if (!m->w.prelude || !m->w.block || !m->w.coda) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    return TL_OK;
}

/* ---------------------------------------------------------------- weight upload */

/* Every matrix of the model, listed once (lm_head only when it is not tied). */
static int list_matrices(tl_model *m, tl_matrix **out) {
    tl_weights *w = &m->w;
    const tl_config *c = &m->cfg;
    int n = 0;
    out[n++] = &w->tok_embed;
    if (c->pos_encoding == TL_POS_LEARNED) out[n++] = &w->pos_embed;
    if (c->injection == TL_INJECT_CONCAT) out[n++] = &w->inject;
    if (!c->tie_embeddings) out[n++] = &w->lm_head;
    if (c->exit_gate) out[n++] = &w->exit_gate;
    tl_layer *groups[3] = {w->prelude, w->block, w->coda};
    int counts[3] = {c->n_prelude, c->n_block, c->n_coda};
    for (int g = 0; g < 3; g++)
        for (int i = 0; i < counts[g]; i++) {
            tl_layer *L = &groups[g][i];
            out[n++] = &L->q; out[n++] = &L->k; out[n++] = &L->v; out[n++] = &L->o;
            if (c->mlp == TL_MLP_SWIGLU) out[n++] = &L->gate;
            out[n++] = &L->up; out[n++] = &L->down;
        }
    return n;
}

/* Every vector slot of the model with its length in floats (the slot may hold NULL). */
static int list_vectors(tl_model *m, const float ***out, int *lens) {
    tl_weights *w = &m->w;
    const tl_config *c = &m->cfg;
    const int d = c->d_model, qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    int n = 0;
#define VEC(slot, len) (out[n] = &(slot), lens[n++] = (len))
    VEC(w->inject_b, d);
    if (!c->state_norm_is_final_norm) { VEC(w->state_norm_w, d); VEC(w->state_norm_b, d); }
    VEC(w->final_norm_w, d); VEC(w->final_norm_b, d);
    VEC(w->exit_gate_b, 1);
    tl_layer *groups[3] = {w->prelude, w->block, w->coda};
    int counts[3] = {c->n_prelude, c->n_block, c->n_coda};
    for (int g = 0; g < 3; g++)
        for (int i = 0; i < counts[g]; i++) {
            tl_layer *L = &groups[g][i];
            VEC(L->attn_norm_w, d); VEC(L->attn_norm_b, d);
            VEC(L->attn_out_norm_w, d); VEC(L->attn_out_norm_b, d);
            VEC(L->mlp_out_norm_w, d); VEC(L->mlp_out_norm_b, d);
            VEC(L->q_b, qd); VEC(L->k_b, kvd); VEC(L->v_b, kvd); VEC(L->o_b, d);
            VEC(L->mlp_norm_w, d); VEC(L->mlp_norm_b, d);
            VEC(L->gate_b, c->d_ff); VEC(L->up_b, c->d_ff); VEC(L->down_b, d);
        }
#undef VEC
    return n;
}

/* Hands the bound tensors to the backend, which moves them into its storage and layout
   (the CPU backend: packed panels in a huge-page region, unless keep_mapped). */
static tl_status upload_weights(tl_model *m, bool keep_mapped) {
    const tl_config *c = &m->cfg;
    const int layers = c->n_prelude + c->n_block + c->n_coda;
    tl_matrix **matrices = malloc((size_t)(8 + 7 * layers) * sizeof *matrices);
    const float ***vectors = malloc((size_t)(8 + 15 * layers) * sizeof *vectors);
    int *lens = malloc((size_t)(8 + 15 * layers) * sizeof *lens);
    tl_status st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    if (matrices && vectors && lens) {
        const int n_matrices = list_matrices(m, matrices), n_vectors = list_vectors(m, vectors, lens);
        st = m->backend->upload_weights(m, matrices, n_matrices, vectors, lens, n_vectors, keep_mapped);
        if (c->tie_embeddings) m->w.lm_head = m->w.tok_embed;
        if (c->state_norm_is_final_norm) {
            m->w.state_norm_w = m->w.final_norm_w;
            m->w.state_norm_b = m->w.final_norm_b;
        }
    }
    free(matrices);
    free(vectors);
    free(lens);
    return st;
}

/* ---------------------------------------------------------------- info */

/* The dtype reported as weight_dtype: the layers' (a q4 checkpoint keeps its embedding and
   head at q8 unless quantised --pure), their quantised one where some of their matrices are
   kept as they were (a width that does not split into groups), or the embedding's for a
   model without layers. */
static tl_dtype layers_dtype(const tl_model *m) {
    const tl_config *c = &m->cfg;
    const tl_layer *L = c->n_block ? m->w.block : c->n_prelude ? m->w.prelude : c->n_coda ? m->w.coda : NULL;
    if (!L) return m->w.tok_embed.dtype;
    const tl_matrix *matrices[] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
    for (size_t i = 0; i < sizeof matrices / sizeof matrices[0]; i++)
        if (matrices[i]->data && tl_dtype_quantised(matrices[i]->dtype)) return matrices[i]->dtype;
    return L->up.dtype;
}

/* Whether dir has a tokenizer.json to load. lstat: any entry of that name means "load it", so
   that a dangling symlink or an unreadable file is an error rather than a silent load without
   a tokenizer. */
static bool has_tokenizer_file(const char *dir) {
    char path[4200];
    struct stat sb;
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    return lstat(path, &sb) == 0;
}

static void fill_info(tl_model *m, const tl_st_set *files) {
    static const char *const injections[] = {"none", "add", "concat"};
    static const char *const dtypes[] = {"f32", "f16", "bf16", "q8", "q4"};
    const tl_config *c = &m->cfg;
    struct tl_model_info *i = &m->info;
    *i = (struct tl_model_info){
        .vocab_size = c->vocab_size, .d_model = c->d_model, .n_heads = c->n_heads,
        .n_kv_heads = c->n_kv_heads, .head_dim = c->head_dim, .d_ff = c->d_ff,
        .max_seq_len = c->max_seq_len, .n_prelude = c->n_prelude, .n_block = c->n_block,
        .n_coda = c->n_coda, .default_loops = c->default_loops, .max_loops = c->max_loops,
        .beta = c->beta, .norm_eps = c->norm_eps, .rope_theta = c->rope_theta,
        .bos_token_id = c->bos_token_id, .eos_token_id = c->eos_token_id,
        .injection = injections[c->injection],
        .loop_update = c->loop_update == TL_UPDATE_REPLACE ? "replace" : "residual",
        .norm = c->norm == TL_NORM_LAYERNORM ? "layernorm" : "rmsnorm",
        .mlp = c->mlp == TL_MLP_GELU ? "gelu" : "swiglu",
        .pos_encoding = c->pos_encoding == TL_POS_LEARNED ? "learned" : "rope",
        .weight_dtype = dtypes[layers_dtype(m)],
        .state_norm = c->state_norm, .bias = c->bias, .tie_embeddings = c->tie_embeddings,
        .n_threads = m->backend->threads(m->backend_ctx), .backend = m->backend->name,
        .kv_type = tl_kv_type_name(m->kv_type),
        .exit_gate = c->exit_gate, .exit_gate_threshold = c->exit_threshold,
    };
    for (int f = 0; f < files->n_files; f++) {
        const tl_st_file *file = &files->files[f];
        for (int t = 0; t < file->n_tensors; t++) {
            /* (a tied checkpoint's stored lm_head, a RoPE table: read by nothing, counted by nothing) */
            if (!file->tensors[t].claimed || file->tensors[t].ignored) continue;
            int64_t numel = 1;
            for (int k = 0; k < file->tensors[t].ndim; k++) numel *= file->tensors[t].shape[k];
            /* Parameters, not storage: a q4 byte holds two, a scale tensor holds none. */
            const size_t len = strlen(file->tensors[t].name);
            const size_t suffix = sizeof TL_ST_SCALE_SUFFIX - 1;
            if (len > suffix && strcmp(file->tensors[t].name + len - suffix, TL_ST_SCALE_SUFFIX) == 0) numel = 0;
            if (file->tensors[t].dtype == TL_ST_U8) numel *= 2;
            i->n_params += numel;
            i->weight_bytes += (int64_t)file->tensors[t].nbytes;
        }
    }
    i->has_tokenizer = has_tokenizer_file(m->dir);
}

/* ---------------------------------------------------------------- load */

/* The family of a config.json: a published family named by model_type (which decides, as in
   transformers' AutoConfig) or else by architectures[0], or NULL for our own format (no
   model_type, or one beside our own fields: extra metadata). The two naming different
   families is an error naming both; an unknown model_type without our fields is one naming it. */
static tl_status detect_family(const cJSON *root, const tl_family **out) {
    static const tl_family *const families[] = {&tl_family_huginn, &tl_family_ouro};
    enum { N_FAMILIES = sizeof families / sizeof families[0] };
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    const cJSON *archs = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    const cJSON *arch = cJSON_IsArray(archs) ? cJSON_GetArrayItem(archs, 0) : NULL;
    const tl_family *by_type = NULL, *by_arch = NULL;
    for (size_t i = 0; i < N_FAMILIES; i++) {
        if (cJSON_IsString(type) && strcmp(type->valuestring, families[i]->model_type) == 0) by_type = families[i];
        if (cJSON_IsString(arch) && strcmp(arch->valuestring, families[i]->architecture) == 0) by_arch = families[i];
    }
    *out = NULL;
    if (by_type && by_arch && by_type != by_arch)
        return tl_fail(TL_ERR_FORMAT, "config.json: model_type \"%s\" and architectures[0] \"%s\" name different "
                       "families (%s's architecture is \"%s\")", type->valuestring, arch->valuestring,
                       by_type->model_type, by_type->architecture);
    if (by_type || by_arch) {
        *out = by_type ? by_type : by_arch;
        return TL_OK;
    }
    if (type && !cJSON_GetObjectItemCaseSensitive(root, "d_model")) {
        char *shown = cJSON_PrintUnformatted(type);
        tl_status st = tl_fail(TL_ERR_UNSUPPORTED,
                               "config.json: unknown model_type %s (supported: \"%s\", \"%s\", or TinyLoop's "
                               "own format without model_type)", shown ? shown : "?",
                               tl_family_huginn.model_type, tl_family_ouro.model_type);
        cJSON_free(shown);
        return st;
    }
    return TL_OK;
}

/* config.json -> *cfg, through the family's reader when it is a published one; *config_hash:
   the file's hash (a model's fingerprint starts from it). */
static tl_status read_config(const char *dir, tl_config *cfg, uint64_t *config_hash, const tl_family **family) {
    char path[4096], *text = NULL;
    size_t text_len;
    snprintf(path, sizeof path, "%s/config.json", dir);
    tl_status st = tl_read_regular(path, TL_MAX_CONFIG_BYTES, &text, &text_len);
    if (st != TL_OK) return st;
    tl_hasher hasher;
    tl_hash_init(&hasher);
    tl_hash_add(&hasher, text, text_len);
    *config_hash = tl_hash_final(&hasher);
    /* The parser reads up to the first NUL: what follows one would be ignored unseen. */
    if (strlen(text) != text_len)
        st = tl_fail(TL_ERR_FORMAT, "config.json: contains a NUL byte at offset %zu", strlen(text));
    cJSON *root = NULL;
    if (st == TL_OK) st = tl_config_json_read(text, &root); /* (its rules hold for every family) */
    if (st == TL_OK) st = detect_family(root, family);
    if (st == TL_OK)
        st = *family ? (*family)->parse_config(root, cfg) : tl_config_from_json(root, cfg);
    cJSON_Delete(root);
    free(text);
    if (st != TL_OK) {
        char msg[TL_ERROR_MAX];
        snprintf(msg, sizeof msg, "%s", tl_last_error());
        return tl_fail(st, "%s/%s", dir, msg);
    }
    return TL_OK;
}

/* The model's fingerprint (a state file names the model it was written by): config.json's
   hash, then each weight file's header (names, dtypes, shapes, offsets) and a sample of
   every tensor's bytes: its start, middle and end. Another checkpoint of the same shapes
   (another seed, a fine-tune, a quantisation) differs in every sample; reading whole
   files would cost a second pass over gigabytes at each load. */
#define FINGERPRINT_SAMPLE 256
static void fingerprint_weights(tl_model *m, const tl_st_set *files) {
    tl_hasher hs;
    tl_hash_init(&hs);
    tl_hash_add(&hs, &m->fingerprint, sizeof m->fingerprint);
    for (int f = 0; f < files->n_files; f++) {
        const tl_st_file *file = &files->files[f];
        const uint8_t *map = file->map;
        uint64_t header_len = 0;
        for (int i = 7; i >= 0; i--) header_len = (header_len << 8) | map[i]; /* validated by tl_st_open */
        tl_hash_add(&hs, map, (size_t)(8 + header_len));
        for (int t = 0; t < file->n_tensors; t++) {
            const tl_st_tensor *x = &file->tensors[t];
            const size_t n = x->nbytes < FINGERPRINT_SAMPLE ? x->nbytes : FINGERPRINT_SAMPLE;
            tl_hash_add(&hs, x->data, n);
            tl_hash_add(&hs, x->data + (x->nbytes - n) / 2, n);
            tl_hash_add(&hs, x->data + x->nbytes - n, n);
        }
    }
    m->fingerprint = tl_hash_final(&hs);
}

/* The fingerprint also covers what a state's text is made of: every token's bytes and
   whether it is special (a state rebuilds its generated text, on which stop strings work,
   from its tokens). Merges and pre-tokenizer rules only encode prompts: not covered. */
static void fingerprint_tokenizer(tl_model *m) {
    tl_hasher hs;
    tl_hash_init(&hs);
    tl_hash_add(&hs, &m->fingerprint, sizeof m->fingerprint);
    const int n = m->tokenizer ? tl_tlz_vocab_size(m->tokenizer) : 0;
    tl_hash_add(&hs, &n, sizeof n);
    for (int32_t id = 0; id < n; id++) {
        const char *bytes = NULL;
        size_t len = 0;
        if (tl_tlz_token_bytes(m->tokenizer, id, &bytes, &len) != 0) len = (size_t)-1; /* an id without text */
        const uint8_t special = (uint8_t)(tl_tlz_is_special(m->tokenizer, id) != 0);
        tl_hash_add(&hs, &len, sizeof len);
        if (len != (size_t)-1) tl_hash_add(&hs, bytes, len);
        tl_hash_add(&hs, &special, 1);
    }
    m->fingerprint = tl_hash_final(&hs);
}

/* CUDA when asked (or an error naming why not), or under AUTO when the plugin finds a device;
   TINYLOOP_BACKEND=cpu|cuda overrides AUTO (a GPU machine running the CPU's tests). */
static tl_status choose_backend(tl_backend_kind kind, const tl_backend **backend) {
    const char *env = getenv("TINYLOOP_BACKEND");
    if (kind == TL_BACKEND_AUTO && env && !strcmp(env, "cpu")) return TL_OK;
    if (kind == TL_BACKEND_AUTO && env && !strcmp(env, "cuda")) kind = TL_BACKEND_CUDA;
    if (kind == TL_BACKEND_CPU) return TL_OK;
    const char *why;
    const tl_backend *cuda = tl_backend_cuda(&why);
    if (cuda) *backend = cuda;
    else if (kind == TL_BACKEND_CUDA) return tl_fail(TL_ERR_UNSUPPORTED, "backend CUDA: %s", why);
    return TL_OK; /* AUTO without a device: the CPU, silently */
}

/* The environment's settings (README): a value that none of their readers takes is refused at
   load, never read silently as the default (TINYLOOP_ISA=avx-512 ran the AVX-512 kernels with
   VNNI, not capped). An empty value is no setting. */
static tl_status check_environment(void) {
    static const struct {
        const char *name, *values[4];
    } SETTINGS[] = {
        {"TINYLOOP_BACKEND", {"cpu", "cuda"}},        {"TINYLOOP_ISA", {"generic", "avx2", "avx512"}},
        {"TINYLOOP_KV_TYPE", {"f32", "f16"}},         {"TINYLOOP_F16_HALVES", {"0", "1"}},
        {"TINYLOOP_PAIR_TILES", {"0", "1"}},
    };
    for (size_t i = 0; i < sizeof SETTINGS / sizeof SETTINGS[0]; i++) {
        const char *value = getenv(SETTINGS[i].name);
        if (!value || !*value) continue;
        bool known = false;
        char listed[64] = "";
        for (int k = 0; SETTINGS[i].values[k]; k++) {
            known = known || strcmp(value, SETTINGS[i].values[k]) == 0;
            snprintf(listed + strlen(listed), sizeof listed - strlen(listed), "%s%s", k ? ", " : "", SETTINGS[i].values[k]);
        }
        if (!known)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "environment: %s=%.64s is not one of %s (unset it for the default)",
                           SETTINGS[i].name, value, listed);
    }
    return TL_OK;
}

/* Every tensor of the open files bound for m's config (read already), and none left over:
   names, shapes, dtypes and values checked (errors name the file and the tensor). */
static tl_status bind_tensors(tl_model *m, tl_st_set *files, const tl_family *family) {
    tl_binder b = {m, files};
    tl_status st = allocate_layers(m);
    if (st == TL_OK) st = family ? family->bind(&b) : bind_all(&b);
    if (st == TL_OK) st = check_all_claimed(&b);
    return st;
}

/* dir/tokenizer.json into m->tokenizer, its ids within the config's vocabulary. */
static tl_status load_tokenizer(tl_model *m, const char *dir) {
    char tok_path[4200], err[TL_ERROR_MAX];
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", dir);
    const int code = tl_tlz_tokenizer_load(tok_path, &m->tokenizer, err, sizeof err);
    if (code != 0)
        return tl_fail(code == TLZ_ENOMEM ? TL_ERR_NO_MEMORY : code == TLZ_EIO ? TL_ERR_IO : TL_ERR_FORMAT, "%s", err);
    if (tl_tlz_vocab_size(m->tokenizer) > m->cfg.vocab_size)
        return tl_fail(TL_ERR_FORMAT, "%s: the tokenizer has %d ids but config.json vocab_size is %d", tok_path,
                       tl_tlz_vocab_size(m->tokenizer), m->cfg.vocab_size);
    return TL_OK;
}

tl_status tl_checkpoint_check(const char *dir, bool *tied) {
    *tied = false;
    tl_model *m = calloc(1, sizeof *m);
    tl_st_set *files = calloc(1, sizeof *files);
    tl_status st = m && files && (m->dir = strdup(dir)) ? TL_OK : tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    const tl_family *family = NULL;
    if (st == TL_OK) st = read_config(dir, &m->cfg, &m->fingerprint, &family);
    bool opened = false;
    if (st == TL_OK) opened = (st = tl_st_set_open(dir, files)) == TL_OK;
    if (st == TL_OK) st = bind_tensors(m, files, family);
    if (st == TL_OK && has_tokenizer_file(dir)) st = load_tokenizer(m, dir);
    if (st == TL_OK) *tied = m->cfg.tie_embeddings;
    if (opened) tl_st_set_close(files);
    free(files);
    tl_model_free(m);
    return st;
}

static tl_status load_into(tl_model *m, const char *dir, const tl_load_options *opts) {
    tl_status st;
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return tl_fail(TL_ERR_IO, "model directory %s: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return tl_fail(TL_ERR_IO, "%s is not a directory (expected a checkpoint directory)", dir);
    if (!(m->dir = strdup(dir))) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");

    const tl_family *family = NULL;
    /* (the config's hash starts the fingerprint: fingerprint_weights adds the weights) */
    if ((st = read_config(dir, &m->cfg, &m->fingerprint, &family)) != TL_OK) return st;

    if ((st = check_environment()) != TL_OK) return st;
    if (opts->backend != TL_BACKEND_AUTO && opts->backend != TL_BACKEND_CPU && opts->backend != TL_BACKEND_CUDA)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "load options: unknown backend %d", (int)opts->backend);
    if (opts->mmap_weights != 0 && opts->mmap_weights != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "load options: mmap_weights = %d must be 0 or 1", opts->mmap_weights);
    if (opts->n_threads < 0 || opts->n_threads > TL_MAX_THREADS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "load options: n_threads = %d is out of range [0, %d]", opts->n_threads,
                       TL_MAX_THREADS);
    if (opts->kv_type != TL_KV_F32 && opts->kv_type != TL_KV_F16)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "load options: unknown kv_type %d (f32 = 0, f16 = 1)",
                       (int)opts->kv_type);
    m->kv_type = opts->kv_type;
    const tl_backend *backend = &tl_cpu_backend;
    if ((st = choose_backend(opts->backend, &backend)) != TL_OK) return st;
    if (backend != &tl_cpu_backend && m->kv_type != TL_KV_F32)
        return tl_fail(TL_ERR_UNSUPPORTED, "load options: kv_type f16 is supported by the CPU backend only, "
                                           "not %s (load with kv_type f32, or backend cpu)", backend->name);

    tl_st_set *files = calloc(1, sizeof *files);
    if (!files) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    if ((st = tl_st_set_open(dir, files)) != TL_OK) { free(files); return st; }
    st = bind_tensors(m, files, family);
    if (st == TL_OK) fingerprint_weights(m, files);
    if (st == TL_OK) {
        const int half = m->cfg.head_dim / 2;
        m->rope_inv_freq = calloc((size_t)half + 1, sizeof(double));
        if (!m->rope_inv_freq) st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        for (int i = 0; st == TL_OK && i < half; i++)
            m->rope_inv_freq[i] = 1.0 / pow((double)m->cfg.rope_theta, (2.0 * i) / m->cfg.head_dim);
    }
    if (st == TL_OK && (st = backend->open(m, opts->n_threads, &m->backend_ctx)) == TL_OK)
        m->backend = backend; /* from here on tl_model_free closes it */
    if (st == TL_OK) fill_info(m, files);
    if (st == TL_OK && m->info.has_tokenizer) st = load_tokenizer(m, dir);
    if (st == TL_OK) fingerprint_tokenizer(m);
    if (st == TL_OK) st = upload_weights(m, opts->mmap_weights);
    if (st == TL_OK && opts->mmap_weights) {
        m->kept_files = files; /* the matrices point into the mappings */
        return TL_OK;
    }
    tl_st_set_close(files);
    free(files);
    return st;
}

tl_status tl_model_load(const char *dir, const tl_load_options *opts, tl_model **out) {
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_model_load: out must not be NULL");
    *out = NULL;
    if (!dir) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_model_load: dir must not be NULL");
    tl_load_options defaults;
    tl_load_options_init(&defaults);
    tl_model *m = calloc(1, sizeof *m);
    if (!m) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    atomic_init(&m->kv_page_bytes, 0);
    m->kv_spares = tl_kv_spares_new(); /* NULL (out of memory) only means no page reuse */
    tl_status st = load_into(m, dir, opts ? opts : &defaults);
    if (st != TL_OK) {
        tl_model_free(m);
        return st;
    }
    tl_clear_error();
    *out = m;
    return TL_OK;
}

const struct tl_model_info *tl_model_info(const tl_model *model) { return model ? &model->info : NULL; }

void tl_model_get_memory(const tl_model *model, tl_model_memory *out) {
    if (!out) return;
    *out = (tl_model_memory){0};
    if (!model) return;
    const long long spare = (long long)tl_kv_spares_bytes(model), pages = atomic_load(&model->kv_page_bytes);
    out->weight_bytes = model->info.weight_bytes;
    out->kv_spare_bytes = spare;
    out->kv_bytes = pages > spare ? pages - spare : 0; /* two reads: a page may move between them */
}

const char *tl_model_warnings(const tl_model *model) { return model ? model->cfg.warnings : ""; }

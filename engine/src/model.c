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
#include <sys/mman.h>
#include <sys/stat.h>

#include "backend.h"
#include "dtype.h"
#include "safetensors.h"
#include "tokenizer.h"

void tl_load_options_init(tl_load_options *opts) {
    if (!opts) return;
    memset(opts, 0, sizeof *opts);
    opts->n_threads = 0;
    opts->backend = TL_BACKEND_AUTO;
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
    if (m->backend) m->backend->close(m->backend_ctx); /* workers first: nothing runs after */
    tlz_tokenizer_free(m->tokenizer);
    for (int i = 0; i < m->n_owned; i++) tl_free_aligned(m->owned[i]);
    free(m->owned);
    if (m->mapping) munmap(m->mapping, m->mapping_len);
    free(m->w.prelude);
    free(m->w.block);
    free(m->w.coda);
    free(m->rope_inv_freq);
    free(m->dir);
    free(m);
}

/* ---------------------------------------------------------------- files */

/* ---------------------------------------------------------------- tensor binding */

typedef struct {
    tl_model *m;
    tl_st_file *file;
    const char *path;
} binder;

static tl_status find_shaped(binder *b, const char *name, int rows, int cols, tl_st_tensor **out) {
    tl_st_tensor *t = tl_st_find(b->file, name);
    if (!t) return tl_fail(TL_ERR_FORMAT, "%s: missing tensor \"%s\" (required by config.json)", b->path, name);
    t->claimed = true;
    bool ok = rows < 0 ? (t->ndim == 1 && t->shape[0] == cols)
                       : (t->ndim == 2 && t->shape[0] == rows && t->shape[1] == cols);
    if (!ok) {
        char got[96] = "[";
        for (int i = 0; i < t->ndim; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        strncat(got, "]", sizeof got - strlen(got) - 1);
        if (rows < 0)
            return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has shape %s, config.json implies [%d]",
                           b->path, name, got, cols);
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has shape %s, config.json implies [%d, %d]",
                       b->path, name, got, rows, cols);
    }
    if (t->dtype != TL_ST_F32 && t->dtype != TL_ST_F16 && t->dtype != TL_ST_BF16)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has dtype %s; only F32, F16 and BF16 are supported",
                       b->path, name, tl_st_dtype_name(t->dtype));
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
                       b->path, name, isnan(v) ? "NaN" : v > 0 ? "+inf" : "-inf", bad);
    }
    *out = t;
    return TL_OK;
}

static tl_status bind_matrix(binder *b, const char *name, int rows, int cols, tl_matrix *out) {
    tl_st_tensor *t;
    tl_status st = find_shaped(b, name, rows, cols, &t);
    if (st != TL_OK) return st;
    out->dtype = t->dtype == TL_ST_F32 ? TL_F32 : t->dtype == TL_ST_F16 ? TL_F16 : TL_BF16;
    out->rows = rows;
    out->cols = cols;
    out->data = t->data;
    size_t elem = tl_st_dtype_size(t->dtype);
    if ((uintptr_t)t->data % elem != 0) { /* unaligned in the file: keep an aligned copy */
        void *copy = own(b->m, tl_alloc_aligned(t->nbytes));
        if (!copy) return tl_fail(TL_ERR_NO_MEMORY, "out of memory copying \"%s\"", name);
        memcpy(copy, t->data, t->nbytes);
        out->data = copy;
    }
    return TL_OK;
}

/* A vector converted to an owned f32 array. */
static tl_status bind_vector(binder *b, const char *name, int len, const float **out) {
    tl_st_tensor *t;
    tl_status st = find_shaped(b, name, -1, len, &t);
    if (st != TL_OK) return st;
    float *v = own(b->m, tl_alloc_aligned((size_t)len * sizeof(float)));
    if (!v) return tl_fail(TL_ERR_NO_MEMORY, "out of memory copying \"%s\"", name);
    tl_convert_to_f32(t->data, t->dtype == TL_ST_F32 ? TL_F32 : t->dtype == TL_ST_F16 ? TL_F16 : TL_BF16,
                      (size_t)len, v);
    *out = v;
    return TL_OK;
}

static tl_status bind_norm(binder *b, const char *prefix, const float **w, const float **bias) {
    char name[256];
    const tl_config *c = &b->m->cfg;
    snprintf(name, sizeof name, "%s.weight", prefix);
    tl_status st = bind_vector(b, name, c->d_model, w);
    if (st != TL_OK || c->norm != TL_NORM_LAYERNORM) return st;
    snprintf(name, sizeof name, "%s.bias", prefix);
    return bind_vector(b, name, c->d_model, bias);
}

/* Matrix `prefix.weight` [rows, cols] and, when the config has biases, `prefix.bias`. */
static tl_status bind_linear(binder *b, const char *prefix, int rows, int cols, tl_matrix *w,
                             const float **bias) {
    char name[256];
    snprintf(name, sizeof name, "%s.weight", prefix);
    tl_status st = bind_matrix(b, name, rows, cols, w);
    if (st != TL_OK || !b->m->cfg.bias) return st;
    snprintf(name, sizeof name, "%s.bias", prefix);
    return bind_vector(b, name, rows, bias);
}

static tl_status bind_layer(binder *b, const char *group, int index, tl_layer *L) {
    const tl_config *c = &b->m->cfg;
    const int d = c->d_model, qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    char p[96], name[160];
    snprintf(p, sizeof p, "%s.%d", group, index);
    tl_status st;
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
#define SUB(suffix) (snprintf(name, sizeof name, "%s.%s", p, suffix), name)
    TRY(bind_norm(b, SUB("attn_norm"), &L->attn_norm_w, &L->attn_norm_b));
    TRY(bind_linear(b, SUB("attn.q"), qd, d, &L->q, &L->q_b));
    TRY(bind_linear(b, SUB("attn.k"), kvd, d, &L->k, &L->k_b));
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

static tl_status bind_all(binder *b) {
    tl_model *m = b->m;
    const tl_config *c = &m->cfg;
    tl_weights *w = &m->w;
    tl_status st;
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
    TRY(bind_matrix(b, "tok_embed.weight", c->vocab_size, c->d_model, &w->tok_embed));
    if (c->pos_encoding == TL_POS_LEARNED)
        TRY(bind_matrix(b, "pos_embed.weight", c->max_seq_len, c->d_model, &w->pos_embed));
    w->prelude = calloc((size_t)c->n_prelude + 1, sizeof(tl_layer));
    w->block = calloc((size_t)c->n_block + 1, sizeof(tl_layer));
    w->coda = calloc((size_t)c->n_coda + 1, sizeof(tl_layer));
    if (!w->prelude || !w->block || !w->coda) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    for (int i = 0; i < c->n_prelude; i++) TRY(bind_layer(b, "prelude", i, &w->prelude[i]));
    for (int i = 0; i < c->n_block; i++) TRY(bind_layer(b, "block", i, &w->block[i]));
    for (int i = 0; i < c->n_coda; i++) TRY(bind_layer(b, "coda", i, &w->coda[i]));
    if (c->injection == TL_INJECT_CONCAT)
        TRY(bind_linear(b, "inject", c->d_model, 2 * c->d_model, &w->inject, &w->inject_b));
    if (c->state_norm) TRY(bind_norm(b, "state_norm", &w->state_norm_w, &w->state_norm_b));
    TRY(bind_norm(b, "final_norm", &w->final_norm_w, &w->final_norm_b));
    if (c->tie_embeddings) w->lm_head = w->tok_embed;
    else TRY(bind_matrix(b, "lm_head.weight", c->vocab_size, c->d_model, &w->lm_head));
#undef TRY
    for (int i = 0; i < b->file->n_tensors; i++)
        if (!b->file->tensors[i].claimed)
            return tl_fail(TL_ERR_FORMAT, "%s: unexpected tensor \"%s\" (not used by this config%s)",
                           b->path, b->file->tensors[i].name,
                           strcmp(b->file->tensors[i].name, "lm_head.weight") == 0 ? ": tie_embeddings is true" : "");
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
    VEC(w->state_norm_w, d); VEC(w->state_norm_b, d);
    VEC(w->final_norm_w, d); VEC(w->final_norm_b, d);
    tl_layer *groups[3] = {w->prelude, w->block, w->coda};
    int counts[3] = {c->n_prelude, c->n_block, c->n_coda};
    for (int g = 0; g < 3; g++)
        for (int i = 0; i < counts[g]; i++) {
            tl_layer *L = &groups[g][i];
            VEC(L->attn_norm_w, d); VEC(L->attn_norm_b, d);
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
    const float ***vectors = malloc((size_t)(8 + 11 * layers) * sizeof *vectors);
    int *lens = malloc((size_t)(8 + 11 * layers) * sizeof *lens);
    tl_status st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    if (matrices && vectors && lens) {
        const int n_matrices = list_matrices(m, matrices), n_vectors = list_vectors(m, vectors, lens);
        st = m->backend->upload_weights(m, matrices, n_matrices, vectors, lens, n_vectors, keep_mapped);
        if (c->tie_embeddings) m->w.lm_head = m->w.tok_embed;
    }
    free(matrices);
    free(vectors);
    free(lens);
    return st;
}

/* ---------------------------------------------------------------- info */

static void fill_info(tl_model *m, const tl_st_file *file) {
    static const char *const injections[] = {"none", "add", "concat"};
    static const char *const dtypes[] = {"f32", "f16", "bf16"};
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
        .weight_dtype = dtypes[m->w.tok_embed.dtype],
        .state_norm = c->state_norm, .bias = c->bias, .tie_embeddings = c->tie_embeddings,
        .n_threads = m->backend->threads(m->backend_ctx), .backend = m->backend->name,
    };
    for (int t = 0; t < file->n_tensors; t++) {
        int64_t numel = 1;
        for (int k = 0; k < file->tensors[t].ndim; k++) numel *= file->tensors[t].shape[k];
        i->n_params += numel;
        i->weight_bytes += (int64_t)file->tensors[t].nbytes;
    }
    char path[4096];
    struct stat sb;
    snprintf(path, sizeof path, "%s/tokenizer.json", m->dir);
    /* lstat: any entry named tokenizer.json means "load it", so that a dangling symlink or an
       unreadable file is an error rather than a silent load without a tokenizer. */
    i->has_tokenizer = lstat(path, &sb) == 0;
}

/* ---------------------------------------------------------------- load */

static tl_status load_into(tl_model *m, const char *dir, const tl_load_options *opts) {
    char path[4096];
    char *text = NULL;
    tl_status st;
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return tl_fail(TL_ERR_IO, "model directory %s: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return tl_fail(TL_ERR_IO, "%s is not a directory (expected a checkpoint directory)", dir);
    if (!(m->dir = strdup(dir))) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");

    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t text_len;
    if ((st = tl_read_regular(path, TL_MAX_CONFIG_BYTES, &text, &text_len)) != TL_OK) return st;
    /* The parser reads up to the first NUL: what follows one would be ignored unseen. */
    st = strlen(text) != text_len
             ? tl_fail(TL_ERR_FORMAT, "config.json: contains a NUL byte at offset %zu", strlen(text))
             : tl_config_parse(text, &m->cfg);
    free(text);
    if (st != TL_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", tl_last_error());
        return tl_fail(st, "%s/%s", dir, msg);
    }

    if (opts->backend == TL_BACKEND_CUDA)
        return tl_fail(TL_ERR_UNSUPPORTED, "backend CUDA requested but this build has no CUDA backend");
    if (opts->backend != TL_BACKEND_AUTO && opts->backend != TL_BACKEND_CPU)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "load options: unknown backend %d", (int)opts->backend);
    if (opts->n_threads < 0 || opts->n_threads > 1024)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "load options: n_threads = %d is out of range [0, 1024]",
                       opts->n_threads);
    const tl_backend *backend = &tl_cpu_backend;

    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    tl_st_file file;
    if ((st = tl_st_open(path, &file)) != TL_OK) return st;
    binder b = {m, &file, path};
    st = bind_all(&b);
    if (st == TL_OK) {
        const int half = m->cfg.head_dim / 2;
        m->rope_inv_freq = calloc((size_t)half + 1, sizeof(double));
        if (!m->rope_inv_freq) st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        for (int i = 0; st == TL_OK && i < half; i++)
            m->rope_inv_freq[i] = 1.0 / pow((double)m->cfg.rope_theta, (2.0 * i) / m->cfg.head_dim);
    }
    if (st == TL_OK && (st = backend->open(m, opts->n_threads, &m->backend_ctx)) == TL_OK)
        m->backend = backend; /* from here on tl_model_free closes it */
    if (st == TL_OK) fill_info(m, &file);
    if (st == TL_OK && m->info.has_tokenizer) {
        char tok_path[4200], err[512];
        snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", dir);
        const int code = tlz_tokenizer_load(tok_path, &m->tokenizer, err, sizeof err);
        if (code != 0)
            st = tl_fail(code == TLZ_ENOMEM ? TL_ERR_NO_MEMORY : code == TLZ_EIO ? TL_ERR_IO : TL_ERR_FORMAT,
                         "%s", err);
        else if (tlz_vocab_size(m->tokenizer) > m->cfg.vocab_size)
            st = tl_fail(TL_ERR_FORMAT, "%s: the tokenizer has %d ids but config.json vocab_size is %d",
                         tok_path, tlz_vocab_size(m->tokenizer), m->cfg.vocab_size);
    }
    if (st == TL_OK) st = upload_weights(m, opts->mmap_weights);
    if (st == TL_OK && opts->mmap_weights) {
        /* The mapping outlives the header table: the matrices may point into it. */
        m->mapping = file.map;
        m->mapping_len = file.map_len;
        file.map = NULL;
    }
    tl_st_close(&file);
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

const char *tl_model_warnings(const tl_model *model) { return model ? model->cfg.warnings : ""; }

/* calibrate.c: activation statistics for activation-aware quantisation (see calibrate.h). */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calibrate.h"
#include "forward.h"

/* One matrix input: the statistics every matrix that reads it shares (q/k/v read one). */
typedef struct {
    const tl_matrix *first; /* the first matrix reading it: what the observe hook names */
    int cols;
    long rows;              /* rows accumulated (tokens x applications of the layer) */
    double *sum_sq;         /* [cols] */
    double *gram;           /* [cols][cols], upper triangle while accumulating; NULL without gram */
    float *importance;      /* [cols] mean x^2, when finished */
} calib_input;

typedef struct {
    char name[96];
    int input;
} calib_tensor;

struct tl_calibration {
    calib_input inputs[4 * 256 + 1];
    int n_inputs;
    calib_tensor *tensors;
    int n_tensors, cap_tensors;
    long tokens;
    bool failed; /* out of memory inside the hook (it cannot return a status) */
    char source[512];
    char text[512]; /* the calibration text's path (tl_calibrate_text), else "" */
};

static void calib_free_input(calib_input *in) {
    free(in->sum_sq);
    free(in->gram);
    free(in->importance);
}

void tl_calibration_free(tl_calibration *cal) {
    if (!cal) return;
    for (int i = 0; i < cal->n_inputs; i++) calib_free_input(&cal->inputs[i]);
    free(cal->tensors);
    free(cal);
}

/* A new input read by the `count` matrices named prefix.suffix[i].weight. */
static tl_status add_input(tl_calibration *cal, bool gram, const char *prefix, const tl_matrix *const *w,
                           const char *const *suffix, int count) {
    if (cal->n_inputs == (int)(sizeof cal->inputs / sizeof cal->inputs[0]))
        return tl_fail(TL_ERR_UNSUPPORTED, "calibrate: more than %d layers", 256);
    calib_input *in = &cal->inputs[cal->n_inputs];
    *in = (calib_input){.first = w[0], .cols = w[0]->cols};
    in->sum_sq = calloc((size_t)in->cols, sizeof *in->sum_sq);
    if (gram) in->gram = calloc((size_t)in->cols * (size_t)in->cols, sizeof *in->gram);
    if (!in->sum_sq || (gram && !in->gram)) {
        calib_free_input(in);
        return tl_fail(TL_ERR_NO_MEMORY, "calibrate: out of memory for the statistics of %s", prefix);
    }
    cal->n_inputs++;
    for (int i = 0; i < count; i++) {
        if (cal->n_tensors == cal->cap_tensors) {
            const int cap = cal->cap_tensors ? 2 * cal->cap_tensors : 64;
            calib_tensor *t = realloc(cal->tensors, (size_t)cap * sizeof *t);
            if (!t) return tl_fail(TL_ERR_NO_MEMORY, "calibrate: out of memory");
            cal->tensors = t;
            cal->cap_tensors = cap;
        }
        calib_tensor *t = &cal->tensors[cal->n_tensors++];
        snprintf(t->name, sizeof t->name, "%s%s.weight", prefix, suffix[i]);
        t->input = cal->n_inputs - 1;
    }
    return TL_OK;
}

/* The inputs of one layer, named as the generic loader binds them (model.c bind_layer). */
static tl_status add_layer(tl_calibration *cal, const tl_model *m, bool gram, const char *group, int index,
                           const tl_layer *L) {
    char p[64];
    snprintf(p, sizeof p, "%s.%d.", group, index);
    tl_status st;
    if ((st = add_input(cal, gram, p, (const tl_matrix *const[]){&L->q, &L->k, &L->v},
                        (const char *const[]){"attn.q", "attn.k", "attn.v"}, 3)) != TL_OK ||
        (st = add_input(cal, gram, p, (const tl_matrix *const[]){&L->o}, (const char *const[]){"attn.o"}, 1)) != TL_OK)
        return st;
    if (m->cfg.mlp == TL_MLP_SWIGLU)
        st = add_input(cal, gram, p, (const tl_matrix *const[]){&L->gate, &L->up},
                       (const char *const[]){"mlp.gate", "mlp.up"}, 2);
    else st = add_input(cal, gram, p, (const tl_matrix *const[]){&L->up}, (const char *const[]){"mlp.up"}, 1);
    if (st != TL_OK) return st;
    return add_input(cal, gram, p, (const tl_matrix *const[]){&L->down}, (const char *const[]){"mlp.down"}, 1);
}

/* The forward's observe hook: x [n][cols] is the input of the matrices w[0..count). */
static void observe(void *ctx, const tl_matrix *const *w, int count, const float *x, int n) {
    (void)count;
    tl_calibration *cal = ctx;
    calib_input *in = NULL;
    for (int i = 0; i < cal->n_inputs && !in; i++)
        if (cal->inputs[i].first == w[0]) in = &cal->inputs[i];
    if (!in) { cal->failed = true; return; } /* a matrix add_layer does not know: never expected */
    const int cols = in->cols;
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * (size_t)cols;
        for (int j = 0; j < cols; j++) in->sum_sq[j] += (double)xr[j] * xr[j];
        if (!in->gram) continue;
        /* Upper triangle only (mirrored when finished): half the work of the full product. */
        for (int j = 0; j < cols; j++) {
            const double xj = xr[j];
            double *g = in->gram + (size_t)j * (size_t)cols;
            if (xj != 0.0)
                for (int k = j; k < cols; k++) g[k] += xj * xr[k];
        }
    }
    in->rows += n;
}

/* Means from the sums; the Gram matrix mirrored to full. */
static tl_status finish(tl_calibration *cal) {
    for (int i = 0; i < cal->n_inputs; i++) {
        calib_input *in = &cal->inputs[i];
        const int cols = in->cols;
        if (in->rows == 0)
            return tl_fail(TL_ERR_INTERNAL, "calibrate: input %d was never observed", i);
        in->importance = malloc((size_t)cols * sizeof *in->importance);
        if (!in->importance) return tl_fail(TL_ERR_NO_MEMORY, "calibrate: out of memory");
        for (int j = 0; j < cols; j++) {
            in->importance[j] = (float)(in->sum_sq[j] / (double)in->rows);
            if (!isfinite(in->importance[j])) {
                const char *name = "?";
                for (int t = 0; t < cal->n_tensors; t++)
                    if (cal->tensors[t].input == i) { name = cal->tensors[t].name; break; }
                return tl_fail(TL_ERR_INVALID_ARGUMENT,
                               "calibrate: the input of %s overflows (mean x^2 not finite)", name);
            }
        }
        if (!in->gram) continue;
        for (int j = 0; j < cols; j++)
            for (int k = j; k < cols; k++) {
                const double v = in->gram[(size_t)j * cols + k] / (double)in->rows;
                in->gram[(size_t)j * cols + k] = in->gram[(size_t)k * cols + j] = v;
            }
    }
    return TL_OK;
}

tl_status tl_calibrate(const tl_model *m, const int32_t *ids, int n, int max_tokens, bool gram,
                       tl_calibration **out) {
    *out = NULL;
    if (!m || !ids) return tl_fail(TL_ERR_INVALID_ARGUMENT, "calibrate: model and ids must not be NULL");
    if (n < 2) return tl_fail(TL_ERR_INVALID_ARGUMENT, "calibrate: the calibration text has %d token%s, need at least 2", n, n == 1 ? "" : "s");
    if (max_tokens < 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "calibrate: max_tokens = %d, need >= 1", max_tokens);
    /* The hook reads activations in place: only host memory will do. */
    if (strcmp(m->backend->name, "cpu") != 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "calibrate: needs the CPU backend (the model runs on %s)", m->backend->name);
    const tl_config *c = &m->cfg;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab_size)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "calibrate: token id %d at index %d is out of range", ids[i], i);
    tl_calibration *cal = calloc(1, sizeof *cal);
    if (!cal) return tl_fail(TL_ERR_NO_MEMORY, "calibrate: out of memory");
    snprintf(cal->source, sizeof cal->source, "%s", m->dir ? m->dir : "(model)");
    tl_status st = TL_OK;
    for (int i = 0; st == TL_OK && i < c->n_prelude; i++) st = add_layer(cal, m, gram, "prelude", i, &m->w.prelude[i]);
    for (int i = 0; st == TL_OK && i < c->n_block; i++) st = add_layer(cal, m, gram, "block", i, &m->w.block[i]);
    for (int i = 0; st == TL_OK && i < c->n_coda; i++) st = add_layer(cal, m, gram, "coda", i, &m->w.coda[i]);
    if (st == TL_OK && c->injection == TL_INJECT_CONCAT)
        st = add_input(cal, gram, "", (const tl_matrix *const[]){&m->w.inject}, (const char *const[]){"inject"}, 1);
    if (st != TL_OK) { tl_calibration_free(cal); return st; }

    /* Windows spread evenly over the text, so that a capped calibration still sees all of it
       (the training text is the books one after another); enough of them to cover a text
       within the budget whole, the last ending at its end (n / window left the rest of a
       text between whole windows unseen: 254 of 510 tokens). */
    const int cap = c->max_seq_len < 256 ? c->max_seq_len : 256, window = n < cap ? n : cap;
    int n_win = (int)(((long)n + window - 1) / window);
    const long want = ((long)max_tokens + window - 1) / window;
    if (n_win > want) n_win = (int)want;
    if (n_win < 1) n_win = 1;
    tl_kv_cache *cache = NULL;
    tl_workspace ws = {0};
    ws.observe = observe;
    ws.observe_ctx = cal;
    int32_t *positions = malloc((size_t)window * sizeof *positions);
    st = positions ? tl_kv_cache_new_for(m, window, 0, TL_FORWARD_CHUNK, &cache)
                   : tl_fail(TL_ERR_NO_MEMORY, "calibrate: out of memory");
    if (st == TL_OK) cache->reserve_loops = c->default_loops;
    for (int i = 0; positions && i < window; i++) positions[i] = i;
    for (int w = 0; st == TL_OK && w < n_win; w++) {
        const long start = n_win > 1 ? (long)w * (long)(n - window) / (n_win - 1) : 0;
        st = tl_kv_truncate(cache, 0); /* an empty cache per window, as tl_score starts */
        for (int s = 0; st == TL_OK && s < window; s += TL_FORWARD_CHUNK) {
            const int len = window - s < TL_FORWARD_CHUNK ? window - s : TL_FORWARD_CHUNK;
            st = tl_forward_run(m, cache, &ws, ids + start + s, positions + s, len, NULL, c->default_loops, 0, NULL);
        }
        cal->tokens += window;
    }
    tl_workspace_release(&ws);
    tl_kv_cache_free(cache);
    free(positions);
    if (st == TL_OK && cal->failed) st = tl_fail(TL_ERR_INTERNAL, "calibrate: a matrix input had no statistics slot");
    if (st == TL_OK) st = finish(cal);
    if (st != TL_OK) { tl_calibration_free(cal); return st; }
    *out = cal;
    return TL_OK;
}

tl_status tl_calibrate_text(const char *model_dir, const char *text_path, int max_tokens, bool gram,
                            int n_threads, tl_calibration **out) {
    *out = NULL;
    char *text = NULL;
    size_t len = 0;
    tl_status st = tl_read_regular(text_path, (size_t)1 << 30, &text, &len);
    if (st != TL_OK) return st;
    if (len == 0) {
        free(text);
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "calibrate: %s is empty", text_path);
    }
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = n_threads;
    o.backend = TL_BACKEND_CPU; /* the calibration hook reads activations in host memory */
    tl_model *m = NULL;
    if ((st = tl_model_load(model_dir, &o, &m)) != TL_OK) { free(text); return st; }
    int32_t *ids = NULL;
    int n = 0;
    st = tl_encode(m, text, len, &ids, &n);
    free(text);
    if (st == TL_OK) st = tl_calibrate(m, ids, n, max_tokens, gram, out);
    if (st == TL_OK) {
        snprintf((*out)->source, sizeof (*out)->source, "%s", model_dir);
        snprintf((*out)->text, sizeof (*out)->text, "%s", text_path);
    }
    tl_free(ids);
    tl_model_free(m);
    return st;
}

int tl_calibration_count(const tl_calibration *cal) { return cal->n_tensors; }
const char *tl_calibration_name(const tl_calibration *cal, int i) { return cal->tensors[i].name; }
const char *tl_calibration_source(const tl_calibration *cal) { return cal->source; }
const char *tl_calibration_text(const tl_calibration *cal) { return cal->text; }
long tl_calibration_tokens(const tl_calibration *cal) { return cal->tokens; }

static const calib_input *find(const tl_calibration *cal, const char *name) {
    for (int i = 0; i < cal->n_tensors; i++)
        if (!strcmp(cal->tensors[i].name, name)) return &cal->inputs[cal->tensors[i].input];
    return NULL;
}

const float *tl_calibration_importance(const tl_calibration *cal, const char *name, int *cols) {
    const calib_input *in = find(cal, name);
    if (in && cols) *cols = in->cols;
    return in ? in->importance : NULL;
}

const double *tl_calibration_gram(const tl_calibration *cal, const char *name) {
    const calib_input *in = find(cal, name);
    return in ? in->gram : NULL;
}

long tl_calibration_rows(const tl_calibration *cal, const char *name) {
    const calib_input *in = find(cal, name);
    return in ? in->rows : 0;
}

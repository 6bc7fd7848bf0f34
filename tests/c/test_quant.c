/* test_quant.c: the q4 quantiser's scale search (engine/src/quant.c).
 *   test_quant GOLDEN_DIR SHIPPED_MODEL_DIR
 * - Per group, its squared error is never above that of the previous quantiser (max|x| / -8
 *   plus 13 nearby scales, kept here as the reference) nor of llama.cpp's Q4_0 rule alone,
 *   on random groups of many shapes and on real weight groups (the shipped model's matrices),
 *   and it is strictly lower on a good share of them (else the search would be dead code).
 * - It is deterministic (same bytes twice) and its nibbles and f16 scales are what the
 *   loader reads back: a q4 copy of a golden checkpoint loads, and every q4 matrix row
 *   dequantises (tl_matrix_row_f32, packed and mapped) to exactly scale * (u - 8) of what
 *   tl_quantize_row_q4 gives for the original row.
 * - With an importance vector (tl_quantize_row_q4_weighted, activation-aware quantisation),
 *   each group's importance-weighted error is never above that of the unweighted result,
 *   and strictly below it on a good share of groups; a uniform importance (any constant,
 *   or all zeros) gives the unweighted bytes exactly. */
#define _DEFAULT_SOURCE /* setrlimit */
#include <math.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "cpu/kernels.h"
#include "dtype.h"
#include "internal.h"
#include "quantised.h"
#include "safetensors.h"

enum { G = TL_QGROUP };

/* Error of one group as stored: packed nibbles and an f16 scale. */
static double group_error(const float *x, const uint8_t *packed, uint16_t scale) {
    const double d = tl_f16_to_f32(scale);
    double err = 0.0;
    for (int i = 0; i < G; i++) {
        const int u = (packed[i / 2] >> (i % 2 ? 4 : 0)) & 15;
        const double e = (double)x[i] - d * (u - 8);
        err += e * e;
    }
    return err;
}

static int clampi(long v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : (int)v; }

static double quantise_with(const float *x, uint16_t h) {
    const float d = tl_f16_to_f32(h), id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t packed[G / 2] = {0};
    for (int i = 0; i < G; i++) packed[i / 2] |= (uint8_t)(clampi(lrintf(x[i] * id) + 8, 0, 15) << (i % 2 ? 4 : 0));
    return group_error(x, packed, h);
}

/* The previous quantiser (commit ecdd675): the largest-magnitude element m at -8, then
   m / (-8 + step / 4) for step in [-6, 6], the least error kept. Returns its error; q4_0 gets
   the error of the plain Q4_0 rule d = m / -8. */
static double old_q4_error(const float *x, double *q4_0) {
    float m = 0.0f;
    for (int i = 0; i < G; i++)
        if (fabsf(x[i]) > fabsf(m)) m = x[i];
    double best = *q4_0 = quantise_with(x, tl_f32_to_f16(m / -8.0f));
    for (int step = -6; step <= 6; step++) {
        const double e = quantise_with(x, tl_f32_to_f16(m / (-8.0f + 0.25f * (float)step)));
        if (e < best) best = e;
    }
    return best;
}

typedef struct {
    long groups, better, worse;
    double new_err, old_err, q4_0_err;
} tally;

/* Quantises one row and compares each group with the old rules. */
static void compare_row(const float *x, int cols, tally *t, const char *what) {
    uint8_t *q = malloc((size_t)cols / 2), *q2 = malloc((size_t)cols / 2);
    uint16_t *s = malloc((size_t)cols / G * sizeof *s), *s2 = malloc((size_t)cols / G * sizeof *s2);
    tl_quantize_row_q4(x, cols, q, s);
    tl_quantize_row_q4(x, cols, q2, s2);
    CHECK(!memcmp(q, q2, (size_t)cols / 2) && !memcmp(s, s2, (size_t)cols / G * sizeof *s), "%s: not deterministic", what);
    for (int g = 0; g < cols / G; g++) {
        double q4_0;
        const double e = group_error(x + g * G, q + g * G / 2, s[g]), old = old_q4_error(x + g * G, &q4_0);
        t->groups++;
        t->new_err += e;
        t->old_err += old;
        t->q4_0_err += q4_0;
        /* Both sides are computed in double from the same values: no tolerance needed. */
        if (e > old || e > q4_0) {
            if (t->worse++ < 5)
                printf("  %s group %d: error %.9g, previous quantiser %.9g, Q4_0 %.9g\n", what, g, e, old, q4_0);
        }
        if (e < old) t->better++;
        CHECK(isfinite(tl_f16_to_f32(s[g])), "%s group %d: scale not finite", what, g);
    }
    free(q); free(q2); free(s); free(s2);
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double uniform(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2.0 * log(uniform() + 1e-300)) * cos(6.283185307179586 * uniform()); }

static void random_groups(void) {
    enum { COLS = 8 * G };
    float x[COLS];
    tally t = {0};
    /* Magnitudes from f16-subnormal scales to large ones, and the shapes that stress the
       rule: gaussian, heavy-tailed (one outlier), one-signed, constant, mostly zeros. */
    static const double mags[] = {1e-7, 1e-4, 0.02, 1.0, 300.0, 6e4};
    for (int trial = 0; trial < 3000; trial++) {
        const double mag = mags[trial % 6];
        const int shape = (trial / 6) % 5;
        for (int i = 0; i < COLS; i++) {
            double v = gauss();
            if (shape == 1 && i % G == (trial % G)) v *= 12.0;
            if (shape == 2) v = fabs(v);
            if (shape == 3) v = 0.75;
            if (shape == 4 && uniform() < 0.9) v = 0.0;
            x[i] = (float)(v * mag / (shape == 1 ? 12.0 : 4.0));
        }
        compare_row(x, COLS, &t, "random");
    }
    float zeros[G] = {0};
    compare_row(zeros, G, &t, "zeros");
    printf("  random: %ld groups, %ld better than the previous quantiser, %ld worse; error %.4g of its %.4g (Q4_0 %.4g)\n",
           t.groups, t.better, t.worse, t.new_err, t.old_err, t.q4_0_err);
    CHECK(t.worse == 0, "%ld random groups with more error than before", t.worse);
    CHECK(t.better * 10 > t.groups, "only %ld of %ld random groups improved", t.better, t.groups);
}

/* Every 2-D matrix of a real checkpoint, every 8th row (the whole model under ASan is slow). */
static void real_groups(const char *model_dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", model_dir);
    tl_st_file f;
    CHECK(tl_st_open(path, &f) == TL_OK, "%s: %s", path, tl_last_error());
    tally t = {0};
    for (int i = 0; i < f.n_tensors; i++) {
        const tl_st_tensor *ts = &f.tensors[i];
        if (ts->ndim != 2 || ts->shape[1] % G || ts->dtype != TL_ST_F16) continue;
        const int cols = (int)ts->shape[1];
        float *row = malloc((size_t)cols * sizeof *row);
        for (int64_t r = 0; r < ts->shape[0]; r += 8) {
            tl_convert_to_f32(ts->data + (size_t)r * (size_t)cols * 2, TL_F16, (size_t)cols, row);
            compare_row(row, cols, &t, ts->name);
        }
        free(row);
    }
    tl_st_close(&f);
    printf("  %s: %ld groups, %ld better than the previous quantiser, %ld worse; error %.4g of its %.4g (Q4_0 %.4g)\n",
           model_dir, t.groups, t.better, t.worse, t.new_err, t.old_err, t.q4_0_err);
    CHECK(t.groups > 10000, "only %ld real groups found in %s", t.groups, model_dir);
    CHECK(t.worse == 0, "%ld real groups with more error than before", t.worse);
    CHECK(t.better * 10 > t.groups, "only %ld of %ld real groups improved", t.better, t.groups);
}

/* A q4 copy of a golden checkpoint: what the loader binds is exactly the quantiser's output. */
static void round_trip(const char *golden, const char *name) {
    const char *qroot = quantised_copy(golden, name, TL_Q4);
    CHECK(qroot != NULL, "%s: quantise", name);
    if (!qroot) return;
    char dir[4096], path[4096];
    snprintf(dir, sizeof dir, "%s/%s", qroot, name);
    snprintf(path, sizeof path, "%s/%s/model.safetensors", golden, name);
    tl_st_file f;
    if (tl_st_open(path, &f) != TL_OK) { CHECK(0, "%s: %s", path, tl_last_error()); return; }
    for (int mapped = 0; mapped <= 1; mapped++) {
        tl_load_options o;
        tl_load_options_init(&o);
        o.mmap_weights = mapped;
        tl_model *m = NULL;
        CHECK(tl_model_load(dir, &o, &m) == TL_OK, "%s: load: %s", dir, tl_last_error());
        if (!m) continue;
        CHECK(!strcmp(tl_model_info(m)->weight_dtype, "q4"), "%s: weight_dtype %s", dir, tl_model_info(m)->weight_dtype);
        const tl_matrix *mat = &m->w.block[0].q;
        CHECK(mat->dtype == TL_Q4, "%s: block.0.attn.q is not q4", dir);
        const tl_st_tensor *ts = tl_st_find(&f, "block.0.attn.q.weight");
        CHECK(ts && ts->ndim == 2 && ts->shape[0] == mat->rows && ts->shape[1] == mat->cols, "%s: block.0.attn.q.weight", path);
        if (!ts || mat->dtype != TL_Q4) { tl_model_free(m); continue; }
        const int cols = mat->cols;
        float *x = malloc((size_t)cols * sizeof *x), *got = malloc((size_t)cols * sizeof *got);
        uint8_t *q = malloc((size_t)cols / 2);
        uint16_t *s = malloc((size_t)cols / G * sizeof *s);
        const tl_dtype src = ts->dtype == TL_ST_F32 ? TL_F32 : ts->dtype == TL_ST_F16 ? TL_F16 : TL_BF16;
        const size_t elem = tl_st_dtype_size(ts->dtype);
        int mismatches = 0;
        for (int r = 0; r < mat->rows; r++) {
            tl_convert_to_f32(ts->data + (size_t)r * (size_t)cols * elem, src, (size_t)cols, x);
            tl_quantize_row_q4(x, cols, q, s);
            tl_matrix_row_f32(mat, r, got);
            for (int c = 0; c < cols; c++) {
                const int u = (q[c / 2] >> (c % 2 ? 4 : 0)) & 15;
                mismatches += got[c] != tl_f16_to_f32(s[c / G]) * (float)(u - 8);
            }
        }
        CHECK(mismatches == 0, "%s (%s): %d elements differ from scale * (u - 8)", dir, mapped ? "mapped" : "packed", mismatches);
        free(x); free(got); free(q); free(s);
        tl_model_free(m);
    }
    tl_st_close(&f);
}

/* Weighted error of one group as stored, by the quantiser's own measure: c_i = imp_i / max
   (in float), sum c_i e_i^2 in double (quant.c q4_weights / q4_try). The same arithmetic on
   both sides, so the comparison needs no tolerance. */
static double weighted_error(const float *x, const float *imp, const uint8_t *packed, uint16_t scale) {
    float mx = 0.0f;
    for (int i = 0; i < G; i++) mx = imp[i] > mx ? imp[i] : mx;
    const double d = tl_f16_to_f32(scale);
    double err = 0.0;
    for (int i = 0; i < G; i++) {
        const int u = (packed[i / 2] >> (i % 2 ? 4 : 0)) & 15;
        const double e = (double)x[i] - d * (u - 8), c = mx > 0.0f ? (double)(imp[i] / mx) : 1.0;
        err += c * (e * e);
    }
    return err;
}

typedef struct { long groups, better, worse; double w_err, u_err; } wtally;

/* One row both ways: weighted result against the unweighted one, per group. */
static void compare_weighted(const float *x, const float *imp, int cols, wtally *t, const char *what) {
    uint8_t *q = malloc((size_t)cols / 2), *qu = malloc((size_t)cols / 2);
    uint16_t *s = malloc((size_t)cols / G * sizeof *s), *su = malloc((size_t)cols / G * sizeof *su);
    tl_quantize_row_q4_weighted(x, imp, cols, q, s);
    tl_quantize_row_q4(x, cols, qu, su);
    for (int g = 0; g < cols / G; g++) {
        const double w = weighted_error(x + g * G, imp + g * G, q + g * G / 2, s[g]),
                     u = weighted_error(x + g * G, imp + g * G, qu + g * G / 2, su[g]);
        t->groups++;
        t->w_err += w;
        t->u_err += u;
        if (w > u && t->worse++ < 5) printf("  %s group %d: weighted error %.9g, unweighted choice %.9g\n", what, g, w, u);
        t->better += w < u;
    }
    free(q); free(qu); free(s); free(su);
}

/* A uniform importance is the unweighted problem: the same bytes. */
static void check_uniform(const float *x, int cols, float value, const char *what) {
    uint8_t *q = malloc((size_t)cols / 2), *qu = malloc((size_t)cols / 2);
    uint16_t *s = malloc((size_t)cols / G * sizeof *s), *su = malloc((size_t)cols / G * sizeof *su);
    float *imp = malloc((size_t)cols * sizeof *imp);
    for (int i = 0; i < cols; i++) imp[i] = value;
    tl_quantize_row_q4_weighted(x, imp, cols, q, s);
    tl_quantize_row_q4(x, cols, qu, su);
    CHECK(!memcmp(q, qu, (size_t)cols / 2) && !memcmp(s, su, (size_t)cols / G * sizeof *s),
          "%s: uniform importance %g differs from the unweighted quantiser", what, value);
    free(q); free(qu); free(s); free(su); free(imp);
}

static void weighted_groups(const char *model_dir) {
    enum { COLS = 8 * G };
    float x[COLS], imp[COLS];
    wtally t = {0};
    static const double mags[] = {1e-4, 0.02, 1.0, 300.0};
    for (int trial = 0; trial < 2000; trial++) {
        const double mag = mags[trial % 4];
        const int shape = (trial / 4) % 4;
        for (int i = 0; i < COLS; i++) {
            x[i] = (float)(gauss() * mag / 4.0);
            /* importances: log-uniform over 6 decades; a few hot channels (the outlier
               features of real activations); some channels never active; near-uniform */
            const double r = uniform();
            imp[i] = shape == 0 ? (float)pow(10.0, -6.0 * r)
                   : shape == 1 ? (float)(r < 0.1 ? 100.0 : 1.0)
                   : shape == 2 ? (float)(r < 0.3 ? 0.0 : r)
                                : (float)(1.0 + 0.01 * r);
        }
        compare_weighted(x, imp, COLS, &t, "random");
        if (trial % 50 == 0) {
            static const float values[] = {1.0f, 3.7e-5f, 2.5e8f, 0.0f};
            for (int v = 0; v < 4; v++) check_uniform(x, COLS, values[v], "random");
        }
    }
    printf("  weighted, random: %ld groups, %ld better than the unweighted choice, %ld worse; weighted error %.4g of its %.4g\n",
           t.groups, t.better, t.worse, t.w_err, t.u_err);
    CHECK(t.worse == 0, "%ld random groups with more weighted error than the unweighted choice", t.worse);
    CHECK(t.better * 4 > t.groups, "only %ld of %ld random groups improved by the importance", t.better, t.groups);

    /* Real weight rows of the shipped model, with importances of the log-uniform shape. */
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", model_dir);
    tl_st_file f;
    CHECK(tl_st_open(path, &f) == TL_OK, "%s: %s", path, tl_last_error());
    wtally r = {0};
    for (int i = 0; i < f.n_tensors; i++) {
        const tl_st_tensor *ts = &f.tensors[i];
        if (ts->ndim != 2 || ts->shape[1] % G || ts->dtype != TL_ST_F16) continue;
        const int cols = (int)ts->shape[1];
        float *row = malloc((size_t)cols * sizeof *row), *w = malloc((size_t)cols * sizeof *w);
        for (int c = 0; c < cols; c++) w[c] = (float)pow(10.0, -3.0 * uniform());
        for (int64_t k = 0; k < ts->shape[0]; k += 32) {
            tl_convert_to_f32(ts->data + (size_t)k * (size_t)cols * 2, TL_F16, (size_t)cols, row);
            compare_weighted(row, w, cols, &r, ts->name);
            if (k % 256 == 0) check_uniform(row, cols, 0.125f, ts->name);
        }
        free(row); free(w);
    }
    tl_st_close(&f);
    printf("  weighted, %s: %ld groups, %ld better, %ld worse; weighted error %.4g of its %.4g\n", model_dir,
           r.groups, r.better, r.worse, r.w_err, r.u_err);
    CHECK(r.groups > 1000 && r.worse == 0, "%ld of %ld real groups with more weighted error", r.worse, r.groups);
    CHECK(r.better * 4 > r.groups, "only %ld of %ld real groups improved by the importance", r.better, r.groups);
}

/* The checkpoint quantised on 1 and on 3 threads (tasks of 32 rows; the shipped model's
   matrices are 8 to 128 tasks each, so the threads do run side by side): the same bytes. */
static void threads_alike(const char *model_dir) {
    char dirs[2][512], paths[2][1100];
    const int threads[2] = {1, 3};
    for (int i = 0; i < 2; i++) {
        snprintf(dirs[i], sizeof dirs[i], "%s/q8-threads-%d", quantised_root, threads[i]);
        snprintf(paths[i], sizeof paths[i], "%s/model.safetensors", dirs[i]);
        CHECK(tl_quantize_checkpoint_calibrated(model_dir, dirs[i], TL_Q8, NULL, threads[i], false) == TL_OK, "q8 on %d threads: %s",
              threads[i], tl_last_error());
    }
    long bytes;
    const long differ = check_files_differ(paths[0], paths[1], &bytes);
    CHECK(differ == 0 && bytes > 1000000, "q8 of %s: %ld of %ld bytes differ between 1 and 3 threads (-1: unreadable)",
          model_dir, differ, bytes);
}

/* A tied Hugging Face folder that stores its head's copy (ouro_bf16_tied), joined into one
   file (the quantiser takes no shards): quantised, the copy no load reads is left out (it was
   quantised, and the load refused its scales as an unexpected tensor, after the quantiser had
   written its output); a head quantised so by an earlier version still loads (the loader
   ignores a copy's scales with it). */
static bool join_shards(const char *from_dir, const char *to_dir, const char *keep_scale_of) {
    tl_st_set set;
    if (tl_st_set_open(from_dir, &set) != TL_OK) { CHECK(0, "%s: %s", from_dir, tl_last_error()); return false; }
    char path[1100];
    snprintf(path, sizeof path, "mkdir -p '%s' && cp '%s/config.json' '%s/'", to_dir, from_dir, to_dir);
    bool ok = system(path) == 0;
    /* the header: every tensor in file order, offsets one after another (and, asked, a fake
       "<name>_scale" of one byte, as an old quantisation's leftover) */
    size_t cap = 1 << 16, n = 0;
    char *header = malloc(cap);
    uint64_t offset = 0;
    n += (size_t)snprintf(header + n, cap - n, "{");
    for (int f = 0; f < set.n_files; f++)
        for (int i = 0; i < set.files[f].n_tensors; i++) {
            const tl_st_tensor *t = &set.files[f].tensors[i];
            n += (size_t)snprintf(header + n, cap - n, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", n > 1 ? "," : "", t->name,
                                  tl_st_dtype_name(t->dtype));
            for (int d = 0; d < t->ndim; d++) n += (size_t)snprintf(header + n, cap - n, "%s%lld", d ? "," : "", (long long)t->shape[d]);
            n += (size_t)snprintf(header + n, cap - n, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
                                  (unsigned long long)(offset + t->nbytes));
            offset += t->nbytes;
        }
    if (keep_scale_of)
        n += (size_t)snprintf(header + n, cap - n, ",\"%s_scale\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[%llu,%llu]}",
                              keep_scale_of, (unsigned long long)offset, (unsigned long long)(offset + 1));
    n += (size_t)snprintf(header + n, cap - n, "}");
    while (n % 8) header[n++] = ' ';
    snprintf(path, sizeof path, "%s/model.safetensors", to_dir);
    FILE *out = ok ? fopen(path, "wb") : NULL;
    ok = out != NULL;
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)((uint64_t)n >> (8 * i));
    if (ok) ok = fwrite(len_le, 1, 8, out) == 8 && fwrite(header, 1, n, out) == n;
    for (int f = 0; ok && f < set.n_files; f++)
        for (int i = 0; ok && i < set.files[f].n_tensors; i++)
            ok = fwrite(set.files[f].tensors[i].data, 1, set.files[f].tensors[i].nbytes, out) == set.files[f].tensors[i].nbytes;
    if (ok && keep_scale_of) ok = fputc(0, out) != EOF;
    if (out) ok = fclose(out) == 0 && ok;
    free(header);
    tl_st_set_close(&set);
    CHECK(ok, "join %s into %s", from_dir, to_dir);
    return ok;
}
static void tied_head_copy(const char *hf_dir) {
    char joined[1024], out[1100], stale[1024], path[1200];
    snprintf(joined, sizeof joined, "%s/ouro-tied-joined", quantised_root);
    snprintf(out, sizeof out, "%s/ouro-tied-q8", quantised_root);
    if (!join_shards(hf_dir, joined, NULL)) return;
    tl_model *m = NULL;
    CHECK(tl_model_load(joined, NULL, &m) == TL_OK, "the joined folder loads: %s", tl_last_error());
    tl_model_free(m);
    for (int type = 0; type < 2; type++) {
        CHECK(tl_quantize_checkpoint(joined, out, type ? TL_Q4 : TL_Q8) == TL_OK, "quantise %s: %s", joined, tl_last_error());
        m = NULL;
        CHECK(tl_model_load(out, NULL, &m) == TL_OK, "%s: load: %s", out, tl_last_error());
        tl_model_free(m);
        snprintf(path, sizeof path, "%s/model.safetensors", out);
        tl_st_file f;
        if (tl_st_open(path, &f) == TL_OK) {
            CHECK(!tl_st_find(&f, "lm_head.weight") && !tl_st_find(&f, "lm_head.weight_scale"),
                  "the tied head's copy is left out");
            tl_st_close(&f);
        }
    }
    /* an earlier quantisation's leftover scales of the copy: ignored with it */
    snprintf(stale, sizeof stale, "%s/ouro-tied-stale", quantised_root);
    if (!join_shards(hf_dir, stale, "lm_head.weight")) return;
    m = NULL;
    CHECK(tl_model_load(stale, NULL, &m) == TL_OK, "a copy's scales are ignored with it: %s", tl_last_error());
    tl_model_free(m);
}

/* A Hugging Face Huginn folder quantised (its fused Wqkv and mlp.fc, split by rows at load,
   were refused once quantised, after the quantiser had written its output): it loads, and
   each split matrix's row r is what tl_quantize_row_q4 makes of the fused row it came from,
   packed and mapped. */
static void fused_split(const char *hf_dir) {
    char out[1024], path[1100];
    snprintf(out, sizeof out, "%s/huginn-q4", quantised_root);
    CHECK(tl_quantize_checkpoint(hf_dir, out, TL_Q4) == TL_OK, "quantise %s: %s", hf_dir, tl_last_error());
    snprintf(path, sizeof path, "%s/model.safetensors", hf_dir);
    tl_st_file f;
    if (tl_st_open(path, &f) != TL_OK) { CHECK(0, "%s: %s", path, tl_last_error()); return; }
    const tl_st_tensor *qkv = tl_st_find(&f, "transformer.core_block.0.attn.Wqkv.weight");
    for (int mapped = 0; qkv && mapped <= 1; mapped++) {
        tl_load_options o;
        tl_load_options_init(&o);
        o.mmap_weights = mapped;
        tl_model *m = NULL;
        CHECK(tl_model_load(out, &o, &m) == TL_OK, "%s: load: %s", out, tl_last_error());
        if (!m) continue;
        const tl_layer *L = &m->w.block[0];
        const tl_matrix *parts[3] = {&L->q, &L->k, &L->v};
        const int cols = (int)qkv->shape[1];
        float x[256], got[256];
        uint8_t q[128];
        uint16_t s[256 / G];
        int row0 = 0, mismatches = 0;
        for (int p = 0; p < 3 && cols <= 256; p++) {
            CHECK(parts[p]->dtype == TL_Q4 && parts[p]->cols == cols, "part %d of Wqkv: q4 [*, %d]", p, cols);
            for (int r = 0; r < parts[p]->rows; r++) {
                tl_convert_to_f32(qkv->data + (size_t)(row0 + r) * (size_t)cols * 4, TL_F32, (size_t)cols, x);
                tl_quantize_row_q4(x, cols, q, s);
                tl_matrix_row_f32(parts[p], r, got);
                for (int c = 0; c < cols; c++) {
                    const int u = (q[c / 2] >> (c % 2 ? 4 : 0)) & 15;
                    mismatches += got[c] != tl_f16_to_f32(s[c / G]) * (float)(u - 8);
                }
            }
            row0 += parts[p]->rows;
        }
        CHECK(row0 == qkv->shape[0] && mismatches == 0, "%s (%s): %d of Wqkv's elements are not their fused row's",
              out, mapped ? "mapped" : "packed", mismatches);
        tl_model_free(m);
    }
    CHECK(qkv && qkv->dtype == TL_ST_F32, "the Huginn test checkpoint's Wqkv (F32)");
    tl_st_close(&f);
    /* q4 keeps the embedding at q8 under Hugging Face's names too (Huginn's wte was q4) */
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    if (tl_st_open(path, &f) != TL_OK) { CHECK(0, "%s: %s", path, tl_last_error()); return; }
    const tl_st_tensor *wte = tl_st_find(&f, "transformer.wte.weight");
    CHECK(wte && wte->dtype == TL_ST_I8, "Huginn's wte in a q4 checkpoint: %s", wte ? tl_st_dtype_name(wte->dtype) : "missing");
    tl_st_close(&f);
}

/* `pure` q4 (scripts/quantize --pure): the embedding and the tied head are q4 like every
   other matrix (plain q4 keeps them at q8, checked here too), each row exactly
   tl_quantize_row_q4's; the model loads, reports q4, and decodes, reading 4.5 bits for the
   head's weights where plain q4 reads 8.5. */
static void pure_q4(const char *golden) {
    char src[1024], plain[1100], pure[1100], path[1200];
    snprintf(src, sizeof src, "%s/gpt2_like", golden);
    snprintf(plain, sizeof plain, "%s/plain-q4", quantised_root);
    snprintf(pure, sizeof pure, "%s/pure-q4", quantised_root);
    CHECK(tl_quantize_checkpoint_calibrated(src, plain, TL_Q4, NULL, 0, false) == TL_OK, "plain q4: %s", tl_last_error());
    CHECK(tl_quantize_checkpoint_calibrated(src, pure, TL_Q4, NULL, 0, true) == TL_OK, "pure q4: %s", tl_last_error());
    const char *dirs[2] = {plain, pure};
    const tl_st_dtype want[2] = {TL_ST_I8, TL_ST_U8};
    long bytes[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/model.safetensors", dirs[i]);
        tl_st_file f;
        if (tl_st_open(path, &f) != TL_OK) { CHECK(0, "%s: %s", path, tl_last_error()); return; }
        const tl_st_tensor *e = tl_st_find(&f, "tok_embed.weight"), *q = tl_st_find(&f, "block.0.attn.q.weight");
        CHECK(e && e->dtype == want[i], "%s: tok_embed.weight is %s", dirs[i], e ? tl_st_dtype_name(e->dtype) : "missing");
        CHECK(q && q->dtype == TL_ST_U8, "%s: block.0.attn.q.weight is %s", dirs[i], q ? tl_st_dtype_name(q->dtype) : "missing");
        tl_st_close(&f);
        struct stat st;
        bytes[i] = stat(path, &st) == 0 ? (long)st.st_size : 0;
    }
    CHECK(bytes[1] > 0 && bytes[1] < bytes[0], "pure q4 is smaller than plain q4 (%ld, %ld bytes)", bytes[1], bytes[0]);
    snprintf(path, sizeof path, "%s/model.safetensors", src);
    tl_st_file f;
    if (tl_st_open(path, &f) != TL_OK) { CHECK(0, "%s: %s", path, tl_last_error()); return; }
    tl_model *m = NULL;
    CHECK(tl_model_load(pure, NULL, &m) == TL_OK, "%s: load: %s", pure, tl_last_error());
    const tl_st_tensor *ts = tl_st_find(&f, "tok_embed.weight");
    if (m && ts) {
        CHECK(!strcmp(tl_model_info(m)->weight_dtype, "q4"), "pure: weight_dtype %s", tl_model_info(m)->weight_dtype);
        const tl_matrix *mat = &m->w.tok_embed;
        CHECK(mat->dtype == TL_Q4 && m->w.lm_head.dtype == TL_Q4, "pure: the embedding and the head are q4");
        const int cols = mat->cols;
        float *x = malloc((size_t)cols * sizeof *x), *got = malloc((size_t)cols * sizeof *got);
        uint8_t *q = malloc((size_t)cols / 2);
        uint16_t *sc = malloc((size_t)cols / G * sizeof *sc);
        const tl_dtype from = ts->dtype == TL_ST_F32 ? TL_F32 : ts->dtype == TL_ST_F16 ? TL_F16 : TL_BF16;
        int mismatches = 0;
        for (int r = 0; r < mat->rows; r++) {
            tl_convert_to_f32(ts->data + (size_t)r * (size_t)cols * tl_st_dtype_size(ts->dtype), from, (size_t)cols, x);
            tl_quantize_row_q4(x, cols, q, sc);
            tl_matrix_row_f32(mat, r, got);
            for (int c = 0; c < cols; c++)
                mismatches += got[c] != tl_f16_to_f32(sc[c / G]) * (float)(((q[c / 2] >> (c % 2 ? 4 : 0)) & 15) - 8);
        }
        CHECK(mismatches == 0, "pure: %d of the embedding's elements are not tl_quantize_row_q4's", mismatches);
        free(x); free(got); free(q); free(sc);
        int32_t prompt[3] = {1, 2, 3}, out[11];
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 8;
        cfg.ignore_eos = true;
        int n_out = 0;
        CHECK(tl_generate(m, prompt, 3, &cfg, out, 11, &n_out, NULL) == TL_OK && n_out == 11, "pure: decodes 8 tokens: %s",
              tl_last_error());
    }
    tl_model_free(m);
    tl_st_close(&f);
}

/* The whole file at `path` (free it), or NULL. */
static char *slurp(const char *path, long *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *bytes = malloc((size_t)*len + 1);
    if (bytes && fread(bytes, 1, (size_t)*len, f) != (size_t)*len) { free(bytes); bytes = NULL; }
    fclose(f);
    return bytes;
}

/* Overwrites the first element of tensor `name` in dir/model.safetensors (F32 or F16) with
   `value`, or the raw `bits` (an f16 scale). */
static bool poke_first(const char *dir, const char *name, float value, int bits) {
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    tl_st_file f;
    if (tl_st_open(path, &f) != TL_OK) return false;
    long at = -1;
    tl_st_dtype dtype = TL_ST_F32;
    for (int i = 0; i < f.n_tensors; i++)
        if (!strcmp(f.tensors[i].name, name)) at = (long)(f.tensors[i].data - (const uint8_t *)f.map), dtype = f.tensors[i].dtype;
    tl_st_close(&f);
    FILE *out = at >= 0 ? fopen(path, "r+b") : NULL;
    if (!out) return false;
    const uint16_t half = (uint16_t)bits;
    const bool ok = fseek(out, at, SEEK_SET) == 0 &&
                    (dtype == TL_ST_F16 ? fwrite(&half, 2, 1, out) : fwrite(&value, 4, 1, out)) == 1;
    return fclose(out) == 0 && ok;
}

/* The quantiser refuses, before writing anything, what would destroy its input or give a
   broken model: OUT_DIR being IN_DIR (it truncated the input's files and died of SIGBUS on
   its own mapping), an input already quantised (passed through as it was, under the other
   type's name), an OUT_DIR holding a sharded checkpoint (whose index the loader would read
   instead), weights with a NaN, and weights too large for a group's f16 scale; the loader
   refuses a non-finite scale like a non-finite weight. */
static void refusals(const char *golden) {
    char src[1024], dir[1024], cmd[16384], out[1024], path[1100];
    snprintf(src, sizeof src, "%s/gpt2_like", golden);
    snprintf(dir, sizeof dir, "%s/same", quantised_root);
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", src, dir);
    CHECK(system(cmd) == 0, "copy");
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    long before_len = 0, after_len = 0;
    char *before = slurp(path, &before_len);
    char alias[1100];
    snprintf(alias, sizeof alias, "%s/.", dir);
    CHECK_ERROR(tl_quantize_checkpoint(dir, dir, TL_Q8), TL_ERR_INVALID_ARGUMENT, "is IN_DIR");
    CHECK_ERROR(tl_quantize_checkpoint(dir, alias, TL_Q4), TL_ERR_INVALID_ARGUMENT, "is IN_DIR");
    char *after = slurp(path, &after_len);
    CHECK(before && after && before_len == after_len && !memcmp(before, after, (size_t)before_len),
          "the input is untouched (%ld -> %ld bytes)", before_len, after_len);
    free(before), free(after);

    snprintf(out, sizeof out, "%s/again", quantised_root);
    snprintf(dir, sizeof dir, "%s/q4/gpt2_like", quantised_root); /* round_trip's q4 copy */
    CHECK_ERROR(tl_quantize_checkpoint(dir, out, TL_Q8), TL_ERR_INVALID_ARGUMENT, "is already quantised");

    snprintf(out, sizeof out, "%s/sharded", quantised_root);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && : > '%s/model.safetensors.index.json'", out, out);
    CHECK(system(cmd) == 0, "sharded");
    CHECK_ERROR(tl_quantize_checkpoint(src, out, TL_Q8), TL_ERR_INVALID_ARGUMENT, "holds a sharded checkpoint");
    /* ...and as IN_DIR, said as such (it was "model.safetensors: cannot open") */
    snprintf(dir, sizeof dir, "%s/sharded-in", quantised_root);
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && cp '%s/config.json' '%s/' && : > '%s/model.safetensors.index.json'", dir, src, dir, dir);
    CHECK(system(cmd) == 0, "sharded input");
    snprintf(out, sizeof out, "%s/from-sharded", quantised_root);
    CHECK_ERROR(tl_quantize_checkpoint(dir, out, TL_Q8), TL_ERR_UNSUPPORTED, "a sharded input is not supported yet");

    const float values[2] = {NAN, 1e7f};
    const char *const want[2] = {"non-finite value at [0, 0]", "too large for a group's f16 scale"};
    for (int i = 0; i < 2; i++) {
        snprintf(dir, sizeof dir, "%s/poked-%d", quantised_root, i);
        snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", src, dir);
        CHECK(system(cmd) == 0 && poke_first(dir, "block.0.attn.q.weight", values[i], 0), "poke %d", i);
        snprintf(out, sizeof out, "%s/poked-%d-q8", quantised_root, i);
        CHECK_ERROR(tl_quantize_checkpoint(dir, out, TL_Q8), TL_ERR_INVALID_ARGUMENT, want[i]);
        struct stat st;
        CHECK(stat(out, &st) != 0, "nothing written for a refused input: %s exists", out);
    }
    /* a NaN in a tensor copied as it is (a norm) is refused before writing too (the written
       checkpoint did not load, and an earlier good one had been replaced by then) */
    snprintf(dir, sizeof dir, "%s/poked-norm", quantised_root);
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", src, dir);
    CHECK(system(cmd) == 0 && poke_first(dir, "block.0.mlp_norm.weight", NAN, 0), "poke the norm");
    snprintf(out, sizeof out, "%s/poked-norm-q8", quantised_root);
    CHECK_ERROR(tl_quantize_checkpoint(dir, out, TL_Q8), TL_ERR_INVALID_ARGUMENT,
                "tensor block.0.mlp_norm.weight has a non-finite value at [0]");
    struct stat nothing;
    CHECK(stat(out, &nothing) != 0, "nothing written for a NaN in a norm: %s exists", out);
    /* an input that does not load (its config against its tensors, its tokenizer.json) is
       refused before writing, with the loader's message: it made a checkpoint that did not
       load, found only by the tool's load after it had replaced an earlier good one */
    snprintf(out, sizeof out, "%s/kept-good", quantised_root);
    CHECK(tl_quantize_checkpoint(src, out, TL_Q8) == TL_OK, "a good one first: %s", tl_last_error());
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    long good_len = 0;
    char *good = slurp(path, &good_len);
    const char *const breakages[2] = {"sed -i 's/\"tie_embeddings\": true/\"tie_embeddings\": false/' '%s/config.json'",
                                      "echo '{' > '%s/tokenizer.json'"};
    const char *const said[2] = {"missing tensor \"lm_head.weight\" (required by config.json)", "tokenizer.json"};
    for (int i = 0; i < 2; i++) {
        snprintf(dir, sizeof dir, "%s/not-loading-%d", quantised_root, i);
        snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", src, dir);
        CHECK(system(cmd) == 0, "copy %d", i);
        char breakage[2048];
        snprintf(breakage, sizeof breakage, breakages[i], dir);
        CHECK(system(breakage) == 0, "break %d", i);
        tl_model *broken = NULL;
        CHECK(tl_model_load(dir, NULL, &broken) != TL_OK, "the broken input %d does not load", i);
        tl_model_free(broken);
        CHECK_ERROR(tl_quantize_checkpoint(dir, out, TL_Q8), TL_ERR_FORMAT, "does not load, so nothing was written");
        CHECK(strstr(tl_last_error(), said[i]) != NULL, "the loader's reason: %s", tl_last_error());
        long now_len = 0;
        char *now = slurp(path, &now_len);
        CHECK(good && now && now_len == good_len && !memcmp(good, now, (size_t)good_len),
              "the earlier good checkpoint's weights are untouched after broken input %d", i);
        free(now);
        tl_model *still_good = NULL; /* (its config.json and tokenizer.json too) */
        CHECK(tl_model_load(out, NULL, &still_good) == TL_OK, "the earlier good checkpoint still loads after broken "
              "input %d: %s", i, tl_last_error());
        tl_model_free(still_good);
    }
    free(good);
    /* matrices whose width does not split into groups are kept as they are, which
       tl_quantize_kept counts (the tool says so), and weight_dtype is the layers' quantised
       one (it said f32); a checkpoint with no matrix to quantise is refused (it was written,
       labelled q4, with not one quantised tensor) */
    snprintf(dir, sizeof dir, "%s/defaults_extra_field", golden); /* d_model 24, d_ff 64 */
    snprintf(out, sizeof out, "%s/narrow-q8", quantised_root);
    CHECK(tl_quantize_checkpoint(dir, out, TL_Q8) == TL_OK, "narrow: %s", tl_last_error());
    tl_model *narrow = NULL;
    CHECK(tl_model_load(out, NULL, &narrow) == TL_OK, "narrow q8 loads: %s", tl_last_error());
    if (narrow) CHECK(!strcmp(tl_model_info(narrow)->weight_dtype, "q8"), "narrow: %s", tl_model_info(narrow)->weight_dtype);
    tl_model_free(narrow);
    char first[256] = "";
    int64_t width = 0;
    const int kept = tl_quantize_kept(dir, first, sizeof first, &width);
    CHECK(kept >= 6 && width == 24 && first[0], "kept %d, the first %s of width %lld", kept, first, (long long)width);
    snprintf(dir, sizeof dir, "%s/nblock0_add_residual", golden); /* d_model 16, d_ff 48 */
    snprintf(out, sizeof out, "%s/none-q4", quantised_root);
    CHECK_ERROR(tl_quantize_checkpoint(dir, out, TL_Q4), TL_ERR_INVALID_ARGUMENT, "nothing to quantise");
    CHECK(stat(out, &nothing) != 0, "nothing written without a matrix to quantise: %s exists", out);
    CHECK(tl_quantize_kept("/nonexistent", first, sizeof first, &width) == -1, "kept of nothing");
    /* q4's bound is its own: 65504 x 8 (1e6 fits q8's 65504 x 127, and q4 wrote it clipped) */
    snprintf(dir, sizeof dir, "%s/poked-q4", quantised_root);
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", src, dir);
    CHECK(system(cmd) == 0 && poke_first(dir, "block.0.attn.q.weight", 1e6f, 0), "poke q4");
    snprintf(out, sizeof out, "%s/poked-q4-q4", quantised_root);
    CHECK_ERROR(tl_quantize_checkpoint(dir, out, TL_Q4), TL_ERR_INVALID_ARGUMENT, "(|x| <= 65504 x 8 for q4)");
    snprintf(out, sizeof out, "%s/poked-q4-q8", quantised_root);
    CHECK(tl_quantize_checkpoint(dir, out, TL_Q8) == TL_OK, "1e6 is a q8 weight: %s", tl_last_error());
    /* the embedding is q8 in plain q4 (1e6 fits), q4 under --pure (refused by q4's bound) */
    snprintf(dir, sizeof dir, "%s/poked-embed", quantised_root);
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s'", src, dir);
    CHECK(system(cmd) == 0 && poke_first(dir, "tok_embed.weight", 1e6f, 0), "poke the embedding");
    snprintf(out, sizeof out, "%s/poked-embed-q4", quantised_root);
    CHECK(tl_quantize_checkpoint(dir, out, TL_Q4) == TL_OK, "1e6 in the embedding is q8 in plain q4: %s", tl_last_error());
    snprintf(out, sizeof out, "%s/poked-embed-pure", quantised_root);
    CHECK_ERROR(tl_quantize_checkpoint_calibrated(dir, out, TL_Q4, NULL, 0, true), TL_ERR_INVALID_ARGUMENT,
                "tok_embed.weight has 1e+06");

    /* A run that fails while writing (here: a full disk, as a file size limit of 1 KiB with
       SIGXFSZ ignored, so that a write fails with EFBIG) leaves the earlier good file as it
       was (it was truncated in place before). */
    snprintf(out, sizeof out, "%s/kept", quantised_root);
    CHECK(tl_quantize_checkpoint(src, out, TL_Q8) == TL_OK, "%s", tl_last_error());
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    before = slurp(path, &before_len);
    struct rlimit saved, small = {1024, 1024};
    getrlimit(RLIMIT_FSIZE, &saved);
    small.rlim_max = saved.rlim_max;
    void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &small);
    CHECK_ERROR(tl_quantize_checkpoint(src, out, TL_Q4), TL_ERR_IO, "writing failed");
    setrlimit(RLIMIT_FSIZE, &saved);
    signal(SIGXFSZ, old_handler);
    after = slurp(path, &after_len);
    CHECK(before && after && before_len == after_len && !memcmp(before, after, (size_t)before_len),
          "a failed run kept the earlier file (%ld -> %ld bytes)", before_len, after_len);
    free(before), free(after);
    snprintf(cmd, sizeof cmd, "ls '%s' | grep -q tmp", out);
    CHECK(system(cmd) != 0, "the partial file is removed");

    /* An OUT_DIR whose files link to the input's: the copies replace the links (they wrote
       through them, emptying the input's config.json); a folder without config.json is
       refused before OUT_DIR is made; a Hugging Face folder's chat template, tokenizer and
       generation configs go along (a quantised chat model chatted with the built-in
       template). */
    snprintf(dir, sizeof dir, "%s/linked-src", quantised_root);
    snprintf(out, sizeof out, "%s/linked-out", quantised_root);
    snprintf(cmd, sizeof cmd,
             "cp -r '%s' '%s' && mkdir -p '%s' && ln -s '%s/config.json' '%s/config.json' && "
             "ln '%s/model.safetensors' '%s/model.safetensors' && "
             "printf '{{ messages }}' > '%s/chat_template.jinja' && printf '{}' > '%s/tokenizer_config.json'",
             src, dir, out, dir, out, dir, out, dir, dir);
    CHECK(system(cmd) == 0, "linked");
    snprintf(path, sizeof path, "%s/config.json", dir);
    before = slurp(path, &before_len);
    CHECK(tl_quantize_checkpoint(dir, out, TL_Q8) == TL_OK, "linked: %s", tl_last_error());
    after = slurp(path, &after_len);
    CHECK(before && after && before_len > 0 && before_len == after_len && !memcmp(before, after, (size_t)before_len),
          "the input's config.json is untouched (%ld -> %ld bytes)", before_len, after_len);
    free(before), free(after);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    tl_st_file kept_input;
    CHECK(tl_st_open(path, &kept_input) == TL_OK && kept_input.tensors[0].dtype != TL_ST_I8,
          "the input's weights are its own (a hard link at OUT_DIR was written through): %s", tl_last_error());
    tl_st_close(&kept_input);
    snprintf(cmd, sizeof cmd, "test ! -L '%s/config.json' && cmp -s '%s/chat_template.jinja' '%s/chat_template.jinja' && "
             "cmp -s '%s/tokenizer_config.json' '%s/tokenizer_config.json' && test ! -e '%s/generation_config.json'",
             out, dir, out, dir, out, out);
    CHECK(system(cmd) == 0, "OUT_DIR has its own config.json and the chat template and tokenizer config");
    snprintf(dir, sizeof dir, "%s/no-config", quantised_root);
    snprintf(out, sizeof out, "%s/no-config-q8", quantised_root);
    snprintf(cmd, sizeof cmd, "cp -r '%s' '%s' && rm '%s/config.json'", src, dir, dir);
    CHECK(system(cmd) == 0, "no config");
    CHECK_ERROR(tl_quantize_checkpoint(dir, out, TL_Q8), TL_ERR_INVALID_ARGUMENT, "IN_DIR must be a checkpoint folder");
    struct stat no_out;
    CHECK(stat(out, &no_out) != 0, "nothing written for a folder without config.json: %s exists", out);

    /* a quantised tensor of another shape than config.json's says what shape it has */
    snprintf(dir, sizeof dir, "%s/other-vocab", quantised_root);
    snprintf(cmd, sizeof cmd, "cp -r '%s/q4/gpt2_like' '%s' && sed -i 's/\"vocab_size\": 96/\"vocab_size\": 128/' '%s/config.json'",
             quantised_root, dir, dir);
    CHECK(system(cmd) == 0, "other vocab");
    tl_model *other = NULL;
    CHECK_ERROR(tl_model_load(dir, NULL, &other), TL_ERR_FORMAT, "tensor \"tok_embed.weight\" has shape [96, 32]; it must be [128, 32]");
    tl_model_free(other);

    snprintf(dir, sizeof dir, "%s/inf-scale", quantised_root);
    snprintf(cmd, sizeof cmd, "cp -r '%s/q4/gpt2_like' '%s'", quantised_root, dir);
    CHECK(system(cmd) == 0 && poke_first(dir, "block.0.attn.q.weight_scale", 0.0f, 0x7c00), "poke a scale");
    tl_model *m = NULL;
    CHECK_ERROR(tl_model_load(dir, NULL, &m), TL_ERR_FORMAT, "scale tensor \"block.0.attn.q.weight_scale\" has a non-finite value");
    tl_model_free(m);
}

/* The activations' quantiser: a group with a NaN (or an inf) gives d = NaN, so the product
   is NaN as with float weights (the NaN was quantised as -qmax: finite logits from a
   diverged state); a group too small for qmax / max|x| (an overflow to inf, then an
   undefined float-to-int conversion that flipped signs) is zero. */
static void activation_groups(void) {
    float x[3 * TL_QGROUP];
    for (int i = 0; i < 3 * TL_QGROUP; i++) x[i] = 0.25f;
    x[3] = NAN;
    for (int i = 0; i < TL_QGROUP; i++) x[TL_QGROUP + i] = (i % 3 - 1) * 5e-36f; /* -, 0, + */
    for (int bits = 8; bits <= 16; bits += 8) {
        int16_t q16[3 * TL_QGROUP];
        int8_t q8[3 * TL_QGROUP];
        float d[3];
        int32_t sum[3];
        tl_cpu_quantize_rows(x, 1, 3 * TL_QGROUP, bits, bits == 16 ? (void *)q16 : (void *)q8, d, sum);
        int nonzero = 0;
        for (int i = 0; i < 2 * TL_QGROUP; i++) nonzero += bits == 16 ? q16[i] != 0 : q8[i] != 0;
        CHECK(isnan(d[0]) && d[1] == 0.0f && sum[0] == 0 && sum[1] == 0 && nonzero == 0,
              "%d-bit rows: a NaN group's d %g, a tiny group's d %g, sums %d %d, %d nonzero", bits, (double)d[0],
              (double)d[1], sum[0], sum[1], nonzero);
        const int qmax = bits == 16 ? 32767 : 127, last = bits == 16 ? q16[2 * TL_QGROUP] : q8[2 * TL_QGROUP];
        CHECK(d[2] == 0.25f / (float)qmax && last == qmax, "%d-bit rows: an ordinary group", bits);
    }
}

/* A quantised copy has the parameters of its parent: two 4-bit weights a stored byte, and the
   scales no parameters of their own. */
static void same_params(const char *golden, const char *name) {
    char parent_dir[4096], dir[4096];
    snprintf(parent_dir, sizeof parent_dir, "%s/%s", golden, name);
    tl_model *parent = NULL;
    if (tl_model_load(parent_dir, NULL, &parent) != TL_OK) { CHECK(0, "%s: %s", parent_dir, tl_last_error()); return; }
    for (int q = 0; q < 2; q++) {
        const char *root = quantised_copy(golden, name, q ? TL_Q8 : TL_Q4);
        if (!root) { CHECK(0, "%s: quantise", name); continue; }
        snprintf(dir, sizeof dir, "%s/%s", root, name);
        tl_model *m = NULL;
        CHECK(tl_model_load(dir, NULL, &m) == TL_OK, "%s: %s", dir, tl_last_error());
        if (m)
            CHECK(tl_model_info(m)->n_params == tl_model_info(parent)->n_params, "%s (%s): %lld parameters, its parent %lld", dir,
                  q ? "q8" : "q4", (long long)tl_model_info(m)->n_params, (long long)tl_model_info(parent)->n_params);
        tl_model_free(m);
    }
    tl_model_free(parent);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: test_quant GOLDEN_DIR SHIPPED_MODEL_DIR\n");
        return 2;
    }
    random_groups();
    activation_groups();
    real_groups(argv[2]);
    weighted_groups(argv[2]);
    round_trip(argv[1], "gpt2_like");
    round_trip(argv[1], "llama_like");
    same_params(argv[1], "llama_like");
    threads_alike(argv[2]); /* after round_trip: quantised_root exists */
    refusals(argv[1]);      /* after round_trip: its q4 copy is an input already quantised */
    pure_q4(argv[1]);
    char hf[1024];
    snprintf(hf, sizeof hf, "%s/../hf/huginn_f32", argv[1]);
    fused_split(hf);
    snprintf(hf, sizeof hf, "%s/../hf/ouro_bf16_tied", argv[1]);
    tied_head_copy(hf);
    return check_summary();
}

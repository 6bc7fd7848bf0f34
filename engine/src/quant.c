/* quant.c: q8 / q4 weight quantisation and the checkpoint converter (see quant.h). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "calibrate.h"
#include "loader.h"
#include "pool.h"
#include "dtype.h"
#include "quant.h"
#include "safetensors.h"

static int clampi(long v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : (int)v; }

/* The scale is rounded to f16 first and the integers computed against the rounded scale,
   so that scale * q reproduces the weights as closely as the stored scale allows. */
void tl_quantize_row_q8(const float *x, int cols, int8_t *q, uint16_t *scales) {
    for (int g = 0; g < cols / TL_QGROUP; g++) {
        const float *xg = x + g * TL_QGROUP;
        float amax = 0.0f;
        for (int i = 0; i < TL_QGROUP; i++) amax = fmaxf(amax, fabsf(xg[i]));
        scales[g] = tl_f32_to_f16(amax / 127.0f);
        const float d = tl_f16_to_f32(scales[g]), id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < TL_QGROUP; i++) q[g * TL_QGROUP + i] = (int8_t)clampi(lrintf(xg[i] * id), -127, 127);
    }
}

/* q4: each group's scale is searched, not derived from max|x| alone. A 4-bit grid is so
   coarse that the scale that minimises the group's error is rarely max|x| / 8: shrinking it
   a little clips the largest element but represents the other 31 more finely, and mapping
   the largest element to +7 instead of -8 is sometimes better. The search, per group:
   - candidates d = m / t for t in [-10, -6] and [6, 9] in steps of 1/8, m the element of
     largest magnitude (t = -8 is llama.cpp's Q4_0 rule; the grid contains every candidate of
     the previous quantiser, so the result is never worse than it by the same measure);
   - each d is rounded to f16 first and the integers computed against the rounded value (the
     kernels only ever see the stored f16 scale);
   - then the best one is refitted: the least-squares scale for its integers,
     sum(x q) / sum(q q), is rounded to f16 and tried with the integers recomputed, as are
     its two f16 neighbours (the f16 rounding can move the optimum by up to half an ulp),
     repeated while the error falls. Refitting every grid candidate instead gave the same
     total error on the shipped model at 3x the time (76 s for GPT-2 small against 23 s).
   The error is the sum of squares sum_i c_i (x_i - d q_i)^2 with c_i = 1, or, given an
   importance vector (activation-aware quantisation: calibrate.c's mean of the input's x_i^2
   over real text), c_i = imp_i / max(imp over the group) (the division leaves the minimiser
   unchanged and keeps the sums in a fixed range); a group of equal importances keeps the
   unweighted result bit for bit.
   Weighting by a proxy of the importance instead (the preceding norm's gamma^2) changed the
   shipped model's top-1 agreement by at most +-0.1%, noise. Ties keep the earlier candidate:
   the result is a pure function of the group's values (and importances). */

/* The one rounding rule of q4: the nearest integer of x / d, clamped to [-8, 7], stored +8. */
static inline uint8_t q4_code(float x, float id) { return (uint8_t)clampi(lrintf(x * id) + 8, 0, 15); }

static double q4_try(const float *xg, const float *c, uint16_t h, uint8_t *u) {
    const float d = tl_f16_to_f32(h), id = d != 0.0f ? 1.0f / d : 0.0f;
    double err = 0.0;
    for (int i = 0; i < TL_QGROUP; i++) {
        u[i] = q4_code(xg[i], id);
        const double e = (double)xg[i] - (double)d * (u[i] - 8);
        err += c ? (double)c[i] * (e * e) : e * e;
    }
    return err;
}

typedef struct {
    double err;
    uint16_t scale;
    uint8_t u[TL_QGROUP];
} q4_best;

/* Tries scale h (its integers left in u) and keeps it in best if it beats it. */
static void q4_consider(const float *xg, const float *c, uint16_t h, q4_best *best, uint8_t *u) {
    if ((h & 0x7c00u) == 0x7c00u) { memset(u, 8, TL_QGROUP); return; } /* inf / NaN: never a scale */
    const double err = q4_try(xg, c, h, u);
    if (err < best->err) {
        best->err = err;
        best->scale = h;
        memcpy(best->u, u, TL_QGROUP);
    }
}

/* The f16 one ulp away from h in magnitude (dir +1 larger, -1 smaller); h itself at the ends. */
static uint16_t f16_step(uint16_t h, int dir) {
    const uint16_t mag = h & 0x7fffu, sign = h & 0x8000u;
    if (dir < 0) return mag == 0 ? h : (uint16_t)(sign | (mag - 1u));
    return mag >= 0x7bffu ? h : (uint16_t)(sign | (mag + 1u));
}

/* The search above with weights c (NULL: all 1). `first`, when not 0xffff, is tried before
   the grid (so it wins ties): the weighted search starts from the unweighted winner, which
   makes its weighted error never above that winner's. */
static q4_best q4_search(const float *xg, const float *c, uint16_t first) {
    float m = 0.0f;
    for (int i = 0; i < TL_QGROUP; i++)
        if (fabsf(xg[i]) > fabsf(m)) m = xg[i];
    q4_best best = {.err = INFINITY, .scale = 0};
    uint8_t u[TL_QGROUP];
    if (first != 0xffffu) q4_consider(xg, c, first, &best, u);
    q4_consider(xg, c, tl_f32_to_f16(m / -8.0f), &best, u); /* the Q4_0 rule first: it wins ties */
    for (int side = 0; side < 2; side++)
        for (int s = 0; s <= 32; s++) {
            const float t = side == 0 ? -10.0f + 0.125f * (float)s : 6.0f + 0.125f * (float)s;
            if (side == 1 && t > 9.0f) break;
            q4_consider(xg, c, tl_f32_to_f16(m / t), &best, u);
        }
    /* Refit the winner: least-squares scale for its integers, new integers, again, while the
       error falls (a few rounds at most; the bound only guards against cycling). */
    for (int round = 0; round < 8; round++) {
        double num = 0.0, den = 0.0;
        for (int i = 0; i < TL_QGROUP; i++) {
            const double qi = (double)best.u[i] - 8.0, ci = c ? (double)c[i] : 1.0;
            num += ci * (xg[i] * qi);
            den += ci * (qi * qi);
        }
        if (den == 0.0) break;
        const double before = best.err;
        const uint16_t ls = tl_f32_to_f16((float)(num / den));
        for (int k = -1; k <= 1; k++) q4_consider(xg, c, k ? f16_step(ls, k) : ls, &best, u);
        if (!(best.err < before)) break;
    }
    return best;
}

/* The group's weights c_i = imp_i / max(imp) into c; false (unweighted) when they are all
   equal or every importance is 0 (inputs calibration never saw active: nothing to weight
   by). Negative or non-finite importances count as 0 (calibrate.c never makes them: it
   fails on a non-finite mean x^2). */
static bool q4_weights(const float *imp, float *c) {
    float mx = 0.0f;
    bool uniform = true;
    for (int i = 0; i < TL_QGROUP; i++) {
        mx = imp[i] > mx && isfinite(imp[i]) ? imp[i] : mx;
        uniform &= imp[i] == imp[0];
    }
    /* Equal importances are the unweighted problem exactly: its answer stands (the weighted
       search from it could only differ where the refit stopped at its round limit). */
    if (!(mx > 0.0f) || uniform) return false;
    for (int i = 0; i < TL_QGROUP; i++) c[i] = imp[i] > 0.0f && isfinite(imp[i]) ? imp[i] / mx : 0.0f;
    return true;
}

/* One group: the unweighted search, then (with an importance) the weighted one from its winner. */
static uint16_t q4_group(const float *xg, const float *imp, uint8_t *packed) {
    q4_best best = q4_search(xg, NULL, 0xffffu);
    float c[TL_QGROUP];
    if (imp && q4_weights(imp, c)) best = q4_search(xg, c, best.scale);
    for (int i = 0; i < TL_QGROUP / 2; i++) packed[i] = (uint8_t)(best.u[2 * i] | best.u[2 * i + 1] << 4);
    return best.scale;
}

void tl_quantize_row_q4(const float *x, int cols, uint8_t *q, uint16_t *scales) {
    tl_quantize_row_q4_weighted(x, NULL, cols, q, scales);
}

void tl_quantize_row_q4_weighted(const float *x, const float *imp, int cols, uint8_t *q, uint16_t *scales) {
    for (int g = 0; g < cols / TL_QGROUP; g++)
        scales[g] = q4_group(x + g * TL_QGROUP, imp ? imp + g * TL_QGROUP : NULL, q + g * TL_QGROUP / 2);
}

/* ---------------------------------------------------------------- GPTQ error feedback */

/* GPTQ (Frantar et al. 2022) on the q4 format: the columns of a row are quantised in order,
   and each one's rounding error is spread over the columns not yet quantised so that the
   product with the calibration inputs moves least: with H = E[x x^T] (+ damping) and U the
   upper Cholesky factor of H^-1, quantising column i with error e_i = (w_i - d q_i) / U_ii
   updates w_k -= e_i U_ik for k > i. The group's scale is chosen, when its first column comes
   up, by the importance-weighted search above (q4_search) on the group's updated weights;
   the integers are then q4_code of each updated weight. The stored format is unchanged. */

/* In place: a [n][n] symmetric positive definite -> its lower Cholesky factor L (a = L L^T).
   False when a pivot is not positive. */
static bool cholesky(double *a, int n) {
    for (int j = 0; j < n; j++) {
        double *aj = a + (size_t)j * n;
        double d = aj[j];
        for (int k = 0; k < j; k++) d -= aj[k] * aj[k];
        if (!(d > 0.0)) return false;
        d = sqrt(d);
        aj[j] = d;
        for (int i = j + 1; i < n; i++) {
            double *ai = a + (size_t)i * n, v = ai[j];
            for (int k = 0; k < j; k++) v -= ai[k] * aj[k];
            ai[j] = v / d;
        }
    }
    return true;
}

/* U [n][n] upper with U^T U = H^-1, from the mean Gram matrix h (GPTQ's Hinv). Damping
   (1% of the mean diagonal, GPTQ's default) keeps H positive definite when inputs are
   correlated or a column is never active; a dead column (zero diagonal) gets 1. */
static tl_status gptq_factor(const double *gram, int n, double *u) {
    double *a = malloc((size_t)n * n * sizeof *a), mean = 0.0;
    if (!a) return tl_fail(TL_ERR_NO_MEMORY, "gptq: out of memory");
    for (int i = 0; i < n; i++) mean += gram[(size_t)i * n + i];
    mean /= n;
    memcpy(a, gram, (size_t)n * n * sizeof *a);
    for (int i = 0; i < n; i++) a[(size_t)i * n + i] += gram[(size_t)i * n + i] > 0.0 ? 0.01 * mean : 1.0;
    bool ok = mean > 0.0 && cholesky(a, n); /* a = L, H = L L^T */
    /* H^-1 = L^-T L^-1. Row by row, so every inner loop runs along contiguous memory (a
       column-wise substitution strides by n and was minutes for n = 3072): row i of
       Linv = (e_i - sum_{k<i} L_ik Linv_k) / L_ii into u, then a = sum_k Linv_k^T Linv_k
       (upper triangle: only columns >= row count, Linv_k being zero past k). */
    for (int i = 0; ok && i < n; i++) {
        double *ui = u + (size_t)i * n;
        memset(ui, 0, (size_t)n * sizeof *ui);
        ui[i] = 1.0;
        for (int k = 0; k < i; k++) {
            const double l = a[(size_t)i * n + k], *uk = u + (size_t)k * n;
            if (l != 0.0)
                for (int j = 0; j <= k; j++) ui[j] -= l * uk[j];
        }
        const double inv = 1.0 / a[(size_t)i * n + i];
        for (int j = 0; j <= i; j++) ui[j] *= inv;
    }
    if (ok) memset(a, 0, (size_t)n * n * sizeof *a);
    for (int k = 0; ok && k < n; k++) { /* a[i][j] (j >= i) += Linv[k][i] Linv[k][j], i, j <= k */
        const double *uk = u + (size_t)k * n;
        for (int i = 0; i <= k; i++) {
            const double v = uk[i];
            double *ai = a + (size_t)i * n;
            if (v != 0.0)
                for (int j = i; j <= k; j++) ai[j] += v * uk[j];
        }
    }
    for (int i = 0; ok && i < n; i++) /* mirror: a = H^-1, full */
        for (int j = 0; j < i; j++) a[(size_t)i * n + j] = a[(size_t)j * n + i];
    ok = ok && cholesky(a, n); /* H^-1 = L2 L2^T; U = L2^T */
    for (int i = 0; ok && i < n; i++)
        for (int j = 0; j < n; j++) u[(size_t)i * n + j] = j >= i ? a[(size_t)j * n + i] : 0.0;
    free(a);
    return ok ? TL_OK : tl_fail(TL_ERR_INVALID_ARGUMENT, "gptq: the calibration's Gram matrix is not positive definite");
}

/* One row, w [cols] (overwritten: the updated weights), against U. */
static void gptq_row_q4(float *w, const double *u, const float *imp, int cols, uint8_t *q, uint16_t *scales) {
    for (int g = 0; g < cols / TL_QGROUP; g++) {
        uint8_t packed[TL_QGROUP / 2];
        const uint16_t h = q4_group(w + g * TL_QGROUP, imp ? imp + g * TL_QGROUP : NULL, packed);
        scales[g] = h;
        const float d = tl_f16_to_f32(h), id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < TL_QGROUP; j++) {
            const int i = g * TL_QGROUP + j;
            const uint8_t c = q4_code(w[i], id);
            if (j % 2 == 0) q[i / 2] = c;
            else q[i / 2] |= (uint8_t)(c << 4);
            const double *ui = u + (size_t)i * cols;
            const double e = ((double)w[i] - (double)d * (c - 8)) / ui[i];
            for (int k = i + 1; k < cols; k++) w[k] -= (float)(e * ui[k]);
        }
    }
}

/* ---------------------------------------------------------------- checkpoint conversion */

/* A file to write whole over `to` (tl_create_beside), opened beside it into *out; its name in
   *partial, for the caller to rename over `to` (or unlink) and free. On failure nothing is
   left (*out and *partial NULL). */
static tl_status open_beside(const char *to, FILE **out, char **partial) {
    *out = NULL;
    int fd;
    const tl_status st = tl_create_beside(to, &fd, partial);
    if (st != TL_OK) return st;
    if ((*out = fdopen(fd, "wb"))) return TL_OK;
    close(fd);
    unlink(*partial);
    free(*partial);
    *partial = NULL;
    return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
}

/* Copies `from` to `to`, written beside it and renamed over it (as the weights): a link at
   `to` is replaced, never written through (one to the input's own file emptied it), and a
   failed copy leaves no half file. */
static tl_status copy_file(const char *from, const char *to, bool optional) {
    FILE *in = fopen(from, "rb");
    if (!in && optional && errno == ENOENT) { /* none to copy: nor may an older one stay */
        if (unlink(to) != 0 && errno != ENOENT) return tl_fail(TL_ERR_IO, "%s: %s", to, strerror(errno));
        return TL_OK;
    }
    if (!in) return tl_fail(TL_ERR_IO, "%s: %s", from, strerror(errno));
    char *partial;
    FILE *out;
    const tl_status opened = open_beside(to, &out, &partial);
    if (opened != TL_OK) {
        fclose(in);
        return opened;
    }
    char buf[1 << 16];
    size_t got;
    int failure = 0; /* the first failure's errno (later calls would change it) */
    while ((got = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, got, out) != got && !failure) failure = errno ? errno : EIO;
    if (ferror(in) && !failure) failure = errno ? errno : EIO;
    fclose(in);
    if ((fflush(out) != 0 || fsync(fileno(out)) != 0) && !failure) failure = errno; /* (synced: the weights' way) */
    if (fclose(out) != 0 && !failure) failure = errno;
    if (!failure && rename(partial, to) != 0) failure = errno;
    if (failure) unlink(partial);
    free(partial);
    return failure ? tl_fail(TL_ERR_IO, "copying %s to %s failed: %s", from, to, strerror(failure)) : TL_OK;
}

/* The files a checkpoint folder carries beside its weights, copied as they are: config.json
   (required), the tokenizer, and a Hugging Face folder's chat template, tokenizer config
   and generation config (a quantised Ouro or Huginn chats as the original). */
static const char *const SIDE_FILES[] = {"config.json", "tokenizer.json", "chat_template.jinja", "tokenizer_config.json",
                                         "generation_config.json"};

static tl_status copy_side_files(const char *in_dir, const char *out_dir) {
    char from[4096], to[4096];
    for (size_t i = 0; i < sizeof SIDE_FILES / sizeof *SIDE_FILES; i++) {
        snprintf(from, sizeof from, "%s/%s", in_dir, SIDE_FILES[i]);
        snprintf(to, sizeof to, "%s/%s", out_dir, SIDE_FILES[i]);
        const tl_status st = copy_file(from, to, i > 0);
        if (st != TL_OK) return st;
    }
    return TL_OK;
}

static bool is_float(const tl_st_tensor *t) {
    return t->dtype == TL_ST_F32 || t->dtype == TL_ST_F16 || t->dtype == TL_ST_BF16;
}

/* A matrix the forward pass multiplies by (a 2-D "*.weight"; pos_embed is added, not
   multiplied). */
static bool is_matrix(const tl_st_tensor *t) {
    const size_t len = strlen(t->name);
    return t->ndim == 2 && len > 7 && strcmp(t->name + len - 7, ".weight") == 0 &&
           strcmp(t->name, "pos_embed.weight") != 0 && is_float(t);
}

/* A matrix whose rows split into whole groups (the others are kept as they are). */
static bool quantisable(const tl_st_tensor *t) { return is_matrix(t) && t->shape[1] % TL_QGROUP == 0 && t->shape[1] > 0; }

int tl_quantize_kept(const char *in_dir, char *first, size_t len, int64_t *width) {
    char from[4096];
    snprintf(from, sizeof from, "%s/model.safetensors", in_dir);
    tl_st_file file;
    if (tl_st_open(from, &file) != TL_OK) return -1;
    int kept = 0;
    for (int i = 0; i < file.n_tensors; i++) {
        const tl_st_tensor *t = &file.tensors[i];
        if (!is_matrix(t) || quantisable(t)) continue;
        if (kept++ == 0) {
            snprintf(first, len, "%s", t->name);
            *width = t->shape[1];
        }
    }
    tl_st_close(&file);
    return kept;
}

/* q4 keeps the embedding and the head at q8: they are a small share of the bytes a token
   reads at depth (the head is read once, the block loops times), and the head's error goes
   straight into the logits (as llama.cpp keeps its output matrix above 4 bits). `pure`
   (llama.cpp's --pure) quantises them to `type` too: on a shallow model the head is a large
   share (GPT-2-small: 39 M of its 124 M weights), which a user trading accuracy for speed
   wants at 4 bits as well. */
static tl_dtype type_for(const tl_st_tensor *t, tl_dtype type, bool pure) {
    if (pure) return type;
    /* ours, then Hugging Face's: Ouro's (Llama's) and Huginn's embeddings */
    static const char *const kept[] = {"tok_embed.weight", "lm_head.weight", "model.embed_tokens.weight",
                                       "transformer.wte.weight"};
    for (size_t i = 0; type == TL_Q4 && i < sizeof kept / sizeof kept[0]; i++)
        if (!strcmp(t->name, kept[i])) return TL_Q8;
    return type;
}

/* A tied checkpoint's stored copy of its head (some Hugging Face exports keep one), which no
   load reads: left out of the output (it was quantised, and its scales then failed the load
   as an unexpected tensor). */
static bool unread_head(const tl_st_tensor *t, bool tied) { return tied && strcmp(t->name, "lm_head.weight") == 0; }

static tl_dtype float_dtype(tl_st_dtype d) { return d == TL_ST_F32 ? TL_F32 : d == TL_ST_F16 ? TL_F16 : TL_BF16; }

/* What would make the output wrong or destroy the input, refused before anything is
   written: IN_DIR without a config.json, OUT_DIR being IN_DIR (the copies truncated the sources, and the new weights
   the mapped file being read: a SIGBUS and an emptied checkpoint), a sharded checkpoint
   left in OUT_DIR (its index, which the loader reads first, would name the old shards), an
   input already quantised (its integer tensors were passed through as they were, under
   the other type's name), weights a group scale cannot represent (a NaN or an infinity,
   in any tensor, or max|x| / 127 beyond f16's 65504: the scale would be infinite and the
   group NaN), and a checkpoint without a matrix to quantise. */
static tl_status check_quantisable(const char *in_dir, const char *out_dir, const tl_st_file *file, tl_dtype want,
                                   bool pure) {
    struct stat in_st, out_st;
    if (stat(in_dir, &in_st) == 0 && stat(out_dir, &out_st) == 0 && in_st.st_dev == out_st.st_dev &&
        in_st.st_ino == out_st.st_ino)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: OUT_DIR %s is IN_DIR: write the quantised checkpoint to another directory",
                       out_dir);
    char index[4096];
    snprintf(index, sizeof index, "%s/config.json", in_dir); /* (copied last: its absence found first) */
    if (access(index, R_OK) != 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: %s/config.json: %s (IN_DIR must be a checkpoint folder)", in_dir,
                       strerror(errno));
    if (tl_st_is_sharded(out_dir))
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "quantize: %s holds a sharded checkpoint (model.safetensors.index.json), which the loader "
                       "would read instead of the quantised file: use another directory", out_dir);
    int n_quantisable = 0;
    for (int i = 0; i < file->n_tensors; i++) {
        const tl_st_tensor *t = &file->tensors[i];
        if (t->dtype == TL_ST_I8 || t->dtype == TL_ST_U8)
            return tl_fail(TL_ERR_INVALID_ARGUMENT,
                           "quantize: %s is already quantised (tensor %s is %s): quantise its f32/f16/bf16 original",
                           in_dir, t->name, tl_st_dtype_name(t->dtype));
        /* every float tensor, those copied as they are too (the written checkpoint would not
           load: an earlier good one was replaced by then) */
        if (!is_float(t)) continue;
        const tl_dtype dt = float_dtype(t->dtype);
        const size_t count = t->nbytes / tl_st_dtype_size(t->dtype);
        const size_t bad = tl_first_nonfinite(t->data, dt, count);
        if (bad < count && t->ndim == 2)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: tensor %s has a non-finite value at [%lld, %lld]", t->name,
                           (long long)(bad / (size_t)t->shape[1]), (long long)(bad % (size_t)t->shape[1]));
        if (bad < count)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: tensor %s has a non-finite value at [%zu]", t->name, bad);
        if (!quantisable(t)) continue;
        n_quantisable++;
        /* the largest a group's f16 scale times its largest integer holds: 127 for q8, 8 for
           q4 (past it a q4 group was written clipped) */
        const int top = type_for(t, want, pure) == TL_Q4 ? 8 : 127;
        for (size_t e = 0; e < count; e++)
            if (fabsf(tl_weight_at_unaligned(t->data, dt, e)) > 65504.0f * (float)top)
                return tl_fail(TL_ERR_INVALID_ARGUMENT,
                               "quantize: tensor %s has %g at [%lld, %lld], too large for a group's f16 scale "
                               "(|x| <= 65504 x %d for %s)", t->name, (double)tl_weight_at_unaligned(t->data, dt, e),
                               (long long)(e / (size_t)t->shape[1]), (long long)(e % (size_t)t->shape[1]), top,
                               top == 8 ? "q4" : "q8");
    }
    /* (a file labelled q8 or q4 without a quantised matrix in it was written) */
    if (n_quantisable == 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "quantize: no matrix of %s has an input width that is a multiple of %d (the quantisation's group): "
                       "nothing to quantise", in_dir, TL_QGROUP);
    return TL_OK;
}

static bool add_number(cJSON *array, double value) {
    cJSON *number = cJSON_CreateNumber(value);
    return number && cJSON_AddItemToArray(array, number);
}

/* false: out of memory (cJSON's Add and Create functions return NULL or false then, and a
   header that lost an entry, a shape's dimension or an offset was written as if whole) */
static bool add_entry(cJSON *header, const char *name, const char *dtype, int64_t rows, int64_t cols,
                      int ndim, const int64_t *shape, uint64_t *offset, uint64_t bytes) {
    cJSON *e = cJSON_AddObjectToObject(header, name);
    cJSON *sh = e && cJSON_AddStringToObject(e, "dtype", dtype) ? cJSON_AddArrayToObject(e, "shape") : NULL;
    bool ok = sh != NULL;
    if (shape)
        for (int i = 0; ok && i < ndim; i++) ok = add_number(sh, (double)shape[i]);
    else
        ok = ok && add_number(sh, (double)rows) && add_number(sh, (double)cols);
    cJSON *off = ok ? cJSON_AddArrayToObject(e, "data_offsets") : NULL;
    ok = off && add_number(off, (double)*offset) && add_number(off, (double)(*offset + bytes));
    *offset += bytes;
    return ok;
}

/* The calibration must be of this checkpoint: each of its tensors exists here with its
   input width, and each matrix that becomes q4 has statistics (a calibration of another
   model fails one or the other, by name or by shape). The embedding and head, q4 only when
   `pure`, need none: without statistics they are quantised unweighted. */
static tl_status check_calibration(tl_st_file *file, const char *path, tl_dtype want, const tl_calibration *cal) {
    if (want != TL_Q4)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: calibration applies to q4 only (q8 keeps max|x| / 127)");
    for (int i = 0; i < tl_calibration_count(cal); i++) {
        const char *name = tl_calibration_name(cal, i);
        int cols = 0;
        tl_calibration_importance(cal, name, &cols);
        const tl_st_tensor *t = tl_st_find(file, name);
        if (!t)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: the calibration (of %s) is not for %s: it has no tensor \"%s\"",
                           tl_calibration_source(cal), path, name);
        if (t->ndim != 2 || t->shape[1] != cols)
            return tl_fail(TL_ERR_INVALID_ARGUMENT,
                           "quantize: the calibration (of %s) is not for %s: \"%s\" has %lld inputs there, %d in the calibration",
                           tl_calibration_source(cal), path, name, (long long)(t->ndim == 2 ? t->shape[1] : -1), cols);
    }
    for (int i = 0; i < file->n_tensors; i++) {
        const tl_st_tensor *t = &file->tensors[i];
        if (quantisable(t) && type_for(t, want, false) == TL_Q4 && !tl_calibration_importance(cal, t->name, NULL))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: the calibration (of %s) has no statistics for %s's \"%s\"",
                           tl_calibration_source(cal), path, t->name);
    }
    return TL_OK;
}

tl_status tl_quantize_checkpoint(const char *in_dir, const char *out_dir, tl_dtype want) {
    return tl_quantize_checkpoint_calibrated(in_dir, out_dir, want, NULL, 0, false);
}

/* One matrix's rows, quantised in tasks of QUANT_TASK_ROWS rows on the pool's threads: every
   row on its own (a row's bytes depend on nothing else), so the file is the same at any
   thread count. The q4 scale search takes about 7 us a group (5.6 minutes for a 1.4 B
   checkpoint on one thread). */
#define QUANT_TASK_ROWS 32
#define QUANT_MAX_THREADS 256

typedef struct {
    const tl_st_tensor *t;
    tl_dtype type;             /* TL_Q8 or TL_Q4 */
    int cols;
    size_t qbytes, groups;     /* per row */
    const float *imp;          /* [cols] or NULL */
    const double *u;           /* GPTQ's factor [cols][cols] or NULL */
    float *rows;               /* [threads][cols]: each thread's row in f32 */
    uint8_t *q;                /* [rows][qbytes] */
    uint16_t *scales;          /* [rows][groups] */
} quantise_job;

static void quantise_rows_task(void *ctx, int task, int thread) {
    const quantise_job *j = ctx;
    const size_t elem = tl_st_dtype_size(j->t->dtype);
    const int64_t rows = j->t->shape[0], r0 = (int64_t)task * QUANT_TASK_ROWS;
    const int64_t r1 = r0 + QUANT_TASK_ROWS < rows ? r0 + QUANT_TASK_ROWS : rows;
    float *row = j->rows + (size_t)thread * (size_t)j->cols;
    for (int64_t r = r0; r < r1; r++) {
        uint8_t *q = j->q + (size_t)r * j->qbytes;
        uint16_t *scales = j->scales + (size_t)r * j->groups;
        tl_convert_to_f32(j->t->data + (size_t)r * (size_t)j->cols * elem, float_dtype(j->t->dtype), (size_t)j->cols, row);
        if (j->type == TL_Q8) tl_quantize_row_q8(row, j->cols, (int8_t *)q, scales);
        else if (j->u) gptq_row_q4(row, j->u, j->imp, j->cols, q, scales);
        else tl_quantize_row_q4_weighted(row, j->imp, j->cols, q, scales);
    }
}

tl_status tl_quantize_checkpoint_calibrated(const char *in_dir, const char *out_dir, tl_dtype want,
                                            const tl_calibration *cal, int threads, bool pure) {
    if (want != TL_Q8 && want != TL_Q4) return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: type must be q8 or q4");
    if (threads < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: threads must be >= 0 (0: every core), got %d", threads);
    if (threads == 0) threads = tl_pool_cores();
    if (threads > QUANT_MAX_THREADS) threads = QUANT_MAX_THREADS;
    if (cal && want != TL_Q4)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: calibration applies to q4 only (q8 keeps max|x| / 127)");
    char from[4096], to[4096];
    tl_status st;
    /* The weights are opened (and a calibration checked against them) before anything is
       written, so that a mismatch leaves no half-made directory. */
    if (tl_st_is_sharded(in_dir)) /* (it said "model.safetensors: cannot open") */
        return tl_fail(TL_ERR_UNSUPPORTED, "quantize: %s holds a sharded checkpoint (model.safetensors.index.json): a sharded "
                                           "input is not supported yet (join its shards into one model.safetensors first)",
                       in_dir);
    snprintf(from, sizeof from, "%s/model.safetensors", in_dir);
    snprintf(to, sizeof to, "%s/model.safetensors", out_dir);
    tl_st_file file;
    if ((st = tl_st_open(from, &file)) != TL_OK) return st;
    if ((st = check_quantisable(in_dir, out_dir, &file, want, pure)) != TL_OK) {
        tl_st_close(&file);
        return st;
    }
    if (cal && (st = check_calibration(&file, from, want, cal)) != TL_OK) {
        tl_st_close(&file);
        return st;
    }
    /* The input as the loader reads it (config.json against every tensor, tokenizer.json):
       one that does not load made a checkpoint that does not load, found only by the
       tool's load after it had replaced OUT_DIR's. */
    bool tied;
    if ((st = tl_checkpoint_check(in_dir, &tied)) != TL_OK) {
        char why[TL_ERROR_MAX];
        snprintf(why, sizeof why, "%s", tl_last_error());
        st = tl_fail(st, "quantize: %s does not load, so nothing was written: %s", in_dir, why);
        tl_st_close(&file);
        return st;
    }
    if (mkdir(out_dir, 0777) != 0 && errno != EEXIST) {
        st = tl_fail(TL_ERR_IO, "quantize: cannot make OUT_DIR %s: %s", out_dir, strerror(errno));
        tl_st_close(&file);
        return st;
    }

    /* The header first (offsets follow from the shapes), then the data in the same order. */
    cJSON *header = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(header, "__metadata__");
    bool whole = meta && cJSON_AddStringToObject(meta, "format", "pt") &&
                 cJSON_AddStringToObject(meta, "tinyloop_quantization", want == TL_Q8 ? "q8" : "q4");
    if (cal) { /* how the file was made, for whoever reads it later */
        char how[1024];
        snprintf(how, sizeof how, "%s, %ld calibration tokens%s%s",
                 tl_calibration_gram(cal, tl_calibration_name(cal, 0)) ? "gptq" : "importance-weighted",
                 tl_calibration_tokens(cal), tl_calibration_text(cal)[0] ? " of " : "", tl_calibration_text(cal));
        whole = whole && cJSON_AddStringToObject(meta, "tinyloop_calibration", how);
    }
    uint64_t offset = 0;
    for (int i = 0; i < file.n_tensors; i++) {
        const tl_st_tensor *t = &file.tensors[i];
        if (unread_head(t, tied)) continue;
        if (!quantisable(t)) {
            whole = whole && add_entry(header, t->name, tl_st_dtype_name(t->dtype), 0, 0, t->ndim, t->shape, &offset, t->nbytes);
            continue;
        }
        const int64_t rows = t->shape[0], cols = t->shape[1];
        const tl_dtype type = type_for(t, want, pure);
        char scale_name[512];
        snprintf(scale_name, sizeof scale_name, "%s" TL_ST_SCALE_SUFFIX, t->name);
        whole = whole && add_entry(header, t->name, type == TL_Q8 ? "I8" : "U8", rows, type == TL_Q8 ? cols : cols / 2, 0,
                                   NULL, &offset, (uint64_t)(rows * (type == TL_Q8 ? cols : cols / 2)));
        whole = whole && add_entry(header, scale_name, "F16", rows, cols / TL_QGROUP, 0, NULL, &offset,
                                   (uint64_t)(rows * (cols / TL_QGROUP) * 2));
    }
    char *text = whole ? cJSON_PrintUnformatted(header) : NULL;
    cJSON_Delete(header);
    /* Written beside, synced, then renamed over `to` (the state file's way): a run that
       fails (gptq_factor, a full disk) or is interrupted leaves an earlier good file as it
       was, not a truncated one. */
    char *partial = NULL;
    FILE *out = NULL;
    st = text ? open_beside(to, &out, &partial) : tl_fail(TL_ERR_NO_MEMORY, "quantize: out of memory");
    if (st != TL_OK) {
        free(text);
        tl_st_close(&file);
        return st;
    }
    size_t hlen = strlen(text), padded = (hlen + 7) / 8 * 8;
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    errno = 0;
    bool ok = fwrite(len_le, 1, 8, out) == 8 && fwrite(text, 1, hlen, out) == hlen;
    for (size_t i = hlen; i < padded; i++) ok &= fputc(' ', out) != EOF;
    free(text);
    bool no_memory = false;
    int failure = ok ? 0 : errno ? errno : EIO; /* the failed write's errno (taken at once: later calls change it) */

    float *rows_f32 = NULL;
    uint8_t *q = NULL;
    uint16_t *scales = NULL;
    double *u = NULL;
    tl_pool *pool = threads > 1 ? tl_pool_new(threads) : NULL;
    threads = pool ? tl_pool_threads(pool) : 1; /* the threads it could start; none: the caller's alone */
    for (int i = 0; ok && i < file.n_tensors; i++) {
        const tl_st_tensor *t = &file.tensors[i];
        if (unread_head(t, tied)) continue;
        if (!quantisable(t)) {
            ok = fwrite(t->data, 1, t->nbytes, out) == t->nbytes;
            if (!ok) failure = errno ? errno : EIO;
            continue;
        }
        const int64_t rows = t->shape[0], cols = t->shape[1];
        const tl_dtype type = type_for(t, want, pure);
        const size_t qbytes = (size_t)(type == TL_Q8 ? cols : cols / 2);
        const size_t groups = (size_t)cols / TL_QGROUP;
        free(rows_f32); free(q); free(scales); free(u);
        rows_f32 = malloc((size_t)threads * (size_t)cols * sizeof *rows_f32);
        q = malloc((size_t)rows * qbytes);
        scales = malloc((size_t)rows * groups * sizeof *scales);
        u = NULL;
        if (!rows_f32 || !q || !scales) { ok = false, no_memory = true; break; }
        /* Calibrated q4: the importance weights each group's scale search; with a Gram
           matrix, GPTQ's error feedback runs over the row too. */
        const float *imp = cal && type == TL_Q4 ? tl_calibration_importance(cal, t->name, NULL) : NULL;
        const double *gram = cal && type == TL_Q4 ? tl_calibration_gram(cal, t->name) : NULL;
        if (gram) {
            u = malloc((size_t)cols * (size_t)cols * sizeof *u);
            if (!u) { ok = false, no_memory = true; break; }
            if ((st = gptq_factor(gram, (int)cols, u)) != TL_OK) break;
        }
        quantise_job job = {t, type, (int)cols, qbytes, groups, imp, u, rows_f32, q, scales};
        const int tasks = (int)((rows + QUANT_TASK_ROWS - 1) / QUANT_TASK_ROWS);
        if (pool) tl_pool_run(pool, tasks, quantise_rows_task, &job);
        else
            for (int task = 0; task < tasks; task++) quantise_rows_task(&job, task, 0);
        ok = fwrite(q, 1, (size_t)rows * qbytes, out) == (size_t)rows * qbytes &&
             fwrite(scales, sizeof *scales, (size_t)rows * groups, out) == (size_t)rows * groups; /* little-endian host */
        if (!ok) failure = errno ? errno : EIO;
    }
    tl_pool_free(pool);
    free(rows_f32); free(q); free(scales); free(u);
    if (ok && (fflush(out) != 0 || fsync(fileno(out)) != 0)) ok = false, failure = errno;
    if (fclose(out) != 0 && ok) ok = false, failure = errno;
    tl_st_close(&file);
    if (st == TL_OK && no_memory) st = tl_fail(TL_ERR_NO_MEMORY, "quantize: out of memory");
    else if (st == TL_OK && !ok) st = tl_fail(TL_ERR_IO, "%s: writing failed: %s", to, strerror(failure));
    if (st == TL_OK && rename(partial, to) != 0) st = tl_fail(TL_ERR_IO, "%s: %s", to, strerror(errno));
    if (st != TL_OK) unlink(partial); /* gptq_factor's message, or the write's */
    free(partial);
    /* The side files once the weights are in place: nothing is written before the weights
       are whole, so a run that fails while quantising (or is stopped then) changes nothing;
       one stopped between the renames leaves new weights beside the earlier config, which the
       load's shape checks refuse rather than misread, and a run again mends. */
    if (st == TL_OK) {
        st = copy_side_files(in_dir, out_dir);
        tl_sync_directory_of(to);
    }
    return st;
}

/* quant.c: q8 / q4 weight quantisation and the checkpoint converter (see quant.h). */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "dtype.h"
#include "quant.h"
#include "safetensors.h"

uint16_t tl_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (a >= 0x38800000u) { /* normal in f16 range (or overflowing to inf) */
        uint32_t h = (a - 0x38000000u) >> 13, rem = a & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
        if (h >= 0x7c00u) h = 0x7c00u;
        return (uint16_t)(sign | h);
    }
    if (a < 0x33000000u) return (uint16_t)sign; /* below half the smallest subnormal */
    uint32_t e = a >> 23, mant = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - (int)e; /* value = mant * 2^(e-150); unit 2^-24 */
    uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

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

/* q4: the element of largest magnitude maps exactly to -8 (its sign picks the scale's), so
   the range [-8, 7] is used in full on the side that needs it (as llama.cpp's Q4_0). Then
   a few nearby scales are tried and the one with the least squared error kept: cheap at
   conversion time, and it lowers the error of the other 31 elements of the group. */
static double q4_error(const float *xg, float d, uint8_t *u) {
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    double err = 0.0;
    for (int i = 0; i < TL_QGROUP; i++) {
        u[i] = (uint8_t)clampi(lrintf(xg[i] * id) + 8, 0, 15);
        const double e = (double)xg[i] - (double)d * (u[i] - 8);
        err += e * e;
    }
    return err;
}

void tl_quantize_row_q4(const float *x, int cols, uint8_t *q, uint16_t *scales) {
    for (int g = 0; g < cols / TL_QGROUP; g++) {
        const float *xg = x + g * TL_QGROUP;
        float m = 0.0f;
        for (int i = 0; i < TL_QGROUP; i++)
            if (fabsf(xg[i]) > fabsf(m)) m = xg[i];
        uint8_t u[TL_QGROUP], best_u[TL_QGROUP];
        uint16_t best = tl_f32_to_f16(m / -8.0f);
        double best_err = q4_error(xg, tl_f16_to_f32(best), best_u);
        for (int step = -6; step <= 6; step++) {
            const uint16_t cand = tl_f32_to_f16(m / (-8.0f + 0.25f * (float)step));
            const double err = q4_error(xg, tl_f16_to_f32(cand), u);
            if (err < best_err) {
                best_err = err;
                best = cand;
                memcpy(best_u, u, sizeof u);
            }
        }
        scales[g] = best;
        for (int i = 0; i < TL_QGROUP / 2; i++)
            q[g * TL_QGROUP / 2 + i] = (uint8_t)(best_u[2 * i] | best_u[2 * i + 1] << 4);
    }
}

/* ---------------------------------------------------------------- checkpoint conversion */

static tl_status copy_file(const char *from, const char *to, bool optional) {
    FILE *in = fopen(from, "rb");
    if (!in) return optional && errno == ENOENT ? TL_OK : tl_fail(TL_ERR_IO, "%s: %s", from, strerror(errno));
    FILE *out = fopen(to, "wb");
    if (!out) { fclose(in); return tl_fail(TL_ERR_IO, "%s: %s", to, strerror(errno)); }
    char buf[1 << 16];
    size_t got;
    bool ok = true;
    while ((got = fread(buf, 1, sizeof buf, in)) > 0) ok &= fwrite(buf, 1, got, out) == got;
    ok &= !ferror(in);
    fclose(in);
    ok &= fclose(out) == 0;
    return ok ? TL_OK : tl_fail(TL_ERR_IO, "copying %s to %s failed", from, to);
}

static bool quantisable(const tl_st_tensor *t) {
    const size_t len = strlen(t->name);
    return t->ndim == 2 && len > 7 && strcmp(t->name + len - 7, ".weight") == 0 &&
           strcmp(t->name, "pos_embed.weight") != 0 && t->shape[1] % TL_QGROUP == 0 && t->shape[1] > 0 &&
           (t->dtype == TL_ST_F32 || t->dtype == TL_ST_F16 || t->dtype == TL_ST_BF16);
}

/* q4 keeps the embedding and the head at q8: they are a small share of the bytes a token
   reads at depth (the head is read once, the block loops times), and the head's error goes
   straight into the logits (as llama.cpp keeps its output matrix above 4 bits). */
static tl_dtype type_for(const tl_st_tensor *t, tl_dtype type) {
    if (type == TL_Q4 && (!strcmp(t->name, "tok_embed.weight") || !strcmp(t->name, "lm_head.weight"))) return TL_Q8;
    return type;
}

static tl_dtype float_dtype(tl_st_dtype d) { return d == TL_ST_F32 ? TL_F32 : d == TL_ST_F16 ? TL_F16 : TL_BF16; }

static void add_entry(cJSON *header, const char *name, const char *dtype, int64_t rows, int64_t cols,
                      int ndim, const int64_t *shape, uint64_t *offset, uint64_t bytes) {
    cJSON *e = cJSON_AddObjectToObject(header, name);
    cJSON_AddStringToObject(e, "dtype", dtype);
    cJSON *sh = cJSON_AddArrayToObject(e, "shape");
    if (shape)
        for (int i = 0; i < ndim; i++) cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)shape[i]));
    else {
        cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)rows));
        cJSON_AddItemToArray(sh, cJSON_CreateNumber((double)cols));
    }
    cJSON *off = cJSON_AddArrayToObject(e, "data_offsets");
    cJSON_AddItemToArray(off, cJSON_CreateNumber((double)*offset));
    cJSON_AddItemToArray(off, cJSON_CreateNumber((double)(*offset + bytes)));
    *offset += bytes;
}

tl_status tl_quantize_checkpoint(const char *in_dir, const char *out_dir, tl_dtype want) {
    if (want != TL_Q8 && want != TL_Q4) return tl_fail(TL_ERR_INVALID_ARGUMENT, "quantize: type must be q8 or q4");
    char from[4096], to[4096];
    if (mkdir(out_dir, 0777) != 0 && errno != EEXIST) return tl_fail(TL_ERR_IO, "%s: %s", out_dir, strerror(errno));
    tl_status st;
    static const char *const copied[] = {"config.json", "tokenizer.json"};
    for (int i = 0; i < 2; i++) {
        snprintf(from, sizeof from, "%s/%s", in_dir, copied[i]);
        snprintf(to, sizeof to, "%s/%s", out_dir, copied[i]);
        if ((st = copy_file(from, to, i > 0)) != TL_OK) return st;
    }
    snprintf(from, sizeof from, "%s/model.safetensors", in_dir);
    snprintf(to, sizeof to, "%s/model.safetensors", out_dir);
    tl_st_file file;
    if ((st = tl_st_open(from, &file)) != TL_OK) return st;

    /* The header first (offsets follow from the shapes), then the data in the same order. */
    cJSON *header = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(header, "__metadata__");
    cJSON_AddStringToObject(meta, "format", "pt");
    cJSON_AddStringToObject(meta, "tinyloop_quantization", want == TL_Q8 ? "q8" : "q4");
    uint64_t offset = 0;
    for (int i = 0; i < file.n_tensors; i++) {
        const tl_st_tensor *t = &file.tensors[i];
        if (!quantisable(t)) {
            add_entry(header, t->name, tl_st_dtype_name(t->dtype), 0, 0, t->ndim, t->shape, &offset, t->nbytes);
            continue;
        }
        const int64_t rows = t->shape[0], cols = t->shape[1];
        const tl_dtype type = type_for(t, want);
        char scale_name[512];
        snprintf(scale_name, sizeof scale_name, "%s_scale", t->name);
        add_entry(header, t->name, type == TL_Q8 ? "I8" : "U8", rows, type == TL_Q8 ? cols : cols / 2, 0, NULL,
                  &offset, (uint64_t)(rows * (type == TL_Q8 ? cols : cols / 2)));
        add_entry(header, scale_name, "F16", rows, cols / TL_QGROUP, 0, NULL, &offset,
                  (uint64_t)(rows * (cols / TL_QGROUP) * 2));
    }
    char *text = cJSON_PrintUnformatted(header);
    cJSON_Delete(header);
    FILE *out = fopen(to, "wb");
    if (!text || !out) {
        free(text);
        if (out) fclose(out);
        tl_st_close(&file);
        return tl_fail(TL_ERR_IO, "%s: %s", to, strerror(errno));
    }
    size_t hlen = strlen(text), padded = (hlen + 7) / 8 * 8;
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    bool ok = fwrite(len_le, 1, 8, out) == 8 && fwrite(text, 1, hlen, out) == hlen;
    for (size_t i = hlen; i < padded; i++) ok &= fputc(' ', out) != EOF;
    free(text);

    float *row = NULL;
    uint8_t *q = NULL;
    uint16_t *scales = NULL;
    for (int i = 0; ok && i < file.n_tensors; i++) {
        const tl_st_tensor *t = &file.tensors[i];
        if (!quantisable(t)) {
            ok = fwrite(t->data, 1, t->nbytes, out) == t->nbytes;
            continue;
        }
        const int64_t rows = t->shape[0], cols = t->shape[1];
        const tl_dtype type = type_for(t, want);
        const size_t elem = tl_st_dtype_size(t->dtype), qbytes = (size_t)(type == TL_Q8 ? cols : cols / 2);
        const size_t groups = (size_t)cols / TL_QGROUP;
        free(row); free(q); free(scales);
        row = malloc((size_t)cols * sizeof *row);
        q = malloc((size_t)rows * qbytes);
        scales = malloc((size_t)rows * groups * sizeof *scales);
        if (!row || !q || !scales) { ok = false; break; }
        for (int64_t r = 0; r < rows; r++) {
            tl_convert_to_f32(t->data + (size_t)r * (size_t)cols * elem, float_dtype(t->dtype), (size_t)cols, row);
            if (type == TL_Q8) tl_quantize_row_q8(row, (int)cols, (int8_t *)q + (size_t)r * qbytes, scales + (size_t)r * groups);
            else tl_quantize_row_q4(row, (int)cols, q + (size_t)r * qbytes, scales + (size_t)r * groups);
        }
        ok = fwrite(q, 1, (size_t)rows * qbytes, out) == (size_t)rows * qbytes &&
             fwrite(scales, sizeof *scales, (size_t)rows * groups, out) == (size_t)rows * groups; /* little-endian host */
    }
    free(row); free(q); free(scales);
    ok &= fclose(out) == 0;
    tl_st_close(&file);
    return ok ? TL_OK : tl_fail(TL_ERR_IO, "%s: writing failed (disk full, or out of memory)", to);
}

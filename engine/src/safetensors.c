/* safetensors.c: header parsing and validation for memory-mapped .safetensors files.
 *
 * Layout: u64 little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}
 * then the data region; offsets are relative to the start of the data region. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "safetensors.h"

#define MAX_HEADER_BYTES (100u << 20) /* the format's own limit */

static const struct { const char *name; tl_st_dtype dtype; size_t size; } dtype_table[] = {
    {"F32", TL_ST_F32, 4}, {"F16", TL_ST_F16, 2}, {"BF16", TL_ST_BF16, 2}, {"F64", TL_ST_F64, 8},
    {"I64", TL_ST_I64, 8}, {"I32", TL_ST_I32, 4}, {"I16", TL_ST_I16, 2}, {"I8", TL_ST_I8, 1},
    {"U8", TL_ST_U8, 1},   {"BOOL", TL_ST_BOOL, 1},
};

const char *tl_st_dtype_name(tl_st_dtype dtype) {
    for (size_t i = 0; i < sizeof dtype_table / sizeof dtype_table[0]; i++)
        if (dtype_table[i].dtype == dtype) return dtype_table[i].name;
    return "?";
}

size_t tl_st_dtype_size(tl_st_dtype dtype) {
    for (size_t i = 0; i < sizeof dtype_table / sizeof dtype_table[0]; i++)
        if (dtype_table[i].dtype == dtype) return dtype_table[i].size;
    return 0;
}

static bool parse_dtype(const char *s, tl_st_dtype *out) {
    for (size_t i = 0; i < sizeof dtype_table / sizeof dtype_table[0]; i++)
        if (strcmp(dtype_table[i].name, s) == 0) { *out = dtype_table[i].dtype; return true; }
    return false;
}

static int by_offset(const void *a, const void *b) {
    const tl_st_tensor *x = a, *y = b;
    return x->data < y->data ? -1 : x->data > y->data ? 1 : 0;
}

/* Tensor pointers by their tensors' names (qsort's and bsearch's comparison). */
static int by_name(const void *a, const void *b) {
    return strcmp((*(const tl_st_tensor *const *)a)->name, (*(const tl_st_tensor *const *)b)->name);
}

void tl_st_close(tl_st_file *file) {
    if (!file) return;
    for (int i = 0; i < file->n_tensors; i++) free(file->tensors[i].name);
    free(file->tensors);
    free(file->by_name);
    if (file->map && !file->borrowed) munmap(file->map, file->map_len);
    memset(file, 0, sizeof *file);
}

/* Validates one header entry and fills *t. */
static tl_status parse_entry(const char *path, const cJSON *entry, const uint8_t *data,
                             size_t data_len, tl_st_tensor *t) {
    const char *name = entry->string;
    if (!cJSON_IsObject(entry))
        return tl_fail(TL_ERR_FORMAT, "%s: header entry \"%s\" is not an object", path, name);
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(entry, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(entry, "shape");
    const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(entry, "data_offsets");
    if (!cJSON_IsString(dtype) || !parse_dtype(dtype->valuestring, &t->dtype))
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has a missing or unknown dtype %s", path,
                       name, cJSON_IsString(dtype) ? dtype->valuestring : "");
    if (!cJSON_IsArray(shape) || cJSON_GetArraySize(shape) > TL_ST_MAX_DIMS)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has a missing or invalid shape", path, name);
    uint64_t numel = 1;
    t->ndim = 0;
    for (const cJSON *d = shape->child; d; d = d->next) {
        if (!cJSON_IsNumber(d) || d->valuedouble < 0 || d->valuedouble > 9.0e15 ||
            d->valuedouble != floor(d->valuedouble))
            return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has an invalid dimension", path, name);
        t->shape[t->ndim++] = (int64_t)d->valuedouble;
        if (t->shape[t->ndim - 1] && numel > UINT64_MAX / 16 / (uint64_t)t->shape[t->ndim - 1])
            return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" is impossibly large", path, name);
        numel *= (uint64_t)t->shape[t->ndim - 1];
    }
    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2 ||
        !cJSON_IsNumber(offsets->child) || !cJSON_IsNumber(offsets->child->next))
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" has invalid data_offsets", path, name);
    double begin = offsets->child->valuedouble, end = offsets->child->next->valuedouble;
    /* %.17g shows a fraction or a huge value as it is (%.0f would round 1.5 to "2"). */
    if (begin != floor(begin) || end != floor(end))
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" data_offsets [%.17g, %.17g] must be integers",
                       path, name, begin, end);
    if (begin < 0 || end < begin)
        return tl_fail(TL_ERR_FORMAT, "%s: tensor \"%s\" data_offsets [%.17g, %.17g] must satisfy 0 <= begin <= end",
                       path, name, begin, end);
    if (end > (double)data_len)
        return tl_fail(TL_ERR_FORMAT,
                       "%s: tensor \"%s\" data_offsets [%.17g, %.17g] fall outside the %zu data "
                       "bytes (truncated file?)",
                       path, name, begin, end, data_len);
    t->nbytes = (size_t)(end - begin);
    if ((uint64_t)t->nbytes != numel * tl_st_dtype_size(t->dtype))
        return tl_fail(TL_ERR_FORMAT,
                       "%s: tensor \"%s\" holds %zu bytes but its shape and dtype need %llu", path,
                       name, t->nbytes, (unsigned long long)(numel * tl_st_dtype_size(t->dtype)));
    t->data = data + (size_t)begin;
    t->name = strdup(name);
    return t->name ? TL_OK : tl_fail(TL_ERR_NO_MEMORY, "out of memory");
}

static tl_status parse_header(const char *path, tl_st_file *f) {
    const uint8_t *bytes = f->map;
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--) header_len = (header_len << 8) | bytes[i];
    if (header_len > MAX_HEADER_BYTES || header_len > f->map_len - 8)
        return tl_fail(TL_ERR_FORMAT,
                       "%s: header length %llu exceeds the file size %zu (truncated or not a "
                       "safetensors file)",
                       path, (unsigned long long)header_len, f->map_len);
    const uint8_t *data = bytes + 8 + header_len;
    size_t data_len = f->map_len - 8 - (size_t)header_len;

    /* read by the loader's rules for every JSON file (tl_json_read_strict: a key given twice,
       a bad \u escape, a number JSON has not, ill-formed UTF-8 refused, as Hugging Face's
       serde refuses them; plain cJSON read "a\uqqqq" as a tensor named "a"); the format pads
       the header with spaces, and nothing else may follow the object */
    const char *header = (const char *)bytes + 8;
    cJSON *root = NULL;
    char why[200];
    const int rc = tl_json_read_strict(header, (size_t)header_len, &root, why, sizeof why);
    if (rc == -2) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    if (rc != 0) return tl_fail(TL_ERR_FORMAT, "%s: the header is not a valid JSON object: %s", path, why);
    int count = 0;
    for (const cJSON *e = root->child; e; e = e->next) count++;
    f->tensors = calloc((size_t)count + 1, sizeof *f->tensors);
    if (!f->tensors) { cJSON_Delete(root); return tl_fail(TL_ERR_NO_MEMORY, "out of memory"); }
    tl_status st = TL_OK;
    for (const cJSON *e = root->child; e && st == TL_OK; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) continue;
        st = parse_entry(path, e, data, data_len, &f->tensors[f->n_tensors]);
        if (st == TL_OK) f->n_tensors++;
    }
    cJSON_Delete(root);
    if (st != TL_OK) return st;

    /* Names are found by binary search (a checkpoint may hold tens of thousands of tensors);
       each is given once (the header's reader refuses a key given twice). */
    if (!(f->by_name = malloc(((size_t)f->n_tensors + 1) * sizeof *f->by_name)))
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    for (int i = 0; i < f->n_tensors; i++) f->by_name[i] = &f->tensors[i];
    qsort(f->by_name, (size_t)f->n_tensors, sizeof *f->by_name, by_name);

    /* Buffers must not overlap (the format also requires them to tile the data region;
       we only refuse overlaps, which is what could make two tensors alias). An empty tensor
       holds no byte to share. */
    tl_st_tensor *sorted = malloc(((size_t)f->n_tensors + 1) * sizeof *sorted);
    if (!sorted) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    int n_sorted = 0;
    for (int i = 0; i < f->n_tensors; i++)
        if (f->tensors[i].nbytes > 0) sorted[n_sorted++] = f->tensors[i];
    qsort(sorted, (size_t)n_sorted, sizeof *sorted, by_offset);
    for (int i = 1; i < n_sorted && st == TL_OK; i++)
        if (sorted[i - 1].data + sorted[i - 1].nbytes > sorted[i].data)
            st = tl_fail(TL_ERR_FORMAT, "%s: tensors \"%s\" and \"%s\" overlap", path,
                         sorted[i - 1].name, sorted[i].name);
    free(sorted);
    return st;
}

tl_status tl_st_open(const char *path, tl_st_file *out) {
    memset(out, 0, sizeof *out);
    int fd;
    size_t size;
    tl_status st = tl_open_regular(path, SIZE_MAX, &fd, &size);
    if (st != TL_OK) return st;
    if (size < 8) {
        close(fd);
        return tl_fail(TL_ERR_FORMAT, "%s: file is %zu bytes, too short for a safetensors header",
                       path, size);
    }
    out->map_len = size;
    out->map = mmap(NULL, out->map_len, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    close(fd);
    if (out->map == MAP_FAILED) {
        out->map = NULL;
        /* ENOMEM (address space, map count) is a memory failure, not a bad file. */
        return tl_fail(map_errno == ENOMEM ? TL_ERR_NO_MEMORY : TL_ERR_IO, "%s: mmap failed: %s", path,
                       strerror(map_errno));
    }
    st = parse_header(path, out);
    if (st != TL_OK) tl_st_close(out);
    return st;
}

tl_status tl_st_open_memory(const char *name, const void *bytes, size_t len, tl_st_file *out) {
    memset(out, 0, sizeof *out);
    if (len < 8)
        return tl_fail(TL_ERR_FORMAT, "%s: file is %zu bytes, too short for a safetensors header", name, len);
    out->map = (void *)bytes;
    out->map_len = len;
    out->borrowed = true;
    tl_status st = parse_header(name, out);
    if (st != TL_OK) tl_st_close(out);
    return st;
}

tl_st_tensor *tl_st_find(tl_st_file *file, const char *name) {
    if (file->n_tensors == 0) return NULL;
    const tl_st_tensor key = {.name = (char *)name}, *key_ptr = &key;
    tl_st_tensor **found = bsearch(&key_ptr, file->by_name, (size_t)file->n_tensors, sizeof *file->by_name, by_name);
    return found ? *found : NULL;
}

/* safetensors.h: read-only, memory-mapped access to a .safetensors file. */
#ifndef TL_SAFETENSORS_H
#define TL_SAFETENSORS_H

#include "internal.h"

typedef enum {
    TL_ST_F32, TL_ST_F16, TL_ST_BF16, TL_ST_F64, TL_ST_I64, TL_ST_I32, TL_ST_I16, TL_ST_I8,
    TL_ST_U8, TL_ST_BOOL
} tl_st_dtype;

#define TL_ST_MAX_DIMS 8

/* A quantised matrix NAME's scales are the tensor NAME TL_ST_SCALE_SUFFIX (SPEC §8): written by
   the quantiser, bound (or ignored with it) by the loader. */
#define TL_ST_SCALE_SUFFIX "_scale"

typedef struct tl_st_tensor {
    char *name;
    tl_st_dtype dtype;
    int ndim;
    int64_t shape[TL_ST_MAX_DIMS];
    const uint8_t *data; /* inside the mapping; not necessarily aligned */
    size_t nbytes;
    bool claimed;        /* set by the loader to find tensors nobody asked for */
    bool ignored;        /* claimed only to be passed over (tl_bind_ignore): not in the model */
} tl_st_tensor;

typedef struct tl_st_file {
    void *map;
    size_t map_len;
    tl_st_tensor *tensors;   /* in the header's order (the fingerprint reads them so) */
    int n_tensors;
    tl_st_tensor **by_name;  /* [n_tensors] the tensors sorted by name (tl_st_find) */
    bool borrowed;       /* map belongs to the caller (tl_st_open_memory): not unmapped */
} tl_st_file;

/* Maps and validates the whole header (dtypes, shapes, offsets, file length, overlaps).
   On error *out is left empty and the message names the file and the problem. */
tl_status tl_st_open(const char *path, tl_st_file *out);
/* The same validation over a file already in memory (bytes must outlive *out); `name` is used
   in messages. The fuzzer's entry point. */
tl_status tl_st_open_memory(const char *name, const void *bytes, size_t len, tl_st_file *out);
tl_st_tensor *tl_st_find(tl_st_file *file, const char *name);
void tl_st_close(tl_st_file *file);
const char *tl_st_dtype_name(tl_st_dtype dtype);

/* ---- a checkpoint's weight files (safetensors_sharded.c): model.safetensors, or the shards
   that model.safetensors.index.json names (Hugging Face sharding). Every tensor is in
   exactly one file, as the index says. */
typedef struct tl_st_set {
    tl_st_file *files;
    char **paths;
    int n_files;
    char *described_as; /* the path error messages name for the whole set (file or index) */
} tl_st_set;

/* Opens dir/model.safetensors.index.json and its shards when the index exists, else
   dir/model.safetensors. Errors name the index or shard file and the tensor. */
tl_status tl_st_set_open(const char *dir, tl_st_set *out);
/* Whether dir holds a sharded checkpoint: any entry of the index's name, which the loader
   reads instead of model.safetensors (a dangling link too: opening it then fails). */
bool tl_st_is_sharded(const char *dir);
/* The tensor and the path of the file holding it, or NULL. */
tl_st_tensor *tl_st_set_find(tl_st_set *set, const char *name, const char **path);
void tl_st_set_close(tl_st_set *set);
size_t tl_st_dtype_size(tl_st_dtype dtype);

#endif

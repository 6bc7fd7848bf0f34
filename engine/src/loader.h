/* loader.h: binding checkpoint tensors into tl_weights, shared by the generic loader
 * (model.c, our own tensor names) and the loaders of published model families
 * (hf_huginn.c, hf_ouro.c, each mapping its original tensor and config names). */
#ifndef TL_LOADER_H
#define TL_LOADER_H

#include "internal.h"
#include "safetensors.h"

struct cJSON;

typedef struct tl_binder {
    tl_model *m;
    tl_st_set *files;
} tl_binder;

/* Matrices stay in their stored dtype (in the mapping, or an aligned copy); vectors become
   owned f32 arrays. Errors name the file and the tensor, and the shape the config implies. */
tl_status tl_bind_matrix(tl_binder *b, const char *name, int rows, int cols, tl_matrix *out);
/* Rows [row0, row0 + rows) of a stored [total_rows, cols] matrix: one part of a fused
   projection (Huginn's Wqkv, its gate/up `fc`). */
tl_status tl_bind_matrix_rows(tl_binder *b, const char *name, int total_rows, int cols, int row0,
                              int rows, tl_matrix *out);
tl_status tl_bind_vector(tl_binder *b, const char *name, int len, const float **out);
/* Elements [at, at + len) of a stored tensor whose shape is shape[0..ndim) (Huginn's qk_bias
   [2, 1, heads, head_dim] holds the q and the k bias). */
tl_status tl_bind_vector_part(tl_binder *b, const char *name, const int64_t *shape, int ndim, int at,
                              int len, const float **out);
/* Claims a tensor the model does not use (a buffer such as freqs_cis, the stored copy of a
   tied head), and its "<name>_scale" where it was quantised, so the loader does not reject
   them as unexpected. Returns whether it exists. */
bool tl_bind_ignore(tl_binder *b, const char *name);
/* The output head of a published family, stored as `name`: with tie_embeddings it is the
   token embedding, and a stored copy (some exports keep one) is claimed and ignored. */
tl_status tl_bind_head(tl_binder *b, const char *name);
/* Whether the checkpoint in dir would load, as far as its files decide: config.json, every
   tensor bound (names, shapes, dtypes, values) with none left over, and tokenizer.json; the
   checks and messages of tl_model_load, without a backend or a copy of the weights. The
   quantiser's check of its input before it writes: an input that does not load made a
   checkpoint that does not load, over a good one. On TL_OK *tied says whether it ties its
   head to its token embedding (config.json as a load reads it, every family's): a stored
   "lm_head.weight" is then never read. */
tl_status tl_checkpoint_check(const char *dir, bool *tied);

/* A published model family: recognised by config.json's model_type or architectures[0],
   with its own config names and tensor names. */
typedef struct tl_family {
    const char *model_type;
    const char *architecture;
    /* config.json (already parsed) -> a validated tl_config; messages start "config.json: ". */
    tl_status (*parse_config)(const struct cJSON *root, tl_config *out);
    tl_status (*bind)(tl_binder *b);
} tl_family;

extern const tl_family tl_family_huginn;
extern const tl_family tl_family_ouro;

/* Family config readers (hf_config.c): like config.c's, for the published field names. */
tl_status tl_hf_int(const struct cJSON *root, const char *name, bool required, int lo, int hi, int *out);
tl_status tl_hf_float(const struct cJSON *root, const char *name, double lo, double hi, float *out);
tl_status tl_hf_bool(const struct cJSON *root, const char *name, bool *out);
/* The string field, or NULL when absent or null; an error when it is not a string. */
tl_status tl_hf_string(const struct cJSON *root, const char *name, const char **out);

#endif

/*
 * tinyloop.h: public C API of TinyLoop, an inference runtime for looped
 * (recurrent-depth) transformer language models.
 *
 * Conventions (SQLite-like):
 *   - opaque handles with a _new/_free (or _load/_free) pair; freeing NULL is a no-op;
 *   - every fallible call returns a tl_status; TL_OK is 0;
 *   - on error, tl_last_error() returns a message for the calling thread that names
 *     the bad field or value. The library never aborts or exits on bad input.
 *   - a loaded tl_model is immutable and may be shared by any number of threads.
 */
#ifndef TINYLOOP_H
#define TINYLOOP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TINYLOOP_VERSION_MAJOR 0
#define TINYLOOP_VERSION_MINOR 1
#define TINYLOOP_VERSION_PATCH 0
#define TINYLOOP_VERSION "0.1.0"

/* Version of the library actually linked (may differ from the header's). */
const char *tl_version(void);

/* ---------------------------------------------------------------- status codes */

typedef enum tl_status {
    TL_OK = 0,
    TL_ERR_INVALID_ARGUMENT = 1, /* a parameter is out of range or inconsistent */
    TL_ERR_IO = 2,               /* a file is missing or unreadable */
    TL_ERR_FORMAT = 3,           /* a file is malformed or inconsistent with the config */
    TL_ERR_NO_MEMORY = 4,        /* an allocation failed */
    TL_ERR_UNSUPPORTED = 5,      /* valid request this build or backend cannot serve */
    TL_ERR_HOOK = 6,             /* a user hook returned an error code */
    TL_ERR_INTERNAL = 7,         /* a bug in TinyLoop: please report */
    TL_STATUS_FORCE_INT = 0x7fffffff
} tl_status;

/* Message describing the calling thread's most recent error ("" if none). */
const char *tl_last_error(void);
/* Short constant name of a status, e.g. "TL_ERR_FORMAT". */
const char *tl_status_name(tl_status status);

/* ---------------------------------------------------------------- model */

typedef struct tl_model tl_model;

typedef enum tl_backend_kind {
    TL_BACKEND_AUTO = 0, /* CUDA when built in and a device is present, else CPU */
    TL_BACKEND_CPU = 1,
    TL_BACKEND_CUDA = 2
} tl_backend_kind;

typedef struct tl_load_options {
    int n_threads;           /* CPU worker threads; 0 = number of online cores */
    tl_backend_kind backend; /* TL_BACKEND_AUTO by default */
} tl_load_options;

/* Fills *opts with the defaults (all cores, automatic backend). */
void tl_load_options_init(tl_load_options *opts);

/* dir: a checkpoint directory (SPEC §1). opts may be NULL for defaults. */
tl_status tl_model_load(const char *dir, const tl_load_options *opts, tl_model **out);
void tl_model_free(tl_model *model); /* NULL is a no-op */

/* The pinned accessor below shares this struct's name, so the type is spelled
   `struct tl_model_info` (C keeps struct tags apart from function names). */
struct tl_model_info {
    int vocab_size;
    int d_model;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int d_ff;
    int max_seq_len;
    int n_prelude;
    int n_block;
    int n_coda;
    int default_loops;
    int max_loops;
    float beta;
    float norm_eps;
    float rope_theta;
    int bos_token_id;
    int eos_token_id;
    const char *injection;    /* "none" | "add" | "concat" */
    const char *loop_update;  /* "replace" | "residual" */
    const char *norm;         /* "layernorm" | "rmsnorm" */
    const char *mlp;          /* "gelu" | "swiglu" */
    const char *pos_encoding; /* "learned" | "rope" */
    const char *weight_dtype; /* "f32" | "f16" | "bf16" (of the matrices, as stored) */
    int state_norm;           /* booleans as 0/1 */
    int bias;
    int tie_embeddings;
    int has_tokenizer;
    int n_threads;            /* worker threads actually used */
    const char *backend;      /* "cpu" | "cuda" */
    int64_t n_params;         /* parameters in the checkpoint */
    int64_t weight_bytes;     /* bytes of weights held in memory */
};

/* Never NULL for a loaded model; valid as long as the model is. */
const struct tl_model_info *tl_model_info(const tl_model *model);

/* ---------------------------------------------------------------- scoring */

/* Logits (n * vocab_size floats; row i = next-token logits after tokens[0..i]) for a
   token sequence at loop depth `loops` (1..max_loops). No sampling, no state kept.
   Thread-safe on a shared model. */
tl_status tl_score(const tl_model *model, const int32_t *tokens, int n, int loops,
                   float *logits);

#ifdef __cplusplus
}
#endif
#endif /* TINYLOOP_H */

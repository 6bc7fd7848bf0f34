/* backend.h: the operations forward.c composes, implemented once per device.
 *
 * Buffers passed to a backend are the backend's own (host memory for the CPU backend).
 * Every operation is batch invariant: row r of an output depends only on row r of the
 * inputs (and the cache), never on n or on the thread count. */
#ifndef TL_BACKEND_H
#define TL_BACKEND_H

#include "internal.h"
#include "kv_cache.h"

typedef struct tl_attention_args {
    const float *q;            /* [n][n_heads * head_dim], positions already applied */
    float *out;                /* [n][n_heads * head_dim] */
    int n;
    const tl_kv_cache *cache;  /* holds the prefix and this chunk's rows */
    int base;                  /* logical index of the chunk's first row */
    int slot;                  /* cache slot of this layer (block layers: at loop 1) */
    int loop;                  /* block layers: 1-based loop; 0 for prelude/coda */
    int slot_stride;           /* slots between consecutive loops (n_block) */
    const int32_t *positions;  /* [n] */
    const uint8_t *mask;       /* [n][base + n - mask_start]: row i may see entry mask_start + c;
                                  NULL = causal within the chunk */
    int mask_start;            /* first logical entry the mask covers (entries before it are
                                  the always-visible prefix) */
    float *scratch;            /* [n_threads][cache->capacity] */
} tl_attention_args;

typedef struct tl_backend {
    const char *name;
    /* y[n][w.rows] = x[n][w.cols] W^T (+ bias) */
    void (*matmul)(const tl_model *m, const float *x, int n, const tl_matrix *w,
                   const float *bias, float *y);
    void (*attention)(const tl_model *m, const tl_attention_args *args);
} tl_backend;

extern const tl_backend tl_cpu_backend;

#endif

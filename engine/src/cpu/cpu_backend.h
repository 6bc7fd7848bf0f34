/* cpu_backend.h: what the CPU backend's files share (not part of the device boundary). */
#ifndef TL_CPU_BACKEND_H
#define TL_CPU_BACKEND_H

#include "../backend.h"
#include "../pool.h"

/* cpu_arena.c: backend buffers (tl_backend.alloc / free), zeroed and 64-byte aligned;
   small ones from huge-page chunks. A NULL arena takes every block from the C heap. */
typedef struct tl_cpu_arena tl_cpu_arena;
tl_cpu_arena *tl_cpu_arena_new(void); /* NULL when out of memory */
void tl_cpu_arena_free(tl_cpu_arena *arena); /* unmaps the chunks: release every block first */
void *tl_cpu_arena_alloc(tl_cpu_arena *arena, size_t bytes);
void tl_cpu_arena_release(tl_cpu_arena *arena, void *buffer);

/* The CPU backend's private state, one per model (m->backend_ctx). */
typedef struct tl_cpu_context {
    tl_pool *pool;               /* worker threads; shared, used by one caller at a time */
    tl_cpu_arena *arena;         /* backend buffers (KV pages, workspaces) */
    void *weights_region;        /* anonymous huge-page copy of every matrix, or NULL */
    size_t weights_region_len;
    /* RoPE's (cos, sin) of every position and frequency, [max_seq_len][head_dim / 2][2]:
       every layer of a forward rotates at the same positions, and the sin/cos calls were
       1.3% of a shipped-model token. NULL when the table would be large (long contexts):
       tl_cpu_rope then computes them per call, with the same expression. */
    float *rope_table;
} tl_cpu_context;

static inline tl_pool *tl_cpu_pool(const tl_model *m) {
    return ((const tl_cpu_context *)m->backend_ctx)->pool;
}

/* cpu_backend.c */
void tl_cpu_matmul(const tl_model *m, const float *x, int n, const tl_matrix *w,
                   const float *bias, float *y);
void tl_cpu_matmul_group(const tl_model *m, const float *x, int n, const tl_matmul_out *outs, int count);

/* cpu_weights.c */
tl_status tl_cpu_upload_weights(const tl_model *m, tl_matrix *const *matrices, int n_matrices,
                                const float **const *vectors, const int *vector_lens,
                                int n_vectors, bool keep_mapped);
void tl_cpu_release_weights(tl_cpu_context *ctx);

/* cpu_rows.c: the per-row operations (norms, RoPE, activations, the loop, the head). */
void tl_cpu_embed(const tl_model *m, const int32_t *tokens, const int32_t *positions, int n, float *x);
void tl_cpu_norm(const tl_model *m, const float *x, int n, const float *w, const float *b, float *y);
void tl_cpu_rope(const tl_model *m, float *q, float *k, int n, const int32_t *positions);
void tl_cpu_rope_heads(const tl_model *m, float *q, float *k, int n, const int32_t *positions,
                       int h0, int h1, int g0, int g1);
/* RoPE's (cos, sin) for frequency i at `position`: the one expression, kept in the table or not. */
void tl_cpu_rope_angle(const tl_model *m, int32_t position, int i, float cos_sin[2]);
void tl_cpu_add(const tl_model *m, float *y, const float *x, size_t count);
void tl_cpu_add_rows(const tl_model *m, float *y, int n, int width, const float *bias);
void tl_cpu_gelu(float *x, size_t count); /* x = gelu_tanh(x): the matmul epilogue */
void tl_cpu_swiglu(float *gate, const float *up, size_t count); /* gate = silu(gate) * up: the epilogue */
/* v[i] = e^(v[i] - max) (math_shared.h's tl_exp_softmax): attention's weights, a block at once. */
void tl_cpu_softmax_weights(float *v, int n, float max);
void tl_cpu_loop_init(const tl_model *m, const float *x, int n, float *e, float *s);
void tl_cpu_state_init_random(const tl_model *m, float *s, int n, const int32_t *positions, uint64_t seed);
void tl_cpu_inject(const tl_model *m, const float *s, const float *e, int n, float *cat, float *out);
void tl_cpu_loop_update(const tl_model *m, float *s, const float *x, const float *u, int n);
void tl_cpu_copy(const tl_model *m, float *dst, const float *src, size_t count);
double tl_cpu_state_change(const tl_model *m, const float *s_new, const float *s_old);
double tl_cpu_exit_gate(const tl_model *m, const float *s);
void tl_cpu_head(const tl_model *m, const float *x, int n, float *normed, float *logits);
void tl_cpu_hidden(const tl_model *m, const float *x, int n, float *hidden);

#endif

/* backend.h: the device boundary. Every operation of the forward pass, over buffers the
 * backend owns; forward.c composes them and model.c / kv_cache.c allocate through them.
 *
 * Buffers. Activations (tl_workspace), the KV cache's K/V storage and the weights live in
 * backend memory (plain host memory for the CPU backend, device memory for a GPU). The
 * host never dereferences them, with one exception: the logits written by `head`, the only
 * result that comes back. Small per-forward inputs stay host arrays owned by the caller and
 * valid for the call: token ids, positions, the tree mask, and the cache's row bookkeeping
 * (tl_kv_cache pos / logical / depth, which the host edits on commit and compaction).
 *
 * Shapes are written [rows][width], row-major with no padding; n is the number of rows of
 * the chunk, d = cfg.d_model, qd = n_heads * head_dim, kvd = n_kv_heads * head_dim.
 *
 * The contract every implementation keeps (batch invariance): row r of every output
 * depends only on row r of the inputs (and the cache and weights), computed by the same
 * sequence of floating-point operations whatever n, the split across threads or blocks, or
 * the other rows. Work may be split along independent outputs, never along a reduction.
 * This is what makes a token's logits identical whether it came alone (decode), in a
 * prompt chunk (prefill), in a speculative tree or in a beam batch. */
#ifndef TL_BACKEND_H
#define TL_BACKEND_H

#include "internal.h"
#include "kv_cache.h"

typedef struct tl_attention_args {
    const float *q;            /* [n][qd], positions already applied */
    float *out;                /* [n][qd] */
    int n;
    tl_kv_cache *cache;        /* holds the prefix and this chunk's rows (written by
                                  qkv_attention; attention only reads it) */
    int base;                  /* logical index of the chunk's first row */
    int slot;                  /* cache slot of this layer (block layers: at loop 1) */
    int loop;                  /* block layers: 1-based loop; 0 for prelude/coda */
    int slot_stride;           /* slots between consecutive loops (n_block) */
    const int32_t *positions;  /* [n] host */
    const uint8_t *mask;       /* host [n][base + n - mask_start]: row i may see entry
                                  mask_start + c; NULL = causal within the chunk */
    int mask_start;            /* first logical entry the mask covers (entries before it are
                                  the always-visible prefix) */
    float *scratch;            /* [threads][scratch_stride] backend buffer (softmax scores) */
    int scratch_stride;        /* floats per thread: cache->capacity times the score arrays a
                                  thread may fill at once (TL_ATTENTION_SCORE_SLOTS) */
    int row;                   /* the chunk's first row among the forward's n rows: where
                                  qkv_attention finds its k and v rows */
} tl_attention_args;

/* Softmax score arrays (cache->capacity floats each) one thread's attention scratch holds
   at once: the CPU backend scores a row's heads together, up to TL_ATTENTION_SCORE_HEADS of
   them (one walk over the cache for all), and the rows of a prompt chunk in groups (one
   walk for several rows), rows x heads at most TL_ATTENTION_SCORE_SLOTS (8 rows of 4 heads). */
#define TL_ATTENTION_SCORE_HEADS 4
#define TL_ATTENTION_SCORE_SLOTS 32

/* One product of a matmul group (tl_backend.matmul_group). */
typedef struct tl_matmul_out {
    const tl_matrix *w;
    const float *bias; /* [w->rows] or NULL */
    float *y;          /* [n][w->rows] */
    bool gelu;         /* then y = gelu_tanh(y), element by element */
    bool swiglu;       /* then y = silu(y) * outs[i + 1].y, element by element: this is the
                          gate, the next product (same shape) the up projection */
} tl_matmul_out;

typedef struct tl_backend {
    const char *name; /* reported in tl_model_info.backend */

    /* ---- lifetime. open runs once at load, after the config, the tensors (host) and
       m->rope_inv_freq are ready and before upload_weights; it stores its
       private state (thread pool, streams, handles) in *ctx, which the model keeps as
       m->backend_ctx. n_threads: tl_load_options.n_threads (0 = the backend decides). */
    tl_status (*open)(const tl_model *m, int n_threads, void **ctx);
    void (*close)(void *ctx); /* frees the context and the weight storage of upload_weights */
    int (*threads)(const void *ctx); /* host workers used (tl_model_info.n_threads; the first
                                        dimension of the attention scratch) */

    /* ---- buffers. alloc returns zeroed backend memory of `bytes` (64-byte aligned), NULL
       when out of memory; ctx is the backend context (NULL allowed for the CPU backend). */
    void *(*alloc)(void *ctx, size_t bytes);
    void (*free)(void *ctx, void *buffer);

    /* ---- weights. Called once at load, after binding: `matrices` point at the checkpoint's
       row-major tensors (host memory: the file mapping or aligned copies, in their stored
       dtype) and `vectors` at host f32 arrays (norm weights and biases; an entry may be
       NULL when the config has no such vector), each of vector_lens[i] floats. The backend
       copies them into its own storage and layout, rewriting each tl_matrix (data, packed)
       and each vector pointer in place; the host copies stay alive with the model.
       keep_mapped (tl_load_options.mmap_weights) asks a host backend to use the mapping
       as is. Aliased entries (a tied lm_head is tok_embed) are listed once; the caller
       re-aliases afterwards. */
    tl_status (*upload_weights)(const tl_model *m, tl_matrix *const *matrices, int n_matrices,
                                const float **const *vectors, const int *vector_lens,
                                int n_vectors, bool keep_mapped);

    /* ---- the forward's operations, in the order a layer uses them */

    /* x[n][d] = tok_embed[tokens[r]] * cfg.embed_scale (+ pos_embed[positions[r]] for
       learned positions). */
    void (*embed)(const tl_model *m, const int32_t *tokens, const int32_t *positions, int n,
                  float *x);
    /* y[n][d] = norm(x[n][d]) * w (+ b): cfg.norm (layernorm / rmsnorm), cfg.norm_eps,
       statistics in double; b may be NULL; y may alias x. */
    void (*norm)(const tl_model *m, const float *x, int n, const float *w, const float *b,
                 float *y);
    /* y[n][w.rows] = x[n][w.cols] W^T (+ bias[w.rows]); bias may be NULL. */
    void (*matmul)(const tl_model *m, const float *x, int n, const tl_matrix *w,
                   const float *bias, float *y);
    /* The products of one input, for i < count: outs[i].y[n][w.rows] = x[n][w.cols] W_i^T
       (+ bias_i), then gelu_tanh when outs[i].gelu (GPT-2's 0.5 x (1 + tanh(sqrt(2/pi)
       (x + 0.044715 x^3)))), or SwiGLU's y = y / (1 + e^-y) * up when outs[i].swiglu.
       Each result is that of its own matmul call; a backend runs the group together (the
       CPU: one parallel region for q/k/v, or gate/up, not one per matrix, with the
       activation applied by the task that computed the columns). */
    void (*matmul_group)(const tl_model *m, const float *x, int n, const tl_matmul_out *outs,
                         int count);
    /* Optional (NULL: the forward calls matmul_group twice): matmul_group(x, first, count),
       then matmul_group(first[0].y, second, 1) (the MLP's down projection of its activated
       gate or up), as one pass. second's output may be x, which the pass no longer reads by
       then. */
    void (*matmul_then)(const tl_model *m, const float *x, int n, const tl_matmul_out *first, int count,
                        const tl_matmul_out *second);
    /* In place on q[n][qd] and k[n][kvd]: RoPE at positions[r] (host [n]) on the pairs of
       cfg.rope_pairing ("half": (i, i + hd/2), "interleaved": (2i, 2i+1)), angles in double
       from m->rope_inv_freq (one call for both, so that a row's angles are computed once). */
    void (*rope)(const tl_model *m, float *q, float *k, int n, const int32_t *positions);
    /* The chunk's K and V rows k[n][kvd], v[n][kvd] into `slot` at logical entries
       [base, base + n) (ring rows with a window). */
    /* (Pages: kv_cache.h. The forward has made the rows' pages private and present;
       tl_kv_writable gives a row's address.) */
    void (*kv_write)(const tl_model *m, tl_kv_cache *cache, int slot, int base, const float *k,
                     const float *v, int n);
    /* Every slot of logical entry `from` copied to entry `to` (compaction of an accepted
       speculative path); the host updates the row bookkeeping. */
    void (*kv_move)(tl_kv_cache *cache, int from, int to);
    /* out[n][qd] = softmax(q K^T / sqrt(head_dim)) V per head (grouped-query: head h reads
       kv head h / (n_heads / n_kv_heads)), over the visible cache entries in logical order:
       causal or args->mask (tree), within cache->window, and with KV sharing by depth
       (a prefix entry computed to depth D lends its loop-D slot to deeper loops).
       n_args chunks, each over its own cache (a batch of sessions), in one call: a backend
       runs them together, and each row's result is what it would be alone. */
    void (*attention)(const tl_model *m, const tl_attention_args *args, int n_args);
    /* Optional (NULL, or false returned having done nothing: the forward runs the separate
       operations above). matmul_group(h, qkv, 3) for q, k, v; rope(q, k) at `positions`
       unless NULL; each chunk's k and v rows (k[args[i].row ..][kvd]) into its cache at
       write_slot as kv_write does; attention(args), whose outputs fill att [n][qd]; then,
       unless o is NULL, matmul_group(att, o, 1): all in one pass, with the results of the
       separate calls bit for bit. o's output may be h, which the pass no longer reads by
       then. A decode step is then one parallel region for all of this on the CPU (a task
       per group of KV heads, then the projection's columns) instead of three, and RoPE and
       the cache writes run on the threads rather than between regions. */
    bool (*qkv_attention)(const tl_model *m, const float *h, int n, const tl_matmul_out qkv[3],
                          const int32_t *positions, int write_slot, const tl_attention_args *args,
                          int n_args, const float *att, const tl_matmul_out *o);
    /* y[n][width] += bias[width] on every row (the qk-bias-after-RoPE test hook). */
    void (*add_rows)(const tl_model *m, float *y, int n, int width, const float *bias);
    /* y[count] += x[count] (residual add). */
    void (*add)(const tl_model *m, float *y, const float *x, size_t count);

    /* ---- the loop */

    /* e[n][d] = x (the prelude's output); s[n][d] = e for injection "none", else 0. */
    void (*loop_init)(const tl_model *m, const float *x, int n, float *e, float *s);
    /* s[n][d] = a truncated normal (mean 0, cfg.state_init_std, cut at +-3 std) times
       cfg.embed_scale, Huginn's random start. Element i of row r is a function of (seed,
       positions[r], i) only: a counter-based draw, so that a token gets the same state in
       every forward that computes it (batch invariance, bit-exact speculation). */
    void (*state_init_random)(const tl_model *m, float *s, int n, const int32_t *positions,
                              uint64_t seed);
    /* out[n][d] = inject(s, e): "none": s; "add": s + e; "concat": W_inj [s ; e] (+ b), or
       W_inj [e ; s] with cfg.inject_embedding_first, through cat[n][2d], a scratch the
       backend may use. */
    void (*inject)(const tl_model *m, const float *s, const float *e, int n, float *cat,
                   float *out);
    /* s[n][d] += beta (x - ref), ref = s ("replace") or u ("residual"); then the state
       norm when the config has one. x is the block's output, u its input. */
    void (*loop_update)(const tl_model *m, float *s, const float *x, const float *u, int n);
    /* dst[count] = src[count], both backend buffers. */
    void (*copy)(const tl_model *m, float *dst, const float *src, size_t count);
    /* The early-exit measure of one row s_new[d] against s_old[d], in double:
       sqrt(sum (s_new - s_old)^2 / sum s_new^2), or +infinity when s_new is all zero. */
    double (*state_change)(const tl_model *m, const float *s_new, const float *s_old);
    /* The exit gate of one row s[d] (cfg.exit_gate, Ouro): sigmoid(exit_gate . s + b), the
       sigmoid in double. Like state_change, only the number comes back. */
    double (*exit_gate)(const tl_model *m, const float *s);

    /* ---- the head: logits[n][vocab] (HOST memory) = final_norm(x[n][d]) lm_head^T (x
       itself when cfg.final_norm_at_head is false), with normed[n][d] as scratch. The one
       result that leaves the backend. */
    void (*head)(const tl_model *m, const float *x, int n, float *normed, float *logits);
    /* hidden[n][d] (HOST memory) = final_norm(x[n][d]) (x itself when
       cfg.final_norm_at_head is false): the rows the head reads, brought back instead of
       the logits (tl_embed's embeddings). */
    void (*hidden)(const tl_model *m, const float *x, int n, float *hidden);
} tl_backend;

/* The backends of this build. */
extern const tl_backend tl_cpu_backend;

#endif

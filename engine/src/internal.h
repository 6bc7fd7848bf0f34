/* internal.h: definitions shared by the engine's source files (not installed). */
#ifndef TL_INTERNAL_H
#define TL_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tinyloop.h"

/* ---------------------------------------------------------------- errors */

/* Records a printf-style message for tl_last_error() and returns `status`, so that
   call sites read `return tl_fail(TL_ERR_FORMAT, "...", ...)`. */
tl_status tl_fail(tl_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The refusal of a call given a NULL pointer it needs: the first NULL of `count` (name,
   pointer) pairs, each pointer passed as (const void *), named ("fn: name must not be NULL",
   TL_ERR_INVALID_ARGUMENT), so that a call of several pointers says which. */
tl_status tl_fail_null(const char *fn, int count, ...);
void tl_clear_error(void);
/* The longest message kept, with its NUL: tl_last_error's, and every copy of one (a session's
   tl_session_error, a serving engine's request), so that a copy is the message whole. */
#define TL_ERROR_MAX 1024
/* Text the library writes or reads (messages, numbers in grammars) does not follow the host's
   locale (setlocale(LC_ALL, "") under a comma-decimal one): between these two calls this
   thread formats and parses in the C locale. tl_enter_c_locale returns the caller's, which
   tl_leave_c_locale puts back. */
void *tl_enter_c_locale(void);
void tl_leave_c_locale(void *callers);

/* ---------------------------------------------------------------- fork() */

/* fork() copies only the calling thread: a child inherits a pool's and an engine's state but
   not their threads, and a condition variable that still counts the parent's sleepers (its
   pthread_cond_destroy waited for them forever: a child that freed a model hung). Whatever
   starts threads records tl_process_mark() and asks tl_forked_since(mark) before it relies on
   them: true in a child made by fork() after the mark (counted by a pthread_atfork handler). */
unsigned tl_process_mark(void);
bool tl_forked_since(unsigned mark);

/* ---------------------------------------------------------------- memory / time */

void *tl_alloc_aligned(size_t bytes);   /* 64-byte aligned, zeroed; NULL on failure */
void tl_free_aligned(void *ptr);
double tl_now_ms(void);                 /* monotonic clock */
/* Anonymous memory of at least `bytes`, zeroed, its start aligned to 2 MiB and advised for
   transparent huge pages: on a VM where a page fault costs ~14 us, 4 KiB pages would cost a
   fault per 4 KiB first touched. NULL when out of memory; else munmap(*region, *region_len)
   frees it. */
void *tl_map_huge(size_t bytes, void **region, size_t *region_len);

/* The name of a KV cache type, as tl_model_info and the load options spell it. */
static inline const char *tl_kv_type_name(tl_kv_type t) { return t == TL_KV_F16 ? "f16" : "f32"; }

/* ---------------------------------------------------------------- hashing */

/* A 64-bit hash fed in pieces (a model's fingerprint, a saved state's checksum): eight bytes
   at a time, each word through a bijective mix, so that a file differing from another in
   any one word always hashes differently. Not cryptographic. */
typedef struct tl_hasher {
    uint64_t h, total;
    uint8_t tail[8];
    int n_tail;
} tl_hasher;
void tl_hash_init(tl_hasher *hs);
void tl_hash_add(tl_hasher *hs, const void *bytes, size_t n);
uint64_t tl_hash_final(const tl_hasher *hs); /* the hasher may go on being fed */

/* ---------------------------------------------------------------- checkpoint files */

/* The one rule for every file of a checkpoint: a regular file (symlinks to one are fine) of
   at most max_bytes. A FIFO, directory or device is refused without blocking (a FIFO would
   otherwise hang the load, /dev/zero would be read until memory runs out), as is a dangling
   symlink, with TL_ERR_IO naming the path and what it is; an oversized file gets
   TL_ERR_FORMAT. tl_open_regular leaves an open descriptor in *fd (the caller closes it);
   tl_read_regular returns the NUL-terminated contents in *out (free()). */
tl_status tl_open_regular(const char *path, size_t max_bytes, int *fd, size_t *size);
tl_status tl_read_regular(const char *path, size_t max_bytes, char **out, size_t *len);
/* Reads exactly `size` bytes of fd into buf (the file at path, named in the error). */
tl_status tl_read_exact(int fd, const char *path, void *buf, size_t size);
/* Writing a file whole or not at all: tl_create_beside opens a new file beside `path`
   (*fd, its name in *temp, to free; on failure the message names `path`, *fd is -1 and
   *temp NULL), which the writer syncs and renames over `path`, then
   tl_sync_directory_of(path) makes the rename durable. */
tl_status tl_create_beside(const char *path, int *fd, char **temp);
void tl_sync_directory_of(const char *path);
#define TL_MAX_CONFIG_BYTES ((size_t)64 << 20)
#define TL_MAX_TOKENIZER_BYTES ((size_t)256 << 20) /* the largest HF tokenizers are ~35 MB */

/* Most rows one forward pass takes when a sequence is forwarded in pieces (prefill, scoring):
   bounds activation memory only, since results do not depend on it (batch invariance). */
#define TL_FORWARD_CHUNK 64

/* ---------------------------------------------------------------- config (config.c) */

typedef enum { TL_INJECT_NONE, TL_INJECT_ADD, TL_INJECT_CONCAT } tl_injection;
typedef enum { TL_UPDATE_REPLACE, TL_UPDATE_RESIDUAL } tl_loop_update;
typedef enum { TL_NORM_LAYERNORM, TL_NORM_RMSNORM } tl_norm_kind;
typedef enum { TL_MLP_GELU, TL_MLP_SWIGLU } tl_mlp_kind;
typedef enum { TL_POS_LEARNED, TL_POS_ROPE } tl_pos_kind;
/* Where a layer's norms sit. "pre": x += Attn(n1 x); x += MLP(n3 x). "sandwich" (Huginn):
   x = n2(x + Attn(n1 x)); x = n4(x + MLP(n3 x)). "pre_post" (Ouro): x += n2(Attn(n1 x));
   x += n4(MLP(n3 x)). n1/n3 are attn_norm/mlp_norm, n2/n4 attn_out_norm/mlp_out_norm. */
typedef enum { TL_PLACE_PRE, TL_PLACE_SANDWICH, TL_PLACE_PRE_POST } tl_norm_placement;
/* RoPE pairs: "half" rotates (i, i + hd/2) (HF Llama), "interleaved" (2i, 2i+1) (Huginn). */
typedef enum { TL_ROPE_HALF, TL_ROPE_INTERLEAVED } tl_rope_pairing;
/* The loop state before the first loop (concat/add injection): zeros, or a truncated normal
   drawn per token from a seed (forward.h: tl_forward.state_seed). */
typedef enum { TL_STATE_ZERO, TL_STATE_TRUNCATED_NORMAL } tl_state_init;

typedef struct tl_config {
    int vocab_size, d_model, n_heads, n_kv_heads, head_dim, d_ff, max_seq_len;
    int n_prelude, n_block, n_coda;
    int default_loops, max_loops;
    float beta, norm_eps, rope_theta;
    tl_injection injection;
    tl_loop_update loop_update;
    bool state_norm, bias, tie_embeddings;
    tl_norm_kind norm;
    tl_mlp_kind mlp;
    tl_pos_kind pos_encoding;
    int bos_token_id, eos_token_id;

    /* General options of the family beyond the first SPEC round (SPEC §1; defaults give
       the original forward pass exactly). */
    tl_norm_placement norm_placement;  /* "norm_placement": "pre" */
    tl_rope_pairing rope_pairing;      /* "rope_pairing": "half" */
    bool qk_bias;                      /* "qk_bias": q and k biases (added before RoPE) without bias */
    float embed_scale;                 /* "embed_scale": 1; token embeddings are multiplied by it */
    bool inject_embedding_first;       /* "inject_order": "state_first" ([s; e]) or "embedding_first" */
    bool state_norm_is_final_norm;     /* "state_norm_weights": "own" or "final_norm" (reuse) */
    bool final_norm_before_coda;       /* "final_norm_before_coda": false; the loop's output is
                                          final-normed before the coda (Huginn's ln_f, twice) */
    bool final_norm_at_head;           /* "final_norm_at_head": true; false when the per-pass
                                          state norm already is the head's norm (Ouro) */
    tl_state_init state_init;          /* "initial_state": "zero" */
    float state_init_std;              /* "initial_state_std": the normal's std before truncation
                                          at +-3 std; the draw is then scaled by embed_scale */
    bool inject_bias;                  /* the concat adapter has a bias (our format: = bias) */
    bool exit_gate;                    /* "exit_gate": false; an exit gate sigma(gate(s)) after
                                          each pass (Ouro): exit_gate.weight [1, d], .bias [1] */
    float exit_threshold;              /* "exit_gate_threshold": 1; its default cumulative-
                                          probability threshold */

    /* Test hook only, never set from a config: q/k biases added after RoPE (the classic
       mistake the golden tests must catch). */
    bool qk_bias_after_rope;
    char warnings[1024];         /* one line per ignored unknown field ("" when none) */
} tl_config;

/* Parses and validates config.json text; the message names the field and value. */
tl_status tl_config_parse(const char *json_text, tl_config *out);
/* A JSON file's text (len bytes) by the rules every file the loader reads shares (config.json,
   tokenizer.json, a sharded checkpoint's index): no byte order mark, one object, nothing
   after it but white space, no key given twice at any depth. 0 and *out (to cJSON_Delete),
   or -1 with why saying what is wrong (the caller names the file), -2 out of memory. */
struct cJSON;
int tl_json_read_strict(const char *text, size_t len, struct cJSON **out, char *why, size_t why_len);
/* The same rules for a value of any kind at the top (a JSON Schema may be true or false). */
int tl_json_read_value_strict(const char *text, size_t len, struct cJSON **out, char *why, size_t why_len);
/* Whether text starts with one JSON value cJSON would read, given the memory: what tells its
   refusal from a failed malloc (both a NULL). Allocates nothing; never true where cJSON refuses. */
bool tl_json_value_parses(const char *text, size_t len);
/* config.json's text (NUL-terminated) read so, failing with TL_ERR_FORMAT "config.json: ...". */
tl_status tl_config_json_read(const char *json_text, struct cJSON **out);
/* tl_config_parse's second half: the fields of a config.json already read. */
tl_status tl_config_from_json(const struct cJSON *root, tl_config *out);
/* A float field's value v (shown as `shown`) in [lo, hi], or (lo, hi] when lo_open, also as
   the float it is stored as (a value that rounds to lo is out); the family readers' too. */
tl_status tl_config_float_in_range(const char *name, const char *shown, double v, double lo, double hi, bool lo_open,
                                   float *out);
/* max_loops when a config does not say: 4 x default_loops, at most 4096 (SPEC §1). */
int tl_config_default_max_loops(int default_loops);
/* The defaults of every optional field, on a zeroed config (shared by the family loaders). */
void tl_config_defaults(tl_config *c);
/* The rules between fields (divisibility, loop bounds, rope's even head_dim), after parsing. */
tl_status tl_config_check(tl_config *c);

/* ---------------------------------------------------------------- weights */

typedef enum { TL_F32 = 0, TL_F16 = 1, TL_BF16 = 2, TL_Q8 = 3, TL_Q4 = 4 } tl_dtype;

/* Quantised matrices (q8, q4; README "Quantised weights"): integers in groups of TL_QGROUP
   consecutive inputs (columns), one f16 scale per (row, group) in `scale`; cols is a
   multiple of TL_QGROUP. q8: int8 q in [-127, 127], w = scale * q. q4: 4-bit u in [0, 15],
   w = scale * (u - 8). Row-major (as in the file): q8 [rows][cols] bytes, q4 [rows][cols/2]
   bytes (element 2j in the low nibble of byte j, 2j+1 in the high one), scale f16
   [rows][cols/TL_QGROUP]. The CPU backend's packed layout is in cpu/cpu_weights.c. */
#define TL_QGROUP 32
static inline bool tl_dtype_quantised(tl_dtype dt) { return dt == TL_Q8 || dt == TL_Q4; }

/* A matrix [rows, cols] in its checkpoint dtype (16-bit types stay 16-bit in memory;
   kernels convert on the fly). `data` is the backend's after upload (backend.h). For the
   CPU backend: row-major as in the file, or, when `packed`, in panels of
   TL_PANEL rows: element (r, c) at [(r / TL_PANEL) * cols * TL_PANEL + c * TL_PANEL + r % TL_PANEL]
   (the last panel zero-padded), so that a kernel streams one panel contiguously and keeps
   one output row per vector lane: no horizontal sums, any number of input rows. */
#define TL_PANEL 16
/* Panels of a matrix of `rows` rows (the last one zero-padded). */
static inline int tl_panel_count(int rows) { return (rows + TL_PANEL - 1) / TL_PANEL; }
typedef struct tl_matrix {
    const void *data;
    const void *scale; /* q8/q4 only: the f16 group scales (packed: inside `data`, NULL) */
    tl_dtype dtype;
    int rows, cols;
    int packed;
} tl_matrix;

/* One pre-norm transformer layer. Vectors (norms, biases) are converted to f32 at load
   (and live in backend memory after upload);
   bias pointers are NULL when the config has no bias (norm_b NULL for rmsnorm). */
typedef struct tl_layer {
    const float *attn_norm_w, *attn_norm_b;
    const float *attn_out_norm_w, *attn_out_norm_b; /* sandwich / pre_post placement only */
    const float *mlp_out_norm_w, *mlp_out_norm_b;
    tl_matrix q, k, v, o;
    const float *q_b, *k_b, *v_b, *o_b;
    const float *mlp_norm_w, *mlp_norm_b;
    tl_matrix gate, up, down; /* gate only for swiglu */
    const float *gate_b, *up_b, *down_b;
} tl_layer;

typedef struct tl_weights {
    tl_matrix tok_embed;        /* [vocab, d] */
    tl_matrix pos_embed;        /* [max_seq_len, d] (learned positions only) */
    tl_layer *prelude, *block, *coda;
    tl_matrix inject;           /* [d, 2d] (concat only) */
    const float *inject_b;
    const float *state_norm_w, *state_norm_b;
    const float *final_norm_w, *final_norm_b;
    tl_matrix lm_head;          /* [vocab, d]; aliases tok_embed when tied */
    tl_matrix exit_gate;        /* [1, d] (exit_gate only) */
    const float *exit_gate_b;   /* [1] */
} tl_weights;

struct tl_backend;
struct tl_tlz_tokenizer;

struct tl_model {
    tl_config cfg;
    tl_weights w;
    struct tl_model_info info;
    const struct tl_backend *backend;
    tl_kv_type kv_type;          /* what the KV pages hold (load option) */
    void *backend_ctx;           /* the backend's private state (backend.h: open / close) */
    struct tl_st_set *kept_files; /* the mapped weight files while matrices point into them
                                     (mmap_weights), else NULL */
    void **owned;                /* host allocations to free with the model */
    int n_owned, cap_owned;
    double *rope_inv_freq;       /* [head_dim/2] */
    struct tl_tlz_tokenizer *tokenizer; /* NULL without tokenizer.json */
    char *dir;
    _Atomic(struct tl_prefix_pool *) prefix_pool; /* opt-in (tl_model_set_prefix_pool), else NULL;
                                           the one mutable part of a model, behind its own lock
                                           (set once, by compare and swap: two first calls at once
                                           must not both install one) */
    struct tl_kv_spares *kv_spares; /* freed KV pages kept for reuse (kv_cache.h), behind
                                       its own lock; NULL: none kept */
    uint64_t fingerprint;        /* config.json, the weight files (sampled) and the token
                                    texts (model.c): what a state file is checked against
                                    (state_file.c) */
    atomic_llong kv_page_bytes;  /* K + V bytes of every page that exists (caches, saved
                                    states, the pool, spares): kv_cache.c counts them through
                                    its const model pointers (the model is heap memory, never
                                    a const object), tl_model_get_memory reads them */
};

#endif

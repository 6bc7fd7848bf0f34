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

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TINYLOOP_VERSION_MAJOR 0
#define TINYLOOP_VERSION_MINOR 1
#define TINYLOOP_VERSION_PATCH 0
#define TINYLOOP_VERSION "0.1.0"

/* The library is built with -fvisibility=hidden: only what this header declares is exported
   (test_symbols lists the shared library's dynamic symbols). */
#if defined(__GNUC__)
#pragma GCC visibility push(default)
#endif

/* Version of the library actually linked (may differ from the header's). */
const char *tl_version(void);

/* ---------------------------------------------------------------- status codes */

typedef enum tl_status {
    TL_OK = 0,
    TL_ERR_INVALID_ARGUMENT = 1, /* a parameter is out of range or inconsistent */
    TL_ERR_IO = 2,               /* a file is missing or unreadable */
    TL_ERR_FORMAT = 3,           /* a file is malformed or inconsistent with the config; or a
                                    step's logits turned NaN or infinite (the model's numbers
                                    overflowed) */
    TL_ERR_NO_MEMORY = 4,        /* an allocation failed */
    TL_ERR_UNSUPPORTED = 5,      /* valid request this build or backend cannot serve */
    TL_ERR_HOOK = 6,             /* a user hook returned an error code */
    TL_ERR_INTERNAL = 7,         /* a bug in TinyLoop: please report */
    TL_STATUS_FORCE_INT = 0x7fffffff
} tl_status;

/* Message describing the calling thread's most recent error ("" if none). A later call may
   replace it, or clear it where it succeeds: read it right after the call that failed. */
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

/* What the KV cache stores. f32 (the default) keeps K and V as the forward computed them; f16
   rounds them to half precision on write (round to nearest even) and widens them exactly
   on read: half the KV memory and half the bytes attention reads, at a small cost in
   accuracy (the results differ from f32's, and are deterministic and batch-invariant as
   f32's are). CPU backend only. */
typedef enum tl_kv_type {
    TL_KV_F32 = 0,
    TL_KV_F16 = 1
} tl_kv_type;

enum { TL_MAX_THREADS = 1024 }; /* the most CPU worker threads a model takes (n_threads) */

typedef struct tl_load_options {
    int n_threads;           /* CPU worker threads; 0 = one per core this process may use
                                (its affinity mask, capped by its cgroup CPU quota) */
    tl_backend_kind backend; /* TL_BACKEND_AUTO by default */
    int mmap_weights;        /* 0 (default): copy matrices into huge-page memory, which
                                streams faster; 1: use the file mapping in place (no copy,
                                pages shared with the page cache and other processes).
                                With 1 the file must not change while the model is loaded:
                                truncating it kills the process with SIGBUS on the next
                                forward, and writing into it changes the weights (and the
                                output) silently, NaN check included (MAP_PRIVATE does not
                                isolate pages the process never wrote). Replace a checkpoint
                                by writing a new file and rename()-ing it over the old one:
                                the loaded model keeps the old inode. */
    tl_kv_type kv_type;      /* TL_KV_F32 by default */
} tl_load_options;

/* Fills *opts with the defaults (one thread per core, automatic backend, f32 KV; f16 KV
   when the environment has TINYLOOP_KV_TYPE=f16). */
void tl_load_options_init(tl_load_options *opts);

/* dir: a checkpoint directory (SPEC §1). opts may be NULL for defaults. A child that fork()
   made after the load keeps the model without its worker threads (fork copies only the
   calling thread): it generates on its own thread and may free it, where no other thread of
   the parent was inside the library at the fork (README, "A process that forks"). */
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
    const char *weight_dtype; /* "f32" | "f16" | "bf16" | "q8" | "q4" (of the layers' matrices, as stored;
                                 a quantised checkpoint's, where it kept some float: the
                                 quantiser names those) */
    int state_norm;           /* booleans as 0/1 */
    int bias;
    int tie_embeddings;
    int has_tokenizer;
    int n_threads;            /* worker threads actually used */
    const char *backend;      /* "cpu" | "cuda" */
    const char *kv_type;      /* "f32" | "f16" (tl_load_options.kv_type) */
    int64_t n_params;         /* parameters of the model (a stored tensor it does not read, such
                                 as a tied checkpoint's lm_head, is not counted) */
    int64_t weight_bytes;     /* bytes of weights held in memory (the same tensors') */
    int exit_gate;            /* 1 when the model has a per-loop exit gate (Ouro) */
    float exit_gate_threshold; /* its default cumulative-probability threshold (config.json's
                                  exit_gate_threshold, a Hugging Face Ouro folder's
                                  early_exit_threshold). 1 exits only where the cumulative
                                  probability reaches 1 in double precision, as Ouro's own
                                  code does: gates near 1 saturate it within a few loops (for
                                  every loop, leave the gate criterion off) */
};

/* Never NULL for a loaded model; valid as long as the model is. */
const struct tl_model_info *tl_model_info(const tl_model *model);

/* What a model holds in memory now (a snapshot; sessions on other threads move it). */
typedef struct tl_model_memory {
    int64_t weight_bytes;    /* the weights (tl_model_info's weight_bytes) */
    int64_t kv_bytes;        /* K/V pages held by sessions, saved states and the prefix pool;
                                a page that forks share counts once */
    int64_t kv_spare_bytes;  /* freed pages the model keeps for the next sessions (<= 64 MiB) */
} tl_model_memory;
void tl_model_get_memory(const tl_model *model, tl_model_memory *out); /* zeros for NULL */
/* What the load accepted but a person should see, one line each ("" when nothing): unknown
   config.json fields, which SPEC §1 ignores (checkpoints carry metadata) but which may be a
   misspelt optional field ("rope_theeta": the default then applies; the line suggests the
   field meant). Never NULL; valid as long as the model is. The CLI prints these. */
const char *tl_model_warnings(const tl_model *model);

/* ---------------------------------------------------------------- text
   These need the checkpoint's tokenizer.json (tl_model_info()->has_tokenizer); without
   one they fail with TL_ERR_UNSUPPORTED. Buffers they return are freed with tl_free. */

void tl_free(void *ptr);

/* Byte-level BPE encoding of text[0..len) (any bytes; special tokens such as
   "<|endoftext|>" are recognised). *ids receives a tl_free-able array of *n_ids ids. The ids
   are the text's alone: no special token is added (Hugging Face's add_special_tokens=False;
   tokenizer.json's post_processor, a template that may put a BOS first, is not applied: a
   prompt that wants one writes it, as chat templates do). */
tl_status tl_encode(const tl_model *model, const char *text, size_t len, int32_t **ids, int *n_ids);
/* tl_encode with flags (0: tl_encode). TL_ENCODE_SPECIAL_AS_TEXT encodes the texts of special
   tokens ("<|endoftext|>", "<|im_start|>") as ordinary text, for text that must not inject
   control tokens (Hugging Face's split_special_tokens, llama.cpp's parse_special false); added
   tokens that are not special are still recognised. Other bits: TL_ERR_INVALID_ARGUMENT. */
enum { TL_ENCODE_SPECIAL_AS_TEXT = 1 };
tl_status tl_encode_ex(const tl_model *model, const char *text, size_t len, unsigned flags, int32_t **ids, int *n_ids);
/* Concatenated bytes of the tokens (NUL-terminated; *len excludes the terminator; free with
   tl_free). A failure leaves *text NULL. */
tl_status tl_decode(const tl_model *model, const int32_t *ids, int n, char **text, size_t *len);
/* The raw bytes of one token; valid as long as the model. */
tl_status tl_token_text(const tl_model *model, int32_t id, const char **bytes, size_t *len);
/* 1 for a special token (end of text...: control, not text unless a config's
   keep_special_text keeps it: tl_token_in_text), else 0 (also without a tokenizer, and for
   ids out of range). */
int tl_token_is_special(const tl_model *model, int32_t id);

/* Streaming detokenizer: never returns a broken UTF-8 sequence (bytes of an unfinished
   code point wait for the next token); flush returns what is left. Pieces stay valid
   until the next call on the same detokenizer. The model must outlive it (it reads the
   model's token texts). */
typedef struct tl_detokenizer tl_detokenizer;
tl_status tl_detokenizer_new(const tl_model *model, tl_detokenizer **out);
tl_status tl_detokenizer_push(tl_detokenizer *d, int32_t id, const char **piece, size_t *len);
/* The bytes held back at the end (d NULL: an empty piece). */
void tl_detokenizer_flush(tl_detokenizer *d, const char **piece, size_t *len);
void tl_detokenizer_free(tl_detokenizer *d);

/* ---------------------------------------------------------------- scoring */

/* Logits (n * vocab_size floats; row i = next-token logits after tokens[0..i]) for a
   token sequence at loop depth `loops` (1..max_loops). No sampling, no state kept.
   Thread-safe on a shared model. */
tl_status tl_score(const tl_model *model, const int32_t *tokens, int n, int loops,
                   float *logits);
enum { TL_MAX_TOP_LOGPROBS = 20 }; /* the most alternatives a token's log-probabilities list */
/* The sequence's own log-probabilities at depth `loops`: logprobs[i] of tokens[i + 1] after
   tokens[0..i] (n - 1 values: tl_score's rows log-softmaxed), and for each of those rows
   the `top` (0..TL_MAX_TOP_LOGPROBS) most likely tokens in top_ids/top_logprobs
   [(n - 1) * top], ranked as tl_session_logprobs ranks them. Holds one chunk of logits at a
   time, not n rows. A row holding a NaN or an infinity (the model's activations overflowed)
   is TL_ERR_FORMAT, naming its position. Thread-safe on a shared model. */
tl_status tl_score_logprobs(const tl_model *model, const int32_t *tokens, int n, int loops, int top,
                            float *logprobs, int32_t *top_ids, float *top_logprobs);

/* A sequence of token ids (a batch's prompts and inputs, stop sequences, tags). */
typedef struct tl_token_seq {
    const int32_t *tokens;
    int n;
} tl_token_seq;

/* ---------------------------------------------------------------- embeddings */

/* How tl_embed turns a sequence's rows into its embedding. */
typedef enum tl_pooling {
    TL_POOLING_MEAN = 0, /* the mean of every token's row (in double, in token order) */
    TL_POOLING_LAST = 1, /* the last token's row: the only one that has read the whole text */
    TL_POOLING_NONE = 2  /* every token's row: out [n][d_model] */
} tl_pooling;

typedef struct tl_embed_options {
    int loops;          /* 0 (default): the model's default_loops; else 1..max_loops */
    tl_pooling pooling; /* TL_POOLING_MEAN */
    int normalize;      /* 1 (default): each vector returned scaled to unit L2 norm (a zero
                           vector stays zero); 0: as the model computed it */
} tl_embed_options;

void tl_embed_options_init(tl_embed_options *opts);

/* The embedding of tokens[0..n): the rows the head reads (final_norm of the coda's output,
   SPEC §1) at depth opts->loops, pooled into out [d_model] (out [n][d_model] with
   TL_POOLING_NONE). opts NULL: the defaults. Each row is the row tl_score's logits come
   from, computed from a zero initial state; nothing is sampled or kept. A NaN or an infinity
   in the result (the model's activations overflowed, or a device failed) is TL_ERR_FORMAT,
   never a vector. Thread-safe on a shared model. */
tl_status tl_embed(const tl_model *model, const int32_t *tokens, int n, const tl_embed_options *opts,
                   float *out);

/* tl_embed of many inputs at once: out receives inputs[0..n_inputs)'s embeddings in order,
   out [n_inputs][d_model] (TL_POOLING_NONE: every input's rows one after another, [sum of
   their n][d_model]). Short inputs share forward passes (each in its own cache, as batched
   sessions do), so each weight read serves all their rows: faster than a tl_embed call
   each for queries and sentences. Each result is bit-identical to tl_embed's for that input
   alone (batch invariance). Every input is checked before any is computed (a bad one is
   named by its index, from 0); n_inputs 0 does nothing. As with tl_embed, a NaN or an
   infinity in a result is TL_ERR_FORMAT, naming the input. Thread-safe on a shared model. */
tl_status tl_embed_batch(const tl_model *model, const tl_token_seq *inputs, int n_inputs, const tl_embed_options *opts,
                         float *out);

/* ---------------------------------------------------------------- generation (SPEC §3) */

typedef enum tl_stop_reason {
    TL_STOP_NONE = 0,             /* still generating; or the step failed (a hook's error, a
                                     grammar too costly): finished all the same, with
                                     tl_session_error saying why */
    TL_STOP_EOS = 1,              /* the model's eos_token_id was emitted (it is in the output) */
    TL_STOP_SEQUENCE = 2,         /* a stop sequence or stop string matched (it is in the output) */
    TL_STOP_MAX_TOKENS = 3,       /* max_tokens were emitted */
    TL_STOP_CALLBACK_ABORT = 4,   /* a callback or stop rule asked to stop (token included) */
    TL_STOP_GRAMMAR_DEAD_END = 5  /* no token was allowed (grammar, or every logit -inf) */
} tl_stop_reason;

/* "EOS", "STOP_SEQUENCE", "MAX_TOKENS", "CALLBACK_ABORT", "GRAMMAR_DEAD_END" ("NONE";
   "UNKNOWN" for a value that is no reason). */
const char *tl_stop_reason_name(tl_stop_reason reason);

/* Hook results: continue, stop after this token, or an error that aborts generation with
   TL_ERR_HOOK (distinct from a normal stop). Hooks return these codes; the stream callback of
   tl_generate_stream returns a bool instead (true = go on), as in the original API. Any
   negative value is an error; TL_HOOK_STOP ends generation from on_token and stop_rule, and
   ends the token's loops from a depth policy; from a logits hook it, like any other positive
   value, goes on. */
enum { TL_HOOK_CONTINUE = 0, TL_HOOK_STOP = 1, TL_HOOK_ERROR = -1 };

/* Per-token hooks (SPEC §5). `tokens` is the whole sequence so far (prompt + emitted). */
typedef int (*tl_on_token_hook)(void *user, int32_t token, int position);
typedef int (*tl_stop_rule_hook)(void *user, const int32_t *tokens, int n);
/* Edits logits[vocab_size] in place before sampling; return TL_HOOK_CONTINUE or an error.
   The buffer is valid during the call only, and logits[0] to logits[vocab_size - 1] are its
   floats: a write just outside them (up to 64 floats either side) fails the generation with
   TL_ERR_HOOK naming the index; further out, it is the caller's memory error. */
typedef int (*tl_logits_hook)(void *user, float *logits, int vocab_size, const int32_t *tokens,
                              int n);

/* Early-exit criteria (tl_generate_config.early_exit_criterion): how a decode token decides,
   after a loop, that its state has settled. A "probe" runs the coda and the head on the
   current loop state (its logits), so probe-based criteria cost a head per probed loop.
   The names in quotes are Huginn-0125's (recpre generate_with_adaptive_compute). */
typedef enum tl_exit_criterion {
    TL_EXIT_HIDDEN_STATE = 0, /* relative state change < early_exit_threshold and the probe's
                                 argmax equals the previous probe's; with
                                 early_exit_logit_margin > 0: top-1 minus top-2 logit >= it */
    TL_EXIT_LATENT_DIFF = 1,  /* "latent-diff": relative state change < early_exit_threshold
                                 (no probe until the exit) */
    TL_EXIT_KL = 2,           /* "kl": KL(previous probe || this probe) < early_exit_kl_threshold */
    TL_EXIT_ENTROPY_DIFF = 3, /* "entropy-diff": |entropy - previous probe's| <
                                 early_exit_entropy_threshold */
    TL_EXIT_ARGMAX = 4,       /* "argmax-stability": the argmax equals the previous probe's
                                 (Huginn asks 5 in a row: early_exit_patience = 5) */
    TL_EXIT_GATE = 5          /* Ouro's exit gate: the cumulative exit probability
                                 sum_u sigma(gate(s_u)) prod_(v<u) (1 - sigma(gate(s_v))) >=
                                 early_exit_gate_threshold (no probe until the exit) */
} tl_exit_criterion;

/* What a decode token's loop `loop` left, for the depth_policy hook. */
typedef struct tl_loop_signals {
    int loop;                /* loops done, 1-based (the hook runs after loops 1 .. loops - 1) */
    int loops;               /* the session's depth: where the token stops if nothing exits */
    int position;            /* the token's position in the sequence */
    double state_change;     /* ||s_loop - s_(loop-1)|| / ||s_loop|| (+inf for an all-zero state) */
    double gate;             /* exit gate sigma(gate(s_loop)) (Ouro); NaN without a gate */
    double exit_probability; /* cumulative exit probability through this loop; NaN without a gate */
    int probed;              /* 1 when a probe ran after this loop; the fields below need one */
    int32_t argmax;          /* the probe's top token; -1 without a probe */
    double entropy;          /* of the probe's softmax, in nats; NaN without a probe */
    double kl;               /* KL(previous probe || this probe); NaN without both */
    double entropy_change;   /* |entropy - previous probe's entropy|; NaN without both */
    int criterion_exit;      /* 1 when early_exit_criterion (with its patience) says exit here;
                                0 on a loop it does not check (min_L, peek_every), and always
                                0 when early_exit_patience is 0 */
} tl_loop_signals;

/* Called after each loop of a decode token but the last: TL_HOOK_STOP exits at this depth,
   TL_HOOK_CONTINUE runs the next loop (the hook decides, criterion_exit is its advice),
   TL_HOOK_ERROR aborts generation with TL_ERR_HOOK. Probes run on the early_exit_min_L /
   early_exit_peek_every schedule so that the hook sees entropy and KL there. */
typedef int (*tl_depth_policy_hook)(void *user, const tl_loop_signals *signals);

/* A grammar drives a mask of allowed tokens. `allowed` fills allowed[vocab_size] with 1 for
   each permitted next token and returns how many (0 ends generation with
   TL_STOP_GRAMMAR_DEAD_END; < 0 is an error; a count that is not the mask's is an error too,
   TL_ERR_HOOK; the mask is valid during the call only, and a write just outside it, as
   outside a logits hook's buffer, fails with TL_ERR_HOOK naming the index); `advance` is
   told the chosen token.
   Or set `compiled` (tl_grammar_use) to a grammar compiled by TinyLoop (GBNF or JSON Schema,
   see the end of this header); the callbacks are then unused: every session gets its own
   matcher, which also enables speculative decoding and fast greedy masks. */
struct tl_compiled_grammar;
typedef struct tl_grammar {
    void *user;
    int (*allowed)(void *user, uint8_t *allowed, int vocab_size);
    int (*advance)(void *user, int32_t token);
    const struct tl_compiled_grammar *compiled; /* NULL: a callback grammar */
} tl_grammar;

/* Self-speculative decoding as a session mode (see tl_generate_speculative). */
typedef enum tl_speculative_mode {
    TL_SPECULATIVE_OFF = 0,
    TL_SPECULATIVE_CHAIN = 1,  /* draft a chain of draft_ahead tokens, verify in one forward */
    TL_SPECULATIVE_TREE = 2    /* draft a tree (K_branches per node, max_nodes), greedy only */
} tl_speculative_mode;

/* One entry of tl_generate_config.logit_bias: `bias` (finite) is added to the logit of
   `token` (0 <= token < vocab_size) at every step; -100 all but bans it, +100 all but
   forces it, as in OpenAI's API. */
typedef struct tl_logit_bias {
    int32_t token;
    float bias;
} tl_logit_bias;

typedef struct tl_generate_config {
    int max_tokens;                  /* 64; new tokens at most (>= 0) */
    int loops;                       /* 0 = the model's default_loops; else 1..max_loops */
    float temperature;               /* 0.0; <= 0.01 means greedy (argmax, ties to lowest id) */
    int top_k;                       /* 50; >= 1 when sampling */
    float top_p;                     /* 1.0; in (0, 1], nucleus over the top-k survivors */
    int cache_window;                /* 0 = unbounded; W > 0 keeps the last W positions */
    float repetition_penalty;        /* 1.0; > 0, HF convention (see tl_generate) */
    const tl_token_seq *stop_sequences; /* token-id suffixes that stop generation */
    int n_stop_sequences;
    int beam_size;                   /* 0 (or 1) = off */
    float length_penalty;            /* 1.0 */
    int early_exit_patience;         /* 0 = off; > 0: a decode token exits once the criterion
                                        held at this many checked loops in a row */
    int early_exit_min_L;            /* 2; the first loop checked (and probed); at most max_loops
                                        while early exit is on */
    int early_exit_peek_every;       /* 1; then every this many loops, below `loops` */
    float early_exit_logit_margin;   /* 0.0; > 0: a probe is stable when top1 - top2 logit >= it */
    float early_exit_threshold;      /* 0.03: hidden-state mode: a probe is stable when the
                                        relative change ||s_l - s_(l-1)|| / ||s_l|| is below it
                                        and the probe's argmax equals the previous probe's;
                                        latent-diff: the change alone */
    tl_exit_criterion early_exit_criterion; /* TL_EXIT_HIDDEN_STATE; what "stable" means */
    float early_exit_kl_threshold;      /* 1e-3 (Huginn's default); TL_EXIT_KL */
    float early_exit_entropy_threshold; /* 1e-3 (Huginn's default); TL_EXIT_ENTROPY_DIFF */
    float early_exit_gate_threshold;    /* 0 = the model's (tl_model_info's exit_gate_threshold);
                                           else in (0, 1]; TL_EXIT_GATE. Ouro's own rule is
                                           patience 1, min_L 1, peek_every 1 */
    uint64_t sample_seed;            /* 0; same seed + config + model = same tokens */
    int ignore_eos;                  /* 0; when 1, eos_token_id does not stop generation */
    /* Stop strings: text that may span token boundaries, matched in the generated text
       (needs a tokenizer: without one, TL_ERR_INVALID_ARGUMENT). The token completing a
       match stays in the output, and tl_session_text never shows text that could still
       become part of a match. */
    const char *const *stop_strings;
    int n_stop_strings;
    /* Hooks, each optional (NULL), each with its own user pointer. */
    tl_on_token_hook on_token;
    void *on_token_user;
    tl_stop_rule_hook stop_rule;
    void *stop_rule_user;
    tl_logits_hook logits_processor;
    void *logits_processor_user;
    const tl_grammar *grammar;
    /* Per-loop depth decision of each decode token (early exit by a user rule); plain
       decoding only, like early exit. */
    tl_depth_policy_hook depth_policy;
    void *depth_policy_user;
    /* Decoding mode. Plain sampling by default; beam_size >= 2 selects beam search; these
       select self-speculative decoding, verified at `loops` (the verify depth). Every mode
       is a session: tl_session_step emits one token per call in all of them. */
    tl_speculative_mode speculative; /* TL_SPECULATIVE_OFF */
    int draft_loops;                 /* 2; 1 <= draft_loops < loops */
    int draft_ahead;                 /* 4; tokens (chain) or tree levels per verification, 1..32 */
    int K_branches;                  /* 2; tree: candidates kept per drafted node, 1..8 */
    int max_nodes;                   /* 64; tree: node budget, 2..256 */
    /* OpenAI's sampling adjustments (its completions fields of these names), applied to a
       step's logits after the logits hook, in this order: logit_bias, the repetition
       penalty, then presence and frequency penalties. Every mode takes them (beam search
       over each hypothesis's own tokens); log-probabilities stay the model's own. */
    const tl_logit_bias *logit_bias; /* NULL; n_logit_bias entries, each token at most once */
    int n_logit_bias;                /* 0 */
    float presence_penalty;          /* 0.0; finite: subtracted once from the logit of every
                                        token generated so far (the prompt's do not count) */
    float frequency_penalty;         /* 0.0; finite: subtracted once per time a token was
                                        generated so far: logit -= count * frequency +
                                        (count > 0) * presence */
    int penalty_window;              /* 0 = the whole sequence; W > 0: the three penalties above
                                        read only the last W tokens of the sequence (prompt and
                                        output), llama.cpp's and Ollama's repeat_last_n: the
                                        repetition penalty every token among them, presence
                                        and frequency the generated ones among them */
    int penalties_count_prompt;      /* 0; 1: presence and frequency count the prompt's tokens
                                        (in the window) as well, llama.cpp's rule */
    /* vLLM's and llama.cpp's sampling extensions. */
    float min_p;                     /* 0.0 (off); in [0, 1]: when sampling, after top_k and
                                        top_p (Hugging Face's and llama.cpp's order; vLLM's
                                        V1 applies it first, the same unless top_p < 1), only
                                        tokens whose probability is at least min_p times the
                                        most likely token's are kept */
    int min_tokens;                  /* 0; in [0, max_tokens]: the first min_tokens new tokens
                                        are neither eos (unless ignore_eos) nor the token of a
                                        one-token stop sequence, longer stop sequences match
                                        from the min_tokens-th new token on, and stop strings
                                        from the next (vLLM's rule: a match ending in the
                                        first min_tokens tokens' text is never seen). The ends are banned (after the
                                        adjustments above) to the lowest finite logit, not
                                        -inf: one comes earlier only where every other token
                                        is banned (a grammar that allows nothing but its
                                        end), and then ends generation as always. The hooks
                                        (stop_rule, on_token) still stop. */
    /* A thinking budget: thinking models write their reasoning in a block (from
       reasoning_start's tokens to reasoning_end's, "<think>" ... "</think>") before the
       answer. With reasoning_budget > 0, once an open block holds that many tokens (after
       its start), the next tokens are reasoning_end's, forced (those it does not already end
       with: a tag of several ids the model had begun), and decoding goes on free (the
       answer follows). A block opens where the generated text comes to hold
       reasoning_start's bytes (however the model's ids spell them; or its ids, where a tag
       is a special token, whose text is not shown) and closes where it holds reasoning_end's;
       it is open from the first token with reasoning_open (the prompt opened it: a template
       that writes "<think>\n" itself); a later block gets a budget of its own. A compiled
       grammar must allow reasoning_end where it is forced (the after-block grammars do):
       else that step fails with TL_ERR_UNSUPPORTED, saying so. The forced tokens'
       log-probabilities are the model's own (tl_session_logprobs), however low. Plain and
       batched decoding, early exit included; speculative and beam sessions refuse it. Neither
       tag may hold an id that ends generation (eos_token_id unless ignore_eos, a one-token
       stop sequence): forced, it would end the reply inside its block, min_tokens or not. */
    int reasoning_budget;            /* 0 (off); > 0: the most tokens of a block */
    tl_token_seq reasoning_start;    /* 1..TL_MAX_REASONING_TAG ids (0 ids: only with reasoning_open) */
    tl_token_seq reasoning_end;      /* 1..TL_MAX_REASONING_TAG ids; also what the budget forces */
    int reasoning_open;              /* 0; 1: the block is open before the first token */
    /* vLLM's skip_special_tokens = false: special tokens' texts ("<|im_end|>", a "<tool_call>"
       a tokenizer marks special) are part of the generated text (tl_session_text, stop
       strings), except the token that ends generation (the end of sequence, a one-token stop
       sequence's), whose text vLLM drops too. The tokens themselves are emitted either way. */
    int keep_special_text;           /* 0 (special tokens are control, not text); 1 */
    /* A model whose loop starts from a random state (Huginn's) draws it from sample_seed, and
       the prompt's K/V depend on it: the prefix pool shares a prefix only between sessions of
       the same seed. With fixed_state_seed = 1 the state is drawn as with sample_seed 0
       whatever sample_seed is (sampling still follows sample_seed), so sessions that sample
       under different seeds share it (a server's unseeded requests, each with a random seed).
       Other models ignore it. */
    int fixed_state_seed;            /* 0; 1 */
    /* The sampler's order. 0: Hugging Face's and vLLM's, the temperature scales the logits and
       then top_k, top_p and min_p cut. 1: llama.cpp's default chain (its server's `samplers`
       with the temperature after the cuts): top_p and min_p cut the distribution at
       temperature 1, and the temperature then applies to the tokens they leave (top_k's cut
       is the same either way). Greedy decoding is the same either way. */
    int temperature_last;            /* 0; 1 */
} tl_generate_config;

enum { TL_MAX_REASONING_TAG = 16 }; /* the most ids of reasoning_start and reasoning_end */

/* Fills *cfg with the documented defaults above. */
void tl_generate_config_init(tl_generate_config *cfg);

#define TL_HISTOGRAM_DEPTHS 65

typedef struct tl_generate_stats {
    double prefill_ms;       /* the prompt's forward pass, from its first row (a session's wait
                                before it, in an engine's queue or for its first step, is not it) */
    double first_token_ms;   /* from the start of the call (a session: its creation) to the first
                                emitted token */
    double decode_ms;        /* from the end of the prefill to the last emitted token */
    int prompt_tokens;
    int tokens_emitted;      /* new tokens, prompt excluded */
    tl_stop_reason stop_reason;
    double loops_used;       /* mean loop depth over emitted tokens */
    int probes;              /* early-exit probes (coda + head runs before the last loop) */
    double probe_ms;         /* time spent in those probes */
    /* depth_histogram[d]: emitted tokens whose logits came from loop depth d (depths above
       TL_HISTOGRAM_DEPTHS - 1 are counted in the last bin) */
    int depth_histogram[TL_HISTOGRAM_DEPTHS];
    double beam_score;       /* beam search: the returned hypothesis's
                                sum_logprob / max(1, len)^length_penalty */
    /* Self-speculative modes (zero otherwise). */
    int drafted;             /* draft tokens (chain) or tree nodes proposed */
    int accepted;            /* of those, accepted by the verifier */
    int verify_steps;        /* verification forwards */
    int draft_forwards;      /* forward passes at draft_loops */
    int verify_forwards;     /* forward passes at the verify depth (the prefill included) */
    double draft_ms, verify_ms;
    double acceptance_rate;  /* accepted / verify depth offered (= drafted for the chain) */
    double mean_accepted;    /* accepted draft tokens per verification */
    int prompt_tokens_reused; /* prompt tokens whose K/V came from the prefix pool */
    int prefill_tokens;      /* prompt tokens the prefill computed in prefill_ms: prompt_tokens
                                less those reused, and less the last where beam search and
                                speculative decoding take it into their first step */
} tl_generate_stats;

/* The tokens after the first (tokens_emitted - 1: the first comes from the prefill's
   logits) / decode seconds, and prefill_tokens / prefill seconds (0 when undefined: fewer
   than two tokens, nothing computed). */
double tl_stats_decode_tokens_per_s(const tl_generate_stats *stats);
double tl_stats_prefill_tokens_per_s(const tl_generate_stats *stats);

/* ---- the step API: one state machine behind every blocking call */

typedef struct tl_session tl_session;

/* Validates the config against the model and copies everything it needs (the prompt,
   stop sequences, stop strings and the tl_grammar struct may be freed afterwards; what hook
   and grammar user pointers point to must outlive the session). The model must outlive the
   session, its forks and its saved states (they read its weights, and give their KV pages
   back to it). A compiled grammar need not: the session holds its own reference.
   The prompt's forward pass runs on the first step. The config's mode (plain, beam_size >= 2,
   speculative) decides how tokens are found; every mode emits one token per step:
     - speculative modes draft and verify when their verified run is used up, then emit the
       run token by token (hooks, stop rules and stats exactly as plain decoding);
     - beam search emits a token as soon as every hypothesis that can still win agrees on
       it, and the rest when the search ends. */
tl_status tl_session_new(const tl_model *model, const int32_t *prompt, int prompt_len,
                         const tl_generate_config *cfg, tl_session **out);
/* NULL is a no-op. Called from one of the session's own hooks (while tl_session_step runs),
   the free is deferred until that step returns. Never call it on a session handed to a
   serving engine (tl_engine_submit with *id > 0): the engine frees it when the request ends,
   which may be at any moment, so the pointer may already be freed; end the request with
   tl_engine_cancel. (A free that does reach a session while the engine holds it, a hook of
   another session's, ends the request with a status saying so, and the engine frees it.) */
void tl_session_free(tl_session *session);

/* Emits one token: *token receives it (or -1 when the session stopped without emitting,
   e.g. max_tokens = 0 or a grammar dead end) and *stop the reason generation ended with this
   step (TL_STOP_NONE to go on). Stepping a finished session is an error, and so is stepping
   a session from inside one of its own hooks (TL_ERR_INVALID_ARGUMENT). */
tl_status tl_session_step(tl_session *session, int32_t *token, tl_stop_reason *stop);

/* Advances n distinct sessions of one model by one step each, as n tl_session_step calls
   would: tokens[i], stops[i] and statuses[i] are session i's results (a session that fails
   is finished; the others go on). Every session's tokens are bit-identical to stepping it
   alone. Returns TL_OK when the call itself is valid (non-NULL arrays, n >= 1, one model, no
   session twice, none finished or stepping); the per-session outcome is in statuses, and a
   failed session's message in tl_session_error (tl_last_error() is then empty: one thread's
   message cannot tell several sessions' failures apart; except where the one forward pass
   the plain sessions share failed, out of memory for a page or the workspace: every one of
   them then failed with it, and tl_last_error() holds it). The call's own bookkeeping (a
   few arrays of n) failing to allocate returns TL_ERR_NO_MEMORY with no session stepped:
   each may be stepped again. A hook may free any session of the call: it is freed when the
   call ends. */
tl_status tl_session_step_batch(tl_session *const *sessions, int n, int32_t *tokens, tl_stop_reason *stops,
                                tl_status *statuses);

/* Chunked prefill: how much of the sessions' prompts one tl_session_step_batch_with forwards. */
typedef struct tl_step_batch_options {
    int prompt_rows; /* 0: no limit (tl_session_step_batch). Otherwise the most rows of prompts
                        not yet in their caches this call forwards, shared out in the call's
                        order; the running sessions' rows always go in. A session whose prompt
                        the limit cuts emits nothing this call: token -1, stop TL_STOP_NONE,
                        status TL_OK (the only step that gives -1 without a stop); a later
                        call forwards the rest and emits its first token. Speculative and
                        beam sessions' prompts share the pass and its chunks as well, but for
                        the last token, which their own first step forwards with its drafts or
                        beams. Tokens stay bit-identical to stepping alone. */
} tl_step_batch_options;
void tl_step_batch_options_init(tl_step_batch_options *opts);
/* tl_session_step_batch with options (NULL: the defaults); prompt_rows < 0 is refused. */
tl_status tl_session_step_batch_with(tl_session *const *sessions, int n, const tl_step_batch_options *opts,
                                     int32_t *tokens, tl_stop_reason *stops, tl_status *statuses);

/* The message of the session's step that failed (tl_session_step's, or its row's in
   tl_session_step_batch), "" while none did; valid until the session is freed. NULL gives "". */
const char *tl_session_error(const tl_session *session);

/* Log-probabilities of the token the last step emitted, under the logits it was chosen from
   as the model gave them (before the logits hook, repetition penalty, grammar mask and
   temperature: the model's own distribution, as tl_score's rows; an early exit's depth when
   it exited): *logprob for the token and, for top in [1, TL_MAX_TOP_LOGPROBS], the top most
   likely tokens, most likely first (ties to the lower id), in top_ids/top_logprobs [top]
   (-1 and -inf past the tokens with a finite logit). Until the next step, from an on_token
   hook as well. A speculative session's token has its verification row's figures (the row
   at the verify depth its token was chosen or accepted from: plain decoding's row, to the
   bit). TL_ERR_UNSUPPORTED for beam sessions (their tokens come from rows not kept);
   TL_ERR_INVALID_ARGUMENT when the last step emitted no token (none yet, a session read from
   a state file before its first step, max_tokens = 0), and while a step of the session runs
   but has not emitted its token (from its logits hook, or from a hook of a session before it
   in tl_session_step_batch, whose shared pass has replaced its rows). */
tl_status tl_session_logprobs(tl_session *session, int top, float *logprob, int32_t *top_ids, float *top_logprobs);

/* ---- many branches of one state: fork, save / resume, the prefix pool */

/* A new session continuing from the same state: tokens, KV cache, sampler position, text,
   stats. The child shares the parent's KV pages until one of them writes into a page (copy
   on write), so a fork costs a page table, not a prefill, and memory grows only with each
   side's own tokens. `hooks` may be NULL: the child keeps the parent's hooks and grammar,
   user pointers included (so a stateful grammar or hook is shared); otherwise the child
   takes the hook fields of *hooks (on_token, stop_rule, logits_processor, depth_policy, their user
   pointers, grammar) and nothing else from it. A compiled grammar is per session: the child
   gets its own copy of the parent's, at the parent's state (also when *hooks names that same
   compiled grammar, or the same rules compiled anew); another compiled grammar starts from
   its start. Any mode: within a speculative cycle too (the drafted tree, the verifier's rows
   and the accepted path are copied) and amid a beam search (its hypotheses, which hold their
   states of the parent's compiled grammar: *hooks may not name another), the child emits
   exactly what the parent would; a speculative or beam branch takes only the hooks its mode
   takes at its start (no depth_policy or callback grammar; a beam search no stop_rule), else
   TL_ERR_UNSUPPORTED. A finished session and one that is stepping are refused. */
tl_status tl_session_fork(const tl_session *parent, const tl_generate_config *hooks, tl_session **child);

/* A saved state (in memory): what tl_session_fork would copy, kept after the session is
   freed; resumed any number of times on the model that saved it (another model, even one
   loaded from the same directory, is refused). Freed before that model is. A speculative or
   beam session's state stays in memory: the bytes and files below hold plain decoding. */
typedef struct tl_session_state tl_session_state;
tl_status tl_session_save(const tl_session *session, tl_session_state **out);
tl_status tl_session_resume(const tl_model *model, const tl_session_state *state,
                            const tl_generate_config *hooks, tl_session **out);
void tl_session_state_free(tl_session_state *state); /* NULL is a no-op */

/* A saved state as bytes (*bytes freed with tl_free) or as a file (written beside `path`,
   then renamed over it: never half a file; a file it replaces keeps its mode), read back
   into a state of `model`, which must be the model that wrote it: its fingerprint
   (config.json, the weight files' headers, a sample of every tensor, the token texts) and its
   KV type are checked, and so is a checksum of the whole state (damaged or truncated:
   TL_ERR_FORMAT; another model: TL_ERR_INVALID_ARGUMENT).
   Written: the config's numbers and stop rules, tokens, sampler position, stats and every
   KV cache entry; not written: hooks (pass them to tl_session_resume) and the time spent
   saved (decode_ms continues where it stopped). A session under a compiled grammar is
   marked so, with a fingerprint of the grammar's rules but not the matcher's position: its
   resume must name the grammar again (hooks->grammar; compiled anew is the same), whose
   matcher then accepts the emitted tokens anew (another grammar, or none:
   TL_ERR_INVALID_ARGUMENT). A model on another backend than the CPU is refused
   (TL_ERR_UNSUPPORTED). A resumed state continues bit-identically to the session it was
   saved from. */
tl_status tl_session_state_to_bytes(const tl_session_state *state, void **bytes, size_t *len);
tl_status tl_session_state_from_bytes(const tl_model *model, const void *bytes, size_t len,
                                      tl_session_state **out);
tl_status tl_session_state_write(const tl_session_state *state, const char *path);
tl_status tl_session_state_read(const tl_model *model, const char *path, tl_session_state **out);
/* The state's tokens (prompt, then emitted) and its prompt length; valid while it lives. */
const int32_t *tl_session_state_tokens(const tl_session_state *state, int *n_tokens, int *prompt_len);

/* Opts a model into a prefix pool of at most budget_bytes of KV pages (> 0; calling again
   changes the budget). Then a new session (plain, speculative or beam search) whose prompt
   starts with a prefix another session has computed at the same depth shares that prefix's K/V
   (with cache_window W, the rows before W: those attend to every row before them)
   instead of recomputing it: bit-identical output, a shorter prefill
   (stats.prompt_tokens_reused); on a model whose loop starts from a random state, only a
   prefix computed under the same sample_seed. Least recently used entries leave first, at
   once when a call lowers the budget. Thread-safe. */
tl_status tl_model_set_prefix_pool(tl_model *model, int64_t budget_bytes);

/* The sequence so far: prompt + emitted tokens; valid until the next step or free. */
const int32_t *tl_session_tokens(const tl_session *session, int *n);
const tl_generate_stats *tl_session_stats(const tl_session *session);
/* The most bytes of K/V pages the session can hold before it ends: its prompt, max_tokens
   and the rows its mode adds (a speculative tree before compaction, every beam's tokens), or
   its window, in every layer instance of its depth (a page shared with a fork or the prefix
   pool counted as its own). The measure of a serving engine's kv_budget_bytes. 0 for NULL. */
int64_t tl_session_max_kv_bytes(const tl_session *session);

/* Text of the emitted tokens that became safe to show since the last call: bytes of an
   unfinished UTF-8 sequence and any suffix that may still grow into a stop string are held
   back until a later step (or the end) settles them. Special tokens (such as the
   end-of-text token) contribute no text. Needs a tokenizer. */
tl_status tl_session_text(tl_session *session, const char **piece, size_t *len);
/* 1 when the token's text is part of a session's text under config (tl_session_text, the
   text stop strings match): a token that is not special; a special one where
   config->keep_special_text keeps it, unless it ends generation (the end of text, unless
   ignore_eos; a one-token stop sequence). Else 0, also without a tokenizer, for ids out
   of range, and for a special token under a config whose keep_special_text, ignore_eos or
   stop_sequences tl_session_new would refuse. config NULL: the defaults
   (tl_generate_config_init). */
int tl_token_in_text(const tl_model *model, const tl_generate_config *config, int32_t id);
/* The session's config as tl_session_new, fork or resume set it (the hooks included, its
   arrays the session's own copies); valid as long as the session. */
const tl_generate_config *tl_session_config(const tl_session *session);

/* ---- blocking calls (SPEC §3): output = prompt + continuation, written to out, which must
   hold prompt_len + max_tokens tokens; *out_len receives the length. stats may be NULL. On a
   failure *out_len is left as it was; stats, where the generation had begun, hold what ran
   before it (stop_reason TL_STOP_NONE). */

tl_status tl_generate(const tl_model *model, const int32_t *prompt, int prompt_len,
                      const tl_generate_config *cfg, int32_t *out, int out_capacity,
                      int *out_len, tl_generate_stats *stats);

/* Called once per emitted token, in order; position = index of the token in the output
   (prompt_len for the first new token). Returning true goes on; false stops after including
   the token (stop reason TL_STOP_CALLBACK_ABORT). Unlike the hooks, it cannot report an
   error: it is the original API's bool(token, position). */
typedef bool (*tl_stream_fn)(void *user, int32_t token, int position);

tl_status tl_generate_stream(const tl_model *model, const int32_t *prompt, int prompt_len,
                             const tl_generate_config *cfg, tl_stream_fn on_token, void *user,
                             int32_t *out, int out_capacity, int *out_len,
                             tl_generate_stats *stats);

/* Each prompt decoded with a fresh cache, in any mode of the config; out receives the concatenation of every prompt +
   its continuation (capacity: sum of prompt lengths + n_prompts * max_tokens), out_lens[i]
   the length of sequence i, *out_len the total. stats, when not NULL, has n_prompts items.
   Every sequence calls the config's hooks with their one user pointer; a callback grammar
   (one sequence's state) is refused for more than one prompt: compile it (tl_grammar_use). */
tl_status tl_generate_batch(const tl_model *model, const tl_token_seq *prompts, int n_prompts,
                            const tl_generate_config *cfg, int32_t *out, int out_capacity,
                            int *out_lens, int *out_len, tl_generate_stats *stats);

/* ---- self-speculative decoding (SPEC §3): draft at a shallow loop depth with the same
   weights, verify in ONE forward at full depth. These blocking calls are loops over a session
   in speculative mode (tl_generate_config.speculative); `base` supplies the other fields. At temperature 0 the output is exactly
   tl_generate's at verify_loops (bit-exact); with temperature > 0 the chain uses speculative
   sampling, so the output *distribution* equals plain sampling at verify_loops. */

typedef struct tl_speculative_config {
    int max_tokens;          /* 64 */
    int draft_loops;         /* 2; 1 <= draft_loops < verify_loops */
    int verify_loops;        /* 8; <= max_loops */
    int draft_ahead;         /* 4; tokens (chain) or tree levels drafted per verify, 1..32 */
    float temperature;       /* 0.0: greedy */
    uint64_t seed;           /* 0 */
    /* Everything else (top_k, top_p, repetition_penalty, stop sequences and strings,
       ignore_eos, cache_window, hooks) comes from `base` when not NULL; its max_tokens,
       loops, temperature and sample_seed are ignored. Drafts use the raw logits with the
       repetition penalty; the logits_processor hook runs on the verifier's rows only, once
       per emitted token, as in plain decoding. Compiled grammars constrain drafts and
       verification alike; callback grammars, beam search and early exit are refused with
       TL_ERR_UNSUPPORTED. */
    const tl_generate_config *base;
} tl_speculative_config;

typedef struct tl_tree_speculative_config {
    tl_speculative_config spec;
    int K_branches;          /* 2; candidates kept per drafted node, 1..8 */
    int max_nodes;           /* 64; node budget of the tree (the full K-ary tree when it fits) */
} tl_tree_speculative_config;

void tl_speculative_config_init(tl_speculative_config *cfg);
void tl_tree_speculative_config_init(tl_tree_speculative_config *cfg);

typedef struct tl_speculative_stats {
    tl_generate_stats gen;   /* the usual stats (loops_used = verify_loops); its speculative
                                fields repeat the ones below */
    int drafted;             /* draft tokens (chain) or tree nodes proposed */
    int accepted;            /* of those, accepted by the verifier */
    int verify_steps;        /* verification forwards */
    double acceptance_rate;  /* accepted / drafted (chain); accepted / verify depth offered (tree) */
    double mean_accepted;    /* accepted draft tokens per verification */
    int draft_forwards;      /* forward passes at draft_loops */
    int verify_forwards;     /* forward passes at verify_loops (the prefill included) */
    double draft_ms, verify_ms;
} tl_speculative_stats;

tl_status tl_generate_speculative(const tl_model *model, const int32_t *prompt, int prompt_len,
                                  const tl_speculative_config *cfg, int32_t *out, int out_capacity,
                                  int *out_len, tl_speculative_stats *stats);
/* Greedy only (temperature must be <= 0.01): tree speculative sampling is not implemented. */
tl_status tl_generate_tree_speculative(const tl_model *model, const int32_t *prompt, int prompt_len,
                                       const tl_tree_speculative_config *cfg, int32_t *out,
                                       int out_capacity, int *out_len, tl_speculative_stats *stats);

/* ---------------------------------------------------------------- serving engine
   (engine/src/scheduler.c; used by the OpenResty server, lua/tinyloop/server/)
   An engine owns a thread that advances every session it holds together, one
   tl_session_step_batch per iteration (continuous batching: sessions join between
   iterations, finished and cancelled ones leave). Requests are named by integer ids so
   that other threads (nginx's thread pool) can wait on them through the FFI. Every
   function is thread-safe; a request id is used by one caller at a time. On a model with a
   prefix pool, a request takes at its admission what the pool was given while it waited, and
   one that shares at least 16 rows of its prompt with a running request still prefilling it
   waits for that prefill (counters.prefill_waiting) rather than compute the rows beside it. */

typedef struct tl_engine tl_engine;

typedef struct tl_engine_options {
    int max_active;  /* 8; sessions stepped together at most, 1 .. 4096 */
    int max_queued;  /* 32; submitted sessions waiting for a place, 0 .. 1048576 */
    int step_rows;   /* -1 (auto); rows one iteration forwards at most: one per running request,
                        and what they leave for prompts not yet in their caches (chunked
                        prefill, tl_step_batch_options.prompt_rows). A long prompt is prefilled
                        over several iterations, the running requests emitting a token in each,
                        so it delays their next token (and a cancel) by one chunk, not by its
                        whole prefill. -1: tl_engine_auto_step_rows(max_active); 0: no limit;
                        otherwise more than max_active. */
    int64_t kv_budget_bytes; /* 0 (none); else the K/V memory the running requests may hold at
                        most, each counted at its tl_session_max_kv_bytes: a queued request
                        starts when its share fits beside the running ones' (in submit order:
                        one that waits for memory holds back those after it, so that a large
                        request is not passed over for good), and a session whose share alone
                        is over the budget is refused at submit. Memory is what an engine of a
                        large looped model runs out of first (Huginn-0125 at 32 loops holds
                        5.6 MB of K/V a token), and a process the kernel kills for it loses
                        every request; the prefix pool's pages are its own budget besides. */
} tl_engine_options;

void tl_engine_options_init(tl_engine_options *opts);
/* The step_rows that -1 stands for: the smallest multiple of 64 (one forward pass each) that
   leaves prompts at least 32 rows when all max_active places run: 64 for max_active <= 32,
   128 up to 96, and so on. */
int tl_engine_auto_step_rows(int max_active);

/* Starts the engine thread. The model must outlive the engine. A child that fork() made
   after it holds the engine without its thread: there submit and read are refused (the
   message names the fork), wait answers -1, cancel does nothing, the counters are as forked,
   and tl_engine_free frees it (a request it was stepping stays allocated). */
tl_status tl_engine_new(const tl_model *model, const tl_engine_options *opts, tl_engine **out);
/* Stops the thread, frees every session and request, and returns once no tl_engine_wait
   is inside the engine any more (they return -1). NULL is a no-op. From a hook of a
   session the engine steps (on its thread) it only stops the engine, as tl_engine_stop does
   there: the owner's tl_engine_free still frees it. */
void tl_engine_free(tl_engine *engine);
/* What tl_engine_free does, without freeing the engine itself: afterwards every call on it
   is answered (wait -1, read and submit refused, cancel a no-op, the counters as they were),
   so that a thread that was about to wait when the owner stopped the engine (a server's
   handler when its worker exits) finds "gone" rather than freed memory. Called again, or
   followed by tl_engine_free, it does nothing more. Not from two threads at once. From a
   hook of a session the engine steps, it asks the stop and returns at once: the engine
   records nothing of that step, and its requests are freed by the owner's later stop or
   free (the thread cannot wait for itself, nor free the sessions it is stepping). */
void tl_engine_stop(tl_engine *engine);

/* Hands a session to the engine: a fresh one, or one stepped by hand this far, which goes on
   from where it is, max_tokens counting every token (the updates carry the tokens the
   engine's steps make, and the text tl_session_text had not yet handed out: the earlier
   tokens' too, where the caller did not take it); its hooks, if any, run on the engine
   thread, so they must be safe to run there (a Lua hook is not: LuaJIT's state is the
   caller's thread's). On TL_OK with *id > 0 the engine owns the session. When active and queued
   sessions are at their limits it returns TL_OK with *id = 0 and the caller keeps the
   session (a server answers 503 and the caller frees it). Owned by the engine, the session
   is freed by it when the request ends: do not use or free the pointer after a successful
   submit (tl_engine_cancel ends a request early). A session of another model, a
   finished or stepping one, or one already submitted (to this engine or another) is refused
   (TL_ERR_INVALID_ARGUMENT, the caller keeps it): stepped in a batch it would fail every
   running request. A cancel (tl_engine_cancel) ends a running request before its next step;
   a beam search, whose one step may search many levels, stops between them. */
tl_status tl_engine_submit(tl_engine *engine, tl_session *session, uint64_t *id);

/* What a request asks of the engine beyond its tokens. */
typedef struct tl_engine_request_options {
    int logprobs;           /* -1 (default): none; 0..TL_MAX_TOP_LOGPROBS: each token's
                               log-probability (tl_session_logprobs) and this many most
                               likely alternatives, in the updates (not beam sessions) */
} tl_engine_request_options;
void tl_engine_request_options_init(tl_engine_request_options *opts);
/* tl_engine_submit with options (NULL: the defaults); logprobs out of range, or asked of a
   beam session, is refused (TL_ERR_INVALID_ARGUMENT, the caller keeps it). */
tl_status tl_engine_submit_with(tl_engine *engine, tl_session *session, const tl_engine_request_options *opts,
                                uint64_t *id);

/* Blocks until request `id` has output not yet read or has finished (1), timeout_ms
   passes (0), or the id is unknown: cancelled, never submitted, or the engine is stopping
   (-1). Only its own request wakes it, not other requests' steps; timeout_ms 0 polls. */
int tl_engine_wait(tl_engine *engine, uint64_t id, int timeout_ms);

typedef enum tl_engine_state {
    TL_ENGINE_QUEUED = 0,
    TL_ENGINE_RUNNING = 1,
    TL_ENGINE_FINISHED = 2
} tl_engine_state;

/* What a request produced since its previous read. text/tokens stay valid until the next
   read or cancel of this id. Once state is TL_ENGINE_FINISHED: stop_reason, status (TL_OK,
   or why a step failed, with the message in error) and stats (a copy of the session's; the
   session itself is already freed) are final. Before, stats holds prompt_tokens_reused only
   (what the prefix pool gave the prompt: at submit, and what a running request's prefill of
   the same prompt gave it as it started, final once RUNNING), the rest 0. */
typedef struct tl_engine_update {
    tl_engine_state state;
    const char *text;       /* tl_session_text pieces ("" without a tokenizer) */
    size_t text_len;
    const int32_t *tokens;  /* emitted token ids */
    int n_tokens;
    /* With logprobs >= 0 (tl_engine_submit_with), else NULL: each token's log-probability
       [n_tokens], and its n_top alternatives (= the request's logprobs) at [i * n_top + j] */
    const float *logprobs;
    const int32_t *top_ids;
    const float *top_logprobs;
    int n_top;
    tl_stop_reason stop_reason;
    tl_status status;
    const char *error;
    tl_generate_stats stats;
} tl_engine_update;

/* Never blocks (beyond the engine's lock). TL_ERR_INVALID_ARGUMENT for an unknown id. */
tl_status tl_engine_read(tl_engine *engine, uint64_t id, tl_engine_update *update);

/* The caller is done with request `id` (always call it once, finished or not): a queued or
   running generation stops before its next step (at most the step in flight completes)
   and is counted as cancelled; its session and buffers are freed. Unknown ids are ignored. */
void tl_engine_cancel(tl_engine *engine, uint64_t id);

typedef struct tl_engine_counters {
    int active, queued;          /* sessions held now */
    int finished_held;           /* requests that finished (no longer active) and that their caller
                                    holds still: no tl_engine_cancel yet (a server's handler reading
                                    the end, which an exiting worker must wait for) */
    int max_active, max_queued;
    uint64_t submitted, finished, cancelled, failed, rejected; /* finished: every request that ended
                                    on the engine thread, its `failed` ones included; cancelled: those
                                    the caller dropped first; rejected: submit when full */
    uint64_t iterations, rows;   /* batched steps, and the session-steps they carried (a prompt chunk
                                    that emitted nothing counts in partial_prefills instead) */
    uint64_t steps_after_cancel; /* steps sessions made after their cancel (the one in flight) */
    uint64_t partial_prefills;   /* session-steps that forwarded part of a prompt and emitted nothing
                                    (step_rows cut it; a prompt that waited for the rows others took,
                                    forwarding none, counts in neither) */
    uint64_t waiter_wakeups;     /* times a sleeping tl_engine_wait woke (its request's output, finish
                                    or cancel, the engine's stop, its timeout): not once per step */
    int64_t kv_budget_bytes;     /* the option (0: none) */
    int64_t kv_reserved_bytes;   /* the running requests' tl_session_max_kv_bytes, summed */
    int kv_waiting;              /* queued requests that a free place would not start: the first
                                    one's share does not fit the budget beside the running ones' */
    int prefill_waiting;         /* queued requests that wait for a running one's prefill of the
                                    prompt they share (at least a page of 16 rows), to take those
                                    rows from the model's prefix pool rather than compute them too */
} tl_engine_counters;

/* The engine's counters now (engine NULL: zeros, as tl_model_get_memory's). */
void tl_engine_get_counters(tl_engine *engine, tl_engine_counters *counters);

/* ---------------------------------------------------------------- grammars
   A grammar is compiled once, independent of any model, and may be shared by any number of
   sessions and threads (its caches are locked). Text is matched as bytes of UTF-8.
     - GBNF: llama.cpp's dialect; the start rule is `root`. Errors give "line L, column C",
       what was expected and the rule, and flag undefined rules, left recursion and an empty
       grammar.
     - JSON Schema: converted to GBNF (tl_json_schema_to_gbnf shows it); a keyword outside the
       supported subset is an error naming it.
     - Regular expressions: converted to GBNF as well (tl_regex_to_gbnf).
   In a tl_generate_config: `tl_grammar g; tl_grammar_use(&g, compiled); cfg.grammar = &g;`.
   A session keeps the compiled grammar alive (reference counted), so it may be freed at once.
   The end of the sequence (eos_token_id) is allowed exactly where the grammar may end. */

typedef struct tl_compiled_grammar tl_compiled_grammar;

tl_status tl_grammar_compile_gbnf(const char *text, size_t len, tl_compiled_grammar **out);

typedef struct tl_json_schema_options {
    int free_whitespace; /* 0 (default): compact JSON; 1: whitespace allowed between tokens */
    int loose;           /* 0 (default): a keyword outside the subset is an error; 1: keywords
                            that only narrow a value are not enforced, so the grammar allows a
                            superset of the schema: an unknown string format (any string),
                            a multipleOf other than 1 or a power of ten below it, uniqueItems,
                            min/maxProperties, contains, if/then/else,
                            not, propertyNames, dependentRequired/Schemas, unevaluated*, a
                            string's min/maxLength beside a pattern or a format, a type beside
                            anyOf/oneOf/allOf, and a bound that is not a number below 2^53 in
                            magnitude (the others are enforced). For schemas given without OpenAI's strict: true (a
                            tool's parameters), where refusing the request helps nobody */
} tl_json_schema_options;

/* schema: a JSON document (len bytes); opts may be NULL. */
tl_status tl_grammar_compile_json_schema(const char *schema, size_t len, const tl_json_schema_options *opts,
                                         tl_compiled_grammar **out);
/* The GBNF a schema compiles to (*gbnf freed with tl_free). */
tl_status tl_json_schema_to_gbnf(const char *schema, size_t len, const tl_json_schema_options *opts, char **gbnf,
                                 size_t *gbnf_len);
/* A regular expression (len bytes) that the whole generated text matches: vLLM's `regex`
   structured output. ECMA-262 syntax, the subset a matcher can follow exactly: literals,
   '.', classes, \d \w \s \D \W \S, \n \r \t \f \v \0 \xHH \uHHHH, groups (named ones
   too), '|', * + ? {m} {m,} {m,n} (n <= 1000; lazy ones read as greedy: the same texts
   match); ^ and $ at the start and end of the pattern or of a top-level alternative (the
   whole text matches anyway). Lookaround, backreferences, \b, possessive quantifiers,
   inline flags and anchors elsewhere are errors naming them. */
tl_status tl_grammar_compile_regex(const char *pattern, size_t len, tl_compiled_grammar **out);
/* The GBNF a regular expression compiles to (*gbnf freed with tl_free). */
tl_status tl_regex_to_gbnf(const char *pattern, size_t len, char **gbnf, size_t *gbnf_len);
/* A grammar that leaves the text free until it contains `trigger` (len bytes, 1 to 256), then
   constrains what follows the trigger to g, after at most max_blanks (0 to 16) blanks:
   spaces, tabs, newlines. The text may also end before the trigger. For thinking models:
   after "</think>" the reasoning runs free and the answer is written under g (vLLM's
   structured outputs with a reasoning parser); for tool calls, after "<tool_call>" (llama.cpp's
   lazy grammar). Exact like any grammar: a token that spans the trigger is allowed only where
   what it writes after the trigger can begin a sentence of g. g may be freed afterwards. */
tl_status tl_grammar_compile_after(const tl_compiled_grammar *g, const char *trigger, size_t len, int max_blanks,
                                   tl_compiled_grammar **out);

/* An optional block, then g: at most max_blanks blanks, `open`, text without `close`, `close`
   and at most max_blanks blanks, or none of it, then a sentence of g (open and close: 1 to 256
   bytes). The text may also end inside the block (as `after`'s may before its trigger). For
   thinking models whose template leaves the block to them (Qwen3's): "<think>" ... "</think>"
   runs free when the model writes one, then g writes the answer. */
tl_status tl_grammar_compile_after_block(const tl_compiled_grammar *g, const char *open, const char *close, int max_blanks,
                                         tl_compiled_grammar **out);

/* Free text and the grammars it opens: xgrammar's triggered tags (vLLM's structural_tag). The
   text is free until one of the triggers appears; from there it is one of the tags whose
   begin starts with that trigger (the rest of its begin, after at most max_blanks blanks a
   sentence of its content, then its end), and then free text again, or the end of the text
   (ends_text). Otherwise the text may end only in free text. triggers: 1 to 64 strings of 1
   to 256 bytes; every tag's begin (1 to 256 tags) starts with one of them. The contents may
   be freed afterwards. */
typedef struct tl_grammar_tag {
    const char *begin;                  /* starts with a trigger */
    const tl_compiled_grammar *content; /* what the tag holds */
    const char *end;                    /* "" for none */
    int ends_text;                      /* 1: nothing follows this tag */
} tl_grammar_tag;
typedef struct tl_grammar_tags_options {
    int max_blanks;   /* 0 (default) to 16: blanks allowed between a begin and its content */
    int at_least_one; /* 1: the text holds a tag (it may not end before one) */
    int tag_first;    /* 1: the text begins with a tag, no free text before it (xgrammar's
                         at_least_one); a tag is there then, whatever at_least_one says */
} tl_grammar_tags_options;
tl_status tl_grammar_compile_tags(const tl_grammar_tag *tags, int n_tags, const char *const *triggers, int n_triggers,
                                  const tl_grammar_tags_options *opts, tl_compiled_grammar **out); /* opts may be NULL */
void tl_compiled_grammar_free(tl_compiled_grammar *g); /* NULL is a no-op */
/* Adds a reference: a grammar is freed by the tl_compiled_grammar_free that drops its last
   (the compiler's is one; each session and matcher holds its own). For handing a grammar
   from one owner to another, as from a thread that compiled it (thread-safe). NULL is a no-op. */
void tl_compiled_grammar_retain(const tl_compiled_grammar *g);
/* *match = 1 when the whole text is a sentence of the grammar. */
tl_status tl_grammar_matches(const tl_compiled_grammar *g, const char *text, size_t len, int *match);
/* *match = 1 when the grammar has not rejected the text: every byte of it was allowed (a partial
   output that may go on; where a grammar has dead ends, a trigger that opens nothing, say, it
   may still fail later). */
tl_status tl_grammar_matches_prefix(const tl_compiled_grammar *g, const char *text, size_t len, int *match);
/* Size of the compiled form (rules, elements), for diagnostics. */
tl_status tl_grammar_rule_count(const tl_compiled_grammar *g, int *rules, int *elements);
/* What a compiled grammar holds in memory now. Its tables (the stacks and states documents have
   met) and cached masks grow with use; past a budget (128 MiB of tables, 64 MiB of masks per
   vocabulary) the next matcher starts a new generation, and an old one is freed with its last
   matcher. A cache of grammars (a server's) bounds their sum with this. */
typedef struct tl_grammar_memory {
    size_t program_bytes;    /* the compiled rules */
    size_t table_bytes;      /* interned stacks, states and transitions, every live generation */
    size_t mask_bytes;       /* cached masks, every live generation and vocabulary */
    size_t vocab_bytes;      /* the vocabulary tries it is bound to: shared by every grammar used
                                with the same tokenizer, so not its own */
    size_t own_bytes;        /* program + tables + masks: what freeing the grammar (and its
                                matchers) gives back */
    int generations;         /* live generations of tables (1, more while old matchers run) */
    int64_t restarts;        /* how many times the tables started a new generation */
} tl_grammar_memory;
/* It never waits for a grammar in use (another thread computing a mask under it): it then
   answers the figures it found last. */
tl_status tl_grammar_memory_usage(const tl_compiled_grammar *g, tl_grammar_memory *out);
/* Gives back the memory of g's tables and cached masks now (a cache dropping g while requests
   may still hold it): new matchers start on fresh tables; running ones keep theirs until they are
   freed. g stays valid, and its languages do not change. */
tl_status tl_grammar_trim(const tl_compiled_grammar *g);
/* Fills *grammar to constrain a generation config with g. */
void tl_grammar_use(tl_grammar *grammar, const tl_compiled_grammar *g);

/* A matcher: the grammar's state over one model's tokens, for callers driving their own loop.
   mask writes allowed[vocab_size] (1 = allowed) and the count (0: dead end); accept advances by
   one token (TL_ERR_INVALID_ARGUMENT when it is not allowed); rollback undoes the last
   n_tokens accepted tokens. */
typedef struct tl_grammar_matcher tl_grammar_matcher;
tl_status tl_grammar_matcher_new(const tl_compiled_grammar *g, const tl_model *model, tl_grammar_matcher **out);
tl_status tl_grammar_matcher_mask(tl_grammar_matcher *m, uint8_t *allowed, int vocab_size, int *count);
tl_status tl_grammar_matcher_accepts(tl_grammar_matcher *m, int32_t token, int *ok);
tl_status tl_grammar_matcher_accept(tl_grammar_matcher *m, int32_t token);
tl_status tl_grammar_matcher_rollback(tl_grammar_matcher *m, int n_tokens);
int tl_grammar_matcher_is_accepting(const tl_grammar_matcher *m); /* the text so far is a sentence */
void tl_grammar_matcher_free(tl_grammar_matcher *m);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif
#endif /* TINYLOOP_H */

/* session.h: the one decode state machine (SPEC §3) and the decoding modes that run on it.
 *
 * A step is: the mode finds the next token (running whatever forward passes it needs and
 * choosing through tl_session_choose), then tl_session_emit appends it and runs the hooks and
 * stop checks. Modes differ only in how they find tokens:
 *     plain        forward the pending token (early exit optional), choose      session.c
 *     speculative  draft a chain or tree, verify it in one forward, then hand out   speculative.c
 *                  the verified run one token per step
 *     beam         advance every beam in one forward until a token is settled   beam.c
 * Every blocking call (generate.c) is a loop over tl_session_step. */
#ifndef TL_SESSION_H
#define TL_SESSION_H

#include "forward.h"
#include "sampler.h"

typedef struct tl_decoder {
    const char *name;
    /* Allocates the mode's state (s->mode_state) and the session's cache. */
    tl_status (*open)(tl_session *s);
    /* Finds the next token: *token = -1 when nothing is allowed (dead end). */
    tl_status (*next)(tl_session *s, int32_t *token);
    void (*close)(tl_session *s);
    /* How many of the cache's first rows hold s->tokens in order, one row a token (what a
       prefill of those tokens computes, so the prefix pool may keep them); NULL: all of
       them. A beam search's cache is a tree past its prompt, and a speculative cycle's rows
       are its drafted tree until the accepted path is compacted. */
    int (*sequence_rows)(const tl_session *s);
    /* Gives dst (a copy of src whose cache shares src's pages and whose grammar is in place:
       fork.c) a copy of src's mode state, so that it continues exactly as src would; NULL
       for plain decoding, which has none. */
    tl_status (*clone)(tl_session *dst, const tl_session *src);
} tl_decoder;

extern const tl_decoder tl_plain_decoder;
extern const tl_decoder tl_speculative_decoder; /* speculative.c */
extern const tl_decoder tl_beam_decoder;        /* beam.c */

struct tl_session {
    const tl_model *m;
    tl_generate_config cfg;      /* validated copy; stop_sequences point into stop_store */
    tl_grammar grammar;          /* copy of *cfg->grammar; cfg.grammar points here */
    tl_token_seq *stop_seqs;     /* [n_stop_sequences] */
    int32_t *stop_store;         /* the stop sequences' tokens */
    int loops;                   /* resolved depth (the verify depth of speculative modes) */
    int greedy;
    const tl_decoder *decoder;
    void *mode_state;            /* the decoder's own state */

    tl_kv_cache *cache;
    tl_workspace ws;
    int32_t *tokens;             /* [prompt_len + max_tokens] prompt, then emitted */
    int32_t *positions;          /* [prompt_len + max_tokens] 0, 1, 2, ... */
    int n_tokens, prompt_len;
    int chunk;                   /* most prompt rows per forward */

    float *logits;               /* [vocab] next-token logits from the last forward */
    float *work;                 /* [vocab] logits after hooks, penalty and grammar mask */
    int32_t *tally;              /* [vocab] zeroed scratch of the logit adjustments (tl_adjust_logits) */
    tl_logit_bias *logit_bias;   /* the config's logit_bias, owned (cfg.logit_bias points here) */
    uint8_t *allowed;            /* [vocab] grammar mask */
    double *probe_logp;          /* [vocab] early exit: the previous probe's log-softmax
                                    (early_exit.c), allocated at its first use */
    double *logprob_scratch;     /* [vocab] tl_session_logprobs' log-softmax, at its first use */
    const float *chosen_row;     /* [vocab] the raw logits the last step's token was chosen
                                    from (plain: s->logits; speculative: its verification
                                    row, kept until the next step), or NULL: no token emitted,
                                    or beam search (whose rows are not kept) */
    tl_distribution dist;
    tl_rng rng;

    /* Generated text (with a tokenizer): stop strings and tl_session_text work on it. */
    char *text;                  /* [text_cap] bytes of the emitted tokens */
    size_t text_len, text_cap, text_shown;
    char **stop_strs;            /* [n_stop_strings] copies */
    size_t *stop_lens;
    size_t *stop_borders;        /* [tl_session_borders_len] each stop string's border table, one
                                    after another (stop_border_table; held_back reads them) */

    tl_generate_stats stats;
    double t_start, t_prefill_start, t_prefill_end, loops_sum; /* (t_prefill_start: 0 until its first row) */
    int prefill_first_row; /* the cache's rows when the prefill's clock started (the pool's, or a
                              state's read mid-prompt): not computed in prefill_ms */
    int last_depth;              /* loop depth of the forward that produced the chosen row */
    bool finished;
    bool prompt_done;            /* the prompt's rows are in the cache (prefill is over) */
    int batch_prompt_rows;       /* rows of its prompt the last batched step that shared it out
                                    gave it (0: none; the serving engine counts a chunk by it) */
    bool rows_from_bytes;        /* some of its K/V rows came from a saved state's bytes
                                    (state_file.c), which only a checksum guards: none is ever
                                    offered to the prefix pool, where other sessions would read
                                    them (forks keep it) */
    bool stepping;               /* inside tl_session_step: hooks may not step or free (TL_STEPPING_WHERE) */
    atomic_bool free_requested;  /* tl_session_free from a hook (done when the step returns),
                                    or of a session a serving engine holds (done by the engine,
                                    which ends its request) */
    atomic_bool engine_claimed;  /* submitted to a serving engine (scheduler.c): the engine
                                    alone frees it; a second submit is refused */
    atomic_bool stop_requested;  /* the engine's cancel: a mode that searches inside one step
                                    (beam search) leaves it early */
    char error[TL_ERROR_MAX];    /* the message of the step that failed (tl_session_error), or "" */

    /* ---- grammar (grammar_mask.c): a compiled grammar runs as this session's own matcher,
       whose callbacks fill s->grammar; forced_token is the one token a mask allowed (-1). */
    struct tl_grammar_matcher *grammar_matcher;
    int32_t forced_token;
    bool grammar_replay;         /* a state read from a file, generated under a compiled
                                    grammar whose position the file does not hold: a resume
                                    names the grammar and replays the emitted tokens (fork.c) */
    uint64_t grammar_fingerprint; /* with grammar_replay: that grammar's fingerprint (grammar.h),
                                    which the named one must have; 0 in a file before version 7 */

    /* ---- the thinking budget (cfg.reasoning_budget): whether a block is open, the tokens it
       holds, and how many of reasoning_end's ids the budget has forced (-1: not forcing).
       reasoning_ids holds the session's copies of the tags, which cfg points at. */
    bool reasoning_inside;
    int reasoning_tokens;
    int reasoning_forced;
    int32_t reasoning_ids[2][TL_MAX_REASONING_TAG];
    /* The tags' bytes (len 0: found by their ids alone: no tokenizer, a special token among
       them, or over 256 bytes): a tag is found where the generated text holds it, however the
       model's ids spelled it, or where the ids end with the tag's. */
    char reasoning_tag_bytes[2][256];
    size_t reasoning_tag_len[2];

    /* Set by tl_generate_stream: its callback runs inside the step like on_token. */
    tl_stream_fn stream_fn;
    void *stream_user;
};

/* A saved state: a clone of the session that is never stepped, only cloned from (fork.c). */
struct tl_session_state {
    tl_session *frozen;
    double saved_at; /* tl_now_ms() when saved: the time spent saved is not the session's */
};

/* tl_session_new minus the public entry's error bookkeeping (generate.c builds on it). */
tl_status tl_session_create(const tl_model *m, const int32_t *prompt, int prompt_len,
                            const tl_generate_config *cfg, tl_session **out);
/* The same with the decoder forced (tests: beam width 1 through the beam machinery). */
tl_status tl_session_create_with(const tl_decoder *decoder, const tl_model *m, const int32_t *prompt,
                                 int prompt_len, const tl_generate_config *cfg, tl_session **out);

/* ---- for the decoders */

/* A cache for the whole sequence plus `headroom` rows that one forward may add beyond it
   (a speculative tree before compaction), taking chunks of up to max(chunk, headroom). */
tl_status tl_session_cache_new(tl_session *s, int headroom);
/* The new cache's first rows from the model's prefix pool, if it has one: the longest pooled
   prefix of the prompt at the session's depth, all but the prompt's last token at most
   (plain decoding needs that token's logits; speculative decoding and beam search take it
   into their first step). Every decoder's prompt rows are plain rows at full depth, so a
   prefix any of them computed serves all of them. */
void tl_session_take_prefix(tl_session *s);
/* The same later (a serving engine's admission), for a session that has not begun its
   prefill and holds only rows the pool gave it: where the pool now holds a longer prefix of
   its prompt (a prefill another request of it finished while this one waited), it lets its
   rows go and takes that one. */
void tl_session_take_prefix_late(tl_session *s);
/* What such a session (else -1) could hold of its prompt without computing it: its rows, or
   the pool's longest prefix now. */
int tl_session_prefix_reach(const tl_session *s);
/* How many rows of waiting's prompt (all but its last token; with a window W, those before W) a
   prefill of running's prompt will give the pool as it is done (with a window, the rows before
   it, where its ring still holds them): their common prefix, where running is still
   prefilling on the same model at the same depth and initial state seed, its rows its own;
   else 0. */
int tl_session_prompt_rows_shared(const tl_session *waiting, const tl_session *running);
/* Forwards the prompt's tokens up to index n (from what the cache already holds: a prefix
   from the pool), timing the prefill. */
tl_status tl_session_prefill(tl_session *s, int n, float *last_logits);
/* s->work = `row` after the logits hook, the repetition penalty and the grammar mask, for the
   history `history[0..n)` (s->tokens for plain decoding; a beam's own history for beams). A
   row holding a NaN (the model's activations overflowed) fails, the session finished. */
tl_status tl_session_prepare_logits_for(tl_session *s, const float *row, const int32_t *history, int n);
/* The buffers hooks write (s->work, the logits hook's; s->allowed, a callback grammar's
   mask): `bytes` with guard bytes on both sides, which tl_session_prepare_logits_for checks
   after each hook (a write just outside fails the session, where it would have corrupted the
   heap). Freed by tl_session_hook_buffer_free (NULL: nothing). */
void *tl_session_hook_buffer_new(size_t bytes);
void tl_session_hook_buffer_free(void *buffer);
/* Whether the session keeps the row each token was chosen from (s->chosen_row), for
   tl_session_logprobs: plain and speculative decoding; beam search does not. */
static inline bool tl_session_keeps_rows(const tl_session *s) { return s->decoder != &tl_beam_decoder; }
static inline tl_status tl_session_prepare_logits(tl_session *s, const float *row) {
    return tl_session_prepare_logits_for(s, row, s->tokens, s->n_tokens);
}
/* The length of s->stop_borders: the sum of the stop strings' lengths. */
static inline size_t tl_session_borders_len(const tl_session *s) {
    size_t len = 0;
    for (int i = 0; i < s->cfg.n_stop_strings; i++) len += s->stop_lens[i];
    return len;
}
/* Whether the generated text holds bytes[0..len) ending in what came after its first `old`
   bytes (a stop string or a reasoning tag the last token completed; len 0: never). */
bool tl_session_text_ends_in_new(const tl_session *s, const char *bytes, size_t len, size_t old);
/* The thinking budget's bookkeeping after s->tokens[s->n_tokens - 1] joined the tokens and
   its bytes the text (which was old_text_len bytes long before them): tl_session_emit; a
   state read from a file replays its tokens through it. */
void tl_session_track_reasoning(tl_session *s, size_t old_text_len);
/* Points s->cfg's reasoning tags at the session's own copies of them (creation, clones). */
void tl_session_own_reasoning_tags(tl_session *s, const tl_generate_config *from);
/* Picks a token from s->work: greedy argmax, or a draw from the temperature / top-k / top-p
   distribution (left in s->dist). -1 when nothing is allowed. */
int32_t tl_session_choose(tl_session *s);
/* Forwards the one pending decode token at s->tokens[start], choosing its depth loop by
   loop (early_exit.c): logits in s->logits, the depth in s->last_depth. */
tl_status tl_session_forward_adaptive(tl_session *s, int start);
/* A hook returned `code` < 0: the session is finished, TL_ERR_HOOK names the hook. */
tl_status tl_session_hook_failed(tl_session *s, const char *hook, int code);

/* Where a call that finds its session stepping came from, as its refusals say. */
#define TL_STEPPING_WHERE "called from a hook of its own step, or of a batched step it is in"

/* Why tl_session_step_batch would refuse s in a batch of model m ("on another model",
   "finished", "stepping"), or NULL: the one rule, also the serving engine's at submit. */
const char *tl_session_batch_refusal(const tl_session *s, const tl_model *m);
/* A serving engine's hold on a session (scheduler.c): tl_session_claim takes it (false: some
   engine holds it already); while held, tl_session_free only asks the engine to end it
   (free_requested). tl_session_unclaim gives it up (a submit that refuses it after all),
   tl_session_release_claimed gives it up and frees the session. */
bool tl_session_claim(tl_session *s);
void tl_session_unclaim(tl_session *s);
void tl_session_release_claimed(tl_session *s);
/* Gives the session grammar g (copied; a compiled grammar gets the session's own matcher,
   at its start). */
tl_status tl_session_set_grammar(tl_session *s, const tl_grammar *g);
/* Appends the token's bytes to the generated text (special tokens have none); *matched
   tells whether a stop string now ends inside them. */
tl_status tl_session_append_text(tl_session *s, int32_t tok, bool *matched);
/* The config's own stop rules (end of text, stop sequences, a stop string: stop_string says
   whether one ended in the token's text) for the emitted token s->tokens[n - 1]; the hooks'
   and max_tokens are tl_session_emit's. TL_STOP_NONE: go on. */
tl_stop_reason tl_session_rule_stop(const tl_session *s, int n, bool stop_string);
/* Appends a chosen token (-1: nothing allowed) and runs hooks and stop checks; *stop tells
   whether generation ended. */
tl_status tl_session_emit(tl_session *s, int32_t token, tl_stop_reason *stop);

#endif

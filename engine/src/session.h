/* session.h: internals of tl_session shared with the blocking calls (generate.c). */
#ifndef TL_SESSION_H
#define TL_SESSION_H

#include "forward.h"
#include "sampler.h"

struct tl_session {
    const tl_model *m;
    tl_generate_config cfg;      /* validated copy; stop_sequences point into stop_store */
    tl_grammar grammar;          /* copy of *cfg->grammar; cfg.grammar points here */
    tl_token_seq *stop_seqs;     /* [n_stop_sequences] */
    int32_t *stop_store;         /* the stop sequences' tokens */
    int loops;                   /* resolved depth */
    int greedy;

    tl_kv_cache *cache;
    tl_workspace ws;
    int32_t *tokens;             /* [prompt_len + max_tokens] prompt, then emitted */
    int32_t *positions;          /* [prompt_len + max_tokens] 0, 1, 2, ... */
    int n_tokens, prompt_len;
    int chunk;                   /* most prompt rows per forward */

    float *logits;               /* [vocab] next-token logits from the last forward */
    float *work;                 /* [vocab] logits after hooks, penalty and grammar mask */
    uint8_t *seen;               /* [vocab] zeroed scratch of the repetition penalty */
    uint8_t *allowed;            /* [vocab] grammar mask */
    tl_distribution dist;
    tl_rng rng;

    /* Generated text (with a tokenizer): stop strings and tl_session_text work on it. */
    char *text;                  /* [text_cap] bytes of the emitted tokens */
    size_t text_len, text_cap, text_shown;
    char **stop_strs;            /* [n_stop_strings] copies */
    size_t *stop_lens;
    size_t max_stop_len;

    tl_generate_stats stats;
    double t_start, t_prefill_end, loops_sum;
    int last_depth;              /* loop depth of the forward that produced s->logits */
    bool finished;

    /* Set by tl_generate_stream: its callback runs inside the step like on_token. */
    tl_stream_fn stream_fn;
    void *stream_user;
};

/* Every rule of SPEC §3 for (model, prompt, config); the message names field and value. */
tl_status tl_generate_validate(const tl_model *m, const int32_t *prompt, int prompt_len,
                               const tl_generate_config *cfg);

/* Shared with the speculative decoders (speculative.c): */

/* tl_session_new with a cache that accepts forwards of min_chunk rows (tree verification). */
tl_status tl_session_create(const tl_model *m, const int32_t *prompt, int prompt_len,
                            const tl_generate_config *cfg, int min_chunk, tl_session **out);

/* s->work = the row after the logits hook, repetition penalty and grammar mask, for the
   history s->tokens (exactly what plain decoding would see at this point). */
tl_status tl_session_prepare_logits(tl_session *s, const float *row);
/* Appends a chosen token (-1: nothing allowed) and runs hooks and stop checks, exactly as
   a plain step does; *stop tells whether generation ended. */
tl_status tl_session_emit(tl_session *s, int32_t token, tl_stop_reason *stop);

#endif

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
    bool finished;

    /* Set by tl_generate_stream: its callback runs inside the step like on_token. */
    tl_stream_fn stream_fn;
    void *stream_user;
};

#endif

/* sampler.h: turning logits into a token (SPEC §3 order: repetition penalty, temperature,
 * top-k, top-p, then a draw from our own seeded generator). */
#ifndef TL_SAMPLER_H
#define TL_SAMPLER_H

#include <limits.h>

#include "internal.h"

/* xoshiro256**, seeded through splitmix64: the same seed gives the same stream on every
   machine, whatever the thread count. */
typedef struct tl_rng { uint64_t s[4]; } tl_rng;
void tl_rng_seed(tl_rng *rng, uint64_t seed);
uint64_t tl_rng_next(tl_rng *rng);
double tl_rng_uniform(tl_rng *rng); /* [0, 1), 53 random bits */

/* Hugging Face convention, once per distinct id in ids[0..n): a positive logit is divided
   by `penalty`, a negative one multiplied. `tally` is vocab int32 of zeroed scratch, left
   zeroed. */
void tl_repetition_penalty(float *logits, const int32_t *ids, int n, float penalty, int32_t *tally);

/* A config's adjustments of one step's logits, in the order tinyloop.h documents:
   logit_bias, the repetition penalty over history[0..n), then the presence and frequency
   penalties over its generated part history[prompt_len..n) (logit -= count * frequency +
   presence, once per distinct token; over all of history with penalties_count_prompt),
   both over the last penalty_window tokens only when it is set, and last min_tokens' ban of the ends (eos, the
   model's eos_token_id, and the one-token stop sequences) while fewer than min_tokens of
   history are generated (sampler.c says how). `tally` as above. Every decoder adjusts its
   rows through this one function. */
void tl_adjust_logits(const tl_generate_config *c, float *logits, const int32_t *history, int n, int prompt_len,
                      int32_t eos, int32_t *tally);
/* Whether token is one of the ends: eos (unless ignore_eos) or a one-token stop sequence's
   token, each of which ends generation whenever it is emitted (min_tokens bans them before;
   keep_special_text shows no text of them). */
bool tl_is_end(const tl_generate_config *c, int32_t eos, int32_t token);
/* Whether min_tokens still holds back the ends of a step whose history has n tokens (its
   longer stop sequences and its stop strings are then not matched either). */
static inline bool tl_min_tokens_pending(const tl_generate_config *c, int n, int prompt_len) {
    return n - prompt_len < c->min_tokens;
}
/* Whether tl_adjust_logits changes anything under config c at a step whose history has n
   tokens (min_tokens' ban ends with its count). */
bool tl_adjusts_logits(const tl_generate_config *c, int n, int prompt_len);
/* The longest stop sequence that may end a step whose history has n tokens (stop.h): a
   one-token one only while min_tokens holds, as eos (its token comes then only where
   nothing else could), any after. */
static inline int tl_stop_longest(const tl_generate_config *c, int n, int prompt_len) {
    return tl_min_tokens_pending(c, n, prompt_len) ? 1 : INT_MAX;
}

/* The rules every decoder shares (greedy, sampling, speculative, beam):
     - -inf and NaN logits are banned tokens (no probability, never chosen);
     - when some logits are +inf, they share all the probability equally;
     - ranking is by logit, ties to the lower id. */

/* Index of the largest logit, the lowest id among ties; NaN never wins; -1 when no logit is
   finite-or-+inf (everything -inf / NaN). */
int32_t tl_argmax(const float *logits, int vocab);

/* The k best of logits[0..vocab), best first (ties: lower id first); banned tokens are never
   chosen. ids[k] and values[k] receive them (values is also the heap's scratch); returns how
   many there are (< k when fewer tokens are allowed). O(vocab log k); a small k over a large
   vocabulary visits only the blocks of logits that may hold the k best. */
int tl_top_k(const float *logits, int vocab, int k, int32_t *ids, float *values);
/* tl_top_k's result, the same ids and values, by a stable radix sort of every allowed token:
   O(vocab) whatever k, in scratch[tl_top_k_radix_scratch(vocab)]. The heap's sift-downs made
   k = vocab (every token: top_k 0 or -1 in the server) cost 7.8 ms over GPT-2's 50257 logits. */
size_t tl_top_k_radix_scratch(int vocab);
int tl_top_k_radix(const float *logits, int vocab, int k, int32_t *ids, float *values, uint64_t *scratch);

/* TL_OK unless the model's logits `row` holds a NaN: its activations overflowed. A NaN never
   compares: a choice or a log-softmax passes over it as if it were banned, going on with what
   is left, or reads a wholly NaN row as every token banned. The error says where (`what` and
   `index`: "token 3", "position 17") and, with an f16 KV cache, its limit (the likely cause). */
tl_status tl_check_logits_finite(const float *row, int vocab, bool f16_kv, const char *what, int index);
/* The likely cause an overflow's message names: an f16 KV cache's limit, or nothing. */
const char *tl_overflow_hint(bool f16_kv);

/* out[i] = log softmax(logits)[i] in double (-inf for banned tokens; with +inf logits,
   -log(count) for each of them). Returns false when every token is banned. */
bool tl_log_softmax(const float *logits, int vocab, double *out);

/* One row's log-probabilities for tl_session_logprobs and tl_score_logprobs: *logprob of
   `token` (skipped when token < 0) and the `top` most likely tokens as tl_top_k ranks them
   (top_ids -1 and top_logprobs -inf past the allowed ones), through scratch[vocab]. */
void tl_row_logprobs(const float *row, int vocab, int32_t token, int top, double *scratch, float *logprob,
                     int32_t *top_ids, float *top_logprobs);
/* The callers' one argument rule for `top` alternatives: in [0, TL_MAX_TOP_LOGPROBS], with
   both arrays when top > 0; `what` names the call in the message. */
tl_status tl_check_top_logprobs(const char *what, int top, const int32_t *top_ids, const float *top_logprobs);

/* An index i with probability weights[i] / total (weights >= 0, total = their sum > 0); -1
   when there is no positive weight. The one draw of the engine: u = uniform * total, then
   the first i whose running sum exceeds u (rounding past the end: the last positive one). */
int tl_draw(const double *weights, int n, double total, tl_rng *rng);

/* The sampling distribution after temperature, top-k, top-p and min-p: `n` candidates
   with ids in decreasing probability (ties: lower id first) and probabilities summing to
   1. */
typedef struct tl_distribution {
    int vocab, n;
    int32_t *ids;   /* [vocab] */
    double *probs;  /* [vocab] */
    float *values;  /* [vocab] the candidates' logits (top-k scratch) */
    uint64_t *scratch; /* tl_top_k_radix's (tl_top_k_radix_scratch), made on first use (a large top_k), or NULL */
} tl_distribution;

tl_status tl_distribution_init(tl_distribution *d, int vocab);
void tl_distribution_free(tl_distribution *d);
/* The sampling distribution: top_k's candidates, cut by top_p then min_p, at `temperature`
   (temperature_last: the cuts read the distribution at temperature 1, and the temperature
   applies to the tokens left, llama.cpp's order; tinyloop.h). Returns false when no token
   has a finite logit. */
bool tl_distribution_build(tl_distribution *d, const float *logits, float temperature, int top_k, float top_p,
                           float min_p, bool temperature_last);
int32_t tl_distribution_draw(const tl_distribution *d, tl_rng *rng);

#endif

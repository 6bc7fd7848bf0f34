/* sampler.h: turning logits into a token (SPEC §3 order: repetition penalty, temperature,
 * top-k, top-p, then a draw from our own seeded generator). */
#ifndef TL_SAMPLER_H
#define TL_SAMPLER_H

#include "internal.h"

/* xoshiro256**, seeded through splitmix64: the same seed gives the same stream on every
   machine, whatever the thread count. */
typedef struct tl_rng { uint64_t s[4]; } tl_rng;
void tl_rng_seed(tl_rng *rng, uint64_t seed);
uint64_t tl_rng_next(tl_rng *rng);
double tl_rng_uniform(tl_rng *rng); /* [0, 1), 53 random bits */

/* Hugging Face convention, once per distinct id in ids[0..n): a positive logit is divided
   by `penalty`, a negative one multiplied. `seen` is vocab bytes of scratch, left zeroed. */
void tl_repetition_penalty(float *logits, const int32_t *ids, int n, float penalty, uint8_t *seen);

/* Index of the largest logit, the lowest id among ties; NaN never wins; -1 when no logit is
   finite-or-+inf (everything -inf / NaN). */
int32_t tl_argmax(const float *logits, int vocab);

/* The sampling distribution after temperature, top-k and top-p: `n` candidates with ids in
   decreasing probability (ties: lower id first) and probabilities summing to 1. */
typedef struct tl_distribution {
    int vocab, n;
    int32_t *ids;   /* [vocab] */
    double *probs;  /* [vocab] */
    float *heap;    /* [vocab] top-k selection scratch */
} tl_distribution;

tl_status tl_distribution_init(tl_distribution *d, int vocab);
void tl_distribution_free(tl_distribution *d);
/* Returns false when no token has a finite logit. */
bool tl_distribution_build(tl_distribution *d, const float *logits, float temperature, int top_k,
                           float top_p);
int32_t tl_distribution_draw(const tl_distribution *d, tl_rng *rng);

#endif

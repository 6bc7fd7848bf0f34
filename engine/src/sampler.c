/* sampler.c: the logit adjustments, greedy argmax, the one top-k, log-softmax and draw,
 * and temperature / top-k / top-p / min-p sampling. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "sampler.h"

/* ---------------------------------------------------------------- random numbers */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void tl_rng_seed(tl_rng *rng, uint64_t seed) {
    for (int i = 0; i < 4; i++) rng->s[i] = splitmix64(&seed);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t tl_rng_next(tl_rng *rng) {
    uint64_t *s = rng->s;
    const uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double tl_rng_uniform(tl_rng *rng) { return (double)(tl_rng_next(rng) >> 11) * 0x1.0p-53; }

/* ---------------------------------------------------------------- penalty, argmax */

void tl_repetition_penalty(float *logits, const int32_t *ids, int n, float penalty, int32_t *tally) {
    if (penalty == 1.0f) return;
    for (int i = 0; i < n; i++) {
        int32_t t = ids[i];
        if (tally[t]) continue;
        tally[t] = 1;
        logits[t] = logits[t] < 0.0f ? logits[t] * penalty : logits[t] / penalty;
    }
    for (int i = 0; i < n; i++) tally[ids[i]] = 0;
}

bool tl_adjusts_logits(const tl_generate_config *c, int n, int prompt_len) {
    return c->n_logit_bias > 0 || c->repetition_penalty != 1.0f || c->presence_penalty != 0.0f ||
           c->frequency_penalty != 0.0f || tl_min_tokens_pending(c, n, prompt_len);
}

/* vLLM's min_tokens: the ends are banned (its stop_token_ids included), not merely
   ignored, so that the tokens a step emits are the ones the text goes on with. Banned to
   the lowest finite logit, not to -inf (tinyloop.h): every rule that chooses (argmax, the
   sampling distribution, beam search's log-probabilities) then takes an end only where
   nothing else is left, a grammar that allows nothing but its end, so that min_tokens never
   delays that end into a dead end; an end a hook or the grammar banned (-inf) stays banned. */
static void ban_end(float *logits, int32_t token) {
    if (logits[token] > -INFINITY) logits[token] = -FLT_MAX;
}
/* The ends (sampler.h): banned here by one loop over them, tested by tl_is_end below. */
static void ban_ends(const tl_generate_config *c, float *logits, int32_t eos) {
    if (!c->ignore_eos) ban_end(logits, eos);
    for (int i = 0; i < c->n_stop_sequences; i++)
        if (c->stop_sequences[i].n == 1) ban_end(logits, c->stop_sequences[i].tokens[0]);
}

bool tl_is_end(const tl_generate_config *c, int32_t eos, int32_t token) {
    if (token == eos && !c->ignore_eos) return true;
    for (int i = 0; i < c->n_stop_sequences; i++)
        if (c->stop_sequences[i].n == 1 && c->stop_sequences[i].tokens[0] == token) return true;
    return false;
}

void tl_adjust_logits(const tl_generate_config *c, float *logits, const int32_t *history, int n, int prompt_len,
                      int32_t eos, int32_t *tally) {
    for (int i = 0; i < c->n_logit_bias; i++) logits[c->logit_bias[i].token] += c->logit_bias[i].bias;
    /* penalty_window: the last W tokens of the sequence, wherever the prompt ends */
    const int window_start = c->penalty_window > 0 && n > c->penalty_window ? n - c->penalty_window : 0;
    tl_repetition_penalty(logits, history + window_start, n - window_start, c->repetition_penalty, tally);
    if (c->presence_penalty != 0.0f || c->frequency_penalty != 0.0f) {
        /* OpenAI's and vLLM's rule: the tokens generated so far (in the window), each counted;
           llama.cpp's (penalties_count_prompt) the prompt's as well */
        const int generated_start =
            c->penalties_count_prompt || window_start > prompt_len ? window_start : prompt_len;
        for (int i = generated_start; i < n; i++) tally[history[i]]++;
        for (int i = generated_start; i < n; i++) {
            const int32_t t = history[i];
            if (!tally[t]) continue; /* already adjusted */
            logits[t] -= (float)tally[t] * c->frequency_penalty + c->presence_penalty;
            tally[t] = 0;
        }
    }
    if (tl_min_tokens_pending(c, n, prompt_len)) ban_ends(c, logits, eos);
}

/* The largest of x[0..n) (-inf when none is larger; NaN never compares): eight interleaved
   running maxima, a loop without a branch or an exit, which the compiler vectorises. */
static float largest(const float *x, int n) {
    float part[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    const int n8 = n & ~7;
    for (int i = 0; i < n8; i += 8)
        for (int l = 0; l < 8; l++) part[l] = x[i + l] > part[l] ? x[i + l] : part[l];
    float best = -INFINITY;
    for (int l = 0; l < 8; l++) best = part[l] > best ? part[l] : best;
    for (int i = n8; i < n; i++) best = x[i] > best ? x[i] : best;
    return best;
}

/* The lowest id of the largest logit (NaN never compares; -1 when none is above -inf), in
   two passes: the largest value (largest()), then the first id holding it. One pass
   keeping the id took 42 us over GPT-2's 50257 logits (a compare and a branch on one
   dependent chain), on the calling thread between forward passes, eight times a step in a
   batch of eight greedy sessions; two take about 8. */
int32_t tl_argmax(const float *logits, int vocab) {
    const float best_value = largest(logits, vocab);
    if (!(best_value > -INFINITY)) return -1;
    for (int i = 0; i < vocab; i++) /* (-0 and +0 are equal: the lowest id of either, as one pass) */
        if (logits[i] == best_value) return i;
    return -1;
}

/* ---------------------------------------------------------------- top-k */

/* "a ranks below b": smaller logit, or equal logit and larger id. */
static inline bool below(float la, int32_t a, float lb, int32_t b) {
    return la < lb || (la == lb && a > b);
}

/* Min-heap of (logit, id) by rank: the root is the weakest survivor. */
static void sift_down(float *val, int32_t *id, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && below(val[l], id[l], val[m], id[m])) m = l;
        if (r < n && below(val[r], id[r], val[m], id[m])) m = r;
        if (m == i) return;
        float tv = val[i]; val[i] = val[m]; val[m] = tv;
        int32_t ti = id[i]; id[i] = id[m]; id[m] = ti;
        i = m;
    }
}

/* Blocks of logits whose maxima bound a small top-k from below (tl_top_k): at most
   PRUNE_BLOCKS of at least PRUNE_BLOCK_MIN, for vocabularies from PRUNE_VOCAB and k up
   to PRUNE_K. */
#define PRUNE_VOCAB 8192
#define PRUNE_K 128
#define PRUNE_BLOCKS 1024
#define PRUNE_BLOCK_MIN 64

/* The heap below visits every logit with a compare and a branch, 57 us for top_k 50 over
   GPT-2's 50257 logits, once a token for each sampling session. The k best are among the
   blocks whose maximum reaches the k-th largest block maximum (k blocks hold a logit at
   least that large, so the k-th best is too), which one branch-free pass finds; the heap
   then visits those blocks' logits only, in id order as before, so the result is the same
   (20 us there; 13 at k 10). */
int tl_top_k(const float *logits, int vocab, int k, int32_t *ids, float *values) {
    if (k < 1) return 0;
    if (k > vocab) k = vocab;
    float block_max[PRUNE_BLOCKS] = {0}; /* (set before read; GCC cannot tell through the recursion) */
    int block = vocab, blocks = 1;
    float floor = -INFINITY; /* a block whose maximum is below it holds none of the k best */
    if (vocab >= PRUNE_VOCAB && k <= PRUNE_K) {
        block = (vocab + PRUNE_BLOCKS - 1) / PRUNE_BLOCKS;
        if (block < PRUNE_BLOCK_MIN) block = PRUNE_BLOCK_MIN;
        blocks = (vocab + block - 1) / block;
        for (int b = 0; b < blocks; b++)
            block_max[b] = largest(logits + (size_t)b * (size_t)block, b + 1 < blocks ? block : vocab - b * block);
        int32_t best_blocks[PRUNE_K];
        float best_max[PRUNE_K];
        if (tl_top_k(block_max, blocks, k, best_blocks, best_max) == k) floor = best_max[k - 1];
    }
    int n = 0;
    /* A size-k min-heap of the best seen so far, over the blocks that may hold them. */
    for (int b = 0; b < blocks; b++) {
        if (blocks > 1 && !(block_max[b] >= floor)) continue;
        const int end = b + 1 < blocks ? (b + 1) * block : vocab;
        for (int i = b * block; i < end; i++) {
            float v = logits[i];
            if (!(v > -INFINITY)) continue; /* -inf and NaN are banned tokens */
            if (n < k) {
                values[n] = v;
                ids[n] = i;
                if (++n == k)
                    for (int j = k / 2 - 1; j >= 0; j--) sift_down(values, ids, k, j);
            } else if (below(values[0], ids[0], v, i)) {
                values[0] = v;
                ids[0] = i;
                sift_down(values, ids, k, 0);
            }
        }
    }
    /* Heap sort on a min-heap leaves the survivors in decreasing rank. */
    if (n < k)
        for (int j = n / 2 - 1; j >= 0; j--) sift_down(values, ids, n, j);
    for (int end = n - 1; end > 0; end--) {
        float tv = values[0]; values[0] = values[end]; values[end] = tv;
        int32_t ti = ids[0]; ids[0] = ids[end]; ids[end] = ti;
        sift_down(values, ids, end, 0);
    }
    return n;
}

/* Radix sort keys: ascending key = descending logit, -0 as +0 (they tie, as in below()). */
static inline uint32_t descending_key(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if (u == 0x80000000u) u = 0;
    return ~(u & 0x80000000u ? ~u : u | 0x80000000u);
}

#define RADIX_BITS 11
#define RADIX_BUCKETS (1 << RADIX_BITS)

size_t tl_top_k_radix_scratch(int vocab) { return 2 * (size_t)vocab + 3 * RADIX_BUCKETS / 2; }

int tl_top_k_radix(const float *logits, int vocab, int k, int32_t *ids, float *values, uint64_t *scratch) {
    if (k < 1) return 0;
    /* Items key << 32 | id in id order: a stable sort on the keys then leaves ties in id
       order. Three passes of 11 bits, their counts taken in one read of the logits (after
       the two item arrays in the scratch: 24 KiB, too much for a caller's stack). */
    uint64_t *from = scratch, *to = scratch + vocab;
    uint32_t (*count)[RADIX_BUCKETS] = (uint32_t (*)[RADIX_BUCKETS])(scratch + 2 * (size_t)vocab);
    memset(count, 0, 3 * sizeof *count);
    int n = 0;
    for (int i = 0; i < vocab; i++) {
        const float v = logits[i];
        if (!(v > -INFINITY)) continue; /* -inf and NaN are banned tokens */
        const uint32_t key = descending_key(v);
        for (int pass = 0; pass < 3; pass++) count[pass][(key >> (RADIX_BITS * pass)) & (RADIX_BUCKETS - 1)]++;
        from[n++] = (uint64_t)key << 32 | (uint32_t)i;
    }
    for (int pass = 0; pass < 3 && n > 0; pass++) {
        const int shift = 32 + RADIX_BITS * pass;
        uint32_t *bucket = count[pass];
        if (bucket[(from[0] >> shift) & (RADIX_BUCKETS - 1)] == (uint32_t)n) continue; /* one bucket: nothing moves */
        uint32_t start = 0;
        for (int b = 0; b < RADIX_BUCKETS; b++) {
            const uint32_t here = bucket[b];
            bucket[b] = start;
            start += here;
        }
        for (int j = 0; j < n; j++) to[bucket[(from[j] >> shift) & (RADIX_BUCKETS - 1)]++] = from[j];
        uint64_t *sorted = to;
        to = from;
        from = sorted;
    }
    if (k > n) k = n;
    for (int j = 0; j < k; j++) {
        ids[j] = (int32_t)(uint32_t)from[j];
        values[j] = logits[ids[j]];
    }
    return k;
}

/* ---------------------------------------------------------------- log-softmax */

const char *tl_overflow_hint(bool f16_kv) {
    return f16_kv ? " (an f16 KV cache holds at most 65504: load it with kv_type f32)" : "";
}

/* An infinity too: finite weights whose logit overflowed (a hook's own +inf is its choice, the
   mass shared; the model's was the same forced token every step, with a log-probability of 0). */
tl_status tl_check_logits_finite(const float *row, int vocab, bool f16_kv, const char *what, int index) {
    int at = 0;
    while (at < vocab && isfinite(row[at])) at++;
    if (at == vocab) return TL_OK;
    return tl_fail(TL_ERR_FORMAT, "the model gave non-finite logits (%s) at %s %d: its activations overflow%s",
                   isnan(row[at]) ? "NaN" : row[at] > 0 ? "inf" : "-inf", what, index, tl_overflow_hint(f16_kv));
}

bool tl_log_softmax(const float *logits, int vocab, double *out) {
    double mx = -INFINITY;
    for (int i = 0; i < vocab; i++) mx = logits[i] > mx ? logits[i] : mx; /* NaN never compares */
    if (!(mx > -INFINITY)) {
        for (int i = 0; i < vocab; i++) out[i] = -INFINITY;
        return false;
    }
    if (mx == INFINITY) { /* the +inf logits share the mass */
        int n_inf = 0;
        for (int i = 0; i < vocab; i++) n_inf += logits[i] == INFINITY;
        const double each = -log((double)n_inf);
        for (int i = 0; i < vocab; i++) out[i] = logits[i] == INFINITY ? each : -INFINITY;
        return true;
    }
    double sum = 0.0;
    for (int i = 0; i < vocab; i++) sum += logits[i] > -INFINITY ? exp((double)logits[i] - mx) : 0.0;
    const double log_z = mx + log(sum);
    for (int i = 0; i < vocab; i++) out[i] = logits[i] > -INFINITY ? (double)logits[i] - log_z : -INFINITY;
    return true;
}

void tl_row_logprobs(const float *row, int vocab, int32_t token, int top, double *scratch, float *logprob,
                     int32_t *top_ids, float *top_logprobs) {
    tl_log_softmax(row, vocab, scratch);
    if (token >= 0) *logprob = (float)scratch[token];
    /* the most likely by logit are the most likely by log-probability; ties to the lower id */
    const int found = top > 0 ? tl_top_k(row, vocab, top, top_ids, top_logprobs) : 0;
    for (int j = 0; j < top; j++) {
        if (j < found) top_logprobs[j] = (float)scratch[top_ids[j]];
        else top_ids[j] = -1, top_logprobs[j] = -INFINITY; /* fewer finite logits than top */
    }
}

tl_status tl_check_top_logprobs(const char *what, int top, const int32_t *top_ids, const float *top_logprobs) {
    if (top < 0 || top > TL_MAX_TOP_LOGPROBS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: top = %d must be in [0, %d]", what, top, TL_MAX_TOP_LOGPROBS);
    if (top > 0 && (!top_ids || !top_logprobs))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: top = %d needs top_ids and top_logprobs", what, top);
    return TL_OK;
}

/* ---------------------------------------------------------------- the draw */

int tl_draw(const double *weights, int n, double total, tl_rng *rng) {
    const double u = tl_rng_uniform(rng) * total;
    double acc = 0.0;
    int last = -1;
    for (int i = 0; i < n; i++) {
        if (!(weights[i] > 0.0)) continue;
        acc += weights[i];
        last = i;
        if (u < acc) return i;
    }
    return last;
}

/* ---------------------------------------------------------------- distribution */

tl_status tl_distribution_init(tl_distribution *d, int vocab) {
    memset(d, 0, sizeof *d);
    d->vocab = vocab;
    d->ids = malloc((size_t)vocab * sizeof *d->ids);
    d->probs = malloc((size_t)vocab * sizeof *d->probs);
    d->values = malloc((size_t)vocab * sizeof *d->values);
    if (!d->ids || !d->probs || !d->values) {
        tl_distribution_free(d);
        return tl_fail(TL_ERR_NO_MEMORY, "sampler: out of memory");
    }
    return TL_OK;
}

void tl_distribution_free(tl_distribution *d) {
    free(d->scratch);
    free(d->ids);
    free(d->probs);
    free(d->values);
    memset(d, 0, sizeof *d);
}

/* From this k on, tl_top_k_radix ranks faster than tl_top_k's heap (GPT-2's 50257 logits:
   k 500, the heap 125 us and the radix sort 298; k 1000, the heap 481 and the sort 295). */
#define RADIX_TOP_K 768

/* d->probs[0, n): the softmax of the candidates' logits over temperature (1 / inv_t), in
   double, from the largest (the first). */
static void softmax_from_first(tl_distribution *d, int n, double inv_t) {
    const double top = (double)d->values[0];
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += (d->probs[i] = exp(((double)d->values[i] - top) * inv_t));
    for (int i = 0; i < n; i++) d->probs[i] /= sum;
}

bool tl_distribution_build(tl_distribution *d, const float *logits, float temperature, int top_k, float top_p,
                           float min_p, bool temperature_last) {
    const int vocab = d->vocab, k = top_k < 1 || top_k > vocab ? vocab : top_k;
    /* the radix sort's scratch on first use (without it, out of memory, the heap ranks) */
    if (k >= RADIX_TOP_K && !d->scratch) d->scratch = malloc(tl_top_k_radix_scratch(vocab) * sizeof *d->scratch);
    int n = k >= RADIX_TOP_K && d->scratch ? tl_top_k_radix(logits, vocab, k, d->ids, d->values, d->scratch)
                                           : tl_top_k(logits, vocab, k, d->ids, d->values);
    d->n = n;
    if (n == 0) return false;
    if (d->values[0] == INFINITY) {
        /* +inf logits share the mass equally; they come first. */
        int n_inf = 0;
        while (n_inf < n && d->values[n_inf] == INFINITY) n_inf++;
        n = n_inf;
        for (int i = 0; i < n; i++) d->probs[i] = 1.0 / n;
    } else { /* (at temperature 1 where the cuts come first: temperature_last) */
        softmax_from_first(d, n, temperature_last ? 1.0 : 1.0 / (double)temperature);
    }
    /* Nucleus: the shortest prefix whose mass reaches top_p (at least one token). */
    const int before_cuts = n;
    if (top_p < 1.0f) {
        double mass = 0.0;
        for (int i = 0; i < n; i++) {
            mass += d->probs[i];
            if (mass >= (double)top_p) { n = i + 1; break; }
        }
    }
    /* Min-p (after top-p, as Hugging Face's and llama.cpp's samplers order them; vLLM's V1
       applies it before top-k and top-p, which agrees unless top_p < 1): the tokens at least
       min_p times as likely as the first, a prefix of the ranked candidates. A ratio to the
       first, so the cut before it needs no renormalising first. */
    if (min_p > 0.0f) {
        const double threshold = (double)min_p * d->probs[0];
        int keep = 1;
        while (keep < n && d->probs[keep] >= threshold) keep++;
        n = keep;
    }
    if (temperature_last && d->values[0] != INFINITY && temperature != 1.0f) {
        softmax_from_first(d, n, 1.0 / (double)temperature); /* the tokens the cuts left (llama.cpp's chain) */
    } else if (n < before_cuts) {
        double sum = 0.0;
        for (int i = 0; i < n; i++) sum += d->probs[i];
        for (int i = 0; i < n; i++) d->probs[i] /= sum;
    }
    d->n = n;
    return true;
}

int32_t tl_distribution_draw(const tl_distribution *d, tl_rng *rng) {
    /* The probabilities are normalised: total 1.0 leaves u exactly uniform. */
    const int i = tl_draw(d->probs, d->n, 1.0, rng);
    return i >= 0 ? d->ids[i] : -1;
}

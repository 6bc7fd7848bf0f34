/* test_generate.c: the generation state machine (SPEC §3): sampling knobs, stop reasons,
 * hooks, stream/batch/step equivalence, cache window, stats and validation. */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "sampler.h"
#include "session.h"
#include "tinyloop.h"

#define CAP 64
static tl_model *model, *model_1thread;
static int vocab, eos;

/* Defaults, with max_tokens fitting the test models' 32-token context. */
static void init_cfg(tl_generate_config *cfg) {
    tl_generate_config_init(cfg);
    cfg->max_tokens = 12;
}

static int gen(const tl_model *m, const int32_t *prompt, int n, const tl_generate_config *cfg,
               int32_t *out, tl_generate_stats *stats) {
    int len = -1;
    tl_status st = tl_generate(m, prompt, n, cfg, out, CAP, &len, stats);
    CHECK(st == TL_OK, "generate: %s", tl_last_error());
    return st == TL_OK ? len : -1;
}

/* ---------------------------------------------------------------- hooks used below */

/* Forces a scripted sequence of tokens: logit 10 for script[step], 0 elsewhere. */
typedef struct { const int32_t *script; int n, prompt_len, calls; } script_t;
static int force_script(void *user, float *logits, int v, const int32_t *tokens, int n) {
    script_t *s = user;
    int step = n - s->prompt_len;
    s->calls++;
    for (int i = 0; i < v; i++) logits[i] = 0.0f;
    logits[s->script[step % s->n]] = 10.0f;
    (void)tokens;
    return TL_HOOK_CONTINUE;
}
/* Token 5 gets logit 3, token 6 logit 2, every other token -10. */
static int two_favourites(void *user, float *logits, int v, const int32_t *tokens, int n) {
    (void)user; (void)tokens; (void)n;
    for (int i = 0; i < v; i++) logits[i] = -10.0f;
    logits[5] = 3.0f;
    logits[6] = 2.0f;
    return TL_HOOK_CONTINUE;
}
static int fail_hook(void *user, float *logits, int v, const int32_t *tokens, int n) {
    (void)user; (void)logits; (void)v; (void)tokens; (void)n;
    return TL_HOOK_ERROR;
}
typedef struct { int calls, last_position, stop_at; int32_t seen[CAP]; } observer_t;
/* A stream callback: true goes on, false stops after this token. */
static bool observe(void *user, int32_t token, int position) {
    observer_t *o = user;
    o->seen[o->calls++] = token;
    CHECK(position == o->last_position + 1 || o->last_position < 0, "positions %d then %d", o->last_position, position);
    o->last_position = position;
    return o->calls != o->stop_at;
}
static int on_token_stop(void *user, int32_t token, int position) {
    observer_t *o = user;
    o->seen[o->calls++] = token;
    (void)position;
    return o->calls == o->stop_at ? TL_HOOK_STOP : TL_HOOK_CONTINUE;
}
static int stop_after_len(void *user, const int32_t *tokens, int n) {
    (void)tokens;
    return n >= *(int *)user ? TL_HOOK_STOP : TL_HOOK_CONTINUE;
}
/* Grammar: allows tokens 3, 4, 5 in turn, then nothing. */
typedef struct { int state; } grammar_state;
static int grammar_allowed(void *user, uint8_t *allowed, int v) {
    grammar_state *g = user;
    (void)v;
    if (g->state >= 3) return 0;
    allowed[3 + g->state] = 1;
    return 1;
}
static int grammar_advance(void *user, int32_t token) {
    grammar_state *g = user;
    CHECK(token == 3 + g->state, "grammar advanced with %d in state %d", token, g->state);
    g->state++;
    return 0;
}

/* ---------------------------------------------------------------- tests */

static void test_greedy_matches_score(void) {
    int32_t prompt[4] = {5, 17, 3, 9}, out[CAP];
    tl_generate_config cfg;
    init_cfg(&cfg);
    cfg.max_tokens = 20;
    cfg.ignore_eos = 1;
    int len = gen(model, prompt, 4, &cfg, out, NULL);
    CHECK(len == 24, "len %d", len);
    float *logits = malloc((size_t)len * (size_t)vocab * sizeof(float));
    CHECK(tl_score(model, out, len, tl_model_info(model)->default_loops, logits) == TL_OK, "score");
    for (int i = 4; i < len; i++)
        CHECK(out[i] == tl_argmax(logits + (size_t)(i - 1) * (size_t)vocab, vocab),
              "token %d = %d is not the argmax of the score row", i, out[i]);
    /* At another depth too. */
    cfg.loops = 7;
    len = gen(model, prompt, 4, &cfg, out, NULL);
    CHECK(tl_score(model, out, len, 7, logits) == TL_OK, "score");
    for (int i = 4; i < len; i++)
        CHECK(out[i] == tl_argmax(logits + (size_t)(i - 1) * (size_t)vocab, vocab), "loops 7 token %d", i);
    free(logits);
}

/* tl_argmax against the plain one-pass rule (the first id whose logit beats every earlier
   one; NaN never compares), over lengths 0-40 (the eight-lane loop and its tail) and a
   GPT-2-sized row, with ties, NaNs, infinities, all -inf rows and signed zeros. */
static int32_t argmax_one_pass(const float *logits, int n) {
    int32_t best = -1;
    float best_value = -INFINITY;
    for (int i = 0; i < n; i++)
        if (logits[i] > best_value) best_value = logits[i], best = i;
    return best;
}

static void test_argmax(void) {
    enum { BIG = 50257 };
    float *row = malloc(BIG * sizeof *row);
    const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f, -1.0f, 3.5f};
    uint32_t state = 99u;
    int wrong = 0, trials = 0;
    for (int trial = 0; trial < 4000; trial++) {
        const int n = trial < 3900 ? trial % 41 : BIG;
        for (int i = 0; i < n; i++) {
            state = state * 1664525u + 1013904223u;
            const unsigned pick = state >> 24;
            /* mostly few distinct values (ties), some specials, some all -inf rows */
            row[i] = trial % 7 == 0 ? -INFINITY : pick < 40 ? specials[pick % 8] : (float)(pick % 5);
        }
        wrong += tl_argmax(row, n) != argmax_one_pass(row, n);
        trials++;
    }
    for (int i = 0; i < BIG; i++) row[i] = NAN;
    wrong += tl_argmax(row, BIG) != -1;
    row[BIG - 1] = -0.0f;
    row[BIG - 2] = 0.0f;
    wrong += tl_argmax(row, BIG) != BIG - 2;
    CHECK(wrong == 0, "tl_argmax differs from the one-pass rule in %d of %d rows", wrong, trials + 2);
    free(row);
}

/* tl_top_k_radix gives tl_top_k's ids and values, bit for bit: rows of few distinct values
   (long runs of ties), specials (NaN, +-inf, +-0, subnormals), all banned, and k from 1 past
   the allowed count; and a distribution over every one of GPT-2's 50257 tokens (top_k 0,
   which ranks by radix) is the heap's ranking with its probabilities. */
static void test_top_k_radix(void) {
    enum { BIG = 50257 };
    float *row = malloc(BIG * sizeof *row), *want_values = malloc(BIG * sizeof(float)), *got_values = malloc(BIG * sizeof(float));
    int32_t *want_ids = malloc(BIG * sizeof(int32_t)), *got_ids = malloc(BIG * sizeof(int32_t));
    uint64_t *scratch = malloc(tl_top_k_radix_scratch(BIG) * sizeof *scratch);
    const float specials[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-42f, -1e-42f, FLT_MAX, -FLT_MAX, 2.0f};
    uint32_t state = 5u;
    int wrong = 0, rows = 0;
    for (int trial = 0; trial < 60; trial++) {
        const int n = trial < 50 ? 1 + trial * 37 : BIG;
        for (int i = 0; i < n; i++) {
            state = state * 1664525u + 1013904223u;
            const unsigned pick = state >> 22;
            row[i] = trial % 9 == 4 ? NAN : pick < 60 ? specials[pick % 10] : trial % 2 ? (float)(pick % 9) - 4.0f
                                                                                   : (float)pick * 0.37f - 150.0f;
            if (trial == 55 && pick > 3) row[i] = -INFINITY; /* fewer allowed blocks than k */
        }
        /* (k up to 128 over 8192 logits or more: tl_top_k's pruned blocks) */
        const int ks[] = {1, 7, 50, 128, 768, n / 2 + 1, n, n + 5};
        for (int c = 0; c < 8; c++) {
            const int want = tl_top_k(row, n, ks[c], want_ids, want_values);
            const int got = tl_top_k_radix(row, n, ks[c], got_ids, got_values, scratch);
            wrong += got != want || memcmp(want_ids, got_ids, (size_t)want * sizeof(int32_t)) != 0 ||
                     memcmp(want_values, got_values, (size_t)want * sizeof(float)) != 0;
            rows++;
        }
    }
    CHECK(wrong == 0, "tl_top_k_radix differs from tl_top_k in %d of %d rankings", wrong, rows);
    /* the distribution of every token: the heap's ranking, softmax at temperature 0.8 */
    for (int i = 0; i < BIG; i++) row[i] = (float)((i * 7919) % 1000) * 0.01f - (i % 13 == 0 ? INFINITY : 0.0f);
    tl_distribution dist;
    CHECK(tl_distribution_init(&dist, BIG) == TL_OK, "distribution of %d tokens", BIG);
    CHECK(tl_distribution_build(&dist, row, 0.8f, 0, 1.0f, 0.0f, false), "build over every token");
    const int want = tl_top_k(row, BIG, BIG, want_ids, want_values);
    bool same = dist.n == want && dist.scratch != NULL && memcmp(dist.ids, want_ids, (size_t)want * sizeof(int32_t)) == 0;
    double *probs = malloc((size_t)want * sizeof *probs), sum = 0.0; /* (the build's softmax, spelled out) */
    const double inv_t = 1.0 / (double)0.8f;
    for (int i = 0; i < want; i++) sum += (probs[i] = exp(((double)want_values[i] - (double)want_values[0]) * inv_t));
    for (int i = 0; i < want; i++) probs[i] /= sum;
    same = same && memcmp(dist.probs, probs, (size_t)want * sizeof *probs) == 0;
    CHECK(same, "every-token distribution: %d candidates (heap %d), not the heap's ranking and probabilities", dist.n, want);
    free(probs);
    tl_distribution_free(&dist);
    free(row);
    free(want_values);
    free(got_values);
    free(want_ids);
    free(got_ids);
    free(scratch);
}

static void test_sampling_knobs(void) {
    int32_t prompt[3] = {2, 8, 30}, greedy[CAP], got[CAP], other[CAP];
    tl_generate_config cfg;
    init_cfg(&cfg);
    cfg.max_tokens = 24;
    cfg.ignore_eos = 1;
    int n = gen(model, prompt, 3, &cfg, greedy, NULL);

    cfg.temperature = 0.9f;
    cfg.top_k = 1;
    CHECK(gen(model, prompt, 3, &cfg, got, NULL) == n && memcmp(got, greedy, (size_t)n * 4) == 0, "top_k=1 != greedy");
    cfg.top_k = 50;
    cfg.top_p = 1e-6f;
    CHECK(gen(model, prompt, 3, &cfg, got, NULL) == n && memcmp(got, greedy, (size_t)n * 4) == 0, "tiny top_p != greedy");
    cfg.temperature = 0.005f; /* <= 0.01 is greedy */
    cfg.top_p = 1.0f;
    CHECK(gen(model, prompt, 3, &cfg, got, NULL) == n && memcmp(got, greedy, (size_t)n * 4) == 0, "T=0.005 != greedy");

    cfg.temperature = 1.0f;
    cfg.top_k = vocab;
    cfg.sample_seed = 42;
    gen(model, prompt, 3, &cfg, got, NULL);
    gen(model, prompt, 3, &cfg, other, NULL);
    CHECK(memcmp(got, other, (size_t)n * 4) == 0, "same seed gave different tokens");
    gen(model_1thread, prompt, 3, &cfg, other, NULL);
    CHECK(memcmp(got, other, (size_t)n * 4) == 0, "same seed differs between 1 and 2 threads");
    CHECK(memcmp(got, greedy, (size_t)n * 4) != 0, "T=1 sampling reproduced greedy exactly");
    cfg.sample_seed = 43;
    gen(model, prompt, 3, &cfg, other, NULL);
    CHECK(memcmp(got, other, (size_t)n * 4) != 0, "seeds 42 and 43 gave the same 24 tokens");
}

/* Empirical draws against softmax(logits / T) restricted to top-k then top-p. */
static void test_distribution_chi_square(void) {
    const float logits[8] = {1.0f, 2.5f, 0.3f, 2.5f, -1.0f, 1.7f, 0.9f, -INFINITY};
    const float T = 0.8f, top_p = 0.9f;
    const int top_k = 5, draws = 200000;
    /* Expected, by hand: ranks 1(2.5) 3(2.5) 5(1.7) 0(1.0) 6(0.9); then nucleus. */
    const int order[5] = {1, 3, 5, 0, 6};
    double p[5], sum = 0;
    for (int i = 0; i < 5; i++) sum += (p[i] = exp((logits[order[i]] - 2.5) / T));
    for (int i = 0; i < 5; i++) p[i] /= sum;
    int keep = 5;
    double mass = 0;
    for (int i = 0; i < 5; i++) { mass += p[i]; if (mass >= top_p) { keep = i + 1; break; } }
    sum = 0;
    for (int i = 0; i < keep; i++) sum += p[i];
    for (int i = 0; i < keep; i++) p[i] /= sum;

    tl_distribution d;
    tl_distribution_init(&d, 8);
    CHECK(tl_distribution_build(&d, logits, T, top_k, top_p, 0.0f, false), "build");
    CHECK(d.n == keep, "kept %d candidates, expected %d", d.n, keep);
    for (int i = 0; i < d.n && i < keep; i++)
        CHECK(d.ids[i] == order[i] && fabs(d.probs[i] - p[i]) < 1e-12, "candidate %d: id %d p %.6f", i, d.ids[i], d.probs[i]);
    tl_rng rng;
    tl_rng_seed(&rng, 7);
    int counts[8] = {0};
    for (int i = 0; i < draws; i++) counts[tl_distribution_draw(&d, &rng)]++;
    double chi2 = 0;
    for (int i = 0; i < keep; i++) {
        double e = p[i] * draws;
        chi2 += (counts[order[i]] - e) * (counts[order[i]] - e) / e;
    }
    int outside = draws;
    for (int i = 0; i < keep; i++) outside -= counts[order[i]];
    CHECK(outside == 0, "%d draws fell outside top-k/top-p", outside);
    /* df = keep - 1 <= 4: the 0.999 quantile of chi2(4) is 18.47. */
    CHECK(chi2 < 18.47, "chi-square %.2f over %d candidates", chi2, keep);
    printf("  sampler chi-square %.2f (df %d, %d draws)\n", chi2, keep - 1, draws);
    float all_banned[8];
    for (int i = 0; i < 8; i++) all_banned[i] = -INFINITY;
    CHECK(!tl_distribution_build(&d, all_banned, 1.0f, 5, 1.0f, 0.5f, false), "all -inf must yield no distribution");
    CHECK(tl_argmax(all_banned, 8) == -1, "argmax of all -inf");
    const float ties[4] = {1.0f, 3.0f, NAN, 3.0f};
    CHECK(tl_argmax(ties, 4) == 1, "argmax ties go to the lowest id, NaN never wins");
    tl_distribution_free(&d);
}

/* The first token generated after prompt[0..n) under config c. */
static int32_t first_new_token(const tl_generate_config *c, const int32_t *prompt, int n) {
    int32_t out[CAP];
    const int len = gen(model, prompt, n, c, out, NULL);
    return len > n ? out[n] : -1;
}

/* Whether chain speculation (draft_loops 2, draft_ahead 3) under config c decodes `want`
   (n tokens, prompt included), as SPEC promises of every greedy config. */
static bool chain_decodes_the_same(const tl_generate_config *c, const int32_t *prompt, int n_prompt, const int32_t *want,
                                   int n) {
    tl_generate_config spec = *c;
    spec.speculative = TL_SPECULATIVE_CHAIN;
    spec.draft_loops = 2;
    spec.draft_ahead = 3;
    int32_t out[CAP];
    const int n_spec = gen(model, prompt, n_prompt, &spec, out, NULL);
    return n_spec == n && memcmp(out, want, (size_t)n * sizeof(int32_t)) == 0;
}

static void test_repetition_penalty(void) {
    float logits[6] = {2.0f, -1.0f, 0.5f, 4.0f, -3.0f, 1.0f};
    const int32_t ids[5] = {0, 1, 0, 4, 1};
    int32_t seen[6] = {0};
    tl_repetition_penalty(logits, ids, 5, 2.0f, seen);
    const float want[6] = {1.0f, -2.0f, 0.5f, 4.0f, -6.0f, 1.0f};
    CHECK(memcmp(logits, want, sizeof want) == 0, "penalised %g %g %g %g %g %g", logits[0], logits[1],
          logits[2], logits[3], logits[4], logits[5]);
    const int32_t zero[6] = {0};
    CHECK(memcmp(seen, zero, sizeof zero) == 0, "seen scratch left dirty");

    /* In generation: token 5 (in the prompt) has logit 3, token 6 logit 2. */
    int32_t prompt[2] = {5, 9}, out[CAP];
    tl_generate_config cfg;
    init_cfg(&cfg);
    cfg.max_tokens = 1;
    cfg.logits_processor = two_favourites;
    gen(model, prompt, 2, &cfg, out, NULL);
    CHECK(out[2] == 5, "without penalty token 5 wins, got %d", out[2]);
    cfg.repetition_penalty = 2.0f; /* 3 / 2 = 1.5 < 2 */
    gen(model, prompt, 2, &cfg, out, NULL);
    CHECK(out[2] == 6, "penalised token 5 must lose to token 6, got %d", out[2]);
    cfg.repetition_penalty = 1.4f; /* 3 / 1.4 = 2.14 > 2 */
    gen(model, prompt, 2, &cfg, out, NULL);
    CHECK(out[2] == 5, "a mild penalty keeps token 5, got %d", out[2]);
}

/* logit_bias, presence and frequency penalties (tinyloop.h): their arithmetic and order on
   one row, then in generation, in every mode, saved and resumed. */
static void test_logit_adjustments(void) {
    /* One row: history = prompt {0, 3} + generated {3, 5, 5, 1}. */
    float logits[8] = {2.0f, -1.0f, 0.5f, 4.0f, -3.0f, 1.0f, 6.0f, 0.25f};
    const int32_t history[6] = {0, 3, 3, 5, 5, 1};
    const tl_logit_bias bias[2] = {{2, 1.5f}, {7, -100.0f}};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.logit_bias = bias;
    cfg.n_logit_bias = 2;
    cfg.repetition_penalty = 2.0f;
    cfg.presence_penalty = 0.5f;
    cfg.frequency_penalty = 0.25f;
    int32_t tally[8] = {0};
    CHECK(tl_adjusts_logits(&cfg, 6, 2), "adjusts");
    tl_adjust_logits(&cfg, logits, history, 6, 2, eos, tally);
    /* bias first, then the repetition penalty over all six (0, 1, 3, 5), then presence and
       frequency over the generated four: 3 once, 5 twice, 1 once; 0 was the prompt's only */
    const float want[8] = {2.0f / 2.0f,
                           -1.0f * 2.0f - (1.0f * 0.25f + 0.5f),
                           0.5f + 1.5f,
                           4.0f / 2.0f - (1.0f * 0.25f + 0.5f),
                           -3.0f,
                           1.0f / 2.0f - (2.0f * 0.25f + 0.5f),
                           6.0f,
                           0.25f - 100.0f};
    for (int i = 0; i < 8; i++) CHECK(logits[i] == want[i], "adjusted logit %d: %g, want %g", i, (double)logits[i], (double)want[i]);
    const int32_t zero[8] = {0};
    CHECK(memcmp(tally, zero, sizeof zero) == 0, "tally left dirty");
    tl_generate_config_init(&cfg);
    CHECK(!tl_adjusts_logits(&cfg, 6, 2), "the defaults adjust nothing");
    cfg.min_tokens = 3; /* min_tokens adjusts while it holds: after 2 new tokens, not after 3 */
    CHECK(tl_adjusts_logits(&cfg, 4, 2) && !tl_adjusts_logits(&cfg, 5, 2), "min_tokens adjusts while it holds only");

    /* In generation: the hook gives token 5 logit 3, token 6 logit 2, the rest -10. */
    int32_t prompt[2] = {5, 9}, out[CAP];
    init_cfg(&cfg);
    cfg.logits_processor = two_favourites;
    cfg.max_tokens = 1;
    tl_logit_bias lift[1] = {{6, 1.5f}};
    cfg.logit_bias = lift;
    cfg.n_logit_bias = 1;
    gen(model, prompt, 2, &cfg, out, NULL);
    CHECK(out[2] == 6, "logit_bias +1.5 on token 6 (3.5 > 3) must win, got %d", out[2]);
    lift[0] = (tl_logit_bias){5, -100.0f};
    gen(model, prompt, 2, &cfg, out, NULL);
    CHECK(out[2] == 6, "logit_bias -100 on token 5 must ban it, got %d", out[2]);
    cfg.n_logit_bias = 0;
    cfg.presence_penalty = 5.0f;
    cfg.max_tokens = 2;
    gen(model, prompt, 2, &cfg, out, NULL);
    CHECK(out[2] == 5 && out[3] == 6, "presence: the prompt's 5 does not count, the generated one does: got %d %d",
          out[2], out[3]);
    cfg.presence_penalty = 0.0f;
    cfg.frequency_penalty = 0.6f; /* 5 scores 3, 2.4, 1.8 after 0, 1, 2 of them */
    cfg.max_tokens = 3;
    gen(model, prompt, 2, &cfg, out, NULL);
    CHECK(out[2] == 5 && out[3] == 5 && out[4] == 6, "frequency: got %d %d %d, want 5 5 6", out[2], out[3], out[4]);

    /* The session keeps its own copy of logit_bias: the caller's array may change. */
    lift[0] = (tl_logit_bias){6, 1.5f};
    cfg.logit_bias = lift;
    cfg.n_logit_bias = 1;
    cfg.frequency_penalty = 0.0f;
    tl_session *s = NULL;
    CHECK(tl_session_new(model, prompt, 2, &cfg, &s) == TL_OK, "session: %s", tl_last_error());
    lift[0] = (tl_logit_bias){5, 100.0f};
    int32_t token = -1;
    tl_stop_reason stop;
    if (s) CHECK(tl_session_step(s, &token, &stop) == TL_OK && token == 6, "the session's copy decides: got %d", token);
    tl_session_free(s);

    /* The model's own logits, every mode: greedy plain decoding with all three against
       chain speculation and a resumed state (both bit-identical to it, SPEC), and beam
       search never choosing a banned token. */
    tl_logit_bias mixed[3] = {{prompt[0], -2.0f}, {11, 3.0f}, {eos, -100.0f}};
    init_cfg(&cfg);
    cfg.max_tokens = 24;
    cfg.loops = 4;
    cfg.logit_bias = mixed;
    cfg.n_logit_bias = 3;
    cfg.presence_penalty = 0.7f;
    cfg.frequency_penalty = 0.4f;
    int32_t plain[CAP], other[CAP];
    const int n_plain = gen(model, prompt, 2, &cfg, plain, NULL);
    tl_generate_config base = cfg;
    base.n_logit_bias = 0;
    base.presence_penalty = base.frequency_penalty = 0.0f;
    const int n_base = gen(model, prompt, 2, &base, other, NULL);
    CHECK(n_plain != n_base || memcmp(plain, other, (size_t)n_plain * sizeof(int32_t)) != 0,
          "the adjustments changed nothing (test too weak)");
    CHECK(chain_decodes_the_same(&cfg, prompt, 2, plain, n_plain),
          "chain speculation with the adjustments differs from plain decoding");
    for (int i = 2; i < n_plain; i++) CHECK(plain[i] != eos, "token %d is the banned eos", i);
    /* saved after 10 tokens (through bytes: the state file's layout), resumed to the end */
    s = NULL;
    CHECK(tl_session_new(model, prompt, 2, &cfg, &s) == TL_OK, "session: %s", tl_last_error());
    for (int i = 0; s && i < 10; i++) tl_session_step(s, &token, &stop);
    tl_session_state *state = NULL, *read_back = NULL;
    void *bytes = NULL;
    size_t len = 0;
    CHECK(s && tl_session_save(s, &state) == TL_OK && tl_session_state_to_bytes(state, &bytes, &len) == TL_OK &&
              tl_session_state_from_bytes(model, bytes, len, &read_back) == TL_OK,
          "save and read back: %s", tl_last_error());
    tl_session_free(s);
    s = NULL;
    if (read_back && tl_session_resume(model, read_back, NULL, &s) == TL_OK) {
        while (tl_session_step(s, &token, &stop) == TL_OK && stop == TL_STOP_NONE) {
        }
        int n_resumed = 0;
        const int32_t *resumed = tl_session_tokens(s, &n_resumed);
        CHECK(n_resumed == n_plain && memcmp(resumed, plain, (size_t)n_plain * sizeof(int32_t)) == 0,
              "the resumed state lost its adjustments");
    } else {
        CHECK(false, "resume: %s", tl_last_error());
    }
    tl_session_free(s);
    tl_session_state_free(state);
    tl_session_state_free(read_back);
    tl_free(bytes);
    tl_generate_config beam = cfg;
    beam.beam_size = 3;
    const int n_beam = gen(model, prompt, 2, &beam, other, NULL);
    CHECK(n_beam > 2, "beam search under the ban wrote %d tokens", n_beam - 2);
    for (int i = 2; i < n_beam; i++) CHECK(other[i] != eos, "beam token %d is the banned eos", i);
}

/* penalty_window (tinyloop.h): the three penalties read the last W tokens of the sequence,
   wherever the prompt ends; 0, or a window longer than the sequence, reads all of it. */
static void test_penalty_window(void) {
    /* One row: history = prompt {0, 3} + generated {3, 5, 5, 1}, repetition 2, presence 0.5,
       frequency 0.25, under windows of 3, 5 and 0 / 6 / 100. */
    const float logits[8] = {2.0f, -1.0f, 0.5f, 4.0f, -3.0f, 1.0f, 6.0f, 0.25f};
    const int32_t history[6] = {0, 3, 3, 5, 5, 1};
    const float rep = 2.0f, pres = 0.5f, freq = 0.25f;
    const struct { int window; float want[8]; } cases[] = {
        /* the last 3: {5, 5, 1}, all generated: 0 and 3 are left alone */
        {3, {2.0f, -1.0f * rep - (freq + pres), 0.5f, 4.0f, -3.0f, 1.0f / rep - (2 * freq + pres), 6.0f, 0.25f}},
        /* the last 5: {3 (the prompt's), 3, 5, 5, 1}: 3 repeated, counted once as generated */
        {5, {2.0f, -1.0f * rep - (freq + pres), 0.5f, 4.0f / rep - (freq + pres), -3.0f, 1.0f / rep - (2 * freq + pres),
             6.0f, 0.25f}},
    };
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    CHECK(cfg.penalty_window == 0, "the default window is the whole sequence");
    cfg.repetition_penalty = rep;
    cfg.presence_penalty = pres;
    cfg.frequency_penalty = freq;
    int32_t tally[8] = {0};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        float row[8];
        memcpy(row, logits, sizeof row);
        cfg.penalty_window = cases[c].window;
        tl_adjust_logits(&cfg, row, history, 6, 2, eos, tally);
        for (int i = 0; i < 8; i++)
            CHECK(row[i] == cases[c].want[i], "window %d: logit %d is %g, want %g", cases[c].window, i, (double)row[i],
                  (double)cases[c].want[i]);
    }
    float whole[8], row[8];
    memcpy(whole, logits, sizeof whole);
    cfg.penalty_window = 0;
    tl_adjust_logits(&cfg, whole, history, 6, 2, eos, tally);
    CHECK(whole[0] == 1.0f, "the whole sequence's window penalises the prompt's 0");
    for (int window = 6; window <= 100; window += 94) {
        memcpy(row, logits, sizeof row);
        cfg.penalty_window = window;
        tl_adjust_logits(&cfg, row, history, 6, 2, eos, tally);
        CHECK(memcmp(row, whole, sizeof row) == 0, "a window of %d over 6 tokens reads them all", window);
    }
    /* penalties_count_prompt (llama.cpp's rule): presence and frequency count the prompt's
       tokens in the window too: under a window of 5 the prompt's 3 is counted with the
       generated one; over the whole sequence the prompt's 0 as well */
    cfg.penalties_count_prompt = 1;
    cfg.penalty_window = 5;
    memcpy(row, logits, sizeof row);
    tl_adjust_logits(&cfg, row, history, 6, 2, eos, tally);
    CHECK(row[3] == 4.0f / rep - (2 * freq + pres) && row[0] == 2.0f && row[5] == 1.0f / rep - (2 * freq + pres),
          "window 5, the prompt counted: %g %g %g", (double)row[3], (double)row[0], (double)row[5]);
    cfg.penalty_window = 0;
    memcpy(row, logits, sizeof row);
    tl_adjust_logits(&cfg, row, history, 6, 2, eos, tally);
    CHECK(row[0] == 2.0f / rep - (freq + pres) && row[3] == 4.0f / rep - (2 * freq + pres),
          "the whole sequence, the prompt counted: %g %g", (double)row[0], (double)row[3]);
    cfg.penalties_count_prompt = 0;
    const int32_t zero[8] = {0};
    CHECK(memcmp(tally, zero, sizeof zero) == 0, "tally left dirty");

    /* In generation: the hook gives token 5 logit 3, token 6 logit 2; the prompt {5, 9}
       ends in 9, so a window of 1 leaves 5 alone and a window of 2 penalises it. */
    int32_t prompt[2] = {5, 9};
    init_cfg(&cfg);
    cfg.logits_processor = two_favourites;
    cfg.max_tokens = 1;
    cfg.repetition_penalty = 2.0f;
    cfg.penalty_window = 1;
    int32_t first = first_new_token(&cfg, prompt, 2);
    CHECK(first == 5, "window 1 ({9}): token 5 is not penalised and wins, got %d", first);
    cfg.penalty_window = 2;
    first = first_new_token(&cfg, prompt, 2);
    CHECK(first == 6, "window 2 ({5, 9}): penalised token 5 loses to 6, got %d", first);
    tl_session *refused = NULL;
    cfg.penalty_window = -1;
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &refused), TL_ERR_INVALID_ARGUMENT, "penalty_window = -1 must be >= 0");
    cfg.penalty_window = 0;
    cfg.penalties_count_prompt = 2;
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &refused), TL_ERR_INVALID_ARGUMENT,
                "penalties_count_prompt = 2 must be 0 or 1");
    CHECK(refused == NULL, "a refused session is NULL");
    /* presence with the prompt counted: the prompt's 5 is penalised from the first step */
    cfg.penalties_count_prompt = 1;
    cfg.repetition_penalty = 1.0f;
    cfg.presence_penalty = 1.5f;
    first = first_new_token(&cfg, prompt, 2);
    CHECK(first == 6, "presence counting the prompt's 5 (3 - 1.5 < 2): got %d", first);
    cfg.penalties_count_prompt = 0;
    first = first_new_token(&cfg, prompt, 2);
    CHECK(first == 5, "presence over the generated tokens only leaves the prompt's 5: got %d", first);

    /* The model's own logits: a short window changes the output, a window longer than the
       sequence does not, and chain speculation with a window is bit-identical to plain
       decoding (its drafts and verifier rows read the same windows). */
    init_cfg(&cfg);
    cfg.max_tokens = 24;
    cfg.loops = 4;
    cfg.repetition_penalty = 3.0f;
    cfg.frequency_penalty = 0.8f;
    int32_t whole_out[CAP], windowed_out[CAP], other[CAP];
    const int n_whole = gen(model, prompt, 2, &cfg, whole_out, NULL);
    cfg.penalty_window = 2 + 24;
    const int n_long = gen(model, prompt, 2, &cfg, other, NULL);
    CHECK(n_long == n_whole && memcmp(other, whole_out, (size_t)n_whole * sizeof(int32_t)) == 0,
          "a window as long as the sequence reads it all");
    cfg.penalty_window = 3;
    const int n_windowed = gen(model, prompt, 2, &cfg, windowed_out, NULL);
    CHECK(n_windowed != n_whole || memcmp(windowed_out, whole_out, (size_t)n_whole * sizeof(int32_t)) != 0,
          "a window of 3 changed nothing (test too weak)");
    CHECK(chain_decodes_the_same(&cfg, prompt, 2, windowed_out, n_windowed),
          "chain speculation with a penalty window differs from plain decoding");
}

/* temperature_last (tinyloop.h): llama.cpp's order, top_p and min_p cut the distribution at
   temperature 1 and the temperature applies to the tokens left. At T = 1 the probabilities
   are 0.636, 0.234, 0.086, 0.032, 0.012; at T = 2, 0.428, 0.260, 0.158, 0.096, 0.058. */
static void test_temperature_last(void) {
    const float logits[5] = {3.0f, 2.0f, 1.0f, 0.0f, -1.0f};
    const struct { float temperature, top_p, min_p; bool last; int want; } cases[] = {
        {2.0f, 0.8f, 0.0f, true, 2},   /* 0.636 + 0.234 reach 0.8 */
        {2.0f, 0.8f, 0.0f, false, 3},  /* 0.428 + 0.260 + 0.158 */
        {2.0f, 1.0f, 0.3f, true, 2},   /* e^-1 = 0.37 of the first, e^-2 = 0.14 not */
        {2.0f, 1.0f, 0.3f, false, 3},  /* e^-0.5, e^-1, not e^-1.5 = 0.22 */
        {0.5f, 0.9f, 0.0f, true, 3},   /* 0.636 + 0.234 + 0.086 */
        {0.5f, 0.9f, 0.0f, false, 2},  /* 0.867 + 0.117 */
        {1.0f, 0.8f, 0.3f, true, 2},   /* at T = 1 the two orders are one */
        {1.0f, 0.8f, 0.3f, false, 2},
    };
    tl_distribution d;
    tl_distribution_init(&d, 5);
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        CHECK(tl_distribution_build(&d, logits, cases[c].temperature, 5, cases[c].top_p, cases[c].min_p, cases[c].last), "build");
        CHECK(d.n == cases[c].want, "case %zu: %d candidates, want %d", c, d.n, cases[c].want);
        /* the tokens left at the temperature, either way: p_i / p_0 = exp((l_i - l_0) / T) */
        double sum = 0.0;
        for (int i = 0; i < d.n; i++) {
            sum += d.probs[i];
            const double ratio = exp(((double)logits[d.ids[i]] - 3.0) / (double)cases[c].temperature);
            CHECK(d.ids[i] == i && fabs(d.probs[i] / d.probs[0] - ratio) < 1e-12, "case %zu candidate %d: p / p_first %.6f, want %.6f",
                  c, i, d.probs[i] / d.probs[0], ratio);
        }
        CHECK(fabs(sum - 1.0) < 1e-12, "case %zu: probabilities sum to %.15f", c, sum);
    }
    tl_distribution_free(&d);
    /* in a session: validated as a flag, and sampling follows it (seeded: some seed differs) */
    tl_generate_config cfg;
    init_cfg(&cfg);
    cfg.temperature_last = 2;
    int32_t prompt[3] = {7, 8, 9}, first[CAP], last[CAP];
    int32_t out[4];
    int n_out = 0;
    CHECK(tl_generate(model, prompt, 3, &cfg, out, 4, &n_out, NULL) == TL_ERR_INVALID_ARGUMENT &&
              strstr(tl_last_error(), "temperature_last = 2 must be 0 or 1"),
          "temperature_last 2: %s", tl_last_error());
    cfg.ignore_eos = 1;
    cfg.temperature = 1.7f;
    cfg.top_p = 0.6f;
    bool differs = false;
    for (uint64_t seed = 1; seed <= 8 && !differs; seed++) {
        cfg.sample_seed = seed;
        cfg.temperature_last = 0;
        const int n_first = gen(model, prompt, 3, &cfg, first, NULL);
        cfg.temperature_last = 1;
        const int n_last = gen(model, prompt, 3, &cfg, last, NULL);
        differs = n_first != n_last || memcmp(first, last, (size_t)n_first * sizeof *first) != 0;
    }
    CHECK(differs, "temperature_last changed no sampled generation over 8 seeds");
}

/* min_p (tinyloop.h): after top-k and top-p, the candidates at least min_p times as likely
   as the first, renormalised; on one row by hand, then in generation. */
static void test_min_p(void) {
    /* At T = 1, relative to the first (2.5): ids 1 and 3 1.0, 5 0.449, 0 0.223, 6 0.202,
       2 0.111, 4 0.030; 7 is banned. */
    const float logits[8] = {1.0f, 2.5f, 0.3f, 2.5f, -1.0f, 1.7f, 0.9f, -INFINITY};
    const struct { int top_k; float top_p, min_p; int want; } cases[] = {
        {8, 1.0f, 0.0f, 7},  {8, 1.0f, 0.2f, 5}, {8, 1.0f, 0.21f, 4}, {8, 1.0f, 0.5f, 2},
        {8, 1.0f, 1.0f, 2},  /* the tie with the first stays */
        {8, 0.8f, 0.3f, 3},  /* the nucleus (1, 3, 5: 0.81) first, then min_p inside it */
        {8, 0.8f, 0.5f, 2},  {3, 1.0f, 0.21f, 3}, {4, 1.0f, 0.21f, 4}, {5, 1.0f, 0.21f, 4},
    };
    tl_distribution d;
    tl_distribution_init(&d, 8);
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        CHECK(tl_distribution_build(&d, logits, 1.0f, cases[c].top_k, cases[c].top_p, cases[c].min_p, false), "build");
        CHECK(d.n == cases[c].want, "top_k %d top_p %g min_p %g: %d candidates, want %d", cases[c].top_k,
              (double)cases[c].top_p, (double)cases[c].min_p, d.n, cases[c].want);
        double sum = 0.0;
        for (int i = 0; i < d.n; i++) {
            sum += d.probs[i];
            const double ratio = exp((double)logits[d.ids[i]] - 2.5);
            CHECK(fabs(d.probs[i] / d.probs[0] - ratio) < 1e-12 && ratio >= (double)cases[c].min_p,
                  "case %zu candidate %d (id %d): p / p_first %.6f, want %.6f", c, i, d.ids[i], d.probs[i] / d.probs[0], ratio);
        }
        CHECK(fabs(sum - 1.0) < 1e-12, "case %zu: probabilities sum to %.15f", c, sum);
    }
    /* The nucleus ends where its mass reaches top_p, exactly reached too (the shortest prefix:
       a mass that had to pass top_p kept the next token): two tied tokens of 0.5 each under
       top_p 0.5 are the first alone (ties rank by id); four of 0.25 under 0.5, two. */
    float tied[8];
    for (int ties = 2; ties <= 4; ties += 2) {
        for (int i = 0; i < 8; i++) tied[i] = i >= 3 && i < 3 + ties ? 4.0f : -INFINITY;
        CHECK(tl_distribution_build(&d, tied, 1.0f, 8, 0.5f, 0.0f, false), "build");
        CHECK(d.n == ties / 2 && d.ids[0] == 3 && (ties == 2 || d.ids[1] == 4),
              "%d tied tokens under top_p 0.5: %d candidates (first id %d), want %d", ties, d.n, d.ids[0], ties / 2);
    }
    tl_distribution_free(&d);

    /* In generation: sampling at T = 1 with min_p = 1 keeps only the most likely token (the
       model's logits have no ties), so every seed decodes greedily; without it, some seed
       does not (the test's strength). */
    int32_t prompt[3] = {7, 8, 9}, greedy[CAP], sampled[CAP];
    tl_generate_config cfg;
    init_cfg(&cfg);
    cfg.ignore_eos = 1;
    const int n_greedy = gen(model, prompt, 3, &cfg, greedy, NULL);
    cfg.temperature = 1.0f;
    cfg.top_k = vocab;
    bool some_seed_differs = false;
    for (uint64_t seed = 1; seed <= 4; seed++) {
        cfg.sample_seed = seed;
        cfg.min_p = 0.0f;
        int n = gen(model, prompt, 3, &cfg, sampled, NULL);
        some_seed_differs |= n != n_greedy || memcmp(sampled, greedy, (size_t)n * sizeof(int32_t)) != 0;
        cfg.min_p = 1.0f;
        n = gen(model, prompt, 3, &cfg, sampled, NULL);
        CHECK(n == n_greedy && memcmp(sampled, greedy, (size_t)n * sizeof(int32_t)) == 0,
              "min_p = 1, seed %llu: not the greedy tokens", (unsigned long long)seed);
        tl_generate_config spec = cfg; /* speculative sampling draws from the same distribution */
        spec.speculative = TL_SPECULATIVE_CHAIN;
        spec.draft_loops = 1;
        spec.draft_ahead = 3;
        n = gen(model, prompt, 3, &spec, sampled, NULL);
        CHECK(n == n_greedy && memcmp(sampled, greedy, (size_t)n * sizeof(int32_t)) == 0,
              "chain speculation, min_p = 1, seed %llu: not the greedy tokens", (unsigned long long)seed);
    }
    CHECK(some_seed_differs, "sampling at T = 1 decoded greedily for every seed (test too weak)");
}

/* min_tokens (tinyloop.h, vLLM's): eos and one-token stop sequences banned, stop sequences
   matched from the min_tokens-th new token on; the same in every mode. */
static void test_min_tokens(void) {
    int32_t prompt[3] = {7, 8, 9}, out[CAP], other[CAP];
    tl_generate_stats st;
    tl_generate_config cfg;
    /* eos as every step's favourite (logit_bias), the real model's logits under it */
    const tl_logit_bias to_eos[1] = {{eos, 100.0f}};
    init_cfg(&cfg);
    cfg.logit_bias = to_eos;
    cfg.n_logit_bias = 1;
    int n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 4 && out[3] == eos && st.stop_reason == TL_STOP_EOS, "without min_tokens: eos first (len %d)", n);
    cfg.min_tokens = 5;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 9 && out[8] == eos && st.stop_reason == TL_STOP_EOS && st.tokens_emitted == 6,
          "min_tokens 5: five tokens, then eos (len %d, %s)", n, tl_stop_reason_name(st.stop_reason));
    for (int i = 3; i < 8; i++) CHECK(out[i] != eos, "token %d is eos", i);
    const int n_plain = n;
    int32_t plain[CAP];
    memcpy(plain, out, (size_t)n * sizeof(int32_t));
    /* every mode: chain and tree speculation, a batch, beam search (its first five tokens
       cannot end it), and a state saved after 2 tokens and resumed */
    tl_generate_config mode = cfg;
    mode.speculative = TL_SPECULATIVE_CHAIN;
    mode.draft_loops = 1;
    mode.draft_ahead = 4;
    n = gen(model, prompt, 3, &mode, other, NULL);
    CHECK(n == n_plain && memcmp(other, plain, (size_t)n * sizeof(int32_t)) == 0, "chain speculation differs");
    mode.speculative = TL_SPECULATIVE_TREE;
    n = gen(model, prompt, 3, &mode, other, NULL);
    CHECK(n == n_plain && memcmp(other, plain, (size_t)n * sizeof(int32_t)) == 0, "tree speculation differs");
    {
        const tl_token_seq prompts[2] = {{prompt, 3}, {prompt, 3}};
        int32_t flat[2 * CAP];
        int out_lens[2] = {0, 0}, total = 0;
        CHECK(tl_generate_batch(model, prompts, 2, &cfg, flat, 2 * CAP, out_lens, &total, NULL) == TL_OK, "batch: %s",
              tl_last_error());
        CHECK(out_lens[0] == n_plain && out_lens[1] == n_plain &&
                  memcmp(flat, plain, (size_t)n_plain * sizeof(int32_t)) == 0 &&
                  memcmp(flat + n_plain, plain, (size_t)n_plain * sizeof(int32_t)) == 0,
              "batch: lengths %d %d", out_lens[0], out_lens[1]);
    }
    mode = cfg;
    mode.beam_size = 3;
    n = gen(model, prompt, 3, &mode, other, NULL);
    CHECK(n >= 9, "beam search ended after %d new tokens", n - 3);
    for (int i = 3; i < n && i < 8; i++) CHECK(other[i] != eos, "beam token %d is eos", i);
    {
        tl_session *s = NULL, *resumed = NULL;
        tl_session_state *state = NULL, *read_back = NULL;
        void *bytes = NULL;
        size_t len = 0;
        int32_t token;
        tl_stop_reason stop = TL_STOP_NONE;
        CHECK(tl_session_new(model, prompt, 3, &cfg, &s) == TL_OK, "session: %s", tl_last_error());
        for (int i = 0; s && i < 2; i++) tl_session_step(s, &token, &stop);
        CHECK(s && tl_session_save(s, &state) == TL_OK && tl_session_state_to_bytes(state, &bytes, &len) == TL_OK &&
                  tl_session_state_from_bytes(model, bytes, len, &read_back) == TL_OK &&
                  tl_session_resume(model, read_back, NULL, &resumed) == TL_OK,
              "save, read back and resume: %s", tl_last_error());
        stop = TL_STOP_NONE;
        while (resumed && stop == TL_STOP_NONE && tl_session_step(resumed, &token, &stop) == TL_OK) {
        }
        int n_resumed = 0;
        const int32_t *tokens = resumed ? tl_session_tokens(resumed, &n_resumed) : NULL;
        CHECK(tokens && n_resumed == n_plain && memcmp(tokens, plain, (size_t)n_plain * sizeof(int32_t)) == 0,
              "the resumed state lost min_tokens (%d tokens)", n_resumed);
        tl_session_free(s);
        tl_session_free(resumed);
        tl_session_state_free(state);
        tl_session_state_free(read_back);
        tl_free(bytes);
    }
    /* ignore_eos: eos is no end, so it is not banned */
    cfg.ignore_eos = 1;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 15 && out[3] == eos && st.stop_reason == TL_STOP_MAX_TOKENS, "ignore_eos: eos not banned (len %d)", n);

    /* A one-token stop sequence is banned like eos (a script of 10s against {10}); longer
       ones match from the min_tokens-th token on (10 11 10 11 ... against {10, 11}). */
    const int32_t script[2] = {10, 11};
    script_t tens = {script, 1, 3, 0}, s = {script, 2, 3, 0};
    const int32_t ten[1] = {10}, ten_eleven[2] = {10, 11};
    tl_token_seq one[1] = {{ten, 1}}, two[1] = {{ten_eleven, 2}};
    init_cfg(&cfg);
    cfg.logits_processor = force_script;
    cfg.logits_processor_user = &tens;
    cfg.stop_sequences = one;
    cfg.n_stop_sequences = 1;
    cfg.min_tokens = 3;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 7 && out[6] == 10 && st.stop_reason == TL_STOP_SEQUENCE, "one-token stop, min_tokens 3: len %d", n);
    for (int i = 3; i < 6; i++) CHECK(out[i] != 10, "token %d is the banned stop token", i);
    cfg.logits_processor_user = &s;
    cfg.stop_sequences = two;
    const struct { int min_tokens, want_len; } at[] = {{0, 5}, {2, 5}, {3, 7}, {4, 7}, {5, 9}};
    for (size_t i = 0; i < sizeof at / sizeof *at; i++) {
        cfg.min_tokens = at[i].min_tokens;
        n = gen(model, prompt, 3, &cfg, out, &st);
        CHECK(n == at[i].want_len && st.stop_reason == TL_STOP_SEQUENCE && out[n - 2] == 10 && out[n - 1] == 11,
              "{10, 11} with min_tokens %d: len %d, want %d", at[i].min_tokens, n, at[i].want_len);
        /* beam search ends its hypotheses by the same rule (the script leaves one path) */
        tl_generate_config beam = cfg;
        beam.beam_size = 2;
        n = gen(model, prompt, 3, &beam, other, &st);
        CHECK(n == at[i].want_len && memcmp(other, out, (size_t)n * sizeof(int32_t)) == 0 && st.stop_reason == TL_STOP_SEQUENCE,
              "beam, {10, 11} with min_tokens %d: len %d (%s), want %d", at[i].min_tokens, n,
              tl_stop_reason_name(st.stop_reason), at[i].want_len);
    }
}

static void test_stop_reasons(void) {
    int32_t prompt[3] = {7, 8, 9}, out[CAP];
    tl_generate_stats st;
    tl_generate_config cfg;
    const int32_t script[6] = {10, 11, 12, 13, 14, 15};
    script_t s = {script, 6, 3, 0};

    /* EOS, included in the output. */
    const int32_t eos_script[4] = {20, 21, (int32_t)eos, 22};
    script_t se = {eos_script, 4, 3, 0};
    init_cfg(&cfg);
    cfg.logits_processor = force_script;
    cfg.logits_processor_user = &se;
    int n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 6 && out[5] == eos && st.stop_reason == TL_STOP_EOS && st.tokens_emitted == 3,
          "EOS: len %d reason %s", n, tl_stop_reason_name(st.stop_reason));
    cfg.ignore_eos = 1;
    cfg.max_tokens = 9;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 12 && st.stop_reason == TL_STOP_MAX_TOKENS, "ignore_eos: len %d reason %s", n,
          tl_stop_reason_name(st.stop_reason));

    /* Stop sequences of different lengths; the first to complete wins; matched tokens stay. */
    init_cfg(&cfg);
    cfg.logits_processor = force_script;
    cfg.logits_processor_user = &s;
    const int32_t seq_a[3] = {12, 13, 14}, seq_b[2] = {11, 12}, seq_c[1] = {99 % 50};
    tl_token_seq seqs[3] = {{seq_a, 3}, {seq_b, 2}, {seq_c, 1}};
    cfg.stop_sequences = seqs;
    cfg.n_stop_sequences = 3;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 6 && out[4] == 11 && out[5] == 12 && st.stop_reason == TL_STOP_SEQUENCE,
          "stop sequence {11,12}: len %d reason %s", n, tl_stop_reason_name(st.stop_reason));
    cfg.stop_sequences = seqs; /* only the 3-token one */
    cfg.n_stop_sequences = 1;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 8 && out[7] == 14 && st.stop_reason == TL_STOP_SEQUENCE, "stop sequence {12,13,14}: len %d", n);
    /* Spanning the prompt/continuation boundary: {9, 10} stops at the first new token. */
    const int32_t across[2] = {9, 10}, inside[2] = {7, 8};
    tl_token_seq span[2] = {{inside, 2}, {across, 2}};
    cfg.stop_sequences = span;
    cfg.n_stop_sequences = 1; /* a match inside the prompt alone never stops */
    cfg.max_tokens = 4;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 7 && st.stop_reason == TL_STOP_MAX_TOKENS, "prompt-only match stopped: len %d", n);
    cfg.n_stop_sequences = 2;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 4 && out[3] == 10 && st.stop_reason == TL_STOP_SEQUENCE, "boundary match: len %d", n);

    /* Stream callback abort: the aborting token is included; called once per token. */
    init_cfg(&cfg);
    cfg.logits_processor = force_script;
    cfg.logits_processor_user = &s;
    observer_t o = {0, -1, 2, {0}};
    int len = 0;
    CHECK(tl_generate_stream(model, prompt, 3, &cfg, observe, &o, out, CAP, &len, &st) == TL_OK, "stream");
    CHECK(len == 5 && o.calls == 2 && o.seen[1] == 11 && out[4] == 11 && st.stop_reason == TL_STOP_CALLBACK_ABORT,
          "stream abort: len %d calls %d reason %s", len, o.calls, tl_stop_reason_name(st.stop_reason));
    o = (observer_t){0, -1, 1000, {0}};
    cfg.max_tokens = 7;
    tl_generate_stream(model, prompt, 3, &cfg, observe, &o, out, CAP, &len, &st);
    CHECK(o.calls == 7 && len == 10 && memcmp(o.seen, out + 3, 7 * 4) == 0, "stream saw %d tokens", o.calls);
    CHECK(o.last_position == 9, "last position %d", o.last_position);

    /* on_token hook asking to stop, and a stop rule. */
    o = (observer_t){0, -1, 3, {0}};
    cfg.on_token = on_token_stop;
    cfg.on_token_user = &o;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 6 && st.stop_reason == TL_STOP_CALLBACK_ABORT, "on_token stop: len %d", n);
    cfg.on_token = NULL;
    int stop_len = 5;
    cfg.stop_rule = stop_after_len;
    cfg.stop_rule_user = &stop_len;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 5 && st.stop_reason == TL_STOP_CALLBACK_ABORT, "stop_rule: len %d", n);

    /* Grammar: 3, 4, 5, then a dead end. */
    init_cfg(&cfg);
    grammar_state g = {0};
    tl_grammar grammar = {.user = &g, .allowed = grammar_allowed, .advance = grammar_advance};
    cfg.grammar = &grammar;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 6 && out[3] == 3 && out[4] == 4 && out[5] == 5 && st.stop_reason == TL_STOP_GRAMMAR_DEAD_END,
          "grammar: len %d reason %s", n, tl_stop_reason_name(st.stop_reason));

    /* max_tokens = 0 returns the prompt. */
    cfg.grammar = NULL;
    cfg.max_tokens = 0;
    n = gen(model, prompt, 3, &cfg, out, &st);
    CHECK(n == 3 && st.stop_reason == TL_STOP_MAX_TOKENS && st.tokens_emitted == 0, "max_tokens 0: len %d", n);

    /* A hook error aborts with TL_ERR_HOOK; the next call works. */
    init_cfg(&cfg);
    cfg.logits_processor = fail_hook;
    CHECK_ERROR(tl_generate(model, prompt, 3, &cfg, out, CAP, &n, NULL), TL_ERR_HOOK, "logits_processor hook returned error -1");
    cfg.logits_processor = NULL;
    CHECK(tl_generate(model, prompt, 3, &cfg, out, CAP, &n, NULL) == TL_OK, "call after a hook error");
}

static void test_step_batch_stats(void) {
    int32_t p1[3] = {1, 2, 3}, p2[5] = {9, 8, 7, 6, 5}, p3[1] = {40}, out[3 * CAP], ref[CAP];
    tl_generate_config cfg;
    init_cfg(&cfg);
    cfg.temperature = 0.8f;
    cfg.top_k = 20;
    cfg.top_p = 0.95f;
    cfg.repetition_penalty = 1.3f;
    cfg.sample_seed = 123;
    cfg.max_tokens = 12;

    /* Step API == blocking call. */
    tl_session *s = NULL;
    CHECK(tl_session_new(model, p2, 5, &cfg, &s) == TL_OK, "session: %s", tl_last_error());
    int32_t tok;
    tl_stop_reason stop = TL_STOP_NONE;
    int steps = 0;
    while (stop == TL_STOP_NONE && tl_session_step(s, &tok, &stop) == TL_OK) steps++;
    int n_step;
    const int32_t *stepped = tl_session_tokens(s, &n_step);
    tl_generate_stats bst;
    int n = gen(model, p2, 5, &cfg, ref, &bst);
    CHECK(n == n_step && memcmp(stepped, ref, (size_t)n * 4) == 0, "step API (%d) != blocking (%d)", n_step, n);
    CHECK_ERROR(tl_session_step(s, &tok, &stop), TL_ERR_INVALID_ARGUMENT, "already finished");
    const tl_generate_stats *ss = tl_session_stats(s);
    CHECK(ss->tokens_emitted == n - 5 && ss->stop_reason == bst.stop_reason, "stats of the step API");
    tl_session_free(s);

    /* Stats. */
    CHECK(bst.prompt_tokens == 5 && bst.tokens_emitted == n - 5, "stats counts");
    CHECK(bst.prefill_ms > 0 && bst.first_token_ms >= bst.prefill_ms && bst.decode_ms > 0, "stats times %g %g %g",
          bst.prefill_ms, bst.first_token_ms, bst.decode_ms);
    CHECK(bst.loops_used == tl_model_info(model)->default_loops, "loops_used %g", bst.loops_used);
    CHECK(tl_stats_decode_tokens_per_s(&bst) > 0 && tl_stats_prefill_tokens_per_s(&bst) > 0, "rates");
    CHECK(bst.prefill_tokens == 5, "a plain prefill computes the whole prompt: %d", bst.prefill_tokens);
    /* beam search and speculative decoding prefill all but the last prompt token (their first
       step's row): the rate counted 5 tokens in the time of 4, and 1 in no time at all */
    {
        tl_generate_config modes;
        init_cfg(&modes);
        modes.max_tokens = 3;
        for (int mode = 0; mode < 3; mode++) {
            modes.beam_size = mode == 0 ? 2 : 0;
            modes.speculative = mode == 1 ? TL_SPECULATIVE_CHAIN : mode == 2 ? TL_SPECULATIVE_TREE : TL_SPECULATIVE_OFF;
            for (int len = 1; len <= 5; len += 4) {
                tl_generate_stats ms;
                if (gen(model, p2, len, &modes, ref, &ms) < 0) continue;
                CHECK(ms.prefill_tokens == len - 1, "mode %d, a %d-token prompt: prefill_tokens %d", mode, len, ms.prefill_tokens);
                CHECK(len > 1 ? fabs(tl_stats_prefill_tokens_per_s(&ms) - (len - 1) * 1000.0 / ms.prefill_ms) < 1e-6
                              : tl_stats_prefill_tokens_per_s(&ms) == 0,
                      "mode %d, a %d-token prompt: prefill rate %g over %g ms", mode, len, tl_stats_prefill_tokens_per_s(&ms),
                      ms.prefill_ms);
            }
        }
    }
    /* the prefill rate counts the prompt tokens it computed, not those the prefix pool gave */
    {
        tl_generate_stats reused = bst;
        reused.prompt_tokens = 100, reused.prompt_tokens_reused = 60, reused.prefill_ms = 10, reused.prefill_tokens = 40;
        CHECK(fabs(tl_stats_prefill_tokens_per_s(&reused) - 4000.0) < 1e-9, "prefill rate with 60 of 100 reused: %g",
              tl_stats_prefill_tokens_per_s(&reused));
        reused.prompt_tokens_reused = 100, reused.prefill_tokens = 0;
        CHECK(tl_stats_prefill_tokens_per_s(&reused) == 0, "prefill rate with every token reused: %g",
              tl_stats_prefill_tokens_per_s(&reused));
    }
    /* the decode rate counts the tokens after the first (which the prefill's logits gave) */
    CHECK(fabs(tl_stats_decode_tokens_per_s(&bst) - (bst.tokens_emitted - 1) * 1000.0 / bst.decode_ms) < 1e-9,
          "decode rate %g over %d tokens in %g ms", tl_stats_decode_tokens_per_s(&bst), bst.tokens_emitted, bst.decode_ms);
    {
        tl_generate_stats one = bst;
        one.tokens_emitted = 1;
        CHECK(tl_stats_decode_tokens_per_s(&one) == 0.0, "one token has no decode rate: %g", tl_stats_decode_tokens_per_s(&one));
    }

    /* Batch: flat concatenation + lengths, each prompt with a fresh cache. */
    tl_token_seq prompts[3] = {{p1, 3}, {p2, 5}, {p3, 1}};
    int lens[3], total = 0;
    tl_generate_stats stats[3];
    CHECK(tl_generate_batch(model, prompts, 3, &cfg, out, 3 * CAP, lens, &total, stats) == TL_OK, "batch: %s",
          tl_last_error());
    int at = 0;
    for (int i = 0; i < 3; i++) {
        int m = gen(model, prompts[i].tokens, prompts[i].n, &cfg, ref, NULL);
        CHECK(lens[i] == m && memcmp(out + at, ref, (size_t)m * 4) == 0, "batch item %d differs", i);
        CHECK(stats[i].tokens_emitted == m - prompts[i].n, "batch stats %d", i);
        at += lens[i];
    }
    CHECK(total == at, "batch total %d vs %d", total, at);
    p2[2] = -5;
    CHECK_ERROR(tl_generate_batch(model, prompts, 3, &cfg, out, 3 * CAP, lens, &total, NULL), TL_ERR_INVALID_ARGUMENT,
                "generate_batch: prompt 1: prompt token id -5 at index 2");
    p2[2] = 7;
    CHECK_ERROR(tl_generate_batch(model, prompts, 3, &cfg, out, 10, lens, &total, NULL), TL_ERR_INVALID_ARGUMENT,
                "out_capacity = 10 is too small");
    /* A prompt whose step fails inside the batch is named with its own message (the batch
       call emptied the thread's last error, and this read "prompt 0: "). */
    tl_generate_config failing = cfg;
    failing.logits_processor = fail_hook;
    CHECK_ERROR(tl_generate_batch(model, prompts, 3, &failing, out, 3 * CAP, lens, &total, NULL), TL_ERR_HOOK,
                "generate_batch: prompt 0: logits_processor hook returned error -1");
}

static void test_cache_window(void) {
    int32_t prompt[6] = {3, 1, 4, 1, 5, 9}, full[CAP], windowed[CAP];
    tl_generate_config cfg;
    init_cfg(&cfg);
    cfg.max_tokens = 20;
    cfg.ignore_eos = 1;
    int n = gen(model, prompt, 6, &cfg, full, NULL);
    cfg.cache_window = 26; /* never reached: identical output */
    CHECK(gen(model, prompt, 6, &cfg, windowed, NULL) == n && memcmp(full, windowed, (size_t)n * 4) == 0,
          "window wider than the sequence changed the output");
    cfg.cache_window = 4;
    tl_session *s = NULL;
    CHECK(tl_session_new(model, prompt, 6, &cfg, &s) == TL_OK, "windowed session");
    CHECK(s->cache->capacity <= 8, "windowed cache holds %d rows for a 26-token run", s->cache->capacity);
    int32_t tok;
    tl_stop_reason stop = TL_STOP_NONE;
    while (stop == TL_STOP_NONE && tl_session_step(s, &tok, &stop) == TL_OK) {}
    CHECK(s->n_tokens == 26, "windowed run length %d", s->n_tokens);
    tl_session_free(s);
    /* The window is exactly W positions, a row's own included: rows 0 .. W-1 see the whole
       sequence (an unwindowed session's log-probabilities), row W is the first to lose row 0
       (a window of W + 1 positions had passed as the first's equal). Stepped in lockstep
       from a 2-token prompt: step k reads row k. */
    for (int window = 3; window <= 5; window++) {
        tl_generate_config plain;
        init_cfg(&plain);
        plain.max_tokens = 8;
        plain.ignore_eos = 1;
        tl_generate_config cut = plain;
        cut.cache_window = window;
        tl_session *whole = NULL, *windowed_session = NULL;
        CHECK(tl_session_new(model, prompt, 2, &plain, &whole) == TL_OK &&
                  tl_session_new(model, prompt, 2, &cut, &windowed_session) == TL_OK, "sessions: %s", tl_last_error());
        for (int row = 1; whole && windowed_session && row <= window; row++) { /* (the step reading row `row`) */
            int32_t token_whole, token_cut;
            tl_stop_reason stop_whole, stop_cut;
            float lp_whole, lp_cut, top_whole[5], top_cut[5];
            int32_t ids_whole[5], ids_cut[5];
            CHECK(tl_session_step(whole, &token_whole, &stop_whole) == TL_OK &&
                      tl_session_step(windowed_session, &token_cut, &stop_cut) == TL_OK &&
                      tl_session_logprobs(whole, 5, &lp_whole, ids_whole, top_whole) == TL_OK &&
                      tl_session_logprobs(windowed_session, 5, &lp_cut, ids_cut, top_cut) == TL_OK,
                  "window %d, row %d: %s", window, row, tl_last_error());
            const bool same = memcmp(ids_whole, ids_cut, sizeof ids_whole) == 0 && memcmp(top_whole, top_cut, sizeof top_whole) == 0;
            CHECK(same == (row < window), "window %d: row %d's log-probabilities %s the unwindowed session's", window, row,
                  same ? "equal" : "differ from");
            if (!same) break;
        }
        tl_session_free(whole);
        tl_session_free(windowed_session);
    }
}

static void test_validation(void) {
    int32_t prompt[3] = {1, 2, 3}, out[CAP];
    const struct tl_model_info *info = tl_model_info(model);
    tl_generate_config cfg;
    int n;
#define BAD(field_set, needle)                                                             \
    do {                                                                                   \
        init_cfg(&cfg);                                                     \
        field_set;                                                                         \
        CHECK_ERROR(tl_generate(model, prompt, 3, &cfg, out, CAP, &n, NULL), TL_ERR_INVALID_ARGUMENT, needle); \
    } while (0)
    BAD(cfg.max_tokens = -1, "max_tokens = -1 must be >= 0");
    BAD(cfg.max_tokens = info->max_seq_len, "exceeds max_seq_len");
    BAD(cfg.loops = info->max_loops + 1, "loops = ");
    BAD(cfg.loops = -1, "loops = -1 is out of range");
    BAD(cfg.temperature = -0.5f, "temperature = -0.5 must be");
    BAD(cfg.temperature = NAN, "temperature = nan");
    BAD(cfg.speculative = (tl_speculative_mode)7, "speculative = 7 is not a mode (0 off, 1 chain, 2 tree)");
    BAD((cfg.speculative = TL_SPECULATIVE_CHAIN, cfg.draft_loops = 1, cfg.draft_ahead = 0), "draft_ahead = 0 is out of range [1, ");
    BAD((cfg.temperature = 0.7f, cfg.top_k = 0), "top_k = 0 must be >= 1 when sampling"); /* (cfg as the block below takes it) */
    {   /* beam search ignores the sampling knobs (SPEC §3): a top_k it never reads is no error */
        tl_generate_config beam = cfg, plain = cfg;
        beam.beam_size = plain.beam_size = 2;
        beam.temperature = 0.7f;
        beam.top_k = 0;
        int32_t a[CAP], b[CAP];
        int na = 0, nb = 0;
        CHECK(tl_generate(model, prompt, 3, &beam, a, CAP, &na, NULL) == TL_OK, "beam with top_k 0: %s", tl_last_error());
        CHECK(tl_generate(model, prompt, 3, &plain, b, CAP, &nb, NULL) == TL_OK && na == nb &&
                  memcmp(a, b, (size_t)na * sizeof *a) == 0, "beam with sampling knobs differs");
    }
    BAD(cfg.top_p = 0.0f, "top_p = 0 must be in (0, 1]");
    BAD(cfg.top_p = 1.5f, "top_p = 1.5");
    BAD(cfg.repetition_penalty = 0.0f, "repetition_penalty = 0");
    BAD(cfg.presence_penalty = NAN, "presence_penalty = nan must be finite");
    BAD(cfg.frequency_penalty = -INFINITY, "frequency_penalty = -inf must be finite");
    BAD(cfg.min_p = -0.1f, "min_p = -0.1 must be in [0, 1]");
    BAD(cfg.min_p = 1.5f, "min_p = 1.5 must be in [0, 1]");
    BAD(cfg.min_p = NAN, "min_p = nan");
    BAD(cfg.min_tokens = -1, "min_tokens = -1 must be in [0, max_tokens = 12]");
    BAD(cfg.min_tokens = 13, "min_tokens = 13 must be in [0, max_tokens = 12]");
    BAD(cfg.n_logit_bias = 1, "n_logit_bias = 1 without logit_bias");
    BAD(cfg.n_logit_bias = -1, "n_logit_bias = -1 must be >= 0");
    static const tl_logit_bias twice[2] = {{7, 1.0f}, {7, 2.0f}}, outside[1] = {{-1, 1.0f}};
    static tl_logit_bias not_finite[2] = {{3, 1.0f}, {4, 0.0f}};
    not_finite[1].bias = NAN;
    BAD((cfg.logit_bias = twice, cfg.n_logit_bias = 2), "logit_bias: token id 7 is listed twice");
    BAD((cfg.logit_bias = outside, cfg.n_logit_bias = 1), "logit_bias: token id -1 is out of range");
    BAD((cfg.logit_bias = not_finite, cfg.n_logit_bias = 2), "logit_bias: the bias of token id 4 = nan must be finite");
    BAD(cfg.cache_window = -3, "cache_window = -3");
    BAD(cfg.n_stop_sequences = 2, "n_stop_sequences = 2 without stop_sequences");
    static const int32_t bad_seq[2] = {1, 100000};
    static tl_token_seq seqs[1] = {{bad_seq, 2}};
    BAD((cfg.stop_sequences = seqs, cfg.n_stop_sequences = 1), "stop_sequences[0] token id 100000");
    static tl_token_seq empty[1] = {{bad_seq, 0}};
    BAD((cfg.stop_sequences = empty, cfg.n_stop_sequences = 1), "stop_sequences[0] is empty");
    BAD(cfg.beam_size = -1, "beam_size = -1");
    BAD(cfg.length_penalty = INFINITY, "length_penalty = inf");
    BAD(cfg.early_exit_patience = -1, "early_exit_patience = -1");
    BAD(cfg.early_exit_min_L = 0, "early_exit_min_L = 0");
    /* with early exit on, past max_loops no loop is checked (taken, early exit never ran) */
    BAD((cfg.early_exit_patience = 1, cfg.early_exit_min_L = tl_model_info(model)->max_loops + 1),
        "no loop would be checked");
    BAD(cfg.early_exit_peek_every = 0, "early_exit_peek_every = 0");
    BAD(cfg.early_exit_logit_margin = -1.0f, "early_exit_logit_margin = -1");
    static tl_grammar half = {.allowed = grammar_allowed};
    BAD(cfg.grammar = &half, "grammar needs both");
#undef BAD
    init_cfg(&cfg);
    CHECK_ERROR(tl_generate(model, prompt, 0, &cfg, out, CAP, &n, NULL), TL_ERR_INVALID_ARGUMENT, "prompt_len = 0");
    CHECK_ERROR(tl_generate(model, NULL, 3, &cfg, out, CAP, &n, NULL), TL_ERR_INVALID_ARGUMENT, "prompt must not be NULL");
    CHECK_ERROR(tl_generate(NULL, prompt, 3, &cfg, out, CAP, &n, NULL), TL_ERR_INVALID_ARGUMENT, "model must not be NULL");
    CHECK_ERROR(tl_generate(model, prompt, 3, &cfg, out, 10, &n, NULL), TL_ERR_INVALID_ARGUMENT, "out_capacity = 10");
    CHECK_ERROR(tl_generate(model, prompt, 3, &cfg, NULL, CAP, &n, NULL), TL_ERR_INVALID_ARGUMENT, "out must not be NULL");
    prompt[1] = info->vocab_size;
    CHECK_ERROR(tl_generate(model, prompt, 3, &cfg, out, CAP, &n, NULL), TL_ERR_INVALID_ARGUMENT, "prompt token id");
    prompt[1] = 2;
    cfg.beam_size = 3;
    cfg.cache_window = 4;
    CHECK_ERROR(tl_session_new(model, prompt, 3, &cfg, &(tl_session *){NULL}), TL_ERR_UNSUPPORTED,
                "beam search (beam_size = 3) does not support cache_window");
    cfg.cache_window = 0;
    tl_session *s = (tl_session *)1;
    cfg.beam_size = 0;
    cfg.top_p = 2.0f;
    CHECK_ERROR(tl_session_new(model, prompt, 3, &cfg, &s), TL_ERR_INVALID_ARGUMENT, "top_p = 2");
    CHECK(s == NULL, "session out must be NULL on error");
    CHECK(strcmp(tl_stop_reason_name(TL_STOP_GRAMMAR_DEAD_END), "GRAMMAR_DEAD_END") == 0, "reason names");
}

/* The output buffer's bounds at their edge: one int short of prompt + max_tokens is refused
   and nothing is written past what was given; exactly that many is taken (tl_generate and
   tl_generate_batch). */
static void test_capacity_edges(void) {
    int32_t prompt[3] = {1, 2, 3}, out[CAP];
    tl_generate_config cfg;
    init_cfg(&cfg); /* 12 tokens: 15 ints a prompt */
    cfg.ignore_eos = true;
    int n = 0;
    for (int i = 0; i < CAP; i++) out[i] = -99;
    CHECK_ERROR(tl_generate(model, prompt, 3, &cfg, out, 14, &n, NULL), TL_ERR_INVALID_ARGUMENT, "out_capacity = 14 is too small");
    CHECK(out[14] == -99, "out[14] written past the 14 given: %d", out[14]);
    CHECK(tl_generate(model, prompt, 3, &cfg, out, 15, &n, NULL) == TL_OK && n == 15, "capacity 15: %s", tl_last_error());
    CHECK(out[15] == -99, "out[15] written: %d", out[15]);
    tl_token_seq prompts[2] = {{prompt, 3}, {prompt, 3}};
    int lens[2], total = 0;
    for (int i = 0; i < CAP; i++) out[i] = -99;
    CHECK_ERROR(tl_generate_batch(model, prompts, 2, &cfg, out, 29, lens, &total, NULL), TL_ERR_INVALID_ARGUMENT,
                "out_capacity = 29 is too small");
    CHECK(out[29] == -99, "batch: out[29] written past the 29 given: %d", out[29]);
    CHECK(tl_generate_batch(model, prompts, 2, &cfg, out, 30, lens, &total, NULL) == TL_OK && total == 30,
          "batch capacity 30: %s", tl_last_error());
    CHECK(out[30] == -99, "batch: out[30] written: %d", out[30]);
}

/* A hook that fails at its `fail_at`-th call (user: its counter). */
static int fail_later(void *user, float *logits, int v, const int32_t *tokens, int n) {
    (void)logits; (void)v; (void)tokens; (void)n;
    int *calls = user;
    return ++calls[0] == calls[1] ? TL_HOOK_ERROR : 0;
}
/* A hook that sleeps 20 ms at every call after the first: the first token comes before any. */
static int slow_after_first(void *user, float *logits, int v, const int32_t *tokens, int n) {
    (void)logits; (void)v; (void)tokens; (void)n;
    if (++*(int *)user > 1) nanosleep(&(struct timespec){0, 20 * 1000000L}, NULL);
    return 0;
}

/* The stats of a generation its hook failed are filled as far as it went (the caller's
   struct was left as it was); first_token_ms is the first token's time, not the last's. */
static void test_stats_edges(void) {
    int32_t prompt[3] = {1, 2, 3}, out[CAP];
    tl_generate_config cfg;
    init_cfg(&cfg);
    cfg.ignore_eos = true;
    int calls[2] = {0, 3}, n = 0;
    cfg.logits_processor = fail_later;
    cfg.logits_processor_user = calls;
    tl_generate_stats st;
    memset(&st, 0, sizeof st);
    st.tokens_emitted = -1;
    CHECK_ERROR(tl_generate(model, prompt, 3, &cfg, out, CAP, &n, &st), TL_ERR_HOOK, "logits_processor");
    CHECK(st.tokens_emitted == 2 && st.prompt_tokens == 3, "stats after a failure at the third token: %d emitted, %d prompt",
          st.tokens_emitted, st.prompt_tokens);
    int slow_calls = 0;
    cfg.logits_processor = slow_after_first;
    cfg.logits_processor_user = &slow_calls;
    cfg.max_tokens = 5;
    const double start = tl_now_ms(); /* (the engine's own monotonic clock) */
    CHECK(tl_generate(model, prompt, 3, &cfg, out, CAP, &n, &st) == TL_OK, "%s", tl_last_error());
    const double total = tl_now_ms() - start;
    /* (four sleeps of 20 ms after the first token: at least 80 ms between it and the end) */
    CHECK(total - st.first_token_ms >= 70.0, "first_token_ms %.1f of %.1f ms: not the first token's", st.first_token_ms, total);
}

int main(int argc, char **argv) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/add_residual_statenorm_rms_gqa2", argc > 1 ? argv[1] : "tests/data/golden");
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 2;
    if (tl_model_load(dir, &o, &model) != TL_OK) { printf("load: %s\n", tl_last_error()); return 1; }
    o.n_threads = 1;
    if (tl_model_load(dir, &o, &model_1thread) != TL_OK) return 1;
    vocab = tl_model_info(model)->vocab_size;
    eos = tl_model_info(model)->eos_token_id;
    test_greedy_matches_score();
    test_argmax();
    test_top_k_radix();
    test_sampling_knobs();
    test_distribution_chi_square();
    test_repetition_penalty();
    test_logit_adjustments();
    test_penalty_window();
    test_min_p();
    test_temperature_last();
    test_min_tokens();
    test_stop_reasons();
    test_step_batch_stats();
    test_cache_window();
    test_validation();
    test_capacity_edges();
    test_stats_edges();
    tl_model_free(model);
    tl_model_free(model_1thread);
    return check_summary();
}

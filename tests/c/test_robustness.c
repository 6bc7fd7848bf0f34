/* test_robustness.c: the decoding findings of the hostile-user probe (issue 11), each fed its
 * input in every decoder it concerns:
 *   - +inf logits share the probability mass and NaN counts as -inf (finding 2): T = 1 with
 *     logits[7] = +inf gives 7, 7, 7, 7 in plain sampling, chain speculative sampling and beam
 *     search, whatever the other logits;
 *   - beam search with no allowed token stops like plain decoding (finding 3);
 *   - prompt_len + max_tokens does not overflow before validation (finding 9, UBSan);
 *   - the stream callback's stop is honoured by beam search (finding 15);
 *   - tl_generate_batch(prompts = NULL) says so (finding 13).
 * The hook closing or stepping its own session (finding 1) is in test_modes.c; the loader's
 * findings (4, 7, 13, 14) in test_load_errors.c. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "tinyloop.h"

#define N_TOKENS 4

static tl_model *model;

/* Sets logits[7] = +inf (and, with `noise`, others to huge finite or NaN values). */
static int inf_at_7(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    (void)tokens; (void)n;
    const int noise = *(const int *)user;
    if (noise) {
        for (int i = 0; i < vocab; i += 3) logits[i] = 3e38f;
        for (int i = 1; i < vocab; i += 5) logits[i] = NAN;
    }
    logits[7] = INFINITY;
    return TL_HOOK_CONTINUE;
}

/* Every logit -inf, or NaN: nothing is allowed. */
static int nothing_allowed(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    (void)tokens; (void)n;
    const float v = *(const int *)user ? NAN : -INFINITY;
    for (int i = 0; i < vocab; i++) logits[i] = v;
    return TL_HOOK_CONTINUE;
}

/* NaN everywhere but token 9: NaN counts as -inf, so 9 is the only choice. */
static int only_9(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    (void)user; (void)tokens; (void)n;
    for (int i = 0; i < vocab; i++) logits[i] = i == 9 ? 0.0f : NAN;
    return TL_HOOK_CONTINUE;
}

static const char *mode_name(int mode) { return mode == 0 ? "plain" : mode == 1 ? "chain" : "beam"; }

static void set_mode(tl_generate_config *c, int mode) {
    if (mode == 1) { c->speculative = TL_SPECULATIVE_CHAIN; c->loops = 4; c->draft_loops = 1; }
    if (mode == 2) c->beam_size = 3;
}

static void infinite_logits(void) {
    const int32_t prompt[3] = {5, 6, 8};
    for (int mode = 0; mode < 3; mode++)
        for (int noise = 0; noise < 2; noise++)
            for (uint64_t seed = 1; seed <= 3; seed++) {
                tl_generate_config c;
                tl_generate_config_init(&c);
                c.max_tokens = N_TOKENS;
                c.temperature = 1.0f;
                c.top_k = 50;
                c.sample_seed = seed;
                c.ignore_eos = 1;
                c.logits_processor = inf_at_7;
                c.logits_processor_user = &noise;
                set_mode(&c, mode);
                int32_t out[16];
                int len = 0;
                tl_generate_stats stats;
                tl_status st = tl_generate(model, prompt, 3, &c, out, 16, &len, &stats);
                CHECK(st == TL_OK && len == 3 + N_TOKENS && stats.stop_reason == TL_STOP_MAX_TOKENS,
                      "%s noise %d: %s (%s), %d tokens, stop %s", mode_name(mode), noise, tl_status_name(st),
                      tl_last_error(), len, tl_stop_reason_name(stats.stop_reason));
                for (int i = 3; i < len; i++)
                    CHECK(out[i] == 7, "%s noise %d seed %d: token %d is %d, want 7", mode_name(mode), noise,
                          (int)seed, i - 3, out[i]);
            }
    /* NaN is -inf: the one non-NaN logit wins, sampled or greedy. */
    for (int mode = 0; mode < 3; mode++)
        for (int greedy = 0; greedy < 2; greedy++) {
            tl_generate_config c;
            tl_generate_config_init(&c);
            c.max_tokens = N_TOKENS;
            c.temperature = greedy ? 0.0f : 1.0f;
            c.ignore_eos = 1;
            c.logits_processor = only_9;
            set_mode(&c, mode);
            int32_t out[16];
            int len = 0;
            tl_status st = tl_generate(model, prompt, 3, &c, out, 16, &len, NULL);
            CHECK(st == TL_OK && len == 3 + N_TOKENS, "%s NaN: %s (%s)", mode_name(mode), tl_status_name(st), tl_last_error());
            for (int i = 3; i < len; i++) CHECK(out[i] == 9, "%s NaN greedy %d: token %d", mode_name(mode), greedy, out[i]);
        }
}

static void no_allowed_token(void) {
    const int32_t prompt[2] = {5, 6};
    for (int mode = 0; mode < 3; mode++)
        for (int nan = 0; nan < 2; nan++)
            for (int greedy = 0; greedy < 2; greedy++) {
                tl_generate_config c;
                tl_generate_config_init(&c);
                c.max_tokens = N_TOKENS;
                c.temperature = greedy ? 0.0f : 1.0f;
                c.logits_processor = nothing_allowed;
                c.logits_processor_user = &nan;
                set_mode(&c, mode);
                int32_t out[16];
                int len = -1;
                tl_generate_stats stats;
                tl_status st = tl_generate(model, prompt, 2, &c, out, 16, &len, &stats);
                CHECK(st == TL_OK && len == 2 && stats.tokens_emitted == 0 &&
                          stats.stop_reason == TL_STOP_GRAMMAR_DEAD_END,
                      "%s (all %s, greedy %d): %s \"%s\", len %d, stop %s", mode_name(mode), nan ? "NaN" : "-inf",
                      greedy, tl_status_name(st), tl_last_error(), len, tl_stop_reason_name(stats.stop_reason));
            }
}

static void overflow_before_validation(void) {
    const int32_t prompt[2] = {5, 6};
    tl_speculative_config sc;
    tl_speculative_config_init(&sc);
    sc.verify_loops = 4;
    sc.draft_loops = 1;
    int32_t out[8];
    int len = 0;
    for (int k = 0; k < 2; k++) {
        sc.max_tokens = k ? INT_MAX - 1 : INT_MAX; /* prompt_len + max_tokens overflows an int */
        CHECK_ERROR(tl_generate_speculative(model, prompt, 2, &sc, out, 8, &len, NULL), TL_ERR_INVALID_ARGUMENT,
                    "exceeds max_seq_len");
        tl_tree_speculative_config tc;
        tl_tree_speculative_config_init(&tc);
        tc.spec = sc;
        CHECK_ERROR(tl_generate_tree_speculative(model, prompt, 2, &tc, out, 8, &len, NULL), TL_ERR_INVALID_ARGUMENT,
                    "exceeds max_seq_len");
    }
    tl_generate_config c;
    tl_generate_config_init(&c);
    c.max_tokens = INT_MAX;
    for (int mode = 0; mode < 3; mode++) {
        set_mode(&c, mode);
        CHECK_ERROR(tl_generate(model, prompt, 2, &c, out, 8, &len, NULL), TL_ERR_INVALID_ARGUMENT, "exceeds max_seq_len");
        tl_session *s = NULL;
        CHECK_ERROR(tl_session_new(model, prompt, 2, &c, &s), TL_ERR_INVALID_ARGUMENT, "exceeds max_seq_len");
    }
    tl_token_seq seqs[2] = {{prompt, 2}, {prompt, 1}};
    int lens[2];
    CHECK_ERROR(tl_generate_batch(model, seqs, 2, &c, out, 8, lens, &len, NULL), TL_ERR_INVALID_ARGUMENT,
                "exceeds max_seq_len");
}

static int stream_calls;
static bool stop_at_first(void *user, int32_t token, int position) {
    (void)user; (void)token; (void)position;
    stream_calls++;
    return false;
}

static void beam_stream_stop(void) {
    const int32_t prompt[2] = {5, 6};
    for (int mode = 0; mode < 3; mode++) {
        tl_generate_config c;
        tl_generate_config_init(&c);
        c.max_tokens = 6;
        c.ignore_eos = 1;
        set_mode(&c, mode);
        int32_t out[16];
        int len = 0;
        tl_generate_stats stats;
        stream_calls = 0;
        tl_status st = tl_generate_stream(model, prompt, 2, &c, stop_at_first, NULL, out, 16, &len, &stats);
        CHECK(st == TL_OK && len == 3 && stream_calls == 1 && stats.tokens_emitted == 1 &&
                  stats.stop_reason == TL_STOP_CALLBACK_ABORT,
              "%s: %s, len %d, %d callbacks, stop %s", mode_name(mode), tl_status_name(st), len, stream_calls,
              tl_stop_reason_name(stats.stop_reason));
    }
}

static void batch_messages(void) {
    tl_generate_config c;
    tl_generate_config_init(&c);
    int32_t out[8];
    int lens[3], len;
    CHECK_ERROR(tl_generate_batch(model, NULL, 3, &c, out, 8, lens, &len, NULL), TL_ERR_INVALID_ARGUMENT,
                "prompts must not be NULL");
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "tests/data/textmodel";
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 1;
    if (tl_model_load(dir, &o, &model) != TL_OK) {
        printf("cannot load %s: %s\n", dir, tl_last_error());
        return 1;
    }
    infinite_logits();
    no_allowed_token();
    overflow_before_validation();
    beam_stream_stop();
    batch_messages();
    tl_model_free(model);
    return check_summary();
}

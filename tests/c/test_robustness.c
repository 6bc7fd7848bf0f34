/* test_robustness.c: the decoding findings of the hostile-user probe (issue 11), each fed its
 * input in every decoder it concerns:
 *   - +inf logits share the probability mass and NaN counts as -inf (finding 2): T = 1 with
 *     logits[7] = +inf gives 7, 7, 7, 7 in plain sampling, chain speculative sampling and beam
 *     search, whatever the other logits;
 *   - beam search with no allowed token stops like plain decoding (finding 3); a certain beam
 *     scores 0 under any length_penalty (not NaN where its power under- or overflows);
 *   - prompt_len + max_tokens does not overflow before validation (finding 9, UBSan);
 *   - the stream callback's stop is honoured by beam search (finding 15);
 *   - tl_generate_batch(prompts = NULL) says so (finding 13).
 * The hook closing or stepping its own session (finding 1) is in test_modes.c; the loader's
 * findings (4, 7, 13, 14) in test_load_errors.c. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* Writes logits[*user] (an index just outside [0, vocab): -1, -64, vocab, vocab + 63), the
   slip of a 1-based loop: the session must fail with the index, not corrupt the heap. */
static int write_outside(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    (void)tokens; (void)n;
    const int at = *(const int *)user;
    logits[at < 0 ? at : vocab + at] = 1.0f;
    return TL_HOOK_CONTINUE;
}

/* A callback grammar that allows every token and writes mask[*user] too (-1, or vocab + it). */
static int allowed_outside(void *user, uint8_t *mask, int vocab) {
    const int at = *(const int *)user;
    for (int i = 0; i < vocab; i++) mask[i] = 1;
    mask[at < 0 ? at : vocab + at] = 1;
    return vocab;
}
static int advance_any(void *user, int32_t token) { (void)user; (void)token; return 0; }

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
    /* A certain beam (log-probability 0, every step +inf at 7) under a length_penalty whose
       power underflows (len^-2000 = 0) or overflows: its score is 0, not 0 / 0 = NaN (which
       ranked below every other hypothesis). */
    static const float penalties[3] = {-2000.0f, -3e38f, 3e38f};
    for (int i = 0; i < 3; i++) {
        const int noise = 0;
        tl_generate_config c;
        tl_generate_config_init(&c);
        c.max_tokens = N_TOKENS;
        c.ignore_eos = 1;
        c.beam_size = 2;
        c.length_penalty = penalties[i];
        c.logits_processor = inf_at_7;
        c.logits_processor_user = (void *)&noise;
        int32_t out[16];
        int len = 0;
        tl_generate_stats stats;
        tl_status st = tl_generate(model, prompt, 3, &c, out, 16, &len, &stats);
        CHECK(st == TL_OK && len == 3 + N_TOKENS && out[3] == 7 && stats.beam_score == 0.0,
              "length_penalty %g: %s, %d tokens, beam_score %g", (double)penalties[i], tl_status_name(st), len,
              stats.beam_score);
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

/* A logits hook that writes just outside its buffer (finding of the Hugging Face processors'
   port: a suppress list of another model's ids aborted the process with "double free or
   corruption" later), or a callback grammar's mask, fails the generation with TL_ERR_HOOK
   naming the index, in every decoder, and through the step API (under ASan, a write that passed the guard would be a
   heap-buffer-overflow). */
static void logits_written_outside(void) {
    const int32_t prompt[2] = {5, 6};
    const int vocab = tl_model_info(model)->vocab_size;
    const int offsets[4] = {-1, -64, 0, 63}; /* (0 and 63: vocab + that) */
    for (int mode = 0; mode < 3; mode++)
        for (int k = 0; k < 4; k++) {
            tl_generate_config c;
            tl_generate_config_init(&c);
            c.max_tokens = N_TOKENS;
            c.logits_processor = write_outside;
            c.logits_processor_user = (void *)&offsets[k];
            set_mode(&c, mode);
            int32_t out[16];
            int len = 0;
            tl_status st = tl_generate(model, prompt, 2, &c, out, 16, &len, NULL);
            char want[32];
            snprintf(want, sizeof want, "logits[%d]", offsets[k] < 0 ? offsets[k] : vocab + offsets[k]);
            CHECK(st == TL_ERR_HOOK && strstr(tl_last_error(), want) != NULL, "%s, write at %s: %s \"%s\"",
                  mode_name(mode), want, tl_status_name(st), tl_last_error());
        }
    /* a callback grammar's mask, the same (the engine's grammar masks write [0, vocab) only) */
    for (int k = 0; k < 4; k++) {
        tl_grammar g = {.user = (void *)&offsets[k], .allowed = allowed_outside, .advance = advance_any};
        tl_generate_config c;
        tl_generate_config_init(&c);
        c.max_tokens = N_TOKENS;
        c.grammar = &g;
        int32_t out[16];
        int len = 0;
        tl_status st = tl_generate(model, prompt, 2, &c, out, 16, &len, NULL);
        char want[32];
        snprintf(want, sizeof want, "mask[%d]", offsets[k] < 0 ? offsets[k] : vocab + offsets[k]);
        CHECK(st == TL_ERR_HOOK && strstr(tl_last_error(), want) != NULL, "grammar, write at %s: %s \"%s\"", want,
              tl_status_name(st), tl_last_error());
    }
    /* the same hook through the step API: the step fails, the session can be freed */
    tl_generate_config c;
    tl_generate_config_init(&c);
    c.max_tokens = N_TOKENS;
    c.logits_processor = write_outside;
    c.logits_processor_user = (void *)&offsets[2];
    tl_session *s = NULL;
    tl_status st = tl_session_new(model, prompt, 2, &c, &s);
    CHECK(st == TL_OK, "session: %s", tl_last_error());
    if (st == TL_OK) {
        int32_t token;
        tl_stop_reason stop;
        st = tl_session_step(s, &token, &stop);
        CHECK(st == TL_ERR_HOOK, "step: %s \"%s\"", tl_status_name(st), tl_last_error());
        tl_session_free(s);
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

/* The C API hunt (stop 51): NULL where a no-op is the rule, a message naming the argument or
   value at fault, every 0/1 field checked, and no output left behind by a failure. */
static void api_edges(const char *dir) {
    tl_compiled_grammar_retain(NULL); /* (as tl_compiled_grammar_free(NULL): it crashed) */
    /* top 0 with NULL arrays is accepted: no pointer arithmetic on them (UBSan) */
    const int32_t ids[4] = {72, 105, 33, 10};
    float logprobs[3];
    CHECK(tl_score_logprobs(model, ids, 4, 2, 0, logprobs, NULL, NULL) == TL_OK, "%s", tl_last_error());
    tl_generate_config c;
    tl_generate_config_init(&c);
    const tl_token_seq prompt = {ids, 2};
    int lens[1], len;
    CHECK_ERROR(tl_generate_batch(model, &prompt, 1, &c, NULL, 100, lens, &len, NULL), TL_ERR_INVALID_ARGUMENT,
                "generate_batch: out must not be NULL");
    tl_compiled_grammar *g = (tl_compiled_grammar *)1;
    CHECK_ERROR(tl_grammar_compile_json_schema(NULL, 3, NULL, &g), TL_ERR_INVALID_ARGUMENT, "JSON schema: the schema's text is NULL");
    CHECK_ERROR(tl_grammar_compile_regex(NULL, 3, &g), TL_ERR_INVALID_ARGUMENT, "regular expression: the pattern is NULL");
    const tl_json_schema_options odd = {5, 7};
    CHECK_ERROR(tl_grammar_compile_json_schema("{}", 2, &odd, &g), TL_ERR_INVALID_ARGUMENT,
                "free_whitespace = 5 and loose = 7 must each be 0 or 1");
    int32_t out[8];
    c.top_p = 1.0000001f; /* (%g showed it as 1: "top_p = 1 must be in (0, 1]") */
    CHECK_ERROR(tl_generate(model, ids, 2, &c, out, 8, &len, NULL), TL_ERR_INVALID_ARGUMENT, "top_p = 1.00000012 must be in (0, 1]");
    tl_generate_config_init(&c);
    c.ignore_eos = 2;
    CHECK_ERROR(tl_generate(model, ids, 2, &c, out, 8, &len, NULL), TL_ERR_INVALID_ARGUMENT, "ignore_eos = 2 must be 0 or 1");
    tl_generate_config_init(&c);
    const tl_token_seq no_tokens = {NULL, 1};
    c.stop_sequences = &no_tokens, c.n_stop_sequences = 1;
    CHECK_ERROR(tl_generate(model, ids, 2, &c, out, 8, &len, NULL), TL_ERR_INVALID_ARGUMENT, "stop_sequences[0].tokens is NULL (n = 1)");
    tl_generate_config_init(&c);
    const int32_t open_tag[1] = {5};
    c.reasoning_budget = 2, c.reasoning_start = (tl_token_seq){open_tag, 1}, c.reasoning_end = no_tokens;
    CHECK_ERROR(tl_generate(model, ids, 2, &c, out, 8, &len, NULL), TL_ERR_INVALID_ARGUMENT, "reasoning_end.tokens is NULL (n = 1)");
    /* a tag holding an id that ends generation: the budget forces the end's ids past every ban,
       so the reply stopped there, inside its block and before min_tokens (min_tokens 6 ended
       after 2 tokens) */
    int32_t thinking_out[16]; /* (the prompt and 8 tokens) */
    const int32_t eos_end[2] = {tl_model_info(model)->eos_token_id, 7}, stop_id[1] = {9};
    c.reasoning_end = (tl_token_seq){eos_end, 2}, c.min_tokens = 6, c.max_tokens = 8;
    char eos_said[128];
    snprintf(eos_said, sizeof eos_said, "reasoning_end token id %d ends generation (eos_token_id or a one-token stop sequence)",
             eos_end[0]);
    CHECK_ERROR(tl_generate(model, ids, 2, &c, thinking_out, 16, &len, NULL), TL_ERR_INVALID_ARGUMENT, eos_said);
    c.ignore_eos = 1; /* (then eos is a token like another) */
    tl_generate_stats thinking_stats;
    CHECK(tl_generate(model, ids, 2, &c, thinking_out, 16, &len, &thinking_stats) == TL_OK && thinking_stats.tokens_emitted == 8,
          "ignore_eos, eos in the end tag: %s, %d tokens", tl_last_error(), thinking_stats.tokens_emitted);
    const tl_token_seq stop_seq = {stop_id, 1};
    c.stop_sequences = &stop_seq, c.n_stop_sequences = 1, c.reasoning_start = stop_seq;
    CHECK_ERROR(tl_generate(model, ids, 2, &c, thinking_out, 16, &len, NULL), TL_ERR_INVALID_ARGUMENT,
                "reasoning_start token id 9 ends generation");
    tl_generate_config_init(&c);
    /* tags: ends_text and at_least_one are 0 or 1 */
    tl_compiled_grammar *content = NULL;
    CHECK(tl_grammar_compile_gbnf("root ::= \"x\"", 12, &content) == TL_OK, "%s", tl_last_error());
    const char *trigger[1] = {"<t>"};
    tl_grammar_tag tag = {"<t>", content, "</t>", 2};
    CHECK_ERROR(tl_grammar_compile_tags(&tag, 1, trigger, 1, NULL, &g), TL_ERR_INVALID_ARGUMENT, "tags[0].ends_text = 2 must be 0 or 1");
    tag.ends_text = 0;
    const tl_grammar_tags_options tags_odd = {0, 3, 0};
    CHECK_ERROR(tl_grammar_compile_tags(&tag, 1, trigger, 1, &tags_odd, &g), TL_ERR_INVALID_ARGUMENT, "at_least_one = 3 must be 0 or 1");
    const tl_grammar_tags_options first_odd = {0, 0, 2};
    CHECK_ERROR(tl_grammar_compile_tags(&tag, 1, trigger, 1, &first_odd, &g), TL_ERR_INVALID_ARGUMENT, "tag_first = 2 must be 0 or 1");
    tl_compiled_grammar_free(content);
    /* load options: mmap_weights is 0 or 1 */
    tl_load_options o;
    tl_load_options_init(&o);
    o.mmap_weights = 2;
    tl_model *m2 = (tl_model *)1;
    CHECK_ERROR(tl_model_load(dir, &o, &m2), TL_ERR_INVALID_ARGUMENT, "load options: mmap_weights = 2 must be 0 or 1");
    /* a failure leaves no output behind (*out was left as it was) */
    tl_engine *e = (tl_engine *)1;
    CHECK(tl_engine_new(NULL, NULL, &e) == TL_ERR_INVALID_ARGUMENT && e == NULL, "tl_engine_new: %s", tl_last_error());
    tl_detokenizer *d = (tl_detokenizer *)1;
    CHECK(tl_detokenizer_new(NULL, &d) != TL_OK && d == NULL, "tl_detokenizer_new: %s", tl_last_error());
    int32_t *enc = (int32_t *)1;
    int n_enc = 9;
    CHECK(tl_encode(NULL, "x", 1, &enc, &n_enc) != TL_OK && enc == NULL && n_enc == 0, "tl_encode: %s", tl_last_error());
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
    logits_written_outside();
    overflow_before_validation();
    beam_stream_stop();
    batch_messages();
    api_edges(dir);
    tl_model_free(model);
    return check_summary();
}

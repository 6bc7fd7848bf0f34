/* test_logprobs.c: tl_session_logprobs and the serving engine's logprobs.
 *
 * - Each emitted token's log-probability and top alternatives are those of tl_score's row
 *   for its position (the model's own logits: the kernels are batch-invariant, so the
 *   decode row and the scored row are the same bits), log-softmaxed here independently;
 *   with sampling, a repetition penalty and a logits hook the figures stay the model's.
 * - tl_score_logprobs gives a sequence the same figures, to the bit, chunk by chunk.
 * - An on_token hook reads the same figures as the caller after the step.
 * - The engine's updates carry, for a request that asked, exactly (memcmp) the figures of
 *   the same session stepped alone, while other requests share its batches.
 * - Speculative sessions give each token its verification row's figures: a greedy chain or
 *   tree exactly (memcmp) the plain session's, a sampled chain tl_score's rows; so does the
 *   engine for a speculative request.
 * - Refusals: top out of range, before any step, max_tokens = 0, beam sessions (the session
 *   call and the engine's submit). */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>

#include "check.h"
#include "tinyloop.h"

#define PROMPT 4
#define STEPS 12
#define TOP 5

static tl_model *model;
static const int32_t prompt[PROMPT] = {11, 250, 3, 77};

typedef struct {
    int n;
    int32_t tokens[STEPS];
    float logprob[STEPS];
    int32_t top_ids[STEPS][TOP];
    float top_logprobs[STEPS][TOP];
} record;

/* Steps a new session to the end, recording each token's figures after its step. */
static void run_alone(const tl_generate_config *cfg, record *rec) {
    tl_session *s = NULL;
    CHECK(tl_session_new(model, prompt, PROMPT, cfg, &s) == TL_OK, "%s", tl_last_error());
    memset(rec, 0, sizeof *rec);
    tl_stop_reason stop = TL_STOP_NONE;
    while (s && stop == TL_STOP_NONE && rec->n < STEPS) {
        int32_t token;
        if (tl_session_step(s, &token, &stop) != TL_OK || token < 0) break;
        rec->tokens[rec->n] = token;
        CHECK(tl_session_logprobs(s, TOP, &rec->logprob[rec->n], rec->top_ids[rec->n], rec->top_logprobs[rec->n]) == TL_OK,
              "%s", tl_last_error());
        rec->n++;
    }
    tl_session_free(s);
}

/* Reads engine request `id` to its end into *got (each update's figures, TOP alternatives);
   false when it did not finish or an update lacked its figures. */
static bool read_request(tl_engine *e, uint64_t id, record *got) {
    memset(got, 0, sizeof *got);
    bool shapes_ok = true, finished = false;
    while (!finished && tl_engine_wait(e, id, 5000) > 0) {
        tl_engine_update u;
        if (tl_engine_read(e, id, &u) != TL_OK) break;
        shapes_ok &= u.n_tokens == 0 || (u.logprobs && u.top_ids && u.top_logprobs && u.n_top == TOP);
        for (int i = 0; i < u.n_tokens && got->n < STEPS; i++, got->n++) {
            got->tokens[got->n] = u.tokens[i];
            got->logprob[got->n] = u.logprobs[i];
            memcpy(got->top_ids[got->n], u.top_ids + (size_t)i * TOP, sizeof got->top_ids[0]);
            memcpy(got->top_logprobs[got->n], u.top_logprobs + (size_t)i * TOP, sizeof got->top_logprobs[0]);
        }
        finished = u.state == TL_ENGINE_FINISHED;
    }
    return finished && shapes_ok;
}

/* The figures against tl_score's rows, log-softmaxed here in long double. */
static void check_against_score(const record *rec, const char *what) {
    const int vocab = tl_model_info(model)->vocab_size, n = PROMPT + rec->n;
    int32_t seq[PROMPT + STEPS];
    memcpy(seq, prompt, sizeof prompt);
    memcpy(seq + PROMPT, rec->tokens, (size_t)rec->n * sizeof *seq);
    float *logits = malloc((size_t)n * (size_t)vocab * sizeof *logits);
    if (tl_score(model, seq, n, tl_model_info(model)->default_loops, logits) != TL_OK) {
        CHECK(0, "tl_score: %s", tl_last_error());
        free(logits);
        return;
    }
    double worst = 0.0;
    int order_ok = 1;
    for (int i = 0; i < rec->n; i++) {
        const float *row = logits + (size_t)(PROMPT - 1 + i) * (size_t)vocab;
        long double mx = -INFINITY, sum = 0.0L;
        for (int v = 0; v < vocab; v++) mx = row[v] > mx ? row[v] : mx;
        for (int v = 0; v < vocab; v++) sum += expl((long double)row[v] - mx);
        const long double log_z = mx + logl(sum);
        double err = fabs((double)((long double)row[rec->tokens[i]] - log_z) - rec->logprob[i]);
        for (int j = 0; j < TOP; j++) {
            const int32_t id = rec->top_ids[i][j];
            if (id < 0 || id >= vocab) { order_ok = 0; continue; }
            const double e = fabs((double)((long double)row[id] - log_z) - rec->top_logprobs[i][j]);
            err = e > err ? e : err;
            /* most likely first, ties to the lower id, and nothing left out above the last */
            if (j > 0 && (row[rec->top_ids[i][j - 1]] < row[id] ||
                          (row[rec->top_ids[i][j - 1]] == row[id] && rec->top_ids[i][j - 1] > id)))
                order_ok = 0;
            if (j == TOP - 1)
                for (int v = 0; v < vocab; v++) {
                    bool listed = false;
                    for (int k = 0; k < TOP; k++) listed |= rec->top_ids[i][k] == v;
                    if (!listed && (row[v] > row[id] || (row[v] == row[id] && v < id))) order_ok = 0;
                }
        }
        worst = err > worst ? err : worst;
    }
    CHECK(worst < 1e-5, "%s: log-probabilities within 1e-5 of tl_score's rows: worst %.3g", what, worst);
    CHECK(order_ok, "%s: the top %d by logit, most likely first, ties to the lower id", what, TOP);
    free(logits);
}

/* An on_token hook that reads the figures from inside the step. */
typedef struct { tl_session *session; int n; float logprob[STEPS]; int32_t first[STEPS]; bool failed; } hook_reads;
static int on_token(void *user, int32_t token, int position) {
    (void)token, (void)position;
    hook_reads *h = user;
    float top_lp[2];
    int32_t top_ids[2];
    if (!h->session || h->n >= STEPS) return TL_HOOK_CONTINUE;
    if (tl_session_logprobs(h->session, 2, &h->logprob[h->n], top_ids, top_lp) != TL_OK) h->failed = true;
    h->first[h->n++] = top_ids[0];
    return TL_HOOK_CONTINUE;
}

/* An on_token hook that asks another session of its batch for its figures. */
typedef struct {
    tl_session *other;
    tl_status status;
    float logprob;
    char message[512], save_message[512];
} other_reads;
static int ask_other(void *user, int32_t token, int position) {
    (void)token, (void)position;
    other_reads *h = user;
    if (!h->other) return TL_HOOK_CONTINUE;
    h->status = tl_session_logprobs(h->other, 0, &h->logprob, NULL, NULL);
    snprintf(h->message, sizeof h->message, "%s", h->status == TL_OK ? "" : tl_last_error());
    tl_session_state *state = NULL;
    if (tl_session_save(h->other, &state) == TL_OK) tl_session_state_free(state);
    else snprintf(h->save_message, sizeof h->save_message, "%s", tl_last_error());
    return TL_HOOK_CONTINUE;
}

/* A logits hook that fails from its third call on. */
static int fail_third(void *user, float *logits, int vocab_size, const int32_t *tokens, int n) {
    (void)logits, (void)vocab_size, (void)tokens, (void)n;
    return ++*(int *)user >= 3 ? TL_HOOK_ERROR : TL_HOOK_CONTINUE;
}

static int damp_hook(void *user, float *logits, int vocab_size, const int32_t *tokens, int n) {
    (void)user, (void)tokens, (void)n;
    for (int v = 0; v < vocab_size; v += 2) logits[v] -= 3.0f; /* changes the choice, not the model's figures */
    return TL_HOOK_CONTINUE;
}

int main(int argc, char **argv) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/textmodel", argc > 1 ? argv[1] : "tests/data");
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 2;
    if (tl_model_load(dir, &o, &model) != TL_OK) { printf("load: %s\n", tl_last_error()); return 1; }

    /* greedy: the token is the top alternative, its log-probability the first listed */
    tl_generate_config greedy;
    tl_generate_config_init(&greedy);
    greedy.max_tokens = STEPS;
    greedy.ignore_eos = 1;
    record g;
    run_alone(&greedy, &g);
    CHECK(g.n == STEPS, "greedy: %d tokens", g.n);
    check_against_score(&g, "greedy");
    bool top_is_token = true;
    for (int i = 0; i < g.n; i++) top_is_token &= g.top_ids[i][0] == g.tokens[i] && g.top_logprobs[i][0] == g.logprob[i];
    CHECK(top_is_token, "greedy: each token is its own top alternative");

    /* sampling, a penalty and a hook: the choice moves, the figures stay the model's */
    tl_generate_config sampled = greedy;
    sampled.temperature = 1.3f;
    sampled.sample_seed = 9;
    sampled.repetition_penalty = 1.5f;
    sampled.logits_processor = damp_hook;
    record r;
    run_alone(&sampled, &r);
    CHECK(r.n == STEPS, "sampled: %d tokens", r.n);
    check_against_score(&r, "sampled with a penalty and a logits hook");
    bool some_not_top = false;
    for (int i = 0; i < r.n; i++) some_not_top |= r.top_ids[i][0] != r.tokens[i];
    CHECK(some_not_top, "sampled: some token is not the model's most likely (else this checks little)");

    /* tl_score_logprobs: the sequence's own figures are the decode's, to the bit (one row
       reduction over bit-identical rows), and rows past the first chunk match tl_score's */
    {
        int32_t seq[PROMPT + STEPS];
        memcpy(seq, prompt, sizeof prompt);
        memcpy(seq + PROMPT, r.tokens, sizeof r.tokens);
        const int n = PROMPT + STEPS, loops = tl_model_info(model)->default_loops;
        float lp[PROMPT + STEPS - 1], top_lp[(PROMPT + STEPS - 1) * TOP];
        int32_t top_ids[(PROMPT + STEPS - 1) * TOP];
        CHECK(tl_score_logprobs(model, seq, n, loops, TOP, lp, top_ids, top_lp) == TL_OK, "%s", tl_last_error());
        bool same = true;
        for (int i = 0; i < STEPS; i++) {
            const int row = PROMPT - 1 + i;
            same &= !memcmp(&lp[row], &r.logprob[i], sizeof(float)) &&
                    !memcmp(&top_ids[row * TOP], r.top_ids[i], sizeof r.top_ids[i]) &&
                    !memcmp(&top_lp[row * TOP], r.top_logprobs[i], sizeof r.top_logprobs[i]);
        }
        CHECK(same, "tl_score_logprobs equals the sampled session's figures bit for bit");
        /* a long sequence (the context: two chunks of 64 rows), without alternatives */
        enum { LONG = 128 };
        int32_t long_seq[LONG];
        for (int i = 0; i < LONG; i++) long_seq[i] = (int32_t)((i * 7919 + 13) % 300);
        float long_lp[LONG - 1];
        float *logits = malloc((size_t)LONG * (size_t)tl_model_info(model)->vocab_size * sizeof *logits);
        CHECK(tl_score_logprobs(model, long_seq, LONG, 2, 0, long_lp, NULL, NULL) == TL_OK, "%s", tl_last_error());
        CHECK(logits && tl_score(model, long_seq, LONG, 2, logits) == TL_OK, "%s", tl_last_error());
        double worst = 0.0;
        const int vocab = tl_model_info(model)->vocab_size;
        for (int i = 0; logits && i + 1 < LONG; i++) {
            const float *row = logits + (size_t)i * (size_t)vocab;
            long double mx = -INFINITY, sum = 0.0L;
            for (int v = 0; v < vocab; v++) mx = row[v] > mx ? row[v] : mx;
            for (int v = 0; v < vocab; v++) sum += expl((long double)row[v] - mx);
            const double err = fabs((double)((long double)row[long_seq[i + 1]] - mx - logl(sum)) - long_lp[i]);
            worst = err > worst ? err : worst;
        }
        CHECK(worst < 1e-5, "128 tokens: within 1e-5 of tl_score's rows, worst %.3g", worst);
        free(logits);
        CHECK_ERROR(tl_score_logprobs(model, seq, n, loops, 21, lp, top_ids, top_lp), TL_ERR_INVALID_ARGUMENT, "must be in [0, 20]");
        CHECK_ERROR(tl_score_logprobs(model, seq, n, loops, 2, lp, NULL, top_lp), TL_ERR_INVALID_ARGUMENT, "needs top_ids");
        CHECK_ERROR(tl_score_logprobs(model, seq, n, 0, 0, lp, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "loops = 0");
        seq[3] = 100000;
        CHECK_ERROR(tl_score_logprobs(model, seq, n, loops, 0, lp, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "token id 100000 at index 3");
        CHECK_ERROR(tl_score_logprobs(model, NULL, n, loops, 0, lp, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
    }

    /* from inside on_token: the same figures as after the step */
    {
        hook_reads h = {0};
        tl_generate_config hooked = sampled;
        hooked.on_token = on_token;
        hooked.on_token_user = &h;
        tl_session *s = NULL;
        CHECK(tl_session_new(model, prompt, PROMPT, &hooked, &s) == TL_OK, "%s", tl_last_error());
        h.session = s;
        tl_stop_reason stop = TL_STOP_NONE;
        for (int i = 0; i < STEPS && stop == TL_STOP_NONE; i++) {
            int32_t token;
            float after;
            CHECK(tl_session_step(s, &token, &stop) == TL_OK, "%s", tl_last_error());
            CHECK(tl_session_logprobs(s, 0, &after, NULL, NULL) == TL_OK && after == h.logprob[i],
                  "token %d: %g in the hook, %g after", i, h.logprob[i], after);
        }
        CHECK(!h.failed && h.n == STEPS && !memcmp(h.logprob, r.logprob, sizeof h.logprob), "hook reads: %d", h.n);
        /* the session finished: the last token's figures stay readable */
        float last;
        CHECK(stop == TL_STOP_MAX_TOKENS && tl_session_logprobs(s, 0, &last, NULL, NULL) == TL_OK && last == r.logprob[STEPS - 1],
              "after the last step");
        tl_session_free(s);
    }

    /* refusals */
    {
        tl_session *s = NULL;
        float lp;
        int32_t ids[TL_MAX_TOP_LOGPROBS + 1];
        float lps[TL_MAX_TOP_LOGPROBS + 1];
        CHECK(tl_session_new(model, prompt, PROMPT, &greedy, &s) == TL_OK, "%s", tl_last_error());
        CHECK_ERROR(tl_session_logprobs(s, 0, &lp, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "the last step emitted no token");
        int32_t token;
        tl_stop_reason stop;
        CHECK(tl_session_step(s, &token, &stop) == TL_OK, "%s", tl_last_error());
        CHECK_ERROR(tl_session_logprobs(s, TL_MAX_TOP_LOGPROBS + 1, &lp, ids, lps), TL_ERR_INVALID_ARGUMENT, "must be in [0, 20]");
        CHECK_ERROR(tl_session_logprobs(s, -1, &lp, ids, lps), TL_ERR_INVALID_ARGUMENT, "must be in [0, 20]");
        CHECK_ERROR(tl_session_logprobs(s, 3, &lp, NULL, lps), TL_ERR_INVALID_ARGUMENT, "needs top_ids");
        CHECK_ERROR(tl_session_logprobs(s, 0, NULL, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
        CHECK(tl_session_logprobs(s, TL_MAX_TOP_LOGPROBS, &lp, ids, lps) == TL_OK && ids[0] == token, "top 20");
        tl_session_free(s);

        tl_generate_config none = greedy;
        none.max_tokens = 0;
        CHECK(tl_session_new(model, prompt, PROMPT, &none, &s) == TL_OK, "%s", tl_last_error());
        CHECK(tl_session_step(s, &token, &stop) == TL_OK && token == -1, "max_tokens 0: no token");
        CHECK_ERROR(tl_session_logprobs(s, 0, &lp, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "the last step emitted no token");
        tl_session_free(s);

        /* Beam search keeps no rows: refused by the session call and the engine's submit. */
        tl_generate_config beam = greedy;
        beam.beam_size = 2;
        CHECK(tl_session_new(model, prompt, PROMPT, &beam, &s) == TL_OK, "%s", tl_last_error());
        CHECK(tl_session_step(s, &token, &stop) == TL_OK && token >= 0, "%s", tl_last_error());
        CHECK_ERROR(tl_session_logprobs(s, 0, &lp, NULL, NULL), TL_ERR_UNSUPPORTED, "a beam session");
        tl_engine *e = NULL;
        CHECK(tl_engine_new(model, NULL, &e) == TL_OK, "%s", tl_last_error());
        tl_session *fresh = NULL;
        CHECK(tl_session_new(model, prompt, PROMPT, &beam, &fresh) == TL_OK, "%s", tl_last_error());
        tl_engine_request_options ro;
        tl_engine_request_options_init(&ro);
        ro.logprobs = 0;
        uint64_t id = 7;
        CHECK_ERROR(tl_engine_submit_with(e, fresh, &ro, &id), TL_ERR_INVALID_ARGUMENT, "plain or speculative decoding only");
        CHECK(id == 0, "refused: no id");
        ro.logprobs = -1; /* without logprobs the same session is served */
        CHECK(tl_engine_submit_with(e, fresh, &ro, &id) == TL_OK && id > 0, "%s", tl_last_error());
        tl_engine_cancel(e, id);
        tl_engine_free(e);
        tl_session_free(s);
    }

    /* A step that failed in a shared batch leaves no figures (not the last token's under the
       failed step's row). */
    {
        int calls = 0;
        tl_generate_config failing = greedy;
        failing.logits_processor = fail_third;
        failing.logits_processor_user = &calls;
        tl_session *pair[2] = {NULL, NULL};
        CHECK(tl_session_new(model, prompt, PROMPT, &failing, &pair[0]) == TL_OK &&
                  tl_session_new(model, prompt, PROMPT, &greedy, &pair[1]) == TL_OK,
              "%s", tl_last_error());
        int32_t tokens[2];
        tl_stop_reason stops[2];
        tl_status statuses[2];
        float lp;
        for (int step = 0; pair[0] && pair[1] && step < 3; step++) {
            CHECK(tl_session_step_batch(pair, 2, tokens, stops, statuses) == TL_OK, "%s", tl_last_error());
            if (step < 2) CHECK(statuses[0] == TL_OK && tl_session_logprobs(pair[0], 0, &lp, NULL, NULL) == TL_OK, "step %d", step);
        }
        CHECK(statuses[0] == TL_ERR_HOOK, "the third step failed in its hook: %d", (int)statuses[0]);
        CHECK_ERROR(tl_session_logprobs(pair[0], 0, &lp, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "emitted no token");
        tl_session_free(pair[0]);
        tl_session_free(pair[1]);
    }

    /* In a shared batch, a hook of one session asking another: the batch's forward pass has
       replaced the other's logits, so one not yet reached is refused (its last token's row
       is gone; it answered that token's log-probability under the new row), and one
       already reached answers this step's figures, as after the step. */
    {
        other_reads first_asks = {0}, second_asks = {0};
        tl_generate_config asking_first = greedy, asking_second = greedy;
        asking_first.on_token = ask_other;
        asking_first.on_token_user = &first_asks;
        asking_second.on_token = ask_other;
        asking_second.on_token_user = &second_asks;
        tl_session *pair[2] = {NULL, NULL};
        CHECK(tl_session_new(model, prompt, PROMPT, &asking_first, &pair[0]) == TL_OK &&
                  tl_session_new(model, prompt, PROMPT - 1, &asking_second, &pair[1]) == TL_OK,
              "%s", tl_last_error());
        int32_t tokens[2];
        tl_stop_reason stops[2];
        tl_status statuses[2];
        CHECK(pair[0] && pair[1] && tl_session_step_batch(pair, 2, tokens, stops, statuses) == TL_OK, "%s", tl_last_error());
        first_asks.other = pair[1];
        second_asks.other = pair[0];
        CHECK(pair[0] && pair[1] && tl_session_step_batch(pair, 2, tokens, stops, statuses) == TL_OK &&
                  statuses[0] == TL_OK && statuses[1] == TL_OK,
              "%s", tl_last_error());
        CHECK(first_asks.status == TL_ERR_INVALID_ARGUMENT &&
                  strstr(first_asks.message, "tl_session_logprobs: the session is stepping and has not emitted this "
                                             "step's token yet"),
              "a session not yet reached: %d, %.4f '%s'", (int)first_asks.status, first_asks.logprob, first_asks.message);
        /* (saving another session of the batch is refused too, naming where it was called from) */
        CHECK(strstr(first_asks.save_message, "tl_session_save: the session is stepping (called from a hook of its own "
                                                "step, or of a batched step it is in)"),
              "save: '%s'", first_asks.save_message);
        float after = 0.0f;
        CHECK(pair[0] && tl_session_logprobs(pair[0], 0, &after, NULL, NULL) == TL_OK, "%s", tl_last_error());
        CHECK(second_asks.status == TL_OK && memcmp(&second_asks.logprob, &after, sizeof after) == 0,
              "a session already reached: %d, %.6f where the step's figure is %.6f", (int)second_asks.status,
              second_asks.logprob, after);
        tl_session_free(pair[0]);
        tl_session_free(pair[1]);
    }

    /* Speculative sessions: each token's figures are its verification row's. A greedy chain
       and tree emit the plain session's tokens, and their rows are the plain decode rows
       (batch-invariant kernels): the same figures, to the bit. A sampled chain's are
       tl_score's rows. Through the engine, the session's own. */
    {
        tl_generate_config chain = greedy;
        chain.speculative = TL_SPECULATIVE_CHAIN;
        chain.draft_loops = 1;
        chain.draft_ahead = 3;
        record sc, st, ss, got;
        run_alone(&chain, &sc);
        CHECK(sc.n == g.n && memcmp(&sc, &g, sizeof g) == 0, "greedy chain: %d tokens, the plain session's figures %s",
              sc.n, memcmp(&sc, &g, sizeof g) ? "differ" : "equal");
        tl_generate_config tree = chain;
        tree.speculative = TL_SPECULATIVE_TREE;
        tree.K_branches = 2;
        run_alone(&tree, &st);
        CHECK(st.n == g.n && memcmp(&st, &g, sizeof g) == 0, "greedy tree: the plain session's figures");
        tl_generate_config sampled_chain = chain;
        sampled_chain.temperature = 1.1f;
        sampled_chain.sample_seed = 5;
        run_alone(&sampled_chain, &ss);
        CHECK(ss.n == STEPS, "sampled chain: %d tokens", ss.n);
        check_against_score(&ss, "sampled chain");
        tl_engine *e = NULL;
        CHECK(tl_engine_new(model, NULL, &e) == TL_OK, "%s", tl_last_error());
        tl_session *s = NULL;
        CHECK(tl_session_new(model, prompt, PROMPT, &sampled_chain, &s) == TL_OK, "%s", tl_last_error());
        tl_engine_request_options ro;
        tl_engine_request_options_init(&ro);
        ro.logprobs = TOP;
        uint64_t id = 0;
        CHECK(tl_engine_submit_with(e, s, &ro, &id) == TL_OK && id > 0, "%s", tl_last_error());
        CHECK(read_request(e, id, &got), "the speculative request finished, every update with its logprobs");
        CHECK(got.n == ss.n && !memcmp(&got, &ss, sizeof got), "engine, speculative: the session's figures");
        tl_engine_cancel(e, id);
        tl_engine_free(e);
    }

    /* The engine: a request with logprobs, beside two without, in shared batches: exactly the
       figures of the session alone. */
    {
        tl_engine *e = NULL;
        CHECK(tl_engine_new(model, NULL, &e) == TL_OK, "%s", tl_last_error());
        tl_engine_request_options ro;
        tl_engine_request_options_init(&ro);
        CHECK(ro.logprobs == -1, "default: no logprobs");
        ro.logprobs = TL_MAX_TOP_LOGPROBS + 1;
        tl_session *s = NULL;
        CHECK(tl_session_new(model, prompt, PROMPT, &sampled, &s) == TL_OK, "%s", tl_last_error());
        uint64_t id = 0, others[2] = {0, 0};
        CHECK_ERROR(tl_engine_submit_with(e, s, &ro, &id), TL_ERR_INVALID_ARGUMENT, "logprobs = 21");
        ro.logprobs = TOP;
        for (int i = 0; i < 2; i++) {
            tl_session *other = NULL;
            CHECK(tl_session_new(model, prompt, PROMPT, &greedy, &other) == TL_OK, "%s", tl_last_error());
            CHECK(tl_engine_submit(e, other, &others[i]) == TL_OK && others[i] > 0, "%s", tl_last_error());
        }
        CHECK(tl_engine_submit_with(e, s, &ro, &id) == TL_OK && id > 0, "%s", tl_last_error());
        record got;
        CHECK(read_request(e, id, &got), "the request finished, every update with its logprobs");
        CHECK(got.n == r.n && !memcmp(&got, &r, sizeof got), "engine: %d tokens, figures %s those alone", got.n,
              memcmp(&got, &r, sizeof got) ? "differ from" : "equal");
        for (int i = 0; i < 2; i++) {
            tl_engine_update u;
            while (tl_engine_wait(e, others[i], 5000) > 0 && tl_engine_read(e, others[i], &u) == TL_OK) {
                CHECK(u.logprobs == NULL && u.top_ids == NULL && u.n_top == 0, "no logprobs unasked");
                if (u.state == TL_ENGINE_FINISHED) break;
            }
            tl_engine_cancel(e, others[i]);
        }
        tl_engine_counters c;
        tl_engine_get_counters(e, &c);
        CHECK(c.rows > c.iterations, "batched: %llu rows in %llu iterations", (unsigned long long)c.rows,
              (unsigned long long)c.iterations);
        tl_engine_cancel(e, id);
        tl_engine_free(e);
    }

    tl_model_free(model);
    printf("%d passed, %d failed\n", checks_passed, checks_failed);
    return checks_failed;
}

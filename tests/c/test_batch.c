/* test_batch.c: many sessions at once. tl_session_step_batch advances a set of sessions in
 * one batched forward (prompt chunks of new sessions beside decode rows of running ones),
 * and every session's tokens must be bit-identical to stepping it alone (memcmp): mixed
 * configs (greedy and seeded sampling, loop depths, lengths, stop rules, windows,
 * speculative, beam and early-exit sessions), sessions joining and leaving mid-run.
 * tl_generate_batch (continuous batching) equals decoding the prompts one by one. Two
 * threads stepping two batches on one model agree too (this test also runs under TSan). */
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>

#include "check.h"
#include "tinyloop.h"

#define CAP 256
#define N_SESSIONS 12

static uint64_t rng_state = 0xB5AD4ECEDA1CE2A9ull;
static uint32_t next_u32(void) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 11);
}

static int stop_at_eleven(void *user, const int32_t *tokens, int n) {
    (void)user; (void)tokens;
    return n >= 11 ? TL_HOOK_STOP : TL_HOOK_CONTINUE;
}

/* One session of the mix: its prompt, config, the step it joins at, and what it produced. */
typedef struct job {
    int32_t prompt[40];
    int n_prompt;
    tl_generate_config cfg;
    int join_at;
    tl_session *session;
    int32_t alone[CAP];
    int n_alone;
    tl_stop_reason alone_stop;
} job;

static void make_job(job *j, int index, int vocab, int max_loops, int max_seq_len) {
    tl_generate_config_init(&j->cfg);
    /* Some long prompts (several chunks where the context allows), most short. */
    const int longest = max_seq_len / 2 < 40 ? max_seq_len / 2 : 40;
    j->n_prompt = 1 + (int)(next_u32() % (unsigned)(index % 4 == 0 ? longest : 8));
    for (int i = 0; i < j->n_prompt; i++) j->prompt[i] = (int32_t)(next_u32() % (uint32_t)vocab);
    tl_generate_config *c = &j->cfg;
    c->max_tokens = 4 + (int)(next_u32() % 20);
    c->loops = 1 + (int)(next_u32() % (unsigned)(max_loops < 6 ? max_loops : 6));
    c->ignore_eos = index % 3 != 0;
    if (index % 2) { c->temperature = 0.8f; c->top_k = 20; c->sample_seed = 1000 + (uint64_t)index; }
    if (index % 5 == 1) c->repetition_penalty = 1.2f;
    if (index % 4 == 2) c->cache_window = 5 + index % 4;
    if (index % 6 == 3) c->stop_rule = stop_at_eleven;
    switch (index % 7) { /* modes that step on their own inside the batch call */
    case 4: if (c->loops >= 2) { c->speculative = TL_SPECULATIVE_CHAIN; c->draft_loops = 1; c->temperature = 0; } break;
    case 5: c->beam_size = 2; c->cache_window = 0; c->stop_rule = NULL; c->temperature = 0; break;
    case 6: if (c->loops >= 3) { c->early_exit_patience = 1; c->early_exit_min_L = 1; } break;
    default: break;
    }
    if (index == 7) c->max_tokens = 0;
    j->join_at = index < 4 ? 0 : (int)(next_u32() % 10);
}

static void run_alone(const tl_model *m, job *j) {
    tl_generate_stats st;
    tl_status s = tl_generate(m, j->prompt, j->n_prompt, &j->cfg, j->alone, CAP, &j->n_alone, &st);
    CHECK(s == TL_OK, "alone: %s", tl_last_error());
    j->alone_stop = st.stop_reason;
}

/* Steps the jobs together: each joins at its step, leaves when it stops. prompt_rows > 0
   prefills in chunks (tl_step_batch_options): a step that forwarded part of a prompt emits
   nothing, and only before the session's first token. */
static int partial_steps;
static void run_together(const tl_model *m, job *jobs, int n_jobs, int prompt_rows, int *batched_steps) {
    tl_step_batch_options opts;
    tl_step_batch_options_init(&opts);
    opts.prompt_rows = prompt_rows;
    tl_session *live[N_SESSIONS];
    int live_job[N_SESSIONS], n_live = 0, joined = 0;
    int32_t tokens[N_SESSIONS];
    tl_stop_reason stops[N_SESSIONS];
    tl_status statuses[N_SESSIONS];
    for (int step = 0; joined < n_jobs || n_live > 0; step++) {
        for (int i = 0; i < n_jobs; i++)
            if (!jobs[i].session && jobs[i].join_at == step) {
                joined++;
                tl_status st = tl_session_new(m, jobs[i].prompt, jobs[i].n_prompt, &jobs[i].cfg, &jobs[i].session);
                CHECK(st == TL_OK, "session %d: %s", i, tl_last_error());
                if (st != TL_OK) continue;
                live[n_live] = jobs[i].session;
                live_job[n_live++] = i;
            }
        if (n_live == 0) continue;
        CHECK(tl_session_step_batch_with(live, n_live, &opts, tokens, stops, statuses) == TL_OK, "step_batch: %s",
              tl_last_error());
        (*batched_steps)++;
        for (int k = 0; k < n_live; k++) {
            job *j = &jobs[live_job[k]];
            CHECK(statuses[k] == TL_OK, "job %d step: %s", live_job[k], tl_status_name(statuses[k]));
            if (tokens[k] < 0 && stops[k] == TL_STOP_NONE) {
                int n;
                tl_session_tokens(j->session, &n);
                CHECK(prompt_rows > 0 && n == j->n_prompt, "job %d emitted nothing after %d of its tokens (prompt %d, rows %d)",
                      live_job[k], n - j->n_prompt, j->n_prompt, prompt_rows);
                partial_steps++;
            }
            if (stops[k] == TL_STOP_NONE && statuses[k] == TL_OK) continue;
            int n;
            const int32_t *got = tl_session_tokens(j->session, &n);
            CHECK(n == j->n_alone && memcmp(got, j->alone, (size_t)n * sizeof *got) == 0 && stops[k] == j->alone_stop,
                  "job %d (loops %d, T %.1f, window %d, spec %d, beam %d, exit %d): batched %d tokens %s, alone %d %s",
                  live_job[k], j->cfg.loops, (double)j->cfg.temperature, j->cfg.cache_window, (int)j->cfg.speculative,
                  j->cfg.beam_size, j->cfg.early_exit_patience, n, tl_stop_reason_name(stops[k]), j->n_alone,
                  tl_stop_reason_name(j->alone_stop));
            tl_session_free(j->session);
            j->session = NULL;
            j->join_at = -1;
            live[k] = live[n_live - 1];
            live_job[k] = live_job[n_live - 1];
            tokens[k] = tokens[n_live - 1];
            stops[k] = stops[n_live - 1];
            statuses[k] = statuses[n_live - 1];
            n_live--;
            k--;
        }
    }
}

static void mixed_batches(const char *golden) {
    static const char *names[] = {"add_residual_statenorm_rms_gqa2", "deep_residual", "f16_concat_residual_gqa",
                                  "bf16_tied_rope_residual", "gpt2_like"};
    int batched_steps = 0, jobs_run = 0;
    for (size_t mi = 0; mi < sizeof names / sizeof names[0]; mi++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", golden, names[mi]);
        tl_model *m = NULL;
        if (tl_model_load(dir, NULL, &m) != TL_OK) { CHECK(0, "load %s: %s", names[mi], tl_last_error()); continue; }
        const struct tl_model_info *info = tl_model_info(m);
        /* Rounds 3 and 4 prefill in chunks of 3 and 7 prompt rows a step. */
        for (int round = 0; round < 5; round++) {
            job jobs[N_SESSIONS];
            memset(jobs, 0, sizeof jobs);
            for (int i = 0; i < N_SESSIONS; i++) {
                make_job(&jobs[i], i + round, info->vocab_size, info->max_loops, info->max_seq_len);
                if (jobs[i].n_prompt + jobs[i].cfg.max_tokens > info->max_seq_len)
                    jobs[i].cfg.max_tokens = info->max_seq_len - jobs[i].n_prompt;
                run_alone(m, &jobs[i]);
            }
            run_together(m, jobs, N_SESSIONS, round == 3 ? 3 : round == 4 ? 7 : 0, &batched_steps);
            jobs_run += N_SESSIONS;
        }
        tl_model_free(m);
    }
    printf("  %d sessions compared with stepping alone over %d batched steps (%d of them chunks of a prompt)\n",
           jobs_run, batched_steps, partial_steps);
    CHECK(partial_steps > 0, "chunked prefill cut some prompts");
}

/* The chunked prefill's rule (tinyloop.h, tl_step_batch_options): prompt rows are shared out
   in the call's order, the running sessions' rows always go in, and a prompt's first token
   comes in the call that forwards its last row. Checked against a count of the rule itself,
   call by call, over prompts longer than many chunks; then against stepping alone. */
static void chunked_prefill_rule(const char *golden) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/../textmodel", golden);
    tl_model *m = NULL;
    if (tl_model_load(dir, NULL, &m) != TL_OK) { CHECK(0, "load"); return; }
    const struct tl_model_info *info = tl_model_info(m);
    enum { N = 5, ROWS = 5, MAX_TOKENS = 12 };
    const int lens[N] = {3, 2 * info->max_seq_len / 5, 1, info->max_seq_len / 4, 7};
    int32_t prompts[N][CAP], alone[N][CAP];
    int n_alone[N];
    tl_session *sessions[N];
    tl_generate_config cfg[N];
    for (int i = 0; i < N; i++) {
        for (int k = 0; k < lens[i]; k++) prompts[i][k] = (int32_t)(next_u32() % (uint32_t)info->vocab_size);
        tl_generate_config_init(&cfg[i]);
        cfg[i].max_tokens = MAX_TOKENS;
        cfg[i].ignore_eos = 1;
        if (i % 2) { cfg[i].temperature = 0.9f; cfg[i].sample_seed = 40 + (uint64_t)i; }
        if (i == 3) { /* early exit: its prompt, a plain prefill, shares the pass and its chunks */
            cfg[i].loops = info->max_loops;
            cfg[i].early_exit_patience = 1;
            cfg[i].early_exit_min_L = 1;
        }
        /* speculative and beam: their prompts but the last token share the pass and its chunks */
        if (i == 0) cfg[i].beam_size = 2;
        if (i == 1) { cfg[i].speculative = TL_SPECULATIVE_CHAIN; cfg[i].loops = 3; cfg[i].draft_loops = 1; }
        tl_generate_stats st;
        CHECK(tl_generate(m, prompts[i], lens[i], &cfg[i], alone[i], CAP, &n_alone[i], &st) == TL_OK, "%s", tl_last_error());
        CHECK(tl_session_new(m, prompts[i], lens[i], &cfg[i], &sessions[i]) == TL_OK, "%s", tl_last_error());
    }
    tl_step_batch_options opts;
    tl_step_batch_options_init(&opts);
    CHECK(opts.prompt_rows == 0, "default: no limit (%d)", opts.prompt_rows);
    int32_t tokens[N], token;
    tl_stop_reason stops[N], stop;
    tl_status statuses[N];
    opts.prompt_rows = -1;
    CHECK_ERROR(tl_session_step_batch_with(sessions, N, &opts, tokens, stops, statuses), TL_ERR_INVALID_ARGUMENT,
                "prompt_rows = -1");
    opts.prompt_rows = ROWS;
    /* The last session: one call cuts its prompt, then tl_session_step alone forwards the rest. */
    tl_session **last = &sessions[N - 1];
    CHECK(tl_session_step_batch_with(last, 1, &opts, tokens, stops, statuses) == TL_OK && tokens[0] == -1 &&
              stops[0] == TL_STOP_NONE && statuses[0] == TL_OK,
          "a cut prompt emits nothing: token %d, stop %s", tokens[0], tl_stop_reason_name(stops[0]));
    CHECK(tl_session_step(*last, &token, &stop) == TL_OK && token >= 0, "a step alone after a cut: %s", tl_last_error());
    int left[N], emitted[N] = {0}, calls = 0, mismatches = 0;
    for (int i = 0; i < N; i++) left[i] = lens[i] - (i < 2); /* (the beam's and the speculative one's last token: their own) */
    left[N - 1] = 0, emitted[N - 1] = 1;
    for (; calls < 200; calls++) {
        tl_session *live[N];
        int index[N], n_live = 0;
        bool expect_token[N];
        for (int i = 0, budget = ROWS; i < N; i++) {
            if (emitted[i] == MAX_TOKENS) continue;
            /* What the rule says this call does: */
            const int take = left[i] > budget ? budget : left[i];
            budget -= take;
            left[i] -= take;
            expect_token[n_live] = left[i] == 0;
            index[n_live] = i;
            live[n_live++] = sessions[i];
        }
        if (n_live == 0) break;
        CHECK(tl_session_step_batch_with(live, n_live, &opts, tokens, stops, statuses) == TL_OK, "%s", tl_last_error());
        for (int k = 0; k < n_live; k++) {
            mismatches += (tokens[k] >= 0) != expect_token[k] || statuses[k] != TL_OK;
            if (tokens[k] >= 0) emitted[index[k]]++;
        }
    }
    CHECK(mismatches == 0, "%d session-steps broke the rule over %d calls", mismatches, calls);
    CHECK(calls > (lens[0] + lens[1] + lens[2] + lens[3] - 2) / ROWS, "the long prompts took %d calls", calls);
    for (int i = 0; i < N; i++) {
        int n;
        const int32_t *got = tl_session_tokens(sessions[i], &n);
        CHECK(n == n_alone[i] && memcmp(got, alone[i], (size_t)n * sizeof *got) == 0, "prompt %d (%d tokens): %d vs alone %d",
              i, lens[i], n, n_alone[i]);
        tl_session_free(sessions[i]);
    }
    tl_model_free(m);
}

/* A callback grammar that allows every token and counts its advances. */
static int advances;
static int allow_all(void *user, uint8_t *allowed, int vocab_size) {
    (void)user;
    memset(allowed, 1, (size_t)vocab_size);
    return vocab_size;
}
/* Allows tokens 5 and 6 and returns *user as the count (the count must be the mask's). */
static int allow_two_say(void *user, uint8_t *allowed, int vocab_size) {
    (void)vocab_size;
    allowed[5] = allowed[6] = 1;
    return *(const int *)user;
}
static int count_advance(void *user, int32_t token) {
    (void)user, (void)token;
    advances++;
    return 0;
}

static int fourth_calls;
static int fail_at_fourth(void *user, int32_t token, int position) {
    (void)user, (void)token, (void)position;
    return ++fourth_calls == 4 ? -5 : TL_HOOK_CONTINUE;
}

/* tl_generate_batch: more prompts than live places, all bit-identical to tl_generate. */
static void generate_batch_equals_one_by_one(const char *golden) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/llama_like", golden);
    tl_model *m = NULL;
    if (tl_model_load(dir, NULL, &m) != TL_OK) { CHECK(0, "load"); return; }
    const int vocab = tl_model_info(m)->vocab_size;
    enum { N = 37 };
    int32_t store[N][12];
    tl_token_seq prompts[N];
    for (int i = 0; i < N; i++) {
        prompts[i].n = 1 + (int)(next_u32() % 12);
        for (int k = 0; k < prompts[i].n; k++) store[i][k] = (int32_t)(next_u32() % (uint32_t)vocab);
        prompts[i].tokens = store[i];
    }
    for (int sampled = 0; sampled < 2; sampled++) {
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 9;
        if (sampled) { cfg.temperature = 1.0f; cfg.sample_seed = 77; }
        static int32_t out[N * 24];
        int lens[N], total = 0;
        tl_generate_stats stats[N];
        CHECK(tl_generate_batch(m, prompts, N, &cfg, out, N * 24, lens, &total, stats) == TL_OK, "batch: %s",
              tl_last_error());
        int at = 0, same = 0;
        for (int i = 0; i < N; i++) {
            int32_t one[24];
            int n = 0;
            tl_generate_stats st;
            tl_generate(m, prompts[i].tokens, prompts[i].n, &cfg, one, 24, &n, &st);
            same += n == lens[i] && memcmp(one, out + at, (size_t)n * sizeof *one) == 0 &&
                    st.stop_reason == stats[i].stop_reason && st.tokens_emitted == stats[i].tokens_emitted;
            at += lens[i];
        }
        CHECK(same == N && at == total, "%s: %d of %d prompts equal one-by-one decoding", sampled ? "sampled" : "greedy",
              same, N);
    }
    /* a failure (an on_token hook's error at the 4th token): the prompts under way keep the
       stats of what ran before it, as tl_generate's do (they were left as the caller had
       them) */
    {
        tl_generate_config failing;
        tl_generate_config_init(&failing);
        failing.max_tokens = 10;
        failing.ignore_eos = 1;
        failing.on_token = fail_at_fourth;
        fourth_calls = 0;
        static int32_t out[N * 24];
        int lens[N], total = 0;
        tl_generate_stats stats[2];
        memset(stats, 0x5a, sizeof stats);
        CHECK_ERROR(tl_generate_batch(m, prompts, 2, &failing, out, N * 24, lens, &total, stats), TL_ERR_HOOK,
                    "on_token hook returned error -5");
        CHECK(stats[0].tokens_emitted + stats[1].tokens_emitted == 4 && stats[0].stop_reason == TL_STOP_NONE &&
                  stats[1].stop_reason == TL_STOP_NONE && stats[0].prompt_tokens == prompts[0].n &&
                  stats[1].prompt_tokens == prompts[1].n,
              "stats after a failure: %d + %d tokens (want 4), stop %d %d", stats[0].tokens_emitted, stats[1].tokens_emitted,
              (int)stats[0].stop_reason, (int)stats[1].stop_reason);
    }
    /* a callback grammar holds one sequence's state: refused for several prompts (the prompts'
       advances interleaved on it, ending each early, and the call said TL_OK); one is fine */
    tl_grammar grammar = {.user = NULL, .allowed = allow_all, .advance = count_advance};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 3;
    cfg.grammar = &grammar;
    static int32_t out[N * 24];
    int lens[N], total = 0;
    CHECK_ERROR(tl_generate_batch(m, prompts, 2, &cfg, out, N * 24, lens, &total, NULL), TL_ERR_INVALID_ARGUMENT,
                "generate_batch: a callback grammar holds one sequence's state and cannot serve 2 prompts");
    CHECK(tl_generate_batch(m, prompts, 1, &cfg, out, N * 24, lens, &total, NULL) == TL_OK && advances == total - prompts[0].n,
          "one prompt under a callback grammar: %s, %d advances", tl_last_error(), advances);
    /* the count is the mask's: 0 over two tokens went on sampling them, 1 forced the last */
    for (int said = 0; said <= 3; said++) {
        tl_grammar two = {.user = &said, .allowed = allow_two_say, .advance = count_advance};
        cfg.grammar = &two;
        int32_t one[16];
        int n = 0;
        if (said == 2) {
            CHECK(tl_generate(m, prompts[0].tokens, prompts[0].n, &cfg, one, 16, &n, NULL) == TL_OK &&
                      (one[prompts[0].n] == 5 || one[prompts[0].n] == 6), "a count that is the mask's: %s", tl_last_error());
        } else {
            char want[120];
            snprintf(want, sizeof want, "grammar allowed hook returned %d for a mask of 2 allowed tokens", said);
            CHECK_ERROR(tl_generate(m, prompts[0].tokens, prompts[0].n, &cfg, one, 16, &n, NULL), TL_ERR_HOOK, want);
        }
    }
    tl_model_free(m);
}

/* ---------------------------------------------------------------- two threads, two batches */

typedef struct thread_job {
    const tl_model *m;
    job jobs[6];
    int prompt_rows; /* one thread prefills in chunks */
    int batched_steps;
} thread_job;

static void *thread_main(void *arg) {
    thread_job *t = arg;
    run_together(t->m, t->jobs, 6, t->prompt_rows, &t->batched_steps);
    return NULL;
}

static void two_threads(const char *golden) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/deep_residual", golden);
    tl_model *m = NULL;
    if (tl_model_load(dir, NULL, &m) != TL_OK) { CHECK(0, "load"); return; }
    const struct tl_model_info *info = tl_model_info(m);
    static thread_job t[2];
    for (int k = 0; k < 2; k++) {
        memset(&t[k], 0, sizeof t[k]);
        t[k].m = m;
        t[k].prompt_rows = k == 1 ? 4 : 0;
        for (int i = 0; i < 6; i++) {
            make_job(&t[k].jobs[i], 6 * k + i, info->vocab_size, info->max_loops, info->max_seq_len);
            if (t[k].jobs[i].n_prompt + t[k].jobs[i].cfg.max_tokens > info->max_seq_len)
                t[k].jobs[i].cfg.max_tokens = info->max_seq_len - t[k].jobs[i].n_prompt;
            run_alone(m, &t[k].jobs[i]);
        }
    }
    pthread_t threads[2];
    for (int k = 0; k < 2; k++) pthread_create(&threads[k], NULL, thread_main, &t[k]);
    for (int k = 0; k < 2; k++) pthread_join(threads[k], NULL);
    tl_model_free(m);
}

/* ---------------------------------------------------------------- bad calls */

static void bad_calls(const char *golden) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/deep_residual", golden);
    tl_model *m = NULL, *other = NULL;
    tl_model_load(dir, NULL, &m);
    snprintf(dir, sizeof dir, "%s/llama_like", golden);
    tl_model_load(dir, NULL, &other);
    if (!m || !other) { CHECK(0, "load"); return; }
    int32_t prompt[2] = {1, 2}, tokens[3];
    tl_stop_reason stops[3];
    tl_status statuses[3];
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 1;
    tl_session *a = NULL, *b = NULL, *c = NULL;
    tl_session_new(m, prompt, 2, &cfg, &a);
    tl_session_new(m, prompt, 2, &cfg, &b);
    tl_session_new(other, prompt, 2, &cfg, &c);
    tl_session *dup[2] = {a, a}, *mixed[2] = {a, c}, *none[1] = {NULL}, *pair[2] = {a, b};
    /* each NULL named (it said "NULL argument" of four pointers) */
    CHECK_ERROR(tl_session_step_batch(NULL, 1, tokens, stops, statuses), TL_ERR_INVALID_ARGUMENT, "sessions must not be NULL");
    CHECK_ERROR(tl_session_step_batch(pair, 2, NULL, stops, statuses), TL_ERR_INVALID_ARGUMENT, "tokens must not be NULL");
    CHECK_ERROR(tl_session_step_batch(pair, 2, tokens, NULL, statuses), TL_ERR_INVALID_ARGUMENT, "stops must not be NULL");
    CHECK_ERROR(tl_session_step_batch(pair, 2, tokens, stops, NULL), TL_ERR_INVALID_ARGUMENT,
                "tl_session_step_batch: statuses must not be NULL");
    CHECK_ERROR(tl_session_step_batch(pair, 0, tokens, stops, statuses), TL_ERR_INVALID_ARGUMENT, "n = 0");
    CHECK_ERROR(tl_session_step_batch(none, 1, tokens, stops, statuses), TL_ERR_INVALID_ARGUMENT, "sessions[0] is NULL");
    CHECK_ERROR(tl_session_step_batch(dup, 2, tokens, stops, statuses), TL_ERR_INVALID_ARGUMENT, "sessions[1] is sessions[0] again");
    CHECK_ERROR(tl_session_step_batch(mixed, 2, tokens, stops, statuses), TL_ERR_INVALID_ARGUMENT, "another model");
    CHECK(tl_session_step_batch(pair, 2, tokens, stops, statuses) == TL_OK && statuses[0] == TL_OK &&
              stops[0] == TL_STOP_MAX_TOKENS && stops[1] == TL_STOP_MAX_TOKENS && strcmp(tl_last_error(), "") == 0,
          "a valid batch: %s", tl_last_error());
    CHECK_ERROR(tl_session_step_batch(pair, 2, tokens, stops, statuses), TL_ERR_INVALID_ARGUMENT, "sessions[0] is finished");
    tl_session_free(a);
    tl_session_free(b);
    tl_session_free(c);
    tl_model_free(m);
    tl_model_free(other);
}

/* A hook may free any session of the call, one that shares the batched forward or one that
   steps on its own (a beam), before or after its own row: each is freed when the call ends
   (a beam session after the hook's was read after its free: ASan's and valgrind's case). */
static tl_session *to_free[2];
static int free_others(void *user, int32_t token, int position) {
    (void)user; (void)token; (void)position;
    for (int i = 0; i < 2; i++)
        if (to_free[i]) { tl_session_free(to_free[i]); to_free[i] = NULL; }
    return TL_HOOK_CONTINUE;
}

static void hook_frees_others(const char *golden) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/deep_residual", golden);
    tl_model *m = NULL;
    tl_model_load(dir, NULL, &m);
    if (!m) { CHECK(0, "load"); return; }
    const int32_t prompt[3] = {1, 2, 3};
    tl_generate_config plain, beam, hooked;
    tl_generate_config_init(&plain);
    plain.max_tokens = 4;
    beam = plain;
    beam.beam_size = 2;
    hooked = plain;
    hooked.on_token = free_others;
    tl_session *before = NULL, *a = NULL, *beam_after = NULL;
    tl_session_new(m, prompt, 3, &plain, &before);
    tl_session_new(m, prompt, 3, &hooked, &a);
    tl_session_new(m, prompt, 3, &beam, &beam_after);
    if (!before || !a || !beam_after) { CHECK(0, "sessions: %s", tl_last_error()); return; }
    to_free[0] = before;
    to_free[1] = beam_after;
    tl_session *set[3] = {before, a, beam_after};
    int32_t tokens[3];
    tl_stop_reason stops[3];
    tl_status statuses[3];
    CHECK(tl_session_step_batch(set, 3, tokens, stops, statuses) == TL_OK && statuses[0] == TL_OK && statuses[1] == TL_OK &&
              statuses[2] == TL_OK && tokens[1] >= 0,
          "a batch whose hook frees two of its sessions: %s", tl_last_error());
    tl_session *alone[1] = {a}; /* the hook's session goes on */
    CHECK(tl_session_step_batch(alone, 1, tokens, stops, statuses) == TL_OK && statuses[0] == TL_OK && tokens[0] >= 0,
          "the hook's session after: %s", tl_session_error(a));
    tl_session_free(a);
    tl_model_free(m);
}

/* Each session of a batch records its rows at its own depth: a loops-1 session stepped beside
   a deeper one keeps rows of depth 1, which its saved state writes whole and a later loops-1
   session takes from the prefix pool (rows marked at the batch's deepest loop had no pages
   there: the state's write failed, and the pool served nothing). */
static void depths_per_session(const char *golden) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/f16_concat_residual_gqa", golden);
    tl_model *m = NULL;
    if (tl_model_load(dir, NULL, &m) != TL_OK) { CHECK(0, "load %s: %s", dir, tl_last_error()); return; }
    tl_model_set_prefix_pool(m, 1 << 30);
    const struct tl_model_info *info = tl_model_info(m);
    int32_t deep_prompt[20], shallow_prompt[20];
    for (int i = 0; i < 20; i++) deep_prompt[i] = (int32_t)((3 + 5 * i) % info->vocab_size),
                                 shallow_prompt[i] = (int32_t)((11 + 7 * i) % info->vocab_size);
    tl_generate_config deep, shallow;
    tl_generate_config_init(&deep);
    tl_generate_config_init(&shallow);
    deep.loops = info->max_loops;
    shallow.loops = 1;
    deep.max_tokens = shallow.max_tokens = 6;
    deep.ignore_eos = shallow.ignore_eos = 1;
    tl_session *s[2] = {NULL, NULL};
    CHECK(tl_session_new(m, deep_prompt, 20, &deep, &s[0]) == TL_OK && tl_session_new(m, shallow_prompt, 20, &shallow, &s[1]) == TL_OK,
          "%s", tl_last_error());
    int32_t tokens[2];
    tl_stop_reason stops[2];
    tl_status statuses[2];
    for (int i = 0; i < 3 && s[0] && s[1]; i++)
        CHECK(tl_session_step_batch(s, 2, tokens, stops, statuses) == TL_OK, "step %d: %s", i, tl_last_error());
    tl_session_state *saved = NULL;
    void *bytes = NULL;
    size_t len = 0;
    CHECK(s[1] && tl_session_save(s[1], &saved) == TL_OK && tl_session_state_to_bytes(saved, &bytes, &len) == TL_OK,
          "the loops-1 session's state: %s", tl_last_error());
    tl_free(bytes);
    tl_session_state_free(saved);
    tl_session_free(s[0]);
    tl_session_free(s[1]);
    tl_session *again = NULL;
    CHECK(tl_session_new(m, shallow_prompt, 20, &shallow, &again) == TL_OK && tl_session_stats(again)->prompt_tokens_reused == 19,
          "a new loops-1 session of the same prompt reused %d of 20 tokens", again ? tl_session_stats(again)->prompt_tokens_reused : -1);
    tl_session_free(again);
    tl_model_free(m);
}

int main(int argc, char **argv) {
    const char *golden = argc > 1 ? argv[1] : "tests/data/golden";
    mixed_batches(golden);
    generate_batch_equals_one_by_one(golden);
    chunked_prefill_rule(golden);
    two_threads(golden);
    bad_calls(golden);
    hook_frees_others(golden);
    depths_per_session(golden);
    return check_summary();
}

/* test_engine.c: the serving engine (scheduler.c). Requests of mixed configs, read by one
 * thread each while the engine thread steps them together, produce exactly the tokens of
 * tl_generate alone; the admission limits hold; a cancel stops a running session within
 * one step and frees it; a waiter wakes for its own request only. Built also under
 * ThreadSanitizer (scripts/test). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

#include "check.h"
#include "tinyloop.h"

#define N 6
#define CAP 160

static tl_model *model;
static tl_engine *engine;

typedef struct {
    int32_t prompt[4];
    tl_generate_config cfg;
    const char *stop_string;
    uint64_t id;
    int32_t got[CAP];
    int n_got, reads;
    char text[4096];
    size_t text_len;
    tl_stop_reason stop;
    tl_status status;
    tl_generate_stats stats;
} job_t;

static void *reader(void *arg) {
    job_t *j = arg;
    for (;;) {
        int w = tl_engine_wait(engine, j->id, 1000);
        if (w < 0) { j->status = TL_ERR_INTERNAL; break; }
        if (w == 0) continue;
        tl_engine_update u;
        if (tl_engine_read(engine, j->id, &u) != TL_OK) { j->status = TL_ERR_INTERNAL; break; }
        j->reads++;
        for (int i = 0; i < u.n_tokens && j->n_got < CAP; i++) j->got[j->n_got++] = u.tokens[i];
        if (j->text_len + u.text_len < sizeof j->text) {
            memcpy(j->text + j->text_len, u.text, u.text_len);
            j->text_len += u.text_len;
        }
        if (u.state == TL_ENGINE_FINISHED) {
            j->stop = u.stop_reason, j->status = u.status, j->stats = u.stats;
            break;
        }
    }
    tl_engine_cancel(engine, j->id); /* done with it: frees the finished request */
    return NULL;
}

typedef struct {
    tl_engine *engine;
    uint64_t id;
    int result;
} wait_job;

static void *wait_once(void *arg) {
    wait_job *w = arg;
    w->result = tl_engine_wait(w->engine, w->id, 30000);
    return NULL;
}

/* Reads request `id` of engine e to its end: its tokens into out (at most cap; NULL with cap
   0), its last update in *last; returns how many tokens came. */
static int read_tokens(tl_engine *e, uint64_t id, int32_t *out, int cap, tl_engine_update *last) {
    int n = 0;
    memset(last, 0, sizeof *last);
    while (tl_engine_wait(e, id, 1000) >= 0 && tl_engine_read(e, id, last) == TL_OK) {
        for (int i = 0; i < last->n_tokens; i++, n++)
            if (n < cap) out[n] = last->tokens[i];
        if (last->state == TL_ENGINE_FINISHED) break;
    }
    return n;
}

/* Reads request `id` until it finishes (or a wait or read fails): its last update in *last,
   and the number of tokens of all of them. */
static int read_to_end(tl_engine *e, uint64_t id, tl_engine_update *last) { return read_tokens(e, id, NULL, 0, last); }

static tl_session *new_session_n(const int32_t *prompt, int n, const tl_generate_config *cfg) {
    tl_session *s = NULL;
    if (tl_session_new(model, prompt, n, cfg, &s) != TL_OK) printf("session: %s\n", tl_last_error());
    return s;
}
static tl_session *new_session(const int32_t *prompt, const tl_generate_config *cfg) { return new_session_n(prompt, 4, cfg); }

static void counters(tl_engine_counters *c) { tl_engine_get_counters(engine, c); }

/* A logits hook that holds the engine thread inside a step until the test opens the gate:
   it makes "full", "queued" and "cancelled mid-step" deterministic on a fast model. */
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static bool gate_open;
static int gate_hook(void *user, float *logits, int vocab_size, const int32_t *tokens, int n) {
    pthread_mutex_lock(&gate_mu);
    while (!gate_open) pthread_cond_wait(&gate_cv, &gate_mu);
    pthread_mutex_unlock(&gate_mu);
    return TL_HOOK_CONTINUE;
}
/* A logits hook whose k-th call holds its step until the test has released k calls (the first
   HOLD_CALLS of them; the rest pass). */
enum { HOLD_CALLS = 2 };
static int hold_calls, hold_released;
static int hold_hook(void *user, float *logits, int vocab_size, const int32_t *tokens, int n) {
    (void)user, (void)logits, (void)vocab_size, (void)tokens, (void)n;
    pthread_mutex_lock(&gate_mu);
    const int call = ++hold_calls;
    pthread_cond_broadcast(&gate_cv);
    while (call <= HOLD_CALLS && hold_released < call) pthread_cond_wait(&gate_cv, &gate_mu);
    pthread_mutex_unlock(&gate_mu);
    return TL_HOOK_CONTINUE;
}
static void hold_wait_calls(int calls) { /* until the hook has been called that often */
    pthread_mutex_lock(&gate_mu);
    while (hold_calls < calls) pthread_cond_wait(&gate_cv, &gate_mu);
    pthread_mutex_unlock(&gate_mu);
}
static void hold_reset(void) { /* for another use of the hook: its next call is the first */
    pthread_mutex_lock(&gate_mu);
    hold_calls = hold_released = 0;
    pthread_mutex_unlock(&gate_mu);
}
static void hold_release(int calls) {
    pthread_mutex_lock(&gate_mu);
    hold_released = calls;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}

/* A logits hook that fails at a session's third token (its history is the prompt, then each
   emitted token). */
static int fail_hook(void *user, float *logits, int vocab_size, const int32_t *tokens, int n) {
    (void)user, (void)logits, (void)vocab_size, (void)tokens;
    return n >= 4 + 2 ? TL_HOOK_ERROR : TL_HOOK_CONTINUE;
}

/* A logits hook that forces the tokens of `forced` after a prompt of 4, one a step. */
static struct {
    int32_t ids[256];
    int n;
} forced;
static int force_hook(void *user, float *logits, int vocab_size, const int32_t *tokens, int n) {
    (void)user, (void)tokens;
    const int step = n - 4;
    const int32_t want = step < forced.n ? forced.ids[step] : 0;
    for (int i = 0; i < vocab_size; i++) logits[i] = i == want ? 10.0f : -10.0f;
    return TL_HOOK_CONTINUE;
}

/* An on_token hook that frees its own session (held by the engine) at its second token. */
static int free_self_hook(void *user, int32_t token, int position) {
    (void)token, (void)position;
    static int seen;
    if (++seen == 2) tl_session_free(*(tl_session **)user);
    return TL_HOOK_CONTINUE;
}
/* An on_token hook that stops (or frees: user's `freeing`) the engine holding its session,
   at the session's second token: on the engine thread, which cannot join itself. */
static tl_engine *hooked_engine;
static int stop_engine_hook(void *user, int32_t token, int position) {
    (void)token, (void)position;
    static int seen;
    if (++seen % 2 == 0) {
        if (*(const bool *)user) tl_engine_free(hooked_engine);
        else tl_engine_stop(hooked_engine);
    }
    return TL_HOOK_CONTINUE;
}
/* A logits hook of a beam session that keeps its hypotheses apart (no token settles) and
   cancels its own engine request at its 5th call, counting the calls after that. */
static uint64_t beam_request;
static atomic_int beam_calls; /* (the main thread polls it while the engine's hook counts) */
static int beam_calls_after_cancel;
static void beam_apart(float *logits, int vocab_size, const int32_t *tokens, int n) {
    for (int i = 0; i < vocab_size; i++) logits[i] = -10.0f;
    for (int k = 0; k < 4; k++) logits[(tokens[n - 1] + 7 * k + 1) % vocab_size] = 1.0f; /* four equal ways on */
}
/* Four hypotheses that never meet: four ways on from the prompt, then one way on from each
   (its last token + 1), so that no token settles until max_tokens; counting calls. Its 5th
   call holds until the engine is stopping (tl_engine_wait answers -1 once tl_engine_stop has
   begun). */
static atomic_int stopped_beam_calls;
static int stopped_beam_prompt = -1;
static tl_engine *stopping_engine;
static uint64_t stopping_request;
static int stopped_beam_hook(void *user, float *logits, int vocab_size, const int32_t *tokens, int n) {
    (void)user;
    if (stopped_beam_prompt < 0) stopped_beam_prompt = n;
    if (n == stopped_beam_prompt) {
        beam_apart(logits, vocab_size, tokens, n);
    } else {
        for (int i = 0; i < vocab_size; i++) logits[i] = -10.0f;
        logits[(tokens[n - 1] + 1) % vocab_size] = 1.0f;
    }
    if (atomic_fetch_add(&stopped_beam_calls, 1) + 1 == 5)
        while (tl_engine_wait(stopping_engine, stopping_request, 1) != -1) {}
    return TL_HOOK_CONTINUE;
}
static int beam_hook(void *user, float *logits, int vocab_size, const int32_t *tokens, int n) {
    (void)user;
    beam_apart(logits, vocab_size, tokens, n);
    const int calls = atomic_fetch_add(&beam_calls, 1) + 1;
    if (calls == 5) tl_engine_cancel(engine, beam_request);
    else if (calls > 5) beam_calls_after_cancel++;
    return TL_HOOK_CONTINUE;
}

/* The KV budget: tl_session_max_kv_bytes is what a session's pages come to (a whole page of
   rows per layer instance of its depth, counted against the model's memory); a session over
   the budget is refused at submit and stays the caller's; running requests' shares stay
   within the budget, the first queued one that does not fit holding back the rest (a small
   one that would fit waits behind it), and every request still emits tl_generate's tokens. */
static void kv_budget(const char *dir) {
    const struct tl_model_info *info = tl_model_info(model);
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.ignore_eos = 1;
    cfg.max_tokens = 12; /* 4 + 12 rows: one page of 16 per layer instance */
    const int32_t prompt[4] = {21, 22, 23, 24};
    tl_model *own = NULL; /* (the shared model's pages are other requests' too, freed as their engines get to it) */
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 1;
    CHECK(tl_model_load(dir, &o, &own) == TL_OK, "load: %s", tl_last_error());
    if (!own) return;
    tl_session *one_page = NULL;
    CHECK(tl_session_new(own, prompt, 4, &cfg, &one_page) == TL_OK, "%s", tl_last_error());
    const int64_t page_share = tl_session_max_kv_bytes(one_page);
    const int slots = info->n_prelude + info->n_block * info->default_loops + info->n_coda;
    const int64_t element = strcmp(info->kv_type, "f16") == 0 ? 2 : 4; /* (the suite reruns this with an f16 cache) */
    const int64_t page = 2 * 16 * (int64_t)info->n_kv_heads * info->head_dim * element;
    CHECK(page_share == slots * page, "a 16-row session's share %lld, want %d slots x %lld bytes", (long long)page_share, slots,
          (long long)page);
    int32_t token;
    tl_stop_reason stop = TL_STOP_NONE;
    while (stop == TL_STOP_NONE && tl_session_step(one_page, &token, &stop) == TL_OK) {}
    tl_model_memory mem;
    tl_model_get_memory(own, &mem);
    CHECK(mem.kv_bytes == page_share, "run to its end, the session holds %lld bytes of K/V, its share %lld",
          (long long)mem.kv_bytes, (long long)page_share);
    tl_session_free(one_page);
    tl_model_free(own);
    CHECK(tl_session_max_kv_bytes(NULL) == 0, "NULL: 0");

    tl_engine_options eo;
    tl_engine_options_init(&eo);
    CHECK(eo.kv_budget_bytes == 0, "no budget by default");
    eo.kv_budget_bytes = -1;
    tl_engine *e = NULL;
    CHECK_ERROR(tl_engine_new(model, &eo, &e), TL_ERR_INVALID_ARGUMENT, "kv_budget_bytes = -1 must be 0 (none) or more");
    cfg.max_tokens = 60; /* 64 rows: 4 pages */
    tl_session *big = new_session(prompt, &cfg);
    const int64_t big_share = tl_session_max_kv_bytes(big);
    CHECK(big_share == 4 * page_share, "64 rows: %lld, want 4 pages' %lld", (long long)big_share, (long long)(4 * page_share));
    eo.kv_budget_bytes = big_share + big_share / 2; /* one big request at a time, and a small one beside it */
    eo.max_active = 4;
    CHECK(tl_engine_new(model, &eo, &e) == TL_OK, "%s", tl_last_error());
    tl_generate_config huge = cfg;
    huge.max_tokens = 120; /* 8 pages: over the budget */
    tl_session *over = new_session(prompt, &huge);
    uint64_t id = 1;
    CHECK_ERROR(tl_engine_submit(e, over, &id), TL_ERR_INVALID_ARGUMENT, "more than the engine's kv_budget_bytes");
    CHECK(id == 0 && tl_session_step(over, &token, &stop) == TL_OK, "the refused session is the caller's: %s", tl_last_error());
    tl_session_free(over);
    /* a beam search's share holds every beam's rows: 6 beams of 20 tokens over the budget (9 pages of 6),
       where 20 tokens alone fit; the message says which rows */
    tl_generate_config beams = cfg;
    beams.max_tokens = 20, beams.beam_size = 6;
    over = new_session(prompt, &beams);
    CHECK(tl_session_max_kv_bytes(over) > eo.kv_budget_bytes, "6 beams: %lld", (long long)tl_session_max_kv_bytes(over));
    CHECK_ERROR(tl_engine_submit(e, over, &id), TL_ERR_INVALID_ARGUMENT, "its prompt's and max_tokens' rows, and every beam's, at");
    tl_session_free(over);

    /* A (held in its steps by the hook), then B (as big) and C (small, would fit beside A). */
    tl_generate_config held = cfg;
    held.logits_processor = hold_hook;
    tl_generate_config small = cfg;
    small.max_tokens = 12;
    const int32_t prompts[3][4] = {{31, 32, 33, 34}, {41, 42, 43, 44}, {51, 52, 53, 54}};
    const tl_generate_config *cfgs[3] = {&held, &cfg, &small};
    uint64_t ids[3] = {0};
    tl_session_free(big);
    hold_reset();
    CHECK(tl_engine_submit(e, new_session(prompts[0], cfgs[0]), &ids[0]) == TL_OK && ids[0] > 0, "A: %s", tl_last_error());
    hold_wait_calls(1);
    for (int i = 1; i < 3; i++)
        CHECK(tl_engine_submit(e, new_session(prompts[i], cfgs[i]), &ids[i]) == TL_OK && ids[i] > 0, "%c: %s", 'A' + i,
              tl_last_error());
    hold_release(1);
    hold_wait_calls(2); /* A's next step: the admission between them left B and C queued */
    tl_engine_counters c;
    tl_engine_get_counters(e, &c);
    CHECK(c.kv_budget_bytes == eo.kv_budget_bytes && c.active == 1 && c.queued == 2 && c.kv_reserved_bytes == big_share &&
              c.kv_waiting == 2,
          "A running: active %d, queued %d, reserved %lld (want %lld), waiting for memory %d", c.active, c.queued,
          (long long)c.kv_reserved_bytes, (long long)big_share, c.kv_waiting);
    tl_engine_update u;
    CHECK(tl_engine_read(e, ids[2], &u) == TL_OK && u.state == TL_ENGINE_QUEUED, "C waits behind B: state %d", (int)u.state);
    hold_release(HOLD_CALLS); /* (the later calls pass) */
    for (int i = 0; i < 3; i++) {
        int32_t want[80], got[80];
        int n_want = 0;
        tl_generate_config alone = *cfgs[i];
        alone.logits_processor = NULL; /* (edits nothing) */
        CHECK(tl_generate(model, prompts[i], 4, &alone, want, 80, &n_want, NULL) == TL_OK, "%s", tl_last_error());
        const int n_got = read_tokens(e, ids[i], got, 80, &u);
        CHECK(u.state == TL_ENGINE_FINISHED && u.status == TL_OK && n_got == n_want - 4 &&
                  !memcmp(got, want + 4, (size_t)n_got * sizeof *got),
              "%c: %d tokens, as tl_generate's %d", 'A' + i, n_got, n_want - 4);
        tl_engine_cancel(e, ids[i]);
    }
    tl_engine_get_counters(e, &c);
    for (int spins = 0; spins < 2000 && (c.kv_reserved_bytes != 0 || c.active != 0); spins++) {
        nanosleep(&(struct timespec){0, 1000000}, NULL);
        tl_engine_get_counters(e, &c);
    }
    CHECK(c.kv_reserved_bytes == 0 && c.kv_waiting == 0 && c.active == 0, "all ended: reserved %lld, waiting %d",
          (long long)c.kv_reserved_bytes, c.kv_waiting);
    tl_engine_free(e);

    /* A budget of exactly one request's share: that request is taken and runs (a share equal
       to the budget fits it); one cancelled in the middle of a step gives its share back, and
       the next runs (it kept the share: the engine waited for memory for good). */
    eo.kv_budget_bytes = big_share;
    eo.max_active = 2;
    CHECK(tl_engine_new(model, &eo, &e) == TL_OK, "%s", tl_last_error());
    hold_reset();
    uint64_t a_id = 0, b_id = 0;
    tl_session *a = new_session(prompts[0], &held);
    const bool a_taken = tl_engine_submit(e, a, &a_id) == TL_OK && a_id > 0;
    CHECK(a_taken, "a share equal to the budget: %s", tl_last_error());
    if (a_taken) {
        hold_wait_calls(1); /* (A inside its first step) */
        tl_engine_cancel(e, a_id);
    } else {
        tl_session_free(a);
    }
    hold_release(HOLD_CALLS);
    CHECK(tl_engine_submit(e, new_session(prompts[1], &cfg), &b_id) == TL_OK && b_id > 0, "B: %s", tl_last_error());
    int32_t want_b[80], got_b[80];
    int n_want_b = 0;
    CHECK(tl_generate(model, prompts[1], 4, &cfg, want_b, 80, &n_want_b, NULL) == TL_OK, "%s", tl_last_error());
    /* (admitted within 10 s, else read_tokens would wait for good) */
    tl_engine_counters admitted;
    tl_engine_get_counters(e, &admitted);
    for (int spins = 0; spins < 10000 && admitted.queued > 0; spins++) {
        nanosleep(&(struct timespec){0, 1000000}, NULL);
        tl_engine_get_counters(e, &admitted);
    }
    CHECK(admitted.queued == 0, "B still queued after A's cancel: reserved %lld of %lld", (long long)admitted.kv_reserved_bytes,
          (long long)eo.kv_budget_bytes);
    const int n_got_b = admitted.queued == 0 ? read_tokens(e, b_id, got_b, 80, &u) : 0;
    CHECK(u.state == TL_ENGINE_FINISHED && u.status == TL_OK && n_got_b == n_want_b - 4 &&
              !memcmp(got_b, want_b + 4, (size_t)n_got_b * sizeof *got_b),
          "B after A's cancel: %d tokens (want %d), state %d", n_got_b, n_want_b - 4, (int)u.state);
    tl_engine_cancel(e, b_id);
    tl_engine_get_counters(e, &c);
    for (int spins = 0; spins < 2000 && (c.kv_reserved_bytes != 0 || c.active != 0); spins++) {
        nanosleep(&(struct timespec){0, 1000000}, NULL);
        tl_engine_get_counters(e, &c);
    }
    CHECK(c.kv_reserved_bytes == 0 && c.active == 0, "all ended: reserved %lld", (long long)c.kv_reserved_bytes);
    tl_engine_free(e);
}

enum { LATER_REQUESTS = 8, LATER_TOKENS = 24 };
static atomic_int later_tokens[LATER_REQUESTS]; /* each later request's tokens so far */
static int later_done_at_b;                      /* those finished at B's first token; -1 before */
static int count_token(void *user, int32_t token, int position) {
    (void)token, (void)position;
    atomic_fetch_add((atomic_int *)user, 1);
    return TL_HOOK_CONTINUE;
}
static int b_first_token(void *user, int32_t token, int position) {
    (void)user, (void)token, (void)position;
    if (later_done_at_b < 0) {
        later_done_at_b = 0;
        for (int k = 0; k < LATER_REQUESTS; k++) later_done_at_b += atomic_load(&later_tokens[k]) >= LATER_TOKENS;
    }
    nanosleep(&(struct timespec){0, 2000000}, NULL); /* (B runs for 50 ms: a reader sees it running) */
    return TL_HOOK_CONTINUE;
}

/* Requests of one prompt (the n choices of a server's request): the first prefills it, the
   others wait for that prefill and take its rows from the prefix pool (they computed them too,
   in the same passes), each emitting what it emits alone on a model without a pool; with
   windows too. */
static void shared_prefill(const char *dir) {
    tl_model *pooled = NULL, *cold = NULL;
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 1;
    CHECK(tl_model_load(dir, &o, &pooled) == TL_OK && tl_model_load(dir, &o, &cold) == TL_OK, "load: %s", tl_last_error());
    if (!pooled || !cold) { tl_model_free(pooled); tl_model_free(cold); return; }
    CHECK(tl_model_set_prefix_pool(pooled, 64 << 20) == TL_OK, "%s", tl_last_error());
    tl_engine_options eo;
    tl_engine_options_init(&eo);
    eo.max_active = 4;
    tl_engine *e = NULL;
    CHECK(tl_engine_new(pooled, &eo, &e) == TL_OK, "%s", tl_last_error());
    enum { CHOICES = 4, LEN = 40, GEN = 8, HEAD = 5 };
    /* twice: the pool cold, then holding the prompt's first HEAD tokens (a chat template's
       opening, which every choice takes at its open: they computed the rest side by side) */
    for (int warm = 0; warm < 2; warm++) {
        int32_t prompt[LEN];
        for (int i = 0; i < LEN; i++) prompt[i] = (int32_t)((i * 29 + 3 + 17 * warm) % 300);
        if (warm) {
            tl_generate_config head;
            tl_generate_config_init(&head);
            head.max_tokens = 1;
            int32_t head_out[HEAD + 1];
            int n_head = 0;
            CHECK(tl_generate(pooled, prompt, HEAD, &head, head_out, HEAD + 1, &n_head, NULL) == TL_OK, "%s", tl_last_error());
        }
        const int opened = warm ? HEAD : 0; /* (what each choice takes at its open) */
        tl_generate_config cfgs[CHOICES];
        uint64_t ids[CHOICES] = {0};
        for (int c = 0; c < CHOICES; c++) {
            tl_generate_config_init(&cfgs[c]);
            cfgs[c].max_tokens = GEN;
            cfgs[c].ignore_eos = 1;
            cfgs[c].temperature = 0.9f;
            cfgs[c].sample_seed = (uint64_t)(40 + c);
            tl_session *s = NULL;
            CHECK(tl_session_new(pooled, prompt, LEN, &cfgs[c], &s) == TL_OK && tl_engine_submit(e, s, &ids[c]) == TL_OK &&
                      ids[c] > 0, "choice %d: %s", c, tl_last_error());
        }
        int fresh = 0, from_pool = 0, computed = 0;
        for (int c = 0; c < CHOICES; c++) {
            tl_engine_update u;
            int32_t got[GEN], want[LEN + GEN];
            const int n_got = read_tokens(e, ids[c], got, GEN, &u);
            int n_want = 0;
            CHECK(tl_generate(cold, prompt, LEN, &cfgs[c], want, LEN + GEN, &n_want, NULL) == TL_OK, "%s", tl_last_error());
            CHECK(u.state == TL_ENGINE_FINISHED && u.status == TL_OK && n_got == GEN && !memcmp(got, want + LEN, sizeof got),
                  "choice %d: not its tokens alone on a cold model", c);
            fresh += u.stats.prompt_tokens_reused == opened;
            from_pool += u.stats.prompt_tokens_reused == LEN - 1;
            computed += u.stats.prefill_tokens;
            tl_engine_cancel(e, ids[c]);
        }
        CHECK(fresh == 1 && from_pool == CHOICES - 1 && computed == LEN - opened + CHOICES - 1,
              "%s: %d choices computed the prompt, %d took it from the pool (want 1 and %d), %d prompt rows computed (want %d)",
              warm ? "a head pooled" : "cold", fresh, from_pool, CHOICES - 1, computed, LEN - opened + CHOICES - 1);
    }
    /* A prompt of 17 tokens: its 16 rows before the last are exactly a page, enough to wait
       for (a wait needs a page of rows more than the pool gives now) */
    {
        int32_t prompt[17];
        for (int i = 0; i < 17; i++) prompt[i] = (int32_t)((i * 43 + 9) % 300);
        uint64_t ids[2] = {0};
        tl_generate_config one_page;
        tl_generate_config_init(&one_page);
        one_page.max_tokens = 3;
        one_page.ignore_eos = 1;
        for (int c = 0; c < 2; c++) {
            tl_session *s = NULL;
            CHECK(tl_session_new(pooled, prompt, 17, &one_page, &s) == TL_OK && tl_engine_submit(e, s, &ids[c]) == TL_OK,
                  "page choice %d: %s", c, tl_last_error());
        }
        tl_engine_update u;
        read_to_end(e, ids[0], &u);
        tl_engine_cancel(e, ids[0]);
        read_to_end(e, ids[1], &u);
        CHECK(u.state == TL_ENGINE_FINISHED && u.stats.prompt_tokens_reused == 16 && u.stats.prefill_tokens == 1,
              "the second of a 17-token prompt: %d rows from the pool, %d computed (want 16 and 1)", u.stats.prompt_tokens_reused,
              u.stats.prefill_tokens);
        tl_engine_cancel(e, ids[1]);
    }
    /* With windows (cache_window W): a session's rows before W are an unwindowed session's, so
       the first (W 28) lends its first 28 rows, and the others wait for them: a plain one takes
       the 28 (and computes the rest), those of W 20 and 24 their 20 and 24 (windowed sessions
       neither waited nor lent before). */
    {
        int32_t prompt[LEN];
        for (int i = 0; i < LEN; i++) prompt[i] = (int32_t)((i * 31 + 11) % 300);
        const int windows[CHOICES] = {28, 0, 20, 24}, want_reused[CHOICES] = {0, 28, 20, 24};
        tl_generate_config cfgs[CHOICES];
        uint64_t ids[CHOICES] = {0};
        for (int c = 0; c < CHOICES; c++) {
            tl_generate_config_init(&cfgs[c]);
            cfgs[c].max_tokens = GEN;
            cfgs[c].ignore_eos = 1;
            cfgs[c].temperature = 0.9f;
            cfgs[c].sample_seed = (uint64_t)(60 + c);
            cfgs[c].cache_window = windows[c];
            tl_session *s = NULL;
            CHECK(tl_session_new(pooled, prompt, LEN, &cfgs[c], &s) == TL_OK && tl_engine_submit(e, s, &ids[c]) == TL_OK,
                  "windowed choice %d: %s", c, tl_last_error());
        }
        for (int c = 0; c < CHOICES; c++) {
            tl_engine_update u;
            int32_t got[GEN], want[LEN + GEN];
            const int n_got = read_tokens(e, ids[c], got, GEN, &u);
            int n_want = 0;
            CHECK(tl_generate(cold, prompt, LEN, &cfgs[c], want, LEN + GEN, &n_want, NULL) == TL_OK, "%s", tl_last_error());
            CHECK(u.state == TL_ENGINE_FINISHED && u.status == TL_OK && n_got == GEN && !memcmp(got, want + LEN, sizeof got),
                  "window %d: not its tokens alone on a cold model", windows[c]);
            CHECK(u.stats.prompt_tokens_reused == want_reused[c] && u.stats.prefill_tokens == LEN - want_reused[c],
                  "window %d: %d prompt rows from the pool, %d computed (want %d and %d)", windows[c],
                  u.stats.prompt_tokens_reused, u.stats.prefill_tokens, want_reused[c], LEN - want_reused[c]);
            tl_engine_cancel(e, ids[c]);
        }
    }
    tl_engine_counters c;
    tl_engine_get_counters(e, &c);
    CHECK(c.prefill_waiting == 0 && c.active == 0, "at rest: %d waiting for a prefill", c.prefill_waiting);
    tl_engine_free(e);

    /* A request waits only for requests submitted before it, and only where their prompt gives
       it a page more than it can take already: B, made while the pool was cold, shares with the
       later ones only the system prompt the pool holds by then. It waited for each of them in
       turn (395 later requests finished before its first token, the review found; here the
       second took its place); now it starts beside the first, and takes that system prompt at
       its admission. */
    enum { SYSTEM = 32, OWN = 40, LATER = LATER_REQUESTS };
    int32_t text[SYSTEM + OWN];
    for (int i = 0; i < SYSTEM + OWN; i++) text[i] = (int32_t)((i * 53 + 7) % 300);
    tl_generate_config one;
    tl_generate_config_init(&one);
    one.max_tokens = LATER_TOKENS;
    one.ignore_eos = 1;
    eo.max_active = 2;
    eo.step_rows = 4; /* (prefills over many iterations) */
    CHECK(tl_engine_new(pooled, &eo, &e) == TL_OK, "%s", tl_last_error());
    /* (counted on the engine thread, which runs every hook: at B's first token, how many later
       requests had emitted all their tokens) */
    tl_generate_config b_cfg = one, q_cfg = one;
    b_cfg.on_token = b_first_token;
    q_cfg.on_token = count_token;
    later_done_at_b = -1;
    tl_session *b = NULL;
    CHECK(tl_session_new(pooled, text, SYSTEM + OWN, &b_cfg, &b) == TL_OK, "%s", tl_last_error()); /* (the pool cold) */
    text[SYSTEM] = 299; /* another request of the same system prompt, alone: the pool has it */
    int32_t out[SYSTEM + OWN + 24];
    int n_out = 0;
    CHECK(tl_generate(pooled, text, SYSTEM + OWN, &one, out, SYSTEM + OWN + 24, &n_out, NULL) == TL_OK, "%s", tl_last_error());
    uint64_t first = 0, b_id = 0, later[LATER] = {0};
    tl_session *s = NULL;
    text[SYSTEM] = 298;
    CHECK(tl_session_new(pooled, text, SYSTEM + OWN, &one, &s) == TL_OK && tl_engine_submit(e, s, &first) == TL_OK &&
              tl_engine_submit(e, b, &b_id) == TL_OK && b_id > 0,
          "%s", tl_last_error());
    for (int k = 0; k < LATER; k++) {
        text[SYSTEM] = (int32_t)(200 + k);
        s = NULL;
        atomic_store(&later_tokens[k], 0);
        q_cfg.on_token_user = &later_tokens[k];
        CHECK(tl_session_new(pooled, text, SYSTEM + OWN, &q_cfg, &s) == TL_OK && tl_engine_submit(e, s, &later[k]) == TL_OK,
              "%s", tl_last_error());
    }
    tl_engine_update u;
    memset(&u, 0, sizeof u);
    /* Read while it runs, B's update says what the pool gave its prompt at its admission (it
       said 0 until B finished: a server counted a cancelled request's share at its submit) */
    int n_b = 0, running_reads = 0, running_reused = SYSTEM;
    while (tl_engine_wait(e, b_id, 1000) >= 0 && tl_engine_read(e, b_id, &u) == TL_OK) {
        n_b += u.n_tokens;
        if (u.state == TL_ENGINE_RUNNING && running_reads++ == 0) running_reused = u.stats.prompt_tokens_reused;
        if (u.state == TL_ENGINE_FINISHED) break;
    }
    CHECK(n_b == 24 && u.state == TL_ENGINE_FINISHED && u.stats.prompt_tokens_reused == SYSTEM,
          "B: %s, its prompt took %d rows from the pool (want the system prompt's %d)", tl_status_name(u.status),
          u.stats.prompt_tokens_reused, SYSTEM);
    CHECK(running_reads > 0 && running_reused == SYSTEM, "B read %d times while it ran, then with %d rows from the pool "
          "(want %d)", running_reads, running_reused, SYSTEM);
    /* (B started beside the first: no later request could finish before its first token) */
    CHECK(later_done_at_b == 0, "%d later requests finished before B's first token: they held it back", later_done_at_b);
    tl_engine_free(e);
    tl_model_free(pooled);
    tl_model_free(cold);
}

static void set_gate(bool open) {
    pthread_mutex_lock(&gate_mu);
    gate_open = open;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}

int main(int argc, char **argv) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/textmodel", argc > 1 ? argv[1] : "tests/data");
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 2;
    if (tl_model_load(dir, &o, &model) != TL_OK) { printf("load: %s\n", tl_last_error()); return 1; }

    tl_engine_options eo;
    tl_engine_options_init(&eo);
    CHECK(eo.max_active == 8 && eo.max_queued == 32 && eo.step_rows == -1, "defaults %d %d %d", eo.max_active,
          eo.max_queued, eo.step_rows);
    /* auto: whole passes of 64 rows with 32 or more left for prompts when every place runs */
    CHECK(tl_engine_auto_step_rows(8) == 64 && tl_engine_auto_step_rows(32) == 64 && tl_engine_auto_step_rows(33) == 128 &&
              tl_engine_auto_step_rows(63) == 128 && tl_engine_auto_step_rows(97) == 192,
          "auto step rows %d %d %d", tl_engine_auto_step_rows(8), tl_engine_auto_step_rows(33), tl_engine_auto_step_rows(97));
    for (int active = 1; active <= 4096; active++) {
        const int rows = tl_engine_auto_step_rows(active);
        if (rows % 64 || rows - active < 32 || rows - active >= 96) { CHECK(0, "max_active %d: auto %d", active, rows); break; }
    }
    eo.max_active = 0;
    CHECK_ERROR(tl_engine_new(model, &eo, &engine), TL_ERR_INVALID_ARGUMENT, "max_active = 0");
    eo.max_active = 4, eo.max_queued = -1;
    CHECK_ERROR(tl_engine_new(model, &eo, &engine), TL_ERR_INVALID_ARGUMENT, "max_queued = -1 must be in [0, 1048576]");
    eo.max_queued = 0, eo.step_rows = -2;
    CHECK_ERROR(tl_engine_new(model, &eo, &engine), TL_ERR_INVALID_ARGUMENT, "step_rows = -2 must be -1 (auto)");
    eo.step_rows = 4; /* no row left for prompts */
    CHECK_ERROR(tl_engine_new(model, &eo, &engine), TL_ERR_INVALID_ARGUMENT, "more than max_active = 4");
    eo.step_rows = -1;
    {   /* the default (auto) takes any max_active: 100 places get 128 rows */
        tl_engine_options big = eo;
        big.max_active = 100;
        tl_engine *e100 = NULL;
        CHECK(tl_engine_new(model, &big, &e100) == TL_OK, "max_active 100 with auto step rows: %s", tl_last_error());
        tl_engine_free(e100);
    }
    eo.max_active = 4, eo.max_queued = 2;
    CHECK(tl_engine_new(model, &eo, &engine) == TL_OK, "%s", tl_last_error());

    /* finished_held: a request that finished counts until its caller lets it go (a server's
       exiting worker waits for the handlers still reading their ends); one cancelled while it
       ran never does. */
    {
        tl_generate_config two;
        tl_generate_config_init(&two);
        two.max_tokens = 2;
        two.ignore_eos = 1;
        const int32_t held_prompt[4] = {5, 6, 7, 8};
        uint64_t held = 0, dropped = 0;
        tl_engine_update u;
        tl_engine_counters c;
        tl_engine *holding = NULL; /* (its own: the counters below are the main engine's) */
        CHECK(tl_engine_new(model, &eo, &holding) == TL_OK, "%s", tl_last_error());
        CHECK(tl_engine_submit(holding, new_session(held_prompt, &two), &held) == TL_OK, "%s", tl_last_error());
        CHECK(read_to_end(holding, held, &u) == 2 && u.state == TL_ENGINE_FINISHED, "the held request's 2 tokens");
        tl_engine_get_counters(holding, &c);
        CHECK(c.active == 0 && c.queued == 0 && c.finished_held == 1, "finished, read, not let go: active %d, held %d",
              c.active, c.finished_held);
        tl_engine_cancel(holding, held);
        tl_engine_get_counters(holding, &c);
        CHECK(c.finished_held == 0, "let go: held %d", c.finished_held);
        two.max_tokens = 40;
        CHECK(tl_engine_submit(holding, new_session(held_prompt, &two), &dropped) == TL_OK, "%s", tl_last_error());
        tl_engine_cancel(holding, dropped);
        for (int spins = 0; spins < 2000; spins++) { /* until the engine has dropped it */
            tl_engine_get_counters(holding, &c);
            if (c.active == 0 && c.queued == 0) break;
            nanosleep(&(struct timespec){0, 1000000}, NULL);
        }
        CHECK(c.active == 0 && c.queued == 0 && c.finished_held == 0, "cancelled while it ran: active %d, held %d",
              c.active, c.finished_held);
        tl_engine_free(holding);
    }

    /* Mixed configs: greedy, seeded sampling, lengths, a stop string, a window, EOS on. */
    static job_t jobs[N];
    for (int i = 0; i < N; i++) {
        job_t *j = &jobs[i];
        for (int k = 0; k < 4; k++) j->prompt[k] = (int32_t)((i * 37 + k * 11) % 300);
        tl_generate_config_init(&j->cfg);
        j->cfg.max_tokens = 10 + 17 * i;
        j->cfg.ignore_eos = i != 5;
        j->cfg.temperature = i % 2 ? 0.9f : 0.0f;
        j->cfg.sample_seed = (uint64_t)(100 + i);
        j->cfg.logits_processor = gate_hook; /* edits nothing: the tokens stay those of a plain run */
        if (i == 4) j->cfg.cache_window = 16;
        if (i == 3) {
            j->stop_string = " ";
            j->cfg.stop_strings = &j->stop_string;
            j->cfg.n_stop_strings = 1;
        }
    }
    set_gate(false);
    for (int i = 0; i < N; i++) {
        CHECK(tl_engine_submit(engine, new_session(jobs[i].prompt, &jobs[i].cfg), &jobs[i].id) == TL_OK, "%s", tl_last_error());
        CHECK(jobs[i].id > 0, "request %d admitted", i);
    }
    /* Four running + two queued: the seventh is refused and stays the caller's. */
    tl_session *extra = new_session(jobs[0].prompt, &jobs[0].cfg);
    uint64_t extra_id = 99;
    CHECK(tl_engine_submit(engine, extra, &extra_id) == TL_OK && extra_id == 0, "full engine: id %llu", (unsigned long long)extra_id);
    tl_session_free(extra);
    CHECK(tl_engine_wait(engine, 12345, 10) == -1, "unknown id");
    tl_engine_update u;
    CHECK_ERROR(tl_engine_read(engine, 12345, &u), TL_ERR_INVALID_ARGUMENT, "unknown request id 12345");

    CHECK(tl_engine_wait(engine, jobs[5].id, 20) == 0, "queued: nothing to read yet (timeout)");
    set_gate(true);
    pthread_t th[N];
    for (int i = 0; i < N; i++) pthread_create(&th[i], NULL, reader, &jobs[i]);
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);

    for (int i = 0; i < N; i++) {
        job_t *j = &jobs[i];
        int32_t want[CAP];
        int want_len = 0;
        tl_generate_stats ws;
        CHECK(tl_generate(model, j->prompt, 4, &j->cfg, want, CAP, &want_len, &ws) == TL_OK, "%s", tl_last_error());
        CHECK(j->status == TL_OK, "job %d status %s", i, tl_status_name(j->status));
        CHECK(j->n_got == want_len - 4 && !memcmp(j->got, want + 4, (size_t)j->n_got * sizeof(int32_t)),
              "job %d: %d tokens, alone %d", i, j->n_got, want_len - 4);
        CHECK(j->stop == ws.stop_reason && j->stats.tokens_emitted == j->n_got,
              "job %d stop %s vs %s", i, tl_stop_reason_name(j->stop), tl_stop_reason_name(ws.stop_reason));
        char *text = NULL;
        size_t len = 0;
        tl_decode(model, j->got, j->n_got, &text, &len);
        /* Text = the detokenized tokens (a stop string's match included, as the session shows it). */
        CHECK(len == j->text_len && !memcmp(text, j->text, len), "job %d text \"%.*s\" vs \"%s\"", i,
              (int)j->text_len, j->text, text);
        tl_free(text);
    }
    CHECK(jobs[3].stop == TL_STOP_SEQUENCE, "stop string: %s", tl_stop_reason_name(jobs[3].stop));

    tl_engine_counters c;
    counters(&c);
    CHECK(c.active == 0 && c.queued == 0 && c.submitted == N && c.finished == N && c.rejected == 1 && c.cancelled == 0,
          "counters active %d queued %d submitted %llu finished %llu", c.active, c.queued,
          (unsigned long long)c.submitted, (unsigned long long)c.finished);
    CHECK(c.iterations > 0 && c.rows > c.iterations, "batched: %llu rows in %llu iterations",
          (unsigned long long)c.rows, (unsigned long long)c.iterations);

    /* Cancel while the engine is inside a step: queued requests go at once, running ones
       after the step in flight (at most one token each); nothing is left afterwards. */
    tl_generate_config lc;
    tl_generate_config_init(&lc);
    lc.max_tokens = 120;
    lc.ignore_eos = 1;
    lc.logits_processor = gate_hook;
    uint64_t ids[5];
    set_gate(false);
    for (int i = 0; i < 5; i++) tl_engine_submit(engine, new_session(jobs[0].prompt, &lc), &ids[i]);
    CHECK(ids[4] > 0, "five admitted");
    tl_engine_cancel(engine, ids[4]); /* queued: max_active is 4 */
    CHECK(tl_engine_wait(engine, ids[4], 10) == -1 && tl_engine_read(engine, ids[4], &u) != TL_OK, "cancelled id is gone");
    for (int i = 0; i < 4; i++) tl_engine_cancel(engine, ids[i]);
    tl_engine_cancel(engine, ids[0]); /* twice is harmless */
    CHECK(tl_engine_wait(engine, ids[0], 10) == -1, "a cancelled running id is gone for readers");
    set_gate(true);
    for (int t = 0; t < 5000; t++) {
        counters(&c);
        if (c.active == 0 && c.queued == 0) break;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    CHECK(c.active == 0 && c.queued == 0, "after cancel: active %d queued %d", c.active, c.queued);
    CHECK(c.cancelled == 5 && c.steps_after_cancel <= 4, /* 0 when the engine had not entered the step yet */
          "cancelled %llu, steps after cancel %llu (the step in flight only)",
          (unsigned long long)c.cancelled, (unsigned long long)c.steps_after_cancel);

    /* A waiter sleeps until its own request has something new: the steps of other requests
       do not wake it (one broadcast per step woke every waiter, the queued ones' too). */
    {
        tl_engine_options o1;
        tl_engine_options_init(&o1);
        o1.max_active = 1, o1.max_queued = 1;
        tl_engine *one = NULL;
        CHECK(tl_engine_new(model, &o1, &one) == TL_OK, "%s", tl_last_error());
        tl_generate_config ac = lc, bc = lc;
        ac.max_tokens = 40, bc.max_tokens = 3;
        uint64_t a = 0, b = 0;
        set_gate(false); /* the engine holds inside a's first step */
        tl_engine_submit(one, new_session(jobs[0].prompt, &ac), &a);
        tl_engine_submit(one, new_session(jobs[1].prompt, &bc), &b);
        CHECK(a > 0 && b > 0, "a running, b queued");
        CHECK(tl_engine_wait(one, b, 0) == 0, "a poll of a queued request: nothing yet");
        tl_engine_counters c1;
        tl_engine_get_counters(one, &c1);
        CHECK(c1.waiter_wakeups == 0, "a poll does not sleep: %llu wake-ups", (unsigned long long)c1.waiter_wakeups);
        wait_job w = {one, b, -2};
        pthread_t t;
        pthread_create(&t, NULL, wait_once, &w);
        struct timespec ts = {0, 50000000}; /* the waiter is asleep by then (if not, this checks less) */
        nanosleep(&ts, NULL);
        set_gate(true);
        pthread_join(t, NULL);
        tl_engine_get_counters(one, &c1);
        CHECK(w.result == 1, "b has output: %d", w.result);
        CHECK(c1.iterations >= 41, "a's 40 steps and b's first ran: %llu", (unsigned long long)c1.iterations);
        CHECK(c1.waiter_wakeups <= 2, "b's waiter woke %llu times over %llu steps (its output, maybe one spurious)",
              (unsigned long long)c1.waiter_wakeups, (unsigned long long)c1.iterations);
        tl_engine_cancel(one, a);
        tl_engine_cancel(one, b);
        tl_engine_free(one);
    }

    /* Submit refuses, for that request alone, what tl_session_step_batch would refuse (in a
       batch it failed every running request, and a session submitted twice was freed twice):
       a session of another model, a finished one, one already submitted. */
    {
        tl_engine_options o1;
        tl_engine_options_init(&o1);
        o1.max_active = 1;
        tl_engine *one;
        CHECK(tl_engine_new(model, &o1, &one) == TL_OK, "%s", tl_last_error());
        tl_model *other;
        CHECK(tl_model_load(dir, &o, &other) == TL_OK, "%s", tl_last_error());
        tl_generate_config gc = lc;
        gc.max_tokens = 2;
        const int32_t prompt[4] = {5, 6, 7, 8};
        uint64_t blocker = 0, queued = 0, refused = 7;
        set_gate(false); /* the blocker holds the one place: `queued` waits, never stepping */
        tl_session *queued_session = new_session(prompt, &gc), *foreign = NULL;
        CHECK(tl_engine_submit(one, new_session(prompt, &gc), &blocker) == TL_OK && blocker > 0, "%s", tl_last_error());
        CHECK(tl_engine_submit(one, queued_session, &queued) == TL_OK && queued > 0, "%s", tl_last_error());
        CHECK(tl_engine_submit(one, queued_session, &refused) == TL_ERR_INVALID_ARGUMENT && refused == 0 &&
                  strstr(tl_last_error(), "already submitted"),
              "the same session again: %s", tl_last_error());
        CHECK(tl_session_new(other, prompt, 4, &gc, &foreign) == TL_OK, "%s", tl_last_error());
        CHECK(tl_engine_submit(one, foreign, &refused) == TL_ERR_INVALID_ARGUMENT && strstr(tl_last_error(), "another model"),
              "another model's session: %s", tl_last_error());
        tl_generate_config one_token = gc;
        one_token.max_tokens = 1;
        one_token.logits_processor = NULL;
        tl_session *done_session = new_session(prompt, &one_token);
        int32_t token;
        tl_stop_reason stop;
        CHECK(tl_session_step(done_session, &token, &stop) == TL_OK && stop == TL_STOP_MAX_TOKENS, "one token");
        CHECK(tl_engine_submit(one, done_session, &refused) == TL_ERR_INVALID_ARGUMENT && strstr(tl_last_error(), "finished"),
              "a finished session: %s", tl_last_error());
        tl_session_free(foreign);
        tl_session_free(done_session);
        set_gate(true);
        const uint64_t both[2] = {blocker, queued};
        for (int i = 0; i < 2; i++) {
            tl_engine_update last;
            const int n_tokens = read_to_end(one, both[i], &last);
            CHECK(last.state == TL_ENGINE_FINISHED && last.status == TL_OK && n_tokens == 2,
                  "request %d beside the refused ones: %s, %d tokens", i, tl_status_name(last.status), n_tokens);
            tl_engine_cancel(one, both[i]);
        }
        tl_engine_free(one);
        tl_model_free(other);
    }

    /* A session whose step fails gets its own message (tl_session_error), not another
       session's or an empty one (the thread's last error, which a batch shares), and the
       sessions stepped with it go on. */
    {
        tl_engine *three;
        CHECK(tl_engine_new(model, NULL, &three) == TL_OK, "%s", tl_last_error());
        tl_generate_config gc;
        tl_generate_config_init(&gc);
        gc.max_tokens = 30;
        gc.ignore_eos = 1;
        tl_generate_config failing = gc;
        failing.logits_processor = fail_hook;
        const int32_t prompt[4] = {5, 6, 7, 8};
        uint64_t ids3[3] = {0, 0, 0};
        CHECK(tl_engine_submit(three, new_session(prompt, &gc), &ids3[0]) == TL_OK && ids3[0] > 0, "%s", tl_last_error());
        CHECK(tl_engine_submit(three, new_session(prompt, &failing), &ids3[1]) == TL_OK && ids3[1] > 0, "%s", tl_last_error());
        CHECK(tl_engine_submit(three, new_session(prompt, &gc), &ids3[2]) == TL_OK && ids3[2] > 0, "%s", tl_last_error());
        for (int i = 0; i < 3; i++) {
            tl_engine_update last;
            const int n_tokens = read_to_end(three, ids3[i], &last);
            CHECK(last.state == TL_ENGINE_FINISHED, "request %d finished", i);
            if (i == 1)
                CHECK(last.status == TL_ERR_HOOK && last.error && strstr(last.error, "logits_processor"),
                      "the failing request: %s, \"%s\"", tl_status_name(last.status), last.error ? last.error : "(null)");
            else
                CHECK(last.status == TL_OK && n_tokens == 30, "request %d beside the failing one: %s, %d tokens", i,
                      tl_status_name(last.status), n_tokens);
            tl_engine_cancel(three, ids3[i]);
        }
        /* The same message stepping alone, where tl_last_error() has it too. */
        tl_session *alone = new_session(prompt, &failing);
        int32_t token;
        tl_stop_reason stop;
        tl_status st = TL_OK;
        CHECK(tl_session_error(alone)[0] == '\0' && tl_session_error(NULL)[0] == '\0', "no failed step yet");
        for (int i = 0; i < 10 && st == TL_OK; i++) st = tl_session_step(alone, &token, &stop);
        CHECK(st == TL_ERR_HOOK && strstr(tl_session_error(alone), "logits_processor") &&
                  !strcmp(tl_session_error(alone), tl_last_error()),
              "stepped alone: %s \"%s\" / \"%s\"", tl_status_name(st), tl_session_error(alone), tl_last_error());
        tl_session_free(alone);
        /* A long message whole (the engine cut its copy at 255 bytes, mid-word): a grammar too
           ambiguous where the forced text leads it (test_grammar's), 265 bytes. */
        const char *schema = "{\"$defs\":{\"n\":{\"anyOf\":[{\"type\":\"null\"},"
                             "{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/$defs/n\"}},\"required\":[\"a\"]},"
                             "{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/$defs/n\"},\"b\":{\"type\":\"integer\"}},"
                             "\"required\":[\"a\",\"b\"]}]}},\"$ref\":\"#/$defs/n\"}";
        tl_compiled_grammar *ambiguous = NULL;
        CHECK(tl_grammar_compile_json_schema(schema, strlen(schema), NULL, &ambiguous) == TL_OK, "%s", tl_last_error());
        char doc[128] = "";
        for (int depth = 0; depth < 20; depth++) strcat(doc, "{\"a\":");
        int32_t *doc_ids = NULL;
        int n_doc = 0;
        CHECK(tl_encode(model, doc, strlen(doc), &doc_ids, &n_doc) == TL_OK && n_doc <= 256, "%s", tl_last_error());
        memcpy(forced.ids, doc_ids, (size_t)n_doc * sizeof *doc_ids);
        forced.n = n_doc;
        tl_free(doc_ids);
        tl_grammar grammar;
        tl_grammar_use(&grammar, ambiguous);
        tl_generate_config led = gc;
        led.max_tokens = 100;
        led.logits_processor = force_hook;
        led.grammar = &grammar;
        alone = new_session(prompt, &led);
        for (st = TL_OK, stop = TL_STOP_NONE; st == TL_OK && stop == TL_STOP_NONE;) st = tl_session_step(alone, &token, &stop);
        char whole[1024];
        snprintf(whole, sizeof whole, "%s", tl_session_error(alone));
        CHECK(st == TL_ERR_UNSUPPORTED && strlen(whole) > 255 && strstr(whole, "too ambiguous"), "stepped alone: %s \"%s\"",
              tl_status_name(st), whole);
        tl_session_free(alone);
        uint64_t led_id = 0;
        CHECK(tl_engine_submit(three, new_session(prompt, &led), &led_id) == TL_OK && led_id > 0, "%s", tl_last_error());
        tl_engine_update led_end;
        read_to_end(three, led_id, &led_end);
        CHECK(led_end.state == TL_ENGINE_FINISHED && led_end.status == TL_ERR_UNSUPPORTED && led_end.error &&
                  !strcmp(led_end.error, whole),
              "the engine's message, whole: %s \"%s\"", tl_status_name(led_end.status), led_end.error ? led_end.error : "(null)");
        tl_engine_cancel(three, led_id);
        tl_compiled_grammar_free(ambiguous);
        tl_engine_counters c3;
        tl_engine_get_counters(three, &c3);
        CHECK(c3.submitted == 4 && c3.failed == 2 && c3.finished == 4, "counters: %llu submitted, %llu failed, %llu finished",
              (unsigned long long)c3.submitted, (unsigned long long)c3.failed, (unsigned long long)c3.finished);
        tl_engine_free(three);
    }

    /* Stopping (tl_engine_stop) with a request running and a waiter asleep on it: the waiter
       returns -1, and afterwards every call is answered without the thread: a late wait -1,
       reads and submits refused, cancels ignored, the counters readable; stopping again and
       then freeing are clean. */
    {
        tl_engine *stopped = NULL;
        CHECK(tl_engine_new(model, NULL, &stopped) == TL_OK, "%s", tl_last_error());
        tl_generate_config held = lc;
        held.max_tokens = 60;
        uint64_t running = 0;
        set_gate(false); /* the engine holds inside the request's first step */
        CHECK(tl_engine_submit(stopped, new_session(jobs[0].prompt, &held), &running) == TL_OK && running > 0, "%s",
              tl_last_error());
        wait_job w = {stopped, running, -2};
        pthread_t t;
        pthread_create(&t, NULL, wait_once, &w);
        struct timespec ts = {0, 20000000};
        nanosleep(&ts, NULL);
        set_gate(true); /* (the step in flight must end for the thread to be joined) */
        tl_engine_stop(stopped);
        pthread_join(t, NULL);
        CHECK(w.result == -1 || w.result == 1, "the waiter returned: %d", w.result);
        CHECK(tl_engine_wait(stopped, running, 100) == -1, "a wait after the stop: gone");
        tl_engine_update su;
        CHECK_ERROR(tl_engine_read(stopped, running, &su), TL_ERR_INVALID_ARGUMENT, "the engine has stopped");
        uint64_t late = 9;
        tl_session *late_session = new_session(jobs[0].prompt, &held);
        CHECK_ERROR(tl_engine_submit(stopped, late_session, &late), TL_ERR_INVALID_ARGUMENT, "the engine is stopping");
        CHECK(late == 0, "no id after the stop");
        tl_session_free(late_session);
        tl_engine_cancel(stopped, running);
        tl_engine_counters sc;
        tl_engine_get_counters(stopped, &sc);
        CHECK(sc.submitted == 1, "counters after the stop: %llu submitted", (unsigned long long)sc.submitted);
        tl_engine_stop(stopped);
        tl_engine_free(stopped);
        tl_engine_stop(NULL);
    }

    /* Stopping with a beam search running: it leaves between search steps, as at a cancel
       (review: the stop waited for the whole search, a second and more of a wide beam). */
    {
        tl_engine *stopped = NULL;
        CHECK(tl_engine_new(model, NULL, &stopped) == TL_OK, "%s", tl_last_error());
        tl_generate_config bc;
        tl_generate_config_init(&bc);
        bc.max_tokens = 60;
        bc.beam_size = 4;
        bc.ignore_eos = 1;
        bc.logits_processor = stopped_beam_hook;
        stopping_engine = stopped;
        CHECK(tl_engine_submit(stopped, new_session(jobs[0].prompt, &bc), &stopping_request) == TL_OK, "%s", tl_last_error());
        for (int spins = 0; spins < 4000 && atomic_load(&stopped_beam_calls) < 5; spins++) {
            struct timespec nap = {0, 1000000};
            nanosleep(&nap, NULL);
        }
        const int at_stop = atomic_load(&stopped_beam_calls);
        tl_engine_stop(stopped); /* (the held hook goes on once it has begun) */
        const int after = atomic_load(&stopped_beam_calls) - at_stop;
        CHECK(at_stop == 5 && after <= 4, "a stopped beam search leaves within one search step: %d calls after the stop (of %d)",
              after, at_stop + after);
        /* ...and its step, failed by the stop, is no failure nor a finish (it counted both) */
        tl_engine_counters stop_counts;
        tl_engine_get_counters(stopped, &stop_counts);
        CHECK(stop_counts.failed == 0 && stop_counts.finished == 0 && stop_counts.active == 1,
              "a stopped beam search: failed %llu, finished %llu, active %d", (unsigned long long)stop_counts.failed,
              (unsigned long long)stop_counts.finished, stop_counts.active);
        tl_engine_free(stopped);
    }

    /* A session the engine holds is the engine's to free (review: a hook's tl_session_free of
       it was a use-after-free and a double free): the request ends with that said. */
    {
        tl_generate_config fc;
        tl_generate_config_init(&fc);
        fc.max_tokens = 12;
        fc.ignore_eos = 1;
        static tl_session *self_ref;
        fc.on_token = free_self_hook;
        fc.on_token_user = &self_ref;
        self_ref = new_session(jobs[0].prompt, &fc);
        uint64_t freed_id = 0;
        CHECK(tl_engine_submit(engine, self_ref, &freed_id) == TL_OK && freed_id > 0, "%s", tl_last_error());
        tl_engine_update fu;
        const int n_freed = read_to_end(engine, freed_id, &fu);
        CHECK(fu.state == TL_ENGINE_FINISHED && fu.status == TL_ERR_INVALID_ARGUMENT &&
                  strstr(fu.error, "freed (tl_session_free) while the engine held it"),
              "a session freed by its hook ends its request: state %d status %d '%s'", (int)fu.state, (int)fu.status,
              fu.error);
        CHECK(n_freed <= 2, "no token after the free's step: %d", n_freed);
        tl_engine_cancel(engine, freed_id);
        /* one session, two engines: the second is refused (both would step and free it) */
        tl_engine *other = NULL;
        tl_engine_options oo;
        tl_engine_options_init(&oo);
        CHECK(tl_engine_new(model, &oo, &other) == TL_OK, "%s", tl_last_error());
        set_gate(false);
        tl_generate_config gated = lc; /* (held in its first step until the gate opens) */
        gated.max_tokens = 4;
        tl_session *shared = new_session(jobs[0].prompt, &gated);
        uint64_t first_id = 0, second_id = 0;
        CHECK(tl_engine_submit(engine, shared, &first_id) == TL_OK && first_id > 0, "%s", tl_last_error());
        CHECK_ERROR(tl_engine_submit(other, shared, &second_id), TL_ERR_INVALID_ARGUMENT, "already submitted to an engine");
        CHECK(second_id == 0, "no id for a refused session");
        set_gate(true);
        tl_engine_update su;
        read_to_end(engine, first_id, &su);
        tl_engine_cancel(engine, first_id);
        tl_engine_free(other);
        /* a beam request's step searches until a token settles: a cancel ends it between
           search steps (review: it ran the whole search first) */
        tl_generate_config bc;
        tl_generate_config_init(&bc);
        bc.max_tokens = 40;
        bc.beam_size = 4;
        bc.ignore_eos = 1;
        bc.logits_processor = beam_hook;
        tl_session *beam = new_session(jobs[0].prompt, &bc);
        CHECK(tl_engine_submit(engine, beam, &beam_request) == TL_OK && beam_request > 0, "%s", tl_last_error());
        for (int spins = 0; spins < 2000 && atomic_load(&beam_calls) < 5; spins++) tl_engine_wait(engine, beam_request, 5);
        tl_engine_counters bcnt;
        for (int spins = 0; spins < 2000; spins++) { /* until the engine dropped it */
            counters(&bcnt);
            if (bcnt.active == 0) break;
            struct timespec nap = {0, 1000000};
            nanosleep(&nap, NULL);
        }
        CHECK(beam_calls >= 5 && beam_calls_after_cancel <= 4,
              "a cancelled beam search stops within one search step: %d calls after the cancel (of %d)",
              beam_calls_after_cancel, beam_calls);
    }

    /* One place and step_rows 2: a prompt goes forward one row an iteration (the step's rows
       less the running requests' one each), a 40-token prompt over 40 iterations, 39 of them
       partial, then the second token (a cap one lower, 0 rows, prefilled the prompt whole). */
    {
        tl_engine_options narrow;
        tl_engine_options_init(&narrow);
        narrow.max_active = 1, narrow.step_rows = 2;
        tl_engine *one_row = NULL;
        CHECK(tl_engine_new(model, &narrow, &one_row) == TL_OK, "%s", tl_last_error());
        int32_t long_prompt[40];
        for (int k = 0; k < 40; k++) long_prompt[k] = (int32_t)((k * 37 + 5) % 300);
        tl_generate_config two;
        tl_generate_config_init(&two);
        two.max_tokens = 2;
        two.ignore_eos = 1;
        tl_session *session = new_session_n(long_prompt, 40, &two);
        uint64_t id = 0;
        CHECK(session && tl_engine_submit(one_row, session, &id) == TL_OK, "%s", tl_last_error());
        tl_engine_update last;
        CHECK(read_to_end(one_row, id, &last) == 2 && last.state == TL_ENGINE_FINISHED, "2 tokens");
        tl_engine_counters cc;
        tl_engine_get_counters(one_row, &cc);
        CHECK(cc.partial_prefills == 39 && cc.iterations == 41 && cc.rows == 2,
              "a 40-token prompt at one row an iteration: %llu partial prefills, %llu iterations, %llu rows (want 39, 41, 2)",
              (unsigned long long)cc.partial_prefills, (unsigned long long)cc.iterations, (unsigned long long)cc.rows);
        tl_engine_free(one_row);
    }
    /* Chunked prefill: with step_rows = 9 and three requests, long prompts are forwarded at
       most 8 rows an iteration (6 once all three run) while a short request goes on
       emitting; every request's tokens are tl_generate's. */
    {
        tl_engine_options o1;
        tl_engine_options_init(&o1);
        o1.max_active = 3, o1.step_rows = 9;
        tl_engine *chunked = NULL;
        CHECK(tl_engine_new(model, &o1, &chunked) == TL_OK, "%s", tl_last_error());
        enum { LONG = 3 };
        const int lens[LONG] = {60, 4, 45};
        static int32_t prompts[LONG][64];
        tl_generate_config gc[LONG];
        uint64_t req[LONG];
        for (int i = 0; i < LONG; i++) {
            for (int k = 0; k < lens[i]; k++) prompts[i][k] = (int32_t)((i * 131 + k * 17) % 300);
            tl_generate_config_init(&gc[i]);
            gc[i].max_tokens = 30;
            gc[i].ignore_eos = 1;
            if (i == 2) { gc[i].temperature = 0.9f; gc[i].sample_seed = 5; }
            tl_session *session = NULL;
            CHECK(tl_session_new(model, prompts[i], lens[i], &gc[i], &session) == TL_OK, "%s", tl_last_error());
            CHECK(tl_engine_submit(chunked, session, &req[i]) == TL_OK && req[i] > 0, "%s", tl_last_error());
        }
        for (int i = 0; i < LONG; i++) {
            int32_t got[CAP], want[CAP];
            int n_got = 0, n_want = 0;
            tl_engine_update last;
            memset(&last, 0, sizeof last);
            while (tl_engine_wait(chunked, req[i], 1000) >= 0 && tl_engine_read(chunked, req[i], &last) == TL_OK) {
                for (int k = 0; k < last.n_tokens && n_got < CAP; k++) got[n_got++] = last.tokens[k];
                if (last.state == TL_ENGINE_FINISHED) break;
            }
            tl_engine_cancel(chunked, req[i]);
            tl_generate_stats ws;
            CHECK(tl_generate(model, prompts[i], lens[i], &gc[i], want, CAP, &n_want, &ws) == TL_OK, "%s", tl_last_error());
            CHECK(last.state == TL_ENGINE_FINISHED && last.status == TL_OK && n_got == n_want - lens[i] &&
                      !memcmp(got, want + lens[i], (size_t)n_got * sizeof *got),
                  "prompt of %d tokens, prefilled in chunks: %d tokens, alone %d", lens[i], n_got,
                  n_want - lens[i]);
        }
        tl_engine_counters cc;
        tl_engine_get_counters(chunked, &cc);
        /* the 60-token prompt alone needs 8 iterations or more, 7 of them without a token */
        CHECK(cc.partial_prefills >= 7, "partial prefills %llu", (unsigned long long)cc.partial_prefills);
        /* rows: the session-steps that emitted, 30 tokens each (a chunk is not one) */
        CHECK(cc.rows == 3 * 30, "rows %llu", (unsigned long long)cc.rows);
        tl_engine_free(chunked);
    }
    {
        /* A prompt that waits while an earlier one takes every row forwards nothing: no chunk
           (it counted as one). step_rows 10 at 2 places: 8 prompt rows an iteration (9 for one
           alone); two 40-token prompts of one token each are 5 chunks apiece, 4 of them
           emitting nothing, or 5 where the second's first chunk is what the first's last left
           (when the engine admits the second decides): 8 to 10. The second waits for the first
           in 4 iterations or more, which counted too (12 or more). */
        tl_engine_options narrow_opts;
        tl_engine_options_init(&narrow_opts);
        narrow_opts.max_active = 2;
        narrow_opts.step_rows = 10;
        tl_engine *narrow = NULL;
        CHECK(tl_engine_new(model, &narrow_opts, &narrow) == TL_OK, "%s", tl_last_error());
        int32_t prompt40[40];
        for (int t = 0; t < 40; t++) prompt40[t] = 5 + t % 50;
        tl_generate_config one;
        tl_generate_config_init(&one);
        one.max_tokens = 1;
        one.ignore_eos = 1;
        uint64_t two[2];
        for (int i = 0; i < 2; i++) {
            tl_session *session = NULL;
            CHECK(tl_session_new(model, prompt40, 40, &one, &session) == TL_OK, "%s", tl_last_error());
            CHECK(tl_engine_submit(narrow, session, &two[i]) == TL_OK && two[i] > 0, "%s", tl_last_error());
        }
        for (int i = 0; i < 2; i++) {
            tl_engine_update nu;
            memset(&nu, 0, sizeof nu);
            while (tl_engine_wait(narrow, two[i], 1000) >= 0 && tl_engine_read(narrow, two[i], &nu) == TL_OK &&
                   nu.state != TL_ENGINE_FINISHED) {}
            CHECK(nu.state == TL_ENGINE_FINISHED, "request %d finished", i);
        }
        tl_engine_counters nc;
        tl_engine_get_counters(narrow, &nc);
        CHECK(nc.partial_prefills >= 8 && nc.partial_prefills <= 10 && nc.rows == 2,
              "partial prefills %llu (want 8 to 10), rows %llu (want 2), iterations %llu",
              (unsigned long long)nc.partial_prefills, (unsigned long long)nc.rows, (unsigned long long)nc.iterations);
        tl_engine_free(narrow);
    }

    /* A prompt chunk in flight when its request is cancelled is a chunk still, not a row (rows
       counted the cancelled request's last chunk). A held request steps alone, then beside a
       long prompt prefilled 2 rows an iteration, and the long one is cancelled while that
       second step is held. rows is then the held request's tokens, one per step. */
    {
        tl_engine_options o2;
        tl_engine_options_init(&o2);
        o2.max_active = 2, o2.step_rows = 4;
        tl_engine *chunked = NULL;
        CHECK(tl_engine_new(model, &o2, &chunked) == TL_OK, "%s", tl_last_error());
        static int32_t long_prompt[100];
        for (int k = 0; k < 100; k++) long_prompt[k] = (int32_t)((k * 29 + 3) % 300);
        tl_generate_config plain, held;
        tl_generate_config_init(&plain);
        plain.max_tokens = 4;
        held = plain;
        held.max_tokens = 8;
        held.ignore_eos = 1;
        held.logits_processor = hold_hook;
        uint64_t long_id = 0, held_id = 0;
        const int32_t one[1] = {7};
        CHECK(tl_engine_submit(chunked, new_session_n(one, 1, &held), &held_id) == TL_OK, "%s", tl_last_error());
        hold_wait_calls(1); /* its first step, alone */
        CHECK(tl_engine_submit(chunked, new_session_n(long_prompt, 100, &plain), &long_id) == TL_OK, "%s", tl_last_error());
        hold_release(1);
        hold_wait_calls(2); /* its second step, the long prompt's first chunk beside it */
        tl_engine_cancel(chunked, long_id);
        hold_release(HOLD_CALLS);
        tl_engine_update last;
        memset(&last, 0, sizeof last);
        int emitted = 0;
        while (tl_engine_wait(chunked, held_id, 1000) >= 0 && tl_engine_read(chunked, held_id, &last) == TL_OK) {
            emitted += last.n_tokens;
            if (last.state == TL_ENGINE_FINISHED) break;
        }
        tl_engine_counters cc;
        tl_engine_get_counters(chunked, &cc);
        CHECK(emitted == 8 && cc.rows == 8 && cc.partial_prefills == 1 && cc.steps_after_cancel == 1 && cc.cancelled == 1,
              "emitted %d, rows %llu, partial prefills %llu, steps after cancel %llu, cancelled %llu", emitted,
              (unsigned long long)cc.rows, (unsigned long long)cc.partial_prefills,
              (unsigned long long)cc.steps_after_cancel, (unsigned long long)cc.cancelled);
        tl_engine_free(chunked);
    }

    /* A hook that stops or frees its own engine (on the engine thread): the stop is asked and
       the step ends; the requests it was stepping outlive it (they were freed under it, and
       read after), and the owner's free joins the thread and frees them. */
    for (int freeing = 0; freeing < 2; freeing++) {
        static bool hook_frees;
        hook_frees = freeing;
        CHECK(tl_engine_new(model, NULL, &hooked_engine) == TL_OK, "%s", tl_last_error());
        tl_generate_config sc;
        tl_generate_config_init(&sc);
        sc.max_tokens = 12;
        sc.ignore_eos = 1;
        sc.on_token = stop_engine_hook;
        sc.on_token_user = &hook_frees;
        tl_generate_config pc = sc; /* (a plain request beside it, held by the engine too) */
        pc.on_token = NULL;
        uint64_t stopping_id = 0, beside_id = 0;
        CHECK(tl_engine_submit(hooked_engine, new_session(jobs[0].prompt, &pc), &beside_id) == TL_OK && beside_id > 0, "%s",
              tl_last_error());
        CHECK(tl_engine_submit(hooked_engine, new_session(jobs[1].prompt, &sc), &stopping_id) == TL_OK && stopping_id > 0,
              "%s", tl_last_error());
        int waits = 0;
        while (tl_engine_wait(hooked_engine, stopping_id, 1000) >= 0 && waits++ < 100) {
            tl_engine_update hu;
            if (tl_engine_read(hooked_engine, stopping_id, &hu) != TL_OK || hu.state == TL_ENGINE_FINISHED) break;
        }
        CHECK(tl_engine_wait(hooked_engine, stopping_id, 0) == -1, "the hook's %s stopped the engine",
              freeing ? "free" : "stop");
        /* read and cancel agree with wait: gone (read found them running for good, and a
           cancel moved the counters of a stopped engine) */
        tl_engine_update gone_update;
        CHECK_ERROR(tl_engine_read(hooked_engine, beside_id, &gone_update), TL_ERR_INVALID_ARGUMENT, "the engine has stopped");
        CHECK_ERROR(tl_engine_read(hooked_engine, stopping_id, &gone_update), TL_ERR_INVALID_ARGUMENT, "the engine has stopped");
        tl_engine_counters before_cancel, after_cancel;
        tl_engine_get_counters(hooked_engine, &before_cancel);
        tl_engine_cancel(hooked_engine, beside_id);
        tl_engine_cancel(hooked_engine, stopping_id);
        tl_engine_get_counters(hooked_engine, &after_cancel);
        CHECK(after_cancel.cancelled == before_cancel.cancelled && after_cancel.queued == before_cancel.queued &&
                  after_cancel.active == before_cancel.active,
              "a cancel after the stop is a no-op: cancelled %llu -> %llu", (unsigned long long)before_cancel.cancelled,
              (unsigned long long)after_cancel.cancelled);
        uint64_t late = 0;
        tl_session *refused = new_session(jobs[0].prompt, &pc);
        CHECK_ERROR(tl_engine_submit(hooked_engine, refused, &late), TL_ERR_INVALID_ARGUMENT, "the engine is stopping");
        tl_session_free(refused);
        tl_engine_free(hooked_engine);
    }

    /* A session stepped by hand, then submitted, goes on from where it was: its tokens by hand
       and the engine's are tl_generate's (max_tokens counting both), the updates carry only
       the engine's tokens, and their text is the whole continuation's where the caller took
       none of it by hand. */
    {
        tl_generate_config twelve;
        tl_generate_config_init(&twelve);
        twelve.max_tokens = 12;
        twelve.ignore_eos = 1;
        const int32_t stepped_prompt[4] = {11, 12, 13, 14};
        int32_t want[16], got[32]; /* (tl_generate writes the prompt first; room for a count gone wrong) */
        char want_text[256] = "", got_text[256] = "";
        int want_len = 0, got_len = 0;
        tl_generate_stats ws;
        CHECK(tl_generate(model, stepped_prompt, 4, &twelve, want, 16, &want_len, &ws) == TL_OK && want_len == 16, "%s",
              tl_last_error());
        tl_session *stepped = new_session(stepped_prompt, &twelve);
        tl_stop_reason stop = TL_STOP_NONE;
        for (; got_len < 3; got_len++)
            CHECK(tl_session_step(stepped, &got[got_len], &stop) == TL_OK && stop == TL_STOP_NONE, "by hand: %s", tl_last_error());
        uint64_t stepped_id = 0;
        CHECK(tl_engine_submit(engine, stepped, &stepped_id) == TL_OK && stepped_id > 0, "a stepped session: %s", tl_last_error());
        tl_engine_update update;
        memset(&update, 0, sizeof update);
        int emitted = 0;
        while (tl_engine_wait(engine, stepped_id, 1000) >= 0 && tl_engine_read(engine, stepped_id, &update) == TL_OK) {
            for (int i = 0; i < update.n_tokens && got_len < 32; i++) got[got_len++] = update.tokens[i];
            if (update.text_len && strlen(got_text) + update.text_len < sizeof got_text)
                strncat(got_text, update.text, update.text_len);
            if (update.state == TL_ENGINE_FINISHED) {
                emitted = update.stats.tokens_emitted;
                break;
            }
        }
        CHECK(update.state == TL_ENGINE_FINISHED && update.status == TL_OK && got_len == 12 && emitted == 12 &&
                  !memcmp(got, want + 4, 12 * sizeof *got),
              "by hand then by the engine: %d tokens (%d emitted), %s", got_len, emitted, tl_status_name(update.status));
        char *piece_text = NULL;
        size_t piece_len = 0;
        CHECK(tl_decode(model, want + 4, 12, &piece_text, &piece_len) == TL_OK && piece_len < sizeof want_text, "%s",
              tl_last_error());
        if (piece_text) memcpy(want_text, piece_text, piece_len);
        tl_free(piece_text);
        CHECK(!strcmp(got_text, want_text), "the updates' text \"%s\", the continuation's \"%s\"", got_text, want_text);
        tl_engine_cancel(engine, stepped_id); /* (let go of its end) */
    }

    kv_budget(dir);
    shared_prefill(dir);

    {   /* NULL's counters are zeros (the caller's struct was left as it was) */
        tl_engine_counters none;
        memset(&none, 0x5a, sizeof none);
        tl_engine_get_counters(NULL, &none);
        CHECK(none.submitted == 0 && none.active == 0 && none.finished_held == 0 && none.waiter_wakeups == 0,
              "a NULL engine's counters: submitted %llu", (unsigned long long)none.submitted);
        tl_engine_get_counters(engine, NULL); /* (a NULL struct: nothing written) */
    }

    /* Freeing with requests still running (and one never read) is clean. */
    tl_engine_submit(engine, new_session(jobs[0].prompt, &lc), &ids[0]);
    tl_engine_free(engine);
    tl_engine_free(NULL);
    tl_model_free(model);
    return check_summary();
}

/* test_process_fork.c: a host that loads a model and then fork()s (a server's master before
 * its workers, a script's shell-out, a test runner). fork() copies only the calling thread:
 * the child holds the model's thread pool and an engine without their threads, and a
 * condition variable that still counts the parent's sleeping workers, whose
 * pthread_cond_destroy in tl_model_free / tl_engine_free waited for them forever (the
 * child hung in its exit; a LuaJIT child in its finalizers). Forked while the engine waits
 * for work, the child generates with the model it inherited (on its own thread: the same
 * tokens), frees it, and frees the engine, which refuses work naming the fork; forked while
 * the engine steps, it frees the engine, leaving the session mid-step alone; the parent's go
 * on.
 *
 * usage: test_process_fork [DATA_DIR] (not built under ThreadSanitizer, which does not take
 * a child of a threaded process) */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "tinyloop.h"

#define TOKENS 16
#define OUT (3 + TOKENS) /* tl_generate writes the prompt, then the tokens */

static tl_model *model;

static int generate(int32_t *out) {
    const int32_t prompt[3] = {1, 2, 3};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = TOKENS;
    cfg.ignore_eos = 1;
    int n = 0;
    const tl_status st = tl_generate(model, prompt, 3, &cfg, out, OUT, &n, NULL);
    CHECK(st == TL_OK && n == OUT, "generate: %s %d tokens (%s)", tl_status_name(st), n, tl_last_error());
    return n;
}

/* A logits hook that holds the engine thread inside a step until the test opens the gate. */
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static bool gate_open, in_step;
static int gate_hook(void *user, float *logits, int vocab_size, const int32_t *tokens, int n) {
    (void)user, (void)logits, (void)vocab_size, (void)tokens, (void)n;
    pthread_mutex_lock(&gate_mu);
    in_step = true;
    pthread_cond_broadcast(&gate_cv);
    while (!gate_open) pthread_cond_wait(&gate_cv, &gate_mu);
    pthread_mutex_unlock(&gate_mu);
    return TL_HOOK_CONTINUE;
}

static tl_session *new_session_with(tl_logits_hook hook) {
    const int32_t prompt[3] = {1, 2, 3};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 4;
    cfg.ignore_eos = 1;
    cfg.logits_processor = hook;
    tl_session *s = NULL;
    CHECK(tl_session_new(model, prompt, 3, &cfg, &s) == TL_OK, "%s", tl_last_error());
    return s;
}
static tl_session *new_session(void) { return new_session_with(NULL); }

/* fork(); the child runs `part` and exits with its checks' summary; the parent checks it
   exited 0 (SIGALRM: it hung). */
static void in_child(const char *what, void (*part)(void *), void *arg) {
    fflush(stdout);
    const pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        alarm(60);
        part(arg);
        const int failed = check_summary();
        fflush(stdout); /* (_exit flushes nothing) */
        _exit(failed);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s: the child %s %d (SIGALRM %d: hung)", what,
          WIFEXITED(status) ? "exited with" : "was killed by signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
          SIGALRM);
}

/* A child forked while the engine stepped a request: it frees the engine without touching
   that request's session (mid-step in the parent's copy: freeing such ones crashed a child
   now and then) and reads the counters. */
static void child_of_busy(void *engine_) {
    tl_engine *engine = engine_;
    tl_engine_counters counters;
    tl_engine_get_counters(engine, &counters);
    CHECK(counters.active == 1, "the counters as forked: %d active", counters.active);
    tl_engine_free(engine);
    CHECK(true, "tl_engine_free returned");
}

/* A child forked while the engine waited for work: it generates and frees everything. */
static const int32_t *parents_tokens;
static void child_of_idle(void *engine_) {
    tl_engine *engine = engine_;
    const int32_t *parents = parents_tokens;
    int32_t tokens[OUT];
    CHECK(generate(tokens) == OUT && memcmp(tokens, parents, sizeof tokens) == 0,
          "the child's tokens are the parent's");
    uint64_t id = 0;
    tl_session *session = new_session();
    CHECK_ERROR(tl_engine_submit(engine, session, &id), TL_ERR_INVALID_ARGUMENT, "forked");
    CHECK(id == 0, "no id");
    tl_session_free(session); /* (a refused submit leaves the session the caller's) */
    tl_engine_update update;
    CHECK_ERROR(tl_engine_read(engine, 1, &update), TL_ERR_INVALID_ARGUMENT, "forked");
    CHECK(tl_engine_wait(engine, 1, 1000) == -1, "a wait on the inherited engine: -1 at once");
    tl_engine_counters counters;
    tl_engine_get_counters(engine, &counters);
    CHECK(counters.submitted == 1 && counters.finished == 1, "the counters as forked: %llu submitted",
          (unsigned long long)counters.submitted);
    tl_engine_free(engine);
    tl_model_free(model);
}

int main(int argc, char **argv) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/textmodel", argc > 1 ? argv[1] : "tests/data");
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 2;
    if (tl_model_load(dir, &o, &model) != TL_OK) { printf("load: %s\n", tl_last_error()); return 1; }
    int32_t parents[OUT];
    generate(parents);
    /* an engine that served a request and sleeps, waiting for work */
    tl_engine *engine = NULL;
    CHECK(tl_engine_new(model, NULL, &engine) == TL_OK, "%s", tl_last_error());
    uint64_t id = 0;
    CHECK(tl_engine_submit(engine, new_session(), &id) == TL_OK && id > 0, "%s", tl_last_error());
    tl_engine_update update = {0};
    while (tl_engine_wait(engine, id, 1000) >= 0 && tl_engine_read(engine, id, &update) == TL_OK &&
           update.state != TL_ENGINE_FINISHED) {
    }
    CHECK(update.state == TL_ENGINE_FINISHED && update.status == TL_OK, "the parent's request");
    /* the pool's workers asleep too: they spin a while after a job, then wait */
    nanosleep(&(struct timespec){.tv_nsec = 100 * 1000 * 1000}, NULL);
    parents_tokens = parents;
    in_child("forked while idle", child_of_idle, engine);
    /* a second engine, held inside a step by the gate at the fork */
    tl_engine *busy = NULL;
    CHECK(tl_engine_new(model, NULL, &busy) == TL_OK, "%s", tl_last_error());
    uint64_t gated = 0;
    CHECK(tl_engine_submit(busy, new_session_with(gate_hook), &gated) == TL_OK && gated > 0, "%s", tl_last_error());
    pthread_mutex_lock(&gate_mu);
    while (!in_step) pthread_cond_wait(&gate_cv, &gate_mu);
    pthread_mutex_unlock(&gate_mu);
    in_child("forked mid-step", child_of_busy, busy);
    pthread_mutex_lock(&gate_mu);
    gate_open = true;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
    while (tl_engine_wait(busy, gated, 1000) >= 0 && tl_engine_read(busy, gated, &update) == TL_OK &&
           update.state != TL_ENGINE_FINISHED) {
    }
    CHECK(update.state == TL_ENGINE_FINISHED && update.status == TL_OK && update.stats.tokens_emitted == 4,
          "the parent's gated request ends after the fork");
    tl_engine_free(busy);
    /* the parent's model and engine serve on */
    int32_t again[OUT];
    CHECK(generate(again) == OUT && memcmp(again, parents, sizeof again) == 0, "the parent generates after the fork");
    tl_engine_cancel(engine, id);
    uint64_t second = 0;
    CHECK(tl_engine_submit(engine, new_session(), &second) == TL_OK && second > 0, "%s", tl_last_error());
    while (tl_engine_wait(engine, second, 1000) >= 0 && tl_engine_read(engine, second, &update) == TL_OK &&
           update.state != TL_ENGINE_FINISHED) {
    }
    CHECK(update.state == TL_ENGINE_FINISHED && update.status == TL_OK, "the parent's engine after the fork");
    tl_engine_free(engine);
    tl_model_free(model);
    return check_summary();
}

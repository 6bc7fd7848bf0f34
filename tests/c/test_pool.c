/* test_pool.c: the CPU backend's worker pool. Every task of a job runs exactly once, on a
 * thread index below the pool's count; in a phased job (tl_pool_run_phased) no task of the
 * second phase starts before every task of the first is done, whatever the thread that
 * claims it. Also run under TSan (scripts/test), which checks the phases' hand-over of
 * plain memory. */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "check.h"
#include "cpu/pool.h"

enum { MAX_TASKS = 64 };

typedef struct {
    int n_tasks, n_first, threads;
    int written[MAX_TASKS];   /* plain memory: a first-phase task writes its slot */
    atomic_int runs[MAX_TASKS];
    atomic_int early;         /* second-phase tasks that saw a first-phase slot unwritten */
    atomic_int bad_thread;
    int round;
} job_state;

static void task_fn(void *ctx, int task, int thread) {
    job_state *s = ctx;
    if (thread < 0 || thread >= s->threads) atomic_fetch_add(&s->bad_thread, 1);
    atomic_fetch_add(&s->runs[task], 1);
    if (task < s->n_first) {
        /* a slow first-phase task now and then, so that second-phase claimers must wait */
        if ((task + s->round) % 7 == 0) nanosleep(&(struct timespec){0, 20000}, NULL);
        s->written[task] = s->round;
        return;
    }
    for (int t = 0; t < s->n_first; t++)
        if (s->written[t] != s->round) atomic_fetch_add(&s->early, 1);
}

int main(void) {
    for (int threads = 1; threads <= 4; threads++) {
        tl_pool *pool = tl_pool_new(threads);
        CHECK(pool != NULL && tl_pool_threads(pool) == threads, "pool of %d threads", threads);
        if (!pool) continue;
        job_state *s = calloc(1, sizeof *s);
        s->threads = threads;
        int wrong_runs = 0, early = 0, bad_thread = 0;
        for (int round = 1; round <= 400; round++) {
            /* odd rounds: two phases of any sizes (either may be empty); even: one phase */
            const int n_tasks = 1 + round % MAX_TASKS, n_first = round % 2 ? (round * 7) % (n_tasks + 1) : n_tasks;
            s->n_tasks = n_tasks;
            s->n_first = n_first;
            s->round = round;
            for (int t = 0; t < MAX_TASKS; t++) atomic_store(&s->runs[t], 0);
            if (round % 2) tl_pool_run_phased(pool, n_tasks, n_first, task_fn, s);
            else tl_pool_run(pool, n_tasks, task_fn, s);
            for (int t = 0; t < MAX_TASKS; t++) wrong_runs += atomic_load(&s->runs[t]) != (t < n_tasks);
        }
        early = atomic_load(&s->early);
        bad_thread = atomic_load(&s->bad_thread);
        CHECK(wrong_runs == 0, "%d threads: %d tasks not run exactly once", threads, wrong_runs);
        CHECK(early == 0, "%d threads: %d second-phase tasks started before the first phase ended", threads, early);
        CHECK(bad_thread == 0, "%d threads: %d tasks got a thread index out of range", threads, bad_thread);
        /* Empty jobs are no-ops. */
        tl_pool_run(pool, 0, task_fn, s);
        tl_pool_run_phased(pool, 0, 0, task_fn, s);
        free(s);
        tl_pool_free(pool);
    }
    return check_summary();
}

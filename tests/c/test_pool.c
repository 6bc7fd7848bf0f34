/* test_pool.c: the worker pool (engine/src/pool.h: the CPU backend's and the quantiser's).
 * Every task of a job runs exactly once, on a
 * thread index below the pool's count; in a phased job (tl_pool_run_phased) no task of the
 * second phase starts before every task of the first is done, whatever the thread that
 * claims it. The shares' learning (tl_pool_teach) moves them toward the faster threads,
 * within their bounds, and follows when the speeds change; balanced jobs
 * (tl_pool_run_balanced) on threads of unequal speed (simulated, on a per-thread clock the
 * pool times tasks by) teach it, and each thread takes its own task. Also run under TSan
 * (scripts/test), which checks the phases' hand-over of plain memory. */
#define _GNU_SOURCE /* nanosleep, sched_setaffinity */
#include <sched.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "check.h"
#include "pool.h"

enum { MAX_TASKS = 64 };

typedef struct {
    int n_tasks, n_first, threads;
    int written[MAX_TASKS];   /* plain memory: a first-phase task writes its slot */
    atomic_int runs[MAX_TASKS];
    atomic_int early;         /* second-phase tasks that saw a first-phase slot unwritten */
    atomic_int bad_thread;
    atomic_int ran_on[MAX_TASKS]; /* the thread that ran each task */
    int round;
} job_state;

static void task_fn(void *ctx, int task, int thread) {
    job_state *s = ctx;
    if (thread < 0 || thread >= s->threads) atomic_fetch_add(&s->bad_thread, 1);
    atomic_fetch_add(&s->runs[task], 1);
    atomic_store(&s->ran_on[task], thread);
    if (task < s->n_first) {
        /* a slow first-phase task now and then, so that second-phase claimers must wait */
        if ((task + s->round) % 7 == 0) nanosleep(&(struct timespec){0, 20000}, NULL);
        s->written[task] = s->round;
        return;
    }
    for (int t = 0; t < s->n_first; t++)
        if (s->written[t] != s->round) atomic_fetch_add(&s->early, 1);
}

/* ---------------------------------------------------------------- balanced shares */

typedef struct {
    int threads;
    float share[TL_POOL_SHARE_THREADS]; /* the job's cut (tl_pool_shares before it) */
    double slowdown[TL_POOL_SHARE_THREADS]; /* per thread: time per unit of work */
    atomic_int ran_on[2 * TL_POOL_SHARE_THREADS];
} balance_state;

/* The pool times balanced tasks by this clock (tl_pool_set_clock): each thread's own count
   of nanoseconds of simulated work, so what the shares learn is the test's slowdowns and
   not the machine's load (a wall-clock version learned the wrong way in the project's CI,
   time-sharing two cores with another test). */
static _Thread_local uint64_t simulated_ns;
static uint64_t simulated_clock(void) { return simulated_ns; }

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* Task t of a phase: share[t] of 40 us of work at the speed of the thread running it, on
   the simulated clock. It also busy-waits an eighth of that for real, so that both threads
   are at work together and claim their own tasks, and the faster one (thread 1 in the
   second half) does finish first and claim first in a second phase. */
static void balance_task(void *ctx, int task, int thread) {
    balance_state *s = ctx;
    atomic_store(&s->ran_on[task], thread);
    const double us = 40.0 * (double)s->share[task % s->threads] * s->slowdown[thread];
    simulated_ns += (uint64_t)(us * 1000.0);
    const double until = now_us() + us / 8.0;
    while (now_us() < until) {
    }
}

/* Runs up to `jobs` balanced jobs (of two phases where `phased`) on threads of the given
   slowdowns; returns the shares after the last, stopping early once thread 0's share
   reaches `stop` from below (`rising`) or from above. Only the jobs whose tasks each ran
   on their own thread teach, and on a loaded machine a thread may come late to many: the
   test waits for the shares to arrive rather than counting on a number of jobs. */
static int run_balanced(tl_pool *pool, int threads, const double *slowdown, int jobs, bool phased, float stop,
                        bool rising, float *share) {
    balance_state s = {.threads = threads};
    int not_own = 0; /* phases whose two tasks both ran, each on the other's thread */
    for (int t = 0; t < threads; t++) s.slowdown[t] = slowdown[t];
    for (int j = 0; j < jobs; j++) {
        tl_pool_shares(pool, s.share);
        if (rising ? s.share[0] >= stop : s.share[0] <= stop) break;
        tl_pool_run_balanced(pool, phased ? 2 * threads : threads, threads, balance_task, &s, s.share);
        for (int begin = 0; begin < (phased ? 2 * threads : threads); begin += threads)
            not_own += atomic_load(&s.ran_on[begin]) == 1 && atomic_load(&s.ran_on[begin + 1]) == 0;
    }
    tl_pool_shares(pool, share);
    return not_own;
}

/* A pool of `threads` threads, or NULL after a failed check naming `what`. */
static tl_pool *pool_of(int threads, const char *what) {
    tl_pool *pool = tl_pool_new(threads);
    if (pool && tl_pool_threads(pool) == threads) return pool;
    CHECK(false, "%s: a pool of %d threads", what, threads);
    tl_pool_free(pool);
    return NULL;
}

/* tl_pool_set_shares: normalised, each within [1/2, 3/2] of an equal share (the others
   taking up what a bounded one gives back), held while jobs would teach otherwise; NULL:
   equal again. */
static void check_set_shares(void) {
    const struct {
        int threads;
        float given[4], want[4];
    } cases[] = {
        {2, {1.0f, 3.0f}, {0.25f, 0.75f}},
        {2, {100.0f, 1.0f}, {0.75f, 0.25f}},
        {2, {0.0f, 0.0f}, {0.5f, 0.5f}},
        {2, {-1.0f, 2.0f}, {0.25f, 0.75f}},
        {2, {NAN, 1.0f}, {0.25f, 0.75f}},
        {4, {3.0f, 1.0f, 1.0f, 1.0f}, {0.375f, 0.625f / 3, 0.625f / 3, 0.625f / 3}},
        {4, {100.0f, 100.0f, 1.0f, 1.0f}, {0.375f, 0.375f, 0.125f, 0.125f}},
        {4, {1.0f, 1.0f, 1.0f, 0.0f}, {0.875f / 3, 0.875f / 3, 0.875f / 3, 0.125f}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int threads = cases[i].threads;
        tl_pool *pool = pool_of(threads, "set shares");
        if (!pool) continue;
        float share[TL_POOL_SHARE_THREADS], sum = 0.0f;
        tl_pool_set_clock(pool, simulated_clock);
        tl_pool_set_shares(pool, cases[i].given);
        /* jobs that would teach the opposite leave pinned shares alone */
        const double slowdown[2] = {1.0, 4.0};
        if (threads == 2) run_balanced(pool, threads, slowdown, 200, false, 2.0f, true, share);
        for (int j = 0; j < 200; j++) { /* and what such jobs would teach, given directly */
            const float work[4] = {0.25f, 0.25f, 0.25f, 0.25f};
            const uint64_t busy[4] = {1000, 4000, 1000, 4000};
            tl_pool_teach(pool, work, busy);
        }
        tl_pool_shares(pool, share);
        bool near = true;
        for (int t = 0; t < threads; t++) {
            near = near && fabsf(share[t] - cases[i].want[t]) < 1e-5f;
            sum += share[t];
        }
        CHECK(near && fabsf(sum - 1.0f) < 1e-5f, "set shares, case %zu (%d threads): got %g %g %g %g", i, threads,
              (double)share[0], (double)share[1], (double)(threads > 2 ? share[2] : 0), (double)(threads > 2 ? share[3] : 0));
        tl_pool_set_shares(pool, NULL);
        tl_pool_shares(pool, share);
        CHECK(fabsf(share[0] - 1.0f / (float)threads) < 1e-6f, "set shares, case %zu: NULL brings equal shares", i);
        tl_pool_free(pool);
    }
}

/* The learning on its own (tl_pool_teach: the step after each learning job), fed the
   times of threads of given slowdowns for the cut the shares make: at 2 threads, thread 0
   twice as fast takes more (past 1.25 x an equal share, the bound being 1.5 x), then the
   shares follow when thread 1 becomes the fast one; at 4 threads, a thread 3 x slower
   falls to its bound (1/2 x) and the others share the rest; the shares stay a partition. */
static void check_learning(void) {
    const struct {
        int threads;
        double slow[2][4]; /* two spells of per-thread slowdowns */
        int watch;         /* the thread whose share is watched */
        float want[2];     /* its share reached in each spell: at least (rising) or at most */
        bool rising[2];
    } cases[] = {
        {2, {{1.0, 2.0}, {2.0, 1.0}}, 0, {0.625f, 0.375f}, {true, false}},
        {4, {{1.0, 1.0, 1.0, 3.0}, {1.0, 1.0, 1.0, 1.0}}, 3, {0.13f, 0.24f}, {false, true}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int threads = cases[c].threads;
        tl_pool *pool = pool_of(threads, "learning");
        if (!pool) continue;
        for (int spell = 0; spell < 2; spell++) {
            float share[TL_POOL_SHARE_THREADS];
            int jobs = 0;
            for (; jobs < 100000; jobs++) {
                tl_pool_shares(pool, share);
                const float watched = share[cases[c].watch];
                if (cases[c].rising[spell] ? watched >= cases[c].want[spell] : watched <= cases[c].want[spell]) break;
                uint64_t busy[TL_POOL_SHARE_THREADS];
                for (int t = 0; t < threads; t++) busy[t] = (uint64_t)(1e6 * share[t] * cases[c].slow[spell][t]);
                tl_pool_teach(pool, share, busy);
            }
            tl_pool_shares(pool, share);
            float sum = 0.0f;
            bool bounded = true;
            for (int t = 0; t < threads; t++) {
                sum += share[t];
                bounded = bounded && share[t] >= 0.499f / (float)threads && share[t] <= 1.501f / (float)threads;
            }
            CHECK(jobs < 100000, "learning, %d threads, spell %d: thread %d's share reached %.3f (want %s %.3f)", threads,
                  spell, cases[c].watch, (double)share[cases[c].watch], cases[c].rising[spell] ? ">=" : "<=",
                  (double)cases[c].want[spell]);
            CHECK(bounded && fabsf(sum - 1.0f) < 1e-4f, "learning, %d threads, spell %d: shares %.3f %.3f %.3f %.3f",
                  threads, spell, (double)share[0], (double)share[1], (double)(threads > 2 ? share[2] : 0),
                  (double)(threads > 2 ? share[3] : 0));
        }
        tl_pool_free(pool);
    }
}

/* Balanced jobs on the pool's threads teach it: on the simulated clock, thread 0 twice as
   fast moves its share up, then down when thread 1 is the fast one. Only jobs whose tasks
   each ran on their own thread teach, and under load a worker comes late to most jobs
   (under ctest -j2, beside another test: about one in a thousand taught), so this asks for
   a window's step each way (0.5 -> about 0.517), within up to a million jobs. And each
   thread takes its own task of a phase, also where thread 1 finishes the first phase
   first. */
static void check_balanced(void) {
    /* Two threads (the CI machine has two cores: more would time-share them), jobs of one
       phase, then of two. */
    const int threads = 2;
    for (int phased = 0; phased <= 1; phased++) {
        tl_pool *pool = pool_of(threads, "balanced");
        if (!pool) continue;
        tl_pool_set_clock(pool, simulated_clock);
        const double fast0[2] = {1.0, 2.0}, fast1[2] = {2.0, 1.0};
        float share[TL_POOL_SHARE_THREADS];
        tl_pool_shares(pool, share);
        for (int t = 0; t < threads; t++)
            CHECK(share[t] > 0.99f / (float)threads && share[t] < 1.01f / (float)threads,
                  "balanced, %d phases: share %d starts equal (%.3f)", phased + 1, t, (double)share[t]);
        const float up = 0.51f;
        int not_own = run_balanced(pool, threads, fast0, 1000000, phased, up, true, share);
        CHECK(share[0] >= up, "balanced, %d phases: the fast thread's share grew to %.3f (want >= %.3f)", phased + 1,
              (double)share[0], (double)up);
        CHECK(share[0] + share[1] > 0.999f && share[0] + share[1] < 1.001f, "balanced, %d phases: shares sum to %.4f",
              phased + 1, (double)(share[0] + share[1]));
        /* Thread 1 now the fast one: the shares follow it. */
        const float down = share[0] - 0.01f;
        not_own += run_balanced(pool, threads, fast1, 1000000, phased, down, false, share);
        CHECK(share[0] <= down, "balanced, %d phases: the shares follow a change of speeds (%.3f, want <= %.3f)",
              phased + 1, (double)share[0], (double)down);
        CHECK(not_own == 0, "balanced, %d phases: %d phases ran each task on the other's thread", phased + 1, not_own);
        tl_pool_free(pool);
    }
}

/* "One thread per core" counts the cores this process may use: a cgroup quota in whole
   cores rounded up, and the affinity mask (taskset, a container's cpuset). */
static void check_cores(void) {
    CHECK(tl_cpu_max_cores("150000 100000\n") == 2, "cpu.max 1.5 cores -> 2");
    CHECK(tl_cpu_max_cores("100000 100000") == 1, "cpu.max 1 core -> 1");
    CHECK(tl_cpu_max_cores("50000 100000") == 1, "cpu.max half a core -> 1");
    CHECK(tl_cpu_max_cores("800000 100000") == 8, "cpu.max 8 cores -> 8");
    CHECK(tl_cpu_max_cores("max 100000") == 0, "cpu.max unlimited -> 0 (no quota)");
    CHECK(tl_cpu_max_cores("0 100000") == 0 && tl_cpu_max_cores("100000 0") == 0, "cpu.max zeros -> 0");
    CHECK(tl_cpu_max_cores("") == 0 && tl_cpu_max_cores(NULL) == 0 && tl_cpu_max_cores("x y") == 0,
          "cpu.max unreadable -> 0");
    const int all = tl_pool_cores();
    CHECK(all >= 1, "cores %d", all);
    cpu_set_t saved, one;
    if (sched_getaffinity(0, sizeof saved, &saved) != 0) return;
    CPU_ZERO(&one);
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &saved)) {
            CPU_SET(cpu, &one);
            break;
        }
    if (sched_setaffinity(0, sizeof one, &one) == 0) {
        CHECK(tl_pool_cores() == 1, "pinned to one CPU: %d cores", tl_pool_cores());
        sched_setaffinity(0, sizeof saved, &saved);
    }
    CHECK(tl_pool_cores() == all, "affinity restored: %d cores, were %d", tl_pool_cores(), all);
}

/* A file of a fake cgroup tree. */
static void put(const char *root, const char *path, const char *text) {
    char file[1024];
    snprintf(file, sizeof file, "%s/%s", root, path);
    for (char *slash = strchr(file + strlen(root) + 1, '/'); slash; slash = strchr(slash + 1, '/')) {
        *slash = '\0';
        mkdir(file, 0755);
        *slash = '/';
    }
    FILE *f = fopen(file, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* tl_cgroup_quota_cores on a fake /sys/fs/cgroup: the least quota of the process's group and
   its ancestors, v2 and v1, other controllers and unlimited ones ignored. */
static void check_cgroup_tree(void) {
    char root[] = "/tmp/tinyloop-cgroup-XXXXXX";
    if (!mkdtemp(root)) { CHECK(0, "mkdtemp"); return; }
    CHECK(tl_cgroup_quota_cores("0::/a/b\n", root) == 0, "no cpu.max anywhere: no quota");
    put(root, "a/b/cpu.max", "max 100000\n");
    CHECK(tl_cgroup_quota_cores("0::/a/b\n", root) == 0, "unlimited group: no quota");
    put(root, "a/cpu.max", "250000 100000\n");
    CHECK(tl_cgroup_quota_cores("0::/a/b\n", root) == 3, "the parent's 2.5 cores: %d", tl_cgroup_quota_cores("0::/a/b\n", root));
    put(root, "a/b/cpu.max", "50000 100000\n");
    CHECK(tl_cgroup_quota_cores("0::/a/b\n", root) == 1, "the least of group and parent");
    CHECK(tl_cgroup_quota_cores("0::/elsewhere\n", root) == 0, "a group with no quota on its path");
    put(root, "cpu.max", "200000 100000\n"); /* the root: a container's own group, mounted */
    CHECK(tl_cgroup_quota_cores("0::/elsewhere\n", root) == 2, "the mount's root counts as an ancestor");
    /* v1: the cpu controller's quota over its period; cpuset and the other lines ignored */
    put(root, "cpu/x/cpu.cfs_quota_us", "300000\n");
    put(root, "cpu/x/cpu.cfs_period_us", "100000\n");
    put(root, "cpuset/x/cpu.cfs_quota_us", "100000\n");
    CHECK(tl_cgroup_quota_cores("5:cpuset:/x\n4:cpu,cpuacct:/x\n1:name=systemd:/\n", root) == 3, "v1 cpu: 3 cores");
    put(root, "cpu/x/cpu.cfs_quota_us", "-1\n");
    CHECK(tl_cgroup_quota_cores("4:cpuacct,cpu:/x\n", root) == 0, "v1 unlimited (-1)");
    CHECK(tl_cgroup_quota_cores("4:cpuacct,cpu:/x\n0::/a/b\n", root) == 1, "v1 and v2 lines: the least");
    CHECK(tl_cgroup_quota_cores("garbage\nno-colons\n\n", root) == 0 && tl_cgroup_quota_cores("", root) == 0 &&
              tl_cgroup_quota_cores(NULL, root) == 0,
          "unreadable text: no quota");
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", root);
    CHECK(system(cmd) == 0, "cleanup");
}

int main(void) {
    check_cores();
    check_cgroup_tree();
    check_set_shares();
    check_learning();
    check_balanced();
    for (int threads = 1; threads <= 4; threads++) {
        tl_pool *pool = tl_pool_new(threads);
        CHECK(pool != NULL && tl_pool_threads(pool) == threads, "pool of %d threads", threads);
        if (!pool) continue;
        job_state *s = calloc(1, sizeof *s);
        s->threads = threads;
        int wrong_runs = 0, early = 0, bad_thread = 0, not_own = 0;
        for (int round = 1; round <= 400; round++) {
            /* odd rounds: two phases of any sizes (either may be empty); even: one phase;
               every fourth: a balanced job (up to one task per thread a phase) */
            const bool balanced = round % 4 == 0;
            int n_tasks = 1 + round % MAX_TASKS, n_first = round % 2 ? (round * 7) % (n_tasks + 1) : n_tasks;
            if (balanced) {
                n_first = round / 4 % (threads + 1);
                n_tasks = n_first + round / 8 % (threads + 1);
            }
            s->n_tasks = n_tasks;
            s->n_first = n_first;
            s->round = round;
            for (int t = 0; t < MAX_TASKS; t++) atomic_store(&s->runs[t], 0);
            if (balanced) tl_pool_run_balanced(pool, n_tasks, n_first, task_fn, s, NULL);
            else if (round % 2) tl_pool_run_phased(pool, n_tasks, n_first, task_fn, s);
            else tl_pool_run(pool, n_tasks, task_fn, s);
            for (int t = 0; t < MAX_TASKS; t++) wrong_runs += atomic_load(&s->runs[t]) != (t < n_tasks);
            /* Two threads, a balanced phase of two tasks that both ran: each its own (the
               thread finishing the first phase first must not take the other's second-
               phase task, whose share was cut for the other). */
            if (balanced && threads == 2)
                for (int begin = 0; begin < n_tasks; begin = n_first) {
                    const int end = begin < n_first ? n_first : n_tasks;
                    if (end - begin == 2 && atomic_load(&s->ran_on[begin]) != atomic_load(&s->ran_on[begin + 1]))
                        not_own += atomic_load(&s->ran_on[begin]) != 0;
                    if (end == n_tasks) break;
                }
        }
        early = atomic_load(&s->early);
        bad_thread = atomic_load(&s->bad_thread);
        CHECK(wrong_runs == 0, "%d threads: %d tasks not run exactly once", threads, wrong_runs);
        CHECK(early == 0, "%d threads: %d second-phase tasks started before the first phase ended", threads, early);
        CHECK(bad_thread == 0, "%d threads: %d tasks got a thread index out of range", threads, bad_thread);
        CHECK(not_own == 0, "%d threads: in %d balanced phases the threads swapped their tasks", threads, not_own);
        /* Empty jobs are no-ops. */
        tl_pool_run(pool, 0, task_fn, s);
        tl_pool_run_phased(pool, 0, 0, task_fn, s);
        free(s);
        tl_pool_free(pool);
    }
    return check_summary();
}

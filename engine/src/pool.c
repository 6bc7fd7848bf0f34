/* pool.c: worker threads that spin briefly, then sleep, between parallel-for jobs.
 *
 * Decode issues ~100 short jobs per token, so waking workers through a condition variable
 * alone would cost several microseconds each: workers first spin on the job word.
 *
 * The caller never waits for a worker that has not started: the job word packs
 * (generation, task count, next task) into one atomic, tasks are claimed by CAS, and the
 * caller, which claims tasks too, waits only until every task is *done*. A worker that was
 * descheduled (another process on the core) simply finds the job exhausted when it wakes,
 * instead of stalling the caller for a scheduler time slice. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h" /* tl_process_mark */
#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <x86intrin.h>
#define cpu_relax() _mm_pause()
/* Task times for the shares, in ticks of any fixed rate (only their ratios count). */
static inline uint64_t ticks(void) { return __rdtsc(); }
#else
#define cpu_relax() ((void)0)
static inline uint64_t ticks(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}
#endif

/* Waits are counted in pauses (~25 ns each where this was tuned, an AMD Zen 5 VM). */
#define SPIN_ROUNDS 20000 /* (~0.5 ms) an idle worker spins this long, then sleeps */
/* Every this many pauses (~25 us: longer than decode's gaps between jobs, so a worker
   with a core of its own never yields in steady decode) a spinning worker, and a caller
   waiting for a task, yields. On a loaded machine the thread it waits for may share its
   core: a pure spin would hold that core for a whole time slice (2 threads then ran 3x
   slower than 1), a yield hands it over. A yield with nothing else runnable returns at
   once, so waiting out a long last task costs syscalls, not latency. */
#define YIELD_EVERY 1000
/* Learning the shares (update_shares): SHARE_WINDOW jobs a step of SHARE_STEP toward their
   balance. Each point of a share off the balance costs about two of a job's time, so the
   step is small: on the shipped model, alike vCPUs, thread 0's share spread with a standard
   deviation of 0.009-0.012 at windows of 16 and steps of 0.3, 0.004 at 32 and 0.1, which
   still settles within about 700 jobs (some 20 tokens there) after the cores change. */
#define SHARE_WINDOW 32
#define SHARE_STEP 0.1f
#define FIELD_BITS 22
#define FIELD_MASK ((UINT64_C(1) << FIELD_BITS) - 1)
#define MAX_TASKS ((int)FIELD_MASK)

/* job word: generation << 44 | n_tasks << 22 | next_task */
static inline uint64_t pack(uint64_t gen, uint64_t n, uint64_t next) {
    return gen << (2 * FIELD_BITS) | n << FIELD_BITS | next;
}
static inline uint64_t gen_of(uint64_t w) { return w >> (2 * FIELD_BITS); }
static inline int n_of(uint64_t w) { return (int)((w >> FIELD_BITS) & FIELD_MASK); }
static inline int next_of(uint64_t w) { return (int)(w & FIELD_MASK); }

struct tl_pool {
    int n_threads;                 /* including the calling thread */
    pthread_t *workers;            /* [n_threads - 1] */
    struct worker_arg *args;       /* [n_threads - 1]: each worker's own, freed with the pool */
    unsigned process;              /* tl_process_mark() when the workers started: in a child
                                      forked since, they are the parent's and not here */
    pthread_mutex_t run_lock;      /* one job at a time */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
    atomic_bool stop;
    atomic_int sleepers;           /* workers in (or entering) the condition wait */
    /* What a job is, written by its caller before it posts: one cache line read by every
       claimer. */
    _Alignas(64) _Atomic uint64_t job; /* see pack() */
    tl_task_fn fn;                 /* stable while any task of the job is unfinished */
    void *ctx;
    int first_phase;               /* tasks of the first phase (tl_pool_run_phased) */
    /* Written as tasks finish: a line of its own, so finishing a task does not take the
       job's line away from a thread about to claim. */
    _Alignas(64) atomic_int done;  /* tasks finished in the current job */
    /* Balanced jobs (tl_pool_run_balanced): each thread's ticks in the job's tasks, and
       whether every task ran on the thread of its index; read by the caller once the job
       is done. The shares are the caller's to update, under run_lock, and read by any
       thread (relaxed atomics: a reader may see a mix of two updates, which only sizes a
       split a little off). */
    _Alignas(64) bool balanced;
    tl_pool_clock_fn clock;        /* tl_pool_set_clock; NULL: ticks() */
    uint64_t busy[TL_POOL_SHARE_THREADS];
    atomic_bool taken[2 * TL_POOL_SHARE_THREADS]; /* the job's tasks handed out */
    /* The caller's, under run_lock: each learning job's balance point, thread t's fraction
       of the work at which the threads would have finished together. */
    float window[SHARE_WINDOW][TL_POOL_SHARE_THREADS];
    int window_jobs;
    bool pinned;                   /* tl_pool_set_shares: no learning */
    atomic_bool misplaced;
    _Atomic float share[TL_POOL_SHARE_THREADS];
};

/* Waits until `count` tasks of the current job are done. A thread that holds one of them
   may have been preempted (another process on its core): past YIELD_EVERY pauses the wait
   yields, rather than holding this core for a whole time slice. */
static void wait_done(tl_pool *pool, int count) {
    for (int spins = 0; atomic_load_explicit(&pool->done, memory_order_acquire) < count; spins++) {
        if (spins < YIELD_EVERY) cpu_relax();
        else sched_yield();
    }
}

/* A balanced job's task for claim `claim` (of n) by `thread`: one of the claim's phase,
   this thread's own where still free (thread t first out of the first phase must not take
   thread 0's second-phase task), else any free one (its thread late or descheduled; the
   job then teaches nothing). A phase has as many claims as tasks, so one is free. */
static int balanced_task(tl_pool *pool, int claim, int n, int thread) {
    const int begin = claim < pool->first_phase ? 0 : pool->first_phase;
    const int end = claim < pool->first_phase ? pool->first_phase : n;
    int task = begin + thread;
    if (task < end && !atomic_exchange_explicit(&pool->taken[task], true, memory_order_relaxed)) return task;
    for (task = begin; atomic_exchange_explicit(&pool->taken[task], true, memory_order_relaxed); task++) {
    }
    atomic_store_explicit(&pool->misplaced, true, memory_order_relaxed);
    return task;
}

/* Claims and runs tasks of generation `gen` until none are left; a task of the second
   phase first waits for the whole first phase (claims go in task order, so every task of
   the first phase is then running or done, and none of them waits). */
static void run_tasks(tl_pool *pool, uint64_t gen, int thread) {
    uint64_t w = atomic_load_explicit(&pool->job, memory_order_acquire);
    for (;;) {
        if (gen_of(w) != gen || next_of(w) >= n_of(w)) return;
        if (!atomic_compare_exchange_weak_explicit(&pool->job, &w, w + 1, memory_order_acquire,
                                                   memory_order_acquire))
            continue;
        const int claim = next_of(w);
        if (claim >= pool->first_phase) wait_done(pool, pool->first_phase);
        if (pool->balanced) {
            const int task = balanced_task(pool, claim, n_of(w), thread);
            const tl_pool_clock_fn clock = pool->clock;
            const uint64_t start = clock ? clock() : ticks();
            pool->fn(pool->ctx, task, thread);
            pool->busy[thread] += (clock ? clock() : ticks()) - start; /* this thread's own slot */
        } else {
            pool->fn(pool->ctx, claim, thread);
        }
        atomic_fetch_add_explicit(&pool->done, 1, memory_order_release);
        w = atomic_load_explicit(&pool->job, memory_order_acquire);
    }
}

typedef struct worker_arg { tl_pool *pool; int thread; } worker_arg;

/* A worker neither allocates nor frees: glibc gives a thread its own malloc arena at its first
   call (free too), 64 MiB of address space reserved (128 briefly) each, so that 16 threads
   took ~1 GiB of a process's RLIMIT_AS and loads under `ulimit -v` failed at random. */
static void *worker_main(void *arg_) {
    const worker_arg arg = *(const worker_arg *)arg_;
    tl_pool *pool = arg.pool;
    uint64_t seen = 0; /* jobs may be posted before this thread first runs */
    for (;;) {
        uint64_t gen;
        int spins = 0;
        while ((gen = gen_of(atomic_load_explicit(&pool->job, memory_order_acquire))) == seen &&
               !atomic_load(&pool->stop)) {
            if (++spins < SPIN_ROUNDS) {
                if (spins % YIELD_EVERY == 0) sched_yield();
                else cpu_relax();
                continue;
            }
            /* Counted before the job word is read again (both seq_cst): a caller that
               posts after that read sees the count and broadcasts under the lock, which
               this thread holds until it waits. */
            pthread_mutex_lock(&pool->sleep_lock);
            atomic_fetch_add(&pool->sleepers, 1);
            while (gen_of(atomic_load(&pool->job)) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->sleep_lock);
            atomic_fetch_sub(&pool->sleepers, 1);
            pthread_mutex_unlock(&pool->sleep_lock);
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = gen;
        run_tasks(pool, gen, arg.thread);
    }
}

/* ---- How many cores this process may use ----------------------------------------------
   Not the machine's count: a container (docker --cpus, a Kubernetes limit, systemd's
   CPUQuota) or taskset gives a process fewer, and a pool of one thread per machine core
   then time-shares them, each job waiting for threads that are not running. The count is
   the CPUs of the affinity mask, capped by the CPU quota of the process's cgroup and every
   ancestor (v2 cpu.max, v1 cpu.cfs_quota_us / cfs_period_us), rounded up. */

static int quota_cores(long long quota, long long period) {
    if (quota <= 0 || period <= 0) return 0;
    const long long cores = (quota + period - 1) / period;
    return cores < 65536 ? (int)cores : 65536;
}

int tl_cpu_max_cores(const char *cpu_max) {
    long long quota, period;
    if (!cpu_max || sscanf(cpu_max, "%lld %lld", &quota, &period) != 2) return 0; /* "max ..." */
    return quota_cores(quota, period);
}

/* The first line of a small file. Not tl_read_regular: a missing file is the usual case
   here (no quota set at that level), and must not leave a message in tl_last_error. */
static bool read_line(const char *path, char *line, size_t size) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    const bool ok = fgets(line, (int)size, f) != NULL;
    fclose(f);
    return ok;
}

/* The least quota of the cgroup `path` under `mount` and its ancestors (0: none). */
static int cgroup_quota_cores(const char *mount, const char *path, bool v2) {
    char dir[512], file[600], line[128];
    if (snprintf(dir, sizeof dir, "%s%s", mount, path) >= (int)sizeof dir) return 0;
    int least = 0;
    for (;;) {
        int cores = 0;
        if (v2) {
            snprintf(file, sizeof file, "%s/cpu.max", dir);
            if (read_line(file, line, sizeof line)) cores = tl_cpu_max_cores(line);
        } else {
            long long quota = -1, period = 0;
            snprintf(file, sizeof file, "%s/cpu.cfs_quota_us", dir);
            if (read_line(file, line, sizeof line)) quota = atoll(line);
            snprintf(file, sizeof file, "%s/cpu.cfs_period_us", dir);
            if (read_line(file, line, sizeof line)) period = atoll(line);
            cores = quota_cores(quota, period);
        }
        if (cores > 0 && (least == 0 || cores < least)) least = cores;
        char *slash = strrchr(dir, '/');
        if (!slash || (size_t)(slash - dir) < strlen(mount)) break; /* the mount's root was read */
        *slash = '\0';
    }
    return least;
}

int tl_cgroup_quota_cores(const char *proc_cgroup, const char *cgroup_root) {
    if (!proc_cgroup || !cgroup_root) return 0;
    char v2[512], v1[512], v1_joint[512];
    if (snprintf(v2, sizeof v2, "%s", cgroup_root) >= (int)sizeof v2 ||
        snprintf(v1, sizeof v1, "%s/cpu", cgroup_root) >= (int)sizeof v1 ||
        snprintf(v1_joint, sizeof v1_joint, "%s/cpu,cpuacct", cgroup_root) >= (int)sizeof v1_joint)
        return 0;
    char line[1024];
    int least = 0;
    for (const char *at = proc_cgroup; *at;) {
        const size_t len = strcspn(at, "\n");
        if (len >= sizeof line) { /* a path this long holds no quota we could read */
            at += len + (at[len] == '\n');
            continue;
        }
        memcpy(line, at, len);
        line[len] = '\0';
        at += len + (at[len] == '\n');
        char *controllers = strchr(line, ':'), *path = controllers ? strchr(controllers + 1, ':') : NULL;
        if (!path) continue;
        *path++ = '\0';
        controllers++;
        int cores = 0;
        if (!*controllers) {
            cores = cgroup_quota_cores(v2, path, true);
        } else {
            bool has_cpu = false; /* "cpu" in the comma list, not "cpuacct" or "cpuset" */
            char *rest = NULL;
            for (char *c = strtok_r(controllers, ",", &rest); c; c = strtok_r(NULL, ",", &rest)) has_cpu |= strcmp(c, "cpu") == 0;
            if (has_cpu) {
                cores = cgroup_quota_cores(v1, path, false);
                if (!cores) cores = cgroup_quota_cores(v1_joint, path, false);
            }
        }
        if (cores > 0 && (least == 0 || cores < least)) least = cores;
    }
    return least;
}

/* The cgroup quota of this process in cores (0: none found). */
static int process_quota_cores(void) {
    FILE *f = fopen("/proc/self/cgroup", "r");
    if (!f) return 0;
    char text[8192];
    const size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    return tl_cgroup_quota_cores(text, "/sys/fs/cgroup");
}

int tl_pool_cores(void) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof mask, &mask) == 0 && CPU_COUNT(&mask) > 0) cores = CPU_COUNT(&mask);
    const int quota = process_quota_cores();
    if (quota > 0 && quota < cores) cores = quota;
    return cores > 0 ? (int)(cores < 65536 ? cores : 65536) : 1;
}

tl_pool *tl_pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    tl_pool *pool = aligned_alloc(64, sizeof *pool); /* the job's and done's own lines */
    if (!pool) return NULL;
    memset(pool, 0, sizeof *pool);
    pool->n_threads = n_threads;
    pool->process = tl_process_mark();
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->sleep_lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    atomic_init(&pool->job, 0);
    pool->workers = calloc((size_t)n_threads, sizeof *pool->workers);
    pool->args = calloc((size_t)n_threads, sizeof *pool->args);
    if (!pool->workers || !pool->args) {
        free(pool->workers);
        free(pool->args);
        free(pool);
        return NULL;
    }
    for (int t = 1; t < n_threads; t++) {
        pool->args[t - 1] = (worker_arg){pool, t};
        if (pthread_create(&pool->workers[t - 1], NULL, worker_main, &pool->args[t - 1]) != 0) {
            pool->n_threads = t; /* keep the threads that started */
            break;
        }
    }
    for (int t = 0; t < TL_POOL_SHARE_THREADS; t++) atomic_init(&pool->share[t], 1.0f / (float)pool->n_threads);
    return pool;
}

int tl_pool_threads(const tl_pool *pool) { return pool ? pool->n_threads : 1; }

void tl_pool_free(tl_pool *pool) {
    if (!pool) return;
    if (tl_forked_since(pool->process)) { /* a child's copy: no worker to stop or join, and the
                                             condition variable counts the parent's sleepers */
        free(pool->workers);
        free(pool->args);
        free(pool);
        return;
    }
    pthread_mutex_lock(&pool->sleep_lock);
    atomic_store(&pool->stop, true);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->sleep_lock);
    for (int t = 1; t < pool->n_threads; t++) pthread_join(pool->workers[t - 1], NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->sleep_lock);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool->workers);
    free(pool->args);
    free(pool);
}

void tl_pool_run(tl_pool *pool, int n_tasks, tl_task_fn fn, void *ctx) {
    tl_pool_run_phased(pool, n_tasks, n_tasks, fn, ctx);
}

const float *tl_pool_shares(const tl_pool *pool, float share[TL_POOL_SHARE_THREADS]) {
    if (!pool) {
        share[0] = 1.0f;
        return share;
    }
    if (pool->n_threads > TL_POOL_SHARE_THREADS) return NULL;
    for (int t = 0; t < pool->n_threads; t++) share[t] = atomic_load_explicit(&pool->share[t], memory_order_relaxed);
    return share;
}

/* The shares normalised to sum to 1 with each within [1/2, 3/2] of an equal share: the
   ones out of bounds are pinned to their bound and the rest rescaled to the remainder,
   until none moves (at most one round per thread). NaN or negative count as 0. */
static void store_shares(tl_pool *pool, const float *share) {
    const int threads = pool->n_threads;
    const float equal = 1.0f / (float)threads, low = 0.5f * equal, high = 1.5f * equal;
    float value[TL_POOL_SHARE_THREADS];
    bool pinned[TL_POOL_SHARE_THREADS] = {false};
    for (int t = 0; t < threads; t++) value[t] = share[t] > 0.0f ? share[t] : 0.0f;
    for (int round = 0; round <= threads; round++) {
        float free_sum = 0.0f, left = 1.0f;
        for (int t = 0; t < threads; t++) {
            if (pinned[t]) left -= value[t];
            else free_sum += value[t];
        }
        bool moved = false;
        for (int t = 0; t < threads; t++) {
            if (pinned[t]) continue;
            value[t] = free_sum > 0.0f ? value[t] * left / free_sum : left / (float)threads;
        }
        for (int t = 0; t < threads; t++) {
            if (pinned[t] || (value[t] >= low && value[t] <= high)) continue;
            value[t] = value[t] < low ? low : high;
            pinned[t] = moved = true;
        }
        if (!moved) break;
    }
    for (int t = 0; t < threads; t++) atomic_store_explicit(&pool->share[t], value[t], memory_order_relaxed);
}

void tl_pool_set_clock(tl_pool *pool, tl_pool_clock_fn clock) {
    if (!pool) return;
    pthread_mutex_lock(&pool->run_lock);
    pool->clock = clock;
    pthread_mutex_unlock(&pool->run_lock);
}

void tl_pool_set_shares(tl_pool *pool, const float *share) {
    if (!pool || pool->n_threads > TL_POOL_SHARE_THREADS) return;
    pthread_mutex_lock(&pool->run_lock); /* no job in flight: the window is the caller's */
    pool->pinned = share != NULL;
    pool->window_jobs = 0;
    if (share) store_shares(pool, share);
    else
        for (int t = 0; t < pool->n_threads; t++)
            atomic_store_explicit(&pool->share[t], 1.0f / (float)pool->n_threads, memory_order_relaxed);
    pthread_mutex_unlock(&pool->run_lock);
}

/* After a learning job in which every thread ran its own task of each phase: thread t did
   work[t] of the job in busy[t] ticks, a rate of work[t] / busy[t], so the job's balance
   point (the cut at which the threads would have finished together) is the rates'
   proportions. Every SHARE_WINDOW such jobs, the shares move SHARE_STEP toward each
   thread's median balance point of the window, within their bounds (pinned shares stay).
   The median, not a sum of times: a thread preempted once (another process on its core, a
   time slice of milliseconds) would outweigh a window of 10-microsecond jobs. */
static void update_shares(tl_pool *pool, const float *work, const uint64_t *busy) {
    if (pool->pinned) return; /* tl_pool_set_shares: held */
    const int threads = pool->n_threads;
    float rate[TL_POOL_SHARE_THREADS], total = 0.0f;
    for (int t = 0; t < threads; t++) {
        if (busy[t] == 0 || !(work[t] > 0.0f)) return; /* a thread without work: nothing to compare */
        rate[t] = work[t] / (float)busy[t];
        total += rate[t];
    }
    for (int t = 0; t < threads; t++) pool->window[pool->window_jobs][t] = rate[t] / total;
    if (++pool->window_jobs < SHARE_WINDOW) return;
    pool->window_jobs = 0;
    float next[TL_POOL_SHARE_THREADS];
    for (int t = 0; t < threads; t++) {
        float points[SHARE_WINDOW];
        for (int j = 0; j < SHARE_WINDOW; j++) { /* insertion sort: 32 values */
            const float v = pool->window[j][t];
            int at = j;
            for (; at > 0 && points[at - 1] > v; at--) points[at] = points[at - 1];
            points[at] = v;
        }
        const float median = 0.5f * (points[SHARE_WINDOW / 2 - 1] + points[SHARE_WINDOW / 2]);
        const float now = atomic_load_explicit(&pool->share[t], memory_order_relaxed);
        next[t] = now + SHARE_STEP * (median - now);
    }
    store_shares(pool, next);
}

void tl_pool_teach(tl_pool *pool, const float *work, const uint64_t *busy) {
    if (!pool || pool->n_threads > TL_POOL_SHARE_THREADS || pool->n_threads < 2) return;
    pthread_mutex_lock(&pool->run_lock); /* the window is the caller of a job's */
    update_shares(pool, work, busy);
    pthread_mutex_unlock(&pool->run_lock);
}

static void run_job(tl_pool *pool, int n_tasks, int n_first, tl_task_fn fn, void *ctx, bool balanced,
                    const float *work);

void tl_pool_run_phased(tl_pool *pool, int n_tasks, int n_first, tl_task_fn fn, void *ctx) {
    run_job(pool, n_tasks, n_first, fn, ctx, false, NULL);
}

void tl_pool_run_balanced(tl_pool *pool, int n_tasks, int n_first, tl_task_fn fn, void *ctx, const float *work) {
    /* At most one task per thread a phase (the `taken` flags' room) */
    const bool fits = pool && pool->n_threads <= TL_POOL_SHARE_THREADS && n_first <= pool->n_threads &&
                      n_tasks - n_first <= pool->n_threads;
    run_job(pool, n_tasks, n_first, fn, ctx, fits, fits ? work : NULL);
}

static void run_job(tl_pool *pool, int n_tasks, int n_first, tl_task_fn fn, void *ctx, bool balanced,
                    const float *work) {
    if (n_tasks <= 0) return;
    /* Single task, single thread, the pool busy with another session's job, or a child's
       copy of the pool (forked: its workers are the parent's): run here. Callers size
       per-thread scratch for every thread index, 0 included. In task order, the phases keep
       theirs. */
    if (!pool || pool->n_threads == 1 || n_tasks == 1 || n_tasks > MAX_TASKS || tl_forked_since(pool->process) ||
        pthread_mutex_trylock(&pool->run_lock) != 0) {
        for (int task = 0; task < n_tasks; task++) fn(ctx, task, 0);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    pool->first_phase = n_first < n_tasks ? n_first : n_tasks;
    pool->balanced = balanced;
    if (balanced) {
        memset(pool->busy, 0, sizeof pool->busy);
        for (int task = 0; task < n_tasks; task++) atomic_store_explicit(&pool->taken[task], false, memory_order_relaxed);
        atomic_store_explicit(&pool->misplaced, false, memory_order_relaxed);
    }
    atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
    uint64_t gen = (gen_of(atomic_load(&pool->job)) + 1) & ((UINT64_C(1) << 20) - 1);
    if (gen == 0) gen = 1; /* 0 is what a fresh worker has "seen" */
    atomic_store(&pool->job, pack(gen, (uint64_t)n_tasks, 0));
    /* Spinning workers see the job word; sleeping ones need the broadcast. Skipping the
       lock when none sleeps, with job and done on lines of their own, took a two-task job
       of 0.3 us tasks from 0.90 to 0.78 us at two threads (a decode token posts ~37). */
    if (atomic_load(&pool->sleepers) > 0) {
        pthread_mutex_lock(&pool->sleep_lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->sleep_lock);
    }
    run_tasks(pool, gen, 0);
    wait_done(pool, n_tasks); /* the tasks still running, claimed by workers */
    if (balanced && work && !atomic_load_explicit(&pool->misplaced, memory_order_relaxed))
        update_shares(pool, work, pool->busy);
    pthread_mutex_unlock(&pool->run_lock);
}

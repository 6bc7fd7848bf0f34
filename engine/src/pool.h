/* pool.h: a fixed set of worker threads that run parallel-for jobs (the CPU backend's
 * operations, the quantiser's rows). */
#ifndef TL_POOL_H
#define TL_POOL_H

#include <stdbool.h>
#include <stdint.h>

/* fn(ctx, task, thread) runs once per task in [0, n_tasks); `thread` in [0, n_threads)
   indexes per-thread scratch. Tasks must not depend on which thread runs them: results
   are then independent of the thread count (the batch-invariance contract). */
typedef void (*tl_task_fn)(void *ctx, int task, int thread);

typedef struct tl_pool tl_pool;

tl_pool *tl_pool_new(int n_threads);   /* NULL on failure; n_threads >= 1 */
int tl_pool_cores(void);               /* the cores this process may use (>= 1): "one per core";
                                         the affinity mask, capped by its cgroup's CPU quota */
int tl_cpu_max_cores(const char *cpu_max); /* a cgroup v2 cpu.max line ("150000 100000") in whole
                                         cores, rounded up (2); 0 for "max ..." or unreadable */
/* The least CPU quota, in whole cores, of the cgroups that proc_cgroup (the text of
   /proc/self/cgroup) names and of their ancestors, read under cgroup_root (/sys/fs/cgroup):
   v2 ("0::/path": cpu.max) and v1's cpu controller ("N:cpu,cpuacct:/path": cpu.cfs_quota_us
   over cpu.cfs_period_us, under cgroup_root/cpu or /cpu,cpuacct); 0 when none is set. */
int tl_cgroup_quota_cores(const char *proc_cgroup, const char *cgroup_root);
void tl_pool_free(tl_pool *pool);
int tl_pool_threads(const tl_pool *pool);

/* Runs the job and returns when every task is done. The pool serves one job at a time;
   when another caller holds it (two sessions on one model), this caller runs all tasks
   itself, so it never waits on a stranger's job.
   Per-thread scratch must therefore exist for every index the pool may pass. */
void tl_pool_run(tl_pool *pool, int n_tasks, tl_task_fn fn, void *ctx);

/* One job of two phases: tasks [0, n_first), then [n_first, n_tasks), where the second
   phase reads what the first wrote (a decode layer's attention, then its output
   projection). A task of the second phase starts only once every task of the first is
   done, waited for inside the job by whichever thread claimed it, so the caller does not
   collect the first phase and post the second: that hand-off is what a region costs. */
void tl_pool_run_phased(tl_pool *pool, int n_tasks, int n_first, tl_task_fn fn, void *ctx);

/* ---------------------------------------------------------------- balanced shares */

/* Cores are not alike: on a cloud VM one vCPU may run 20% slower than another (a busy
   neighbour on its core), on a hybrid CPU an efficiency core slower still. A job split
   into one equal task per thread then waits for the slowest thread each time (the shipped
   model at two threads: the calling thread idled 28% of each job). The pool therefore
   keeps a share of work per thread, learned from the jobs below, for callers that split a
   small job one task per thread: task t of a phase sized share[t] of that phase's work.
   Up to TL_POOL_SHARE_THREADS threads; larger pools keep equal shares. */
#define TL_POOL_SHARE_THREADS 8

/* The current shares into share[0..threads), summing to 1 (equal until learned), and
   returns share; NULL, writing nothing, for pools larger than TL_POOL_SHARE_THREADS (they
   keep equal splits). */
const float *tl_pool_shares(const tl_pool *pool, float share[TL_POOL_SHARE_THREADS]);

/* Pins the shares (normalised, each within [1/2, 3/2] of an equal share; learning stops),
   for callers that know their cores and for tests that cut jobs unevenly on purpose; NULL
   returns to equal shares and learning. Waits for a job in flight. No-op for pools larger
   than TL_POOL_SHARE_THREADS. */
void tl_pool_set_shares(tl_pool *pool, const float *share);

/* tl_pool_run_phased for a job whose phases have at most one task per thread, task t of
   a phase (the phase's first task + t) cut for thread t by the shares (tl_pool_shares just
   before). Thread t runs task t of each phase, unless it comes late and another thread has
   taken it (the caller still never waits for a thread that has not started).
   `work` (or NULL: the job teaches nothing) is the cut as made, work[t] thread t's fraction
   of the whole job (whole panels or heads only approach the shares): where every task ran
   on its own thread, the threads' times then teach the shares (update_shares: the median
   of a window of jobs, a bounded step, so that a preempted thread cannot swing them). */
void tl_pool_run_balanced(tl_pool *pool, int n_tasks, int n_first, tl_task_fn fn, void *ctx, const float *work);

/* What a learning job of tl_pool_run_balanced teaches, given directly: thread t did
   work[t] of a job in busy[t] ticks of any fixed rate. The same step as after a job (one
   job of the window; pinned shares ignore it), for tests of the learning that must not
   depend on how the machine schedules the pool's threads: under load a worker comes late
   to most jobs, whose tasks then do not run on their own threads and teach nothing. */
void tl_pool_teach(tl_pool *pool, const float *work, const uint64_t *busy);

/* The clock that times a balanced job's tasks, read by the thread running each task just
   before and after it; any fixed rate (only ratios count). NULL (the default): the CPU's
   time-stamp counter (CLOCK_MONOTONIC elsewhere). A test sets a per-thread virtual clock
   that its tasks advance, so that what the shares learn is decided by the test and not by
   the machine's load (a test timing real busy-waits learned the wrong way in CI, its two
   threads time-sharing cores with another test). Set it with no job in flight. */
typedef uint64_t (*tl_pool_clock_fn)(void);
void tl_pool_set_clock(tl_pool *pool, tl_pool_clock_fn clock);

#endif

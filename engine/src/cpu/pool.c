/* pool.c: worker threads that spin briefly, then sleep, between parallel-for jobs.
 *
 * Decode issues ~100 short jobs per token, so waking workers through a condition
 * variable alone would cost several microseconds each; workers first spin on the job
 * generation counter and only then block. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define SPIN_ROUNDS 20000

struct tl_pool {
    int n_threads;                 /* including the calling thread */
    pthread_t *workers;            /* [n_threads - 1] */
    pthread_mutex_t run_lock;      /* one job at a time */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
    atomic_uint generation;        /* bumped for each new job */
    atomic_int next_task;
    atomic_int pending_workers;    /* workers still inside the current job */
    atomic_bool stop;
    int n_tasks;
    tl_task_fn fn;
    void *ctx;
};

static void run_tasks(tl_pool *pool, int thread) {
    for (;;) {
        int task = atomic_fetch_add_explicit(&pool->next_task, 1, memory_order_relaxed);
        if (task >= pool->n_tasks) break;
        pool->fn(pool->ctx, task, thread);
    }
}

typedef struct { tl_pool *pool; int thread; } worker_arg;

static void *worker_main(void *arg_) {
    worker_arg arg = *(worker_arg *)arg_;
    free(arg_);
    tl_pool *pool = arg.pool;
    unsigned seen = 0; /* jobs may be posted before this thread first runs */
    for (;;) {
        unsigned gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen &&
               !atomic_load(&pool->stop)) {
            if (++spins < SPIN_ROUNDS) { cpu_relax(); continue; }
            pthread_mutex_lock(&pool->sleep_lock);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->sleep_lock);
            pthread_mutex_unlock(&pool->sleep_lock);
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = gen;
        run_tasks(pool, arg.thread);
        atomic_fetch_sub_explicit(&pool->pending_workers, 1, memory_order_release);
    }
}

tl_pool *tl_pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    tl_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->sleep_lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pool->workers = calloc((size_t)n_threads, sizeof *pool->workers);
    if (!pool->workers) { free(pool); return NULL; }
    for (int t = 1; t < n_threads; t++) {
        worker_arg *arg = malloc(sizeof *arg);
        if (arg) *arg = (worker_arg){pool, t};
        if (!arg || pthread_create(&pool->workers[t - 1], NULL, worker_main, arg) != 0) {
            free(arg);
            pool->n_threads = t; /* keep the threads that started */
            break;
        }
    }
    return pool;
}

int tl_pool_threads(const tl_pool *pool) { return pool ? pool->n_threads : 1; }

void tl_pool_free(tl_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->sleep_lock);
    atomic_store(&pool->stop, true);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->sleep_lock);
    for (int t = 1; t < pool->n_threads; t++) pthread_join(pool->workers[t - 1], NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->sleep_lock);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool->workers);
    free(pool);
}

void tl_pool_run(tl_pool *pool, int n_tasks, tl_task_fn fn, void *ctx) {
    if (n_tasks <= 0) return;
    /* Single task, single thread, or the pool busy with another session's job: run here.
       Callers size per-thread scratch for thread index 0 being always usable. */
    if (!pool || pool->n_threads == 1 || n_tasks == 1 || pthread_mutex_trylock(&pool->run_lock) != 0) {
        for (int task = 0; task < n_tasks; task++) fn(ctx, task, 0);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_tasks = n_tasks;
    atomic_store_explicit(&pool->next_task, 0, memory_order_relaxed);
    atomic_store_explicit(&pool->pending_workers, pool->n_threads - 1, memory_order_relaxed);
    pthread_mutex_lock(&pool->sleep_lock);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->sleep_lock);
    run_tasks(pool, 0);
    while (atomic_load_explicit(&pool->pending_workers, memory_order_acquire) > 0) cpu_relax();
    pthread_mutex_unlock(&pool->run_lock);
}

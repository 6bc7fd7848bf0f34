/* sampler_bench.c: what choosing a token costs (engine/src/sampler.c), per call over one row
 * of logits, on the calling thread: greedy's argmax, the top-k ranking (the heap, its pruned
 * blocks for a small k, the radix sort for a large one) and whole distributions (temperature,
 * top-k, top-p), the work a session does once a token between forward passes (eight times
 * a step in a batch of eight). A tool, not a test: its ctest runs only check that it runs.
 *   build/scripts/bench/tinyloop-sampler-bench [--vocab 50257] [--repeat 200] [--seed 1] */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "sampler.h"

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---------------------------------------------------------------- the rows */

static uint64_t rng_state;
static double uniform01(void) { /* xorshift64*, 53 bits */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 0x2545F4914F6CDD1DULL) >> 11) * 0x1p-53;
}

/* uniform: logits spread evenly over [-4, 4] (a flat row: the hardest for pruning and the
   nucleus); peaked: normal(0, 2) with 20 tokens lifted by 8 to 12, as a trained model's
   row has a few likely tokens and a long tail. */
static void fill_row(float *row, int vocab, int peaked) {
    for (int i = 0; i < vocab; i++) {
        if (!peaked) {
            row[i] = (float)(uniform01() * 8.0 - 4.0);
            continue;
        }
        const double u1 = uniform01() + 1e-300, u2 = uniform01();
        row[i] = (float)(2.0 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
    for (int s = 0; peaked && s < 20; s++) row[(int)(uniform01() * vocab)] += (float)(8.0 + 4.0 * uniform01());
}

/* ---------------------------------------------------------------- the calls */

typedef enum { ARGMAX, TOP_K, RADIX, DISTRIBUTION } call_kind;

typedef struct {
    const char *name;
    call_kind kind;
    int k;      /* TOP_K / RADIX: k; DISTRIBUTION: top_k (0: every token) */
    float top_p; /* DISTRIBUTION */
} call;

typedef struct {
    int vocab;
    int32_t *ids;
    float *values;
    uint64_t *scratch;
    tl_distribution dist;
} buffers;

static int run_call(const call *c, const float *row, buffers *b) {
    switch (c->kind) {
    case ARGMAX: return tl_argmax(row, b->vocab);
    case TOP_K: return tl_top_k(row, b->vocab, c->k, b->ids, b->values);
    case RADIX: return tl_top_k_radix(row, b->vocab, c->k, b->ids, b->values, b->scratch);
    case DISTRIBUTION: return tl_distribution_build(&b->dist, row, 0.8f, c->k, c->top_p, 0.0f, false) ? b->dist.n : -1;
    }
    return -1;
}

/* The median of `repeat` calls, in microseconds (after one untimed call). */
static double time_call(const call *c, const float *row, buffers *b, int repeat, double *times) {
    volatile int sink = run_call(c, row, b);
    for (int r = 0; r < repeat; r++) {
        const double t0 = now_us();
        sink = run_call(c, row, b);
        times[r] = now_us() - t0;
    }
    (void)sink;
    qsort(times, (size_t)repeat, sizeof *times, cmp_double);
    return repeat % 2 ? times[repeat / 2] : 0.5 * (times[repeat / 2 - 1] + times[repeat / 2]);
}

/* ---------------------------------------------------------------- main */

static void usage(FILE *to) {
    fprintf(to, "usage: tinyloop-sampler-bench [--vocab 50257] [--repeat 200] [--seed 1]\n"
                "  --vocab N    logits a row (2 to 4194304; GPT-2's 50257 by default)\n"
                "  --repeat N   timed calls of each kind (1 to 100000); the median is printed\n"
                "  --seed N     seed of the rows\n"
                "Prints the median microseconds a call over a uniform row (logits evenly in [-4, 4])\n"
                "and a peaked one (normal(0, 2), 20 tokens lifted by 8 to 12).\n");
}

int main(int argc, char **argv) {
    int vocab = 50257, repeat = 200, seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "--help") || !strcmp(opt, "-h")) {
            usage(stdout);
            return 0;
        }
        const char *value = i + 1 < argc ? argv[++i] : "";
        const int ok = !strcmp(opt, "--vocab")    ? bench_int(value, 2, 1 << 22, &vocab)
                       : !strcmp(opt, "--repeat") ? bench_int(value, 1, 100000, &repeat)
                       : !strcmp(opt, "--seed")   ? bench_int(value, 0, 1 << 30, &seed)
                                                  : -1;
        if (ok == -1) {
            fprintf(stderr, "tinyloop-sampler-bench: unknown option %s\n", opt);
            usage(stderr);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "tinyloop-sampler-bench: bad option %s %s\n", opt, value);
            return 2;
        }
    }
    rng_state = 0x9E3779B97F4A7C15ULL ^ (uint64_t)seed;
    buffers b = {.vocab = vocab};
    float *rows[2] = {malloc((size_t)vocab * sizeof(float)), malloc((size_t)vocab * sizeof(float))};
    double *times = malloc((size_t)repeat * sizeof *times);
    b.ids = malloc((size_t)vocab * sizeof *b.ids);
    b.values = malloc((size_t)vocab * sizeof *b.values);
    b.scratch = malloc(tl_top_k_radix_scratch(vocab) * sizeof *b.scratch);
    if (!rows[0] || !rows[1] || !times || !b.ids || !b.values || !b.scratch || tl_distribution_init(&b.dist, vocab) != TL_OK) {
        fprintf(stderr, "tinyloop-sampler-bench: out of memory for a vocabulary of %d\n", vocab);
        return 1;
    }
    fill_row(rows[0], vocab, 0);
    fill_row(rows[1], vocab, 1);
    const call calls[] = {
        {"argmax (greedy)", ARGMAX, 0, 1.0f},
        {"top-k heap, k 10", TOP_K, 10, 1.0f},
        {"top-k heap, k 50", TOP_K, 50, 1.0f},
        {"top-k heap, k 128", TOP_K, 128, 1.0f},
        {"top-k heap, k 1000", TOP_K, 1000, 1.0f},
        {"top-k radix, k 1000", RADIX, 1000, 1.0f},
        {"top-k radix, every token", RADIX, vocab, 1.0f},
        {"distribution top_k 50", DISTRIBUTION, 50, 1.0f},
        {"distribution top_k 50, top_p 0.95", DISTRIBUTION, 50, 0.95f},
        {"distribution every token", DISTRIBUTION, 0, 1.0f},
        {"distribution every token, top_p 0.95", DISTRIBUTION, 0, 0.95f},
    };
    printf("vocabulary %d, median of %d calls, microseconds a call (temperature 0.8)\n", vocab, repeat);
    printf("%-40s %12s %12s\n", "call", "uniform row", "peaked row");
    for (size_t c = 0; c < sizeof calls / sizeof calls[0]; c++) {
        double us[2];
        for (int r = 0; r < 2; r++) us[r] = time_call(&calls[c], rows[r], &b, repeat, times);
        printf("%-40s %12.2f %12.2f\n", calls[c].name, us[0], us[1]);
    }
    tl_distribution_free(&b.dist);
    free(rows[0]);
    free(rows[1]);
    free(times);
    free(b.ids);
    free(b.values);
    free(b.scratch);
    return bench_output_status("tinyloop-sampler-bench");
}

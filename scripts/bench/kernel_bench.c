/* kernel_bench: the CPU matmul kernels on their own, per instruction set, weight type and
 * row count: GFLOP/s (2 x rows x k x cols per call) and weight GB/s, the median of
 * --repeat timed runs with its interquartile range.
 *
 *   tinyloop-kernel-bench [--k 768] [--cols 3072] [--mb 0] [--rows 1,2,4,6,8,12,16]
 *                         [--dtype f16,q8,q4] [--isa LIST] [--threads 1] [--repeat 15]
 *                         [--f16-halves auto|0|1] [--pair-tiles auto|0|1]
 *
 * One row streams its weights (decode); several rows share every weight load in register
 * tiles (prefill, speculative verification, batched decode), so their figure is compute's.
 * --mb M spreads copies of the matrix over M MB and walks them in turn, so that the
 * weights come from memory rather than cache (use a few times the L3 that tinyloop-bench
 * prints); 0 keeps one matrix (cache-resident when it fits). --threads 2 splits the columns
 * into contiguous whole-panel ranges, one task per thread, run by the engine's own pool
 * (pool.h: persistent workers that spin between jobs, as in decoding; threads created per
 * call made two-thread figures of small matrices measure thread creation). For q8/q4,
 * GFLOP/s counts the integer multiply-adds as a float product would (2 per weight and
 * row). Float rows are arranged once per call for families that arrange them
 * (tl_kernels.arrange_rows: AVX-512's two-panel tiles, 6 to 16 rows; not for 16-bit weights
 * in one-panel tiles), inside the timing, as the engine does
 * once per product. A tool, not a test: speed figures drift with the machine. */
#define _GNU_SOURCE
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "cpu/kernels.h"
#include "pool.h"
#include "dtype.h"
#include "quant.h"

enum { MAX_LIST = 32, MAX_THREADS = 64 };

typedef struct {
    const tl_kernels *kern;
    tl_dtype dtype;
    int k, cols, rows, copies, threads;
    size_t matrix_bytes;
    const uint8_t *weights; /* [copies][matrix_bytes] */
    const float *x;         /* [rows][k] */
    float *tiles;           /* [rows * k]: x arranged (tl_kernels.arrange_rows), per call */
    const float *arranged;  /* tiles when this call's x was arranged, else NULL */
    const tl_qrows *xq;
    float *y;               /* [rows][cols] */
    tl_pool *pool;          /* threads workers (the caller included) */
    int call;               /* the copy the next timed call reads */
} bench_job;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Thread t's columns: contiguous whole panels, as the pool splits a product. */
static void columns_of(const bench_job *job, int t, int *o0, int *o1) {
    const int panels = (job->cols + TL_PANEL - 1) / TL_PANEL;
    *o0 = panels * t / job->threads * TL_PANEL;
    *o1 = panels * (t + 1) / job->threads * TL_PANEL;
    if (*o1 > job->cols) *o1 = job->cols;
}

static void run_part(bench_job *job, int t) {
    int o0, o1;
    columns_of(job, t, &o0, &o1);
    if (o0 >= o1) return;
    const void *w = job->weights + (size_t)job->call * job->matrix_bytes;
    if (tl_dtype_quantised(job->dtype))
        job->kern->qmatmul_packed(job->xq, job->rows, job->k, w, job->dtype, NULL, o0, o1, job->y, job->cols);
    else if (job->arranged)
        job->kern->matmul_packed_arranged(job->x, job->arranged, job->rows, job->k, w, job->dtype, NULL, o0, o1,
                                          job->y, job->cols);
    else
        job->kern->matmul_packed(job->x, job->rows, job->k, w, job->dtype, NULL, o0, o1, job->y, job->cols);
}

/* Task t: thread t's columns (tasks are claimed by whichever thread is free, as in the engine). */
static void part_task(void *ctx, int task, int thread) {
    (void)thread;
    run_part(ctx, task);
}

/* One timed call over every thread's columns, reading the next copy of the matrix. */
static double timed_call(bench_job *job) {
    const double t0 = now_s();
    /* Float rows arranged for the family's multi-row tiles once per call, as the engine
       does once per product (cpu_backend.c), and timed with it. */
    job->arranged = !tl_dtype_quantised(job->dtype) && job->kern->arrange_rows &&
                            job->kern->arrange_rows(job->x, job->rows, job->k, job->dtype, 0, job->k, job->tiles)
                        ? job->tiles
                        : NULL;
    tl_pool_run(job->pool, job->threads, part_task, job);
    const double elapsed = now_s() - t0;
    job->call = (job->call + 1) % job->copies;
    return elapsed;
}

static int compare_doubles(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int parse_list(const char *s, int *out) {
    int n = 0;
    for (char *end; *s && n < MAX_LIST; s = *end ? end + 1 : end) {
        long v = strtol(s, &end, 10);
        /* a number, then a comma or the end ("1.5" read as rows 1 and 5, "1x4" as 1 and 4) */
        if (end == s || v < 1 || v > 4096 || (*end && *end != ',') || (*end == ',' && !end[1])) return -1;
        out[n++] = (int)v;
    }
    return n;
}

static uint32_t rng_state = 12345u;
static uint32_t next_random(void) {
    rng_state = rng_state * 1664525u + 1013904223u;
    return rng_state >> 8;
}

/* A packed matrix of random values in `dtype` (weights in [-0.125, 0.125); q8/q4: random
   integers with random small f16 scales), matrix_bytes long. */
static void fill_matrix(uint8_t *w, size_t bytes, tl_dtype dtype) {
    if (dtype == TL_F32) {
        for (size_t i = 0; i + 4 <= bytes; i += 4) {
            const float v = ((float)next_random() / 16777216.0f - 0.5f) * 0.25f;
            memcpy(w + i, &v, 4);
        }
    } else if (dtype == TL_F16 || dtype == TL_BF16) {
        for (size_t i = 0; i + 2 <= bytes; i += 2) {
            const float v = ((float)next_random() / 16777216.0f - 0.5f) * 0.25f;
            uint32_t bits;
            memcpy(&bits, &v, 4);
            const uint16_t h = dtype == TL_F16 ? tl_f32_to_f16(v) : (uint16_t)(bits >> 16);
            memcpy(w + i, &h, 2);
        }
    } else {
        const size_t bb = tl_qblock_bytes(dtype);
        for (size_t b = 0; b < bytes; b++) w[b] = (uint8_t)next_random();
        for (size_t blk = 0; blk + bb <= bytes; blk += bb)
            for (int l = 0; l < TL_PANEL; l++) {
                const uint16_t h = tl_f32_to_f16((float)next_random() / 16777216.0f * 0.02f);
                memcpy(w + blk + tl_qscale_offset(dtype) + 2 * (size_t)l, &h, 2);
            }
    }
}

static int usage(const char *why) {
    if (why) fprintf(stderr, "tinyloop-kernel-bench: %s\n", why);
    fprintf(stderr, "usage: tinyloop-kernel-bench [--k 768] [--cols 3072] [--mb 0] [--rows 1,2,4,6,8,12,16]\n"
                    "                             [--dtype f16,q8,q4] [--isa LIST] [--threads 1] [--repeat 15]\n"
                    "                             [--f16-halves auto|0|1] [--pair-tiles auto|0|1]\n"
                    "  --isa LIST   of generic, avx2, avx512, avx512-vnni (default: those this CPU runs,\n"
                    "               generic left out)\n"
                    "  --dtype LIST of f32, f16, bf16, q8, q4 (q8/q4 need k a multiple of 32)\n"
                    "  --f16-halves auto|0|1  AVX-512's single row of f16 weights converted 8 lanes at a\n"
                    "               time (1) or 16 (0); auto: the CPU's choice (halves on AMD family 19h)\n"
                    "  --pair-tiles auto|0|1  AVX-512's 6 rows and more of f16/bf16 weights in two-panel\n"
                    "               tiles (1) or one-panel tiles of 4 rows (0; the last 5 or 6 whole); auto:\n"
                    "               the CPU's choice (one-panel on AMD family 19h)\n");
    return 2;
}

int main(int argc, char **argv) {
    int k = 768, cols = 3072, threads = 1, repeat = 15, rows[MAX_LIST], n_rows;
    double mb = 0.0;
    const char *dtypes = "f16,q8,q4", *isas = NULL;
    n_rows = parse_list("1,2,4,6,8,12,16", rows);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help")) return usage(NULL), 0;
        if (!v) return usage("every option takes a value");
        i++;
        /* numbers read whole here; their ranges are checked below, with their messages */
        int *const whole = !strcmp(a, "--k") ? &k : !strcmp(a, "--cols") ? &cols : !strcmp(a, "--threads") ? &threads
                         : !strcmp(a, "--repeat") ? &repeat : NULL;
        const bool number_ok = whole ? bench_int(v, -1000000000, 1000000000, whole)
                             : !strcmp(a, "--mb") ? bench_number(v, -1e9, 1e9, &mb) : true;
        if (!number_ok) {
            fprintf(stderr, "tinyloop-kernel-bench: %s wants a number, got %s\n", a, v);
            return 2;
        }
        if (whole || !strcmp(a, "--mb")) continue;
        if (!strcmp(a, "--dtype")) dtypes = v;
        else if (!strcmp(a, "--isa")) isas = v;
        else if (!strcmp(a, "--f16-halves") || !strcmp(a, "--pair-tiles")) {
            if (strcmp(v, "auto") && strcmp(v, "0") && strcmp(v, "1"))
                return usage(!strcmp(a, "--f16-halves") ? "--f16-halves must be auto, 0 or 1" : "--pair-tiles must be auto, 0 or 1");
#if defined(__x86_64__)
            (!strcmp(a, "--f16-halves") ? tl_cpu_set_f16_halves : tl_cpu_set_pair_tiles)(!strcmp(v, "auto") ? -1 : atoi(v));
#endif
        }
        else if (!strcmp(a, "--rows")) {
            if ((n_rows = parse_list(v, rows)) <= 0) return usage("--rows: a comma-separated list of 1..4096");
        } else return usage("unknown option");
    }
    if (k < 1 || k > 1 << 20 || cols < 1 || cols > 1 << 22) return usage("--k and --cols must be positive");
    if (threads < 1 || threads > MAX_THREADS) return usage("--threads must be 1..64");
    if (repeat < 1 || repeat > 1000) return usage("--repeat must be 1..1000");
    if (mb < 0.0 || mb > 65536.0) return usage("--mb must be 0..65536");

    /* The instruction sets to run: asked for, or every one this CPU has. */
    const tl_kernels *families[4];
    int n_families = 0;
    const tl_kernels *known[] = {&tl_kernels_generic,
#if defined(__x86_64__)
                                 &tl_kernels_avx2, &tl_kernels_avx512, &tl_kernels_avx512_vnni
#endif
    };
    for (size_t f = 0; f < sizeof known / sizeof known[0]; f++) {
        bool wanted = isas ? false : f > 0;
        if (isas) {
            const size_t len = strlen(known[f]->isa);
            for (const char *p = isas; (p = strstr(p, known[f]->isa)); p += len)
                if ((p == isas || p[-1] == ',') && (p[len] == ',' || p[len] == 0)) wanted = true;
        }
        if (!wanted) continue;
        if (!tl_cpu_can_run(known[f])) {
            fprintf(stderr, "tinyloop-kernel-bench: this CPU cannot run %s\n", known[f]->isa);
            return 1;
        }
        families[n_families++] = known[f];
    }
    if (n_families == 0) return usage("--isa names none of generic, avx2, avx512, avx512-vnni");

    /* Every dtype named is known, and q8/q4 get whole groups, before anything runs (none, an
       empty --dtype, printed an empty table) */
    if (!*dtypes) return fprintf(stderr, "tinyloop-kernel-bench: --dtype names no type\n"), 2;
    for (const char *d = dtypes; *d;) {
        const size_t len = strcspn(d, ",");
        const bool quantised = (len == 2 && (!strncmp(d, "q8", 2) || !strncmp(d, "q4", 2)));
        const bool known_dtype = quantised || (len == 3 && (!strncmp(d, "f32", 3) || !strncmp(d, "f16", 3))) ||
                                 (len == 4 && !strncmp(d, "bf16", 4));
        if (!known_dtype) return fprintf(stderr, "tinyloop-kernel-bench: unknown dtype '%.*s'\n", (int)len, d), 2;
        if (quantised && k % TL_QGROUP) return fprintf(stderr, "tinyloop-kernel-bench: q8/q4 need k a multiple of 32\n"), 2;
        d += len + (d[len] == ',');
    }

    int max_rows = 0;
    for (int r = 0; r < n_rows; r++) max_rows = rows[r] > max_rows ? rows[r] : max_rows;
    float *x = malloc((size_t)max_rows * (size_t)k * sizeof(float));
    float *tiles = malloc((size_t)max_rows * (size_t)k * sizeof(float));
    float *y = malloc((size_t)max_rows * (size_t)cols * sizeof(float));
    int8_t *q8 = malloc((size_t)max_rows * (size_t)k);
    int16_t *q16 = malloc((size_t)max_rows * (size_t)k * sizeof(int16_t));
    const size_t n_groups = (size_t)max_rows * (size_t)(k / TL_QGROUP + 1);
    float *d8 = malloc(n_groups * sizeof(float)), *d16 = malloc(n_groups * sizeof(float));
    int32_t *sum8 = malloc(n_groups * sizeof(int32_t)), *sum16 = malloc(n_groups * sizeof(int32_t));
    if (!x || !tiles || !y || !q8 || !q16 || !d8 || !d16 || !sum8 || !sum16) return fprintf(stderr, "out of memory\n"), 1;
    for (size_t i = 0; i < (size_t)max_rows * (size_t)k; i++) x[i] = (float)next_random() / 16777216.0f - 0.5f;
    const tl_qrows xq = {q8, d8, sum8, q16, d16, sum16};

    tl_pool *pool = tl_pool_new(threads);
    if (!pool) return fprintf(stderr, "tinyloop-kernel-bench: cannot start %d threads\n", threads), 1;
    printf("k %d, cols %d, %d thread%s, median of %d runs%s\n", k, cols, threads, threads > 1 ? "s" : "", repeat,
           mb > 0.0 ? " (weights spread over copies, from memory)" : "");
    printf("%-12s %-5s %5s | %9s | %8s | %-19s\n", "isa", "dtype", "rows", "GFLOP/s", "GB/s", "GFLOP/s q1-q3");
    for (const char *d = dtypes; *d;) {
        const char *comma = strchr(d, ',');
        const size_t len = comma ? (size_t)(comma - d) : strlen(d);
        char name[8] = {0};
        memcpy(name, d, len < sizeof name - 1 ? len : sizeof name - 1);
        d += len + (comma ? 1 : 0);
        tl_dtype dtype;
        if (!strcmp(name, "f32")) dtype = TL_F32;
        else if (!strcmp(name, "f16")) dtype = TL_F16;
        else if (!strcmp(name, "bf16")) dtype = TL_BF16;
        else if (!strcmp(name, "q8")) dtype = TL_Q8;
        else if (!strcmp(name, "q4")) dtype = TL_Q4;
        else dtype = TL_Q4; /* checked above */
        if (tl_dtype_quantised(dtype)) {
            tl_cpu_quantize_rows(x, max_rows, k, 8, q8, d8, sum8);
            tl_cpu_quantize_rows(x, max_rows, k, 16, q16, d16, sum16);
        }
        const size_t matrix_bytes = (size_t)tl_panel_count(cols) * tl_panel_bytes(dtype, k);
        int copies = mb > 0.0 ? (int)(mb * 1e6 / (double)matrix_bytes) : 1;
        if (copies < 1) copies = 1;
        uint8_t *weights = aligned_alloc(64, ((size_t)copies * matrix_bytes + 63) / 64 * 64);
        if (!weights) {
            tl_pool_free(pool);
            return fprintf(stderr, "out of memory for %d copies of %zu bytes\n", copies, matrix_bytes), 1;
        }
        for (int c = 0; c < copies; c++) fill_matrix(weights + (size_t)c * matrix_bytes, matrix_bytes, dtype);
        for (int f = 0; f < n_families; f++)
            for (int r = 0; r < n_rows; r++) {
                bench_job job = {.kern = families[f], .dtype = dtype, .k = k, .cols = cols, .rows = rows[r],
                                 .copies = copies, .threads = threads, .matrix_bytes = matrix_bytes,
                                 .weights = weights, .x = x, .tiles = tiles, .xq = &xq, .y = y, .pool = pool};
                /* Calls per run: enough for ~20 ms, and a whole walk over the copies. */
                const double flop = 2.0 * rows[r] * (double)k * (double)cols;
                timed_call(&job); /* warm-up */
                double one = timed_call(&job);
                int calls = (int)(0.02 / (one > 1e-7 ? one : 1e-7)) + 1;
                if (calls < copies) calls = copies;
                double runs_s[1000];
                for (int run = 0; run < repeat; run++) {
                    double total = 0.0;
                    for (int c = 0; c < calls; c++) total += timed_call(&job);
                    runs_s[run] = total / calls;
                }
                qsort(runs_s, (size_t)repeat, sizeof(double), compare_doubles);
                const double median = runs_s[repeat / 2], q1 = runs_s[repeat / 4], q3 = runs_s[(3 * repeat) / 4];
                printf("%-12s %-5s %5d | %9.1f | %8.1f | %8.1f - %-8.1f\n", families[f]->isa, name, rows[r],
                       flop / median * 1e-9, (double)matrix_bytes / median * 1e-9, flop / q3 * 1e-9, flop / q1 * 1e-9);
            }
        free(weights);
    }
    free(x);
    free(tiles);
    free(y);
    free(q8);
    free(q16);
    free(d8);
    free(d16);
    free(sum8);
    free(sum16);
    tl_pool_free(pool);
    return bench_output_status("tinyloop-kernel-bench");
}

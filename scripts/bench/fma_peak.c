/* fma_peak.c: tinyloop-fma-peak, the cores' multiply-add rate, a yardstick for the kernels'
 * GFLOP/s (tinyloop-kernel-bench, tinyloop-bench's prefill): 12 independent chains of
 * vfmadd231ps per thread, 512-bit where the CPU has AVX-512, else 256-bit (FMA3), run on 1
 * to N threads at once; and the same chains with each multiplicand converted from f16 first,
 * the bound of a one-row f16 matmul from cache where conversions and FMAs share ports (on
 * AVX-512 CPUs at both widths: Zen 4 converts 256 bits at a time at twice the rate).
 *   build/scripts/bench/tinyloop-fma-peak [--threads 1,2] [--millions 200]
 * The loop is inline assembly because a compiler folds chains whose values it can prove
 * equal: a C version with 12 accumulators started alike compiled to one chain, and its
 * "peak" was 12 x one chain's latency-bound rate (stop 45's note reported that figure). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu/kernels.h"

#if defined(__x86_64__)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* 12 chains, each one FMA per iteration, on registers REG0..REG11 of width R ("zmm" or
   "ymm"); operands zero (no denormals, no overflow). The VEX vxorps of xmm0 zeroes the
   whole register at either width. */
#define FMA(R, n) "vfmadd231ps %%" R "12, %%" R "13, %%" R #n "\n\t"
#define CHAINS(R, iterations)                                                                                   \
    __asm__ volatile("vxorps %%xmm0, %%xmm0, %%xmm0\n\t"                                                      \
                     "vmovaps %%" R "0, %%" R "1\n\t vmovaps %%" R "0, %%" R "2\n\t vmovaps %%" R "0, %%" R "3\n\t" \
                     "vmovaps %%" R "0, %%" R "4\n\t vmovaps %%" R "0, %%" R "5\n\t vmovaps %%" R "0, %%" R "6\n\t" \
                     "vmovaps %%" R "0, %%" R "7\n\t vmovaps %%" R "0, %%" R "8\n\t vmovaps %%" R "0, %%" R "9\n\t" \
                     "vmovaps %%" R "0, %%" R "10\n\t vmovaps %%" R "0, %%" R "11\n\t"                             \
                     "vmovaps %%" R "0, %%" R "12\n\t vmovaps %%" R "0, %%" R "13\n\t"                             \
                     "1:\n\t" FMA(R, 0) FMA(R, 1) FMA(R, 2) FMA(R, 3) FMA(R, 4) FMA(R, 5) FMA(R, 6) FMA(R, 7)    \
                         FMA(R, 8) FMA(R, 9) FMA(R, 10) FMA(R, 11) "dec %0\n\t jnz 1b\n\t vzeroupper"            \
                     : "+r"(iterations)                                                                         \
                     :                                                                                          \
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",  \
                       "xmm11", "xmm12", "xmm13", "cc")

/* The same 12 chains with each FMA's multiplicand converted from f16 first (vcvtph2ps from
   memory, as a one-row f16 matmul converts every weight it multiplies: one conversion per
   FMA). Where the conversion shares the FMA's ports (Zen 4) this rate, not the FMA's, bounds
   a single row of f16 weights read from cache. `halves` holds 16 zero halves. */
#define CONVERTED_FMA(R, n) "vcvtph2ps (%1), %%" R "14\n\t vfmadd231ps %%" R "14, %%" R "13, %%" R #n "\n\t"
#define CONVERTED_CHAINS(R, iterations, halves)                                                                 \
    __asm__ volatile("vxorps %%xmm0, %%xmm0, %%xmm0\n\t"                                                      \
                     "vmovaps %%" R "0, %%" R "1\n\t vmovaps %%" R "0, %%" R "2\n\t vmovaps %%" R "0, %%" R "3\n\t" \
                     "vmovaps %%" R "0, %%" R "4\n\t vmovaps %%" R "0, %%" R "5\n\t vmovaps %%" R "0, %%" R "6\n\t" \
                     "vmovaps %%" R "0, %%" R "7\n\t vmovaps %%" R "0, %%" R "8\n\t vmovaps %%" R "0, %%" R "9\n\t" \
                     "vmovaps %%" R "0, %%" R "10\n\t vmovaps %%" R "0, %%" R "11\n\t"                             \
                     "vmovaps %%" R "0, %%" R "13\n\t"                                                              \
                     "1:\n\t" CONVERTED_FMA(R, 0) CONVERTED_FMA(R, 1) CONVERTED_FMA(R, 2) CONVERTED_FMA(R, 3)        \
                         CONVERTED_FMA(R, 4) CONVERTED_FMA(R, 5) CONVERTED_FMA(R, 6) CONVERTED_FMA(R, 7)            \
                             CONVERTED_FMA(R, 8) CONVERTED_FMA(R, 9) CONVERTED_FMA(R, 10) CONVERTED_FMA(R, 11)      \
                                 "dec %0\n\t jnz 1b\n\t vzeroupper"                                                \
                     : "+r"(iterations)                                                                         \
                     : "r"(halves)                                                                              \
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",  \
                       "xmm11", "xmm13", "xmm14", "cc", "memory")

static const unsigned short zero_halves[16] __attribute__((aligned(64)));

__attribute__((target("avx512f"))) static void chains512(long iterations) { CHAINS("zmm", iterations); }
__attribute__((target("avx2,fma"))) static void chains256(long iterations) { CHAINS("ymm", iterations); }
__attribute__((target("avx512f"))) static void converted512(long iterations) { CONVERTED_CHAINS("zmm", iterations, zero_halves); }
__attribute__((target("avx2,fma,f16c"))) static void converted256(long iterations) { CONVERTED_CHAINS("ymm", iterations, zero_halves); }

typedef struct { long iterations; int wide, converted; } job;

static void *run(void *arg) {
    const job *j = arg;
    if (j->converted) {
        if (j->wide) converted512(j->iterations);
        else converted256(j->iterations);
    } else if (j->wide) chains512(j->iterations);
    else chains256(j->iterations);
    return NULL;
}

/* GFLOP/s of `threads` threads running job j at once; 0 when a thread would not start. */
static double measure(long threads, job j) {
    pthread_t tid[256];
    int started = 0;
    const double t0 = now();
    for (; started < threads; started++)
        if (pthread_create(&tid[started], NULL, run, &j) != 0) break;
    for (int i = 0; i < started; i++) pthread_join(tid[i], NULL);
    const double seconds = now() - t0;
    if (started < threads) {
        fprintf(stderr, "tinyloop-fma-peak: could start only %d of %ld threads\n", started, threads);
        return 0.0;
    }
    return (double)threads * (double)j.iterations * 12.0 * (j.wide ? 16 : 8) * 2.0 / seconds / 1e9;
}

static int usage(FILE *fp, int code) {
    fputs("usage: tinyloop-fma-peak [--threads LIST] [--millions N]\n"
          "  --threads LIST  comma-separated thread counts (default 1,2)\n"
          "  --millions N    iterations per thread, in millions, each 12 FMAs (default 200)\n", fp);
    return code;
}

int main(int argc, char **argv) {
    const char *list = "1,2";
    long millions = 200;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return usage(stdout, 0);
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) list = argv[++i];
        else if (!strcmp(argv[i], "--millions") && i + 1 < argc) {
            char *end;
            millions = strtol(argv[++i], &end, 10);
            if (*end || millions < 1 || millions > 100000) {
                fprintf(stderr, "tinyloop-fma-peak: --millions needs a number in [1, 100000], got \"%s\"\n", argv[i]);
                return 2;
            }
        } else return usage(stderr, 2);
    }
    /* The kernels' own rule (the AVX2 family: AVX2, FMA and F16C, whose conversions the
       second column needs; the AVX-512 family on top of it) */
    const int wide = tl_cpu_can_run(&tl_kernels_avx512);
    if (!wide && !tl_cpu_can_run(&tl_kernels_avx2)) {
        fprintf(stderr, "tinyloop-fma-peak: this CPU runs neither the AVX-512 nor the AVX2 kernels (AVX2, FMA, F16C)\n");
        return 1;
    }
    printf("%d-bit FMA, 12 independent chains a thread, %ld M iterations each; then the same chains with\n"
           "each FMA's multiplicand converted from f16 first (vcvtph2ps), as a one-row f16 matmul converts\n"
           "every weight: %s\n",
           wide ? 512 : 256, millions,
           wide ? "512-bit conversions and FMAs, then 256-bit ones (a CPU whose 512-bit conversion\n"
                  "runs at half the rate, Zen 4, is faster in halves: the AVX-512 kernels' one row of f16)"
                : "256-bit conversions and FMAs");
    if (wide) printf("%12s| %19s | %19s | %19s\n", "", "FMA peak", "fed by 512-bit cvt", "fed by 256-bit cvt");
    else printf("%12s| %19s | %19s\n", "", "FMA peak", "fed by 256-bit cvt");
    for (const char *p = list; *p;) {
        char *end;
        const long threads = strtol(p, &end, 10);
        if (end == p || threads < 1 || threads > 256 || (*end && *end != ',')) {
            fprintf(stderr, "tinyloop-fma-peak: --threads: a comma-separated list of counts in [1, 256], got \"%s\"\n", list);
            return 2;
        }
        p = *end ? end + 1 : end;
        const long iterations = millions * 1000000L;
        const double peak = measure(threads, (job){iterations, wide, 0});
        const double converted = peak > 0 ? measure(threads, (job){iterations, wide, 1}) : 0;
        if (peak <= 0 || converted <= 0) return 1;
        printf("threads %3ld | %11.1f GFLOP/s | %11.1f GFLOP/s", threads, peak, converted);
        if (wide) { /* the same conversions 256 bits at a time */
            const double narrow = measure(threads, (job){iterations, 0, 1});
            if (narrow <= 0) return 1;
            printf(" | %11.1f GFLOP/s", narrow);
        }
        putchar('\n');
    }
    return 0;
}
#else
int main(void) {
    fprintf(stderr, "tinyloop-fma-peak: x86-64 only\n");
    return 1;
}
#endif

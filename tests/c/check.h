/* check.h: minimal assertion helpers for the C tests. Each test program prints one line
 * per failure and closes with "N passed, M failed"; its exit code is the failure count. */
#ifndef TL_TEST_CHECK_H
#define TL_TEST_CHECK_H

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

/* Atomic: tests that run checks on several threads (test_batch) count them all, race-free. */
static _Atomic int checks_passed, checks_failed;

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (cond) {                                                             \
            checks_passed++;                                                    \
        } else {                                                                \
            checks_failed++;                                                    \
            printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);              \
            printf(__VA_ARGS__);                                                \
            printf("\n");                                                       \
        }                                                                       \
    } while (0)

/* A call must fail with `status` and a tl_last_error() containing `needle`. */
#define CHECK_ERROR(call, status, needle)                                       \
    do {                                                                        \
        tl_status st_ = (call);                                                 \
        const char *msg_ = tl_last_error();                                     \
        CHECK(st_ == (status) && strstr(msg_, (needle)) != NULL,                \
              "got %s \"%s\", want %s containing \"%s\"", tl_status_name(st_),  \
              msg_, tl_status_name(status), (needle));                          \
    } while (0)

/* How many bytes of the files at path_a and path_b differ (each byte past the shorter one's
   end counts), with the longer length in *bytes; -1 when either cannot be opened. */
static inline long check_files_differ(const char *path_a, const char *path_b, long *bytes) {
    FILE *a = fopen(path_a, "rb"), *b = fopen(path_b, "rb");
    long differ = a && b ? 0 : -1;
    *bytes = 0;
    if (a && b)
        for (int ca = fgetc(a), cb = fgetc(b); ca != EOF || cb != EOF; ca = fgetc(a), cb = fgetc(b), (*bytes)++)
            differ += ca != cb;
    if (a) fclose(a);
    if (b) fclose(b);
    return differ;
}

static inline int check_summary(void) {
    printf("%d passed, %d failed\n", checks_passed, checks_failed);
    return checks_failed ? 1 : 0;
}

#endif

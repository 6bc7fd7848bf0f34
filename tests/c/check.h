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

static inline int check_summary(void) {
    printf("%d passed, %d failed\n", checks_passed, checks_failed);
    return checks_failed ? 1 : 0;
}

#endif

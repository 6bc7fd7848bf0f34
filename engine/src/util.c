/* util.c: error reporting, aligned memory and the clock shared by the engine. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

/* ---------------------------------------------------------------- errors */

/* One message per thread: concurrent sessions must not see each other's errors. */
static _Thread_local char last_error[1024];

tl_status tl_fail(tl_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

void tl_clear_error(void) { last_error[0] = '\0'; }

const char *tl_last_error(void) { return last_error; }

const char *tl_status_name(tl_status status) {
    switch (status) {
    case TL_OK: return "TL_OK";
    case TL_ERR_INVALID_ARGUMENT: return "TL_ERR_INVALID_ARGUMENT";
    case TL_ERR_IO: return "TL_ERR_IO";
    case TL_ERR_FORMAT: return "TL_ERR_FORMAT";
    case TL_ERR_NO_MEMORY: return "TL_ERR_NO_MEMORY";
    case TL_ERR_UNSUPPORTED: return "TL_ERR_UNSUPPORTED";
    case TL_ERR_HOOK: return "TL_ERR_HOOK";
    case TL_ERR_INTERNAL: return "TL_ERR_INTERNAL";
    default: return "TL_ERR_UNKNOWN";
    }
}

const char *tl_version(void) { return TINYLOOP_VERSION; }

/* ---------------------------------------------------------------- memory / time */

void *tl_alloc_aligned(size_t bytes) {
    void *p = NULL;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded == 0) rounded = 64;
    if (posix_memalign(&p, 64, rounded) != 0) return NULL;
    memset(p, 0, rounded);
    return p;
}

void tl_free_aligned(void *ptr) { free(ptr); }

double tl_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

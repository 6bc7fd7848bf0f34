/* clock_shim: an LD_PRELOAD library that steps the wall clock. gettimeofday, time and
   clock_gettime's CLOCK_REALTIME clocks answer the real time plus the seconds written in the
   file $TL_CLOCK_SHIM_FILE names (read at each call: a test writes it while a server runs);
   the monotonic clocks are left alone. server_spec runs nginx under it to step the clock back
   while requests wait, as an NTP step or `date -s` does. The path is taken when the library
   loads, in nginx's master: nginx clears the environment of the workers it forks. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

static char offset_path[4096];

__attribute__((constructor)) static void take_path(void) {
    const char *path = getenv("TL_CLOCK_SHIM_FILE");
    if (path && strlen(path) < sizeof offset_path) strcpy(offset_path, path);
}

static long offset_seconds(void) {
    long seconds = 0;
    if (!offset_path[0]) return 0;
    FILE *f = fopen(offset_path, "r");
    if (f) {
        if (fscanf(f, "%ld", &seconds) != 1) seconds = 0;
        fclose(f);
    }
    return seconds;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    static int (*real)(struct timeval *restrict, void *restrict);
    if (!real) real = (int (*)(struct timeval *restrict, void *restrict))dlsym(RTLD_NEXT, "gettimeofday");
    int r = real(tv, tz);
    if (r == 0) tv->tv_sec += offset_seconds();
    return r;
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int r = real(clock, ts);
    if (r == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE)) ts->tv_sec += offset_seconds();
    return r;
}

time_t time(time_t *out) {
    struct timeval now;
    if (gettimeofday(&now, NULL) != 0) return (time_t)-1;
    if (out) *out = now.tv_sec;
    return now.tv_sec;
}

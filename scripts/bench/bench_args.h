/* bench_args.h: a benchmark's numbers from its command line, read whole and checked against
   their range: atoi read "abc" as 0 and "2x" as 2, atof let "nan" through a range check (every
   comparison with NaN is false); and its exit status once its figures are printed. One rule
   for the tools of scripts/bench and scripts/tools. */
#ifndef TL_BENCH_ARGS_H
#define TL_BENCH_ARGS_H

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A benchmark's exit status once its figures are printed: 1, said on stderr, where stdout
   could not take them all (a full disk, a reader gone with SIGPIPE ignored: `> /dev/full`
   exited 0), since the figures are the run's result. */
static inline int bench_output_status(const char *tool) {
    if (fflush(stdout) == 0 && !ferror(stdout)) return 0;
    fprintf(stderr, "%s: writing the output failed: %s\n", tool, strerror(errno));
    return 1;
}

/* A whole number in [lo, hi], all of `text`. */
static inline bool bench_long(const char *text, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    const long v = strtol(text, &end, 10);
    if (end == text || *end || errno || v < lo || v > hi) return false;
    *out = v;
    return true;
}

static inline bool bench_int(const char *text, int lo, int hi, int *out) {
    long v;
    if (!bench_long(text, lo, hi, &v)) return false;
    *out = (int)v;
    return true;
}

/* A number in [lo, hi] (NaN is in no range), all of `text`. */
static inline bool bench_number(const char *text, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    const double v = strtod(text, &end);
    if (end == text || *end || errno || !(v >= lo && v <= hi)) return false;
    *out = v;
    return true;
}

/* An option of `names` [n_names] that takes a value, given as NAME VALUE or NAME=VALUE at
   argv[*i]: its index in names, its value in *value (NULL where the command line ends before
   it) and *i past what it took; -1 where argv[*i] is none of them. (--threads=2 was an
   unknown option where --type=q4 was taken: one rule for every tool.) */
static inline int bench_value_option(int argc, char **argv, int *i, const char *const *names, int n_names,
                                     const char **value) {
    for (int k = 0; k < n_names; k++) {
        const size_t len = strlen(names[k]);
        if (strncmp(argv[*i], names[k], len) || (argv[*i][len] != '\0' && argv[*i][len] != '=')) continue;
        *value = argv[*i][len] == '=' ? argv[*i] + len + 1 : *i + 1 < argc ? argv[++*i] : NULL;
        return k;
    }
    return -1;
}

#endif

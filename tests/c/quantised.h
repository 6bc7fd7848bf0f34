/* quantised.h: q8 / q4 copies of golden checkpoints for the bit-exact tests, written under
 * one temporary directory that is removed at exit. */
#ifndef TL_TEST_QUANTISED_H
#define TL_TEST_QUANTISED_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "quant.h"

char *mkdtemp(char *templ); /* POSIX.1-2008; the tests build as plain C11 */

static char quantised_root[256];

static void quantised_cleanup(void) {
    if (!quantised_root[0]) return;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", quantised_root);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", quantised_root);
}

/* Writes "<name>" quantised to `type` as <tmp>/<q8|q4>/<name>; returns that root (to use in
   place of the golden root), or NULL after printing why. */
static const char *quantised_copy(const char *golden_root, const char *name, tl_dtype type) {
    static char roots[2][512];
    if (!quantised_root[0]) {
        snprintf(quantised_root, sizeof quantised_root, "/tmp/tinyloop-test-q-XXXXXX");
        if (!mkdtemp(quantised_root)) { quantised_root[0] = '\0'; printf("mkdtemp failed\n"); return NULL; }
        atexit(quantised_cleanup);
    }
    const int slot = type == TL_Q8 ? 0 : 1;
    char in[4096], out[4096];
    snprintf(roots[slot], sizeof roots[slot], "%s/%s", quantised_root, slot ? "q4" : "q8");
    mkdir(roots[slot], 0777);
    snprintf(in, sizeof in, "%s/%s", golden_root, name);
    snprintf(out, sizeof out, "%s/%s", roots[slot], name);
    if (tl_quantize_checkpoint(in, out, type) != TL_OK) {
        printf("quantise %s: %s\n", name, tl_last_error());
        return NULL;
    }
    return roots[slot];
}

#endif

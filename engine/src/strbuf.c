/* strbuf.c: a growing NUL-terminated text (strbuf.h). */
#include "strbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void tl_strbuf_put(strbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap < b->n + n + 1) cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) { b->oom = true; return; }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void tl_strbuf_puts(strbuf *b, const char *s) { tl_strbuf_put(b, s, strlen(s)); }

void tl_strbuf_printf(strbuf *b, const char *fmt, ...) {
    char small[512];
    va_list ap;
    va_start(ap, fmt);
    const int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) { tl_strbuf_put(b, small, (size_t)n); return; }
    char *big = malloc((size_t)n + 1);
    if (!big) { b->oom = true; return; }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    tl_strbuf_put(b, big, (size_t)n);
    free(big);
}

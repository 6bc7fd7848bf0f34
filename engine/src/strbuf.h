/* strbuf.h: a growing NUL-terminated text (internal), for code that writes text piece by
 * piece (the GBNF that JSON Schema and regular expressions compile to).
 *
 * Out of memory is sticky: the first failed growth sets `oom` and every later write is a
 * no-op, so a writer checks once at the end instead of after every piece. */
#ifndef TL_STRBUF_H
#define TL_STRBUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct strbuf {
    char *p; /* NULL until the first write; free() it */
    size_t n, cap;
    bool oom;
} strbuf;

void tl_strbuf_put(strbuf *b, const char *s, size_t n);
void tl_strbuf_puts(strbuf *b, const char *s);
void tl_strbuf_printf(strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif

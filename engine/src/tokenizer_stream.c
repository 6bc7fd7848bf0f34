/* Streaming detokenizer: turns ids into text one token at a time without
 * ever showing half a character. A byte-level BPE token can end in the
 * middle of a UTF-8 sequence (GPT-2 splits most emoji and many CJK characters
 * across tokens), so the tail of a token may have to wait for the next one.
 */
#include "tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tl_tlz_stream {
    const tl_tlz_tokenizer *tok;
    unsigned char held[4]; /* unfinished code point: at most 3 bytes */
    size_t n_held;
    char *out;             /* what the last call returned */
    size_t cap;
};

int tl_tlz_stream_new(const tl_tlz_tokenizer *tok, tl_tlz_stream **out, char *err, size_t errlen)
{
    if (out) *out = NULL;
    if (!tok || !out) {
        if (err && errlen) snprintf(err, errlen, "tl_tlz_stream_new: NULL argument");
        return TLZ_EINVAL;
    }
    tl_tlz_stream *s = calloc(1, sizeof *s);
    if (!s) {
        if (err && errlen) snprintf(err, errlen, "out of memory creating a detokenizer stream");
        return TLZ_ENOMEM;
    }
    s->tok = tok;
    *out = s;
    return TLZ_OK;
}

int tl_tlz_stream_push(tl_tlz_stream *s, int32_t id, const char **out, size_t *len, char *err, size_t errlen)
{
    if (out) *out = NULL;
    if (len) *len = 0;
    if (!s || !out || !len) {
        if (err && errlen) snprintf(err, errlen, "tl_tlz_stream_push: NULL argument");
        return TLZ_EINVAL;
    }
    const char *bytes;
    size_t n;
    if (tl_tlz_token_bytes(s->tok, id, &bytes, &n) != TLZ_OK) {
        if (err && errlen)
            snprintf(err, errlen, "cannot decode token id %ld: not in the vocab (size %ld)", (long)id,
                     (long)tl_tlz_vocab_size(s->tok));
        return TLZ_EID;
    }
    size_t total = s->n_held + n;
    if (total + 1 > s->cap) {
        size_t cap = s->cap ? s->cap : 64;
        while (cap < total + 1) cap *= 2;
        char *p = realloc(s->out, cap);
        if (!p) {
            if (err && errlen) snprintf(err, errlen, "out of memory in the detokenizer stream");
            return TLZ_ENOMEM; /* the stream is unchanged: the caller may retry */
        }
        s->out = p;
        s->cap = cap;
    }
    memcpy(s->out, s->held, s->n_held);
    memcpy(s->out + s->n_held, bytes, n);
    size_t ready = total - tl_tlz_utf8_unfinished_tail((const unsigned char *)s->out, total);
    s->n_held = total - ready; /* <= 3: an unfinished sequence */
    memcpy(s->held, s->out + ready, s->n_held);
    s->out[ready] = '\0';
    *out = s->out;
    *len = ready;
    return TLZ_OK;
}

void tl_tlz_stream_flush(tl_tlz_stream *s, const char **out, size_t *len)
{
    static const char empty[1] = "";
    if (out) *out = empty;
    if (len) *len = 0;
    if (!s || !out || !len) return;
    /* held has room for a terminator; out may not be allocated yet. */
    s->held[s->n_held] = '\0';
    *out = (const char *)s->held;
    *len = s->n_held;
    s->n_held = 0;
}

void tl_tlz_stream_reset(tl_tlz_stream *s)
{
    if (s) s->n_held = 0;
}

void tl_tlz_stream_free(tl_tlz_stream *s)
{
    if (!s) return;
    free(s->out);
    free(s);
}

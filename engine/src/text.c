/* text.c: the public text API over the checkpoint's tokenizer (tokenizer.c). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tokenizer.h"

void tl_free(void *ptr) { free(ptr); }

static tl_status need_tokenizer(const tl_model *m, const char *what) {
    if (!m) return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: model must not be NULL", what);
    if (!m->tokenizer)
        return tl_fail(TL_ERR_UNSUPPORTED, "%s: the model at %s has no tokenizer.json (token ids only)",
                       what, m->dir);
    return TL_OK;
}

static tl_status from_tlz(int code, const char *err) {
    tl_status st = code == TLZ_ENOMEM ? TL_ERR_NO_MEMORY
                 : code == TLZ_EIO    ? TL_ERR_IO
                 : code == TLZ_EFORMAT ? TL_ERR_FORMAT
                                       : TL_ERR_INVALID_ARGUMENT;
    return tl_fail(st, "%s", err);
}

tl_status tl_encode_ex(const tl_model *m, const char *text, size_t len, unsigned flags, int32_t **ids, int *n_ids) {
    tl_clear_error(); /* "" after success, the message after a failure */
    if (ids) *ids = NULL; /* (every failure leaves no array behind, as the other calls' *out) */
    if (n_ids) *n_ids = 0;
    tl_status st = need_tokenizer(m, "tl_encode");
    if (st != TL_OK) return st;
    if ((!text && len) || !ids || !n_ids)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_encode: ids, n_ids and text (where len > 0) must not be NULL");
    if (flags & ~(unsigned)TL_ENCODE_SPECIAL_AS_TEXT)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_encode_ex: unknown flags 0x%x (TL_ENCODE_SPECIAL_AS_TEXT is 0x%x)",
                       flags & ~(unsigned)TL_ENCODE_SPECIAL_AS_TEXT, (unsigned)TL_ENCODE_SPECIAL_AS_TEXT);
    char err[512];
    size_t n = 0;
    *ids = NULL;
    const unsigned tl_tlz_flags = (flags & TL_ENCODE_SPECIAL_AS_TEXT) ? TLZ_ENCODE_NO_SPECIAL : 0;
    int code = tl_tlz_encode_ex(m->tokenizer, text ? text : "", len, tl_tlz_flags, ids, &n, err, sizeof err);
    if (code != 0) return from_tlz(code, err);
    if (n > (size_t)INT32_MAX) { free(*ids); *ids = NULL; return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_encode: text too long"); }
    *n_ids = (int)n;
    return TL_OK;
}

tl_status tl_encode(const tl_model *m, const char *text, size_t len, int32_t **ids, int *n_ids) {
    return tl_encode_ex(m, text, len, 0, ids, n_ids);
}

tl_status tl_decode(const tl_model *m, const int32_t *ids, int n, char **text, size_t *len) {
    tl_clear_error(); /* "" after success, the message after a failure */
    if (text) *text = NULL; /* (a failure leaves no text behind, as tl_encode_ex leaves no ids) */
    tl_status st = need_tokenizer(m, "tl_decode");
    if (st != TL_OK) return st;
    if (!text) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_decode: text must not be NULL");
    if (n < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_decode: n = %d must be >= 0", n);
    if (!ids && n) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_decode: ids must not be NULL where n = %d > 0", n);
    char err[512];
    size_t got = 0;
    int code = tl_tlz_decode(m->tokenizer, ids, (size_t)n, text, &got, err, sizeof err);
    if (code != 0) return from_tlz(code, err);
    if (len) *len = got;
    return TL_OK;
}

tl_status tl_token_text(const tl_model *m, int32_t id, const char **bytes, size_t *len) {
    tl_clear_error(); /* "" after success, the message after a failure */
    tl_status st = need_tokenizer(m, "tl_token_text");
    if (st != TL_OK) return st;
    if (!bytes || !len) return tl_fail_null("tl_token_text", 2, "bytes", (const void *)bytes, "len", (const void *)len);
    if (tl_tlz_token_bytes(m->tokenizer, id, bytes, len) != 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_token_text: token id %d has no text", (int)id);
    return TL_OK;
}

int tl_token_is_special(const tl_model *m, int32_t id) {
    return m && m->tokenizer && tl_tlz_is_special(m->tokenizer, id) ? 1 : 0;
}

struct tl_detokenizer {
    tl_tlz_stream *stream;
};

tl_status tl_detokenizer_new(const tl_model *m, tl_detokenizer **out) {
    tl_clear_error(); /* "" after success, the message after a failure */
    if (out) *out = NULL;
    tl_status st = need_tokenizer(m, "tl_detokenizer_new");
    if (st != TL_OK) return st;
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_detokenizer_new: out must not be NULL");
    *out = calloc(1, sizeof **out);
    char err[512];
    if (!*out) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    int code = tl_tlz_stream_new(m->tokenizer, &(*out)->stream, err, sizeof err);
    if (code != 0) {
        free(*out);
        *out = NULL;
        return from_tlz(code, err);
    }
    return TL_OK;
}

tl_status tl_detokenizer_push(tl_detokenizer *d, int32_t id, const char **piece, size_t *len) {
    tl_clear_error(); /* "" after success, the message after a failure */
    if (!d || !piece || !len)
        return tl_fail_null("tl_detokenizer_push", 3, "d", (const void *)d, "piece", (const void *)piece, "len",
                            (const void *)len);
    char err[512];
    int code = tl_tlz_stream_push(d->stream, id, piece, len, err, sizeof err);
    return code ? from_tlz(code, err) : TL_OK;
}

void tl_detokenizer_flush(tl_detokenizer *d, const char **piece, size_t *len) {
    if (!d) {
        if (piece) *piece = "";
        if (len) *len = 0;
        return;
    }
    tl_tlz_stream_flush(d->stream, piece, len);
}

void tl_detokenizer_free(tl_detokenizer *d) {
    if (!d) return;
    tl_tlz_stream_free(d->stream);
    free(d);
}

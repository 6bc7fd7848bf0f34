/* fuzz_tokenizer.c: libFuzzer target for tokenizer.json loading and the encode/decode round
 * trip. The first byte picks the mode:
 *   odd:  the rest is a tokenizer.json document: load it (never a crash, a leak or a message-
 *         less failure); when it loads, encode a few texts, and every id encode returns must
 *         decode, and stream through the detokenizer to the same bytes;
 *   even: the rest is text for the GPT-2 tokenizer (loaded once): decode(encode(x)) == x for
 *         every byte string x, the streamed detokenizer gives the same bytes, and encoding
 *         without special tokens round-trips too. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"

#ifndef TL_FUZZ_DATA
#define TL_FUZZ_DATA "tests/data"
#endif

static tl_tlz_tokenizer *gpt2;

/* Encodes text, decodes the ids (and streams them); returns 0 when encoding failed. Aborts
   when an id from encode cannot be decoded, or when want_round_trip and the bytes differ. */
static int check(const tl_tlz_tokenizer *tok, const char *text, size_t len, unsigned flags, int want_round_trip) {
    char err[256];
    int32_t *ids = NULL;
    size_t n = 0;
    if (tl_tlz_encode_ex(tok, text, len, flags, &ids, &n, err, sizeof err) != 0) {
        if (!err[0]) abort();
        return 0;
    }
    char *back = NULL;
    size_t back_len = 0;
    if (tl_tlz_decode(tok, ids, n, &back, &back_len, err, sizeof err) != 0) abort();
    if (want_round_trip && (back_len != len || memcmp(back, text, len) != 0)) abort();
    /* The streamed detokenizer concatenates to the same bytes. */
    tl_tlz_stream *s = NULL;
    if (tl_tlz_stream_new(tok, &s, err, sizeof err) != 0) abort();
    char *streamed = malloc(back_len + 1);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        const char *piece;
        size_t plen;
        if (tl_tlz_stream_push(s, ids[i], &piece, &plen, err, sizeof err) != 0) abort();
        if (at + plen > back_len) abort();
        memcpy(streamed + at, piece, plen);
        at += plen;
    }
    const char *piece;
    size_t plen;
    tl_tlz_stream_flush(s, &piece, &plen);
    if (at + plen != back_len) abort();
    memcpy(streamed + at, piece, plen);
    if (memcmp(streamed, back, back_len) != 0) abort();
    free(streamed);
    tl_tlz_stream_free(s);
    free(back);
    free(ids);
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const char *rest = (const char *)data + 1;
    const size_t len = size - 1;
    char err[256];
    if (data[0] & 1) {
        tl_tlz_tokenizer *tok = NULL;
        if (tl_tlz_tokenizer_load_json(rest, len, &tok, err, sizeof err) != 0) {
            if (tok || !err[0]) abort();
            return 0;
        }
        static const char *const texts[] = {"", "hello world", "  a\n\tb", "<|endoftext|>x", "\xff\xfe\x80", "caf\xc3\xa9 \xe2\x82"};
        for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
            check(tok, texts[i], strlen(texts[i]), 0, 0);
        check(tok, rest, len < 64 ? len : 64, 0, 0);
        tl_tlz_tokenizer_free(tok);
        return 0;
    }
    if (!gpt2 && tl_tlz_tokenizer_load(TL_FUZZ_DATA "/gpt2/tokenizer.json", &gpt2, err, sizeof err) != 0) abort();
    if (!check(gpt2, rest, len, 0, 1)) abort();                       /* GPT-2 covers every byte */
    if (!check(gpt2, rest, len, TLZ_ENCODE_NO_SPECIAL, 1)) abort();
    return 0;
}

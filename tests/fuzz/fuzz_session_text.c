/* fuzz_session_text.c: libFuzzer target for tl_session_text with random stop strings. The
 * input gives up to three stop strings and the tokens to emit (forced through the
 * logits_processor on the small text checkpoint, greedy); after the session ends:
 *   - the pieces tl_session_text returned concatenate to the bytes of the emitted tokens
 *     (special tokens contribute none);
 *   - a stop string never occurs before the last token's bytes, and one ends inside them
 *     exactly when the stop reason is STOP_SEQUENCE;
 *   - no piece shown before the end reached into the match that stopped generation (the
 *     hold-back of possible stop-string prefixes).
 * Input: byte 0: number of stop strings (% 4) and how often to call tl_session_text; per stop
 * string a length byte (1 + % 8) and its bytes (NUL becomes 'x': NUL-containing strings are
 * refused by the Lua binding); then two bytes per token id (% vocab_size), at most 24. */
#include <stdlib.h>
#include <string.h>

#include "tinyloop.h"

#ifndef TL_FUZZ_DATA
#define TL_FUZZ_DATA "tests/data"
#endif

#define MAX_FORCED 24

static tl_model *model;

typedef struct { const int32_t *ids; int n, prompt_len; } forced;

static int force(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    (void)tokens;
    const forced *f = user;
    const int k = n - f->prompt_len;
    if (k < f->n) {
        for (int i = 0; i < vocab; i++) logits[i] = 0.0f;
        logits[f->ids[k]] = 1.0f;
    }
    return TL_HOOK_CONTINUE;
}

static int first_match(const char *text, size_t len, char stops[][9], const size_t *stop_lens, int n_stops,
                       size_t *start, size_t *end) {
    for (size_t e = 1; e <= len; e++) /* the earliest-ending occurrence */
        for (int i = 0; i < n_stops; i++)
            if (stop_lens[i] <= e && memcmp(text + e - stop_lens[i], stops[i], stop_lens[i]) == 0) {
                *start = e - stop_lens[i];
                *end = e;
                return 1;
            }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!model) {
        tl_load_options o;
        tl_load_options_init(&o);
        o.n_threads = 1;
        if (tl_model_load(TL_FUZZ_DATA "/textmodel", &o, &model) != TL_OK) abort();
    }
    if (size < 1) return 0;
    const int vocab = tl_model_info(model)->vocab_size;
    size_t at = 1;
    const int n_stops = data[0] % 4, text_every = 1 + (data[0] >> 2) % 3;
    char stops[3][9];
    size_t stop_lens[3];
    const char *stop_ptrs[3];
    for (int i = 0; i < n_stops; i++) {
        size_t L = at < size ? 1 + data[at++] % 8 : 1;
        for (size_t j = 0; j < L; j++) stops[i][j] = at < size ? (data[at] ? (char)data[at] : 'x') : 'e', at++;
        stops[i][L] = '\0';
        stop_lens[i] = L;
        stop_ptrs[i] = stops[i];
    }
    int32_t ids[MAX_FORCED];
    int n_ids = 0;
    for (; at + 1 < size && n_ids < MAX_FORCED; at += 2) ids[n_ids++] = (int32_t)((data[at] | data[at + 1] << 8) % vocab);
    if (n_ids == 0) return 0;

    const int32_t prompt[2] = {5, 6};
    forced f = {ids, n_ids, 2};
    tl_generate_config c;
    tl_generate_config_init(&c);
    c.max_tokens = n_ids;
    c.ignore_eos = 1;
    c.stop_strings = stop_ptrs;
    c.n_stop_strings = n_stops;
    c.logits_processor = force;
    c.logits_processor_user = &f;
    tl_session *s = NULL;
    if (tl_session_new(model, prompt, 2, &c, &s) != TL_OK) abort();
    char shown[MAX_FORCED * 64 + 1];
    size_t shown_len = 0, shown_before_last = 0;
    tl_stop_reason stop = TL_STOP_NONE;
    for (int step = 0; stop == TL_STOP_NONE; step++) {
        int32_t tok;
        shown_before_last = shown_len;
        if (tl_session_step(s, &tok, &stop) != TL_OK) abort();
        if (tok != ids[step]) abort(); /* the forcing works: the test tests what it claims */
        if (stop != TL_STOP_NONE || step % text_every == 0) {
            const char *piece;
            size_t len;
            if (tl_session_text(s, &piece, &len) != TL_OK || shown_len + len > sizeof shown) abort();
            memcpy(shown + shown_len, piece, len);
            shown_len += len;
        }
    }
    /* The expected text: every emitted token's bytes, but none for the special token (the
       checkpoint's only one is eos) nor for an id the tokenizer has no text for. */
    int n_out;
    const int32_t *out = tl_session_tokens(s, &n_out);
    char expect[MAX_FORCED * 64];
    size_t expect_len = 0, last_start = 0;
    for (int i = 2; i < n_out; i++) {
        const char *bytes;
        size_t blen;
        last_start = expect_len;
        if (out[i] == tl_model_info(model)->eos_token_id || tl_token_text(model, out[i], &bytes, &blen) != TL_OK) continue;
        if (expect_len + blen > sizeof expect) abort();
        memcpy(expect + expect_len, bytes, blen);
        expect_len += blen;
    }
    if (shown_len != expect_len || memcmp(shown, expect, expect_len) != 0) abort();
    size_t m_start, m_end;
    const int matched = first_match(expect, expect_len, stops, stop_lens, n_stops, &m_start, &m_end);
    if (matched && m_end <= last_start) abort();                 /* should have stopped earlier */
    if ((stop == TL_STOP_SEQUENCE) != matched) abort();
    if (stop != TL_STOP_SEQUENCE && stop != TL_STOP_MAX_TOKENS) abort();
    if (matched && shown_before_last > m_start) abort();         /* showed part of the match early */
    tl_session_free(s);
    return 0;
}

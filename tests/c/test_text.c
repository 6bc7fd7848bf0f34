/* test_text.c: the text API (encode, decode, streaming detokenizer) and stop strings in
 * the generation state machine, on a small checkpoint with its own byte-level BPE. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "tinyloop.h"

#define CAP 128
static tl_model *model;

/* Forces a scripted token sequence through a logits processor. */
typedef struct { const int32_t *script; int n, prompt_len; } script_t;
static int force(void *user, float *logits, int v, const int32_t *tokens, int n) {
    script_t *s = user;
    (void)tokens;
    for (int i = 0; i < v; i++) logits[i] = 0.0f;
    int step = n - s->prompt_len;
    logits[s->script[step < s->n ? step : s->n - 1]] = 50.0f;
    return TL_HOOK_CONTINUE;
}

static void test_encode_decode(void) {
    const char *text = "It is a truth universally acknowledged, that a single man\n\tin possession  "
                       "of a good fortune \xC3\xA9t\xC3\xA9 \xE2\x82\xAC 42!";
    int32_t *ids = NULL;
    int n = 0;
    CHECK(tl_encode(model, text, strlen(text), &ids, &n) == TL_OK && n > 10, "encode: %s", tl_last_error());
    char *back = NULL;
    size_t len = 0;
    CHECK(tl_decode(model, ids, n, &back, &len) == TL_OK && len == strlen(text) && memcmp(back, text, len) == 0,
          "decode(encode(x)) != x");
    tl_free(back);

    /* The streaming detokenizer never splits a UTF-8 sequence and concatenates to decode. */
    tl_detokenizer *d = NULL;
    CHECK(tl_detokenizer_new(model, &d) == TL_OK, "detokenizer");
    char joined[512] = "";
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        const char *piece;
        size_t plen;
        CHECK(tl_detokenizer_push(d, ids[i], &piece, &plen) == TL_OK, "push");
        for (size_t j = 0; j < plen && j < 1; j++)
            CHECK(((unsigned char)piece[0] & 0xC0) != 0x80, "a piece starts inside a UTF-8 sequence");
        memcpy(joined + at, piece, plen);
        at += plen;
    }
    const char *rest;
    size_t rlen;
    tl_detokenizer_flush(d, &rest, &rlen);
    memcpy(joined + at, rest, rlen);
    at += rlen;
    CHECK(at == strlen(text) && memcmp(joined, text, at) == 0, "streamed text differs");
    const int32_t e_acute[2] = {0xC3, 0xA9}; /* ids 0..255 are the single bytes */
    const char *piece;
    size_t plen;
    tl_detokenizer_push(d, e_acute[0], &piece, &plen);
    CHECK(plen == 0, "half a code point was emitted");
    tl_detokenizer_push(d, e_acute[1], &piece, &plen);
    CHECK(plen == 2 && memcmp(piece, "\xC3\xA9", 2) == 0, "completed code point not emitted");
    CHECK_ERROR(tl_detokenizer_push(d, 99999, &piece, &plen), TL_ERR_INVALID_ARGUMENT, "99999");
    CHECK_ERROR(tl_detokenizer_push(d, 5, NULL, &plen), TL_ERR_INVALID_ARGUMENT, "tl_detokenizer_push: piece must not be NULL");
    tl_detokenizer_free(d);
    tl_free(ids);

    const char *tok_bytes;
    size_t tok_len;
    CHECK(tl_token_text(model, 'a', &tok_bytes, &tok_len) == TL_OK && tok_len == 1 && tok_bytes[0] == 'a', "token text");
    CHECK_ERROR(tl_token_text(model, -3, &tok_bytes, &tok_len), TL_ERR_INVALID_ARGUMENT, "token id -3");
    /* a NULL named (it said "NULL argument" of two pointers) */
    CHECK_ERROR(tl_token_text(model, 5, &tok_bytes, NULL), TL_ERR_INVALID_ARGUMENT, "tl_token_text: len must not be NULL");
    CHECK_ERROR(tl_token_text(model, 5, NULL, &tok_len), TL_ERR_INVALID_ARGUMENT, "tl_token_text: bytes must not be NULL");
    CHECK_ERROR(tl_decode(model, (const int32_t[]){5, 4000}, 2, &back, &len), TL_ERR_INVALID_ARGUMENT, "4000");
    /* each fault named alone, and no text left behind by a failure */
    back = (char *)"stale";
    CHECK_ERROR(tl_decode(model, (const int32_t[]){5}, -1, &back, &len), TL_ERR_INVALID_ARGUMENT, "n = -1 must be >= 0");
    CHECK(back == NULL, "a failed tl_decode leaves *text NULL");
    CHECK_ERROR(tl_decode(model, NULL, 2, &back, &len), TL_ERR_INVALID_ARGUMENT, "ids must not be NULL where n = 2 > 0");
    CHECK_ERROR(tl_decode(model, NULL, 0, NULL, &len), TL_ERR_INVALID_ARGUMENT, "text must not be NULL");
    const char *flushed = "stale";
    size_t flushed_len = 9;
    tl_detokenizer_flush(NULL, &flushed, &flushed_len);
    CHECK(flushed && flushed[0] == 0 && flushed_len == 0, "flushing no detokenizer gives an empty piece");

    /* A special token's text: its token by default; with TL_ENCODE_SPECIAL_AS_TEXT, ordinary
       text (no control token in the ids, the same bytes back); unknown flags refused. */
    const char *with_special = "Emma<|endoftext|>Jane";
    const int32_t eos = tl_model_info(model)->eos_token_id;
    int has_eos = 0;
    CHECK(tl_encode_ex(model, with_special, strlen(with_special), 0, &ids, &n) == TL_OK, "%s", tl_last_error());
    for (int i = 0; i < n; i++) has_eos += ids[i] == eos;
    CHECK(has_eos == 1, "<|endoftext|> is its token by default (%d found)", has_eos);
    tl_free(ids);
    CHECK(tl_encode_ex(model, with_special, strlen(with_special), TL_ENCODE_SPECIAL_AS_TEXT, &ids, &n) == TL_OK, "%s",
          tl_last_error());
    has_eos = 0;
    for (int i = 0; i < n; i++) has_eos += ids[i] == eos || tl_token_is_special(model, ids[i]);
    CHECK(has_eos == 0 && n > 3, "TL_ENCODE_SPECIAL_AS_TEXT gave a special token (%d of %d)", has_eos, n);
    CHECK(tl_decode(model, ids, n, &back, &len) == TL_OK && len == strlen(with_special) && memcmp(back, with_special, len) == 0,
          "the special text read as text decodes to other bytes");
    tl_free(back);
    tl_free(ids);
    CHECK_ERROR(tl_encode_ex(model, "a", 1, 6, &ids, &n), TL_ERR_INVALID_ARGUMENT, "unknown flags 0x6");
}

/* A session of `prompt` whose logits processor forces sc's script (sc must outlive it), with
   stop strings, the end of text ignored, for max_tokens tokens; NULL (a failed check) if refused. */
static tl_session *forced_session(const int32_t *prompt, int np, script_t *sc, const char *const *stops, int n_stops,
                                  int max_tokens) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = max_tokens;
    cfg.logits_processor = force;
    cfg.logits_processor_user = sc;
    cfg.stop_strings = stops;
    cfg.n_stop_strings = n_stops;
    cfg.ignore_eos = 1;
    tl_session *s = NULL;
    CHECK(tl_session_new(model, prompt, np, &cfg, &s) == TL_OK, "session: %s", tl_last_error());
    return s;
}

/* Generates with a forced script; returns every piece tl_session_text showed, joined,
   and the length shown before the last step. */
static tl_stop_reason run_script(const char *prompt_text, const char *script_text, const char *const *stops,
                                 int n_stops, int32_t *out, int *out_n, char *shown, size_t *shown_before_last) {
    int32_t *prompt = NULL, *script = NULL;
    int np = 0, ns = 0;
    tl_encode(model, prompt_text, strlen(prompt_text), &prompt, &np);
    tl_encode(model, script_text, strlen(script_text), &script, &ns);
    script_t sc = {script, ns, np};
    tl_session *s = forced_session(prompt, np, &sc, stops, n_stops, ns + 2);
    tl_stop_reason stop = TL_STOP_NONE;
    size_t at = 0;
    while (s && stop == TL_STOP_NONE) {
        int32_t tok;
        const char *piece;
        size_t len;
        *shown_before_last = at;
        if (tl_session_step(s, &tok, &stop) != TL_OK) break;
        CHECK(tl_session_text(s, &piece, &len) == TL_OK, "session text");
        memcpy(shown + at, piece, len);
        at += len;
    }
    shown[at] = 0;
    const int32_t *all = tl_session_tokens(s, out_n);
    memcpy(out, all, (size_t)*out_n * sizeof *out);
    *out_n -= np;
    memmove(out, out + np, (size_t)*out_n * sizeof *out);
    tl_session_free(s);
    tl_free(prompt);
    tl_free(script);
    return stop;
}

static void test_stop_strings(void) {
    int32_t out[CAP];
    int n = 0;
    char shown[1024];
    size_t before_last = 0;
    const char *script = "Mr. Darcy was all politeness; but Elizabeth smiled.";
    int32_t *ids;
    int nids;
    tl_encode(model, script, strlen(script), &ids, &nids);

    /* "all polite" spans several tokens of this tokenizer. */
    const char *stop1[] = {"zzz", "all polite"};
    tl_stop_reason r = run_script("Yes.", script, stop1, 2, out, &n, shown, &before_last);
    CHECK(r == TL_STOP_SEQUENCE, "stop string: reason %s", tl_stop_reason_name(r));
    char *text;
    size_t len;
    tl_decode(model, out, n, &text, &len);
    const char *match = strstr(text, "all polite");
    CHECK(match && strlen(match) < 10 + 4, "output must end at the token completing the match: \"%s\"", text);
    CHECK(n >= 2 && n < nids, "stopped after %d of %d tokens", n, nids);
    /* The match was spread over several steps, yet nothing of it was shown before the end. */
    size_t match_at = (size_t)(match - text);
    CHECK(before_last <= match_at, "text shown before the final step (%zu bytes) reached into the match at %zu",
          before_last, match_at);
    CHECK(strcmp(shown, text) == 0, "everything is shown once generation ends: \"%s\" vs \"%s\"", shown, text);
    tl_free(text);
    int tokens_in_match = 0;
    for (int i = 0, pos = 0; i < nids; i++) {
        const char *b;
        size_t bl;
        tl_token_text(model, ids[i], &b, &bl);
        if ((size_t)pos + bl > (size_t)(strstr(script, "all polite") - script) && pos < (int)(strstr(script, "all polite") - script) + 10)
            tokens_in_match++;
        pos += (int)bl;
    }
    CHECK(tokens_in_match >= 3, "the stop string must span tokens for this test (%d)", tokens_in_match);

    /* A stop string in the prompt alone does not stop; a near miss is shown eventually. */
    const char *stop2[] = {"Yes."};
    r = run_script("Yes.", script, stop2, 1, out, &n, shown, &before_last);
    CHECK(r == TL_STOP_MAX_TOKENS && strncmp(shown, script, strlen(script)) == 0, "prompt-only stop string: %s \"%s\"",
          tl_stop_reason_name(r), shown);
    const char *stop3[] = {"Darcy is"};
    r = run_script("Yes.", script, stop3, 1, out, &n, shown, &before_last);
    CHECK(r == TL_STOP_MAX_TOKENS && strncmp(shown, script, strlen(script)) == 0, "near miss: \"%s\"", shown);
    tl_free(ids);

    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    int32_t prompt[2] = {72, 105}, buf[CAP];
    int len2;
    const char *empty[] = {""};
    cfg.stop_strings = empty;
    cfg.n_stop_strings = 1;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, buf, CAP, &len2, NULL), TL_ERR_INVALID_ARGUMENT, "stop_strings[0] is empty");
    cfg.n_stop_strings = 3;
    cfg.stop_strings = NULL;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, buf, CAP, &len2, NULL), TL_ERR_INVALID_ARGUMENT, "n_stop_strings = 3");
    /* each fault its own words: a NULL string is no empty one, a negative count no missing array */
    const char *null_one[] = {NULL};
    cfg.stop_strings = null_one;
    cfg.n_stop_strings = 1;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, buf, CAP, &len2, NULL), TL_ERR_INVALID_ARGUMENT, "stop_strings[0] is NULL");
    cfg.n_stop_strings = -1;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, buf, CAP, &len2, NULL), TL_ERR_INVALID_ARGUMENT,
                "n_stop_strings = -1 must be >= 0");
    cfg.n_stop_strings = 0;
    tl_token_seq one_seq = {prompt, 1};
    cfg.stop_sequences = &one_seq;
    cfg.n_stop_sequences = -2;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, buf, CAP, &len2, NULL), TL_ERR_INVALID_ARGUMENT,
                "n_stop_sequences = -2 must be >= 0");
    cfg.n_stop_sequences = 0;
    tl_logit_bias bias = {1, 0.5f};
    cfg.logit_bias = &bias;
    cfg.n_logit_bias = -1;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, buf, CAP, &len2, NULL), TL_ERR_INVALID_ARGUMENT,
                "n_logit_bias = -1 must be >= 0");
    /* a value that is no stop reason is not named as one */
    CHECK(strcmp(tl_stop_reason_name((tl_stop_reason)99), "UNKNOWN") == 0 && strcmp(tl_stop_reason_name(TL_STOP_NONE), "NONE") == 0,
          "stop reason names: %s, %s", tl_stop_reason_name((tl_stop_reason)99), tl_stop_reason_name(TL_STOP_NONE));
}

/* What tl_session_text holds back while a stop string may be beginning: the longest suffix of
   the text that is a proper prefix of one of them (as each length k compared by memcmp finds
   it; the engine runs the stop strings' border tables), after every step of a script full of
   near misses: stop strings whose prefixes repeat inside them (borders) and a text that keeps
   matching and failing them at different depths. */
static size_t hold_reference(const char *text, size_t len, const char *const *stops, int n_stops) {
    size_t hold = 0;
    for (int i = 0; i < n_stops; i++) {
        const size_t L = strlen(stops[i]);
        for (size_t k = L - 1 < len ? L - 1 : len; k > hold; k--)
            if (memcmp(text + len - k, stops[i], k) == 0) { hold = k; break; }
    }
    return hold;
}

static void test_stop_hold_back(void) {
    const char *script_text = "abaababaabaababaabaababaab aaaaaaaaaaaaaaa abcabcabcabcabd xyxyxyxyxxyxy. aabaabaabaaab!";
    const char *stops[] = {"abaababaabaababz", "aaaaaaaaaaaaaaaaab", "abcabcabd?", "xyxyxyxyxyz", "aabaabaabaabaab", "q"};
    const int n_stops = 6;
    int32_t *script = NULL, prompt[2] = {72, 105};
    int ns = 0;
    tl_encode(model, script_text, strlen(script_text), &script, &ns);
    script_t sc = {script, ns, 2};
    tl_session *s = forced_session(prompt, 2, &sc, stops, n_stops, ns);
    tl_stop_reason stop = TL_STOP_NONE;
    size_t shown = 0, held_most = 0;
    int steps = 0;
    while (s && stop == TL_STOP_NONE) {
        int32_t tok;
        const char *piece;
        size_t len;
        if (tl_session_step(s, &tok, &stop) != TL_OK) break;
        CHECK(tl_session_text(s, &piece, &len) == TL_OK, "session text");
        shown += len;
        int n = 0;
        const int32_t *all = tl_session_tokens(s, &n);
        char *text = NULL;
        size_t text_len = 0;
        tl_decode(model, all + 2, n - 2, &text, &text_len);
        const size_t hold = stop == TL_STOP_NONE ? hold_reference(text, text_len, stops, n_stops) : 0;
        size_t want = text_len - hold;
        if (want < shown - len) want = shown - len; /* (what was shown stays shown) */
        CHECK(shown == want, "step %d: %zu bytes shown of \"%s\", want %zu (held back %zu)", steps, shown, text, want, hold);
        if (hold > held_most) held_most = hold;
        tl_free(text);
        steps++;
    }
    CHECK(stop == TL_STOP_MAX_TOKENS && steps == ns, "the script ran out: %s after %d of %d steps", tl_stop_reason_name(stop),
          steps, ns);
    CHECK(held_most >= 12, "the script must reach deep into a stop string (held %zu at most)", held_most);
    tl_session_free(s);
    tl_free(script);
}

/* keep_special_text (vLLM's skip_special_tokens = false): <|endoftext|> (319, special) forced
   as the 3rd token. Where it does not end generation (ignore_eos) its text is in the
   generated text, and stop strings see it; the token that ends generation keeps none. */
static void test_keep_special_text(void) {
    const int32_t eos = 319, prompt[2] = {72, 105};
    int32_t script[6], out[CAP];
    const char *words = "ab";
    for (int i = 0; i < 6; i++) script[i] = i == 2 ? eos : (int32_t)words[i % 2];
    script_t sc = {script, 6, 2};
    for (int keep = 0; keep <= 1; keep++) {
        for (int mode = 0; mode < 4; mode++) { /* ignore_eos; eos ends; a one-token stop sequence; a stop string */
            tl_generate_config cfg;
            tl_generate_config_init(&cfg);
            cfg.max_tokens = 6;
            cfg.logits_processor = force;
            cfg.logits_processor_user = &sc;
            cfg.keep_special_text = keep;
            cfg.ignore_eos = mode != 1;
            const tl_token_seq stop_eos = {&eos, 1};
            if (mode == 2) cfg.stop_sequences = &stop_eos, cfg.n_stop_sequences = 1;
            const char *stop_text[] = {"<|endoftext|>"};
            if (mode == 3) cfg.stop_strings = stop_text, cfg.n_stop_strings = 1;
            tl_session *s = NULL;
            CHECK(tl_session_new(model, prompt, 2, &cfg, &s) == TL_OK, "%s", tl_last_error());
            tl_stop_reason stop = TL_STOP_NONE;
            int n = 0;
            while (s && stop == TL_STOP_NONE && n < CAP) {
                int32_t tok;
                if (tl_session_step(s, &tok, &stop) != TL_OK) { CHECK(0, "step: %s", tl_last_error()); break; }
                if (tok >= 0) out[n++] = tok;
            }
            const char *text = "";
            size_t len = 0;
            if (s) tl_session_text(s, &text, &len);
            const bool ends = mode != 0 && (mode != 3 || keep); /* (a stop string sees the text only where it is kept) */
            CHECK(n == (ends ? 3 : 6) && out[2] == eos, "keep %d mode %d: %d tokens", keep, mode, n);
            const char *want = !ends ? (keep ? "ab<|endoftext|>bab" : "abbab") : mode == 3 ? "ab<|endoftext|>" : "ab";
            CHECK(len == strlen(want) && memcmp(text, want, len) == 0, "keep %d mode %d: text \"%.*s\", want \"%s\"", keep,
                  mode, (int)len, text, want);
            CHECK(stop == (!ends ? TL_STOP_MAX_TOKENS : mode == 1 ? TL_STOP_EOS : TL_STOP_SEQUENCE), "keep %d mode %d: %s", keep,
                  mode, tl_stop_reason_name(stop));
            /* the rule the text followed, as the bindings' mirrors ask it: the session's own
               config (tl_session_config) says whether <|endoftext|> is text */
            const tl_generate_config *own = tl_session_config(s);
            const int eos_in_text = keep && (mode == 0 || mode == 3);
            CHECK(own && own->keep_special_text == keep && own->ignore_eos == cfg.ignore_eos, "keep %d mode %d: config", keep, mode);
            CHECK(tl_token_in_text(model, own, eos) == eos_in_text && tl_token_in_text(model, own, 'a') == 1,
                  "keep %d mode %d: tl_token_in_text %d, want %d", keep, mode, tl_token_in_text(model, own, eos), eos_in_text);
            tl_session_free(s);
        }
    }
    /* no config: the defaults; ids out of range have no text */
    CHECK(tl_token_in_text(model, NULL, eos) == 0 && tl_token_in_text(model, NULL, 'a') == 1, "tl_token_in_text defaults");
    CHECK(tl_token_in_text(model, NULL, -1) == 0 && tl_token_in_text(model, NULL, tl_model_info(model)->vocab_size) == 0 &&
              tl_token_in_text(NULL, NULL, 'a') == 0 && tl_session_config(NULL) == NULL,
          "tl_token_in_text out of range");
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.keep_special_text = 2;
    int32_t buf[CAP];
    int n;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, buf, CAP, &n, NULL), TL_ERR_INVALID_ARGUMENT, "keep_special_text = 2 must be 0 or 1");
    /* a config tl_session_new refuses is no keeper of special text here either (a stop
       sequence without its tokens was read through NULL) */
    CHECK(tl_token_in_text(model, &cfg, eos) == 0, "keep_special_text = 2 keeps nothing");
    cfg.keep_special_text = 1;
    cfg.ignore_eos = 1;
    CHECK(tl_token_in_text(model, &cfg, eos) == 1, "kept with ignore_eos");
    cfg.n_stop_sequences = 1;
    CHECK(tl_token_in_text(model, &cfg, eos) == 0, "n_stop_sequences 1 without stop_sequences");
    tl_token_seq hollow = {NULL, 1};
    cfg.stop_sequences = &hollow;
    CHECK(tl_token_in_text(model, &cfg, eos) == 0, "a stop sequence without tokens");
    const int32_t below[1] = {-5};
    tl_token_seq out_of_range = {below, 1};
    cfg.stop_sequences = &out_of_range;
    CHECK(tl_token_in_text(model, &cfg, eos) == 0, "a stop sequence of an id out of range");
}

static void test_no_tokenizer(const char *golden) {
    tl_model *bare = NULL;
    CHECK(tl_model_load(golden, NULL, &bare) == TL_OK, "load %s", golden);
    CHECK(tl_model_info(bare)->has_tokenizer == 0, "has_tokenizer");
    int32_t *ids;
    int n;
    CHECK_ERROR(tl_encode(bare, "hi", 2, &ids, &n), TL_ERR_UNSUPPORTED, "has no tokenizer.json");
    char *text;
    size_t len;
    CHECK_ERROR(tl_decode(bare, (const int32_t[]){1}, 1, &text, &len), TL_ERR_UNSUPPORTED, "no tokenizer");
    tl_detokenizer *d;
    CHECK_ERROR(tl_detokenizer_new(bare, &d), TL_ERR_UNSUPPORTED, "no tokenizer");
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 4;
    const char *stops[] = {"x"};
    cfg.stop_strings = stops;
    cfg.n_stop_strings = 1;
    int32_t prompt[1] = {3}, out[8];
    CHECK_ERROR(tl_generate(bare, prompt, 1, &cfg, out, 8, &n, NULL), TL_ERR_INVALID_ARGUMENT, "stop_strings need a tokenizer");
    cfg.n_stop_strings = 0;
    tl_session *s = NULL;
    tl_session_new(bare, prompt, 1, &cfg, &s);
    const char *piece;
    CHECK_ERROR(tl_session_text(s, &piece, &len), TL_ERR_UNSUPPORTED, "no tokenizer");
    tl_session_free(s);
    tl_model_free(bare);
}

int main(int argc, char **argv) {
    char dir[4096], golden[4096];
    const char *data = argc > 1 ? argv[1] : "tests/data";
    snprintf(dir, sizeof dir, "%s/textmodel", data);
    snprintf(golden, sizeof golden, "%s/golden/gpt2_like", data);
    if (tl_model_load(dir, NULL, &model) != TL_OK) { printf("load: %s\n", tl_last_error()); return 1; }
    CHECK(tl_model_info(model)->has_tokenizer == 1, "has_tokenizer");
    test_encode_decode();
    test_stop_strings();
    test_stop_hold_back();
    test_keep_special_text();
    test_no_tokenizer(golden);
    tl_model_free(model);
    return check_summary();
}

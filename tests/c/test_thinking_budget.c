/* test_thinking_budget.c: the thinking budget (tl_generate_config.reasoning_budget).
 *
 * A logits hook writes a script of tokens (the model's weights do not matter: each step's
 * argmax is the script's token), so the expected output is known exactly:
 * - a block opened by the generated "<think>" holds `budget` tokens, then "</think>"'s ids are
 *   forced, and the script goes on (the hook's tokens) after them;
 * - a block the model closes within its budget is left alone; a second block gets a budget
 *   of its own; reasoning_open counts from the first token;
 * - batched stepping, a fork and a state written to bytes and read back mid-block force at the
 *   same token as the session stepped alone (memcmp of the tokens);
 * - under a compiled after-block grammar the forced end is allowed, and the grammar writes the
 *   answer after it;
 * - refusals: bad values, speculative and beam sessions. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "tinyloop.h"

#define MAX_NEW 40

static tl_model *model;
static int32_t think[16], end_think[16], filler, other;
static int n_think, n_end;

typedef struct script {
    int32_t tokens[MAX_NEW];
    int n, prompt_len;
} script;

/* Forces script->tokens[k] as the k-th generated token (then leaves the logits alone). */
static int follow_script(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    const script *sc = user;
    const int k = n - sc->prompt_len;
    if (k >= 0 && k < sc->n && sc->tokens[k] < vocab) logits[sc->tokens[k]] = 1e9f;
    return 0;
}

static void add(script *sc, const int32_t *ids, int n) {
    for (int i = 0; i < n && sc->n < MAX_NEW; i++) sc->tokens[sc->n++] = ids[i];
}
static void add_filler(script *sc, int32_t id, int count) {
    for (int i = 0; i < count; i++) add(sc, &id, 1);
}

static const int32_t prompt[2] = {11, 12};

static tl_generate_config config(script *sc, int budget, int max_tokens) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = max_tokens;
    cfg.ignore_eos = 1;
    cfg.logits_processor = follow_script;
    cfg.logits_processor_user = sc;
    cfg.reasoning_budget = budget;
    cfg.reasoning_start = (tl_token_seq){think, n_think};
    cfg.reasoning_end = (tl_token_seq){end_think, n_end};
    sc->prompt_len = 2;
    return cfg;
}

/* The generated tokens of a session stepped to its end. */
static int run(const tl_generate_config *cfg, int32_t *out) {
    tl_session *s = NULL;
    CHECK(tl_session_new(model, prompt, 2, cfg, &s) == TL_OK, "%s", tl_last_error());
    int n = 0;
    tl_stop_reason stop = TL_STOP_NONE;
    while (s && stop == TL_STOP_NONE) {
        int32_t tok = -1;
        if (tl_session_step(s, &tok, &stop) != TL_OK || tok < 0) break;
        out[n++] = tok;
    }
    tl_session_free(s);
    return n;
}

static void expect_tokens(const char *what, const int32_t *got, int n_got, const script *want, int n_want) {
    CHECK(n_got == n_want && memcmp(got, want->tokens, (size_t)n_want * sizeof *got) == 0, "%s: %d tokens, want %d%s", what,
          n_got, n_want, n_got == n_want ? " (others)" : "");
}

static int encode_into(const char *text, int32_t *out, int cap);

static void check_blocks(void) {
    int32_t out[MAX_NEW];
    /* a block over its budget: 5 tokens, then the end, forced; the script goes on after it */
    script sc = {0};
    add(&sc, think, n_think);
    add_filler(&sc, filler, 20);
    tl_generate_config cfg = config(&sc, 5, n_think + 5 + n_end + 4);
    script want = {0};
    add(&want, think, n_think);
    add_filler(&want, filler, 5);
    add(&want, end_think, n_end);
    add_filler(&want, filler, 4);
    expect_tokens("over budget", out, run(&cfg, out), &want, want.n);

    /* closed by the model within its budget: untouched; then a second block with its own budget */
    script closed = {0};
    add(&closed, think, n_think);
    add_filler(&closed, filler, 3);
    add(&closed, end_think, n_end);
    add_filler(&closed, other, 2);
    add(&closed, think, n_think);
    add_filler(&closed, filler, 10);
    cfg = config(&closed, 4, closed.n - 10 + 4 + n_end);
    want = (script){0};
    add(&want, closed.tokens, closed.n - 10);
    add_filler(&want, filler, 4);
    add(&want, end_think, n_end);
    expect_tokens("closed, then a second block", out, run(&cfg, out), &want, want.n);

    /* the budget spent while the model writes the end's ids (a tag of several): only the
       rest is forced, the end written once */
    CHECK(n_end > 2, "</think> is %d ids here: the begun-end case needs more than 2", n_end);
    if (n_end > 2) {
        script begun = {0};
        add(&begun, think, n_think);
        add_filler(&begun, filler, 2);
        add(&begun, end_think, 2); /* the end's first two ids, then filler again */
        add_filler(&begun, filler, 10);
        cfg = config(&begun, 4, n_think + 2 + n_end + 1);
        want = (script){0};
        add(&want, think, n_think);
        add_filler(&want, filler, 2);
        add(&want, end_think, n_end);
        add_filler(&want, filler, 1);
        expect_tokens("the end begun by the model", out, run(&cfg, out), &want, want.n);
    }

    /* a tag is found in the text, however the ids spell it: the end "in" is one merged id, the
       model writes it as "i" and "n"; the block closes there, and nothing is forced later */
    int32_t in_merged[4], i_id[4], n_id[4];
    if (encode_into("in", in_merged, 4) == 1 && encode_into("i", i_id, 4) == 1 && encode_into("n", n_id, 4) == 1) {
        script spelled = {0};
        add(&spelled, think, n_think);
        add_filler(&spelled, filler, 2);
        add(&spelled, i_id, 1);
        add(&spelled, n_id, 1);
        add_filler(&spelled, filler, 12);
        cfg = config(&spelled, 6, n_think + 16);
        cfg.reasoning_end = (tl_token_seq){in_merged, 1};
        want = (script){0};
        add(&want, spelled.tokens, n_think + 16);
        expect_tokens("an end spelled by other ids", out, run(&cfg, out), &want, want.n);
    } else {
        CHECK(0, "\"in\" is one merged id, \"i\" and \"n\" one each, in the text model");
    }

    /* the prompt opened the block: counted from the first token */
    script open = {0};
    add_filler(&open, filler, 12);
    cfg = config(&open, 3, 3 + n_end + 2);
    cfg.reasoning_open = 1;
    cfg.reasoning_start.n = 0; /* (none needed when the block is open from the start) */
    want = (script){0};
    add_filler(&want, filler, 3);
    add(&want, end_think, n_end);
    add_filler(&want, filler, 2);
    expect_tokens("open from the prompt", out, run(&cfg, out), &want, want.n);

    /* off: the script as written */
    cfg = config(&sc, 0, 12);
    want = (script){0};
    add(&want, sc.tokens, 12);
    expect_tokens("no budget", out, run(&cfg, out), &want, 12);
}

/* Batched stepping, a fork and a state read back from bytes, each from the middle of the
   block, force where the session stepped alone does. */
static void check_continuations(void) {
    script sc = {0};
    add(&sc, think, n_think);
    add_filler(&sc, filler, 30);
    const int total = n_think + 6 + n_end + 3;
    tl_generate_config cfg = config(&sc, 6, total);
    int32_t alone[MAX_NEW];
    const int n_alone = run(&cfg, alone);
    CHECK(n_alone == total, "alone: %d tokens", n_alone);

    /* two sessions of the same config stepped as one batch, with a third without a budget */
    tl_generate_config free_cfg = config(&sc, 0, total);
    tl_session *s[3] = {NULL, NULL, NULL};
    for (int i = 0; i < 3; i++)
        CHECK(tl_session_new(model, prompt, 2, i == 2 ? &free_cfg : &cfg, &s[i]) == TL_OK, "%s", tl_last_error());
    int32_t batched[3][MAX_NEW];
    int n[3] = {0, 0, 0};
    for (int step = 0; step < total && s[0] && s[1] && s[2]; step++) {
        int32_t tokens[3];
        tl_stop_reason stops[3];
        tl_status statuses[3];
        if (tl_session_step_batch(s, 3, tokens, stops, statuses) != TL_OK) break;
        for (int i = 0; i < 3; i++)
            if (statuses[i] == TL_OK && tokens[i] >= 0) batched[i][n[i]++] = tokens[i];
    }
    for (int i = 0; i < 2; i++)
        CHECK(n[i] == n_alone && memcmp(batched[i], alone, (size_t)n_alone * sizeof *alone) == 0, "batched session %d", i);
    CHECK(n[2] == total && memcmp(batched[2], sc.tokens, (size_t)total * sizeof *alone) == 0, "the batch's session without a budget");
    for (int i = 0; i < 3; i++) tl_session_free(s[i]);

    /* a fork, and a state through bytes, from the middle of the block and from the middle of
       the forced end */
    const int save_points[2] = {n_think + 3, n_think + 6 + 2};
    for (int point = 0; point < 2; point++) {
    tl_session *parent = NULL;
    CHECK(tl_session_new(model, prompt, 2, &cfg, &parent) == TL_OK, "%s", tl_last_error());
    int done = 0;
    tl_stop_reason stop = TL_STOP_NONE;
    for (; parent && done < save_points[point]; done++) {
        int32_t tok;
        CHECK(tl_session_step(parent, &tok, &stop) == TL_OK, "%s", tl_last_error());
    }
    tl_session *child = NULL, *resumed = NULL;
    tl_session_state *saved = NULL, *read = NULL;
    void *bytes = NULL;
    size_t len = 0;
    CHECK(parent && tl_session_fork(parent, &cfg, &child) == TL_OK, "fork: %s", tl_last_error());
    CHECK(parent && tl_session_save(parent, &saved) == TL_OK && tl_session_state_to_bytes(saved, &bytes, &len) == TL_OK &&
              tl_session_state_from_bytes(model, bytes, len, &read) == TL_OK &&
              tl_session_resume(model, read, &cfg, &resumed) == TL_OK,
          "state through bytes: %s", tl_last_error());
    tl_session *continued[2] = {child, resumed};
    const char *names[2] = {"fork", "state read back"};
    for (int c = 0; c < 2; c++) {
        int32_t out[MAX_NEW];
        int k = done;
        memcpy(out, alone, (size_t)done * sizeof *out);
        stop = TL_STOP_NONE;
        while (continued[c] && stop == TL_STOP_NONE && k < MAX_NEW) {
            int32_t tok = -1;
            if (tl_session_step(continued[c], &tok, &stop) != TL_OK || tok < 0) break;
            out[k++] = tok;
        }
        CHECK(k == n_alone && memcmp(out, alone, (size_t)n_alone * sizeof *out) == 0, "%s from token %d: %d tokens",
              names[c], done, k);
    }
    tl_session_free(child);
    tl_session_free(resumed);
    tl_session_free(parent);
    tl_session_state_free(saved);
    tl_session_state_free(read);
    tl_free(bytes);
    }

    /* an early-exit session (its own forward, one token at a time) forces where plain decoding does */
    tl_generate_config early = cfg;
    early.early_exit_patience = 1;
    early.early_exit_min_L = 1;
    early.loops = 2;
    int32_t exited[MAX_NEW];
    const int n_exited = run(&early, exited);
    CHECK(n_exited == n_alone && memcmp(exited, alone, (size_t)n_alone * sizeof *alone) == 0, "early exit: %d tokens", n_exited);
}

/* Under an after-block grammar: the forced end is the grammar's too; the answer follows it. */
static void check_grammar(void) {
    tl_compiled_grammar *answer = NULL, *g = NULL;
    const char *gbnf = "root ::= \"yes\" | \"no\"";
    CHECK(tl_grammar_compile_gbnf(gbnf, strlen(gbnf), &answer) == TL_OK, "%s", tl_last_error());
    CHECK(answer && tl_grammar_compile_after_block(answer, "<think>", "</think>", 0, &g) == TL_OK, "%s", tl_last_error());
    tl_compiled_grammar_free(answer);
    if (!g) return;
    script sc = {0};
    add(&sc, think, n_think);
    add_filler(&sc, filler, 30);
    tl_generate_config cfg = config(&sc, 4, 30);
    cfg.ignore_eos = 0; /* (the grammar's end is the model's end of text) */
    tl_grammar grammar;
    tl_grammar_use(&grammar, g);
    cfg.grammar = &grammar;
    int32_t out[MAX_NEW];
    const int n = run(&cfg, out);
    char *text = NULL;
    size_t text_len = 0;
    CHECK(tl_decode(model, out, n, &text, &text_len) == TL_OK, "%s", tl_last_error());
    const char *want_yes = "<think>aaaa</think>yes<|endoftext|>", *want_no = "<think>aaaa</think>no<|endoftext|>";
    CHECK(text && (strcmp(text, want_yes) == 0 || strcmp(text, want_no) == 0), "under the grammar: \"%s\"", text ? text : "");
    tl_free(text);
    tl_compiled_grammar_free(g);

    /* a grammar that does not let the block end: the step that would force it fails, saying so */
    tl_compiled_grammar *no_slash = NULL;
    const char *letters = "root ::= [a-z<>]+";
    CHECK(tl_grammar_compile_gbnf(letters, strlen(letters), &no_slash) == TL_OK, "%s", tl_last_error());
    if (!no_slash) return;
    tl_grammar_use(&grammar, no_slash);
    cfg = config(&sc, 2, 30);
    cfg.grammar = &grammar;
    tl_session *s = NULL;
    CHECK(tl_session_new(model, prompt, 2, &cfg, &s) == TL_OK, "%s", tl_last_error());
    tl_status st = TL_OK;
    tl_stop_reason stop = TL_STOP_NONE;
    for (int i = 0; s && i < 30 && st == TL_OK && stop == TL_STOP_NONE; i++) {
        int32_t tok;
        st = tl_session_step(s, &tok, &stop);
    }
    CHECK(st == TL_ERR_UNSUPPORTED && strstr(tl_last_error(), "the grammar does not allow reasoning_end") != NULL,
          "a grammar that refuses the end: %s \"%s\"", tl_status_name(st), tl_last_error());
    tl_session_free(s);
    tl_compiled_grammar_free(no_slash);
}

static void check_refusals(void) {
    script sc = {0};
    tl_session *s = NULL;
    tl_generate_config cfg = config(&sc, -1, 8);
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &s), TL_ERR_INVALID_ARGUMENT, "reasoning_budget = -1");
    cfg = config(&sc, 4, 8);
    cfg.reasoning_open = 2;
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &s), TL_ERR_INVALID_ARGUMENT, "reasoning_open = 2");
    cfg = config(&sc, 4, 8);
    cfg.reasoning_end.n = 0;
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &s), TL_ERR_INVALID_ARGUMENT, "reasoning_end has 0 ids");
    cfg = config(&sc, 4, 8);
    cfg.reasoning_start.n = 0;
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &s), TL_ERR_INVALID_ARGUMENT, "reasoning_start has 0 ids");
    cfg = config(&sc, 4, 8);
    cfg.reasoning_end.n = TL_MAX_REASONING_TAG + 1;
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &s), TL_ERR_INVALID_ARGUMENT, "reasoning_end has 17 ids");
    int32_t bad[1] = {100000};
    cfg = config(&sc, 4, 8);
    cfg.reasoning_end = (tl_token_seq){bad, 1};
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &s), TL_ERR_INVALID_ARGUMENT, "reasoning_end token id 100000");
    cfg = config(&sc, 4, 8);
    cfg.speculative = TL_SPECULATIVE_CHAIN;
    cfg.loops = 2;
    cfg.draft_loops = 1;
    cfg.logits_processor = NULL;
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &s), TL_ERR_UNSUPPORTED, "not speculative decoding");
    cfg = config(&sc, 4, 8);
    cfg.beam_size = 2;
    cfg.logits_processor = NULL;
    CHECK_ERROR(tl_session_new(model, prompt, 2, &cfg, &s), TL_ERR_UNSUPPORTED, "not beam search");
    /* off, tags are not looked at (a config without them is valid) */
    cfg = config(&sc, 0, 8);
    cfg.reasoning_start = cfg.reasoning_end = (tl_token_seq){NULL, 0};
    CHECK(tl_session_new(model, prompt, 2, &cfg, &s) == TL_OK, "no budget, no tags: %s", tl_last_error());
    tl_session_free(s);
}

static int encode_into(const char *text, int32_t *out, int cap) {
    int32_t *ids = NULL;
    int n = 0;
    if (tl_encode(model, text, strlen(text), &ids, &n) != TL_OK || n > cap) n = 0;
    if (n > 0) memcpy(out, ids, (size_t)n * sizeof *out);
    tl_free(ids);
    return n;
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "tests/data/textmodel";
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 1;
    if (tl_model_load(dir, &o, &model) != TL_OK) {
        printf("load %s: %s\n0 passed, 1 failed\n", dir, tl_last_error());
        return 1;
    }
    n_think = encode_into("<think>", think, 16);
    n_end = encode_into("</think>", end_think, 16);
    int32_t one[4];
    filler = encode_into("a", one, 4) == 1 ? one[0] : -1;
    other = encode_into("b", one, 4) == 1 ? one[0] : -1;
    CHECK(n_think > 0 && n_end > 0 && filler >= 0 && other >= 0, "the tags' and fillers' ids");
    check_blocks();
    check_continuations();
    check_grammar();
    check_refusals();
    tl_model_free(model);
    printf("%d passed, %d failed\n", checks_passed, checks_failed);
    return checks_failed;
}

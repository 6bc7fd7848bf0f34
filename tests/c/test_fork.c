/* test_fork.c: one state, many continuations. A forked session continues exactly as its
 * parent would (memcmp, greedy and seeded sampling), shares the parent's KV pages and only
 * pays for its own tokens; hooks can be replaced per branch; saved states resume any number
 * of times on their model only; the prefix pool gives a new session the K/V of a prefix
 * another session computed, with output bit-identical to a cold start; bad input is refused
 * with clear errors. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "kv_cache.h"
#include "session.h"
#include "validate.h"

#define CAP 256

static tl_model *load(const char *dir) {
    tl_model *m = NULL;
    if (tl_model_load(dir, NULL, &m) != TL_OK) printf("load %s: %s\n", dir, tl_last_error());
    return m;
}

/* Steps a session until it stops or `steps` tokens were emitted; returns its token count. */
static int run(tl_session *s, int steps) {
    int32_t token;
    tl_stop_reason stop = TL_STOP_NONE;
    for (int i = 0; i < steps && stop == TL_STOP_NONE && !s->finished; i++)
        if (tl_session_step(s, &token, &stop) != TL_OK) return -1;
    return s->n_tokens;
}

static bool same_tokens(const tl_session *a, const tl_session *b) {
    return a->n_tokens == b->n_tokens && memcmp(a->tokens, b->tokens, (size_t)a->n_tokens * sizeof(int32_t)) == 0;
}

static int common_prefix_len(const int32_t *a, int na, const int32_t *b, int nb) {
    int k = 0;
    while (k < na && k < nb && a[k] == b[k]) k++;
    return k;
}

/* Pages of the child that are its own (not shared with anyone). */
static int private_pages(const tl_kv_cache *c) {
    int n = 0;
    for (size_t i = 0; i < (size_t)c->n_slots * (size_t)c->n_pages; i++)
        n += c->pages[i] && atomic_load(&c->pages[i]->refs) == 1;
    return n;
}

static int ban(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    (void)tokens; (void)n;
    const int32_t *banned = user;
    if (*banned < vocab) logits[*banned] = -INFINITY;
    return TL_HOOK_CONTINUE;
}

static void forks_continue_exactly(const tl_model *m) {
    const int32_t prompt[6] = {3, 14, 15, 92, 65, 35};
    for (int sampled = 0; sampled < 2; sampled++) {
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 60;
        cfg.ignore_eos = 1;
        if (sampled) { cfg.temperature = 0.9f; cfg.top_k = 30; cfg.sample_seed = 5; }
        tl_session *whole = NULL, *parent = NULL, *child = NULL;
        tl_session_new(m, prompt, 6, &cfg, &whole);
        tl_session_new(m, prompt, 6, &cfg, &parent);
        run(whole, 1000);
        run(parent, 37);
        CHECK(tl_session_fork(parent, NULL, &child) == TL_OK, "fork: %s", tl_last_error());
        /* The last token's log-probabilities (and their top) are the parent's: the fork
           copies the row they are read from. */
        float lp_parent = 0, lp_child = 1, top_parent[5] = {0}, top_child[5] = {1};
        int32_t ids_parent[5] = {0}, ids_child[5] = {1};
        CHECK(child && tl_session_logprobs(parent, 5, &lp_parent, ids_parent, top_parent) == TL_OK &&
                  tl_session_logprobs(child, 5, &lp_child, ids_child, top_child) == TL_OK && lp_parent == lp_child &&
                  memcmp(ids_parent, ids_child, sizeof ids_parent) == 0 && memcmp(top_parent, top_child, sizeof top_parent) == 0,
              "%s: the fork's last log-probability %g (%s), the parent's %g", sampled ? "sampled" : "greedy", lp_child,
              tl_last_error(), lp_parent);
        /* The fork copied no K/V: every page is the parent's. */
        CHECK(child && private_pages(child->cache) == 0 && tl_kv_cache_bytes(child->cache) == tl_kv_cache_bytes(parent->cache),
              "a fresh fork owns %d pages of its own", child ? private_pages(child->cache) : -1);
        run(child, 1000);
        run(parent, 1000);
        CHECK(same_tokens(parent, whole) && same_tokens(child, whole),
              "%s: parent and child must both continue as the uninterrupted run", sampled ? "sampled" : "greedy");
        /* The child paid for its own 23 tokens only: one page per slot that the 43rd row
           (shared, copied on write) and rows 48..65 touch, at most. */
        const tl_kv_cache *c = child->cache;
        const int slots_in_use = c->model->cfg.n_prelude + c->model->cfg.n_block * child->loops + c->model->cfg.n_coda;
        CHECK(private_pages(c) <= 3 * slots_in_use, "child owns %d pages for 23 tokens over %d slots", private_pages(c),
              slots_in_use);
        tl_session_free(whole);
        tl_session_free(parent);
        tl_session_free(child);
    }
}

static int exit_at_once(void *user, const tl_loop_signals *signals);
static int never_stop(void *user, const int32_t *tokens, int n) {
    (void)user, (void)tokens, (void)n;
    return 0;
}
static int allow_everything(void *user, uint8_t *allowed, int vocab) {
    (void)user;
    memset(allowed, 1, (size_t)vocab);
    return vocab;
}
static int advance_nothing(void *user, int32_t token) {
    (void)user, (void)token;
    return 0;
}

/* Two compiled grammars, "root ::= [a-z ]+" and "root ::= [0-9]+", and their tl_grammar uses;
   false (said) when either fails to compile. */
static bool letters_and_digits(tl_compiled_grammar **letters, tl_compiled_grammar **digits, tl_grammar *use_letters,
                               tl_grammar *use_digits) {
    const char *letters_src = "root ::= [a-z ]+", *digits_src = "root ::= [0-9]+";
    CHECK(tl_grammar_compile_gbnf(letters_src, strlen(letters_src), letters) == TL_OK &&
          tl_grammar_compile_gbnf(digits_src, strlen(digits_src), digits) == TL_OK, "compile: %s", tl_last_error());
    if (!*letters || !*digits) return false;
    tl_grammar_use(use_letters, *letters);
    tl_grammar_use(use_digits, *digits);
    return true;
}

static int ban_first_choice(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    (void)user, (void)tokens, (void)n;
    logits[tl_argmax(logits, vocab)] = -INFINITY; /* (greedy: the second best instead) */
    return TL_HOOK_CONTINUE;
}

/* Speculative and beam sessions fork, and save and resume in memory, at any token: between
   speculative cycles and within one (the drafted tree, the verifier's rows and the accepted
   path are copied), amid a beam search (its hypotheses), for a chain, a sampled chain, a tree
   and a beam search, each branch continuing exactly as the uninterrupted run, a speculative
   one's last token's log-probabilities the parent's; a speculative branch with hooks of its
   own continues as a plain session forked at the same token with them (greedy: speculative
   decoding emits plain decoding's tokens). A state file holds plain decoding only: refused,
   saying so. */
static void mode_forks(const tl_model *m) {
    const int32_t prompt[5] = {11, 4, 27, 8, 60};
    enum { TOKENS = 40 };
    const char *names[4] = {"chain", "sampled chain", "tree", "beam search"};
    int mid_cycle = 0;
    for (int mode = 0; mode < 4; mode++) {
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = TOKENS;
        cfg.ignore_eos = 1;
        cfg.loops = tl_model_info(m)->max_loops;
        cfg.draft_loops = 1;
        cfg.speculative = mode == 3 ? TL_SPECULATIVE_OFF : mode == 2 ? TL_SPECULATIVE_TREE : TL_SPECULATIVE_CHAIN;
        if (mode == 1) { cfg.temperature = 0.8f; cfg.sample_seed = 9; }
        if (mode == 2) { cfg.K_branches = 2; cfg.max_nodes = 9; }
        if (mode == 3) cfg.beam_size = 3;
        tl_session *whole = NULL;
        CHECK(tl_session_new(m, prompt, 5, &cfg, &whole) == TL_OK && run(whole, TOKENS) == 5 + TOKENS, "%s: %s", names[mode],
              tl_last_error());
        for (int at = 0; at < 12; at++) {
            tl_session *parent = NULL, *child = NULL, *resumed = NULL;
            tl_session_state *state = NULL;
            tl_session_new(m, prompt, 5, &cfg, &parent);
            run(parent, at);
            CHECK(tl_session_fork(parent, NULL, &child) == TL_OK && tl_session_save(parent, &state) == TL_OK &&
                      tl_session_resume(m, state, NULL, &resumed) == TL_OK,
                  "%s at %d: fork, save, resume: %s", names[mode], at, tl_last_error());
            if (!child || !resumed) break;
            /* (within a cycle the cache holds a row past the sequence's pending token) */
            mid_cycle += mode < 3 && parent->cache->length >= parent->n_tokens;
            if (at > 0 && mode < 3) {
                float lp_parent, lp_child;
                CHECK(tl_session_logprobs(parent, 0, &lp_parent, NULL, NULL) == TL_OK &&
                          tl_session_logprobs(child, 0, &lp_child, NULL, NULL) == TL_OK && lp_parent == lp_child,
                      "%s at %d: the last token's log-probability %g, the fork's %g", names[mode], at, lp_parent, lp_child);
            }
            void *bytes = NULL;
            size_t len = 0;
            CHECK_ERROR(tl_session_state_to_bytes(state, &bytes, &len), TL_ERR_UNSUPPORTED,
                        mode < 3 ? "a speculative session's state is kept in memory only"
                                 : "a beam session's state is kept in memory only");
            run(child, TOKENS);
            run(resumed, TOKENS);
            run(parent, TOKENS);
            CHECK(same_tokens(child, whole) && same_tokens(resumed, whole) && same_tokens(parent, whole),
                  "%s forked at token %d: the fork %d, the resumed state %d, the parent %d continue as the uninterrupted run",
                  names[mode], at, same_tokens(child, whole), same_tokens(resumed, whole), same_tokens(parent, whole));
            tl_session_free(parent);
            tl_session_free(child);
            tl_session_free(resumed);
            tl_session_state_free(state);
        }
        tl_session_free(whole);
        if (mode == 1 || mode == 3) continue;
        /* a branch with hooks of its own, against a plain one forked at the same token */
        tl_generate_config plain_cfg = cfg;
        plain_cfg.speculative = TL_SPECULATIVE_OFF;
        tl_generate_config hooks;
        tl_generate_config_init(&hooks);
        hooks.logits_processor = ban_first_choice;
        for (int at = 3; at < 9; at += 2) {
            tl_session *spec = NULL, *plain = NULL, *spec_branch = NULL, *plain_branch = NULL;
            tl_session_new(m, prompt, 5, &cfg, &spec);
            tl_session_new(m, prompt, 5, &plain_cfg, &plain);
            run(spec, at);
            run(plain, at);
            CHECK(tl_session_fork(spec, &hooks, &spec_branch) == TL_OK && tl_session_fork(plain, &hooks, &plain_branch) == TL_OK,
                  "%s: forks with hooks: %s", names[mode], tl_last_error());
            run(spec_branch, TOKENS);
            run(plain_branch, TOKENS);
            CHECK(spec_branch && plain_branch && same_tokens(spec_branch, plain_branch),
                  "%s forked at token %d with hooks of its own: not the plain branch's tokens", names[mode], at);
            tl_session_free(spec);
            tl_session_free(plain);
            tl_session_free(spec_branch);
            tl_session_free(plain_branch);
        }
    }
    CHECK(mid_cycle > 0, "no fork came within a cycle");
    /* a branch takes only the hooks its mode takes at its start (it would not run the others:
       a speculative fork with a depth_policy ran every loop) */
    {
        tl_generate_config spec_cfg, beam_cfg, hooks;
        tl_generate_config_init(&spec_cfg);
        spec_cfg.speculative = TL_SPECULATIVE_CHAIN;
        spec_cfg.loops = tl_model_info(m)->max_loops;
        spec_cfg.draft_loops = 1;
        beam_cfg = spec_cfg;
        beam_cfg.speculative = TL_SPECULATIVE_OFF;
        beam_cfg.beam_size = 2;
        tl_session *spec = NULL, *beam = NULL, *branch = NULL;
        tl_session_new(m, prompt, 5, &spec_cfg, &spec);
        tl_session_new(m, prompt, 5, &beam_cfg, &beam);
        run(spec, 2);
        run(beam, 2);
        tl_generate_config_init(&hooks);
        hooks.depth_policy = exit_at_once;
        CHECK_ERROR(tl_session_fork(spec, &hooks, &branch), TL_ERR_UNSUPPORTED,
                    "speculative decoding (chain) does not combine with early exit");
        CHECK_ERROR(tl_session_fork(beam, &hooks, &branch), TL_ERR_UNSUPPORTED, "does not support early exit");
        tl_generate_config_init(&hooks);
        hooks.stop_rule = never_stop;
        CHECK_ERROR(tl_session_fork(beam, &hooks, &branch), TL_ERR_UNSUPPORTED, "does not support a stop_rule hook");
        CHECK(tl_session_fork(spec, &hooks, &branch) == TL_OK, "a speculative branch with a stop_rule: %s", tl_last_error());
        tl_session_free(branch);
        tl_generate_config_init(&hooks);
        tl_grammar callbacks = {.allowed = allow_everything, .advance = advance_nothing};
        hooks.grammar = &callbacks;
        CHECK_ERROR(tl_session_fork(spec, &hooks, &branch), TL_ERR_UNSUPPORTED, "with a callback grammar is not supported");
        tl_session_state *state = NULL;
        CHECK(tl_session_save(spec, &state) == TL_OK, "%s", tl_last_error());
        CHECK_ERROR(tl_session_resume(m, state, &hooks, &branch), TL_ERR_UNSUPPORTED, "with a callback grammar is not supported");
        tl_session_state_free(state);
        tl_session_free(spec);
        tl_session_free(beam);
    }
    /* a beam search under a compiled grammar: its hypotheses hold states of that grammar, so a
       fork goes on under it (and emits what the parent does), another grammar is refused */
    tl_compiled_grammar *letters = NULL, *digits = NULL;
    tl_grammar use_letters, use_digits;
    if (!letters_and_digits(&letters, &digits, &use_letters, &use_digits)) return;
    tl_generate_config beams;
    tl_generate_config_init(&beams);
    beams.max_tokens = 16;
    beams.ignore_eos = 1;
    beams.beam_size = 3;
    beams.grammar = &use_letters;
    tl_session *whole = NULL, *parent = NULL, *child = NULL, *other = NULL;
    tl_session_new(m, prompt, 5, &beams, &whole);
    tl_session_new(m, prompt, 5, &beams, &parent);
    run(whole, 100);
    run(parent, 5);
    tl_generate_config another = beams;
    another.grammar = &use_digits;
    CHECK(tl_session_fork(parent, NULL, &child) == TL_OK, "a beam search under its grammar: %s", tl_last_error());
    CHECK_ERROR(tl_session_fork(parent, &another, &other), TL_ERR_UNSUPPORTED, "fork it under that same grammar");
    run(child, 100);
    CHECK(child && same_tokens(child, whole), "a beam search forked under its grammar: not the uninterrupted run");
    tl_session_free(whole);
    tl_session_free(parent);
    tl_session_free(child);
    tl_compiled_grammar_free(letters);
    tl_compiled_grammar_free(digits);
}

static void hooks_per_branch(const tl_model *m) {
    const int32_t prompt[3] = {7, 8, 9};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 12;
    cfg.ignore_eos = 1;
    tl_session *parent = NULL, *child = NULL, *alone = NULL;
    tl_session_new(m, prompt, 3, &cfg, &parent);
    run(parent, 4);
    /* The child bans the token the parent emits next: the branches must part there. */
    tl_session *probe = NULL;
    tl_session_fork(parent, NULL, &probe);
    run(probe, 1);
    int32_t banned = probe->tokens[probe->n_tokens - 1];
    tl_session_free(probe);
    tl_generate_config hooks;
    tl_generate_config_init(&hooks);
    hooks.logits_processor = ban;
    hooks.logits_processor_user = &banned;
    CHECK(tl_session_fork(parent, &hooks, &child) == TL_OK, "fork with hooks: %s", tl_last_error());
    run(child, 1);
    CHECK(child->tokens[child->n_tokens - 1] != banned, "the child's own hook did not run");
    run(parent, 1);
    CHECK(parent->tokens[parent->n_tokens - 1] == banned, "the parent's branch changed");
    /* The parent's continuation is the uninterrupted one. */
    tl_session_new(m, prompt, 3, &cfg, &alone);
    run(alone, 5);
    CHECK(same_tokens(alone, parent), "parent after a fork");
    tl_session_free(parent);
    tl_session_free(child);
    tl_session_free(alone);
}

static void saved_states(const tl_model *m, const char *dir) {
    const int32_t prompt[4] = {1, 2, 3, 4};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 30;
    cfg.temperature = 0.7f;
    cfg.sample_seed = 9;
    cfg.ignore_eos = 1;
    tl_session *s = NULL, *whole = NULL, *a = NULL, *b = NULL;
    tl_session_new(m, prompt, 4, &cfg, &s);
    tl_session_new(m, prompt, 4, &cfg, &whole);
    run(whole, 1000);
    run(s, 11);
    tl_session_state *state = NULL;
    CHECK(tl_session_save(s, &state) == TL_OK, "save: %s", tl_last_error());
    tl_session_free(s); /* the state outlives its session */
    CHECK(tl_session_resume(m, state, NULL, &a) == TL_OK && tl_session_resume(m, state, NULL, &b) == TL_OK,
          "resume: %s", tl_last_error());
    run(a, 1000);
    run(b, 1000);
    CHECK(a && b && same_tokens(a, whole) && same_tokens(b, whole), "resumed states continue as the whole run");
    tl_model *other = load(dir); /* the same directory, another model: its cache is not ours */
    tl_session *wrong = (tl_session *)1;
    /* (it said "another model (X), not this one (X)": the one directory twice) */
    CHECK_ERROR(tl_session_resume(other, state, NULL, &wrong), TL_ERR_INVALID_ARGUMENT,
                "saved by another load of");
    /* (the KV types named only where they differ: "its KV cache is f32, this one's f32") */
    CHECK(strstr(tl_last_error(), "KV cache is") == NULL, "the same KV type named: %s", tl_last_error());
    CHECK(wrong == NULL, "out is NULL on error");
    tl_model_free(other);
    tl_load_options other_kv;
    tl_load_options_init(&other_kv);
    const bool half = m->kv_type == TL_KV_F16;
    other_kv.kv_type = half ? TL_KV_F32 : TL_KV_F16;
    other = NULL;
    CHECK(tl_model_load(dir, &other_kv, &other) == TL_OK, "load: %s", tl_last_error());
    CHECK_ERROR(tl_session_resume(other, state, NULL, &wrong), TL_ERR_INVALID_ARGUMENT,
                half ? "(its KV cache is f16, this one's f32)" : "(its KV cache is f32, this one's f16)");
    tl_model_free(other);
    tl_session_free(whole);
    tl_session_free(a);
    tl_session_free(b);
    tl_session_state_free(state);
}

/* The text of s's tokens from `from` on, end-of-text tokens left out (with ignore_eos, an
   accepting grammar allows them and generation goes on), and whether g matches it. */
static char *matched_text(const tl_model *m, const tl_session *s, int from, const tl_compiled_grammar *g, int *match) {
    *match = 0;
    if (!s) return NULL;
    int32_t kept[CAP];
    int n = 0;
    for (int i = from; i < s->n_tokens && n < CAP; i++)
        if (s->tokens[i] != m->cfg.eos_token_id) kept[n++] = s->tokens[i];
    char *text = NULL;
    size_t len = 0;
    if (tl_decode(m, kept, n, &text, &len) == TL_OK) tl_grammar_matches(g, text, len, match);
    return text;
}

/* A compiled grammar runs as each session's own matcher: a fork or a resumed state gets a
   copy of it at the parent's state and outlives the parent (they used to share one matcher,
   freed with the parent); hooks naming another compiled grammar start that one afresh. */
static void compiled_grammars(const tl_model *m) {
    const int32_t prompt[3] = {40, 41, 42};
    tl_compiled_grammar *letters = NULL, *digits = NULL;
    tl_grammar use_letters, use_digits;
    if (!letters_and_digits(&letters, &digits, &use_letters, &use_digits)) return;
    for (int sampled = 0; sampled < 2; sampled++) {
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 24;
        cfg.ignore_eos = 1;
        cfg.grammar = &use_letters;
        if (sampled) { cfg.temperature = 0.8f; cfg.sample_seed = 11; }
        tl_session *whole = NULL, *parent = NULL, *child = NULL, *resumed = NULL, *renamed = NULL, *other = NULL;
        tl_session_new(m, prompt, 3, &cfg, &whole);
        tl_session_new(m, prompt, 3, &cfg, &parent);
        CHECK(whole && parent, "sessions with a compiled grammar: %s", tl_last_error());
        if (!whole || !parent) return;
        run(whole, 1000);
        run(parent, 6);
        tl_session_state *state = NULL;
        CHECK(tl_session_fork(parent, NULL, &child) == TL_OK && tl_session_save(parent, &state) == TL_OK,
              "fork and save with a compiled grammar: %s", tl_last_error());
        tl_generate_config same = cfg, another = cfg;
        another.grammar = &use_digits;
        CHECK(tl_session_fork(parent, &same, &renamed) == TL_OK && tl_session_fork(parent, &another, &other) == TL_OK,
              "fork with grammar hooks: %s", tl_last_error());
        tl_session_free(parent); /* the branches' matchers are their own */
        CHECK(tl_session_resume(m, state, NULL, &resumed) == TL_OK, "resume: %s", tl_last_error());
        tl_session_state_free(state);
        run(child, 1000);
        run(resumed, 1000);
        run(renamed, 1000);
        run(other, 1000);
        CHECK(child && same_tokens(child, whole), "sampled=%d: the fork continues under the parent's grammar state",
              sampled);
        CHECK(resumed && same_tokens(resumed, whole), "sampled=%d: the resumed state too", sampled);
        CHECK(renamed && same_tokens(renamed, whole), "sampled=%d: hooks naming the same grammar continue it", sampled);
        int letters_ok = 0, digits_ok = 0;
        char *text = matched_text(m, whole, 3, letters, &letters_ok);
        tl_free(text);
        text = matched_text(m, other, 3 + 6, digits, &digits_ok);
        CHECK(letters_ok && other && other->n_tokens == 3 + 24, "sampled=%d: the whole run matches its grammar",
              sampled);
        CHECK(digits_ok, "sampled=%d: another compiled grammar starts from its start: '%s'", sampled,
              text ? text : "");
        tl_free(text);
        tl_session_free(whole);
        tl_session_free(child);
        tl_session_free(resumed);
        tl_session_free(renamed);
        tl_session_free(other);
    }
    tl_compiled_grammar_free(letters);
    tl_compiled_grammar_free(digits);
}

static void bad_input(const tl_model *m) {
    const int32_t prompt[2] = {1, 2};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 2;
    tl_session *s = NULL, *child = NULL;
    tl_session_state *state = NULL;
    CHECK_ERROR(tl_session_fork(NULL, NULL, &child), TL_ERR_INVALID_ARGUMENT, "session must not be NULL");
    tl_session_new(m, prompt, 2, &cfg, &s);
    run(s, 10);
    CHECK_ERROR(tl_session_fork(s, NULL, &child), TL_ERR_INVALID_ARGUMENT, "has finished");
    CHECK_ERROR(tl_session_save(s, &state), TL_ERR_INVALID_ARGUMENT, "has finished");
    tl_session_free(s);
    CHECK_ERROR(tl_model_set_prefix_pool((tl_model *)m, 0), TL_ERR_INVALID_ARGUMENT, "budget = 0 bytes must be > 0");
    CHECK_ERROR(tl_model_set_prefix_pool((tl_model *)m, -5), TL_ERR_INVALID_ARGUMENT, "budget = -5 bytes");
    CHECK_ERROR(tl_session_resume(m, NULL, NULL, &child), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
}

/* The pool: a second session on a longer prompt reuses the first one's prefix, with the
   output of a model without a pool, token for token. */
static void prefix_pool(const char *dir) {
    tl_model *pooled = load(dir), *cold = load(dir);
    if (!pooled || !cold) { CHECK(0, "load"); return; }
    CHECK(tl_model_set_prefix_pool(pooled, 64 << 20) == TL_OK, "pool: %s", tl_last_error());
    const int vocab = tl_model_info(pooled)->vocab_size, max_len = tl_model_info(pooled)->max_seq_len;
    int32_t prompt[80];
    const int n = max_len / 2 < 80 ? max_len / 2 : 80;
    for (int i = 0; i < n; i++) prompt[i] = (int32_t)((i * 131 + 7) % vocab);
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 8;
    cfg.ignore_eos = 1;
    int32_t out_a[CAP], out_b[CAP], want[CAP];
    int na, nb, nw;
    tl_generate_stats sa, sb, sw;
    CHECK(tl_generate(pooled, prompt, n - 10, &cfg, out_a, CAP, &na, &sa) == TL_OK && sa.prompt_tokens_reused == 0,
          "first session: nothing to reuse (%d)", sa.prompt_tokens_reused);
    CHECK(tl_generate(pooled, prompt, n, &cfg, out_b, CAP, &nb, &sb) == TL_OK, "second: %s", tl_last_error());
    CHECK(sb.prompt_tokens_reused == n - 10, "second session reused %d of its %d prompt tokens (want %d)",
          sb.prompt_tokens_reused, n, n - 10);
    CHECK(sa.prefill_tokens == n - 10 && sb.prefill_tokens == 10, "the prefill computed %d and %d prompt tokens (want %d, 10)",
          sa.prefill_tokens, sb.prefill_tokens, n - 10);
    tl_generate(cold, prompt, n, &cfg, want, CAP, &nw, &sw);
    CHECK(nb == nw && memcmp(out_b, want, (size_t)nw * sizeof *want) == 0, "pooled output differs from a cold start");
    /* The same prompt again: all but its last token come from the pool. */
    CHECK(tl_generate(pooled, prompt, n, &cfg, out_b, CAP, &nb, &sb) == TL_OK && sb.prompt_tokens_reused == n - 1 &&
              memcmp(out_b, want, (size_t)nw * sizeof *want) == 0,
          "repeat: reused %d", sb.prompt_tokens_reused);
    /* Another depth never shares rows computed at this one. */
    cfg.loops = tl_model_info(pooled)->default_loops + 1;
    CHECK(tl_generate(pooled, prompt, n, &cfg, out_b, CAP, &nb, &sb) == TL_OK && sb.prompt_tokens_reused == 0,
          "another depth reused %d", sb.prompt_tokens_reused);
    /* A budget of one byte set: the entries leave at once (they stayed, and were served,
       until an offer of a new entry that fit), nothing is reused after. */
    tl_model_memory mem;
    tl_model_get_memory(pooled, &mem);
    CHECK(mem.kv_bytes > 0, "the pool holds pages: %lld bytes", (long long)mem.kv_bytes);
    CHECK(tl_model_set_prefix_pool(pooled, 1) == TL_OK, "new budget");
    tl_model_get_memory(pooled, &mem);
    CHECK(mem.kv_bytes == 0, "a 1-byte pool still holds %lld bytes of pages", (long long)mem.kv_bytes);
    cfg.loops = 0;
    CHECK(tl_generate(pooled, prompt, n, &cfg, out_b, CAP, &nb, &sb) == TL_OK && sb.prompt_tokens_reused == 0,
          "a 1-byte pool still served %d tokens", sb.prompt_tokens_reused);
    tl_generate(pooled, prompt + 1, n - 1, &cfg, out_a, CAP, &na, &sa);
    CHECK(tl_generate(pooled, prompt + 1, n - 1, &cfg, out_a, CAP, &na, &sa) == TL_OK && sa.prompt_tokens_reused == 0,
          "a 1-byte pool still reused %d tokens", sa.prompt_tokens_reused);
    tl_model_free(pooled);
    tl_model_free(cold);
}

/* The pool serves the longest prefix it holds, whichever entry holds it: prompts over three
   tokens at two depths, each session reusing exactly the longest common prefix of its prompt
   (all but the last token at most) with the sequences earlier sessions offered at its depth
   (their prompts, then their rows at the end), counted here by comparing with every one of
   them; and each continuing as a cold start does. The pool keeps its entries in an order where
   that prefix is a neighbour's (prefix_pool.c): a lookup that missed a neighbour, or an order
   broken by an insertion or a removal, reuses less. */
#define MAX_OFFERED 512
static void prefix_pool_longest_prefix(const char *dir) {
    tl_model *pooled = load(dir), *cold = load(dir);
    if (!pooled || !cold) { CHECK(0, "load"); tl_model_free(pooled); tl_model_free(cold); return; }
    CHECK(tl_model_set_prefix_pool(pooled, 256 << 20) == TL_OK, "pool: %s", tl_last_error());
    static int32_t offered[MAX_OFFERED][24];
    int offered_len[MAX_OFFERED], offered_loops[MAX_OFFERED], n_offered = 0;
    uint32_t draw = 12345;
    int failures = 0, reused_total = 0;
    for (int session = 0; session < 150 && n_offered + 2 <= MAX_OFFERED; session++) {
        int32_t prompt[16];
        draw = draw * 1103515245u + 12345u;
        const int n = 2 + (int)((draw >> 16) % 12);
        for (int i = 0; i < n; i++) {
            draw = draw * 1103515245u + 12345u;
            prompt[i] = 5 + (int32_t)((draw >> 16) % 3);
        }
        draw = draw * 1103515245u + 12345u;
        const int loops = tl_model_info(pooled)->default_loops + (int)((draw >> 16) % 2);
        const int steps = 1 + (int)((draw >> 20) % 3);
        int want = 0;
        for (int k = 0; k < n_offered; k++)
            if (offered_loops[k] == loops) {
                const int len = common_prefix_len(offered[k], offered_len[k], prompt, n - 1);
                if (len > want) want = len;
            }
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.loops = loops;
        cfg.max_tokens = steps;
        cfg.ignore_eos = 1;
        tl_session *s = NULL, *c = NULL;
        if (tl_session_new(pooled, prompt, n, &cfg, &s) != TL_OK || tl_session_new(cold, prompt, n, &cfg, &c) != TL_OK) {
            CHECK(0, "session %d: %s", session, tl_last_error());
            tl_session_free(s);
            break;
        }
        run(s, steps);
        run(c, steps);
        if (s->stats.prompt_tokens_reused != want || !same_tokens(s, c)) {
            if (failures++ < 3)
                CHECK(0, "session %d (%d prompt tokens): reused %d, the longest pooled prefix is %d; as a cold start: %d",
                      session, n, s->stats.prompt_tokens_reused, want, same_tokens(s, c));
        }
        reused_total += s->stats.prompt_tokens_reused;
        /* what the session offers: its prompt's rows, then at the end all its rows */
        const int ends[2] = {n, s->cache->length};
        for (int e = 0; e < 2; e++) {
            memcpy(offered[n_offered], s->tokens, (size_t)ends[e] * sizeof(int32_t));
            offered_len[n_offered] = ends[e];
            offered_loops[n_offered++] = loops;
        }
        tl_session_free(s);
        tl_session_free(c);
    }
    CHECK(failures == 0, "%d sessions reused other than the longest pooled prefix", failures);
    CHECK(reused_total > 300, "the sessions reused %d prompt tokens in all: too few to test the lookup", reused_total);
    tl_model_free(pooled);
    tl_model_free(cold);
}

/* Conversations that open with one system prompt share its pages in the pool: the budget
   counts them once (each entry counted its own, and a pool whose pages fitted eight such
   conversations kept two). A budget of exactly the pages of eight keeps all eight. */
static void run_conversations(tl_model *m, const int32_t *system, int n_system, int32_t *prompt, int n_own, int *reused) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 2;
    cfg.ignore_eos = 1;
    const int vocab = tl_model_info(m)->vocab_size;
    for (int c = 0; c < 8; c++) {
        memcpy(prompt, system, (size_t)n_system * sizeof *prompt);
        for (int i = 0; i < n_own; i++) prompt[n_system + i] = (int32_t)((c * 977 + i * 31 + 5) % vocab);
        int32_t out[CAP];
        int n_out = 0;
        tl_generate_stats st;
        CHECK(tl_generate(m, prompt, n_system + n_own, &cfg, out, CAP, &n_out, &st) == TL_OK, "conversation %d: %s", c,
              tl_last_error());
        if (reused) reused[c] = st.prompt_tokens_reused;
    }
}

static void prefix_pool_shared_pages(const char *dir) {
    tl_model *sizing = load(dir), *pooled = load(dir);
    if (!sizing || !pooled) { CHECK(0, "load"); tl_model_free(sizing); return; }
    const int vocab = tl_model_info(pooled)->vocab_size;
    enum { SYSTEM = 64, OWN = 16 };
    int32_t system[SYSTEM], prompt[SYSTEM + OWN];
    for (int i = 0; i < SYSTEM; i++) system[i] = (int32_t)((i * 211 + 3) % vocab);
    /* the pages the eight conversations' entries hold, shared ones once */
    CHECK(tl_model_set_prefix_pool(sizing, 64 << 20) == TL_OK, "pool: %s", tl_last_error());
    run_conversations(sizing, system, SYSTEM, prompt, OWN, NULL);
    tl_model_memory mem;
    tl_model_get_memory(sizing, &mem);
    const int64_t pages_of_eight = mem.kv_bytes;
    CHECK(pages_of_eight > 0, "the pool holds pages");
    /* a pool of exactly that: every conversation's own part is still there */
    CHECK(tl_model_set_prefix_pool(pooled, pages_of_eight) == TL_OK, "pool: %s", tl_last_error());
    run_conversations(pooled, system, SYSTEM, prompt, OWN, NULL);
    int reused[8];
    run_conversations(pooled, system, SYSTEM, prompt, OWN, reused);
    for (int c = 0; c < 8; c++)
        CHECK(reused[c] == SYSTEM + OWN - 1, "conversation %d again reused %d of its %d prompt tokens (want %d)", c, reused[c],
              SYSTEM + OWN, SYSTEM + OWN - 1);
    tl_model_get_memory(pooled, &mem);
    CHECK(mem.kv_bytes <= pages_of_eight, "the pool holds %lld bytes, over its budget of %lld", (long long)mem.kv_bytes,
          (long long)pages_of_eight);
    tl_model_free(sizing);
    tl_model_free(pooled);
}

/* A plain session that ends offers its generated rows too: a prompt that resends its text
   and more (a chat's next turn) reuses all of it, and decodes as a cold start does. Only rows
   at the session's full depth are offered, up to the first shallower one (an early exit's,
   its own or inherited by a fork that dropped the depth policy); rows read from saved bytes
   never are. */

/* Exits every decode token at its first loop. */
static int exit_at_once(void *user, const tl_loop_signals *signals) {
    (void)user;
    (void)signals;
    return TL_HOOK_STOP;
}

/* Early exit gives back the pages of the slots a finished page's rows never reached: a
   session at 4 loops whose decode tokens all exit at the first holds, past the prompt's
   pages, the pages of one loop (it held those of 4), with the tokens of a session holding
   them all (KV sharing reads a shallower row's deepest slot: the pages given back are never
   read). Its fork, a save and a rollback into a trimmed page go on alike. */
static void early_exit_pages(const char *dir) {
    tl_model *m = load(dir);
    if (!m) { CHECK(0, "load"); return; }
    const tl_config *mc = &m->cfg;
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.loops = mc->max_loops;
    cfg.max_tokens = 96;
    cfg.ignore_eos = 1;
    cfg.depth_policy = exit_at_once;
    int32_t prompt[16];
    for (int i = 0; i < 16; i++) prompt[i] = (int32_t)((i * 131 + 7) % mc->vocab_size);
    tl_session *s = NULL;
    CHECK(tl_session_new(m, prompt, 16, &cfg, &s) == TL_OK, "session: %s", tl_last_error());
    if (!s) { tl_model_free(m); return; }
    run(s, 80); /* 95 entries: the prompt's page, then pages of decode rows */
    const int per_loop = mc->n_block, outer = mc->n_prelude + mc->n_coda, done = s->cache->trimmed_blocks;
    CHECK(done == s->cache->length / TL_KV_PAGE_ROWS, "%d pages looked at of %d whole ones", done,
          s->cache->length / TL_KV_PAGE_ROWS);
    size_t held = 0;
    for (int p = 0; p < done; p++)
        for (int slot = 0; slot < s->cache->n_slots; slot++) held += s->cache->pages[(size_t)slot * s->cache->n_pages + p] != NULL;
    /* the prompt's page at full depth; the decode pages at one loop */
    const size_t want = (size_t)(outer + per_loop * mc->max_loops) + (size_t)(outer + per_loop) * (size_t)(done - 1);
    CHECK(done >= 4 && held == want, "early-exited pages: %zu held (want %zu)", held, want);
    /* the same tokens as a session without early exit's pages given back: a fork of the
       trimmed cache continues as the session does */
    tl_session *child = NULL;
    CHECK(tl_session_fork(s, NULL, &child) == TL_OK, "fork: %s", tl_last_error());
    run(s, 8);
    run(child, 8);
    CHECK(child && same_tokens(s, child), "a fork of the trimmed session differs from it");
    tl_session_free(child);
    tl_session_free(s);
    tl_model_free(m);
}

/* The next turn of `turn` (n tokens, then MORE of its own) on the pooled model: how many
   prompt tokens it reused, and whether its output is the cold model's. */
enum { N = 20, GEN = 8, MORE = 3 };
static int next_turn_reuse(tl_model *pooled, tl_model *cold, const int32_t *turn, int n, bool *as_cold) {
    const int vocab = tl_model_info(pooled)->vocab_size;
    int32_t prompt[CAP], got[CAP], want[CAP];
    memcpy(prompt, turn, (size_t)n * sizeof *prompt);
    for (int i = 0; i < MORE; i++) prompt[n + i] = (int32_t)((i * 53 + 5) % vocab);
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = GEN;
    cfg.ignore_eos = 1;
    cfg.loops = tl_model_info(pooled)->max_loops; /* the turns' depth, deep enough to exit early */
    int n_got = 0, n_want = 0;
    tl_generate_stats stats = {0}, cold_stats;
    const bool ok = tl_generate(pooled, prompt, n + MORE, &cfg, got, CAP, &n_got, &stats) == TL_OK &&
                    tl_generate(cold, prompt, n + MORE, &cfg, want, CAP, &n_want, &cold_stats) == TL_OK;
    *as_cold = ok && n_got == n_want && memcmp(got, want, (size_t)n_want * sizeof *want) == 0;
    return stats.prompt_tokens_reused;
}

/* Entries of c at its session's full depth before the first shallower one. */
static int full_depth_rows(const tl_session *s) {
    int n = 0;
    while (n < s->cache->length && s->cache->depth[tl_kv_row(s->cache, n)] == s->loops) n++;
    return n;
}

static void prefix_pool_keeps_generations(const char *dir) {
    tl_model *pooled = load(dir), *cold = load(dir);
    if (!pooled || !cold) { CHECK(0, "load"); return; }
    CHECK(tl_model_set_prefix_pool(pooled, 64 << 20) == TL_OK, "pool: %s", tl_last_error());
    const int vocab = tl_model_info(pooled)->vocab_size;
    int32_t first[N];
    int variant = 0; /* each case its own prompt, so that none reuses another's rows */
#define NEW_PROMPT() for (int i = 0; i < N; i++) first[i] = (int32_t)((i * 37 + 11 + 101 * variant) % vocab); variant++
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = GEN;
    cfg.ignore_eos = 1;
    cfg.loops = tl_model_info(pooled)->max_loops; /* deep enough for an early exit to be shallower */
    bool as_cold;

    /* plain: every row the first turn computed, its prompt and all but its last token */
    NEW_PROMPT();
    tl_session *s = NULL;
    CHECK(tl_session_new(pooled, first, N, &cfg, &s) == TL_OK && run(s, GEN) == N + GEN, "plain turn: %s", tl_last_error());
    int reused = next_turn_reuse(pooled, cold, s->tokens, s->n_tokens, &as_cold);
    CHECK(reused == N + GEN - 1 && as_cold, "the next turn reused %d prompt tokens (want %d), as a cold start: %d", reused,
          N + GEN - 1, as_cold);
    tl_session_free(s);

    /* early exit: the rows up to the first shallow one */
    NEW_PROMPT();
    tl_generate_config early = cfg;
    early.early_exit_patience = 1; /* any loop-state change counts as settled: exits at loop 2 */
    early.early_exit_min_L = 1;
    early.early_exit_threshold = 1e30f;
    CHECK(tl_session_new(pooled, first, N, &early, &s) == TL_OK && run(s, GEN) == N + GEN, "early exit: %s", tl_last_error());
    int full = full_depth_rows(s);
    CHECK(full >= N && full < s->cache->length, "the early-exit turn has %d full-depth rows of %d (want a shallow one)", full,
          s->cache->length);
    reused = next_turn_reuse(pooled, cold, s->tokens, s->n_tokens, &as_cold);
    CHECK(reused == full && as_cold, "after an early exit the next turn reused %d prompt tokens (want %d), as a cold start: %d",
          reused, full, as_cold);
    tl_session_free(s);

    /* a fork whose hooks drop the parent's depth policy: the parent's shallow rows stay out */
    NEW_PROMPT();
    tl_generate_config policy = cfg;
    policy.depth_policy = exit_at_once;
    tl_session *parent = NULL, *child = NULL;
    CHECK(tl_session_new(pooled, first, N, &policy, &parent) == TL_OK && run(parent, 3) == N + 3, "policy: %s",
          tl_last_error());
    tl_generate_config no_hooks;
    tl_generate_config_init(&no_hooks);
    CHECK(tl_session_fork(parent, &no_hooks, &child) == TL_OK && !tl_early_exit_on(&child->cfg), "fork: %s", tl_last_error());
    run(child, GEN);
    full = full_depth_rows(child);
    CHECK(full == N, "the fork holds %d full-depth rows (want the prompt's, %d)", full, N);
    reused = next_turn_reuse(pooled, cold, child->tokens, child->n_tokens, &as_cold);
    CHECK(reused == N && as_cold, "after the fork the next turn reused %d prompt tokens (want %d), as a cold start: %d", reused,
          N, as_cold);
    tl_session_free(parent);
    tl_session_free(child);

    /* a session resumed from saved bytes offers nothing (its prompt was offered by the
       session that saved it, on the cold model, which has no pool) */
    NEW_PROMPT();
    tl_session_state *state = NULL, *read = NULL;
    void *bytes = NULL;
    size_t len = 0;
    CHECK(tl_session_new(cold, first, N, &cfg, &s) == TL_OK && run(s, 2) == N + 2 && tl_session_save(s, &state) == TL_OK &&
              tl_session_state_to_bytes(state, &bytes, &len) == TL_OK &&
              tl_session_state_from_bytes(pooled, bytes, len, &read) == TL_OK,
          "save and read: %s", tl_last_error());
    tl_session_free(s);
    s = NULL;
    CHECK(tl_session_resume(pooled, read, NULL, &s) == TL_OK && run(s, GEN) == N + GEN, "resume: %s", tl_last_error());
    reused = next_turn_reuse(pooled, cold, s->tokens, s->n_tokens, &as_cold);
    CHECK(reused == 0 && as_cold, "after a resumed session the next turn reused %d prompt tokens (want 0)", reused);
    tl_session_free(s);
    tl_session_state_free(state);
    tl_session_state_free(read);
    tl_free(bytes);

    /* saved before its first step, holding a prefix it took from a pool: read back, its
       prefill (the last prompt token) must not offer the rows that came from the bytes */
    NEW_PROMPT();
    tl_model *donor = load(dir);
    CHECK(donor && tl_model_set_prefix_pool(donor, 64 << 20) == TL_OK, "donor pool: %s", tl_last_error());
    int n_out;
    int32_t out[CAP];
    tl_generate(donor, first, N, &cfg, out, CAP, &n_out, NULL); /* the donor's pool holds the prompt */
    state = read = NULL;
    bytes = NULL;
    s = NULL;
    CHECK(tl_session_new(donor, first, N, &cfg, &s) == TL_OK && s->cache->length == N - 1 &&
              tl_session_save(s, &state) == TL_OK && tl_session_state_to_bytes(state, &bytes, &len) == TL_OK &&
              tl_session_state_from_bytes(pooled, bytes, len, &read) == TL_OK,
          "save before the first step: %s", tl_last_error());
    tl_session_free(s);
    s = NULL;
    CHECK(tl_session_resume(pooled, read, NULL, &s) == TL_OK && s->rows_from_bytes && run(s, 1) == N + 1, "resume: %s",
          tl_last_error());
    reused = next_turn_reuse(pooled, cold, first, N, &as_cold);
    CHECK(reused == 0 && as_cold, "after a state read before its prefill the next turn reused %d prompt tokens (want 0)",
          reused);
    tl_session_free(s);
    tl_session_state_free(state);
    tl_session_state_free(read);
    tl_free(bytes);
    tl_model_free(donor);
#undef NEW_PROMPT
    tl_model_free(pooled);
    tl_model_free(cold);
}

/* Two first calls of tl_model_set_prefix_pool at once install one pool (each made its own
   and one was lost: a leak under LeakSanitizer, a race under ThreadSanitizer). */
typedef struct { tl_model *model; int64_t budget; pthread_barrier_t *start; tl_status status; } set_pool_job;
static void *set_pool_thread(void *arg) {
    set_pool_job *j = arg;
    pthread_barrier_wait(j->start);
    j->status = tl_model_set_prefix_pool(j->model, j->budget);
    return NULL;
}
static void prefix_pool_first_calls(const char *dir) {
    for (int round = 0; round < 20; round++) {
        tl_model *m = load(dir);
        if (!m) { CHECK(0, "load"); return; }
        pthread_barrier_t start;
        pthread_barrier_init(&start, NULL, 2);
        set_pool_job jobs[2] = {{m, 1 << 20, &start, TL_ERR_INTERNAL}, {m, 2 << 20, &start, TL_ERR_INTERNAL}};
        pthread_t threads[2];
        for (int t = 0; t < 2; t++) pthread_create(&threads[t], NULL, set_pool_thread, &jobs[t]);
        for (int t = 0; t < 2; t++) pthread_join(threads[t], NULL);
        pthread_barrier_destroy(&start);
        CHECK(jobs[0].status == TL_OK && jobs[1].status == TL_OK, "round %d: %s, %s", round,
              tl_status_name(jobs[0].status), tl_status_name(jobs[1].status));
        tl_model_free(m);
    }
}

/* A model whose loop starts from a random state (Huginn) draws it from the config's seed,
   and the prompt's K/V depend on it: the pool shares a prefix only with a session of the
   same seed (it gave seed 2 the K/V computed under seed 1, and other tokens than a cold
   start's). */
static void prefix_pool_seeded(const char *huginn_dir) {
    tl_model *pooled = load(huginn_dir), *cold = load(huginn_dir);
    if (!pooled || !cold) { CHECK(0, "load %s", huginn_dir); return; }
    CHECK(tl_model_set_prefix_pool(pooled, 64 << 20) == TL_OK, "pool: %s", tl_last_error());
    const int vocab = tl_model_info(pooled)->vocab_size;
    int32_t prompt[12];
    for (int i = 0; i < 12; i++) prompt[i] = (int32_t)((i * 37 + 5) % vocab);
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 12;
    cfg.ignore_eos = 1;
    int32_t got[CAP], want[CAP];
    int n_got, n_want;
    tl_generate_stats sg, sw;
    for (int round = 0; round < 3; round++) {
        cfg.sample_seed = round == 1 ? 2 : 1; /* fills the pool under 1, then 2, then 1 again */
        CHECK(tl_generate(pooled, prompt, 12, &cfg, got, CAP, &n_got, &sg) == TL_OK, "%s", tl_last_error());
        CHECK(tl_generate(cold, prompt, 12, &cfg, want, CAP, &n_want, &sw) == TL_OK, "%s", tl_last_error());
        CHECK(n_got == n_want && !memcmp(got, want, (size_t)n_want * sizeof *want),
              "seed %llu, round %d: the pooled output differs from a cold start", (unsigned long long)cfg.sample_seed,
              round);
        CHECK(sg.prompt_tokens_reused == (round == 2 ? 11 : 0), "round %d reused %d prompt tokens", round,
              sg.prompt_tokens_reused);
    }
    /* fixed_state_seed: the state sample_seed 0 draws, whatever the sampling's seed. Sampled
       sessions of seeds 3, 4 and 5 then share the prompt's pages (each its own tokens, those
       of a cold start); greedy, seed 9 and fixed gives seed 0's tokens. */
    cfg.fixed_state_seed = 1;
    cfg.temperature = 0.9f;
    for (int round = 0; round < 3; round++) {
        cfg.sample_seed = (uint64_t)(3 + round);
        CHECK(tl_generate(pooled, prompt, 12, &cfg, got, CAP, &n_got, &sg) == TL_OK, "%s", tl_last_error());
        CHECK(tl_generate(cold, prompt, 12, &cfg, want, CAP, &n_want, &sw) == TL_OK, "%s", tl_last_error());
        CHECK(n_got == n_want && !memcmp(got, want, (size_t)n_want * sizeof *want),
              "fixed state, seed %llu: the pooled output differs from a cold start", (unsigned long long)cfg.sample_seed);
        CHECK(sg.prompt_tokens_reused == (round > 0 ? 11 : 0), "fixed state, round %d reused %d prompt tokens", round,
              sg.prompt_tokens_reused);
    }
    cfg.temperature = 0.0f;
    cfg.sample_seed = 9;
    CHECK(tl_generate(cold, prompt, 12, &cfg, got, CAP, &n_got, &sg) == TL_OK, "%s", tl_last_error());
    cfg.fixed_state_seed = 0;
    cfg.sample_seed = 0;
    CHECK(tl_generate(cold, prompt, 12, &cfg, want, CAP, &n_want, &sw) == TL_OK, "%s", tl_last_error());
    CHECK(n_got == n_want && !memcmp(got, want, (size_t)n_want * sizeof *want), "fixed state, greedy: not seed 0's tokens");
    cfg.fixed_state_seed = 2;
    CHECK_ERROR(tl_generate(cold, prompt, 12, &cfg, got, CAP, &n_got, &sg), TL_ERR_INVALID_ARGUMENT,
                "fixed_state_seed = 2 must be 0 or 1");
    tl_model_free(pooled);
    tl_model_free(cold);
}

/* Speculative decoding (chain, sampled chain, tree) and beam search prefill their prompt but
   its last token with plain rows at full depth: they take a pooled prefix and offer their
   prompt, as plain sessions do. Each mode, on a prompt that resends a plain generation and
   goes on, reuses all that generation's rows and emits exactly what it emits on a model
   without a pool, alone and stepped in a batch (the batch prefills the prompts of its
   speculative and beam sessions in the shared pass). Then the next plain turn after each
   mode's generation reuses the mode's rows: a beam search's prompt (past it, its cache is
   every beam's rows), a speculative session's prompt and accepted tokens (the verifier's
   rows are plain decoding's bit for bit), and continues as a cold start does. */
static void prefix_pool_other_decoders(const char *dir) {
    tl_model *pooled = load(dir), *cold = load(dir);
    if (!pooled || !cold) { CHECK(0, "load"); tl_model_free(pooled); tl_model_free(cold); return; }
    CHECK(tl_model_set_prefix_pool(pooled, 64 << 20) == TL_OK, "pool: %s", tl_last_error());
    const int vocab = tl_model_info(pooled)->vocab_size;
    enum { MODES = 4 };
    const char *names[MODES] = {"chain", "sampled chain", "tree", "beam"};
    tl_generate_config modes[MODES];
    for (int i = 0; i < MODES; i++) {
        tl_generate_config_init(&modes[i]);
        modes[i].max_tokens = GEN;
        modes[i].ignore_eos = 1;
        modes[i].loops = tl_model_info(pooled)->max_loops; /* next_turn_reuse's depth */
        modes[i].draft_loops = 1;
    }
    modes[0].speculative = modes[1].speculative = TL_SPECULATIVE_CHAIN;
    modes[1].temperature = 0.9f;
    modes[1].sample_seed = 5;
    modes[2].speculative = TL_SPECULATIVE_TREE;
    modes[2].K_branches = 2;
    modes[2].max_nodes = 9;
    modes[3].beam_size = 3;
    tl_generate_config plain;
    tl_generate_config_init(&plain);
    plain.max_tokens = GEN;
    plain.ignore_eos = 1;
    plain.loops = modes[0].loops;
    for (int mode = 0; mode < MODES; mode++) {
        for (int batched = 0; batched < 2; batched++) {
            /* A plain generation into the pool, then the mode on its text and MORE tokens. */
            int32_t prompt[CAP];
            for (int i = 0; i < N; i++) prompt[i] = (int32_t)((i * 41 + 3 + 97 * (2 * mode + batched)) % vocab);
            tl_session *first = NULL, *got = NULL, *want = NULL;
            CHECK(tl_session_new(pooled, prompt, N, &plain, &first) == TL_OK && run(first, GEN) == N + GEN, "%s: plain: %s",
                  names[mode], tl_last_error());
            if (!first) continue;
            const int n = N + GEN + MORE;
            memcpy(prompt, first->tokens, (size_t)(N + GEN) * sizeof *prompt);
            tl_session_free(first);
            for (int i = 0; i < MORE; i++) prompt[N + GEN + i] = (int32_t)((i * 29 + 13) % vocab);
            CHECK(tl_session_new(pooled, prompt, n, &modes[mode], &got) == TL_OK &&
                      tl_session_new(cold, prompt, n, &modes[mode], &want) == TL_OK,
                  "%s: sessions: %s", names[mode], tl_last_error());
            if (!got || !want) { tl_session_free(got); tl_session_free(want); continue; }
            if (batched) {
                /* stepped together with a plain session, as an engine steps them */
                tl_session *other = NULL;
                CHECK(tl_session_new(pooled, prompt + 1, N, &plain, &other) == TL_OK, "other: %s", tl_last_error());
                for (int step = 0; step < GEN && !got->finished; step++) {
                    tl_session *pair[2] = {got, other};
                    int32_t tokens[2];
                    tl_stop_reason stops[2];
                    tl_status statuses[2];
                    const int live = other && !other->finished ? 2 : 1;
                    CHECK(tl_session_step_batch(pair, live, tokens, stops, statuses) == TL_OK && statuses[0] == TL_OK,
                          "%s: batch step: %s", names[mode], tl_session_error(got));
                }
                tl_session_free(other);
            } else {
                run(got, GEN);
            }
            run(want, GEN);
            CHECK(got->stats.prompt_tokens_reused == N + GEN - 1 && got->stats.prefill_tokens == n - 1 - (N + GEN - 1),
                  "%s%s: reused %d prompt tokens (want %d), computed %d", names[mode], batched ? " in a batch" : "",
                  got->stats.prompt_tokens_reused, N + GEN - 1, got->stats.prefill_tokens);
            CHECK(got->n_tokens == n + GEN && same_tokens(got, want), "%s%s: the pooled output differs from a cold start",
                  names[mode], batched ? " in a batch" : "");
            /* (the prefill's passes: one of 30 rows cold, one of 3 from the pool, alone or in the
               batch's shared pass) */
            CHECK(got->stats.verify_forwards == want->stats.verify_forwards, "%s%s: %d forwards at the verify depth, cold %d",
                  names[mode], batched ? " in a batch" : "", got->stats.verify_forwards, want->stats.verify_forwards);
            tl_session_free(want);
            if (batched) { tl_session_free(got); continue; }
            /* the next plain turn after the mode's generation */
            bool as_cold = false;
            const int reused = next_turn_reuse(pooled, cold, got->tokens, got->n_tokens, &as_cold);
            const int low = modes[mode].beam_size ? n - 1 : got->n_tokens - 1;
            const int high = modes[mode].beam_size ? n - 1 : got->n_tokens;
            CHECK(reused >= low && reused <= high && as_cold,
                  "%s: the next turn reused %d prompt tokens (want %d to %d), as a cold start: %d", names[mode], reused, low,
                  high, as_cold);
            tl_session_free(got);
        }
    }
    /* Stopped within a cycle (a stop sequence on a token the verifier accepted): the chain's
       rows then run to its last token, whose row the verification computed; a tree's to its
       first branch off the nodes' order. Each stop token is the cold chain's at that place. */
    int ended_on_accepted = 0;
    for (int mode = 0; mode <= 2; mode += 2)
        for (int at = 1; at <= GEN; at++) {
            int32_t prompt[N], cold_out[CAP];
            for (int i = 0; i < N; i++) prompt[i] = (int32_t)((i * 23 + 7 + 89 * (at + GEN * mode)) % vocab);
            int n_cold = 0;
            tl_generate_config cfg = modes[mode];
            CHECK(tl_generate(cold, prompt, N, &cfg, cold_out, CAP, &n_cold, NULL) == TL_OK && n_cold == N + GEN, "%s: %s",
                  names[mode], tl_last_error());
            const tl_token_seq stop = {&cold_out[N + at - 1], 1};
            cfg.stop_sequences = &stop;
            cfg.n_stop_sequences = 1;
            tl_session *s = NULL;
            CHECK(tl_session_new(pooled, prompt, N, &cfg, &s) == TL_OK && run(s, GEN) > N && s->finished, "%s: %s",
                  names[mode], tl_last_error());
            if (!s) continue;
            /* the first logits of the next turn, not only its tokens: a row of another node's
               K/V in the pool moves them before it flips an argmax */
            int32_t next[CAP];
            memcpy(next, s->tokens, (size_t)s->n_tokens * sizeof *next);
            next[s->n_tokens] = 1; /* (a prompt takes all but its last token from the pool) */
            tl_session *next_pooled = NULL, *next_cold = NULL;
            CHECK(tl_session_new(pooled, next, s->n_tokens + 1, &plain, &next_pooled) == TL_OK &&
                      tl_session_new(cold, next, s->n_tokens + 1, &plain, &next_cold) == TL_OK && run(next_pooled, 1) > 0 &&
                      run(next_cold, 1) > 0,
                  "next turn: %s", tl_last_error());
            CHECK(next_pooled && next_cold && next_pooled->stats.prompt_tokens_reused > 0 &&
                      memcmp(next_pooled->logits, next_cold->logits, (size_t)vocab * sizeof(float)) == 0,
                  "%s stopped at token %d: the next turn's first logits on the pool differ from a cold start's", names[mode], at);
            tl_session_free(next_pooled);
            tl_session_free(next_cold);
            bool as_cold = false;
            const int reused = next_turn_reuse(pooled, cold, s->tokens, s->n_tokens, &as_cold);
            const int low = mode == 0 ? s->n_tokens - 1 : N - 1;
            CHECK(reused >= low && reused <= s->n_tokens && as_cold,
                  "%s stopped at token %d: the next turn reused %d prompt tokens (want %d to %d), as a cold start: %d",
                  names[mode], at, reused, low, s->n_tokens, as_cold);
            ended_on_accepted += mode == 0 && reused == s->n_tokens;
            tl_session_free(s);
        }
    CHECK(ended_on_accepted > 0, "no chain stopped on a token its verification had computed");
    tl_model_free(pooled);
    tl_model_free(cold);
}

static int stop_at_length(void *user, const int32_t *tokens, int n) {
    (void)tokens;
    return n >= *(const int *)user;
}

/* A session of `window` on `pooled` against one on `cold`: the same logits at every step and
   the same tokens; returns the rows it took from the pool (-1: it failed). */
static int windowed_against_cold(tl_model *pooled, tl_model *cold, const int32_t *prompt, int n, int window) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 40;
    cfg.ignore_eos = 1;
    cfg.cache_window = window;
    tl_session *want = NULL, *got = NULL;
    tl_session_new(cold, prompt, n, &cfg, &want);
    tl_session_new(pooled, prompt, n, &cfg, &got);
    CHECK(want && got, "window %d: sessions: %s", window, tl_last_error());
    int reused = -1;
    if (want && got) {
        const size_t row_bytes = (size_t)tl_model_info(cold)->vocab_size * sizeof(float);
        bool same_logits = true;
        for (int t = 0; t < 40 && !want->finished && !got->finished; t++) {
            if (run(want, 1) < 0 || run(got, 1) < 0) break;
            same_logits = same_logits && memcmp(want->logits, got->logits, row_bytes) == 0;
        }
        CHECK(same_logits && got->n_tokens == n + 40 && same_tokens(want, got),
              "window %d: a session that took %d rows from the pool differs from a cold one", window,
              got->stats.prompt_tokens_reused);
        reused = got->stats.prompt_tokens_reused;
    }
    tl_session_free(want);
    tl_session_free(got);
    return reused;
}

/* Sessions with a window (cache_window W) take from the pool the rows before W, and offer
   them while their ring holds them: a row before W attends to every row before it, as an
   unwindowed session's (they neither took nor offered, a long system prompt recomputed by every
   windowed request). Around the 16-row page: windows of 15, 16, 17, 24. */
static void prefix_pool_windowed(const char *dir) {
    tl_model *pooled = load(dir), *cold = load(dir);
    if (!pooled || !cold) { CHECK(0, "load"); tl_model_free(pooled); tl_model_free(cold); return; }
    CHECK(tl_model_set_prefix_pool(pooled, 64 << 20) == TL_OK, "pool: %s", tl_last_error());
    enum { LEN = 60 };
    int32_t prompt[LEN];
    for (int i = 0; i < LEN; i++) prompt[i] = (int32_t)((i * 37 + 11) % 250 + 1);
    tl_generate_config plain;
    tl_generate_config_init(&plain);
    plain.max_tokens = 4;
    plain.ignore_eos = 1;
    int32_t out[CAP];
    int n_out = 0;
    CHECK(tl_generate(pooled, prompt, LEN, &plain, out, CAP, &n_out, NULL) == TL_OK, "%s", tl_last_error());
    const int windows[] = {15, 16, 17, 24};
    for (int w = 0; w < 4; w++) {
        const int reused = windowed_against_cold(pooled, cold, prompt, LEN, windows[w]);
        CHECK(reused == windows[w], "window %d took %d rows from the pool (want the %d before it)", windows[w], reused,
              windows[w]);
    }
    /* A windowed session's own rows: offered before its window while its ring holds them */
    CHECK(tl_model_set_prefix_pool(pooled, 1) == TL_OK && tl_model_set_prefix_pool(pooled, 64 << 20) == TL_OK, "emptied");
    int32_t other[30];
    for (int i = 0; i < 30; i++) other[i] = (int32_t)((i * 53 + 5) % 250 + 1);
    CHECK(windowed_against_cold(pooled, cold, other, 30, 24) == 0, "a fresh prompt took rows");
    tl_generate_stats stats;
    CHECK(tl_generate(pooled, other, 30, &plain, out, CAP, &n_out, &stats) == TL_OK && stats.prompt_tokens_reused == 24,
          "after a window of 24, a plain session took %d rows (want 24)", stats.prompt_tokens_reused);
    int32_t want[CAP];
    int n_want = 0;
    tl_generate(cold, other, 30, &plain, want, CAP, &n_want, NULL);
    CHECK(n_out == n_want && !memcmp(out, want, (size_t)n_want * sizeof *want), "the plain session differs from a cold one");
    /* ... but not once the ring has written past its capacity (rows 0.. overwritten) */
    CHECK(tl_model_set_prefix_pool(pooled, 1) == TL_OK && tl_model_set_prefix_pool(pooled, 64 << 20) == TL_OK, "emptied");
    CHECK(windowed_against_cold(pooled, cold, prompt, LEN, 8) == 0, "a fresh prompt took rows");
    CHECK(tl_generate(pooled, prompt, LEN, &plain, out, CAP, &n_out, &stats) == TL_OK && stats.prompt_tokens_reused == 0,
          "a wrapped ring offered %d rows", stats.prompt_tokens_reused);
    /* A windowed speculative session whose drafts wrapped past its ring's capacity and were
       rolled back: ring row 0 holds a later entry, which it offered as entry 0 (the review) */
    CHECK(tl_model_set_prefix_pool(pooled, 1) == TL_OK && tl_model_set_prefix_pool(pooled, 64 << 20) == TL_OK, "emptied");
    int32_t spec_prompt[4], seq[64];
    for (int i = 0; i < 4; i++) spec_prompt[i] = (int32_t)((i * 37 + 19) % 250 + 1);
    int stop_after = 14;
    tl_generate_config spec;
    tl_generate_config_init(&spec);
    spec.cache_window = 8;
    spec.ignore_eos = 1;
    spec.loops = 3;
    spec.speculative = TL_SPECULATIVE_CHAIN;
    spec.draft_loops = 1;
    spec.draft_ahead = 6;
    spec.max_tokens = 40;
    spec.stop_rule = stop_at_length;
    spec.stop_rule_user = &stop_after;
    tl_session *drafted = NULL;
    int n_seq = 0;
    if (tl_session_new(pooled, spec_prompt, 4, &spec, &drafted) == TL_OK) {
        run(drafted, 40);
        n_seq = drafted->n_tokens;
        memcpy(seq, drafted->tokens, (size_t)n_seq * sizeof *seq);
    }
    tl_session_free(drafted);
    CHECK(n_seq == 14, "the windowed speculative session emitted %d tokens (want 14)", n_seq - 4);
    plain.loops = 3;
    plain.max_tokens = 3;
    tl_session *cold_plain = NULL, *pool_plain = NULL;
    tl_session_new(cold, seq, n_seq, &plain, &cold_plain);
    tl_session_new(pooled, seq, n_seq, &plain, &pool_plain);
    CHECK(cold_plain && pool_plain && run(cold_plain, 1) > 0 && run(pool_plain, 1) > 0, "%s", tl_last_error());
    if (cold_plain && pool_plain)
        CHECK(!memcmp(cold_plain->logits, pool_plain->logits, (size_t)tl_model_info(cold)->vocab_size * sizeof(float)),
              "after a windowed speculative session, a plain one that took %d rows differs from a cold one",
              pool_plain->stats.prompt_tokens_reused);
    tl_session_free(cold_plain);
    tl_session_free(pool_plain);
    tl_model_free(pooled);
    tl_model_free(cold);
}

/* Kept pages (kv_cache.h: a freed page is reused with its old rows in it). Sessions on a
   model whose spare pages hold other sessions' K/V emit exactly what they emit on a model
   that never reuses a page: with a window (a ring), speculative rollback and early exit
   (which leaves deeper slots of exited rows unwritten), so a read of a row its cache never
   wrote would show. */
static void reused_pages(const char *dir) {
    tl_model *fresh = load(dir), *reusing = load(dir);
    if (!fresh || !reusing) { CHECK(0, "load"); tl_model_free(fresh); tl_model_free(reusing); return; }
    tl_kv_spares_free(fresh, fresh->kv_spares); /* never reuses: every page is a new one */
    fresh->kv_spares = NULL;
    enum { CONFIGS = 4, TOKENS = 70 };
    tl_generate_config cfgs[CONFIGS];
    for (int i = 0; i < CONFIGS; i++) {
        tl_generate_config_init(&cfgs[i]);
        cfgs[i].max_tokens = TOKENS;
        cfgs[i].ignore_eos = 1;
    }
    cfgs[1].cache_window = 24;
    cfgs[2].speculative = TL_SPECULATIVE_CHAIN;
    cfgs[2].draft_loops = 1;
    cfgs[3].loops = 4; /* the text model's max: tokens exit at 2, 3 or 4 loops */
    cfgs[3].early_exit_patience = 1;
    cfgs[3].early_exit_min_L = 1;
    cfgs[3].early_exit_criterion = TL_EXIT_LATENT_DIFF;
    cfgs[3].early_exit_threshold = 0.06f;
    /* Other sessions' K/V into the spare pages first. */
    for (int k = 0; k < 6; k++) {
        int32_t other[40];
        for (int i = 0; i < 40; i++) other[i] = (int32_t)((k * 131 + i * 17) % 200 + 1);
        tl_session *s = NULL;
        if (tl_session_new(reusing, other, 40, &cfgs[k % CONFIGS], &s) == TL_OK) run(s, TOKENS);
        tl_session_free(s);
    }
    CHECK(tl_kv_spares_bytes(reusing) > 0, "the polluting sessions left no spare pages");
    const int32_t prompt[5] = {7, 21, 9, 88, 3};
    for (int i = 0; i < CONFIGS; i++) {
        tl_session *want = NULL, *got = NULL;
        tl_session_new(fresh, prompt, 5, &cfgs[i], &want);
        tl_session_new(reusing, prompt, 5, &cfgs[i], &got);
        CHECK(want && got, "config %d: sessions: %s", i, tl_last_error());
        if (want && got) {
            /* Logits, not only tokens: a stray read moves them before it flips an argmax. */
            const size_t row_bytes = (size_t)tl_model_info(fresh)->vocab_size * sizeof(float);
            bool same_logits = true;
            for (int t = 0; t < TOKENS && !want->finished && !got->finished; t++) {
                if (run(want, 1) < 0 || run(got, 1) < 0) break;
                same_logits = same_logits && memcmp(want->logits, got->logits, row_bytes) == 0;
            }
            CHECK(same_logits, "config %d: logits on reused pages differ from those on fresh pages", i);
            CHECK(got->n_tokens == 5 + TOKENS && same_tokens(want, got),
                  "config %d: a session on reused pages differs from one on fresh pages", i);
            if (i == 3) /* some tokens exit early, some run deeper: slots left unwritten */
                CHECK(got->stats.loops_used > 2.05 && got->stats.loops_used < 3.95, "early exit: loops used %.2f",
                      got->stats.loops_used);
        }
        tl_session_free(want);
        tl_session_free(got);
    }
    CHECK(tl_kv_spares_bytes(fresh) == 0, "a model without spares kept pages");
    tl_model_free(fresh);
    tl_model_free(reusing);
}

/* tl_model_get_memory: the K/V bytes follow the pages that sessions hold. A fork adds none
   until one side writes (then the page it writes into is copied), a saved state keeps its
   pages after the session is freed, and freed pages move to the spares. */
static void memory_accounting(const char *dir) {
    tl_model *m = load(dir);
    if (!m) { CHECK(0, "load"); return; }
    tl_model_memory mem;
    tl_model_get_memory(m, &mem);
    CHECK(mem.kv_bytes == 0 && mem.kv_spare_bytes == 0 && mem.weight_bytes == tl_model_info(m)->weight_bytes &&
              mem.weight_bytes > 0,
          "fresh model: kv %lld, spare %lld, weights %lld", (long long)mem.kv_bytes, (long long)mem.kv_spare_bytes,
          (long long)mem.weight_bytes);
    const int32_t prompt[6] = {3, 14, 15, 92, 65, 35};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 60;
    cfg.ignore_eos = 1;
    tl_session *parent = NULL, *child = NULL;
    tl_session_state *state = NULL;
    tl_session_new(m, prompt, 6, &cfg, &parent);
    run(parent, 20); /* 25 entries: each slot's first page full, its second partly */
    const long long held = (long long)tl_kv_cache_bytes(parent->cache);
    tl_model_get_memory(m, &mem);
    CHECK(held > 0 && mem.kv_bytes == held, "one session: kv %lld, its cache %lld", (long long)mem.kv_bytes, held);
    tl_session_fork(parent, NULL, &child);
    tl_model_get_memory(m, &mem);
    CHECK(child && mem.kv_bytes == held, "a fork adds no pages: kv %lld, was %lld", (long long)mem.kv_bytes, held);
    run(child, 1); /* writes into the shared second page of each slot: copies those */
    tl_model_get_memory(m, &mem);
    const long long forked = mem.kv_bytes;
    CHECK(forked > held && forked - held <= (long long)tl_kv_cache_bytes(child->cache) / 2,
          "the child's first write copies its last pages only: kv %lld, was %lld", forked, held);
    tl_session_save(parent, &state);
    tl_session_free(parent);
    tl_model_get_memory(m, &mem);
    CHECK(state && mem.kv_bytes == forked && mem.kv_spare_bytes == 0,
          "a saved state keeps the freed session's pages: kv %lld (want %lld), spare %lld", (long long)mem.kv_bytes,
          forked, (long long)mem.kv_spare_bytes);
    tl_session_free(child);
    tl_session_state_free(state);
    tl_model_get_memory(m, &mem);
    CHECK(mem.kv_bytes == 0 && mem.kv_spare_bytes == forked, "all freed: kv %lld, spare %lld (want %lld)",
          (long long)mem.kv_bytes, (long long)mem.kv_spare_bytes, forked);
    tl_model_free(m);
    tl_model_get_memory(NULL, &mem);
    CHECK(mem.kv_bytes == 0 && mem.weight_bytes == 0, "NULL model: zeros");
    tl_model_get_memory(NULL, NULL); /* a no-op */
}

/* ---------------------------------------------------------------- the pool's budget and order */

/* Greedy, one token, whatever it is: the sessions of the pool's tests below. */
static tl_generate_config one_token(void) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 1;
    cfg.ignore_eos = 1;
    return cfg;
}

/* A one_token session of p[0..n) on m; returns the prompt tokens it took from the pool. */
static int pooled_run(tl_model *m, const int32_t *p, int n) {
    const tl_generate_config cfg = one_token();
    tl_session *s = NULL;
    if (tl_session_new(m, p, n, &cfg, &s) != TL_OK) { CHECK(0, "session: %s", tl_last_error()); return -1; }
    const int reused = s->stats.prompt_tokens_reused;
    CHECK(run(s, 1) == n + 1, "step: %s", tl_last_error());
    tl_session_free(s);
    return reused;
}
static int64_t pool_bytes(const tl_model *m) {
    tl_model_memory mem;
    tl_model_get_memory(m, &mem);
    return mem.kv_bytes;
}

/* The pool's budget at its edge (an entry of exactly the budget is kept), its eviction order
   (the least recently used entry leaves: a take and an offer of rows it holds both count as a
   use), and no entry kept beside an entry it is a prefix of (the pool holds the longer one). */
static void prefix_pool_budget_and_order(const char *dir) {
    enum { ENTRY = 40 };
    int32_t A[ENTRY], B[ENTRY], C[ENTRY], L[64];
    for (int i = 0; i < ENTRY; i++) A[i] = 100 + i, B[i] = (300 + 7 * i) % 319, C[i] = (9 + 3 * i) % 319;
    for (int i = 0; i < 64; i++) L[i] = (50 + 5 * i) % 319;
    tl_model *m = load(dir);
    if (!m) { CHECK(0, "load"); return; }
    tl_model_set_prefix_pool(m, 1 << 30);
    pooled_run(m, A, ENTRY);
    const int64_t one = pool_bytes(m);
    pooled_run(m, B, ENTRY);
    const int64_t two = pool_bytes(m);
    CHECK(one > 0 && two == 2 * one, "entries of %lld and %lld bytes", (long long)one, (long long)two);
    tl_model_free(m);
    /* a budget of exactly one entry keeps it */
    m = load(dir);
    tl_model_set_prefix_pool(m, one);
    pooled_run(m, A, ENTRY);
    CHECK(pooled_run(m, A, ENTRY) == ENTRY - 1, "a budget of exactly one entry: the entry was not kept");
    tl_model_free(m);
    /* two entries' budget: A, B, then A again (a use), then C evicts B, not A */
    for (int probe = 0; probe < 2; probe++) {
        m = load(dir);
        tl_model_set_prefix_pool(m, two);
        pooled_run(m, A, ENTRY), pooled_run(m, B, ENTRY), pooled_run(m, A, ENTRY), pooled_run(m, C, ENTRY);
        const int reused = pooled_run(m, probe ? B : A, ENTRY);
        CHECK(reused == (probe ? 0 : ENTRY - 1), "after A, B, A, C in a pool of two: %s reused %d", probe ? "B" : "A", reused);
        tl_model_free(m);
    }
    /* a take alone is a use: a session that took A's rows and was freed before its first step */
    m = load(dir);
    tl_model_set_prefix_pool(m, two);
    pooled_run(m, A, ENTRY), pooled_run(m, B, ENTRY);
    {
        const tl_generate_config cfg = one_token();
        tl_session *s = NULL;
        CHECK(tl_session_new(m, A, ENTRY, &cfg, &s) == TL_OK && s->stats.prompt_tokens_reused == ENTRY - 1, "the take");
        tl_session_free(s);
    }
    pooled_run(m, C, ENTRY);
    CHECK(pooled_run(m, A, ENTRY) == ENTRY - 1, "a session's take alone did not keep A in the pool");
    tl_model_free(m);
    /* an offer of rows the pool holds is a use: a session made before the pool, stepped after */
    m = load(dir);
    {
        const tl_generate_config cfg = one_token();
        tl_session *s = NULL;
        CHECK(tl_session_new(m, A, ENTRY, &cfg, &s) == TL_OK, "session: %s", tl_last_error());
        tl_model_set_prefix_pool(m, two);
        pooled_run(m, A, ENTRY), pooled_run(m, B, ENTRY);
        CHECK(s && run(s, 1) == ENTRY + 1, "step");
        tl_session_free(s);
    }
    pooled_run(m, C, ENTRY);
    CHECK(pooled_run(m, A, ENTRY) == ENTRY - 1, "an offer of rows the pool held did not keep A in the pool");
    tl_model_free(m);
    /* a prefix of an entry is not stored again; an entry extending one replaces it */
    m = load(dir);
    tl_model_set_prefix_pool(m, 1 << 30);
    pooled_run(m, L, 64);
    const int64_t long_entry = pool_bytes(m);
    CHECK(pooled_run(m, L, ENTRY) == ENTRY - 1 && pool_bytes(m) == long_entry, "a prefix of the entry: %lld -> %lld bytes",
          (long long)long_entry, (long long)pool_bytes(m));
    tl_model_free(m);
    m = load(dir);
    tl_model_set_prefix_pool(m, 1 << 30);
    {
        const tl_generate_config cfg = one_token();
        tl_session *s = NULL;
        CHECK(tl_session_new(m, A, ENTRY, &cfg, &s) == TL_OK && run(s, 1) == ENTRY + 1, "A: %s", tl_last_error());
        int32_t E[ENTRY + 10];
        memcpy(E, s->tokens, (size_t)(ENTRY + 1) * sizeof *E); /* A, its token, then nine more */
        for (int i = ENTRY + 1; i < ENTRY + 10; i++) E[i] = (int32_t)(200 + i);
        tl_session_free(s);
        const int64_t before = pool_bytes(m);
        CHECK(pooled_run(m, E, ENTRY + 10) == ENTRY, "the extension reused less than A's rows");
        /* the pool now holds E's rows alone: as much as a pool that only ever saw E */
        tl_model *only = load(dir);
        tl_model_set_prefix_pool(only, 1 << 30);
        pooled_run(only, E, ENTRY + 10);
        CHECK(pool_bytes(m) == pool_bytes(only) && pool_bytes(m) > before, "A kept beside its extension: %lld bytes, E alone %lld",
              (long long)pool_bytes(m), (long long)pool_bytes(only));
        tl_model_free(only);
    }
    tl_model_free(m);
}

/* ---------------------------------------------------------------- a fork's own rows and clock */

/* A fork reads its own verifier row (the parent stepping on changes nothing of the child's
   logprobs), and a state saved between the prompt's prefill and its first token, resumed
   later, does not count the time it waited in first_token_ms. */
static void forks_own_row_and_clock(const tl_model *m) {
    int32_t prompt[6] = {10, 20, 30, 40, 50, 60}, token;
    tl_stop_reason stop;
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 8;
    tl_session *parent = NULL, *child = NULL;
    CHECK(tl_session_new(m, prompt, 6, &cfg, &parent) == TL_OK, "%s", tl_last_error());
    if (!parent) return;
    for (int i = 0; i < 3; i++) tl_session_step(parent, &token, &stop);
    float before = 0.0f, child_lp = 1.0f;
    CHECK(tl_session_logprobs(parent, 0, &before, NULL, NULL) == TL_OK, "%s", tl_last_error());
    CHECK(tl_session_fork(parent, NULL, &child) == TL_OK, "fork: %s", tl_last_error());
    tl_session_step(parent, &token, &stop);
    CHECK(child && tl_session_logprobs(child, 0, &child_lp, NULL, NULL) == TL_OK && child_lp == before,
          "the child's logprob %.6f after its parent stepped, %.6f before", child_lp, before);
    tl_session_free(child);
    tl_session_free(parent);

    tl_session *s = NULL, *resumed = NULL;
    tl_session_state *state = NULL;
    CHECK(tl_session_new(m, prompt, 6, &cfg, &s) == TL_OK, "%s", tl_last_error());
    if (!s) return;
    CHECK(tl_session_prefill(s, 6, s->logits) == TL_OK, "prefill: %s", tl_last_error()); /* the rows, no token yet */
    CHECK(tl_session_save(s, &state) == TL_OK, "save: %s", tl_last_error());
    nanosleep(&(struct timespec){0, 300 * 1000000L}, NULL);
    CHECK(tl_session_resume(m, state, NULL, &resumed) == TL_OK, "resume: %s", tl_last_error());
    if (resumed) {
        tl_session_step(resumed, &token, &stop);
        CHECK(tl_session_stats(resumed)->first_token_ms < 250.0, "first_token_ms %.1f counts the 300 ms the state waited",
              tl_session_stats(resumed)->first_token_ms);
    }
    tl_session_free(resumed);
    tl_session_state_free(state);
    tl_session_free(s);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "tests/data/textmodel";
    tl_model *m = load(dir);
    if (!m) return 1;
    forks_continue_exactly(m);
    mode_forks(m);
    hooks_per_branch(m);
    saved_states(m, dir);
    compiled_grammars(m);
    bad_input(m);
    prefix_pool(dir);
    prefix_pool_first_calls(dir);
    prefix_pool_longest_prefix(dir);
    prefix_pool_shared_pages(dir);
    early_exit_pages(dir);
    prefix_pool_keeps_generations(dir);
    prefix_pool_other_decoders(dir);
    prefix_pool_windowed(dir);
    char huginn[4096];
    snprintf(huginn, sizeof huginn, "%s/../hf/huginn_f32", dir);
    prefix_pool_seeded(huginn);
    reused_pages(dir);
    memory_accounting(dir);
    prefix_pool_budget_and_order(dir);
    forks_own_row_and_clock(m);
    tl_model_free(m);
    return check_summary();
}

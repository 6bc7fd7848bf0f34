/* test_modes.c: every decoder is a session mode (plain, chain speculative, tree speculative,
 * beam search). For each mode, over the random-token and real-text prompt sets of
 * test_speculative:
 *   - stepping a session token by token, tl_generate and tl_generate_stream give the same
 *     tokens (memcmp) and the same stop reason;
 *   - the on_token hook, the stream callback, stop_rule and logits_processor fire at the same
 *     tokens and positions on every path, and (greedy) in plain, chain and tree alike;
 *   - the pieces of tl_session_text concatenate to the decoded output;
 *   - beam search emits its first token before the search is over (it streams).
 * Plus the step API's guards: a hook that frees or steps its own session. */
#include <stdbool.h>
#include <stdlib.h>

#include "check.h"
#include "text_prompts.h"
#include "tinyloop.h"

#define CAP 200
#define MAX_EVENTS 512

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

/* ---------------------------------------------------------------- recording hooks */

/* Everything the hooks saw during one run, to compare runs event by event. */
typedef struct trace {
    int n_on_token, n_stream, n_stop_rule, n_logits;
    int32_t on_token[MAX_EVENTS];     /* token */
    int on_token_pos[MAX_EVENTS];     /* position */
    int32_t stream[MAX_EVENTS];
    int stop_rule_n[MAX_EVENTS];      /* sequence length when the stop rule ran */
    int logits_n[MAX_EVENTS];         /* history length when the logits hook ran */
    int logits_calls_at_first_token;  /* logits hook calls before the first emission */
    int stop_rule_at;                 /* stop when the sequence reaches this length (0: never) */
    int32_t banned;                   /* token the logits hook bans (-1: none) */
    int on_token_stop_at;             /* on_token asks to stop at this call (0: never) */
} trace;

static int record_on_token(void *user, int32_t token, int position) {
    trace *t = user;
    if (t->n_on_token == 0) t->logits_calls_at_first_token = t->n_logits;
    if (t->n_on_token < MAX_EVENTS) {
        t->on_token[t->n_on_token] = token;
        t->on_token_pos[t->n_on_token] = position;
    }
    t->n_on_token++;
    return t->on_token_stop_at && t->n_on_token == t->on_token_stop_at ? TL_HOOK_STOP : TL_HOOK_CONTINUE;
}

static bool record_stream(void *user, int32_t token, int position) {
    (void)position;
    trace *t = user;
    if (t->n_stream < MAX_EVENTS) t->stream[t->n_stream] = token;
    t->n_stream++;
    return true;
}

static int record_stop_rule(void *user, const int32_t *tokens, int n) {
    (void)tokens;
    trace *t = user;
    if (t->n_stop_rule < MAX_EVENTS) t->stop_rule_n[t->n_stop_rule] = n;
    t->n_stop_rule++;
    return t->stop_rule_at && n >= t->stop_rule_at ? TL_HOOK_STOP : TL_HOOK_CONTINUE;
}

static int record_logits(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    (void)tokens;
    trace *t = user;
    if (t->banned >= 0 && t->banned < vocab) logits[t->banned] = -1e30f;
    if (t->n_logits < MAX_EVENTS) t->logits_n[t->n_logits] = n;
    t->n_logits++;
    return TL_HOOK_CONTINUE;
}

static void attach(tl_generate_config *cfg, trace *t, bool stop_rule) {
    cfg->on_token = record_on_token;
    cfg->on_token_user = t;
    cfg->logits_processor = record_logits;
    cfg->logits_processor_user = t;
    if (stop_rule) {
        cfg->stop_rule = record_stop_rule;
        cfg->stop_rule_user = t;
    }
}

static bool same_events(const int32_t *a, int na, const int32_t *b, int nb) {
    return na == nb && memcmp(a, b, (size_t)(na < MAX_EVENTS ? na : MAX_EVENTS) * sizeof *a) == 0;
}
static bool same_ints(const int *a, int na, const int *b, int nb) {
    return na == nb && memcmp(a, b, (size_t)(na < MAX_EVENTS ? na : MAX_EVENTS) * sizeof *a) == 0;
}

/* ---------------------------------------------------------------- one mode, three paths */

typedef struct run {
    tl_status status;
    int32_t tokens[CAP];
    int n;
    tl_stop_reason reason;
    trace hooks;
    char text[4096];
    size_t text_len;
} run;

static void reset_trace(trace *t, const trace *settings) {
    memset(t, 0, sizeof *t);
    t->stop_rule_at = settings->stop_rule_at;
    t->banned = settings->banned;
    t->on_token_stop_at = settings->on_token_stop_at;
}

/* Steps a session to its end, collecting tokens and streamed text. */
static void run_steps(const tl_model *m, const int32_t *prompt, int n, tl_generate_config cfg, bool stop_rule,
                      const trace *settings, run *r) {
    reset_trace(&r->hooks, settings);
    attach(&cfg, &r->hooks, stop_rule);
    r->text_len = 0;
    tl_session *s = NULL;
    r->status = tl_session_new(m, prompt, n, &cfg, &s);
    const bool has_text = tl_model_info(m)->has_tokenizer;
    tl_stop_reason stop = TL_STOP_NONE;
    int32_t token;
    while (r->status == TL_OK && stop == TL_STOP_NONE) {
        r->status = tl_session_step(s, &token, &stop);
        const char *piece;
        size_t len;
        if (r->status == TL_OK && has_text && tl_session_text(s, &piece, &len) == TL_OK &&
            r->text_len + len < sizeof r->text) {
            memcpy(r->text + r->text_len, piece, len);
            r->text_len += len;
        }
    }
    r->reason = stop;
    const int32_t *all = tl_session_tokens(s, &r->n);
    if (all) memcpy(r->tokens, all, (size_t)r->n * sizeof *all);
    tl_session_free(s);
}

static void run_blocking(const tl_model *m, const int32_t *prompt, int n, tl_generate_config cfg, bool stop_rule,
                         const trace *settings, bool stream, run *r) {
    reset_trace(&r->hooks, settings);
    attach(&cfg, &r->hooks, stop_rule);
    tl_generate_stats st;
    r->status = stream ? tl_generate_stream(m, prompt, n, &cfg, record_stream, &r->hooks, r->tokens, CAP, &r->n, &st)
                       : tl_generate(m, prompt, n, &cfg, r->tokens, CAP, &r->n, &st);
    r->reason = st.stop_reason;
}

static const char *mode_name(const tl_generate_config *c) {
    return c->beam_size >= 2 ? "beam" : c->speculative == TL_SPECULATIVE_CHAIN ? "chain"
         : c->speculative == TL_SPECULATIVE_TREE ? "tree" : "plain";
}

static int runs_compared;
static run stepped, blocking, streamed, reference;

/* The three paths of one mode agree; returns the stepped run (in `stepped`). */
static void check_paths(const tl_model *m, const int32_t *prompt, int n, const tl_generate_config *cfg,
                        bool stop_rule, const trace *settings, const char *label) {
    run_steps(m, prompt, n, *cfg, stop_rule, settings, &stepped);
    run_blocking(m, prompt, n, *cfg, stop_rule, settings, false, &blocking);
    run_blocking(m, prompt, n, *cfg, stop_rule, settings, true, &streamed);
    runs_compared++;
    const char *mode = mode_name(cfg);
    CHECK(stepped.status == TL_OK && blocking.status == TL_OK && streamed.status == TL_OK, "%s %s: %s", label, mode,
          tl_last_error());
    CHECK(same_events(stepped.tokens, stepped.n, blocking.tokens, blocking.n) &&
              same_events(stepped.tokens, stepped.n, streamed.tokens, streamed.n),
          "%s %s: stepped %d, blocking %d, streamed %d tokens differ", label, mode, stepped.n, blocking.n, streamed.n);
    CHECK(stepped.reason == blocking.reason && stepped.reason == streamed.reason, "%s %s: stop %s / %s / %s", label,
          mode, tl_stop_reason_name(stepped.reason), tl_stop_reason_name(blocking.reason),
          tl_stop_reason_name(streamed.reason));
    /* Observers see exactly the emitted tokens, at their positions. */
    const int emitted = stepped.n - n;
    bool positions_ok = stepped.hooks.n_on_token == emitted;
    for (int i = 0; positions_ok && i < emitted && i < MAX_EVENTS; i++)
        positions_ok = stepped.hooks.on_token[i] == stepped.tokens[n + i] && stepped.hooks.on_token_pos[i] == n + i;
    CHECK(positions_ok, "%s %s: on_token saw %d calls for %d tokens", label, mode, stepped.hooks.n_on_token, emitted);
    CHECK(same_events(streamed.hooks.stream, streamed.hooks.n_stream, stepped.tokens + n, emitted),
          "%s %s: the stream callback saw %d tokens for %d", label, mode, streamed.hooks.n_stream, emitted);
    CHECK(same_ints(stepped.hooks.logits_n, stepped.hooks.n_logits, blocking.hooks.logits_n, blocking.hooks.n_logits) &&
              same_ints(stepped.hooks.stop_rule_n, stepped.hooks.n_stop_rule, blocking.hooks.stop_rule_n,
                        blocking.hooks.n_stop_rule),
          "%s %s: hooks ran differently when stepped", label, mode);
    /* The streamed text is the decoded output (special tokens carry no text). */
    if (tl_model_info(m)->has_tokenizer) {
        int32_t plain_ids[CAP];
        int k = 0;
        const int eos = tl_model_info(m)->eos_token_id;
        for (int i = n; i < stepped.n; i++)
            if (stepped.tokens[i] != eos) plain_ids[k++] = stepped.tokens[i];
        char *text = NULL;
        size_t len = 0;
        tl_decode(m, plain_ids, k, &text, &len);
        CHECK(text && len == stepped.text_len && memcmp(text, stepped.text, len) == 0,
              "%s %s: streamed text (%zu bytes) != decoded output (%zu bytes)", label, mode, stepped.text_len, len);
        tl_free(text);
    }
}

/* Plain, chain and tree (greedy) agree with each other on tokens and on every hook event;
   beam's three paths agree with each other. */
static void check_modes(const tl_model *m, const int32_t *prompt, int n, tl_generate_config cfg,
                        const trace *settings, int draft, int ahead, int K, const char *label) {
    cfg.speculative = TL_SPECULATIVE_OFF;
    check_paths(m, prompt, n, &cfg, true, settings, label);
    reference = stepped;
    const tl_speculative_mode modes[2] = {TL_SPECULATIVE_CHAIN, TL_SPECULATIVE_TREE};
    for (int i = 0; i < 2; i++) {
        tl_generate_config spec = cfg;
        spec.speculative = modes[i];
        spec.draft_loops = draft;
        spec.draft_ahead = ahead;
        spec.K_branches = K;
        spec.max_nodes = 40;
        check_paths(m, prompt, n, &spec, true, settings, label);
        const char *mode = mode_name(&spec);
        CHECK(same_events(stepped.tokens, stepped.n, reference.tokens, reference.n) && stepped.reason == reference.reason,
              "%s %s: %d tokens (%s) vs plain %d (%s)", label, mode, stepped.n, tl_stop_reason_name(stepped.reason),
              reference.n, tl_stop_reason_name(reference.reason));
        CHECK(same_ints(stepped.hooks.logits_n, stepped.hooks.n_logits, reference.hooks.logits_n,
                        reference.hooks.n_logits) &&
                  same_ints(stepped.hooks.stop_rule_n, stepped.hooks.n_stop_rule, reference.hooks.stop_rule_n,
                            reference.hooks.n_stop_rule) &&
                  same_events(stepped.hooks.on_token, stepped.hooks.n_on_token, reference.hooks.on_token,
                              reference.hooks.n_on_token),
              "%s %s: hooks fired at other tokens than in plain decoding", label, mode);
        CHECK(stepped.text_len == reference.text_len && memcmp(stepped.text, reference.text, stepped.text_len) == 0,
              "%s %s: streamed text differs from plain decoding", label, mode);
    }
    tl_generate_config beam = cfg;
    beam.beam_size = 2 + (int)(next_u32() % 3);
    beam.stop_strings = NULL; /* not supported with beams: covered by the validation test */
    beam.n_stop_strings = 0;
    beam.cache_window = 0;
    check_paths(m, prompt, n, &beam, false, settings, label);
}

/* ---------------------------------------------------------------- prompt sets */

static tl_model *load(const char *dir) {
    tl_model *m = NULL;
    /* (a model that does not load fails the test: the callers return without it) */
    CHECK(tl_model_load(dir, NULL, &m) == TL_OK, "load %s: %s", dir, tl_last_error());
    return m;
}

static void random_prompts(const char *golden) {
    static const struct { const char *name; int verify; } models[] = {
        {"add_residual_statenorm_rms_gqa2", 8}, {"deep_residual", 8}, {"f16_concat_residual_gqa", 6},
        {"bf16_tied_rope_residual", 5},
    };
    for (size_t mi = 0; mi < sizeof models / sizeof models[0]; mi++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", golden, models[mi].name);
        tl_model *m = load(dir);
        if (!m) continue;
        const int vocab = tl_model_info(m)->vocab_size;
        for (int p = 0; p < 12; p++) {
            int32_t prompt[8];
            const int n = 1 + (int)(next_u32() % 8);
            for (int i = 0; i < n; i++) prompt[i] = (int32_t)(next_u32() % (uint32_t)vocab);
            tl_generate_config cfg;
            tl_generate_config_init(&cfg);
            cfg.max_tokens = 20;
            cfg.loops = models[mi].verify;
            cfg.ignore_eos = p % 3 != 0;
            if (p % 4 == 1) cfg.repetition_penalty = 1.3f;
            cfg.cache_window = p % 5 == 2 ? 6 : 0;
            trace settings = {0};
            settings.banned = p % 2 ? (int32_t)(next_u32() % (uint32_t)vocab) : -1;
            settings.stop_rule_at = p % 3 == 1 ? n + 5 + p % 7 : 0;
            char label[128];
            snprintf(label, sizeof label, "%s prompt %d", models[mi].name, p);
            check_modes(m, prompt, n, cfg, &settings, 1 + p % 3, 1 + p % 6, 1 + p % 3, label);
        }
        tl_model_free(m);
    }
}

static void text_prompts(const char *data) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/textmodel", data);
    tl_model *m = load(dir);
    if (!m) return;
    for (int p = 0; p < 15; p++) {
        int32_t *ids;
        int n;
        if (text_prompt(m, p, &ids, &n) != TL_OK) { CHECK(0, "encode prompt %d: %s", p, tl_last_error()); continue; }
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 40;
        cfg.loops = 4;
        cfg.ignore_eos = p % 2;
        const char *stops[] = {"the", "e, "};
        if (p % 3 == 1) { cfg.stop_strings = stops; cfg.n_stop_strings = 1 + p % 2; }
        trace settings = {0};
        settings.banned = -1;
        char label[128];
        snprintf(label, sizeof label, "text prompt %d", p);
        check_modes(m, ids, n, cfg, &settings, 1 + p % 3, 2 + p % 5, 1 + p % 4, label);
        tl_free(ids);
    }
    tl_model_free(m);
}

/* ---------------------------------------------------------------- beam streams */

/* On the shipped model (a trained one: beams agree on most of their prefix; on the random
   test checkpoints they disagree from the first token on, and nothing settles early). */
static void beam_streams(const char *dir) {
    tl_model *m = load(dir);
    if (!m) return;
    int32_t *ids;
    int n;
    const char *t = "It is a truth universally acknowledged, that a single man";
    tl_encode(m, t, strlen(t), &ids, &n);
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 30;
    cfg.beam_size = 4;
    cfg.ignore_eos = 1;
    trace settings = {0};
    settings.banned = -1;
    run_steps(m, ids, n, cfg, false, &settings, &stepped);
    CHECK(stepped.status == TL_OK && stepped.n == n + 30, "beam run: %s", tl_last_error());
    /* 4 beams x 30 steps of logits-hook calls in all; the first token came out long before. */
    CHECK(stepped.hooks.logits_calls_at_first_token < stepped.hooks.n_logits / 2,
          "beam search emitted its first token after %d of %d hook calls: it did not stream",
          stepped.hooks.logits_calls_at_first_token, stepped.hooks.n_logits);
    /* The stream's stop request ends the session at that token: the output is a prefix. */
    reference = stepped;
    settings.on_token_stop_at = 3;
    run_blocking(m, ids, n, cfg, false, &settings, false, &blocking);
    CHECK(blocking.status == TL_OK && blocking.n == n + 3 && blocking.reason == TL_STOP_CALLBACK_ABORT &&
              memcmp(blocking.tokens, reference.tokens, (size_t)blocking.n * 4) == 0,
          "beam with on_token stopping at 3: %d tokens, %s", blocking.n - n, tl_stop_reason_name(blocking.reason));
    tl_free(ids);
    tl_model_free(m);
}

/* ---------------------------------------------------------------- hooks that misuse the session */

typedef struct misuse {
    tl_session *session;
    int mode; /* 0: free it, 1: step it */
    tl_status inner_status;
    char inner_error[256];
} misuse;

static int misuse_hook(void *user, int32_t token, int position) {
    (void)token; (void)position;
    misuse *u = user;
    if (u->mode == 0) {
        tl_session_free(u->session);
    } else {
        int32_t tok;
        tl_stop_reason stop;
        u->inner_status = tl_session_step(u->session, &tok, &stop);
        snprintf(u->inner_error, sizeof u->inner_error, "%s", tl_last_error());
    }
    return TL_HOOK_CONTINUE;
}

static void hooks_misusing_their_session(const char *golden) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/deep_residual", golden);
    tl_model *m = load(dir);
    if (!m) return;
    int32_t prompt[3] = {1, 2, 3};
    const tl_speculative_mode modes[3] = {TL_SPECULATIVE_OFF, TL_SPECULATIVE_CHAIN, TL_SPECULATIVE_TREE};
    for (int mode = 0; mode < 4; mode++) {
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 5;
        cfg.loops = 4;
        if (mode < 3) cfg.speculative = modes[mode];
        else cfg.beam_size = 3;
        misuse u = {0};
        cfg.on_token = misuse_hook;
        cfg.on_token_user = &u;
        /* Stepping from its own hook is refused; the outer step goes on. */
        u.mode = 1;
        CHECK(tl_session_new(m, prompt, 3, &cfg, &u.session) == TL_OK, "session: %s", tl_last_error());
        int32_t tok;
        tl_stop_reason stop;
        tl_status st = tl_session_step(u.session, &tok, &stop);
        CHECK(st == TL_OK && tok >= 0 && u.inner_status == TL_ERR_INVALID_ARGUMENT &&
                  strstr(u.inner_error, "already stepping"),
              "mode %d: re-entrant step: outer %s, inner %s \"%s\"", mode, tl_status_name(st),
              tl_status_name(u.inner_status), u.inner_error);
        CHECK(strcmp(tl_last_error(), "") == 0, "the outer step succeeded, so no error is left: \"%s\"",
              tl_last_error());
        /* Freeing from its own hook is deferred until the step returns (ASan: no use after free). */
        u.mode = 0;
        st = tl_session_step(u.session, &tok, &stop);
        CHECK(st == TL_OK && tok >= 0, "mode %d: step whose hook freed the session: %s", mode, tl_last_error());
    }
    tl_model_free(m);
}

/* ---------------------------------------------------------------- the thread's error */

static void errors_set_and_cleared(const char *golden) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/deep_residual", golden);
    tl_model *m = load(dir);
    if (!m) return;
    int32_t prompt[2] = {1, 2}, out[CAP];
    int n;
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 3;
    tl_speculative_config sc;
    tl_speculative_config_init(&sc);
    sc.max_tokens = 3;
    sc.verify_loops = 4;
    sc.draft_loops = 1;
    float logits[2 * 1024];
    tl_session *s = NULL;
    int32_t tok;
    tl_stop_reason stop;
    /* Each call after a failing one: success leaves "" behind. */
#define AFTER_FAILURE(call)                                                                         \
    do {                                                                                            \
        tl_generate(m, prompt, 0, &cfg, out, CAP, &n, NULL);                                         \
        CHECK(strlen(tl_last_error()) > 0, "the failing call set an error");                         \
        CHECK((call) == TL_OK && strcmp(tl_last_error(), "") == 0, #call " left \"%s\"", tl_last_error()); \
    } while (0)
    AFTER_FAILURE(tl_generate(m, prompt, 2, &cfg, out, CAP, &n, NULL));
    AFTER_FAILURE(tl_generate_speculative(m, prompt, 2, &sc, out, CAP, &n, NULL));
    AFTER_FAILURE(tl_score(m, prompt, 2, 2, logits));
    AFTER_FAILURE(tl_session_new(m, prompt, 2, &cfg, &s));
    AFTER_FAILURE(tl_session_step(s, &tok, &stop));
    tl_session_free(s);
#undef AFTER_FAILURE
    tl_model_free(m);
}

int main(int argc, char **argv) {
    const char *data = argc > 1 ? argv[1] : "tests/data";
    char golden[2048];
    snprintf(golden, sizeof golden, "%.2000s/golden", data);
    random_prompts(golden);
    text_prompts(data);
    printf("  %d mode runs compared over stepped, blocking and streamed paths\n", runs_compared);
    if (argc > 2) beam_streams(argv[2]);
    else CHECK(0, "usage: test_modes DATA_DIR SHIPPED_MODEL_DIR");
    hooks_misusing_their_session(golden);
    errors_set_and_cleared(golden);
    return check_summary();
}

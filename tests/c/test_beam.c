/* test_beam.c: beam search: beam width 1 equals greedy (through the beam machinery),
 * hand-checkable searches whose logits a logits_processor controls, the length penalty,
 * determinism across thread counts, and validation. */
#include <math.h>
#include <stdlib.h>

#include "session.h"
#include "check.h"
#include "tinyloop.h"

#define CAP 64
static tl_model *model, *model_1thread;
static int eos;

/* ---------------------------------------------------------------- scripted logits */

/* Logits as log-probabilities chosen by the step and the previous token; -inf elsewhere. */
typedef struct { int prompt_len; int scenario; } script_t;

static void set(float *l, int v, int id, double p) { if (id < v) l[id] = (float)log(p); }

static int scripted(void *user, float *l, int v, const int32_t *tokens, int n) {
    const script_t *s = user;
    const int step = n - s->prompt_len, last = step > 0 ? tokens[n - 1] : -1;
    for (int i = 0; i < v; i++) l[i] = -INFINITY;
    if (s->scenario == 0) {
        /* Greedy takes 10 (0.6) then faces four 0.25 choices; the 20 (0.4) branch then has a
           0.9 token: beam search must find 20, 40, EOS. */
        if (step == 0) { set(l, v, 10, 0.6); set(l, v, 20, 0.4); }
        else if (step == 1 && last == 10) { for (int t = 30; t < 34; t++) set(l, v, t, 0.25); }
        else if (step == 1 && last == 20) { set(l, v, 40, 0.9); set(l, v, 41, 0.1); }
        else set(l, v, eos, 1.0);
    } else {
        /* X = [EOS] at once (0.5); Y = [11, 12, EOS] with 0.5 * 0.6. */
        if (step == 0) { set(l, v, eos, 0.5); set(l, v, 11, 0.5); }
        else if (step == 1) { set(l, v, 12, 0.6); set(l, v, 13, 0.4); }
        else set(l, v, eos, 1.0);
    }
    return TL_HOOK_CONTINUE;
}

static void test_hand_checked(void) {
    int32_t prompt[3] = {2, 3, 4}, out[CAP];
    int n;
    script_t sc = {3, 0};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 6;
    cfg.logits_processor = scripted;
    cfg.logits_processor_user = &sc;
    tl_generate_stats st;
    CHECK(tl_generate(model, prompt, 3, &cfg, out, CAP, &n, &st) == TL_OK, "greedy: %s", tl_last_error());
    CHECK(n == 6 && out[3] == 10 && out[4] == 30 && out[5] == eos, "greedy path 10, 30, EOS");
    cfg.beam_size = 2;
    CHECK(tl_generate(model, prompt, 3, &cfg, out, CAP, &n, &st) == TL_OK, "beam: %s", tl_last_error());
    CHECK(n == 6 && out[3] == 20 && out[4] == 40 && out[5] == eos, "beam path %d %d %d", out[3], out[4], out[5]);
    const double want = (log(0.4) + log(0.9)) / 3.0;
    CHECK(fabs(st.beam_score - want) < 1e-6, "beam score %.7f, want %.7f", st.beam_score, want);
    CHECK(st.stop_reason == TL_STOP_EOS && st.tokens_emitted == 3, "beam stats");

    /* Length penalty: X = [EOS] (logp ln .5, len 1) vs Y = [11, 12, EOS] (ln .5 + ln .6, len 3). */
    sc.scenario = 1;
    const double x = log(0.5), y = log(0.5) + log(0.6);
    const float penalties[3] = {0.0f, 1.0f, 2.0f};
    for (int i = 0; i < 3; i++) {
        cfg.length_penalty = penalties[i];
        CHECK(tl_generate(model, prompt, 3, &cfg, out, CAP, &n, &st) == TL_OK, "beam lp");
        const double sx = x / pow(1.0, penalties[i]), sy = y / pow(3.0, penalties[i]);
        const bool y_wins = sy > sx;
        CHECK(y_wins ? (n == 6 && out[3] == 11 && out[4] == 12) : (n == 4 && out[3] == eos),
              "length_penalty %g: scores X %.4f Y %.4f, got %d tokens", (double)penalties[i], sx, sy, n - 3);
        CHECK(fabs(st.beam_score - (y_wins ? sy : sx)) < 1e-6, "length_penalty %g score %.6f", (double)penalties[i],
              st.beam_score);
    }
}

/* Beam width 1 through the beam machinery (tree mask, shared prefix) is greedy decoding. */
static void test_width_one(const char *root) {
    static const char *names[] = {"deep_residual", "llama_like", "f16_concat_residual_gqa", "gpt2_like"};
    for (int mi = 0; mi < 4; mi++) {
        char dir[8192];
        snprintf(dir, sizeof dir, "%s/%s", root, names[mi]);
        tl_model *m = NULL;
        if (tl_model_load(dir, NULL, &m) != TL_OK) { CHECK(0, "load %s", names[mi]); continue; }
        const int vocab = tl_model_info(m)->vocab_size;
        for (int p = 0; p < 5; p++) {
            int32_t prompt[5], want[CAP], got[CAP];
            for (int i = 0; i < 5; i++) prompt[i] = (int32_t)((p * 37 + i * 11 + mi) % vocab);
            tl_generate_config cfg;
            tl_generate_config_init(&cfg);
            cfg.max_tokens = 20;
            cfg.ignore_eos = p % 2;
            int wn, gn;
            tl_generate(m, prompt, 5 - p % 3, &cfg, want, CAP, &wn, NULL);
            cfg.beam_size = 1;
            tl_session *s = NULL;
            tl_status st = tl_session_create_with(&tl_beam_decoder, m, prompt, 5 - p % 3, &cfg, &s);
            int32_t token;
            tl_stop_reason stop = TL_STOP_NONE;
            while (st == TL_OK && stop == TL_STOP_NONE) st = tl_session_step(s, &token, &stop);
            CHECK(st == TL_OK, "beam 1: %s", tl_last_error());
            const int32_t *tokens = tl_session_tokens(s, &gn);
            memcpy(got, tokens, (size_t)gn * sizeof *got);
            tl_session_free(s);
            CHECK(gn == wn && memcmp(got, want, (size_t)wn * 4) == 0, "%s prompt %d: beam width 1 != greedy", names[mi], p);
        }
        tl_model_free(m);
    }
}

static void test_determinism_and_stops(void) {
    int32_t prompt[4] = {9, 1, 40, 7}, a[CAP], b[CAP];
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 16;
    cfg.beam_size = 4;
    cfg.length_penalty = 0.7f;
    cfg.temperature = 0.9f; /* ignored by beam search */
    tl_generate_stats sa, sb;
    int na, nb;
    CHECK(tl_generate(model, prompt, 4, &cfg, a, CAP, &na, &sa) == TL_OK, "beam 4");
    CHECK(tl_generate(model_1thread, prompt, 4, &cfg, b, CAP, &nb, &sb) == TL_OK, "beam 4, 1 thread");
    CHECK(na == nb && memcmp(a, b, (size_t)na * 4) == 0 && memcmp(&sa.beam_score, &sb.beam_score, sizeof(double)) == 0,
          "beam search differs between 1 and 2 threads");
    cfg.sample_seed = 99;
    CHECK(tl_generate(model, prompt, 4, &cfg, b, CAP, &nb, &sb) == TL_OK && nb == na && memcmp(a, b, (size_t)na * 4) == 0,
          "sampling knobs must not change beam search");
    /* A stop sequence on the winner's second token ends that hypothesis there (kept in the output). */
    CHECK(na >= 6, "the winner has %d tokens: too few for the stop-sequence check", na);
    if (na >= 6) {
        int32_t seq[1] = {a[5]};
        tl_token_seq seqs[1] = {{seq, 1}};
        cfg.stop_sequences = seqs;
        cfg.n_stop_sequences = 1;
        CHECK(tl_generate(model, prompt, 4, &cfg, b, CAP, &nb, &sb) == TL_OK, "beam with stop sequence");
        bool ends_with_stop = nb > 4 && b[nb - 1] == seq[0];
        CHECK(sb.stop_reason != TL_STOP_SEQUENCE || ends_with_stop, "stop-sequence hypothesis must end with it");
        for (int i = 4; i < nb - 1; i++) CHECK(b[i] != seq[0], "stop token inside the winner at %d", i);
    }
}

/* Batches run beam search per prompt, like tl_generate. */
static void test_batch(void) {
    int32_t p1[2] = {3, 4}, p2[3] = {7, 8, 9}, out[2 * CAP], one[CAP];
    tl_token_seq prompts[2] = {{p1, 2}, {p2, 3}};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 8;
    cfg.beam_size = 3;
    int lens[2], total, n;
    CHECK(tl_generate_batch(model, prompts, 2, &cfg, out, 2 * CAP, lens, &total, NULL) == TL_OK, "beam batch: %s",
          tl_last_error());
    CHECK(tl_generate(model, p2, 3, &cfg, one, CAP, &n, NULL) == TL_OK && n == lens[1] &&
              memcmp(one, out + lens[0], (size_t)n * 4) == 0, "beam batch item differs from tl_generate");
}

static int noop_stop_rule(void *u, const int32_t *t, int n) { (void)u; (void)t; (void)n; return 0; }
static int noop_allowed(void *u, uint8_t *a, int v) { (void)u; (void)a; (void)v; return 0; }
static int noop_advance(void *u, int32_t t) { (void)u; (void)t; return 0; }

static void test_validation(void) {
    int32_t prompt[2] = {1, 2}, out[CAP];
    int n;
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 8;
    cfg.beam_size = 3;
    cfg.stop_rule = noop_stop_rule;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, out, CAP, &n, NULL), TL_ERR_UNSUPPORTED,
                "beam search (beam_size = 3) does not support a stop_rule hook");
    cfg.stop_rule = NULL;
    tl_grammar g = {.allowed = noop_allowed, .advance = noop_advance};
    cfg.grammar = &g;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, out, CAP, &n, NULL), TL_ERR_UNSUPPORTED, "a callback grammar");
    cfg.grammar = NULL;
    cfg.beam_size = 65;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, out, CAP, &n, NULL), TL_ERR_INVALID_ARGUMENT, "beam_size = 65");
    cfg.beam_size = 2;
    cfg.length_penalty = NAN;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, out, CAP, &n, NULL), TL_ERR_INVALID_ARGUMENT, "length_penalty");
    cfg.length_penalty = 1.0f;
    CHECK_ERROR(tl_generate(model, prompt, 2, &cfg, out, 5, &n, NULL), TL_ERR_INVALID_ARGUMENT, "out_capacity = 5");
    tl_speculative_config sc;
    tl_speculative_config_init(&sc);
    sc.max_tokens = 4;
    sc.verify_loops = 4;
    sc.base = &cfg;
    CHECK_ERROR(tl_generate_speculative(model, prompt, 2, &sc, out, CAP, &n, NULL), TL_ERR_UNSUPPORTED, "beam search");
    cfg.max_tokens = 0;
    CHECK(tl_generate(model, prompt, 2, &cfg, out, CAP, &n, NULL) == TL_OK && n == 2, "beam with max_tokens 0");
}

int main(int argc, char **argv) {
    char root[2048], dir[4096];
    snprintf(root, sizeof root, "%.2000s", argc > 1 ? argv[1] : "tests/data/golden");
    snprintf(dir, sizeof dir, "%s/add_residual_statenorm_rms_gqa2", root);
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 2;
    if (tl_model_load(dir, &o, &model) != TL_OK) { printf("load: %s\n", tl_last_error()); return 1; }
    o.n_threads = 1;
    tl_model_load(dir, &o, &model_1thread);
    eos = tl_model_info(model)->eos_token_id;
    test_hand_checked();
    test_width_one(root);
    test_determinism_and_stops();
    test_batch();
    test_validation();
    tl_model_free(model);
    tl_model_free(model_1thread);
    return check_summary();
}

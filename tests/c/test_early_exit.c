/* test_early_exit.c: adaptive-depth early exit (hidden-state and logit-margin probes) and
 * the KV sharing it relies on. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "forward.h"
#include "session.h"
#include "tinyloop.h"

#define CAP 64
static tl_model *model;

static tl_generate_stats run(tl_generate_config *cfg, int32_t *out, int *n) {
    int32_t prompt[4] = {4, 8, 15, 16};
    tl_generate_stats st;
    memset(&st, 0, sizeof st);
    CHECK(tl_generate(model, prompt, 4, cfg, out, CAP, n, &st) == TL_OK, "generate: %s", tl_last_error());
    return st;
}

static void test_modes(void) {
    int32_t plain[CAP], got[CAP];
    int np, ng;
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 20;
    cfg.loops = 8;
    cfg.ignore_eos = 1;
    tl_generate_stats ps = run(&cfg, plain, &np);
    CHECK(ps.loops_used == 8 && ps.depth_histogram[8] == 20 && ps.probes == 0, "plain: loops %g", ps.loops_used);

    cfg.early_exit_patience = 0; /* off */
    cfg.early_exit_threshold = 1e9f;
    tl_generate_stats st = run(&cfg, got, &ng);
    CHECK(ng == np && memcmp(plain, got, (size_t)np * 4) == 0 && st.probes == 0, "patience 0 must be plain");

    /* Unreachable threshold: every probe unstable, every token at full depth. */
    cfg.early_exit_patience = 1;
    cfg.early_exit_threshold = 0.0f;
    st = run(&cfg, got, &ng);
    CHECK(ng == np && memcmp(plain, got, (size_t)np * 4) == 0, "unreachable threshold changed the output");
    CHECK(st.loops_used == 8 && st.depth_histogram[8] == 20, "unreachable threshold: loops_used %g", st.loops_used);
    CHECK(st.probes == 19 * 6, "probes at loops 2..7 for 19 decoded tokens: %d", st.probes); /* token 1 comes from the prefill */
    CHECK(st.probe_ms > 0, "probe time");

    /* Logit-margin mode with a margin every probe meets: exit at min_L. */
    cfg.early_exit_threshold = 0.03f;
    cfg.early_exit_logit_margin = 1e-6f;
    cfg.early_exit_min_L = 3;
    st = run(&cfg, got, &ng);
    CHECK(st.depth_histogram[3] == 19 && st.depth_histogram[8] == 1, "margin mode: %d tokens at depth 3",
          st.depth_histogram[3]);
    CHECK(st.loops_used < 8 && st.loops_used > 3, "margin mode loops_used %g", st.loops_used);

    /* min_L at max_loops itself is a depth it reaches (only past it is refused): every token
       at full depth, as plain decoding */
    tl_generate_config at_max = cfg;
    at_max.loops = at_max.early_exit_min_L = tl_model_info(model)->max_loops;
    int32_t deepest[CAP];
    int n_deepest = 0;
    CHECK(tl_generate(model, (const int32_t[4]){4, 8, 15, 16}, 4, &at_max, deepest, CAP, &n_deepest, NULL) == TL_OK,
          "early_exit_min_L = max_loops = %d: %s", at_max.loops, tl_last_error());
    at_max.early_exit_min_L++;
    CHECK_ERROR(tl_generate(model, (const int32_t[4]){4, 8, 15, 16}, 4, &at_max, deepest, CAP, &n_deepest, NULL),
                TL_ERR_INVALID_ARGUMENT, "is past max_loops");

    /* Hidden-state mode with a loose threshold: loops_used drops (a probe needs the previous
       probe's argmax to agree, so the earliest exit is min_L + peek_every). */
    cfg.early_exit_logit_margin = 0.0f;
    cfg.early_exit_threshold = 1e9f;
    cfg.early_exit_min_L = 2;
    cfg.early_exit_peek_every = 2;
    st = run(&cfg, got, &ng);
    CHECK(st.loops_used < 8, "loose threshold: loops_used %g", st.loops_used);
    CHECK(st.depth_histogram[1] == 0 && st.depth_histogram[2] == 0 && st.depth_histogram[3] == 0,
          "no exit before min_L + peek_every");
    int total = 0;
    for (int d = 0; d < TL_HISTOGRAM_DEPTHS; d++) total += st.depth_histogram[d];
    CHECK(total == 20, "histogram counts %d tokens", total);

    tl_generate_config_init(&cfg);
    cfg.max_tokens = 4;
    cfg.early_exit_threshold = -1.0f;
    int32_t prompt[1] = {1};
    CHECK_ERROR(tl_generate(model, prompt, 1, &cfg, got, CAP, &ng, NULL), TL_ERR_INVALID_ARGUMENT, "early_exit_threshold = -1");
}

/* After an early-exit run, a full-depth token reads the exited positions' deepest slots:
   the same logits as with those slots explicitly copied into every deeper loop. */
static void test_kv_sharing(void) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 12;
    cfg.loops = 8;
    cfg.ignore_eos = 1;
    cfg.early_exit_patience = 1;
    cfg.early_exit_logit_margin = 1e-6f;
    cfg.early_exit_min_L = 2;
    int32_t prompt[3] = {7, 7, 9};
    tl_session *s = NULL;
    CHECK(tl_session_new(model, prompt, 3, &cfg, &s) == TL_OK, "session");
    int32_t tok;
    tl_stop_reason stop = TL_STOP_NONE;
    while (stop == TL_STOP_NONE && tl_session_step(s, &tok, &stop) == TL_OK) {}
    tl_kv_cache *c = s->cache;
    const tl_config *mc = &model->cfg;
    const bool host_memory = strcmp(model->backend->name, "cpu") == 0;
    int shallow = 0;
    for (int j = 0; j < c->length; j++) shallow += c->depth[j] == 2;
    CHECK(shallow >= 10, "exited positions in the cache: %d", shallow);

    /* A copy of the cache with explicit deep slots. */
    tl_kv_cache *copy = NULL;
    CHECK(tl_kv_cache_fork(c, &copy) == TL_OK, "fork the cache"); /* shares pages until written */
    copy->reserve_loops = mc->max_loops;
    for (int j = 0; j < c->length; j++) {
        for (int loop = copy->depth[j] + 1; loop <= mc->max_loops; loop++)
            for (int i = 0; i < mc->n_block; i++) {
                int from = mc->n_prelude + (copy->depth[j] - 1) * mc->n_block + i;
                int to = mc->n_prelude + (loop - 1) * mc->n_block + i;
                void *k_to, *v_to;
                CHECK(tl_kv_writable(copy, to, j, &k_to, &v_to), "page");
                if (host_memory) {
                    memcpy(k_to, tl_kv_k(copy, from, j), copy->row_bytes);
                    memcpy(v_to, tl_kv_v(copy, from, j), copy->row_bytes);
                } else { /* K/V rows are device memory (TINYLOOP_BACKEND=cuda): f32, the backend copies */
                    model->backend->copy(model, k_to, tl_kv_k(copy, from, j), (size_t)copy->row_bytes / sizeof(float));
                    model->backend->copy(model, v_to, tl_kv_v(copy, from, j), (size_t)copy->row_bytes / sizeof(float));
                }
            }
        copy->depth[j] = (uint16_t)mc->max_loops;
    }
    const int vocab = mc->vocab_size;
    float *a = malloc((size_t)vocab * sizeof(float)), *b = malloc((size_t)vocab * sizeof(float));
    int32_t next = 5, pos = c->length;
    tl_workspace ws = {0};
    CHECK(tl_forward_run(model, c, &ws, &next, &pos, 1, NULL, 8, 0, a) == TL_OK, "forward on the session cache");
    CHECK(tl_forward_run(model, copy, &ws, &next, &pos, 1, NULL, 8, 0, b) == TL_OK, "forward on the copy");
    CHECK(memcmp(a, b, (size_t)vocab * sizeof(float)) == 0, "shared reads differ from copied slots");
    free(a);
    free(b);
    tl_workspace_release(&ws);
    tl_kv_cache_free(copy);
    tl_session_free(s);
}

/* tl_forward_loop_measured is tl_forward_loop plus the hidden-state measure the probe used
   to compute on the host: same logits, same number (CPU buffers are host memory; another
   backend's state is not, so there only the logits are compared). */
static void test_measured_loop(void) {
    const tl_config *mc = &model->cfg;
    const bool host_memory = strcmp(model->backend->name, "cpu") == 0;
    const int d = mc->d_model, vocab = mc->vocab_size;
    int32_t tok = 9, pos = 0;
    float *before = malloc((size_t)d * sizeof(float));
    float *a = malloc((size_t)vocab * sizeof(float)), *b = malloc((size_t)vocab * sizeof(float));
    for (int measured = 0; measured <= 1; measured++) {
        tl_kv_cache *c = NULL;
        tl_workspace ws = {0};
        tl_forward f;
        CHECK(tl_kv_cache_new_for(model, 4, 0, 1, &c) == TL_OK, "cache");
        CHECK(tl_forward_begin(&f, model, c, &ws, &tok, &pos, 1, NULL) == TL_OK, "begin");
        for (int l = 1; l <= 4; l++) {
            if (!measured) { tl_forward_loop(&f); continue; }
            double got;
            if (!host_memory) {
                tl_forward_loop_measured(&f, &got);
                CHECK(got >= 0.0, "loop %d: measured change %g", l, got);
                continue;
            }
            memcpy(before, ws.s, (size_t)d * sizeof(float));
            tl_forward_loop_measured(&f, &got);
            double change = 0.0, norm = 0.0;
            for (int i = 0; i < d; i++) {
                double delta = (double)ws.s[i] - (double)before[i];
                change += delta * delta;
                norm += (double)ws.s[i] * (double)ws.s[i];
            }
            const double want = norm > 0.0 ? sqrt(change / norm) : INFINITY;
            CHECK(got == want, "loop %d: measured change %.17g, host formula %.17g", l, got, want);
        }
        tl_forward_end(&f, 0, measured ? b : a);
        tl_workspace_release(&ws);
        tl_kv_cache_free(c);
    }
    CHECK(memcmp(a, b, (size_t)vocab * sizeof(float)) == 0, "measured loops changed the logits");
    free(before);
    free(a);
    free(b);
}

int main(int argc, char **argv) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/deep_residual", argc > 1 ? argv[1] : "tests/data/golden");
    if (tl_model_load(dir, NULL, &model) != TL_OK) { printf("load: %s\n", tl_last_error()); return 1; }
    test_modes();
    test_kv_sharing();
    test_measured_loop();
    tl_model_free(model);
    return check_summary();
}

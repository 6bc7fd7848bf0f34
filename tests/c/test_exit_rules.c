/* test_exit_rules.c: the early-exit criteria (tl_generate_config.early_exit_criterion) and the
 * per-loop depth_policy hook.
 *   - Ouro's gate: on the tiny Ouro folders (tests/data/hf), every token decoded after a
 *     full-depth prefix exits at the pass scripts/reference/ouro_ref.py's rule gives (goldens
 *     exits.{i} for thresholds exit_q), and the hook sees the golden per-pass gates;
 *   - Huginn's criteria (latent-diff, KL, entropy-diff, argmax stability, and the hidden-state
 *     default): each exits where an independent host computation over per-loop logits says;
 *     runs are deterministic;
 *   - the hook: it decides the depth, sees probes on the schedule, its error aborts cleanly;
 *   - the rules of the new fields, each fed a bad value. */
#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "forward.h"
#include "safetensors.h"
#include "session.h"
#include "tinyloop.h"

static const char *data; /* tests/data */

static tl_model *load(const char *sub) {
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/%s", data, sub);
    tl_model *m = NULL;
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 2;
    /* (a model that does not load fails the test: the callers return without it) */
    CHECK(tl_model_load(dir, &o, &m) == TL_OK, "load %s: %s", dir, tl_last_error());
    return m;
}

/* A logits_processor that leaves only `token` allowed (the decode then follows a script). */
static int force_token(void *user, float *logits, int vocab, const int32_t *tokens, int n) {
    (void)tokens;
    (void)n;
    const int32_t token = *(const int32_t *)user;
    for (int i = 0; i < vocab; i++)
        if (i != token) logits[i] = -INFINITY;
    return TL_HOOK_CONTINUE;
}

/* Decodes `forced` after prompt[0..n) (prefilled at full depth), and returns the depth the
   decoded token's forward stopped at (-1 on error). */
static int exit_depth_after(const tl_model *m, const int32_t *prompt, int n, int32_t forced,
                            const tl_generate_config *base) {
    tl_generate_config cfg = *base;
    cfg.max_tokens = 2;
    cfg.ignore_eos = 1;
    cfg.logits_processor = force_token;
    cfg.logits_processor_user = &forced;
    tl_session *s = NULL;
    int32_t tok;
    tl_stop_reason stop;
    int depth = -1;
    if (tl_session_new(m, prompt, n, &cfg, &s) == TL_OK && tl_session_step(s, &tok, &stop) == TL_OK &&
        tl_session_step(s, &tok, &stop) == TL_OK)
        depth = s->last_depth;
    else
        printf("session: %s\n", tl_last_error());
    tl_session_free(s);
    return depth;
}

/* ---------------------------------------------------------------- Ouro's gate */

typedef struct {
    double gate[64], probability[64];
    int calls;
} gate_record;

static int record_gates(void *user, const tl_loop_signals *sig) {
    gate_record *r = user;
    if (sig->loop != r->calls + 1 || sig->loop >= sig->loops) return TL_HOOK_ERROR;
    r->gate[r->calls] = sig->gate;
    r->probability[r->calls++] = sig->exit_probability;
    return TL_HOOK_CONTINUE;
}

static void test_ouro_gate(const char *name) {
    char path[4300], sub[256];
    snprintf(sub, sizeof sub, "hf/%s", name);
    snprintf(path, sizeof path, "%s/hf/%s/golden.safetensors", data, name);
    tl_model *m = load(sub);
    tl_st_file f;
    CHECK(m && tl_st_open(path, &f) == TL_OK, "%s: model and golden", name);
    if (!m) return;
    CHECK(tl_model_info(m)->exit_gate == 1, "%s: info.exit_gate", name);
    const tl_st_tensor *qs = tl_st_find(&f, "exit_q");
    CHECK(qs != NULL, "%s: golden exit_q", name);
    const int n_q = qs ? (int)qs->shape[0] : 0, passes = 4;
    int compared = 0, early = 0;
    for (int i = 0; i < 16; i++) {
        char key[64];
        snprintf(key, sizeof key, "tokens.%d", i);
        const tl_st_tensor *t = tl_st_find(&f, key);
        snprintf(key, sizeof key, "exits.%d", i);
        const tl_st_tensor *e = tl_st_find(&f, key);
        if (!t || !e) break;
        const int n = (int)t->shape[0];
        const int32_t *tokens = (const int32_t *)t->data, *exits = (const int32_t *)e->data;
        for (int k = 0; k < n_q; k++) {
            tl_generate_config cfg;
            tl_generate_config_init(&cfg);
            cfg.loops = passes;
            cfg.early_exit_criterion = TL_EXIT_GATE;
            cfg.early_exit_patience = 1; /* Ouro's own rule: every pass checked, exit at once */
            cfg.early_exit_min_L = 1;
            cfg.early_exit_gate_threshold = ((const float *)qs->data)[k];
            for (int p = 1; p < n; p++) {
                const int got = exit_depth_after(m, tokens, p, tokens[p], &cfg), want = exits[k * n + p];
                CHECK(got == want, "%s seq %d position %d q %.2f: exit at pass %d, reference %d", name, i, p,
                      (double)cfg.early_exit_gate_threshold, got, want);
                compared++;
                early += want < passes;
            }
        }
    }
    CHECK(compared > 100 && early > compared / 4, "%s: %d exits compared, %d early", name, compared, early);

    /* The hook's signals carry the gates: those of the longest golden sequence at 4 passes. */
    const tl_st_tensor *t = tl_st_find(&f, "tokens.3"), *g = tl_st_find(&f, "gates.3");
    CHECK(t && g && g->shape[0] == passes, "%s: golden gates.3 of 4 passes", name);
    if (t && g) {
        const int n = (int)t->shape[0];
        const int32_t *tokens = (const int32_t *)t->data;
        const float *gates = (const float *)g->data; /* [passes][n] */
        double worst = 0.0;
        for (int p = 1; p < n; p++) {
            gate_record rec = {{0}, {0}, 0};
            tl_generate_config cfg;
            tl_generate_config_init(&cfg);
            cfg.loops = passes;
            cfg.depth_policy = record_gates;
            cfg.depth_policy_user = &rec;
            CHECK(exit_depth_after(m, tokens, p, tokens[p], &cfg) == passes && rec.calls == passes - 1,
                  "%s position %d: a hook that continues runs every pass (%d calls)", name, p, rec.calls);
            double remaining = 1.0, cumulative = 0.0;
            for (int u = 0; u < rec.calls; u++) {
                const double want = gates[u * n + p];
                cumulative += want * remaining;
                remaining *= 1.0 - want;
                worst = fmax(worst, fabs(rec.gate[u] - want));
                worst = fmax(worst, fabs(rec.probability[u] - cumulative));
            }
        }
        CHECK(worst <= 1e-5, "%s: gates and exit probabilities within 1e-5 of the reference (%.3g)", name, worst);
        printf("  %-16s gate exits match the reference; max |gate diff| %.2e\n", name, worst);
    }
    /* The model's own threshold (config.json early_exit_threshold) is the default. */
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.loops = passes;
    cfg.early_exit_criterion = TL_EXIT_GATE;
    cfg.early_exit_patience = 1;
    cfg.early_exit_min_L = 1;
    const tl_st_tensor *t0 = tl_st_find(&f, "tokens.1");
    if (t0 && tl_model_info(m)->exit_gate_threshold >= 1.0f) {
        /* 1.0: a cumulative probability below 1 never reaches it; every token runs all passes */
        const int32_t *tokens = (const int32_t *)t0->data;
        for (int p = 1; p < (int)t0->shape[0]; p++)
            CHECK(exit_depth_after(m, tokens, p, tokens[p], &cfg) == passes, "%s: threshold 1 exits early", name);
    }
    tl_st_close(&f);
    tl_model_free(m);
}

/* ---------------------------------------------------------------- Huginn's criteria */

#define L 8
#define PROMPT 5

/* Per-loop logits of the token decoded after the prompt (full-depth prefix, a head after
   every loop, as probes would run), and the state change of each loop. */
typedef struct {
    float *logits[L + 1]; /* [1..L] */
    double change[L + 1];
    int32_t first;        /* the token decoded (greedy after the prompt) */
} trajectory;

static const int32_t prompt[PROMPT] = {4, 8, 15, 16, 23};

static void trace(const tl_model *m, trajectory *tr) {
    const int vocab = m->cfg.vocab_size;
    float *scores = malloc((size_t)PROMPT * (size_t)vocab * sizeof(float));
    CHECK(tl_score(m, prompt, PROMPT, L, scores) == TL_OK, "score");
    tr->first = tl_argmax(scores + (size_t)(PROMPT - 1) * (size_t)vocab, vocab);
    free(scores);
    int32_t pos[PROMPT + 1];
    for (int i = 0; i <= PROMPT; i++) pos[i] = i;
    tl_kv_cache *cache = NULL;
    tl_workspace ws = {0};
    tl_forward f;
    CHECK(tl_kv_cache_new_for(m, PROMPT + 1, 0, PROMPT, &cache) == TL_OK &&
              tl_forward_run(m, cache, &ws, prompt, pos, PROMPT, NULL, L, PROMPT, NULL) == TL_OK &&
              tl_forward_begin(&f, m, cache, &ws, &tr->first, pos + PROMPT, 1, NULL) == TL_OK,
          "trace forward: %s", tl_last_error());
    for (int l = 1; l <= L; l++) {
        tr->logits[l] = malloc((size_t)vocab * sizeof(float));
        tl_forward_loop_measured(&f, &tr->change[l]);
        tl_forward_head(&f, 0, tr->logits[l]);
    }
    tl_workspace_release(&ws);
    tl_kv_cache_free(cache);
}

/* Host-side distribution statistics, written independently of early_exit.c. */
static double entropy_of(const float *x, int vocab) {
    double mx = -INFINITY, z = 0.0, h = 0.0;
    for (int i = 0; i < vocab; i++) mx = fmax(mx, x[i]);
    for (int i = 0; i < vocab; i++) z += exp(x[i] - mx);
    for (int i = 0; i < vocab; i++) {
        const double p = exp(x[i] - mx) / z;
        if (p > 0) h -= p * log(p);
    }
    return h;
}

static double kl_of(const float *prev, const float *cur, int vocab) { /* KL(prev || cur) */
    double mp = -INFINITY, mc = -INFINITY, zp = 0.0, zc = 0.0, kl = 0.0;
    for (int i = 0; i < vocab; i++) { mp = fmax(mp, prev[i]); mc = fmax(mc, cur[i]); }
    for (int i = 0; i < vocab; i++) { zp += exp(prev[i] - mp); zc += exp(cur[i] - mc); }
    for (int i = 0; i < vocab; i++) {
        const double lp = prev[i] - mp - log(zp), lc = cur[i] - mc - log(zc);
        kl += exp(lp) * (lp - lc);
    }
    return kl;
}

/* The measure a criterion compares with its threshold at loop l (min_L 1: every loop is
   probed, the first has no previous probe: +inf). */
static double measure(tl_exit_criterion c, const trajectory *tr, int l, int vocab) {
    if (c == TL_EXIT_LATENT_DIFF) return tr->change[l];
    if (l < 2) return INFINITY;
    if (c == TL_EXIT_KL) return kl_of(tr->logits[l - 1], tr->logits[l], vocab);
    return fabs(entropy_of(tr->logits[l], vocab) - entropy_of(tr->logits[l - 1], vocab));
}

static tl_generate_stats decode_two(const tl_model *m, const tl_generate_config *base, int32_t *second) {
    tl_generate_config cfg = *base;
    cfg.loops = L;
    cfg.max_tokens = 2;
    cfg.ignore_eos = 1;
    int32_t out[PROMPT + 2];
    int n = 0;
    tl_generate_stats st;
    memset(&st, 0, sizeof st);
    CHECK(tl_generate(m, prompt, PROMPT, &cfg, out, PROMPT + 2, &n, &st) == TL_OK && n == PROMPT + 2,
          "generate: %s", tl_last_error());
    *second = out[PROMPT + 1];
    return st;
}

/* Depth of the decoded (second) token: the first comes from the prefill, at L. */
static int second_depth(const tl_generate_stats *st) {
    for (int d = 1; d <= L; d++)
        if (st->depth_histogram[d] == (d == L ? 2 : 1)) return d;
    return -1;
}

static void test_huginn_criteria(void) {
    tl_model *m = load("golden/deep_residual");
    CHECK(m != NULL, "load deep_residual");
    if (!m) return;
    const int vocab = m->cfg.vocab_size;
    trajectory tr;
    trace(m, &tr);
    const tl_exit_criterion measured[] = {TL_EXIT_LATENT_DIFF, TL_EXIT_KL, TL_EXIT_ENTROPY_DIFF};
    const char *names[] = {"latent_diff", "kl", "entropy_diff"};
    for (int k = 0; k < 3; k++) {
        const tl_exit_criterion c = measured[k];
        int early = 0, depths = 0; /* exits before L, and distinct depths seen (bitmask) */
        /* Thresholds just above each loop's measure, and 0 (never met): the expected exit is
           the first loop whose measure is below the threshold. */
        for (int at = 0; at < L; at++) {
            const double threshold = at == 0 ? 0.0 : measure(c, &tr, at, vocab) * 1.01 + 1e-12;
            if (!isfinite(threshold)) continue;
            int want = L;
            for (int l = 1; l < L && want == L; l++)
                if (measure(c, &tr, l, vocab) < threshold) want = l;
            tl_generate_config cfg;
            tl_generate_config_init(&cfg);
            cfg.early_exit_criterion = c;
            cfg.early_exit_patience = 1;
            cfg.early_exit_min_L = 1;
            cfg.early_exit_threshold = (float)threshold;
            cfg.early_exit_kl_threshold = (float)threshold;
            cfg.early_exit_entropy_threshold = (float)threshold;
            if ((double)(float)threshold != threshold) { /* compare in the float the config holds */
                const float t = (float)threshold;
                want = L;
                for (int l = 1; l < L && want == L; l++)
                    if (measure(c, &tr, l, vocab) < (double)t) want = l;
            }
            int32_t second, again;
            tl_generate_stats a = decode_two(m, &cfg, &second), b = decode_two(m, &cfg, &again);
            const int got = second_depth(&a);
            early += want < L;
            depths |= 1 << want;
            CHECK(got == want, "%s threshold %.6g: exit at %d, expected %d", names[k], threshold, got, want);
            CHECK(second == tl_argmax(tr.logits[want], vocab), "%s: the token comes from depth %d's logits",
                  names[k], want);
            CHECK(second == again && memcmp(a.depth_histogram, b.depth_histogram, sizeof a.depth_histogram) == 0 &&
                      a.probes == b.probes, "%s: two runs differ", names[k]);
        }
        CHECK(early >= 3 && __builtin_popcount((unsigned)depths) >= 3, "%s: %d early exits over %d depths", names[k],
              early, __builtin_popcount((unsigned)depths));
        printf("  %-14s exits where expected at %d thresholds (%d depths)\n", names[k], early,
               __builtin_popcount((unsigned)depths));
    }
    /* Argmax stability with patience p: the argmax equal to the previous probe's at p
       checked loops in a row; and the hidden-state default (state change and argmax). */
    for (int patience = 1; patience <= 3; patience++) {
        int want = L, run = 0;
        for (int l = 2; l < L && want == L; l++) {
            run = tl_argmax(tr.logits[l], vocab) == tl_argmax(tr.logits[l - 1], vocab) ? run + 1 : 0;
            if (run >= patience) want = l;
        }
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.early_exit_criterion = TL_EXIT_ARGMAX;
        cfg.early_exit_patience = patience;
        cfg.early_exit_min_L = 1;
        int32_t second;
        tl_generate_stats st = decode_two(m, &cfg, &second);
        CHECK(patience > 1 || want < L, "argmax patience 1 never exits: the test would prove nothing");
        CHECK(second_depth(&st) == want, "argmax patience %d: exit at %d, expected %d", patience,
              second_depth(&st), want);
        CHECK(st.probes == (want < L ? want : L - 1), "argmax: %d probes before the exit at %d", st.probes, want);
    }
    {
        int want = L;
        for (int l = 2; l < L && want == L; l++)
            if (tr.change[l] < 1e9 && tl_argmax(tr.logits[l], vocab) == tl_argmax(tr.logits[l - 1], vocab)) want = l;
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.early_exit_patience = 1;
        cfg.early_exit_min_L = 1;
        cfg.early_exit_threshold = 1e9f;
        int32_t second;
        tl_generate_stats st = decode_two(m, &cfg, &second);
        CHECK(second_depth(&st) == want, "hidden_state: exit at %d, expected %d", second_depth(&st), want);
    }
    for (int l = 1; l <= L; l++) free(tr.logits[l]);
    tl_model_free(m);
}

/* ---------------------------------------------------------------- the hook */

typedef struct {
    int exit_at;       /* loop to answer STOP at (0: never); -1: answer an error */
    int calls, probed, with_kl;
    int bad;           /* signals that broke their documented shape */
} policy_state;

static int policy(void *user, const tl_loop_signals *sig) {
    policy_state *p = user;
    p->calls++;
    if (sig->loops != L || sig->loop < 1 || sig->loop >= L || !(sig->state_change >= 0)) p->bad++;
    if (!isnan(sig->gate) || !isnan(sig->exit_probability)) p->bad++; /* no gate in this model */
    if (sig->probed) {
        p->probed++;
        if (sig->argmax < 0 || !(sig->entropy >= 0)) p->bad++;
        if (!isnan(sig->kl)) p->with_kl++;
    } else if (sig->argmax != -1 || !isnan(sig->entropy) || !isnan(sig->kl)) {
        p->bad++;
    }
    if (p->exit_at < 0) return TL_HOOK_ERROR;
    return sig->loop == p->exit_at ? TL_HOOK_STOP : TL_HOOK_CONTINUE;
}

/* A hook that goes on past the criterion's advice, counting the loops it was given as
   exits: said[0] on loops the schedule (min_L, peek_every) checks, said[1] on the others. */
typedef struct { int min_L, peek_every, said[2]; } advice_count;
static int past_advice(void *user, const tl_loop_signals *sig) {
    advice_count *a = user;
    const bool checked = sig->loop >= a->min_L && (sig->loop - a->min_L) % a->peek_every == 0;
    if (sig->criterion_exit) a->said[checked ? 0 : 1]++;
    return TL_HOOK_CONTINUE;
}

static int follow_advice(void *user, const tl_loop_signals *sig) {
    (void)user;
    return sig->criterion_exit ? TL_HOOK_STOP : TL_HOOK_CONTINUE;
}

static void test_depth_policy(void) {
    tl_model *m = load("golden/deep_residual");
    CHECK(m != NULL, "load deep_residual");
    if (!m) return;
    const int tokens = 6;
    /* The hook alone (patience 0) decides: exit at loop 3 for every decoded token. */
    policy_state p = {3, 0, 0, 0, 0};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.loops = L;
    cfg.max_tokens = tokens;
    cfg.ignore_eos = 1;
    cfg.depth_policy = policy;
    cfg.depth_policy_user = &p;
    cfg.early_exit_min_L = 2; /* probes at loops 2, 3 */
    int32_t out[PROMPT + 8];
    int n = 0;
    tl_generate_stats st;
    CHECK(tl_generate(m, prompt, PROMPT, &cfg, out, PROMPT + 8, &n, &st) == TL_OK, "hook run: %s", tl_last_error());
    CHECK(st.depth_histogram[3] == tokens - 1 && st.depth_histogram[L] == 1, "hook exits at 3: %d tokens",
          st.depth_histogram[3]);
    CHECK(p.calls == 3 * (tokens - 1) && p.probed == 2 * (tokens - 1) && p.with_kl == tokens - 1 && p.bad == 0,
          "hook calls %d, probed %d, with kl %d, bad %d", p.calls, p.probed, p.with_kl, p.bad);

    /* A hook that never exits is plain decoding at L: the same tokens. */
    int32_t plain[PROMPT + 8];
    int np = 0;
    tl_generate_config off = cfg;
    off.depth_policy = NULL;
    CHECK(tl_generate(m, prompt, PROMPT, &off, plain, PROMPT + 8, &np, NULL) == TL_OK, "plain");
    p = (policy_state){0, 0, 0, 0, 0};
    CHECK(tl_generate(m, prompt, PROMPT, &cfg, out, PROMPT + 8, &n, &st) == TL_OK && n == np &&
              memcmp(out, plain, (size_t)n * sizeof *out) == 0 && st.depth_histogram[L] == tokens,
          "a hook that never exits changed the output");
    CHECK(p.calls == (L - 1) * (tokens - 1), "hook called after loops 1..L-1: %d calls", p.calls);

    /* Its advice: a hook that answers criterion_exit decodes as the criterion alone does. */
    tl_generate_config alone = off, advised = cfg;
    alone.early_exit_patience = advised.early_exit_patience = 1;
    alone.early_exit_threshold = advised.early_exit_threshold = 1e9f;
    advised.depth_policy = follow_advice;
    tl_generate_stats sa, sb;
    int32_t oa[PROMPT + 8], ob[PROMPT + 8];
    int na_ = 0, nb_ = 0;
    CHECK(tl_generate(m, prompt, PROMPT, &alone, oa, PROMPT + 8, &na_, &sa) == TL_OK &&
              tl_generate(m, prompt, PROMPT, &advised, ob, PROMPT + 8, &nb_, &sb) == TL_OK && na_ == nb_ &&
              memcmp(oa, ob, (size_t)na_ * sizeof *oa) == 0 &&
              memcmp(sa.depth_histogram, sb.depth_histogram, sizeof sa.depth_histogram) == 0 && sa.loops_used < L,
          "following criterion_exit differs from the criterion (loops_used %g / %g)", sa.loops_used, sb.loops_used);
    /* The advice is given on the loops the criterion checks only: past a checked loop that
       said exit, the loops the schedule skips (peek_every 3) are not said to be exits. */
    tl_generate_config past = advised;
    past.early_exit_peek_every = 3; /* (checks at loops 2 and 5; L - 1 loops a token) */
    past.early_exit_criterion = TL_EXIT_LATENT_DIFF; /* (met on every checked loop: threshold 1e9) */
    advice_count exits_said = {past.early_exit_min_L, past.early_exit_peek_every, {0, 0}};
    past.depth_policy = past_advice;
    past.depth_policy_user = &exits_said;
    CHECK(tl_generate(m, prompt, PROMPT, &past, ob, PROMPT + 8, &nb_, NULL) == TL_OK, "past the advice: %s", tl_last_error());
    CHECK(exits_said.said[0] > 0 && exits_said.said[1] == 0, "criterion_exit on checked loops %d, on unchecked ones %d",
          exits_said.said[0], exits_said.said[1]);
    /* An error from the hook aborts with TL_ERR_HOOK naming it; the next call works. */
    p = (policy_state){-1, 0, 0, 0, 0};
    CHECK_ERROR(tl_generate(m, prompt, PROMPT, &cfg, out, PROMPT + 8, &n, NULL), TL_ERR_HOOK, "depth_policy");
    p = (policy_state){3, 0, 0, 0, 0};
    CHECK(tl_generate(m, prompt, PROMPT, &cfg, out, PROMPT + 8, &n, &st) == TL_OK, "after a hook error");

    /* A hooked session steps alone in a batch: the same tokens as on its own. */
    tl_session *a = NULL, *b = NULL;
    policy_state pa = {3, 0, 0, 0, 0};
    cfg.depth_policy_user = &pa;
    CHECK(tl_session_new(m, prompt, PROMPT, &cfg, &a) == TL_OK && tl_session_new(m, prompt, PROMPT, &off, &b) == TL_OK,
          "sessions");
    int32_t toks[2];
    tl_stop_reason stops[2] = {TL_STOP_NONE, TL_STOP_NONE};
    tl_status sts[2];
    tl_session *both[2] = {a, b};
    for (int i = 0; i < tokens && stops[0] == TL_STOP_NONE; i++)
        CHECK(tl_session_step_batch(both, 2, toks, stops, sts) == TL_OK && sts[0] == TL_OK && sts[1] == TL_OK,
              "batch step");
    int na = 0;
    const int32_t *ta = tl_session_tokens(a, &na);
    CHECK(na == n && memcmp(ta, out, (size_t)n * sizeof *out) == 0, "the hooked session in a batch differs");
    CHECK(tl_session_stats(a)->depth_histogram[3] == tokens - 1, "batched hooked session exits at 3");
    tl_session_free(a);
    tl_session_free(b);
    tl_model_free(m);
}

/* ---------------------------------------------------------------- depth per session */

/* The published folders allow 4x their trained depth (KV pages follow the depth in use): a
   session may run shallower or deeper than the default through `loops`, deterministically,
   paying KV memory for its own depth only; beyond max_loops is refused by name. */
static void test_depth_override(const char *name) {
    char sub[256];
    snprintf(sub, sizeof sub, "hf/%s", name);
    tl_model *m = load(sub);
    CHECK(m != NULL, "load %s", name);
    if (!m) return;
    const struct tl_model_info *info = tl_model_info(m);
    CHECK(info->max_loops == 4 * info->default_loops, "%s: max_loops %d, default_loops %d", name, info->max_loops,
          info->default_loops);
    const int32_t p[3] = {3, 5, 7};
    size_t bytes[2] = {0, 0};
    const int depths[2] = {1, 2 * info->default_loops};
    for (int k = 0; k < 2; k++) {
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.loops = depths[k];
        cfg.max_tokens = 4;
        cfg.ignore_eos = 1;
        int32_t a[8], b[8];
        int na = 0, nb = 0;
        tl_generate_stats st;
        CHECK(tl_generate(m, p, 3, &cfg, a, 8, &na, &st) == TL_OK && tl_generate(m, p, 3, &cfg, b, 8, &nb, NULL) == TL_OK &&
                  na == nb && memcmp(a, b, (size_t)na * sizeof *a) == 0 && st.loops_used == depths[k],
              "%s at loops %d: %s", name, depths[k], tl_last_error());
        tl_session *s = NULL;
        int32_t tok;
        tl_stop_reason stop;
        CHECK(tl_session_new(m, p, 3, &cfg, &s) == TL_OK && tl_session_step(s, &tok, &stop) == TL_OK, "session");
        bytes[k] = s ? tl_kv_cache_bytes(s->cache) : 0;
        tl_session_free(s);
    }
    CHECK(bytes[1] > 4 * bytes[0], "%s: KV bytes at depth %d (%zu) vs 1 (%zu): pages follow the depth", name,
          depths[1], bytes[1], bytes[0]);
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.loops = info->max_loops + 1;
    cfg.max_tokens = 2;
    int32_t out[8];
    int n;
    char want[64];
    snprintf(want, sizeof want, "loops = %d is out of range [1, max_loops = %d]", info->max_loops + 1, info->max_loops);
    CHECK_ERROR(tl_generate(m, p, 3, &cfg, out, 8, &n, NULL), TL_ERR_INVALID_ARGUMENT, want);
    tl_model_free(m);
}

/* ---------------------------------------------------------------- rules */

static void test_rules(void) {
    tl_model *m = load("golden/deep_residual");
    if (!m) return;
    int32_t out[16];
    int n;
    tl_generate_config cfg;
#define BAD(field, value, status, needle)                                                          \
    do {                                                                                           \
        tl_generate_config_init(&cfg);                                                             \
        cfg.max_tokens = 2;                                                                        \
        cfg.field = value;                                                                         \
        CHECK_ERROR(tl_generate(m, prompt, PROMPT, &cfg, out, 16, &n, NULL), status, needle);      \
    } while (0)
    BAD(early_exit_criterion, (tl_exit_criterion)9, TL_ERR_INVALID_ARGUMENT, "early_exit_criterion = 9");
    BAD(early_exit_criterion, (tl_exit_criterion)-1, TL_ERR_INVALID_ARGUMENT, "early_exit_criterion = -1");
    BAD(early_exit_criterion, TL_EXIT_GATE, TL_ERR_UNSUPPORTED, "exit gate");
    BAD(early_exit_kl_threshold, -1.0f, TL_ERR_INVALID_ARGUMENT, "early_exit_kl_threshold = -1");
    BAD(early_exit_kl_threshold, NAN, TL_ERR_INVALID_ARGUMENT, "early_exit_kl_threshold = nan");
    BAD(early_exit_entropy_threshold, INFINITY, TL_ERR_INVALID_ARGUMENT, "early_exit_entropy_threshold = inf");
    BAD(early_exit_gate_threshold, 1.5f, TL_ERR_INVALID_ARGUMENT, "early_exit_gate_threshold = 1.5");
    BAD(early_exit_gate_threshold, -0.5f, TL_ERR_INVALID_ARGUMENT, "early_exit_gate_threshold = -0.5");
    /* the margin belongs to the hidden-state criterion */
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 2;
    cfg.early_exit_criterion = TL_EXIT_KL;
    cfg.early_exit_logit_margin = 1.0f;
    CHECK_ERROR(tl_generate(m, prompt, PROMPT, &cfg, out, 16, &n, NULL), TL_ERR_INVALID_ARGUMENT,
                "applies to the hidden_state criterion only");
    /* a depth_policy is early exit: refused with speculative decoding and beam search */
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 2;
    cfg.loops = 4;
    cfg.depth_policy = policy;
    cfg.speculative = TL_SPECULATIVE_CHAIN;
    CHECK_ERROR(tl_generate(m, prompt, PROMPT, &cfg, out, 16, &n, NULL), TL_ERR_UNSUPPORTED, "depth_policy");
    cfg.speculative = TL_SPECULATIVE_OFF;
    cfg.beam_size = 2;
    CHECK_ERROR(tl_generate(m, prompt, PROMPT, &cfg, out, 16, &n, NULL), TL_ERR_UNSUPPORTED, "early exit");
#undef BAD
    tl_model_free(m);
}

int main(int argc, char **argv) {
    data = argc > 1 ? argv[1] : "tests/data";
    test_ouro_gate("ouro_f32");
    test_ouro_gate("ouro_bf16_tied");
    test_huginn_criteria();
    test_depth_policy();
    test_depth_override("huginn_f32");
    test_depth_override("ouro_f32");
    test_rules();
    return check_summary();
}

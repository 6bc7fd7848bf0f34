/* test_cuda.c: the CUDA backend plugin (cuda/, libtinyloop-cuda.so), through the public API.
 *
 * Usage: test_cuda DATA_DIR [expect]
 *   expect "no-plugin": TINYLOOP_CUDA_PLUGIN points nowhere; backend CUDA must fail with
 *                       TL_ERR_UNSUPPORTED naming the plugin, AUTO must fall back to the CPU.
 *   expect "no-entry":  TINYLOOP_CUDA_PLUGIN points at a library that is no plugin; the
 *                       message names that file (not the default plugin name), AUTO the CPU.
 *   expect "device":    a GPU must be used (scripts/gpu-check): a load that fails is a failure,
 *                       not the refusal checked here on machines without one.
 *   otherwise:          with no device (CI), backend CUDA fails with TL_ERR_UNSUPPORTED naming
 *                       the cause and AUTO gives the CPU; with a device (scripts/gpu-check):
 *     - logits parity with the CPU backend on every golden config and the text model
 *       (max |diff| <= 1e-3 of the largest |logit|, f32 accumulation on both);
 *     - on the GPU, greedy chain and tree speculative decoding and batched decoding emit
 *       exactly the tokens of plain decoding, on 100 random prompts;
 *     - prefill-then-decode equals token by token: scoring prompt + greedy continuation in
 *       one forward picks every continuation token at its position. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "tinyloop.h"

static tl_status load(const char *dir, tl_backend_kind kind, tl_model **m) {
    tl_load_options o;
    tl_load_options_init(&o);
    o.backend = kind;
    o.n_threads = 2;
    return tl_model_load(dir, &o, m);
}

static uint64_t rng = 12345;
static int random_token(int vocab) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int)((rng >> 33) % (uint64_t)vocab);
}

/* ---------------------------------------------------------------- without a device */

static void check_refusal(const char *dir, const char *expect) {
    tl_model *m = NULL;
    tl_status st = load(dir, TL_BACKEND_CUDA, &m);
    CHECK(st == TL_ERR_UNSUPPORTED, "backend CUDA without a device: got %s", tl_status_name(st));
    const char *msg = tl_last_error();
    CHECK(strncmp(msg, "backend CUDA: ", 14) == 0, "message: %s", msg);
    if (!strcmp(expect, "no-plugin"))
        CHECK(strstr(msg, "libtinyloop-cuda.so could not be loaded") != NULL, "message: %s", msg);
    else if (!strcmp(expect, "no-entry")) {
        char want[4300];
        snprintf(want, sizeof want, "%s has no entry point", getenv("TINYLOOP_CUDA_PLUGIN"));
        CHECK(strstr(msg, want) != NULL, "message: %s", msg);
    }
    else
        CHECK(strstr(msg, "no CUDA device") != NULL || strstr(msg, "could not be loaded") != NULL, "message: %s", msg);
    if (m) tl_model_free(m);
    /* AUTO: the CPU, silently */
    st = load(dir, TL_BACKEND_AUTO, &m);
    CHECK(st == TL_OK, "AUTO load: %s", tl_last_error());
    if (st == TL_OK) {
        CHECK(strcmp(tl_model_info(m)->backend, "cpu") == 0, "AUTO without a device: %s", tl_model_info(m)->backend);
        tl_model_free(m);
    }
}

/* ---------------------------------------------------------------- with a device */

static void check_parity(const char *dir) {
    tl_model *cpu = NULL, *gpu = NULL;
    if (load(dir, TL_BACKEND_CPU, &cpu) != TL_OK || load(dir, TL_BACKEND_CUDA, &gpu) != TL_OK) {
        CHECK(0, "%s: load: %s", dir, tl_last_error());
        tl_model_free(cpu);
        return;
    }
    const struct tl_model_info *info = tl_model_info(cpu);
    const int n = info->max_seq_len < 12 ? info->max_seq_len : 12;
    int32_t tokens[12];
    for (int i = 0; i < n; i++) tokens[i] = random_token(info->vocab_size);
    const size_t count = (size_t)n * (size_t)info->vocab_size, rows = (size_t)n * (size_t)info->d_model;
    const size_t room = count > rows ? count : rows;
    float *a = malloc(room * sizeof(float)), *b = malloc(room * sizeof(float));
    /* at the model's default depth and at its deepest (every loop update and state norm) */
    const int depths[2] = {info->default_loops, info->max_loops};
    for (int d = 0; d < 2 && a && b; d++) {
        if (tl_score(cpu, tokens, n, depths[d], a) != TL_OK || tl_score(gpu, tokens, n, depths[d], b) != TL_OK) {
            CHECK(0, "%s: score at %d loops: %s", dir, depths[d], tl_last_error());
            continue;
        }
        double max_abs = 0.0, max_diff = 0.0;
        for (size_t i = 0; i < count; i++) {
            if (fabs(a[i]) > max_abs) max_abs = fabs(a[i]);
            if (fabs((double)a[i] - b[i]) > max_diff) max_diff = fabs((double)a[i] - b[i]);
        }
        CHECK(max_diff <= 1e-3 * (max_abs > 1.0 ? max_abs : 1.0),
              "%s: GPU vs CPU logits at %d loops differ by %g (max |logit| %g)", dir, depths[d], max_diff, max_abs);
    }
    /* the rows the head reads (tl_embed: the backend's hidden op), every token's */
    tl_embed_options eo;
    tl_embed_options_init(&eo);
    eo.pooling = TL_POOLING_NONE;
    eo.normalize = 0;
    if (a && b && tl_embed(cpu, tokens, n, &eo, a) == TL_OK && tl_embed(gpu, tokens, n, &eo, b) == TL_OK) {
        double max_abs = 0.0, max_diff = 0.0;
        for (size_t i = 0; i < rows; i++) {
            if (fabs(a[i]) > max_abs) max_abs = fabs(a[i]);
            if (fabs((double)a[i] - b[i]) > max_diff) max_diff = fabs((double)a[i] - b[i]);
        }
        CHECK(max_diff <= 1e-3 * (max_abs > 1.0 ? max_abs : 1.0), "%s: GPU vs CPU embedding rows differ by %g (max %g)", dir,
              max_diff, max_abs);
    } else {
        CHECK(0, "%s: embed: %s", dir, tl_last_error());
    }
    free(a);
    free(b);
    tl_model_free(cpu);
    tl_model_free(gpu);
}

static void check_exact_decoding(const char *dir) {
    tl_model *m = NULL;
    if (load(dir, TL_BACKEND_CUDA, &m) != TL_OK) {
        CHECK(0, "%s: %s", dir, tl_last_error());
        return;
    }
    const struct tl_model_info *info = tl_model_info(m);
    enum { PROMPTS = 100, MAX_NEW = 12, MAX_PROMPT = 10 };
    static int32_t prompts[PROMPTS][MAX_PROMPT], plain[PROMPTS][MAX_PROMPT + MAX_NEW];
    static int prompt_lens[PROMPTS], plain_lens[PROMPTS];
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = MAX_NEW;
    cfg.ignore_eos = 1;
    int mismatches[3] = {0, 0, 0}, prefill_mismatches = 0;
    for (int p = 0; p < PROMPTS; p++) {
        prompt_lens[p] = 1 + p % MAX_PROMPT;
        for (int i = 0; i < prompt_lens[p]; i++) prompts[p][i] = random_token(info->vocab_size);
        if (tl_generate(m, prompts[p], prompt_lens[p], &cfg, plain[p], MAX_PROMPT + MAX_NEW, &plain_lens[p], NULL) != TL_OK) {
            CHECK(0, "generate: %s", tl_last_error());
            tl_model_free(m);
            return;
        }
        /* speculative chain and tree: the same tokens */
        for (int mode = 0; mode < 2; mode++) {
            tl_generate_config spec = cfg;
            spec.speculative = mode == 0 ? TL_SPECULATIVE_CHAIN : TL_SPECULATIVE_TREE;
            spec.draft_loops = 1;
            spec.loops = info->default_loops > 1 ? info->default_loops : 2;
            tl_generate_config ref = cfg;
            ref.loops = spec.loops;
            int32_t out[MAX_PROMPT + MAX_NEW], want[MAX_PROMPT + MAX_NEW];
            int len = 0, want_len = 0;
            if (tl_generate(m, prompts[p], prompt_lens[p], &ref, want, MAX_PROMPT + MAX_NEW, &want_len, NULL) != TL_OK ||
                tl_generate(m, prompts[p], prompt_lens[p], &spec, out, MAX_PROMPT + MAX_NEW, &len, NULL) != TL_OK) {
                CHECK(0, "speculative: %s", tl_last_error());
                continue;
            }
            if (len != want_len || memcmp(out, want, (size_t)len * sizeof *out)) mismatches[mode]++;
        }
        /* prefill-then-decode vs token by token: one forward over prompt + continuation
           chooses each continuation token where decoding did */
        const int total = plain_lens[p];
        float *logits = malloc((size_t)total * (size_t)info->vocab_size * sizeof(float));
        const bool scored = logits && tl_score(m, plain[p], total, info->default_loops, logits) == TL_OK;
        CHECK(scored, "prefill: score: %s", tl_last_error());
        if (scored) {
            for (int t = prompt_lens[p]; t < total; t++) {
                const float *row = logits + (size_t)(t - 1) * (size_t)info->vocab_size;
                int best = 0;
                for (int v = 1; v < info->vocab_size; v++)
                    if (row[v] > row[best]) best = v;
                if (best != plain[p][t]) { prefill_mismatches++; break; }
            }
        }
        free(logits);
    }
    /* batched: every prompt at once */
    tl_token_seq seqs[PROMPTS];
    for (int p = 0; p < PROMPTS; p++) seqs[p] = (tl_token_seq){prompts[p], prompt_lens[p]};
    int32_t *out = malloc((size_t)PROMPTS * (MAX_PROMPT + MAX_NEW) * sizeof *out);
    int out_lens[PROMPTS], out_len = 0;
    if (out && tl_generate_batch(m, seqs, PROMPTS, &cfg, out, PROMPTS * (MAX_PROMPT + MAX_NEW), out_lens, &out_len, NULL) == TL_OK) {
        const int32_t *at = out;
        for (int p = 0; p < PROMPTS; p++) {
            if (out_lens[p] != plain_lens[p] || memcmp(at, plain[p], (size_t)out_lens[p] * sizeof *at)) mismatches[2]++;
            at += out_lens[p];
        }
    } else {
        CHECK(0, "generate_batch: %s", tl_last_error());
    }
    free(out);
    CHECK(mismatches[0] == 0, "%s: chain speculative differs from plain on %d of %d prompts", dir, mismatches[0], PROMPTS);
    CHECK(mismatches[1] == 0, "%s: tree speculative differs from plain on %d of %d prompts", dir, mismatches[1], PROMPTS);
    CHECK(mismatches[2] == 0, "%s: batched differs from plain on %d of %d prompts", dir, mismatches[2], PROMPTS);
    CHECK(prefill_mismatches == 0, "%s: prefill disagrees with decoding on %d prompts", dir, prefill_mismatches);
    tl_model_free(m);
}

int main(int argc, char **argv) {
    const char *data = argc > 1 ? argv[1] : "tests/data";
    const char *expect = argc > 2 ? argv[2] : "";
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/textmodel", data);
    tl_model *probe = NULL;
    const bool need_device = !strcmp(expect, "device");
    if (need_device) expect = "";
    if (expect[0] || load(dir, TL_BACKEND_CUDA, &probe) != TL_OK) {
        if (need_device) {
            CHECK(0, "no CUDA backend where one is needed: %s", tl_last_error());
            return check_summary();
        }
        check_refusal(dir, expect);
        printf("test_cuda: no CUDA device here (%s): checked the refusal and the CPU fallback\n",
               expect[0] ? expect : "plugin present");
        return check_summary();
    }
    CHECK(strcmp(tl_model_info(probe)->backend, "cuda") == 0, "backend %s", tl_model_info(probe)->backend);
    tl_model_free(probe);
    static const char *golden[] = {"add_replace_beta_statenorm_ln", "add_residual_statenorm_rms_gqa2",
                                   "bf16_none_mqa_ln", "bf16_tied_rope_residual", "concat_replace_bias",
                                   "concat_residual_mqa", "deep_residual", "f16_concat_residual_gqa",
                                   "f16_tied_statenorm_ln", "gpt2_like", "llama_like", "nblock0_add_residual",
                                   "nblock0_none", "none_replace_beta_rope1000", "none_residual_eps"};
    for (size_t i = 0; i < sizeof golden / sizeof golden[0]; i++) {
        char gdir[4200];
        snprintf(gdir, sizeof gdir, "%s/golden/%s", data, golden[i]);
        check_parity(gdir);
    }
    check_parity(dir);
    check_exact_decoding(dir);
    return check_summary();
}

/* test_golden.c: logits parity with the PyTorch reference (tests/data/golden).
 * f32 checkpoints: max |diff| <= 1e-4; f16/bf16: max |diff| <= 2e-2 x the logit range. The
 * activations against their formulas over the whole float range. */
#include <dirent.h>
#include <math.h>
#include <stdlib.h>

#include "../../engine/src/math_shared.h"
#include "../../engine/src/safetensors.h"
#include "check.h"
#include "tinyloop.h"

static void check_case(const char *dir, const char *name, int threads) {
    char path[4096];
    tl_load_options opts;
    tl_load_options_init(&opts);
    opts.n_threads = threads;
    tl_model *model = NULL;
    tl_status st = tl_model_load(dir, &opts, &model);
    CHECK(st == TL_OK, "%s: load failed: %s", name, tl_last_error());
    if (st != TL_OK) return;
    const struct tl_model_info *info = tl_model_info(model);
    snprintf(path, sizeof path, "%s/golden.safetensors", dir);
    tl_st_file golden;
    st = tl_st_open(path, &golden);
    CHECK(st == TL_OK, "%s: %s", name, tl_last_error());
    if (st != TL_OK) { tl_model_free(model); return; }
    bool is_f32 = strcmp(info->weight_dtype, "f32") == 0;
    for (int i = 0;; i++) {
        char key[64];
        snprintf(key, sizeof key, "tokens.%d", i);
        tl_st_tensor *tokens = tl_st_find(&golden, key);
        if (!tokens) break;
        snprintf(key, sizeof key, "loops.%d", i);
        tl_st_tensor *loops = tl_st_find(&golden, key);
        snprintf(key, sizeof key, "logits.%d", i);
        tl_st_tensor *want = tl_st_find(&golden, key);
        int n = (int)tokens->shape[0];
        int32_t *ids = malloc((size_t)n * sizeof *ids);
        int32_t depth;
        float *expect = malloc(want->nbytes), *got = malloc(want->nbytes);
        memcpy(ids, tokens->data, (size_t)n * sizeof *ids);
        memcpy(&depth, loops->data, sizeof depth);
        memcpy(expect, want->data, want->nbytes);
        st = tl_score(model, ids, n, depth, got);
        CHECK(st == TL_OK, "%s seq %d: %s", name, i, tl_last_error());
        size_t count = (size_t)n * (size_t)info->vocab_size;
        float max_diff = 0, lo = INFINITY, hi = -INFINITY;
        for (size_t j = 0; j < count; j++) {
            float d = fabsf(got[j] - expect[j]);
            if (!(d <= max_diff)) max_diff = d; /* NaN propagates as a failure */
            if (expect[j] < lo) lo = expect[j];
            if (expect[j] > hi) hi = expect[j];
        }
        float tol = is_f32 ? 1e-4f : 2e-2f * (hi - lo);
        CHECK(max_diff <= tol, "%s seq %d (n=%d, loops=%d, %d threads): max |diff| %.3g > %.3g",
              name, i, n, depth, threads, max_diff, tol);
        if (threads == 1)
            printf("  %-34s seq %d n=%2d loops=%2d %-4s max|diff| %.2e (tol %.1e)\n", name, i, n,
                   depth, info->weight_dtype, max_diff, tol);
        free(ids);
        free(expect);
        free(got);
    }
    tl_st_close(&golden);
    tl_model_free(model);
}

/* The activations (math_shared.h, every backend's) against PyTorch's formulas in double, over
   the whole float range: past the exp's clamp (88) they divided by e^88 instead of giving 0,
   so gelu(-3e38) was -1.8 and silu(-1e36) -0.006 (the golden cases' values never go there). */
static void activations_match_their_formulas(void) {
    double worst_gelu = 0, worst_silu = 0;
    float worst_gelu_at = 0, worst_silu_at = 0;
    for (int sign = -1; sign <= 1; sign += 2)
        for (double magnitude = 1e-6; magnitude < 3.4e38; magnitude *= 1.07) {
            const float x = (float)(sign * magnitude);
            const double xd = x, u = 0.7978845608028654 * (xd + 0.044715 * xd * xd * xd);
            const double gelu = 0.5 * xd * (1.0 + tanh(u)), silu = xd / (1.0 + exp(-xd));
            /* (relative to max(1, |value|): float's rounding of the formula's terms) */
            const double gelu_error = fabs(tl_gelu_tanh(x) - gelu) / fmax(1.0, fabs(gelu));
            const double silu_error = fabs(tl_swiglu(x, 1.0f) - (isnan(silu) ? 0.0 : silu)) / fmax(1.0, fabs(silu));
            if (gelu_error > worst_gelu) worst_gelu = gelu_error, worst_gelu_at = x;
            if (silu_error > worst_silu) worst_silu = silu_error, worst_silu_at = x;
        }
    CHECK(worst_gelu < 1e-5, "gelu: relative error %g at x = %g", worst_gelu, (double)worst_gelu_at);
    CHECK(worst_silu < 1e-5, "silu: relative error %g at x = %g", worst_silu, (double)worst_silu_at);
}

int main(int argc, char **argv) {
    activations_match_their_formulas();
    const char *root = argc > 1 ? argv[1] : "tests/data/golden";
    DIR *d = opendir(root);
    CHECK(d != NULL, "cannot open %s", root);
    if (!d) return check_summary();
    int cases = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        char dir[4096], probe[4200];
        snprintf(dir, sizeof dir, "%s/%s", root, e->d_name);
        snprintf(probe, sizeof probe, "%s/golden.safetensors", dir);
        FILE *fp = fopen(probe, "rb");
        if (!fp) continue;
        fclose(fp);
        cases++;
        check_case(dir, e->d_name, 1);
        check_case(dir, e->d_name, 2);
    }
    closedir(d);
    CHECK(cases >= 10, "only %d golden cases found in %s", cases, root);
    return check_summary();
}

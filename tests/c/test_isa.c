/* test_isa.c: the kernel families agree bit for bit. With packed weights (the default)
 * generic (fmaf), AVX2 and AVX-512 compute the same canonical sums; with mapped row-major
 * weights, AVX2 and AVX-512 do. So a result never depends on the machine's vector width. */
#include <stdlib.h>

#include "check.h"
#include "quantised.h"
#include "cpu/kernels.h"
#include "tinyloop.h"

static float *score_with(const tl_kernels *k, const tl_model *m, const int32_t *ids, int n, int loops) {
    tl_cpu_use_kernels(k);
    float *out = malloc((size_t)n * (size_t)tl_model_info(m)->vocab_size * sizeof(float));
    CHECK(tl_score(m, ids, n, loops, out) == TL_OK, "score: %s", tl_last_error());
    return out;
}

/* q8/q4: generic, AVX2, AVX-512 and AVX512-VNNI agree on packed weights, and the row-major
   (mapped) path, portable C for every ISA, agrees with them too: one canonical order. */
static int check_quantised(const char *root, const char *name, tl_dtype type, bool avx2, bool avx512, bool vnni) {
    const char *qroot = quantised_copy(root, name, type);
    CHECK(qroot != NULL, "%s: quantise", name);
    if (!qroot) return 0;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", qroot, name);
    int compared = 0;
    float *first = NULL;
    size_t bytes = 0;
    for (int mapped = 0; mapped <= 1; mapped++) {
        tl_load_options o;
        tl_load_options_init(&o);
        o.mmap_weights = mapped;
        tl_model *m = NULL;
        if (tl_model_load(dir, &o, &m) != TL_OK) { CHECK(0, "load %s: %s", dir, tl_last_error()); break; }
        const struct tl_model_info *info = tl_model_info(m);
        CHECK(strcmp(info->weight_dtype, type == TL_Q8 ? "q8" : "q4") == 0, "%s: weight_dtype %s", dir, info->weight_dtype);
        int32_t ids[20];
        for (int t = 0; t < 20; t++) ids[t] = (int32_t)((t * 7 + 3) % info->vocab_size);
        bytes = (size_t)20 * (size_t)info->vocab_size * sizeof(float);
        const tl_kernels *ks[4] = {&tl_kernels_generic, NULL, NULL, NULL};
#if defined(__x86_64__)
        ks[1] = avx2 ? &tl_kernels_avx2 : NULL;
        ks[2] = avx512 ? &tl_kernels_avx512 : NULL;
        ks[3] = vnni ? &tl_kernels_avx512_vnni : NULL;
#endif
        for (int k = 0; k < 4; k++) {
            if (!ks[k]) continue;
            float *got = score_with(ks[k], m, ids, 20, info->max_loops);
            if (!first) first = got;
            else {
                CHECK(memcmp(first, got, bytes) == 0, "%s %s: %s (%s) differs from generic (packed)", name,
                      type == TL_Q8 ? "q8" : "q4", ks[k]->isa, mapped ? "mapped" : "packed");
                compared++;
                free(got);
            }
        }
        tl_model_free(m);
    }
    free(first);
    (void)avx2; (void)avx512; (void)vnni;
    return compared;
}

int main(int argc, char **argv) {
    const char *root = argc > 1 ? argv[1] : "tests/data/golden";
    const char *names[] = {"gpt2_like", "f16_concat_residual_gqa", "bf16_tied_rope_residual", "concat_residual_mqa",
                           "llama_like"};
#if defined(__x86_64__)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
    const bool vnni = avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#else
    const bool avx2 = false, avx512 = false, vnni = false;
#endif
    int compared = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", root, names[i]);
        for (int mapped = 0; mapped <= 1; mapped++) {
            tl_load_options o;
            tl_load_options_init(&o);
            o.mmap_weights = mapped;
            tl_model *m = NULL;
            if (tl_model_load(dir, &o, &m) != TL_OK) { CHECK(0, "load %s", names[i]); continue; }
            const struct tl_model_info *info = tl_model_info(m);
            int32_t ids[20];
            for (int t = 0; t < 20; t++) ids[t] = (int32_t)((t * 7 + 3) % info->vocab_size);
            const size_t bytes = (size_t)20 * (size_t)info->vocab_size * sizeof(float);
            float *ref = mapped ? NULL : score_with(&tl_kernels_generic, m, ids, 20, info->max_loops);
#if defined(__x86_64__)
            float *a2 = avx2 ? score_with(&tl_kernels_avx2, m, ids, 20, info->max_loops) : NULL;
            float *a5 = avx512 ? score_with(&tl_kernels_avx512, m, ids, 20, info->max_loops) : NULL;
            if (ref && a2) { CHECK(memcmp(ref, a2, bytes) == 0, "%s: generic != avx2 (packed)", names[i]); compared++; }
            if (a2 && a5) { CHECK(memcmp(a2, a5, bytes) == 0, "%s: avx2 != avx512 (%s)", names[i], mapped ? "mapped" : "packed"); compared++; }
            free(a2);
            free(a5);
#endif
            free(ref);
            tl_model_free(m);
        }
    }
    const char *quantised[] = {"gpt2_like", "llama_like", "f16_concat_residual_gqa"};
    for (size_t i = 0; i < sizeof quantised / sizeof quantised[0]; i++)
        for (int t = 0; t < 2; t++) compared += check_quantised(root, quantised[i], t ? TL_Q4 : TL_Q8, avx2, avx512, vnni);
    printf("  %d cross-ISA comparisons (avx2 %s, avx512 %s, vnni %s)\n", compared, avx2 ? "yes" : "no",
           avx512 ? "yes" : "no", vnni ? "yes" : "no");
    return check_summary();
}

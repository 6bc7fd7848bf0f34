/* quantize.c: tinyloop-quantize, the tool behind scripts/quantize (SPEC §8).
 *   tinyloop-quantize --type q8|q4 IN_DIR OUT_DIR
 * Converts an f32/f16/bf16 checkpoint to q8 or q4 (layout: README "Quantised weights"),
 * then loads the result once to check that the engine accepts it. */
#include <stdio.h>
#include <string.h>

#include "quant.h"
#include "tinyloop.h"

static int usage(FILE *fp, int code) {
    fputs("usage: scripts/quantize --type q8|q4 IN_DIR OUT_DIR\n"
          "  Writes OUT_DIR: IN_DIR's config.json and tokenizer.json, and model.safetensors with\n"
          "  every matrix quantised in groups of 32 inputs with one f16 scale per group\n"
          "  (q8: int8, 8.5 bits a weight; q4: 4-bit, 4.5 bits a weight).\n", fp);
    return code;
}

int main(int argc, char **argv) {
    const char *type = NULL, *dirs[2] = {NULL, NULL};
    int n_dirs = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return usage(stdout, 0);
        if (!strcmp(argv[i], "--type") && i + 1 < argc) type = argv[++i];
        else if (!strncmp(argv[i], "--type=", 7)) type = argv[i] + 7;
        else if (argv[i][0] == '-') { fprintf(stderr, "quantize: unknown option %s\n", argv[i]); return usage(stderr, 2); }
        else if (n_dirs < 2) dirs[n_dirs++] = argv[i];
        else return usage(stderr, 2);
    }
    if (!type || n_dirs != 2) return usage(stderr, 2);
    tl_dtype dt;
    if (!strcmp(type, "q8")) dt = TL_Q8;
    else if (!strcmp(type, "q4")) dt = TL_Q4;
    else { fprintf(stderr, "quantize: --type must be q8 or q4, got \"%s\"\n", type); return 2; }
    if (tl_quantize_checkpoint(dirs[0], dirs[1], dt) != TL_OK) {
        fprintf(stderr, "quantize: %s\n", tl_last_error());
        return 1;
    }
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 1;
    tl_model *m = NULL;
    if (tl_model_load(dirs[1], &o, &m) != TL_OK) {
        fprintf(stderr, "quantize: the written checkpoint does not load: %s\n", tl_last_error());
        return 1;
    }
    const struct tl_model_info *info = tl_model_info(m);
    printf("%s: %s, %.2f M parameters, %.1f MB of tensors\n", dirs[1], info->weight_dtype, info->n_params / 1e6,
           info->weight_bytes / 1e6);
    tl_model_free(m);
    return 0;
}

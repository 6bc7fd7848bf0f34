/* quantize.c: tinyloop-quantize, the tool behind scripts/quantize (SPEC §8).
 *   tinyloop-quantize --type q8|q4 [--pure] [--calibrate TEXT [--gptq] [--calibrate-tokens N]] IN_DIR OUT_DIR
 * Converts an f32/f16/bf16 checkpoint to q8 or q4 (layout: README "Quantised weights"),
 * then loads the result once to check that the engine accepts it. With --calibrate, q4 is
 * activation-aware: IN_DIR runs over TEXT first (calibrate.c) and the importance of each
 * matrix input weights its groups' scale search (quant.c); --gptq adds GPTQ's error
 * feedback. TEXT must not be the text the result is evaluated on. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_args.h"
#include "calibrate.h"
#include "quant.h"
#include "tinyloop.h"

static int usage(FILE *fp, int code) {
    fputs("usage: scripts/quantize --type q8|q4 [--pure] [--calibrate TEXT [--gptq] [--calibrate-tokens N]]\n"
          "                        [--threads N] IN_DIR OUT_DIR\n"
          "  Writes OUT_DIR: IN_DIR's config.json, tokenizer.json and (a Hugging Face folder's)\n"
          "  chat_template.jinja, tokenizer_config.json and generation_config.json, and model.safetensors with\n"
          "  every matrix quantised in groups of 32 inputs with one f16 scale per group (a\n"
          "  matrix of another width kept as it was, and said)\n"
          "  (q8: int8, 8.5 bits a weight; q4: 4-bit, 4.5 bits a weight; q4 keeps the\n"
          "  embedding and the head at q8).\n"
          "  --pure            q4: the embedding and the head at q4 too (llama.cpp's --pure):\n"
          "                    fewer bytes a token, larger logit error\n"
          "  --calibrate TEXT  q4 only: run IN_DIR over TEXT (a training text, never the text\n"
          "                    you evaluate on) and weight each group's error by its inputs'\n"
          "                    mean x^2 (activation-aware quantisation); same file format\n"
          "  --gptq            with --calibrate: also GPTQ's error feedback along each row\n"
          "  --calibrate-tokens N  tokens of TEXT to run, in windows of up to 256 spread over it,\n"
          "                    N rounded up to whole windows (16384)\n"
          "  --threads N       threads for the calibration and the quantisation (default 0:\n"
          "                    one per core); the output is the same at any count\n", fp);
    return fp == stdout && code == 0 ? bench_output_status("tinyloop-quantize") : code;
}

/* The options that take a value (bench_value_option). */
static const char *const VALUE_OPTIONS[] = {"--type", "--calibrate", "--calibrate-tokens", "--threads"};
#define N_VALUE_OPTIONS (int)(sizeof VALUE_OPTIONS / sizeof *VALUE_OPTIONS)

int main(int argc, char **argv) {
    const char *type = NULL, *dirs[2] = {NULL, NULL}, *calib_text = NULL;
    int n_dirs = 0, calib_tokens = 16384, threads = 0;
    bool gptq = false, pure = false, given[N_VALUE_OPTIONS] = {false};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return usage(stdout, 0);
        const char *value;
        const int option = bench_value_option(argc, argv, &i, VALUE_OPTIONS, N_VALUE_OPTIONS, &value);
        if (option >= 0) {
            const char *name = VALUE_OPTIONS[option];
            if (!value) { /* the last argument: its value is missing */
                fprintf(stderr, "quantize: %s needs a value\n", name);
                return usage(stderr, 2);
            }
            /* (the last one was taken without a word: --type q8 --type q4 quantised to q4) */
            if (given[option]) { fprintf(stderr, "quantize: %s given twice\n", name); return 2; }
            given[option] = true;
            if (option == 0) type = value;
            else if (option == 1) calib_text = value;
            else {
                long v;
                const bool tokens = option == 2;
                /* (threads: the load that checks the result takes at most TL_MAX_THREADS) */
                if (!bench_long(value, tokens ? 1 : 0, tokens ? (1L << 30) : TL_MAX_THREADS, &v)) {
                    if (tokens) fprintf(stderr, "quantize: %s needs a number >= 1, got \"%s\"\n", name, value);
                    else fprintf(stderr, "quantize: %s needs a number in [0, %d], got \"%s\"\n", name, TL_MAX_THREADS, value);
                    return 2;
                }
                if (tokens) calib_tokens = (int)v; else threads = (int)v;
            }
        }
        else if (!strcmp(argv[i], "--gptq")) gptq = true;
        else if (!strcmp(argv[i], "--pure")) pure = true;
        else if (argv[i][0] == '-') { fprintf(stderr, "quantize: unknown option %s\n", argv[i]); return usage(stderr, 2); }
        else if (!argv[i][0] && n_dirs < 2) { /* ("" was read as the root: "/model.safetensors: cannot open") */
            fprintf(stderr, "quantize: %s is empty\n", n_dirs == 0 ? "IN_DIR" : "OUT_DIR");
            return 2;
        }
        else if (n_dirs < 2) dirs[n_dirs++] = argv[i];
        else return usage(stderr, 2);
    }
    if (!type || n_dirs != 2) return usage(stderr, 2);
    tl_dtype dt;
    if (!strcmp(type, "q8")) dt = TL_Q8;
    else if (!strcmp(type, "q4")) dt = TL_Q4;
    else { fprintf(stderr, "quantize: --type must be q8 or q4, got \"%s\"\n", type); return 2; }
    if (gptq && !calib_text) { fprintf(stderr, "quantize: --gptq needs --calibrate TEXT\n"); return 2; }
    if (pure && dt != TL_Q4) { fprintf(stderr, "quantize: --pure applies to q4 only (q8 quantises every matrix alike)\n"); return 2; }
    if (calib_text && dt != TL_Q4) {
        fprintf(stderr, "quantize: --calibrate applies to q4 only (q8 keeps max|x| / 127)\n");
        return 2;
    }
    tl_calibration *cal = NULL;
    if (calib_text) {
        if (tl_calibrate_text(dirs[0], calib_text, calib_tokens, gptq, threads, &cal) != TL_OK) {
            fprintf(stderr, "quantize: calibration on %s: %s\n", calib_text, tl_last_error());
            return 1;
        }
        printf("calibration: %ld tokens of %s through %s%s\n", tl_calibration_tokens(cal), calib_text, dirs[0],
               gptq ? " (with Gram matrices for GPTQ)" : "");
    }
    const tl_status qst = tl_quantize_checkpoint_calibrated(dirs[0], dirs[1], dt, cal, threads, pure);
    tl_calibration_free(cal);
    if (qst != TL_OK) { /* (the library's messages name the step already: "quantize: ...") */
        const char *why = tl_last_error();
        fprintf(stderr, "%s%s\n", strncmp(why, "quantize: ", 10) ? "quantize: " : "", why);
        return 1;
    }
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = threads ? threads : 1;
    tl_model *m = NULL;
    if (tl_model_load(dirs[1], &o, &m) != TL_OK) {
        fprintf(stderr, "quantize: the written checkpoint does not load: %s\n", tl_last_error());
        return 1;
    }
    const struct tl_model_info *info = tl_model_info(m);
    printf("%s: %s, %.2f M parameters, %.1f MB of tensors\n", dirs[1], info->weight_dtype, info->n_params / 1e6,
           info->weight_bytes / 1e6);
    /* config.json's warnings (a misspelt optional field: its default applied), as the CLI
       says them: the copy carries the input's config, and a quantised model is often the one
       served */
    for (const char *line = tl_model_warnings(m); *line;) {
        const size_t len = strcspn(line, "\n");
        fprintf(stderr, "quantize: warning: %.*s\n", (int)len, line);
        line += len + (line[len] == '\n');
    }
    tl_model_free(m);
    /* (said, not silent: a matrix that stays f16 costs its bytes on every token) */
    char first[256] = "";
    int64_t width = 0;
    const int kept = tl_quantize_kept(dirs[0], first, sizeof first, &width);
    if (kept > 0)
        fprintf(stderr, "quantize: %d matri%s kept as %s (%s, %lld wide%s): an input width that is not a multiple of %d "
                        "does not split into groups\n", kept, kept == 1 ? "x" : "ces", kept == 1 ? "it was" : "they were",
                first, (long long)width, kept > 1 ? ", and others" : "", TL_QGROUP);
    return bench_output_status("tinyloop-quantize"); /* (its lines lost: 1, as the benches) */
}

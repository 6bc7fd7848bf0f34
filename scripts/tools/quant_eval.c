/* quant_eval.c: tinyloop-quant-eval, the quality of a quantised checkpoint against its
 * reference (the f16 / f32 original), teacher-forced at the default depth:
 *   tinyloop-quant-eval REF_DIR QUANT_DIR [--text FILE] [--window N] [--max-tokens N] [--threads N]
 * With --text (e.g. the shipped model's held-out build/corpus/val.txt): the text is encoded
 * and cut into windows of N tokens (default 256); per window tl_score gives every position's
 * logits from both models. Without --text: random token ids (for random-weight checkpoints
 * such as tinyloop-bench --keep writes). Prints top-1 agreement (argmax of the quantised
 * model = argmax of the reference), perplexity of both on the text's next tokens (text mode),
 * and the logit error: RMS and max |difference|, relative to the RMS of the reference logits. */
#define _POSIX_C_SOURCE 200809L /* fileno */
#include <limits.h>
#include <stdbool.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench_args.h"
#include "tinyloop.h"

static void die(const char *what) {
    fprintf(stderr, "quant-eval: %s: %s\n", what, tl_last_error());
    exit(1);
}

static tl_model *load(const char *dir, int threads) {
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = threads;
    tl_model *m = NULL;
    if (tl_model_load(dir, &o, &m) != TL_OK) die(dir);
    return m;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* -log softmax(x)[target], in double. */
static double nll(const float *x, int n, int target) {
    double mx = x[0], s = 0.0;
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < n; i++) s += exp((double)x[i] - mx);
    return log(s) + mx - (double)x[target];
}

static int usage(const char *bad) {
    if (bad) fprintf(stderr, "tinyloop-quant-eval: %s needs a whole number in its range (--window >= 2, --max-tokens >= 1, "
                             "--threads in [0, %d])\n", bad, TL_MAX_THREADS);
    fprintf(stderr, "usage: tinyloop-quant-eval REF_DIR QUANT_DIR [--text FILE] [--window N] [--max-tokens N] [--threads N]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *ref_dir = NULL, *q_dir = NULL, *text_path = NULL;
    int window = 256, max_tokens = 1 << 30, threads = 0;
    static const char *const value_options[] = {"--text", "--window", "--max-tokens", "--threads"};
    bool given[4] = {false};
    for (int i = 1; i < argc; i++) {
        const char *value;
        const int option = bench_value_option(argc, argv, &i, value_options, 4, &value);
        if (option >= 0) {
            /* (an option was read as a model directory, and one given twice kept its last value) */
            if (!value || given[option]) {
                fprintf(stderr, "tinyloop-quant-eval: %s %s\n", value_options[option], value ? "given twice" : "needs a value");
                return usage(NULL);
            }
            given[option] = true;
            if (option == 0) text_path = value;
            else if (option == 1) { if (!bench_int(value, 2, 1 << 20, &window)) return usage("--window"); }
            else if (option == 2) { if (!bench_int(value, 1, INT_MAX, &max_tokens)) return usage("--max-tokens"); }
            else if (!bench_int(value, 0, TL_MAX_THREADS, &threads)) return usage("--threads");
        }
        else if (argv[i][0] == '-' && argv[i][1]) { fprintf(stderr, "tinyloop-quant-eval: unknown option %s\n", argv[i]); return usage(NULL); }
        else if (!ref_dir) ref_dir = argv[i];
        else if (!q_dir) q_dir = argv[i];
        else return usage(NULL);
    }
    if (!ref_dir || !q_dir) return usage(NULL);
    tl_model *ref = load(ref_dir, threads), *qm = load(q_dir, threads);
    const struct tl_model_info *info = tl_model_info(ref);
    const int vocab = info->vocab_size, loops = info->default_loops;
    /* two checkpoints of one model: the same vocabulary, context and depth (a larger
       vocabulary wrote past the logits' buffer) */
    const struct tl_model_info *q_info = tl_model_info(qm);
    if (q_info->vocab_size != vocab || q_info->max_seq_len != info->max_seq_len || q_info->max_loops != info->max_loops) {
        fprintf(stderr, "tinyloop-quant-eval: %s and %s are not one model (vocabulary %d and %d, context %d and %d, "
                        "max_loops %d and %d)\n", ref_dir, q_dir, vocab, q_info->vocab_size, info->max_seq_len,
                q_info->max_seq_len, info->max_loops, q_info->max_loops);
        tl_model_free(ref);
        tl_model_free(qm);
        return 2;
    }
    if (window > info->max_seq_len) window = info->max_seq_len;

    int32_t *ids = NULL;
    int n = 0;
    if (text_path) {
        FILE *fp = fopen(text_path, "rb");
        if (!fp) { perror(text_path); return 1; }
        /* (a pipe's or a directory's size is no length: "Bad address", "Cannot allocate memory") */
        struct stat st;
        if (fstat(fileno(fp), &st) != 0 || !S_ISREG(st.st_mode)) {
            fprintf(stderr, "tinyloop-quant-eval: --text %s is not a regular file\n", text_path);
            return 1;
        }
        const long len = (long)st.st_size;
        char *text = malloc((size_t)len + 1);
        if (!text || fread(text, 1, (size_t)len, fp) != (size_t)len) { perror(text_path); return 1; }
        fclose(fp);
        if (tl_encode(ref, text, (size_t)len, &ids, &n) != TL_OK) die("encode");
        free(text);
    } else {
        n = max_tokens < (1 << 30) ? max_tokens : 4 * window;
        ids = malloc((size_t)n * sizeof *ids);
        uint64_t s = 0x9E3779B97F4A7C15ull;
        for (int i = 0; i < n; i++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            ids[i] = (int32_t)(s % (uint64_t)vocab);
        }
    }
    if (n > max_tokens) n = max_tokens;
    if (n < window) { /* not one window to compare (it printed NaN and exit 0) */
        fprintf(stderr, "tinyloop-quant-eval: %d tokens of text, fewer than one window of %d: nothing to compare "
                        "(a longer --text, or a smaller --window)\n", n, window);
        if (text_path) tl_free(ids); else free(ids);
        tl_model_free(ref);
        tl_model_free(qm);
        return 2;
    }
    float *a = malloc((size_t)window * vocab * sizeof *a), *b = malloc((size_t)window * vocab * sizeof *b);
    if (!a || !b) { fprintf(stderr, "out of memory\n"); return 1; }
    long positions = 0, agree = 0, predicted = 0;
    double nll_ref = 0.0, nll_q = 0.0, err2 = 0.0, ref2 = 0.0, err_max = 0.0;
    for (int start = 0; start + window <= n; start += window) {
        if (tl_score(ref, ids + start, window, loops, a) != TL_OK) die("score (reference)");
        if (tl_score(qm, ids + start, window, loops, b) != TL_OK) die("score (quantised)");
        for (int t = 0; t < window; t++) {
            const float *x = a + (size_t)t * vocab, *y = b + (size_t)t * vocab;
            agree += argmax(x, vocab) == argmax(y, vocab);
            positions++;
            for (int v = 0; v < vocab; v++) {
                const double e = (double)y[v] - (double)x[v];
                err2 += e * e;
                ref2 += (double)x[v] * (double)x[v];
                if (fabs(e) > err_max) err_max = fabs(e);
            }
            if (text_path && t + 1 < window) {
                nll_ref += nll(x, vocab, ids[start + t + 1]);
                nll_q += nll(y, vocab, ids[start + t + 1]);
                predicted++;
            }
        }
    }
    const double ref_rms = sqrt(ref2 / ((double)positions * vocab)), err_rms = sqrt(err2 / ((double)positions * vocab));
    printf("reference %s (%s), quantised %s (%s), depth %d, %ld positions in windows of %d\n", ref_dir,
           info->weight_dtype, q_dir, tl_model_info(qm)->weight_dtype, loops, positions, window);
    printf("top-1 agreement  %.2f%%\n", 100.0 * agree / positions);
    if (text_path) {
        const double p_ref = exp(nll_ref / predicted), p_q = exp(nll_q / predicted);
        printf("perplexity       %.3f -> %.3f (%+.2f%%)\n", p_ref, p_q, 100.0 * (p_q / p_ref - 1.0));
    }
    printf("logit error      rms %.4g (%.2f%% of the logits' rms %.4g), max %.4g\n", err_rms,
           100.0 * err_rms / ref_rms, ref_rms, err_max);
    free(a); free(b);
    if (text_path) tl_free(ids); else free(ids);
    tl_model_free(ref);
    tl_model_free(qm);
    return bench_output_status("tinyloop-quant-eval");
}

/* batch_bench.c: tinyloop-batch-bench, many sessions at once (a benchmark, not a test).
 *
 * Prints the aggregate decode tokens/s of 1, 2, 4, 8 and 16 concurrent sessions advanced
 * together by tl_session_step_batch (one forward per step for all of them), next to one
 * session's rate, and the time to first token of a session whose long prompt prefix is
 * served from the prefix pool against a cold prefill of the same prompt.
 *
 *   tinyloop-bench --preset gpt2-small --dtype f16 --keep      (prints the checkpoint's path)
 *   tinyloop-batch-bench --model DIR [--threads N] [--steps N] [--prefix 512] [--sessions 1,2,4,8,16]
 *
 * Prompts are random token ids (seeded): the weights may be random too. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tinyloop.h"

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void die(const char *what) {
    fprintf(stderr, "tinyloop-batch-bench: %s: %s\n", what, tl_last_error());
    exit(1);
}

static uint64_t rng_state = 0x243F6A8885A308D3ull;
static int32_t random_token(int vocab) {
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (int32_t)(rng_state % (uint64_t)vocab);
}

/* Aggregate decode tokens/s of n sessions stepped together for `steps` steps (after one
   step that runs every prefill). */
static double decode_rate(const tl_model *m, int n, int steps, int prompt_len) {
    const int vocab = tl_model_info(m)->vocab_size;
    tl_session *sessions[64];
    int32_t tokens[64];
    tl_stop_reason stops[64];
    tl_status statuses[64];
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = steps + 1;
    cfg.ignore_eos = 1;
    for (int i = 0; i < n; i++) {
        int32_t prompt[64];
        for (int k = 0; k < prompt_len; k++) prompt[k] = random_token(vocab);
        if (tl_session_new(m, prompt, prompt_len, &cfg, &sessions[i]) != TL_OK) die("session");
    }
    if (tl_session_step_batch(sessions, n, tokens, stops, statuses) != TL_OK) die("prefill step");
    const double t0 = now_ms();
    for (int s = 0; s < steps; s++)
        if (tl_session_step_batch(sessions, n, tokens, stops, statuses) != TL_OK) die("step");
    const double ms = now_ms() - t0;
    for (int i = 0; i < n; i++) tl_session_free(sessions[i]);
    return (double)n * steps * 1000.0 / ms;
}

/* Time to first token (ms) of a prompt `len` tokens long. */
static double first_token_ms(const tl_model *m, const int32_t *prompt, int len, int *reused) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 1;
    tl_session *s;
    int32_t token;
    tl_stop_reason stop;
    if (tl_session_new(m, prompt, len, &cfg, &s) != TL_OK) die("session");
    const double t0 = now_ms();
    if (tl_session_step(s, &token, &stop) != TL_OK) die("step");
    const double ms = now_ms() - t0;
    *reused = tl_session_stats(s)->prompt_tokens_reused;
    tl_session_free(s);
    return ms;
}

int main(int argc, char **argv) {
    const char *dir = NULL, *counts = "1,2,4,8,16";
    int threads = 0, steps = 32, prefix = 512;
    tl_backend_kind backend = TL_BACKEND_CPU;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("usage: tinyloop-batch-bench --model DIR [--threads N] [--steps N] [--prefix N] [--sessions LIST] [--backend B]\n"
                   "  --threads N      CPU threads (default: all cores)\n"
                   "  --steps N        timed decode steps per measurement (default 32)\n"
                   "  --prefix N       shared prompt prefix for the prefix-pool figure (default 512)\n"
                   "  --sessions LIST  concurrent sessions to measure (default 1,2,4,8,16)\n"
                   "  --backend B      cpu (default) or cuda\n");
            return 0;
        }
        if (!v) { fprintf(stderr, "tinyloop-batch-bench: %s needs a value (see --help)\n", a); return 2; }
        if (!strcmp(a, "--model")) dir = v;
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--steps")) steps = atoi(v);
        else if (!strcmp(a, "--prefix")) prefix = atoi(v);
        else if (!strcmp(a, "--sessions")) counts = v;
        else if (!strcmp(a, "--backend") && (!strcmp(v, "cpu") || !strcmp(v, "cuda")))
            backend = !strcmp(v, "cpu") ? TL_BACKEND_CPU : TL_BACKEND_CUDA;
        else { fprintf(stderr, "tinyloop-batch-bench: unknown option %s (see --help)\n", a); return 2; }
        i++;
    }
    if (!dir || steps < 1 || prefix < 1) { fprintf(stderr, "tinyloop-batch-bench: need --model DIR (see --help)\n"); return 2; }
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = threads;
    o.backend = backend;
    tl_model *m;
    if (tl_model_load(dir, &o, &m) != TL_OK) die("load");
    const struct tl_model_info *info = tl_model_info(m);
    printf("model      %s (%lld params, %s, %.1f MB of weights), %d threads\n", dir, (long long)info->n_params,
           info->weight_dtype, info->weight_bytes / 1e6, info->n_threads);

    printf("\nsessions   aggregate decode tok/s   vs one session\n");
    double one = 0.0;
    char list[256];
    snprintf(list, sizeof list, "%s", counts);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        const int n = atoi(tok);
        if (n < 1 || n > 64) continue;
        const int prompt_len = 16 < info->max_seq_len - steps - 2 ? 16 : 1;
        const double rate = decode_rate(m, n, steps, prompt_len);
        if (n == 1 || one == 0.0) one = rate / n;
        printf("%8d   %22.1f   %13.2fx\n", n, rate, rate / one);
        fflush(stdout);
    }

    if (prefix + 2 <= info->max_seq_len) {
        int32_t *prompt = malloc((size_t)(prefix + 1) * sizeof *prompt);
        for (int k = 0; k <= prefix; k++) prompt[k] = random_token(info->vocab_size);
        int reused;
        const double cold = first_token_ms(m, prompt, prefix + 1, &reused);
        if (tl_model_set_prefix_pool(m, (int64_t)1 << 32) != TL_OK) die("prefix pool");
        first_token_ms(m, prompt, prefix + 1, &reused); /* fills the pool */
        prompt[prefix] = (prompt[prefix] + 1) % info->vocab_size; /* a new question after the shared prefix */
        const double warm = first_token_ms(m, prompt, prefix + 1, &reused);
        printf("\nshared prefix of %d tokens: time to first token %.1f ms cold, %.1f ms from the pool "
               "(%d tokens reused): %.1fx shorter\n", prefix, cold, warm, reused, cold / warm);
        free(prompt);
    }
    tl_model_free(m);
    return 0;
}

/* batch_bench.c: tinyloop-batch-bench, many sessions at once (a benchmark, not a test).
 *
 * Prints the aggregate decode tokens/s of 1, 2, 4, 8 and 16 concurrent sessions advanced
 * together by tl_session_step_batch (one forward per step for all of them), next to one
 * session's rate, and the time to first token of a session whose long prompt prefix is
 * served from the prefix pool against a cold prefill of the same prompt, and the same for a
 * session saved to a state file and read back.
 *
 * --mix P,T adds the serving mix: the same session counts, each session of a P-token prompt
 * and T tokens sampled at temperature 0.8, replaced by a fresh one as soon as it finishes (the
 * first ones of staggered lengths, i/N of T, so that sessions end and join one at a time). This
 * is what the HTTP server's engine thread runs under scripts/bench/serve_bench.sh, without the
 * HTTP: the joining prompts' rows share the passes with the decode rows, and every row samples.
 * --step-rows LIST runs the mix once per value, in turn, as the serving engine runs with that
 * step_rows: a step forwards one row per session, and what they leave of the value for prompts
 * (tl_step_batch_options.prompt_rows; 0: a joining prompt is prefilled whole in its first
 * step). It prints the step times' p50, p99 and maximum beside the rate: a running session
 * waits one step for each of its tokens, so a long step is a stall of every stream.
 *
 *   tinyloop-bench --preset gpt2-small --dtype f16 --keep      (prints the checkpoint's path)
 *   tinyloop-batch-bench --model DIR [--threads N] [--steps N] [--prefix 512] [--sessions 1,2,4,8,16]
 *                        [--mix P,T [--step-rows 0,64]] [--rounds N] [--pool-entries N]
 *
 * On a shared VM one session's rate drifts by a quarter within minutes, and a ratio to one
 * session is only as good as that baseline: --rounds N measures every count N times in turn
 * (1, 2, 4, ..., then again) and prints the medians, their range and the range of the
 * ratios within each round.
 *
 * Prompts are random token ids (seeded): the weights may be random too. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bench_args.h"
#include "tinyloop.h"

#define MAX_ROUNDS 15
#define MAX_COUNTS 16

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* CPU time of the whole process (every thread of the pool), ms. */
static double cpu_ms(void) {
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-3;
}

static int compare_doubles(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0..n) (sorts v). */
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, compare_doubles);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static _Noreturn void die(const char *what) {
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
    int32_t *prompt = malloc((size_t)prompt_len * sizeof *prompt);
    if (!prompt) die("prompt");
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < prompt_len; k++) prompt[k] = random_token(vocab);
        if (tl_session_new(m, prompt, prompt_len, &cfg, &sessions[i]) != TL_OK) die("session");
    }
    free(prompt);
    if (tl_session_step_batch(sessions, n, tokens, stops, statuses) != TL_OK) die("prefill step");
    const double t0 = now_ms();
    for (int s = 0; s < steps; s++)
        if (tl_session_step_batch(sessions, n, tokens, stops, statuses) != TL_OK) die("step");
    const double ms = now_ms() - t0;
    for (int i = 0; i < n; i++) tl_session_free(sessions[i]);
    return (double)n * steps * 1000.0 / ms;
}

/* One session of the serving mix: a random prompt, `max_tokens` sampled tokens. */
static tl_session *mix_session(const tl_model *m, int prompt_len, int max_tokens, uint64_t seed) {
    int32_t prompt[1024];
    for (int k = 0; k < prompt_len; k++) prompt[k] = random_token(tl_model_info(m)->vocab_size);
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = max_tokens;
    cfg.ignore_eos = 1;
    cfg.temperature = 0.8f;
    cfg.sample_seed = seed;
    tl_session *s;
    if (tl_session_new(m, prompt, prompt_len, &cfg, &s) != TL_OK) die("session");
    return s;
}

/* The timed steps of one mix run: their wall times, sorted after the run (ms). */
typedef struct step_times {
    double *ms;
    int n;
} step_times;

/* Tokens/s of n sessions stepped together under the serving mix (see the top), counting the
   steps' time only: untimed steps first reach the steady state of joins, and a replacement
   is created between steps, off the clock (the server creates it on another thread). Prompts
   are cut to prompt_rows rows a step (0: whole); only emitted tokens count.
   *cpu_share: the process's CPU time over those steps' wall time (2.0 = two cores busy; less
   when other processes took the cores: the figure is then theirs to explain). */
static double mix_rate(const tl_model *m, int n, int steps, int prompt_len, int max_tokens, int prompt_rows,
                       double *cpu_share, step_times *times) {
    tl_step_batch_options opts;
    tl_step_batch_options_init(&opts);
    opts.prompt_rows = prompt_rows;
    times->n = 0;
    tl_session *sessions[64];
    int32_t tokens[64];
    tl_stop_reason stops[64];
    tl_status statuses[64];
    uint64_t seed = 0;
    for (int i = 0; i < n; i++) {
        const int first = max_tokens * (i + 1) / n;
        sessions[i] = mix_session(m, prompt_len, first > 0 ? first : 1, ++seed);
    }
    double ms = 0.0, cpu = 0.0;
    long rows = 0;
    /* Untimed until every first session has been replaced (the steady state: with chunked
       prefill the first prompts queue behind each other for many steps) and T steps passed. */
    int replaced = 0, warm_steps = 0;
    for (int s = 0; s < steps;) {
        const bool timed = replaced >= n && warm_steps >= max_tokens;
        const double t0 = now_ms(), c0 = cpu_ms();
        if (tl_session_step_batch_with(sessions, n, &opts, tokens, stops, statuses) != TL_OK) die("step");
        const double step_ms = now_ms() - t0;
        if (!timed) warm_steps++;
        else {
            s++;
            ms += step_ms, cpu += cpu_ms() - c0;
            times->ms[times->n++] = step_ms;
            for (int i = 0; i < n; i++) rows += tokens[i] >= 0;
        }
        for (int i = 0; i < n; i++) {
            if (statuses[i] != TL_OK) die("mix step");
            if (stops[i] == TL_STOP_NONE) continue;
            tl_session_free(sessions[i]);
            sessions[i] = mix_session(m, prompt_len, max_tokens, ++seed);
            replaced++;
        }
    }
    for (int i = 0; i < n; i++) tl_session_free(sessions[i]);
    *cpu_share = cpu / ms;
    qsort(times->ms, (size_t)times->n, sizeof *times->ms, compare_doubles);
    return (double)rows * 1000.0 / ms;
}

/* The q-quantile of sorted times (nearest rank). */
static double quantile(const step_times *t, double q) {
    int k = (int)(q * t->n + 0.999999) - 1;
    return t->ms[k < 0 ? 0 : k >= t->n ? t->n - 1 : k];
}

/* The decoders the prefix-pool figure times: plain, a speculative chain, a beam search. */
enum { PLAIN, CHAIN, BEAM, DECODERS };
static const char *const decoder_names[DECODERS] = {"plain", "speculative chain", "beam search (2)"};

/* Time to first token (ms) of a prompt `len` tokens long. */
static double first_token_ms_with(const tl_model *m, const int32_t *prompt, int len, int *reused, int decoder) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 1;
    if (decoder == CHAIN) {
        cfg.speculative = TL_SPECULATIVE_CHAIN;
        cfg.draft_loops = 1;
    }
    if (decoder == BEAM) cfg.beam_size = 2;
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

static double first_token_ms(const tl_model *m, const int32_t *prompt, int len, int *reused) {
    return first_token_ms_with(m, prompt, len, reused, PLAIN);
}

/* --pool-entries N: sessions that each open with the shared prefix and go on with 2 tokens of
   their own (with the token each generates, the 3 the prefix figure leaves room for), as conversations under one system prompt do, each leaving its prompt in the pool
   as an entry of its own: the whole cost of a session (made, stepped once, freed) as the pool
   fills, by doubling, then the time to lower the budget until every entry has left. The
   pool's work must not grow with its entries (it sorted every entry's pages at each offer). */
static void pool_growth(tl_model *m, const int32_t *prefix_prompt, int prefix, int entries, int vocab) {
    int32_t *prompt = malloc((size_t)(prefix + 2) * sizeof *prompt);
    if (!prompt) die("out of memory");
    memcpy(prompt, prefix_prompt, (size_t)prefix * sizeof *prompt);
    printf("\na pool of many conversations: sessions of the %d-token prefix and 2 tokens of their own, each an entry\n"
           "     entries   ms a session (made, stepped once, freed)\n", prefix);
    double t0 = now_ms();
    int from = 0;
    for (int e = 0; e < entries; e++) {
        /* (e in base vocab: distinct while e < vocab^2) */
        prompt[prefix] = (int32_t)(e % vocab);
        prompt[prefix + 1] = (int32_t)((e / vocab) % vocab);
        int reused;
        first_token_ms(m, prompt, prefix + 2, &reused); /* (timed whole here: made, stepped, freed) */
        if (e + 1 == entries || ((e + 1) & e) == 0) { /* at each power of two */
            const double t1 = now_ms();
            printf("%12d   %8.2f\n", e + 1, (t1 - t0) / (e + 1 - from));
            t0 = t1;
            from = e + 1;
        }
    }
    const double t1 = now_ms();
    if (tl_model_set_prefix_pool(m, 1) != TL_OK) die("prefix pool");
    printf("lowering the budget until the %d entries have left: %.1f ms\n", entries, now_ms() - t1);
    free(prompt);
}

/* A session of `len` prompt tokens stepped once (prefill and first token), saved to a state
   file; then the file read back, resumed and stepped for the next token, as a process
   continuing that conversation would. Prints the file's size and both times (the file is
   read from the page cache: it was just written). */
static void state_file_figure(const tl_model *m, const int32_t *prompt, int len, double cold_ms) {
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 2;
    tl_session *s, *resumed;
    tl_session_state *state, *read_back;
    int32_t token;
    tl_stop_reason stop;
    const char *tmp = getenv("TMPDIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/tinyloop-batch-bench-%ld.state", tmp && *tmp ? tmp : "/tmp", (long)getpid());
    if (strcmp(tl_model_info(m)->backend, "cpu") != 0) { /* (tl_session_state_write: CPU states only) */
        printf("state file: not measured on the %s backend (state files hold CPU states only)\n", tl_model_info(m)->backend);
        return;
    }
    if (tl_session_new(m, prompt, len, &cfg, &s) != TL_OK || tl_session_step(s, &token, &stop) != TL_OK) die("session");
    const double t0 = now_ms();
    if (tl_session_save(s, &state) != TL_OK || tl_session_state_write(state, path) != TL_OK) die("state write");
    const double t1 = now_ms();
    if (tl_session_state_read(m, path, &read_back) != TL_OK || tl_session_resume(m, read_back, NULL, &resumed) != TL_OK ||
        tl_session_step(resumed, &token, &stop) != TL_OK)
        die("state read");
    const double t2 = now_ms();
    struct stat sb;
    const double mb = stat(path, &sb) == 0 ? (double)sb.st_size / 1e6 : 0.0;
    printf("state file of a %d-token session: %.1f MB, written in %.1f ms; read + resume + next token %.1f ms, "
           "against a cold prefill of %.1f ms: %.1fx shorter\n", len, mb, t1 - t0, t2 - t1, cold_ms, cold_ms / (t2 - t1));
    unlink(path);
    tl_session_free(resumed);
    tl_session_state_free(read_back);
    tl_session_state_free(state);
    tl_session_free(s);
}

/* A comma-separated list of whole numbers in [lo, hi], at most `max` of them, none empty. */
static bool whole_list(const char *text, int lo, int hi, int *out, int max, int *n) {
    char copy[256];
    if (snprintf(copy, sizeof copy, "%s", text) >= (int)sizeof copy) return false;
    *n = 0;
    for (char *at = copy;;) {
        char *comma = strchr(at, ',');
        if (comma) *comma = '\0';
        if (*n == max || !bench_int(at, lo, hi, &out[*n])) return false;
        (*n)++;
        if (!comma) return true;
        at = comma + 1;
    }
}

int main(int argc, char **argv) {
    const char *dir = NULL, *counts = "1,2,4,8,16", *step_rows = "0";
    int threads = 0, steps = 32, prefix = 512, mix_prompt = 0, mix_tokens = 0, context = 0; /* 0: 16, or 1 on a short model */
    int pool_entries = 0;
    bool prefix_given = false, prefix_capped = false;
    int rounds = 1;
    tl_backend_kind backend = TL_BACKEND_CPU;
    tl_load_options o; /* --kv-type sets its kv_type over the default (TINYLOOP_KV_TYPE) */
    tl_load_options_init(&o);
    for (int i = 1; i < argc; i += 2) { /* an option and its value (every option but --help has one) */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            printf("usage: tinyloop-batch-bench --model DIR [--threads N] [--steps N] [--context N] [--prefix N] [--sessions LIST] [--mix P,T]\n"
                   "                            [--backend B] [--kv-type f32|f16] [--rounds N]\n"
                   "  --threads N      CPU threads (default: all cores)\n"
                   "  --steps N        timed decode steps per measurement (default 32)\n"
                   "  --context N      prompt tokens of each session before the timed steps (default 16):\n"
                   "                   attention reads this many K/V rows and more a step\n"
                   "  --prefix N       shared prompt prefix for the prefix-pool figure (default 512)\n"
                   "  --pool-entries N also N sessions of that prefix and 2 tokens of their own, each a pool entry:\n"
                   "                   a session's time as the pool fills, and emptying it (default 0: not measured)\n"
                   "  --sessions LIST  concurrent sessions to measure (default 1,2,4,8,16)\n"
                   "  --mix P,T        also the serving mix: P-token prompts, T tokens each at temperature 0.8,\n"
                   "                   a finished session replaced at once (serve_bench's load without HTTP)\n"
                   "  --step-rows L    the mix once per value of the list: rows a step forwards at most, one per\n"
                   "                   session and the rest for prompts (the engine's chunked prefill; default 0:\n"
                   "                   prompts whole), with the step times' p50/p99/max\n"
                   "  --backend B      cpu (default) or cuda\n"
                   "  --kv-type T      the KV cache's type, f32 or f16 (default: f32, or TINYLOOP_KV_TYPE)\n"
                   "  --rounds N       measure the decode rates N times in turn (1 to 15, default 1) and print\n"
                   "                   medians, ranges and the range of the ratios within a round\n");
            return 0;
        }
        if (!v) { fprintf(stderr, "tinyloop-batch-bench: %s needs a value (see --help)\n", a); return 2; }
        /* the whole-number options: their place and range */
        static const struct { const char *name; long lo, hi; } NUMBERS[] = {
            {"--threads", 0, TL_MAX_THREADS}, {"--steps", 1, 1 << 20}, {"--context", 1, 1 << 24}, {"--prefix", 1, 1 << 24},
            {"--pool-entries", 0, 1 << 20}};
        int *const places[] = {&threads, &steps, &context, &prefix, &pool_entries};
        int number = -1;
        for (int k = 0; k < 5; k++)
            if (!strcmp(a, NUMBERS[k].name)) number = k;
        if (number >= 0) {
            if (!bench_int(v, (int)NUMBERS[number].lo, (int)NUMBERS[number].hi, places[number])) {
                fprintf(stderr, "tinyloop-batch-bench: %s wants a whole number from %ld to %ld, got %s\n", a,
                        NUMBERS[number].lo, NUMBERS[number].hi, v);
                return 2;
            }
            prefix_given = prefix_given || !strcmp(a, "--prefix");
        }
        else if (!strcmp(a, "--model")) dir = v;
        else if (!strcmp(a, "--sessions")) counts = v;
        else if (!strcmp(a, "--step-rows")) step_rows = v;
        else if (!strcmp(a, "--rounds")) {
            rounds = atoi(v);
            if (rounds < 1 || rounds > MAX_ROUNDS) {
                fprintf(stderr, "tinyloop-batch-bench: --rounds wants 1 to %d, got %s\n", MAX_ROUNDS, v);
                return 2;
            }
        }
        else if (!strcmp(a, "--backend")) {
            if (strcmp(v, "cpu") && strcmp(v, "cuda")) {
                fprintf(stderr, "tinyloop-batch-bench: --backend wants cpu or cuda, got %s\n", v);
                return 2;
            }
            backend = !strcmp(v, "cpu") ? TL_BACKEND_CPU : TL_BACKEND_CUDA;
        }
        else if (!strcmp(a, "--kv-type")) {
            if (strcmp(v, "f32") && strcmp(v, "f16")) {
                fprintf(stderr, "tinyloop-batch-bench: --kv-type wants f32 or f16, got %s\n", v);
                return 2;
            }
            o.kv_type = !strcmp(v, "f16") ? TL_KV_F16 : TL_KV_F32;
        }
        else if (!strcmp(a, "--mix")) {
            if (sscanf(v, "%d,%d", &mix_prompt, &mix_tokens) != 2 || mix_prompt < 1 || mix_prompt > 1024 || mix_tokens < 1) {
                fprintf(stderr, "tinyloop-batch-bench: --mix wants P,T (a prompt of 1..1024 tokens, T >= 1), got %s\n", v);
                return 2;
            }
        }
        else { fprintf(stderr, "tinyloop-batch-bench: unknown option %s (see --help)\n", a); return 2; }
    }
    /* the lists, before anything is measured (a bad value was dropped, or refused after the
       decode measurements) */
    int session_list[MAX_COUNTS], n_session_list, rows_list[16], n_rows;
    if (!whole_list(counts, 1, 64, session_list, MAX_COUNTS, &n_session_list)) {
        fprintf(stderr, "tinyloop-batch-bench: --sessions wants up to %d counts of 1 to 64, comma-separated, got %s\n",
                MAX_COUNTS, counts);
        return 2;
    }
    if (!whole_list(step_rows, 0, 1 << 20, rows_list, 16, &n_rows)) {
        fprintf(stderr, "tinyloop-batch-bench: --step-rows wants up to 16 values, comma-separated, got %s\n", step_rows);
        return 2;
    }
    for (int r = 0; r < n_rows; r++)
        if (rows_list[r] == 1) { /* (1 leaves one session no prompt row) */
            fprintf(stderr, "tinyloop-batch-bench: --step-rows wants 0 or values >= 2, got 1\n");
            return 2;
        }
    if (!dir) { fprintf(stderr, "tinyloop-batch-bench: need --model DIR (see --help)\n"); return 2; }
    o.n_threads = threads;
    o.backend = backend;
    tl_model *m;
    if (tl_model_load(dir, &o, &m) != TL_OK) die("load");
    const struct tl_model_info *info = tl_model_info(m);
    if (mix_prompt + mix_tokens > info->max_seq_len) {
        fprintf(stderr, "tinyloop-batch-bench: --mix %d,%d is over the model's context of %d tokens\n", mix_prompt,
                mix_tokens, info->max_seq_len);
        tl_model_free(m);
        return 2;
    }
    /* the prefix, a new question token after it and the two tokens state_file_figure steps */
    if (prefix + 3 > info->max_seq_len && prefix_given) {
        fprintf(stderr, "tinyloop-batch-bench: --prefix %d and 3 tokens after it exceed the model's context of %d\n", prefix,
                info->max_seq_len);
        tl_model_free(m);
        return 2;
    }
    /* (each entry's two tokens of its own are distinct for vocab^2 entries) */
    if (pool_entries > 0 && (long long)info->vocab_size * info->vocab_size < pool_entries) {
        fprintf(stderr, "tinyloop-batch-bench: --pool-entries %d: this model's vocabulary of %d makes %lld distinct entries\n",
                pool_entries, info->vocab_size, (long long)info->vocab_size * info->vocab_size);
        tl_model_free(m);
        return 2;
    }
    if (prefix + 3 > info->max_seq_len) { /* (the default, on a short model: the line was left out) */
        prefix = info->max_seq_len - 3; /* (< 1 on a model of 3 positions or fewer: no prefix figure) */
        prefix_capped = true;
    }
    printf("model      %s (%lld params, %s, %.1f MB of weights), %d threads, %s KV\n", dir, (long long)info->n_params,
           info->weight_dtype, info->weight_bytes / 1e6, info->n_threads, info->kv_type);
    if (prefix_capped && prefix >= 1)
        printf("(--prefix: the default 512 and 3 tokens after it exceed the model's context: %d here)\n", prefix);

    /* The ratios are to one session measured in this run, first (a ratio to the list's
       first entry would read 8x for 8 sessions whatever they did). */
    if (context == 0) context = 16 < info->max_seq_len - steps - 2 ? 16 : 1;
    if (context < 1 || context > info->max_seq_len - steps - 2) {
        fprintf(stderr, "tinyloop-batch-bench: --context %d: want 1 .. %d (the model's context less the steps)\n",
                context, info->max_seq_len - steps - 2);
        tl_model_free(m);
        return 2;
    }
    const int prompt_len = context;
    /* The counts to measure after the baseline of one session (a leading 1 is the baseline). */
    int session_counts[MAX_COUNTS], n_counts = 0;
    for (int k = 0; k < n_session_list; k++)
        if (!(k == 0 && session_list[k] == 1)) session_counts[n_counts++] = session_list[k];
    const bool baseline_listed = session_list[0] == 1;
    double one_rates[MAX_ROUNDS], rates[MAX_COUNTS][MAX_ROUNDS], ratios[MAX_COUNTS][MAX_ROUNDS];
    fflush(stdout);
    for (int round = 0; round < rounds; round++) {
        if (rounds > 1 && isatty(2)) fprintf(stderr, "  round %d of %d\r", round + 1, rounds); /* progress */
        one_rates[round] = decode_rate(m, 1, steps, prompt_len);
        for (int c = 0; c < n_counts; c++) {
            rates[c][round] = decode_rate(m, session_counts[c], steps, prompt_len);
            ratios[c][round] = rates[c][round] / one_rates[round];
        }
    }
    if (rounds == 1) {
        printf("\nsessions   aggregate decode tok/s   vs one session\n");
        printf("%8d   %22.1f   %13.2fx%s\n", 1, one_rates[0], 1.0, baseline_listed ? "" : "   (the baseline, not in --sessions)");
        for (int c = 0; c < n_counts; c++) printf("%8d   %22.1f   %13.2fx\n", session_counts[c], rates[c][0], ratios[c][0]);
    } else {
        printf("\n%d rounds, each measuring every count in turn: medians (range)\n"
               "sessions   aggregate decode tok/s           median / one session's median   ratio within a round\n",
               rounds);
        double one_sorted[MAX_ROUNDS];
        memcpy(one_sorted, one_rates, sizeof one_sorted);
        const double one = median(one_sorted, rounds);
        printf("%8d   %8.1f (%7.1f - %7.1f)   %13.2fx%s\n", 1, one, one_sorted[0], one_sorted[rounds - 1], 1.0,
               baseline_listed ? "" : "                   (the baseline, not in --sessions)");
        for (int c = 0; c < n_counts; c++) {
            const double rate = median(rates[c], rounds); /* sorts the rates, and below the ratios */
            median(ratios[c], rounds);
            printf("%8d   %8.1f (%7.1f - %7.1f)   %13.2fx                   %.2fx - %.2fx\n", session_counts[c], rate,
                   rates[c][0], rates[c][rounds - 1], rate / one, ratios[c][0], ratios[c][rounds - 1]);
        }
    }
    fflush(stdout);

    if (mix_prompt > 0) {
        printf("\nserving mix: prompts of %d tokens, %d tokens each at temperature 0.8, a finished session replaced at once\n"
               "     sessions     step rows   aggregate tok/s   vs one session   step p50 / p99 / max ms   CPU %%   tok per CPU-s\n",
               mix_prompt, mix_tokens);
        const int mix_steps = 2 * mix_tokens > steps ? 2 * mix_tokens : steps;
        step_times times = {malloc((size_t)mix_steps * sizeof(double)), 0};
        if (!times.ms) die("out of memory");
        double share;
        /* The baseline: one session at the list's first value. */
        const int base_rows = rows_list[0] > 0 ? rows_list[0] - 1 : 0;
        const double mix_one = mix_rate(m, 1, mix_steps, mix_prompt, mix_tokens, base_rows, &share, &times);
        printf("mix %8d   %11d   %15.1f   %13.2fx   %7.1f / %7.1f / %7.1f   %5.0f   %13.1f   (the baseline)\n", 1,
               rows_list[0], mix_one, 1.0, quantile(&times, 0.5), quantile(&times, 0.99), times.ms[times.n - 1],
               100 * share, mix_one / share);
        for (int k = 0; k < n_session_list; k++) {
            const int n = session_list[k];
            for (int r = 0; r < n_rows; r++) { /* in turn, so that drift falls on every value alike */
                if (rows_list[r] > 0 && rows_list[r] <= n) {
                    printf("mix %8d   %11d   (the engine needs more step rows than sessions)\n", n, rows_list[r]);
                    continue;
                }
                const int prompt_rows = rows_list[r] > 0 ? rows_list[r] - n : 0;
                const double rate = mix_rate(m, n, mix_steps, mix_prompt, mix_tokens, prompt_rows, &share, &times);
                printf("mix %8d   %11d   %15.1f   %13.2fx   %7.1f / %7.1f / %7.1f   %5.0f   %13.1f\n", n, rows_list[r],
                       rate, rate / mix_one, quantile(&times, 0.5), quantile(&times, 0.99), times.ms[times.n - 1],
                       100 * share, rate / share);
                fflush(stdout);
            }
        }
        free(times.ms);
    }

    if (prefix >= 1) {
        int32_t *prompt = malloc((size_t)(prefix + 1) * sizeof *prompt);
        if (!prompt) die("out of memory");
        for (int k = 0; k <= prefix; k++) prompt[k] = random_token(info->vocab_size);
        int reused;
        /* (a speculative draft runs fewer loops than the verifier: none on a model of one loop) */
        const bool chain = info->default_loops >= 2;
        double cold[DECODERS];
        for (int d = 0; d < DECODERS; d++)
            if (d != CHAIN || chain) cold[d] = first_token_ms_with(m, prompt, prefix + 1, &reused, d);
        state_file_figure(m, prompt, prefix + 1, cold[PLAIN]);
        if (tl_model_set_prefix_pool(m, (int64_t)1 << 32) != TL_OK) die("prefix pool");
        first_token_ms(m, prompt, prefix + 1, &reused); /* fills the pool */
        /* each decoder's prompt: a new question after the shared prefix (every decoder takes
           and offers prefixes, so each asks one no other asked) */
        for (int d = 0; d < DECODERS; d++) {
            if (d == CHAIN && !chain) {
                printf("shared prefix of %d tokens, %s: not measured (the model loops once)\n", prefix, decoder_names[d]);
                continue;
            }
            prompt[prefix] = (prompt[prefix] + 1) % info->vocab_size;
            const double warm = first_token_ms_with(m, prompt, prefix + 1, &reused, d);
            printf("%sshared prefix of %d tokens, %s: time to first token %.1f ms cold, %.1f ms from the pool "
                   "(%d tokens reused): %.1fx shorter\n", d == 0 ? "\n" : "", prefix, decoder_names[d], cold[d], warm,
                   reused, cold[d] / warm);
        }
        fflush(stdout);
        if (pool_entries > 0) pool_growth(m, prompt, prefix, pool_entries, info->vocab_size);
        free(prompt);
    }
    tl_model_free(m);
    return bench_output_status("tinyloop-batch-bench");
}

/* tinyloop.c: the command-line generator. Streams text from a checkpoint as it is
 * produced, then prints one line of stats on stderr.
 *
 *   tinyloop [options] [--] "prompt text"
 *
 * Exit status: 0 on success, 1 when the engine reports an error, 2 for bad usage. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tinyloop.h"

#ifndef TINYLOOP_DEFAULT_MODEL
#define TINYLOOP_DEFAULT_MODEL "models/tinyloop-austen"
#endif
#define MAX_STOPS 32

static const char usage[] =
    "usage: tinyloop [options] [--] PROMPT\n"
    "Generate text from a looped transformer checkpoint, streaming it as it is produced.\n"
    "\n"
    "  -m, --model DIR            checkpoint directory (default " TINYLOOP_DEFAULT_MODEL ")\n"
    "  -p, --prompt TEXT          the prompt (or give it as the last argument)\n"
    "  -n, --max-tokens N         new tokens at most (default 64)\n"
    "  -L, --loops N              loop depth (default: the model's default_loops)\n"
    "  -t, --temperature T        0 = greedy (default 0)\n"
    "  -k, --top-k K              keep the K most likely tokens (default 50)\n"
    "      --top-p P              nucleus mass in (0, 1] (default 1)\n"
    "  -s, --seed N               sampling seed (default 0)\n"
    "      --repetition-penalty R HF-style penalty on seen tokens (default 1)\n"
    "      --stop TEXT            stop when TEXT appears (repeatable)\n"
    "      --cache-window W       attend to the last W positions only (default 0: all)\n"
    "      --ignore-eos           keep going past the end-of-text token\n"
    "      --threads N            CPU threads (default: all cores)\n"
    "      --no-prompt            do not echo the prompt\n"
    "      --no-stats             no stats line\n"
    "  -h, --help                 this text\n";

static int die_usage(const char *fmt, const char *arg) {
    fprintf(stderr, "tinyloop: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, " (see --help)\n");
    return 2;
}

static int parse_int(const char *s, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

static int parse_float(const char *s, float *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = (float)v;
    return 0;
}

int main(int argc, char **argv) {
    const char *model_dir = TINYLOOP_DEFAULT_MODEL, *prompt = NULL;
    const char *stops[MAX_STOPS];
    int n_stops = 0, threads = 0, echo_prompt = 1, show_stats = 1;
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define IS(s, l) (strcmp(a, s) == 0 || strcmp(a, l) == 0)
#define NEED() do { if (!v) return die_usage("option %s needs a value", a); i++; } while (0)
#define INT(dst, lo, hi) do { NEED(); if (parse_int(v, lo, hi, &(dst))) return die_usage("bad value for %s", a); } while (0)
#define FLT(dst) do { NEED(); if (parse_float(v, &(dst))) return die_usage("bad value for %s", a); } while (0)
        if (IS("-h", "--help")) { fputs(usage, stdout); return 0; }
        else if (IS("-m", "--model")) { NEED(); model_dir = v; }
        else if (IS("-p", "--prompt")) { NEED(); prompt = v; }
        else if (IS("-n", "--max-tokens")) INT(cfg.max_tokens, 0, INT_MAX);
        else if (IS("-L", "--loops")) INT(cfg.loops, 1, INT_MAX);
        else if (IS("-t", "--temperature")) FLT(cfg.temperature);
        else if (IS("-k", "--top-k")) INT(cfg.top_k, INT_MIN, INT_MAX);
        else if (IS("--top-p", "--top-p")) FLT(cfg.top_p);
        else if (IS("-s", "--seed")) { int seed; INT(seed, 0, INT_MAX); cfg.sample_seed = (uint64_t)seed; }
        else if (IS("--repetition-penalty", "--repetition-penalty")) FLT(cfg.repetition_penalty);
        else if (IS("--cache-window", "--cache-window")) INT(cfg.cache_window, INT_MIN, INT_MAX);
        else if (IS("--threads", "--threads")) INT(threads, 1, 1024);
        else if (IS("--stop", "--stop")) {
            NEED();
            if (n_stops == MAX_STOPS) return die_usage("at most 32 --stop strings%s", "");
            stops[n_stops++] = v;
        }
        else if (IS("--ignore-eos", "--ignore-eos")) cfg.ignore_eos = 1;
        else if (IS("--no-prompt", "--no-prompt")) echo_prompt = 0;
        else if (IS("--no-stats", "--no-stats")) show_stats = 0;
        else if (strcmp(a, "--") == 0) { if (v) prompt = argv[++i]; }
        else if (a[0] == '-' && a[1]) return die_usage("unknown option %s", a);
        else if (!prompt) prompt = a;
        else return die_usage("unexpected argument %s", a);
    }
    if (!prompt) return die_usage("no prompt given%s", "");
    cfg.stop_strings = stops;
    cfg.n_stop_strings = n_stops;

    tl_load_options opts;
    tl_load_options_init(&opts);
    opts.n_threads = threads;
    tl_model *model = NULL;
    tl_session *session = NULL;
    int32_t *ids = NULL;
    int n_ids = 0, status = 1;
    if (tl_model_load(model_dir, &opts, &model) != TL_OK) goto fail;
    if (tl_encode(model, prompt, strlen(prompt), &ids, &n_ids) != TL_OK) goto fail;
    if (n_ids == 0) {
        fprintf(stderr, "tinyloop: the prompt encodes to no tokens\n");
        goto done;
    }
    if (tl_session_new(model, ids, n_ids, &cfg, &session) != TL_OK) goto fail;
    if (echo_prompt) { fputs(prompt, stdout); fflush(stdout); }
    for (tl_stop_reason stop = TL_STOP_NONE; stop == TL_STOP_NONE;) {
        int32_t token;
        const char *piece;
        size_t len;
        if (tl_session_step(session, &token, &stop) != TL_OK) goto fail;
        if (tl_session_text(session, &piece, &len) != TL_OK) goto fail;
        fwrite(piece, 1, len, stdout);
        fflush(stdout);
    }
    fputc('\n', stdout);
    fflush(stdout);
    if (show_stats) {
        const tl_generate_stats *st = tl_session_stats(session);
        fprintf(stderr,
                "[prefill %d tokens %.1f ms (%.1f tok/s) | first token %.1f ms | %d tokens %.1f tok/s | "
                "stop %s | loops %.2f | %d threads]\n",
                st->prompt_tokens, st->prefill_ms, tl_stats_prefill_tokens_per_s(st), st->first_token_ms,
                st->tokens_emitted, tl_stats_decode_tokens_per_s(st), tl_stop_reason_name(st->stop_reason),
                st->loops_used, tl_model_info(model)->n_threads);
    }
    status = 0;
    goto done;
fail:
    fprintf(stderr, "tinyloop: %s\n", tl_last_error());
done:
    tl_free(ids);
    tl_session_free(session);
    tl_model_free(model);
    return status;
}

/* bench.c: tinyloop-bench, the CPU throughput benchmark (a tool, not a test).
 *
 * For each thread count it loads a checkpoint and measures
 *   - prefill tokens/s: one prompt of --prompt-len tokens through tl_forward_run in
 *     chunks of --chunk rows, logits for the last prompt row only;
 *   - decode tokens/s: --decode tokens after the prefill, one per tl_forward_run (n = 1,
 *     logits for that row, greedy argmax feeds the next step), at --loops;
 *   - weight bytes read per decoded token, from the loaded model's matrices and dtypes
 *     (prelude + block x loops + coda layers, concat injection x loops, lm_head, norm
 *     vectors, embedding rows), and the achieved GB/s = bytes/token x decode tokens/s;
 *   - the machine's streaming read bandwidth at the same thread count (a sum over a buffer
 *     of max(8 x L3, 1 GiB), split across the threads, best of a few passes, each thread
 *     reading its part as one stream and as four interleaved ones): with less,
 *     part of the buffer stays in the cache and the figure measures the cache, not DRAM;
 *   - with --sgemm, OpenBLAS sgemm GFLOP/s on the model's layer shapes at the prefill chunk
 *     size, and prefill's matmul GFLOP/s as a fraction of it (a yardstick measured in the
 *     same run; OpenBLAS is linked into this tool only, never into the engine),
 * and prints one table (optionally a CSV file too). The L3 size is printed, and a note
 * warns when the weights are under 4 x L3: decode may then read them from the cache. Timings are medians of --repeat runs
 * after one warm-up run.
 *
 * The checkpoint is either an existing directory (--model DIR) or a random one written to
 * a temporary directory from a preset (--preset NAME, --list-presets: k_presets, among them
 * the published shapes and options of Huginn-0125 and Ouro) or a config.json (--config FILE),
 * in --dtype f32|f16|bf16. The temporary directory is removed
 * at exit unless --keep. GB are 10^9 bytes, MB 10^6, MiB/GiB powers of two. */
#define _GNU_SOURCE
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bench_args.h"
#include "cpu/kernels.h"
#include "forward.h"
#include "kv_cache.h"
#include "pool.h"
#include "quant.h"

#define MAX_THREAD_COUNTS 64
#define GB 1e9
#define MB 1e6
#define MIB (1024.0 * 1024.0)

/* ---------------------------------------------------------------- errors, temp dir */

static char g_tmpdir[4096];
static char g_cfg_path[4200];
static char g_st_path[4200];
static int g_keep;

static void remove_tmpdir(void) {
    if (!g_tmpdir[0] || g_keep) return;
    unlink(g_cfg_path); /* async-signal-safe: also called from the signal handler */
    unlink(g_st_path);
    rmdir(g_tmpdir);
    g_tmpdir[0] = '\0';
}

static void on_signal(int sig) {
    remove_tmpdir();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* One line on stderr, then exit (the temp dir is removed by the atexit handler). */
static void die(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
static void die(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("tinyloop-bench: error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(code);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---------------------------------------------------------------- text */

typedef struct { char *s; size_t len, cap; } sbuf;
static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) die(1, "formatting failed");
        if (b->s && b->len + (size_t)n < b->cap) { b->len += (size_t)n; return; }
        size_t cap = b->cap ? b->cap : 4096;
        while (cap <= b->len + (size_t)n) cap *= 2;
        char *grown = realloc(b->s, cap);
        if (!grown) die(1, "out of memory");
        b->s = grown;
        b->cap = cap;
    }
}

/* ---------------------------------------------------------------- presets */

/* A preset is a config.json in our format (SPEC §1). The fields every config has are struct
   fields; `options` holds any further config.json fields (the general options of SPEC §1:
   norm placement, RoPE pairing, ...) as a JSON fragment, so that a preset can carry a
   published model's architecture without the struct growing a field per option. */
typedef struct {
    const char *name;
    int vocab, d, heads, kv_heads, dff, max_seq, prelude, block, coda, loops, max_loops;
    const char *norm, *mlp, *pos, *injection, *update;
    int bias, tie, state_norm, bos, eos;
    double rope_theta, norm_eps; /* 0: the SPEC defaults, 10000 and 1e-5 */
    const char *options;         /* more fields, "\"k\": v, ..." without braces; NULL: none */
} preset;

/* Huginn-0125 (tomg-group-umd/huginn-0125, config.json) in our format, as hf_huginn.c maps
   it: sandwich layers, q/k biases before interleaved RoPE, embeddings times init_values.
   embed_scale = sqrt(5280), the concat adapter on [state ; embedding] without a bias, ln_f
   before the coda and at the head, and the "like-init" random initial state of std
   init_values.std = sqrt(2 / (5 x 5280)) (drawn in the timed runs: see ws.state_seed in main). */
#define HUGINN_OPTIONS                                                                         \
    "\"norm_placement\": \"sandwich\", \"rope_pairing\": \"interleaved\", \"qk_bias\": true, " \
    "\"embed_scale\": 72.6636084983398, \"inject_order\": \"state_first\", "                  \
    "\"final_norm_before_coda\": true, \"initial_state\": \"truncated_normal\", "             \
    "\"initial_state_std\": 0.008703882797784892"
/* Ouro (ByteDance/Ouro-1.4B, -2.6B) in our format, as hf_ouro.c maps it: the whole stack is
   the loop, 4-norm "pre_post" layers, model.norm after every pass (the state norm reusing
   final_norm), none again at the head, and the exit gate sigma(gate . s + b) with the
   published early_exit_threshold 1. (tl_forward_run, which the bench times, never evaluates
   the gate: early_exit.c does, for early_exit_criterion "gate", one d-length dot product a
   pass.) */
#define OURO_OPTIONS                                                                                   \
    "\"norm_placement\": \"pre_post\", \"state_norm_weights\": \"final_norm\", \"final_norm_at_head\": false, " \
    "\"exit_gate\": true, \"exit_gate_threshold\": 1.0"

static const preset k_presets[] = {
    {.name = "gpt2-small", .vocab = 50257, .d = 768, .heads = 12, .kv_heads = 12, .dff = 3072,
     .max_seq = 1024, .prelude = 0, .block = 12, .coda = 0, .loops = 1, .max_loops = 1,
     .norm = "layernorm", .mlp = "gelu", .pos = "learned", .injection = "add", .update = "replace",
     .bias = 1, .tie = 1, .state_norm = 0, .bos = 50256, .eos = 50256},
    {.name = "looped-400m", .vocab = 50257, .d = 1024, .heads = 16, .kv_heads = 16, .dff = 4096,
     .max_seq = 2048, .prelude = 2, .block = 4, .coda = 2, .loops = 8, .max_loops = 8,
     .norm = "rmsnorm", .mlp = "swiglu", .pos = "rope", .injection = "add", .update = "replace",
     .bias = 0, .tie = 0, .state_norm = 1, .bos = 50256, .eos = 50256},
    /* small but exercising the rarer paths: GQA, concat injection, residual update,
       biases, state norm, untied head */
    {.name = "tiny", .vocab = 512, .d = 64, .heads = 4, .kv_heads = 2, .dff = 192, .max_seq = 512,
     .prelude = 1, .block = 2, .coda = 1, .loops = 4, .max_loops = 8,
     .norm = "rmsnorm", .mlp = "swiglu", .pos = "rope", .injection = "concat", .update = "residual",
     .bias = 1, .tie = 0, .state_norm = 1, .bos = 0, .eos = 1},
    /* The published shapes: 55 heads of 96, 2 + 4 x 32 + 2 layers, 3.56 B parameters (tied
       head); bos/eos are the config's defaults (65504, 65505). */
    {.name = "huginn-0125", .vocab = 65536, .d = 5280, .heads = 55, .kv_heads = 55, .dff = 17920,
     .max_seq = 4096, .prelude = 2, .block = 4, .coda = 2, .loops = 32, .max_loops = 128,
     .norm = "rmsnorm", .mlp = "swiglu", .pos = "rope", .injection = "concat", .update = "replace",
     .bias = 0, .tie = 1, .state_norm = 0, .bos = 65504, .eos = 65505,
     .rope_theta = 50000.0, .norm_eps = 1e-6, .options = HUGINN_OPTIONS},
    /* 16 heads of 128 (num_key_value_heads 16: no GQA), 24 / 48 layers x 4 passes
       (total_ut_steps), untied head, rope_theta 1e6; 1.43 B / 2.67 B parameters. */
    {.name = "ouro-1.4b", .vocab = 49152, .d = 2048, .heads = 16, .kv_heads = 16, .dff = 5632,
     .max_seq = 65536, .prelude = 0, .block = 24, .coda = 0, .loops = 4, .max_loops = 16,
     .norm = "rmsnorm", .mlp = "swiglu", .pos = "rope", .injection = "none", .update = "replace",
     .bias = 0, .tie = 0, .state_norm = 1, .bos = 0, .eos = 0,
     .rope_theta = 1e6, .norm_eps = 1e-6, .options = OURO_OPTIONS},
    {.name = "ouro-2.6b", .vocab = 49152, .d = 2048, .heads = 16, .kv_heads = 16, .dff = 5632,
     .max_seq = 65536, .prelude = 0, .block = 48, .coda = 0, .loops = 4, .max_loops = 16,
     .norm = "rmsnorm", .mlp = "swiglu", .pos = "rope", .injection = "none", .update = "replace",
     .bias = 0, .tie = 0, .state_norm = 1, .bos = 0, .eos = 0,
     .rope_theta = 1e6, .norm_eps = 1e-6, .options = OURO_OPTIONS},
    /* The same architectures at test size (the ctest smoke runs): every option above, so the
       writer and the loader must agree on the tensors each one implies. */
    {.name = "huginn-tiny", .vocab = 512, .d = 96, .heads = 4, .kv_heads = 4, .dff = 160,
     .max_seq = 256, .prelude = 2, .block = 4, .coda = 2, .loops = 4, .max_loops = 16,
     .norm = "rmsnorm", .mlp = "swiglu", .pos = "rope", .injection = "concat", .update = "replace",
     .bias = 0, .tie = 1, .state_norm = 0, .bos = 0, .eos = 1,
     .rope_theta = 50000.0, .norm_eps = 1e-6, .options = HUGINN_OPTIONS},
    {.name = "ouro-tiny", .vocab = 512, .d = 64, .heads = 4, .kv_heads = 4, .dff = 176,
     .max_seq = 256, .prelude = 0, .block = 3, .coda = 0, .loops = 4, .max_loops = 16,
     .norm = "rmsnorm", .mlp = "swiglu", .pos = "rope", .injection = "none", .update = "replace",
     .bias = 0, .tie = 0, .state_norm = 1, .bos = 0, .eos = 0,
     .rope_theta = 1e6, .norm_eps = 1e-6, .options = OURO_OPTIONS},
};
#define N_PRESETS ((int)(sizeof k_presets / sizeof k_presets[0]))

/* "a, b, c": the preset names, for --help and the unknown-preset error. */
static const char *preset_names(void) {
    static char list[512];
    if (!list[0])
        for (int i = 0; i < N_PRESETS; i++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", k_presets[i].name);
    return list;
}

static char *preset_config_json(const char *name) {
    const preset *p = NULL;
    for (int i = 0; i < N_PRESETS; i++)
        if (!strcmp(k_presets[i].name, name)) p = &k_presets[i];
    if (!p) die(2, "--preset: unknown preset \"%s\" (%s)", name, preset_names());
    sbuf b = {0};
    sb_printf(&b,
              "{\n"
              "  \"vocab_size\": %d,\n  \"d_model\": %d,\n  \"n_heads\": %d,\n  \"n_kv_heads\": %d,\n"
              "  \"d_ff\": %d,\n  \"max_seq_len\": %d,\n"
              "  \"n_prelude\": %d,\n  \"n_block\": %d,\n  \"n_coda\": %d,\n"
              "  \"default_loops\": %d,\n  \"max_loops\": %d,\n  \"beta\": 1.0,\n"
              "  \"injection\": \"%s\",\n  \"loop_update\": \"%s\",\n  \"state_norm\": %s,\n"
              "  \"norm\": \"%s\",\n  \"norm_eps\": %g,\n  \"mlp\": \"%s\",\n  \"bias\": %s,\n"
              "  \"pos_encoding\": \"%s\",\n  \"rope_theta\": %.1f,\n  \"tie_embeddings\": %s,\n"
              "  \"bos_token_id\": %d,\n  \"eos_token_id\": %d,\n",
              p->vocab, p->d, p->heads, p->kv_heads, p->dff, p->max_seq, p->prelude, p->block, p->coda,
              p->loops, p->max_loops, p->injection, p->update, p->state_norm ? "true" : "false",
              p->norm, p->norm_eps > 0.0 ? p->norm_eps : 1e-5, p->mlp, p->bias ? "true" : "false", p->pos,
              p->rope_theta > 0.0 ? p->rope_theta : 10000.0, p->tie ? "true" : "false", p->bos, p->eos);
    if (p->options) sb_printf(&b, "  %s,\n", p->options);
    /* provenance of a kept checkpoint; the parser warns about it as an unknown field */
    sb_printf(&b, "  \"tinyloop_bench_preset\": \"%s\"\n}\n", p->name);
    return b.s;
}

/* ---------------------------------------------------------------- options */

typedef struct {
    const char *model_dir, *preset, *config_file, *dtype_name, *csv, *tmp_parent;
    tl_dtype dtype;
    tl_backend_kind backend; /* --backend: the CPU unless asked */
    int threads[MAX_THREAD_COUNTS], n_threads;
    int prompt_len, decode, loops, repeat, chunk, stream_passes, keep, sgemm, print_config, mmap;
    long stream_mb;
    uint64_t seed;
} options;

static void usage(FILE *fp) {
    fprintf(fp,
        "usage: tinyloop-bench (--model DIR | --preset NAME | --config FILE) [options]\n"
        "\n"
        "Checkpoint (exactly one):\n"
        "  --model DIR          an existing checkpoint directory (config.json + model.safetensors)\n"
        "  --preset NAME        write a random checkpoint to a temp dir, one of:\n"
        "                       %s\n"
        "  --config FILE        write a random checkpoint for this config.json to a temp dir\n"
        "  --dtype T            f32 (default), f16 or bf16: dtype of a written checkpoint\n"
        "  --seed N             seed of the random weights and prompt (default 1)\n"
        "  --tmpdir DIR         parent of the temp dir (default $TMPDIR or /tmp)\n"
        "  --keep               keep the written checkpoint (its path is printed)\n"
        "  --list-presets       print the preset names, one a line, and exit\n"
        "  --print-config       print the config.json of --preset/--config (checked by the\n"
        "                       engine's parser) and its tensor and byte counts at --dtype, then\n"
        "                       exit without writing anything\n"
        "\n"
        "Measurement:\n"
        "  --threads LIST       comma-separated thread counts (default 1,<cores>)\n"
        "  --mmap               read the weights from the file's mapping in place (tl_load_options\n"
        "                       mmap_weights: the row-major kernels) instead of copied panels\n"
        "  --backend B          cpu (default) or cuda (the stream and sgemm columns stay the\n"
        "                       CPU's; scripts/gpu-check adds the device's copy bandwidth)\n"
        "  --prompt-len N       prompt tokens for prefill (default 128)\n"
        "  --chunk N            rows per prefill forward (default 64)\n"
        "  --decode N           tokens decoded one at a time after the prefill (default 32)\n"
        "  --loops N            loop depth (default: the model's default_loops)\n"
        "  --repeat N           timed runs; the median is reported (default 3; plus 1 warm-up)\n"
        "  --stream-mb N        stream-bandwidth buffer in MiB (default max(8 x L3, 1024))\n"
        "  --stream-passes N    stream passes of each kind (one and four streams a thread);\n"
        "                       the best is reported (default 5)\n"
        "  --sgemm              also measure OpenBLAS sgemm on the layer shapes (yardstick for\n"
        "                       prefill; needs a build that found OpenBLAS)\n"
        "  --csv FILE           also write the results as CSV\n"
        "  --help               this text\n"
        "\n"
        "GB/s are 10^9 bytes per second; 'decode %% of stream' compares decode GB/s (weight\n"
        "bytes per token x decode tokens/s) with the streaming read bandwidth at the same\n"
        "thread count. KV-cache reads are reported separately, not counted in weight bytes.\n",
        preset_names());
}

static long parse_long(const char *flag, const char *s, long lo, long hi) {
    long v;
    if (!bench_long(s, lo, hi, &v)) die(2, "%s: expected an integer in [%ld, %ld], got \"%s\"", flag, lo, hi, s);
    return v;
}

static void parse_threads(options *o, const char *s) {
    char buf[512];
    if (strlen(s) >= sizeof buf || !*s) die(2, "--threads: bad list \"%s\"", s);
    strcpy(buf, s);
    o->n_threads = 0;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (o->n_threads == MAX_THREAD_COUNTS) die(2, "--threads: at most %d entries", MAX_THREAD_COUNTS);
        o->threads[o->n_threads++] = (int)parse_long("--threads", tok, 1, TL_MAX_THREADS);
    }
    if (o->n_threads == 0) die(2, "--threads: bad list \"%s\"", s);
}

static void parse_args(int argc, char **argv, options *o) {
    memset(o, 0, sizeof *o);
    o->backend = TL_BACKEND_CPU;
    o->prompt_len = 128;
    o->decode = 32;
    o->repeat = 3;
    o->chunk = 64;
    o->stream_passes = 5;
    o->stream_mb = 0;
    o->seed = 1;
    o->dtype = TL_F32;
    for (int i = 1; i < argc; i++) {
        char flag[64];
        const char *arg = argv[i], *val = NULL;
        const char *eq = strchr(arg, '=');
        if (strncmp(arg, "--", 2) == 0 && eq && (size_t)(eq - arg) < sizeof flag) {
            memcpy(flag, arg, (size_t)(eq - arg));
            flag[eq - arg] = '\0';
            val = eq + 1;
        } else {
            snprintf(flag, sizeof flag, "%s", arg);
        }
        if (!strcmp(flag, "--help") || !strcmp(flag, "-h")) { usage(stdout); exit(bench_output_status("tinyloop-bench")); }
        if (!strcmp(flag, "--list-presets")) {
            for (int k = 0; k < N_PRESETS; k++) puts(k_presets[k].name);
            exit(bench_output_status("tinyloop-bench"));
        }
        if (!strcmp(flag, "--keep") || !strcmp(flag, "--sgemm") || !strcmp(flag, "--print-config") || !strcmp(flag, "--mmap")) {
            if (val) die(2, "%s takes no value", flag);
            if (!strcmp(flag, "--keep")) o->keep = 1;
            else if (!strcmp(flag, "--sgemm")) o->sgemm = 1;
            else if (!strcmp(flag, "--mmap")) o->mmap = 1;
            else o->print_config = 1;
            continue;
        }
        static const char *const valued[] = {"--model", "--preset", "--config", "--dtype", "--seed",
            "--tmpdir", "--threads", "--prompt-len", "--chunk", "--decode", "--loops", "--repeat",
            "--stream-mb", "--stream-passes", "--csv", "--backend", NULL};
        int known = 0;
        for (int k = 0; valued[k]; k++) known |= !strcmp(flag, valued[k]);
        if (!known) die(2, "unknown option \"%s\" (see --help)", arg);
        if (!val) {
            if (i + 1 >= argc) die(2, "%s needs a value (see --help)", flag);
            val = argv[++i];
        }
        if (!strcmp(flag, "--model")) o->model_dir = val;
        else if (!strcmp(flag, "--preset")) o->preset = val;
        else if (!strcmp(flag, "--config")) o->config_file = val;
        else if (!strcmp(flag, "--dtype")) {
            o->dtype_name = val;
            if (!strcmp(val, "f32")) o->dtype = TL_F32;
            else if (!strcmp(val, "f16")) o->dtype = TL_F16;
            else if (!strcmp(val, "bf16")) o->dtype = TL_BF16;
            else die(2, "--dtype: expected f32, f16 or bf16, got \"%s\"", val);
        }
        else if (!strcmp(flag, "--seed")) o->seed = (uint64_t)parse_long(flag, val, 0, 0x7fffffffL);
        else if (!strcmp(flag, "--tmpdir")) o->tmp_parent = val;
        else if (!strcmp(flag, "--threads")) parse_threads(o, val);
        else if (!strcmp(flag, "--prompt-len")) o->prompt_len = (int)parse_long(flag, val, 1, 1 << 24);
        else if (!strcmp(flag, "--chunk")) o->chunk = (int)parse_long(flag, val, 1, 1 << 16);
        else if (!strcmp(flag, "--decode")) o->decode = (int)parse_long(flag, val, 1, 1 << 24);
        else if (!strcmp(flag, "--loops")) o->loops = (int)parse_long(flag, val, 1, 1 << 16);
        else if (!strcmp(flag, "--repeat")) o->repeat = (int)parse_long(flag, val, 1, 1000);
        else if (!strcmp(flag, "--stream-mb")) o->stream_mb = parse_long(flag, val, 1, 1L << 20);
        else if (!strcmp(flag, "--stream-passes")) o->stream_passes = (int)parse_long(flag, val, 1, 1000);
        else if (!strcmp(flag, "--csv")) o->csv = val;
        else if (!strcmp(flag, "--backend")) {
            if (!strcmp(val, "cpu")) o->backend = TL_BACKEND_CPU;
            else if (!strcmp(val, "cuda")) o->backend = TL_BACKEND_CUDA;
            else die(2, "--backend: expected cpu or cuda, got \"%s\"", val);
        }
    }
    int sources = !!o->model_dir + !!o->preset + !!o->config_file;
    if (sources != 1) die(2, "give exactly one of --model DIR, --preset NAME, --config FILE (see --help)");
    if (o->model_dir && o->dtype_name) die(2, "--dtype applies to written checkpoints (--preset/--config), not --model");
    if (o->model_dir && o->keep) die(2, "--keep applies to written checkpoints (--preset/--config), not --model");
    if (o->model_dir && o->print_config)
        die(2, "--print-config applies to written checkpoints (--preset/--config), not --model");
#ifndef TL_BENCH_OPENBLAS
    if (o->sgemm) die(2, "--sgemm: this tinyloop-bench was built without OpenBLAS (install libopenblas-dev and re-run cmake)");
#endif
    if (o->n_threads == 0) {
        const int cores = tl_pool_cores(); /* the engine's "one per core" */
        o->threads[o->n_threads++] = 1;
        if (cores > 1) o->threads[o->n_threads++] = cores > 1024 ? 1024 : cores;
    }
}

static char *read_file_text(const char *path) {
    FILE *fp = fopen(path, "rb");
    if (!fp) die(1, "--config: cannot open %s: %s", path, strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            if (cap > (64u << 20)) die(1, "--config: %s is larger than 64 MiB", path);
            char *grown = realloc(buf, cap);
            if (!grown) die(1, "out of memory");
            buf = grown;
        }
        size_t got = fread(buf + len, 1, 4096, fp);
        len += got;
        if (got < 4096) break;
    }
    if (ferror(fp)) die(1, "--config: cannot read %s", path);
    fclose(fp);
    buf[len] = '\0';
    return buf;
}

/* ---------------------------------------------------------------- random checkpoint */

typedef struct { uint64_t state; int has_spare; double spare; } rng;

static uint64_t rng_next(rng *r) { /* splitmix64 */
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static double rng_uniform(rng *r) { return ((double)(rng_next(r) >> 11) + 0.5) * 0x1.0p-53; } /* (0,1) */
static double rng_normal(rng *r) { /* Box-Muller */
    if (r->has_spare) { r->has_spare = 0; return r->spare; }
    double u = rng_uniform(r), v = rng_uniform(r);
    double rad = sqrt(-2.0 * log(u)), ang = 6.283185307179586 * v;
    r->spare = rad * sin(ang);
    r->has_spare = 1;
    return rad * cos(ang);
}

/* f32 -> bf16, round to nearest even (inf and NaN kept); f32 -> f16 is the engine's
   tl_f32_to_f16 (quant.h), the one conversion the quantiser uses too. */
static uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u); /* quiet NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

typedef enum { INIT_NORMAL, INIT_ONES, INIT_ZEROS } init_kind;
typedef struct {
    char name[128];
    int64_t rows, cols; /* rows < 0: a vector of cols elements */
    init_kind init;
} tspec;

typedef struct { tspec *v; int n, cap; } tlist;

static void tl_add(tlist *l, const char *name, int64_t rows, int64_t cols, init_kind init) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        tspec *grown = realloc(l->v, (size_t)l->cap * sizeof *grown);
        if (!grown) die(1, "out of memory");
        l->v = grown;
    }
    tspec *t = &l->v[l->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->rows = rows;
    t->cols = cols;
    t->init = init;
}

static void add_norm(tlist *l, const tl_config *c, const char *prefix) {
    char name[128];
    snprintf(name, sizeof name, "%s.weight", prefix);
    tl_add(l, name, -1, c->d_model, INIT_ONES);
    if (c->norm == TL_NORM_LAYERNORM) {
        snprintf(name, sizeof name, "%s.bias", prefix);
        tl_add(l, name, -1, c->d_model, INIT_ZEROS);
    }
}

/* prefix.weight [rows, cols], and prefix.bias when `bias`. */
static void add_linear(tlist *l, const char *prefix, int rows, int cols, bool bias) {
    char name[128];
    snprintf(name, sizeof name, "%s.weight", prefix);
    tl_add(l, name, rows, cols, INIT_NORMAL);
    if (bias) {
        snprintf(name, sizeof name, "%s.bias", prefix);
        tl_add(l, name, -1, rows, INIT_NORMAL);
    }
}

/* Tensor names and shapes of SPEC §1 for this config: exactly the tensors the loader binds
   for it (engine/src/model.c, bind_all and bind_layer), which refuses a missing one and an
   unexpected one alike; the huginn-tiny / ouro-tiny / tiny ctest runs keep the two in step. */
static tlist checkpoint_tensors(const tl_config *c) {
    tlist l = {0};
    const int d = c->d_model, qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    /* qk_bias: q and k carry a bias even when the other linears do not */
    const bool qk_bias = c->bias || c->qk_bias;
    tl_add(&l, "tok_embed.weight", c->vocab_size, d, INIT_NORMAL);
    if (c->pos_encoding == TL_POS_LEARNED) tl_add(&l, "pos_embed.weight", c->max_seq_len, d, INIT_NORMAL);
    const char *groups[] = {"prelude", "block", "coda"};
    const int counts[] = {c->n_prelude, c->n_block, c->n_coda};
    for (int g = 0; g < 3; g++)
        for (int i = 0; i < counts[g]; i++) {
            char p[64];
#define SUB(s) (snprintf(p, sizeof p, "%s.%d.%s", groups[g], i, s), p)
            add_norm(&l, c, SUB("attn_norm"));
            if (c->norm_placement != TL_PLACE_PRE) { /* sandwich / pre_post: the 2nd and 4th norms */
                add_norm(&l, c, SUB("attn_out_norm"));
                add_norm(&l, c, SUB("mlp_out_norm"));
            }
            add_linear(&l, SUB("attn.q"), qd, d, qk_bias);
            add_linear(&l, SUB("attn.k"), kvd, d, qk_bias);
            add_linear(&l, SUB("attn.v"), kvd, d, c->bias);
            add_linear(&l, SUB("attn.o"), d, qd, c->bias);
            add_norm(&l, c, SUB("mlp_norm"));
            if (c->mlp == TL_MLP_SWIGLU) add_linear(&l, SUB("mlp.gate"), c->d_ff, d, c->bias);
            add_linear(&l, SUB("mlp.up"), c->d_ff, d, c->bias);
            add_linear(&l, SUB("mlp.down"), d, c->d_ff, c->bias);
#undef SUB
        }
    if (c->injection == TL_INJECT_CONCAT) add_linear(&l, "inject", d, 2 * d, c->inject_bias);
    /* "state_norm_weights": "final_norm" reuses final_norm: no tensor of its own */
    if (c->state_norm && !c->state_norm_is_final_norm) add_norm(&l, c, "state_norm");
    add_norm(&l, c, "final_norm");
    if (!c->tie_embeddings) tl_add(&l, "lm_head.weight", c->vocab_size, d, INIT_NORMAL);
    if (c->exit_gate) add_linear(&l, "exit_gate", 1, d, true);
    return l;
}

static int64_t tspec_numel(const tspec *t) { return t->rows < 0 ? t->cols : t->rows * t->cols; }
static size_t dtype_size(tl_dtype dt) { return dt == TL_F32 ? 4 : 2; }

static void write_all(FILE *fp, const void *p, size_t n, const char *path) {
    if (n && fwrite(p, 1, n, fp) != n) die(1, "writing %s: %s", path, strerror(errno));
}

/* Writes config.json and model.safetensors into g_tmpdir, streaming the tensors in
   chunks (the whole file is never held in memory). Returns the bytes written. */
static double write_checkpoint(const char *config_text, const tl_config *c, tl_dtype dt, uint64_t seed) {
    FILE *fp = fopen(g_cfg_path, "wb");
    if (!fp) die(1, "cannot create %s: %s", g_cfg_path, strerror(errno));
    write_all(fp, config_text, strlen(config_text), g_cfg_path);
    if (fclose(fp) != 0) die(1, "writing %s: %s", g_cfg_path, strerror(errno));

    tlist l = checkpoint_tensors(c);
    const char *dtname = dt == TL_F32 ? "F32" : dt == TL_F16 ? "F16" : "BF16";
    const size_t es = dtype_size(dt);
    sbuf h = {0};
    sb_printf(&h, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (int i = 0; i < l.n; i++) {
        const tspec *t = &l.v[i];
        uint64_t nb = (uint64_t)tspec_numel(t) * es;
        if (t->rows < 0)
            sb_printf(&h, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld],\"data_offsets\":[%llu,%llu]}",
                      t->name, dtname, (long long)t->cols, (unsigned long long)off,
                      (unsigned long long)(off + nb));
        else
            sb_printf(&h, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld],\"data_offsets\":[%llu,%llu]}",
                      t->name, dtname, (long long)t->rows, (long long)t->cols,
                      (unsigned long long)off, (unsigned long long)(off + nb));
        off += nb;
    }
    sb_printf(&h, "}");
    while (h.len % 8 != 0) sb_printf(&h, " ");

    fp = fopen(g_st_path, "wb");
    if (!fp) die(1, "cannot create %s: %s", g_st_path, strerror(errno));
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)((uint64_t)h.len >> (8 * i));
    write_all(fp, len_le, 8, g_st_path);
    write_all(fp, h.s, h.len, g_st_path);

    enum { CHUNK = 1 << 20 };
    float *vals = malloc(CHUNK * sizeof *vals);
    uint8_t *out = malloc(CHUNK * es);
    if (!vals || !out) die(1, "out of memory");
    rng r = {seed * 0x2545f4914f6cdd1dULL + 12345, 0, 0.0};
    for (int i = 0; i < l.n; i++) {
        const tspec *t = &l.v[i];
        for (int64_t left = tspec_numel(t); left > 0;) {
            size_t n = left < CHUNK ? (size_t)left : (size_t)CHUNK;
            for (size_t k = 0; k < n; k++)
                vals[k] = t->init == INIT_ONES ? 1.0f : t->init == INIT_ZEROS ? 0.0f
                                                      : (float)(0.02 * rng_normal(&r));
            if (dt == TL_F32) {
                memcpy(out, vals, n * 4); /* little-endian host (x86-64, arm64) */
            } else {
                uint16_t *o16 = (uint16_t *)out;
                for (size_t k = 0; k < n; k++)
                    o16[k] = dt == TL_F16 ? tl_f32_to_f16(vals[k]) : f32_to_bf16(vals[k]);
            }
            write_all(fp, out, n * es, g_st_path);
            left -= (int64_t)n;
        }
    }
    if (fclose(fp) != 0) die(1, "writing %s: %s", g_st_path, strerror(errno));
    free(vals);
    free(out);
    free(h.s);
    free(l.v);
    return (double)(8 + h.len + off);
}

/* ---------------------------------------------------------------- weight bytes per token */

/* Stored bytes per weight: q8 / q4 add one f16 scale per TL_QGROUP weights. */
static double weight_bytes(tl_dtype dt) {
    return dt == TL_Q8 ? 1.0 + 2.0 / TL_QGROUP : dt == TL_Q4 ? 0.5 + 2.0 / TL_QGROUP : (double)dtype_size(dt);
}
static double mat_bytes(const tl_matrix *m) {
    return m->data ? (double)m->rows * (double)m->cols * weight_bytes(m->dtype) : 0.0;
}
static double vec_bytes(const float *p, int len) { return p ? 4.0 * len : 0.0; } /* f32 at load */

static double layer_matrix_bytes(const tl_layer *L) {
    return mat_bytes(&L->q) + mat_bytes(&L->k) + mat_bytes(&L->v) + mat_bytes(&L->o) +
           mat_bytes(&L->gate) + mat_bytes(&L->up) + mat_bytes(&L->down);
}
static double layer_vector_bytes(const tl_config *c, const tl_layer *L) {
    const int d = c->d_model, qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    return vec_bytes(L->attn_norm_w, d) + vec_bytes(L->attn_norm_b, d) + vec_bytes(L->q_b, qd) +
           vec_bytes(L->k_b, kvd) + vec_bytes(L->v_b, kvd) + vec_bytes(L->o_b, d) +
           vec_bytes(L->attn_out_norm_w, d) + vec_bytes(L->attn_out_norm_b, d) +
           vec_bytes(L->mlp_out_norm_w, d) + vec_bytes(L->mlp_out_norm_b, d) +
           vec_bytes(L->mlp_norm_w, d) + vec_bytes(L->mlp_norm_b, d) +
           vec_bytes(L->gate_b, c->d_ff) + vec_bytes(L->up_b, c->d_ff) + vec_bytes(L->down_b, d);
}

typedef struct { double layers, inject, lm_head, vectors, embed_rows, total; } byte_breakdown;

/* Bytes of weights one decoded token reads at `loops`: every matrix once per use. */
static byte_breakdown bytes_per_token(const tl_model *m, int loops) {
    const tl_config *c = &m->cfg;
    const tl_weights *w = &m->w;
    byte_breakdown b = {0};
    for (int i = 0; i < c->n_prelude; i++) {
        b.layers += layer_matrix_bytes(&w->prelude[i]);
        b.vectors += layer_vector_bytes(c, &w->prelude[i]);
    }
    for (int i = 0; i < c->n_block; i++) {
        b.layers += loops * layer_matrix_bytes(&w->block[i]);
        b.vectors += loops * layer_vector_bytes(c, &w->block[i]);
    }
    for (int i = 0; i < c->n_coda; i++) {
        b.layers += layer_matrix_bytes(&w->coda[i]);
        b.vectors += layer_vector_bytes(c, &w->coda[i]);
    }
    if (c->injection == TL_INJECT_CONCAT) {
        /* "residual" applies the injection once more before the coda */
        int uses = loops + (c->loop_update == TL_UPDATE_RESIDUAL);
        b.inject = uses * mat_bytes(&w->inject);
        b.vectors += uses * vec_bytes(w->inject_b, c->d_model);
    }
    if (c->state_norm)
        b.vectors += loops * (vec_bytes(w->state_norm_w, c->d_model) + vec_bytes(w->state_norm_b, c->d_model));
    b.vectors += vec_bytes(w->final_norm_w, c->d_model) + vec_bytes(w->final_norm_b, c->d_model);
    b.lm_head = mat_bytes(&w->lm_head);
    b.embed_rows = (double)c->d_model * weight_bytes(w->tok_embed.dtype);
    if (c->pos_encoding == TL_POS_LEARNED)
        b.embed_rows += (double)c->d_model * (double)dtype_size(w->pos_embed.dtype);
    b.total = b.layers + b.inject + b.lm_head + b.vectors + b.embed_rows;
    return b;
}

/* ---------------------------------------------------------------- stream bandwidth */

static int g_stream_avx2;

#if defined(__x86_64__)
__attribute__((target("avx2"))) static double sum_avx2(const float *p, size_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
        a4 = _mm256_add_ps(a4, _mm256_load_ps(p + i + 32));
        a5 = _mm256_add_ps(a5, _mm256_load_ps(p + i + 40));
        a6 = _mm256_add_ps(a6, _mm256_load_ps(p + i + 48));
        a7 = _mm256_add_ps(a7, _mm256_load_ps(p + i + 56));
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    double total = 0.0;
    for (int k = 0; k < 8; k++) total += lanes[k];
    for (; i < n; i++) total += p[i];
    return total;
}

/* The same sum read as four interleaved streams (the quarters of the part, a 64-byte line of
   each in turn, each prefetched 2 KiB ahead), as the decode kernel reads four panels: one
   stream keeps too few lines in flight to show what the memory can deliver to a core, and a
   yardstick slower than the decode would overstate "decode % of stream". */
__attribute__((target("avx2"))) static double sum_avx2_streams(const float *p, size_t n) {
    const size_t len = (n / 4) & ~(size_t)15; /* floats per stream, whole lines */
    __m256 acc[8];
    for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
    for (size_t i = 0; i < len; i += 16)
        for (int s = 0; s < 4; s++) {
            const float *q = p + (size_t)s * len + i;
            _mm_prefetch((const char *)(q + 512), _MM_HINT_T0);
            acc[2 * s] = _mm256_add_ps(acc[2 * s], _mm256_loadu_ps(q));
            acc[2 * s + 1] = _mm256_add_ps(acc[2 * s + 1], _mm256_loadu_ps(q + 8));
        }
    float lanes[8];
    double total = 0.0;
    for (int a = 0; a < 8; a++) {
        _mm256_storeu_ps(lanes, acc[a]);
        for (int k = 0; k < 8; k++) total += lanes[k];
    }
    return total + sum_avx2(p + 4 * len, n - 4 * len);
}
#endif

/* Portable: integer words, so the compiler may vectorise (integer sums reassociate). */
static double sum_plain(const float *p, size_t n) {
    const uint64_t *q = (const uint64_t *)p;
    size_t words = n / 2, i = 0;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    for (; i + 8 <= words; i += 8) {
        a0 += q[i]; a1 += q[i + 1]; a2 += q[i + 2]; a3 += q[i + 3];
        a4 += q[i + 4]; a5 += q[i + 5]; a6 += q[i + 6]; a7 += q[i + 7];
    }
    for (; i < words; i++) a0 += q[i];
    return (double)(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7);
}

typedef struct {
    const float *buf;
    size_t n_floats;
    int n_threads, passes;  /* passes of both kinds together, alternated */
    int streams;  /* 1 or 4 read streams per thread (sum_avx2_streams) this pass */
    pthread_barrier_t start, stop;
    volatile double sink[1024];
} stream_job;

static void stream_part(stream_job *j, int t) {
    size_t per = (j->n_floats / (size_t)j->n_threads) & ~(size_t)63; /* 256-byte aligned parts */
    size_t b = per * (size_t)t, e = t == j->n_threads - 1 ? j->n_floats : b + per;
#if defined(__x86_64__)
    if (g_stream_avx2) {
        j->sink[t] += j->streams == 4 ? sum_avx2_streams(j->buf + b, e - b) : sum_avx2(j->buf + b, e - b);
        return;
    }
#endif
    j->sink[t] += sum_plain(j->buf + b, e - b);
}

typedef struct { stream_job *job; int t; } stream_arg;

static void *stream_worker(void *p) {
    stream_arg *a = p;
    for (int pass = 0; pass < a->job->passes; pass++) {
        pthread_barrier_wait(&a->job->start);
        stream_part(a->job, a->t);
        pthread_barrier_wait(&a->job->stop);
    }
    return NULL;
}

/* Best-of-passes read bandwidth in bytes/s with `threads` threads (the caller is one). */
static double stream_bandwidth(const float *buf, size_t n_floats, int threads, int passes) {
    stream_job *j = calloc(1, sizeof *j);
    pthread_t *tid = calloc((size_t)threads, sizeof *tid);
    stream_arg *args = calloc((size_t)threads, sizeof *args);
    if (!j || !tid || !args) die(1, "out of memory");
    j->buf = buf;
    j->n_floats = n_floats;
    j->n_threads = threads;
    j->passes = 2 * passes; /* `passes` of each kind */
    if (pthread_barrier_init(&j->start, NULL, (unsigned)threads) ||
        pthread_barrier_init(&j->stop, NULL, (unsigned)threads))
        die(1, "stream: cannot create barriers");
    for (int t = 1; t < threads; t++) {
        args[t] = (stream_arg){j, t};
        if (pthread_create(&tid[t], NULL, stream_worker, &args[t]) != 0)
            die(1, "stream: cannot start thread %d of %d", t, threads);
    }
    double best = 1e30; /* the best pass of either kind */
    for (int pass = 0; pass < j->passes; pass++) {
        j->streams = pass % 2 ? 4 : 1; /* set before the barrier the workers pass */
        pthread_barrier_wait(&j->start);
        double t0 = now_s();
        stream_part(j, 0);
        pthread_barrier_wait(&j->stop);
        double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    for (int t = 1; t < threads; t++) pthread_join(tid[t], NULL);
    pthread_barrier_destroy(&j->start);
    pthread_barrier_destroy(&j->stop);
    free(j);
    free(tid);
    free(args);
    return (double)n_floats * sizeof(float) / best;
}

/* The stream buffer, touched once so that no pass pays for page faults. */
static float *alloc_stream_buffer(size_t bytes) {
    float *buf = aligned_alloc(64, bytes);
    if (!buf) die(1, "cannot allocate the %.0f MiB stream buffer (see --stream-mb)", bytes / MIB);
    size_t n = bytes / sizeof(float);
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023) * 0.001f;
    return buf;
}

/* Total L3 bytes: the sum over distinct L3 instances in sysfs (what lscpu reports). */
static double l3_bytes(void) {
    char seen[64][256];
    int n_seen = 0;
    double total = 0.0;
    long cpus = sysconf(_SC_NPROCESSORS_CONF);
    for (long cpu = 0; cpu < cpus && cpu < 4096; cpu++)
        for (int idx = 0; idx < 16; idx++) {
            char path[256], level[32] = "", size[64] = "", shared[256] = "";
            FILE *fp;
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/cache/index%d/level", cpu, idx);
            if (!(fp = fopen(path, "r"))) break;
            if (!fgets(level, sizeof level, fp)) level[0] = '\0';
            fclose(fp);
            if (atoi(level) != 3) continue;
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/cache/index%d/size", cpu, idx);
            if ((fp = fopen(path, "r"))) { if (!fgets(size, sizeof size, fp)) size[0] = '\0'; fclose(fp); }
            snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/cache/index%d/shared_cpu_list", cpu, idx);
            if ((fp = fopen(path, "r"))) { if (!fgets(shared, sizeof shared, fp)) shared[0] = '\0'; fclose(fp); }
            int dup = 0;
            for (int k = 0; k < n_seen; k++) dup |= !strcmp(seen[k], shared);
            if (dup) continue;
            if (n_seen < 64) snprintf(seen[n_seen++], sizeof seen[0], "%s", shared);
            char *end;
            double v = strtod(size, &end);
            double unit = *end == 'K' ? 1024.0 : *end == 'M' ? MIB : *end == 'G' ? MIB * 1024.0 : 1.0;
            total += v * unit;
        }
    return total;
}

/* The L3 size and where it came from: sysfs (what lscpu reports), else the C library's
   CPUID-based figure (virtual machines often hide sysfs cache entries). */
static double l3_size(const char **source) {
    double v = l3_bytes();
    *source = "sysfs";
    if (v > 0.0) return v;
#ifdef _SC_LEVEL3_CACHE_SIZE
    long s = sysconf(_SC_LEVEL3_CACHE_SIZE);
    *source = "cpuid";
    if (s > 0) return (double)s;
#endif
    *source = "unknown";
    return 0.0;
}

/* ---------------------------------------------------------------- matmul work per token */

static double layer_macs(const tl_layer *L) {
    const tl_matrix *ms[] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
    double macs = 0.0;
    for (int i = 0; i < 7; i++)
        if (ms[i]->data) macs += (double)ms[i]->rows * (double)ms[i]->cols;
    return macs;
}

/* Matmul multiply-adds per prefill token: every layer instance, the injection, and the head
   for one row per prompt (the only row whose logits prefill asks for). Attention is not
   counted: the sgemm yardstick covers the matmuls. */
static double prefill_macs_per_token(const tl_model *m, int loops, int prompt_len) {
    const tl_config *c = &m->cfg;
    const tl_weights *w = &m->w;
    double macs = 0.0;
    for (int i = 0; i < c->n_prelude; i++) macs += layer_macs(&w->prelude[i]);
    for (int i = 0; i < c->n_block; i++) macs += loops * layer_macs(&w->block[i]);
    for (int i = 0; i < c->n_coda; i++) macs += layer_macs(&w->coda[i]);
    if (c->injection == TL_INJECT_CONCAT)
        macs += (loops + (c->loop_update == TL_UPDATE_RESIDUAL)) * 2.0 * c->d_model * (double)c->d_model;
    return macs + (double)c->vocab_size * c->d_model / prompt_len;
}

/* ---------------------------------------------------------------- sgemm yardstick */

#ifdef TL_BENCH_OPENBLAS
/* The two OpenBLAS entry points used, declared here so that no cblas.h variant is needed. */
enum { BLAS_ROW_MAJOR = 101, BLAS_NO_TRANS = 111, BLAS_TRANS = 112 };
void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc);
void openblas_set_num_threads(int n);

/* Best-of-passes GFLOP/s of OpenBLAS sgemm, Y[rows][N] = X[rows][K] W^T for the shapes of
   one layer of the model (ms[7]: q k v o gate up down; data NULL = absent), f32, `threads` OpenBLAS threads: the rate
   a prefill chunk of `rows` rows could reach with a tuned GEMM on this machine. */
static double sgemm_gflops(const tl_matrix *ms, int rows, int threads, int passes) {
    openblas_set_num_threads(threads);
    double best = 1e30, flops = 0.0;
    float *x = NULL, *w = NULL, *y = NULL;
    size_t xmax = 0, wmax = 0, ymax = 0;
    for (int i = 0; i < 7; i++) {
        if (!ms[i].data) continue;
        size_t xs = (size_t)rows * ms[i].cols, ws = (size_t)ms[i].rows * ms[i].cols, ys = (size_t)rows * ms[i].rows;
        if (xs > xmax) xmax = xs;
        if (ws > wmax) wmax = ws;
        if (ys > ymax) ymax = ys;
        flops += 2.0 * (double)ws * rows;
    }
    x = malloc(xmax * sizeof *x);
    w = malloc(wmax * sizeof *w);
    y = malloc(ymax * sizeof *y);
    if (!x || !w || !y) die(1, "out of memory");
    for (size_t i = 0; i < xmax; i++) x[i] = (float)((i * 7) % 13) * 0.01f;
    for (size_t i = 0; i < wmax; i++) w[i] = (float)((i * 5) % 11) * 0.01f;
    /* Pass 0 warms up (OpenBLAS starts its threads); then at least `passes` passes and at
       least half a second, so that a short GEMM is not judged on one scheduler slice. */
    double start = now_s();
    for (int pass = 0; pass <= passes || now_s() - start < 0.5; pass++) {
        double t0 = now_s();
        for (int i = 0; i < 7; i++)
            if (ms[i].data)
                cblas_sgemm(BLAS_ROW_MAJOR, BLAS_NO_TRANS, BLAS_TRANS, rows, ms[i].rows, ms[i].cols, 1.0f,
                            x, ms[i].cols, w, ms[i].cols, 0.0f, y, ms[i].rows);
        double dt = now_s() - t0;
        if (pass > 0 && dt < best) best = dt;
    }
    free(x);
    free(w);
    free(y);
    return flops / best / 1e9;
}
#endif

/* The loop depth to run at; exits when the flags do not fit the model. */
static int checked_loops(const options *o, const tl_config *c) {
    int loops = o->loops ? o->loops : c->default_loops;
    if (loops < 1 || loops > c->max_loops)
        die(2, "--loops %d is out of range [1, max_loops = %d]", loops, c->max_loops);
    if ((long)o->prompt_len + o->decode > c->max_seq_len)
        die(2, "--prompt-len %d + --decode %d exceed max_seq_len = %d", o->prompt_len, o->decode,
            c->max_seq_len);
    return loops;
}

/* ---------------------------------------------------------------- model timing */

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

typedef struct {
    const tl_model *m;
    tl_kv_cache *cache;
    tl_workspace ws;
    const int32_t *prompt;
    int32_t *positions; /* 0 .. prompt_len + decode - 1 */
    float *logits;
    int prompt_len, decode, loops, chunk;
} bench_state;

static void one_run(bench_state *b, double *prefill_s, double *decode_s) {
    const tl_model *m = b->m;
    tl_status st = tl_kv_truncate(b->cache, 0);
    double t0 = now_s();
    for (int start = 0; st == TL_OK && start < b->prompt_len; start += b->chunk) {
        int len = b->prompt_len - start < b->chunk ? b->prompt_len - start : b->chunk;
        int last = start + len == b->prompt_len;
        st = tl_forward_run(m, b->cache, &b->ws, b->prompt + start, b->positions + start, len, NULL,
                            b->loops, last ? len - 1 : len, last ? b->logits : NULL);
    }
    double t1 = now_s();
    int32_t tok = argmax(b->logits, m->cfg.vocab_size);
    for (int i = 0; st == TL_OK && i < b->decode; i++) {
        st = tl_forward_run(m, b->cache, &b->ws, &tok, b->positions + b->prompt_len + i, 1, NULL,
                            b->loops, 0, b->logits);
        tok = argmax(b->logits, m->cfg.vocab_size);
    }
    double t2 = now_s();
    if (st != TL_OK) die(1, "forward failed: %s: %s", tl_status_name(st), tl_last_error());
    *prefill_s = t1 - t0;
    *decode_s = t2 - t1;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

typedef struct {
    int threads;
    double prefill_tps, decode_tps, bytes_per_token, decode_gbs, stream_gbs, pct;
    double prefill_gflops, sgemm_gflops, sgemm_pct; /* sgemm: 0 without --sgemm */
} result_row;

/* ---------------------------------------------------------------- memory */

/* A "Vm...:" line of /proc/self/status (Linux) in bytes, or 0 when unknown: VmHWM is the
   peak resident set, VmRSS the current one. */
static double proc_status_bytes(const char *key) {
    FILE *fp = fopen("/proc/self/status", "r");
    if (!fp) return 0.0;
    char line[256];
    double kb = 0.0;
    size_t n = strlen(key);
    while (fgets(line, sizeof line, fp))
        if (!strncmp(line, key, n) && line[n] == ':') kb = strtod(line + n + 1, NULL);
    fclose(fp);
    return kb * 1024.0;
}

/* ---------------------------------------------------------------- config checks */

/* The parser's warnings (unknown fields: a misspelt option silently keeps its default) go to
   stderr. A preset may only draw the one about its provenance tag: any other is a bug in
   k_presets, which the preset ctest catches. */
static void check_warnings(const options *o, const tl_config *c) {
    for (const char *line = c->warnings; *line;) {
        const char *end = strchr(line, '\n');
        int len = end ? (int)(end - line) : (int)strlen(line);
        int tag = strstr(line, "\"tinyloop_bench_preset\"") && strstr(line, "\"tinyloop_bench_preset\"") < line + len;
        if (o->preset && !tag) die(1, "preset %s: %.*s", o->preset, len, line);
        if (!tag) fprintf(stderr, "tinyloop-bench: warning: %.*s\n", len, line);
        line += len + (end != NULL);
    }
}

/* The config.json, then (as a JSON-free trailer on stderr) what the writer would write. */
static void print_config(const char *config_text, const tl_config *c, tl_dtype dt) {
    tlist l = checkpoint_tensors(c);
    double params = 0.0;
    for (int i = 0; i < l.n; i++) params += (double)tspec_numel(&l.v[i]);
    fputs(config_text, stdout);
    fprintf(stderr, "%d tensors, %.4f B parameters, %.3f GB in %s (head dim %d, %d layer applications at "
                    "default_loops %d)\n",
            l.n, params / 1e9, params * (double)dtype_size(dt) / GB,
            dt == TL_F32 ? "f32" : dt == TL_F16 ? "f16" : "bf16", c->head_dim,
            c->n_prelude + c->n_block * c->default_loops + c->n_coda, c->default_loops);
    free(l.v);
}

/* The general options (SPEC §1) that differ from the defaults, for the header. */
static void describe_options(const tl_config *c, bool mapped, char *buf, size_t len) {
    static const char *const placements[] = {"pre", "sandwich", "pre_post"};
    buf[0] = '\0';
#define ADD(...) snprintf(buf + strlen(buf), len - strlen(buf), __VA_ARGS__)
    if (c->norm_placement != TL_PLACE_PRE) ADD(", %s norms", placements[c->norm_placement]);
    if (c->rope_pairing == TL_ROPE_INTERLEAVED) ADD(", interleaved rope");
    if (c->qk_bias && !c->bias) ADD(", qk bias");
    if (c->embed_scale != 1.0f) ADD(", embed scale %g", (double)c->embed_scale);
    if (c->injection == TL_INJECT_CONCAT) ADD(", adapter [%s]", c->inject_embedding_first ? "e ; s" : "s ; e");
    if (c->state_norm) ADD(", state norm%s", c->state_norm_is_final_norm ? " = final norm" : "");
    if (c->final_norm_before_coda) ADD(", final norm before coda");
    if (!c->final_norm_at_head) ADD(", no final norm at head");
    if (c->state_init == TL_STATE_TRUNCATED_NORMAL) ADD(", random initial state (std %g)", (double)c->state_init_std);
    if (c->exit_gate) ADD(", exit gate");
    if (mapped) ADD(", weights mapped in place (--mmap)");
#undef ADD
    if (!buf[0]) snprintf(buf, len, ", none");
}

/* ---------------------------------------------------------------- main */

int main(int argc, char **argv) {
    options o;
    parse_args(argc, argv, &o);
    g_keep = o.keep;
    atexit(remove_tmpdir);
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);
    signal(SIGHUP, on_signal);
    signal(SIGPIPE, on_signal); /* (its reader gone, | head: the temporary checkpoint went with it) */

    /* a path it cannot write fails before the run, but the file is written (emptied) only with
       the results (opened to write here, a run refused afterwards left it empty) */
    if (o.csv) {
        FILE *probe = fopen(o.csv, "a");
        if (!probe) die(1, "--csv: cannot open %s: %s", o.csv, strerror(errno));
        fclose(probe);
    }

    /* ---- the checkpoint */
    const char *model_dir = o.model_dir;
    const char *label = o.model_dir ? o.model_dir : o.preset ? o.preset : o.config_file;
    if (!model_dir) {
        char *config_text = o.preset ? preset_config_json(o.preset) : read_file_text(o.config_file);
        tl_config cfg;
        if (tl_config_parse(config_text, &cfg) != TL_OK)
            die(1, "%s: %s", o.preset ? "preset" : o.config_file, tl_last_error());
        check_warnings(&o, &cfg);
        if (o.print_config) {
            print_config(config_text, &cfg, o.dtype);
            free(config_text);
            return bench_output_status("tinyloop-bench");
        }
        (void)checked_loops(&o, &cfg); /* before writing hundreds of MB */
        const char *parent = o.tmp_parent ? o.tmp_parent : getenv("TMPDIR");
        if (!parent || !*parent) parent = "/tmp";
        char templ[4096];
        snprintf(templ, sizeof templ, "%s/tinyloop-bench-XXXXXX", parent);
        if (!mkdtemp(templ)) die(1, "cannot create a temp dir under %s: %s", parent, strerror(errno));
        snprintf(g_tmpdir, sizeof g_tmpdir, "%s", templ);
        snprintf(g_cfg_path, sizeof g_cfg_path, "%s/config.json", g_tmpdir);
        snprintf(g_st_path, sizeof g_st_path, "%s/model.safetensors", g_tmpdir);
        const char *dtn = o.dtype == TL_F32 ? "f32" : o.dtype == TL_F16 ? "f16" : "bf16";
        fprintf(stderr, "writing a random %s checkpoint (%s) to %s ...\n", label, dtn, g_tmpdir);
        double t0 = now_s();
        double bytes = write_checkpoint(config_text, &cfg, o.dtype, o.seed);
        fprintf(stderr, "  %.1f MB in %.1f s\n", bytes / MB, now_s() - t0);
        free(config_text);
        model_dir = g_tmpdir;
    }

    /* ---- the stream buffer (allocated and touched once, reused for every thread count) */
    const char *l3_source;
    double l3 = l3_size(&l3_source);
    size_t stream_bytes;
    int stream_capped = 0;
    if (o.stream_mb > 0) stream_bytes = (size_t)o.stream_mb << 20;
    else {
        double want = 8.0 * l3 > 1024.0 * MIB ? 8.0 * l3 : 1024.0 * MIB;
        /* Never more than a quarter of the memory: the model is loaded at the same time. */
        double cap = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE) / 4.0;
        if (cap > 0.0 && want > cap) { want = cap; stream_capped = 1; }
        stream_bytes = (size_t)ceil(want / MIB) << 20;
    }
    /* Allocated after the first thread count's model is freed, so that the peak RSS printed
       for the model is the model's alone (and the two never add up for one thread count). */
    float *stream_buf = NULL;
#if defined(__x86_64__)
    const char *isa_env = getenv("TINYLOOP_ISA");
    g_stream_avx2 = __builtin_cpu_supports("avx2") && !(isa_env && !strcmp(isa_env, "generic"));
#endif

    /* ---- per thread count */
    result_row rows[MAX_THREAD_COUNTS];
    byte_breakdown bb = {0};
    int loops = 0;
    struct tl_model_info info0;
    memset(&info0, 0, sizeof info0);
    double kv_bytes = 0.0, mean_ctx = 0.0, prefill_macs = 0.0;
    tl_matrix layer_shapes[7]; /* one layer's matrices (shapes only) for the sgemm yardstick */
    memset(layer_shapes, 0, sizeof layer_shapes);
    for (int ti = 0; ti < o.n_threads; ti++) {
        tl_load_options lo;
        tl_load_options_init(&lo);
        lo.n_threads = o.threads[ti];
        lo.backend = o.backend;
        lo.mmap_weights = o.mmap;
        tl_model *m = NULL;
        tl_status st = tl_model_load(model_dir, &lo, &m);
        if (st != TL_OK) die(1, "loading %s: %s: %s", model_dir, tl_status_name(st), tl_last_error());
        const tl_config *c = &m->cfg;
        loops = checked_loops(&o, c);
        if (ti == 0) {
            info0 = *tl_model_info(m);
            bb = bytes_per_token(m, loops);
            prefill_macs = prefill_macs_per_token(m, loops, o.prompt_len);
            const tl_layer *L0 = c->n_block ? &m->w.block[0] : &m->w.prelude[0];
            const tl_matrix *l0[7] = {&L0->q, &L0->k, &L0->v, &L0->o, &L0->gate, &L0->up, &L0->down};
            for (int i = 0; i < 7; i++) layer_shapes[i] = *l0[i];
            int instances = c->n_prelude + c->n_block * loops + c->n_coda;
            mean_ctx = o.prompt_len + (o.decode + 1) / 2.0;
            /* (the cache's own element: TINYLOOP_KV_TYPE=f16 halves it; it read f32 always) */
            const bool kv_f16 = !strcmp(info0.kv_type, "f16");
            kv_bytes = instances * mean_ctx * 2.0 * c->n_kv_heads * c->head_dim * (kv_f16 ? 2.0 : 4.0);
            printf("model      %s (%s%s)\n", label, o.model_dir ? "" : "random, ", info0.weight_dtype);
            if (!o.model_dir) printf("checkpoint %s%s\n", model_dir, o.keep ? " (kept)" : " (removed at exit)");
            printf("shape      vocab %d, d_model %d, heads %d/%d, d_ff %d, layers %d + %d x loops + %d, "
                   "%s, %s, %s, injection %s%s\n",
                   c->vocab_size, c->d_model, c->n_heads, c->n_kv_heads, c->d_ff, c->n_prelude,
                   c->n_block, c->n_coda, info0.norm, info0.mlp, info0.pos_encoding, info0.injection,
                   c->tie_embeddings ? ", tied head" : "");
            char opts[512];
            describe_options(c, o.mmap, opts, sizeof opts);
            printf("options    %s\n", opts + 2);
            const tl_kernels *kernels = tl_cpu_kernels();
#if defined(__x86_64__)
            /* (the AVX-512 kernels' choices: TINYLOOP_F16_HALVES, TINYLOOP_PAIR_TILES) */
            const bool halves = tl_cpu_f16_halves(kernels);
            const bool one_panel = tl_cpu_one_panel_rows(kernels);
#else
            const bool halves = false, one_panel = false;
#endif
            const char *choices = halves && one_panel ? " (one f16 row in 256-bit halves; several 16-bit rows in one-panel tiles)"
                                  : halves            ? " (one f16 row in 256-bit halves)"
                                  : one_panel         ? " (several 16-bit rows in one-panel tiles)"
                                                      : "";
            printf("size       %.1f M params, %.1f MB of weights; CPU kernels %s%s\n", info0.n_params / 1e6,
                   info0.weight_bytes / MB, kernels->isa, choices);
            printf("run        loops %d (max %d), prompt %d tokens in chunks of %d, decode %d tokens, "
                   "median of %d runs after 1 warm-up\n",
                   loops, c->max_loops, o.prompt_len, o.chunk, o.decode, o.repeat);
            printf("bytes/tok  %.2f MB = layer matrices %.2f + inject %.2f + lm_head %.2f + "
                   "norm/bias vectors %.3f + embedding rows %.3f\n",
                   bb.total / MB, bb.layers / MB, bb.inject / MB, bb.lm_head / MB, bb.vectors / MB,
                   bb.embed_rows / MB);
            printf("kv reads   %.2f MB/token at mean context %.0f (%s K+V, not counted in bytes/tok)\n",
                   kv_bytes / MB, mean_ctx, kv_f16 ? "f16" : "f32");
            printf("L3         %.1f MiB (%s)\n", l3 / MIB, l3_source);
            printf("stream     %.0f MiB buffer (%.1f x L3), best of %d passes, %s\n",
                   stream_bytes / MIB, l3 > 0.0 ? stream_bytes / l3 : 0.0, 2 * o.stream_passes,
                   g_stream_avx2 ? "avx2 kernel (one and four read streams a thread, alternated)" : "plain C kernel");
            printf("prefill    %.1f MFLOP of matmuls per token (attention not counted)\n",
                   2.0 * prefill_macs / 1e6);
            if (l3 > 0.0 && (double)info0.weight_bytes < 4.0 * l3)
                printf("WARNING    the weights (%.1f MB) are under 4 x L3 (%.0f MiB): decode may read part of "
                       "them from the cache, so decode GB/s and %% of stream overstate the memory bandwidth\n",
                       info0.weight_bytes / MB, 4.0 * l3 / MIB);
            if (stream_capped)
                printf("note       the stream buffer is capped at a quarter of the memory, under 8 x L3\n");
            if (l3 > 0.0 && stream_bytes < 8.0 * l3)
                printf("note       the stream buffer is under 8 x L3: stream GB/s partly measures the cache\n");
            if (l3 <= 0.0)
                printf("note       the L3 size is unknown: the buffer cannot be checked against it\n");
            printf("\n");
            fflush(stdout);
        }

        bench_state b = {0};
        b.m = m;
        b.prompt_len = o.prompt_len;
        b.decode = o.decode;
        b.loops = loops;
        b.chunk = o.chunk;
        int total = o.prompt_len + o.decode;
        int32_t *prompt = malloc((size_t)o.prompt_len * sizeof *prompt);
        b.positions = malloc((size_t)total * sizeof *b.positions);
        b.logits = malloc((size_t)c->vocab_size * sizeof *b.logits);
        if (!prompt || !b.positions || !b.logits) die(1, "out of memory");
        rng r = {o.seed ^ 0x5eedULL, 0, 0.0};
        for (int i = 0; i < o.prompt_len; i++) prompt[i] = (int32_t)(rng_next(&r) % (uint64_t)c->vocab_size);
        for (int i = 0; i < total; i++) b.positions[i] = i;
        b.prompt = prompt;
        /* A random initial state is drawn as generation draws it (session.c: a nonzero seed;
           0 would mean the zero state), so that its cost is in the figures. */
        if (c->state_init == TL_STATE_TRUNCATED_NORMAL) b.ws.state_seed = (o.seed << 1) | 1u;
        st = tl_kv_cache_new_for(m, total, 0, o.chunk, &b.cache);
        if (st != TL_OK) die(1, "kv cache: %s", tl_last_error());

        double warm_p, warm_d;
        one_run(&b, &warm_p, &warm_d);
        double *pre = malloc((size_t)o.repeat * sizeof *pre), *dec = malloc((size_t)o.repeat * sizeof *dec);
        if (!pre || !dec) die(1, "out of memory");
        for (int rep = 0; rep < o.repeat; rep++) one_run(&b, &pre[rep], &dec[rep]);

        /* Resident now: the weights as loaded (the file mapping is gone once they are copied),
           the KV cache and the workspace. */
        double rss_after_runs = proc_status_bytes("VmRSS");
        result_row *row = &rows[ti];
        row->threads = tl_model_info(m)->n_threads;
        row->prefill_tps = o.prompt_len / median(pre, o.repeat);
        row->decode_tps = o.decode / median(dec, o.repeat);
        free(pre);
        free(dec);
        free(prompt);
        free(b.positions);
        free(b.logits);
        tl_workspace_release(&b.ws);
        tl_kv_cache_free(b.cache);
        tl_model_free(m);
        if (ti == 0) {
            /* The process's peak so far: the load (file mapping and packed copy), the KV cache
               and the workspace of the first thread count, before any stream buffer. */
            double hwm = proc_status_bytes("VmHWM");
            if (hwm > 0.0)
                printf("memory     peak RSS %.2f GB (load + runs at %d threads); %.2f GB resident after the runs "
                       "(weights, KV cache, workspace)\n", hwm / GB, o.threads[0], rss_after_runs / GB);
            else printf("memory     RSS unknown (no /proc/self/status)\n");
            fflush(stdout);
        }

        row->bytes_per_token = bb.total;
        row->decode_gbs = bb.total * row->decode_tps / GB;
        if (!stream_buf) stream_buf = alloc_stream_buffer(stream_bytes);
        row->stream_gbs = stream_bandwidth(stream_buf, stream_bytes / sizeof(float), o.threads[ti],
                                           o.stream_passes) / GB;
        row->pct = 100.0 * row->decode_gbs / row->stream_gbs;
        row->prefill_gflops = 2.0 * prefill_macs * row->prefill_tps / 1e9;
#ifdef TL_BENCH_OPENBLAS
        if (o.sgemm) {
            row->sgemm_gflops = sgemm_gflops(layer_shapes, o.chunk < o.prompt_len ? o.chunk : o.prompt_len,
                                             o.threads[ti], 3);
            row->sgemm_pct = 100.0 * row->prefill_gflops / row->sgemm_gflops;
        }
#endif
        fprintf(stderr, "  threads %d done\n", row->threads);
    }
    free(stream_buf);

    /* ---- the table */
    printf("%7s | %13s | %13s | %12s | %18s | %11s | %11s | %18s", "threads", "prefill tok/s",
           "prefill GF/s", "decode tok/s", "weight bytes/token", "decode GB/s", "stream GB/s",
           "decode % of stream");
    if (o.sgemm) printf(" | %12s | %17s", "sgemm GF/s", "prefill % of sgemm");
    printf("\n--------+---------------+---------------+--------------+--------------------+-------------+-------------+-------------------");
    if (o.sgemm) printf("+--------------+-------------------");
    printf("\n");
    for (int i = 0; i < o.n_threads; i++) {
        const result_row *r = &rows[i];
        char bytes[32];
        snprintf(bytes, sizeof bytes, "%.2f MB", r->bytes_per_token / MB);
        /* tokens/s with 3 significant digits at least: Huginn at 32 loops decodes well under
           one token a second on a small machine */
        printf("%7d | %13.*f | %13.1f | %12.*f | %18s | %11.2f | %11.2f | %17.1f%%", r->threads,
               r->prefill_tps < 10.0 ? 3 : 1, r->prefill_tps, r->prefill_gflops,
               r->decode_tps < 1.0 ? 4 : 2, r->decode_tps, bytes, r->decode_gbs, r->stream_gbs, r->pct);
        if (o.sgemm) printf(" | %12.1f | %16.1f%%", r->sgemm_gflops, r->sgemm_pct);
        printf("\n");
    }

    if (o.csv) {
        /* --csv /dev/stdout into a file: after the table, not over it */
        struct stat csv_stat, out_stat;
        fflush(stdout);
        const bool is_stdout = stat(o.csv, &csv_stat) == 0 && fstat(1, &out_stat) == 0 && csv_stat.st_dev == out_stat.st_dev &&
                               csv_stat.st_ino == out_stat.st_ino;
        FILE *csv = fopen(o.csv, is_stdout ? "a" : "w");
        if (!csv) die(1, "--csv: cannot open %s: %s", o.csv, strerror(errno));
        fprintf(csv, "model,dtype,loops,prompt_len,decode,threads,prefill_tok_s,decode_tok_s,"
                     "weight_bytes_per_token,decode_gb_s,stream_gb_s,decode_pct_of_stream,"
                     "prefill_gflop_s,sgemm_gflop_s,prefill_pct_of_sgemm,l3_bytes\n");
        for (int i = 0; i < o.n_threads; i++) {
            const result_row *r = &rows[i];
            fputc('"', csv); /* the label quoted, its quotes doubled (RFC 4180) */
            for (const char *ch = label; *ch; ch++) {
                if (*ch == '"') fputc('"', csv);
                fputc(*ch, csv);
            }
            fprintf(csv, "\",%s,%d,%d,%d,%d,%.3f,%.3f,%.0f,%.4f,%.4f,%.2f,%.3f,%.3f,%.2f,%.0f\n",
                    info0.weight_dtype, loops, o.prompt_len, o.decode, r->threads, r->prefill_tps,
                    r->decode_tps, r->bytes_per_token, r->decode_gbs, r->stream_gbs, r->pct,
                    r->prefill_gflops, r->sgemm_gflops, r->sgemm_pct, l3);
        }
        if (fclose(csv) != 0) die(1, "--csv: writing %s failed", o.csv);
    }
    return bench_output_status("tinyloop-bench");
}

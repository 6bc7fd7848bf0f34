/* test_state_file.c: saved states as bytes and files. A state written, read back and
 * resumed continues exactly as the uninterrupted session (memcmp of tokens and text, over
 * greedy, seeded sampling, a cache window, early exit, stop rules, a state saved before its
 * prompt was forwarded, and through a file); the bytes are a function of the state (written
 * twice, or read and written again, they are equal). A state is refused by another model
 * (another checkpoint of the same shapes included) and by another KV type; a damaged,
 * truncated or malformed state is refused with a clear error, never read; the fuzzer's seeds
 * are states of the test checkpoint. */
#define _GNU_SOURCE /* mkdtemp */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "session.h"

static tl_model *load(const char *dir, tl_kv_type kv_type) {
    tl_load_options o;
    tl_load_options_init(&o);
    o.kv_type = kv_type;
    tl_model *m = NULL;
    if (tl_model_load(dir, &o, &m) != TL_OK) printf("load %s: %s\n", dir, tl_last_error());
    return m;
}

static void run(tl_session *s, int steps) {
    int32_t token;
    tl_stop_reason stop = TL_STOP_NONE;
    for (int i = 0; i < steps && !s->finished; i++)
        if (tl_session_step(s, &token, &stop) != TL_OK) return;
}

static bool same_run(const tl_session *a, const tl_session *b) {
    return a->n_tokens == b->n_tokens && memcmp(a->tokens, b->tokens, (size_t)a->n_tokens * sizeof(int32_t)) == 0 &&
           a->text_len == b->text_len && (!a->text_len || memcmp(a->text, b->text, a->text_len) == 0) &&
           a->stats.stop_reason == b->stats.stop_reason &&
           memcmp(a->stats.depth_histogram, b->stats.depth_histogram, sizeof a->stats.depth_histogram) == 0;
}

/* The bytes of session s's state. */
static void *state_bytes(const tl_session *s, size_t *len) {
    tl_session_state *state = NULL;
    void *bytes = NULL;
    *len = 0;
    if (tl_session_save(s, &state) == TL_OK) tl_session_state_to_bytes(state, &bytes, len);
    tl_session_state_free(state);
    return bytes;
}

/* A session of m resumed from bytes (NULL, with the error in tl_last_error, when refused). */
static tl_session *resume_bytes(const tl_model *m, const void *bytes, size_t len) {
    tl_session_state *state = NULL;
    tl_session *s = NULL;
    if (tl_session_state_from_bytes(m, bytes, len, &state) == TL_OK) tl_session_resume(m, state, NULL, &s);
    tl_session_state_free(state);
    return s;
}

/* Recomputes the trailing checksum of a state edited on purpose (the malformed-field cases:
   the checksum alone would refuse them before any field is read). */
static void fix_checksum(uint8_t *bytes, size_t len) {
    tl_hasher hash;
    tl_hash_init(&hash);
    tl_hash_add(&hash, bytes, len - 8);
    const uint64_t sum = tl_hash_final(&hash);
    memcpy(bytes + len - 8, &sum, 8);
}

typedef struct scenario {
    const char *name;
    int save_after; /* steps before the save */
    void (*setup)(tl_generate_config *cfg);
} scenario;

static void greedy(tl_generate_config *c) { (void)c; }
static void sampled(tl_generate_config *c) { c->temperature = 0.9f; c->top_k = 30; c->top_p = 0.95f; c->sample_seed = 11; }
static void windowed(tl_generate_config *c) {
    sampled(c);
    c->cache_window = 8;
    c->repetition_penalty = 1.3f;
    c->penalty_window = 5;
}
static void early_exit(tl_generate_config *c) {
    c->loops = 4;
    c->early_exit_patience = 1;
    c->early_exit_min_L = 1;
    c->early_exit_criterion = TL_EXIT_LATENT_DIFF;
    c->early_exit_threshold = 0.5f;
}
static const char *const STOP_STRINGS[] = {"zzqx", "\n\n\n\n"};
static const int32_t STOP_SEQ[] = {7, 7, 7};
static const tl_token_seq STOP_SEQS[] = {{STOP_SEQ, 3}};
static void stop_rules(tl_generate_config *c) {
    sampled(c);
    c->stop_strings = STOP_STRINGS;
    c->n_stop_strings = 2;
    c->stop_sequences = STOP_SEQS;
    c->n_stop_sequences = 1;
    c->ignore_eos = 0;
}

static void roundtrips(const tl_model *m, const char *tmp_dir) {
    const int32_t prompt[7] = {3, 14, 15, 92, 65, 35, 89};
    const scenario scenarios[] = {
        {"greedy", 20, greedy},         {"sampled", 33, sampled},      {"window", 25, windowed},
        {"early exit", 17, early_exit}, {"stop rules", 9, stop_rules}, {"before the prompt", 0, sampled},
    };
    for (size_t k = 0; k < sizeof scenarios / sizeof *scenarios; k++) {
        const scenario *sc = &scenarios[k];
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 48;
        cfg.ignore_eos = 1;
        sc->setup(&cfg);
        tl_session *whole = NULL, *parent = NULL;
        tl_session_new(m, prompt, 7, &cfg, &whole);
        tl_session_new(m, prompt, 7, &cfg, &parent);
        run(whole, 1000);
        run(parent, sc->save_after);
        CHECK(!parent->finished, "%s: the parent finished before its save", sc->name);
        size_t len = 0, again_len = 0;
        void *bytes = state_bytes(parent, &len);
        void *again = state_bytes(parent, &again_len);
        CHECK(bytes && again && len == again_len && memcmp(bytes, again, len) == 0,
              "%s: the same state written twice differs (%zu, %zu bytes): %s", sc->name, len, again_len, tl_last_error());
        tl_session_free(parent); /* the state outlives its session and its pages' owner */

        tl_session *resumed = resume_bytes(m, bytes, len);
        CHECK(resumed != NULL, "%s: resume: %s", sc->name, tl_last_error());
        if (resumed) {
            size_t reread_len = 0;
            void *reread = state_bytes(resumed, &reread_len);
            CHECK(reread && reread_len == len && memcmp(reread, bytes, len) == 0,
                  "%s: a state read and written again differs", sc->name);
            tl_free(reread);
            CHECK(resumed->stats.tokens_emitted == sc->save_after, "%s: %d tokens emitted before the save, stats say %d",
                  sc->name, sc->save_after, resumed->stats.tokens_emitted);
            run(resumed, 1000);
            CHECK(same_run(resumed, whole), "%s: the resumed session must continue as the uninterrupted run "
                  "(%d vs %d tokens)", sc->name, resumed->n_tokens, whole->n_tokens);
            tl_session_free(resumed);
        }

        /* The same through a file, twice from one state (a state resumes any number of times). */
        char path[512];
        snprintf(path, sizeof path, "%s/state.tls", tmp_dir);
        tl_session_state *state = NULL, *from_file = NULL;
        CHECK(tl_session_state_from_bytes(m, bytes, len, &state) == TL_OK, "%s: %s", sc->name, tl_last_error());
        CHECK(tl_session_state_write(state, path) == TL_OK, "%s: write: %s", sc->name, tl_last_error());
        CHECK(tl_session_state_read(m, path, &from_file) == TL_OK, "%s: read: %s", sc->name, tl_last_error());
        for (int twice = 0; from_file && twice < 2; twice++) {
            tl_session *s = NULL;
            CHECK(tl_session_resume(m, from_file, NULL, &s) == TL_OK, "%s: %s", sc->name, tl_last_error());
            if (s) run(s, 1000);
            CHECK(s && same_run(s, whole), "%s: resumed from a file (%d), the run differs", sc->name, twice);
            tl_session_free(s);
        }
        int n_tokens = 0, prompt_len = 0;
        const int32_t *tokens = tl_session_state_tokens(from_file, &n_tokens, &prompt_len);
        CHECK(tokens && prompt_len == 7 && n_tokens == 7 + sc->save_after && memcmp(tokens, whole->tokens, (size_t)n_tokens * 4) == 0,
              "%s: the state's tokens (%d of which %d prompt)", sc->name, n_tokens, prompt_len);
        tl_session_state_free(state);
        tl_session_state_free(from_file);
        unlink(path);
        tl_free(bytes);
        tl_free(again);
        tl_session_free(whole);
    }
}

/* A copy of checkpoint `dir` in `out` whose first weight has one mantissa bit flipped:
   the same shapes and config, other weights. */
static bool copy_with_other_weight(const char *dir, const char *out) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cp '%s/config.json' '%s/model.safetensors' '%s/'", dir, dir, out);
    if (system(cmd) != 0) return false;
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    FILE *f = fopen(path, "r+b");
    if (!f) return false;
    uint8_t header[8];
    bool ok = fread(header, 1, 8, f) == 8;
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; i--) header_len = (header_len << 8) | header[i];
    uint8_t byte = 0;
    ok = ok && fseek(f, (long)(8 + header_len), SEEK_SET) == 0 && fread(&byte, 1, 1, f) == 1;
    byte ^= 1; /* the lowest mantissa bit of the first element: a finite weight stays finite */
    ok = ok && fseek(f, (long)(8 + header_len), SEEK_SET) == 0 && fwrite(&byte, 1, 1, f) == 1;
    return fclose(f) == 0 && ok;
}

/* Where refusals' state (4 prompt tokens, 5 emitted, no grammar) holds the grammar
   fingerprint: after the 212 bytes up to its tokens, the 9 tokens, the RNG, prompt_done and
   compiled_grammar. */
#define GRAMMAR_FINGERPRINT_AT (212 + 4 * 9 + 32 + 2)

static void refusals(const tl_model *m, const char *dir, const char *tmp_dir, const char *other_dir) {
    const int32_t prompt[4] = {5, 6, 7, 8};
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 20;
    cfg.ignore_eos = 1;
    tl_session *s = NULL;
    tl_session_new(m, prompt, 4, &cfg, &s);
    run(s, 5);
    size_t len = 0;
    uint8_t *bytes = state_bytes(s, &len);
    CHECK(bytes && len > 100, "state bytes: %s", tl_last_error());
    if (!bytes) return;
    tl_session_state *state = NULL;
    tl_session_state_from_bytes(m, bytes, len, &state);

    /* NULLs and bad paths */
    void *out_bytes;
    size_t out_len;
    tl_session_state *out = NULL;
    CHECK_ERROR(tl_session_state_to_bytes(NULL, &out_bytes, &out_len), TL_ERR_INVALID_ARGUMENT, "state must not be NULL");
    CHECK_ERROR(tl_session_state_to_bytes(state, NULL, &out_len), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
    CHECK_ERROR(tl_session_state_from_bytes(NULL, bytes, len, &out), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
    CHECK_ERROR(tl_session_state_from_bytes(m, NULL, 10, &out), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
    CHECK_ERROR(tl_session_state_write(state, ""), TL_ERR_INVALID_ARGUMENT, "path must not be empty");
    CHECK_ERROR(tl_session_state_write(state, "/nonexistent-dir/x/state.tls"), TL_ERR_IO, "/nonexistent-dir/x/state.tls");
    CHECK_ERROR(tl_session_state_read(m, "/nonexistent-dir/state.tls", &out), TL_ERR_IO, "/nonexistent-dir/state.tls");
    CHECK_ERROR(tl_session_state_read(m, tmp_dir, &out), TL_ERR_IO, tmp_dir); /* a directory */
    /* What is at the path must be a file (or a link, replaced): renamed over a FIFO or a
       device, the state took its place (as root, /dev/full became a regular file) and the
       write said TL_OK. */
    char fifo_path[512];
    snprintf(fifo_path, sizeof fifo_path, "%s/fifo.tls", tmp_dir);
    unlink(fifo_path);
    CHECK(mkfifo(fifo_path, 0600) == 0, "mkfifo %s", fifo_path);
    CHECK_ERROR(tl_session_state_write(state, fifo_path), TL_ERR_IO, "is a FIFO, not a regular file: it is not replaced");
    struct stat fifo_sb;
    CHECK(lstat(fifo_path, &fifo_sb) == 0 && S_ISFIFO(fifo_sb.st_mode), "the FIFO is still there");
    unlink(fifo_path);
    CHECK_ERROR(tl_session_state_write(state, tmp_dir), TL_ERR_IO, "is a directory, not a regular file");
    /* A state file is created like any other file: 0666 less the umask (and it replaces an
       older file of the same name whole). */
    char mode_path[512];
    snprintf(mode_path, sizeof mode_path, "%s/mode.tls", tmp_dir);
    const mode_t old_mask = umask(027);
    for (int twice = 0; twice < 2; twice++)
        CHECK(tl_session_state_write(state, mode_path) == TL_OK, "write: %s", tl_last_error());
    umask(old_mask);
    struct stat sb;
    CHECK(stat(mode_path, &sb) == 0 && (sb.st_mode & 0777) == 0640 && sb.st_size == (off_t)len,
          "mode %o, %lld bytes (want 0640, %zu)", (unsigned)(sb.st_mode & 0777), (long long)sb.st_size, len);
    /* A file its user made private stays so when a save replaces it (it became 0644, the
       umask's, at the next save: a conversation's tokens readable by all), read-only too. */
    const mode_t modes[2] = {0600, 0444};
    for (int i = 0; i < 2; i++) {
        CHECK(chmod(mode_path, modes[i]) == 0, "chmod");
        CHECK(tl_session_state_write(state, mode_path) == TL_OK, "write over mode %o: %s", (unsigned)modes[i], tl_last_error());
        CHECK(stat(mode_path, &sb) == 0 && (sb.st_mode & 0777) == modes[i], "mode %o after a save, want %o",
              (unsigned)(sb.st_mode & 0777), (unsigned)modes[i]);
    }
    unlink(mode_path);
    /* a name of 240 bytes and more, which the file system takes (the temporary name beside it,
       the whole name and a suffix, passed its 255: "File name too long") */
    char long_path[800];
    snprintf(long_path, sizeof long_path, "%s/%0240d.tls", tmp_dir, 0);
    CHECK(tl_session_state_write(state, long_path) == TL_OK, "a 244-byte name: %s", tl_last_error());
    tl_session_state *long_read = NULL;
    CHECK(tl_session_state_read(m, long_path, &long_read) == TL_OK, "read it back: %s", tl_last_error());
    tl_session_state_free(long_read);
    unlink(long_path);
    /* a large file that is no state is refused from its first bytes (read whole first: 1 GB
       of memory and 4.5 s for one of 1 GB) */
    char big_path[512];
    snprintf(big_path, sizeof big_path, "%s/big.tls", tmp_dir);
    FILE *big = fopen(big_path, "wb");
    CHECK(big && ftruncate(fileno(big), (off_t)1 << 30) == 0, "a sparse file of 1 GB");
    if (big) fclose(big);
    CHECK_ERROR(tl_session_state_read(m, big_path, &out), TL_ERR_FORMAT, "no TLSTATE header");
    /* ...its memory measured in a child of its own (this process's peak is a high-water mark
       that earlier work may have set higher) */
    long resident_pages = 0; /* (this process's now: the child starts with it) */
    FILE *statm = fopen("/proc/self/statm", "r");
    if (statm) {
        long size_pages;
        if (fscanf(statm, "%ld %ld", &size_pages, &resident_pages) != 2) resident_pages = 0;
        fclose(statm);
    }
    const long resident_kb = resident_pages * (sysconf(_SC_PAGESIZE) / 1024);
    fflush(NULL);
    const pid_t child = fork();
    if (child == 0) {
        tl_session_state *never = NULL;
        _exit(tl_session_state_read(m, big_path, &never) == TL_ERR_FORMAT ? 0 : 1);
    }
    int child_status = -1;
    struct rusage child_usage = {0};
    CHECK(child > 0 && wait4(child, &child_status, 0, &child_usage) == child && WIFEXITED(child_status) &&
              WEXITSTATUS(child_status) == 0, "the refusal in a child");
    CHECK(child_usage.ru_maxrss - resident_kb < 64 * 1024, "the refusal took %ld KB more than the %ld KB it started with",
          child_usage.ru_maxrss - resident_kb, resident_kb);
    unlink(big_path);

    /* Damage: any flipped byte, any truncation; and not a state at all. */
    uint8_t *copy = malloc(len);
    const size_t flips[] = {40, len / 2, len - 9, len - 1};
    for (size_t i = 0; i < sizeof flips / sizeof *flips; i++) {
        memcpy(copy, bytes, len);
        copy[flips[i]] ^= 0x10;
        CHECK_ERROR(tl_session_state_from_bytes(m, copy, len, &out), TL_ERR_FORMAT, "checksum mismatch");
    }
    const size_t cuts[] = {len - 1, len - 8, len / 2, 45};
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++)
        CHECK_ERROR(tl_session_state_from_bytes(m, bytes, cuts[i], &out), TL_ERR_FORMAT, "checksum mismatch");
    CHECK_ERROR(tl_session_state_from_bytes(m, bytes, 20, &out), TL_ERR_FORMAT, "20 bytes, fewer than a state's header");
    CHECK_ERROR(tl_session_state_from_bytes(m, bytes, 5, &out), TL_ERR_FORMAT, "not a TinyLoop state");
    CHECK_ERROR(tl_session_state_from_bytes(m, "{\"not\": \"a state\"}", 18, &out), TL_ERR_FORMAT, "not a TinyLoop state");
    memcpy(copy, bytes, len);
    copy[8] = 9; /* version 9: a later build's */
    CHECK_ERROR(tl_session_state_from_bytes(m, copy, len, &out), TL_ERR_FORMAT, "version 9");

    /* Older layouts are still read, and resume as this one does: version 7 (before
       temperature_last: without its 4, at 200), version 6 (also before the grammar
       fingerprint: this one's bytes without its 8, at GRAMMAR_FINGERPRINT_AT, 0 here),
       version 5 (also before keep_special_text and fixed_state_seed: without 12, at 192),
       version 4 (also before penalty_window and penalties_count_prompt: without 20 at 184),
       version 3 (also before the thinking budget: without 36 at 168), version 2 (also before
       min_p and min_tokens: without 44 at 160) and version 1 (also before logit_bias and the
       presence and frequency penalties: without 56 bytes at 148). */
    const struct { uint8_t version; size_t at, cut; } older[] = {
        {7, 200, 4}, {6, 200, 4}, {5, 192, 12}, {4, 184, 20}, {3, 168, 36}, {2, 160, 44}, {1, 148, 56}};
    for (size_t i = 0; i < sizeof older / sizeof *older; i++) {
        const size_t fp_bytes = older[i].version <= 6 ? 8 : 0; /* (the grammar fingerprint, from version 7) */
        const size_t at = older[i].at, cut = older[i].cut + fp_bytes, fp = GRAMMAR_FINGERPRINT_AT;
        uint8_t *old_bytes = malloc(len - cut);
        memcpy(old_bytes, bytes, at);                                         /* up to the config's cut */
        memcpy(old_bytes + at, (const uint8_t *)bytes + at + older[i].cut, fp - at - older[i].cut); /* to the fingerprint */
        memcpy(old_bytes + fp - older[i].cut, (const uint8_t *)bytes + fp + fp_bytes, len - fp - fp_bytes); /* after it */
        old_bytes[8] = older[i].version;
        fix_checksum(old_bytes, len - cut);
        tl_session_state *old = NULL;
        CHECK(tl_session_state_from_bytes(m, old_bytes, len - cut, &old) == TL_OK, "version %d: %s", older[i].version,
              tl_last_error());
        void *again = NULL;
        size_t again_len = 0;
        CHECK(old && tl_session_state_to_bytes(old, &again, &again_len) == TL_OK && again_len == len &&
                  memcmp(again, bytes, len) == 0,
              "a version %d state reads as the same state (rewritten as version 8: the same bytes)", older[i].version);
        tl_free(again);
        tl_session_state_free(old);
        free(old_bytes);
    }

    /* Fields that pass the checksum but not the rules (a crafted file). The layout: a 36-byte
       header, the config's 15 ints at 36 and 9 floats at 96, the seed at 132, no stop rules
       (140, 144), the presence and frequency penalties at 148 and 152, no logit_bias (156),
       min_p at 160 and min_tokens at 164, the thinking budget at 168 (its budget, open, and
       two empty tags' counts at 176 and 180), penalty_window at 184, penalties_count_prompt at
       188, keep_special_text at 192, fixed_state_seed at 196, temperature_last at 200, prompt_len
       at 204, n_tokens at 208, the tokens from 212. */
    struct { size_t at; int32_t value; tl_status status; const char *needle; } fields[] = {
        {36 + 16, 4, TL_ERR_FORMAT, "beam search or speculative"},         /* beam_size */
        {36 + 4, 999, TL_ERR_INVALID_ARGUMENT, "loops"},                     /* loops: tl_session_new's check */
        {96, 0x7fc00000, TL_ERR_INVALID_ARGUMENT, "temperature"},            /* NaN */
        {140, 1 << 30, TL_ERR_FORMAT, "stop sequences do not fit"},
        {148, 0x7fc00000, TL_ERR_INVALID_ARGUMENT, "presence_penalty"},     /* NaN */
        {156, 1 << 30, TL_ERR_FORMAT, "logit_bias entries do not fit"},
        {160, 0x7fc00000, TL_ERR_INVALID_ARGUMENT, "min_p"},                /* NaN */
        {164, 999, TL_ERR_INVALID_ARGUMENT, "min_tokens"},                  /* above max_tokens */
        {168, -1, TL_ERR_INVALID_ARGUMENT, "reasoning_budget = -1"},
        {172, 2, TL_ERR_INVALID_ARGUMENT, "reasoning_open = 2"},
        {176, 17, TL_ERR_FORMAT, "a reasoning tag of 17 ids"},
        {180, -1, TL_ERR_FORMAT, "a reasoning tag of -1 ids"},
        {176, 1, TL_ERR_FORMAT, "a reasoning tag of 1 ids with the budget off"}, /* (found by fuzz_state) */
        {184, -1, TL_ERR_INVALID_ARGUMENT, "penalty_window = -1"},
        {188, 2, TL_ERR_INVALID_ARGUMENT, "penalties_count_prompt = 2"},
        {192, 2, TL_ERR_INVALID_ARGUMENT, "keep_special_text = 2"},
        {196, 2, TL_ERR_INVALID_ARGUMENT, "fixed_state_seed = 2"},
        {200, 2, TL_ERR_INVALID_ARGUMENT, "temperature_last = 2"},
        {204, 0, TL_ERR_FORMAT, "prompt"},
        {208, 1 << 30, TL_ERR_FORMAT, "tokens"},
        {208, 4 + 21, TL_ERR_FORMAT, "max_tokens"},
        {36, 5, TL_ERR_FORMAT, "reached max_tokens = 5"}, /* 5 emitted: it had finished */
        {212 + 4 * 9 + 32, 2, TL_ERR_FORMAT, "prompt_done is 2"}, /* after the tokens and the RNG */
        {212 + 4 * 9 + 32, 1 | 2 << 8, TL_ERR_FORMAT, "compiled_grammar is 2"}, /* the next byte */
        {GRAMMAR_FINGERPRINT_AT, 1, TL_ERR_FORMAT, "a grammar fingerprint without a grammar"},
        {212 + 4 * 4, 1 << 20, TL_ERR_FORMAT, "outside the vocabulary"},     /* the first emitted token */
        {212, -3, TL_ERR_INVALID_ARGUMENT, "prompt"},                        /* a prompt token */
    };
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++) {
        memcpy(copy, bytes, len);
        memcpy(copy + fields[i].at, &fields[i].value, 4);
        fix_checksum(copy, len);
        CHECK_ERROR(tl_session_state_from_bytes(m, copy, len, &out), fields[i].status, fields[i].needle);
        CHECK(out == NULL, "field at %zu: a refused state is NULL", fields[i].at);
    }
    /* The cache part: length and the first entry's index and depth (after the fixed-size
       part: tokens, rng, prompt_done, compiled_grammar, the grammar fingerprint, text_shown,
       5 f64, 2 + 65 i32). */
    const size_t cache_at = GRAMMAR_FINGERPRINT_AT + 8 + 8 + 40 + 4 * 67;
    struct { size_t at; int32_t value; const char *needle; } cache_fields[] = {
        {cache_at, 3, "the cache holds 3 entries"},
        {cache_at + 4, 99, "cache entries for a length"},
        {cache_at + 8, 5, "index"},
        {cache_at + 12, 0, "depth 0"},
        {cache_at + 12, 99, "depth 99"},
        {cache_at + 12, 1, "a prompt entry all of them"}, /* entry 0 at depth 1 of 2 */
        {cache_at - 4 * 65, 1, "depth histogram"},
        {cache_at - 4 * 67, 5, "text shown"}, /* the low half of text_shown: more than the text */
    };
    for (size_t i = 0; i < sizeof cache_fields / sizeof *cache_fields; i++) {
        memcpy(copy, bytes, len);
        if (!strcmp(cache_fields[i].needle, "text shown")) {
            const uint64_t too_many = 1u << 20;
            memcpy(copy + cache_at - 4 * 67 - 40 - 8, &too_many, 8);
        } else {
            memcpy(copy + cache_fields[i].at, &cache_fields[i].value, 4);
        }
        fix_checksum(copy, len);
        CHECK_ERROR(tl_session_state_from_bytes(m, copy, len, &out), TL_ERR_FORMAT, cache_fields[i].needle);
    }
    /* An emitted end of text stops a session that does not ignore it: such a state had
       finished (ignore_eos is the config's 10th int). */
    memcpy(copy, bytes, len);
    const int32_t no = 0, eos = m->cfg.eos_token_id;
    memcpy(copy + 36 + 4 * 9, &no, 4);
    memcpy(copy + 212 + 4 * 4, &eos, 4);
    fix_checksum(copy, len);
    CHECK_ERROR(tl_session_state_from_bytes(m, copy, len, &out), TL_ERR_FORMAT, "the session had finished");
    /* An unchanged copy with its checksum recomputed still reads: the cases above failed on
       their field, not on the offsets. */
    memcpy(copy, bytes, len);
    fix_checksum(copy, len);
    CHECK(tl_session_state_from_bytes(m, copy, len, &out) == TL_OK, "an intact crafted copy: %s", tl_last_error());
    tl_session_state_free(out);
    out = NULL;
    free(copy);

    /* Another model: another checkpoint, the same checkpoint with one weight changed, the
       same one with an f16 KV cache. */
    tl_model *other = load(other_dir, TL_KV_F32);
    if (other) CHECK_ERROR(tl_session_state_from_bytes(other, bytes, len, &out), TL_ERR_INVALID_ARGUMENT, "another model");
    tl_model_free(other);
    char changed_dir[512];
    snprintf(changed_dir, sizeof changed_dir, "%s/changed", tmp_dir);
    mkdir(changed_dir, 0700);
    CHECK(copy_with_other_weight(dir, changed_dir), "copying %s", dir);
    tl_model *changed = load(changed_dir, TL_KV_F32);
    if (changed) CHECK_ERROR(tl_session_state_from_bytes(changed, bytes, len, &out), TL_ERR_INVALID_ARGUMENT, "another model");
    tl_model_free(changed);
    tl_model *same = load(dir, m->kv_type);
    CHECK(same && tl_session_state_from_bytes(same, bytes, len, &out) == TL_OK,
          "the same checkpoint loaded again reads the state: %s", tl_last_error());
    tl_session_state_free(out);
    out = NULL;
    tl_model_free(same);
    const tl_kv_type other_kv = m->kv_type == TL_KV_F32 ? TL_KV_F16 : TL_KV_F32;
    tl_model *other_kv_model = load(dir, other_kv);
    if (other_kv_model)
        CHECK_ERROR(tl_session_state_from_bytes(other_kv_model, bytes, len, &out), TL_ERR_INVALID_ARGUMENT, "load it with kv_type");
    tl_model_free(other_kv_model);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", changed_dir);
    CHECK(system(cmd) == 0, "cleanup");


    tl_session_state_free(state);
    tl_free(bytes);
    tl_session_free(s);
}

/* The checksum fed in pieces of any sizes equals the checksum of the whole (a writer feeds
   it field by field, a reader in one piece); and it sees every byte. */
static void checksum_pieces(void) {
    uint8_t data[300];
    for (int i = 0; i < 300; i++) data[i] = (uint8_t)(i * 37 + 11);
    tl_hasher whole;
    tl_hash_init(&whole);
    tl_hash_add(&whole, data, sizeof data);
    const uint64_t expected = tl_hash_final(&whole);
    const size_t steps[] = {1, 3, 7, 8, 9, 13, 64};
    for (size_t k = 0; k < sizeof steps / sizeof *steps; k++) {
        tl_hasher pieces;
        tl_hash_init(&pieces);
        for (size_t at = 0, size = steps[k]; at < sizeof data; at += size, size = size % 11 + 1)
            tl_hash_add(&pieces, data + at, at + size <= sizeof data ? size : sizeof data - at);
        CHECK(tl_hash_final(&pieces) == expected, "pieces starting at %zu bytes hash differently", steps[k]);
    }
    for (size_t i = 0; i < sizeof data; i += 37) {
        data[i] ^= 0x80;
        tl_hasher changed;
        tl_hash_init(&changed);
        tl_hash_add(&changed, data, sizeof data);
        CHECK(tl_hash_final(&changed) != expected, "byte %zu changed, same hash", i);
        data[i] ^= 0x80;
        tl_hash_init(&changed);
        tl_hash_add(&changed, data, sizeof data - 1); /* one byte shorter */
        CHECK(tl_hash_final(&changed) != expected, "a shorter input, same hash");
    }
}

/* Resumes `state` with `hooks` and runs it to its end: NULL when it ran as `whole` did, else
   what went wrong. */
static const char *resumes_as(const tl_model *m, const tl_session_state *state, const tl_generate_config *hooks,
                              const tl_session *whole) {
    tl_session *resumed = NULL;
    if (tl_session_resume(m, state, hooks, &resumed) != TL_OK) return tl_last_error();
    run(resumed, 1000);
    const bool same = same_run(resumed, whole);
    tl_session_free(resumed);
    return same ? NULL : "the resumed run differs";
}

/* A session under a compiled grammar: its file marks it so (the matcher's position is not
   written), and a resume must name the grammar again, whose matcher then accepts the emitted
   tokens anew: the continuation equals the uninterrupted run's. Without the grammar, or with
   one that does not allow those tokens, the resume is refused. */
static void compiled_grammar_states(const tl_model *m) {
    const int32_t prompt[4] = {5, 6, 7, 8};
    tl_compiled_grammar *letters = NULL, *digits = NULL;
    const char *letters_gbnf = "root ::= [a-z ]+", *digits_gbnf = "root ::= [0-9]+";
    CHECK(tl_grammar_compile_gbnf(letters_gbnf, strlen(letters_gbnf), &letters) == TL_OK, "%s", tl_last_error());
    CHECK(tl_grammar_compile_gbnf(digits_gbnf, strlen(digits_gbnf), &digits) == TL_OK, "%s", tl_last_error());
    tl_grammar with_letters, with_digits;
    tl_grammar_use(&with_letters, letters);
    tl_grammar_use(&with_digits, digits);
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 16;
    cfg.temperature = 0.8f;
    cfg.sample_seed = 9;
    cfg.grammar = &with_letters;
    tl_session *whole = NULL, *s = NULL, *resumed = NULL;
    tl_session_new(m, prompt, 4, &cfg, &whole);
    tl_session_new(m, prompt, 4, &cfg, &s);
    run(whole, 1000);
    run(s, 5);
    size_t len = 0;
    void *bytes = state_bytes(s, &len);
    CHECK(bytes != NULL, "a state under a compiled grammar is written: %s", tl_last_error());
    tl_session_free(s);
    tl_session_state *state = NULL;
    CHECK(bytes && tl_session_state_from_bytes(m, bytes, len, &state) == TL_OK, "%s", tl_last_error());
    tl_generate_config hooks;
    tl_generate_config_init(&hooks);
    CHECK_ERROR(tl_session_resume(m, state, NULL, &resumed), TL_ERR_INVALID_ARGUMENT, "pass that grammar to resume");
    CHECK_ERROR(tl_session_resume(m, state, &hooks, &resumed), TL_ERR_INVALID_ARGUMENT, "pass that grammar to resume");
    hooks.grammar = &with_digits;
    CHECK_ERROR(tl_session_resume(m, state, &hooks, &resumed), TL_ERR_INVALID_ARGUMENT, "not the one the state was generated under");
    CHECK(resumed == NULL, "a refused resume gives no session");
    /* another grammar that takes every token emitted so far (letters, spaces and commas) is
       still another grammar: refused by the fingerprint the file holds, where it resumed and
       then wrote commas */
    tl_compiled_grammar *wider = NULL;
    const char *wider_gbnf = "root ::= [a-z ,]+";
    CHECK(tl_grammar_compile_gbnf(wider_gbnf, strlen(wider_gbnf), &wider) == TL_OK, "%s", tl_last_error());
    tl_grammar with_wider;
    tl_grammar_use(&with_wider, wider);
    hooks.grammar = &with_wider;
    CHECK_ERROR(tl_session_resume(m, state, &hooks, &resumed), TL_ERR_INVALID_ARGUMENT, "not the one the state was generated under");
    /* a version 6 file holds no fingerprint: a grammar is checked by the tokens it takes */
    {
        /* (without temperature_last's 4 bytes at 200, and the fingerprint's 8) */
        uint8_t *v6 = malloc(len - 12);
        int32_t n_tokens = 0; /* (at 208, after the same config as refusals': no stop rules) */
        memcpy(&n_tokens, (const uint8_t *)bytes + 208, 4);
        const size_t fp = 212 + 4 * (size_t)n_tokens + 32 + 2;
        CHECK(n_tokens == 9, "the state under a grammar holds %d tokens (4 + 5)", n_tokens);
        memcpy(v6, bytes, 200);
        memcpy(v6 + 200, (const uint8_t *)bytes + 204, fp - 204);
        memcpy(v6 + fp - 4, (const uint8_t *)bytes + fp + 8, len - fp - 8);
        v6[8] = 6;
        fix_checksum(v6, len - 12);
        tl_session_state *old = NULL;
        CHECK(tl_session_state_from_bytes(m, v6, len - 12, &old) == TL_OK, "version 6: %s", tl_last_error());
        hooks.grammar = &with_digits;
        CHECK_ERROR(tl_session_resume(m, old, &hooks, &resumed), TL_ERR_INVALID_ARGUMENT, "is not allowed by the grammar");
        hooks.grammar = &with_letters;
        const char *why = resumes_as(m, old, &hooks, whole);
        CHECK(!why, "a version 6 state resumed under its grammar: %s", why);
        tl_session_state_free(old);
        free(v6);
    }
    /* the same grammar compiled anew has the same fingerprint: resumed */
    tl_compiled_grammar *letters_again = NULL;
    CHECK(tl_grammar_compile_gbnf(letters_gbnf, strlen(letters_gbnf), &letters_again) == TL_OK, "%s", tl_last_error());
    tl_grammar with_letters_again;
    tl_grammar_use(&with_letters_again, letters_again);
    hooks.grammar = &with_letters_again;
    const char *why_anew = resumes_as(m, state, &hooks, whole);
    CHECK(!why_anew, "resumed under its grammar compiled anew: %s", why_anew);
    tl_compiled_grammar_free(letters_again);
    tl_compiled_grammar_free(wider);
    hooks.grammar = &with_letters;
    for (int twice = 0; twice < 2; twice++) {
        CHECK(tl_session_resume(m, state, &hooks, &resumed) == TL_OK, "resume: %s", tl_last_error());
        if (resumed) run(resumed, 1000);
        CHECK(resumed && same_run(resumed, whole), "resumed under its grammar (%d), the run differs", twice);
        if (resumed && twice == 0) { /* a resumed session's own state is marked the same way */
            size_t again_len = 0;
            tl_session_free(resumed);
            CHECK(tl_session_resume(m, state, &hooks, &resumed) == TL_OK, "%s", tl_last_error());
            void *again = state_bytes(resumed, &again_len);
            CHECK(again && again_len == len && memcmp(again, bytes, len) == 0, "resumed and saved again, the bytes differ");
            tl_free(again);
            run(resumed, 1000);
        }
        tl_session_free(resumed);
        resumed = NULL;
    }
    tl_session_state_free(state);
    tl_free(bytes);
    tl_session_free(whole);
    tl_compiled_grammar_free(letters);
    tl_compiled_grammar_free(digits);
}

/* The fuzzer's seeds (tests/fuzz/make_state_seeds.lua) are states of this checkpoint: they
   must still read, or the fuzzer would start from inputs refused at the fingerprint and
   never reach the fields (rewrite them when the fingerprint or the layout changes). */
static void fuzz_seeds_read(const tl_model *m, const char *corpus) {
    const char *names[] = {"greedy", "stop_rules_window", "before_prompt", "early_exit", "logit_adjustments",
                           "min_p_min_tokens", "compiled_grammar"};
    /* the layout a state is written in now (its version, byte 8): the seeds' too, so that
       they carry every field the layout has */
    uint8_t version = 0;
    {
        const int32_t prompt[2] = {1, 2};
        tl_generate_config cfg;
        tl_generate_config_init(&cfg);
        cfg.max_tokens = 2;
        tl_session *s = NULL;
        tl_session_state *now = NULL;
        void *bytes = NULL;
        size_t len = 0;
        if (tl_session_new(m, prompt, 2, &cfg, &s) == TL_OK && tl_session_save(s, &now) == TL_OK &&
            tl_session_state_to_bytes(now, &bytes, &len) == TL_OK && len > 8)
            version = ((const uint8_t *)bytes)[8];
        tl_free(bytes);
        tl_session_state_free(now);
        tl_session_free(s);
    }
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", corpus, names[i]);
        FILE *f = fopen(path, "rb");
        uint8_t head[9] = {0};
        CHECK(f && fread(head, 1, sizeof head, f) == sizeof head && head[8] == version,
              "%s: layout version %d, states are written in %d now (rewrite the seeds: luajit "
              "tests/fuzz/make_state_seeds.lua)", path, head[8], version);
        if (f) fclose(f);
        tl_session_state *state = NULL;
        const tl_status st = tl_session_state_read(m, path, &state);
        if (m->kv_type == TL_KV_F32)
            CHECK(st == TL_OK, "%s: %s (rewrite the seeds: luajit tests/fuzz/make_state_seeds.lua)", path, tl_last_error());
        else
            CHECK(st == TL_ERR_INVALID_ARGUMENT && strstr(tl_last_error(), "kv_type f32"), "%s with f16 KV: %s", path,
                  tl_last_error());
        tl_session_state_free(state);
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/zz_max_tokens_reached", corpus);
    tl_session_state *state = NULL;
    CHECK_ERROR(tl_session_state_read(m, path, &state), TL_ERR_FORMAT, "checksum mismatch");
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "tests/data/textmodel";
    const char *other_dir = argc > 2 ? argv[2] : "tests/data/golden/deep_residual";
    const char *corpus = argc > 3 ? argv[3] : "tests/fuzz/corpus/state";
    const char *env_kv = getenv("TINYLOOP_KV_TYPE");
    tl_model *m = load(dir, env_kv && !strcmp(env_kv, "f16") ? TL_KV_F16 : TL_KV_F32);
    if (!m) return 1;
    char tmp_dir[] = "/tmp/tinyloop-state-XXXXXX";
    if (!mkdtemp(tmp_dir)) return 1;
    checksum_pieces();
    roundtrips(m, tmp_dir);
    refusals(m, dir, tmp_dir, other_dir);
    compiled_grammar_states(m);
    fuzz_seeds_read(m, corpus);
    rmdir(tmp_dir);
    tl_model_free(m);
    return check_summary();
}

/* state_file.c: a saved state (fork.c) as bytes or a file, read back by the model that wrote
 * it: tl_session_state_to_bytes / _write, tl_session_state_from_bytes / _read.
 *
 * What a state holds is the plain session's state (fork.c clones the same fields): the
 * config's numbers and stop rules, the tokens, the sampler's RNG, the stats, and the K/V
 * rows of every cache entry. Everything else is rebuilt on reading: the session is created
 * from the config and prompt (so every check of tl_session_new runs again), the text is
 * re-derived from the emitted tokens, and the entries' rows are copied into a new cache.
 * Hooks are code, not data: they are not written; tl_session_resume takes them. A session
 * under a compiled grammar is marked so: its matcher's position is not written, and a
 * resume must name the grammar again, whose matcher then accepts the emitted tokens anew
 * (fork.c).
 *
 * The layout, little-endian, no padding (version 8; version 7, still read, ends the config at
 * fixed_state_seed, version 6 also has no grammar fingerprint, version 5 ends the config at penalties_count_prompt, version 4 at the reasoning tags, version 3 at min_tokens,
 * version 2 at the logit_bias entries, and version 1 at the stop strings):
 *     "TLSTATE\0"  u32 version  u64 model fingerprint (model.c)
 *     u32 kv_type  u32 vocab  u32 n_slots  u32 kv_dim
 *     config: i32 max_tokens loops top_k cache_window beam_size early_exit_patience
 *             early_exit_min_L early_exit_peek_every early_exit_criterion ignore_eos
 *             speculative draft_loops draft_ahead K_branches max_nodes
 *             f32 temperature top_p repetition_penalty length_penalty early_exit_logit_margin
 *             early_exit_threshold early_exit_kl_threshold early_exit_entropy_threshold
 *             early_exit_gate_threshold   u64 sample_seed
 *             i32 n_stop_sequences, each: i32 n, i32 tokens[n]
 *             i32 n_stop_strings, each: u32 length, its bytes
 *             f32 presence_penalty frequency_penalty
 *             i32 n_logit_bias, each: i32 token, f32 bias
 *             f32 min_p  i32 min_tokens
 *             i32 reasoning_budget reasoning_open  i32 n, i32 ids[n] of reasoning_start, then
 *             of reasoning_end (the budget's state is replayed from the tokens)
 *             i32 penalty_window penalties_count_prompt
 *             i32 keep_special_text fixed_state_seed
 *             i32 temperature_last
 *     i32 prompt_len  i32 n_tokens  i32 tokens[n_tokens]
 *     u64 rng[4]  u8 prompt_done  u8 compiled_grammar  u64 grammar fingerprint (grammar.h;
 *             0: none)  u64 text_shown
 *     f64 prefill_ms first_token_ms decode_ms probe_ms loops_sum
 *     i32 probes prompt_tokens_reused  i32 depth_histogram[65]
 *     i32 cache length  i32 n_entries, each: i32 logical index, i32 depth, then for every
 *             slot the entry has (prelude, block loops 1..depth, coda) its K row and V row
 *             (kv_dim elements of kv_type)
 *     u64 checksum of every byte before it
 * The fingerprint ties a file to the weights it was computed with: another model (another
 * checkpoint of the same shapes included) is refused, and so is another KV type. */
#define _GNU_SOURCE /* strndup */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "grammar.h"
#include "kv_cache.h"
#include "session.h"

static const char STATE_MAGIC[8] = "TLSTATE";
#define STATE_START_BYTES (sizeof STATE_MAGIC + 4) /* the magic and the version */
#define STATE_VERSION 8u
#define STATE_OLDEST_READ 1u /* a version 1 state has no logit_bias nor presence/frequency penalties,
                                version 2 no min_p nor min_tokens, version 3 no thinking budget,
                                version 4 no penalty_window nor penalties_count_prompt,
                                version 5 no keep_special_text nor fixed_state_seed,
                                version 6 no grammar fingerprint (any grammar that takes the
                                tokens resumes it), version 7 no temperature_last */
#define STATE_MAX_FILE_BYTES ((size_t)1 << 40)

static bool host_is_little_endian(void) {
    const uint16_t one = 1;
    uint8_t first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* ================================================================ writing */

/* Writes to a file, or into a buffer of the exact size, measured by a first pass that only
   counts (f and buffer NULL): a growing buffer would copy megabytes of K/V over and over. */
typedef struct state_writer {
    FILE *f;
    uint8_t *buffer;
    size_t written;
    tl_hasher hash;
    int error; /* errno of the first failure; 0: none */
} state_writer;

static void fail_with(state_writer *w, int error) {
    if (!w->error) w->error = error ? error : EIO;
}

static void put(state_writer *w, const void *bytes, size_t n) {
    if (w->error || !n) return;
    if (w->f) {
        tl_hash_add(&w->hash, bytes, n);
        if (fwrite(bytes, 1, n, w->f) != n) fail_with(w, errno);
    } else if (w->buffer) {
        tl_hash_add(&w->hash, bytes, n);
        memcpy(w->buffer + w->written, bytes, n);
    }
    w->written += n;
}
static void put_i32(state_writer *w, int32_t v) { put(w, &v, sizeof v); }
static void put_u32(state_writer *w, uint32_t v) { put(w, &v, sizeof v); }
static void put_u64(state_writer *w, uint64_t v) { put(w, &v, sizeof v); }
static void put_f32(state_writer *w, float v) { put(w, &v, sizeof v); }
static void put_f64(state_writer *w, double v) { put(w, &v, sizeof v); }

static tl_status check_writable(const tl_session_state *state, const char *what) {
    if (!state) return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: state must not be NULL", what);
    const tl_session *s = state->frozen;
    if (!host_is_little_endian())
        return tl_fail(TL_ERR_UNSUPPORTED, "%s: state files are little-endian; this host is not", what);
    if (s->decoder != &tl_plain_decoder) /* (a speculative or beam state: save and resume keep it in memory) */
        return tl_fail(TL_ERR_UNSUPPORTED, "%s: a %s session's state is kept in memory only: a state file holds plain "
                                           "decoding", what, s->decoder->name);
    if (s->m->backend != &tl_cpu_backend)
        return tl_fail(TL_ERR_UNSUPPORTED, "%s: the state's KV cache lives on the %s backend; only CPU states "
                                           "can be written", what, s->m->backend->name);
    return TL_OK;
}

static void write_config(state_writer *w, const tl_generate_config *c) {
    const int32_t ints[] = {c->max_tokens, c->loops, c->top_k, c->cache_window, c->beam_size,
                            c->early_exit_patience, c->early_exit_min_L, c->early_exit_peek_every,
                            (int32_t)c->early_exit_criterion, c->ignore_eos, (int32_t)c->speculative,
                            c->draft_loops, c->draft_ahead, c->K_branches, c->max_nodes};
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++) put_i32(w, ints[i]);
    const float floats[] = {c->temperature, c->top_p, c->repetition_penalty, c->length_penalty,
                            c->early_exit_logit_margin, c->early_exit_threshold, c->early_exit_kl_threshold,
                            c->early_exit_entropy_threshold, c->early_exit_gate_threshold};
    for (size_t i = 0; i < sizeof floats / sizeof *floats; i++) put_f32(w, floats[i]);
    put_u64(w, c->sample_seed);
    put_i32(w, c->n_stop_sequences);
    for (int i = 0; i < c->n_stop_sequences; i++) {
        put_i32(w, c->stop_sequences[i].n);
        put(w, c->stop_sequences[i].tokens, (size_t)c->stop_sequences[i].n * sizeof(int32_t));
    }
    put_i32(w, c->n_stop_strings);
    for (int i = 0; i < c->n_stop_strings; i++) {
        const size_t len = strlen(c->stop_strings[i]);
        put_u32(w, (uint32_t)len);
        put(w, c->stop_strings[i], len);
    }
    put_f32(w, c->presence_penalty);
    put_f32(w, c->frequency_penalty);
    put_i32(w, c->n_logit_bias);
    for (int i = 0; i < c->n_logit_bias; i++) {
        put_i32(w, c->logit_bias[i].token);
        put_f32(w, c->logit_bias[i].bias);
    }
    put_f32(w, c->min_p);
    put_i32(w, c->min_tokens);
    put_i32(w, c->reasoning_budget);
    put_i32(w, c->reasoning_open);
    for (int t = 0; t < 2; t++) {
        const tl_token_seq *tag = t ? &c->reasoning_end : &c->reasoning_start;
        put_i32(w, tag->n);
        put(w, tag->tokens, (size_t)tag->n * sizeof(int32_t));
    }
    put_i32(w, c->penalty_window);
    put_i32(w, c->penalties_count_prompt);
    put_i32(w, c->keep_special_text);
    put_i32(w, c->fixed_state_seed);
    put_i32(w, c->temperature_last);
}

static void write_stats(state_writer *w, const tl_session *s) {
    const tl_generate_stats *st = &s->stats;
    put_f64(w, st->prefill_ms);
    put_f64(w, st->first_token_ms);
    put_f64(w, st->decode_ms);
    put_f64(w, st->probe_ms);
    put_f64(w, s->loops_sum);
    put_i32(w, st->probes);
    put_i32(w, st->prompt_tokens_reused);
    for (int i = 0; i < TL_HISTOGRAM_DEPTHS; i++) put_i32(w, st->depth_histogram[i]);
}

/* The entries the ring still holds (every entry without a window), oldest first. */
static int first_entry(const tl_kv_cache *c) { return c->length > c->capacity ? c->length - c->capacity : 0; }

/* Every entry the ring holds: a plain session's ring has no gaps (only speculative rollbacks
   leave them), which the reader relies on. */
static tl_status write_cache(state_writer *w, const tl_session *s) {
    const tl_kv_cache *c = s->cache;
    const tl_config *mc = &s->m->cfg;
    const int n_entries = c->length - first_entry(c);
    put_i32(w, c->length);
    put_i32(w, n_entries);
    for (int j = first_entry(c); j < c->length; j++) {
        const int row = tl_kv_row(c, j), depth = c->depth[row];
        if (c->logical[row] != j || depth < 1 || depth > mc->max_loops || c->pos[row] != s->positions[j])
            return tl_fail(TL_ERR_INTERNAL, "state: cache entry %d is missing, or has depth %d, position %d", j, depth,
                           c->pos[row]);
        put_i32(w, j);
        put_i32(w, depth);
        for (int slot = 0; slot < c->n_slots; slot++) {
            if (!tl_kv_slot_at_depth(mc, slot, depth)) continue;
            const void *key = tl_kv_k(c, slot, j), *value = tl_kv_v(c, slot, j);
            if (!key || !value) return tl_fail(TL_ERR_INTERNAL, "state: cache entry %d has no page in slot %d", j, slot);
            put(w, key, c->row_bytes);
            put(w, value, c->row_bytes);
        }
    }
    return TL_OK;
}

/* The whole state into w, checksum last. */
static tl_status write_state(state_writer *w, const tl_session *s) {
    const tl_model *m = s->m;
    tl_hash_init(&w->hash);
    put(w, STATE_MAGIC, sizeof STATE_MAGIC);
    put_u32(w, STATE_VERSION);
    put_u64(w, m->fingerprint);
    put_u32(w, (uint32_t)m->kv_type);
    put_u32(w, (uint32_t)m->cfg.vocab_size);
    put_u32(w, (uint32_t)s->cache->n_slots);
    put_u32(w, (uint32_t)s->cache->kv_dim);
    write_config(w, &s->cfg);
    put_i32(w, s->prompt_len);
    put_i32(w, s->n_tokens);
    put(w, s->tokens, (size_t)s->n_tokens * sizeof *s->tokens);
    for (int i = 0; i < 4; i++) put_u64(w, s->rng.s[i]);
    const uint8_t prompt_done = s->prompt_done, compiled_grammar = s->grammar_matcher || s->grammar_replay;
    put(w, &prompt_done, 1);
    put(w, &compiled_grammar, 1);
    put_u64(w, s->grammar_matcher ? s->grammar_matcher->g->fingerprint : s->grammar_replay ? s->grammar_fingerprint : 0);
    put_u64(w, s->text_shown);
    write_stats(w, s);
    tl_status st = write_cache(w, s);
    const uint64_t checksum = tl_hash_final(&w->hash);
    put_u64(w, checksum);
    return st;
}

tl_status tl_session_state_to_bytes(const tl_session_state *state, void **bytes, size_t *len) {
    tl_clear_error();
    if (!bytes || !len) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_state_to_bytes: bytes and len must not be NULL");
    *bytes = NULL;
    *len = 0;
    tl_status st = check_writable(state, "tl_session_state_to_bytes");
    if (st != TL_OK) return st;
    state_writer count = {0};
    if ((st = write_state(&count, state->frozen)) != TL_OK) return st;
    state_writer w = {.buffer = malloc(count.written)};
    if (!w.buffer) return tl_fail(TL_ERR_NO_MEMORY, "tl_session_state_to_bytes: out of memory for %zu bytes", count.written);
    if ((st = write_state(&w, state->frozen)) != TL_OK) {
        free(w.buffer);
        return st;
    }
    *bytes = w.buffer;
    *len = w.written;
    return TL_OK;
}

/* A temporary file beside `path`, synced, then renamed over it: a reader never sees half a
   state, and a failed write leaves the old file as it was. */
tl_status tl_session_state_write(const tl_session_state *state, const char *path) {
    tl_clear_error();
    if (!path || !*path) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_state_write: path must not be empty");
    tl_status st = check_writable(state, "tl_session_state_write");
    if (st != TL_OK) return st;
    char *temp;
    int fd;
    if ((st = tl_create_beside(path, &fd, &temp)) != TL_OK) return st;
    state_writer w = {.f = fdopen(fd, "wb")};
    if (!w.f) {
        close(fd);
        st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    } else {
        st = write_state(&w, state->frozen);
        if (fflush(w.f) != 0 || fsync(fileno(w.f)) != 0) fail_with(&w, errno);
        if (fclose(w.f) != 0) fail_with(&w, errno);
        if (st == TL_OK && w.error) st = tl_fail(TL_ERR_IO, "state file %s: write failed: %s", path, strerror(w.error));
        if (st == TL_OK && rename(temp, path) != 0)
            st = tl_fail(TL_ERR_IO, "state file %s: %s", path, strerror(errno));
        if (st == TL_OK) tl_sync_directory_of(path);
    }
    if (st != TL_OK) unlink(temp);
    free(temp);
    return st;
}

/* ================================================================ reading */

typedef struct state_reader {
    const uint8_t *at;
    size_t left;
    bool short_read; /* the bytes ended before the layout did */
    uint32_t version;  /* the state's layout version */
} state_reader;

static bool get(state_reader *r, void *out, size_t n) {
    if (r->short_read || n > r->left) {
        r->short_read = true;
        memset(out, 0, n);
        return false;
    }
    memcpy(out, r->at, n);
    r->at += n;
    r->left -= n;
    return true;
}
static int32_t get_i32(state_reader *r) { int32_t v; get(r, &v, sizeof v); return v; }
static uint32_t get_u32(state_reader *r) { uint32_t v; get(r, &v, sizeof v); return v; }
static uint64_t get_u64(state_reader *r) { uint64_t v; get(r, &v, sizeof v); return v; }
static float get_f32(state_reader *r) { float v; get(r, &v, sizeof v); return v; }
static double get_f64(state_reader *r) { double v; get(r, &v, sizeof v); return v; }

/* A count of `size`-byte items that the remaining bytes can hold (so no allocation is ever
   larger than the input). */
static bool count_fits(const state_reader *r, int32_t count, size_t size) {
    return count >= 0 && (size_t)count <= r->left / (size ? size : 1);
}

#define MALFORMED(...) tl_fail(TL_ERR_FORMAT, "state: " __VA_ARGS__)

/* The config written by write_config (pointers into the caller's stores, freed by it). */
typedef struct read_config {
    tl_generate_config cfg;
    tl_token_seq *stop_seqs;
    char **stop_strs;
    tl_logit_bias *logit_bias;
    int32_t reasoning_ids[2][TL_MAX_REASONING_TAG];
} read_config;

/* n int32 values copied out of the bytes (which need not be aligned for int32_t); NULL when
   out of memory. The caller checked that they fit. */
static int32_t *get_i32_array(state_reader *r, int32_t n) {
    int32_t *values = malloc(((size_t)n + 1) * sizeof *values);
    if (values) get(r, values, (size_t)n * sizeof *values);
    return values;
}

static void read_config_free(read_config *rc) {
    for (int i = 0; rc->stop_seqs && i < rc->cfg.n_stop_sequences; i++) free((void *)rc->stop_seqs[i].tokens);
    free(rc->stop_seqs);
    for (int i = 0; rc->stop_strs && i < rc->cfg.n_stop_strings; i++) free(rc->stop_strs[i]);
    free(rc->stop_strs);
    free(rc->logit_bias);
}

static tl_status read_config_fields(state_reader *r, read_config *rc) {
    tl_generate_config *c = &rc->cfg;
    tl_generate_config_init(c);
    c->max_tokens = get_i32(r);
    c->loops = get_i32(r);
    c->top_k = get_i32(r);
    c->cache_window = get_i32(r);
    c->beam_size = get_i32(r);
    c->early_exit_patience = get_i32(r);
    c->early_exit_min_L = get_i32(r);
    c->early_exit_peek_every = get_i32(r);
    c->early_exit_criterion = (tl_exit_criterion)get_i32(r);
    c->ignore_eos = get_i32(r);
    c->speculative = (tl_speculative_mode)get_i32(r);
    c->draft_loops = get_i32(r);
    c->draft_ahead = get_i32(r);
    c->K_branches = get_i32(r);
    c->max_nodes = get_i32(r);
    c->temperature = get_f32(r);
    c->top_p = get_f32(r);
    c->repetition_penalty = get_f32(r);
    c->length_penalty = get_f32(r);
    c->early_exit_logit_margin = get_f32(r);
    c->early_exit_threshold = get_f32(r);
    c->early_exit_kl_threshold = get_f32(r);
    c->early_exit_entropy_threshold = get_f32(r);
    c->early_exit_gate_threshold = get_f32(r);
    c->sample_seed = get_u64(r);

    const int32_t n_seqs = get_i32(r);
    if (!count_fits(r, n_seqs, sizeof(int32_t))) return MALFORMED("%d stop sequences do not fit in the bytes left", n_seqs);
    rc->stop_seqs = calloc((size_t)n_seqs + 1, sizeof *rc->stop_seqs);
    if (!rc->stop_seqs) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    c->stop_sequences = rc->stop_seqs;
    for (int i = 0; i < n_seqs; i++) {
        const int32_t n = get_i32(r);
        if (!count_fits(r, n, sizeof(int32_t))) return MALFORMED("stop sequence %d: %d tokens do not fit", i, n);
        int32_t *tokens = get_i32_array(r, n); /* validated by tl_session_create */
        if (!tokens) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        rc->stop_seqs[i] = (tl_token_seq){tokens, n};
        c->n_stop_sequences = i + 1;
    }
    const int32_t n_strs = get_i32(r);
    if (!count_fits(r, n_strs, sizeof(uint32_t))) return MALFORMED("%d stop strings do not fit in the bytes left", n_strs);
    rc->stop_strs = calloc((size_t)n_strs + 1, sizeof *rc->stop_strs);
    if (!rc->stop_strs) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    c->stop_strings = (const char *const *)rc->stop_strs;
    for (int i = 0; i < n_strs; i++) {
        const uint32_t len = get_u32(r);
        if (r->short_read || len > r->left) return MALFORMED("stop string %d: %u bytes do not fit", i, len);
        if (memchr(r->at, '\0', len)) return MALFORMED("stop string %d contains a NUL byte", i);
        if (!(rc->stop_strs[i] = malloc((size_t)len + 1))) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        c->n_stop_strings = i + 1;
        get(r, rc->stop_strs[i], len);
        rc->stop_strs[i][len] = '\0';
    }
    if (r->version >= 2) {
        c->presence_penalty = get_f32(r);
        c->frequency_penalty = get_f32(r);
        const int32_t n_bias = get_i32(r);
        if (!count_fits(r, n_bias, sizeof(int32_t) + sizeof(float)))
            return MALFORMED("%d logit_bias entries do not fit in the bytes left", n_bias);
        if (!(rc->logit_bias = malloc(((size_t)n_bias + 1) * sizeof *rc->logit_bias)))
            return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        for (int i = 0; i < n_bias; i++) { /* validated by tl_session_create */
            rc->logit_bias[i].token = get_i32(r);
            rc->logit_bias[i].bias = get_f32(r);
        }
        c->logit_bias = rc->logit_bias;
        c->n_logit_bias = n_bias;
    }
    if (r->version >= 3) { /* validated by tl_session_create */
        c->min_p = get_f32(r);
        c->min_tokens = get_i32(r);
    }
    if (r->version >= 4) { /* the values validated by tl_session_create, the counts here */
        c->reasoning_budget = get_i32(r);
        c->reasoning_open = get_i32(r);
        for (int t = 0; t < 2; t++) {
            const int32_t n = get_i32(r);
            if (n < 0 || n > TL_MAX_REASONING_TAG || !count_fits(r, n, sizeof(int32_t)))
                return MALFORMED("a reasoning tag of %d ids (at most %d)", n, TL_MAX_REASONING_TAG);
            /* (a session keeps its tags only with a budget: a written state has none without
               one, and one read must write back as it was) */
            if (n > 0 && c->reasoning_budget == 0)
                return MALFORMED("a reasoning tag of %d ids with the budget off (reasoning_budget 0)", n);
            get(r, rc->reasoning_ids[t], (size_t)n * sizeof(int32_t));
            *(t ? &c->reasoning_end : &c->reasoning_start) = (tl_token_seq){n > 0 ? rc->reasoning_ids[t] : NULL, n};
        }
    }
    if (r->version >= 5) { /* validated by tl_session_create */
        c->penalty_window = get_i32(r);
        c->penalties_count_prompt = get_i32(r);
    }
    if (r->version >= 6) { /* validated by tl_session_create */
        c->keep_special_text = get_i32(r);
        c->fixed_state_seed = get_i32(r);
    }
    if (r->version >= 8) c->temperature_last = get_i32(r); /* validated by tl_session_create */
    return r->short_read ? MALFORMED("the bytes end inside the config") : TL_OK;
}

/* The stats and timing; what each stored figure implies is checked against the tokens. */
static tl_status read_stats(state_reader *r, tl_session *s) {
    tl_generate_stats *st = &s->stats;
    st->prefill_ms = get_f64(r);
    st->first_token_ms = get_f64(r);
    st->decode_ms = get_f64(r);
    st->probe_ms = get_f64(r);
    s->loops_sum = get_f64(r);
    st->probes = get_i32(r);
    st->prompt_tokens_reused = get_i32(r);
    long long counted = 0;
    bool bins_ok = true;
    for (int i = 0; i < TL_HISTOGRAM_DEPTHS; i++) {
        st->depth_histogram[i] = get_i32(r);
        bins_ok &= st->depth_histogram[i] >= 0;
        counted += st->depth_histogram[i];
    }
    if (r->short_read) return MALFORMED("the bytes end inside the stats");
    const double times[] = {st->prefill_ms, st->first_token_ms, st->decode_ms, st->probe_ms, s->loops_sum};
    for (size_t i = 0; i < sizeof times / sizeof *times; i++)
        if (!(times[i] >= 0.0) || !isfinite(times[i])) return MALFORMED("stats: a time or sum is %g", times[i]);
    const int emitted = s->n_tokens - s->prompt_len;
    if (!bins_ok || counted != emitted)
        return MALFORMED("stats: the depth histogram counts %lld tokens, the state has %d", counted, emitted);
    if (st->probes < 0 || st->prompt_tokens_reused < 0 || st->prompt_tokens_reused > s->prompt_len)
        return MALFORMED("stats: %d probes, %d prompt tokens reused", st->probes, st->prompt_tokens_reused);
    st->tokens_emitted = emitted;
    st->loops_used = emitted ? s->loops_sum / emitted : 0.0;
    /* (not written: a saved session decodes plainly, whose prefill computed every prompt
       token the pool did not give) */
    st->prefill_tokens = s->prompt_done ? s->prompt_len - st->prompt_tokens_reused : 0;
    /* The clock's anchors from the durations written (a prompt saved part-way starts its
       clock anew at its resume: fork.c's resume_clock, which also moves these by the time the
       state then waits). */
    if (s->prompt_done) {
        s->t_prefill_end = tl_now_ms() - st->decode_ms;
        s->t_start = s->t_prefill_end - st->prefill_ms;
    }
    return TL_OK;
}

static tl_status read_cache(state_reader *r, tl_session *s) {
    const tl_config *mc = &s->m->cfg;
    tl_kv_cache_free(s->cache); /* the one tl_session_create made (maybe with a pooled prefix) */
    s->cache = NULL;
    tl_status st = tl_session_cache_new(s, 0);
    if (st != TL_OK) return st;
    tl_kv_cache *c = s->cache;
    const int32_t length = get_i32(r), n_entries = get_i32(r);
    if (r->short_read) return MALFORMED("the bytes end before the cache");
    /* The pending token (the last one) is not in the cache yet; every other one is, once
       the prompt has been forwarded. */
    if (length < 0 || length >= s->n_tokens || (s->prompt_done && length != s->n_tokens - 1))
        return MALFORMED("the cache holds %d entries of a sequence of %d tokens", length, s->n_tokens);
    /* A plain session's ring holds every entry it has room for (only speculative rollbacks
       leave gaps). Whatever entries it holds came from these bytes, which only a checksum
       guards: the session never offers them to the prefix pool (rows_from_bytes), which
       promises other sessions bit-identical rows. */
    c->length = length;
    const int oldest = first_entry(c);
    if (n_entries != length - oldest)
        return MALFORMED("%d cache entries for a length of %d (the cache holds entries [%d, %d))", n_entries, length,
                         oldest, length);
    for (int e = 0; e < n_entries; e++) {
        const int32_t j = get_i32(r), depth = get_i32(r);
        if (r->short_read) return MALFORMED("the bytes end inside cache entry %d", e);
        if (j != oldest + e) return MALFORMED("cache entry %d has index %d, not %d", e, j, oldest + e);
        if (depth < 1 || depth > s->loops || (j < s->prompt_len && depth != s->loops))
            return MALFORMED("cache entry %d has depth %d (the session runs %d loops; a prompt entry all of them)", j,
                             depth, s->loops);
        for (int slot = 0; slot < c->n_slots; slot++) {
            if (!tl_kv_slot_at_depth(mc, slot, depth)) continue;
            void *key, *value;
            if (2 * c->row_bytes > r->left) return MALFORMED("the bytes end inside cache entry %d", j);
            if (!tl_kv_writable(c, slot, j, &key, &value))
                return tl_fail(TL_ERR_NO_MEMORY, "state: out of memory for the KV cache");
            get(r, key, c->row_bytes);
            get(r, value, c->row_bytes);
        }
        const int row = tl_kv_row(c, j);
        c->logical[row] = j;
        c->pos[row] = s->positions[j];
        c->depth[row] = (uint16_t)depth;
    }
    return TL_OK;
}

/* Appends the emitted tokens s->tokens[prompt_len, n_tokens) to the session's text, checking
   that none of them stopped it: a saved session has not finished (tl_session_emit's stop
   checks; hooks are not saved, so their stops cannot be checked). A state past its end would
   step beyond the session's arrays. */
static tl_status rebuild_emitted(tl_session *s) {
    const tl_generate_config *c = &s->cfg;
    const int emitted = s->n_tokens - s->prompt_len;
    if (emitted > 0 && emitted >= c->max_tokens)
        return MALFORMED("%d tokens emitted: the session had reached max_tokens = %d", emitted, c->max_tokens);
    const int n_tokens = s->n_tokens;
    for (int i = s->prompt_len; i < n_tokens; i++) {
        s->n_tokens = i + 1; /* (the thinking budget's state, as the emission left it) */
        bool stop_string = false;
        const size_t old_text_len = s->text_len;
        tl_status st = tl_session_append_text(s, s->tokens[i], &stop_string);
        if (st != TL_OK) return st;
        tl_session_track_reasoning(s, old_text_len);
        if (tl_session_rule_stop(s, i + 1, stop_string) != TL_STOP_NONE)
            return MALFORMED("token %d (%d) ends the generation (end of text or a stop rule): the session had finished",
                             i, s->tokens[i]);
    }
    return TL_OK;
}

/* Everything after the header: a frozen session of model m, or an error. */
static tl_status read_session(state_reader *r, const tl_model *m, tl_session **out) {
    *out = NULL;
    read_config rc = {0};
    tl_status st = read_config_fields(r, &rc);
    const int32_t prompt_len = st == TL_OK ? get_i32(r) : 0, n_tokens = st == TL_OK ? get_i32(r) : 0;
    if (st == TL_OK && r->short_read) st = MALFORMED("the bytes end before the tokens");
    if (st == TL_OK && (prompt_len < 1 || n_tokens < prompt_len || !count_fits(r, n_tokens, sizeof(int32_t))))
        st = MALFORMED("%d tokens of which %d are the prompt", n_tokens, prompt_len);
    if (st == TL_OK && (long long)n_tokens > (long long)prompt_len + rc.cfg.max_tokens)
        st = MALFORMED("%d tokens: more than the prompt (%d) plus max_tokens (%d)", n_tokens, prompt_len, rc.cfg.max_tokens);
    if (st == TL_OK && (rc.cfg.beam_size >= 2 || rc.cfg.speculative != TL_SPECULATIVE_OFF))
        st = MALFORMED("the config selects beam search or speculative decoding (saved states are plain)");
    int32_t *tokens = st == TL_OK ? get_i32_array(r, n_tokens) : NULL;
    if (st == TL_OK && !tokens) st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    tl_session *s = NULL;
    if (st == TL_OK) st = tl_session_create(m, tokens, prompt_len, &rc.cfg, &s); /* every config check */
    read_config_free(&rc);
    if (st != TL_OK) {
        free(tokens);
        return st;
    }
    if (s->decoder != &tl_plain_decoder) st = MALFORMED("saved states are plain decoding");
    for (int i = prompt_len; st == TL_OK && i < n_tokens; i++)
        if (tokens[i] < 0 || tokens[i] >= m->cfg.vocab_size)
            st = MALFORMED("token %d is %d, outside the vocabulary [0, %d)", i, tokens[i], m->cfg.vocab_size);
    if (st == TL_OK) {
        memcpy(s->tokens, tokens, (size_t)n_tokens * sizeof *tokens);
        s->n_tokens = n_tokens;
        for (int i = 0; i < 4; i++) s->rng.s[i] = get_u64(r);
        uint8_t prompt_done = 0, compiled_grammar = 0;
        get(r, &prompt_done, 1);
        get(r, &compiled_grammar, 1);
        const uint64_t grammar_fingerprint = r->version >= 7 ? get_u64(r) : 0;
        const uint64_t text_shown = get_u64(r);
        if (r->short_read) st = MALFORMED("the bytes end before the stats");
        else if (prompt_done > 1) st = MALFORMED("prompt_done is %u", prompt_done);
        else if (compiled_grammar > 1) st = MALFORMED("compiled_grammar is %u", compiled_grammar);
        else if (!compiled_grammar && grammar_fingerprint) st = MALFORMED("a grammar fingerprint without a grammar");
        else if (!prompt_done && n_tokens != prompt_len) st = MALFORMED("tokens were emitted before the prompt was forwarded");
        s->prompt_done = prompt_done;
        s->grammar_replay = compiled_grammar;
        s->grammar_fingerprint = compiled_grammar ? grammar_fingerprint : 0;
        if (st == TL_OK) st = rebuild_emitted(s);
        if (st == TL_OK && text_shown > s->text_len)
            st = MALFORMED("%llu bytes of text shown, of %zu", (unsigned long long)text_shown, s->text_len);
        s->text_shown = (size_t)text_shown;
    }
    free(tokens);
    if (st == TL_OK) st = read_stats(r, s);
    if (st == TL_OK) st = read_cache(r, s);
    if (st == TL_OK && r->left != 0) st = MALFORMED("%zu bytes follow the cache", r->left);
    if (st == TL_OK) s->rows_from_bytes = s->cache->length > 0; /* (none read: it computes all its rows itself) */
    if (st != TL_OK) {
        tl_session_free(s);
        return st;
    }
    *out = s;
    return TL_OK;
}

/* A state's magic and version, from its first `have` bytes (len: the whole state's), so that
   a file is refused before it is read whole (a file of 1 GB that is no state took 1 GB and 4.5 s
   to refuse). */
static tl_status check_start(const void *bytes, size_t have, size_t len) {
    if (have < sizeof STATE_MAGIC || memcmp(bytes, STATE_MAGIC, sizeof STATE_MAGIC) != 0)
        return tl_fail(TL_ERR_FORMAT, "state: not a TinyLoop state (%zu bytes, no TLSTATE header)", len);
    if (have < STATE_START_BYTES) return TL_OK; /* (truncated: the caller says so) */
    uint32_t version;
    memcpy(&version, (const uint8_t *)bytes + sizeof STATE_MAGIC, sizeof version);
    if (version < STATE_OLDEST_READ || version > STATE_VERSION)
        return tl_fail(TL_ERR_FORMAT, "state: version %u; this build reads versions %u to %u", version,
                       STATE_OLDEST_READ, STATE_VERSION);
    return TL_OK;
}

tl_status tl_session_state_from_bytes(const tl_model *model, const void *bytes, size_t len, tl_session_state **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_state_from_bytes: out must not be NULL");
    *out = NULL;
    if (!model || (!bytes && len))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_state_from_bytes: model and bytes must not be NULL");
    if (!host_is_little_endian())
        return tl_fail(TL_ERR_UNSUPPORTED, "state files are little-endian; this host is not");
    if (model->backend != &tl_cpu_backend)
        return tl_fail(TL_ERR_UNSUPPORTED, "a state is read into the CPU backend only (this model runs on %s)",
                       model->backend->name);
    const size_t header = STATE_START_BYTES + 8 + 4 * 4, trailer = 8; /* + fingerprint, KV type and shapes */
    tl_status st = check_start(bytes, len, len);
    if (st != TL_OK) return st;
    if (len < header + trailer)
        return tl_fail(TL_ERR_FORMAT, "state: %zu bytes, fewer than a state's header and checksum (%zu): truncated", len,
                       header + trailer);
    state_reader r = {(const uint8_t *)bytes + sizeof STATE_MAGIC, len - sizeof STATE_MAGIC - trailer, false, 0};
    r.version = get_u32(&r); /* (in range: check_start) */
    tl_hasher hash;
    tl_hash_init(&hash);
    tl_hash_add(&hash, bytes, len - trailer);
    uint64_t stored;
    memcpy(&stored, (const uint8_t *)bytes + len - trailer, sizeof stored);
    if (tl_hash_final(&hash) != stored)
        return tl_fail(TL_ERR_FORMAT, "state: checksum mismatch (the state is damaged or truncated)");
    const uint64_t fingerprint = get_u64(&r);
    const uint32_t kv_type = get_u32(&r), vocab = get_u32(&r), n_slots = get_u32(&r), kv_dim = get_u32(&r);
    const tl_config *mc = &model->cfg;
    if (fingerprint != model->fingerprint || vocab != (uint32_t)mc->vocab_size || n_slots != (uint32_t)tl_kv_slots(mc) ||
        kv_dim != (uint32_t)(mc->n_kv_heads * mc->head_dim))
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "state: written by another model (fingerprint %016llx), not this one (%s, %016llx): its KV "
                       "cache belongs to that model's weights",
                       (unsigned long long)fingerprint, model->dir, (unsigned long long)model->fingerprint);
    if (kv_type != (uint32_t)model->kv_type) {
        const char *written = tl_kv_type_name((tl_kv_type)kv_type);
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "state: its KV cache is %s, this model's is %s (load it with kv_type %s)",
                       written, tl_kv_type_name(model->kv_type), written);
    }
    tl_session_state *state = calloc(1, sizeof *state);
    if (!state) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    st = read_session(&r, model, &state->frozen);
    if (st != TL_OK) {
        free(state);
        return st;
    }
    state->saved_at = tl_now_ms(); /* (read_stats set its clock to now: from here it is saved) */
    *out = state;
    return TL_OK;
}

tl_status tl_session_state_read(const tl_model *model, const char *path, tl_session_state **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_state_read: out must not be NULL");
    *out = NULL;
    if (!model || !path) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_state_read: model and path must not be NULL");
    /* Into memory advised for huge pages: a state is mostly K/V, tens of megabytes, and
       faulting them in 4 KiB at a time cost more than reading them (a 38 MB state on a VM
       whose faults cost ~14 us: 9,000 faults). read(), not a mapping of the file: a file
       truncated while mapped would kill the process with SIGBUS. */
    int fd;
    size_t len;
    tl_status st = tl_open_regular(path, STATE_MAX_FILE_BYTES, &fd, &len);
    if (st != TL_OK) return st;
    /* the start first: a file that is no state is refused before memory is taken for it */
    uint8_t start_bytes[STATE_START_BYTES];
    const size_t start = len < sizeof start_bytes ? len : sizeof start_bytes;
    st = tl_read_exact(fd, path, start_bytes, start);
    if (st == TL_OK) st = check_start(start_bytes, start, len);
    void *region = NULL;
    size_t region_len = 0;
    uint8_t *bytes = NULL;
    if (st == TL_OK && !(bytes = tl_map_huge(len ? len : 1, &region, &region_len)))
        st = tl_fail(TL_ERR_NO_MEMORY, "out of memory for %zu bytes", len);
    if (st == TL_OK) {
        memcpy(bytes, start_bytes, start);
        st = tl_read_exact(fd, path, bytes + start, len - start);
    }
    close(fd);
    if (st == TL_OK) st = tl_session_state_from_bytes(model, bytes, len, out);
    if (st != TL_OK && strncmp(tl_last_error(), path, strlen(path)) != 0) { /* name the file in the message */
        char message[TL_ERROR_MAX];
        snprintf(message, sizeof message, "%s", tl_last_error());
        st = tl_fail(st, "%s: %s", path, message);
    }
    if (region) munmap(region, region_len);
    return st;
}

const int32_t *tl_session_state_tokens(const tl_session_state *state, int *n_tokens, int *prompt_len) {
    if (n_tokens) *n_tokens = state ? state->frozen->n_tokens : 0;
    if (prompt_len) *prompt_len = state ? state->frozen->prompt_len : 0;
    return state ? state->frozen->tokens : NULL;
}

/* test_load_errors.c: every validation rule of checkpoint loading and tl_score, fed the
 * bad input, must return the right status and a message naming the problem. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "internal.h" /* tl_json_value_parses */
#include "tinyloop.h"

static char work[256];  /* scratch checkpoint directory */
static char source[4096];

static char *slurp(const char *path, size_t *len) {
    *len = 0;
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    rewind(fp);
    char *buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, fp) != (size_t)n) n = 0;
    buf[n] = 0;
    fclose(fp);
    *len = (size_t)n;
    return buf;
}

static void spit(const char *name, const void *data, size_t len) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", work, name);
    FILE *fp = fopen(path, "wb");
    fwrite(data, 1, len, fp);
    fclose(fp);
}

/* Restores the scratch directory to the pristine source checkpoint. */
/* Copies files[0..n) of directory `from` into the work directory. */
static void copy_into_work(const char *from, const char *const *files, int n) {
    for (int i = 0; i < n; i++) {
        char path[4400];
        size_t len = 0;
        snprintf(path, sizeof path, "%s/%s", from, files[i]);
        char *data = slurp(path, &len);
        spit(files[i], data, len);
        free(data);
    }
}

static void reset(void) {
    const char *const files[] = {"config.json", "model.safetensors"};
    copy_into_work(source, files, 2);
}

static int loaded_max_loops; /* the last model load_work loaded: its max_loops */
static tl_status load_work(void) {
    tl_model *m = NULL;
    tl_status st = tl_model_load(work, NULL, &m);
    if (st == TL_OK) loaded_max_loops = tl_model_info(m)->max_loops;
    tl_model_free(m);
    return st;
}

/* config.json = the source config with each pairs[i][0] set to the JSON pairs[i][1] (NULL =
   removed). */
static tl_status load_with_fields(int n, const char *const pairs[][2]) {
    char path[4200];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/config.json", source);
    char *text = slurp(path, &len);
    cJSON *root = cJSON_Parse(text);
    free(text);
    for (int i = 0; i < n; i++) {
        cJSON_DeleteItemFromObjectCaseSensitive(root, pairs[i][0]);
        if (pairs[i][1]) cJSON_AddItemToObject(root, pairs[i][0], cJSON_Parse(pairs[i][1]));
    }
    char *out = cJSON_Print(root);
    spit("config.json", out, strlen(out));
    cJSON_free(out);
    cJSON_Delete(root);
    tl_status st = load_work();
    reset();
    return st;
}
static tl_status load_with_field(const char *key, const char *value) {
    const char *const pair[1][2] = {{key, value}};
    return load_with_fields(1, pair);
}

/* Text load_with_header writes after the header's JSON (NULL: none), before the padding. */
static const char *header_tail;
static const char *header_find, *header_put; /* (the header's text with the first header_find as header_put) */

/* model.safetensors with its header rewritten by `edit` (data region unchanged). */
static tl_status load_with_header(void (*edit)(cJSON *header)) {
    char path[4200];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/model.safetensors", source);
    unsigned char *file = (unsigned char *)slurp(path, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | file[i];
    cJSON *header = cJSON_ParseWithLength((char *)file + 8, hlen);
    edit(header);
    char *json = cJSON_PrintUnformatted(header);
    const char *found = header_find ? strstr(json, header_find) : NULL;
    const size_t head = found ? (size_t)(found - json) : strlen(json);
    const char *rest = found ? found + strlen(header_find) : "";
    char *text = malloc(strlen(json) + (found ? strlen(header_put) : 0) + (header_tail ? strlen(header_tail) : 0) + 1);
    sprintf(text, "%.*s%s%s%s", (int)head, json, found ? header_put : "", rest, header_tail ? header_tail : "");
    cJSON_free(json);
    size_t tlen = strlen(text), padded = (tlen + 7) & ~(size_t)7;
    size_t out_len = 8 + padded + (len - 8 - hlen);
    unsigned char *out = malloc(out_len);
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(padded >> (8 * i));
    memset(out + 8, ' ', padded);
    memcpy(out + 8, text, tlen);
    memcpy(out + 8 + padded, file + 8 + hlen, len - 8 - hlen);
    spit("model.safetensors", out, out_len);
    free(out);
    free(text);
    free(file);
    cJSON_Delete(header);
    tl_status st = load_work();
    reset();
    return st;
}

static void drop_q(cJSON *h) { cJSON_DeleteItemFromObjectCaseSensitive(h, "block.0.attn.q.weight"); }
/* An empty tensor at the very end of the data region: well-formed, but unknown. */
static void add_extra(cJSON *h) {
    double end = 0;
    for (cJSON *e = h->child; e; e = e->next) {
        cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
        if (off && cJSON_GetArrayItem(off, 1)->valuedouble > end) end = cJSON_GetArrayItem(off, 1)->valuedouble;
    }
    char spec[160];
    snprintf(spec, sizeof spec, "{\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [%.0f, %.0f]}", end, end);
    cJSON_AddItemToObject(h, "mystery.weight", cJSON_Parse(spec));
}
static void set_dtype(cJSON *h, const char *dt) {
    cJSON *t = cJSON_GetObjectItemCaseSensitive(h, "final_norm.weight");
    cJSON_ReplaceItemInObjectCaseSensitive(t, "dtype", cJSON_CreateString(dt));
}
static void dtype_i32(cJSON *h) { set_dtype(h, "I32"); }
static void dtype_q4(cJSON *h) { set_dtype(h, "Q4"); }
static void shape_lies(cJSON *h) {
    cJSON *t = cJSON_GetObjectItemCaseSensitive(h, "final_norm.weight");
    cJSON_ReplaceItemInObjectCaseSensitive(t, "shape", cJSON_Parse("[3]"));
}
static void overlap(cJSON *h) {
    cJSON *a = cJSON_GetObjectItemCaseSensitive(h, "final_norm.weight");
    cJSON *b = cJSON_GetObjectItemCaseSensitive(h, "final_norm.bias");
    cJSON_ReplaceItemInObjectCaseSensitive(b, "data_offsets",
        cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(a, "data_offsets"), 1));
}
static void bad_offsets(cJSON *h) {
    cJSON *t = cJSON_GetObjectItemCaseSensitive(h, "final_norm.weight");
    cJSON_ReplaceItemInObjectCaseSensitive(t, "data_offsets", cJSON_Parse("[\"a\", 4]"));
}
static void not_object(cJSON *h) {
    cJSON_ReplaceItemInObjectCaseSensitive(h, "final_norm.weight", cJSON_CreateNumber(3));
}

static void config_errors(void) {
    CHECK(load_with_field("extra_metadata", "{\"anything\": [1, 2]}") == TL_OK,
          "unknown field must be ignored: %s", tl_last_error());
    CHECK_ERROR(load_with_field("vocab_size", NULL), TL_ERR_FORMAT, "missing required field \"vocab_size\"");
    CHECK_ERROR(load_with_field("vocab_size", "\"abc\""), TL_ERR_FORMAT, "\"vocab_size\" must be an integer, got \"abc\"");
    CHECK_ERROR(load_with_field("d_model", "0"), TL_ERR_FORMAT, "\"d_model\" = 0 is out of range");
    CHECK_ERROR(load_with_field("d_model", "2.5"), TL_ERR_FORMAT, "\"d_model\" must be an integer, got 2.5");
    CHECK_ERROR(load_with_field("n_heads", "5"), TL_ERR_FORMAT, "not divisible by n_heads = 5");
    CHECK_ERROR(load_with_field("n_kv_heads", "3"), TL_ERR_FORMAT, "n_kv_heads = 3 must divide n_heads");
    CHECK_ERROR(load_with_field("n_prelude", "-1"), TL_ERR_FORMAT, "\"n_prelude\" = -1 is out of range");
    CHECK_ERROR(load_with_field("default_loops", "0"), TL_ERR_FORMAT, "\"default_loops\" = 0");
    CHECK_ERROR(load_with_field("max_loops", "1"), TL_ERR_FORMAT, "max_loops = 1 is below default_loops");
    /* The engine's ceiling of loops (README "The model format"), where SPEC's default max_loops
       (4 x default_loops) stops too. */
    CHECK_ERROR(load_with_field("max_loops", "4097"), TL_ERR_FORMAT, "field \"max_loops\" = 4097 is out of range [1, 4096]");
    CHECK_ERROR(load_with_field("default_loops", "4097"), TL_ERR_FORMAT, "\"default_loops\" = 4097 is out of range [1, 4096]");
    const char *const deep[2][2] = {{"max_loops", NULL}, {"default_loops", "1024"}};
    CHECK(load_with_fields(2, deep) == TL_OK && loaded_max_loops == 4096, "default_loops 1024: max_loops %d",
          loaded_max_loops);
    const char *const deeper[2][2] = {{"max_loops", NULL}, {"default_loops", "2000"}};
    CHECK(load_with_fields(2, deeper) == TL_OK && loaded_max_loops == 4096, "default_loops 2000: max_loops %d",
          loaded_max_loops);
    const char *const shallow[2][2] = {{"max_loops", NULL}, {"default_loops", "3"}};
    CHECK(load_with_fields(2, shallow) == TL_OK && loaded_max_loops == 12, "default_loops 3: max_loops %d (4 x)",
          loaded_max_loops);
    CHECK_ERROR(load_with_field("beta", "-0.5"), TL_ERR_FORMAT, "\"beta\" = -0.5 is out of range");
    CHECK_ERROR(load_with_field("beta", "\"big\""), TL_ERR_FORMAT, "\"beta\" must be a number");
    CHECK_ERROR(load_with_field("norm_eps", "0"), TL_ERR_FORMAT, "\"norm_eps\" = 0 is out of range");
    CHECK_ERROR(load_with_field("norm_eps", "1e-60"), TL_ERR_FORMAT, "\"norm_eps\" = 1e-60 rounds to 0 as a float");
    CHECK_ERROR(load_with_field("beta", "1e-50"), TL_ERR_FORMAT, "\"beta\" = 1e-50 rounds to 0 as a float");
    CHECK_ERROR(load_with_field("injection", "\"mul\""), TL_ERR_FORMAT, "\"injection\" = \"mul\" is not one of");
    CHECK_ERROR(load_with_field("loop_update", "\"average\""), TL_ERR_FORMAT, "\"loop_update\" = \"average\"");
    CHECK_ERROR(load_with_field("norm", "\"batchnorm\""), TL_ERR_FORMAT, "\"norm\" = \"batchnorm\"");
    CHECK_ERROR(load_with_field("norm", NULL), TL_ERR_FORMAT, "missing required field \"norm\"");
    CHECK_ERROR(load_with_field("mlp", "\"relu\""), TL_ERR_FORMAT, "\"mlp\" = \"relu\"");
    CHECK_ERROR(load_with_field("pos_encoding", "\"alibi\""), TL_ERR_FORMAT, "\"pos_encoding\" = \"alibi\"");
    CHECK_ERROR(load_with_field("state_norm", "\"yes\""), TL_ERR_FORMAT, "\"state_norm\" must be true or false, got \"yes\"");
    CHECK_ERROR(load_with_field("eos_token_id", "100000"), TL_ERR_FORMAT, "\"eos_token_id\" = 100000 is out of range");
    CHECK_ERROR(load_with_field("rope_theta", "-1"), TL_ERR_FORMAT, "\"rope_theta\" = -1");
    /* Valid config, inconsistent with the tensors. */
    CHECK_ERROR(load_with_field("d_ff", "100"), TL_ERR_FORMAT, "config.json implies [100, ");
    CHECK_ERROR(load_with_field("bias", "false"), TL_ERR_FORMAT, "unexpected tensor \"");
    CHECK_ERROR(load_with_field("injection", "\"add\""), TL_ERR_FORMAT, "unexpected tensor \"inject.");
    CHECK_ERROR(load_with_field("n_block", "5"), TL_ERR_FORMAT, "missing tensor \"block.");
    CHECK_ERROR(load_with_field("tie_embeddings", "true"), TL_ERR_FORMAT, "unexpected tensor \"lm_head.weight\" (not used by this config: tie_embeddings is true)");
    CHECK_ERROR(load_with_field("mlp", "\"swiglu\""), TL_ERR_FORMAT, "mlp.gate.weight");
    CHECK_ERROR(load_with_field("norm", "\"rmsnorm\""), TL_ERR_FORMAT, "norm.bias\"");
    /* Ouro's exit gate in our format: its tensors are required, its threshold is a probability. */
    CHECK_ERROR(load_with_field("exit_gate", "true"), TL_ERR_FORMAT, "missing tensor \"exit_gate.weight\"");
    CHECK_ERROR(load_with_field("exit_gate", "1"), TL_ERR_FORMAT, "\"exit_gate\" must be true or false, got 1");
    CHECK_ERROR(load_with_field("exit_gate_threshold", "1.5"), TL_ERR_FORMAT, "\"exit_gate_threshold\" = 1.5 is out of range");

    spit("config.json", "{\"vocab_size\": 12,", 18);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "config.json: not valid JSON (error near line 1");
    spit("config.json", "[1, 2]", 6);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "top level must be a JSON object");
    reset();
}

static void file_errors(void) {
    char path[512];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/model.safetensors", work);
    char *file = slurp(path, &len);

    spit("model.safetensors", file, len - 100);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "truncated file?");
    /* one byte short: the last tensor's end (a bound off by one read past the data) */
    spit("model.safetensors", file, len - 1);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "truncated file?");
    spit("model.safetensors", file, 5);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "too short for a safetensors header");
    unsigned char huge[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, '{', '}'};
    spit("model.safetensors", huge, sizeof huge);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "exceeds the file size");
    file[9] = '#';
    spit("model.safetensors", file, len);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "header is not a valid JSON object");
    free(file);
    reset();

    CHECK_ERROR(load_with_header(drop_q), TL_ERR_FORMAT, "missing tensor \"block.0.attn.q.weight\"");
    CHECK_ERROR(load_with_header(add_extra), TL_ERR_FORMAT, "unexpected tensor \"mystery.weight\"");
    CHECK_ERROR(load_with_header(dtype_i32), TL_ERR_FORMAT, "final_norm.weight\" has dtype I32");
    CHECK_ERROR(load_with_header(dtype_q4), TL_ERR_FORMAT, "unknown dtype Q4");
    CHECK_ERROR(load_with_header(shape_lies), TL_ERR_FORMAT, "but its shape and dtype need");
    CHECK_ERROR(load_with_header(overlap), TL_ERR_FORMAT, "overlap");
    CHECK_ERROR(load_with_header(bad_offsets), TL_ERR_FORMAT, "invalid data_offsets");
    CHECK_ERROR(load_with_header(not_object), TL_ERR_FORMAT, "is not an object");

    snprintf(path, sizeof path, "%s/model.safetensors", work);
    unlink(path);
    CHECK_ERROR(load_work(), TL_ERR_IO, "model.safetensors: cannot open");
    reset();
    snprintf(path, sizeof path, "%s/config.json", work);
    unlink(path);
    CHECK_ERROR(load_work(), TL_ERR_IO, "config.json: cannot open");
    reset();
}

static void api_errors(void) {
    tl_model *m = NULL;
    CHECK_ERROR(tl_model_load("/nonexistent/model", NULL, &m), TL_ERR_IO, "/nonexistent/model");
    CHECK(m == NULL, "out must be NULL after a failed load");
    snprintf(source + strlen(source), 32, "%s", "");
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", source);
    CHECK_ERROR(tl_model_load(path, NULL, &m), TL_ERR_IO, "is not a directory");
    CHECK_ERROR(tl_model_load(NULL, NULL, &m), TL_ERR_INVALID_ARGUMENT, "dir must not be NULL");
    CHECK_ERROR(tl_model_load(work, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "out must not be NULL");
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = -2;
    CHECK_ERROR(tl_model_load(work, &o, &m), TL_ERR_INVALID_ARGUMENT, "n_threads = -2");
    o.n_threads = TL_MAX_THREADS + 1;
    CHECK_ERROR(tl_model_load(work, &o, &m), TL_ERR_INVALID_ARGUMENT, "n_threads = 1025");
    o.n_threads = TL_MAX_THREADS; /* (the most is taken) */
    CHECK(tl_model_load(work, &o, &m) == TL_OK && tl_model_info(m)->n_threads == TL_MAX_THREADS, "n_threads = %d: %s",
          TL_MAX_THREADS, tl_last_error());
    tl_model_free(m);
    m = NULL;
    tl_load_options_init(&o);
    o.mmap_weights = 2;
    CHECK_ERROR(tl_model_load(work, &o, &m), TL_ERR_INVALID_ARGUMENT, "load options: mmap_weights = 2 must be 0 or 1");
    tl_load_options_init(&o);
    o.backend = TL_BACKEND_CUDA;
    if (tl_model_load(work, &o, &m) == TL_OK) tl_model_free(m); /* a machine with a GPU */
    else CHECK(strstr(tl_last_error(), "backend CUDA") != NULL, "CUDA refusal: %s", tl_last_error());
    m = NULL;
    tl_model_free(NULL);
    /* a setting of the environment that nothing reads is refused (it was the default,
       silently); an empty one is no setting */
    static const char *const bogus[][2] = {{"TINYLOOP_ISA", "avx-512"}, {"TINYLOOP_BACKEND", "gpu"},
                                           {"TINYLOOP_KV_TYPE", "F16"}, {"TINYLOOP_F16_HALVES", "yes"},
                                           {"TINYLOOP_PAIR_TILES", "2"}};
    for (size_t i = 0; i < sizeof bogus / sizeof bogus[0]; i++) {
        const char *was = getenv(bogus[i][0]);
        char *saved = was ? strdup(was) : NULL;
        setenv(bogus[i][0], bogus[i][1], 1);
        char expected[96];
        snprintf(expected, sizeof expected, "environment: %s=%s is not one of", bogus[i][0], bogus[i][1]);
        CHECK_ERROR(tl_model_load(work, NULL, &m), TL_ERR_INVALID_ARGUMENT, expected);
        CHECK(m == NULL, "no model after a refused environment");
        setenv(bogus[i][0], "", 1);
        CHECK(tl_model_load(work, NULL, &m) == TL_OK, "%s empty: %s", bogus[i][0], tl_last_error());
        tl_model_free(m);
        m = NULL;
        if (saved) setenv(bogus[i][0], saved, 1);
        else unsetenv(bogus[i][0]);
        free(saved);
    }

    CHECK(tl_model_load(work, NULL, &m) == TL_OK, "load: %s", tl_last_error());
    const struct tl_model_info *info = tl_model_info(m);
    int32_t tokens[4] = {1, 2, 3, 4};
    float *logits = malloc((size_t)4 * (size_t)info->vocab_size * sizeof(float));
    CHECK_ERROR(tl_score(NULL, tokens, 4, 1, logits), TL_ERR_INVALID_ARGUMENT, "model must not be NULL");
    CHECK_ERROR(tl_score(m, NULL, 4, 1, logits), TL_ERR_INVALID_ARGUMENT, "must not be NULL");
    CHECK_ERROR(tl_score(m, tokens, 0, 1, logits), TL_ERR_INVALID_ARGUMENT, "n = 0 is out of range");
    CHECK_ERROR(tl_score(m, tokens, info->max_seq_len + 1, 1, logits), TL_ERR_INVALID_ARGUMENT, "max_seq_len");
    CHECK_ERROR(tl_score(m, tokens, 4, 0, logits), TL_ERR_INVALID_ARGUMENT, "loops = 0 is out of range");
    CHECK_ERROR(tl_score(m, tokens, 4, info->max_loops + 1, logits), TL_ERR_INVALID_ARGUMENT, "max_loops");
    tokens[2] = info->vocab_size;
    CHECK_ERROR(tl_score(m, tokens, 4, 1, logits), TL_ERR_INVALID_ARGUMENT, "at index 2 is out of range");
    tokens[2] = -1;
    CHECK_ERROR(tl_score(m, tokens, 4, 1, logits), TL_ERR_INVALID_ARGUMENT, "token id -1");
    tokens[2] = 3;
    CHECK(tl_score(m, tokens, 4, 1, logits) == TL_OK && tl_last_error()[0] == '\0',
          "a good call clears the error: %s", tl_last_error());
    CHECK(strcmp(tl_status_name(TL_ERR_FORMAT), "TL_ERR_FORMAT") == 0, "status name");
    free(logits);
    tl_model_free(m);
}

/* ---------------------------------------------------------------- robustness (issue 11) */

static void spit_text(const char *name, const char *text) { spit(name, text, strlen(text)); }

static void path_in_work(char *path, size_t len, const char *name) { snprintf(path, len, "%s/%s", work, name); }

/* config.json = the source config with `key` written as the raw JSON text `raw` (which cJSON
   could not round-trip, e.g. 1e400). */
static tl_status load_with_raw(const char *key, const char *raw) {
    char path[4200];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/config.json", source);
    char *text = slurp(path, &len);
    cJSON *root = cJSON_Parse(text);
    free(text);
    cJSON_DeleteItemFromObjectCaseSensitive(root, key);
    char *out = cJSON_Print(root);
    char *buf = malloc(strlen(out) + strlen(key) + strlen(raw) + 16);
    sprintf(buf, "{\"%s\": %s, %s", key, raw, strchr(out, '{') + 1);
    spit_text("config.json", buf);
    free(buf);
    cJSON_free(out);
    cJSON_Delete(root);
    tl_status st = load_work();
    reset();
    return st;
}

/* Finding 14: config.json leniency; finding 13: "1e400" named as such. */
static void config_strictness(void) {
    char path[4200];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/config.json", source);
    char *text = slurp(path, &len);
    char *buf = malloc(len + 64);

    /* Duplicate key: the first one used to win silently. */
    snprintf(buf, len + 64, "{\"d_model\": 64, %s", strchr(text, '{') + 1);
    spit_text("config.json", buf);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "config.json: duplicate key \"d_model\"");
    /* Trailing garbage after the object. */
    snprintf(buf, len + 64, "%s\n}garbage", text);
    spit_text("config.json", buf);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "unexpected text after the JSON value: \"}garbage\"");
    snprintf(buf, len + 64, "%s \n\t", text); /* trailing whitespace is fine */
    spit_text("config.json", buf);
    CHECK(load_work() == TL_OK, "trailing whitespace: %s", tl_last_error());
    /* A number JSON has not (cJSON read 064 as 64) and a \u escape without four hex digits
       (cJSON read it as U+0000: "add\uqqqq" loaded as "add"). */
    snprintf(buf, len + 64, "{\"d_model\": 064, %s", strchr(text, '{') + 1);
    spit_text("config.json", buf);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "config.json: '064' at line 1, column 13 is no JSON number");
    snprintf(buf, len + 64, "{\"note\": \"a\\uqqqq\", %s", strchr(text, '{') + 1);
    spit_text("config.json", buf);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "config.json: a \\u escape without four hex digits at line 1, column 12");
    /* A byte order mark. */
    snprintf(buf, len + 64, "\xEF\xBB\xBF%s", text);
    spit_text("config.json", buf);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "byte order mark");
    /* A NUL byte: what follows it must not be ignored unseen. */
    memcpy(buf, text, len);
    memcpy(buf + len, "\0{}", 3);
    spit("config.json", buf, len + 3);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "contains a NUL byte at offset");
    reset();
    free(buf);
    free(text);

    CHECK_ERROR(load_with_raw("d_model", "1e400"), TL_ERR_FORMAT,
                "\"d_model\" = a number beyond the range of a double is out of range");
    CHECK_ERROR(load_with_raw("beta", "-1e400"), TL_ERR_FORMAT,
                "\"beta\" must be a number, got a number beyond the range of a double");

    /* Unknown fields load (SPEC §1) but are reported; a misspelling gets a suggestion. */
    tl_model *m = NULL;
    CHECK(tl_model_load(work, NULL, &m) == TL_OK && strcmp(tl_model_warnings(m), "") == 0,
          "a clean config has no warnings: \"%s\"", m ? tl_model_warnings(m) : "");
    tl_model_free(m);
    CHECK(strcmp(tl_model_warnings(NULL), "") == 0, "warnings of NULL");
    snprintf(path, sizeof path, "%s/config.json", source);
    text = slurp(path, &len);
    cJSON *root = cJSON_Parse(text);
    free(text);
    cJSON_AddItemToObject(root, "rope_theeta", cJSON_CreateNumber(500000));
    cJSON_AddItemToObject(root, "architectures", cJSON_Parse("[\"LoopLM\"]"));
    cJSON_AddItemToObject(root, "x\n\x1b[31m\"", cJSON_CreateNumber(1)); /* (a name that would break the line) */
    char *out = cJSON_Print(root);
    spit_text("config.json", out);
    cJSON_free(out);
    cJSON_Delete(root);
    m = NULL;
    CHECK(tl_model_load(work, NULL, &m) == TL_OK, "unknown fields load: %s", tl_last_error());
    const char *w = m ? tl_model_warnings(m) : "";
    CHECK(strstr(w, "config.json: unknown field \"rope_theeta\" ignored (did you mean \"rope_theta\"?)\n") != NULL,
          "misspelling reported: \"%s\"", w);
    CHECK(strstr(w, "config.json: unknown field \"architectures\" ignored\n") != NULL, "metadata reported: \"%s\"", w);
    /* one line each: a name's control bytes escaped */
    CHECK(strstr(w, "config.json: unknown field \"x\\x0a\\x1b[31m\\x22\" ignored\n") != NULL && !strchr(w, '\x1b'),
          "control bytes in a name: \"%s\"", w);
    tl_model_free(m);
    reset();
}

/* A message is whole however long the checkpoint's path: the tokenizer's reason was copied
   through a 512-byte buffer and cut mid-path under a directory of ~450 bytes. */
static void long_path_message(void) {
    char deep[1024], link_path[1200], target[600];
    snprintf(deep, sizeof deep, "%s/", work);
    for (int level = 0; level < 2; level++) {
        const size_t at = strlen(deep);
        memset(deep + at, 'd', 200);
        deep[at + 200] = '\0';
        CHECK(mkdir(deep, 0700) == 0, "mkdir %s", deep);
        strcat(deep, "/");
    }
    const char *files[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        snprintf(link_path, sizeof link_path, "%s%s", deep, files[i]);
        path_in_work(target, sizeof target, files[i]);
        CHECK(symlink(target, link_path) == 0, "symlink %s", link_path);
    }
    char tokenizer[1200];
    snprintf(tokenizer, sizeof tokenizer, "%stokenizer.json", deep);
    FILE *fp = fopen(tokenizer, "wb");
    CHECK(fp != NULL, "%s", tokenizer);
    if (fp) {
        fputs("{\"version\": \"1.0\", \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\", 1]}, "
              "\"added_tokens\": []}", fp);
        fclose(fp);
    }
    tl_model *m = NULL;
    deep[strlen(deep) - 1] = '\0'; /* (the directory as a caller names it) */
    const tl_status st = tl_model_load(deep, NULL, &m);
    strcat(deep, "/");
    CHECK(st == TL_ERR_FORMAT && strlen(tl_last_error()) > 512 && strstr(tl_last_error(), tokenizer) != NULL,
          "%s: the message names %s whole (%zu bytes): %s", tl_status_name(st), tokenizer, strlen(tl_last_error()),
          tl_last_error());
    tl_model_free(m);
    unlink(tokenizer);
    for (int i = 0; i < 2; i++) {
        snprintf(link_path, sizeof link_path, "%s%s", deep, files[i]);
        unlink(link_path);
    }
    for (int level = 0; level < 2; level++) {
        deep[strlen(deep) - 1] = '\0';
        rmdir(deep);
        *strrchr(deep, '/') = '\0';
        strcat(deep, "/");
    }
}

/* A message longer than tl_last_error holds keeps its reason: a path of 3,900 bytes was 1,023
   bytes of path and nothing else ("load: TL_ERR_FORMAT: /tmp/.../dddd"). */
static void very_long_path_message(void) {
    char deep[4200];
    snprintf(deep, sizeof deep, "%s", work);
    int levels = 0;
    while (strlen(deep) + 1 + 200 < 3900) {
        const size_t at = strlen(deep);
        deep[at] = '/';
        memset(deep + at + 1, 'd', 200);
        deep[at + 201] = '\0';
        CHECK(mkdir(deep, 0700) == 0, "mkdir %s", deep);
        levels++;
    }
    char file[4300];
    snprintf(file, sizeof file, "%s/config.json", deep);
    FILE *fp = fopen(file, "wb");
    CHECK(fp != NULL, "%s", file);
    if (fp) {
        fputs("{\"vocab_size\": 1,}", fp);
        fclose(fp);
    }
    tl_model *m = NULL;
    const tl_status st = tl_model_load(deep, NULL, &m);
    const char *msg = tl_last_error();
    CHECK(st == TL_ERR_FORMAT && strstr(msg, "config.json: not valid JSON (error near line 1, column ") != NULL &&
              strstr(msg, " ... ") != NULL && strncmp(msg, work, strlen(work)) == 0,
          "%s: the message keeps its start and its reason: %s", tl_status_name(st), msg);
    tl_model_free(m);
    unlink(file);
    for (int level = 0; level < levels; level++) {
        rmdir(deep);
        *strrchr(deep, '/') = '\0';
    }
}

/* A message longer than the formatting buffer (8 KiB) too keeps whole UTF-8 characters: cut
   by vsnprintf, its end was half a character (the server writes messages into JSON). */
static bool valid_utf8(const char *s) {
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        const int n = *p < 0x80 ? 1 : (*p & 0xE0) == 0xC0 ? 2 : (*p & 0xF0) == 0xE0 ? 3 : (*p & 0xF8) == 0xF0 ? 4 : 0;
        if (n == 0) return false;
        for (int k = 1; k < n; k++)
            if ((p[k] & 0xC0) != 0x80) return false;
        p += n;
    }
    return true;
}
static void huge_message_keeps_characters(void) {
    static char text[9001];
    for (int shift = 0; shift < 3; shift++) {
        memset(text, 'a', (size_t)shift);
        for (size_t i = (size_t)shift; i + 3 <= 9000; i += 3) memcpy(text + i, "\xe2\x82\xac", 3); /* euros */
        text[9000 - (9000 - shift) % 3] = '\0';
        tl_fail(TL_ERR_FORMAT, "%s", text);
        CHECK(strlen(tl_last_error()) < 1024 && valid_utf8(tl_last_error()) && strstr(tl_last_error(), " ... "),
              "a message of %zu bytes kept as %zu bytes of valid UTF-8", strlen(text), strlen(tl_last_error()));
    }
}

/* cJSON returns NULL for text it refuses and for a malloc that failed: the loader told them
   apart with tl_json_value_parses, which must never accept what cJSON refuses (else a bad
   file would be said to be out of memory), and should accept what cJSON reads. */
static void check_recognizer(const char *text, size_t len, int want) {
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, NULL, false);
    const int cjson = root != NULL, ours = tl_json_value_parses(text, len);
    cJSON_Delete(root);
    if (want >= 0) CHECK(ours == want, "tl_json_value_parses(%.*s) = %d, want %d", (int)len, text, ours, want);
    CHECK(!ours || cjson, "tl_json_value_parses accepts what cJSON refuses: %.*s", (int)len, text);
}

static void json_recognizer(void) {
    static const struct { const char *text; int valid; } cases[] = {
        {"{}", 1}, {"[]", 1}, {" {\"a\" : [1, -2.5e+3, true, false, null, \"x\\u00e9\\n\"]}\n", 1}, {"0", 1}, {"\"s\"", 1},
        {"{\"a\":{\"b\":[{}]}} trailing", 1}, /* (one value: cJSON reads no further either) */
        {"\"\\ud83d\\ude00\"", 1}, {"{\"a\":\"b\",\"c\":\"d\"}", 1},
        {"", 0}, {"{", 0}, {"[1,]", 0}, {"{\"a\":1,}", 0}, {"{\"a\" 1}", 0}, {"{\"a\":\"b\":1}", 0}, {"{1:2}", 0},
        {"[1 2]", 0}, {"tru", 0}, {"nul", 0}, {"01", 0}, {"1.", 0}, {"-", 0}, {"+1", 0}, {"\"\\x\"", 0},
        {"\"\\ud83d\"", 0}, {"\"\\ude00\"", 0}, {"\"\\ud83d\\u0041\"", 0}, {"\"\\u12\"", 0}, {"\"abc", 0},
        {"\"a\tb\"", 0}, {"[1]]", 1}, {"{\"a\":[}", 0}, {"[{]}", 0}, {"]", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) check_recognizer(cases[i].text, strlen(cases[i].text), cases[i].valid);
    /* cJSON's limits: a number of at most 63 bytes, at most 1000 open containers */
    char text[4100];
    for (int digits = 62; digits <= 64; digits++) {
        memset(text, '7', (size_t)digits);
        check_recognizer(text, (size_t)digits, -1);
    }
    for (int depth = 990; depth <= 1002; depth++) {
        memset(text, '[', (size_t)depth);
        memset(text + depth, ']', (size_t)depth);
        check_recognizer(text, 2 * (size_t)depth, -1);
        check_recognizer(text, 2 * (size_t)depth - 1, 0);
    }
    memset(text, '[', 999), memset(text + 999, ']', 999);
    check_recognizer(text, 2 * 999, 1);
    /* every cut and one-byte change of a document with every kind of value */
    static const char doc[] = "{\"k\": [1, -0.5, 2e-3, true, false, null, \"t\\\"\\u00e9\\ud83d\\ude00\"], \"o\": {\"x\": {}}, \"e\": []}";
    const size_t doc_len = sizeof doc - 1;
    static const char bytes[] = "{}[]:,\"\\ u0aZe.-+1tfn\t";
    for (size_t cut = 0; cut <= doc_len; cut++) check_recognizer(doc, cut, cut == doc_len ? 1 : -1);
    for (size_t at = 0; at < doc_len; at++)
        for (size_t b = 0; b < sizeof bytes - 1; b++) {
            memcpy(text, doc, doc_len);
            text[at] = bytes[b];
            check_recognizer(text, doc_len, -1);
        }
}

/* A failed malloc inside cJSON is out of memory, not "not valid JSON": a user told so of a
   good file replaces it. Every allocation cJSON makes while the checkpoint loads fails in
   turn (cJSON's hooks, the process's own here). */
static long cjson_allocations, cjson_fail_at;
static void *cjson_malloc(size_t size) { return ++cjson_allocations == cjson_fail_at ? NULL : malloc(size); }

static void json_out_of_memory(void) {
    cJSON_Hooks hooks = {cjson_malloc, free};
    cJSON_InitHooks(&hooks);
    cjson_allocations = 0, cjson_fail_at = 0;
    CHECK(load_work() == TL_OK, "the copy loads: %s", tl_last_error());
    const long total = cjson_allocations;
    int no_memory = 0;
    for (long n = 1; n <= total; n += 1 + total / 200) {
        cjson_allocations = 0, cjson_fail_at = n;
        const tl_status st = load_work();
        if (st == TL_OK) continue;
        no_memory++;
        CHECK(st == TL_ERR_NO_MEMORY && strstr(tl_last_error(), "out of memory") != NULL,
              "cJSON's allocation %ld of %ld failing: %s %s", n, total, tl_status_name(st), tl_last_error());
    }
    CHECK(total > 0 && no_memory > 0, "%ld cJSON allocations, %d failed loads", total, no_memory);
    cJSON_InitHooks(NULL);
}

/* Finding 7 (and the dangling symlink of 14): checkpoint files must be regular files; nothing
   may block. SIGALRM turns a hang (the bug) into a failed test. */
static void special_files(void) {
    char path[4200], other[4200];
    alarm(20);
    const char *names[] = {"config.json", "model.safetensors", "tokenizer.json"};
    for (int i = 0; i < 3; i++) {
        path_in_work(path, sizeof path, names[i]);
        unlink(path);
        CHECK(mkfifo(path, 0600) == 0, "mkfifo");
        CHECK_ERROR(load_work(), TL_ERR_IO, "is a FIFO, not a regular file");
        unlink(path);
        CHECK(mkdir(path, 0700) == 0, "mkdir");
        CHECK_ERROR(load_work(), TL_ERR_IO, "is a directory, not a regular file");
        rmdir(path);
        CHECK(symlink("/dev/zero", path) == 0, "symlink");
        CHECK_ERROR(load_work(), TL_ERR_IO, "is a device, not a regular file");
        unlink(path);
        reset();
    }
    alarm(0);
    /* A dangling tokenizer.json symlink used to load silently without a tokenizer. */
    path_in_work(path, sizeof path, "tokenizer.json");
    path_in_work(other, sizeof other, "missing.json");
    CHECK(symlink(other, path) == 0, "symlink");
    CHECK_ERROR(load_work(), TL_ERR_IO, "tokenizer.json: is a dangling symbolic link");
    unlink(path);
    /* An oversized tokenizer.json is refused before anything is read (sparse: no disk used). */
    FILE *fp = fopen(path, "wb");
    CHECK(fp && ftruncate(fileno(fp), (off_t)(257L << 20)) == 0, "ftruncate");
    if (fp) fclose(fp);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "exceeds the limit of 268435456 bytes");
    unlink(path);
    path_in_work(path, sizeof path, "config.json");
    fp = fopen(path, "wb");
    CHECK(fp && ftruncate(fileno(fp), (off_t)(65L << 20)) == 0, "ftruncate");
    if (fp) fclose(fp);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "config.json: 68157440 bytes exceeds the limit");
    reset();
}

/* Finding 4: a NaN or inf weight is refused at load, naming the tensor and the index. */
static tl_status load_poisoned(const char *dir, const char *tensor, long index, const char *what) {
    char path[4200];
    size_t len = 0, clen = 0;
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *config = slurp(path, &clen);
    spit("config.json", config, clen);
    free(config);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unsigned char *file = (unsigned char *)slurp(path, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | file[i];
    cJSON *header = cJSON_ParseWithLength((char *)file + 8, hlen);
    cJSON *t = cJSON_GetObjectItemCaseSensitive(header, tensor);
    const char *dtype = cJSON_GetObjectItemCaseSensitive(t, "dtype")->valuestring;
    size_t at = 8 + hlen + (size_t)cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(t, "data_offsets"), 0)->valuedouble;
    const int nan = strcmp(what, "NaN") == 0, neg = strcmp(what, "-inf") == 0;
    if (strcmp(dtype, "F32") == 0) {
        uint32_t bits = nan ? 0x7fc00001u : neg ? 0xff800000u : 0x7f800000u;
        memcpy(file + at + 4 * index, &bits, 4);
    } else {
        uint16_t bits = strcmp(dtype, "F16") == 0 ? (nan ? 0x7e01 : neg ? 0xfc00 : 0x7c00)
                                                 : (nan ? 0x7fc1 : neg ? 0xff80 : 0x7f80);
        memcpy(file + at + 2 * index, &bits, 2);
    }
    spit("model.safetensors", file, len);
    free(file);
    cJSON_Delete(header);
    tl_status st = load_work();
    reset();
    return st;
}

static void nonfinite_weights(void) {
    char dir[4300], golden[4200];
    snprintf(golden, sizeof golden, "%s", source);
    char *slash = strrchr(golden, '/');
    if (slash) *slash = '\0';
    CHECK_ERROR(load_poisoned(source, "block.0.mlp.down.weight", 37, "NaN"), TL_ERR_FORMAT,
                "tensor \"block.0.mlp.down.weight\" has a non-finite value (NaN) at index 37");
    CHECK_ERROR(load_poisoned(source, "final_norm.bias", 3, "+inf"), TL_ERR_FORMAT,
                "tensor \"final_norm.bias\" has a non-finite value (+inf) at index 3");
    snprintf(dir, sizeof dir, "%s/f16_concat_residual_gqa", golden);
    CHECK_ERROR(load_poisoned(dir, "tok_embed.weight", 100, "-inf"), TL_ERR_FORMAT,
                "tensor \"tok_embed.weight\" has a non-finite value (-inf) at index 100");
    /* Past the scan's first block of 4096 elements, and the very last element. */
    CHECK_ERROR(load_poisoned(dir, "tok_embed.weight", 5000, "NaN"), TL_ERR_FORMAT,
                "tensor \"tok_embed.weight\" has a non-finite value (NaN) at index 5000");
    snprintf(dir, sizeof dir, "%s/bf16_tied_rope_residual", golden);
    CHECK_ERROR(load_poisoned(dir, "block.0.attn.v.weight", 0, "NaN"), TL_ERR_FORMAT,
                "tensor \"block.0.attn.v.weight\" has a non-finite value (NaN) at index 0");
    CHECK_ERROR(load_poisoned(dir, "tok_embed.weight", 112 * 48 - 1, "+inf"), TL_ERR_FORMAT,
                "tensor \"tok_embed.weight\" has a non-finite value (+inf) at index 5375");
    /* The largest finite values are fine. */
    CHECK(load_work() == TL_OK, "pristine copy loads: %s", tl_last_error());
}

/* Finding 13: fractional data_offsets are shown as they are, not rounded. */
/* A second entry of a name the header already has (cJSON keeps both). */
static void name_twice(cJSON *h) {
    cJSON_AddItemToObject(h, "final_norm.weight", cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(h, "final_norm.weight"), 1));
}
/* An empty tensor where another tensor's bytes begin: it shares no byte with it. */
static void empty_at_start(cJSON *h) {
    cJSON_AddItemToObject(h, "mystery.weight", cJSON_Parse("{\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]}"));
}
static void unchanged(cJSON *h) { (void)h; }

/* The header's own rules (review): a name given twice, text after the JSON object, and an
   empty tensor, which overlaps nothing. */
static void header_rules(void) {
    CHECK_ERROR(load_with_header(name_twice), TL_ERR_FORMAT, "duplicate key \"final_norm.weight\"");
    header_tail = " GARBAGE {\"x\": 1}";
    CHECK_ERROR(load_with_header(unchanged), TL_ERR_FORMAT, "the header is not a valid JSON object: unexpected text after the JSON value");
    /* the header read by the loader's rules for JSON files (it was plain cJSON's): a \u
       escape without four hex digits (a tensor "final_norm\uqqqq.weight" loaded as
       "final_norm"), a number JSON has not */
    header_tail = NULL;
    header_find = "\"final_norm.weight\"", header_put = "\"final_norm\\uqqqq.weight\"";
    CHECK_ERROR(load_with_header(unchanged), TL_ERR_FORMAT, "a \\u escape without four hex digits");
    header_find = "\"shape\":[", header_put = "\"shape\":[0";
    CHECK_ERROR(load_with_header(unchanged), TL_ERR_FORMAT, "is no JSON number");
    header_find = NULL;
    CHECK(load_with_header(unchanged) == TL_OK, "the header as it was: %s", tl_last_error());
    header_tail = "  \n";
    CHECK(load_with_header(unchanged) == TL_OK, "blanks after the header's JSON load: %s", tl_last_error());
    header_tail = NULL;
    CHECK_ERROR(load_with_header(empty_at_start), TL_ERR_FORMAT, "mystery.weight");
    CHECK(!strstr(tl_last_error(), "overlap"), "an empty tensor overlaps nothing: %s", tl_last_error());
}

/* Writes file `name` of directory `from` into the work directory with `insertion` right after
   the first `after` in it; false when there is no `after`. */
static bool spit_with_inserted(const char *from, const char *name, const char *after, const char *insertion) {
    char path[4400];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/%s", from, name);
    char *text = slurp(path, &len);
    const char *at = strstr(text, after);
    if (at) {
        const size_t head = (size_t)(at - text) + strlen(after), size = len + strlen(insertion) + 1;
        char *out = malloc(size);
        snprintf(out, size, "%.*s%s%s", (int)head, text, insertion, text + head);
        spit_text(name, out);
        free(out);
    }
    free(text);
    return at != NULL;
}

/* A published family's config.json (Ouro's) by the same rules as ours (review): a float that
   rounds to 0 (a RoPE base of 0 made every logit NaN), a key given twice, and head_dim times
   the heads past an int (signed overflow). */
static void family_config_rules(void) {
    char golden[sizeof source];
    snprintf(golden, sizeof golden, "%s", source);
    if (strlen(golden) + 20 >= sizeof source) return; /* (a source path that long leaves no room) */
    memcpy(source + strlen(golden), "/../../hf/ouro_f32", 19);
    reset();
    CHECK(load_work() == TL_OK, "the Ouro copy loads: %s", tl_last_error());
    CHECK_ERROR(load_with_field("rope_theta", "1e-60"), TL_ERR_FORMAT, "\"rope_theta\" = 1e-60 rounds to 0 as a float");
    CHECK_ERROR(load_with_field("rms_norm_eps", "1e-60"), TL_ERR_FORMAT, "\"rms_norm_eps\" = 1e-60 rounds to 0");
    CHECK_ERROR(load_with_field("head_dim", "131074"), TL_ERR_UNSUPPORTED, "head_dim = 131074");
    CHECK(spit_with_inserted(source, "config.json", "{", "\"rope_theta\": 500000.0, "), "config.json has an object");
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "duplicate key \"rope_theta\"");
    /* Huginn's two names for a tied head must agree when both are given */
    memcpy(source + strlen(golden), "/../../hf/huginn_f32", 21);
    reset();
    CHECK(load_work() == TL_OK, "the Huginn copy loads: %s", tl_last_error());
    CHECK_ERROR(load_with_field("tie_word_embeddings", "false"), TL_ERR_FORMAT,
                "tie_word_embeddings = false and tie_embeddings = true disagree");
    CHECK_ERROR(load_with_field("rope_base", "1e-60"), TL_ERR_FORMAT, "\"rope_base\" = 1e-60 rounds to 0");
    /* a family's fields at their bounds and types: an id one past the vocabulary, a fraction,
       a number for a boolean */
    CHECK_ERROR(load_with_field("eos_token_id", "96"), TL_ERR_FORMAT, "field \"eos_token_id\" = 96 is out of range [0, 95]");
    CHECK(load_with_field("eos_token_id", "95") == TL_OK, "eos_token_id 95 (the last id): %s", tl_last_error());
    CHECK_ERROR(load_with_field("eos_token_id", "93.5"), TL_ERR_FORMAT, "field \"eos_token_id\" must be an integer, got 93.5");
    CHECK_ERROR(load_with_field("bias", "0"), TL_ERR_FORMAT, "field \"bias\" must be true or false, got 0");
    CHECK_ERROR(load_with_field("qk_bias", "1"), TL_ERR_FORMAT, "field \"qk_bias\" must be true or false, got 1");
    snprintf(source, sizeof source, "%s", golden);
    reset();
}

/* A sharded checkpoint's index (review): a tensor named twice in weight_map is refused, and
   an index that is a FIFO is refused, not waited on. */
static void index_rules(void) {
    char sharded[sizeof source + 64], path[4200];
    snprintf(sharded, sizeof sharded, "%s/../../hf/ouro_f32_sharded", source);
    const char *const names[] = {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                 "model.safetensors.index.json"};
    path_in_work(path, sizeof path, "model.safetensors");
    unlink(path);
    copy_into_work(sharded, names, 4);
    CHECK(load_work() == TL_OK, "the sharded copy loads: %s", tl_last_error());
    if (spit_with_inserted(sharded, "model.safetensors.index.json", "\"weight_map\": {",
                           "\"model.norm.weight\": \"model-00001-of-00002.safetensors\", "))
        CHECK_ERROR(load_work(), TL_ERR_FORMAT, "duplicate key \"model.norm.weight\" in \"weight_map\"");
    else
        CHECK(false, "the index has a weight_map");
    alarm(20);
    path_in_work(path, sizeof path, "model.safetensors.index.json");
    unlink(path);
    CHECK(mkfifo(path, 0600) == 0, "mkfifo");
    CHECK_ERROR(load_work(), TL_ERR_IO, "is a FIFO, not a regular file");
    unlink(path);
    char other[4200];
    path_in_work(other, sizeof other, "missing.json");
    CHECK(symlink(other, path) == 0, "symlink");
    CHECK_ERROR(load_work(), TL_ERR_IO, "is a dangling symbolic link");
    alarm(0);
    for (int i = 0; i < 4; i++) {
        path_in_work(path, sizeof path, names[i]);
        unlink(path);
    }
    reset();
}

static void fractional_offsets(cJSON *h) {
    cJSON *t = cJSON_GetObjectItemCaseSensitive(h, "final_norm.weight");
    cJSON_ReplaceItemInObjectCaseSensitive(t, "data_offsets", cJSON_Parse("[1.5, 4]"));
}
static void huge_offsets(cJSON *h) {
    cJSON *t = cJSON_GetObjectItemCaseSensitive(h, "final_norm.weight");
    cJSON_ReplaceItemInObjectCaseSensitive(t, "data_offsets", cJSON_Parse("[0, 1e300]"));
}

static void offsets_messages(void) {
    CHECK_ERROR(load_with_header(fractional_offsets), TL_ERR_FORMAT, "data_offsets [1.5, 4] must be integers");
    CHECK_ERROR(load_with_header(huge_offsets), TL_ERR_FORMAT, "data_offsets [0, 1.0000000000000001e+300] fall outside");
}

int main(int argc, char **argv) {
    snprintf(source, sizeof source, "%s", argc > 1 ? argv[1] : "tests/data/golden/concat_replace_bias");
    snprintf(work, sizeof work, "/tmp/tl_load_errors_XXXXXX");
    if (!mkdtemp(work)) { perror("mkdtemp"); return 1; }
    reset();
    CHECK(load_work() == TL_OK, "pristine copy must load: %s", tl_last_error());
    config_errors();
    file_errors();
    api_errors();
    config_strictness();
    special_files();
    long_path_message();
    very_long_path_message();
    huge_message_keeps_characters();
    json_recognizer();
    json_out_of_memory();
    nonfinite_weights();
    offsets_messages();
    header_rules();
    family_config_rules();
    index_rules();
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", work); unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", work); unlink(path);
    rmdir(work);
    return check_summary();
}

/* test_load_errors.c: every validation rule of checkpoint loading and tl_score, fed the
 * bad input, must return the right status and a message naming the problem. */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
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
static void reset(void) {
    const char *files[] = {"config.json", "model.safetensors"};
    for (int i = 0; i < 2; i++) {
        char path[4200];
        size_t len = 0;
        snprintf(path, sizeof path, "%s/%s", source, files[i]);
        char *data = slurp(path, &len);
        spit(files[i], data, len);
        free(data);
    }
}

static tl_status load_work(void) {
    tl_model *m = NULL;
    tl_status st = tl_model_load(work, NULL, &m);
    tl_model_free(m);
    return st;
}

/* config.json = the source config with `key` set to the JSON `value` (NULL = removed). */
static tl_status load_with_field(const char *key, const char *value) {
    char path[4200];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/config.json", source);
    char *text = slurp(path, &len);
    cJSON *root = cJSON_Parse(text);
    free(text);
    cJSON_DeleteItemFromObjectCaseSensitive(root, key);
    if (value) cJSON_AddItemToObject(root, key, cJSON_Parse(value));
    char *out = cJSON_Print(root);
    spit("config.json", out, strlen(out));
    cJSON_free(out);
    cJSON_Delete(root);
    tl_status st = load_work();
    reset();
    return st;
}

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
    char *text = cJSON_PrintUnformatted(header);
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
    CHECK_ERROR(load_with_field("beta", "-0.5"), TL_ERR_FORMAT, "\"beta\" = -0.5 is out of range");
    CHECK_ERROR(load_with_field("beta", "\"big\""), TL_ERR_FORMAT, "\"beta\" must be a number");
    CHECK_ERROR(load_with_field("norm_eps", "0"), TL_ERR_FORMAT, "\"norm_eps\" = 0 is out of range");
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

    spit("config.json", "{\"vocab_size\": 12,", 18);
    CHECK_ERROR(load_work(), TL_ERR_FORMAT, "config.json: invalid JSON");
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
    tl_load_options_init(&o);
    o.backend = TL_BACKEND_CUDA;
    CHECK_ERROR(tl_model_load(work, &o, &m), TL_ERR_UNSUPPORTED, "CUDA");
    tl_model_free(NULL);

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

int main(int argc, char **argv) {
    snprintf(source, sizeof source, "%s", argc > 1 ? argv[1] : "tests/data/golden/concat_replace_bias");
    snprintf(work, sizeof work, "/tmp/tl_load_errors_XXXXXX");
    if (!mkdtemp(work)) { perror("mkdtemp"); return 1; }
    reset();
    CHECK(load_work() == TL_OK, "pristine copy must load: %s", tl_last_error());
    config_errors();
    file_errors();
    api_errors();
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", work); unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", work); unlink(path);
    rmdir(work);
    return check_summary();
}

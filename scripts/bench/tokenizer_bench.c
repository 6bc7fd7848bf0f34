/* tokenizer_bench.c: encode throughput (MB/s) of a tokenizer.json with many added tokens, the
 * shape of checkpoints that reserve thousands of them ("<|reserved_special_token_N|>"), on
 * three texts: plain English (tests/data/tokenizer/sample.txt repeated), the same with an
 * added token every few words, and "<|" repeated (every position starts like an added token).
 * A tool, not a test: ctest runs it once on a small size only to see it work.
 *   tinyloop-tokenizer-bench SOURCE_DIR [--added N (3000)] [--mb M (1)] [--tokenizer PATH]
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tokenizer.h"

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    rewind(f);
    char *s = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    fclose(f);
    if (s) {
        s[n] = '\0';
        *len = (size_t)n;
    }
    return s;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* `size` bytes of `piece` repeated. */
static char *repeat(const char *piece, size_t piece_len, size_t size) {
    char *s = malloc(size);
    for (size_t i = 0; s && i < size; i++) s[i] = piece[i % piece_len];
    return s;
}

int main(int argc, char **argv) {
    if (argc < 2 || argv[1][0] == '-') {
        fprintf(stderr, "usage: %s SOURCE_DIR [--added N] [--mb M] [--tokenizer PATH]\n", argv[0]);
        return 2;
    }
    const char *src = argv[1];
    char path[4096], sample_path[4096];
    snprintf(path, sizeof path, "%s/tests/data/gpt2/tokenizer.json", src);
    snprintf(sample_path, sizeof sample_path, "%s/tests/data/tokenizer/sample.txt", src);
    long added = 3000;
    double mb = 1.0;
    for (int i = 2; i < argc; i += 2) {
        const char *value = i + 1 < argc ? argv[i + 1] : "";
        char *end = NULL;
        if (!strcmp(argv[i], "--added")) added = strtol(value, &end, 10);
        else if (!strcmp(argv[i], "--mb")) mb = strtod(value, &end);
        else if (!strcmp(argv[i], "--tokenizer") && *value) end = (char *)value + strlen(value);
        if (!end || end == value || *end != '\0' || added < 0 || added > 1000000 || !(mb > 0 && mb <= 1024)) {
            fprintf(stderr, "%s: bad option %s %s (--added 0..1000000, --mb in (0, 1024], --tokenizer PATH)\n", argv[0],
                    argv[i], value);
            return 2;
        }
        if (!strcmp(argv[i], "--tokenizer")) snprintf(path, sizeof path, "%s", value);
    }

    /* the tokenizer, with `added` reserved tokens appended after its last id */
    size_t len = 0;
    char *text = read_file(path, &len);
    cJSON *root = text ? cJSON_ParseWithLength(text, len) : NULL;
    free(text);
    if (!root) {
        fprintf(stderr, "%s: cannot read %s as JSON\n", argv[0], path);
        return 1;
    }
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "model"), "vocab");
    cJSON *list = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (!list) list = cJSON_AddArrayToObject(root, "added_tokens");
    int next_id = 0;
    for (const cJSON *v = vocab ? vocab->child : NULL; v; v = v->next)
        if ((int)v->valuedouble >= next_id) next_id = (int)v->valuedouble + 1;
    for (const cJSON *a = list ? list->child : NULL; a; a = a->next) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(a, "id");
        if (cJSON_IsNumber(id) && (int)id->valuedouble >= next_id) next_id = (int)id->valuedouble + 1;
    }
    for (long i = 0; list && i < added; i++) {
        char content[64];
        snprintf(content, sizeof content, "<|reserved_special_token_%ld|>", i);
        cJSON *a = cJSON_CreateObject();
        cJSON_AddNumberToObject(a, "id", next_id + (double)i);
        cJSON_AddStringToObject(a, "content", content);
        cJSON_AddBoolToObject(a, "special", 1);
        cJSON_AddItemToArray(list, a);
    }
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    tl_tlz_tokenizer *tok = NULL;
    char err[512];
    if (!json || tl_tlz_tokenizer_load_json(json, strlen(json), &tok, err, sizeof err) != TLZ_OK) {
        fprintf(stderr, "%s: %s\n", argv[0], json ? err : "out of memory");
        return 1;
    }
    free(json);

    size_t sample_len = 0;
    char *sample = read_file(sample_path, &sample_len);
    if (!sample || sample_len == 0) {
        fprintf(stderr, "%s: cannot read %s\n", argv[0], sample_path);
        return 1;
    }
    /* the sample with an added token after every 40 bytes or so (at a space) */
    char *marked = malloc(sample_len * 2 + 64);
    size_t marked_len = 0;
    for (size_t i = 0, since = 0; i < sample_len; i++, since++) {
        marked[marked_len++] = sample[i];
        if (sample[i] == ' ' && since >= 40) {
            marked_len += (size_t)sprintf(marked + marked_len, "<|reserved_special_token_%ld|>", added > 0 ? (long)(i % (size_t)added) : 0L);
            since = 0;
        }
    }
    const size_t size = (size_t)(mb * 1048576.0);
    const struct { const char *name; char *text; } texts[] = {
        {"plain text", repeat(sample, sample_len, size)},
        {"added tokens every ~40 bytes", repeat(marked, marked_len, size)},
        {"\"<|\" repeated", repeat("<|", 2, size)},
    };
    printf("tokenizer %s, %d ids (%ld reserved tokens added), %.2f MiB a text\n", path, tl_tlz_vocab_size(tok), added, mb);
    printf("%-30s %10s %10s %10s\n", "text", "ids", "seconds", "MB/s");
    int rc = 0;
    for (size_t t = 0; t < sizeof texts / sizeof *texts; t++) {
        int32_t *ids = NULL;
        size_t n = 0;
        const double start = now_s();
        if (!texts[t].text || tl_tlz_encode(tok, texts[t].text, size, &ids, &n, err, sizeof err) != TLZ_OK) {
            fprintf(stderr, "%s: %s: %s\n", argv[0], texts[t].name, texts[t].text ? err : "out of memory");
            rc = 1;
            continue;
        }
        const double seconds = now_s() - start;
        printf("%-30s %10zu %10.3f %10.1f\n", texts[t].name, n, seconds, (double)size / 1e6 / seconds);
        free(ids);
        free(texts[t].text);
    }
    free(sample);
    free(marked);
    tl_tlz_tokenizer_free(tok);
    return rc;
}

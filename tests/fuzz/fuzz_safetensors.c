/* fuzz_safetensors.c: libFuzzer target for the safetensors header parser and validator
 * (tl_st_open_memory: header length, JSON, dtypes, shapes, offsets, overlaps) and, when the
 * header is valid, for the loader's binding of its tensors against a fixed config (shapes,
 * dtypes, unknown tensors, the non-finite weight check): the input is written as the
 * model.safetensors of a scratch checkpoint next to the config of the seed checkpoint. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "safetensors.h"

/* tests/data/golden/concat_replace_bias/config.json (the seed corpus's checkpoint). */
static const char config[] =
    "{\"vocab_size\": 64, \"d_model\": 32, \"n_heads\": 4, \"d_ff\": 64, \"max_seq_len\": 32,"
    " \"n_prelude\": 1, \"n_block\": 1, \"n_coda\": 0, \"default_loops\": 2, \"norm\": \"layernorm\","
    " \"mlp\": \"gelu\", \"pos_encoding\": \"learned\", \"bos_token_id\": 0, \"eos_token_id\": 1,"
    " \"injection\": \"concat\", \"bias\": true, \"max_loops\": 6}";

static char dir[64];

static void write_file(const char *name, const void *data, size_t len) {
    char path[128];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp) abort();
    if (len && fwrite(data, 1, len, fp) != len) abort();
    fclose(fp);
}

static void cleanup(void) {
    char path[128];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    rmdir(dir);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "%s/tl_fuzz_st_XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
        if (!mkdtemp(dir)) abort();
        write_file("config.json", config, strlen(config));
        atexit(cleanup);
    }
    tl_st_file f;
    tl_status st = tl_st_open_memory("fuzz.safetensors", data, size, &f);
    if (st != TL_OK) {
        if (tl_last_error()[0] == '\0') abort();
        return 0;
    }
    for (int i = 0; i < f.n_tensors; i++) { /* every tensor lies inside the data */
        const tl_st_tensor *t = &f.tensors[i];
        if (t->data < data || t->data + t->nbytes > data + size) abort();
    }
    tl_st_close(&f);

    write_file("model.safetensors", data, size);
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 1;
    o.mmap_weights = size % 2; /* both weight paths */
    tl_model *m = NULL;
    if (tl_model_load(dir, &o, &m) == TL_OK) {
        int32_t tokens[3] = {1, 2, 3};
        float logits[3 * 64];
        if (tl_score(m, tokens, 3, 2, logits) != TL_OK) abort();
        tl_model_free(m);
    } else if (tl_last_error()[0] == '\0') {
        abort();
    }
    return 0;
}

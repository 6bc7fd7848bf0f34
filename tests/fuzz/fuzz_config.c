/* fuzz_config.c: libFuzzer target for the config.json parser and its validation
 * (tl_config_parse). Every input must give TL_OK or an error with a message; never a crash,
 * a leak or undefined behaviour. Accepted configs must satisfy the cross-field rules; JSON
 * that tl_json_value_parses accepts, cJSON must read. */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0'; /* the loader refuses embedded NULs before parsing (model.c) */
    /* The recognizer that tells cJSON's refusal from its failed malloc never accepts what
       cJSON refuses (else a bad file reads as out of memory). */
    if (tl_json_value_parses(text, size)) {
        cJSON *root = cJSON_ParseWithLengthOpts(text, size, NULL, false);
        if (!root) abort();
        cJSON_Delete(root);
    }
    tl_config c;
    tl_status st = tl_config_parse(text, &c);
    if (st == TL_OK) {
        /* What the rest of the engine relies on. */
        if (c.d_model < 1 || c.n_heads < 1 || c.d_model % c.n_heads || c.head_dim * c.n_heads != c.d_model ||
            c.n_heads % c.n_kv_heads || c.max_loops < c.default_loops || c.bos_token_id >= c.vocab_size ||
            c.eos_token_id >= c.vocab_size || !(c.norm_eps > 0) || !(c.rope_theta > 0) ||
            memchr(c.warnings, '\0', sizeof c.warnings) == NULL)
            abort();
    } else if (tl_last_error()[0] == '\0') {
        abort(); /* an error without a message */
    }
    free(text);
    return 0;
}

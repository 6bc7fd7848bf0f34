/* fuzz_json_schema: libFuzzer target for the JSON Schema converter: any input either converts
 * to a grammar that compiles (a conversion that yields invalid GBNF is a bug) or fails with a
 * message. */
#include <stdint.h>
#include <string.h>

#include "tinyloop.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* (the length's low bits pick the options: both readings of every schema get fuzzed) */
    tl_json_schema_options opts = {.free_whitespace = (int)(size & 1), .loose = (int)((size >> 1) & 1)};
    tl_compiled_grammar *g = NULL;
    tl_status st = tl_grammar_compile_json_schema((const char *)data, size, &opts, &g);
    if (st != TL_OK) {
        if (strncmp(tl_last_error(), "JSON schema: the generated grammar", 34) == 0) __builtin_trap();
        if (tl_last_error()[0] == 0) __builtin_trap();
        return 0;
    }
    int match;
    tl_grammar_matches(g, "{}", 2, &match);
    tl_compiled_grammar_free(g);
    return 0;
}

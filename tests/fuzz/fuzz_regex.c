/* fuzz_regex: libFuzzer target for the regular-expression converter (regex.c): any input
 * either converts to a grammar that compiles (a conversion that yields invalid GBNF is a
 * bug) or fails with a message; a compiled grammar then matches texts without fault,
 * among them the input itself (a pattern of literals matches its own text). */
#include <stdint.h>
#include <string.h>

#include "tinyloop.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    tl_compiled_grammar *g = NULL;
    const tl_status st = tl_grammar_compile_regex((const char *)data, size, &g);
    if (st != TL_OK) {
        if (strncmp(tl_last_error(), "regular expression: the generated grammar", 41) == 0) __builtin_trap();
        if (tl_last_error()[0] == 0) __builtin_trap();
        return 0;
    }
    int match;
    tl_grammar_matches(g, (const char *)data, size, &match);
    tl_grammar_matches(g, "", 0, &match);
    tl_grammar_matches(g, "aaaaaaaaaaaaaaaa\n \"\\", 20, &match);
    /* a pattern without special characters is a literal: it must match itself */
    bool literal = size > 0;
    for (size_t i = 0; i < size && literal; i++) literal = data[i] >= 'a' && data[i] <= 'z';
    if (literal && (tl_grammar_matches(g, (const char *)data, size, &match) != TL_OK || !match)) __builtin_trap();
    tl_compiled_grammar_free(g);
    return 0;
}

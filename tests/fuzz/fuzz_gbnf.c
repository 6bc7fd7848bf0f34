/* fuzz_gbnf: libFuzzer target for the GBNF parser, compiler and matcher. Any input must either
 * compile or fail with a message; a compiled grammar is then matched against the input's tail.
 *   clang -fsanitize=fuzzer,address,undefined ... (scripts/fuzz builds it) */
#include <stdint.h>
#include <string.h>

#include "tinyloop.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* the first NUL (if any) splits grammar text from a text to match */
    const uint8_t *nul = memchr(data, 0, size);
    size_t glen = nul ? (size_t)(nul - data) : size;
    tl_compiled_grammar *g = NULL;
    if (tl_grammar_compile_gbnf((const char *)data, glen, &g) != TL_OK) {
        if (tl_last_error()[0] == 0) __builtin_trap(); /* a failure must say why */
        return 0;
    }
    /* Matching walks every live stack per byte: a grammar like "x ::= .+ ...(n dots)" keeps
       O(n) stacks alive, so matching n bytes is O(n^2) by construction (0.5 s for 1.4 KB, ten
       times that under the sanitizers: a libFuzzer timeout, not a bug). The texts are cut to
       MATCH_MAX bytes, still longer than any grammar's interesting prefix; the parser and the
       compiler see the whole input. */
    enum { MATCH_MAX = 256 };
    int match;
    if (nul) {
        const size_t tlen = size - glen - 1;
        tl_grammar_matches(g, (const char *)nul + 1, tlen < MATCH_MAX ? tlen : MATCH_MAX, &match);
    }
    tl_grammar_matches(g, (const char *)data, glen < MATCH_MAX ? glen : MATCH_MAX, &match);
    tl_compiled_grammar_free(g);
    return 0;
}

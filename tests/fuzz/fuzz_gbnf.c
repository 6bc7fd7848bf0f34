/* fuzz_gbnf: libFuzzer target for the GBNF parser, compiler and matcher. Any input must either
 * compile or fail with a message; a compiled grammar is then matched against the input's tail.
 *   clang -fsanitize=fuzzer,address,undefined ... (scripts/fuzz builds it) */
#include <stdint.h>
#include <string.h>

#include "grammar.h"
#include "tinyloop.h"
#include "tokenizer.h"

#ifndef TL_FUZZ_DATA
#define TL_FUZZ_DATA "tests/data"
#endif

/* A nine-token vocabulary with a thinking model's special tokens (<think> 6, </think> 7,
   <|end|> 8 the end), for the token-level walk. */
enum { VOCAB = 9, EOS = 8 };

/* Token by token (the text's bytes read as ids): at each state the mask allows exactly the
   tokens that advance it, token references and their negations included; then an allowed one
   is taken. */
static void walk_tokens(const tl_compiled_grammar *g, const uint8_t *ids, size_t n) {
    static tl_tlz_tokenizer *tok;
    char err[128];
    if (!tok && tl_tlz_tokenizer_load(TL_FUZZ_DATA "/tokenizer/thinking9.json", &tok, err, sizeof err) != TLZ_OK) __builtin_trap();
    tl_grammar_matcher *mt = NULL;
    if (tl_gram_matcher_new(g, tok, VOCAB, EOS, &mt) != TL_OK) return; /* (a name the vocabulary lacks) */
    uint8_t allowed[VOCAB];
    for (size_t i = 0; i < n && i < 64; i++) {
        const int32_t state = tl_gram_matcher_state(mt);
        if (tl_gram_matcher_mask_state(mt, state, allowed) < 0) break;
        for (int t = 0; t < VOCAB; t++) {
            const int32_t next = tl_gram_matcher_advance_state(mt, state, t);
            if (next >= 0 && allowed[t] != (next != GRAM_DEAD)) __builtin_trap();
        }
        int pick = ids[i] % VOCAB;
        for (int k = 0; k < VOCAB && !allowed[pick]; k++) pick = (pick + 1) % VOCAB;
        if (!allowed[pick] || pick == EOS || tl_grammar_matcher_accept(mt, pick) != TL_OK) break;
    }
    tl_grammar_matcher_free(mt);
}

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
    if (nul) walk_tokens(g, nul + 1, size - glen - 1);
    /* the grammar as the content of grammars built from others (after, tags, after_block):
       its program copied and renumbered; matched on a text that opens it (one input in four:
       the three compiles cost more than the parse, and the parser is this target's first job) */
    if (size % 4 != 0) {
        tl_compiled_grammar_free(g);
        return 0;
    }
    tl_compiled_grammar *after = NULL, *tags = NULL, *block = NULL;
    const tl_grammar_tag tag[] = {{"<t>", g, "</t>", 0}, {"<t:", g, "", 1}};
    const char *const triggers[] = {"<t", "t:"};
    /* (size % 4 == 0 here; tag_first too, its own root rule) */
    tl_grammar_tags_options opts = {(int)((size >> 3) % 3), (int)((size >> 2) & 1), (int)((size >> 5) & 1)};
    if (tl_grammar_compile_after(g, "</t>", 4, (int)((size >> 2) % 5), &after) != TL_OK && tl_last_error()[0] == 0) __builtin_trap();
    if (tl_grammar_compile_tags(tag, 2, triggers, 2, &opts, &tags) != TL_OK && tl_last_error()[0] == 0) __builtin_trap();
    if (tl_grammar_compile_after_block(g, "<t>", "</t>", 2, &block) != TL_OK && tl_last_error()[0] == 0) __builtin_trap();
    char text[MATCH_MAX + 16] = "x <t>";
    const size_t n = glen < MATCH_MAX ? glen : MATCH_MAX;
    memcpy(text + 5, data, n);
    memcpy(text + 5 + n, "</t>", 4);
    if (after) tl_grammar_matches(after, text, n + 9, &match);
    if (tags) tl_grammar_matches(tags, text, n + 9, &match);
    if (block) tl_grammar_matches(block, text + 2, n + 7, &match);
    tl_compiled_grammar_free(after);
    tl_compiled_grammar_free(tags);
    tl_compiled_grammar_free(block);
    tl_compiled_grammar_free(g);
    return 0;
}

/* text_prompts.h: the prompts the C tests run on the text model (tests/data/textmodel):
 * five opening lines, each also cut short by 0-9 bytes, so prompts differ in length and in
 * how their last token splits. */
#ifndef TL_TEST_TEXT_PROMPTS_H
#define TL_TEST_TEXT_PROMPTS_H

#include <string.h>

#include "tinyloop.h"

/* Prompt number p (any p >= 0) as token ids; free *ids with tl_free. */
static inline tl_status text_prompt(const tl_model *m, int p, int32_t **ids, int *n) {
    static const char *const texts[] = {
        "It is a truth universally acknowledged, that a single man",
        "Mr. Bennet was so odd a mixture of quick parts",
        "The village of Longbourn was only one mile from Meryton;",
        "Emma Woodhouse, handsome, clever, and rich,",
        "You can't have everything.  Where would you put it?",
    };
    const char *t = texts[p % 5];
    return tl_encode(m, t, strlen(t) - (size_t)(p / 5) % 10, ids, n);
}

#endif

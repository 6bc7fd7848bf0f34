/* stop.c: stop-sequence suffix matching. */
#include <string.h>

#include "stop.h"

bool tl_stop_sequences_match(const int32_t *tokens, int n, int first_new, const tl_token_seq *seqs,
                             int n_seqs, int longest) {
    if (n <= first_new) return false;
    for (int i = 0; i < n_seqs; i++) {
        const tl_token_seq *s = &seqs[i];
        if (s->n <= n && s->n <= longest && memcmp(tokens + n - s->n, s->tokens, (size_t)s->n * sizeof(int32_t)) == 0)
            return true;
    }
    return false;
}

const char *tl_stop_reason_name(tl_stop_reason reason) {
    switch (reason) {
    case TL_STOP_EOS: return "EOS";
    case TL_STOP_SEQUENCE: return "STOP_SEQUENCE";
    case TL_STOP_MAX_TOKENS: return "MAX_TOKENS";
    case TL_STOP_CALLBACK_ABORT: return "CALLBACK_ABORT";
    case TL_STOP_GRAMMAR_DEAD_END: return "GRAMMAR_DEAD_END";
    case TL_STOP_NONE: return "NONE";
    default: return "UNKNOWN"; /* no reason's value: not to be read as one (tl_status_name's rule) */
    }
}

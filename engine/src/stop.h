/* stop.h: stop-sequence matching (token-id suffixes). */
#ifndef TL_STOP_H
#define TL_STOP_H

#include "internal.h"

/* True when tokens[0..n) ends with one of the sequences of at most `longest` tokens
   (INT_MAX: any) and the match includes at least one token at index >= first_new (a stop
   sequence may begin in the prompt but must end on a generated token: the prompt alone
   never stops generation). */
bool tl_stop_sequences_match(const int32_t *tokens, int n, int first_new, const tl_token_seq *seqs,
                             int n_seqs, int longest);

#endif

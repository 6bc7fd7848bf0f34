/* validate.h: the rules of a generation config (SPEC §3) in one place. */
#ifndef TL_VALIDATE_H
#define TL_VALIDATE_H

#include "internal.h"

/* Limits of the speculative and beam modes. */
#define TL_MAX_DRAFT_AHEAD 32
#define TL_MAX_TREE_NODES 256
#define TL_MAX_K_BRANCHES 8
#define TL_MAX_BEAM_SIZE 64

/* Whether decode tokens choose their depth loop by loop (early_exit.c): a criterion with
   patience, or a depth_policy hook. Such sessions step alone, never in a batched forward. */
static inline bool tl_early_exit_on(const tl_generate_config *c) {
    return c->early_exit_patience > 0 || c->depth_policy != NULL;
}

/* Every rule for (model, prompt, config), including which mode combinations are supported;
   the message names the field and value (TL_ERR_UNSUPPORTED names the combination). */
tl_status tl_generate_validate(const tl_model *m, const int32_t *prompt, int prompt_len,
                               const tl_generate_config *cfg);

/* Whether the fields tl_token_in_text reads (keep_special_text, ignore_eos, the stop
   sequences) are ones tl_generate_validate takes; no message. */
bool tl_text_fields_valid(const tl_generate_config *c, int vocab);

/* The rules of a config's decoding mode (speculative, beam search): its fields and the hooks
   and grammar it takes (tl_generate_validate's, and a branch's new hooks: fork.c). */
tl_status tl_validate_mode(const tl_model *m, const tl_generate_config *cfg);

/* The rules of a grammar on model m (a config's, or a branch's new one: fork.c). */
tl_status tl_validate_grammar(const tl_model *m, const tl_grammar *g);

/* The rules of a tl_speculative_config alone (tl_generate_speculative's own fields). */
tl_status tl_speculative_validate(const tl_model *m, const tl_speculative_config *cfg);

#endif

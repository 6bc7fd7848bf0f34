/* beam.h: beam search, reached through tl_generate / tl_generate_stream when
 * cfg->beam_size >= 2 (the step API emits one token of one sequence at a time). */
#ifndef TL_BEAM_H
#define TL_BEAM_H

#include "forward.h"
#include "sampler.h"

/* cfg must already be validated (tl_generate_validate). out holds prompt_len + max_tokens. */
tl_status tl_beam_generate(const tl_model *m, const int32_t *prompt, int prompt_len,
                           const tl_generate_config *cfg, tl_stream_fn on_token, void *user,
                           int32_t *out, int *out_len, tl_generate_stats *stats);

#endif

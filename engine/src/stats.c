/* stats.c: per-token accounting and the public stats helpers. */
#include <string.h>

#include "stats.h"

/* The first token comes from the prefill's logits: decode_ms (from the end of the prefill to
   the last token) holds the forward passes of the tokens after it, so those are what it
   rates (llama.cpp's "eval" rate counts the same n - 1). Counting all n, one token read as
   a rate of hundreds of thousands a second. */
double tl_stats_decode_tokens_per_s(const tl_generate_stats *s) {
    return s && s->decode_ms > 0 && s->tokens_emitted > 1 ? (s->tokens_emitted - 1) * 1000.0 / s->decode_ms : 0.0;
}

/* The prompt tokens the prefill computed: those the prefix pool gave cost it nothing (a
   conversation's turn over 2,000 reused tokens read as a prefill many times its speed), and
   beam search's and speculative decoding's last one is their first step's row (a one-token
   prompt read as 1.3 million tokens a second). */
double tl_stats_prefill_tokens_per_s(const tl_generate_stats *s) {
    const int computed = s ? s->prefill_tokens : 0;
    return computed > 0 && s->prefill_ms > 0 ? computed * 1000.0 / s->prefill_ms : 0.0;
}

void tl_stats_count_token(tl_generate_stats *s, int emitted, int depth, double *loops_sum,
                          double t_start, double t_prefill_end, double now) {
    if (emitted == 1) s->first_token_ms = now - t_start;
    s->decode_ms = now - t_prefill_end;
    s->tokens_emitted = emitted;
    *loops_sum += depth;
    s->loops_used = *loops_sum / emitted;
    s->depth_histogram[depth < TL_HISTOGRAM_DEPTHS ? depth : TL_HISTOGRAM_DEPTHS - 1]++;
}

void tl_stats_finish_speculative(tl_generate_stats *s, double depth_offered) {
    s->acceptance_rate = depth_offered > 0 ? s->accepted / depth_offered : 0.0;
    s->mean_accepted = s->verify_steps ? (double)s->accepted / s->verify_steps : 0.0;
}

void tl_stats_to_speculative(const tl_generate_stats *s, tl_speculative_stats *out) {
    memset(out, 0, sizeof *out);
    out->gen = *s;
    out->drafted = s->drafted;
    out->accepted = s->accepted;
    out->verify_steps = s->verify_steps;
    out->acceptance_rate = s->acceptance_rate;
    out->mean_accepted = s->mean_accepted;
    out->draft_forwards = s->draft_forwards;
    out->verify_forwards = s->verify_forwards;
    out->draft_ms = s->draft_ms;
    out->verify_ms = s->verify_ms;
}

/* stats.h: how a session accounts for what it did (tl_generate_stats). */
#ifndef TL_STATS_H
#define TL_STATS_H

#include "internal.h"

/* Counts the emitted token number `emitted` (1-based), computed at loop depth `depth`, at
   time `now`; `loops_sum` carries the depth total between calls. */
void tl_stats_count_token(tl_generate_stats *stats, int emitted, int depth, double *loops_sum,
                          double t_start, double t_prefill_end, double now);

/* Fills the derived speculative figures: acceptance over the verify depth offered. */
void tl_stats_finish_speculative(tl_generate_stats *stats, double depth_offered);

/* The tl_speculative_stats view of a session's stats. */
void tl_stats_to_speculative(const tl_generate_stats *stats, tl_speculative_stats *out);

#endif

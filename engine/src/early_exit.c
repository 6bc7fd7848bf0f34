/* early_exit.c: the depth of one decode token, chosen loop by loop (SPEC §3 early_exit_*, and
 * the depth_policy hook). After each loop but the last, the loop's signals are gathered in one
 * place: the state change, Ouro's exit gate, and on checked loops a probe (coda + head) with
 * its argmax, entropy and KL to the previous probe. The configured criterion judges them
 * (patience counts consecutive checked loops that met it); a depth_policy hook, when set, has
 * the last word. The exited position keeps its depth in the cache, and deeper loops of later
 * tokens read its deepest slot (KV sharing, SPEC §2). */
#include <math.h>
#include <stdlib.h>

#include "session.h"
#include "validate.h"

/* Criteria that judge the probe's distribution need its logits at every checked loop; the
   others (state change, gate) run the head only at the exit. */
static bool needs_probe(tl_exit_criterion c) {
    return c == TL_EXIT_HIDDEN_STATE || c == TL_EXIT_KL || c == TL_EXIT_ENTROPY_DIFF || c == TL_EXIT_ARGMAX;
}

/* The probe's distribution (log-softmax, entropy, KL) costs two exp per vocabulary entry;
   only the KL and entropy criteria and a depth_policy hook (which is shown them) read it.
   The default criterion needs the argmax alone. */
static bool needs_distribution(const tl_generate_config *c) {
    return c->depth_policy || (c->early_exit_patience > 0 && (c->early_exit_criterion == TL_EXIT_KL ||
                                                              c->early_exit_criterion == TL_EXIT_ENTROPY_DIFF));
}

/* What the previous probe of this token left. */
typedef struct probe_memory {
    bool have;       /* a probe ran before */
    int32_t argmax;  /* -1 before the first */
    double entropy;
    double *logp;    /* [vocab] its log-softmax (prev_logp of the next probe); NULL when
                        nothing reads the distribution */
} probe_memory;

/* The probe's signals from its logits, in double: argmax (tl_argmax: ties to the lowest id),
   entropy, KL(previous || this) and the top-1 minus top-2 margin (in float, as the logits);
   then this probe becomes the previous one. Without prev->logp only the argmax and margin
   are read (entropy and KL stay NaN). A row with no finite logit gives argmax -1 and
   leaves the memory as it was. */
static void read_probe(const float *logits, int vocab, probe_memory *prev, tl_loop_signals *sig, double *margin) {
    const int32_t top = tl_argmax(logits, vocab);
    sig->probed = 1;
    sig->argmax = top;
    *margin = 0.0;
    if (top < 0) return;
    const float best = logits[top];
    float second = -INFINITY;
    for (int i = 0; i < vocab; i++)
        if (i != top && logits[i] > second) second = logits[i];
    *margin = (double)(best - second);
    if (!prev->logp) {
        prev->have = true;
        prev->argmax = top;
        return;
    }
    double sum = 0.0;
    for (int i = 0; i < vocab; i++) sum += exp((double)logits[i] - (double)best);
    const double log_z = (double)best + log(sum);
    double entropy = 0.0, kl = 0.0;
    for (int i = 0; i < vocab; i++) {
        const double lp = (double)logits[i] - log_z, p = exp(lp);
        if (p > 0.0) entropy -= p * lp;
        if (prev->have) {
            const double q = exp(prev->logp[i]);
            if (q > 0.0) kl += q * (prev->logp[i] - lp);
        }
        prev->logp[i] = lp;
    }
    sig->entropy = entropy;
    if (prev->have) {
        sig->kl = kl;
        sig->entropy_change = fabs(entropy - prev->entropy);
    }
    prev->have = true;
    prev->argmax = top;
    prev->entropy = entropy;
}

/* Whether this checked loop meets the criterion (one rule per criterion, here only). */
static bool criterion_met(const tl_generate_config *c, const tl_loop_signals *sig, const probe_memory *prev,
                          double margin, double gate_threshold) {
    switch (c->early_exit_criterion) {
    case TL_EXIT_HIDDEN_STATE:
        if (c->early_exit_logit_margin > 0.0f) return sig->argmax >= 0 && margin >= (double)c->early_exit_logit_margin;
        return sig->state_change < (double)c->early_exit_threshold && prev->have && sig->argmax == prev->argmax;
    case TL_EXIT_LATENT_DIFF:
        return sig->state_change < (double)c->early_exit_threshold;
    case TL_EXIT_KL:
        return prev->have && sig->kl < (double)c->early_exit_kl_threshold;
    case TL_EXIT_ENTROPY_DIFF:
        return prev->have && sig->entropy_change < (double)c->early_exit_entropy_threshold;
    case TL_EXIT_ARGMAX:
        return prev->have && sig->argmax == prev->argmax;
    case TL_EXIT_GATE:
        return sig->exit_probability >= gate_threshold;
    }
    return false;
}

tl_status tl_session_forward_adaptive(tl_session *s, int start) {
    const tl_generate_config *c = &s->cfg;
    const tl_model *m = s->m;
    const int L = s->loops, vocab = m->cfg.vocab_size;
    const bool criterion_on = c->early_exit_patience > 0;
    const bool probing = c->depth_policy || (criterion_on && needs_probe(c->early_exit_criterion));
    const double gate_threshold = c->early_exit_gate_threshold > 0.0f ? (double)c->early_exit_gate_threshold
                                                                     : (double)m->cfg.exit_threshold;
    probe_memory prev = {false, -1, 0.0, NULL};
    if (probing && needs_distribution(c) && L > 1) {
        /* The session's buffer, made once: not an allocation per token. */
        if (!s->probe_logp && !(s->probe_logp = malloc((size_t)vocab * sizeof *s->probe_logp)))
            return tl_fail(TL_ERR_NO_MEMORY, "out of memory for early-exit probes (%d doubles)", vocab);
        prev.logp = s->probe_logp;
    }
    tl_forward f;
    tl_status st = tl_forward_begin(&f, m, s->cache, &s->ws, s->tokens + start, s->positions + start, 1, NULL);
    /* Ouro's stick-breaking exit distribution: pass u exits with probability
       gate_u * remaining, remaining = prod_(v<u) (1 - gate_v); summed as the reference does. */
    double remaining = 1.0, cumulative = 0.0;
    int stable = 0;
    for (int l = 1; st == TL_OK && l < L; l++) {
        tl_loop_signals sig = {.loop = l, .loops = L, .position = s->positions[start], .gate = NAN,
                               .exit_probability = NAN, .argmax = -1, .entropy = NAN, .kl = NAN,
                               .entropy_change = NAN};
        tl_forward_loop_measured(&f, &sig.state_change);
        if (m->cfg.exit_gate) {
            sig.gate = m->backend->exit_gate(m, s->ws.s);
            cumulative += sig.gate * remaining;
            remaining *= 1.0 - sig.gate;
            sig.exit_probability = cumulative;
        }
        const bool check = l >= c->early_exit_min_L && (l - c->early_exit_min_L) % c->early_exit_peek_every == 0;
        double margin = 0.0;
        if (check && probing) {
            const double t0 = tl_now_ms();
            tl_forward_head(&f, 0, s->logits);
            const probe_memory before = prev; /* the criterion compares with the probe before */
            read_probe(s->logits, vocab, &prev, &sig, &margin);
            if (criterion_on) stable = criterion_met(c, &sig, &before, margin, gate_threshold) ? stable + 1 : 0;
            s->stats.probes++;
            s->stats.probe_ms += tl_now_ms() - t0;
        } else if (check && criterion_on) {
            stable = criterion_met(c, &sig, &prev, margin, gate_threshold) ? stable + 1 : 0;
        }
        /* (its verdict on a loop it checked: on the loops between, a hook that went past its
           advice saw the last checked loop's verdict as this loop's) */
        sig.criterion_exit = criterion_on && check && stable >= c->early_exit_patience;
        bool exit = sig.criterion_exit;
        if (c->depth_policy) {
            const int r = c->depth_policy(c->depth_policy_user, &sig);
            if (r < 0) return tl_session_hook_failed(s, "depth_policy", r);
            exit = r == TL_HOOK_STOP;
        }
        if (exit) {
            if (!sig.probed) tl_forward_head(&f, 0, s->logits);
            tl_forward_commit(&f); /* the last head's coda K/V and logits are this depth's */
            s->last_depth = l;
            return TL_OK;
        }
    }
    if (st != TL_OK) return st;
    tl_forward_loop(&f);
    tl_forward_end(&f, 0, s->logits);
    s->last_depth = L;
    return TL_OK;
}

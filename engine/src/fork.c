/* fork.c: one session state, many continuations: tl_session_fork, and saved states
 * (tl_session_save / tl_session_resume) that outlive their session. Both are a clone of the
 * session whose KV cache shares the original's pages (copy on write, kv_cache.h): a clone
 * costs the page table and the host arrays, never a forward. */
#define _POSIX_C_SOURCE 200809L /* strdup */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar.h"
#include "session.h"
#include "validate.h"

/* Which sessions can be cloned: any that is neither finished nor stepping (plain decoding's
   whole state is the fields below; the other modes' decoders copy their own: speculative
   decoding's draft tree and verifier rows, a beam search's hypotheses). */
static tl_status check_clonable(const tl_session *s, const char *what) {
    if (!s) return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: session must not be NULL", what);
    if (s->stepping)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: the session is stepping (%s)", what, TL_STEPPING_WHERE);
    if (s->finished)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s: the session has finished (stop reason %s)", what,
                       tl_stop_reason_name(s->stats.stop_reason));
    return TL_OK;
}

/* The branch's new matcher takes the emitted tokens again, to the source's position. */
static tl_status accept_emitted(tl_session *s) {
    for (int i = s->prompt_len; i < s->n_tokens; i++)
        if (tl_grammar_matcher_accept(s->grammar_matcher, s->tokens[i]) != TL_OK)
            return tl_fail(TL_ERR_INVALID_ARGUMENT,
                           "the state's token %d (id %d) is not allowed by the grammar passed to resume: not the "
                           "grammar it was generated under", i, s->tokens[i]);
    return TL_OK;
}

/* The grammar of a clone: the source's compiled grammar continues from the source's state
   (a copy of its matcher; also when the branch's hooks name that same compiled grammar, or
   the same rules compiled anew, whose matcher takes the emitted tokens again: a caller that
   compiles per request branches as a state file resumes), another compiled grammar starts
   from its start state, a callback grammar is the caller's. */
static tl_status clone_grammar(tl_session *s, const tl_session *src, const tl_generate_config *hooks) {
    const tl_grammar *g = hooks ? hooks->grammar : src->cfg.grammar ? &src->grammar : NULL;
    s->cfg.grammar = g ? &s->grammar : NULL;
    if (!g) return TL_OK;
    if (src->grammar_matcher && (!hooks || g->compiled == src->grammar_matcher->g)) {
        tl_status st = tl_gram_matcher_clone(src->grammar_matcher, &s->grammar_matcher);
        if (st == TL_OK) tl_gram_matcher_as_grammar(s->grammar_matcher, &s->grammar);
        return st;
    }
    tl_status st = tl_session_set_grammar(s, g);
    if (st == TL_OK && src->grammar_matcher && s->grammar_matcher &&
        s->grammar_matcher->g->fingerprint == src->grammar_matcher->g->fingerprint)
        st = accept_emitted(s);
    return st;
}

/* A state read from a file that was generated under a compiled grammar holds the tokens,
   not the matcher's position (state_file.c): the branch's compiled grammar, which its hooks
   must name (its rules: the fingerprint the file holds, from layout version 7), gets there by
   accepting the emitted tokens again. */
static tl_status replay_grammar(tl_session *s) {
    s->grammar_replay = false;
    if (!s->grammar_matcher)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "the state was generated under a compiled grammar, whose position a state file does not "
                       "hold: pass that grammar to resume (hooks.grammar)");
    if (s->grammar_fingerprint && s->grammar_fingerprint != s->grammar_matcher->g->fingerprint)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "the grammar passed to resume is not the one the state was generated under (its rules differ)");
    return accept_emitted(s);
}

/* The hook fields of *hooks (or the source's when NULL); the grammar is clone_grammar's. */
static void take_hooks(tl_generate_config *cfg, const tl_generate_config *hooks) {
    if (!hooks) return;
    cfg->on_token = hooks->on_token;
    cfg->on_token_user = hooks->on_token_user;
    cfg->stop_rule = hooks->stop_rule;
    cfg->stop_rule_user = hooks->stop_rule_user;
    cfg->logits_processor = hooks->logits_processor;
    cfg->logits_processor_user = hooks->logits_processor_user;
    cfg->depth_policy = hooks->depth_policy;
    cfg->depth_policy_user = hooks->depth_policy_user;
}

/* A branch of a speculative or beam session takes only the hooks its mode takes at its start
   (tl_validate_mode: no depth_policy, a beam search no stop_rule, no callback grammar): the
   mode would not run the others. */
static tl_status check_branch_hooks(const tl_session *src, const tl_generate_config *hooks) {
    if (!hooks || src->decoder == &tl_plain_decoder) return TL_OK;
    tl_generate_config branch = src->cfg;
    take_hooks(&branch, hooks);
    branch.grammar = hooks->grammar;
    return tl_validate_mode(src->m, &branch);
}

static void *copy_of(const void *src, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (p && bytes) memcpy(p, src, bytes);
    return p;
}

/* A deep copy of a plain session whose cache shares src's pages. */
static tl_status clone(const tl_session *src, const tl_generate_config *hooks, tl_session **out) {
    *out = NULL;
    if (hooks && hooks->grammar) {
        tl_status st = tl_validate_grammar(src->m, hooks->grammar);
        if (st != TL_OK) return st;
    }
    tl_status branch_st = check_branch_hooks(src, hooks);
    if (branch_st != TL_OK) return branch_st;
    const tl_generate_config *c = &src->cfg;
    const int vocab = src->m->cfg.vocab_size, total = src->prompt_len + c->max_tokens;
    tl_session *s = calloc(1, sizeof *s);
    if (!s) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    *s = *src;
    /* Nothing below may point into src: reset every owned pointer, then copy. */
    s->stop_seqs = NULL;
    s->stop_store = NULL;
    s->cache = NULL;
    s->ws = (tl_workspace){0};
    s->ws.state_seed = src->ws.state_seed;
    s->tokens = s->positions = NULL;
    s->logits = s->work = NULL;
    s->tally = NULL;
    s->logit_bias = NULL;
    s->allowed = NULL;
    s->probe_logp = NULL; /* scratch: the child allocates its own at first use */
    s->logprob_scratch = NULL;
    s->dist = (tl_distribution){0};
    s->text = NULL;
    s->stop_strs = NULL;
    s->stop_lens = NULL;
    s->stop_borders = NULL;
    s->mode_state = NULL;
    s->stepping = false;
    atomic_store(&s->free_requested, false); /* (the child is nobody's engine's: *src copied its flags) */
    atomic_store(&s->engine_claimed, false);
    atomic_store(&s->stop_requested, false);
    s->stream_fn = NULL;
    s->stream_user = NULL;
    s->grammar_matcher = NULL;

    int stop_total = 0;
    for (int i = 0; i < c->n_stop_sequences; i++) stop_total += c->stop_sequences[i].n;
    s->stop_seqs = calloc((size_t)c->n_stop_sequences + 1, sizeof *s->stop_seqs);
    s->stop_store = copy_of(src->stop_store, (size_t)stop_total * sizeof *s->stop_store);
    s->tokens = copy_of(src->tokens, (size_t)total * sizeof *s->tokens);
    s->positions = copy_of(src->positions, (size_t)total * sizeof *s->positions);
    s->logits = copy_of(src->logits, (size_t)vocab * sizeof *s->logits);
    s->chosen_row = src->chosen_row && s->logits ? s->logits : NULL; /* (a plain session's: its logits) */
    s->work = tl_session_hook_buffer_new((size_t)vocab * sizeof *s->work);
    s->tally = calloc((size_t)vocab, sizeof *s->tally);
    s->logit_bias = copy_of(src->logit_bias, ((size_t)c->n_logit_bias + 1) * sizeof *s->logit_bias);
    s->allowed = tl_session_hook_buffer_new((size_t)vocab);
    s->text = src->text_cap ? copy_of(src->text, src->text_cap) : NULL;
    s->stop_strs = calloc((size_t)c->n_stop_strings + 1, sizeof *s->stop_strs);
    s->stop_lens = copy_of(src->stop_lens, ((size_t)c->n_stop_strings + 1) * sizeof *s->stop_lens);
    const size_t borders_len = tl_session_borders_len(src);
    if (borders_len > 0) s->stop_borders = copy_of(src->stop_borders, borders_len * sizeof *s->stop_borders);
    tl_status st = (s->stop_seqs && s->stop_store && s->tokens && s->positions && s->logits && s->work &&
                    s->tally && s->logit_bias && s->allowed && (s->text || !src->text_cap) && s->stop_strs && s->stop_lens &&
                    (s->stop_borders || borders_len == 0))
                       ? tl_distribution_init(&s->dist, vocab)
                       : tl_fail(TL_ERR_NO_MEMORY, "out of memory cloning a session of %d tokens", total);
    for (int i = 0, at = 0; st == TL_OK && i < c->n_stop_sequences; i++) {
        s->stop_seqs[i] = (tl_token_seq){s->stop_store + at, c->stop_sequences[i].n};
        at += c->stop_sequences[i].n;
    }
    for (int i = 0; st == TL_OK && i < c->n_stop_strings; i++)
        if (!(s->stop_strs[i] = strdup(src->stop_strs[i]))) st = tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    if (st == TL_OK) st = tl_kv_cache_fork(src->cache, &s->cache);
    s->cfg.stop_sequences = s->stop_seqs;
    s->cfg.stop_strings = (const char *const *)s->stop_strs;
    s->cfg.logit_bias = s->logit_bias;
    tl_session_own_reasoning_tags(s, &src->cfg); /* (the ids came with *s = *src; the pointers still named src's) */
    if (st == TL_OK) st = clone_grammar(s, src, hooks);
    if (st == TL_OK && src->grammar_replay) st = replay_grammar(s);
    if (st == TL_OK && src->decoder->clone) st = src->decoder->clone(s, src); /* (its grammar in place) */
    take_hooks(&s->cfg, hooks);
    if (st != TL_OK) {
        tl_session_free(s);
        return st;
    }
    *out = s;
    return TL_OK;
}

tl_status tl_session_fork(const tl_session *parent, const tl_generate_config *hooks, tl_session **child) {
    tl_clear_error();
    if (!child) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_fork: child must not be NULL");
    *child = NULL;
    tl_status st = check_clonable(parent, "tl_session_fork");
    return st == TL_OK ? clone(parent, hooks, child) : st;
}

tl_status tl_session_save(const tl_session *session, tl_session_state **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_save: out must not be NULL");
    *out = NULL;
    tl_status st = check_clonable(session, "tl_session_save");
    if (st != TL_OK) return st;
    tl_session_state *state = calloc(1, sizeof *state);
    if (!state) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    if ((st = clone(session, NULL, &state->frozen)) != TL_OK) {
        free(state);
        return st;
    }
    state->saved_at = tl_now_ms();
    *out = state;
    return TL_OK;
}

/* Time resumes where it stopped, as a state read from bytes resumes (state_file.c): the time
   spent saved counts neither as prefill nor as decoding, and a prompt saved part-way starts
   its prefill's clock (and the rows it counts, prefill_tokens) at its next row. */
static void resume_clock(tl_session *s, double saved_at) {
    const double now = tl_now_ms();
    if (s->prompt_done) {
        const double away = now - saved_at;
        s->t_start += away;
        s->t_prefill_end += away;
        if (s->t_prefill_start > 0) s->t_prefill_start += away;
    } else {
        s->t_start = now;
        s->t_prefill_start = 0;
    }
}

tl_status tl_session_resume(const tl_model *model, const tl_session_state *state, const tl_generate_config *hooks,
                            tl_session **out) {
    tl_clear_error();
    if (!out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_resume: out must not be NULL");
    *out = NULL;
    if (!model || !state) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_session_resume: model and state must not be NULL");
    if (state->frozen->m != model) {
        const tl_model *saver = state->frozen->m;
        /* (another load of the same directory read as "another model (X), not this one (X)") */
        if (saver->dir && model->dir && strcmp(saver->dir, model->dir) == 0) {
            /* (the KV types named only where they differ: "its KV cache is f32, this one's f32" puzzled) */
            char kv[96] = "";
            if (saver->kv_type != model->kv_type)
                snprintf(kv, sizeof kv, " (its KV cache is %s, this one's %s)", tl_kv_type_name(saver->kv_type),
                         tl_kv_type_name(model->kv_type));
            return tl_fail(TL_ERR_INVALID_ARGUMENT,
                           "tl_session_resume: the state was saved by another load of %s%s: a state in memory resumes "
                           "in the model that saved it; write it (tl_session_state_write) and read it into this one",
                           model->dir, kv);
        }
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "tl_session_resume: the state was saved by another model (%s), not this one (%s): its "
                       "KV cache belongs to that model's weights", saver->dir, model->dir);
    }
    tl_status st = clone(state->frozen, hooks, out);
    if (st == TL_OK) resume_clock(*out, state->saved_at);
    return st;
}

void tl_session_state_free(tl_session_state *state) {
    if (!state) return;
    tl_session_free(state->frozen);
    free(state);
}

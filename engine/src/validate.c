/* validate.c: documented defaults and every rule of a generation config (SPEC §3).
 * A message always names the field and its value, so a user can fix the call from it. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sampler.h"
#include "validate.h"

/* ---------------------------------------------------------------- defaults */

void tl_generate_config_init(tl_generate_config *cfg) {
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->max_tokens = 64;
    cfg->temperature = 0.0f;
    cfg->top_k = 50;
    cfg->top_p = 1.0f;
    cfg->repetition_penalty = 1.0f;
    cfg->length_penalty = 1.0f;
    cfg->early_exit_min_L = 2;
    cfg->early_exit_peek_every = 1;
    cfg->early_exit_threshold = 0.03f;
    cfg->early_exit_criterion = TL_EXIT_HIDDEN_STATE;
    cfg->early_exit_kl_threshold = 1e-3f;
    cfg->early_exit_entropy_threshold = 1e-3f;
    cfg->early_exit_gate_threshold = 0.0f; /* the model's */
    cfg->speculative = TL_SPECULATIVE_OFF;
    cfg->draft_loops = 2;
    cfg->draft_ahead = 4;
    cfg->K_branches = 2;
    cfg->max_nodes = 64;
}

void tl_speculative_config_init(tl_speculative_config *cfg) {
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    cfg->max_tokens = 64;
    cfg->draft_loops = 2;
    cfg->verify_loops = 8;
    cfg->draft_ahead = 4;
}

void tl_tree_speculative_config_init(tl_tree_speculative_config *cfg) {
    if (!cfg) return;
    memset(cfg, 0, sizeof *cfg);
    tl_speculative_config_init(&cfg->spec);
    cfg->K_branches = 2;
    cfg->max_nodes = 64;
}

/* ---------------------------------------------------------------- field rules */

static bool is_flag(int v) { return v == 0 || v == 1; }

/* The stop sequences' rules; report: say the fault (tl_fail), else only answer. */
#define FAULT(...) (report ? tl_fail(TL_ERR_INVALID_ARGUMENT, __VA_ARGS__) : TL_ERR_INVALID_ARGUMENT)
static tl_status check_stop_sequences(const tl_generate_config *c, int vocab, bool report) {
    if (c->n_stop_sequences < 0) return FAULT("n_stop_sequences = %d must be >= 0", c->n_stop_sequences);
    if (c->n_stop_sequences > 0 && !c->stop_sequences)
        return FAULT("n_stop_sequences = %d without stop_sequences", c->n_stop_sequences);
    for (int i = 0; i < c->n_stop_sequences; i++) {
        const tl_token_seq *s = &c->stop_sequences[i];
        if (s->n < 1) return FAULT("stop_sequences[%d] is empty (n = %d)", i, s->n);
        if (!s->tokens) return FAULT("stop_sequences[%d].tokens is NULL (n = %d)", i, s->n);
        for (int j = 0; j < s->n; j++)
            if (s->tokens[j] < 0 || s->tokens[j] >= vocab)
                return FAULT("stop_sequences[%d] token id %d is out of range [0, %d)", i, s->tokens[j], vocab);
    }
    return TL_OK;
}
#undef FAULT

bool tl_text_fields_valid(const tl_generate_config *c, int vocab) {
    return is_flag(c->keep_special_text) && is_flag(c->ignore_eos) && check_stop_sequences(c, vocab, false) == TL_OK;
}

/* Each entry's token in range, at most once, and its bias finite. */
static tl_status validate_logit_bias(const tl_generate_config *c, int vocab) {
    if (c->n_logit_bias < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_logit_bias = %d must be >= 0", c->n_logit_bias);
    if (c->n_logit_bias > 0 && !c->logit_bias)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_logit_bias = %d without logit_bias", c->n_logit_bias);
    if (c->n_logit_bias == 0) return TL_OK;
    uint8_t *listed = calloc((size_t)vocab, 1);
    if (!listed) return tl_fail(TL_ERR_NO_MEMORY, "out of memory checking logit_bias");
    tl_status st = TL_OK;
    for (int i = 0; st == TL_OK && i < c->n_logit_bias; i++) {
        const tl_logit_bias *e = &c->logit_bias[i];
        /* named by token id: what every front end's user wrote (Lua's table has no order) */
        if (e->token < 0 || e->token >= vocab)
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "logit_bias: token id %d is out of range [0, %d)", e->token, vocab);
        else if (listed[e->token])
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "logit_bias: token id %d is listed twice", e->token);
        else if (!isfinite(e->bias))
            st = tl_fail(TL_ERR_INVALID_ARGUMENT, "logit_bias: the bias of token id %d = %g must be finite", e->token,
                         (double)e->bias);
        else
            listed[e->token] = 1;
    }
    free(listed);
    return st;
}

static tl_status check_threshold(const char *name, float value) {
    if (!(value >= 0.0f) || !isfinite(value))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s = %g must be a finite number >= 0", name, (double)value);
    return TL_OK;
}

/* The criterion and its thresholds, checked whether or not early exit is on (a config that
   names a criterion this model cannot evaluate is wrong before patience is set). */
static tl_status validate_exit_criterion(const tl_model *m, const tl_generate_config *c) {
    static const char *const names[] = {"hidden_state", "latent_diff", "kl", "entropy_diff", "argmax", "gate"};
    tl_status st;
    if ((int)c->early_exit_criterion < 0 || (int)c->early_exit_criterion > TL_EXIT_GATE)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "early_exit_criterion = %d is not a criterion (0 hidden_state, 1 latent_diff, 2 kl, "
                       "3 entropy_diff, 4 argmax, 5 gate)", (int)c->early_exit_criterion);
    if ((st = check_threshold("early_exit_logit_margin", c->early_exit_logit_margin)) != TL_OK ||
        (st = check_threshold("early_exit_threshold", c->early_exit_threshold)) != TL_OK ||
        (st = check_threshold("early_exit_kl_threshold", c->early_exit_kl_threshold)) != TL_OK ||
        (st = check_threshold("early_exit_entropy_threshold", c->early_exit_entropy_threshold)) != TL_OK)
        return st;
    if (!(c->early_exit_gate_threshold >= 0.0f && c->early_exit_gate_threshold <= 1.0f))
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "early_exit_gate_threshold = %.9g must be in (0, 1] (0 = the model's exit_gate_threshold)",
                       (double)c->early_exit_gate_threshold);
    /* The margin is a variant of the hidden-state test: with another criterion it would be
       silently ignored. */
    if (c->early_exit_logit_margin > 0.0f && c->early_exit_criterion != TL_EXIT_HIDDEN_STATE)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "early_exit_logit_margin = %g applies to the hidden_state criterion only "
                       "(early_exit_criterion = %s)", (double)c->early_exit_logit_margin,
                       names[c->early_exit_criterion]);
    if (c->early_exit_criterion == TL_EXIT_GATE && !m->cfg.exit_gate)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "early_exit_criterion = gate needs a model with an exit gate (Ouro); this one has none");
    return TL_OK;
}

static tl_status validate_fields(const tl_model *m, const int32_t *prompt, int prompt_len,
                                 const tl_generate_config *c) {
    const tl_config *mc = &m->cfg;
    tl_status st;
    if (!prompt && prompt_len > 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt must not be NULL");
    if (prompt_len < 1) return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt_len = %d must be >= 1", prompt_len);
    if (c->max_tokens < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_tokens = %d must be >= 0", c->max_tokens);
    if ((long long)prompt_len + c->max_tokens > mc->max_seq_len)
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "prompt_len + max_tokens = %d + %d exceeds max_seq_len = %d", prompt_len,
                       c->max_tokens, mc->max_seq_len);
    for (int i = 0; i < prompt_len; i++)
        if (prompt[i] < 0 || prompt[i] >= mc->vocab_size)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "prompt token id %d at index %d is out of range [0, %d)",
                           prompt[i], i, mc->vocab_size);
    if (c->loops != 0 && (c->loops < 1 || c->loops > mc->max_loops))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "loops = %d is out of range [1, max_loops = %d] (0 = default)",
                       c->loops, mc->max_loops);
    if (!(c->temperature >= 0.0f) || !isfinite(c->temperature))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "temperature = %g must be a finite number >= 0", (double)c->temperature);
    if (c->temperature > 0.01f && c->top_k < 1 && c->beam_size < 2) /* (beam search samples nothing: SPEC §3) */
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_k = %d must be >= 1 when sampling (temperature = %g)",
                       c->top_k, (double)c->temperature);
    if (!(c->top_p > 0.0f && c->top_p <= 1.0f))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "top_p = %.9g must be in (0, 1]", (double)c->top_p); /* (%g showed 1.0000001 as 1) */
    if (!(c->repetition_penalty > 0.0f) || !isfinite(c->repetition_penalty))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "repetition_penalty = %g must be a finite number > 0",
                       (double)c->repetition_penalty);
    if (!isfinite(c->presence_penalty))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "presence_penalty = %g must be finite", (double)c->presence_penalty);
    if (!isfinite(c->frequency_penalty))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "frequency_penalty = %g must be finite", (double)c->frequency_penalty);
    if (c->penalty_window < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "penalty_window = %d must be >= 0 (0 = the whole sequence)",
                       c->penalty_window);
    /* the 0/1 fields (another value was taken as true, or as false, by whichever reader) */
    const struct { const char *name; int value; } flags[] = {
        {"penalties_count_prompt", c->penalties_count_prompt}, {"keep_special_text", c->keep_special_text},
        {"fixed_state_seed", c->fixed_state_seed}, {"ignore_eos", c->ignore_eos},
        {"temperature_last", c->temperature_last}};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (!is_flag(flags[i].value))
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s = %d must be 0 or 1", flags[i].name, flags[i].value);
    if ((st = validate_logit_bias(c, mc->vocab_size)) != TL_OK) return st;
    if (!(c->min_p >= 0.0f && c->min_p <= 1.0f))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "min_p = %g must be in [0, 1] (0 = off)", (double)c->min_p);
    if (c->min_tokens < 0 || c->min_tokens > c->max_tokens)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "min_tokens = %d must be in [0, max_tokens = %d]", c->min_tokens,
                       c->max_tokens);
    if (c->cache_window < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "cache_window = %d must be >= 0 (0 = unbounded)", c->cache_window);
    if ((st = check_stop_sequences(c, mc->vocab_size, true)) != TL_OK) return st;
    if (c->beam_size < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "beam_size = %d must be >= 0", c->beam_size);
    if (c->beam_size > TL_MAX_BEAM_SIZE)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "beam_size = %d is above %d", c->beam_size, TL_MAX_BEAM_SIZE);
    if (!isfinite(c->length_penalty))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "length_penalty = %g must be finite", (double)c->length_penalty);
    if (c->early_exit_patience < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "early_exit_patience = %d must be >= 0", c->early_exit_patience);
    if (c->early_exit_min_L < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "early_exit_min_L = %d must be >= 1", c->early_exit_min_L);
    /* with early exit on, past max_loops no depth reaches it (taken, early exit silently never
       ran); past this run's loops alone it stays valid, the default 2 with loops = 1 included */
    if (tl_early_exit_on(c) && c->early_exit_min_L > mc->max_loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "early_exit_min_L = %d is past max_loops = %d: no loop would be checked",
                       c->early_exit_min_L, mc->max_loops);
    if (c->early_exit_peek_every < 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "early_exit_peek_every = %d must be >= 1", c->early_exit_peek_every);
    if ((st = validate_exit_criterion(m, c)) != TL_OK) return st;
    if (c->n_stop_strings < 0) return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_stop_strings = %d must be >= 0", c->n_stop_strings);
    if (c->n_stop_strings > 0 && !c->stop_strings)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "n_stop_strings = %d without stop_strings", c->n_stop_strings);
    for (int i = 0; i < c->n_stop_strings; i++) {
        if (!c->stop_strings[i]) return tl_fail(TL_ERR_INVALID_ARGUMENT, "stop_strings[%d] is NULL", i);
        if (!c->stop_strings[i][0]) return tl_fail(TL_ERR_INVALID_ARGUMENT, "stop_strings[%d] is empty", i);
    }
    if (c->n_stop_strings > 0 && !m->tokenizer)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "stop_strings need a tokenizer, and this model has no tokenizer.json");
    return c->grammar ? tl_validate_grammar(m, c->grammar) : TL_OK;
}

tl_status tl_validate_grammar(const tl_model *m, const tl_grammar *g) {
    if (!g->compiled && (!g->allowed || !g->advance))
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "grammar needs both an allowed and an advance callback (or a compiled grammar)");
    if (g->compiled && !m->tokenizer)
        return tl_fail(TL_ERR_UNSUPPORTED, "a compiled grammar needs the model's tokenizer.json (token bytes)");
    return TL_OK;
}

/* ---------------------------------------------------------------- modes */

static tl_status validate_speculative(const tl_model *m, const tl_generate_config *c) {
    const int verify = c->loops ? c->loops : m->cfg.default_loops;
    if (c->speculative != TL_SPECULATIVE_CHAIN && c->speculative != TL_SPECULATIVE_TREE)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "speculative = %d is not a mode (0 off, 1 chain, 2 tree)",
                       (int)c->speculative);
    const char *mode = c->speculative == TL_SPECULATIVE_CHAIN ? "chain" : "tree";
    if (c->draft_loops < 1 || c->draft_loops >= verify)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_loops = %d must be in [1, verify_loops = %d)",
                       c->draft_loops, verify);
    if (c->draft_ahead < 1 || c->draft_ahead > TL_MAX_DRAFT_AHEAD)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_ahead = %d is out of range [1, %d]", c->draft_ahead,
                       TL_MAX_DRAFT_AHEAD);
    /* The tree's fields are checked in chain mode too: a value out of range is a mistake
       whichever mode reads it (a sweep's config goes from one mode to the other). */
    if (c->K_branches < 1 || c->K_branches > TL_MAX_K_BRANCHES)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "K_branches = %d is out of range [1, %d]", c->K_branches,
                       TL_MAX_K_BRANCHES);
    if (c->max_nodes < 2 || c->max_nodes > TL_MAX_TREE_NODES)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_nodes = %d is out of range [2, %d]", c->max_nodes,
                       TL_MAX_TREE_NODES);
    if (c->speculative == TL_SPECULATIVE_TREE) {
        if (c->temperature > 0.01f)
            return tl_fail(TL_ERR_UNSUPPORTED,
                           "temperature = %g: tree speculative sampling is not implemented (use greedy, or the chain)",
                           (double)c->temperature);
    }
    if (c->beam_size >= 2)
        return tl_fail(TL_ERR_UNSUPPORTED, "speculative decoding (%s) does not combine with beam search (beam_size = %d)",
                       mode, c->beam_size);
    if (tl_early_exit_on(c))
        return tl_fail(TL_ERR_UNSUPPORTED, "speculative decoding (%s) does not combine with early exit "
                       "(early_exit_patience = %d%s)", mode, c->early_exit_patience,
                       c->depth_policy ? ", a depth_policy hook" : "");
    /* Drafts need the grammar's state after a drafted path: compiled grammars have it (states
       are values); a callback grammar can only advance. */
    if (c->grammar && !c->grammar->compiled)
        return tl_fail(TL_ERR_UNSUPPORTED,
                       "speculative decoding (%s) with a callback grammar is not supported (it cannot roll back): "
                       "use a compiled grammar (GBNF or JSON Schema)", mode);
    return TL_OK;
}

/* The thinking budget's fields (reasoning_budget and its tags). */
static tl_status validate_reasoning(const tl_model *m, const tl_generate_config *c) {
    if (c->reasoning_budget < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "reasoning_budget = %d must be >= 0 (0 = off)", c->reasoning_budget);
    if (c->reasoning_open != 0 && c->reasoning_open != 1)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "reasoning_open = %d must be 0 or 1", c->reasoning_open);
    if (c->reasoning_budget == 0) return TL_OK;
    const tl_token_seq *tags[2] = {&c->reasoning_start, &c->reasoning_end};
    const char *names[2] = {"reasoning_start", "reasoning_end"};
    for (int t = 0; t < 2; t++) {
        const tl_token_seq *tag = tags[t];
        const int least = t == 0 && c->reasoning_open ? 0 : 1;
        if (tag->n < least || tag->n > TL_MAX_REASONING_TAG)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s has %d ids: a thinking budget needs %d to %d", names[t], tag->n, least,
                           TL_MAX_REASONING_TAG);
        if (tag->n > 0 && !tag->tokens)
            return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s.tokens is NULL (n = %d)", names[t], tag->n);
        for (int j = 0; j < tag->n; j++) {
            if (tag->tokens[j] < 0 || tag->tokens[j] >= m->cfg.vocab_size)
                return tl_fail(TL_ERR_INVALID_ARGUMENT, "%s token id %d is out of range [0, %d)", names[t], tag->tokens[j],
                               m->cfg.vocab_size);
            /* (the budget forces the end's ids past every ban: an end among them stopped the
               reply there, before min_tokens, and inside the block it was closing) */
            if (tl_is_end(c, m->cfg.eos_token_id, tag->tokens[j]))
                return tl_fail(TL_ERR_INVALID_ARGUMENT,
                               "%s token id %d ends generation (eos_token_id or a one-token stop sequence): a tag of the "
                               "thinking block cannot", names[t], tag->tokens[j]);
        }
    }
    if (c->speculative != TL_SPECULATIVE_OFF || c->beam_size >= 2)
        return tl_fail(TL_ERR_UNSUPPORTED, "a thinking budget (reasoning_budget = %d) is for plain decoding, not %s",
                       c->reasoning_budget, c->beam_size >= 2 ? "beam search" : "speculative decoding");
    return TL_OK;
}

/* Beam search ranks whole hypotheses: rules that judge one emitted sequence at a time (a
   stop rule, stop strings, a callback grammar) or forget history (a window) would need one
   state per beam, which is not built. A compiled grammar's states are values: each hypothesis
   carries its own (beam.c). on_token observes the settled tokens and works. */
static tl_status validate_beam(const tl_generate_config *c) {
    const char *what = c->grammar && !c->grammar->compiled
                         ? "a callback grammar (its state cannot be copied per hypothesis: use a compiled grammar, GBNF or JSON Schema)"
                     : c->stop_rule ? "a stop_rule hook"
                     : c->n_stop_strings > 0 ? "stop strings"
                     : c->cache_window > 0 ? "cache_window"
                     : tl_early_exit_on(c) ? "early exit (early_exit_patience or depth_policy)" : NULL;
    if (what)
        return tl_fail(TL_ERR_UNSUPPORTED, "beam search (beam_size = %d) does not support %s yet", c->beam_size, what);
    return TL_OK;
}

tl_status tl_validate_mode(const tl_model *m, const tl_generate_config *c) {
    tl_status st = TL_OK;
    if (c->speculative != TL_SPECULATIVE_OFF) st = validate_speculative(m, c);
    if (st == TL_OK && c->beam_size >= 2) st = validate_beam(c);
    return st;
}

tl_status tl_generate_validate(const tl_model *m, const int32_t *prompt, int prompt_len,
                               const tl_generate_config *c) {
    if (!m) return tl_fail(TL_ERR_INVALID_ARGUMENT, "model must not be NULL");
    if (!c) return tl_fail(TL_ERR_INVALID_ARGUMENT, "config must not be NULL");
    tl_status st = validate_fields(m, prompt, prompt_len, c);
    if (st == TL_OK) st = validate_reasoning(m, c);
    if (st == TL_OK) st = tl_validate_mode(m, c);
    return st;
}

tl_status tl_speculative_validate(const tl_model *m, const tl_speculative_config *c) {
    if (!m) return tl_fail(TL_ERR_INVALID_ARGUMENT, "model must not be NULL");
    if (!c) return tl_fail(TL_ERR_INVALID_ARGUMENT, "speculative config must not be NULL");
    if (c->verify_loops < 1 || c->verify_loops > m->cfg.max_loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "verify_loops = %d is out of range [1, max_loops = %d]",
                       c->verify_loops, m->cfg.max_loops);
    if (c->draft_loops < 1 || c->draft_loops >= c->verify_loops)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_loops = %d must be in [1, verify_loops = %d)",
                       c->draft_loops, c->verify_loops);
    if (c->draft_ahead < 1 || c->draft_ahead > TL_MAX_DRAFT_AHEAD)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "draft_ahead = %d is out of range [1, %d]", c->draft_ahead,
                       TL_MAX_DRAFT_AHEAD);
    return TL_OK;
}

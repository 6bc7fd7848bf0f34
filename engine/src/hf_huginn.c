/* hf_huginn.c: Huginn-0125 (model_type "huginn_raven", RavenForCausalLM) checkpoint folders,
 * with their published config and tensor names, mapped onto the family's options (SPEC §1):
 *   x = wte[t] * embed_scale; prelude; s0 = 0 (tl_score) or a truncated normal;
 *   loop: s = core_block(adapter([s ; e])) (replace, beta 1, no state norm);
 *   coda(ln_f(s)); logits = lm_head(ln_f(.)): the same ln_f before and after the coda.
 * Layers are "sandwich" blocks with 4 RMSNorms: x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x));
 * attention has a fused Wqkv, a per-head qk_bias [2, 1, H, hd] added before RoPE on
 * interleaved pairs; the MLP's fused fc holds the gate rows first, then the up rows. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "loader.h"

/* The published class names this mapping implements; another value is a different model. */
static tl_status check_class(const cJSON *root, const char *field, const char *expected) {
    const char *value;
    tl_status st = tl_hf_string(root, field, &value);
    if (st == TL_OK && value && strcmp(value, expected) != 0)
        st = tl_fail(TL_ERR_UNSUPPORTED, "config.json: Huginn %s = \"%s\" is not supported (only \"%s\")",
                     field, value, expected);
    return st;
}

/* init_values.<name> when config.json carries it (it overrides the derived value, as in the
   published config class), else `derived`. */
static tl_status init_value(const cJSON *root, const char *name, double derived, float *out) {
    const cJSON *values = cJSON_GetObjectItemCaseSensitive(root, "init_values");
    *out = (float)derived;
    if (!cJSON_IsObject(values)) return TL_OK;
    return tl_hf_float(values, name, 0.0, 1e6, out); /* the message names the field */
}

static tl_status token_id(const cJSON *root, const char *name, int fallback, int vocab, int *out) {
    *out = fallback < vocab ? fallback : 0;
    return tl_hf_int(root, name, false, 0, vocab - 1, out);
}

static tl_status huginn_config(const cJSON *root, tl_config *c) {
    tl_status st;
    int n_layers = -1;
    float noise = 0.0f;
    const char *injection, *state_init;
    tl_config_defaults(c);
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
    TRY(check_class(root, "block_class_name", "SandwichBlock"));
    TRY(check_class(root, "norm_class_name", "RMSNorm_llama"));
    TRY(check_class(root, "mlp_class_name", "GatedMLP"));
    TRY(check_class(root, "nonlin_name", "SiLU"));
    TRY(tl_hf_int(root, "n_embd", true, 1, 1 << 20, &c->d_model));
    c->n_heads = -1;
    TRY(tl_hf_int(root, "n_heads", false, 1, 1 << 20, &c->n_heads));
    if (c->n_heads < 0) TRY(tl_hf_int(root, "num_attention_heads", true, 1, 1 << 20, &c->n_heads));
    c->n_kv_heads = c->n_heads;
    TRY(tl_hf_int(root, "num_key_value_heads", false, 1, 1 << 20, &c->n_kv_heads));
    if (c->n_kv_heads != c->n_heads)
        return tl_fail(TL_ERR_UNSUPPORTED, "config.json: num_key_value_heads = %d differs from n_heads = %d: "
                       "grouped-query attention is not part of Huginn's architecture", c->n_kv_heads, c->n_heads);
    TRY(tl_hf_int(root, "intermediate_size", true, 1, 1 << 22, &c->d_ff));
    TRY(tl_hf_int(root, "block_size", true, 1, 1 << 24, &c->max_seq_len));
    TRY(tl_hf_int(root, "vocab_size", true, 1, 1 << 24, &c->vocab_size));
    /* The embedding and head have padded_vocab_size rows (ids past vocab_size are padding). */
    TRY(tl_hf_int(root, "padded_vocab_size", false, c->vocab_size, 1 << 24, &c->vocab_size));
    TRY(tl_hf_int(root, "n_layers_in_prelude", true, 0, 4096, &c->n_prelude));
    TRY(tl_hf_int(root, "n_layers_in_recurrent_block", true, 1, 4096, &c->n_block));
    TRY(tl_hf_int(root, "n_layers_in_coda", true, 0, 4096, &c->n_coda));
    TRY(tl_hf_int(root, "n_layers", false, 0, 3 * 4096, &n_layers));
    if (n_layers >= 0 && n_layers != c->n_prelude + c->n_block + c->n_coda)
        return tl_fail(TL_ERR_FORMAT, "config.json: n_layers = %d is not n_layers_in_prelude + "
                       "n_layers_in_recurrent_block + n_layers_in_coda = %d", n_layers,
                       c->n_prelude + c->n_block + c->n_coda);
    TRY(tl_hf_int(root, "mean_recurrence", true, 1, 4096, &c->default_loops));
    /* SPEC §1's default ceiling: KV pages follow the depth a session runs (kv_cache.h), so
       deeper loops than the trained ones cost nothing until used. */
    c->max_loops = tl_config_default_max_loops(c->default_loops);
    c->norm_eps = 1e-6f;
    TRY(tl_hf_float(root, "norm_eps", 0.0, 1.0, &c->norm_eps));
    c->rope_theta = 50000.0f;
    TRY(tl_hf_float(root, "rope_base", 0.0, 1e12, &c->rope_theta));
    c->qk_bias = true;
    TRY(tl_hf_bool(root, "qk_bias", &c->qk_bias));
    bool adapter_bias = false;
    TRY(tl_hf_bool(root, "bias", &adapter_bias));
    /* (both names are seen in the wild; two that disagree are a mistake either way) */
    bool tie_word = true, tie = true;
    TRY(tl_hf_bool(root, "tie_word_embeddings", &tie_word));
    TRY(tl_hf_bool(root, "tie_embeddings", &tie));
    const cJSON *tie_word_item = cJSON_GetObjectItemCaseSensitive(root, "tie_word_embeddings");
    const cJSON *tie_item = cJSON_GetObjectItemCaseSensitive(root, "tie_embeddings");
    if (cJSON_IsBool(tie_word_item) && cJSON_IsBool(tie_item) && tie_word != tie)
        return tl_fail(TL_ERR_FORMAT, "config.json: tie_word_embeddings = %s and tie_embeddings = %s disagree",
                       tie_word ? "true" : "false", tie ? "true" : "false");
    c->tie_embeddings = cJSON_IsBool(tie_item) ? tie : tie_word;
    TRY(tl_hf_string(root, "injection_type", &injection));
    if (injection && strcmp(injection, "linear") != 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "config.json: Huginn injection_type = \"%s\" is not supported "
                       "(only \"linear\")", injection);
    TRY(tl_hf_float(root, "test_time_noise", -1.0, 1e6, &noise));
    if (noise != 0.0f)
        return tl_fail(TL_ERR_UNSUPPORTED, "config.json: Huginn test_time_noise = %g is not supported "
                       "(only 0: the engine's forward pass is deterministic)", noise);
    TRY(tl_hf_string(root, "state_init", &state_init));
    const double derived_std = sqrt(2.0 / (5.0 * c->d_model));
    TRY(init_value(root, "embed_scale", sqrt((double)c->d_model), &c->embed_scale));
    TRY(init_value(root, "std", derived_std, &c->state_init_std));
    if (!state_init || strcmp(state_init, "like-init") == 0) c->state_init = TL_STATE_TRUNCATED_NORMAL;
    else if (strcmp(state_init, "zero") == 0) c->state_init = TL_STATE_ZERO;
    else
        return tl_fail(TL_ERR_UNSUPPORTED, "config.json: Huginn state_init = \"%s\" is not supported "
                       "(\"like-init\" or \"zero\")", state_init);
    TRY(token_id(root, "bos_token_id", 65504, c->vocab_size, &c->bos_token_id));
    TRY(token_id(root, "eos_token_id", 65505, c->vocab_size, &c->eos_token_id));
#undef TRY
    c->bias = false; /* Huginn's `bias` is the adapter's alone (bound in huginn_bind) */
    c->inject_bias = adapter_bias;
    c->norm = TL_NORM_RMSNORM;
    c->mlp = TL_MLP_SWIGLU;
    c->pos_encoding = TL_POS_ROPE;
    c->injection = TL_INJECT_CONCAT;
    c->loop_update = TL_UPDATE_REPLACE;
    c->norm_placement = TL_PLACE_SANDWICH;
    c->rope_pairing = TL_ROPE_INTERLEAVED;
    c->final_norm_before_coda = true;
    return tl_config_check(c);
}

static tl_status huginn_layer(tl_binder *b, const char *group, int index, tl_layer *L) {
    const tl_config *c = &b->m->cfg;
    const int d = c->d_model, hd = c->head_dim, qd = c->n_heads * hd, kvd = c->n_kv_heads * hd;
    char name[160];
    tl_status st;
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
#define NAME(suffix) (snprintf(name, sizeof name, "transformer.%s.%d.%s", group, index, suffix), name)
    TRY(tl_bind_vector(b, NAME("norm_1.weight"), d, &L->attn_norm_w));
    TRY(tl_bind_vector(b, NAME("norm_2.weight"), d, &L->attn_out_norm_w));
    TRY(tl_bind_vector(b, NAME("norm_3.weight"), d, &L->mlp_norm_w));
    TRY(tl_bind_vector(b, NAME("norm_4.weight"), d, &L->mlp_out_norm_w));
    /* Wqkv rows: q [qd], then k [kvd], then v [kvd]. */
    const int qkv = qd + 2 * kvd;
    TRY(tl_bind_matrix_rows(b, NAME("attn.Wqkv.weight"), qkv, d, 0, qd, &L->q));
    TRY(tl_bind_matrix_rows(b, NAME("attn.Wqkv.weight"), qkv, d, qd, kvd, &L->k));
    TRY(tl_bind_matrix_rows(b, NAME("attn.Wqkv.weight"), qkv, d, qd + kvd, kvd, &L->v));
    if (c->qk_bias) {
        const int64_t shape[4] = {2, 1, c->n_heads, hd};
        TRY(tl_bind_vector_part(b, NAME("attn.qk_bias"), shape, 4, 0, qd, &L->q_b));
        TRY(tl_bind_vector_part(b, NAME("attn.qk_bias"), shape, 4, qd, kvd, &L->k_b));
    }
    TRY(tl_bind_matrix(b, NAME("attn.proj.weight"), d, qd, &L->o));
    /* fc rows: the gate half (through SiLU) first, then the up half. */
    TRY(tl_bind_matrix_rows(b, NAME("mlp.fc.weight"), 2 * c->d_ff, d, 0, c->d_ff, &L->gate));
    TRY(tl_bind_matrix_rows(b, NAME("mlp.fc.weight"), 2 * c->d_ff, d, c->d_ff, c->d_ff, &L->up));
    TRY(tl_bind_matrix(b, NAME("mlp.proj.weight"), d, c->d_ff, &L->down));
#undef NAME
#undef TRY
    return TL_OK;
}

static tl_status huginn_bind(tl_binder *b) {
    const tl_config *c = &b->m->cfg;
    tl_weights *w = &b->m->w;
    const int d = c->d_model;
    tl_status st;
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
    TRY(tl_bind_matrix(b, "transformer.wte.weight", c->vocab_size, d, &w->tok_embed));
    for (int i = 0; i < c->n_prelude; i++) TRY(huginn_layer(b, "prelude", i, &w->prelude[i]));
    TRY(tl_bind_matrix(b, "transformer.adapter.weight", d, 2 * d, &w->inject));
    if (c->inject_bias) TRY(tl_bind_vector(b, "transformer.adapter.bias", d, &w->inject_b));
    for (int i = 0; i < c->n_block; i++) TRY(huginn_layer(b, "core_block", i, &w->block[i]));
    for (int i = 0; i < c->n_coda; i++) TRY(huginn_layer(b, "coda", i, &w->coda[i]));
    TRY(tl_bind_vector(b, "transformer.ln_f.weight", d, &w->final_norm_w));
    TRY(tl_bind_head(b, "lm_head.weight"));
#undef TRY
    tl_bind_ignore(b, "freqs_cis"); /* RoPE table buffer: the engine computes its own */
    return TL_OK;
}

const tl_family tl_family_huginn = {
    .model_type = "huginn_raven",
    .architecture = "RavenForCausalLM",
    .parse_config = huginn_config,
    .bind = huginn_bind,
};

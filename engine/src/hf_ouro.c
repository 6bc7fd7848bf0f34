/* hf_ouro.c: Ouro (model_type "ouro", OuroForCausalLM) checkpoint folders, with their
 * published config and tensor names, mapped onto the family's options (SPEC §1):
 *   the whole stack is the loop (no prelude, coda or injection: the state starts as the
 *   embedding); each pass ends with model.norm, whose output feeds the next pass and, after
 *   the last, the head directly (state norm reusing the final norm, none at the head);
 *   layers have 4 RMSNorms, the 2nd and 4th on the branch outputs:
 *   x += n2(attn(n1 x)); x += n4(mlp(n3 x)); RoPE "rotate half"; SwiGLU;
 *   an exit gate sigma(early_exit_gate(h)) after each pass. */
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "loader.h"

/* bos/eos ids: an integer, a list (its first id) or null (then `fallback`). */
static tl_status token_id(const cJSON *root, const char *name, int vocab, int *out) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, name);
    *out = 0;
    if (cJSON_IsArray(item)) {
        cJSON *wrapper = cJSON_CreateObject();
        tl_status st = TL_OK;
        if (!wrapper) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
        const cJSON *first = cJSON_GetArrayItem(item, 0);
        if (first) {
            cJSON *copy = cJSON_Duplicate(first, true);
            if (!copy || !cJSON_AddItemToObject(wrapper, name, copy)) { /* (else read as missing) */
                cJSON_Delete(copy);
                cJSON_Delete(wrapper);
                return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
            }
            st = tl_hf_int(wrapper, name, false, 0, vocab - 1, out);
        }
        cJSON_Delete(wrapper);
        return st;
    }
    return tl_hf_int(root, name, false, 0, vocab - 1, out);
}

/* Options of the Ouro config that change the computation and that the engine does not
   implement: refused by name rather than silently ignored. */
static tl_status refuse_unsupported(const cJSON *root) {
    const cJSON *scaling = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    /* {"rope_type": "default"} (or the older "type") is plain RoPE, as transformers reads it */
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(scaling, "rope_type");
    if (!kind) kind = cJSON_GetObjectItemCaseSensitive(scaling, "type");
    const bool plain = cJSON_IsObject(scaling) && cJSON_IsString(kind) && strcmp(kind->valuestring, "default") == 0;
    if (scaling && !cJSON_IsNull(scaling) && !plain)
        return tl_fail(TL_ERR_UNSUPPORTED, "config.json: rope_scaling is not supported (only plain RoPE)");
    bool sliding = false;
    tl_status st = tl_hf_bool(root, "use_sliding_window", &sliding);
    if (st != TL_OK) return st;
    if (sliding)
        return tl_fail(TL_ERR_UNSUPPORTED, "config.json: use_sliding_window = true is not supported "
                       "(sliding-window layers)");
    const cJSON *types = cJSON_GetObjectItemCaseSensitive(root, "layer_types");
    if (types && !cJSON_IsNull(types) && !cJSON_IsArray(types))
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"layer_types\" must be a list of strings");
    int i = 0;
    for (const cJSON *t = cJSON_IsArray(types) ? types->child : NULL; t; t = t->next, i++)
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "full_attention") != 0)
            return tl_fail(TL_ERR_UNSUPPORTED, "config.json: layer_types[%d] is not \"full_attention\" "
                           "(sliding-window layers are not supported)", i);
    const char *act;
    if ((st = tl_hf_string(root, "hidden_act", &act)) != TL_OK) return st;
    if (act && strcmp(act, "silu") != 0)
        return tl_fail(TL_ERR_UNSUPPORTED, "config.json: hidden_act = \"%s\" is not supported (only \"silu\")", act);
    bool attention_bias = false;
    if ((st = tl_hf_bool(root, "attention_bias", &attention_bias)) != TL_OK) return st;
    if (attention_bias)
        return tl_fail(TL_ERR_UNSUPPORTED, "config.json: attention_bias = true is not part of Ouro's architecture");
    return TL_OK;
}

static tl_status ouro_config(const cJSON *root, tl_config *c) {
    tl_status st;
    int head_dim = -1;
    tl_config_defaults(c);
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
    TRY(refuse_unsupported(root));
    TRY(tl_hf_int(root, "vocab_size", true, 1, 1 << 24, &c->vocab_size));
    TRY(tl_hf_int(root, "hidden_size", true, 1, 1 << 20, &c->d_model));
    TRY(tl_hf_int(root, "intermediate_size", true, 1, 1 << 22, &c->d_ff));
    TRY(tl_hf_int(root, "num_hidden_layers", true, 1, 4096, &c->n_block));
    TRY(tl_hf_int(root, "num_attention_heads", true, 1, 1 << 20, &c->n_heads));
    c->n_kv_heads = c->n_heads;
    TRY(tl_hf_int(root, "num_key_value_heads", false, 1, 1 << 20, &c->n_kv_heads));
    TRY(tl_hf_int(root, "head_dim", false, 1, 1 << 20, &head_dim));
    if (head_dim > 0 && (int64_t)head_dim * c->n_heads != c->d_model) /* (both up to 2^20) */
        return tl_fail(TL_ERR_UNSUPPORTED, "config.json: head_dim = %d with num_attention_heads = %d does not "
                       "span hidden_size = %d (not supported)", head_dim, c->n_heads, c->d_model);
    c->max_seq_len = 32768;
    TRY(tl_hf_int(root, "max_position_embeddings", false, 1, 1 << 24, &c->max_seq_len));
    c->norm_eps = 1e-6f;
    TRY(tl_hf_float(root, "rms_norm_eps", 0.0, 1.0, &c->norm_eps));
    TRY(tl_hf_float(root, "rope_theta", 0.0, 1e12, &c->rope_theta));
    TRY(tl_hf_bool(root, "tie_word_embeddings", &c->tie_embeddings));
    c->default_loops = 4;
    TRY(tl_hf_int(root, "total_ut_steps", false, 1, 4096, &c->default_loops));
    /* SPEC §1's default ceiling: KV pages follow the depth a session runs (kv_cache.h), so
       deeper loops than the trained ones cost nothing until used. */
    c->max_loops = tl_config_default_max_loops(c->default_loops);
    c->exit_threshold = 1.0f;
    TRY(tl_hf_float(root, "early_exit_threshold", 0.0, 1.0, &c->exit_threshold));
    TRY(token_id(root, "bos_token_id", c->vocab_size, &c->bos_token_id));
    TRY(token_id(root, "eos_token_id", c->vocab_size, &c->eos_token_id));
#undef TRY
    c->norm = TL_NORM_RMSNORM;
    c->mlp = TL_MLP_SWIGLU;
    c->pos_encoding = TL_POS_ROPE;
    c->injection = TL_INJECT_NONE;
    c->loop_update = TL_UPDATE_REPLACE;
    c->norm_placement = TL_PLACE_PRE_POST;
    c->state_norm = true;
    c->state_norm_is_final_norm = true;
    c->final_norm_at_head = false;
    c->exit_gate = true;
    return tl_config_check(c);
}

static tl_status ouro_layer(tl_binder *b, int index, tl_layer *L) {
    const tl_config *c = &b->m->cfg;
    const int d = c->d_model, qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    char name[160];
    tl_status st;
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
#define NAME(suffix) (snprintf(name, sizeof name, "model.layers.%d.%s", index, suffix), name)
    TRY(tl_bind_vector(b, NAME("input_layernorm.weight"), d, &L->attn_norm_w));
    TRY(tl_bind_vector(b, NAME("input_layernorm_2.weight"), d, &L->attn_out_norm_w));
    TRY(tl_bind_vector(b, NAME("post_attention_layernorm.weight"), d, &L->mlp_norm_w));
    TRY(tl_bind_vector(b, NAME("post_attention_layernorm_2.weight"), d, &L->mlp_out_norm_w));
    TRY(tl_bind_matrix(b, NAME("self_attn.q_proj.weight"), qd, d, &L->q));
    TRY(tl_bind_matrix(b, NAME("self_attn.k_proj.weight"), kvd, d, &L->k));
    TRY(tl_bind_matrix(b, NAME("self_attn.v_proj.weight"), kvd, d, &L->v));
    TRY(tl_bind_matrix(b, NAME("self_attn.o_proj.weight"), d, qd, &L->o));
    TRY(tl_bind_matrix(b, NAME("mlp.gate_proj.weight"), c->d_ff, d, &L->gate));
    TRY(tl_bind_matrix(b, NAME("mlp.up_proj.weight"), c->d_ff, d, &L->up));
    TRY(tl_bind_matrix(b, NAME("mlp.down_proj.weight"), d, c->d_ff, &L->down));
#undef NAME
#undef TRY
    return TL_OK;
}

static tl_status ouro_bind(tl_binder *b) {
    const tl_config *c = &b->m->cfg;
    tl_weights *w = &b->m->w;
    const int d = c->d_model;
    tl_status st;
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
    TRY(tl_bind_matrix(b, "model.embed_tokens.weight", c->vocab_size, d, &w->tok_embed));
    for (int i = 0; i < c->n_block; i++) TRY(ouro_layer(b, i, &w->block[i]));
    TRY(tl_bind_vector(b, "model.norm.weight", d, &w->final_norm_w));
    w->state_norm_w = w->final_norm_w;
    TRY(tl_bind_matrix(b, "model.early_exit_gate.weight", 1, d, &w->exit_gate));
    TRY(tl_bind_vector(b, "model.early_exit_gate.bias", 1, &w->exit_gate_b));
    TRY(tl_bind_head(b, "lm_head.weight"));
#undef TRY
    tl_bind_ignore(b, "model.rotary_emb.inv_freq"); /* a RoPE buffer, when a file keeps it */
    return TL_OK;
}

const tl_family tl_family_ouro = {
    .model_type = "ouro",
    .architecture = "OuroForCausalLM",
    .parse_config = ouro_config,
    .bind = ouro_bind,
};

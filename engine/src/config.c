/* config.c: config.json -> tl_config, with every field validated (SPEC §1). */
#include <math.h>
#include <ctype.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "internal.h"
#include "tokenizer.h" /* tl_tlz_quote_in */

/* Upper bounds that keep sizes far from integer overflow while allowing any real model. */
#define MAX_DIM (1 << 20)
#define MAX_LAYERS 4096
#define MAX_LOOPS 4096

/* ---------------------------------------------------------------- field readers */

/* Names looked up during the parse running on this thread. Whatever top-level key nobody
   looked up is an unknown field (a warning, SPEC §1). Recording in the one lookup function
   keeps the readers' signatures and makes a field known by being read, wherever it is. */
#define MAX_READ_FIELDS 256
typedef struct field_log { const char *names[MAX_READ_FIELDS]; int n; } field_log;
static _Thread_local field_log *reading;

static const cJSON *field(const cJSON *root, const char *name) {
    if (reading && reading->n < MAX_READ_FIELDS) reading->names[reading->n++] = name;
    return cJSON_GetObjectItemCaseSensitive(root, name);
}

/* Each reader returns TL_OK, or an error naming the field and the offending value.
   `required` false means an absent (or null) field keeps *out unchanged. */

static void describe(const cJSON *item, char *buf, size_t len) {
    /* cJSON reads 1e400 as inf and would print it as "null". */
    if (cJSON_IsNumber(item) && !isfinite(item->valuedouble)) {
        snprintf(buf, len, "a number beyond the range of a double");
        return;
    }
    char *text = cJSON_PrintUnformatted(item);
    snprintf(buf, len, "%s", text ? text : "?");
    if (strlen(buf) > 60) strcpy(buf + 57, "...");
    cJSON_free(text);
}

static tl_status read_int(const cJSON *root, const char *name, bool required, int lo, int hi,
                          int *out) {
    const cJSON *item = field(root, name);
    char shown[64];
    if (!item || cJSON_IsNull(item)) {
        if (required) return tl_fail(TL_ERR_FORMAT, "config.json: missing required field \"%s\"", name);
        return TL_OK;
    }
    describe(item, shown, sizeof shown);
    if (!cJSON_IsNumber(item) || item->valuedouble != floor(item->valuedouble))
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" must be an integer, got %s", name, shown);
    if (item->valuedouble < lo || item->valuedouble > hi)
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" = %s is out of range [%d, %d]",
                       name, shown, lo, hi);
    *out = (int)item->valuedouble;
    return TL_OK;
}

static tl_status read_float(const cJSON *root, const char *name, double lo, double hi,
                            bool lo_open, float *out) {
    const cJSON *item = field(root, name);
    char shown[64];
    if (!item || cJSON_IsNull(item)) return TL_OK;
    describe(item, shown, sizeof shown);
    if (!cJSON_IsNumber(item) || !isfinite(item->valuedouble))
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" must be a number, got %s", name, shown);
    return tl_config_float_in_range(name, shown, item->valuedouble, lo, hi, lo_open, out);
}

tl_status tl_config_float_in_range(const char *name, const char *shown, double v, double lo, double hi, bool lo_open,
                                   float *out) {
    if ((lo_open ? v <= lo : v < lo) || v > hi)
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" = %s is out of range %s%g, %g]",
                       name, shown, lo_open ? "(" : "[", lo, hi);
    /* Stored as a float: 1e-60 passes the (0, ...) check as a double but becomes 0.0f
       (found by fuzz_config: a norm_eps of 0 divides by zero on an all-zero row; a RoPE
       base of 0 makes every logit NaN). */
    if (lo_open && !((float)v > (float)lo))
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" = %s rounds to %g as a float, outside (%g, %g]",
                       name, shown, (double)(float)v, lo, hi);
    *out = (float)v;
    return TL_OK;
}

static tl_status read_bool(const cJSON *root, const char *name, bool *out) {
    const cJSON *item = field(root, name);
    char shown[64];
    if (!item || cJSON_IsNull(item)) return TL_OK;
    if (!cJSON_IsBool(item)) {
        describe(item, shown, sizeof shown);
        return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" must be true or false, got %s",
                       name, shown);
    }
    *out = cJSON_IsTrue(item);
    return TL_OK;
}

/* Reads a string field that must be one of `choices` (NULL-terminated); *out = index. */
static tl_status read_enum(const cJSON *root, const char *name, bool required,
                           const char *const *choices, int *out) {
    const cJSON *item = field(root, name);
    char shown[64], allowed[160] = "";
    if (!item || cJSON_IsNull(item)) {
        if (required) return tl_fail(TL_ERR_FORMAT, "config.json: missing required field \"%s\"", name);
        return TL_OK;
    }
    for (int i = 0; choices[i]; i++) {
        if (cJSON_IsString(item) && strcmp(item->valuestring, choices[i]) == 0) {
            *out = i;
            return TL_OK;
        }
        snprintf(allowed + strlen(allowed), sizeof allowed - strlen(allowed), "%s\"%s\"",
                 i ? ", " : "", choices[i]);
    }
    describe(item, shown, sizeof shown);
    return tl_fail(TL_ERR_FORMAT, "config.json: field \"%s\" = %s is not one of %s", name, shown,
                   allowed);
}

/* ---------------------------------------------------------------- parse */

int tl_config_default_max_loops(int default_loops) {
    return default_loops > MAX_LOOPS / 4 ? MAX_LOOPS : 4 * default_loops;
}

void tl_config_defaults(tl_config *c) {
    c->beta = 1.0f;
    c->norm_eps = 1e-5f;
    c->rope_theta = 10000.0f;
    c->injection = TL_INJECT_ADD;
    c->embed_scale = 1.0f;
    c->final_norm_at_head = true;
    c->exit_threshold = 1.0f;
}

/* The options added for the published looped models (SPEC §1); all optional. */
static tl_status parse_general_options(const cJSON *root, tl_config *c) {
    static const char *const placements[] = {"pre", "sandwich", "pre_post", NULL};
    static const char *const pairings[] = {"half", "interleaved", NULL};
    static const char *const orders[] = {"state_first", "embedding_first", NULL};
    static const char *const state_norm_weights[] = {"own", "final_norm", NULL};
    static const char *const initial_states[] = {"zero", "truncated_normal", NULL};
    int placement = TL_PLACE_PRE, pairing = TL_ROPE_HALF, order = 0, reuse = 0, init = TL_STATE_ZERO;
    tl_status st;
#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
    TRY(read_enum(root, "norm_placement", false, placements, &placement));
    TRY(read_enum(root, "rope_pairing", false, pairings, &pairing));
    TRY(read_bool(root, "qk_bias", &c->qk_bias));
    TRY(read_float(root, "embed_scale", 0.0, 1e6, true, &c->embed_scale));
    TRY(read_enum(root, "inject_order", false, orders, &order));
    TRY(read_enum(root, "state_norm_weights", false, state_norm_weights, &reuse));
    TRY(read_bool(root, "final_norm_before_coda", &c->final_norm_before_coda));
    TRY(read_bool(root, "final_norm_at_head", &c->final_norm_at_head));
    TRY(read_enum(root, "initial_state", false, initial_states, &init));
    TRY(read_float(root, "initial_state_std", 0.0, 1e6, false, &c->state_init_std));
    /* Ouro's exit gate in our format: exit_gate.weight [1, d_model], exit_gate.bias [1]; the
       threshold is the range Ouro's early_exit_threshold has (hf_ouro.c) */
    TRY(read_bool(root, "exit_gate", &c->exit_gate));
    TRY(read_float(root, "exit_gate_threshold", 0.0, 1.0, false, &c->exit_threshold));
#undef TRY
    c->norm_placement = (tl_norm_placement)placement;
    c->rope_pairing = (tl_rope_pairing)pairing;
    c->inject_embedding_first = order == 1;
    c->state_norm_is_final_norm = reuse == 1;
    c->state_init = (tl_state_init)init;
    return TL_OK;
}

static tl_status parse_fields(const cJSON *root, tl_config *c) {
    static const char *const injections[] = {"none", "add", "concat", NULL};
    static const char *const updates[] = {"replace", "residual", NULL};
    static const char *const norms[] = {"layernorm", "rmsnorm", NULL};
    static const char *const mlps[] = {"gelu", "swiglu", NULL};
    static const char *const positions[] = {"learned", "rope", NULL};
    tl_status st;
    int injection = TL_INJECT_ADD, update = TL_UPDATE_REPLACE, norm = 0, mlp = 0, pos = 0;

#define TRY(call) do { if ((st = (call)) != TL_OK) return st; } while (0)
    TRY(read_int(root, "vocab_size", true, 1, 1 << 24, &c->vocab_size));
    TRY(read_int(root, "d_model", true, 1, MAX_DIM, &c->d_model));
    TRY(read_int(root, "n_heads", true, 1, MAX_DIM, &c->n_heads));
    c->n_kv_heads = c->n_heads;
    TRY(read_int(root, "n_kv_heads", false, 1, MAX_DIM, &c->n_kv_heads));
    TRY(read_int(root, "d_ff", true, 1, MAX_DIM, &c->d_ff));
    TRY(read_int(root, "max_seq_len", true, 1, 1 << 24, &c->max_seq_len));
    TRY(read_int(root, "n_prelude", true, 0, MAX_LAYERS, &c->n_prelude));
    TRY(read_int(root, "n_block", true, 0, MAX_LAYERS, &c->n_block));
    TRY(read_int(root, "n_coda", true, 0, MAX_LAYERS, &c->n_coda));
    TRY(read_int(root, "default_loops", true, 1, MAX_LOOPS, &c->default_loops));
    c->max_loops = tl_config_default_max_loops(c->default_loops);
    TRY(read_int(root, "max_loops", false, 1, MAX_LOOPS, &c->max_loops));
    c->beta = 1.0f;
    TRY(read_float(root, "beta", 0.0, 1e6, true, &c->beta));
    TRY(read_enum(root, "injection", false, injections, &injection));
    TRY(read_enum(root, "loop_update", false, updates, &update));
    TRY(read_bool(root, "state_norm", &c->state_norm));
    TRY(read_enum(root, "norm", true, norms, &norm));
    c->norm_eps = 1e-5f;
    TRY(read_float(root, "norm_eps", 0.0, 1.0, true, &c->norm_eps));
    TRY(read_enum(root, "mlp", true, mlps, &mlp));
    TRY(read_bool(root, "bias", &c->bias));
    TRY(read_enum(root, "pos_encoding", true, positions, &pos));
    c->rope_theta = 10000.0f;
    TRY(read_float(root, "rope_theta", 0.0, 1e12, true, &c->rope_theta));
    TRY(read_bool(root, "tie_embeddings", &c->tie_embeddings));
    TRY(read_int(root, "bos_token_id", true, 0, c->vocab_size - 1, &c->bos_token_id));
    TRY(read_int(root, "eos_token_id", true, 0, c->vocab_size - 1, &c->eos_token_id));
#undef TRY
    c->injection = (tl_injection)injection;
    c->loop_update = (tl_loop_update)update;
    c->norm = (tl_norm_kind)norm;
    c->mlp = (tl_mlp_kind)mlp;
    c->pos_encoding = (tl_pos_kind)pos;
    c->inject_bias = c->bias;
    if ((st = parse_general_options(root, c)) != TL_OK) return st;
    return tl_config_check(c);
}

tl_status tl_config_check(tl_config *c) {
    if (c->d_model % c->n_heads != 0)
        return tl_fail(TL_ERR_FORMAT, "config.json: d_model = %d is not divisible by n_heads = %d",
                       c->d_model, c->n_heads);
    c->head_dim = c->d_model / c->n_heads;
    if (c->n_kv_heads > c->n_heads || c->n_heads % c->n_kv_heads != 0)
        return tl_fail(TL_ERR_FORMAT,
                       "config.json: n_kv_heads = %d must divide n_heads = %d",
                       c->n_kv_heads, c->n_heads);
    if (c->max_loops < c->default_loops)
        return tl_fail(TL_ERR_FORMAT, "config.json: max_loops = %d is below default_loops = %d",
                       c->max_loops, c->default_loops);
    if (c->pos_encoding == TL_POS_ROPE && c->head_dim % 2 != 0)
        return tl_fail(TL_ERR_FORMAT,
                       "config.json: rope needs an even head_dim, got d_model/n_heads = %d",
                       c->head_dim);
    if (c->state_norm_is_final_norm && !c->state_norm)
        return tl_fail(TL_ERR_FORMAT,
                       "config.json: state_norm_weights = \"final_norm\" needs state_norm = true");
    if (c->state_init != TL_STATE_ZERO && c->injection == TL_INJECT_NONE)
        return tl_fail(TL_ERR_FORMAT, "config.json: initial_state applies to injection \"add\" or "
                       "\"concat\" (with \"none\" the state starts as the prelude output)");
    return TL_OK;
}

/* Levenshtein distance, capped: only "is it a likely misspelling" matters. */
static int edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return 99;
    int row[64];
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

/* SPEC §1: unknown fields are ignored (checkpoints carry metadata), but each one is reported
   as a warning, with a suggestion when it looks like a misspelt field (rope_theeta), since a
   misspelt optional field silently keeps the default. */
static void collect_warnings(const cJSON *root, const field_log *log, tl_config *c) {
    for (const cJSON *e = root->child; e; e = e->next) {
        const char *closest = NULL;
        int best = 3; /* suggest at distance <= 2 */
        bool known = false;
        for (int i = 0; i < log->n && !known; i++) {
            if (strcmp(e->string, log->names[i]) == 0) known = true;
            int d = edit_distance(e->string, log->names[i]);
            if (d < best) { best = d; closest = log->names[i]; }
        }
        if (known) continue;
        size_t used = strlen(c->warnings);
        char line[200], name[72]; /* (the name escaped: a control byte in it broke the one line) */
        tl_tlz_quote_in(e->string, strlen(e->string), '"', name, sizeof name);
        if (closest)
            snprintf(line, sizeof line, "config.json: unknown field \"%s\" ignored (did you mean \"%s\"?)\n", name, closest);
        else
            snprintf(line, sizeof line, "config.json: unknown field \"%s\" ignored\n", name);
        if (used + strlen(line) < sizeof c->warnings) memcpy(c->warnings + used, line, strlen(line) + 1);
        else if (used + 4 < sizeof c->warnings) memcpy(c->warnings + used, "...", 4);
    }
}

static int by_key(const void *a, const void *b) {
    return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

/* JSON leaves duplicate keys undefined and cJSON keeps the first: "d_model" given twice is a
   mistake whichever one was meant, at any depth. Sorting keeps it O(n log n). 0, or -1 with
   why filled (-2: out of memory). */
static int check_duplicates(const cJSON *node, char *why, size_t why_len) {
    int rc = 0, n = 0;
    for (const cJSON *e = node->child; e; e = e->next) n++;
    if (cJSON_IsObject(node) && n > 1) {
        const cJSON **keys = malloc((size_t)n * sizeof *keys);
        if (!keys) return snprintf(why, why_len, "out of memory"), -2;
        int k = 0;
        for (const cJSON *e = node->child; e; e = e->next) keys[k++] = e;
        qsort(keys, (size_t)n, sizeof *keys, by_key);
        for (int i = 1; i < n && rc == 0; i++)
            if (strcmp(keys[i - 1]->string, keys[i]->string) == 0) {
                char key[72], in[72];
                tl_tlz_quote_in(keys[i]->string, strlen(keys[i]->string), '"', key, sizeof key);
                if (node->string) tl_tlz_quote_in(node->string, strlen(node->string), '"', in, sizeof in);
                snprintf(why, why_len, "duplicate key \"%s\"%s%s%s", key, node->string ? " in \"" : "", node->string ? in : "",
                         node->string ? "\"" : "");
                rc = -1;
            }
        free(keys);
    }
    for (const cJSON *e = node->child; e && rc == 0; e = e->next) rc = check_duplicates(e, why, why_len);
    return rc;
}

/* The line and column (from 1) of byte pos of text. */
static void line_column(const char *text, size_t pos, size_t *line, size_t *column) {
    *line = 1, *column = 1;
    for (size_t i = 0; i < pos; i++) {
        if (text[i] == '\n') ++*line, *column = 1;
        else ++*column;
    }
}

/* The length of the JSON number (RFC 8259's grammar) at text[0..len), 0 where none is: cJSON
   reads 01, 1., -.5 and 2.e3 as numbers. A number must not run on into a letter, digit, '.',
   '+' or '-' ("01" and "1.5.2" are none), json_text.lua's rule for the server's bodies. */
static size_t json_number_length(const char *text, size_t len) {
    size_t p = 0;
#define DIGIT_AT(k) ((k) < len && text[k] >= '0' && text[k] <= '9')
    if (p < len && text[p] == '-') p++;
    if (!DIGIT_AT(p)) return 0;
    if (text[p] == '0') p++;
    else while (DIGIT_AT(p)) p++;
    if (p < len && text[p] == '.') {
        if (!DIGIT_AT(p + 1)) return 0;
        p++;
        while (DIGIT_AT(p)) p++;
    }
    if (p < len && (text[p] == 'e' || text[p] == 'E')) {
        p++;
        if (p < len && (text[p] == '+' || text[p] == '-')) p++;
        if (!DIGIT_AT(p)) return 0;
        while (DIGIT_AT(p)) p++;
    }
    if (p < len && (DIGIT_AT(p) || text[p] == '.' || text[p] == '+' || text[p] == '-' || isalpha((unsigned char)text[p])))
        return 0;
#undef DIGIT_AT
    return p;
}

/* What cJSON lets through and JSON (RFC 8259) does not, as Python's json and Hugging Face's
   serde read it: ill-formed UTF-8 (a tokenizer.json token with a stray byte loaded, encoded
   and decoded its bytes), control characters other than tab, line feed and carriage return
   between tokens, or any unescaped one inside a string (cJSON skips every byte up to a space
   as a blank and keeps raw ones in strings), a \u escape without four hex digits (cJSON reads
   "\uqqqq" as U+0000, which ended the string there: a schema's name cut short, no error),
   and numbers outside JSON's grammar (json_number_length). 0 or -1 with *why. */
static int check_json_bytes(const char *text, size_t len, char *why, size_t why_len) {
    bool in_string = false;
    for (size_t i = 0; i < len;) {
        const unsigned char c = (unsigned char)text[i];
        if (c >= 0x80) {
            const int k = tl_tlz_utf8_seq((const unsigned char *)text + i, len - i);
            if (k <= 0) return snprintf(why, why_len, "not valid UTF-8 (byte %zu)", i), -1;
            i += (size_t)k;
            continue;
        }
        if (c < 0x20 && (in_string || (c != '\t' && c != '\n' && c != '\r'))) {
            size_t line, column;
            line_column(text, i, &line, &column);
            char what[32];
            if (c) snprintf(what, sizeof what, "a control character (0x%02X)", c);
            else snprintf(what, sizeof what, "a NUL byte");
            return snprintf(why, why_len, "%s %s at line %zu, column %zu", what,
                            in_string ? "unescaped in a string" : "outside a string", line, column), -1;
        }
        if (in_string && c == '\\') {
            if (i + 1 < len && text[i + 1] == 'u') {
                for (size_t k = i + 2; k < i + 6; k++)
                    if (k >= len || !isxdigit((unsigned char)text[k])) {
                        size_t line, column;
                        line_column(text, i, &line, &column);
                        return snprintf(why, why_len, "a \\u escape without four hex digits at line %zu, column %zu", line,
                                        column), -1;
                    }
            }
            i++; /* (the escaped character, a quote too) */
        } else if (c == '"') {
            in_string = !in_string;
        } else if (!in_string && (c == '-' || (c >= '0' && c <= '9'))) {
            const size_t n = json_number_length(text + i, len - i);
            if (n == 0) {
                size_t line, column, shown = 0;
                line_column(text, i, &line, &column);
                while (i + shown < len && shown < 20 && (isalnum((unsigned char)text[i + shown]) || memchr(".+-", text[i + shown], 3)))
                    shown++;
                return snprintf(why, why_len, "'%.*s' at line %zu, column %zu is no JSON number", (int)shown, text + i, line,
                                column), -1;
            }
            i += n;
            continue;
        }
        i++;
    }
    return 0;
}

/* cJSON returns NULL both for text it refuses and for a malloc that failed: "not valid JSON"
   for a good tokenizer.json under a memory limit sent a user to replace a good file (and the
   server answered a request's schema 400). This recognizer allocates nothing and accepts no
   more than cJSON does (RFC 8259's grammar, at most CJSON_NESTING_LIMIT - 1 open containers,
   numbers of at most 63 bytes, cJSON's buffer for one, \u escapes whose surrogates pair up):
   text it accepts that cJSON refused was refused for want of memory. Bytes after the first
   value are not read, as cJSON does not. */
bool tl_json_value_parses(const char *text, size_t len) {
    unsigned char is_object[(CJSON_NESTING_LIMIT + 7) / 8] = {0}; /* a bit per open container */
    int depth = 0;
    size_t i = 0;
    bool reading_key = false;
#define SKIP_BLANKS() while (i < len && (text[i] == ' ' || text[i] == '\t' || text[i] == '\n' || text[i] == '\r')) i++
#define HEX4_AT(k) (k + 4 <= len && isxdigit((unsigned char)text[k]) && isxdigit((unsigned char)text[k + 1]) && \
                    isxdigit((unsigned char)text[k + 2]) && isxdigit((unsigned char)text[k + 3]))
    for (;;) {
        /* a value */
        SKIP_BLANKS();
        if (i >= len) return false;
        const char c = text[i];
        if (c == '{' || c == '[') {
            if (depth >= CJSON_NESTING_LIMIT - 1) return false;
            if (c == '{') is_object[depth / 8] |= (unsigned char)(1u << depth % 8);
            else is_object[depth / 8] &= (unsigned char)~(1u << depth % 8);
            depth++;
            i++;
            SKIP_BLANKS();
            if (i < len && text[i] == (c == '{' ? '}' : ']')) { depth--, i++; goto after_value; }
            if (c == '[') continue;
            goto key;
        } else if (c == '"') {
            goto string;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            const size_t n = json_number_length(text + i, len - i);
            if (n == 0 || n > 63) return false;
            i += n;
        } else {
            static const char *const words[3] = {"true", "false", "null"};
            size_t n = 0;
            for (int w = 0; w < 3 && n == 0; w++)
                if (len - i >= strlen(words[w]) && memcmp(text + i, words[w], strlen(words[w])) == 0) n = strlen(words[w]);
            if (n == 0) return false;
            i += n;
        }
        goto after_value;
    key:
        if (i >= len || text[i] != '"') return false;
        reading_key = true;
    string: /* text[i] is the opening quote */
        for (i++;; i++) {
            if (i >= len || (unsigned char)text[i] < 0x20) return false;
            if (text[i] == '"') break;
            if (text[i] != '\\') continue;
            if (++i >= len) return false;
            if (text[i] == 'u') {
                if (!HEX4_AT(i + 1)) return false;
                const unsigned long unit = strtoul((char[5]){text[i + 1], text[i + 2], text[i + 3], text[i + 4], 0}, NULL, 16);
                i += 4;
                if (unit >= 0xDC00 && unit <= 0xDFFF) return false;
                if (unit >= 0xD800 && unit <= 0xDBFF) {
                    if (!(i + 2 < len && text[i + 1] == '\\' && text[i + 2] == 'u' && HEX4_AT(i + 3))) return false;
                    const unsigned long low =
                        strtoul((char[5]){text[i + 3], text[i + 4], text[i + 5], text[i + 6], 0}, NULL, 16);
                    if (low < 0xDC00 || low > 0xDFFF) return false;
                    i += 6;
                }
            } else if (!memchr("\"\\/bfnrt", text[i], 8)) {
                return false;
            }
        }
        i++;
        if (reading_key) { /* its colon, then the member's value */
            reading_key = false;
            SKIP_BLANKS();
            if (i >= len || text[i] != ':') return false;
            i++;
            continue;
        }
    after_value:
        SKIP_BLANKS();
        if (depth == 0) return true;
        const bool in_object = is_object[(depth - 1) / 8] >> (depth - 1) % 8 & 1;
        if (i >= len) return false;
        if (text[i] == ',') {
            i++;
            if (in_object) { SKIP_BLANKS(); goto key; }
            continue;
        }
        if (text[i] != (in_object ? '}' : ']')) return false;
        depth--, i++;
        goto after_value;
    }
#undef HEX4_AT
#undef SKIP_BLANKS
}

int tl_json_read_value_strict(const char *text, size_t len, cJSON **out, char *why, size_t why_len) {
    *out = NULL;
    /* cJSON skips a byte order mark; JSON (RFC 8259) forbids one, and a tool that wrote it
       may have mangled more. */
    if (len >= 3 && (unsigned char)text[0] == 0xEF && (unsigned char)text[1] == 0xBB && (unsigned char)text[2] == 0xBF)
        return snprintf(why, why_len, "starts with a UTF-8 byte order mark, which JSON does not allow"), -1;
    const char *end = NULL;
    /* (in the C locale: cJSON writes a number's '.' as the locale's decimal point, its first
       byte, then calls strtod; where that point is two bytes, ps_AF's U+066B, every fraction
       was refused, and a good config.json read as out of memory) */
    void *callers = tl_enter_c_locale();
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, false);
    tl_leave_c_locale(callers);
    if (!root) {
        if (check_json_bytes(text, len, why, why_len) == 0 && tl_json_value_parses(text, len))
            return snprintf(why, why_len, "out of memory while reading %zu bytes of JSON", len), -2;
        size_t pos = end && end >= text && end <= text + len ? (size_t)(end - text) : 0, line, column;
        line_column(text, pos, &line, &column);
        return snprintf(why, why_len, "not valid JSON (error near line %zu, column %zu)", line, column), -1;
    }
    const char *stop = text + len;
    while (end && end < stop && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r')) end++;
    int rc = 0;
    if (end && end < stop) { /* (any byte, a NUL too: the text is len bytes) */
        const int shown = stop - end < 20 ? (int)(stop - end) : 20;
        if (*end == '\0') rc = -1, snprintf(why, why_len, "unexpected text after the JSON value: a NUL byte");
        else rc = -1, snprintf(why, why_len, "unexpected text after the JSON value: \"%.*s\"", shown, end);
    }
    else if ((rc = check_json_bytes(text, len, why, why_len)) == 0) /* (nothing but blanks after the value) */
        rc = check_duplicates(root, why, why_len);
    if (rc != 0) {
        cJSON_Delete(root);
        return rc;
    }
    *out = root;
    return 0;
}

int tl_json_read_strict(const char *text, size_t len, cJSON **out, char *why, size_t why_len) {
    const int rc = tl_json_read_value_strict(text, len, out, why, why_len);
    if (rc == 0 && !cJSON_IsObject(*out)) {
        cJSON_Delete(*out);
        *out = NULL;
        return snprintf(why, why_len, "the top level must be a JSON object"), -1;
    }
    return rc;
}

tl_status tl_config_json_read(const char *json_text, cJSON **out) {
    char why[200];
    const int rc = tl_json_read_strict(json_text, strlen(json_text), out, why, sizeof why);
    return rc == 0 ? TL_OK : tl_fail(rc == -2 ? TL_ERR_NO_MEMORY : TL_ERR_FORMAT, "config.json: %s", why);
}

tl_status tl_config_from_json(const cJSON *root, tl_config *out) {
    memset(out, 0, sizeof *out);
    tl_config_defaults(out);
    field_log log = {.n = 0};
    reading = &log;
    tl_status st = parse_fields(root, out);
    reading = NULL;
    if (st == TL_OK) collect_warnings(root, &log, out);
    return st;
}

tl_status tl_config_parse(const char *json_text, tl_config *out) {
    cJSON *root = NULL;
    tl_status st = tl_config_json_read(json_text, &root);
    if (st == TL_OK) st = tl_config_from_json(root, out);
    else {
        memset(out, 0, sizeof *out);
        tl_config_defaults(out);
    }
    cJSON_Delete(root);
    return st;
}

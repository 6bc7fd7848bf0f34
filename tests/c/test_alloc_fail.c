/* test_alloc_fail.c: allocation-failure injection. Linked against a copy of the library
 * whose every malloc / calloc / realloc / posix_memalign / strdup / mmap counts
 * (tests/alloc/fail_alloc.h, force-included), each scenario is run once to count its
 * allocations, then once per allocation N with the N-th one failing. Each run must end in
 * TL_OK (the failure was absorbed) or TL_ERR_NO_MEMORY with a message, never another
 * status, a crash, or (under ASan's LeakSanitizer, scripts/test) a leak.
 * Scenarios: model load (config, safetensors header, weights, backend, tokenizer), with and
 * without mmap_weights; session creation and steps in every mode (plain with stop strings and
 * sampling, beam, chain and tree speculative, early exit) with tl_session_text; tokenizer
 * encode / decode / detokenizer; scoring; fork, save and resume; a saved state written to bytes
 * or a file, read back and resumed; the serving engine; grammars (regex, tags, after, after_block)
 * and a session under one; a JSON Schema's GBNF (an absorbed failure gives the same text) and
 * its compilation; quantising a checkpoint. cJSON's allocations count and fail too (its hooks). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../alloc/fail_alloc_control.h"
#include "check.h"
#include "quant.h" /* tl_quantize_checkpoint */
#include "tinyloop.h"

static const char *dir;
static tl_model *model; /* loaded without injection, for the scenarios after loading */
static const int32_t prompt[3] = {5, 6, 8};

static tl_status load(int mmap_weights) {
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 1;
    o.mmap_weights = mmap_weights;
    tl_model *m = NULL;
    tl_status st = tl_model_load(dir, &o, &m);
    if ((st == TL_OK) != (m != NULL)) return TL_ERR_INTERNAL;
    tl_model_free(m);
    return st;
}
static tl_status load_copy(void) { return load(0); }
static tl_status load_mapped(void) { return load(1); }

static tl_status run_session(const tl_generate_config *c) {
    tl_session *s = NULL;
    tl_status st = tl_session_new(model, prompt, 3, c, &s);
    if (st != TL_OK) return s ? TL_ERR_INTERNAL : st;
    tl_stop_reason stop = TL_STOP_NONE;
    for (int i = 0; i < 6 && stop == TL_STOP_NONE && st == TL_OK; i++) {
        int32_t tok;
        st = tl_session_step(s, &tok, &stop);
        const char *piece;
        size_t len;
        if (st == TL_OK) st = tl_session_text(s, &piece, &len);
    }
    tl_session_free(s);
    return st;
}

static tl_generate_config base(void) {
    tl_generate_config c;
    tl_generate_config_init(&c);
    c.max_tokens = 6;
    c.ignore_eos = 1;
    return c;
}
static tl_status plain(void) {
    static const char *const stops[2] = {"zzq", "\xc3\xa9"};
    tl_generate_config c = base();
    c.temperature = 0.8f;
    c.sample_seed = 7;
    c.repetition_penalty = 1.2f;
    c.stop_strings = stops;
    c.n_stop_strings = 2;
    return run_session(&c);
}
static tl_status beam(void) { tl_generate_config c = base(); c.beam_size = 3; return run_session(&c); }
static tl_status chain(void) {
    tl_generate_config c = base();
    c.speculative = TL_SPECULATIVE_CHAIN; c.loops = 4; c.draft_loops = 1; c.temperature = 0.7f;
    return run_session(&c);
}
static tl_status tree(void) {
    tl_generate_config c = base();
    c.speculative = TL_SPECULATIVE_TREE; c.loops = 4; c.draft_loops = 1;
    return run_session(&c);
}
static tl_status early_exit(void) {
    tl_generate_config c = base();
    c.loops = 4; c.early_exit_patience = 1; c.cache_window = 4;
    return run_session(&c);
}

static int exit_at_two(void *user, const tl_loop_signals *sig) {
    (void)user;
    return sig->loop == 2 ? TL_HOOK_STOP : TL_HOOK_CONTINUE;
}
/* The probes' log-probability buffer of the KL criterion, and a depth policy. */
static tl_status exit_rules(void) {
    tl_generate_config c = base();
    c.loops = 4; c.early_exit_patience = 1; c.early_exit_criterion = TL_EXIT_KL;
    c.depth_policy = exit_at_two;
    return run_session(&c);
}

static tl_status text(void) {
    static const char sample[] = "It is a truth universally acknowledged, caf\xc3\xa9 <|endoftext|>";
    int32_t *ids = NULL;
    int n = 0;
    tl_status st = tl_encode(model, sample, sizeof sample - 1, &ids, &n);
    if (st != TL_OK) return st;
    char *back = NULL;
    size_t len = 0;
    st = tl_decode(model, ids, n, &back, &len);
    tl_free(back);
    tl_detokenizer *d = NULL;
    if (st == TL_OK) st = tl_detokenizer_new(model, &d);
    for (int i = 0; st == TL_OK && i < n; i++) {
        const char *piece;
        st = tl_detokenizer_push(d, ids[i], &piece, &len);
    }
    tl_detokenizer_free(d);
    tl_free(ids);
    return st;
}

static tl_status score(void) {
    float *logits = malloc(3 * (size_t)tl_model_info(model)->vocab_size * sizeof(float));
    tl_status st = tl_score(model, prompt, 3, 3, logits);
    free(logits);
    return st;
}

/* A session stepped twice, forked, saved and resumed; each branch steps once. */
static tl_status branches(void) {
    tl_generate_config c = base();
    c.temperature = 0.8f;
    tl_session *s = NULL, *child = NULL, *resumed = NULL;
    tl_session_state *state = NULL;
    tl_status st = tl_session_new(model, prompt, 3, &c, &s);
    int32_t tok;
    tl_stop_reason stop;
    for (int i = 0; i < 2 && st == TL_OK; i++) st = tl_session_step(s, &tok, &stop);
    if (st == TL_OK) st = tl_session_fork(s, NULL, &child);
    if (st == TL_OK) st = tl_session_save(s, &state);
    if (st == TL_OK) st = tl_session_resume(model, state, NULL, &resumed);
    if (st == TL_OK) st = tl_session_step(child, &tok, &stop);
    if (st == TL_OK) st = tl_session_step(resumed, &tok, &stop);
    tl_session_free(resumed);
    tl_session_state_free(state);
    tl_session_free(child);
    tl_session_free(s);
    return st;
}

/* A saved state to bytes, read back, resumed and stepped. */
static tl_status state_bytes(void) {
    tl_generate_config c = base();
    static const char *const stops[1] = {"zzq"};
    c.stop_strings = stops;
    c.n_stop_strings = 1;
    tl_session *s = NULL, *resumed = NULL;
    tl_session_state *state = NULL, *read_back = NULL;
    void *bytes = NULL;
    size_t len = 0;
    tl_status st = tl_session_new(model, prompt, 3, &c, &s);
    int32_t tok;
    tl_stop_reason stop;
    for (int i = 0; i < 2 && st == TL_OK; i++) st = tl_session_step(s, &tok, &stop);
    if (st == TL_OK) st = tl_session_save(s, &state);
    if (st == TL_OK) st = tl_session_state_to_bytes(state, &bytes, &len);
    if (st == TL_OK) st = tl_session_state_from_bytes(model, bytes, len, &read_back);
    if (st != TL_OK && read_back) st = TL_ERR_INTERNAL; /* a refused state is NULL */
    if (st == TL_OK) st = tl_session_resume(model, read_back, NULL, &resumed);
    if (st == TL_OK) st = tl_session_step(resumed, &tok, &stop);
    tl_session_free(resumed);
    tl_session_state_free(read_back);
    tl_free(bytes);
    tl_session_state_free(state);
    tl_session_free(s);
    return st;
}

/* A saved state written to a file, read back, resumed and stepped. */
static char state_path[64];
static tl_status state_file(void) {
    tl_generate_config c = base();
    tl_session *s = NULL, *resumed = NULL;
    tl_session_state *state = NULL, *read_back = NULL;
    tl_status st = tl_session_new(model, prompt, 3, &c, &s);
    int32_t tok;
    tl_stop_reason stop;
    if (st == TL_OK) st = tl_session_step(s, &tok, &stop);
    if (st == TL_OK) st = tl_session_save(s, &state);
    if (st == TL_OK) st = tl_session_state_write(state, state_path);
    if (st == TL_OK) st = tl_session_state_read(model, state_path, &read_back);
    if (st != TL_OK && read_back) st = TL_ERR_INTERNAL;
    if (st == TL_OK) st = tl_session_resume(model, read_back, NULL, &resumed);
    if (st == TL_OK) st = tl_session_step(resumed, &tok, &stop);
    tl_session_free(resumed);
    tl_session_state_free(read_back);
    tl_session_state_free(state);
    tl_session_free(s);
    unlink(state_path);
    return st;
}

/* The serving engine: new, one request read to its end, free. A failure on the engine
   thread reaches the reader as the request's status and message (TL_ERR_NO_MEMORY with a
   message counts as absorbed); an engine that tl_engine_new returned must run (its thread's
   arrays were allocated there, after the call had said TL_OK, and every submit then failed). */
static tl_status engine_run(void) {
    tl_engine *e = NULL;
    tl_status st = tl_engine_new(model, NULL, &e);
    if (st != TL_OK) return st;
    tl_generate_config cfg;
    tl_generate_config_init(&cfg);
    cfg.max_tokens = 6;
    cfg.ignore_eos = 1;
    tl_session *s = NULL;
    uint64_t id = 0;
    st = tl_session_new(model, prompt, 3, &cfg, &s);
    if (st == TL_OK && (st = tl_engine_submit(e, s, &id)) != TL_OK) tl_session_free(s);
    if (st == TL_OK && id == 0) st = TL_ERR_INTERNAL; /* an empty engine must admit it */
    while (st == TL_OK) {
        tl_engine_update u;
        if (tl_engine_wait(e, id, 10000) < 0) { st = TL_ERR_INTERNAL; break; }
        if ((st = tl_engine_read(e, id, &u)) != TL_OK) break;
        if (u.state != TL_ENGINE_FINISHED) continue;
        if (u.status != TL_OK) st = u.status == TL_ERR_NO_MEMORY && u.error && u.error[0] ? TL_OK : TL_ERR_INTERNAL;
        else if (u.stats.tokens_emitted != 6) st = TL_ERR_INTERNAL;
        break;
    }
    if (id) tl_engine_cancel(e, id);
    tl_engine_free(e);
    return st;
}

/* Grammars: a regular expression, GBNF, and the grammars built around them (after, tags,
   after_block: programs copied and renumbered), then a session under the last one with a
   one-token stop sequence (its matcher's ends are set; this checkpoint's one special token is
   eos, which they leave to the grammar). */
static tl_status grammars(void) {
    tl_compiled_grammar *digits = NULL, *rx = NULL, *after = NULL, *tags = NULL, *block = NULL;
    tl_status st = tl_grammar_compile_gbnf("root ::= [0-9]+", 15, &digits);
    if (st == TL_OK) st = tl_grammar_compile_regex("(a?|b)*[0-9]{2}", 15, &rx);
    if (st == TL_OK) st = tl_grammar_compile_after(digits, "</t>", 4, 2, &after);
    const tl_grammar_tag tag[] = {{"<d>", digits, "</d>", 0}, {"<r>", rx, "", 1}};
    const char *const triggers[] = {"<d", "<r"};
    if (st == TL_OK) st = tl_grammar_compile_tags(tag, 2, triggers, 2, NULL, &tags);
    if (st == TL_OK) st = tl_grammar_compile_after_block(tags, "<t>", "</t>", 1, &block);
    if (st == TL_OK) {
        tl_generate_config c = base();
        c.ignore_eos = 0;
        tl_grammar use;
        tl_grammar_use(&use, block);
        c.grammar = &use;
        const int32_t eos = tl_model_info(model)->eos_token_id;
        const tl_token_seq stop = {&eos, 1};
        c.stop_sequences = &stop;
        c.n_stop_sequences = 1;
        st = run_session(&c);
    }
    tl_compiled_grammar_free(digits);
    tl_compiled_grammar_free(rx);
    tl_compiled_grammar_free(after);
    tl_compiled_grammar_free(tags);
    tl_compiled_grammar_free(block);
    return st;
}

/* A JSON Schema with every scratch text of the conversion (optional properties, additional
   ones, enum, anyOf, a type list, arrays, a pattern, a format): a run that absorbed a failure
   must give the reference's GBNF to the byte (a scratch text lost to it was written out as a
   narrower grammar, or failed as the schema's fault), then compile. */
static const char k_schema[] =
    "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\", \"minLength\": 1}, "
    "\"n\": {\"type\": \"integer\"}, \"kind\": {\"enum\": [\"a\", \"b\", 3]}, "
    "\"tags\": {\"type\": \"array\", \"items\": {\"type\": \"string\"}, \"minItems\": 1, \"maxItems\": 3}, "
    "\"pair\": {\"type\": \"array\", \"prefixItems\": [{\"type\": \"number\"}, {\"type\": \"boolean\"}]}, "
    "\"either\": {\"anyOf\": [{\"type\": \"string\", \"pattern\": \"^[a-z]+$\"}, {\"type\": \"null\"}]}, "
    "\"opt\": {\"type\": [\"string\", \"null\"]}, \"when\": {\"type\": \"string\", \"format\": \"date\"}, "
    /* oneOf over $refs, a type beside anyOf, nullable, a draft-07 tuple (schema_bits' table:
       its failure was a schema error, "branch 0 may be of another") */
    "\"pet\": {\"oneOf\": [{\"$ref\": \"#/$defs/cat\"}, {\"$ref\": \"#/$defs/dog\"}]}, "
    "\"shape\": {\"type\": \"object\", \"anyOf\": [{\"properties\": {\"r\": {\"type\": \"number\"}}}, "
    "{\"properties\": {\"w\": {\"type\": \"number\"}}}]}, \"note\": {\"type\": \"string\", \"nullable\": true}, "
    "\"xy\": {\"type\": \"array\", \"items\": [{\"type\": \"integer\"}, {\"type\": \"integer\"}]}}, "
    "\"$defs\": {\"cat\": {\"type\": \"object\", \"properties\": {\"k\": {\"const\": \"cat\"}}, \"required\": [\"k\"]}, "
    "\"dog\": {\"type\": \"object\", \"properties\": {\"k\": {\"const\": \"dog\"}}, \"required\": [\"k\"]}}, "
    "\"required\": [\"name\", \"kind\", \"extra\", \"more\"], \"additionalProperties\": {\"type\": \"integer\"}}";
static char *schema_reference; /* the GBNF of the run without injection */
/* Small schemas whose first allocations are the table of schema_bits (a type beside anyOf, a
   oneOf), and an allOf's branch list: its failure was reported as the schema's fault ("branch 0 may be of another", "a
   value may match both"), not as out of memory. */
static tl_status json_schema_small(void) {
    static const char *const schemas[] = {
        "{\"type\":\"object\",\"anyOf\":[{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}},"
        "{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"string\"}}}]}",
        "{\"oneOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}",
        /* allOf over a $ref: the branch list grown as the $refs are followed */
        "{\"$defs\":{\"B\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}},"
        "\"allOf\":[{\"$ref\":\"#/$defs/B\"},{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"string\"}}}]}"};
    tl_status st = TL_OK;
    for (size_t i = 0; i < sizeof schemas / sizeof *schemas && st == TL_OK; i++) {
        char *gbnf = NULL;
        st = tl_json_schema_to_gbnf(schemas[i], strlen(schemas[i]), NULL, &gbnf, NULL);
        tl_free(gbnf);
    }
    return st;
}

static tl_status json_schema(void) {
    char *gbnf = NULL;
    size_t len = 0;
    tl_status st = tl_json_schema_to_gbnf(k_schema, sizeof k_schema - 1, NULL, &gbnf, &len);
    if (st == TL_OK) {
        if (!schema_reference) {
            schema_reference = malloc(len + 1);
            if (schema_reference) memcpy(schema_reference, gbnf, len + 1);
        } else {
            CHECK(strcmp(gbnf, schema_reference) == 0, "an absorbed failure gave another grammar:\n%s\nwant:\n%s", gbnf,
                  schema_reference);
        }
    }
    tl_free(gbnf);
    tl_compiled_grammar *g = NULL;
    if (st == TL_OK) st = tl_grammar_compile_json_schema(k_schema, sizeof k_schema - 1, NULL, &g);
    tl_compiled_grammar_free(g);
    return st;
}

/* Quantising a checkpoint, then loading what it wrote: a header that lost an entry to a
   failed allocation was written as if whole (TL_OK, then a load's TL_ERR_FORMAT). */
static char quantized_dir[64];
static tl_status quantize(void) {
    tl_status st = tl_quantize_checkpoint(dir, quantized_dir, TL_Q8);
    tl_model *m = NULL;
    if (st == TL_OK) st = tl_model_load(quantized_dir, NULL, &m);
    tl_model_free(m);
    return st;
}

static void inject(const char *name, tl_status (*scenario)(void)) {
    tl_test_alloc_arm(0);
    tl_status st = scenario();
    const long total = tl_test_alloc_count();
    CHECK(st == TL_OK, "%s without injection: %s %s", name, tl_status_name(st), tl_last_error());
    long no_memory = 0, absorbed = 0;
    for (long n = 1; n <= total; n++) {
        tl_test_alloc_arm(n);
        st = scenario();
        const long failed = tl_test_alloc_failed();
        tl_test_alloc_arm(0);
        if (!failed) continue; /* this run allocated less */
        if (st == TL_OK) { absorbed++; continue; }
        no_memory++;
        CHECK(st == TL_ERR_NO_MEMORY && tl_last_error()[0] != '\0',
              "%s, allocation %ld of %ld failing: %s \"%s\", want TL_ERR_NO_MEMORY", name, n, total,
              tl_status_name(st), tl_last_error());
    }
    /* (the counting allocator in use: else every run above was skipped and nothing checked) */
    CHECK(total > 0 && no_memory + absorbed > 0, "%s: %ld allocations counted, none failed", name, total);
    printf("%-12s %5ld allocations: %ld runs TL_ERR_NO_MEMORY, %ld absorbed the failure\n", name, total, no_memory,
           absorbed);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0); /* progress survives a sanitizer abort */
    /* cJSON (the system's library, not compiled with the counting header) allocates through
       the same counter: a failed malloc inside it was "not valid JSON", TL_ERR_FORMAT */
    cJSON_Hooks cjson_hooks = {tl_test_malloc, free};
    cJSON_InitHooks(&cjson_hooks);
    dir = argc > 1 ? argv[1] : "tests/data/textmodel";
    inject("load", load_copy);
    inject("load mmap", load_mapped);
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 1;
    tl_test_alloc_arm(0);
    if (tl_model_load(dir, &o, &model) != TL_OK) {
        printf("cannot load %s: %s\n", dir, tl_last_error());
        return 1;
    }
    inject("plain", plain);
    inject("beam", beam);
    inject("chain", chain);
    inject("tree", tree);
    inject("early exit", early_exit);
    inject("exit rules", exit_rules);
    inject("tokenizer", text);
    inject("score", score);
    inject("branches", branches);
    inject("state bytes", state_bytes);
    snprintf(state_path, sizeof state_path, "/tmp/tinyloop-alloc-fail-%ld.state", (long)getpid());
    inject("state file", state_file);
    inject("engine", engine_run);
    inject("grammars", grammars);
    inject("json schema", json_schema);
    inject("json schema small", json_schema_small);
    snprintf(quantized_dir, sizeof quantized_dir, "/tmp/tinyloop-alloc-fail-%ld.q8", (long)getpid());
    inject("quantize", quantize);
    char quantized_file[128];
    static const char *const written[] = {"config.json", "model.safetensors", "tokenizer.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(quantized_file, sizeof quantized_file, "%s/%s", quantized_dir, written[i]);
        unlink(quantized_file);
    }
    rmdir(quantized_dir);
    free(schema_reference);
    tl_model_free(model);
    return check_summary();
}

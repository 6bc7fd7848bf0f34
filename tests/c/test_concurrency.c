/* test_concurrency.c: four threads, each with its own sessions on one shared model, produce
 * exactly the tokens of sequential runs, and between them the embeddings of sequential
 * calls, to the bit (tl_embed, and in odd rounds tl_embed_batch of the prompt and its first
 * two tokens, sharing a forward). Then four threads share one compiled grammar whose tables
 * start new generations under them. First, a model's worker threads make no malloc arena.
 * Built also under ThreadSanitizer (scripts/test). */
#define _GNU_SOURCE /* open_memstream, malloc_info */
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "grammar.h"
#include "tinyloop.h"

#define THREADS 4
#define ROUNDS 3
#define CAP 32

static tl_model *model;

typedef struct {
    int index;
    int32_t prompt[4];
    tl_generate_config cfg;
    int32_t want[CAP], got[ROUNDS][CAP];
    int want_len, got_len[ROUNDS];
    float *embed_want, *embed_got[ROUNDS]; /* [d_model] each: the prompt's embedding */
    float *batch_out;                      /* [2][d_model]: tl_embed_batch's two vectors */
    tl_status status;
} job_t;

static tl_embed_options embed_options(int i) {
    tl_embed_options o;
    tl_embed_options_init(&o);
    o.loops = 1 + i % 2;
    o.pooling = i % 2 ? TL_POOLING_LAST : TL_POOLING_MEAN;
    return o;
}

static void *worker(void *arg) {
    job_t *j = arg;
    for (int r = 0; r < ROUNDS; r++) {
        /* Alternate the blocking call and the step API: both are one state machine. */
        if (r % 2 == 0) {
            j->status |= tl_generate(model, j->prompt, 4, &j->cfg, j->got[r], CAP, &j->got_len[r], NULL);
        } else {
            tl_session *s = NULL;
            j->status |= tl_session_new(model, j->prompt, 4, &j->cfg, &s);
            int32_t tok;
            tl_stop_reason stop = TL_STOP_NONE;
            while (s && stop == TL_STOP_NONE && tl_session_step(s, &tok, &stop) == TL_OK) {}
            const int32_t *tokens = tl_session_tokens(s, &j->got_len[r]);
            memcpy(j->got[r], tokens, (size_t)j->got_len[r] * sizeof(int32_t));
            tl_session_free(s);
        }
        const tl_embed_options eo = embed_options(j->index);
        if (r % 2 == 0) {
            j->status |= tl_embed(model, j->prompt, 4, &eo, j->embed_got[r]);
        } else {
            const tl_token_seq inputs[2] = {{j->prompt, 4}, {j->prompt, 2}};
            const size_t d = (size_t)tl_model_info(model)->d_model;
            j->status |= tl_embed_batch(model, inputs, 2, &eo, j->batch_out);
            memcpy(j->embed_got[r], j->batch_out, d * sizeof(float));
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------- one grammar, four threads
   Each thread starts matchers on one shared compiled grammar (a server's cached one), walks a
   document's tokens, clones some halfway, and matches nested texts, on tables kept small, so
   that new generations start while other threads' matchers are still on old ones. */
enum { GRAMMAR_ROUNDS = 60 };
static tl_model *text_model;
static tl_compiled_grammar *shared_grammar;
static int32_t *doc_ids;
static int n_doc_ids;

typedef struct {
    int index, accepted, matched;
    tl_status status;
} grammar_job;

static void *grammar_worker(void *arg) {
    grammar_job *j = arg;
    uint64_t rng = 0x9E3779B97F4A7C15ULL * (uint64_t)(j->index + 1);
    for (int r = 0; r < GRAMMAR_ROUNDS && j->status == TL_OK; r++) {
        tl_grammar_matcher *mt = NULL, *twin = NULL;
        if ((j->status = tl_grammar_matcher_new(shared_grammar, text_model, &mt)) != TL_OK) break;
        for (int i = 0; i < n_doc_ids && j->status == TL_OK; i++) {
            j->status = tl_grammar_matcher_accept(mt, doc_ids[i]);
            if (i == n_doc_ids / 2 && r % 3 == 0 && j->status == TL_OK) j->status = tl_gram_matcher_clone(mt, &twin);
        }
        j->accepted += j->status == TL_OK && tl_grammar_matcher_is_accepting(mt);
        tl_grammar_matcher_free(mt); /* the twin, halfway, outlives it on its generation */
        for (int i = n_doc_ids / 2 + 1; twin && i < n_doc_ids && j->status == TL_OK; i++)
            j->status = tl_grammar_matcher_accept(twin, doc_ids[i]);
        if (twin) j->accepted += j->status == TL_OK && tl_grammar_matcher_is_accepting(twin);
        tl_grammar_matcher_free(twin);
        char text[512] = "{\"k\":"; /* a random path 30 deep: new stacks for the tables */
        for (int d = 0; d < 30; d++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            strcat(text, rng & 1 ? "[" : "{\"k\":");
        }
        strcat(text, "1");
        for (size_t i = strlen(text); i-- > 0;) /* each opened value closed, innermost first */
            if (text[i] == '[' || text[i] == '{') strcat(text, text[i] == '[' ? "]" : "}");
        int match = 0;
        if (j->status == TL_OK) j->status = tl_grammar_matches(shared_grammar, text, strlen(text), &match);
        j->matched += match;
    }
    return NULL;
}

static void test_shared_grammar(const char *data_dir) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/../textmodel", data_dir);
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 1;
    if (tl_model_load(dir, &o, &text_model) != TL_OK) { CHECK(0, "load %s: %s", dir, tl_last_error()); return; }
    const char *schema = "{\"type\":\"object\"}";
    CHECK(tl_grammar_compile_json_schema(schema, strlen(schema), NULL, &shared_grammar) == TL_OK, "%s", tl_last_error());
    const char *doc = "{\"a\":[1,{\"b\":[true,null]}],\"c\":\"x\"}";
    CHECK(tl_encode(text_model, doc, strlen(doc), &doc_ids, &n_doc_ids) == TL_OK, "%s", tl_last_error());
    if (shared_grammar && doc_ids) {
        shared_grammar->table_budget = 64 << 10;
        grammar_job jobs[THREADS];
        pthread_t threads[THREADS];
        for (int i = 0; i < THREADS; i++) {
            jobs[i] = (grammar_job){.index = i};
            pthread_create(&threads[i], NULL, grammar_worker, &jobs[i]);
        }
        for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
        for (int i = 0; i < THREADS; i++)
            CHECK(jobs[i].status == TL_OK && jobs[i].accepted == GRAMMAR_ROUNDS + (GRAMMAR_ROUNDS + 2) / 3 &&
                      jobs[i].matched == GRAMMAR_ROUNDS,
                  "grammar thread %d: %s, %d accepted, %d matched", i, jobs[i].status == TL_OK ? "ok" : tl_last_error(),
                  jobs[i].accepted, jobs[i].matched);
        CHECK(shared_grammar->generations >= 2, "the tables started over %lld times", (long long)shared_grammar->generations);
    }
    tl_free(doc_ids);
    tl_compiled_grammar_free(shared_grammar);
    tl_model_free(text_model);
}

/* The model's worker threads never call malloc or free: glibc gives a thread its own arena
   at its first call (64 MiB of address space reserved, 128 briefly), and 16 threads' arenas
   failed loads under `ulimit -v` at random (each freed its start argument). Counted with
   malloc_info before this test starts threads of its own (under a sanitizer, whose allocator
   glibc's malloc_info does not see, it reads one heap or none). */
static void worker_threads_keep_no_arena(const char *dir) {
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 4;
    tl_model *m = NULL;
    CHECK(tl_model_load(dir, &o, &m) == TL_OK, "load: %s", tl_last_error());
    if (!m) return;
    const int32_t prompt[4] = {3, 4, 5, 6};
    tl_generate_config c;
    tl_generate_config_init(&c);
    c.max_tokens = 8;
    c.ignore_eos = 1;
    int32_t out[CAP];
    int n = 0;
    CHECK(tl_generate(m, prompt, 4, &c, out, CAP, &n, NULL) == TL_OK, "generate: %s", tl_last_error());
    char *xml = NULL;
    size_t len = 0;
    FILE *fp = open_memstream(&xml, &len);
    int heaps = 0;
    if (fp && malloc_info(0, fp) == 0) {
        fclose(fp);
        for (const char *at = xml; (at = strstr(at, "<heap nr=")); at++) heaps++;
    } else if (fp) {
        fclose(fp);
    }
    free(xml);
    CHECK(heaps <= 1, "%d malloc arenas after a model of 4 threads generated: its workers allocate", heaps);
    tl_model_free(m);
}

int main(int argc, char **argv) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/f16_concat_residual_gqa", argc > 1 ? argv[1] : "tests/data/golden");
    worker_threads_keep_no_arena(dir);
    tl_load_options o;
    tl_load_options_init(&o);
    o.n_threads = 2;
    if (tl_model_load(dir, &o, &model) != TL_OK) { printf("load: %s\n", tl_last_error()); return 1; }
    job_t jobs[THREADS];
    memset(jobs, 0, sizeof jobs);
    for (int i = 0; i < THREADS; i++) {
        job_t *j = &jobs[i];
        j->index = i;
        for (int k = 0; k < 4; k++) j->prompt[k] = (int32_t)((i * 31 + k * 7) % 100);
        tl_generate_config_init(&j->cfg);
        j->cfg.max_tokens = 20;
        j->cfg.ignore_eos = 1;
        j->cfg.temperature = i == 0 ? 0.0f : 0.7f + 0.1f * (float)i;
        j->cfg.sample_seed = 1000u + (uint64_t)i;
        j->cfg.loops = 1 + i;
        j->cfg.cache_window = i == 3 ? 6 : 0;
        CHECK(tl_generate(model, j->prompt, 4, &j->cfg, j->want, CAP, &j->want_len, NULL) == TL_OK,
              "sequential %d: %s", i, tl_last_error());
        const size_t d = (size_t)tl_model_info(model)->d_model;
        j->embed_want = calloc(d, sizeof(float));
        j->batch_out = calloc(2 * d, sizeof(float));
        for (int r = 0; r < ROUNDS; r++) j->embed_got[r] = calloc(d, sizeof(float));
        const tl_embed_options eo = embed_options(i);
        CHECK(j->embed_want && j->batch_out && tl_embed(model, j->prompt, 4, &eo, j->embed_want) == TL_OK,
              "sequential embed %d: %s", i, tl_last_error());
    }
    pthread_t threads[THREADS];
    for (int i = 0; i < THREADS; i++) pthread_create(&threads[i], NULL, worker, &jobs[i]);
    for (int i = 0; i < THREADS; i++) pthread_join(threads[i], NULL);
    for (int i = 0; i < THREADS; i++) {
        CHECK(jobs[i].status == TL_OK, "thread %d failed", i);
        for (int r = 0; r < ROUNDS; r++)
            CHECK(jobs[i].got_len[r] == jobs[i].want_len &&
                      memcmp(jobs[i].got[r], jobs[i].want, (size_t)jobs[i].want_len * sizeof(int32_t)) == 0,
                  "thread %d round %d differs from the sequential run", i, r);
        const size_t d = (size_t)tl_model_info(model)->d_model;
        for (int r = 0; r < ROUNDS; r++) {
            CHECK(jobs[i].embed_got[r] && memcmp(jobs[i].embed_got[r], jobs[i].embed_want, d * sizeof(float)) == 0,
                  "thread %d round %d: the embedding differs from the sequential one", i, r);
            free(jobs[i].embed_got[r]);
        }
        free(jobs[i].embed_want);
        free(jobs[i].batch_out);
    }
    tl_model_free(model);
    test_shared_grammar(argc > 1 ? argv[1] : "tests/data/golden");
    return check_summary();
}

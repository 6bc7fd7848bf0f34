/* scheduler.c: the serving engine (tinyloop.h, "serving engine"). One thread per engine
 * owns the running sessions and advances all of them with one tl_session_step_batch per
 * iteration; other threads submit, wait, read and cancel requests by id under one mutex.
 *
 * Locking: `mu` guards every field of the engine and of its requests except the running
 * sessions themselves, which only the engine thread touches (it steps them without the
 * lock, so a slow forward pass never blocks a reader). A request's buffers are written by
 * the engine thread and swapped out by readers, both under `mu`. Sessions that end, and
 * cancelled requests, are unlinked under `mu` but freed after it is released (freeing a
 * session's pages and matcher took 0.1-0.5 ms, during which every read and wait stalled).
 * Requests are found by id (a linear scan: there are at most max_active + max_queued plus
 * a few finished-but-unread ones), so a waiter never holds a request pointer while it
 * sleeps, and cancel can free a finished request at once.
 *
 * Waking: each tl_engine_wait sleeps on a condition variable of its own (on its stack),
 * linked into its request's list of waiters, and the engine signals only the waiters of a
 * request that has something new (output, its finish, its cancel) or all of them when it
 * stops. Why not one broadcast per step: it woke every waiting thread on every step, the
 * waiters of queued requests included (with max_queued = 32, dozens of threads per token
 * that find nothing and sleep again, each a context switch on the cores the step needs).
 * A waiter's node is touched only under `mu`; a request that goes away (unlink_request)
 * signals and unlinks its waiters first, so no node outlives its wait. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "session.h"

typedef struct buffer {
    char *text;
    size_t len, cap;
    int32_t *tokens;
    int n_tokens, cap_tokens;
    /* a request with logprobs >= 0: [cap_tokens] and [cap_tokens * n_top], beside tokens */
    float *logprobs;
    int32_t *top_ids;
    float *top_logprobs;
} buffer;

/* One emitted token's log-probabilities (tl_session_logprobs), for its request's buffer. */
typedef struct token_logprobs {
    bool failed;               /* tl_session_logprobs failed (out of memory: the rest is checked at submit) */
    float logprob;
    int32_t top_ids[TL_MAX_TOP_LOGPROBS];
    float top_logprobs[TL_MAX_TOP_LOGPROBS];
} token_logprobs;

/* One tl_engine_wait call, sleeping (see "Waking" above). */
typedef struct waiter {
    pthread_cond_t cond;
    struct waiter *next;
} waiter;

typedef struct request {
    uint64_t id;
    waiter *waiters;           /* the tl_engine_wait calls sleeping on this request */
    tl_session *session;       /* owned until it finishes or is cancelled; then NULL */
    int logprobs;              /* tl_engine_request_options.logprobs: -1, or the alternatives */
    int64_t kv_share;          /* tl_session_max_kv_bytes at submit: its share of kv_budget_bytes */
    tl_engine_state state;
    bool cancelled;            /* the caller is gone: drop the session, free the request */
    bool oom;                  /* an output buffer could not grow: finish with an error */
    buffer pending, given;     /* written by the engine / handed to the last read */
    tl_stop_reason stop_reason;
    tl_status status;
    char error[TL_ERROR_MAX];
    tl_generate_stats stats;
} request;

struct tl_engine {
    const tl_model *model;
    tl_engine_options opts;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work;       /* the engine thread: a submit, a cancel or stop */
    pthread_condattr_t wait_attr; /* of every waiter's cond: CLOCK_MONOTONIC */
    bool stop;
    bool joined;               /* tl_engine_stop joined the thread (the stopping caller's) */
    unsigned process;          /* tl_process_mark() when the thread started: in a child
                                  forked since (inherited), the thread is the parent's */
    bool idle;                 /* (under mu) the thread waits for work: nothing mid-step */
    bool child_stopped;        /* an inherited engine's stop ran (stop_inherited) */
    bool child_frees;          /* ... and found its memory safe to free */
    int waiters;               /* tl_engine_wait calls inside; free waits for 0 */
    int cancels_freeing;       /* tl_engine_cancel calls freeing a request after mu; stop waits
                                  for 0 (the session gives its pages back to the model) */
    request **reqs;            /* every live request, in submit order */
    int n_reqs, cap_reqs;
    uint64_t next_id;
    tl_engine_counters c;
    /* The engine thread's own, [max_active] each: allocated by tl_engine_new, so that an
       engine that returned TL_OK can run (a thread that failed to allocate them would have
       left an engine refusing every submit). */
    request **run;               /* the running requests */
    tl_session **sessions;       /* their sessions, as one batch */
    int32_t *tokens;
    tl_stop_reason *stops;
    tl_status *statuses;
    const char **pieces;         /* each session's new text (tl_session_text) */
    size_t *piece_lens;
    token_logprobs *logprobs;    /* each session's token's, where its request asked */
    tl_session **retired_sessions; /* [2 * max_active] ended, to free once mu is released */
    int n_retired_sessions;
    request **retired_requests;  /* [max_active] cancelled while running, likewise */
    int n_retired_requests;
};

void tl_engine_options_init(tl_engine_options *opts) {
    if (!opts) return;
    opts->max_active = 8;
    opts->max_queued = 32;
    opts->step_rows = -1; /* auto: tl_engine_auto_step_rows */
    opts->kv_budget_bytes = 0; /* none */
}

/* step_rows = -1: whole forward passes of TL_FORWARD_CHUNK rows with at least 32 of them left
   for prompts when every place runs (64 for max_active up to 32, then 128 up to 96, ...): a
   smaller share would make a new prompt's first token wait about prompt_len / share
   iterations, one row an iteration at the edge. */
int tl_engine_auto_step_rows(int max_active) {
    if (max_active < 1 || max_active > 4096) return TL_FORWARD_CHUNK;
    return TL_FORWARD_CHUNK * ((max_active + 32 + TL_FORWARD_CHUNK - 1) / TL_FORWARD_CHUNK);
}

static request *find(tl_engine *e, uint64_t id) {
    for (int i = 0; i < e->n_reqs; i++)
        if (e->reqs[i]->id == id) return e->reqs[i];
    return NULL;
}

/* Under mu: r has something new for its readers (or is going away, or the engine stops). */
static void wake(request *r) {
    for (waiter *w = r->waiters; w; w = w->next) pthread_cond_signal(&w->cond);
}

static void wake_all(tl_engine *e) {
    for (int i = 0; i < e->n_reqs; i++) wake(e->reqs[i]);
}

static void free_buffer(buffer *b) {
    free(b->text);
    free(b->tokens);
    free(b->logprobs);
    free(b->top_ids);
    free(b->top_logprobs);
}

/* A request whose session was tl_session_free'd while the engine held it ends so. */
#define FREED_WHILE_HELD "the session was freed (tl_session_free) while the engine held it: its request ends here"

static void free_request(request *r) {
    if (!r) return;
    tl_session_release_claimed(r->session);
    free_buffer(&r->pending);
    free_buffer(&r->given);
    free(r);
}

/* Unlinks r (under mu; r's session is no longer stepping): the caller frees it (free_request)
   once mu is released. Its waiters wake, find the id gone and return -1; their nodes are
   theirs again. */
static void unlink_request(tl_engine *e, request *r) {
    wake(r);
    r->waiters = NULL;
    for (int i = 0; i < e->n_reqs; i++) {
        if (e->reqs[i] == r) {
            memmove(&e->reqs[i], &e->reqs[i + 1], (size_t)(e->n_reqs - i - 1) * sizeof *e->reqs);
            e->n_reqs--;
            break;
        }
    }
}

/* Appends a step's text and token (-1: none) to b; `lp` (NULL: the request asked for none)
   the token's log-probabilities with n_top alternatives. */
static bool append(buffer *b, const char *text, size_t len, int32_t token, const token_logprobs *lp, int n_top) {
    if (len) {
        if (b->len + len > b->cap) {
            size_t cap = b->cap ? b->cap : 256;
            while (cap < b->len + len) cap *= 2;
            char *t = realloc(b->text, cap);
            if (!t) return false;
            b->text = t, b->cap = cap;
        }
        memcpy(b->text + b->len, text, len);
        b->len += len;
    }
    if (token >= 0) {
        if (b->n_tokens == b->cap_tokens) {
            int cap = b->cap_tokens ? 2 * b->cap_tokens : 64;
            int32_t *t = realloc(b->tokens, (size_t)cap * sizeof *t);
            if (!t) return false;
            b->tokens = t;
            if (lp) {
                const size_t tops = (size_t)cap * (size_t)n_top;
                float *l = realloc(b->logprobs, (size_t)cap * sizeof *l);
                if (l) b->logprobs = l;
                int32_t *ids = realloc(b->top_ids, (tops ? tops : 1) * sizeof *ids);
                if (ids) b->top_ids = ids;
                float *tl = realloc(b->top_logprobs, (tops ? tops : 1) * sizeof *tl);
                if (tl) b->top_logprobs = tl;
                if (!l || !ids || !tl) return false;
            }
            b->cap_tokens = cap;
        }
        if (lp) {
            b->logprobs[b->n_tokens] = lp->logprob;
            memcpy(b->top_ids + (size_t)b->n_tokens * (size_t)n_top, lp->top_ids, (size_t)n_top * sizeof *lp->top_ids);
            memcpy(b->top_logprobs + (size_t)b->n_tokens * (size_t)n_top, lp->top_logprobs,
                   (size_t)n_top * sizeof *lp->top_logprobs);
        }
        b->tokens[b->n_tokens++] = token;
    }
    return true;
}

/* Under mu: the session ended (stop, failure or out of memory); keep what the reader needs
   (`error` may be the session's own message: copied before the session goes). */
static void finish(tl_engine *e, request *r, tl_stop_reason stop, tl_status status, const char *error) {
    if (error) snprintf(r->error, sizeof r->error, "%s", error);
    r->stats = *tl_session_stats(r->session);
    /* its KV cache goes now, not when the caller reads: after mu is released (free_retired) */
    if (e->n_retired_sessions < 2 * e->opts.max_active) e->retired_sessions[e->n_retired_sessions++] = r->session;
    else tl_session_release_claimed(r->session); /* (more freed-while-queued ones than places: now) */
    r->session = NULL;
    r->state = TL_ENGINE_FINISHED;
    r->stop_reason = stop;
    r->status = status;
    if (status != TL_OK) e->c.failed++;
    e->c.finished++;
    e->c.active--;
}

static void free_engine_arrays(tl_engine *e) {
    free(e->run), free(e->sessions), free(e->tokens), free(e->stops), free(e->statuses), free(e->pieces);
    free(e->piece_lens), free(e->logprobs), free(e->retired_sessions), free(e->retired_requests);
}

/* The engine thread, without mu: frees the sessions that ended and the requests cancelled
   since it last held it (finish, and the top of its loop). */
static void free_retired(tl_engine *e) {
    for (int i = 0; i < e->n_retired_sessions; i++) tl_session_release_claimed(e->retired_sessions[i]);
    for (int i = 0; i < e->n_retired_requests; i++) free_request(e->retired_requests[i]);
    e->n_retired_sessions = e->n_retired_requests = 0;
}

static bool alloc_engine_arrays(tl_engine *e) {
    const size_t cap = (size_t)e->opts.max_active;
    e->run = calloc(cap, sizeof *e->run);
    e->sessions = calloc(cap, sizeof *e->sessions);
    e->tokens = calloc(cap, sizeof *e->tokens);
    e->stops = calloc(cap, sizeof *e->stops);
    e->statuses = calloc(cap, sizeof *e->statuses);
    e->pieces = calloc(cap, sizeof *e->pieces);
    e->piece_lens = calloc(cap, sizeof *e->piece_lens);
    e->logprobs = calloc(cap, sizeof *e->logprobs);
    e->retired_sessions = calloc(2 * cap, sizeof *e->retired_sessions);
    e->retired_requests = calloc(cap, sizeof *e->retired_requests);
    return e->run && e->sessions && e->tokens && e->stops && e->statuses && e->pieces && e->piece_lens && e->logprobs &&
           e->retired_sessions && e->retired_requests;
}

/* Whether queued request r waits for the prefill of a running request submitted before it
   (only those: a later one never holds it back, and a wait lasts one prefill) whose prompt gives
   r at least a page of rows more than it could take now (tl_session_prefix_reach): admitted now,
   both would compute them (the n choices of one prompt, a burst of chats under one long system
   prompt); admitted after, r takes them from the pool (tl_session_take_prefix_late). */
static bool awaits_prefill(const request *r, request *const *run, int n_run) {
    if (atomic_load(&r->session->free_requested)) return false; /* (finished at its admission) */
    int shared = 0; /* (the most an earlier request's prefill gives r; the pool's lock only then) */
    for (int k = 0; k < n_run; k++) {
        const int rows = run[k]->id < r->id ? tl_session_prompt_rows_shared(r->session, run[k]->session) : 0;
        if (rows > shared) shared = rows;
    }
    if (shared < TL_KV_PAGE_ROWS) return false;
    const int reach = tl_session_prefix_reach(r->session);
    return reach >= 0 && shared >= reach + TL_KV_PAGE_ROWS;
}

static void *engine_main(void *arg) {
    tl_engine *e = arg;
    const int cap = e->opts.max_active;
    request **run = e->run;
    tl_session **sessions = e->sessions;
    int32_t *tokens = e->tokens;
    tl_stop_reason *stops = e->stops;
    tl_status *statuses = e->statuses;
    const char **pieces = e->pieces;
    size_t *piece_lens = e->piece_lens;
    token_logprobs *logprobs = e->logprobs;
    int n_run = 0;
    tl_step_batch_options step_opts;
    tl_step_batch_options_init(&step_opts);

    pthread_mutex_lock(&e->mu);
    while (!e->stop) {
        /* Between iterations, so a cancel takes effect before the next token. */
        int kept = 0;
        for (int i = 0; i < n_run; i++) {
            request *r = run[i];
            if (r->cancelled) {
                e->c.active--;
                e->c.kv_reserved_bytes -= r->kv_share;
                unlink_request(e, r);
                e->retired_requests[e->n_retired_requests++] = r; /* (at most one per place) */
            } else if (r->state == TL_ENGINE_RUNNING) {
                run[kept++] = r;
            } else { /* finished: it left the batch, the request waits for its reader */
                e->c.kv_reserved_bytes -= r->kv_share;
            }
        }
        n_run = kept;
        /* Queued requests start in submit order while places are free and, under a budget,
           while their K/V share fits beside the running ones'; the first that does not fit
           holds back the rest (kv_waiting), else a stream of small requests could keep a large
           one waiting for good. */
        e->c.kv_waiting = e->c.prefill_waiting = 0;
        for (int i = 0; i < e->n_reqs && n_run < cap; i++) {
            request *r = e->reqs[i];
            if (r->state == TL_ENGINE_QUEUED && !r->cancelled) {
                if (awaits_prefill(r, run, n_run)) { /* (a place stays free for those after it) */
                    e->c.prefill_waiting++;
                    continue;
                }
                if (e->opts.kv_budget_bytes > 0 && e->c.kv_reserved_bytes + r->kv_share > e->opts.kv_budget_bytes) {
                    for (int k = i; k < e->n_reqs; k++)
                        e->c.kv_waiting += e->reqs[k]->state == TL_ENGINE_QUEUED && !e->reqs[k]->cancelled;
                    break;
                }
                r->state = TL_ENGINE_RUNNING;
                e->c.queued--;
                e->c.active++;
                if (atomic_load(&r->session->free_requested)) { /* freed while it waited (a hook of another) */
                    wake(r);
                    finish(e, r, TL_STOP_NONE, TL_ERR_INVALID_ARGUMENT, FREED_WHILE_HELD);
                    continue;
                }
                e->c.kv_reserved_bytes += r->kv_share;
                tl_session_take_prefix_late(r->session); /* (what the pool was given while it waited) */
                r->stats.prompt_tokens_reused = tl_session_stats(r->session)->prompt_tokens_reused;
                run[n_run++] = r;
            }
        }
        /* (Admission wakes nobody: a wait returns for output, a finish or a cancel, and the
           handler learns "running" from its first read.) */
        if (n_run == 0) {
            if (e->n_retired_sessions + e->n_retired_requests > 0) { /* freed first: the wait may be long */
                pthread_mutex_unlock(&e->mu);
                free_retired(e);
                pthread_mutex_lock(&e->mu);
                continue;
            }
            e->idle = true;
            pthread_cond_wait(&e->work, &e->mu);
            e->idle = false;
            continue;
        }
        for (int i = 0; i < n_run; i++) sessions[i] = run[i]->session;
        pthread_mutex_unlock(&e->mu);
        free_retired(e);
        /* Chunked prefill: prompts get what the running requests' rows leave of step_rows (at
           least one row: step_rows > max_active), so that an iteration is one forward pass of
           TL_FORWARD_CHUNK rows with the defaults, not a full one and a nearly empty one. */
        step_opts.prompt_rows = e->opts.step_rows > 0 ? e->opts.step_rows - n_run : 0;

        /* The forward pass, without the lock. Only this thread touches these sessions. */
        tl_status st = tl_session_step_batch_with(sessions, n_run, &step_opts, tokens, stops, statuses);
        /* A refused call fails every row with its message (submit admits only sessions the
           call takes, so this is out of memory at most); a failed session has its own. */
        char batch_error[TL_ERROR_MAX] = "";
        if (st != TL_OK) snprintf(batch_error, sizeof batch_error, "%s", tl_last_error());
        for (int i = 0; i < n_run; i++) {
            if (st != TL_OK) statuses[i] = st;
            pieces[i] = "", piece_lens[i] = 0;
            if (statuses[i] == TL_OK && tl_session_text(sessions[i], &pieces[i], &piece_lens[i]) != TL_OK)
                pieces[i] = "", piece_lens[i] = 0; /* no tokenizer: token ids only */
            /* (a request's logprobs is fixed at submit: read without the lock) */
            logprobs[i].failed = statuses[i] == TL_OK && tokens[i] >= 0 && run[i]->logprobs >= 0 &&
                                 tl_session_logprobs(sessions[i], run[i]->logprobs, &logprobs[i].logprob,
                                                     logprobs[i].top_ids, logprobs[i].top_logprobs) != TL_OK;
        }

        pthread_mutex_lock(&e->mu);
        /* stopped during the step: nothing more is recorded (the counters stay as they were at
           the stop; a beam search's step, failed by the stop, counted as failed and finished) */
        if (e->stop) break;
        e->c.iterations++;
        e->c.rows += (uint64_t)n_run; /* (less the prompt chunks, below) */
        for (int i = 0; i < n_run; i++) {
            request *r = run[i];
            const bool cut = statuses[i] == TL_OK && tokens[i] < 0 && stops[i] == TL_STOP_NONE;
            if (cut) { /* step_rows cut its prompt: a chunk, not a step (also when cancelled since), */
                e->c.rows--;
                /* or nothing where the earlier prompts took every row (it counted as a chunk) */
                if (r->session->batch_prompt_rows > 0) e->c.partial_prefills++;
            }
            if (r->cancelled) {
                e->c.steps_after_cancel++;
                continue; /* dropped at the top of the loop; its waiters were woken by the cancel */
            }
            if (atomic_load(&r->session->free_requested)) { /* freed by a hook during the step */
                wake(r);
                finish(e, r, TL_STOP_NONE, TL_ERR_INVALID_ARGUMENT, FREED_WHILE_HELD);
                continue;
            }
            if (cut) continue; /* nothing to read yet */
            wake(r); /* a token, a finish or a failure: something to read in every case */
            if (statuses[i] != TL_OK) {
                finish(e, r, TL_STOP_NONE, statuses[i], st != TL_OK ? batch_error : tl_session_error(r->session));
                continue;
            }
            if (logprobs[i].failed) {
                finish(e, r, TL_STOP_NONE, TL_ERR_NO_MEMORY, "out of memory for the token's log-probabilities");
                continue;
            }
            if (!append(&r->pending, pieces[i], piece_lens[i], tokens[i], r->logprobs >= 0 ? &logprobs[i] : NULL,
                        r->logprobs)) {
                finish(e, r, TL_STOP_NONE, TL_ERR_NO_MEMORY, "out of memory for the request's output");
                continue;
            }
            if (stops[i] != TL_STOP_NONE) finish(e, r, stops[i], TL_OK, NULL);
        }
    }
    /* Stopping: the running sessions are freed with their requests by tl_engine_free. */
    pthread_mutex_unlock(&e->mu);
    free_retired(e);
    return NULL;
}

tl_status tl_engine_new(const tl_model *model, const tl_engine_options *opts, tl_engine **out) {
    tl_clear_error();
    if (out) *out = NULL;
    if (!model || !out) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_engine_new: model and out must not be NULL");
    tl_engine_options o;
    tl_engine_options_init(&o);
    if (opts) o = *opts;
    if (o.max_active < 1 || o.max_active > 4096)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_active = %d must be in [1, 4096]", o.max_active);
    if (o.max_queued < 0 || o.max_queued > 1 << 20)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "max_queued = %d must be in [0, 1048576]", o.max_queued);
    if (o.step_rows == -1) o.step_rows = tl_engine_auto_step_rows(o.max_active);
    if (o.kv_budget_bytes < 0)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "kv_budget_bytes = %lld must be 0 (none) or more",
                       (long long)o.kv_budget_bytes);
    if (o.step_rows < 0 || (o.step_rows > 0 && o.step_rows <= o.max_active))
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "step_rows = %d must be -1 (auto), 0 (no limit) or more than max_active = %d (every "
                       "running request takes a row, and prompts need at least one)",
                       o.step_rows, o.max_active);
    tl_engine *e = calloc(1, sizeof *e);
    if (!e) return tl_fail(TL_ERR_NO_MEMORY, "tl_engine_new: out of memory");
    e->model = model;
    e->opts = o;
    e->next_id = 1;
    e->c.max_active = o.max_active;
    e->c.max_queued = o.max_queued;
    e->c.kv_budget_bytes = o.kv_budget_bytes;
    if (!alloc_engine_arrays(e)) {
        free_engine_arrays(e);
        free(e);
        return tl_fail(TL_ERR_NO_MEMORY, "tl_engine_new: out of memory");
    }
    pthread_condattr_init(&e->wait_attr);
    pthread_condattr_setclock(&e->wait_attr, CLOCK_MONOTONIC); /* wait timeouts ignore clock changes */
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work, NULL);
    e->process = tl_process_mark();
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        pthread_condattr_destroy(&e->wait_attr);
        pthread_cond_destroy(&e->work);
        pthread_mutex_destroy(&e->mu);
        free_engine_arrays(e);
        free(e);
        return tl_fail(TL_ERR_NO_MEMORY, "tl_engine_new: cannot start the engine thread");
    }
    *out = e;
    return TL_OK;
}

/* An engine a fork()ed child inherited: its thread is the parent's. The child may free it
   (tl_engine_free, joining nothing) and read its counters; the rest is refused, as by a
   stopped engine, naming the fork. Never by taking mu: a parent thread that held it at the
   fork left it locked for good. */
static bool inherited(const tl_engine *e) { return tl_forked_since(e->process); }
#define INHERITED_ENGINE \
    "the engine was made before this process was forked (fork() copies no thread: its thread is the parent's); " \
    "make an engine in this process"

/* The inherited engine's stop: nothing joined or waited for (the parent's waiters and
   cancels are not here). Its requests and their sessions are freed only where the fork found
   mu free (the child's trylock takes it) and the thread waiting for work (or joined, stopped
   before the fork): else a session was mid-step or mid-free, a request's buffer mid-change,
   and freeing them crashed a child now and then (sessions freed twice) where leaving them
   allocated costs only the child's memory. */
static void stop_inherited(tl_engine *e) {
    if (e->child_stopped) return;
    e->child_stopped = true;
    const bool locked = pthread_mutex_trylock(&e->mu) == 0;
    e->child_frees = locked && (e->idle || e->joined);
    e->stop = true;
    if (e->child_frees) { /* (idle: the thread freed its retired sessions before it waited) */
        for (int i = 0; i < e->n_reqs; i++) free_request(e->reqs[i]);
        e->n_reqs = 0;
    }
    if (locked) pthread_mutex_unlock(&e->mu);
}

/* Whether the caller is the engine's own thread: a hook of a session it steps. */
static bool on_engine_thread(const tl_engine *e) { return !e->joined && pthread_equal(pthread_self(), e->thread); }

void tl_engine_stop(tl_engine *e) {
    if (!e) return;
    if (inherited(e)) {
        stop_inherited(e);
        return;
    }
    pthread_mutex_lock(&e->mu);
    e->stop = true;
    /* a step that searches within itself (beam search) leaves early, as at a cancel: the
       join below waited for a whole search (a second and more of a wide beam) */
    for (int i = 0; i < e->n_reqs; i++)
        if (e->reqs[i]->session) atomic_store(&e->reqs[i]->session->stop_requested, true);
    pthread_cond_broadcast(&e->work);
    wake_all(e);
    pthread_mutex_unlock(&e->mu);
    /* From a hook, on the engine thread: the stop is asked, and the thread leaves once its
       step returns. It cannot join itself, and the requests it is stepping must outlive the
       step: the owner's stop or free joins and frees them. */
    if (on_engine_thread(e)) return;
    if (!e->joined) {
        pthread_join(e->thread, NULL);
        e->joined = true;
    }
    pthread_mutex_lock(&e->mu);
    while (e->waiters > 0 || e->cancels_freeing > 0) { /* they see `stop` and leave; a cancel ends its free */
        wake_all(e);
        pthread_mutex_unlock(&e->mu);
        sched_yield();
        pthread_mutex_lock(&e->mu);
    }
    /* Every request goes (a wait or read of its id now finds nothing: -1, an error); the
       counters stay as they were. */
    for (int i = 0; i < e->n_reqs; i++) free_request(e->reqs[i]);
    e->n_reqs = 0;
    pthread_mutex_unlock(&e->mu);
}

void tl_engine_free(tl_engine *e) {
    if (!e) return;
    if (inherited(e)) { /* (the parent's sleepers count in its condition variables: no destroy) */
        stop_inherited(e);
        if (!e->child_frees) return; /* left allocated (stop_inherited) */
        free(e->reqs);
        free_engine_arrays(e);
        free(e);
        return;
    }
    if (on_engine_thread(e)) { /* from a hook: a stop only (tl_engine_stop's), the owner frees */
        tl_engine_stop(e);
        return;
    }
    tl_engine_stop(e);
    free(e->reqs);
    pthread_condattr_destroy(&e->wait_attr);
    pthread_cond_destroy(&e->work);
    pthread_mutex_destroy(&e->mu);
    free_engine_arrays(e);
    free(e);
}

void tl_engine_request_options_init(tl_engine_request_options *opts) {
    if (opts) opts->logprobs = -1;
}

tl_status tl_engine_submit(tl_engine *e, tl_session *session, uint64_t *id) {
    return tl_engine_submit_with(e, session, NULL, id);
}

tl_status tl_engine_submit_with(tl_engine *e, tl_session *session, const tl_engine_request_options *opts, uint64_t *id) {
    tl_clear_error();
    if (!e || !session || !id) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_engine_submit: engine, session and id must not be NULL");
    *id = 0;
    if (inherited(e)) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_engine_submit: " INHERITED_ENGINE);
    tl_engine_request_options o;
    tl_engine_request_options_init(&o);
    if (opts) o = *opts;
    if (o.logprobs < -1 || o.logprobs > TL_MAX_TOP_LOGPROBS)
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_engine_submit: logprobs = %d must be -1 (none) or in [0, %d]", o.logprobs,
                       TL_MAX_TOP_LOGPROBS);
    if (o.logprobs >= 0 && !tl_session_keeps_rows(session))
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "tl_engine_submit: logprobs of a %s session are not kept (plain or speculative decoding only)",
                       session->decoder->name);
    request *r = calloc(1, sizeof *r);
    if (!r) return tl_fail(TL_ERR_NO_MEMORY, "tl_engine_submit: out of memory");
    pthread_mutex_lock(&e->mu);
    if (e->stop) {
        pthread_mutex_unlock(&e->mu);
        free(r);
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_engine_submit: the engine is stopping");
    }
    /* Full means no free place to run now and no room to wait. */
    const bool full = e->c.active + e->c.queued >= e->opts.max_active + e->opts.max_queued;
    if (!full && e->n_reqs == e->cap_reqs) { /* (room first: nothing of the session is taken yet) */
        int cap = e->cap_reqs ? 2 * e->cap_reqs : 16;
        request **reqs = realloc(e->reqs, (size_t)cap * sizeof *reqs);
        if (!reqs) {
            pthread_mutex_unlock(&e->mu);
            free(r);
            return tl_fail(TL_ERR_NO_MEMORY, "tl_engine_submit: out of memory");
        }
        e->reqs = reqs, e->cap_reqs = cap;
    }
    /* What tl_session_step_batch would refuse fails here, for this request alone: in a
       batch it would fail the call, and with it every running request. The claim first: a
       session some engine holds (this one or another, whose thread may be stepping it) is
       refused without reading anything else of it. A refused or rejected session stays the
       caller's. */
    const char *refusal = tl_session_claim(session) ? NULL : "already submitted to an engine";
    if (!refusal) {
        refusal = tl_session_batch_refusal(session, e->model);
        if (refusal || full) tl_session_unclaim(session);
    }
    const int64_t share = refusal ? 0 : tl_session_max_kv_bytes(session); /* (read once it is ours) */
    const int64_t budget = e->opts.kv_budget_bytes;
    if (!refusal && budget > 0 && share > budget) { /* it would wait for good */
        const tl_generate_config *c = &session->cfg;
        tl_session_unclaim(session);
        pthread_mutex_unlock(&e->mu);
        free(r);
        return tl_fail(TL_ERR_INVALID_ARGUMENT,
                       "tl_engine_submit: the session may hold %.1f MB of K/V (its prompt's and max_tokens' rows%s, at %d "
                       "loops), more than the engine's kv_budget_bytes (%.1f MB): fewer tokens, fewer loops%s, a cache_window "
                       "or an f16 KV cache need less",
                       (double)share / 1048576.0,
                       c->beam_size >= 2 ? ", and every beam's" : c->speculative != TL_SPECULATIVE_OFF ? ", and the drafted ones" : "",
                       session->loops, (double)budget / 1048576.0,
                       c->beam_size >= 2 ? ", a smaller beam" : c->speculative == TL_SPECULATIVE_TREE ? ", fewer tree nodes" : "");
    }
    if (refusal || full) {
        if (!refusal) e->c.rejected++;
        pthread_mutex_unlock(&e->mu);
        free(r);
        return refusal ? tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_engine_submit: the session is %s", refusal) : TL_OK;
    }
    r->id = e->next_id++;
    r->session = session;
    r->kv_share = share;
    r->stats.prompt_tokens_reused = tl_session_stats(session)->prompt_tokens_reused; /* (tl_engine_update) */
    r->logprobs = o.logprobs;
    r->state = TL_ENGINE_QUEUED;
    e->reqs[e->n_reqs++] = r;
    e->c.queued++;
    e->c.submitted++;
    *id = r->id;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->mu);
    return TL_OK;
}

static bool readable(const request *r) {
    return r->pending.len > 0 || r->pending.n_tokens > 0 || r->state == TL_ENGINE_FINISHED;
}

int tl_engine_wait(tl_engine *e, uint64_t id, int timeout_ms) {
    if (!e || inherited(e)) return -1;
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    if (timeout_ms < 0) timeout_ms = 0;
    deadline.tv_sec += timeout_ms / 1000;
    deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;
    int result;
    waiter self = {.next = NULL};
    pthread_cond_init(&self.cond, &e->wait_attr);
    pthread_mutex_lock(&e->mu);
    e->waiters++;
    for (;;) {
        request *r = e->stop ? NULL : find(e, id); /* looked up again after every wake */
        if (!r || r->cancelled) { result = -1; break; }
        if (readable(r)) { result = 1; break; }
        if (timeout_ms == 0) { result = 0; break; } /* a poll: no sleep */
        self.next = r->waiters; /* linked only while asleep */
        r->waiters = &self;
        int rc = pthread_cond_timedwait(&self.cond, &e->mu, &deadline);
        e->c.waiter_wakeups++;
        r = find(e, id); /* gone: unlink_request unlinked every node already */
        for (waiter **p = r ? &r->waiters : NULL; p && *p; p = &(*p)->next)
            if (*p == &self) { *p = self.next; break; }
        if (rc == ETIMEDOUT) {
            r = e->stop ? NULL : r;
            result = !r || r->cancelled ? -1 : readable(r) ? 1 : 0;
            break;
        }
    }
    e->waiters--;
    pthread_mutex_unlock(&e->mu);
    pthread_cond_destroy(&self.cond);
    return result;
}

tl_status tl_engine_read(tl_engine *e, uint64_t id, tl_engine_update *u) {
    tl_clear_error();
    if (!e || !u) return tl_fail_null("tl_engine_read", 2, "engine", (const void *)e, "update", (const void *)u);
    memset(u, 0, sizeof *u);
    if (inherited(e)) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_engine_read: " INHERITED_ENGINE);
    pthread_mutex_lock(&e->mu);
    /* (stopped: gone, as for tl_engine_wait; a stop from a hook left the requests in place
       until the owner's stop or free, which read then found running for good) */
    request *r = e->stop ? NULL : find(e, id);
    if (!r || r->cancelled) {
        const bool stopped = e->stop;
        pthread_mutex_unlock(&e->mu);
        if (stopped) return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_engine_read: the engine has stopped");
        return tl_fail(TL_ERR_INVALID_ARGUMENT, "tl_engine_read: unknown request id %llu", (unsigned long long)id);
    }
    /* Swap, so the engine appends to the old buffer's memory while the reader uses this one. */
    buffer b = r->given;
    r->given = r->pending;
    r->pending = b;
    r->pending.len = 0;
    r->pending.n_tokens = 0;
    u->state = r->state;
    u->text = r->given.text ? r->given.text : "";
    u->text_len = r->given.len;
    u->tokens = r->given.tokens;
    u->n_tokens = r->given.n_tokens;
    if (r->logprobs >= 0) {
        u->logprobs = r->given.logprobs;
        u->top_ids = r->given.top_ids;
        u->top_logprobs = r->given.top_logprobs;
        u->n_top = r->logprobs;
    }
    u->stop_reason = r->stop_reason;
    u->status = r->status;
    /* (r->error is written by finish, under mu, until the request finishes: read it only then) */
    u->error = r->state == TL_ENGINE_FINISHED ? r->error : "";
    /* (before: what the pool gave its prompt, final from admission on; the rest is the
       session's, which the engine thread writes meanwhile) */
    if (r->state == TL_ENGINE_FINISHED) u->stats = r->stats;
    else u->stats.prompt_tokens_reused = r->stats.prompt_tokens_reused;
    pthread_mutex_unlock(&e->mu);
    return TL_OK;
}

void tl_engine_cancel(tl_engine *e, uint64_t id) {
    if (!e || inherited(e)) return;
    pthread_mutex_lock(&e->mu);
    request *r = e->stop ? NULL : find(e, id), *gone = NULL; /* (stopped: a no-op, the counters kept) */
    if (r && !r->cancelled) {
        if (r->state == TL_ENGINE_FINISHED) {
            unlink_request(e, r);
            gone = r;
        } else if (r->state == TL_ENGINE_QUEUED) {
            e->c.queued--;
            e->c.cancelled++;
            unlink_request(e, r);
            gone = r;
        } else {
            /* Running: the engine thread may be stepping it; it drops it between steps, and a
               step that searches within itself (beam search) leaves early. */
            r->cancelled = true;
            atomic_store(&r->session->stop_requested, true);
            e->c.cancelled++;
            pthread_cond_signal(&e->work);
            wake(r); /* (removed requests woke theirs in unlink_request) */
        }
    }
    if (gone) e->cancels_freeing++;
    pthread_mutex_unlock(&e->mu);
    if (!gone) return;
    free_request(gone); /* (a queued one's session too: the engine never held it) */
    pthread_mutex_lock(&e->mu);
    e->cancels_freeing--;
    pthread_mutex_unlock(&e->mu);
}

void tl_engine_get_counters(tl_engine *e, tl_engine_counters *c) {
    if (!c) return;
    if (!e) { /* (zeros, as tl_model_get_memory's for NULL: a caller's struct was left unwritten) */
        memset(c, 0, sizeof *c);
        return;
    }
    if (!inherited(e)) {
        pthread_mutex_lock(&e->mu);
    } else if (pthread_mutex_trylock(&e->mu) != 0) { /* (held at the fork, for good: not waited for) */
        *c = e->c; /* as the fork found them, the requests not counted */
        c->finished_held = 0;
        return;
    }
    *c = e->c;
    /* (counted here, from the requests in hand: a finished one stays until its caller's cancel,
       and one cancelled while it ran, finished by the step in flight, is dropped at the loop's
       top) */
    c->finished_held = 0;
    for (int i = 0; i < e->n_reqs; i++)
        c->finished_held += e->reqs[i]->state == TL_ENGINE_FINISHED && !e->reqs[i]->cancelled;
    pthread_mutex_unlock(&e->mu);
}

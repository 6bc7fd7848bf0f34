/* cuda_backend.c: the CUDA backend (engine/src/backend.h), host side, built into the plugin
 * libtinyloop-cuda.so (engine/src/backend_plugin.h) with the kernels of kernels.cu.
 *
 * Every operation queues its kernels on the legacy default stream in call order and returns
 * without waiting; the host waits only where a result comes back: the logits (head), one
 * double (state_change, exit_gate). Small host inputs (token ids, positions, the attention's
 * resolved key table, the tree mask) are copied into page-locked staging blocks and travel
 * from there in stream-ordered allocations (cudaMallocAsync) freed after their kernels, so
 * concurrent forwards on one model share no scratch and no copy reads a caller's array after
 * the call returns.
 *
 * Errors. The operations return nothing (backend.h), so a CUDA failure (out of device
 * memory, a lost device) is remembered in the context and turns the next logits into NaN:
 * the session then stops with its non-finite-logits error instead of emitting garbage. */
#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../engine/src/backend_plugin.h"
#include "../engine/src/kv_cache.h"
#include "launch.h"

static tl_backend_host host;

/* Page-locked host memory that small inputs travel from (upload_async). A block is reused
   once `copied`, recorded on the stream after the last copy out of it, has completed; `busy`
   marks it held by a thread between taking it and recording that event. */
typedef struct staging_block {
    void *host;
    size_t size;
    cudaEvent_t copied;
    bool busy;
} staging_block;
#define STAGING_BLOCKS 64
#define STAGING_MIN_BYTES ((size_t)64 << 10)

typedef struct cuda_context {
    int device;
    double *inv_freq;      /* device [head_dim / 2] */
    void **weights;        /* device allocations of upload_weights */
    int n_weights;
    atomic_int failed;     /* a CUDA call failed: the next logits are NaN */
    char failure[256];     /* the first failure, for the log line */
    pthread_mutex_t failure_lock;
    staging_block staging[STAGING_BLOCKS];
    int n_staging, staging_next; /* blocks made; where the next search starts */
    pthread_mutex_t staging_lock;
} cuda_context;

static cuda_context *ctx_of(const tl_model *m) { return m->backend_ctx; }

/* Remembers a failed CUDA call (the first one's text is kept). */
static void note(const tl_model *m, int err, const char *what) {
    if (!err) return;
    cuda_context *ctx = ctx_of(m);
    if (atomic_exchange(&ctx->failed, 1) == 0) {
        pthread_mutex_lock(&ctx->failure_lock);
        snprintf(ctx->failure, sizeof ctx->failure, "%s: %s", what, cudaGetErrorString((cudaError_t)err));
        pthread_mutex_unlock(&ctx->failure_lock);
        fprintf(stderr, "tinyloop: CUDA backend: %s (the logits of this model are NaN from now on)\n", ctx->failure);
    }
}

static tlk_matrix kernel_matrix(const tl_matrix *w) {
    const int dtype = w->dtype == TL_F16 ? TLK_F16 : w->dtype == TL_BF16 ? TLK_BF16 : w->dtype == TL_Q8 ? TLK_Q8
                    : w->dtype == TL_Q4 ? TLK_Q4 : TLK_F32;
    return (tlk_matrix){w->data, w->scale, dtype, w->rows, w->cols};
}

/* A failure handled where it happens (an allocation refused, then reported as out of
   memory) must leave this thread's last error clear: the kernel launchers read it
   (launched() in kernels.cu), and a stale one would mark the model failed for good at its
   next launch (note()). Sticky errors, a lost device, stay whatever is cleared. */
static void forget_error(void) { (void)cudaGetLastError(); }

/* cudaMalloc, after giving back what the device's default pool keeps (cuda_open makes it
   keep what upload_async and the head free): memory held there cannot serve a cudaMalloc,
   so a refusal trims the pool, once its queued frees are done, and tries again. */
static cudaError_t device_malloc(void **p, size_t bytes) {
    cudaError_t err = cudaMalloc(p, bytes);
    if (err == cudaErrorMemoryAllocation) {
        forget_error();
        int device;
        cudaMemPool_t pool;
        if (cudaGetDevice(&device) == cudaSuccess && cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess &&
            cudaDeviceSynchronize() == cudaSuccess && cudaMemPoolTrimTo(pool, 0) == cudaSuccess)
            err = cudaMalloc(p, bytes);
    }
    if (err != cudaSuccess) forget_error();
    return err;
}

/* Whether the copies queued before `copied` was recorded are done. A query answered "not
   ready" is no failure: it is cleared from this thread's last error, which the kernel
   launchers read (launched() in kernels.cu) and would otherwise report as one. */
static bool staging_done(cudaEvent_t copied) {
    const cudaError_t st = cudaEventQuery(copied);
    if (st == cudaErrorNotReady) forget_error();
    return st == cudaSuccess;
}

/* A staging block of at least `bytes` whose earlier copies are done, marked busy; NULL when
   every block is busy or none can be made (the caller then copies synchronously). Blocks are
   taken in turn, so the next idle one is the one whose copy was queued longest ago: while
   the device is behind, a new block is made, up to STAGING_BLOCKS, then the host waits. */
static staging_block *staging_take(cuda_context *ctx, size_t bytes) {
    pthread_mutex_lock(&ctx->staging_lock);
    int at = -1;
    for (int i = 0; i < ctx->n_staging && at < 0; i++) {
        const int j = (ctx->staging_next + i) % ctx->n_staging;
        if (!ctx->staging[j].busy) at = j;
    }
    bool fresh = false;
    if (!(at >= 0 && ctx->staging[at].size >= bytes && staging_done(ctx->staging[at].copied)) &&
        ctx->n_staging < STAGING_BLOCKS) {
        staging_block *b = &ctx->staging[ctx->n_staging];
        *b = (staging_block){0};
        if (cudaEventCreateWithFlags(&b->copied, cudaEventDisableTiming) == cudaSuccess) {
            at = ctx->n_staging++;
            fresh = true;
        } else {
            forget_error(); /* the older blocks, or a synchronous copy, serve */
        }
    }
    staging_block *found = at >= 0 ? &ctx->staging[at] : NULL;
    if (found) {
        found->busy = true;
        ctx->staging_next = at + 1;
    }
    pthread_mutex_unlock(&ctx->staging_lock);
    if (!found) return NULL;
    /* A block that is not fresh may still be read by a queued copy: wait for it (at once when
       its event has completed, as checked above). */
    bool ok = fresh || cudaEventSynchronize(found->copied) == cudaSuccess;
    if (ok && found->size < bytes) {
        size_t size = STAGING_MIN_BYTES;
        while (size < bytes) size *= 2;
        if (found->host) cudaFreeHost(found->host);
        found->host = NULL;
        found->size = 0;
        ok = cudaMallocHost(&found->host, size) == cudaSuccess;
        if (ok) found->size = size;
    }
    if (!ok) {
        forget_error(); /* the caller copies synchronously */
        pthread_mutex_lock(&ctx->staging_lock);
        found->busy = false;
        pthread_mutex_unlock(&ctx->staging_lock);
        return NULL;
    }
    return found;
}

/* A host array copied into a stream-ordered device allocation (freed by release_async). The
   source is the caller's array, valid for the call only, and pageable: cudaMemcpyAsync from
   pageable memory gives no promise about when the source has been read (and may wait for the
   stream to drain). So the bytes go through a page-locked staging block, reused only after
   the event recorded behind the copy; without one the copy is synchronous. */
static void *upload_async(const tl_model *m, const void *src, size_t bytes) {
    cuda_context *ctx = ctx_of(m);
    void *dst = NULL;
    if (!bytes) return NULL;
    int err = (int)cudaMallocAsync(&dst, bytes, 0);
    if (!err) {
        staging_block *b = staging_take(ctx, bytes);
        if (b) {
            memcpy(b->host, src, bytes);
            err = (int)cudaMemcpyAsync(dst, b->host, bytes, cudaMemcpyHostToDevice, 0);
            const int recorded = (int)cudaEventRecord(b->copied, 0);
            if (!err) err = recorded;
            pthread_mutex_lock(&ctx->staging_lock);
            b->busy = false;
            pthread_mutex_unlock(&ctx->staging_lock);
        } else {
            err = (int)cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
        }
        if (err) cudaFreeAsync(dst, 0);
    }
    note(m, err, "uploading a host array");
    return err ? NULL : dst;
}
static void release_async(void *p) {
    if (p) cudaFreeAsync(p, 0);
}

/* ---------------------------------------------------------------- lifetime */

static tl_status cuda_open(const tl_model *m, int n_threads, void **out) {
    (void)n_threads;
    const tl_config *c = &m->cfg;
    if (c->head_dim > TLK_MAX_HEAD)
        return host.fail(TL_ERR_UNSUPPORTED, "backend CUDA: head_dim %d is over the kernels' %d", c->head_dim,
                         TLK_MAX_HEAD);
    cuda_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return host.fail(TL_ERR_NO_MEMORY, "out of memory");
    pthread_mutex_init(&ctx->failure_lock, NULL);
    pthread_mutex_init(&ctx->staging_lock, NULL);
    int err = (int)cudaGetDevice(&ctx->device);
    const size_t half = (size_t)(c->head_dim / 2) + 1;
    if (!err) err = (int)device_malloc((void **)&ctx->inv_freq, half * sizeof(double));
    if (!err) err = (int)cudaMemcpy(ctx->inv_freq, m->rope_inv_freq, half * sizeof(double), cudaMemcpyHostToDevice);
    if (err) {
        forget_error();
        if (ctx->inv_freq) cudaFree(ctx->inv_freq);
        pthread_mutex_destroy(&ctx->failure_lock);
        pthread_mutex_destroy(&ctx->staging_lock);
        free(ctx);
        return host.fail(TL_ERR_UNSUPPORTED, "backend CUDA: %s", cudaGetErrorString((cudaError_t)err));
    }
    /* The stream-ordered allocations (every op's small inputs, cudaMallocAsync) come from the
       device's default pool, whose release threshold is 0: it would hand its memory back to
       the driver at every synchronisation (each token's logits) and map it again on the next
       token. Keep it; advisory, so a failure changes nothing but speed. */
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, ctx->device) == cudaSuccess) {
        uint64_t keep = UINT64_MAX;
        if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess) forget_error();
    } else {
        forget_error();
    }
    *out = ctx;
    return TL_OK;
}

static void cuda_close(void *opaque) {
    cuda_context *ctx = opaque;
    if (!ctx) return;
    cudaDeviceSynchronize(); /* nothing queued may still read what is freed */
    for (int i = 0; i < ctx->n_weights; i++) cudaFree(ctx->weights[i]);
    /* What the default pool kept for this model goes back to the device (another model's
       pool memory is mapped again when it next asks) */
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, ctx->device) != cudaSuccess || cudaMemPoolTrimTo(pool, 0) != cudaSuccess)
        forget_error();
    free(ctx->weights);
    cudaFree(ctx->inv_freq);
    for (int i = 0; i < ctx->n_staging; i++) {
        if (ctx->staging[i].host) cudaFreeHost(ctx->staging[i].host);
        cudaEventDestroy(ctx->staging[i].copied);
    }
    pthread_mutex_destroy(&ctx->failure_lock);
    pthread_mutex_destroy(&ctx->staging_lock);
    free(ctx);
}

static int cuda_threads(const void *ctx) {
    (void)ctx;
    return 1; /* the attention needs no host scratch: its softmax runs online */
}

static void *cuda_alloc(void *opaque, size_t bytes) {
    (void)opaque;
    void *p = NULL;
    if (device_malloc(&p, bytes ? bytes : 1) != cudaSuccess) return NULL;
    if (cudaMemset(p, 0, bytes) != cudaSuccess) {
        forget_error();
        cudaFree(p);
        return NULL;
    }
    return p;
}

static void cuda_free(void *opaque, void *p) {
    (void)opaque;
    if (!p) return;
    cudaDeviceSynchronize(); /* a queued kernel may still use it (cudaFree waits too; explicit) */
    cudaFree(p);
}

/* ---------------------------------------------------------------- weights */

static tl_status keep_weight(cuda_context *ctx, void *p) {
    void **grown = realloc(ctx->weights, (size_t)(ctx->n_weights + 1) * sizeof *grown);
    if (!grown) {
        cudaFree(p);
        return host.fail(TL_ERR_NO_MEMORY, "out of memory");
    }
    ctx->weights = grown;
    ctx->weights[ctx->n_weights++] = p;
    return TL_OK;
}

static tl_status device_copy(cuda_context *ctx, const void *src, size_t bytes, void **out) {
    void *p = NULL;
    cudaError_t err = device_malloc(&p, bytes ? bytes : 1);
    if (err == cudaSuccess && bytes) err = cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice);
    if (err != cudaSuccess) {
        forget_error();
        if (p) cudaFree(p);
        return host.fail(err == cudaErrorMemoryAllocation ? TL_ERR_NO_MEMORY : TL_ERR_UNSUPPORTED,
                         "backend CUDA: copying %zu bytes of weights to the device: %s", bytes, cudaGetErrorString(err));
    }
    *out = p;
    return keep_weight(ctx, p);
}

/* Bytes of a row-major matrix in its stored dtype. */
static size_t matrix_bytes(const tl_matrix *w) {
    const size_t count = (size_t)w->rows * (size_t)w->cols;
    switch (w->dtype) {
    case TL_F32: return count * 4;
    case TL_Q8: return count;
    case TL_Q4: return count / 2;
    default: return count * 2;
    }
}

/* Matrices stay row-major in their stored dtype (f32, f16, bf16, and q8/q4 with their f16
   group scales: the checkpoint's layout, which the kernels read directly). */
static tl_status cuda_upload_weights(const tl_model *m, tl_matrix *const *matrices, int n_matrices,
                                     const float **const *vectors, const int *vector_lens, int n_vectors,
                                     bool keep_mapped) {
    (void)keep_mapped; /* device memory is always a copy */
    cuda_context *ctx = ctx_of(m);
    for (int i = 0; i < n_matrices; i++) {
        tl_matrix *w = matrices[i];
        void *p;
        tl_status st = device_copy(ctx, w->data, matrix_bytes(w), &p);
        if (st != TL_OK) return st;
        w->data = p;
        w->packed = 0;
        if (tl_dtype_quantised(w->dtype)) {
            st = device_copy(ctx, w->scale, (size_t)w->rows * (size_t)(w->cols / TL_QGROUP) * 2, &p);
            if (st != TL_OK) return st;
            w->scale = p;
        }
    }
    for (int i = 0; i < n_vectors; i++) {
        if (!*vectors[i]) continue;
        void *p;
        tl_status st = device_copy(ctx, *vectors[i], (size_t)vector_lens[i] * sizeof(float), &p);
        if (st != TL_OK) return st;
        *vectors[i] = p;
    }
    return TL_OK;
}

/* ---------------------------------------------------------------- the forward's operations */

static void cuda_embed(const tl_model *m, const int32_t *tokens, const int32_t *positions, int n, float *x) {
    const tl_config *c = &m->cfg;
    int32_t *dev_tokens = upload_async(m, tokens, (size_t)n * sizeof *tokens);
    int32_t *dev_positions = upload_async(m, positions, (size_t)n * sizeof *positions);
    if (dev_tokens && dev_positions) {
        const bool learned = c->pos_encoding == TL_POS_LEARNED;
        tlk_matrix pos = kernel_matrix(&m->w.pos_embed);
        if (!learned) pos.data = NULL;
        note(m, tlk_launch_embed(dev_tokens, dev_positions, n, kernel_matrix(&m->w.tok_embed), c->embed_scale, pos, x),
             "embed");
    }
    release_async(dev_tokens);
    release_async(dev_positions);
}

static void cuda_norm(const tl_model *m, const float *x, int n, const float *w, const float *b, float *y) {
    const tl_config *c = &m->cfg;
    note(m, tlk_launch_norm(x, n, c->d_model, c->norm == TL_NORM_LAYERNORM, c->norm_eps, w, b, y), "norm");
}

static void matmul_one(const tl_model *m, const float *x, int n, const tl_matrix *w, const float *bias, bool gelu,
                       float *y) {
    note(m, tlk_launch_matmul(x, n, kernel_matrix(w), bias, gelu, y), "matmul");
}

static void cuda_matmul(const tl_model *m, const float *x, int n, const tl_matrix *w, const float *bias, float *y) {
    matmul_one(m, x, n, w, bias, false, y);
}

static void cuda_matmul_group(const tl_model *m, const float *x, int n, const tl_matmul_out *outs, int count) {
    enum { MOST = 8 };
    if (count > MOST) {
        for (int i = 0; i < count; i++) matmul_one(m, x, n, outs[i].w, outs[i].bias, outs[i].gelu, outs[i].y);
    } else {
        tlk_matrix w[MOST];
        const float *bias[MOST];
        float *y[MOST];
        int gelu[MOST];
        for (int i = 0; i < count; i++) {
            w[i] = kernel_matrix(outs[i].w);
            bias[i] = outs[i].bias;
            y[i] = outs[i].y;
            gelu[i] = outs[i].gelu;
        }
        note(m, tlk_launch_matmul_group(x, n, w, bias, gelu, y, count), "matmul");
    }
    /* SwiGLU: the gate (outs[i]) becomes silu(gate) * up (outs[i + 1]), once both are made. */
    for (int i = 0; i + 1 < count; i++)
        if (outs[i].swiglu)
            note(m, tlk_launch_swiglu(outs[i].y, outs[i + 1].y, (size_t)n * (size_t)outs[i].w->rows), "swiglu");
}

static void cuda_rope(const tl_model *m, float *q, float *k, int n, const int32_t *positions) {
    const tl_config *c = &m->cfg;
    const int interleaved = c->rope_pairing == TL_ROPE_INTERLEAVED;
    int32_t *dev_positions = upload_async(m, positions, (size_t)n * sizeof *positions);
    if (dev_positions) {
        note(m, tlk_launch_rope(q, n, c->n_heads, c->head_dim, interleaved, dev_positions, ctx_of(m)->inv_freq), "rope");
        note(m, tlk_launch_rope(k, n, c->n_kv_heads, c->head_dim, interleaved, dev_positions, ctx_of(m)->inv_freq), "rope");
    }
    release_async(dev_positions);
}

/* Row copies into KV pages, gathered on the host and done by one kernel: each row's K and V
   destination (the cache's page table, copy on write included) and source (rows of a device
   buffer, or other pages). */
typedef struct row_copies {
    void **dst_k, **dst_v; /* f32 rows: this backend's models keep f32 KV (model.c refuses f16) */
    const float **src_k, **src_v;
    int n;
} row_copies;

static bool row_copies_new(const tl_model *m, int most, row_copies *rc, const char *what) {
    *rc = (row_copies){0};
    if (most < 1) most = 1; /* malloc(0) may return NULL */
    void **dst = malloc((size_t)most * 2 * sizeof *dst);
    const float **src = malloc((size_t)most * 2 * sizeof *src);
    if (!dst || !src) {
        note(m, (int)cudaErrorMemoryAllocation, what);
        free(dst);
        free(src);
        return false;
    }
    *rc = (row_copies){dst, dst + most, src, src + most, 0};
    return true;
}

/* One more row, to entry `logical` of `slot`; false (nothing added) when no page can hold it. */
static bool row_copies_add(row_copies *rc, tl_kv_cache *c, int slot, int logical, const float *k, const float *v) {
    if (!host.kv_writable(c, slot, logical, &rc->dst_k[rc->n], &rc->dst_v[rc->n])) return false;
    rc->src_k[rc->n] = k;
    rc->src_v[rc->n] = v;
    rc->n++;
    return true;
}

static void row_copies_run(const tl_model *m, row_copies *rc, int kvd) {
    if (rc->n > 0) {
        const size_t bytes = (size_t)rc->n * sizeof(float *);
        void *dk = upload_async(m, rc->dst_k, bytes), *dv = upload_async(m, rc->dst_v, bytes);
        void *sk = upload_async(m, rc->src_k, bytes), *sv = upload_async(m, rc->src_v, bytes);
        if (dk && dv && sk && sv) note(m, tlk_launch_scatter_rows(dk, dv, sk, sv, rc->n, kvd), "kv rows");
        release_async(dk);
        release_async(dv);
        release_async(sk);
        release_async(sv);
    }
    free(rc->dst_k);
    free(rc->src_k);
}

static void cuda_kv_write(const tl_model *m, tl_kv_cache *c, int slot, int base, const float *k, const float *v,
                          int n) {
    const size_t kvd = (size_t)c->kv_dim;
    row_copies rc;
    if (!row_copies_new(m, n, &rc, "kv write (host memory)")) return;
    for (int t = 0; t < n; t++) row_copies_add(&rc, c, slot, base + t, k + (size_t)t * kvd, v + (size_t)t * kvd);
    row_copies_run(m, &rc, c->kv_dim);
}

static void cuda_kv_move(tl_kv_cache *c, int from, int to) {
    const tl_model *m = c->model;
    row_copies rc;
    if (!row_copies_new(m, c->n_slots, &rc, "kv move (host memory)")) return;
    for (int slot = 0; slot < c->n_slots; slot++) {
        void *k_to, *v_to;
        if (!tl_kv_k(c, slot, from) || !host.kv_writable(c, slot, to, &k_to, &v_to)) continue; /* a slot never reached */
        /* The source looked up once the destination is writable (cpu_kv_move); row_copies_add
           then finds the destination's page private. f32 KV. */
        row_copies_add(&rc, c, slot, to, tl_kv_k(c, slot, from), tl_kv_v(c, slot, from));
    }
    row_copies_run(m, &rc, c->kv_dim);
}

/* The slot entry j is read from (KV sharing by depth, SPEC §2: the CPU's slot_for). */
static int slot_for(const tl_attention_args *a, int j) {
    if (a->loop == 0) return a->slot;
    int depth = a->loop;
    if (j < a->base) {
        const int have = a->cache->depth[tl_kv_row(a->cache, j)];
        if (have < depth) depth = have;
    }
    return a->slot + (depth - 1) * a->slot_stride;
}

/* One chunk: the host resolves the entries (held or not, which slot, where its page is)
   once for all rows and heads; the kernel applies the per-row rules (causal, window, mask). */
static void attention_chunk(const tl_model *m, const tl_attention_args *a) {
    const tl_config *c = &m->cfg;
    const tl_kv_cache *cache = a->cache;
    const int last = a->base + a->n, first = last > cache->capacity ? last - cache->capacity : 0;
    const int entries = last - first;
    const float **keys = malloc((size_t)entries * 2 * sizeof *keys);
    int32_t *entry_pos = malloc((size_t)entries * sizeof *entry_pos);
    if (!keys || !entry_pos) {
        note(m, (int)cudaErrorMemoryAllocation, "attention (host memory)");
        free(keys);
        free(entry_pos);
        return;
    }
    for (int j = first; j < last; j++) {
        const int row = tl_kv_row(cache, j), e = j - first;
        const tl_kv_page *page = cache->logical[row] == j ? tl_kv_page_of(cache, slot_for(a, j), row) : NULL;
        keys[e] = page ? tl_kv_page_row(cache, page->k, row) : NULL; /* f32 KV, as on the host */
        keys[entries + e] = page ? tl_kv_page_row(cache, page->v, row) : NULL;
        entry_pos[e] = cache->pos[row];
    }
    const int mask_width = a->base + a->n - a->mask_start;
    tlk_attention args = {a->q, a->out, a->n, c->n_heads, c->n_kv_heads, c->head_dim, first, last, a->base,
                          cache->window, NULL, NULL, NULL, NULL, NULL, a->mask_start, mask_width};
    void *dev_keys = upload_async(m, keys, (size_t)entries * 2 * sizeof *keys);
    void *dev_pos = upload_async(m, entry_pos, (size_t)entries * sizeof *entry_pos);
    void *dev_row_pos = upload_async(m, a->positions, (size_t)a->n * sizeof *a->positions);
    void *dev_mask = a->mask ? upload_async(m, a->mask, (size_t)a->n * (size_t)mask_width) : NULL;
    args.k = dev_keys;
    args.v = dev_keys ? (const float *const *)dev_keys + entries : NULL;
    args.entry_pos = dev_pos;
    args.positions = dev_row_pos;
    args.mask = dev_mask;
    void *dev_args = upload_async(m, &args, sizeof args);
    if (dev_keys && dev_pos && dev_row_pos && (dev_mask || !a->mask) && dev_args)
        note(m, tlk_launch_attention(dev_args, a->n, c->n_heads, c->head_dim), "attention");
    release_async(dev_args);
    release_async(dev_keys);
    release_async(dev_pos);
    release_async(dev_row_pos);
    release_async(dev_mask);
    free(keys);
    free(entry_pos);
}

static void cuda_attention(const tl_model *m, const tl_attention_args *args, int n_args) {
    for (int i = 0; i < n_args; i++) attention_chunk(m, &args[i]);
}

static void cuda_add_rows(const tl_model *m, float *y, int n, int width, const float *bias) {
    note(m, tlk_launch_add_rows(y, n, width, bias), "add_rows");
}
static void cuda_add(const tl_model *m, float *y, const float *x, size_t count) {
    note(m, tlk_launch_add(y, x, count), "add");
}

/* ---------------------------------------------------------------- the loop */

static void cuda_copy(const tl_model *m, float *dst, const float *src, size_t count) {
    note(m, (int)cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDeviceToDevice, 0), "copy");
}

static void cuda_loop_init(const tl_model *m, const float *x, int n, float *e, float *s) {
    const size_t count = (size_t)n * (size_t)m->cfg.d_model;
    cuda_copy(m, e, x, count);
    if (m->cfg.injection == TL_INJECT_NONE) cuda_copy(m, s, e, count);
    else note(m, (int)cudaMemsetAsync(s, 0, count * sizeof(float), 0), "loop_init");
}

static void cuda_state_init_random(const tl_model *m, float *s, int n, const int32_t *positions, uint64_t seed) {
    const tl_config *c = &m->cfg;
    int32_t *dev_positions = upload_async(m, positions, (size_t)n * sizeof *positions);
    if (dev_positions)
        note(m, tlk_launch_state_init(s, n, c->d_model, dev_positions, seed, (double)c->state_init_std * c->embed_scale),
             "state_init_random");
    release_async(dev_positions);
}

static void cuda_inject(const tl_model *m, const float *s, const float *e, int n, float *cat, float *out) {
    const tl_config *c = &m->cfg;
    const size_t count = (size_t)n * (size_t)c->d_model;
    switch (c->injection) {
    case TL_INJECT_NONE: cuda_copy(m, out, s, count); break;
    case TL_INJECT_ADD: note(m, tlk_launch_inject_add(s, e, out, count), "inject"); break;
    case TL_INJECT_CONCAT:
        note(m, tlk_launch_concat(c->inject_embedding_first ? e : s, c->inject_embedding_first ? s : e, n,
                                  c->d_model, cat),
             "inject");
        matmul_one(m, cat, n, &m->w.inject, m->w.inject_b, false, out);
        break;
    }
}

static void cuda_loop_update(const tl_model *m, float *s, const float *x, const float *u, int n) {
    const tl_config *c = &m->cfg;
    const size_t count = (size_t)n * (size_t)c->d_model;
    note(m, tlk_launch_loop_update(s, x, c->loop_update == TL_UPDATE_REPLACE ? s : u, c->beta, count),
         "loop_update");
    if (c->state_norm) cuda_norm(m, s, n, m->w.state_norm_w, m->w.state_norm_b, s);
}

/* A device value back to the host: the stream's work up to here is done when it returns. */
static bool fetch(const tl_model *m, void *dst, const void *src, size_t bytes) {
    const int err = (int)cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
    note(m, err, "copying a result to the host");
    return !err && !atomic_load(&ctx_of(m)->failed);
}

static double cuda_state_change(const tl_model *m, const float *s_new, const float *s_old) {
    double *sums = NULL, host_sums[2];
    int err = (int)cudaMallocAsync((void **)&sums, 2 * sizeof(double), 0);
    if (!err) err = tlk_launch_change_sums(s_new, s_old, m->cfg.d_model, sums);
    note(m, err, "state_change");
    const bool ok = !err && fetch(m, host_sums, sums, sizeof host_sums);
    release_async(sums);
    if (!ok) return NAN;
    return host_sums[1] > 0.0 ? sqrt(host_sums[0] / host_sums[1]) : INFINITY;
}

static double cuda_exit_gate(const tl_model *m, const float *s) {
    float *logit = NULL, value;
    const int err = (int)cudaMallocAsync((void **)&logit, sizeof(float), 0);
    note(m, err, "exit_gate");
    if (err) return NAN;
    matmul_one(m, s, 1, &m->w.exit_gate, m->w.exit_gate_b, false, logit);
    const bool ok = fetch(m, &value, logit, sizeof value);
    release_async(logit);
    return ok ? 1.0 / (1.0 + exp(-(double)value)) : NAN;
}

/* ---------------------------------------------------------------- the head */

static void cuda_head(const tl_model *m, const float *x, int n, float *normed, float *logits) {
    const tl_config *c = &m->cfg;
    const size_t count = (size_t)n * (size_t)c->vocab_size;
    float *dev_logits = NULL;
    int err = (int)cudaMallocAsync((void **)&dev_logits, count * sizeof(float), 0);
    note(m, err, "head");
    bool ok = false;
    if (!err) {
        const float *in = x;
        if (c->final_norm_at_head) {
            cuda_norm(m, x, n, m->w.final_norm_w, m->w.final_norm_b, normed);
            in = normed;
        }
        matmul_one(m, in, n, &m->w.lm_head, NULL, false, dev_logits);
        ok = fetch(m, logits, dev_logits, count * sizeof(float));
        release_async(dev_logits);
    }
    if (!ok)
        for (size_t i = 0; i < count; i++) logits[i] = NAN;
}

static void cuda_hidden(const tl_model *m, const float *x, int n, float *hidden) {
    const tl_config *c = &m->cfg;
    const size_t count = (size_t)n * (size_t)c->d_model;
    const float *rows = x;
    float *dev_normed = NULL;
    bool ok = false;
    if (c->final_norm_at_head) {
        const int err = (int)cudaMallocAsync((void **)&dev_normed, count * sizeof(float), 0);
        note(m, err, "hidden");
        if (!err) {
            cuda_norm(m, x, n, m->w.final_norm_w, m->w.final_norm_b, dev_normed);
            rows = dev_normed;
        } else {
            rows = NULL;
        }
    }
    if (rows) ok = fetch(m, hidden, rows, count * sizeof(float));
    if (dev_normed) release_async(dev_normed);
    if (!ok)
        for (size_t i = 0; i < count; i++) hidden[i] = NAN;
}

/* ---------------------------------------------------------------- the vtable, the entry */

static const tl_backend cuda_backend = {
    .name = "cuda",
    .open = cuda_open,
    .close = cuda_close,
    .threads = cuda_threads,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .upload_weights = cuda_upload_weights,
    .embed = cuda_embed,
    .norm = cuda_norm,
    .matmul = cuda_matmul,
    .matmul_group = cuda_matmul_group,
    .rope = cuda_rope,
    .kv_write = cuda_kv_write,
    .kv_move = cuda_kv_move,
    .attention = cuda_attention,
    .add_rows = cuda_add_rows,
    .add = cuda_add,
    .loop_init = cuda_loop_init,
    .state_init_random = cuda_state_init_random,
    .inject = cuda_inject,
    .loop_update = cuda_loop_update,
    .copy = cuda_copy,
    .state_change = cuda_state_change,
    .exit_gate = cuda_exit_gate,
    .head = cuda_head,
    .hidden = cuda_hidden,
};

__attribute__((visibility("default"))) const tl_backend *tl_cuda_backend_plugin(const tl_backend_host *h, char *why,
                                                                              size_t why_len) {
    if (!h || h->abi != TL_BACKEND_PLUGIN_ABI || h->sizeof_model != sizeof(tl_model) ||
        h->sizeof_config != sizeof(tl_config) || h->sizeof_kv_cache != sizeof(tl_kv_cache) ||
        h->sizeof_backend != sizeof(tl_backend)) {
        snprintf(why, why_len, "%s was built from another TinyLoop tree (its engine structures differ); "
                 "rebuild it with this libtinyloop", TL_CUDA_PLUGIN_FILE);
        return NULL;
    }
    int devices = 0;
    const cudaError_t err = cudaGetDeviceCount(&devices);
    if (err != cudaSuccess || devices < 1) {
        snprintf(why, why_len, "no CUDA device: %s",
                 err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found none");
        return NULL;
    }
    host = *h;
    return &cuda_backend;
}

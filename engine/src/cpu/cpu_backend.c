/* cpu_backend.c: the CPU backend: its context (thread pool, weight region), host-memory
 * buffers, the KV cache writes, and matmul and attention split over the thread pool.
 * The per-row operations are in cpu_rows.c, the weight layout in cpu_weights.c.
 *
 * Work is split only along independent outputs (matrix columns; (row, head) pairs),
 * never along a reduction, so the thread count cannot change any result. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "kernels.h"

/* ---------------------------------------------------------------- lifetime */

/* The largest RoPE table kept (bytes): 8 MiB is 16k positions at head_dim 128. */
#define ROPE_TABLE_MAX ((size_t)8 << 20)

static float *rope_table_new(const tl_model *m) {
    const tl_config *cfg = &m->cfg;
    if (cfg->pos_encoding != TL_POS_ROPE || !m->rope_inv_freq || cfg->max_seq_len <= 0) return NULL;
    const size_t half = (size_t)cfg->head_dim / 2, entries = (size_t)cfg->max_seq_len * half;
    if (entries * 2 * sizeof(float) > ROPE_TABLE_MAX) return NULL;
    float *table = malloc(entries * 2 * sizeof(float));
    if (!table) return NULL; /* computed per call instead */
    for (int32_t pos = 0; pos < cfg->max_seq_len; pos++)
        for (size_t i = 0; i < half; i++)
            tl_cpu_rope_angle(m, pos, (int)i, &table[((size_t)pos * half + i) * 2]);
    return table;
}

static tl_status cpu_open(const tl_model *m, int n_threads, void **out) {
    *out = NULL;
    tl_cpu_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    ctx->rope_table = rope_table_new(m);
    const int threads = n_threads > 0 ? n_threads : tl_pool_cores();
    if (!(ctx->arena = tl_cpu_arena_new())) {
        free(ctx->rope_table);
        free(ctx);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    }
    if (!(ctx->pool = tl_pool_new(threads))) {
        tl_cpu_arena_free(ctx->arena);
        free(ctx->rope_table);
        free(ctx);
        return tl_fail(TL_ERR_NO_MEMORY, "cannot start worker threads");
    }
    *out = ctx;
    return TL_OK;
}

static void cpu_close(void *opaque) {
    tl_cpu_context *ctx = opaque;
    if (!ctx) return;
    tl_pool_free(ctx->pool);
    tl_cpu_release_weights(ctx);
    tl_cpu_arena_free(ctx->arena);
    free(ctx->rope_table);
    free(ctx);
}

static int cpu_threads(const void *opaque) {
    const tl_cpu_context *ctx = opaque;
    return ctx ? tl_pool_threads(ctx->pool) : 1;
}

/* ---------------------------------------------------------------- buffers (host memory) */

static void *cpu_alloc(void *ctx, size_t bytes) {
    return tl_cpu_arena_alloc(ctx ? ((tl_cpu_context *)ctx)->arena : NULL, bytes);
}

static void cpu_free(void *ctx, void *buffer) {
    tl_cpu_arena_release(ctx ? ((tl_cpu_context *)ctx)->arena : NULL, buffer);
}

/* ---------------------------------------------------------------- KV cache */

/* Elements [from, from + count) of a K row and a V row computed in f32 (k and v point at
   element `from`) into the cache rows k_row and v_row (tl_kv_writable) as the cache's type
   keeps them: f16 rounds to nearest even (narrow_f16: the same bits on every ISA). */
static void kv_store(const tl_kernels *kern, const tl_kv_cache *c, void *k_row, void *v_row, const float *k,
                     const float *v, int from, int count) {
    if (c->model->kv_type == TL_KV_F32) {
        memcpy((float *)k_row + from, k, (size_t)count * sizeof(float));
        memcpy((float *)v_row + from, v, (size_t)count * sizeof(float));
        return;
    }
    kern->narrow_f16(k, count, (uint16_t *)k_row + from);
    kern->narrow_f16(v, count, (uint16_t *)v_row + from);
}

/* The forward reserved the rows' pages (tl_kv_reserve): writable finds them in place. A
   page it could not make (out of memory) marks the cache and drops the row. */
static void cpu_kv_write(const tl_model *m, tl_kv_cache *c, int slot, int base, const float *k,
                         const float *v, int n) {
    (void)m;
    const size_t kvd = (size_t)c->kv_dim;
    const tl_kernels *kern = tl_cpu_kernels();
    for (int t = 0; t < n; t++) {
        void *k_row, *v_row;
        if (!tl_kv_writable(c, slot, base + t, &k_row, &v_row)) continue;
        kv_store(kern, c, k_row, v_row, k + (size_t)t * kvd, v + (size_t)t * kvd, 0, c->kv_dim);
    }
}

static void cpu_kv_move(tl_kv_cache *c, int from, int to) {
    for (int slot = 0; slot < c->n_slots; slot++) {
        void *k_to, *v_to;
        if (!tl_kv_k(c, slot, from) || !tl_kv_writable(c, slot, to, &k_to, &v_to)) continue; /* a slot never reached */
        /* The source looked up after the destination was made writable: where both rows sit
           in one shared page, that copied the page and let go of the shared one. */
        memcpy(k_to, tl_kv_k(c, slot, from), c->row_bytes);
        memcpy(v_to, tl_kv_v(c, slot, from), c->row_bytes);
    }
}

/* ---------------------------------------------------------------- matmul */

/* Quantised activations need, a row, k + 8 k / TL_QGROUP bytes at 8 bits (q4 weights) and
   2 k + 8 k / TL_QGROUP at 16 (q8): decode's fit on the stack (a single row up to k = 16384
   at 16 bits); larger chunks take a heap buffer for the call (per call, since two sessions
   may run forwards on one model at the same time). A call's one stack buffer serves all
   the rows it quantises (a job's input and its second phase's), front to back, so that its
   frame stays one buffer deep (the engine thread of a scheduler runs on a default stack). */
enum { Q_STACK_BYTES = 36864 };

typedef struct {
    uint8_t *at;
    size_t left;
} stack_room;

/* `bytes` of the room (from a 64-byte boundary on), or where they do not fit a heap buffer
   returned in *heap too, for the caller to free; NULL when out of memory. */
static void *take_memory(stack_room *room, size_t bytes, void **heap) {
    const size_t whole = (bytes + 63) / 64 * 64;
    *heap = NULL;
    if (whole > room->left) return *heap = malloc(bytes);
    void *at = room->at;
    room->at += whole;
    room->left -= whole;
    return at;
}

/* The width q8/q4 weights multiply their activations at (kernels.h): q4 8-bit rows, q8
   16-bit ones. */
static inline int activation_bits(tl_dtype weights) { return weights == TL_Q8 ? 16 : 8; }

static size_t quantised_bytes(int n, int k, int bits) {
    const size_t vals = (size_t)n * (size_t)k;
    return vals / TL_QGROUP * (sizeof(float) + sizeof(int32_t)) + vals * (size_t)(bits / 8);
}

/* Room for n rows of k inputs quantised to `bits` (tl_cpu_quantize_rows' q, d and sum). */
typedef struct {
    int n, k, bits;
    void *q;      /* [n][k] int8_t (bits 8) or int16_t (bits 16) */
    float *d;     /* [n][k / TL_QGROUP] */
    int32_t *sum; /* [n][k / TL_QGROUP] */
} quantised_rows;

/* The room in mem (quantised_bytes(n, k, bits)), and out's fields of that width pointing at it. */
static quantised_rows quantised_room(int n, int k, int bits, void *mem, tl_qrows *out) {
    const size_t groups = (size_t)n * (size_t)k / TL_QGROUP;
    float *d = mem;
    int32_t *sum = (int32_t *)(d + groups);
    void *q = sum + groups;
    if (bits == 16) { out->q16 = q; out->d16 = d; out->sum16 = sum; }
    else { out->q = q; out->d = d; out->sum = sum; }
    return (quantised_rows){n, k, bits, q, d, sum};
}

/* x quantised to `bits` in mem (quantised_bytes(n, k, bits)), into out's fields of that width. */
static void quantise_input(const float *x, int n, int k, int bits, void *mem, tl_qrows *out) {
    const quantised_rows room = quantised_room(n, k, bits, mem, out);
    tl_cpu_quantize_rows(x, n, k, bits, room.q, room.d, room.sum);
}

/* Inputs [i0, i1) of each row of x [room.n][room.k] into the room, where quantising the
   whole rows would put them: a product's input quantised piece by piece by the tasks that
   computed it. i0 and i1 are on whole groups (the tasks' cuts: cut_panels, the head-cut
   check; a q8/q4 input width is a multiple of TL_QGROUP, checked at load). */
static void quantise_columns(const quantised_rows *room, const float *x, int i0, int i1) {
    const size_t groups = (size_t)room->k / TL_QGROUP, width = (size_t)(room->bits / 8);
    for (size_t r = 0; r < (size_t)room->n; r++) {
        const size_t at = r * (size_t)room->k + (size_t)i0, group = r * groups + (size_t)i0 / TL_QGROUP;
        tl_cpu_quantize_rows(x + at, 1, i1 - i0, room->bits, (uint8_t *)room->q + at * width, room->d + group,
                             room->sum + group);
    }
}

/* A group's products (tl_backend.matmul_group) are the tasks of one parallel region:
   product i owns tasks [first_task[i], first_task[i + 1]), each a run of whole panels. A
   SwiGLU gate's tasks also compute the same columns of the up projection after it, which
   then owns no task of its own.
   A small group (a decode row's q, k and v) is instead cut into one task per thread across
   its products ("spanning"): each task is a run of the group's panels in order, so a
   thread claims one task per region rather than one per product (each claim, and each
   start of a kernel on a cold stream, cost about a microsecond where a region's work is
   a few). Which task computes a column never changes its value. */
enum { GROUP_MAX = 4 };

typedef struct {
    const float *x;
    const float *tiles; /* x arranged for the kernels' multi-row tiles (arrange_group_input), or NULL */
    float *arrange_out; /* where each task also arranges its columns of outs[0]'s output, the
                           input of a second phase (arranged_output), or NULL */
    tl_dtype arrange_dt; /* the second phase's weights' type, with arrange_out */
    const quantised_rows *quantise_out; /* where each task also quantises its columns of outs[0]'s
                                           output for a second phase of q8/q4 weights
                                           (quantised_output), or NULL */
    int cut_panels; /* outs[0]'s tasks start on a multiple of this many panels: 1, or a
                       group's (TL_QGROUP / TL_PANEL) with quantise_out, so that each task
                       quantises whole groups */
    const tl_qrows *xq; /* x quantised, for q8/q4 weights */
    const tl_matmul_out *outs;
    int count;
    int n;
    int first_task[GROUP_MAX + 1];
    int cols_per_task[GROUP_MAX];
    /* Spanning: span_tasks > 0 tasks share span_units, a panel of product i weighing
       unit_weight[i] (2 for a gate with its up projection, 0 for that up projection).
       Balanced (one task per thread, sized by the pool's shares): task t takes units
       [span_first[t], span_first[t + 1]). */
    int span_tasks, span_units;
    int unit_weight[GROUP_MAX];
    bool balanced;
    int span_first[TL_POOL_SHARE_THREADS + 1];
    const tl_kernels *kern;
} matmul_job;

/* Columns [o0, o1) of one product. */
static void product_columns(const matmul_job *j, const tl_matmul_out *out, int o0, int o1) {
    const tl_matrix *w = out->w;
    if (tl_dtype_quantised(w->dtype)) {
        if (w->packed) j->kern->qmatmul_packed(j->xq, j->n, w->cols, w->data, w->dtype, out->bias, o0, o1, out->y, w->rows);
        else tl_qmatmul_rowmajor(j->xq, j->n, w->cols, w, out->bias, o0, o1, out->y, w->rows);
    } else if (w->packed && j->tiles) {
        j->kern->matmul_packed_arranged(j->x, j->tiles, j->n, w->cols, w->data, w->dtype, out->bias, o0, o1, out->y,
                                        w->rows);
    } else {
        (w->packed ? j->kern->matmul_packed : j->kern->matmul)(j->x, j->n, w->cols, w->data, w->dtype,
                                                               out->bias, o0, o1, out->y, w->rows);
    }
}

/* A SwiGLU gate (outs[i].swiglu) with its up projection, the product after it. */
static inline bool swiglu_pair(const tl_matmul_out *outs, int i, int count) {
    return outs[i].swiglu && i + 1 < count;
}

/* Columns [o0, o1) of product i (with its up projection when i is a SwiGLU gate), then
   the activation while the columns are still in cache, on the thread that made them. */
static void product_task(const matmul_job *j, int i, int o0, int o1) {
    const tl_matmul_out *out = &j->outs[i];
    const size_t width = (size_t)out->w->rows;
    product_columns(j, out, o0, o1);
    const bool swiglu = swiglu_pair(j->outs, i, j->count);
    if (swiglu) product_columns(j, out + 1, o0, o1);
    for (int r = 0; r < j->n; r++) {
        float *y = out->y + (size_t)r * width + (size_t)o0;
        if (out->gelu) tl_cpu_gelu(y, (size_t)(o1 - o0));
        if (swiglu) tl_cpu_swiglu(y, out[1].y + (size_t)r * width + (size_t)o0, (size_t)(o1 - o0));
    }
    if (j->arrange_out && i == 0) j->kern->arrange_rows(out->y, j->n, (int)width, j->arrange_dt, o0, o1, j->arrange_out);
    if (j->quantise_out && i == 0) quantise_columns(j->quantise_out, out->y, o0, o1);
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }

/* Spanning task `task`: units [task U / T, (task + 1) U / T) of the group's panels in
   order; a product's panels are those whose units start in that range (product 0's cuts
   rounded down to whole cut_panels, the same rounding for the tasks on both sides of a
   cut), so the tasks cover each panel exactly once. */
static void span_task(const matmul_job *j, int task) {
    const int unit0 = j->balanced ? j->span_first[task] : (int)((long)task * j->span_units / j->span_tasks);
    const int unit1 = j->balanced ? j->span_first[task + 1] : (int)((long)(task + 1) * j->span_units / j->span_tasks);
    int base = 0; /* the first unit of product i */
    for (int i = 0; i < j->count && base < unit1; i++) {
        const int weight = j->unit_weight[i];
        if (!weight) continue;
        const int rows = j->outs[i].w->rows, panels = tl_panel_count(rows);
        int p0 = unit0 > base ? ceil_div(unit0 - base, weight) : 0;
        int p1 = ceil_div(unit1 - base, weight);
        if (p1 > panels) p1 = panels;
        if (i == 0 && j->cut_panels > 1) { /* the same rounding of each cut for both its tasks */
            p0 = p0 < panels ? p0 / j->cut_panels * j->cut_panels : p0;
            p1 = p1 < panels ? p1 / j->cut_panels * j->cut_panels : p1;
        }
        if (p0 < p1) product_task(j, i, p0 * TL_PANEL, p1 * TL_PANEL < rows ? p1 * TL_PANEL : rows);
        base += panels * weight;
    }
}

static void matmul_task(void *ctx, int task, int thread) {
    (void)thread;
    const matmul_job *j = ctx;
    if (j->span_tasks) {
        span_task(j, task);
        return;
    }
    int i = 0;
    while (task >= j->first_task[i + 1]) i++;
    const int width = j->outs[i].w->rows;
    const int o0 = (task - j->first_task[i]) * j->cols_per_task[i];
    product_task(j, i, o0, o0 + j->cols_per_task[i] < width ? o0 + j->cols_per_task[i] : width);
}

/* The group's input x [n][k] quantised for its q8/q4 products into *qrows: q4 multiplies
   8-bit rows, q8 16-bit ones (kernels.h), and the products of a group share x, so it is
   quantised once per width. The rows go to the stack room or to a heap buffer returned in
   *heap for the caller to free. False when out of memory: the outputs are then NaN,
   nothing sensible being left to compute with. */
static bool quantise_group_input(const float *x, int n, const tl_matmul_out *outs, int count, stack_room *room,
                                 void **heap, tl_qrows *qrows) {
    bool any_q4 = false, any_q8 = false;
    for (int i = 0; i < count; i++) {
        any_q4 = any_q4 || outs[i].w->dtype == TL_Q4;
        any_q8 = any_q8 || outs[i].w->dtype == TL_Q8;
    }
    *heap = NULL;
    if (!any_q4 && !any_q8) return true;
    const int k = outs[0].w->cols;
    const size_t bytes8 = any_q4 ? quantised_bytes(n, k, activation_bits(TL_Q4)) : 0,
                 bytes16 = any_q8 ? quantised_bytes(n, k, activation_bits(TL_Q8)) : 0;
    /* The 16-bit rows first: both parts stay aligned for their elements. */
    uint8_t *mem = take_memory(room, bytes16 + bytes8, heap);
    if (!mem) {
        for (int i = 0; i < count; i++)
            for (size_t e = 0; e < (size_t)n * (size_t)outs[i].w->rows; e++) outs[i].y[e] = NAN;
        return false;
    }
    if (any_q8) quantise_input(x, n, k, 16, mem, qrows);
    if (any_q4) quantise_input(x, n, k, 8, mem + bytes16, qrows);
    return true;
}

/* The group's input x [n][k] arranged for the kernels' multi-row tiles (tl_kernels.
   arrange_rows), once for all of the job's tasks, where a product of the group is a packed
   float matrix and the kernels take such rows: a heap buffer for the caller to free (a
   batch of 16 rows of 3072 inputs is 192 KiB). NULL where they read x as it is, or out of
   memory: the same results either way. */
static bool arranges(const tl_kernels *kern, int n, const tl_matmul_out *outs, int count, tl_dtype *dt) {
    for (int i = 0; kern->arrange_rows && i < count; i++)
        if (outs[i].w->packed && kern->arrange_rows(NULL, n, outs[i].w->cols, outs[i].w->dtype, 0, 0, NULL)) {
            *dt = outs[i].w->dtype;
            return true;
        }
    return false;
}
static float *arrange_group_input(const tl_kernels *kern, const float *x, int n, const tl_matmul_out *outs, int count) {
    tl_dtype dt;
    if (!arranges(kern, n, outs, count, &dt)) return NULL;
    const int k = outs[0].w->cols;
    float *tiles = malloc((size_t)n * (size_t)k * sizeof(float));
    if (tiles) kern->arrange_rows(x, n, k, dt, 0, k, tiles);
    return tiles;
}

/* The buffer in which a first phase's tasks arrange the input of a second phase's product
   `second` (matmul_job.arrange_out), each as it computes its columns, so that the second
   phase's tiles read arranged rows too, without a pass of its own between the phases.
   GPT-2-shaped f16, 8 sessions at two threads: the row-major 8-row tile of the down and
   output projections took 16% of the run at 1.6x the arranged tile's time per multiply-add;
   arranged, the products took 39% of the run where they had taken 41%, +1-2% aggregate
   tokens/s at 8 and 16 sessions (alternated runs, within the VM's drift). NULL where they
   read x as it is, or out of memory: the same results either way. */
static float *arranged_output(const tl_kernels *kern, int n, const tl_matmul_out *second, tl_dtype *dt) {
    if (!arranges(kern, n, second, 1, dt)) return NULL;
    return malloc((size_t)n * (size_t)second->w->cols * sizeof(float));
}

/* Below this many multiply-adds a product is "small" (a decode row's: a few microseconds):
   one task per thread, since every task is a claim on the pool's shared job word. */
#define SMALL_MACS (1L << 21)

/* Columns per task for one product of `macs` multiply-adds: a few tasks per thread
   balance uneven cores on large products; a small one takes one task per thread; tasks
   hold whole runs of `cut` panels of a packed matrix; tiny products stay one task. */
static int columns_per_task(const tl_matrix *w, long macs, int threads, int cut) {
    const int tasks = threads * (macs < SMALL_MACS ? 1 : 4), unit = cut * TL_PANEL;
    int per = (w->rows + tasks - 1) / tasks;
    per = (per + unit - 1) / unit * unit;
    if (per < unit) per = unit;
    if (macs < 32768) per = w->rows;
    return per;
}

/* Where a cut by the pool's shares falls among `units` whole units (panels, KV heads): the
   nearest unit to the shares' running sum. */
static inline int share_cut(float cumulative, int units) { return (int)(cumulative * (float)units + 0.5f); }

/* The group's split into tasks (count <= GROUP_MAX); returns the number of tasks. The
   quantised input (job->xq) is the caller's to set. `share` (or NULL: equal parts) is the
   pool's (tl_pool_shares): a small group spanned one task per thread is then cut by it
   (job->balanced). `quantise_out` (or NULL) is matmul_job's: outs[0]'s tasks then start
   on whole groups. */
static int matmul_job_init(matmul_job *job, const float *x, int n, const tl_matmul_out *outs, int count,
                           int threads, const float *share, const quantised_rows *quantise_out) {
    *job = (matmul_job){.x = x, .outs = outs, .count = count, .n = n, .kern = tl_cpu_kernels(),
                        .quantise_out = quantise_out, .cut_panels = quantise_out ? TL_QGROUP / TL_PANEL : 1};
    long group_macs = 0;
    for (int i = 0; i < count; i++) {
        const tl_matrix *w = outs[i].w;
        const bool pair = swiglu_pair(outs, i, count), paired = i > 0 && swiglu_pair(outs, i - 1, count);
        const long macs = (long)w->rows * w->cols * n * (pair ? 2 : 1);
        job->cols_per_task[i] = columns_per_task(w, macs, threads, i == 0 ? job->cut_panels : 1);
        const int tasks = paired ? 0 : (w->rows + job->cols_per_task[i] - 1) / job->cols_per_task[i];
        job->first_task[i + 1] = job->first_task[i] + tasks;
        job->unit_weight[i] = paired ? 0 : pair ? 2 : 1;
        job->span_units += job->unit_weight[i] * tl_panel_count(w->rows);
        if (!paired) group_macs += macs;
    }
    /* Small products (q, k, v of a decode row; its MLP; its output projection): one
       spanning task per thread, cut by the threads' shares. */
    if (threads > 1 && group_macs < SMALL_MACS && job->first_task[count] > 1)
        job->span_tasks = threads < job->span_units ? threads : job->span_units;
    if (share && job->span_tasks == threads) {
        job->balanced = true;
        float sum = 0.0f;
        job->span_first[0] = 0;
        for (int t = 0; t < threads; t++) {
            sum += share[t];
            int unit = t + 1 == threads ? job->span_units : share_cut(sum, job->span_units);
            if (unit < job->span_first[t]) unit = job->span_first[t];
            if (unit > job->span_units) unit = job->span_units;
            job->span_first[t + 1] = unit;
        }
    }
    return job->span_tasks ? job->span_tasks : job->first_task[count];
}

/* Each thread's fraction of a balanced job's multiply-adds (tl_pool_run_balanced's `work`):
   its units of `first` and of `second` (or NULL), a unit weighing its product's inner
   dimension (a gate's unit already counts its up projection). The cuts as the shares made
   them: rounded to whole groups (cut_panels), a task's work is a panel off at most, which
   the shares' median over a window of jobs absorbs. */
static void balanced_work(const matmul_job *first, const matmul_job *second, float *work) {
    const int threads = first->span_tasks;
    const double k1 = first->outs[0].w->cols, k2 = second ? second->outs[0].w->cols : 0.0;
    const double total = first->span_units * k1 + (second ? second->span_units * k2 : 0.0);
    for (int t = 0; t < threads; t++) {
        double macs = (first->span_first[t + 1] - first->span_first[t]) * k1;
        if (second) macs += (second->span_first[t + 1] - second->span_first[t]) * k2;
        work[t] = (float)(macs / total);
    }
}

void tl_cpu_matmul_group(const tl_model *m, const float *x, int n, const tl_matmul_out *outs, int count) {
    if (count > GROUP_MAX) { /* not from the forward; split rather than fail (pairs stay together) */
        const int head = swiglu_pair(outs, GROUP_MAX - 1, count) ? GROUP_MAX - 1 : GROUP_MAX;
        tl_cpu_matmul_group(m, x, n, outs, head);
        tl_cpu_matmul_group(m, x, n, outs + head, count - head);
        return;
    }
    tl_pool *pool = tl_cpu_pool(m);
    float shares[TL_POOL_SHARE_THREADS];
    matmul_job job;
    const int n_tasks =
        matmul_job_init(&job, x, n, outs, count, tl_pool_threads(pool), tl_pool_shares(pool, shares), NULL);
    _Alignas(64) uint8_t stack[Q_STACK_BYTES];
    stack_room room = {stack, sizeof stack};
    void *heap = NULL;
    tl_qrows qrows = {0};
    if (!quantise_group_input(x, n, outs, count, &room, &heap, &qrows)) return;
    job.xq = &qrows;
    float *tiles = arrange_group_input(job.kern, x, n, outs, count);
    job.tiles = tiles;
    if (job.balanced) {
        float work[TL_POOL_SHARE_THREADS];
        balanced_work(&job, NULL, work);
        tl_pool_run_balanced(pool, n_tasks, n_tasks, matmul_task, &job, work);
    } else {
        tl_pool_run(pool, n_tasks, matmul_task, &job);
    }
    free(tiles);
    free(heap);
}

void tl_cpu_matmul(const tl_model *m, const float *x, int n, const tl_matrix *w,
                   const float *bias, float *y) {
    const tl_matmul_out one = {w, bias, y, false, false};
    tl_cpu_matmul_group(m, x, n, &one, 1);
}

/* A product whose input is another's output as the second phase of the same job
   (tl_pool_run_phased): the MLP's down projection after gate/up, the attention's output
   projection after the heads. The first phase's tasks prepare the second's input as they
   compute it, each its own columns: arranged for float weights' tiles (arranged_output),
   quantised for q8/q4 weights (quantised_output). */

/* Where a first phase's tasks quantise the input of a second phase's q8/q4 product
   `second` (matmul_job.quantise_out), each its own columns as it computes them: the
   second phase then reads whole quantised rows with no region of its own and no
   quantisation on the calling thread between the phases (separately, the q4 GPT-2 decode
   spent 17% of the worker's time waiting at two threads). The rows go to the stack room
   or to a heap buffer returned in *heap for the caller to free. False where `second` is
   float or out of memory: the phases then go apart. */
static bool quantised_output(int n, const tl_matmul_out *second, stack_room *stack, void **heap, tl_qrows *view,
                             quantised_rows *room) {
    *heap = NULL;
    const tl_dtype dt = second->w->dtype;
    if (!tl_dtype_quantised(dt)) return false;
    const int k = second->w->cols, bits = activation_bits(dt);
    const size_t bytes = quantised_bytes(n, k, bits);
    void *mem = take_memory(stack, bytes, heap);
    if (!mem) return false;
    *room = quantised_room(n, k, bits, mem, view);
    return true;
}

typedef struct {
    matmul_job first, second;
    int first_tasks;
} matmul_then_job;

static void matmul_then_task(void *ctx, int task, int thread) {
    matmul_then_job *job = ctx;
    if (task < job->first_tasks) matmul_task(&job->first, task, thread);
    else matmul_task(&job->second, task - job->first_tasks, thread);
}

/* cpu_matmul_then's job; false (nothing computed) when out of memory for its quantised
   rows. A frame of its own, so that the separate products' frames do not stack on its
   buffer. */
static __attribute__((noinline)) bool matmul_then_phased(const tl_model *m, const float *x, int n,
                                                         const tl_matmul_out *first, int count,
                                                         const tl_matmul_out *second) {
    _Alignas(64) uint8_t stack[Q_STACK_BYTES];
    stack_room room = {stack, sizeof stack};
    void *heap = NULL, *second_heap = NULL;
    tl_qrows first_q = {0}, second_q = {0};
    quantised_rows second_room;
    const bool quantised_second = tl_dtype_quantised(second->w->dtype);
    if (quantised_second && !quantised_output(n, second, &room, &second_heap, &second_q, &second_room)) return false;
    if (!quantise_group_input(x, n, first, count, &room, &heap, &first_q)) {
        free(second_heap);
        return false;
    }
    tl_pool *pool = tl_cpu_pool(m);
    const int threads = tl_pool_threads(pool);
    float shares[TL_POOL_SHARE_THREADS];
    const float *share = tl_pool_shares(pool, shares);
    matmul_then_job job;
    job.first_tasks = matmul_job_init(&job.first, x, n, first, count, threads, share, quantised_second ? &second_room : NULL);
    const int second_tasks = matmul_job_init(&job.second, first[0].y, n, second, 1, threads, share, NULL);
    job.first.xq = &first_q;
    job.second.xq = &second_q;
    /* The first phase's input arranged up front; the second's by the first's tasks. */
    float *tiles = arrange_group_input(job.first.kern, x, n, first, count);
    job.first.tiles = tiles;
    float *second_tiles = arranged_output(job.first.kern, n, second, &job.first.arrange_dt);
    job.first.arrange_out = second_tiles;
    job.second.tiles = second_tiles;
    /* Both phases cut by the shares: the threads' times teach the pool (the decode MLP is
       most of a small model's token). */
    if (job.first.balanced && job.second.balanced) {
        float work[TL_POOL_SHARE_THREADS];
        balanced_work(&job.first, &job.second, work);
        tl_pool_run_balanced(pool, job.first_tasks + second_tasks, job.first_tasks, matmul_then_task, &job, work);
    } else {
        tl_pool_run_phased(pool, job.first_tasks + second_tasks, job.first_tasks, matmul_then_task, &job);
    }
    free(tiles);
    free(second_tiles);
    free(heap);
    free(second_heap);
    return true;
}

static void cpu_matmul_then(const tl_model *m, const float *x, int n, const tl_matmul_out *first, int count,
                            const tl_matmul_out *second) {
    if (count > GROUP_MAX || !matmul_then_phased(m, x, n, first, count, second)) {
        /* (too many products, or out of memory: the separate ones say so, NaN) */
        tl_cpu_matmul_group(m, x, n, first, count);
        tl_cpu_matmul_group(m, first[0].y, n, second, 1);
    }
}

/* ---------------------------------------------------------------- attention */

typedef struct {
    const tl_model *m;
    const tl_attention_args *args;
    int n_args;
    const int *first_task;     /* [n_args + 1] task index where each chunk's tasks begin */
    int heads_per_task;        /* a task is (chunk, rows, group of this many heads) */
    int rows_per_task;         /* rows of a chunk whose rows share their keys (rows_share_keys) */
    const tl_kernels *kern;
} attention_job;

/* Whether chunk row i may attend to logical entry j, held in physical row `row`. */
static inline bool visible(const tl_attention_args *a, int i, int j, int row, int32_t min_pos) {
    const tl_kv_cache *c = a->cache;
    if (c->logical[row] != j || c->pos[row] < min_pos) return false;
    if (!a->mask) return j < a->base || j - a->base <= i;
    if (j < a->mask_start) return true;
    const size_t width = (size_t)(a->base + a->n - a->mask_start);
    return a->mask[(size_t)i * width + (size_t)(j - a->mask_start)] != 0;
}

static inline int slot_for(const tl_attention_args *a, int j, int row) {
    if (a->loop == 0) return a->slot;
    int depth = a->loop;
    /* KV sharing (SPEC §2): a prefix entry computed at a shallower depth lends its
       deepest slot to every deeper loop. Chunk rows are at the current loop. */
    if (j < a->base) {
        int have = a->cache->depth[row];
        if (have < depth) depth = have;
    }
    return a->slot + (depth - 1) * a->slot_stride;
}

/* The page of the keys being read, kept while consecutive entries stay in it: a page holds
   16 rows of one slot, so most keys skip the page-table lookup. Addresses only: the
   arithmetic (and so every result) is the same as with tl_kv_k / tl_kv_v. */
typedef struct page_cursor { int slot, page; const tl_kv_page *p; } page_cursor;

static inline const tl_kv_page *cursor_page(page_cursor *cur, const tl_kv_cache *c, int slot, int row) {
    const int page = row / TL_KV_PAGE_ROWS;
    if (slot != cur->slot || page != cur->page) {
        cur->slot = slot;
        cur->page = page;
        cur->p = tl_kv_page_of(c, slot, row);
    }
    return cur->p;
}

/* Keys handed to the kernels per call: two KV pages, so a block's key rows stay few
   enough to live on the stack. */
#define ATTENTION_BLOCK 32

/* A walk over the logical entries [first, last) that one chunk row sees: j and its
   physical row advance together (the ring's modulo once per walk, not per key). */
typedef struct key_walk { int j, row; page_cursor cur; } key_walk;

static key_walk walk_start(const tl_kv_cache *c, int first) {
    return (key_walk){first, tl_kv_row(c, first), {-1, -1, NULL}};
}

/* The next (at most ATTENTION_BLOCK) entries that row i sees, from the walk's entry on (in
   logical order; the walk advances past them): the start of their K rows, or V rows when
   `values` (kv_dim elements of the cache's type, every head), and their offsets from
   `first`. Returns how many. */
static int gather_visible(const tl_attention_args *a, int i, int32_t min_pos, int first, int last,
                          bool values, key_walk *w, const void **rows, int *at) {
    const tl_kv_cache *c = a->cache;
    int n = 0;
    for (; w->j < last && n < ATTENTION_BLOCK; w->j++, w->row = w->row + 1 == c->capacity ? 0 : w->row + 1) {
        if (!visible(a, i, w->j, w->row, min_pos)) continue;
        const tl_kv_page *page = cursor_page(&w->cur, c, slot_for(a, w->j, w->row), w->row);
        rows[n] = tl_kv_page_row(c, values ? page->v : page->k, w->row);
        at[n++] = w->j - first;
    }
    return n;
}

/* The rows [i0, i1) x heads [h0, h1) of one chunk that one attention_rows call computes;
   (row i, head h) keeps its scores in slot (i - i0) * (h1 - h0) + (h - h0) of the thread's
   scratch (cache->capacity floats a slot). */
typedef struct attention_group {
    const tl_kernels *kern;
    const tl_attention_args *a;
    int i0, i1, h0, h1;
    int hd, n_heads, group; /* head size, query heads, query heads per KV head */
    int first;              /* the oldest logical entry held: scores are indexed from it */
    float scale;
    float *scores;
    float max_score[TL_ATTENTION_SCORE_SLOTS], sum[TL_ATTENTION_SCORE_SLOTS];
} attention_group;

static inline int score_slot(const attention_group *g, int i, int h) {
    return (i - g->i0) * (g->h1 - g->h0) + (h - g->h0);
}
static inline const float *query(const attention_group *g, int i, int h) {
    return g->a->q + ((size_t)i * (size_t)g->n_heads + (size_t)h) * (size_t)g->hd;
}
static inline float *output(const attention_group *g, int i, int h) {
    return g->a->out + ((size_t)i * (size_t)g->n_heads + (size_t)h) * (size_t)g->hd;
}

/* Rows [r0, r1) x head h over one block of n keys (K rows of head h, or V rows when
   `values`), at offsets `at` from g->first: the first pass stores each score and keeps the
   running maximum; the second weighs the V rows by the softmax of those scores into the
   outputs and keeps the running sum of the weights. The rows are f32 (rows) or f16 (halves:
   an f16 cache, widened in the kernels' registers); the arithmetic is the same either way
   on the widened values (kernels.h). */
static void attend_block(attention_group *g, bool values, int h, const float *const *rows,
                         const uint16_t *const *halves, int n, const int *at, int r0, int r1) {
    const size_t capacity = (size_t)g->a->cache->capacity;
    float block[ATTENTION_BLOCK];
    for (int i = r0; i < r1; i++) {
        const int slot = score_slot(g, i, h);
        float *s_ih = g->scores + (size_t)slot * capacity;
        if (!values) {
            if (halves) g->kern->dots_f16(query(g, i, h), halves, n, g->hd, block);
            else g->kern->dots(query(g, i, h), rows, n, g->hd, block);
            float m_ih = g->max_score[slot];
            for (int b = 0; b < n; b++) {
                const float score = block[b] * g->scale;
                s_ih[at[b]] = score;
                if (score > m_ih) m_ih = score;
            }
            g->max_score[slot] = m_ih;
        } else {
            for (int b = 0; b < n; b++) block[b] = s_ih[at[b]];
            tl_cpu_softmax_weights(block, n, g->max_score[slot]);
            float sum = g->sum[slot];
            for (int b = 0; b < n; b++) sum += block[b];
            g->sum[slot] = sum;
            if (halves) g->kern->axpys_f16(output(g, i, h), block, halves, n, g->hd);
            else g->kern->axpys(output(g, i, h), block, rows, n, g->hd);
        }
    }
}

/* Prefetches into L2 every line that bytes [from, to) of rows[b] touch, for b in [b0, b1):
   from the line the first byte is on. */
static inline void prefetch_rows(const void *const *rows, int b0, int b1, size_t from, size_t to) {
    for (int b = b0; b < b1; b++) {
        const uintptr_t first = ((uintptr_t)rows[b] + from) & ~(uintptr_t)63;
        for (uintptr_t line = first; line < (uintptr_t)rows[b] + to; line += 64) __builtin_prefetch((const void *)line, 0, 2);
    }
}

/* One walk over the entries [from, to) that row `seen_by` sees (every row of [r0, r1)
   sees them too), for rows [r0, r1) and the group's heads, one attend_block per block of
   visible entries and head: each block of K or V rows is gathered once and used for every
   row and head while it sits in L1. */
static void walk_entries(attention_group *g, bool values, int from, int to, int seen_by, int32_t min_pos,
                         int r0, int r1) {
    const tl_attention_args *a = g->a;
    const bool half = a->cache->model->kv_type == TL_KV_F16;
    /* Two blocks' rows and offsets: the next block is gathered before the current one is
       computed, and its rows' bytes for the group's heads prefetched into L2 while the
       current one's dots or axpys run, so that its K or V rows (a few cache lines each, in
       rows of pages) are on their way. Addresses only: the order of the keys, and so every
       result, is the same. GPT-2-small, 512-token prompts, 64 tokens decoded, three rounds
       alternated (tinyloop-bench, tok/s, one thread): f16 64-72 -> 71-79, q4 --pure 126-139
       -> 140-154; 8 sessions at 384 tokens of context (tinyloop-batch-bench, two threads)
       256-273 -> 267-293.
       The prefetches are spread over the heads' computations, a share before each, not
       issued all at once (a block is 32 rows of the group's heads, 16 lines a row for four f32
       heads of 64: hundreds of prefetches in a burst stall on the few outstanding misses a
       core may have, with nothing to overlap).
       Alternated rounds, tinyloop-bench decode tok/s at 1 / 2 threads on the 32 MiB-L3 Zen 4
       EPYC: the shipped model after a 220-token prompt 575-671 -> 689-782 / 1148-1307 ->
       1106-1454 (the noise of that VM); GPT-2-small q4 --pure after 512, 127-169 -> 140-208
       / 188-246 -> 204-279; 8 GPT-2 f16 sessions at 384 tokens of context (tinyloop-batch-bench,
       two threads) 272-274 -> 297-305. */
    const void *blocks[2][ATTENTION_BLOCK];
    int offsets[2][ATTENTION_BLOCK]; /* the block's entries, as offsets from g->first */
    const float *head_rows[ATTENTION_BLOCK];
    const uint16_t *head_halves[ATTENTION_BLOCK];
    const size_t elem = half ? sizeof(uint16_t) : sizeof(float);
    const size_t slice_from = (size_t)(g->h0 / g->group) * (size_t)g->hd * elem;
    const size_t slice_to = (size_t)((g->h1 - 1) / g->group + 1) * (size_t)g->hd * elem;
    key_walk w = walk_start(a->cache, from);
    int cur = 0, n = gather_visible(a, seen_by, min_pos, g->first, to, values, &w, blocks[0], offsets[0]);
    while (n > 0) {
        const void **rows = blocks[cur];
        const int *at = offsets[cur];
        /* (0 once the walk is past `to`) */
        const int n_next = gather_visible(a, seen_by, min_pos, g->first, to, values, &w, blocks[!cur], offsets[!cur]);
        const int heads = g->h1 - g->h0;
        for (int h = g->h0; h < g->h1; h++) {
            const size_t in_row = (size_t)(h / g->group) * (size_t)g->hd;
            if (half)
                for (int b = 0; b < n; b++) head_halves[b] = (const uint16_t *)rows[b] + in_row;
            else
                for (int b = 0; b < n; b++) head_rows[b] = (const float *)rows[b] + in_row;
            const int share = h - g->h0; /* this head's share of the next block's rows */
            prefetch_rows(blocks[!cur], n_next * share / heads, n_next * (share + 1) / heads, slice_from, slice_to);
            attend_block(g, values, h, head_rows, half ? head_halves : NULL, n, at, r0, r1);
        }
        cur = !cur;
        n = n_next;
    }
}

/* Whether a chunk's rows may share their walks over the cache (attention_rows with
   several rows): causal attention with neither a tree mask nor a window, so every row
   sees all that its first row sees, and in the same order. */
static inline bool rows_share_keys(const tl_attention_args *a) {
    return !a->mask && a->cache->window == 0;
}

/* Chunk rows [i0, i1)' attention for heads [h0, h1) (rows x heads at most the slots the
   scratch holds; several rows only where rows_share_keys). Scores, then a max-subtracted
   softmax; each row's loops run over its keys in logical order, so the arithmetic is the
   same whether the row came alone, in a chunk or in a group of rows. A group walks the
   entries its first row sees once for every row and head (each K and V row read once,
   where a row alone re-read them all from L2/L3 for every row of a long prompt), then each
   later row walks its own last few (the causal diagonal), which follow in logical order.
   The visible keys are gathered ATTENTION_BLOCK at a time and handed to the kernels as one
   block (kernels.h: a block gives each key the arithmetic it gets alone). */
static void attention_rows(const tl_model *m, const tl_kernels *kern, const tl_attention_args *a, int i0, int i1,
                           int h0, int h1, int thread) {
    const tl_config *cfg = &m->cfg;
    const tl_kv_cache *c = a->cache;
    /* Logical entries [first, last) are held: the chunk's own rows may have overwritten
       ring rows older than that. */
    const int last = a->base + a->n, first = last > c->capacity ? last - c->capacity : 0;
    attention_group g = {.kern = kern, .a = a, .i0 = i0, .i1 = i1, .h0 = h0, .h1 = h1, .hd = cfg->head_dim,
                         .n_heads = cfg->n_heads, .group = cfg->n_heads / cfg->n_kv_heads, .first = first,
                         .scale = 1.0f / sqrtf((float)cfg->head_dim),
                         .scores = a->scratch + (size_t)thread * (size_t)a->scratch_stride};
    const int slots = (i1 - i0) * (h1 - h0);
    for (int s = 0; s < slots; s++) g.max_score[s] = -INFINITY, g.sum[s] = 0.0f;
    for (int i = i0; i < i1; i++) memset(output(&g, i, h0), 0, (size_t)(h1 - h0) * (size_t)g.hd * sizeof(float));
    /* Two passes: the scores and their maxima, then the softmax-weighted values. */
    for (int values = 0; values < 2; values++) {
        if (i1 - i0 == 1) {
            const int32_t min_pos = c->window > 0 ? a->positions[i0] - c->window + 1 : INT32_MIN;
            walk_entries(&g, values, first, last, i0, min_pos, i0, i1);
            continue;
        }
        /* Row i0 sees the entries before a->base + i0 + 1; row i also those up to its own. */
        const int shared_end = a->base + i0 + 1;
        walk_entries(&g, values, first, shared_end, i0, INT32_MIN, i0, i1);
        for (int i = i0 + 1; i < i1; i++) walk_entries(&g, values, shared_end, a->base + i + 1, i, INT32_MIN, i, i + 1);
    }
    for (int i = i0; i < i1; i++)
        for (int h = h0; h < h1; h++) {
            const float sum = g.sum[score_slot(&g, i, h)], inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            float *out = output(&g, i, h);
            for (int d = 0; d < g.hd; d++) out[d] *= inv;
        }
}

/* Rows of a chunk's row group: rows_per_task where its rows share their keys, one
   otherwise; and the chunk's number of groups. */
static inline int group_rows(const tl_attention_args *a, int rows_per_task) {
    return rows_share_keys(a) ? rows_per_task : 1;
}
static inline int row_groups(const tl_attention_args *a, int rows_per_task) {
    const int rows = group_rows(a, rows_per_task);
    return (a->n + rows - 1) / rows;
}

/* Task = (chunk, group of rows (row_groups), group of heads_per_task heads). */
static void attention_task(void *ctx, int task, int thread) {
    const attention_job *job = ctx;
    int part = 0; /* the chunk this task belongs to (few chunks: a linear search) */
    while (task >= job->first_task[part + 1]) part++;
    task -= job->first_task[part];
    const tl_attention_args *a = &job->args[part];
    const int n_heads = job->m->cfg.n_heads, rows = group_rows(a, job->rows_per_task);
    const int head_groups = (n_heads + job->heads_per_task - 1) / job->heads_per_task;
    const int h0 = task % head_groups * job->heads_per_task, i0 = task / head_groups * rows;
    attention_rows(job->m, job->kern, a, i0, i0 + rows < a->n ? i0 + rows : a->n, h0,
                   h0 + job->heads_per_task < n_heads ? h0 + job->heads_per_task : n_heads, thread);
}

/* Score slots (rows x heads) that every chunk's scratch holds (at least 1). */
static int score_slots_fit(const tl_attention_args *args, int n_args) {
    int fit = TL_ATTENTION_SCORE_SLOTS;
    for (int i = 0; i < n_args; i++) {
        const int holds = args[i].scratch_stride / args[i].cache->capacity;
        if (holds < fit) fit = holds;
    }
    return fit < 1 ? 1 : fit;
}

/* The most heads one attention_rows call may take for one row: at most
   TL_ATTENTION_SCORE_HEADS (a row's heads share its walk), within the scratch. */
static int score_heads_fit(const tl_model *m, const tl_attention_args *args, int n_args) {
    const int n_heads = m->cfg.n_heads, slots = score_slots_fit(args, n_args);
    int fit = n_heads < TL_ATTENTION_SCORE_HEADS ? n_heads : TL_ATTENTION_SCORE_HEADS;
    return fit < slots ? fit : slots;
}

/* Rows a task of a chunk whose rows share their keys takes at most. Prefill of a 1000-token
   prompt on a GPT-2-shaped f16 model, one thread: one row a walk 417-459 tokens/s, groups
   of 4 rows 511-568, of 8 rows 590-680 (16: 586-687, within the drift). */
#define ATTENTION_GROUP_ROWS 8

/* Every (chunk, rows, head group) of every chunk is one task of ONE parallel region: a
   batch of sessions pays one fork/join per layer, not one per session. */
static void cpu_attention(const tl_model *m, const tl_attention_args *args, int n_args) {
    int first_small[17], *first = n_args < 17 ? first_small : malloc(((size_t)n_args + 1) * sizeof(int));
    if (!first) { /* no memory for the index: the chunks one region each */
        for (int i = 0; i < n_args; i++) cpu_attention(m, &args[i], 1);
        return;
    }
    const int n_heads = m->cfg.n_heads, threads = tl_pool_threads(tl_cpu_pool(m));
    /* Heads per task: as many as every chunk's scratch holds scores for, fewer while that
       would leave threads without a task (a decode row has only its heads to share). */
    int per_task = score_heads_fit(m, args, n_args), rows = 0;
    for (int i = 0; i < n_args; i++) rows += args[i].n;
    while (per_task > 1 && (long)rows * ((n_heads + per_task - 1) / per_task) < threads) per_task = (per_task + 1) / 2;
    const int head_groups = (n_heads + per_task - 1) / per_task;
    /* Rows per task where a chunk's rows share their keys: as many as the scratch's slots
       hold with the task's heads, fewer while that would leave a thread without a task. */
    int rows_per_task = score_slots_fit(args, n_args) / per_task; /* >= 1: per_task fits the slots */
    if (rows_per_task > ATTENTION_GROUP_ROWS) rows_per_task = ATTENTION_GROUP_ROWS;
    for (; rows_per_task > 1; rows_per_task--) {
        long tasks = 0;
        for (int i = 0; i < n_args; i++) tasks += row_groups(&args[i], rows_per_task);
        if (tasks * head_groups >= threads) break;
    }
    first[0] = 0;
    for (int i = 0; i < n_args; i++) first[i + 1] = first[i] + row_groups(&args[i], rows_per_task) * head_groups;
    attention_job job = {m, args, n_args, first, per_task, rows_per_task, tl_cpu_kernels()};
    tl_pool_run(tl_cpu_pool(m), first[n_args], attention_task, &job);
    if (first != first_small) free(first);
}

/* ---------------------------------------------------------------- q/k/v and attention, fused */

/* A decode step's attention sub-layer as one parallel region (backend.h qkv_attention):
   a task owns a group of KV heads (with the query heads that read them) and computes
   their q, k and v columns, turns them (RoPE), writes the k and v columns into the
   caches and runs those heads' attention, all on one thread and with nothing shared
   between tasks. Separately these were two regions with RoPE and the cache writes
   between them on the calling thread, about 3 us a layer at two threads where the
   layer's work is 20 (the shipped model).
   The output projection of att follows as the job's second phase (tl_pool_run_phased).
   Every step is the separate operation's own code on a subset of independent outputs
   (columns, heads), so the results are theirs bit for bit. */

/* Rows one fused call takes (decode rows of this many sessions): their cache destinations
   are looked up beforehand, on this thread (a lookup may allocate a page), into arrays on
   the stack. */
#define FUSED_MAX_ROWS 64

typedef struct {
    matmul_job mm;                 /* the q, k, v group */
    const tl_model *m;
    const int32_t *positions;      /* [n], or NULL: no RoPE */
    const tl_attention_args *args;
    int n_args;
    void *const *k_dst, *const *v_dst; /* [n] row i's K and V in chunk i's cache (NULL: dropped) */
    int tasks;                     /* groups of KV heads: the first phase */
    int kv_first[TL_POOL_SHARE_THREADS + 1]; /* task t's KV heads [kv_first[t], kv_first[t + 1]),
                                                where the pool has shares (tasks <= TL_POOL_SHARE_THREADS) */
    int score_heads;               /* heads per attention_rows call */
    const float *att;              /* [n][n_heads * head_dim]: the heads' outputs */
    float *att_tiles;              /* att arranged by the tasks, each its heads (arranged_output), or NULL */
    tl_dtype att_dt;               /* the output projection's weights' type, with att_tiles */
    const quantised_rows *att_quantised; /* att quantised by the tasks, each its heads (quantised_output), or NULL */
    matmul_job out;                /* the output projection of att: the second phase */
} qkv_attention_job;

/* Task t's first KV head of `tasks` equal groups. */
static inline int equal_kv_start(int task, int kv_heads, int tasks) { return task * kv_heads / tasks; }

/* Task t's first KV head: the shares' cut where the job has one, else equal groups. */
static inline int kv_group_start(const qkv_attention_job *j, int task) {
    return j->tasks <= TL_POOL_SHARE_THREADS ? j->kv_first[task] : equal_kv_start(task, j->m->cfg.n_kv_heads, j->tasks);
}

static void qkv_attention_task(void *ctx, int task, int thread) {
    qkv_attention_job *j = ctx;
    if (task >= j->tasks) {
        matmul_task(&j->out, task - j->tasks, thread);
        return;
    }
    const tl_config *c = &j->m->cfg;
    const int hd = c->head_dim, group = c->n_heads / c->n_kv_heads, n = j->mm.n;
    const int g0 = kv_group_start(j, task), g1 = kv_group_start(j, task + 1); /* KV heads */
    const int h0 = g0 * group, h1 = g1 * group;
    const tl_matmul_out *qkv = j->mm.outs;
    product_task(&j->mm, 0, h0 * hd, h1 * hd);
    product_task(&j->mm, 1, g0 * hd, g1 * hd);
    product_task(&j->mm, 2, g0 * hd, g1 * hd);
    if (j->positions) tl_cpu_rope_heads(j->m, qkv[0].y, qkv[1].y, n, j->positions, h0, h1, g0, g1);
    const size_t kvd = (size_t)c->n_kv_heads * (size_t)hd, at = (size_t)g0 * (size_t)hd;
    for (int r = 0; r < n; r++) {
        if (!j->k_dst[r]) continue; /* chunk r is forward row r */
        kv_store(j->mm.kern, j->args[r].cache, j->k_dst[r], j->v_dst[r], qkv[1].y + (size_t)r * kvd + at,
                    qkv[2].y + (size_t)r * kvd + at, (int)at, (g1 - g0) * hd);
    }
    for (int i = 0; i < j->n_args; i++) /* chunk i is forward row i, its only row */
        for (int h = h0; h < h1; h += j->score_heads)
            attention_rows(j->m, j->mm.kern, &j->args[i], 0, 1, h, h + j->score_heads < h1 ? h + j->score_heads : h1, thread);
    if (j->att_tiles) j->mm.kern->arrange_rows(j->att, n, c->n_heads * hd, j->att_dt, h0 * hd, h1 * hd, j->att_tiles);
    if (j->att_quantised) quantise_columns(j->att_quantised, j->att, h0 * hd, h1 * hd);
}

/* The KV heads of `threads` tasks (kv_heads >= threads) into first[0..threads]: by `share`,
   each task the nearest whole heads and at least one, or (share NULL) equal groups,
   task t from head t * kv_heads / threads. False when a task would not start on a panel of
   the k/v columns. */
static bool kv_groups(int kv_heads, int head_dim, int threads, const float *share, int *first) {
    float sum = 0.0f;
    first[0] = 0;
    first[threads] = kv_heads;
    for (int t = 1; t < threads; t++) {
        int g = equal_kv_start(t, kv_heads, threads);
        if (share) {
            sum += share[t - 1];
            const int near = share_cut(sum, kv_heads);
            const int most = kv_heads - (threads - t); /* a head left for each later task */
            g = near < first[t - 1] + 1 ? first[t - 1] + 1 : near > most ? most : near;
        }
        first[t] = g;
        if (g * head_dim % TL_PANEL != 0) return false;
    }
    return true;
}

static bool cpu_qkv_attention(const tl_model *m, const float *h, int n, const tl_matmul_out qkv[3],
                              const int32_t *positions, int write_slot, const tl_attention_args *args,
                              int n_args, const float *att, const tl_matmul_out *o) {
    const tl_config *c = &m->cfg;
    tl_pool *pool = tl_cpu_pool(m);
    const int threads = tl_pool_threads(pool);
    /* Fewer KV heads than threads would leave threads idle: the separate operations split
       finer. */
    if (n > FUSED_MAX_ROWS || c->n_kv_heads < threads) return false;
    /* Decode rows only (one row a chunk, alone or batched): a chunk of several rows
       (verification, short prompts) splits its attention finer as (rows, heads) tasks, each
       walking the cache once for all the rows and heads its scratch holds, where a KV-head
       task walks it once per row for its few heads (a 6-row verification measured 3% slower
       fused). */
    for (int i = 0; i < n_args; i++)
        if (args[i].n > 1) return false;
    /* Task t takes the KV heads nearest its thread's share (tl_pool_shares), at least one,
       else (or on more threads than shares) equal groups; its columns must start on a panel
       of a packed matrix (its q columns then do too: they start at group times its first k
       column). */
    _Alignas(64) uint8_t stack[Q_STACK_BYTES];
    stack_room room = {stack, sizeof stack};
    void *heap = NULL;
    tl_qrows qrows = {0};
    void *k_dst[FUSED_MAX_ROWS], *v_dst[FUSED_MAX_ROWS];
    qkv_attention_job job = {.mm = {.x = h, .xq = &qrows, .outs = qkv, .count = 3, .n = n, .kern = tl_cpu_kernels()},
                             .m = m, .positions = positions, .args = args, .n_args = n_args,
                             .k_dst = k_dst, .v_dst = v_dst, .tasks = threads, .att = att,
                             .score_heads = score_heads_fit(m, args, n_args)};
    float shares[TL_POOL_SHARE_THREADS];
    const float *share = tl_pool_shares(pool, shares);
    if (threads <= TL_POOL_SHARE_THREADS) { /* kv_first's room: by the shares, else equal */
        if (!kv_groups(c->n_kv_heads, c->head_dim, threads, share, job.kv_first) &&
            !kv_groups(c->n_kv_heads, c->head_dim, threads, NULL, job.kv_first))
            return false;
    } else {
        for (int task = 1; task < threads; task++)
            if (equal_kv_start(task, c->n_kv_heads, threads) * c->head_dim % TL_PANEL != 0) return false;
    }
    if (!quantise_group_input(h, n, qkv, 3, &room, &heap, &qrows))
        return false; /* out of memory: the separate operations meet it too, and say so (NaN) */
    float *tiles = arrange_group_input(job.mm.kern, h, n, qkv, 3);
    job.mm.tiles = tiles;
    /* Looked up here, not in the tasks: a lookup may allocate a page (kv_write's way). Each
       chunk is one row, so forward row i is chunk i's. */
    for (int i = 0; i < n_args; i++)
        if (!tl_kv_writable(args[i].cache, write_slot, args[i].base, &k_dst[i], &v_dst[i]))
            k_dst[i] = v_dst[i] = NULL; /* out of memory: the cache is marked, the row dropped */
    /* The output projection as the second phase; for q8/q4 weights where every task's
       heads are whole groups of att, which the tasks quantise (quantised_output), else
       after the job. */
    void *att_heap = NULL;
    tl_qrows att_q = {0};
    quantised_rows att_room;
    bool phased = o != NULL;
    if (phased && tl_dtype_quantised(o->w->dtype)) {
        const int q_columns_per_kv_head = c->n_heads / c->n_kv_heads * c->head_dim;
        for (int task = 1; task < threads && phased; task++)
            phased = kv_group_start(&job, task) * q_columns_per_kv_head % TL_QGROUP == 0;
        phased = phased && quantised_output(n, o, &room, &att_heap, &att_q, &att_room);
        job.att_quantised = phased ? &att_room : NULL;
    }
    int out_tasks = 0;
    if (phased) {
        out_tasks = matmul_job_init(&job.out, att, n, o, 1, threads, share, NULL);
        job.out.xq = &att_q;
        job.att_tiles = arranged_output(job.mm.kern, n, o, &job.att_dt);
        job.out.tiles = job.att_tiles;
    }
    /* Both phases cut for their threads: each thread takes its own task (the heads only
       approach the shares, so this job does not teach the pool). */
    if (!phased || job.out.balanced)
        tl_pool_run_balanced(pool, job.tasks + out_tasks, job.tasks, qkv_attention_task, &job, NULL);
    else
        tl_pool_run_phased(pool, job.tasks + out_tasks, job.tasks, qkv_attention_task, &job);
    free(tiles);
    free(job.att_tiles);
    free(heap);
    free(att_heap);
    if (o && !phased) tl_cpu_matmul_group(m, att, n, o, 1);
    return true;
}

/* ---------------------------------------------------------------- the vtable */

const tl_backend tl_cpu_backend = {
    .name = "cpu",
    .open = cpu_open,
    .close = cpu_close,
    .threads = cpu_threads,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload_weights = tl_cpu_upload_weights,
    .embed = tl_cpu_embed,
    .norm = tl_cpu_norm,
    .matmul = tl_cpu_matmul,
    .matmul_group = tl_cpu_matmul_group,
    .rope = tl_cpu_rope,
    .kv_write = cpu_kv_write,
    .kv_move = cpu_kv_move,
    .attention = cpu_attention,
    .qkv_attention = cpu_qkv_attention,
    .matmul_then = cpu_matmul_then,
    .add_rows = tl_cpu_add_rows,
    .add = tl_cpu_add,
    .loop_init = tl_cpu_loop_init,
    .state_init_random = tl_cpu_state_init_random,
    .inject = tl_cpu_inject,
    .loop_update = tl_cpu_loop_update,
    .copy = tl_cpu_copy,
    .state_change = tl_cpu_state_change,
    .exit_gate = tl_cpu_exit_gate,
    .head = tl_cpu_head,
    .hidden = tl_cpu_hidden,
};

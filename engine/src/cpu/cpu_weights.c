/* cpu_weights.c: the CPU backend's weight layout.
 *
 * Matrices are copied out of the file mapping into one anonymous region backed by
 * transparent huge pages, in the packed panel layout (see tl_matrix): decode streams every
 * weight once per token, and with 4 KiB file pages the hardware prefetchers stop at each
 * page boundary and the TLB misses; panels make several input rows cheap (prefill,
 * speculative verification, beams). Vectors are already f32 host arrays: used in place. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MADV_HUGEPAGE */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu_backend.h"
#include "kernels.h"

/* Bytes of the packed layout: whole panels, the last one zero-padded. */
static size_t packed_bytes(const tl_matrix *x) {
    return (size_t)tl_panel_count(x->rows) * tl_panel_bytes(x->dtype, x->cols);
}

/* Row-major q8/q4 src (the file's layout) -> packed q blocks (kernels.h). The padding rows
   of the last panel stay zero: scale 0, so they contribute nothing (q8's zero is the byte
   128, but a zero scale makes the value irrelevant). */
static void pack_quantised(const tl_matrix *src, uint8_t *dst, int r0, int r1) {
    const tl_dtype dt = src->dtype;
    const size_t groups = (size_t)(src->cols / TL_QGROUP), bb = tl_qblock_bytes(dt);
    const uint8_t *q = src->data, *scales = src->scale;
    for (int r = r0; r < r1; r++) {
        const int lane = r % TL_PANEL;
        for (size_t g = 0; g < groups; g++) {
            uint8_t *blk = dst + ((size_t)(r / TL_PANEL) * groups + g) * bb;
            memcpy(blk + tl_qscale_offset(dt) + 2 * lane, scales + 2 * ((size_t)r * groups + g), 2);
            for (int i = 0; i < TL_QGROUP; i++) {
                const size_t col = g * TL_QGROUP + (size_t)i;
                if (dt == TL_Q8) {
                    blk[(i / 4) * 64 + lane * 4 + i % 4] = (uint8_t)(((const int8_t *)q)[(size_t)r * (size_t)src->cols + col] + 128);
                } else {
                    const uint8_t byte = q[((size_t)r * (size_t)src->cols + col) / 2];
                    const uint8_t u = col % 2 ? byte >> 4 : byte & 15;
                    blk[((i % 16) / 4) * 64 + lane * 4 + i % 4] |= (uint8_t)(i < 16 ? u : u << 4);
                }
            }
        }
    }
}

/* Panels [p0, p1) of one float matrix: each panel written in order, its 16 source rows
   read side by side (the element-at-a-time copy along each row wrote 16 scattered
   streams and was most of a load's time). */
#define DEFINE_PACK_FLOAT(NAME, T)                                                        \
    static void NAME(const tl_matrix *src, uint8_t *dst, int p0, int p1) {                \
        const size_t cols = (size_t)src->cols;                                            \
        for (int p = p0; p < p1; p++) {                                                   \
            const int rows = src->rows - p * TL_PANEL < TL_PANEL ? src->rows - p * TL_PANEL : TL_PANEL; \
            const T *from = (const T *)src->data + (size_t)p * TL_PANEL * cols;           \
            T *panel = (T *)dst + (size_t)p * TL_PANEL * cols;                            \
            for (size_t c = 0; c < cols; c++)                                             \
                for (int lane = 0; lane < rows; lane++) panel[c * TL_PANEL + (size_t)lane] = from[(size_t)lane * cols + c]; \
        }                                                                                 \
    }
DEFINE_PACK_FLOAT(pack_panels_32, uint32_t)
DEFINE_PACK_FLOAT(pack_panels_16, uint16_t)

/* Panels [p0, p1) of row-major src -> packed dst (see tl_matrix). Float data is aligned to
   its element: the loader copies a tensor the file leaves unaligned (model.c). */
static void pack_panels(const tl_matrix *src, uint8_t *dst, int p0, int p1) {
    if (tl_dtype_quantised(src->dtype)) {
        pack_quantised(src, dst, p0 * TL_PANEL, p1 * TL_PANEL < src->rows ? p1 * TL_PANEL : src->rows);
        return;
    }
    (src->dtype == TL_F32 ? pack_panels_32 : pack_panels_16)(src, dst, p0, p1);
}

/* The packing is spread over the pool: a task is up to PACK_PANELS panels of one matrix. */
#define PACK_PANELS 64

typedef struct {
    tl_matrix *const *matrices;
    uint8_t *const *dst;  /* [n_matrices] where each matrix's panels go */
    const int *first_task; /* [n_matrices + 1] */
} pack_job;

static void pack_task(void *ctx, int task, int thread) {
    (void)thread;
    const pack_job *job = ctx;
    int i = 0;
    while (task >= job->first_task[i + 1]) i++;
    const int p0 = (task - job->first_task[i]) * PACK_PANELS, panels = tl_panel_count(job->matrices[i]->rows);
    pack_panels(job->matrices[i], job->dst[i], p0, p0 + PACK_PANELS < panels ? p0 + PACK_PANELS : panels);
}

tl_status tl_cpu_upload_weights(const tl_model *m, tl_matrix *const *matrices, int n_matrices,
                                const float **const *vectors, const int *vector_lens,
                                int n_vectors, bool keep_mapped) {
    (void)vectors;
    (void)vector_lens;
    (void)n_vectors;
    if (keep_mapped) return TL_OK; /* the kernels read the row-major mapping directly */
    tl_cpu_context *ctx = m->backend_ctx;
    size_t total = 0;
    for (int i = 0; i < n_matrices; i++) total += (packed_bytes(matrices[i]) + 63) & ~(size_t)63;
    void *region;
    size_t len;
    uint8_t *at = tl_map_huge(total, &region, &len);
    if (!at) return tl_fail(TL_ERR_NO_MEMORY, "cannot allocate %zu bytes for the weights", total);
    uint8_t **dst = malloc((size_t)n_matrices * sizeof *dst);
    int *first_task = malloc(((size_t)n_matrices + 1) * sizeof *first_task);
    if (!dst || !first_task) {
        free(dst);
        free(first_task);
        munmap(region, len);
        return tl_fail(TL_ERR_NO_MEMORY, "out of memory");
    }
    first_task[0] = 0;
    for (int i = 0; i < n_matrices; i++) {
        dst[i] = at;
        at += (packed_bytes(matrices[i]) + 63) & ~(size_t)63;
        first_task[i + 1] = first_task[i] + (tl_panel_count(matrices[i]->rows) + PACK_PANELS - 1) / PACK_PANELS;
    }
    const pack_job job = {matrices, dst, first_task};
    tl_pool_run(ctx->pool, first_task[n_matrices], pack_task, (void *)&job);
    for (int i = 0; i < n_matrices; i++) {
        matrices[i]->data = dst[i];
        matrices[i]->scale = NULL; /* packed q blocks carry their scales */
        matrices[i]->packed = 1;
    }
    free(dst);
    free(first_task);
    ctx->weights_region = region;
    ctx->weights_region_len = len;
    return TL_OK;
}

void tl_cpu_release_weights(tl_cpu_context *ctx) {
    if (ctx->weights_region) munmap(ctx->weights_region, ctx->weights_region_len);
    ctx->weights_region = NULL;
    ctx->weights_region_len = 0;
}

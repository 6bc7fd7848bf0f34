/* cpu_weights.c: the CPU backend's weight layout.
 *
 * Matrices are copied out of the file mapping into one anonymous region backed by
 * transparent huge pages, in the packed panel layout (see tl_matrix): decode streams every
 * weight once per token, and with 4 KiB file pages the hardware prefetchers stop at each
 * page boundary and the TLB misses; panels make several input rows cheap (prefill,
 * speculative verification, beams). Vectors are already f32 host arrays: used in place. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, MADV_HUGEPAGE */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu_backend.h"

/* Bytes of the packed layout: whole panels, the last one zero-padded. */
static size_t packed_bytes(const tl_matrix *x) {
    size_t panels = ((size_t)x->rows + TL_PANEL - 1) / TL_PANEL;
    return panels * TL_PANEL * (size_t)x->cols * (x->dtype == TL_F32 ? 4u : 2u);
}

/* Row-major src -> packed dst (see tl_matrix). */
static void pack_matrix(const tl_matrix *src, uint8_t *dst) {
    const size_t elem = src->dtype == TL_F32 ? 4u : 2u, cols = (size_t)src->cols;
    const uint8_t *from = src->data;
    for (int r = 0; r < src->rows; r++) {
        const uint8_t *row = from + (size_t)r * cols * elem;
        uint8_t *panel = dst + (size_t)(r / TL_PANEL) * cols * TL_PANEL * elem + (size_t)(r % TL_PANEL) * elem;
        for (size_t c = 0; c < cols; c++) memcpy(panel + c * TL_PANEL * elem, row + c * elem, elem);
    }
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
    const size_t huge = (size_t)2 << 20;
    size_t len = (total + huge - 1) / huge * huge + huge;
    void *region = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (region == MAP_FAILED) return tl_fail(TL_ERR_NO_MEMORY, "cannot allocate %zu bytes for the weights", len);
#ifdef MADV_HUGEPAGE
    madvise(region, len, MADV_HUGEPAGE); /* advisory: without it the copy still works */
#endif
    uint8_t *at = (uint8_t *)(((uintptr_t)region + huge - 1) & ~(uintptr_t)(huge - 1));
    for (int i = 0; i < n_matrices; i++) {
        pack_matrix(matrices[i], at);
        matrices[i]->data = at;
        matrices[i]->packed = 1;
        at += (packed_bytes(matrices[i]) + 63) & ~(size_t)63;
    }
    ctx->weights_region = region;
    ctx->weights_region_len = len;
    return TL_OK;
}

void tl_cpu_release_weights(tl_cpu_context *ctx) {
    if (ctx->weights_region) munmap(ctx->weights_region, ctx->weights_region_len);
    ctx->weights_region = NULL;
    ctx->weights_region_len = 0;
}

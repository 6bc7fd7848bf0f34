/* kernels.h: the CPU inner loops, one implementation per instruction set.
 *
 * Batch invariance rests here: every output element y[r][o] is computed by the same
 * sequence of floating-point operations whatever the number of rows n, the column
 * range, or the tile the element falls in. Tiles only share loads, never partial sums. */
#ifndef TL_CPU_KERNELS_H
#define TL_CPU_KERNELS_H

#include "../dtype.h"
#include "../internal.h"

typedef struct tl_kernels {
    const char *isa; /* "avx2" or "generic" */
    /* y[r*ldy + o] = sum_k x[r*k + i] * W[o*k + i] (+ bias[o]) for r < n, o in [o0, o1).
       W is [*, k] row-major in dtype `dt`; bias may be NULL. */
    void (*matmul)(const float *x, int n, int k, const void *w, tl_dtype dt, const float *bias,
                   int o0, int o1, float *y, int ldy);
    /* The same for a packed matrix (TL_PANEL-row panels): o0 is a multiple of TL_PANEL and
       o1 is one or the matrix's row count. Every output row is computed as
           acc_j = sum over k = j (mod 4), k < (K & ~3), of fma(W[o][k], x[k], acc_j);
           acc_0 += the leftover k in order;  y = (acc_0 + acc_1) + (acc_2 + acc_3) (+ bias)
       by every implementation (the generic one with fmaf), so all of them agree bit for
       bit, whatever the number of rows. */
    void (*matmul_packed)(const float *x, int n, int k, const void *w, tl_dtype dt,
                          const float *bias, int o0, int o1, float *y, int ldy);
    float (*dot)(const float *a, const float *b, int k);
    void (*axpy)(float *y, float a, const float *x, int k); /* y += a * x */
} tl_kernels;

/* Chosen once at first use: AVX-512 (multi-row matmul) or AVX2+FMA+F16C when the CPU has
   them; the environment variable TINYLOOP_ISA=generic|avx2 caps the choice (tests run every
   path: avx2 and avx512 must agree bit for bit). */
const tl_kernels *tl_cpu_kernels(void);

/* Tests only: switch every later computation to these kernels. */
void tl_cpu_use_kernels(const tl_kernels *k);

extern const tl_kernels tl_kernels_generic;
#if defined(__x86_64__)
extern const tl_kernels tl_kernels_avx2;
extern const tl_kernels tl_kernels_avx512; /* bit-identical to avx2, faster on several rows */
#endif

/* out[i] = W[row][i] as f32, for i < cols (row-major or packed). */
void tl_matrix_row_f32(const tl_matrix *m, int row, float *out);
/* Index of element (row, col) in the stored layout. */
static inline size_t tl_matrix_index(const tl_matrix *m, int row, int col) {
    if (!m->packed) return (size_t)row * (size_t)m->cols + (size_t)col;
    return ((size_t)(row / TL_PANEL) * (size_t)m->cols + (size_t)col) * TL_PANEL + (size_t)(row % TL_PANEL);
}

#endif

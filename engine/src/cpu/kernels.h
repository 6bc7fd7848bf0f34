/* kernels.h: the CPU inner loops, one implementation per instruction set.
 *
 * Batch invariance rests here: every output element y[r][o] is computed by the same
 * sequence of floating-point operations whatever the number of rows n, the column
 * range, or the tile the element falls in. Tiles only share loads, never partial sums. */
#ifndef TL_CPU_KERNELS_H
#define TL_CPU_KERNELS_H

#include "../dtype.h"
#include "../internal.h"

/* Activation rows quantised for the q8/q4 matmuls, for n rows of k values (k a multiple of
   TL_QGROUP): q4 weights multiply 8-bit rows, q8 weights 16-bit ones (8-bit activations cost
   q8 more top-1 agreement than its target allows; 16-bit ones cost it nothing measurable).
   q [n][k] in [-qmax, qmax] (int8_t, qmax 127; int16_t, qmax 32767) and, per row and group,
   d [n][k/TL_QGROUP] (x ~ d * q) and sum [n][k/TL_QGROUP] (the sum of the group's q, which
   removes the weights' unsigned offset). A width a matmul does not need stays NULL. */
typedef struct tl_qrows {
    const int8_t *q; /* 8-bit rows, for q4 weights */
    const float *d;
    const int32_t *sum;
    const int16_t *q16; /* 16-bit rows, for q8 weights */
    const float *d16;
    const int32_t *sum16;
} tl_qrows;

/* Quantises each row on its own (so a row's result cannot depend on the others) to `bits`
   8 (q: int8_t) or 16 (q: int16_t): per group, qmax = 2^(bits-1) - 1, d = max|x| / qmax and
   q = round_to_even(x * (qmax / max|x|)) (0 for an all-zero group). One rule: every family's
   tl_kernels.quantize_rows gives its bits (the generic loop in kernels_generic.c spells it out). */
void tl_cpu_quantize_rows(const float *x, int n, int k, int bits, void *q, float *d, int32_t *sum);

/* The packed q8/q4 layout (TL_PANEL-row panels, like the float one): panel p, group g is one
   block of tl_qblock_bytes at data + (p * groups + g) * tl_qblock_bytes, holding
     q8: 8 sub-blocks j of [16 lanes][4 bytes]: byte (j, lane, b) = q[row p*16+lane][32g+4j+b] + 128;
     q4: 4 sub-blocks j of [16 lanes][4 bytes]: low nibble u[..][32g+4j+b], high nibble u[..][32g+16+4j+b];
   then the 16 lanes' f16 scales. One 64-byte load feeds 16 outputs x 4 inputs (VNNI's
   vpdpbusd shape); the +128 makes q8 unsigned for it, and the activations' group sums
   remove the offset again (q4's 8 likewise). */
static inline size_t tl_qblock_bytes(tl_dtype dt) { return dt == TL_Q8 ? 16 * 32 + 32 : 16 * 16 + 32; }
static inline size_t tl_qscale_offset(tl_dtype dt) { return dt == TL_Q8 ? 16 * 32 : 16 * 16; }
/* Bytes of one packed panel (TL_PANEL rows of k inputs) in any weight dtype. */
static inline size_t tl_panel_bytes(tl_dtype dt, int k) {
    if (tl_dtype_quantised(dt)) return (size_t)(k / TL_QGROUP) * tl_qblock_bytes(dt);
    return (size_t)TL_PANEL * (size_t)k * (dt == TL_F32 ? 4u : 2u);
}

/* Row-major q8/q4 (the file's layout, tl_load_options.mmap_weights), portable C with the
   canonical order above: every ISA uses it, so packed and row-major results agree. */
void tl_qmatmul_rowmajor(const tl_qrows *x, int n, int k, const tl_matrix *w, const float *bias,
                         int o0, int o1, float *y, int ldy);

typedef struct tl_kernels {
    const char *isa; /* "generic", "avx2" or "avx512" */
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
    /* The same for a packed q8/q4 matrix (layout below), activations quantised by
       tl_cpu_quantize_rows (q8: 16-bit rows q16/d16; q4: 8-bit rows q/d). Every output is
       computed as
           acc = 0;  for each group g in order:
               isum = sum_i wq[o][32g + i] * xq[r][32g + i]     (exact, in int32)
               acc = fma(scale[o][g] * d[r][g], (float)isum, acc)
           y = acc (+ bias)
       by every implementation (integer sums are exact in any order, and cannot overflow:
       32 x 127 x 32767 and 32 x 8 x 127 are far below 2^31), so they agree bit for bit. */
    void (*qmatmul_packed)(const tl_qrows *x, int n, int k, const void *w, tl_dtype dt,
                           const float *bias, int o0, int o1, float *y, int ldy);
    /* Attention over a block of keys (the visible keys of a KV page or more), one call per
       block rather than per key. Each result is computed as if alone, by every
       implementation:
           dots:  scores[j] = the 8-lane dot of q and keys[j]: lane l = fma over i = l (mod 8),
                  i < (k & ~7), in order; then (l0+l4, l1+l5, l2+l6, l3+l7) = q0..q3,
                  s = (q0 + q2) + (q1 + q3); then s += q[i] * keys[j][i] for the leftover i
           axpys: for j = 0..n-1 in order: y[i] = fma(a[j], x[j][i], y[i]) for i < (k & ~7),
                  y[i] += a[j] * x[j][i] for the rest
       so a row's attention output does not depend on how its keys were blocked. */
    void (*dots)(const float *q, const float *const *keys, int n, int k, float *scores);
    void (*axpys)(float *y, const float *a, const float *const *x, int n, int k);
    /* Optional (NULL in families without): x [n][k] rearranged once for several calls of
       matmul_packed_arranged (a job's tasks) over weights of type dt, into `tiles` of n * k
       floats, in the order the family's multi-row tiles read it; false (nothing written)
       where they would not read it (too few or too many rows, or no such tiles for dt on
       this CPU); with tiles NULL it only answers that. Then
       matmul_packed_arranged(x, tiles, ...) is matmul_packed(x, ...) with the same results,
       bit for bit, reading the tiles' rows from `tiles` (NULL: exactly matmul_packed).
       Rearranging per call would cost the tiles' gain back on a task of a few dozen panels.
       Only inputs [i0, i1) of each row are read and their places in `tiles` written (0, k:
       the whole rows): a product whose input is another's output arranges it piece by
       piece, each task of the first product its own columns (cpu_backend.c). */
    bool (*arrange_rows)(const float *x, int n, int k, tl_dtype dt, int i0, int i1, float *tiles);
    void (*matmul_packed_arranged)(const float *x, const float *tiles, int n, int k, const void *w, tl_dtype dt,
                                   const float *bias, int o0, int o1, float *y, int ldy);
    /* dots and axpys over keys / rows stored as f16 (an f16 KV cache): each element is widened
       exactly in registers (F16C, or tl_f16_to_f32), then the order above, so every result is
       dots' or axpys' on the widened rows, on every implementation (for every half that
       tl_f32_to_f16 writes: F16C quiets a signalling NaN, which the cache never holds). */
    void (*dots_f16)(const float *q, const uint16_t *const *keys, int n, int k, float *scores);
    void (*axpys_f16)(float *y, const float *a, const uint16_t *const *x, int n, int k);
    /* dst[i] = tl_f32_to_f16(src[i]) for i < n (round to nearest even): the f16 KV cache's
       rows, the same bits on every implementation. */
    void (*narrow_f16)(const float *src, int n, uint16_t *dst);
    /* tl_cpu_quantize_rows's rows, the same bits on every implementation. */
    void (*quantize_rows)(const float *x, int n, int k, int bits, void *q, float *d, int32_t *sum);
} tl_kernels;

/* Chosen once at first use: AVX-512 (multi-row matmul; with VNNI and BW, avx512-vnni for
   q8/q4) or AVX2+FMA+F16C when the CPU has them; TINYLOOP_ISA=generic|avx2|avx512 caps the choice (tests run every
   path: avx2 and avx512 must agree bit for bit). */
const tl_kernels *tl_cpu_kernels(void);

/* Whether this CPU runs kernel family k (the rule tl_cpu_kernels chooses by; tests and
   benchmarks ask it before running a family). */
bool tl_cpu_can_run(const tl_kernels *k);

/* Tests only: switch every later computation to these kernels. */
void tl_cpu_use_kernels(const tl_kernels *k);

extern const tl_kernels tl_kernels_generic;
#if defined(__x86_64__)
extern const tl_kernels tl_kernels_avx2;
extern const tl_kernels tl_kernels_avx512; /* bit-identical to avx2, faster on several rows */
extern const tl_kernels tl_kernels_avx512_vnni; /* avx512 with VNNI q8/q4 dot products */
void tl_qmatmul_packed_avx2(const tl_qrows *x, int n, int k, const void *w, tl_dtype dt,
                            const float *bias, int o0, int o1, float *y, int ldy);
void tl_quantize_rows_avx2(const float *x, int n, int k, int bits, void *q, float *d, int32_t *sum);
void tl_qmatmul_packed_vnni(const tl_qrows *x, int n, int k, const void *w, tl_dtype dt,
                            const float *bias, int o0, int o1, float *y, int ldy);
/* The AVX-512 kernels' single row of f16 weights: 1 converts and multiplies 8 lanes at a time
   (two halves of each 16-lane panel), 0 all 16 at once, -1 the CPU's choice (halves on AMD
   family 19h, Zen 4, where 512-bit conversions run at half the rate). The same bits either
   way; for tests and benchmarks. */
void tl_cpu_set_f16_halves(int mode);
/* Whether family k runs a single row of f16 weights in halves now (the AVX-512 ones, by the
   choice above, made if it was not yet): benchmarks print it beside the kernels' name. */
bool tl_cpu_f16_halves(const tl_kernels *k);
/* The AVX-512 kernels' several rows of 16-bit (f16, bf16) weights: 1 in two-panel tiles
   (6 rows and more), 0 in one-panel tiles (4 rows each, the last 5 or 6 whole, or 3, 2, 1
   left), -1 the CPU's choice (one-panel on AMD family 19h). The same bits either way; for
   tests and benchmarks. */
void tl_cpu_set_pair_tiles(int mode);
/* Whether family k runs several rows of 16-bit weights in one-panel tiles now (an AVX-512
   family without the two-panel ones, by the choice above): benchmarks print it. */
bool tl_cpu_one_panel_rows(const tl_kernels *k);
#endif

/* out[i] = W[row][i] as f32, for i < cols (row-major or packed; q8/q4: scale * q). */
void tl_matrix_row_f32(const tl_matrix *m, int row, float *out);
/* Index of element (row, col) in the stored layout. */
static inline size_t tl_matrix_index(const tl_matrix *m, int row, int col) {
    if (!m->packed) return (size_t)row * (size_t)m->cols + (size_t)col;
    return ((size_t)(row / TL_PANEL) * (size_t)m->cols + (size_t)col) * TL_PANEL + (size_t)(row % TL_PANEL);
}

#endif

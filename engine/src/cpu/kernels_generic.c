/* kernels_generic.c: portable C kernels and ISA dispatch. */
#include <stdbool.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "../dtype.h"
#include "kernels.h"

/* ---------------------------------------------------------------- q8 / q4 */

/* Element (lane, i) of a packed q block as a signed integer (q8: q; q4: u - 8). */
static inline int qblock_at(const uint8_t *blk, tl_dtype dt, int lane, int i) {
    if (dt == TL_Q8) return (int)blk[(i / 4) * 64 + lane * 4 + i % 4] - 128;
    const uint8_t byte = blk[((i % 16) / 4) * 64 + lane * 4 + i % 4];
    return (int)(i < 16 ? byte & 15 : byte >> 4) - 8;
}

/* Element (row, col) of a row-major q matrix as a signed integer, and its group's scale. */
static inline int qrow_at(const tl_matrix *m, int row, int col, float *scale) {
    uint16_t h;
    memcpy(&h, (const uint8_t *)m->scale + 2 * ((size_t)row * (size_t)(m->cols / TL_QGROUP) + (size_t)(col / TL_QGROUP)), 2);
    *scale = tl_f16_to_f32(h);
    if (m->dtype == TL_Q8) return ((const int8_t *)m->data)[(size_t)row * (size_t)m->cols + (size_t)col];
    const uint8_t byte = ((const uint8_t *)m->data)[((size_t)row * (size_t)m->cols + (size_t)col) / 2];
    return (int)(col % 2 ? byte >> 4 : byte & 15) - 8;
}

static inline uint16_t read_u16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return h;
}

static void quantize_rows_generic(const float *x, int n, int k, int bits, void *q, float *d, int32_t *sum) {
    const int groups = k / TL_QGROUP, qmax = bits == 16 ? 32767 : 127;
    for (int r = 0; r < n; r++)
        for (int g = 0; g < groups; g++) {
            const size_t at = (size_t)r * (size_t)k + (size_t)g * TL_QGROUP;
            float amax = 0.0f;
            bool finite = true;
            for (int i = 0; i < TL_QGROUP; i++) {
                /* a compare, not fmaxf: GCC calls libm for fmaxf (1.5% of a q4 run's time) */
                const float a = fabsf(x[at + i]);
                amax = a > amax ? a : amax;
                finite &= a <= FLT_MAX; /* (false for inf and NaN) */
            }
            /* A group with an inf or a NaN gives d = NaN (the product is NaN, as with float
               weights, not a finite value that hides a diverged state); one so small that
               qmax / amax overflows (below ~1e-34) is zero (a negligible part, and no
               float-to-int conversion of an infinity, which C leaves undefined). */
            if (!finite || amax < 0x1p-100f) {
                for (int i = 0; i < TL_QGROUP; i++) {
                    if (bits == 16) ((int16_t *)q)[at + i] = 0;
                    else ((int8_t *)q)[at + i] = 0;
                }
                d[(size_t)r * (size_t)groups + (size_t)g] = finite ? 0.0f : NAN;
                sum[(size_t)r * (size_t)groups + (size_t)g] = 0;
                continue;
            }
            const float id = (float)qmax / amax;
            int32_t s = 0;
            for (int i = 0; i < TL_QGROUP; i++) {
                /* Round half to even by the 1.5 * 2^23 trick: plain IEEE adds, so the same
                   bits on every machine (|x * id| <= 32767.x, far below 2^22). */
                const float t = x[at + i] * id;
                int v = (int)((t + 0x1.8p23f) - 0x1.8p23f);
                v = v > qmax ? qmax : v < -qmax ? -qmax : v;
                if (bits == 16) ((int16_t *)q)[at + i] = (int16_t)v;
                else ((int8_t *)q)[at + i] = (int8_t)v;
                s += v;
            }
            d[(size_t)r * (size_t)groups + (size_t)g] = amax / (float)qmax;
            sum[(size_t)r * (size_t)groups + (size_t)g] = s;
        }
}

/* The activations quantised for weights of type dt (kernels.h): element `at + i` as an
   integer, and group `gi`'s d. */
static inline int qx_at(const tl_qrows *x, tl_dtype dt, size_t at, int i) {
    return dt == TL_Q8 ? x->q16[at + (size_t)i] : x->q[at + (size_t)i];
}
static inline float qx_d(const tl_qrows *x, tl_dtype dt, size_t gi) { return dt == TL_Q8 ? x->d16[gi] : x->d[gi]; }

static void qmatmul_packed_generic(const tl_qrows *x, int n, int k, const void *w, tl_dtype dt,
                                   const float *bias, int o0, int o1, float *y, int ldy) {
    const int groups = k / TL_QGROUP;
    const size_t bb = tl_qblock_bytes(dt);
    for (int o = o0; o < o1; o++) {
        const uint8_t *panel = (const uint8_t *)w + (size_t)(o / TL_PANEL) * (size_t)groups * bb;
        const int lane = o % TL_PANEL;
        for (int r = 0; r < n; r++) {
            float acc = 0.0f;
            for (int g = 0; g < groups; g++) {
                const uint8_t *blk = panel + (size_t)g * bb;
                const size_t at = (size_t)r * (size_t)k + (size_t)g * TL_QGROUP, gi = (size_t)r * (size_t)groups + (size_t)g;
                int32_t isum = 0;
                for (int i = 0; i < TL_QGROUP; i++) isum += qblock_at(blk, dt, lane, i) * qx_at(x, dt, at, i);
                const float s = tl_f16_to_f32(read_u16(blk + tl_qscale_offset(dt) + 2 * lane)) * qx_d(x, dt, gi);
                acc = fmaf(s, (float)isum, acc);
            }
            y[(size_t)r * (size_t)ldy + o] = bias ? acc + bias[o] : acc;
        }
    }
}

void tl_qmatmul_rowmajor(const tl_qrows *x, int n, int k, const tl_matrix *w, const float *bias,
                         int o0, int o1, float *y, int ldy) {
    const int groups = k / TL_QGROUP;
    for (int o = o0; o < o1; o++)
        for (int r = 0; r < n; r++) {
            float acc = 0.0f;
            for (int g = 0; g < groups; g++) {
                const size_t at = (size_t)r * (size_t)k + (size_t)g * TL_QGROUP, gi = (size_t)r * (size_t)groups + (size_t)g;
                float scale = 0.0f;
                int32_t isum = 0;
                for (int i = 0; i < TL_QGROUP; i++) isum += qrow_at(w, o, g * TL_QGROUP + i, &scale) * qx_at(x, w->dtype, at, i);
                acc = fmaf(scale * qx_d(x, w->dtype, gi), (float)isum, acc);
            }
            y[(size_t)r * (size_t)ldy + o] = bias ? acc + bias[o] : acc;
        }
}

/* ---------------------------------------------------------------- rows of a matrix */

void tl_matrix_row_f32(const tl_matrix *m, int row, float *out) {
    if (tl_dtype_quantised(m->dtype)) {
        float scale;
        if (!m->packed) {
            for (int i = 0; i < m->cols; i++) {
                const int v = qrow_at(m, row, i, &scale);
                out[i] = scale * (float)v;
            }
            return;
        }
        const size_t bb = tl_qblock_bytes(m->dtype), groups = (size_t)(m->cols / TL_QGROUP);
        const uint8_t *panel = (const uint8_t *)m->data + (size_t)(row / TL_PANEL) * groups * bb;
        for (int i = 0; i < m->cols; i++) {
            const uint8_t *blk = panel + (size_t)(i / TL_QGROUP) * bb;
            scale = tl_f16_to_f32(read_u16(blk + tl_qscale_offset(m->dtype) + 2 * (row % TL_PANEL)));
            out[i] = scale * (float)qblock_at(blk, m->dtype, row % TL_PANEL, i % TL_QGROUP);
        }
        return;
    }
    if (m->packed) {
        for (int i = 0; i < m->cols; i++) out[i] = tl_weight_at(m->data, m->dtype, tl_matrix_index(m, row, i));
        return;
    }
    size_t base = (size_t)row * (size_t)m->cols;
    if (m->dtype == TL_F32) {
        memcpy(out, (const float *)m->data + base, (size_t)m->cols * sizeof(float));
        return;
    }
    for (int i = 0; i < m->cols; i++) out[i] = tl_weight_at(m->data, m->dtype, base + (size_t)i);
}

/* One x row by one row-major W row (mapped weights) in the vector kernels' order
   (kernels_avx2.c's DEFINE_MATMUL, which AVX-512 runs too), so that a result never depends
   on the machine's vector width: 32 running sums acc[j][l] over k in chunks of 32 (element
   i + 8j + l), the 8-chunks left into acc[0], each an fmaf; the lanes' tree
   (a0 + a1) + (a2 + a3); AVX2's horizontal sum (lane l + lane l+4, then (0 + 2) + (1 + 3));
   then the last k % 8 products added in order. (Four scalar sums by k mod 4 made mapped
   generic results differ from AVX2's and AVX-512's.) */
static float dot_weights(const float *x, const void *w, tl_dtype dt, size_t base, int k) {
    const int k32 = k & ~31, k8 = k & ~7;
    float acc[4][8] = {{0}};
    int i = 0;
    for (; i < k32; i += 32)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++) {
                const int at = i + 8 * j + l;
                acc[j][l] = fmaf(tl_weight_at(w, dt, base + (size_t)at), x[at], acc[j][l]);
            }
    for (; i < k8; i += 8)
        for (int l = 0; l < 8; l++) acc[0][l] = fmaf(tl_weight_at(w, dt, base + (size_t)(i + l)), x[i + l], acc[0][l]);
    float lanes[8], halves[4];
    for (int l = 0; l < 8; l++) lanes[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    for (int l = 0; l < 4; l++) halves[l] = lanes[l] + lanes[l + 4];
    float s = (halves[0] + halves[2]) + (halves[1] + halves[3]);
    for (; i < k; i++) s += x[i] * tl_weight_at(w, dt, base + (size_t)i);
    return s;
}

static void matmul_generic(const float *x, int n, int k, const void *w, tl_dtype dt,
                           const float *bias, int o0, int o1, float *y, int ldy) {
    for (int r = 0; r < n; r++)
        for (int o = o0; o < o1; o++) {
            float s = dot_weights(x + (size_t)r * (size_t)k, w, dt, (size_t)o * (size_t)k, k);
            y[(size_t)r * (size_t)ldy + (size_t)o] = bias ? s + bias[o] : s;
        }
}

/* The packed canonical order with fmaf: bit-identical to the vector kernels. */
static void matmul_packed_generic(const float *x, int n, int k, const void *w, tl_dtype dt,
                                  const float *bias, int o0, int o1, float *y, int ldy) {
    const int k4 = k & ~3;
    for (int o = o0; o < o1; o++) {
        const size_t panel = (size_t)(o / TL_PANEL) * (size_t)k * TL_PANEL, lane = (size_t)(o % TL_PANEL);
        for (int r = 0; r < n; r++) {
            const float *xr = x + (size_t)r * (size_t)k;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int i = 0; i < k4; i += 4)
                for (int j = 0; j < 4; j++)
                    acc[j] = fmaf(tl_weight_at(w, dt, panel + (size_t)(i + j) * TL_PANEL + lane), xr[i + j], acc[j]);
            for (int i = k4; i < k; i++)
                acc[0] = fmaf(tl_weight_at(w, dt, panel + (size_t)i * TL_PANEL + lane), xr[i], acc[0]);
            float v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
            y[(size_t)r * (size_t)ldy + o] = bias ? v + bias[o] : v;
        }
    }
}

/* dots and axpys (attention) in the order kernels.h fixes: eight fmaf lanes over k in
   steps of 8, their fixed horizontal tree, then a plain multiply-add tail; for f32 rows and
   for f16 ones (each element widened exactly first). */
#define AS_FLOAT(x) (x)
#define DEFINE_DOTS_GENERIC(NAME, ELEM_T, WIDEN)                                              \
    static void NAME(const float *q, const ELEM_T *const *keys, int n, int k, float *scores) { \
        const int k8 = k & ~7;                                                                \
        for (int j = 0; j < n; j++) {                                                         \
            const ELEM_T *b = keys[j];                                                        \
            float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                         \
            for (int i = 0; i < k8; i += 8)                                                   \
                for (int l = 0; l < 8; l++) lane[l] = fmaf(WIDEN(b[i + l]), q[i + l], lane[l]); \
            float half[4];                                                                    \
            for (int l = 0; l < 4; l++) half[l] = lane[l] + lane[l + 4];                      \
            float s = (half[0] + half[2]) + (half[1] + half[3]);                              \
            for (int i = k8; i < k; i++) s += q[i] * WIDEN(b[i]);                             \
            scores[j] = s;                                                                    \
        }                                                                                     \
    }
#define DEFINE_AXPYS_GENERIC(NAME, ELEM_T, WIDEN)                                             \
    static void NAME(float *y, const float *a, const ELEM_T *const *x, int n, int k) {        \
        const int k8 = k & ~7;                                                                \
        for (int j = 0; j < n; j++) {                                                         \
            for (int i = 0; i < k8; i++) y[i] = fmaf(a[j], WIDEN(x[j][i]), y[i]);             \
            for (int i = k8; i < k; i++) y[i] += a[j] * WIDEN(x[j][i]);                       \
        }                                                                                     \
    }
DEFINE_DOTS_GENERIC(dots_generic, float, AS_FLOAT)
DEFINE_DOTS_GENERIC(dots_f16_generic, uint16_t, tl_f16_to_f32)
DEFINE_AXPYS_GENERIC(axpys_generic, float, AS_FLOAT)
DEFINE_AXPYS_GENERIC(axpys_f16_generic, uint16_t, tl_f16_to_f32)

static void narrow_f16_generic(const float *src, int n, uint16_t *dst) {
    for (int i = 0; i < n; i++) dst[i] = tl_f32_to_f16(src[i]);
}

const tl_kernels tl_kernels_generic = {"generic", matmul_generic, matmul_packed_generic,
                                       qmatmul_packed_generic, dots_generic, axpys_generic,
                                       NULL, NULL, /* rows as they are */
                                       dots_f16_generic, axpys_f16_generic, narrow_f16_generic,
                                       quantize_rows_generic};

static const tl_kernels *chosen;

bool tl_cpu_can_run(const tl_kernels *k) {
    if (k == &tl_kernels_generic) return true;
#if defined(__x86_64__)
    __builtin_cpu_init();
    /* F16C through cpuid (leaf 1, ecx bit 29): clang before 16 has no "f16c" for
       __builtin_cpu_supports, and the fuzzers and the identity tests build with clang. */
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    /* (the AVX-512 kernels use 256-bit EVEX forms too: every AVX-512 CPU since Skylake-SP
       has VL) */
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
    if (k == &tl_kernels_avx2) return avx2;
    if (k == &tl_kernels_avx512) return avx512;
    if (k == &tl_kernels_avx512_vnni)
        return avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
#endif
    return false;
}

void tl_cpu_use_kernels(const tl_kernels *k) { __atomic_store_n(&chosen, k, __ATOMIC_RELEASE); }

const tl_kernels *tl_cpu_kernels(void) {
    const tl_kernels *k = __atomic_load_n(&chosen, __ATOMIC_ACQUIRE);
    if (k) return k;
    k = &tl_kernels_generic;
#if defined(__x86_64__)
    const char *force = getenv("TINYLOOP_ISA");
    const bool generic_only = force && strcmp(force, "generic") == 0;
    const bool avx2_only = force && strcmp(force, "avx2") == 0;
    const bool avx512_only = force && strcmp(force, "avx512") == 0;
    if (!generic_only && tl_cpu_can_run(&tl_kernels_avx2)) {
        k = &tl_kernels_avx2;
        if (!avx2_only && tl_cpu_can_run(&tl_kernels_avx512)) {
            k = &tl_kernels_avx512;
            if (!avx512_only && tl_cpu_can_run(&tl_kernels_avx512_vnni)) k = &tl_kernels_avx512_vnni;
        }
    }
#endif
    __atomic_store_n(&chosen, k, __ATOMIC_RELEASE);
    return k;
}

void tl_cpu_quantize_rows(const float *x, int n, int k, int bits, void *q, float *d, int32_t *sum) {
    tl_cpu_kernels()->quantize_rows(x, n, k, bits, q, d, sum);
}

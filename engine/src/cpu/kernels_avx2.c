/* kernels_avx2.c: AVX2 + FMA + F16C kernels (this file is compiled with -mavx2 -mfma -mf16c
 * and only called after a run-time CPU check).
 *
 * The canonical dot product of one row of x with one row of W: a single 8-lane FMA
 * accumulator over k in steps of 8, a fixed-order horizontal sum, then a scalar tail.
 * Tiles of 2 rows x 4 columns exist only to share loads; each (row, column) still runs
 * exactly that sequence, which is what makes results batch invariant. */
#if defined(__x86_64__)
#include <immintrin.h>

#include "kernels.h"

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_f32(const void *w, size_t i) { return _mm256_loadu_ps((const float *)w + i); }
static inline __m256 load_f16(const void *w, size_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
}
static inline __m256 load_bf16(const void *w, size_t i) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Finishes one (row, column): horizontal sum, then the scalar tail from k8 to k. */
static inline float finish(__m256 acc, const float *xr, const void *w, tl_dtype dt, size_t wbase,
                           int k8, int k) {
    float s = hsum(acc);
    for (int i = k8; i < k; i++) s += xr[i] * tl_weight_at(w, dt, wbase + (size_t)i);
    return s;
}

#define DEFINE_MATMUL(NAME, LOAD, DT)                                                     \
    static void NAME(const float *x, int n, int k, const void *w, const float *bias, int o0, \
                     int o1, float *y, int ldy) {                                         \
        const int k8 = k & ~7;                                                            \
        int o = o0;                                                                       \
        for (; o + 4 <= o1; o += 4) {                                                     \
            const size_t b0 = (size_t)o * (size_t)k, b1 = b0 + (size_t)k,                 \
                         b2 = b1 + (size_t)k, b3 = b2 + (size_t)k;                        \
            int r = 0;                                                                    \
            for (; r + 2 <= n; r += 2) {                                                  \
                const float *xa = x + (size_t)r * (size_t)k, *xb = xa + k;                \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;               \
                __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;                                \
                for (int i = 0; i < k8; i += 8) {                                         \
                    __m256 va = _mm256_loadu_ps(xa + i), vb = _mm256_loadu_ps(xb + i);    \
                    __m256 w0 = LOAD(w, b0 + (size_t)i), w1 = LOAD(w, b1 + (size_t)i);    \
                    __m256 w2 = LOAD(w, b2 + (size_t)i), w3 = LOAD(w, b3 + (size_t)i);    \
                    a0 = _mm256_fmadd_ps(w0, va, a0); c0 = _mm256_fmadd_ps(w0, vb, c0);   \
                    a1 = _mm256_fmadd_ps(w1, va, a1); c1 = _mm256_fmadd_ps(w1, vb, c1);   \
                    a2 = _mm256_fmadd_ps(w2, va, a2); c2 = _mm256_fmadd_ps(w2, vb, c2);   \
                    a3 = _mm256_fmadd_ps(w3, va, a3); c3 = _mm256_fmadd_ps(w3, vb, c3);   \
                }                                                                         \
                float *ya = y + (size_t)r * (size_t)ldy + o, *yb = ya + ldy;              \
                ya[0] = finish(a0, xa, w, DT, b0, k8, k); ya[1] = finish(a1, xa, w, DT, b1, k8, k);           \
                ya[2] = finish(a2, xa, w, DT, b2, k8, k); ya[3] = finish(a3, xa, w, DT, b3, k8, k);           \
                yb[0] = finish(c0, xb, w, DT, b0, k8, k); yb[1] = finish(c1, xb, w, DT, b1, k8, k);           \
                yb[2] = finish(c2, xb, w, DT, b2, k8, k); yb[3] = finish(c3, xb, w, DT, b3, k8, k);           \
            }                                                                             \
            for (; r < n; r++) {                                                          \
                const float *xa = x + (size_t)r * (size_t)k;                              \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;               \
                for (int i = 0; i < k8; i += 8) {                                         \
                    __m256 va = _mm256_loadu_ps(xa + i);                                  \
                    a0 = _mm256_fmadd_ps(LOAD(w, b0 + (size_t)i), va, a0);                \
                    a1 = _mm256_fmadd_ps(LOAD(w, b1 + (size_t)i), va, a1);                \
                    a2 = _mm256_fmadd_ps(LOAD(w, b2 + (size_t)i), va, a2);                \
                    a3 = _mm256_fmadd_ps(LOAD(w, b3 + (size_t)i), va, a3);                \
                }                                                                         \
                float *ya = y + (size_t)r * (size_t)ldy + o;                              \
                ya[0] = finish(a0, xa, w, DT, b0, k8, k); ya[1] = finish(a1, xa, w, DT, b1, k8, k);           \
                ya[2] = finish(a2, xa, w, DT, b2, k8, k); ya[3] = finish(a3, xa, w, DT, b3, k8, k);           \
            }                                                                             \
        }                                                                                 \
        for (; o < o1; o++) {                                                             \
            const size_t b0 = (size_t)o * (size_t)k;                                      \
            for (int r = 0; r < n; r++) {                                                 \
                const float *xa = x + (size_t)r * (size_t)k;                              \
                __m256 a0 = _mm256_setzero_ps();                                          \
                for (int i = 0; i < k8; i += 8)                                           \
                    a0 = _mm256_fmadd_ps(LOAD(w, b0 + (size_t)i), _mm256_loadu_ps(xa + i), a0); \
                y[(size_t)r * (size_t)ldy + o] = finish(a0, xa, w, DT, b0, k8, k);                  \
            }                                                                             \
        }                                                                                 \
        if (bias)                                                                         \
            for (int r = 0; r < n; r++)                                                   \
                for (int oo = o0; oo < o1; oo++) y[(size_t)r * (size_t)ldy + oo] += bias[oo]; \
    }

DEFINE_MATMUL(matmul_f32, load_f32, TL_F32)
DEFINE_MATMUL(matmul_f16, load_f16, TL_F16)
DEFINE_MATMUL(matmul_bf16, load_bf16, TL_BF16)

static void matmul_avx2(const float *x, int n, int k, const void *w, tl_dtype dt,
                        const float *bias, int o0, int o1, float *y, int ldy) {
    switch (dt) {
    case TL_F16: matmul_f16(x, n, k, w, bias, o0, o1, y, ldy); break;
    case TL_BF16: matmul_bf16(x, n, k, w, bias, o0, o1, y, ldy); break;
    default: matmul_f32(x, n, k, w, bias, o0, o1, y, ldy); break;
    }
}

static float dot_avx2(const float *a, const float *b, int k) {
    const int k8 = k & ~7;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < k8; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(b + i), _mm256_loadu_ps(a + i), acc);
    float s = hsum(acc);
    for (int i = k8; i < k; i++) s += a[i] * b[i];
    return s;
}

static void axpy_avx2(float *y, float a, const float *x, int k) {
    const int k8 = k & ~7;
    const __m256 va = _mm256_set1_ps(a);
    for (int i = 0; i < k8; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (int i = k8; i < k; i++) y[i] += a * x[i];
}

const tl_kernels tl_kernels_avx2 = {"avx2", matmul_avx2, dot_avx2, axpy_avx2};
#endif

/* kernels_vnni.c: q4 matmul with AVX512-VNNI (vpdpbusd: 16 lanes x 4 byte products into
 * int32 per instruction). Compiled with -mavx512f -mavx512bw -mavx512vnni -mf16c in a file
 * of its own, so that no other kernel picks up instructions a plain AVX-512 CPU lacks;
 * called only after a run-time CPU check.
 *
 * The packed q block layout (kernels.h) is vpdpbusd's shape: one 64-byte load is 16 output
 * lanes x 4 inputs, multiplied by 4 activation bytes broadcast to every lane. The nibbles
 * are unsigned (as vpdpbusd's first operand must be), so the sum is corrected by 8 x the
 * activations' group sum; integers are exact, and the float steps are kernels.h's canonical
 * ones, so the result is bit-identical to the generic and AVX2 kernels. (q8 multiplies f32
 * activations: kernels_avx512.c.) */
#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#include "avx2_inline.h"

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* R input rows share every weight load. The integer sum of a group runs in two chains
   (even and odd sub-blocks) to halve vpdpbusd's latency chain; integer addition is exact,
   so the split cannot change a bit. */
#define DEFINE_VNNI_ROWS(NAME, R)                                                         \
    static inline void NAME(const tl_qrows *x, int row0, int k, const uint8_t *panel, float *out) { \
        const int groups = k / TL_QGROUP;                                                 \
        const size_t bb = tl_qblock_bytes(TL_Q4);                                         \
        const __m512i low4 = _mm512_set1_epi8(15);                                        \
        __m512 acc[R];                                                                    \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                         \
        for (int g = 0; g < groups; g++) {                                                \
            const uint8_t *blk = panel + (size_t)g * bb;                                  \
            if (R == 1)                                                                   \
                for (size_t p_ = 0; p_ < bb; p_ += 64)                                    \
                    _mm_prefetch((const char *)blk + PREFETCH_AHEAD + p_, _MM_HINT_T0);   \
            __m512i wv[8];                                                                \
            for (int j = 0; j < 4; j++) {                                                 \
                const __m512i v = _mm512_loadu_si512(blk + 64 * j);                       \
                wv[j] = _mm512_and_si512(v, low4);                                        \
                wv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);              \
            }                                                                             \
            const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + tl_qscale_offset(TL_Q4)))); \
            for (int r = 0; r < R; r++) {                                                 \
                const int8_t *xq = x->q + (size_t)(row0 + r) * (size_t)k + (size_t)g * TL_QGROUP; \
                const size_t gi = (size_t)(row0 + r) * (size_t)groups + (size_t)g;        \
                __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();     \
                for (int j = 0; j < 8; j += 2) {                                          \
                    even = _mm512_dpbusd_epi32(even, wv[j], bcast4(xq + 4 * j));          \
                    odd = _mm512_dpbusd_epi32(odd, wv[j + 1], bcast4(xq + 4 * j + 4));    \
                }                                                                         \
                const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(even, odd), _mm512_set1_epi32(8 * x->sum[gi])); \
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(sw, _mm512_set1_ps(x->d[gi])),     \
                                         _mm512_cvtepi32_ps(isum), acc[r]);               \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * TL_PANEL, acc[r]);         \
    }

DEFINE_VNNI_ROWS(q4_r4, 4)
DEFINE_VNNI_ROWS(q4_r2, 2)
DEFINE_VNNI_ROWS(q4_r1, 1)

/* q4 only (q8 goes to the AVX-512 f32 kernel). */
void tl_qmatmul_packed_vnni(const tl_qrows *x, int n, int k, const void *w, tl_dtype dt,
                            const float *bias, int o0, int o1, float *y, int ldy) {
    const size_t panel_bytes = (size_t)(k / TL_QGROUP) * tl_qblock_bytes(dt);
    float out[4 * TL_PANEL];
    for (int o = o0; o < o1; o += TL_PANEL) {
        const uint8_t *panel = (const uint8_t *)w + (size_t)(o / TL_PANEL) * panel_bytes;
        const int lanes = o1 - o < TL_PANEL ? o1 - o : TL_PANEL;
        for (int r = 0; r < n;) {
            const int rows = n - r >= 4 ? 4 : n - r >= 2 ? 2 : 1;
            (rows == 4 ? q4_r4 : rows == 2 ? q4_r2 : q4_r1)(x, r, k, panel, out);
            for (int t = 0; t < rows; t++) {
                float *yr = y + (size_t)(r + t) * (size_t)ldy + o;
                for (int l = 0; l < lanes; l++) yr[l] = bias ? out[t * TL_PANEL + l] + bias[o + l] : out[t * TL_PANEL + l];
            }
            r += rows;
        }
    }
}
#endif

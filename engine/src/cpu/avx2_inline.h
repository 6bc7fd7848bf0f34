/* avx2_inline.h: 256-bit helpers shared by the AVX2 and AVX-512 kernel files (each compiles
 * them with its own target flags). The horizontal sum's order is part of the canonical
 * dot product: both files must use this one. */
#ifndef TL_AVX2_INLINE_H
#define TL_AVX2_INLINE_H

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

#define ELEM(dt) ((dt) == TL_F32 ? 4u : 2u)
/* Software prefetch distance for streaming a single row: the hardware prefetcher alone
   leaves single-row streaming ~15% short of the machine's read bandwidth. */
#define PREFETCH_AHEAD 2048

#endif

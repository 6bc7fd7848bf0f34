/* dtype.h: the checkpoint's scalar types converted to f32, exactly (one definition, used
 * by the loader for vectors and by every CPU kernel for matrices). */
#ifndef TL_DTYPE_H
#define TL_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"

/* f16 -> f32, exact: subnormals, inf and NaN included. Inline: the kernels' scalar tails
   call it per element. */
static inline float tl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);           /* inf / NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);   /* normal: rebias 15 -> 127 */
    } else if (mant == 0) {
        bits = sign;                                        /* zero */
    } else {                                                /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

static inline float tl_bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v = {(uint32_t)b << 16};
    return v.f;
}

/* Element i of an array of dtype `dt`, as f32. */
static inline float tl_weight_at(const void *w, tl_dtype dt, size_t i) {
    switch (dt) {
    case TL_F16: return tl_f16_to_f32(((const uint16_t *)w)[i]);
    case TL_BF16: return tl_bf16_to_f32(((const uint16_t *)w)[i]);
    default: return ((const float *)w)[i];
    }
}

/* Element i of src (dtype dt, not necessarily aligned), as f32. */
static inline float tl_weight_at_unaligned(const void *src, tl_dtype dt, size_t i) {
    const uint8_t *from = src;
    if (dt == TL_F32) {
        float f;
        memcpy(&f, from + 4 * i, sizeof f);
        return f;
    }
    uint16_t h;
    memcpy(&h, from + 2 * i, sizeof h);
    return dt == TL_F16 ? tl_f16_to_f32(h) : tl_bf16_to_f32(h);
}

/* f32 -> f16, round to nearest even (subnormals and inf kept; NaN quieted, its payload's top
   bits kept, as F16C does): quantisation scales, and the rule of an f16 KV cache's kernels. */
uint16_t tl_f32_to_f16(float f);

/* out[i] = src[i] as f32 for i < count; src need not be aligned for its type. */
void tl_convert_to_f32(const void *src, tl_dtype dt, size_t count, float *out);

/* Index of the first element of src[0..count) that is NaN or +-inf (exponent bits all ones),
   or count when every element is finite; src need not be aligned. */
size_t tl_first_nonfinite(const void *src, tl_dtype dt, size_t count);

#endif

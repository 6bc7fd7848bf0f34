/* dtype.c: scalar conversions of the checkpoint dtypes (see dtype.h). */
#include <string.h>

#include "dtype.h"

void tl_convert_to_f32(const void *src, tl_dtype dt, size_t count, float *out) {
    const uint8_t *from = src;
    if (dt == TL_F32) {
        memcpy(out, from, count * sizeof(float)); /* memcpy: the data may be unaligned */
        return;
    }
    for (size_t i = 0; i < count; i++) {
        uint16_t h;
        memcpy(&h, from + 2 * i, sizeof h);
        out[i] = dt == TL_F16 ? tl_f16_to_f32(h) : tl_bf16_to_f32(h);
    }
}

size_t tl_first_nonfinite(const void *src, tl_dtype dt, size_t count) {
    const uint8_t *from = src;
    if (dt == TL_F32) {
        for (size_t i = 0; i < count; i++) {
            uint32_t u;
            memcpy(&u, from + 4 * i, sizeof u);
            if ((u & 0x7f800000u) == 0x7f800000u) return i;
        }
        return count;
    }
    const uint16_t exp = dt == TL_F16 ? 0x7c00 : 0x7f80;
    for (size_t i = 0; i < count; i++) {
        uint16_t h;
        memcpy(&h, from + 2 * i, sizeof h);
        if ((h & exp) == exp) return i;
    }
    return count;
}

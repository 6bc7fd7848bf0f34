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

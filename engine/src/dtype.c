/* dtype.c: scalar conversions of the checkpoint dtypes (see dtype.h). */
#include <stdbool.h>
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

/* Whether element i of src is non-finite (all exponent bits set: inf or NaN). */
static inline bool nonfinite_at(const uint8_t *from, tl_dtype dt, size_t i) {
    if (dt == TL_F32) {
        uint32_t u;
        memcpy(&u, from + 4 * i, sizeof u);
        return (u & 0x7f800000u) == 0x7f800000u;
    }
    const uint16_t exp = dt == TL_F16 ? 0x7c00 : 0x7f80;
    uint16_t h;
    memcpy(&h, from + 2 * i, sizeof h);
    return (h & exp) == exp;
}

/* Blocks of elements OR their flags in a loop without an exit, which the compiler
   vectorises (the early-exit scan ran at 2 GB/s: 40% of loading GPT-2 small); only a block
   with a hit is searched element by element. */
#define SCAN_BLOCK 4096

size_t tl_first_nonfinite(const void *src, tl_dtype dt, size_t count) {
    const uint8_t *from = src;
    for (size_t start = 0; start < count; start += SCAN_BLOCK) {
        const size_t end = count - start < SCAN_BLOCK ? count : start + SCAN_BLOCK;
        unsigned any = 0;
        /* One loop per dtype, each with the dtype a constant, so that each vectorises. */
        if (dt == TL_F32)
            for (size_t i = start; i < end; i++) any |= nonfinite_at(from, TL_F32, i);
        else if (dt == TL_F16)
            for (size_t i = start; i < end; i++) any |= nonfinite_at(from, TL_F16, i);
        else
            for (size_t i = start; i < end; i++) any |= nonfinite_at(from, TL_BF16, i);
        if (!any) continue;
        for (size_t i = start; i < end; i++)
            if (nonfinite_at(from, dt, i)) return i;
    }
    return count;
}

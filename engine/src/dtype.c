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

uint16_t tl_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    /* inf; a NaN quieted with its payload's top bits, as F16C's vcvtps2ph does (the f16 KV
       cache's kernels narrow with it, and must give these bits) */
    if (a >= 0x7f800000u) return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u | ((a & 0x7fffffu) >> 13) : 0x7c00u));
    if (a >= 0x38800000u) { /* normal in f16 range (or overflowing to inf) */
        uint32_t h = (a - 0x38000000u) >> 13, rem = a & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
        if (h >= 0x7c00u) h = 0x7c00u;
        return (uint16_t)(sign | h);
    }
    if (a < 0x33000000u) return (uint16_t)sign; /* below half the smallest subnormal */
    uint32_t e = a >> 23, mant = (a & 0x7fffffu) | 0x800000u;
    int shift = 126 - (int)e; /* value = mant * 2^(e-150); unit 2^-24 */
    uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

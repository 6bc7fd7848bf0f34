/* kernels.cuh: the arithmetic of the CUDA kernels, written once for the device and the host.
 *
 * Every __global__ kernel in kernels.cu is a thin wrapper: it finds its (row, output) or
 * (row, head) from the grid and calls the functions below. tests/cuda/test_cuda_kernels.cpp
 * compiles this same file for the CPU and runs the kernels warp by warp (32 lane values and
 * the butterfly of tlk_warp_sum_host) against plain references, so the arithmetic the GPU
 * runs is checked on machines without one (llm.c's "each kernel beside its reference").
 *
 * Batch invariance (engine/src/backend.h) is built in: one warp computes one output element
 * (or one (row, head) of attention) through a fixed order that depends on the element's own
 * inputs only, never on how many rows share the launch:
 *   dot products: lane l accumulates the elements i with (i / 8) % 32 == l, in increasing
 *                 order, with fmaf from 0; then the xor butterfly over offsets 16, 8, 4, 2, 1
 *                 (every lane ends with the same sum: IEEE addition is commutative);
 *   norms:        the same lanes (i % 32 == l) in double, the same butterfly;
 *   attention:    keys in logical order, an online softmax per key (every lane holds the
 *                 same score, maximum and sum), each lane owning head elements
 *                 d = l, l + 32, ...
 * The CPU backend computes the same functions in other orders: the two agree within the
 * parity tolerance, each agrees with itself bit for bit. */
#ifndef TL_CUDA_KERNELS_CUH
#define TL_CUDA_KERNELS_CUH

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../engine/src/math_shared.h"

#include "kernel_types.h"

/* ---------------------------------------------------------------- conversions */

TL_SHARED float tlk_bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> float, exact (subnormals, infinities and NaN included). */
TL_SHARED float tlk_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return tlk_bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f; /* mantissa * 2^-24: exact */
        return sign ? -magnitude : magnitude;
    }
    return tlk_bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

TL_SHARED float tlk_bf16(uint16_t b) { return tlk_bits_float((uint32_t)b << 16); }

/* Element (row, col) of a matrix as f32 (q8/q4: scale * value, the CPU's dequantisation). */
TL_SHARED float tlk_weight(const tlk_matrix *w, size_t row, int col) {
    const size_t i = row * (size_t)w->cols + (size_t)col;
    switch (w->dtype) {
    case TLK_F16: return tlk_f16(((const uint16_t *)w->data)[i]);
    case TLK_BF16: return tlk_bf16(((const uint16_t *)w->data)[i]);
    case TLK_Q8:
    case TLK_Q4: {
        const float scale = tlk_f16(w->scales[row * (size_t)(w->cols / TLK_QGROUP) + (size_t)(col / TLK_QGROUP)]);
        int v;
        if (w->dtype == TLK_Q8) v = ((const int8_t *)w->data)[i];
        else {
            const uint8_t byte = ((const uint8_t *)w->data)[i / 2];
            v = (int)(i % 2 ? byte >> 4 : byte & 15) - 8;
        }
        return scale * (float)v;
    }
    default: return ((const float *)w->data)[i];
    }
}

/* ---------------------------------------------------------------- dot products */

/* Lane `lane`'s partial sums of R rows against weight row o: acc[r] = fmaf chain over the
   lane's elements (kernels.cuh header), x rows ldx floats apart, `rows` <= R of them live.
   The weights are read once for all rows; each row's arithmetic is that of a lone row. */
template <int R>
TL_SHARED void tlk_dot_lane(const float *x, size_t ldx, int rows, const tlk_matrix *w, int o, int lane,
                            float acc[R]) {
    const int k = w->cols;
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    for (int c = lane * TLK_CHUNK; c < k; c += TLK_WARP * TLK_CHUNK) {
        const int len = k - c < TLK_CHUNK ? k - c : TLK_CHUNK;
        float wv[TLK_CHUNK];
        for (int i = 0; i < len; i++) wv[i] = tlk_weight(w, (size_t)o, c + i);
        for (int r = 0; r < R; r++) {
            if (r >= rows) break;
            const float *xr = x + (size_t)r * ldx + c;
            for (int i = 0; i < len; i++) acc[r] = fmaf(wv[i], xr[i], acc[r]);
        }
    }
}

/* The butterfly on the host: v[32] -> every lane's sum (what __shfl_xor_sync gives each
   lane on the device, offset by offset). */
template <typename T>
static inline void tlk_warp_sum_host(T v[TLK_WARP]) {
    for (int offset = TLK_WARP / 2; offset > 0; offset /= 2) {
        T next[TLK_WARP];
        for (int l = 0; l < TLK_WARP; l++) next[l] = v[l] + v[l ^ offset];
        for (int l = 0; l < TLK_WARP; l++) v[l] = next[l];
    }
}

/* A product's epilogue: the sum, + bias, then GELU when asked (the CPU's order). */
TL_SHARED float tlk_matmul_finish(float sum, const float *bias, int o, int gelu) {
    float y = bias ? sum + bias[o] : sum;
    return gelu ? tl_gelu_tanh(y) : y;
}

/* ---------------------------------------------------------------- norms */

/* Lane sums of a row for the norm statistics: pass 0 sums x (layernorm's mean), pass 1
   sums (x - mean)^2; in double, elements i = lane (mod 32) in increasing order. */
TL_SHARED double tlk_norm_lane(const float *x, int d, int lane, int pass, double mean) {
    double acc = 0.0;
    for (int i = lane; i < d; i += TLK_WARP) {
        if (pass == 0) acc += x[i];
        else acc += ((double)x[i] - mean) * ((double)x[i] - mean);
    }
    return acc;
}

/* y = (x - mean) * inv * w (+ b) for the lane's elements, the CPU's expression. */
TL_SHARED void tlk_norm_apply(const float *x, float *y, int d, int lane, double mean, double var_sum, float eps,
                              const float *w, const float *b) {
    const float inv = (float)(1.0 / sqrt(var_sum / d + (double)eps));
    const float mf = (float)mean;
    for (int i = lane; i < d; i += TLK_WARP) y[i] = (x[i] - mf) * inv * w[i] + (b ? b[i] : 0.0f);
}

/* ---------------------------------------------------------------- positions */

/* RoPE on pair `pair` of every head of one row (the CPU's rotation; angles in double). */
TL_SHARED void tlk_rope_pair(float *row, int heads, int head_dim, int pair, int interleaved, int32_t position,
                             double inv_freq) {
    const double angle = (double)position * inv_freq;
    const float cs = (float)cos(angle), sn = (float)sin(angle);
    const int half = head_dim / 2;
    const int first = interleaved ? 2 * pair : pair, second = interleaved ? 2 * pair + 1 : pair + half;
    for (int h = 0; h < heads; h++) {
        float *v = row + (size_t)h * (size_t)head_dim;
        const float a = v[first], b = v[second];
        v[first] = a * cs - b * sn;
        v[second] = b * cs + a * sn;
    }
}

/* ---------------------------------------------------------------- attention */

/* Whether row i sees entry j (the CPU's `visible`). */
TL_SHARED int tlk_visible(const tlk_attention *a, int i, int j) {
    const int e = j - a->first;
    if (!a->k[e]) return 0;
    if (a->window > 0 && a->entry_pos[e] < a->positions[i] - a->window + 1) return 0;
    if (!a->mask) return j < a->base || j - a->base <= i;
    if (j < a->mask_start) return 1;
    return a->mask[(size_t)i * (size_t)a->mask_width + (size_t)(j - a->mask_start)] != 0;
}

/* Lane partial of q . k over the head (elements d = lane (mod 32), increasing). */
TL_SHARED float tlk_score_lane(const float *q, const float *k, int head_dim, int lane) {
    float acc = 0.0f;
    for (int d = lane; d < head_dim; d += TLK_WARP) acc = fmaf(q[d], k[d], acc);
    return acc;
}

/* The online softmax's running maximum and sum, the same on every lane. */
typedef struct tlk_softmax { float max, sum; } tlk_softmax;

/* Folds score s in: returns the factor the lanes' accumulated output is rescaled by, and in
   *weight the new key's weight. */
TL_SHARED float tlk_softmax_step(tlk_softmax *st, float s, float *weight) {
    const float new_max = s > st->max ? s : st->max;
    const float rescale = expf(st->max - new_max); /* 0 for the first key (max = -inf) */
    *weight = expf(s - new_max);
    st->sum = st->sum * rescale + *weight;
    st->max = new_max;
    return rescale;
}

/* out[j] for the lane's head elements d = lane + 32 j: out = out * rescale + weight * v. */
TL_SHARED void tlk_attend_lane(float *out_lane, const float *v, int head_dim, int lane, float rescale, float weight) {
    for (int d = lane, j = 0; d < head_dim; d += TLK_WARP, j++) out_lane[j] = out_lane[j] * rescale + weight * v[d];
}

#endif

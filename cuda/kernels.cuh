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
 *   norms:        a block of TLK_NORM_THREADS threads a row, thread t summing the
 *                 elements i = t (mod TLK_NORM_THREADS) in double, the butterfly in each
 *                 warp, the warps' sums added in warp order;
 *   attention:    a row's visible keys as a list, tiles of 32 of them, every
 *                 TLK_ATT_WARPS-th tile to one warp, a lane a key; an online softmax per
 *                 tile, each lane owning head elements d = l, l + 32, ...; the warps
 *                 merged in warp order (the attention section below)
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

/* Loop unrolling where nvcc compiles for the device (the host compilers take no such pragma). */
#ifdef __CUDA_ARCH__
#define TLK_UNROLL _Pragma("unroll")
#define TLK_UNROLL_BY(n) _Pragma(TLK_STRINGIFY(unroll n))
#define TLK_STRINGIFY(x) #x
#else
#define TLK_UNROLL
#define TLK_UNROLL_BY(n)
#endif

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
/* One chunk of `len` weights (columns c..c + len - 1) into the rows' sums, in order. */
template <int R>
TL_SHARED void tlk_dot_chunk(const float *wv, int len, const float *x, size_t ldx, int c, int rows, float acc[R]) {
    for (int r = 0; r < R; r++) {
        if (r >= rows) break;
        const float *xr = x + (size_t)r * ldx + c;
        for (int i = 0; i < len; i++) acc[r] = fmaf(wv[i], xr[i], acc[r]);
    }
}

template <int R>
TL_SHARED void tlk_dot_lane(const float *x, size_t ldx, int rows, const tlk_matrix *w, int o, int lane,
                            float acc[R]) {
    const int k = w->cols;
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    for (int c = lane * TLK_CHUNK; c < k; c += TLK_WARP * TLK_CHUNK) {
        const int len = k - c < TLK_CHUNK ? k - c : TLK_CHUNK;
        float wv[TLK_CHUNK];
        for (int i = 0; i < len; i++) wv[i] = tlk_weight(w, (size_t)o, c + i);
        tlk_dot_chunk<R>(wv, len, x, ldx, c, rows, acc);
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

/* A row's norm statistics over TLK_NORM_THREADS threads: thread t sums the elements
   i = t (mod TLK_NORM_THREADS) in increasing order, in double (pass 0: x, layernorm's mean;
   pass 1: (x - mean)^2); each warp's 32 sums go through the butterfly, and the warps' totals
   are added in warp order (tlk_norm_total). */
TL_SHARED double tlk_norm_part(const float *x, int d, int thread, int pass, double mean) {
    double acc = 0.0;
    for (int i = thread; i < d; i += TLK_NORM_THREADS) {
        if (pass == 0) acc += x[i];
        else acc += ((double)x[i] - mean) * ((double)x[i] - mean);
    }
    return acc;
}

TL_SHARED double tlk_norm_total(const double warp_sums[TLK_NORM_THREADS / TLK_WARP]) {
    double total = 0.0;
    for (int w = 0; w < TLK_NORM_THREADS / TLK_WARP; w++) total += warp_sums[w];
    return total;
}

/* y = (x - mean) * inv * w (+ b) for the thread's elements, the CPU's expression. */
TL_SHARED void tlk_norm_apply(const float *x, float *y, int d, int thread, double mean, double var_sum, float eps,
                              const float *w, const float *b) {
    const float inv = (float)(1.0 / sqrt(var_sum / d + (double)eps));
    const float mf = (float)mean;
    for (int i = thread; i < d; i += TLK_NORM_THREADS) y[i] = (x[i] - mf) * inv * w[i] + (b ? b[i] : 0.0f);
}

/* ---------------------------------------------------------------- positions */

/* RoPE's angle for a position and a pair's frequency (in double, the CPU's). */
TL_SHARED void tlk_rope_angle(int32_t position, double inv_freq, float *cs, float *sn) {
    const double angle = (double)position * inv_freq;
    *cs = (float)cos(angle);
    *sn = (float)sin(angle);
}

/* Pair `pair` of one head (head_dim elements at v) turned by the angle (the CPU's rotation). */
TL_SHARED void tlk_rope_turn(float *v, int head_dim, int pair, int interleaved, float cs, float sn) {
    const int half = head_dim / 2;
    const int first = interleaved ? 2 * pair : pair, second = interleaved ? 2 * pair + 1 : pair + half;
    const float a = v[first], b = v[second];
    v[first] = a * cs - b * sn;
    v[second] = b * cs + a * sn;
}

/* RoPE on pair `pair` of every head of one row. */
TL_SHARED void tlk_rope_pair(float *row, int heads, int head_dim, int pair, int interleaved, int32_t position,
                             double inv_freq) {
    float cs, sn;
    tlk_rope_angle(position, inv_freq, &cs, &sn);
    for (int h = 0; h < heads; h++) tlk_rope_turn(row + (size_t)h * (size_t)head_dim, head_dim, pair, interleaved, cs, sn);
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

/* Attention works on a row's visible keys as a list: the entries it sees (tlk_visible), in
   logical order, whatever lies between them. Rank r of that list goes to tile r / 32 and lane
   r % 32, and tile t to warp t % TLK_ATT_WARPS of the TLK_ATT_WARPS on the (row, head); each
   warp folds its tiles in increasing order into an online softmax, and the warps' partials
   are merged in warp order (tlk_attention_merge). So a row's result depends on its visible
   keys alone: the same in a decode step, a prefill chunk, a tree whose siblings sit between
   its keys, a compacted cache and a ring that dropped what its window hides. */

/* Lane's key, entry j (visible to the row): its scaled score q . k, head elements in
   increasing order, fmaf from 0. */
TL_SHARED float tlk_key_score(const tlk_attention *a, const float *q, size_t in_row, int j, float scale) {
    const float *k = a->k[j - a->first] + in_row;
    float acc = 0.0f;
    TLK_UNROLL_BY(8)
    for (int d = 0; d < a->head_dim; d++) acc = fmaf(q[d], k[d], acc);
    return acc * scale;
}

/* The online softmax's running maximum and sum, the same on every lane of a warp. */
typedef struct tlk_softmax { float max, sum; } tlk_softmax;

/* A key's weight against the new maximum: 0 for a key not seen (-inf). */
TL_SHARED float tlk_key_weight(float score, float new_max) {
    return score == -INFINITY ? 0.0f : expf(score - new_max);
}

/* Folds a tile in: st and new_max from before, tile_sum the warp's sum of the tile's
   weights. Returns the factor the lanes' accumulated output is rescaled by (0 for the first
   tile a warp sees: max = -inf). */
TL_SHARED float tlk_softmax_fold(tlk_softmax *st, float new_max, float tile_sum) {
    const float rescale = expf(st->max - new_max);
    st->sum = st->sum * rescale + tile_sum;
    st->max = new_max;
    return rescale;
}

/* The lane's head elements d = lane + 32 jj (jj < SLOTS, the launch's ceil(head_dim / 32): a
   count known when compiling, so out_lane stays in registers): out = out * rescale + sum over
   the tile's keys (entries keys[], -1 past the list's end) in order of weight[key] *
   v[key][d] (fmaf); keys of weight 0 are skipped (the same on every lane). */
template <int SLOTS>
TL_SHARED void tlk_attend_tile_lane(float out_lane[SLOTS], const tlk_attention *a, size_t in_row,
                                    const int keys[TLK_KEY_TILE], const float weights[TLK_KEY_TILE], int lane,
                                    float rescale) {
    const int hd = a->head_dim;
    TLK_UNROLL
    for (int jj = 0; jj < SLOTS; jj++) out_lane[jj] *= rescale;
    TLK_UNROLL
    for (int key = 0; key < TLK_KEY_TILE; key++) {
        if (keys[key] < 0 || weights[key] == 0.0f) continue;
        const float *v = a->v[keys[key] - a->first] + in_row;
        TLK_UNROLL
        for (int jj = 0; jj < SLOTS; jj++) {
            const int d = lane + TLK_WARP * jj;
            if (d < hd) out_lane[jj] = fmaf(weights[key], v[d], out_lane[jj]);
        }
    }
}

/* Element d of the (row, head)'s output from the warps' partials, merged in warp order
   (every thread computes the same denominator). 0 where no key is seen. */
TL_SHARED float tlk_attention_merge(const float max[TLK_ATT_WARPS], const float sum[TLK_ATT_WARPS],
                                    const float out_d[TLK_ATT_WARPS]) {
    float top = -INFINITY;
    for (int w = 0; w < TLK_ATT_WARPS; w++) top = max[w] > top ? max[w] : top;
    if (top == -INFINITY) return 0.0f;
    float num = 0.0f, den = 0.0f;
    for (int w = 0; w < TLK_ATT_WARPS; w++) {
        const float f = expf(max[w] - top); /* 0 for a warp that saw no key */
        num = fmaf(out_d[w], f, num);
        den = fmaf(sum[w], f, den);
    }
    return num / den;
}

#endif

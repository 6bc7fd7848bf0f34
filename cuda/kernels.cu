/* kernels.cu: the CUDA kernels, each a thin wrapper around the arithmetic of kernels.cuh
 * (which tests/cuda/test_cuda_kernels.cpp checks on the CPU), and their C launchers
 * (launch.h). Built with -fmad=false: nvcc would otherwise fuse the written a * b + c into
 * FMAs, and the bits would no longer be those of the expressions the tests check. */
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.cuh"
#include "launch.h"

#define FULL_MASK 0xffffffffu
#define WARPS_PER_BLOCK 4

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
    for (int offset = TLK_WARP / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

static int launched(void) { return (int)cudaGetLastError(); }

static unsigned blocks_for(size_t threads, unsigned per_block) {
    return (unsigned)((threads + per_block - 1) / per_block);
}

/* ---------------------------------------------------------------- matmul */

/* tlk_dot_lane for f16/bf16 rows whose 8-element chunks are 16-byte aligned (cols % 8 == 0,
   an aligned allocation): each chunk is one 16-byte load, converted in registers, and
   several chunks are in flight at once. The values and the order they are added in are
   tlk_dot_lane's, so the bits are too; only the loads differ (8 two-byte loads a chunk, each
   waited for, gave a 768 x 768 product 12 us on an H100). */
template <int R, bool BF16>
__device__ __forceinline__ void dot_lane_half8(const float *x, size_t ldx, int rows, const tlk_matrix *w, int o,
                                               int lane, float acc[R]) {
    const int k = w->cols;
    const uint4 *wrow = (const uint4 *)((const uint16_t *)w->data + (size_t)o * (size_t)k);
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
#pragma unroll 4
    for (int c = lane * TLK_CHUNK; c < k; c += TLK_WARP * TLK_CHUNK) {
        const uint4 packed = __ldg(wrow + c / TLK_CHUNK);
        const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
        float wv[TLK_CHUNK];
        for (int i = 0; i < TLK_CHUNK; i++) {
            const uint16_t h = (uint16_t)(words[i / 2] >> (16 * (i % 2))); /* little-endian: element c + i */
            wv[i] = BF16 ? tlk_bf16(h) : __half2float(__ushort_as_half(h)); /* both exact */
        }
        tlk_dot_chunk<R>(wv, TLK_CHUNK, x, ldx, c, rows, acc);
    }
}

/* Up to TLK_GROUP_MAX products of the same input in one launch (q/k/v, gate/up): matrix g
   owns the blocks [block_start[g], block_start[g + 1]) along x. Each output's arithmetic is
   that of a launch of its matrix alone. */
#define TLK_GROUP_MAX 4
typedef struct matmul_group {
    tlk_matrix w[TLK_GROUP_MAX];
    const float *bias[TLK_GROUP_MAX];
    float *y[TLK_GROUP_MAX];
    int gelu[TLK_GROUP_MAX];
    int block_start[TLK_GROUP_MAX + 1];
    int count;
} matmul_group;

/* One warp per output o and group of up to R rows (blockIdx.y): the weight row is read once
   for the group. R is a launch choice only: each row's arithmetic is the same for any R.
   HALF8: 0 = tlk_dot_lane, 1 = f16 and 2 = bf16 through dot_lane_half8. */
template <int R, int HALF8>
__global__ void k_matmul(const float *x, int n, matmul_group group) {
    int g = 0;
    while (g + 1 < group.count && (int)blockIdx.x >= group.block_start[g + 1]) g++;
    const tlk_matrix *w = &group.w[g];
    const int o = (int)(((blockIdx.x - group.block_start[g]) * blockDim.x + threadIdx.x) / TLK_WARP);
    const int lane = (int)(threadIdx.x % TLK_WARP), r0 = (int)blockIdx.y * R;
    if (o >= w->rows || r0 >= n) return; /* whole warps leave together: o is per warp */
    const int live = n - r0 < R ? n - r0 : R;
    float acc[R];
    const float *xr = x + (size_t)r0 * (size_t)w->cols;
    if (HALF8 == 1) dot_lane_half8<R, false>(xr, (size_t)w->cols, live, w, o, lane, acc);
    else if (HALF8 == 2) dot_lane_half8<R, true>(xr, (size_t)w->cols, live, w, o, lane, acc);
    else tlk_dot_lane<R>(xr, (size_t)w->cols, live, w, o, lane, acc);
    for (int r = 0; r < R; r++) {
        if (r >= live) break;
        const float sum = warp_sum(acc[r]);
        if (lane == 0) group.y[g][(size_t)(r0 + r) * (size_t)w->rows + o] = tlk_matmul_finish(sum, group.bias[g], o, group.gelu[g]);
    }
}

template <int HALF8>
static void launch_matmul(const float *x, int n, const matmul_group &group) {
    const dim3 block(WARPS_PER_BLOCK * TLK_WARP);
    const unsigned gx = (unsigned)group.block_start[group.count];
    if (n == 1) k_matmul<1, HALF8><<<dim3(gx, 1), block>>>(x, n, group);
    else if (n <= 4) k_matmul<4, HALF8><<<dim3(gx, 1), block>>>(x, n, group);
    else k_matmul<8, HALF8><<<dim3(gx, (unsigned)((n + 7) / 8)), block>>>(x, n, group);
}

/* 0, 1 or 2: how k_matmul reads w (HALF8). */
static int half8_of(const tlk_matrix &w) {
    if ((w.dtype != TLK_F16 && w.dtype != TLK_BF16) || w.cols % TLK_CHUNK || (uintptr_t)w.data % 16) return 0;
    return w.dtype == TLK_F16 ? 1 : 2;
}

static void launch_group(const float *x, int n, const matmul_group &group) {
    switch (half8_of(group.w[0])) {
    case 1: launch_matmul<1>(x, n, group); break;
    case 2: launch_matmul<2>(x, n, group); break;
    default: launch_matmul<0>(x, n, group);
    }
}

extern "C" int tlk_launch_matmul_group(const float *x, int n, const tlk_matrix *w, const float *const *bias,
                                       const int *gelu, float *const *y, int count) {
    /* One launch for matrices read alike (one HALF8) and the same input width; else one each. */
    bool together = count <= TLK_GROUP_MAX;
    for (int g = 1; g < count && together; g++)
        together = half8_of(w[g]) == half8_of(w[0]) && w[g].cols == w[0].cols;
    for (int first = 0; first < count;) {
        const int take = together ? count : 1;
        matmul_group group = {};
        group.count = take;
        for (int g = 0; g < take; g++) {
            group.w[g] = w[first + g];
            group.bias[g] = bias[first + g];
            group.y[g] = y[first + g];
            group.gelu[g] = gelu[first + g];
            group.block_start[g + 1] = group.block_start[g] + (int)blocks_for((size_t)w[first + g].rows, WARPS_PER_BLOCK);
        }
        launch_group(x, n, group);
        first += take;
    }
    return launched();
}

extern "C" int tlk_launch_matmul(const float *x, int n, tlk_matrix w, const float *bias, int gelu, float *y) {
    return tlk_launch_matmul_group(x, n, &w, &bias, &gelu, &y, 1);
}

/* ---------------------------------------------------------------- norms */

/* One block of TLK_NORM_THREADS per row (a warp alone waited on its loads one after another:
   15 us for a row of 768 on an H100). */
__device__ __forceinline__ double block_total(double part, double *warp_sums) {
    const int lane = (int)(threadIdx.x % TLK_WARP), warp = (int)(threadIdx.x / TLK_WARP);
    part = warp_sum(part);
    if (lane == 0) warp_sums[warp] = part;
    __syncthreads();
    const double total = tlk_norm_total(warp_sums);
    __syncthreads(); /* every thread has read warp_sums before the next pass writes it */
    return total;
}

__global__ void k_norm(const float *x, int n, int d, int layernorm, float eps, const float *w, const float *b,
                       float *y) {
    __shared__ double warp_sums[TLK_NORM_THREADS / TLK_WARP];
    const int r = (int)blockIdx.x, t = (int)threadIdx.x;
    if (r >= n) return; /* the whole block */
    const float *xr = x + (size_t)r * (size_t)d;
    const double mean = layernorm ? block_total(tlk_norm_part(xr, d, t, 0, 0.0), warp_sums) / d : 0.0;
    const double var_sum = block_total(tlk_norm_part(xr, d, t, 1, mean), warp_sums);
    /* y may alias x: each thread writes only the elements it read itself */
    tlk_norm_apply(xr, y + (size_t)r * (size_t)d, d, t, mean, var_sum, eps, w, b);
}

extern "C" int tlk_launch_norm(const float *x, int n, int d, int layernorm, float eps, const float *w,
                               const float *b, float *y) {
    if (n > 0) k_norm<<<(unsigned)n, TLK_NORM_THREADS>>>(x, n, d, layernorm, eps, w, b, y);
    return launched();
}

/* ---------------------------------------------------------------- positions, embedding */

/* A thread per (row, head, pair): the loop over heads in one thread waited on each head's
   loads in turn (11 us a call at 16 heads on an H100). */
__global__ void k_rope(float *x, int n, int heads, int head_dim, int interleaved, const int32_t *positions,
                       const double *inv_freq) {
    const int half = head_dim / 2;
    const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (t >= (size_t)n * (size_t)heads * (size_t)half) return;
    const int pair = (int)(t % (size_t)half);
    const size_t row_head = t / (size_t)half; /* row * heads + head */
    float cs, sn;
    tlk_rope_angle(positions[row_head / (size_t)heads], inv_freq[pair], &cs, &sn);
    tlk_rope_turn(x + row_head * (size_t)head_dim, head_dim, pair, interleaved, cs, sn);
}

extern "C" int tlk_launch_rope(float *x, int n, int heads, int head_dim, int interleaved,
                               const int32_t *positions, const double *inv_freq) {
    const size_t threads = (size_t)n * (size_t)heads * (size_t)(head_dim / 2);
    if (threads) k_rope<<<blocks_for(threads, 256), 256>>>(x, n, heads, head_dim, interleaved, positions, inv_freq);
    return launched();
}

__global__ void k_embed(const int32_t *tokens, const int32_t *positions, int n, tlk_matrix tok_embed,
                        float embed_scale, tlk_matrix pos_embed, float *x) {
    const int d = tok_embed.cols;
    const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (t >= (size_t)n * (size_t)d) return;
    const int r = (int)(t / (size_t)d), i = (int)(t % (size_t)d);
    float v = tlk_weight(&tok_embed, (size_t)tokens[r], i);
    if (embed_scale != 1.0f) v *= embed_scale;
    if (pos_embed.data) v += tlk_weight(&pos_embed, (size_t)positions[r], i);
    x[t] = v;
}

extern "C" int tlk_launch_embed(const int32_t *tokens, const int32_t *positions, int n, tlk_matrix tok_embed,
                                float embed_scale, tlk_matrix pos_embed, float *x) {
    const size_t threads = (size_t)n * (size_t)tok_embed.cols;
    k_embed<<<blocks_for(threads, 256), 256>>>(tokens, positions, n, tok_embed, embed_scale, pos_embed, x);
    return launched();
}

/* ---------------------------------------------------------------- attention */

/* This warp's tile: the lane's key, entry `key` (-1: none), folded into the warp's softmax. */
template <int SLOTS>
__device__ __forceinline__ void attend_tile(const tlk_attention *a, const float *q_row, size_t in_row, int key,
                                            float scale, int lane, tlk_softmax *st, float *out) {
    const float score = key >= 0 ? tlk_key_score(a, q_row, in_row, key, scale) : -INFINITY;
    float tile_max = score;
    for (int offset = TLK_WARP / 2; offset > 0; offset /= 2) {
        const float other = __shfl_xor_sync(FULL_MASK, tile_max, offset);
        tile_max = other > tile_max ? other : tile_max;
    }
    if (tile_max == -INFINITY) return; /* the same on every lane */
    const float new_max = tile_max > st->max ? tile_max : st->max;
    const float weight = tlk_key_weight(score, new_max);
    const float rescale = tlk_softmax_fold(st, new_max, warp_sum(weight));
    int keys[TLK_KEY_TILE];
    float weights[TLK_KEY_TILE];
    for (int k = 0; k < TLK_KEY_TILE; k++) {
        keys[k] = __shfl_sync(FULL_MASK, key, k);
        weights[k] = __shfl_sync(FULL_MASK, weight, k);
    }
    tlk_attend_tile_lane<SLOTS>(out, a, in_row, keys, weights, lane, rescale);
}

/* One block per (row, head), TLK_ATT_WARPS warps, over the row's visible keys as a list
   (kernels.cuh): the block reads the entries a block's width at a time, ranks the visible
   ones (a ballot per warp, the warps' counts in order) into `pending`, and whenever a round
   of TLK_ATT_WARPS tiles is there, warp w folds tile w of it. One warp per (row, head)
   walking the keys one by one left a decode step 12 warps on 132 SMs: 280 us a layer at 150
   keys on an H100. */
#define ROUND (TLK_ATT_WARPS * TLK_KEY_TILE)
template <int SLOTS>
__global__ void __launch_bounds__(ROUND) k_attention(const tlk_attention *a) {
    __shared__ float q_row[TLK_MAX_HEAD];
    __shared__ int pending[2 * ROUND]; /* ranks [done, done + held): < one round, plus a read */
    __shared__ int warp_counts[TLK_ATT_WARPS];
    __shared__ float part_max[TLK_ATT_WARPS], part_sum[TLK_ATT_WARPS];
    __shared__ float part_out[TLK_ATT_WARPS][TLK_MAX_HEAD];
    const int task = (int)blockIdx.x, t = (int)threadIdx.x, lane = t % TLK_WARP, warp = t / TLK_WARP;
    if (task >= a->n * a->n_heads) return; /* the whole block */
    const int i = task / a->n_heads, h = task % a->n_heads, hd = a->head_dim;
    const int kv_head = h / (a->n_heads / a->n_kv_heads);
    const size_t qd = (size_t)a->n_heads * (size_t)hd, in_row = (size_t)kv_head * (size_t)hd;
    for (int d = t; d < hd; d += ROUND) q_row[d] = a->q[(size_t)i * qd + (size_t)h * (size_t)hd + d];
    const float scale = 1.0f / sqrtf((float)hd);
    float out[SLOTS] = {0};
    tlk_softmax st = {-INFINITY, 0.0f};
    int held = 0; /* the same in every thread */
    for (int from = a->first; from < a->last; from += ROUND) {
        const int j = from + t;
        const bool seen = j < a->last && tlk_visible(a, i, j);
        const unsigned ballot = __ballot_sync(FULL_MASK, seen);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads(); /* (also: q_row is written) */
        int rank = held, read = 0;
        for (int w = 0; w < TLK_ATT_WARPS; w++) {
            if (w < warp) rank += warp_counts[w];
            read += warp_counts[w];
        }
        if (seen) pending[rank + __popc(ballot & ((1u << lane) - 1u))] = j;
        held += read;
        __syncthreads();
        if (held >= ROUND) {
            attend_tile<SLOTS>(a, q_row, in_row, pending[t], scale, lane, &st, out);
            const int rest = held - ROUND, moved = t < rest ? pending[ROUND + t] : 0;
            __syncthreads(); /* every tile has read its keys */
            if (t < rest) pending[t] = moved;
            held = rest;
            __syncthreads();
        }
    }
    if (warp * TLK_KEY_TILE < held) attend_tile<SLOTS>(a, q_row, in_row, t < held ? pending[t] : -1, scale, lane, &st, out);
    if (lane == 0) {
        part_max[warp] = st.max;
        part_sum[warp] = st.sum;
    }
    for (int jj = 0; jj < SLOTS; jj++)
        if (lane + TLK_WARP * jj < hd) part_out[warp][lane + TLK_WARP * jj] = out[jj];
    __syncthreads();
    float *o = a->out + (size_t)i * qd + (size_t)h * (size_t)hd;
    for (int d = t; d < hd; d += ROUND) {
        float column[TLK_ATT_WARPS];
        for (int w = 0; w < TLK_ATT_WARPS; w++) column[w] = part_out[w][d];
        o[d] = tlk_attention_merge(part_max, part_sum, column);
    }
}

extern "C" int tlk_launch_attention(const tlk_attention *a_device, int n, int n_heads, int head_dim) {
    if (n < 1) return launched();
    const unsigned blocks = (unsigned)(n * n_heads);
    switch ((head_dim + TLK_WARP - 1) / TLK_WARP) { /* head_dim <= TLK_MAX_HEAD (cuda_open) */
    case 1: k_attention<1><<<blocks, ROUND>>>(a_device); break;
    case 2: k_attention<2><<<blocks, ROUND>>>(a_device); break;
    case 3: k_attention<3><<<blocks, ROUND>>>(a_device); break;
    case 4: k_attention<4><<<blocks, ROUND>>>(a_device); break;
    default: k_attention<TLK_MAX_HEAD / TLK_WARP><<<blocks, ROUND>>>(a_device);
    }
    return launched();
}

/* ---------------------------------------------------------------- KV rows */

/* Row t's K and V copied by blockIdx.y's share of 256 elements (one block a row waited on
   its loads in turn: 9 us for a row of 1024). */
__global__ void k_scatter_rows(float *const *dst_k, float *const *dst_v, const float *const *src_k,
                               const float *const *src_v, int n, int kvd) {
    const int t = (int)blockIdx.x, i = (int)(blockIdx.y * blockDim.x + threadIdx.x);
    if (t >= n || i >= kvd) return;
    dst_k[t][i] = src_k[t][i];
    dst_v[t][i] = src_v[t][i];
}

extern "C" int tlk_launch_scatter_rows(float *const *dst_k, float *const *dst_v, const float *const *src_k,
                                       const float *const *src_v, int n, int kvd) {
    if (n > 0 && kvd > 0) k_scatter_rows<<<dim3((unsigned)n, blocks_for((size_t)kvd, 256)), 256>>>(dst_k, dst_v, src_k, src_v, n, kvd);
    return launched();
}

/* ---------------------------------------------------------------- element-wise */

#define ELEMENTWISE(NAME, PARAMS, BODY)                                          \
    __global__ void k_##NAME PARAMS {                                           \
        const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;         \
        if (i < count) { BODY; }                                                \
    }

ELEMENTWISE(add, (float *y, const float *x, size_t count), y[i] += x[i])
ELEMENTWISE(swiglu, (float *gate, const float *up, size_t count), gate[i] = tl_swiglu(gate[i], up[i]))
ELEMENTWISE(inject_add, (const float *s, const float *e, float *out, size_t count), out[i] = s[i] + e[i])
ELEMENTWISE(loop_update, (float *s, const float *x, const float *ref, float beta, size_t count),
            s[i] += beta * (x[i] - ref[i]))

extern "C" int tlk_launch_add(float *y, const float *x, size_t count) {
    if (count) k_add<<<blocks_for(count, 256), 256>>>(y, x, count);
    return launched();
}
extern "C" int tlk_launch_swiglu(float *gate, const float *up, size_t count) {
    if (count) k_swiglu<<<blocks_for(count, 256), 256>>>(gate, up, count);
    return launched();
}
extern "C" int tlk_launch_inject_add(const float *s, const float *e, float *out, size_t count) {
    if (count) k_inject_add<<<blocks_for(count, 256), 256>>>(s, e, out, count);
    return launched();
}
extern "C" int tlk_launch_loop_update(float *s, const float *x, const float *ref, float beta, size_t count) {
    if (count) k_loop_update<<<blocks_for(count, 256), 256>>>(s, x, ref, beta, count);
    return launched();
}

__global__ void k_add_rows(float *y, int n, int width, const float *bias) {
    const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (t < (size_t)n * (size_t)width) y[t] += bias[t % (size_t)width];
}
extern "C" int tlk_launch_add_rows(float *y, int n, int width, const float *bias) {
    const size_t count = (size_t)n * (size_t)width;
    if (count) k_add_rows<<<blocks_for(count, 256), 256>>>(y, n, width, bias);
    return launched();
}

__global__ void k_concat(const float *first, const float *second, int n, int d, float *cat) {
    const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (t >= (size_t)n * 2 * (size_t)d) return;
    const size_t r = t / (2 * (size_t)d), i = t % (2 * (size_t)d);
    cat[t] = i < (size_t)d ? first[r * (size_t)d + i] : second[r * (size_t)d + i - (size_t)d];
}
extern "C" int tlk_launch_concat(const float *first, const float *second, int n, int d, float *cat) {
    const size_t count = (size_t)n * 2 * (size_t)d;
    if (count) k_concat<<<blocks_for(count, 256), 256>>>(first, second, n, d, cat);
    return launched();
}

__global__ void k_state_init(float *s, int n, int d, const int32_t *positions, uint64_t seed, double scale) {
    const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (t >= (size_t)n * (size_t)d) return;
    const int r = (int)(t / (size_t)d), i = (int)(t % (size_t)d);
    s[t] = (float)(tl_state_draw(seed, positions[r], i) * scale);
}
extern "C" int tlk_launch_state_init(float *s, int n, int d, const int32_t *positions, uint64_t seed,
                                     double scale) {
    const size_t count = (size_t)n * (size_t)d;
    if (count) k_state_init<<<blocks_for(count, 256), 256>>>(s, n, d, positions, seed, scale);
    return launched();
}

__global__ void k_change_sums(const float *a, const float *b, int d, double *out) {
    const int lane = (int)threadIdx.x;
    double change = 0.0, norm = 0.0;
    for (int i = lane; i < d; i += TLK_WARP) {
        const double delta = (double)a[i] - (double)b[i];
        change += delta * delta;
        norm += (double)a[i] * (double)a[i];
    }
    change = warp_sum(change);
    norm = warp_sum(norm);
    if (lane == 0) { out[0] = change; out[1] = norm; }
}
extern "C" int tlk_launch_change_sums(const float *a, const float *b, int d, double *out) {
    k_change_sums<<<1, TLK_WARP>>>(a, b, d, out);
    return launched();
}

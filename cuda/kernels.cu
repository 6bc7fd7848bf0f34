/* kernels.cu: the CUDA kernels, each a thin wrapper around the arithmetic of kernels.cuh
 * (which tests/cuda/test_cuda_kernels.cpp checks on the CPU), and their C launchers
 * (launch.h). Built with -fmad=false: nvcc would otherwise fuse the written a * b + c into
 * FMAs, and the bits would no longer be those of the expressions the tests check. */
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

/* One warp per output o and group of up to R rows (blockIdx.y): the weight row is read once
   for the group. R is a launch choice only: each row's arithmetic is the same for any R. */
template <int R>
__global__ void k_matmul(const float *x, int n, tlk_matrix w, const float *bias, int gelu, float *y, int ldy) {
    const int o = (int)((blockIdx.x * blockDim.x + threadIdx.x) / TLK_WARP), lane = (int)(threadIdx.x % TLK_WARP);
    const int r0 = (int)blockIdx.y * R;
    if (o >= w.rows || r0 >= n) return; /* whole warps leave together: o is per warp */
    const int live = n - r0 < R ? n - r0 : R;
    float acc[R];
    tlk_dot_lane<R>(x + (size_t)r0 * (size_t)w.cols, (size_t)w.cols, live, &w, o, lane, acc);
    for (int r = 0; r < R; r++) {
        if (r >= live) break;
        const float sum = warp_sum(acc[r]);
        if (lane == 0) y[(size_t)(r0 + r) * (size_t)ldy + o] = tlk_matmul_finish(sum, bias, o, gelu);
    }
}

extern "C" int tlk_launch_matmul(const float *x, int n, tlk_matrix w, const float *bias, int gelu, float *y,
                                 int ldy) {
    const dim3 block(WARPS_PER_BLOCK * TLK_WARP);
    const unsigned gx = blocks_for((size_t)w.rows, WARPS_PER_BLOCK);
    if (n == 1) k_matmul<1><<<dim3(gx, 1), block>>>(x, n, w, bias, gelu, y, ldy);
    else if (n <= 4) k_matmul<4><<<dim3(gx, 1), block>>>(x, n, w, bias, gelu, y, ldy);
    else k_matmul<8><<<dim3(gx, (unsigned)((n + 7) / 8)), block>>>(x, n, w, bias, gelu, y, ldy);
    return launched();
}

/* ---------------------------------------------------------------- norms */

__global__ void k_norm(const float *x, int n, int d, int layernorm, float eps, const float *w, const float *b,
                       float *y) {
    const int r = (int)((blockIdx.x * blockDim.x + threadIdx.x) / TLK_WARP), lane = (int)(threadIdx.x % TLK_WARP);
    if (r >= n) return;
    const float *xr = x + (size_t)r * (size_t)d;
    const double mean = layernorm ? warp_sum(tlk_norm_lane(xr, d, lane, 0, 0.0)) / d : 0.0;
    const double var_sum = warp_sum(tlk_norm_lane(xr, d, lane, 1, mean));
    __syncwarp(); /* every lane has read its row before any writes (y may alias x) */
    tlk_norm_apply(xr, y + (size_t)r * (size_t)d, d, lane, mean, var_sum, eps, w, b);
}

extern "C" int tlk_launch_norm(const float *x, int n, int d, int layernorm, float eps, const float *w,
                               const float *b, float *y) {
    k_norm<<<blocks_for((size_t)n, WARPS_PER_BLOCK), WARPS_PER_BLOCK * TLK_WARP>>>(x, n, d, layernorm, eps, w, b, y);
    return launched();
}

/* ---------------------------------------------------------------- positions, embedding */

__global__ void k_rope(float *x, int n, int heads, int head_dim, int interleaved, const int32_t *positions,
                       const double *inv_freq) {
    const int half = head_dim / 2;
    const size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (t >= (size_t)n * (size_t)half) return;
    const int r = (int)(t / (size_t)half), pair = (int)(t % (size_t)half);
    tlk_rope_pair(x + (size_t)r * (size_t)heads * (size_t)head_dim, heads, head_dim, pair, interleaved,
                  positions[r], inv_freq[pair]);
}

extern "C" int tlk_launch_rope(float *x, int n, int heads, int head_dim, int interleaved,
                               const int32_t *positions, const double *inv_freq) {
    const size_t threads = (size_t)n * (size_t)(head_dim / 2);
    k_rope<<<blocks_for(threads, 256), 256>>>(x, n, heads, head_dim, interleaved, positions, inv_freq);
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

/* One warp per (row, head): keys in logical order, the online softmax of kernels.cuh. */
__global__ void k_attention(const tlk_attention *a) {
    const int task = (int)((blockIdx.x * blockDim.x + threadIdx.x) / TLK_WARP), lane = (int)(threadIdx.x % TLK_WARP);
    if (task >= a->n * a->n_heads) return;
    const int i = task / a->n_heads, h = task % a->n_heads, hd = a->head_dim;
    const int kv_head = h / (a->n_heads / a->n_kv_heads);
    const size_t qd = (size_t)a->n_heads * (size_t)hd, in_row = (size_t)kv_head * (size_t)hd;
    const float *q = a->q + (size_t)i * qd + (size_t)h * (size_t)hd;
    const float scale = 1.0f / sqrtf((float)hd);
    float out[TLK_MAX_HEAD / TLK_WARP] = {0};
    tlk_softmax st = {-INFINITY, 0.0f};
    for (int j = a->first; j < a->last; j++) {
        if (!tlk_visible(a, i, j)) continue; /* the same for every lane */
        const int e = j - a->first;
        const float s = warp_sum(tlk_score_lane(q, a->k[e] + in_row, hd, lane)) * scale;
        float weight;
        const float rescale = tlk_softmax_step(&st, s, &weight);
        tlk_attend_lane(out, a->v[e] + in_row, hd, lane, rescale, weight);
    }
    const float inv = st.sum > 0.0f ? 1.0f / st.sum : 0.0f;
    float *o = a->out + (size_t)i * qd + (size_t)h * (size_t)hd;
    for (int d = lane, jj = 0; d < hd; d += TLK_WARP, jj++) o[d] = out[jj] * inv;
}

extern "C" int tlk_launch_attention(const tlk_attention *a_device, int n, int n_heads, int head_dim) {
    (void)head_dim;
    k_attention<<<blocks_for((size_t)n * (size_t)n_heads, WARPS_PER_BLOCK), WARPS_PER_BLOCK * TLK_WARP>>>(a_device);
    return launched();
}

/* ---------------------------------------------------------------- KV rows */

__global__ void k_scatter_rows(float *const *dst_k, float *const *dst_v, const float *const *src_k,
                               const float *const *src_v, int n, int kvd) {
    const int t = (int)blockIdx.x;
    if (t >= n) return;
    for (int i = (int)threadIdx.x; i < kvd; i += (int)blockDim.x) {
        dst_k[t][i] = src_k[t][i];
        dst_v[t][i] = src_v[t][i];
    }
}

extern "C" int tlk_launch_scatter_rows(float *const *dst_k, float *const *dst_v, const float *const *src_k,
                                       const float *const *src_v, int n, int kvd) {
    if (n > 0) k_scatter_rows<<<(unsigned)n, 128>>>(dst_k, dst_v, src_k, src_v, n, kvd);
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

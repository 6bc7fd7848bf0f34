/* launch.h: the CUDA kernels as plain C calls (kernels.cu), for cuda_backend.c.
 *
 * Every launcher queues its kernel on the legacy default stream, in call order, and returns
 * 0, or a nonzero cudaError_t when the launch itself failed. Pointers are device memory
 * unless said otherwise; shapes as in engine/src/backend.h. */
#ifndef TL_CUDA_LAUNCH_H
#define TL_CUDA_LAUNCH_H

#include <stddef.h>
#include <stdint.h>

#include "kernel_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y[r * w.rows + o] = x[r] . W[o] (+ bias[o]) (then GELU when gelu), r < n, o < w.rows
   (x rows are w.cols wide). */
int tlk_launch_matmul(const float *x, int n, tlk_matrix w, const float *bias, int gelu, float *y);
/* count products of the same x, y[g] = x w[g]^T (+ bias[g], GELU where gelu[g]), each [n][w[g].rows]:
   one launch where the matrices are read alike, bit for bit the products made one by one. */
int tlk_launch_matmul_group(const float *x, int n, const tlk_matrix *w, const float *const *bias, const int *gelu,
                            float *const *y, int count);
/* y[n][d] = norm(x) * w (+ b); layernorm subtracts the mean, rmsnorm not. y may alias x. */
int tlk_launch_norm(const float *x, int n, int d, int layernorm, float eps, const float *w, const float *b,
                    float *y);
/* RoPE in place on x[n][heads * head_dim]; positions [n] and inv_freq [head_dim / 2] are
   device arrays. */
int tlk_launch_rope(float *x, int n, int heads, int head_dim, int interleaved, const int32_t *positions,
                    const double *inv_freq);
/* x[n][d] = embedding rows (token ids and positions device arrays [n]); pos_embed.data may
   be NULL. */
int tlk_launch_embed(const int32_t *tokens, const int32_t *positions, int n, tlk_matrix tok_embed,
                     float embed_scale, tlk_matrix pos_embed, float *x);
/* One chunk's attention; `a` and the arrays it points to are device memory. */
int tlk_launch_attention(const tlk_attention *a_device, int n, int n_heads, int head_dim);
/* dst_k[t][0..kvd) = k[t], dst_v likewise, t < n (destination row addresses, device arrays). */
int tlk_launch_scatter_rows(float *const *dst_k, float *const *dst_v, const float *const *src_k,
                            const float *const *src_v, int n, int kvd);
/* Element-wise. */
int tlk_launch_add(float *y, const float *x, size_t count);                  /* y += x */
int tlk_launch_add_rows(float *y, int n, int width, const float *bias);      /* y[r] += bias */
int tlk_launch_swiglu(float *gate, const float *up, size_t count);           /* gate = silu(gate) up */
int tlk_launch_inject_add(const float *s, const float *e, float *out, size_t count); /* out = s + e */
/* cat[r] = [first[r] ; second[r]] (each d wide). */
int tlk_launch_concat(const float *first, const float *second, int n, int d, float *cat);
/* s += beta (x - ref) (ref = s or u). */
int tlk_launch_loop_update(float *s, const float *x, const float *ref, float beta, size_t count);
/* s[n][d] = tl_state_draw(seed, positions[r], i) * scale; positions a device array. */
int tlk_launch_state_init(float *s, int n, int d, const int32_t *positions, uint64_t seed, double scale);
/* out[0] = sum (a - b)^2, out[1] = sum a^2 over d elements, in double (one warp). */
int tlk_launch_change_sums(const float *a, const float *b, int d, double *out);

#ifdef __cplusplus
}
#endif

#endif

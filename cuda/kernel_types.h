/* kernel_types.h: what the C host side (cuda_backend.c) and the kernels (kernels.cuh) both
 * name: the weight dtype codes, the limits, and one attention chunk as the kernel reads it. */
#ifndef TL_CUDA_KERNEL_TYPES_H
#define TL_CUDA_KERNEL_TYPES_H

#include <stdint.h>

#define TLK_WARP 32
#define TLK_CHUNK 8      /* consecutive elements a lane reads at once (16 bytes of f16) */
#define TLK_MAX_HEAD 256 /* head_dim a warp holds in registers: 8 elements a lane */
#define TLK_KEY_TILE 32  /* attention: consecutive entries a warp scores at once, a key a lane */
#define TLK_ATT_WARPS 8  /* attention: warps on one (row, head), each every 8th tile */
#define TLK_NORM_THREADS 256 /* norms: threads on one row */

/* Weight dtypes as the kernels see them (tl_dtype is mapped in cuda_backend.c). q8 and q4 are
   the checkpoint's row-major layout (SPEC §8): int8 values, or two 4-bit values a byte (low
   nibble first, stored + 8), times one f16 scale per row and group of TLK_QGROUP columns. */
enum { TLK_F32 = 0, TLK_F16 = 1, TLK_BF16 = 2, TLK_Q8 = 3, TLK_Q4 = 4 };
#define TLK_QGROUP 32

/* A weight matrix as the kernels read it: [rows][cols] row-major. */
typedef struct tlk_matrix {
    const void *data;
    const uint16_t *scales; /* q8/q4: [rows][cols / TLK_QGROUP] f16; else NULL */
    int dtype, rows, cols;
} tlk_matrix;

/* One chunk of attention (a session's rows against its cache), resolved on the host: the
   entries [first, last) as K/V row addresses (NULL where the entry is not held: never
   written, or its ring row overwritten), pointing at the head-0 element of the slot that
   KV sharing picks, and their positions. */
typedef struct tlk_attention {
    const float *q;         /* [n][n_heads * head_dim] */
    float *out;             /* [n][n_heads * head_dim] */
    int n, n_heads, n_kv_heads, head_dim;
    int first, last, base;  /* logical entries held; the chunk's first entry */
    int window;             /* 0 = unbounded */
    const float *const *k;  /* [last - first] */
    const float *const *v;  /* [last - first] */
    const int32_t *entry_pos;  /* [last - first] */
    const int32_t *positions;  /* [n] the rows' positions */
    const uint8_t *mask;       /* [n][mask_width] or NULL (causal) */
    int mask_start, mask_width;
} tlk_attention;

#endif

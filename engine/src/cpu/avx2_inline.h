/* avx2_inline.h: 256-bit helpers shared by the AVX2 and AVX-512 kernel files (each compiles
 * them with its own target flags). The horizontal sum's order is part of the canonical
 * dot product: both files must use this one. */
#ifndef TL_AVX2_INLINE_H
#define TL_AVX2_INLINE_H

#include <immintrin.h>

#include "../dtype.h"
#include "kernels.h"

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_f32(const void *w, size_t i) { return _mm256_loadu_ps((const float *)w + i); }
static inline __m256 load_f16(const void *w, size_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
}
static inline __m256 load_bf16(const void *w, size_t i) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Attention rows of f32 or f16 elements (an f16 KV cache), widened exactly on load: 8 (a
   256-bit vector) or one. */
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline float widen1_f32(float x) { return x; }
static inline float widen1_f16(uint16_t x) { return tl_f16_to_f32(x); }

/* axpys (kernels.h) over y's elements from i on, in blocks of four W-lane vectors held in
   registers for the whole block of keys: per element the fma sequence over j in order, so
   the width cannot change a bit. Both kernel files expand it at their widths (LOADX: W of
   x's elements as floats), then finish with the axpys_from of x's element type. */
#define AXPYS_BLOCKS(W, VEC, LOAD, LOADX, STORE, SET1, FMA)                               \
    for (; i + 4 * (W) <= k8; i += 4 * (W)) {                                              \
        VEC y0 = LOAD(y + i), y1 = LOAD(y + i + (W)), y2 = LOAD(y + i + 2 * (W)), y3 = LOAD(y + i + 3 * (W)); \
        for (int j = 0; j < n; j++) {                                                     \
            const VEC va = SET1(a[j]);                                                    \
            y0 = FMA(va, LOADX(x[j] + i), y0);                                            \
            y1 = FMA(va, LOADX(x[j] + i + (W)), y1);                                      \
            y2 = FMA(va, LOADX(x[j] + i + 2 * (W)), y2);                                  \
            y3 = FMA(va, LOADX(x[j] + i + 3 * (W)), y3);                                  \
        }                                                                                 \
        STORE(y + i, y0);                                                                 \
        STORE(y + i + (W), y1);                                                           \
        STORE(y + i + 2 * (W), y2);                                                       \
        STORE(y + i + 3 * (W), y3);                                                       \
    }

/* The rest of axpys from element i: 8-lane chunks below k & ~7, then the plain tail. */
#define DEFINE_AXPYS_FROM(NAME, ELEM_T, LOAD8, WIDEN1)                                    \
    static inline void NAME(float *y, const float *a, const ELEM_T *const *x, int n, int i, int k) { \
        for (; i < (k & ~7); i += 8) {                                                    \
            __m256 yv = _mm256_loadu_ps(y + i);                                           \
            for (int j = 0; j < n; j++) yv = _mm256_fmadd_ps(_mm256_set1_ps(a[j]), LOAD8(x[j] + i), yv); \
            _mm256_storeu_ps(y + i, yv);                                                  \
        }                                                                                 \
        for (; i < k; i++)                                                                \
            for (int j = 0; j < n; j++) y[i] += a[j] * WIDEN1(x[j][i]);                   \
    }
DEFINE_AXPYS_FROM(axpys_from, float, load8_f32, widen1_f32)
DEFINE_AXPYS_FROM(axpys_from_f16, uint16_t, load8_f16, widen1_f16)

/* The fixed tree that ends every dot product's four partial sums (kernels.h):
   (p0 + p1) + (p2 + p3), eight lanes at once. */
static inline __m256 tree4(__m256 p0, __m256 p1, __m256 p2, __m256 p3) {
    return _mm256_add_ps(_mm256_add_ps(p0, p1), _mm256_add_ps(p2, p3));
}

#define ELEM(dt) ((dt) == TL_F32 ? 4u : 2u)
/* Software prefetch distance of a panel streamed on its own (a single row; the groups of
   panels that one to three rows read side by side, a stream each): the hardware
   prefetcher alone leaves single-row streaming ~15% short of the machine's read
   bandwidth. 1024 rather than 2048 since the prefetches go to L2 (below): medians of four
   alternated rounds from memory, 32 MiB-L3 EPYC, GB/s 2048 -> 1024: one thread, one row
   f16 22.5 -> 24.9, q8 21.4 -> 24.4, q4 20.6 -> 23.6, two rows f16 20.9 -> 23.1; two threads
   q4 one row 28.1 -> 34.2; the rest within the noise (512 lost 15% at three rows, two
   threads). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1024
#endif
/* Every software prefetch of weights goes to L2 (prefetcht1), not L1: a line prefetched
   into L1 holds one of L1's few miss buffers until memory answers, so with several
   streams in flight the prefetches stalled the loads behind them. Measured from memory on
   a 32 MiB-L3 AMD EPYC (tinyloop-kernel-bench --k 768 --cols 3072 --mb 1024, three rounds
   alternated, GB/s T0 -> T1): one row q8 13-16 -> 19-22 (one thread), 22-24 -> 28-40 (two);
   q4 17-20 -> 19-22, 19-23 -> 29-30; f16 21-23 -> 21-24, 22-27 -> 30-40; 8 rows q4 8 -> 10-11,
   13-15 -> 17-21; f16 8 rows unchanged. TL_PF_HINT overrides it for such comparisons. */
#ifndef TL_PF_HINT
#define TL_PF_HINT _MM_HINT_T1
#endif

/* A single row's prefetch of the q block PREFETCH_AHEAD bytes on (its panel is one stream). */
static inline void prefetch_qblock(const uint8_t *blk, size_t bytes) {
    for (size_t p = 0; p < bytes; p += 64) _mm_prefetch((const char *)blk + PREFETCH_AHEAD + p, TL_PF_HINT);
}

/* A multi-row tile's prefetch of the next panels (`bytes` from `ahead`), spread evenly over
   its `steps` (k steps of all its passes together, or q groups): prefetch_per_step once per
   tile, then prefetch_spread at each step (from 1) with the pointer it returned last
   (`ahead` at first). The per-step byte count is divided out once per tile: a division per
   step held the AVX2 6-row tile at 70 GFLOP/s instead of 96-104. */
static inline size_t prefetch_per_step(size_t bytes, size_t steps) { return steps ? (bytes + steps - 1) / steps : 0; }
static inline const char *prefetch_spread(const char *fetched, const char *ahead, size_t bytes, size_t per_step,
                                          size_t step) {
    const char *to = ahead + (step * per_step < bytes ? step * per_step : bytes);
    for (; fetched < to; fetched += 64) _mm_prefetch(fetched, TL_PF_HINT);
    return fetched;
}

/* Stores a tile's `rows` x `lanes` outputs (+ bias, the canonical last step) from
   out[rows][per_row][TL_PANEL]'s panel `p` into y at column o. */
static inline void store_tile(const float *out, int rows, int per_row, int p, int lanes, const float *bias,
                              int o, float *y, int ldy) {
    for (int t = 0; t < rows; t++) {
        const float *src = out + ((size_t)t * (size_t)per_row + (size_t)p) * TL_PANEL;
        float *yr = y + (size_t)t * (size_t)ldy + o;
        for (int l = 0; l < lanes; l++) yr[l] = bias ? src[l] + bias[o + l] : src[l];
    }
}

/* A q8/q4 tile: rows [row0, row0 + R) over P packed panels at once, panel p at `panel` +
   p * `stride` bytes (one-panel tiles ignore the stride), into out[R][P][TL_PANEL]. Each
   row's and panel's integer sums and float steps are the same in every tile, so a row's
   result does not depend on the tile it lands in (kernels.h). */
typedef void (*qtile_fn)(const tl_qrows *x, int row0, int k, const uint8_t *panel, size_t stride, float *out);

/* The packed q8/q4 product over panels [o0, o1), one panel at a time (VNNI's q4 pairs' odd
   last panel): each panel's rows in tiles of 4, 2 and 1 rows (tiles[0..2]; tiles[0] NULL: no
   4-row tile), then + bias into y. A row's result is its tile's, whichever tile it lands in
   (kernels.h). */
static inline void qmatmul_panels(const tl_qrows *x, int n, int k, const void *w, tl_dtype dt, const float *bias,
                                  int o0, int o1, float *y, int ldy, const qtile_fn tiles[3]) {
    const size_t panel_bytes = tl_panel_bytes(dt, k);
    float out[4 * TL_PANEL];
    for (int o = o0; o < o1; o += TL_PANEL) {
        const uint8_t *panel = (const uint8_t *)w + (size_t)(o / TL_PANEL) * panel_bytes;
        const int lanes = o1 - o < TL_PANEL ? o1 - o : TL_PANEL;
        for (int r = 0; r < n;) {
            const int rows = n - r >= 4 && tiles[0] ? 4 : n - r >= 2 ? 2 : 1;
            tiles[rows == 4 ? 0 : rows == 2 ? 1 : 2](x, r, k, panel, 0, out);
            store_tile(out, rows, 1, 0, lanes, bias, o, y + (size_t)r * (size_t)ldy, ldy);
            r += rows;
        }
    }
}

/* How a few-row product lays a range's `count` panels out as at most P parts read side by
   side (qmatmul_rows_parts, FEW_ROWS_PANELS), each walked by its own prefetch stream: parts
   of `part` panels (the last may be shorter: `last` panels), so that every panel is read in a
   stream. P equal parts left up to P - 1 panels over, read one at a time at a fraction of the
   rate: at two threads GPT-2's MLP down projection is cut in tasks of 6 panels, a third of
   which went so (q4: 7.6% of a token's bytes at about 10% of its product time). At step g
   the tile reads panel g of every part, `parts` wide, or one panel fewer once g reaches the
   last part's end (stream_width). */
typedef struct stream_parts {
    int part;  /* panels a part: the distance between the streams, in panels */
    int parts; /* 1 to P */
    int last;  /* the last part's panels, 1 to part */
} stream_parts;

static inline stream_parts stream_parts_of(int count, int P) {
    stream_parts sp = {0, 0, 0};
    if (count < 1) return sp;
    sp.part = (count + P - 1) / P;
    sp.parts = (count + sp.part - 1) / sp.part;
    sp.last = count - (sp.parts - 1) * sp.part;
    return sp;
}

static inline int stream_width(const stream_parts *sp, int g) { return g < sp->last ? sp->parts : sp->parts - 1; }

/* The first column of part p's panel g, in a range from column o0. */
static inline int stream_col(const stream_parts *sp, int o0, int p, int g) { return o0 + (p * sp->part + g) * TL_PANEL; }

/* The packed q8/q4 product of n rows over [o0, o1): its panels as stream parts
   (stream_parts_of), by_width[W - 1][R - 1] the tile of R rows (1 to 3) over W panels (1 to
   P, at most 4). The rows go in groups of 3 (2 + 2 for the last 4), which the later groups
   read from cache. The range's last panel, possibly partial, is the last part's last. */
static inline void qmatmul_rows_parts(const tl_qrows *x, int n, int k, const void *w, tl_dtype dt, const float *bias,
                                      int o0, int o1, float *y, int ldy, const qtile_fn by_width[4][3], int P) {
    const size_t panel_bytes = tl_panel_bytes(dt, k);
    float out[3 * 4 * TL_PANEL]; /* R <= 3, P <= 4 */
    const stream_parts sp = stream_parts_of((o1 - o0 + TL_PANEL - 1) / TL_PANEL, P);
    for (int g = 0; g < sp.part; g++) {
        const int width = stream_width(&sp, g);
        const uint8_t *panel = (const uint8_t *)w + (size_t)(o0 / TL_PANEL + g) * panel_bytes;
        for (int r = 0; r < n;) {
            const int left = n - r, rows = left == 4 ? 2 : left >= 3 ? 3 : left;
            by_width[width - 1][rows - 1](x, r, k, panel, (size_t)sp.part * panel_bytes, out);
            for (int p = 0; p < width; p++) {
                const int col = stream_col(&sp, o0, p, g);
                store_tile(out, rows, width, p, o1 - col < TL_PANEL ? o1 - col : TL_PANEL, bias, col,
                           y + (size_t)r * (size_t)ldy, ldy);
            }
            r += rows;
        }
    }
}

#endif

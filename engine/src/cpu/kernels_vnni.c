/* kernels_vnni.c: q4 and q8 matmuls with AVX512-VNNI (q4: vpdpbusd, 16 lanes x 4 byte
 * products into int32 per instruction; q8: vpdpwssd, 16 lanes x 2 int16 products).
 * Compiled with -mavx512f -mavx512bw -mavx512vnni -mf16c in a file of its own, so that no
 * other kernel picks up instructions a plain AVX-512 CPU lacks; called only after a run-time
 * CPU check.
 *
 * The packed q block layout (kernels.h) is vpdpbusd's shape: one 64-byte load is 16 output
 * lanes x 4 inputs, multiplied by 4 activation bytes broadcast to every lane. The nibbles
 * are unsigned (as vpdpbusd's first operand must be), so the sum is corrected by 8 x the
 * activations' group sum; integers are exact, and the float steps are kernels.h's canonical
 * ones, so the result is bit-identical to the generic and AVX2 kernels. */
#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#include "avx2_inline.h"

/* A group's step of the canonical q order (kernels.h): acc = fma(scale * d, (float)isum, acc). */
static inline __m512 fold_group(__m512 acc, __m512 scales, float d, __m512i isum) {
    return _mm512_fmadd_ps(_mm512_mul_ps(scales, _mm512_set1_ps(d)), _mm512_cvtepi32_ps(isum), acc);
}

static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* q4 tiles (qtile_fn): R input rows x P panels, panel p at `panel` + p * `stride` bytes,
   R x P outputs into out[R][P][TL_PANEL]. Every weight load feeds the R rows; P > 1 panels
   are read side by side from as many parts of a range (qmatmul_rows_parts), each prefetched
   in its own stream (a single row prefetches too; multi-row one-panel tiles are compute's).
   The integer sum of a group runs in two chains per row and panel (the low and the high
   nibbles) to halve vpdpbusd's latency chain; integer addition is exact, so neither the
   split nor the tile can change a bit. */
#define DEFINE_VNNI_Q4_TILE(NAME, R, P)                                                   \
    static inline void NAME(const tl_qrows *x, int row0, int k, const uint8_t *panel, size_t stride, float *out) { \
        const int groups = k / TL_QGROUP;                                                 \
        const size_t bb = tl_qblock_bytes(TL_Q4);                                         \
        const __m512i low4 = _mm512_set1_epi8(15);                                        \
        __m512 acc[R][P];                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();                  \
        for (int g = 0; g < groups; g++) {                                                \
            const uint8_t *blk[P];                                                        \
            __m512i even[R][P], odd[R][P];                                                \
            for (int p = 0; p < P; p++) {                                                 \
                blk[p] = panel + (size_t)p * stride + (size_t)g * bb;                     \
                if (R == 1 || P > 1) prefetch_qblock(blk[p], bb);                         \
                for (int r = 0; r < R; r++) even[r][p] = odd[r][p] = _mm512_setzero_si512(); \
            }                                                                             \
            for (int j = 0; j < 4; j++) {                                                 \
                __m512i xlo[R], xhi[R];                                                   \
                for (int r = 0; r < R; r++) {                                             \
                    const int8_t *xq = x->q + (size_t)(row0 + r) * (size_t)k + (size_t)g * TL_QGROUP; \
                    xlo[r] = bcast4(xq + 4 * j);                                          \
                    xhi[r] = bcast4(xq + 16 + 4 * j);                                     \
                }                                                                         \
                for (int p = 0; p < P; p++) {                                             \
                    const __m512i v = _mm512_loadu_si512(blk[p] + 64 * j);                 \
                    const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4); \
                    for (int r = 0; r < R; r++) {                                         \
                        even[r][p] = _mm512_dpbusd_epi32(even[r][p], lo, xlo[r]);         \
                        odd[r][p] = _mm512_dpbusd_epi32(odd[r][p], hi, xhi[r]);           \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
            for (int p = 0; p < P; p++) {                                                 \
                const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[p] + tl_qscale_offset(TL_Q4)))); \
                for (int r = 0; r < R; r++) {                                             \
                    const size_t gi = (size_t)(row0 + r) * (size_t)groups + (size_t)g;    \
                    const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(even[r][p], odd[r][p]), _mm512_set1_epi32(8 * x->sum[gi])); \
                    acc[r][p] = fold_group(acc[r][p], sw, x->d[gi], isum);                \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++) _mm512_storeu_ps(out + (r * P + p) * TL_PANEL, acc[r][p]); \
    }

DEFINE_VNNI_Q4_TILE(q4_r4, 4, 1)
DEFINE_VNNI_Q4_TILE(q4_r2, 2, 1)
DEFINE_VNNI_Q4_TILE(q4_r1, 1, 1)
DEFINE_VNNI_Q4_TILE(q4_1x4, 1, 4)
DEFINE_VNNI_Q4_TILE(q4_2x3, 2, 3)
DEFINE_VNNI_Q4_TILE(q4_3x2, 3, 2)
DEFINE_VNNI_Q4_TILE(q4_1x3, 1, 3)
DEFINE_VNNI_Q4_TILE(q4_1x2, 1, 2)
DEFINE_VNNI_Q4_TILE(q4_2x2, 2, 2)
DEFINE_VNNI_Q4_TILE(q4_3x1, 3, 1)

/* Two panels of q4 at once for R rows (batched decode, verification, prefill): each
   broadcast of 4 activation bytes feeds two vpdpbusd, where the one-panel tile feeds one;
   each panel's integer sum is its own chain per row, so every output's sums, and thus its
   float steps, are the one-panel tile's. `ahead` (or NULL) is the next `ahead_bytes` of
   panels, prefetched evenly over the groups (prefetch_spread). Measured (k = 768, one
   thread, alternated with the one-panel tiles): +22-32% at 2, 4 and 8 rows, from cache and
   from memory. */
#define DEFINE_VNNI_PAIR(NAME, R)                                                         \
    static inline void NAME(const tl_qrows *x, int row0, int k, const uint8_t *panel, size_t panel_bytes, \
                            const char *ahead, size_t ahead_bytes, float *out) {          \
        const int groups = k / TL_QGROUP;                                                 \
        const size_t bb = tl_qblock_bytes(TL_Q4);                                         \
        const __m512i low4 = _mm512_set1_epi8(15);                                        \
        const size_t per_group = prefetch_per_step(ahead_bytes, (size_t)groups);          \
        const char *fetched = ahead;                                                      \
        __m512 acc[R][2];                                                                 \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();          \
        for (int g = 0; g < groups; g++) {                                                \
            const uint8_t *b0 = panel + (size_t)g * bb, *b1 = b0 + panel_bytes;           \
            if (ahead) fetched = prefetch_spread(fetched, ahead, ahead_bytes, per_group, (size_t)g + 1); \
            __m512i sum[R][2];                                                            \
            for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = _mm512_setzero_si512();   \
            for (int j = 0; j < 4; j++) {                                                 \
                const __m512i v0 = _mm512_loadu_si512(b0 + 64 * j), v1 = _mm512_loadu_si512(b1 + 64 * j); \
                const __m512i lo0 = _mm512_and_si512(v0, low4), lo1 = _mm512_and_si512(v1, low4); \
                const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);     \
                const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);     \
                for (int r = 0; r < R; r++) {                                             \
                    const int8_t *xq = x->q + (size_t)(row0 + r) * (size_t)k + (size_t)g * TL_QGROUP; \
                    const __m512i xlo = bcast4(xq + 4 * j), xhi = bcast4(xq + 16 + 4 * j); \
                    sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], lo0, xlo);                 \
                    sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], lo1, xlo);                 \
                    sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], hi0, xhi);                 \
                    sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], hi1, xhi);                 \
                }                                                                         \
            }                                                                             \
            const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b0 + tl_qscale_offset(TL_Q4)))); \
            const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b1 + tl_qscale_offset(TL_Q4)))); \
            for (int r = 0; r < R; r++) {                                                 \
                const size_t gi = (size_t)(row0 + r) * (size_t)groups + (size_t)g;        \
                const __m512i offset = _mm512_set1_epi32(8 * x->sum[gi]);                 \
                acc[r][0] = fold_group(acc[r][0], s0, x->d[gi], _mm512_sub_epi32(sum[r][0], offset)); \
                acc[r][1] = fold_group(acc[r][1], s1, x->d[gi], _mm512_sub_epi32(sum[r][1], offset)); \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) {                                                     \
            _mm512_storeu_ps(out + (2 * r) * TL_PANEL, acc[r][0]);                        \
            _mm512_storeu_ps(out + (2 * r + 1) * TL_PANEL, acc[r][1]);                    \
        }                                                                                 \
    }

DEFINE_VNNI_PAIR(q4_pair_r4, 4)
DEFINE_VNNI_PAIR(q4_pair_r2, 2)

/* The q4 product for four rows or more (fewer: qmatmul_rows_parts): pairs of panels (the second may be the matrix's
   partial last one) in tiles of 4 and 2 rows, a last single row through the one-panel tile
   on each panel; an odd last panel through qmatmul_panels. */
static void q4_pairs(const tl_qrows *x, int n, int k, const void *w, const float *bias, int o0, int o1,
                     float *y, int ldy, const qtile_fn tiles[3]) {
    const size_t panel_bytes = tl_panel_bytes(TL_Q4, k);
    float out[4 * 2 * TL_PANEL];
    int o = o0;
    for (; o + TL_PANEL < o1; o += 2 * TL_PANEL) {
        const uint8_t *panel = (const uint8_t *)w + (size_t)(o / TL_PANEL) * panel_bytes;
        const int lanes[2] = {TL_PANEL, o1 - o - TL_PANEL < TL_PANEL ? o1 - o - TL_PANEL : TL_PANEL};
        const int next = o + 2 * TL_PANEL < o1 ? (o1 - o - TL_PANEL - 1) / TL_PANEL : 0;
        const char *ahead = next ? (const char *)(panel + 2 * panel_bytes) : NULL;
        const size_t ahead_bytes = (size_t)(next < 2 ? next : 2) * panel_bytes;
        for (int r = 0; r < n;) {
            const int rows = n - r >= 4 ? 4 : n - r >= 2 ? 2 : 1;
            if (rows > 1) {
                (rows == 4 ? q4_pair_r4 : q4_pair_r2)(x, r, k, panel, panel_bytes, r == 0 ? ahead : NULL, ahead_bytes, out);
                for (int p = 0; p < 2; p++)
                    store_tile(out, rows, 2, p, lanes[p], bias, o + p * TL_PANEL, y + (size_t)r * (size_t)ldy, ldy);
            } else {
                for (int p = 0; p < 2; p++) {
                    tiles[2](x, r, k, panel + (size_t)p * panel_bytes, 0, out);
                    store_tile(out, 1, 1, 0, lanes[p], bias, o + p * TL_PANEL, y + (size_t)r * (size_t)ldy, ldy);
                }
            }
            r += rows;
        }
    }
    if (o < o1) qmatmul_panels(x, n, k, w, TL_Q4, bias, o, o1, y, ldy, tiles);
}


/* q8 tiles of several rows compute longer per byte, and prefetch further: 4096 bytes
   ahead against PREFETCH_AHEAD, medians of three alternated rounds from memory, GB/s, one
   thread: 3 rows 18.1 -> 24.1, 4 rows 12.4 -> 14.9, 8 rows 7.7 -> 10.1; two threads 3 rows
   21.1 -> 25.2, 8 rows 14.8 -> 17.7. */
#ifndef Q8_AHEAD
#define Q8_AHEAD(R) ((R) == 1 ? PREFETCH_AHEAD : 4096)
#endif

/* q8 tiles (qtile_fn, as q4's above): 16-bit activations (kernels.h) with vpdpwssd (int16
   pairs into int32). Each half of a sub-block (32 bytes: 8 lanes x 4 inputs, unsigned q +
   128) is widened to int16, so int32 slot s holds lane s/2's inputs 2(s%2) and 2(s%2)+1: one
   64-bit broadcast of the 4 activations feeds it. After the group one permute pair gathers
   each lane's two slots from both halves, and 128 x the activations' sum removes the
   offset. A single row on one panel splits its sums in even and odd sub-blocks to halve the
   latency chains (R x P > 1 tiles have 2RP chains already); exact: integers. A block's 8.5
   lines ahead are prefetched one a sub-block, not all at the group's start (from memory,
   one thread, 1 row x 4 panels: 28.6-29.8 -> 29.8-33.9 GB/s); q4's 4.5 lines measured
   slower spread. */
#define DEFINE_VNNI_Q8_TILE(NAME, R, P)                                                   \
    static inline void NAME(const tl_qrows *x, int row0, int k, const uint8_t *panel, size_t stride, float *out) { \
        const int groups = k / TL_QGROUP, chains = R * P == 1 ? 2 : 1;                   \
        const size_t bb = tl_qblock_bytes(TL_Q8);                                         \
        const __m512i first = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30); \
        const __m512i second = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31); \
        __m512 acc[R][P];                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();                  \
        for (int g = 0; g < groups; g++) {                                                \
            const uint8_t *blk[P];                                                        \
            __m512i lo[R][P][2], hi[R][P][2]; /* lanes 0-7, 8-15; per chain */            \
            for (int p = 0; p < P; p++) {                                                 \
                blk[p] = panel + (size_t)p * stride + (size_t)g * bb;                     \
                if (R == 1 || P > 1) _mm_prefetch((const char *)blk[p] + Q8_AHEAD(R) + 512, TL_PF_HINT); \
                for (int r = 0; r < R; r++) lo[r][p][0] = lo[r][p][1] = hi[r][p][0] = hi[r][p][1] = _mm512_setzero_si512(); \
            }                                                                             \
            for (int j = 0; j < 8; j++) {                                                 \
                const int c = j % chains;                                                 \
                __m512i xb[R];                                                            \
                for (int r = 0; r < R; r++) {                                             \
                    int64_t xv;                                                           \
                    memcpy(&xv, x->q16 + (size_t)(row0 + r) * (size_t)k + (size_t)g * TL_QGROUP + 4 * j, 8); \
                    xb[r] = _mm512_set1_epi64(xv);                                        \
                }                                                                         \
                for (int p = 0; p < P; p++) {                                             \
                    if (R == 1 || P > 1) _mm_prefetch((const char *)blk[p] + Q8_AHEAD(R) + 64 * j, TL_PF_HINT); \
                    const __m512i wl = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk[p] + 64 * j))); \
                    const __m512i wh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk[p] + 64 * j + 32))); \
                    for (int r = 0; r < R; r++) {                                         \
                        lo[r][p][c] = _mm512_dpwssd_epi32(lo[r][p][c], wl, xb[r]);        \
                        hi[r][p][c] = _mm512_dpwssd_epi32(hi[r][p][c], wh, xb[r]);        \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
            for (int p = 0; p < P; p++) {                                                 \
                const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk[p] + tl_qscale_offset(TL_Q8)))); \
                for (int r = 0; r < R; r++) {                                             \
                    const size_t gi = (size_t)(row0 + r) * (size_t)groups + (size_t)g;    \
                    const __m512i l = _mm512_add_epi32(lo[r][p][0], lo[r][p][1]), h = _mm512_add_epi32(hi[r][p][0], hi[r][p][1]); \
                    const __m512i pairs = _mm512_add_epi32(_mm512_permutex2var_epi32(l, first, h), \
                                                           _mm512_permutex2var_epi32(l, second, h)); \
                    acc[r][p] = fold_group(acc[r][p], sw, x->d16[gi], _mm512_sub_epi32(pairs, _mm512_set1_epi32(128 * x->sum16[gi]))); \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++) _mm512_storeu_ps(out + (r * P + p) * TL_PANEL, acc[r][p]); \
    }

DEFINE_VNNI_Q8_TILE(q8_r2, 2, 1)
DEFINE_VNNI_Q8_TILE(q8_r1, 1, 1)
DEFINE_VNNI_Q8_TILE(q8_1x4, 1, 4)
DEFINE_VNNI_Q8_TILE(q8_2x3, 2, 3)
DEFINE_VNNI_Q8_TILE(q8_3x2, 3, 2)
DEFINE_VNNI_Q8_TILE(q8_1x2, 1, 2)
DEFINE_VNNI_Q8_TILE(q8_2x2, 2, 2)
DEFINE_VNNI_Q8_TILE(q8_1x3, 1, 3)
DEFINE_VNNI_Q8_TILE(q8_3x1, 3, 1)

void tl_qmatmul_packed_vnni(const tl_qrows *x, int n, int k, const void *w, tl_dtype dt,
                            const float *bias, int o0, int o1, float *y, int ldy) {
    static const qtile_fn q4_tiles[3] = {q4_r4, q4_r2, q4_r1};
    /* Panels as parts side by side: one to three rows (decode, 2-3 sessions or beams) in
       one tile, 4, 3 or 2 panels wide; q8 batches of 4 rows or more in groups of 3 rows
       over 2 panels (from memory, k 2048, one thread: 4 rows 107-110 -> 137-155 GFLOP/s,
       8 rows 146-152 -> 198-214, 16 rows 193-201 -> 213-230). q4 batches of 4 or more keep
       the adjacent pairs (q4_pairs): its 3 x 2 parts measured no better at 4, 8 and 16.
       The widest part count by row count (1, 2, 3, 4 or more), and the tiles by width and
       row group (qmatmul_rows_parts: 3 rows or fewer are one group). */
    static const qtile_fn q8_by_width[4][3] = {{q8_r1, q8_r2, q8_3x1}, {q8_1x2, q8_2x2, q8_3x2}, {q8_1x3, q8_2x3}, {q8_1x4}};
    static const qtile_fn q4_by_width[4][3] = {{q4_r1, q4_r2, q4_3x1}, {q4_1x2, q4_2x2, q4_3x2}, {q4_1x3, q4_2x3}, {q4_1x4}};
    static const int widest[4] = {4, 3, 2, 2};
    if (n < 1) return;
    if (dt == TL_Q4 && n >= 4) q4_pairs(x, n, k, w, bias, o0, o1, y, ldy, q4_tiles);
    else qmatmul_rows_parts(x, n, k, w, dt, bias, o0, o1, y, ldy, dt == TL_Q8 ? q8_by_width : q4_by_width,
                            widest[n < 4 ? n - 1 : 3]);
}
#endif

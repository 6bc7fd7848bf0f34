/* kernels_avx2.c: AVX2 + FMA + F16C kernels (this file is compiled with -mavx2 -mfma -mf16c
 * and only called after a run-time CPU check).
 *
 * Batch invariance: every (row, column) of a matmul runs the same canonical dot product
 * (see DEFINE_MATMUL) whatever the number of rows, so a row's result cannot depend on
 * what it was computed with. */
#if defined(__x86_64__)
#include <float.h>
#include <math.h>
#include <string.h>

#include "avx2_inline.h"

/* Finishes one (row, column): the four accumulators in a fixed tree, a horizontal sum,
   then the scalar tail from k8 to k. */
static inline float finish(__m256 a0, __m256 a1, __m256 a2, __m256 a3, const float *xr,
                           const void *w, tl_dtype dt, size_t wbase, int k8, int k) {
    float s = hsum(tree4(a0, a1, a2, a3));
    for (int i = k8; i < k; i++) s += xr[i] * tl_weight_at(w, dt, wbase + (size_t)i);
    return s;
}


/* The canonical dot product of one x row with one W row: four 8-lane FMA accumulators
   over k in chunks of 32 (accumulator j takes elements i+8j..i+8j+7), leftover 8-chunks
   into accumulator 0, then finish(). The two-row tile below shares the W loads between
   two x rows but gives each (row, column) exactly this sequence. */
#define DEFINE_MATMUL(NAME, LOAD, DT)                                                     \
    static void NAME(const float *x, int n, int k, const void *w, const float *bias, int o0, \
                     int o1, float *y, int ldy) {                                         \
        const int k32 = k & ~31, k8 = k & ~7;                                             \
        const char *wbytes = (const char *)w;                                             \
        for (int o = o0; o < o1; o++) {                                                   \
            const size_t b = (size_t)o * (size_t)k;                                       \
            int r = 0;                                                                    \
            for (; r + 2 <= n; r += 2) {                                                  \
                const float *xa = x + (size_t)r * (size_t)k, *xb = xa + k;                \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;               \
                __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;                                \
                int i = 0;                                                                \
                for (; i < k32; i += 32) {                                                \
                    __m256 w0 = LOAD(w, b + (size_t)i), w1 = LOAD(w, b + (size_t)i + 8);  \
                    __m256 w2 = LOAD(w, b + (size_t)i + 16), w3 = LOAD(w, b + (size_t)i + 24); \
                    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xa + i), a0);                \
                    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xa + i + 8), a1);            \
                    a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xa + i + 16), a2);           \
                    a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xa + i + 24), a3);           \
                    c0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb + i), c0);                \
                    c1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + i + 8), c1);            \
                    c2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + i + 16), c2);           \
                    c3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + i + 24), c3);           \
                }                                                                         \
                for (; i < k8; i += 8) {                                                  \
                    __m256 w0 = LOAD(w, b + (size_t)i);                                   \
                    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xa + i), a0);                \
                    c0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb + i), c0);                \
                }                                                                         \
                y[(size_t)r * (size_t)ldy + o] = finish(a0, a1, a2, a3, xa, w, DT, b, k8, k); \
                y[(size_t)(r + 1) * (size_t)ldy + o] = finish(c0, c1, c2, c3, xb, w, DT, b, k8, k); \
            }                                                                             \
            for (; r < n; r++) {                                                          \
                const float *xa = x + (size_t)r * (size_t)k;                              \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;               \
                int i = 0;                                                                \
                for (; i < k32; i += 32) {                                                \
                    const char *ahead = wbytes + (b + (size_t)i) * ELEM(DT) + PREFETCH_AHEAD; \
                    _mm_prefetch(ahead, TL_PF_HINT);                                     \
                    if (ELEM(DT) == 4) _mm_prefetch(ahead + 64, TL_PF_HINT);             \
                    a0 = _mm256_fmadd_ps(LOAD(w, b + (size_t)i), _mm256_loadu_ps(xa + i), a0); \
                    a1 = _mm256_fmadd_ps(LOAD(w, b + (size_t)i + 8), _mm256_loadu_ps(xa + i + 8), a1); \
                    a2 = _mm256_fmadd_ps(LOAD(w, b + (size_t)i + 16), _mm256_loadu_ps(xa + i + 16), a2); \
                    a3 = _mm256_fmadd_ps(LOAD(w, b + (size_t)i + 24), _mm256_loadu_ps(xa + i + 24), a3); \
                }                                                                         \
                for (; i < k8; i += 8)                                                    \
                    a0 = _mm256_fmadd_ps(LOAD(w, b + (size_t)i), _mm256_loadu_ps(xa + i), a0); \
                y[(size_t)r * (size_t)ldy + o] = finish(a0, a1, a2, a3, xa, w, DT, b, k8, k); \
            }                                                                             \
        }                                                                                 \
        if (bias)                                                                         \
            for (int r = 0; r < n; r++)                                                   \
                for (int oo = o0; oo < o1; oo++) y[(size_t)r * (size_t)ldy + oo] += bias[oo]; \
    }

DEFINE_MATMUL(matmul_f32, load_f32, TL_F32)
DEFINE_MATMUL(matmul_f16, load_f16, TL_F16)
DEFINE_MATMUL(matmul_bf16, load_bf16, TL_BF16)

static void matmul_avx2(const float *x, int n, int k, const void *w, tl_dtype dt,
                        const float *bias, int o0, int o1, float *y, int ldy) {
    switch (dt) {
    case TL_F16: matmul_f16(x, n, k, w, bias, o0, o1, y, ldy); break;
    case TL_BF16: matmul_bf16(x, n, k, w, bias, o0, o1, y, ldy); break;
    default: matmul_f32(x, n, k, w, bias, o0, o1, y, ldy); break;
    }
}

/* ---------------------------------------------------------------- packed panels */

/* 16 lanes = two ymm halves; four partial accumulators per half (k mod 4). A single row
   keeps all eight in registers and streams its panel once, prefetching ahead in its own
   stream. Several rows share every weight load in tiles of R rows whose 2 x R x 4 partial
   sums do not fit 16 registers: a tile computes them JW residues at a time (JW = 1: one
   pass over the panel per residue k mod 4, re-read from L1/L2; JW = 2: two), each partial
   sum over its k in increasing order with the same fma, the leftover k into the k = 0
   (mod 4) sum after its run, then the same final tree: the single row's result, bit for
   bit. `ahead` (or NULL) is the next panel, prefetched evenly over the tile's passes
   (prefetch_spread). Measured on GPT-2-shaped f16 panels (k = 768, one thread, from cache
   and from memory alike): one row at a time ran at 38-59 GFLOP/s whatever the row count;
   the tiles run at 85-92 (3 rows), 81-83 (4) and 96-104 GFLOP/s (6 to 16 rows), against a
   112 GFLOP/s FMA peak (tinyloop-kernel-bench --isa avx2). */
#define DEFINE_PACKED_TILE(NAME, LOAD, DT, R, JW)                                         \
    static inline void NAME(const float *x, int k, const void *w, size_t panel, const char *ahead, float *out) { \
        const int k4 = k & ~3, passes = 4 / (JW);                                         \
        const size_t panel_bytes = tl_panel_bytes(DT, k);                                 \
        const char *fetched = ahead;                                                      \
        const size_t per_step = prefetch_per_step(panel_bytes, (size_t)passes * (size_t)(k4 / 4)); \
        __m256 partial[R][2][4];                                                          \
        for (int jb = 0; jb < 4; jb += JW) {                                              \
            __m256 acc[R][2][JW];                                                         \
            for (int r = 0; r < R; r++)                                                   \
                for (int jj = 0; jj < JW; jj++) acc[r][0][jj] = acc[r][1][jj] = _mm256_setzero_ps(); \
            for (int i = 0; i < k4; i += 4) {                                             \
                if (ahead)                                                                \
                    fetched = prefetch_spread(fetched, ahead, panel_bytes, per_step,      \
                                              (size_t)(jb / (JW)) * (size_t)(k4 / 4) + (size_t)(i / 4) + 1); \
                for (int jj = 0; jj < JW; jj++) {                                         \
                    const size_t at = panel + (size_t)(i + jb + jj) * TL_PANEL;           \
                    const __m256 lo = LOAD(w, at), hi = LOAD(w, at + 8);                  \
                    for (int r = 0; r < R; r++) {                                         \
                        const __m256 xv = _mm256_broadcast_ss(x + (size_t)r * (size_t)k + (size_t)(i + jb + jj)); \
                        acc[r][0][jj] = _mm256_fmadd_ps(lo, xv, acc[r][0][jj]);           \
                        acc[r][1][jj] = _mm256_fmadd_ps(hi, xv, acc[r][1][jj]);           \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
            if (jb == 0)                                                                  \
                for (int i = k4; i < k; i++) {                                            \
                    const size_t at = panel + (size_t)i * TL_PANEL;                       \
                    const __m256 lo = LOAD(w, at), hi = LOAD(w, at + 8);                  \
                    for (int r = 0; r < R; r++) {                                         \
                        const __m256 xv = _mm256_broadcast_ss(x + (size_t)r * (size_t)k + (size_t)i); \
                        acc[r][0][0] = _mm256_fmadd_ps(lo, xv, acc[r][0][0]);             \
                        acc[r][1][0] = _mm256_fmadd_ps(hi, xv, acc[r][1][0]);             \
                    }                                                                     \
                }                                                                         \
            for (int r = 0; r < R; r++)                                                   \
                for (int jj = 0; jj < JW; jj++) {                                         \
                    partial[r][0][jb + jj] = acc[r][0][jj];                               \
                    partial[r][1][jb + jj] = acc[r][1][jj];                               \
                }                                                                         \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int h = 0; h < 2; h++)                                                   \
                _mm256_storeu_ps(out + r * TL_PANEL + 8 * h, tree4(partial[r][h][0], partial[r][h][1], partial[r][h][2], partial[r][h][3])); \
    }

/* Row tiles: 6 (JW 1), 4 (JW 1), 3 (JW 2), 1 (all eight sums at once); 5 rows as 4 + 1. Two
   rows run as two single rows: a 2-row tile (8 sums a pass, the FMA latency barely hidden)
   ran at 47 GFLOP/s where two single rows run at 62. */
static inline int avx2_tile_rows(int left) { return left >= 6 ? 6 : left == 5 || left == 4 ? 4 : left == 3 ? 3 : 1; }

#define DEFINE_PACKED(NAME, LOAD, DT)                                                     \
    DEFINE_PACKED_TILE(NAME##_r6, LOAD, DT, 6, 1)                                         \
    DEFINE_PACKED_TILE(NAME##_r4, LOAD, DT, 4, 1)                                         \
    DEFINE_PACKED_TILE(NAME##_r3, LOAD, DT, 3, 2)                                         \
    static inline void NAME##_r1(const float *xr, int k, const void *w, size_t panel, float *out) { \
        const int k4 = k & ~3;                                                            \
        const char *wbytes = (const char *)w;                                             \
        __m256 lo[4], hi[4];                                                              \
        for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();                  \
        for (int i = 0; i < k4; i += 4) {                                                 \
            for (unsigned p_ = 0; p_ < ELEM(DT); p_++) /* 4 k x 16 lanes = ELEM lines */  \
                _mm_prefetch(wbytes + (panel + (size_t)i * TL_PANEL) * ELEM(DT) + PREFETCH_AHEAD + 64 * p_, TL_PF_HINT); \
            for (int j = 0; j < 4; j++) {                                                 \
                const size_t at = panel + (size_t)(i + j) * TL_PANEL;                     \
                const __m256 xv = _mm256_broadcast_ss(xr + i + j);                        \
                lo[j] = _mm256_fmadd_ps(LOAD(w, at), xv, lo[j]);                          \
                hi[j] = _mm256_fmadd_ps(LOAD(w, at + 8), xv, hi[j]);                      \
            }                                                                             \
        }                                                                                 \
        for (int i = k4; i < k; i++) {                                                    \
            const size_t at = panel + (size_t)i * TL_PANEL;                               \
            const __m256 xv = _mm256_broadcast_ss(xr + i);                                \
            lo[0] = _mm256_fmadd_ps(LOAD(w, at), xv, lo[0]);                              \
            hi[0] = _mm256_fmadd_ps(LOAD(w, at + 8), xv, hi[0]);                          \
        }                                                                                 \
        _mm256_storeu_ps(out, tree4(lo[0], lo[1], lo[2], lo[3]));                        \
        _mm256_storeu_ps(out + 8, tree4(hi[0], hi[1], hi[2], hi[3]));                    \
    }                                                                                     \
    static void NAME(const float *x, int n, int k, const void *w, const float *bias, int o0, \
                     int o1, float *y, int ldy) {                                         \
        float out[6 * TL_PANEL];                                                          \
        for (int o = o0; o < o1; o += TL_PANEL) {                                         \
            const size_t panel = (size_t)(o / TL_PANEL) * (size_t)k * TL_PANEL;           \
            const int lanes = o1 - o < TL_PANEL ? o1 - o : TL_PANEL;                      \
            for (int r = 0; r < n;) {                                                     \
                const int rows = avx2_tile_rows(n - r);                                   \
                const float *xr = x + (size_t)r * (size_t)k;                              \
                /* the first tile of a panel streams the next one in */                  \
                const char *ahead = r == 0 && o + TL_PANEL < o1                           \
                    ? (const char *)w + (panel + (size_t)k * TL_PANEL) * ELEM(DT) : NULL; \
                switch (rows) {                                                           \
                case 6: NAME##_r6(xr, k, w, panel, ahead, out); break;                    \
                case 4: NAME##_r4(xr, k, w, panel, ahead, out); break;                    \
                case 3: NAME##_r3(xr, k, w, panel, ahead, out); break;                    \
                default: NAME##_r1(xr, k, w, panel, out); break;                          \
                }                                                                         \
                store_tile(out, rows, 1, 0, lanes, bias, o, y + (size_t)r * (size_t)ldy, ldy); \
                r += rows;                                                                \
            }                                                                             \
        }                                                                                 \
    }

DEFINE_PACKED(packed_f32, load_f32, TL_F32)
DEFINE_PACKED(packed_f16, load_f16, TL_F16)
DEFINE_PACKED(packed_bf16, load_bf16, TL_BF16)

static void matmul_packed_avx2(const float *x, int n, int k, const void *w, tl_dtype dt,
                               const float *bias, int o0, int o1, float *y, int ldy) {
    switch (dt) {
    case TL_F16: packed_f16(x, n, k, w, bias, o0, o1, y, ldy); break;
    case TL_BF16: packed_bf16(x, n, k, w, bias, o0, o1, y, ldy); break;
    default: packed_f32(x, n, k, w, bias, o0, o1, y, ldy); break;
    }
}

/* ---------------------------------------------------------------- q8 / q4 panels */

/* A group's step of the canonical q order (kernels.h): acc = fma(scale * d, (float)isum, acc). */
static inline __m256 fold_group(__m256 acc, __m256 scales, float d, __m256i isum) {
    return _mm256_fmadd_ps(_mm256_mul_ps(scales, _mm256_set1_ps(d)), _mm256_cvtepi32_ps(isum), acc);
}

/* q8/q4 tiles (qtile_fn): R input rows x P panels, panel p at `panel` + p * `stride` bytes,
   into out[R][P][TL_PANEL]; every weight load feeds the R rows. P > 1 panels are read side by
   side from as many parts of a range (qmatmul_rows_parts), each prefetched in its own
   stream (a single row prefetches too; multi-row one-panel tiles are compute's).
   q8: 16-bit activations (kernels.h). 16 lanes = four ymm quarters; a sub-block's 16 bytes
   per quarter are 4 lanes x 4 inputs, widened to int16 (the bytes are unsigned, q + 128) and
   multiplied by the 4 activations with madd into int32 pairs [lane][inputs 0-1 | 2-3]; after
   the group, hadd joins the pairs (the lanes come out as 0 1 4 5 | 2 3 6 7 and a qword
   permute restores their order) and 128 x the activations' sum removes the offset. Integer
   sums are exact, so the order of the adds cannot show. A block's lines are prefetched one
   a sub-block (from memory, one thread, 1 row x 2 panels: 26.2 -> 28.0-33.7 GB/s). */
#define DEFINE_Q8_TILE(NAME, R, P)                                                        \
    static inline void NAME(const tl_qrows *x, int row0, int k, const uint8_t *panel, size_t stride, float *out) { \
        const int groups = k / TL_QGROUP;                                                 \
        const size_t bb = tl_qblock_bytes(TL_Q8);                                         \
        __m256 acc[R][P][2];                                                              \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps(); \
        for (int g = 0; g < groups; g++) {                                                \
            const uint8_t *blk[P];                                                        \
            __m256i dp[R][P][4];                                                          \
            for (int p = 0; p < P; p++) {                                                 \
                blk[p] = panel + (size_t)p * stride + (size_t)g * bb;                     \
                if (R == 1 || P > 1) _mm_prefetch((const char *)blk[p] + PREFETCH_AHEAD + 512, TL_PF_HINT); \
                for (int r = 0; r < R; r++)                                               \
                    dp[r][p][0] = dp[r][p][1] = dp[r][p][2] = dp[r][p][3] = _mm256_setzero_si256(); \
            }                                                                             \
            for (int j = 0; j < 8; j++) {                                                 \
                __m256i xb[R];                                                            \
                for (int r = 0; r < R; r++) {                                             \
                    int64_t xv;                                                           \
                    memcpy(&xv, x->q16 + (size_t)(row0 + r) * (size_t)k + (size_t)g * TL_QGROUP + 4 * j, 8); \
                    xb[r] = _mm256_set1_epi64x(xv);                                       \
                }                                                                         \
                for (int p = 0; p < P; p++) {                                             \
                    if (R == 1 || P > 1) _mm_prefetch((const char *)blk[p] + PREFETCH_AHEAD + 64 * j, TL_PF_HINT); \
                    for (int c = 0; c < 4; c++) {                                         \
                        const __m256i wq = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk[p] + 64 * j + 16 * c))); \
                        for (int r = 0; r < R; r++) dp[r][p][c] = _mm256_add_epi32(dp[r][p][c], _mm256_madd_epi16(wq, xb[r])); \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
            for (int p = 0; p < P; p++)                                                   \
                for (int h = 0; h < 2; h++) {                                             \
                    const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk[p] + tl_qscale_offset(TL_Q8) + 16 * h))); \
                    for (int r = 0; r < R; r++) {                                         \
                        const size_t gi = (size_t)(row0 + r) * (size_t)groups + (size_t)g; \
                        const __m256i lanes = _mm256_permute4x64_epi64(_mm256_hadd_epi32(dp[r][p][2 * h], dp[r][p][2 * h + 1]), 0xD8); \
                        const __m256i isum = _mm256_sub_epi32(lanes, _mm256_set1_epi32(128 * x->sum16[gi])); \
                        acc[r][p][h] = fold_group(acc[r][p][h], sw, x->d16[gi], isum);    \
                    }                                                                     \
                }                                                                         \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++) {                                                 \
                _mm256_storeu_ps(out + (r * P + p) * TL_PANEL, acc[r][p][0]);             \
                _mm256_storeu_ps(out + (r * P + p) * TL_PANEL + 8, acc[r][p][1]);         \
            }                                                                             \
    }

/* q4: quantised activations. Integer dot products of 4 inputs per lane: maddubs multiplies
   the unsigned nibbles by the signed activation bytes into int16 pairs (2 * 15 * 127 and
   the sum of two such results, 4 * 15 * 127, cannot saturate), madd with ones adds the
   pairs into int32. A block's 4.5 lines are prefetched at the group's start. */
#define DEFINE_Q4_TILE(NAME, R, P)                                                        \
    static inline void NAME(const tl_qrows *x, int row0, int k, const uint8_t *panel, size_t stride, float *out) { \
        const int groups = k / TL_QGROUP;                                                 \
        const size_t bb = tl_qblock_bytes(TL_Q4);                                         \
        const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(15);           \
        __m256 acc[R][P][2];                                                              \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps(); \
        for (int g = 0; g < groups; g++) {                                                \
            const uint8_t *blk[P];                                                        \
            for (int p = 0; p < P; p++) {                                                 \
                blk[p] = panel + (size_t)p * stride + (size_t)g * bb;                     \
                if (R == 1 || P > 1) prefetch_qblock(blk[p], bb);                         \
            }                                                                             \
            for (int h = 0; h < 2; h++) {                                                 \
                __m256i dp[R][P];                                                         \
                for (int r = 0; r < R; r++)                                               \
                    for (int p = 0; p < P; p++) dp[r][p] = _mm256_setzero_si256();        \
                for (int j = 0; j < 4; j++) {                                             \
                    __m256i xa[R], xb[R];                                                 \
                    for (int r = 0; r < R; r++) {                                         \
                        const int8_t *xq = x->q + (size_t)(row0 + r) * (size_t)k + (size_t)g * TL_QGROUP; \
                        int32_t a, b;                                                     \
                        memcpy(&a, xq + 4 * j, 4);                                        \
                        memcpy(&b, xq + 16 + 4 * j, 4);                                   \
                        xa[r] = _mm256_set1_epi32(a);                                     \
                        xb[r] = _mm256_set1_epi32(b);                                     \
                    }                                                                     \
                    for (int p = 0; p < P; p++) {                                         \
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(blk[p] + j * 64 + h * 32)); \
                        const __m256i lo = _mm256_and_si256(v, low4);                     \
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4); \
                        for (int r = 0; r < R; r++) {                                     \
                            const __m256i prod = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa[r]), _mm256_maddubs_epi16(hi, xb[r])); \
                            dp[r][p] = _mm256_add_epi32(dp[r][p], _mm256_madd_epi16(prod, ones)); \
                        }                                                                 \
                    }                                                                     \
                }                                                                         \
                for (int p = 0; p < P; p++) {                                             \
                    const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk[p] + tl_qscale_offset(TL_Q4) + 16 * h))); \
                    for (int r = 0; r < R; r++) {                                         \
                        const size_t gi = (size_t)(row0 + r) * (size_t)groups + (size_t)g; \
                        const __m256i isum = _mm256_sub_epi32(dp[r][p], _mm256_set1_epi32(8 * x->sum[gi])); \
                        acc[r][p][h] = fold_group(acc[r][p][h], sw, x->d[gi], isum);      \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++) {                                                 \
                _mm256_storeu_ps(out + (r * P + p) * TL_PANEL, acc[r][p][0]);             \
                _mm256_storeu_ps(out + (r * P + p) * TL_PANEL + 8, acc[r][p][1]);         \
            }                                                                             \
    }

DEFINE_Q8_TILE(q8_r2, 2, 1)
DEFINE_Q8_TILE(q8_r1, 1, 1)
DEFINE_Q8_TILE(q8_1x2, 1, 2)
DEFINE_Q8_TILE(q8_2x2, 2, 2)
DEFINE_Q8_TILE(q8_3x2, 3, 2)
DEFINE_Q8_TILE(q8_3x1, 3, 1)
DEFINE_Q4_TILE(q4_r2, 2, 1)
DEFINE_Q4_TILE(q4_r1, 1, 1)
DEFINE_Q4_TILE(q4_1x2, 1, 2)
DEFINE_Q4_TILE(q4_2x2, 2, 2)
DEFINE_Q4_TILE(q4_3x2, 3, 2)
DEFINE_Q4_TILE(q4_3x1, 3, 1)

void tl_qmatmul_packed_avx2(const tl_qrows *x, int n, int k, const void *w, tl_dtype dt,
                            const float *bias, int o0, int o1, float *y, int ldy) {
    /* Every row count reads 2 panels as parts side by side, rows in groups of up to 3 over
       them (qmatmul_rows_parts; 2 or 3 rows spill some of the 16 registers, and still beat
       the one-panel tiles, which streamed one panel at a time: from memory, k 2048, one
       thread, q8 2 rows 49-67 -> 64-81 GFLOP/s, 8 rows 57-80 -> 83-84, q4 3 rows 87-90 ->
       121-165, 8 rows 109-118 -> 124-168); the one-panel tiles where the last part ends. */
    static const qtile_fn q8_by_width[4][3] = {{q8_r1, q8_r2, q8_3x1}, {q8_1x2, q8_2x2, q8_3x2}};
    static const qtile_fn q4_by_width[4][3] = {{q4_r1, q4_r2, q4_3x1}, {q4_1x2, q4_2x2, q4_3x2}};
    qmatmul_rows_parts(x, n, k, w, dt, bias, o0, o1, y, ldy, dt == TL_Q8 ? q8_by_width : q4_by_width, 2);
}

/* dots: eight keys at a time, so eight independent FMA chains hide the FMA latency, and
   their eight horizontal sums run as one transposed tree (hsum8); then four, then one.
   Each key still gets exactly the sequence kernels.h fixes. */

/* The horizontal sums of a[0..7], each by hsum's tree ((l0+l4) + (l2+l6)) + ((l1+l5) +
   (l3+l7)), eight at once: every add is one of hsum's, on the same operands. */
static inline __m256 hsum8(const __m256 a[8]) {
    /* halves: [a_j lanes 0-3 + lanes 4-7] for j = 0, 1 in one register, and so on */
    const __m256 h01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
    const __m256 h23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
    const __m256 h45 = _mm256_add_ps(_mm256_permute2f128_ps(a[4], a[5], 0x20), _mm256_permute2f128_ps(a[4], a[5], 0x31));
    const __m256 h67 = _mm256_add_ps(_mm256_permute2f128_ps(a[6], a[7], 0x20), _mm256_permute2f128_ps(a[6], a[7], 0x31));
    /* pairs (h0 + h2, h1 + h3): [key 0, key 2 | key 1, key 3] and [4, 6 | 5, 7] */
    const __m256 p0123 = _mm256_add_ps(_mm256_shuffle_ps(h01, h23, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm256_shuffle_ps(h01, h23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 p4567 = _mm256_add_ps(_mm256_shuffle_ps(h45, h67, _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm256_shuffle_ps(h45, h67, _MM_SHUFFLE(3, 2, 3, 2)));
    /* the last add: [s0 s2 s4 s6 | s1 s3 s5 s7], put in key order */
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(p0123, p4567, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(p0123, p4567, _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* dots over keys of f32 or f16 elements (LOAD8 widens 8, WIDEN1 one, exactly). */
#define DEFINE_DOTS_AVX2(NAME, ELEM_T, LOAD8, WIDEN1)                                           \
    static float NAME##_tail(const float *q, const ELEM_T *b, int k8, int k, float s) {         \
        for (int i = k8; i < k; i++) s += q[i] * WIDEN1(b[i]);                                  \
        return s;                                                                               \
    }                                                                                           \
    static void NAME(const float *q, const ELEM_T *const *keys, int n, int k, float *scores) {  \
        const int k8 = k & ~7;                                                                  \
        int j = 0;                                                                              \
        for (; j + 8 <= n; j += 8) {                                                            \
            __m256 acc[8];                                                                      \
            for (int t = 0; t < 8; t++) acc[t] = _mm256_setzero_ps();                           \
            for (int i = 0; i < k8; i += 8) {                                                   \
                const __m256 qv = _mm256_loadu_ps(q + i);                                       \
                for (int t = 0; t < 8; t++) acc[t] = _mm256_fmadd_ps(LOAD8(keys[j + t] + i), qv, acc[t]); \
            }                                                                                   \
            _mm256_storeu_ps(scores + j, hsum8(acc));                                           \
            if (k8 < k)                                                                         \
                for (int t = 0; t < 8; t++) scores[j + t] = NAME##_tail(q, keys[j + t], k8, k, scores[j + t]); \
        }                                                                                       \
        for (; j + 4 <= n; j += 4) {                                                            \
            const ELEM_T *b0 = keys[j], *b1 = keys[j + 1], *b2 = keys[j + 2], *b3 = keys[j + 3]; \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                         \
            for (int i = 0; i < k8; i += 8) {                                                   \
                const __m256 qv = _mm256_loadu_ps(q + i);                                       \
                a0 = _mm256_fmadd_ps(LOAD8(b0 + i), qv, a0);                                    \
                a1 = _mm256_fmadd_ps(LOAD8(b1 + i), qv, a1);                                    \
                a2 = _mm256_fmadd_ps(LOAD8(b2 + i), qv, a2);                                    \
                a3 = _mm256_fmadd_ps(LOAD8(b3 + i), qv, a3);                                    \
            }                                                                                   \
            scores[j] = NAME##_tail(q, b0, k8, k, hsum(a0));                                    \
            scores[j + 1] = NAME##_tail(q, b1, k8, k, hsum(a1));                                \
            scores[j + 2] = NAME##_tail(q, b2, k8, k, hsum(a2));                                \
            scores[j + 3] = NAME##_tail(q, b3, k8, k, hsum(a3));                                \
        }                                                                                       \
        for (; j < n; j++) {                                                                    \
            __m256 acc = _mm256_setzero_ps();                                                   \
            for (int i = 0; i < k8; i += 8) acc = _mm256_fmadd_ps(LOAD8(keys[j] + i), _mm256_loadu_ps(q + i), acc); \
            scores[j] = NAME##_tail(q, keys[j], k8, k, hsum(acc));                              \
        }                                                                                       \
    }
DEFINE_DOTS_AVX2(dots_avx2, float, load8_f32, widen1_f32)
DEFINE_DOTS_AVX2(dots_f16_avx2, uint16_t, load8_f16, widen1_f16)

/* axpys: y is read and written once per 32 elements for the whole block of keys, not once
   per key; per element the fma sequence over j is the one kernels.h fixes. */
static void axpys_avx2(float *y, const float *a, const float *const *x, int n, int k) {
    const int k8 = k & ~7;
    int i = 0;
    AXPYS_BLOCKS(8, __m256, _mm256_loadu_ps, load8_f32, _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps)
    axpys_from(y, a, x, n, i, k);
}
static void axpys_f16_avx2(float *y, const float *a, const uint16_t *const *x, int n, int k) {
    const int k8 = k & ~7;
    int i = 0;
    AXPYS_BLOCKS(8, __m256, _mm256_loadu_ps, load8_f16, _mm256_storeu_ps, _mm256_set1_ps, _mm256_fmadd_ps)
    axpys_from_f16(y, a, x, n, i, k);
}

/* F16C rounds to nearest even (imm 0) as tl_f32_to_f16 does, NaNs included (test_isa). */
static void narrow_f16_avx2(const float *src, int n, uint16_t *dst) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = tl_f32_to_f16(src[i]);
}

/* tl_cpu_quantize_rows (kernels.h) 8 lanes at a time, the same bits as the generic loop:
   max|x| is exact in any order, x * (qmax / max|x|) and the 1.5 * 2^23 rounding are the
   same IEEE operations, and the group sums are exact integers. The generic loop took
   about 1 ns an element, a few percent of a q4 decode token at two threads (serial, on the
   calling thread, while the others wait for the product); this loop 0.36-0.40. The AVX-512
   families run it too. */
static inline float hmax(__m256 v) { /* (exact in any order over finite lanes; with an inf or a
                                          NaN among them the caller discards it) */
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

void tl_quantize_rows_avx2(const float *x, int n, int k, int bits, void *q, float *d, int32_t *sum) {
    const int groups = k / TL_QGROUP, qmax = bits == 16 ? 32767 : 127;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), largest = _mm256_set1_ps(FLT_MAX);
    const __m256 magic = _mm256_set1_ps(0x1.8p23f);
    const __m256i hi = _mm256_set1_epi32(qmax), lo = _mm256_set1_epi32(-qmax);
    for (size_t g = 0; g < (size_t)n * (size_t)groups; g++) {
        const float *xg = x + g * TL_QGROUP;
        __m256 v[TL_QGROUP / 8], amax = _mm256_setzero_ps();
        int finite = 0xff;
        for (int j = 0; j < TL_QGROUP / 8; j++) {
            v[j] = _mm256_loadu_ps(xg + 8 * j);
            const __m256 a = _mm256_and_ps(v[j], abs_mask);
            amax = _mm256_max_ps(amax, a);
            finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, largest, _CMP_LE_OQ)); /* false for inf, NaN */
        }
        const float group_max = hmax(amax);
        if (finite != 0xff || group_max < 0x1p-100f) { /* the generic loop's zero group */
            if (bits == 16) memset((int16_t *)q + g * TL_QGROUP, 0, TL_QGROUP * sizeof(int16_t));
            else memset((int8_t *)q + g * TL_QGROUP, 0, TL_QGROUP);
            d[g] = finite == 0xff ? 0.0f : NAN;
            sum[g] = 0;
            continue;
        }
        const __m256 id = _mm256_set1_ps((float)qmax / group_max);
        __m256i total = _mm256_setzero_si256();
        for (int j = 0; j < TL_QGROUP / 8; j++) {
            const __m256 t = _mm256_mul_ps(v[j], id);
            __m256i r = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(t, magic), magic)); /* exact: integral */
            r = _mm256_max_epi32(_mm256_min_epi32(r, hi), lo);
            total = _mm256_add_epi32(total, r);
            /* (|r| <= qmax: the saturating packs keep every value) */
            const __m128i r16 = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
            if (bits == 16) _mm_storeu_si128((__m128i *)((int16_t *)q + g * TL_QGROUP + 8 * j), r16);
            else _mm_storel_epi64((__m128i *)((int8_t *)q + g * TL_QGROUP + 8 * j), _mm_packs_epi16(r16, r16));
        }
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        d[g] = group_max / (float)qmax;
        sum[g] = _mm_cvtsi128_si32(s4);
    }
}

const tl_kernels tl_kernels_avx2 = {"avx2", matmul_avx2, matmul_packed_avx2, tl_qmatmul_packed_avx2, dots_avx2, axpys_avx2,
                                    NULL, NULL, /* rows as they are */
                                    dots_f16_avx2, axpys_f16_avx2, narrow_f16_avx2, tl_quantize_rows_avx2};
#endif

/* kernels_avx512.c: AVX-512 matmul for several rows at once (prefill, speculative
 * verification, beam steps). Compiled with -mavx512f -mavx512vl -mfma -mf16c; chosen at run time.
 *
 * It is bit-identical to the AVX2 kernel, which stays in charge of single rows: a 512-bit
 * register holds two of the canonical 8-lane accumulators side by side (zA = [a0 | a1],
 * zB = [a2 | a3]), a 16-element load feeds both with exactly the elements the AVX2 kernel
 * gives them, FMAs are per lane, and the leftover 8-chunks and the final reduction run on
 * the same 256-bit halves in the same order. What changes is only how many rows share each
 * weight load: 8 here instead of 2. */
#if defined(__x86_64__)
#include <cpuid.h>
#include <stdlib.h>
#include <string.h>

#include "avx2_inline.h"

static inline __m256 high_half(__m512 z) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
}

static inline __m512 l16_f32(const void *w, size_t i) { return _mm512_loadu_ps((const float *)w + i); }
static inline __m512 l16_f16(const void *w, size_t i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
}
static inline __m512 l16_bf16(const void *w, size_t i) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* The AVX2 kernel's finish(): leftover 8-chunks into a0, the fixed tree, the scalar tail. */
#define FINISH(zA, zB, xr, L8, DT)                                                        \
    do {                                                                                  \
        __m256 a0 = _mm512_castps512_ps256(zA), a1 = high_half(zA);                       \
        __m256 a2 = _mm512_castps512_ps256(zB), a3 = high_half(zB);                       \
        for (int i = k32; i < k8; i += 8) a0 = _mm256_fmadd_ps(L8(w, b + (size_t)i), _mm256_loadu_ps((xr) + i), a0); \
        float s_ = hsum(tree4(a0, a1, a2, a3));                                           \
        for (int i = k8; i < k; i++) s_ += (xr)[i] * tl_weight_at(w, DT, b + (size_t)i);  \
        *out_ = s_;                                                                       \
    } while (0)

#define DEFINE_ROWS(NAME, L16, L8, DT, R)                                                 \
    static inline void NAME(const float *x, int k, const void *w, size_t b, float *y, int ldy) { \
        const int k32 = k & ~31, k8 = k & ~7;                                             \
        __m512 zA[R], zB[R];                                                              \
        for (int r = 0; r < R; r++) zA[r] = zB[r] = _mm512_setzero_ps();                  \
        for (int i = 0; i < k32; i += 32) {                                               \
            const __m512 wA = L16(w, b + (size_t)i), wB = L16(w, b + (size_t)i + 16);     \
            for (int r = 0; r < R; r++) {                                                 \
                const float *xr = x + (size_t)r * (size_t)k + i;                          \
                zA[r] = _mm512_fmadd_ps(wA, _mm512_loadu_ps(xr), zA[r]);                  \
                zB[r] = _mm512_fmadd_ps(wB, _mm512_loadu_ps(xr + 16), zB[r]);             \
            }                                                                             \
        }                                                                                 \
        for (int r = 0; r < R; r++) {                                                     \
            float *out_ = y + (size_t)r * (size_t)ldy;                                    \
            FINISH(zA[r], zB[r], x + (size_t)r * (size_t)k, L8, DT);                     \
        }                                                                                 \
    }

#define DEFINE_MATMUL(NAME, L16, L8, DT)                                                  \
    DEFINE_ROWS(NAME##_r8, L16, L8, DT, 8)                                                \
    DEFINE_ROWS(NAME##_r4, L16, L8, DT, 4)                                                \
    DEFINE_ROWS(NAME##_r1, L16, L8, DT, 1)                                                \
    static void NAME(const float *x, int n, int k, const void *w, const float *bias, int o0, \
                     int o1, float *y, int ldy) {                                         \
        for (int o = o0; o < o1; o++) {                                                   \
            const size_t b = (size_t)o * (size_t)k;                                       \
            int r = 0;                                                                    \
            for (; r + 8 <= n; r += 8) NAME##_r8(x + (size_t)r * (size_t)k, k, w, b, y + (size_t)r * (size_t)ldy + o, ldy); \
            for (; r + 4 <= n; r += 4) NAME##_r4(x + (size_t)r * (size_t)k, k, w, b, y + (size_t)r * (size_t)ldy + o, ldy); \
            for (; r < n; r++) NAME##_r1(x + (size_t)r * (size_t)k, k, w, b, y + (size_t)r * (size_t)ldy + o, ldy); \
        }                                                                                 \
        if (bias)                                                                         \
            for (int r = 0; r < n; r++)                                                   \
                for (int oo = o0; oo < o1; oo++) y[(size_t)r * (size_t)ldy + oo] += bias[oo]; \
    }

DEFINE_MATMUL(matmul_f32, l16_f32, load_f32, TL_F32)
DEFINE_MATMUL(matmul_f16, l16_f16, load_f16, TL_F16)
DEFINE_MATMUL(matmul_bf16, l16_bf16, load_bf16, TL_BF16)

/* ---------------------------------------------------------------- packed panels */

/* The leftover k (k mod 4) of each of the R rows, in order, into its k = 0 (mod 4) partial
   sum acc[r][0] (the canonical order): one loop for the narrow and the wide tiles. */
#define LEFTOVER_K(L16, R, acc)                                                           \
    for (int i = k4; i < k; i++) {                                                        \
        const __m512 wv = L16(w, panel + (size_t)i * TL_PANEL);                           \
        for (int r = 0; r < (R); r++)                                                     \
            acc[r][0] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[(size_t)r * (size_t)k + (size_t)i]), acc[r][0]); \
    }

/* One zmm = one panel's 16 output lanes; four partial accumulators (k mod 4) per input row;
   up to 6 input rows share every weight load (24 accumulators + 4 weights of 32 zmm); the
   rows left use tiles of 5, 4, 3, 2 or 1 rows (packed_tile_rows). `ahead` (or NULL) is
   the next panel: the first tile over a panel prefetches it at the pace it computes, since
   the hardware prefetcher alone left 6-row tiles at half speed on weights streamed from
   memory (a 77 MB head: 5.6 ms -> 3.0 ms for 6 rows, one thread). With the two-panel tiles
   only chunks of 4 and 5 rows use it: 1 to 3 rows run groups of panels with a stream each
   (DEFINE_PACKED_ROWS_PANELS, one panel wide included), 6 rows and more two-panel tiles
   that prefetch, and the one-panel tiles take their odd last panel alone, with no panel
   after it. Without them (use_pair_tiles), every chunk of 4 rows and more runs these. */
#define DEFINE_PACKED_ROWS(NAME, L16, DT, R)                                              \
    static inline void NAME(const float *x, int k, const void *w, size_t panel, const char *ahead, float *out) { \
        const int k4 = k & ~3;                                                            \
        const char *wbytes = (const char *)w;                                             \
        (void)ahead;                                                                      \
        __m512 acc[R][4];                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();                  \
        for (int i = 0; i < k4; i += 4) {                                                 \
            if (R == 1)                                                                   \
                for (unsigned p_ = 0; p_ < ELEM(DT); p_++)                                \
                    _mm_prefetch(wbytes + (panel + (size_t)i * TL_PANEL) * ELEM(DT) + PREFETCH_AHEAD + 64 * p_, TL_PF_HINT); \
            else if (ahead)                                                               \
                for (unsigned p_ = 0; p_ < ELEM(DT); p_++)                                \
                    _mm_prefetch(ahead + (size_t)i * TL_PANEL * ELEM(DT) + 64 * p_, TL_PF_HINT); \
            for (int j = 0; j < 4; j++) {                                                 \
                const __m512 wv = L16(w, panel + (size_t)(i + j) * TL_PANEL);             \
                for (int r = 0; r < R; r++)                                               \
                    acc[r][j] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[(size_t)r * (size_t)k + (size_t)(i + j)]), acc[r][j]); \
            }                                                                             \
        }                                                                                 \
        LEFTOVER_K(L16, R, acc);                                                          \
        for (int r = 0; r < R; r++)                                                       \
            _mm512_storeu_ps(out + r * TL_PANEL, _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), \
                                                               _mm512_add_ps(acc[r][2], acc[r][3]))); \
    }

/* Wide tiles for many rows (batched decode, prefill; a range's odd last panel, the
   two-panel tiles taking the others, so nothing follows it to prefetch): the four partial
   sums of the canonical order are computed JW at a time (JW = 2: passes k = 0,1 then 2,3
   (mod 4); JW = 1: one pass per residue), so R x JW accumulators fit the register file
   with R above 6 and each converted weight vector feeds R FMAs instead of 6. Every partial
   sum still runs over its k in increasing order with the same fma, the leftover k still
   go to the k = 0 (mod 4) sum after its main run, and the final tree is the same: the
   results are those of the narrow tiles, bit for bit. A panel (16 x k weights: 24 KiB at
   k = 768 in f16) is re-read from L1/L2 by the later passes, not from memory. */
#define DEFINE_PACKED_WIDE(NAME, L16, DT, R, JW)                                          \
    static inline void NAME(const float *x, int k, const void *w, size_t panel, float *out) { \
        const int k4 = k & ~3;                                                            \
        __m512 partial[R][4];                                                             \
        for (int jb = 0; jb < 4; jb += JW) {                                              \
            __m512 acc[R][JW];                                                            \
            for (int r = 0; r < R; r++)                                                   \
                for (int jj = 0; jj < JW; jj++) acc[r][jj] = _mm512_setzero_ps();         \
            for (int i = 0; i < k4; i += 4) {                                             \
                for (int jj = 0; jj < JW; jj++) {                                         \
                    const __m512 wv = L16(w, panel + (size_t)(i + jb + jj) * TL_PANEL);   \
                    for (int r = 0; r < R; r++)                                           \
                        acc[r][jj] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[(size_t)r * (size_t)k + (size_t)(i + jb + jj)]), acc[r][jj]); \
                }                                                                         \
            }                                                                             \
            if (jb == 0) LEFTOVER_K(L16, R, acc);                                         \
            for (int r = 0; r < R; r++)                                                   \
                for (int jj = 0; jj < JW; jj++) partial[r][jb + jj] = acc[r][jj];          \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            _mm512_storeu_ps(out + r * TL_PANEL, _mm512_add_ps(_mm512_add_ps(partial[r][0], partial[r][1]), \
                                                               _mm512_add_ps(partial[r][2], partial[r][3]))); \
    }

/* Row r's input i for a tile of R rows: from x row-major ([r][k]), or TILED from the rows
   as arrange_rows_avx512 lays them out ([i][R]: the R inputs a k step broadcasts share a
   cache line or two, where row-major they sit on R lines k floats apart, which the panels
   streaming through L1 evict; from memory, GPT-2 shapes at 8 rows, that cost 25-40%). */
#define X_AT(TILED, R, r, i) ((TILED) ? x[(size_t)(i) * (size_t)(R) + (size_t)(r)] : x[(size_t)(r) * (size_t)k + (size_t)(i)])

/* Two-panel tiles (batched decode, verification, prefill): R rows x 2 panels, so each
   broadcast activation feeds two FMAs and each converted weight vector R, where a
   one-panel tile issues a broadcast load per FMA and is bound by its loads. The 2 x R x 4
   partial sums do not fit the registers, so they are computed JW at a time, as in the wide
   tile: the results are the one-panel tiles', bit for bit. `ahead` (or NULL) is the next
   `ahead_bytes` of panels, prefetched evenly over all the passes by prefetch_spread (the
   first pass alone would have to stream at twice the rate; from memory that lost 20%).
   Measured on GPT-2-shaped f16 panels (k = 768, medians of 21-41 alternated runs against
   the one-panel tiles): one thread +11-17% at 6 rows, +13-23% at 8, +12-21% at 10 to 16
   from cache, +5-15% from memory; two threads streaming from memory, where both share the
   bandwidth, -5% to +16% from run to run (the machine's drift), +8-12% at 12 and 16 rows. */
#define DEFINE_PACKED_PAIR(NAME, L16, DT, R, JW, TILED)                                   \
    static inline void NAME(const float *x, int k, const void *w, size_t panel, const char *ahead, \
                            size_t ahead_bytes, float *out) {                            \
        const int k4 = k & ~3, passes = 4 / (JW);                                         \
        const size_t panel1 = panel + (size_t)k * TL_PANEL;                               \
        const char *fetched = ahead;                                                      \
        const size_t per_step = prefetch_per_step(ahead_bytes, (size_t)passes * (size_t)(k4 / 4)); \
        __m512 partial[R][2][4];                                                          \
        for (int jb = 0; jb < 4; jb += JW) {                                              \
            __m512 acc[R][2][JW];                                                         \
            for (int r = 0; r < R; r++)                                                   \
                for (int jj = 0; jj < JW; jj++) acc[r][0][jj] = acc[r][1][jj] = _mm512_setzero_ps(); \
            for (int i = 0; i < k4; i += 4) {                                             \
                if (ahead)                                                                \
                    fetched = prefetch_spread(fetched, ahead, ahead_bytes, per_step,      \
                                              (size_t)(jb / (JW)) * (size_t)(k4 / 4) + (size_t)(i / 4) + 1); \
                for (int jj = 0; jj < JW; jj++) {                                         \
                    const __m512 w0 = L16(w, panel + (size_t)(i + jb + jj) * TL_PANEL);   \
                    const __m512 w1 = L16(w, panel1 + (size_t)(i + jb + jj) * TL_PANEL);  \
                    for (int r = 0; r < R; r++) {                                         \
                        const __m512 xb = _mm512_set1_ps(X_AT(TILED, R, r, i + jb + jj)); \
                        acc[r][0][jj] = _mm512_fmadd_ps(w0, xb, acc[r][0][jj]);           \
                        acc[r][1][jj] = _mm512_fmadd_ps(w1, xb, acc[r][1][jj]);           \
                    }                                                                     \
                }                                                                         \
            }                                                                             \
            if (jb == 0) /* the leftover k into the k = 0 (mod 4) sums (LEFTOVER_K) */    \
                for (int i = k4; i < k; i++) {                                            \
                    const __m512 w0 = L16(w, panel + (size_t)i * TL_PANEL), w1 = L16(w, panel1 + (size_t)i * TL_PANEL); \
                    for (int r = 0; r < R; r++) {                                         \
                        const __m512 xb = _mm512_set1_ps(X_AT(TILED, R, r, i));            \
                        acc[r][0][0] = _mm512_fmadd_ps(w0, xb, acc[r][0][0]);             \
                        acc[r][1][0] = _mm512_fmadd_ps(w1, xb, acc[r][1][0]);             \
                    }                                                                     \
                }                                                                         \
            for (int r = 0; r < R; r++)                                                   \
                for (int jj = 0; jj < JW; jj++) {                                         \
                    partial[r][0][jb + jj] = acc[r][0][jj];                               \
                    partial[r][1][jb + jj] = acc[r][1][jj];                               \
                }                                                                         \
        }                                                                                 \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < 2; p++)                                                   \
                _mm512_storeu_ps(out + (r * 2 + p) * TL_PANEL, _mm512_add_ps(_mm512_add_ps(partial[r][p][0], partial[r][p][1]), \
                                                                             _mm512_add_ps(partial[r][p][2], partial[r][p][3]))); \
    }

/* One to three rows (decode, batches of 2-3 sessions, 2-3 beams) over P panels at once:
   1 x 4, 2 x 3, 3 x 2 (4 accumulators per row and panel: 16, 24, 24 of the 32 registers),
   and a panel or more narrower where a range's short last part has ended (FEW_ROWS_PANELS),
   each panel prefetched in its own stream. A one-panel tile has four FMA chains per row,
   which at the FMA latency allow one FMA a cycle, and one stream, which leaves too few
   lines in flight to read memory at its rate. Each (row, panel)'s chains are the one-panel
   tile's, so the bits are. Measured (tinyloop-kernel-bench, f16, one thread, alternated):
   - one row from memory (k 2048, 1 GiB of copies): 1 panel 21-24 GB/s, 2 panels 27-30,
     3: 32-35, 4: 33-37, 6: 27-33; from L2 (k 256) 78-82 -> 83-87 GFLOP/s;
   - from L3 (k 768, cols 3072): 2 rows 108-111 -> 152-161 GFLOP/s, 3 rows 134-138 ->
     179-185 (f32 2 rows 48-56 -> 85; bf16 3 rows 115-132 -> 189-192); from memory at two
     threads 2 rows 38-43 -> 45-56 GB/s;
   - the P streams spread over the range (FEW_ROWS_PANELS: each walks a contiguous part)
     instead of P adjacent panels: from memory, one thread, k 768: 1 row 30-32 -> 34-38
     GB/s, 2 rows 29-30 -> 36-38, 3 rows 25-26 -> 29-31; two threads 54-59 -> 57-63,
     51-57 -> 64-69, 45-48 -> 53-56.
   `panel` is the first panel's offset and `stride` the distance to the next of its P
   panels, in weights; each panel's stream prefetches PREFETCH_AHEAD on in its own part,
   running into the part's next panel (the next call's). */
#define DEFINE_PACKED_ROWS_PANELS(NAME, L16, DT, R, P)                                    \
    static inline void NAME(const float *x, int k, const void *w, size_t panel, size_t stride, float *out) { \
        const int k4 = k & ~3;                                                            \
        const char *wbytes = (const char *)w;                                             \
        __m512 acc[R][P][4];                                                              \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++)                                                   \
                for (int j = 0; j < 4; j++) acc[r][p][j] = _mm512_setzero_ps();           \
        for (int i = 0; i < k4; i += 4) {                                                 \
            for (int p = 0; p < P; p++)                                                   \
                for (unsigned p_ = 0; p_ < ELEM(DT); p_++)                                \
                    _mm_prefetch(wbytes + (panel + p * stride + (size_t)i * TL_PANEL) * ELEM(DT) + PREFETCH_AHEAD + 64 * p_, TL_PF_HINT); \
            for (int j = 0; j < 4; j++) {                                                 \
                __m512 wv[P];                                                             \
                for (int p = 0; p < P; p++) wv[p] = L16(w, panel + p * stride + (size_t)(i + j) * TL_PANEL); \
                for (int r = 0; r < R; r++) {                                             \
                    const __m512 xb = _mm512_set1_ps(x[(size_t)r * (size_t)k + (size_t)(i + j)]); \
                    for (int p = 0; p < P; p++) acc[r][p][j] = _mm512_fmadd_ps(wv[p], xb, acc[r][p][j]); \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int i = k4; i < k; i++)                                                      \
            for (int p = 0; p < P; p++) {                                                 \
                const __m512 wv = L16(w, panel + p * stride + (size_t)i * TL_PANEL);      \
                for (int r = 0; r < R; r++)                                               \
                    acc[r][p][0] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[(size_t)r * (size_t)k + (size_t)i]), acc[r][p][0]); \
            }                                                                             \
        for (int r = 0; r < R; r++)                                                       \
            for (int p = 0; p < P; p++)                                                   \
                _mm512_storeu_ps(out + (r * P + p) * TL_PANEL, _mm512_add_ps(_mm512_add_ps(acc[r][p][0], acc[r][p][1]), \
                                                                           _mm512_add_ps(acc[r][p][2], acc[r][p][3]))); \
    }

/* One row of f16 weights over P panels at once, converted and multiplied 8 lanes at a time
   (vcvtph2ps ymm, ymm FMAs: the 16-lane panel as two halves). On Zen 4 a 512-bit conversion
   takes the FMA ports and halves their rate, where 256-bit ones run beside them
   (tinyloop-fma-peak, one thread: 116 GFLOP/s FMA peak, 56 fed by 512-bit conversions, 116 by
   256-bit ones), and a single row converts every weight it multiplies: there it runs faster
   in halves, from cache (the shipped model's weights sit in the L3; from memory, 1 GiB of
   copies, they ran alike within the noise: one thread 24-29 GB/s whole, 26-27 in halves,
   two threads 26-30 and 30-38). Each lane's four chains and final tree are
   DEFINE_PACKED_ROWS_PANELS's (lanes are independent), so the bits are the same; the
   prefetches too. Uses ymm16-31 (AVX512VL): P = 3 holds 24 accumulators. Measured on the
   32 MiB-L3 Zen 4 (tinyloop-kernel-bench --f16-halves 0|1, alternated): one thread, k 256,
   cols 3072 from 6 MB of copies, 53 -> 61-69 GFLOP/s; two threads on the shipped model's
   shapes (k 256, cols 256 / 768 / 2048, k 1024 cols 256) from 8 MB, 82-102 -> 102-131; P = 2
   ran at 54-69, P = 1 at 46-62. */
#define DEFINE_HALVES_ROW_PANELS(NAME, P)                                                 \
    static inline void NAME(const float *x, int k, const void *w, size_t panel, size_t stride, float *out) { \
        const int k4 = k & ~3;                                                            \
        const uint16_t *halves = (const uint16_t *)w;                                     \
        __m256 acc[P][2][4];                                                              \
        for (int p = 0; p < P; p++)                                                       \
            for (int j = 0; j < 4; j++) acc[p][0][j] = acc[p][1][j] = _mm256_setzero_ps(); \
        for (int i = 0; i < k4; i += 4) {                                                 \
            for (int p = 0; p < P; p++)                                                   \
                for (unsigned p_ = 0; p_ < 2; p_++)                                       \
                    _mm_prefetch((const char *)(halves + panel + p * stride + (size_t)i * TL_PANEL) + PREFETCH_AHEAD + 64 * p_, TL_PF_HINT); \
            for (int j = 0; j < 4; j++) {                                                 \
                const __m256 xb = _mm256_set1_ps(x[i + j]);                               \
                for (int p = 0; p < P; p++) {                                             \
                    const uint16_t *at = halves + panel + p * stride + (size_t)(i + j) * TL_PANEL; \
                    acc[p][0][j] = _mm256_fmadd_ps(load8_f16(at), xb, acc[p][0][j]); \
                    acc[p][1][j] = _mm256_fmadd_ps(load8_f16(at + 8), xb, acc[p][1][j]); \
                }                                                                         \
            }                                                                             \
        }                                                                                 \
        for (int i = k4; i < k; i++) {                                                    \
            const __m256 xb = _mm256_set1_ps(x[i]);                                       \
            for (int p = 0; p < P; p++)                                                   \
                for (int h = 0; h < 2; h++) {                                             \
                    const uint16_t *at = halves + panel + p * stride + (size_t)i * TL_PANEL + 8 * h; \
                    acc[p][h][0] = _mm256_fmadd_ps(load8_f16(at), xb, acc[p][h][0]); \
                }                                                                         \
        }                                                                                 \
        for (int p = 0; p < P; p++)                                                       \
            for (int h = 0; h < 2; h++)                                                   \
                _mm256_storeu_ps(out + p * TL_PANEL + 8 * h, tree4(acc[p][h][0], acc[p][h][1], acc[p][h][2], acc[p][h][3])); \
    }
DEFINE_HALVES_ROW_PANELS(f16_halves_row3, 3)
DEFINE_HALVES_ROW_PANELS(f16_halves_row2, 2)
DEFINE_HALVES_ROW_PANELS(f16_halves_row1, 1)

/* Two choices of tile that the CPU decides (the results are the same bits either way):
   - f16_halves: a single row of f16 weights in halves (DEFINE_HALVES_ROW_PANELS), on AMD
     family 19h, whose AVX-512 parts (Zen 4) convert 512 bits at a time at half the rate of
     two 256-bit conversions; elsewhere 512 bits at once, as measured on Xeons.
   - pair_tiles: several rows of 16-bit (f16, bf16) weights in two-panel tiles
     (DEFINE_PACKED_PAIR) everywhere but AMD family 19h, where the one-panel tiles
     (packed_tile_rows) run nearer the FMA peak: there the pairs' passes over k (JW < 4), not the loads,
     are the limit. Measured on the 32 MiB-L3 Zen 4 (tinyloop-kernel-bench, alternated),
     f16, k 768, cols 3072: one thread from the L3, 8 / 12 / 16 / 128 rows 97 / 100 / 97 /
     97 -> 111 / 111 / 111 / 111 GFLOP/s (FMA peak 116); two threads from memory (1 GiB of
     copies) 158-167 / 163-184 / 163-181 / 188-191 -> 187-209 / 206-207 / 204-210 / 216-218;
     k 3072, cols 768: 8 rows 134-159 -> 175-176, 128 rows 186-187 -> 222; bf16 alike. f32
     weights (twice the bytes) keep the pairs: from memory at 8 and 16 rows they ran 8-40%
     faster in pairs.
   Each is decided once, on first use; TINYLOOP_F16_HALVES / TINYLOOP_PAIR_TILES = 0 | 1 in
   the environment override (A/B runs), tl_cpu_set_f16_halves / tl_cpu_set_pair_tiles too
   (tests, benchmarks). */
typedef struct cpu_choice {
    int mode; /* -1: not decided yet, else 0 or 1 */
    const char *env;
} cpu_choice;
static cpu_choice f16_halves = {-1, "TINYLOOP_F16_HALVES"};
static cpu_choice pair_tiles = {-1, "TINYLOOP_PAIR_TILES"};

static bool amd_family_19h(void) {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u; /* "AuthenticAMD" */
    if (!amd || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xfu, extended = (eax >> 20) & 0xffu;
    return (base == 0xfu ? base + extended : base) == 0x19u;
}

static inline bool chosen(cpu_choice *choice, bool on_amd_family_19h) {
    int mode = __atomic_load_n(&choice->mode, __ATOMIC_RELAXED);
    if (mode < 0) {
        const char *forced = getenv(choice->env);
        int undecided = -1;
        mode = forced && (!strcmp(forced, "0") || !strcmp(forced, "1")) ? forced[0] == '1'
                                                                         : amd_family_19h() == on_amd_family_19h;
        /* (only while undecided: a tl_cpu_set_* meanwhile stands) */
        if (!__atomic_compare_exchange_n(&choice->mode, &undecided, mode, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            mode = undecided;
    }
    return mode == 1;
}
static inline bool use_f16_halves(void) { return chosen(&f16_halves, true); }
static inline bool use_pair_tiles(void) { return chosen(&pair_tiles, false); }
/* Whether products over weights of type dt run the two-panel tiles (f32 always), and so
   read rows arranged for them (arrange_rows_avx512). */
static inline bool pair_tiles_for(tl_dtype dt) { return dt == TL_F32 || use_pair_tiles(); }

static bool avx512_family(const tl_kernels *k) { return k == &tl_kernels_avx512 || k == &tl_kernels_avx512_vnni; }
bool tl_cpu_f16_halves(const tl_kernels *k) { return avx512_family(k) && use_f16_halves(); }
bool tl_cpu_one_panel_rows(const tl_kernels *k) { return avx512_family(k) && !use_pair_tiles(); }

void tl_cpu_set_f16_halves(int mode) { __atomic_store_n(&f16_halves.mode, mode < 0 ? -1 : mode != 0, __ATOMIC_RELAXED); }
void tl_cpu_set_pair_tiles(int mode) { __atomic_store_n(&pair_tiles.mode, mode < 0 ? -1 : mode != 0, __ATOMIC_RELAXED); }

/* One-panel row tiles. Beside the two-panel tiles (`pairs`, which take 6 rows and more but
   for a range's odd last panel): 12 (JW 2), then the narrow 6, 4, 3, 2, 1. Measured on
   GPT-2-shaped f16 panels, a 12-row tile beats two 6-row ones by ~5% from cache; 16-row
   (JW 1) and 8-row tiles did not pay once the weights stream from memory. Without the
   pairs (16-bit weights on AMD family 19h: use_pair_tiles), all the rows: tiles of 4, the
   last 5 or 6 whole (a tile of 1 runs four FMA chains, a fifth of the rate: 5 rows as 4 + 1
   ran at 94 GFLOP/s from the L3 where the 5-row tile runs at 107-111), else 3, 2 or 1. */
static inline int packed_tile_rows(int left, bool pairs) {
    if (pairs) return left >= 12 ? 12 : left >= 6 ? 6 : left >= 4 ? 4 : left;
    return left == 5 || left == 6 ? left : left >= 4 ? 4 : left;
}
/* Two-panel row tiles: 12, 8, 6, 4 (16 as 8 + 8, and 9 to 11 as 6 + the rest: 8 + 1 measured
   6% slower), for chunks of 6 rows or more; fewer than 4 rows left take the one-panel
   tiles. Chunks of 4 or 5 rows measured 3% slower in pairs and stay on one-panel tiles. */
static inline int pair_tile_rows(int left) {
    return left == 8 || left == 16 ? 8 : left >= 12 ? 12 : left >= 6 ? 6 : left >= 4 ? 4 : 0;
}

/* A few-row tile (DEFINE_PACKED_ROWS_PANELS, DEFINE_HALVES_ROW_PANELS): R rows over W panels,
   the first at `panel` and the next `stride` on, in weights, into out[R][W][TL_PANEL]. */
typedef void (*few_rows_tile)(const float *x, int k, const void *w, size_t panel, size_t stride, float *out);

/* The few-row loop of a packed product: the panels of [o, o1) as stream parts
   (stream_parts_of), BY_WIDTH[W - 1] the tile of R rows over W panels (1 to P). The range's
   last panel, possibly partial, is the last part's last. */
#define FEW_ROWS_PANELS(BY_WIDTH, R, P)                                                   \
    do {                                                                                  \
        const stream_parts sp_ = stream_parts_of((o1 - o + TL_PANEL - 1) / TL_PANEL, (P)); \
        for (int g_ = 0; g_ < sp_.part; g_++) {                                           \
            const int width_ = stream_width(&sp_, g_);                                    \
            (BY_WIDTH)[width_ - 1](x, k, w, (size_t)(o / TL_PANEL + g_) * (size_t)k * TL_PANEL, \
                                   (size_t)sp_.part * (size_t)k * TL_PANEL, out);         \
            for (int p_ = 0; p_ < width_; p_++) {                                         \
                const int col_ = stream_col(&sp_, o, p_, g_);                             \
                store_tile(out, R, width_, p_, o1 - col_ < TL_PANEL ? o1 - col_ : TL_PANEL, bias, col_, y, ldy); \
            }                                                                             \
        }                                                                                 \
        o = o1;                                                                           \
    } while (0)

#define DEFINE_PACKED(NAME, L16, DT)                                                      \
    DEFINE_PACKED_PAIR(NAME##_p12, L16, DT, 12, 1, 0)                                     \
    DEFINE_PACKED_PAIR(NAME##_p8, L16, DT, 8, 1, 0)                                       \
    DEFINE_PACKED_PAIR(NAME##_p6, L16, DT, 6, 2, 0)                                       \
    DEFINE_PACKED_PAIR(NAME##_p4, L16, DT, 4, 2, 0)                                       \
    DEFINE_PACKED_PAIR(NAME##_t12, L16, DT, 12, 1, 1)                                     \
    DEFINE_PACKED_PAIR(NAME##_t8, L16, DT, 8, 1, 1)                                       \
    DEFINE_PACKED_PAIR(NAME##_t6, L16, DT, 6, 2, 1)                                       \
    DEFINE_PACKED_PAIR(NAME##_t4, L16, DT, 4, 2, 1)                                       \
    DEFINE_PACKED_ROWS_PANELS(NAME##_1x4, L16, DT, 1, 4)                                  \
    DEFINE_PACKED_ROWS_PANELS(NAME##_1x3, L16, DT, 1, 3)                                  \
    DEFINE_PACKED_ROWS_PANELS(NAME##_1x2, L16, DT, 1, 2)                                  \
    DEFINE_PACKED_ROWS_PANELS(NAME##_1x1, L16, DT, 1, 1)                                  \
    DEFINE_PACKED_ROWS_PANELS(NAME##_2x3, L16, DT, 2, 3)                                  \
    DEFINE_PACKED_ROWS_PANELS(NAME##_2x2, L16, DT, 2, 2)                                  \
    DEFINE_PACKED_ROWS_PANELS(NAME##_2x1, L16, DT, 2, 1)                                  \
    DEFINE_PACKED_ROWS_PANELS(NAME##_3x2, L16, DT, 3, 2)                                  \
    DEFINE_PACKED_ROWS_PANELS(NAME##_3x1, L16, DT, 3, 1)                                  \
    DEFINE_PACKED_WIDE(NAME##_r12, L16, DT, 12, 2)                                        \
    DEFINE_PACKED_ROWS(NAME##_r6, L16, DT, 6)                                             \
    DEFINE_PACKED_ROWS(NAME##_r5, L16, DT, 5)                                             \
    DEFINE_PACKED_ROWS(NAME##_r4, L16, DT, 4)                                             \
    DEFINE_PACKED_ROWS(NAME##_r3, L16, DT, 3)                                             \
    DEFINE_PACKED_ROWS(NAME##_r2, L16, DT, 2)                                             \
    DEFINE_PACKED_ROWS(NAME##_r1, L16, DT, 1)                                             \
    static void NAME(const float *x, const float *tiles, int n, int k, const void *w, const float *bias, \
                     int o0, int o1, float *y, int ldy) {                                 \
        float out[12 * 2 * TL_PANEL];                                                     \
        const size_t panel_bytes = tl_panel_bytes(DT, k);                                 \
        int o = o0;                                                                       \
        /* One to three rows: parts of panels side by side (FEW_ROWS_PANELS), the tiles  \
           by width: f16 in halves three wide (DEFINE_HALVES_ROW_PANELS), else 4, 3 and 2 \
           wide by rows (DEFINE_PACKED_ROWS_PANELS). */                                  \
        static const few_rows_tile halves[3] = {f16_halves_row1, f16_halves_row2, f16_halves_row3}; \
        static const few_rows_tile row1[4] = {NAME##_1x1, NAME##_1x2, NAME##_1x3, NAME##_1x4}; \
        static const few_rows_tile rows2[3] = {NAME##_2x1, NAME##_2x2, NAME##_2x3};       \
        static const few_rows_tile rows3[2] = {NAME##_3x1, NAME##_3x2};                   \
        switch (n) {                                                                      \
        case 1:                                                                           \
            if ((DT) == TL_F16 && use_f16_halves()) FEW_ROWS_PANELS(halves, 1, 3);        \
            else FEW_ROWS_PANELS(row1, 1, 4);                                             \
            break;                                                                        \
        case 2: FEW_ROWS_PANELS(rows2, 2, 3); break;                                      \
        case 3: FEW_ROWS_PANELS(rows3, 3, 2); break;                                      \
        default: break;                                                                   \
        }                                                                                 \
        /* Six rows or more: pairs of panels (the second may be the matrix's partial last \
           one), then an odd last panel alone; or (!pairs) every panel alone. */          \
        const bool pairs = pair_tiles_for(DT);                                            \
        for (; pairs && n >= 6 && o + TL_PANEL < o1; o += 2 * TL_PANEL) {                 \
            const size_t panel = (size_t)(o / TL_PANEL) * (size_t)k * TL_PANEL;           \
            const int lanes1 = o1 - o - TL_PANEL < TL_PANEL ? o1 - o - TL_PANEL : TL_PANEL; \
            const int next = o + 2 * TL_PANEL < o1 ? (o1 - o - 2 * TL_PANEL + TL_PANEL - 1) / TL_PANEL : 0; \
            const char *ahead = next ? (const char *)w + (panel + 2 * (size_t)k * TL_PANEL) * ELEM(DT) : NULL; \
            const size_t ahead_bytes = (size_t)(next < 2 ? next : 2) * panel_bytes;       \
            int r = 0;                                                                    \
            for (int rows; r < n && (rows = pair_tile_rows(n - r)) > 0; r += rows) {      \
                const char *a = r == 0 ? ahead : NULL;                                    \
                /* the group's rows arranged ([k][rows]) where given, else row-major */   \
                const float *xr = (tiles ? tiles : x) + (size_t)r * (size_t)k;            \
                switch (rows) {                                                           \
                case 12: (tiles ? NAME##_t12 : NAME##_p12)(xr, k, w, panel, a, ahead_bytes, out); break; \
                case 8: (tiles ? NAME##_t8 : NAME##_p8)(xr, k, w, panel, a, ahead_bytes, out); break; \
                case 6: (tiles ? NAME##_t6 : NAME##_p6)(xr, k, w, panel, a, ahead_bytes, out); break; \
                default: (tiles ? NAME##_t4 : NAME##_p4)(xr, k, w, panel, a, ahead_bytes, out); break; \
                }                                                                         \
                store_tile(out, rows, 2, 0, TL_PANEL, bias, o, y + (size_t)r * (size_t)ldy, ldy); \
                store_tile(out, rows, 2, 1, lanes1, bias, o + TL_PANEL, y + (size_t)r * (size_t)ldy, ldy); \
            }                                                                             \
            /* The rows left (fewer than 4: one tile) in one-panel tiles, panel by panel. */ \
            for (int p = 0; p < 2 && r < n; p++) {                                        \
                const float *xr = x + (size_t)r * (size_t)k;                              \
                const size_t pp = panel + (size_t)p * (size_t)k * TL_PANEL;               \
                switch (n - r) {                                                          \
                case 3: NAME##_r3(xr, k, w, pp, NULL, out); break;                        \
                case 2: NAME##_r2(xr, k, w, pp, NULL, out); break;                        \
                default: NAME##_r1(xr, k, w, pp, NULL, out); break;                       \
                }                                                                         \
                store_tile(out, n - r, 1, 0, p ? lanes1 : TL_PANEL, bias, o + p * TL_PANEL, y + (size_t)r * (size_t)ldy, ldy); \
            }                                                                             \
        }                                                                                 \
        for (; o < o1; o += TL_PANEL) {                                                   \
            const size_t panel = (size_t)(o / TL_PANEL) * (size_t)k * TL_PANEL;           \
            const int lanes = o1 - o < TL_PANEL ? o1 - o : TL_PANEL;                      \
            for (int r = 0; r < n;) {                                                     \
                const int rows = packed_tile_rows(n - r, pairs);                          \
                const float *xr = x + (size_t)r * (size_t)k;                              \
                /* The first tile of a panel streams the next one in (single rows      \
                   prefetch within their own stream instead). */                          \
                const char *ahead = r == 0 && rows > 1 && o + TL_PANEL < o1               \
                    ? (const char *)w + (panel + (size_t)k * TL_PANEL) * ELEM(DT) : NULL; \
                switch (rows) {                                                           \
                case 12: NAME##_r12(xr, k, w, panel, out); break;                         \
                case 6: NAME##_r6(xr, k, w, panel, ahead, out); break;                    \
                case 5: NAME##_r5(xr, k, w, panel, ahead, out); break;                    \
                case 4: NAME##_r4(xr, k, w, panel, ahead, out); break;                    \
                case 3: NAME##_r3(xr, k, w, panel, ahead, out); break;                    \
                case 2: NAME##_r2(xr, k, w, panel, ahead, out); break;                    \
                default: NAME##_r1(xr, k, w, panel, ahead, out); break;                   \
                }                                                                         \
                store_tile(out, rows, 1, 0, lanes, bias, o, y + (size_t)r * (size_t)ldy, ldy); \
                r += rows;                                                                \
            }                                                                             \
        }                                                                                 \
    }

DEFINE_PACKED(packed_f32, l16_f32, TL_F32)
DEFINE_PACKED(packed_f16, l16_f16, TL_F16)
DEFINE_PACKED(packed_bf16, l16_bf16, TL_BF16)

static void matmul_packed_arranged_avx512(const float *x, const float *tiles, int n, int k, const void *w,
                                          tl_dtype dt, const float *bias, int o0, int o1, float *y, int ldy) {
    switch (dt) {
    case TL_F16: packed_f16(x, tiles, n, k, w, bias, o0, o1, y, ldy); break;
    case TL_BF16: packed_bf16(x, tiles, n, k, w, bias, o0, o1, y, ldy); break;
    default: packed_f32(x, tiles, n, k, w, bias, o0, o1, y, ldy); break;
    }
}

static void matmul_packed_avx512(const float *x, int n, int k, const void *w, tl_dtype dt,
                                 const float *bias, int o0, int o1, float *y, int ldy) {
    matmul_packed_arranged_avx512(x, NULL, n, k, w, dt, bias, o0, o1, y, ldy);
}

/* The rows of x [n][k] for the two-panel tiles (kernels.h): each group of rows the pair
   loop takes (pair_tile_rows) as [k][rows] at the group's offset r * k; the rows after the
   last group are not read from here. False (nothing written) where no pair tile runs, and
   past ARRANGE_MAX_ROWS: prefill chunks read x row-major as before (128 rows arranged per
   product measured even, within the noise, and cost a buffer of 128 x k floats). */
#define ARRANGE_MAX_ROWS 16
static bool arrange_rows_avx512(const float *x, int n, int k, tl_dtype dt, int i0, int i1, float *tiles) {
    if (n < 6 || n > ARRANGE_MAX_ROWS || tl_dtype_quantised(dt) || !pair_tiles_for(dt)) return false;
    if (!tiles) return true; /* the question only */
    for (int r = 0, rows; r < n && (rows = pair_tile_rows(n - r)) > 0; r += rows) {
        float *group = tiles + (size_t)r * (size_t)k;
        for (int i = i0; i < i1; i++)
            for (int t = 0; t < rows; t++) group[(size_t)i * (size_t)rows + (size_t)t] = x[(size_t)(r + t) * (size_t)k + (size_t)i];
    }
    return true;
}

/* Single rows stay on the AVX2 kernel (prefetched streaming, measured at the machine's
   bandwidth); several rows come here. Results are identical either way. */
static void matmul_avx512(const float *x, int n, int k, const void *w, tl_dtype dt, const float *bias,
                          int o0, int o1, float *y, int ldy) {
    if (n == 1) {
        tl_kernels_avx2.matmul(x, n, k, w, dt, bias, o0, o1, y, ldy);
        return;
    }
    switch (dt) {
    case TL_F16: matmul_f16(x, n, k, w, bias, o0, o1, y, ldy); break;
    case TL_BF16: matmul_bf16(x, n, k, w, bias, o0, o1, y, ldy); break;
    default: matmul_f32(x, n, k, w, bias, o0, o1, y, ldy); break;
    }
}

/* Attention dots: the AVX2 kernel (256-bit lanes are what kernels.h's dot order names). */
static void dots_avx512(const float *q, const float *const *keys, int n, int k, float *scores) {
    tl_kernels_avx2.dots(q, keys, n, k, scores);
}
static void dots_f16_avx512(const float *q, const uint16_t *const *keys, int n, int k, float *scores) {
    tl_kernels_avx2.dots_f16(q, keys, n, k, scores);
}
/* axpys 16 lanes wide: per element, the same fma over j in order as the AVX2 kernel (the
   lanes are independent), 64 elements of y held in registers for the whole block. */
static inline __m512 load16_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static void axpys_avx512(float *y, const float *a, const float *const *x, int n, int k) {
    const int k8 = k & ~7;
    int i = 0;
    AXPYS_BLOCKS(16, __m512, _mm512_loadu_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps)
    axpys_from(y, a, x, n, i, k);
}
static void narrow_f16_avx512(const float *src, int n, uint16_t *dst) {
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = tl_f32_to_f16(src[i]);
}
static void axpys_f16_avx512(float *y, const float *a, const uint16_t *const *x, int n, int k) {
    const int k8 = k & ~7;
    int i = 0;
    AXPYS_BLOCKS(16, __m512, _mm512_loadu_ps, load16_f16, _mm512_storeu_ps, _mm512_set1_ps, _mm512_fmadd_ps)
    axpys_from_f16(y, a, x, n, i, k);
}

/* ---------------------------------------------------------------- q8 / q4 */

/* q8 and q4 are integer dot products (kernels.h): AVX-512 without VNNI and BW runs the AVX2
   kernels, with them kernels_vnni.c's (integer sums are exact, so every ISA agrees). Their
   activations are quantised by the AVX2 loop (a 16-lane copy measured 0.27 ns an element
   against 0.36-0.40, a few microseconds a GPT-2 token, not worth a second rule). */
const tl_kernels tl_kernels_avx512 = {"avx512", matmul_avx512, matmul_packed_avx512, tl_qmatmul_packed_avx2,
                                      dots_avx512, axpys_avx512, arrange_rows_avx512, matmul_packed_arranged_avx512,
                                      dots_f16_avx512, axpys_f16_avx512, narrow_f16_avx512,
                                      tl_quantize_rows_avx2};
const tl_kernels tl_kernels_avx512_vnni = {"avx512-vnni", matmul_avx512, matmul_packed_avx512,
                                           tl_qmatmul_packed_vnni, dots_avx512, axpys_avx512,
                                           arrange_rows_avx512, matmul_packed_arranged_avx512, dots_f16_avx512,
                                           axpys_f16_avx512, narrow_f16_avx512, tl_quantize_rows_avx2};
#endif

/* test_isa.c: the kernel families agree bit for bit. With packed weights (the default)
 * generic (fmaf), AVX2 and AVX-512 compute the same canonical sums; with mapped row-major
 * weights they compute the row-major kernels' own (generic following AVX2's lanes in
 * fmaf). So a result never depends on the machine's vector width. */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "check.h"
#include "quantised.h"
#include "cpu/kernels.h"
#include "dtype.h"
#include "quant.h"
#include "tinyloop.h"

static float *score_with(const tl_kernels *k, const tl_model *m, const int32_t *ids, int n, int loops) {
    tl_cpu_use_kernels(k);
    float *out = malloc((size_t)n * (size_t)tl_model_info(m)->vocab_size * sizeof(float));
    CHECK(tl_score(m, ids, n, loops, out) == TL_OK, "score: %s", tl_last_error());
    return out;
}

/* q8/q4: generic, AVX2, AVX-512 and AVX512-VNNI agree on packed weights, and the row-major
   (mapped) path, portable C for every ISA, agrees with them too: one canonical order. */
static int check_quantised(const char *root, const char *name, tl_dtype type, bool avx2, bool avx512, bool vnni) {
    const char *qroot = quantised_copy(root, name, type);
    CHECK(qroot != NULL, "%s: quantise", name);
    if (!qroot) return 0;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/%s", qroot, name);
    int compared = 0;
    float *first = NULL;
    size_t bytes = 0;
    for (int mapped = 0; mapped <= 1; mapped++) {
        tl_load_options o;
        tl_load_options_init(&o);
        o.mmap_weights = mapped;
        tl_model *m = NULL;
        if (tl_model_load(dir, &o, &m) != TL_OK) { CHECK(0, "load %s: %s", dir, tl_last_error()); break; }
        const struct tl_model_info *info = tl_model_info(m);
        CHECK(strcmp(info->weight_dtype, type == TL_Q8 ? "q8" : "q4") == 0, "%s: weight_dtype %s", dir, info->weight_dtype);
        int32_t ids[20];
        for (int t = 0; t < 20; t++) ids[t] = (int32_t)((t * 7 + 3) % info->vocab_size);
        bytes = (size_t)20 * (size_t)info->vocab_size * sizeof(float);
        const tl_kernels *ks[4] = {&tl_kernels_generic, NULL, NULL, NULL};
#if defined(__x86_64__)
        ks[1] = avx2 ? &tl_kernels_avx2 : NULL;
        ks[2] = avx512 ? &tl_kernels_avx512 : NULL;
        ks[3] = vnni ? &tl_kernels_avx512_vnni : NULL;
#endif
        for (int k = 0; k < 4; k++) {
            if (!ks[k]) continue;
            float *got = score_with(ks[k], m, ids, 20, info->max_loops);
            if (!first) first = got;
            else {
                CHECK(memcmp(first, got, bytes) == 0, "%s %s: %s (%s) differs from generic (packed)", name,
                      type == TL_Q8 ? "q8" : "q4", ks[k]->isa, mapped ? "mapped" : "packed");
                compared++;
                free(got);
            }
        }
        tl_model_free(m);
    }
    free(first);
    (void)avx2; (void)avx512; (void)vnni;
    return compared;
}

/* Whether a kernel wrote y (zeroed before, `rows` x `cols`) outside its n rows and its columns
   [o0, o1): a tile taller than the rows left, or a partial panel stored whole, would. */
static bool wrote_outside(const float *y, int rows, int cols, int n, int o0, int o1) {
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < cols; o++)
            if ((r >= n || o < o0 || o >= o1) && y[(size_t)r * (size_t)cols + (size_t)o] != 0.0f) return true;
    return false;
}

/* Every row count from 1 to 40 (so every tile size and mix of tiles: one-panel 12, 6, 4, 3,
   2, 1, and without the pairs 6, 5, 4, 3, 2, 1; two-panel 12, 8, 6, 4 with 1-3 rows left;
   AVX-512 runs it with and without the two-panel tiles for 16-bit weights), k with and
   without a leftover (k mod 4;
   k = 3: the leftover alone), column ranges of 1 to 3 panels from the first or the second
   (one panel, a pair of whole panels, a pair whose second is partial, a pair and an odd
   last panel, each last panel whole or partial) and, for one to three rows, of up to 11
   panels (AVX-512 reads the panels of 1, 2 and 3 rows as up to 4, 3 and 2 parts side by
   side, the last part shorter where they do not divide: one to three panels a part, each
   last one whole or partial), each weight
   dtype, with and without a
   bias: each kernel family's packed matmul equals the generic one bit for bit, and so does
   a row computed on its own (a row's result never depends on the tile it landed in), and
   nothing outside the rows and columns asked for is written. */
static int check_packed_rows(const tl_kernels *const *families, int n_families) {
    enum { ROWS = 176, MAX_N = 40, NARROW = 48 /* columns of the ranges every row count takes */ };
    const int ks[] = {3, 64, 67, 256};
    const tl_dtype dts[] = {TL_F32, TL_F16, TL_BF16};
    int compared = 0, arranged = 0;
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
        for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++) {
            const int k = ks[ki];
            const tl_dtype dt = dts[di];
            const size_t elem = dt == TL_F32 ? 4 : 2, count = (size_t)ROWS * (size_t)k;
            unsigned char *w = malloc(count * elem);
            float *x = malloc((size_t)MAX_N * (size_t)k * sizeof(float));
            float *tiles = malloc((size_t)MAX_N * (size_t)k * sizeof(float));
            float *pieces = malloc((size_t)MAX_N * (size_t)k * sizeof(float));
            float *want = malloc((size_t)MAX_N * ROWS * sizeof(float)), *got = malloc((size_t)MAX_N * ROWS * sizeof(float));
            float bias[ROWS];
            uint32_t state = 12345u + (uint32_t)(ki * 7 + di);
            for (size_t i = 0; i < count; i++) {
                state = state * 1664525u + 1013904223u;
                const float value = ((float)(state >> 8) / 16777216.0f - 0.5f) * 0.25f;
                if (dt == TL_F32) memcpy(w + i * 4, &value, 4);
                else {
                    uint32_t bits;
                    memcpy(&bits, &value, 4);
                    const uint16_t half = dt == TL_F16 ? tl_f32_to_f16(value) : (uint16_t)(bits >> 16);
                    memcpy(w + i * 2, &half, 2);
                }
            }
            for (int i = 0; i < MAX_N * k; i++) {
                state = state * 1664525u + 1013904223u;
                x[i] = (float)(state >> 8) / 16777216.0f - 0.5f;
            }
            for (int o = 0; o < ROWS; o++) bias[o] = 0.01f * (float)o;
            for (int o0 = 0; o0 <= TL_PANEL; o0 += TL_PANEL)
                for (int o1 = o0 + 8; o1 <= ROWS; o1 += 8)
                    for (int n = 1; n <= (o1 <= NARROW ? MAX_N : 3); n++) {
                        const size_t width = (size_t)(o1 - o0) * sizeof(float);
                        const float *b = n % 2 ? bias : NULL; /* with and without a bias */
                        tl_kernels_generic.matmul_packed(x, n, k, w, dt, b, o0, o1, want, ROWS);
                        for (int f = 0; f < n_families; f++) {
                            /* with the rows as they are, then (where the family arranges
                               them: arrange_rows) arranged once for its multi-row tiles: the
                               generic kernel's bits, and nothing written outside */
                            const bool will = families[f]->arrange_rows && families[f]->arrange_rows(x, n, k, dt, 0, k, NULL);
                            memset(tiles, 0, (size_t)MAX_N * (size_t)k * sizeof(float));
                            const bool did = families[f]->arrange_rows && families[f]->arrange_rows(x, n, k, dt, 0, k, tiles);
                            CHECK(will == did, "%s: arrange_rows(NULL) answers %d for %d rows, arranging %d", families[f]->isa,
                                  will, n, did);
                            if (did) { /* arranged in three pieces of inputs, as a first phase's tasks do: the same */
                                memset(pieces, 0, (size_t)MAX_N * (size_t)k * sizeof(float));
                                for (int piece = 0; piece < 3; piece++)
                                    families[f]->arrange_rows(x, n, k, dt, piece * k / 3, (piece + 1) * k / 3, pieces);
                                CHECK(memcmp(pieces, tiles, (size_t)MAX_N * (size_t)k * sizeof(float)) == 0,
                                      "%s: %d rows of k=%d arranged in pieces differ from arranged whole", families[f]->isa, n, k);
                            }
                            for (int arranging = 0; arranging <= did; arranging++) {
                                memset(got, 0, (size_t)MAX_N * ROWS * sizeof(float));
                                if (arranging) families[f]->matmul_packed_arranged(x, tiles, n, k, w, dt, b, o0, o1, got, ROWS);
                                else families[f]->matmul_packed(x, n, k, w, dt, b, o0, o1, got, ROWS);
                                bool same = true;
                                for (int r = 0; r < n; r++)
                                    same = same && memcmp(want + (size_t)r * ROWS + o0, got + (size_t)r * ROWS + o0, width) == 0;
                                CHECK(same, "packed %s k=%d dtype %d, %d rows%s (columns %d-%d): differs from generic",
                                      families[f]->isa, k, (int)dt, n, arranging ? " arranged" : "", o0, o1);
                                CHECK(!wrote_outside(got, MAX_N, ROWS, n, o0, o1),
                                      "packed %s k=%d dtype %d, %d rows%s (columns %d-%d): wrote outside its rows or columns",
                                      families[f]->isa, k, (int)dt, n, arranging ? " arranged" : "", o0, o1);
                                arranged += arranging;
                            }
                            /* the last row alone, through the single-row tile */
                            families[f]->matmul_packed(x + (size_t)(n - 1) * (size_t)k, 1, k, w, dt, b, o0, o1, got, ROWS);
                            CHECK(memcmp(want + (size_t)(n - 1) * ROWS + o0, got + o0, width) == 0,
                                  "packed %s k=%d dtype %d: row %d of %d differs from the row alone", families[f]->isa, k, (int)dt, n - 1, n);
                            compared++;
                        }
                    }
            free(w);
            free(x);
            free(tiles);
            free(pieces);
            free(want);
            free(got);
        }
    /* an AVX-512 family was given: its arranged rows were compared (6 rows and more) */
    bool any_arranges = false;
    for (int f = 0; f < n_families; f++) any_arranges = any_arranges || families[f]->arrange_rows;
    CHECK(!any_arranges || arranged > 0, "arranged rows: %d comparisons", arranged);
    return compared;
}

/* q8/q4 kernels on their own, every row count from 1 to 9 (tiles of 1 to 3 rows over 1 to
   4 panels, VNNI's q4 two-panel tiles of 4 and 2 with a last row alone and one-panel tiles
   of 4, 2 and 1 rows for an odd last panel), column ranges of 1 to 9 panels from the first
   or the second, whole or partial (a single row's panels read as up to four parts side by
   side, 1 to 3 panels a part, the last part shorter), with and without a bias: each
   family equals the generic kernel bit for bit, so does a row alone, and nothing outside
   the rows and columns asked for is written. The weights span their whole range (q8 bytes 1..255, i.e.
   q = -127..127; every nibble) and the activations include an all-zero group and groups
   whose values all sit at +-max|x| (q = +-qmax on every input: the largest integer sums),
   so an overflow or a lost offset would show. */
static int check_quantised_rows(const tl_kernels *const *families, int n_families) {
    enum { ROWS = 144, MAX_N = 9, K = 256 };
    const int groups = K / TL_QGROUP;
    int compared = 0;
    uint32_t state = 4242u;
    static float x[MAX_N * K], want[MAX_N * ROWS], got[MAX_N * ROWS];
    static int8_t q8x[MAX_N * K];
    static int16_t q16x[MAX_N * K];
    static float d[MAX_N * K / TL_QGROUP], d16[MAX_N * K / TL_QGROUP];
    static int32_t sum[MAX_N * K / TL_QGROUP], sum16[MAX_N * K / TL_QGROUP];
    for (int i = 0; i < MAX_N * K; i++) {
        state = state * 1664525u + 1013904223u;
        const float v = (float)(state >> 8) / 16777216.0f - 0.5f;
        const int g = (i % K) / TL_QGROUP;
        x[i] = g == 1 ? 0.0f : g == 2 ? (v < 0.0f ? -3.0f : 3.0f) : v;
    }
    tl_cpu_quantize_rows(x, MAX_N, K, 8, q8x, d, sum);
    tl_cpu_quantize_rows(x, MAX_N, K, 16, q16x, d16, sum16);
    const tl_qrows xq = {q8x, d, sum, q16x, d16, sum16};
    float bias[ROWS];
    for (int o = 0; o < ROWS; o++) bias[o] = 0.01f * (float)o;
    for (int t = 0; t < 2; t++) {
        const tl_dtype dt = t ? TL_Q4 : TL_Q8;
        const size_t bb = tl_qblock_bytes(dt), bytes = (size_t)(ROWS / TL_PANEL) * (size_t)groups * bb;
        uint8_t *w = malloc(bytes);
        for (size_t b = 0; b < bytes; b++) {
            state = state * 1664525u + 1013904223u;
            w[b] = (uint8_t)(state >> 24);
        }
        for (size_t blk = 0; blk < bytes / bb; blk++) {
            uint8_t *p = w + blk * bb;
            if (dt == TL_Q8)
                for (size_t b = 0; b < tl_qscale_offset(dt); b++) p[b] = p[b] ? p[b] : 1;
            for (int l = 0; l < TL_PANEL; l++) {
                state = state * 1664525u + 1013904223u;
                const uint16_t h = tl_f32_to_f16((float)(state >> 8) / 16777216.0f * 0.02f);
                memcpy(p + tl_qscale_offset(dt) + 2 * (size_t)l, &h, 2);
            }
        }
        for (int o0 = 0; o0 <= TL_PANEL; o0 += TL_PANEL)
            for (int o1 = o0 + 8; o1 <= ROWS; o1 += 8)
                for (int n = 1; n <= MAX_N; n++) {
                    const size_t width = (size_t)(o1 - o0) * sizeof(float);
                    const float *b = n % 2 ? bias : NULL; /* with and without a bias */
                    tl_kernels_generic.qmatmul_packed(&xq, n, K, w, dt, b, o0, o1, want, ROWS);
                    for (int f = 0; f < n_families; f++) {
                        memset(got, 0, sizeof got);
                        families[f]->qmatmul_packed(&xq, n, K, w, dt, b, o0, o1, got, ROWS);
                        bool same = true;
                        for (int r = 0; r < n; r++)
                            same = same && memcmp(want + (size_t)r * ROWS + o0, got + (size_t)r * ROWS + o0, width) == 0;
                        CHECK(same, "%s %s: %d rows (columns %d-%d) differ from generic", dt == TL_Q8 ? "q8" : "q4",
                              families[f]->isa, n, o0, o1);
                        CHECK(!wrote_outside(got, MAX_N, ROWS, n, o0, o1), "%s %s: %d rows (columns %d-%d) wrote outside their rows or columns",
                              dt == TL_Q8 ? "q8" : "q4", families[f]->isa, n, o0, o1);
                        /* the last row alone, through the single-row kernel */
                        const tl_qrows last = {q8x + (size_t)(n - 1) * K, d + (size_t)(n - 1) * (size_t)groups,
                                               sum + (size_t)(n - 1) * (size_t)groups, q16x + (size_t)(n - 1) * K,
                                               d16 + (size_t)(n - 1) * (size_t)groups, sum16 + (size_t)(n - 1) * (size_t)groups};
                        families[f]->qmatmul_packed(&last, 1, K, w, dt, b, o0, o1, got, ROWS);
                        CHECK(memcmp(want + (size_t)(n - 1) * ROWS + o0, got + o0, width) == 0,
                              "%s %s: row %d of %d differs from the row alone", dt == TL_Q8 ? "q8" : "q4", families[f]->isa,
                              n - 1, n);
                        compared++;
                    }
                }
        free(w);
    }
    return compared;
}

/* Attention blocks: every block size from 1 to 36 keys (the eight- and four-key groups and
   their leftovers), head sizes with and without a leftover (k mod 8) and through each
   step of the AVX-512 axpys (64-element blocks, then 8-lane chunks: k = 88, 24): each
   family's dots and axpys equal the generic ones bit for bit, and so does the same work
   done one key per call (a key's score and a row's output never depend on how the keys
   were blocked). */
static int check_attention_blocks(const tl_kernels *const *families, int n_families) {
    enum { MAX_KEYS = 36, MAX_K = 128 };
    const int ks[] = {64, 67, 3, 128, 88, 24};
    static float keys[MAX_KEYS][MAX_K], q[MAX_K], weights[MAX_KEYS];
    const float *rows[MAX_KEYS];
    uint32_t state = 777u;
    for (int j = 0; j < MAX_KEYS; j++) {
        for (int i = 0; i < MAX_K; i++) {
            state = state * 1664525u + 1013904223u;
            keys[j][i] = (float)(state >> 8) / 16777216.0f - 0.5f;
        }
        weights[j] = (float)(j + 1) / 37.0f;
        rows[j] = keys[j];
    }
    for (int i = 0; i < MAX_K; i++) q[i] = 0.03f * (float)(i % 17) - 0.2f;
    int compared = 0;
    for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
        for (int n = 1; n <= MAX_KEYS; n++) {
            const int k = ks[ki];
            float want[MAX_KEYS], got[MAX_KEYS], one[1];
            float want_y[MAX_K], got_y[MAX_K], alone_y[MAX_K];
            tl_kernels_generic.dots(q, rows, n, k, want);
            for (int i = 0; i < k; i++) want_y[i] = 0.5f - 0.01f * (float)i;
            tl_kernels_generic.axpys(want_y, weights, rows, n, k);
            for (int f = 0; f < n_families; f++) {
                families[f]->dots(q, rows, n, k, got);
                CHECK(memcmp(want, got, (size_t)n * sizeof(float)) == 0, "dots %s k=%d, %d keys: differs from generic",
                      families[f]->isa, k, n);
                families[f]->dots(q, rows + (n - 1), 1, k, one);
                CHECK(memcmp(&want[n - 1], one, sizeof(float)) == 0, "dots %s k=%d: key %d of %d differs from the key alone",
                      families[f]->isa, k, n - 1, n);
                for (int i = 0; i < k; i++) got_y[i] = alone_y[i] = 0.5f - 0.01f * (float)i;
                families[f]->axpys(got_y, weights, rows, n, k);
                for (int j = 0; j < n; j++) families[f]->axpys(alone_y, weights + j, rows + j, 1, k);
                CHECK(memcmp(want_y, got_y, (size_t)k * sizeof(float)) == 0, "axpys %s k=%d, %d keys: differs from generic",
                      families[f]->isa, k, n);
                CHECK(memcmp(want_y, alone_y, (size_t)k * sizeof(float)) == 0,
                      "axpys %s k=%d, %d keys one per call: differs from the block", families[f]->isa, k, n);
                compared++;
            }
        }
    return compared;
}

/* dots_f16 and axpys_f16 (an f16 KV cache's rows): on every family, the results of dots and
   axpys on the rows widened by tl_f16_to_f32, bit for bit, for every finite half (zeros,
   subnormals, the largest; the 2048 non-finite ones are mapped to finite ones: a NaN's sign
   in a sum depends on the operand order a compiler picks, for f32 rows as for f16), at
   lengths that meet every vector loop and scalar tail. */
static int check_f16_rows(const tl_kernels *const *families, int n_families) {
    enum { ALL = 65536, KEYS = 32, MAX_K = 80 };
    uint16_t *halves = malloc(ALL * sizeof *halves);
    float *widened = malloc(ALL * sizeof *widened);
    float q[MAX_K], a[KEYS], want[MAX_K], got[MAX_K], want_s[KEYS], got_s[KEYS];
    const uint16_t *keys_f16[KEYS];
    const float *keys[KEYS];
    for (int i = 0; i < ALL; i++) {
        halves[i] = (uint16_t)(i * 40503u); /* every value once */
        if ((halves[i] & 0x7c00u) == 0x7c00u) halves[i] ^= 0x4000u; /* inf / NaN -> a finite half */
        widened[i] = tl_f16_to_f32(halves[i]);
    }
    for (int i = 0; i < MAX_K; i++) q[i] = (float)((i * 7) % 13) * 0.125f - 0.75f;
    for (int j = 0; j < KEYS; j++) a[j] = (float)((j * 5) % 11) * 0.0625f + 0.01f;
    int compared = 0;
    for (int f = 0; f < n_families; f++) {
        int wrong = 0;
        for (int start = 0; start + KEYS * MAX_K <= ALL; start += KEYS * MAX_K)
            for (int k = 1; k <= MAX_K; k += k < 20 ? 1 : 13)
                for (int n = 1; n <= KEYS; n += n < 9 ? 1 : 7) {
                    for (int j = 0; j < n; j++) {
                        keys_f16[j] = halves + start + j * MAX_K;
                        keys[j] = widened + start + j * MAX_K;
                    }
                    families[f]->dots(q, keys, n, k, want_s);
                    families[f]->dots_f16(q, keys_f16, n, k, got_s);
                    for (int j = 0; j < n; j++) wrong += memcmp(&want_s[j], &got_s[j], sizeof(float)) != 0;
                    for (int i = 0; i < MAX_K; i++) want[i] = got[i] = (float)i * 0.5f;
                    families[f]->axpys(want, a, keys, n, k);
                    families[f]->axpys_f16(got, a, keys_f16, n, k);
                    wrong += memcmp(want, got, sizeof want) != 0;
                    /* across families: the f16 rows agree with the generic kernels too */
                    tl_kernels_generic.dots_f16(q, keys_f16, n, k, want_s);
                    for (int j = 0; j < n; j++) wrong += memcmp(&want_s[j], &got_s[j], sizeof(float)) != 0;
                    compared++;
                }
        CHECK(wrong == 0, "%s: f16 rows: %d results differ from the widened rows' (of %d cases)", families[f]->isa,
              wrong, compared);
    }
    free(halves);
    free(widened);
    return compared;
}

/* narrow_f16 (an f16 KV cache's writes): every family gives tl_f32_to_f16's bits, for 2^22
   float bit patterns spread over all 2^32 (a large odd stride) and the edges: ties to even at
   every exponent, subnormal boundaries, overflow to inf, NaNs with payloads. */
static int check_narrow(const tl_kernels *const *families, int n_families) {
    enum { COUNT = 1 << 22, EDGES = 64 };
    float *src = malloc((COUNT + EDGES) * sizeof *src);
    uint16_t *want = malloc((COUNT + EDGES) * sizeof *want), *got = malloc((COUNT + EDGES + 1) * sizeof *got);
    uint32_t bits = 0x12345u;
    for (int i = 0; i < COUNT; i++, bits += 0x9e3779b1u) memcpy(&src[i], &bits, sizeof bits);
    const uint32_t edges[] = {0x33000000u, 0x33000001u, 0x337fffffu, 0x33800000u, 0x387fe000u, 0x387ff000u,
                              0x38800000u, 0x38801000u, 0x38803000u, 0x477fe000u, 0x477fefffu, 0x477ff000u,
                              0x47800000u, 0x7f800000u, 0x7f800001u, 0x7fc00000u, 0x7fa00000u, 0xffc12345u,
                              0x80000000u, 0x00000001u, 0x3f801000u, 0x3f803000u, 0xbf801000u, 0x7f7fffffu};
    for (int i = 0; i < EDGES; i++) {
        const uint32_t e = edges[i % (int)(sizeof edges / sizeof edges[0])] ^ (i >= 32 ? 0x80000000u : 0);
        memcpy(&src[COUNT + i], &e, sizeof e);
    }
    for (int i = 0; i < COUNT + EDGES; i++) want[i] = tl_f32_to_f16(src[i]);
    int compared = 0;
    for (int f = 0; f < n_families; f++) {
        got[COUNT + EDGES] = 0xabcd;
        families[f]->narrow_f16(src, COUNT + EDGES, got);
        int wrong = 0;
        for (int i = 0; i < COUNT + EDGES; i++) wrong += got[i] != want[i];
        for (int n = 0; n < 40; n++) { /* short rows: the scalar tails */
            got[n] = 0xabcd;
            families[f]->narrow_f16(src + COUNT, n, got);
            for (int i = 0; i < n; i++) wrong += got[i] != want[COUNT + i];
            wrong += got[n] != 0xabcd;
        }
        CHECK(wrong == 0, "%s: narrow_f16 differs from tl_f32_to_f16 in %d values", families[f]->isa, wrong);
        compared++;
    }
    free(src);
    free(want);
    free(got);
    return compared;
}

/* Activations quantised for q8/q4 products (tl_kernels.quantize_rows): each family writes
   the generic loop's q, d and group sums bit for bit, at 8 and 16 bits, over random groups
   and edge groups: all zero, all below the zero cut (2^-100) and just above it, halves
   that round to even (2.5 at max|x| = 127 or 32767), signed zeros, subnormals beside normal
   values, FLT_MAX, an infinity and a NaN (the group's d NaN, its q and sum zero), and one
   odd lane (NaN, an infinity, the largest value) in an otherwise random group. Rows of
   1 to 3 groups and a block of many, so that tails and offsets count. */
static int check_quantize(const tl_kernels *const *families, int n_families) {
    enum { GROUPS = 4096, K = GROUPS * TL_QGROUP };
    float *x = malloc(K * sizeof *x);
    uint32_t state = 777u;
    for (int i = 0; i < K; i++) {
        state = state * 1664525u + 1013904223u;
        x[i] = ((float)(state >> 8) / 16777216.0f - 0.5f) * (float)(1 + (i / TL_QGROUP) % 7);
    }
    const float edge_values[][4] = {{0.0f, -0.0f, 0.0f, 0.0f},        {1e-35f, -1e-36f, 0.0f, 1e-40f},
                                    {0x1p-100f, 1e-35f, -1e-38f, 0.0f}, {127.0f, 2.5f, -2.5f, 3.5f},
                                    {32767.0f, 2.5f, -1.5f, 0.5f},      {1.0f, 1e-40f, -1e-39f, -0.0f},
                                    {FLT_MAX, -FLT_MAX, 1.0f, -1e30f},  {1.0f, INFINITY, -2.0f, 0.5f},
                                    {1.0f, -INFINITY, 0.0f, 0.0f},      {NAN, 1.0f, 2.0f, -3.0f}};
    const int n_edges = (int)(sizeof edge_values / sizeof edge_values[0]);
    for (int e = 0; e < n_edges; e++) /* the first groups: each edge set, repeated along the group */
        for (int i = 0; i < TL_QGROUP; i++) x[e * TL_QGROUP + i] = edge_values[e][i % 4] * (i < 4 || i % 3 ? 1.0f : -1.0f);
    /* then random groups with one odd lane, in either vector of a group: a NaN or an
       infinity (the group's "finite" of every vector counts), the largest value */
    const struct { int lane; float value; } odd[] = {{31, NAN}, {12, INFINITY}, {31, -INFINITY}, {0, NAN}, {17, 1e30f}, {8, -7.0f}};
    for (int o = 0; o < (int)(sizeof odd / sizeof odd[0]); o++) x[(n_edges + o) * TL_QGROUP + odd[o].lane] = odd[o].value;
    int16_t *want_q = malloc(K * sizeof *want_q), *got_q = malloc((K + TL_QGROUP) * sizeof *got_q);
    float *want_d = malloc(GROUPS * sizeof *want_d), *got_d = malloc((GROUPS + 1) * sizeof *got_d);
    int32_t *want_sum = malloc(GROUPS * sizeof *want_sum), *got_sum = malloc((GROUPS + 1) * sizeof *got_sum);
    int compared = 0;
    for (int bits = 8; bits <= 16; bits += 8) {
        const size_t qbytes = bits / 8;
        for (int shape = 0; shape < 4; shape++) {
            /* n rows of k: 1 x 32, 3 x 64, 2 x 96, then 32 x (K / 32) */
            const int n = shape == 3 ? 32 : shape == 1 ? 3 : shape == 2 ? 2 : 1;
            const int k = shape == 3 ? K / 32 : TL_QGROUP * (shape + 1);
            const int groups = n * k / TL_QGROUP;
            tl_kernels_generic.quantize_rows(x, n, k, bits, want_q, want_d, want_sum);
            CHECK(bits == 16 || groups <= 3 || ((int8_t *)want_q)[3 * TL_QGROUP + 1] == 2, "generic: 2.5 at max 127 gives %d, not 2",
                  ((int8_t *)want_q)[3 * TL_QGROUP + 1]);
            for (int f = 0; f < n_families; f++) {
                memset(got_q, 0x5a, (size_t)(n * k + TL_QGROUP) * qbytes);
                got_d[groups] = 42.0f;
                got_sum[groups] = 42;
                families[f]->quantize_rows(x, n, k, bits, got_q, got_d, got_sum);
                bool inside = true;
                for (size_t b = (size_t)n * (size_t)k * qbytes; b < (size_t)(n * k + TL_QGROUP) * qbytes; b++)
                    inside = inside && ((uint8_t *)got_q)[b] == 0x5a;
                CHECK(memcmp(want_q, got_q, (size_t)n * (size_t)k * qbytes) == 0 &&
                          memcmp(want_d, got_d, (size_t)groups * sizeof(float)) == 0 &&
                          memcmp(want_sum, got_sum, (size_t)groups * sizeof(int32_t)) == 0,
                      "%s: quantize_rows (%d bits, %d x %d) differs from generic", families[f]->isa, bits, n, k);
                CHECK(inside && got_d[groups] == 42.0f && got_sum[groups] == 42,
                      "%s: quantize_rows (%d bits, %d x %d) wrote past its rows", families[f]->isa, bits, n, k);
                compared++;
            }
        }
    }
    free(x);
    free(want_q);
    free(got_q);
    free(want_d);
    free(got_d);
    free(want_sum);
    free(got_sum);
    return compared;
}

int main(int argc, char **argv) {
    const char *root = argc > 1 ? argv[1] : "tests/data/golden";
    const char *names[] = {"gpt2_like", "f16_concat_residual_gqa", "bf16_tied_rope_residual", "concat_residual_mqa",
                           "llama_like"};
#if defined(__x86_64__)
    /* (this test builds with clang too: clang is where implicit FMA contraction would break
       the cross-ISA identity it checks) */
    const bool avx2 = tl_cpu_can_run(&tl_kernels_avx2);
    const bool avx512 = tl_cpu_can_run(&tl_kernels_avx512);
    const bool vnni = tl_cpu_can_run(&tl_kernels_avx512_vnni);
#else
    const bool avx2 = false, avx512 = false, vnni = false;
#endif
    int compared = 0;
    {
        const tl_kernels *families[4];
        int n_families = 0;
        families[n_families++] = &tl_kernels_generic; /* itself: the single-row check */
#if defined(__x86_64__)
        if (avx2) families[n_families++] = &tl_kernels_avx2;
        if (avx512) families[n_families++] = &tl_kernels_avx512;
        /* AVX-512's CPU-dependent tiles both ways, each the generic kernel's bits: a single
           row of f16 weights in halves and whole (tl_cpu_set_f16_halves), several rows of
           16-bit weights in one-panel and two-panel tiles (tl_cpu_set_pair_tiles). The two
           choices touch different rows (one; six and more), so two runs take all four. */
        if (avx512)
            for (int halves = 0; halves <= 1; halves++) {
                tl_cpu_set_f16_halves(halves);
                tl_cpu_set_pair_tiles(!halves);
                compared += check_packed_rows(families, n_families);
            }
        else compared += check_packed_rows(families, n_families);
        tl_cpu_set_f16_halves(-1);
        tl_cpu_set_pair_tiles(-1);
#else
        compared += check_packed_rows(families, n_families);
#endif
        compared += check_attention_blocks(families, n_families);
        compared += check_f16_rows(families, n_families);
        compared += check_narrow(families, n_families);
#if defined(__x86_64__)
        if (vnni) families[n_families++] = &tl_kernels_avx512_vnni;
#endif
        compared += check_quantised_rows(families, n_families);
        compared += check_quantize(families, n_families);
    }
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s/%s", root, names[i]);
        for (int mapped = 0; mapped <= 1; mapped++) {
            tl_load_options o;
            tl_load_options_init(&o);
            o.mmap_weights = mapped;
            tl_model *m = NULL;
            if (tl_model_load(dir, &o, &m) != TL_OK) { CHECK(0, "load %s", names[i]); continue; }
            const struct tl_model_info *info = tl_model_info(m);
            int32_t ids[20];
            for (int t = 0; t < 20; t++) ids[t] = (int32_t)((t * 7 + 3) % info->vocab_size);
            const size_t bytes = (size_t)20 * (size_t)info->vocab_size * sizeof(float);
            float *ref = score_with(&tl_kernels_generic, m, ids, 20, info->max_loops);
#if defined(__x86_64__)
            float *a2 = avx2 ? score_with(&tl_kernels_avx2, m, ids, 20, info->max_loops) : NULL;
            float *a5 = avx512 ? score_with(&tl_kernels_avx512, m, ids, 20, info->max_loops) : NULL;
            if (ref && a2) { CHECK(memcmp(ref, a2, bytes) == 0, "%s: generic != avx2 (%s)", names[i], mapped ? "mapped" : "packed"); compared++; }
            if (a2 && a5) { CHECK(memcmp(a2, a5, bytes) == 0, "%s: avx2 != avx512 (%s)", names[i], mapped ? "mapped" : "packed"); compared++; }
            free(a2);
            free(a5);
#endif
            free(ref);
            tl_model_free(m);
        }
    }
    const char *quantised[] = {"gpt2_like", "llama_like", "f16_concat_residual_gqa"};
    for (size_t i = 0; i < sizeof quantised / sizeof quantised[0]; i++)
        for (int t = 0; t < 2; t++) compared += check_quantised(root, quantised[i], t ? TL_Q4 : TL_Q8, avx2, avx512, vnni);
    printf("  %d cross-ISA comparisons (avx2 %s, avx512 %s, vnni %s)\n", compared, avx2 ? "yes" : "no",
           avx512 ? "yes" : "no", vnni ? "yes" : "no");
    return check_summary();
}

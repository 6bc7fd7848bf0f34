/* cpu_rows.c: the CPU backend's per-row operations, on the calling thread.
 *
 * These are cheap next to the matmuls (O(n d) against O(n d^2)), so they stay serial:
 * no parallel region per norm. Their floating-point expressions are the reference the
 * golden files and the cross-ISA tests were made with; change one and every bit-exact
 * result moves. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../math_shared.h"
#include "cpu_backend.h"
#include "kernels.h"

/* ---------------------------------------------------------------- embedding */

void tl_cpu_embed(const tl_model *m, const int32_t *tokens, const int32_t *positions, int n,
                  float *x) {
    const tl_config *c = &m->cfg;
    const int d = c->d_model;
    for (int t = 0; t < n; t++) {
        float *xr = x + (size_t)t * (size_t)d;
        tl_matrix_row_f32(&m->w.tok_embed, tokens[t], xr);
        if (c->embed_scale != 1.0f)
            for (int i = 0; i < d; i++) xr[i] *= c->embed_scale;
        if (c->pos_encoding == TL_POS_LEARNED)
            /* x + pos element by element: one f32 rounding each, as the reference. */
            for (int i = 0; i < d; i++)
                xr[i] += tl_weight_at(m->w.pos_embed.data, m->w.pos_embed.dtype,
                                      tl_matrix_index(&m->w.pos_embed, positions[t], i));
    }
}

/* ---------------------------------------------------------------- norms */

/* Sum over a row of (x[i] - shift)^power (power 1 or 2) in double: eight interleaved
   partial sums (element i into sum i mod 8) added in a fixed tree, then the last d mod 8 in
   order. One chain of d dependent adds made a norm of the shipped model (d 256) cost 0.5 us,
   a norm of GPT-2 (d 768) 1.4 us, serial work while the pool's other threads wait. */
static double row_sum(const float *xr, int d, int power, double shift) {
    double part[8] = {0};
    const int d8 = d & ~7;
    for (int i = 0; i < d8; i += 8)
        for (int l = 0; l < 8; l++) {
            const double v = (double)xr[i + l] - shift;
            part[l] += power == 2 ? v * v : v;
        }
    double total = ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
    for (int i = d8; i < d; i++) {
        const double v = (double)xr[i] - shift;
        total += power == 2 ? v * v : v;
    }
    return total;
}

/* y = norm(x) row by row; y may alias x. Statistics in double: cheap, and closer to the
   float64 reference. */
void tl_cpu_norm(const tl_model *m, const float *x, int n, const float *w, const float *b,
                 float *y) {
    const tl_config *c = &m->cfg;
    const int d = c->d_model;
    for (int r = 0; r < n; r++) {
        const float *xr = x + (size_t)r * (size_t)d;
        float *yr = y + (size_t)r * (size_t)d;
        const double mean = c->norm == TL_NORM_LAYERNORM ? row_sum(xr, d, 1, 0.0) / d : 0.0;
        const double var = row_sum(xr, d, 2, mean);
        const float inv = (float)(1.0 / sqrt(var / d + (double)c->norm_eps));
        const float mf = (float)mean;
        for (int i = 0; i < d; i++) yr[i] = (xr[i] - mf) * inv * w[i] + (b ? b[i] : 0.0f);
    }
}

/* ---------------------------------------------------------------- positions */

/* Turns pair (first, second) of each of the row's `heads` heads by the angle (cs, sn). */
static inline void rope_pair(float *row, int heads, int hd, int first, int second, float cs, float sn) {
    for (int h = 0; h < heads; h++) {
        float *v = row + (size_t)h * (size_t)hd;
        float a = v[first], b = v[second];
        v[first] = a * cs - b * sn;
        v[second] = b * cs + a * sn;
    }
}

void tl_cpu_rope_angle(const tl_model *m, int32_t position, int i, float cos_sin[2]) {
    const double angle = (double)position * (double)m->rope_inv_freq[i];
    cos_sin[0] = (float)cos(angle);
    cos_sin[1] = (float)sin(angle);
}

/* RoPE on q heads [h0, h1) and k heads [g0, g1) of every row of q [n][n_heads * hd] and
   k [n][n_kv_heads * hd]; angles in double (from the backend's table, or computed here
   when there is none), each used for both. Frequency i turns the pair (i, i + hd/2) in the
   Hugging Face "rotate half" form, or (2i, 2i+1) when interleaved (Huginn's complex-number
   form); the arithmetic per pair is the same, whichever heads one call covers. */
void tl_cpu_rope_heads(const tl_model *m, float *q, float *k, int n, const int32_t *positions,
                       int h0, int h1, int g0, int g1) {
    const int hd = m->cfg.head_dim, half = hd / 2, qh = m->cfg.n_heads, kh = m->cfg.n_kv_heads;
    const bool interleaved = m->cfg.rope_pairing == TL_ROPE_INTERLEAVED;
    const float *table = ((const tl_cpu_context *)m->backend_ctx)->rope_table;
    for (int r = 0; r < n; r++) {
        float *q_row = q + ((size_t)r * (size_t)qh + (size_t)h0) * (size_t)hd;
        float *k_row = k + ((size_t)r * (size_t)kh + (size_t)g0) * (size_t)hd;
        for (int i = 0; i < half; i++) {
            float computed[2];
            const float *cos_sin = table ? &table[((size_t)positions[r] * (size_t)half + (size_t)i) * 2] : computed;
            if (!table) tl_cpu_rope_angle(m, positions[r], i, computed);
            const int first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
            rope_pair(q_row, h1 - h0, hd, first, second, cos_sin[0], cos_sin[1]);
            rope_pair(k_row, g1 - g0, hd, first, second, cos_sin[0], cos_sin[1]);
        }
    }
}

/* Every head (backend.h's rope). */
void tl_cpu_rope(const tl_model *m, float *q, float *k, int n, const int32_t *positions) {
    tl_cpu_rope_heads(m, q, k, n, positions, 0, m->cfg.n_heads, 0, m->cfg.n_kv_heads);
}

/* ---------------------------------------------------------------- element-wise */

void tl_cpu_add_rows(const tl_model *m, float *y, int n, int width, const float *bias) {
    (void)m;
    for (int r = 0; r < n; r++)
        for (int i = 0; i < width; i++) y[(size_t)r * (size_t)width + (size_t)i] += bias[i];
}

void tl_cpu_add(const tl_model *m, float *y, const float *x, size_t count) {
    (void)m;
    for (size_t i = 0; i < count; i++) y[i] += x[i];
}

/* The element-wise loops below are cloned per ISA so that they run 16 or 8 lanes wide where
   the CPU has them (GELU is the epilogue of every GPT-2 up-projection, SwiGLU of every
   gate/up pair, the softmax weights attention's): plain IEEE operations without contraction
   (-ffp-contract=off), so every clone gives the same bits. GCC only: clang 14 leaves the
   cloned symbol undefined at link time (the fuzz builds). The clones are static, behind the
   entry points: GCC exports the dispatcher of an extern clone whatever its visibility. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define CLONED_PER_ISA __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONED_PER_ISA
#endif

CLONED_PER_ISA
static void gelu_loop(float *x, size_t count) {
    for (size_t i = 0; i < count; i++) x[i] = tl_gelu_tanh(x[i]);
}
void tl_cpu_gelu(float *x, size_t count) { gelu_loop(x, count); }

CLONED_PER_ISA
static void swiglu_loop(float *gate, const float *up, size_t count) {
    for (size_t i = 0; i < count; i++) gate[i] = tl_swiglu(gate[i], up[i]);
}
void tl_cpu_swiglu(float *gate, const float *up, size_t count) { swiglu_loop(gate, up, count); }

CLONED_PER_ISA
static void softmax_weights_loop(float *v, int n, float max) {
    for (int i = 0; i < n; i++) v[i] = tl_exp_softmax(v[i] - max);
}
void tl_cpu_softmax_weights(float *v, int n, float max) { softmax_weights_loop(v, n, max); }

void tl_cpu_copy(const tl_model *m, float *dst, const float *src, size_t count) {
    (void)m;
    memcpy(dst, src, count * sizeof(float));
}

/* ---------------------------------------------------------------- the loop */

void tl_cpu_loop_init(const tl_model *m, const float *x, int n, float *e, float *s) {
    const size_t bytes = (size_t)n * (size_t)m->cfg.d_model * sizeof(float);
    memcpy(e, x, bytes);
    if (m->cfg.injection == TL_INJECT_NONE) memcpy(s, e, bytes);
    else memset(s, 0, bytes);
}

void tl_cpu_state_init_random(const tl_model *m, float *s, int n, const int32_t *positions,
                              uint64_t seed) {
    const tl_config *c = &m->cfg;
    const int d = c->d_model;
    for (int r = 0; r < n; r++)
        for (int i = 0; i < d; i++)
            s[(size_t)r * (size_t)d + (size_t)i] =
                (float)(tl_state_draw(seed, positions[r], i) * c->state_init_std * c->embed_scale);
}

void tl_cpu_inject(const tl_model *m, const float *s, const float *e, int n, float *cat,
                   float *out) {
    const int d = m->cfg.d_model;
    const size_t count = (size_t)n * (size_t)d, row_bytes = (size_t)d * sizeof(float);
    switch (m->cfg.injection) {
    case TL_INJECT_NONE:
        memcpy(out, s, count * sizeof(float));
        break;
    case TL_INJECT_ADD:
        for (size_t i = 0; i < count; i++) out[i] = s[i] + e[i];
        break;
    case TL_INJECT_CONCAT: {
        /* cat row = [s ; e], or [e ; s] with inject_embedding_first */
        const float *first = m->cfg.inject_embedding_first ? e : s;
        const float *second = m->cfg.inject_embedding_first ? s : e;
        for (int r = 0; r < n; r++) {
            memcpy(cat + (size_t)r * 2 * (size_t)d, first + (size_t)r * (size_t)d, row_bytes);
            memcpy(cat + ((size_t)r * 2 + 1) * (size_t)d, second + (size_t)r * (size_t)d, row_bytes);
        }
        tl_cpu_matmul(m, cat, n, &m->w.inject, m->w.inject_b, out);
        break;
    }
    }
}

void tl_cpu_loop_update(const tl_model *m, float *s, const float *x, const float *u, int n) {
    const tl_config *c = &m->cfg;
    const size_t count = (size_t)n * (size_t)c->d_model;
    /* replace: s += beta (b - s); residual: s += beta (b - u). */
    const float *ref = c->loop_update == TL_UPDATE_REPLACE ? s : u;
    for (size_t i = 0; i < count; i++) s[i] += c->beta * (x[i] - ref[i]);
    if (c->state_norm) tl_cpu_norm(m, s, n, m->w.state_norm_w, m->w.state_norm_b, s);
}

double tl_cpu_state_change(const tl_model *m, const float *s_new, const float *s_old) {
    const int d = m->cfg.d_model;
    double change = 0.0, norm = 0.0;
    for (int i = 0; i < d; i++) {
        double delta = (double)s_new[i] - (double)s_old[i];
        change += delta * delta;
        norm += (double)s_new[i] * (double)s_new[i];
    }
    return norm > 0.0 ? sqrt(change / norm) : INFINITY;
}

double tl_cpu_exit_gate(const tl_model *m, const float *s) {
    float logit; /* host memory is the CPU backend's: the one-row matmul writes it directly */
    tl_cpu_matmul(m, s, 1, &m->w.exit_gate, m->w.exit_gate_b, &logit);
    return 1.0 / (1.0 + exp(-(double)logit));
}

/* ---------------------------------------------------------------- the head */

void tl_cpu_head(const tl_model *m, const float *x, int n, float *normed, float *logits) {
    /* Host memory is the CPU backend's memory: the matmul writes the logits in place. */
    if (!m->cfg.final_norm_at_head) {
        tl_cpu_matmul(m, x, n, &m->w.lm_head, NULL, logits);
        return;
    }
    tl_cpu_norm(m, x, n, m->w.final_norm_w, m->w.final_norm_b, normed);
    tl_cpu_matmul(m, normed, n, &m->w.lm_head, NULL, logits);
}

void tl_cpu_hidden(const tl_model *m, const float *x, int n, float *hidden) {
    const size_t count = (size_t)n * (size_t)m->cfg.d_model;
    if (m->cfg.final_norm_at_head) tl_cpu_norm(m, x, n, m->w.final_norm_w, m->w.final_norm_b, hidden);
    else memcpy(hidden, x, count * sizeof *hidden);
}

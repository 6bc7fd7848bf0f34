/* math_shared.h: element-wise rules that every backend computes the same way, written
 * once: the activations' exp, GPT-2's tanh GELU, SwiGLU's gate, and the counter-based draw
 * of Huginn's random initial state. Plain C11; nvcc compiles the same text for the CUDA kernels
 * (cuda/kernels.cuh), where TL_SHARED makes each function host + device. */
#ifndef TL_MATH_SHARED_H
#define TL_MATH_SHARED_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define TL_SHARED static __host__ __device__ __forceinline__
#else
#define TL_SHARED static inline
#endif

/* exp(x) for the activations, in plain float arithmetic the compiler vectorises: libm's
   tanhf is one call per element and took 11% of a 16-session GPT-2 step. x = n ln2 + r
   (Cody-Waite, |r| <= ln2 / 2), e^r by its degree-6 Taylor polynomial (relative error
   under 2e-7 on that range), 2^n written into the exponent bits. x is clamped to
   [-87, 88] first, so 2^n stays a normal float; NaN clamps too, and every caller
   multiplies by the NaN input anyway. Only IEEE operations: the same bits under every CPU
   kernel family, and on the GPU when nvcc does not contract (cuda/ builds with
   -fmad=false). */
#define TL_EXP_ACTIVATION_MAX 88.0f /* (e^88 is about 2^127, the largest power of two a float holds) */
TL_SHARED float tl_exp_activation(float x) {
    x = x > -87.0f ? x : -87.0f;
    x = x < TL_EXP_ACTIVATION_MAX ? x : TL_EXP_ACTIVATION_MAX;
    const float round_shift = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504088896341f + round_shift) - round_shift;
    float r = x - n * 0.693145751953125f; /* ln 2, high bits: n * it is exact */
    r = r - n * 1.42860682030941723e-6f;  /* ln 2, the rest */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) * (1 << 23);
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* A softmax weight e^x (x = score - max <= 0) with the activations' exp, so a block of them
   vectorises (libm's expf was one call per score); unlike an activation's, a NaN score
   stays NaN, so a broken row still ends in the non-finite-logits error. */
TL_SHARED float tl_exp_softmax(float x) {
    const float e = tl_exp_activation(x);
    return x == x ? e : x;
}

/* GPT-2's tanh GELU, 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), written as
   x / (1 + e^(-2u)) (the same function: 0.5 (1 + tanh u) is the logistic of 2u). */
TL_SHARED float tl_gelu_tanh(float x) {
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    const float a = -2.0f * u;
    /* Past the exp's clamp (88) the quotient is x e^-a < x e^-88, zero for PyTorch: divided by
       the clamped e^88 instead, gelu(-3e38) was -1.8 and gelu(-1e36) -0.006 (x * 0 is -0 there,
       and NaN for -inf, as PyTorch's 0.5 x (1 + tanh u) is). */
    return a > TL_EXP_ACTIVATION_MAX ? x * 0.0f : x / (1.0f + tl_exp_activation(a));
}

/* SwiGLU's gate: silu(gate) * up, with the activations' exp (libm's expf was one call per
   element: 2.5% of a shipped-model token; this one vectorises, and gives the GPU the same
   bits as the CPU). */
TL_SHARED float tl_swiglu(float gate, float up) {
    /* (past the exp's clamp, zero as in tl_gelu_tanh: gate * sigmoid(gate) underflows there) */
    return (-gate > TL_EXP_ACTIVATION_MAX ? gate * 0.0f : gate / (1.0f + tl_exp_activation(-gate))) * up;
}

/* splitmix64: a counter-based generator, so a draw depends only on its key. */
TL_SHARED uint64_t tl_mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* A standard normal for key `key`, redrawn (next counter) until |z| <= 3: the truncated normal
   of torch.nn.init.trunc_normal_(a = -3 std, b = 3 std), by rejection. */
TL_SHARED double tl_truncated_normal(uint64_t key) {
    for (uint64_t attempt = 0;; attempt++) {
        uint64_t a = tl_mix64(key ^ tl_mix64(attempt)), b = tl_mix64(a);
        double u1 = ((double)(a >> 11) + 1.0) * 0x1.0p-53, u2 = (double)(b >> 11) * 0x1.0p-53;
        double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
        if (fabs(z) <= 3.0) return z;
    }
}

/* Element i of the random initial state of the token at `position` (seed: the session's):
   a function of (seed, position, i) only, so a token gets the same state in every forward
   that computes it. Scaled by the caller (state_init_std * embed_scale). */
TL_SHARED double tl_state_draw(uint64_t seed, int32_t position, int i) {
    const uint64_t row_key = tl_mix64(seed ^ tl_mix64((uint64_t)(uint32_t)position + 1));
    return tl_truncated_normal(row_key ^ tl_mix64((uint64_t)i << 32));
}

#endif

/*
 * Float32 math shared by the CPU kernels and, through TF_HD, the CUDA kernels,
 * so both compute the same activations. Plain arithmetic (no libm call) so
 * the CPU loops using it vectorize.
 *
 * The activations are TransformerEngine's (transformer_engine/common/util/math.h),
 * listed once in TF_OPS_ACTIVATIONS below: every kernel, CPU or GPU, element-wise
 * or gated, expands that list, so an activation is defined in one place.
 */
#ifndef TF_OPS_MATH_H
#define TF_OPS_MATH_H

#include <stdint.h>

#include "../common/tf_dtype.h"
#include "activation.h"

/*
 * exp(x) in float32 from arithmetic only (no libm call), so loops using it
 * vectorize: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor
 * polynomial (truncation < 2^-24 relative), times 2^n built from bits. Inputs
 * are clamped to [-87, 88], where 2^n stays a normal float.
 */
TF_HD float tf_ops_expf(float x) {
  x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
  const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  const float n = (x * 1.44269504f + shifter) - shifter;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 split hi + lo */
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * tf_f32_from_bits((uint32_t)((int32_t)n + 127) << 23);
}

/* Past this |argument| tf_ops_expf is clamped: exp(-a) there is not exp(-a). */
#define TF_OPS_EXP_LIMIT 87.0f

/*
 * sigmoid(a) = 1 / (1 + exp(-a)), and 0 where exp(-a) would pass the clamp (a < -87, where the
 * sigmoid is below 2^-125), so that x * sigmoid(k x) keeps torch's values at the edges: -0 far out on
 * the left and NaN at -inf. The division runs unconditionally and the limit only selects: a division
 * under the condition made GCC's AVX2 build of the loops twice as slow.
 */
TF_HD float tf_ops_sigmoid(float a) {
  const float s = 1.0f / (1.0f + tf_ops_expf(-a));
  return -a > TF_OPS_EXP_LIMIT ? 0.0f : s;
}

/*
 * sigmoid'(a) = s (1 - s), computed as exp(-a) s^2 (no cancellation in 1 - s), and 0 where exp(-a) is
 * clamped on either side; so the gradient of x * sigmoid(k x), s + k x sigmoid'(k x), is NaN at
 * +-inf, as in torch, and s alone for large finite |x|.
 */
TF_HD float tf_ops_dsigmoid(float a) {
  const float e = tf_ops_expf(-a);
  const float s = 1.0f / (1.0f + e);
  return a > TF_OPS_EXP_LIMIT || a < -TF_OPS_EXP_LIMIT ? 0.0f : e * s * s;
}

#define TF_GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define TF_GELU_K1 0.044715f

/*
 * GELU, tanh approximation: 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), computed
 * as x sigmoid(2u), since 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)): one exp and one division, and no
 * cancellation in 1 + tanh(u) for negative u. The sigmoid's limit gives torch's values at the edges:
 * -0 for very negative x, NaN for -inf.
 */

/* -2u of the tanh approximation. */
TF_HD float tf_ops_gelu_minus_2u(float x) {
  return (-2.0f * TF_GELU_K0) * x - (2.0f * TF_GELU_K0 * TF_GELU_K1) * (x * x * x);
}

TF_HD float tf_ops_gelu(float x) { return x * tf_ops_sigmoid(-tf_ops_gelu_minus_2u(x)); }

/*
 * d gelu / dx = s + x s (1 - s) d(2u)/dx. As in torch, the gradient is NaN at +-inf and for |x| so
 * large that d(2u)/dx overflows.
 */
TF_HD float tf_ops_dgelu(float x) {
  const float u2 = -tf_ops_gelu_minus_2u(x);
  const float du2 = (2.0f * TF_GELU_K0) * (1.0f + (3.0f * TF_GELU_K1) * (x * x));
  return tf_ops_sigmoid(u2) + x * du2 * tf_ops_dsigmoid(u2);
}

TF_HD float tf_ops_gelu_grad(float x, float g) { return g * tf_ops_dgelu(x); }

/* ReLU as TE's fmaxf(x, 0): a NaN input gives 0 (torch's relu would keep the NaN). */
TF_HD float tf_ops_relu(float x) { return x > 0.0f ? x : 0.0f; }

/* A select, not a product: 0 where x <= 0 whatever g is (an infinite g included), as torch. */
TF_HD float tf_ops_relu_grad(float x, float g) { return x > 0.0f ? g : 0.0f; }

/* TE's quick GELU: x sigmoid(1.702 x). */
#define TF_QGELU_K 1.702f

TF_HD float tf_ops_qgelu(float x) { return x * tf_ops_sigmoid(TF_QGELU_K * x); }

TF_HD float tf_ops_qgelu_grad(float x, float g) {
  const float kx = TF_QGELU_K * x;
  return g * (tf_ops_sigmoid(kx) + kx * tf_ops_dsigmoid(kx));
}

/* Squared ReLU, relu(x)^2 (TE's srelu); NaN gives 0 as in tf_ops_relu. */
TF_HD float tf_ops_srelu(float x) { return x > 0.0f ? x * x : 0.0f; }

TF_HD float tf_ops_srelu_grad(float x, float g) { return x > 0.0f ? g * (2.0f * x) : 0.0f; }

/* SiLU (swish): x sigmoid(x). */
TF_HD float tf_ops_silu(float x) { return x * tf_ops_sigmoid(x); }

TF_HD float tf_ops_silu_grad(float x, float g) { return g * (tf_ops_sigmoid(x) + x * tf_ops_dsigmoid(x)); }

/*
 * The activations: X(code, act, grad) with act(x) and grad(x, g) = g * act'(x) (the ReLU family as
 * selects). TF_ACT_NONE, the identity, is not listed: the kernels skip it. The gated activations
 * (activation.h) apply these to the first half of their input.
 */
#define TF_OPS_ACTIVATIONS(X)                            \
  X(TF_ACT_GELU_TANH, tf_ops_gelu, tf_ops_gelu_grad)     \
  X(TF_ACT_RELU, tf_ops_relu, tf_ops_relu_grad)          \
  X(TF_ACT_QGELU, tf_ops_qgelu, tf_ops_qgelu_grad)       \
  X(TF_ACT_SRELU, tf_ops_srelu, tf_ops_srelu_grad)       \
  X(TF_ACT_SILU, tf_ops_silu, tf_ops_silu_grad)

/* act(x) for one element (the identity for TF_ACT_NONE); the CPU loops switch outside the loop. */
TF_HD float tf_ops_act(tf_activation act, float x) {
  switch (act) {
#define TF_OPS_ACT_CASE(code, f, grad) \
  case code:                           \
    return f(x);
    TF_OPS_ACTIVATIONS(TF_OPS_ACT_CASE)
#undef TF_OPS_ACT_CASE
    default:
      return x;
  }
}

/* g * act'(x) for one element (g for TF_ACT_NONE). */
TF_HD float tf_ops_act_grad(tf_activation act, float x, float g) {
  switch (act) {
#define TF_OPS_GRAD_CASE(code, f, grad) \
  case code:                            \
    return grad(x, g);
    TF_OPS_ACTIVATIONS(TF_OPS_GRAD_CASE)
#undef TF_OPS_GRAD_CASE
    default:
      return g;
  }
}

#endif /* TF_OPS_MATH_H */

/*
 * Float32 math shared by the CPU kernels and, through TF_HD, the CUDA kernels,
 * so both compute the same activations. Plain arithmetic (no libm call) so
 * the CPU loops using it vectorize.
 */
#ifndef TF_OPS_MATH_H
#define TF_OPS_MATH_H

#include <stdint.h>

#include "../common/tf_dtype.h"

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

TF_HD float tf_ops_sigmoid(float a) { return 1.0f / (1.0f + tf_ops_expf(-a)); }

#define TF_GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define TF_GELU_K1 0.044715f

/*
 * GELU, tanh approximation: 0.5 x (1 + tanh(u)) with u = sqrt(2/pi) (x + 0.044715 x^3), computed
 * as x s with s = 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)): one exp and one division, and no
 * cancellation in 1 + tanh(u) for negative u. Where exp(-2u) would pass the clamp of tf_ops_expf
 * (s < 2^-125), s is 0, so GELU keeps torch's values at the edges: -0 for very negative x, NaN for
 * -inf.
 */
#define TF_GELU_EXP_LIMIT 87.0f

/* -2u of the tanh approximation. */
TF_HD float tf_ops_gelu_minus_2u(float x) {
  return (-2.0f * TF_GELU_K0) * x - (2.0f * TF_GELU_K0 * TF_GELU_K1) * (x * x * x);
}

/* The division runs unconditionally and the limit only selects: a division under the condition
 * made GCC's AVX2 build of the loops twice as slow. */
TF_HD float tf_ops_gelu(float x) {
  const float z = tf_ops_gelu_minus_2u(x);
  const float sigmoid = tf_ops_sigmoid(-z);
  return x * (z > TF_GELU_EXP_LIMIT ? 0.0f : sigmoid);
}

/*
 * d gelu / dx = s + x s (1 - s) d(2u)/dx, with s (1 - s) = exp(-2u) s^2 (again no cancellation).
 * That term is 0 where exp(-2u) is clamped, so, as in torch, the gradient is NaN at +-inf and for
 * |x| so large that d(2u)/dx overflows.
 */
TF_HD float tf_ops_dgelu(float x) {
  const float z = tf_ops_gelu_minus_2u(x);
  const float e = tf_ops_expf(z);
  const float sigmoid = 1.0f / (1.0f + e);
  const float s = z > TF_GELU_EXP_LIMIT ? 0.0f : sigmoid;
  const float ds = z > TF_GELU_EXP_LIMIT || z < -TF_GELU_EXP_LIMIT ? 0.0f : e * s * s;
  const float du2 = (2.0f * TF_GELU_K0) * (1.0f + (3.0f * TF_GELU_K1) * (x * x));
  return s + x * du2 * ds;
}

#endif /* TF_OPS_MATH_H */

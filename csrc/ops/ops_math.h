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

/* tanh(u) = sign(u) (1 - 2 / (exp(2|u|) + 1)); absolute error ~1e-7. */
TF_HD float tf_ops_tanhf(float u) {
  const float a = u < 0.0f ? -u : u;
  const float t = 1.0f - 2.0f / (tf_ops_expf(2.0f * a) + 1.0f);
  return u < 0.0f ? -t : t;
}

#define TF_GELU_K0 0.7978845608028654f /* sqrt(2 / pi) */
#define TF_GELU_K1 0.044715f

/* GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
TF_HD float tf_ops_gelu(float x) {
  return 0.5f * x * (1.0f + tf_ops_tanhf(TF_GELU_K0 * (x + TF_GELU_K1 * x * x * x)));
}

/* d gelu / dx of the tanh approximation. */
TF_HD float tf_ops_dgelu(float x) {
  const float t = tf_ops_tanhf(TF_GELU_K0 * (x + TF_GELU_K1 * x * x * x));
  const float du = TF_GELU_K0 * (1.0f + 3.0f * TF_GELU_K1 * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

TF_HD float tf_ops_sigmoid(float a) { return 1.0f / (1.0f + tf_ops_expf(-a)); }

#endif /* TF_OPS_MATH_H */

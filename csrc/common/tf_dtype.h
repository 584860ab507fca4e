/*
 * Element types of the C core and the bit-level conversions between them.
 *
 * Everything here is branch-free integer and float arithmetic so that the CPU
 * compiler vectorizes the loops that use it, and so that the very same code is
 * compiled for the GPU (TF_HD) -- which is what makes CPU and CUDA results
 * bit-identical.
 */
#ifndef TF_DTYPE_H
#define TF_DTYPE_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define TF_HD __host__ __device__ __forceinline__
#else
#define TF_HD static inline
#endif

typedef enum tf_dtype {
  TF_FLOAT32 = 0,
  TF_BFLOAT16 = 1,
  TF_FLOAT16 = 2
} tf_dtype;

/* Size in bytes of one element of a floating dtype, 0 for an unknown one. */
TF_HD int64_t tf_dtype_size(tf_dtype dtype) {
  return dtype == TF_FLOAT32 ? 4 : (dtype == TF_BFLOAT16 || dtype == TF_FLOAT16) ? 2 : 0;
}

TF_HD uint32_t tf_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

TF_HD float tf_f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

TF_HD float tf_bf16_to_f32(uint16_t h) { return tf_f32_from_bits((uint32_t)h << 16); }

/* Round to nearest even; NaN stays a (quiet) NaN with its sign. */
TF_HD uint16_t tf_f32_to_bf16(float f) {
  uint32_t u = tf_f32_bits(f);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  uint32_t is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return (uint16_t)(is_nan ? ((u >> 16) | 0x40u) : rounded);
}

/*
 * IEEE half -> float. Normal numbers are rebiased by a power-of-two multiply;
 * subnormals are produced exactly by the "magic number" subtraction.
 */
TF_HD float tf_f16_to_f32(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = tf_f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = tf_f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude =
      two_w < (1u << 27) ? tf_f32_bits(denormalized) : tf_f32_bits(normalized);
  return tf_f32_from_bits(sign | magnitude);
}

/*
 * float -> IEEE half, round to nearest even, overflow to Inf, NaN kept.
 * Scaling |f| up by 2^112 then down by 2^-110 makes the FPU do the rounding
 * into the half's mantissa for normal and subnormal results alike.
 */
TF_HD uint16_t tf_f32_to_f16(float f) {
  const uint32_t w = tf_f32_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  float base = (tf_f32_from_bits(w & 0x7FFFFFFFu) * 0x1.0p+112f) * 0x1.0p-110f;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = tf_f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = tf_f32_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

#endif /* TF_DTYPE_H */

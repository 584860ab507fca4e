/*
 * The two FP8 formats of te_fuser, and float32 <-> FP8 conversion.
 *
 *   E4M3 (float8_e4m3fn): bias 7, no Inf, NaN = S.1111.111, max 448.
 *   E5M2 (float8_e5m2):   bias 15, IEEE-like Inf/NaN, max 57344.
 *
 * Encoding rounds to nearest even, saturates every finite or infinite value
 * beyond the largest finite one to that value (cvt.rn.satfinite semantics),
 * encodes subnormals exactly, and maps NaN to NaN keeping its sign. It is
 * written with selects rather than branches so loops over it vectorize, and
 * it is shared verbatim by the CUDA kernels (TF_HD).
 */
#ifndef TF_FP8_FORMAT_H
#define TF_FP8_FORMAT_H

#include "../common/tf_dtype.h"

typedef enum tf_fp8_format {
  TF_FP8_E4M3 = 0,
  TF_FP8_E5M2 = 1
} tf_fp8_format;

#define TF_FP8_E4M3_MAX 448.0f
#define TF_FP8_E5M2_MAX 57344.0f

TF_HD float tf_fp8_max(tf_fp8_format format) {
  return format == TF_FP8_E4M3 ? TF_FP8_E4M3_MAX : TF_FP8_E5M2_MAX;
}

/*
 * Generic encoder for a format with `mbits` mantissa bits and exponent bias
 * `bias`; `max_code` is the code of the largest finite value, `nan_code` the
 * code used for NaN (sign added separately).
 */
TF_HD uint8_t tf_fp8_encode_generic(float v, uint32_t mbits, uint32_t bias,
                                    float max_value, uint32_t max_code, uint32_t nan_code) {
  const uint32_t bits = tf_f32_bits(v);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t abits = bits & 0x7FFFFFFFu;
  const float a = tf_f32_from_bits(abits);
  /* Smallest normal value is 2^(1-bias); below it the step is 2^(1-bias-mbits). */
  const float min_normal = tf_f32_from_bits((128u - bias) << 23);
  const float inv_step = tf_f32_from_bits((126u + bias + mbits) << 23);

  /* Normal range: round the float32 mantissa to mbits bits, carrying into the exponent. */
  const uint32_t shift = 23u - mbits;
  const uint32_t rounded = abits + ((1u << (shift - 1u)) - 1u) + ((abits >> shift) & 1u);
  const uint32_t normal_code = (rounded >> shift) - ((127u - bias) << mbits);

  /* Subnormal range: a / step is exact; adding 2^23 rounds it to nearest even. */
  const float clamped = a < min_normal ? a : min_normal;
  const float q = clamped * inv_step;
  const float q_rounded = (q + 0x1.0p23f) - 0x1.0p23f;
  const uint32_t sub_code = (uint32_t)(int32_t)q_rounded;

  uint32_t code = a < min_normal ? sub_code : normal_code;
  code = a >= max_value ? max_code : code; /* saturate, Inf included */
  code = abits > 0x7F800000u ? nan_code : code;
  return (uint8_t)(sign | code);
}

TF_HD uint8_t tf_fp8_e4m3_encode(float v) {
  return tf_fp8_encode_generic(v, 3u, 7u, TF_FP8_E4M3_MAX, 0x7Eu, 0x7Fu);
}

TF_HD uint8_t tf_fp8_e5m2_encode(float v) {
  return tf_fp8_encode_generic(v, 2u, 15u, TF_FP8_E5M2_MAX, 0x7Bu, 0x7Fu);
}

/* Generic decoder: exact, so no rounding is involved. */
TF_HD float tf_fp8_decode_generic(uint8_t code, uint32_t mbits, uint32_t bias, uint32_t is_nan) {
  const uint32_t c = code;
  const uint32_t sign = (c & 0x80u) << 24;
  const uint32_t ebits = 7u - mbits;
  const uint32_t exponent = (c >> mbits) & ((1u << ebits) - 1u);
  const uint32_t mantissa = c & ((1u << mbits) - 1u);
  const uint32_t top_exponent = (1u << ebits) - 1u;
  /* E5M2 reserves the top exponent for Inf/NaN like IEEE; E4M3 does not. */
  const uint32_t ieee_special = (mbits == 2u) & (exponent == top_exponent);
  const uint32_t f32_exponent = ieee_special ? 255u : exponent + 127u - bias;
  const uint32_t normal_bits = (f32_exponent << 23) | (mantissa << (23u - mbits));
  const float sub_value = (float)(int32_t)mantissa * tf_f32_from_bits((127u - bias + 1u - mbits) << 23);
  uint32_t magnitude = exponent == 0u ? tf_f32_bits(sub_value) : normal_bits;
  magnitude = is_nan ? 0x7FC00000u : magnitude;
  return tf_f32_from_bits(sign | magnitude);
}

TF_HD float tf_fp8_e4m3_decode(uint8_t code) {
  return tf_fp8_decode_generic(code, 3u, 7u, (code & 0x7Fu) == 0x7Fu);
}

TF_HD float tf_fp8_e5m2_decode(uint8_t code) {
  return tf_fp8_decode_generic(code, 2u, 15u, (code & 0x7Fu) > 0x7Cu);
}

#endif /* TF_FP8_FORMAT_H */

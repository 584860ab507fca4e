/*
 * The per-block scales of TransformerEngine's block-scaled FP8 recipes (docs/block_scaling.md):
 * MXFP8's E8M0 codes and Float8 block scaling's float32 scales, from a block's amax. Shared with
 * the CUDA kernels (TF_HD) so that both compute the same bits.
 */
#ifndef TF_FP8_BLOCK_FORMAT_H
#define TF_FP8_BLOCK_FORMAT_H

#include "fp8_format.h"

/* |v|'s bits with NaN mapped to 0, as an int32 (which orders like the values and vectorizes as a
 * signed max where SSE2 has no unsigned one): a max over them is TE's fmaxf amax, which drops NaN. */
TF_HD int32_t tf_abs_bits_no_nan(float v) {
  const int32_t a = (int32_t)(tf_f32_bits(v) & 0x7FFFFFFFu);
  return a > 0x7F800000 ? 0 : a;
}

/* float32(1 / fp8_max), TE's Quantized_Limits::max_norm_rcp: MXFP8 multiplies by it. */
TF_HD float tf_mxfp8_max_rcp(tf_fp8_format format) {
  return format == TF_FP8_E4M3 ? (float)(1.0 / 448.0) : (float)(1.0 / 57344.0);
}

/*
 * TE's E8M0 scale code of a block: float32(amax * max_rcp) rounded up to a power of two, 2^-127
 * (code 0) for 0 and values up to 2^-127, 2^127 (code 254) for Inf; NaN (255) only for a NaN.
 */
TF_HD uint8_t tf_mxfp8_scale_code(float amax, tf_fp8_format format) {
  const uint32_t v = tf_f32_bits(amax * tf_mxfp8_max_rcp(format)) & 0x7FFFFFFFu;
  const uint32_t exponent = v >> 23;
  const uint32_t mantissa = v & 0x7FFFFFu;
  const uint32_t up = (mantissa != 0u) & (exponent != 0xFEu) & !(exponent == 0u && mantissa <= 0x400000u);
  const uint32_t special = mantissa != 0u ? 0xFFu : 0xFEu; /* exponent 0xFF: NaN or Inf */
  return (uint8_t)(exponent == 0xFFu ? special : exponent + up);
}

/* The multiplier that scales a block's elements into FP8: 2^(127 - (code - 127)), TE's exp2f_rcp. */
TF_HD float tf_e8m0_quant_multiplier(uint8_t code) {
  const uint32_t c = code;
  const uint32_t bits = c == 255u ? 0x7FFFFFFFu : c == 254u ? 0x00400000u : (254u - c) << 23;
  return tf_f32_from_bits(bits);
}

/* The value of an E8M0 code: 2^(code - 127), NaN for 255 (TE's exp2f). */
TF_HD float tf_e8m0_decode(uint8_t code) {
  const uint32_t c = code;
  const uint32_t bits = c == 255u ? 0x7FFFFFFFu : c == 0u ? 0x00400000u : c << 23;
  return tf_f32_from_bits(bits);
}

/* TE's TypeExtrema<IType>::max: the scale that replaces an infinite fp8_max / amax. */
TF_HD float tf_block_input_max(tf_dtype dtype) {
  return dtype == TF_FLOAT32 ? 0x1.FFFFFEp127f : dtype == TF_BFLOAT16 ? 0x1.FEp127f : 65504.0f;
}

/*
 * TE's compute_scale_from_amax (Float8 block scaling): amax floored at epsilon; 1 for a zero,
 * infinite or NaN amax; else float32(fp8_max / amax), input_max where that is infinite, its mantissa
 * cleared (rounded down to a power of two) when pow2.
 */
TF_HD float tf_fp8_block_scale(float amax, float fp8_max, float epsilon, int pow2, float input_max) {
  amax = amax < epsilon ? epsilon : amax;
  const uint32_t a = tf_f32_bits(amax) & 0x7FFFFFFFu;
  float scale = fp8_max / (a == 0u ? 1.0f : amax);
  scale = (tf_f32_bits(scale) & 0x7FFFFFFFu) == 0x7F800000u ? input_max : scale;
  scale = pow2 ? tf_f32_from_bits(tf_f32_bits(scale) & 0xFF800000u) : scale;
  return (a == 0u || a >= 0x7F800000u) ? 1.0f : scale;
}

#endif /* TF_FP8_BLOCK_FORMAT_H */

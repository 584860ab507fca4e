/*
 * NVFP4's scalar arithmetic (docs/block_scaling.md, "NVFP4"): E2M1 codes, the per-tensor float32
 * global scale, the per-block E4M3 scale, round to nearest even, stochastic rounding with a
 * counter-based random stream, and the 16-point random Hadamard transform's matrix.
 *
 * An E2M1 code is a 4-bit sign-magnitude value: bit 3 the sign, bits 0-2 the magnitudes
 * {0, 0.5, 1, 1.5, 2, 3, 4, 6}; two codes per byte, the even-indexed element in the low nibble.
 */
#ifndef TF_NVFP4_FORMAT_H
#define TF_NVFP4_FORMAT_H

#include <float.h>
#include <stdint.h>

#include "../fp8/fp8_format.h"

#define TF_E2M1_MAX 6.0f

/* The magnitude of an E2M1 code's bits 0-2: m * 0.5 below 1, else (2 + m) * 2^(e - 2). */
TF_HD float tf_e2m1_decode(uint8_t code) {
  const uint32_t e = (code >> 1) & 3u, m = code & 1u;
  const float magnitude = e == 0u ? 0.5f * (float)m : (float)(2u + m) * (float)(1u << e) * 0.25f;
  return (code & 8u) ? -magnitude : magnitude;
}

/* The sign bit of v as E2M1's bit 3 (kept for zero, as a float conversion keeps it). */
TF_HD uint8_t tf_e2m1_sign(float v) { return (uint8_t)((tf_f32_bits(v) >> 28) & 8u); }

/*
 * Round to nearest even (cvt.rn.satfinite): |v| >= 5 past the tie goes to 6, ties go to the even
 * code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). NaN gives the
 * signed zero; the quantizers never pass one (their callers refuse non-finite input).
 */
TF_HD uint8_t tf_e2m1_encode_rn(float v) {
  const float a = tf_f32_from_bits(tf_f32_bits(v) & 0x7FFFFFFFu);
  const uint32_t code = (uint32_t)(a > 0.25f) + (uint32_t)(a >= 0.75f) + (uint32_t)(a > 1.25f) +
                        (uint32_t)(a >= 1.75f) + (uint32_t)(a > 2.5f) + (uint32_t)(a >= 3.5f) +
                        (uint32_t)(a > 5.0f);
  return (uint8_t)(code | tf_e2m1_sign(v));
}

/*
 * Stochastic rounding with 24 random bits u: |v| lies in [lo, hi) between two neighbouring codes
 * (hi - lo = q); it rounds up when u < (|v| - lo) / q * 2^24, so up with probability
 * ceil(d * 2^24) / 2^24 for d = (|v| - lo) / q (within 2^-24 of d). |v| >= 6 gives 6.
 * |v| - lo and the division by q (a power of two) are exact in float32.
 */
TF_HD uint8_t tf_e2m1_encode_sr(float v, uint32_t u24) {
  const float a = tf_f32_from_bits(tf_f32_bits(v) & 0x7FFFFFFFu);
  const uint32_t lo = (uint32_t)(a >= 0.5f) + (uint32_t)(a >= 1.0f) + (uint32_t)(a >= 1.5f) +
                      (uint32_t)(a >= 2.0f) + (uint32_t)(a >= 3.0f) + (uint32_t)(a >= 4.0f) +
                      (uint32_t)(a >= 6.0f);
  const float q = lo < 4u ? 0.5f : lo < 6u ? 1.0f : 2.0f;
  const float d = (a - tf_e2m1_decode((uint8_t)lo)) / q;
  const uint32_t up = lo < 7u && (float)u24 < d * 16777216.0f;
  return (uint8_t)((lo + up) | tf_e2m1_sign(v));
}

/*
 * The random bits of element `index` of a quantization seeded with `seed`: the top 24 bits of
 * SplitMix64's output for the state seed + (index + 1) * 0x9E3779B97F4A7C15 (mod 2^64).
 */
TF_HD uint32_t tf_nvfp4_random24(uint64_t seed, uint64_t index) {
  uint64_t z = seed + (index + 1u) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (uint32_t)(z >> 40);
}

/*
 * TE's global encode scale S_enc = float32(448 * 6 / amax), FLT_MAX where that is infinite, 1 for
 * amax 0 (or a quotient of 0).
 */
TF_HD float tf_nvfp4_global_scale(float amax) {
  float s = 2688.0f / amax;
  s = s > FLT_MAX ? FLT_MAX : s;
  return (amax == 0.0f || s == 0.0f) ? 1.0f : s;
}

/* TE's block scale: E4M3(satfinite, nearest even) of float32(block_amax * float32(S_enc * float32(1/6))). */
TF_HD uint8_t tf_nvfp4_block_scale(float block_amax, float s_enc) {
  const float multiplier = s_enc * (1.0f / 6.0f);
  const float s = block_amax * multiplier;
  return tf_fp8_e4m3_encode(s > FLT_MAX ? FLT_MAX : s);
}

/* What a block's elements are multiplied by before the E2M1 cast: float32(1 / float32(scale *
 * float32(1 / S_enc))), FLT_MAX where that is infinite (a zero block scale). */
TF_HD float tf_nvfp4_encode_multiplier(uint8_t scale_code, float s_enc) {
  const float s_dec = 1.0f / s_enc;
  const float r = 1.0f / (tf_fp8_e4m3_decode(scale_code) * s_dec);
  return r > FLT_MAX ? FLT_MAX : r;
}

/* The dequantization factor of a block: float32(float32(scale * amax) * float32(1 / 2688)). */
TF_HD float tf_nvfp4_decode_factor(uint8_t scale_code, float amax) {
  return tf_fp8_e4m3_decode(scale_code) * amax * (float)(1.0 / 2688.0);
}

/* TE's random signs of the wgrad Hadamard transform, as a bit mask (bit j set: row j negated). */
#define TF_NVFP4_RHT_SIGN_MASK 0xD7E8u

/* The transform's matrix entry M[j][i] = sign_j * (-1)^popcount(i & j) / 4: y = x M per 16 elements. */
TF_HD float tf_nvfp4_rht_entry(int j, int i) {
  const uint32_t parity = (uint32_t)__builtin_popcount((unsigned)(i & j)) & 1u;
  const uint32_t negative = parity ^ ((TF_NVFP4_RHT_SIGN_MASK >> j) & 1u);
  return negative ? -0.25f : 0.25f;
}

#endif /* TF_NVFP4_FORMAT_H */

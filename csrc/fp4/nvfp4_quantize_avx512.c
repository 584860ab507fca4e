/*
 * NVFP4's quantizer and amax on AVX-512 (F + BW + VL): the bytes of nvfp4.c's loops, which GCC
 * vectorizes poorly (a block's scale and multiplier one at a time through the scalar E4M3 encoder and
 * two divisions, the transposed codes gathered byte by byte).
 *
 * A band goes 16 rows by 16 columns at a time, widened to float32 in 16 registers v[r] whose lanes are
 * the columns, so both usages come from one read of x:
 *   - rowwise, the 16 rows' block amaxes are reduced across lanes into one vector (row_maxima16), whose
 *     E4M3 scales and multipliers are computed 16 at a time (block_scales16);
 *   - columnwise, a block is a lane: the Hadamard transform is 16 vector sums over the rows (in
 *     nvfp4.c's order), the block amaxes a vertical maximum;
 *   - the E2M1 codes come from the float32 bits of the value rounded (or truncated) onto the grid, looked
 *     up in a vector of codes; stochastic rounding draws 16 SplitMix64 outputs
 *     a vector with AVX-512 DQ's 64-bit multiply (built from vpmuludq's 32-bit products instead, dy took
 *     2.66 ms, not 2.05: Zen 4, 1 thread, bf16 1024 x 1024, 2026-11-29); two codes a byte by a shift
 *     across 64-bit lanes (rowwise) or nibble shifts down the lanes (columnwise).
 * Every CPU with AVX-512 F + BW + VL so far has DQ too; tf_nvfp4_avx512_usable checks for it all the same.
 */
#include "nvfp4_band.h"

#if TF_X86
#include <float.h>
#include <immintrin.h>
#include <string.h>

#include "../fp8/fp8_encode_avx512.h"
#include "nvfp4.h"
#include "nvfp4_format.h"

int tf_nvfp4_avx512_usable(void) { return tf_cpu_isa() >= TF_ISA_AVX512 && __builtin_cpu_supports("avx512dq"); }

/* The kernels below need AVX-512 DQ on top of the tier's F + BW + VL. */
#pragma GCC push_options
#pragma GCC target("avx512dq")

enum { LANES = 16 };

/* SplitMix64's increment: element `index` starts from seed + (index + 1) * GOLDEN. */
#define GOLDEN 0x9E3779B97F4A7C15ull

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* v[r] = row g + r of x at the columns [c, c + nk), zero beyond them and beyond the rows. */
TF_AVX512_INLINE void load_rows16(const void *x, tf_dtype d, int64_t ld_x, int64_t rows, int64_t g, int64_t c,
                                  int64_t nk, __m512 v[LANES]) {
  for (int r = 0; r < LANES; ++r) v[r] = g + r < rows ? load_upto16(x, (g + r) * ld_x + c, nk, d) : _mm512_setzero_ps();
}

/* |v|'s bits as int32: ordered like the values, NaN above Inf. */
TF_AVX512_INLINE __m512i abs_bits16(__m512 v) {
  return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
}

TF_AVX512_INLINE __m512i max2(__m512i a, __m512i b) { return _mm512_max_epi32(a, b); }

/* Lane r = the maximum over b[r]'s lanes: four rounds of halving shuffles, each pairing two vectors. */
TF_AVX512_INLINE __m512i row_maxima16(const __m512i b[LANES]) {
  /* Lane 4l + m of the result comes out of input 4m + l: feeding b[4l + m] there puts row r in lane r. */
  __m512i w[LANES], h[8], q[4], e[2];
  for (int j = 0; j < LANES; ++j) w[j] = b[4 * (j % 4) + j / 4];
  for (int p = 0; p < 8; ++p)
    h[p] = max2(_mm512_shuffle_i32x4(w[2 * p], w[2 * p + 1], 0x44), _mm512_shuffle_i32x4(w[2 * p], w[2 * p + 1], 0xEE));
  for (int p = 0; p < 4; ++p)
    q[p] = max2(_mm512_shuffle_i32x4(h[2 * p], h[2 * p + 1], 0x88), _mm512_shuffle_i32x4(h[2 * p], h[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p) {
    const __m512 s = _mm512_castsi512_ps(q[2 * p]), t = _mm512_castsi512_ps(q[2 * p + 1]);
    e[p] = max2(_mm512_castps_si512(_mm512_shuffle_ps(s, t, 0x44)), _mm512_castps_si512(_mm512_shuffle_ps(s, t, 0xEE)));
  }
  const __m512 s = _mm512_castsi512_ps(e[0]), t = _mm512_castsi512_ps(e[1]);
  return max2(_mm512_castps_si512(_mm512_shuffle_ps(s, t, 0x88)), _mm512_castps_si512(_mm512_shuffle_ps(s, t, 0xDD)));
}

/* tf_fp8_e4m3_decode of codes in 32-bit lanes. */
TF_AVX512_INLINE __m512 e4m3_decode16(__m512i c) {
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(c, 3), _mm512_set1_epi32(15));
  const __m512i m = _mm512_and_si512(c, _mm512_set1_epi32(7));
  const __m512i normal =
      _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23), _mm512_slli_epi32(m, 20));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0x1p-9f));
  __m512i mag = _mm512_mask_blend_epi32(_mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), normal,
                                        _mm512_castps_si512(sub));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7F));
  mag = _mm512_mask_blend_epi32(nan, mag, _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(_mm512_or_si512(mag, _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24)));
}

/* tf_nvfp4_block_scale of 16 block amaxes (as bits), and *multiplier tf_nvfp4_encode_multiplier of each. */
TF_AVX512_INLINE __m128i block_scales16(__m512i amax_bits, float s_enc, __m512 *multiplier) {
  const float to_scale = s_enc * (1.0f / 6.0f);
  const __m512 max = _mm512_set1_ps(FLT_MAX);
  /* min(FLT_MAX, s): Inf to FLT_MAX, NaN kept (vminps returns its second operand on NaN). */
  const __m512 s = _mm512_min_ps(max, _mm512_mul_ps(_mm512_castsi512_ps(amax_bits), _mm512_set1_ps(to_scale)));
  const __m128i codes = generic_codes16(s, TF_FP8_E4M3);
  const float s_dec = 1.0f / s_enc;
  const __m512 scale = _mm512_mul_ps(e4m3_decode16(_mm512_cvtepu8_epi32(codes)), _mm512_set1_ps(s_dec));
  *multiplier = _mm512_min_ps(max, _mm512_div_ps(_mm512_set1_ps(1.0f), scale));
  return codes;
}

/* E2M1's sign, bit 3, of each lane's float. */
TF_AVX512_INLINE __m512i e2m1_sign16(__m512i bits) {
  return _mm512_and_si512(_mm512_srli_epi32(bits, 28), _mm512_set1_epi32(8));
}

/*
 * tf_e2m1_encode_rn of each lane, in 32-bit lanes: |v| capped at 6 is rounded to the E2M1 grid by adding and
 * subtracting 2^(22 + its exponent, at least 0), whose float32 step (0.5 below 2, then 1, then 2) is the grid's
 * there; round to nearest even lands on the even code. The rounded value's bits >> 22 are 252 + code from 0.5 on
 * (1.0 and up: 254 + code - 2), looked up by their low 4 bits; 0 and NaN give code 0 and keep the sign.
 * (7 comparisons counted instead: x 1.24 ms and w 0.91 ms, not 1.12 and 0.78: Zen 4, 1 thread, bf16 1024 x 1024,
 * 2026-11-29.)
 */
TF_AVX512_INLINE __m512i e2m1_rn16(__m512 v) {
  const __m512 c = _mm512_min_ps(_mm512_set1_ps(6.0f), _mm512_castsi512_ps(abs_bits16(v))); /* NaN stays NaN */
  const __m512i e = _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(c), _mm512_set1_epi32(0x7F800000)),
                                     _mm512_set1_epi32(127 << 23));
  const __m512 magic = _mm512_castsi512_ps(_mm512_add_epi32(e, _mm512_set1_epi32(22 << 23)));
  const __m512 r = _mm512_sub_ps(_mm512_add_ps(c, magic), magic);
  const __m512i codes = _mm512_setr_epi32(4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 2, 3);
  const __mmask16 nonzero = _mm512_cmp_ps_mask(r, _mm512_setzero_ps(), _CMP_NEQ_OQ);
  const __m512i code = _mm512_maskz_permutexvar_epi32(nonzero, _mm512_srli_epi32(_mm512_castps_si512(r), 22), codes);
  return _mm512_or_si512(code, e2m1_sign16(_mm512_castps_si512(v)));
}

/*
 * tf_e2m1_encode_sr of each lane with the 24 random bits u24, as nvfp4.c's encode_sr_lanes computes it. The lower
 * code: |v| capped at 6 keeps one mantissa bit, the grid's step from 1 on, so its bits >> 22 are 252 + code from 0.5
 * on and at most 251 below (looked up by their low 4 bits once raised to 251); NaN gives 0. The lower code's
 * magnitude and 1 / q are looked up by the code. (7 comparisons counted instead: dy 2.05 ms, not 1.78: Zen 4,
 * 1 thread, bf16 1024 x 1024, 2026-11-29.)
 */
TF_AVX512_INLINE __m512i e2m1_sr16(__m512 v, __m512i u24) {
  const __m512 a = _mm512_castsi512_ps(abs_bits16(v));
  const __m512 c = _mm512_min_ps(_mm512_set1_ps(6.0f), a); /* NaN stays NaN */
  const __m512i index = _mm512_max_epi32(_mm512_srli_epi32(_mm512_castps_si512(c), 22), _mm512_set1_epi32(251));
  const __m512i codes = _mm512_setr_epi32(4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 3);
  const __m512i lo = _mm512_maskz_permutexvar_epi32(_mm512_cmp_ps_mask(a, a, _CMP_ORD_Q), index, codes);
  const __m512 grid = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 inverse_q = _mm512_setr_ps(2.0f, 2.0f, 2.0f, 2.0f, 1.0f, 1.0f, 0.5f, 0.5f, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 d =
      _mm512_mul_ps(_mm512_sub_ps(a, _mm512_permutexvar_ps(lo, grid)), _mm512_permutexvar_ps(lo, inverse_q));
  const __mmask16 up = _mm512_cmp_ps_mask(a, _mm512_set1_ps(6.0f), _CMP_LT_OQ) &
                       _mm512_cmp_ps_mask(_mm512_cvtepi32_ps(u24), _mm512_mul_ps(d, _mm512_set1_ps(16777216.0f)),
                                          _CMP_LT_OQ);
  return _mm512_or_si512(_mm512_mask_add_epi32(lo, up, lo, _mm512_set1_epi32(1)), e2m1_sign16(_mm512_castps_si512(v)));
}

/* tf_nvfp4_random24 from the SplitMix64 state z (seed + (index + 1) * GOLDEN) of each 64-bit lane. */
TF_AVX512_INLINE __m256i random24x8(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64((long long)0xBF58476D1CE4E5B9ull));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64((long long)0x94D049BB133111EBull));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
  return _mm512_cvtepi64_epi32(_mm512_srli_epi64(z, 40));
}

/* 16 draws: lanes 0-7 from the states z_lo, 8-15 from z_hi. */
TF_AVX512_INLINE __m512i random24x16(__m512i z_lo, __m512i z_hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(random24x8(z_lo)), random24x8(z_hi), 1);
}

/* The 8 bytes of 16 codes (32-bit lanes), two a byte, the even lane's in the low nibble. */
TF_AVX512_INLINE __m128i pack_codes16(__m512i c) {
  return _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64(c, 28)));
}

/* The transform's sign of M[j][i] (tf_nvfp4_rht_entry): constant once the callers' loops are unrolled. */
TF_AVX512_INLINE int rht_negative(int j, int i) {
  return (__builtin_popcount((unsigned)(i & j)) & 1) ^ ((TF_NVFP4_RHT_SIGN_MASK >> j) & 1);
}

/* t[i] = sum over j of float32(v[j] * M[j][i]), added in j order from +0 (nvfp4.c's columns16): v[j] * -1/4 is
 * -(v[j] * 1/4) exactly. Added negated rather than subtracted, as there: t - p would keep a NaN p's sign. */
TF_AVX512_INLINE void rht16(const __m512 v[LANES], __m512 t[LANES]) {
#pragma GCC unroll 16
  for (int i = 0; i < LANES; ++i) t[i] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int j = 0; j < LANES; ++j) {
    const __m512 p = _mm512_mul_ps(v[j], _mm512_set1_ps(0.25f));
    const __m512 n = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(p), _mm512_set1_epi32(INT32_MIN)));
#pragma GCC unroll 16
    for (int i = 0; i < LANES; ++i) t[i] = _mm512_add_ps(t[i], rht_negative(j, i) ? n : p);
  }
}

/* ---- amax -------------------------------------------------------------------------------------- */

TF_AVX512_INLINE int32_t amax_band(const tf_nvfp4_amax_args *a, int64_t row_begin, int64_t row_end, tf_dtype d) {
  __m512i best = _mm512_setzero_si512();
  __m512 v[LANES], t[LANES];
  for (int64_t g = row_begin; g < row_end; g += LANES)
    for (int64_t c = 0; c < a->cols; c += LANES) {
      load_rows16(a->x, d, a->ld_x, a->rows, g, c, a->cols - c, v);
      if (a->rht) {
        rht16(v, t);
        for (int r = 0; r < LANES; ++r) best = max2(best, abs_bits16(t[r]));
      } else {
        for (int r = 0; r < LANES; ++r) best = max2(best, abs_bits16(v[r]));
      }
    }
  return _mm512_reduce_max_epi32(best);
}

TF_TARGET_AVX512 void tf_nvfp4_amax_band_avx512(const tf_nvfp4_amax_args *a, int64_t row_begin, int64_t row_end,
                                                int32_t *result) {
  *result = a->dtype == TF_FLOAT32    ? amax_band(a, row_begin, row_end, TF_FLOAT32)
            : a->dtype == TF_BFLOAT16 ? amax_band(a, row_begin, row_end, TF_BFLOAT16)
                                      : amax_band(a, row_begin, row_end, TF_FLOAT16);
}

/* ---- quantize ---------------------------------------------------------------------------------- */

/* The per-call constants of stochastic rounding: lane k's offsets k * GOLDEN (rowwise, consecutive counters) and
 * k * rows_p * GOLDEN (columnwise, lane k a column rows_p counters on). */
typedef struct draws {
  __m512i row_lo, row_hi, col_lo, col_hi;
} draws;

TF_AVX512_INLINE __m512i lane_multiples8(uint64_t first, uint64_t step) {
  uint64_t m[8];
  for (int k = 0; k < 8; ++k) m[k] = (first + (uint64_t)k) * step;
  return _mm512_loadu_si512(m);
}

/* The 16 rows of one 16-column block rowwise: scales, codes, packed bytes (rows < nr). */
TF_AVX512_INLINE void rowwise16(const tf_nvfp4_quantize_args *a, const __m512 v[LANES], int64_t g, int64_t nr, int64_t c,
                                int two_d, uint8_t code_2d, float multiplier_2d, const draws *dr) {
  uint8_t code[LANES];
  float multiplier[LANES];
  if (two_d) {
    memset(code, code_2d, sizeof code);
    for (int r = 0; r < LANES; ++r) multiplier[r] = multiplier_2d;
  } else {
    __m512i bits[LANES], m;
    __m512 mu;
    for (int r = 0; r < LANES; ++r) bits[r] = abs_bits16(v[r]);
    m = row_maxima16(bits);
    _mm_storeu_si128((__m128i *)code, block_scales16(m, a->s_enc, &mu));
    _mm512_storeu_ps(multiplier, mu);
  }
  const int64_t ld_y = a->cols_p / 2;
  for (int64_t r = 0; r < nr; ++r) {
    a->scale[(g + r) * a->ld_scale + c / LANES] = code[r];
    const __m512 s = _mm512_mul_ps(v[r], _mm512_set1_ps(multiplier[r]));
    __m512i codes;
    if (a->stochastic) {
      const uint64_t z = a->seed + ((uint64_t)((g + r) * a->cols_p + c) + 1u) * GOLDEN;
      const __m512i zv = _mm512_set1_epi64((long long)z);
      codes = e2m1_sr16(s, random24x16(_mm512_add_epi64(zv, dr->row_lo), _mm512_add_epi64(zv, dr->row_hi)));
    } else {
      codes = e2m1_rn16(s);
    }
    _mm_storel_epi64((__m128i *)(a->y + (g + r) * ld_y + c / 2), pack_codes16(codes));
  }
}

/* The 16 columns [c, c + nk) of the row group g columnwise: lane k is column c + k's block. */
TF_AVX512_INLINE void columnwise16(const tf_nvfp4_quantize_args *a, const __m512 v[LANES], int64_t g, int64_t c,
                                   int64_t nk, int two_d, uint8_t code_2d, float multiplier_2d, const draws *dr) {
  __m512 t[LANES], mu;
  uint8_t code[LANES];
  if (a->rht_t)
    rht16(v, t);
  else
    for (int i = 0; i < LANES; ++i) t[i] = v[i];
  if (two_d) {
    memset(code, code_2d, sizeof code);
    mu = _mm512_set1_ps(multiplier_2d);
  } else {
    __m512i m = _mm512_setzero_si512();
    for (int i = 0; i < LANES; ++i) m = max2(m, abs_bits16(t[i]));
    _mm_storeu_si128((__m128i *)code, block_scales16(m, a->s_enc_t, &mu));
  }
  /* Value i of column c + k draws rows_p * cols_p + (c + k) * rows_p + g + i. */
  const uint64_t counter = (uint64_t)a->rows_p * (uint64_t)a->cols_p + (uint64_t)(c * a->rows_p + g);
  const __m512i z0 = _mm512_set1_epi64((long long)(a->seed + (counter + 1u) * GOLDEN));
  __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
  for (int i = 0; i < LANES; ++i) {
    const __m512 s = _mm512_mul_ps(t[i], mu);
    __m512i codes;
    if (a->stochastic) {
      const __m512i z = _mm512_add_epi64(z0, _mm512_set1_epi64((long long)((uint64_t)i * GOLDEN)));
      codes = e2m1_sr16(s, random24x16(_mm512_add_epi64(z, dr->col_lo), _mm512_add_epi64(z, dr->col_hi)));
    } else {
      codes = e2m1_rn16(s);
    }
    if (i < 8)
      lo = _mm512_or_si512(lo, _mm512_slli_epi32(codes, 4 * i));
    else
      hi = _mm512_or_si512(hi, _mm512_slli_epi32(codes, 4 * (i - 8)));
  }
  uint32_t low[LANES], high[LANES];
  _mm512_storeu_si512(low, lo);
  _mm512_storeu_si512(high, hi);
  const int64_t ld_y_t = a->rows_p / 2;
  for (int64_t k = 0; k < nk; ++k) {
    const uint64_t bytes = (uint64_t)low[k] | (uint64_t)high[k] << 32; /* little-endian: value 2h in byte h's low nibble */
    a->scale_t[(c + k) * a->ld_scale_t + g / LANES] = code[k];
    memcpy(a->y_t + (c + k) * ld_y_t + g / 2, &bytes, sizeof bytes);
  }
}

TF_AVX512_INLINE void quantize_band(const tf_nvfp4_quantize_args *a, int64_t row_begin, int64_t row_end, tf_dtype d) {
  const uint64_t rows_p_golden = (uint64_t)a->rows_p * GOLDEN;
  const draws dr = {lane_multiples8(0, GOLDEN), lane_multiples8(8, GOLDEN), lane_multiples8(0, rows_p_golden),
                    lane_multiples8(8, rows_p_golden)};
  __m512 v[LANES];
  for (int64_t g = row_begin; g < row_end; g += LANES) {
    const int64_t nr = min64(LANES, a->rows - g);
    for (int64_t c = 0; c < a->cols; c += LANES) {
      const int64_t nk = min64(LANES, a->cols - c);
      load_rows16(a->x, d, a->ld_x, a->rows, g, c, nk, v);
      uint8_t code_2d = 0;
      float multiplier_2d = 0.0f, multiplier_2d_t = 0.0f;
      if (a->block_2d) {
        __m512i m = _mm512_setzero_si512();
        for (int r = 0; r < LANES; ++r) m = max2(m, abs_bits16(v[r]));
        const float amax = tf_f32_from_bits((uint32_t)_mm512_reduce_max_epi32(m));
        code_2d = tf_nvfp4_block_scale(amax, a->s_enc);
        multiplier_2d = tf_nvfp4_encode_multiplier(code_2d, a->s_enc);
        multiplier_2d_t = tf_nvfp4_encode_multiplier(code_2d, a->s_enc_t);
      }
      if (a->y) rowwise16(a, v, g, nr, c, a->block_2d, code_2d, multiplier_2d, &dr);
      if (a->y_t) columnwise16(a, v, g, c, nk, a->block_2d, code_2d, multiplier_2d_t, &dr);
    }
  }
}

TF_TARGET_AVX512 void tf_nvfp4_quantize_band_avx512(const tf_nvfp4_quantize_args *a, int64_t row_begin,
                                                    int64_t row_end) {
  if (a->dtype == TF_FLOAT32)
    quantize_band(a, row_begin, row_end, TF_FLOAT32);
  else if (a->dtype == TF_BFLOAT16)
    quantize_band(a, row_begin, row_end, TF_BFLOAT16);
  else
    quantize_band(a, row_begin, row_end, TF_FLOAT16);
}

#pragma GCC pop_options

#endif /* TF_X86 */

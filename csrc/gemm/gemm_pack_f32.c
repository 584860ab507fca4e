/* Packing of FP8 blocks into the float32 layouts (gemm_kernels.h) of the portable and AVX2 paths.
 *
 * Both decode each code exactly, so they write the same bits. The AVX2 packers decode 8 codes a
 * step by arithmetic on the code's bits: no table, and no float32 subnormal is ever formed (FP8
 * subnormals are scaled integers), so a flush-to-zero mode cannot change them. b's panels are
 * decoded 8 rows x 8 k at a time and transposed in registers, straight into [kc][NR]. */
#include "gemm_kernels.h"

#include <string.h>

#if TF_X86
#include <immintrin.h>
#endif

static float decode(uint8_t code, tf_fp8_format f) {
  return f == TF_FP8_E4M3 ? tf_fp8_e4m3_decode(code) : tf_fp8_e5m2_decode(code);
}

/* Decodes n FP8 codes to float32 (branch-free, so the loop vectorizes). */
static void decode_row(const uint8_t *src, int64_t n, tf_fp8_format f, float *dst) {
  if (f == TF_FP8_E4M3)
    for (int64_t i = 0; i < n; ++i) dst[i] = tf_fp8_e4m3_decode(src[i]);
  else
    for (int64_t i = 0; i < n; ++i) dst[i] = tf_fp8_e5m2_decode(src[i]);
}

void tf_gemm_pack_a_f32_portable(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t rows,
                                 int64_t k0, int64_t kc, tf_fp8_format f, float *dst) {
  for (int64_t r = 0; r < rows; ++r) {
    if (r < valid)
      decode_row(x + (r0 + r) * ld + k0, kc, f, dst + r * kc);
    else
      memset(dst + r * kc, 0, sizeof(float) * (size_t)kc);
  }
}

void tf_gemm_pack_b_f32_portable(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t cols,
                                 int64_t k0, int64_t kc, tf_fp8_format f, float *dst) {
  for (int64_t p = 0; p < cols; p += TF_GEMM_NR) {
    float *panel = dst + p * kc;
    for (int64_t w = 0; w < TF_GEMM_NR; ++w) {
      if (p + w >= valid) {
        for (int64_t kk = 0; kk < kc; ++kk) panel[kk * TF_GEMM_NR + w] = 0.0f;
        continue;
      }
      const uint8_t *src = x + (r0 + p + w) * ld + k0;
      for (int64_t kk = 0; kk < kc; ++kk) panel[kk * TF_GEMM_NR + w] = decode(src[kk], f);
    }
  }
}

#if TF_X86
/* The constants of one format's decoder, as vectors. */
typedef struct {
  __m128i mantissa_shift; /* 23 - mantissa bits: a normal code's magnitude bits to float32's place */
  __m256i exponent_rebias;    /* (127 - bias) << 23 */
  __m256i first_normal;       /* magnitudes below it are subnormal (exponent field 0) */
  __m256 subnormal_unit;      /* 2^(1 - bias - mantissa bits): the value of a subnormal's integer */
  __m256i inf_magnitude;      /* E5M2's Inf (0x7C); -1 (no code) for E4M3 */
  __m256i last_number;        /* magnitudes above it are NaN */
} decoder;

TF_TARGET_AVX2 static inline decoder make_decoder(tf_fp8_format f) {
  const int e4m3 = f == TF_FP8_E4M3;
  const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  decoder d;
  d.mantissa_shift = _mm_cvtsi32_si128(23 - mbits);
  d.exponent_rebias = _mm256_set1_epi32((127 - bias) << 23);
  d.first_normal = _mm256_set1_epi32(1 << mbits);
  d.subnormal_unit = _mm256_castsi256_ps(_mm256_set1_epi32((127 + 1 - bias - mbits) << 23));
  d.inf_magnitude = _mm256_set1_epi32(e4m3 ? -1 : 0x7C);
  d.last_number = _mm256_set1_epi32(e4m3 ? 0x7E : 0x7C);
  return d;
}

/* The float32 values of the 8 codes in the low 8 bytes of `codes`: fp8_format.h's bits, NaN as
 * sign | 0x7FC00000. */
TF_TARGET_AVX2 static inline __m256 decode8(__m128i codes, const decoder *d) {
  const __m256i c = _mm256_cvtepu8_epi32(codes);
  const __m256i magnitude = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_xor_si256(c, magnitude), 24);
  const __m256i normal = _mm256_add_epi32(_mm256_sll_epi32(magnitude, d->mantissa_shift), d->exponent_rebias);
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), d->subnormal_unit);
  __m256i bits = _mm256_blendv_epi8(normal, _mm256_castps_si256(subnormal),
                                    _mm256_cmpgt_epi32(d->first_normal, magnitude));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7F800000), _mm256_cmpeq_epi32(magnitude, d->inf_magnitude));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000), _mm256_cmpgt_epi32(magnitude, d->last_number));
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}

/* The first n (at most 8; zeros past them, code 0 being +0) codes at src, in the low 8 bytes. */
TF_TARGET_AVX2 static inline __m128i load_codes(const uint8_t *src, int64_t n) {
  if (n >= 8) return _mm_loadl_epi64((const __m128i *)src);
  uint8_t part[8] = {0};
  if (n > 0) memcpy(part, src, (size_t)n);
  return _mm_loadl_epi64((const __m128i *)part);
}

TF_TARGET_AVX2 void tf_gemm_pack_a_f32_avx2(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid,
                                            int64_t rows, int64_t k0, int64_t kc, tf_fp8_format f,
                                            float *dst) {
  const decoder d = make_decoder(f);
  const int64_t whole = kc / 8 * 8;
  for (int64_t r = 0; r < rows; ++r) {
    float *out = dst + r * kc;
    if (r >= valid) {
      memset(out, 0, sizeof(float) * (size_t)kc);
      continue;
    }
    const uint8_t *src = x + (r0 + r) * ld + k0;
    for (int64_t i = 0; i < whole; i += 8) _mm256_storeu_ps(out + i, decode8(load_codes(src + i, 8), &d));
    for (int64_t i = whole; i < kc; ++i) out[i] = decode(src[i], f);
  }
}

/* r[i] <- column i of the 8 x 8 matrix whose rows are r[0..7]. */
TF_TARGET_AVX2 static inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

TF_TARGET_AVX2 void tf_gemm_pack_b_f32_avx2(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid,
                                            int64_t cols, int64_t k0, int64_t kc, tf_fp8_format f,
                                            float *dst) {
  const decoder d = make_decoder(f);
  for (int64_t p = 0; p < cols; p += TF_GEMM_NR) {
    float *panel = dst + p * kc;
    for (int64_t h = 0; h < TF_GEMM_NR; h += 8) {
      for (int64_t kk = 0; kk < kc; kk += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) {
          const int64_t row = p + h + i;
          r[i] = row < valid ? decode8(load_codes(x + (r0 + row) * ld + k0 + kk, kc - kk), &d)
                             : _mm256_setzero_ps();
        }
        transpose8(r); /* r[i]: k = kk + i of the 8 columns */
        const int64_t n = kc - kk < 8 ? kc - kk : 8;
        for (int64_t i = 0; i < n; ++i) _mm256_storeu_ps(panel + (kk + i) * TF_GEMM_NR + h, r[i]);
      }
    }
  }
}
#endif

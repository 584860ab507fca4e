/* FP8 GEMM driver: checks, tile loop, packing (FP8 -> bf16/float32) and the epilogue. */
#include "fp8_gemm.h"

#include <stdlib.h>
#include <string.h>

#include "../common/tf_checks.h"
#include "fp8_bf16_table.h"
#include "gemm_kernels.h"

#define KC_PAD_MAX TF_GEMM_KC /* TF_GEMM_KC is a multiple of 32 */

static const uint16_t *bf16_table(tf_fp8_format f) {
  return f == TF_FP8_E4M3 ? tf_fp8_e4m3_bf16 : tf_fp8_e5m2_bf16;
}

static float bf16_bits_to_f32(uint16_t h) { return tf_bf16_to_f32(h); }

int64_t tf_fp8_gemm_tiles(int64_t m, int64_t n) {
  if (m < 0 || n < 0) return -1;
  return ((m + TF_GEMM_MB - 1) / TF_GEMM_MB) * ((n + TF_GEMM_NB - 1) / TF_GEMM_NB);
}

static int is_float_dtype(tf_dtype d) {
  return d == TF_FLOAT32 || d == TF_BFLOAT16 || d == TF_FLOAT16;
}

tf_status tf_fp8_gemm_check(int64_t m, int64_t n, int64_t k, tf_fp8_format format_a,
                            tf_fp8_format format_b, int has_bias, tf_dtype bias_dtype,
                            tf_dtype out_dtype, tf_isa isa) {
  if (m < 0 || n < 0 || k < 0) return TF_ERR_BAD_SIZE;
  if (!tf_mul_fits(m, k) || !tf_mul_fits(n, k) || !tf_mul_fits(m, n)) return TF_ERR_OVERFLOW;
  if ((format_a != TF_FP8_E4M3 && format_a != TF_FP8_E5M2) ||
      (format_b != TF_FP8_E4M3 && format_b != TF_FP8_E5M2))
    return TF_ERR_BAD_DTYPE;
  if (!is_float_dtype(out_dtype) || (has_bias && !is_float_dtype(bias_dtype))) return TF_ERR_BAD_DTYPE;
  if ((int)isa < 0 || (int)isa > (int)tf_cpu_isa_detected()) return TF_ERR_BAD_ARGUMENT;
  return TF_OK;
}

/* ---- packing ---------------------------------------------------------------------------- */

/* Rows [r0, r0 + rows) of x (ld k), k range [k0, k0 + kc), as float32 panels of `width` rows:
 * [panel][kc][width]; rows past `valid` are zero. */
static void pack_f32(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t rows,
                     int64_t k0, int64_t kc, int64_t width, const uint16_t *table, float *dst) {
  for (int64_t p = 0; p < rows; p += width) {
    float *panel = dst + p * kc;
    for (int64_t w = 0; w < width; ++w) {
      const int64_t r = p + w;
      if (r < valid) {
        const uint8_t *src = x + (r0 + r) * ld + k0;
        for (int64_t kk = 0; kk < kc; ++kk) panel[kk * width + w] = bf16_bits_to_f32(table[src[kk]]);
      } else {
        for (int64_t kk = 0; kk < kc; ++kk) panel[kk * width + w] = 0.0f;
      }
    }
  }
}

#if TF_X86
/* a rows as groups of 16 rows, [group][16][kc_pad] bf16, zero past `valid` rows and past kc. */
static void pack_bf16_rows(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t rows,
                           int64_t k0, int64_t kc, int64_t kc_pad, const uint16_t *table,
                           uint16_t *dst) {
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t *row = dst + r * kc_pad;
    int64_t kk = 0;
    if (r < valid) {
      const uint8_t *src = x + (r0 + r) * ld + k0;
      for (; kk < kc; ++kk) row[kk] = table[src[kk]];
    }
    for (; kk < kc_pad; ++kk) row[kk] = 0;
  }
}

/* b rows (the output's columns) as groups of 16, [group][kc_pad / 2][16][2] bf16 (VNNI). */
static void pack_bf16_vnni(const uint8_t *x, int64_t ld, int64_t r0, int64_t valid, int64_t rows,
                           int64_t k0, int64_t kc, int64_t kc_pad, const uint16_t *table,
                           uint16_t *dst) {
  for (int64_t g = 0; g < rows; g += 16) {
    uint16_t *group = dst + g * kc_pad;
    for (int64_t c = 0; c < 16; ++c) {
      const int64_t r = g + c;
      const uint8_t *src = r < valid ? x + (r0 + r) * ld + k0 : 0;
      for (int64_t kk = 0; kk < kc_pad; ++kk) {
        const uint16_t v = (src && kk < kc) ? table[src[kk]] : 0;
        group[(kk >> 1) * 32 + c * 2 + (kk & 1)] = v;
      }
    }
  }
}
#endif

/* ---- epilogue --------------------------------------------------------------------------- */

static float load_as_f32(const void *p, tf_dtype d, int64_t i) {
  if (d == TF_FLOAT32) return ((const float *)p)[i];
  const uint16_t h = ((const uint16_t *)p)[i];
  return d == TF_BFLOAT16 ? tf_bf16_to_f32(h) : tf_f16_to_f32(h);
}

static void epilogue(const float *acc, int64_t rows, int64_t cols, float scale, const void *bias,
                     tf_dtype bias_dtype, void *out, tf_dtype out_dtype, int64_t ldo,
                     int64_t row0, int64_t col0) {
  for (int64_t i = 0; i < rows; ++i) {
    const float *src = acc + i * TF_GEMM_NB;
    const int64_t o = (row0 + i) * ldo + col0;
    for (int64_t j = 0; j < cols; ++j) {
      float v = src[j] * scale;
      if (bias) v += load_as_f32(bias, bias_dtype, col0 + j);
      if (out_dtype == TF_FLOAT32)
        ((float *)out)[o + j] = v;
      else if (out_dtype == TF_BFLOAT16)
        ((uint16_t *)out)[o + j] = tf_f32_to_bf16(v);
      else
        ((uint16_t *)out)[o + j] = tf_f32_to_f16(v);
    }
  }
}

/* ---- driver ----------------------------------------------------------------------------- */

static int uses_bf16_pairs(tf_isa isa) { return isa >= TF_ISA_AVX512_BF16; }

static void compute_tile(const uint8_t *a, const uint16_t *ta, const uint8_t *b,
                         const uint16_t *tb, int64_t m, int64_t n, int64_t k, tf_isa isa,
                         int64_t row0, int64_t col0, void *a_pack, void *b_pack, float *acc) {
  const int64_t rows = m - row0 < TF_GEMM_MB ? m - row0 : TF_GEMM_MB;
  const int64_t cols = n - col0 < TF_GEMM_NB ? n - col0 : TF_GEMM_NB;
  memset(acc, 0, sizeof(float) * TF_GEMM_MB * TF_GEMM_NB);
  for (int64_t k0 = 0; k0 < k; k0 += TF_GEMM_KC) {
    const int64_t kc = k - k0 < TF_GEMM_KC ? k - k0 : TF_GEMM_KC;
#if TF_X86
    if (uses_bf16_pairs(isa)) {
      const int64_t kc_pad = (kc + 31) / 32 * 32;
      pack_bf16_rows(a, k, row0, rows, TF_GEMM_MB, k0, kc, kc_pad, ta, a_pack);
      pack_bf16_vnni(b, k, col0, cols, TF_GEMM_NB, k0, kc, kc_pad, tb, b_pack);
      if (isa == TF_ISA_AMX)
        tf_gemm_block_bf16_amx(kc_pad, a_pack, b_pack, acc);
      else
        tf_gemm_block_bf16_avx512(kc_pad, a_pack, b_pack, acc);
      continue;
    }
#endif
    pack_f32(a, k, row0, rows, TF_GEMM_MB, k0, kc, TF_GEMM_MR, ta, a_pack);
    pack_f32(b, k, col0, cols, TF_GEMM_NB, k0, kc, TF_GEMM_NR, tb, b_pack);
#if TF_X86
    if (isa >= TF_ISA_AVX2) {
      tf_gemm_block_f32_avx2(kc, a_pack, b_pack, acc);
      continue;
    }
#endif
    tf_gemm_block_f32_portable(kc, a_pack, b_pack, acc);
  }
}

tf_status tf_fp8_gemm_nt(const uint8_t *a, tf_fp8_format format_a, const uint8_t *b,
                         tf_fp8_format format_b, int64_t m, int64_t n, int64_t k,
                         float scale_inv_a, float scale_inv_b, const void *bias,
                         tf_dtype bias_dtype, void *out, tf_dtype out_dtype, tf_isa isa,
                         int64_t tile_begin, int64_t tile_end) {
  const tf_status s =
      tf_fp8_gemm_check(m, n, k, format_a, format_b, bias != 0, bias_dtype, out_dtype, isa);
  if (s != TF_OK) return s;
  const int64_t tiles = tf_fp8_gemm_tiles(m, n);
  if (!tf_range_ok(tile_begin, tile_end, tiles)) return TF_ERR_BAD_SIZE;
  if (tile_begin == tile_end) return TF_OK;
  if (!out || (k > 0 && (!a || !b))) return TF_ERR_NULL_POINTER;

  /* float32 panels are the larger layout: MB x KC floats for a, NB x KC for b. */
  float *acc = malloc(sizeof(float) * TF_GEMM_MB * TF_GEMM_NB);
  float *a_pack = malloc(sizeof(float) * TF_GEMM_MB * TF_GEMM_KC);
  float *b_pack = malloc(sizeof(float) * TF_GEMM_NB * TF_GEMM_KC);
  tf_status result = TF_OK;
  if (!acc || !a_pack || !b_pack) {
    result = TF_ERR_BAD_ARGUMENT;
  } else {
    const float scale = scale_inv_a * scale_inv_b;
    const int64_t tiles_n = (n + TF_GEMM_NB - 1) / TF_GEMM_NB;
    for (int64_t t = tile_begin; t < tile_end; ++t) {
      const int64_t row0 = (t / tiles_n) * TF_GEMM_MB, col0 = (t % tiles_n) * TF_GEMM_NB;
      compute_tile(a, bf16_table(format_a), b, bf16_table(format_b), m, n, k, isa, row0, col0,
                   a_pack, b_pack, acc);
      const int64_t rows = m - row0 < TF_GEMM_MB ? m - row0 : TF_GEMM_MB;
      const int64_t cols = n - col0 < TF_GEMM_NB ? n - col0 : TF_GEMM_NB;
      epilogue(acc, rows, cols, scale, bias, bias_dtype, out, out_dtype, n, row0, col0);
    }
  }
  free(acc);
  free(a_pack);
  free(b_pack);
  return result;
}

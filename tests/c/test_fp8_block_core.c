/*
 * Standalone test of the block-scaled FP8 quantizers (no torch): the scale functions against
 * double-precision references written from docs/block_scaling.md, each tier's kernels against a
 * plain element-by-element reference over ragged sizes, special blocks and band splits (outputs
 * allocated to their exact sizes, so ASan catches a write past them), and every size and pointer
 * check. Run by tests/c/run_fp8_block.sh under ASan and UBSan.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_features.h"
#include "common/tf_dtype.h"
#include "fp8/fp8_block.h"
#include "fp8/fp8_block_format.h"

#include "check.h"

static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static uint32_t rand_u32(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

static float bits_f(uint32_t u) { return tf_f32_from_bits(u); }
static uint32_t f_bits(float f) { return tf_f32_bits(f); }
static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---- the scales ------------------------------------------------------------------------------ */

/* TE's code from its definition: v = float32(amax * float32(1 / max)), the least 2^k >= v. */
static int ref_mx_code(float amax, double fp8_max) {
  const double rcp = (double)(float)(1.0 / fp8_max);
  const float v = (float)((double)amax * rcp); /* exact product, one rounding */
  if (v == 0.0f) return 0;
  if (isinf(v)) return 254;
  int e;
  const double m = frexp(v, &e); /* v = m * 2^e, m in [0.5, 1) */
  const int ceil_log2 = m == 0.5 ? e - 1 : e;
  return ceil_log2 + 127 < 0 ? 0 : ceil_log2 + 127 > 254 ? 254 : ceil_log2 + 127;
}

static void test_mx_scale_code(void) {
  const double maxes[2] = {448.0, 57344.0};
  for (int f = 0; f < 2; ++f) {
    int bad = 0, closed_form_bad = 0;
    uint32_t first = 0;
    for (uint64_t u = 0; u <= 0x7F800000u; u += 0x3FF) {
      const float amax = bits_f((uint32_t)u);
      const int got = tf_mxfp8_scale_code(amax, (tf_fp8_format)f);
      if (got != ref_mx_code(amax, maxes[f]) && bad++ == 0) first = (uint32_t)u;
      /* Where v is normal, the code is exactly ceil(log2(amax / fp8_max)) (docs/block_scaling.md). */
      const float v = amax * tf_mxfp8_max_rcp((tf_fp8_format)f);
      if (isfinite(v) && v >= FLT_MIN) {
        const double hi = ldexp(maxes[f], got - 127), lo = ldexp(maxes[f], got - 128);
        closed_form_bad += !((double)amax <= hi && (double)amax > lo);
      }
    }
    CHECK(bad == 0, "mx scale code, format %d: %d differ, first amax bits 0x%08x", f, bad, first);
    CHECK(closed_form_bad == 0, "mx scale code, format %d: %d normal v off ceil(log2(amax/max))", f,
          closed_form_bad);
  }
  /* Around every 448 * 2^k, where a rounded reciprocal could move a code. */
  int near_bad = 0;
  for (int k = -140; k <= 120; ++k)
    for (int d = -4; d <= 4; ++d) {
      const float base = (float)ldexp(448.0, k);
      if (base == 0.0f || isinf(base)) continue;
      float a = base;
      for (int s = 0; s < abs(d); ++s) a = nextafterf(a, d < 0 ? 0.0f : INFINITY);
      near_bad += tf_mxfp8_scale_code(a, TF_FP8_E4M3) != ref_mx_code(a, 448.0);
    }
  CHECK(near_bad == 0, "mx scale code near 448 * 2^k: %d differ", near_bad);
  CHECK(tf_mxfp8_scale_code(448.0f, TF_FP8_E4M3) == 127, "amax 448 -> 2^0");
  CHECK(tf_mxfp8_scale_code(nextafterf(448.0f, 1e9f), TF_FP8_E4M3) == 128, "amax just above 448 -> 2^1");
  CHECK(tf_mxfp8_scale_code(224.0f, TF_FP8_E4M3) == 126, "amax 224 -> 2^-1");
  CHECK(tf_mxfp8_scale_code(57344.0f, TF_FP8_E5M2) == 127, "amax 57344 -> 2^0 for E5M2");
  CHECK(tf_mxfp8_scale_code(0.0f, TF_FP8_E4M3) == 0, "zero block -> code 0");
  CHECK(tf_mxfp8_scale_code(INFINITY, TF_FP8_E4M3) == 254, "Inf -> code 254 (satfinite)");
  CHECK(tf_mxfp8_scale_code(FLT_MAX, TF_FP8_E4M3) == 127 + 120, "FLT_MAX -> 2^120");
  CHECK(tf_mxfp8_scale_code(0x1p-140f, TF_FP8_E4M3) == 0, "v <= 2^-127 -> code 0");
  CHECK(tf_mxfp8_scale_code(0x1p-118f, TF_FP8_E4M3) == 1, "v in (2^-127, 2^-126] -> code 1");
  CHECK(tf_mxfp8_scale_code(NAN, TF_FP8_E4M3) == 255, "NaN -> 255");
}

static void test_e8m0(void) {
  int bad = 0;
  for (int c = 1; c <= 253; ++c)
    bad += tf_e8m0_decode((uint8_t)c) != (float)ldexp(1.0, c - 127) ||
           tf_e8m0_quant_multiplier((uint8_t)c) != (float)ldexp(1.0, 127 - c);
  CHECK(bad == 0, "e8m0 codes 1..253: %d wrong", bad);
  CHECK(tf_e8m0_decode(0) == 0x1p-127f && tf_e8m0_quant_multiplier(0) == 0x1p127f, "code 0");
  CHECK(tf_e8m0_decode(254) == 0x1p127f && tf_e8m0_quant_multiplier(254) == 0x1p-127f, "code 254");
  CHECK(isnan(tf_e8m0_decode(255)) && isnan(tf_e8m0_quant_multiplier(255)), "code 255 is NaN");
}

static float ref_block_scale(float amax, float fp8_max, float eps, int pow2, float input_max) {
  if (amax < eps) amax = eps;
  if (amax == 0.0f || isinf(amax) || isnan(amax)) return 1.0f;
  double s = (double)(float)((double)fp8_max / (double)amax);
  if (isinf(s)) s = input_max;
  if (pow2) {
    int e;
    frexp(s, &e);
    s = ldexp(1.0, e - 1);
  }
  return (float)s;
}

static void test_block_scale(void) {
  const float input_max[3] = {FLT_MAX, 0x1.FEp127f, 65504.0f};
  int bad = 0;
  for (int i = 0; i < 300000; ++i) {
    const float amax = bits_f(rand_u32() & 0x7FFFFFFFu);
    const float eps = i % 3 == 0 ? bits_f(rand_u32() & 0x7F7FFFFFu) : 0.0f;
    const int pow2 = i & 1, d = i % 3;
    const float fp8_max = i & 2 ? 448.0f : 57344.0f;
    const float got = tf_fp8_block_scale(amax, fp8_max, eps, pow2, input_max[d]);
    bad += f_bits(got) != f_bits(ref_block_scale(amax, fp8_max, eps, pow2, input_max[d]));
  }
  CHECK(bad == 0, "block scale: %d of 300000 random differ", bad);
  CHECK(tf_fp8_block_scale(0.0f, 448.0f, 0.0f, 0, FLT_MAX) == 1.0f, "amax 0 -> 1");
  CHECK(tf_fp8_block_scale(INFINITY, 448.0f, 0.0f, 1, FLT_MAX) == 1.0f, "amax Inf -> 1");
  CHECK(tf_fp8_block_scale(0x1p-140f, 448.0f, 0.0f, 0, FLT_MAX) == FLT_MAX, "infinite quotient -> FLT_MAX");
  CHECK(tf_fp8_block_scale(0x1p-140f, 448.0f, 0.0f, 0, 0x1.FEp127f) == 0x1.FEp127f, "... bf16 max for bf16");
  CHECK(tf_fp8_block_scale(0x1p-140f, 448.0f, 0.0f, 1, FLT_MAX) == 0x1p127f, "pow2 of FLT_MAX");
  CHECK(tf_fp8_block_scale(3.0f, 448.0f, 0.0f, 1, FLT_MAX) == 128.0f, "448/3 = 149.3 -> 128");
  CHECK(tf_fp8_block_scale(0.0f, 448.0f, 0.5f, 0, FLT_MAX) == 896.0f, "epsilon floors a zero amax");
  CHECK(tf_fp8_block_scale(7.0f, 448.0f, 0.0f, 0, FLT_MAX) == 64.0f, "448 / 7");
}

/* ---- kernels against element-by-element references ------------------------------------------- */

static const tf_dtype DTYPES[3] = {TF_FLOAT32, TF_BFLOAT16, TF_FLOAT16};

static float load(const void *x, tf_dtype d, int64_t i) {
  if (d == TF_FLOAT32) return ((const float *)x)[i];
  const uint16_t h = ((const uint16_t *)x)[i];
  return d == TF_BFLOAT16 ? tf_bf16_to_f32(h) : tf_f16_to_f32(h);
}

static uint8_t enc(float v, tf_fp8_format f) { return f == TF_FP8_E4M3 ? tf_fp8_e4m3_encode(v) : tf_fp8_e5m2_encode(v); }

/* out[i * cdiv(cols, bc) + j] = max |x| over block (i, j) of br x bc blocks, NaN skipped (calloc'ed). */
static float *amax_grid(const void *x, tf_dtype d, int64_t ld, int64_t rows, int64_t cols, int64_t br, int64_t bc) {
  const int64_t nj = cdiv(cols, bc);
  float *out = calloc((size_t)(cdiv(rows, br) * nj + 1), sizeof(float));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float a = fabsf(load(x, d, r * ld + c));
      float *m = &out[r / br * nj + c / bc];
      if (a > *m) *m = a;
    }
  return out;
}

/* A rows x ld input of dtype d (the matrix and its row padding) with random magnitudes over many binades, some
 * all-zero rows and columns, and NaN, Inf, subnormal and huge values scattered in. */
static void *make_input(tf_dtype d, int64_t rows, int64_t ld) {
  const int64_t n = rows * ld;
  void *x = malloc((size_t)(n > 0 ? n : 1) * (size_t)tf_dtype_size(d));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = i / ld, c = i % ld;
    const uint32_t pick = rand_u32() % 64;
    float v = (float)ldexp((double)(rand_u32() % 2048) / 1024.0 - 1.0, (int)(rand_u32() % 40) - 20);
    if (r % 37 == 5 || c % 41 == 7) v = 0.0f; /* zero rows and columns: whole zero blocks */
    if (pick == 0) v = NAN;
    if (pick == 1) v = r % 2 ? INFINITY : -INFINITY;
    if (pick == 2) v = bits_f(rand_u32() & 0x807FFFFFu); /* float32 subnormal */
    if (pick == 3) v = r % 2 ? 3e38f : 6e4f;
    if (r % 53 == 11) v = NAN; /* all-NaN rows */
    if (d == TF_FLOAT32) ((float *)x)[i] = v;
    else ((uint16_t *)x)[i] = d == TF_BFLOAT16 ? tf_f32_to_bf16(v) : tf_f32_to_f16(v);
  }
  return x;
}

static void *exact(int64_t bytes) { return malloc((size_t)(bytes > 0 ? bytes : 1)); }

static const int ISA_CAPS[3] = {TF_ISA_PORTABLE, TF_ISA_AVX2, TF_ISA_AVX512};

static void test_mxfp8_kernel(void) {
  const int64_t sizes_r[] = {1, 31, 32, 33, 70}, sizes_c[] = {1, 31, 32, 33, 600};
  int bad = 0, runs = 0;
  for (int t = 0; t < 3; ++t) {
    if (ISA_CAPS[t] > (int)tf_cpu_isa_detected()) continue;
    CHECK(tf_set_cpu_isa_cap(ISA_CAPS[t]) == TF_OK, "set cap");
    for (int di = 0; di < 3; ++di)
      for (int f = 0; f < 2; ++f)
        for (int ri = 0; ri < 5; ++ri)
          for (int ci = 0; ci < 5; ++ci) {
            const int64_t rows = sizes_r[ri], cols = sizes_c[ci], ld = cols + 3;
            const tf_dtype d = DTYPES[di];
            const int64_t ls = cdiv(cols, 32), lsc = cols, srows = cdiv(rows, 32);
            void *x = make_input(d, rows, ld);
            uint8_t *y = exact(rows * cols), *s = exact(rows * ls), *yc = exact(rows * cols),
                    *sc = exact(srows * lsc);
            /* Two bands split on a 32-row boundary. */
            const int64_t mid = rows > 32 ? 32 : rows;
            int st = tf_mxfp8_quantize(x, d, rows, cols, ld, 0, mid, (tf_fp8_format)f, y, s, ls, yc, sc, lsc);
            st |= tf_mxfp8_quantize(x, d, rows, cols, ld, mid, rows, (tf_fp8_format)f, y, s, ls, yc, sc, lsc);
            bad += st != TF_OK;
            float *row_amax = amax_grid(x, d, ld, rows, cols, 1, 32), *col_amax = amax_grid(x, d, ld, rows, cols, 32, 1);
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < cols; ++c) {
                const int64_t b = c / 32, rb = r / 32;
                const uint8_t code = tf_mxfp8_scale_code(row_amax[r * ls + b], (tf_fp8_format)f);
                const uint8_t code_c = tf_mxfp8_scale_code(col_amax[rb * cols + c], (tf_fp8_format)f);
                const float v = load(x, d, r * ld + c);
                bad += s[r * ls + b] != code || sc[rb * lsc + c] != code_c;
                bad += y[r * cols + c] != enc(v * tf_e8m0_quant_multiplier(code), (tf_fp8_format)f);
                bad += yc[r * cols + c] != enc(v * tf_e8m0_quant_multiplier(code_c), (tf_fp8_format)f);
              }
            ++runs;
            free(x), free(y), free(s), free(yc), free(sc), free(row_amax), free(col_amax);
          }
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(bad == 0 && runs > 0, "mxfp8 kernels: %d mismatches over %d runs", bad, runs);
}

static void test_fp8_block_kernel(void) {
  const int64_t sizes[] = {1, 127, 128, 129, 300};
  int bad = 0, runs = 0;
  for (int t = 0; t < 3; ++t) {
    if (ISA_CAPS[t] > (int)tf_cpu_isa_detected()) continue;
    CHECK(tf_set_cpu_isa_cap(ISA_CAPS[t]) == TF_OK, "set cap");
    for (int di = 0; di < 3; ++di)
      for (int dim = 1; dim <= 2; ++dim)
        for (int ri = 0; ri < 5; ++ri)
          for (int ci = 0; ci < 5; ++ci) {
            const int64_t rows = sizes[ri], cols = sizes[ci], ld = cols + 1;
            const tf_dtype d = DTYPES[di];
            const tf_fp8_format f = (tf_fp8_format)((ri + ci) % 2);
            const int pow2 = (ri + ci + dim) % 2;
            const float eps = ci == 4 ? 1e-3f : 0.0f;
            const int64_t rb = cdiv(rows, 128), cb = cdiv(cols, 128);
            const int64_t ls = dim == 1 ? rows : cb, lst = dim == 1 ? cols : rb;
            const int64_t s_n = (dim == 1 ? cb : rb) * ls, st_n = (dim == 1 ? rb : cb) * lst;
            void *x = make_input(d, rows, ld);
            uint8_t *y = exact(rows * cols), *yt = exact(rows * cols);
            float *s = exact(s_n * 4), *stt = exact(st_n * 4);
            const int64_t mid = rows > 128 ? 128 : rows;
            int st = tf_fp8_block_quantize(x, d, rows, cols, ld, 0, mid, f, dim, eps, pow2, y, s, ls, yt, stt, lst);
            st |= tf_fp8_block_quantize(x, d, rows, cols, ld, mid, rows, f, dim, eps, pow2, y, s, ls, yt, stt, lst);
            bad += st != TF_OK;
            const float in_max = tf_block_input_max(d);
            float *grid_r = amax_grid(x, d, ld, rows, cols, dim == 1 ? 1 : 128, 128);
            float *grid_c = amax_grid(x, d, ld, rows, cols, 128, dim == 1 ? 1 : 128);
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < cols; ++c) {
                const float row_amax = grid_r[(dim == 1 ? r : r / 128) * cb + c / 128];
                const float col_amax = grid_c[r / 128 * (dim == 1 ? cols : cb) + (dim == 1 ? c : c / 128)];
                const float sr = ref_block_scale(row_amax, tf_fp8_max(f), eps, pow2, in_max);
                const float sc = ref_block_scale(col_amax, tf_fp8_max(f), eps, pow2, in_max);
                const float v = load(x, d, r * ld + c);
                bad += y[r * cols + c] != enc(v * sr, f) || yt[c * rows + r] != enc(v * sc, f);
                const float s_got = dim == 1 ? s[c / 128 * ls + r] : s[r / 128 * ls + c / 128];
                const float st_got = dim == 1 ? stt[r / 128 * lst + c] : stt[c / 128 * lst + r / 128];
                bad += f_bits(s_got) != f_bits(1.0f / sr) || f_bits(st_got) != f_bits(1.0f / sc);
              }
            ++runs;
            free(x), free(y), free(yt), free(s), free(stt), free(grid_r), free(grid_c);
          }
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(bad == 0 && runs > 0, "fp8 block kernels: %d mismatches over %d runs", bad, runs);
}

static float store_round(float v, tf_dtype d) {
  if (d == TF_FLOAT32) return v;
  return d == TF_BFLOAT16 ? tf_bf16_to_f32(tf_f32_to_bf16(v)) : tf_f16_to_f32(tf_f32_to_f16(v));
}

static void test_dequantize_kernel(void) {
  const int64_t rows = 70, cols = 300;
  /* (block rows, block cols, transposed, kind): the six layouts of docs/block_scaling.md. */
  const int layouts[6][4] = {{1, 32, 0, 0}, {32, 1, 0, 0}, {1, 128, 1, 1}, {128, 128, 0, 1}, {128, 1, 0, 1}, {1, 1, 1, 1}};
  uint8_t *y = exact(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) y[i] = (uint8_t)rand_u32();
  int bad = 0;
  for (int t = 0; t < 3; ++t) {
    if (ISA_CAPS[t] > (int)tf_cpu_isa_detected()) continue;
    CHECK(tf_set_cpu_isa_cap(ISA_CAPS[t]) == TF_OK, "set cap");
    for (int li = 0; li < 6; ++li)
      for (int di = 0; di < 3; ++di)
        for (int f = 0; f < 2; ++f) {
          const int64_t br = layouts[li][0], bc = layouts[li][1];
          const int tr = layouts[li][2];
          const tf_block_scale_kind kind = (tf_block_scale_kind)layouts[li][3];
          const int64_t srows = tr ? cdiv(cols, bc) : cdiv(rows, br), scols = tr ? cdiv(rows, br) : cdiv(cols, bc);
          void *scale = exact(srows * scols * (kind == TF_BLOCK_SCALE_E8M0 ? 1 : 4));
          for (int64_t i = 0; i < srows * scols; ++i) {
            if (kind == TF_BLOCK_SCALE_E8M0) ((uint8_t *)scale)[i] = (uint8_t)rand_u32();
            else ((float *)scale)[i] = bits_f((rand_u32() & 0x3FFFFFFFu) + 0x1F000000u);
          }
          const tf_dtype d = DTYPES[di];
          void *x = exact(rows * cols * tf_dtype_size(d));
          int st = tf_block_dequantize(y, (tf_fp8_format)f, rows, cols, 0, 33, scale, kind, srows, scols, br, bc, tr, x, d);
          st |= tf_block_dequantize(y, (tf_fp8_format)f, rows, cols, 33, rows, scale, kind, srows, scols, br, bc, tr, x, d);
          bad += st != TF_OK;
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < cols; ++c) {
              const int64_t i = r / br, j = c / bc, at = tr ? j * scols + i : i * scols + j;
              const float sv = kind == TF_BLOCK_SCALE_E8M0 ? tf_e8m0_decode(((uint8_t *)scale)[at]) : ((float *)scale)[at];
              const uint8_t code = y[r * cols + c];
              const double value = (double)(f ? tf_fp8_e5m2_decode(code) : tf_fp8_e4m3_decode(code));
              const float want = store_round((float)(value * (double)sv), d);
              const float got = load(x, d, r * cols + c);
              bad += !(f_bits(got) == f_bits(want) || (isnan(got) && isnan(want)));
            }
          free(scale), free(x);
        }
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(bad == 0, "block dequantize: %d mismatches", bad);
  free(y);
}

/* ---- argument checks -------------------------------------------------------------------------- */

static void test_checks(void) {
  float x[64 * 64] = {0};
  uint8_t y[64 * 64], yc[64 * 64], s[64 * 64], sc[64 * 64];
  float fs[64 * 64], fst[64 * 64];
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, y, s, 2, yc, sc, 64) == TF_OK, "mx ok");
  CHECK(tf_mxfp8_quantize(x, (tf_dtype)7, 64, 64, 64, 0, 64, TF_FP8_E4M3, y, s, 2, 0, 0, 0) == TF_ERR_BAD_DTYPE, "mx dtype");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, (tf_fp8_format)2, y, s, 2, 0, 0, 0) == TF_ERR_BAD_DTYPE, "mx format");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, -1, 64, 64, 0, 0, TF_FP8_E4M3, y, s, 2, 0, 0, 0) == TF_ERR_BAD_SIZE, "mx rows < 0");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 64, 64, 63, 0, 64, TF_FP8_E4M3, y, s, 2, 0, 0, 0) == TF_ERR_BAD_SIZE, "mx ld_x < cols");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 65, TF_FP8_E4M3, y, s, 2, 0, 0, 0) == TF_ERR_BAD_SIZE, "mx band past rows");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, y, s, 1, 0, 0, 0) == TF_ERR_BAD_SIZE, "mx ld_scale");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 0, 0, 0, yc, sc, 63) == TF_ERR_BAD_SIZE, "mx ld_scale_col");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 64, 64, 64, 16, 64, TF_FP8_E4M3, 0, 0, 0, yc, sc, 64) == TF_ERR_BAD_SIZE, "mx band not on a block");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 64, 64, 64, 16, 64, TF_FP8_E4M3, y, s, 2, 0, 0, 0) == TF_OK, "mx rowwise band anywhere");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, y, 0, 2, 0, 0, 0) == TF_ERR_NULL_POINTER, "mx y without scale");
  CHECK(tf_mxfp8_quantize(0, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, y, s, 2, 0, 0, 0) == TF_ERR_NULL_POINTER, "mx x NULL");
  CHECK(tf_mxfp8_quantize(0, TF_FLOAT32, 64, 64, 64, 0, 0, TF_FP8_E4M3, y, s, 2, 0, 0, 0) == TF_OK, "mx empty band");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, INT64_MAX / 2, 4, 4, 0, 0, TF_FP8_E4M3, y, s, 1, 0, 0, 0) == TF_ERR_OVERFLOW, "mx rows * ld_x overflows bytes");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 1 << 20, 4, 4, 0, 0, TF_FP8_E4M3, y, s, INT64_MAX / 4, 0, 0, 0) == TF_ERR_OVERFLOW, "mx rows * ld_scale overflows");
  CHECK(tf_mxfp8_quantize(x, TF_FLOAT32, 1 << 20, 4, 4, 0, 0, TF_FP8_E4M3, 0, 0, 0, yc, sc, INT64_MAX / 4) == TF_ERR_OVERFLOW, "mx scale_col overflows");

  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 1, 0.0f, 1, y, fs, 64, yc, fst, 64) == TF_OK, "block ok");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 3, 0.0f, 1, y, fs, 64, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "block_dim 3");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 1, -1.0f, 1, y, fs, 64, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "epsilon < 0");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 1, NAN, 1, y, fs, 64, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "epsilon NaN");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 1, INFINITY, 1, y, fs, 64, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "epsilon Inf");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 1, 0.0f, 1, y, fs, 63, 0, 0, 0) == TF_ERR_BAD_SIZE, "1D ld_scale < rows");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 1, 0.0f, 1, 0, 0, 0, yc, fst, 63) == TF_ERR_BAD_SIZE, "1D ld_scale_t < cols");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 2, 0.0f, 1, y, fs, 0, 0, 0, 0) == TF_ERR_BAD_SIZE, "2D ld_scale 0");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 300, 64, 64, 100, 300, TF_FP8_E4M3, 2, 0.0f, 1, y, fs, 1, 0, 0, 0) == TF_ERR_BAD_SIZE, "2D band not on a block");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 300, 64, 64, 128, 200, TF_FP8_E4M3, 1, 0.0f, 1, 0, 0, 0, yc, fst, 64) == TF_ERR_BAD_SIZE, "columnwise band end not on a block");
  CHECK(tf_fp8_block_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, TF_FP8_E4M3, 1, 0.0f, 1, 0, fs, 64, 0, 0, 0) == TF_ERR_NULL_POINTER, "scale without y");

  CHECK(tf_block_dequantize(y, TF_FP8_E4M3, 64, 64, 0, 64, s, TF_BLOCK_SCALE_E8M0, 64, 2, 1, 32, 0, fs, TF_FLOAT32) == TF_OK, "dequantize ok");
  CHECK(tf_block_dequantize(y, TF_FP8_E4M3, 64, 64, 0, 64, s, TF_BLOCK_SCALE_E8M0, 64, 1, 1, 32, 0, fs, TF_FLOAT32) == TF_ERR_BAD_SIZE, "scale too narrow");
  CHECK(tf_block_dequantize(y, TF_FP8_E4M3, 64, 64, 0, 64, s, TF_BLOCK_SCALE_E8M0, 2, 63, 1, 32, 1, fs, TF_FLOAT32) == TF_ERR_BAD_SIZE, "transposed scale too short");
  CHECK(tf_block_dequantize(y, TF_FP8_E4M3, 64, 64, 0, 64, s, TF_BLOCK_SCALE_E8M0, 64, 2, 0, 32, 0, fs, TF_FLOAT32) == TF_ERR_BAD_SIZE, "block_rows 0");
  CHECK(tf_block_dequantize(y, TF_FP8_E4M3, 64, 64, 0, 64, s, (tf_block_scale_kind)2, 64, 2, 1, 32, 0, fs, TF_FLOAT32) == TF_ERR_BAD_ARGUMENT, "scale kind");
  CHECK(tf_block_dequantize(y, TF_FP8_E4M3, 64, 64, 0, 64, 0, TF_BLOCK_SCALE_E8M0, 64, 2, 1, 32, 0, fs, TF_FLOAT32) == TF_ERR_NULL_POINTER, "scale NULL");
  CHECK(tf_block_dequantize(y, TF_FP8_E4M3, INT64_MAX / 2, 4, 0, 0, s, TF_BLOCK_SCALE_E8M0, 1, 1, INT64_MAX, 4, 0, fs, TF_FLOAT32) == TF_ERR_OVERFLOW, "rows * cols overflows");
  CHECK(tf_block_dequantize(y, TF_FP8_E4M3, 4, 4, 0, 4, s, TF_BLOCK_SCALE_E8M0, INT64_MAX / 2, 4, 4, 4, 0, fs, TF_FLOAT32) == TF_ERR_OVERFLOW, "scale size overflows");
}

int main(void) {
  test_mx_scale_code();
  test_e8m0();
  test_block_scale();
  test_mxfp8_kernel();
  test_fp8_block_kernel();
  test_dequantize_kernel();
  test_checks();
  return check_report();
}

/*
 * Standalone test of the NVFP4 quantizers (no torch): the scalar functions against double-precision
 * references written from docs/block_scaling.md, each tier's kernels against a plain element-by-element
 * reference (1D and 2D blocks, the Hadamard transform, stochastic rounding, band splits; outputs
 * allocated to their exact sizes, so ASan catches a write past them), and every size and pointer check.
 * Run by tests/c/run_nvfp4.sh under ASan and UBSan.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cpu_features.h"
#include "common/tf_dtype.h"
#include "fp4/nvfp4.h"
#include "fp4/nvfp4_format.h"

#include "check.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rand_u32(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

static const double GRID[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

/* ---- the scalar functions ------------------------------------------------------------------- */

/* The nearest grid magnitude, ties to the even code; beyond 6 (Inf too) 6. */
static int ref_rn_code(float v) {
  const double a = fabs((double)v);
  int best = 7;
  if (a < 6.0) {
    best = 0;
    for (int k = 1; k < 8; ++k) {
      const double d = fabs(a - GRID[k]), db = fabs(a - GRID[best]);
      if (d < db || (d == db && k % 2 == 0)) best = k;
    }
  }
  return best | (signbit(v) ? 8 : 0);
}

static void test_e2m1(void) {
  int bad = 0;
  for (int c = 0; c < 16; ++c) {
    const double want = (c & 8 ? -1.0 : 1.0) * GRID[c & 7];
    bad += tf_e2m1_decode((uint8_t)c) != want || !!signbit(tf_e2m1_decode((uint8_t)c)) != !!(c & 8);
  }
  CHECK(bad == 0, "e2m1 decode: %d codes wrong", bad);
  bad = 0;
  uint32_t first = 0;
  for (uint64_t u = 0; u <= 0xFF800000u; u += 0x1FF) {
    const float v = tf_f32_from_bits((uint32_t)u);
    if (isnan(v)) continue;
    if (tf_e2m1_encode_rn(v) != ref_rn_code(v) && bad++ == 0) first = (uint32_t)u;
  }
  /* Every tie and its float32 neighbours. */
  for (int k = 0; k < 7; ++k)
    for (int s = 0; s < 2; ++s) {
      float mid = (float)((GRID[k] + GRID[k + 1]) / 2) * (s ? -1.0f : 1.0f);
      const float near[3] = {nextafterf(mid, -INFINITY), mid, nextafterf(mid, INFINITY)};
      for (int i = 0; i < 3; ++i)
        if (tf_e2m1_encode_rn(near[i]) != ref_rn_code(near[i]) && bad++ == 0) first = tf_f32_bits(near[i]);
    }
  CHECK(bad == 0, "e2m1 round to nearest even: %d differ, first bits 0x%08x", bad, first);
  CHECK(tf_e2m1_encode_rn(-0.0f) == 8 && tf_e2m1_encode_rn(INFINITY) == 7 && tf_e2m1_encode_rn(-1e30f) == 15,
        "signed zero, Inf and huge values saturate");
  CHECK(tf_e2m1_encode_rn(NAN) == 0 && tf_e2m1_encode_rn(-NAN) == 8, "NaN gives the signed zero");
}

static void test_stochastic(void) {
  int bad = 0, neighbour_bad = 0;
  for (int t = 0; t < 400000; ++t) {
    const float v = ((float)(int32_t)rand_u32() / 2147483648.0f) * 7.0f;
    const uint32_t u = rand_u32() >> 8;
    const int got = tf_e2m1_encode_sr(v, u);
    const double a = fabs((double)v);
    int lo = 0;
    while (lo < 7 && GRID[lo + 1] <= a) ++lo;
    const int up = lo < 7 && (double)u < (a - GRID[lo]) / (GRID[lo + 1] - GRID[lo]) * 16777216.0;
    bad += got != ((lo + up) | (signbit(v) ? 8 : 0));
    neighbour_bad += (got & 7) != lo && (got & 7) != lo + 1;
  }
  CHECK(bad == 0, "stochastic rounding: %d of 400000 differ from the rule", bad);
  CHECK(neighbour_bad == 0, "stochastic rounding: %d results not a neighbour", neighbour_bad);
  /* Grid values never move; u = 0 rounds up anything off the grid, u = 2^24 - 1 almost nothing. */
  int grid_bad = 0;
  for (int k = 0; k < 8; ++k)
    for (uint32_t u = 0; u < (1u << 24); u += 4099) grid_bad += tf_e2m1_encode_sr((float)GRID[k], u) != k;
  CHECK(grid_bad == 0, "grid values move under stochastic rounding: %d", grid_bad);
  CHECK(tf_e2m1_encode_sr(0.75f, 0) == 2 && tf_e2m1_encode_sr(0.75f, (1u << 23) - 1) == 2 &&
            tf_e2m1_encode_sr(0.75f, 1u << 23) == 1,
        "0.75: up with probability exactly 1/2");
  uint64_t seen = 0;
  for (uint64_t i = 0; i < 64; ++i) seen |= 1ull << (tf_nvfp4_random24(7, i) >> 18);
  CHECK(__builtin_popcountll(seen) > 40, "random stream spreads over its range (%d of 64 bins)", __builtin_popcountll(seen));
  CHECK(tf_nvfp4_random24(7, 3) == tf_nvfp4_random24(7, 3) && tf_nvfp4_random24(7, 3) != tf_nvfp4_random24(8, 3),
        "random stream: reproducible, seed-dependent");
}

static float ref_global_scale(float amax) {
  double s = (double)(float)(2688.0 / (double)amax);
  if (isinf(s)) s = FLT_MAX;
  return (amax == 0.0f || s == 0.0) ? 1.0f : (float)s;
}

static void test_scales(void) {
  int bad = 0, block_bad = 0;
  const float one_sixth = (float)(1.0 / 6.0);
  for (uint64_t u = 0; u < 0x7F800000u; u += 0x7FF) {
    const float amax = tf_f32_from_bits((uint32_t)u);
    const float s = tf_nvfp4_global_scale(amax);
    bad += tf_f32_bits(s) != tf_f32_bits(ref_global_scale(amax));
    const float block = amax * (float)((rand_u32() & 0xFFFF) / 65536.0);
    const float multiplier = (float)((double)s * (double)one_sixth);
    double d = (double)(float)((double)block * (double)multiplier);
    block_bad += tf_nvfp4_block_scale(block, s) != tf_fp8_e4m3_encode(isinf(d) ? FLT_MAX : (float)d);
  }
  CHECK(bad == 0, "global scale: %d differ", bad);
  CHECK(block_bad == 0, "block scale: %d differ", block_bad);
  CHECK(tf_nvfp4_global_scale(0.0f) == 1.0f && tf_nvfp4_global_scale(1e-45f) == FLT_MAX &&
            tf_nvfp4_global_scale(2688.0f) == 1.0f,
        "global scale of 0, of a subnormal and of 2688");
  CHECK(tf_nvfp4_block_scale(1e30f, FLT_MAX) == 0x7E, "block scale saturates at 448");
  CHECK(tf_nvfp4_encode_multiplier(0, 1.0f) == FLT_MAX, "zero block scale: multiplier FLT_MAX");
  /* The transform's matrix is orthogonal: M M^T = I exactly (entries +-1/4, 16 of them per dot). */
  int orth_bad = 0;
  for (int i = 0; i < 16; ++i)
    for (int k = 0; k < 16; ++k) {
      double dot = 0.0;
      for (int j = 0; j < 16; ++j) dot += (double)tf_nvfp4_rht_entry(i, j) * tf_nvfp4_rht_entry(k, j);
      orth_bad += dot != (i == k ? 1.0 : 0.0);
    }
  CHECK(orth_bad == 0, "Hadamard matrix not orthogonal: %d entries", orth_bad);
}

/* ---- the kernels against an element-by-element reference ------------------------------------ */

static const tf_dtype DTYPES[3] = {TF_FLOAT32, TF_BFLOAT16, TF_FLOAT16};
static const int ISA_CAPS[3] = {TF_ISA_PORTABLE, TF_ISA_AVX2, TF_ISA_AVX512};

static float widen(const void *x, tf_dtype d, int64_t i) {
  if (d == TF_FLOAT32) return ((const float *)x)[i];
  const uint16_t h = ((const uint16_t *)x)[i];
  return d == TF_BFLOAT16 ? tf_bf16_to_f32(h) : tf_f16_to_f32(h);
}

/* randn-like values with edge blocks: an all-zero block, huge and tiny blocks, signed zeros. */
static void *make_input(tf_dtype d, int64_t rows, int64_t ld) {
  void *x = malloc((size_t)(rows * ld) * tf_dtype_size(d));
  for (int64_t i = 0; i < rows * ld; ++i) {
    const int64_t r = i / ld, c = i % ld;
    float v = ((float)(int32_t)rand_u32() / 2147483648.0f) * 3.0f;
    if (c / 16 == 1) v = 0.0f;
    if (c / 16 == 2 && r % 3 == 0) v *= 1e4f;
    if (c / 16 == 3) v *= 1e-6f;
    if (c % 29 == 5) v = -0.0f;
    if (d == TF_FLOAT32) ((float *)x)[i] = v;
    else ((uint16_t *)x)[i] = d == TF_BFLOAT16 ? tf_f32_to_bf16(v) : tf_f32_to_f16(v);
  }
  return x;
}

static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

/* Element (r, c) of the rows x cols matrix x zero-padded: 0 outside it. */
static float padded(const void *x, tf_dtype d, int64_t ld, int64_t rows, int64_t cols, int64_t r, int64_t c) {
  return r < rows && c < cols ? widen(x, d, r * ld + c) : 0.0f;
}

/* The columnwise value (c, r) of x zero-padded: x itself, or the transform of its column's 16-row group. */
static float ref_column_value(const void *x, tf_dtype d, int64_t ld, int64_t rows, int64_t cols, int64_t r,
                              int64_t c, int rht) {
  if (!rht) return padded(x, d, ld, rows, cols, r, c);
  const int64_t g = r / 16 * 16;
  float acc = 0.0f;
  for (int j = 0; j < 16; ++j) {
    const float m = (((__builtin_popcount((unsigned)(j & (r - g))) & 1) ^ ((0xD7E8 >> j) & 1)) ? -0.25f : 0.25f);
    acc = (float)((double)acc + (double)(float)((double)padded(x, d, ld, rows, cols, g + j, c) * m));
  }
  return acc;
}

typedef struct mode {
  int block_2d, rht_t, stochastic;
} mode;

/* Quantizes element (i, j) of a matrix whose value is value(i, j), with 16-element blocks along j
 * (or 16x16 blocks), as docs/block_scaling.md says: the matrix zero-padded to multiples of 16, of which
 * the data keeps its n_rows rows, each of n_cols rounded up to 16 values (a partial block is a padded one). */
static int ref_check(const void *x, tf_dtype d, int64_t ld, int64_t rows, int64_t cols, mode md, int columnwise,
                     uint64_t seed, float amax, const uint8_t *y, const uint8_t *s, int64_t ld_s) {
  const int64_t n_rows = columnwise ? cols : rows, n_cols = up16(columnwise ? rows : cols);
  const float s_enc = ref_global_scale(amax);
  int bad = 0;
  for (int64_t i = 0; i < n_rows; ++i)
    for (int64_t b = 0; b < n_cols; b += 16) {
      double bamax = 0.0;
      const int64_t i0 = md.block_2d ? i / 16 * 16 : i, i1 = md.block_2d ? i0 + 16 : i + 1;
      for (int64_t ii = i0; ii < i1; ++ii)
        for (int64_t j = b; j < b + 16; ++j) {
          const float v = columnwise ? ref_column_value(x, d, ld, rows, cols, j, ii, md.rht_t)
                                     : padded(x, d, ld, rows, cols, ii, j);
          bamax = fabs(v) > bamax ? fabs(v) : bamax;
        }
      const float multiplier = (float)((double)s_enc * (double)(float)(1.0 / 6.0));
      const double sd = (double)(float)(bamax * multiplier);
      const uint8_t code = tf_fp8_e4m3_encode(isinf(sd) ? FLT_MAX : (float)sd);
      bad += s[i * ld_s + b / 16] != code;
      const float s_dec = (float)(1.0 / (double)s_enc);
      double enc = (double)(float)(1.0 / (double)(float)((double)tf_fp8_e4m3_decode(code) * s_dec));
      const float e = isinf(enc) ? FLT_MAX : (float)enc;
      for (int64_t j = b; j < b + 16; ++j) {
        const float v = columnwise ? ref_column_value(x, d, ld, rows, cols, j, i, md.rht_t)
                                   : padded(x, d, ld, rows, cols, i, j);
        const float scaled = (float)((double)v * e);
        const uint64_t counter = (uint64_t)(columnwise ? up16(rows) * up16(cols) : 0) + (uint64_t)(i * n_cols + j);
        const uint8_t want = md.stochastic ? tf_e2m1_encode_sr(scaled, tf_nvfp4_random24(seed, counter))
                                           : (uint8_t)ref_rn_code(scaled);
        const uint8_t byte = y[(i * n_cols + j) / 2];
        bad += ((j % 2 ? byte >> 4 : byte) & 15) != want;
      }
    }
  return bad;
}

static void test_kernels(void) {
  const int64_t sizes_r[] = {16, 48, 1, 33}, sizes_c[] = {16, 64, 528, 15, 529};
  const mode modes[] = {{0, 0, 0}, {1, 0, 0}, {0, 1, 0}, {0, 0, 1}, {0, 1, 1}, {1, 0, 1}};
  int bad = 0, band_bad = 0, amax_bad = 0, runs = 0;
  for (int t = 0; t < 3; ++t) {
    if (ISA_CAPS[t] > (int)tf_cpu_isa_detected()) continue;
    CHECK(tf_set_cpu_isa_cap(ISA_CAPS[t]) == TF_OK, "set cap");
    for (int di = 0; di < 3; ++di)
      for (int ri = 0; ri < 4; ++ri)
        for (int ci = 0; ci < 5; ++ci)
          for (int mi = 0; mi < 6; ++mi) {
            const int64_t rows = sizes_r[ri], cols = sizes_c[ci], ld = cols + 16;
            const tf_dtype d = DTYPES[di];
            const mode md = modes[mi];
            void *x = make_input(d, rows, ld);
            float amax = 0.0f, amax_t = 0.0f;
            CHECK(tf_nvfp4_amax(x, d, rows, cols, ld, 0, rows, 0, &amax) == TF_OK, "amax");
            CHECK(tf_nvfp4_amax(x, d, rows, cols, ld, 0, rows, md.rht_t, &amax_t) == TF_OK, "amax_t");
            double want = 0.0, want_t = 0.0;
            const int64_t rows_p = up16(rows), cols_p = up16(cols);
            for (int64_t r = 0; r < rows_p; ++r)
              for (int64_t c = 0; c < cols; ++c) {
                want = fmax(want, fabs(padded(x, d, ld, rows, cols, r, c)));
                want_t = fmax(want_t, fabs(ref_column_value(x, d, ld, rows, cols, r, c, md.rht_t)));
              }
            amax_bad += amax != (float)want || amax_t != (float)want_t;
            const int64_t ls = cols_p / 16, lst = rows_p / 16;
            const size_t ny = (size_t)(rows * cols_p / 2), nyt = (size_t)(cols * rows_p / 2);
            uint8_t *y = malloc(ny), *s = malloc((size_t)(rows * ls));
            uint8_t *yt = malloc(nyt), *st = malloc((size_t)(cols * lst));
            uint8_t *y2 = malloc(ny), *s2 = malloc((size_t)(rows * ls));
            uint8_t *yt2 = malloc(nyt), *st2 = malloc((size_t)(cols * lst));
            const uint64_t seed = 0x1234567ull + (uint64_t)runs;
            CHECK(tf_nvfp4_quantize(x, d, rows, cols, ld, 0, rows, md.block_2d, md.rht_t, md.stochastic, seed, amax,
                                    md.block_2d ? amax : amax_t, y, s, ls, yt, st, lst) == TF_OK,
                  "quantize");
            bad += ref_check(x, d, ld, rows, cols, md, 0, seed, amax, y, s, ls);
            bad += ref_check(x, d, ld, rows, cols, md, 1, seed, md.block_2d ? amax : amax_t, yt, st, lst);
            /* The same bytes from 16-row bands, last band first. */
            for (int64_t r0 = (rows - 1) / 16 * 16; r0 >= 0; r0 -= 16)
              CHECK(tf_nvfp4_quantize(x, d, rows, cols, ld, r0, r0 + 16 < rows ? r0 + 16 : rows, md.block_2d, md.rht_t, md.stochastic, seed,
                                      amax, md.block_2d ? amax : amax_t, y2, s2, ls, yt2, st2, lst) == TF_OK,
                    "band");
            band_bad += memcmp(y, y2, ny) || memcmp(s, s2, (size_t)(rows * ls)) || memcmp(yt, yt2, nyt) ||
                        memcmp(st, st2, (size_t)(cols * lst));
            ++runs;
            free(x), free(y), free(s), free(yt), free(st), free(y2), free(s2), free(yt2), free(st2);
          }
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(runs > 0 && bad == 0, "quantize: %d mismatches with the reference over %d runs", bad, runs);
  CHECK(band_bad == 0, "quantize: %d runs differ when split into bands", band_bad);
  CHECK(amax_bad == 0, "amax: %d runs wrong", amax_bad);
}

static void test_amax_specials(void) {
  float x[16 * 16] = {0};
  float amax = 0.0f;
  x[37] = -INFINITY;
  CHECK(tf_nvfp4_amax(x, TF_FLOAT32, 16, 16, 16, 0, 16, 0, &amax) == TF_OK && isinf(amax), "Inf shows in the amax");
  x[200] = NAN;
  CHECK(tf_nvfp4_amax(x, TF_FLOAT32, 16, 16, 16, 0, 16, 1, &amax) == TF_OK && isnan(amax), "NaN shows in the amax");
}

/*
 * Inf and overflowing values in x under a finite amax (the C API does not refuse them; the Python callers do): no
 * reference defines their codes, but every tier gives the portable tier's bytes and amax bits. Inf blocks saturate
 * their scales (rowwise, 2D); under the transform the sums of values near FLT_MAX overflow to Inf. Left out: NaN,
 * and Inf under the transform (Inf - Inf), whose NaN signs depend on the compiler's operand order in the portable
 * loops (-O1 and -O3 differ), so no tier can match them.
 */
static void test_tiers_agree_on_non_finite(void) {
  const int64_t rows = 40, cols = 70, ld = 72, rows_p = 48, cols_p = 80, ls = cols_p / 16, lst = rows_p / 16;
  const size_t ny = (size_t)(rows * cols_p / 2), nyt = (size_t)(cols * rows_p / 2);
  const size_t ns = (size_t)(rows * ls), nst = (size_t)(cols * lst), n = ny + ns + nyt + nst;
  const mode modes[] = {{0, 0, 0}, {1, 0, 0}, {0, 1, 0}, {0, 0, 1}, {0, 1, 1}, {1, 0, 1}};
  int bad = 0, amax_bad = 0, runs = 0;
  for (int di = 0; di < 3; ++di)
    for (int mi = 0; mi < 6; ++mi) {
      const tf_dtype d = DTYPES[di];
      const mode md = modes[mi];
      const float huge = d == TF_FLOAT16 ? 60000.0f : 3e38f;
      const float specials[4] = {md.rht_t ? huge : INFINITY, md.rht_t ? -huge : -INFINITY, huge, -huge};
      void *x = make_input(d, rows, ld);
      for (int64_t i = 0; i < rows * ld; i += 11) {
        const float v = specials[(i / 11) % 4];
        if (d == TF_FLOAT32) ((float *)x)[i] = v;
        else ((uint16_t *)x)[i] = d == TF_BFLOAT16 ? tf_f32_to_bf16(v) : tf_f32_to_f16(v);
      }
      uint8_t *want = malloc(n), *got = malloc(n);
      uint32_t want_amax = 0;
      for (int t = 0; t < 3; ++t) {
        if (ISA_CAPS[t] > (int)tf_cpu_isa_detected()) continue;
        CHECK(tf_set_cpu_isa_cap(ISA_CAPS[t]) == TF_OK, "set cap");
        uint8_t *out = t == 0 ? want : got;
        float amax;
        CHECK(tf_nvfp4_amax(x, d, rows, cols, ld, 0, rows, md.rht_t, &amax) == TF_OK, "amax");
        CHECK(tf_nvfp4_quantize(x, d, rows, cols, ld, 0, rows, md.block_2d, md.rht_t, md.stochastic, 77, 1000.0f,
                                md.block_2d ? 1000.0f : 30.0f, out, out + ny, ls, out + ny + ns, out + ny + ns + nyt,
                                lst) == TF_OK,
              "quantize");
        if (t == 0) {
          want_amax = tf_f32_bits(amax);
        } else {
          bad += memcmp(want, got, n) != 0;
          amax_bad += tf_f32_bits(amax) != want_amax;
          ++runs;
        }
      }
      free(want), free(got), free(x);
    }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(bad == 0, "non-finite input: %d of %d runs differ from the portable tier's bytes", bad, runs);
  CHECK(amax_bad == 0, "non-finite input: %d of %d amaxes differ from the portable tier's", amax_bad, runs);
}

/*
 * The E2M1 codes of every tier against the scalar encoders (test_e2m1, test_stochastic check those) over a sweep of
 * float32 values in [-6, 6] (every 2047th bit pattern, each tie and its neighbours): under the amax 2688 (S_enc 1)
 * a block whose amax is 6 gets the scale 1, so its values are encoded as they are. Each block's first row and
 * column hold 6, giving every rowwise and columnwise block that amax.
 */
static void test_codes_sweep(void) {
  const int64_t rows = 1024, cols = 544, rows_p = rows, cols_p = cols;
  float *x = malloc((size_t)(rows * cols) * sizeof(float));
  uint8_t *y = malloc((size_t)(rows * cols_p / 2)), *s = malloc((size_t)(rows * cols_p / 16));
  uint8_t *yt = malloc((size_t)(cols * rows_p / 2)), *st = malloc((size_t)(cols * rows_p / 16));
  uint32_t u = 0;
  int k = 0, t0 = 0;
  for (int64_t i = 0; i < rows * cols; ++i) {
    float v;
    if ((i / cols) % 16 == 0 || i % 16 == 0) {
      v = 6.0f;
    } else if (t0 < 7 * 3) { /* the ties 0.25, 0.75, ..., 5 and their neighbours */
      const float mid = (float)((GRID[t0 / 3] + GRID[t0 / 3 + 1]) / 2);
      v = t0 % 3 == 0 ? nextafterf(mid, 0.0f) : t0 % 3 == 1 ? mid : nextafterf(mid, 7.0f);
      ++t0;
    } else {
      v = tf_f32_from_bits(u);
      u = u + 2047u > 0x40C00000u ? (u + 2047u) % 0x40C00000u : u + 2047u;
    }
    x[i] = (k++ % 3 == 1) ? -v : v;
  }
  int bad = 0, scale_bad = 0, runs = 0;
  for (int t = 0; t < 3; ++t) {
    if (ISA_CAPS[t] > (int)tf_cpu_isa_detected()) continue;
    CHECK(tf_set_cpu_isa_cap(ISA_CAPS[t]) == TF_OK, "set cap");
    for (int stochastic = 0; stochastic < 2; ++stochastic) {
      const uint64_t seed = 991;
      CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, rows, cols, cols, 0, rows, 0, 0, stochastic, seed, 2688.0f, 2688.0f, y, s,
                              cols_p / 16, yt, st, rows_p / 16) == TF_OK,
            "quantize");
      for (int64_t i = 0; i < rows * cols_p / 16; ++i) scale_bad += s[i] != 0x38;
      for (int64_t i = 0; i < cols * rows_p / 16; ++i) scale_bad += st[i] != 0x38;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float v = x[r * cols + c];
          const uint64_t n = (uint64_t)(r * cols_p + c), n_t = (uint64_t)(rows_p * cols_p + c * rows_p + r);
          const uint8_t want = stochastic ? tf_e2m1_encode_sr(v, tf_nvfp4_random24(seed, n)) : tf_e2m1_encode_rn(v);
          const uint8_t want_t = stochastic ? tf_e2m1_encode_sr(v, tf_nvfp4_random24(seed, n_t)) : want;
          bad += ((y[n / 2] >> (4 * (n % 2))) & 15) != want;
          bad += ((yt[(c * rows_p + r) / 2] >> (4 * (r % 2))) & 15) != want_t;
        }
      ++runs;
    }
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(runs > 0 && scale_bad == 0, "codes sweep: %d block scales are not 1", scale_bad);
  CHECK(bad == 0, "codes sweep: %d codes differ from the scalar encoders' over %d runs", bad, runs);
  free(x), free(y), free(s), free(yt), free(st);
}

static void test_dequantize(void) {
  int bad = 0;
  for (int t = 0; t < 3; ++t) {
    if (ISA_CAPS[t] > (int)tf_cpu_isa_detected()) continue;
    CHECK(tf_set_cpu_isa_cap(ISA_CAPS[t]) == TF_OK, "set cap");
    const int64_t rows = 32, cols = 1040;
    uint8_t *y = malloc((size_t)(rows * cols / 2)), *s = malloc((size_t)(rows * cols / 16));
    for (int64_t i = 0; i < rows * cols / 2; ++i) y[i] = (uint8_t)rand_u32();
    for (int64_t i = 0; i < rows * cols / 16; ++i) s[i] = (uint8_t)(rand_u32() % 0x7F); /* no NaN code */
    const float amax = 3.7f;
    for (int di = 0; di < 3; ++di) {
      const tf_dtype d = DTYPES[di];
      void *out = malloc((size_t)(rows * cols) * tf_dtype_size(d));
      CHECK(tf_nvfp4_dequantize(y, rows, cols, 0, rows, s, cols / 16, amax, out, d) == TF_OK, "dequantize");
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const uint8_t byte = y[(r * cols + c) / 2];
          const double e = tf_e2m1_decode((uint8_t)((c % 2 ? byte >> 4 : byte) & 15));
          const float f1 = (float)((double)tf_fp8_e4m3_decode(s[r * (cols / 16) + c / 16]) * amax);
          const float factor = (float)((double)f1 * (double)(float)(1.0 / 2688.0));
          const float v = (float)(e * factor);
          const float got = widen(out, d, r * cols + c);
          const float want = d == TF_FLOAT32 ? v : d == TF_BFLOAT16 ? tf_bf16_to_f32(tf_f32_to_bf16(v))
                                                                    : tf_f16_to_f32(tf_f32_to_f16(v));
          bad += tf_f32_bits(got) != tf_f32_bits(want);
        }
      free(out);
    }
    free(y), free(s);
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(bad == 0, "dequantize: %d mismatches", bad);
}

static void test_checks(void) {
  float x[64 * 64] = {0}, amax = 0.0f;
  uint8_t y[64 * 32], yt[64 * 32], s[64 * 4], st[64 * 4];
  float out[64 * 64];
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 0, 1, 1, 5, 1.0f, 2.0f, y, s, 4, yt, st, 4) == TF_OK, "ok");
  CHECK(tf_nvfp4_quantize(x, (tf_dtype)7, 64, 64, 64, 0, 64, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_DTYPE, "dtype");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 40, 40, 64, 32, 40, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 3, yt, st, 3) == TF_OK, "ragged last band");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 40, 33, 64, 0, 40, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 2, 0, 0, 0) == TF_ERR_BAD_SIZE, "ld_scale < ceil(cols / 16)");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 33, 40, 64, 0, 33, 0, 0, 0, 0, 1.0f, 1.0f, 0, 0, 0, yt, st, 2) == TF_ERR_BAD_SIZE, "ld_scale_t < ceil(rows / 16)");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 40, 64, 64, 16, 24, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_SIZE, "band ends off a 16-row bound, before rows");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 8, 64, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_SIZE, "band not a multiple of 16");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 80, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_SIZE, "band past rows");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 48, 0, 64, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_SIZE, "ld_x < cols");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 3, 0, 0, 0) == TF_ERR_BAD_SIZE, "ld_scale");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 0, 0, 0, 0, 1.0f, 1.0f, 0, 0, 0, yt, st, 3) == TF_ERR_BAD_SIZE, "ld_scale_t");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 2, 0, 0, 0, 1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "block_2d 2");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 1, 1, 0, 0, 1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "2D with rht");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 1, 0, 0, 0, 1.0f, 2.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "2D, two amaxes");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 0, 0, 0, 0, INFINITY, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "amax Inf");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 0, 0, 0, 0, 1.0f, NAN, y, s, 4, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "amax_t NaN");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 0, 0, 0, 0, -1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_BAD_ARGUMENT, "amax < 0");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 64, 64, 64, 0, 64, 0, 0, 0, 0, 1.0f, 1.0f, y, 0, 4, 0, 0, 0) == TF_ERR_NULL_POINTER, "y without scale");
  CHECK(tf_nvfp4_quantize(0, TF_FLOAT32, 64, 64, 64, 0, 64, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_ERR_NULL_POINTER, "x NULL");
  CHECK(tf_nvfp4_quantize(0, TF_FLOAT32, 64, 64, 64, 0, 0, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 4, 0, 0, 0) == TF_OK, "empty band");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, INT64_MAX / 32 * 16, 16, 16, 0, 0, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 1, 0, 0, 0) == TF_ERR_OVERFLOW, "rows * cols overflows");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, INT64_MAX - 3, 1, 1, 0, 0, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 1, 0, 0, 0) == TF_ERR_OVERFLOW, "rows rounded up to 16 overflows");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 1, INT64_MAX - 3, INT64_MAX, 0, 0, 0, 0, 0, 0, 1.0f, 1.0f, y, s, INT64_MAX, 0, 0, 0) == TF_ERR_OVERFLOW, "cols rounded up to 16 overflows");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, (INT64_MAX / 64 + 1) / 16 * 16 + 1, 15, 15, 0, 0, 0, 0, 0, 0, 1.0f, 1.0f, y, s, 1, 0, 0, 0) == TF_ERR_OVERFLOW, "padded rows * cols * 4 overflows");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 1 << 20, 16, 16, 0, 0, 0, 0, 0, 0, 1.0f, 1.0f, y, s, INT64_MAX / 4, 0, 0, 0) == TF_ERR_OVERFLOW, "rows * ld_scale overflows");
  CHECK(tf_nvfp4_quantize(x, TF_FLOAT32, 1 << 20, 16, 16, 0, 0, 0, 0, 0, 0, 1.0f, 1.0f, 0, 0, 0, yt, st, INT64_MAX / 4) == TF_ERR_OVERFLOW, "cols * ld_scale_t overflows");
  CHECK(tf_nvfp4_amax(x, TF_FLOAT32, 64, 64, 64, 0, 64, 2, &amax) == TF_ERR_BAD_ARGUMENT, "amax rht 2");
  CHECK(tf_nvfp4_amax(x, TF_FLOAT32, 64, 64, 64, 0, 64, 0, 0) == TF_ERR_NULL_POINTER, "amax NULL");
  CHECK(tf_nvfp4_amax(x, TF_FLOAT32, 64, 24, 64, 0, 64, 0, &amax) == TF_OK, "amax of ragged cols");
  CHECK(tf_nvfp4_amax(x, TF_FLOAT32, 64, 64, 63, 0, 64, 0, &amax) == TF_ERR_BAD_SIZE, "amax ld_x < cols");
  CHECK(tf_nvfp4_dequantize(y, 64, 64, 0, 64, s, 4, 1.0f, out, TF_FLOAT32) == TF_OK, "dequantize ok");
  CHECK(tf_nvfp4_dequantize(y, 64, 64, 0, 64, s, 3, 1.0f, out, TF_FLOAT32) == TF_ERR_BAD_SIZE, "dequantize ld_scale");
  CHECK(tf_nvfp4_dequantize(y, 64, 40, 0, 64, s, 4, 1.0f, out, TF_FLOAT32) == TF_ERR_BAD_SIZE, "dequantize cols not a multiple of 16");
  CHECK(tf_nvfp4_dequantize(y, 64, 64, 0, 64, s, 4, NAN, out, TF_FLOAT32) == TF_ERR_BAD_ARGUMENT, "dequantize amax NaN");
  CHECK(tf_nvfp4_dequantize(y, 64, 64, 0, 64, 0, 4, 1.0f, out, TF_FLOAT32) == TF_ERR_NULL_POINTER, "dequantize scale NULL");
  CHECK(tf_nvfp4_dequantize(y, 64, 64, 0, 64, s, 4, 1.0f, out, (tf_dtype)9) == TF_ERR_BAD_DTYPE, "dequantize dtype");
  CHECK(tf_nvfp4_dequantize(y, INT64_MAX / 2, 64, 0, 0, s, 4, 1.0f, out, TF_FLOAT32) == TF_ERR_OVERFLOW, "dequantize overflows");
}

/* Unpacking to E4M3 on every tier: each byte (twice, at ragged offsets around the 32-byte step) against the
 * E4M3 encoding of its two E2M1 values; bad ranges and pointers refused. */
static void test_unpack_e4m3(void) {
  enum { N = 256 + 45 };
  uint8_t y[N], codes[2 * N];
  for (int i = 0; i < N; ++i) y[i] = (uint8_t)(i * 7 + i / 256);
  for (int t = 0; t < 3; ++t) {
    if (ISA_CAPS[t] > (int)tf_cpu_isa_detected()) continue;
    CHECK(tf_set_cpu_isa_cap(ISA_CAPS[t]) == TF_OK, "set cap");
    for (int begin = 0; begin < 3; ++begin) {
      memset(codes, 0xAA, sizeof codes);
      CHECK(tf_nvfp4_unpack_e4m3(y, begin, N - begin, codes) == TF_OK, "unpack");
      int bad = 0;
      for (int i = 0; i < 2 * N; ++i) {
        const int inside = i >= 2 * begin && i < 2 * (N - begin);
        const uint8_t e2m1 = (uint8_t)((i % 2 ? y[i / 2] >> 4 : y[i / 2]) & 15);
        bad += codes[i] != (inside ? tf_fp8_e4m3_encode(tf_e2m1_decode(e2m1)) : 0xAA);
      }
      CHECK(bad == 0, "unpacked codes are the E4M3 encodings of the E2M1 values, nothing written outside");
    }
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(tf_nvfp4_unpack_e4m3(y, 2, 1, codes) == TF_ERR_BAD_SIZE, "end before begin");
  CHECK(tf_nvfp4_unpack_e4m3(y, -1, 1, codes) == TF_ERR_BAD_SIZE, "negative begin");
  CHECK(tf_nvfp4_unpack_e4m3(y, 0, INT64_MAX, codes) == TF_ERR_BAD_SIZE, "2 * end overflows");
  CHECK(tf_nvfp4_unpack_e4m3(NULL, 0, 1, codes) == TF_ERR_NULL_POINTER, "null data");
  CHECK(tf_nvfp4_unpack_e4m3(NULL, 0, 0, NULL) == TF_OK, "an empty range touches nothing");
}

int main(void) {
  test_e2m1();
  test_stochastic();
  test_scales();
  test_kernels();
  test_amax_specials();
  test_tiers_agree_on_non_finite();
  test_codes_sweep();
  test_dequantize();
  test_checks();
  test_unpack_e4m3();
  return check_report();
}

/* Standalone test of csrc/gemm (FP8 GEMM) and csrc/common/cpu_features, under ASan and UBSan:
 * every path this CPU has against a double reference of the decoded FP8 values, within the float32
 * summation bound; the float32 paths against each other bit for bit; tile ranges; bad arguments. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/cpu_features.h"
#include "fp8/fp8_format.h"
#include "gemm/fp8_gemm.h"
#include "gemm/gemm_kernels.h"

static uint32_t rng_state = 12345u;
static uint32_t rnd(void) {
  rng_state ^= rng_state << 13, rng_state ^= rng_state >> 17, rng_state ^= rng_state << 5;
  return rng_state;
}

static float decode(uint8_t code, tf_fp8_format f) {
  return f == TF_FP8_E4M3 ? tf_fp8_e4m3_decode(code) : tf_fp8_e5m2_decode(code);
}

static int is_nan_code(uint8_t c, tf_fp8_format f) {
  return f == TF_FP8_E4M3 ? (c & 0x7F) == 0x7F : (c & 0x7F) > 0x7C;
}

/* A random finite code: mostly small magnitudes, with zeros, subnormals and the largest values. */
static uint8_t random_code(tf_fp8_format f) {
  const uint32_t r = rnd();
  uint8_t c;
  switch (r % 16) {
    case 0: c = 0; break;                                  /* zero */
    case 1: c = (uint8_t)(1 + (r >> 8) % 3); break;        /* subnormals */
    case 2: c = f == TF_FP8_E4M3 ? 0x7E : 0x7B; break;     /* largest finite */
    case 3: c = f == TF_FP8_E4M3 ? 0x7C : 0x7C; break;     /* E5M2 Inf would poison sums: skip */
    default: c = (uint8_t)(0x30 + (r >> 8) % 0x18); break; /* around 1 */
  }
  if ((r % 16) == 3 && f == TF_FP8_E5M2) c = 0x7A;
  c |= (uint8_t)((r >> 20) & 0x80);
  return is_nan_code(c, f) ? 0 : c;
}

static float out_to_f32(const void *out, tf_dtype d, int64_t i) {
  if (d == TF_FLOAT32) return ((const float *)out)[i];
  const uint16_t h = ((const uint16_t *)out)[i];
  return d == TF_BFLOAT16 ? tf_bf16_to_f32(h) : tf_f16_to_f32(h);
}

static double unit_roundoff(tf_dtype d) {
  return d == TF_FLOAT32 ? ldexp(1, -24) : d == TF_BFLOAT16 ? ldexp(1, -8) : ldexp(1, -11);
}

/* k = 1 and b = 1: the output is every FP8 code decoded, on every path (the packing's decoder). */
static void test_decode(void) {
  uint8_t a[256], one[2] = {0x38, 0x3C}; /* 1.0 in E4M3 and in E5M2 */
  float out[256];
  for (int c = 0; c < 256; ++c) a[c] = (uint8_t)c;
  for (int isa = 0; isa <= (int)tf_cpu_isa_detected(); ++isa) {
    for (int f = 0; f < 2; ++f) {
      const tf_status s = tf_fp8_gemm_nt(a, (tf_fp8_format)f, &one[f], (tf_fp8_format)f, 256, 1, 1, 1, 1,
                                         NULL, TF_FLOAT32, out, TF_FLOAT32, (tf_isa)isa, 0, tf_fp8_gemm_tiles(256, 1));
      CHECK(s == TF_OK, "decode status");
      for (int c = 0; c < 256; ++c) {
        const float want = decode((uint8_t)c, (tf_fp8_format)f);
        CHECK(isnan(want) ? isnan(out[c]) : out[c] == want, "isa %d format %d code %d: %g vs %g", isa, f, c,
              out[c], want);
      }
    }
  }
}

/* The AVX2 float32 packers write the portable packers' bits: every code (NaN and Inf included) at
 * every position of a vector, ragged k blocks, offsets into a larger matrix, rows past `valid`. */
static void test_f32_packing(void) {
#if TF_X86
  if (tf_cpu_isa_detected() < TF_ISA_AVX2) return;
  enum { LD = 300, ROWS = 48 };
  static uint8_t x[(ROWS + 3) * LD];
  static float want[ROWS * 256 + 1], got[ROWS * 256 + 1]; /* one past the largest block */
  for (size_t i = 0; i < sizeof x; ++i) x[i] = (uint8_t)(i % 251 + (i / 251) % 5); /* every code, shifted */
  static const int64_t kcs[] = {1, 2, 7, 8, 9, 15, 16, 17, 31, 100, 255, 256};
  for (int f = 0; f < 2; ++f) {
    for (size_t ki = 0; ki < sizeof kcs / sizeof kcs[0]; ++ki) {
      const int64_t kc = kcs[ki], k0 = (int64_t)(ki * 3 % 41), r0 = (int64_t)ki % 3;
      for (int64_t valid = ROWS - 13; valid <= ROWS; valid += 13) {
        memset(want, 0xAB, sizeof want), memset(got, 0xCD, sizeof got);
        tf_gemm_pack_a_f32_portable(x, LD, r0, valid, ROWS, k0, kc, (tf_fp8_format)f, want);
        tf_gemm_pack_a_f32_avx2(x, LD, r0, valid, ROWS, k0, kc, (tf_fp8_format)f, got);
        CHECK(memcmp(want, got, sizeof(float) * (size_t)(ROWS * kc)) == 0,
              "pack_a format %d kc %lld valid %lld differs", f, (long long)kc, (long long)valid);
        memset(want, 0xAB, sizeof want), memset(got, 0xCD, sizeof got);
        tf_gemm_pack_b_f32_portable(x, LD, r0, valid, ROWS, k0, kc, (tf_fp8_format)f, want);
        tf_gemm_pack_b_f32_avx2(x, LD, r0, valid, ROWS, k0, kc, (tf_fp8_format)f, got);
        CHECK(memcmp(want, got, sizeof(float) * (size_t)(ROWS * kc)) == 0,
              "pack_b format %d kc %lld valid %lld differs", f, (long long)kc, (long long)valid);
        /* nothing past the packed block is written */
        const uint32_t untouched = 0xCDCDCDCDu;
        uint32_t first_past;
        memcpy(&first_past, got + ROWS * kc, sizeof first_past);
        CHECK(first_past == untouched, "pack_b format %d kc %lld wrote past its block", f, (long long)kc);
      }
    }
  }
#endif
}

/* One GEMM on one path, checked against the double reference; returns the output (caller frees). */
static void *run_case(int64_t m, int64_t n, int64_t k, tf_fp8_format fa, tf_fp8_format fb,
                      tf_dtype out_dtype, int with_bias, tf_isa isa, int nan_row) {
  uint8_t *a = malloc((size_t)(m * k + 1)), *b = malloc((size_t)(n * k + 1));
  float *bias = malloc(sizeof(float) * (size_t)(n + 1));
  void *out = malloc((size_t)(m * n + 1) * 4);
  rng_state = (uint32_t)(1234567u + m * 31 + n * 17 + k);
  for (int64_t i = 0; i < m * k; ++i) a[i] = random_code(fa);
  for (int64_t i = 0; i < n * k; ++i) b[i] = random_code(fb);
  for (int64_t j = 0; j < n; ++j) bias[j] = (float)((int)(rnd() % 2001) - 1000) / 64.0f;
  if (nan_row >= 0 && k > 0) a[nan_row * k + k / 2] = fa == TF_FP8_E4M3 ? 0x7F : 0x7E;
  const float sa = 0.375f, sb = 3.0e-2f;
  const tf_status s = tf_fp8_gemm_nt(a, fa, b, fb, m, n, k, sa, sb, with_bias ? bias : NULL,
                                     TF_FLOAT32, out, out_dtype, isa, 0, tf_fp8_gemm_tiles(m, n));
  CHECK(s == TF_OK, "gemm status %d", (int)s);
  const double scale = (double)(sa * sb), u_out = unit_roundoff(out_dtype), u = ldexp(1, -24);
  int bad = 0;
  for (int64_t i = 0; i < m && !bad; ++i) {
    for (int64_t j = 0; j < n && !bad; ++j) {
      double exact = 0, mag = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double prod = (double)decode(a[i * k + p], fa) * decode(b[j * k + p], fb);
        exact += prod;
        mag += fabs(prod);
      }
      const double bj = with_bias ? bias[j] : 0.0;
      const double ref = exact * scale + bj;
      const double got = out_to_f32(out, out_dtype, i * n + j);
      if (i == nan_row && k > 0) {
        bad = !isnan(got);
        CHECK(!bad, "isa %d: NaN row %lld col %lld gave %g", (int)isa, (long long)i, (long long)j, got);
        continue;
      }
      /* summation bound, the epilogue's float32 roundings, then the output rounding */
      const double tol = (double)(k + 1) * u * mag * scale + 4 * u * (fabs(exact * scale) + fabs(bj)) +
                         u_out * fabs(ref) + (out_dtype == TF_FLOAT16 ? ldexp(1, -25) : 0.0);
      if (out_dtype == TF_FLOAT16 && fabs(ref) - tol > 65520.0)
        bad = !(isinf(got) && signbit(got) == signbit(ref)); /* beyond float16: rounds to Inf */
      else
        bad = !(fabs(got - ref) <= tol);
      CHECK(!bad, "isa %d m%lld n%lld k%lld fa%d fb%d out%d bias%d: [%lld,%lld] %.9g vs %.9g (tol %g)",
            (int)isa, (long long)m, (long long)n, (long long)k, fa, fb, out_dtype, with_bias,
            (long long)i, (long long)j, got, ref, tol);
    }
  }
  free(a), free(b), free(bias);
  return out;
}

static void test_paths(void) {
  static const int64_t shapes[][3] = {{1, 1, 1}, {7, 13, 5}, {97, 129, 300}, {200, 40, 513},
                                      {16, 16, 16}, {5, 3, 0}, {400, 20, 40}};
  const tf_isa top = tf_cpu_isa_detected();
  for (size_t sidx = 0; sidx < sizeof(shapes) / sizeof(shapes[0]); ++sidx) {
    const int64_t m = shapes[sidx][0], n = shapes[sidx][1], k = shapes[sidx][2];
    for (int combo = 0; combo < 4; ++combo) {
      const tf_fp8_format fa = (tf_fp8_format)(combo & 1), fb = (tf_fp8_format)(combo >> 1);
      for (int od = 0; od < 3; ++od) {
        void *first = NULL;
        for (int isa = 0; isa <= (int)top; ++isa) {
          void *out = run_case(m, n, k, fa, fb, (tf_dtype)od, (combo + od) & 1, (tf_isa)isa, -1);
          if (isa == 0) {
            first = out;
          } else {
            /* the float32 paths (portable, AVX2, AVX512 tier) give the same bits */
            if (isa <= TF_ISA_AVX512)
              CHECK(memcmp(first, out, (size_t)(m * n) * (size_t)tf_dtype_size((tf_dtype)od)) == 0,
                    "isa %d differs from portable bits (m%lld n%lld k%lld)", isa, (long long)m,
                    (long long)n, (long long)k);
            free(out);
          }
        }
        free(first);
      }
    }
  }
  for (int isa = 0; isa <= (int)top; ++isa)
    free(run_case(40, 150, 70, TF_FP8_E4M3, TF_FP8_E5M2, TF_FLOAT32, 1, (tf_isa)isa, 33));
}

/* Tiles computed in several calls equal one call. */
/* Every path's bf16 output is its float32 output rounded by tf_f32_to_bf16, bit for bit, and a
 * bf16 or float16 bias gives what the same values in float32 give: subnormal results (a tiny
 * scale), NaN rows and a ragged last vector of columns included. */
static void test_epilogue(void) {
  const int64_t m = 45, n = 37, k = 70;
  uint8_t *a = malloc((size_t)(m * k)), *b = malloc((size_t)(n * k));
  float *bias32 = malloc(sizeof(float) * (size_t)n), *ref = malloc(sizeof(float) * (size_t)(m * n));
  float *got32 = malloc(sizeof(float) * (size_t)(m * n));
  uint16_t *bias16 = malloc(sizeof(uint16_t) * (size_t)n), *got16 = malloc(sizeof(uint16_t) * (size_t)(m * n));
  rng_state = 777u;
  for (int64_t i = 0; i < m * k; ++i) a[i] = random_code(TF_FP8_E4M3);
  for (int64_t i = 0; i < n * k; ++i) b[i] = random_code(TF_FP8_E5M2);
  a[3 * k + 5] = 0x7F; /* row 3 is NaN */
  static const float scales[] = {0.02f, 1e-41f};
  for (int isa = 0; isa <= (int)tf_cpu_isa_detected(); ++isa) {
    for (int si = 0; si < 2; ++si) {
      for (int bd = 0; bd < 3; ++bd) { /* bias: none, bf16, float16 (as float32 in the reference) */
        for (int64_t j = 0; j < n; ++j) {
          bias16[j] = bd == 1 ? tf_f32_to_bf16((float)((int)(rnd() % 2001) - 1000) * scales[si])
                              : tf_f32_to_f16((float)((int)(rnd() % 2001) - 1000) / 256.0f);
          bias32[j] = bd == 1 ? tf_bf16_to_f32(bias16[j]) : tf_f16_to_f32(bias16[j]);
        }
        const tf_dtype bias_dtype = bd == 1 ? TF_BFLOAT16 : TF_FLOAT16;
        const void *bias = bd ? (const void *)bias16 : NULL;
        CHECK(tf_fp8_gemm_nt(a, TF_FP8_E4M3, b, TF_FP8_E5M2, m, n, k, scales[si], 1.0f, bd ? bias32 : NULL,
                             TF_FLOAT32, ref, TF_FLOAT32, (tf_isa)isa, 0, tf_fp8_gemm_tiles(m, n)) == TF_OK &&
                  tf_fp8_gemm_nt(a, TF_FP8_E4M3, b, TF_FP8_E5M2, m, n, k, scales[si], 1.0f, bias,
                                 bias_dtype, got32, TF_FLOAT32, (tf_isa)isa, 0, tf_fp8_gemm_tiles(m, n)) == TF_OK &&
                  tf_fp8_gemm_nt(a, TF_FP8_E4M3, b, TF_FP8_E5M2, m, n, k, scales[si], 1.0f, bias,
                                 bias_dtype, got16, TF_BFLOAT16, (tf_isa)isa, 0, tf_fp8_gemm_tiles(m, n)) == TF_OK,
              "epilogue status");
        int64_t bad = 0;
        for (int64_t i = 0; i < m * n; ++i)
          bad += memcmp(&got32[i], &ref[i], sizeof(float)) != 0 || got16[i] != tf_f32_to_bf16(ref[i]);
        CHECK(bad == 0, "isa %d scale %g bias %d: %lld outputs differ", isa, (double)scales[si], bd,
              (long long)bad);
      }
    }
  }
  free(a), free(b), free(bias32), free(ref), free(got32), free(bias16), free(got16);
}

/* One call for all tiles gives the bits of calls for two tiles at a time: a call spanning several
 * rows of tiles reuses b packed by its first row (three k blocks here), one within a row packs per tile. */
static void test_tile_ranges(void) {
  const int64_t m = 450, n = 300, k = 600;
  uint8_t *a = malloc((size_t)(m * k)), *b = malloc((size_t)(n * k));
  float *one = malloc(sizeof(float) * (size_t)(m * n)), *split = malloc(sizeof(float) * (size_t)(m * n));
  for (int64_t i = 0; i < m * k; ++i) a[i] = random_code(TF_FP8_E4M3);
  for (int64_t i = 0; i < n * k; ++i) b[i] = random_code(TF_FP8_E4M3);
  const int64_t tiles = tf_fp8_gemm_tiles(m, n);
  CHECK(tiles == ((m + TF_GEMM_MB - 1) / TF_GEMM_MB) * ((n + TF_GEMM_NB - 1) / TF_GEMM_NB) && tiles > 2, "tiles %lld", (long long)tiles);
  const tf_isa isa = tf_cpu_isa_detected();
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, m, n, k, 1, 1, NULL, TF_FLOAT32, one, TF_FLOAT32, isa, 0, tiles) == TF_OK,
        "one call");
  for (int64_t t = 0; t < tiles; t += 2) {
    const int64_t e = t + 2 < tiles ? t + 2 : tiles;
    CHECK(tf_fp8_gemm_nt(a, 0, b, 0, m, n, k, 1, 1, NULL, TF_FLOAT32, split, TF_FLOAT32, isa, t, e) == TF_OK,
          "range %lld", (long long)t);
  }
  CHECK(memcmp(one, split, sizeof(float) * (size_t)(m * n)) == 0, "split differs");
  free(a), free(b), free(one), free(split);
}

static void test_bad_arguments(void) {
  uint8_t a[4] = {0}, b[4] = {0};
  float out[4];
  const tf_isa isa = TF_ISA_PORTABLE;
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, -1, 2, 2, 1, 1, NULL, 0, out, 0, isa, 0, 0) == TF_ERR_BAD_SIZE, "m<0");
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, 2, 2, -2, 1, 1, NULL, 0, out, 0, isa, 0, 1) == TF_ERR_BAD_SIZE, "k<0");
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, INT64_MAX / 2, 2, 4, 1, 1, NULL, 0, out, 0, isa, 0, 1) == TF_ERR_OVERFLOW,
        "m*k overflow");
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, INT64_MAX / 2, INT64_MAX / 2, 1, 1, 1, NULL, 0, out, 0, isa, 0, 1) ==
            TF_ERR_OVERFLOW, "m*n overflow");
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, 2, 2, 2, 1, 1, NULL, 0, out, 0, isa, 0, 2) == TF_ERR_BAD_SIZE, "range");
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, 2, 2, 2, 1, 1, NULL, 0, out, 0, isa, -1, 1) == TF_ERR_BAD_SIZE, "begin<0");
  CHECK(tf_fp8_gemm_nt(a, (tf_fp8_format)2, b, 0, 2, 2, 1, 1, 1, NULL, 0, out, 0, isa, 0, 1) == TF_ERR_BAD_DTYPE,
        "format");
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, 2, 2, 1, 1, 1, NULL, 0, out, (tf_dtype)7, isa, 0, 1) == TF_ERR_BAD_DTYPE,
        "out dtype");
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, 2, 2, 1, 1, 1, out, (tf_dtype)7, out, 0, isa, 0, 1) == TF_ERR_BAD_DTYPE,
        "bias dtype");
  CHECK(tf_fp8_gemm_nt(NULL, 0, b, 0, 2, 2, 1, 1, 1, NULL, 0, out, 0, isa, 0, 1) == TF_ERR_NULL_POINTER, "a");
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, 2, 2, 1, 1, 1, NULL, 0, NULL, 0, isa, 0, 1) == TF_ERR_NULL_POINTER, "out");
  CHECK(tf_fp8_gemm_nt(a, 0, b, 0, 2, 2, 1, 1, 1, NULL, 0, out, 0, (tf_isa)TF_ISA_COUNT, 0, 1) ==
            TF_ERR_BAD_ARGUMENT, "isa beyond the enum");
  if (tf_cpu_isa_detected() < TF_ISA_AMX)
    CHECK(tf_fp8_gemm_nt(a, 0, b, 0, 2, 2, 1, 1, 1, NULL, 0, out, 0, TF_ISA_AMX, 0, 1) == TF_ERR_BAD_ARGUMENT,
          "isa the CPU lacks");
  CHECK(tf_fp8_gemm_tiles(-1, 3) == -1 && tf_fp8_gemm_tiles(0, 3) == 0, "tiles of bad/empty sizes");
}

static void test_cpu_features(void) {
  const tf_isa top = tf_cpu_isa_detected();
  CHECK(tf_cpu_isa() == top && tf_cpu_isa_cap() == -1, "no cap at start");
  CHECK(tf_set_cpu_isa_cap(TF_ISA_PORTABLE) == TF_OK && tf_cpu_isa() == TF_ISA_PORTABLE, "cap");
  CHECK(tf_set_cpu_isa_cap(TF_ISA_COUNT - 1) == TF_OK && tf_cpu_isa() == top, "cap above");
  CHECK(tf_set_cpu_isa_cap(TF_ISA_COUNT) == TF_ERR_BAD_ARGUMENT && tf_set_cpu_isa_cap(-2) == TF_ERR_BAD_ARGUMENT,
        "bad caps");
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK && tf_cpu_isa() == top, "uncapped");
  CHECK(tf_isa_name(0) && strcmp(tf_isa_name(TF_ISA_AMX), "amx") == 0 && !tf_isa_name(TF_ISA_COUNT), "names");
  printf("detected tier: %s\n", tf_isa_name((int)top));
}

int main(void) {
  test_cpu_features();
  test_decode();
  test_f32_packing();
  test_paths();
  test_epilogue();
  test_tile_ranges();
  test_bad_arguments();
  return check_report();
}

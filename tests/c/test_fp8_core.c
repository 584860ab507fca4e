/*
 * Standalone test of the FP8 C core (no torch): conversions against slow
 * double-precision references written from the format definitions, the
 * kernels against those conversions, every size and pointer check, and the
 * scaling edge cases. Run by tests/c/run.sh under ASan and UBSan.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "common/cpu_features.h"
#include "common/tf_checks.h"
#include "common/tf_dtype.h"
#include "common/tf_status.h"
#include "fp8/fp8_format.h"
#include "fp8/fp8_kernels.h"
#include "fp8/fp8_quantize.h"
#include "fp8/fp8_scaling.h"
#include "fp8/fp8_transpose.h"

#include "check.h"

/* xorshift64*: reproducible pseudo-random bits. */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rand_u32(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}

static float bits_f(uint32_t u) { return tf_f32_from_bits(u); }
static uint32_t f_bits(float f) { return tf_f32_bits(f); }

/* ---- Reference FP8 formats, from their definitions. ---- */

typedef struct fmt_ref {
  const char *name;
  int mbits, bias;
  uint8_t max_code;
  uint8_t (*encode)(float);
  float (*decode)(uint8_t);
} fmt_ref;

/* Value of a code's magnitude (code & 0x7F) as a double; NaN for NaN codes, Inf for E5M2 Inf. */
static double ref_decode_magnitude(const fmt_ref *f, int code) {
  const int ebits = 7 - f->mbits;
  const int e = (code >> f->mbits) & ((1 << ebits) - 1);
  const int m = code & ((1 << f->mbits) - 1);
  if (f->mbits == 3 && e == 15 && m == 7) return NAN;          /* E4M3: only S.1111.111 */
  if (f->mbits == 2 && e == 31) return m == 0 ? INFINITY : NAN; /* E5M2: IEEE-like */
  if (e == 0) return ldexp(m, 1 - f->bias - f->mbits);
  return ldexp(1.0 + ldexp(m, -f->mbits), e - f->bias);
}

/* Round to nearest, ties to the even code, saturate at max_code, NaN -> 0x7F, sign kept. */
static uint8_t ref_encode(const fmt_ref *f, float v) {
  const uint8_t sign = (f_bits(v) >> 24) & 0x80u;
  if (isnan(v)) return sign | 0x7Fu;
  const double a = fabs((double)v);
  if (a >= ref_decode_magnitude(f, f->max_code)) return sign | f->max_code;
  int lo = 0; /* largest code with value <= a */
  while (lo + 1 <= f->max_code && ref_decode_magnitude(f, lo + 1) <= a) ++lo;
  const double below = ref_decode_magnitude(f, lo), above = ref_decode_magnitude(f, lo + 1);
  int code;
  if (a - below < above - a) code = lo;
  else if (a - below > above - a) code = lo + 1;
  else code = (lo % 2 == 0) ? lo : lo + 1;
  return (uint8_t)(sign | code);
}

static const fmt_ref E4M3 = {"e4m3", 3, 7, 0x7E, tf_fp8_e4m3_encode, tf_fp8_e4m3_decode};
static const fmt_ref E5M2 = {"e5m2", 2, 15, 0x7B, tf_fp8_e5m2_encode, tf_fp8_e5m2_decode};

static int same_float(float a, float b) {
  return isnan(a) ? (isnan(b) && signbit(a) == signbit(b)) : f_bits(a) == f_bits(b);
}

static void test_decode_and_round_trip(const fmt_ref *f) {
  int decode_bad = -1, trip_bad = -1;
  for (int c = 0; c < 256; ++c) {
    const double mag = ref_decode_magnitude(f, c & 0x7F);
    const float want = (float)((c & 0x80) ? -mag : mag);
    const float got = f->decode((uint8_t)c);
    if (!same_float(got, want) && decode_bad < 0) decode_bad = c;
    /* Every finite code survives encode(decode()); Inf saturates; NaN becomes the canonical NaN. */
    uint8_t expect = (uint8_t)c;
    if (isinf(mag)) expect = (uint8_t)((c & 0x80) | f->max_code);
    if (isnan(mag)) expect = (uint8_t)((c & 0x80) | 0x7F);
    if (f->encode(got) != expect && trip_bad < 0) trip_bad = c;
  }
  CHECK(decode_bad < 0, "%s: decode of code 0x%02x", f->name, decode_bad);
  CHECK(trip_bad < 0, "%s: encode(decode()) of code 0x%02x", f->name, trip_bad);
}

static void test_encode_random(const fmt_ref *f) {
  int bad = 0;
  uint32_t first = 0;
  for (int i = 0; i < 60000; ++i) {
    uint32_t u = rand_u32();
    /* Two thirds of the samples within the FP8 range and just around it. */
    if (i % 3 != 0) u = (u & 0x807FFFFFu) | ((uint32_t)(97 + rand_u32() % 48) << 23);
    const float v = bits_f(u);
    if (f->encode(v) != ref_encode(f, v) && bad++ == 0) first = u;
  }
  CHECK(bad == 0, "%s: %d random encodings differ, first input bits 0x%08x", f->name, bad, first);
}

/* Every midpoint between neighbouring codes (exact ties) and its two float neighbours. */
static void test_encode_midpoints(const fmt_ref *f) {
  int bad = 0;
  float first = 0.0f;
  for (int c = 0; c < f->max_code; ++c) {
    const float mid = (float)((ref_decode_magnitude(f, c) + ref_decode_magnitude(f, c + 1)) / 2);
    const float probes[3] = {nextafterf(mid, 0.0f), mid, nextafterf(mid, INFINITY)};
    for (int k = 0; k < 3; ++k)
      for (int s = 0; s < 2; ++s) {
        const float v = s ? -probes[k] : probes[k];
        if (f->encode(v) != ref_encode(f, v) && bad++ == 0) first = v;
      }
  }
  CHECK(bad == 0, "%s: %d midpoint encodings differ, first %a", f->name, bad, (double)first);
}

static void test_encode_hand_points(void) {
  /* E4M3: step 1/8 in [1, 2); 1.0 is 0x38. */
  CHECK(tf_fp8_e4m3_encode(1.0625f) == 0x38, "e4m3 tie 1+1/16 -> 1.0 (even)");
  CHECK(tf_fp8_e4m3_encode(nextafterf(1.0625f, 2.0f)) == 0x39, "e4m3 just above a tie rounds up");
  CHECK(tf_fp8_e4m3_encode(1.1875f) == 0x3A, "e4m3 tie 1.1875 -> 1.25 (even)");
  CHECK(tf_fp8_e4m3_encode(1.9375f) == 0x40, "e4m3 tie 1.9375 carries into the exponent: 2.0");
  CHECK(tf_fp8_e4m3_encode(-1.0625f) == 0xB8, "e4m3 negative tie");
  /* E4M3 subnormals: step 2^-9; the largest subnormal is 7 * 2^-9, the smallest normal 2^-6 = 0x08. */
  CHECK(tf_fp8_e4m3_encode(0x1p-10f) == 0x00, "e4m3 tie 2^-10 -> 0 (even)");
  CHECK(tf_fp8_e4m3_encode(nextafterf(0x1p-10f, 1.0f)) == 0x01, "e4m3 above 2^-10 -> 2^-9");
  CHECK(tf_fp8_e4m3_encode(0x1.8p-9f) == 0x02, "e4m3 tie 1.5 * 2^-9 -> 2 * 2^-9");
  CHECK(tf_fp8_e4m3_encode(0x7p-9f) == 0x07, "e4m3 largest subnormal");
  CHECK(tf_fp8_e4m3_encode(0xFp-10f) == 0x08, "e4m3 tie 7.5 * 2^-9 -> smallest normal");
  CHECK(tf_fp8_e4m3_encode(0x1p-149f) == 0x00, "e4m3 float subnormal -> 0");
  CHECK(tf_fp8_e4m3_encode(-0x1p-149f) == 0x80, "e4m3 tiny negative -> -0");
  CHECK(tf_fp8_e4m3_encode(-0.0f) == 0x80, "e4m3 -0");
  /* E5M2: step 1/4 in [1, 2); 1.0 is 0x3C; subnormal step 2^-16. */
  CHECK(tf_fp8_e5m2_encode(1.125f) == 0x3C, "e5m2 tie 1.125 -> 1.0 (even)");
  CHECK(tf_fp8_e5m2_encode(1.375f) == 0x3E, "e5m2 tie 1.375 -> 1.5 (even)");
  CHECK(tf_fp8_e5m2_encode(0x1p-17f) == 0x00, "e5m2 tie 2^-17 -> 0");
  CHECK(tf_fp8_e5m2_encode(0x3p-17f) == 0x02, "e5m2 tie 3 * 2^-17 -> 2 * 2^-16");
  CHECK(tf_fp8_e5m2_encode(0x3p-16f) == 0x03, "e5m2 largest subnormal");
  CHECK(tf_fp8_e5m2_decode(0x01) == 0x1p-16f, "e5m2 smallest subnormal value");
  CHECK(tf_fp8_e4m3_decode(0x01) == 0x1p-9f, "e4m3 smallest subnormal value");
}

static void test_saturation_and_nan(void) {
  CHECK(tf_fp8_e4m3_encode(448.0f) == 0x7E, "e4m3 max");
  CHECK(tf_fp8_e4m3_encode(464.0f) == 0x7E, "e4m3 tie above max saturates");
  CHECK(tf_fp8_e4m3_encode(1e30f) == 0x7E, "e4m3 large saturates");
  CHECK(tf_fp8_e4m3_encode(FLT_MAX) == 0x7E, "e4m3 FLT_MAX saturates");
  CHECK(tf_fp8_e4m3_encode(INFINITY) == 0x7E, "e4m3 +Inf saturates");
  CHECK(tf_fp8_e4m3_encode(-INFINITY) == 0xFE, "e4m3 -Inf saturates");
  CHECK(tf_fp8_e5m2_encode(57344.0f) == 0x7B, "e5m2 max");
  CHECK(tf_fp8_e5m2_encode(61440.0f) == 0x7B, "e5m2 tie above max saturates");
  CHECK(tf_fp8_e5m2_encode(INFINITY) == 0x7B, "e5m2 +Inf saturates");
  CHECK(tf_fp8_e5m2_encode(-INFINITY) == 0xFB, "e5m2 -Inf saturates");
  CHECK(tf_fp8_e5m2_decode(0x7C) == INFINITY && tf_fp8_e5m2_decode(0xFC) == -INFINITY,
        "e5m2 Inf codes");
  const float qnan = bits_f(0x7FC00000u), neg_nan = bits_f(0xFFC00000u);
  const float snan = bits_f(0x7F800001u), neg_payload = bits_f(0xFFBFFFFFu);
  CHECK(tf_fp8_e4m3_encode(qnan) == 0x7F && tf_fp8_e4m3_encode(neg_nan) == 0xFF, "e4m3 NaN sign");
  CHECK(tf_fp8_e4m3_encode(snan) == 0x7F && tf_fp8_e4m3_encode(neg_payload) == 0xFF,
        "e4m3 NaN payloads");
  CHECK(tf_fp8_e5m2_encode(qnan) == 0x7F && tf_fp8_e5m2_encode(neg_nan) == 0xFF, "e5m2 NaN sign");
  CHECK(tf_fp8_e5m2_encode(snan) == 0x7F && tf_fp8_e5m2_encode(neg_payload) == 0xFF,
        "e5m2 NaN payloads");
  CHECK(isnan(tf_fp8_e4m3_decode(0xFF)) && signbit(tf_fp8_e4m3_decode(0xFF)), "e4m3 -NaN decodes");
  CHECK(isnan(tf_fp8_e5m2_decode(0x7D)) && !signbit(tf_fp8_e5m2_decode(0x7D)), "e5m2 +NaN decodes");
  CHECK(tf_fp8_max(TF_FP8_E4M3) == 448.0f && tf_fp8_max(TF_FP8_E5M2) == 57344.0f, "fp8 max");
}

/* ---- 16-bit floats: every code against an ldexp reference and back. ---- */

static void test_half_and_bfloat(void) {
  int f16_bad = -1, bf16_bad = -1;
  for (uint32_t h = 0; h < 65536; ++h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    double mag = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    const float want = (float)((h & 0x8000) ? -mag : mag);
    const float got = tf_f16_to_f32((uint16_t)h);
    const uint16_t back = tf_f32_to_f16(got);
    const uint16_t back_want = isnan(mag) ? (uint16_t)((h & 0x8000) | 0x7E00) : (uint16_t)h;
    if ((!same_float(got, want) || back != back_want) && f16_bad < 0) f16_bad = (int)h;
    const float b = tf_bf16_to_f32((uint16_t)h);
    const int bnan = ((h >> 7) & 255) == 255 && (h & 127);
    if ((f_bits(b) != h << 16 || tf_f32_to_bf16(b) != (bnan ? (h | 0x40) : h)) && bf16_bad < 0)
      bf16_bad = (int)h;
  }
  CHECK(f16_bad < 0, "float16 code 0x%04x", f16_bad);
  CHECK(bf16_bad < 0, "bfloat16 code 0x%04x", bf16_bad);
  CHECK(tf_f32_to_f16(1.0f + 0x1p-11f) == 0x3C00, "f16 tie -> even");
  CHECK(tf_f32_to_f16(1.0f + 0x3p-11f) == 0x3C02, "f16 tie -> even (up)");
  CHECK(tf_f32_to_f16(65519.0f) == 0x7BFF && tf_f32_to_f16(65520.0f) == 0x7C00, "f16 overflow");
  CHECK(tf_f32_to_f16(0x1p-25f) == 0x0000 && tf_f32_to_f16(0x1.8p-24f) == 0x0002,
        "f16 subnormal ties");
  CHECK(tf_f32_to_bf16(1.0f + 0x1p-8f) == 0x3F80 && tf_f32_to_bf16(1.0f + 0x3p-8f) == 0x3F82,
        "bf16 ties -> even");
  CHECK(tf_f32_to_bf16(FLT_MAX) == 0x7F80, "bf16 FLT_MAX rounds to Inf");
}

/*
 * The CPU's NaN results that the CUDA kernels reproduce (see mul_like_cpu in
 * csrc/cuda/fp8/fp8_cuda_traits.cuh): a NaN operand of a multiply comes back
 * quieted with its sign and payload, including inside tf_f16_to_f32.
 */
static void test_cpu_nan_propagation(void) {
  CHECK(f_bits(tf_f16_to_f32(0x7D00)) == 0x7FE00000u, "f16 sNaN -> quieted, payload kept");
  CHECK(f_bits(tf_f16_to_f32(0xFE01)) == 0xFFC02000u, "f16 -qNaN -> payload and sign kept");
  const float in[3] = {bits_f(0xFF800001u), bits_f(0x7FC00000u), 1.0f};
  uint8_t y[3];
  uint32_t a;
  tf_status st = tf_fp8_quantize(in, TF_FLOAT32, 0, 3, 2.0f, TF_FP8_E5M2, y, &a);
  CHECK(st == TF_OK && y[0] == 0xFF && y[1] == 0x7F && a == 0x7FC00000u,
        "quantize keeps the NaN sign through the scale multiply");
  float out[2];
  const uint8_t codes[2] = {0xFF, 0x7F};
  st = tf_fp8_dequantize(codes, TF_FP8_E4M3, 0, 2, 3.0f, out, TF_FLOAT32);
  CHECK(st == TF_OK && f_bits(out[0]) == 0xFFC00000u && f_bits(out[1]) == 0x7FC00000u,
        "dequantize keeps the decoded NaN");
}

/* ---- Kernels. ---- */

#define N 1000

static void fill_f32(float *x, int n) {
  for (int i = 0; i < n; ++i) x[i] = (float)((int32_t)rand_u32() % 20000) / 16.0f;
}

static void test_quantize_kernels(void) {
  static float x[N];
  static uint16_t xh[N], xb[N];
  static uint8_t y[N];
  fill_f32(x, N);
  x[10] = -3000.5f; /* the amax */
  for (int i = 0; i < N; ++i) {
    xb[i] = tf_f32_to_bf16(x[i]);
    xh[i] = tf_f32_to_f16(x[i]);
  }
  const float scale = 0.37f;
  uint32_t amax = 0;
  /* Two sub-ranges, as the binding's threads call them. */
  tf_status s1 = tf_fp8_quantize(x, TF_FLOAT32, 0, 333, scale, TF_FP8_E4M3, y, &amax);
  uint32_t amax2 = 0;
  tf_status s2 = tf_fp8_quantize(x, TF_FLOAT32, 333, N, scale, TF_FP8_E4M3, y, &amax2);
  int bad = 0;
  for (int i = 0; i < N; ++i) bad += y[i] != ref_encode(&E4M3, x[i] * scale);
  CHECK(s1 == TF_OK && s2 == TF_OK && bad == 0, "quantize f32 e4m3: %d wrong bytes", bad);
  CHECK((amax > amax2 ? amax : amax2) == f_bits(3000.5f), "quantize amax is max |x|");

  CHECK(tf_fp8_quantize(xb, TF_BFLOAT16, 0, N, scale, TF_FP8_E5M2, y, &amax) == TF_OK, "bf16");
  bad = 0;
  for (int i = 0; i < N; ++i) bad += y[i] != ref_encode(&E5M2, tf_bf16_to_f32(xb[i]) * scale);
  CHECK(bad == 0, "quantize bf16 e5m2: %d wrong bytes", bad);
  CHECK(amax == f_bits(tf_bf16_to_f32(xb[10])) - 0x80000000u, "bf16 amax");

  CHECK(tf_fp8_quantize(xh, TF_FLOAT16, 0, N, scale, TF_FP8_E4M3, y, &amax) == TF_OK, "f16");
  bad = 0;
  for (int i = 0; i < N; ++i) bad += y[i] != ref_encode(&E4M3, tf_f16_to_f32(xh[i]) * scale);
  CHECK(bad == 0, "quantize f16 e4m3: %d wrong bytes", bad);

  /* Dequantize: decode * scale_inv, rounded to the output dtype. */
  static float back[N];
  static uint16_t back16[N];
  CHECK(tf_fp8_dequantize(y, TF_FP8_E4M3, 0, N, 1.0f / scale, back, TF_FLOAT32) == TF_OK, "dq");
  bad = 0;
  for (int i = 0; i < N; ++i) bad += !same_float(back[i], tf_fp8_e4m3_decode(y[i]) * (1.0f / scale));
  CHECK(bad == 0, "dequantize f32: %d wrong", bad);
  CHECK(tf_fp8_dequantize(y, TF_FP8_E4M3, 0, N, 1.0f / scale, back16, TF_FLOAT16) == TF_OK, "dq");
  bad = 0;
  for (int i = 0; i < N; ++i)
    bad += back16[i] != tf_f32_to_f16(tf_fp8_e4m3_decode(y[i]) * (1.0f / scale));
  CHECK(bad == 0, "dequantize f16: %d wrong", bad);
  CHECK(tf_fp8_dequantize(y, TF_FP8_E4M3, 0, N, 1.0f / scale, back16, TF_BFLOAT16) == TF_OK, "dq");
  bad = 0;
  for (int i = 0; i < N; ++i)
    bad += back16[i] != tf_f32_to_bf16(tf_fp8_e4m3_decode(y[i]) * (1.0f / scale));
  CHECK(bad == 0, "dequantize bf16: %d wrong", bad);
}

static void test_amax_special_values(void) {
  float x[6] = {1.0f, -2.0f, 0.5f, -0.0f, 3.0f, -1.5f};
  uint32_t amax = 0;
  CHECK(tf_fp8_amax(x, TF_FLOAT32, 0, 6, &amax) == TF_OK && amax == f_bits(3.0f), "amax");
  x[1] = -INFINITY;
  CHECK(tf_fp8_amax(x, TF_FLOAT32, 0, 6, &amax) == TF_OK && amax == 0x7F800000u, "amax -Inf");
  x[4] = bits_f(0xFFC00000u); /* -NaN wins over Inf and reports a positive NaN */
  CHECK(tf_fp8_amax(x, TF_FLOAT32, 0, 6, &amax) == TF_OK && amax == 0x7FC00000u, "amax NaN");
  CHECK(tf_fp8_amax(x, TF_FLOAT32, 2, 4, &amax) == TF_OK && amax == f_bits(0.5f), "amax range");
  CHECK(tf_fp8_amax(x, TF_FLOAT32, 3, 3, &amax) == TF_OK && amax == 0, "amax empty");
  const uint16_t h[3] = {0x3C00, 0xFC00, 0x7E00}; /* 1, -Inf, NaN in float16 */
  CHECK(tf_fp8_amax(h, TF_FLOAT16, 0, 2, &amax) == TF_OK && amax == 0x7F800000u, "f16 amax Inf");
  CHECK(tf_fp8_amax(h, TF_FLOAT16, 0, 3, &amax) == TF_OK && amax > 0x7F800000u, "f16 amax NaN");
  const uint16_t b[2] = {0xC040, 0x3F80}; /* -3, 1 in bfloat16 */
  CHECK(tf_fp8_amax(b, TF_BFLOAT16, 0, 2, &amax) == TF_OK && amax == f_bits(3.0f), "bf16 amax");
}

static void test_cast_transpose(void) {
  /* Rows: a tall tile, a short one and a ragged edge in the first band, an edge band; columns: a
   * 64-wide tile, a 32-wide one and a ragged edge. */
  enum { R = TF_FP8_CT_BAND + TF_FP8_CT_TILE + 37, C = 100, LD = 105 };
  static float x[R * LD];
  static uint8_t y[R * C], y_t[C * R], q[R * LD];
  fill_f32(x, R * LD);
  const float scale = 0.011f;
  uint32_t amax_all = 0, amax_ref = 0, a = 0;
  /* Bands at multiples of the tile height, as the binding splits them. */
  const int64_t cuts[3] = {0, TF_FP8_CT_BAND + TF_FP8_CT_TILE, R};
  int ok = 1;
  for (int b = 0; b < 2; ++b) {
    ok &= tf_fp8_cast_transpose(x, TF_FLOAT32, R, C, LD, cuts[b], cuts[b + 1], scale,
                                TF_FP8_E5M2, y, y_t, &a) == TF_OK;
    amax_all = a > amax_all ? a : amax_all;
  }
  ok &= tf_fp8_quantize(x, TF_FLOAT32, 0, R * LD, scale, TF_FP8_E5M2, q, &a) == TF_OK;
  int bad = 0;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      bad += y[r * C + c] != q[r * LD + c] || y_t[c * R + r] != q[r * LD + c];
      const uint32_t v = f_bits(x[r * LD + c]) & 0x7FFFFFFFu;
      amax_ref = v > amax_ref ? v : amax_ref;
    }
  CHECK(ok && bad == 0, "cast_transpose: %d wrong bytes", bad);
  CHECK(amax_all == amax_ref, "cast_transpose amax covers only the rows x cols block");
}

static void test_size_checks(void) {
  float x[4] = {0};
  uint8_t y[4];
  uint32_t a;
  CHECK(tf_fp8_quantize(x, TF_FLOAT32, -1, 2, 1.0f, TF_FP8_E4M3, y, &a) == TF_ERR_BAD_SIZE, "q -begin");
  CHECK(tf_fp8_quantize(x, TF_FLOAT32, 3, 2, 1.0f, TF_FP8_E4M3, y, &a) == TF_ERR_BAD_SIZE, "q b>e");
  CHECK(tf_fp8_quantize(x, TF_FLOAT32, 0, 2, 1.0f, TF_FP8_E4M3, y, NULL) == TF_ERR_NULL_POINTER, "q amax");
  CHECK(tf_fp8_quantize(NULL, TF_FLOAT32, 0, 2, 1.0f, TF_FP8_E4M3, y, &a) == TF_ERR_NULL_POINTER, "q x");
  CHECK(tf_fp8_quantize(x, TF_FLOAT32, 0, 2, 1.0f, TF_FP8_E4M3, NULL, &a) == TF_ERR_NULL_POINTER, "q y");
  CHECK(tf_fp8_quantize(NULL, TF_FLOAT32, 2, 2, 1.0f, TF_FP8_E4M3, NULL, &a) == TF_OK, "q empty");
  CHECK(tf_fp8_quantize(x, (tf_dtype)3, 0, 2, 1.0f, TF_FP8_E4M3, y, &a) == TF_ERR_BAD_DTYPE, "q dtype");
  CHECK(tf_fp8_quantize(x, TF_FLOAT32, 0, 2, 1.0f, (tf_fp8_format)2, y, &a) == TF_ERR_BAD_DTYPE, "q fmt");
  CHECK(tf_fp8_amax(x, TF_FLOAT32, 0, -1, &a) == TF_ERR_BAD_SIZE, "amax e<b");
  CHECK(tf_fp8_amax(NULL, TF_FLOAT32, 0, 1, &a) == TF_ERR_NULL_POINTER, "amax x");
  CHECK(tf_fp8_amax(x, TF_FLOAT32, 0, 1, NULL) == TF_ERR_NULL_POINTER, "amax out");
  CHECK(tf_fp8_amax(x, (tf_dtype)-1, 0, 1, &a) == TF_ERR_BAD_DTYPE, "amax dtype");
  CHECK(tf_fp8_dequantize(y, TF_FP8_E4M3, -2, 1, 1.0f, x, TF_FLOAT32) == TF_ERR_BAD_SIZE, "dq size");
  CHECK(tf_fp8_dequantize(NULL, TF_FP8_E4M3, 0, 1, 1.0f, x, TF_FLOAT32) == TF_ERR_NULL_POINTER, "dq y");
  CHECK(tf_fp8_dequantize(y, TF_FP8_E4M3, 0, 1, 1.0f, NULL, TF_FLOAT32) == TF_ERR_NULL_POINTER, "dq x");
  CHECK(tf_fp8_dequantize(y, (tf_fp8_format)5, 0, 1, 1.0f, x, TF_FLOAT32) == TF_ERR_BAD_DTYPE, "dq fmt");

  const tf_fp8_format f = TF_FP8_E4M3;
  CHECK(tf_fp8_cast_transpose(x, TF_FLOAT32, -1, 2, 2, 0, 0, 1.0f, f, y, y, &a) == TF_ERR_BAD_SIZE,
        "ct rows < 0");
  CHECK(tf_fp8_cast_transpose(x, TF_FLOAT32, 2, -2, 2, 0, 2, 1.0f, f, y, y, &a) == TF_ERR_BAD_SIZE,
        "ct cols < 0");
  CHECK(tf_fp8_cast_transpose(x, TF_FLOAT32, 2, 2, 1, 0, 2, 1.0f, f, y, y, &a) == TF_ERR_BAD_SIZE,
        "ct stride < cols");
  CHECK(tf_fp8_cast_transpose(x, TF_FLOAT32, 2, 2, 2, 1, 3, 1.0f, f, y, y, &a) == TF_ERR_BAD_SIZE,
        "ct row range past rows");
  CHECK(tf_fp8_cast_transpose(x, TF_FLOAT32, 2, 2, 2, 2, 1, 1.0f, f, y, y, &a) == TF_ERR_BAD_SIZE,
        "ct row range reversed");
  CHECK(tf_fp8_cast_transpose(x, TF_FLOAT32, INT64_MAX / 2, 3, 3, 0, 0, 1.0f, f, y, y, &a) ==
            TF_ERR_OVERFLOW, "ct rows * cols overflows");
  CHECK(tf_fp8_cast_transpose(x, TF_FLOAT32, 4, 2, INT64_MAX / 3, 0, 0, 1.0f, f, y, y, &a) ==
            TF_ERR_OVERFLOW, "ct rows * stride overflows");
  CHECK(tf_fp8_cast_transpose(NULL, TF_FLOAT32, 2, 2, 2, 0, 2, 1.0f, f, y, y, &a) ==
            TF_ERR_NULL_POINTER, "ct x");
  CHECK(tf_fp8_cast_transpose(x, TF_FLOAT32, 2, 2, 2, 0, 2, 1.0f, f, y, NULL, &a) ==
            TF_ERR_NULL_POINTER, "ct y_t");
  CHECK(tf_fp8_cast_transpose(x, TF_FLOAT32, 2, 2, 2, 0, 2, 1.0f, f, y, y, NULL) ==
            TF_ERR_NULL_POINTER, "ct amax");
  CHECK(tf_fp8_cast_transpose(NULL, TF_FLOAT32, 5, 0, 0, 0, 5, 1.0f, f, NULL, NULL, &a) == TF_OK,
        "ct zero columns");

  CHECK(tf_mul_fits(INT64_MAX, 1) && !tf_mul_fits(INT64_MAX, 2) && !tf_mul_fits(-1, 2) &&
            tf_mul_fits(0, INT64_MAX),
        "tf_mul_fits");
  CHECK(tf_range_ok(0, 0, 0) && !tf_range_ok(-1, 0, 3) && !tf_range_ok(2, 1, 3) &&
            !tf_range_ok(0, 4, 3),
        "tf_range_ok");
}

/* ---- Every instruction-set path against the portable one (fp8_kernels.h). ---- */

typedef struct isa_path {
  const char *name;
  const tf_fp8_kernel_set *set;
} isa_path;

/* The paths this CPU runs besides the portable one. */
static int simd_paths(isa_path paths[2]) {
  int n = 0;
  if (tf_fp8_kernels_avx2 && tf_cpu_isa_detected() >= TF_ISA_AVX2)
    paths[n++] = (isa_path){"avx2", tf_fp8_kernels_avx2};
  if (tf_fp8_kernels_avx512 && tf_cpu_isa_detected() >= TF_ISA_AVX512)
    paths[n++] = (isa_path){"avx512", tf_fp8_kernels_avx512};
  return n;
}

static const char *const dtype_names[3] = {"f32", "bf16", "f16"};
/*
 * Scales of both AVX2 encoders: positive finite ones take the fast encoder (the first two are the
 * smallest for which E4M3's scale * 2^-8 is still normal, and just below it); zero, negative,
 * infinite and too small ones take the generic one. (No NaN scale: which NaN x * NaN gives depends
 * on the operand order the compiler picks, in the portable loops too.)
 */
static const float path_scales[] = {1.0f,  0.5f,      3.0f,      0x1p-7f,   0.37f,     0x1p-118f,
                                    0x1.fffffep-119f, 0x1p-140f, 0x1p+100f, FLT_MAX,   -1.0f,
                                    -0.37f, 0.0f,     -0.0f,     INFINITY,  -INFINITY};
#define N_PATH_SCALES (int)(sizeof path_scales / sizeof path_scales[0])

/* Canary bytes around every output: a kernel writing outside its range changes them. */
#define PAD 64
#define CANARY 0xA5u

static int canaries_intact(const uint8_t *buf, int64_t lo, int64_t hi, int64_t size) {
  for (int64_t i = 0; i < size; ++i)
    if ((i < lo || i >= hi) && buf[i] != CANARY) return 0;
  return 1;
}

/*
 * quantize and amax of x[begin, end) on `path` and on the portable set: same
 * bytes, same amax bits, nothing written outside [begin, end).
 */
static int same_quantize(const isa_path *path, const void *x, tf_dtype d, int64_t begin,
                         int64_t end, float scale, tf_fp8_format f, uint8_t *y, uint8_t *y_ref) {
  memset(y, CANARY, (size_t)end + PAD);
  memset(y_ref, CANARY, (size_t)end + PAD);
  const uint32_t a = path->set->quantize[d][f](x, begin, end, scale, y);
  const uint32_t a_ref = tf_fp8_kernels_portable.quantize[d][f](x, begin, end, scale, y_ref);
  const uint32_t m = path->set->amax[d](x, begin, end);
  return a == a_ref && m == a_ref && memcmp(y + begin, y_ref + begin, (size_t)(end - begin)) == 0 &&
         canaries_intact(y, begin, end, end + PAD);
}

static void test_paths_every_16bit_value(const isa_path *path) {
  enum { LEN = 65536 };
  static uint16_t x[LEN];
  static uint8_t y[LEN + PAD], y_ref[LEN + PAD];
  for (int i = 0; i < LEN; ++i) x[i] = (uint16_t)i;
  for (int d = TF_BFLOAT16; d <= TF_FLOAT16; ++d)
    for (int f = 0; f < 2; ++f)
      for (int k = 0; k < N_PATH_SCALES; ++k) {
        int ok = same_quantize(path, x, (tf_dtype)d, 0, LEN, path_scales[k], (tf_fp8_format)f, y, y_ref);
        /* Odd sub-ranges start and end inside vectors. */
        ok &= same_quantize(path, x, (tf_dtype)d, 3, LEN - 5, path_scales[k], (tf_fp8_format)f, y, y_ref);
        CHECK(ok, "%s: every %s value, %s, scale %a", path->name, dtype_names[d], f ? "e5m2" : "e4m3",
              (double)path_scales[k]);
      }
}

static void test_paths_random_f32_bits(const isa_path *path) {
  enum { LEN = 1 << 18 };
  static uint32_t x[LEN];
  static uint8_t y[LEN + PAD], y_ref[LEN + PAD];
  for (int i = 0; i < LEN; ++i) {
    uint32_t u = rand_u32();
    /* Half of them near the FP8 ranges (float32 exponents 97..144), the rest anywhere. */
    if (i % 2) u = (u & 0x807FFFFFu) | ((uint32_t)(97 + rand_u32() % 48) << 23);
    x[i] = u;
  }
  for (int f = 0; f < 2; ++f)
    for (int k = 0; k < N_PATH_SCALES; ++k)
      CHECK(same_quantize(path, x, TF_FLOAT32, 1, LEN - 2, path_scales[k], (tf_fp8_format)f, y, y_ref),
            "%s: random f32 bits, %s, scale %a", path->name, f ? "e5m2" : "e4m3",
            (double)path_scales[k]);
}

/* Every short length at several offsets: the vector loops, their tails and empty ranges. */
static void test_paths_lengths(const isa_path *path) {
  enum { LEN = 200 };
  static uint32_t x32[LEN];
  static uint16_t x16[LEN];
  static uint8_t y[LEN + PAD], y_ref[LEN + PAD];
  for (int i = 0; i < LEN; ++i) {
    x32[i] = rand_u32();
    x16[i] = (uint16_t)rand_u32();
  }
  int bad = 0;
  for (int d = 0; d < 3; ++d)
    for (int f = 0; f < 2; ++f)
      for (int64_t begin = 0; begin < 9; ++begin)
        for (int64_t len = 0; begin + len <= LEN - 8; ++len)
          for (int sc = 0; sc < 2; ++sc) /* the fast encoder, then the generic one */
            bad += !same_quantize(path, d == TF_FLOAT32 ? (const void *)x32 : (const void *)x16,
                                  (tf_dtype)d, begin, begin + len, sc ? -0.75f : 0.75f,
                                  (tf_fp8_format)f, y, y_ref);
  CHECK(bad == 0, "%s: %d (dtype, format, begin, length) cases differ from portable", path->name, bad);
}

/* The amax element (a large value, Inf or NaN) at every position, first and last included. */
static void test_paths_amax_every_position(const isa_path *path) {
  enum { LEN = 131 };
  static float x32[LEN];
  static uint16_t xb[LEN], xh[LEN];
  static uint8_t y[LEN + PAD], y_ref[LEN + PAD];
  const float specials[3] = {1000.0f, INFINITY, NAN};
  int bad = 0;
  for (int sp = 0; sp < 3; ++sp)
    for (int p = 0; p < LEN; ++p) {
      for (int i = 0; i < LEN; ++i) {
        x32[i] = i == p ? -specials[sp] : (float)((int)(rand_u32() % 2000) - 1000) / 8.0f;
        xb[i] = tf_f32_to_bf16(x32[i]);
        xh[i] = tf_f32_to_f16(x32[i]);
      }
      const void *xs[3] = {x32, xb, xh};
      for (int d = 0; d < 3; ++d) {
        const uint32_t a_path = path->set->amax[d](xs[d], 0, LEN);
        const uint32_t expect = d == TF_FLOAT32   ? f_bits(x32[p]) & 0x7FFFFFFFu
                                : d == TF_BFLOAT16 ? f_bits(tf_bf16_to_f32(xb[p])) & 0x7FFFFFFFu
                                                   : f_bits(tf_f16_to_f32(xh[p])) & 0x7FFFFFFFu;
        bad += a_path != expect;
        bad += !same_quantize(path, xs[d], (tf_dtype)d, 0, LEN, 1.0f, TF_FP8_E4M3, y, y_ref);
        bad += path->set->quantize[d][TF_FP8_E5M2](xs[d], 0, LEN, 2.0f, y) != expect;
        /* A range that ends right after the special element, and one that starts on it. */
        bad += path->set->amax[d](xs[d], 0, p + 1) != expect;
        bad += path->set->amax[d](xs[d], p, LEN) != expect;
      }
    }
  CHECK(bad == 0, "%s: amax with the maximum at every position: %d wrong", path->name, bad);
}

/*
 * Cast-transpose blocks of whole and ragged tiles, with a row stride, against the portable set.
 * The last shape is wider than one AVX-512 panel (4096 columns): two panels across, then a ragged
 * right edge and two bottom rows.
 */
static void test_paths_cast_transpose(const isa_path *path) {
  static const int64_t shapes[][3] = {{64, 64, 64}, {96, 130, 135}, {37, 70, 75}, {33, 31, 31},
                                       {1, 1, 1},    {128, 32, 40},  {32, 96, 97}, {65, 33, 33},
                                       {192, 96, 100}, {130, 64, 64}, {128, 128, 128}, {130, 4165, 4181}};
  enum { MAX_X = 130 * 4181, MAX_Y = 130 * 4165 };
  static uint32_t x32[MAX_X];
  static uint16_t x16[MAX_X];
  /* 64-byte aligned: shapes whose rows and columns are multiples of 32 take the streaming stores. */
  static _Alignas(64) uint8_t y[MAX_Y + PAD], y_ref[MAX_Y + PAD], t[MAX_Y + PAD], t_ref[MAX_Y + PAD];
  for (int i = 0; i < MAX_X; ++i) {
    x32[i] = rand_u32();
    if (i % 3) x32[i] = (x32[i] & 0x807FFFFFu) | ((uint32_t)(100 + rand_u32() % 40) << 23);
    x16[i] = (uint16_t)rand_u32();
  }
  int bad = 0;
  for (size_t sh = 0; sh < sizeof shapes / sizeof shapes[0]; ++sh) {
    const int64_t rows = shapes[sh][0], cols = shapes[sh][1], ld = shapes[sh][2];
    for (int d = 0; d < 3; ++d)
      for (int f = 0; f < 2; ++f)
        for (int sc = 0; sc < 4; ++sc) {
          static const float scales[4] = {1.3f, -1.3f, 0x1p-125f, -INFINITY};
          const float scale = scales[sc];
          const void *x = d == TF_FLOAT32 ? (const void *)x32 : (const void *)x16;
          memset(y, CANARY, sizeof y);
          memset(y_ref, CANARY, sizeof y_ref);
          memset(t, CANARY, sizeof t);
          memset(t_ref, CANARY, sizeof t_ref);
          const uint32_t a = path->set->cast_transpose[d][f](x, ld, rows, cols, scale, y, cols, t, rows);
          const uint32_t a_ref = tf_fp8_kernels_portable.cast_transpose[d][f](x, ld, rows, cols, scale,
                                                                            y_ref, cols, t_ref, rows);
          uint32_t amax_ref = 0;
          for (int64_t r = 0; r < rows; ++r) {
            const uint32_t m = tf_fp8_kernels_portable.amax[d](x, r * ld, r * ld + cols);
            amax_ref = m > amax_ref ? m : amax_ref;
          }
          const size_t n = (size_t)(rows * cols);
          bad += a != a_ref || a != amax_ref || memcmp(y, y_ref, n) != 0 || memcmp(t, t_ref, n) != 0 ||
                 !canaries_intact(y, 0, (int64_t)n, MAX_Y + PAD) ||
                 !canaries_intact(t, 0, (int64_t)n, MAX_Y + PAD);
        }
    }
  CHECK(bad == 0, "%s: cast_transpose: %d (shape, dtype, format, scale) cases differ", path->name, bad);
}

/*
 * float16 NaNs of different kinds in one range: the widening quiets a signalling NaN, so the
 * float32 amax bits are not the widened 16-bit maximum (0x7C01 -> 0x7FC02000 beats 0x7E00 ->
 * 0x7FC00000). Every kernel must report the portable bits, NaN codes included.
 */
static void test_paths_f16_nan_payloads(const isa_path *path) {
  enum { ROWS = 3, COLS = 64, LEN = ROWS * COLS };
  static uint16_t x[LEN];
  static _Alignas(64) uint8_t y[LEN + PAD], y_ref[LEN + PAD], t[LEN], t_ref[LEN];
  static const uint16_t nans[4][2] = {{0x7E00, 0x7C01}, {0x7C01, 0x7E00}, {0xFE00, 0xFC01}, {0x7FFF, 0x7D00}};
  int bad = 0;
  for (int k = 0; k < 4; ++k)
    for (int p = 0; p < LEN; p += 37) {
      for (int i = 0; i < LEN; ++i) x[i] = tf_f32_to_f16((float)((int)(rand_u32() % 2000) - 1000) / 8.0f);
      x[p] = nans[k][0];
      x[(p + 70) % LEN] = nans[k][1];
      const uint32_t want = tf_fp8_kernels_portable.amax[TF_FLOAT16](x, 0, LEN);
      bad += path->set->amax[TF_FLOAT16](x, 0, LEN) != want;
      for (int f = 0; f < 2; ++f)
        for (int sc = 0; sc < 2; ++sc) {
          const float scale = sc ? -2.0f : 2.0f;
          bad += !same_quantize(path, x, TF_FLOAT16, 0, LEN, scale, (tf_fp8_format)f, y, y_ref);
          const uint32_t a = path->set->cast_transpose[TF_FLOAT16][f](x, COLS, ROWS, COLS, scale, y, COLS, t, ROWS);
          const uint32_t a_ref = tf_fp8_kernels_portable.cast_transpose[TF_FLOAT16][f](x, COLS, ROWS, COLS, scale,
                                                                                     y_ref, COLS, t_ref, ROWS);
          bad += a != want || a_ref != want || memcmp(y, y_ref, LEN) != 0 || memcmp(t, t_ref, LEN) != 0;
        }
    }
  CHECK(bad == 0, "%s: float16 NaN payloads: %d wrong", path->name, bad);
}

/*
 * lookup16 and lookup32 (dequantize's copies) against the portable ones: random tables and codes, every
 * code value, every short length at several offsets, nothing written outside [begin, end).
 */
static void test_paths_lookups(const isa_path *path) {
  enum { LEN = 300 };
  static uint8_t codes[LEN];
  static uint16_t table16[256], x16[LEN + PAD], ref16[LEN + PAD];
  static uint32_t table32[256], x32[LEN + PAD], ref32[LEN + PAD];
  int bad = 0;
  for (int round = 0; round < 4; ++round) {
    for (int c = 0; c < 256; ++c) {
      table16[c] = (uint16_t)rand_u32();
      table32[c] = rand_u32();
    }
    for (int i = 0; i < LEN; ++i) codes[i] = round == 0 ? (uint8_t)i : (uint8_t)rand_u32();
    for (int64_t begin = 0; begin < 9; ++begin)
      for (int64_t len = 0; begin + len <= LEN; ++len) {
        memset(x16, CANARY, sizeof x16);
        memset(ref16, CANARY, sizeof ref16);
        memset(x32, CANARY, sizeof x32);
        memset(ref32, CANARY, sizeof ref32);
        path->set->lookup16(codes, begin, begin + len, table16, x16);
        tf_fp8_lookup16_portable(codes, begin, begin + len, table16, ref16);
        path->set->lookup32(codes, begin, begin + len, table32, x32);
        tf_fp8_lookup32_portable(codes, begin, begin + len, table32, ref32);
        bad += memcmp(x16, ref16, sizeof x16) != 0 || memcmp(x32, ref32, sizeof x32) != 0;
        for (int64_t i = begin; i < begin + len; ++i) bad += x16[i] != table16[codes[i]] || x32[i] != table32[codes[i]];
      }
  }
  CHECK(bad == 0, "%s: lookup16/lookup32: %d cases differ from the table", path->name, bad);
}

/*
 * tf_fp8_dequantize of every code into each dtype, with and without the portable cap: the same bits,
 * each the code's decoded value times scale_inv in float32, rounded to the dtype.
 */
static void test_dequantize_under_cap(void) {
  enum { LEN = 256 * 3 + 17 };
  static uint8_t codes[LEN];
  static uint32_t out[2][LEN];
  static const float scales_inv[] = {1.0f, 0.37f, 0x1p-140f, 3e38f, -2.5f, 0.0f, INFINITY};
  for (int i = 0; i < LEN; ++i) codes[i] = i < 512 ? (uint8_t)i : (uint8_t)rand_u32();
  int bad = 0;
  for (int d = 0; d < 3; ++d)
    for (int f = 0; f < 2; ++f)
      for (size_t k = 0; k < sizeof scales_inv / sizeof scales_inv[0]; ++k) {
        for (int capped = 0; capped < 2; ++capped) {
          CHECK(tf_set_cpu_isa_cap(capped ? TF_ISA_PORTABLE : -1) == TF_OK, "set cap");
          memset(out[capped], CANARY, sizeof out[capped]);
          bad += tf_fp8_dequantize(codes, (tf_fp8_format)f, 1, LEN - 2, scales_inv[k], out[capped],
                                   (tf_dtype)d) != TF_OK;
        }
        bad += memcmp(out[0], out[1], sizeof out[0]) != 0;
        const int64_t size = tf_dtype_size((tf_dtype)d);
        for (int64_t i = 1; i < LEN - 2; ++i) {
          const float v = (f ? tf_fp8_e5m2_decode(codes[i]) : tf_fp8_e4m3_decode(codes[i])) * scales_inv[k];
          uint32_t want = f_bits(v);
          if (d == TF_BFLOAT16) want = tf_f32_to_bf16(v);
          if (d == TF_FLOAT16) want = tf_f32_to_f16(v);
          uint32_t got = 0;
          memcpy(&got, (const char *)out[0] + i * size, (size_t)size);
          /* A NaN's payload follows the operand order the compiler picked: any NaN will do. */
          const uint32_t exp_mask = d == TF_FLOAT32 ? 0x7F800000u : d == TF_BFLOAT16 ? 0x7F80u : 0x7C00u;
          const uint32_t abs_got = got & (d == TF_FLOAT32 ? 0x7FFFFFFFu : 0x7FFFu);
          bad += isnan(v) ? abs_got <= exp_mask : got != want;
        }
      }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(bad == 0, "dequantize with and without the portable cap: %d differences", bad);
}

/*
 * The public entry points under the ISA cap: the same bytes with and without
 * it, over a tensor split into chunks the way the binding splits it, with the
 * maximum just before, on and after each chunk boundary and at the last element.
 */
static void test_public_api_under_cap(void) {
  enum { CHUNK = 1 << 16, LEN = 3 * CHUNK + 37 };
  static float x[LEN];
  static uint8_t y[2][LEN];
  for (int i = 0; i < LEN; ++i) x[i] = (float)((int)(rand_u32() % 20000) - 10000) / 64.0f;
  const int64_t positions[] = {0, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK - 1, 3 * CHUNK, LEN - 1};
  int bad = 0;
  for (size_t pi = 0; pi < sizeof positions / sizeof positions[0]; ++pi) {
    const int64_t p = positions[pi];
    const float saved = x[p];
    x[p] = -7777.0f;
    for (int capped = 0; capped < 2; ++capped) {
      CHECK(tf_set_cpu_isa_cap(capped ? TF_ISA_PORTABLE : -1) == TF_OK, "set cap");
      CHECK(capped ? tf_fp8_kernels_active() == &tf_fp8_kernels_portable
                   : tf_fp8_kernels_active() != NULL,
            "active kernel set under the cap");
      uint32_t amax = 0;
      for (int64_t b = 0; b < LEN; b += CHUNK) {
        uint32_t a = 0;
        const int64_t e = LEN - b < CHUNK ? LEN : b + CHUNK;
        bad += tf_fp8_quantize(x, TF_FLOAT32, b, e, 0.05f, TF_FP8_E4M3, y[capped], &a) != TF_OK;
        amax = a > amax ? a : amax;
      }
      bad += amax != f_bits(7777.0f);
      uint32_t m = 0;
      bad += tf_fp8_amax(x, TF_FLOAT32, 0, LEN, &m) != TF_OK || m != f_bits(7777.0f);
    }
    bad += memcmp(y[0], y[1], LEN) != 0;
    x[p] = saved;
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK && tf_cpu_isa() == tf_cpu_isa_detected(), "cap removed");
  CHECK(bad == 0, "public API with and without the portable cap: %d differences", bad);
}

/*
 * The table path (tf_fp8_table_build and the table kernels), with and without the portable cap:
 * the table built in parts, then quantize of every 16-bit pattern (shuffled, in an odd range)
 * gives the same bytes and amax bits as the scale path, for both formats and every path scale;
 * once more with the NaN patterns replaced, so that the amax is a number.
 * Then each instruction-set path's table kernels against the portable ones at every short length.
 */
static int same_table_path(const uint16_t *x, int64_t len, tf_dtype d, float scale, tf_fp8_format f,
                           const uint8_t *table, uint8_t *y, uint8_t *y_ref) {
  int ok = 1;
  uint32_t a = 0, a_ref = 0;
  memset(y, CANARY, (size_t)len + PAD);
  memset(y_ref, CANARY, (size_t)len + PAD);
  ok &= tf_fp8_quantize_table(x, d, 3, len - 5, table, y, &a) == TF_OK;
  ok &= tf_fp8_quantize(x, d, 3, len - 5, scale, f, y_ref, &a_ref) == TF_OK;
  return ok && a == a_ref && memcmp(y, y_ref, (size_t)len + PAD) == 0;
}

static void test_table_path(void) {
  enum { LEN = TF_FP8_TABLE_ENTRIES + 37 };
  static uint16_t x[LEN], x_no_nan[LEN];
  static uint8_t table[TF_FP8_TABLE_ENTRIES], y[LEN + PAD], y_ref[LEN + PAD];
  for (int i = 0; i < LEN; ++i) x[i] = (uint16_t)i;
  for (int i = LEN - 1; i > 0; --i) { /* Fisher-Yates */
    const int j = (int)(rand_u32() % (uint32_t)(i + 1));
    const uint16_t v = x[i];
    x[i] = x[j];
    x[j] = v;
  }
  static const int64_t parts[] = {0, 1000, 40000, TF_FP8_TABLE_ENTRIES};
  int bad = 0;
  for (int capped = 0; capped < 2; ++capped) {
    CHECK(tf_set_cpu_isa_cap(capped ? TF_ISA_PORTABLE : -1) == TF_OK, "set cap");
    for (int d = TF_BFLOAT16; d <= TF_FLOAT16; ++d) {
      const uint16_t nan_above = d == TF_BFLOAT16 ? 0x7F80u : 0x7C00u;
      for (int i = 0; i < LEN; ++i)
        x_no_nan[i] = (x[i] & 0x7FFFu) > nan_above ? (uint16_t)(rand_u32() % nan_above) : x[i];
      for (int f = 0; f < 2; ++f)
        for (int k = 0; k < N_PATH_SCALES; ++k) {
          const float scale = path_scales[k];
          memset(table, CANARY, sizeof table);
          for (int p = 0; p < 3; ++p)
            bad += tf_fp8_table_build((tf_dtype)d, scale, (tf_fp8_format)f, parts[p], parts[p + 1], table) != TF_OK;
          bad += !same_table_path(x, LEN, (tf_dtype)d, scale, (tf_fp8_format)f, table, y, y_ref);
          bad += !same_table_path(x_no_nan, LEN, (tf_dtype)d, scale, (tf_fp8_format)f, table, y, y_ref);
        }
    }
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(bad == 0, "table path against the scale path: %d differences", bad);

  /* Each path's table kernels against the portable ones: every short range, tails included. */
  isa_path paths[2];
  const int n = simd_paths(paths);
  for (int pi = 0; pi < n; ++pi) {
    int diff = 0;
    CHECK(tf_fp8_table_build(TF_FLOAT16, 0.75f, TF_FP8_E4M3, 0, TF_FP8_TABLE_ENTRIES, table) == TF_OK, "build");
    for (int d = TF_BFLOAT16; d <= TF_FLOAT16; ++d)
      for (int64_t begin = 0; begin < 9; ++begin)
        for (int64_t len = 0; begin + len <= 200; ++len) {
          memset(y, CANARY, 200 + PAD);
          memset(y_ref, CANARY, 200 + PAD);
          const uint32_t a = paths[pi].set->quantize_table[d - TF_BFLOAT16](x, begin, begin + len, table, y);
          const uint32_t a_ref =
              tf_fp8_kernels_portable.quantize_table[d - TF_BFLOAT16](x, begin, begin + len, table, y_ref);
          diff += a != a_ref || memcmp(y, y_ref, 200 + PAD) != 0;
        }
    CHECK(diff == 0, "%s: table kernels at short lengths: %d differences", paths[pi].name, diff);
  }

  uint32_t a = 0;
  CHECK(tf_set_cpu_isa_cap(TF_ISA_AVX2) == TF_OK, "set cap"); /* the avx512 tier takes no table */
  CHECK(tf_fp8_table_pays(TF_BFLOAT16, TF_FP8_TABLE_MIN_ELEMENTS) && tf_fp8_table_pays(TF_FLOAT16, INT64_MAX) &&
            !tf_fp8_table_pays(TF_FLOAT16, TF_FP8_TABLE_MIN_ELEMENTS - 1) && !tf_fp8_table_pays(TF_FLOAT32, INT64_MAX),
        "table_pays: 16-bit tensors from TF_FP8_TABLE_MIN_ELEMENTS elements");
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(tf_cpu_isa() < TF_ISA_AVX512 || !tf_fp8_table_pays(TF_BFLOAT16, INT64_MAX), "table_pays: not on avx512");
  CHECK(tf_fp8_table_build(TF_FLOAT32, 1.0f, TF_FP8_E4M3, 0, 1, table) == TF_ERR_BAD_DTYPE &&
            tf_fp8_table_build(TF_BFLOAT16, 1.0f, (tf_fp8_format)2, 0, 1, table) == TF_ERR_BAD_DTYPE &&
            tf_fp8_table_build(TF_BFLOAT16, 1.0f, TF_FP8_E4M3, -1, 1, table) == TF_ERR_BAD_SIZE &&
            tf_fp8_table_build(TF_BFLOAT16, 1.0f, TF_FP8_E4M3, 2, 1, table) == TF_ERR_BAD_SIZE &&
            tf_fp8_table_build(TF_BFLOAT16, 1.0f, TF_FP8_E4M3, 0, TF_FP8_TABLE_ENTRIES + 1, table) == TF_ERR_BAD_SIZE &&
            tf_fp8_table_build(TF_BFLOAT16, 1.0f, TF_FP8_E4M3, 0, 1, NULL) == TF_ERR_NULL_POINTER &&
            tf_fp8_table_build(TF_BFLOAT16, 1.0f, TF_FP8_E4M3, 5, 5, NULL) == TF_OK,
        "table_build checks");
  CHECK(tf_fp8_quantize_table(x, TF_FLOAT32, 0, 1, table, y, &a) == TF_ERR_BAD_DTYPE &&
            tf_fp8_quantize_table(x, TF_BFLOAT16, 0, 1, table, y, NULL) == TF_ERR_NULL_POINTER &&
            tf_fp8_quantize_table(x, TF_BFLOAT16, 0, 1, NULL, y, &a) == TF_ERR_NULL_POINTER &&
            tf_fp8_quantize_table(x, TF_BFLOAT16, 2, 1, table, y, &a) == TF_ERR_BAD_SIZE &&
            tf_fp8_quantize_table(NULL, TF_BFLOAT16, 0, 0, NULL, NULL, &a) == TF_OK && a == 0,
        "quantize_table checks");
}

static void test_isa_paths(void) {
  isa_path paths[2];
  const int n = simd_paths(paths);
  printf("instruction-set paths compared with the portable one: %d (%s%s%s)\n", n, n ? paths[0].name : "-",
         n > 1 ? ", " : "", n > 1 ? paths[1].name : "");
  for (int i = 0; i < n; ++i) {
    test_paths_every_16bit_value(&paths[i]);
    test_paths_random_f32_bits(&paths[i]);
    test_paths_lengths(&paths[i]);
    test_paths_amax_every_position(&paths[i]);
    test_paths_cast_transpose(&paths[i]);
    test_paths_f16_nan_payloads(&paths[i]);
    test_paths_lookups(&paths[i]);
  }
  test_public_api_under_cap();
  test_dequantize_under_cap();
  test_table_path();
}

/* ---- Scaling. ---- */

static void test_delayed_scaling(void) {
  /* history_len 3, two tensors, TransformerEngine's layout: row 0 the amax recorded since the last
   * update, rows 1.. the completed ones, oldest first. */
  float hist[6] = {3.0f, 0.0f, /* recorded: tensor 0 has 3, tensor 1 nothing */
                   1.0f, 4.0f, /* oldest completed */
                   8.0f, 2.0f};
  float scale[2] = {5.0f, 7.0f};
  float scale_inv[2];
  tf_status st = tf_fp8_delayed_scaling_update(hist, 3, 2, scale, scale_inv, 448.0f, 1, TF_AMAX_MAX);
  CHECK(st == TF_OK, "delayed update ok");
  /* tensor 0: max(3, 1, 8) = 8 -> 448 / 8 / 2 = 28, rows move up (1 drops out), 3 is the newest. */
  CHECK(hist[0] == 0.0f && hist[2] == 8.0f && hist[4] == 3.0f, "history of tensor 0 rolled");
  /* tensor 1 recorded nothing: its history and scale stay (TE skips such a tensor). */
  CHECK(hist[1] == 0.0f && hist[3] == 4.0f && hist[5] == 2.0f, "history of tensor 1 kept");
  CHECK(scale[0] == 28.0f && scale[1] == 7.0f, "delayed scales %g %g", scale[0], scale[1]);
  CHECK(scale_inv[0] == 1.0f / 28.0f && scale_inv[1] == 1.0f / 7.0f, "scale_inv");

  /* most_recent: only the recorded amax, whatever the older rows hold. */
  float h1[4] = {2.0f, 0.0f, 100.0f, 100.0f};
  float s1[2] = {1.0f, 3.0f}, si1[2];
  st = tf_fp8_delayed_scaling_update(h1, 2, 2, s1, si1, 448.0f, 0, TF_AMAX_MOST_RECENT);
  CHECK(st == TF_OK && s1[0] == 224.0f && s1[1] == 3.0f && si1[1] == 1.0f / 3.0f,
        "most_recent / nothing recorded keeps scale");
  CHECK(h1[0] == 0.0f && h1[2] == 2.0f && h1[1] == 0.0f && h1[3] == 100.0f, "most_recent history");

  /* history_len 1: the recorded amax alone, then row 0 is reset. */
  float h5[1] = {4.0f}, s5[1] = {1.0f}, si5[1];
  st = tf_fp8_delayed_scaling_update(h5, 1, 1, s5, si5, 448.0f, 0, TF_AMAX_MAX);
  CHECK(st == TF_OK && s5[0] == 112.0f && h5[0] == 0.0f, "history_len 1");

  /* Inf or NaN anywhere in the reduced window keeps the old scale. */
  float h2[4] = {1.0f, 1.0f, INFINITY, NAN};
  float s2[2] = {9.0f, 10.0f}, si2[2];
  st = tf_fp8_delayed_scaling_update(h2, 2, 2, s2, si2, 448.0f, 0, TF_AMAX_MAX);
  CHECK(st == TF_OK && s2[0] == 9.0f && s2[1] == 10.0f, "Inf/NaN history keeps the scale");
  float h3[1] = {NAN}, s3[1] = {2.0f}, si3[1];
  st = tf_fp8_delayed_scaling_update(h3, 1, 1, s3, si3, 448.0f, 0, TF_AMAX_MOST_RECENT);
  CHECK(st == TF_OK && s3[0] == 2.0f && h3[0] == 0.0f, "NaN amax keeps the scale");

  /* An amax so small that fp8_max / amax overflows: FLT_MAX, then divided by 2^margin. */
  float h4[1] = {0x1p-149f}, s4[1] = {1.0f}, si4[1];
  st = tf_fp8_delayed_scaling_update(h4, 1, 1, s4, si4, 448.0f, 2, TF_AMAX_MAX);
  CHECK(st == TF_OK && s4[0] == FLT_MAX / 4.0f, "overflowing scale clamps to FLT_MAX");
  CHECK(tf_fp8_delayed_scale(4.0f, 1.0f, 448.0f, -3) == 896.0f, "negative margin multiplies");

  /* Argument checks. */
  float one = 1.0f;
  CHECK(tf_fp8_delayed_scaling_update(&one, 0, 1, &one, &one, 448.0f, 0, TF_AMAX_MAX) == TF_ERR_BAD_SIZE,
        "history_len 0");
  CHECK(tf_fp8_delayed_scaling_update(&one, 1, -1, &one, &one, 448.0f, 0, TF_AMAX_MAX) == TF_ERR_BAD_SIZE,
        "negative num_scales");
  CHECK(tf_fp8_delayed_scaling_update(&one, INT64_MAX, 2, &one, &one, 448.0f, 0, TF_AMAX_MAX) ==
            TF_ERR_OVERFLOW, "history size overflows");
  CHECK(tf_fp8_delayed_scaling_update(&one, 1, 1, &one, &one, 448.0f, 127, TF_AMAX_MAX) ==
            TF_ERR_BAD_ARGUMENT, "margin 127");
  CHECK(tf_fp8_delayed_scaling_update(&one, 1, 1, &one, &one, NAN, 0, TF_AMAX_MAX) == TF_ERR_BAD_ARGUMENT,
        "NaN fp8_max");
  CHECK(tf_fp8_delayed_scaling_update(&one, 1, 1, &one, &one, 0.0f, 0, TF_AMAX_MAX) == TF_ERR_BAD_ARGUMENT,
        "zero fp8_max");
  CHECK(tf_fp8_delayed_scaling_update(&one, 1, 1, &one, &one, 448.0f, 0, (tf_amax_algo)2) ==
            TF_ERR_BAD_ARGUMENT, "unknown algo");
  CHECK(tf_fp8_delayed_scaling_update(&one, 1, 1, NULL, &one, 448.0f, 0, TF_AMAX_MAX) == TF_ERR_NULL_POINTER,
        "NULL scale");
  CHECK(tf_fp8_delayed_scaling_update(NULL, 1, 0, NULL, NULL, 448.0f, 0, TF_AMAX_MAX) == TF_OK, "no tensors");
}

static void test_current_scaling(void) {
  CHECK(tf_fp8_current_scale(0.0f, 448.0f, 0.0f, 0) == 1.0f, "amax 0 -> 1");
  CHECK(tf_fp8_current_scale(-0.0f, 448.0f, 0.0f, 0) == 1.0f, "amax -0 -> 1");
  CHECK(tf_fp8_current_scale(NAN, 448.0f, 0.0f, 0) == 1.0f, "amax NaN -> 1");
  CHECK(tf_fp8_current_scale(INFINITY, 448.0f, 0.0f, 0) == 1.0f, "amax Inf -> 1");
  CHECK(tf_fp8_current_scale(2.0f, 448.0f, 0.0f, 0) == 224.0f, "448 / 2");
  CHECK(tf_fp8_current_scale(3.0f, 448.0f, 0.0f, 0) == 448.0f / 3.0f, "448 / 3");
  CHECK(tf_fp8_current_scale(3.0f, 448.0f, 0.0f, 1) == 128.0f, "pow2 of 149.33 -> 128");
  CHECK(tf_fp8_current_scale(1e-6f, 448.0f, 1e-3f, 0) == 448.0f / 1e-3f, "epsilon floors amax");
  CHECK(tf_fp8_current_scale(0x1p-149f, 448.0f, 0.0f, 0) == FLT_MAX, "overflow -> FLT_MAX");
  CHECK(tf_fp8_current_scale(0x1p-149f, 448.0f, 0.0f, 1) == 0x1p127f, "pow2 of FLT_MAX");
  CHECK(tf_fp8_current_scale(0.75f, 57344.0f, 0.0f, 1) == 65536.0f, "pow2 rounds 76458.7 down to 65536");
}

/* The FP8 byte transpose against the definition: shapes with ragged 8 x 8, 16 x 16 and 64 x 64 edges, the
 * rows split into bands (each writes only its own bytes), and the size and pointer checks. */
static void test_fp8_transpose(void) {
  /* The AVX-512 path's whole panels are 128 rows by up to 4096 columns in blocks of 64: shapes with
   * whole and partial panels, blocks and tiles, under the portable cap (the SSE2 tiles) and without. */
  static const int64_t shapes[][2] = {{1, 1},    {8, 8},     {16, 16},  {17, 33},   {48, 80},  {64, 64},
                                       {67, 131}, {129, 200}, {130, 7},  {3, 200},   {0, 5},    {5, 0},
                                       {128, 64}, {256, 192}, {300, 100}, {257, 4200}, {384, 4096}};
  enum { MAX = 384 * 4200 };
  static uint8_t x[MAX], y[MAX + PAD];
  uint32_t state = 99u;
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); ++i) {
    const int64_t rows = shapes[i][0], cols = shapes[i][1];
    for (int64_t e = 0; e < rows * cols; ++e) x[e] = (uint8_t)((state = state * 1664525u + 1013904223u) >> 24);
    for (int capped = 0; capped < 2; ++capped) {
      CHECK(tf_set_cpu_isa_cap(capped ? TF_ISA_PORTABLE : -1) == TF_OK, "set cap");
      memset(y, 0xA5, sizeof y);
      /* two bands, split at a multiple of TF_FP8_TRANSPOSE_BAND where there are enough rows */
      const int64_t cut = rows > TF_FP8_TRANSPOSE_BAND ? TF_FP8_TRANSPOSE_BAND : rows;
      CHECK(tf_fp8_transpose(x, rows, cols, 0, cut, y) == TF_OK && tf_fp8_transpose(x, rows, cols, cut, rows, y) == TF_OK,
            "transpose %lld x %lld", (long long)rows, (long long)cols);
      int64_t bad = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) bad += y[c * rows + r] != x[r * cols + c];
      for (int64_t e = rows * cols; e < (int64_t)sizeof y; ++e) bad += y[e] != 0xA5; /* nothing past the end */
      CHECK(bad == 0, "transpose %lld x %lld%s: %lld bytes wrong", (long long)rows, (long long)cols,
            capped ? " (portable cap)" : "", (long long)bad);
    }
  }
  CHECK(tf_set_cpu_isa_cap(-1) == TF_OK, "cap removed");
  CHECK(tf_fp8_transpose(x, -1, 2, 0, 0, y) == TF_ERR_BAD_SIZE, "negative rows");
  CHECK(tf_fp8_transpose(x, 4, 4, 2, 5, y) == TF_ERR_BAD_SIZE, "band past the end");
  CHECK(tf_fp8_transpose(x, INT64_MAX / 2, 4, 0, 1, y) == TF_ERR_OVERFLOW, "rows * cols overflows");
  CHECK(tf_fp8_transpose(NULL, 4, 4, 0, 4, y) == TF_ERR_NULL_POINTER, "null x");
  CHECK(tf_fp8_transpose(NULL, 4, 4, 2, 2, NULL) == TF_OK, "an empty band needs no data");
}

int main(void) {
  test_decode_and_round_trip(&E4M3);
  test_decode_and_round_trip(&E5M2);
  test_encode_random(&E4M3);
  test_encode_random(&E5M2);
  test_encode_midpoints(&E4M3);
  test_encode_midpoints(&E5M2);
  test_encode_hand_points();
  test_saturation_and_nan();
  test_half_and_bfloat();
  test_cpu_nan_propagation();
  test_quantize_kernels();
  test_amax_special_values();
  test_cast_transpose();
  test_fp8_transpose();
  test_size_checks();
  test_isa_paths();
  test_delayed_scaling();
  test_current_scaling();
  return check_report();
}

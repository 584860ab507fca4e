/* Standalone test of csrc/gemm/block_scaled_gemm.c under ASan and UBSan, on every path this CPU has:
 * bit for bit against the FP8 GEMM run on each K block's columns with unit scales and combined here in
 * float32 in block order (the numerics block_scaled_gemm.h states), and on the portable path against
 * a plain k-order float32 sum; ragged last blocks, NaN/Inf codes and scales, strided scales, every
 * output dtype; tile ranges; bad arguments. Operands are allocated at their exact sizes, so a read
 * past a ragged block's end is an ASan error. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/cpu_features.h"
#include "common/tf_dtype.h"
#include "gemm/block_scaled_gemm.h"
#include "gemm/fp8_gemm.h"

static uint32_t rng_state = 2024u;
static uint32_t rnd(void) {
  rng_state ^= rng_state << 13, rng_state ^= rng_state >> 17, rng_state ^= rng_state << 5;
  return rng_state;
}

/* A code of moderate magnitude or, one in 64 when `specials`, a NaN, Inf or largest one. */
static uint8_t random_code(int specials) {
  const uint32_t r = rnd();
  return specials && (r % 64) == 0 ? (uint8_t)(0x7C | (r >> 24 & 0x83)) : (uint8_t)((r >> 8) & 0xB7);
}

/* One in 25 an edge value when `edges` (over thousands of blocks they would leave only NaN). */
static float random_scale(int edges) {
  static const float edge[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 0x1p-149f, 0x1p-127f, 3e38f, -1.5f};
  const uint32_t r = rnd();
  if (edges && r % 25 == 0) return edge[(r >> 8) % (sizeof(edge) / sizeof(edge[0]))];
  return ldexpf((r >> 8) % 2 ? 1.375f : 1.0f, (int)((r >> 12) % 28) - 20);
}

static float decode(uint8_t code, tf_fp8_format f) {
  return f == TF_FP8_E4M3 ? tf_fp8_e4m3_decode(code) : tf_fp8_e5m2_decode(code);
}

static uint32_t bits_of(const void *out, tf_dtype d, int64_t i) {
  return d == TF_FLOAT32 ? tf_f32_bits(((const float *)out)[i]) : ((const uint16_t *)out)[i];
}

static uint32_t round_to(float v, tf_dtype d) {
  return d == TF_FLOAT32 ? tf_f32_bits(v) : d == TF_BFLOAT16 ? tf_f32_to_bf16(v) : tf_f32_to_f16(v);
}

static int is_nan_bits(uint32_t u, tf_dtype d) {
  return d == TF_FLOAT32 ? (u & 0x7FFFFFFFu) > 0x7F800000u
                         : d == TF_BFLOAT16 ? (u & 0x7FFF) > 0x7F80 : (u & 0x7FFF) > 0x7C00;
}

typedef struct {
  int64_t m, n, k, block, blocks;
  uint8_t *a, *b;
  float *sa, *sb; /* sa row-major (m, blocks); sb stored transposed: (blocks, n) */
  tf_block_operand oa, ob;
  float *bias;
} problem;

static problem make_problem(int64_t m, int64_t n, int64_t k, int64_t block, tf_fp8_format fa, tf_fp8_format fb) {
  problem p = {m, n, k, block, tf_block_scaled_gemm_blocks(k, block), NULL, NULL, NULL, NULL, {0}, {0}, NULL};
  p.a = malloc((size_t)(m * k) + 1); /* + 1: malloc(0) may give NULL */
  p.b = malloc((size_t)(n * k) + 1);
  p.sa = malloc(sizeof(float) * (size_t)(m * p.blocks) + 1);
  p.sb = malloc(sizeof(float) * (size_t)(n * p.blocks) + 1);
  p.bias = malloc(sizeof(float) * (size_t)n + 1);
  for (int64_t i = 0; i < m * k; ++i) p.a[i] = random_code(k <= 300);
  for (int64_t i = 0; i < n * k; ++i) p.b[i] = random_code(k <= 300);
  for (int64_t i = 0; i < m * p.blocks; ++i) p.sa[i] = random_scale(k <= 300);
  for (int64_t i = 0; i < n * p.blocks; ++i) p.sb[i] = random_scale(k <= 300);
  for (int64_t j = 0; j < n; ++j) p.bias[j] = (float)((int)(rnd() % 200) - 100) * 0.125f;
  p.oa = (tf_block_operand){p.a, fa, p.sa, p.blocks, 1};
  p.ob = (tf_block_operand){p.b, fb, p.sb, 1, n};
  return p;
}

static void free_problem(problem *p) {
  free(p->a), free(p->b), free(p->sa), free(p->sb), free(p->bias);
}

/* The float32 totals (m x n) with each block's sum from the FP8 GEMM on that block's columns alone
 * (portable_sum: a plain k-order sum instead), combined one rounding at a time. */
static float *reference_totals(const problem *p, tf_isa isa, int portable_sum) {
  float *total = calloc((size_t)(p->m * p->n) + 1, sizeof(float));
  float *part = malloc(sizeof(float) * (size_t)(p->m * p->n) + 1);
  uint8_t *ab = malloc((size_t)(p->m * p->block) + 1), *bb = malloc((size_t)(p->n * p->block) + 1);
  for (int64_t kb = 0; kb < p->blocks; ++kb) {
    const int64_t k0 = kb * p->block, kc = p->k - k0 < p->block ? p->k - k0 : p->block;
    for (int64_t i = 0; i < p->m; ++i) memcpy(ab + i * kc, p->a + i * p->k + k0, (size_t)kc);
    for (int64_t j = 0; j < p->n; ++j) memcpy(bb + j * kc, p->b + j * p->k + k0, (size_t)kc);
    if (portable_sum) {
      for (int64_t i = 0; i < p->m; ++i)
        for (int64_t j = 0; j < p->n; ++j) {
          float s = 0.0f;
          for (int64_t q = 0; q < kc; ++q) {
            const float prod = decode(ab[i * kc + q], p->oa.format) * decode(bb[j * kc + q], p->ob.format);
            s += prod;
          }
          part[i * p->n + j] = s;
        }
    } else {
      CHECK(tf_fp8_gemm_nt(ab, p->oa.format, bb, p->ob.format, p->m, p->n, kc, 1.0f, 1.0f, NULL, TF_FLOAT32,
                           part, TF_FLOAT32, isa, 0, tf_fp8_gemm_tiles(p->m, p->n)) == TF_OK,
            "fp8 gemm of a block");
    }
    for (int64_t i = 0; i < p->m; ++i)
      for (int64_t j = 0; j < p->n; ++j) {
        const float scale = p->sa[i * p->blocks + kb] * p->sb[kb * p->n + j];
        const float scaled = part[i * p->n + j] * scale;
        total[i * p->n + j] += scaled;
      }
  }
  free(part), free(ab), free(bb);
  return total;
}

/* Compares out with round(total + bias); returns the number of differing values (NaN equals NaN). */
static int64_t count_differences(const problem *p, const float *total, const void *out, tf_dtype d, int with_bias) {
  int64_t bad = 0;
  for (int64_t i = 0; i < p->m; ++i)
    for (int64_t j = 0; j < p->n; ++j) {
      float v = total[i * p->n + j];
      if (with_bias) v += p->bias[j];
      const uint32_t want = round_to(v, d), got = bits_of(out, d, i * p->n + j);
      if (is_nan_bits(want, d) ? !is_nan_bits(got, d) : want != got) ++bad;
    }
  return bad;
}

static void test_paths(void) {
  /* (m, n, k, block): cut tiles, each recipe's block, ragged K (odd remainders for the pair paths),
   * K below a block, several tiles per call; a K whose packed blocks of a exceed the fused AVX512-BF16
   * kernel's 16 MiB (that tier then takes the per-block path, as AMX does) */
  static const int64_t shapes[][4] = {{197, 130, 96, 32}, {197, 130, 300, 32}, {70, 45, 300, 128},
                                      {33, 150, 37, 16},  {5, 7, 5, 16},        {1, 1, 1, 32},
                                      {300, 260, 75, 16}, {9, 3, 256, 256},     {4, 5, 0, 16},
                                      {3, 40, 44001, 16}};
  static const tf_dtype outs[] = {TF_FLOAT32, TF_BFLOAT16, TF_FLOAT16};
  for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); ++s) {
    const tf_fp8_format fa = (tf_fp8_format)(s & 1), fb = (tf_fp8_format)((s >> 1) & 1);
    problem p = make_problem(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], fa, fb);
    void *out = malloc(sizeof(float) * (size_t)(p.m * p.n) + 1);
    for (int isa = 0; isa <= (int)tf_cpu_isa_detected(); ++isa) {
      float *total = reference_totals(&p, (tf_isa)isa, 0);
      for (int o = 0; o < 3; ++o) {
        const int with_bias = (int)((s + (size_t)o) & 1);
        const tf_status st = tf_block_scaled_gemm_nt(&p.oa, &p.ob, p.m, p.n, p.k, p.block, with_bias ? p.bias : NULL,
                                                     TF_FLOAT32, out, outs[o], (tf_isa)isa, 0, tf_fp8_gemm_tiles(p.m, p.n));
        CHECK(st == TF_OK, "status %d", (int)st);
        const int64_t bad = count_differences(&p, total, out, outs[o], with_bias);
        CHECK(bad == 0, "isa %d shape %zu out %d: %lld values differ from the per-block FP8 GEMM", isa, s, o,
              (long long)bad);
      }
      free(total);
    }
    /* the portable path sums in k order: the plain sum, without the FP8 GEMM */
    float *plain = reference_totals(&p, TF_ISA_PORTABLE, 1);
    CHECK(tf_block_scaled_gemm_nt(&p.oa, &p.ob, p.m, p.n, p.k, p.block, NULL, TF_FLOAT32, out, TF_FLOAT32,
                                  TF_ISA_PORTABLE, 0, tf_fp8_gemm_tiles(p.m, p.n)) == TF_OK, "portable");
    CHECK(count_differences(&p, plain, out, TF_FLOAT32, 0) == 0, "shape %zu: portable differs from the k-order sum", s);
    free(plain);
    free(out);
    free_problem(&p);
  }
}

/* tf_nvfp4_gemm_nt on every path: E4M3 codes of E2M1 values, E4M3-valued scales (zero, subnormal and 448
 * among them; with nan_scale, one NaN), against each block's exact sum (double) times sa * sb, added into a
 * float32 total in block order, times alpha, plus the bias: the bits must not depend on the path. */
static void test_nvfp4(void) {
  static const uint8_t e2m1[16] = {0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C,
                                   0x80, 0xB0, 0xB8, 0xBC, 0xC0, 0xC4, 0xC8, 0xCC};
  static const int64_t shapes[][3] = {{197, 130, 96}, {33, 150, 48}, {300, 260, 80}, {5, 7, 16}, {3, 40, 44000}};
  static const tf_dtype outs[] = {TF_FLOAT32, TF_BFLOAT16, TF_FLOAT16};
  for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); ++s) {
    for (int nan_scale = 0; nan_scale < 2; ++nan_scale) {
      problem p = make_problem(shapes[s][0], shapes[s][1], shapes[s][2], TF_NVFP4_GEMM_BLOCK, TF_FP8_E4M3, TF_FP8_E4M3);
      for (int64_t i = 0; i < p.m * p.k; ++i) p.a[i] = e2m1[rnd() % 16];
      for (int64_t i = 0; i < p.n * p.k; ++i) p.b[i] = e2m1[rnd() % 16];
      for (int64_t i = 0; i < p.m * p.blocks; ++i) p.sa[i] = tf_fp8_e4m3_decode((uint8_t)(rnd() % 127));
      for (int64_t i = 0; i < p.n * p.blocks; ++i) p.sb[i] = tf_fp8_e4m3_decode((uint8_t)(rnd() % 127));
      p.sa[0] = 0.0f, p.sb[0] = 448.0f, p.sa[p.m * p.blocks - 1] = 0x1p-9f;
      if (nan_scale) p.sb[p.n * p.blocks - 1] = NAN;
      const float alpha = ldexpf(1.0f + (float)(rnd() % 1000) / 1000.0f, (int)(rnd() % 30) - 25);
      float *want = malloc(sizeof(float) * (size_t)(p.m * p.n) + 1);
      for (int64_t i = 0; i < p.m; ++i)
        for (int64_t j = 0; j < p.n; ++j) {
          float total = 0.0f;
          for (int64_t kb = 0; kb < p.blocks; ++kb) {
            double sum = 0.0;
            for (int64_t q = kb * p.block; q < (kb + 1) * p.block; ++q)
              sum += (double)tf_fp8_e4m3_decode(p.a[i * p.k + q]) * (double)tf_fp8_e4m3_decode(p.b[j * p.k + q]);
            total += (float)(sum * (double)p.sa[i * p.blocks + kb] * (double)p.sb[kb * p.n + j]);
          }
          want[i * p.n + j] = total * alpha;
        }
      void *out = malloc(sizeof(float) * (size_t)(p.m * p.n) + 1);
      for (int isa = 0; isa <= (int)tf_cpu_isa_detected(); ++isa)
        for (int o = 0; o < 3; ++o) {
          const int with_bias = (int)((s + (size_t)o) & 1);
          const tf_status st = tf_nvfp4_gemm_nt(&p.oa, &p.ob, p.m, p.n, p.k, alpha, with_bias ? p.bias : NULL,
                                                TF_FLOAT32, out, outs[o], (tf_isa)isa, 0, tf_fp8_gemm_tiles(p.m, p.n));
          CHECK(st == TF_OK, "status %d", (int)st);
          const int64_t bad = count_differences(&p, want, out, outs[o], with_bias);
          CHECK(bad == 0, "nvfp4 isa %d shape %zu nan %d out %d: %lld values differ", isa, s, nan_scale, o,
                (long long)bad);
        }
      free(out), free(want);
      free_problem(&p);
    }
  }
  uint8_t a[16] = {0}, b[16] = {0};
  float one = 1.0f, out[1];
  const tf_block_operand oa = {a, TF_FP8_E4M3, &one, 1, 1}, ob = {b, TF_FP8_E5M2, &one, 1, 1};
  CHECK(tf_nvfp4_gemm_nt(&oa, &ob, 1, 1, 16, 1.0f, NULL, TF_FLOAT32, out, TF_FLOAT32, TF_ISA_PORTABLE, 0, 1) ==
            TF_ERR_BAD_DTYPE, "nvfp4: an E5M2 operand");
  CHECK(tf_nvfp4_gemm_nt(&oa, NULL, 1, 1, 16, 1.0f, NULL, TF_FLOAT32, out, TF_FLOAT32, TF_ISA_PORTABLE, 0, 1) ==
            TF_ERR_NULL_POINTER, "nvfp4: no b");
}

/* Any split of the tiles gives the bits of one call (each tile packs and sums alone). */
static void test_tile_ranges(void) {
  problem p = make_problem(500, 300, 100, 32, TF_FP8_E4M3, TF_FP8_E5M2);
  const int64_t tiles = tf_fp8_gemm_tiles(p.m, p.n);
  float *one = malloc(sizeof(float) * (size_t)(p.m * p.n)), *split = malloc(sizeof(float) * (size_t)(p.m * p.n));
  const tf_isa isa = tf_cpu_isa_detected();
  CHECK(tf_block_scaled_gemm_nt(&p.oa, &p.ob, p.m, p.n, p.k, p.block, p.bias, TF_FLOAT32, one, TF_FLOAT32, isa, 0,
                                tiles) == TF_OK, "whole");
  for (int64_t t = 0; t < tiles; t += 2) {
    const int64_t e = t + 2 < tiles ? t + 2 : tiles;
    CHECK(tf_block_scaled_gemm_nt(&p.oa, &p.ob, p.m, p.n, p.k, p.block, p.bias, TF_FLOAT32, split, TF_FLOAT32, isa,
                                  t, e) == TF_OK, "tiles %lld..%lld", (long long)t, (long long)e);
  }
  CHECK(memcmp(one, split, sizeof(float) * (size_t)(p.m * p.n)) == 0, "split tiles differ");
  free(one), free(split);
  free_problem(&p);
}

static void test_bad_arguments(void) {
  uint8_t a[8] = {0}, b[8] = {0};
  float sa[4] = {1, 1, 1, 1}, sb[4] = {1, 1, 1, 1}, out[4];
  const tf_block_operand oa = {a, TF_FP8_E4M3, sa, 2, 1}, ob = {b, TF_FP8_E4M3, sb, 2, 1};
  const tf_isa isa = TF_ISA_PORTABLE;
#define RUN(A, B, M, N, K, BLOCK, OUT, BEGIN, END) \
  tf_block_scaled_gemm_nt(A, B, M, N, K, BLOCK, NULL, TF_FLOAT32, OUT, TF_FLOAT32, isa, BEGIN, END)
  CHECK(RUN(&oa, &ob, 2, 2, 4, 2, out, 0, 1) == TF_OK, "valid");
  CHECK(RUN(&oa, &ob, -1, 2, 4, 2, out, 0, 0) == TF_ERR_BAD_SIZE, "m<0");
  CHECK(RUN(&oa, &ob, 2, 2, -4, 2, out, 0, 1) == TF_ERR_BAD_SIZE, "k<0");
  CHECK(RUN(&oa, &ob, 2, 2, 4, 0, out, 0, 1) == TF_ERR_BAD_ARGUMENT, "block 0");
  CHECK(RUN(&oa, &ob, 2, 2, 4, TF_GEMM_KC + 1, out, 0, 1) == TF_ERR_BAD_ARGUMENT, "block above KC");
  CHECK(RUN(&oa, &ob, INT64_MAX / 2, 2, 4, 2, out, 0, 1) == TF_ERR_OVERFLOW, "m*k");
  CHECK(RUN(&oa, &ob, 2, 2, 4, 2, out, 0, 2) == TF_ERR_BAD_SIZE, "tile range");
  CHECK(RUN(NULL, &ob, 2, 2, 4, 2, out, 0, 1) == TF_ERR_NULL_POINTER, "operand a");
  CHECK(RUN(&oa, &ob, 2, 2, 4, 2, NULL, 0, 1) == TF_ERR_NULL_POINTER, "out");
  tf_block_operand bad = oa;
  bad.scales = NULL;
  CHECK(RUN(&bad, &ob, 2, 2, 4, 2, out, 0, 1) == TF_ERR_NULL_POINTER, "scales");
  bad = ob;
  bad.codes = NULL;
  CHECK(RUN(&oa, &bad, 2, 2, 4, 2, out, 0, 1) == TF_ERR_NULL_POINTER, "codes");
  bad = oa;
  bad.scale_block_stride = -1;
  CHECK(RUN(&bad, &ob, 2, 2, 4, 2, out, 0, 1) == TF_ERR_BAD_SIZE, "negative stride");
  bad.scale_block_stride = INT64_MAX / 2 + 1; /* each index fits; their sum does not */
  bad.scale_row_stride = INT64_MAX / 2 + 1;
  CHECK(RUN(&bad, &ob, 2, 2, 4, 2, out, 0, 1) == TF_ERR_OVERFLOW, "scale index overflow");
  bad = oa;
  bad.format = (tf_fp8_format)2;
  CHECK(RUN(&bad, &ob, 2, 2, 4, 2, out, 0, 1) == TF_ERR_BAD_DTYPE, "format");
  CHECK(tf_block_scaled_gemm_nt(&oa, &ob, 2, 2, 4, 2, NULL, TF_FLOAT32, out, (tf_dtype)7, isa, 0, 1) ==
            TF_ERR_BAD_DTYPE, "out dtype");
  CHECK(tf_block_scaled_gemm_nt(&oa, &ob, 2, 2, 4, 2, NULL, TF_FLOAT32, out, TF_FLOAT32, (tf_isa)TF_ISA_COUNT, 0,
                                1) == TF_ERR_BAD_ARGUMENT, "isa beyond the enum");
  CHECK(tf_block_scaled_gemm_blocks(33, 16) == 3 && tf_block_scaled_gemm_blocks(32, 16) == 2 &&
            tf_block_scaled_gemm_blocks(0, 16) == 0 && tf_block_scaled_gemm_blocks(4, 0) == -1,
        "block counts");
#undef RUN
}

int main(void) {
  test_paths();
  test_tile_ranges();
  test_nvfp4();
  test_bad_arguments();
  return check_report();
}

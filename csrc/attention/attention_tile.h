/*
 * Register-blocked tile kernels of the CPU attention: a small GEMM and the
 * row operations of the softmax, on 16-float vectors (GCC vector extensions,
 * which the compiler maps to whatever vector ISA the calling function is
 * built for -- see TF_ATTN_VECTOR_CLONES).
 *
 * Everything is always_inline so it is compiled inside the unit functions
 * built per ISA (TF_ATTN_VECTOR_CLONES).
 */
#ifndef TF_ATTENTION_TILE_H
#define TF_ATTENTION_TILE_H

#include <stdint.h>
#include <string.h>

#include "../common/cpu_features.h"

#define TF_ATTN_INLINE static inline __attribute__((always_inline))

/*
 * One build of a unit function per x86-64 level, chosen at each call by the
 * CPU's tier capped by the user's override (cpu_features.h: tf_cpu_isa), so
 * te_fuser.kernels.cpu.set_isa selects the vector path too. NAME##_body is
 * the always_inline body; TF_ATTN_VECTOR_CLONES(NAME, (params), (args))
 * defines NAME, which calls the x86-64-v4 build for the AVX512 tiers and
 * above, the x86-64-v3 build for AVX2, and the baseline one otherwise.
 */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TF_ATTN_VECTOR_CLONES(NAME, PARAMS, ARGS)                              \
  __attribute__((target("arch=x86-64-v4"))) static void NAME##_v4 PARAMS {     \
    NAME##_body ARGS;                                                          \
  }                                                                            \
  __attribute__((target("arch=x86-64-v3"))) static void NAME##_v3 PARAMS {     \
    NAME##_body ARGS;                                                          \
  }                                                                            \
  static void NAME##_base PARAMS { NAME##_body ARGS; }                         \
  static void NAME PARAMS {                                                    \
    const tf_isa isa_ = tf_cpu_isa();                                          \
    if (isa_ >= TF_ISA_AVX512)                                                 \
      NAME##_v4 ARGS;                                                          \
    else if (isa_ >= TF_ISA_AVX2)                                              \
      NAME##_v3 ARGS;                                                          \
    else                                                                       \
      NAME##_base ARGS;                                                        \
  }
#else
#define TF_ATTN_VECTOR_CLONES(NAME, PARAMS, ARGS) \
  static void NAME PARAMS { NAME##_body ARGS; }
#endif

/*
 * The vector helpers are always inlined, so no vector crosses a real call
 * boundary and the ABI note GCC gives for 64-byte vectors does not apply;
 * it stays off for the rest of the including file, where the calls are.
 */
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float tf_v16 __attribute__((vector_size(64)));
typedef uint32_t tf_v16u __attribute__((vector_size(64)));
typedef int32_t tf_v16i __attribute__((vector_size(64)));

TF_ATTN_INLINE tf_v16 tf_v16_load(const float *p) {
  tf_v16 v;
  memcpy(&v, p, sizeof v);
  return v;
}

TF_ATTN_INLINE void tf_v16_store(float *p, tf_v16 v) { memcpy(p, &v, sizeof v); }

TF_ATTN_INLINE tf_v16 tf_v16_splat(float x) {
  const tf_v16 zero = {0};
  return zero + x;
}

/* Lanes of a where mask is all-ones, of b elsewhere. */
TF_ATTN_INLINE tf_v16 tf_v16_select(tf_v16i mask, tf_v16 a, tf_v16 b) {
  const tf_v16u m = (tf_v16u)mask;
  return (tf_v16)(((tf_v16u)a & m) | ((tf_v16u)b & ~m));
}

TF_ATTN_INLINE tf_v16 tf_v16_max(tf_v16 a, tf_v16 b) { return tf_v16_select(a > b, a, b); }

/*
 * 2^x for x <= 0 (small positive x is fine too), relative error about 1e-7;
 * x <= -127 (including -inf and NaN) gives exactly 0. Round-to-nearest splits
 * x into an integer r and f in [-0.5, 0.5]; a degree-7 Taylor polynomial gives
 * 2^f, and 2^r is built in the exponent bits (r = -127 builds +0). Adding
 * 1.5 * 2^23 rounds x and leaves r + 2^22 in the low mantissa bits of the sum,
 * which the exponent is built from directly (no float-to-int conversion).
 */
TF_ATTN_INLINE tf_v16 tf_v16_exp2(tf_v16 x) {
  const tf_v16 xc = tf_v16_max(x, tf_v16_splat(-127.0f));
  const tf_v16 shifted = xc + 12582912.0f;
  const tf_v16 r = shifted - 12582912.0f;
  const tf_v16 f = xc - r;
  tf_v16 poly = f * 1.525273380405984e-05f + 1.5403530393381606e-04f;
  poly = poly * f + 1.3333558146428443e-03f;
  poly = poly * f + 9.618129107628477e-03f;
  poly = poly * f + 5.550410866482158e-02f;
  poly = poly * f + 2.402265069591007e-01f;
  poly = poly * f + 6.931471805599453e-01f;
  poly = poly * f + 1.0f;
  /* The shift keeps the low 9 bits of (r + 2^22) + 127, which are r + 127 (2^22 is a multiple of 2^9). */
  const tf_v16u bits = ((tf_v16u)shifted + 127u) << 23;
  return poly * (tf_v16)bits;
}

/*
 * C[M x N] (row stride ldc) = (accumulate ? C : 0) + A B, where A[r][k] is
 * A[r * a_rs + k * a_cs] and B is K x N with row stride ldb. M must be a
 * multiple of TF_ATTN_GEMM_ROWS and N of 16; the K loop keeps a
 * TF_ATTN_GEMM_ROWS x 32 block of C in registers (x 16 for a last odd 16 columns).
 */
#define TF_ATTN_GEMM_ROWS 8

#define TF_ATTN_GEMM_BLOCK(COLS)                                                     \
  do {                                                                               \
    tf_v16 x[TF_ATTN_GEMM_ROWS][COLS];                                               \
    for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)                                      \
      for (int c = 0; c < COLS; ++c)                                                 \
        x[i][c] = accumulate ? tf_v16_load(C + (r + i) * ldc + n + 16 * c)           \
                             : tf_v16_splat(0.0f);                                   \
    for (int64_t kk = 0; kk < K; ++kk) {                                             \
      tf_v16 b[COLS];                                                                \
      for (int c = 0; c < COLS; ++c) b[c] = tf_v16_load(B + kk * ldb + n + 16 * c);  \
      for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i) {                                  \
        const float a = A[(r + i) * a_rs + kk * a_cs];                               \
        for (int c = 0; c < COLS; ++c) x[i][c] += a * b[c];                          \
      }                                                                              \
    }                                                                                \
    for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)                                      \
      for (int c = 0; c < COLS; ++c) tf_v16_store(C + (r + i) * ldc + n + 16 * c, x[i][c]); \
  } while (0)

TF_ATTN_INLINE void tf_attn_gemm(float *restrict C, int64_t ldc, const float *restrict A,
                                 int64_t a_rs, int64_t a_cs, const float *restrict B, int64_t ldb,
                                 int64_t M, int64_t N, int64_t K, int accumulate) {
  for (int64_t r = 0; r < M; r += TF_ATTN_GEMM_ROWS) {
    int64_t n = 0;
    for (; n + 32 <= N; n += 32) TF_ATTN_GEMM_BLOCK(2);
    if (n < N) TF_ATTN_GEMM_BLOCK(1);
  }
}

/* Sets s[j] = -inf for j in [limit, TF_ATTN_BLOCK_K) (limit may be <= 0). */
TF_ATTN_INLINE void tf_attn_mask_tail(float *s, int64_t limit, int64_t width) {
  for (int64_t j = limit < 0 ? 0 : limit; j < width; ++j) s[j] = -__builtin_inff();
}

#endif /* TF_ATTENTION_TILE_H */

/*
 * Register-blocked tile kernels of the CPU attention: a small GEMM and the
 * row operations of the softmax, on vectors of TF_ATTN_VW floats (GCC vector
 * extensions, which the compiler maps to whatever vector ISA the calling
 * function is built for -- see TF_ATTN_VECTOR_CLONES).
 *
 * The width is a parameter of the including file, set before the first
 * include: 16 floats (64-byte vectors, the default) for the x86-64-v4 and
 * baseline builds, 8 (32-byte) for the AVX2 build. x86-64-v3 has no register
 * for a 64-byte vector, so under it GCC keeps every 16-float value in memory;
 * with 8-float vectors and a register block of at most 12 accumulators (16
 * ymm registers) the block stays in registers.
 *
 * Everything is always_inline so it is compiled inside the unit functions
 * built per ISA (TF_ATTN_VECTOR_CLONES).
 */
#ifndef TF_ATTENTION_TILE_H
#define TF_ATTENTION_TILE_H

#include <stdint.h>
#include <string.h>

#include "../common/cpu_features.h"
#include "../common/tf_isa_clones.h"

#ifndef TF_ATTN_VW
#define TF_ATTN_VW 16
#endif
#if TF_ATTN_VW != 16 && TF_ATTN_VW != 8
#error "TF_ATTN_VW must be 16 or 8"
#endif

/* GCC on x86-64 builds the vector path once per x86-64 level (TF_ATTN_VECTOR_CLONES). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TF_ATTN_X86_CLONES 1
#else
#define TF_ATTN_X86_CLONES 0
#endif

/*
 * The AVX2 build's helpers are compiled for its target, x86-64-v3, so that
 * they may name its instructions (tf_vf_max); they are inlined only there.
 */
#if TF_ATTN_VW == 8 && TF_ATTN_X86_CLONES
#define TF_ATTN_INLINE static inline __attribute__((always_inline, target("arch=x86-64-v3")))
#else
#define TF_ATTN_INLINE static inline __attribute__((always_inline))
#endif

/*
 * One build of a unit function per x86-64 level, chosen at each call by the
 * CPU's tier capped by the user's override (cpu_features.h: tf_cpu_isa), so
 * te_fuser.kernels.cpu.set_isa selects the vector path too. NAME##_body is
 * the always_inline body. In a file with 16-float vectors,
 * TF_ATTN_VECTOR_CLONES(NAME, (params), (args)) defines NAME, which calls the
 * x86-64-v4 build for the AVX512 tiers and above, tf_attn_NAME_avx2 for AVX2,
 * and the baseline build otherwise; TF_ATTN_AVX2_BUILD defines
 * tf_attn_NAME_avx2, the x86-64-v3 build, in the same body's file with
 * 8-float vectors (attention_*_avx2.c).
 */
#if TF_ATTN_X86_CLONES
#define TF_ATTN_VECTOR_CLONES(NAME, PARAMS, ARGS)                              \
  void tf_attn_##NAME##_avx2 PARAMS;                                           \
  __attribute__((target("arch=x86-64-v4"))) static void NAME##_v4 PARAMS {     \
    NAME##_body ARGS;                                                          \
  }                                                                            \
  static void NAME##_base PARAMS { NAME##_body ARGS; }                         \
  TF_ISA_DISPATCH(NAME, PARAMS, ARGS, NAME##_v4, tf_attn_##NAME##_avx2, NAME##_base)
#define TF_ATTN_AVX2_BUILD(NAME, PARAMS, ARGS)                                 \
  void tf_attn_##NAME##_avx2 PARAMS;                                           \
  __attribute__((target("arch=x86-64-v3"))) void tf_attn_##NAME##_avx2 PARAMS { \
    NAME##_body ARGS;                                                          \
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

typedef float tf_vf __attribute__((vector_size(4 * TF_ATTN_VW)));
typedef uint32_t tf_vfu __attribute__((vector_size(4 * TF_ATTN_VW)));
typedef int32_t tf_vfi __attribute__((vector_size(4 * TF_ATTN_VW)));

TF_ATTN_INLINE tf_vf tf_vf_load(const float *p) {
  tf_vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

TF_ATTN_INLINE void tf_vf_store(float *p, tf_vf v) { memcpy(p, &v, sizeof v); }

TF_ATTN_INLINE tf_vf tf_vf_splat(float x) {
  const tf_vf zero = {0};
  return zero + x;
}

/* Lanes of a where mask is all-ones, of b elsewhere. */
TF_ATTN_INLINE tf_vf tf_vf_select(tf_vfi mask, tf_vf a, tf_vf b) {
  const tf_vfu m = (tf_vfu)mask;
  return (tf_vf)(((tf_vfu)a & m) | ((tf_vfu)b & ~m));
}

/*
 * a > b ? a : b per lane. With 8-float vectors on x86 (the AVX2 build) that
 * is exactly what vmaxps computes (b where either is NaN, and for two zeros),
 * which is asked for by name: GCC builds the select from a compare and three
 * logic operations there.
 */
#if TF_ATTN_VW == 8 && TF_ATTN_X86_CLONES
TF_ATTN_INLINE tf_vf tf_vf_max(tf_vf a, tf_vf b) {
  return __builtin_ia32_maxps256(a, b);
}
#else
TF_ATTN_INLINE tf_vf tf_vf_max(tf_vf a, tf_vf b) { return tf_vf_select(a > b, a, b); }
#endif

#define TF_ATTN_UNROLL _Pragma("GCC unroll 8")
#define TF_ATTN_EXP2_MAX_N 4

/*
 * 2^x of n vectors (a constant, at most TF_ATTN_EXP2_MAX_N) in place, for
 * x <= 0 (small positive x is fine too), relative error below 3e-7
 * (tests/c/test_attention_core.c measures 2.3e-7: two float32 ulps);
 * x <= -127 (including -inf) gives exactly 0 and NaN stays NaN (the clamp
 * is written so that vmaxps returns x for NaN). Round-to-nearest splits x
 * into an integer r and f in [-0.5, 0.5]; a degree-5 polynomial fitted for
 * the least maximum relative error (7.5e-8; a degree-6 fit measures 8.5e-8 in
 * all, but costs 2% of the forward) gives 2^f, and 2^r is built in
 * the exponent bits (r = -127 builds +0). Adding 1.5 * 2^23 rounds x and
 * leaves r + 2^22 in the low mantissa bits of the sum, which the exponent is
 * built from directly (no float-to-int conversion). Each step runs across all
 * n vectors before the next, so that independent operations stand next to
 * each other for the scheduler (one chain is about 40 cycles of latency).
 */
TF_ATTN_INLINE void tf_vf_exp2_n(tf_vf *x, const int n) {
  tf_vf shifted[TF_ATTN_EXP2_MAX_N], f[TF_ATTN_EXP2_MAX_N], poly[TF_ATTN_EXP2_MAX_N];
  TF_ATTN_UNROLL for (int i = 0; i < n; ++i) {
    const tf_vf xc = tf_vf_max(tf_vf_splat(-127.0f), x[i]);
    shifted[i] = xc + 12582912.0f;
    f[i] = xc - (shifted[i] - 12582912.0f);
  }
  TF_ATTN_UNROLL for (int i = 0; i < n; ++i) poly[i] = f[i] * 1.3276470424276737e-03f + 9.675541618467592e-03f;
  TF_ATTN_UNROLL for (int i = 0; i < n; ++i) poly[i] = poly[i] * f[i] + 5.55071328092508e-02f;
  TF_ATTN_UNROLL for (int i = 0; i < n; ++i) poly[i] = poly[i] * f[i] + 2.4022119718702328e-01f;
  TF_ATTN_UNROLL for (int i = 0; i < n; ++i) poly[i] = poly[i] * f[i] + 6.931469670586026e-01f;
  TF_ATTN_UNROLL for (int i = 0; i < n; ++i) poly[i] = poly[i] * f[i] + 1.0000000716556787f;
  /* The shift keeps the low 9 bits of (r + 2^22) + 127, which are r + 127 (2^22 is a multiple of 2^9). */
  TF_ATTN_UNROLL for (int i = 0; i < n; ++i) x[i] = poly[i] * (tf_vf)(((tf_vfu)shifted[i] + 127u) << 23);
}

TF_ATTN_INLINE tf_vf tf_vf_exp2(tf_vf x) {
  tf_vf_exp2_n(&x, 1);
  return x;
}

/*
 * The register block of the tile products: TF_ATTN_GEMM_ROWS rows by two
 * vectors, 8 x 32 floats with 16-float vectors (16 zmm accumulators) and
 * 4 x 16 with 8-float ones (8 ymm accumulators, leaving registers for the
 * two B vectors and the broadcast A value). The loops over the block are
 * unrolled whole, so the accumulators are registers and not an array.
 */
#define TF_ATTN_GEMM_ROWS (TF_ATTN_VW == 16 ? 8 : 4)

/*
 * C[M x N] (row stride ldc) = (accumulate ? C : 0) + A B, where A[r][k] is
 * A[r * a_rs + k * a_cs] and B is K x N with row stride ldb. M must be a
 * multiple of TF_ATTN_GEMM_ROWS and N of TF_ATTN_VW; the K loop keeps a
 * TF_ATTN_GEMM_ROWS x 2 vector block of C in registers (x 1 for a last odd vector).
 */
#define TF_ATTN_GEMM_BLOCK(COLS)                                                          \
  do {                                                                                    \
    tf_vf x[TF_ATTN_GEMM_ROWS][COLS];                                                     \
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)                            \
      TF_ATTN_UNROLL for (int c = 0; c < COLS; ++c)                                       \
        x[i][c] = accumulate ? tf_vf_load(C + (r + i) * ldc + n + TF_ATTN_VW * c)         \
                             : tf_vf_splat(0.0f);                                         \
    for (int64_t kk = 0; kk < K; ++kk) {                                                  \
      tf_vf b[COLS];                                                                      \
      TF_ATTN_UNROLL for (int c = 0; c < COLS; ++c)                                       \
        b[c] = tf_vf_load(B + kk * ldb + n + TF_ATTN_VW * c);                             \
      TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i) {                        \
        const float a = A[(r + i) * a_rs + kk * a_cs];                                    \
        TF_ATTN_UNROLL for (int c = 0; c < COLS; ++c) x[i][c] += a * b[c];                \
      }                                                                                   \
    }                                                                                     \
    TF_ATTN_UNROLL for (int i = 0; i < TF_ATTN_GEMM_ROWS; ++i)                            \
      TF_ATTN_UNROLL for (int c = 0; c < COLS; ++c)                                       \
        tf_vf_store(C + (r + i) * ldc + n + TF_ATTN_VW * c, x[i][c]);                     \
  } while (0)

TF_ATTN_INLINE void tf_attn_gemm(float *restrict C, int64_t ldc, const float *restrict A,
                                 int64_t a_rs, int64_t a_cs, const float *restrict B, int64_t ldb,
                                 int64_t M, int64_t N, int64_t K, int accumulate) {
  for (int64_t r = 0; r < M; r += TF_ATTN_GEMM_ROWS) {
    int64_t n = 0;
    for (; n + 2 * TF_ATTN_VW <= N; n += 2 * TF_ATTN_VW) TF_ATTN_GEMM_BLOCK(2);
    if (n < N) TF_ATTN_GEMM_BLOCK(1);
  }
}

/* Sets s[j] = -inf for j in [limit, TF_ATTN_BLOCK_K) (limit may be <= 0). */
TF_ATTN_INLINE void tf_attn_mask_tail(float *s, int64_t limit, int64_t width) {
  for (int64_t j = limit < 0 ? 0 : limit; j < width; ++j) s[j] = -__builtin_inff();
}

#endif /* TF_ATTENTION_TILE_H */

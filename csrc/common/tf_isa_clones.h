/*
 * One build of a loop function per x86-64 level -- baseline, x86-64-v3 (AVX2) and x86-64-v4
 * (AVX-512) -- chosen at each call by tf_cpu_isa(), so te_fuser.kernels.cpu.set_isa selects it
 * too. The loops are plain C that GCC vectorizes at each level's width.
 *
 * The builds give the same bits: elementwise float math does not depend on the vector width
 * (the library is compiled as ISO C, so GCC does not contract a * b + c into an FMA), and a loop
 * that reduces keeps its order fixed by summing into TF_ISA_LANES partial sums, combined in order.
 *
 * TF_ISA_CLONES(NAME, (params), (args)) defines `static void NAME(params)` from the
 * TF_ISA_INLINE function NAME##_body(params). Helpers the body calls are TF_ISA_INLINE too, so each
 * build inlines them and compiles them for its own level.
 */
#ifndef TF_ISA_CLONES_H
#define TF_ISA_CLONES_H

#include "cpu_features.h"

#define TF_ISA_INLINE static inline __attribute__((always_inline))

/* Partial sums of a reduction: one 64-byte vector of floats. */
#define TF_ISA_LANES 16

/*
 * `static void NAME(params)` calling V4, V3 or BASE (functions of the same parameters) by the tier:
 * AVX512 and above, AVX2, below.
 */
#define TF_ISA_DISPATCH(NAME, PARAMS, ARGS, V4, V3, BASE) \
  static void NAME PARAMS {                               \
    const tf_isa isa_ = tf_cpu_isa();                     \
    if (isa_ >= TF_ISA_AVX512)                            \
      V4 ARGS;                                            \
    else if (isa_ >= TF_ISA_AVX2)                         \
      V3 ARGS;                                            \
    else                                                  \
      BASE ARGS;                                          \
  }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TF_ISA_CLONES(NAME, PARAMS, ARGS)                                  \
  __attribute__((target("arch=x86-64-v4"))) static void NAME##_v4 PARAMS { \
    NAME##_body ARGS;                                                      \
  }                                                                        \
  __attribute__((target("arch=x86-64-v3"))) static void NAME##_v3 PARAMS { \
    NAME##_body ARGS;                                                      \
  }                                                                        \
  static void NAME##_base PARAMS { NAME##_body ARGS; }                     \
  TF_ISA_DISPATCH(NAME, PARAMS, ARGS, NAME##_v4, NAME##_v3, NAME##_base)
#else
#define TF_ISA_CLONES(NAME, PARAMS, ARGS) \
  static void NAME PARAMS { NAME##_body ARGS; }
#endif

#endif /* TF_ISA_CLONES_H */

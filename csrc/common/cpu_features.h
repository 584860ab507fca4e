/* The CPU's instruction-set tiers, detected once at run time, and a cap that tests and users set
 * to force a lower tier (te_fuser.kernels.cpu.set_isa, or TE_FUSER_CPU_ISA at import).
 *
 * Kernels for a tier above the build's baseline are compiled with GCC function attributes
 * (TF_TARGET_* below), so the library loads on any x86-64 and on other architectures, where only
 * TF_ISA_PORTABLE exists. A kernel asks tf_cpu_isa() each call and takes the best path it has at
 * or below the answer. */
#ifndef TF_CPU_FEATURES_H
#define TF_CPU_FEATURES_H

#include "tf_status.h"

typedef enum tf_isa {
  TF_ISA_PORTABLE = 0,    /* plain C (the compiler's baseline vectors) */
  TF_ISA_AVX2 = 1,        /* AVX2 + FMA + F16C */
  TF_ISA_AVX512 = 2,      /* AVX512 F + BW + VL (+ the AVX2 tier) */
  TF_ISA_AVX512_BF16 = 3, /* + AVX512_BF16 (vdpbf16ps, vcvtne2ps2bf16) */
  TF_ISA_AMX = 4          /* + AMX-TILE and AMX-BF16, with the kernel's permission to use tile data */
} tf_isa;

#define TF_ISA_COUNT 5

/* The best tier this CPU (and OS) supports, without the cap. Detected once, thread-safe. */
tf_isa tf_cpu_isa_detected(void);

/* The tier kernels should use: min(detected, cap). */
tf_isa tf_cpu_isa(void);

/* Caps the tier at `cap` (0..TF_ISA_COUNT-1), or removes the cap when cap is -1.
 * TF_ERR_BAD_ARGUMENT for anything else. A cap above the detected tier is allowed and changes
 * nothing. */
tf_status tf_set_cpu_isa_cap(int cap);

/* The current cap (-1 when none). */
int tf_cpu_isa_cap(void);

/* "portable", "avx2", "avx512", "avx512_bf16", "amx"; NULL outside the enum. */
const char *tf_isa_name(int isa);

/* The tiered kernels need a compiler with AMX and AVX512-BF16 intrinsics (GCC 11, clang 12);
 * older compilers build the portable tier only, and detection then reports it. */
#if defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define TF_X86 1
#define TF_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TF_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))
#define TF_TARGET_AVX512_BF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")))
#define TF_TARGET_AMX \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#else
#define TF_X86 0
#endif

#endif /* TF_CPU_FEATURES_H */

/* Run-time detection of the CPU's tiers (see cpu_features.h). */
#define _GNU_SOURCE /* syscall() */
#include "cpu_features.h"

#include <stdatomic.h>

#if TF_X86
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

/* -1 until detected; then the tier. Racing first calls detect twice and store the same value. */
static _Atomic int detected_isa = -1;
static _Atomic int isa_cap = -1;

#if TF_X86
static int bit(unsigned reg, int b) { return (int)((reg >> b) & 1u); }

/* XCR0: which register states the OS saves (and so lets us use). */
static unsigned long long read_xcr0(void) {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((unsigned long long)hi << 32) | lo;
}

/* Linux hands out AMX tile data only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XFEATURE_XTILEDATA); the permission is per process and asking twice is harmless. */
static int request_amx_permission(void) {
#if defined(__linux__)
  enum { ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
  unsigned long long granted = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) != 0) return 0;
  return (int)((granted >> XFEATURE_XTILEDATA) & 1u);
#else
  return 0;
#endif
}

static tf_isa detect(void) {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return TF_ISA_PORTABLE;
  const int fma = bit(ecx, 12), osxsave = bit(ecx, 27), avx = bit(ecx, 28), f16c = bit(ecx, 29);
  if (!osxsave || !avx) return TF_ISA_PORTABLE;
  const unsigned long long xcr0 = read_xcr0();
  if ((xcr0 & 0x6u) != 0x6u) return TF_ISA_PORTABLE; /* XMM and YMM state */
  if (__get_cpuid_max(0, 0) < 7) return TF_ISA_PORTABLE;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  const int avx2 = bit(ebx, 5), avx512f = bit(ebx, 16), avx512bw = bit(ebx, 30),
            avx512vl = bit(ebx, 31);
  const int amx_bf16 = bit(edx, 22), amx_tile = bit(edx, 24);
  unsigned eax1, ebx1, ecx1, edx1;
  __cpuid_count(7, 1, eax1, ebx1, ecx1, edx1);
  const int avx512_bf16 = bit(eax1, 5);
  if (!(avx2 && fma && f16c)) return TF_ISA_PORTABLE;
  /* opmask, ZMM_Hi256 and Hi16_ZMM state */
  if (!(avx512f && avx512bw && avx512vl) || (xcr0 & 0xE0u) != 0xE0u) return TF_ISA_AVX2;
  if (!avx512_bf16) return TF_ISA_AVX512;
  /* XTILECFG and XTILEDATA state (XCR0 bits 17, 18) */
  if (!(amx_tile && amx_bf16) || ((xcr0 >> 17) & 3u) != 3u || !request_amx_permission())
    return TF_ISA_AVX512_BF16;
  return TF_ISA_AMX;
}
#else
static tf_isa detect(void) { return TF_ISA_PORTABLE; }
#endif

tf_isa tf_cpu_isa_detected(void) {
  int isa = atomic_load(&detected_isa);
  if (isa < 0) {
    isa = (int)detect();
    atomic_store(&detected_isa, isa);
  }
  return (tf_isa)isa;
}

tf_isa tf_cpu_isa(void) {
  const tf_isa isa = tf_cpu_isa_detected();
  const int cap = atomic_load(&isa_cap);
  return cap >= 0 && cap < (int)isa ? (tf_isa)cap : isa;
}

tf_status tf_set_cpu_isa_cap(int cap) {
  if (cap < -1 || cap >= TF_ISA_COUNT) return TF_ERR_BAD_ARGUMENT;
  atomic_store(&isa_cap, cap);
  return TF_OK;
}

int tf_cpu_isa_cap(void) { return atomic_load(&isa_cap); }

const char *tf_isa_name(int isa) {
  static const char *const names[TF_ISA_COUNT] = {"portable", "avx2", "avx512", "avx512_bf16", "amx"};
  return isa >= 0 && isa < TF_ISA_COUNT ? names[isa] : 0;
}

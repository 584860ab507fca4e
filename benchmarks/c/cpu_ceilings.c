/*
 * Per-core costs that bound the CPU benchmarks on this machine, measured on one thread:
 *   - the float32 FMA peak (GFLOP/s), the ceiling of the attention kernels' products;
 *   - ns per element of the FP8 quantize and cast-transpose kernels of the active tier, with
 *     their input and output in L2, so that memory bandwidth takes no part.
 * bench_quantize.py gives the other half: x.clone()'s bandwidth in GB/s. A kernel can reach
 * a fraction f of it on T threads only if its ns per element here is at most
 *   T * bytes per element / (f * clone GB/s)
 * (benchmarks/RESULTS.md does the arithmetic). Build and run: sh benchmarks/c/cpu_ceilings.sh
 */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/cpu_features.h"
#include "fp8/fp8_quantize.h"

#if TF_X86
#include <immintrin.h>
#endif

enum { ELEMENTS = 1 << 15, COLS = 256, REPEATS = 2000, ROUNDS = 5 };

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#if TF_X86
/* Ten independent FMA chains, more than latency x throughput needs on any AVX2 core. */
TF_TARGET_AVX2 static double fma_gflops(void) {
  __m256 acc[10];
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int j = 0; j < 10; ++j) acc[j] = _mm256_set1_ps((float)j);
  const long iterations = 50000000;
  const double t0 = seconds();
  for (long i = 0; i < iterations; ++i)
    for (int j = 0; j < 10; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  const double elapsed = seconds() - t0;
  __m256 sum = acc[0];
  for (int j = 1; j < 10; ++j) sum = _mm256_add_ps(sum, acc[j]);
  volatile float sink = _mm256_cvtss_f32(sum); /* keeps the chains */
  (void)sink;
  return (double)iterations * 10 * 16 / elapsed * 1e-9;
}
#endif

typedef enum { QUANTIZE, QUANTIZE_TABLE, CAST_TRANSPOSE } kernel;

static const char *const kernel_names[] = {"quantize", "quantize (16-bit table)", "cast-transpose"};

/* Median over ROUNDS of the mean ns per element of REPEATS calls. */
static double ns_per_element(kernel k, tf_dtype dtype, const void *x, const uint8_t *table,
                             uint8_t *y, uint8_t *y_t) {
  double times[ROUNDS];
  uint32_t amax = 0;
  for (int round = 0; round < ROUNDS; ++round) {
    const double t0 = seconds();
    for (int r = 0; r < REPEATS; ++r) {
      tf_status status;
      if (k == QUANTIZE)
        status = tf_fp8_quantize(x, dtype, 0, ELEMENTS, 1.7f, TF_FP8_E4M3, y, &amax);
      else if (k == QUANTIZE_TABLE)
        status = tf_fp8_quantize_table(x, dtype, 0, ELEMENTS, table, y, &amax);
      else
        status = tf_fp8_cast_transpose(x, dtype, ELEMENTS / COLS, COLS, COLS, 0, ELEMENTS / COLS, 1.7f,
                                       TF_FP8_E4M3, y, y_t, &amax);
      if (status != TF_OK) {
        fprintf(stderr, "%s failed: status %d\n", kernel_names[k], (int)status);
        exit(1);
      }
    }
    times[round] = (seconds() - t0) / REPEATS / ELEMENTS * 1e9;
  }
  for (int i = 1; i < ROUNDS; ++i) /* insertion sort of five */
    for (int j = i; j > 0 && times[j] < times[j - 1]; --j) {
      const double t = times[j];
      times[j] = times[j - 1];
      times[j - 1] = t;
    }
  return times[ROUNDS / 2];
}

int main(void) {
  float *x32 = malloc(sizeof(float) * ELEMENTS);
  uint16_t *x16 = malloc(sizeof(uint16_t) * ELEMENTS);
  uint8_t *y = malloc(ELEMENTS), *y_t = malloc(ELEMENTS), *table = malloc(TF_FP8_TABLE_ENTRIES);
  if (!x32 || !x16 || !y || !y_t || !table) return 1;
  srand(1234);
  for (int i = 0; i < ELEMENTS; ++i) {
    x32[i] = 8.0f * ((float)rand() / (float)RAND_MAX - 0.5f);
    uint32_t bits;
    memcpy(&bits, &x32[i], sizeof bits);
    x16[i] = (uint16_t)(bits >> 16); /* bfloat16, truncated: any pattern will do */
  }
  if (tf_fp8_table_build(TF_BFLOAT16, 1.7f, TF_FP8_E4M3, 0, TF_FP8_TABLE_ENTRIES, table) != TF_OK) return 1;
  printf("tier %s, one thread\n", tf_isa_name(tf_cpu_isa()));
#if TF_X86
  if (tf_cpu_isa() >= TF_ISA_AVX2) printf("float32 FMA peak: %.1f GFLOP/s\n", fma_gflops());
#endif
  printf("ns per element, %d elements in L2, E4M3:\n", ELEMENTS);
  printf("  fp32 quantize %.3f, cast-transpose %.3f\n", ns_per_element(QUANTIZE, TF_FLOAT32, x32, NULL, y, y_t),
         ns_per_element(CAST_TRANSPOSE, TF_FLOAT32, x32, NULL, y, y_t));
  printf("  bf16 quantize %.3f, through the table %.3f, cast-transpose %.3f\n",
         ns_per_element(QUANTIZE, TF_BFLOAT16, x16, NULL, y, y_t),
         ns_per_element(QUANTIZE_TABLE, TF_BFLOAT16, x16, table, y, y_t),
         ns_per_element(CAST_TRANSPOSE, TF_BFLOAT16, x16, NULL, y, y_t));
  free(x32);
  free(x16);
  free(y);
  free(y_t);
  free(table);
  return 0;
}

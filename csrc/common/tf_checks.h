/* Size checks shared by the C kernels: every size a kernel is given goes through these. */
#ifndef TF_CHECKS_H
#define TF_CHECKS_H

#include <stdint.h>

/* 1 when a * b fits in int64 for non-negative a and b, 0 otherwise. */
static inline int tf_mul_fits(int64_t a, int64_t b) {
  return a >= 0 && b >= 0 && (b == 0 || a <= INT64_MAX / b);
}

/* 1 when [begin, end) is a valid sub-range of [0, limit). */
static inline int tf_range_ok(int64_t begin, int64_t end, int64_t limit) {
  return begin >= 0 && begin <= end && end <= limit;
}

#endif /* TF_CHECKS_H */

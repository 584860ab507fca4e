/*
 * The check harness of the standalone C tests (and of the CUDA emulation tests, in C++):
 * CHECK(cond, printf-args) counts a pass or prints the failure, and check_report() prints
 * the closing "N passed, M failed" line and gives the exit status. One test per program.
 */
#ifndef TF_TEST_CHECK_H
#define TF_TEST_CHECK_H

#include <stdio.h>

static int passed;
static int failed;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (cond) {                                            \
      ++passed;                                            \
    } else {                                               \
      ++failed;                                            \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
    }                                                      \
  } while (0)

static inline int check_report(void) {
  printf("%d passed, %d failed\n", passed, failed);
  return failed != 0;
}

#endif /* TF_TEST_CHECK_H */

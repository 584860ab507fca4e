/*
 * The output descriptor of the fused-op kernels (activation.h, norm.h): a
 * floating dtype, or FP8 codes of value * scale written directly so the next
 * op's input is already quantized. Plain C, usable from the C++ binding.
 */
#ifndef TF_OPS_IO_H
#define TF_OPS_IO_H

#include "../common/tf_dtype.h"
#include "../fp8/fp8_format.h"

/* Where a kernel writes its main output: a floating dtype, or FP8 with a scale. */
typedef struct tf_ops_output {
  void *data;            /* same element layout as the kernel's input */
  tf_dtype dtype;        /* element type when fp8 == 0 */
  int fp8;               /* 1: data holds FP8 codes of value * scale */
  tf_fp8_format format;  /* FP8 format when fp8 == 1 */
  float scale;           /* FP8 scale when fp8 == 1 */
} tf_ops_output;

#endif /* TF_OPS_IO_H */

// Host stand-in for the parts of <cuda_bf16.h> the kernels use: bfloat16
// storage and round-to-nearest-even conversions (the shared tf_dtype.h ones).
#pragma once

#include <cuda_runtime.h>

#include "common/tf_dtype.h"

struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {{tf_f32_to_bf16(lo)}, {tf_f32_to_bf16(hi)}};
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
  return {tf_bf16_to_f32(v.x.bits), tf_bf16_to_f32(v.y.bits)};
}

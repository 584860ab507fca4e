// Host stand-in for the parts of <cuda_fp16.h> the kernels use: half
// storage and round-to-nearest-even conversions (the shared tf_dtype.h ones).
#pragma once

#include <cuda_runtime.h>

#include "common/tf_dtype.h"

struct __half {
  uint16_t bits;
};
struct alignas(4) __half2 {
  __half x, y;
};

inline __half2 __floats2half2_rn(float lo, float hi) { return {{tf_f32_to_f16(lo)}, {tf_f32_to_f16(hi)}}; }
inline float2 __half22float2(__half2 v) { return {tf_f16_to_f32(v.x.bits), tf_f16_to_f32(v.y.bits)}; }

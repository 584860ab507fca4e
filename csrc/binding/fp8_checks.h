// Argument checks of the FP8 ops, shared by their CPU and CUDA implementations.
#pragma once

#include "binding_util.h"

namespace te_fuser {

inline void check_quantize_args(const Tensor& input, const Tensor& scale, const Tensor& amax) {
  check_contiguous(input, "input");
  check_scalar_f32(scale, "scale");
  check_scalar_f32(amax, "amax");
  check_same_device(input, scale, "input", "scale");
  check_same_device(input, amax, "input", "amax");
}

// Returns the number of scaled tensors, amax_history.size(1).
inline int64_t check_scaling_update_args(const Tensor& amax_history, const Tensor& scale,
                                         const Tensor& scale_inv, int64_t margin) {
  STD_TORCH_CHECK(amax_history.dim() == 2, "amax_history must be 2-D (history_len, n)");
  const int64_t n = amax_history.size(1);
  for (const Tensor* t : {&amax_history, &scale, &scale_inv}) {
    STD_TORCH_CHECK(t->scalar_type() == ScalarType::Float && t->is_contiguous(),
                    "amax_history, scale and scale_inv must be contiguous float32");
    check_same_device(*t, amax_history, "every argument", "amax_history");
  }
  STD_TORCH_CHECK(scale.numel() == n && scale_inv.numel() == n,
                  "scale and scale_inv must have amax_history.size(1) elements");
  STD_TORCH_CHECK(margin >= -126 && margin <= 126, "margin must lie in [-126, 126]");
  return n;
}

}  // namespace te_fuser

// CUDA implementations of the RoPE ops (schemas and CPU versions in rope_ops.cpp): the same argument
// checks, except that cu_seqlens and start_positions stay on the device (rope_cuda.h: tokens they
// misplace come out NaN), then the launcher on the current stream of x's device. Nothing waits.
#include <optional>

#include "rope_checks.h"

#include <torch/csrc/stable/accelerator.h>

#include "../cuda/ops/rope_cuda.h"

namespace te_fuser {
namespace {

using torch::stable::accelerator::DeviceGuard;

template <bool kBackward>
Tensor rope_cuda(Tensor x, Tensor freqs, std::optional<Tensor> start_positions, std::optional<Tensor> cu_seqlens,
                 int64_t tensor_format, bool interleaved, int64_t cp_size, int64_t cp_rank) {
  const char* arg = kBackward ? "grad" : "x";
  STD_TORCH_CHECK(x.is_cuda(), arg, " must be a CUDA tensor");
  const RopeCall c = rope_call(x, freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size,
                               cp_rank, arg, /*on_host=*/false);
  const DeviceGuard guard(x.get_device_index());
  Tensor out = new_empty(x, x.sizes(), x.scalar_type());
  int64_t out_strides[4];
  contiguous_strides(out, c.problem.format, out_strides);
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), arg);
  void* stream = current_cuda_stream(x, arg);
  const tf_status s =
      kBackward ? tf_rope_backward_cuda(&c.problem, dtype, x.const_data_ptr(), c.strides, out.mutable_data_ptr(),
                                        out_strides, stream)
                : tf_rope_forward_cuda(&c.problem, dtype, x.const_data_ptr(), c.strides, out.mutable_data_ptr(),
                                       out_strides, stream);
  check_status(s, kBackward ? "rope_backward" : "rope_forward");
  return out;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CUDA, m) {
  m.impl("rope_forward", TORCH_BOX(&te_fuser::rope_cuda<false>));
  m.impl("rope_backward", TORCH_BOX(&te_fuser::rope_cuda<true>));
}

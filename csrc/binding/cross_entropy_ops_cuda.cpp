// CUDA implementations of the cross-entropy ops (schemas and CPU versions in cross_entropy_ops.cpp): the
// same argument checks, then the launchers of csrc/cuda/ops/cross_entropy.cu on the current stream of the
// logits' device. Nothing waits; an invalid target is marked with NaN (see cross_entropy_cuda.h).
#include <vector>

#include "fused_checks.h"

#include <torch/csrc/stable/accelerator.h>

#include "../cuda/ops/cross_entropy_cuda.h"

namespace te_fuser {
namespace {

using torch::stable::accelerator::DeviceGuard;

Matrix check_logits_and_target(const Tensor& logits, const Tensor& target) {
  STD_TORCH_CHECK(logits.is_cuda(), "logits must be a CUDA tensor");
  const Matrix m = as_matrix(logits, "logits");
  STD_TORCH_CHECK(target.scalar_type() == ScalarType::Long && target.is_contiguous() && target.numel() == m.rows,
                  "target must be a contiguous int64 tensor with one element per row of logits");
  check_same_device(target, logits, "target", "logits");
  return m;
}

Tensor cross_entropy_stats_cuda(Tensor logits, Tensor target, int64_t vocab_start, int64_t vocab_size,
                                int64_t ignore_index) {
  const Matrix m = check_logits_and_target(logits, target);
  const tf_dtype dtype = to_tf_dtype(logits.scalar_type(), "logits");
  DeviceGuard guard(logits.get_device_index());
  std::vector<int64_t> sizes = row_shape(logits);
  sizes.push_back(4);
  Tensor stats = new_empty(logits, sizes, ScalarType::Float);
  check_status(tf_cross_entropy_stats_cuda(logits.const_data_ptr(), dtype, m.rows, m.cols,
                                           target.const_data_ptr<int64_t>(), vocab_start, vocab_size, ignore_index,
                                           stats.mutable_data_ptr<float>(), current_cuda_stream(logits, "logits")),
               "cross_entropy_stats");
  return stats;
}

Tensor cross_entropy_backward_cuda(Tensor logits, Tensor target, Tensor lse, Tensor scale, int64_t vocab_start,
                                   int64_t vocab_size, int64_t ignore_index, double smoothing, double on_target) {
  const Matrix m = check_logits_and_target(logits, target);
  check_stats(lse, m, logits, "lse");
  check_stats(scale, m, logits, "scale");
  const tf_dtype dtype = to_tf_dtype(logits.scalar_type(), "logits");
  DeviceGuard guard(logits.get_device_index());
  Tensor dx = new_empty(logits, logits.sizes(), logits.scalar_type());
  check_status(tf_cross_entropy_backward_cuda(logits.const_data_ptr(), dtype, m.rows, m.cols,
                                              target.const_data_ptr<int64_t>(), vocab_start, vocab_size, ignore_index,
                                              lse.const_data_ptr<float>(), scale.const_data_ptr<float>(),
                                              static_cast<float>(smoothing), static_cast<float>(on_target),
                                              dx.mutable_data_ptr(), current_cuda_stream(logits, "logits")),
               "cross_entropy_backward");
  return dx;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CUDA, m) {
  m.impl("cross_entropy_stats", TORCH_BOX(&te_fuser::cross_entropy_stats_cuda));
  m.impl("cross_entropy_backward", TORCH_BOX(&te_fuser::cross_entropy_backward_cuda));
}

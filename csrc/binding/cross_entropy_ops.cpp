// Schemas and CPU implementations of the cross-entropy ops over the C core in csrc/ops/cross_entropy.h:
// per-row statistics of this rank's vocabulary shard, and the gradient from the combined log-sum-exp.
// logits are viewed as (numel / last dim) x (last dim); target holds one int64 per row.
#include <vector>

#include "fused_checks.h"

extern "C" {
#include "../ops/cross_entropy.h"
}

namespace te_fuser {
namespace {

void check_target(const Tensor& target, Matrix m, const Tensor& logits) {
  STD_TORCH_CHECK(target.scalar_type() == ScalarType::Long && target.is_contiguous() && target.numel() == m.rows,
                  "target must be a contiguous int64 tensor with one element per row of logits");
  check_same_device(target, logits, "target", "logits");
}

// Runs fn(row_begin, row_end) -> tf_status over bands of about kGrainElements elements on the thread pool.
template <class F>
void parallel_rows(Matrix m, const char* what, const F& fn) {
  const int64_t band = kGrainElements / (m.cols > 0 ? m.cols : 1) + 1;
  const int64_t bands = (m.rows + band - 1) / band;
  std::vector<int> status(static_cast<size_t>(bands), TF_OK);
  torch::stable::parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * band;
      status[b] = fn(r0, m.rows - r0 < band ? m.rows : r0 + band);
    }
  });
  for (int64_t b = 0; b < bands; ++b) {
    STD_TORCH_CHECK(status[b] != TF_ERR_BAD_ARGUMENT, what,
                    ": every target must be in [0, vocab_size) or equal to ignore_index");
    check_status(static_cast<tf_status>(status[b]), what);
  }
}

Tensor cross_entropy_stats_cpu(Tensor logits, Tensor target, int64_t vocab_start, int64_t vocab_size,
                               int64_t ignore_index) {
  const Matrix m = as_matrix(logits, "logits");
  check_target(target, m, logits);
  const tf_dtype dtype = to_tf_dtype(logits.scalar_type(), "logits");
  std::vector<int64_t> sizes = row_shape(logits);
  sizes.push_back(4);
  Tensor stats = new_empty(logits, sizes, ScalarType::Float);
  const void* xp = logits.const_data_ptr();
  const int64_t* tp = target.const_data_ptr<int64_t>();
  float* sp = stats.mutable_data_ptr<float>();
  parallel_rows(m, "cross_entropy_stats", [&](int64_t r0, int64_t r1) {
    return tf_cross_entropy_stats(xp, dtype, m.rows, m.cols, tp, vocab_start, vocab_size, ignore_index, r0, r1, sp);
  });
  return stats;
}

Tensor cross_entropy_backward_cpu(Tensor logits, Tensor target, Tensor lse, Tensor scale, int64_t vocab_start,
                                  int64_t vocab_size, int64_t ignore_index, double smoothing, double on_target) {
  const Matrix m = as_matrix(logits, "logits");
  check_target(target, m, logits);
  check_stats(lse, m, logits, "lse");
  check_stats(scale, m, logits, "scale");
  const tf_dtype dtype = to_tf_dtype(logits.scalar_type(), "logits");
  Tensor dx = new_empty(logits, logits.sizes(), logits.scalar_type());
  const void* xp = logits.const_data_ptr();
  const int64_t* tp = target.const_data_ptr<int64_t>();
  const float* lp = lse.const_data_ptr<float>();
  const float* sp = scale.const_data_ptr<float>();
  void* dxp = dx.mutable_data_ptr();
  parallel_rows(m, "cross_entropy_backward", [&](int64_t r0, int64_t r1) {
    return tf_cross_entropy_backward(xp, dtype, m.rows, m.cols, tp, vocab_start, vocab_size, ignore_index, lp, sp,
                                     static_cast<float>(smoothing), static_cast<float>(on_target), r0, r1, dxp,
                                     dtype);
  });
  return dx;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def("cross_entropy_stats(Tensor logits, Tensor target, int vocab_start, int vocab_size, int ignore_index)"
        " -> Tensor");
  m.def(
      "cross_entropy_backward(Tensor logits, Tensor target, Tensor lse, Tensor scale, int vocab_start,"
      " int vocab_size, int ignore_index, float smoothing, float on_target) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CPU, m) {
  m.impl("cross_entropy_stats", TORCH_BOX(&te_fuser::cross_entropy_stats_cpu));
  m.impl("cross_entropy_backward", TORCH_BOX(&te_fuser::cross_entropy_backward_cpu));
}

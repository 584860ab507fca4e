// Schemas of the rotary position embedding ops (rope_forward, rope_backward) and their CPU
// implementations over token ranges of the C core in csrc/ops/rope.c.
//
// x (or grad) is [s, b, h, d] (tensor_format 0, sbhd), [b, s, h, d] (1, bshd) or [t, h, d]
// (2, thd) with any strides; the result is a new contiguous tensor of the same shape and dtype.
// freqs is a contiguous float32 [s2, 1 or b, 1, d2]; start_positions ([b]) and cu_seqlens
// ([b + 1], thd only) are contiguous int32.
#include <optional>
#include <vector>

#include "rope_checks.h"

namespace te_fuser {
namespace {

template <bool kBackward>
Tensor rope_cpu(Tensor x, Tensor freqs, std::optional<Tensor> start_positions, std::optional<Tensor> cu_seqlens,
                int64_t tensor_format, bool interleaved, int64_t cp_size, int64_t cp_rank) {
  const char* arg = kBackward ? "grad" : "x";
  const RopeCall c = rope_call(x, freqs, start_positions, cu_seqlens, tensor_format, interleaved, cp_size,
                               cp_rank, arg, /*on_host=*/true);
  Tensor out = new_empty(x, x.sizes(), x.scalar_type());
  int64_t out_strides[4];
  contiguous_strides(out, c.problem.format, out_strides);
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), arg);
  const int64_t tokens = tf_rope_tokens(&c.problem);
  const int64_t per_token = c.problem.heads * c.problem.dim;
  const int64_t grain = kGrainElements / (per_token > 0 ? per_token : 1) + 1;
  const void* xp = x.const_data_ptr();
  void* yp = out.mutable_data_ptr();
  const int64_t chunks = (tokens + grain - 1) / grain;
  std::vector<int> status(static_cast<size_t>(chunks), TF_OK);
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t k = c0; k < c1; ++k) {
      const int64_t t0 = k * grain, t1 = tokens - t0 < grain ? tokens : t0 + grain;
      status[k] = kBackward ? tf_rope_backward(&c.problem, dtype, xp, c.strides, yp, out_strides, t0, t1)
                            : tf_rope_forward(&c.problem, dtype, xp, c.strides, yp, out_strides, t0, t1);
    }
  });
  for (int s : status) check_status(static_cast<tf_status>(s), kBackward ? "rope_backward" : "rope_forward");
  return out;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def(
      "rope_forward(Tensor x, Tensor freqs, Tensor? start_positions, Tensor? cu_seqlens, int tensor_format,"
      " bool interleaved, int cp_size, int cp_rank) -> Tensor");
  m.def(
      "rope_backward(Tensor grad, Tensor freqs, Tensor? start_positions, Tensor? cu_seqlens, int tensor_format,"
      " bool interleaved, int cp_size, int cp_rank) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CPU, m) {
  m.impl("rope_forward", TORCH_BOX(&te_fuser::rope_cpu<false>));
  m.impl("rope_backward", TORCH_BOX(&te_fuser::rope_cpu<true>));
}

// Argument checks of the RoPE ops, shared by their CPU (rope_ops.cpp) and CUDA (rope_ops_cuda.cpp)
// implementations: x (or grad) as a tf_rope_problem and its strides in (s or t, b, h, d) order.
#pragma once

#include <optional>

#include "binding_util.h"

extern "C" {
#include "../ops/rope.h"
}

namespace te_fuser {

inline tf_rope_format to_rope_format(int64_t format) {
  STD_TORCH_CHECK(format >= TF_ROPE_SBHD && format <= TF_ROPE_THD,
                  "tensor_format must be 0 (sbhd), 1 (bshd) or 2 (thd), got ", format);
  return static_cast<tf_rope_format>(format);
}

inline void check_int32_vector(const Tensor& v, int64_t n, const Tensor& like, const char* arg) {
  STD_TORCH_CHECK(v.scalar_type() == ScalarType::Int && v.dim() == 1 && v.is_contiguous(), arg,
                  " must be a contiguous 1-D int32 tensor");
  STD_TORCH_CHECK(n < 0 || v.size(0) == n, arg, " must have ", n, " elements, got ", v.size(0));
  check_same_device(v, like, arg, "the input");
}

// The problem of x, its strides in (s or t, b, h, d) order, and the tokens to spread over threads.
struct RopeCall {
  tf_rope_problem problem;
  int64_t strides[4];
};

// on_host: cu_seqlens and start_positions are read here (CPU); on the GPU only their shapes are checked.
inline RopeCall rope_call(const Tensor& x, const Tensor& freqs, const std::optional<Tensor>& start_positions,
                          const std::optional<Tensor>& cu_seqlens, int64_t tensor_format, bool interleaved,
                          int64_t cp_size, int64_t cp_rank, const char* arg, bool on_host) {
  RopeCall c{};
  tf_rope_problem& p = c.problem;
  p.format = to_rope_format(tensor_format);
  to_tf_dtype(x.scalar_type(), arg);
  const bool thd = p.format == TF_ROPE_THD;
  STD_TORCH_CHECK(x.dim() == (thd ? 3 : 4), arg, " must have ", thd ? 3 : 4, " dimensions, got ", x.dim());
  if (thd) {
    STD_TORCH_CHECK(cu_seqlens.has_value(), "cu_seqlens is required when tensor_format is thd");
    check_int32_vector(*cu_seqlens, -1, x, "cu_seqlens");
    STD_TORCH_CHECK(cu_seqlens->size(0) >= 1, "cu_seqlens must have at least one element");
    p.seq = x.size(0);
    p.batch = cu_seqlens->size(0) - 1;
    p.cu_seqlens = static_cast<const int32_t*>(cu_seqlens->const_data_ptr());
    c.strides[0] = x.stride(0);
    c.strides[1] = 0;
  } else {
    const int s_dim = p.format == TF_ROPE_SBHD ? 0 : 1;
    p.seq = x.size(s_dim);
    p.batch = x.size(1 - s_dim);
    c.strides[0] = x.stride(s_dim);
    c.strides[1] = x.stride(1 - s_dim);
  }
  const int64_t h_dim = x.dim() - 2;
  p.heads = x.size(h_dim);
  p.dim = x.size(h_dim + 1);
  c.strides[2] = x.stride(h_dim);
  c.strides[3] = x.stride(h_dim + 1);

  STD_TORCH_CHECK(freqs.scalar_type() == ScalarType::Float && freqs.is_contiguous() && freqs.dim() == 4 &&
                      freqs.size(2) == 1,
                  "freqs must be a contiguous float32 tensor [s, 1, 1, d] or [s, b, 1, d]");
  check_same_device(freqs, x, "freqs", arg);
  p.freqs = freqs.const_data_ptr<float>();
  p.freq_rows = freqs.size(0);
  p.freq_batch = freqs.size(1);
  p.rot_dim = freqs.size(3);
  if (start_positions.has_value()) {
    check_int32_vector(*start_positions, p.batch, x, "start_positions");
    p.start_positions = static_cast<const int32_t*>(start_positions->const_data_ptr());
  }
  p.interleaved = interleaved ? 1 : 0;
  p.cp_size = cp_size;
  p.cp_rank = cp_rank;
  check_status(on_host ? tf_rope_check(&p) : tf_rope_check_shape(&p), "rotary position embedding");
  return c;
}

// The output's strides in (s or t, b, h, d) order for a contiguous tensor of x's shape.
inline void contiguous_strides(const Tensor& out, tf_rope_format format, int64_t strides[4]) {
  if (format == TF_ROPE_THD) {
    strides[0] = out.stride(0);
    strides[1] = 0;
  } else {
    const int s_dim = format == TF_ROPE_SBHD ? 0 : 1;
    strides[0] = out.stride(s_dim);
    strides[1] = out.stride(1 - s_dim);
  }
  strides[2] = out.stride(out.dim() - 2);
  strides[3] = out.stride(out.dim() - 1);
}

}  // namespace te_fuser

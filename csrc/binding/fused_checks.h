// Argument checks and shape helpers of the fused ops, shared by their CPU and CUDA
// implementations. Every tensor is viewed as (numel / last dim) x (last dim).
#pragma once

#include <vector>

#include "binding_util.h"

extern "C" {
#include "../ops/activation.h"
}

namespace te_fuser {

struct Matrix {
  int64_t rows;
  int64_t cols;
};

inline Matrix as_matrix(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.dim() >= 1, arg, " must have at least one dimension");
  check_contiguous(t, arg);
  const int64_t cols = t.size(t.dim() - 1);
  return {cols == 0 ? 0 : t.numel() / cols, cols};
}

inline void check_vector(const Tensor& v, int64_t n, const Tensor& like, const char* arg) {
  check_contiguous(v, arg);
  STD_TORCH_CHECK(v.dim() == 1 && v.size(0) == n, arg, " must be 1-D with ", n, " elements");
  check_same_device(v, like, arg, "input");
}

inline void check_same_shape(const Tensor& a, const Tensor& b, const char* arg_a, const char* arg_b) {
  STD_TORCH_CHECK(a.dim() == b.dim(), arg_a, " and ", arg_b, " must have the same shape");
  for (int64_t d = 0; d < a.dim(); ++d)
    STD_TORCH_CHECK(a.size(d) == b.size(d), arg_a, " and ", arg_b, " must have the same shape");
  check_same_device(a, b, arg_a, arg_b);
}

// Per-row float32 statistics of a norm (rstd, mean).
inline void check_stats(const Tensor& stat, Matrix m, const Tensor& x, const char* arg) {
  STD_TORCH_CHECK(stat.scalar_type() == ScalarType::Float && stat.is_contiguous() &&
                      stat.numel() == m.rows,
                  arg, " must be a contiguous float32 tensor with one element per row of x");
  check_same_device(stat, x, arg, "x");
}

inline tf_activation to_activation(int64_t act) {
  STD_TORCH_CHECK(tf_activation_known(act),
                  "activation must be 0 (none), 1 (gelu, tanh), 2 (relu), 3 (qgelu), 4 (srelu) or 5 (silu), got ", act);
  return static_cast<tf_activation>(act);
}

// The activation of a gated kernel: any but none (geglu 1, reglu 2, qgeglu 3, sreglu 4, swiglu 5).
inline tf_activation to_gated_activation(int64_t act) {
  STD_TORCH_CHECK(tf_activation_known(act) && act != TF_ACT_NONE,
                  "a gated activation must be 1 (geglu), 2 (reglu), 3 (qgeglu), 4 (sreglu) or 5 (swiglu), got ", act);
  return static_cast<tf_activation>(act);
}

// x (..., 2 n) of a gated activation, and the shape of its output (..., n).
inline std::vector<int64_t> gated_output_shape(const Tensor& x, Matrix m) {
  STD_TORCH_CHECK(m.cols % 2 == 0, "x's last dimension must be even for a gated activation, got ", m.cols);
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() /= 2;
  return sizes;
}

// grad (..., n) of a gated activation of x (..., 2 n).
inline Matrix check_gated_grad(const Tensor& grad, const Tensor& x, Matrix m) {
  const Matrix g = as_matrix(grad, "grad");
  STD_TORCH_CHECK(m.cols % 2 == 0 && grad.dim() == x.dim() && g.rows == m.rows && g.cols * 2 == m.cols,
                  "grad must have x's shape with the last dimension halved");
  check_same_device(grad, x, "grad", "x");
  return g;
}

// x's shape without its last dimension: the shape of per-row statistics.
inline std::vector<int64_t> row_shape(const Tensor& x) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.pop_back();
  return sizes;
}

}  // namespace te_fuser

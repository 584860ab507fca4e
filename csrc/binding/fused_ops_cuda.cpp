// CUDA implementations of the fused ops (schemas and CPU versions in fused_ops.cpp):
// the same argument checks, then the launchers of csrc/cuda/ops on the current
// stream of the input's device. FP8 scales are read on the device: nothing waits.

#include <optional>
#include <vector>

#include "fused_checks.h"

#include <torch/csrc/stable/accelerator.h>

#include "../cuda/ops/fused_ops_cuda.h"

namespace te_fuser {
namespace {

using torch::stable::accelerator::DeviceGuard;

// The shared as_matrix, for tensors that must live on the GPU.
Matrix as_cuda_matrix(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.is_cuda(), arg, " must be a CUDA tensor");
  return as_matrix(t, arg);
}

// A new output tensor and its launcher descriptor: FP8 when fp8_dtype is given, else `dtype`.
struct Output {
  Tensor tensor;
  tf_ops_cuda_output desc;
};

Output make_output(const Tensor& like, torch::headeronly::IntHeaderOnlyArrayRef sizes, ScalarType dtype,
                   const std::optional<ScalarType>& fp8_dtype, const std::optional<Tensor>& scale,
                   const std::optional<Tensor>& amax) {
  tf_ops_cuda_output desc{nullptr, TF_FLOAT32, 0, TF_FP8_E4M3, nullptr, nullptr};
  ScalarType out_type = dtype;
  if (fp8_dtype.has_value()) {
    STD_TORCH_CHECK(scale.has_value() && amax.has_value(), "an FP8 output needs both scale and amax");
    check_scalar_f32(*scale, "scale");
    check_scalar_f32(*amax, "amax");
    check_same_device(like, *scale, "input", "scale");
    check_same_device(like, *amax, "input", "amax");
    STD_TORCH_CHECK(scale->const_data_ptr() != amax->const_data_ptr(), "scale and amax must not share memory on CUDA");
    desc.fp8 = 1;
    desc.format = to_tf_fp8_format(*fp8_dtype, "fp8_dtype");
    desc.scale = scale->const_data_ptr<float>();
    desc.amax = amax->mutable_data_ptr<float>();
    out_type = *fp8_dtype;
  } else {
    desc.dtype = to_tf_dtype(dtype, "output dtype");
  }
  Tensor out = new_empty(like, sizes, out_type);
  desc.data = out.mutable_data_ptr();
  return {out, desc};
}

Tensor bias_act_forward_impl(const Tensor& x, const std::optional<Tensor>& bias, int64_t activation,
                             const std::optional<ScalarType>& fp8_dtype, const std::optional<Tensor>& scale,
                             const std::optional<Tensor>& amax) {
  const Matrix m = as_cuda_matrix(x, "x");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_activation act = to_activation(activation);
  tf_dtype bias_dtype = TF_FLOAT32;
  if (bias.has_value()) {
    check_vector(*bias, m.cols, x, "bias");
    bias_dtype = to_tf_dtype(bias->scalar_type(), "bias");
  }
  const DeviceGuard guard(x.get_device_index());
  Output y = make_output(x, x.sizes(), x.scalar_type(), fp8_dtype, scale, amax);
  check_status(tf_bias_act_forward_cuda(x.const_data_ptr(), dtype, bias ? bias->const_data_ptr() : nullptr,
                                        bias_dtype, m.rows, m.cols, act, &y.desc, current_cuda_stream(x, "x")),
               "bias_act_forward");
  return y.tensor;
}

Tensor bias_act_forward_cuda(Tensor x, std::optional<Tensor> bias, int64_t activation) {
  return bias_act_forward_impl(x, bias, activation, std::nullopt, std::nullopt, std::nullopt);
}

Tensor bias_act_forward_fp8_cuda(Tensor x, std::optional<Tensor> bias, int64_t activation, ScalarType fp8_dtype,
                                 Tensor scale, Tensor amax) {
  return bias_act_forward_impl(x, bias, activation, fp8_dtype, scale, amax);
}

std::tuple<Tensor, Tensor> act_bias_backward_cuda(Tensor grad, Tensor x, std::optional<Tensor> bias,
                                                  int64_t activation, bool compute_dbias,
                                                  std::optional<ScalarType> fp8_dtype, std::optional<Tensor> scale,
                                                  std::optional<Tensor> amax) {
  const Matrix m = as_cuda_matrix(x, "x");
  as_cuda_matrix(grad, "grad");
  check_same_shape(grad, x, "grad", "x");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype dy_dtype = to_tf_dtype(grad.scalar_type(), "grad");
  const tf_activation act = to_activation(activation);
  tf_dtype bias_dtype = TF_FLOAT32;
  ScalarType dbias_type = grad.scalar_type();
  if (bias.has_value()) {
    check_vector(*bias, m.cols, x, "bias");
    bias_dtype = to_tf_dtype(bias->scalar_type(), "bias");
    dbias_type = bias->scalar_type();
  }
  const DeviceGuard guard(x.get_device_index());
  Output dx = make_output(x, x.sizes(), grad.scalar_type(), fp8_dtype, scale, amax);
  const int64_t bands = compute_dbias ? tf_ops_cuda_bands(m.rows) : 0;
  Tensor partials = new_empty(x, {bands * m.cols}, ScalarType::Float);
  Tensor dbias = new_empty(x, {compute_dbias ? m.cols : 0}, dbias_type);
  check_status(tf_act_bias_backward_cuda(grad.const_data_ptr(), dy_dtype, x.const_data_ptr(), dtype,
                                         bias ? bias->const_data_ptr() : nullptr, bias_dtype, m.rows, m.cols, act,
                                         &dx.desc, compute_dbias ? partials.mutable_data_ptr<float>() : nullptr,
                                         compute_dbias ? dbias.mutable_data_ptr() : nullptr,
                                         to_tf_dtype(dbias_type, "dbias"), current_cuda_stream(x, "x")),
               "act_bias_backward");
  return std::make_tuple(dx.tensor, dbias);
}

Tensor gated_act_forward_impl(const Tensor& x, int64_t activation, const std::optional<ScalarType>& fp8_dtype,
                              const std::optional<Tensor>& scale, const std::optional<Tensor>& amax) {
  const Matrix m = as_cuda_matrix(x, "x");
  const tf_activation act = to_gated_activation(activation);
  const std::vector<int64_t> sizes = gated_output_shape(x, m);
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const DeviceGuard guard(x.get_device_index());
  Output y = make_output(x, sizes, x.scalar_type(), fp8_dtype, scale, amax);
  check_status(tf_gated_act_forward_cuda(x.const_data_ptr(), dtype, m.rows, m.cols / 2, act, &y.desc,
                                         current_cuda_stream(x, "x")),
               "gated_act_forward");
  return y.tensor;
}

Tensor gated_act_forward_cuda(Tensor x, int64_t activation) {
  return gated_act_forward_impl(x, activation, std::nullopt, std::nullopt, std::nullopt);
}

Tensor gated_act_forward_fp8_cuda(Tensor x, int64_t activation, ScalarType fp8_dtype, Tensor scale, Tensor amax) {
  return gated_act_forward_impl(x, activation, fp8_dtype, scale, amax);
}

Tensor gated_act_backward_cuda(Tensor grad, Tensor x, int64_t activation) {
  const Matrix m = as_cuda_matrix(x, "x");
  STD_TORCH_CHECK(grad.is_cuda(), "grad must be a CUDA tensor");
  const Matrix g = check_gated_grad(grad, x, m);
  const tf_activation act = to_gated_activation(activation);
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype dy_dtype = to_tf_dtype(grad.scalar_type(), "grad");
  const DeviceGuard guard(x.get_device_index());
  Tensor dx = new_empty(x, x.sizes(), grad.scalar_type());
  check_status(tf_gated_act_backward_cuda(grad.const_data_ptr(), dy_dtype, x.const_data_ptr(), dtype, g.rows, g.cols,
                                          act, dx.mutable_data_ptr(), current_cuda_stream(x, "x")),
               "gated_act_backward");
  return dx;
}

// LayerNorm when beta is given, RMSNorm otherwise; returns y, mean (LayerNorm) and rstd.
std::tuple<Tensor, std::optional<Tensor>, Tensor> norm_forward(
    const Tensor& x, const Tensor& weight, const std::optional<Tensor>& beta, double eps, bool zero_centered_gamma,
    const std::optional<ScalarType>& fp8_dtype, const std::optional<Tensor>& scale,
    const std::optional<Tensor>& amax) {
  const Matrix m = as_cuda_matrix(x, "x");
  check_vector(weight, m.cols, x, "weight");
  if (beta.has_value()) {
    check_vector(*beta, m.cols, x, "bias");
    STD_TORCH_CHECK(weight.scalar_type() == beta->scalar_type(), "weight and bias must share a dtype");
  }
  STD_TORCH_CHECK(eps >= 0.0, "eps must be >= 0");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype pdtype = to_tf_dtype(weight.scalar_type(), "weight");
  const DeviceGuard guard(x.get_device_index());
  Output y = make_output(x, x.sizes(), x.scalar_type(), fp8_dtype, scale, amax);
  std::optional<Tensor> mean;
  if (beta.has_value()) mean = new_empty(x, row_shape(x), ScalarType::Float);
  Tensor rstd = new_empty(x, row_shape(x), ScalarType::Float);
  check_status(tf_norm_forward_cuda(x.const_data_ptr(), dtype, weight.const_data_ptr(),
                                    beta ? beta->const_data_ptr() : nullptr, pdtype, zero_centered_gamma,
                                    static_cast<float>(eps), m.rows, m.cols, &y.desc,
                                    mean ? mean->mutable_data_ptr<float>() : nullptr,
                                    rstd.mutable_data_ptr<float>(), current_cuda_stream(x, "x")),
               "norm_forward");
  return std::make_tuple(y.tensor, mean, rstd);
}

std::tuple<Tensor, Tensor> rmsnorm_forward_cuda(Tensor x, Tensor weight, double eps, bool zero_centered_gamma,
                                                std::optional<ScalarType> fp8_dtype, std::optional<Tensor> scale,
                                                std::optional<Tensor> amax) {
  auto [y, mean, rstd] = norm_forward(x, weight, std::nullopt, eps, zero_centered_gamma, fp8_dtype, scale, amax);
  return std::make_tuple(y, rstd);
}

std::tuple<Tensor, Tensor, Tensor> layernorm_forward_cuda(Tensor x, Tensor weight, Tensor bias, double eps,
                                                          bool zero_centered_gamma,
                                                          std::optional<ScalarType> fp8_dtype,
                                                          std::optional<Tensor> scale, std::optional<Tensor> amax) {
  auto [y, mean, rstd] = norm_forward(x, weight, bias, eps, zero_centered_gamma, fp8_dtype, scale, amax);
  return std::make_tuple(y, *mean, rstd);
}

// LayerNorm when mean is given, RMSNorm otherwise; returns dx, dweight and dbias (LayerNorm).
std::tuple<Tensor, Tensor, std::optional<Tensor>> norm_backward(const Tensor& grad, const Tensor& x,
                                                                const std::optional<Tensor>& mean,
                                                                const Tensor& rstd, const Tensor& weight,
                                                                bool zero_centered_gamma) {
  const Matrix m = as_cuda_matrix(x, "x");
  as_cuda_matrix(grad, "grad");
  check_same_shape(grad, x, "grad", "x");
  check_vector(weight, m.cols, x, "weight");
  if (mean.has_value()) check_stats(*mean, m, x, "mean");
  check_stats(rstd, m, x, "rstd");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype dy_dtype = to_tf_dtype(grad.scalar_type(), "grad");
  const tf_dtype pdtype = to_tf_dtype(weight.scalar_type(), "weight");
  const DeviceGuard guard(x.get_device_index());
  Tensor dx = new_empty(x, x.sizes(), grad.scalar_type());
  const int64_t bands = tf_ops_cuda_bands(m.rows);
  Tensor partials = new_empty(x, {2 * bands * m.cols}, ScalarType::Float);
  Tensor dweight = new_empty(x, {m.cols}, weight.scalar_type());
  std::optional<Tensor> dbias;
  if (mean.has_value()) dbias = new_empty(x, {m.cols}, weight.scalar_type());
  check_status(tf_norm_backward_cuda(grad.const_data_ptr(), dy_dtype, x.const_data_ptr(), dtype,
                                     mean ? mean->const_data_ptr<float>() : nullptr, rstd.const_data_ptr<float>(),
                                     weight.const_data_ptr(), pdtype, zero_centered_gamma, m.rows, m.cols,
                                     dx.mutable_data_ptr(), partials.mutable_data_ptr<float>(),
                                     dweight.mutable_data_ptr(), dbias ? dbias->mutable_data_ptr() : nullptr,
                                     current_cuda_stream(x, "x")),
               "norm_backward");
  return std::make_tuple(dx, dweight, dbias);
}

std::tuple<Tensor, Tensor> rmsnorm_backward_cuda(Tensor grad, Tensor x, Tensor rstd, Tensor weight,
                                                 bool zero_centered_gamma) {
  auto [dx, dweight, dbias] = norm_backward(grad, x, std::nullopt, rstd, weight, zero_centered_gamma);
  return std::make_tuple(dx, dweight);
}

std::tuple<Tensor, Tensor, Tensor> layernorm_backward_cuda(Tensor grad, Tensor x, Tensor mean, Tensor rstd,
                                                           Tensor weight, bool zero_centered_gamma) {
  auto [dx, dweight, dbias] = norm_backward(grad, x, mean, rstd, weight, zero_centered_gamma);
  return std::make_tuple(dx, dweight, *dbias);
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CUDA, m) {
  m.impl("bias_act_forward", TORCH_BOX(&te_fuser::bias_act_forward_cuda));
  m.impl("bias_act_forward_fp8", TORCH_BOX(&te_fuser::bias_act_forward_fp8_cuda));
  m.impl("act_bias_backward", TORCH_BOX(&te_fuser::act_bias_backward_cuda));
  m.impl("gated_act_forward", TORCH_BOX(&te_fuser::gated_act_forward_cuda));
  m.impl("gated_act_forward_fp8", TORCH_BOX(&te_fuser::gated_act_forward_fp8_cuda));
  m.impl("gated_act_backward", TORCH_BOX(&te_fuser::gated_act_backward_cuda));
  m.impl("rmsnorm_forward", TORCH_BOX(&te_fuser::rmsnorm_forward_cuda));
  m.impl("rmsnorm_backward", TORCH_BOX(&te_fuser::rmsnorm_backward_cuda));
  m.impl("layernorm_forward", TORCH_BOX(&te_fuser::layernorm_forward_cuda));
  m.impl("layernorm_backward", TORCH_BOX(&te_fuser::layernorm_backward_cuda));
}

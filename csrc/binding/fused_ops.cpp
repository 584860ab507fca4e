// Schemas of the fused element-wise and normalization ops (bias + activation,
// activation gradient + bias gradient, the gated activations, RMSNorm, LayerNorm) and their
// CPU implementations over row bands of the C core in csrc/ops.
//
// Every tensor argument is viewed as (numel / last dim) x (last dim). Forward
// ops may write FP8 directly: given fp8_dtype, scale and amax, the output holds
// FP8 codes of value * scale and amax <- max(amax, max |value|) in place.
#include <optional>
#include <vector>

#include "fused_checks.h"

extern "C" {
#include "../ops/activation.h"
#include "../ops/norm.h"
}

namespace te_fuser {
namespace {

// Rows per band: about kGrainElements elements, and at most kMaxBands bands so
// the per-band partial sums stay small. Depends on the shape only, which keeps
// the reductions independent of the thread count.
constexpr int64_t kMaxBands = 256;

int64_t band_rows(Matrix m) {
  const int64_t by_grain = kGrainElements / (m.cols > 0 ? m.cols : 1) + 1;
  const int64_t by_cap = (m.rows + kMaxBands - 1) / kMaxBands;
  return by_grain > by_cap ? by_grain : by_cap;
}

// Runs fn(band, row_begin, row_end, &amax_bits) -> tf_status over all bands on
// the thread pool; statuses are checked after the parallel region. Returns the
// combined amax bits.
template <class F>
uint32_t parallel_bands(Matrix m, const char* what, const F& fn) {
  const int64_t band = band_rows(m);
  const int64_t bands = (m.rows + band - 1) / band;
  std::vector<uint32_t> partial(static_cast<size_t>(bands), 0u);
  std::vector<int> status(static_cast<size_t>(bands), TF_OK);
  torch::stable::parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * band;
      const int64_t r1 = m.rows - r0 < band ? m.rows : r0 + band;
      status[b] = fn(b, r0, r1, &partial[b]);
    }
  });
  uint32_t amax = 0;
  for (int64_t b = 0; b < bands; ++b) {
    check_status(static_cast<tf_status>(status[b]), what);
    amax = partial[b] > amax ? partial[b] : amax;
  }
  return amax;
}

int64_t num_bands(Matrix m) {
  const int64_t band = band_rows(m);
  return (m.rows + band - 1) / band;
}

// Sums float32 partial rows (bands x cols) in band order into a new cols tensor of out_dtype.
Tensor sum_partials(const Tensor& partials, int64_t bands, int64_t cols, ScalarType out_dtype) {
  Tensor out = new_empty(partials, {cols}, out_dtype);
  check_status(tf_ops_sum_partials(partials.const_data_ptr<float>(), bands, cols, 0, cols,
                                   out.mutable_data_ptr(), to_tf_dtype(out_dtype, "out_dtype")),
               "sum of partial reductions");
  return out;
}

// The main output of a forward op: FP8 when fp8_dtype is given, else like_dtype.
struct OutputSpec {
  tf_ops_output desc;
  ScalarType scalar_type;
  std::optional<Tensor> amax;
};

OutputSpec output_spec(const Tensor& input, ScalarType like_dtype,
                       const std::optional<ScalarType>& fp8_dtype,
                       const std::optional<Tensor>& scale, const std::optional<Tensor>& amax) {
  OutputSpec spec{{nullptr, TF_FLOAT32, 0, TF_FP8_E4M3, 1.0f}, like_dtype, std::nullopt};
  if (!fp8_dtype.has_value()) {
    STD_TORCH_CHECK(!scale.has_value() && !amax.has_value(),
                    "scale and amax are only accepted together with fp8_dtype");
    spec.desc.dtype = to_tf_dtype(like_dtype, "output dtype");
    return spec;
  }
  STD_TORCH_CHECK(scale.has_value() && amax.has_value(),
                  "an FP8 output (fp8_dtype given) needs both scale and amax");
  check_scalar_f32(*scale, "scale");
  check_scalar_f32(*amax, "amax");
  check_same_device(input, *scale, "input", "scale");
  check_same_device(input, *amax, "input", "amax");
  spec.desc.fp8 = 1;
  spec.desc.format = to_tf_fp8_format(*fp8_dtype, "fp8_dtype");
  spec.desc.scale = *scale->const_data_ptr<float>();
  spec.scalar_type = *fp8_dtype;
  spec.amax = amax;
  return spec;
}

Tensor allocate_output(OutputSpec& spec, const Tensor& like, torch::headeronly::IntHeaderOnlyArrayRef sizes) {
  Tensor out = new_empty(like, sizes, spec.scalar_type);
  spec.desc.data = out.mutable_data_ptr();
  return out;
}

void finish_output(const OutputSpec& spec, uint32_t bits) {
  if (!spec.amax.has_value()) return;
  float* p = spec.amax->mutable_data_ptr<float>();
  const uint32_t old = tf_f32_bits(*p) & 0x7FFFFFFFu;
  *p = tf_f32_from_bits(bits > old ? bits : old);
}

Tensor bias_act_forward_impl(const Tensor& x, const std::optional<Tensor>& bias, int64_t activation,
                             const std::optional<ScalarType>& fp8_dtype, const std::optional<Tensor>& scale,
                             const std::optional<Tensor>& amax) {
  const Matrix m = as_matrix(x, "x");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_activation act = to_activation(activation);
  tf_dtype bias_dtype = TF_FLOAT32;
  const void* b = nullptr;
  if (bias.has_value()) {
    check_vector(*bias, m.cols, x, "bias");
    bias_dtype = to_tf_dtype(bias->scalar_type(), "bias");
    b = bias->const_data_ptr();
  }
  OutputSpec spec = output_spec(x, x.scalar_type(), fp8_dtype, scale, amax);
  Tensor out = allocate_output(spec, x, x.sizes());
  const void* xp = x.const_data_ptr();
  const uint32_t bits = parallel_bands(m, "bias_act_forward", [&](int64_t, int64_t r0, int64_t r1, uint32_t* a) {
    return tf_bias_act_forward(xp, dtype, b, bias_dtype, m.rows, m.cols, r0, r1, act, &spec.desc, a);
  });
  finish_output(spec, bits);
  return out;
}

std::tuple<Tensor, Tensor> act_bias_backward_cpu(Tensor grad, Tensor x, std::optional<Tensor> bias,
                                                 int64_t activation, bool compute_dbias,
                                                 std::optional<ScalarType> fp8_dtype,
                                                 std::optional<Tensor> scale,
                                                 std::optional<Tensor> amax) {
  const Matrix m = as_matrix(x, "x");
  as_matrix(grad, "grad");
  check_same_shape(grad, x, "grad", "x");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype dy_dtype = to_tf_dtype(grad.scalar_type(), "grad");
  const tf_activation act = to_activation(activation);
  tf_dtype bias_dtype = TF_FLOAT32;
  const void* b = nullptr;
  ScalarType dbias_type = grad.scalar_type();
  if (bias.has_value()) {
    check_vector(*bias, m.cols, x, "bias");
    bias_dtype = to_tf_dtype(bias->scalar_type(), "bias");
    b = bias->const_data_ptr();
    dbias_type = bias->scalar_type();
  }
  OutputSpec spec = output_spec(x, grad.scalar_type(), fp8_dtype, scale, amax);
  Tensor dx = allocate_output(spec, x, x.sizes());
  const int64_t bands = compute_dbias ? num_bands(m) : 0;
  Tensor partials = new_empty(x, {bands, m.cols}, ScalarType::Float);
  float* part = compute_dbias ? partials.mutable_data_ptr<float>() : nullptr;
  const void* dyp = grad.const_data_ptr();
  const void* xp = x.const_data_ptr();
  const uint32_t bits = parallel_bands(m, "act_bias_backward", [&](int64_t band, int64_t r0, int64_t r1, uint32_t* a) {
    return tf_act_bias_backward(dyp, dy_dtype, xp, dtype, b, bias_dtype, m.rows, m.cols, r0, r1,
                                act, &spec.desc, part ? part + band * m.cols : nullptr, a);
  });
  finish_output(spec, bits);
  Tensor dbias = compute_dbias ? sum_partials(partials, bands, m.cols, dbias_type)
                               : new_empty(x, {0}, dbias_type);
  return std::make_tuple(dx, dbias);
}

Tensor gated_act_forward_impl(const Tensor& x, int64_t activation, const std::optional<ScalarType>& fp8_dtype,
                              const std::optional<Tensor>& scale, const std::optional<Tensor>& amax) {
  const Matrix m = as_matrix(x, "x");
  const tf_activation act = to_gated_activation(activation);
  const std::vector<int64_t> sizes = gated_output_shape(x, m);
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  OutputSpec spec = output_spec(x, x.scalar_type(), fp8_dtype, scale, amax);
  Tensor out = allocate_output(spec, x, sizes);
  const Matrix half{m.rows, m.cols / 2};
  const void* xp = x.const_data_ptr();
  const uint32_t bits = parallel_bands(m, "gated_act_forward", [&](int64_t, int64_t r0, int64_t r1, uint32_t* a) {
    return tf_gated_act_forward(xp, dtype, half.rows, half.cols, r0, r1, act, &spec.desc, a);
  });
  finish_output(spec, bits);
  return out;
}

// Single-output ops come in a high-precision and an FP8 variant: inductor cannot lower a
// single-output op whose mutable argument (amax) is optional.
Tensor bias_act_forward_cpu(Tensor x, std::optional<Tensor> bias, int64_t activation) {
  return bias_act_forward_impl(x, bias, activation, std::nullopt, std::nullopt, std::nullopt);
}

Tensor bias_act_forward_fp8_cpu(Tensor x, std::optional<Tensor> bias, int64_t activation,
                                ScalarType fp8_dtype, Tensor scale, Tensor amax) {
  return bias_act_forward_impl(x, bias, activation, fp8_dtype, scale, amax);
}

Tensor gated_act_forward_cpu(Tensor x, int64_t activation) {
  return gated_act_forward_impl(x, activation, std::nullopt, std::nullopt, std::nullopt);
}

Tensor gated_act_forward_fp8_cpu(Tensor x, int64_t activation, ScalarType fp8_dtype, Tensor scale, Tensor amax) {
  return gated_act_forward_impl(x, activation, fp8_dtype, scale, amax);
}

Tensor gated_act_backward_cpu(Tensor grad, Tensor x, int64_t activation) {
  const Matrix m = as_matrix(x, "x");
  const Matrix g = check_gated_grad(grad, x, m);
  const tf_activation act = to_gated_activation(activation);
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype dy_dtype = to_tf_dtype(grad.scalar_type(), "grad");
  OutputSpec spec = output_spec(x, grad.scalar_type(), std::nullopt, std::nullopt, std::nullopt);
  Tensor dx = allocate_output(spec, x, x.sizes());
  const void* dyp = grad.const_data_ptr();
  const void* xp = x.const_data_ptr();
  parallel_bands(m, "gated_act_backward", [&](int64_t, int64_t r0, int64_t r1, uint32_t* a) {
    return tf_gated_act_backward(dyp, dy_dtype, xp, dtype, g.rows, g.cols, r0, r1, act, &spec.desc, a);
  });
  return dx;
}

std::tuple<Tensor, Tensor> rmsnorm_forward_cpu(Tensor x, Tensor weight, double eps,
                                               bool zero_centered_gamma,
                                               std::optional<ScalarType> fp8_dtype,
                                               std::optional<Tensor> scale,
                                               std::optional<Tensor> amax) {
  const Matrix m = as_matrix(x, "x");
  check_vector(weight, m.cols, x, "weight");
  STD_TORCH_CHECK(eps >= 0.0, "eps must be >= 0");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype pdtype = to_tf_dtype(weight.scalar_type(), "weight");
  OutputSpec spec = output_spec(x, x.scalar_type(), fp8_dtype, scale, amax);
  Tensor y = allocate_output(spec, x, x.sizes());
  Tensor rstd = new_empty(x, row_shape(x), ScalarType::Float);
  const void* xp = x.const_data_ptr();
  const void* wp = weight.const_data_ptr();
  float* rp = rstd.mutable_data_ptr<float>();
  const uint32_t bits = parallel_bands(m, "rmsnorm_forward", [&](int64_t, int64_t r0, int64_t r1, uint32_t* a) {
    return tf_rmsnorm_forward(xp, dtype, wp, pdtype, zero_centered_gamma, static_cast<float>(eps),
                              m.rows, m.cols, r0, r1, &spec.desc, rp, a);
  });
  finish_output(spec, bits);
  return std::make_tuple(y, rstd);
}

std::tuple<Tensor, Tensor, Tensor> layernorm_forward_cpu(Tensor x, Tensor weight, Tensor bias,
                                                         double eps, bool zero_centered_gamma,
                                                         std::optional<ScalarType> fp8_dtype,
                                                         std::optional<Tensor> scale,
                                                         std::optional<Tensor> amax) {
  const Matrix m = as_matrix(x, "x");
  check_vector(weight, m.cols, x, "weight");
  check_vector(bias, m.cols, x, "bias");
  STD_TORCH_CHECK(weight.scalar_type() == bias.scalar_type(), "weight and bias must share a dtype");
  STD_TORCH_CHECK(eps >= 0.0, "eps must be >= 0");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype pdtype = to_tf_dtype(weight.scalar_type(), "weight");
  OutputSpec spec = output_spec(x, x.scalar_type(), fp8_dtype, scale, amax);
  Tensor y = allocate_output(spec, x, x.sizes());
  Tensor mean = new_empty(x, row_shape(x), ScalarType::Float);
  Tensor rstd = new_empty(x, row_shape(x), ScalarType::Float);
  const void* xp = x.const_data_ptr();
  const void* wp = weight.const_data_ptr();
  const void* bp = bias.const_data_ptr();
  float* mp = mean.mutable_data_ptr<float>();
  float* rp = rstd.mutable_data_ptr<float>();
  const uint32_t bits = parallel_bands(m, "layernorm_forward", [&](int64_t, int64_t r0, int64_t r1, uint32_t* a) {
    return tf_layernorm_forward(xp, dtype, wp, bp, pdtype, zero_centered_gamma,
                                static_cast<float>(eps), m.rows, m.cols, r0, r1, &spec.desc, mp,
                                rp, a);
  });
  finish_output(spec, bits);
  return std::make_tuple(y, mean, rstd);
}

std::tuple<Tensor, Tensor> rmsnorm_backward_cpu(Tensor grad, Tensor x, Tensor rstd, Tensor weight,
                                                bool zero_centered_gamma) {
  const Matrix m = as_matrix(x, "x");
  as_matrix(grad, "grad");
  check_same_shape(grad, x, "grad", "x");
  check_vector(weight, m.cols, x, "weight");
  check_stats(rstd, m, x, "rstd");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype dy_dtype = to_tf_dtype(grad.scalar_type(), "grad");
  const tf_dtype pdtype = to_tf_dtype(weight.scalar_type(), "weight");
  Tensor dx = new_empty(x, x.sizes(), grad.scalar_type());
  const int64_t bands = num_bands(m);
  Tensor partials = new_empty(x, {bands, m.cols}, ScalarType::Float);
  const void* dyp = grad.const_data_ptr();
  const void* xp = x.const_data_ptr();
  const void* wp = weight.const_data_ptr();
  const float* rp = rstd.const_data_ptr<float>();
  void* dxp = dx.mutable_data_ptr();
  float* part = partials.mutable_data_ptr<float>();
  parallel_bands(m, "rmsnorm_backward", [&](int64_t band, int64_t r0, int64_t r1, uint32_t*) {
    return tf_rmsnorm_backward(dyp, dy_dtype, xp, dtype, rp, wp, pdtype, zero_centered_gamma,
                               m.rows, m.cols, r0, r1, dxp, dy_dtype, part + band * m.cols);
  });
  return std::make_tuple(dx, sum_partials(partials, bands, m.cols, weight.scalar_type()));
}

std::tuple<Tensor, Tensor, Tensor> layernorm_backward_cpu(Tensor grad, Tensor x, Tensor mean,
                                                          Tensor rstd, Tensor weight,
                                                          bool zero_centered_gamma) {
  const Matrix m = as_matrix(x, "x");
  as_matrix(grad, "grad");
  check_same_shape(grad, x, "grad", "x");
  check_vector(weight, m.cols, x, "weight");
  check_stats(mean, m, x, "mean");
  check_stats(rstd, m, x, "rstd");
  const tf_dtype dtype = to_tf_dtype(x.scalar_type(), "x");
  const tf_dtype dy_dtype = to_tf_dtype(grad.scalar_type(), "grad");
  const tf_dtype pdtype = to_tf_dtype(weight.scalar_type(), "weight");
  Tensor dx = new_empty(x, x.sizes(), grad.scalar_type());
  const int64_t bands = num_bands(m);
  Tensor dgamma_parts = new_empty(x, {bands, m.cols}, ScalarType::Float);
  Tensor dbeta_parts = new_empty(x, {bands, m.cols}, ScalarType::Float);
  const void* dyp = grad.const_data_ptr();
  const void* xp = x.const_data_ptr();
  const void* wp = weight.const_data_ptr();
  const float* mp = mean.const_data_ptr<float>();
  const float* rp = rstd.const_data_ptr<float>();
  void* dxp = dx.mutable_data_ptr();
  float* dg = dgamma_parts.mutable_data_ptr<float>();
  float* db = dbeta_parts.mutable_data_ptr<float>();
  parallel_bands(m, "layernorm_backward", [&](int64_t band, int64_t r0, int64_t r1, uint32_t*) {
    return tf_layernorm_backward(dyp, dy_dtype, xp, dtype, mp, rp, wp, pdtype, zero_centered_gamma,
                                 m.rows, m.cols, r0, r1, dxp, dy_dtype, dg + band * m.cols,
                                 db + band * m.cols);
  });
  return std::make_tuple(dx, sum_partials(dgamma_parts, bands, m.cols, weight.scalar_type()),
                         sum_partials(dbeta_parts, bands, m.cols, weight.scalar_type()));
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def("bias_act_forward(Tensor x, Tensor? bias, int activation) -> Tensor");
  m.def(
      "bias_act_forward_fp8(Tensor x, Tensor? bias, int activation, ScalarType fp8_dtype,"
      " Tensor scale, Tensor(a!) amax) -> Tensor");
  m.def(
      "act_bias_backward(Tensor grad, Tensor x, Tensor? bias, int activation, bool compute_dbias,"
      " ScalarType? fp8_dtype=None, Tensor? scale=None, Tensor(a!)? amax=None) -> (Tensor, Tensor)");
  m.def("gated_act_forward(Tensor x, int activation) -> Tensor");
  m.def(
      "gated_act_forward_fp8(Tensor x, int activation, ScalarType fp8_dtype, Tensor scale, Tensor(a!) amax)"
      " -> Tensor");
  m.def("gated_act_backward(Tensor grad, Tensor x, int activation) -> Tensor");
  m.def(
      "rmsnorm_forward(Tensor x, Tensor weight, float eps, bool zero_centered_gamma,"
      " ScalarType? fp8_dtype=None, Tensor? scale=None, Tensor(a!)? amax=None) -> (Tensor, Tensor)");
  m.def(
      "rmsnorm_backward(Tensor grad, Tensor x, Tensor rstd, Tensor weight,"
      " bool zero_centered_gamma) -> (Tensor, Tensor)");
  m.def(
      "layernorm_forward(Tensor x, Tensor weight, Tensor bias, float eps, bool zero_centered_gamma,"
      " ScalarType? fp8_dtype=None, Tensor? scale=None, Tensor(a!)? amax=None)"
      " -> (Tensor, Tensor, Tensor)");
  m.def(
      "layernorm_backward(Tensor grad, Tensor x, Tensor mean, Tensor rstd, Tensor weight,"
      " bool zero_centered_gamma) -> (Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CPU, m) {
  m.impl("bias_act_forward", TORCH_BOX(&te_fuser::bias_act_forward_cpu));
  m.impl("bias_act_forward_fp8", TORCH_BOX(&te_fuser::bias_act_forward_fp8_cpu));
  m.impl("act_bias_backward", TORCH_BOX(&te_fuser::act_bias_backward_cpu));
  m.impl("gated_act_forward", TORCH_BOX(&te_fuser::gated_act_forward_cpu));
  m.impl("gated_act_forward_fp8", TORCH_BOX(&te_fuser::gated_act_forward_fp8_cpu));
  m.impl("gated_act_backward", TORCH_BOX(&te_fuser::gated_act_backward_cpu));
  m.impl("rmsnorm_forward", TORCH_BOX(&te_fuser::rmsnorm_forward_cpu));
  m.impl("rmsnorm_backward", TORCH_BOX(&te_fuser::rmsnorm_backward_cpu));
  m.impl("layernorm_forward", TORCH_BOX(&te_fuser::layernorm_forward_cpu));
  m.impl("layernorm_backward", TORCH_BOX(&te_fuser::layernorm_backward_cpu));
}

// CUDA implementations of the FP8 quantizer ops (schemas in fp8_ops.cpp). They
// check their arguments like the CPU ones, then enqueue the kernels of
// csrc/cuda/fp8 on the current stream of the input's device. Scales are read
// on the device, so no op waits for the GPU.
#include "fp8_checks.h"

#include <torch/csrc/stable/accelerator.h>

#include "../cuda/fp8/fp8_cuda.h"

namespace te_fuser {
namespace {

using torch::stable::accelerator::DeviceGuard;

// The CPU reads the scale before it writes amax; GPU blocks overlap both.
void check_no_scale_amax_alias(const Tensor& scale, const Tensor& amax) {
  STD_TORCH_CHECK(scale.const_data_ptr() != amax.const_data_ptr(),
                  "scale and amax must not share memory on CUDA");
}

Tensor fp8_quantize_cuda(Tensor input, Tensor scale, Tensor amax, ScalarType fp8_dtype) {
  check_quantize_args(input, scale, amax);
  check_no_scale_amax_alias(scale, amax);
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const tf_fp8_format format = to_tf_fp8_format(fp8_dtype, "fp8_dtype");
  const DeviceGuard guard(input.get_device_index());
  void* stream = current_cuda_stream(input, "input");
  Tensor out = new_empty(input, input.sizes(), fp8_dtype);
  check_status(tf_fp8_quantize_cuda(input.const_data_ptr(), dtype, input.numel(),
                                    scale.const_data_ptr<float>(), format,
                                    static_cast<uint8_t*>(out.mutable_data_ptr()),
                                    amax.mutable_data_ptr<float>(), stream),
               "fp8_quantize");
  return out;
}

Tensor fp8_amax_cuda(Tensor input) {
  check_contiguous(input, "input");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const DeviceGuard guard(input.get_device_index());
  void* stream = current_cuda_stream(input, "input");
  // The kernel folds max |x| into the output, so it starts from 0 (the amax of nothing).
  Tensor out = torch::stable::new_zeros(input, {1}, ScalarType::Float);
  check_status(tf_fp8_amax_cuda(input.const_data_ptr(), dtype, input.numel(),
                                out.mutable_data_ptr<float>(), stream),
               "fp8_amax");
  return out;
}

Tensor fp8_dequantize_cuda(Tensor data, Tensor scale_inv, ScalarType out_dtype) {
  check_contiguous(data, "data");
  check_scalar_f32(scale_inv, "scale_inv");
  check_same_device(data, scale_inv, "data", "scale_inv");
  const tf_fp8_format format = to_tf_fp8_format(data.scalar_type(), "data");
  const tf_dtype dtype = to_tf_dtype(out_dtype, "out_dtype");
  const DeviceGuard guard(data.get_device_index());
  void* stream = current_cuda_stream(data, "data");
  Tensor out = new_empty(data, data.sizes(), out_dtype);
  check_status(tf_fp8_dequantize_cuda(static_cast<const uint8_t*>(data.const_data_ptr()), format,
                                      data.numel(), scale_inv.const_data_ptr<float>(),
                                      out.mutable_data_ptr(), dtype, stream),
               "fp8_dequantize");
  return out;
}

// input is viewed as a matrix of (numel / last dim) rows, as on the CPU.
std::tuple<Tensor, Tensor> fp8_cast_transpose_cuda(Tensor input, Tensor scale, Tensor amax,
                                                   ScalarType fp8_dtype) {
  check_quantize_args(input, scale, amax);
  check_no_scale_amax_alias(scale, amax);
  STD_TORCH_CHECK(input.dim() >= 2, "input must have at least 2 dimensions");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const tf_fp8_format format = to_tf_fp8_format(fp8_dtype, "fp8_dtype");
  const int64_t cols = input.size(input.dim() - 1);
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  const DeviceGuard guard(input.get_device_index());
  void* stream = current_cuda_stream(input, "input");
  Tensor out = new_empty(input, input.sizes(), fp8_dtype);
  Tensor out_t = new_empty(input, {cols, rows}, fp8_dtype);
  check_status(tf_fp8_cast_transpose_cuda(input.const_data_ptr(), dtype, rows, cols, cols,
                                          scale.const_data_ptr<float>(), format,
                                          static_cast<uint8_t*>(out.mutable_data_ptr()),
                                          static_cast<uint8_t*>(out_t.mutable_data_ptr()),
                                          amax.mutable_data_ptr<float>(), stream),
               "fp8_cast_transpose");
  return std::make_tuple(out, out_t);
}

void fp8_delayed_scaling_update_cuda(Tensor amax_history, Tensor scale, Tensor scale_inv,
                                     double fp8_max, int64_t margin, int64_t amax_compute_algo) {
  const int64_t n = check_scaling_update_args(amax_history, scale, scale_inv, margin);
  const DeviceGuard guard(amax_history.get_device_index());
  void* stream = current_cuda_stream(amax_history, "amax_history");
  check_status(tf_fp8_delayed_scaling_update_cuda(
                   amax_history.mutable_data_ptr<float>(), amax_history.size(0), n,
                   scale.mutable_data_ptr<float>(), scale_inv.mutable_data_ptr<float>(),
                   static_cast<float>(fp8_max), static_cast<int32_t>(margin),
                   static_cast<tf_amax_algo>(amax_compute_algo), stream),
               "fp8_delayed_scaling_update");
}

std::tuple<Tensor, Tensor> fp8_current_scale_cuda(Tensor amax, double fp8_max, double epsilon,
                                                  bool force_pow2) {
  check_scalar_f32(amax, "amax");
  const DeviceGuard guard(amax.get_device_index());
  void* stream = current_cuda_stream(amax, "amax");
  Tensor scale = new_empty(amax, {1}, ScalarType::Float);
  Tensor scale_inv = new_empty(amax, {1}, ScalarType::Float);
  check_status(tf_fp8_current_scale_cuda(amax.const_data_ptr<float>(), static_cast<float>(fp8_max),
                                         static_cast<float>(epsilon), force_pow2 ? 1 : 0,
                                         scale.mutable_data_ptr<float>(),
                                         scale_inv.mutable_data_ptr<float>(), stream),
               "fp8_current_scale");
  return std::make_tuple(scale, scale_inv);
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CUDA, m) {
  m.impl("fp8_quantize", TORCH_BOX(&te_fuser::fp8_quantize_cuda));
  m.impl("fp8_amax", TORCH_BOX(&te_fuser::fp8_amax_cuda));
  m.impl("fp8_dequantize", TORCH_BOX(&te_fuser::fp8_dequantize_cuda));
  m.impl("fp8_cast_transpose", TORCH_BOX(&te_fuser::fp8_cast_transpose_cuda));
  m.impl("fp8_delayed_scaling_update", TORCH_BOX(&te_fuser::fp8_delayed_scaling_update_cuda));
  m.impl("fp8_current_scale", TORCH_BOX(&te_fuser::fp8_current_scale_cuda));
}

// CUDA implementations of nvfp4_quantize (with given amaxes too), nvfp4_amax and nvfp4_dequantize
// (schemas and CPU versions in nvfp4_ops.cpp): the same argument checks and TE's output shapes, then
// the launchers of csrc/cuda/block on the current stream of the input's device. The amaxes stay on the
// device and the quantizer reads them there, so nothing waits for the GPU; for the same reason Inf or
// NaN input is not refused here, as the CPU op does from its amax: te_fuser.kernels.nvfp4.nvfp4_quantize
// refuses it before calling either.
#include <tuple>
#include <vector>

#include "binding_util.h"

#include <torch/csrc/stable/accelerator.h>

#include "../cuda/block/block_cuda.h"

namespace te_fuser {
namespace {

using torch::stable::accelerator::DeviceGuard;

constexpr int64_t kBlock = 16;

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

Tensor nothing(const Tensor& like, ScalarType dtype) { return new_empty(like, {0}, dtype); }

using Quantized = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// input's amax on the device (tf_nvfp4_amax_cuda; rht: of the transformed column blocks), into a new tensor.
Tensor device_amax(const Tensor& input, tf_dtype dtype, int64_t rows, int64_t cols, bool rht, void* stream) {
  Tensor a = torch::stable::new_zeros(input, {1}, ScalarType::Float);
  check_status(tf_nvfp4_amax_cuda(input.const_data_ptr(), dtype, rows, cols, cols, rht ? 1 : 0,
                                  a.mutable_data_ptr<float>(), stream),
               "nvfp4_quantize (amax)");
  return a;
}

// (data, scale, amax, columnwise data, columnwise scale, columnwise amax); an unused usage's are empty. The
// amaxes are given (a group's, as device tensors of one float32) or, when amax_given is null, the input's own.
Quantized quantize(const Tensor& input, bool rowwise, bool columnwise, bool block_2d, bool rht, bool stochastic,
                   int64_t seed, const Tensor* amax_given, const Tensor* amax_t_given) {
  check_contiguous(input, "input");
  STD_TORCH_CHECK(rowwise || columnwise, "at least one of rowwise and columnwise must be true");
  STD_TORCH_CHECK(!(block_2d && rht), "block_2d and rht cannot both be set (2D blocks are the weights', "
                                      "the Hadamard transform the wgrad operands')");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const auto [rows, cols] = matrix_of(input, "input");
  // Sizes not multiples of 16 quantize the zero-padded matrix, as the CPU op does (nvfp4_ops.cpp): the packed
  // rows hold cols_p values (rowwise) or rows_p (columnwise).
  const int64_t rows_p = round_up(rows, kBlock), cols_p = round_up(cols, kBlock);
  const DeviceGuard guard(input.get_device_index());
  void* stream = current_cuda_stream(input, "input");
  const void* x = input.const_data_ptr();
  // Each usage's amax in a tensor of its own (outputs must not alias each other or the inputs); 2D blocks
  // quantize both usages under the rowwise one.
  Tensor a = amax_given ? torch::stable::clone(*amax_given) : device_amax(input, dtype, rows, cols, false, stream);
  Tensor at = nothing(input, ScalarType::Float);
  if (columnwise)
    at = amax_given ? torch::stable::clone(*amax_t_given) : device_amax(input, dtype, rows, cols, rht, stream);
  const float* amax = a.const_data_ptr<float>();
  const float* amax_t = columnwise && !block_2d ? at.const_data_ptr<float>() : amax;
  const int64_t ld_scale = round_up(cols_p / kBlock, 4), ld_scale_t = round_up(rows_p / kBlock, 4);
  std::vector<int64_t> data_shape(input.sizes().begin(), input.sizes().end());
  data_shape.back() = cols_p / 2;
  Tensor y = rowwise ? new_empty(input, data_shape, ScalarType::Byte) : nothing(input, ScalarType::Byte);
  Tensor s = rowwise ? torch::stable::new_zeros(input, {round_up(rows, 128), ld_scale}, ScalarType::Byte)
                     : nothing(input, ScalarType::Byte);
  Tensor yt = columnwise ? new_empty(input, {cols, rows_p / 2}, ScalarType::Byte) : nothing(input, ScalarType::Byte);
  Tensor st = columnwise ? torch::stable::new_zeros(input, {round_up(cols, 128), ld_scale_t}, ScalarType::Byte)
                         : nothing(input, ScalarType::Byte);
  auto bytes = [](Tensor& t, bool used) { return used ? static_cast<uint8_t*>(t.mutable_data_ptr()) : nullptr; };
  check_status(tf_nvfp4_quantize_cuda(x, dtype, rows, cols, cols, block_2d ? 1 : 0, rht ? 1 : 0, stochastic ? 1 : 0,
                                      static_cast<uint64_t>(seed), amax, amax_t, bytes(y, rowwise), bytes(s, rowwise),
                                      ld_scale, bytes(yt, columnwise), bytes(st, columnwise), ld_scale_t, stream),
               "nvfp4_quantize");
  if (!rowwise) a = nothing(input, ScalarType::Float);
  return std::make_tuple(y, s, a, yt, st, at);
}

Quantized nvfp4_quantize_cuda(Tensor input, bool rowwise, bool columnwise, bool block_2d, bool rht, bool stochastic,
                              int64_t seed) {
  return quantize(input, rowwise, columnwise, block_2d, rht, stochastic, seed, nullptr, nullptr);
}

Quantized nvfp4_quantize_with_amax_cuda(Tensor input, Tensor amax, Tensor amax_t, bool rowwise, bool columnwise,
                                        bool block_2d, bool rht, bool stochastic, int64_t seed) {
  for (const Tensor* t : {&amax, &amax_t}) {
    const char* arg = t == &amax ? "amax" : "amax_t";
    check_same_device(input, *t, "input", arg);
    STD_TORCH_CHECK(t->numel() == 1 && t->scalar_type() == ScalarType::Float, arg, " must be one float32 value");
  }
  return quantize(input, rowwise, columnwise, block_2d, rht, stochastic, seed, &amax, &amax_t);
}

Tensor nvfp4_amax_cuda(Tensor input, bool rht) {
  check_contiguous(input, "input");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const auto [rows, cols] = matrix_of(input, "input");
  const DeviceGuard guard(input.get_device_index());
  return device_amax(input, dtype, rows, cols, rht, current_cuda_stream(input, "input"));
}

// The values of packed data (rows x cols / 2 bytes) under its scales and amax (read on the device).
Tensor nvfp4_dequantize_cuda(Tensor data, Tensor scale, Tensor amax, ScalarType out_dtype) {
  check_contiguous(data, "data");
  check_contiguous(scale, "scale");
  check_same_device(data, scale, "data", "scale");
  check_same_device(data, amax, "data", "amax");
  STD_TORCH_CHECK(data.dim() == 2 && data.scalar_type() == ScalarType::Byte, "data must be a 2-D uint8 tensor");
  STD_TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == ScalarType::Byte, "scale must be a 2-D uint8 tensor");
  STD_TORCH_CHECK(amax.numel() == 1 && amax.scalar_type() == ScalarType::Float, "amax must be one float32 value");
  const tf_dtype dtype = to_tf_dtype(out_dtype, "out_dtype");
  const int64_t rows = data.size(0), cols = data.size(1) * 2;
  STD_TORCH_CHECK(cols % kBlock == 0, "data must hold a multiple of 16 values per row, got ", cols);
  STD_TORCH_CHECK(scale.size(0) >= rows && scale.size(1) >= cols / kBlock, "scale of shape (", scale.size(0), ", ",
                  scale.size(1), ") does not cover data of ", rows, " x ", cols, " values");
  const DeviceGuard guard(data.get_device_index());
  void* stream = current_cuda_stream(data, "data");
  Tensor out = new_empty(data, {rows, cols}, out_dtype);
  check_status(tf_nvfp4_dequantize_cuda(static_cast<const uint8_t*>(data.const_data_ptr()), rows, cols,
                                        static_cast<const uint8_t*>(scale.const_data_ptr()), scale.size(1),
                                        amax.const_data_ptr<float>(), out.mutable_data_ptr(), dtype, stream),
               "nvfp4_dequantize");
  return out;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CUDA, m) {
  m.impl("nvfp4_quantize", TORCH_BOX(&te_fuser::nvfp4_quantize_cuda));
  m.impl("nvfp4_quantize_with_amax", TORCH_BOX(&te_fuser::nvfp4_quantize_with_amax_cuda));
  m.impl("nvfp4_amax", TORCH_BOX(&te_fuser::nvfp4_amax_cuda));
  m.impl("nvfp4_dequantize", TORCH_BOX(&te_fuser::nvfp4_dequantize_cuda));
}

// CUDA implementations of the block-scaled FP8 quantizer and dequantizer ops (schemas and CPU versions in
// fp8_block_ops.cpp): the same argument checks and TE's output shapes, then the launchers of
// csrc/cuda/block on the current stream of the input's device. Scale tensors are zeroed on the device
// first, so their padding matches the CPU's.
#include <tuple>
#include <vector>

#include "binding_util.h"

#include <torch/csrc/stable/accelerator.h>

#include "../cuda/block/block_cuda.h"

namespace te_fuser {
namespace {

using torch::stable::accelerator::DeviceGuard;

constexpr int64_t kMxBlock = 32, kBlockLen = 128;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

Tensor nothing(const Tensor& like) { return new_empty(like, {0}, ScalarType::Byte); }

template <class T>
T* ptr(Tensor& t, bool used) {
  return used ? static_cast<T*>(t.mutable_data_ptr()) : nullptr;
}

void check_usage(bool rowwise, bool columnwise) {
  STD_TORCH_CHECK(rowwise || columnwise, "at least one of rowwise and columnwise must be true");
}

std::tuple<Tensor, Tensor, Tensor, Tensor> mxfp8_quantize_cuda(Tensor input, ScalarType fp8_dtype, bool rowwise,
                                                               bool columnwise) {
  check_contiguous(input, "input");
  check_usage(rowwise, columnwise);
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const tf_fp8_format format = to_tf_fp8_format(fp8_dtype, "fp8_dtype");
  const auto [rows, cols] = matrix_of(input, "input");
  const DeviceGuard guard(input.get_device_index());
  void* stream = current_cuda_stream(input, "input");
  const int64_t ld_scale = round_up(ceil_div(cols, kMxBlock), 4), ld_scale_col = round_up(cols, 128);
  Tensor y = rowwise ? new_empty(input, input.sizes(), fp8_dtype) : nothing(input);
  Tensor s = rowwise ? torch::stable::new_zeros(input, {round_up(rows, 128), ld_scale}, ScalarType::Byte)
                     : nothing(input);
  Tensor yc = columnwise ? new_empty(input, input.sizes(), fp8_dtype) : nothing(input);
  Tensor sc = columnwise ? torch::stable::new_zeros(input, {round_up(ceil_div(rows, kMxBlock), 4), ld_scale_col},
                                                    ScalarType::Byte)
                         : nothing(input);
  check_status(tf_mxfp8_quantize_cuda(input.const_data_ptr(), dtype, rows, cols, cols, format,
                                      ptr<uint8_t>(y, rowwise), ptr<uint8_t>(s, rowwise), ld_scale,
                                      ptr<uint8_t>(yc, columnwise), ptr<uint8_t>(sc, columnwise), ld_scale_col,
                                      stream),
               "mxfp8_quantize");
  return std::make_tuple(y, s, yc, sc);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_block_quantize_cuda(Tensor input, ScalarType fp8_dtype,
                                                                   int64_t block_dim, double epsilon,
                                                                   bool force_pow_2_scales, bool rowwise,
                                                                   bool columnwise) {
  check_contiguous(input, "input");
  check_usage(rowwise, columnwise);
  STD_TORCH_CHECK(block_dim == 1 || block_dim == 2, "block_dim must be 1 or 2, got ", block_dim);
  STD_TORCH_CHECK(epsilon >= 0.0 && epsilon <= 3.4028234663852886e38, "epsilon must be finite and >= 0");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const tf_fp8_format format = to_tf_fp8_format(fp8_dtype, "fp8_dtype");
  const auto [rows, cols] = matrix_of(input, "input");
  const DeviceGuard guard(input.get_device_index());
  void* stream = current_cuda_stream(input, "input");
  const int64_t row_blocks = ceil_div(rows, kBlockLen), col_blocks = ceil_div(cols, kBlockLen);
  // TE's get_scale_shape, as on the CPU.
  const std::vector<int64_t> s_shape = block_dim == 1 ? std::vector<int64_t>{col_blocks, round_up(rows, 4)}
                                                      : std::vector<int64_t>{row_blocks, round_up(col_blocks, 4)};
  const std::vector<int64_t> st_shape = block_dim == 1 ? std::vector<int64_t>{row_blocks, round_up(cols, 4)}
                                                       : std::vector<int64_t>{col_blocks, round_up(row_blocks, 4)};
  std::vector<int64_t> t_shape{cols};
  for (int64_t d = 0; d + 1 < input.dim(); ++d) t_shape.push_back(input.size(d));
  Tensor y = rowwise ? new_empty(input, input.sizes(), fp8_dtype) : nothing(input);
  Tensor s = rowwise ? torch::stable::new_zeros(input, s_shape, ScalarType::Float) : nothing(input);
  Tensor yt = columnwise ? new_empty(input, t_shape, fp8_dtype) : nothing(input);
  Tensor st = columnwise ? torch::stable::new_zeros(input, st_shape, ScalarType::Float) : nothing(input);
  check_status(tf_fp8_block_quantize_cuda(input.const_data_ptr(), dtype, rows, cols, cols, format,
                                          static_cast<int>(block_dim), static_cast<float>(epsilon),
                                          force_pow_2_scales ? 1 : 0, ptr<uint8_t>(y, rowwise), ptr<float>(s, rowwise),
                                          s_shape[1], ptr<uint8_t>(yt, columnwise), ptr<float>(st, columnwise),
                                          st_shape[1], stream),
               "fp8_block_quantize");
  return std::make_tuple(y, s, yt, st);
}

Tensor block_dequantize_cuda(Tensor data, Tensor scale, int64_t block_rows, int64_t block_cols, bool scale_transposed,
                             ScalarType out_dtype) {
  check_contiguous(data, "data");
  check_contiguous(scale, "scale");
  check_same_device(data, scale, "data", "scale");
  STD_TORCH_CHECK(data.dim() == 2, "data must be 2-D");
  STD_TORCH_CHECK(scale.dim() == 2, "scale must be 2-D");
  const tf_fp8_format format = to_tf_fp8_format(data.scalar_type(), "data");
  const tf_dtype dtype = to_tf_dtype(out_dtype, "out_dtype");
  STD_TORCH_CHECK(scale.scalar_type() == ScalarType::Byte || scale.scalar_type() == ScalarType::Float,
                  "scale must be uint8 (E8M0 codes) or float32");
  const tf_block_scale_kind kind = scale.scalar_type() == ScalarType::Byte ? TF_BLOCK_SCALE_E8M0 : TF_BLOCK_SCALE_F32;
  const DeviceGuard guard(data.get_device_index());
  void* stream = current_cuda_stream(data, "data");
  const int64_t rows = data.size(0), cols = data.size(1);
  Tensor out = new_empty(data, {rows, cols}, out_dtype);
  check_status(tf_block_dequantize_cuda(static_cast<const uint8_t*>(data.const_data_ptr()), format, rows, cols,
                                        scale.const_data_ptr(), kind, scale.size(0), scale.size(1), block_rows,
                                        block_cols, scale_transposed ? 1 : 0, out.mutable_data_ptr(), dtype, stream),
               "block_dequantize");
  return out;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CUDA, m) {
  m.impl("mxfp8_quantize", TORCH_BOX(&te_fuser::mxfp8_quantize_cuda));
  m.impl("fp8_block_quantize", TORCH_BOX(&te_fuser::fp8_block_quantize_cuda));
  m.impl("block_dequantize", TORCH_BOX(&te_fuser::block_dequantize_cuda));
}

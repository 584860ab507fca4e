// Schemas of the block-scaled FP8 ops (MXFP8, Float8 block scaling, their dequantize) and their
// CPU implementations, which call csrc/fp8/fp8_block.h over bands of whole 128-row blocks spread
// on torch's intra-op thread pool. Scale tensors have TransformerEngine's shapes, their padding
// zeroed (docs/block_scaling.md).
#include <cstring>
#include <tuple>
#include <vector>

#include "binding_util.h"

extern "C" {
#include "../fp8/fp8_block.h"
}

namespace te_fuser {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// A new tensor of `sizes` filled with zero bytes: scale tensors, whose padding TE leaves undefined.
Tensor new_zeros(const Tensor& like, std::vector<int64_t> sizes, ScalarType dtype) {
  Tensor out = new_empty(like, sizes, dtype);
  const size_t element = dtype == ScalarType::Float ? 4 : 1;
  if (out.numel() > 0) std::memset(out.mutable_data_ptr(), 0, static_cast<size_t>(out.numel()) * element);
  return out;
}

Tensor nothing(const Tensor& like) { return new_empty(like, {0}, ScalarType::Byte); }

// fn(row_begin, row_end) -> tf_status over bands of whole multiples of 128 rows (about
// kGrainElements elements each) on the thread pool; statuses are checked after the region.
template <class F>
void parallel_row_bands(int64_t rows, int64_t cols, const char* what, const F& fn) {
  const int64_t unit = TF_FP8_BLOCK_LEN;
  const int64_t band = (kGrainElements / (cols > 0 ? cols : 1) / unit + 1) * unit;
  const int64_t bands = ceil_div(rows, band);
  std::vector<int> status(static_cast<size_t>(bands), TF_OK);
  torch::stable::parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) status[b] = fn(b * band, rows - b * band < band ? rows : (b + 1) * band);
  });
  for (int s : status) check_status(static_cast<tf_status>(s), what);
}

void check_usage(bool rowwise, bool columnwise) {
  STD_TORCH_CHECK(rowwise || columnwise, "at least one of rowwise and columnwise must be true");
}

// (data, scale, columnwise data, columnwise scale); an unused usage's pair is empty.
std::tuple<Tensor, Tensor, Tensor, Tensor> mxfp8_quantize_cpu(Tensor input, ScalarType fp8_dtype, bool rowwise,
                                                              bool columnwise) {
  check_contiguous(input, "input");
  check_usage(rowwise, columnwise);
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const tf_fp8_format format = to_tf_fp8_format(fp8_dtype, "fp8_dtype");
  const auto [rows, cols] = matrix_of(input, "input");
  const int64_t ld_scale = round_up(ceil_div(cols, TF_MXFP8_BLOCK), 4), ld_scale_col = round_up(cols, 128);
  Tensor y = rowwise ? new_empty(input, input.sizes(), fp8_dtype) : nothing(input);
  Tensor s = rowwise ? new_zeros(input, {round_up(rows, 128), ld_scale}, ScalarType::Byte) : nothing(input);
  Tensor yc = columnwise ? new_empty(input, input.sizes(), fp8_dtype) : nothing(input);
  Tensor sc = columnwise ? new_zeros(input, {round_up(ceil_div(rows, TF_MXFP8_BLOCK), 4), ld_scale_col},
                                     ScalarType::Byte)
                         : nothing(input);
  const void* x = input.const_data_ptr();
  auto bytes = [](Tensor& t, bool used) { return used ? static_cast<uint8_t*>(t.mutable_data_ptr()) : nullptr; };
  uint8_t *py = bytes(y, rowwise), *ps = bytes(s, rowwise), *pyc = bytes(yc, columnwise), *psc = bytes(sc, columnwise);
  parallel_row_bands(rows, cols, "mxfp8_quantize", [&](int64_t r0, int64_t r1) {
    return tf_mxfp8_quantize(x, dtype, rows, cols, cols, r0, r1, format, py, ps, ld_scale, pyc, psc, ld_scale_col);
  });
  return std::make_tuple(y, s, yc, sc);
}

// (data, scale_inv, transposed data, its scale_inv) in TE's layouts; an unused usage's pair is empty.
std::tuple<Tensor, Tensor, Tensor, Tensor> fp8_block_quantize_cpu(Tensor input, ScalarType fp8_dtype,
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
  const int64_t row_blocks = ceil_div(rows, TF_FP8_BLOCK_LEN), col_blocks = ceil_div(cols, TF_FP8_BLOCK_LEN);
  // TE's get_scale_shape: (blocks along the scaled dim, padded other dim) for 1D, blocks x blocks for 2D.
  const std::vector<int64_t> s_shape = block_dim == 1 ? std::vector<int64_t>{col_blocks, round_up(rows, 4)}
                                                      : std::vector<int64_t>{row_blocks, round_up(col_blocks, 4)};
  const std::vector<int64_t> st_shape = block_dim == 1 ? std::vector<int64_t>{row_blocks, round_up(cols, 4)}
                                                       : std::vector<int64_t>{col_blocks, round_up(row_blocks, 4)};
  std::vector<int64_t> t_shape{cols};
  for (int64_t d = 0; d + 1 < input.dim(); ++d) t_shape.push_back(input.size(d));
  Tensor y = rowwise ? new_empty(input, input.sizes(), fp8_dtype) : nothing(input);
  Tensor s = rowwise ? new_zeros(input, s_shape, ScalarType::Float) : nothing(input);
  Tensor yt = columnwise ? new_empty(input, t_shape, fp8_dtype) : nothing(input);
  Tensor st = columnwise ? new_zeros(input, st_shape, ScalarType::Float) : nothing(input);
  const void* x = input.const_data_ptr();
  uint8_t* py = rowwise ? static_cast<uint8_t*>(y.mutable_data_ptr()) : nullptr;
  float* ps = rowwise ? s.mutable_data_ptr<float>() : nullptr;
  uint8_t* pyt = columnwise ? static_cast<uint8_t*>(yt.mutable_data_ptr()) : nullptr;
  float* pst = columnwise ? st.mutable_data_ptr<float>() : nullptr;
  parallel_row_bands(rows, cols, "fp8_block_quantize", [&](int64_t r0, int64_t r1) {
    return tf_fp8_block_quantize(x, dtype, rows, cols, cols, r0, r1, format, static_cast<int>(block_dim),
                                 static_cast<float>(epsilon), force_pow_2_scales ? 1 : 0, py, ps, s_shape[1], pyt,
                                 pst, st_shape[1]);
  });
  return std::make_tuple(y, s, yt, st);
}

Tensor block_dequantize_cpu(Tensor data, Tensor scale, int64_t block_rows, int64_t block_cols, bool scale_transposed,
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
  const int64_t rows = data.size(0), cols = data.size(1);
  Tensor out = new_empty(data, {rows, cols}, out_dtype);
  const uint8_t* y = static_cast<const uint8_t*>(data.const_data_ptr());
  const void* sp = scale.const_data_ptr();
  void* x = out.mutable_data_ptr();
  parallel_row_bands(rows, cols, "block_dequantize", [&](int64_t r0, int64_t r1) {
    return tf_block_dequantize(y, format, rows, cols, r0, r1, sp, kind, scale.size(0), scale.size(1), block_rows,
                               block_cols, scale_transposed ? 1 : 0, x, dtype);
  });
  return out;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def(
      "mxfp8_quantize(Tensor input, ScalarType fp8_dtype, bool rowwise, bool columnwise)"
      " -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "fp8_block_quantize(Tensor input, ScalarType fp8_dtype, int block_dim, float epsilon,"
      " bool force_pow_2_scales, bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "block_dequantize(Tensor data, Tensor scale, int block_rows, int block_cols, bool scale_transposed,"
      " ScalarType out_dtype) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CPU, m) {
  m.impl("mxfp8_quantize", TORCH_BOX(&te_fuser::mxfp8_quantize_cpu));
  m.impl("fp8_block_quantize", TORCH_BOX(&te_fuser::fp8_block_quantize_cpu));
  m.impl("block_dequantize", TORCH_BOX(&te_fuser::block_dequantize_cpu));
}

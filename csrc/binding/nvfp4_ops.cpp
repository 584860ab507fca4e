// Schemas of the NVFP4 ops (quantize, with given amaxes too, amax, dequantize, unpack) and their CPU
// implementations, which call csrc/fp4/nvfp4.h over bands of whole 16-row blocks spread on torch's
// intra-op thread pool. Data and scale tensors have TransformerEngine's shapes, the scales' padding
// zeroed (docs/block_scaling.md, "NVFP4").
#include <cstring>
#include <tuple>
#include <vector>

#include "binding_util.h"

extern "C" {
#include "../fp4/nvfp4.h"
}

namespace te_fuser {
namespace {

int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

Tensor zeroed_bytes(const Tensor& like, std::vector<int64_t> sizes) {
  Tensor out = new_empty(like, sizes, ScalarType::Byte);
  if (out.numel() > 0) std::memset(out.mutable_data_ptr(), 0, static_cast<size_t>(out.numel()));
  return out;
}

Tensor nothing(const Tensor& like) { return new_empty(like, {0}, ScalarType::Byte); }

// fn(row_begin, row_end) -> tf_status over bands of whole multiples of 16 rows (the last one up to rows) on the
// thread pool.
template <class F>
void parallel_row_bands(int64_t rows, int64_t cols, const char* what, const F& fn) {
  const int64_t unit = TF_NVFP4_BLOCK;
  const int64_t band = (kGrainElements / (cols > 0 ? cols : 1) / unit + 1) * unit;
  const int64_t bands = (rows + band - 1) / band;
  std::vector<int> status(static_cast<size_t>(bands), TF_OK);
  torch::stable::parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) status[b] = fn(b, b * band, rows - b * band < band ? rows : (b + 1) * band);
  });
  for (int s : status) check_status(static_cast<tf_status>(s), what);
}

// The amax of the band maxima, NaN above Inf above every finite value (as the C amax orders them).
float band_amax(const void* x, tf_dtype dtype, int64_t rows, int64_t cols, int rht) {
  const int64_t band_rows = (kGrainElements / (cols > 0 ? cols : 1) / TF_NVFP4_BLOCK + 1) * TF_NVFP4_BLOCK;
  std::vector<float> part(static_cast<size_t>((rows + band_rows - 1) / band_rows), 0.0f);
  parallel_row_bands(rows, cols, "nvfp4_quantize (amax)", [&](int64_t b, int64_t r0, int64_t r1) {
    return tf_nvfp4_amax(x, dtype, rows, cols, cols, r0, r1, rht, &part[b]);
  });
  uint32_t best = 0;
  for (float p : part) {
    uint32_t bits;
    std::memcpy(&bits, &p, sizeof bits);
    best = bits > best ? bits : best;
  }
  float amax;
  std::memcpy(&amax, &best, sizeof amax);
  return amax;
}

Tensor scalar_f32(const Tensor& like, float v) {
  Tensor out = new_empty(like, {1}, ScalarType::Float);
  *out.mutable_data_ptr<float>() = v;
  return out;
}

using Quantized = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// One float32 value from a CPU tensor of one element, named in the error.
float given_amax(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.is_cpu(), arg, " must be a CPU tensor");
  STD_TORCH_CHECK(t.numel() == 1 && t.scalar_type() == ScalarType::Float, arg, " must be one float32 value");
  return *t.const_data_ptr<float>();
}

// (data, scale, amax, columnwise data, columnwise scale, columnwise amax); an unused usage's are empty. The
// amaxes are given (a group's, all-reduced) or, when amax is null, the input's own.
Quantized quantize(const Tensor& input, bool rowwise, bool columnwise, bool block_2d, bool rht, bool stochastic,
                   int64_t seed, const float* amax_given, const float* amax_t_given) {
  check_contiguous(input, "input");
  STD_TORCH_CHECK(rowwise || columnwise, "at least one of rowwise and columnwise must be true");
  STD_TORCH_CHECK(!(block_2d && rht), "block_2d and rht cannot both be set (2D blocks are the weights', "
                                      "the Hadamard transform the wgrad operands')");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const auto [rows, cols] = matrix_of(input, "input");
  // Sizes not multiples of 16 quantize the zero-padded matrix (nvfp4.h): the packed rows hold cols_p values.
  const int64_t rows_p = round_up(rows, TF_NVFP4_BLOCK), cols_p = round_up(cols, TF_NVFP4_BLOCK);
  const void* x = input.const_data_ptr();
  const float amax = amax_given ? *amax_given : band_amax(x, dtype, rows, cols, 0);
  const float amax_t = amax_given ? *amax_t_given : columnwise && rht ? band_amax(x, dtype, rows, cols, 1) : amax;
  STD_TORCH_CHECK(amax <= 3.4028234663852886e38f && amax_t <= 3.4028234663852886e38f,
                  "input holds Inf or NaN, which NVFP4 cannot represent");
  STD_TORCH_CHECK(amax >= 0.0f && amax_t >= 0.0f, "amax and amax_t must not be negative");
  const int64_t ld_scale = round_up(cols_p / TF_NVFP4_BLOCK, 4), ld_scale_t = round_up(rows_p / TF_NVFP4_BLOCK, 4);
  std::vector<int64_t> data_shape(input.sizes().begin(), input.sizes().end());
  data_shape.back() = cols_p / 2;
  Tensor y = rowwise ? new_empty(input, data_shape, ScalarType::Byte) : nothing(input);
  Tensor s = rowwise ? zeroed_bytes(input, {round_up(rows, 128), ld_scale}) : nothing(input);
  Tensor yt = columnwise ? new_empty(input, {cols, rows_p / 2}, ScalarType::Byte) : nothing(input);
  Tensor st = columnwise ? zeroed_bytes(input, {round_up(cols, 128), ld_scale_t}) : nothing(input);
  auto bytes = [](Tensor& t, bool used) { return used ? static_cast<uint8_t*>(t.mutable_data_ptr()) : nullptr; };
  uint8_t *py = bytes(y, rowwise), *ps = bytes(s, rowwise), *pyt = bytes(yt, columnwise), *pst = bytes(st, columnwise);
  parallel_row_bands(rows, cols, "nvfp4_quantize", [&](int64_t, int64_t r0, int64_t r1) {
    return tf_nvfp4_quantize(x, dtype, rows, cols, cols, r0, r1, block_2d ? 1 : 0, rht ? 1 : 0, stochastic ? 1 : 0,
                             static_cast<uint64_t>(seed), amax, amax_t, py, ps, ld_scale, pyt, pst, ld_scale_t);
  });
  Tensor a = rowwise ? scalar_f32(input, amax) : new_empty(input, {0}, ScalarType::Float);
  Tensor at = columnwise ? scalar_f32(input, amax_t) : new_empty(input, {0}, ScalarType::Float);
  return std::make_tuple(y, s, a, yt, st, at);
}

Quantized nvfp4_quantize_cpu(Tensor input, bool rowwise, bool columnwise, bool block_2d, bool rht, bool stochastic,
                             int64_t seed) {
  return quantize(input, rowwise, columnwise, block_2d, rht, stochastic, seed, nullptr, nullptr);
}

// The same under amaxes from outside (a tensor-parallel group's maximum of each rank's nvfp4_amax).
Quantized nvfp4_quantize_with_amax_cpu(Tensor input, Tensor amax, Tensor amax_t, bool rowwise, bool columnwise,
                                       bool block_2d, bool rht, bool stochastic, int64_t seed) {
  const float a = given_amax(amax, "amax"), at = given_amax(amax_t, "amax_t");
  return quantize(input, rowwise, columnwise, block_2d, rht, stochastic, seed, &a, &at);
}

// The amax nvfp4_quantize takes of input: of its values, or (rht) of the Hadamard transform of each 16
// consecutive values of a column.
Tensor nvfp4_amax_cpu(Tensor input, bool rht) {
  check_contiguous(input, "input");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const auto [rows, cols] = matrix_of(input, "input");
  return scalar_f32(input, band_amax(input.const_data_ptr(), dtype, rows, cols, rht ? 1 : 0));
}

// The values of packed data (rows x cols / 2 bytes) under its scales and amax, as out_dtype (rows x cols).
Tensor nvfp4_dequantize_cpu(Tensor data, Tensor scale, Tensor amax, ScalarType out_dtype) {
  check_contiguous(data, "data");
  check_contiguous(scale, "scale");
  check_same_device(data, scale, "data", "scale");
  check_same_device(data, amax, "data", "amax");
  STD_TORCH_CHECK(data.dim() == 2 && data.scalar_type() == ScalarType::Byte, "data must be a 2-D uint8 tensor");
  STD_TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == ScalarType::Byte, "scale must be a 2-D uint8 tensor");
  STD_TORCH_CHECK(amax.numel() == 1 && amax.scalar_type() == ScalarType::Float, "amax must be one float32 value");
  const tf_dtype dtype = to_tf_dtype(out_dtype, "out_dtype");
  const int64_t rows = data.size(0), cols = data.size(1) * 2;
  STD_TORCH_CHECK(cols % TF_NVFP4_BLOCK == 0, "data must hold a multiple of 16 values per row, got ", cols);
  STD_TORCH_CHECK(scale.size(0) >= rows && scale.size(1) >= cols / TF_NVFP4_BLOCK, "scale of shape (", scale.size(0),
                  ", ", scale.size(1), ") does not cover data of ", rows, " x ", cols, " values");
  const float a = *amax.const_data_ptr<float>();
  Tensor out = new_empty(data, {rows, cols}, out_dtype);
  const uint8_t* y = static_cast<const uint8_t*>(data.const_data_ptr());
  const uint8_t* s = static_cast<const uint8_t*>(scale.const_data_ptr());
  void* x = out.mutable_data_ptr();
  parallel_row_bands(rows, cols, "nvfp4_dequantize", [&](int64_t, int64_t r0, int64_t r1) {
    return tf_nvfp4_dequantize(y, rows, cols, r0, r1, s, scale.size(1), a, x, dtype);
  });
  return out;
}

// The E4M3 codes of packed E2M1 data (..., m / 2 bytes) as float8_e4m3fn (..., m): the block GEMM's operand.
Tensor nvfp4_unpack_e4m3_cpu(Tensor data) {
  check_contiguous(data, "data");
  STD_TORCH_CHECK(data.scalar_type() == ScalarType::Byte && data.dim() >= 1, "data must be a uint8 tensor of at "
                  "least 1 dimension");
  std::vector<int64_t> shape(data.sizes().begin(), data.sizes().end());
  STD_TORCH_CHECK(!__builtin_mul_overflow(shape.back(), 2, &shape.back()), "data's last dimension overflows");
  Tensor out = new_empty(data, shape, ScalarType::Float8_e4m3fn);
  // One thread: a vector shuffle a byte, memory-bound well before a pool would pay off.
  check_status(tf_nvfp4_unpack_e4m3(static_cast<const uint8_t*>(data.const_data_ptr()), 0, data.numel(),
                                    static_cast<uint8_t*>(out.mutable_data_ptr())),
               "nvfp4_unpack_e4m3");
  return out;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def(
      "nvfp4_quantize(Tensor input, bool rowwise, bool columnwise, bool block_2d, bool rht, bool stochastic,"
      " int seed) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "nvfp4_quantize_with_amax(Tensor input, Tensor amax, Tensor amax_t, bool rowwise, bool columnwise,"
      " bool block_2d, bool rht, bool stochastic, int seed) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("nvfp4_amax(Tensor input, bool rht) -> Tensor");
  m.def("nvfp4_unpack_e4m3(Tensor data) -> Tensor");
  m.def("nvfp4_dequantize(Tensor data, Tensor scale, Tensor amax, ScalarType out_dtype) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CPU, m) {
  m.impl("nvfp4_quantize", TORCH_BOX(&te_fuser::nvfp4_quantize_cpu));
  m.impl("nvfp4_quantize_with_amax", TORCH_BOX(&te_fuser::nvfp4_quantize_with_amax_cpu));
  m.impl("nvfp4_amax", TORCH_BOX(&te_fuser::nvfp4_amax_cpu));
  m.impl("nvfp4_unpack_e4m3", TORCH_BOX(&te_fuser::nvfp4_unpack_e4m3_cpu));
  m.impl("nvfp4_dequantize", TORCH_BOX(&te_fuser::nvfp4_dequantize_cpu));
}

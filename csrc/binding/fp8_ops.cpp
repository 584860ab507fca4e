// Schemas of the FP8 quantizer ops and their CPU implementations, which call
// the C core in csrc/fp8 over chunks spread on torch's intra-op thread pool.
#include <vector>

#include "fp8_checks.h"

extern "C" {
#include "../fp8/fp8_quantize.h"
#include "../fp8/fp8_scaling.h"
#include "../fp8/fp8_transpose.h"
}

namespace te_fuser {
namespace {

// Runs fn(chunk, &amax_bits) -> tf_status for every chunk in [0, chunks) on the
// thread pool and returns the combined amax bits; statuses are checked after
// the parallel region so nothing throws inside it.
template <class F>
uint32_t parallel_chunks(int64_t chunks, const char* what, const F& fn) {
  std::vector<uint32_t> partial(static_cast<size_t>(chunks), 0u);
  std::vector<int> status(static_cast<size_t>(chunks), TF_OK);
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) status[c] = fn(c, &partial[c]);
  });
  uint32_t amax = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    check_status(static_cast<tf_status>(status[c]), what);
    amax = partial[c] > amax ? partial[c] : amax;
  }
  return amax;
}

// The same over the elements [0, n), in chunks of kGrainElements: fn(begin, end, &amax_bits).
template <class F>
uint32_t parallel_elements(int64_t n, const char* what, const F& fn) {
  return parallel_chunks((n + kGrainElements - 1) / kGrainElements, what,
                         [&](int64_t c, uint32_t* amax_bits) {
                           const int64_t begin = c * kGrainElements;
                           const int64_t end = n - begin < kGrainElements ? n : begin + kGrainElements;
                           return fn(begin, end, amax_bits);
                         });
}

// The same over the rows [0, rows) of a rows x cols matrix, in bands of whole multiples of `unit`
// rows of about kGrainElements elements each: fn(row_begin, row_end, &amax_bits).
template <class F>
uint32_t parallel_row_bands(int64_t rows, int64_t cols, int64_t unit, const char* what, const F& fn) {
  const int64_t band = (kGrainElements / (cols > 0 ? cols : 1) / unit + 1) * unit;
  return parallel_chunks((rows + band - 1) / band, what, [&](int64_t c, uint32_t* amax_bits) {
    const int64_t r0 = c * band;
    return fn(r0, rows - r0 < band ? rows : r0 + band, amax_bits);
  });
}

// The FP8 codes of every bit pattern of a 16-bit dtype at this scale (see
// tf_fp8_table_build), built on the calling thread: a second parallel region
// costs more than the build when other processes share the cores.
std::vector<uint8_t> build_table(tf_dtype dtype, float scale, tf_fp8_format format, const char* what) {
  std::vector<uint8_t> table(TF_FP8_TABLE_ENTRIES);
  check_status(tf_fp8_table_build(dtype, scale, format, 0, TF_FP8_TABLE_ENTRIES, table.data()), what);
  return table;
}

// amax <- max(amax, new), on the bit patterns of non-negative floats (NaN wins).
void accumulate_amax(const Tensor& amax, uint32_t bits) {
  float* p = amax.mutable_data_ptr<float>();
  const uint32_t old = tf_f32_bits(*p) & 0x7FFFFFFFu;
  *p = tf_f32_from_bits(bits > old ? bits : old);
}

Tensor fp8_quantize_cpu(Tensor input, Tensor scale, Tensor amax, ScalarType fp8_dtype) {
  check_quantize_args(input, scale, amax);
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const tf_fp8_format format = to_tf_fp8_format(fp8_dtype, "fp8_dtype");
  Tensor out = new_empty(input, input.sizes(), fp8_dtype);
  const void* x = input.const_data_ptr();
  uint8_t* y = static_cast<uint8_t*>(out.mutable_data_ptr());
  const float s = *scale.const_data_ptr<float>();
  const bool use_table = tf_fp8_table_pays(dtype, input.numel());
  const std::vector<uint8_t> table =
      use_table ? build_table(dtype, s, format, "fp8_quantize") : std::vector<uint8_t>();
  const uint32_t bits = parallel_elements(input.numel(), "fp8_quantize",
                                          [&](int64_t b, int64_t e, uint32_t* a) {
                                            return use_table
                                                       ? tf_fp8_quantize_table(x, dtype, b, e, table.data(), y, a)
                                                       : tf_fp8_quantize(x, dtype, b, e, s, format, y, a);
                                          });
  accumulate_amax(amax, bits);
  return out;
}

Tensor fp8_amax_cpu(Tensor input) {
  check_contiguous(input, "input");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const void* x = input.const_data_ptr();
  const uint32_t bits = parallel_elements(input.numel(), "fp8_amax",
                                     [&](int64_t b, int64_t e, uint32_t* a) {
                                       return tf_fp8_amax(x, dtype, b, e, a);
                                     });
  Tensor out = new_empty(input, {1}, ScalarType::Float);
  *out.mutable_data_ptr<float>() = tf_f32_from_bits(bits);
  return out;
}

Tensor fp8_dequantize_cpu(Tensor data, Tensor scale_inv, ScalarType out_dtype) {
  check_contiguous(data, "data");
  check_scalar_f32(scale_inv, "scale_inv");
  check_same_device(data, scale_inv, "data", "scale_inv");
  const tf_fp8_format format = to_tf_fp8_format(data.scalar_type(), "data");
  const tf_dtype dtype = to_tf_dtype(out_dtype, "out_dtype");
  Tensor out = new_empty(data, data.sizes(), out_dtype);
  const uint8_t* y = static_cast<const uint8_t*>(data.const_data_ptr());
  void* x = out.mutable_data_ptr();
  const float s_inv = *scale_inv.const_data_ptr<float>();
  parallel_elements(data.numel(), "fp8_dequantize", [&](int64_t b, int64_t e, uint32_t*) {
    return tf_fp8_dequantize(y, format, b, e, s_inv, x, dtype);
  });
  return out;
}

// input is viewed as a matrix of (numel / last dim) rows; the transpose is
// (last dim) x rows, which is what the weight-gradient GEMM consumes.
std::tuple<Tensor, Tensor> fp8_cast_transpose_cpu(Tensor input, Tensor scale, Tensor amax,
                                                  ScalarType fp8_dtype) {
  check_quantize_args(input, scale, amax);
  STD_TORCH_CHECK(input.dim() >= 2, "input must have at least 2 dimensions");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  const tf_fp8_format format = to_tf_fp8_format(fp8_dtype, "fp8_dtype");
  const int64_t cols = input.size(input.dim() - 1);
  const int64_t rows = cols == 0 ? 0 : input.numel() / cols;
  Tensor out = new_empty(input, input.sizes(), fp8_dtype);
  Tensor out_t = new_empty(input, {cols, rows}, fp8_dtype);
  const void* x = input.const_data_ptr();
  uint8_t* y = static_cast<uint8_t*>(out.mutable_data_ptr());
  uint8_t* y_t = static_cast<uint8_t*>(out_t.mutable_data_ptr());
  const float s = *scale.const_data_ptr<float>();
  const uint32_t bits = parallel_row_bands(rows, cols, TF_FP8_CT_BAND, "fp8_cast_transpose",
                                           [&](int64_t r0, int64_t r1, uint32_t* a) {
                                             return tf_fp8_cast_transpose(x, dtype, rows, cols, cols, r0, r1, s,
                                                                          format, y, y_t, a);
                                           });
  accumulate_amax(amax, bits);
  return std::make_tuple(out, out_t);
}

// data is viewed as a matrix of (product of the leading dims) rows by its last dim; the result is
// that matrix transposed, in bands of whole 64-row tiles on the thread pool.
Tensor fp8_transpose_cpu(Tensor data) {
  check_contiguous(data, "data");
  to_tf_fp8_format(data.scalar_type(), "data");
  STD_TORCH_CHECK(data.dim() >= 1, "data must have at least 1 dimension");
  const int64_t cols = data.size(data.dim() - 1);
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < data.dim(); ++d)
    STD_TORCH_CHECK(!__builtin_mul_overflow(rows, data.size(d), &rows), "data's leading dims overflow int64");
  Tensor out = new_empty(data, {cols, rows}, data.scalar_type());
  const uint8_t* x = static_cast<const uint8_t*>(data.const_data_ptr());
  uint8_t* y = static_cast<uint8_t*>(out.mutable_data_ptr());
  parallel_row_bands(rows, cols, TF_FP8_TRANSPOSE_BAND, "fp8_transpose",
                     [&](int64_t r0, int64_t r1, uint32_t*) { return tf_fp8_transpose(x, rows, cols, r0, r1, y); });
  return out;
}

void fp8_delayed_scaling_update_cpu(Tensor amax_history, Tensor scale, Tensor scale_inv,
                                    double fp8_max, int64_t margin, int64_t amax_compute_algo) {
  const int64_t n = check_scaling_update_args(amax_history, scale, scale_inv, margin);
  check_status(tf_fp8_delayed_scaling_update(
                   amax_history.mutable_data_ptr<float>(), amax_history.size(0), n,
                   scale.mutable_data_ptr<float>(), scale_inv.mutable_data_ptr<float>(),
                   static_cast<float>(fp8_max), static_cast<int32_t>(margin),
                   static_cast<tf_amax_algo>(amax_compute_algo)),
               "fp8_delayed_scaling_update");
}

std::tuple<Tensor, Tensor> fp8_current_scale_cpu(Tensor amax, double fp8_max, double epsilon,
                                                 bool force_pow2) {
  check_scalar_f32(amax, "amax");
  Tensor scale = new_empty(amax, {1}, ScalarType::Float);
  Tensor scale_inv = new_empty(amax, {1}, ScalarType::Float);
  const float s = tf_fp8_current_scale(*amax.const_data_ptr<float>(), static_cast<float>(fp8_max),
                                       static_cast<float>(epsilon), force_pow2 ? 1 : 0);
  *scale.mutable_data_ptr<float>() = s;
  *scale_inv.mutable_data_ptr<float>() = 1.0f / s;
  return std::make_tuple(scale, scale_inv);
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def("fp8_quantize(Tensor input, Tensor scale, Tensor(a!) amax, ScalarType fp8_dtype) -> Tensor");
  m.def("fp8_amax(Tensor input) -> Tensor");
  m.def("fp8_dequantize(Tensor data, Tensor scale_inv, ScalarType out_dtype) -> Tensor");
  m.def("fp8_transpose(Tensor data) -> Tensor");
  m.def(
      "fp8_cast_transpose(Tensor input, Tensor scale, Tensor(a!) amax, ScalarType fp8_dtype)"
      " -> (Tensor, Tensor)");
  m.def(
      "fp8_delayed_scaling_update(Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) scale_inv,"
      " float fp8_max, int margin, int amax_compute_algo) -> ()");
  m.def(
      "fp8_current_scale(Tensor amax, float fp8_max, float epsilon, bool force_pow2)"
      " -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CPU, m) {
  m.impl("fp8_quantize", TORCH_BOX(&te_fuser::fp8_quantize_cpu));
  m.impl("fp8_amax", TORCH_BOX(&te_fuser::fp8_amax_cpu));
  m.impl("fp8_dequantize", TORCH_BOX(&te_fuser::fp8_dequantize_cpu));
  m.impl("fp8_transpose", TORCH_BOX(&te_fuser::fp8_transpose_cpu));
  m.impl("fp8_cast_transpose", TORCH_BOX(&te_fuser::fp8_cast_transpose_cpu));
  m.impl("fp8_delayed_scaling_update", TORCH_BOX(&te_fuser::fp8_delayed_scaling_update_cpu));
  m.impl("fp8_current_scale", TORCH_BOX(&te_fuser::fp8_current_scale_cpu));
}

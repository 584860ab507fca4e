// te_fuser::block_scaled_gemm: the same with one scale per (row, K block) of a and b
// (csrc/gemm/block_scaled_gemm.h), float32 values read through their strides or E8M0 codes.
//
// te_fuser::nvfp4_gemm: NVFP4's GEMM (tf_nvfp4_gemm_nt) on packed E2M1 data and E4M3 scale codes, which it
// unpacks and decodes itself, so that its C kernel only ever sees E2M1 values under E4M3 scales.
//
// te_fuser::fp8_gemm: a @ b.T for row-major FP8 a (m, k) and b (n, k), scaled by their scale_inv,
// plus an optional bias, in out_dtype (csrc/gemm/fp8_gemm.h). The CPU kernel spreads the output
// tiles over torch's intra-op threads; each tile is computed the same way whatever the split.
// The CUDA path of te_fuser.ops.gemm uses torch._scaled_mm, so only the CPU kernel is here.
#include <algorithm>
#include <optional>
#include <vector>

#include "binding_util.h"

extern "C" {
#include "../common/cpu_features.h"
#include "../fp4/nvfp4.h"
#include "../fp8/fp8_block_format.h"
#include "../fp8/fp8_format.h"
#include "../gemm/block_scaled_gemm.h"
#include "../gemm/fp8_gemm.h"
}

namespace te_fuser {
namespace {

void check_fp8_matrix(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.is_cpu(), arg, " must be a CPU tensor");
  STD_TORCH_CHECK(t.dim() == 2, arg, " must be 2-D, got ", t.dim(), " dimensions");
  check_contiguous(t, arg);
}

// The tiles in row-major order cut into as many slices, of equal output area rather than equal
// count: the last row and column of tiles are partial, and torch hands each thread a run of whole
// slices, so a split by count left one thread up to an eighth more work on some GPT shapes.
// bounds[s] is slice s's first tile (a tile goes to the slice holding its middle).
std::vector<int64_t> equal_cost_slices(int64_t m, int64_t n) {
  const int64_t tiles = tf_fp8_gemm_tiles(m, n);
  const int64_t tiles_n = (n + TF_GEMM_NB - 1) / TF_GEMM_NB;
  auto area = [&](int64_t t) {
    const int64_t row0 = t / tiles_n * TF_GEMM_MB, col0 = t % tiles_n * TF_GEMM_NB;
    return static_cast<double>(std::min<int64_t>(TF_GEMM_MB, m - row0)) *
           static_cast<double>(std::min<int64_t>(TF_GEMM_NB, n - col0));
  };
  const double total = static_cast<double>(m) * static_cast<double>(n);
  std::vector<int64_t> bounds(static_cast<size_t>(tiles) + 1, tiles);
  int64_t t = 0;
  double before = 0.0;  // the area of tiles [0, t)
  for (int64_t s = 0; s < tiles; ++s) {
    const double start = total * static_cast<double>(s) / static_cast<double>(tiles);
    while (t < tiles && before + 0.5 * area(t) < start) before += area(t++);
    bounds[static_cast<size_t>(s)] = t;
  }
  return bounds;
}

// Computes the output tiles of an m x n GEMM on torch's threads, each run of slices (equal_cost_slices) by
// tiles(first tile, end tile) -> tf_status; raises the first failure, naming `what`.
template <typename Tiles>
void run_tiles(int64_t m, int64_t n, const char* what, Tiles tiles) {
  const std::vector<int64_t> bounds = equal_cost_slices(m, n);
  const int64_t slices = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<int> status(static_cast<size_t>(slices), TF_OK);
  torch::stable::parallel_for(0, slices, 1, [&](int64_t s0, int64_t s1) { status[s0] = tiles(bounds[s0], bounds[s1]); });
  for (int s : status) check_status(static_cast<tf_status>(s), what);
}

// The bias argument's pointer and dtype, after checking it holds one value per row of b (n).
const void* checked_bias(const std::optional<Tensor>& bias, int64_t n, tf_dtype* dtype) {
  *dtype = TF_FLOAT32;
  if (!bias.has_value()) return nullptr;
  const Tensor& t = *bias;
  STD_TORCH_CHECK(t.is_cpu(), "bias must be a CPU tensor");
  STD_TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "bias must be 1-D with b.shape[0] = ", n, " elements");
  check_contiguous(t, "bias");
  *dtype = to_tf_dtype(t.scalar_type(), "bias");
  return t.const_data_ptr();
}

Tensor fp8_gemm_cpu(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, ScalarType out_dtype,
                    std::optional<Tensor> bias) {
  check_fp8_matrix(a, "a");
  check_fp8_matrix(b, "b");
  const tf_fp8_format fa = to_tf_fp8_format(a.scalar_type(), "a");
  const tf_fp8_format fb = to_tf_fp8_format(b.scalar_type(), "b");
  check_scalar_f32(a_scale_inv, "a_scale_inv");
  check_scalar_f32(b_scale_inv, "b_scale_inv");
  check_same_device(a, a_scale_inv, "a", "a_scale_inv");
  check_same_device(b, b_scale_inv, "b", "b_scale_inv");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  STD_TORCH_CHECK(b.size(1) == k, "b must have a.shape[1] = ", k, " columns, got ", b.size(1));
  const tf_dtype out = to_tf_dtype(out_dtype, "out_dtype");
  tf_dtype bias_dtype;
  const void* bias_ptr = checked_bias(bias, n, &bias_dtype);
  // One tier for the whole call, so a cap changed meanwhile cannot mix paths within one output.
  const tf_isa isa = tf_cpu_isa();
  check_status(tf_fp8_gemm_check(m, n, k, fa, fb, bias_ptr != nullptr, bias_dtype, out, isa),
               "fp8_gemm");
  Tensor result = new_empty(a, {m, n}, out_dtype);
  const uint8_t* pa = static_cast<const uint8_t*>(a.const_data_ptr());
  const uint8_t* pb = static_cast<const uint8_t*>(b.const_data_ptr());
  const float sa = *a_scale_inv.const_data_ptr<float>();
  const float sb = *b_scale_inv.const_data_ptr<float>();
  void* po = result.mutable_data_ptr();
  run_tiles(m, n, "fp8_gemm", [&](int64_t begin, int64_t end) {
    return tf_fp8_gemm_nt(pa, fa, pb, fb, m, n, k, sa, sb, bias_ptr, bias_dtype, po, out, isa, begin, end);
  });
  return result;
}

// A (rows, blocks) CPU tensor of scales, any strides: float32 values, or uint8 E8M0 codes (MXFP8's).
void check_block_scales(const Tensor& t, const char* arg, int64_t rows, int64_t blocks) {
  STD_TORCH_CHECK(t.is_cpu(), arg, " must be a CPU tensor");
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float || t.scalar_type() == ScalarType::Byte, arg,
                  " must be float32 (values) or uint8 (E8M0 codes)");
  STD_TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == blocks, arg, " must have shape (",
                  rows, ", ", blocks, ") (one scale per row and K block)");
}

// Checked scales as float32: the tensor itself, or E8M0 codes decoded (tf_e8m0_decode) into a
// contiguous copy, which costs a pass over (rows, blocks) bytes instead of torch ops on the Python side.
Tensor float_block_scales(const Tensor& t) {
  if (t.scalar_type() == ScalarType::Float) return t;
  const int64_t rows = t.size(0), blocks = t.size(1), s0 = t.stride(0), s1 = t.stride(1);
  Tensor out = new_empty(t, {rows, blocks}, ScalarType::Float);
  const uint8_t* codes = t.const_data_ptr<uint8_t>();
  float* values = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kb = 0; kb < blocks; ++kb) values[r * blocks + kb] = tf_e8m0_decode(codes[r * s0 + kb * s1]);
  return out;
}

Tensor block_scaled_gemm_cpu(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, int64_t block,
                             ScalarType out_dtype, std::optional<Tensor> bias) {
  check_fp8_matrix(a, "a");
  check_fp8_matrix(b, "b");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  STD_TORCH_CHECK(b.size(1) == k, "b must have a.shape[1] = ", k, " columns, got ", b.size(1));
  STD_TORCH_CHECK(block >= 1 && block <= TF_GEMM_KC, "block must lie in [1, ", TF_GEMM_KC, "], got ", block);
  const int64_t blocks = tf_block_scaled_gemm_blocks(k, block);
  check_block_scales(a_scales, "a_scales", m, blocks);
  check_block_scales(b_scales, "b_scales", n, blocks);
  a_scales = float_block_scales(a_scales);
  b_scales = float_block_scales(b_scales);
  const tf_block_operand pa = {static_cast<const uint8_t*>(a.const_data_ptr()),
                               to_tf_fp8_format(a.scalar_type(), "a"),
                               a_scales.const_data_ptr<float>(), a_scales.stride(0), a_scales.stride(1)};
  const tf_block_operand pb = {static_cast<const uint8_t*>(b.const_data_ptr()),
                               to_tf_fp8_format(b.scalar_type(), "b"),
                               b_scales.const_data_ptr<float>(), b_scales.stride(0), b_scales.stride(1)};
  const tf_dtype out = to_tf_dtype(out_dtype, "out_dtype");
  tf_dtype bias_dtype;
  const void* bias_ptr = checked_bias(bias, n, &bias_dtype);
  const tf_isa isa = tf_cpu_isa();  // one tier for the whole call, as in fp8_gemm
  check_status(tf_block_scaled_gemm_check(m, n, k, block, &pa, &pb, bias_ptr != nullptr, bias_dtype, out, isa),
               "block_scaled_gemm");
  Tensor result = new_empty(a, {m, n}, out_dtype);
  void* po = result.mutable_data_ptr();
  run_tiles(m, n, "block_scaled_gemm", [&](int64_t begin, int64_t end) {
    return tf_block_scaled_gemm_nt(&pa, &pb, m, n, k, block, bias_ptr, bias_dtype, po, out, isa, begin, end);
  });
  return result;
}

// (rows, bytes) packed E2M1 values as the (rows, 2 * bytes) E4M3 codes of those values.
Tensor unpacked_e2m1(const Tensor& data) {
  Tensor codes = new_empty(data, {data.size(0), 2 * data.size(1)}, ScalarType::Byte);
  check_status(tf_nvfp4_unpack_e4m3(static_cast<const uint8_t*>(data.const_data_ptr()), 0, data.numel(),
                                    static_cast<uint8_t*>(codes.mutable_data_ptr())),
               "nvfp4_gemm");
  return codes;
}

// A (rows, blocks) CPU tensor of E4M3 scale codes (uint8 or float8_e4m3fn, any strides) as a contiguous
// float32 tensor of their values.
Tensor e4m3_scale_values(const Tensor& t, const char* arg, int64_t rows, int64_t blocks) {
  STD_TORCH_CHECK(t.is_cpu(), arg, " must be a CPU tensor");
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Byte || t.scalar_type() == ScalarType::Float8_e4m3fn, arg,
                  " must hold E4M3 scale codes (uint8 or float8_e4m3fn)");
  STD_TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == blocks, arg, " must have shape (", rows,
                  ", ", blocks, ") (one scale per row and 16-value block)");
  const int64_t s0 = t.stride(0), s1 = t.stride(1);
  Tensor out = new_empty(t, {rows, blocks}, ScalarType::Float);
  const uint8_t* codes = static_cast<const uint8_t*>(t.const_data_ptr());
  float* values = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kb = 0; kb < blocks; ++kb) values[r * blocks + kb] = tf_fp8_e4m3_decode(codes[r * s0 + kb * s1]);
  return out;
}

void check_nvfp4_data(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.is_cpu(), arg, " must be a CPU tensor");
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Byte && t.dim() == 2, arg,
                  " must be a 2-D uint8 tensor of packed E2M1 values (two a byte)");
  check_contiguous(t, arg);
  STD_TORCH_CHECK(t.size(1) % (TF_NVFP4_GEMM_BLOCK / 2) == 0, arg, "'s rows must hold whole 16-value blocks (",
                  TF_NVFP4_GEMM_BLOCK / 2, " bytes each), got ", t.size(1), " bytes");
}

Tensor nvfp4_gemm_cpu(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, Tensor alpha, ScalarType out_dtype,
                      std::optional<Tensor> bias) {
  check_nvfp4_data(a, "a");
  check_nvfp4_data(b, "b");
  STD_TORCH_CHECK(b.size(1) == a.size(1), "b must have a.shape[1] = ", a.size(1), " bytes a row, got ", b.size(1));
  check_scalar_f32(alpha, "alpha");
  STD_TORCH_CHECK(alpha.is_cpu(), "alpha must be a CPU tensor");
  int64_t k;
  STD_TORCH_CHECK(!__builtin_mul_overflow(a.size(1), 2, &k), "a's rows overflow int64 values");
  const int64_t m = a.size(0), n = b.size(0), blocks = k / TF_NVFP4_GEMM_BLOCK;
  a_scales = e4m3_scale_values(a_scales, "a_scales", m, blocks);
  b_scales = e4m3_scale_values(b_scales, "b_scales", n, blocks);
  const Tensor a_codes = unpacked_e2m1(a), b_codes = unpacked_e2m1(b);
  const tf_block_operand pa = {static_cast<const uint8_t*>(a_codes.const_data_ptr()), TF_FP8_E4M3,
                               a_scales.const_data_ptr<float>(), blocks, 1};
  const tf_block_operand pb = {static_cast<const uint8_t*>(b_codes.const_data_ptr()), TF_FP8_E4M3,
                               b_scales.const_data_ptr<float>(), blocks, 1};
  const float alpha_value = *alpha.const_data_ptr<float>();
  const tf_dtype out = to_tf_dtype(out_dtype, "out_dtype");
  tf_dtype bias_dtype;
  const void* bias_ptr = checked_bias(bias, n, &bias_dtype);
  const tf_isa isa = tf_cpu_isa();  // one tier for the whole call, as in fp8_gemm
  check_status(tf_block_scaled_gemm_check(m, n, k, TF_NVFP4_GEMM_BLOCK, &pa, &pb, bias_ptr != nullptr, bias_dtype,
                                          out, isa),
               "nvfp4_gemm");
  Tensor result = new_empty(a, {m, n}, out_dtype);
  void* po = result.mutable_data_ptr();
  run_tiles(m, n, "nvfp4_gemm", [&](int64_t begin, int64_t end) {
    return tf_nvfp4_gemm_nt(&pa, &pb, m, n, k, alpha_value, bias_ptr, bias_dtype, po, out, isa, begin, end);
  });
  return result;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def(
      "fp8_gemm(Tensor a, Tensor a_scale_inv, Tensor b, Tensor b_scale_inv, ScalarType out_dtype,"
      " Tensor? bias=None) -> Tensor");
  m.def(
      "block_scaled_gemm(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, int block,"
      " ScalarType out_dtype, Tensor? bias=None) -> Tensor");
  m.def(
      "nvfp4_gemm(Tensor a, Tensor a_scales, Tensor b, Tensor b_scales, Tensor alpha, ScalarType out_dtype,"
      " Tensor? bias=None) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CPU, m) {
  m.impl("fp8_gemm", TORCH_BOX(&te_fuser::fp8_gemm_cpu));
  m.impl("block_scaled_gemm", TORCH_BOX(&te_fuser::block_scaled_gemm_cpu));
  m.impl("nvfp4_gemm", TORCH_BOX(&te_fuser::nvfp4_gemm_cpu));
}

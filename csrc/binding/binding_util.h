// Helpers shared by the binding files: dtype mapping, argument checks that
// raise (as RuntimeError in Python) instead of crashing, and the thread split.
// These checks keep the raw torch.ops.te_fuser.* entry points safe on their own.
// The Python wrappers raise friendlier messages: the wrappers of the fused ops,
// of attention on the CPU kernel, and of FP8 quantize, cast_transpose,
// dequantize, fp8_gemm and the scale updates check their arguments only after
// these refused them (te_fuser/kernels/validate.py, call_checked), the others
// before each call.
#pragma once

// CUDA builds: torch's C shim declares its CUDA entry points (the current
// stream) only under USE_CUDA, so it is set before any torch header.
#if defined(TE_FUSER_WITH_CUDA) && !defined(USE_CUDA)
#define USE_CUDA
#endif

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <tuple>
#include <vector>

extern "C" {
#include "../common/tf_dtype.h"
#include "../common/tf_status.h"
#include "../fp8/fp8_format.h"
}

namespace te_fuser {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

inline tf_dtype to_tf_dtype(ScalarType t, const char* arg) {
  switch (t) {
    case ScalarType::Float: return TF_FLOAT32;
    case ScalarType::BFloat16: return TF_BFLOAT16;
    case ScalarType::Half: return TF_FLOAT16;
    default: break;
  }
  STD_TORCH_CHECK(false, arg, " must be float32, bfloat16 or float16");
  return TF_FLOAT32;
}

inline tf_fp8_format to_tf_fp8_format(ScalarType t, const char* arg) {
  if (t == ScalarType::Float8_e4m3fn) return TF_FP8_E4M3;
  STD_TORCH_CHECK(t == ScalarType::Float8_e5m2, arg,
                  " must be torch.float8_e4m3fn or torch.float8_e5m2");
  return TF_FP8_E5M2;
}

inline ScalarType fp8_scalar_type(tf_fp8_format f) {
  return f == TF_FP8_E4M3 ? ScalarType::Float8_e4m3fn : ScalarType::Float8_e5m2;
}

// A new contiguous tensor of `sizes` and `dtype` on the device of `like`. It calls the C shim's
// empty_strided directly: torch::stable::new_empty looks aten::new_empty up by name and runs it
// through the dispatcher on every call, which costs more than the kernel on a small tensor.
inline Tensor new_empty(const Tensor& like, torch::headeronly::IntHeaderOnlyArrayRef sizes,
                        ScalarType dtype) {
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    STD_TORCH_CHECK(sizes[d] >= 0, "te_fuser: negative size in an output allocation");
    strides[d] = stride;
    STD_TORCH_CHECK(!__builtin_mul_overflow(stride, sizes[d] > 0 ? sizes[d] : 1, &stride),
                    "te_fuser: output size overflows int64");
  }
  int32_t device_type = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(like.get(), &device_type));
  AtenTensorHandle out = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(
      ndim, sizes.data(), strides.data(),
      torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype)), device_type,
      like.get_device_index(), &out));
  return Tensor(out);
}

inline void check_status(tf_status s, const char* what) {
  STD_TORCH_CHECK(s == TF_OK, what, ": ", tf_status_string(s));
}

inline void check_contiguous(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.is_contiguous(), arg, " must be contiguous");
}

inline void check_same_device(const Tensor& a, const Tensor& b, const char* arg_a,
                              const char* arg_b) {
  STD_TORCH_CHECK(a.get_device() == b.get_device() && a.is_cpu() == b.is_cpu(), arg_a,
                  " and ", arg_b, " must be on the same device");
}

// A float32 tensor with exactly one element, e.g. a per-tensor scale or amax.
inline void check_scalar_f32(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float && t.numel() == 1, arg,
                  " must be a float32 tensor with one element");
}

#ifdef TE_FUSER_WITH_CUDA
// The current CUDA stream of the device t is on (t must be a CUDA tensor).
inline void* current_cuda_stream(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.is_cuda(), arg, " must be a CUDA tensor");
  void* stream = nullptr;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream));
  return stream;
}
#endif

// The input viewed as (product of the leading dims) x (last dim).
inline std::tuple<int64_t, int64_t> matrix_of(const Tensor& input, const char* arg) {
  STD_TORCH_CHECK(input.dim() >= 1, arg, " must have at least 1 dimension");
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < input.dim(); ++d)
    STD_TORCH_CHECK(!__builtin_mul_overflow(rows, input.size(d), &rows), arg, "'s leading dims overflow int64");
  return std::make_tuple(rows, input.size(input.dim() - 1));
}

// Elements handed to one thread at a time by the element-wise kernels.
constexpr int64_t kGrainElements = 1 << 16;

}  // namespace te_fuser

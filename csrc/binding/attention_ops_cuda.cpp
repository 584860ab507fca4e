// CUDA implementations of attention_fwd / attention_bwd (schemas in
// attention_ops.cpp): argument checks, output allocation, and calls into the
// extern "C" launchers of csrc/cuda/attention on the current stream.
//
// shim.h declares aoti_torch_get_current_cuda_stream only under USE_CUDA;
// this file is compiled only in CUDA builds.
#ifndef USE_CUDA
#define USE_CUDA
#endif

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>

#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "binding_util.h"

extern "C" {
#include "../cuda/attention/attention_cuda.h"
}

namespace te_fuser {
namespace {

using OptTensor = std::optional<Tensor>;

bool is_fp8(ScalarType t) { return t == ScalarType::Float8_e4m3fn; }

tf_dtype half_dtype(ScalarType t, const char* arg) {
  STD_TORCH_CHECK(t == ScalarType::BFloat16 || t == ScalarType::Half, arg,
                  " must be bfloat16 or float16 on CUDA");
  return t == ScalarType::BFloat16 ? TF_BFLOAT16 : TF_FLOAT16;
}

// The kernels read and write 16-byte row chunks: a view whose rows are not
// 16-byte aligned is copied to a contiguous tensor first.
Tensor rows_aligned(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.dim() == 4, arg,
                  " must be 4-D: [B, S, H, D] (or [1, T, H, D] with cu_seqlens)");
  STD_TORCH_CHECK(t.stride(3) == 1 || t.size(3) <= 1, arg, " must be contiguous in the head dim");
  const int64_t bytes = static_cast<int64_t>(t.element_size());
  bool ok = reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  for (int64_t d = 0; d < 3; ++d) ok = ok && (t.stride(d) * bytes) % 16 == 0;
  return ok ? t : torch::stable::contiguous(t);
}

tf_attn_cuda_tensor in_view(const Tensor& t) {
  return {t.const_data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

tf_attn_cuda_out_tensor out_view(const Tensor& t) {
  return {t.mutable_data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

// A new dense tensor shaped like the 4-D `like`, with its dims laid out in
// the same order (e.g. an sbhd view gives an sbhd-ordered result).
Tensor dense_like(const Tensor& like, ScalarType dtype) {
  int64_t order[4] = {0, 1, 2, 3};  // dims by decreasing stride; the last stays last
  for (int i = 1; i < 3; ++i)
    for (int j = i; j > 0 && like.stride(order[j]) > like.stride(order[j - 1]); --j)
      std::swap(order[j], order[j - 1]);
  Tensor t = new_empty(
      like, {like.size(order[0]), like.size(order[1]), like.size(order[2]), like.size(3)}, dtype);
  // Dim k of t is dim order[k] of `like`: transpose it back into place.
  for (int64_t d = 0; d < 3; ++d) {
    int64_t k = d;
    while (order[k] != d) ++k;
    if (k != d) {
      t = torch::stable::transpose(t, d, k);
      std::swap(order[d], order[k]);
    }
  }
  return t;
}

void check_cuda_tensor(const Tensor& t, const Tensor& q, const char* arg) {
  STD_TORCH_CHECK(t.is_cuda(), arg, " must be a CUDA tensor");
  check_same_device(t, q, arg, "q");
}

void check_int32_vector(const OptTensor& t, int64_t n, const Tensor& q, const char* arg) {
  if (!t.has_value()) return;
  check_cuda_tensor(*t, q, arg);
  STD_TORCH_CHECK(t->scalar_type() == ScalarType::Int && t->dim() == 1 && t->numel() == n &&
                      t->is_contiguous(),
                  arg, " must be a contiguous int32 vector of ", n, " elements");
}

const int32_t* int32_ptr(const OptTensor& t) {
  return t.has_value() ? t->const_data_ptr<int32_t>() : nullptr;
}

const float* descale_ptr(const OptTensor& t, const Tensor& q, bool fp8, const char* arg) {
  if (!fp8) {
    STD_TORCH_CHECK(!t.has_value(), arg, " is only used with float8_e4m3fn inputs");
    return nullptr;
  }
  STD_TORCH_CHECK(t.has_value(), arg, " is required with float8_e4m3fn inputs");
  check_cuda_tensor(*t, q, arg);
  check_scalar_f32(*t, arg);
  return t->const_data_ptr<float>();
}

// Shapes, dtypes and optional arguments shared by forward and backward.
tf_attn_cuda_problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v,
                                  const OptTensor& cu_q, const OptTensor& cu_kv,
                                  const OptTensor& lens_q, const OptTensor& lens_kv,
                                  double softmax_scale, bool causal, double dropout_p,
                                  int64_t seed, int64_t offset, const OptTensor& q_descale,
                                  const OptTensor& k_descale, const OptTensor& v_descale,
                                  tf_dtype out_dtype) {
  check_cuda_tensor(q, q, "q");
  check_cuda_tensor(k, q, "k");
  check_cuda_tensor(v, q, "v");
  STD_TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                  "q, k and v must have the same dtype");
  for (int64_t d = 0; d < 4; ++d)
    STD_TORCH_CHECK(k.size(d) == v.size(d), "k and v must have the same shape");
  STD_TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3),
                  "q and k must agree in batch and head dim");
  STD_TORCH_CHECK(q.size(2) > 0 && k.size(2) > 0 && q.size(2) % k.size(2) == 0,
                  "the number of query heads must be a positive multiple of the KV heads");
  STD_TORCH_CHECK(tf_attention_cuda_head_dim_supported(q.size(3)),
                  "attention on CUDA supports head dims " TF_ATTN_CUDA_HEAD_DIMS ", got ",
                  q.size(3));
  STD_TORCH_CHECK(cu_q.has_value() == cu_kv.has_value(),
                  "cu_seqlens_q and cu_seqlens_kv must be given together");
  STD_TORCH_CHECK(std::isfinite(softmax_scale), "softmax_scale must be finite");
  STD_TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must lie in [0, 1)");
  const bool packed = cu_q.has_value();
  int64_t num_seqs = q.size(0);
  if (packed) {
    STD_TORCH_CHECK(q.size(0) == 1, "with cu_seqlens the batch dim of q, k, v must be 1");
    STD_TORCH_CHECK(cu_q->dim() == 1 && cu_q->numel() >= 1, "cu_seqlens_q must be [N + 1]");
    num_seqs = cu_q->numel() - 1;
    check_int32_vector(cu_q, num_seqs + 1, q, "cu_seqlens_q");
    check_int32_vector(cu_kv, num_seqs + 1, q, "cu_seqlens_kv");
  }
  check_int32_vector(lens_q, num_seqs, q, "seqlens_q");
  check_int32_vector(lens_kv, num_seqs, q, "seqlens_kv");
  const bool fp8 = is_fp8(q.scalar_type());
  STD_TORCH_CHECK(!packed || (!lens_q.has_value() && !lens_kv.has_value()),
                  "seqlens and cu_seqlens cannot be combined");
  // FP8 tiles are converted to out_dtype for the MMA (bfloat16 for a float32
  // output); e4m3 values are exact in both 16-bit types.
  const tf_dtype dtype = fp8 ? (out_dtype == TF_FLOAT32 ? TF_BFLOAT16 : out_dtype)
                             : half_dtype(q.scalar_type(), "q");

  tf_attn_cuda_problem p{};
  p.batch = q.size(0);
  p.num_seqs = num_seqs;
  p.seqlen_q = q.size(1);
  p.seqlen_kv = k.size(1);
  p.heads_q = q.size(2);
  p.heads_kv = k.size(2);
  p.head_dim = q.size(3);
  p.cu_seqlens_q = int32_ptr(cu_q);
  p.cu_seqlens_kv = int32_ptr(cu_kv);
  p.seqlens_q = int32_ptr(lens_q);
  p.seqlens_kv = int32_ptr(lens_kv);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.causal = causal ? 1 : 0;
  p.dropout_p = static_cast<float>(dropout_p);
  p.seed = static_cast<uint64_t>(seed);
  p.offset = static_cast<uint64_t>(offset);
  p.dtype = dtype;
  p.out_dtype = out_dtype;
  p.fp8_inputs = fp8 ? 1 : 0;
  p.q_descale = descale_ptr(q_descale, q, fp8, "q_descale");
  p.k_descale = descale_ptr(k_descale, q, fp8, "k_descale");
  p.v_descale = descale_ptr(v_descale, q, fp8, "v_descale");
  return p;
}

// Output dtype: q's, or out_dtype (float32 when None, as on the CPU) for FP8 inputs.
ScalarType fwd_out_dtype(const Tensor& q, std::optional<ScalarType> out_dtype) {
  if (is_fp8(q.scalar_type())) {
    const ScalarType d = out_dtype.value_or(ScalarType::Float);
    to_tf_dtype(d, "out_dtype");
    return d;
  }
  half_dtype(q.scalar_type(), "q");
  STD_TORCH_CHECK(!out_dtype.has_value() || *out_dtype == q.scalar_type(),
                  "out_dtype must be None or q's dtype for bfloat16/float16 inputs");
  return q.scalar_type();
}

void* current_stream(const Tensor& q) {
  void* stream = nullptr;
  STD_TORCH_CHECK(aoti_torch_get_current_cuda_stream(q.get_device_index(), &stream) ==
                      AOTI_TORCH_SUCCESS,
                  "could not get the current CUDA stream");
  return stream;
}

std::vector<int64_t> lse_shape(const tf_attn_cuda_problem& p) {
  if (p.cu_seqlens_q != nullptr) return {p.heads_q, p.seqlen_q};
  return {p.batch, p.heads_q, p.seqlen_q};
}

std::tuple<Tensor, Tensor> attention_fwd_cuda(
    Tensor q, Tensor k, Tensor v, OptTensor cu_seqlens_q, OptTensor cu_seqlens_kv,
    OptTensor seqlens_q, OptTensor seqlens_kv, double softmax_scale, bool causal,
    double dropout_p, int64_t seed, int64_t offset, OptTensor q_descale, OptTensor k_descale,
    OptTensor v_descale, std::optional<ScalarType> out_dtype) {
  const ScalarType out_type = fwd_out_dtype(q, out_dtype);
  torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  q = rows_aligned(q, "q");
  k = rows_aligned(k, "k");
  v = rows_aligned(v, "v");
  const tf_attn_cuda_problem p =
      make_problem(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, softmax_scale,
                   causal, dropout_p, seed, offset, q_descale, k_descale, v_descale,
                   to_tf_dtype(out_type, "out_dtype"));
  Tensor out = dense_like(q, out_type);
  const std::vector<int64_t> shape = lse_shape(p);
  Tensor lse = new_empty(q, shape, ScalarType::Float);
  if (p.cu_seqlens_q != nullptr) {  // tokens outside every sequence
    torch::stable::zero_(out);
    torch::stable::fill_(lse, -INFINITY);
  }
  check_status(tf_attention_fwd_cuda(&p, in_view(q), in_view(k), in_view(v), out_view(out),
                                     lse.mutable_data_ptr<float>(), current_stream(q)),
               "attention_fwd (CUDA)");
  return std::make_tuple(out, lse);
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd_cuda(
    Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, OptTensor cu_seqlens_q,
    OptTensor cu_seqlens_kv, OptTensor seqlens_q, OptTensor seqlens_kv, double softmax_scale,
    bool causal, double dropout_p, int64_t seed, int64_t offset, OptTensor q_descale,
    OptTensor k_descale, OptTensor v_descale) {
  // Gradients come in the dtype of dout (q's dtype, or the forward's
  // out_dtype for FP8 inputs).
  const tf_dtype dtype = to_tf_dtype(dout.scalar_type(), "dout");
  STD_TORCH_CHECK(is_fp8(q.scalar_type()) || dout.scalar_type() == q.scalar_type(),
                  "dout must have q's dtype for non-FP8 inputs");
  STD_TORCH_CHECK(out.scalar_type() == dout.scalar_type(), "out and dout must have the same dtype");
  torch::stable::accelerator::DeviceGuard guard(q.get_device_index());
  dout = rows_aligned(dout, "dout");
  q = rows_aligned(q, "q");
  k = rows_aligned(k, "k");
  v = rows_aligned(v, "v");
  out = rows_aligned(out, "out");
  const tf_attn_cuda_problem p =
      make_problem(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv, softmax_scale,
                   causal, dropout_p, seed, offset, q_descale, k_descale, v_descale, dtype);
  check_cuda_tensor(dout, q, "dout");
  check_cuda_tensor(out, q, "out");
  check_cuda_tensor(lse, q, "lse");
  for (int64_t d = 0; d < 4; ++d) {
    STD_TORCH_CHECK(dout.size(d) == q.size(d), "dout must have q's shape");
    STD_TORCH_CHECK(out.size(d) == q.size(d), "out must have q's shape");
  }
  const std::vector<int64_t> shape = lse_shape(p);
  STD_TORCH_CHECK(lse.scalar_type() == ScalarType::Float && lse.is_contiguous() &&
                      lse.dim() == static_cast<int64_t>(shape.size()),
                  "lse must be a contiguous float32 tensor of the forward's lse shape");
  for (size_t d = 0; d < shape.size(); ++d)
    STD_TORCH_CHECK(lse.size(static_cast<int64_t>(d)) == shape[d],
                    "lse must be a contiguous float32 tensor of the forward's lse shape");

  const ScalarType grad_type = dout.scalar_type();
  Tensor dq = dense_like(q, grad_type);
  Tensor dk = dense_like(k, grad_type);
  Tensor dv = dense_like(v, grad_type);
  if (p.cu_seqlens_q != nullptr) {  // key tokens outside every sequence
    torch::stable::zero_(dk);
    torch::stable::zero_(dv);
  }
  Tensor dq_accum =
      new_empty(q, {p.batch, p.seqlen_q, p.heads_q, p.head_dim}, ScalarType::Float);
  Tensor delta = new_empty(q, shape, ScalarType::Float);
  check_status(tf_attention_bwd_cuda(&p, in_view(dout), in_view(q), in_view(k), in_view(v),
                                     in_view(out), lse.const_data_ptr<float>(), out_view(dq),
                                     out_view(dk), out_view(dv),
                                     dq_accum.mutable_data_ptr<float>(),
                                     delta.mutable_data_ptr<float>(), current_stream(q)),
               "attention_bwd (CUDA)");
  return std::make_tuple(dq, dk, dv);
}

bool attention_fp8_tensor_cores_cuda(Tensor like) {
  torch::stable::accelerator::DeviceGuard guard(like.get_device_index());
  return tf_attention_cuda_fp8_mma_available() != 0;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CUDA, m) {
  m.impl("attention_fwd", TORCH_BOX(&te_fuser::attention_fwd_cuda));
  m.impl("attention_bwd", TORCH_BOX(&te_fuser::attention_bwd_cuda));
  m.impl("attention_fp8_tensor_cores", TORCH_BOX(&te_fuser::attention_fp8_tensor_cores_cuda));
}

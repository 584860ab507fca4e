// Host-side argument checks shared by the attention launchers.
#pragma once

#include <math.h>
#include <stdint.h>

#include "attention_cuda.h"
#include "../../common/tf_checks.h"

namespace tf_attn {

constexpr int64_t kMaxGridYZ = 65535;

// a + b for non-negative a, b, or -1 when it overflows.
inline int64_t add_or_neg(int64_t a, int64_t b) { return a <= INT64_MAX - b ? a + b : -1; }

// The problem itself: sizes, the packed/padded mode, dtype and scalars.
inline tf_status check_problem(const tf_attn_cuda_problem* p) {
  if (p == nullptr) return TF_ERR_NULL_POINTER;
  if (p->batch < 0 || p->num_seqs < 0 || p->seqlen_q < 0 || p->seqlen_kv < 0 ||
      p->heads_q < 1 || p->heads_kv < 1 || p->heads_q % p->heads_kv != 0)
    return TF_ERR_BAD_SIZE;
  if (!tf_attention_cuda_head_dim_supported(p->head_dim)) return TF_ERR_BAD_SIZE;
  const bool packed = p->cu_seqlens_q != nullptr;
  if (packed != (p->cu_seqlens_kv != nullptr)) return TF_ERR_BAD_ARGUMENT;
  if (packed ? p->batch != 1 : p->num_seqs != p->batch) return TF_ERR_BAD_SIZE;
  if (p->heads_q > kMaxGridYZ || p->num_seqs > kMaxGridYZ) return TF_ERR_BAD_SIZE;
  if (p->seqlen_q > INT32_MAX || p->seqlen_kv > INT32_MAX) return TF_ERR_BAD_SIZE;
  if (p->dtype != TF_BFLOAT16 && p->dtype != TF_FLOAT16) return TF_ERR_BAD_DTYPE;
  if (p->fp8_inputs != 0 && p->fp8_inputs != 1) return TF_ERR_BAD_ARGUMENT;
  if (p->fp8_inputs ? tf_dtype_size(p->out_dtype) == 0 : p->out_dtype != p->dtype)
    return TF_ERR_BAD_DTYPE;
  if (!isfinite(p->softmax_scale)) return TF_ERR_BAD_ARGUMENT;
  if (!(p->dropout_p >= 0.0f && p->dropout_p < 1.0f)) return TF_ERR_BAD_ARGUMENT;
  /* lse / delta have B * H * S elements, indexed in int64. */
  if (!tf_mul_fits(p->batch, p->heads_q) || !tf_mul_fits(p->batch * p->heads_q, p->seqlen_q))
    return TF_ERR_OVERFLOW;
  return TF_OK;
}

// One [B, S, H, D] tensor: 16-byte aligned rows and an int64-safe extent.
inline tf_status check_tensor(const void* data, int64_t sb, int64_t ss, int64_t sh, int64_t b,
                              int64_t s, int64_t h, int64_t d, int64_t elem_bytes) {
  if (b == 0 || s == 0) return TF_OK;
  if (data == nullptr) return TF_ERR_NULL_POINTER;
  if (sb < 0 || ss < 0 || sh < 0) return TF_ERR_BAD_SIZE;
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0 || (sb * elem_bytes) % 16 != 0 ||
      (ss * elem_bytes) % 16 != 0 || (sh * elem_bytes) % 16 != 0)
    return TF_ERR_BAD_ARGUMENT;
  int64_t extent = d;
  const int64_t dims[3][2] = {{b, sb}, {s, ss}, {h, sh}};
  for (int i = 0; i < 3; ++i) {
    if (!tf_mul_fits(dims[i][0] - 1, dims[i][1])) return TF_ERR_OVERFLOW;
    extent = add_or_neg(extent, (dims[i][0] - 1) * dims[i][1]);
    if (extent < 0) return TF_ERR_OVERFLOW;
  }
  if (!tf_mul_fits(extent, elem_bytes)) return TF_ERR_OVERFLOW;
  return TF_OK;
}

inline tf_status check_in(const tf_attn_cuda_tensor& t, int64_t b, int64_t s, int64_t h,
                          int64_t d, int64_t elem_bytes) {
  return check_tensor(t.data, t.stride_batch, t.stride_token, t.stride_head, b, s, h, d,
                      elem_bytes);
}

inline tf_status check_out(const tf_attn_cuda_out_tensor& t, int64_t b, int64_t s, int64_t h,
                           int64_t d, int64_t elem_bytes) {
  return check_tensor(t.data, t.stride_batch, t.stride_token, t.stride_head, b, s, h, d,
                      elem_bytes);
}

// The common inputs q, k, v.
inline tf_status check_qkv(const tf_attn_cuda_problem* p, const tf_attn_cuda_tensor& q,
                           const tf_attn_cuda_tensor& k, const tf_attn_cuda_tensor& v) {
  const int64_t in_bytes = p->fp8_inputs ? 1 : 2;
  tf_status st = check_in(q, p->batch, p->seqlen_q, p->heads_q, p->head_dim, in_bytes);
  if (st == TF_OK) st = check_in(k, p->batch, p->seqlen_kv, p->heads_kv, p->head_dim, in_bytes);
  if (st == TF_OK) st = check_in(v, p->batch, p->seqlen_kv, p->heads_kv, p->head_dim, in_bytes);
  if (st == TF_OK && p->fp8_inputs &&
      (p->q_descale == nullptr || p->k_descale == nullptr || p->v_descale == nullptr))
    st = TF_ERR_NULL_POINTER;
  return st;
}

}  // namespace tf_attn

// Schemas of the fused attention ops and their CPU implementations, which
// call the C core in csrc/attention over work units spread on torch's
// intra-op thread pool (schema details: csrc/attention/attention.h).
#include <algorithm>
#include <atomic>
#include <optional>
#include <vector>

#include "binding_util.h"

extern "C" {
#include "../attention/attention.h"
}

namespace te_fuser {
namespace {

using OptTensor = std::optional<Tensor>;

tf_attn_elem to_attn_elem(ScalarType t, const char* arg) {
  if (t == ScalarType::Float8_e4m3fn) return TF_ATTN_E4M3;
  return static_cast<tf_attn_elem>(to_tf_dtype(t, arg));
}

// A [B, S, H, D] tensor as a C operand; descale only for E4M3.
tf_attn_operand operand(const Tensor& t, const char* arg, float descale = 1.0f) {
  STD_TORCH_CHECK(t.dim() == 4, arg, " must be 4-D [batch, seq, heads, head_dim]");
  STD_TORCH_CHECK(t.size(3) <= 1 || t.stride(3) == 1, arg, " must have a contiguous last dim");
  tf_attn_operand op;
  op.data = t.data_ptr();
  op.elem = to_attn_elem(t.scalar_type(), arg);
  op.stride_b = t.stride(0);
  op.stride_s = t.stride(1);
  op.stride_h = t.stride(2);
  op.descale = descale;
  return op;
}

// An empty tensor of `like`'s sizes whose dims 0..2 are laid out in the order
// of like's strides (last dim innermost), so an sbhd view gets an sbhd output.
Tensor empty_in_order_of(const Tensor& like, ScalarType dtype) {
  int64_t order[3] = {0, 1, 2};  // outermost first: a stable sort by decreasing stride
  for (int i = 1; i < 3; ++i)
    for (int j = i; j > 0 && like.stride(order[j]) > like.stride(order[j - 1]); --j)
      std::swap(order[j], order[j - 1]);
  std::vector<int64_t> sizes = {like.size(order[0]), like.size(order[1]), like.size(order[2]),
                                like.size(3)};
  Tensor t = new_empty(like, sizes, dtype);
  // Dim i of t holds logical dim order[i]; transpose until they line up.
  for (int i = 0; i < 3; ++i) {
    for (int j = i; j < 3; ++j) {
      if (order[j] == i) {
        if (j != i) {
          t = torch::stable::transpose(t, i, j);
          std::swap(order[i], order[j]);
        }
        break;
      }
    }
  }
  return t;
}

const int32_t* int32_data(const OptTensor& t, const char* arg, int64_t numel,
                          const Tensor& like) {
  if (!t.has_value()) return nullptr;
  STD_TORCH_CHECK(t->scalar_type() == ScalarType::Int && t->dim() == 1 && t->is_contiguous(),
                  arg, " must be a contiguous 1-D int32 tensor");
  STD_TORCH_CHECK(t->numel() == numel, arg, " must have ", numel, " elements");
  check_same_device(*t, like, arg, "q");
  return t->const_data_ptr<int32_t>();
}

float descale_of(const OptTensor& t, const char* arg, bool fp8, const Tensor& like) {
  if (!fp8) {
    STD_TORCH_CHECK(!t.has_value(), arg, " is only accepted with float8_e4m3fn inputs");
    return 1.0f;
  }
  STD_TORCH_CHECK(t.has_value(), arg, " is required with float8_e4m3fn inputs");
  check_scalar_f32(*t, arg);
  check_same_device(*t, like, arg, "q");
  return *t->const_data_ptr<float>();
}

struct Problem {
  tf_attn_problem p;
  bool fp8;
  float descale[3];
};

// Shared argument checks of forward and backward; fills the C problem.
Problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& cu_q,
                     const OptTensor& cu_kv, const OptTensor& lens_q, const OptTensor& lens_kv,
                     double softmax_scale, bool causal, double dropout_p, int64_t seed,
                     int64_t offset, const OptTensor& q_descale, const OptTensor& k_descale,
                     const OptTensor& v_descale) {
  STD_TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
                  "q, k and v must be 4-D [batch, seq, heads, head_dim]");
  check_same_device(q, k, "q", "k");
  check_same_device(q, v, "q", "v");
  STD_TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                  "q, k and v must have the same dtype");
  STD_TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "q, k and v must have the same batch size");
  STD_TORCH_CHECK(k.size(3) == q.size(3) && v.size(3) == q.size(3), "q, k and v must have the same head_dim");
  for (int d = 1; d < 3; ++d)
    STD_TORCH_CHECK(v.size(d) == k.size(d), "k and v must have the same sequence length and heads");
  STD_TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0,
                  "the number of query heads must be a multiple of the number of kv heads");
  STD_TORCH_CHECK(cu_q.has_value() == cu_kv.has_value(),
                  "cu_seqlens_q and cu_seqlens_kv must be given together");
  Problem r{};
  r.fp8 = q.scalar_type() == ScalarType::Float8_e4m3fn;
  tf_attn_problem& p = r.p;
  p.batch = q.size(0);
  p.seq_q = q.size(1);
  p.seq_kv = k.size(1);
  p.heads_q = q.size(2);
  p.heads_kv = k.size(2);
  p.head_dim = q.size(3);
  if (cu_q.has_value()) {
    STD_TORCH_CHECK(p.batch == 1, "packed (cu_seqlens) inputs must have batch size 1");
    STD_TORCH_CHECK(!lens_q.has_value() && !lens_kv.has_value(),
                    "seqlens and cu_seqlens cannot be combined");
    STD_TORCH_CHECK(cu_q->dim() == 1 && cu_q->numel() >= 1, "cu_seqlens_q must be 1-D with N + 1 entries");
    p.num_seqs = cu_q->numel() - 1;
    p.cu_seqlens_q = int32_data(cu_q, "cu_seqlens_q", p.num_seqs + 1, q);
    p.cu_seqlens_kv = int32_data(cu_kv, "cu_seqlens_kv", p.num_seqs + 1, q);
  }
  p.seqlens_q = int32_data(lens_q, "seqlens_q", p.batch, q);
  p.seqlens_kv = int32_data(lens_kv, "seqlens_kv", p.batch, q);
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.causal = causal ? 1 : 0;
  p.dropout_p = static_cast<float>(dropout_p);
  p.seed = static_cast<uint64_t>(seed);
  p.offset = static_cast<uint64_t>(offset);
  r.descale[0] = descale_of(q_descale, "q_descale", r.fp8, q);
  r.descale[1] = descale_of(k_descale, "k_descale", r.fp8, q);
  r.descale[2] = descale_of(v_descale, "v_descale", r.fp8, q);
  check_status(tf_attn_check(&p), "attention");
  return r;
}

Tensor empty_stats(const Tensor& q, const tf_attn_problem& p) {
  if (p.cu_seqlens_q) return new_empty(q, {p.heads_q, p.seq_q}, ScalarType::Float);
  return new_empty(q, {p.batch, p.heads_q, p.seq_q}, ScalarType::Float);
}

void check_stats(const Tensor& lse, const Tensor& q, const tf_attn_problem& p) {
  STD_TORCH_CHECK(lse.scalar_type() == ScalarType::Float && lse.is_contiguous(),
                  "lse must be a contiguous float32 tensor");
  const bool ok = p.cu_seqlens_q
                      ? lse.dim() == 2 && lse.size(0) == p.heads_q && lse.size(1) == p.seq_q
                      : lse.dim() == 3 && lse.size(0) == p.batch && lse.size(1) == p.heads_q &&
                            lse.size(2) == p.seq_q;
  STD_TORCH_CHECK(ok, "lse must be [batch, heads_q, seq_q] (or [heads_q, tokens] when packed)");
  check_same_device(lse, q, "lse", "q");
}

// Runs fn(begin, end, scratch) -> tf_status over the units [0, units). Each
// thread takes ranges of a few units from a shared counter until none are
// left, so a thread slowed down by other load on the machine ends up with
// fewer units instead of holding up the call. With last_first the ranges are
// handed out from the end: for the units of query tiles the last tiles carry
// the most keys under causality, and the cheap first ones then even out the
// finish. The scratch of every thread is one row of a tensor allocated here
// (so torch's memory accounting sees it); statuses are checked after the
// parallel region so nothing throws inside it.
template <class F>
void parallel_units(const Tensor& like, int64_t units, int64_t scratch_floats, bool last_first,
                    const char* what, const F& fn) {
  if (units == 0) return;
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  const int64_t chunks = units < threads ? units : (threads > 0 ? threads : 1);
  // About 16 ranges per thread: a fine enough split, and few enough calls that
  // the C core's per-call checks stay negligible.
  const int64_t grain = std::max<int64_t>(1, units / (chunks * 16));
  Tensor scratch = new_empty(like, {chunks, scratch_floats > 0 ? scratch_floats : 1},
                                            ScalarType::Float);
  float* base = scratch.mutable_data_ptr<float>();
  const int64_t row = scratch.size(1);
  std::atomic<int64_t> next{0};
  std::vector<int> status(static_cast<size_t>(chunks), TF_OK);
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      while (status[c] == TF_OK) {
        const int64_t taken = next.fetch_add(grain, std::memory_order_relaxed);
        if (taken >= units) break;
        const int64_t n = std::min(grain, units - taken);
        const int64_t begin = last_first ? units - taken - n : taken;
        status[c] = fn(begin, begin + n, base + c * row);
      }
    }
  });
  for (int64_t c = 0; c < chunks; ++c) check_status(static_cast<tf_status>(status[c]), what);
}

std::tuple<Tensor, Tensor> attention_fwd_cpu(Tensor q, Tensor k, Tensor v, OptTensor cu_seqlens_q,
                                             OptTensor cu_seqlens_kv, OptTensor seqlens_q,
                                             OptTensor seqlens_kv, double softmax_scale,
                                             bool causal, double dropout_p, int64_t seed,
                                             int64_t offset, OptTensor q_descale,
                                             OptTensor k_descale, OptTensor v_descale,
                                             std::optional<ScalarType> out_dtype) {
  STD_TORCH_CHECK(q.is_cpu(), "attention_fwd: this implementation takes CPU tensors");
  const Problem r = make_problem(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv,
                                 softmax_scale, causal, dropout_p, seed, offset, q_descale,
                                 k_descale, v_descale);
  ScalarType dtype = q.scalar_type();
  if (r.fp8) {
    dtype = out_dtype.value_or(ScalarType::Float);
  } else {
    STD_TORCH_CHECK(!out_dtype.has_value() || *out_dtype == dtype,
                    "out_dtype must be q's dtype for non-FP8 inputs");
  }
  to_tf_dtype(dtype, "out_dtype");
  Tensor out = empty_in_order_of(q, dtype);
  Tensor lse = empty_stats(q, r.p);
  const tf_attn_operand oq = operand(q, "q", r.descale[0]), ok = operand(k, "k", r.descale[1]),
                        ov = operand(v, "v", r.descale[2]), oo = operand(out, "out");
  float* lse_data = lse.mutable_data_ptr<float>();
  parallel_units(q, tf_attn_fwd_units(&r.p), tf_attn_fwd_scratch_floats(&r.p), true, "attention_fwd",
                 [&](int64_t u0, int64_t u1, float* scratch) {
                   return tf_attn_fwd(&r.p, &oq, &ok, &ov, &oo, lse_data, u0, u1, scratch);
                 });
  return std::make_tuple(out, lse);
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd_cpu(
    Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, OptTensor cu_seqlens_q,
    OptTensor cu_seqlens_kv, OptTensor seqlens_q, OptTensor seqlens_kv, double softmax_scale,
    bool causal, double dropout_p, int64_t seed, int64_t offset, OptTensor q_descale,
    OptTensor k_descale, OptTensor v_descale) {
  STD_TORCH_CHECK(q.is_cpu(), "attention_bwd: this implementation takes CPU tensors");
  const Problem r = make_problem(q, k, v, cu_seqlens_q, cu_seqlens_kv, seqlens_q, seqlens_kv,
                                 softmax_scale, causal, dropout_p, seed, offset, q_descale,
                                 k_descale, v_descale);
  for (const Tensor* t : {&dout, &out}) {
    STD_TORCH_CHECK(t->dim() == 4 && t->size(0) == q.size(0) && t->size(1) == q.size(1) &&
                        t->size(2) == q.size(2) && t->size(3) == q.size(3),
                    "dout and out must have q's shape");
    check_same_device(*t, q, "dout and out", "q");
  }
  STD_TORCH_CHECK(dout.scalar_type() == out.scalar_type(), "dout and out must have the same dtype");
  STD_TORCH_CHECK(r.fp8 || dout.scalar_type() == q.scalar_type(),
                  "dout must have q's dtype for non-FP8 inputs");
  check_stats(lse, q, r.p);
  const ScalarType grad_dtype = dout.scalar_type();
  to_tf_dtype(grad_dtype, "dout");
  Tensor dq = empty_in_order_of(q, grad_dtype);
  Tensor dk = empty_in_order_of(k, grad_dtype);
  Tensor dv = empty_in_order_of(v, grad_dtype);
  Tensor delta = empty_stats(q, r.p);
  const tf_attn_operand odo = operand(dout, "dout"), oout = operand(out, "out");
  const tf_attn_operand oq = operand(q, "q", r.descale[0]), ok = operand(k, "k", r.descale[1]),
                        ov = operand(v, "v", r.descale[2]);
  const tf_attn_operand odq = operand(dq, "dq"), odk = operand(dk, "dk"), odv = operand(dv, "dv");
  float* delta_data = delta.mutable_data_ptr<float>();
  const float* lse_data = lse.const_data_ptr<float>();
  parallel_units(q, tf_attn_rowdot_units(&r.p), 0, false, "attention_bwd",
                 [&](int64_t u0, int64_t u1, float*) {
                   return tf_attn_bwd_rowdot(&r.p, &odo, &oout, delta_data, u0, u1);
                 });
  const int64_t scratch = tf_attn_bwd_scratch_floats(&r.p);
  const int64_t threads = static_cast<int64_t>(torch::stable::get_num_threads());
  if (tf_attn_bwd_units(&r.p) < threads) {
    // Too few (sequence, kv head) units to keep every thread busy: dK/dV per
    // key tile, then dQ per query tile.
    parallel_units(q, tf_attn_bwd_dkdv_units(&r.p), scratch, false, "attention_bwd",
                   [&](int64_t u0, int64_t u1, float* buf) {
                     return tf_attn_bwd_dkdv(&r.p, &odo, &oq, &ok, &ov, lse_data, delta_data,
                                             &odk, &odv, u0, u1, buf);
                   });
    parallel_units(q, tf_attn_fwd_units(&r.p), scratch, true, "attention_bwd",
                   [&](int64_t u0, int64_t u1, float* buf) {
                     return tf_attn_bwd_dq(&r.p, &odo, &oq, &ok, &ov, lse_data, delta_data, &odq,
                                           u0, u1, buf);
                   });
    return std::make_tuple(dq, dk, dv);
  }
  // dQ is accumulated in float32: in dq itself when it is float32.
  Tensor dq_accum = grad_dtype == ScalarType::Float ? dq : empty_in_order_of(q, ScalarType::Float);
  const tf_attn_operand oacc = operand(dq_accum, "dq_accum");
  parallel_units(q, tf_attn_bwd_units(&r.p), scratch, false, "attention_bwd",
                 [&](int64_t u0, int64_t u1, float* buf) {
                   return tf_attn_bwd(&r.p, &odo, &oq, &ok, &ov, lse_data, delta_data, &oacc,
                                      &odq, &odk, &odv, u0, u1, buf);
                 });
  return std::make_tuple(dq, dk, dv);
}

// The CPU kernels decode FP8 tiles inside the kernel (to bf16 for AMX tiles, else float32).
bool attention_fp8_tensor_cores_cpu(Tensor) { return false; }

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_kv,"
      " Tensor? seqlens_q, Tensor? seqlens_kv, float softmax_scale, bool causal, float dropout_p,"
      " int seed, int offset, Tensor? q_descale, Tensor? k_descale, Tensor? v_descale,"
      " ScalarType? out_dtype) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,"
      " Tensor? cu_seqlens_q, Tensor? cu_seqlens_kv, Tensor? seqlens_q, Tensor? seqlens_kv,"
      " float softmax_scale, bool causal, float dropout_p, int seed, int offset,"
      " Tensor? q_descale, Tensor? k_descale, Tensor? v_descale)"
      " -> (Tensor dq, Tensor dk, Tensor dv)");
  // Whether attention_fwd runs FP8 inputs on FP8 tensor cores on like's device.
  m.def("attention_fp8_tensor_cores(Tensor like) -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CPU, m) {
  m.impl("attention_fwd", TORCH_BOX(&te_fuser::attention_fwd_cpu));
  m.impl("attention_bwd", TORCH_BOX(&te_fuser::attention_bwd_cpu));
  m.impl("attention_fp8_tensor_cores", TORCH_BOX(&te_fuser::attention_fp8_tensor_cores_cpu));
}

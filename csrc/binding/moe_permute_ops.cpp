// Schemas and CPU implementations of the MoE permutation ops over the C core in csrc/ops/moe_permute.h.
// A row_id_map is int32: (tokens, 2 experts + 1) for map kind 0 (mask), (topk, tokens) for kind 1 (index).
// Data tensors are 2-D (rows, hidden) and contiguous; the gathers copy elements of any dtype (FP8 codes
// and scales included), the weighted sums take float32, bfloat16 or float16.
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "binding_util.h"

extern "C" {
#include "../ops/moe_permute.h"
}

namespace te_fuser {
namespace {

using OptTensor = std::optional<Tensor>;

void check_2d(const Tensor& t, const char* arg) {
  STD_TORCH_CHECK(t.dim() == 2, arg, " must be 2-D, got ", t.dim(), " dimensions");
  check_contiguous(t, arg);
}

tf_moe_rows rows_of(const Tensor& t) {
  return {const_cast<void*>(t.const_data_ptr()), t.size(0), t.size(1), t.size(1),
          static_cast<int64_t>(t.element_size())};
}

tf_moe_map map_of(const Tensor& map, int64_t kind) {
  STD_TORCH_CHECK(kind == TF_MOE_MAP_MASK || kind == TF_MOE_MAP_INDEX, "map_kind must be 0 (mask) or 1 (index)");
  STD_TORCH_CHECK(map.scalar_type() == ScalarType::Int, "row_id_map must be int32");
  check_2d(map, "row_id_map");
  if (kind == TF_MOE_MAP_MASK) {
    STD_TORCH_CHECK(map.size(1) % 2 == 1, "a mask row_id_map must have 2 experts + 1 columns");
    return {map.const_data_ptr<int32_t>(), TF_MOE_MAP_MASK, map.size(0), (map.size(1) - 1) / 2};
  }
  return {map.const_data_ptr<int32_t>(), TF_MOE_MAP_INDEX, map.size(1), map.size(0)};
}

// Rows [0, kept) of a permuted tensor are the map's destinations; the rest are not written.
int64_t kept_rows(const tf_moe_map& m) {
  int64_t kept = 0;
  if (m.kind == TF_MOE_MAP_MASK) {
    for (int64_t t = 0; t < m.tokens; ++t) kept += m.data[t * (2 * m.width + 1) + 2 * m.width];
  } else {
    for (int64_t i = 0; i < m.tokens * m.width; ++i) kept += m.data[i] != -1;
  }
  return kept;
}

void zero_tail(Tensor& t, int64_t from_row) {
  if (from_row >= t.size(0) || t.numel() == 0) return;
  const int64_t row_bytes = t.size(1) * static_cast<int64_t>(t.element_size());
  std::memset(static_cast<char*>(t.mutable_data_ptr()) + from_row * row_bytes, 0,
              static_cast<size_t>((t.size(0) - from_row) * row_bytes));
}

// Runs fn(token_begin, token_end) -> tf_status over bands of about kGrainElements elements.
template <class F>
void parallel_tokens(int64_t tokens, int64_t cols, const char* what, const F& fn) {
  const int64_t band = kGrainElements / (cols > 0 ? cols : 1) + 1;
  const int64_t bands = (tokens + band - 1) / band;
  std::vector<int> status(static_cast<size_t>(bands), TF_OK);
  torch::stable::parallel_for(0, bands, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t0 = b * band;
      status[b] = fn(t0, tokens - t0 < band ? tokens : t0 + band);
    }
  });
  for (int64_t b = 0; b < bands; ++b) {
    STD_TORCH_CHECK(status[b] != TF_ERR_BAD_ARGUMENT, what, ": row_id_map holds an entry outside its range");
    check_status(static_cast<tf_status>(status[b]), what);
  }
}

Tensor moe_mask_row_id_map_cpu(Tensor routing_map, int64_t num_out_tokens) {
  STD_TORCH_CHECK(routing_map.dim() == 2 && routing_map.scalar_type() == ScalarType::Bool,
                  "routing_map must be a 2-D bool tensor");
  const int64_t tokens = routing_map.size(0), experts = routing_map.size(1);
  Tensor map = new_empty(routing_map, {tokens, 2 * experts + 1}, ScalarType::Int);
  std::vector<int64_t> counts(static_cast<size_t>(experts) + 1);
  int64_t kept = 0;
  check_status(tf_moe_mask_row_id_map(static_cast<const uint8_t*>(routing_map.const_data_ptr()), tokens, experts,
                                      routing_map.stride(0), routing_map.stride(1), num_out_tokens, counts.data(),
                                      tokens > 0 ? map.mutable_data_ptr<int32_t>() : nullptr, &kept),
               "moe_mask_row_id_map");
  return map;
}

Tensor moe_index_row_id_map_cpu(Tensor indices, int64_t num_experts, int64_t num_out_tokens) {
  STD_TORCH_CHECK(indices.scalar_type() == ScalarType::Int, "routing_map (expert indices) must be int32");
  check_2d(indices, "routing_map");
  const int64_t tokens = indices.size(0), topk = indices.size(1);
  Tensor map = new_empty(indices, {topk, tokens}, ScalarType::Int);
  std::vector<int64_t> counts(static_cast<size_t>(num_experts > 0 ? num_experts : 0) + 1);
  const tf_status s = tf_moe_index_row_id_map(indices.const_data_ptr<int32_t>(), tokens, topk, num_experts,
                                              num_out_tokens, counts.data(),
                                              map.numel() > 0 ? map.mutable_data_ptr<int32_t>() : nullptr);
  STD_TORCH_CHECK(s != TF_ERR_BAD_ARGUMENT, "moe_index_row_id_map: every expert index must be in [0, ", num_experts,
                  ")");
  check_status(s, "moe_index_row_id_map");
  return map;
}

std::tuple<Tensor, Tensor> moe_permute_rows_cpu(Tensor input, Tensor row_id_map, int64_t map_kind,
                                                int64_t num_out_tokens, OptTensor probs) {
  check_2d(input, "input");
  const tf_moe_map m = map_of(row_id_map, map_kind);
  STD_TORCH_CHECK(input.size(0) == m.tokens, "input must have one row per token of row_id_map");
  STD_TORCH_CHECK(num_out_tokens >= 0, "num_out_tokens must be >= 0");
  check_same_device(input, row_id_map, "input", "row_id_map");
  Tensor out = new_empty(input, {num_out_tokens, input.size(1)}, input.scalar_type());
  Tensor out_probs = new_empty(input, {probs ? num_out_tokens : 0}, probs ? probs->scalar_type() : ScalarType::Float);
  tf_moe_rows probs_rows{};
  if (probs) {
    check_2d(*probs, "probs");
    check_same_device(*probs, input, "probs", "input");
    probs_rows = rows_of(*probs);
  }
  const tf_moe_rows in = rows_of(input), o = rows_of(out);
  void* op = out_probs.numel() > 0 ? out_probs.mutable_data_ptr() : nullptr;
  parallel_tokens(m.tokens, input.size(1), "moe_permute", [&](int64_t t0, int64_t t1) {
    return tf_moe_permute(m, in, probs ? &probs_rows : nullptr, o, op, t0, t1);
  });
  const int64_t kept = kept_rows(m);
  zero_tail(out, kept);
  if (probs && kept < num_out_tokens)
    std::memset(static_cast<char*>(op) + kept * out_probs.element_size(), 0,
                static_cast<size_t>((num_out_tokens - kept) * out_probs.element_size()));
  return {out, out_probs};
}

Tensor moe_unpermute_rows_cpu(Tensor input, Tensor row_id_map, int64_t map_kind, OptTensor weights,
                              int64_t num_tokens) {
  check_2d(input, "input");
  const tf_moe_map m = map_of(row_id_map, map_kind);
  STD_TORCH_CHECK(num_tokens == m.tokens, "num_tokens must be row_id_map's number of tokens");
  check_same_device(input, row_id_map, "input", "row_id_map");
  const tf_dtype dtype = to_tf_dtype(input.scalar_type(), "input");
  tf_moe_rows w{};
  tf_dtype w_dtype = TF_FLOAT32;
  if (weights) {
    check_2d(*weights, "merging_probs");
    check_same_device(*weights, input, "merging_probs", "input");
    w_dtype = to_tf_dtype(weights->scalar_type(), "merging_probs");
    w = rows_of(*weights);
  }
  Tensor out = new_empty(input, {num_tokens, input.size(1)}, input.scalar_type());
  const tf_moe_rows in = rows_of(input), o = rows_of(out);
  parallel_tokens(m.tokens, input.size(1), "moe_unpermute", [&](int64_t t0, int64_t t1) {
    return tf_moe_unpermute(m, in, dtype, weights ? &w : nullptr, w_dtype, o, t0, t1);
  });
  return out;
}

std::tuple<Tensor, Tensor> moe_unpermute_backward_cpu(Tensor grad, Tensor fwd_input, Tensor row_id_map,
                                                      int64_t map_kind, Tensor weights) {
  check_2d(grad, "grad");
  check_2d(fwd_input, "fwd_input");
  check_2d(weights, "merging_probs");
  const tf_moe_map m = map_of(row_id_map, map_kind);
  check_same_device(grad, fwd_input, "grad", "fwd_input");
  check_same_device(grad, row_id_map, "grad", "row_id_map");
  check_same_device(grad, weights, "grad", "merging_probs");
  STD_TORCH_CHECK(grad.scalar_type() == fwd_input.scalar_type(), "grad and fwd_input must have the same dtype");
  const tf_dtype dtype = to_tf_dtype(grad.scalar_type(), "grad");
  const tf_dtype w_dtype = to_tf_dtype(weights.scalar_type(), "merging_probs");
  Tensor act_grad = new_empty(grad, {fwd_input.size(0), grad.size(1)}, grad.scalar_type());
  Tensor w_grad = new_empty(grad, {weights.size(0), weights.size(1)}, weights.scalar_type());
  const tf_moe_rows g = rows_of(grad), x = rows_of(fwd_input), w = rows_of(weights), dx = rows_of(act_grad),
                    dw = rows_of(w_grad);
  parallel_tokens(m.tokens, grad.size(1), "moe_unpermute_backward", [&](int64_t t0, int64_t t1) {
    return tf_moe_unpermute_backward(m, g, x, dtype, w, w_dtype, dx, dw, t0, t1);
  });
  zero_tail(act_grad, kept_rows(m));
  return {act_grad, w_grad};
}

Tensor moe_unpermute_probs_cpu(Tensor permuted_probs, Tensor row_id_map, int64_t map_kind) {
  STD_TORCH_CHECK(permuted_probs.dim() == 1 && permuted_probs.is_contiguous(),
                  "permuted_probs must be 1-D and contiguous");
  const tf_moe_map m = map_of(row_id_map, map_kind);
  check_same_device(permuted_probs, row_id_map, "permuted_probs", "row_id_map");
  Tensor out = new_empty(permuted_probs, {m.tokens, m.width}, permuted_probs.scalar_type());
  const tf_moe_rows p = {const_cast<void*>(permuted_probs.const_data_ptr()), permuted_probs.size(0), 1, 1,
                         static_cast<int64_t>(permuted_probs.element_size())};
  const tf_moe_rows o = rows_of(out);
  parallel_tokens(m.tokens, m.width, "moe_unpermute_probs",
                  [&](int64_t t0, int64_t t1) { return tf_moe_unpermute_probs(m, p, o, t0, t1); });
  return out;
}

Tensor moe_chunk_sort_map_cpu(Tensor split_sizes, Tensor sorted_index, int64_t num_tokens) {
  STD_TORCH_CHECK(split_sizes.scalar_type() == ScalarType::Long && split_sizes.dim() == 1 &&
                      split_sizes.is_contiguous(),
                  "split_sizes must be a contiguous 1-D int64 tensor");
  STD_TORCH_CHECK(sorted_index.scalar_type() == ScalarType::Long && sorted_index.dim() == 1 &&
                      sorted_index.is_contiguous() && sorted_index.size(0) == split_sizes.size(0),
                  "sorted_index must be a contiguous 1-D int64 tensor as long as split_sizes");
  const int64_t splits = split_sizes.size(0);
  Tensor map = new_empty(split_sizes, {num_tokens}, ScalarType::Int);
  std::vector<int64_t> scratch(static_cast<size_t>(splits) + 1);
  const tf_status s = tf_moe_chunk_sort_map(splits ? split_sizes.const_data_ptr<int64_t>() : nullptr,
                                            splits ? sorted_index.const_data_ptr<int64_t>() : nullptr, splits,
                                            num_tokens, scratch.data(),
                                            num_tokens ? map.mutable_data_ptr<int32_t>() : nullptr);
  STD_TORCH_CHECK(s != TF_ERR_BAD_ARGUMENT, "sorted_index must be a permutation of [0, ", splits, ")");
  STD_TORCH_CHECK(s != TF_ERR_BAD_SIZE, "split_sizes must be >= 0 and add up to the ", num_tokens, " tokens");
  check_status(s, "moe_chunk_sort_map");
  return map;
}

Tensor moe_sort_rows_cpu(Tensor input, Tensor map, bool forward) {
  STD_TORCH_CHECK(input.dim() == 1 || input.dim() == 2, "input must be 1-D or 2-D");
  check_contiguous(input, "input");
  STD_TORCH_CHECK(map.scalar_type() == ScalarType::Int && map.dim() == 1 && map.is_contiguous() &&
                      map.size(0) == input.size(0),
                  "the chunk map must be contiguous 1-D int32 with one entry per row of input");
  check_same_device(input, map, "input", "map");
  Tensor out = new_empty(input, input.sizes(), input.scalar_type());
  const int64_t cols = input.dim() == 2 ? input.size(1) : 1;
  const int64_t es = static_cast<int64_t>(input.element_size());
  const tf_moe_rows in = {const_cast<void*>(input.const_data_ptr()), input.size(0), cols, cols, es};
  const tf_moe_rows o = {out.mutable_data_ptr(), input.size(0), cols, cols, es};
  const int32_t* mp = map.numel() ? map.const_data_ptr<int32_t>() : nullptr;
  parallel_tokens(input.size(0), cols, "moe_sort_chunks_by_index",
                  [&](int64_t t0, int64_t t1) { return tf_moe_sort_rows(mp, forward, in, o, t0, t1); });
  return out;
}

}  // namespace
}  // namespace te_fuser

STABLE_TORCH_LIBRARY_FRAGMENT(te_fuser, m) {
  m.def("moe_mask_row_id_map(Tensor routing_map, int num_out_tokens) -> Tensor");
  m.def("moe_index_row_id_map(Tensor indices, int num_experts, int num_out_tokens) -> Tensor");
  m.def("moe_permute_rows(Tensor input, Tensor row_id_map, int map_kind, int num_out_tokens, Tensor? probs)"
        " -> (Tensor, Tensor)");
  m.def("moe_unpermute_rows(Tensor input, Tensor row_id_map, int map_kind, Tensor? merging_probs, int num_tokens)"
        " -> Tensor");
  m.def("moe_unpermute_backward(Tensor grad, Tensor fwd_input, Tensor row_id_map, int map_kind,"
        " Tensor merging_probs) -> (Tensor, Tensor)");
  m.def("moe_unpermute_probs(Tensor permuted_probs, Tensor row_id_map, int map_kind) -> Tensor");
  m.def("moe_chunk_sort_map(Tensor split_sizes, Tensor sorted_index, int num_tokens) -> Tensor");
  m.def("moe_sort_rows(Tensor input, Tensor map, bool forward) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(te_fuser, CPU, m) {
  m.impl("moe_mask_row_id_map", TORCH_BOX(&te_fuser::moe_mask_row_id_map_cpu));
  m.impl("moe_index_row_id_map", TORCH_BOX(&te_fuser::moe_index_row_id_map_cpu));
  m.impl("moe_permute_rows", TORCH_BOX(&te_fuser::moe_permute_rows_cpu));
  m.impl("moe_unpermute_rows", TORCH_BOX(&te_fuser::moe_unpermute_rows_cpu));
  m.impl("moe_unpermute_backward", TORCH_BOX(&te_fuser::moe_unpermute_backward_cpu));
  m.impl("moe_unpermute_probs", TORCH_BOX(&te_fuser::moe_unpermute_probs_cpu));
  m.impl("moe_chunk_sort_map", TORCH_BOX(&te_fuser::moe_chunk_sort_map_cpu));
  m.impl("moe_sort_rows", TORCH_BOX(&te_fuser::moe_sort_rows_cpu));
}

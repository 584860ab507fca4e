// The parts of the forward that do not depend on how the MMA operands are
// stored: kernel arguments, the CTA's sequence rows, the masked online
// softmax of one score tile, dropout, and the epilogue. Shared by the 16-bit
// kernel (attention_fwd.cu) and the FP8 tensor-core one (attention_fwd_fp8.cu).
//
// Fragment conventions (MMA C layout): thread (g = lane / 4, t = lane % 4) of
// a warp holds, for each n8 tile i, s[i][0..1] at row g, columns 2t and 2t+1
// and s[i][2..3] at row g + 8; the warp owns 16 query rows.
#pragma once

#include "attention_device.cuh"
#include "attention_traits.cuh"

namespace tf_attn {

struct FwdArgs {
  tf_attn_cuda_problem p;
  tf_attn_cuda_tensor q, k, v;
  tf_attn_cuda_out_tensor out;
  float* lse;
};

// What a forward CTA covers: its query rows m0.., the keys it must visit
// (n_blocks tiles of BN), where its q rows and its kv head's k / v rows start,
// and the softmax scale in log2 units.
struct FwdBlock {
  SeqRows qr, kr;
  int64_t h, hk, m0, q_valid;
  int n_blocks;
  const char *q_rows, *k_rows, *v_rows;
  float scale_log2;
};

// Byte address of row `row` of head h of sequence rows `r` in tensor x.
__device__ __forceinline__ const char* row_ptr(const tf_attn_cuda_tensor& x, const SeqRows& r,
                                               int64_t row, int64_t h, int elem_bytes) {
  return static_cast<const char*>(x.data) +
         (r.batch * x.stride_batch + (r.begin + row) * x.stride_token + h * x.stride_head) *
             elem_bytes;
}

// Last query blocks first: under a causal mask they carry the most keys, so
// the short ones fill the tail of the grid. Returns false when the block lies
// past the sequence's rows (the CTA has nothing to do).
template <int BM, int BN>
__device__ __forceinline__ bool fwd_block(const FwdArgs& a, bool fp8, FwdBlock& b) {
  const tf_attn_cuda_problem& p = a.p;
  b.h = blockIdx.y;
  b.hk = b.h / (p.heads_q / p.heads_kv);
  b.qr = seq_rows(p.cu_seqlens_q, p.seqlens_q, blockIdx.z, p.seqlen_q);
  b.kr = seq_rows(p.cu_seqlens_kv, p.seqlens_kv, blockIdx.z, p.seqlen_kv);
  b.m0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * BM;
  if (b.m0 >= b.qr.cap) return false;
  b.q_valid = b.qr.len - b.m0;  // may be <= 0: the block only writes zeros
  // Keys this block can see: all valid ones, or (causal) those <= its last row.
  const int64_t n_end = b.q_valid <= 0 ? 0 : (p.causal ? min(b.kr.len, b.m0 + BM) : b.kr.len);
  b.n_blocks = static_cast<int>((n_end + BN - 1) / BN);
  const int elem_bytes = fp8 ? 1 : 2;
  b.q_rows = row_ptr(a.q, b.qr, b.m0, b.h, elem_bytes);
  b.k_rows = row_ptr(a.k, b.kr, 0, b.hk, elem_bytes);
  b.v_rows = row_ptr(a.v, b.kr, 0, b.hk, elem_bytes);
  const float qk_descale = fp8 ? load_descale(p.q_descale) * load_descale(p.k_descale) : 1.0f;
  b.scale_log2 = p.softmax_scale * qk_descale * kLog2e;
  return true;
}

// Running softmax state of this thread's two rows (row0, row0 + 8).
struct SoftmaxRows {
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.0f, 0.0f};  // this thread's partial sums, reduced in the epilogue
};

// Scales the BN-key score tile s (keys n0..) into log2 units, masks keys past
// kv_len and (causal) past each row, folds it into the running max and sum,
// rescales the output accumulator o and leaves 2^(s - max) in s.
template <int BN, int D>
__device__ __forceinline__ void online_softmax(float (&s)[BN / 8][4], float (&o)[D / 8][4],
                                               SoftmaxRows& st, float scale_log2, bool causal,
                                               int64_t n0, int64_t kv_len, int64_t row0) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  // Warp-uniform: only tiles reaching past the sequence or past the warp's first row need masks.
  const bool need_mask = n0 + BN > kv_len || (causal && n0 + BN - 1 > row0 - g);
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[i][e] * scale_log2;
      if (need_mask) {
        const int64_t col = n0 + i * 8 + t * 2 + (e & 1);
        const int64_t row = row0 + (e >> 1) * 8;
        if (col >= kv_len || (causal && col > row)) x = -INFINITY;
      }
      s[i][e] = x;
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
    }
  }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    const float new_max = fmaxf(st.max[r], tile_max[r]);
    // A row that has seen only masked keys keeps max -inf: subtract 0 instead.
    base[r] = new_max == -INFINITY ? 0.0f : new_max;
    const float alpha = exp2f(st.max[r] - base[r]);
    st.max[r] = new_max;
    st.sum[r] *= alpha;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][2 * r] *= alpha;
      o[i][2 * r + 1] *= alpha;
    }
  }
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[i][e] = exp2f(s[i][e] - base[e >> 1]);
      st.sum[e >> 1] += s[i][e];
    }
  }
}

// Dropout acts on the weights that multiply V, not on the normalizer: zeroes
// the dropped entries of the probability tile (keys n0..).
template <int BN>
__device__ __forceinline__ void drop_probabilities(float (&s)[BN / 8][4], const Dropout& drop,
                                                   int64_t head, int64_t row0, int64_t n0, int t) {
  if (!drop.on) return;
  const uint64_t keep = dropout_keep_mask<BN / 8, false>(drop, blockIdx.z, head, row0, n0 + t * 2);
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (!((keep >> (4 * i + e)) & 1u)) s[i][e] = 0.0f;
    }
  }
}

// Normalizes the warp's 16 output rows (times v_scale), writes their
// logsumexp, and stores them as out_dtype. 16-bit outputs are staged in
// `stage` (16 rows of D + kRowPad elements that only this warp touches; all
// cp.async traffic into it must be complete) and stored in 16-byte chunks;
// float32 outputs go straight from registers.
template <int D, class E>
__device__ __forceinline__ void fwd_epilogue(const FwdArgs& a, const FwdBlock& b,
                                             float (&o)[D / 8][4], const SoftmaxRows& st,
                                             float v_scale, int64_t row0, uint16_t* stage) {
  constexpr int LD = D + kRowPad;
  const tf_attn_cuda_problem& p = a.p;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float out_scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = st.sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int64_t row = row0 + r * 8;
    const bool live = row < b.qr.len && sum > 0.0f;
    out_scale[r] = live ? v_scale / sum : 0.0f;
    if (t == 0 && row < b.qr.cap) {
      a.lse[lse_index(b.qr, p.heads_q, b.h, p.seqlen_q, row)] =
          live ? (st.max[r] + log2f(sum)) * kLn2 : -INFINITY;
    }
  }
  if (p.out_dtype == TF_FLOAT32) {  // (FP8 only)
    const int64_t out_row = b.qr.batch * a.out.stride_batch + b.h * a.out.stride_head;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row0 + r * 8;
      if (row >= b.qr.cap) continue;
#pragma unroll
      for (int i = 0; i < D / 8; ++i)
        store_pair(a.out.data, out_row + (b.qr.begin + row) * a.out.stride_token + i * 8 + t * 2,
                   TF_FLOAT32, o[i][2 * r] * out_scale[r], o[i][2 * r + 1] * out_scale[r]);
    }
    return;
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    *reinterpret_cast<uint32_t*>(stage + g * LD + i * 8 + t * 2) =
        E::pack(o[i][0] * out_scale[0], o[i][1] * out_scale[0]);
    *reinterpret_cast<uint32_t*>(stage + (g + 8) * LD + i * 8 + t * 2) =
        E::pack(o[i][2] * out_scale[1], o[i][3] * out_scale[1]);
  }
  __syncwarp();
  const int64_t first = row0 - g;  // the warp's first row
  char* obase = static_cast<char*>(a.out.data) +
                (b.qr.batch * a.out.stride_batch + (b.qr.begin + first) * a.out.stride_token +
                 b.h * a.out.stride_head) * 2;
  for (int c = lane; c < 16 * (D / 8); c += 32) {
    const int r = c / (D / 8), k = (c % (D / 8)) * 8;
    if (first + r < b.qr.cap) {
      *reinterpret_cast<uint4*>(obase + (r * a.out.stride_token + k) * 2) =
          *reinterpret_cast<const uint4*>(stage + r * LD + k);
    }
  }
}

}  // namespace tf_attn

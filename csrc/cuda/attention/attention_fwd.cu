// Fused attention forward: one CTA per (query block, query head, sequence).
//
// Each warp owns 16 query rows and keeps their Q fragments and fp32 output
// accumulator in registers. K and V tiles stream through shared memory with
// cp.async: V_j is fetched while S = Q K_j^T and the online softmax run, and
// K_{j+1} while O += P V_j. P never leaves registers: the S accumulator
// fragments are exactly the A fragments of the P V MMA.
#include <cuda_runtime.h>

#include "attention_checks.h"
#include "attention_device.cuh"
#include "attention_traits.cuh"

namespace tf_attn {
namespace {

struct FwdArgs {
  tf_attn_cuda_problem p;
  tf_attn_cuda_tensor q, k, v;
  tf_attn_cuda_out_tensor out;
  float* lse;
};

template <int D>
struct Fwd : TileShape<D, FwdConfig<D>::kBlockM, FwdConfig<D>::kBlockN> {
  using Base = TileShape<D, FwdConfig<D>::kBlockM, FwdConfig<D>::kBlockN>;
  static constexpr int kWarps = Base::kBlockM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSmemElems = (Base::kBlockM + 2 * Base::kBlockN) * Base::kLd;
  static constexpr int kSmemBytes = kSmemElems * 2;
};

template <int D, class E, bool kFp8>
__global__ void __launch_bounds__(Fwd<D>::kThreads)
    attention_fwd_kernel(const __grid_constant__ FwdArgs a) {
  using C = Fwd<D>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, LD = C::kLd, NT = C::kThreads;
  constexpr int kInBytes = kFp8 ? 1 : 2;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* sQ = smem;
  uint16_t* sK = sQ + BM * LD;
  uint16_t* sV = sK + BN * LD;

  const tf_attn_cuda_problem& p = a.p;
  const int64_t h = blockIdx.y, hk = h / (p.heads_q / p.heads_kv);
  const SeqRows qr = seq_rows(p.cu_seqlens_q, p.seqlens_q, blockIdx.z, p.seqlen_q);
  const SeqRows kr = seq_rows(p.cu_seqlens_kv, p.seqlens_kv, blockIdx.z, p.seqlen_kv);
  // Last query blocks first: under a causal mask they carry the most keys,
  // so the short ones fill the tail of the grid.
  const int64_t m0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * BM;
  if (m0 >= qr.cap) return;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const char* qbase = static_cast<const char*>(a.q.data) +
                      (qr.batch * a.q.stride_batch + (qr.begin + m0) * a.q.stride_token +
                       h * a.q.stride_head) * kInBytes;
  const char* kbase = static_cast<const char*>(a.k.data) +
                      (kr.batch * a.k.stride_batch + kr.begin * a.k.stride_token +
                       hk * a.k.stride_head) * kInBytes;
  const char* vbase = static_cast<const char*>(a.v.data) +
                      (kr.batch * a.v.stride_batch + kr.begin * a.v.stride_token +
                       hk * a.v.stride_head) * kInBytes;

  // Keys this block can see: all valid ones, or (causal) those <= its last row.
  const int64_t q_valid = qr.len - m0;  // may be <= 0: the block only writes zeros
  const int64_t n_end = q_valid <= 0 ? 0 : (p.causal ? min(kr.len, m0 + BM) : kr.len);
  const int n_blocks = static_cast<int>((n_end + BN - 1) / BN);

  const float qk_descale = kFp8 ? load_descale(p.q_descale) * load_descale(p.k_descale) : 1.0f;
  const float scale_log2 = p.softmax_scale * qk_descale * kLog2e;
  const Dropout drop = make_dropout(p);

  load_tile<E, kFp8, BM, D, LD, NT>(sQ, qbase, a.q.stride_token, q_valid);
  if (n_blocks > 0) load_tile<E, kFp8, BN, D, LD, NT>(sK, kbase, a.k.stride_token, kr.len);
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this thread's partial sums, reduced at the end
  uint32_t qf[D / 16][4];
  const int64_t row0 = m0 + warp * 16 + g;  // this thread's rows: row0, row0 + 8

  for (int j = 0; j < n_blocks; ++j) {
    const int64_t n0 = static_cast<int64_t>(j) * BN;
    cp_async_wait_all();
    __syncthreads();  // K_j (and Q) landed; every warp is done reading V_{j-1}
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                kk * 16 + (lane >> 4) * 8);
    }
    load_tile<E, kFp8, BN, D, LD, NT>(sV, vbase + n0 * a.v.stride_token * kInBytes,
                                      a.v.stride_token, kr.len - n0);
    cp_async_commit();

    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) {
        uint32_t b[4];
        ldmatrix_x4(b, sK + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 +
                           ((lane >> 3) & 1) * 8);
        E::mma(s[2 * nn], qf[kk], b[0], b[1]);
        E::mma(s[2 * nn + 1], qf[kk], b[2], b[3]);
      }
    }

    // Scale into log2 units, mask, and update the running max and sum.
    const bool need_mask = n0 + BN > kr.len || (p.causal && n0 + BN - 1 > m0);
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[i][e] * scale_log2;
        if (need_mask) {
          const int64_t col = n0 + i * 8 + t * 2 + (e & 1);
          const int64_t row = row0 + (e >> 1) * 8;
          if (col >= kr.len || (p.causal && col > row)) x = -INFINITY;
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
      const float new_max = fmaxf(row_max[r], tile_max[r]);
      // A row that has seen only masked keys keeps max -inf: subtract 0 instead.
      base[r] = new_max == -INFINITY ? 0.0f : new_max;
      const float alpha = exp2f(row_max[r] - base[r]);
      row_max[r] = new_max;
      row_sum[r] *= alpha;
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
        row_sum[e >> 1] += s[i][e];
      }
    }
    // Dropout acts on the weights that multiply V, not on the normalizer.
    if (drop.on) {
      const uint64_t keep =
          dropout_keep_mask<BN / 8, false>(drop, blockIdx.z, h, row0, n0 + t * 2);
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (!((keep >> (4 * i + e)) & 1u)) s[i][e] = 0.0f;
        }
      }
    }

    cp_async_wait_all();
    __syncthreads();  // V_j landed; every warp is done reading K_j
    if (j + 1 < n_blocks)
      load_tile<E, kFp8, BN, D, LD, NT>(sK, kbase + (n0 + BN) * a.k.stride_token * kInBytes,
                                        a.k.stride_token, kr.len - n0 - BN);
    cp_async_commit();

#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t pf[4] = {E::pack(s[2 * kk][0], s[2 * kk][1]),
                              E::pack(s[2 * kk][2], s[2 * kk][3]),
                              E::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              E::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                 dd * 16 + (lane >> 4) * 8);
        E::mma(o[2 * dd], pf, b[0], b[1]);
        E::mma(o[2 * dd + 1], pf, b[2], b[3]);
      }
    }
  }

  // Epilogue: normalize, stage the warp's 16 rows in its own rows of sQ (no
  // other warp reads them), then store 16-byte chunks.
  cp_async_wait_all();
  __syncthreads();  // no Q copy of another thread may land on the staging rows
  const float v_scale = (kFp8 ? load_descale(p.v_descale) : 1.0f) * (drop.on ? drop.inv_keep : 1.0f);
  float out_scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int64_t row = row0 + r * 8;
    const bool live = row < qr.len && sum > 0.0f;
    out_scale[r] = live ? v_scale / sum : 0.0f;
    if (t == 0 && row < qr.cap) {
      a.lse[lse_index(qr, p.heads_q, h, p.seqlen_q, row)] =
          live ? (row_max[r] + log2f(sum)) * kLn2 : -INFINITY;
    }
  }
  if (p.out_dtype == TF_FLOAT32) {  // (FP8 only) straight from registers
    const int64_t out_row = qr.batch * a.out.stride_batch + h * a.out.stride_head;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = row0 + r * 8;
      if (row >= qr.cap) continue;
#pragma unroll
      for (int i = 0; i < D / 8; ++i)
        store_pair(a.out.data, out_row + (qr.begin + row) * a.out.stride_token + i * 8 + t * 2,
                   TF_FLOAT32, o[i][2 * r] * out_scale[r], o[i][2 * r + 1] * out_scale[r]);
    }
    return;
  }
  __syncwarp();
  uint16_t* stage = sQ + warp * 16 * LD;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    *reinterpret_cast<uint32_t*>(stage + g * LD + i * 8 + t * 2) =
        E::pack(o[i][0] * out_scale[0], o[i][1] * out_scale[0]);
    *reinterpret_cast<uint32_t*>(stage + (g + 8) * LD + i * 8 + t * 2) =
        E::pack(o[i][2] * out_scale[1], o[i][3] * out_scale[1]);
  }
  __syncwarp();
  char* obase = static_cast<char*>(a.out.data) +
                (qr.batch * a.out.stride_batch + (qr.begin + m0 + warp * 16) * a.out.stride_token +
                 h * a.out.stride_head) * 2;
  for (int c = lane; c < 16 * (D / 8); c += 32) {
    const int r = c / (D / 8), k = (c % (D / 8)) * 8;
    if (m0 + warp * 16 + r < qr.cap) {
      *reinterpret_cast<uint4*>(obase + (r * a.out.stride_token + k) * 2) =
          *reinterpret_cast<const uint4*>(stage + r * LD + k);
    }
  }
}

template <int D, class E, bool kFp8>
tf_status launch_fwd(const FwdArgs& a, cudaStream_t stream) {
  using C = Fwd<D>;
  auto kernel = attention_fwd_kernel<D, E, kFp8>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes) !=
      cudaSuccess)
    return TF_ERR_CUDA;
  const dim3 grid(static_cast<unsigned>((a.p.seqlen_q + C::kBlockM - 1) / C::kBlockM),
                  static_cast<unsigned>(a.p.heads_q), static_cast<unsigned>(a.p.num_seqs));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(a);
  return cudaGetLastError() == cudaSuccess ? TF_OK : TF_ERR_CUDA;
}

template <int D>
tf_status dispatch_fwd(const FwdArgs& a, cudaStream_t stream) {
  if (a.p.dtype == TF_BFLOAT16)
    return a.p.fp8_inputs ? launch_fwd<D, Bf16, true>(a, stream)
                          : launch_fwd<D, Bf16, false>(a, stream);
  return a.p.fp8_inputs ? launch_fwd<D, Fp16, true>(a, stream)
                        : launch_fwd<D, Fp16, false>(a, stream);
}

}  // namespace
}  // namespace tf_attn

extern "C" int tf_attention_cuda_head_dim_supported(int64_t d) {
  return d == 32 || d == 64 || d == 96 || d == 128;
}

extern "C" tf_status tf_attention_fwd_cuda(const tf_attn_cuda_problem* p, tf_attn_cuda_tensor q,
                                           tf_attn_cuda_tensor k, tf_attn_cuda_tensor v,
                                           tf_attn_cuda_out_tensor out, float* lse,
                                           void* stream) {
  using namespace tf_attn;
  tf_status st = check_problem(p);
  if (st != TF_OK) return st;
  st = check_qkv(p, q, k, v);
  if (st == TF_OK)
    st = check_out(out, p->batch, p->seqlen_q, p->heads_q, p->head_dim, tf_dtype_size(p->out_dtype));
  if (st != TF_OK) return st;
  if (p->num_seqs == 0 || p->seqlen_q == 0) return TF_OK;
  if (lse == nullptr) return TF_ERR_NULL_POINTER;
  const FwdArgs a{*p, q, k, v, out, lse};
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (p->head_dim) {
    case 32: return dispatch_fwd<32>(a, s);
    case 64: return dispatch_fwd<64>(a, s);
    case 96: return dispatch_fwd<96>(a, s);
    default: return dispatch_fwd<128>(a, s);
  }
}

// Fused attention forward with 16-bit tensor-core MMAs (bf16 / fp16 inputs,
// and FP8 inputs decoded to 16 bits where the FP8 MMA is not available): one
// CTA per (query block, query head, sequence).
//
// Each warp owns 16 query rows and keeps their Q fragments and fp32 output
// accumulator in registers. K and V tiles stream through shared memory with
// cp.async: V_j is fetched while S = Q K_j^T and the online softmax run, and
// K_{j+1} while O += P V_j. P never leaves registers: the S accumulator
// fragments are exactly the A fragments of the P V MMA.
#include <cuda_runtime.h>

#include "attention_checks.h"
#include "attention_fwd_fp8.h"
#include "attention_fwd_tile.cuh"
#include "attention_traits.cuh"

namespace tf_attn {
namespace {

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
  FwdBlock b;
  if (!fwd_block<BM, BN>(a, kFp8, b)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Dropout drop = make_dropout(p);

  load_tile<E, kFp8, BM, D, LD, NT>(sQ, b.q_rows, a.q.stride_token, b.q_valid);
  if (b.n_blocks > 0) load_tile<E, kFp8, BN, D, LD, NT>(sK, b.k_rows, a.k.stride_token, b.kr.len);
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  SoftmaxRows st;
  uint32_t qf[D / 16][4];
  const int64_t row0 = b.m0 + warp * 16 + lane / 4;  // this thread's rows: row0, row0 + 8

  for (int j = 0; j < b.n_blocks; ++j) {
    const int64_t n0 = static_cast<int64_t>(j) * BN;
    cp_async_wait_all();
    __syncthreads();  // K_j (and Q) landed; every warp is done reading V_{j-1}
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        ldmatrix_x4(qf[kk], sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                kk * 16 + (lane >> 4) * 8);
    }
    load_tile<E, kFp8, BN, D, LD, NT>(sV, b.v_rows + n0 * a.v.stride_token * kInBytes,
                                      a.v.stride_token, b.kr.len - n0);
    cp_async_commit();

    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) {
        uint32_t kb[4];
        ldmatrix_x4(kb, sK + (nn * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 +
                            ((lane >> 3) & 1) * 8);
        E::mma(s[2 * nn], qf[kk], kb[0], kb[1]);
        E::mma(s[2 * nn + 1], qf[kk], kb[2], kb[3]);
      }
    }
    online_softmax<BN, D>(s, o, st, b.scale_log2, p.causal, n0, b.kr.len, row0);
    drop_probabilities<BN>(s, drop, b.h, row0, n0, lane % 4);

    cp_async_wait_all();
    __syncthreads();  // V_j landed; every warp is done reading K_j
    if (j + 1 < b.n_blocks)
      load_tile<E, kFp8, BN, D, LD, NT>(sK, b.k_rows + (n0 + BN) * a.k.stride_token * kInBytes,
                                        a.k.stride_token, b.kr.len - n0 - BN);
    cp_async_commit();

#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t pf[4] = {E::pack(s[2 * kk][0], s[2 * kk][1]),
                              E::pack(s[2 * kk][2], s[2 * kk][3]),
                              E::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              E::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, sV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD +
                                  dd * 16 + (lane >> 4) * 8);
        E::mma(o[2 * dd], pf, vb[0], vb[1]);
        E::mma(o[2 * dd + 1], pf, vb[2], vb[3]);
      }
    }
  }

  // The epilogue stages each warp's rows in its own rows of sQ.
  cp_async_wait_all();
  __syncthreads();  // no Q copy of another thread may land on the staging rows
  const float v_scale = (kFp8 ? load_descale(p.v_descale) : 1.0f) * (drop.on ? drop.inv_keep : 1.0f);
  fwd_epilogue<D, E>(a, b, o, st, v_scale, row0, sQ + warp * 16 * LD);
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

template <int D, class E>
tf_status dispatch_fwd(const FwdArgs& a, cudaStream_t stream) {
  return a.p.fp8_inputs ? launch_fwd<D, E, true>(a, stream) : launch_fwd<D, E, false>(a, stream);
}

template <int D>
tf_status dispatch_fwd(const FwdArgs& a, cudaStream_t stream) {
  return a.p.dtype == TF_BFLOAT16 ? dispatch_fwd<D, Bf16>(a, stream)
                                  : dispatch_fwd<D, Fp16>(a, stream);
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
  if (p->fp8_inputs) {  // FP8 tensor cores where the device has them
    int launched = 0;
    st = launch_fwd_fp8(a, s, &launched);
    if (st != TF_OK || launched) return st;
  }
  switch (p->head_dim) {
    case 32: return dispatch_fwd<32>(a, s);
    case 64: return dispatch_fwd<64>(a, s);
    case 96: return dispatch_fwd<96>(a, s);
    default: return dispatch_fwd<128>(a, s);
  }
}

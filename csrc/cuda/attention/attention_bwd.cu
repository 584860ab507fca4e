// Fused attention backward: one CTA per (key block, KV head, sequence).
//
// The CTA keeps its K and V tiles in shared memory and their dK / dV in fp32
// registers (each warp owns 16 keys), and streams blocks of queries -- of
// every query head of the GQA group, so dK / dV are summed over the group
// without atomics. Per query block it computes, transposed so that keys are
// the MMA rows:
//   S^T = K Q^T, P^T = exp(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta),
//   dV += P^T dO, dK += dS^T Q  (P^T and dS^T feed the MMA from registers),
// then stages dS in shared memory and adds dQ = dS K into a float32 buffer
// with atomics; a last kernel scales that buffer into dq.
// Q / dO (and their lse / delta) are double-buffered with cp.async.
#include "attention_bwd_kernels.h"
#include "attention_checks.h"
#include "attention_device.cuh"
#include "attention_traits.cuh"

namespace tf_attn {
namespace {

struct BwdArgs {
  tf_attn_cuda_problem p;
  tf_attn_cuda_tensor dout, q, k, v;
  const float *lse, *delta;
  tf_attn_cuda_out_tensor dk, dv;
  float* dq_accum;
};

template <int D>
struct Bwd : TileShape<D, BwdConfig<D>::kBlockM, BwdConfig<D>::kBlockN> {
  using Base = TileShape<D, BwdConfig<D>::kBlockM, BwdConfig<D>::kBlockN>;
  static constexpr int BM = Base::kBlockM, BN = Base::kBlockN, LD = Base::kLd;
  static constexpr int kWarps = BN / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLdS = BM + kRowPad;  // dS^T tile [key][query]
  // dQ = dS K: warps tile the BM x D result as row blocks x column slices.
  static constexpr int kRowBlocks = BM / 16;
  static constexpr int kColSplit = kWarps / kRowBlocks;
  static constexpr int kColsPerWarp = D / kColSplit;
  static constexpr int kDqChunk = kColsPerWarp < 32 ? kColsPerWarp : 32;
  static_assert(kWarps % kRowBlocks == 0 && kColsPerWarp % kDqChunk == 0 && kDqChunk % 16 == 0,
                "dQ tiling");
  static constexpr int kSmemElems = 2 * BN * LD + 4 * BM * LD + BN * kLdS;
  static constexpr int kSmemBytes = kSmemElems * 2 + 4 * BM * static_cast<int>(sizeof(float));
};

template <int D, class E, bool kFp8>
__global__ void __launch_bounds__(Bwd<D>::kThreads)
    attention_bwd_kernel(const __grid_constant__ BwdArgs a) {
  using C = Bwd<D>;
  constexpr int BM = C::BM, BN = C::BN, LD = C::LD, LDS = C::kLdS, NT = C::kThreads;
  constexpr int kInBytes = kFp8 ? 1 : 2;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* sK = smem;
  uint16_t* sV = sK + BN * LD;
  uint16_t* sQ = sV + BN * LD;       // [2][BM * LD]
  uint16_t* sdO = sQ + 2 * BM * LD;  // [2][BM * LD]
  uint16_t* sdS = sdO + 2 * BM * LD;
  float* sLse = reinterpret_cast<float*>(sdS + BN * LDS);  // [2][BM], log2 units
  float* sDelta = sLse + 2 * BM;                            // [2][BM]

  const tf_attn_cuda_problem& p = a.p;
  const int64_t hk = blockIdx.y, group = p.heads_q / p.heads_kv;
  const SeqRows qr = seq_rows(p.cu_seqlens_q, p.seqlens_q, blockIdx.z, p.seqlen_q);
  const SeqRows kr = seq_rows(p.cu_seqlens_kv, p.seqlens_kv, blockIdx.z, p.seqlen_kv);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
  if (n0 >= kr.cap) return;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  // Query blocks that see any of these keys (causal: queries i >= n0).
  const int m_begin = p.causal ? static_cast<int>(n0 / BM) : 0;
  const int m_end = static_cast<int>((qr.len + BM - 1) / BM);
  const int m_count = n0 < kr.len && m_end > m_begin ? m_end - m_begin : 0;
  const int iters = m_count * static_cast<int>(group);

  const float q_descale = kFp8 ? load_descale(p.q_descale) : 1.0f;
  const float k_descale = kFp8 ? load_descale(p.k_descale) : 1.0f;
  const float v_descale = kFp8 ? load_descale(p.v_descale) : 1.0f;
  const float scale_log2 = p.softmax_scale * q_descale * k_descale * kLog2e;
  const Dropout drop = make_dropout(p);

  // Fetches query block `it` (head, block) into buffer `buf`.
  auto prefetch = [&](int it, int buf) {
    const int64_t h = hk * group + it / m_count;
    const int64_t m0 = static_cast<int64_t>(m_begin + it % m_count) * BM;
    const int64_t valid = qr.len - m0;
    const char* q = static_cast<const char*>(a.q.data) +
                    (qr.batch * a.q.stride_batch + (qr.begin + m0) * a.q.stride_token +
                     h * a.q.stride_head) * kInBytes;
    const int64_t dout_off =
        qr.batch * a.dout.stride_batch + (qr.begin + m0) * a.dout.stride_token + h * a.dout.stride_head;
    load_tile<E, kFp8, BM, D, LD, NT>(sQ + buf * BM * LD, q, a.q.stride_token, valid);
    if (kFp8 && p.out_dtype == TF_FLOAT32)
      load_tile_f32<E, BM, D, LD, NT>(sdO + buf * BM * LD,
                                      static_cast<const float*>(a.dout.data) + dout_off,
                                      a.dout.stride_token, valid);
    else
      load_tile<E, false, BM, D, LD, NT>(sdO + buf * BM * LD,
                                         static_cast<const uint16_t*>(a.dout.data) + dout_off,
                                         a.dout.stride_token, valid);
    for (int r = threadIdx.x; r < BM; r += NT) {
      const bool ok = r < valid;
      const int64_t idx = lse_index(qr, p.heads_q, h, p.seqlen_q, ok ? m0 + r : 0);
      // lse is -inf on rows that saw no key; +inf here makes their P zero.
      const float l = ok ? a.lse[idx] : -INFINITY;
      sLse[buf * BM + r] = l == -INFINITY ? INFINITY : l * kLog2e;
      sDelta[buf * BM + r] = ok ? a.delta[idx] : 0.0f;
    }
  };

  if (iters > 0) {
    const char* kb = static_cast<const char*>(a.k.data) +
                     (kr.batch * a.k.stride_batch + (kr.begin + n0) * a.k.stride_token +
                      hk * a.k.stride_head) * kInBytes;
    const char* vb = static_cast<const char*>(a.v.data) +
                     (kr.batch * a.v.stride_batch + (kr.begin + n0) * a.v.stride_token +
                      hk * a.v.stride_head) * kInBytes;
    load_tile<E, kFp8, BN, D, LD, NT>(sK, kb, a.k.stride_token, kr.len - n0);
    load_tile<E, kFp8, BN, D, LD, NT>(sV, vb, a.v.stride_token, kr.len - n0);
    prefetch(0, 0);
  }
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;
  }
  const int64_t key0 = n0 + warp * 16 + g;  // this thread's keys: key0, key0 + 8
  const uint16_t* sKw = sK + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
  const uint16_t* sVw = sV + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;

  for (int it = 0; it < iters; ++it) {
    const int buf = it & 1;
    const int64_t h = hk * group + it / m_count;
    const int64_t m0 = static_cast<int64_t>(m_begin + it % m_count) * BM;
    const uint16_t* q = sQ + buf * BM * LD;
    const uint16_t* dout = sdO + buf * BM * LD;
    const float* lse = sLse + buf * BM;
    const float* delta = sDelta + buf * BM;
    cp_async_wait_all();
    __syncthreads();  // block `it` landed; every warp is done with block it-1
    if (it + 1 < iters) prefetch(it + 1, buf ^ 1);
    cp_async_commit();

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys.
    float s[BM / 8][4], dp[BM / 8][4];
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      ldmatrix_x4(ka, sKw + kk * 16);
      ldmatrix_x4(va, sVw + kk * 16);
#pragma unroll
      for (int nn = 0; nn < BM / 16; ++nn) {
        const int off = (nn * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t b[4];
        ldmatrix_x4(b, q + off);
        E::mma(s[2 * nn], ka, b[0], b[1]);
        E::mma(s[2 * nn + 1], ka, b[2], b[3]);
        ldmatrix_x4(b, dout + off);
        E::mma(dp[2 * nn], va, b[0], b[1]);
        E::mma(dp[2 * nn + 1], va, b[2], b[3]);
      }
    }

    // P^T and dS^T in place of S^T and dP^T. Query rows past the valid
    // length carry lse = +inf, so only keys need an explicit mask.
    const bool need_mask = n0 + BN > kr.len || (p.causal && n0 + BN - 1 > m0);
    const uint64_t keep =
        drop.on ? dropout_keep_mask<BM / 8, true>(drop, blockIdx.z, h, key0, m0 + t * 2) : 0;
#pragma unroll
    for (int i = 0; i < BM / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = i * 8 + t * 2 + (e & 1);
        float pr = exp2f(s[i][e] * scale_log2 - lse[col]);
        if (need_mask) {
          const int64_t key = key0 + (e >> 1) * 8;
          if (key >= kr.len || (p.causal && key > m0 + col)) pr = 0.0f;
        }
        // With dropout, dV takes the dropped weights and dP the dropped gradient.
        float z = 1.0f;
        if (drop.on) z = (keep >> (4 * i + e)) & 1u ? drop.inv_keep : 0.0f;
        s[i][e] = pr * z;
        dp[i][e] = pr * (dp[i][e] * v_descale * z - delta[col]);
      }
    }

    // dV += P^T dO and dK += dS^T Q, both A operands straight from registers.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      const uint32_t pa[4] = {E::pack(s[2 * kk][0], s[2 * kk][1]), E::pack(s[2 * kk][2], s[2 * kk][3]),
                              E::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              E::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const uint32_t da[4] = {E::pack(dp[2 * kk][0], dp[2 * kk][1]), E::pack(dp[2 * kk][2], dp[2 * kk][3]),
                              E::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                              E::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
      for (int dd = 0; dd < D / 16; ++dd) {
        const int off = (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dd * 16 + (lane >> 4) * 8;
        uint32_t b[4];
        ldmatrix_x4_trans(b, dout + off);
        E::mma(dv[2 * dd], pa, b[0], b[1]);
        E::mma(dv[2 * dd + 1], pa, b[2], b[3]);
        ldmatrix_x4_trans(b, q + off);
        E::mma(dk[2 * dd], da, b[0], b[1]);
        E::mma(dk[2 * dd + 1], da, b[2], b[3]);
      }
      // Stage dS^T [key][query] for the dQ product.
      uint16_t* st = sdS + (warp * 16 + g) * LDS + kk * 16 + t * 2;
      *reinterpret_cast<uint32_t*>(st) = da[0];
      *reinterpret_cast<uint32_t*>(st + 8 * LDS) = da[1];
      *reinterpret_cast<uint32_t*>(st + 8) = da[2];
      *reinterpret_cast<uint32_t*>(st + 8 * LDS + 8) = da[3];
    }
    __syncthreads();  // dS complete

    // dQ[m0 + rows, cols] += dS K over this CTA's keys.
    const int mrow = (warp % C::kRowBlocks) * 16;
    const int col_base = (warp / C::kRowBlocks) * C::kColsPerWarp;
    const int64_t qrow0 = m0 + mrow + g;
    float* dq_row = a.dq_accum + ((qr.batch * p.seqlen_q + qr.begin + qrow0) * p.heads_q + h) * D;
    const int64_t dq_row8 = 8 * p.heads_q * D;  // 8 rows further
#pragma unroll
    for (int c0 = col_base; c0 < col_base + C::kColsPerWarp; c0 += C::kDqChunk) {
      float acc[C::kDqChunk / 8][4];
#pragma unroll
      for (int i = 0; i < C::kDqChunk / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t dsa[4];
        ldmatrix_x4_trans(dsa, sdS + (kk * 16 + (lane & 7) + (lane >> 4) * 8) * LDS + mrow +
                                   ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int dd = 0; dd < C::kDqChunk / 16; ++dd) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sK + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + c0 +
                                   dd * 16 + (lane >> 4) * 8);
          E::mma(acc[2 * dd], dsa, b[0], b[1]);
          E::mma(acc[2 * dd + 1], dsa, b[2], b[3]);
        }
      }
#pragma unroll
      for (int i = 0; i < C::kDqChunk / 8; ++i) {
        const int col = c0 + i * 8 + t * 2;
        if (qrow0 < qr.len) {
          atomicAdd(dq_row + col, acc[i][0]);
          atomicAdd(dq_row + col + 1, acc[i][1]);
        }
        if (qrow0 + 8 < qr.len) {
          atomicAdd(dq_row + dq_row8 + col, acc[i][2]);
          atomicAdd(dq_row + dq_row8 + col + 1, acc[i][3]);
        }
      }
    }
  }

  // dK = scale * dS^T Q, dV = P^T dO; keys past the valid length hold zeros.
  const float dk_scale = p.softmax_scale * q_descale;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = key0 + r * 8;
    if (key >= kr.cap) continue;
    const int64_t dk_row = kr.batch * a.dk.stride_batch + (kr.begin + key) * a.dk.stride_token +
                           hk * a.dk.stride_head;
    const int64_t dv_row = kr.batch * a.dv.stride_batch + (kr.begin + key) * a.dv.stride_token +
                           hk * a.dv.stride_head;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      const int col = i * 8 + t * 2;
      store_pair(a.dk.data, dk_row + col, p.out_dtype, dk[i][2 * r] * dk_scale,
                 dk[i][2 * r + 1] * dk_scale);
      store_pair(a.dv.data, dv_row + col, p.out_dtype, dv[i][2 * r], dv[i][2 * r + 1]);
    }
  }
}

// dq = dq_accum * scale * k_descale for every token and head of batch
// blockIdx.y: 8 elements per thread.
__global__ void __launch_bounds__(256)
    attention_bwd_dq_kernel(const float* __restrict__ acc, tf_attn_cuda_out_tensor dq,
                            tf_dtype dtype, int64_t tokens, int64_t heads, int64_t d, float scale,
                            const float* k_descale) {
  const int64_t chunks = d / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= tokens * heads * chunks) return;
  const int64_t b = blockIdx.y, c = idx % chunks, h = (idx / chunks) % heads,
                token = idx / (chunks * heads);
  const float sc = scale * load_descale(k_descale);
  const float4* src =
      reinterpret_cast<const float4*>(acc + ((b * tokens + token) * heads + h) * d + c * 8);
  const float4 x = src[0], y = src[1];
  const int64_t dst = b * dq.stride_batch + token * dq.stride_token + h * dq.stride_head + c * 8;
  store_pair(dq.data, dst, dtype, x.x * sc, x.y * sc);
  store_pair(dq.data, dst + 2, dtype, x.z * sc, x.w * sc);
  store_pair(dq.data, dst + 4, dtype, y.x * sc, y.y * sc);
  store_pair(dq.data, dst + 6, dtype, y.z * sc, y.w * sc);
}

template <int D, class E, bool kFp8>
tf_status launch_bwd(const BwdArgs& a, cudaStream_t stream) {
  using C = Bwd<D>;
  auto kernel = attention_bwd_kernel<D, E, kFp8>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes) !=
      cudaSuccess)
    return TF_ERR_CUDA;
  const dim3 grid(static_cast<unsigned>((a.p.seqlen_kv + C::BN - 1) / C::BN),
                  static_cast<unsigned>(a.p.heads_kv), static_cast<unsigned>(a.p.num_seqs));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(a);
  return cudaGetLastError() == cudaSuccess ? TF_OK : TF_ERR_CUDA;
}

template <int D, class E>
tf_status dispatch_bwd_fp8(const BwdArgs& a, cudaStream_t stream) {
  return a.p.fp8_inputs ? launch_bwd<D, E, true>(a, stream) : launch_bwd<D, E, false>(a, stream);
}

template <class E>
tf_status dispatch_bwd(const BwdArgs& a, cudaStream_t stream) {
  switch (a.p.head_dim) {
    case 32: return dispatch_bwd_fp8<32, E>(a, stream);
    case 64: return dispatch_bwd_fp8<64, E>(a, stream);
    case 96: return dispatch_bwd_fp8<96, E>(a, stream);
    default: return dispatch_bwd_fp8<128, E>(a, stream);
  }
}

tf_status launch_dq(const tf_attn_cuda_problem& p, const float* acc, tf_attn_cuda_out_tensor dq,
                    cudaStream_t stream) {
  const int64_t per_batch = p.seqlen_q * p.heads_q * (p.head_dim / 8);
  if (per_batch == 0) return TF_OK;
  if ((per_batch + 255) / 256 > INT32_MAX) return TF_ERR_BAD_SIZE;
  const dim3 grid(static_cast<unsigned>((per_batch + 255) / 256), static_cast<unsigned>(p.batch));
  const float* k_descale = p.fp8_inputs ? p.k_descale : nullptr;
  attention_bwd_dq_kernel<<<grid, 256, 0, stream>>>(acc, dq, p.out_dtype, p.seqlen_q, p.heads_q,
                                                    p.head_dim, p.softmax_scale, k_descale);
  return cudaGetLastError() == cudaSuccess ? TF_OK : TF_ERR_CUDA;
}

}  // namespace
}  // namespace tf_attn

extern "C" tf_status tf_attention_bwd_cuda(const tf_attn_cuda_problem* p, tf_attn_cuda_tensor dout,
                                           tf_attn_cuda_tensor q, tf_attn_cuda_tensor k,
                                           tf_attn_cuda_tensor v, tf_attn_cuda_tensor out,
                                           const float* lse, tf_attn_cuda_out_tensor dq,
                                           tf_attn_cuda_out_tensor dk, tf_attn_cuda_out_tensor dv,
                                           float* dq_accum, float* delta, void* stream) {
  using namespace tf_attn;
  tf_status st = check_problem(p);
  if (st != TF_OK) return st;
  const int64_t b = p->batch, sq = p->seqlen_q, skv = p->seqlen_kv, d = p->head_dim;
  st = check_qkv(p, q, k, v);
  const int64_t ob = tf_dtype_size(p->out_dtype);
  if (st == TF_OK) st = check_in(dout, b, sq, p->heads_q, d, ob);
  if (st == TF_OK) st = check_in(out, b, sq, p->heads_q, d, ob);
  if (st == TF_OK) st = check_out(dq, b, sq, p->heads_q, d, ob);
  if (st == TF_OK) st = check_out(dk, b, skv, p->heads_kv, d, ob);
  if (st == TF_OK) st = check_out(dv, b, skv, p->heads_kv, d, ob);
  if (st != TF_OK) return st;
  if (p->num_seqs == 0 || (sq == 0 && skv == 0)) return TF_OK;
  if (lse == nullptr || dq_accum == nullptr || delta == nullptr) return TF_ERR_NULL_POINTER;
  if (reinterpret_cast<uintptr_t>(dq_accum) % 16 != 0) return TF_ERR_BAD_ARGUMENT;
  if (!tf_mul_fits(b * sq * p->heads_q, d)) return TF_ERR_OVERFLOW;
  // The kernel counts (query head, query block) steps in int.
  if ((sq / 16 + 1) * (p->heads_q / p->heads_kv) > INT32_MAX) return TF_ERR_BAD_SIZE;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  // dQ accumulates across key blocks; delta is read only at valid rows.
  if (cudaMemsetAsync(dq_accum, 0, static_cast<size_t>(b * sq * p->heads_q * d) * sizeof(float), s) !=
      cudaSuccess)
    return TF_ERR_CUDA;
  if (sq > 0) st = launch_bwd_preprocess(*p, dout, out, delta, s);
  if (st != TF_OK) return st;
  if (skv > 0) {
    const BwdArgs a{*p, dout, q, k, v, lse, delta, dk, dv, dq_accum};
    st = p->dtype == TF_BFLOAT16 ? dispatch_bwd<Bf16>(a, s) : dispatch_bwd<Fp16>(a, s);
    if (st != TF_OK) return st;
  }
  return launch_dq(*p, dq_accum, dq, s);
}

// Fused attention forward on Hopper's FP8 tensor cores (wgmma with e4m3
// operands, sm_90a) for float8_e4m3fn q, k, v: one CTA per (query block,
// query head, sequence), the structure of attention_fwd.cu with 8-bit
// operands. Each warpgroup (4 warps) owns 64 query rows; every warp still
// holds 16 rows in the mma C layout, so the softmax and the epilogue are the
// 16-bit kernel's (attention_fwd_tile.cuh).
//
// - S = Q K^T multiplies the stored e4m3 bytes directly: Q fragments come
//   from shared memory through ldmatrix, K is read by wgmma from shared
//   memory. The products are exact in the fp32 accumulators, so S equals the
//   16-bit path's up to summation order.
// - O += P V: P is quantized to e4m3 after scaling by kPScale (P <= 1, so
//   P * 256 <= 256 < 448 and weights down to 2^-14 stay normal numbers); the
//   epilogue divides by kPScale. The row sum uses the unquantized P.
// - wgmma wants B K-major: for P V the reduction runs over keys, so V is
//   stored transposed (head dim x keys). The keys are also permuted inside
//   each group of 16: register j of the A fragment must hold P at positions
//   4t..4t+3, while the S accumulators give thread t the keys 2t, 2t+1,
//   8+2t, 9+2t. Storing key c at position fp8_key_position(c) makes the S
//   fragments the P fragments as they are.
// - K and V^T are stored in wgmma's canonical no-swizzle layout: core
//   matrices of 8 rows x 16 bytes, 128 contiguous bytes each; the core
//   matrices of a row block follow each other along the reduction dim
//   (leading byte offset 128), row blocks are kLd... bytes apart (stride
//   byte offset).
#include <cuda_runtime.h>

#include "attention_fwd_fp8.h"
#include "attention_traits.cuh"

namespace tf_attn {
namespace {

constexpr float kPScale = 256.0f;

template <int D>
struct FwdFp8 {
  static constexpr int kBlockM = FwdConfig<D>::kBlockM, kBlockN = FwdConfig<D>::kBlockN;
  static constexpr int kThreads = kBlockM / 16 * 32;
  // Q rows in bytes, padded by 16 so the 8 rows of an ldmatrix phase fall
  // into 8 different 16-byte bank groups.
  static constexpr int kLdQ = D + 16;
  // Bytes between 8-row blocks of the core-matrix layouts of K and V^T.
  static constexpr int kBlockStrideK = D / 16 * 128;
  static constexpr int kBlockStrideV = kBlockN / 16 * 128;
  static constexpr int kTileBytes = kBlockM * kLdQ + kBlockN * D + D * kBlockN;
  static constexpr int kStageBytes = kBlockM * (D + kRowPad) * 2;  // the epilogue's 16-bit rows
  static constexpr int kSmemBytes = kTileBytes > kStageBytes ? kTileBytes : kStageBytes;
  static_assert(D % 32 == 0 && kBlockN % 32 == 0, "the FP8 MMA reduces over 32 elements");
  static_assert(kBlockM == 128, "two warpgroups of 64 rows");
};

// Position of key c (of a tile) in the transposed V rows; see the file comment.
__device__ __forceinline__ int fp8_key_position(int c) {
  return (c & ~15) | (((c & 7) >> 1) << 2) | (((c >> 3) & 1) << 1) | (c & 1);
}

// Byte offset of element (row, col) in a core-matrix layout whose 8-row
// blocks are block_stride bytes apart.
__device__ __forceinline__ int core_matrix_offset(int row, int col, int block_stride) {
  return (row >> 3) * block_stride + (col >> 4) * 128 + (row & 7) * 16 + (col & 15);
}

// Copies `Rows` rows of D bytes (global row stride in bytes) into shared
// memory, as padded rows of Ld bytes (Ld > 0) or in the core-matrix layout
// (Ld == 0); rows >= valid are zero-filled. cp.async: the caller commits.
template <int Rows, int D, int Ld, int kThreads>
__device__ __forceinline__ void copy_tile_fp8(uint8_t* dst, const char* src, int64_t row_stride,
                                              int64_t valid) {
  constexpr int kChunks = D / 16;
  for (int c = threadIdx.x; c < Rows * kChunks; c += kThreads) {
    const int r = c / kChunks, k = (c % kChunks) * 16;
    const bool ok = r < valid;
    const int at = Ld > 0 ? r * Ld + k : core_matrix_offset(r, k, D / 16 * 128);
    cp_async_16(dst + at, ok ? src + r * row_stride + k : src, ok);
  }
}

// Writes the V tile (BN keys x D bytes, keys >= valid as zeros) transposed
// and key-permuted into dst (D rows of BN bytes, core-matrix layout).
// Ordinary loads and stores: the transpose happens on the way.
template <int BN, int D, int kThreads>
__device__ __forceinline__ void store_v_transposed(uint8_t* dst, const char* src,
                                                   int64_t row_stride, int64_t valid) {
  constexpr int kChunks = D / 16;
#pragma unroll 1
  for (int c = threadIdx.x; c < BN * kChunks; c += kThreads) {
    const int r = c / kChunks, k = (c % kChunks) * 16;
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (r < valid) raw = *reinterpret_cast<const uint4*>(src + r * row_stride + k);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&raw);
    const int pos = fp8_key_position(r);
#pragma unroll
    for (int i = 0; i < 16; ++i) dst[core_matrix_offset(k + i, pos, BN / 16 * 128)] = bytes[i];
  }
}

// wgmma shared-memory descriptor of a K-major operand in the no-swizzle
// core-matrix layout: start address, leading byte offset (between core
// matrices along the reduction dim, 128 here) and stride byte offset
// (between 8-row blocks), each in 16-byte units.
__device__ __forceinline__ uint64_t smem_desc(const void* start, int block_stride) {
  return static_cast<uint64_t>((smem_addr(start) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(block_stride >> 4) << 32);
}

// Four scaled probabilities as e4m3 bytes, the first in the low byte.
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  return static_cast<uint32_t>(cvt_e4m3x2(a * kPScale, b * kPScale)) |
         (static_cast<uint32_t>(cvt_e4m3x2(c * kPScale, d * kPScale)) << 16);
}

template <int D, class E>
__global__ void __launch_bounds__(FwdFp8<D>::kThreads)
    attention_fwd_fp8_kernel(const __grid_constant__ FwdArgs a) {
  using C = FwdFp8<D>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, LQ = C::kLdQ, NT = C::kThreads;
  extern __shared__ __align__(128) uint8_t smem8[];
  uint8_t* sQ = smem8;
  uint8_t* sK = sQ + BM * LQ;
  uint8_t* sVt = sK + BN * D;

  const tf_attn_cuda_problem& p = a.p;
  FwdBlock b;
  if (!fwd_block<BM, BN>(a, true, b)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const Dropout drop = make_dropout(p);

  copy_tile_fp8<BM, D, LQ, NT>(sQ, b.q_rows, a.q.stride_token, b.q_valid);
  if (b.n_blocks > 0) copy_tile_fp8<BN, D, 0, NT>(sK, b.k_rows, a.k.stride_token, b.kr.len);
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  SoftmaxRows st;
  uint32_t qf[D / 32][4];
  const int64_t row0 = b.m0 + warp * 16 + lane / 4;

  for (int j = 0; j < b.n_blocks; ++j) {
    const int64_t n0 = static_cast<int64_t>(j) * BN;
    store_v_transposed<BN, D, NT>(sVt, b.v_rows + n0 * a.v.stride_token, a.v.stride_token,
                                  b.kr.len - n0);
    cp_async_wait_all();
    fence_proxy_async_shared();  // K_j and V_j^T are read by wgmma (the async proxy)
    __syncthreads();             // K_j, V_j^T (and Q) are complete
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 32; ++kk)
        ldmatrix_x4(qf[kk], sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LQ +
                                kk * 32 + (lane >> 4) * 16);
    }

    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
    fence_operands(s);
    wgmma_fence();  // orders the writes of s and qf before the MMAs read them
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk)
      wgmma_m64k32_e4m3_rs<BN>(s, qf[kk], smem_desc(sK + kk * 256, C::kBlockStrideK));
    wgmma_commit();
    wgmma_wait_all();
    fence_operands(s);
    online_softmax<BN, D>(s, o, st, b.scale_log2, p.causal, n0, b.kr.len, row0);
    drop_probabilities<BN>(s, drop, b.h, row0, n0, lane % 4);

    fence_operands(o);
    uint32_t pf[BN / 32][4];  // P as e4m3 A fragments, keys 32 kk .. for each kk
#pragma unroll
    for (int kk = 0; kk < BN / 32; ++kk) {
      const float(*t)[4] = s + 4 * kk;  // the four n8 tiles of those keys
      pf[kk][0] = pack_e4m3x4(t[0][0], t[0][1], t[1][0], t[1][1]);
      pf[kk][1] = pack_e4m3x4(t[0][2], t[0][3], t[1][2], t[1][3]);
      pf[kk][2] = pack_e4m3x4(t[2][0], t[2][1], t[3][0], t[3][1]);
      pf[kk][3] = pack_e4m3x4(t[2][2], t[2][3], t[3][2], t[3][3]);
    }
    wgmma_fence();  // orders the writes of o and pf before the MMAs read them
#pragma unroll
    for (int kk = 0; kk < BN / 32; ++kk)
      wgmma_m64k32_e4m3_rs<D>(o, pf[kk], smem_desc(sVt + kk * 256, C::kBlockStrideV));
    wgmma_commit();
    wgmma_wait_all();
    fence_operands(o);

    __syncthreads();  // every warpgroup is done reading K_j and V_j^T
    if (j + 1 < b.n_blocks)
      copy_tile_fp8<BN, D, 0, NT>(sK, b.k_rows + (n0 + BN) * a.k.stride_token, a.k.stride_token,
                                  b.kr.len - n0 - BN);
    cp_async_commit();
  }

  cp_async_wait_all();
  __syncthreads();  // every warp is done with the tiles the staging rows overlay
  const float v_scale = load_descale(p.v_descale) * (drop.on ? drop.inv_keep : 1.0f) / kPScale;
  uint16_t* stage = reinterpret_cast<uint16_t*>(smem8) + warp * 16 * (D + kRowPad);
  fwd_epilogue<D, E>(a, b, o, st, v_scale, row0, stage);
}

template <int D, class E>
tf_status launch(const FwdArgs& a, cudaStream_t stream, int* launched) {
  using C = FwdFp8<D>;
  auto kernel = attention_fwd_fp8_kernel<D, E>;
  *launched = 0;
  cudaFuncAttributes attr;
  // binaryVersion is the architecture of the kernel binary this device runs
  // (the sm_80 one on anything but sm_90): wgmma exists in the sm_90a one.
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) return TF_ERR_CUDA;
  if (attr.binaryVersion != 90) return TF_OK;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes) !=
      cudaSuccess)
    return TF_ERR_CUDA;
  const dim3 grid(static_cast<unsigned>((a.p.seqlen_q + C::kBlockM - 1) / C::kBlockM),
                  static_cast<unsigned>(a.p.heads_q), static_cast<unsigned>(a.p.num_seqs));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(a);
  *launched = 1;
  return cudaGetLastError() == cudaSuccess ? TF_OK : TF_ERR_CUDA;
}

template <class E>
tf_status launch_dim(const FwdArgs& a, cudaStream_t stream, int* launched) {
  switch (a.p.head_dim) {
    case 32: return launch<32, E>(a, stream, launched);
    case 64: return launch<64, E>(a, stream, launched);
    case 96: return launch<96, E>(a, stream, launched);
    default: return launch<128, E>(a, stream, launched);
  }
}

}  // namespace

tf_status launch_fwd_fp8(const FwdArgs& a, cudaStream_t stream, int* launched) {
  return a.p.dtype == TF_BFLOAT16 ? launch_dim<Bf16>(a, stream, launched)
                                  : launch_dim<Fp16>(a, stream, launched);
}

}  // namespace tf_attn

extern "C" int tf_attention_cuda_fp8_mma_available(void) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, tf_attn::attention_fwd_fp8_kernel<64, tf_attn::Bf16>) ==
             cudaSuccess &&
         attr.binaryVersion == 90;
}

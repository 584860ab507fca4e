// Device building blocks of the attention kernels: the 16-bit element types
// (packing and their MMA, from attention_ptx.cuh), global ->
// shared tile loads (with the FP8 -> 16-bit conversion), and the per-sequence
// row ranges for padded and packed (cu_seqlens) problems.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "attention_cuda.h"
#include "attention_ptx.cuh"
#include "../../attention/attention_dropout.h"
#include "../../fp8/fp8_format.h"

namespace tf_attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The 16-bit element types; each names its MMA instruction.
struct Bf16 {
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ static void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    mma_bf16_m16n8k16(c, a, b0, b1);
  }
};

struct Fp16 {
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  __device__ static void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    mma_f16_m16n8k16(c, a, b0, b1);
  }
};

// Rows [begin, begin + len) of one sequence inside the token dim, and the
// batch index of the tensors. `cap` rows belong to the sequence (padded
// length, or the packed segment); the first `len` of them are valid.
struct SeqRows {
  int64_t batch, begin, cap, len;
};

__device__ __forceinline__ int64_t clamp64(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// Segment bounds are clamped into the tensor so that bad cu_seqlens or
// seqlens cannot make a kernel read or write out of bounds.
__device__ __forceinline__ SeqRows seq_rows(const int32_t* cu, const int32_t* lens, int64_t s,
                                            int64_t tokens) {
  SeqRows r;
  if (cu != nullptr) {
    r.batch = 0;
    r.begin = clamp64(cu[s], 0, tokens);
    r.cap = clamp64(static_cast<int64_t>(cu[s + 1]) - r.begin, 0, tokens - r.begin);
  } else {
    r.batch = s;
    r.begin = 0;
    r.cap = tokens;
  }
  r.len = lens != nullptr ? clamp64(lens[s], 0, r.cap) : r.cap;
  return r;
}

// Index of row i of sequence s, head h in an lse-shaped float array:
// [B, H, S] when padded, [H, T] when packed (rows.batch is 0 then).
__device__ __forceinline__ int64_t lse_index(const SeqRows& rows, int64_t heads, int64_t h,
                                             int64_t tokens, int64_t i) {
  return (rows.batch * heads + h) * tokens + rows.begin + i;
}

__device__ __forceinline__ float load_descale(const float* p) { return p != nullptr ? *p : 1.0f; }

// Loads `Rows` rows of D elements into shared memory (row stride Ld) from
// global rows at src + r * row_stride (elements of the source type); rows
// >= valid are zero-filled. 16-bit sources go through cp.async (the caller
// commits and waits); FP8 sources are converted on the way and stored with
// ordinary shared stores. All kThreads threads of the CTA take part.
template <class E, bool kFp8, int Rows, int D, int Ld, int kThreads>
__device__ __forceinline__ void load_tile(uint16_t* dst, const void* src, int64_t row_stride,
                                          int64_t valid) {
  if constexpr (!kFp8) {
    constexpr int kChunks = D / 8;  // 16-byte chunks per row
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int c = threadIdx.x; c < Rows * kChunks; c += kThreads) {
      const int r = c / kChunks, k = (c % kChunks) * 8;
      const bool ok = r < valid;
      cp_async_16(dst + r * Ld + k, ok ? s + r * row_stride + k : s, ok);
    }
  } else {
    constexpr int kChunks = D / 16;  // 16 FP8 values per 16-byte chunk
    const uint8_t* s = static_cast<const uint8_t*>(src);
    for (int c = threadIdx.x; c < Rows * kChunks; c += kThreads) {
      const int r = c / kChunks, k = (c % kChunks) * 16;
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (r < valid) raw = *reinterpret_cast<const uint4*>(s + r * row_stride + k);
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        w[i] = E::pack(tf_fp8_e4m3_decode(b[2 * i]), tf_fp8_e4m3_decode(b[2 * i + 1]));
      }
      uint4* d = reinterpret_cast<uint4*>(dst + r * Ld + k);
      d[0] = make_uint4(w[0], w[1], w[2], w[3]);
      d[1] = make_uint4(w[4], w[5], w[6], w[7]);
    }
  }
}

// The same for float32 source rows (dout when FP8 attention produced a
// float32 output): converted on the way, ordinary shared stores.
template <class E, int Rows, int D, int Ld, int kThreads>
__device__ __forceinline__ void load_tile_f32(uint16_t* dst, const float* src, int64_t row_stride,
                                              int64_t valid) {
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < Rows * kChunks; c += kThreads) {
    const int r = c / kChunks, k = (c % kChunks) * 8;
    float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f), y = x;
    if (r < valid) {
      const float4* s = reinterpret_cast<const float4*>(src + r * row_stride + k);
      x = s[0];
      y = s[1];
    }
    *reinterpret_cast<uint4*>(dst + r * Ld + k) =
        make_uint4(E::pack(x.x, x.y), E::pack(x.z, x.w), E::pack(y.x, y.y), E::pack(y.z, y.w));
  }
}

// Stores two adjacent output values as out_dtype (float32, bf16 or fp16).
__device__ __forceinline__ void store_pair(void* base, int64_t index, tf_dtype out_dtype, float lo,
                                           float hi) {
  if (out_dtype == TF_FLOAT32) {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + index) = make_float2(lo, hi);
  } else {
    uint32_t* dst = reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(base) + index);
    *dst = out_dtype == TF_BFLOAT16 ? Bf16::pack(lo, hi) : Fp16::pack(lo, hi);
  }
}

// Dropout shared bit-for-bit with the CPU kernels (attention_dropout.h):
// element (sequence, query head, query row, key col) is kept iff its Philox
// bits reach the threshold; kept elements are scaled by 1 / (1 - p).
struct Dropout {
  tf_attn_dropout_key_t key;
  uint32_t threshold;
  bool on;
  float inv_keep;
};

__device__ __forceinline__ Dropout make_dropout(const tf_attn_cuda_problem& p) {
  Dropout d;
  d.on = p.dropout_p > 0.0f;
  d.key = tf_attn_dropout_key(p.seed, p.offset);
  d.threshold = tf_attn_dropout_threshold(p.dropout_p);
  d.inv_keep = 1.0f / (1.0f - p.dropout_p);
  return d;
}

// Keep bits of one thread's accumulator fragments: bit 4 * i + e stands for
// the element at fragment row r0 + (e / 2) * 8, column c0 + 8 * i + e % 2
// (MMA C layout). Fragment rows are query rows and columns keys, or the other
// way round when kKeyRows. The loop stays rolled so that Philox does not
// multiply the live registers of the caller.
template <int kTiles, bool kKeyRows>
__device__ __forceinline__ uint64_t dropout_keep_mask(const Dropout& d, int64_t seq, int64_t head,
                                                      int64_t r0, int64_t c0) {
  static_assert(kTiles * 4 <= 64, "one bit per fragment element");
  uint64_t mask = 0;
#pragma unroll 1
  for (int k = 0; k < kTiles * 4; ++k) {
    const int64_t r = r0 + ((k & 3) >> 1) * 8, c = c0 + (k >> 2) * 8 + (k & 1);
    const uint32_t query = static_cast<uint32_t>(kKeyRows ? c : r);
    const uint32_t key = static_cast<uint32_t>(kKeyRows ? r : c);
    const uint32_t bits = tf_attn_dropout_bits(d.key, static_cast<uint32_t>(seq),
                                               static_cast<uint32_t>(head), query, key);
    if (bits >= d.threshold) mask |= uint64_t{1} << k;
  }
  return mask;
}

}  // namespace tf_attn

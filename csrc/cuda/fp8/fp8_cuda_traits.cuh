// Element and format traits of the FP8 CUDA kernels, the vector words they
// move memory in, and the run-time -> compile-time dtype/format dispatch.
// Every conversion forwards to the TF_HD functions the CPU kernels use.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include "fp8_cuda.h"

namespace tf_cuda {

// High-precision element types, stored as their raw bits.
struct F32 {
  using Storage = float;
  static __device__ __forceinline__ float to_f32(float v) { return v; }
  static __device__ __forceinline__ float from_f32(float v) { return v; }
};

struct BF16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float to_f32(uint16_t v) { return tf_bf16_to_f32(v); }
  static __device__ __forceinline__ uint16_t from_f32(float v) { return tf_f32_to_bf16(v); }
};

// NaN results of arithmetic differ between the CPU and the GPU, and the CPU's
// bytes (an FP8 NaN's sign, an amax's bits) depend on them: x86 and AArch64
// return a NaN operand, quieted, sign and payload kept; NVIDIA GPUs return
// the canonical NaN 0x7FFFFFFF. These helpers give the CPU's result.
__device__ __forceinline__ float quieted(float nan) {
  return tf_f32_from_bits(tf_f32_bits(nan) | 0x00400000u);
}

// The CPU's NaN for an invalid operation on non-NaN operands (Inf * 0): x86's
// "real indefinite" 0xFFC00000, AArch64's default NaN 0x7FC00000.
#if defined(__aarch64__)
#define TF_CPU_DEFAULT_NAN_BITS 0x7FC00000u
#else
#define TF_CPU_DEFAULT_NAN_BITS 0xFFC00000u
#endif

// a * b rounded to nearest (__fmul_rn: never contracted into an FMA), with the
// CPU's NaN. When both are NaN the CPU's pick depends on operand order; a wins here.
__device__ __forceinline__ float mul_like_cpu(float a, float b) {
  const float p = __fmul_rn(a, b);
  return a != a   ? quieted(a)
         : b != b ? quieted(b)
         : p != p ? tf_f32_from_bits(TF_CPU_DEFAULT_NAN_BITS)
                  : p;
}

// 1 / s rounded to nearest, with the CPU's NaN.
__device__ __forceinline__ float recip_like_cpu(float s) {
  return s != s ? quieted(s) : __fdiv_rn(1.0f, s);
}

struct F16 {
  using Storage = uint16_t;
  // tf_f16_to_f32 forms a NaN's bits with a multiply: rebuild them the CPU way
  // (the half's payload shifted in, quiet bit set).
  static __device__ __forceinline__ float to_f32(uint16_t v) {
    const uint32_t sign = static_cast<uint32_t>(v & 0x8000u) << 16;
    const uint32_t payload = static_cast<uint32_t>(v & 0x03FFu) << 13;
    const float nan = tf_f32_from_bits(sign | 0x7FC00000u | payload);
    return (v & 0x7FFFu) > 0x7C00u ? nan : tf_f16_to_f32(v);
  }
  static __device__ __forceinline__ uint16_t from_f32(float v) { return tf_f32_to_f16(v); }
};

struct E4M3 {
  static __device__ __forceinline__ uint8_t encode(float v) { return tf_fp8_e4m3_encode(v); }
  static __device__ __forceinline__ float decode(uint8_t c) { return tf_fp8_e4m3_decode(c); }
};

struct E5M2 {
  static __device__ __forceinline__ uint8_t encode(float v) { return tf_fp8_e5m2_encode(v); }
  static __device__ __forceinline__ float decode(uint8_t c) { return tf_fp8_e5m2_decode(c); }
};

// Bytes per vectorized access of the high-precision side, and the elements that makes.
constexpr int kVecBytes = 16;
template <class Elem>
constexpr int kVecElems = kVecBytes / static_cast<int>(sizeof(typename Elem::Storage));

// The machine word of N bytes, so a vector access is one load or store instruction.
template <int N>
struct Word;
template <>
struct Word<4> {
  using type = unsigned int;
};
template <>
struct Word<8> {
  using type = uint2;
};
template <>
struct Word<16> {
  using type = uint4;
};

// Loads N bytes (N a word size) from an N-aligned address into an array of any element type.
template <int N, class T>
__device__ __forceinline__ void load_vec(const void *src, T *dst) {
  const typename Word<N>::type w = *static_cast<const typename Word<N>::type *>(src);
  memcpy(dst, &w, N);
}

template <int N, class T>
__device__ __forceinline__ void store_vec(void *dst, const T *src) {
  typename Word<N>::type w;
  memcpy(&w, src, N);
  *static_cast<typename Word<N>::type *>(dst) = w;
}

__device__ __forceinline__ bool aligned_to(const void *p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// |v| as bits: orders like the value for non-negative floats, and NaN wins over Inf.
__device__ __forceinline__ uint32_t abs_bits(float v) { return tf_f32_bits(v) & 0x7FFFFFFFu; }

// Calls f(Elem{}) with the trait of a run-time dtype.
template <class F>
tf_status dispatch_dtype(tf_dtype dtype, F &&f) {
  switch (dtype) {
    case TF_FLOAT32: return f(F32{});
    case TF_BFLOAT16: return f(BF16{});
    case TF_FLOAT16: return f(F16{});
  }
  return TF_ERR_BAD_DTYPE;
}

// Calls f(Fmt{}) with the trait of a run-time FP8 format.
template <class F>
tf_status dispatch_format(tf_fp8_format format, F &&f) {
  switch (format) {
    case TF_FP8_E4M3: return f(E4M3{});
    case TF_FP8_E5M2: return f(E5M2{});
  }
  return TF_ERR_BAD_DTYPE;
}

}  // namespace tf_cuda

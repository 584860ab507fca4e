// Host model of csrc/cuda/attention/attention_ptx.cuh (run.sh puts it in that
// file's place in the copy of csrc the emulated kernels are built from): each
// inline-PTX instruction, lane-exact per the PTX ISA, on the fibers of
// cuda_runtime.h. A warp-wide instruction collects every lane's operands and
// the last lane to arrive computes the whole instruction:
//
// - ldmatrix.x4 (.trans): lane l gives the address of row l % 8 of matrix
//   l / 8 (16 bytes each); lane l = 4 g + t receives, of each matrix m, the
//   16-bit elements (g, 2t) and (g, 2t + 1) -- (2t, g) and (2t + 1, g) with
//   .trans -- low half first.
// - mma.m16n8k16 (bf16/fp16, fp32 accumulators): a0 = A(g, 2t..2t+1),
//   a1 = A(g+8, 2t..), a2 = A(g, 2t+8..), a3 = A(g+8, 2t+8..); b0 = B(2t..2t+1, g),
//   b1 = B(2t+8..2t+9, g); c0..c3 = C(g, 2t), C(g, 2t+1), C(g+8, 2t), C(g+8, 2t+1).
// - wgmma.m64nNk32 e4m3 with A in registers: warp w of the warpgroup holds rows
//   16 w.. of A in the m16n8k32 8-bit layout (a0 = A(g, 4t..4t+3), a1 = A(g+8, 4t..),
//   a2 = A(g, 16+4t..), a3 = A(g+8, 16+4t..), first element in the low byte) and
//   of D (d[i][0..3] = D(g, 8i+2t), D(g, 8i+2t+1), D(g+8, 8i+2t), D(g+8, 8i+2t+1));
//   B (32 x N, K-major) is read through the shared-memory descriptor (start,
//   leading byte offset between the two 16-byte core matrices along K, stride
//   byte offset between 8-row blocks along N; only the no-swizzle layout, which
//   is all the kernels use). It is asynchronous: it is computed at
//   wgmma.wait_group, from the shared memory published to the async proxy by
//   fence.proxy.async (a snapshot taken at each fence), and it requires a
//   wgmma.fence since the previous wait.
// - cp.async: queued per thread, landing at the cp.async.wait_group that
//   covers its group (or at issue, see EmuCopyTiming), so reading shared memory
//   before the wait (or without the barrier after it) reads the NaN bytes
//   shared memory starts with.
// - cvt.rn.satfinite.e4m3x2: the shared encoder (fp8_format.h) after clamping
//   finite and infinite values to +-448; lo in the low byte.
//
// The FP8 instructions exist only in the binaries for which the production
// header emits them (cvt from sm_89, wgmma in sm_90a): under another
// emu_binary_version they stop the program, as __trap would stop the kernel.
// MMA arithmetic is float32: products of 16-bit or e4m3 values are exact, the
// k terms are added one after another to the accumulator.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <cstring>
#include <utility>
#include <vector>

#include "fp8/fp8_format.h"

namespace tf_attn {

// When cp.async copies land: at the wait that covers them (the latest the
// hardware may deliver them, so reads before the wait see stale data) or at
// issue (the earliest, so a copy into a buffer that other warps still read
// overwrites it under them).
enum class EmuCopyTiming { kAtWait, kAtIssue };
inline EmuCopyTiming emu_copy_timing = EmuCopyTiming::kAtWait;

// Deliberate errors in the model, for the test that shows the kernels'
// results depend on the details the model encodes (a kernel with the
// matching bug would fail the same way).
enum class EmuFault {
  kNone,
  kWaitSkipsLastGroup,    // cp.async.wait_group 0 behaves like wait_group 1
  kMmaASwapped,           // a1 and a2 of the mma A fragment exchanged
  kLdmatrixTransIgnored,  // ldmatrix .trans loads untransposed
  kWgmmaStridesSwapped,   // the descriptor's leading and stride byte offsets exchanged
};
inline EmuFault emu_fault = EmuFault::kNone;

// ---- per-thread state of the asynchronous instructions ----------------------

struct EmuCopy {
  uint32_t dst;
  const void* src;
  bool valid, landed;
};
struct EmuWgmma {
  float* d;
  int n;
  uint32_t a[4];
  uint64_t desc;
};
struct EmuAsyncState {
  long block = -1;
  std::vector<EmuCopy> open;                 // cp.async not yet committed
  std::vector<std::vector<EmuCopy>> groups;  // committed cp.async groups, oldest first
  std::vector<EmuWgmma> mma_open, mma_committed;
  bool fenced = false;  // wgmma.fence since the last wait
};
inline EmuAsyncState emu_async_states[kEmuMaxThreads];

// A thread must not end with copies or MMAs in flight: they would land in
// shared memory that other threads may still be using.
inline void emu_check_nothing_in_flight() {
  const EmuAsyncState& s = emu_async_states[emu_thread()];
  // (Under kWaitSkipsLastGroup the last group is in flight by design.)
  if (s.block != emu_block.serial || emu_fault == EmuFault::kWaitSkipsLastGroup) return;
  for (const std::vector<EmuCopy>& g : s.groups)
    if (!g.empty()) emu_fatal("the thread ends with cp.async copies that no wait_group covered");
  if (!s.open.empty()) emu_fatal("the thread ends with uncommitted cp.async copies");
  if (!s.mma_open.empty() || !s.mma_committed.empty()) emu_fatal("the thread ends with wgmma in flight");
}

inline EmuAsyncState& emu_async(int thread) {
  emu_thread_exit_check = emu_check_nothing_in_flight;
  EmuAsyncState& s = emu_async_states[thread];
  if (s.block != emu_block.serial) {
    s = EmuAsyncState{};
    s.block = emu_block.serial;
  }
  return s;
}

// The async proxy's view of the block's shared memory (what wgmma reads).
struct EmuProxyView {
  long block = -1;
  std::vector<unsigned char> bytes;
};
inline EmuProxyView emu_proxy;

inline const unsigned char* emu_proxy_bytes() {
  if (emu_proxy.block != emu_block.serial) {
    emu_proxy.bytes.assign(emu_shared.bytes, 0xFF);
    emu_proxy.block = emu_block.serial;
  }
  return emu_proxy.bytes.data();
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

inline uint32_t emu_lo(uint32_t r) { return r & 0xFFFFu; }
inline uint32_t emu_hi(uint32_t r) { return r >> 16; }

// ---- mma.sync.m16n8k16 --------------------------------------------------------

struct EmuMmaIn {
  float c[4];
  uint32_t a[4], b[2];
};

// One m16n8k16 for the warp whose lanes start at thread `first`, from every
// lane's emu_in to every lane's emu_out. The emulation's hottest loop: built
// optimized and uninstrumented even in the sanitized -Og build (it touches
// only its own arrays and the slots).
template <float (*Decode)(uint16_t)>
[[gnu::optimize("O2", "fp-contract=off"), gnu::no_sanitize("address", "undefined")]] void emu_mma_warp(int first) {
  float A[16][16], B[16][8], C[16][8];
  const bool swap = emu_fault == EmuFault::kMmaASwapped;
  for (int lane = 0; lane < 32; ++lane) {
    EmuMmaIn x;
    std::memcpy(&x, emu_in[first + lane].bytes, sizeof x);
    const int g = lane / 4, t = lane % 4;
    const int rows[4] = {g, swap ? g : g + 8, swap ? g + 8 : g, g + 8};
    const int cols[4] = {2 * t, swap ? 2 * t + 8 : 2 * t, swap ? 2 * t : 2 * t + 8, 2 * t + 8};
    for (int r = 0; r < 4; ++r) {
      A[rows[r]][cols[r]] = Decode(static_cast<uint16_t>(emu_lo(x.a[r])));
      A[rows[r]][cols[r] + 1] = Decode(static_cast<uint16_t>(emu_hi(x.a[r])));
    }
    for (int r = 0; r < 2; ++r) {
      B[2 * t + 8 * r][g] = Decode(static_cast<uint16_t>(emu_lo(x.b[r])));
      B[2 * t + 8 * r + 1][g] = Decode(static_cast<uint16_t>(emu_hi(x.b[r])));
    }
    C[g][2 * t] = x.c[0];
    C[g][2 * t + 1] = x.c[1];
    C[g + 8][2 * t] = x.c[2];
    C[g + 8][2 * t + 1] = x.c[3];
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    float d[4];
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
      float acc = C[row][col];
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      d[e] = acc;
    }
    std::memcpy(emu_out[first + lane].bytes, d, sizeof d);
  }
}

template <float (*Decode)(uint16_t)>
void emu_mma_m16n8k16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, const char* what) {
  const EmuGroup w = emu_warp();
  if (w.size != 32) emu_fatal("%s in a partial warp", what);
  const EmuMmaIn in = {{c[0], c[1], c[2], c[3]}, {a[0], a[1], a[2], a[3]}, {b0, b1}};
  std::memcpy(emu_in[emu_thread()].bytes, &in, sizeof in);
  emu_meet(w, what, [w] { emu_mma_warp<Decode>(w.first); });
  std::memcpy(c, emu_out[emu_thread()].bytes, 4 * sizeof(float));
}

inline float emu_bf16(uint16_t h) { return tf_bf16_to_f32(h); }
inline float emu_f16(uint16_t h) { return tf_f16_to_f32(h); }

__device__ __forceinline__ void mma_bf16_m16n8k16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  emu_mma_m16n8k16<emu_bf16>(c, a, b0, b1, "mma.sync.m16n8k16.bf16");
}

__device__ __forceinline__ void mma_f16_m16n8k16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  emu_mma_m16n8k16<emu_f16>(c, a, b0, b1, "mma.sync.m16n8k16.f16");
}

// ---- wgmma.mma_async.m64nNk32.f32.e4m3.e4m3 (A in registers) -----------------

template <int N>
__device__ __forceinline__ void wgmma_m64k32_e4m3_rs(float (&d)[N / 8][4], const uint32_t a[4], uint64_t desc_b) {
  if (emu_binary_version != 90) emu_fatal("wgmma in the sm_%d binary: the kernel traps", emu_binary_version);
  EmuAsyncState& s = emu_async(emu_thread());
  if (!s.fenced) emu_fatal("wgmma.mma_async without a wgmma.fence since the last wait");
  s.mma_open.push_back({&d[0][0], N, {a[0], a[1], a[2], a[3]}, desc_b});
}

__device__ __forceinline__ void wgmma_fence() { emu_async(emu_thread()).fenced = true; }

__device__ __forceinline__ void wgmma_commit() {
  EmuAsyncState& s = emu_async(emu_thread());
  s.mma_committed.insert(s.mma_committed.end(), s.mma_open.begin(), s.mma_open.end());
  s.mma_open.clear();
}

// A shared-memory matrix descriptor: start address, leading byte offset (between
// the core matrices along K), stride byte offset (between 8-row blocks along N).
struct EmuDescriptor {
  uint32_t start, lead, stride;
};

inline EmuDescriptor emu_descriptor(uint64_t desc) {
  if ((desc >> 62) != 0) emu_fatal("wgmma descriptor with a swizzle mode (not modelled)");
  if (((desc >> 49) & 7) != 0) emu_fatal("wgmma descriptor with a base offset");
  // Bits 14-15, 30-31, 46-48 and 52-61 are reserved.
  if ((desc & 0x3FF1C000C000C000ull) != 0) emu_fatal("wgmma descriptor with reserved bits set");
  EmuDescriptor d = {static_cast<uint32_t>(desc & 0x3FFF) << 4, static_cast<uint32_t>((desc >> 16) & 0x3FFF) << 4,
                     static_cast<uint32_t>((desc >> 32) & 0x3FFF) << 4};
  if (emu_fault == EmuFault::kWgmmaStridesSwapped) std::swap(d.lead, d.stride);
  return d;
}

// Element (k, n) of a K-major no-swizzle B operand, from the async proxy's view.
inline float emu_wgmma_b(const EmuDescriptor& d, int k, int n) {
  const uint32_t addr = d.start + (n / 8) * d.stride + (k / 16) * d.lead + (n % 8) * 16 + k % 16;
  return tf_fp8_e4m3_decode(emu_proxy_bytes()[emu_shared_offset(addr, 1)]);
}

__device__ __forceinline__ void wgmma_wait_all() {
  if (emu_binary_version != 90) return;  // compiled only into the sm_90a binary
  const EmuAsyncState& self = emu_async(emu_thread());
  if (!self.mma_open.empty()) emu_fatal("wgmma.wait_group with uncommitted wgmma");
  const EmuGroup wg = emu_warpgroup();
  emu_meet(wg, "wgmma.wait_group", [wg] {
    const std::vector<EmuWgmma>& first = emu_async(wg.first).mma_committed;
    for (int t = wg.first; t < wg.first + wg.size; ++t) {
      const std::vector<EmuWgmma>& ops = emu_async(t).mma_committed;
      bool same = ops.size() == first.size();
      for (size_t j = 0; same && j < ops.size(); ++j) same = ops[j].n == first[j].n && ops[j].desc == first[j].desc;
      if (!same) emu_fatal("the threads of a warpgroup issued different wgmma");
    }
    for (size_t j = 0; j < first.size(); ++j) {
      const int n = first[j].n;
      const EmuDescriptor desc = emu_descriptor(first[j].desc);
      std::vector<float> B(32 * n);
      for (int k = 0; k < 32; ++k)
        for (int c = 0; c < n; ++c) B[k * n + c] = emu_wgmma_b(desc, k, c);
      for (int w = 0; w < 4; ++w) {
        float A[16][32];
        for (int lane = 0; lane < 32; ++lane) {
          const EmuWgmma& op = emu_async(wg.first + 32 * w + lane).mma_committed[j];
          const int g = lane / 4, t = lane % 4;
          for (int r = 0; r < 4; ++r)
            for (int byte = 0; byte < 4; ++byte)
              A[g + 8 * (r % 2)][16 * (r / 2) + 4 * t + byte] =
                  tf_fp8_e4m3_decode(static_cast<uint8_t>(op.a[r] >> (8 * byte)));
        }
        for (int lane = 0; lane < 32; ++lane) {
          float* d = emu_async(wg.first + 32 * w + lane).mma_committed[j].d;
          const int g = lane / 4, t = lane % 4;
          for (int i = 0; i < n / 8; ++i)
            for (int e = 0; e < 4; ++e) {
              const int row = g + 8 * (e / 2), col = 8 * i + 2 * t + e % 2;
              float acc = d[4 * i + e];
              for (int k = 0; k < 32; ++k) acc += A[row][k] * B[k * n + col];
              d[4 * i + e] = acc;
            }
        }
      }
    }
    for (int t = wg.first; t < wg.first + wg.size; ++t) emu_async(t).mma_committed.clear();
  });
  emu_async(emu_thread()).fenced = false;
}

__device__ __forceinline__ void fence_operand(float&) {}
template <int N>
__device__ __forceinline__ void fence_operands(float (&)[N][4]) {}

__device__ __forceinline__ void fence_proxy_async_shared() {
  if (emu_binary_version < 90) return;  // compiled only from sm_90
  emu_proxy_bytes();
  std::memcpy(emu_proxy.bytes.data(), emu_shared.data, emu_shared.bytes);
}

// ---- cvt.rn.satfinite.e4m3x2.f32 ------------------------------------------------

__device__ __forceinline__ uint16_t cvt_e4m3x2(float lo, float hi) {
  if (emu_binary_version < 89) emu_fatal("cvt.e4m3x2 in the sm_%d binary: the kernel traps", emu_binary_version);
  const auto encode = [](float x) -> uint32_t {
    if (x == x) x = x < -448.0f ? -448.0f : (x > 448.0f ? 448.0f : x);
    return tf_fp8_e4m3_encode(x);
  };
  return static_cast<uint16_t>(encode(lo) | encode(hi) << 8);
}

// ---- ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 -------------------------

inline void emu_ldmatrix_x4(uint32_t r[4], const void* row, bool trans) {
  const EmuGroup w = emu_warp();
  if (w.size != 32) emu_fatal("ldmatrix in a partial warp");
  const uint32_t addr = smem_addr(row);
  std::memcpy(emu_in[emu_thread()].bytes, &addr, sizeof addr);
  emu_meet(w, trans ? "ldmatrix.x4.trans" : "ldmatrix.x4", [w, trans] {
    uint16_t M[4][8][8];
    for (int lane = 0; lane < 32; ++lane) {
      uint32_t a;
      std::memcpy(&a, emu_in[w.first + lane].bytes, sizeof a);
      if (a % 16 != 0) emu_fatal("ldmatrix row address 0x%x is not 16-byte aligned", a);
      std::memcpy(M[lane / 8][lane % 8], emu_shared.data + emu_shared_offset(a, 16), 16);
    }
    const bool t_rows = trans && emu_fault != EmuFault::kLdmatrixTransIgnored;
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      uint32_t out[4];
      for (int m = 0; m < 4; ++m) {
        const uint16_t lo = t_rows ? M[m][2 * t][g] : M[m][g][2 * t];
        const uint16_t hi = t_rows ? M[m][2 * t + 1][g] : M[m][g][2 * t + 1];
        out[m] = lo | static_cast<uint32_t>(hi) << 16;
      }
      std::memcpy(emu_out[w.first + lane].bytes, out, sizeof out);
    }
  });
  std::memcpy(r, emu_out[emu_thread()].bytes, 4 * sizeof(uint32_t));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) { emu_ldmatrix_x4(r, row, false); }

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* row) { emu_ldmatrix_x4(r, row, true); }

// ---- cp.async.cg.shared.global 16 bytes, commit_group, wait_group 0 ------------

inline void emu_land(EmuCopy& c) {
  static const unsigned char zeros[16] = {};
  if (!c.landed) std::memcpy(emu_shared.data + emu_shared_offset(c.dst, 16), c.valid ? c.src : zeros, 16);
  c.landed = true;
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  EmuCopy c = {smem_addr(dst), src, valid, false};
  if (c.dst % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0)
    emu_fatal("cp.async of 16 bytes between addresses that are not 16-byte aligned");
  emu_shared_offset(c.dst, 16);
  if (emu_copy_timing == EmuCopyTiming::kAtIssue) emu_land(c);
  emu_async(emu_thread()).open.push_back(c);
}

__device__ __forceinline__ void cp_async_commit() {
  EmuAsyncState& s = emu_async(emu_thread());
  s.groups.push_back(s.open);
  s.open.clear();
}

__device__ __forceinline__ void cp_async_wait_all() {
  EmuAsyncState& s = emu_async(emu_thread());
  const size_t keep = emu_fault == EmuFault::kWaitSkipsLastGroup && !s.groups.empty() ? 1 : 0;
  for (size_t g = 0; g + keep < s.groups.size(); ++g)
    for (EmuCopy& c : s.groups[g]) emu_land(c);
  s.groups.erase(s.groups.begin(), s.groups.end() - static_cast<long>(keep));
}

}  // namespace tf_attn

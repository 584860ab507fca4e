// Host stand-in for the CUDA runtime and the device built-ins that the kernels
// of csrc/cuda use, so their indexing, tails, tiling, synchronization and
// reductions run (and are checked against the C core) on a machine without a
// GPU.
//
// Every CUDA thread of a block is a fiber (ucontext) on the calling OS thread;
// the blocks of a grid run one after another. A fiber runs until it reaches a
// barrier or a warp-wide operation (__syncthreads, __syncwarp, __shfl_xor_sync,
// and the warp / warpgroup instructions of the stand-ins for inline-PTX
// headers, which use emu_meet), then the next fiber runs: the order is
// deterministic, so a missing barrier shows up as stale data every time
// instead of by luck. A barrier that some threads never reach (divergence, a
// thread that exited) stops the program with a message. The last thread to
// reach a warp-wide operation computes it for the whole warp from every
// lane's operands, which is what makes lane-exact models of ldmatrix and mma
// possible.
//
// It does not model the GPU's arithmetic (NaN canonicalization, FMA): the
// kernels handle those by construction and GPU tests check them.
#pragma once

#include <math.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif
#include <stdarg.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __grid_constant__
#define __align__(n) alignas(n)
// One block runs at a time, so a static serves as the block's shared memory.
#define __shared__ static

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
// threadIdx always holds the running fiber's index (set at every switch).
inline dim3 threadIdx, blockIdx, blockDim, gridDim;

struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

template <class T>
T min(T a, T b) {
  return a < b ? a : b;
}
template <class T>
T max(T a, T b) {
  return a > b ? a : b;
}

typedef struct CUstream_st *cudaStream_t;
enum cudaError_t { cudaSuccess = 0 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
struct cudaFuncAttributes {
  int binaryVersion, ptxVersion, maxDynamicSharedSizeBytes;
};

// Few SMs, so that modest test sizes already make the grid-stride loops go round.
constexpr int kEmuSms = 2;
// The architecture of the kernel binary the emulated device runs (what
// cudaFuncGetAttributes reports as binaryVersion): 90 for the sm_90a binary,
// 80 for the sm_80 one. Tests set it to run both.
inline int emu_binary_version = 90;
inline long emu_launch_count = 0;

[[noreturn]] inline void emu_fatal(const char *format, ...) {
  std::fflush(stdout);
  va_list args;
  va_start(args, format);
  std::fprintf(stderr, "CUDA emulation: block (%u, %u, %u) thread %u: ", blockIdx.x, blockIdx.y, blockIdx.z,
               threadIdx.x);
  std::vfprintf(stderr, format, args);
  std::fputc('\n', stderr);
  va_end(args);
  std::abort();
}

inline cudaError_t cudaGetDevice(int *device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr, int) {
  *value = kEmuSms;
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}

// Largest dynamic shared memory of a block: 163 KiB on sm_80, 227 KiB on sm_90.
inline int emu_max_dynamic_shared() { return emu_binary_version >= 90 ? 232448 : 166912; }
// What cudaFuncSetAttribute allowed each kernel (48 KiB without it).
inline std::map<const void *, int> emu_max_dynamic_shared_of;

template <class... A>
const void *emu_kernel_id(void (*kernel)(A...)) {
  return reinterpret_cast<const void *>(kernel);
}
template <class... A>
cudaError_t cudaFuncSetAttribute(void (*kernel)(A...), cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || value > emu_max_dynamic_shared())
    return static_cast<cudaError_t>(1);
  emu_max_dynamic_shared_of[emu_kernel_id(kernel)] = value;
  return cudaSuccess;
}
template <class... A>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *attr, void (*kernel)(A...)) {
  const auto it = emu_max_dynamic_shared_of.find(emu_kernel_id(kernel));
  attr->binaryVersion = attr->ptxVersion = emu_binary_version;
  attr->maxDynamicSharedSizeBytes = it == emu_max_dynamic_shared_of.end() ? 48 * 1024 : it->second;
  return cudaSuccess;
}

// ---- fibers -------------------------------------------------------------

constexpr int kEmuMaxThreads = 1024;
constexpr size_t kEmuStackBytes = 32 * 1024;  // the kernels use under 8 KiB; a guard page stops overflows

struct EmuFiber {
  ucontext_t context;
  char *stack = nullptr;  // mapped once, with an inaccessible guard page below it
  dim3 index;
  bool done = false, waiting = false;
  const char *waiting_at = nullptr;
};

struct EmuBlock {
  std::vector<EmuFiber> fibers = std::vector<EmuFiber>(kEmuMaxThreads);
  int threads = 0, current = 0;
  long serial = 0;  // counts the blocks run, so per-thread state can tell a new block
  ucontext_t scheduler;
  void (*body)(void *) = nullptr;
  void *body_arg = nullptr;
};
inline EmuBlock emu_block;

// Linear index of the running thread inside its block.
inline int emu_thread() { return emu_block.current; }

// AddressSanitizer must be told when execution moves to another stack.
#if defined(__SANITIZE_ADDRESS__)
struct EmuStackBounds {
  const void *bottom = nullptr;
  size_t size = 0;
};
inline EmuStackBounds emu_scheduler_stack;
// Before leaving the running stack for `to` (nullptr: the scheduler's);
// `ending`: the running fiber never resumes.
inline void emu_leave_stack(const EmuFiber *to, bool ending, void **fake_stack) {
  __sanitizer_start_switch_fiber(ending ? nullptr : fake_stack, to ? to->stack : emu_scheduler_stack.bottom,
                                 to ? kEmuStackBytes : emu_scheduler_stack.size);
}
inline void emu_enter_stack(void *fake_stack, EmuStackBounds *from = nullptr) {
  __sanitizer_finish_switch_fiber(fake_stack, from ? &from->bottom : nullptr, from ? &from->size : nullptr);
}
#else
inline void emu_leave_stack(const EmuFiber *, bool, void **) {}
inline void emu_enter_stack(void *) {}
#endif

inline void emu_switch(int from_context_of, int to, bool ending) {
  EmuFiber &next = emu_block.fibers[to];
  emu_block.current = to;
  threadIdx = next.index;
  void *fake_stack = nullptr;
  emu_leave_stack(&next, ending, &fake_stack);
  swapcontext(&emu_block.fibers[from_context_of].context, &next.context);
  emu_enter_stack(fake_stack);
}

// The order in which threads run between barriers. kInterleaved switches
// warps at every warp-wide operation, so warps advance together; the others
// run one warp until it waits at a block-wide barrier before the next warp
// starts (in ascending or descending order), so a warp that reads what another
// has not written yet, or overwrites what another has not read yet, does so.
enum class EmuSchedule { kInterleaved, kWarpByWarp, kWarpByWarpDescending };
inline EmuSchedule emu_schedule = EmuSchedule::kInterleaved;

inline bool emu_runnable(int f) { return !emu_block.fibers[f].done && !emu_block.fibers[f].waiting; }

// The fiber to run after `self`, or -1 when none can run.
inline int emu_next_fiber(int self) {
  const int n = emu_block.threads;
  if (emu_schedule != EmuSchedule::kInterleaved) {
    const int first = self / 32 * 32, lanes = min(32, n - first);
    for (int i = 1; i <= lanes; ++i)
      if (emu_runnable(first + (self - first + i) % lanes)) return first + (self - first + i) % lanes;
    const int warps = (n + 31) / 32, step = emu_schedule == EmuSchedule::kWarpByWarp ? 1 : warps - 1;
    for (int w = (self / 32 + step) % warps, k = 1; k < warps; w = (w + step) % warps, ++k)
      for (int t = 32 * w; t < min(32 * w + 32, n); ++t)
        if (emu_runnable(t)) return t;
    return -1;
  }
  for (int i = 1; i <= n; ++i)
    if (emu_runnable((self + i) % n)) return (self + i) % n;
  return -1;
}

// Lets the next runnable fiber run; back to the scheduler when none can.
// `ending`: the running fiber has finished.
inline void emu_yield(bool ending = false) {
  const int self = emu_block.current, next = emu_next_fiber(self);
  if (next == self) return;
  if (next >= 0) {
    emu_switch(self, next, ending);
    return;
  }
  void *fake_stack = nullptr;
  emu_leave_stack(nullptr, ending, &fake_stack);
  swapcontext(&emu_block.fibers[self].context, &emu_block.scheduler);
  emu_enter_stack(fake_stack);
}

// Run when a thread ends (set by a stand-in that has per-thread state to check).
inline void (*emu_thread_exit_check)() = nullptr;

inline void emu_fiber_main() {
#if defined(__SANITIZE_ADDRESS__)
  // Fiber 0 is always entered from the scheduler: that tells where its stack is.
  if (emu_block.current == 0)
    emu_enter_stack(nullptr, &emu_scheduler_stack);
  else
    emu_enter_stack(nullptr);
#endif
  emu_block.body(emu_block.body_arg);
  if (emu_thread_exit_check != nullptr) emu_thread_exit_check();
  emu_block.fibers[emu_block.current].done = true;
  emu_yield(true);
}

// Per-thread operand and result slots of the warp-wide operations.
constexpr size_t kEmuSlotBytes = 64;
struct alignas(16) EmuSlot {
  unsigned char bytes[kEmuSlotBytes];
};
inline EmuSlot emu_in[kEmuMaxThreads], emu_out[kEmuMaxThreads];

// A set of threads that meet at barriers: the block, a warp or a warpgroup.
struct EmuGroup {
  int first, size, id;  // id: warps 0..31, warpgroups 32..39, the block 40
};
inline EmuGroup emu_warp() {
  const int first = emu_thread() / 32 * 32;
  return {first, min(32, emu_block.threads - first), first / 32};
}
inline EmuGroup emu_warpgroup() {
  const int first = emu_thread() / 128 * 128;
  if (first + 128 > emu_block.threads) emu_fatal("a warpgroup instruction in a partial warpgroup");
  return {first, 128, 32 + first / 128};
}

struct EmuMeeting {
  int arrived = 0;
  const char *what = nullptr;
};
inline EmuMeeting emu_meetings[41];  // by group id

// The threads of `group` meet here, each having stored its operands in
// emu_in[its thread]. The last one to arrive runs complete() (which reads
// every member's emu_in and writes every member's emu_out) and then all go
// on. Every member must be at the same operation (`what`).
template <class F>
void emu_meet(EmuGroup group, const char *what, F complete) {
  EmuMeeting &m = emu_meetings[group.id];
  if (m.arrived == 0) m.what = what;
  if (std::strcmp(m.what, what) != 0) emu_fatal("threads of one warp or block diverged: %s and %s", m.what, what);
  if (++m.arrived == group.size) {
    m.arrived = 0;
    complete();
    for (int t = group.first; t < group.first + group.size; ++t) emu_block.fibers[t].waiting = false;
    return;
  }
  EmuFiber &self = emu_block.fibers[emu_thread()];
  self.waiting = true;
  self.waiting_at = what;
  while (self.waiting) emu_yield();
}

inline void __syncthreads() { emu_meet({0, emu_block.threads, 40}, "__syncthreads", [] {}); }
inline void __syncwarp(unsigned int = 0xffffffffu) { emu_meet(emu_warp(), "__syncwarp", [] {}); }

template <class T>
T __shfl_xor_sync(unsigned int, T value, int lane_mask) {
  static_assert(sizeof(T) <= 8, "one register");
  const EmuGroup w = emu_warp();
  std::memcpy(emu_in[emu_thread()].bytes, &value, sizeof value);
  std::memcpy(emu_in[emu_thread()].bytes + 8, &lane_mask, sizeof lane_mask);
  emu_meet(w, "__shfl_xor_sync", [w] {
    for (int lane = 0; lane < w.size; ++lane) {
      int mask;
      std::memcpy(&mask, emu_in[w.first + lane].bytes + 8, sizeof mask);
      const int src = lane ^ mask;
      if (src >= w.size) emu_fatal("__shfl_xor_sync reads lane %d of a %d-lane warp", src, w.size);
      std::memcpy(emu_out[w.first + lane].bytes, emu_in[w.first + src].bytes, sizeof(T));
    }
  });
  T out;
  std::memcpy(&out, emu_out[emu_thread()].bytes, sizeof out);
  return out;
}

// One OS thread runs every fiber, so plain read-modify-writes are atomic.
inline unsigned int atomicMax(unsigned int *p, unsigned int value) {
  const unsigned int old = *p;
  *p = old > value ? old : value;
  return old;
}
inline unsigned int atomicAnd(unsigned int *p, unsigned int value) {
  const unsigned int old = *p;
  *p = old & value;
  return old;
}
inline float atomicAdd(float *p, float value) {
  const float old = *p;
  *p = old + value;
  return old;
}

// Built with -ffp-contract=off, so these are single IEEE operations as on the GPU.
// The GPU's arithmetic returns the canonical NaN 0x7FFFFFFF for every NaN result (NaN operands or an
// invalid operation such as Inf * 0), where the host's keeps a NaN operand's payload or gives its own
// default NaN: emulated, so kernels that must write the CPU's NaN bytes are checked to do so explicitly.
inline float gpu_nan_rule(float r) {
  if (r == r) return r;
  const unsigned int canonical = 0x7FFFFFFFu;
  float out;
  memcpy(&out, &canonical, sizeof out);
  return out;
}
inline float __fmul_rn(float a, float b) { return gpu_nan_rule(a * b); }
inline float __fadd_rn(float a, float b) { return gpu_nan_rule(a + b); }
inline float __fdiv_rn(float a, float b) { return gpu_nan_rule(a / b); }

// ---- dynamic shared memory --------------------------------------------------

// The block's dynamic shared memory; shared-window addresses start at
// kEmuSharedBase (the window's first KiB is reserved on sm_80+).
constexpr uint32_t kEmuSharedBase = 1024;
struct EmuShared {
  unsigned char *data = nullptr;
  size_t bytes = 0;
};
inline EmuShared emu_shared;

// What `extern __shared__ __align__(A) T name[];` becomes (emulate_sources.py).
template <class T>
T *emu_dynamic_shared(size_t align) {
  if (emu_shared.bytes == 0) emu_fatal("dynamic shared memory used by a launch that requested none");
  if (reinterpret_cast<uintptr_t>(emu_shared.data) % align != 0) emu_fatal("shared memory misaligned");
  return reinterpret_cast<T *>(emu_shared.data);
}

inline size_t __cvta_generic_to_shared(const void *p) {
  const unsigned char *c = static_cast<const unsigned char *>(p);
  if (c < emu_shared.data || c >= emu_shared.data + emu_shared.bytes)
    emu_fatal("%p is not in the block's dynamic shared memory", p);
  return kEmuSharedBase + static_cast<size_t>(c - emu_shared.data);
}

// Offset into the dynamic shared memory of `bytes` bytes at shared-window address addr.
inline size_t emu_shared_offset(uint32_t addr, size_t bytes) {
  if (addr < kEmuSharedBase || addr - kEmuSharedBase + bytes > emu_shared.bytes)
    emu_fatal("shared address 0x%x (+%zu bytes) is outside the %zu-byte dynamic shared memory", addr, bytes,
              emu_shared.bytes);
  return addr - kEmuSharedBase;
}

// ---- launches ---------------------------------------------------------------

// Makes f start the kernel at its next switch (out of line, like the switch:
// getcontext returns twice).
[[gnu::noinline]] inline void emu_prepare_fiber(EmuFiber &f) {
  f.done = f.waiting = false;
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = kEmuStackBytes;
  f.context.uc_link = nullptr;
  makecontext(&f.context, emu_fiber_main, 0);
}

// Runs the fibers until none can run (out of line: nothing of the caller may
// live across the switch, which returns twice as far as the compiler knows).
[[gnu::noinline]] inline void emu_enter_fibers() {
  emu_block.current = 0;
  threadIdx = emu_block.fibers[0].index;
  void *fake_stack = nullptr;
  emu_leave_stack(&emu_block.fibers[0], false, &fake_stack);
  swapcontext(&emu_block.scheduler, &emu_block.fibers[0].context);
  emu_enter_stack(fake_stack);
}

// Runs every thread of block blockIdx to its end.
inline void emu_run_block() {
  ++emu_block.serial;
  // Shared memory starts as NaN bytes (bf16, fp16, float and e4m3 alike), so a
  // read of data that never landed shows up in the results.
  std::memset(emu_shared.data, 0xFF, emu_shared.bytes);
  for (int t = 0; t < emu_block.threads; ++t) emu_prepare_fiber(emu_block.fibers[t]);
  emu_enter_fibers();
  for (int t = 0; t < emu_block.threads; ++t) {
    const EmuFiber &f = emu_block.fibers[t];
    if (!f.done) {
      threadIdx = f.index;
      emu_fatal("deadlock: waits at %s, which not every thread of its warp or block reaches", f.waiting_at);
    }
  }
}

// What `kernel<<<grid, block, shared, stream>>>(args)` becomes: body() is the kernel call.
template <class Body>
void emu_launch(const void *kernel, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t, Body body) {
  ++emu_launch_count;
  const long threads = static_cast<long>(block.x) * block.y * block.z;
  if (threads < 1 || threads > kEmuMaxThreads) emu_fatal("launch with %ld threads per block", threads);
  if (grid.y > 65535 || grid.z > 65535) emu_fatal("grid (%u, %u, %u) too large", grid.x, grid.y, grid.z);
  const auto allowed = emu_max_dynamic_shared_of.find(kernel);
  const size_t limit = allowed == emu_max_dynamic_shared_of.end() ? 48 * 1024 : allowed->second;
  if (shared_bytes > limit) emu_fatal("launch with %zu bytes of dynamic shared memory, %zu allowed", shared_bytes, limit);
  gridDim = grid;
  blockDim = block;
  // Exactly the requested bytes, so that AddressSanitizer sees accesses past them.
  void *shared = nullptr;
  if (posix_memalign(&shared, 1024, shared_bytes > 0 ? shared_bytes : 1) != 0) emu_fatal("no memory");
  emu_shared.data = static_cast<unsigned char *>(shared);
  emu_shared.bytes = shared_bytes;
  emu_block.threads = static_cast<int>(threads);
  emu_block.body = [](void *b) { (*static_cast<Body *>(b))(); };
  emu_block.body_arg = &body;
  for (EmuMeeting &m : emu_meetings) m = EmuMeeting{};
  for (int t = 0; t < threads; ++t) {
    EmuFiber &f = emu_block.fibers[t];
    if (f.stack == nullptr) {
      void *map = mmap(nullptr, kEmuStackBytes + 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                       -1, 0);
      if (map == MAP_FAILED || mprotect(map, 4096, PROT_NONE) != 0) emu_fatal("no memory for fiber stacks");
      f.stack = static_cast<char *>(map) + 4096;
    }
    f.index = dim3(t % block.x, t / block.x % block.y, t / (block.x * block.y));
  }
  for (unsigned int z = 0; z < grid.z; ++z)
    for (unsigned int y = 0; y < grid.y; ++y)
      for (unsigned int x = 0; x < grid.x; ++x) {
        blockIdx = dim3(x, y, z);
        emu_run_block();
      }
  std::free(shared);
  emu_shared = EmuShared{};
}

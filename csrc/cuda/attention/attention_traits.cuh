// Tile configurations of the attention kernels, per head dim.
//
// Every warp owns 16 rows of the output tile (one m16 MMA row block), so a
// tile of M rows runs on M / 16 warps. Shared-memory rows are padded by 8
// elements (16 bytes): with that pad the 8 row addresses of every ldmatrix
// phase fall into 8 different 16-byte bank groups for all head dims here,
// without an XOR swizzle.
#pragma once

namespace tf_attn {

constexpr int kRowPad = 8;

// Forward: a CTA owns kBlockM query rows and streams kBlockN keys at a time.
template <int D>
struct FwdConfig;

template <>
struct FwdConfig<32> { static constexpr int kBlockM = 128, kBlockN = 128; };
template <>
struct FwdConfig<64> { static constexpr int kBlockM = 128, kBlockN = 64; };
template <>
struct FwdConfig<96> { static constexpr int kBlockM = 128, kBlockN = 64; };
template <>
struct FwdConfig<128> { static constexpr int kBlockM = 128, kBlockN = 64; };

// Backward: a CTA owns kBlockN keys of one KV head, keeps their dK/dV in
// registers, and streams kBlockM queries (of every query head of the group).
template <int D>
struct BwdConfig;

template <>
struct BwdConfig<32> { static constexpr int kBlockM = 64, kBlockN = 128; };
template <>
struct BwdConfig<64> { static constexpr int kBlockM = 64, kBlockN = 128; };
template <>
struct BwdConfig<96> { static constexpr int kBlockM = 64, kBlockN = 64; };
template <>
struct BwdConfig<128> { static constexpr int kBlockM = 64, kBlockN = 64; };

// Derived sizes shared by both directions.
template <int D, int BlockM, int BlockN>
struct TileShape {
  static constexpr int kHeadDim = D;
  static constexpr int kBlockM = BlockM;
  static constexpr int kBlockN = BlockN;
  static constexpr int kLd = D + kRowPad;  // smem row stride in elements
  static_assert(D % 16 == 0, "head dim must be a multiple of 16");
  static_assert(BlockM % 16 == 0 && BlockN % 16 == 0, "tiles are made of 16-row blocks");
};

}  // namespace tf_attn

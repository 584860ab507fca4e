/*
 * Tile operations of the AMX attention kernels (see attention_amx.h): the
 * hardware instructions, or with TF_ATTN_AMX_EMULATE a software model of the
 * eight 16 x 64-byte tile registers that reads and writes the same bytes.
 * Tile numbers are compile-time constants, as the instructions require.
 *
 *   AMX_CONFIGURE()          every tile 16 rows x 64 bytes
 *   AMX_ZERO(t)              tile t = 0
 *   AMX_LOAD(t, ptr, stride) 16 rows of 64 bytes, `stride` bytes apart
 *   AMX_STORE(t, ptr, stride)
 *   AMX_DP(c, a, b)          c += a . b (bf16 pairs, float32 accumulation)
 *   AMX_RELEASE()            back to the init state
 */
#ifndef TF_ATTENTION_AMX_TILE_H
#define TF_ATTENTION_AMX_TILE_H

#include "attention_amx.h"

#if defined(TF_ATTN_AMX_EMULATE)

#include "../common/tf_dtype.h"

typedef struct tf_amx_emu_tile {
  unsigned char bytes[16][64];
} tf_amx_emu_tile;

static _Thread_local tf_amx_emu_tile tf_amx_emu_regs[8];

static inline void tf_amx_emu_load(int t, const void *ptr, int64_t stride) {
  for (int r = 0; r < 16; ++r) memcpy(tf_amx_emu_regs[t].bytes[r], (const char *)ptr + r * stride, 64);
}

static inline void tf_amx_emu_store(int t, void *ptr, int64_t stride) {
  for (int r = 0; r < 16; ++r) memcpy((char *)ptr + r * stride, tf_amx_emu_regs[t].bytes[r], 64);
}

/* bf16 bits as float, a subnormal as zero (the instruction's DAZ). */
static inline float tf_amx_emu_bf16(const unsigned char *p) {
  uint16_t b;
  memcpy(&b, p, 2);
  return (b & 0x7f80u) == 0 ? 0.0f * tf_bf16_to_f32(b) : tf_bf16_to_f32(b);
}

static inline void tf_amx_emu_dp(int c, int a, int b) {
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 16; ++n) {
      float acc;
      memcpy(&acc, tf_amx_emu_regs[c].bytes[m] + 4 * n, 4);
      for (int k = 0; k < 16; ++k)
        for (int e = 0; e < 2; ++e) {
          /* The product of two bf16 is exact in float32; the sum is rounded once. */
          const float prod = tf_amx_emu_bf16(tf_amx_emu_regs[a].bytes[m] + 4 * k + 2 * e) *
                             tf_amx_emu_bf16(tf_amx_emu_regs[b].bytes[k] + 4 * n + 2 * e);
          acc += prod;
        }
      memcpy(tf_amx_emu_regs[c].bytes[m] + 4 * n, &acc, 4);
    }
}

#define AMX_CONFIGURE() ((void)0)
#define AMX_ZERO(t) memset(&tf_amx_emu_regs[t], 0, sizeof tf_amx_emu_regs[t])
#define AMX_LOAD(t, ptr, stride) tf_amx_emu_load(t, ptr, stride)
#define AMX_STORE(t, ptr, stride) tf_amx_emu_store(t, ptr, stride)
#define AMX_DP(c, a, b) tf_amx_emu_dp(c, a, b)
#define AMX_RELEASE() ((void)0)

#elif TF_ATTN_AMX_BUILT

#include <immintrin.h>

/* The 64-byte LDTILECFG operand: palette 1, then bytes per row and rows of each tile. */
typedef struct tf_amx_config {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tf_amx_config;

#define AMX_CONFIGURE()                                   \
  do {                                                    \
    tf_amx_config cfg_;                                   \
    memset(&cfg_, 0, sizeof cfg_);                        \
    cfg_.palette = 1;                                     \
    for (int t_ = 0; t_ < 8; ++t_) {                      \
      cfg_.colsb[t_] = 64;                                \
      cfg_.rows[t_] = 16;                                 \
    }                                                     \
    _tile_loadconfig(&cfg_);                              \
  } while (0)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, ptr, stride) _tile_loadd(t, ptr, stride)
#define AMX_STORE(t, ptr, stride) _tile_stored(t, ptr, stride)
#define AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMX_RELEASE() _tile_release()

#endif

#endif /* TF_ATTENTION_AMX_TILE_H */
